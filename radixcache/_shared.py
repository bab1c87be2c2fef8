"""Helpers shared by both tree cores and the cache layer."""

from __future__ import annotations

import numpy as np
import torch

EMPTY_INDICES = torch.empty(0, dtype=torch.int64)


def indices_from_key(key: np.ndarray) -> torch.Tensor:
    """The index tensor of a node inserted without kv_indices: its tokens serve as indices."""
    # A copy: the key buffer is read-only and must never be written through a tensor.
    return torch.from_numpy(np.array(key, dtype=np.int64))


def reentered(what: str) -> RuntimeError:
    """The error for a call into a tree core (or its heap) while another call of it runs."""
    return RuntimeError(
        f"RadixCache re-entered from inside one of its own calls ({what} while another call "
        "was running): a token's __index__, an extra_key's __hash__/__eq__, a torch hook, a "
        "finalizer or another thread called into the cache; serialise calls (one thread, or "
        "a lock) and keep cache calls out of such hooks"
    )


def display_order(node) -> tuple:
    """Sort key for listing siblings: namespace, then tokens (the same on both cores)."""
    extra_key = node.extra_key
    return (extra_key is not None, repr(extra_key), node.key[:16].tolist())


def cat_values(path: list) -> torch.Tensor:
    """Concatenate the path's index tensors when some live on a device (CPU ones follow)."""
    values = [node.value for node in path]
    device = next(v.device for v in values if v.device.type != "cpu")
    return torch.cat([v.to(device) for v in values])


#: Eviction policy names (SGLang's spelling). Each core's ``EvictionHeap`` orders leaves by
#: priority first (lower goes first), then: lru/priority least recently used; lfu fewest hits,
#: then LRU; fifo oldest created; mru most recently used; filo newest created; slru nodes hit
#: fewer than 2 times before the rest, LRU inside each segment. Node id breaks every tie.
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")

#: Policies whose key can fall when a leaf is touched: the touched leaf is pushed anew.
KEY_FALLS_ON_ACCESS = frozenset({"mru"})

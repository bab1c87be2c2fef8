"""Helpers shared by both tree cores and the cache layer."""

from __future__ import annotations

import numpy as np
import torch



def empty_indices() -> torch.Tensor:
    """A new empty int64 tensor: the indices of a miss. Never a shared one: the caller may
    change a result in place (``set_``, ``unsqueeze_``), which must not show in any other.
    Its storage cannot grow, like a hit's (the compiled core's come from a DLPack block)."""
    return torch.from_numpy(np.empty(0, dtype=np.int64))


_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# The most locks a node can hold (the compiled core counts them in 32 bits; both cores refuse
# the lock past it).
MAX_LOCK_REF = 2**31 - 1


class MatchResult:
    """The longest cached prefix: its KV ``indices``, ``last_node`` and ``length``."""

    __slots__ = ("indices", "last_node", "length")

    def __init__(self, indices: torch.Tensor, last_node, length: int) -> None:
        self.indices = indices
        self.last_node = last_node
        self.length = length

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        """Drop the reference to the index tensor (the cache keeps its own copy)."""
        self.indices = empty_indices()

    def __enter__(self) -> "MatchResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"


class InsertResult:
    """``prefix_len`` leading tokens were cached already; ``last_node`` ends the sequence."""

    __slots__ = ("prefix_len", "last_node")

    def __init__(self, prefix_len: int, last_node) -> None:
        self.prefix_len = prefix_len
        self.last_node = last_node

    def __repr__(self) -> str:
        return f"InsertResult(prefix_len={self.prefix_len}, last_node={self.last_node!r})"


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


def cat_tensors(values: list) -> torch.Tensor:
    """Concatenate index tensors of which some live on a device (CPU ones move to it)."""
    device = next((v.device for v in values if v.device.type != "cpu"), None)
    if device is None:
        return torch.cat(values)
    return torch.cat([v.to(device) for v in values])


#: Eviction policy names (SGLang's spelling). Each core's ``EvictionHeap`` orders leaves by
#: priority first (lower goes first), then: lru/priority least recently used; lfu fewest hits,
#: then LRU; fifo oldest created; mru most recently used; filo newest created; slru nodes hit
#: fewer than 2 times before the rest, LRU inside each segment. Node id breaks every tie.
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")

#: Policies whose key can fall when a leaf is touched: the touched leaf is pushed anew.
KEY_FALLS_ON_ACCESS = frozenset({"mru"})

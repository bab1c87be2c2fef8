"""Names and defaults the command line needs, importable without torch or numpy (so that
``radixcache --help`` and argument errors answer at once): the modules that use them import
them from here."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from ._validate import check_int, check_real

# The docstrings under the names below are what the API reference shows for them.
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")
"""``RadixCache(eviction_policy=...)``: the eviction policy names (SGLang's spelling).

Each core's ``EvictionHeap`` orders leaves by priority first (lower goes first), then:
``lru``/``priority`` least recently used; ``lfu`` fewest hits, then LRU; ``fifo`` oldest
created; ``mru`` most recently used; ``filo`` newest created; ``slru`` nodes hit fewer than 2
times before the rest, LRU inside each segment. Node id breaks every tie.
"""

#: Policies whose key can fall when a leaf is touched: the touched leaf is pushed anew.
KEY_FALLS_ON_ACCESS = frozenset({"mru"})

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
"""``RadixCache(host_tier=True, write_policy=...)``: when a node gets its host copy.

``write_back`` (the default) when it is evicted from the device; ``write_through`` once it has
been hit (inserted through, or made) once; ``write_through_selective`` once hit twice.
"""

ARRAY_TYPES = ("torch", "numpy")
"""``RadixCache(array_type=...)``: what the cache's index arrays are.

``torch`` (the default): 1-D ``torch.int64`` tensors (on the values' device); ``numpy``: 1-D
int64 numpy arrays, and the cache never imports torch (simulators, engines without torch).
``KVPool`` and ``HostPool`` take the same names for what ``alloc`` returns.
"""

MAX_POOL_SLOTS = sys.maxsize // 8
"""The most token slots a pool may have (``KVPool``, ``HostPool``, and the command's
``--capacity`` and ``--host-capacity``): 2**60 - 1 on a 64-bit machine.

Slot ids are int64, and a list of them all (8 bytes each) must be an array this machine can
address (numpy's limit, ``sys.maxsize`` bytes). A pool keeps only the slots it hands out, so
its capacity costs nothing up to this limit.
"""

#: The ``Router`` policies, in the order the command lists them.
ROUTING_POLICIES = ("round-robin", "random", "least-loaded", "prefix-hash", "cache-aware")

#: ``Router``'s default weight of a worker's load (tokens queued or running) against the
#: prefill tokens a request would need there: 10 tokens of queued work weigh as much as one
#: token of prefill saved (chosen on the Mooncake trace, see docs/events-and-routing.md).
DEFAULT_LOAD_WEIGHT = 0.1

#: Prefill throughput per worker, tokens/s (an 8B model on one H100-class GPU, roughly).
DEFAULT_PREFILL_TPS = 20_000.0
#: Decode speed per running request, tokens/s.
DEFAULT_DECODE_TPS = 50.0
#: Arrival interval for traces without timestamps, ms.
DEFAULT_INTERVAL_MS = 100.0

#: Host-to-device load speed per worker, tokens/s, for KV loaded back from a host tier. An
#: 8B model of the Llama-3 shape (32 layers, 8 KV heads of 128 dims, K and V in fp16) holds
#: 32 * 8 * 128 * 2 * 2 = 128 KiB per token; 200,000 tokens/s is 26 GB/s, what a PCIe Gen4
#: x16 link (32 GB/s raw) carries in practice, or about half of a Gen5 x16 link's (64 GB/s
#: raw): on the safe side for an H100-class GPU, and 10x ``DEFAULT_PREFILL_TPS``.
DEFAULT_LOAD_TPS = 200_000.0
#: ``Router``'s default weight of a block held only on a worker's host tier, as a fraction of
#: a device block: a host hit costs a load instead of a prefill, so it saves
#: ``1 - DEFAULT_PREFILL_TPS / DEFAULT_LOAD_TPS`` = 0.9 of the prefill a device hit saves.
DEFAULT_HOST_WEIGHT = 1.0 - DEFAULT_PREFILL_TPS / DEFAULT_LOAD_TPS
#: The ``router`` name of the pooled-bound rows.
POOLED = "pooled"


@dataclass(frozen=True)
class EventLag:
    """How stale the router's view is: how late the workers' events reach it.

    Zero (the default): before the next routing decision. At most one of the two fields is
    non-zero. Written ``"N"`` (decisions) or ``"Nms"`` on the command line (``parse``).

    Attributes:
        requests: Events arrive this many routing decisions after they were published, an
            int >= 0.
        ms: Events arrive this many milliseconds (simulated time) after they were published,
            a finite number >= 0.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a negative or infinite field, or both fields non-zero.
    """

    requests: int = 0
    ms: float = 0.0

    def __post_init__(self) -> None:
        check_int(self.requests, "event lag requests", low=0)
        check_real(self.ms, "event lag ms", low=0)
        if self.requests and self.ms:
            raise ValueError("an event lag is either in requests or in ms, not both")

    @classmethod
    def parse(cls, text: str) -> "EventLag":
        """Read an event lag as the command line writes it.

        Args:
            text: ``"3"`` or ``"3req"`` (three routing decisions), or ``"50ms"`` (50 ms).

        Returns:
            The ``EventLag``.

        Raises:
            ValueError: ``text`` is neither form, or a lag in decisions is not whole.
        """
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(ms|req|requests)?\s*", text)
        if not match:
            raise ValueError(f"event lag {text!r}: expected N (requests), Nreq or Nms")
        number, unit = match.groups()
        if unit == "ms":
            return cls(ms=float(number))
        if "." in number:
            raise ValueError(f"event lag {text!r}: a lag in requests must be a whole number")
        return cls(requests=int(number))

    def __str__(self) -> str:
        return f"{self.ms:g}ms" if self.ms else f"{self.requests}"

"""The pure core's eviction heap: ``EvictionHeap``, the policies' sort keys and the nodes'
eviction ranks.

Part of the pure core (``_core_py``, whose docstring specifies the interface); the heap shares
its tree's guard.
"""

from __future__ import annotations

import heapq
from typing import Any

from ._errors import reentered
from ._tree_py import Guard, Node

__all__ = ["EvictionHeap", "device_leaf", "host_leaf"]

# Sort keys are single ints, fields packed most significant first (a heap of 10^6 leaves
# compares ints far faster than tuples). Every field fits 64 bits (priority is int64, times
# and ids are counters); the lowest field is the node id, so two nodes never tie.
_BIAS = 1 << 63      # int64 priority -> unsigned
_MAX = (1 << 64) - 1  # for "largest first" fields
#: A node's eviction rank sits above every policy field (the widest, lfu's, take 256 bits).
_RANK_SHIFT = 256


def _lru_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | (n._last_access_time << 64) | n._id


def _lfu_key(n: Node) -> int:
    return (((n._priority + _BIAS) << 192) | (n._hit_count << 128)
            | (n._last_access_time << 64) | n._id)


def _fifo_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | (n._created_time << 64) | n._id


def _mru_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | ((_MAX - n._last_access_time) << 64) | (_MAX - n._id)


def _filo_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | ((_MAX - n._created_time) << 64) | (_MAX - n._id)


def _slru_key(n: Node) -> int:
    # Probationary segment (hit < 2 times) before the protected one; LRU inside each.
    return (((n._priority + _BIAS) << 129) | ((n._hit_count >= 2) << 128)
            | (n._last_access_time << 64) | n._id)


def device_leaf(node: Node) -> bool:
    """With a host tier: a node the device heap may evict (on the device, not evicted,
    unlocked, no child on the device; the root is never pushed)."""
    if node._evicted or node._lock_ref or not node._on_device:
        return False
    for child in node._children.values():
        if child._on_device:
            return False
    return True


def host_leaf(node: Node) -> bool:
    """A node the host heap may evict: only on the host, not evicted, no children."""
    return (not node._on_device and node._host is not None and not node._evicted
            and not node._children)


def _ranked_key(policy_key: Any, ranks: dict) -> Any:
    """The sort key of a heap with ranks: the rank above the policy's fields."""
    def key(n: Node) -> int:
        rank = ranks.get(n)
        return policy_key(n) if rank is None else (rank << _RANK_SHIFT) | policy_key(n)
    return key


_POLICY_KEYS = {
    "lru": _lru_key, "lfu": _lfu_key, "fifo": _fifo_key, "mru": _mru_key,
    "filo": _filo_key, "slru": _slru_key, "priority": _lru_key,
}


class EvictionHeap:
    """Lazy min-heap of evictable leaves in ``policy`` order, kept across evict calls.

    ``push(node)`` when a node becomes an evictable leaf (or, for policies whose key can fall,
    when it is touched). ``pop_victim()`` returns the next evictable leaf whose key is still
    the one it was pushed with: entries of nodes that stopped being evictable leaves are
    dropped, entries whose key rose since are pushed again. The heap compacts itself when
    stale entries pile up, so it stays within twice the live entries (amortised O(1)).
    """

    __slots__ = ("_key", "_policy_key", "_ranks", "_heap", "_nodes", "_limit", "_enter",
                 "_leave", "_valid")

    def __init__(self, policy: str, guard: Guard | None = None, valid: Any = None) -> None:
        # valid(node): whether a node may be evicted now; None: an evictable leaf of a tree
        # without a host tier (unlocked, childless, not evicted), tested inline.
        self._valid = valid
        guard = Guard() if guard is None else guard  # the tree's: one guard for both
        self._enter = guard.acquire
        self._leave = guard.release
        self._policy_key = self._key = _POLICY_KEYS[policy]
        # node -> its eviction rank, for the ranks above 0 (the rest have 0). While any is
        # set, the sort key is (rank, policy key): self._key is a _ranked_key.
        self._ranks: dict = {}
        self._heap: list = []
        self._nodes: dict = {}  # key -> node; the heap itself holds bare int keys
        self._limit = 1024

    def clear(self) -> None:
        if not self._enter(False):
            raise reentered("clear")
        old = self._nodes  # released after the guard: finalizers may use the empty heap
        self._heap = []
        self._nodes = {}
        self._limit = 1024
        self._leave()
        del old

    def __len__(self) -> int:
        return len(self._heap)

    def key_of(self, node: Node) -> int:
        return self._key(node)

    def rank_of(self, node: Node) -> int:
        """``node``'s eviction rank (0 unless one was set)."""
        return self._ranks.get(node, 0)

    def _set_rank(self, node: Node, rank: int, push: bool = True) -> dict | None:
        """Set ``node``'s rank (an int in [0, 2^63), checked by the caller) without the
        guard. A lowered rank pushes the node again if it may be evicted now (a fall in key
        always comes with a fresh push; ``push`` false: the caller pushes it); returns what a
        compaction dropped."""
        ranks = self._ranks
        old = ranks.get(node, 0)
        if rank:
            if self._key is self._policy_key:
                self._key = _ranked_key(self._policy_key, ranks)
            ranks[node] = rank
        elif old:
            del ranks[node]
            if not ranks:
                self._key = self._policy_key
        if push and rank < old and self._may_go(node):
            return self._push(node)
        return None

    def _drop_rank(self, node: Node) -> None:
        """Forget the rank of a node that left the tree (without the guard)."""
        ranks = self._ranks
        if ranks and ranks.pop(node, None) is not None and not ranks:
            self._key = self._policy_key

    def _clear_ranks(self) -> dict:
        """Forget every rank (without the guard); returns the old table, to release later."""
        old = self._ranks
        self._ranks = {}
        self._key = self._policy_key
        return old

    def _may_go(self, node: Node) -> bool:
        """Whether ``node`` is an evictable leaf of this heap now (its pops' validity test)."""
        if self._valid is None:
            return not (node._evicted or node._children or node._lock_ref)
        return self._valid(node)

    def entries(self) -> list:
        """(stored key, node) of every live entry (for consistency checks)."""
        if not self._enter(False):
            raise reentered("entries")
        try:
            return list(self._nodes.items())
        finally:
            self._leave()

    def push(self, node: Node) -> None:
        if not self._enter(False):
            raise reentered("push")
        try:
            dropped = self._push(node)  # noqa: F841 -- released when the call returns
        finally:
            self._leave()

    def _push(self, node: Node) -> dict | None:
        """Push without the guard; returns what a compaction dropped (None if none ran)."""
        key = self._key(node)
        heapq.heappush(self._heap, key)
        self._nodes[key] = node
        if len(self._heap) > self._limit:
            return self._compact()
        return None

    def pop_victim(self) -> Node | None:
        if not self._enter(False):
            raise reentered("pop_victim")
        stale = []  # entries dropped here, released when the call returns
        try:
            return self._pop(stale)
        finally:
            self._leave()

    def _pop(self, stale: list) -> Node | None:
        """Pop without the guard; dropped entries' nodes go to ``stale``."""
        heap = self._heap
        nodes = self._nodes
        sort_key = self._key
        valid = self._valid
        while heap:
            stored = heapq.heappop(heap)
            node = nodes.pop(stored, None)
            if node is None:
                continue  # a duplicate of an entry already handled
            stale.append(node)
            if valid is None:
                if node._evicted or node._children or node._lock_ref:
                    continue  # pushed again if it becomes an evictable leaf
            elif not valid(node):
                continue
            current = sort_key(node)
            if current == stored:
                return node
            if current > stored:  # touched since pushed: wait for its turn
                heapq.heappush(heap, current)
                nodes[current] = node
            # else: a fall in key always came with a fresh push
        return None

    def _compact(self) -> dict:
        """Keep one usable entry per leaf; returns the old table for the caller to release."""
        sort_key = self._key
        valid = self._valid
        best: dict = {}
        for stored, node in self._nodes.items():
            if valid is None:
                if node._evicted or node._children or node._lock_ref:
                    continue
            elif not valid(node):
                continue
            if stored <= sort_key(node) and (node._id not in best or stored < best[node._id][0]):
                best[node._id] = (stored, node)
        old = self._nodes
        self._nodes = dict(best.values())
        self._heap = list(self._nodes)
        heapq.heapify(self._heap)
        self._limit = max(1024, 2 * len(self._heap))
        return old

"""Blocks credited to an instance by a placement whose KV events have not arrived yet.

When a request is placed (a pick of the Endpoint Picker, a ``/select`` with a
``request_id``), the instance chosen will hold the prompt's blocks as soon as it prefills
it, but its events for them reach the index some time later. A follow-up turn sent the
moment the answer arrives can come before them, and would then be ranked as if the
conversation were cached nowhere. So the placement credits the prompt's blocks to the
chosen worker provisionally: an entry of this table, which ranking counts as if the worker
held the blocks on its device, and which goes away as soon as the worker's own events show
the blocks (the last block of the prompt held: the engines store a prompt's blocks in
order), or when its time to live passes, or when the table is full (the oldest first).

The table never touches the index: ``/query`` answers only what the events said.

Keys are the index's own block keys (``KvIndexer.block_keys``), which chain each block to
the ones before it, so a worker's pending keys are closed under prefixes: each key is
counted once per entry holding it, and ``depth`` finds how far a prompt's chain runs
through them by bisection.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional


class _Entry:
    __slots__ = ("alive", "expires", "keys", "table", "worker")

    def __init__(self, table: "PendingTable", worker: Any, keys: list, expires: float) -> None:
        self.table, self.worker, self.keys, self.expires = table, worker, keys, expires
        self.alive = True


class PendingTable:
    """One group's provisional holdings: ``counts`` maps a worker to ``{key: how many of its
    entries hold the key}``; ``entries`` a worker to its live entries."""

    __slots__ = ("counts", "entries")

    def __init__(self) -> None:
        self.counts: dict = {}
        self.entries: dict = {}

    def __bool__(self) -> bool:
        return bool(self.counts)

    def depths(self, keys: list) -> dict:
        """``{worker: leading keys of keys pending for it}`` (workers with at least one)."""
        out = {}
        if not keys:
            return out
        first = keys[0]
        for worker, counts in self.counts.items():
            if first not in counts:
                continue
            low, high = 1, len(keys)  # keys[:low] pending: find the largest such low
            while low < high:
                mid = (low + high + 1) // 2
                if keys[mid - 1] in counts:
                    low = mid
                else:
                    high = mid - 1
            out[worker] = low
        return out


class PendingBlocks:
    """The provisional holdings of every group (module docstring): the entries in the order
    they expire, and what was added, confirmed and expired (for the metrics). Not
    thread-safe: the service's lock guards it.

    Args:
        ttl: Seconds an entry lives at most (> 0).
        max_entries: The most entries kept; the oldest go first.
    """

    def __init__(self, ttl: float, max_entries: int = 1024) -> None:
        if not ttl > 0:
            raise ValueError(f"the pending blocks' time to live must be > 0 s, got {ttl}")
        self.ttl = float(ttl)
        self.max_entries = int(max_entries)
        self._order: collections.deque = collections.deque()  # entries, oldest first
        self._live = 0
        self.added = 0
        self.confirmed = 0
        self.expired = 0

    def __len__(self) -> int:
        return self._live

    def add(self, table: PendingTable, worker: Any, keys: list,
            now: Optional[float] = None) -> None:
        """Credit ``keys`` (a prompt's block keys, in order) to ``worker`` in ``table``."""
        if not keys:
            return
        now = time.monotonic() if now is None else now
        self.expire(now)
        while self._live >= self.max_entries:
            oldest = self._order.popleft()
            if oldest.alive:
                self._drop(oldest)
                self.expired += 1
        entry = _Entry(table, worker, keys, now + self.ttl)
        counts = table.counts.get(worker)
        if counts is None:
            counts = table.counts[worker] = {}
        get = counts.get
        for key in keys:
            counts[key] = get(key, 0) + 1
        self._order.append(entry)
        table.entries.setdefault(worker, []).append(entry)
        self._live += 1
        self.added += 1

    def expire(self, now: Optional[float] = None) -> None:
        """Drop the entries whose time is up."""
        order = self._order
        if not order:
            return
        now = time.monotonic() if now is None else now
        while order and (not order[0].alive or order[0].expires <= now):
            entry = order.popleft()
            if entry.alive:
                self._drop(entry)
                self.expired += 1

    def confirm(self, table: PendingTable, worker: Any, holds: Any) -> None:
        """Drop ``worker``'s entries whose last key ``holds(key)`` says it now holds (its
        events arrived: an engine stores a prompt's blocks in order)."""
        for entry in list(table.entries.get(worker, ())):
            if holds(entry.keys[-1]):
                self._drop(entry)
                self.confirmed += 1

    def confirm_held(self, table: PendingTable, worker: Any, keys: list, held: int) -> None:
        """Drop ``worker``'s entries that lie within ``keys[:held]``, a prompt's leading
        blocks the index says the worker holds (the keys chain: an entry lies there when
        its last key is the prompt's key at the same depth)."""
        for entry in list(table.entries.get(worker, ())):
            n = len(entry.keys)
            if n <= held and entry.keys[-1] == keys[n - 1]:
                self._drop(entry)
                self.confirmed += 1

    def forget(self, table: PendingTable, worker: Any = None) -> None:
        """Drop ``worker``'s entries in ``table`` (None: every worker's)."""
        for who in ([worker] if worker is not None else list(table.entries)):
            for entry in list(table.entries.get(who, ())):
                self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        if not entry.alive:
            return
        entry.alive = False
        self._live -= 1
        table, worker = entry.table, entry.worker
        counts = table.counts.get(worker)
        if counts is not None:
            for key in entry.keys:
                left = counts.get(key, 0) - 1
                if left > 0:
                    counts[key] = left
                else:
                    counts.pop(key, None)
            if not counts:
                del table.counts[worker]
        entries = table.entries.get(worker)
        if entries is not None:
            entries.remove(entry)
            if not entries:
                del table.entries[worker]
        entry.keys = ()  # a dead entry may wait in the order a while: not with its keys

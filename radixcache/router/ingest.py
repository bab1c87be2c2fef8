"""``KvIndexer``'s ingest: a worker's events (objects, wire payloads, or an in-process
cache's block-key records) applied to its copies' holdings, each count in ``IndexerStats``.
A payload the block module reads whole (``read_wire``) is applied there in one call per run
of events (``apply_wire``); the rest event by event here.
"""

from __future__ import annotations

import operator
from array import array
from typing import Any, Hashable, Iterable, Optional

from .. import _core
from .._validate import check_int, is_int, wrap_int64
from ..events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    TokenIds,
    decode_batch,
    encode_namespace,
)
from ..events.wire import _event_of, _transport, _typed_events, _typed_kinds
from ..events.recorder import KEYS_STORED
from .copies import CopyTable, _Copy
from .keys import (
    _HASH_TYPES,
    _all_hash_types,
    _entry,
    _event_group,
    _event_medium,
    _event_namespace,
    _event_token_bytes,
    _has_entries,
    _is_key_record,
    _msgpack_ids,
    _named_namespace,
    _namespace_bytes,
    _namespace_entry,
    _root_key,
    _tier,
    chain_keys,
)
from .stats import IndexerStats

_DECODER = [False]  # whether decode_batch's optional dependencies were found


def _own_keys(hashes: Any, keys: list) -> bool:
    """Whether each hash is its block's own key, as an int taken modulo 2**64 (a publisher
    that spells its 64-bit hashes unsigned sends ``key + 2**64`` for a negative key)."""
    return bool(keys) and type(hashes[0]) is int and wrap_int64(hashes[0]) == keys[0] and all(
        type(h) is int and wrap_int64(h) == key for h, key in zip(hashes, keys))


class EventIngest(CopyTable):
    """Events applied to the copies' holdings (see the module docstring): the in-process
    index ``KvIndexer`` answers from, and the view a store-backed one applies batches to."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = check_int(block_size, "block_size", 1)
        self._page_bytes = self.block_size * 8
        # a payload's batch read and applied in one call each (the block module's)
        self._read_wire = _core.blocks.read_wire
        self._apply_wire = _core.blocks.apply_wire
        self._root_seed = _root_key(encode_namespace(None))  # a chain's seed, no namespace
        self.stats = IndexerStats()

    # -- events ------------------------------------------------------------------------
    def _apply_events(self, worker: Hashable, events: Iterable[Any]) -> None:
        """``KvIndexer.apply`` in this process: one batch of ``worker``'s events."""
        self._check_worker(worker)
        stats = self.stats
        stats.batches += 1
        if isinstance(events, ReceivedBatch):
            if events.restarted:
                self._clear_worker(worker)
                stats.restarts += 1
            events = events.events
        try:
            events = list(events)
        except TypeError:
            stats.malformed_batches += 1
            return
        for event in events:
            stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear_worker(worker)
                stats.cleared += 1
            else:
                stats.malformed_events += 1

    def _apply_payload(self, worker: Hashable, payload: bytes, seq: int = -1) -> bool:
        """``KvIndexer.apply_payload`` in this process: one wire payload's batch."""
        self._check_worker(worker)
        if not _DECODER[0]:  # what the block module leaves is decoded: msgspec is needed
            _transport("decode_batch")  # ImportError, before anything is applied
            _DECODER[0] = True
        batch = self._read_wire(payload) if type(payload) is bytes else None
        if batch is not None:
            self._apply_batch(worker, batch, payload)
            return True
        events = _typed_events(payload)
        if events is None:  # not one the typed decoder takes: read field by field
            return self._apply_checked(worker, payload, seq)
        # Checked by the decoder but for the token ids, read here from their msgpack bytes
        # (any batch with ids that are not all int64s is read field by field above); then
        # its structs are read as the events they decode to (the same fields, lists for
        # tuples), but those with extra keys, made into events.
        stored, removed = _typed_kinds()
        for event in events:
            if type(event) in stored:
                ids = _msgpack_ids(bytes(event.token_ids))
                if ids is None:
                    return self._apply_checked(worker, payload, seq)
                event.token_ids = TokenIds(ids)
        stats = self.stats
        stats.batches += 1
        for event in events:
            stats.events += 1
            kind = type(event)
            if kind in stored:
                self._stored(worker, event if event.extra_keys is None else _event_of(event))
            elif kind in removed:
                self._removed(worker, event)
            else:
                self._clear_worker(worker)
                stats.cleared += 1
        return True

    def _apply_payloads(self, worker: Hashable, payloads: list) -> int:
        """``KvIndexer.apply_payloads`` in this process: a run of one worker's wire payloads,
        in order; how many were applied (the others malformed, counted)."""
        self._check_worker(worker)
        if not _DECODER[0]:  # as _apply_payload: before anything is applied
            _transport("decode_batch")
            _DECODER[0] = True
        read, apply_batch = self._read_wire, self._apply_batch
        applied = 0
        for payload in payloads:
            batch = read(payload) if type(payload) is bytes else None
            if batch is None:
                applied += self._apply_payload(worker, payload)
            else:
                apply_batch(worker, batch, payload)
                applied += 1
        return applied

    def _apply_batch(self, worker: Hashable, batch: Any, payload: bytes) -> None:
        """Apply a batch the block module read (``read_wire``): its events in order, as
        many at a time as the block module applies in one call (``apply_wire``), any other
        one (a clear, a parent on another tier, holdings both ways) here, from the events
        ``decode_batch`` reads from the same payload."""
        stats = self.stats
        stats.batches += 1
        n = len(batch)
        medium = batch.medium
        tier = MEDIUM_GPU if medium is None or medium == MEDIUM_GPU else _tier(medium)
        group = batch.group or None  # _group, inline (a batch's every time)
        start = 0
        events = None
        while True:
            start = self._apply_run(worker, batch, start, tier, group)
            if start >= n:
                return
            if events is None:
                events = decode_batch(payload).events
            event = events[start]
            stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event)
            else:
                self._clear_worker(worker)
                stats.cleared += 1
            start += 1

    def _apply_run(self, worker: Hashable, batch: Any, start: int, tier: str,
                   group: Any) -> int:
        """Apply ``batch``'s events from ``start`` to ``worker``'s copy on (``tier``,
        ``group``) in one call into the block module, up to the first it leaves to
        ``_apply_batch``; returns where it stopped."""
        current = self._copies.get(worker)
        if type(current) is _Copy:  # the usual case: one copy
            if current.medium == tier and current.group == group:
                copy, alone = current, True
            else:
                copy, alone = None, current.group != group
        elif current is None:
            copy, alone = None, True  # no other copy may hold a parent
        else:
            copy = current.get((tier, group))
            alone = not any(other.group == group for other in current.values()
                            if other is not copy)
        if copy is None:
            # made first (and forgotten below if it holds nothing): a worker id's own code
            # runs while it is made, never between the call and the copy it fills
            copy = self._copy(worker, tier, group)
        elif copy.refs is not None:
            return start  # held both ways: one event at a time
        published, direct = copy.published, copy.direct
        before = direct + len(published)
        (end, stored, duplicates, removed, unknown_removals, unknown_parent,
         wrong_block_size, malformed, direct) = self._apply_wire(
            self._index, batch, start, published, copy.cid, direct, self.block_size,
            self._root_seed, alone, bool(self._ns_of))
        copy.direct = direct
        after = direct + len(published)
        self._held += after - before
        if not after:
            self._forget_if_empty(copy)
        stats = self.stats
        stats.events += end - start
        if stored or duplicates:
            stats.stored_blocks += stored
            stats.duplicate_blocks += duplicates
        if removed or unknown_removals:
            stats.removed_blocks += removed
            stats.unknown_removals += unknown_removals
            if self._ns_of:
                self._prune_namespaces()
        if unknown_parent or wrong_block_size or malformed:
            stats.unknown_parent += unknown_parent
            stats.wrong_block_size += wrong_block_size
            stats.malformed_events += malformed
        return end

    def _apply_checked(self, worker: Hashable, payload: Any, seq: int) -> bool:
        try:
            batch = decode_batch(payload, seq)
        except (ValueError, TypeError):
            self.stats.malformed_batches += 1
            return False
        self._apply_events(worker, batch.events)
        return True

    def _apply_keys(self, worker: Hashable, records: Iterable[Any]) -> None:
        """``KvIndexer.apply_keys`` in this process: one batch of block-key records."""
        self._check_worker(worker)
        stats = self.stats
        stats.batches += 1
        if type(records) is not list:  # take_events() gives a list: no copy
            try:
                records = list(records)
            except TypeError:
                stats.malformed_batches += 1
                return
        index = self._index
        stats.events += len(records)
        # The worker's device copy, found once per batch and kept in step as records make
        # or drop it (the one place these records go).
        copy = self._find(worker, MEDIUM_GPU, None)
        for record in records:
            if type(record) is not tuple:
                if isinstance(record, AllBlocksCleared):
                    self._clear_worker(worker)
                    copy = None
                    stats.cleared += 1
                else:
                    stats.malformed_events += 1
                continue
            if not _is_key_record(record):
                stats.malformed_events += 1
                continue
            keys = record[1]
            if record[0] == KEYS_STORED:
                parent = record[2]
                if parent is not None and (copy is None or self._key_of(copy, parent) is None):
                    stats.unknown_parent += 1
                    continue
                if not keys:
                    continue  # no full block: nothing held, as ``apply`` does
                if copy is None:
                    copy = self._copy(worker, MEDIUM_GPU, None)
                if copy.published:  # also fed events under other hashes
                    keys = array("q", keys).tolist()  # native order, as written
                    before = copy.size
                    stored, duplicates = self._store_each(copy, keys, keys)
                    self._held += copy.size - before
                else:
                    stored, duplicates = index.store(copy.cid, keys)
                    copy.direct += stored
                    self._held += stored
                stats.stored_blocks += stored
                stats.duplicate_blocks += duplicates
            else:
                if copy is None:
                    stats.unknown_removals += len(keys) // 8
                elif copy.published:  # also fed events under other hashes: the general path
                    self._removed(worker, BlockRemoved(
                        tuple(array("q", keys)), MEDIUM_GPU))  # native order, as written
                    copy = self._find(worker, MEDIUM_GPU, None)  # it may have been dropped
                else:
                    removed, unknown = index.remove(copy.cid, keys)
                    copy.direct -= removed
                    self._held -= removed
                    stats.removed_blocks += removed
                    stats.unknown_removals += unknown
                    if not copy.direct:  # holding nothing: dropped
                        self._forget_if_empty(copy)
                        copy = None

    def _stored(self, worker: Hashable, event: BlockStored) -> None:
        stats = self.stats
        hashes = event.block_hashes
        token_ids = event.token_ids
        block_size = event.block_size
        if not is_int(block_size):
            stats.malformed_events += 1  # e.g. an array, whose != is not a truth value
            return
        if block_size != self.block_size:
            stats.wrong_block_size += 1
            return
        try:
            medium = _event_medium(event)
            group = _event_group(event)
            data = _event_token_bytes(token_ids)
            if len(data) != len(hashes) * self._page_bytes:
                raise ValueError("token_ids do not fill the blocks")
            copy = self._find(worker, medium, group)
            parent = event.parent_block_hash
            extra_keys = getattr(event, "extra_keys", None)
            if parent is None:
                namespace = _event_namespace(event)
                key = _root_key(_namespace_bytes(namespace))
                ns_entry = _entry(extra_keys[0]) if _has_entries(extra_keys) else None
            else:
                key = None if copy is None else self._key_of(copy, parent)
                if key is None:
                    key = self._parent_on_other_tier(worker, group, copy, parent)
                if key is None:
                    stats.unknown_parent += 1
                    return
                ns_entry = None
                if extra_keys:
                    # The sequence's namespace: as remembered for the parent, else as this
                    # event names it (its root may have come without extra keys, SGLang's
                    # way: every engine's store event names its adapter and salt).
                    ns_entry = self._ns_of.get(key)
                    if ns_entry is None:
                        ns_entry = _namespace_entry(_named_namespace(event))
            keys = self._chain_keys(key, data, extra_keys, ns_entry)
            if ns_entry is not None and extra_keys:
                # A later event below these blocks tells their extra keys from the
                # namespace's by it.
                self._ns_of.update(dict.fromkeys(keys, ns_entry))
            # Published under the indexer's own keys (a fast64 publisher), or checked hashes.
            identity = keys == list(hashes)
            if not identity:
                if not _all_hash_types(hashes):
                    hashes = [h if type(h) in _HASH_TYPES else operator.index(h)
                              for h in hashes]
                identity = _own_keys(hashes, keys)
        except (TypeError, ValueError, OverflowError, LookupError, RecursionError):
            # LookupError: extra_keys[0]; RecursionError: a hand-built, absurdly deep namespace
            stats.malformed_events += 1
            return
        if not keys:
            return
        if copy is None:
            copy = self._copy(worker, medium, group)
        before = copy.size
        try:
            self._store_into(copy, hashes, keys, identity)
        finally:
            self._held += copy.size - before

    def _store_into(self, copy: _Copy, hashes: Any, keys: list, identity: bool) -> None:
        stats = self.stats
        published = copy.published
        if identity and not published:
            # Every holding under its own key: the blocks this copy does not hold yet, in
            # one call.
            stored, duplicates = self._index.store(copy.cid, keys)
            copy.direct += stored
            stats.stored_blocks += stored
            stats.duplicate_blocks += duplicates
            return
        if not identity and not copy.direct and (
                published.add_new(hashes, keys) if copy.refs is None
                else published.isdisjoint(hashes)):
            # New hashes (the common case): in bulk, mapped already when no refs are kept.
            if copy.refs is not None:
                for block_hash, key in zip(hashes, keys):
                    self._publish(copy, block_hash, key)
            self._index.add(copy.cid, keys)
            stats.stored_blocks += len(keys)
            return
        stored, duplicates = self._store_each(copy, hashes, keys)
        stats.stored_blocks += stored
        stats.duplicate_blocks += duplicates

    def _store_each(self, copy: _Copy, hashes: Any, keys: list) -> tuple:
        """Hold ``keys[i]`` for ``copy`` under publisher hash ``hashes[i]``, one at a time:
        a hash already held for the same key is a duplicate, for another key it is moved
        (the publisher reused it: the newer block wins). Returns (stored, duplicates)."""
        stored = duplicates = 0
        index, cid = self._index, copy.cid
        for block_hash, key in zip(hashes, keys):
            known = copy.published.get(block_hash)
            own = False
            if known is None:
                known = self._own(copy, block_hash)
                own = known is not None
            if known is not None:
                if known == key:
                    duplicates += 1
                    continue
                if own:
                    copy.direct -= 1
                else:
                    self._unpublish(copy, block_hash)
                index.unhold(known, cid)
            if type(block_hash) is int and wrap_int64(block_hash) == key:
                copy.direct += 1  # its own key (modulo 2**64, as every int hash)
            else:
                self._publish(copy, block_hash, key)
            index.hold(key, cid)
            stored += 1
        return stored, duplicates

    def _removed(self, worker: Hashable, event: BlockRemoved) -> None:
        stats = self.stats
        try:
            medium = _event_medium(event)
            group = _event_group(event)
            hashes = event.block_hashes
            try:
                array("q", hashes)  # every hash an int64 (cheaper than checking each type)
            except (TypeError, OverflowError):
                if not _all_hash_types(hashes):
                    hashes = [h if type(h) in _HASH_TYPES else operator.index(h)
                              for h in hashes]
        except TypeError:
            stats.malformed_events += 1
            return
        copy = self._find(worker, medium, group)
        if copy is None:
            stats.unknown_removals += len(hashes)
            return
        removed = unknown = 0
        before = copy.size
        if not copy.published:
            # Every block held under its own key: one call.
            if type(hashes) is not list and type(hashes) is not tuple:
                hashes = list(hashes)
            try:
                removed, unknown = self._index.remove(copy.cid, hashes)
            except (TypeError, OverflowError):  # a hash that is no int64 key: not held
                for block_hash in hashes:
                    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
                        block_hash = int(block_hash)
                    key = self._own(copy, block_hash)
                    if key is not None:
                        self._index.unhold(key, copy.cid)
                        removed += 1
                    else:
                        unknown += 1
            copy.direct -= removed
        else:
            for block_hash in hashes:
                key = self._unpublish(copy, block_hash)
                if key is None:
                    if type(block_hash) is not int and isinstance(block_hash, int) \
                            and not isinstance(block_hash, bool):
                        block_hash = int(block_hash)
                    key = self._own(copy, block_hash)
                    if key is None:
                        unknown += 1
                        continue
                    copy.direct -= 1
                self._index.unhold(key, copy.cid)
                removed += 1
        self._held += copy.size - before
        stats.removed_blocks += removed
        stats.unknown_removals += unknown
        self._forget_if_empty(copy)
        if self._ns_of:
            self._prune_namespaces()

    def _chain_keys(self, seed: int, data: bytes, extra_keys: Any,
                    ns_entry: Optional[tuple]) -> list:
        """The keys of the blocks of ``data`` below ``seed`` (``chain_keys``)."""
        return chain_keys(self._page_bytes, seed, data, extra_keys, ns_entry)


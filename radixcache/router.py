"""Routing requests across workers: a KV-aware block index fed by events, and routing policies.

``KvIndexer`` mirrors which blocks each worker's prefix cache holds, learned only from the
KV events the workers publish (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, as
``RadixCache.take_events()`` returns them or as ``ZmqEventSubscriber.receive()`` delivers
them; ``apply_payload`` decodes a raw wire payload). ``overlap(tokens, extra_key)`` says how
many leading blocks of a request each worker holds.

Block keys are computed by the indexer itself, not taken from the publisher: a block's key
chains its parent's key and the block's token ids (and, for a sequence's first block, the
namespace), so any publisher that sends token ids (radixcache, vLLM, SGLang) indexes the
same way and a query hashes its tokens the same way. Per copy (a worker's blocks on one
tier, ``medium``, in one KV-cache group, ``group_idx``), a map from the publisher's block
hash to the indexer's key resolves ``parent_block_hash`` and ``BlockRemoved``. The keys are
the ``fast64`` block hash (``radixcache.events.BLOCK_HASHES``: the block module's
``page_hash_chain``, compiled when built, seeded by the namespace), so a publisher recording
with ``block_hash="fast64"`` sends the indexer's own keys: checked against the token ids,
such blocks need no map entry. The keys are 64-bit and not collision resistant: a hostile
publisher could make two prefixes share keys; feed the index from trusted workers.
Memory is proportional to the (block, copy) pairs held: one entry per pair in that map and
one per distinct block in the block module's block table (``BlockIndex``, compiled when built:
16 bytes a slot, and a short list when several copies hold the block), freed when its last
holder removes it; a worker that holds nothing keeps nothing. Stores, removals and overlap
queries are one call into that table each (a query hashes its blocks there, as far as any
worker's run of held blocks goes).

Bad input from the wire never raises: an event that cannot be applied (a removal of an
unknown block, a stored block whose parent is unknown, a wrong block size, a malformed event
or payload) is skipped and counted in ``stats``.

``Router`` picks a worker per request with one of ``ROUTING_POLICIES``; ``cache-aware``
scores each worker by the prefill it would still need after its cached overlap (from the
indexer) plus a weighted load, as NVIDIA Dynamo's KV router does. Load is reported by the
caller (``add_load``/``remove_load``, in tokens of work queued or running).
"""

from __future__ import annotations

import hashlib
import numbers
import operator
import random
import sys
from array import array
from bisect import bisect_right
from dataclasses import dataclass, fields
from typing import Any, Hashable, Iterable, Optional


from . import _core
from ._options import DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from ._options import DEFAULT_HOST_WEIGHT
from .events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    TokenIds,
    _fast_root,
    decode_batch,
    encode_namespace,
    tokens_le_bytes,
)

__all__ = ["DEFAULT_LOAD_WEIGHT", "ROUTING_POLICIES", "IndexerStats", "KvIndexer", "Router"]

_LITTLE_ENDIAN = sys.byteorder == "little"
_KEYS_STORED = 0  # _keyfeed.STORED (a record's tag)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# A publisher's block hashes are only looked up, never computed with: vLLM sends ints or
# bytes (its ExternalBlockHash).
_HASH_TYPES = (int, bytes)

# DEFAULT_LOAD_WEIGHT and ROUTING_POLICIES live in _options (the command line reads them).

#: ``Router``'s block size (tokens per block) when neither it nor an indexer is given.
DEFAULT_BLOCK_SIZE = 16



@dataclass
class IndexerStats:
    """What ``KvIndexer`` applied and what it had to skip (counts since creation).

    Attributes:
        batches: Event batches applied (``apply`` calls).
        events: Events seen.
        stored_blocks: Blocks added for a worker.
        removed_blocks: Blocks removed for a worker.
        cleared: ``AllBlocksCleared`` events applied.
        duplicate_blocks: Blocks stored again by a worker that already held them (no change).
        unknown_parent: ``BlockStored`` events skipped because their parent block is unknown.
        unknown_removals: Removed blocks the worker was not known to hold.
        wrong_block_size: ``BlockStored`` events skipped: not the indexer's block size.
        malformed_events: Events skipped: not an event, or inconsistent fields.
        malformed_batches: Wire payloads that could not be decoded.
        restarts: Restarted publishers whose blocks were dropped.
    """

    batches: int = 0             #: event batches applied (``apply`` calls)
    events: int = 0              #: events seen
    stored_blocks: int = 0       #: blocks added for a worker
    removed_blocks: int = 0      #: blocks removed for a worker
    cleared: int = 0             #: ``AllBlocksCleared`` applied
    duplicate_blocks: int = 0    #: stored again by a worker that already held it (no change)
    unknown_parent: int = 0      #: ``BlockStored`` skipped: its parent block is unknown
    unknown_removals: int = 0    #: removed blocks the worker was not known to hold
    wrong_block_size: int = 0    #: ``BlockStored`` skipped: not the indexer's block size
    malformed_events: int = 0    #: events skipped: not an event, or inconsistent fields
    malformed_batches: int = 0   #: wire payloads that could not be decoded
    restarts: int = 0            #: restarted publishers whose blocks were dropped

    @property
    def skipped(self) -> int:
        """Events or blocks that could not be applied."""
        return (self.unknown_parent + self.unknown_removals + self.wrong_block_size
                + self.malformed_events + self.malformed_batches)

    def as_dict(self) -> dict:
        """The counts by name.

        Returns:
            ``{field name: count}`` for every field, in declaration order.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _all_hash_types(hashes: Any) -> bool:
    return set(map(type, hashes)) <= _HASH_TYPE_SET


_HASH_TYPE_SET = set(_HASH_TYPES)


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _event_token_bytes(token_ids: Any) -> bytes:
    """An event's token ids as int64 little-endian bytes; a tuple or list (what events hold)
    goes through ``array('q')``, cheaper than numpy for Python ints."""
    if type(token_ids) is TokenIds:
        return token_ids.le_bytes
    if _LITTLE_ENDIAN and type(token_ids) in (tuple, list):
        return array("q", token_ids).tobytes()  # TypeError/OverflowError for non-int64 items
    return tokens_le_bytes(token_ids)


def _root_key(namespace: bytes) -> int:
    # The chain of a sequence starts from its namespace, so equal tokens in two namespaces
    # get different keys: the seed of the fast64 block hash, so a fast64 publisher's hashes
    # are the indexer's keys.
    return _fast_root(namespace)


# Block keys: the block module's page hash chain (compiled when built), seeded by the namespace.
_page_keys = _core.blocks.page_hash_chain


def _event_namespace(event: BlockStored) -> Any:
    """The namespace of a stored event's blocks: ``extra_keys`` when the publisher sends it.

    vLLM's layout carries ``extra_keys`` per block (None, or a tuple of keys); a subtree never
    mixes namespaces, so the first block's entry stands for the event. A one-element entry
    is that element. Without the field, the namespace is None.
    """
    extra_keys = getattr(event, "extra_keys", None)
    if not extra_keys:
        return None
    first = extra_keys[0]
    if isinstance(first, (list, tuple)):
        if len(first) == 0:
            return None
        if len(first) == 1:
            return first[0]
        return tuple(first)
    return first


def _namespace_bytes(namespace: Any) -> bytes:
    try:
        return encode_namespace(namespace)
    except TypeError:
        # A publisher may send any msgpack value; a stable spelling keeps it a namespace.
        return b"R" + repr(namespace).encode("utf-8", "surrogatepass")


class _Copy:
    """One worker's blocks on one tier and KV-cache group: ``(worker, medium, group)``."""

    __slots__ = ("worker", "medium", "group", "published", "size", "cid")

    def __init__(self, worker: Hashable, medium: str, group: Any) -> None:
        self.worker = worker
        self.medium = medium
        self.group = group
        # publisher hash -> indexer key, for hashes that are not the key itself; a block
        # published under its own key (a ``fast64`` publisher) is held without an entry
        self.published: dict = {}
        self.size = 0  # (publisher hash, block) pairs held
        self.cid = -1  # its id in the indexer's BlockIndex, set by KvIndexer._copy

    def __repr__(self) -> str:
        return f"_Copy({self.worker!r}, {self.medium!r}, {self.group!r})"


def _event_medium(event: Any) -> str:
    """An event's tier: its ``medium``, ``"GPU"`` (the device tier) when it names none."""
    medium = getattr(event, "medium", None)
    if medium is None:
        return MEDIUM_GPU
    if not isinstance(medium, str):
        raise TypeError("medium must be a str or None")
    return medium


def _event_group(event: Any) -> Any:
    group = getattr(event, "group_idx", None)
    if group is not None:
        if isinstance(group, bool) or not isinstance(group, numbers.Integral):
            raise TypeError("group_idx must be an int or None")
        group = int(group)
    return group


class KvIndexer:
    """Which blocks each worker holds, learned from its KV events; see the module docstring.

    Workers are any hashable ids. Apply each worker's batches in the order it published them:
    ``apply(worker, events)`` for event objects, ``apply_payload(worker, payload, seq)`` for
    a raw msgpack payload. ``len(indexer)`` is the number of distinct blocks held. Not
    thread-safe: serialise ``apply`` with the queries.

    Blocks are held per copy: a worker's blocks on one tier (the event's ``medium``,
    ``"GPU"`` when it names none) in one KV-cache group (``group_idx``). A removal removes
    that copy only, and a block stays held while any of the copy's publisher hashes maps to
    it. ``overlap`` counts the device tier (``"GPU"``) by default, any group; ``medium=``
    reports another tier. Memory is one entry per (block, copy) and one per distinct block;
    a worker holding nothing costs nothing.

    Args:
        block_size: The workers' page size (tokens per block), an int >= 1. Events of
            another block size are skipped and counted.

    Raises:
        TypeError: ``block_size`` is not an int.
        ValueError: ``block_size`` < 1.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = _check_block_size(block_size)
        self._page_bytes = self.block_size * 8
        # indexer key -> the ids (``_Copy.cid``) of the copies holding it, a copy once per
        # publisher hash that maps to the block: the block module's BlockIndex (compiled when
        # built); copy ids are reused once their copy is dropped
        self._index = _core.blocks.BlockIndex()
        self._free_cids: list = []
        self._next_cid = 0
        self._owner_tables: dict = {}  # medium -> (owners by copy id, workers); see _owners
        self._cid_version = 0  # changes with the copies (the owner tables' validity)
        # worker -> its _Copy, or {(medium, group): _Copy} when it has several; only copies
        # holding at least one block
        self._copies: dict = {}
        self.stats = IndexerStats()

    # -- workers -----------------------------------------------------------------------
    @staticmethod
    def _check_worker(worker: Hashable) -> None:
        try:
            hash(worker)
        except TypeError:
            raise TypeError(f"worker must be a hashable id, got {type(worker).__name__}") from None
        if worker is None:
            raise TypeError("worker must be a hashable id, not None")

    def _copy(self, worker: Hashable, medium: str, group: Any) -> _Copy:
        """``worker``'s copy on (medium, group), made when missing."""
        copy = self._find(worker, medium, group)
        if copy is None:
            copy = _Copy(worker, medium, group)
            self._new_cid(copy)
            current = self._copies.get(worker)
            if current is None:
                self._copies[worker] = copy  # one copy: no map of them (the usual case)
            elif type(current) is _Copy:
                self._copies[worker] = {(current.medium, current.group): current,
                                        (medium, group): copy}
            else:
                current[(medium, group)] = copy
        return copy

    def _find(self, worker: Hashable, medium: str, group: Any) -> Optional[_Copy]:
        current = self._copies.get(worker)
        if type(current) is _Copy:
            return current if current.medium == medium and current.group == group else None
        return None if current is None else current.get((medium, group))

    def _copies_of(self, worker: Hashable) -> list:
        current = self._copies.get(worker)
        if current is None:
            return []
        return [current] if type(current) is _Copy else list(current.values())

    def _all_copies(self) -> list:
        return [c for w in self._copies for c in self._copies_of(w)]

    def _forget_if_empty(self, copy: _Copy) -> None:
        if not copy.size:
            self._drop_cid(copy)
            current = self._copies.get(copy.worker)
            if current is copy:
                del self._copies[copy.worker]
            elif type(current) is dict and current.get((copy.medium, copy.group)) is copy:
                del current[(copy.medium, copy.group)]
                if len(current) == 1:
                    self._copies[copy.worker], = current.values()

    @property
    def workers(self) -> list:
        """The workers holding at least one block (any tier), in first-seen order."""
        return list(self._copies)

    def blocks_held(self, worker: Hashable, medium: Optional[str] = None) -> int:
        """Count the blocks ``worker`` holds.

        A block held under two publisher hashes, tiers or groups counts once per hash, tier
        and group.

        Args:
            worker: The worker id.
            medium: Count only this tier (e.g. ``"GPU"``, ``"CPU"``); None: every tier.

        Returns:
            The number of blocks (0 for an unknown worker).
        """
        return sum(c.size for c in self._copies_of(worker)
                   if medium is None or c.medium == medium)

    def __len__(self) -> int:
        """``len(indexer)``: the distinct blocks held by at least one worker.

        Returns:
            The number of blocks.
        """
        return len(self._index)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` and every block it held on every tier (it left the fleet, or
        restarted).

        Args:
            worker: The worker id; an unknown one is ignored.
        """
        self._clear_worker(worker)

    def _clear_copy(self, copy: _Copy) -> None:
        if copy.size:
            self._index.clear_copy(copy.cid)
        copy.published = {}
        copy.size = 0
        self._drop_cid(copy)

    def _holds(self, key: Any, copy: _Copy) -> bool:
        return (type(key) is int and _INT64_MIN <= key <= _INT64_MAX
                and self._index.holds(key, copy.cid))

    def _key_of(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """The indexer key ``copy`` holds under publisher hash ``block_hash``, or None."""
        key = copy.published.get(block_hash)
        if key is None and type(block_hash) is int and self._holds(block_hash, copy):
            key = block_hash  # published under its own key
        return key

    def _parent_on_other_tier(self, worker: Hashable, group: Any, copy: Optional[_Copy],
                              parent: Any) -> Optional[int]:
        """The key of ``parent`` as another tier of ``worker`` (same group) holds it, or None.

        A host copy of a block is often made while its parent is only on the device (the
        leaves leave the device first), so its ``BlockStored`` names a parent this tier does
        not hold. Keys come from the tokens alone, so the other tier's key is this one's."""
        for other in self._copies_of(worker):
            if other is not copy and other.group == group:
                key = self._key_of(other, parent)
                if key is not None:
                    return key
        return None

    def _clear_worker(self, worker: Hashable) -> None:
        copies = self._copies_of(worker)
        self._copies.pop(worker, None)
        for copy in copies:
            self._clear_copy(copy)  # drops its id too

    def _hold(self, key: int, copy: _Copy) -> None:
        self._index.hold(key, copy.cid)

    def _unhold(self, key: int, copy: _Copy) -> None:
        self._index.unhold(key, copy.cid)

    def _new_cid(self, copy: _Copy) -> None:
        if self._free_cids:
            copy.cid = self._free_cids.pop()
        else:
            copy.cid = self._next_cid
            self._next_cid += 1
        self._cid_version += 1
        self._owner_tables.clear()

    def _drop_cid(self, copy: _Copy) -> None:
        # The copy is being dropped, holding nothing: its id may serve another copy.
        if copy.cid >= 0:
            self._free_cids.append(copy.cid)
            copy.cid = -1
            self._cid_version += 1
            self._owner_tables.clear()

    def _owners(self, medium: Any) -> tuple:
        """``(owners, workers)`` for ``BlockIndex.overlap``: ``owners[cid]`` is the position
        in ``workers`` of the worker of the copy ``cid`` if it is on ``medium`` (a tier, or a
        tuple of tiers: a block counts when the worker holds it on any of them), else -1."""
        media = medium if type(medium) is tuple else (medium,)
        table = self._owner_tables.get(medium)
        if table is None:
            version = self._cid_version
            owners = [-1] * self._next_cid
            workers: list = []
            slots: dict = {}
            for copy in self._all_copies():
                if copy.medium in media and copy.cid >= 0:
                    slot = slots.get(copy.worker)
                    if slot is None:
                        slot = slots[copy.worker] = len(workers)
                        workers.append(copy.worker)
                    owners[copy.cid] = slot
            table = (owners, workers)
            if version == self._cid_version:  # a worker id's __eq__ changed no copy
                self._owner_tables[medium] = table
        return table

    # -- events ------------------------------------------------------------------------
    def apply(self, worker: Hashable, events: Iterable[Any]) -> None:
        """Apply one batch of ``worker``'s events, in order.

        Never raises for bad events: what cannot be applied is skipped and counted in
        ``stats``. A ``ReceivedBatch`` marked ``restarted`` (its publisher restarted) first
        drops every block the worker held.

        Args:
            worker: The worker id (any hashable).
            events: The batch: an iterable of ``BlockStored``, ``BlockRemoved`` and
                ``AllBlocksCleared`` (as ``RadixCache.take_events()`` returns them), or a
                subscriber's ``ReceivedBatch``.
        """
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

    def apply_payload(self, worker: Hashable, payload: bytes, seq: int = -1) -> bool:
        """Decode a wire payload with ``decode_batch`` and apply its events.

        Args:
            worker: The worker id (any hashable).
            payload: The msgpack payload of one batch (the last frame of a ZeroMQ message).
            seq: The batch's sequence number, for error messages (-1: unknown).

        Returns:
            True if the payload was applied, False if it was malformed (then counted in
            ``stats.malformed_batches``; nothing is kept for the worker).
        """
        self._check_worker(worker)
        try:
            batch = decode_batch(payload, seq)
        except (ValueError, TypeError):
            self.stats.malformed_batches += 1
            return False
        self.apply(worker, batch.events)
        return True

    def _apply_own(self, worker: Hashable, records: list) -> None:
        """Apply one batch of a ``_keyfeed.KeyRecorder``'s records (an in-process worker
        whose block keys are this indexer's own): counted exactly as ``apply`` counts the
        equivalent ``fast64`` events, each record one call into the block index."""
        stats = self.stats
        stats.batches += 1
        index = self._index
        for record in records:
            stats.events += 1
            if type(record) is not tuple:
                if isinstance(record, AllBlocksCleared):
                    self._clear_worker(worker)
                    stats.cleared += 1
                else:
                    stats.malformed_events += 1
                continue
            copy = self._find(worker, MEDIUM_GPU, None)
            if record[0] == _KEYS_STORED:
                _, keys, parent = record
                if parent is not None and (copy is None or self._key_of(copy, parent) is None):
                    stats.unknown_parent += 1
                    continue
                if copy is None:
                    copy = self._copy(worker, MEDIUM_GPU, None)
                stored, duplicates = index.store(copy.cid, keys)
                copy.size += stored
                stats.stored_blocks += stored
                stats.duplicate_blocks += duplicates
            elif copy is None:
                stats.unknown_removals += len(record[1]) // 8
            elif copy.published:  # also fed events under other hashes: the general path
                self._removed(worker, BlockRemoved(
                    tuple(array("q", record[1])), MEDIUM_GPU))  # native order, as written
            else:
                removed, unknown = index.remove(copy.cid, record[1])
                copy.size -= removed
                stats.removed_blocks += removed
                stats.unknown_removals += unknown
                self._forget_if_empty(copy)

    def _stored(self, worker: Hashable, event: BlockStored) -> None:
        stats = self.stats
        hashes = event.block_hashes
        token_ids = event.token_ids
        block_size = event.block_size
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
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
            if parent is None:
                key = _root_key(_namespace_bytes(_event_namespace(event)))
            else:
                key = None if copy is None else self._key_of(copy, parent)
                if key is None:
                    key = self._parent_on_other_tier(worker, group, copy, parent)
                if key is None:
                    stats.unknown_parent += 1
                    return
            keys = _page_keys(key, data, self._page_bytes)
            # Published under the indexer's own keys (a fast64 publisher), or checked hashes.
            identity = keys == list(hashes)
            if not identity and not _all_hash_types(hashes):
                hashes = [h if type(h) in _HASH_TYPES else operator.index(h) for h in hashes]
        except (TypeError, ValueError, OverflowError, LookupError, RecursionError):
            # LookupError: extra_keys[0]; RecursionError: a hand-built, absurdly deep namespace
            stats.malformed_events += 1
            return
        if not keys:
            return
        if copy is None:
            copy = self._copy(worker, medium, group)
        if identity:
            # No hash map: the blocks this copy does not hold yet, in one call.
            stored, duplicates = self._index.store(copy.cid, keys)
            copy.size += stored
            stats.stored_blocks += stored
            stats.duplicate_blocks += duplicates
            return
        published = copy.published
        if published.keys().isdisjoint(hashes) and len(set(hashes)) == len(keys):
            # New hashes (the common case): in bulk.
            published.update(zip(hashes, keys))
            self._index.add(copy.cid, keys)
            copy.size += len(keys)
            stats.stored_blocks += len(keys)
            return
        stored = 0
        for block_hash, key in zip(hashes, keys):
            known = published.get(block_hash)
            if known is not None:
                if known == key:
                    stats.duplicate_blocks += 1
                    continue
                # The publisher reused a hash for other content: the newer block wins.
                self._unhold(known, copy)
                copy.size -= 1
            published[block_hash] = key
            self._hold(key, copy)
            stored += 1
        copy.size += stored
        stats.stored_blocks += stored

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
                    if self._holds(block_hash, copy):
                        self._unhold(block_hash, copy)
                        removed += 1
                    else:
                        unknown += 1
        else:
            published = copy.published
            for block_hash in hashes:
                key = published.pop(block_hash, None)
                if key is None:
                    if type(block_hash) is int and self._holds(block_hash, copy):
                        key = block_hash
                    else:
                        unknown += 1
                        continue
                self._unhold(key, copy)
                removed += 1
        copy.size -= removed
        stats.removed_blocks += removed
        stats.unknown_removals += unknown
        self._forget_if_empty(copy)

    # -- queries -----------------------------------------------------------------------
    def block_keys(self, tokens: Any, extra_key: Any = None) -> list:
        """Compute the indexer keys of the full blocks of ``tokens``.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int.

        Returns:
            One key (an int) per full block of ``block_size`` tokens, each chained to the
            previous one.

        Raises:
            TypeError: tokens that are not integers, or an ``extra_key`` of another type.
            OverflowError: a token that does not fit in int64.
        """
        data = tokens_le_bytes(tokens)
        return _page_keys(_root_key(encode_namespace(extra_key)), data, self._page_bytes)

    def overlap(self, tokens: Any, extra_key: Any = None, medium: Optional[str] = MEDIUM_GPU
                ) -> dict:
        """Tell how many leading blocks of ``tokens`` each worker holds.

        Only full blocks count; a block counts when any of the worker's KV-cache groups
        holds it on tier ``medium``.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int.
            medium: The tier counted: ``"GPU"`` (the device, also events naming no medium)
                by default, e.g. ``"CPU"`` for a host tier.

        Returns:
            ``{worker: leading blocks held}`` for every worker that holds at least one.

        Raises:
            TypeError: tokens that are not integers, an ``extra_key`` of another type, or a
                ``medium`` that is not a str.
            OverflowError: a token that does not fit in int64.
        """
        if medium is None:
            medium = MEDIUM_GPU
        elif not isinstance(medium, str):
            raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
        return self._overlap(tokens_le_bytes(tokens), encode_namespace(extra_key), medium)

    def _overlap(self, data: bytes, namespace: bytes, medium: Any = MEDIUM_GPU) -> dict:
        # The index hashes the query's blocks and walks them in one call, as far as any
        # worker's run goes; workers reach it as positions in ``workers``.
        owners, workers = self._owners(medium)
        return {workers[owner]: depth for owner, depth in self._index.overlap(
            _root_key(namespace), data, self._page_bytes, owners)}

    def __repr__(self) -> str:
        return (f"KvIndexer(block_size={self.block_size}, workers={len(self._copies)}, "
                f"blocks={len(self._index)})")


def _check_worker_count(num_workers: Any) -> int:
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral):
        raise TypeError(f"num_workers must be an int, got {type(num_workers).__name__}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    return int(num_workers)


def _check_weight(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


class Router:
    """Picks a worker (``0 .. num_workers-1``) per request.

    Policies (``ROUTING_POLICIES``):

    - ``round-robin``: workers in turn.
    - ``random``: uniformly at random from a ``random.Random(seed)``.
    - ``least-loaded``: the smallest reported load; ties go to the worker routed to least.
    - ``prefix-hash``: a consistent hash (a ring of ``virtual_nodes`` points per worker,
      SHA-256, the same in every process) of a prompt's first blocks of ``block_size``
      tokens and the namespace: a prefix lands on the same worker. ``prefix_blocks=N``
      hashes the first N blocks. The default, ``"auto"``, hashes the shortest prefix (of 1,
      2, 3, 4, 6, 8, 12, 16, ... blocks, or the whole prompt) whose family (the requests
      seen so far that start with it) is at most one worker's share of the traffic
      (1 / ``num_workers``, and at least ``MIN_PREFIX_FAMILY`` requests, so a young family
      stays on one worker): a first block every request shares (a system prompt) is too big
      a family for one worker, so a deeper prefix decides, while a conversation's turns,
      which share their first blocks, stay together. Each prompt counts once for each of
      its candidate prefixes (at most ``MAX_PREFIX_FAMILIES`` counts, halved when full).
    - ``cache-aware``: the lowest ``prefill_weight * (tokens not cached on the worker) +
      load_weight * load``, the cached tokens being the worker's overlap in ``indexer`` times
      ``block_size``; ties go to the lower load, then to the worker routed to least. A worker
      with a host tier (blocks the indexer holds for it on ``"CPU"``) also gets
      ``host_weight`` of a block for each leading block it holds on the host beyond its
      device overlap (its overlap on either tier minus its device overlap): such a block is
      loaded back, not recomputed.

    Load is whatever the caller reports, in tokens of work queued or running: ``add_load``
    when a request is dispatched, ``remove_load`` as its work completes (``set_load`` for a
    router that polls its workers instead). Feed the indexer with each worker's events
    (``router.indexer.apply(worker, events)``); worker ids in the events are the ints
    ``0 .. num_workers-1``: ``cache-aware`` routing raises ValueError naming any other id
    the indexer holds blocks for, rather than ignoring its blocks. Not thread-safe: serialise ``route`` with the load reports and the
    indexer's ``apply``.

    Args:
        num_workers: How many workers, an int >= 1.
        policy: One of ``ROUTING_POLICIES`` (default ``"cache-aware"``).
        block_size: Tokens per block, the workers' page size (default: the ``indexer``'s,
            or ``DEFAULT_BLOCK_SIZE``); ``prefix-hash`` and ``cache-aware`` count in blocks.
        indexer: A ``KvIndexer`` to read overlaps from (default: a new one, ``router.indexer``).
        seed: Seed of the ``random`` policy.
        prefix_blocks: How many leading blocks ``prefix-hash`` hashes, an int >= 1, or
            ``"auto"`` (the default): the shortest prefix (1, 2, 3, 4, 6, 8, 12, ... blocks)
            whose family is at most one worker's share of the requests seen so far.
        prefill_weight: ``cache-aware``'s weight of the tokens a worker would prefill.
        load_weight: ``cache-aware``'s weight of a worker's load (default
            ``DEFAULT_LOAD_WEIGHT``: 10 tokens of queued work weigh as much as one token of
            prefill saved).
        virtual_nodes: Points per worker on ``prefix-hash``'s ring, an int >= 1.
        host_weight: ``cache-aware``'s weight of a block held only on a worker's host tier,
            as a fraction of a device block, in ``[0, 1]`` (default ``DEFAULT_HOST_WEIGHT``,
            0.9: loading a token back at the default 200,000 tokens/s costs a tenth of
            prefilling it at 20,000 tokens/s); 0 ignores host tiers.

    Raises:
        TypeError: an argument of the wrong type (``policy`` not a str, ``indexer`` not a
            ``KvIndexer``, a count or weight that is not a number).
        ValueError: an unknown policy, a count < 1, a negative or infinite weight, a
            ``host_weight`` outside ``[0, 1]``, or a ``block_size`` that differs from the
            ``indexer``'s.
    """

    #: The most block prefixes ``prefix_blocks="auto"`` counts before halving every count.
    MAX_PREFIX_FAMILIES = 1 << 20
    #: ``prefix_blocks="auto"`` never splits a family of fewer requests than this.
    MIN_PREFIX_FAMILY = 64

    def __init__(self, num_workers: int, policy: str = "cache-aware", *,
                 block_size: Optional[int] = None,
                 indexer: Optional[KvIndexer] = None, seed: int = 0,
                 prefix_blocks: Any = "auto",
                 prefill_weight: float = 1.0, load_weight: float = DEFAULT_LOAD_WEIGHT,
                 virtual_nodes: int = 64, host_weight: float = DEFAULT_HOST_WEIGHT) -> None:
        self.num_workers = _check_worker_count(num_workers)
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a str, got {type(policy).__name__}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"unknown routing policy {policy!r}; valid: {', '.join(ROUTING_POLICIES)}")
        self.policy = policy
        if indexer is None:
            indexer = KvIndexer(DEFAULT_BLOCK_SIZE if block_size is None else block_size)
        elif not isinstance(indexer, KvIndexer):
            raise TypeError(f"indexer must be a KvIndexer, got {type(indexer).__name__}")
        elif block_size is not None:  # None: the indexer's own block size
            block_size = _check_block_size(block_size)
            if indexer.block_size != block_size:
                raise ValueError(f"indexer.block_size {indexer.block_size} differs from "
                                 f"block_size {block_size}")
        self.indexer = indexer
        self.block_size = indexer.block_size
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if isinstance(prefix_blocks, str):
            if prefix_blocks != "auto":
                raise ValueError(f"prefix_blocks must be an int >= 1 or 'auto', got "
                                 f"{prefix_blocks!r}")
            checks = (("virtual_nodes", virtual_nodes),)
        else:
            checks = (("prefix_blocks", prefix_blocks), ("virtual_nodes", virtual_nodes))
        for name, value in checks:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        #: blocks prefix-hash hashes: an int, or "auto" (see the class docstring)
        self.prefix_blocks = prefix_blocks if isinstance(prefix_blocks, str) else int(
            prefix_blocks)
        self._families: dict = {}  # block prefix key -> requests seen starting with it
        self._family_requests = 0
        self.prefill_weight = _check_weight("prefill_weight", prefill_weight)
        self.load_weight = _check_weight("load_weight", load_weight)
        self.host_weight = _check_weight("host_weight", host_weight)
        if self.host_weight > 1:
            raise ValueError(f"host_weight must lie in [0, 1] (a fraction of a device "
                             f"block), got {self.host_weight}")
        self._rng = random.Random(int(seed))
        self._next = 0
        self._loads = [0] * self.num_workers
        self._routed = [0] * self.num_workers
        self._ring: list = []
        self._ring_workers: list = []
        if policy == "prefix-hash":
            points = sorted((_stable_hash(b"worker", worker, replica), worker)
                            for worker in range(self.num_workers)
                            for replica in range(int(virtual_nodes)))
            self._ring = [p for p, _ in points]
            self._ring_workers = [w for _, w in points]
        #: overlap (in blocks) per worker of the last ``cache-aware`` decision
        self.last_overlap: dict = {}
        #: leading blocks on either tier (device or host) per worker of the last
        #: ``cache-aware`` decision that looked at host tiers
        self.last_host_overlap: dict = {}

    @property
    def uses_events(self) -> bool:
        """Whether the policy reads the indexer (only ``cache-aware`` does)."""
        return self.policy == "cache-aware"

    # -- load ----------------------------------------------------------------------------
    def _check_worker(self, worker: Any) -> int:
        if isinstance(worker, bool) or not isinstance(worker, numbers.Integral):
            raise TypeError(f"worker must be an int, got {type(worker).__name__}")
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} out of range [0, {self.num_workers})")
        return int(worker)

    @staticmethod
    def _check_tokens(tokens: Any) -> int:
        if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral):
            raise TypeError(f"load must be an int number of tokens, got {type(tokens).__name__}")
        if tokens < 0:
            raise ValueError(f"load must be >= 0 tokens, got {tokens}")
        return int(tokens)

    def add_load(self, worker: int, tokens: int) -> None:
        """Report ``tokens`` more work queued or running on ``worker`` (a dispatch).

        Args:
            worker: The worker, ``0 .. num_workers-1``.
            tokens: Tokens of work, an int >= 0.

        Raises:
            TypeError: ``worker`` or ``tokens`` is not an int.
            ValueError: ``worker`` out of range, or ``tokens`` < 0.
        """
        worker = self._check_worker(worker)
        self._loads[worker] += self._check_tokens(tokens)

    def remove_load(self, worker: int, tokens: int) -> None:
        """Report that ``tokens`` of ``worker``'s work completed.

        Args:
            worker: The worker, ``0 .. num_workers-1``.
            tokens: Tokens of work done, an int >= 0, at most the worker's load.

        Raises:
            TypeError: ``worker`` or ``tokens`` is not an int.
            ValueError: ``worker`` out of range, ``tokens`` < 0, or more than the worker's
                load (the load never goes below zero).
        """
        worker = self._check_worker(worker)
        tokens = self._check_tokens(tokens)
        if tokens > self._loads[worker]:
            raise ValueError(f"removing {tokens} tokens of load from worker {worker}, "
                             f"which has {self._loads[worker]}")
        self._loads[worker] -= tokens

    def set_load(self, worker: int, tokens: int) -> None:
        """Set ``worker``'s load as measured (for routers that poll their workers).

        Args:
            worker: The worker, ``0 .. num_workers-1``.
            tokens: Its load in tokens, an int >= 0.

        Raises:
            TypeError: ``worker`` or ``tokens`` is not an int.
            ValueError: ``worker`` out of range, or ``tokens`` < 0.
        """
        worker = self._check_worker(worker)
        self._loads[worker] = self._check_tokens(tokens)

    @property
    def loads(self) -> tuple:
        """The current load per worker, in tokens."""
        return tuple(self._loads)

    @property
    def routed(self) -> tuple:
        """How many requests went to each worker."""
        return tuple(self._routed)

    # -- routing -------------------------------------------------------------------------
    def route(self, tokens: Any, extra_key: Any = None) -> int:
        """Pick the worker for a request and count it as routed there.

        The inputs are checked under every policy, before anything changes.

        Args:
            tokens: The request's prompt, a 1-D integer sequence (list, tuple, numpy array,
                CPU tensor).
            extra_key: Its namespace: None, str, bytes or int.

        Returns:
            The worker, ``0 .. num_workers-1``.

        Raises:
            TypeError: tokens that are not integers, or an ``extra_key`` of another type.
            OverflowError: a token that does not fit in int64.
        """
        data = tokens_le_bytes(tokens)
        namespace = encode_namespace(extra_key)
        policy = self.policy
        if policy == "round-robin":
            worker = self._next
            self._next = (worker + 1) % self.num_workers
        elif policy == "random":
            worker = self._rng.randrange(self.num_workers)
        elif policy == "least-loaded":
            loads, routed = self._loads, self._routed
            worker = min(range(self.num_workers), key=lambda w: (loads[w], routed[w], w))
        elif policy == "prefix-hash":
            worker = self._prefix_worker(data, namespace)
        else:
            worker = self._cache_aware(data, namespace)
        self._routed[worker] += 1
        return worker

    def _prefix_worker(self, data: bytes, namespace: bytes) -> int:
        page_bytes = self.block_size * 8
        if self.prefix_blocks == "auto":
            depth = self._family_depth(data, namespace, page_bytes)
        else:
            depth = self.prefix_blocks
        point = _stable_hash(b"prefix", namespace, data[: depth * page_bytes] if depth else data)
        i = bisect_right(self._ring, point)
        return self._ring_workers[i % len(self._ring_workers)]

    def _family_depth(self, data: bytes, namespace: bytes, page_bytes: int) -> int:
        """How many blocks ``auto`` hashes: the shortest candidate prefix (``_depths``: 1, 2,
        3, 4, 6, 8, 12, ... blocks, and the whole prompt) whose family is at most one
        worker's share of the requests seen (0: the prompt has no full block). Every
        candidate of the prompt is counted, so a family's count is the requests that
        reached it, however deep."""
        keys = _page_keys(_root_key(namespace), data, page_bytes)
        families = self._families
        share = max(self._family_requests / self.num_workers, self.MIN_PREFIX_FAMILY)
        chosen = 0
        for depth in _depths(len(keys)):
            key = keys[depth - 1]
            seen = families.get(key, 0)
            families[key] = seen + 1
            if not chosen and seen <= share:
                chosen = depth
        self._family_requests += 1
        if len(families) > self.MAX_PREFIX_FAMILIES:
            # Halve: old families fade, and the table stays bounded.
            self._families = {k: v // 2 for k, v in families.items() if v > 1}
            self._family_requests //= 2
        return chosen or len(keys)

    def _cache_aware(self, data: bytes, namespace: bytes) -> int:
        data_len = len(data) // 8
        overlap = self.indexer._overlap(data, namespace)
        for worker in overlap:
            if type(worker) is not int or not 0 <= worker < self.num_workers:
                self._check_overlap_worker(worker)
        self.last_overlap = overlap
        if self.host_weight and self._has_host_blocks():
            overlap = self._with_host_blocks(data, namespace, overlap)
        loads, routed = self._loads, self._routed
        block_size = self.block_size
        prefill_weight, load_weight = self.prefill_weight, self.load_weight
        best = None
        best_key = None
        for worker in range(self.num_workers):
            cached = overlap.get(worker, 0) * block_size
            score = prefill_weight * (data_len - cached) + load_weight * loads[worker]
            key = (score, loads[worker], routed[worker], worker)
            if best_key is None or key < best_key:
                best, best_key = worker, key
        return best

    def _has_host_blocks(self) -> bool:
        """Whether the indexer holds any block on a worker's host tier."""
        indexer = self.indexer
        return any(indexer.blocks_held(worker, MEDIUM_CPU) for worker in indexer.workers)

    def _with_host_blocks(self, data: bytes, namespace: bytes, overlap: dict) -> dict:
        """``overlap`` (device blocks) plus ``host_weight`` per leading block held on the
        host beyond it: ``{worker: weighted blocks}``. The leading blocks are those held on
        either tier: a host tier usually holds the continuation of a device prefix, not the
        prefix itself."""
        host = self.indexer._overlap(data, namespace, (MEDIUM_GPU, MEDIUM_CPU))
        self.last_host_overlap = host
        weighted = dict(overlap)
        for worker, blocks in host.items():
            if type(worker) is not int or not 0 <= worker < self.num_workers:
                self._check_overlap_worker(worker)
            extra = blocks - overlap.get(worker, 0)
            if extra > 0:
                weighted[worker] = overlap.get(worker, 0) + self.host_weight * extra
        return weighted

    def _check_overlap_worker(self, worker: Any) -> None:
        if (not isinstance(worker, bool) and isinstance(worker, numbers.Integral)
                and 0 <= worker < self.num_workers):
            return
        raise ValueError(
            f"the indexer holds blocks of worker {worker!r}, which is not one of this "
            f"router's workers 0 .. {self.num_workers - 1}: apply each worker's events under "
            f"its int id")

    def __repr__(self) -> str:
        return (f"Router(num_workers={self.num_workers}, policy={self.policy!r}, "
                f"block_size={self.block_size}, loads={list(self._loads)})")


# Candidate prefix lengths of prefix_blocks="auto", in blocks: 1, 2, 3, 4, 6, 8, 12, 16, ...
_DEPTHS = sorted({n for k in range(63) for n in (1 << k, 3 << k >> 1) if n >= 1})


def _depths(blocks: int) -> list:
    """The candidate prefix lengths of a prompt of ``blocks`` full blocks, the whole included."""
    out = _DEPTHS[:bisect_right(_DEPTHS, blocks - 1)]
    if blocks:
        out.append(blocks)
    return out


def _stable_hash(tag: bytes, *parts: Any) -> int:
    """A 64-bit hash that is the same in every process (for the prefix-hash ring)."""
    digest = hashlib.sha256(tag)
    for part in parts:
        if isinstance(part, int):
            part = part.to_bytes(8, "big", signed=True)
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest()[:8], "big")

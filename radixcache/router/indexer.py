"""``KvIndexer``: which blocks each worker holds, learned from its KV events (see
``radixcache.router``), and ``IndexerStats``, what it applied and skipped.

The block table (``BlockIndex``) and the chain of block keys (``page_hash_chain``) come from
the block module (compiled when built); both are reached in one place below.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import sys
from array import array
from dataclasses import dataclass, fields
from typing import Any, Hashable, Iterable, Optional

import numpy as np

from .. import _core
from .._validate import INT64_MAX, INT64_MIN, check_int, is_int
from ..events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    TokenIds,
    canonical_namespace,
    decode_batch,
    encode_namespace,
    tokens_le_bytes,
)
from ..events.hashing import fast64_root
from ..events.wire import _event_of, _transport, _typed_events, _typed_kinds
from ..events.recorder import KEYS_REMOVED, KEYS_STORED

_LITTLE_ENDIAN = sys.byteorder == "little"
# A publisher's block hashes are only looked up, never computed with: vLLM sends ints or
# bytes (its ExternalBlockHash).
_HASH_TYPES = (int, bytes)

# The block module's table and page hash chain (compiled when built): the block keys are
# the chain seeded by the namespace. A table is made per indexer from the module chosen then.
_page_keys = _core.blocks.page_hash_chain
_DECODER = [False]  # whether decode_batch's optional dependencies were found
_ids_le_bytes = _core.blocks.ids_le_bytes
_msgpack_ids = _core.blocks.msgpack_ids


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
        store_errors: Calls to the store (``KvIndexer(store=...)``) that failed: it could
            not be reached, or refused a write (out of memory).
        blind_lookups: Lookups answered ``{}`` (cache-blind routing) because the store
            failed.
        stale_batches: Batches skipped: not newer than the worker's stored sequence number
            (already applied, by this router or another).
        foreign_batches: Batches skipped: another router owns the worker's ingest.
        collected_workers: Workers whose lease expired, their blocks collected.
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
    store_errors: int = 0        #: store calls that failed (unreachable, or out of memory)
    blind_lookups: int = 0       #: lookups answered ``{}`` because the store failed
    stale_batches: int = 0       #: batches not newer than the stored sequence: skipped
    foreign_batches: int = 0     #: batches of a worker another router owns: skipped
    collected_workers: int = 0   #: workers whose lease expired: their blocks collected

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


def _event_token_bytes(token_ids: Any) -> bytes:
    """An event's token ids as int64 little-endian bytes; a tuple or list (what events hold)
    is read by the block module in one pass, or through ``array('q')`` when an item is no
    exact int (a bool, an int subclass: taken as before), cheaper than numpy."""
    if type(token_ids) is TokenIds:
        return token_ids.le_bytes
    if type(token_ids) is tuple or type(token_ids) is list:
        try:
            return _ids_le_bytes(token_ids)
        except (TypeError, OverflowError):
            pass  # any int64 value array('q') takes, or its error
        if _LITTLE_ENDIAN:
            return array("q", token_ids).tobytes()  # TypeError/OverflowError: not int64
    return tokens_le_bytes(token_ids)


@functools.lru_cache(maxsize=4096)  # a query's namespace is usually one of a few
def _root_key(namespace: bytes) -> int:
    # The chain of a sequence starts from its namespace, so equal tokens in two namespaces
    # get different keys: the seed of the fast64 block hash, so a fast64 publisher's hashes
    # are the indexer's keys.
    return fast64_root(namespace)


def _event_namespace(event: BlockStored) -> Any:
    """The namespace of a root event's blocks: its first block's ``extra_keys`` entry when
    the publisher sends the field, else SGLang's ``lora_name`` and ``cache_salt``.

    vLLM's layout carries ``extra_keys`` per block (None, or a tuple of keys); the first
    block's entry names the sequence (``_entry_namespace``). SGLang sends no extra keys: its
    hashes depend on the adapter and the salt, so the namespace is ``lora_name``, or
    ``cache_salt``, or ``(lora_name, cache_salt)`` when both are set; its ``session_id`` is
    attribution only and never part of a block's identity.
    """
    extra_keys = getattr(event, "extra_keys", None)
    if extra_keys:
        return _entry_namespace(_entry(extra_keys[0]))
    return namespace_for(getattr(event, "lora_name", None), getattr(event, "cache_salt", None))


def namespace_for(lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> Any:
    """The namespace of a sequence cached for LoRA adapter ``lora_name`` with ``cache_salt``
    (either None): the ``extra_key`` a query passes to find what such a request's events
    stored (``lora_name``, or ``cache_salt``, or ``(lora_name, cache_salt)`` when both are
    set; None for neither).

    Raises:
        TypeError: a value that is not a str or None.
    """
    for value in (lora_name, cache_salt):
        if value is not None and not isinstance(value, str):
            raise TypeError("lora_name and cache_salt must be str or None")
    if cache_salt is None:
        return lora_name
    return cache_salt if lora_name is None else (lora_name, cache_salt)


def _entry(entry: Any) -> Optional[tuple]:
    """A block's ``extra_keys`` entry as a tuple, nested arrays as tuples (a list and a tuple
    spell the same entry); None for none or an empty one."""
    if entry is None:
        return None
    if not isinstance(entry, (list, tuple)):
        return (_frozen(entry),)
    return tuple(_frozen(item) for item in entry) or None


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def _entry_namespace(entry: Optional[tuple]) -> Any:
    """The namespace an entry names as a sequence's first: a one-element entry is that
    element, a longer one the tuple."""
    if entry is None:
        return None
    return entry[0] if len(entry) == 1 else entry


def _fold(key: int, entry: tuple) -> int:
    """``key`` with a block's own extra keys (an image's hash, ...) mixed in."""
    digest = hashlib.blake2b(key.to_bytes(8, "little", signed=True) + _namespace_bytes(entry),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# SGLang's names for the tiers it shares with vLLM: its pinned host memory is the host tier.
_MEDIUM_ALIASES = {"CPU_PINNED": MEDIUM_CPU}


def _tier(medium: str) -> str:
    return _MEDIUM_ALIASES.get(medium, medium)


def _namespace_bytes(namespace: Any) -> bytes:
    try:
        return encode_namespace(namespace)
    except TypeError:
        # A publisher may send any msgpack value; a stable spelling keeps it a namespace.
        return b"R" + repr(namespace).encode("utf-8", "surrogatepass")


class _Copy:
    """One worker's blocks on one tier and KV-cache group: ``(worker, medium, group)``."""

    __slots__ = ("worker", "medium", "group", "published", "direct", "refs", "cid")

    def __init__(self, worker: Hashable, medium: str, group: Any, published: Any) -> None:
        self.worker = worker
        self.medium = medium
        self.group = group
        # publisher hash -> indexer key, for hashes that are not the key itself (the block
        # module's KeyMap: 16 bytes a hash, whatever its type); a block published under its
        # own key (a ``fast64`` publisher) is held without an entry
        self.published = published
        self.direct = 0  # holdings published under their own key (no ``published`` entry)
        # indexer key -> how many ``published`` hashes name it; kept only while the copy
        # holds blocks both ways (None otherwise), to tell its own-key holdings apart
        self.refs: Optional[dict] = None
        self.cid = -1  # its id in the indexer's BlockIndex, set by KvIndexer._copy

    @property
    def size(self) -> int:
        """(publisher hash, block) pairs held: one holding each in the BlockIndex."""
        return self.direct + len(self.published)

    def __repr__(self) -> str:
        return f"_Copy({self.worker!r}, {self.medium!r}, {self.group!r})"


def _int64_array(tokens: Any) -> bool:
    """Whether ``tokens`` is a numpy array the block index reads in place: exactly
    ``numpy.ndarray``, 1-D, contiguous, little-endian int64."""
    return (type(tokens) is np.ndarray and tokens.dtype.str == "<i8" and tokens.ndim == 1
            and tokens.flags.c_contiguous)


def _is_key_record(record: tuple) -> bool:
    """A ``KeyRecorder`` record: ``(KEYS_STORED, keys, parent_key)`` or ``(KEYS_REMOVED,
    keys)``, ``keys`` whole int64s as bytes, ``parent_key`` an int or None."""
    if len(record) == 3:
        tag, keys, parent = record
        if type(tag) is not int or tag != KEYS_STORED or not (
                parent is None or type(parent) is int):
            return False
    elif len(record) == 2:
        tag, keys = record
        if type(tag) is not int or tag != KEYS_REMOVED:
            return False
    else:
        return False
    return type(keys) is bytes and len(keys) % 8 == 0


def _event_medium(event: Any) -> str:
    """An event's tier: its ``medium``, ``"GPU"`` (the device tier) when it names none."""
    medium = getattr(event, "medium", None)
    if medium is None:
        return MEDIUM_GPU
    if not isinstance(medium, str):
        raise TypeError("medium must be a str or None")
    return _tier(medium)


def _event_group(event: Any) -> Any:
    group = getattr(event, "group_idx", None)
    if group is not None:
        if not is_int(group):
            raise TypeError("group_idx must be an int or None")
        group = int(group)
    return group


class KvIndexer:
    """Which blocks each worker holds, learned from its KV events; see the module docstring.

    Workers are any hashable ids. Apply each worker's batches in the order it published them:
    ``apply(worker, events)`` for event objects, ``apply_payload(worker, payload, seq)`` for
    a raw msgpack payload, ``apply_keys(worker, records)`` for the block-key records of a
    cache in the same process (``event_options={"record": "keys"}``). ``len(indexer)`` is
    the number of distinct blocks held. Not thread-safe: serialise ``apply`` with the
    queries.

    Blocks are held per copy: a worker's blocks on one tier (the event's ``medium``,
    ``"GPU"`` when it names none) in one KV-cache group (``group_idx``). A removal removes
    that copy only, and a block stays held while any of the copy's publisher hashes maps to
    it. ``overlap`` counts the device tier (``"GPU"``) by default, any group; ``medium=``
    reports another tier. Memory is one entry per (block, copy) and one per distinct block;
    a worker holding nothing costs nothing.

    With ``store="redis://host:port/db"`` the index lives in Redis or Valkey, shared by
    every ``KvIndexer`` given the same store and ``namespace`` (router replicas), and it
    survives their restarts; the answers are the same. A worker's ingest is owned by one
    router at a time (a lease of ``lease_s`` seconds, renewed by its batches and by
    ``renew``); ``collect_expired`` drops the blocks of workers whose lease expired. If the
    store fails, lookups answer ``{}`` (cache-blind routing) and the failures are counted in
    ``stats``; nothing raises. See ``radixcache.router.redis_store``.

    Args:
        block_size: The workers' page size (tokens per block), an int >= 1. Events of
            another block size are skipped and counted.
        store: None (the index in this process), or the URL of a Redis or Valkey server
            (``redis://``, ``rediss://`` or ``unix://``); needs ``radixcache[redis]``.
        namespace: With ``store``: the name of the shared index (a str without ``:``).
        lease_s: With ``store``: seconds a worker's lease lasts without a batch or a
            ``renew``.
        owner: With ``store``: this router's owner token (a str), e.g. its pod name, so that
            it takes its workers back at once after a restart; None: a new random token.

    Raises:
        TypeError: ``block_size`` is not an int.
        ValueError: ``block_size`` < 1, or a bad ``store``, ``namespace`` or ``lease_s``.
        ImportError: ``store`` without the ``redis`` client installed.
    """

    def __init__(self, block_size: int, store: Optional[str] = None,
                 namespace: str = "default", lease_s: float = 30.0,
                 owner: Optional[str] = None) -> None:
        self.block_size = check_int(block_size, "block_size", 1)
        self._store = None
        self._page_bytes = self.block_size * 8
        # indexer key -> the ids (``_Copy.cid``) of the copies holding it, a copy once per
        # publisher hash that maps to the block: the block module's BlockIndex (compiled when
        # built); copy ids are reused once their copy is dropped
        self._index = _core.blocks.BlockIndex()
        self._key_map = _core.blocks.KeyMap  # publisher hash maps, same module
        # a payload's batch read and applied in one call each (same module)
        self._read_wire = _core.blocks.read_wire
        self._apply_wire = _core.blocks.apply_wire
        self._free_cids: list = []
        self._held = 0  # the copies' holdings, together: the table's pairs
        self._next_cid = 0
        self._owner_tables: dict = {}  # medium -> (owners by copy id, workers); see _owners
        self._cid_version = 0  # changes with the copies (the owner tables' validity)
        # worker -> its _Copy, or {(medium, group): _Copy} when it has several; only copies
        # holding at least one block
        self._copies: dict = {}
        # indexer key -> the extra-keys entry of its sequence's namespace, for blocks stored
        # with per-block extra keys under a namespace: a key's namespace is fixed by the
        # key, so an entry is never wrong, only kept a while after its block left
        self._ns_of: dict = {}
        self._root_seed = _root_key(encode_namespace(None))  # a chain's seed, no namespace
        self.stats = IndexerStats()
        if store is not None:
            from .redis_store import RedisStore  # only here: importing radixcache needs no redis

            self._store = RedisStore(self, store, namespace, lease_s, owner)

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
            copy = _Copy(worker, medium, group, self._key_map())
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
        """The workers holding at least one block (any tier), in first-seen order (with a
        store: in the order the store first saw them)."""
        if self._store is not None:
            return self._store.workers()
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
        if medium is not None:
            medium = _tier(medium)
        if self._store is not None:
            return self._store.blocks_held(worker, medium)
        return sum(c.size for c in self._copies_of(worker)
                   if medium is None or c.medium == medium)

    def __len__(self) -> int:
        """``len(indexer)``: the distinct blocks held by at least one worker.

        Returns:
            The number of blocks.
        """
        if self._store is not None:
            return len(self._store)
        return len(self._index)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` and every block it held on every tier (it left the fleet, or
        restarted).

        Args:
            worker: The worker id; an unknown one is ignored.
        """
        if self._store is not None:
            self._store.remove_worker(worker)
            return
        self._clear_worker(worker)

    def _clear_copy(self, copy: _Copy) -> None:
        self._held -= copy.size
        if copy.size:
            self._index.clear_copy(copy.cid)
        copy.published.clear()
        copy.direct = 0
        copy.refs = None
        self._drop_cid(copy)

    def _refs(self, copy: _Copy) -> dict:
        """``copy.refs``, counted from ``copy.published`` when not kept yet."""
        refs = copy.refs
        if refs is None:
            refs = copy.refs = {}
            for key in copy.published.values():
                refs[key] = refs.get(key, 0) + 1
        return refs

    def _direct(self, copy: _Copy, block_hash: Any) -> bool:
        """Whether ``copy`` holds ``block_hash`` as a block's own key (no ``published``
        entry): one of its holdings of that key is not some other hash's."""
        if not copy.direct or type(block_hash) is not int or not (
                INT64_MIN <= block_hash <= INT64_MAX):
            return False
        if not copy.published:
            return self._index.holds(block_hash, copy.cid)
        named = self._refs(copy).get(block_hash, 0)
        return self._index.holders(block_hash).count(copy.cid) > named

    def _publish(self, copy: _Copy, block_hash: Any, key: int) -> None:
        copy.published.put(block_hash, key)
        refs = copy.refs
        if refs is not None:
            refs[key] = refs.get(key, 0) + 1

    def _unpublish(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """Forget ``block_hash`` in ``copy.published``: the key it named, or None."""
        key = copy.published.pop(block_hash)
        refs = copy.refs
        if key is not None and refs is not None:
            if not copy.published:
                copy.refs = None
            elif refs[key] == 1:
                del refs[key]
            else:
                refs[key] -= 1
        return key

    def _key_of(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """The indexer key ``copy`` holds under publisher hash ``block_hash``, or None."""
        key = copy.published.get(block_hash)
        if key is None and self._direct(copy, block_hash):
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
        for copy in self._copies_of(worker):
            self._clear_copy(copy)  # drops its id too
        self._copies.pop(worker, None)
        self._prune_namespaces()

    def _prune_namespaces(self) -> None:
        """Forget the namespaces of blocks no longer held, once they are most of them."""
        ns_of = self._ns_of
        if len(ns_of) > 2 * len(self._index) + 1024:
            holders = self._index.holders
            self._ns_of = {key: entry for key, entry in ns_of.items() if holders(key)}

    def _new_cid(self, copy: _Copy) -> None:
        if self._free_cids:
            copy.cid = self._free_cids.pop()
        else:
            copy.cid = self._next_cid
            self._next_cid += 1
        self._cid_version += 1
        self._owner_tables.clear()

    def _drop_cid(self, copy: _Copy) -> None:
        # The copy is being dropped, holding nothing: its id may serve another copy, once
        # no block refers to it. The copies' counts add up to the table's holdings
        # (``_held``) unless one drifted; then this id's holdings are cleared before reuse.
        if copy.cid >= 0:
            if self._index.pairs != self._held:
                self._index.clear_copy(copy.cid)
            self._free_cids.append(copy.cid)
            copy.cid = -1
            self._cid_version += 1
            self._owner_tables.clear()

    def _owners(self, medium: Any) -> tuple:
        """``(owners, workers, owners as int64 bytes)`` for ``BlockIndex.overlap``:
        ``owners[cid]`` is the position in ``workers`` of the worker of the copy ``cid`` if it
        is on ``medium`` (a tier, or a tuple of tiers: a block counts when the worker holds it
        on any of them), else -1."""
        media = medium if type(medium) is tuple else (medium,)
        table = self._owner_tables.get(medium)
        if table is None:
            version = self._cid_version
            owners = array("q", [-1]) * self._next_cid
            workers: list = []
            slots: dict = {}
            for copy in self._all_copies():
                if copy.medium in media and copy.cid >= 0:
                    slot = slots.get(copy.worker)
                    if slot is None:
                        slot = slots[copy.worker] = len(workers)
                        workers.append(copy.worker)
                    owners[copy.cid] = slot
            table = (owners, workers, owners.tobytes())
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
                subscriber's ``ReceivedBatch``. With a store, a ``ReceivedBatch``'s ``seq``
                is recorded, and a batch not newer than the recorded one is skipped.
        """
        if self._store is not None:
            self._store.apply(worker, events)
            return
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
        if self._store is not None:
            return self._store.apply_payload(worker, payload, seq)
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

    def _apply_batch(self, worker: Hashable, batch: Any, payload: bytes) -> None:
        """Apply a batch the block module read (``read_wire``): its events in order, as
        many at a time as the block module applies in one call (``apply_wire``), any other
        one (a clear, a parent on another tier, holdings both ways) here, from the events
        ``decode_batch`` reads from the same payload."""
        stats = self.stats
        stats.batches += 1
        n = len(batch)
        tier = MEDIUM_GPU if batch.medium is None else _tier(batch.medium)
        group = batch.group
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
        self.apply(worker, batch.events)
        return True

    def apply_keys(self, worker: Hashable, records: Iterable[Any]) -> None:
        """Apply one batch of an in-process worker's block-key records, in order.

        The records are what ``take_events()`` returns from a cache made with
        ``event_options={"record": "keys"}`` (see ``radixcache.events.recorder``):
        ``(KEYS_STORED, keys, parent_key)``, ``(KEYS_REMOVED, keys)`` and
        ``AllBlocksCleared()``, ``keys`` being the blocks' ``fast64`` keys (this indexer's own
        keys) as native-endian int64 bytes. They are counted in ``stats`` exactly as
        ``apply`` counts the equivalent ``fast64`` events, and each record is one call into
        the block table. The blocks are held on the worker's device tier (``"GPU"``, no
        group), as ``apply`` holds events that name no medium.

        Never raises for bad records: one that is not such a record is skipped and counted
        in ``stats.malformed_events``, a batch that is not iterable in
        ``stats.malformed_batches``.

        Args:
            worker: The worker id (any hashable).
            records: The batch: the records of one ``take_events()`` call, in order.

        Raises:
            TypeError: ``worker`` is None or not hashable.
        """
        if self._store is not None:
            self._store.apply_keys(worker, records)
            return
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
                ns_entry = _entry(extra_keys[0]) if extra_keys else None
            else:
                key = None if copy is None else self._key_of(copy, parent)
                if key is None:
                    key = self._parent_on_other_tier(worker, group, copy, parent)
                if key is None:
                    stats.unknown_parent += 1
                    return
                ns_entry = self._ns_of.get(key) if extra_keys else None
            keys = self._chain_keys(key, data, extra_keys, ns_entry)
            if ns_entry is not None and extra_keys:
                # A later event below these blocks tells their extra keys from the
                # namespace's by it.
                self._ns_of.update(dict.fromkeys(keys, ns_entry))
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
            own = known is None and self._direct(copy, block_hash)
            if own:
                known = block_hash
            if known is not None:
                if known == key:
                    duplicates += 1
                    continue
                if own:
                    copy.direct -= 1
                else:
                    self._unpublish(copy, block_hash)
                index.unhold(known, cid)
            if type(block_hash) is int and block_hash == key:
                copy.direct += 1
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
                    if self._direct(copy, block_hash):
                        self._index.unhold(block_hash, copy.cid)
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
                    if not self._direct(copy, block_hash):
                        unknown += 1
                        continue
                    key = block_hash
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
        """The keys of the blocks of ``data`` below ``seed``: the page hash chain, each block
        whose ``extra_keys`` entry is neither None nor the namespace's own (``ns_entry``)
        folded with it, the next blocks chained from the folded key."""
        page_bytes = self._page_bytes
        if not extra_keys:
            return _page_keys(seed, data, page_bytes)
        pages = len(data) // page_bytes
        folds = []
        for i, raw in enumerate(extra_keys[:pages]):
            entry = _entry(raw)
            if entry is not None and entry != ns_entry:
                folds.append((i, entry))
        if not folds:
            return _page_keys(seed, data, page_bytes)
        keys: list = []
        start = 0
        for i, entry in folds:
            part = _page_keys(seed, data[start * page_bytes:(i + 1) * page_bytes], page_bytes)
            part[-1] = seed = _fold(part[-1], entry)
            keys += part
            start = i + 1
        if start < pages:
            keys += _page_keys(seed, data[start * page_bytes:pages * page_bytes], page_bytes)
        return keys

    # -- queries -----------------------------------------------------------------------
    def block_keys(self, tokens: Any, extra_key: Any = None,
                   block_extra_keys: Any = None) -> list:
        """Compute the indexer keys of the full blocks of ``tokens``.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int, or a tuple (an
                ``extra_keys`` entry of several keys, e.g. SGLang's ``(lora_name,
                cache_salt)``).
            block_extra_keys: Per-block extra keys, as vLLM's ``BlockStored.extra_keys``:
                one entry (None, or a tuple of keys such as an image's hash) per block,
                from the first; missing entries are None. None: no block has any.

        Returns:
            One key (an int) per full block of ``block_size`` tokens, each chained to the
            previous one.

        Raises:
            TypeError: tokens that are not integers, an ``extra_key`` of another type, or
                ``block_extra_keys`` that is not a list or tuple of entries.
            ValueError: the first block's entry names another namespace than ``extra_key``.
            OverflowError: a token that does not fit in int64.
        """
        data = tokens_le_bytes(tokens)
        namespace, entries, ns_entry = self._query_namespace(extra_key, block_extra_keys)
        return self._chain_keys(_root_key(namespace), data, entries, ns_entry)

    def overlap(self, tokens: Any, extra_key: Any = None, medium: Optional[str] = MEDIUM_GPU,
                block_extra_keys: Any = None) -> dict:
        """Tell how many leading blocks of ``tokens`` each worker holds.

        Only full blocks count; a block counts when any of the worker's KV-cache groups
        holds it on tier ``medium``.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int, or a tuple (see
                ``block_keys``).
            medium: The tier counted: ``"GPU"`` (the device, also events naming no medium)
                by default, e.g. ``"CPU"`` for a host tier (SGLang's ``"CPU_PINNED"`` is
                the same tier).
            block_extra_keys: Per-block extra keys (an image's hash on the blocks of its
                placeholder tokens, ...), as ``block_keys`` takes them: a block matches only
                a block stored with the same entry.

        Returns:
            ``{worker: leading blocks held}`` for every worker that holds at least one.

        Raises:
            TypeError: tokens that are not integers, an ``extra_key`` of another type, a
                ``medium`` that is not a str, or ``block_extra_keys`` of another type.
            ValueError: the first block's entry names another namespace than ``extra_key``.
            OverflowError: a token that does not fit in int64.
        """
        if medium is None:
            medium = MEDIUM_GPU
        elif not isinstance(medium, str):
            raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
        medium = _tier(medium)
        if block_extra_keys is None and type(extra_key) is not tuple:
            namespace = encode_namespace(extra_key)
            if type(tokens) is list:
                try:  # read by the block index itself: one call for the whole query
                    return self._overlap(tokens, namespace, medium)
                except (TypeError, OverflowError):
                    pass  # not all exact int64s: checked and read as any sequence below
            elif _int64_array(tokens):
                return self._overlap(tokens, namespace, medium)  # read in place
            return self._overlap(tokens_le_bytes(tokens), namespace, medium)
        data = tokens_le_bytes(tokens)
        namespace, entries, ns_entry = self._query_namespace(extra_key, block_extra_keys)
        seed = _root_key(namespace)
        keys = self._chain_keys(seed, data, entries, ns_entry)
        if keys == _page_keys(seed, data, self._page_bytes):
            return self._overlap(data, namespace, medium)  # no block folded: one call
        return self._overlap_keys(keys, medium)

    @staticmethod
    def _query_namespace(extra_key: Any, block_extra_keys: Any) -> tuple:
        """``(namespace bytes, entries, namespace entry)`` of a query (see ``block_keys``)."""
        if type(extra_key) is tuple:
            namespace, ns_entry = _namespace_bytes(extra_key), _entry(extra_key)
        else:
            namespace = encode_namespace(extra_key)
            ns_entry = None if extra_key is None else (canonical_namespace(extra_key),)
        if block_extra_keys is None:
            return namespace, None, ns_entry
        if type(block_extra_keys) not in (list, tuple) or not all(
                entry is None or isinstance(entry, (list, tuple)) for entry in block_extra_keys):
            raise TypeError("block_extra_keys must be a list or tuple of entries (None, or a "
                            "tuple of keys)")
        entries = list(block_extra_keys)
        first = _entry(entries[0]) if entries else None
        if first is not None and first != ns_entry:
            if extra_key is not None:
                raise ValueError(f"the first block's extra keys {first!r} name another "
                                 f"namespace than extra_key {extra_key!r}")
            # A sequence's first entry is its namespace, as in a stored root event.
            ns_entry = first
            namespace = _namespace_bytes(_entry_namespace(first))
        return namespace, entries, ns_entry

    def _overlap_keys(self, keys: list, medium: Any) -> dict:
        """``overlap`` of blocks given by their keys: the leading ones each worker holds."""
        if self._store is not None:
            return self._store.overlap(array("q", keys).tobytes(), medium)
        owners, workers, _ = self._owners(medium)
        n_owners = len(owners)
        depths: dict = {}
        active: Optional[list] = None
        for depth, key in enumerate(keys):
            held = dict.fromkeys(owners[c] for c in self._index.holders(key)
                                 if c < n_owners and owners[c] >= 0)
            if active is None:
                active = list(held)
            else:
                for owner in active:
                    if owner not in held:
                        depths[owner] = depth
                active = [owner for owner in active if owner in held]
            if not active:
                break
        for owner in active or ():
            depths[owner] = len(keys)
        return {workers[owner]: depth for owner, depth in depths.items()}

    def _overlap(self, data: Any, namespace: bytes, medium: Any = MEDIUM_GPU) -> dict:
        # The index hashes the query's blocks (``data``: int64 bytes, a list of ints, or an
        # int64 array as ``_int64_array`` accepts it) and walks them in one call, as far as
        # any worker's run goes; workers reach it as positions in ``workers``.
        if self._store is not None:
            if type(data) is not bytes:
                # An int64 array the caller checked is its own bytes; a list is read in C.
                data = (data.tobytes() if _int64_array(data)
                        else _ids_le_bytes(data))  # TypeError/OverflowError as the index's
            return self._store.overlap(_core.blocks.page_hash_bytes(
                _root_key(namespace), data, self._page_bytes), medium)
        _, workers, owners = self._owners(medium)
        return {workers[owner]: depth for owner, depth in self._index.overlap(
            _root_key(namespace), data, self._page_bytes, owners)}

    # -- a shared store --------------------------------------------------------------------
    def resume_seq(self, worker: Hashable) -> Optional[int]:
        """Tell where ``worker``'s stream resumes: the sequence number after the last batch
        stored for it (what a subscriber's ``start_seq`` asks the publisher to replay from).

        Args:
            worker: The worker id.

        Returns:
            The sequence number, or None: no store, no stored batch, or the store failed.
        """
        return None if self._store is None else self._store.resume_seq(worker)

    def renew(self, workers: Optional[Iterable[Hashable]] = None) -> None:
        """Renew the leases of the workers this indexer owns (their batches also renew them).

        Call it for workers known to be alive but quiet, well within ``lease_s``. Nothing
        without a store.

        Args:
            workers: The worker ids (None: every worker this indexer owns).
        """
        if self._store is not None:
            self._store.renew(list(self._store._owned) if workers is None else workers)

    def collect_expired(self, limit: int = 100) -> list:
        """Drop the blocks of the workers whose lease expired (any router may call it).

        Reads the leases by expiry and each dead worker's own list of blocks: no scan of
        the store. Nothing without a store.

        Args:
            limit: At most this many workers per call.

        Returns:
            The workers collected.
        """
        return [] if self._store is None else self._store.collect(limit)

    def close(self) -> None:
        """Close the connection to the store (nothing without one)."""
        if self._store is not None:
            self._store.close()

    def __repr__(self) -> str:
        if self._store is not None:
            return (f"KvIndexer(block_size={self.block_size}, store={self._store.url!r}, "
                    f"namespace={self._store.namespace!r})")
        return (f"KvIndexer(block_size={self.block_size}, workers={len(self._copies)}, "
                f"blocks={len(self._index)})")




IndexerStats.__module__ = "radixcache.router"  # pickles name the public module, as before

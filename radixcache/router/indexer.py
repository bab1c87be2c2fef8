"""``KvIndexer``: which blocks each worker holds, learned from its KV events (see
``radixcache.router``), and ``IndexerStats``, what it applied and skipped.

The public class and its queries. Underneath, by job: ``keys`` (what a block's key is made
of: namespaces, extra keys, tiers, the chain), ``copies`` (each copy's holdings in the block
table and its map of publisher hashes), ``ingest`` (events applied to the copies, counted in
``stats``); with ``store=``, ``redis_store`` keeps the index in Redis or Valkey and this
class hands it its calls.
"""

from __future__ import annotations

from array import array
from typing import Any, Hashable, Iterable, Optional

from .. import _core
from ..events import MEDIUM_GPU, encode_namespace, tokens_le_bytes
from .ingest import EventIngest
from .keys import (
    _ids_le_bytes,
    _int64_array,
    _page_keys,
    _root_key,
    _tier,
    query_namespace,
)
from .stats import IndexerStats

__all__ = ["IndexerStats", "KvIndexer"]


class KvIndexer(EventIngest):
    """Which blocks each worker holds, learned from its KV events; see the module docstring.

    Workers are any hashable ids. Apply each worker's batches in the order it published them:
    ``apply(worker, events)`` for event objects, ``apply_payload(worker, payload, seq)`` for
    a raw msgpack payload, ``apply_keys(worker, records)`` for the block-key records of a
    cache in the same process (``event_options={"record": "keys"}``). ``len(indexer)`` is
    the number of distinct blocks held. Not thread-safe: serialise ``apply`` with the
    queries.

    Blocks are held per copy: a worker's blocks on one tier (the event's ``medium``,
    ``"GPU"`` when it names none; SGLang's ``"CPU_PINNED"`` is ``"CPU"``) in one KV-cache
    group (``group_idx``; None and 0 are the first group). A removal removes that copy only,
    and a block stays held while any of the copy's publisher hashes maps to it. ``overlap``
    counts the device tier (``"GPU"``) by default, any group; ``medium=`` reports another
    tier, None every tier. Memory is one entry per (block, copy) and one per distinct block;
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
        super().__init__(block_size)
        self._store = None
        if store is not None:
            from .redis_store import RedisStore  # only here: importing radixcache needs no redis

            self._store = RedisStore(self, store, namespace, lease_s, owner)

    @property
    def workers(self) -> list:
        """The workers holding at least one block (any tier): in the order they last began
        to hold blocks (nothing is kept for a worker that holds nothing, so one that leaves
        and comes back comes last); with a store, in the order the store first saw them."""
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
        else:
            self._apply_events(worker, events)

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
        return self._apply_payload(worker, payload, seq)

    def apply_payloads(self, worker: Hashable, payloads: Iterable[bytes]) -> int:
        """Apply a run of ``worker``'s wire payloads, in order: what ``apply_payload`` on
        each does, in one call (a subscriber's batches as they came).

        Args:
            worker: The worker id (any hashable).
            payloads: The payloads, in the order they were published.

        Returns:
            How many were applied; the others were malformed (counted in
            ``stats.malformed_batches``).

        Raises:
            TypeError: ``worker`` is None or not hashable (before anything is applied).
        """
        if type(payloads) is not list:
            payloads = list(payloads)
        if self._store is not None:
            self._check_worker(worker)  # refused as in process, even with no payload
            return sum(self._store.apply_payload(worker, p) for p in payloads)
        return self._apply_payloads(worker, payloads)

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
        else:
            self._apply_keys(worker, records)

    # -- queries -----------------------------------------------------------------------
    def block_keys(self, tokens: Any, extra_key: Any = None,
                   block_extra_keys: Any = None) -> list:
        """Compute the indexer keys of the full blocks of ``tokens``.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int, or a tuple read as a
                stored sequence's first ``extra_keys`` entry is (a one-key tuple is its
                key, ``()`` no namespace, a longer one the tuple, e.g. SGLang's
                ``(lora_name, cache_salt)``).
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
        data = None
        if type(tokens) is list:
            try:  # exact int64s, read in one pass by the block module
                data = _ids_le_bytes(tokens)
            except (TypeError, OverflowError):
                pass  # checked and read as any sequence below
        if data is None:
            data = tokens_le_bytes(tokens)
        namespace, entries, ns_entry = query_namespace(extra_key, block_extra_keys)
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
                the same tier); None: every tier (a block counts when the worker holds it
                on any tier, as ``blocks_held(worker, None)`` counts every tier).
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
        if medium is not None:  # None: every tier
            if not isinstance(medium, str):
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
        namespace, entries, ns_entry = query_namespace(extra_key, block_extra_keys)
        seed = _root_key(namespace)
        keys = self._chain_keys(seed, data, entries, ns_entry)
        if keys == _page_keys(seed, data, self._page_bytes):
            return self._overlap(data, namespace, medium)  # no block folded: one call
        return self._overlap_keys(keys, medium)

    def overlap_keys(self, keys: Any, medium: Any = MEDIUM_GPU) -> dict:
        """Tell how many leading blocks of a list of keys each worker holds: ``overlap`` from
        any point of a chain (a suffix of what ``block_keys`` gives), on one tier or several.

        Args:
            keys: Block keys (int64 ints), in order.
            medium: A tier (``"GPU"`` by default) or a tuple of tiers, a block counting when
                the worker holds it on any of them.

        Returns:
            ``{worker: leading keys held}`` for every worker that holds at least one.

        Raises:
            TypeError: a key that is not an int, or a tier that is not a str.
            OverflowError: a key that does not fit in int64.
        """
        media = medium if type(medium) is tuple else (medium,)
        if not media or not all(isinstance(m, str) for m in media):
            raise TypeError("medium must be a str or a tuple of str")
        media = tuple(_tier(m) for m in media)
        keys = array("q", keys).tolist()  # TypeError / OverflowError, as block_keys'
        return self._overlap_keys(keys, media if len(media) > 1 else media[0])

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

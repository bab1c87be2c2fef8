"""Routing requests across workers: a KV-aware block index fed by events, and routing policies.

``KvIndexer`` mirrors which blocks each worker's prefix cache holds, learned only from the
KV events the workers publish (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, as
``RadixCache.take_events()`` returns them or as ``ZmqEventSubscriber.receive()`` delivers
them; ``apply_payload`` decodes a raw wire payload). ``overlap(tokens, extra_key)`` says how
many leading blocks of a request each worker holds.

Block keys are computed by the indexer itself, not taken from the publisher: a block's key
chains its parent's key and the block's token ids (and, for a sequence's first block, the
namespace), so any publisher that sends token ids (radixcache, vLLM, SGLang) indexes the
same way and a query hashes its tokens the same way. Per worker, a map from the publisher's
block hash to the indexer's key resolves ``parent_block_hash`` and ``BlockRemoved``.
Memory is proportional to the blocks held: one entry per (worker, block) in that map and one
per distinct block (a bit mask of its holders), freed when its last holder removes it. The
keys use Python's own hash, so they are stable within a process only: each router process
keeps its own index.

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


from ._options import DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    decode_batch,
    encode_namespace,
    tokens_le_bytes,
)

__all__ = ["DEFAULT_LOAD_WEIGHT", "ROUTING_POLICIES", "IndexerStats", "KvIndexer", "Router"]

_LITTLE_ENDIAN = sys.byteorder == "little"
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

    @property
    def skipped(self) -> int:
        """Events or blocks that could not be applied (everything but the first six counts)."""
        return (self.unknown_parent + self.unknown_removals + self.wrong_block_size
                + self.malformed_events + self.malformed_batches)

    def as_dict(self) -> dict:
        """The counts by name.

        Returns:
            ``{field name: count}`` for every field, in declaration order.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(block_size)


def _event_token_bytes(token_ids: Any) -> bytes:
    """An event's token ids as int64 little-endian bytes; a tuple or list (what events hold)
    goes through ``array('q')``, cheaper than numpy for Python ints."""
    if _LITTLE_ENDIAN and type(token_ids) in (tuple, list):
        return array("q", token_ids).tobytes()  # TypeError/OverflowError for non-int64 items
    return tokens_le_bytes(token_ids)


def _root_key(namespace: bytes) -> int:
    # The chain of a sequence starts from its namespace, so equal tokens in two namespaces
    # get different keys.
    return hash(("radixcache-root", namespace))


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


class KvIndexer:
    """Which blocks each worker holds, learned from its KV events; see the module docstring.

    Workers are any hashable ids. Apply each worker's batches in the order it published them:
    ``apply(worker, events)`` for event objects, ``apply_payload(worker, payload, seq)`` for
    a raw msgpack payload. ``len(indexer)`` is the number of distinct blocks held. Not
    thread-safe: serialise ``apply`` with the queries.

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
        # indexer key -> bit mask of the worker slots holding that block
        self._holders: dict = {}
        # worker slot -> {publisher hash: indexer key}
        self._published: list = []
        self._slot_of: dict = {}
        self._worker_of: list = []
        self._free_slots: list = []
        self.stats = IndexerStats()

    # -- workers -----------------------------------------------------------------------
    def _slot(self, worker: Hashable) -> int:
        try:
            slot = self._slot_of.get(worker)
        except TypeError:
            raise TypeError(f"worker must be a hashable id, got {type(worker).__name__}") from None
        if slot is None:
            if worker is None:
                raise TypeError("worker must be a hashable id, not None")
            if self._free_slots:
                slot = self._free_slots.pop()
                self._worker_of[slot] = worker
            else:
                slot = len(self._published)
                self._published.append({})
                self._worker_of.append(worker)
            self._slot_of[worker] = slot
        return slot

    @property
    def workers(self) -> list:
        """The workers the indexer knows (that sent at least one batch), in first-seen order
        of their slot."""
        return [w for w in self._worker_of if w is not None]

    def blocks_held(self, worker: Hashable) -> int:
        """Count the blocks ``worker`` holds.

        Args:
            worker: The worker id.

        Returns:
            The number of blocks (0 for an unknown worker).
        """
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._published[slot])

    def __len__(self) -> int:
        """``len(indexer)``: the distinct blocks held by at least one worker.

        Returns:
            The number of blocks.
        """
        return len(self._holders)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` and every block it held (it left the fleet, or restarted).

        Args:
            worker: The worker id; an unknown one is ignored.
        """
        slot = self._slot_of.pop(worker, None)
        if slot is None:
            return
        self._clear_slot(slot)
        self._worker_of[slot] = None
        self._free_slots.append(slot)

    def _clear_slot(self, slot: int) -> None:
        holders = self._holders
        keep = ~(1 << slot)
        for key in set(self._published[slot].values()):
            mask = holders.get(key, 0) & keep
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
        self._published[slot] = {}

    # -- events ------------------------------------------------------------------------
    def apply(self, worker: Hashable, events: Iterable[Any]) -> None:
        """Apply one batch of ``worker``'s events, in order.

        Never raises for bad events: what cannot be applied is skipped and counted in
        ``stats``.

        Args:
            worker: The worker id (any hashable).
            events: The batch: an iterable of ``BlockStored``, ``BlockRemoved`` and
                ``AllBlocksCleared`` (as ``RadixCache.take_events()`` returns them), or a
                subscriber's ``ReceivedBatch``.
        """
        slot = self._slot(worker)
        stats = self.stats
        stats.batches += 1
        if isinstance(events, ReceivedBatch):
            events = events.events
        try:
            events = list(events)
        except TypeError:
            stats.malformed_batches += 1
            return
        for event in events:
            stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(slot, event)
            elif isinstance(event, BlockRemoved):
                self._removed(slot, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear_slot(slot)
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
            ``stats.malformed_batches``).
        """
        self._slot(worker)
        try:
            batch = decode_batch(payload, seq)
        except (ValueError, TypeError):
            self.stats.malformed_batches += 1
            return False
        self.apply(worker, batch.events)
        return True

    def _stored(self, slot: int, event: BlockStored) -> None:
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
            data = _event_token_bytes(token_ids)
            if len(data) != len(hashes) * self._page_bytes:
                raise ValueError("token_ids do not fill the blocks")
            published = self._published[slot]
            parent = event.parent_block_hash
            namespace_key = None
            if parent is None:
                namespace_key = _root_key(_namespace_bytes(_event_namespace(event)))
                key = namespace_key
            else:
                key = published.get(parent)
                if key is None:
                    stats.unknown_parent += 1
                    return
            page_bytes = self._page_bytes
            pairs = []
            for start, block_hash in zip(range(0, len(data), page_bytes), hashes):
                if type(block_hash) not in _HASH_TYPES:
                    block_hash = operator.index(block_hash)
                key = hash((key, data[start:start + page_bytes]))
                pairs.append((block_hash, key))
        except (TypeError, ValueError, OverflowError, LookupError):  # LookupError: extra_keys[0]
            stats.malformed_events += 1
            return
        holders = self._holders
        holders_get = holders.get
        bit = 1 << slot
        stored = 0
        for block_hash, key in pairs:
            known = published.get(block_hash)
            if known is not None:
                if known == key:
                    stats.duplicate_blocks += 1
                    continue
                # The publisher reused a hash for other content: the newer block wins.
                self._drop(slot, block_hash, known)
            published[block_hash] = key
            holders[key] = holders_get(key, 0) | bit
            stored += 1
        stats.stored_blocks += stored

    def _drop(self, slot: int, block_hash: int, key: int) -> None:
        del self._published[slot][block_hash]
        mask = self._holders.get(key, 0) & ~(1 << slot)
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _removed(self, slot: int, event: BlockRemoved) -> None:
        stats = self.stats
        published = self._published[slot]
        try:
            hashes = [h if type(h) in _HASH_TYPES else operator.index(h)
                      for h in event.block_hashes]
        except TypeError:
            stats.malformed_events += 1
            return
        holders = self._holders
        keep = ~(1 << slot)
        removed = 0
        for block_hash in hashes:
            key = published.pop(block_hash, None)
            if key is None:
                stats.unknown_removals += 1
                continue
            mask = holders.get(key, 0) & keep
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)
            removed += 1
        stats.removed_blocks += removed

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
        key = _root_key(encode_namespace(extra_key))
        page_bytes = self._page_bytes
        keys = []
        for start in range(0, len(data) - page_bytes + 1, page_bytes):
            key = hash((key, data[start:start + page_bytes]))
            keys.append(key)
        return keys

    def overlap(self, tokens: Any, extra_key: Any = None) -> dict:
        """Tell how many leading blocks of ``tokens`` each worker holds.

        Only full blocks count.

        Args:
            tokens: A 1-D integer sequence (list, tuple, numpy array, CPU tensor).
            extra_key: The namespace: None, str, bytes or int.

        Returns:
            ``{worker: leading blocks held}`` for every worker that holds at least one.

        Raises:
            TypeError: tokens that are not integers, or an ``extra_key`` of another type.
            OverflowError: a token that does not fit in int64.
        """
        return self._overlap(tokens_le_bytes(tokens), encode_namespace(extra_key))

    def _overlap(self, data: bytes, namespace: bytes) -> dict:
        key = _root_key(namespace)
        holders = self._holders
        page_bytes = self._page_bytes
        counts: dict = {}
        active = -1
        depth = 0
        for start in range(0, len(data) - page_bytes + 1, page_bytes):
            key = hash((key, data[start:start + page_bytes]))
            mask = holders.get(key, 0) & active
            if mask != active and depth:
                self._credit(active & ~mask, depth, counts)
            active = mask
            if not active:
                break
            depth += 1
        if depth and active:
            self._credit(active, depth, counts)  # held every full block of the query
        return counts

    def _credit(self, mask: int, depth: int, counts: dict) -> None:
        workers = self._worker_of
        while mask:
            low = mask & -mask
            counts[workers[low.bit_length() - 1]] = depth
            mask ^= low

    def __repr__(self) -> str:
        return (f"KvIndexer(block_size={self.block_size}, workers={len(self._slot_of)}, "
                f"blocks={len(self._holders)})")


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
      SHA-256, the same in every process) of the first ``prefix_blocks`` blocks of
      ``block_size`` tokens and the namespace: a prefix always lands on the same worker.
    - ``cache-aware``: the lowest ``prefill_weight * (tokens not cached on the worker) +
      load_weight * load``, the cached tokens being the worker's overlap in ``indexer`` times
      ``block_size``; ties go to the lower load, then to the worker routed to least.

    Load is whatever the caller reports, in tokens of work queued or running: ``add_load``
    when a request is dispatched, ``remove_load`` as its work completes (``set_load`` for a
    router that polls its workers instead). Feed the indexer with each worker's events
    (``router.indexer.apply(worker, events)``); worker ids in the events are the ints
    ``0 .. num_workers-1``. Not thread-safe: serialise ``route`` with the load reports and the
    indexer's ``apply``.

    Args:
        num_workers: How many workers, an int >= 1.
        policy: One of ``ROUTING_POLICIES`` (default ``"cache-aware"``).
        block_size: Tokens per block, the workers' page size (default: the ``indexer``'s,
            or ``DEFAULT_BLOCK_SIZE``); ``prefix-hash`` and ``cache-aware`` count in blocks.
        indexer: A ``KvIndexer`` to read overlaps from (default: a new one, ``router.indexer``).
        seed: Seed of the ``random`` policy.
        prefix_blocks: How many leading blocks ``prefix-hash`` hashes, an int >= 1.
        prefill_weight: ``cache-aware``'s weight of the tokens a worker would prefill.
        load_weight: ``cache-aware``'s weight of a worker's load (default
            ``DEFAULT_LOAD_WEIGHT``: 10 tokens of queued work weigh as much as one token of
            prefill saved).
        virtual_nodes: Points per worker on ``prefix-hash``'s ring, an int >= 1.

    Raises:
        TypeError: an argument of the wrong type (``policy`` not a str, ``indexer`` not a
            ``KvIndexer``, a count or weight that is not a number).
        ValueError: an unknown policy, a count < 1, a negative or infinite weight, or a
            ``block_size`` that differs from the ``indexer``'s.
    """

    def __init__(self, num_workers: int, policy: str = "cache-aware", *,
                 block_size: Optional[int] = None,
                 indexer: Optional[KvIndexer] = None, seed: int = 0, prefix_blocks: int = 1,
                 prefill_weight: float = 1.0, load_weight: float = DEFAULT_LOAD_WEIGHT,
                 virtual_nodes: int = 64) -> None:
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
        for name, value in (("prefix_blocks", prefix_blocks), ("virtual_nodes", virtual_nodes)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.prefix_blocks = int(prefix_blocks)
        self.prefill_weight = _check_weight("prefill_weight", prefill_weight)
        self.load_weight = _check_weight("load_weight", load_weight)
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
        point = _stable_hash(b"prefix", namespace,
                             data[: self.prefix_blocks * self.block_size * 8])
        i = bisect_right(self._ring, point)
        return self._ring_workers[i % len(self._ring_workers)]

    def _cache_aware(self, data: bytes, namespace: bytes) -> int:
        data_len = len(data) // 8
        overlap = self.indexer._overlap(data, namespace)
        self.last_overlap = overlap
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

    def __repr__(self) -> str:
        return (f"Router(num_workers={self.num_workers}, policy={self.policy!r}, "
                f"block_size={self.block_size}, loads={list(self._loads)})")


def _stable_hash(tag: bytes, *parts: Any) -> int:
    """A 64-bit hash that is the same in every process (for the prefix-hash ring)."""
    digest = hashlib.sha256(tag)
    for part in parts:
        if isinstance(part, int):
            part = part.to_bytes(8, "big", signed=True)
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return int.from_bytes(digest.digest()[:8], "big")

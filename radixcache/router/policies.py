"""``Router``: picks a worker per request with one of ``ROUTING_POLICIES`` (see
``radixcache.router``); ``cache-aware`` reads a ``KvIndexer``'s overlaps.
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from typing import Any, Optional

from .._options import DEFAULT_HOST_WEIGHT, DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from .._validate import check_int, is_int, is_real
from ..events import MEDIUM_CPU, MEDIUM_GPU, encode_namespace, tokens_le_bytes
from .indexer import KvIndexer
from .keys import _int64_array, _namespace_bytes, _page_keys, _root_key

# DEFAULT_LOAD_WEIGHT and ROUTING_POLICIES live in _options (the command line reads them).

#: ``Router``'s block size (tokens per block) when neither it nor an indexer is given.
DEFAULT_BLOCK_SIZE = 16


def _check_weight(name: str, value: Any) -> float:
    if not is_real(value):
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
    the indexer holds blocks for, rather than ignoring its blocks. Not thread-safe: serialise
    ``route`` with the load reports and the indexer's ``apply``.

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
        self.num_workers = check_int(num_workers, "num_workers", 1)
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
            block_size = check_int(block_size, "block_size", 1)
            if indexer.block_size != block_size:
                raise ValueError(f"indexer.block_size {indexer.block_size} differs from "
                                 f"block_size {block_size}")
        self.indexer = indexer
        self.block_size = indexer.block_size
        seed = check_int(seed, "seed")
        if isinstance(prefix_blocks, str):
            if prefix_blocks != "auto":
                raise ValueError(f"prefix_blocks must be an int >= 1 or 'auto', got "
                                 f"{prefix_blocks!r}")
            checks = (("virtual_nodes", virtual_nodes),)
        else:
            checks = (("prefix_blocks", prefix_blocks), ("virtual_nodes", virtual_nodes))
        for name, value in checks:
            check_int(value, name, 1)
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
        if not is_int(worker):
            raise TypeError(f"worker must be an int, got {type(worker).__name__}")
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} out of range [0, {self.num_workers})")
        return int(worker)

    @staticmethod
    def _check_tokens(tokens: Any) -> int:
        if not is_int(tokens):
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
        policy = self.policy
        # An int64 array needs no check: cache-aware reads it in place (the block index
        # hashes it as it is) and the policies that ignore the tokens skip the copy;
        # prefix-hash slices the bytes.
        data = tokens if policy != "prefix-hash" and _int64_array(tokens) else \
            tokens_le_bytes(tokens)
        namespace = encode_namespace(extra_key)
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
            worker = min(self._cache_aware_keys(data, namespace, range(self.num_workers)))[3]
        self._routed[worker] += 1
        return worker

    def rank(self, tokens: Any, extra_key: Any = None, workers: Any = None) -> list:
        """Order the workers for a request, best first, and count it as routed to the first.

        The first is the worker ``route`` would pick among ``workers`` (the same worker, and
        the same state changes, when ``workers`` is None: every worker); the others follow
        in the policy's order of preference, for a caller that falls back down the list
        (an endpoint picker's ordered endpoints): ``cache-aware`` and ``least-loaded`` by
        their scores, ``round-robin`` in turn from the first, ``random`` in turn after a
        random first, ``prefix-hash`` in the order the ring meets them after the prompt's
        point (so a prefix's fallback is stable too).

        Args:
            tokens: The request's prompt, a 1-D integer sequence (as ``route`` takes it).
            extra_key: Its namespace: None, str, bytes or int.
            workers: The eligible workers (ints ``0 .. num_workers-1``; duplicates count
                once), or None for every worker.

        Returns:
            The eligible workers, best first; an empty list when none is eligible (nothing
            is counted then).

        Raises:
            TypeError: tokens that are not integers, an ``extra_key`` of another type, or a
                worker that is not an int.
            ValueError: a worker out of range.
            OverflowError: a token that does not fit in int64.
        """
        policy = self.policy
        data = tokens if policy != "prefix-hash" and _int64_array(tokens) else \
            tokens_le_bytes(tokens)
        # A tuple is a namespace of several keys (a LoRA adapter and a cache salt), keyed as
        # the indexer keys such a sequence's events.
        namespace = _namespace_bytes(extra_key) if type(extra_key) is tuple else \
            encode_namespace(extra_key)
        n = self.num_workers
        if workers is None:
            eligible = list(range(n))
        else:
            eligible = list(dict.fromkeys(self._check_worker(w) for w in workers))
        if not eligible:
            return []
        if policy == "round-robin":
            start = self._next
            ordered = sorted(eligible, key=lambda w: (w - start) % n)
            self._next = (ordered[0] + 1) % n
        elif policy == "random":
            first = eligible[self._rng.randrange(len(eligible))]
            ordered = sorted(eligible, key=lambda w: (w - first) % n)
        elif policy == "least-loaded":
            loads, routed = self._loads, self._routed
            ordered = sorted(eligible, key=lambda w: (loads[w], routed[w], w))
        elif policy == "prefix-hash":
            ring_workers = self._ring_workers
            at = self._prefix_point(data, namespace)
            wanted = set(eligible)
            ordered = []
            for step in range(len(ring_workers)):
                worker = ring_workers[(at + step) % len(ring_workers)]
                if worker in wanted:
                    ordered.append(worker)
                    wanted.discard(worker)
                    if not wanted:
                        break
            ordered.extend(sorted(wanted))  # never reached: every worker is on the ring
        else:
            ordered = [key[3] for key in sorted(self._cache_aware_keys(data, namespace,
                                                                       eligible))]
        self._routed[ordered[0]] += 1
        return ordered

    def _prefix_worker(self, data: bytes, namespace: bytes) -> int:
        return self._ring_workers[self._prefix_point(data, namespace) % len(self._ring_workers)]

    def _prefix_point(self, data: bytes, namespace: bytes) -> int:
        """The ring position of a prompt's hashed prefix (its worker is the one there)."""
        page_bytes = self.block_size * 8
        if self.prefix_blocks == "auto":
            depth = self._family_depth(data, namespace, page_bytes)
        else:
            depth = self.prefix_blocks
        point = _stable_hash(b"prefix", namespace, data[: depth * page_bytes] if depth else data)
        return bisect_right(self._ring, point)

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

    def _cache_aware_keys(self, data: Any, namespace: bytes, workers: Any) -> list:
        """``cache-aware``'s sort key of each of ``workers``: ``(score, load, routed,
        worker)``, the lowest best."""
        data_len = len(data) // 8 if type(data) is bytes else len(data)
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
        get = overlap.get
        return [(prefill_weight * (data_len - get(worker, 0) * block_size)
                 + load_weight * loads[worker], loads[worker], routed[worker], worker)
                for worker in workers]

    def _has_host_blocks(self) -> bool:
        """Whether the indexer holds any block on a worker's host tier."""
        indexer = self.indexer
        if indexer._store is not None:  # one round trip, not one per worker
            return indexer._store.holds_on(MEDIUM_CPU)
        if not indexer._owners(MEDIUM_CPU)[1]:  # no worker has a copy on the host tier
            return False
        return any(indexer.blocks_held(worker, MEDIUM_CPU) for worker in indexer.workers)

    def _with_host_blocks(self, data: Any, namespace: bytes, overlap: dict) -> dict:
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
        if is_int(worker) and 0 <= worker < self.num_workers:
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

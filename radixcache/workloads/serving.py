"""The serving loop: ``ServingLoop`` replays requests against a cache a step at a time, the
way an inference server does (match, lock, evict, insert, unlock), over a ``KVPool`` (and a
``HostPool`` for a cache with a host tier); ``serve`` runs it over a whole workload and
returns a ``ServeResult``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .pools import HostPool, KVPool, as_cache_array
from .requests import FRESH_TOKEN_BASE, Request, take_buffer

__all__ = ["Admission", "HitRates", "ServeResult", "ServingLoop", "serve"]


class HitRates:
    """The hit rates of a replay's result, split by where the hits were found.

    A mixin for result classes with ``prompt_tokens``, ``cached_tokens`` (device and host
    hits) and ``host_cached_tokens`` (``ServeResult``, ``radixcache.fleet.FleetResult``).
    """

    __slots__ = ()

    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int

    @property
    def host_hit_rate(self) -> float:
        """``host_cached_tokens / prompt_tokens``: the share of prompt tokens found only on
        the host."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """The share of prompt tokens found on the device (``hit_rate - host_hit_rate``)."""
        device = self.cached_tokens - self.host_cached_tokens
        return device / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class ServeResult(HitRates):
    """What one replay did (``serve``, ``ServingLoop.result``).

    Rejected requests (too big for the pool even after evicting everything unlocked) are
    counted in ``requests``, ``prompt_tokens`` and ``cached_tokens`` too: their lookup was made.
    With a host tier, ``cached_tokens`` counts the prompt tokens found on the device and those
    found only on the host (loaded back before the request runs): ``host_cached_tokens`` says
    how many of them were on the host.

    Attributes:
        requests: Requests replayed.
        rejected: Requests that did not fit in the pool.
        prompt_tokens: Prompt tokens looked up.
        cached_tokens: Prompt tokens found cached.
        hit_rate: ``cached_tokens / prompt_tokens``.
        evicted_tokens: Tokens evicted.
        peak_tokens: The largest tree size reached, in tokens.
        seconds: Time spent inside cache calls only.
        stats: ``cache.stats()`` at the end (a ``CacheStats``).
        host_capacity: Host slots (0: no host tier).
        host_cached_tokens: Of ``cached_tokens``, those found only on the host.
        loaded_tokens: Tokens loaded back from the host to the device.
        backed_up_tokens: Tokens copied from the device to the host.
        host_evicted_tokens: Tokens evicted from the host.
    """

    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    evicted_tokens: int
    peak_tokens: int
    seconds: float
    stats: Any
    host_capacity: int = 0
    host_cached_tokens: int = 0
    loaded_tokens: int = 0
    backed_up_tokens: int = 0
    host_evicted_tokens: int = 0

    @property
    def requests_per_second(self) -> float:
        """Requests per second of cache time (0.0 when no time was measured)."""
        return self.requests / self.seconds if self.seconds > 0 else 0.0


@dataclass(eq=False)
class Admission:
    """A request the serving loop admitted: its slots are allocated and its prefix is locked.

    Attributes:
        request: The ``Request``.
        cached: Prompt tokens found cached when it was admitted.
        tokens: Prompt + output, an int64 array.
        kv: Their KV slots, an int64 tensor.
        lock_node: The node it holds locked.
        owned_from: ``kv[owned_from:]`` still belong to the request (the tree holds the slots
            before it).
        loaded: Of ``cached``, the tokens loaded back from the host tier (0 without one).
    """

    request: Request
    cached: int
    tokens: np.ndarray
    kv: Any
    lock_node: Any
    owned_from: int
    loaded: int = 0


class ServingLoop:
    """One worker's serving loop over ``cache`` and a ``KVPool(capacity)``, a step at a time.

    ``admit(request)`` matches the prompt, locks the match, evicts when the pool is short and
    allocates slots for the uncached prompt tokens and the output (None when the request does
    not fit even after evicting every unlocked entry: rejected, nothing evicted).
    ``cache_prompt(admission)`` (optional, when the prefill is done) inserts the prompt and
    moves the lock onto it. ``finish(admission)`` inserts prompt + output, frees the slots the
    tree already had (and the unaligned tail it does not cache) and unlocks. ``serve`` runs
    ``admit`` then ``finish`` per request; the fleet simulation interleaves the steps of many
    requests over time. Counters accumulate until ``result()``.

    With ``host_capacity`` (a cache made with ``host_tier=True``), the loop also runs a host
    pool of that many slots (``HostPool``), as an engine with host memory does:

    - ``admit`` first hands the cache's due write-through copies to the host
      (``write_through``, once per admission: the scheduler step; write-through policies
      only), evicting host-only entries when the host is full;
    - when the device pool is short, it evicts from the device (``write_back``: a device
      victim without a host copy is copied to the host, the cache evicting host-only entries
      in policy order to make room, and dropped only when the host is still full); a victim that
      gets no host copy leaves with its host-only children (``evict(..., free_host=...)``), so the
      device's eviction order never depends on the host's size;
    - the prompt's tokens found only on the host (``host_length``) count as cached: they get
      device slots and are loaded back (``load_back``) before the request runs; the request
      then holds its lock on the whole prefix.

    Without ``host_capacity`` the loop is exactly the one-tier loop.

    Args:
        cache: An empty ``RadixCache`` (every slot it holds must come from the pool).
        capacity: The KV pool's size in token slots.
        pool: A fresh ``KVPool(capacity)`` to use (default: a new one).
        host_capacity: Host slots, an int >= 0, or None (default): no host tier. Needs a
            cache with a host tier.
        host_pool: A fresh ``HostPool(host_capacity)`` to use (default: a new one).

    Raises:
        TypeError: a ``host_capacity`` that is not an int.
        ValueError: a non-empty cache, a ``pool`` that is used or of another capacity, a
            ``host_capacity`` < 0 or on a cache without a host tier, or a ``host_pool`` that
            is used, of another capacity, or given without ``host_capacity``.
    """

    def __init__(self, cache: Any, capacity: int, *, pool: KVPool | None = None,
                 host_capacity: int | None = None, host_pool: HostPool | None = None) -> None:
        # The slots the loop hands the cache are of the cache's kind of array.
        self._numpy = getattr(cache, "array_type", "torch") == "numpy"
        if pool is None:
            pool = KVPool(capacity)
        elif pool.capacity != capacity or pool.used:
            raise ValueError("pool must be an unused KVPool of the given capacity")
        if cache.total_size():
            raise ValueError("serve needs an empty cache (its slots must come from the pool)")
        if host_capacity is None:
            if host_pool is not None:
                raise ValueError("host_pool needs host_capacity")
        else:
            if host_pool is None:
                host_pool = HostPool(host_capacity)  # checks host_capacity
            elif host_pool.capacity != host_capacity or host_pool.used:
                raise ValueError("host_pool must be an unused HostPool of the given capacity")
            if not getattr(cache, "host_tier", False):
                raise ValueError("host_capacity needs a cache with a host tier "
                                 "(RadixCache(host_tier=True))")
            if cache.host_size():
                raise ValueError("serve needs an empty cache (its host slots must come from "
                                 "the host pool)")
        self.cache = cache
        self.pool = pool
        self.host_pool = host_pool
        self._page_size = cache.page_size
        self._next_fresh = FRESH_TOKEN_BASE
        self.seconds = 0.0
        self.requests = self.rejected = self.prompt_tokens = self.cached_tokens = 0
        self.evicted_tokens = self.peak_tokens = 0
        self.host_cached_tokens = self.loaded_tokens = self.backed_up_tokens = 0
        self.host_evicted_tokens = 0
        # write_back: device victims are backed up on eviction; the write-through policies
        # copy what the cache queued, once per step.
        self._write_back = host_pool is not None and cache.write_policy == "write_back"
        self._write_through = host_pool is not None and not self._write_back
        self._wanted = 0  # host slots a write-through copy could not get
        self._dropped = 0  # host tokens an eviction dropped with their device parent

    def admit(self, request: Request, *, wait: bool = False) -> Admission | None:
        """Admit a request: match, lock, evict if the pool is short, allocate.

        A request that cannot fit is counted as rejected, unless ``wait`` is true: then
        nothing is counted (the caller retries once running requests released their locks).

        Args:
            request: The ``Request``.
            wait: If true, a request that does not fit now is not counted as rejected.

        Returns:
            An ``Admission`` (hand it to ``cache_prompt`` and ``finish``), or None when the
            request cannot fit now (its lock is released, nothing evicted).
        """
        if self.host_pool is not None:
            return self._admit_tiered(request, wait)
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        prompt = request.prompt
        start = clock()
        match = cache.match_prefix(prompt, request.extra_key)
        cache.inc_lock_ref(match.last_node)
        self.seconds += clock() - start
        cached = match.length

        need = len(prompt) - cached + request.output_len
        short = need - pool.available
        # Evict only when that can make room: a request bigger than the pool could ever
        # free must not wipe the cache on its way to rejection.
        if 0 < short <= cache.evictable_size():
            start = clock()
            self.evicted_tokens += cache.evict(short, pool.free)
            self.seconds += clock() - start
        if need > pool.available:
            start = clock()
            cache.dec_lock_ref(match.last_node)
            self.seconds += clock() - start
            if not wait:
                self._count(request, cached)
                self.rejected += 1
            return None
        self._count(request, cached)

        full = self._sequence(request)
        return Admission(request, cached, full, self._slots(match, cached, need),
                         match.last_node, cached)

    def _sequence(self, request: Request) -> np.ndarray:
        """The request's prompt + output as one int64 array (fresh ids for an output the
        request does not give)."""
        prompt, output = request.prompt, request.output
        # A parsed trace's request may come with its prompt at the start of a buffer that has
        # room for the output: prompt + output are then made without copying the prompt.
        buffer = take_buffer(request)
        if output is not None:
            return np.concatenate((prompt, output))
        total = len(prompt) + request.output_len
        fresh = np.arange(self._next_fresh, self._next_fresh + request.output_len,
                          dtype=np.int64)
        self._next_fresh += request.output_len
        if buffer is not None and len(buffer) >= total:
            full = buffer[:total]
            full[len(prompt):] = fresh
            return full
        return np.concatenate((prompt, fresh))

    def _slots(self, match: Any, cached: int, need: int) -> Any:
        """The request's KV slots: the match's ``cached`` indices, then ``need`` taken from
        the pool, in one buffer filled once (numpy: large fresh torch allocations are much
        slower on some hosts), as the cache's kind of array."""
        slots = np.empty(cached + need, dtype=np.int64)
        if cached:
            slots[:cached] = match.indices if self._numpy else match.indices.numpy()
        self.pool._take_into(slots[cached:])
        return as_cache_array(slots, self._numpy)

    def _count(self, request: Request, cached: int) -> None:
        self.requests += 1
        self.prompt_tokens += len(request.prompt)
        self.cached_tokens += cached

    # -- the host tier ---------------------------------------------------------------------
    def _admit_tiered(self, request: Request, wait: bool) -> Admission | None:
        """``admit`` with a host pool (see the class docstring)."""
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        prompt = request.prompt
        start = clock()
        if self._write_through:
            self._copy_due()
        match = cache.match_prefix(prompt, request.extra_key)
        locked = match.last_node
        cache.inc_lock_ref(locked)
        self.seconds += clock() - start
        cached = match.length

        # The host part needs device slots too: it is loaded back.
        need = len(prompt) - cached + request.output_len
        short = need - pool.available
        if 0 < short <= cache.evictable_size():
            start = clock()
            host_evicted = self.host_evicted_tokens
            self._evict_device(short)
            if match.host_length and self.host_evicted_tokens != host_evicted:
                # The room made on the host may have taken part of the match's host-only
                # continuation (it is not locked): match again (the device part is locked).
                match = cache.match_prefix(prompt, request.extra_key)
            self.seconds += clock() - start
        host = match.host_length
        if need > pool.available:
            start = clock()
            cache.dec_lock_ref(locked)
            self.seconds += clock() - start
            if not wait:
                self._count(request, cached + host)
                self.host_cached_tokens += host
                self.rejected += 1
            return None
        self._count(request, cached + host)
        self.host_cached_tokens += host

        full = self._sequence(request)
        kv = self._slots(match, cached, need)
        lock_node = locked
        if host:
            # Load the host part back into the first slots after the device part, and hold
            # the lock on the whole prefix (the engine copies host -> device here).
            start = clock()
            cache.load_back(match, kv[cached:cached + host])
            cache.inc_lock_ref(match.last_host_node)
            cache.dec_lock_ref(locked)
            self.seconds += clock() - start
            self.loaded_tokens += host
            lock_node = match.last_host_node
        return Admission(request, cached + host, full, kv, lock_node, cached + host, host)

    def _evict_device(self, short: int) -> None:
        """Evict ``short`` device tokens, backing victims up to the host (write_back)."""
        cache = self.cache
        # write_back: a victim without a host copy is backed up; when the host has no room,
        # the cache evicts host entries in policy order (``free_host``) and asks again.
        backup = self._backup if self._write_back else None
        # The device slots of every victim in one call (``batch``): fewer calls into the pool.
        # A victim that gets no host copy leaves with its host-only children (``free_host``):
        # every victim leaves the device in policy order, whatever the host's size.
        self._dropped = 0
        freed = cache.evict(short, self.pool.free, batch=True, backup=backup,
                            free_host=self._free_dropped)
        self.evicted_tokens += freed
        self.host_evicted_tokens += self._dropped

    def _free_dropped(self, host_indices: Any) -> None:
        """``evict``'s ``free_host``: host-only nodes that left to make room for a copy,
        or with a device victim."""
        self._dropped += len(host_indices)
        self.host_pool.free(host_indices)

    def _evict_host(self, num_tokens: int) -> int:
        freed = self.cache.evict_host(num_tokens, self.host_pool.free, batch=True)
        self.host_evicted_tokens += freed
        return freed

    def _backup(self, device_indices: Any) -> Any:
        """Host slots for a copy of ``device_indices`` (None: the host is full)."""
        n = device_indices.shape[0]
        # The cache copies the answer before anything else runs: a view of the pool will do.
        host = self.host_pool._alloc_shared(n)
        if host is None:
            self._wanted = n
            return None
        self.backed_up_tokens += n
        return as_cache_array(host, self._numpy)

    def _copy_due(self) -> None:
        """Hand the write-through copies due to the host, evicting from the host for room."""
        cache, host_pool = self.cache, self.host_pool
        while True:
            self._wanted = 0
            cache.write_through(self._backup)
            wanted = self._wanted
            # A copy that missed room: evict host-only entries for it, unless it can never
            # fit (it then waits at the head of the queue, as the cache keeps it).
            if not wanted or wanted > host_pool.capacity:
                return
            self._evict_host(wanted - host_pool.available)
            if host_pool.available < wanted:
                return

    def cache_prompt(self, admission: Admission) -> None:
        """Insert the prompt (its prefill is done) and move the request's lock onto it.

        Args:
            admission: What ``admit`` returned.
        """
        prompt_len = len(admission.request.prompt)
        aligned = prompt_len - prompt_len % self._page_size
        if aligned <= admission.owned_from:
            return  # the tree already holds every full page of the prompt
        cache, clock = self.cache, time.perf_counter
        start = clock()
        inserted = cache.insert(admission.tokens[:prompt_len], admission.kv[:prompt_len],
                                admission.request.extra_key)
        cache.inc_lock_ref(inserted.last_node)
        cache.dec_lock_ref(admission.lock_node)
        self.seconds += clock() - start
        # Pages another request inserted meanwhile: the tree keeps its own slots.
        if inserted.prefix_len > admission.owned_from:
            self.pool.free(admission.kv[admission.owned_from:inserted.prefix_len])
        admission.owned_from = aligned
        admission.lock_node = inserted.last_node
        self._note_peak()

    def finish(self, admission: Admission) -> None:
        """Finish a request: insert prompt + output, free the slots the tree does not take,
        unlock.

        Args:
            admission: What ``admit`` returned.
        """
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        full, kv = admission.tokens, admission.kv
        start = clock()
        inserted = cache.insert(full, kv, admission.request.extra_key)
        self.seconds += clock() - start

        # The frees below read the slots as numpy (slicing a tensor costs more).
        slots = kv if type(kv) is np.ndarray else kv.numpy()
        # Slots of tokens the tree already held (a longer match than the prompt's) are spare.
        # Both frees give back slots this loop took from the pool and the tree did not keep.
        if inserted.prefix_len > admission.owned_from:
            pool._put_back(slots[admission.owned_from:inserted.prefix_len])
        # The tail past the last full page is not cached: its slots go back too.
        aligned_len = len(full) - len(full) % self._page_size
        if aligned_len < len(full):
            pool._put_back(slots[aligned_len:])

        start = clock()
        cache.dec_lock_ref(admission.lock_node)
        self.seconds += clock() - start
        admission.lock_node = None
        self._note_peak()

    def _note_peak(self) -> None:
        total = self.cache.total_size()
        if total > self.peak_tokens:
            self.peak_tokens = total

    def result(self) -> ServeResult:
        """Sum up the replay so far.

        Returns:
            A ``ServeResult`` with the counters so far and ``cache.stats()``.
        """
        return ServeResult(
            requests=self.requests,
            rejected=self.rejected,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            evicted_tokens=self.evicted_tokens,
            peak_tokens=self.peak_tokens,
            seconds=self.seconds,
            stats=self.cache.stats(),
            host_capacity=0 if self.host_pool is None else self.host_pool.capacity,
            host_cached_tokens=self.host_cached_tokens,
            loaded_tokens=self.loaded_tokens,
            backed_up_tokens=self.backed_up_tokens,
            host_evicted_tokens=self.host_evicted_tokens,
        )


def serve(cache: Any, requests: Iterable[Request], capacity: int,
          progress: Callable[[int], Any] | None = None, *,
          pool: KVPool | None = None, host_capacity: int | None = None,
          host_pool: HostPool | None = None) -> ServeResult:
    """Replay ``requests`` through ``cache`` over a ``KVPool(capacity)``, as a server would.

    Per request: match the prompt, lock the match, evict when the pool is short, allocate slots
    for the uncached prompt tokens and the output, insert prompt + output, free the slots the
    tree already had (and the unaligned tail it does not cache), unlock. A request that would
    not fit even after evicting every unlocked entry is rejected without evicting anything.
    ``progress(1)`` is called after each request (``tqdm.update`` fits). ``pool`` lets a
    caller watch the pool (its capacity must equal ``capacity``). The cache must start empty:
    every slot it holds has to come from the pool. ``ServingLoop`` holds the steps.

    ``host_capacity`` (a cache made with ``host_tier=True``) adds a host pool of that many
    slots: evicted prefixes are backed up there (per the cache's write policy) and host hits
    are loaded back before the request runs; they count in ``cached_tokens`` and
    ``hit_rate`` (``host_cached_tokens`` says how many). See ``ServingLoop``.

    Args:
        cache: An empty ``RadixCache``.
        requests: The ``Request`` objects, in arrival order.
        capacity: The KV pool's size in token slots, an int >= 0.
        progress: Called with 1 after each request, or None.
        pool: A fresh ``KVPool(capacity)`` to use (default: a new one).
        host_capacity: Host slots, an int >= 0, or None (default): no host tier.
        host_pool: A fresh ``HostPool(host_capacity)`` to use (default: a new one).

    Returns:
        A ``ServeResult``: hit rate, rejected requests, evicted tokens, peak tree size and
        the time spent in cache calls (and, with a host tier, the host's share of the hits,
        tokens loaded back and backed up).

    Raises:
        TypeError: ``capacity`` or ``host_capacity`` is not an int.
        ValueError: a negative ``capacity`` or ``host_capacity``, a non-empty cache, a
            ``pool`` or ``host_pool`` that is used or of another capacity, or a
            ``host_capacity`` on a cache without a host tier.
    """
    loop = ServingLoop(cache, capacity, pool=pool, host_capacity=host_capacity,
                       host_pool=host_pool)
    # A parsed trace can make each request into one reused buffer: every request is done
    # with (inserted, its slots taken or freed) before the next is made.
    replay = getattr(requests, "_replay", None)
    for request in (replay() if replay is not None else requests):
        admission = loop.admit(request)
        if admission is not None:
            loop.finish(admission)
        if progress is not None:
            progress(1)
    return loop.result()

"""Fleet simulation: a trace replayed over N workers behind a ``Router``, against one pooled cache.

Each worker is a ``RadixCache(enable_events=True)`` over its own KV pool of ``capacity`` slots
(events off for policies that never read them: they change nothing but the time), running
the serving loop of ``radixcache.workloads`` (``ServingLoop``) one step at a time.
The router learns what the workers hold ONLY from their KV events, delivered after a lag
(``EventLag``: a number of routing decisions, or milliseconds of simulated time); it never
looks into a worker's tree.

Time model (simulated seconds; arrivals from the trace's ``timestamp`` in ms, or one every
``interval_ms``):

- a request is routed when it arrives and queues on its worker; each worker prefills one
  request at a time, first come first served, at ``prefill_tokens_per_s``;
- when a worker starts a request's prefill the serving loop admits it: the prompt is matched
  against the worker's cache NOW (what it holds after everything finished before), its prefix
  is locked and its slots allocated; prefill takes (prompt - cached tokens) / throughput;
- when the prefill ends the prompt is inserted (its pages are published) and the lock moves
  onto it; time to first token (TTFT) = prefill end - arrival;
- the request then decodes ``output_len`` tokens at ``decode_tokens_per_s`` (per request;
  decoding requests run concurrently, as in continuous batching) and finishes: prompt +
  output are inserted and the lock released;
- load, as the router sees it, is the work queued or running on a worker, in tokens: a
  request adds prompt + output tokens when routed, its prompt tokens leave when its prefill
  ends and its output tokens when it finishes.

With a host tier (``host_capacity`` slots of host memory per worker), a worker's serving loop
backs evicted prefixes up to its host pool and loads the prompt's host hits back when it
admits a request: the load takes (tokens loaded) / ``load_tokens_per_s`` on the worker, before
its prefill (the worker is busy for both), so TTFT includes it.

A request that does not fit in its worker's pool when its turn comes (even after evicting
every unlocked entry) waits, at the head of the queue, until a running request on that worker
finishes and releases its locks and slots; with nothing running it is rejected, as ``serve``
rejects it, and gets no TTFT. The pooled bound is one
worker with ``num_workers x capacity`` slots and ``num_workers x`` the prefill throughput.
"""

from __future__ import annotations

import heapq
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ._options import (DEFAULT_DECODE_TPS, DEFAULT_INTERVAL_MS, DEFAULT_PREFILL_TPS, POOLED,
                       EventLag)
from ._options import DEFAULT_LOAD_TPS, WRITE_POLICIES
from .cache import RadixCache
from .router import KvIndexer, Router
from .traces import Trace, check_timestamps
from ._validate import check_int, check_real
from .workloads import Request, ServingLoop
from .workloads.serving import HitRates

__all__ = [
    "DEFAULT_DECODE_TPS",
    "DEFAULT_INTERVAL_MS",
    "DEFAULT_LOAD_TPS",
    "DEFAULT_PREFILL_TPS",
    "POOLED",
    "EventLag",
    "FleetResult",
    "InProcessChannel",
    "TimeModel",
    "arrival_times",
    "simulate_fleet",
    "simulate_pooled",
]

# The defaults, POOLED and EventLag live in _options (the command line reads them).


@dataclass(frozen=True)
class TimeModel:
    """The fleet's time model: how fast a worker prefills and a request decodes.

    Attributes:
        prefill_tokens_per_s: Prefill throughput per worker, tokens/s (default
            ``DEFAULT_PREFILL_TPS``); a worker prefills one request at a time.
        decode_tokens_per_s: Decode speed per running request, tokens/s (default
            ``DEFAULT_DECODE_TPS``); decoding requests run concurrently.
        load_tokens_per_s: Host-to-device load speed per worker, tokens/s (default
            ``DEFAULT_LOAD_TPS``: 128 KiB per token of a Llama-3-8B-shaped model over
            about 26 GB/s of PCIe); a worker loads a request's host hits before its prefill.

    Raises:
        TypeError: a field that is not a number.
        ValueError: a field that is not finite and > 0.
    """

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TPS
    decode_tokens_per_s: float = DEFAULT_DECODE_TPS
    load_tokens_per_s: float = DEFAULT_LOAD_TPS

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s", "load_tokens_per_s"):
            check_real(getattr(self, name), name, low=0, low_inclusive=False)


@dataclass(frozen=True)
class FleetResult(HitRates):
    """One replay over a fleet (or the pooled bound, ``router == "pooled"``).

    Attributes:
        router: The routing policy, or ``POOLED``.
        workers: How many workers.
        capacity: KV slots per worker.
        policy: The workers' eviction policy.
        page_size: Tokens per page (and per routing block).
        requests: Requests replayed.
        rejected: Requests that did not fit in their worker's pool.
        prompt_tokens: Prompt tokens over every request.
        cached_tokens: Prompt tokens found cached.
        hit_rate: ``cached_tokens / prompt_tokens`` over every request (rejected ones
            included, as in ``serve``).
        prefill_tokens: The prompt tokens computed (admitted requests, minus their cached
            tokens).
        load_imbalance: The largest worker's prefill tokens over the mean.
        ttft_p50: Median time to first token in simulated seconds over admitted requests
            (None when none was admitted).
        ttft_p99: 99th percentile of the same.
        evicted_tokens: Tokens evicted, all workers.
        peak_tokens: The sum of the workers' peak tree sizes.
        seconds: Time spent in cache calls, all workers.
        wall_seconds: Time the whole replay took.
        worker_prefill_tokens: Prefill tokens per worker.
        decisions: The worker of each request, in arrival order.
        indexer_stats: The router's ``KvIndexer`` counters (None for the pooled bound).
        host_capacity: Host slots per worker (0: no host tier).
        write_policy: The caches' write policy (None without a host tier).
        host_cached_tokens: Of ``cached_tokens``, those found only on a host tier (loaded
            back, or counted in a rejected request's lookup).
        loaded_tokens: Tokens loaded back from the host tiers.
        backed_up_tokens: Tokens copied to the host tiers.
    """

    router: str
    workers: int
    capacity: int
    policy: str
    page_size: int
    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int
    load_imbalance: float
    ttft_p50: Optional[float]
    ttft_p99: Optional[float]
    evicted_tokens: int
    peak_tokens: int
    seconds: float
    wall_seconds: float
    worker_prefill_tokens: tuple
    decisions: tuple
    indexer_stats: Optional[dict]
    host_capacity: int = 0
    write_policy: Optional[str] = None
    host_cached_tokens: int = 0
    loaded_tokens: int = 0
    backed_up_tokens: int = 0


def arrival_times(requests: Sequence[Request],
                  interval_ms: float = DEFAULT_INTERVAL_MS) -> np.ndarray:
    """Give the requests' arrival times.

    Args:
        requests: The ``Request`` objects, in order.
        interval_ms: The spacing in ms when no request has a ``timestamp``, a finite number
            >= 0.

    Returns:
        The arrival times in seconds, a float64 numpy array: the requests' ``timestamp``
        (ms) when every one has one, else one every ``interval_ms``.

    Raises:
        TypeError: ``interval_ms`` is not a number.
        ValueError: a negative or infinite ``interval_ms``, timestamps on only some
            requests, or timestamps that decrease.
    """
    check_real(interval_ms, "interval_ms", low=0)
    if isinstance(requests, Trace):  # its column: no request is made
        stamps = requests.timestamps
    else:
        stamps = np.array([math.nan if r.timestamp is None else r.timestamp for r in requests],
                          dtype=np.float64)
    check_timestamps(stamps)
    if len(stamps) and np.isnan(stamps[0]):  # none has one
        return np.arange(len(requests), dtype=np.float64) * (interval_ms / 1000.0)
    times = stamps / 1000.0
    earlier = np.flatnonzero(np.diff(times) < 0)
    if len(earlier):
        i = int(earlier[0]) + 1
        raise ValueError(f"timestamps must not decrease: request {i + 1} has {stamps[i]:g} ms, "
                         f"after {stamps[i - 1]:g} ms")
    return times


class InProcessChannel:
    """A worker's event stream to the router inside one process.

    Batches wait, stamped with the simulated time and the number of routing decisions made
    when they were published, until the router takes them. ``simulate_fleet`` uses one per
    worker by default; a channel of another kind (a ZeroMQ loopback, say) offers the same
    three methods.
    """

    def __init__(self) -> None:
        self._batches: deque = deque()

    def publish(self, events: list, time_s: float, step: int) -> None:
        """Queue one batch of a worker's events.

        Args:
            events: The batch's KV events.
            time_s: The simulated time it was published, in seconds.
            step: How many routing decisions had been made then.
        """
        self._batches.append((time_s, step, events))

    def take(self, max_time: float, max_step: float) -> list:
        """Take the batches that have reached the router.

        Args:
            max_time: Take batches published at or before this simulated time (seconds).
            max_step: ... and at or before this many routing decisions.

        Returns:
            The batches (lists of events), in publishing order.
        """
        batches = self._batches
        out = []
        while batches and batches[0][0] <= max_time and batches[0][1] <= max_step:
            out.append(batches.popleft()[2])
        return out

    def close(self) -> None:
        """Drop the batches still waiting."""
        self._batches.clear()


# Heap event kinds; at equal times finishes free slots before prefills end.
_FINISH, _PREFILLED = 0, 1


class _Ingest:
    """What the fleet feeds events to with router replicas: worker ``w``'s batches go to
    replica ``w mod R``'s indexer; ``stats`` sums the replicas' counts."""

    def __init__(self, routers: list) -> None:
        self._indexers = [router.indexer for router in routers]

    def apply(self, worker: int, events: Any) -> None:
        self._indexers[worker % len(self._indexers)].apply(worker, events)

    def apply_keys(self, worker: int, records: Any) -> None:
        self._indexers[worker % len(self._indexers)].apply_keys(worker, records)

    @property
    def stats(self) -> Any:
        from .router import IndexerStats

        total = IndexerStats()
        for indexer in self._indexers:
            for name, value in indexer.stats.as_dict().items():
                setattr(total, name, getattr(total, name) + value)
        return total


class _Replicas:
    """R router replicas in front of one fleet (see ``simulate_fleet``'s ``routers``):
    request ``i`` goes to replica ``i mod R`` (a load balancer's round robin), which counts
    only the load it dispatched itself."""

    def __init__(self, routers: list) -> None:
        self.routers = routers
        self.indexer = _Ingest(routers)
        self._of: dict = {}  # request index -> the replica that routed it

    def dispatch(self, index: int, prompt: Any, extra_key: Any, tokens: int) -> int:
        router = self.routers[index % len(self.routers)]
        self._of[index] = router
        worker = router.route(prompt, extra_key)
        router.add_load(worker, tokens)
        return worker

    def unload(self, index: int, worker: int, tokens: int, done: bool = False) -> None:
        router = self._of.pop(index) if done else self._of[index]
        router.remove_load(worker, tokens)


def _percentiles(values: list) -> tuple:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


def _replay(requests: Sequence[Request], arrivals: np.ndarray, num_workers: int,
            capacity: int, router: Optional[Router], router_name: str, *, page_size: int,
            eviction_policy: str, core: Optional[str], time_model: TimeModel,
            prefill_tps: float, event_lag: EventLag, progress: Optional[Callable[[int], Any]],
            channels: Optional[list], with_events: bool, host_capacity: int = 0,
            write_policy: str = "write_back", load_tps: float = DEFAULT_LOAD_TPS
            ) -> FleetResult:
    wall_start = time.perf_counter()
    # In-process channels feed the index the workers' block keys directly (event option
    # record="keys", applied by KvIndexer.apply_keys): no event objects, keys hashed once per
    # stored leaf, applied in one call per record. The key records know one tier: with a host
    # tier the workers publish events per medium, hashing pages with the fast chain (the
    # index keys blocks by their tokens, whatever the publisher's hash).
    direct = with_events and channels is None and not host_capacity
    if direct:
        cache_options = {"event_options": {"record": "keys"}}
    elif with_events and channels is None:
        cache_options = {"event_options": {"block_hash": "fast64"}}
    else:
        cache_options = {}
    if host_capacity:
        cache_options = dict(cache_options, host_tier=True, write_policy=write_policy)
    # numpy index arrays: the simulation never needs torch (nor its import time).
    caches = [RadixCache(page_size=page_size, eviction_policy=eviction_policy,
                         enable_events=with_events, core=core, array_type="numpy",
                         **cache_options)
              for _ in range(num_workers)]
    loops = [ServingLoop(cache, capacity, host_capacity=host_capacity or None)
             for cache in caches]
    # Events published once every request is routed reach no decision: an in-process
    # channel drops them rather than hold them to the end (a given channel gets them all).
    own_channels = channels is None
    routing = True
    if with_events and channels is None:
        channels = [InProcessChannel() for _ in range(num_workers)]
    if with_events and router is not None:
        apply = router.indexer.apply_keys if direct else router.indexer.apply
    decode_tps = time_model.decode_tokens_per_s
    queues = [deque() for _ in range(num_workers)]
    busy = [False] * num_workers
    running = [0] * num_workers  # admitted, not finished (holding locks and slots)
    # The queue's head is waiting for a running request to free room: only that retries it
    # (an arrival retrying would touch its prefix and count a lookup each time).
    blocked = [False] * num_workers
    worker_prefill = [0] * num_workers
    ttfts: list = []
    decisions: list = []
    heap: list = []
    tie = 0  # heap tie breaker: FIFO among events at the same time and kind
    steps = 0  # routing decisions made so far
    lag_s = event_lag.ms / 1000.0
    # Requests are read (a Trace makes their tokens) when routed and held only until admitted
    # (then while admitted): queues hold indices, and the requests made when routed wait
    # beside them up to a quarter of the pools' slots in tokens (2 bytes a slot; past that,
    # one is made again when admitted), so memory stays with the pools, not the trace.
    waiting: dict = {}  # index -> its request made when routed, until admitted
    waiting_tokens = 0  # the tokens (prompt and output) they hold
    waiting_limit = num_workers * capacity // 4
    if isinstance(requests, Trace):
        prompt_lengths, output_lengths = requests.prompt_lengths, requests.output_lengths
    else:
        prompt_lengths = [len(r.prompt) for r in requests]
        output_lengths = [r.output_len for r in requests]

    replicas = isinstance(router, _Replicas)

    def unload(index: int, worker: int, tokens: int, done: bool = False) -> None:
        if replicas:
            router.unload(index, worker, tokens, done)
        else:
            router.remove_load(worker, tokens)

    take_events = [cache.take_events for cache in caches]

    def publish(worker: int, now: float) -> None:
        if with_events:
            events = take_events[worker]()
            if events and (routing or not own_channels):
                channels[worker].publish(events, now, steps)

    def start_next(worker: int, now: float) -> None:
        nonlocal tie, waiting_tokens
        loop = loops[worker]
        queue = queues[worker]
        while queue:
            index = queue.popleft()
            request = waiting.pop(index, None)
            if request is None:
                request = requests[index]
            else:
                waiting_tokens -= int(prompt_lengths[index]) + int(output_lengths[index])
            # While requests run, their locked prefixes and slots may be what is missing:
            # wait for one to finish rather than reject.
            wait = running[worker] > 0
            admission = loop.admit(request, wait=wait)
            publish(worker, now)  # evictions made room
            if admission is None:
                if wait:
                    queue.appendleft(index)
                    blocked[worker] = True
                    break
                if router is not None:
                    unload(index, worker, int(prompt_lengths[index])
                           + int(output_lengths[index]), True)
                continue
            running[worker] += 1
            compute = len(request.prompt) - admission.cached
            worker_prefill[worker] += compute
            busy[worker] = True
            tie += 1
            duration = compute / prefill_tps
            if admission.loaded:
                duration += admission.loaded / load_tps  # host hits are loaded back first
            heapq.heappush(heap, (now + duration, _PREFILLED, tie, worker,
                                  index, admission))
            return
        busy[worker] = False

    def handle(event: tuple) -> None:
        nonlocal tie
        now, kind, _, worker, index, admission = event
        request = admission.request
        if kind == _PREFILLED:
            loops[worker].cache_prompt(admission)
            publish(worker, now)
            ttfts.append(now - arrivals[index])
            if router is not None:
                unload(index, worker, len(request.prompt))
            tie += 1
            heapq.heappush(heap, (now + request.output_len / decode_tps, _FINISH, tie, worker,
                                  index, admission))
            start_next(worker, now)
        else:
            loops[worker].finish(admission)
            publish(worker, now)
            running[worker] -= 1
            blocked[worker] = False
            if router is not None:
                unload(index, worker, request.output_len, True)
            if not busy[worker]:
                start_next(worker, now)  # a request may have waited for room

    try:
        for index in range(len(requests)):
            now = float(arrivals[index])
            while heap and heap[0][0] <= now:
                handle(heapq.heappop(heap))
            request = None
            if router is None:
                worker = 0
            else:
                request = requests[index]
                if with_events:
                    if event_lag.ms:
                        max_time, max_step = now - lag_s, math.inf
                    else:
                        max_time, max_step = math.inf, steps - event_lag.requests
                    for w in range(num_workers):
                        for events in channels[w].take(max_time, max_step):
                            apply(w, events)
                if replicas:
                    worker = router.dispatch(index, request.prompt, request.extra_key,
                                             len(request.prompt) + request.output_len)
                else:
                    worker = router.route(request.prompt, request.extra_key)
                    router.add_load(worker, len(request.prompt) + request.output_len)
            steps += 1
            decisions.append(worker)
            queues[worker].append(index)
            if request is not None:
                size = int(prompt_lengths[index]) + int(output_lengths[index])
                if waiting_tokens + size <= waiting_limit:
                    waiting[index] = request  # admitted as routed, not made again
                    waiting_tokens += size
                request = None
            if not busy[worker] and not blocked[worker]:
                start_next(worker, now)
            if progress is not None:
                progress(1)
        routing = False
        while heap:
            handle(heapq.heappop(heap))
    finally:
        if channels is not None:
            for channel in channels:
                channel.close()

    results = [loop.result() for loop in loops]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached_tokens = sum(r.cached_tokens for r in results)
    total_prefill = sum(worker_prefill)
    mean_prefill = total_prefill / num_workers
    p50, p99 = _percentiles(ttfts)
    return FleetResult(
        router=router_name,
        workers=num_workers,
        capacity=capacity,
        policy=eviction_policy,
        page_size=page_size,
        requests=sum(r.requests for r in results),
        rejected=sum(r.rejected for r in results),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        prefill_tokens=total_prefill,
        load_imbalance=max(worker_prefill) / mean_prefill if mean_prefill else 1.0,
        ttft_p50=p50,
        ttft_p99=p99,
        evicted_tokens=sum(r.evicted_tokens for r in results),
        peak_tokens=sum(r.peak_tokens for r in results),
        seconds=sum(r.seconds for r in results),
        wall_seconds=time.perf_counter() - wall_start,
        worker_prefill_tokens=tuple(worker_prefill),
        decisions=tuple(decisions),
        indexer_stats=router.indexer.stats.as_dict() if with_events else None,
        host_capacity=host_capacity,
        write_policy=write_policy if host_capacity else None,
        host_cached_tokens=sum(r.host_cached_tokens for r in results),
        loaded_tokens=sum(r.loaded_tokens for r in results),
        backed_up_tokens=sum(r.backed_up_tokens for r in results),
    )


def _check_host(host_capacity: Any, write_policy: Any) -> int:
    host_capacity = check_int(host_capacity, "host_capacity", low=0)
    if not isinstance(write_policy, str):
        raise TypeError(f"write_policy must be a str, got {type(write_policy).__name__}")
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"unknown write policy {write_policy!r}; valid: "
                         f"{', '.join(WRITE_POLICIES)}")
    return host_capacity


def _check_common(requests: Sequence[Request], num_workers: Any, capacity: Any,
                  arrivals: Any, interval_ms: float) -> np.ndarray:
    check_int(num_workers, "num_workers", low=1)
    check_int(capacity, "capacity", low=1)
    if not isinstance(requests, Trace):  # a Trace makes Request objects only
        for request in requests:
            if not isinstance(request, Request):
                raise TypeError(f"requests must be Request objects, got "
                                f"{type(request).__name__}")
    if arrivals is None:
        arrivals = arrival_times(requests, interval_ms)
    arrivals = np.asarray(arrivals, dtype=np.float64)
    if arrivals.shape != (len(requests),):
        raise ValueError(f"arrivals must hold one time per request ({len(requests)}), "
                         f"got shape {arrivals.shape}")
    if len(arrivals) and (not np.all(np.isfinite(arrivals)) or np.any(np.diff(arrivals) < 0)):
        raise ValueError("arrival times must be finite and in non-decreasing order")
    return arrivals


def simulate_fleet(requests: Sequence[Request], num_workers: int, capacity: int,
                   router: str | Router = "cache-aware", *, page_size: int = 16,
                   eviction_policy: str = "lru", core: Optional[str] = None,
                   arrivals: Any = None, interval_ms: float = DEFAULT_INTERVAL_MS,
                   time_model: TimeModel = TimeModel(), event_lag: EventLag = EventLag(),
                   router_options: Optional[dict] = None,
                   progress: Optional[Callable[[int], Any]] = None,
                   channels: Optional[list] = None,
                   publish_events: Optional[bool] = None, host_capacity: int = 0,
                   write_policy: str = "write_back", routers: int = 1,
                   index: Optional[str] = None) -> FleetResult:
    """Replay ``requests`` over ``num_workers`` workers of ``capacity`` slots behind a router.

    ``router`` is a policy name (``radixcache.router.ROUTING_POLICIES``; ``router_options``
    go to ``Router``, its ``block_size`` is ``page_size``) or a fresh ``Router`` of
    ``num_workers`` with that block size. ``arrivals`` (seconds, non-decreasing) default to
    ``arrival_times(requests, interval_ms)``. ``channels``, one per worker, carry the
    workers' events to the router (default ``InProcessChannel``); each needs
    ``publish(events, time_s, step)``, ``take(max_time, max_step)`` and ``close()``.
    ``progress(1)`` is called per request routed. ``routers`` > 1 puts that many router
    replicas (each a ``Router`` of the policy) in front of the workers: request ``i`` goes to
    replica ``i mod routers``, which counts only the load it dispatched, and worker ``w``'s
    events are ingested by replica ``w mod routers``; each replica indexes only the workers
    it ingests, unless ``index`` names a Redis or Valkey server (``redis://...``): then the
    replicas ingest into one shared ``KvIndexer(store=index)`` that every replica reads (a
    fresh namespace, deleted afterwards). ``publish_events``: whether the workers
    record and send KV events; by default only when the router reads them
    (``Router.uses_events``, i.e. ``cache-aware``) or ``channels`` are given: the other
    policies keep no cache state, and events never change what a cache does, so skipping
    them only saves the hashing. See the module docstring for the model.

    Args:
        requests: The ``Request`` objects, in arrival order.
        num_workers: How many workers, an int >= 1.
        capacity: KV slots per worker, an int >= 1.
        router: A policy name or a ``Router`` (see above).
        page_size: Tokens per page of every worker's cache, and per routing block.
        eviction_policy: The workers' eviction policy.
        core: The tree core of the workers' caches (None: the default).
        arrivals: Arrival times in seconds, one per request, non-decreasing (default:
            ``arrival_times(requests, interval_ms)``).
        interval_ms: The arrival spacing when ``arrivals`` is None and the requests have no
            timestamps.
        time_model: The ``TimeModel``.
        event_lag: The ``EventLag`` of the router's view.
        router_options: Keyword arguments for ``Router`` (with a policy name only).
        progress: Called with 1 per request routed, or None.
        channels: One channel per worker, or None (see above).
        publish_events: Whether the workers record and send KV events (None: see above).
        routers: Router replicas, an int >= 1 (with a policy name only).
        index: None (each replica's index in process), or the URL of the Redis or Valkey
            server of a shared index (with a policy name only; needs ``radixcache[redis]``).
        host_capacity: Host slots per worker, an int >= 0 (0: no host tier). With a host
            tier the workers' events report its blocks (``medium="CPU"``) and ``cache-aware``
            counts them at ``Router.host_weight``.
        write_policy: The workers' write policy with a host tier (``WRITE_POLICIES``).

    Returns:
        A ``FleetResult``.

    Raises:
        TypeError: an argument of the wrong type (a count that is not an int, items that are
            not ``Request``, a ``time_model`` or ``event_lag`` of another class).
        ValueError: a count < 1, arrivals that are not one finite non-decreasing time per
            request, a ``Router`` whose workers or block size do not match, options with a
            ``Router``, not one channel per worker, a negative ``host_capacity``, an
            unknown ``write_policy``, or ``routers`` or ``index`` with a ``Router``.
    """
    arrivals = _check_common(requests, num_workers, capacity, arrivals, interval_ms)
    host_capacity = _check_host(host_capacity, write_policy)
    if not isinstance(time_model, TimeModel):
        raise TypeError(f"time_model must be a TimeModel, got {type(time_model).__name__}")
    if not isinstance(event_lag, EventLag):
        raise TypeError(f"event_lag must be an EventLag, got {type(event_lag).__name__}")
    routers = check_int(routers, "routers", 1)
    replicated = routers > 1 or index is not None
    if isinstance(router, Router):
        if router.num_workers != num_workers or router.block_size != page_size:
            raise ValueError("router must have num_workers workers and block_size page_size")
        if router_options:
            raise ValueError("router_options apply only when router is a policy name")
        if replicated:
            raise ValueError("routers and index apply only when router is a policy name")
        name = router.policy
    else:
        name = router
        router = Router(num_workers, router, block_size=page_size, **(router_options or {}))
    shared = None
    if replicated:
        # Replica r ingests workers w with w mod R == r; with a store, into the one index.
        namespace = f"simulate-{uuid.uuid4().hex}"
        replicas = []
        for replica in range(routers):
            indexer = None
            if index is not None:
                indexer = KvIndexer(page_size, store=index, namespace=namespace,
                                    owner=f"replica-{replica}", lease_s=24 * 3600.0)
                shared = shared or indexer
            replicas.append(router if replica == 0 and indexer is None else
                            Router(num_workers, name, block_size=page_size, indexer=indexer,
                                   **(router_options or {})))
        router = _Replicas(replicas)
    if channels is not None and len(channels) != num_workers:
        raise ValueError(f"need one channel per worker ({num_workers}), got {len(channels)}")
    if publish_events is None:
        uses_events = (router.routers[0] if isinstance(router, _Replicas) else router).uses_events
        publish_events = uses_events or channels is not None
    try:
        return _replay(requests, arrivals, int(num_workers), int(capacity), router, name,
                       page_size=page_size, eviction_policy=eviction_policy, core=core,
                       time_model=time_model, prefill_tps=time_model.prefill_tokens_per_s,
                       event_lag=event_lag, progress=progress, channels=channels,
                       with_events=bool(publish_events), host_capacity=host_capacity,
                       write_policy=write_policy, load_tps=time_model.load_tokens_per_s)
    finally:
        if shared is not None:
            shared._store.drop_namespace()
            for replica in router.routers:
                replica.indexer.close()


def simulate_pooled(requests: Sequence[Request], num_workers: int, capacity: int, *,
                    page_size: int = 16, eviction_policy: str = "lru",
                    core: Optional[str] = None, arrivals: Any = None,
                    interval_ms: float = DEFAULT_INTERVAL_MS,
                    time_model: TimeModel = TimeModel(),
                    progress: Optional[Callable[[int], Any]] = None, host_capacity: int = 0,
                    write_policy: str = "write_back") -> FleetResult:
    """Replay the pooled bound: one cache with the whole fleet's memory and throughput.

    One cache of ``num_workers * capacity`` slots (and ``num_workers * host_capacity`` host
    slots) that prefills and loads at ``num_workers`` times the throughput: the hit rate no
    router can beat by placement alone.

    Args:
        requests: The ``Request`` objects, in arrival order.
        num_workers: How many workers the fleet has, an int >= 1.
        capacity: KV slots per worker, an int >= 1.
        page_size: Tokens per page.
        eviction_policy: The cache's eviction policy.
        core: The tree core (None: the default).
        arrivals: Arrival times in seconds (default: ``arrival_times(requests,
            interval_ms)``).
        interval_ms: The arrival spacing when the requests have no timestamps.
        time_model: The per-worker ``TimeModel``.
        progress: Called with 1 per request, or None.
        host_capacity: Host slots per worker, an int >= 0 (0: no host tier).
        write_policy: The cache's write policy with a host tier (``WRITE_POLICIES``).

    Returns:
        A ``FleetResult`` with ``router == POOLED``; its ``capacity`` and
        ``host_capacity`` are the per-worker ones.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a count < 1, arrivals that are not one finite non-decreasing time
            per request, a negative ``host_capacity`` or an unknown ``write_policy``.
    """
    arrivals = _check_common(requests, num_workers, capacity, arrivals, interval_ms)
    host_capacity = _check_host(host_capacity, write_policy)
    if not isinstance(time_model, TimeModel):
        raise TypeError(f"time_model must be a TimeModel, got {type(time_model).__name__}")
    result = _replay(requests, arrivals, 1, int(num_workers) * int(capacity), None, POOLED,
                     page_size=page_size, eviction_policy=eviction_policy, core=core,
                     time_model=time_model,
                     prefill_tps=time_model.prefill_tokens_per_s * num_workers,
                     event_lag=EventLag(), progress=progress, channels=None,
                     with_events=False, host_capacity=int(num_workers) * host_capacity,
                     write_policy=write_policy,
                     load_tps=time_model.load_tokens_per_s * num_workers)
    return _with(result, workers=int(num_workers), capacity=int(capacity),
                 host_capacity=host_capacity)


def _with(result: FleetResult, **changes: Any) -> FleetResult:
    from dataclasses import replace

    return replace(result, **changes)

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

A request that does not fit in its worker's pool when its turn comes (even after evicting
every unlocked entry) waits, at the head of the queue, until a running request on that worker
finishes and releases its locks and slots; with nothing running it is rejected, as ``serve``
rejects it, and gets no TTFT. The pooled bound is one
worker with ``num_workers x capacity`` slots and ``num_workers x`` the prefill throughput.
"""

from __future__ import annotations

import heapq
import math
import numbers
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .cache import RadixCache
from .router import Router
from .workloads import Request, ServingLoop

__all__ = [
    "DEFAULT_DECODE_TPS",
    "DEFAULT_INTERVAL_MS",
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

#: Prefill throughput per worker, tokens/s (an 8B model on one H100-class GPU, roughly).
DEFAULT_PREFILL_TPS = 20_000.0
#: Decode speed per running request, tokens/s.
DEFAULT_DECODE_TPS = 50.0
#: Arrival interval for traces without timestamps, ms.
DEFAULT_INTERVAL_MS = 100.0
#: The ``router`` name of the pooled-bound rows.
POOLED = "pooled"


@dataclass(frozen=True)
class EventLag:
    """How stale the router's view is: events reach it ``requests`` routing decisions or
    ``ms`` milliseconds (simulated) after they were published; zero: before the next
    decision. Written ``"N"`` (decisions) or ``"Nms"`` on the command line."""

    requests: int = 0
    ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.requests, bool) or not isinstance(self.requests, numbers.Integral):
            raise TypeError(f"event lag requests must be an int, got {self.requests!r}")
        if isinstance(self.ms, bool) or not isinstance(self.ms, numbers.Real):
            raise TypeError(f"event lag ms must be a number, got {self.ms!r}")
        if self.requests < 0 or not 0 <= self.ms < math.inf:
            raise ValueError(f"event lag must be >= 0 and finite, got {self}")
        if self.requests and self.ms:
            raise ValueError("an event lag is either in requests or in ms, not both")

    @classmethod
    def parse(cls, text: str) -> "EventLag":
        """``"3"`` or ``"3req"``: three routing decisions; ``"50ms"``: 50 ms."""
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(ms|req|requests)?\s*", text)
        if not match:
            raise ValueError(f"event lag {text!r}: expected N (requests), Nreq or Nms")
        number, unit = match.groups()
        if unit == "ms":
            return cls(ms=float(number))
        if "." in number:
            raise ValueError(f"event lag {text!r}: a lag in requests must be a whole number")
        return cls(requests=int(number))

    def __str__(self) -> str:
        return f"{self.ms:g}ms" if self.ms else f"{self.requests}"


@dataclass(frozen=True)
class TimeModel:
    """Prefill throughput per worker and decode speed per request, tokens/s."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TPS
    decode_tokens_per_s: float = DEFAULT_DECODE_TPS

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {value}")


@dataclass(frozen=True)
class FleetResult:
    """One replay over a fleet (or the pooled bound, ``router == "pooled"``).

    ``capacity`` is per worker; ``hit_rate`` is cached / prompt tokens over every request
    (rejected ones included, as in ``serve``); ``prefill_tokens`` the prompt tokens computed
    (admitted requests, minus their cached tokens); ``load_imbalance`` the largest worker's
    prefill tokens over the mean; TTFT percentiles in simulated seconds over admitted requests
    (None when none was); ``seconds`` the time spent in cache calls (all workers),
    ``wall_seconds`` the whole replay; ``peak_tokens`` the sum of the workers' peak tree
    sizes; ``decisions`` the worker of each request in arrival order; ``indexer_stats`` the
    router's ``KvIndexer`` counters (None for the pooled bound).
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


def arrival_times(requests: Sequence[Request],
                  interval_ms: float = DEFAULT_INTERVAL_MS) -> np.ndarray:
    """Arrival times in seconds: the requests' ``timestamp`` (ms) when every one has one,
    else one every ``interval_ms``. A trace where only some requests carry one, or where they
    decrease, is an error."""
    if isinstance(interval_ms, bool) or not isinstance(interval_ms, numbers.Real):
        raise TypeError(f"interval_ms must be a number, got {type(interval_ms).__name__}")
    if not 0 <= interval_ms < math.inf:
        raise ValueError(f"interval_ms must be >= 0 and finite, got {interval_ms}")
    stamps = [r.timestamp for r in requests]
    given = sum(s is not None for s in stamps)
    if given == 0:
        return np.arange(len(requests), dtype=np.float64) * (interval_ms / 1000.0)
    if given < len(stamps):
        first = next(i for i, s in enumerate(stamps) if s is None)
        raise ValueError(f"{given} of {len(stamps)} requests carry a timestamp (request "
                         f"{first + 1} has none): give every request one, or none")
    times = np.asarray(stamps, dtype=np.float64) / 1000.0
    earlier = np.flatnonzero(np.diff(times) < 0)
    if len(earlier):
        i = int(earlier[0]) + 1
        raise ValueError(f"timestamps must not decrease: request {i + 1} has {stamps[i]:g} ms, "
                         f"after {stamps[i - 1]:g} ms")
    return times


class InProcessChannel:
    """A worker's event stream to the router inside one process: batches wait, stamped with
    the simulated time and the number of routing decisions made when they were published."""

    def __init__(self) -> None:
        self._batches: deque = deque()

    def publish(self, events: list, time_s: float, step: int) -> None:
        self._batches.append((time_s, step, events))

    def take(self, max_time: float, max_step: float) -> list:
        """The batches published at or before ``max_time`` and ``max_step``, in order."""
        batches = self._batches
        out = []
        while batches and batches[0][0] <= max_time and batches[0][1] <= max_step:
            out.append(batches.popleft()[2])
        return out

    def close(self) -> None:
        self._batches.clear()


# Heap event kinds; at equal times finishes free slots before prefills end.
_FINISH, _PREFILLED = 0, 1


def _percentiles(values: list) -> tuple:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
    return float(p50), float(p99)


def _replay(requests: Sequence[Request], arrivals: np.ndarray, num_workers: int,
            capacity: int, router: Optional[Router], router_name: str, *, page_size: int,
            eviction_policy: str, core: Optional[str], time_model: TimeModel,
            prefill_tps: float, event_lag: EventLag, progress: Optional[Callable[[int], Any]],
            channels: Optional[list], with_events: bool) -> FleetResult:
    wall_start = time.perf_counter()
    # In-process channels carry the events as objects: the workers hash pages with the
    # fast chain (the index keys blocks by their tokens, whatever the publisher's hash).
    fast = {"event_options": {"block_hash": "fast64"}} if with_events and channels is None \
        else {}
    caches = [RadixCache(page_size=page_size, eviction_policy=eviction_policy,
                         enable_events=with_events, core=core, **fast)
              for _ in range(num_workers)]
    loops = [ServingLoop(cache, capacity) for cache in caches]
    if with_events and channels is None:
        channels = [InProcessChannel() for _ in range(num_workers)]
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

    def publish(worker: int, now: float) -> None:
        if with_events:
            events = caches[worker].take_events()
            if events:
                channels[worker].publish(events, now, steps)

    def start_next(worker: int, now: float) -> None:
        nonlocal tie
        loop = loops[worker]
        queue = queues[worker]
        while queue:
            index = queue.popleft()
            request = requests[index]
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
                    router.remove_load(worker, len(request.prompt) + request.output_len)
                continue
            running[worker] += 1
            compute = len(request.prompt) - admission.cached
            worker_prefill[worker] += compute
            busy[worker] = True
            tie += 1
            heapq.heappush(heap, (now + compute / prefill_tps, _PREFILLED, tie, worker,
                                  index, admission))
            return
        busy[worker] = False

    def handle(event: tuple) -> None:
        nonlocal tie
        now, kind, _, worker, index, admission = event
        request = requests[index]
        if kind == _PREFILLED:
            loops[worker].cache_prompt(admission)
            publish(worker, now)
            ttfts.append(now - arrivals[index])
            if router is not None:
                router.remove_load(worker, len(request.prompt))
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
                router.remove_load(worker, request.output_len)
            if not busy[worker]:
                start_next(worker, now)  # a request may have waited for room

    try:
        for index in range(len(requests)):
            now = float(arrivals[index])
            while heap and heap[0][0] <= now:
                handle(heapq.heappop(heap))
            request = requests[index]
            if router is None:
                worker = 0
            else:
                if with_events:
                    if event_lag.ms:
                        max_time, max_step = now - lag_s, math.inf
                    else:
                        max_time, max_step = math.inf, steps - event_lag.requests
                    for w in range(num_workers):
                        for events in channels[w].take(max_time, max_step):
                            router.indexer.apply(w, events)
                worker = router.route(request.prompt, request.extra_key)
                router.add_load(worker, len(request.prompt) + request.output_len)
            steps += 1
            decisions.append(worker)
            queues[worker].append(index)
            if not busy[worker] and not blocked[worker]:
                start_next(worker, now)
            if progress is not None:
                progress(1)
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
    )


def _check_common(requests: Sequence[Request], num_workers: Any, capacity: Any,
                  arrivals: Any, interval_ms: float) -> np.ndarray:
    for name, value in (("num_workers", num_workers), ("capacity", capacity)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for request in requests:
        if not isinstance(request, Request):
            raise TypeError(f"requests must be Request objects, got {type(request).__name__}")
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
                   publish_events: Optional[bool] = None) -> FleetResult:
    """Replay ``requests`` over ``num_workers`` workers of ``capacity`` slots behind a router.

    ``router`` is a policy name (``radixcache.router.ROUTING_POLICIES``; ``router_options``
    go to ``Router``, its ``block_size`` is ``page_size``) or a fresh ``Router`` of
    ``num_workers`` with that block size. ``arrivals`` (seconds, non-decreasing) default to
    ``arrival_times(requests, interval_ms)``. ``channels``, one per worker, carry the
    workers' events to the router (default ``InProcessChannel``); each needs
    ``publish(events, time_s, step)``, ``take(max_time, max_step)`` and ``close()``.
    ``progress(1)`` is called per request routed. ``publish_events``: whether the workers
    record and send KV events; by default only when the router reads them
    (``Router.uses_events``, i.e. ``cache-aware``) or ``channels`` are given: the other
    policies keep no cache state, and events never change what a cache does, so skipping
    them only saves the hashing. See the module docstring for the model.
    """
    arrivals = _check_common(requests, num_workers, capacity, arrivals, interval_ms)
    if not isinstance(time_model, TimeModel):
        raise TypeError(f"time_model must be a TimeModel, got {type(time_model).__name__}")
    if not isinstance(event_lag, EventLag):
        raise TypeError(f"event_lag must be an EventLag, got {type(event_lag).__name__}")
    if isinstance(router, Router):
        if router.num_workers != num_workers or router.block_size != page_size:
            raise ValueError("router must have num_workers workers and block_size page_size")
        if router_options:
            raise ValueError("router_options apply only when router is a policy name")
        name = router.policy
    else:
        name = router
        router = Router(num_workers, router, block_size=page_size, **(router_options or {}))
    if channels is not None and len(channels) != num_workers:
        raise ValueError(f"need one channel per worker ({num_workers}), got {len(channels)}")
    if publish_events is None:
        publish_events = router.uses_events or channels is not None
    return _replay(requests, arrivals, int(num_workers), int(capacity), router, name,
                   page_size=page_size, eviction_policy=eviction_policy, core=core,
                   time_model=time_model, prefill_tps=time_model.prefill_tokens_per_s,
                   event_lag=event_lag, progress=progress, channels=channels,
                   with_events=bool(publish_events))


def simulate_pooled(requests: Sequence[Request], num_workers: int, capacity: int, *,
                    page_size: int = 16, eviction_policy: str = "lru",
                    core: Optional[str] = None, arrivals: Any = None,
                    interval_ms: float = DEFAULT_INTERVAL_MS,
                    time_model: TimeModel = TimeModel(),
                    progress: Optional[Callable[[int], Any]] = None) -> FleetResult:
    """The pooled bound: one cache of ``num_workers * capacity`` slots that prefills at
    ``num_workers`` times the throughput; the result's ``capacity`` is the per-worker one."""
    arrivals = _check_common(requests, num_workers, capacity, arrivals, interval_ms)
    if not isinstance(time_model, TimeModel):
        raise TypeError(f"time_model must be a TimeModel, got {type(time_model).__name__}")
    result = _replay(requests, arrivals, 1, int(num_workers) * int(capacity), None, POOLED,
                     page_size=page_size, eviction_policy=eviction_policy, core=core,
                     time_model=time_model,
                     prefill_tps=time_model.prefill_tokens_per_s * num_workers,
                     event_lag=EventLag(), progress=progress, channels=None,
                     with_events=False)
    return _with(result, workers=int(num_workers), capacity=int(capacity))


def _with(result: FleetResult, **changes: Any) -> FleetResult:
    from dataclasses import replace  # noqa: PLC0415

    return replace(result, **changes)

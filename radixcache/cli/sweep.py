"""Running a sweep's points: one after another here, in forked processes that share the parsed
trace (``simulate --jobs``), or on any ``concurrent.futures.Executor`` (a process or thread
pool, Dask's ``Client.get_executor()``, ...); and the fixed slices of a sweep that
``simulate --shard I/N`` runs and writes for ``radixcache merge``.

``run_sweep`` is the public entry: it runs any picklable ``run_point`` over any points.
``radixcache.cli.main(argv, executor=...)`` runs ``radixcache simulate``'s own points
(``ServePoint``, ``FleetPoint``) on an executor; those read the trace from its path in each
worker process, once per process.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from .output import atomic_write, progress_bar

if TYPE_CHECKING:
    import argparse
    from concurrent.futures import Executor

    from ..fleet import FleetResult, TimeModel
    from ..traces import Trace
    from ..workloads import ServeResult


class SweepError(Exception):
    """The points of a sweep could not run: a worker process died, or a worker could not read
    the trace (exit code 1)."""


# What the forked workers run: (run_point, points), set just before the pool forks them, so
# that they share the parent's parsed trace (copy-on-write) instead of receiving a copy.
_SWEEP: Any = None


def _default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        return os.cpu_count() or 1


def _sweep_worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool


def _sweep_point(index: int) -> tuple[int, Any]:
    run_point, points = _SWEEP
    return index, run_point(points[index], None)


def run_sweep(points: Sequence, run_point: Callable[[Any, Any], Any], jobs: int | None = None,
              quiet: bool = True, label: Callable[[Any], str] = str, total_requests: int = 0,
              *, executor: Executor | None = None) -> list:
    """Call ``run_point(point, progress)`` for every point; the results in the points' order.

    Without ``executor``: with one job the points run here one after another, each announced
    on stderr as "run k of N: label" (unless ``quiet``) with a bar over its
    ``total_requests`` requests, which ``progress(n)`` advances (``progress`` may be None).
    With more, in that many forked processes that share what this process holds (the parsed
    trace) copy-on-write; where a process cannot be forked the points run here, and a note
    says so. ``jobs=None``: one process per core, at most one per point.

    With ``executor`` (any ``concurrent.futures.Executor``: a ``ProcessPoolExecutor``, a
    ``ThreadPoolExecutor``, Dask's ``Client.get_executor()``, ...): each point is submitted
    as ``run_point(point, None)``. For an executor of other processes or machines,
    ``run_point``, the points and the results must pickle (a module-level function or a
    ``functools.partial`` of one, not a lambda or a closure), and whatever ``run_point``
    reads (a trace file) must be reachable from the workers. The executor stays open: it is
    the caller's.

    With several processes or an executor, one bar counts finished points, and each is
    announced as "done k of N: label" as it finishes.

    Args:
        points: The points, in the order of the results.
        run_point: ``run_point(point, progress) -> result``.
        jobs: Forked processes (None: one per core); not with ``executor``.
        quiet: No announcements and no bar.
        label: A point's text in the announcements.
        total_requests: The length of one point's bar (serial runs).
        executor: Run the points there instead.

    Returns:
        ``[run_point(point, ...) for point in points]``, whichever process ran each.

    Raises:
        SweepError: a worker process died (out of memory, killed).
        ValueError: both ``jobs`` and ``executor``.
        Exception: what ``run_point`` raised for the first point found failing; the points
            not started yet are cancelled.
    """
    if executor is not None:
        if jobs is not None:
            raise ValueError("run_sweep: jobs and executor are exclusive: the executor's "
                             "workers run the points")
        return _run_on(executor, points, run_point, quiet, label)
    global _SWEEP
    jobs = min(_default_jobs() if jobs is None else jobs, len(points))
    if jobs > 1 and "fork" not in multiprocessing.get_all_start_methods():
        print(f"radixcache: note: --jobs {jobs}: this platform cannot fork a process that "
              "shares the parsed trace; running the points one after another",
              file=sys.stderr)
        jobs = 1
    if jobs <= 1:
        results = []
        for k, point in enumerate(points, 1):
            text = f"run {k} of {len(points)}: {label(point)}"
            if not quiet:
                print(text, file=sys.stderr, flush=True)
            bar = progress_bar(quiet, total=total_requests, desc=text, unit="req")
            try:
                results.append(run_point(point, bar.update if bar is not None else None))
            finally:
                if bar is not None:
                    bar.close()
        return results

    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    results = [None] * len(points)
    _SWEEP = (run_point, points)
    bar = None
    # What exists now (the parsed trace, the modules) is shared with the forked workers: kept
    # out of their collections, which would otherwise walk it and copy the pages they touch.
    # Undone once the workers are gone, unless the caller had frozen objects already.
    frozen = not gc.get_freeze_count()
    if frozen:
        gc.freeze()
    try:
        executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_sweep_worker_init)
    except BaseException:
        if frozen:
            gc.unfreeze()
        raise
    done = False
    try:
        futures = [executor.submit(_sweep_point, index) for index in range(len(points))]
        # The bar (and its monitor thread) only once the workers are forked.
        bar = progress_bar(quiet, total=len(points), desc=f"{len(points)} points, {jobs} processes",
                           unit="point")
        for finished, future in enumerate(as_completed(futures), 1):
            try:
                index, result = future.result()
            except BrokenProcessPool:
                raise SweepError("a worker process of --jobs died (out of memory?); "
                                 "try fewer --jobs") from None
            results[index] = result
            _finished(bar, quiet, finished, len(points), label(points[index]))
        done = True
    finally:
        _SWEEP = None
        if bar is not None:
            bar.close()
        if not done:  # an error or Ctrl-C: stop the points still running
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)
        if frozen:
            gc.unfreeze()
    return results


def _finished(bar: Any, quiet: bool, finished: int, total: int, text: str) -> None:
    if bar is not None:
        bar.update(1)
    if not quiet:
        print(f"done {finished} of {total}: {text}", file=sys.stderr, flush=True)


def _run_on(executor: Executor, points: Sequence, run_point: Callable[[Any, Any], Any],
            quiet: bool, label: Callable[[Any], str]) -> list:
    """``run_sweep`` on the caller's executor."""
    from concurrent.futures import BrokenExecutor, as_completed

    results = [None] * len(points)
    futures: dict = {}
    bar = None
    done = False
    try:
        for index, point in enumerate(points):
            futures[executor.submit(run_point, point, None)] = index
        bar = progress_bar(quiet, total=len(points), desc=f"{len(points)} points, executor",
                           unit="point")
        for finished, future in enumerate(as_completed(futures), 1):
            index = futures[future]
            try:
                results[index] = future.result()
            except BrokenExecutor as exc:
                raise SweepError(f"a worker of the executor died (out of memory?): "
                                 f"{exc}") from None
            _finished(bar, quiet, finished, len(points), label(points[index]))
        done = True
    finally:
        if bar is not None:
            bar.close()
        if not done:  # an error or Ctrl-C: the points not started yet are not run
            for future in futures:
                future.cancel()
    return results


# -- simulate's points, runnable in any process --------------------------------------------

class TraceSource(NamedTuple):
    """Where a sweep's requests come from, so that any process can read them again: the
    trace file (an absolute path) or, with ``path`` None, the embedded synthetic chat
    workload of ``seed``; the first ``limit`` requests."""

    path: str | None
    block_size: int
    limit: int | None
    seed: int

    def read(self) -> Trace:
        """Parse the trace (or make the embedded workload).

        Raises:
            TraceError: a malformed trace.
            OSError: an unreadable one.
        """
        from ..traces import Trace, read_trace
        from ..workloads import synthetic_chat

        if self.path is None:
            requests = Trace.from_requests(synthetic_chat(seed=self.seed))
            return requests if self.limit is None else requests[: self.limit]
        return read_trace(self.path, block_size=self.block_size, limit=self.limit)


# The trace this process read for points that came from another process: (source, trace).
# One at a time, so that a long-lived worker (Dask's) holds at most one trace.
_LOADED: tuple | None = None
_LOADING = threading.Lock()


def _load(source: TraceSource, counts: tuple[int, int]) -> Trace:
    """``source``'s trace, read once per process; it must hold what the driver's held."""
    global _LOADED
    from ..traces import TraceError

    where = f"{source.path!r} on {socket.gethostname()}"
    with _LOADING:  # threads of one worker share one read
        if _LOADED is None or _LOADED[0] != source:
            _LOADED = None  # the previous trace goes before the next one is read
            try:
                _LOADED = (source, source.read())
            except OSError as exc:
                raise SweepError(f"a worker cannot read the trace {where}: "
                                 f"{exc.strerror or exc} (the trace's path must be reachable "
                                 "from every worker)") from None
            except TraceError as exc:
                raise SweepError(f"a worker read a malformed trace {where}: {exc}") from None
        trace = _LOADED[1]
    found = (len(trace), trace.prompt_tokens)
    if found != counts:
        raise SweepError(f"the trace {where} holds {found[0]:,} requests and {found[1]:,} "
                         f"prompt tokens, the sweep's {counts[0]:,} and {counts[1]:,}: every "
                         "worker must read the same file")
    return trace


class _TracePoints:
    """A sweep's ``run_point`` that pickles without its parsed trace: a copy in another
    process (a process pool's, a Dask worker's) reads the trace from its source instead,
    once per process, and checks it holds the same requests."""

    def __init__(self, source: TraceSource, requests: Trace) -> None:
        self.source = source
        self.counts = (len(requests), requests.prompt_tokens)
        self._requests: Trace | None = requests

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_requests"] = None
        return state

    def requests(self) -> Trace:
        if self._requests is None:
            return _load(self.source, self.counts)
        return self._requests


class ServePoint(_TracePoints):
    """One point of ``simulate``'s single-cache sweep: ``(capacity, policy, host capacity,
    write policy)`` replayed through ``serve`` on a fresh cache of ``core``."""

    def __init__(self, source: TraceSource, requests: Trace, core: str, page_size: int) -> None:
        super().__init__(source, requests)
        self.core = core
        self.page_size = page_size

    def __call__(self, point: tuple, progress: Any = None) -> ServeResult:
        from ..cache import RadixCache
        from ..workloads import serve

        capacity, policy, host, write_policy = point
        requests = self.requests()
        # numpy index arrays: a simulation never needs torch (nor its import time).
        if not host:
            cache = RadixCache(page_size=self.page_size, eviction_policy=policy,
                               core=self.core, array_type="numpy")
            return serve(cache, requests, capacity, progress=progress)
        cache = RadixCache(page_size=self.page_size, eviction_policy=policy, core=self.core,
                           host_tier=True, write_policy=write_policy, array_type="numpy")
        return serve(cache, requests, capacity, progress=progress, host_capacity=host)


class FleetPoint(_TracePoints):
    """One point of ``simulate --workers N``'s sweep: ``(capacity, policy, host capacity,
    write policy, router)`` over the fleet (``router`` ``pooled``: the pooled bound)."""

    def __init__(self, source: TraceSource, requests: Trace, core: str, page_size: int, *,
                 workers: int, event_lag: Any, router_options: dict, time_model: TimeModel,
                 interval: float, arrivals: Any, routers: int = 1,
                 index: str | None = None) -> None:
        super().__init__(source, requests)
        self.core = core
        self.page_size = page_size
        self.workers = workers
        self.event_lag = event_lag
        self.router_options = router_options
        self.time_model = time_model
        self.interval = interval
        self._arrivals = arrivals
        self.routers = routers  # router replicas
        self.index = index  # the shared index's server, for the ``.../shared`` rows

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_arrivals"] = None  # made again from the trace
        return state

    def __call__(self, point: tuple, progress: Any = None) -> FleetResult:
        from .._options import POOLED
        from ..fleet import arrival_times, simulate_fleet, simulate_pooled

        capacity, policy, host, write_policy, router = point
        requests = self.requests()
        if self._arrivals is None:
            self._arrivals = arrival_times(requests, self.interval)
        common = {"page_size": self.page_size, "eviction_policy": policy, "core": self.core,
                  "arrivals": self._arrivals, "time_model": self.time_model,
                  "progress": progress}
        if host:
            common.update(host_capacity=host, write_policy=write_policy)
        if router == POOLED:
            return simulate_pooled(requests, self.workers, capacity, **common)
        if router.endswith(SHARED_SUFFIX):  # the replicas on one shared index
            result = simulate_fleet(requests, self.workers, capacity,
                                    router[:-len(SHARED_SUFFIX)], event_lag=self.event_lag,
                                    router_options=self.router_options, routers=self.routers,
                                    index=self.index, **common)
            from dataclasses import replace

            return replace(result, router=router)
        return simulate_fleet(requests, self.workers, capacity, router,
                              event_lag=self.event_lag, router_options=self.router_options,
                              routers=self.routers, **common)


# -- shards: fixed slices of a sweep and their files -----------------------------------------

#: The ``format`` of a shard file (``simulate --shard I/N --json``), and its version.
SHARD_FORMAT = "radixcache simulate --shard"
SHARD_FORMAT_VERSION = 1
#: The options of ``simulate`` that change its rows: a shard file records them (with the
#: trace, the core and the points), and ``merge`` joins only shards that agree on all of them.
ROW_OPTIONS = ("page_size", "block_size", "limit", "seed", "workers", "event_lag",
               "prefill_tps", "decode_tps", "interval", "load_weight", "prefill_weight",
               "prefix_blocks", "load_tps", "host_weight", "routers")

#: The suffix of a router row run on a shared index (``simulate --index URL``).
SHARED_SUFFIX = "/shared"


def shard_slice(points: int, index: int, shards: int) -> range:
    """The points of shard ``index`` (0-based) of ``shards``: a contiguous block, the blocks
    in shard order, their sizes differing by at most one (shards past the points are empty).

    Args:
        points: How many points the sweep has.
        index: The shard, 0 to ``shards - 1``.
        shards: How many shards.

    Returns:
        The shard's point indices, a ``range``.

    Raises:
        ValueError: ``shards < 1``, ``index`` outside ``0..shards-1`` or ``points < 0``.
    """
    if shards < 1 or not 0 <= index < shards or points < 0:
        raise ValueError(f"shard {index} of {shards} over {points} points does not exist")
    return range(index * points // shards, (index + 1) * points // shards)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def take_shard(args: argparse.Namespace, points: list, run_point: _TracePoints,
               trace_name: str) -> tuple[list, dict | None]:
    """The points this run replays: with ``--shard I/N`` those of shard I (and a line on
    stdout saying so), else all. Also what the shard's file records about the sweep (None
    without ``--shard``): the trace (name, size, sha256, requests, prompt tokens), the
    radixcache version, the core, ``ROW_OPTIONS`` and every point of the sweep."""
    if args.shard is None:
        return points, None
    from .. import __version__

    index, count = args.shard
    part = shard_slice(len(points), index, count)
    trace = {"name": trace_name, "requests": run_point.counts[0],
             "prompt_tokens": run_point.counts[1]}
    if run_point.source.path is not None:
        trace.update(bytes=os.path.getsize(run_point.source.path),
                     sha256=_file_sha256(run_point.source.path))
    options = {name: getattr(args, name) for name in ROW_OPTIONS}
    if options["event_lag"] is not None:
        options["event_lag"] = str(options["event_lag"])
    sweep = {"radixcache": __version__, "trace": trace, "core": run_point.core,
             "options": options, "points": [list(point) for point in points]}
    print(f"shard {index}/{count}: {len(part)} of the sweep's {len(points)} points")
    return points[part.start:part.stop], {"shard": [index, count], "sweep": sweep}


def write_shard(path: str, record: dict, rows: list[dict]) -> None:
    """A shard's file, written atomically: ``{"format": SHARD_FORMAT, "format_version": 1,
    "shard": [I, N], "sweep": {...}, "rows": [...]}`` (``rows``: the shard's rows, as a run
    without ``--shard`` writes them)."""
    document = {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, **record,
                "rows": rows}

    def write(temp_path: str) -> None:
        with open(temp_path, "w", encoding="utf-8") as out:
            json.dump(document, out, indent=2)
            out.write("\n")

    atomic_write(path, write)

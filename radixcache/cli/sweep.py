"""Running a sweep's points (``simulate --jobs``): one after another here, or in forked
processes that share the parsed trace."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
from typing import Any, Callable

from .output import progress_bar


class SweepError(Exception):
    """The worker processes of a sweep failed (exit code 1)."""


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


def run_sweep(points: list, run_point: Callable[[Any, Any], Any], jobs: int | None,
              quiet: bool, label: Callable[[Any], str], total_requests: int) -> list:
    """``run_point(point, progress)`` for every point, the results in the points' order.

    With one job the points run here one after another, each announced as "run k of N: label"
    and with a bar over its requests. With more, in that many forked processes (each point is
    independent and rows do not depend on where they ran), under one bar that counts finished
    points; where a process cannot be forked the points run here, and a note says so. Each
    finished point is announced as "done k of N: label".
    """
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

    from concurrent.futures import ProcessPoolExecutor, as_completed  # noqa: PLC0415
    from concurrent.futures.process import BrokenProcessPool  # noqa: PLC0415

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
            if bar is not None:
                bar.update(1)
            if not quiet:
                print(f"done {finished} of {len(points)}: {label(points[index])}",
                      file=sys.stderr, flush=True)
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

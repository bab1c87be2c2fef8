"""The ``radixcache`` command: ``simulate`` replays a trace through the serving loop, ``bench``
times the tree cores side by side, ``trace`` downloads and lists the public Mooncake traces.

Exit codes: 0 success, 1 unreadable or malformed trace (or failed output or download), 2 bad
arguments. Parsing imports neither torch nor the tree cores (``--help``, ``--version`` and
argument errors answer at once); a run imports them when it starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Callable, Sequence

# Light modules only: torch, numpy and the cores are imported inside the run functions.
from ._options import (DEFAULT_DECODE_TPS, DEFAULT_INTERVAL_MS, DEFAULT_LOAD_WEIGHT,
                       DEFAULT_PREFILL_TPS, EVICTION_POLICIES, POOLED, ROUTING_POLICIES, EventLag)
from ._options import DEFAULT_HOST_WEIGHT, DEFAULT_LOAD_TPS, WRITE_POLICIES

if TYPE_CHECKING:
    from .cache import RadixCache
    from .fleet import FleetResult
    from .traces import Trace
    from .workloads import Request, ServeResult

__all__ = ["main", "JSON_KEYS", "FLEET_JSON_KEYS"]

#: Keys of every object ``simulate --json`` writes, in order: every column of the table.
JSON_KEYS = ("capacity", "policy", "page_size", "requests", "rejected", "prompt_tokens",
             "cached_tokens", "hit_rate", "evicted_tokens", "peak_tokens", "seconds",
             "requests_per_second", "host_capacity", "write_policy", "device_hit_rate",
             "host_hit_rate", "loaded_tokens", "backed_up_tokens")
#: Keys of the rows ``simulate --workers N --json`` writes (N >= 2), in order.
FLEET_JSON_KEYS = JSON_KEYS + ("workers", "router", "prefill_tokens", "load_imbalance",
                               "ttft_p50", "ttft_p99", "wall_seconds")
#: The tree cores, by name (which are built is known only once the cores are imported).
CORE_NAMES = ("c", "python")
DEFAULT_ROUTERS = "round-robin,prefix-hash,cache-aware"
#: The options that only a fleet (--workers >= 2) uses, with their defaults.
FLEET_DEFAULTS = {"router": DEFAULT_ROUTERS, "event_lag": "0", "prefill_tps": DEFAULT_PREFILL_TPS,
                  "decode_tps": DEFAULT_DECODE_TPS, "interval": DEFAULT_INTERVAL_MS,
                  "load_weight": DEFAULT_LOAD_WEIGHT, "prefill_weight": 1.0,
                  "prefix_blocks": "auto", "load_tps": DEFAULT_LOAD_TPS,
                  "host_weight": DEFAULT_HOST_WEIGHT}

EMBEDDED_NAME = "synthetic chat (embedded)"
#: Traces larger than this get a "reading" line first (parsing takes seconds).
LARGE_TRACE_BYTES = 1_000_000
#: Capacities for the embedded chat workload; a trace file gets fractions of its size.
DEFAULT_CAPACITIES = "32768,131072,524288"
#: Default capacities for a trace: these fractions of its unique prompt tokens.
CAPACITY_FRACTIONS = (1 / 64, 1 / 16, 1 / 4, 1)

# Plot size in inches at PLOT_DPI: the PNG is 800 x 500 pixels.
PLOT_SIZE = (8, 5)
PLOT_DPI = 100


class _UsageError(Exception):
    """A bad argument found after parsing (exit code 2)."""


class _ParseError(Exception):
    """argparse's complaint, with the (sub)command parser it belongs to."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """Errors become one line plus the (sub)command's usage line, printed by ``main``."""

    def error(self, message: str):  # type: ignore[override]
        raise _ParseError(self, message)


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415
    except ImportError:  # pragma: no cover -- Python < 3.8
        PackageNotFoundError, version = Exception, None
    try:
        if version is not None:
            return version("radixcache")
    except PackageNotFoundError:
        pass
    from . import __version__  # noqa: PLC0415

    return __version__


class _VersionAction(argparse.Action):
    """``--version``: the installed package's version (looked up only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"radixcache {_version()}")
        parser.exit()


class _SweepError(Exception):
    """The worker processes of a sweep failed (exit code 1)."""


# -- argument parsing --------------------------------------------------------------------------
_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """A count of tokens (or requests) as people write it: ``4096``, ``500k``, ``1M``,
    ``1.5M``, ``2G``, ``1e6``, ``64Ki`` (k/M/G/T are powers of 1000, Ki/Mi/Gi of 1024; case
    does not matter). Raises ValueError for anything else, a negative number or a fraction
    of one."""
    cleaned = text.strip().replace("_", "")
    number = cleaned.rstrip("kKmMgGtTiI")
    unit = cleaned[len(number):].lower()
    if not number or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size like 4096, 500k, 1M, 1e6 or 2G, got {text!r}")
    try:
        value = Decimal(number) * _SIZE_UNITS[unit]
    except InvalidOperation:
        raise ValueError(f"expected a size like 4096, 500k, 1M, 1e6 or 2G, got {text!r}") from None
    if not value.is_finite():
        raise ValueError(f"expected a finite size, got {text!r}")
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number ({value.normalize():f})")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text.strip()}")
    return value


def _plain_positive_int(text: str) -> int:
    """A small count (workers, repeats): digits only."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _capacity_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            values.append(_positive_int(part))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"capacity {part!r}: {exc}") from None
    return sorted(set(values))


def _host_capacity_list(text: str) -> list[int]:
    """Host capacities: sizes >= 0 (0: no host tier), duplicates dropped, sorted."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = parse_size(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"host capacity {part!r}: {exc}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"host capacity {part!r}: must be >= 0")
        values.append(value)
    return sorted(set(values))


def _write_policy_list(text: str) -> list[str]:
    return _name_list(text, WRITE_POLICIES, "write policy")


def _name_list(text: str, valid: Sequence[str], what: str) -> list[str]:
    """A comma-separated list of names from ``valid`` (or ``all``), duplicates dropped."""
    if text.strip() == "all":
        return list(valid)
    names = []
    for part in text.split(","):
        name = part.strip()
        if name not in valid:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {name!r}; valid: {', '.join(valid)} or 'all'"
            )
        if name not in names:
            names.append(name)
    return names


def _policy_list(text: str) -> list[str]:
    return _name_list(text, EVICTION_POLICIES, "policy")


def _router_list(text: str) -> list[str]:
    return _name_list(text, ROUTING_POLICIES, "router")


def _prefix_blocks(text: str) -> int | str:
    if text.strip() == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 1 or 'auto', got {text!r}") from None


def _event_lag(text: str) -> EventLag:
    try:
        return EventLag.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(low: float, low_ok: bool):
    """A float parser accepting values above ``low`` (or equal when ``low_ok``), finite."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not low_ok):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if low_ok else '>'} {low:g} and finite, got {text}")
        return value
    return parse


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="radixcache", usage="radixcache [-h] [--version] COMMAND ...",
        description="Replay LLM request traces through a radix-tree KV prefix cache.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sim = sub.add_parser(
        "simulate", prog="radixcache simulate",
        help="replay a trace through the serving loop and report hit rates",
        usage="radixcache simulate [TRACE] [--capacity N[,N...]] [--policy NAME[,NAME...]] "
              "[options]",
        description="Replay TRACE (Mooncake or token-id JSONL; without it, an embedded "
                    "synthetic chat workload) through the serving loop against a KV pool of "
                    "each capacity with each eviction policy.",
    )
    sim.add_argument("trace", nargs="?", metavar="TRACE",
                     help="JSONL trace file (default: the embedded synthetic chat workload)")
    sim.add_argument("--capacity", type=_capacity_list, default=None, metavar="N[,N...]",
                     help="KV pool size(s) in token slots, such as 4096, 500k, 1M, 1e6 or 2G "
                          "(default: for a trace file, "
                          + ", ".join(f"1/{round(1 / f)}" if f < 1 else "all"
                                      for f in CAPACITY_FRACTIONS)
                          + " of its unique prompt tokens, rounded; for the embedded "
                          f"workload {DEFAULT_CAPACITIES})")
    sim.add_argument("--page-size", type=_positive_int, default=1, metavar="P",
                     help="tokens per KV page (default 1)")
    sim.add_argument("--policy", type=_policy_list, default=["lru"], metavar="NAME[,NAME...]",
                     help=f"eviction policies: {', '.join(EVICTION_POLICIES)} or 'all' "
                          "(default lru)")
    sim.add_argument("--limit", type=_positive_int, metavar="K",
                     help="replay only the first K requests")
    sim.add_argument("--block-size", type=_positive_int, default=512, metavar="B",
                     help="tokens per hash id in Mooncake traces (default 512)")
    sim.add_argument("--seed", type=int, default=0,
                     help="seed of the embedded synthetic workload and of the 'random' router "
                          "(default 0)")
    sim.add_argument("--core", choices=CORE_NAMES, default=None,
                     help="tree core (default: the compiled core 'c' when it is built, else "
                          "'python')")
    sim.add_argument("--plot", metavar="OUT.png",
                     help="write a hit-rate-vs-capacity plot, in the format its extension "
                          "names (.png, .pdf, .svg, ...)")
    sim.add_argument("--json", metavar="OUT.json", help="write the result rows as JSON")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    host = sim.add_argument_group(
        "host tier",
        "Back each cache with host memory: evicted prefixes are copied there (per the write "
        "policy) and host hits are loaded back before the request runs; they count in the "
        "hit rate (split into device and host hit rates).")
    host.add_argument("--host-capacity", type=_host_capacity_list, default=None,
                      metavar="H[,H...]",
                      help="host memory in token slots per cache (per worker with --workers), "
                           "such as 0, 4M, 1e8; several make a sweep dimension (default: no "
                           "host tier, the same as 0)")
    host.add_argument("--write-policy", type=_write_policy_list, default=None,
                      metavar="NAME[,NAME...]",
                      help=f"when a prefix is copied to the host: {', '.join(WRITE_POLICIES)} "
                           "(on eviction, on its first hit, on its second hit) or 'all' "
                           "(default write_back)")
    sim.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                     help="run the sweep's points in N processes that share the parsed trace "
                          "(default: the number of cores, at most one per point; 1: serially)")
    fleet = sim.add_argument_group(
        "fleet (--workers N >= 2)",
        "Replay over N workers of --capacity slots each behind a router that learns what they "
        "hold only from their KV events, with a time model; a 'pooled' row gives the bound of "
        "one cache of N x capacity slots.")
    fleet.add_argument("--workers", type=_plain_positive_int, default=1, metavar="N",
                       help="workers, each with its own cache of --capacity slots (default 1: "
                            "the single-cache replay)")
    fleet.add_argument("--router", type=_router_list, default=None, metavar="NAME[,NAME...]",
                       help=f"routing policies: {', '.join(ROUTING_POLICIES)} or 'all' "
                            f"(default {DEFAULT_ROUTERS})")
    fleet.add_argument("--event-lag", type=_event_lag, default=None, metavar="LAG",
                       help="how late the router sees the workers' KV events: N routing "
                            "decisions, or Nms of simulated time (default 0: before the next "
                            "decision)")
    fleet.add_argument("--prefill-tps", type=_number(0, False), default=None, metavar="T",
                       help="prefill throughput per worker, tokens/s "
                            f"(default {DEFAULT_PREFILL_TPS:g})")
    fleet.add_argument("--decode-tps", type=_number(0, False), default=None, metavar="T",
                       help="decode speed per running request, tokens/s "
                            f"(default {DEFAULT_DECODE_TPS:g})")
    fleet.add_argument("--interval", type=_number(0, True), default=None, metavar="MS",
                       help="arrival interval for traces without timestamps, ms "
                            f"(default {DEFAULT_INTERVAL_MS:g})")
    fleet.add_argument("--load-weight", type=_number(0, True), default=None, metavar="W",
                       help="cache-aware: weight of a worker's load (tokens queued or running) "
                            f"(default {DEFAULT_LOAD_WEIGHT:g})")
    fleet.add_argument("--prefill-weight", type=_number(0, True), default=None, metavar="W",
                       help="cache-aware: weight of the prefill tokens the request would need "
                            "on the worker (default 1)")
    fleet.add_argument("--prefix-blocks", type=_prefix_blocks, default=None, metavar="N|auto",
                       help="prefix-hash: hash the first N blocks of --page-size tokens; 'auto' "
                            "(default) hashes the shortest prefix that at most one worker's "
                            "share of the requests seen starts with")
    fleet.add_argument("--load-tps", type=_number(0, False), default=None, metavar="T",
                       help="host tier: host-to-device load speed per worker, tokens/s, added "
                            f"to TTFT (default {DEFAULT_LOAD_TPS:g}: 128 KiB per token of a "
                            "Llama-3-8B-shaped model over ~26 GB/s of PCIe)")
    fleet.add_argument("--host-weight", type=_number(0, True), default=None, metavar="W",
                       help="cache-aware: weight of a block held only on a worker's host "
                            f"tier, as a fraction of a device block, 0..1 (default "
                            f"{DEFAULT_HOST_WEIGHT:g})")

    bench = sub.add_parser(
        "bench", prog="radixcache bench", help="time the tree cores side by side",
        usage="radixcache bench [--quick] [--repeat N]",
        description="Time every available tree core on the embedded chat workload (serving "
                    "loop, cache calls only; in-cache calls per input type split into tree "
                    "walk and the rest) and on insert/exists exercise workloads over a shallow "
                    "and a deep tree (against a set of tuples), with the walk cost per node.",
    )
    bench.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    bench.add_argument("--repeat", type=_plain_positive_int, default=None, metavar="N",
                       help="runs per measurement, the best is kept (default 3, 1 with --quick)")
    for name, command in (("simulate", sim), ("bench", bench)):
        command.set_defaults(parser=command)

    from .download import TRACES  # noqa: PLC0415 -- standard library only

    trace = sub.add_parser(
        "trace", prog="radixcache trace", help="download or list the public Mooncake traces",
        usage="radixcache trace {download,list} ...",
        description="Fetch the public Mooncake FAST'25 request traces (published by the "
                    "Mooncake project, Apache-2.0) into a local directory, checked against "
                    "their published size and sha256.")
    trace.set_defaults(parser=trace)
    trace_sub = trace.add_subparsers(dest="trace_command", metavar="ACTION")
    trace_sub.required = True
    default_dir = "$XDG_CACHE_HOME/radixcache/traces, else ~/.cache/radixcache/traces"
    download = trace_sub.add_parser(
        "download", prog="radixcache trace download", help="fetch a trace",
        usage="radixcache trace download NAME [--dir DIR] [--force] [--quiet]",
        description="Fetch trace NAME and print where it went; a valid copy already there "
                    "is kept.")
    download.add_argument("name", choices=list(TRACES), metavar="NAME",
                          help=f"the trace: {', '.join(TRACES)}")
    download.add_argument("--dir", metavar="DIR", help=f"where to put it (default {default_dir})")
    download.add_argument("--force", action="store_true",
                          help="fetch it again even when a valid copy is there")
    download.add_argument("--quiet", action="store_true", help="no progress bar")
    listing = trace_sub.add_parser(
        "list", prog="radixcache trace list", help="list the traces and whether they are here",
        usage="radixcache trace list [--dir DIR]",
        description="The traces 'trace download' knows, their size, and whether a valid "
                    "copy is in DIR.")
    listing.add_argument("--dir", metavar="DIR", help=f"where to look (default {default_dir})")
    download.set_defaults(parser=download)
    listing.set_defaults(parser=listing)
    return parser


# -- output helpers ----------------------------------------------------------------------------
def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(temp_path)`` then move the file onto ``path``: never a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
    os.close(fd)
    try:
        write(temp_path)
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp_path, 0o666 & ~umask)
        os.replace(temp_path, path)
    except BaseException:
        try:
            os.unlink(temp_path)
        except OSError:
            pass
        raise


def _check_output_path(path: str | None, option: str) -> None:
    """Fail before a long replay when an output file could never be written."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _UsageError(f"{option}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise _UsageError(f"{option}: {path!r} is a directory")
    if not os.access(directory, os.W_OK):
        raise _UsageError(f"{option}: directory {directory!r} is not writable")


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                  left: Sequence[int] = ()) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _progress_bar(total: int, label: str, quiet: bool, unit: str = "req"):
    """A tqdm bar on stderr, or None when quiet, not a terminal, or tqdm is missing."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415 -- only needed on a terminal
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False)


# -- running a sweep's points ------------------------------------------------------------------
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


def _run_sweep(points: list, run_point: Callable[[Any, Any], Any], jobs: int | None,
               quiet: bool, label: Callable[[Any], str], total_requests: int) -> list:
    """``run_point(point, progress)`` for every point, the results in the points' order.

    With one job the points run here one after another, each announced as "run k of N: label"
    and with a bar over its requests. With more, in that many forked processes (each point is independent and rows do not depend
    on where they ran), under one bar that counts finished points; where a process cannot be
    forked the points run here, and a note says so. Each finished point is announced as
    "done k of N: label".
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
            bar = _progress_bar(total_requests, text, quiet)
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
        bar = _progress_bar(len(points), f"{len(points)} points, {jobs} processes", quiet,
                            unit="point")
        for finished, future in enumerate(as_completed(futures), 1):
            try:
                index, result = future.result()
            except BrokenProcessPool:
                raise _SweepError("a worker process of --jobs died (out of memory?); "
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


# -- simulate ------------------------------------------------------------------------------------
def _write_json(path: str, rows: list[dict]) -> None:
    def write(temp_path: str) -> None:
        with open(temp_path, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
            out.write("\n")

    _atomic_write(path, write)


def _short_count(n: int) -> str:
    """1536 -> '1.5k', 4194304 -> '4.19M' (powers of 1000, up to 3 significant digits)."""
    for factor, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= factor:
            return f"{n / factor:.3g}{unit}"
    return str(n)


def _finish_plot(path: str, fig: Any, ax: Any, rows: list[dict], xlabel: str, title: str,
                 legend_title: str) -> None:
    """Axes shared by both plots (hit rate against capacity), then the atomic PNG write."""
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    capacities = sorted({r["capacity"] for r in rows})
    if capacities[-1] >= 10 * capacities[0]:
        ax.set_xscale("log")
    # Ticks at the measured capacities only, in readable units.
    ax.set_xticks(capacities, [_short_count(c) for c in capacities])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(*_hit_rate_limits([r["hit_rate"] for r in rows]))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(title=legend_title)
    fig.tight_layout()
    file_format = _plot_format(path)
    _atomic_write(path, lambda temp_path: fig.savefig(temp_path, format=file_format,
                                                      dpi=PLOT_DPI))


def _hit_rate_limits(hit_rates: Sequence[float]) -> tuple[float, float]:
    """The y range (percent) for these hit rates: the data with 10% of its span (at least 1
    point) of headroom either side, within 0..100."""
    low, high = 100 * min(hit_rates), 100 * max(hit_rates)
    pad = max(0.1 * (high - low), 1.0)
    return max(0.0, low - pad), min(100.0, high + pad)


def _plot_formats() -> dict[str, str]:
    """The file formats matplotlib can write here: extension -> description."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    return Figure().canvas.get_supported_filetypes()


def _plot_format(path: str) -> str:
    """The format --plot's extension names; _UsageError when it names none matplotlib writes."""
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    formats = _plot_formats()
    if extension not in formats:
        what = f"extension '.{extension}'" if extension else "no extension"
        raise _UsageError(f"--plot: {path!r} has {what}; use one of "
                          + ", ".join("." + f for f in sorted(formats)))
    return extension


def _write_plot(path: str, rows: list[dict], trace_name: str, page_size: int) -> None:
    # Figure without pyplot renders PNG through the Agg canvas: no GUI backend involved.
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    # One line per eviction policy (and write policy, when a host tier has several).
    policies = list(dict.fromkeys((r["policy"], r.get("write_policy")) for r in rows))
    several = len({w for _, w in policies}) > 1
    markers, styles = "os^Dvx*", ("-", "--", "-.", ":")
    for i, (policy, write_policy) in enumerate(policies):
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        # Policies often tie: shrinking markers and varied dashes keep every line visible.
        ax.plot([c for c, _ in points], [100 * h for _, h in points],
                label=f"{policy}, {write_policy}" if several else policy,
                marker=markers[i % len(markers)], linestyle=styles[i % len(styles)],
                markersize=max(3, 10 - 1.5 * i), fillstyle="none" if i % 2 else "full")
    _finish_plot(path, fig, ax, rows, "KV pool capacity (token slots)",
                 f"Prefix cache hit rate vs capacity: {trace_name} (page size {page_size})",
                 "eviction policy")


def _result_row(capacity: int, policy: str, page_size: int, result: ServeResult,
                write_policy: str | None = None) -> dict:
    return {
        "capacity": capacity,
        "policy": policy,
        "page_size": page_size,
        "requests": result.requests,
        "rejected": result.rejected,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_rate": result.hit_rate,
        "evicted_tokens": result.evicted_tokens,
        "peak_tokens": result.peak_tokens,
        "seconds": result.seconds,
        "requests_per_second": result.requests_per_second,
        "host_capacity": result.host_capacity,
        "write_policy": write_policy if result.host_capacity else None,
        "device_hit_rate": result.device_hit_rate,
        "host_hit_rate": result.host_hit_rate,
        "loaded_tokens": result.loaded_tokens,
        "backed_up_tokens": result.backed_up_tokens,
    }


def _nice(n: float) -> int:
    """``n`` rounded to two significant digits (1234567 -> 1200000), at least 1."""
    if n < 1:
        return 1
    digits = len(str(int(n))) - 2
    step = 10 ** max(digits, 0)
    return max(1, int(round(n / step)) * step)


def default_capacities(unique_tokens: int, page_size: int) -> list[int]:
    """Capacities at ``CAPACITY_FRACTIONS`` of a trace's unique prompt tokens, rounded to
    nice numbers, none below one page."""
    return sorted({max(page_size, _nice(unique_tokens * f)) for f in CAPACITY_FRACTIONS})


def _warn(message: str) -> None:
    print(f"radixcache: warning: {message}", file=sys.stderr)


def _warn_meaningless(args: argparse.Namespace, requests: Sequence[Request]) -> None:
    """One line on stderr for each setting that makes the run's numbers meaningless."""
    if not requests:
        _warn("the trace holds no requests: every number will be 0")
        return
    # A parsed trace has its lengths as columns: reading them makes no request's tokens.
    prompt_lengths = getattr(requests, "prompt_lengths", None)
    if prompt_lengths is not None:
        longest = int(prompt_lengths.max())
        smallest = int((prompt_lengths + requests.output_lengths).min())
    else:
        longest = max(len(r.prompt) for r in requests)
        smallest = min(len(r.prompt) + r.output_len for r in requests)
    if args.page_size > longest:
        _warn(f"the page size ({args.page_size:,} tokens) is larger than every prompt (the "
              f"longest has {longest:,} tokens): nothing can be cached, the hit rate is 0")
    below_page = []
    if args.page_size <= longest:
        below_page = [c for c in args.capacity if c < args.page_size]
        if below_page:
            _warn(f"{_capacities(below_page)} smaller than one page ({args.page_size:,} "
                  "tokens): no page fits, nothing can be cached")
    too_small = [c for c in args.capacity if c < smallest and c not in below_page]
    if too_small:
        _warn(f"{_capacities(too_small)} smaller than every request (the smallest needs "
              f"{smallest:,} slots): every request will be rejected")


def _capacities(values: Sequence[int]) -> str:
    """'capacity 1,000 is' or 'capacities 1,000 and 2,000 are'."""
    if len(values) == 1:
        return f"capacity {values[0]:,} is"
    return (f"capacities {', '.join(f'{v:,}' for v in values[:-1])} and {values[-1]:,} are")


def _fleet_options(args: argparse.Namespace) -> None:
    """Fill the fleet options' defaults; naming one without --workers >= 2 is an error."""
    given = [name for name in FLEET_DEFAULTS if getattr(args, name) is not None]
    if args.workers == 1:
        if given:
            option = "--" + given[0].replace("_", "-")
            raise _UsageError(f"{option} applies to a fleet: add --workers N (N >= 2)")
        return
    for name, default in FLEET_DEFAULTS.items():
        if getattr(args, name) is None:
            value = default
            if name == "router":
                value = _router_list(default)
            elif name == "event_lag":
                value = EventLag.parse(default)
            setattr(args, name, value)


def _host_options(args: argparse.Namespace) -> None:
    """Fill the host tier's defaults; a write policy without host memory is an error."""
    has_host = args.host_capacity is not None and any(args.host_capacity)
    if args.write_policy is not None and not has_host:
        raise _UsageError("--write-policy applies to a host tier: add --host-capacity H "
                          "(H > 0)")
    for option, value in (("--load-tps", args.load_tps), ("--host-weight", args.host_weight)):
        if args.workers > 1 and value is not None and not has_host:
            raise _UsageError(f"{option} applies to a host tier: add --host-capacity H (H > 0)")
    if args.workers > 1 and args.host_weight is not None and args.host_weight > 1:
        raise _UsageError(f"--host-weight must lie in [0, 1] (a fraction of a device "
                          f"block), got {args.host_weight:g}")
    if args.write_policy is None:
        args.write_policy = ["write_back"]
    args.show_host = args.host_capacity is not None
    if args.host_capacity is None:
        args.host_capacity = [0]


def _host_points(args: argparse.Namespace) -> list[tuple[int, str | None]]:
    """(host capacity, write policy) pairs of the sweep: host 0 (no host tier) once."""
    return [(host, None) if not host else (host, write_policy)
            for host in args.host_capacity
            for write_policy in (args.write_policy if host else [None])]


def _host_label(host: int, write_policy: str | None) -> str:
    return f", host {host:,} {write_policy}" if host else ", no host"


def _simulate(args: argparse.Namespace) -> int:
    _host_options(args)  # first: it tells the options given from the defaults filled next
    _fleet_options(args)
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415 -- fail now, not after the replay
        except ImportError:
            raise _UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        _plot_format(args.plot)
    # The run starts: numpy and the cores from here on (the caches use numpy index arrays:
    # torch is not imported).
    from . import _core  # noqa: PLC0415
    from .cache import RadixCache  # noqa: PLC0415
    from .traces import Trace, TraceError, read_trace  # noqa: PLC0415
    from .workloads import serve, synthetic_chat  # noqa: PLC0415

    if args.core is not None and args.core not in _core.CORES:
        raise _UsageError(f"--core {args.core}: the compiled core is not built here "
                          f"(available: {', '.join(sorted(_core.CORES))})")

    # Parse once; every (capacity, policy) replays the same requests.
    if args.trace is None:
        trace_name = EMBEDDED_NAME
        requests: Trace = Trace.from_requests(synthetic_chat(seed=args.seed))
        if args.limit is not None:
            requests = requests[: args.limit]
    else:
        trace_name = os.path.basename(args.trace)
        try:
            if not args.quiet and os.path.getsize(args.trace) > LARGE_TRACE_BYTES:
                print(f"reading {trace_name} ({os.path.getsize(args.trace) / 1e6:,.1f} MB)...",
                      file=sys.stderr, flush=True)
            requests = read_trace(args.trace, block_size=args.block_size, limit=args.limit)
        except TraceError as exc:
            print(f"radixcache: error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"radixcache: error: cannot read trace {args.trace!r}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1

    core = _core.get_core(args.core).CORE_NAME
    if any(args.host_capacity):
        try:
            RadixCache(core=core, host_tier=True, array_type="numpy")
        except TypeError:  # a compiled core built before it had the host tier
            raise _UsageError(f"--host-capacity: the {core!r} tree core of this build has no "
                              "host tier; use --core python") from None
    prompt_total = requests.prompt_tokens
    largest_need = requests.largest_need
    capacities_note = ""
    if args.capacity is None:
        if args.trace is None:
            args.capacity = _capacity_list(DEFAULT_CAPACITIES)
        else:
            unique = requests.unique_tokens
            args.capacity = default_capacities(unique, args.page_size)
            capacities_note = (f"; capacities {', '.join(_short_count(c) for c in args.capacity)}"
                               f" (fractions of its {_short_count(unique)} unique prompt "
                               "tokens; --capacity sets others)")
    print(f"trace: {trace_name}: {len(requests):,} requests, {prompt_total:,} prompt tokens; "
          f"page size {args.page_size}; core {core}{capacities_note}")
    _warn_meaningless(args, requests)
    if args.workers > 1:
        return _simulate_fleet(args, requests, trace_name, core, largest_need)

    def run_point(point: tuple, progress: Any) -> ServeResult:
        capacity, policy, host, write_policy = point
        # numpy index arrays: a simulation never needs torch (nor its import time).
        if not host:
            cache = RadixCache(page_size=args.page_size, eviction_policy=policy, core=core,
                               array_type="numpy")
            return serve(cache, requests, capacity, progress=progress)
        cache = RadixCache(page_size=args.page_size, eviction_policy=policy, core=core,
                           host_tier=True, write_policy=write_policy, array_type="numpy")
        return serve(cache, requests, capacity, progress=progress, host_capacity=host)

    host_points = _host_points(args)
    points = [(capacity, policy, host, write_policy) for capacity in args.capacity
              for policy in args.policy for host, write_policy in host_points]

    def label(point: tuple) -> str:
        capacity, policy, host, write_policy = point
        return f"{policy} @ {capacity:,}" + (_host_label(host, write_policy)
                                               if args.show_host else "")

    results = iter(_run_sweep(points, run_point, args.jobs, args.quiet, label, len(requests)))
    rows: list[dict] = []
    table: list[list[str]] = []
    notes: list[str] = []
    for capacity, policy, host, write_policy in points:
        result = next(results)
        rows.append(_result_row(capacity, policy, args.page_size, result, write_policy))
        line = [f"{capacity:,}", policy]
        if args.show_host:
            line += [f"{host:,}", write_policy or "-"]
        line += [f"{result.requests:,}", f"{result.rejected:,}",
                 f"{result.prompt_tokens:,}", f"{result.cached_tokens:,}",
                 f"{100 * result.hit_rate:.2f}%"]
        if args.show_host:
            line += [f"{100 * result.device_hit_rate:.2f}%",
                     f"{100 * result.host_hit_rate:.2f}%", f"{result.loaded_tokens:,}",
                     f"{result.backed_up_tokens:,}"]
        line += [f"{result.evicted_tokens:,}", f"{result.peak_tokens:,}",
                 f"{result.seconds:.3f}", f"{result.requests_per_second:,.0f}"]
        table.append(line)
        if result.rejected:
            notes.append(
                f"rejected: capacity {capacity:,} ({policy}): {result.rejected:,} of "
                f"{result.requests:,} requests did not fit in the pool even after "
                f"evicting every unlocked entry (the largest request needs "
                f"{largest_need:,} slots)"
            )
    headers = ["capacity", "policy"]
    if args.show_host:
        headers += ["host", "write policy"]
    headers += ["requests", "rejected", "prompt tokens", "cached tokens", "hit rate"]
    if args.show_host:
        headers += ["device hit", "host hit", "loaded", "backed up"]
    headers += ["evicted tokens", "peak tokens", "cache s", "req/s"]
    print(_format_table(headers, table, left=(1, 3) if args.show_host else (1,)))
    for note in notes:
        print(note)

    try:
        if args.json:
            _write_json(args.json, rows)
        if args.plot:
            if len(args.host_capacity) > 1:
                _write_host_plot(args.plot, rows, trace_name, args.page_size)
            else:
                _write_plot(args.plot, rows, trace_name, args.page_size)
    except OSError as exc:
        print(f"radixcache: error: cannot write output: {exc}", file=sys.stderr)
        return 1
    return 0


def _fleet_row(result: FleetResult) -> dict:
    row = {
        "capacity": result.capacity,
        "policy": result.policy,
        "page_size": result.page_size,
        "requests": result.requests,
        "rejected": result.rejected,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_rate": result.hit_rate,
        "evicted_tokens": result.evicted_tokens,
        "peak_tokens": result.peak_tokens,
        "seconds": result.seconds,
        "requests_per_second": result.requests / result.seconds if result.seconds > 0 else 0.0,
        "host_capacity": result.host_capacity,
        "write_policy": result.write_policy,
        "device_hit_rate": result.device_hit_rate,
        "host_hit_rate": result.host_hit_rate,
        "loaded_tokens": result.loaded_tokens,
        "backed_up_tokens": result.backed_up_tokens,
        "workers": result.workers,
        "router": result.router,
        "prefill_tokens": result.prefill_tokens,
        "load_imbalance": result.load_imbalance,
        "ttft_p50": result.ttft_p50,
        "ttft_p99": result.ttft_p99,
        "wall_seconds": result.wall_seconds,
    }
    return row


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def _simulate_fleet(args: argparse.Namespace, requests: Trace, trace_name: str,
                    core: str, largest_need: int) -> int:
    from .fleet import TimeModel, arrival_times, simulate_fleet, simulate_pooled  # noqa: PLC0415

    try:
        arrivals = arrival_times(requests, args.interval)
    except ValueError as exc:
        print(f"radixcache: error: {trace_name}: {exc}", file=sys.stderr)
        return 1
    timed = bool(requests) and requests[0].timestamp is not None
    time_model = TimeModel(args.prefill_tps, args.decode_tps, args.load_tps)
    router_options = {"load_weight": args.load_weight, "prefill_weight": args.prefill_weight,
                      "seed": args.seed, "prefix_blocks": args.prefix_blocks,
                      "host_weight": args.host_weight}
    host_note = ""
    if args.show_host:
        host_note = (f"; host load {args.load_tps:g} tokens/s per worker; cache-aware host "
                     f"block weight {args.host_weight:g}")
    print(f"fleet: {args.workers} workers; routers {', '.join(args.router)}; event lag "
          f"{args.event_lag}; prefill {args.prefill_tps:g} tokens/s per worker, decode "
          f"{args.decode_tps:g} tokens/s per request; arrivals "
          + ("from the trace's timestamps" if timed else f"every {args.interval:g} ms")
          + f"; cache-aware weights: prefill {args.prefill_weight:g}, load "
            f"{args.load_weight:g}" + host_note)

    def label(point: tuple) -> str:
        capacity, policy, host, write_policy, router = point
        return (f"{router} @ {capacity:,}" + (f" {policy}" if len(args.policy) > 1 else "")
                + (_host_label(host, write_policy) if args.show_host else ""))

    def run_point(point: tuple, progress: Any) -> FleetResult:
        capacity, policy, host, write_policy, router = point
        common = dict(page_size=args.page_size, eviction_policy=policy, core=core,
                      arrivals=arrivals, time_model=time_model, progress=progress)
        if host:
            common.update(host_capacity=host, write_policy=write_policy)
        if router == POOLED:
            return simulate_pooled(requests, args.workers, capacity, **common)
        return simulate_fleet(requests, args.workers, capacity, router,
                              event_lag=args.event_lag, router_options=router_options,
                              **common)

    points = [(capacity, policy, host, write_policy, router) for capacity in args.capacity
              for policy in args.policy for host, write_policy in _host_points(args)
              for router in [*args.router, POOLED]]
    results = iter(_run_sweep(points, run_point, args.jobs, args.quiet, label, len(requests)))
    rows: list[dict] = []
    table: list[list[str]] = []
    notes: list[str] = []
    for capacity, policy, host, write_policy, router in points:
        result = next(results)
        rows.append(_fleet_row(result))
        line = [f"{capacity:,}", policy]
        if args.show_host:
            line += [f"{host:,}", write_policy or "-"]
        line += [router, f"{result.requests:,}",
                 f"{result.rejected:,}", f"{result.prompt_tokens:,}",
                 f"{result.cached_tokens:,}", f"{100 * result.hit_rate:.2f}%"]
        if args.show_host:
            line += [f"{100 * result.host_hit_rate:.2f}%", f"{result.loaded_tokens:,}"]
        line += [f"{result.prefill_tokens:,}", f"{result.load_imbalance:.2f}",
                 _ms(result.ttft_p50), _ms(result.ttft_p99),
                 f"{result.wall_seconds:.1f}"]
        table.append(line)
        if result.rejected:
            where = (f"one cache of {args.workers} x {capacity:,} slots"
                     if router == POOLED else f"{capacity:,} slots per worker")
            notes.append(
                f"rejected: {router}, {where} ({policy}): {result.rejected:,} of "
                f"{result.requests:,} requests did not fit in their worker's pool even "
                f"after evicting every unlocked entry (the largest request needs "
                f"{largest_need:,} slots)"
            )
        skipped = (result.indexer_stats or {})
        bad = {k: v for k, v in skipped.items()
               if v and k not in ("batches", "events", "stored_blocks",
                                  "removed_blocks", "cleared", "duplicate_blocks")}
        if bad:
            notes.append(f"indexer ({router} @ {capacity:,}"
                         + (_host_label(host, write_policy) if args.show_host else "")
                         + f"): skipped events {bad}")
    headers = ["capacity", "policy"]
    if args.show_host:
        headers += ["host", "write policy"]
    headers += ["router", "requests", "rejected", "prompt tokens", "cached tokens", "hit rate"]
    if args.show_host:
        headers += ["host hit", "loaded"]
    headers += ["prefill tokens", "imbalance", "TTFT p50 ms", "TTFT p99 ms", "wall s"]
    print(_format_table(headers, table, left=(1, 3, 4) if args.show_host else (1, 2)))
    for note in notes:
        print(note)

    try:
        if args.json:
            _write_json(args.json, rows)
        if args.plot:
            if len(args.host_capacity) > 1:
                _write_host_plot(args.plot, rows, trace_name, args.page_size, args.workers)
            else:
                _write_fleet_plot(args.plot, rows, trace_name, args.page_size, args.workers)
    except OSError as exc:
        print(f"radixcache: error: cannot write output: {exc}", file=sys.stderr)
        return 1
    return 0


def _write_fleet_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                      workers: int) -> None:
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = list(dict.fromkeys((r["router"], r["policy"], r.get("write_policy")) for r in rows))
    several = len({line[2] for line in lines}) > 1  # write policies of a host tier
    markers = "os^Dvx*"
    routers = [name for name in dict.fromkeys(r["router"] for r in rows) if name != POOLED]
    for router, policy, write_policy in lines:
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows
                        if r["router"] == router and r["policy"] == policy
                        and r.get("write_policy") == write_policy)
        label = router if len(policies) == 1 else f"{router} ({policy})"
        if several:
            label += f", {write_policy}"
        if router == POOLED:
            label = f"pooled: one cache of {workers} x capacity" + (
                "" if len(policies) == 1 else f" ({policy})")
            # Dashed and grey; with several policies a shade and marker per policy.
            p = policies.index(policy)
            style = dict(linestyle="--", color=("black", "dimgray", "gray", "darkgray")[p % 4],
                         marker=None if len(policies) == 1 else markers[p % len(markers)])
        else:
            i = routers.index(router)
            style = dict(linestyle="-", marker=markers[i % len(markers)])
        ax.plot([c for c, _ in points], [100 * h for _, h in points], label=label, **style)
    _finish_plot(path, fig, ax, rows, "KV pool capacity per worker (token slots)",
                 f"Hit rate over {workers} workers by router: {trace_name} (page {page_size})",
                 "router")


def _write_host_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                     workers: int = 1) -> None:
    """Hit rate against host capacity: one line per device capacity (and eviction policy,
    write policy and router when there are several); host 0 (no host tier) starts every line."""
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    capacities = list(dict.fromkeys(r["capacity"] for r in rows))
    varying = [key for key in ("policy", "write_policy", "router")
               if len({r.get(key) for r in rows if r["host_capacity"]}) > 1]
    lines = list(dict.fromkeys((r["capacity"], *(r.get(k) for k in varying))
                               for r in rows if r["host_capacity"]))
    markers, styles = "os^Dvx*", ("-", "--", "-.", ":")
    others = list(dict.fromkeys(line[1:] for line in lines))
    for line in lines:
        capacity, rest = line[0], dict(zip(varying, line[1:]))

        def on_line(r: dict, host_too: bool) -> bool:
            return r["capacity"] == capacity and all(
                r.get(k) == v for k, v in rest.items() if host_too or k != "write_policy")

        points = sorted((r["host_capacity"], r["hit_rate"]) for r in rows
                        if on_line(r, bool(r["host_capacity"])))
        label = f"device {_short_count(capacity)}" + "".join(
            f", {v}" for v in rest.values())
        i, j = capacities.index(capacity), others.index(line[1:])
        ax.plot([h for h, _ in points], [100 * h for _, h in points], label=label,
                marker=markers[i % len(markers)], linestyle=styles[j % len(styles)],
                color=f"C{i}" if len(others) > 1 else None)
    hosts = sorted({r["host_capacity"] for r in rows})
    positive = [h for h in hosts if h]
    if positive and positive[-1] >= 10 * positive[0]:
        ax.set_xscale("symlog", linthresh=positive[0])
    ax.set_xticks(hosts, [_short_count(h) for h in hosts])
    ax.xaxis.set_minor_locator(NullLocator())
    per = " per worker" if workers > 1 else ""
    ax.set_xlabel(f"host memory{per} (token slots; 0: no host tier)")
    ax.set_ylabel("prefix cache hit rate, device + host (%)")
    ax.set_ylim(*_hit_rate_limits([r["hit_rate"] for r in rows]))
    fleet = f" over {workers} workers" if workers > 1 else ""
    ax.set_title(f"Hit rate vs host memory{fleet}: {trace_name} (page {page_size})")
    ax.grid(True, alpha=0.3)
    ax.legend(title="device capacity" + per, fontsize="small")
    fig.tight_layout()
    file_format = _plot_format(path)
    _atomic_write(path, lambda temp_path: fig.savefig(temp_path, format=file_format,
                                                      dpi=PLOT_DPI))


# -- bench ---------------------------------------------------------------------------------------
def _bench_chat(core: str, requests: list[Request], capacity: int,
                repeat: int) -> tuple[float, ServeResult]:
    from .cache import RadixCache  # noqa: PLC0415
    from .workloads import serve  # noqa: PLC0415

    best = math.inf
    result = None
    for _ in range(repeat):
        result = serve(RadixCache(eviction_policy="lru", core=core), requests, capacity)
        best = min(best, result.seconds)
    return best, result


def _run_exercise(run: Callable[[], object], repeat: int) -> tuple[float, object]:
    best = math.inf
    built = None
    for _ in range(repeat):
        built = None
        start = time.perf_counter()
        built = run()
        best = min(best, time.perf_counter() - start)
    return best, built


def _exercise_on_cache(core: str, ops: list[tuple[str, list[int]]]) -> tuple[RadixCache, int]:
    from .cache import RadixCache  # noqa: PLC0415

    cache = RadixCache(core=core)
    insert, exists = cache.insert, cache.exists
    found = 0
    for kind, tokens in ops:
        if kind == "insert":
            insert(tokens)
        elif exists(tokens):
            found += 1
    return cache, found


def _exercise_on_set(ops: list[tuple[str, list[int]]]) -> tuple[set, int]:
    seen: set = set()
    found = 0
    for kind, tokens in ops:
        if kind == "insert":
            seen.add(tuple(tokens))
        elif tuple(tokens) in seen:
            found += 1
    return seen, found


def _bench(args: argparse.Namespace) -> int:
    from . import _core  # noqa: PLC0415
    from .cache import RadixCache  # noqa: PLC0415
    from .workloads import (INPUT_TYPES, deep_exercise_ops, exercise_ops,  # noqa: PLC0415
                            synthetic_chat, time_cached_calls, walk_cost)

    repeat = args.repeat or (1 if args.quick else 3)
    cores = [name for name in ("python", "c") if name in _core.CORES]
    cores += sorted(set(_core.CORES) - set(cores))
    num_conversations = 60 if args.quick else 300
    num_ops = 10_000 if args.quick else 100_000
    requests = synthetic_chat(num_conversations=num_conversations)
    shapes = {"shallow": exercise_ops(num_ops=num_ops),
              "deep": deep_exercise_ops(num_ops=num_ops)}
    capacity = 65536
    chat_label = f"chat: {len(requests):,} requests, capacity {capacity:,}, lru"
    print(f"radixcache bench: best of {repeat} run(s); cores: {', '.join(cores)}")

    table = []
    chat_seconds: dict[str, float] = {}
    ops_seconds: dict[tuple[str, str], float] = {}
    answers: dict[str, tuple] = {}
    trees: dict[tuple[str, str], RadixCache] = {}
    for core in cores:
        seconds, result = _bench_chat(core, requests, capacity, repeat)
        chat_seconds[core] = seconds
        table.append([chat_label, core, f"{seconds:.4f}",
                      f"{len(requests) / seconds:,.0f} req/s" if seconds > 0 else "-"])
        found_all = []
        for shape, ops in shapes.items():
            label = f"exercise ({shape}): {len(ops):,} insert/exists calls"
            found_seconds, (cache, found) = _run_exercise(
                lambda ops=ops: _exercise_on_cache(core, ops), repeat)
            trees[shape, core] = cache
            ops_seconds[shape, core] = found_seconds
            found_all.append(found)
            table.append([label, core, f"{found_seconds:.4f}",
                          f"{len(ops) / found_seconds:,.0f} calls/s" if found_seconds > 0
                          else "-"])
        answers[core] = (result.cached_tokens, result.evicted_tokens, *found_all)
    for shape, ops in shapes.items():
        label = f"exercise ({shape}): {len(ops):,} insert/exists calls"
        set_seconds, (_seen, found) = _run_exercise(lambda ops=ops: _exercise_on_set(ops),
                                                    repeat)
        ops_seconds[shape, "set"] = set_seconds
        table.append([label, "set of tuples", f"{set_seconds:.4f}",
                      f"{len(ops) / set_seconds:,.0f} calls/s" if set_seconds > 0 else "-"])
    table.sort(key=lambda row: row[0] != chat_label)
    print(_format_table(["workload", "core", "seconds", "throughput"], table, left=(0, 1)))

    print("\nin-cache calls per request, every prompt cached (µs): match_prefix + insert, "
          "the core's bare walk over the same tokens, and the rest")
    rows = []
    for page_size in (1, 16):
        for input_type in INPUT_TYPES:
            for core in cores:
                timing = time_cached_calls(RadixCache(page_size=page_size, core=core),
                                           requests, input_type, passes=max(3, repeat))
                us = timing.per_request_us
                rows.append([str(page_size), input_type, core, f"{us(timing.call_seconds):.2f}",
                             f"{us(timing.walk_seconds):.2f}", f"{us(timing.rest_seconds):.2f}",
                             f"{timing.rest_share:.0%}"])
    print(_format_table(["page", "tokens as", "core", "calls", "walk", "rest", "rest share"],
                        rows, left=(1, 2)))

    print("\nexists per node visited on the exercise trees (int64 queries, ns):")
    rows = []
    for shape, ops in shapes.items():
        sequences = list({id(tokens): tokens for kind, tokens in ops if kind == "insert"}
                         .values())
        for core in cores:
            per_node, depth = walk_cost(trees[shape, core], sequences, passes=max(3, repeat))
            rows.append([shape, core, f"{trees[shape, core].node_count():,}", f"{depth:.1f}",
                         f"{per_node * 1e9:.1f}"])
    print(_format_table(["tree", "core", "nodes", "average depth", "ns per node"], rows,
                        left=(0, 1)))
    print()

    if len(cores) < 2:
        print(f"only the {cores[0]!r} core is available (the compiled core is not built), "
              "so there is no ratio to print")
    else:
        base = cores[0]
        for other in cores[1:]:
            print(f"speedup of {other!r} over {base!r}: "
                  f"chat {_ratio(chat_seconds[base], chat_seconds[other])}, "
                  + ", ".join(f"exercise ({shape}) "
                              f"{_ratio(ops_seconds[shape, base], ops_seconds[shape, other])}"
                              for shape in shapes))
        if len(set(answers.values())) > 1:
            print(f"radixcache: error: the cores disagree on the results: {answers}",
                  file=sys.stderr)
            return 1
    best = cores[-1]
    print(f"speedup of {best!r} over a set of tuples: "
          + ", ".join(f"exercise ({shape}) "
                      f"{_ratio(ops_seconds[shape, 'set'], ops_seconds[shape, best])}"
                      for shape in shapes))
    return 0


def _ratio(slow: float, fast: float) -> str:
    return f"{slow / fast:.1f}x" if fast > 0 else "-"


# -- trace ---------------------------------------------------------------------------------------
def _download_progress(name: str, quiet: bool):
    """A tqdm bar for a download (None when quiet, not a terminal, or tqdm is missing)."""
    if quiet or not sys.stderr.isatty():
        return None, None
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return None, None
    bar = tqdm(desc=name, unit="B", unit_scale=True, file=sys.stderr, leave=False)

    def update(done: int, total: int | None) -> None:
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    return bar, update


def _trace(args: argparse.Namespace) -> int:
    from . import download  # noqa: PLC0415 -- standard library only

    directory = args.dir
    if args.trace_command == "list":
        where = download.default_dir() if directory is None else directory
        print(f"traces in {where}:")
        rows = []
        for name, info in download.TRACES.items():
            problem = download.verify(name, directory)
            state = "present" if problem is None else (
                "-" if problem == "not downloaded" else f"invalid: {problem}")
            size = f"{info.size / 1e6:.1f} MB" if info.size else "a few MB"
            rows.append([name, f"{info.requests:,}", size, state, info.description])
        print(_format_table(["name", "requests", "size", "here", "description"], rows,
                            left=(0, 3, 4)))
        print("get one with: radixcache trace download NAME")
        return 0
    info = download.TRACES[args.name]
    bar, progress = _download_progress(args.name, args.quiet)
    try:
        path, fetched = download.download(args.name, directory, force=args.force,
                                          progress=progress)
    except download.DownloadError as exc:
        print(f"radixcache: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    if not fetched:
        print(f"{path} (already present and valid)")
    else:
        if info.sha256 is None:
            print(f"note: no published checksum for the {args.name} trace is recorded; its "
                  f"size and format were checked. sha256: {download._sha256(path)}",
                  file=sys.stderr)
        print(path)
    return 0


# -- entry point ---------------------------------------------------------------------------------
def _usage_line(parser: argparse.ArgumentParser) -> str:
    usage = " ".join(parser.format_usage().split())  # one line, however argparse wraps it
    return f"{usage}  (see '{parser.prog} --help')"


#: glibc's malloc settings for the command's process (mallopt's M_TRIM_THRESHOLD and
#: M_MMAP_THRESHOLD): a replay allocates and frees blocks of up to tens of MB over and over
#: (prompts, slot arrays, trees of each point), and by default glibc hands them back to the
#: system and faults them in again: a tenth of a replay's time on the Mooncake trace.
_MALLOC_TRIM_THRESHOLD = 1 << 30
_MALLOC_MMAP_THRESHOLD = 32 << 20


def _keep_freed_memory() -> None:
    """Keep the memory a replay frees for its next allocations (glibc only; elsewhere, or
    should the C library refuse, nothing changes). Only the command's own process does this:
    a library does not set its host's allocator."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # noqa: PLC0415

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(-1, _MALLOC_TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
    mallopt(-3, _MALLOC_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def entry_point() -> int:
    """The ``radixcache`` command (and ``python -m radixcache``): ``main()`` on
    ``sys.argv[1:]``, in a process that exits next; returns the exit code."""
    _keep_freed_memory()
    code = main()
    # What is left (torch's modules, the parsed trace) is kept out of the collections at
    # exit, which would otherwise walk all of it: about a quarter of a second with torch.
    gc.freeze()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the (sub)command they were given to
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except _ParseError as exc:  # one line, then the usage line of the command it concerns
        print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        print(_usage_line(exc.parser), file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse exits 0 after --help and --version
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "trace":
            return _trace(args)
        return _bench(args)
    except _UsageError as exc:
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr)
        print(_usage_line(args.parser), file=sys.stderr)
        return 2
    except _SweepError as exc:
        print(f"radixcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("radixcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry_point())

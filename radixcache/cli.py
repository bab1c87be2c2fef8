"""The ``radixcache`` command: ``simulate`` replays a trace through the serving loop, ``bench``
times the tree cores side by side.

Exit codes: 0 success, 1 unreadable or malformed trace (or failed output), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from . import _core
from .cache import EVICTION_POLICIES, RadixCache
from .fleet import (
    DEFAULT_DECODE_TPS,
    DEFAULT_INTERVAL_MS,
    DEFAULT_PREFILL_TPS,
    POOLED,
    EventLag,
    FleetResult,
    TimeModel,
    arrival_times,
    simulate_fleet,
    simulate_pooled,
)
from .router import DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from .traces import TraceError, read_trace
from .workloads import (INPUT_TYPES, Request, ServeResult, deep_exercise_ops, exercise_ops, serve,
                        synthetic_chat, time_cached_calls, walk_cost)

__all__ = ["main", "JSON_KEYS", "FLEET_JSON_KEYS"]

#: Keys of every object ``simulate --json`` writes, in order.
JSON_KEYS = ("capacity", "policy", "page_size", "requests", "prompt_tokens", "cached_tokens",
             "hit_rate", "evicted_tokens", "peak_tokens", "seconds")
#: Keys of the rows ``simulate --workers N --json`` writes (N >= 2), in order.
FLEET_JSON_KEYS = JSON_KEYS + ("workers", "router", "prefill_tokens", "load_imbalance",
                               "ttft_p50", "ttft_p99")
DEFAULT_ROUTERS = "round-robin,prefix-hash,cache-aware"
#: The options that only a fleet (--workers >= 2) uses, with their defaults.
FLEET_DEFAULTS = {"router": DEFAULT_ROUTERS, "event_lag": "0", "prefill_tps": DEFAULT_PREFILL_TPS,
                  "decode_tps": DEFAULT_DECODE_TPS, "interval": DEFAULT_INTERVAL_MS,
                  "load_weight": DEFAULT_LOAD_WEIGHT, "prefill_weight": 1.0,
                  "prefix_blocks": "auto"}

EMBEDDED_NAME = "synthetic chat (embedded)"
#: Traces larger than this get a "reading" line first (parsing takes seconds).
LARGE_TRACE_BYTES = 1_000_000
DEFAULT_CAPACITIES = "32768,131072,524288"

# Plot size in inches at PLOT_DPI: the PNG is 800 x 500 pixels.
PLOT_SIZE = (8, 5)
PLOT_DPI = 100


class _UsageError(Exception):
    """A bad argument found after parsing (exit code 2)."""


# -- argument parsing --------------------------------------------------------------------------
def _positive_int(text: str) -> int:
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
    parser = argparse.ArgumentParser(
        prog="radixcache",
        description="Replay LLM request traces through a radix-tree KV prefix cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    cores = sorted(_core.CORES)

    sim = sub.add_parser(
        "simulate", help="replay a trace through the serving loop and report hit rates",
        description="Replay TRACE (Mooncake or token-id JSONL; without it, an embedded "
                    "synthetic chat workload) through the serving loop against a KV pool of "
                    "each capacity with each eviction policy.",
    )
    sim.add_argument("trace", nargs="?", metavar="TRACE",
                     help="JSONL trace file (default: the embedded synthetic chat workload)")
    sim.add_argument("--capacity", type=_capacity_list, default=_capacity_list(DEFAULT_CAPACITIES),
                     metavar="N[,N...]",
                     help=f"KV pool size(s) in token slots (default {DEFAULT_CAPACITIES})")
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
    sim.add_argument("--core", choices=cores, default=None,
                     help=f"tree core (default: {_core.core_name()})")
    sim.add_argument("--plot", metavar="OUT.png", help="write a hit-rate-vs-capacity PNG")
    sim.add_argument("--json", metavar="OUT.json", help="write the result rows as JSON")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    fleet = sim.add_argument_group(
        "fleet (--workers N >= 2)",
        "Replay over N workers of --capacity slots each behind a router that learns what they "
        "hold only from their KV events, with a time model; a 'pooled' row gives the bound of "
        "one cache of N x capacity slots.")
    fleet.add_argument("--workers", type=_positive_int, default=1, metavar="N",
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

    bench = sub.add_parser(
        "bench", help="time the tree cores side by side",
        description="Time every available tree core on the embedded chat workload (serving "
                    "loop, cache calls only; in-cache calls per input type split into tree "
                    "walk and the rest) and on insert/exists exercise workloads over a shallow "
                    "and a deep tree (against a set of tuples), with the walk cost per node.",
    )
    bench.add_argument("--quick", action="store_true", help="smaller workloads, one repeat")
    bench.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                       help="runs per measurement, the best is kept (default 3, 1 with --quick)")
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


def _progress_bar(total: int, label: str, quiet: bool):
    """A tqdm bar on stderr, or None when quiet, not a terminal, or tqdm is missing."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # noqa: PLC0415 -- only needed on a terminal
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


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
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(title=legend_title)
    fig.tight_layout()
    _atomic_write(path, lambda temp_path: fig.savefig(temp_path, format="png", dpi=PLOT_DPI))


def _write_plot(path: str, rows: list[dict], trace_name: str, page_size: int) -> None:
    # Figure without pyplot renders PNG through the Agg canvas: no GUI backend involved.
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    ax = fig.add_subplot()
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    markers, styles = "os^Dvx*", ("-", "--", "-.", ":")
    for i, policy in enumerate(policies):
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == policy)
        # Policies often tie: shrinking markers and varied dashes keep every line visible.
        ax.plot([c for c, _ in points], [100 * h for _, h in points], label=policy,
                marker=markers[i % len(markers)], linestyle=styles[i % len(styles)],
                markersize=max(3, 10 - 1.5 * i), fillstyle="none" if i % 2 else "full")
    _finish_plot(path, fig, ax, rows, "KV pool capacity (token slots)",
                 f"Prefix cache hit rate vs capacity: {trace_name} (page size {page_size})",
                 "eviction policy")


def _result_row(capacity: int, policy: str, page_size: int, result: ServeResult) -> dict:
    return {
        "capacity": capacity,
        "policy": policy,
        "page_size": page_size,
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_rate": result.hit_rate,
        "evicted_tokens": result.evicted_tokens,
        "peak_tokens": result.peak_tokens,
        "seconds": result.seconds,
    }


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


def _simulate(args: argparse.Namespace) -> int:
    _fleet_options(args)
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415 -- fail now, not after the replay
        except ImportError:
            raise _UsageError("--plot needs matplotlib (pip install matplotlib)") from None

    # Parse once; every (capacity, policy) replays the same requests.
    if args.trace is None:
        trace_name = EMBEDDED_NAME
        requests: list[Request] = synthetic_chat(seed=args.seed)
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
    prompt_total = sum(len(r.prompt) for r in requests)
    largest_need = max((len(r.prompt) + r.output_len for r in requests), default=0)
    print(f"trace: {trace_name}: {len(requests):,} requests, {prompt_total:,} prompt tokens; "
          f"page size {args.page_size}; core {core}")
    if args.workers > 1:
        return _simulate_fleet(args, requests, trace_name, core, largest_need)

    rows: list[dict] = []
    table: list[list[str]] = []
    notes: list[str] = []
    for capacity in args.capacity:
        for policy in args.policy:
            cache = RadixCache(page_size=args.page_size, eviction_policy=policy, core=core)
            bar = _progress_bar(len(requests), f"{policy} @ {capacity:,}", args.quiet)
            try:
                result = serve(cache, requests, capacity,
                               progress=bar.update if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()
            rows.append(_result_row(capacity, policy, args.page_size, result))
            table.append([
                f"{capacity:,}", policy, f"{result.requests:,}", f"{result.rejected:,}",
                f"{result.prompt_tokens:,}", f"{result.cached_tokens:,}",
                f"{100 * result.hit_rate:.2f}%", f"{result.evicted_tokens:,}",
                f"{result.peak_tokens:,}", f"{result.seconds:.3f}",
                f"{result.requests_per_second:,.0f}",
            ])
            if result.rejected:
                notes.append(
                    f"rejected: capacity {capacity:,} ({policy}): {result.rejected:,} of "
                    f"{result.requests:,} requests did not fit in the pool even after "
                    f"evicting every unlocked entry (the largest request needs "
                    f"{largest_need:,} slots)"
                )
    print(_format_table(
        ["capacity", "policy", "requests", "rejected", "prompt tokens", "cached tokens",
         "hit rate", "evicted tokens", "peak tokens", "cache s", "req/s"],
        table, left=(1,),
    ))
    for note in notes:
        print(note)

    try:
        if args.json:
            _write_json(args.json, rows)
        if args.plot:
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
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "hit_rate": result.hit_rate,
        "evicted_tokens": result.evicted_tokens,
        "peak_tokens": result.peak_tokens,
        "seconds": result.seconds,
        "workers": result.workers,
        "router": result.router,
        "prefill_tokens": result.prefill_tokens,
        "load_imbalance": result.load_imbalance,
        "ttft_p50": result.ttft_p50,
        "ttft_p99": result.ttft_p99,
    }
    return row


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def _simulate_fleet(args: argparse.Namespace, requests: list[Request], trace_name: str,
                    core: str, largest_need: int) -> int:
    try:
        arrivals = arrival_times(requests, args.interval)
    except ValueError as exc:
        print(f"radixcache: error: {trace_name}: {exc}", file=sys.stderr)
        return 1
    timed = bool(requests) and requests[0].timestamp is not None
    time_model = TimeModel(args.prefill_tps, args.decode_tps)
    router_options = {"load_weight": args.load_weight, "prefill_weight": args.prefill_weight,
                      "seed": args.seed, "prefix_blocks": args.prefix_blocks}
    print(f"fleet: {args.workers} workers; routers {', '.join(args.router)}; event lag "
          f"{args.event_lag}; prefill {args.prefill_tps:g} tokens/s per worker, decode "
          f"{args.decode_tps:g} tokens/s per request; arrivals "
          + ("from the trace's timestamps" if timed else f"every {args.interval:g} ms")
          + f"; cache-aware weights: prefill {args.prefill_weight:g}, load "
            f"{args.load_weight:g}")

    rows: list[dict] = []
    table: list[list[str]] = []
    notes: list[str] = []
    runs = len(args.capacity) * len(args.policy) * (len(args.router) + 1)
    run = 0
    for capacity in args.capacity:
        for policy in args.policy:
            for router in [*args.router, POOLED]:
                label = f"{router} @ {capacity:,}" + (f" {policy}" if len(args.policy) > 1
                                                      else "")
                run += 1
                label = f"run {run} of {runs}: {label}"
                if not args.quiet:
                    print(label, file=sys.stderr, flush=True)
                bar = _progress_bar(len(requests), label, args.quiet)
                common = dict(page_size=args.page_size, eviction_policy=policy, core=core,
                              arrivals=arrivals, time_model=time_model,
                              progress=bar.update if bar is not None else None)
                try:
                    if router == POOLED:
                        result = simulate_pooled(requests, args.workers, capacity, **common)
                    else:
                        result = simulate_fleet(requests, args.workers, capacity, router,
                                                event_lag=args.event_lag,
                                                router_options=router_options, **common)
                finally:
                    if bar is not None:
                        bar.close()
                rows.append(_fleet_row(result))
                table.append([
                    f"{capacity:,}", policy, router, f"{result.requests:,}",
                    f"{result.rejected:,}", f"{result.prompt_tokens:,}",
                    f"{result.cached_tokens:,}", f"{100 * result.hit_rate:.2f}%",
                    f"{result.prefill_tokens:,}", f"{result.load_imbalance:.2f}",
                    _ms(result.ttft_p50), _ms(result.ttft_p99),
                    f"{result.wall_seconds:.1f}",
                ])
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
                    notes.append(f"indexer ({router} @ {capacity:,}): skipped events {bad}")
    print(_format_table(
        ["capacity", "policy", "router", "requests", "rejected", "prompt tokens",
         "cached tokens", "hit rate", "prefill tokens", "imbalance", "TTFT p50 ms",
         "TTFT p99 ms", "wall s"],
        table, left=(1, 2),
    ))
    for note in notes:
        print(note)

    try:
        if args.json:
            _write_json(args.json, rows)
        if args.plot:
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
    lines = list(dict.fromkeys((r["router"], r["policy"]) for r in rows))
    markers = "os^Dvx*"
    routers = [name for name in dict.fromkeys(r["router"] for r in rows) if name != POOLED]
    for router, policy in lines:
        points = sorted((r["capacity"], r["hit_rate"]) for r in rows
                        if r["router"] == router and r["policy"] == policy)
        label = router if len(policies) == 1 else f"{router} ({policy})"
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


# -- bench ---------------------------------------------------------------------------------------
def _bench_chat(core: str, requests: list[Request], capacity: int,
                repeat: int) -> tuple[float, ServeResult]:
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


# -- entry point ---------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 after --help
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "simulate":
            return _simulate(args)
        return _bench(args)
    except _UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"radixcache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("radixcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

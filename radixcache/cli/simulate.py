"""``radixcache simulate``: replay a trace (or the embedded chat workload) through the serving
loop over a sweep of capacities and policies, on one cache or a fleet behind a router, and
print, write (--json) and plot (--plot) the rows. numpy, the tree cores and the simulators
are imported when a run starts."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Sequence

from .._options import (DEFAULT_DECODE_TPS, DEFAULT_HOST_WEIGHT, DEFAULT_INTERVAL_MS,
                        DEFAULT_LOAD_TPS, DEFAULT_LOAD_WEIGHT, DEFAULT_PREFILL_TPS,
                        MAX_POOL_SLOTS, POOLED, EventLag)
from .._validate import counted
from .args import (CAPACITY_FRACTIONS, DEFAULT_CAPACITIES, DEFAULT_ROUTERS, capacity_list,
                   router_list)
from .errors import UsageError
from .output import check_output_path, format_table, short_count, warn, write_json
from .plots import plot_format, write_fleet_plot, write_host_plot, write_plot
from .sweep import (SHARED_SUFFIX, FleetPoint, ServePoint, TraceSource, run_sweep, take_shard,
                    write_shard)

if TYPE_CHECKING:
    from ..fleet import FleetResult
    from ..traces import Trace
    from ..workloads import Request, ServeResult

#: Keys of every object ``simulate --json`` writes, in order: every column of the table.
JSON_KEYS = ("capacity", "policy", "page_size", "requests", "rejected", "prompt_tokens",
             "cached_tokens", "hit_rate", "evicted_tokens", "peak_tokens", "seconds",
             "requests_per_second", "host_capacity", "write_policy", "device_hit_rate",
             "host_hit_rate", "loaded_tokens", "backed_up_tokens")
#: Keys of the rows ``simulate --workers N --json`` writes (N >= 2), in order.
FLEET_JSON_KEYS = JSON_KEYS + ("workers", "router", "prefill_tokens", "load_imbalance",
                               "ttft_p50", "ttft_p99", "wall_seconds")
#: The options that only a fleet (--workers >= 2) uses, with their defaults.
FLEET_DEFAULTS = {"router": DEFAULT_ROUTERS, "event_lag": "0", "prefill_tps": DEFAULT_PREFILL_TPS,
                  "decode_tps": DEFAULT_DECODE_TPS, "interval": DEFAULT_INTERVAL_MS,
                  "load_weight": DEFAULT_LOAD_WEIGHT, "prefill_weight": 1.0,
                  "prefix_blocks": "auto", "load_tps": DEFAULT_LOAD_TPS,
                  "host_weight": DEFAULT_HOST_WEIGHT, "routers": 1, "index": None}

EMBEDDED_NAME = "synthetic chat (embedded)"
#: Traces larger than this get a "reading" line first (parsing takes seconds).
LARGE_TRACE_BYTES = 1_000_000


def _row(result: ServeResult | FleetResult, capacity: int, policy: str, page_size: int,
         write_policy: str | None) -> dict:
    """The ``JSON_KEYS`` of a result row (a fleet's or a single cache's)."""
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
        "requests_per_second": result.requests / result.seconds if result.seconds > 0 else 0.0,
        "host_capacity": result.host_capacity,
        "write_policy": write_policy if result.host_capacity else None,
        "device_hit_rate": result.device_hit_rate,
        "host_hit_rate": result.host_hit_rate,
        "loaded_tokens": result.loaded_tokens,
        "backed_up_tokens": result.backed_up_tokens,
    }


def _fleet_row(result: FleetResult) -> dict:
    """The ``FLEET_JSON_KEYS`` of a fleet's result row."""
    return {
        **_row(result, result.capacity, result.policy, result.page_size, result.write_policy),
        "workers": result.workers,
        "router": result.router,
        "prefill_tokens": result.prefill_tokens,
        "load_imbalance": result.load_imbalance,
        "ttft_p50": result.ttft_p50,
        "ttft_p99": result.ttft_p99,
        "wall_seconds": result.wall_seconds,
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


def _warn_meaningless(args: argparse.Namespace, requests: Sequence[Request]) -> None:
    """One line on stderr for each setting that makes the run's numbers meaningless."""
    if not requests:
        warn("the trace holds no requests: every number will be 0")
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
        warn(f"the page size ({counted(args.page_size, 'token')}) is larger than every "
             f"prompt (the longest has {counted(longest, 'token')}): nothing can be cached, "
             "the hit rate is 0")
    below_page = []
    if args.page_size <= longest:
        below_page = [c for c in args.capacity if c < args.page_size]
        if below_page:
            warn(f"{_capacities(below_page)} smaller than one page "
                 f"({counted(args.page_size, 'token')}): no page fits, nothing can be cached")
    too_small = [c for c in args.capacity if c < smallest and c not in below_page]
    if too_small:
        warn(f"{_capacities(too_small)} smaller than every request (the smallest needs "
             f"{counted(smallest, 'slot')}): every request will be rejected")


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
            raise UsageError(f"{option} applies to a fleet: add --workers N (N >= 2)")
        return
    for name, default in FLEET_DEFAULTS.items():
        if getattr(args, name) is None:
            value = default
            if name == "router":
                value = router_list(default)
            elif name == "event_lag":
                value = EventLag.parse(default)
            setattr(args, name, value)
    for option, sizes in (("--capacity", args.capacity), ("--host-capacity", args.host_capacity)):
        if sizes and args.workers * max(sizes) > MAX_POOL_SLOTS:  # the pooled row's pool
            raise UsageError(f"{option}: the pooled row's one cache of {args.workers} x "
                             f"{max(sizes):,} slots is more than this machine can address "
                             f"(at most {MAX_POOL_SLOTS:,})")


def _host_options(args: argparse.Namespace) -> None:
    """Fill the host tier's defaults; a write policy without host memory is an error."""
    has_host = args.host_capacity is not None and any(args.host_capacity)
    if args.write_policy is not None and not has_host:
        raise UsageError("--write-policy applies to a host tier: add --host-capacity H "
                         "(H > 0)")
    for option, value in (("--load-tps", args.load_tps), ("--host-weight", args.host_weight)):
        if args.workers > 1 and value is not None and not has_host:
            raise UsageError(f"{option} applies to a host tier: add --host-capacity H (H > 0)")
    if args.workers > 1 and args.host_weight is not None and args.host_weight > 1:
        raise UsageError(f"--host-weight must lie in [0, 1] (a fraction of a device "
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


def run(args: argparse.Namespace) -> int:
    """``radixcache simulate``: replay, print the table, write --json and --plot."""
    _host_options(args)  # first: it tells the options given from the defaults filled next
    _fleet_options(args)
    _sweep_options(args)
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 -- fail now, not after the replay
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        plot_format(args.plot)
    # The run starts: numpy and the cores from here on (the caches use numpy index arrays:
    # torch is not imported).
    from .. import _core
    from ..cache import RadixCache
    from ..traces import TraceError, check_timestamps

    if args.core is not None and args.core not in _core.CORES:
        raise UsageError(f"--core {args.core}: the compiled core is not built here "
                         f"(available: {', '.join(sorted(_core.CORES))})")

    # Parse once; every (capacity, policy) replays the same requests.
    source = TraceSource(None if args.trace is None else os.path.abspath(args.trace),
                         args.block_size, args.limit, args.seed)
    if args.trace is None:
        trace_name = EMBEDDED_NAME
        requests = source.read()
    else:
        trace_name = os.path.basename(args.trace)
        try:
            if not args.quiet and os.path.getsize(args.trace) > LARGE_TRACE_BYTES:
                print(f"reading {trace_name} ({os.path.getsize(args.trace) / 1e6:,.1f} MB)...",
                      file=sys.stderr, flush=True)
            requests = source.read()
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
            raise UsageError(f"--host-capacity: the {core!r} tree core of this build has no "
                             "host tier; use --core python") from None
    prompt_total = requests.prompt_tokens
    largest_need = requests.largest_need
    capacities_note = ""
    if args.capacity is None:
        if args.trace is None:
            args.capacity = capacity_list(DEFAULT_CAPACITIES)
        else:
            unique = requests.unique_tokens
            args.capacity = default_capacities(unique, args.page_size)
            capacities_note = (f"; capacities {', '.join(short_count(c) for c in args.capacity)}"
                               f" (fractions of its {short_count(unique)} unique prompt "
                               "tokens; --capacity sets others)")
    print(f"trace: {trace_name}: {counted(len(requests), 'request')}, "
          f"{counted(prompt_total, 'prompt token')}; page size {args.page_size}; core {core}"
          f"{capacities_note}")
    try:  # the trace format's rule, whether the replay uses the timestamps or not
        check_timestamps(requests.timestamps)
    except ValueError as exc:
        print(f"radixcache: error: {trace_name}: {exc}", file=sys.stderr)
        return 1
    _warn_meaningless(args, requests)
    if args.workers > 1:
        return _run_fleet(args, requests, trace_name, core, largest_need, source)

    run_point = ServePoint(source, requests, core, args.page_size)
    host_points = _host_points(args)
    points = [(capacity, policy, host, write_policy) for capacity in args.capacity
              for policy in args.policy for host, write_policy in host_points]
    points, args.shard_record = take_shard(args, points, run_point, trace_name)

    def label(point: tuple) -> str:
        capacity, policy, host, write_policy = point
        return f"{policy} @ {capacity:,}" + (_host_label(host, write_policy)
                                               if args.show_host else "")

    results = iter(run_sweep(points, run_point, args.jobs, args.quiet, label, len(requests),
                             executor=args.executor))
    rows: list[dict] = []
    table: list[list[str]] = []
    notes: list[str] = []
    for capacity, policy, host, write_policy in points:
        result = next(results)
        rows.append(_row(result, capacity, policy, args.page_size, write_policy))
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
                f"{counted(result.requests, 'request')} did not fit in the pool even after "
                f"evicting every unlocked entry (the largest request needs "
                f"{counted(largest_need, 'slot')})"
            )
    headers = ["capacity", "policy"]
    if args.show_host:
        headers += ["host", "write policy"]
    headers += ["requests", "rejected", "prompt tokens", "cached tokens", "hit rate"]
    if args.show_host:
        headers += ["device hit", "host hit", "loaded", "backed up"]
    headers += ["evicted tokens", "peak tokens", "cache s", "req/s"]
    return _report(args, trace_name, headers, table, (1, 3) if args.show_host else (1,), notes,
                   rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:,.0f}"


def _run_fleet(args: argparse.Namespace, requests: Trace, trace_name: str, core: str,
               largest_need: int, source: TraceSource) -> int:
    from ..fleet import TimeModel, arrival_times

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
            f"{args.load_weight:g}" + host_note
          + (f"; {args.routers} router replicas" if args.routers > 1 else "")
          + (f"; shared index {args.index}" if args.index else ""))

    def label(point: tuple) -> str:
        capacity, policy, host, write_policy, router = point
        return (f"{router} @ {capacity:,}" + (f" {policy}" if len(args.policy) > 1 else "")
                + (_host_label(host, write_policy) if args.show_host else ""))

    run_point = FleetPoint(source, requests, core, args.page_size, workers=args.workers,
                           event_lag=args.event_lag, router_options=router_options,
                           time_model=time_model, interval=args.interval, arrivals=arrivals,
                           routers=args.routers, index=args.index)
    routers = [name for router in args.router for name in (
        (router, router + SHARED_SUFFIX) if args.index and router == "cache-aware" else (router,))]
    points = [(capacity, policy, host, write_policy, router) for capacity in args.capacity
              for policy in args.policy for host, write_policy in _host_points(args)
              for router in [*routers, POOLED]]
    points, args.shard_record = take_shard(args, points, run_point, trace_name)
    results = iter(run_sweep(points, run_point, args.jobs, args.quiet, label, len(requests),
                             executor=args.executor))
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
            where = (f"one cache of {args.workers} x {counted(capacity, 'slot')}"
                     if router == POOLED else f"{counted(capacity, 'slot')} per worker")
            notes.append(
                f"rejected: {router}, {where} ({policy}): {result.rejected:,} of "
                f"{counted(result.requests, 'request')} did not fit in their worker's pool "
                f"even after evicting every unlocked entry (the largest request needs "
                f"{counted(largest_need, 'slot')})"
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
    return _report(args, trace_name, headers, table, (1, 3, 4) if args.show_host else (1, 2),
                   notes, rows)


def write_sweep_plot(path: str, rows: list[dict], trace_name: str, page_size: int,
                     workers: int, host_sweep: bool) -> None:
    """The plot of a sweep's rows: against host capacity when the sweep has several, else
    against capacity (per router for a fleet, per policy otherwise)."""
    if host_sweep:
        write_host_plot(path, rows, trace_name, page_size, workers)
    elif workers > 1:
        write_fleet_plot(path, rows, trace_name, page_size, workers)
    else:
        write_plot(path, rows, trace_name, page_size)


def _sweep_options(args: argparse.Namespace) -> None:
    """--shard writes its slice's rows (--json) for 'radixcache merge', which plots them; an
    executor given to ``main`` runs the points instead of --jobs."""
    if args.shard is not None and not args.json:
        raise UsageError("--shard needs --json OUT.json: a shard's rows go to that file, "
                         "for 'radixcache merge'")
    if args.shard is not None and args.plot:
        raise UsageError("--plot draws a whole sweep, not a shard: plot the merged rows "
                         "('radixcache merge SHARD.json... --plot OUT.png')")
    if args.executor is not None and args.jobs is not None:
        raise UsageError("--jobs: the executor given to radixcache.cli.main runs the points")


def _report(args: argparse.Namespace, trace_name: str, headers: list[str],
            table: list[list[str]], left: Sequence[int], notes: list[str],
            rows: list[dict]) -> int:
    """Print the table and its notes, write --json and --plot; the exit code."""
    print(format_table(headers, table, left=left))
    for note in notes:
        print(note)
    try:
        if args.json and args.shard_record is not None:
            write_shard(args.json, args.shard_record, rows)
        elif args.json:
            write_json(args.json, rows)
        if args.plot:
            write_sweep_plot(args.plot, rows, trace_name, args.page_size, args.workers,
                             len(args.host_capacity) > 1)
    except OSError as exc:
        print(f"radixcache: error: cannot write output: {exc}", file=sys.stderr)
        return 1
    return 0

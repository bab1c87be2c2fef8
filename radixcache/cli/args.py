"""The command line: the parser of ``radixcache`` and its subcommands, and the argument types
(sizes such as ``500k``, lists of names). Imports only light modules (no torch, numpy or
tree cores): ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import math
import re
from decimal import Decimal, InvalidOperation
from typing import Sequence

from .._options import (DEFAULT_DECODE_TPS, DEFAULT_HOST_WEIGHT, DEFAULT_INTERVAL_MS,
                        DEFAULT_LOAD_TPS, DEFAULT_LOAD_WEIGHT, DEFAULT_PREFILL_TPS,
                        EVICTION_POLICIES, MAX_POOL_SLOTS, ROUTING_POLICIES, WRITE_POLICIES,
                        EventLag)
from .errors import ParseError

#: The tree cores, by name (which are built is known only once the cores are imported).
CORE_NAMES = ("c", "python")
DEFAULT_ROUTERS = "round-robin,prefix-hash,cache-aware"
#: Capacities for the embedded chat workload; a trace file gets fractions of its size.
DEFAULT_CAPACITIES = "32768,131072,524288"
#: Default capacities for a trace: these fractions of its unique prompt tokens.
CAPACITY_FRACTIONS = (1 / 64, 1 / 16, 1 / 4, 1)


class _Parser(argparse.ArgumentParser):
    """Errors become one line plus the (sub)command's usage line, printed by ``main``."""

    def error(self, message: str):  # type: ignore[override]
        raise ParseError(self, message)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixcache")
    except PackageNotFoundError:  # not installed: run from a source tree
        from .. import __version__

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


def _store_url(text: str) -> str:
    """The URL of a Redis or Valkey server."""
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"not a redis://, rediss:// or unix:// URL: {text!r}")
    return text


def _plain_positive_int(text: str) -> int:
    """A small count (workers, repeats): digits only."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


#: What is wrong with a pool size above ``MAX_POOL_SLOTS``.
_UNADDRESSABLE = f"more slots than this machine can address (at most {MAX_POOL_SLOTS:,})"


def capacity_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = _positive_int(part)
            if value > MAX_POOL_SLOTS:
                raise argparse.ArgumentTypeError(_UNADDRESSABLE)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"capacity {part!r}: {exc}") from None
        values.append(value)
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
        if value > MAX_POOL_SLOTS:
            raise argparse.ArgumentTypeError(f"host capacity {part!r}: {_UNADDRESSABLE}")
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


def router_list(text: str) -> list[str]:
    return _name_list(text, ROUTING_POLICIES, "router")


def _prefix_blocks(text: str) -> int | str:
    if text.strip() == "auto":
        return "auto"
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number >= 1 or 'auto', got {text!r}") from None


def shard(text: str) -> tuple[int, int]:
    """``I/N``: the I-th of N slices of a sweep, 0-based (``0/4`` to ``3/4``), as (I, N)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected I/N, the I-th of N shards counted from 0 (0/4 to 3/4), got {text!r}")
    index, count = int(match[1]), int(match[2])
    if count < 1:
        raise argparse.ArgumentTypeError(f"the number of shards must be >= 1, got {text!r}")
    if index >= count:
        raise argparse.ArgumentTypeError(
            f"shard {index} of {count} does not exist: shards count from 0 "
            f"(0/{count} to {count - 1}/{count}), got {text!r}")
    return index, count


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


def build_parser() -> argparse.ArgumentParser:
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
    sim.add_argument("--capacity", type=capacity_list, default=None, metavar="N[,N...]",
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
    sim.add_argument("--shard", type=shard, default=None, metavar="I/N",
                     help="run only shard I of N (counted from 0: 0/N to N-1/N), a fixed slice "
                          "of the sweep's points, and write its rows with --json for "
                          "'radixcache merge' (one shard per task of a job array)")
    fleet = sim.add_argument_group(
        "fleet (--workers N >= 2)",
        "Replay over N workers of --capacity slots each behind a router that learns what they "
        "hold only from their KV events, with a time model; a 'pooled' row gives the bound of "
        "one cache of N x capacity slots.")
    fleet.add_argument("--workers", type=_plain_positive_int, default=1, metavar="N",
                       help="workers, each with its own cache of --capacity slots (default 1: "
                            "the single-cache replay)")
    # Their defaults (None here) are filled in only for a fleet (see simulate.FLEET_DEFAULTS).
    for flag, parse, metavar, text in (
            ("--router", router_list, "NAME[,NAME...]",
             f"routing policies: {', '.join(ROUTING_POLICIES)} or 'all' "
             f"(default {DEFAULT_ROUTERS})"),
            ("--event-lag", _event_lag, "LAG",
             "how late the router sees the workers' KV events: N routing decisions, or Nms "
             "of simulated time (default 0: before the next decision)"),
            ("--prefill-tps", _number(0, False), "T",
             f"prefill throughput per worker, tokens/s (default {DEFAULT_PREFILL_TPS:g})"),
            ("--decode-tps", _number(0, False), "T",
             f"decode speed per running request, tokens/s (default {DEFAULT_DECODE_TPS:g})"),
            ("--interval", _number(0, True), "MS",
             "arrival interval for traces without timestamps, ms "
             f"(default {DEFAULT_INTERVAL_MS:g})"),
            ("--load-weight", _number(0, True), "W",
             "cache-aware: weight of a worker's load (tokens queued or running) "
             f"(default {DEFAULT_LOAD_WEIGHT:g})"),
            ("--prefill-weight", _number(0, True), "W",
             "cache-aware: weight of the prefill tokens the request would need on the worker "
             "(default 1)"),
            ("--prefix-blocks", _prefix_blocks, "N|auto",
             "prefix-hash: hash the first N blocks of --page-size tokens; 'auto' (default) "
             "hashes the shortest prefix that at most one worker's share of the requests seen "
             "starts with"),
            ("--load-tps", _number(0, False), "T",
             "host tier: host-to-device load speed per worker, tokens/s, added to TTFT "
             f"(default {DEFAULT_LOAD_TPS:g}: 128 KiB per token of a Llama-3-8B-shaped model "
             "over ~26 GB/s of PCIe)"),
            ("--host-weight", _number(0, True), "W",
             "cache-aware: weight of a block held only on a worker's host tier, as a fraction "
             f"of a device block, 0..1 (default {DEFAULT_HOST_WEIGHT:g})"),
            ("--routers", _plain_positive_int, "R",
             "router replicas in front of the workers: request i goes to replica i mod R, "
             "worker w's events to replica w mod R, each replica indexing only the workers it "
             "ingests (default 1)"),
            ("--index", _store_url, "URL",
             "redis://host:port/db of a Redis or Valkey server: cache-aware also runs with its "
             "--routers replicas on one shared index there, the 'cache-aware/shared' row "
             "(needs radixcache[redis])")):
        fleet.add_argument(flag, type=parse, default=None, metavar=metavar, help=text)

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
    merge = sub.add_parser(
        "merge", prog="radixcache merge", help="join the shards of a sweep (simulate --shard)",
        usage="radixcache merge SHARD.json [SHARD.json ...] [--json OUT.json] [--plot OUT.png]",
        description="Join the files that 'radixcache simulate --shard I/N --json' wrote, one "
                    "per shard of one sweep, into the rows a single run writes (in the same "
                    "order; the timings are each shard's own). Every shard 0 to N-1 must be "
                    "given once, all of the same trace, options and grid; otherwise nothing "
                    "is written.")
    merge.add_argument("shards", nargs="+", metavar="SHARD.json",
                       help="the shard files (any order)")
    merge.add_argument("--json", metavar="OUT.json",
                       help="write the merged rows there (default: print them on stdout)")
    merge.add_argument("--plot", metavar="OUT.png",
                       help="plot the merged rows as 'simulate --plot' does")
    for _name, command in (("simulate", sim), ("bench", bench), ("merge", merge)):
        command.set_defaults(parser=command)

    from ..download import TRACES  # standard library only

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
    from . import serve  # its flags only: the service is imported when it runs

    serve.add_parser(sub)
    return parser


def usage_line(parser: argparse.ArgumentParser) -> str:
    """The (sub)command's usage on one line, and where to read more."""
    usage = " ".join(parser.format_usage().split())  # one line, however argparse wraps it
    return f"{usage}  (see '{parser.prog} --help')"

"""``radixcache merge``: join the files that ``simulate --shard I/N --json`` wrote, one per
shard of one sweep, into the rows a single run writes.

Each file must be a shard file whose rows are its shard's points; all of them must record the
same sweep (trace content, radixcache version, tree core, the options that change rows, and
the grid of points) and the same N, and every shard 0 to N-1 must be given exactly once. The
rows come out in the sweep's order, each with the timings its shard measured. Any failure
writes nothing. Parsing the files imports no numpy, torch or tree core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NamedTuple

from .errors import UsageError
from .output import check_output_path, write_json
from .plots import plot_format
from .simulate import FLEET_JSON_KEYS, JSON_KEYS, write_sweep_plot
from .sweep import SHARD_FORMAT, SHARD_FORMAT_VERSION, SweepError, shard_slice

#: The fields of a row that are measurements, not results: they differ from run to run, and a
#: merge keeps each shard's.
TIMING_KEYS = ("seconds", "requests_per_second", "wall_seconds")
# The fields of a row that name its point, in the order of the point's tuple.
_POINT_KEYS = ("capacity", "policy", "host_capacity", "write_policy")
_FLEET_POINT_KEYS = _POINT_KEYS + ("router",)


class MergeError(SweepError):
    """The files are not the shards of one sweep, or one is not a shard file (exit code 1)."""


class Shard(NamedTuple):
    """One shard file, read and checked on its own."""

    path: str
    index: int
    count: int
    sweep: dict
    rows: list


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape_problem(document: dict) -> str | None:
    """What makes a shard file's fields unusable (None: nothing)."""
    shard = document.get("shard")
    if not (isinstance(shard, list) and len(shard) == 2 and all(map(_is_int, shard))
            and shard[1] >= 1 and 0 <= shard[0] < shard[1]):
        return f"'shard' must be [I, N] with 0 <= I < N, got {shard!r}"
    sweep = document.get("sweep")
    if not isinstance(sweep, dict):
        return "no 'sweep' object"
    for key, kind in (("radixcache", str), ("trace", dict), ("core", str), ("options", dict),
                      ("points", list)):
        if not isinstance(sweep.get(key), kind):
            return f"'sweep' has no {key!r} {kind.__name__}"
    if not isinstance(sweep["trace"].get("name"), str):
        return "the sweep's 'trace' has no 'name'"
    for key in ("page_size", "workers"):
        if not (_is_int(sweep["options"].get(key)) and sweep["options"][key] >= 1):
            return f"the sweep's 'options' have no {key!r} >= 1"
    points = sweep["points"]
    if not points or not all(isinstance(p, list) and len(p) == len(points[0]) in (4, 5)
                             for p in points):
        return "the sweep's 'points' must be lists of 4 (one cache) or 5 (a fleet) fields"
    rows = document.get("rows")
    if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
        return "'rows' must be a list of objects"
    return None


def read_shard(path: str) -> Shard:
    """Read one shard file and check it on its own: its format, and that its rows are the
    points of its shard, in order, with every field a row of the sweep's kind has.

    Raises:
        MergeError: naming the file and what is wrong with it.
    """
    try:
        with open(path, encoding="utf-8") as file:
            document = json.load(file)
    except OSError as exc:
        raise MergeError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise MergeError(f"{path}: not a shard file (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path}: not a shard file (not JSON: line {exc.lineno}, column "
                         f"{exc.colno}: {exc.msg})") from None
    if isinstance(document, list):
        raise MergeError(f"{path}: the rows of a run without --shard, not a shard file: "
                         "merge joins the files of 'radixcache simulate --shard I/N --json'")
    if not isinstance(document, dict) or document.get("format") != SHARD_FORMAT:
        raise MergeError(f"{path}: not a shard file of 'radixcache simulate --shard I/N "
                         "--json'")
    if document.get("format_version") != SHARD_FORMAT_VERSION:
        raise MergeError(f"{path}: shard file format version "
                         f"{document.get('format_version')!r}; this radixcache reads version "
                         f"{SHARD_FORMAT_VERSION}")
    problem = _shape_problem(document)
    if problem is not None:
        raise MergeError(f"{path}: malformed shard file: {problem}")
    (index, count), sweep, rows = document["shard"], document["sweep"], document["rows"]
    points = sweep["points"]
    part = shard_slice(len(points), index, count)
    if len(rows) != len(part):
        raise MergeError(f"{path}: shard {index}/{count} of a sweep of {len(points)} points "
                         f"holds {len(part)} of them, but the file has {len(rows)} rows")
    fleet = len(points[0]) == 5
    keys = list(FLEET_JSON_KEYS if fleet else JSON_KEYS)
    names = _FLEET_POINT_KEYS if fleet else _POINT_KEYS
    for k, (row, point_index) in enumerate(zip(rows, part)):
        if list(row) != keys:
            missing = [key for key in keys if key not in row]
            raise MergeError(f"{path}: row {k} does not have the fields of a "
                             f"{'fleet ' if fleet else ''}row"
                             + (f" (missing {', '.join(missing)})" if missing else ""))
        named = [row[name] for name in names]
        if named != points[point_index]:
            raise MergeError(f"{path}: row {k} ({_point_text(names, named)}) is not the "
                             f"sweep's point {point_index} "
                             f"({_point_text(names, points[point_index])})")
    return Shard(path, index, count, sweep, rows)


def _point_text(names: tuple, values: list) -> str:
    return ", ".join(f"{name} {value!r}" for name, value in zip(names, values))


def _trace_text(trace: dict) -> str:
    text = f"{trace.get('name')} ({trace.get('requests', 0):,} requests"
    if "sha256" in trace:
        text += f", sha256 {str(trace['sha256'])[:12]}"
    return text + ")"


def _option_text(value: Any) -> str:
    return "its default" if value is None else str(value)


def _sweep_difference(a: Shard, b: Shard) -> str | None:
    """Why ``a`` and ``b`` are not shards of one sweep (None: they are)."""
    x, y = a.sweep, b.sweep
    if x["radixcache"] != y["radixcache"]:
        return (f"{a.path} was written by radixcache {x['radixcache']}, {b.path} by "
                f"{y['radixcache']}: run every shard with one version")
    for key in sorted(set(x["options"]) | set(y["options"])):
        mine, theirs = x["options"].get(key), y["options"].get(key)
        if mine != theirs:
            return (f"{a.path} and {b.path} are shards of different sweeps: "
                    f"--{key.replace('_', '-')} {_option_text(mine)} and "
                    f"{_option_text(theirs)}")

    def content(trace: dict) -> dict:  # the name is the file's, which may differ by machine
        return {key: value for key, value in trace.items() if key != "name"}

    # (After the options: --limit, --seed and --block-size change the trace too.)
    if content(x["trace"]) != content(y["trace"]):
        return (f"{a.path} and {b.path} are shards of sweeps over different traces: "
                f"{_trace_text(x['trace'])} and {_trace_text(y['trace'])}")
    if x["core"] != y["core"]:
        return (f"{a.path} ran the {x['core']!r} tree core, {b.path} the {y['core']!r}: give "
                "every shard the same --core")
    if x["points"] != y["points"]:
        first = next((k for k, (p, q) in enumerate(zip(x["points"], y["points"])) if p != q),
                     min(len(x["points"]), len(y["points"])))
        return (f"{a.path} and {b.path} are shards of different sweeps: their grids differ "
                f"({len(x['points'])} and {len(y['points'])} points, from point {first} on: "
                "give every shard the same --capacity, --policy, --host-capacity, "
                "--write-policy and --router)")
    return None


def merge_shards(shards: list[Shard]) -> tuple[dict, list[dict]]:
    """Check that ``shards`` are every shard of one sweep, once each; return the sweep's
    record and its rows in the sweep's order.

    Raises:
        MergeError: different sweeps or shard counts, a shard given twice, a shard missing.
    """
    first = shards[0]
    for shard in shards[1:]:
        if shard.count != first.count:
            raise MergeError(f"{first.path} is shard {first.index}/{first.count}, {shard.path} "
                             f"shard {shard.index}/{shard.count}: the shards of one sweep are "
                             "all I/N with the same N")
        difference = _sweep_difference(first, shard)
        if difference is not None:
            raise MergeError(difference)
    by_index: dict[int, Shard] = {}
    for shard in shards:
        if shard.index in by_index:
            raise MergeError(f"shard {shard.index}/{shard.count} given twice: "
                             f"{by_index[shard.index].path} and {shard.path}")
        by_index[shard.index] = shard
    missing = [index for index in range(first.count) if index not in by_index]
    if missing:
        listed = ", ".join(f"{index}/{first.count}" for index in missing[:10])
        if len(missing) > 10:
            listed += f" and {len(missing) - 10:,} more"
        raise MergeError(f"missing shard{'s' if len(missing) > 1 else ''} {listed}: merge "
                         f"needs every shard 0/{first.count} to "
                         f"{first.count - 1}/{first.count} of the sweep once")
    # The shards are contiguous slices in shard order: their rows, one after another.
    rows = [row for index in range(first.count) for row in by_index[index].rows]
    return first.sweep, rows


def run(args: argparse.Namespace) -> int:
    """``radixcache merge``: check the shards, write the merged rows (--json, else stdout)
    and the plot (--plot); nothing when a check fails."""
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    inputs = {os.path.realpath(path) for path in args.shards}
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and os.path.realpath(path) in inputs:
            raise UsageError(f"{option} {path}: that is one of the shard files")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 -- fail before reading the shards
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
        plot_format(args.plot)
    sweep, rows = merge_shards([read_shard(path) for path in args.shards])
    options, points = sweep["options"], sweep["points"]
    written = []
    try:
        if args.plot:
            write_sweep_plot(args.plot, rows, sweep["trace"]["name"], options["page_size"],
                             options["workers"], len({point[2] for point in points}) > 1)
            written.append(args.plot)
        if args.json:
            write_json(args.json, rows)
    except OSError as exc:
        for path in written:  # all or nothing
            os.unlink(path)
        print(f"radixcache: error: cannot write output: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    count = len(args.shards)
    print(f"merged {count} shard{'s' if count > 1 else ''} of {sweep['trace']['name']}: "
          f"{len(rows)} rows" + (f" in {args.json}" if args.json else ""), file=sys.stderr)
    return 0

"""The ``radixcache`` command: ``simulate`` replays a trace through the serving loop, ``merge``
joins the shards of a sweep (``simulate --shard``), ``bench`` times the tree cores side by side,
``trace`` downloads and lists the public Mooncake traces, ``serve`` runs the router index as
an HTTP service.

Exit codes: 0 success, 1 unreadable or malformed trace (or failed output, download, merge or
sweep worker), 2 bad arguments. Parsing imports neither torch nor the tree cores (``--help``,
``--version`` and argument errors answer at once); a run imports them when it starts.

One module per concern: ``args`` (the parser, sizes), ``output`` (tables, atomic writes,
progress), ``sweep`` (a sweep's points: ``--jobs``, executors, ``--shard``), ``plots``, and one
per subcommand: ``simulate``, ``merge``, ``bench``, ``trace``, ``serve``.
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING, Sequence

# Light modules only: torch, numpy and the cores are imported inside the run functions.
from . import bench, merge, serve, simulate, trace
from .args import build_parser, usage_line
from .errors import ParseError, UsageError
from .args import parse_size as parse_size
from .simulate import FLEET_JSON_KEYS, JSON_KEYS
from .simulate import default_capacities as default_capacities
from .sweep import SweepError

if TYPE_CHECKING:
    from concurrent.futures import Executor

__all__ = ["main", "JSON_KEYS", "FLEET_JSON_KEYS"]


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
    import ctypes

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


def main(argv: Sequence[str] | None = None, *, executor: Executor | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``), as the ``radixcache`` command
    does: what it prints goes to ``sys.stdout`` and ``sys.stderr``.

    Args:
        argv: The arguments after ``radixcache``, such as ``["simulate", "trace.jsonl",
            "--capacity", "1M,4M", "--json", "rows.json"]``.
        executor: ``simulate`` only: run the sweep's points on this
            ``concurrent.futures.Executor`` (a process or thread pool, Dask's
            ``Client.get_executor()``, ...) instead of ``--jobs``; the rows are those of
            ``--jobs 1``, in the same order. A worker in another process reads the trace from
            its path (absolute, as given here), once per process: the path must be reachable
            from every worker. The executor stays open.

    Returns:
        The exit code (0 success; 1 an unreadable or malformed trace, a failed output,
            download or merge, or a worker that failed; 2 bad arguments).

    Raises:
        ValueError: ``executor`` for another command than ``simulate``.
    """
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # reported by the (sub)command they were given to
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except ParseError as exc:  # one line, then the usage line of the command it concerns
        print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        print(usage_line(exc.parser), file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse exits 0 after --help and --version
        return exc.code if isinstance(exc.code, int) else 2
    if executor is not None and args.command != "simulate":
        raise ValueError(f"main: executor runs the points of 'simulate', not of "
                         f"{args.command!r}")
    args.executor = executor
    try:
        if args.command == "simulate":
            return simulate.run(args)
        if args.command == "merge":
            return merge.run(args)
        if args.command == "trace":
            return trace.run(args)
        if args.command == "serve":
            return serve.run(args)
        return bench.run(args)
    except UsageError as exc:
        print(f"{args.parser.prog}: error: {exc}", file=sys.stderr)
        print(usage_line(args.parser), file=sys.stderr)
        return 2
    except SweepError as exc:
        print(f"radixcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("radixcache: interrupted", file=sys.stderr)
        return 130

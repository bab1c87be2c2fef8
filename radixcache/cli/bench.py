"""``radixcache bench``: time every available tree core side by side on the embedded chat
workload and on insert/exists exercises over a shallow and a deep tree. The caches' index
arrays are torch tensors where torch is installed, else numpy arrays (the first line says
which)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import TYPE_CHECKING, Callable

from .output import format_table

if TYPE_CHECKING:
    from ..cache import RadixCache
    from ..workloads import Request, ServeResult


def _bench_chat(core: str, requests: list[Request], capacity: int, repeat: int,
                array_type: str) -> tuple[float, ServeResult]:
    from ..cache import RadixCache
    from ..workloads import serve

    best = math.inf
    result = None
    for _ in range(repeat):
        result = serve(RadixCache(eviction_policy="lru", core=core, array_type=array_type),
                       requests, capacity)
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


def _exercise_on_cache(core: str, ops: list[tuple[str, list[int]]],
                       array_type: str) -> tuple[RadixCache, int]:
    from ..cache import RadixCache

    cache = RadixCache(core=core, array_type=array_type)
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


def run(args: argparse.Namespace) -> int:
    """``radixcache bench``: time every tree core side by side and print the tables."""
    from .. import _core
    from .._torch import torch_installed
    from ..cache import RadixCache
    from ..workloads import (INPUT_TYPES, deep_exercise_ops, exercise_ops,
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
    # torch tensors, the library's default, where torch is installed; else numpy arrays.
    array_type = "torch" if torch_installed() else "numpy"
    input_types = [t for t in INPUT_TYPES if array_type == "torch" or t != "tensor"]
    print(f"radixcache bench: best of {repeat} run(s); cores: {', '.join(cores)}; "
          f"index arrays: {array_type}"
          + ("" if array_type == "torch" else " (torch is not installed)"))

    table = []
    chat_seconds: dict[str, float] = {}
    ops_seconds: dict[tuple[str, str], float] = {}
    answers: dict[str, tuple] = {}
    trees: dict[tuple[str, str], RadixCache] = {}
    for core in cores:
        seconds, result = _bench_chat(core, requests, capacity, repeat, array_type)
        chat_seconds[core] = seconds
        table.append([chat_label, core, f"{seconds:.4f}",
                      f"{len(requests) / seconds:,.0f} req/s" if seconds > 0 else "-"])
        found_all = []
        for shape, ops in shapes.items():
            label = f"exercise ({shape}): {len(ops):,} insert/exists calls"
            found_seconds, (cache, found) = _run_exercise(
                lambda ops=ops, core=core: _exercise_on_cache(core, ops, array_type), repeat)
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
    print(format_table(["workload", "core", "seconds", "throughput"], table, left=(0, 1)))

    print("\nin-cache calls per request, every prompt cached (µs): match_prefix + insert, "
          "the core's bare walk over the same tokens, and the rest")
    rows = []
    for page_size in (1, 16):
        for input_type in input_types:
            for core in cores:
                timing = time_cached_calls(RadixCache(page_size=page_size, core=core,
                                                      array_type=array_type),
                                           requests, input_type, passes=max(3, repeat))
                us = timing.per_request_us
                rows.append([str(page_size), input_type, core, f"{us(timing.call_seconds):.2f}",
                             f"{us(timing.walk_seconds):.2f}", f"{us(timing.rest_seconds):.2f}",
                             f"{timing.rest_share:.0%}"])
    print(format_table(["page", "tokens as", "core", "calls", "walk", "rest", "rest share"],
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
    print(format_table(["tree", "core", "nodes", "average depth", "ns per node"], rows,
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

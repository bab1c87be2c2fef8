"""Run the benchmark workloads with time.perf_counter (best of N) and print Markdown tables.

    python benchmarks/scripts/report.py [--quick] [--repeat N]
                                [--cases serve,incache,trace,exercise,reading,walk,match,evict]
                                [--trace-limit N] [--json PATH]

Same workloads as the pytest-benchmark files (``benchmarks/_cases.py``), every core of this
build side by side ("python" always, "c" once compiled), then a table of the ratios against
the project's speed goals (compiled against pure core). Times are the best of N runs; rounds of
different cores are interleaved so that load from other processes hits them alike.
docs/performance.md is made from this output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import _cases as cases

CASE_NAMES = ("serve", "incache", "trace", "exercise", "reading", "walk", "match", "evict")
clock = time.perf_counter


# -- timing helpers ----------------------------------------------------------------------------
def best_of(repeat: int, run: Callable[[], Any], setup: Callable[[], Any] | None = None) -> float:
    """Best wall time of ``run(*setup())`` over ``repeat`` runs; setup is untimed."""
    best = float("inf")
    for _ in range(repeat):
        args = setup() if setup is not None else ()
        start = clock()
        run(*args)
        best = min(best, clock() - start)
    return best


def per_call(repeat: int, call: Callable[[], Any], min_time: float = 0.05) -> float:
    """Best time of one short call: ``repeat`` batches of enough loops to last ``min_time``."""
    loops = 1
    while True:
        start = clock()
        for _ in range(loops):
            call()
        if clock() - start >= min_time:
            break
        loops *= 2
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        for _ in range(loops):
            call()
        best = min(best, (clock() - start) / loops)
    return best


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.0f} ns"


def fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def progress(msg: str) -> None:
    print(f"[report] {msg}", file=sys.stderr, flush=True)


# -- the cases ---------------------------------------------------------------------------------
def run_serving(requests: list, capacity: int, cores: list[str], repeat: int,
                label: str) -> dict:
    """{page_size: {core: {"whole": s, "cache": s, "hit_rate": .., "evicted": ..}}}."""
    from radixcache import RadixCache
    from radixcache.workloads import serve

    out: dict = {}
    for page_size in cases.SERVE_PAGE_SIZES:
        per_core = {core: {"whole": float("inf"), "cache": float("inf")} for core in cores}
        for rep in range(repeat):
            for core in cores:  # interleaved: background load hits both cores alike
                progress(f"{label}: page_size={page_size} core={core} run {rep + 1}/{repeat}")
                cache = RadixCache(page_size=page_size, core=core)
                start = clock()
                result = serve(cache, requests, capacity)
                whole = clock() - start
                entry = per_core[core]
                entry["whole"] = min(entry["whole"], whole)
                entry["cache"] = min(entry["cache"], result.seconds)
                entry.update(hit_rate=result.hit_rate, evicted=result.evicted_tokens,
                             rejected=result.rejected, requests=result.requests)
                del cache
                gc.collect()
        out[page_size] = per_core
    return out


def run_in_cache(sizes: cases.Sizes, cores: list[str], repeat: int) -> dict:
    """{page_size: {input_type: {core: InCacheTiming}}}; cores interleaved per row."""
    requests = cases.synthetic_chat(num_conversations=sizes.incache_conversations,
                                    num_system_prompts=sizes.chat_system_prompts, seed=0)
    out: dict = {}
    for page_size in cases.SERVE_PAGE_SIZES:
        for input_type in cases.INPUT_TYPES:
            for core in cores:
                progress(f"in-cache calls: page_size={page_size} {input_type} core={core}")
                timing = cases.in_cache_timing(core, page_size, input_type, requests, repeat)
                out.setdefault(page_size, {}).setdefault(input_type, {})[core] = timing
                gc.collect()
    return out


def run_walk(sizes: cases.Sizes, cores: list[str]) -> dict:
    """{shape: {core: (s per node visited, average depth, nodes)}} for the exercise trees."""
    out: dict = {}
    for shape in cases.EXERCISE_SHAPES:
        ops = cases.exercise_ops_of(shape, sizes.exercise_ops)
        for core in cores:
            progress(f"walk cost: {shape} tree, core={core}")
            out.setdefault(shape, {})[core] = cases.exercise_walk_cost(ops, core)
        del ops
        gc.collect()
    return out


def run_exercise(sizes: cases.Sizes, cores: list[str], repeat: int,
                 shape: str = "shallow") -> dict:
    """{contender: {"time": s, "mem": MemoryUse}} for set, cache:<core>, tree:<core>."""
    ops = cases.exercise_ops_of(shape, sizes.exercise_ops)
    contenders = [("set", None)] + [(kind, core) for kind in ("cache", "tree") for core in cores]
    names = ["set" if kind == "set" else f"{kind}:{core}" for kind, core in contenders]
    out: dict = {name: {"time": float("inf")} for name in names}
    for rep in range(repeat):
        for name, (kind, core) in zip(names, contenders):
            progress(f"exercise ({shape}): {name} run {rep + 1}/{repeat}")
            run = cases.exercise_runner(kind, core)
            gc.collect()
            start = clock()
            built = run(ops)
            out[name]["time"] = min(out[name]["time"], clock() - start)
            del built
    for name, (kind, core) in zip(names, contenders):
        progress(f"exercise ({shape}): memory of {name}")
        run = cases.exercise_runner(kind, core)
        out[name]["mem"] = cases.measure_memory(lambda run=run: run(ops))
        if kind == "cache":
            out[name]["nodes"] = run(ops).node_count()
    return out


def run_reading(sizes: cases.Sizes, cores: list[str], repeat: int) -> dict:
    """{name: best seconds} on the deep exercise with ids up to 2^40: set of tuples, the
    tuple() loop, and per core the bare core and RadixCache on lists and on array('q')."""
    ops = cases.exercise_ops_of("deep-big-ids", sizes.exercise_ops)
    inputs = {"lists": ops, "arrays": cases.ops_as_arrays(ops)}
    inputs["pairs"] = [(op, tokens, arr) for (op, tokens), (_, arr)
                       in zip(inputs["lists"], inputs["arrays"])]
    runs = [("set", cases.run_exercise_set, "lists"),
            ("tuple-loop", cases.run_tuple_loop, "lists")]
    for core in cores:
        runs.append((f"touched:{core}", lambda pairs, core=core:
                     cases.run_exercise_tree_touched(pairs, core), "pairs"))
        for kind in ("tree", "cache"):
            for tokens in ("lists", "arrays"):
                runs.append((f"{kind}:{core}:{tokens}", cases.exercise_runner(kind, core),
                             tokens))
    out = {name: float("inf") for name, _, _ in runs}
    for rep in range(repeat):
        for name, run, tokens in runs:  # interleaved: background load hits all alike
            progress(f"reading (deep, ids to 2^40): {name} run {rep + 1}/{repeat}")
            gc.collect()
            start = clock()
            built = run(inputs[tokens])
            out[name] = min(out[name], clock() - start)
            del built
    return out


def run_evict_callbacks(sizes: cases.Sizes, cores: list[str], rounds: int) -> dict:
    """{core: {callback: s per evicted node (best round)}} in a cache of the second-largest
    eviction size, rounds of the three callback kinds interleaved."""
    num_leaves = sizes.eviction_leaves[-2]
    out: dict = {core: {} for core in cores}
    for core in cores:
        progress(f"evict callbacks: building {num_leaves} leaves on core={core}")
        scenario = cases.EvictionScenario(core, num_leaves, sizes.eviction_nodes)
        best = {callback: float("inf") for callback in scenario.CALLBACKS}
        for callback in scenario.CALLBACKS:
            scenario.timed_round(clock, callback)  # warm-up
        for _ in range(rounds):
            for callback in scenario.CALLBACKS:
                elapsed, nodes = scenario.timed_round(clock, callback)
                if nodes:
                    best[callback] = min(best[callback], elapsed / nodes)
        out[core] = best
        del scenario
        gc.collect()
    return out


def run_match(sizes: cases.Sizes, cores: list[str], repeat: int) -> dict:
    out: dict = {}
    for core in cores:
        progress(f"match: core={core}")
        lp = cases.long_prompt(core, sizes.match_tokens)
        out.setdefault("array_equal", per_call(repeat, lp.array_equal))
        out[f"match_prefix:{core}"] = per_call(repeat, lp.match)
        out[f"tree_walk:{core}"] = per_call(repeat, lp.tree_match)
    return out


def run_eviction(sizes: cases.Sizes, cores: list[str], rounds: int) -> dict:
    """{core: {leaves: ns per evicted node (best round)}}."""
    out: dict = {core: {} for core in cores}
    for num_leaves in sizes.eviction_leaves:
        for core in cores:
            progress(f"evict: building {num_leaves} leaves on core={core}")
            scenario = cases.EvictionScenario(core, num_leaves, sizes.eviction_nodes)
            scenario.timed_round(clock)  # warm-up round
            best = float("inf")
            for _ in range(rounds):
                elapsed, nodes = scenario.timed_round(clock)
                if nodes:
                    best = min(best, elapsed / nodes)
            out[core][num_leaves] = best
            del scenario
            gc.collect()
    return out


# -- the report --------------------------------------------------------------------------------
class Targets:
    """Rows of the target table: what, measured ratio, goal, met?"""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def add(self, what: str, value: float | None, goal: str,
            met: Callable[[float], bool] | None,
            missing: str = "n/a (compiled core not built)", unit: str = "x") -> None:
        """``met`` None: an informative row without a target. ``unit``: "x" (a ratio, two
        decimals), "%" or "ns" (whole numbers)."""
        if value is None:
            self.rows.append([what, "-", goal, missing if met is not None else "-"])
            return
        space = " " if unit == "ns" else ""
        shown = f"{value:.2f}x" if unit == "x" else f"{value:.0f}{space}{unit}"
        if met is None:
            self.rows.append([what, shown, goal, "-"])
        else:
            self.rows.append([what, shown, goal, "yes" if met(value) else "**no**"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and best of 2: a smoke run of a minute or so")
    parser.add_argument("--repeat", type=int, default=None,
                        help="best of N for every case (default: 5 chat, 2 trace, 3 exercise, "
                             "7 match batches, 10 eviction rounds; 2 with --quick)")
    parser.add_argument("--cases", default=",".join(CASE_NAMES),
                        help=f"comma-separated subset of {','.join(CASE_NAMES)}")
    parser.add_argument("--trace-limit", type=int, default=None,
                        help="replay the first N trace requests (0: all; default 2000, "
                             "200 with --quick)")
    parser.add_argument("--json", type=Path, default=None, help="also write raw numbers here")
    parser.add_argument("--cores", default=None,
                        help="comma-separated subset of the built cores (default: all; the "
                             "cases that compare cores need both)")
    parser.add_argument("--timer", choices=("perf_counter", "process_time"),
                        default="perf_counter",
                        help="clock for this script's timings; process_time (CPU time) is "
                             "steadier on a loaded machine. serve()'s cache-call seconds "
                             "always use perf_counter")
    args = parser.parse_args(argv)
    global clock
    clock = getattr(time, args.timer)

    sizes = cases.QUICK if args.quick else cases.FULL
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(wanted) - set(CASE_NAMES)
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")

    def reps(default: int) -> int:
        if args.repeat is not None:
            return max(1, args.repeat)
        return 2 if args.quick else default

    trace_limit = sizes.trace_limit if args.trace_limit is None else (args.trace_limit or None)
    cores = cases.core_names()
    if args.cores is not None:
        chosen = [c.strip() for c in args.cores.split(",") if c.strip()]
        unknown = set(chosen) - set(cores)
        if unknown:
            parser.error(f"unknown or unbuilt core(s): {', '.join(sorted(unknown))}")
        cores = chosen
    compiled = "c" in cores
    raw: dict = {"cores": cores, "sizes": sizes.__dict__, "quick": args.quick}
    out: list[str] = []
    targets = Targets()
    started = time.perf_counter()

    out.append("## Benchmark results\n")
    out.append(
        f"`python benchmarks/scripts/report.py{' --quick' if args.quick else ''}` on "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}; "
        f"cores: {', '.join(cores)}"
        + ("" if compiled else " (compiled core not built: pure Python only)")
        + f"; timer time.{args.timer}; load average at start {os.getloadavg()[0]:.1f}.\n"
    )

    if "serve" in wanted:
        requests = cases.chat_requests(sizes)
        res = run_serving(requests, sizes.chat_capacity, cores, reps(5), "chat")
        raw["serve"] = res
        out.append(f"### 1. Serving loop: synthetic chat\n\n{len(requests)} requests "
                   f"({sizes.chat_conversations} conversations over "
                   f"{sizes.chat_system_prompts} system prompts of 800-2000 tokens), KV pool "
                   f"of {sizes.chat_capacity} tokens. *cache calls* = time inside cache calls "
                   "only (`ServeResult.seconds`, always wall time); *whole* = the whole "
                   f"`serve()` call (time.{args.timer}).\n")
        out.append(_serving_table(res, cores))
        for page_size, per_core in res.items():
            if compiled:
                speedup = ratio(per_core["python"]["cache"], per_core["c"]["cache"])
            else:
                speedup = None
            targets.add(f"serving loop (chat, page_size={page_size}): c vs python, cache calls",
                        speedup, ">= 10x", lambda v: v >= 10)

    if "incache" in wanted:
        res = run_in_cache(sizes, cores, reps(3))
        raw["incache"] = {ps: {t: {core: {"match": v.match_seconds, "insert": v.insert_seconds,
                                           "walk": v.walk_seconds, "requests": v.requests}
                                    for core, v in per_core.items()}
                               for t, per_core in per_type.items()}
                          for ps, per_type in res.items()}
        rows = []
        for page_size, per_type in res.items():
            for input_type, per_core in per_type.items():
                for core, v in per_core.items():
                    us = v.per_request_us
                    rows.append([str(page_size), input_type, core,
                                 f"{us(v.match_seconds):.2f}", f"{us(v.insert_seconds):.2f}",
                                 f"{us(v.call_seconds):.2f}", f"{us(v.walk_seconds):.2f}",
                                 f"{us(v.rest_seconds):.2f}", f"{v.rest_share:.0%}"])
                if compiled:
                    share = per_core["c"].rest_share
                    targets.add(f"in-cache calls, page {page_size}, {input_type}: share that "
                                "is not tree walk (c)", share * 100, "<= 20%",
                                lambda v: v <= 20, unit="%")
        first = next(iter(next(iter(res.values())).values()))
        nreq = next(iter(first.values())).requests
        out.append(f"### 1b. In-cache calls per input type\n\n{nreq} chat requests "
                   "(about 2,000 prompt tokens each), every prompt already cached (two "
                   "untimed passes first). Per request, µs inside `match_prefix(prompt)` + "
                   "`insert(prompt + output, kv)` (kv: a CPU int64 tensor), and in the same "
                   "run the core's bare read-only walk (`walk`) over the same prompt and "
                   "sequence as int64 arrays; *rest* = calls − walk (conversion, checks, "
                   "bookkeeping, the returned tensor). Best of "
                   f"{reps(3)} passes, GC off while timing.\n")
        out.append(table(["page", "tokens as", "core", "match µs", "insert µs", "calls µs",
                          "walk µs", "rest µs", "rest share"], rows) + "\n")

    if "trace" in wanted:
        if not cases.TRACE_PATH.is_file():
            out.append(f"### 2. Trace replay\n\nskipped: {cases.TRACE_PATH} not found.\n")
        else:
            requests = cases.trace_requests(trace_limit)
            res = run_serving(requests, sizes.trace_capacity, cores, reps(2), "trace")
            raw["trace"] = res
            which = "all" if trace_limit is None else f"the first {len(requests)}"
            out.append(f"### 2. Trace replay: {cases.TRACE_PATH.name}\n\n{which} requests "
                       f"(each hash id = 512 tokens), KV pool of {sizes.trace_capacity} "
                       "tokens; columns as above.\n")
            out.append(_serving_table(res, cores))
            for page_size, per_core in res.items():
                speedup = (ratio(per_core["python"]["cache"], per_core["c"]["cache"])
                           if compiled else None)
                targets.add(f"trace replay (page_size={page_size}): c vs python, cache calls",
                            speedup, "(none)", None)

    if "exercise" in wanted:
        raw["exercise"] = {}
        for shape in cases.EXERCISE_SHAPES:
            res = run_exercise(sizes, cores, reps(3), shape)
            raw["exercise"][shape] = {k: {"time": v["time"], "nodes": v.get("nodes"),
                                          **v["mem"].__dict__} for k, v in res.items()}
            rows = []
            set_time = res["set"]["time"]
            set_mem = res["set"]["mem"].current
            for name, entry in res.items():
                mem = entry["mem"]
                nodes = entry.get("nodes")
                rows.append([_contender_label(name), fmt_time(entry["time"]),
                             fmt_ratio(ratio(set_time, entry["time"])), fmt_bytes(mem.current),
                             fmt_bytes(mem.peak), fmt_ratio(ratio(mem.current, set_mem)),
                             f"{mem.current / nodes:.0f}" if nodes else "-"])
            out.append(f"### 3. Exercise, {shape} tree: {sizes.exercise_ops} insert/exists "
                       "calls from lists\n\n" + EXERCISE_TEXT[shape])
            out.append(table(["structure", "time", "speed vs set", "memory (tracemalloc)",
                              "peak", "memory vs set", "bytes per node"], rows) + "\n")
            c_time = res["cache:c"]["time"] if compiled else None
            py_time = res["cache:python"]["time"]
            goals = EXERCISE_GOALS[shape]
            targets.add(f"exercise ({shape}): c vs python (RadixCache)", ratio(py_time, c_time),
                        goals["python"], goals["python_met"])
            targets.add(f"exercise ({shape}): c vs python (bare core object, no cache layer)",
                        ratio(res["tree:python"]["time"],
                              res["tree:c"]["time"] if compiled else None), "(none)", None)
            targets.add(f"exercise ({shape}): c (RadixCache) vs set of tuples, speed",
                        ratio(set_time, c_time), goals["set"], goals["set_met"])
            targets.add(f"exercise ({shape}): c (RadixCache) memory / set memory (tracemalloc)",
                        ratio(res["cache:c"]["mem"].current, set_mem) if compiled else None,
                        "<= 0.20x", lambda v: v <= 0.2)
            del res
            gc.collect()

    if "reading" in wanted:
        res = run_reading(sizes, cores, reps(3))
        raw["reading"] = res
        floor = res["tuple-loop"]
        rows = [["`set` of tuples", fmt_time(res["set"]), "-"],
                ["`tuple()` of each call's list (the floor)", fmt_time(floor), "-"]]
        for core in cores:
            for kind, label in (("tree", "bare core"), ("cache", "RadixCache")):
                lists, arrays = res[f"{kind}:{core}:lists"], res[f"{kind}:{core}:arrays"]
                rows.append([f"{label}, core={core}: lists / `array('q')`",
                             f"{fmt_time(lists)} / {fmt_time(arrays)}",
                             f"{fmt_time(lists - arrays)} "
                             f"({fmt_ratio(ratio(lists - arrays, floor))})"])
            touched = res[f"touched:{core}"] - res[f"tree:{core}:arrays"]
            rows.append([f"bare core, core={core}: `array('q')` + `tuple()` of the list first",
                         fmt_time(res[f"touched:{core}"]),
                         f"{fmt_time(touched)} ({fmt_ratio(ratio(touched, floor))}): the "
                         "floor in context"])
        out.append(f"### 3c. Reading token lists: deep exercise, ids up to 2^40\n\n"
                   f"{sizes.exercise_ops} insert/exists calls of the deep exercise with ids up "
                   "to 2^40, on lists and on the same calls as `array('q')`; reading cost = "
                   "lists - arrays, against a `tuple()` of every call's list (touching each int "
                   "once), alone and in context (before each call on the arrays: the tree and "
                   f"the ints then compete for the caches). Best of {reps(3)} interleaved "
                   "rounds.\n")
        out.append(table(["contender", "time", "reading cost (vs tuple loop)"], rows) + "\n")
        if compiled:
            lists, arrays = res["tree:c:lists"], res["tree:c:arrays"]
            targets.add("deep exercise, ids to 2^40: c reading cost of lists / tuple() loop",
                        ratio(lists - arrays, floor), "<= 1.2x", lambda v: v <= 1.2)
            targets.add("deep exercise, ids to 2^40: c reading cost of lists / tuple() in "
                        "context", ratio(lists - arrays, res["touched:c"] - arrays), "(none)",
                        None)
            targets.add("deep exercise, ids to 2^40, lists: c (RadixCache) vs set of tuples",
                        ratio(res["set"], res["cache:c:lists"]), ">= 1x", lambda v: v >= 1)

    if "walk" in wanted:
        res = run_walk(sizes, cores)
        raw["walk"] = res
        rows = []
        for shape, per_core in res.items():
            for core, (per_node, depth, nodes) in per_core.items():
                rows.append([shape, core, f"{nodes:,}", f"{depth:.1f}",
                             f"{per_node * 1e9:.1f}"])
        out.append("### 3b. Walk cost per node visited\n\nThe tree an exercise run builds; "
                   "`exists` of up to 2,000 inserted sequences (int64 arrays: no conversion "
                   "timed), time divided by the nodes visited (each query's terminal depth). "
                   "Includes the per-call cost and the token comparisons: an upper bound on "
                   "one walk step.\n")
        out.append(table(["tree", "core", "nodes", "average depth", "ns per node visited"],
                         rows) + "\n")
        for shape in ("deep", "deep-big-ids"):
            if shape in res:
                per_node = res[shape].get("c", (None,))[0]
                targets.add(f"walk cost per node visited, {shape} tree (c)",
                            None if per_node is None else per_node * 1e9, "<= 30 ns",
                            lambda v: v <= 30, unit="ns")

    if "match" in wanted:
        res = run_match(sizes, cores, reps(7))
        raw["match"] = res
        base = res["array_equal"]
        rows = [["`numpy.array_equal` (same arrays)", fmt_time(base), "1.00x"]]
        for core in cores:
            for kind, label in (("match_prefix", "`RadixCache.match_prefix`"),
                                ("tree_walk", "core walk `Core.walk`")):
                t = res[f"{kind}:{core}"]
                rows.append([f"{label}, core={core}", fmt_time(t), fmt_ratio(ratio(t, base))])
        out.append(f"### 4. Match of one cached prompt of {sizes.match_tokens} tokens\n\n"
                   "Query: a fresh numpy int64 copy of the cached prompt. `match_prefix` "
                   "includes building the returned index tensor; the core walk does not.\n")
        out.append(table(["call", "time per call", "vs array_equal"], rows) + "\n")
        targets.add("long-prompt match: c `match_prefix` / `numpy.array_equal`",
                    ratio(res.get("match_prefix:c"), base), "<= 3x", lambda v: v <= 3)
        targets.add("long-prompt match: c core walk / `numpy.array_equal`",
                    ratio(res.get("tree_walk:c"), base), "(none)", None)

    if "evict" in wanted:
        res = run_eviction(sizes, cores, reps(10))
        raw["evict"] = res
        leaves = list(sizes.eviction_leaves)
        rows = [[f"{n:,}"] + [fmt_time(res[core][n]) for core in cores] for n in leaves]
        rows.append([f"{leaves[-1]:,} / {leaves[0]:,}"]
                    + [fmt_ratio(ratio(res[core][leaves[-1]], res[core][leaves[0]]))
                       for core in cores])
        out.append(f"### 5. Eviction: time per evicted node\n\nCaches of distinct random "
                   f"8-token sequences; each timed round is one `evict` call freeing about "
                   f"{sizes.eviction_nodes} leaves (LRU), refilled untimed between rounds.\n")
        out.append(table(["leaves in cache"] + [f"{core} per node" for core in cores], rows)
                   + "\n")
        for core in cores:
            targets.add(f"eviction per node, {leaves[-1]:,} vs {leaves[0]:,} leaves, "
                        f"core={core}", ratio(res[core][leaves[-1]], res[core][leaves[0]]),
                        "<= 2x", lambda v: v <= 2)
        res = run_evict_callbacks(sizes, cores, reps(10))
        raw["evict_callbacks"] = res
        callbacks = cases.EvictionScenario.CALLBACKS
        rows = [[core] + [fmt_time(res[core][cb]) for cb in callbacks] for core in cores]
        out.append(f"Per evicted node by free callback, {sizes.eviction_leaves[-2]:,} leaves: "
                   "none, a no-op callback per node (each node's index tensor made and handed "
                   "over), a no-op batched callback (`batch=True`). Rounds interleaved.\n")
        out.append(table(["core", "no callback", "per-node callback", "batched callback"],
                         rows) + "\n")
        if compiled:
            targets.add("evict per node, no-op per-node callback (c)",
                        res["c"]["per-node"] * 1e9, "<= 1500 ns", lambda v: v <= 1500,
                        unit="ns")

    out.append("### Targets\n")
    out.append(table(["ratio", "measured", "target", "met"], targets.rows) + "\n")
    out.append(f"Total run time {time.perf_counter() - started:.0f} s (wall).")
    print("\n".join(out))
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=2, default=str))
    return 0


EXERCISE_TEXT = {
    "shallow": "Long shared prefixes (50 bases of 100-2000 tokens, tails of 1-20: terminal depth "
               "2). Memory of the built structure: tracemalloc current (what it keeps) and peak "
               "(while building). Both cores allocate through Python's allocators (bytes keys; "
               "the compiled core's child tables with PyMem_*), so tracemalloc sees them whole; "
               "no tensors are stored here. The set's tuples share the int objects of the input "
               "lists, so it is charged only 8 bytes per token plus the tuple and table "
               "overhead. Bytes per node = tracemalloc current / nodes.\n",
    "deep": "Prefixes of random length (100-2000 tokens) of 200 shared bases plus tails of "
            "1-20 (`workloads.deep_exercise_ops`): every insert cuts a base's chain somewhere "
            "new, so terminals sit about 100 nodes deep. Token ids below 64,000. Columns as "
            "above.\n",
    "deep-big-ids": "The deep tree with token ids up to 2^41 (two-digit Python ints, the "
                    "slow path of a naive int conversion). Columns as above.\n",
}

EXERCISE_GOALS = {
    "shallow": {"python": "(none)", "python_met": None,
                "set": ">= 4x", "set_met": lambda v: v >= 4},
    "deep": {"python": ">= 10x", "python_met": lambda v: v >= 10,
             "set": ">= 1x", "set_met": lambda v: v >= 1},
    "deep-big-ids": {"python": ">= 10x", "python_met": lambda v: v >= 10,
                     "set": ">= 1x", "set_met": lambda v: v >= 1},
}


def _contender_label(name: str) -> str:
    if name == "set":
        return "`set` of tuples"
    kind, core = name.split(":")
    return f"RadixCache, core={core}" if kind == "cache" else f"bare core object, core={core}"


def _serving_table(res: dict, cores: list[str]) -> str:
    header = ["page size"]
    for core in cores:
        header += [f"{core}: cache calls", f"{core}: whole"]
    if "c" in cores and "python" in cores:
        header += ["c speedup (cache calls)", "c speedup (whole)"]
    header += ["hit rate", "evicted tokens"]
    rows = []
    for page_size, per_core in res.items():
        row = [str(page_size)]
        for core in cores:
            row += [fmt_time(per_core[core]["cache"]), fmt_time(per_core[core]["whole"])]
        if "c" in cores and "python" in cores:
            row += [fmt_ratio(ratio(per_core["python"]["cache"], per_core["c"]["cache"])),
                    fmt_ratio(ratio(per_core["python"]["whole"], per_core["c"]["whole"]))]
        first = per_core[cores[0]]
        outcomes = {(e["hit_rate"], e["evicted"], e["rejected"]) for e in per_core.values()}
        # Both cores implement one interface: the same requests must give the same outcome.
        same = "" if len(outcomes) == 1 else " (**cores differ!**)"
        row += [f"{first['hit_rate']:.3f}{same}", f"{first['evicted']:,}"]
        rows.append(row)
    return table(header, rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Case 3: the exercise -- 10^5 insert / exists calls from Python lists, long shared prefixes.

One group: a plain ``set`` of token tuples (the yardstick), ``RadixCache`` per core (public
API) and the bare core object per core (``Core.insert``/``Core.exists``, no cache layer).
Each round starts from an empty structure. Memory of the built structure (tracemalloc current
and peak; both cores allocate through Python's allocators -- bytes keys, the compiled core's
child tables with PyMem_* -- so tracemalloc sees them whole) is measured once per row,
untimed, and shown in the end-of-run summary and in ``extra_info``.

A second group, the deep exercise with token ids up to 2^40, times what reading the lists
costs: each core (bare and behind ``RadixCache``) on the lists and on the same calls as
``array('q')``, beside a ``tuple()`` of every call's list (the floor of touching each int
once) and the set of tuples. Reading cost = lists - arrays; its ratio to the ``tuple()`` loop
is in the summary.
"""

from __future__ import annotations

import pytest

from _cases import (FULL, benchmark_min_seconds, core_of, exercise_ops, exercise_ops_of,
                    exercise_runner, measure_memory, ops_as_arrays, run_exercise_set,
                    run_tuple_loop)

NUM_OPS = FULL.exercise_ops
ROUNDS = 3
GROUP = f"exercise: {NUM_OPS} insert/exists calls from lists"


@pytest.fixture(scope="module")
def ops():
    return exercise_ops(NUM_OPS)


@pytest.fixture(scope="module")
def distinct_inserted(ops):
    return len({tuple(tokens) for op, tokens in ops if op == "insert"})


def _terminal_count(tree) -> int:
    return sum(1 for node, _depth in tree.iter_nodes() if node.terminal)


def _record_memory(benchmark, note, build) -> None:
    mem = measure_memory(build)
    benchmark.extra_info.update(tracemalloc_current_bytes=mem.current,
                                tracemalloc_peak_bytes=mem.peak)
    note(f"memory of the built structure: tracemalloc current {mem.current / 2**20:.1f} MiB, "
         f"peak {mem.peak / 2**20:.1f} MiB")


def test_exercise_set_of_tuples(benchmark, note, ops, distinct_inserted):
    benchmark.group = GROUP
    run = exercise_runner("set", None)
    seen = benchmark.pedantic(run, args=(ops,), rounds=ROUNDS, iterations=1)
    assert len(seen) == distinct_inserted
    _record_memory(benchmark, note, lambda: run(ops))


def test_exercise_radixcache(benchmark, note, core, ops, distinct_inserted):
    benchmark.group = GROUP
    run = exercise_runner("cache", core)
    cache = benchmark.pedantic(run, args=(ops,), rounds=ROUNDS, iterations=1)
    assert _terminal_count(core_of(cache).tree) == distinct_inserted
    _record_memory(benchmark, note, lambda: run(ops))


def test_exercise_tree_core(benchmark, note, core, ops, distinct_inserted):
    benchmark.group = GROUP
    run = exercise_runner("tree", core)
    bare = benchmark.pedantic(run, args=(ops,), rounds=ROUNDS, iterations=1)
    assert _terminal_count(bare.tree) == distinct_inserted
    _record_memory(benchmark, note, lambda: run(ops))


DEEP_GROUP = f"exercise: {NUM_OPS} insert/exists calls, deep tree, ids up to 2^40"
_DEEP_BEST: dict = {}


@pytest.fixture(scope="module")
def deep_big_ops():
    ops = exercise_ops_of("deep-big-ids", NUM_OPS)
    return {"lists": ops, "arrays": ops_as_arrays(ops)}


def _deep_note(note, name: str, benchmark) -> None:
    best = benchmark_min_seconds(benchmark)
    if best is None:
        return
    _DEEP_BEST[name] = best
    got = _DEEP_BEST
    for core in ("python", "c"):
        lists, arrays = got.get(f"tree:{core}:lists"), got.get(f"tree:{core}:arrays")
        floor = got.get("tuple-loop")
        if name.startswith(f"tree:{core}") and None not in (lists, arrays, floor):
            note(f"core={core}: reading the lists costs {(lists - arrays) * 1e3:.0f} ms, "
                 f"{(lists - arrays) / floor:.2f}x the tuple() loop ({floor * 1e3:.0f} ms)")
        cache_lists, the_set = got.get(f"cache:{core}:lists"), got.get("set")
        if name.startswith(f"cache:{core}") and None not in (cache_lists, the_set):
            note(f"core={core}: RadixCache on lists is {the_set / cache_lists:.2f}x the speed "
                 "of the set of tuples")


@pytest.mark.parametrize("contender", ["set", "tuple-loop"])
def test_deep_big_ids_yardsticks(benchmark, note, deep_big_ops, contender):
    benchmark.group = DEEP_GROUP
    run = run_exercise_set if contender == "set" else run_tuple_loop
    benchmark.pedantic(run, args=(deep_big_ops["lists"],), rounds=ROUNDS, iterations=1)
    _deep_note(note, contender, benchmark)


@pytest.mark.parametrize("tokens", ["lists", "arrays"])
@pytest.mark.parametrize("kind", ["tree", "cache"])
def test_deep_big_ids(benchmark, note, core, deep_big_ops, kind, tokens):
    benchmark.group = DEEP_GROUP
    run = exercise_runner(kind, core)
    benchmark.pedantic(run, args=(deep_big_ops[tokens],), rounds=ROUNDS, iterations=1)
    _deep_note(note, f"{kind}:{core}:{tokens}", benchmark)

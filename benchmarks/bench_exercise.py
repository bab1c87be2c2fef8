"""Case 3: the exercise -- 10^5 insert / exists calls from Python lists, long shared prefixes.

One group: a plain ``set`` of token tuples (the yardstick), ``RadixCache`` per core (public
API) and the bare core object per core (``Core.insert``/``Core.exists``, no cache layer).
Each round starts from an empty structure. Memory of the built structure (tracemalloc current
and peak; both cores allocate through Python's allocators -- bytes keys, the compiled core's
child tables with PyMem_* -- so tracemalloc sees them whole) is measured once per row,
untimed, and shown in the end-of-run summary and in ``extra_info``.
"""

from __future__ import annotations

import pytest

from _cases import FULL, exercise_ops, exercise_runner, measure_memory

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
    assert _terminal_count(cache._tree) == distinct_inserted
    _record_memory(benchmark, note, lambda: run(ops))


def test_exercise_tree_core(benchmark, note, core, ops, distinct_inserted):
    benchmark.group = GROUP
    run = exercise_runner("tree", core)
    bare = benchmark.pedantic(run, args=(ops,), rounds=ROUNDS, iterations=1)
    assert _terminal_count(bare.tree) == distinct_inserted
    _record_memory(benchmark, note, lambda: run(ops))

"""What the safety rules cost: the re-entrancy guard per call, GC visibility of nodes.

Run from the repository root: ``python benchmarks/scripts/safety_cost.py``. Prints ns per call for a
minimal call through each layer, the guard pattern alone, the exercise workload (10^5
insert/exists from lists: time and memory), and a full ``gc.collect()`` with a large tree
alive (nodes are tracked by the collector, so a full collection visits each one). Run it on
two checkouts (``PYTHONPATH=...``) to compare before/after.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cases import core_of, exercise_ops, run_exercise_cache

from radixcache import RadixCache
from radixcache._core import CORES


def per_call_ns(fn, calls: int = 200_000, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn(calls)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e9


def main() -> None:
    def bare(calls: int) -> None:
        for _ in range(calls):
            pass

    for core in sorted(CORES):
        guard = getattr(CORES[core], "Guard", threading.Lock)()
        if not hasattr(guard, "acquire"):
            guard = threading.Lock()
        enter, leave = guard.acquire, guard.release

        def guarded(calls: int, enter=enter, leave=leave) -> None:
            for _ in range(calls):
                if not enter(False):
                    raise RuntimeError
                try:
                    pass
                finally:
                    leave()

        print(f"[{core}] cache-level guard pattern alone: "
              f"{per_call_ns(guarded) - per_call_ns(bare):.0f} ns")
    for core in sorted(CORES):
        cache = RadixCache(core=core)
        cache.insert([1, 2, 3])
        core_object = core_of(cache)

        def cache_exists(calls: int, exists=cache.exists, tokens=[1, 2, 3]) -> None:  # noqa: B006 -- never mutated
            for _ in range(calls):
                exists(tokens)

        def core_exists(calls: int, exists=core_object.exists, tokens=(1, 2, 3)) -> None:
            for _ in range(calls):
                exists(tokens)

        print(f"[{core}] RadixCache.exists(3 tokens) {per_call_ns(cache_exists):.0f} ns, "
              f"Core.exists {per_call_ns(core_exists):.0f} ns")

    ops = exercise_ops(100_000)
    for core in sorted(CORES):
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            run_exercise_cache(ops, core)
            best = min(best, time.process_time() - start)
        tracemalloc.start()
        built = run_exercise_cache(ops, core)
        current, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"[{core}] exercise 10^5 ops: {best * 1e3:.0f} ms, "
              f"{current / 2**20:.2f} MiB for {built.node_count()} nodes")

    big = RadixCache(core="c" if "c" in CORES else "python")
    rng = np.random.default_rng(0)
    for _ in range(200_000):
        big.insert(rng.integers(0, 32_000, size=8))

    def collect_ms() -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            gc.collect()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    with_tree = collect_ms()
    nodes = big.node_count()
    del big
    without = collect_ms()
    print(f"full gc.collect(): {with_tree:.1f} ms with {nodes} nodes alive, {without:.1f} ms "
          f"without: {(with_tree - without) / nodes * 1e6:.0f} ns per node")


if __name__ == "__main__":
    main()

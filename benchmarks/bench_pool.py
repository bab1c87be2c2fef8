"""Case 9: ``KVPool.free`` -- giving slots back, the call every eviction callback makes.

One group per (input kind, ids per call): the pool's ``free`` with each core's one-pass push
(``put_slots``; the pools use the compiled one, the pure one is its reference), beside its
checked numpy path alone (what ``free`` does for the inputs the push declines, and without
the compiled core: a numpy range check, then a slice assignment) and the floor: copying the ids
into the free stack with no check (``numpy.copyto`` of the same ids into the same place).
Each timed round frees the same ids ``CALLS`` times (the stack top is put back between calls,
untimed work of one integer store). The end-of-run summary gives each contender's time per
call and its ratio to the numpy path.

Inputs: a CPU ``torch.int64`` tensor (what an ``evict`` callback gets from a torch cache) and
an int64 numpy array (from a cache with ``array_type="numpy"``, as the simulator runs); 16,
670 (a chat eviction's node) and 10^5 ids (a long prompt's node).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cases import benchmark_min_seconds
from radixcache._core import CORES
from radixcache.workloads import KVPool, pools

CAPACITY = 1_000_000  # not a power of two, as most pools
CALLS = 200
ROUNDS = 20
SIZES = (16, 670, 100_000)
CONTENDERS = ("numpy-path",) + tuple(f"free:{name}" for name in CORES) + ("copy-floor",)
_BEST: dict = {}


def _ids(kind: str, n: int):
    ids = np.random.default_rng(n).permutation(CAPACITY)[:n].astype(np.int64)
    return torch.from_numpy(ids) if kind == "tensor" else ids


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n}ids")
@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
@pytest.mark.parametrize("contender", CONTENDERS)
def test_pool_free(benchmark, note, monkeypatch, contender, kind, n):
    benchmark.group = f"KVPool.free: {CALLS} calls of {n} ids, {kind}"
    pool = KVPool(CAPACITY)
    pool.alloc(CAPACITY)  # all in use: each call frees n slots at the bottom of the stack
    slots = _ids(kind, n)
    if contender == "copy-floor":
        stack, ids = pool._free, slots.numpy() if kind == "tensor" else slots

        def run():
            for _ in range(CALLS):
                np.copyto(stack[:n], ids)
    else:
        put = None if contender == "numpy-path" else CORES[contender[5:]].put_slots
        monkeypatch.setattr(pools, "_put_slots", put)
        free = pool.free

        def run():
            for _ in range(CALLS):
                free(slots)
                pool._top = 0
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    if contender != "copy-floor":
        free(slots)
        assert pool.used == CAPACITY - n and sorted(pool.free_slots().tolist()) == sorted(
            slots.tolist())
    best = benchmark_min_seconds(benchmark)
    if best is None:
        return
    per_call = best / CALLS
    _BEST[(kind, n, contender)] = per_call
    base = _BEST.get((kind, n, "numpy-path"))
    ratio = f", {base / per_call:.2f}x the numpy path's speed" if base else ""
    note(f"{per_call * 1e9:.0f} ns per call, {per_call / n * 1e9:.2f} ns per id{ratio}")

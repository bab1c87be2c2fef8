"""Case 5: eviction at scale -- time per evicted node in caches of 10^3 .. 10^6 leaves.

Building the cache is setup (untimed, once per core and size). Each timed round is one
``evict`` call freeing about 200 leaves; an untimed setup before every round inserts as many
fresh sequences, so the cache size stays put. The table's time is per round (~200 nodes);
``extra_info`` holds the nodes evicted per round and the best time per node.

Groups are per size (python vs c). To see how one core scales with size instead, run with
``--benchmark-group-by=param:core``.

``test_evict_callbacks``: the same rounds in a cache of 10^5 leaves with no free callback, a
no-op callback per node (each node's index tensor is made and handed over) and a no-op
batched callback (``batch=True``: one tensor for the round): the cache's cost per evicted
node, the callback's own work excluded.
"""

from __future__ import annotations

import pytest

from _cases import FULL, EvictionScenario, benchmark_min_seconds

NODES_PER_ROUND = FULL.eviction_nodes
ROUNDS = 10


@pytest.mark.parametrize("num_leaves", FULL.eviction_leaves,
                         ids=[f"{n:.0e}".replace("+0", "") for n in FULL.eviction_leaves])
def test_evict_per_node(benchmark, note, core, num_leaves):
    scenario = EvictionScenario(core, num_leaves, NODES_PER_ROUND)
    benchmark.group = f"eviction: {NODES_PER_ROUND} nodes per round, cache of {num_leaves} leaves"
    benchmark.pedantic(scenario.evict_round, setup=scenario.prepare, rounds=ROUNDS,
                       iterations=1, warmup_rounds=1)
    scenario.finish()
    # Every round must actually have evicted: otherwise the timing measures nothing.
    assert min(scenario.evicted_per_round) >= NODES_PER_ROUND
    nodes = sum(scenario.evicted_per_round) / len(scenario.evicted_per_round)
    benchmark.extra_info["nodes_per_round"] = nodes
    best = benchmark_min_seconds(benchmark)
    if best is not None:
        benchmark.extra_info["min_ns_per_node"] = best / nodes * 1e9
        note(f"{best / nodes * 1e9:.0f} ns per evicted node (best round, "
             f"{nodes:.0f} nodes per round)")
    assert scenario.cache.node_count() >= num_leaves  # refilled, not drained


CALLBACK_LEAVES = 10**5


@pytest.mark.parametrize("callback", EvictionScenario.CALLBACKS)
def test_evict_callbacks(benchmark, note, core, callback):
    scenario = EvictionScenario(core, CALLBACK_LEAVES, NODES_PER_ROUND)
    benchmark.group = (f"eviction: {NODES_PER_ROUND} nodes per round, cache of "
                       f"{CALLBACK_LEAVES} leaves, by free callback")
    benchmark.pedantic(lambda: scenario.evict_round(callback), setup=scenario.prepare,
                       rounds=ROUNDS, iterations=1, warmup_rounds=1)
    scenario.finish()
    assert min(scenario.evicted_per_round) >= NODES_PER_ROUND
    nodes = sum(scenario.evicted_per_round) / len(scenario.evicted_per_round)
    best = benchmark_min_seconds(benchmark)
    if best is not None:
        benchmark.extra_info["min_ns_per_node"] = best / nodes * 1e9
        note(f"callback {callback}: {best / nodes * 1e9:.0f} ns per evicted node (best round)")

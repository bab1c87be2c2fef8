"""Fleet simulation against the single-cache replay, side by side, on the Mooncake
conversation trace (``radixcache trace download conversation``, or ``RADIXCACHE_TRACE_DIR``;
skipped without it): one 4-worker ``cache-aware`` run (``simulate_fleet``: the workers hand
their blocks' keys to the router's ``KvIndexer``, which applies them before every decision) and one
``round-robin`` run (no events), against ``serve()`` of one cache, all at 2,000,000 slots (per
worker for the fleet) and 16-token pages, compiled core. Rounds alternate between the three,
so machine noise hits them alike; the summary gives each fleet run's best time over the
single replay's best::

    python -m pytest benchmarks/bench_fleet.py --benchmark-columns=min,mean,rounds

Set ``RADIXCACHE_BENCH_FLEET_LIMIT=N`` to replay only the first N requests.
"""

from __future__ import annotations

import os
import time

import pytest

from _cases import trace_file

CONVERSATION_TRACE, CONVERSATION_MISSING = trace_file("conversation")
CAPACITY = 2_000_000
PAGE_SIZE = 16
WORKERS = 4
ROUNDS = 5


@pytest.fixture(scope="module")
def conversation():
    if not CONVERSATION_TRACE.is_file():
        pytest.skip(CONVERSATION_MISSING)
    from radixcache.traces import read_trace

    limit = os.environ.get("RADIXCACHE_BENCH_FLEET_LIMIT")
    return read_trace(CONVERSATION_TRACE, block_size=512,
                      limit=int(limit) if limit else None)


def test_fleet_against_single_replay(benchmark, conversation, note):
    from radixcache import RadixCache
    from radixcache.fleet import simulate_fleet
    from radixcache.workloads import serve

    runs = {
        "single": lambda: serve(RadixCache(page_size=PAGE_SIZE), conversation, CAPACITY),
        "round-robin": lambda: simulate_fleet(conversation, WORKERS, CAPACITY, "round-robin",
                                              page_size=PAGE_SIZE),
        "cache-aware": lambda: simulate_fleet(conversation, WORKERS, CAPACITY, "cache-aware",
                                              page_size=PAGE_SIZE),
    }
    best = {name: float("inf") for name in runs}
    hit_rates = {}
    for _ in range(ROUNDS):  # interleaved rounds
        for name, run in runs.items():
            start = time.perf_counter()
            result = run()
            best[name] = min(best[name], time.perf_counter() - start)
            hit_rates[name] = result.hit_rate
    # The timing table: the cache-aware fleet run (the one the ratio is about).
    benchmark.pedantic(runs["cache-aware"], rounds=1, iterations=1)
    ratios = {name: best[name] / best["single"] for name in ("round-robin", "cache-aware")}
    benchmark.extra_info.update(best_seconds=best, ratio_to_single=ratios, hit_rate=hit_rates,
                                requests=len(conversation))
    note(f"{len(conversation):,} requests; best of {ROUNDS}: single {best['single']:.2f} s, "
         f"{WORKERS}-worker round-robin {best['round-robin']:.2f} s "
         f"({ratios['round-robin']:.1f}x), cache-aware {best['cache-aware']:.2f} s "
         f"({ratios['cache-aware']:.1f}x); hit rates {hit_rates}")

"""Where a 4-worker cache-aware fleet run's time goes, on the Mooncake conversation trace
(``RADIXCACHE_TRACE_DIR`` or ``radixcache trace download conversation``), beside the single
replay and the round-robin run of ``benchmarks/bench_fleet.py`` (same sizes, compiled core)::

    python benchmarks/scripts/fleet_breakdown.py [--rounds 3]

Per round: the three runs' times, then, inside the cache-aware run, the time and count of the
router index's block-table stores and removals, of the workers' ``fast64`` chain over the
pages they store, and of the router's ``overlap`` queries. Each of those calls is timed in
place, by wrapping the index's table and the workers' key recorders (this script reaches into
both; the timers add about 0.3 µs a call, a few ms a run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cases import trace_file
from bench_fleet import CAPACITY, PAGE_SIZE, WORKERS  # the benchmark's sizes

from radixcache import RadixCache
from radixcache.events import recorder as recorder_module
from radixcache.fleet import simulate_fleet
from radixcache.router import indexer as indexer_module
from radixcache.traces import read_trace
from radixcache.workloads import serve

seconds = {"store": 0.0, "remove": 0.0, "hash": 0.0, "overlap": 0.0}
counts = {"store": 0, "remove": 0, "hash": 0}


def _timed(name, call, blocks=None):
    """``call`` with its time added to ``seconds[name]`` and ``blocks(args, result)`` to
    ``counts[name]``."""

    def run(*args):
        start = time.perf_counter()
        result = call(*args)
        seconds[name] += time.perf_counter() - start
        if blocks is not None:
            counts[name] += blocks(args, result)
        return result

    return run


class _TimedTable:
    """The index's block table, its stores, removals and overlaps timed."""

    def __init__(self, table):
        self._table = table
        self.store = _timed("store", table.store, lambda args, _: len(args[1]) // 8)
        self.remove = _timed("remove", table.remove, lambda args, _: len(args[1]) // 8)
        self.overlap = _timed("overlap", table.overlap)

    def __getattr__(self, name):
        return getattr(self._table, name)


def _instrument() -> None:
    indexer_init = indexer_module.KvIndexer.__init__
    recorder_init = recorder_module.KeyRecorder.__init__

    def timed_indexer_init(self, *args, **kwargs):
        indexer_init(self, *args, **kwargs)
        self._index = _TimedTable(self._index)

    def timed_recorder_init(self, *args, **kwargs):
        recorder_init(self, *args, **kwargs)
        self._hash_bytes = _timed("hash", self._hash_bytes, lambda _, keys: len(keys) // 8)

    indexer_module.KvIndexer.__init__ = timed_indexer_init
    recorder_module.KeyRecorder.__init__ = timed_recorder_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path, missing = trace_file("conversation")
    if not path.is_file():
        sys.exit(missing)
    trace = read_trace(path, block_size=512)
    _instrument()
    # Warm up (the first replay imports torch): not a round.
    serve(RadixCache(page_size=PAGE_SIZE), trace[:50], CAPACITY)
    simulate_fleet(trace[:50], WORKERS, CAPACITY, "cache-aware", page_size=PAGE_SIZE)
    for _ in range(args.rounds):
        for name in seconds:
            seconds[name] = 0.0
        for name in counts:
            counts[name] = 0
        start = time.perf_counter()
        serve(RadixCache(page_size=PAGE_SIZE), trace, CAPACITY)
        single = time.perf_counter() - start
        start = time.perf_counter()
        simulate_fleet(trace, WORKERS, CAPACITY, "round-robin", page_size=PAGE_SIZE)
        round_robin = time.perf_counter() - start
        start = time.perf_counter()
        simulate_fleet(trace, WORKERS, CAPACITY, "cache-aware", page_size=PAGE_SIZE)
        cache_aware = time.perf_counter() - start
        print(f"single {single:.2f} s, round-robin {round_robin:.2f} s, cache-aware "
              f"{cache_aware:.2f} s ({cache_aware / single:.1f}x); in it: stores "
              f"{seconds['store']:.2f} s ({counts['store'] / 1e6:.2f} M blocks, "
              f"{seconds['store'] / max(counts['store'], 1) * 1e9:.0f} ns each), removals "
              f"{seconds['remove']:.2f} s ({counts['remove'] / 1e6:.2f} M, "
              f"{seconds['remove'] / max(counts['remove'], 1) * 1e9:.0f} ns each), fast64 "
              f"chain {seconds['hash']:.2f} s ({counts['hash'] / 1e6:.2f} M pages), overlaps "
              f"{seconds['overlap']:.2f} s", flush=True)


if __name__ == "__main__":
    main()

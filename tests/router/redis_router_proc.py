"""A router process for tests/router/test_redis_index.py: applies one worker's batches to a shared
store-backed ``KvIndexer``.

    python redis_router_proc.py URL NAMESPACE OWNER WORKER FIRST|resume LAST [--slow]

``resume``: start from ``resume_seq(WORKER)`` (printed as ``resumed N``). ``--slow``: print
``applied`` after the first batch and pause between batches (to be killed mid-stream).
"""

from __future__ import annotations

import random
import sys
import time

from radixcache import RadixCache
from radixcache.events import ReceivedBatch
from radixcache.router import KvIndexer

PAGE = 4


def batches_of(worker: int, count: int) -> list:
    """The first ``count`` event batches of worker ``worker``'s cache (deterministic)."""
    rng = random.Random(1000 + worker)
    cache = RadixCache(page_size=PAGE, enable_events=True, array_type="numpy")
    pages = [[rng.randrange(5) for _ in range(PAGE)] for _ in range(8)]
    out = []
    while len(out) < count:
        if rng.random() < 0.7:
            cache.insert([t for _ in range(rng.randrange(1, 6)) for t in rng.choice(pages)])
        else:
            cache.evict(rng.randrange(1, 3 * PAGE))
        out.append(cache.take_events())
    return out


def expected_overlap(count: int) -> list:
    """Queries with the in-process index's answers after ``count`` batches of workers 0, 1."""
    local = KvIndexer(PAGE)
    for worker in (0, 1):
        for seq, events in enumerate(batches_of(worker, count)):
            local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
    rng = random.Random(7)
    pages = [[rng.randrange(5) for _ in range(PAGE)] for _ in range(8)]
    queries = [[t for _ in range(rng.randrange(1, 6)) for t in rng.choice(pages)]
               for _ in range(40)]
    for worker in (0, 1):  # the workers' own page sets
        r = random.Random(1000 + worker)
        own = [[r.randrange(5) for _ in range(PAGE)] for _ in range(8)]
        queries += [own[i] + own[j] for i in range(8) for j in range(8)]
    return [(q, local.overlap(q)) for q in queries]


def main(argv: list) -> None:
    url, namespace, owner, worker, first, last = argv[:6]
    slow = "--slow" in argv
    worker, last = int(worker), int(last)
    indexer = KvIndexer(PAGE, store=url, namespace=namespace, owner=owner)
    if first == "resume":
        first = indexer.resume_seq(worker) or 0
        print(f"resumed {first}", flush=True)
    first = int(first)
    batches = batches_of(worker, last)
    for seq in range(first, last):
        indexer.apply(worker, ReceivedBatch(seq, 0.0, batches[seq], None))
        if slow:
            if seq == first:
                print("applied", flush=True)
            time.sleep(0.02)
    if indexer.stats.store_errors or indexer.stats.foreign_batches:
        raise SystemExit(f"store errors: {indexer.stats}")


if __name__ == "__main__":
    main(sys.argv[1:])

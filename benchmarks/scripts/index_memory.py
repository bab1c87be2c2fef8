"""What ``KvIndexer`` holds per block, measured with tracemalloc (everything the index keeps
reachable, from an empty index)::

    python benchmarks/scripts/index_memory.py [--workers 100000] [--blocks 1000000]

Rows: one distinct block per worker over ``--workers`` workers; ``--blocks`` blocks held by
the last of ``--workers`` workers after all the others came and went (each stored and removed
one block); the same with a ``fast64`` publisher (its hashes are the indexer's keys), and
``--blocks`` shared by two workers. Publisher hashes are SHA-256 chains, as radixcache and
vLLM send them, unless said otherwise.
"""

from __future__ import annotations

import argparse
from array import array
import gc
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from radixcache.events import BlockRemoved, BlockStored, encode_namespace
from radixcache.router import KvIndexer
from radixcache.router.indexer import _page_keys, _root_key

BLOCK = 16
CHUNK = 10_000  # blocks per stored event


def _measure(build) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        index = build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0], index
    finally:
        tracemalloc.stop()


def _sha_like(i: int) -> int:
    # A publisher hash: any 64-bit value, unrelated to the indexer's key.
    return (i * 0x9E3779B97F4A7C15 + 12345) % 2**63


def one_block_per_worker(workers: int) -> KvIndexer:
    index = KvIndexer(BLOCK)
    for w in range(workers):
        index.apply(w, [BlockStored((_sha_like(w),), None, (w,) * BLOCK, BLOCK)])
    return index


def blocks_of_last_worker(workers: int, blocks: int, fast64: bool, holders: int = 1):
    index = KvIndexer(BLOCK)
    for w in range(workers - 1):  # workers that came and went
        index.apply(w, [BlockStored((_sha_like(w),), None, (w,) * BLOCK, BLOCK)])
        index.apply(w, [BlockRemoved((_sha_like(w),))])
    for h in range(holders):
        worker = workers - 1 - h
        parent = None
        for start in range(0, blocks, CHUNK):
            count = min(CHUNK, blocks - start)
            chunk = tuple(range(start * BLOCK, (start + count) * BLOCK))
            if fast64:  # the fast64 chain: the indexer's own keys
                seed = _root_key(encode_namespace(None)) if parent is None else parent
                hashes = _page_keys(seed, array("q", chunk).tobytes(), BLOCK * 8)
            else:
                hashes = [_sha_like(start + i + 7 * h) for i in range(count)]
            index.apply(worker, [BlockStored(tuple(hashes), parent, chunk, BLOCK)])
            parent = hashes[-1]
    return index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    rows = [
        (f"{args.workers:,} workers, one block each",
         lambda: one_block_per_worker(args.workers), args.workers),
        (f"{args.blocks:,} blocks of worker {args.workers - 1:,} (after {args.workers - 1:,} "
         "came and went)", lambda: blocks_of_last_worker(args.workers, args.blocks, False),
         args.blocks),
        (f"{args.blocks:,} blocks, fast64 publisher",
         lambda: blocks_of_last_worker(2, args.blocks, True), args.blocks),
        (f"{args.blocks:,} blocks held by two workers",
         lambda: blocks_of_last_worker(2, args.blocks, False, holders=2), args.blocks),
    ]
    for label, build, blocks in rows:
        size, index = _measure(build)
        print(f"{label}: {size / 2**20:,.1f} MiB, {size / blocks:,.0f} B per block "
              f"({len(index):,} distinct blocks, {len(index.workers):,} workers holding)")
        del index


if __name__ == "__main__":
    main()

"""What ``KvIndexer`` holds per block, measured with tracemalloc (everything the index keeps
reachable, from an empty index)::

    python benchmarks/scripts/index_memory.py [--workers 100000] [--blocks 1000000]

Rows: one distinct block per worker over ``--workers`` workers; ``--blocks`` blocks held by
the last of ``--workers`` workers after all the others came and went (each stored and removed
one block); the same with a ``fast64`` publisher (its hashes are the indexer's keys), and
``--blocks`` shared by two workers. Publisher hashes are SHA-256 chains, as radixcache and
vLLM send them, unless said otherwise.

``--by-hash-type``: the same ``--shared-blocks`` blocks held by 1 and by ``--fleet`` workers,
for each kind of publisher hash (32-byte bytes, 64-bit ints, ``fast64`` keys): bytes per block
(one worker) and per additional (block, worker) pair ((fleet - one) / ((fleet - 1) x blocks));
then the time one ``AllBlocksCleared`` takes for a worker holding ``--blocks`` 32-byte-hashed
blocks (beside a second worker holding the same), best of 3::

    python benchmarks/scripts/index_memory.py --by-hash-type [--fleet 64] [--shared-blocks 100000]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
import tracemalloc
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_namespace,
)
from radixcache.router import KvIndexer
from radixcache.router.keys import _page_keys, _root_key

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


def _hashes(kind: str, blocks: int) -> list:
    """``blocks`` publisher hashes of one chain from the root, in chunks of ``CHUNK``."""
    if kind == "fast64":
        data = array("q", range(blocks * BLOCK)).tobytes()
        return _page_keys(_root_key(encode_namespace(None)), data, BLOCK * 8)
    out = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(blocks)]
    if kind == "int64":
        return [int.from_bytes(h[:8], "little") >> 1 for h in out]
    return out


def shared_blocks(kind: str, workers: int, blocks: int) -> KvIndexer:
    index = KvIndexer(BLOCK)
    hashes = _hashes(kind, blocks)
    events = []
    for start in range(0, blocks, CHUNK):
        count = min(CHUNK, blocks - start)
        events.append(BlockStored(tuple(hashes[start:start + count]),
                                  None if start == 0 else hashes[start - 1],
                                  tuple(range(start * BLOCK, (start + count) * BLOCK)), BLOCK))
    del hashes
    for w in range(workers):
        index.apply(w, events)
    return index


def by_hash_type(fleet: int, blocks: int, clear_blocks: int) -> None:
    for kind in ("bytes32", "int64", "fast64"):
        one, index = _measure(lambda kind=kind: shared_blocks(kind, 1, blocks))
        del index
        many, index = _measure(lambda kind=kind: shared_blocks(kind, fleet, blocks))
        assert index.blocks_held(fleet - 1) == blocks and len(index) == blocks
        del index
        pair = (many - one) / ((fleet - 1) * blocks)
        print(f"{kind:>7}: {one / blocks:5.1f} B per block (one worker), {pair:5.1f} B per "
              f"additional (block, worker) pair ({fleet} workers x {blocks:,} blocks: "
              f"{many / 2**20:,.1f} MiB)")
    times = []
    for _ in range(3):
        index = shared_blocks("bytes32", 2, clear_blocks)
        start = time.perf_counter()
        index.apply(0, [AllBlocksCleared()])
        times.append(time.perf_counter() - start)
        assert index.blocks_held(0) == 0 and index.blocks_held(1) == clear_blocks
        del index
    print(f"AllBlocksCleared of a worker's {clear_blocks:,} blocks (32-byte hashes, a second "
          f"worker holding them too): {min(times) * 1e3:.0f} ms (best of 3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--by-hash-type", action="store_true",
                        help="memory per block and per pair for each kind of publisher hash")
    parser.add_argument("--fleet", type=int, default=64)
    parser.add_argument("--shared-blocks", type=int, default=100_000)
    args = parser.parse_args()
    if args.by_hash_type:
        by_hash_type(args.fleet, args.shared_blocks, args.blocks)
        return
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

"""``KvIndexer(store="redis://...")`` beside the in-process ``KvIndexer``: ingest rate, lookup
latency and memory per (block, worker) pair, against a real ``redis-server`` this script
starts on loopback (AOF on, fsync every second, as a primary would run)::

    nice -n 10 python benchmarks/bench_redis_index.py [--rounds 3] [--blocks 200000]

Skips (exit 0, a message) without ``redis-server`` or the ``redis`` client.

- ingest: vLLM-shaped batches (one per scheduler step: a few requests' new full blocks as
  ``BlockStored`` events of 1 to 32 blocks, and an evicted leaf's ``BlockRemoved`` now and
  then), publisher hashes SHA-256 (vLLM, radixcache's default) or ``fast64`` (the indexer's
  own keys); block events per second, best of interleaved rounds.
- overlap: an 8k-token prompt, page 16 (512 blocks), 16 workers holding prefixes of it of
  random depth; p50 and p99 of single lookups (one round trip each).
- floor: a script that only returns, called the way the index calls its scripts: the round
  trip every batch and every lookup pays before any work.
- memory: ``MEMORY USAGE`` summed over the namespace's keys, per (block, worker) pair, for
  blocks held by one worker and by four.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixcache import _core
from radixcache.events import (
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    encode_namespace,
)
from radixcache.events.hashing import block_hashes, fast64_root
from radixcache.router import KvIndexer

PAGE = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(directory: str):
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
         "--appendonly", "yes", "--appendfsync", "everysec", "--dir", directory,
         "--save", "", "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(400):
        try:
            client.ping()
            return proc, port, client
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def vllm_batches(rng: random.Random, steps: int, block_hash: str) -> list:
    """Per scheduler step one batch: 1-4 requests' new blocks (1-32 each, chained on a held
    prefix), and now and then an evicted leaf."""
    keyer = KvIndexer(PAGE)
    batches = []
    held: list = []  # (hashes, tokens) of stored leaves, for parents and removals
    for seq in range(steps):
        events = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 32)
            if held and rng.random() < 0.5:
                parent_hashes, parent_tokens = rng.choice(held)
                prefix = parent_tokens
                parent = parent_hashes[-1]
            else:
                prefix, parent = [], None
            tokens = [rng.randrange(32000) for _ in range(n * PAGE)]
            if block_hash == "fast64":  # the indexer's own keys
                hashes = keyer.block_keys(prefix + tokens)[len(prefix) // PAGE:]
            else:
                hashes = block_hashes(tokens, PAGE, None, parent)
            events.append(BlockStored(tuple(hashes), parent, tuple(tokens), PAGE))
            held.append((hashes, prefix + tokens))
        if len(held) > 64 and rng.random() < 0.5:
            hashes, _ = held.pop(rng.randrange(len(held) // 2))
            events.append(BlockRemoved((hashes[-1],)))
        batches.append(ReceivedBatch(seq, 0.0, events, None))
    return batches


def fleet_batches(steps: int, workers: int, block_hash: str) -> list:
    """(worker, batch) of ``workers`` workers' streams, interleaved."""
    streams = [vllm_batches(random.Random(w), steps // workers, block_hash)
               for w in range(workers)]
    return [(w, stream[i]) for i in range(steps // workers) for w, stream in enumerate(streams)]


def block_events(batches: list) -> int:
    return sum(len(e.block_hashes) for _, b in batches for e in b.events)


def ingest(url: str, namespace: str, batches: list) -> float:
    index = KvIndexer(PAGE) if url is None else KvIndexer(PAGE, store=url,
                                                          namespace=namespace)
    start = time.perf_counter()
    for worker, batch in batches:
        index.apply(worker, batch)
    elapsed = time.perf_counter() - start
    assert not index.stats.store_errors and not index.stats.skipped, index.stats
    return elapsed


def lookup_latency(url, namespace, rounds: int, client) -> tuple:
    rng = random.Random(1)
    tokens = [rng.randrange(32000) for _ in range(8192)]
    keys = KvIndexer(PAGE).block_keys(tokens)
    indexes = {"in-process": KvIndexer(PAGE),
               "redis": KvIndexer(PAGE, store=url, namespace=namespace + "q")}
    depths = [rng.randint(1, 512) for _ in range(16)]
    for index in indexes.values():
        for w, depth in enumerate(depths):
            index.apply(w, [BlockStored(tuple(keys[:depth]), None, tuple(tokens[:depth * PAGE]),
                                        PAGE)])
    assert indexes["redis"].overlap(tokens) == indexes["in-process"].overlap(tokens)
    client.config_resetstat()  # the lookups' script time only
    out = {name: [] for name in indexes}
    for _ in range(rounds):
        for name, index in indexes.items():
            samples = []
            for _ in range(500):
                t0 = time.perf_counter()
                index.overlap(tokens)
                samples.append(time.perf_counter() - t0)
            samples.sort()
            out[name].append((samples[len(samples) // 2], samples[int(len(samples) * 0.99)]))
    # the router's own part of a lookup: the prompt's tokens (a list) as bytes, its chain of keys
    root = fast64_root(encode_namespace(None))
    samples = []
    for _ in range(500):
        t0 = time.perf_counter()
        _core.blocks.page_hash_bytes(root, _core.blocks.ids_le_bytes(tokens), 8 * PAGE)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    best = {name: min(v, key=lambda x: x[1]) for name, v in out.items()}
    return best, samples[len(samples) // 2]


def floor_us(url: str, rounds: int) -> tuple:
    """p50 and mean of a script that only returns, called as the index calls its scripts."""
    index = KvIndexer(PAGE, store=url, namespace="floor")
    store = index._store
    script = store.client.register_script("return 'ok'")
    store._call(script, [store.prefix])
    best = None
    for _ in range(rounds):
        samples = []
        for _ in range(2000):
            t0 = time.perf_counter()
            store._call(script, [store.prefix])
            samples.append(time.perf_counter() - t0)
        samples.sort()
        row = (samples[len(samples) // 2] * 1e6, sum(samples) / len(samples) * 1e6)
        best = row if best is None or row[1] < best[1] else best
    index.close()
    return best


def memory_per_pair(client, url, namespace: str, blocks: int, holders: int) -> tuple:
    index = KvIndexer(PAGE, store=url, namespace=namespace)
    rng = random.Random(2)
    per_event = 512
    for _start in range(0, blocks, per_event):
        tokens = [rng.randrange(32000) for _ in range(per_event * PAGE)]
        keys = index.block_keys(tokens)
        for w in range(holders):
            index.apply(w, [BlockStored(tuple(keys), None, tuple(tokens), PAGE)])
    total = blocks_bytes = journal_bytes = 0
    prefix = f"rc:{namespace}:".encode()
    pipe_keys = list(client.scan_iter(prefix + b"*", count=10_000))
    for i in range(0, len(pipe_keys), 10_000):
        pipe = client.pipeline(transaction=False)
        chunk = pipe_keys[i:i + 10_000]
        for key in chunk:
            pipe.memory_usage(key, samples=0)
        for key, size in zip(chunk, pipe.execute()):
            total += size
            if key == prefix + b"blocks":
                blocks_bytes += size
            elif key.startswith(prefix + b"j:"):
                journal_bytes += size
    pairs = len(index) * holders
    return total / pairs, blocks_bytes / pairs, journal_bytes / pairs, len(index)


def script_us(client) -> float:
    """Mean server time of the script calls since the last CONFIG RESETSTAT, microseconds."""
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    usec = sum(v["usec"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return usec / calls if calls else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000, help="batches per ingest round")
    parser.add_argument("--blocks", type=int, default=200_000, help="blocks for the memory row")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        print("skipped: redis-server is not installed (apt-get install redis-server)")
        return
    try:
        import redis  # noqa: F401
    except ImportError:
        print("skipped: the redis client is not installed (pip install 'radixcache[redis]')")
        return
    with tempfile.TemporaryDirectory() as directory:
        proc, port, client = start_server(directory)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            version = client.info()["redis_version"]
            print(f"redis-server {version} on loopback, AOF everysec; page {PAGE}")
            print("\ningest (block events/s, best of interleaved rounds; 8 workers)")
            for block_hash in ("sha256", "fast64"):
                batches = fleet_batches(args.steps, 8, block_hash)
                n = block_events(batches)
                best = {"in-process": 0.0, "redis": 0.0}
                server_us, total_us = [], []
                for r in range(args.rounds):
                    for name in best:
                        u = None if name == "in-process" else url
                        client.config_resetstat()
                        elapsed = ingest(u, f"i{block_hash}{r}", batches)
                        best[name] = max(best[name], n / elapsed)
                        if u is not None:
                            server_us.append(script_us(client))
                            total_us.append(elapsed / len(batches) * 1e6)
                print(f"  {block_hash:7s} publisher: in-process {best['in-process']:>12,.0f}"
                      f"   redis {best['redis']:>10,.0f}   ratio "
                      f"{best['in-process'] / best['redis']:.1f}x   "
                      f"({n:,} block events, {args.steps} batches)")
                per_batch = min(server_us) / 1e6
                print(f"          server script time {per_batch * 1e6:.0f} us per batch: "
                      f"{n / len(batches) / per_batch:,.0f} block events/s of server time")
                fastest = min(range(len(total_us)), key=total_us.__getitem__)
                print(f"          fastest round: {total_us[fastest]:.0f} us per batch, of which "
                      f"server {server_us[fastest]:.0f} us, the rest the router (its view, "
                      f"the call, the round trip)")
            p50, mean = floor_us(url, args.rounds)
            print(f"\nfloor: a script that only returns, p50 {p50:.0f} us, mean {mean:.0f} us "
                  f"per call ({1e6 / mean:,.0f} calls/s)")
            print("\noverlap of an 8k-token prompt (512 blocks), 16 workers, one lookup")
            lat, router_part = lookup_latency(url, "lat", args.rounds, client)
            for name, (p50, p99) in lat.items():
                print(f"  {name:10s} p50 {p50 * 1e3:7.3f} ms   p99 {p99 * 1e3:7.3f} ms")
            server = script_us(client)
            print(f"  server script time per lookup: {server:.0f} us mean; the router's part "
                  f"(tokens to bytes, the chain of keys): {router_part * 1e6:.0f} us p50")
            print("\nmemory per (block, worker) pair (MEMORY USAGE, all the namespace's keys)")
            for holders in (1, 4):
                per, blocks_b, journal_b, nblocks = memory_per_pair(
                    client, url, f"mem{holders}", args.blocks, holders)
                print(f"  {nblocks:,} blocks x {holders} worker(s): {per:6.1f} B per pair "
                      f"(block keys {blocks_b:.1f}, journals {journal_b:.1f})")
            print(f"\nused_memory after all rows: {client.info('memory')['used_memory_human']}")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()

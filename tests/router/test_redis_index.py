"""``KvIndexer(store="redis://...")`` against a real ``redis-server``: the same answers as the
in-process index, shared by routers, surviving router and server restarts, leases, and
cache-blind routing while the store is away.

The tests start ``redis-server`` themselves (127.0.0.1, a free port, AOF on) and skip when it
is not installed, unless ``RADIXCACHE_REQUIRE_REDIS=1`` (CI), where they fail instead.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from radixcache import RadixCache, _core
from radixcache._core import BLOCKS, CORES
from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    encode_namespace,
    tokens_le_bytes,
)
from radixcache.router import KvIndexer, Router
from ports import free_port
from own_keys import (
    held_under_a_negative_key_and_its_unsigned_spelling,
    negative_key_block,
    negative_key_steps,
)

redis = pytest.importorskip("redis", reason="needs the redis client (radixcache[redis])")

REDIS_SERVER = shutil.which("redis-server")
REQUIRE = os.environ.get("RADIXCACHE_REQUIRE_REDIS") == "1"


def need_server() -> None:
    """Skip without redis-server, or fail where RADIXCACHE_REQUIRE_REDIS=1 (CI)."""
    if REDIS_SERVER is None:
        if REQUIRE:
            pytest.fail("RADIXCACHE_REQUIRE_REDIS=1 but redis-server is not installed "
                        "(apt-get install redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server); set "
                    "RADIXCACHE_REQUIRE_REDIS=1 to fail instead")

HERE = Path(__file__).resolve().parent


class RedisServer:
    """A real redis-server on 127.0.0.1 with AOF on (fsync on every write), in ``directory``."""

    def __init__(self, directory: Path) -> None:
        need_server()
        self.directory = directory
        self.port = free_port()
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory),
             "--save", "", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
            except redis.BusyLoadingError:
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def client(self):
        return redis.Redis(port=self.port)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def namespace():
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def on_core(core_name, monkeypatch):
    """The caches' tree core and the in-process index's block module, both ``core_name``."""
    monkeypatch.setattr(_core, "core", CORES[core_name])
    monkeypatch.setattr(_core, "blocks", BLOCKS[core_name])
    return core_name


# -- streams -------------------------------------------------------------------------------
def cache_batches(rng, page_size, workers, steps, block_hash):
    """(worker, events) per step from real caches doing inserts, evictions and resets; some
    batches are copied onto a host tier ("CPU") and a second KV-cache group."""
    options = {} if block_hash == "sha256" else {"event_options": {"block_hash": block_hash}}
    caches = [RadixCache(page_size=page_size, enable_events=True, array_type="numpy",
                         **options) for _ in range(workers)]
    pages = [[rng.randrange(4) for _ in range(page_size)] for _ in range(6)]
    out, queries = [], []
    for step in range(steps):
        worker = rng.randrange(workers)
        cache = caches[worker]
        roll = rng.random()
        if step % 89 == 88:
            cache.reset()
        elif roll < 0.6:
            seq = [t for _ in range(rng.randrange(1, 6)) for t in rng.choice(pages)]
            seq += [rng.randrange(4) for _ in range(rng.randrange(page_size))]
            namespace = rng.choice((None, None, "a", 3))
            cache.insert(seq, extra_key=namespace)
            queries.append((seq, namespace))
        else:
            cache.evict(rng.randrange(1, 4 * page_size))
        events = cache.take_events()
        extra = []
        for event in events:
            if rng.random() < 0.3 and not isinstance(event, AllBlocksCleared):
                extra.append(dataclasses.replace(event, medium="CPU"))
            if rng.random() < 0.2 and not isinstance(event, AllBlocksCleared):
                extra.append(dataclasses.replace(event, group_idx=1))
        out.append((f"w{worker}", events + extra))
    return out, queries


def assert_same(local, remote, queries, rng):
    # what the router's host-tier scoring asks first
    assert Router(1, indexer=remote, block_size=remote.block_size)._has_host_blocks() == \
        Router(1, indexer=local, block_size=local.block_size)._has_host_blocks()
    for tokens, namespace in rng.sample(queries, min(4, len(queries))):
        tokens = tokens + [rng.randrange(4)]
        for medium in ("GPU", "CPU"):
            assert remote.overlap(tokens, namespace, medium) == \
                local.overlap(tokens, namespace, medium), (tokens, namespace, medium)
        # either tier, as the router's host-tier scoring asks
        raw, ns = tokens_le_bytes(tokens), encode_namespace(namespace)
        both = ("GPU", "CPU")
        assert remote._overlap(raw, ns, both) == local._overlap(raw, ns, both)


def test_importing_radixcache_imports_no_redis():
    code = ("import sys, radixcache, radixcache.router, radixcache.fleet; "
            "from radixcache.router import KvIndexer; KvIndexer(4).overlap([1, 2, 3, 4]); "
            "assert 'redis' not in sys.modules, 'redis imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the same answers ------------------------------------------------------------------------
@pytest.mark.parametrize("block_hash", ["sha256", "fast64"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_redis_index_agrees_with_the_in_process_index(server, namespace, on_core, block_hash,
                                                      page_size):
    rng = random.Random(page_size * 7 + len(block_hash))
    batches, queries = cache_batches(rng, page_size, 3, 260, block_hash)
    local = KvIndexer(page_size)
    remote = KvIndexer(page_size, store=server.url, namespace=namespace)
    for seq, (worker, events) in enumerate(batches):
        batch = ReceivedBatch(seq, 0.0, events, None)
        local.apply(worker, batch)
        remote.apply(worker, batch)
        if queries:
            assert_same(local, remote, queries, rng)
        assert len(remote) == len(local)
    assert sorted(remote.workers) == sorted(local.workers)
    for worker in local.workers:
        for medium in (None, "GPU", "CPU"):
            assert remote.blocks_held(worker, medium) == local.blocks_held(worker, medium)
    assert remote.stats.store_errors == remote.stats.stale_batches == 0
    # A second router on the same namespace reads the same index; another namespace not.
    reader = KvIndexer(page_size, store=server.url, namespace=namespace)
    other = KvIndexer(page_size, store=server.url, namespace=namespace + "x")
    for tokens, ns in queries[-10:]:
        assert reader.overlap(tokens, ns) == local.overlap(tokens, ns)
        assert other.overlap(tokens, ns) == {}
    # A router restarted under the same owner token takes its workers back from the store
    # (journals and sequence numbers) and goes on agreeing.
    restarted = KvIndexer(page_size, store=server.url, namespace=namespace,
                          owner=remote._store.token)
    more, more_queries = cache_batches(random.Random(5), page_size, 3, 60, block_hash)
    # new caches: each worker's first batch is a restarted publisher's (numbers start over)
    seen = set()
    for offset, (worker, events) in enumerate(more):
        batch = ReceivedBatch(offset, 0.0, events, None, restarted=worker not in seen)
        seen.add(worker)
        local.apply(worker, batch)
        restarted.apply(worker, batch)
        assert_same(local, restarted, queries + more_queries, rng)
    assert len(restarted) == len(local)
    for idx in (remote, reader, other, restarted):
        idx.close()


def test_reapplying_a_batch_is_harmless(server, namespace):
    local = KvIndexer(2)
    remote = KvIndexer(2, store=server.url, namespace=namespace)
    events = [BlockStored((11, 12), None, (1, 2, 3, 4), 2)]
    second = [BlockStored((13,), 12, (5, 6), 2)]
    for idx in (local, remote):
        idx.apply("a", ReceivedBatch(0, 0.0, events, None))
        idx.apply("a", ReceivedBatch(1, 0.0, second, None))
    remote.apply("a", ReceivedBatch(0, 0.0, events, None))
    remote.apply("a", ReceivedBatch(1, 0.0, second, None))
    assert remote.stats.stale_batches == 2
    assert remote.overlap([1, 2, 3, 4, 5, 6]) == local.overlap([1, 2, 3, 4, 5, 6]) == {"a": 3}
    assert remote.resume_seq("a") == 2
    # A second router does not apply batches of a worker the first one owns.
    second_router = KvIndexer(2, store=server.url, namespace=namespace)
    second_router.apply("a", ReceivedBatch(2, 0.0, [BlockStored((14,), 13, (7, 8), 2)], None))
    assert second_router.stats.foreign_batches == 1
    assert remote.overlap([1, 2, 3, 4, 5, 6, 7, 8]) == {"a": 3}
    assert second_router.resume_seq("a") == 2


def test_long_chains_big_batches_and_a_block_held_twice_agree(server, namespace):
    # A lookup reads the chain in chunks and a batch its blocks in chunks of runs: chains
    # and events past those chunks, a walk that ends inside a chunk, and a block one copy
    # holds twice (two publisher hashes of the same tokens) removed in one event.
    rng = random.Random(5)
    local = KvIndexer(2)
    remote = KvIndexer(2, store=server.url, namespace=namespace)
    tokens = [rng.randrange(1000) for _ in range(2 * 4500)]
    keys = local.block_keys(tokens)
    twice = [BlockStored((b"h1",), None, (7, 7), 2), BlockStored((b"h2",), None, (7, 7), 2)]
    steps = [
        ("a", [BlockStored(tuple(keys), None, tuple(tokens), 2)]),
        ("b", [BlockStored(tuple(keys[:2100]), None, tuple(tokens[:4200]), 2)]),
        ("c", [BlockStored(tuple(keys[:257]), None, tuple(tokens[:514]), 2)]),
        ("a", [BlockRemoved(tuple(keys[2050:4400]))]),
        ("b", twice),
        ("b", [BlockRemoved((b"h1", b"h2"))]),
        ("b", twice + [BlockRemoved((b"h2",))]),
    ]
    for worker, events in steps:
        for idx in (local, remote):
            idx.apply(worker, events)
        for query in (tokens, tokens[:600], tokens[:4102], tokens[:9000], [7, 7], [7, 7, 1, 2]):
            assert remote.overlap(query) == local.overlap(query)
        assert len(remote) == len(local)
        for worker_id in ("a", "b", "c"):
            assert remote.blocks_held(worker_id) == local.blocks_held(worker_id)
    assert remote.overlap(tokens) == {"a": 2050, "b": 2100, "c": 257}
    assert remote.overlap([7, 7]) == {"b": 1}
    remote.remove_worker("a")
    local.remove_worker("a")
    assert remote.overlap(tokens) == local.overlap(tokens) == {"b": 2100, "c": 257}
    assert len(remote) == len(local)
    remote.close()


def test_worker_ids_must_read_back(server, namespace):
    remote = KvIndexer(2, store=server.url, namespace=namespace)
    with pytest.raises(TypeError, match="worker id of a store-backed KvIndexer"):
        remote.apply(object(), [BlockStored((1,), None, (1, 2), 2)])
    assert len(remote) == 0 and remote.workers == []
    with pytest.raises(ValueError, match="namespace"):
        KvIndexer(2, store=server.url, namespace="a:b")
    with pytest.raises(ValueError, match="store must be"):
        KvIndexer(2, store="http://x")


# -- leases ---------------------------------------------------------------------------------
def test_expired_lease_collects_the_dead_workers_blocks(server, namespace):
    remote = KvIndexer(2, store=server.url, namespace=namespace, lease_s=0.3)
    keep = KvIndexer(2, store=server.url, namespace=namespace, lease_s=30)
    remote.apply("dead", [BlockStored((1, 2), None, (1, 2, 3, 4), 2)])
    keep.apply("alive", [BlockStored((1, 2), None, (1, 2, 3, 4), 2),
                         BlockStored((3,), None, (9, 9), 2)])
    assert keep.overlap([1, 2, 3, 4]) == {"dead": 2, "alive": 2}
    assert len(keep) == 3
    assert keep.collect_expired() == []  # nothing expired yet
    time.sleep(0.5)
    assert keep.collect_expired() == ["dead"]
    assert keep.stats.collected_workers == 1
    assert keep.overlap([1, 2, 3, 4]) == {"alive": 2}
    assert keep.blocks_held("dead") == 0 and len(keep) == 3
    assert keep.workers == ["alive"]
    # the dead worker's keys are gone from the store: only the live worker's remain
    client = server.client()
    assert client.hlen(f"rc:{namespace}:blocks") == 3
    # A renewed lease is not collected.
    short = KvIndexer(2, store=server.url, namespace=namespace, lease_s=0.4)
    short.apply("quiet", [BlockStored((5,), None, (7, 7), 2)])
    for _ in range(4):
        time.sleep(0.15)
        short.renew()
    assert keep.collect_expired() == []
    assert keep.overlap([7, 7]) == {"quiet": 1}


# -- the store goes away ---------------------------------------------------------------------
def test_routing_goes_cache_blind_while_the_store_is_away_then_recovers(tmp_path, namespace):
    srv = RedisServer(tmp_path)
    try:
        indexer = KvIndexer(2, store=srv.url, namespace=namespace, owner="r1")
        router = Router(2, "cache-aware", indexer=indexer)
        history = [BlockStored((1, 2), None, (1, 2, 3, 4), 2)]
        indexer.apply(0, ReceivedBatch(0, 0.0, history, None))
        assert router.route([1, 2, 3, 4, 5]) == 0
        assert indexer.overlap([1, 2, 3, 4]) == {0: 2}
        srv.kill()
        lost = [BlockStored((3,), 2, (5, 6), 2)]
        indexer.apply(0, ReceivedBatch(1, 0.0, lost, None))  # not stored: counted
        assert indexer.overlap([1, 2, 3, 4]) == {}  # cache-blind, no exception
        router.route([1, 2, 3, 4, 5])
        assert indexer.stats.store_errors >= 1 and indexer.stats.blind_lookups >= 1
        srv.start()  # from its AOF
        time.sleep(0.6)  # the pause before the store is tried again
        assert indexer.overlap([1, 2, 3, 4]) == {0: 2}  # the index survived
        assert indexer.resume_seq(0) == 1  # replay from the lost batch on
        indexer.apply(0, ReceivedBatch(1, 0.0, lost, None))
        assert indexer.overlap([1, 2, 3, 4, 5, 6]) == {0: 3}
        assert router.route([1, 2, 3, 4, 5, 6, 7]) == 0
    finally:
        srv.stop()


def test_index_survives_a_sigkilled_server_through_its_aof(tmp_path, namespace):
    srv = RedisServer(tmp_path)
    try:
        rng = random.Random(3)
        batches, queries = cache_batches(rng, 2, 2, 80, "sha256")
        local = KvIndexer(2)
        remote = KvIndexer(2, store=srv.url, namespace=namespace)
        for seq, (worker, events) in enumerate(batches):
            local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
            remote.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        srv.kill()
        srv.start()
        fresh = KvIndexer(2, store=srv.url, namespace=namespace)
        for tokens, ns in queries:
            assert fresh.overlap(tokens, ns) == local.overlap(tokens, ns)
        assert len(fresh) == len(local) > 0
    finally:
        srv.stop()


# -- router processes ------------------------------------------------------------------------
def _router(url, namespace, owner, worker, first, last, *extra):
    return subprocess.Popen(
        [sys.executable, str(HERE / "redis_router_proc.py"), url, namespace, owner,
         str(worker), str(first), str(last), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_router_processes_share_a_namespace_and_a_killed_one_resumes(server, namespace):
    from redis_router_proc import batches_of, expected_overlap

    # Two processes each own one worker's ingest; both write the one index.
    procs = [_router(server.url, namespace, f"r{w}", w, 0, 40) for w in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    reader = KvIndexer(4, store=server.url, namespace=namespace)
    for w in (0, 1):
        assert reader.resume_seq(w) == 40
    for tokens, want in expected_overlap(40):
        assert reader.overlap(tokens) == want
    # A router is SIGKILLed mid-stream; restarted, it resumes from the stored sequence.
    proc = _router(server.url, namespace, "r0", 0, 40, 400, "--slow")
    line = proc.stdout.readline()  # it applied one batch at least
    assert line.startswith("applied")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resume = reader.resume_seq(0)
    assert 40 < resume < 400
    proc = _router(server.url, namespace, "r0", 0, "resume", 400)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"resumed {resume}" in out
    local = KvIndexer(4)
    for seq, events in enumerate(batches_of(0, 400)):
        local.apply(0, ReceivedBatch(seq, 0.0, events, None))
    for seq, events in enumerate(batches_of(1, 40)):
        local.apply(1, ReceivedBatch(seq, 0.0, events, None))
    for tokens, _ in expected_overlap(400):
        assert reader.overlap(tokens) == local.overlap(tokens)
    assert len(reader) == len(local)


# -- the loopback ZeroMQ fleet ---------------------------------------------------------------
def test_loopback_zmq_fleet_routes_the_same_on_the_redis_index(server, namespace, on_core):
    pytest.importorskip("zmq")
    if str(HERE.parent / "sim") not in sys.path:  # the fleet tests' loopback channel
        sys.path.insert(0, str(HERE.parent / "sim"))
    from test_fleet import ZmqChannel

    from radixcache.fleet import TimeModel, simulate_fleet
    from radixcache.workloads import synthetic_chat

    requests = synthetic_chat(num_conversations=12, num_system_prompts=3, seed=5,
                              system_prompt_len=(40, 80), user_len=(4, 12),
                              output_len=(4, 12))
    prompts = [(r.prompt.tolist(), r.extra_key) for r in requests]
    local_index = KvIndexer(4)
    remote_index = KvIndexer(4, store=server.url, namespace=namespace)
    checked = []

    class CheckedChannel(ZmqChannel):
        """Each batch off the wire goes to an in-process index and the Redis one, which must
        agree after it; the fleet's router (on the Redis index) then applies it again."""

        def __init__(self, worker):
            super().__init__()
            self.worker = worker

        def take(self, max_time, max_step):
            out = []
            while (self.pending and self.pending[0][0] <= max_time
                   and self.pending[0][1] <= max_step):
                _, _, seq = self.pending.popleft()
                batch = self.sub.receive(timeout=10.0)
                assert batch is not None and batch.seq == seq
                local_index.apply(self.worker, batch)
                remote_index.apply(self.worker, batch)
                for tokens, key in prompts[::3]:
                    assert remote_index.overlap(tokens, key) == local_index.overlap(tokens, key)
                checked.append(seq)
                out.append(batch)
            return out

    common = dict(page_size=4, core=on_core, interval_ms=50,
                  time_model=TimeModel(prefill_tokens_per_s=2000.0, decode_tokens_per_s=200.0))
    local = simulate_fleet(requests, 3, 400, "cache-aware", **common)
    channels = [CheckedChannel(w) for w in range(3)]
    router = Router(3, "cache-aware", block_size=4, indexer=remote_index)
    wired = simulate_fleet(requests, 3, 400, router, channels=channels, **common)
    assert len(checked) > len(requests)
    assert wired.decisions == local.decisions and len(set(local.decisions)) == 3
    assert wired.cached_tokens == local.cached_tokens > 0
    assert remote_index.stats.stale_batches == len(checked)  # applied twice: once counted
    assert remote_index.stats.store_errors == 0


def test_a_full_store_is_counted_and_lookups_go_on(server, namespace):
    indexer = KvIndexer(2, store=server.url, namespace=namespace)
    indexer.apply("a", [BlockStored((1,), None, (1, 2), 2)])
    client = server.client()
    client.config_set("maxmemory", "1")  # every write refused (noeviction)
    try:
        indexer.apply("a", [BlockStored((2,), 1, (3, 4), 2)])  # refused: counted, no raise
        assert indexer.stats.store_errors == 1
        time.sleep(0.6)
        assert indexer.overlap([1, 2, 3, 4]) == {"a": 1}  # lookups write nothing: answered
    finally:
        client.config_set("maxmemory", "0")
    assert indexer.resume_seq("a") is None  # no numbered batch was ever stored
    indexer.apply("a", [BlockStored((2,), 1, (3, 4), 2)])
    assert indexer.overlap([1, 2, 3, 4]) == {"a": 2}


def test_the_router_fleet_page_example_runs(server):
    import re

    page = (HERE.parents[1] / "docs" / "router-fleet.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    example = example.replace("redis://redis-primary:6379/0", server.url)
    scope = {}
    exec(compile(example, "router-fleet.md", "exec"), scope)
    assert scope["indexer"]._store is not None and scope["router"].route([1] * 40) in range(8)


# -- fleet simulation with router replicas ----------------------------------------------------
def _chat():
    from radixcache.fleet import TimeModel
    from radixcache.workloads import synthetic_chat

    requests = synthetic_chat(num_conversations=16, num_system_prompts=3, seed=11,
                              system_prompt_len=(40, 80), user_len=(4, 12), output_len=(4, 12))
    common = dict(page_size=4, interval_ms=20,
                  time_model=TimeModel(prefill_tokens_per_s=2000.0, decode_tokens_per_s=200.0))
    return requests, common


def test_fleet_with_one_replica_on_the_shared_index_routes_as_in_process(server, on_core):
    from radixcache.fleet import simulate_fleet

    requests, common = _chat()
    local = simulate_fleet(requests, 4, 300, "cache-aware", core=on_core, **common)
    shared = simulate_fleet(requests, 4, 300, "cache-aware", core=on_core, routers=1,
                            index=server.url, **common)
    assert shared.decisions == local.decisions and len(set(local.decisions)) > 1
    assert shared.cached_tokens == local.cached_tokens > 0
    assert shared.ttft_p50 == local.ttft_p50
    assert not any(server.client().scan_iter(b"rc:simulate-*"))  # its namespace is gone


def test_fleet_replicas_share_what_they_ingest_only_through_the_index(server):
    from radixcache.fleet import simulate_fleet

    requests, common = _chat()
    split = simulate_fleet(requests, 4, 300, "cache-aware", routers=2, **common)
    shared = simulate_fleet(requests, 4, 300, "cache-aware", routers=2, index=server.url,
                            **common)
    # The same ingest (worker w by replica w mod 2): the shared index stores every batch once.
    assert shared.indexer_stats["batches"] == split.indexer_stats["batches"] > 0
    assert shared.indexer_stats["store_errors"] == 0
    # Per-replica indexes see half the workers: replica 0 never routes on worker 1's blocks
    # (it cannot see them), so the decisions differ from the shared index's.
    assert shared.decisions != split.decisions
    assert shared.requests == split.requests == len(requests)


def test_fleet_replicas_without_a_store():
    from radixcache.fleet import simulate_fleet
    from radixcache.router import Router as _Router

    requests, common = _chat()
    one = simulate_fleet(requests, 4, 300, "cache-aware", **common)
    again = simulate_fleet(requests, 4, 300, "cache-aware", routers=1, **common)
    assert (again.decisions, again.cached_tokens) == (one.decisions, one.cached_tokens)
    three = simulate_fleet(requests, 4, 300, "round-robin", routers=3, **common)
    assert three.requests == len(requests)
    with pytest.raises(ValueError, match="routers and index apply only"):
        simulate_fleet(requests, 4, 300, _Router(4, block_size=4), routers=2, **common)
    with pytest.raises(ValueError, match="routers must be"):
        simulate_fleet(requests, 4, 300, "cache-aware", routers=0, **common)


def test_simulate_command_reports_the_shared_index_beside_per_replica_indexes(server, tmp_path,
                                                                              capsys):
    import json

    from radixcache.cli import main

    out = tmp_path / "rows.json"
    assert main(["simulate", "--limit", "60", "--capacity", "3000", "--workers", "4",
                 "--router", "cache-aware,round-robin", "--routers", "2", "--index", server.url,
                 "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    by_router = {row["router"]: row for row in rows}
    assert set(by_router) == {"cache-aware", "cache-aware/shared", "round-robin", "pooled"}
    assert all(row["requests"] == 60 for row in rows)
    assert "2 router replicas; shared index" in capsys.readouterr().out
    # Without a fleet, or with a URL that is none, the command says so.
    assert main(["simulate", "--limit", "5", "--routers", "2"]) == 2
    assert "--routers applies to a fleet" in capsys.readouterr().err
    assert main(["simulate", "--workers", "2", "--index", "http://x"]) == 2
    assert "not a redis://" in capsys.readouterr().err


def test_compacted_journals_give_the_same_blocks_back(server, namespace):
    # Churn makes the journals grow past their compaction point many times; a router that
    # takes the workers over from the compacted journals goes on agreeing.
    rng = random.Random(9)
    batches, queries = cache_batches(rng, 2, 2, 900, "sha256")
    local = KvIndexer(2)
    first = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    for seq, (worker, events) in enumerate(batches[:800]):
        local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        first.apply(worker, ReceivedBatch(seq, 0.0, events, None))
    client = server.client()
    compacted = [f for f in client.hkeys(f"rc:{namespace}:n") if f.startswith(b"z:")]
    assert compacted  # some journal was compacted
    taken = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    before = local.stats.unknown_parent
    for seq, (worker, events) in enumerate(batches[800:], 800):
        local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        taken.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        assert_same(local, taken, queries, rng)
    assert taken.stats.unknown_parent == local.stats.unknown_parent - before


@pytest.mark.parametrize("kind", ["bytes", "bytes of two lengths", "ints past int64", "a mix"])
def test_publisher_hashes_of_every_kind_survive_a_take_over(server, namespace, kind):
    # The journal writes a batch's hashes as one run when they are all of one kind (bytes of
    # one length, or int64s) and one by one otherwise; either way a router that takes the
    # worker over maps the same hashes to the same blocks (removals by hash agree).
    rng = random.Random(len(kind))

    def new_hash():
        if kind == "bytes":
            return rng.randbytes(32)
        if kind == "bytes of two lengths":
            return rng.randbytes(rng.choice((16, 32)))
        if kind == "ints past int64":
            return rng.randrange(1 << 64, 1 << 70)
        return rng.choice((rng.randbytes(32), rng.randrange(-(1 << 63), 1 << 63),
                           rng.randrange(1 << 64, 1 << 70)))

    chains: list = []  # (hashes, tokens) of stored chains
    batches, queries = [], []
    for _ in range(160):
        events = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 6)
            tokens = [rng.randrange(3) for _ in range(2 * n)]
            if chains and rng.random() < 0.5:
                parent_hashes, parent_tokens = rng.choice(chains)
                parent, prefix = parent_hashes[-1], parent_tokens
            else:
                parent, prefix = None, []
            hashes = [new_hash() for _ in range(n)]
            events.append(BlockStored(tuple(hashes), parent, tuple(tokens), 2))
            chains.append((hashes, prefix + tokens))
            queries.append((prefix + tokens, None))
        if len(chains) > 4 and rng.random() < 0.6:
            hashes, _ = chains.pop(rng.randrange(len(chains)))
            gone = hashes[rng.randrange(len(hashes)):]
            # sometimes with hashes never stored, and a hash stored again in the same batch
            if rng.random() < 0.3:
                gone = gone + [new_hash()]
            events.append(BlockRemoved(tuple(gone)))
        batches.append((rng.choice(("w0", "w1")), events))
    local = KvIndexer(2)
    first = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    for seq, (worker, events) in enumerate(batches[:100]):
        local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        first.apply(worker, ReceivedBatch(seq, 0.0, events, None))
    assert_same(local, first, queries, rng)
    first.close()
    taken = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    for seq, (worker, events) in enumerate(batches[100:], 100):
        local.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        taken.apply(worker, ReceivedBatch(seq, 0.0, events, None))
        assert_same(local, taken, queries, rng)
    assert local.stats.removed_blocks > 0
    assert len(taken) == len(local)
    for worker in ("w0", "w1"):
        assert taken.blocks_held(worker, None) == local.blocks_held(worker, None)
    taken.close()


@pytest.mark.parametrize("unsigned_first", [False, True])
@pytest.mark.parametrize("both_ways", [False, True])
@pytest.mark.parametrize("via", ["events", "payloads"])
def test_a_hash_equal_to_its_negative_own_key_is_taken_mod_2_64(server, namespace, via,
                                                                both_ways, unsigned_first):
    # As in process (test_indexer_model.py): K + 2**64 names the block held as K.
    remote = KvIndexer(2, store=server.url, namespace=namespace)
    got = held_under_a_negative_key_and_its_unsigned_spelling(remote, via, both_ways,
                                                              unsigned_first)
    assert got == negative_key_steps(both_ways)
    remote.close()


@pytest.mark.parametrize("unsigned_first", [False, True])
def test_a_take_over_keeps_an_own_key_named_either_way(server, namespace, unsigned_first):
    # The journal keeps what the view held: a router that takes the worker over removes the
    # block by the other spelling of its key, and a child below it finds it.
    first = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    tokens, key = negative_key_block(first)
    stored, other = (key + 2 ** 64, key) if unsigned_first else (key, key + 2 ** 64)
    first.apply(0, ReceivedBatch(0, 0.0, [BlockStored((stored,), None, tokens, 2),
                                          BlockStored((b"x",), None, (9, 9), 2)], None))
    first.close()
    taken = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    taken.apply(0, ReceivedBatch(1, 0.0, [BlockStored((other,), None, tokens, 2),
                                          BlockStored((5,), other, (5, 5), 2)], None))
    assert taken.stats.duplicate_blocks == 1 and taken.stats.unknown_parent == 0
    assert taken.overlap(tokens + (5, 5)) == {0: 2} and taken.blocks_held(0) == 3
    taken.apply(0, ReceivedBatch(2, 0.0, [BlockRemoved((other,))], None))
    assert taken.stats.removed_blocks == 1 and taken.stats.unknown_removals == 0
    assert taken.overlap(tokens) == {} and taken.blocks_held(0) == 2
    taken.close()


def test_medium_none_counts_every_tier_and_workers_keep_the_stores_order(server, namespace):
    remote = KvIndexer(2, store=server.url, namespace=namespace)
    local = KvIndexer(2)
    for idx in (remote, local):
        idx.apply("a", [BlockStored((10, 11), None, (1, 2, 3, 4), 2)])
        idx.apply("b", [BlockStored((10,), None, (1, 2), 2, medium="CPU")])
        idx.apply("c", [BlockStored((10,), None, (1, 2), 2),
                        BlockStored((11,), 10, (3, 4), 2, medium="DISK")])
        assert idx.overlap([1, 2, 3, 4], medium=None) == {"a": 2, "b": 1, "c": 2}
        assert idx.overlap([1, 2, 3, 4]) == {"a": 2, "c": 1}
        idx.apply("a", [BlockRemoved((10, 11))])
        idx.apply("a", [BlockStored((10,), None, (1, 2), 2)])
    # in process: the order workers last began to hold blocks; in the store: first seen
    assert local.workers == ["b", "c", "a"] and remote.workers == ["a", "b", "c"]
    remote.close()


def test_group_0_and_none_are_one_copy_in_the_store(server, namespace):
    first = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    first.apply(0, ReceivedBatch(0, 0.0, [BlockStored((b"x",), None, (1, 2), 2, group_idx=0),
                                          BlockStored((b"y",), b"x", (3, 4), 2)], None))
    assert first.blocks_held(0) == 2 and first.stats.unknown_parent == 0
    first.close()
    taken = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    taken.apply(0, ReceivedBatch(1, 0.0, [BlockRemoved((b"x",), None, 0),
                                          BlockRemoved((b"y",), None, None)], None))
    assert taken.stats.unknown_removals == 0 and len(taken) == 0 and taken.workers == []
    taken.close()


def test_a_store_with_group_0_and_none_as_two_copies_keeps_one(server, namespace, monkeypatch):
    # A store written when group 0 and None were two copies: a router that takes the worker
    # over keeps one of them, and drops the other's blocks from the store, journal and all.
    import radixcache.router.ingest as ingest_module
    import radixcache.router.redis_store as store_module

    def group_as_sent(event):
        return getattr(event, "group_idx", None)

    for module in (ingest_module, store_module):
        monkeypatch.setattr(module, "_event_group", group_as_sent)
    old = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    old.apply(0, ReceivedBatch(0, 0.0, [BlockStored((b"x",), None, (1, 2), 2, group_idx=0),
                                        BlockStored((b"y",), None, (3, 4), 2)], None))
    assert old.blocks_held(0) == 2 and len(old) == 2
    old.close()
    monkeypatch.undo()
    client = server.client()
    journals = lambda: sorted(k for k in client.keys(f"rc:{namespace}:j:*"))  # noqa: E731
    assert len(journals()) == 2
    taken = KvIndexer(2, store=server.url, namespace=namespace, owner="a")
    taken.apply(0, ReceivedBatch(1, 0.0, [BlockStored((b"z",), None, (5, 6), 2)], None))
    assert len(journals()) == 1
    view = taken._store.view  # one copy: the one kept (one block), and the new block
    assert [c.size for c in view._copies_of(0)] == [2] and len(view._index) == 2
    assert taken.blocks_held(0) == 2 and len(taken) == 2
    kept = [taken.overlap(tokens) for tokens in ([1, 2], [3, 4])]
    assert sorted(kept, key=len) == [{}, {0: 1}] and taken.overlap([5, 6]) == {0: 1}
    taken.close()


def test_scripts_flushed_from_the_server_are_loaded_again(server, namespace):
    # The script calls go on their own connection; a server without the scripts (restarted,
    # or SCRIPT FLUSH) gets them again and the call is answered, not counted as a failure.
    index = KvIndexer(2, store=server.url, namespace=namespace)
    client = server.client()
    index.apply(0, [BlockStored((1,), None, (1, 2), 2)])
    client.script_flush()
    index.apply(0, [BlockStored((2,), 1, (3, 4), 2)])
    client.script_flush()
    assert index.overlap([1, 2, 3, 4]) == {0: 2}
    assert index.stats.store_errors == 0
    index.close()

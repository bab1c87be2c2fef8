"""The service's parts on their own: the flags and static publishers, the endpoint
allow-list, the scoping rules, the standard hashes, the pool, the tiers' cursor (on an
in-process index), the selection policies and the command line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from radixcache.service.config import ServiceConfig, parse_publisher, read_publishers_file
from radixcache.service.identity import Registration, identities, query_key
from radixcache.service.pool import PoolBlocks
from radixcache.service.query import Hits
from radixcache.service.select import Chooser, Loads

independent = pytest.mark.core_independent
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@independent
def test_publisher_flags_and_files(tmp_path):
    reg = parse_publisher("w1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,type=SGLang,"
                          "tenant=t,dp_rank=2,lora=a,salt=s,block_size=32", "m", 16)
    assert reg == Registration("w1", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "SGLang",
                               "m", 32, "t", 2, "a", "s")
    assert parse_publisher("w=tcp://127.0.0.1:1,address=10.0.0.5:8000", "m", 16).address == \
        "10.0.0.5:8000"
    assert parse_publisher("w=tcp://127.0.0.1:1,address=[fd00::5]:8000", "m", 16).address == \
        "[fd00::5]:8000"
    for bad in ("10.0.0.5", "fd00::5:80", "h:99999", "a b:1"):
        with pytest.raises(ValueError, match="address"):
            parse_publisher(f"w=tcp://127.0.0.1:1,address={bad}", "m", 16)
    assert reg.key_text == "w1|t|2" and reg.scope == ("t", "m", 32)
    for bad in ("w1", "=tcp://x:1", "w1=tcp://x:1,colour=red", "w1=tcp://x:1,type=TRT",
                "w1=tcp://x:1,block_size=0", "w1=tcp://x:1,dp_rank=x"):
        with pytest.raises(ValueError, match="--publisher"):
            parse_publisher(bad, "m", 16)
    conductor = {"http_server_port": 13333, "kvevent_instance": {"node1": {
        "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
        "type": "vLLM", "modelname": "qwen2.5", "lora_name": "", "tenant_id": "default",
        "instance_id": "vllm-prefill-node1", "block_size": 128, "dp_rank": 0,
        "additionalsalt": ""}}}
    path = tmp_path / "conductor_config.json"
    path.write_text(json.dumps(conductor))
    reg, = read_publishers_file(str(path), "m", 16)
    assert reg == Registration("vllm-prefill-node1", "tcp://127.0.0.1:5557",
                               "tcp://127.0.0.1:5558", "vLLM", "qwen2.5", 128)
    path.write_text(json.dumps([{"instance_id": "x", "endpoint": "tcp://127.0.0.1:1",
                                 "address": "10.0.0.9:80"}]))
    assert read_publishers_file(str(path), "m", 16)[0].address == "10.0.0.9:80"
    path.write_text("[{\"instance_id\": 3}]")
    with pytest.raises(ValueError, match="entry 0: endpoint"):
        read_publishers_file(str(path), "m", 16)
    # /register's name for the replay socket is not this file's: refused, not dropped.
    path.write_text(json.dumps([{"instance_id": "x", "endpoint": "tcp://127.0.0.1:1",
                                 "replay_endpoint": "tcp://127.0.0.1:2"}]))
    with pytest.raises(ValueError, match="entry 0: unknown key.*'replay_endpoint'"):
        read_publishers_file(str(path), "m", 16)


@independent
def test_the_endpoint_allow_list():
    default = ServiceConfig()
    for endpoint, allowed in [("tcp://127.0.0.1:5557", True), ("tcp://localhost:1", True),
                              ("tcp://[::1]:5557", True), ("ipc:///tmp/kv", True),
                              ("tcp://10.0.0.1:5557", False), ("tcp://127.0.0.1:*", False),
                              ("tcp://127.0.0.1:1;10.0.0.1:1", False), ("pgm://x", False),
                              ("tcp://127.0.0.1:1 ", False), ("ipc:///a;b", False)]:
        assert default.endpoint_allowed(endpoint) is allowed, endpoint
    fleet = ServiceConfig(allow_endpoints=["tcp://10.0.*:5557"])
    assert fleet.endpoint_allowed("tcp://10.0.3.4:5557")
    assert not fleet.endpoint_allowed("tcp://10.1.3.4:5557")
    assert not fleet.endpoint_allowed("tcp://127.0.0.1:5557")  # patterns replace loopback


@independent
def test_which_blocks_a_query_matches():
    # A block's identity is its own LoRA and salt, else its registration's.
    assert identities(None, None, None, None) == [(None, None)]
    assert identities("a", None, None, None) == [("a", None)]
    assert identities(None, None, "a", None) == []  # every block of it is adapter a's
    assert identities("a", None, "a", None) == [("a", None), (None, None)]
    assert identities("a", "s", "a", "s") == [("a", "s"), ("a", None), (None, "s"),
                                              (None, None)]
    assert identities("b", "s", "a", None) == [("b", "s")]
    # How each publisher family keys them.
    assert query_key("vllm", "a", None, 3) == ("a", None)
    assert query_key("vllm", None, "s", 3) == ("s", None)
    assert query_key("vllm", "a", "s", 3) == (None, [("a", "s"), ("a",), ("a",)])
    assert query_key("named", "a", "s", 3) == (("a", "s"), None)


@independent
def test_standard_hashes_follow_the_document():
    xxhash = pytest.importorskip("xxhash")
    from radixcache.service.stdhash import local_hashes, roll, seq_hashes, unsigned

    tokens = [1, 2, 3, 4, 2**32 - 1, 0, 7]
    local = [xxhash.xxh3_64_intdigest(struct.pack("<2I", *tokens[i:i + 2]), seed=9)
             for i in (0, 2, 4)]
    assert local_hashes(tokens, 2, 9) == local
    seqs = [local[0]]
    for value in local[1:]:
        seqs.append(xxhash.xxh3_64_intdigest(struct.pack("<QQ", seqs[-1], value), seed=9))
    assert seq_hashes(tokens, 2, 9) == roll(local, 9) == seqs
    assert roll(local[1:], 9, parent=seqs[0]) == seqs[1:]
    assert unsigned(-1) == 2**64 - 1
    with pytest.raises(OverflowError):
        seq_hashes([2**32], 1)
    with pytest.raises(OverflowError):
        seq_hashes([-1], 1)


@independent
def test_a_pool_counts_its_holders_and_tiers():
    pool = PoolBlocks()
    ident = (None, None)
    assert pool.store("p", ident, [1, 2, 3], "CPU") == 3
    assert pool.store("p", ident, [1], "CPU") == 0
    assert pool.store("q", ident, [4], "DISK") == 1
    assert pool.run(ident, [1, 2, 3, 4], 0, "CPU") == 3
    assert pool.run(ident, [1, 2, 3, 4], 3, "DISK") == 1
    assert pool.run(ident, [1, 2, 3, 4], 0, "CPU", holders={"q"}) == 0
    assert pool.run(("a", None), [1], 0, "CPU") == 0
    assert pool.remove("p", ident, [2, 9], "CPU") == 1
    assert pool.run(ident, [1, 2, 3], 0, "CPU") == 1
    assert (pool.count("p"), pool.count("p", "DISK"), len(pool)) == (2, 0, 3)
    assert pool.clear("p") == 2 and pool.clear("p") == 0
    assert len(pool) == 1 and pool.count("q", "DISK") == 1


def test_the_cursor_walks_device_host_then_disk():
    """Mooncake's conductor's cursor: the device run, then host blocks, then disk blocks,
    each figure where the cursor stood; a pool extends every instance's host and disk."""
    from radixcache.events import BlockStored
    from radixcache.router import KvIndexer
    from radixcache.service.state import Group

    tokens = list(range(1, 15))  # seven blocks of 2
    group = Group(("default", "m", 2, None, None, "vllm"), KvIndexer(2))
    group.workers = {("a", 0): None, ("b", 0): None}
    group.tiered = {("a", 0), ("b", 0)}
    idx = group.indexer
    idx.apply(("a", 0), [BlockStored((1, 2), None, tuple(tokens[:4]), 2),  # 0-1 device
                         BlockStored((3,), 2, tuple(tokens[4:6]), 2, medium="CPU"),  # 2 host
                         BlockStored((5,), None, tuple(tokens[:2]), 2, medium="DISK")])
    # b: block 0 on the host only (below no device run), block 1 on the device: the cursor
    # stops at the device's first miss and the host does not jump ahead of it.
    idx.apply(("b", 0), [BlockStored((7,), None, tuple(tokens[:2]), 2, medium="CPU"),
                         BlockStored((8,), 7, tuple(tokens[2:4]), 2)])
    from radixcache.service.query import group_blocks

    assert group_blocks(group, tokens, None, None) == {("a", 0): (2, 3, 3), ("b", 0): (0, 1, 1)}
    pool = PoolBlocks()
    seqs = list(range(100, 107))  # stand-ins for the prompt's standard hashes
    pool.store("store", (None, None), seqs[3:5], "CPU")
    pool.store("store", (None, None), seqs[5:6], "DISK")
    found = group_blocks(group, tokens, None, None, pool, None, lambda: seqs)
    assert found == {("a", 0): (2, 5, 6), ("b", 0): (0, 1, 1)}


@independent
def test_hits_and_the_policies():
    hits = Hits(4, 8, 8, {0: 4})
    hits.add_rank(1, 6, 6, 10)
    assert (hits.gpu, hits.cpu, hits.disk, hits.longest, hits.dp) == (6, 8, 10, 10,
                                                                       {0: 4, 1: 6})
    loads = Loads()
    chooser = Chooser(1.0, 0.1, 0.9)
    cands = {"a": Hits(100, 100, 100, {0: 100}), "b": Hits(0, 0, 0, {0: 0})}
    assert chooser.choose("cache-aware", cands, 200, loads) == "a"
    loads.start("r", "a", 2000)  # 2000 tokens of load weigh 200 of prefill
    assert chooser.choose("cache-aware", cands, 200, loads) == "b"
    assert chooser.choose("least-loaded", cands, 200, loads) == "b"
    with pytest.raises(ValueError, match="already running"):
        loads.start("r", "b", 1)
    assert loads.end("r") == ("a", 2000) and loads.end("r") is None
    assert loads.tokens == {}
    host = {"a": Hits(0, 100, 100, {0: 0}), "b": Hits(80, 80, 80, {0: 80})}
    assert chooser.cached(host["a"]) == 90  # a host hit: 0.9 of a device one
    assert chooser.choose("cache-aware", host, 200, loads) == "a"
    with pytest.raises(ValueError, match="unknown policy"):
        chooser.choose("fastest", cands, 1, loads)


@independent
def test_the_command_parses_without_a_web_framework():
    code = """
import sys
for name in ("uvicorn", "prometheus_client", "xxhash", "zmq", "redis", "grpc", "tokenizers",
             "jinja2"):
    sys.modules[name] = None
from radixcache.cli import main
assert main(["serve", "--help"]) == 0
for argv in (["serve", "--index", "http://x"], ["serve", "--publisher", "x"],
             ["serve", "--publisher", "w=tcp://10.0.0.1:5557"], ["serve", "--port", "70000"],
             ["serve", "--publisher", "w=tcp://127.0.0.1:5557,replay=tcp://10.0.0.1:5558"],
             ["serve", "--publisher", "w=tcp://127.0.0.1:5557,address=10.0.0.1"],
             ["serve", "--epp", "9002"], ["serve", "--tokenizer", "/models/m"],
             ["serve", "--epp", "9002", "--tokenizer", "d", "--shed-load", "5"],
             ["serve", "--epp", "9002", "--tokenizer", "d", "--max-endpoints", "0"],
             ["serve", "--pending-ttl", "-1"], ["serve", "--host-weight", "2"]):
    assert main(argv) == 2, argv
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("ok\n")
    assert "--allow-endpoint" in done.stdout and "not allowed" in done.stderr
    assert "'tcp://10.0.0.1:5558' is not allowed" in done.stderr  # the replay socket too
    assert "--epp" in done.stdout and "needs the model's tokenizer" in done.stderr
    assert "address must be ip:port" in done.stderr


@independent
def test_the_ranking_orders_every_candidate():
    loads = Loads()
    chooser = Chooser(1.0, 0.1, 0.9)
    cands = {"a": Hits(100, 100, 100, {0: 100}), "b": Hits(0, 0, 0, {0: 0}),
             "c": Hits(40, 40, 40, {0: 40})}
    assert chooser.rank("cache-aware", cands, 200, loads) == ["a", "c", "b"]
    loads.start("r", "a", 1000)  # weighs 100 tokens: a falls behind c, ties b
    assert chooser.rank("cache-aware", cands, 200, loads) == ["c", "b", "a"]
    assert chooser.rank("least-loaded", cands, 200, loads) == ["b", "c", "a"]
    assert [chooser.rank("round-robin", cands, 1, loads) for _ in range(3)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(chooser.rank("random", cands, 1, loads)) == ["a", "b", "c"]
    assert chooser.choose("least-loaded", cands, 1, loads) == "b"
    # A request served elsewhere than placed: its load moves there.
    assert loads.move("r", "b") and loads.tokens == {"b": 1000}
    assert loads.routed == {"a": 1}  # routed where it was placed
    assert not loads.move("nobody", "a")
    assert loads.end("r") == ("b", 1000) and loads.tokens == {}


@independent
def test_pending_prompts_against_a_brute_force_model():
    """Random prompts credited to random workers, confirmed, expired and forgotten: the
    depths found by bisection equal the longest run of a prompt's keys held by one live
    entry (computed by brute force), the table is empty once every entry is gone, and full
    tables drop their oldest entries."""
    import random

    from radixcache.service.pending import PendingBlocks, PendingTable

    rng = random.Random(5)
    trunks = [[rng.randrange(1 << 60) for _ in range(12)] for _ in range(3)]

    def prompt() -> list:
        # A chain key names its whole prefix: branches share the trunk's keys, then differ.
        trunk = rng.choice(trunks)
        cut = rng.randrange(0, len(trunk) + 1)
        return trunk[:cut] + [rng.randrange(1 << 60) for _ in range(rng.randrange(0, 4))]

    pending = PendingBlocks(ttl=10.0, max_entries=40)
    table = PendingTable()
    live: list = []  # (worker, keys, expires)
    now = 0.0
    for step in range(3000):
        now += rng.random() * 0.05
        action = rng.random()
        if action < 0.5:
            worker, keys = rng.randrange(4), prompt()
            if keys:
                pending.add(table, worker, keys, now)
                live.append((worker, keys, now + 10.0))
                live = live[-40:]  # the oldest go when the table is full
        elif action < 0.6 and live:
            worker, keys, _ = rng.choice(live)
            pending.confirm(table, worker, lambda key, last=keys[-1]: key == last)
            live = [e for e in live if not (e[0] == worker and e[1][-1] == keys[-1])]
        elif action < 0.65 and live:
            worker = rng.randrange(4)
            pending.forget(table, worker)
            live = [e for e in live if e[0] != worker]
        pending.expire(now)
        live = [e for e in live if e[2] > now]
        query = prompt()
        expected: dict = {}
        for worker, keys, _ in live:
            n = 0
            while n < min(len(keys), len(query)) and keys[n] == query[n]:
                n += 1
            if n:
                expected[worker] = max(expected.get(worker, 0), n)
        assert table.depths(query) == expected, step
        assert len(pending) == len(live)
    pending.expire(now + 11.0)
    assert len(pending) == 0 and not table and not table.entries
    assert pending.confirmed > 100 and pending.expired > 100

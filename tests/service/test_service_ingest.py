"""What ``radixcache serve`` ingests, as its own process: a late registration catches up
through the publisher's replay and a restarted publisher's old blocks go (vLLM's and
SGLang's own publishers); hostile batches change nothing but the counts; a silent
publisher leaves the answers and comes back; RFC #1527 event maps, a store's pool extending
every instance through the host and disk tiers as Mooncake's conductor counts it, and
``/query_by_hash`` over the standard XXH3-64 sequence hashes.

Where a test needs a publisher no engine class can be (one sending malformed batches, or
RFC #1527 maps, which Mooncake's store master sends from C++), it uses a raw ZeroMQ PUB
socket and says so.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
zmq = pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
xxhash = pytest.importorskip("xxhash")
msgspec = pytest.importorskip("msgspec")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))

from engine_publishers import (
    EnginePublisher,
    load_sglang_kv_events,
    load_vllm_kv_events,
    short_workdir,
)
from service_helpers import WAIT_S, Service, register_body, wait_until

from radixcache import RadixCache
from radixcache.events import BlockStored, ZmqEventPublisher, encode_batch


@pytest.fixture
def raw_pub():
    """Raw PUB sockets (the test's own publishers of batches no engine sends)."""
    ctx = zmq.Context()
    made = []

    class Raw:
        def __init__(self) -> None:
            self.sock = ctx.socket(zmq.PUB)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
            self.seq = 0
            made.append(self)

        def send(self, payload: bytes) -> None:
            self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    yield Raw
    for raw in made:
        raw.sock.close()
    ctx.term()


def gpu(svc: Service, tokens: list, instance: str, block_size: int = 2, **extra) -> int:
    answer = svc.post("/query", {"model": "m", "token_ids": tokens,
                                 "block_size": block_size, **extra}).json()
    return answer.get(extra.get("tenant_id", "default"), {}).get(instance, {}).get("GPU", 0)


@pytest.fixture(params=["vllm", "sglang"])
def engine(request):
    if request.param == "vllm":
        if sys.version_info < (3, 10):
            pytest.skip("vLLM's kv_events.py needs Python >= 3.10")
        try:
            module = load_vllm_kv_events()
        except FileNotFoundError as exc:
            if os.environ.get("RADIXCACHE_REQUIRE_VLLM_SCHEMA") == "1":
                pytest.fail(str(exc))
            pytest.skip(str(exc))
    else:
        try:
            module = load_sglang_kv_events()
        except Exception as exc:
            if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
                raise
            pytest.skip(f"SGLang 0.5.23 is not importable: {exc}")
    workdir = short_workdir()
    made = []

    def make(**kwargs):
        made.append(EnginePublisher(request.param, module, workdir, **kwargs))
        return made[-1]

    yield make
    for pub in made:
        pub.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)


def test_a_late_registration_catches_up_and_a_restart_is_seen(service, engine):
    svc = service()
    pub = engine()
    for i in range(10):  # published before the service hears of the publisher
        pub.publish(i)
    pub.wait_sent()
    kind = "vLLM" if pub.engine == "vllm" else "SGLang"
    assert svc.post("/register", register_body("e", pub.endpoint, pub.replay_endpoint,
                                               kind=kind)).status_code == 200
    wait_until(lambda: all(gpu(svc, [i, i + 1], "e") == 2 for i in range(10)),
               "the replayed batches")
    pub.shutdown()
    again = engine(endpoints=(pub.endpoint, pub.replay_endpoint))  # the engine restarted
    # Its first batches may go out before the subscription reconnects: a later one shows the
    # restart, and replay brings the first ones back.
    sent = []
    wait_until(lambda: (sent.append(again.publish(100 + len(sent))),
                        gpu(svc, [100, 101], "e") == 2)[1], "the new publisher's batches")
    again.wait_sent()
    wait_until(lambda: all(gpu(svc, [100 + i, 101 + i], "e") == 2 for i in range(len(sent))),
               "every batch of the new publisher")
    assert all(gpu(svc, [i, i + 1], "e") == 0 for i in range(10))  # the old blocks went
    worker, = svc.client.get("/workers").json()
    assert worker["restarts"] == 1 and worker["blocks"]["GPU"] == len(sent)


def test_hostile_batches_change_nothing_but_the_counts(service, raw_pub):
    """Malformed payloads, a msgpack bomb, events of another block size, a deep nest, on an
    engine registration and on an RFC #1527 one: counted, nothing indexed, the service and
    its subscriptions go on."""
    svc = service()
    pubs = {"vLLM": raw_pub(), "Mooncake": raw_pub()}
    for kind, pub in pubs.items():
        assert svc.post("/register", register_body(kind, pub.endpoint, kind=kind)
                        ).status_code == 200
    good = encode_batch([BlockStored((1,), None, (7, 8), 2)])
    wait_until(lambda: (pubs["vLLM"].send(good), gpu(svc, [7, 8], "vLLM") == 2)[1],
               "the engine subscription")

    def workers() -> dict:
        return {w["instance_id"]: w for w in svc.client.get("/workers").json()}

    empty = msgspec.msgpack.encode([0.0, [], 0])  # an RFC #1527 batch of no event
    wait_until(lambda: (pubs["Mooncake"].send(empty), workers()["Mooncake"]["batches"])[1],
               "the RFC #1527 subscription")
    before = workers()
    hostile = [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode([1, 2, 3]),
               msgspec.msgpack.encode([0.0, "events", 0]), b"\x91" * 100_000,
               msgspec.msgpack.encode([0.0, [[1] * 10] * 1000, 0]),
               encode_batch([BlockStored((2,), None, (9, 9, 9), 3)]),  # another block size
               encode_batch([BlockStored((3,), 12345, (5, 5), 2)]),  # an unknown parent
               msgspec.msgpack.encode([0.0, [{"event_type": "stored", "seq_hashes": ["x"],
                                              "medium": "cpu"}], 0]),
               msgspec.msgpack.encode([0.0, [{"event_type": "stored", "seq_hashes": [1.5],
                                              "medium": "cpu"}], 0]),
               msgspec.msgpack.encode([0.0, [{"event_type": "stored", "seq_hashes": [5],
                                              "medium": "tape"}], 0])]
    for payload in hostile:
        for pub in pubs.values():
            pub.send(payload)
    marker = encode_batch([BlockStored((4,), None, (70, 80), 2)])
    wait_until(lambda: (pubs["vLLM"].send(marker), gpu(svc, [70, 80], "vLLM") == 2)[1],
               "the batches after the hostile ones")
    wait_until(lambda: workers()["Mooncake"]["batches"] >= before["Mooncake"]["batches"]
               + len(hostile), "the RFC #1527 subscription's hostile batches")
    after = workers()
    assert after["vLLM"]["blocks"]["GPU"] == before["vLLM"]["blocks"]["GPU"] + 1 == 2
    assert after["vLLM"]["malformed"] >= 7 and after["Mooncake"]["malformed"] >= 7
    assert after["Mooncake"]["blocks"] == {"GPU": 0, "CPU": 0, "DISK": 0}
    assert svc.client.get("/ready").json() == {"ready": True, "problems": []}


def test_a_silent_publisher_leaves_the_answers_and_comes_back(service):
    """An idle publisher stays in the answers (it answers the subscription's probes of its
    replay socket); one that stops answering leaves them within --instance-timeout, and comes
    back when it is heard from again (restarted on the same endpoints: its old blocks
    dropped, its new ones indexed)."""
    svc = service("--instance-timeout", "1")
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    endpoints = (pub.endpoint, pub.replay_endpoint)
    try:
        cache = RadixCache(page_size=2, enable_events=True, array_type="numpy")
        assert svc.post("/register", register_body("q", *endpoints)).status_code == 200
        cache.insert([1, 2, 3, 4])
        pub.publish(cache.take_events())
        wait_until(lambda: gpu(svc, [1, 2, 3, 4], "q") == 4, "the first batch")
        time.sleep(2.5)  # idle, alive: still answered for
        assert gpu(svc, [1, 2, 3, 4], "q") == 4
        pub.close()
        wait_until(lambda: svc.post("/query", {"model": "m", "token_ids": [1, 2],
                                               "block_size": 2}).json() == {},
                   "the silent instance to leave", timeout=10)
        pub = ZmqEventPublisher(*endpoints)  # restarted: it answers the probes again
        wait_until(lambda: "q" in svc.post("/query", {"model": "m", "token_ids": [1, 2],
                                                      "block_size": 2}).json().get(
                                                          "default", {}),
                   "the instance back", timeout=10)
        cache = RadixCache(page_size=2, enable_events=True, array_type="numpy")
        cache.insert([5, 6])
        pub.publish(cache.take_events())
        wait_until(lambda: gpu(svc, [5, 6], "q") == 2, "its first batch")
        assert gpu(svc, [1, 2, 3, 4], "q") == 0  # a restarted publisher: its old blocks gone
    finally:
        pub.close()


def test_an_instance_is_live_once_its_first_replay_has_ended(service, raw_pub):
    """Part way through the subscription's first replay the publisher has answered, but the
    index holds only part of what it has: the instance is not live (answered for, picked)
    until the answer ends. The test's own ROUTER plays the publisher's replay socket: no
    engine's publisher can be held part way through an answer."""
    svc = service("--instance-timeout", "30")
    pub = raw_pub()
    ctx = zmq.Context()
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay_endpoint = f"tcp://127.0.0.1:{replay.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        assert svc.post("/register", register_body("r", pub.endpoint,
                                                   replay_endpoint)).status_code == 200
        assert replay.poll(int(WAIT_S * 1000)), "the subscription never asked for a replay"
        identity, _, start = replay.recv_multipart()
        assert int.from_bytes(start, "big", signed=True) == 0
        batches = [encode_batch([BlockStored([10 * i + 1], None, [10 * i, 10 * i + 1], 2)])
                   for i in range(3)]
        for seq, payload in enumerate(batches[:2]):  # the answer's first two batches
            replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        wait_until(lambda: svc.client.get("/workers").json()[0]["replayed"] == 2,
                   "the first two batches")
        time.sleep(0.3)  # what the ingest thread does with them meanwhile
        worker, = svc.client.get("/workers").json()
        assert worker["blocks"]["GPU"] == 2 and not worker["live"]
        assert gpu(svc, [0, 1], "r") == 0
        replay.send_multipart([identity, b"", (2).to_bytes(8, "big"), batches[2]])
        replay.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])
        wait_until(lambda: gpu(svc, [20, 21], "r") == 2, "the instance once caught up")
        assert svc.client.get("/workers").json()[0]["live"]
    finally:
        replay.close()
        ctx.term()


def standard_seqs(tokens: list, block_size: int, seed: int = 1337) -> list:
    """The document's hashes, written out here: XXH3-64 of each block's u32 tokens, rolled."""
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=seed)
        out.append(local if not out else xxhash.xxh3_64_intdigest(
            struct.pack("<QQ", out[-1], local), seed=seed))
    return out


def rfc_batch(*events: dict) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def test_a_stores_pool_extends_every_instance_through_its_tiers(service, raw_pub):
    """Mooncake's store master (a raw socket sending its RFC #1527 maps: one event per
    object, no token ids) holds blocks on the host and disk; an engine instance holds a
    device prefix. Each instance's cursor walks its device run, then the pool's host, then
    its disk blocks; the pool is no instance of its own; ``/query_by_hash`` reads the pool
    by the standard sequence hashes."""
    svc = service()
    tokens = list(range(100, 112))  # six blocks of 2
    seqs = standard_seqs(tokens, 2)
    store = raw_pub()
    assert svc.post("/register", register_body("store", store.endpoint, kind="Mooncake")
                    ).status_code == 200
    engine_pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        cache = RadixCache(page_size=2, enable_events=True, array_type="numpy")
        for name in ("a", "b"):
            body = register_body(name, engine_pub.endpoint if name == "a" else
                                 "tcp://127.0.0.1:9", engine_pub.replay_endpoint
                                 if name == "a" else None)
            assert svc.post("/register", body).status_code == 200
        cache.insert(tokens[:4])  # a: the first two blocks on the device
        engine_pub.publish(cache.take_events())
        wait_until(lambda: gpu(svc, tokens, "a") == 4, "a's device blocks")

        def envelope(kind: str, hashes: list, medium: str) -> dict:
            return {"event_id": 1, "timestamp": 0, "event_type": kind, "model_name": None,
                    "block_size": None, "additional_salt": None, "lora_name": None,
                    "tenant_id": "default", "backend_id": "daemon-0", "medium": medium,
                    "dp_rank": 0, "seq_hashes": hashes, "base_block_idx": 0,
                    "parent_hash": None, "token_ids": None, "object_key": "k",
                    "type": "BlockStored", "block_hashes": hashes}

        batch = rfc_batch(*[envelope("stored", [h], "cpu") for h in seqs[2:4]],
                          envelope("stored", [seqs[4]], "disk"))

        def query() -> dict:
            return svc.post("/query", {"model": "m", "token_ids": tokens,
                                       "block_size": 2}).json()["default"]

        wait_until(lambda: (store.send(batch), query()["a"]["CPU"] == 8)[1],
                   "the pool's blocks")
        assert query() == {
            "a": {"longest_matched": 10, "GPU": 4, "DP": {"0": 4}, "CPU": 8, "DISK": 10},
            "b": {"longest_matched": 0, "GPU": 0, "DP": {"0": 0}, "CPU": 0, "DISK": 0}}
        by_hash = svc.post("/query_by_hash", {"model": "m", "seq_hashes": seqs,
                                              "block_size": 2}).json()["default"]
        assert by_hash["b"] == {"longest_matched": 0, "GPU": 0, "DP": {"0": 0}, "CPU": 0,
                                "DISK": 0}
        # The pool's host blocks from the first: every instance reads them, b too.
        store.send(rfc_batch(*[envelope("stored", [h], "cpu") for h in seqs[:2]]))
        wait_until(lambda: query()["b"]["CPU"] == 8, "the pool's first blocks")
        assert query()["b"] == {"longest_matched": 10, "GPU": 0, "DP": {"0": 0}, "CPU": 8,
                                "DISK": 10}
        by_hash = svc.post("/query_by_hash", {"model": "m", "seq_hashes": seqs,
                                              "block_size": 2}).json()["default"]
        assert by_hash["b"] == query()["b"]  # the pool, by hash as by tokens
        # Dynamo's by-hash query sends local hashes: rolled into the same sequence hashes.
        locals_ = [xxhash.xxh3_64_intdigest(struct.pack("<2I", *tokens[i:i + 2]), seed=1337)
                   for i in range(0, 12, 2)]
        signed = [h - (1 << 64) if h >= 1 << 63 else h for h in locals_]
        dynamo = svc.post("/query_by_hash", {"model_name": "m", "block_hashes": signed}).json()
        assert dynamo["instances"]["b"]["cpu"] == 8
        store.send(rfc_batch(envelope("removed", [seqs[2]], "cpu")))
        wait_until(lambda: query()["a"]["CPU"] == 4, "the removal")
        store.send(rfc_batch({"event_type": "cleared", "tenant_id": "default",
                              "backend_id": "daemon-0"}))
        wait_until(lambda: query()["b"]["CPU"] == 0, "the clear")
        # An RFC #1527 engine sends token ids: its blocks are indexed by them, on its device.
        rfc_engine = raw_pub()
        assert svc.post("/register", register_body("c", rfc_engine.endpoint, kind="Mooncake")
                        ).status_code == 200
        stored = dict(envelope("stored", seqs[:3], "gpu"), token_ids=tokens[:6])
        wait_until(lambda: (rfc_engine.send(rfc_batch(stored)), query().get("c", {}).get(
            "GPU") == 6)[1], "the RFC engine's blocks")
        assert "store" not in query()  # a pool is no instance
    finally:
        engine_pub.close()

"""Replicas of ``radixcache serve`` on one real ``redis-server`` (``--index redis://...``):
a registration made on one reaches the other, both answer alike, a replica killed with
SIGKILL and started again resumes from the store without losing or double-counting a batch,
and while the store is down the replicas answer cache-blind and ``/ready`` says so.
"""

from __future__ import annotations

import signal
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("xxhash")
pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))

from service_helpers import Service, register_body, wait_until
from test_redis_index import RedisServer

from radixcache import RadixCache
from radixcache.events import ZmqEventPublisher
from radixcache.router import KvIndexer

PROMPTS = [list(range(1, 41)), list(range(1, 21)) + list(range(500, 520)),
           list(range(900, 940))]


def answers(svc: Service) -> list:
    return [svc.post("/query", {"model": "m", "token_ids": p, "block_size": 4}).json()
            for p in PROMPTS]


def expected(reference: KvIndexer) -> list:
    return [{"default": {"w": {"longest_matched": reference.overlap(p).get("w", 0) * 4,
                               "GPU": reference.overlap(p).get("w", 0) * 4,
                               "DP": {"0": reference.overlap(p).get("w", 0) * 4},
                               "CPU": reference.overlap(p).get("w", 0) * 4,
                               "DISK": reference.overlap(p).get("w", 0) * 4}}}
            for p in PROMPTS]


def test_replicas_answer_alike_resume_after_sigkill_and_go_blind_without_the_store(tmp_path):
    redis_server = RedisServer(tmp_path)
    namespace = "t" + uuid.uuid4().hex[:10]
    replicas = {}
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")

    def start(name: str) -> Service:
        replicas[name] = Service("--index", redis_server.url, "--namespace", namespace,
                                 "--owner", name, "--lease", "3")
        return replicas[name]

    try:
        a, b = start("a"), start("b")
        cache = RadixCache(page_size=4, enable_events=True, array_type="numpy")
        reference = KvIndexer(4)

        def step(tokens: list, evict: int = 0) -> None:
            cache.insert(tokens)
            if evict:
                cache.evict(evict)
            events = cache.take_events()
            reference.apply("w", events)
            pub.publish(events)
            assert pub.flush(10)

        assert a.post("/register", register_body("w", pub.endpoint, pub.replay_endpoint,
                                                 block_size=4)).status_code == 200
        wait_until(lambda: [w["instance_id"] for w in b.client.get("/workers").json()] == ["w"],
                   "the registration to reach the other replica")
        step(PROMPTS[0])
        step(PROMPTS[1], evict=8)
        wait_until(lambda: answers(a) == answers(b) == expected(reference), "both replicas")
        # A replica killed mid-stream, and batches meanwhile: restarted with its owner token,
        # it takes its publishers back and resumes from the sequence the store recorded.
        a.stop(signal.SIGKILL)
        step(PROMPTS[2])
        step(PROMPTS[0] + [7, 7, 7, 7], evict=12)
        a = start("a")
        wait_until(lambda: answers(a) == answers(b) == expected(reference),
                   "the restarted replica to resume")
        held = {w["instance_id"]: w["blocks"]["GPU"] for w in a.client.get("/workers").json()}
        assert held == {"w": reference.blocks_held("w", "GPU")}  # nothing counted twice
        # The store down: answers go cache-blind (zeros), /ready says why; back with it.
        redis_server.kill()
        blind = {"default": {"w": {"longest_matched": 0, "GPU": 0, "DP": {"0": 0}, "CPU": 0,
                                   "DISK": 0}}}
        for svc in (a, b):
            wait_until(lambda svc=svc: svc.client.get("/ready").status_code == 503,
                       "/ready to see the store down")
            assert "store" in " ".join(svc.client.get("/ready").json()["problems"])
            assert answers(svc) == [blind] * len(PROMPTS)
            assert svc.alive()
        redis_server.start()
        for svc in (a, b):
            wait_until(lambda svc=svc: svc.client.get("/ready").status_code == 200,
                       "/ready with the store back")
        step(list(range(2000, 2016)))  # the next batch: the owner writes again
        wait_until(lambda: answers(a) == answers(b) == expected(reference),
                   "the answers with the store back")
    finally:
        pub.close()
        for svc in replicas.values():
            svc.stop()
        redis_server.stop()

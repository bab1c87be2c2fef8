"""Where requests go, over HTTP against ``radixcache serve`` as its own process: the serving
addresses registrations carry (what the Endpoint Picker answers with), and the prompts a
placement credits its instance with until the instance's events show them, which ranking
counts and ``/query`` never does."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from service_helpers import register_body, wait_until

from radixcache import RadixCache
from radixcache.events import ZmqEventPublisher

PROMPT = list(range(1, 17))  # eight blocks of 2


@pytest.fixture
def publishers():
    made = []

    def make():
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


def metric(svc, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(svc.client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_serving_addresses_are_registered_checked_and_listed(service, publishers):
    a, b, c = publishers(), publishers(), publishers()
    svc = service("--publisher", f"a={a.endpoint},replay={a.replay_endpoint},model=m,"
                  "block_size=2,address=127.0.0.1:8001")
    workers = {w["instance_id"]: w for w in svc.client.get("/workers").json()}
    assert workers["a"]["address"] == "127.0.0.1:8001"
    # Mooncake's body and Dynamo's take it as an optional field; clients that send none work
    # as before.
    ok = svc.post("/register", register_body("b", b.endpoint, address="[::1]:8002"))
    assert ok.status_code == 200
    dynamo = svc.post("/register", {"instance_id": 7, "endpoint": c.endpoint,
                                    "model_name": "m", "block_size": 2,
                                    "address": "10.0.0.7:80"})
    assert dynamo.status_code == 201
    plain = publishers()
    assert svc.post("/register", register_body("d", plain.endpoint)).status_code == 200
    assert {w["instance_id"]: w["address"] for w in svc.client.get("/workers").json()} == {
        "a": "127.0.0.1:8001", "b": "[::1]:8002", 7: "10.0.0.7:80", "d": None}
    before = svc.client.get("/workers").json()
    other = publishers()
    for body, field in (
            (register_body("e", other.endpoint, address="127.0.0.1:8001"), "address"),  # a's
            (register_body("a", other.endpoint, dp_rank=1, address="127.0.0.1:9"),
             "address"),  # a's other rank elsewhere
            (register_body("e", other.endpoint, address="nowhere"), "address"),
            (register_body("e", other.endpoint, address="::1:80"), "address"),
            (register_body("e", other.endpoint, address="1.2.3.4:0"), "address"),
            (register_body("e", other.endpoint, address=5), "address")):
        refused = svc.post("/register", body)
        assert refused.status_code in (400, 409), (body, refused.text)
        assert refused.json()["field"] == field, refused.json()
    assert svc.client.get("/workers").json() == before  # nothing changed
    # Another rank of a at a's address is fine.
    rank = svc.post("/register", register_body("a", other.endpoint, dp_rank=1,
                                               address="127.0.0.1:8001"))
    assert rank.status_code == 200
    # Once no registration uses it, an address is free again.
    assert svc.post("/unregister", {"instance_id": "b"}).status_code == 200
    again = publishers()
    assert svc.post("/register", register_body("f", again.endpoint, address="[::1]:8002")
                    ).status_code == 200


def test_placements_count_in_ranking_until_events_confirm_them(service, publishers):
    """A placement credits its instance with the prompt: the next ranking prefers it (here
    over an idle instance, despite the placed request's load), ``/query`` still answers
    what the events said (nothing). The instance's events for the prompt confirm the credit
    and end it: once they are evicted again, the instance holds nothing and loses. Without
    crediting (``--pending-ttl 0``), or once the time to live has passed, the idle instance
    wins."""
    pub_a, pub_b = publishers(), publishers()
    cache_a = RadixCache(page_size=2, enable_events=True, array_type="numpy")
    svc = service("--pending-ttl", "60")
    for name, pub in (("a", pub_a), ("b", pub_b)):
        assert svc.post("/register", register_body(name, pub.endpoint, pub.replay_endpoint)
                        ).status_code == 200
    prompt = {"model": "m", "token_ids": PROMPT, "block_size": 2}
    placed = svc.post("/select", {**prompt, "request_id": "r1"}).json()
    assert placed["instance_id"] == "a" and placed["overlap_tokens"] == 0
    assert placed["load"] == 16
    longer = {**prompt, "token_ids": PROMPT + [99, 98]}
    ranked = svc.post("/select", longer).json()
    assert ranked["instance_id"] == "a"  # credited 16 tokens, loaded 16 (weighing 1.6)
    assert ranked["overlap_tokens"] == 0 and ranked["cached_tokens"] == 16
    exact = svc.post("/query", longer).json()["default"]
    assert (exact["a"]["GPU"], exact["a"]["longest_matched"], exact["b"]["GPU"]) == (0, 0, 0)
    assert metric(svc, "radixcache_serve_pending_prompts") == 1
    # a's events show the prompt: the credit is confirmed and ends.
    cache_a.insert(PROMPT)
    pub_a.publish(cache_a.take_events())
    wait_until(lambda: svc.post("/query", prompt).json()["default"]["a"]["GPU"] == 16,
               "a's events")
    wait_until(lambda: metric(svc, "radixcache_serve_pending_confirmed_total") == 1,
               "the confirmation")
    assert metric(svc, "radixcache_serve_pending_prompts") == 0
    # Evicted: a holds nothing, is loaded, and no credit is left to prefer it.
    cache_a.evict(100, lambda idx: None)
    pub_a.publish(cache_a.take_events())
    wait_until(lambda: svc.post("/query", prompt).json()["default"]["a"]["GPU"] == 0,
               "a's eviction")
    assert svc.post("/select", longer).json()["instance_id"] == "b"


@pytest.mark.parametrize("ttl", ["0", "0.5"])
def test_no_credit_without_a_time_to_live_or_past_it(service, publishers, ttl):
    pub_a, pub_b = publishers(), publishers()
    svc = service("--pending-ttl", ttl)
    for name, pub in (("a", pub_a), ("b", pub_b)):
        assert svc.post("/register", register_body(name, pub.endpoint, pub.replay_endpoint)
                        ).status_code == 200
    prompt = {"model": "m", "token_ids": PROMPT, "block_size": 2}
    assert svc.post("/select", {**prompt, "request_id": "r1"}).json()["instance_id"] == "a"
    if ttl != "0":
        assert svc.post("/select", prompt).json()["instance_id"] == "a"  # credited
        time.sleep(0.8)
    assert svc.post("/select", prompt).json()["instance_id"] == "b"  # only a's load counts

"""``radixcache serve`` over HTTP, as its own process, with a real client (httpx): Mooncake's
documented requests and answers field for field, Dynamo's dialect, the security rules
(bearer token, endpoint allow-list, body and token limits), a fuzz of hostile requests, the
metrics as Prometheus' own parser reads them, /select and /load, and SIGTERM.

Publishers here are radixcache's own ``ZmqEventPublisher`` (the engines' classes drive
test_service_ingest.py and test_service_differential.py): what these tests check is the
HTTP surface.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("xxhash")

from service_helpers import register_body, wait_until

from radixcache import RadixCache
from radixcache.events import ZmqEventPublisher

#: Mooncake's documented /register body (docs/source/api-reference/http/conductor-indexer.md),
#: its endpoints replaced by this machine's.
DOC_REGISTER = {"endpoint": "tcp://1.1.1.1:5557", "replay_endpoint": "tcp://1.1.1.1:5558",
                "type": "vLLM", "modelname": "deepseek", "lora_name": "sql-adapter",
                "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 128,
                "dp_rank": 0, "additionalsalt": "w8a8"}
DOC_UNREGISTER = {"type": "vLLM", "modelname": "deepseek", "lora_name": "sql-adapter",
                  "tenant_id": "default", "instance_id": "vllm-prefill-node1",
                  "block_size": 128, "dp_rank": 0}


@pytest.fixture
def publisher():
    made = []

    def make(page_size: int = 2):
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        cache = RadixCache(page_size=page_size, enable_events=True, array_type="numpy")
        made.append(pub)
        return pub, cache

    yield make
    for pub in made:
        pub.close()


def publish(pub, cache, tokens) -> None:
    cache.insert(list(tokens))
    pub.publish(cache.take_events())
    assert pub.flush(10)


def test_mooncake_documented_requests_and_answers(service, publisher):
    svc = service()
    pub, cache = publisher(page_size=128)
    tokens = list(range(1000, 1256))  # two blocks of 128
    publish(pub, cache, tokens)
    # The documented body as it is: its endpoint is no loopback address, so it is refused.
    refused = svc.post("/register", DOC_REGISTER)
    assert refused.status_code == 403 and refused.json()["field"] == "endpoint"
    body = dict(DOC_REGISTER, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
    r = svc.post("/register", body)
    assert r.status_code == 200
    assert r.json() == {"status": "registered successfully", "instance_id": "vllm-prefill-node1"}
    assert svc.post("/register", body).json() == r.json()  # the same again: no change
    query = {"model": "deepseek", "lora_name": "sql-adapter", "token_ids": tokens + [5],
             "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 128,
             "cache_salt": "w8a8"}
    # The registration's LoRA and salt name the blocks that name none (the cache's).
    answer = wait_until(lambda: svc.post("/query", query).json().get("default", {}).get(
        "vllm-prefill-node1", {}).get("GPU") == 256 and svc.post("/query", query).json(),
        "the blocks")
    assert answer == {"default": {"vllm-prefill-node1": {
        "longest_matched": 256, "GPU": 256, "DP": {"0": 256}, "CPU": 256, "DISK": 256}}}
    # Another LoRA, salt, tenant, model or block size never matches them.
    for change in ({"lora_name": "other"}, {"cache_salt": "fp8"}, {"lora_name": None},
                   {"cache_salt": None}):
        other = svc.post("/query", {**query, **change}).json()
        assert other["default"]["vllm-prefill-node1"]["longest_matched"] == 0, change
    for change, status, field in (({"tenant_id": "acme"}, 404, "instance_id"),
                                  ({"model": "llama"}, 404, "instance_id"),
                                  ({"block_size": 64}, 400, "block_size")):
        refused = svc.post("/query", {**query, **change})
        assert (refused.status_code, refused.json()["field"]) == (status, field), change
    anyone = {k: v for k, v in query.items() if k != "instance_id"}
    assert svc.post("/query", {**anyone, "tenant_id": "acme"}).json() == {}
    assert svc.post("/query", {**anyone, "model": "llama"}).json() == {}
    assert svc.post("/query", {**anyone, "block_size": 64}).status_code == 400
    seqs = {"model": "deepseek", "lora_name": "sql-adapter", "seq_hashes": [1234567890,
                                                                          9876543210],
            "tenant_id": "default", "instance_id": "vllm-prefill-node1", "block_size": 128,
            "cache_salt": "w8a8"}
    by_hash = svc.post("/query_by_hash", seqs)
    assert by_hash.status_code == 200
    assert set(by_hash.json()["default"]["vllm-prefill-node1"]) == {
        "longest_matched", "GPU", "DP", "CPU", "DISK"}
    older = dict(seqs)
    older["block_hash"] = older.pop("seq_hashes")  # the earlier drafts' name
    assert svc.post("/query_by_hash", older).json() == by_hash.json()
    r = svc.post("/unregister", DOC_UNREGISTER)
    assert r.status_code == 200
    assert r.json() == {"status": "unregistered successfully",
                        "removed_instances": ["vllm-prefill-node1|default|0"]}
    assert svc.post("/query", anyone).json() == {}
    assert svc.post("/query", query).status_code == 404  # the instance is gone
    gone = svc.post("/unregister", DOC_UNREGISTER)
    assert gone.status_code == 404 and gone.json()["field"] == "instance_id"


def test_data_parallel_ranks_of_one_instance_answer_together(service, publisher):
    """Two DP ranks of one instance, each with its own publisher and cache: one entry for the
    instance, ``DP`` per rank, ``GPU`` the best rank's; the same whether the query names the
    instance or not, and in either dialect."""
    svc = service()
    tokens = list(range(2000, 2008))  # four blocks of 2
    for rank, held in ((0, tokens), (1, tokens[:4])):
        pub, cache = publisher(page_size=2)
        publish(pub, cache, held)
        body = register_body("dp", pub.endpoint, pub.replay_endpoint, dp_rank=rank)
        assert svc.post("/register", body).status_code == 200
    query = {"model": "m", "token_ids": tokens + [9], "block_size": 2}
    want = {"default": {"dp": {"longest_matched": 8, "GPU": 8, "DP": {"0": 8, "1": 4},
                               "CPU": 8, "DISK": 8}}}
    answer = wait_until(lambda: (lambda got: got == want and got)(
        svc.post("/query", query).json()), "both ranks' blocks")
    assert answer == want
    assert svc.post("/query", {**query, "instance_id": "dp"}).json() == want
    # Dynamo's dialect answers only the instances with a hit: another way through the index.
    dynamo = svc.post("/query", {"token_ids": tokens + [9], "model_name": "m"}).json()
    assert dynamo == {"scores": {"dp": {"0": 8, "1": 4}}, "frequencies": [], "instances": {
        "dp": {"longest_matched": 8, "gpu": 8, "dp": {"0": 8, "1": 4}, "cpu": 8, "disk": 8}}}


def test_dynamo_dialect(service, publisher):
    svc = service()
    pub, cache = publisher(page_size=4)
    tokens = list(range(1, 13))
    publish(pub, cache, tokens)
    body = {"instance_id": 1001, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
            "model_name": "m", "block_size": 4}
    r = svc.post("/register", body)
    assert (r.status_code, r.json()) == (201, {"status": "ok"})
    again = svc.post("/register", body)
    assert again.status_code == 409 and "error" in again.json()
    missing = svc.post("/register", {"instance_id": 1002, "model_name": "m", "block_size": 4})
    assert missing.status_code == 422 and missing.json()["field"] == "endpoint"
    query = {"token_ids": tokens + [99], "model_name": "m"}
    answer = wait_until(lambda: (lambda a: a if a["scores"] else None)(
        svc.post("/query", query).json()), "the blocks")
    assert answer == {"scores": {"1001": {"0": 12}}, "frequencies": [], "instances": {
        "1001": {"longest_matched": 12, "gpu": 12, "dp": {"0": 12}, "cpu": 12, "disk": 12}}}
    # Both dialects read one index: Mooncake's query of the same scope.
    mooncake = svc.post("/query", {"model": "m", "token_ids": tokens, "block_size": 4}).json()
    assert mooncake["default"]["1001"]["GPU"] == 12
    unknown = svc.post("/query", {"token_ids": tokens, "model_name": "nope"})
    assert unknown.status_code == 404
    salted = svc.post("/query_by_hash", {"block_hashes": [1, 2], "model_name": "m",
                                         "cache_salt": "s"})
    assert salted.status_code == 400 and salted.json()["field"] == "cache_salt"
    workers = svc.client.get("/workers").json()
    assert [(w["instance_id"], w["blocks"]["GPU"]) for w in workers] == [(1001, 3)]
    r = svc.post("/unregister", {"instance_id": 1001, "model_name": "m"})
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert svc.post("/unregister", {"instance_id": 1001, "model_name": "m"}).status_code == 404
    assert svc.post("/query", query).status_code == 404  # no instance of the model left


def test_changes_need_the_token_and_endpoints_the_allow_list(service, publisher):
    svc = service("--allow-endpoint", "tcp://127.0.0.1:*", env={
        "RADIXCACHE_SERVE_TOKEN": "s3cret"})
    pub, _ = publisher()
    body = register_body("i", pub.endpoint, pub.replay_endpoint)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = svc.post("/register", body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
    assert svc.client.get("/workers").json() == []
    good = {"authorization": "Bearer s3cret"}
    assert svc.post("/register", body, headers=good).status_code == 200
    query = {"model": "m", "token_ids": [1, 2], "block_size": 2}
    assert svc.post("/query", query).status_code == 200  # reads need no token
    select = {"model": "m", "token_ids": [1, 2], "block_size": 2}
    assert svc.post("/select", select).status_code == 200  # nor a selection that counts none
    assert svc.post("/select", {**select, "request_id": "r"}).status_code == 401
    assert svc.post("/load", {"request_id": "r", "event": "end"}).status_code == 401
    assert svc.post("/unregister", {"instance_id": "i"}).status_code == 401
    for endpoint in ("tcp://10.1.2.3:5557", "tcp://127.0.0.1:1;10.1.2.3:80", "udp://127.0.0.1:1",
                     "tcp://127.0.0.1:*"):
        r = svc.post("/register", register_body("j", endpoint), headers=good)
        assert r.status_code == 403 and r.json()["field"] == "endpoint", endpoint
    r = svc.post("/register", register_body("j", "tcp://127.0.0.1:9", replay="tcp://10.0.0.1:1"),
                 headers=good)
    assert r.status_code == 403 and r.json()["field"] == "replay_endpoint"
    assert [w["instance_id"] for w in svc.client.get("/workers").json()] == ["i"]
    assert svc.post("/unregister", {"instance_id": "i"}, headers=good).status_code == 200


def test_limits(service):
    svc = service("--max-body", "4096", "--max-tokens", "100")
    too_big = svc.client.post("/query", content=b"x" * 5000,
                              headers={"content-type": "application/json"})
    assert too_big.status_code == 413
    many = svc.post("/query", {"model": "m", "token_ids": list(range(101)), "block_size": 2})
    assert many.status_code == 400 and many.json()["field"] == "token_ids"

    def chunks():  # no content-length: the body is counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    streamed = svc.client.post("/query", content=chunks())
    assert streamed.status_code == 413
    assert svc.client.get("/health").status_code == 200


#: Requests a fuzz draws from: bodies of every kind of wrong.
def hostile_bodies(rnd: random.Random) -> list:
    ok = {"model": "m", "token_ids": [1, 2, 3, 4], "block_size": 2}
    values = [None, True, -1, 0, 2**64, 2**70, -2**70, 1.5, "x", "", [], {}, [1, "a"], [-1],
              [2**32], [[1]], {"a": 1}, "\ud800", "\x00" * 10, 1e308]
    bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"model": "m"', b"[" * 10000,
              b'{"a":' * 5000, json.dumps(ok).encode() * 2, b"\x00" * 100]
    for _ in range(150):
        body = dict(ok)
        for _ in range(rnd.randrange(1, 4)):
            field = rnd.choice(["model", "model_name", "token_ids", "block_size", "tenant_id",
                                "instance_id", "lora_name", "lora_id", "cache_salt",
                                "seq_hashes", "block_hashes", "routing_group", "endpoint",
                                "type", "modelname", "dp_rank", "request_id", "event",
                                "policy", "output_tokens", "tokens"])
            body[field] = rnd.choice(values)
        if rnd.random() < 0.3:
            del body[rnd.choice(list(body))]
        bodies.append(json.dumps(body).encode())
    return bodies


def test_hostile_requests_get_4xx_and_change_nothing(service, publisher):
    """A fuzz of bodies, methods, paths and headers: never a 5xx, the index and the
    registrations unchanged, the service alive."""
    svc = service()
    pub, cache = publisher()
    publish(pub, cache, range(1, 9))
    assert svc.post("/register", register_body("i", pub.endpoint, pub.replay_endpoint)
                    ).status_code == 200
    query = {"model": "m", "token_ids": list(range(1, 9)), "block_size": 2}
    wait_until(lambda: svc.post("/query", query).json()["default"]["i"]["GPU"] == 8,
               "the blocks")
    before = (svc.post("/query", query).json(), svc.client.get("/workers").json())
    rnd = random.Random(41)
    paths = ["/register", "/unregister", "/query", "/query_by_hash", "/select", "/load",
             "/health", "/ready", "/metrics", "/workers", "/nope", "/query/", "//query"]
    started = time.monotonic()
    statuses = set()
    for body in hostile_bodies(rnd):
        path = rnd.choice(paths[:6])
        method = rnd.choice(["POST", "POST", "POST", "GET", "PUT", "DELETE"])
        headers = rnd.choice([{}, {"content-type": "text/plain"},
                              {"content-length": "abc"}, {"content-length": "-5"},
                              {"authorization": "Bearer x"}])
        try:
            r = svc.client.request(method, path, content=body, headers=headers)
        except Exception as exc:  # a client-side refusal (a bad header): not the service's
            assert "content-length" in str(exc).lower() or "header" in str(exc).lower(), exc
            continue
        statuses.add(r.status_code)
        assert r.status_code < 500, (method, path, body[:200], r.text)
        if r.status_code >= 400:
            assert "error" in r.json()
        assert time.monotonic() - started < 120
    for path in paths:
        assert svc.client.request("PATCH", path).status_code in (404, 405)
    assert svc.alive()
    assert (svc.post("/query", query).json(), svc.client.get("/workers").json()) == before
    assert statuses & {400, 422} and statuses & {404, 405}


def test_metrics_parse_and_move(service, publisher):
    from prometheus_client.parser import text_string_to_metric_families

    def metrics() -> dict:
        text = svc.client.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    svc = service()
    pub, cache = publisher()
    assert svc.post("/register", register_body("i", pub.endpoint, pub.replay_endpoint)
                    ).status_code == 200
    labels = (("dp_rank", "0"), ("instance_id", "i"), ("model", "m"), ("tenant", "default"))
    gpu_blocks = ("radixcache_serve_blocks", tuple(sorted(labels + (("medium", "GPU"),))))
    publish(pub, cache, range(1, 9))
    wait_until(lambda: metrics().get(("radixcache_serve_stored_blocks_total", labels)) == 4,
               "4 stored blocks counted")
    first = metrics()
    assert first[gpu_blocks] == 4
    assert first[("radixcache_serve_subscribed", labels)] == 1
    publish(pub, cache, range(100, 106))
    wait_until(lambda: metrics()[("radixcache_serve_stored_blocks_total", labels)] == 7,
               "7 stored blocks counted")
    second = metrics()
    assert second[("radixcache_serve_batches_total", labels)] > first[
        ("radixcache_serve_batches_total", labels)]
    assert second[("radixcache_serve_index_blocks", (("block_size", "2"), ("model", "m"),
                                                     ("tenant", "default")))] == 7
    for _ in range(3):
        svc.post("/query", {"model": "m", "token_ids": [1, 2, 3], "block_size": 2})
    svc.post("/select", {"model": "m", "token_ids": [1, 2, 3, 4], "block_size": 2})
    third = metrics()
    assert third[("radixcache_serve_request_seconds_count", (("endpoint", "/query"),))] == 3
    assert third[("radixcache_serve_selection_hit_tokens_sum", ())] == 4
    assert third[("process_resident_memory_bytes", ())] > 0


def test_select_and_load(service, publisher):
    svc = service()
    (pub_a, cache_a), (pub_b, _) = publisher(), publisher()
    publish(pub_a, cache_a, range(1, 17))
    for name, pub in (("a", pub_a), ("b", pub_b)):
        assert svc.post("/register", register_body(name, pub.endpoint, pub.replay_endpoint)
                        ).status_code == 200
    prompt = {"model": "m", "token_ids": list(range(1, 17)), "block_size": 2}
    wait_until(lambda: svc.post("/query", prompt).json()["default"]["a"]["GPU"] == 16, "a")
    chosen = svc.post("/select", {**prompt, "request_id": "r1", "output_tokens": 100}).json()
    assert chosen["instance_id"] == "a" and chosen["overlap_tokens"] == 16
    assert chosen["load"] == 116 and chosen["policy"] == "cache-aware"
    again = svc.post("/select", {**prompt, "request_id": "r1"})
    assert again.status_code == 409 and again.json()["field"] == "request_id"
    # Load on a outweighs its cache: 10 tokens of load weigh as one of prefill (0.1).
    start = svc.post("/load", {"request_id": "big", "event": "start", "instance_id": "a",
                               "tokens": 1000})
    assert start.json() == {"status": "ok", "instance_id": "a", "load": 1116}
    assert svc.post("/select", prompt).json()["instance_id"] == "b"
    assert svc.post("/select", {**prompt, "policy": "least-loaded"}).json()["instance_id"] == "b"
    end = svc.post("/load", {"request_id": "big", "event": "end"})
    assert end.json()["load"] == 116
    assert svc.post("/load", {"request_id": "big", "event": "end"}).status_code == 404
    assert svc.post("/load", {"request_id": "x", "event": "start", "instance_id": "zz"}
                    ).status_code == 404
    rr = [svc.post("/select", {**prompt, "policy": "round-robin"}).json()["instance_id"]
          for _ in range(4)]
    assert sorted(rr) == ["a", "a", "b", "b"]
    bad = svc.post("/select", {**prompt, "policy": "fastest"})
    assert bad.status_code == 400 and bad.json()["field"] == "policy"
    assert svc.post("/select", {**prompt, "model": "nope"}).status_code == 404


def test_sigterm_stops_cleanly_and_sigkill_leaves_no_listener(service, publisher):
    svc = service()
    pub, _ = publisher()
    assert svc.post("/register", register_body("i", pub.endpoint, pub.replay_endpoint)
                    ).status_code == 200
    assert svc.stop(signal.SIGTERM) == 0
    assert "Traceback" not in svc.output(), svc.output()


def test_static_publishers_from_flags_and_a_file(service, publisher, tmp_path):
    (pub_a, cache_a), (pub_b, cache_b) = publisher(), publisher()
    publish(pub_a, cache_a, range(1, 9))
    publish(pub_b, cache_b, range(1, 5))
    conductor = {"kvevent_instance": {"b": {
        "endpoint": pub_b.endpoint, "replay_endpoint": pub_b.replay_endpoint, "type": "vLLM",
        "modelname": "m", "instance_id": "b", "block_size": 2, "dp_rank": 0}}}
    path = tmp_path / "conductor_config.json"
    path.write_text(json.dumps(conductor))
    svc = service("--publisher", f"a={pub_a.endpoint},replay={pub_a.replay_endpoint},model=m",
                  "--block-size", "2", "--publishers-file", str(path))
    query = {"model": "m", "token_ids": list(range(1, 9)), "block_size": 2}
    wait_until(lambda: {i: h["GPU"] for i, h in svc.post("/query", query).json().get(
        "default", {}).items()} == {"a": 8, "b": 4}, "both static publishers' blocks")
    refused = svc.post("/register", register_body("a", pub_a.endpoint))  # taken: conflict
    assert refused.status_code == 409


@pytest.mark.parametrize("kind", ["MooncakeQuery", "DynamoQuery", "SelectRequest"])
def test_token_ids_read_fast_decode_as_the_plain_decoder(kind):
    """``decode_tokens`` (ids read by the block module) gives what ``decode`` gives for every
    body: the same fields and ids, or the same 4xx naming the same field."""
    from radixcache.service import api

    struct = getattr(api, kind)
    rnd = random.Random(5)
    base = {"model": "m", "model_name": "m", "block_size": 2}
    id_lists = [[], [0], [1, 2, 3], [2**32 - 1, 7], [2**32], [2**40, 1], [-1], [1.0], [1.5],
                ["1"], [True], [None], "12", None, [[1]],
                [rnd.randrange(2**32) for _ in range(300)]]
    bodies = []
    for ids in id_lists:
        fields = dict(base, token_ids=ids)
        bodies.append(json.dumps(fields).encode())
        bodies.append(json.dumps(fields, indent=2).encode())
        bodies.append(json.dumps(fields, separators=(",", ":")).encode())
    bodies += [b'{"model":"m","model_name":"m","token_ids":[01]}', b'{"token_ids":[1,2]}',
               b'{"model":"m","model_name":"m","token_ids":[1,2],"block_size":"x"}',
               b'{"model":"m","model_name":"m","token_ids":[1 ,\n2 ]}', b"[1,2]", b"{",
               b'{"model":"m","model_name":"m","token_ids":[1,2]} x',
               # Where the ids are cut out of the body (``split_ids``): a key written twice,
               # nested, escaped, last, spaced, or as a string's text.
               b'{"model":"m","model_name":"m","token_ids":[3],"token_ids":[]}',
               b'{"model":"m","model_name":"m","token_ids":[1,2],"token_ids":[3]}',
               b'{"model":"m","model_name":"m","x":{"token_ids":[5]},"token\\u005fids":[]}',
               b'{"model":"m","model_name":"m","x":{"token_ids":[5]},"token_ids":[]}',
               b'{"model":"m","model_name":"m","x":{"token_ids":[5]}}',
               b'{"model":"m","model_name":"m","x":["token_ids"],"token_ids":[6]}',
               b'{"model":"m","model_name":"m","block_size":2,"token_ids":[4,5]}',
               b'{"model":"m","model_name":"m","token_ids" :\n[ 1 , 2 ] }',
               b'{"model":"m","model_name":"m","token_ids":[1],"x":"\\"token_ids\\":[2]"}',
               b'{"model":"m","model_name":"m","token_ids":[1,[2]]}',
               b'{"model":"m","model_name":"m","token_ids":[1,2]',
               b'{"model":"m","token_ids":[1,2],"x":{"model_name":"m"}}']
    for body in bodies:
        split = api.split_ids(body)
        if split is not None:  # what is cut out holds no key: the dialect is the same
            assert api.is_dynamo(split[0]) == api.is_dynamo(body), body
        try:
            plain = api.decode(body, struct)
        except api.BadRequest as exc:
            with pytest.raises(api.BadRequest) as fast:
                api.decode_tokens(body, struct)
            assert (str(fast.value), fast.value.field, fast.value.status) == (
                str(exc), exc.field, exc.status), body
            continue
        fast = api.decode_tokens(body, struct)
        for name in struct.__struct_fields__:
            mine, theirs = getattr(fast, name), getattr(plain, name)
            if name == "token_ids":
                mine, theirs = [int(i) for i in mine], [int(i) for i in theirs]
            assert mine == theirs, (body, name)

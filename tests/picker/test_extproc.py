"""The picker's gRPC side, with a real gRPC client against the picker as its own process.

The engines are stood in for by their event publishers only (``ZmqEventPublisher`` in this
process, fed by a ``RadixCache``): these tests send ext_proc messages as Envoy would and read
the answers, so they reach what Envoy's configuration cannot easily make happen (the subset
hint, a stream held open, a shed request) and check the exact messages of each mode.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
from epp_support import EPP_MODULES, require

PAGE = 4
MODEL = "m"


@pytest.fixture
def picker_env(model_dir, tmp_path):
    """Three endpoints (their publishers made by ``publish``), a picker process over them,
    and a gRPC channel to it."""
    require(EPP_MODULES)
    import grpc
    from harness import free_port, start_picker

    from radixcache import RadixCache
    from radixcache.events import ZmqEventPublisher

    class Endpoint:
        def __init__(self, i):
            self.port = 8000 + i
            self.events = f"tcp://127.0.0.1:{free_port()}"
            self.replay = f"tcp://127.0.0.1:{free_port()}"
            self.publisher = None
            self.cache = RadixCache(page_size=PAGE, enable_events=True, array_type="numpy")

        address = property(lambda self: f"127.0.0.1:{self.port}")
        publisher_spec = property(lambda self: f"e{self.port}={self.events},replay={self.replay},"
                                               f"address={self.address}")

        def start(self):
            self.publisher = ZmqEventPublisher(self.events, self.replay)

        def insert(self, tokens):
            self.cache.insert(tokens)
            self.publisher.publish(self.cache.take_events())
            self.publisher.flush(5.0)

    endpoints = [Endpoint(i) for i in range(3)]
    logs = tmp_path / "logs"
    logs.mkdir()
    state = {"picker": None, "channel": None}

    def start(*extra, wait=True, static=3):
        picker = start_picker(endpoints[:static], model_dir, logs, page_size=PAGE,
                              extra=("--model", MODEL, *extra), wait=wait)
        state["picker"] = picker
        state["channel"] = grpc.insecure_channel(f"127.0.0.1:{picker.port}")
        return picker, state["channel"]

    try:
        yield endpoints, start
    finally:
        if state["channel"] is not None:
            state["channel"].close()
        if state["picker"] is not None:
            state["picker"].process.stop()
        for endpoint in endpoints:
            if endpoint.publisher is not None:
                endpoint.publisher.close(timeout=1.0)


def _pb():
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from google.protobuf import struct_pb2

    return base_pb2, ep, ep_grpc, struct_pb2


def request_messages(body: dict, *, mode: int = 4, subset=None, headers=None,
                     path="/v1/chat/completions"):
    """The messages Envoy sends for one request: headers (with the body mode and the subset
    hint), then the body."""
    base_pb2, ep, _, struct_pb2 = _pb()
    pairs = [(":path", path), (":method", "POST"), ("content-type", "application/json")]
    pairs += list((headers or {}).items())
    header_map = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                             for k, v in pairs])
    first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map),
                                 protocol_config=ep.ProtocolConfiguration(
                                     request_body_mode=mode))
    if subset is not None:
        metadata = struct_pb2.Struct()
        metadata.update({"x-gateway-destination-endpoint-subset": subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(metadata)
    data = json.dumps(body).encode()
    return [first, ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True))]


def chat(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


def exchange(channel, messages, then=None, hold=False):
    """Send ``messages`` on one stream and return the answers and the call; ``then`` (a
    list) is sent after the answers to ``messages`` came back; ``hold``: the stream stays
    open (as Envoy holds it while the request runs) until the call is cancelled."""
    _, ep, ep_grpc, _ = _pb()
    outgoing: queue.Queue = queue.Queue()
    for message in messages:
        outgoing.put(message)
    expected = 2 if messages[0].protocol_config.request_body_mode in (2, 4) else 1

    def requests():
        while True:
            item = outgoing.get()
            if item is None:
                return
            yield item

    call = ep_grpc.ExternalProcessorStub(channel).Process(requests(), timeout=20)
    answers = []
    for answer in call:
        answers.append(answer)
        kind = answer.WhichOneof("response")
        if kind == "immediate_response" or len(answers) == expected:
            break
    for message in then or ():
        outgoing.put(message)
        answers.append(next(call))
    if not hold:
        outgoing.put(None)
    return answers, call


def endpoints_of(answers) -> list:
    for answer in answers:
        common = getattr(answer, answer.WhichOneof("response")).response
        for option in common.header_mutation.set_headers:
            if option.header.key == "x-gateway-destination-endpoint":
                value = option.header.raw_value.decode()
                meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value
                assert meta.fields["x-gateway-destination-endpoint"].string_value == value
                return value.split(",")
    return []


def test_health_readiness_follows_the_endpoints(picker_env):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    endpoints, start = picker_env
    # No publisher is up yet.
    picker, channel = start("--instance-timeout", "30", "--no-api", wait=False)
    stub = health_pb2_grpc.HealthStub(channel)
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)

    def status(service):
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def live():
        import grpc

        try:
            return status("liveness") == serving
        except grpc.RpcError:  # not listening yet
            return False

    picker.process.wait_until(live, "liveness")
    for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert status(service) == not_serving
    # --no-api: the HTTP port serves the metrics and probes, not the index's API.
    http = _http(picker)
    assert http("POST", "/query", {"model": MODEL, "token_ids": [1], "block_size": PAGE}
                )[0] == 404
    assert http("GET", "/ready")[0] == 200 and http("GET", "/metrics")[0] == 200
    # A request now: no endpoint is eligible yet.
    answers, _ = exchange(channel, request_messages(chat("hello")))
    assert answers[0].immediate_response.status.code == 503
    for endpoint in endpoints:
        endpoint.start()
    picker.process.wait_until(lambda: status("readiness") == serving, "readiness")
    assert status("envoy.service.ext_proc.v3.ExternalProcessor") == serving
    assert picker.value("unavailable_total") == 1


def test_subset_hint_modes_served_endpoint_and_the_cached_worker_first(picker_env):
    endpoints, start = picker_env
    for endpoint in endpoints:
        endpoint.start()
    picker, channel = start("--instance-timeout", "60")  # every endpoint eligible throughout
    from radixcache.picker import ChatTokenizer

    tokenizer = ChatTokenizer.from_dir(str(picker.process.argv[picker.process.argv.index(
        "--tokenizer") + 1]))
    body = chat("the cache prefix token router worker " * 8)
    ids = tokenizer.chat_ids(tokenizer.prepare_messages(body["messages"]))
    endpoints[1].insert(ids)
    picker.process.wait_until(
        lambda: picker.value("endpoint_blocks", endpoint=endpoints[1].address) > 0, "events")
    # Full duplex: the headers' answer carries the endpoints, the body comes back unchanged.
    answers, _ = exchange(channel, request_messages(body))
    assert endpoints_of(answers)[0] == endpoints[1].address
    assert len(endpoints_of(answers)) == 3
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert json.loads(streamed.body) == body and streamed.end_of_stream
    # Buffered: the headers go on at once, the body's answer carries the endpoints.
    answers, _ = exchange(channel, request_messages(body, mode=2))
    assert answers[0].WhichOneof("response") == "request_headers"
    assert not answers[0].request_headers.response.header_mutation.set_headers
    assert answers[1].WhichOneof("response") == "request_body"
    assert endpoints_of(answers)[0] == endpoints[1].address
    # The subset: only its endpoints, as a list or as comma-separated text.
    allowed = [endpoints[0].address, endpoints[2].address]
    for subset in (allowed, ",".join(allowed)):
        answers, _ = exchange(channel, request_messages(body, subset=subset))
        assert sorted(endpoints_of(answers)) == sorted(allowed)
    for subset in ([], ["127.0.0.1:1"]):  # empty, or nothing eligible in it: 503
        answers, _ = exchange(channel, request_messages(body, subset=subset))
        assert answers[0].immediate_response.status.code == 503
        assert json.loads(answers[0].immediate_response.body)["error"]["code"] == \
            "no_endpoint"
    # The served endpoint, read from the response's metadata: a fallback is counted.
    _, ep, _, struct_pb2 = _pb()
    served = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    meta = struct_pb2.Struct()
    meta.update({"x-gateway-destination-endpoint-served": endpoints[2].address})
    served.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    answers, _ = exchange(channel, request_messages(body), then=[served])
    assert answers[2].WhichOneof("response") == "response_headers"
    picker.process.wait_until(lambda: picker.value("in_flight") == 0, "the stream's end")
    assert picker.value("fallbacks_total") == 1
    assert picker.value("served_total", endpoint=endpoints[2].address) == 1
    # A path the picker does not read: picked at its headers.
    answers, _ = exchange(channel, request_messages({}, path="/v1/models", mode=0))
    assert len(endpoints_of(answers)) == 3


def test_sheddable_requests_get_429_when_every_endpoint_is_saturated(picker_env):
    endpoints, start = picker_env
    for endpoint in endpoints:
        endpoint.start()
    # (Liveness is not what this tests: a long --instance-timeout keeps every idle endpoint
    # eligible however slowly a loaded machine answers the probes.)
    picker, channel = start("--shed-load", "1", "--sheddable", "batch",
                            "--instance-timeout", "60")
    only = [endpoints[0].address]
    objective = {"x-gateway-inference-objective": "batch"}
    # A request held open on the only allowed endpoint: it carries load.
    held, call = exchange(channel, request_messages(chat("first"), subset=only), hold=True)
    try:
        assert endpoints_of(held) == only
        answers, _ = exchange(channel, request_messages(chat("second"), subset=only,
                                                        headers=objective))
        assert answers[0].immediate_response.status.code == 429
        # Not sheddable: served all the same; sheddable but another endpoint is free: served.
        answers, _ = exchange(channel, request_messages(chat("third"), subset=only))
        assert endpoints_of(answers) == only
        answers, _ = exchange(channel, request_messages(chat("fourth"), headers=objective))
        assert len(endpoints_of(answers)) == 3
    finally:
        call.cancel()
    picker.process.wait_until(lambda: picker.value("in_flight") == 0, "the streams' end")
    answers, _ = exchange(channel, request_messages(chat("fifth"), subset=only,
                                                    headers=objective))
    assert endpoints_of(answers) == only  # the load went with the streams
    assert picker.value("shed_total") == 1
    deadline = time.monotonic() + 10
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # gRPC's request threads end with their streams


def _http(picker):
    """``call(method, path, body=None) -> (status, JSON or text)`` on the picker's HTTP
    port."""
    import http.client

    def call(method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", picker.http_port, timeout=10)
        try:
            conn.request(method, path, None if body is None else json.dumps(body).encode())
            response = conn.getresponse()
            data = response.read().decode()
        finally:
            conn.close()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data

    return call


def test_one_registry_for_the_api_and_the_picker(picker_env):
    """The picker picks among what ``/register`` added too; its placements count in the one
    load table ``/select`` reads; a pick credits the endpoint in ranking while ``/query``
    answers only what the events said; SIGTERM stops the process cleanly with a stream
    open."""
    endpoints, start = picker_env
    for endpoint in endpoints:
        endpoint.start()
    picker, channel = start(static=1)
    http = _http(picker)
    status, _ = http("POST", "/register", {
        "endpoint": endpoints[1].events, "replay_endpoint": endpoints[1].replay,
        "type": "vLLM", "modelname": MODEL, "instance_id": "late", "block_size": PAGE,
        "dp_rank": 0, "address": endpoints[1].address})
    assert status == 200
    picker.process.wait_until(
        lambda: picker.value("endpoint_eligible", endpoint=endpoints[1].address) == 1,
        "the registered endpoint to be heard from")
    body = chat("a conversation about the cache prefix token router " * 6)
    held, call = exchange(channel, request_messages(body), hold=True)
    try:
        first = endpoints_of(held)
        assert sorted(first) == sorted(e.address for e in endpoints[:2])  # both, not e[2]
        instance = {endpoints[0].address: "e8000", endpoints[1].address: "late"}
        # The held request's load is in the table /select reads.
        other = [i for a, i in instance.items() if a != first[0]][0]
        select = {"model": MODEL, "token_ids": [1, 2, 3, 4], "block_size": PAGE,
                  "policy": "least-loaded"}
        assert http("POST", "/select", select)[1]["instance_id"] == other
        # A follow-up now goes where the held one went (its prompt credited there), while
        # /query answers what the events said: nothing.
        follow = chat("a conversation about the cache prefix token router " * 6 + "more")
        again, _ = exchange(channel, request_messages(follow))
        assert endpoints_of(again)[0] == first[0]
        from radixcache.picker import ChatTokenizer

        tokenizer = ChatTokenizer.from_dir(str(picker.process.argv[picker.process.argv.index(
            "--tokenizer") + 1]))
        ids = tokenizer.chat_ids(tokenizer.prepare_messages(follow["messages"]))
        status, answer = http("POST", "/query", {"model": MODEL, "token_ids": ids,
                                                 "block_size": PAGE})
        assert status == 200
        assert {i: h["GPU"] for i, h in answer["default"].items()} == {"e8000": 0, "late": 0}
        # SIGTERM with the stream still open: a clean stop.
        picker.process.proc.terminate()
        assert picker.process.proc.wait(20) == 0, picker.process.tail()
    finally:
        call.cancel()

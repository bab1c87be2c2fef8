"""The fast front end (``/query`` and ``/query_by_hash`` answered from the HTTP parser's
callbacks, ``--http-frontend fast``, the default) against the ASGI application alone
(``--http-frontend asgi``): two services with the same publisher and the same flags get the
same raw bytes over loopback, and must answer byte for byte alike (less the ``date``
header), whatever the request: good and bad bodies, keep-alive, pipelining (fast and ASGI
requests mixed), bodies in pieces, chunked bodies, oversized bodies, ``Expect:
100-continue``, HTTP/1.0, malformed framing. Every read is bounded in time.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("uvicorn")
pytest.importorskip("httptools")
pytest.importorskip("prometheus_client")
pytest.importorskip("xxhash")

from service_helpers import register_body, wait_until

from radixcache import RadixCache
from radixcache.events import ZmqEventPublisher

FLAGS = ("--max-body", "4096", "--max-tokens", "64", "--hash-index")
QUERY = {"model": "m", "token_ids": list(range(1, 13)), "block_size": 2}
DYNAMO = {"model_name": "m", "token_ids": list(range(1, 13))}
#: The longest a test waits for a response: it only bounds a hang.
READ_S = 10.0


def request(path: str, body: bytes, *headers: str, method: str = "POST",
            version: str = "1.1", close: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1",
             *headers]
    if body and not any(h.lower().startswith(("content-length", "transfer-encoding"))
                        for h in headers):
        lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post(path: str, doc: object, *headers: str, close: bool = False) -> bytes:
    return request(path, json.dumps(doc).encode(), "Content-Type: application/json",
                   *headers, close=close)


def chunked(body: bytes, parts: int = 3) -> bytes:
    size = -(-len(body) // parts)
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def exchange(port: int, pieces: list, pause: float = 0.0) -> bytes:
    """Send ``pieces`` (``pause`` seconds apart) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_S) as sock:
        for i, piece in enumerate(pieces):
            if i and pause:
                time.sleep(pause)
            sock.sendall(piece)
        out = b""
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 16)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            out += data
        return out


def normalized(raw: bytes) -> bytes:
    """``raw`` without its ``date`` headers (the clock's, not the service's)."""
    return b"\r\n".join(line for line in raw.split(b"\r\n")
                        if not line.lower().startswith(b"date: "))


@pytest.fixture
def pair(service):
    """``(fast port, asgi port)``: two services on one publisher's blocks."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    cache = RadixCache(page_size=2, enable_events=True, array_type="numpy")
    try:
        fast, plain = service(*FLAGS), service(*FLAGS, "--http-frontend", "asgi")
        for svc in (fast, plain):
            assert svc.post("/register", register_body("i", pub.endpoint, pub.replay_endpoint)
                            ).status_code == 200
        cache.insert(list(range(1, 9)))
        pub.publish(cache.take_events())
        assert pub.flush(10)
        for svc in (fast, plain):
            wait_until(lambda svc=svc: svc.post("/query", QUERY).json()["default"]["i"]["GPU"]
                       == 8, "the blocks")
        yield fast.port, plain.port
    finally:
        pub.close()


def same(pair, pieces: list, pause: float = 0.0) -> bytes:
    fast, plain = (normalized(exchange(port, pieces, pause)) for port in pair)
    assert fast == plain
    return fast


def test_queries_good_and_bad_answer_alike(pair):
    cases = [QUERY, DYNAMO, dict(QUERY, tenant_id="other"), dict(QUERY, instance_id="i"),
             dict(QUERY, instance_id="nobody"), dict(QUERY, block_size=4),
             dict(QUERY, token_ids=list(range(65))), dict(QUERY, token_ids=[-1]),
             dict(QUERY, token_ids=[1, "a"]), dict(QUERY, lora_id=3), {"model": "m"},
             dict(DYNAMO, block_size=3), dict(DYNAMO, token_ids=[2 ** 32]), [], None,
             dict(QUERY, token_ids=list(range(1, 13)), model="m", cache_salt="s")]
    answers = set()
    for doc in cases:
        answers.add(same(pair, [post("/query", doc, close=True)]).split(b"\r\n")[0])
    for body in (b"", b"{", b"\xff", b'{"token_ids": [1, 2], "token_ids": [3]}',
                 b'{"model": "m", "token_ids": [01], "block_size": 2}'):
        answers.add(same(pair, [request("/query", body, close=True)]).split(b"\r\n")[0])
    by_hash = [{"model": "m", "block_size": 2, "seq_hashes": [1, 2, 3]},
               {"model": "m", "block_size": 2, "seq_hashes": [2 ** 64]},
               {"model": "m", "block_size": 2}, {"model_name": "m", "block_hashes": [5]},
               {"model_name": "m", "block_hashes": [5], "cache_salt": "x"}]
    for doc in by_hash:
        answers.add(same(pair, [post("/query_by_hash", doc, close=True)]).split(b"\r\n")[0])
    assert {b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 404 Not Found",
            b"HTTP/1.1 422 Unprocessable Entity"} <= answers


def test_framing_keep_alive_and_pipelining_answer_alike(pair):
    one = post("/query", QUERY)
    dynamo = post("/query", DYNAMO)
    last = post("/query", QUERY, close=True)
    out = same(pair, [one + dynamo + request("/health", b"", method="GET") + one
                      + post("/workers", {}) + request("/query", b"{") + last])
    assert out.count(b"HTTP/1.1 ") == 7 and out.count(b"connection: close") == 1
    # One request in many writes, a pipeline cut mid-request.
    whole = one + one + last
    same(pair, [whole[i:i + 7] for i in range(0, len(whole), 7)], pause=0.002)
    same(pair, [one[:40], one[40:] + one[:len(one) - 3], one[len(one) - 3:] + last],
         pause=0.05)
    # Chunked, without a length, with two lengths, oversized, not a length, HTTP/1.0, a
    # query string, other methods, Expect: 100-continue: the ASGI route's answers.
    body = json.dumps(QUERY).encode()
    for raw in (request("/query", chunked(body), "Transfer-Encoding: chunked", close=True),
                request("/query", chunked(b" " * 5000), "Transfer-Encoding: chunked",
                        close=True),
                request("/query", b"", close=True),
                request("/query", body, f"Content-Length: {len(body)}",
                        f"Content-Length: {len(body)}", close=True),
                request("/query", b"x" * 5000, close=True),
                request("/query", body, "Content-Length: 1e3", close=True),
                request("/query", body, "Content-Length: -5", close=True),
                request("/query", body, version="1.0"),
                request("/query?x=1", body, close=True),
                request("/qu%65ry", body, close=True),
                request("/query", body, method="PUT", close=True),
                request("/query", b"", method="HEAD", close=True),
                request("/query", b"", method="GET", close=True)):
        status = same(pair, [raw]).split(b"\r\n")[0]
        assert status.startswith(b"HTTP/1.1 "), raw[:80]
    expect = request("/query", b"", "Expect: 100-continue",
                     f"Content-Length: {len(body)}", close=True)
    out = same(pair, [expect, body], pause=0.2)
    assert out.startswith(b"HTTP/1.1 100 Continue") and b"200 OK" in out


def test_metrics_count_both_front_ends_alike(pair):
    import httpx

    def counts(port: int) -> dict:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=READ_S).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("radixcache_serve_request_seconds_count")}

    moved = []
    for port in pair:
        before = counts(port)
        exchange(port, [post("/query", QUERY) * 3 + post("/query", {"model": "m"})
                        + post("/query_by_hash", {"model": "m", "block_size": 2,
                                                  "seq_hashes": [1]}, close=True)])
        after = counts(port)
        moved.append({k: v - before.get(k, 0) for k, v in after.items()})
    fast, plain = moved
    assert fast == plain
    # A refused request is not counted.
    assert fast['radixcache_serve_request_seconds_count{endpoint="/query"}'] == 3
    assert fast['radixcache_serve_request_seconds_count{endpoint="/query_by_hash"}'] == 1


def test_protocol_class_serves_only_plain_fast_routes():
    from radixcache.service.app import make_app
    from radixcache.service.config import ServiceConfig
    from radixcache.service.frontend import FAST_PATHS, protocol_class

    app = make_app(ServiceConfig(port=0), metrics=False)
    assert protocol_class(app) is not None
    assert all(("POST", path) in app.routes for path in FAST_PATHS)
    # Without the API there is no fast route: every request goes the ASGI way.
    bare = make_app(ServiceConfig(port=0), metrics=False, api=False)
    cls = protocol_class(bare)
    assert cls is not None and not any(("POST", p) in bare.routes for p in FAST_PATHS)


def test_a_client_that_does_not_read_is_answered_in_order(pair):
    """Thousands of pipelined queries whose answers (every registered instance, 60 of them)
    are left unread for a while: the socket's write buffer fills, the answers go the ASGI way
    (which waits for it to drain) and back, and every answer comes, in order, the same as
    the ASGI application's."""
    import threading

    import httpx

    for port in pair:
        for k in range(60):  # instances that publish nothing: each answer lists them all
            endpoint = f"tcp://127.0.0.1:{20000 + k}"  # no publisher of ours
            assert httpx.post(f"http://127.0.0.1:{port}/register", json=register_body(
                f"x{k}", endpoint), timeout=READ_S).status_code == 200
    count = 1500
    bodies = [post("/query", dict(QUERY, token_ids=list(range(1, 13 + i % 3))))
              for i in range(count - 1)] + [post("/query", QUERY, close=True)]
    outs = []
    for port in pair:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            sock.settimeout(READ_S)
            sock.connect(("127.0.0.1", port))
            sender = threading.Thread(target=sock.sendall, args=(b"".join(bodies),),
                                      daemon=True)
            sender.start()
            time.sleep(1.0)  # nothing read meanwhile
            out = b""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                data = sock.recv(1 << 20)
                if not data:
                    break
                out += data
            sender.join(READ_S)
        assert out.count(b"HTTP/1.1 200 OK") == count
        outs.append(normalized(out))
    assert outs[0] == outs[1]

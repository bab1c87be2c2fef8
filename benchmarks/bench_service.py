"""``radixcache serve`` as a gateway sees it, side by side with NVIDIA Dynamo's standalone
indexer (``python -m dynamo.indexer``, a Rust service) when one is given: the same
publishers, the same events, the same queries, both spoken to in Dynamo's dialect (the one
both serve), and their answers compared::

    nice -n 5 python benchmarks/bench_service.py [--rounds 3] [--blocks 1000000]
        [--instances 64] [--dynamo-python /path/to/venv/bin/python] [--quick]

Dynamo's indexer is a benchmark-only dependency: install ``ai-dynamo-runtime==1.6.1`` in a
separate virtual environment and pass its python (it binds 0.0.0.0; nothing else is needed).

- fill: ``--instances`` publishers (raw ZeroMQ PUB sockets sending vLLM-shaped batches of 32
  blocks, map encoding, each instance holding a prefix of the query's prompt of random depth
  and chains of its own) until ``--blocks`` blocks are indexed; block events per second from
  the first batch sent to the last one seen in a query (each instance's marker block, stored
  when it connected, removed after its last batch).
- query: an 8,192-token prompt, block size 16; p50 and p99 of single ``/query`` calls from
  one client over loopback (a persistent connection); then queries per second with 16
  concurrent clients (``wrk`` when installed, else client processes).
- ingest while serving: 16 publishers stream batches of stored and removed blocks as fast as
  they can for a few seconds while one client queries at 200 queries per second: block
  events applied per second and that client's p99; then the same with the publishers held
  to 10^6 block events a second in all (paced): the p99 at that rate.
- memory: the service's resident memory per indexed block (from once the publishers are
  registered and connected to when it settles after the fill), against an in-process
  ``KvIndexer`` fed the same payloads (in a process of its own).
- answers: each instance's device hit for 50 prompts, radixcache against Dynamo.
- floor: the same client against a server that answers every request with a fixed body
  and does nothing else (asyncio, on uvloop when installed): p50, p99 and queries per
  second over loopback, and its p99 while radixcache ingests the same stream (what the
  machine alone costs a query then), flat out and paced.

Rounds alternate the two services (best of the interleaved rounds); ratios are
radixcache / Dynamo.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixcache.events import BlockRemoved, BlockStored, block_hashes, encode_batch

BLOCK = 16
PROMPT_BLOCKS = 512
BATCH_BLOCKS = 32
MODEL = "bench"
#: Block events a second of the paced ingest phase (the target's rate).
PACED_RATE = 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Server:
    """A service under test: radixcache serve, or Dynamo's indexer."""

    def __init__(self, name: str, argv: list, port: int, env: dict | None = None,
                 cwd: Optional[str] = None) -> None:
        self.name, self.port = name, port
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd)
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"{name} did not start: {self.log.read()[-2000:]!r}")
            time.sleep(0.1)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes) -> tuple:
        for attempt in (0, 1):
            try:
                self.conn.request("POST", path, body, {"content-type": "application/json"})
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                if attempt:  # the server closed an idle connection: once more on a new one
                    raise
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_radixcache(port: int, checkout: Optional[str] = None, *flags: str) -> Server:
    """``radixcache serve`` of this checkout, or of another one (``--baseline``: its built
    tree, run from its own directory)."""
    env = None
    if checkout is not None:
        env = dict(os.environ, PYTHONPATH=checkout)
    return Server("radixcache" if checkout is None else "baseline",
                  [sys.executable, "-m", "radixcache", "serve", "--port", str(port), *flags],
                  port, env, cwd=checkout)


def start_dynamo(python: str, port: int) -> Server:
    return Server("dynamo", [python, "-m", "dynamo.indexer", "--port", str(port),
                             "--threads", "2"], port)


#: The floor's server: reads each request (its head and content-length body) and answers a
#: fixed body; nothing else.
FLOOR_SERVER = r"""
import asyncio, sys
ANSWER = b'{"scores":{},"frequencies":[],"instances":{}}'
REPLY = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
         + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)
class Protocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(REPLY)
async def main():
    server = await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1",
                                                            int(sys.argv[1]))
    await server.serve_forever()
try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def start_floor(port: int) -> Server:
    return Server("floor", [sys.executable, "-c", FLOOR_SERVER, str(port)], port)


class Workload:
    """The prompt, each instance's blocks as pre-encoded payloads, and the markers that
    show a fill is complete."""

    def __init__(self, instances: int, blocks: int, seed: int = 1) -> None:
        rnd = random.Random(seed)
        self.instances = instances
        self.prompt = [rnd.randrange(1, 100_000) for _ in range(PROMPT_BLOCKS * BLOCK)]
        self.prompts = [self.prompt] + [
            self.prompt[:rnd.randrange(0, PROMPT_BLOCKS) * BLOCK]
            + [rnd.randrange(1, 100_000) for _ in range(PROMPT_BLOCKS * BLOCK)]
            for _ in range(49)]
        self.prompts = [p[:PROMPT_BLOCKS * BLOCK] for p in self.prompts]
        per = blocks // instances
        self.payloads: list = []  # per instance: encoded batches
        self.markers: list = []  # per instance: a marker prompt (one block)
        self.marker_removals: list = []  # per instance: the batch that removes it
        self.blocks = 0
        for w in range(instances):
            out = []
            share = rnd.randrange(0, PROMPT_BLOCKS)
            made = 0

            def chain(tokens: list, out: list = out) -> None:
                # Content hashes (SHA-256 chained), as the engines send: the same blocks
                # have the same hashes on every instance.
                nonlocal made
                all_hashes = block_hashes(tokens, BLOCK)
                parent = None
                for start in range(0, len(all_hashes), BATCH_BLOCKS):
                    hashes = tuple(all_hashes[start:start + BATCH_BLOCKS])
                    part = tuple(tokens[start * BLOCK:(start + len(hashes)) * BLOCK])
                    out.append(encode_batch([BlockStored(hashes, parent, part, BLOCK)]))
                    parent = hashes[-1]
                    made += len(hashes)

            chain(self.prompt[:share * BLOCK])
            while made < per:
                n = min(PROMPT_BLOCKS, per - made)
                chain([rnd.randrange(1, 100_000) for _ in range(n * BLOCK)])
            marker = [10**6 + w] * BLOCK
            marker_hashes = tuple(block_hashes(marker, BLOCK))
            out.append(encode_batch([BlockStored(marker_hashes, None, tuple(marker), BLOCK)]))
            self.marker_removals.append(encode_batch([BlockRemoved(marker_hashes)]))
            self.payloads.append(out)
            self.markers.append(marker)
            self.blocks += made + 1


class Publishers:
    """One raw PUB socket per instance (the benchmark's own: no encoding on the way)."""

    def __init__(self, count: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.socks = []
        self.endpoints = []
        self.seq = [0] * count
        for _ in range(count):
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks.append(s)
            self.endpoints.append(f"tcp://127.0.0.1:{port}")

    def send(self, w: int, payload: bytes) -> None:
        seq = self.seq[w]
        self.seq[w] = seq + 1
        self.socks[w].send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.ctx.term()


def settled_rss(pid: int, limit_s: float = 20.0) -> int:
    """The resident bytes of ``pid`` once they stop changing (three equal readings a second
    apart, at most ``limit_s``): a service may hand a burst's buffers back once it is over."""
    readings = [rss_bytes(pid)]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and (len(readings) < 3 or len(set(readings[-3:])) > 1):
        time.sleep(1)
        readings.append(rss_bytes(pid))
    return readings[-1]


def query_body(tokens: list) -> bytes:
    return json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()


def answer(server: Server, tokens: list) -> dict:
    status, body = server.post("/query", query_body(tokens))
    if status != 200:
        return {}
    return {int(k): v["gpu"] for k, v in json.loads(body)["instances"].items()}


def register_all(server: Server, pubs: Publishers) -> None:
    for w, endpoint in enumerate(pubs.endpoints):
        status, body = server.post("/register", json.dumps(
            {"instance_id": w, "endpoint": endpoint, "model_name": MODEL,
             "block_size": BLOCK}).encode())
        assert status in (200, 201), (status, body)


def wait_markers(server: Server, work: Workload, pubs: Publishers, resend: bool,
                 limit_s: float = 600, gone: bool = False) -> None:
    """Until every instance's marker block is in the answers (re-sending it while the
    subscriptions connect, when ``resend``), or with ``gone`` out of them."""
    deadline = time.monotonic() + limit_s
    pending = set(range(work.instances))
    while pending:
        for w in list(pending):
            held = answer(server, work.markers[w]).get(w)
            if (not held) if gone else held == BLOCK:
                pending.discard(w)
            elif resend:
                pubs.send(w, work.payloads[w][-1])
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name}: markers of {len(pending)} instances "
                                   "never seen")
            time.sleep(0.05)


def fill(server: Server, work: Workload, pubs: Publishers) -> tuple:
    """Send every instance's batches (interleaved), then the removal of its marker (stored
    when it connected): once every marker is gone, everything before it is applied. ``(block
    events per second, resident bytes once every publisher is registered and connected)``."""
    register_all(server, pubs)
    wait_markers(server, work, pubs, resend=True)  # connected
    connected_rss = rss_bytes(server.proc.pid)
    started = time.perf_counter()
    longest = max(len(p) for p in work.payloads) - 1  # the marker is stored already
    for i in range(longest):
        for w in range(work.instances):
            if i < len(work.payloads[w]) - 1:
                pubs.send(w, work.payloads[w][i])
    for w in range(work.instances):
        pubs.send(w, work.marker_removals[w])
    wait_markers(server, work, pubs, resend=False, gone=True)
    return work.blocks / (time.perf_counter() - started), connected_rss


def latency(server: Server, body: bytes, n: int) -> tuple:
    times = []
    for i in range(n + 50):
        t = time.perf_counter()
        status, _ = server.post("/query", body)
        if i >= 50:
            times.append(time.perf_counter() - t)
        assert status == 200
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3


def throughput(server: Server, body: bytes, seconds: float, clients: int = 16) -> float:
    wrk = shutil.which("wrk")
    if wrk is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script, \
                tempfile.NamedTemporaryFile("wb", delete=False) as data:
            data.write(body)
            data.flush()
            script.write(f'wrk.method = "POST"\nlocal f = io.open("{data.name}", "rb")\n'
                         'wrk.body = f:read("*a")\nf:close()\n'
                         'wrk.headers["Content-Type"] = "application/json"\n')
        out = subprocess.run([wrk, "-t2", f"-c{clients}", f"-d{seconds:.0f}s", "-s",
                              script.name, f"http://127.0.0.1:{server.port}/query"],
                             capture_output=True, text=True).stdout
        os.unlink(script.name)
        os.unlink(data.name)
        for line in out.splitlines():
            if line.startswith("Requests/sec:"):
                return float(line.split()[1])
        raise RuntimeError(out)
    done = [0] * clients
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        while time.monotonic() < stop:
            conn.request("POST", "/query", body, {"content-type": "application/json"})
            conn.getresponse().read()
            done[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds


def _stream(conn, publishers: int, seconds: float, rate: Optional[float] = None) -> None:
    """The ingest phase's publishers, in a process of their own (so that the querying client
    is not slowed by them): each stores a chain of 32 blocks, then removes it, over and
    over; markers show it is connected, then the stream runs for ``seconds``, as fast as
    they can send or, with ``rate``, at that many block events a second in all."""
    pubs = Publishers(publishers)
    rnd = random.Random(7)
    base = 1 << 50
    stream = []
    for w in range(publishers):
        pairs = []
        for k in range(64):
            tokens = tuple(rnd.randrange(1, 100_000) for _ in range(BATCH_BLOCKS * BLOCK))
            hashes = tuple(range(base + (w * 64 + k) * BATCH_BLOCKS,
                                 base + (w * 64 + k + 1) * BATCH_BLOCKS))
            pairs.append((encode_batch([BlockStored(hashes, None, tokens, BLOCK)]),
                          encode_batch([BlockRemoved(hashes)])))
        stream.append(pairs)
    conn.send(pubs.endpoints)
    while True:  # markers until the parent has seen each
        command = conn.recv()
        if command == "go":
            break
        for w, marker in enumerate(command):
            if marker is not None:
                pubs.send(w, encode_batch([BlockStored((base - 1 - w,), None, tuple(marker),
                                                       BLOCK)]))
    sent = 0
    started = time.perf_counter()
    i = 0
    per_turn = publishers * 2 * BATCH_BLOCKS
    while time.perf_counter() - started < seconds:
        if rate is not None:  # paced: turn i starts when the rate allows it
            wait = started + i * per_turn / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        for w in range(publishers):
            store, remove = stream[w][i % 64]
            pubs.send(w, store)
            pubs.send(w, remove)
        sent += per_turn
        i += 1
    for w in range(publishers):  # the markers leave: seen once everything before is applied
        pubs.send(w, encode_batch([BlockRemoved((base - 1 - w,))]))
    conn.send(sent)
    conn.recv()
    pubs.close()


def ingest_while_serving(server: Server, body: bytes, seconds: float,
                         publishers: int = 16, queried: Optional[Server] = None,
                         rate: Optional[float] = None) -> tuple:
    """``publishers`` new publishers stream stored/removed batches for ``seconds`` (as fast
    as they can, or at ``rate`` block events a second) while one client queries ``queried``
    (default ``server``) at 200 queries per second; ``(block events/s applied, query p99
    ms)``."""
    import multiprocessing

    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_stream,
                                                       args=(child, publishers, seconds,
                                                             rate))
    proc.start()
    endpoints = parent.recv()
    for w, endpoint in enumerate(endpoints):
        status, out = server.post("/register", json.dumps(
            {"instance_id": 10_000 + w, "endpoint": endpoint, "model_name": MODEL,
             "block_size": BLOCK}).encode())
        assert status in (200, 201), out
    marker = [[2 * 10**6 + w] * BLOCK for w in range(publishers)]
    waiting = set(range(publishers))
    while waiting:  # connected: a marker seen from each
        parent.send([marker[w] if w in waiting else None for w in range(publishers)])
        time.sleep(0.02)
        waiting = {w for w in waiting if answer(server, marker[w]).get(10_000 + w) != BLOCK}
    parent.send("go")
    started = time.perf_counter()
    times: list = []
    next_at = started
    while time.perf_counter() - started < seconds:
        now = time.perf_counter()
        if now < next_at:
            time.sleep(next_at - now)
        t = time.perf_counter()
        (queried or server).post("/query", body)
        times.append(time.perf_counter() - t)
        next_at += 1 / 200
    sent = parent.recv()
    deadline = time.monotonic() + 300
    while any(answer(server, marker[w]).get(10_000 + w) for w in range(publishers)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    parent.send("done")
    proc.join()
    for w in range(publishers):
        server.post("/unregister", json.dumps({"instance_id": 10_000 + w,
                                               "model_name": MODEL}).encode())
    times.sort()
    return sent / elapsed, times[int(len(times) * 0.99)] * 1e3


def in_process_memory(work: Workload) -> int:
    """Resident bytes an in-process ``KvIndexer`` adds for the same payloads (its own
    process)."""
    code = f"""
import pickle, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from radixcache.router import KvIndexer
payloads = pickle.load(sys.stdin.buffer)
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
idx = KvIndexer({BLOCK})
before = rss()
for w, batches in enumerate(payloads):
    for p in batches:
        idx.apply_payload(w, p)
print(rss() - before, len(idx))
"""
    import pickle

    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(work.payloads),
                          capture_output=True, check=True)
    return int(done.stdout.split()[0])


def one_round(name: str, start, work: Workload, args: argparse.Namespace) -> dict:
    pubs = Publishers(work.instances)
    server = start(free_port())
    try:
        rate, base_rss = fill(server, work, pubs)
        rss = settled_rss(server.proc.pid) - base_rss  # the blocks', not the subscriptions'
        body = query_body(work.prompt)
        p50, p99 = latency(server, body, args.queries)
        qps = throughput(server, body, args.seconds)
        answers = [answer(server, p) for p in work.prompts]
        ingest, ingest_p99 = ingest_while_serving(server, body, args.seconds)
        paced, paced_p99 = ingest_while_serving(server, body, args.seconds, rate=PACED_RATE)
        floor = None
        if name == "radixcache":  # the floor's, beside this service's ingest
            floor = floor_round(body, args, server)
    finally:
        server.stop()
        pubs.close()
    return {"service": name, "fill_events_s": rate, "p50_ms": p50, "p99_ms": p99,
            "qps16": qps, "ingest_events_s": ingest, "ingest_query_p99_ms": ingest_p99,
            "paced_events_s": paced, "paced_query_p99_ms": paced_p99,
            "rss_per_block": rss / work.blocks, "answers": answers, "floor": floor}


def floor_round(body: bytes, args: argparse.Namespace, ingesting: Server) -> dict:
    """The floor's figures: the fixed-answer server queried alone, then while
    ``ingesting`` ingests the ingest phase's stream."""
    floor = start_floor(free_port())
    try:
        p50, p99 = latency(floor, body, args.queries)
        qps = throughput(floor, body, args.seconds)
        _, ingest_p99 = ingest_while_serving(ingesting, body, args.seconds, queried=floor)
        _, paced_p99 = ingest_while_serving(ingesting, body, args.seconds, queried=floor,
                                            rate=PACED_RATE)
    finally:
        floor.stop()
    return {"service": "floor", "p50_ms": p50, "p99_ms": p99, "qps16": qps,
            "ingest_query_p99_ms": ingest_p99, "paced_query_p99_ms": paced_p99}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--dynamo-python", default=None,
                        help="a python with ai-dynamo-runtime installed (its own venv)")
    parser.add_argument("--baseline", metavar="CHECKOUT", default=None,
                        help="another checkout of radixcache (built) served the same way in "
                             "the same interleaved rounds: a before/after comparison")
    parser.add_argument("--flags", default="",
                        help="extra flags of this checkout's radixcache serve (one string)")
    parser.add_argument("--quick", action="store_true",
                        help="100,000 blocks, 500 queries, 2-second phases, one round")
    parser.add_argument("--json", default=None, help="write every round's figures here")
    args = parser.parse_args()
    try:
        import zmq  # noqa: F401
    except ImportError:
        print("bench_service: needs pyzmq (pip install 'radixcache[serve]')")
        return 0
    if args.quick:
        args.blocks, args.queries, args.seconds, args.rounds = 100_000, 500, 2.0, 1
    work = Workload(args.instances, args.blocks)
    print(f"{work.blocks:,} blocks over {work.instances} instances, block {BLOCK}, "
          f"prompt {len(work.prompt):,} tokens; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    flags = args.flags.split()
    services = [("radixcache", lambda port: start_radixcache(port, None, *flags))]
    if args.baseline:
        services.append(("baseline", lambda port: start_radixcache(port, args.baseline)))
    if args.dynamo_python:
        services.append(("dynamo", lambda port: start_dynamo(args.dynamo_python, port)))
    rounds: dict = {name: [] for name, _ in services}
    for r in range(args.rounds):
        for name, start in (services[r % len(services):] + services[:r % len(services)]):
            result = one_round(name, start, work, args)
            rounds[name].append(result)
            if result["floor"] is not None:
                rounds.setdefault("floor", []).append(result["floor"])
                f = result["floor"]
                print(f"round {r + 1} floor: query p50 {f['p50_ms']:.3f} ms p99 "
                      f"{f['p99_ms']:.3f} ms, {f['qps16']:,.0f} q/s (16 clients), query p99 "
                      f"{f['ingest_query_p99_ms']:.2f} ms while radixcache ingests, "
                      f"{f['paced_query_p99_ms']:.2f} ms at the paced rate", flush=True)
            print(f"round {r + 1} {name}: fill {result['fill_events_s']:,.0f} events/s, "
                  f"query p50 {result['p50_ms']:.3f} ms p99 {result['p99_ms']:.3f} ms, "
                  f"{result['qps16']:,.0f} q/s (16 clients), ingest "
                  f"{result['ingest_events_s']:,.0f} events/s with query p99 "
                  f"{result['ingest_query_p99_ms']:.2f} ms, paced "
                  f"{result['paced_events_s']:,.0f} events/s with query p99 "
                  f"{result['paced_query_p99_ms']:.2f} ms, "
                  f"{result['rss_per_block']:.1f} B/block; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    in_proc = in_process_memory(work) / work.blocks
    best_of = {"fill_events_s": max, "p50_ms": min, "p99_ms": min, "qps16": max,
               "ingest_events_s": max, "ingest_query_p99_ms": min, "paced_events_s": max,
               "paced_query_p99_ms": min, "rss_per_block": min}
    best = {name: {key: pick(x[key] for x in rs) for key, pick in best_of.items()
                   if key in rs[0]} for name, rs in rounds.items()}
    others = [n for n in ("dynamo", "baseline") if n in best]
    print(f"\nbest of {args.rounds} interleaved rounds (in-process KvIndexer: "
          f"{in_proc:.1f} B/block resident; load average {os.getloadavg()[0]:.1f}; ratios: "
          "radixcache / the other):")
    print("| what | " + " | ".join(best) + "".join(f" | / {n}" for n in others) + " |")
    for key in best_of:
        row = ["" if key not in best[n] else f"{best[n][key]:,.3f}" if "ms" in key
               else f"{best[n][key]:,.0f}" for n in best]
        ratios = [f"{best['radixcache'][key] / best[n][key]:.2f}" if best[n][key] else ""
                  for n in others]
        print(f"| {key} | " + " | ".join(row + ratios) + " |")
    for other in others:
        ours, theirs = rounds["radixcache"][0]["answers"], rounds[other][0]["answers"]
        same = sum(a == b for a, b in zip(ours, theirs))
        print(f"answers: {same} of {len(ours)} prompts give every instance the same device "
              f"hit in radixcache and {other}")
        if same != len(ours):
            for a, b in zip(ours, theirs):
                if a != b:
                    print("  differs:", sorted(set(a.items()) ^ set(b.items()))[:10])
                    break
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": {n: [{k: v for k, v in x.items()
                                       if k not in ("answers", "floor")}
                                      for x in rs] for n, rs in rounds.items()},
                       "in_process_bytes_per_block": in_proc}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

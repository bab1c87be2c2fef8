"""Where a ``/query``'s time goes while the service ingests: its handler runs in this process
on the main thread (as on ``radixcache serve``'s event loop) beside the service's ingest
thread, fed by 16 publishers streaming as fast as they can (``bench_service``'s ingest
phase), and each query's wall time is split into time on a core (the thread's CPU time),
time runnable but waiting for a core (the kernel's per-thread accounting,
``/proc/thread-self/schedstat``, Linux only), and the rest (blocked: waiting for the
interpreter's lock, or for the service's lock, which the ingest thread holds while it applies
a batch)::

    python benchmarks/service_query_wait.py [--seconds 8] [--blocks 20000] [--rate 1e6]

``--http`` serves ``radixcache serve`` in its own process instead (this script, run as the
server, times each request's ``data_received`` callback, the event loop thread's wait for a
core, the ingest's holds of the service's lock and the collector's passes) and queries it
over HTTP as ``bench_service`` does: each query's time from the client's view is split into
the time before the server's callback began (and of it, the loop thread runnable but waiting
for a core), the callback (the handler, the answer written, the bookkeeping after it: a
callback slowed after the write makes the next part negative), and the time after it until
the client had the answer, and the client's own wait for a core is given; the slowest
queries are listed with the lock holds and collections that overlapped them.

On a 2-core machine the publishers' process, ZeroMQ's I/O threads, the ingest thread and the
query share two cores: see docs/service.md#performance.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_service as bench


def run_delay() -> int:
    """Nanoseconds this thread has spent runnable, waiting for a core (the kernel adds each
    wait when the thread gets a core back)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1])


def fill_and_stream(server, pubs: "bench.Publishers", args: argparse.Namespace) -> tuple:
    """``server`` filled with ``args.blocks`` blocks over 64 instances (``pubs``), then
    ``bench_service``'s ingest phase: 16 publishers registered with it, each seen connected,
    then streaming for ``args.seconds``; ``(the query's body, the publishers' process, the
    pipe to it)``."""
    work = bench.Workload(64, args.blocks)
    bench.fill(server, work, pubs)
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=bench._stream, args=(child, 16, args.seconds, args.rate))
    proc.start()
    for w, endpoint in enumerate(parent.recv()):
        server.post("/register", json.dumps(
            {"instance_id": 10_000 + w, "endpoint": endpoint, "model_name": bench.MODEL,
             "block_size": bench.BLOCK}).encode())
    marker = [[2 * 10**6 + w] * bench.BLOCK for w in range(16)]
    waiting = set(range(16))
    while waiting:  # every publisher connected
        parent.send([marker[w] if w in waiting else None for w in range(16)])
        time.sleep(0.02)
        waiting = {w for w in waiting
                   if bench.answer(server, marker[w]).get(10_000 + w) != bench.BLOCK}
    parent.send("go")
    return bench.query_body(work.prompt), proc, parent


def traced_server(out: str, argv: list) -> int:
    """``radixcache serve`` (``argv``) with timestamps (``time.perf_counter``, the same clock
    in every process) written to ``out`` when it gets SIGUSR1: each ``data_received`` call's
    start, end and the loop thread's wait for a core at both; each hold of the service's
    lock by the ingest (start, end, batches, CPU time, wait for a core, time lent to a
    waiting request); each collection."""
    import gc
    import signal

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from radixcache.cli import main as cli
    from radixcache.service.state import IndexService, _Lock

    clock = time.perf_counter
    trace: dict = {"received": [], "holds": [], "gc": []}
    started = [0.0]

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            trace["gc"].append((started[0], clock(), info["generation"]))

    gc.callbacks.append(collected)
    apply = IndexService._apply

    def held(self, sub, batches: list) -> None:
        t, cpu, wait = clock(), time.thread_time(), run_delay()
        lent[0] = 0.0
        apply(self, sub, batches)
        trace["holds"].append((t, clock(), len(batches), time.thread_time() - cpu,
                               (run_delay() - wait) / 1e9, lent[0]))

    IndexService._apply = held
    lend = _Lock.lend
    lent = [0.0]

    def lending(self) -> None:
        t = clock()
        lend(self)
        lent[0] += clock() - t

    _Lock.lend = lending
    data_received = HttpToolsProtocol.data_received

    def received(self, data: bytes) -> None:
        t, wait = clock(), run_delay()
        data_received(self, data)
        trace["received"].append((t, clock(), wait / 1e9, run_delay() / 1e9))

    HttpToolsProtocol.data_received = received

    def dump(*_: object) -> None:
        with open(out, "w") as f:
            json.dump(trace, f)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    return cli(argv)


def over_http(args: argparse.Namespace) -> int:
    """See the module docstring (``--http``)."""
    import bisect
    import signal

    clock = time.perf_counter
    port = bench.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        server = bench.Server("radixcache", [sys.executable, __file__, "--traced-server", out,
                                             "serve", "--port", str(port)], port)
        pubs = bench.Publishers(64)
        try:
            body, proc, pipe = fill_and_stream(server, pubs, args)
            queries = []
            started = next_at = clock()
            while clock() - started < args.seconds:  # as bench_service's ingest phase
                if clock() < next_at:
                    time.sleep(next_at - clock())
                t, wait = clock(), run_delay()
                server.post("/query", body)
                queries.append((t, clock(), (run_delay() - wait) / 1e9))
                next_at += 1 / 200
            sent = pipe.recv() / (clock() - started)
            pipe.send("done")
            proc.join()
            server.proc.send_signal(signal.SIGUSR1)
            server.proc.wait(30)
            with open(out) as f:
                trace = json.load(f)
        finally:
            server.stop()
            pubs.close()
    calls = sorted(trace["received"])
    starts = [c[0] for c in calls]
    rows = []
    for t0, t1, client in queries:
        i = bisect.bisect_left(starts, t0)
        if i == len(calls) or calls[i][0] > t1:
            continue  # a query's bytes read in more than one callback: left out
        c = calls[i]
        waited = c[2] - calls[i - 1][3] if i else 0.0  # since the previous call ended
        rows.append((t1 - t0, c[0] - t0, waited, c[1] - c[0], t1 - c[1], client, t0, t1))
    rows.sort()
    n = len(rows)
    print(f"{n} queries during ingest ({sent:,.0f} block events/s sent); load average "
          f"{os.getloadavg()[0]:.1f}")
    for name, part in (("all", rows), ("slowest 10%", rows[int(n * 0.9):]),
                       ("slowest 1%", rows[int(n * 0.99):])):
        k = len(part)
        wall, before, waited, inside, after, client = (sum(r[i] for r in part) / k * 1e3
                                                       for i in range(6))
        print(f"{name:12s} mean {wall:.2f} ms = before the server's callback {before:.2f} (the "
              f"loop thread waiting for a core {waited:.2f}) + in it {inside:.2f} + after it "
              f"{after:.2f}; the client waiting for a core {client:.2f} of it")
    holds = trace["holds"]
    cpu = sorted(h[3] for h in holds)
    wall = sorted(h[1] - h[0] for h in holds)
    rest = sorted(h[1] - h[0] - h[3] - h[4] - h[5] for h in holds)
    print(f"{len(holds)} holds of the lock by the ingest: wall p50 {wall[len(wall) // 2] * 1e3:.2f}"
          f" p99 {wall[int(len(wall) * 0.99)] * 1e3:.2f} max {wall[-1] * 1e3:.2f} ms, CPU p99 "
          f"{cpu[int(len(cpu) * 0.99)] * 1e3:.2f} max {cpu[-1] * 1e3:.2f} ms; neither on a core, "
          f"waiting for one nor lent (blocked on the interpreter's lock) p99 "
          f"{rest[int(len(rest) * 0.99)] * 1e3:.2f} max {rest[-1] * 1e3:.2f} ms; lent to requests "
          f"{sum(h[5] for h in holds) * 1e3:.0f} ms in all")
    for gen in (0, 1, 2):
        times = [g[1] - g[0] for g in trace["gc"] if g[2] == gen]
        if times:
            print(f"collections of generation {gen}: {len(times)}, longest "
                  f"{max(times) * 1e3:.2f} ms")
    print("slowest 1%: ms before (the loop thread waiting for a core) / in / after (the client "
          "waiting for a core) | overlapping holds: "
          "count, longest wall, its CPU, its wait for a core, lent to a request | collections")
    for r in rows[int(n * 0.99):]:
        over = [h for h in holds if h[1] > r[6] and h[0] < r[7]]
        top = max(over, key=lambda h: h[1] - h[0], default=(0, 0, 0, 0, 0, 0))
        collections = [g[2] for g in trace["gc"] if g[1] > r[6] and g[0] < r[7]]
        print(f"  {r[0] * 1e3:6.2f}: {r[1] * 1e3:5.2f} ({r[2] * 1e3:5.2f}) / {r[3] * 1e3:5.2f} / "
              f"{r[4] * 1e3:5.2f} ({r[5] * 1e3:5.2f}) | {len(over)}, "
              f"{(top[1] - top[0]) * 1e3:.2f}, {top[3] * 1e3:.2f}, {top[4] * 1e3:.2f}, "
              f"{top[5] * 1e3:.2f} | {collections}")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--traced-server"]:
        return traced_server(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=None,
                        help="block events a second the publishers are held to (default: "
                             "as fast as they can)")
    parser.add_argument("--http", action="store_true",
                        help="radixcache serve in its own process, queried over HTTP")
    args = parser.parse_args()
    if not os.path.exists("/proc/thread-self/schedstat"):
        print("service_query_wait: needs Linux's /proc/thread-self/schedstat")
        return 0
    if args.http:
        return over_http(args)
    from radixcache.service.app import make_app
    from radixcache.service.config import ServiceConfig

    sys.setswitchinterval(0.0005)  # as radixcache serve sets it
    app = make_app(ServiceConfig(), metrics=False)
    app.service.start()

    class InProcess:  # bench_service's Server, its requests handled in this process
        name = "in-process"

        class proc:
            pid = os.getpid()

        def post(self, path: str, body: bytes) -> tuple:
            status, out, _ = app.routes[("POST", path)][0](body)
            return status, out

    server = InProcess()
    pubs = bench.Publishers(64)
    try:
        body, proc, parent = fill_and_stream(server, pubs, args)
        handler = app.routes[("POST", "/query")][0]
        split = []
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds - 0.2:
            t = time.perf_counter()  # the readings are inside the wall time they split
            wait0, cpu0 = run_delay(), time.thread_time()
            handler(body)
            on_cpu, runnable = time.thread_time() - cpu0, (run_delay() - wait0) / 1e9
            wall = time.perf_counter() - t
            split.append((wall, on_cpu, runnable, max(wall - on_cpu - runnable, 0.0)))
            time.sleep(0.005)  # 200 queries per second at most
        parent.recv()
        parent.send("done")
        proc.join()
    finally:
        app.service.close()
        pubs.close()
    split.sort()
    n = len(split)
    print(f"{n} queries during ingest; load average {os.getloadavg()[0]:.1f}")
    for name, part in (("all", split), ("slowest 10%", split[int(n * 0.9):]),
                       ("slowest 1%", split[int(n * 0.99):])):
        k = len(part)
        wall, on_cpu, runnable, blocked = (sum(x[i] for x in part) / k * 1e3 for i in range(4))
        print(f"{name:12s} mean {wall:.3f} ms = on a core {on_cpu:.3f} + runnable, waiting "
              f"for a core {runnable:.3f} + blocked on a lock {blocked:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a ``/query``'s time goes while the service ingests: its handler runs in this process
on the main thread (as on ``radixcache serve``'s event loop) beside the service's ingest
thread, fed by 16 publishers streaming as fast as they can (``bench_service``'s ingest
phase), and each query's wall time is split into time on a core (the thread's CPU time),
time runnable but waiting for a core (the kernel's per-thread accounting,
``/proc/thread-self/schedstat``, Linux only), and the rest (blocked: waiting for the
interpreter's lock, or for the service's lock, which the ingest thread holds while it applies
a batch)::

    python benchmarks/service_query_wait.py [--seconds 8] [--blocks 20000]

On a 2-core machine the publishers' process, ZeroMQ's I/O threads, the ingest thread and the
query share two cores: see docs/service.md#performance.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--blocks", type=int, default=20_000)
    args = parser.parse_args()
    if not os.path.exists("/proc/thread-self/schedstat"):
        print("service_query_wait: needs Linux's /proc/thread-self/schedstat")
        return 0
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
    work = bench.Workload(64, args.blocks)
    pubs = bench.Publishers(64)
    try:
        bench.fill(server, work, pubs)
        body = bench.query_body(work.prompt)
        parent, child = multiprocessing.Pipe()
        proc = multiprocessing.get_context("fork").Process(
            target=bench._stream, args=(child, 16, args.seconds))
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

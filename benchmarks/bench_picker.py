"""The Endpoint Picker behind a real Envoy: latency it adds, picks per second, follow-ups.

A script (``python benchmarks/bench_picker.py --rounds 5``), run on 127.0.0.1 with the test
model (a tokenizer trained on the spot) and the tests' workers (``tests/picker/worker.py``:
RadixCache, ZeroMQ events), needing ``radixcache[epp,epp-test]``. Three figures:

1. **Latency added**: one client sends 2,000-token chat requests through Envoy with the
   picker (the documentation's configuration) and through Envoy alone (round robin over the
   same workers, no ext_proc), in alternating rounds; the report gives each side's p50 and
   p99 (best round) and the difference. Beside them, interleaved, the **floor**: the same
   Envoy configuration with a trivial ext_proc server (``extproc_floor.py``: the picker's
   gRPC stack, every message answered at once), what the ext_proc exchange alone costs; and
   each ext_proc server's CPU time per request (from ``/proc``). ``--compare-src DIR`` adds a
   picker run from another checkout (before and after a change, in one run);
   ``--skip-response-headers`` adds the picker and the floor with Envoy's
   ``response_header_mode: SKIP`` (what reading the served endpoint back costs). Two prompt
   kinds: ``follow-up`` (conversations whose history grows to 2,000 tokens, as chat traffic
   does: the picker encodes only the new message, its cache holds the rest) and ``cold`` (a
   new 2,000-token conversation each time: the whole prompt is tokenized).
2. **Picks per second**: 32 concurrent ext_proc streams (a gRPC client in its own process)
   straight to one picker process, follow-up requests of 2,000 tokens.
3. **Follow-ups to the holder**: 8 clients (no think time) run 32 conversations through
   Envoy, with a system prompt they all share and with one of their own; the share of
   follow-up turns served by the worker that served the turn before (no worker stops: every
   one stays eligible), with the picker crediting placements ahead of their events and
   without (``--pending-ttl 0``), interleaved.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "picker"))

PAGE = 16


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def chat_bodies(rng, count, kind, target_tokens=2000):
    """Request bodies of about ``target_tokens`` tokens: ``cold`` ones share nothing;
    ``follow-up`` ones are the turns of a few conversations grown to that length."""
    from workload import MODEL, words

    if kind == "cold":
        return [{"model": MODEL, "messages": [
            {"role": "system", "content": f"Cold {i} {rng.random()}"},
            {"role": "user", "content": words(rng, target_tokens * 9 // 10,
                                              target_tokens * 9 // 10)}]}
            for i in range(count)]
    bodies = []
    conversation = 0
    while len(bodies) < count:
        messages = [{"role": "system", "content": f"Conversation {conversation}: "
                     + words(rng, 300, 300)}]
        while len(" ".join(m["content"] for m in messages).split()) < target_tokens * 9 // 10:
            messages.append({"role": "user", "content": words(rng, 60, 80)})
            messages.append({"role": "assistant", "content": words(rng, 60, 80)})
        messages.append({"role": "user", "content": words(rng, 30, 40)})
        bodies.append({"model": MODEL, "messages": messages})
        conversation += 1
    return bodies


def start_pool(model_dir, logs, processes, log_name, extra=()):
    """Four workers and a picker over them (appended to ``processes`` as they start)."""
    from harness import start_picker, start_worker, wait_workers

    workers = [start_worker(f"w{i}", model_dir, logs, capacity=1 << 20, page_size=PAGE)
               for i in range(4)]
    processes += [w.process for w in workers]
    wait_workers(workers)
    picker = start_picker(workers, model_dir, logs, page_size=PAGE,
                          extra=("--model", "test-model", *extra), log_name=log_name)
    processes.append(picker.process)
    return workers, picker


def start_floor(logs, sync=False):
    """The trivial ext_proc server (``extproc_floor.py``), once it accepts connections."""
    import socket

    from harness import Process, free_port

    port = free_port()
    argv = [sys.executable, str(ROOT / "benchmarks" / "extproc_floor.py"), str(port)]
    process = Process(argv + (["--sync"] if sync else []), logs / f"floor-{port}.log", "floor")

    def accepts() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    process.wait_until(accepts, "its port")
    return process, port


def cpu_seconds(pid):
    """A process's user and system CPU time so far (None where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def latency_sides(args, model_dir, logs, processes):
    """``{name: (Envoy, ext_proc server's Process or None)}``, interleaved in this order."""
    from harness import EnvoyConfig, _ext_proc, start_envoy, start_picker

    workers, picker = start_pool(model_dir, logs, processes, "picker")
    floor, floor_port = start_floor(logs)
    processes.append(floor)
    servers = [("picker", picker.port, picker.process), ("floor", floor_port, floor)]
    if args.compare_src:
        other = start_picker(workers, model_dir, logs, page_size=PAGE,
                             extra=("--model", "test-model"), log_name="picker-compared",
                             source=Path(args.compare_src).resolve())
        processes.append(other.process)
        servers.insert(1, ("picker@compared", other.port, other.process))
    sides = {}
    for name, port, server in servers:
        modes = ("SEND", "SKIP") if args.skip_response_headers else ("SEND",)
        for mode in modes:
            config = EnvoyConfig(workers, port, fail_open_listener=False)
            _ext_proc(config.config["static_resources"]["listeners"][0])[
                "processing_mode"]["response_header_mode"] = mode
            label = name if mode == "SEND" else f"{name}, no response headers"
            envoy = start_envoy(config, logs, "envoy-" + label.replace(" ", "-").replace(",", ""))
            processes.append(envoy.process)
            sides[label] = (envoy, server)
    alone = start_envoy(EnvoyConfig(workers, picker.port, fail_open_listener=False,
                                    picker=False), logs, "envoy-alone")
    processes.append(alone.process)
    sides["round-robin"] = (alone, None)
    return sides, picker


def latency_rounds(args, model_dir, logs):
    from harness import Client

    processes = []
    try:
        sides, picker = latency_sides(args, model_dir, logs, processes)
        rng = random.Random(1)
        report = {}
        tokens = None
        for kind in ("follow-up", "cold"):
            bodies = chat_bodies(rng, args.requests, kind)
            if kind == "follow-up":
                # The histories were seen before (the turns that built them): each picker's
                # cache holds their pieces, as it would in a running conversation.
                for name, (envoy, _server) in sides.items():
                    if name.startswith("picker"):
                        warm = Client(envoy.config.port)
                        for body in bodies:
                            warm.post("/v1/chat/completions",
                                      dict(body, messages=body["messages"][:-1]))
                        warm.close()
            best, cpu = {}, {}
            for _ in range(args.rounds):
                for name, (envoy, server) in sides.items():
                    if kind == "cold":  # new prompts every round and side: none seen before
                        bodies = chat_bodies(rng, args.requests, kind)
                    client = Client(envoy.config.port)
                    before = server and cpu_seconds(server.proc.pid)
                    times = []
                    for body in bodies:
                        start = time.perf_counter()
                        status, _, _ = client.post("/v1/chat/completions", body)
                        times.append(time.perf_counter() - start)
                        assert status == 200, (name, status, server and server.tail(),
                                               envoy.process.tail())
                    client.close()
                    after = server and cpu_seconds(server.proc.pid)
                    if before is not None and after is not None:
                        cpu[name] = cpu.get(name, 0.0) + (after - before) / len(bodies)
                    p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
                    old = best.get(name)
                    best[name] = (min(p50, old[0]) if old else p50, min(p99, old[1]) if old
                                  else p99)
            report[kind] = {name: (p50, p99, cpu.get(name, 0.0) / args.rounds)
                            for name, (p50, p99) in best.items()}
            if tokens is None:
                from radixcache.picker import ChatTokenizer

                tokenizer = ChatTokenizer.from_dir(str(model_dir))
                tokens = [len(tokenizer.chat_ids(tokenizer.prepare_messages(b["messages"])))
                          for b in bodies]
        metrics = picker.metrics()
        seconds = {k[0]: v for k, v in metrics.items() if k[0].endswith(("_sum", "_count"))}
        return report, tokens, seconds
    finally:
        for process in reversed(processes):
            process.stop()


def _pick_client(port, bodies, streams, seconds, out):
    """A process of its own: ``streams`` concurrent ext_proc streams for ``seconds``."""
    import asyncio

    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    headers = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=2))
    messages = [ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(b).encode(),
                                                              end_of_stream=True))
                for b in bodies]

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            done = [0]
            end = time.monotonic() + seconds

            async def stream(i):
                k = i
                while time.monotonic() < end:
                    call = stub.Process()
                    await call.write(headers)
                    await call.write(messages[k % len(messages)])
                    await call.read()
                    answer = await call.read()
                    assert answer.WhichOneof("response") == "request_body", answer
                    await call.done_writing()
                    done[0] += 1
                    k += streams

            start = time.monotonic()
            await asyncio.gather(*(stream(i) for i in range(streams)))
            out.put(done[0] / (time.monotonic() - start))

    asyncio.run(run())


def picks_per_second(args, model_dir, logs):
    from harness import free_port, start_picker

    from radixcache.events import ZmqEventPublisher

    class Endpoint:
        def __init__(self, i):
            self.address = f"127.0.0.1:{9100 + i}"
            events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
            self.publisher = ZmqEventPublisher(events, replay)
            self.publisher_spec = f"e{i}={events},replay={replay},address={self.address}"

    endpoints = [Endpoint(i) for i in range(4)]
    picker = start_picker(endpoints, model_dir, logs, page_size=PAGE,
                          extra=("--model", "test-model"), log_name="picker-rate")
    try:
        bodies = chat_bodies(random.Random(2), 64, "follow-up")
        queue = multiprocessing.Queue()
        best = 0.0
        for _ in range(args.rounds):
            client = multiprocessing.Process(target=_pick_client,
                                             args=(picker.port, bodies, 32, args.seconds,
                                                   queue))
            client.start()
            best = max(best, queue.get(timeout=args.seconds + 120))
            client.join()
        return best
    finally:
        picker.process.stop()
        for endpoint in endpoints:
            endpoint.publisher.close(timeout=1.0)


def follow_ups(args, model_dir, logs, extra=(), shared_system=True):
    from harness import Client, EnvoyConfig, start_envoy
    from workload import conversations, reply_of, words

    processes = []
    try:
        workers, picker = start_pool(model_dir, logs, processes, "picker-follow", extra)
        envoy = start_envoy(EnvoyConfig(workers, picker.port, fail_open_listener=False),
                            logs, "envoy-follow")
        processes.append(envoy.process)
        rng = random.Random(4)
        shared = "You are the assistant of a shop. " + words(rng, 150, 150)
        convs = conversations(32, rng, shared_system=shared if shared_system else None)
        lock = threading.Lock()
        counts = {"follow": 0, "same": 0, "requests": 0}

        def run(mine):
            client = Client(envoy.config.port)
            local = random.Random(len(mine))
            for _turn in range(args.turns):
                for conv in mine:
                    conv.messages.append({"role": "user", "content": words(local, 20, 40)})
                    status, headers, body = client.post("/v1/chat/completions", conv.body())
                    conv.messages.append({"role": "assistant",
                                          "content": reply_of(status, body, False)})
                    with lock:
                        counts["requests"] += 1
                        if conv.workers:
                            counts["follow"] += 1
                            counts["same"] += headers["x-worker"] == conv.workers[-1]
                    conv.workers.append(headers["x-worker"])

        threads = [threading.Thread(target=run, args=(convs[i::8],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        spread = [sum(1 for c in convs for w in c.workers if w == f"w{i}") for i in range(4)]
        return counts, spread
    finally:
        for process in reversed(processes):
            process.stop()


def latency_report(args, model_dir, logs):
    report, tokens, seconds = latency_rounds(args, model_dir, logs)
    print(f"latency, one client, chat prompts of {min(tokens)}-{max(tokens)} tokens "
          f"(best of {args.rounds} interleaved rounds of {args.requests} requests); added: "
          f"over Envoy round robin; CPU: the ext_proc server's, per request:")
    for kind, sides in report.items():
        b50, b99, _ = sides["round-robin"]
        print(f"  {kind}:")
        for name, (p50, p99, cpu) in sides.items():
            line = f"    {name:34} p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms"
            if name != "round-robin":
                line += (f" | added p50 {(p50 - b50) * 1e3:+.2f} ms  p99 {(p99 - b99) * 1e3:+.2f}"
                         f" ms | CPU {cpu * 1e6:5.0f} us")
            print(line)
    for name in ("tokenize", "pick"):
        total = seconds.get(f"radixcache_picker_{name}_seconds_sum", 0.0)
        count = seconds.get(f"radixcache_picker_{name}_seconds_count", 1.0) or 1.0
        print(f"  picker's mean {name} time over all requests: {total / count * 1e3:.3f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    parser.add_argument("--requests", type=int, default=60, help="requests per round")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per rate round")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--only", choices=["latency", "rate", "follow-ups"], default=None,
                        help="run one of the three parts")
    parser.add_argument("--compare-src", default=None, metavar="DIR",
                        help="latency: also a picker run from another checkout's source "
                             "(its radixcache package, compiled), interleaved with this one")
    parser.add_argument("--skip-response-headers", action="store_true",
                        help="latency: also the picker and the floor with Envoy's "
                             "response_header_mode SKIP (no served endpoint reported)")
    parser.add_argument("--picker-args", default="",
                        help="more flags for the picker's radixcache serve, e.g. "
                             "'--load-weight 0.3'")
    args = parser.parse_args()
    from model import make_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_model_dir(tmp / "model")
        logs = tmp / "logs"
        logs.mkdir()
        if args.only in (None, "latency"):
            latency_report(args, model_dir, logs)
        if args.only in (None, "rate"):
            rate = picks_per_second(args, model_dir, logs)
            print(f"picks per second, one picker process, 32 concurrent streams, 2,000-token "
                  f"follow-ups: {rate:,.0f} (best of {args.rounds} rounds of {args.seconds:g} s)")
        if args.only in (None, "follow-ups"):
            # With and without crediting placements ahead of their events, interleaved.
            given = tuple(args.picker_args.split()) if args.picker_args else ()
            for r in range(args.rounds):
                for shared in (True, False):
                    for label, extra in (("pending on", given),
                                         ("pending off", given + ("--pending-ttl", "0"))):
                        counts, spread = follow_ups(args, model_dir, logs, extra, shared)
                        share = counts["same"] / counts["follow"]
                        print(f"round {r + 1}, {'shared' if shared else 'own'} system prompts, "
                              f"{label}: follow-ups served by the worker holding their "
                              f"conversation {counts['same']}/{counts['follow']} = {share:.1%}; "
                              f"requests per worker {spread}; load average "
                              f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

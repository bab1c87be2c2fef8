"""What ``ZmqEventSubscriber`` recovers, against real publishers, over loopback::

    python benchmarks/scripts/event_recovery.py [--only late-join|long-replay|idle-tail]
                                        [--batches 1000000] [--wait 10]

- ``late-join``: vLLM 0.33's and SGLang 0.5.23's own publishers send 50 batches; then a
  subscriber joins with ``start_seq=0``. How many of the 50 it receives, how many messages it
  counted malformed, and how long it took.
- ``long-replay``: radixcache's publisher sends ``--batches`` batches in one burst whose first
  batch the stream loses, so one replay delivers the whole burst ahead of the stream's
  copies. Deliveries, duplicates and restarts (``resets``) the subscriber counted: a correct
  one delivers each batch once and counts no restart.
- ``idle-tail``: each publisher (radixcache's, vLLM's, SGLang's) sends a burst of 100 whose
  last 95 the stream loses, then goes idle. How many of the 95 the subscriber has within
  ``--wait`` seconds, and when the last one came (its default ``probe_interval`` is 1 s).

The stream's losses are made by the lossy link of the transport tests
(``tests/events/transport_helpers.py``); the engines' publishers are loaded as the interop
tests load them (``tests/events/engine_publishers.py``: SGLang from ``bash
tests/install_sglang.sh``, vLLM's file from ``bash tests/fetch_vllm_kv_events.sh``). An engine
that is not there is reported as skipped. Only public attributes of the subscriber are read,
so the script measures earlier versions alike.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
for _path in (REPO_ROOT, REPO_ROOT / "tests" / "events"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import radixcache.events as ev
from engine_publishers import (
    EnginePublisher,
    load_sglang_kv_events,
    load_vllm_kv_events,
    short_workdir,
)
from transport_helpers import LossyLink

ENGINES = {"vllm": load_vllm_kv_events, "sglang": load_sglang_kv_events}


def engine_modules() -> dict:
    modules = {}
    for name, load in ENGINES.items():
        try:
            modules[name] = load()
        except Exception as exc:  # not installed, not fetched, or failing to import
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
    return modules


def take(sub, last_seq: int, wait_s: float, seqs: list) -> float:
    """Receive into ``seqs`` until batch ``last_seq`` or ``wait_s`` seconds; returns the time
    the last batch came (seconds from the start)."""
    start = time.monotonic()
    came = 0.0
    while (not seqs or seqs[-1] < last_seq) and time.monotonic() - start < wait_s:
        batch = sub.receive(timeout=0.1)
        if batch is not None:
            seqs.append(batch.seq)
            came = time.monotonic() - start
    return came


def late_join(modules: dict, wait_s: float) -> None:
    for name, module in modules.items():
        workdir = short_workdir()
        pub = EnginePublisher(name, module, workdir)
        try:
            for i in range(50):
                pub.publish(i)
            pub.wait_sent()
            sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv",
                                        start_seq=0)
            try:
                seqs: list = []
                came = take(sub, 49, wait_s, seqs)
                recovered = len(set(seqs) & set(range(50)))
                print(f"late-join {name}: recovered {recovered} of 50 in {came:.2f} s, "
                      f"malformed {sub.malformed}, gaps {sub.gap_count}")
            finally:
                sub.close()
        finally:
            pub.shutdown()
            shutil.rmtree(workdir, ignore_errors=True)


def _connect(sub, pub) -> int:
    """Publish clears until the stream is live; the next sequence number."""
    deadline = time.monotonic() + 30
    last = pub.publish([ev.AllBlocksCleared()])
    while (batch := sub.receive(timeout=0.1)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("the subscriber never connected")
        last = pub.publish([ev.AllBlocksCleared()])
    take(sub, last, 30, [batch.seq])
    return last + 1


def long_replay(batches: int, wait_s: float) -> None:
    # Room for the whole burst in the queue (nothing dropped) and in the replay buffer.
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                               buffer_steps=batches + 1_000, max_queue_size=batches + 1_000)
    link = LossyLink(pub.endpoint)
    sub = ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint, hwm=0)
    try:
        first = _connect(sub, pub)
        link.drop = {first}
        start = time.monotonic()
        for i in range(batches):
            if pub.publish([ev.BlockRemoved((i,))]) != first + i:
                raise RuntimeError(f"batch {first + i} was not queued")
        pub.flush()
        published = time.monotonic() - start
        seqs: list = []
        # Past the burst's last batch, what else comes within a second (duplicates,
        # restarted publishers' batches) is counted too.
        came = take(sub, first + batches - 1, wait_s, seqs)
        take(sub, 2**62, 1.0, seqs)
        burst = [s for s in seqs if s >= first]
        print(f"long-replay {batches:,}: {len(burst):,} deliveries of {batches:,} batches "
              f"({len(set(burst)):,} distinct), restarts {sub.resets}, replayed "
              f"{sub.replayed:,}, gaps {sub.gap_count}; published in {published:.1f} s, "
              f"received in {came:.1f} s")
    finally:
        sub.close()
        link.close()
        pub.close()


class _OwnPublisher:
    """radixcache's publisher with the engines' adapter's methods."""

    def __init__(self) -> None:
        self.pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*",
                                        replay_endpoint="tcp://127.0.0.1:*", topic="kv")
        self.endpoint, self.replay_endpoint = self.pub.endpoint, self.pub.replay_endpoint
        self.count = 0

    def publish(self, i: int) -> int:
        self.pub.publish([ev.BlockStored((10_000 + i,), None, (i, i + 1), 2)])
        self.count += 1
        return self.count - 1

    def wait_sent(self) -> None:
        self.pub.flush()

    def shutdown(self) -> None:
        self.pub.close()


def idle_tail(modules: dict, wait_s: float) -> None:
    makers = {"radixcache": lambda workdir: _OwnPublisher()}
    for name, module in modules.items():
        makers[name] = lambda workdir, name=name, module=module: EnginePublisher(
            name, module, workdir)
    for name, make in makers.items():
        workdir = short_workdir()
        pub = make(workdir)
        link = LossyLink(pub.endpoint)
        sub = ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint, topic="kv")
        try:
            deadline = time.monotonic() + 30
            pub.publish(pub.count)
            while (batch := sub.receive(timeout=0.1)) is None:  # until the stream is live
                if time.monotonic() > deadline:
                    raise TimeoutError("the subscriber never connected")
                pub.publish(pub.count)
            pub.wait_sent()
            take(sub, pub.count - 1, 30, [batch.seq])
            first = pub.count
            link.drop = set(range(first + 5, first + 100))
            for i in range(first, first + 100):
                pub.publish(i)
            pub.wait_sent()
            seqs = []
            came = take(sub, first + 99, wait_s, seqs)
            recovered = len(set(seqs) & link.drop)
            probe = getattr(sub, "probe_interval", None)
            print(f"idle-tail {name}: recovered {recovered} of {len(link.dropped)} lost in "
                  f"{wait_s:g} s (last came {came:.2f} s after the burst was sent; "
                  f"probe_interval {probe}, probes {getattr(sub, 'probes', 'n/a')}, "
                  f"gaps {sub.gap_count})")
        finally:
            sub.close()
            link.close()
            pub.shutdown()
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["late-join", "long-replay", "idle-tail"])
    parser.add_argument("--batches", type=int, default=1_000_000)
    parser.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait for what is missing (default 10)")
    args = parser.parse_args()
    modules = engine_modules() if args.only != "long-replay" else {}
    if args.only in (None, "late-join"):
        late_join(modules, args.wait)
    if args.only in (None, "long-replay"):
        long_replay(args.batches, max(args.wait, 600.0))
    if args.only in (None, "idle-tail"):
        idle_tail(modules, args.wait)


if __name__ == "__main__":
    main()

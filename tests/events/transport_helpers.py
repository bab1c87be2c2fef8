"""What the transport tests share: a lossy link between a PUB socket and a subscriber, a
replay client that follows vLLM's and SGLang's protocol, and bounded receive loops.

Every socket here binds 127.0.0.1 on a port the system picks, and every loop is bounded.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable, List, Optional

import zmq

#: The longest any wait may take before a test fails: it only bounds a hang.
WAIT_S = 30.0
#: A replay's end marker, as vLLM, SGLang and radixcache send it.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class LossyLink:
    """Forwards a PUB socket's messages to its own PUB socket (``endpoint``), except those
    whose sequence number is in ``drop``.

    A stand-in for the network: a real PUB socket loses messages only when a subscriber falls
    behind, at no predictable place; this loses exactly the ones a test names, so what the
    subscriber must recover is known. The publisher on the other side is real.
    """

    def __init__(self, upstream: str, drop: Iterable[int] = ()) -> None:
        self.drop = set(drop)
        self.dropped: List[int] = []
        self.forwarded = 0
        self.endpoint: Optional[str] = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(upstream,), daemon=True)
        self._thread.start()
        if not self._ready.wait(WAIT_S) or self.endpoint is None:
            raise RuntimeError("the lossy link did not start")

    def _run(self, upstream: str) -> None:
        # The sockets live and die in this thread: ZeroMQ sockets are not thread-safe.
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        pub = ctx.socket(zmq.PUB)
        try:
            for sock in (sub, pub):
                sock.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            pub.setsockopt(zmq.SNDHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(upstream)
            self.endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
            self._ready.set()
            while not self._stop.is_set():
                if not sub.poll(20):
                    continue
                frames = sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq in self.drop:
                    self.dropped.append(seq)
                else:
                    pub.send_multipart(frames)
                    self.forwarded += 1
        finally:
            self._ready.set()
            sub.close()
            pub.close()
            ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the lossy link did not stop"


def engine_layout_replay(endpoint: str, start_seq: int) -> list:
    """Ask a replay socket for every batch from ``start_seq`` on as vLLM's and SGLang's
    subscribers do (a DEALER sends ``(b"", start_seq)``), and read their layout: one
    ``(b"", topic, seq, payload)`` per batch, then ``(b"", b"", -1, b"")``. Returns
    ``[(topic, seq, payload), ...]``; fails on anything else."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", seq_bytes(start_seq)])
        answer = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "no end marker"
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return answer
            answer.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        dealer.close()
        ctx.term()


def receive_through(sub, last_seq: int, step=None, wait_s: float = WAIT_S) -> list:
    """Receive batches until the one numbered ``last_seq`` (or a later one) arrives; fails
    after ``wait_s`` seconds. ``step()``, when given, runs whenever nothing came within a
    tenth of a second (to keep a publisher going while a subscription connects)."""
    received: list = []
    deadline = time.monotonic() + wait_s
    while not received or received[-1].seq < last_seq:
        assert time.monotonic() < deadline, (
            f"batch {last_seq} never came (got {[b.seq for b in received][-5:]}, "
            f"gaps {sub.gaps}, malformed {sub.malformed})")
        batch = sub.receive(timeout=0.1)
        if batch is None:
            if step is not None:
                step()
            continue
        received.append(batch)
    return received


def connect(sub, publish_one) -> int:
    """Publish with ``publish_one()`` (it returns the sequence number) until ``sub`` receives
    a batch, then take every batch published so far: the stream is live from then on.
    Returns the next sequence number."""
    last = publish_one()
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, "the subscriber never connected"
        batch = sub.receive(timeout=0.1)
        if batch is not None:
            break
        last = publish_one()
    received = [batch]
    if batch.seq < last:
        received += receive_through(sub, last)
    assert received[-1].seq == last
    return last + 1

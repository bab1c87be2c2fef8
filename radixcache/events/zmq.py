"""The ZeroMQ transport: ``ZmqEventPublisher`` and ``ZmqEventSubscriber`` (see "Transport"
in ``radixcache.events``). Imports ``types`` and ``wire`` of the package; pyzmq and msgspec
are imported when a publisher or subscriber is made (``pip install radixcache[events]``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import time
from typing import Iterable, Iterator, Optional

from .types import DEFAULT_ENCODING, KVEvent, _check_encoding
from .wire import (
    ReceivedBatch,
    _batch_wire,
    _check_events,
    _encode,
    _is_builtin_int,
    _transport,
    decode_batch,
)

_END_SEQ = -1  # the sequence number of a replay's end marker


# -- publisher ----------------------------------------------------------------------------

class ZmqEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket from a background thread.

    ``publish(events)`` never blocks on the network: it stamps the batch with the next
    sequence number and the time, and hands it to a queue of ``max_queue_size`` batches; when
    the queue is full the batch is dropped and counted (``dropped``), leaving a gap in the
    sequence numbers that subscribers see. ``encoding`` lays out the events: ``"map"`` (vLLM's
    tagged maps, the default) or ``"positional"`` (tagged arrays, for older consumers). A
    batch that cannot be encoded (a namespace msgpack cannot carry) is counted in ``errors``,
    kept in ``last_error`` and leaves a gap, like a failed send. The last ``buffer_steps`` sent
    batches are kept for the replay socket (``replay_endpoint``, a ROUTER). Both endpoints are
    bound; ``endpoint`` and ``replay_endpoint`` hold the resolved addresses
    (``tcp://127.0.0.1:*`` picks a port). Use it as a context manager, or call ``close()``.
    Needs pyzmq and msgspec (``pip install radixcache[events]``).

    Args:
        endpoint: The ZeroMQ address the PUB socket binds (default ``"tcp://*:5557"``).
        replay_endpoint: The address the replay ROUTER socket binds, or None for no replay.
        topic: The topic frame of every message (subscribers filter on its prefix).
        buffer_steps: How many sent batches the replay socket keeps, an int >= 0.
        max_queue_size: How many batches may wait for the sending thread, an int >= 1.
        data_parallel_rank: The rank sent in every batch, or None.
        hwm: The PUB socket's send high-water mark, an int >= 0.
        encoding: ``"map"`` or ``"positional"``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an unknown ``encoding``, or a count below its minimum.
        ImportError: pyzmq or msgspec is not installed.
        zmq.ZMQError: an endpoint cannot be bound.
    """

    _IDLE_WAIT_S = 0.1
    _REPLAY_POLL_S = 0.005
    _CLOSE_TIMEOUT_S = 10.0

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: Optional[str] = None,
                 topic: str = "", buffer_steps: int = 10_000, *,
                 max_queue_size: int = 100_000, data_parallel_rank: Optional[int] = 0,
                 hwm: int = 100_000, encoding: str = DEFAULT_ENCODING) -> None:
        zmq, msgspec = _transport("ZmqEventPublisher")
        self.encoding = _check_encoding(encoding)
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError(
                f"replay_endpoint must be a str or None, got {type(replay_endpoint).__name__}"
            )
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, value, low in (("buffer_steps", buffer_steps, 0),
                                 ("max_queue_size", max_queue_size, 1), ("hwm", hwm, 0)):
            if not _is_builtin_int(value):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if data_parallel_rank is not None and not _is_builtin_int(data_parallel_rank):
            raise TypeError("data_parallel_rank must be an int or None")
        self._zmq = zmq
        self._msgspec = msgspec
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic_bytes = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = None
        self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for one full replay per client without silently dropping its tail.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets(linger=0)
            raise
        self._queue: queue.Queue = queue.Queue(max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._next_seq = 0
        self._queued = 0
        self._handled = 0
        self.dropped = 0
        self.sent = 0
        self.errors = 0
        self.last_error: Optional[BaseException] = None
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixcache-kv-events",
                                        daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------
    def publish(self, events: Iterable[KVEvent]) -> Optional[int]:
        """Queue one batch for sending; never blocks on the network.

        Args:
            events: The batch's KV events, in order (``RadixCache.take_events()``).

        Returns:
            The batch's sequence number, or None if it was empty (nothing is sent) or
            dropped because the queue was full.

        Raises:
            TypeError: an item that is not a KV event.
            RuntimeError: the publisher is closed.
        """
        batch = _check_events(events)
        if not batch:
            return None
        with self._lock:
            if self._closing:
                raise RuntimeError("publish() on a closed ZmqEventPublisher")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, time.time(), batch))
            except queue.Full:
                self.dropped += 1
                return None
            self._queued += 1
        return seq

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued batch went out (or failed to encode, see ``errors``).

        Args:
            timeout: The most seconds to wait (None: as long as it takes).

        Returns:
            True if the queue drained, False if ``timeout`` seconds passed first.
        """
        with self._done:
            return self._done.wait_for(lambda: self._handled >= self._queued, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the sending thread and close the sockets.

        Calling it again does nothing.

        Args:
            timeout: The most seconds to wait for the queue to drain, and the sockets' linger.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self.flush(timeout)
        self._closed = True
        self._thread.join(self._CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # never close sockets another thread still uses
            return
        self._close_sockets(linger=int(timeout * 1000))

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
                f"{self.replay_endpoint!r}, encoding={self.encoding!r}, sent={self.sent}, "
                f"dropped={self.dropped})")

    # -- background thread ---------------------------------------------------------------
    def _run(self) -> None:
        encoder = self._msgspec.msgpack.Encoder()
        wait = self._REPLAY_POLL_S if self._replay is not None else self._IDLE_WAIT_S
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                seq, ts, batch = self._queue.get(timeout=wait)
            except queue.Empty:
                if self._closed:
                    return
                continue
            try:
                payload = _encode(encoder, _batch_wire(ts, batch, self.data_parallel_rank,
                                                       self.encoding))
                self._pub.send_multipart(
                    (self._topic_bytes, seq.to_bytes(8, "big", signed=True), payload),
                    copy=False,
                )
                self._buffer.append((seq, payload))
                self.sent += 1
            except Exception as exc:  # keep serving; the subscriber sees a gap
                self.errors += 1
                self.last_error = exc
            with self._done:
                self._handled += 1
                self._done.notify_all()

    def _serve_replays(self) -> None:
        zmq = self._zmq
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.errors += 1
                continue
            identity = frames[0]
            start = int.from_bytes(frames[2], "big", signed=True)
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart(
                            (identity, b"", seq.to_bytes(8, "big", signed=True), payload),
                            flags=zmq.NOBLOCK)
                replay.send_multipart(
                    (identity, b"", _END_SEQ.to_bytes(8, "big", signed=True), b""),
                    flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.errors += 1
                self.last_error = exc


# -- subscriber ---------------------------------------------------------------------------

class ZmqEventSubscriber:
    """Receives event batches in sequence order, filling gaps from the replay socket.

    ``receive(timeout)`` returns the next :class:`ReceivedBatch` or None after ``timeout``
    seconds without one; iterating yields batches until one does not come within
    ``timeout`` (None: forever). With ``start_seq`` and ``replay_endpoint`` the subscriber
    first asks for every buffered batch from ``start_seq`` on, so one that joins late
    recovers the earlier batches. A batch that neither the stream nor the replay delivers
    (dropped by the publisher, or gone from its buffer) is skipped and listed in ``gaps`` as
    an inclusive ``(first_seq, last_seq)`` range (the latest ``MAX_GAPS``; ``gap_count`` and
    ``missed`` count every gap and batch). ``replayed`` counts batches that came through
    replay, ``malformed`` frames that were ignored; ``hwm`` is the SUB socket's receive
    high-water mark. A replay that ends without its end marker for ``replay_timeout`` seconds
    is abandoned (what it missed becomes a gap); ``receive(timeout)`` never waits past its
    own timeout for it, the replay goes on at the next call.

    A publisher that restarts on the same endpoints starts its sequence again at 0. A
    stream batch below what was already delivered is a stale duplicate only when replay
    delivered that very batch (the same payload) ahead of the stream; one publisher's PUB
    stream never goes back, so anything else is a reset. It is counted in ``resets``, the
    new publisher's batches are delivered from its first one on (replayed when the stream missed them), and the first of them is marked
    ``ReceivedBatch.restarted``, so ``KvIndexer.apply`` drops what the worker held before. A
    restart whose first batch the subscriber sees has a sequence number above every one the
    old publisher sent cannot be told from a gap: it is filled from the new publisher's
    replay and recorded as a gap if it cannot be.

    Payloads are decoded by ``decode_batch``, so either encoding is read; one it rejects
    makes ``receive`` raise its ValueError, and the next call goes on with the batch after
    it. Use it as a context manager, or call ``close()``. Needs pyzmq and msgspec
    (``pip install radixcache[events]``).

    Args:
        endpoint: The publisher's PUB address to connect to (its ``endpoint``).
        replay_endpoint: The publisher's replay address (its ``replay_endpoint``), or None
            for no gap filling.
        topic: Receive only messages whose topic starts with this.
        start_seq: The first sequence number wanted (with ``replay_endpoint``: replayed from
            the publisher's buffer first), or None to start with whatever comes.
        timeout: Seconds iteration waits for the next batch before it ends (None: forever).
        replay_timeout: Seconds a replay may go silent before it is abandoned.
        hwm: The SUB socket's receive high-water mark.

    Raises:
        TypeError: an endpoint or topic of the wrong type.
        ValueError: ``start_seq`` is not a non-negative int or None.
        ImportError: pyzmq or msgspec is not installed.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 topic: str = "", start_seq: Optional[int] = None,
                 timeout: Optional[float] = None, replay_timeout: float = 2.0,
                 hwm: int = 100_000) -> None:
        zmq, _ = _transport("ZmqEventSubscriber")
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError("replay_endpoint must be a str or None")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if start_seq is not None and (not _is_builtin_int(start_seq) or start_seq < 0):
            raise ValueError(f"start_seq must be a non-negative int or None, got {start_seq!r}")
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.timeout = timeout
        self.replay_timeout = replay_timeout
        self._ctx = zmq.Context()
        self._sub = None
        self._replay = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._new_replay_socket()
        except Exception:
            self.close()
            raise
        self._expected = start_seq
        self._initial_replay = start_seq is not None and self._replay is not None
        self._pending: collections.deque = collections.deque()
        # A replay in flight: when it gives up, and the stream frames that wait for it.
        self._replay_deadline: Optional[float] = None
        self._backlog: collections.deque = collections.deque()
        self._stream_last: Optional[int] = None  # the last sequence number the stream sent
        # seq -> hash of the payload, for batches replay delivered that the stream has not
        # passed yet: how a stale duplicate is told from a restarted publisher's batch
        self._replayed: dict = {}
        self._restart_next = False
        self._gaps: collections.deque = collections.deque(maxlen=self.MAX_GAPS)
        self.gap_count = 0
        self.missed = 0
        self.replayed = 0
        self.malformed = 0
        self.resets = 0

    #: How many gap ranges ``gaps`` keeps (the latest); ``gap_count`` and ``missed`` count all.
    MAX_GAPS = 1000
    #: How many replayed batches are remembered (a hash each) to recognise their stream copy.
    MAX_REPLAYED = 100_000

    @property
    def gaps(self) -> list:
        """The latest ``MAX_GAPS`` gaps, as inclusive ``(first_seq, last_seq)`` ranges."""
        return list(self._gaps)

    def _new_replay_socket(self):
        # DEALER, not REQ: one request is answered by many messages.
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        return sock

    @property
    def next_seq(self) -> Optional[int]:
        """The sequence number expected next (None before the first batch)."""
        return self._expected

    def receive(self, timeout: Optional[float] = None) -> Optional[ReceivedBatch]:
        """Receive the next batch in sequence order, filling gaps from the replay socket.

        Returns within ``timeout`` in every state: every wait polls with the time left; a
        replay in flight carries on at the next call.

        Args:
            timeout: The most seconds to wait (None: as long as it takes).

        Returns:
            A ``ReceivedBatch``, or None when none arrived within ``timeout`` seconds.

        Raises:
            ValueError: the batch's payload is malformed (the next call goes on with the
                batch after it).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._initial_replay:
            self._initial_replay = False
            self._start_replay(self._expected)
        while not self._pending:
            if self._replay_deadline is not None:
                if not self._step_replay(deadline):
                    return None
                continue
            if not self._sub.poll(self._wait_ms(deadline)):
                return None
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            self._on_stream(int.from_bytes(frames[1], "big", signed=True), frames[2])
        seq, payload, restarted = self._pending.popleft()
        batch = decode_batch(payload, seq)
        if restarted:
            batch = dataclasses.replace(batch, restarted=True)
        return batch

    @staticmethod
    def _wait_ms(deadline: Optional[float], limit: Optional[float] = None) -> int:
        """Milliseconds to poll: until the earlier of ``deadline`` and ``limit`` (-1: forever),
        rounded up so a poll never returns before its deadline."""
        ends = [t for t in (deadline, limit) if t is not None]
        if not ends:
            return -1
        return max(0, math.ceil((min(ends) - time.monotonic()) * 1000))

    def _on_stream(self, seq: int, payload: bytes) -> None:
        """A batch from the PUB stream, which one publisher sends in increasing order."""
        digests = self._replayed
        if self._expected is not None and seq < self._expected:
            # Below what was delivered: a stale duplicate is a batch that replay delivered
            # ahead of the stream, byte for byte; anything else is a new publisher on the
            # same endpoints (it starts again at 0). The stream itself never goes back.
            stale = ((self._stream_last is None or seq > self._stream_last)
                     and digests.get(seq) == hash(payload))
            if not stale:
                self.resets += 1
                digests.clear()
                self._expected = 0
                self._restart_next = True
        self._stream_last = seq
        while digests and next(iter(digests)) <= seq:  # the stream is past them
            del digests[next(iter(digests))]
        if (self._expected is not None and seq > self._expected
                and self._replay is not None):
            self._backlog.append((seq, payload))
            self._start_replay(self._expected)
            return
        self._accept(seq, payload)

    def _accept(self, seq: int, payload: bytes) -> bool:
        """Queue batch ``seq`` unless already delivered; record any gap it reveals."""
        if self._expected is None:
            self._expected = seq
        if seq < self._expected:
            return False  # already delivered (replay and stream overlap)
        if seq > self._expected:
            self._gaps.append((self._expected, seq - 1))
            self.gap_count += 1
            self.missed += seq - self._expected
        self._pending.append((seq, payload, self._restart_next))
        self._restart_next = False
        self._expected = seq + 1
        return True

    def _start_replay(self, start: int) -> None:
        """Ask for every buffered batch from ``start`` on; ``_step_replay`` takes the answer."""
        self._replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        self._replay_deadline = time.monotonic() + self.replay_timeout

    def _step_replay(self, deadline: Optional[float]) -> bool:
        """Take one replay message, or end the replay; False when ``deadline`` came first."""
        if not self._replay.poll(self._wait_ms(deadline, self._replay_deadline)):
            if time.monotonic() < self._replay_deadline:
                return False  # the caller's deadline; the replay carries on next call
            # No end marker: drop the socket so late replies cannot confuse the next ask.
            self._replay.close(linger=0)
            self._replay = self._new_replay_socket()
            self._end_replay()
            return True
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            self.malformed += 1
            return True
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == _END_SEQ:
            self._end_replay()
        elif self._accept(seq, frames[2]):
            self.replayed += 1
            if len(self._replayed) < self.MAX_REPLAYED:
                self._replayed[seq] = hash(frames[2])
        return True

    def _end_replay(self) -> None:
        # The stream frames that waited go on in order; a gap left now is a real gap.
        self._replay_deadline = None
        backlog = self._backlog
        while backlog:
            self._accept(*backlog.popleft())

    def __iter__(self) -> Iterator[ReceivedBatch]:
        """Yield batches in order until none comes within ``timeout`` seconds."""
        while True:
            batch = self.receive(self.timeout)
            if batch is None:
                return
            yield batch

    def close(self) -> None:
        """Close the sockets (pending messages are dropped)."""
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


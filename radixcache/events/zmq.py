"""The ZeroMQ transport: ``ZmqEventPublisher`` and ``ZmqEventSubscriber`` (see "Transport"
in ``radixcache.events``). Imports ``types`` and ``wire`` of the package; pyzmq and msgspec
are imported when a publisher or subscriber is made (``pip install radixcache[events]``).

The replay protocol is vLLM's and SGLang's: a DEALER asks a ROUTER with ``(b"", start_seq)``;
the answer is one message ``(b"", topic, seq, payload)`` per buffered batch from
``start_seq`` on, then the end marker ``(b"", b"", -1, b"")``. Sequence numbers are 8 bytes,
big endian. The subscriber also reads the three-frame answers, ``(b"", seq, payload)``, that
radixcache's publisher sent before it followed the engines.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import math
import queue
import threading
import time
from array import array
from bisect import bisect_left
from typing import Any, Iterable, Iterator, Optional

from .._validate import check_int, is_real
from .hashing import _page_hash_core
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
_END_SEQ_BYTES = _END_SEQ.to_bytes(8, "big", signed=True)
#: The longest single wait on a socket, in milliseconds: longer waits poll again (a poll's
#: timeout is a C int of milliseconds, about 24.8 days at most).
_MAX_POLL_MS = 3_600_000


def _check_timeout(value: Any, what: str) -> Optional[float]:
    """Seconds to wait as a float, or None for no limit (``None`` or infinity).

    Raises:
        TypeError: not a number (a bool is not one).
        ValueError: NaN or negative.
    """
    if value is None:
        return None
    if not is_real(value):
        raise TypeError(f"{what} must be a number of seconds or None, got "
                        f"{type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number of seconds >= 0 or None, got nan")
    if seconds < 0:
        raise ValueError(f"{what} must be >= 0 seconds or None, got {seconds:g}")
    return None if math.isinf(seconds) else seconds


def _deadline(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else time.monotonic() + seconds


def _wait_ms(*ends: Optional[float]) -> int:
    """Milliseconds to poll: until the earliest of ``ends`` (monotonic times; None: no
    limit, -1 when all are None), rounded up so a poll never returns before its end, and at
    most ``_MAX_POLL_MS`` (the caller polls again)."""
    finite = [end for end in ends if end is not None]
    if not finite:
        return -1
    left = math.ceil((min(finite) - time.monotonic()) * 1000)
    return min(_MAX_POLL_MS, max(0, left))


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# -- publisher ----------------------------------------------------------------------------

class ZmqEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket from a background thread.

    ``publish(events)`` never blocks on the network: it stamps the batch with the next
    sequence number and the time, and hands it to a queue of ``max_queue_size`` batches; when
    the queue is full the batch is dropped and counted (``dropped``), leaving a gap in the
    sequence numbers that subscribers see. ``encoding`` lays out the events: ``"map"`` (vLLM's
    tagged maps, the default) or ``"positional"`` (tagged arrays, for older consumers). A
    batch that cannot be encoded (a namespace msgpack cannot carry, a ``cache_salt`` in the
    positional encoding) is counted in ``errors``, kept in ``last_error`` and leaves a gap,
    like a failed send. The last ``buffer_steps`` sent
    batches are kept for the replay socket (``replay_endpoint``, a ROUTER), which answers as
    vLLM's and SGLang's do: a request ``(b"", start_seq)`` gets ``(b"", topic, seq, payload)``
    for every buffered batch from ``start_seq`` on, then ``(b"", b"", -1, b"")``. Both
    endpoints are bound; ``endpoint`` and ``replay_endpoint`` hold the resolved addresses
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
    #: Seconds ``close`` gives the sending thread, past its timeout, to finish what it holds.
    _THREAD_EXIT_S = 1.0

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
        self._sockets_closed = False
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
        # Guards what the sending thread and close() share: the counts flush() waits on,
        # whether the thread has ended, and whether it must close the sockets when it does.
        self._done = threading.Condition()
        self._next_seq = 0
        self._queued = 0
        self._handled = 0
        self.dropped = 0
        self.sent = 0
        self.errors = 0
        self.last_error: Optional[BaseException] = None
        self._closing = False
        self._stop = False  # the sending thread takes no more batches
        self._thread_done = False
        self._thread_closes_sockets: Optional[int] = None  # the linger it closes them with
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
            RuntimeError: the publisher is closed, or its sending thread has stopped.
        """
        batch = _check_events(events)
        if not batch:
            return None
        with self._lock:
            if self._closing:
                raise RuntimeError("publish() on a closed ZmqEventPublisher")
            if self._thread_done:
                raise RuntimeError(
                    f"the sending thread of this ZmqEventPublisher has stopped "
                    f"(last error: {self.last_error!r})")
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
            timeout: The most seconds to wait (None or ``math.inf``: as long as it takes).

        Returns:
            True if the queue drained, False if ``timeout`` seconds passed first (or the
            sending thread stopped with batches left).

        Raises:
            TypeError, ValueError: a ``timeout`` that is not a number >= 0 or None.
        """
        wait = _check_timeout(timeout, "timeout")
        with self._done:
            self._done.wait_for(lambda: self._handled >= self._queued or self._thread_done,
                                wait)
            return self._handled >= self._queued

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Send what is queued, stop the sending thread and close the sockets and context.

        Waits up to ``timeout`` seconds for the queue to drain; batches still queued then are
        not sent (they count in ``dropped``). The sockets linger for what is left of the
        timeout to deliver what was sent. The sockets and the context are always released:
        here, or, if the sending thread is still busy past the timeout (a batch whose
        encoding does not return), by that thread as soon as it is done. Calling it again
        does nothing.

        Args:
            timeout: The most seconds to wait (None or ``math.inf``: until all is sent).

        Raises:
            TypeError, ValueError: a ``timeout`` that is not a number >= 0 or None (nothing
                is closed then).
        """
        wait = _check_timeout(timeout, "timeout")
        with self._lock:
            if self._closing:
                return
            self._closing = True
        deadline = _deadline(wait)
        self.flush(wait)
        self._stop = True
        self._thread.join(None if deadline is None
                          else max(0.0, deadline - time.monotonic()) + self._THREAD_EXIT_S)
        linger = -1 if deadline is None else _wait_ms(deadline)
        with self._done:
            if not self._thread_done:  # never close sockets another thread still uses
                self._thread_closes_sockets = linger
                return
        self._close_sockets(linger)

    def _close_sockets(self, linger: int) -> None:
        if self._sockets_closed:
            return
        self._sockets_closed = True
        try:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    sock.close(linger=linger)
        finally:
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
        try:
            self._send_loop()
        finally:
            self._finish_thread()

    def _send_loop(self) -> None:
        encoder = self._msgspec.msgpack.Encoder()
        wait = self._REPLAY_POLL_S if self._replay is not None else self._IDLE_WAIT_S
        while not self._stop:
            if self._replay is not None:
                try:
                    self._serve_replays()
                except Exception as exc:  # a socket error: keep publishing
                    self.errors += 1
                    self.last_error = exc
            try:
                seq, ts, batch = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            try:
                payload = _encode(encoder, _batch_wire(ts, batch, self.data_parallel_rank,
                                                       self.encoding))
                self._pub.send_multipart((self._topic_bytes, _seq_bytes(seq), payload),
                                         copy=False)
                self._buffer.append((seq, payload))
                self.sent += 1
            except Exception as exc:  # keep serving; the subscriber sees a gap
                self.errors += 1
                self.last_error = exc
            with self._done:
                self._handled += 1
                self._done.notify_all()

    def _finish_thread(self) -> None:
        """The thread's last act, however it ends: what is still queued will never be sent
        (it counts as dropped), flush() waiters wake, and the sockets are closed here when
        close() gave up waiting for this thread."""
        left = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            left += 1
        with self._lock:
            self.dropped += left
        with self._done:
            self._handled += left
            self._thread_done = True
            self._done.notify_all()
            linger = self._thread_closes_sockets
        if linger is not None:
            self._close_sockets(linger)

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
            tail = []  # newest first: a request for the last few batches reads only those
            for seq, payload in reversed(self._buffer):
                if seq < start:
                    break
                tail.append((seq, payload))
            try:
                for seq, payload in reversed(tail):
                    if self._stop:  # closing: the client sees a replay without its end
                        return
                    replay.send_multipart(
                        (identity, b"", self._topic_bytes, _seq_bytes(seq), payload),
                        flags=zmq.NOBLOCK)
                replay.send_multipart((identity, b"", b"", _END_SEQ_BYTES, b""),
                                      flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.errors += 1
                self.last_error = exc


# -- subscriber ---------------------------------------------------------------------------

class _Digests:
    """Digests of the batches replay delivered ahead of the stream, in sequence order, the
    latest ``limit`` of them (16 bytes each): how the stream's late copy of a batch is told
    from a restarted publisher's batch with the same number."""

    __slots__ = ("_hashes", "_head", "_seqs", "limit")

    def __init__(self, limit: int) -> None:
        self._seqs = array("q")
        self._hashes = array("q")
        self._head = 0  # entries before it are forgotten
        self.limit = limit

    def __len__(self) -> int:
        return len(self._seqs) - self._head

    def add(self, seq: int, digest: int) -> None:
        if len(self._seqs) > self._head and seq <= self._seqs[-1]:
            self.clear()  # never out of order (a reset starts again from nothing)
        self._seqs.append(seq)
        self._hashes.append(digest)
        if len(self) > self.limit:
            self._head += 1
            self._compact()

    def pop_through(self, seq: int) -> Optional[int]:
        """The digest kept for ``seq`` (None if none), forgetting every one up to ``seq``:
        the stream, which never goes back, is past them."""
        seqs = self._seqs
        end = len(seqs)
        at = bisect_left(seqs, seq, self._head, end)
        found = self._hashes[at] if at < end and seqs[at] == seq else None
        self._head = at + (found is not None)
        self._compact()
        return found

    def clear(self) -> None:
        del self._seqs[:]
        del self._hashes[:]
        self._head = 0

    def _compact(self) -> None:
        head = self._head
        if head == len(self._seqs):
            self.clear()
        elif head > 4096 and 2 * head > len(self._seqs):
            del self._seqs[:head]
            del self._hashes[:head]
            self._head = 0


def _stream_seq(frames: list) -> Optional[int]:
    """The sequence number of a PUB message ``(topic, seq, payload)``, None if malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    seq = int.from_bytes(frames[1], "big", signed=True)
    return seq if seq >= 0 else None


def _replay_message(frames: list) -> Optional[tuple]:
    """``(seq, payload)`` of a replay answer, ``(_END_SEQ, b"")`` for its end marker, None
    if malformed. Reads the engines' ``(b"", topic, seq, payload)`` and radixcache's older
    ``(b"", seq, payload)``; the topic is not checked (one publisher sends one topic, and
    the end marker's is empty)."""
    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
        return None
    seq = int.from_bytes(frames[-2], "big", signed=True)
    if seq == _END_SEQ:
        return _END_SEQ, b""
    return (seq, frames[-1]) if seq >= 0 else None


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
    replay, ``malformed`` messages that were ignored; ``hwm`` is the SUB socket's receive
    high-water mark. The replay protocol is vLLM's and SGLang's (their publishers and
    radixcache's are read alike; see ``radixcache.events.zmq``). An answer that loses
    messages on the way (a hole inside it, or silence once it began) is asked for again
    from the first one missing, up to ``MAX_REPLAY_RETRIES`` times. A replay that goes
    silent for ``replay_timeout`` seconds before its end marker is abandoned (what it
    missed becomes a gap); ``receive(timeout)`` never waits past its own timeout for it,
    the replay goes on at the next call.

    A gap at the end of a burst shows in no later batch: when nothing arrived for
    ``probe_interval`` seconds, ``receive`` asks the replay socket for the batches after the
    last one delivered (a probe, counted in ``probes``). One probe per quiet interval at
    most, never while a replay runs; its answer is only what this subscriber lacks (an idle
    publisher answers with its end marker alone), and a probe is abandoned after
    ``min(replay_timeout, probe_interval)`` seconds of silence.

    A publisher that restarts on the same endpoints starts its sequence again at 0. A
    stream batch below what was already delivered is the stream's late copy of a batch that
    replay delivered first (the same payload) or recorded as missed, when the stream has
    not gone back; one publisher's PUB stream never goes back, so anything else is a reset.
    It is counted in ``resets``, the new publisher's batches are delivered from its first one
    on (replayed when the stream missed them), and the first of them is marked
    ``ReceivedBatch.restarted``, so ``KvIndexer.apply`` drops what the worker held before.
    The comparison keeps a digest of each of the latest ``MAX_REPLAYED`` batches replay
    delivered ahead of the stream (16 bytes each, forgotten as the stream passes them), so a
    replay of any length is delivered once. A restart whose first batch the subscriber sees
    has a sequence number above every one the old publisher sent cannot be told from a gap:
    it is filled from the new publisher's replay and recorded as a gap if it cannot be.

    Payloads are decoded by ``decode_batch``, so either encoding is read; one it rejects
    makes ``receive`` raise its ValueError, and the next call goes on with the batch after
    it (marked ``restarted`` if the rejected one was). Use it as a context manager, or call
    ``close()``. Needs pyzmq and msgspec (``pip install radixcache[events]``).

    Args:
        endpoint: The publisher's PUB address to connect to (its ``endpoint``).
        replay_endpoint: The publisher's replay address (its ``replay_endpoint``), or None
            for no gap filling.
        topic: Receive only messages whose topic starts with this.
        start_seq: The first sequence number wanted (with ``replay_endpoint``: replayed from
            the publisher's buffer first), or None to start with whatever comes.
        timeout: Seconds iteration waits for the next batch before it ends (None or
            ``math.inf``: forever).
        replay_timeout: Seconds a replay may go silent before it is abandoned (None or
            ``math.inf``: never).
        probe_interval: Seconds of quiet after which the replay socket is probed for a lost
            tail, > 0 (None or ``math.inf``: never).
        hwm: The SUB socket's receive high-water mark, an int >= 0.
        decode: False: ``receive`` hands each batch over undecoded, its ``payload`` set and
            ``events`` empty (``ts`` 0.0, ``data_parallel_rank`` None), for a consumer that
            reads payloads itself (``KvIndexer.apply_payload`` reads one in a single call
            into the block module); a malformed payload is then the consumer's to find.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``start_seq`` is not a non-negative int or None, or a number of seconds
            or ``hwm`` is out of range.
        ImportError: pyzmq or msgspec is not installed.
    """

    #: How many gap ranges ``gaps`` keeps (the latest); ``gap_count`` and ``missed`` count all.
    MAX_GAPS = 1000
    #: How many replayed batches are remembered (the latest, a digest each) to recognise
    #: their late copies on the stream (16 MB at most).
    MAX_REPLAYED = 1_000_000
    #: How many times in a row a replay whose answer lost messages on the way is asked again,
    #: from the first one missing, without getting further, before what is still missing
    #: counts as a gap (an answer that got further starts the count again).
    MAX_REPLAY_RETRIES = 3

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 topic: str = "", start_seq: Optional[int] = None,
                 timeout: Optional[float] = None, replay_timeout: Optional[float] = 2.0,
                 probe_interval: Optional[float] = 1.0, hwm: int = 100_000,
                 decode: bool = True) -> None:
        self._closed = True  # until the sockets exist: close() has nothing to release
        zmq, _ = _transport("ZmqEventSubscriber")
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError("replay_endpoint must be a str or None")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if start_seq is not None and (not _is_builtin_int(start_seq) or start_seq < 0):
            raise ValueError(f"start_seq must be a non-negative int or None, got {start_seq!r}")
        if not _is_builtin_int(hwm):
            raise TypeError(f"hwm must be an int, got {type(hwm).__name__}")
        if hwm < 0:
            raise ValueError(f"hwm must be >= 0, got {hwm}")
        if not isinstance(decode, bool):
            raise TypeError(f"decode must be a bool, got {type(decode).__name__}")
        self._decode = decode
        self.timeout = timeout
        self.replay_timeout = replay_timeout
        self.probe_interval = probe_interval
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context()
        self._closed = False
        self._sub = None
        self._replay = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
            self._sub_handle = self._sub.underlying  # libzmq's socket, for recv_stream
            if replay_endpoint is not None:
                self._replay = self._new_replay_socket()
        except Exception:
            self.close()
            raise
        self._read_stream = None  # the block module's recv_stream, once it is needed
        self._expected = start_seq
        self._initial_replay = start_seq is not None and self._replay is not None
        self._pending: collections.deque = collections.deque()
        # A replay in flight: whether one is, when its silence abandons it (None: never),
        # whether it is a probe, whether its answer has begun, how many more times it may
        # be asked again, and the stream messages that wait for it.
        self._replay_active = False
        self._replay_deadline: Optional[float] = None
        self._probing = False
        self._replay_heard = False
        self._retries_left = 0
        self._retry_from = 0  # where the last ask of the replay in flight started
        self._backlog: collections.deque = collections.deque()
        self._stream_last: Optional[int] = None  # the last sequence number the stream sent
        self._digests = _Digests(self.MAX_REPLAYED)
        self._restart_next = False  # the next batch accepted starts a restarted publisher
        self._restart_owed = False  # a restarted batch was rejected: mark the next one
        self._last_heard = time.monotonic()  # a batch, or the end of a replay
        self._last_contact: Optional[float] = None  # any message from the publisher
        self._gaps: collections.deque = collections.deque(maxlen=self.MAX_GAPS)
        self.gap_count = 0
        self.missed = 0
        self.replayed = 0
        self.malformed = 0
        self.resets = 0
        self.probes = 0
        self._deferred: Optional[ValueError] = None  # receive_many's error for the next call

    # -- options -------------------------------------------------------------------------
    @property
    def timeout(self) -> Optional[float]:
        """Seconds iteration waits for the next batch (None: forever)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: Optional[float]) -> None:
        self._timeout = _check_timeout(value, "timeout")

    @property
    def replay_timeout(self) -> Optional[float]:
        """Seconds a replay may go silent before it is abandoned (None: never)."""
        return self._replay_timeout

    @replay_timeout.setter
    def replay_timeout(self, value: Optional[float]) -> None:
        self._replay_timeout = _check_timeout(value, "replay_timeout")

    @property
    def probe_interval(self) -> Optional[float]:
        """Seconds of quiet before the replay socket is probed for a lost tail (None:
        never)."""
        return self._probe_interval

    @probe_interval.setter
    def probe_interval(self, value: Optional[float]) -> None:
        seconds = _check_timeout(value, "probe_interval")
        if seconds == 0:
            raise ValueError("probe_interval must be > 0 seconds or None, got 0")
        self._probe_interval = seconds

    @property
    def gaps(self) -> list:
        """The latest ``MAX_GAPS`` gaps, as inclusive ``(first_seq, last_seq)`` ranges."""
        return list(self._gaps)

    @property
    def sockets(self) -> list:
        """The sockets a batch can arrive on (the SUB socket, and the replay socket when
        there is one; a replay may replace it): one thread serving many subscribers polls
        them together (``zmq.Poller``) and calls ``receive(0)`` on those ready, and on every
        subscriber now and then for its probes and replay timeouts."""
        return [s for s in (self._sub, self._replay) if s is not None]

    @property
    def next_seq(self) -> Optional[int]:
        """The sequence number expected next (None before the first batch)."""
        return self._expected

    @property
    def replaying(self) -> bool:
        """True while a replay asked for (the first one from ``start_seq``, or one filling a
        gap; not a probe) has not ended, or batches it delivered wait to be received."""
        return (self._initial_replay or (self._replay_active and not self._probing)
                or bool(self._pending) or bool(self._backlog))

    @property
    def last_contact(self) -> Optional[float]:
        """When the publisher was last heard from (``time.monotonic()``): a batch on the
        stream or any answer on the replay socket, a probe's lone end marker included; None
        before the first. With a replay socket and probes on, a live publisher is heard from
        about every ``probe_interval`` seconds even when it publishes nothing, so a contact
        older than a few intervals means it stopped (or is unreachable)."""
        return self._last_contact

    def _new_replay_socket(self):
        # DEALER, not REQ: one request is answered by many messages. No receive limit: the
        # answer is what was asked for, and a full queue would make the publisher's ROUTER
        # drop the rest of it (SGLang's sends up to 1,000 messages ahead).
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.RCVHWM, 0)
        sock.connect(self.replay_endpoint)
        return sock

    # -- receiving -----------------------------------------------------------------------
    def receive(self, timeout: Optional[float] = None) -> Optional[ReceivedBatch]:
        """Receive the next batch in sequence order, filling gaps from the replay socket.

        Returns within ``timeout`` in every state: every wait polls with the time left; a
        replay in flight carries on at the next call.

        Args:
            timeout: The most seconds to wait (None or ``math.inf``: as long as it takes).

        Returns:
            A ``ReceivedBatch``, or None when none arrived within ``timeout`` seconds.

        Raises:
            ValueError: the batch's payload is malformed (the next call goes on with the
                batch after it), or ``timeout`` is negative or NaN.
            TypeError: ``timeout`` is not a number or None.
            RuntimeError: the subscriber is closed.
        """
        deadline = _deadline(_check_timeout(timeout, "timeout"))
        if self._closed:
            raise RuntimeError("receive() on a closed ZmqEventSubscriber")
        if self._initial_replay:
            self._initial_replay = False
            self._start_replay(self._expected)
        while not self._pending:
            if self._replay_active:
                if not self._step_replay(deadline):
                    return None
                continue
            probe_at = self._probe_at()
            if (probe_at is not None and time.monotonic() >= probe_at
                    and not self._sub.poll(0)):
                self.probes += 1
                self._start_replay(self._expected, probe=True)
                continue
            if not self._sub.poll(_wait_ms(deadline, probe_at)):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue  # a probe is due, or a long wait polls again
            frames = self._sub.recv_multipart()
            seq = _stream_seq(frames)
            if seq is None:
                self.malformed += 1
                continue
            self._last_heard = self._last_contact = time.monotonic()
            self._on_stream(seq, frames[2])
        seq, payload, restarted = self._pending.popleft()
        restarted = restarted or self._restart_owed
        if not self._decode:
            self._restart_owed = False
            return ReceivedBatch(seq, 0.0, [], None, payload, restarted)
        try:
            batch = decode_batch(payload, seq)
        except ValueError:
            self._restart_owed = restarted  # the restart is not lost with its batch
            raise
        self._restart_owed = False
        if restarted:
            batch = dataclasses.replace(batch, restarted=True)
        return batch

    def receive_many(self, limit: int) -> list:
        """The batches that have already arrived, up to ``limit``, without waiting: what
        ``receive(0)`` called until it returns None (or ``limit`` times) returns, in one
        call. A subscriber that hands payloads over undecoded (``decode=False``) reads the
        stream's batches that come in order straight off its socket, without the
        bookkeeping of a call per batch; anything else (a gap, a replay, a restart, a probe
        due) goes the way ``receive`` takes it.

        Args:
            limit: The most batches returned, an int >= 1.

        Returns:
            The batches, in order (empty when none has arrived).

        Raises:
            ValueError: a malformed payload (``decode=True``) met before any batch: raised
                as ``receive`` raises it; met after some, it is raised by the next call. Or
                ``limit`` is below 1.
            TypeError: ``limit`` is not an int.
            RuntimeError: the subscriber is closed.
        """
        limit = check_int(limit, "limit", 1)
        if self._closed:
            raise RuntimeError("receive_many() on a closed ZmqEventSubscriber")
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred
        out: list = []
        if (not self._decode and not self._initial_replay and not self._pending
                and not self._replay_active and not self._restart_owed
                and self._expected is not None and self._expected < 1 << 63):
            # (a stream at the last int64 sequence number goes receive's way: recv_stream
            # takes int64 expectations only)
            probe_at = self._probe_at()
            if (probe_at is None or time.monotonic() < probe_at) and \
                    self._drain_stream(out, limit):
                return out  # the stream had nothing more: nor has receive(0)
        while len(out) < limit:
            try:
                batch = self.receive(0)
            except ValueError as exc:
                if not out:
                    raise
                self._deferred = exc
                break
            if batch is None:
                break
            out.append(batch)
        return out

    def _drain_stream(self, out: list, limit: int) -> bool:
        """``receive_many``'s fast path: stream messages read while each is the batch
        expected next (the block module's ``recv_stream``, one call), taken as
        ``_on_stream`` and ``_accept`` take them; the first that is not is handed to
        ``_on_stream``, and what follows it to ``receive``. True when it read all there was
        (no message handed to ``_on_stream``, no error)."""
        read = self._read_stream
        if read is None:
            read = self._read_stream = _page_hash_core().recv_stream
        got = read(self._sub_handle, limit - len(out), self._expected)
        if got is None:  # libzmq's calls cannot be bound here: through pyzmq
            read = self._read_stream = _page_hash_core(pure=True).recv_stream
            got = read(self._sub_handle, limit - len(out), self._expected)
        payloads, malformed, last, error = got
        self.malformed += malformed
        if payloads or last is not None:
            self._last_heard = self._last_contact = time.monotonic()
        if payloads:
            if not out:
                self._digests.clear()  # the stream is past every replayed batch
            seq = self._expected
            for payload in payloads:
                out.append(ReceivedBatch(seq, 0.0, [], None, payload, False))
                seq += 1
            self._stream_last = seq - 1
            self._expected = seq
        if last is not None:
            self._on_stream(*last)
            return False
        if error and error != errno.EINTR:
            # the exception pyzmq raises for it (ContextTerminated for ETERM)
            zmq = self._zmq
            exc = zmq.ContextTerminated() if error == zmq.ETERM else zmq.ZMQError(error)
            if not out:
                raise exc
            self._deferred = exc  # the batches read first: raised by the next call
            return True
        return not error

    def _probe_at(self) -> Optional[float]:
        """When the next probe is due, None if never (no replay socket, probes off, or no
        sequence number known to ask from)."""
        if self._probe_interval is None or self._replay is None or self._expected is None:
            return None
        return self._last_heard + self._probe_interval

    def _on_stream(self, seq: int, payload: bytes) -> None:
        """A batch from the PUB stream, which one publisher sends in increasing order."""
        if self._expected is not None and seq < self._expected:
            # Below what was delivered: the stream's late copy of a batch that replay
            # delivered (the same payload) or recorded as missed, unless the stream went
            # back (one publisher's never does) or the payload differs: then a new publisher
            # on the same endpoints, which starts again at 0.
            went_back = self._stream_last is not None and seq <= self._stream_last
            digest = None if went_back else self._digests.pop_through(seq)
            self._stream_last = seq
            if not went_back and (digest is None or digest == hash(payload)):
                return
            self.resets += 1
            self._expected = 0
            self._restart_next = True
        self._digests.clear()  # all below what is expected, so below seq: passed
        self._stream_last = seq
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

    def _start_replay(self, start: int, probe: bool = False, retry: bool = False) -> None:
        """Ask for every buffered batch from ``start`` on; ``_step_replay`` takes the answer.
        A ``retry`` asks again for what an answer lost on the way."""
        self._replay.send_multipart((b"", _seq_bytes(start)))
        self._replay_active = True
        self._probing = probe
        self._replay_heard = False
        if not retry:
            self._retries_left = self.MAX_REPLAY_RETRIES
            self._retry_from = start
        self._replay_deadline = _deadline(self._replay_silence())

    def _retry_replay(self) -> bool:
        """Ask again from the first batch missing, on a fresh socket (the rest of the answer
        in flight is dropped): the answer lost messages on the way. False when the retries
        are spent."""
        if self._expected is not None and self._expected > self._retry_from:
            # This answer got further than the last ask: a busy machine losing the tail of
            # a long answer, not a publisher that lacks the batches. Not stuck yet.
            self._retries_left = self.MAX_REPLAY_RETRIES
        if self._retries_left <= 0:
            return False
        self._retries_left -= 1
        self._retry_from = self._expected
        self._renew_replay_socket()
        self._start_replay(self._expected, probe=self._probing, retry=True)
        return True

    def _renew_replay_socket(self) -> None:
        # A new identity: the publisher's ROUTER drops what is still addressed to the old.
        self._replay.close(linger=0)
        self._replay = self._new_replay_socket()

    def _replay_silence(self) -> Optional[float]:
        """Seconds of silence after which the replay in flight is abandoned (None: never)."""
        if not self._probing:
            return self._replay_timeout
        if self._replay_timeout is None:
            return self._probe_interval
        return min(self._replay_timeout, self._probe_interval)

    def _step_replay(self, deadline: Optional[float]) -> bool:
        """Take one replay message, or end the replay; False when ``deadline`` came first."""
        if not self._replay.poll(_wait_ms(deadline, self._replay_deadline)):
            now = time.monotonic()
            if self._replay_deadline is not None and now >= self._replay_deadline:
                # No end marker. One that went silent after it began lost its tail (or its
                # publisher died): ask again. Otherwise drop the socket, so late replies
                # cannot confuse the next ask, and give up.
                if not (self._replay_heard and self._retry_replay()):
                    self._renew_replay_socket()
                    self._end_replay()
                return True
            return deadline is None or now < deadline
        frames = self._replay.recv_multipart()
        self._last_contact = time.monotonic()
        self._replay_deadline = _deadline(self._replay_silence())  # it is not silent
        message = _replay_message(frames)
        if message is None:
            self.malformed += 1
            return True
        seq, payload = message
        if seq == _END_SEQ:
            self._end_replay()
            return True
        self._last_heard = time.monotonic()
        began, self._replay_heard = self._replay_heard, True
        if (began and self._expected is not None and seq > self._expected
                and self._retry_replay()):
            # A hole inside the answer (its first batch may lie beyond: the buffer starts
            # there): a ROUTER drops what a client's full queue cannot take (SGLang's keeps
            # 1,000 messages), or the publisher never sent it. Asking again tells which.
            return True
        if self._accept(seq, payload):
            self.replayed += 1
            if self._stream_last is None or seq > self._stream_last:
                self._digests.add(seq, hash(payload))
        return True

    def _end_replay(self) -> None:
        # The stream messages that waited go on in order; a gap left now is a real gap.
        self._replay_active = False
        self._replay_deadline = None
        self._probing = False
        self._last_heard = time.monotonic()
        backlog = self._backlog
        while backlog:
            self._accept(*backlog.popleft())

    def __iter__(self) -> Iterator[ReceivedBatch]:
        """Yield batches in order until none comes within ``timeout`` seconds."""
        while True:
            batch = self.receive(self._timeout)
            if batch is None:
                return
            yield batch

    def close(self) -> None:
        """Close the sockets and the context (pending messages are dropped). Calling it
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            for sock in (self._sub, self._replay):
                if sock is not None:
                    sock.close(linger=0)
        finally:
            self._ctx.term()

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

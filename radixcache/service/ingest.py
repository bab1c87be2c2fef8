"""The subscriptions to the registered publishers, all served by one thread: it polls every
subscriber's sockets together, takes what each ready one has received (with
``ZmqEventSubscriber``'s gap filling, replay and restart detection), and hands it to the
service, which applies a run of batches under one hold of its lock, each batch in one call
into the block module (``KvIndexer.apply_payload``).

One thread, not one per publisher: the request path then shares the interpreter with a
single busy thread, so a query waits at most about one switch interval for it (with a
thread per publisher it waited for each of them in turn).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

#: Milliseconds the thread waits on the sockets before it looks again.
POLL_MS = 50
#: Seconds between calls to every subscriber, ready or not (its probes of an idle
#: publisher and its replay timeouts run inside ``receive``).
SWEEP_S = 0.1
#: The most batches taken from one subscriber at a time.
DRAIN = 64

_log = logging.getLogger(__name__)
#: Seconds without a batch after which the memory a burst's payloads used goes back to the
#: system (``malloc_trim``): ZeroMQ's threads buffer a burst in their own heaps, which glibc
#: otherwise keeps for good.
TRIM_AFTER_S = 1.0


def _trimmer():
    """glibc's ``malloc_trim``, or None elsewhere."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class Subscription:
    """The subscriber of one registration, and what it applied (read by the metrics).

    Args:
        registration: The publisher.
        start_seq: The first sequence number asked for (replayed from the publisher's
            buffer), or None.
        decode: Whether batches come decoded (a shared store applies event objects) or as
            payloads.
        probe_interval: Seconds of quiet after which the publisher's replay socket is probed
            (a live publisher answers even when it has nothing to send).
    """

    def __init__(self, registration: Any, start_seq: Optional[int], decode: bool,
                 probe_interval: float = 1.0) -> None:
        from ..events import ZmqEventSubscriber

        self.registration = registration
        # what the ingest reads of it with every run (a registration never changes)
        self.key, self.worker, self.group_key = (registration.key, registration.worker,
                                                 registration.group)
        self.subscriber = ZmqEventSubscriber(registration.endpoint,
                                             registration.replay_endpoint,
                                             start_seq=start_seq, decode=decode,
                                             probe_interval=probe_interval)
        self.batches = 0
        self.events = 0
        self.stored = 0
        self.removed = 0
        self.malformed = 0
        self.restarts = 0
        self.last_batch: Optional[float] = None  # when the last batch came
        self.applied_seq: Optional[int] = None  # the last batch applied
        # Whether the first replay (from start_seq) has ended, answered or abandoned, and
        # its batches are applied: before, the index holds only part of what the publisher
        # has, and the instance is not live.
        self.caught_up = registration.replay_endpoint is None
        self.closed = threading.Event()

    @property
    def heard(self) -> Optional[float]:
        """When the publisher was last heard from (``time.monotonic()``): its last batch,
        or its last answer on the replay socket (probes included); None before either."""
        contact = self.subscriber.last_contact
        batch = self.last_batch
        if contact is None or (batch is not None and batch > contact):
            return batch
        return contact


class Ingest:
    """The thread that drains every subscription; ``apply(subscription, batches)`` is
    called on it."""

    def __init__(self, apply: Callable[[Subscription, list], None]) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._subs: list = []
        self._closing: list = []
        self._changed = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="serve ingest")

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.append(sub)
            self._changed = True

    def remove(self, sub: Subscription, timeout: float = 5.0) -> None:
        """Stop draining ``sub`` and close its sockets (on the thread, which may be using
        them; here when the thread is not running)."""
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            self._closing.append(sub)
            self._changed = True
        if not self._thread.is_alive() or self._thread is threading.current_thread():
            self._close_pending()
        elif not sub.closed.wait(timeout):
            _log.warning("subscription of %s not closed in %s s", sub.registration.key_text,
                         timeout)

    def stop(self) -> None:
        """Stop the thread and close every subscription."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._lock:
            self._closing.extend(self._subs)
            self._subs = []
        self._close_pending()

    def _close_pending(self) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
        for sub in closing:
            if not sub.closed.is_set():
                sub.subscriber.close()
                sub.closed.set()

    def _run(self) -> None:
        import zmq

        poller = None
        owner: dict = {}  # socket -> subscription
        last_sweep = 0.0
        trim = _trimmer()
        self._untrimmed = False
        self._last_batch = 0.0
        while not self._stop.is_set():
            with self._lock:
                changed, self._changed = self._changed, False
                subs = list(self._subs)
                closing = bool(self._closing)
            if closing:
                self._close_pending()
            if changed or poller is None:
                poller = zmq.Poller()
                owner = {}
                for sub in subs:
                    for sock in sub.subscriber.sockets:
                        poller.register(sock, zmq.POLLIN)
                        owner[sock] = sub
            if not owner:
                self._stop.wait(POLL_MS / 1000)
                ready: list = []
            else:
                ready = list(dict.fromkeys(owner[s] for s, _ in poller.poll(POLL_MS)))
            now = time.monotonic()
            if now - last_sweep >= SWEEP_S:
                last_sweep = now
                ready = subs
                if trim is not None and self._untrimmed and \
                        now - self._last_batch >= TRIM_AFTER_S:
                    self._untrimmed = False
                    trim(0)
            for sub in ready:
                if sub.closed.is_set():
                    continue
                before = sub.subscriber.sockets
                self._drain(sub)
                if sub.subscriber.sockets != before:  # a replay renewed its socket
                    with self._lock:
                        self._changed = True

    def _drain(self, sub: Subscription) -> None:
        receive_many = sub.subscriber.receive_many
        batches: list = []
        rejected = 0
        while len(batches) < DRAIN:
            want = DRAIN - len(batches)
            try:
                got = receive_many(want)
            except ValueError:  # a payload the decoder rejects: counted, the stream goes on
                sub.malformed += 1
                rejected += 1
                if rejected >= DRAIN:
                    break  # the rest on the next turn: the other subscriptions' meanwhile
                continue
            except RuntimeError:  # closed
                return
            batches += got
            if len(got) < want:
                break  # all there was: the rest comes with the next poll
        if not batches:
            self._check_caught_up(sub)
            return
        sub.last_batch = self._last_batch = time.monotonic()
        self._untrimmed = True
        sub.batches += len(batches)
        try:
            self._apply(sub, batches)
        except Exception:  # a bug must not end the ingest: logged and counted
            sub.malformed += len(batches)
            _log.exception("batches %s..%s of %s not applied", batches[0].seq,
                           batches[-1].seq, sub.registration.key_text)
        self._check_caught_up(sub)

    @staticmethod
    def _check_caught_up(sub: Subscription) -> None:
        if not sub.caught_up and not sub.subscriber.replaying:
            sub.caught_up = True

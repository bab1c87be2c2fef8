"""One subscription per registered publisher: a thread that receives its batches (with
``ZmqEventSubscriber``'s gap filling, replay and restart detection) and hands each one to
the service, which applies it under its lock in one call into the block module
(``KvIndexer.apply_payload``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

#: Seconds a subscription's thread waits for a batch before it looks whether to stop.
POLL_S = 0.1
#: The most batches a thread hands over at once (those already waiting): applied under one
#: hold of the service's lock.
DRAIN = 64


class Subscription:
    """The subscriber of one registration and the thread that drains it.

    Args:
        registration: The publisher.
        apply: Called with ``(subscription, batches)`` on the thread, with each run of
            batches received together.
        start_seq: The first sequence number asked for (replayed from the publisher's
            buffer), or None.
        decode: Whether batches come decoded (a shared store applies event objects) or as
            payloads.
    """

    def __init__(self, registration: Any, apply: Any, start_seq: Optional[int],
                 decode: bool) -> None:
        from ..events import ZmqEventSubscriber

        self.registration = registration
        self._apply = apply
        self.subscriber = ZmqEventSubscriber(registration.endpoint,
                                             registration.replay_endpoint,
                                             start_seq=start_seq, decode=decode)
        # What was applied, read by the metrics at a scrape (plain counts: no cost per batch).
        self.batches = 0
        self.events = 0
        self.stored = 0
        self.removed = 0
        self.malformed = 0
        self.restarts = 0
        self.last_heard = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ingest {registration.key_text}")

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        receive = self.subscriber.receive
        while not self._stop.is_set():
            batches = []
            wait = POLL_S
            try:
                while len(batches) < DRAIN:
                    batch = receive(wait)
                    if batch is None:
                        break
                    batches.append(batch)
                    wait = 0  # then only what already waits
            except ValueError:  # a payload the decoder rejects: counted, the stream goes on
                self.malformed += 1
            except RuntimeError:  # closed under it
                return
            if not batches:
                continue
            self.last_heard = time.monotonic()
            self.batches += len(batches)
            try:
                self._apply(self, batches)
            except Exception:  # a bug must not end the subscription: logged, counted
                self.malformed += len(batches)
                logging.getLogger(__name__).exception(
                    "batches %s..%s of %s not applied", batches[0].seq, batches[-1].seq,
                    self.registration.key_text)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (within about ``POLL_S``), then close the sockets."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.subscriber.close()

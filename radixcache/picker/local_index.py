"""``LocalIndexPicker``: the ``Picker`` over a ``Router`` and ``KvIndexer`` in this process.

Each endpoint is an engine's HTTP address (``ip:port``) with the ZeroMQ addresses its KV events
are published on (``events``, and the ``replay`` socket that fills gaps); a thread per
endpoint reads them with a ``ZmqEventSubscriber`` and applies each batch to the index, under
the lock that ``pick`` takes too. Endpoint ``i`` of the list is worker ``i`` of the router.

- **Catching up.** A subscriber asks the publisher's replay socket for every batch it still
  buffers from sequence number 0 on, so a picker started (or restarted) after the engines
  rebuilds what they published since they started, as far as their replay buffers reach.
- **Liveness.** With a replay socket the subscriber probes an idle publisher every
  ``probe_interval`` seconds, and a live one answers, so an endpoint not heard from for
  ``stale_after`` seconds is taken as stopped: it is no longer eligible, its blocks are
  dropped, and a new subscriber waits for it from sequence 0 again (a restarted engine starts
  empty; the same engine back from a network cut replays its buffer). An endpoint becomes
  eligible when its publisher is first heard from. Without a replay socket nothing tells an
  idle publisher from a stopped one: such an endpoint is always eligible.
- **Load** is the work of the requests in flight, in tokens: ``pick`` adds a request's
  prefill (the prompt tokens the first endpoint lacks) and its ``output_tokens`` to the
  first endpoint, ``served`` moves it to the endpoint that served, ``finished`` removes it.

It exists so that the picker runs on its own; inside the index service the same interface is
served by the service's shared state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

from ..router import KvIndexer, Router
from ..router import namespace_for
from .picking import Pick, check_max_endpoints

__all__ = ["EndpointSpec", "LocalIndexPicker"]


@dataclass(frozen=True)
class EndpointSpec:
    """An engine: its HTTP ``address`` (``ip:port``), the ZeroMQ address its KV events are
    published on, and its replay address (or None)."""

    address: str
    events: str
    replay: Optional[str] = None


class _Feed:
    """One endpoint's subscriber thread and what it knows of the endpoint."""

    def __init__(self, picker: "LocalIndexPicker", index: int, spec: EndpointSpec) -> None:
        self.picker = picker
        self.index = index
        self.spec = spec
        self.eligible = spec.replay is None  # without a replay socket: nothing to wait for
        self.settled = spec.replay is None  # heard from, or waited for once in vain
        self.events_seq: Optional[int] = None  # the last batch applied
        self.malformed = 0
        self.thread = threading.Thread(target=self._run, name=f"radixcache-picker-{index}",
                                       daemon=True)

    def _subscriber(self) -> Any:
        from ..events import ZmqEventSubscriber

        picker = self.picker
        if self.spec.replay is None:
            return ZmqEventSubscriber(self.spec.events)
        return ZmqEventSubscriber(self.spec.events, self.spec.replay, start_seq=0,
                                  probe_interval=picker.probe_interval,
                                  replay_timeout=picker.stale_after)

    def _run(self) -> None:
        picker = self.picker
        stop = picker._stop
        while not stop.is_set():
            subscriber = self._subscriber()
            started = time.monotonic()
            try:
                while not stop.is_set():
                    try:
                        batch = subscriber.receive(timeout=picker.poll_interval)
                    except ValueError:  # a malformed payload: skipped, the next one follows
                        self.malformed += 1
                        batch = None
                    if batch is not None:
                        with picker._lock:
                            picker.router.indexer.apply(self.index, batch)
                        self.events_seq = batch.seq
                    if self.spec.replay is None:
                        continue
                    contact = subscriber.last_contact
                    now = time.monotonic()
                    if contact is not None and now - contact <= picker.stale_after:
                        self.eligible = self.settled = True
                        continue
                    if now - (started if contact is None else contact) > picker.stale_after:
                        self.settled = True
                        if contact is not None or self.eligible:
                            break  # it stopped: start over with a fresh subscriber
            finally:
                subscriber.close()
            if self.eligible or self.events_seq is not None:
                self.eligible = False
                self.events_seq = None
                with picker._lock:
                    picker.router.indexer.remove_worker(self.index)


class LocalIndexPicker:
    """A ``Picker`` with its own index, fed by the endpoints' events (module docstring).

    Args:
        endpoints: The ``EndpointSpec`` of each endpoint (distinct addresses).
        block_size: The engines' page size, in tokens.
        policy: The routing policy (``radixcache.router.ROUTING_POLICIES``).
        router_options: More keyword arguments for ``Router`` (``load_weight``,
            ``prefill_weight``, ``host_weight``, ``prefix_blocks``, ``seed``, ...).
        stale_after: Seconds without a word from an endpoint's publisher after which it
            is taken as stopped.
        probe_interval: Seconds of quiet after which a subscriber probes its publisher.
        start: Whether to start the subscriber threads now (else call ``start()``).

    Raises:
        ValueError: no endpoints, two with one address, or bad router options.
    """

    #: Seconds a subscriber thread waits for a batch before it looks at the clock again.
    poll_interval = 0.05

    def __init__(self, endpoints: Sequence[EndpointSpec], *, block_size: int,
                 policy: str = "cache-aware", router_options: Optional[dict] = None,
                 stale_after: float = 3.0, probe_interval: float = 0.5,
                 start: bool = True) -> None:
        endpoints = list(endpoints)
        if not endpoints:
            raise ValueError("the picker needs at least one endpoint")
        addresses = [spec.address for spec in endpoints]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"endpoint addresses must be distinct: {addresses}")
        if not stale_after > 0 or not probe_interval > 0:
            raise ValueError("stale_after and probe_interval must be > 0 seconds")
        self.stale_after = float(stale_after)
        self.probe_interval = float(probe_interval)
        self.router = Router(len(endpoints), policy, indexer=KvIndexer(block_size),
                             **(router_options or {}))
        self.block_size = self.router.block_size
        self.addresses = addresses
        self._index_of = {address: i for i, address in enumerate(addresses)}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._feeds = [_Feed(self, i, spec) for i, spec in enumerate(endpoints)]
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Start the subscriber threads (once)."""
        if not self._started:
            self._started = True
            for feed in self._feeds:
                feed.thread.start()

    # -- the Picker interface -----------------------------------------------------------
    def pick(self, model: str, token_ids: Sequence[int], *, lora: Optional[str] = None,
             salt: Optional[str] = None, candidates: Optional[Collection[str]] = None,
             output_tokens: int = 0, max_endpoints: int = 1) -> Pick:
        """See ``Picker.pick``."""
        max_endpoints = check_max_endpoints(max_endpoints)
        index_of = self._index_of
        if candidates is None:
            allowed = range(len(self._feeds))
        else:
            allowed = sorted({index_of[a] for a in candidates if a in index_of})
        eligible = [i for i in allowed if self._feeds[i].eligible]
        prompt = len(token_ids)
        if not eligible:
            return Pick((), (), prompt, 0)
        namespace = namespace_for(lora, salt)
        router = self.router
        block_size = self.block_size
        with self._lock:
            loads = router.loads
            least_load = min(loads[i] for i in eligible)
            ordered = router.rank(token_ids, namespace, eligible)[:max_endpoints]
            if router.policy == "cache-aware":
                overlap = router.last_overlap
            else:  # the prediction, for the load and the metrics, from the same index
                overlap = router.indexer.overlap(token_ids, namespace)
            cached = [min(prompt, overlap.get(i, 0) * block_size) for i in ordered]
            load_tokens = prompt - cached[0] + output_tokens
            router.add_load(ordered[0], load_tokens)
        return Pick([self.addresses[i] for i in ordered], cached, prompt, load_tokens,
                    least_load)

    def served(self, pick: Pick, endpoint: str) -> None:
        """See ``Picker.served``."""
        holder = pick.holder
        if holder is None or endpoint == holder or endpoint not in self._index_of:
            return
        with self._lock:
            self.router.remove_load(self._index_of[holder], pick.load_tokens)
            self.router.add_load(self._index_of[endpoint], pick.load_tokens)
            pick.holder = endpoint

    def finished(self, pick: Pick) -> None:
        """See ``Picker.finished``."""
        with self._lock:
            holder, pick.holder = pick.holder, None
            if holder is not None:
                self.router.remove_load(self._index_of[holder], pick.load_tokens)

    def ready(self) -> bool:
        """Every endpoint heard from or waited for once, and one of them eligible."""
        feeds = self._feeds
        return all(feed.settled for feed in feeds) and any(feed.eligible for feed in feeds)

    def status(self) -> dict:
        """See ``Picker.status``."""
        with self._lock:
            indexer, loads = self.router.indexer, self.router.loads
            blocks = [indexer.blocks_held(i) for i in range(len(self._feeds))]
        return {feed.spec.address: {"eligible": feed.eligible, "events_seq": feed.events_seq,
                                    "blocks": blocks[i], "load": loads[i]}
                for i, feed in enumerate(self._feeds)}

    def close(self) -> None:
        """Stop the subscriber threads (they close their subscribers)."""
        self._stop.set()
        for feed in self._feeds:
            if feed.thread.is_alive():
                feed.thread.join(timeout=5.0)

    def __enter__(self) -> "LocalIndexPicker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

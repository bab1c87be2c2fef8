"""``/metrics``: the service's Prometheus metrics, with ``prometheus-client``. Per
publisher: batches, block events, stored and removed blocks, malformed batches and events,
restarts, sequence gaps, batches missed and replayed (counted by its subscription as it
applies batches, read at each scrape: nothing is spent per batch), whether it is subscribed
and live, and its blocks per tier; the index's distinct blocks per scope; the process's
memory and CPU; request latencies (``/query``, ``/query_by_hash``, ``/select``) and each
selection's predicted hit as histograms; the placed prompts credited ahead of their events
(``pending``). The Endpoint Picker's metrics join the same registry.
"""

from __future__ import annotations

from typing import Any

_LABELS = ("instance_id", "tenant", "model", "dp_rank")
#: Request latency buckets, in seconds (50 µs to 2.5 s).
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Predicted hit buckets, in tokens.
HIT_BUCKETS = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def _labels(reg: Any) -> tuple:
    return (str(reg.instance_id), reg.tenant, reg.model, str(reg.dp_rank))


class Metrics:
    """The metrics of one service; ``service`` (its ``IndexService``) is read at each
    scrape."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram
        from prometheus_client.process_collector import ProcessCollector

        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # memory (RSS) and CPU of the process
        self.latency = Histogram("radixcache_serve_request_seconds", "Request latency in the "
                                 "service, by endpoint", ("endpoint",),
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.hits = Histogram("radixcache_serve_selection_hit_tokens", "Predicted cached "
                              "tokens of each selection (device tier)", buckets=HIT_BUCKETS,
                              registry=self.registry)
        self._latency: dict = {}
        self.service: Any = None
        self.registry.register(_Collector(self))

    def selection(self, selection: Any) -> None:
        self.hits.observe(selection.overlap_tokens)

    def observe(self, endpoint: str, seconds: float) -> None:
        child = self._latency.get(endpoint)
        if child is None:
            child = self._latency[endpoint] = self.latency.labels(endpoint)
        child.observe(seconds)

    def render(self) -> tuple:
        """``(body, content type)`` of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


#: Per-publisher counters: (metric name, help, what it reads from the subscription).
_COUNTERS = (
    ("radixcache_serve_batches", "Event batches received and applied, per publisher",
     lambda sub: sub.batches),
    ("radixcache_serve_events", "KV events applied, per publisher", lambda sub: sub.events),
    ("radixcache_serve_stored_blocks", "Blocks stored, per publisher", lambda sub: sub.stored),
    ("radixcache_serve_removed_blocks", "Blocks removed, per publisher",
     lambda sub: sub.removed),
    ("radixcache_serve_malformed", "Malformed batches and events skipped, per publisher",
     lambda sub: sub.malformed + sub.subscriber.malformed),
    ("radixcache_serve_restarts", "Publisher restarts seen (the instance's blocks dropped), "
     "per publisher", lambda sub: sub.restarts),
    ("radixcache_serve_gaps", "Sequence gaps seen (batches lost on the stream, then replayed "
     "or missed)", lambda sub: sub.subscriber.gap_count),
    ("radixcache_serve_missed_batches", "Batches neither the stream nor replay delivered",
     lambda sub: sub.subscriber.missed),
    ("radixcache_serve_replayed_batches", "Batches delivered by replay",
     lambda sub: sub.subscriber.replayed),
)


class _Collector:
    """What is read at a scrape: the subscriptions' counts and the blocks held."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self.metrics.service
        if service is None:
            return
        counters = [(CounterMetricFamily(name, text, labels=_LABELS), read)
                    for name, text, read in _COUNTERS]
        subscribed = GaugeMetricFamily("radixcache_serve_subscribed", "1 while the "
                                       "publisher's subscription runs", labels=_LABELS)
        live = GaugeMetricFamily("radixcache_serve_live", "1 while the publisher's instance "
                                 "is in the answers", labels=_LABELS)
        blocks = GaugeMetricFamily("radixcache_serve_blocks", "Blocks held, per publisher and "
                                   "tier", labels=(*_LABELS, "medium"))
        with service.lock:
            subs = dict(service._subs)
            workers = service.workers()
        for info in workers:
            key = (info["instance_id"], info["tenant"], info["dp_rank"])
            sub = subs.get(key)
            if sub is None:
                continue
            labels = list(_labels(sub.registration))
            for family, read in counters:
                family.add_metric(labels, read(sub))
            subscribed.add_metric(labels, 1.0 if info["subscribed"] else 0.0)
            live.add_metric(labels, 1.0 if info["live"] else 0.0)
            for medium, count in info["blocks"].items():
                blocks.add_metric([*labels, medium], count)
        for family, _ in counters:
            yield family
        yield from (subscribed, live, blocks)
        size = GaugeMetricFamily("radixcache_serve_index_blocks", "Distinct blocks indexed, "
                                 "per scope", labels=("tenant", "model", "block_size"))
        for (tenant, model, block_size), count in service.index_sizes().items():
            size.add_metric([tenant, model, str(block_size)], count)
        yield size
        yield GaugeMetricFamily("radixcache_serve_running_requests", "Requests whose load is "
                                "counted (started, not ended)", value=service.loads.running())
        pending = service.pending
        if pending is not None:
            yield GaugeMetricFamily("radixcache_serve_pending_prompts", "Placed prompts whose "
                                    "blocks count for their instance until its events show "
                                    "them", value=len(pending))
            for name, value, text in (
                    ("added", pending.added, "Placed prompts credited to their instance"),
                    ("confirmed", pending.confirmed, "Credited prompts the instance's events "
                     "then showed"),
                    ("expired", pending.expired, "Credited prompts dropped unconfirmed (time "
                     "to live passed, or the table full)")):
                yield CounterMetricFamily(f"radixcache_serve_pending_{name}", text, value=value)

"""``/metrics``: the service's Prometheus metrics, with ``prometheus-client``. Counters move
as batches are applied (per publisher: batches, block events, stored and removed blocks,
malformed batches and events, restarts); the subscribers' own counts (gaps, batches missed,
replayed, probes), each publisher's blocks per tier and the index's size are read at each
scrape; request latencies and each selection's predicted hit are histograms.
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
    """The metrics of one service; ``service`` is read at each scrape."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.process_collector import ProcessCollector

        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # memory (RSS) and CPU of the process
        r = self.registry
        self._counters = {
            "batches": Counter("radixcache_serve_batches", "Event batches applied, per "
                               "publisher", _LABELS, registry=r),
            "events": Counter("radixcache_serve_events", "KV events applied, per publisher",
                              _LABELS, registry=r),
            "stored": Counter("radixcache_serve_stored_blocks", "Blocks stored, per "
                              "publisher", _LABELS, registry=r),
            "removed": Counter("radixcache_serve_removed_blocks", "Blocks removed, per "
                               "publisher", _LABELS, registry=r),
            "malformed": Counter("radixcache_serve_malformed", "Malformed batches and "
                                 "events skipped, per publisher", _LABELS, registry=r),
            "restarts": Counter("radixcache_serve_restarts", "Publisher restarts seen (their "
                                "blocks dropped), per publisher", _LABELS, registry=r),
        }
        self._children: dict = {}
        self.latency = Histogram("radixcache_serve_request_seconds", "Request latency in the "
                                 "service, by endpoint", ("endpoint",),
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.hits = Histogram("radixcache_serve_selection_hit_tokens", "Predicted cached "
                              "tokens of each selection (device tier)", buckets=HIT_BUCKETS,
                              registry=r)
        self._latency: dict = {}
        self.service: Any = None
        r.register(_Collector(self))

    # -- hooks the service calls ------------------------------------------------------------
    def batch(self, reg: Any, events: int, stored: int, removed: int, malformed: int, *,
              restarted: bool, rejected: bool) -> None:
        """One batch of ``reg``'s applied: its counts (``rejected``: the payload was
        malformed)."""
        children = self._children.get(reg.key)
        if children is None:
            labels = _labels(reg)
            children = self._children[reg.key] = {k: c.labels(*labels)
                                                  for k, c in self._counters.items()}
        children["batches"].inc()
        if events:
            children["events"].inc(events)
        if stored:
            children["stored"].inc(stored)
        if removed:
            children["removed"].inc(removed)
        if malformed or rejected:
            children["malformed"].inc(max(malformed, 1))
        if restarted:
            children["restarts"].inc()

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


class _Collector:
    """What is read at a scrape: the subscribers' counts and the blocks held."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self.metrics.service
        if service is None:
            return
        families = {
            "gaps": CounterMetricFamily("radixcache_serve_gaps", "Sequence gaps seen "
                                        "(batches lost, then replayed or missed)", labels=_LABELS),
            "missed": CounterMetricFamily("radixcache_serve_missed_batches", "Batches "
                                          "neither the stream nor replay delivered",
                                          labels=_LABELS),
            "replayed": CounterMetricFamily("radixcache_serve_replayed_batches", "Batches "
                                            "delivered by replay", labels=_LABELS),
            "subscribed": GaugeMetricFamily("radixcache_serve_subscribed", "1 while the "
                                            "publisher's subscription runs", labels=_LABELS),
            "live": GaugeMetricFamily("radixcache_serve_live", "1 while the publisher's "
                                      "instance is in the answers", labels=_LABELS),
            "blocks": GaugeMetricFamily("radixcache_serve_blocks", "Blocks held, per "
                                        "publisher and tier", labels=(*_LABELS, "medium")),
        }
        with service.lock:
            rows = [(reg, service._subs.get(reg.key)) for reg in service.registrations()]
            workers = {(w["instance_id"], w["tenant"], w["dp_rank"]): w
                       for w in service.workers()}
        for reg, sub in rows:
            if sub is None:
                continue
            labels = list(_labels(reg))
            families["gaps"].add_metric(labels, sub.subscriber.gap_count)
            families["missed"].add_metric(labels, sub.subscriber.missed)
            families["replayed"].add_metric(labels, sub.subscriber.replayed)
            info = workers.get(reg.key, {})
            families["subscribed"].add_metric(labels, 1.0 if info.get("subscribed") else 0.0)
            families["live"].add_metric(labels, 1.0 if info.get("live") else 0.0)
            for medium, count in info.get("blocks", {}).items():
                families["blocks"].add_metric([*labels, medium], count)
        yield from families.values()
        size = GaugeMetricFamily("radixcache_serve_index_blocks", "Distinct blocks indexed, "
                                 "per scope", labels=("tenant", "model", "block_size"))
        for (tenant, model, block_size), count in service.index_sizes().items():
            size.add_metric([tenant, model, str(block_size)], count)
        yield size

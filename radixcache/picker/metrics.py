"""The picker's Prometheus metrics (``prometheus-client``), in the registry of the service it
runs in, so one ``/metrics`` scrape gives both. Names start with ``radixcache_picker_``:

- ``picks_total{endpoint}``: requests routed, by the first endpoint listed;
- ``served_total{endpoint}``: responses, by the endpoint the gateway reports served them;
- ``fallbacks_total``: responses served by another endpoint than the first listed;
- ``predicted_hit_tokens`` (histogram; its ``_sum`` is the total) and ``prompt_tokens_total``:
  what the index predicts the first endpoint holds of each prompt, and the prompts' length;
- ``unavailable_total`` (503: no eligible endpoint), ``shed_total`` (429),
  ``rejected_total{status}`` (400, 404, 413: requests the picker answered itself),
  ``errors_total`` (a request the picker failed on; Envoy then follows its
  ``failure_mode_allow``);
- ``pick_seconds`` and ``tokenize_seconds`` (histograms): the time to choose the endpoints
  and the time to read and tokenize the body;
- ``in_flight``: requests picked and not yet ended;
- read from the ``Picker`` at each scrape: ``ready``, and per endpoint
  ``endpoint_eligible``, ``endpoint_load_tokens``, ``endpoint_blocks`` and
  ``endpoint_events_seq`` (the last event batch applied; -1: none).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["PickerMetrics"]

PREFIX = "radixcache_picker_"
#: Seconds: 50 us to 1 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0)
#: Tokens: 0 to 128 Ki.
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 131072)


class PickerMetrics:
    """The picker's counters and histograms (module docstring) in ``registry`` (a
    ``prometheus_client.CollectorRegistry``; None: a new one), and the gauges read from
    ``picker`` (set it once the picker exists) at each scrape."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        self.picker: Any = None

        def counter(name: str, text: str, labels: tuple = ()) -> Any:
            return Counter(PREFIX + name, text, labels, registry=registry)

        self.picks = counter("picks", "Requests routed, by the first endpoint listed.",
                             ("endpoint",))
        self.served = counter("served", "Responses, by the endpoint that served them.",
                              ("endpoint",))
        self.fallbacks = counter("fallbacks",
                                 "Responses served by another endpoint than the first listed.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the picks.")
        self.unavailable = counter("unavailable", "Requests answered 503: no eligible endpoint.")
        self.shed = counter("shed", "Sheddable requests answered 429.")
        self.rejected = counter("rejected", "Requests the picker answered itself, by HTTP "
                                "status.", ("status",))
        self.errors = counter("errors", "Requests the picker failed on.")
        self.hit_tokens = Histogram(PREFIX + "predicted_hit_tokens", "Prompt tokens the first "
                                    "endpoint is predicted to hold, per pick.",
                                    buckets=TOKEN_BUCKETS, registry=registry)
        self.pick_seconds = Histogram(PREFIX + "pick_seconds", "Time to choose the endpoints.",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.tokenize_seconds = Histogram(PREFIX + "tokenize_seconds", "Time to read and "
                                          "tokenize a request body.", buckets=LATENCY_BUCKETS,
                                          registry=registry)
        self.in_flight = Gauge(PREFIX + "in_flight", "Requests picked and not yet ended.",
                               registry=registry)
        self._children: dict = {}
        registry.register(_PickerCollector(self))

    def picked(self, endpoint: str, prompt_tokens: int, hit_tokens: int,
               seconds: float) -> None:
        """A request routed to ``endpoint`` first."""
        child = self._children.get(endpoint)
        if child is None:
            child = self._children[endpoint] = self.picks.labels(endpoint)
        child.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.hit_tokens.observe(hit_tokens)
        self.pick_seconds.observe(seconds)


class _PickerCollector:
    """The gauges read from the picker at each scrape."""

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        picker: Optional[Any] = self.metrics.picker
        if picker is None:
            return
        status = picker.status()
        yield GaugeMetricFamily(PREFIX + "ready", "1 when the picker has an eligible endpoint "
                                "and its index is ready.", value=1.0 if picker.ready() else 0.0)
        for key, name, text in (
                ("eligible", "endpoint_eligible", "1 when the endpoint may be picked."),
                ("load", "endpoint_load_tokens", "Tokens of requests in flight there."),
                ("blocks", "endpoint_blocks", "Blocks the index holds for the endpoint."),
                ("events_seq", "endpoint_events_seq",
                 "Sequence number of the last event batch applied (-1: none).")):
            family = GaugeMetricFamily(PREFIX + name, text, labels=("endpoint",))
            for endpoint in sorted(status):
                value = status[endpoint][key]
                family.add_metric([endpoint], -1 if value is None else float(value))
            yield family

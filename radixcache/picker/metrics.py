"""The picker's Prometheus metrics, served as text on ``/metrics`` (the exposition format 0.0.4).

Counters and histograms are updated by the ext_proc server's event loop; the per-endpoint
gauges (eligible, load, blocks held, last event batch applied) are read from the ``Picker`` at
each scrape. Names start with ``radixcache_picker_``:

- ``picks_total{endpoint}``: requests routed, by the first endpoint listed;
- ``served_total{endpoint}``: responses, by the endpoint the gateway reports served them;
- ``fallbacks_total``: responses served by another endpoint than the first listed;
- ``predicted_hit_tokens`` (histogram) and ``predicted_hit_tokens_total``,
  ``prompt_tokens_total``: what the index predicts the first endpoint holds of each prompt;
- ``unavailable_total`` (503: no eligible endpoint), ``shed_total`` (429),
  ``rejected_total{status}`` (400, 404, 413: requests the picker answered itself),
  ``errors_total`` (a request the picker failed on; Envoy then follows its
  ``failure_mode_allow``);
- ``pick_seconds`` and ``tokenize_seconds`` (histograms): the time to choose the endpoints
  and the time to read and tokenize the body;
- ``in_flight``: requests picked and not yet ended;
- ``endpoint_eligible{endpoint}``, ``endpoint_load_tokens{endpoint}``,
  ``endpoint_blocks{endpoint}``, ``endpoint_events_seq{endpoint}``; ``ready``.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Callable, Optional, Sequence

__all__ = ["PickerMetrics", "serve_metrics"]

PREFIX = "radixcache_picker_"
#: Seconds: 50 us to 1 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0)
#: Tokens: 0 to 128 Ki.
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 131072)


def _labels(names: Sequence[str], values: Sequence[Any]) -> str:
    if not names:
        return ""
    body = ",".join(f'{name}="{_escape(str(value))}"' for name, value in zip(names, values))
    return "{" + body + "}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Counter:
    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labels = PREFIX + name, help_text, tuple(labels)
        self.values: dict = {}

    def inc(self, *label_values: Any, amount: int = 1) -> None:
        self.values[label_values] = self.values.get(label_values, 0) + amount

    def get(self, *label_values: Any) -> int:
        return self.values.get(label_values, 0)

    def render(self) -> list:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        items = sorted(self.values.items()) or ([((), 0)] if not self.labels else [])
        for label_values, value in items:
            lines.append(f"{self.name}{_labels(self.labels, label_values)} {_number(value)}")
        return lines


class _Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_number(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _gauge(name: str, help_text: str, labels: Sequence[str], rows: Sequence[tuple]) -> list:
    name = PREFIX + name
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    for *label_values, value in rows:
        lines.append(f"{name}{_labels(labels, label_values)} {_number(value)}")
    return lines


class PickerMetrics:
    """The picker's counters and histograms (module docstring); ``render(status, ready)``
    writes them with the gauges read from the picker."""

    def __init__(self) -> None:
        self.picks = _Counter("picks_total", "Requests routed, by the first endpoint listed.",
                              ["endpoint"])
        self.served = _Counter("served_total", "Responses, by the endpoint that served them.",
                               ["endpoint"])
        self.fallbacks = _Counter("fallbacks_total",
                                  "Responses served by another endpoint than the first listed.")
        self.predicted_hit_tokens = _Counter(
            "predicted_hit_tokens_total", "Prompt tokens the first endpoint was predicted to "
            "hold, summed over picks.")
        self.prompt_tokens = _Counter("prompt_tokens_total", "Prompt tokens of the picks.")
        self.unavailable = _Counter("unavailable_total",
                                    "Requests answered 503: no eligible endpoint.")
        self.shed = _Counter("shed_total", "Sheddable requests answered 429.")
        self.rejected = _Counter("rejected_total",
                                 "Requests the picker answered itself, by HTTP status.",
                                 ["status"])
        self.errors = _Counter("errors_total", "Requests the picker failed on.")
        self.hit_tokens = _Histogram("predicted_hit_tokens",
                                     "Prompt tokens the first endpoint is predicted to hold.",
                                     TOKEN_BUCKETS)
        self.pick_seconds = _Histogram("pick_seconds", "Time to choose the endpoints.",
                                       LATENCY_BUCKETS)
        self.tokenize_seconds = _Histogram("tokenize_seconds",
                                           "Time to read and tokenize a request body.",
                                           LATENCY_BUCKETS)
        self.in_flight = 0

    def render(self, status: dict, ready: bool) -> str:
        """The exposition text, with ``status`` (``Picker.status()``) as gauges."""
        lines: list = []
        for metric in (self.picks, self.served, self.fallbacks, self.predicted_hit_tokens,
                       self.prompt_tokens, self.unavailable, self.shed, self.rejected,
                       self.errors, self.hit_tokens, self.pick_seconds,
                       self.tokenize_seconds):
            lines += metric.render()
        lines += _gauge("in_flight", "Requests picked and not yet ended.", (),
                        [(self.in_flight,)])
        lines += _gauge("ready", "1 when the picker has synced with its endpoints.", (),
                        [(int(ready),)])
        endpoints = sorted(status)
        for key, name, help_text in (
                ("eligible", "endpoint_eligible", "1 when the endpoint may be picked."),
                ("load", "endpoint_load_tokens", "Tokens of requests in flight there."),
                ("blocks", "endpoint_blocks", "Blocks the index holds for the endpoint."),
                ("events_seq", "endpoint_events_seq",
                 "Sequence number of the last event batch applied (-1: none).")):
            rows = []
            for endpoint in endpoints:
                value = status[endpoint][key]
                rows.append((endpoint, -1 if value is None else int(value)))
            lines += _gauge(name, help_text, ["endpoint"], rows)
        return "\n".join(lines) + "\n"


def serve_metrics(host: str, port: int, render: Callable[[], str]) -> Any:
    """Serve ``render()`` on ``http://host:port/metrics`` from a daemon thread.

    Returns:
        The ``ThreadingHTTPServer`` (``server_address`` holds the bound port; call
        ``shutdown()`` to stop it).
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = render().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes are not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="radixcache-picker-metrics",
                              daemon=True)
    thread.start()
    return server


def parse_metrics(text: str) -> dict:
    """``{(name, labels): value}`` of an exposition text (labels as a sorted tuple of
    pairs): for tests and tools that read the picker's metrics."""
    values: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        labels: Optional[tuple] = ()
        if "{" in sample:
            name, rest = sample.split("{", 1)
            pairs = []
            for item in rest.rstrip("}").split('",'):
                if item:
                    key, val = item.split("=", 1)
                    pairs.append((key, val.strip('"')))
            labels = tuple(sorted(pairs))
        else:
            name = sample
        values[(name, labels)] = float(value)
    return values

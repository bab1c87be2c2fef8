"""vLLM's and SGLang's own ``ZmqEventPublisher`` classes, loaded and driven alike, for the
interop tests (``test_engine_interop.py``) and ``benchmarks/scripts/event_recovery.py``.

SGLang's is imported from the installed package (``bash tests/install_sglang.sh``). vLLM's
is loaded from the one file ``tests/fetch_vllm_kv_events.sh`` extracts from its wheel,
``vllm/distributed/kv_events.py`` (the rest of vLLM is not installed): the names that file
imports from other vLLM modules are stubbed, each one below saying why.
"""

from __future__ import annotations

import ast
import atexit
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Optional, Union

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_DIR = Path(os.environ.get("VLLM_KV_EVENTS_DIR", REPO_ROOT / "tests" / ".vllm"))
VLLM_FILE = VLLM_DIR / "vllm" / "distributed" / "kv_events.py"
#: The longest a wait here may take: it only bounds a hang.
WAIT_S = 30.0


class _KVEventsConfig:
    """Stands in for ``vllm.config.kv_events.KVEventsConfig``, which the publisher only builds
    from its own arguments and hands back from ``get_publisher_config()``: the real one
    lives in vLLM's config package, which imports most of vLLM (torch with CUDA, ...)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _needs_a_node_ip(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("only a tcp://*:0 endpoint needs vLLM's network helpers")


# What vllm/distributed/kv_events.py imports from the rest of vLLM: the block hash type its
# structs use (the real one is this union), its logger factory, the config struct above,
# and network helpers that only a tcp://*:0 endpoint needs (never used here).
_VLLM_STUBS = {
    "ExternalBlockHash": Union[bytes, int],
    "init_logger": logging.getLogger,
    "KVEventsConfig": _KVEventsConfig,
    "get_ip": _needs_a_node_ip,
    "get_tcp_uri": _needs_a_node_ip,
    "is_valid_ipv6_address": _needs_a_node_ip,
    "split_zmq_path": _needs_a_node_ip,
}


def _vllm_stub_modules(source: str) -> dict:
    """A module for every ``vllm.*`` import of ``source`` (and its parents), holding the
    stubs above; a name without a stub is an ImportError, so a new import is noticed."""
    modules: dict = {}

    def module(name: str) -> types.ModuleType:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in modules:
                modules[prefix] = types.ModuleType(prefix)
                modules[prefix].__path__ = []
        return modules[name]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            stub = module(node.module)
            for alias in node.names:
                if alias.name not in _VLLM_STUBS:
                    raise ImportError(f"vLLM's kv_events.py imports {alias.name} from "
                                      f"{node.module}, which has no stand-in here")
                setattr(stub, alias.name, _VLLM_STUBS[alias.name])
    module("vllm.distributed")
    return modules


def load_vllm_kv_events(path: Path = VLLM_FILE) -> types.ModuleType:
    """vLLM's kv_events module from ``path``, its vLLM imports stubbed while it loads (they
    are gone from ``sys.modules`` afterwards). FileNotFoundError without the file."""
    if not path.is_file():
        raise FileNotFoundError(f"vLLM's kv_events.py is not at {path}: run "
                                "tests/fetch_vllm_kv_events.sh (or set VLLM_KV_EVENTS_DIR)")
    name = "vllm.distributed.kv_events"
    stubs = _vllm_stub_modules(path.read_text())
    stubs[name] = None
    saved = {key: sys.modules.get(key) for key in stubs}
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        stubs[name] = module
        sys.modules.update(stubs)
        spec.loader.exec_module(module)
        return module
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def load_sglang_kv_events() -> types.ModuleType:
    """SGLang's kv_events module (ImportError, or whatever SGLang's imports raise)."""
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def wait_released(endpoint: str) -> None:
    """Wait (bounded) until a TCP endpoint a shut-down publisher bound can be bound again.
    The engines close their sockets without waiting (their ZeroMQ context is shared), so
    the port is freed a moment later, by ZeroMQ's own thread: binding it at once fails now
    and then with "Address already in use". A bind here, in a context of its own that
    ``term()`` closes for good, shows it free."""
    if not endpoint.startswith("tcp://"):
        return  # an ipc path is bound again at once
    import zmq

    deadline = time.monotonic() + WAIT_S
    while True:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        finally:
            sock.close()
            ctx.term()
        time.sleep(0.01)


class EnginePublisher:
    """One engine's ``ZmqEventPublisher`` on this machine, topic ``"kv"``: vLLM's on ipc
    sockets in ``workdir`` (it binds only wildcard and ipc addresses, and connects to the
    others), SGLang's on 127.0.0.1, ports the system picks. Batch ``i`` stores one block, the
    tokens ``(i, i + 1)`` under hash ``10_000 + i``. ``endpoints`` binds the ones of an
    earlier publisher, once it has released them (a restart)."""

    def __init__(self, engine: str, module: Any, workdir: str,
                 endpoints: Optional[tuple] = None, buffer_steps: int = 10_000) -> None:
        self.engine = engine
        self.module = module
        self.count = 0
        self.down = False
        for endpoint in endpoints or ():
            wait_released(endpoint)
        if engine == "vllm":
            if endpoints is None:
                endpoints = (f"ipc://{workdir}/pub", f"ipc://{workdir}/replay")
            self.pub = module.ZmqEventPublisher(
                data_parallel_rank=0, endpoint=endpoints[0], replay_endpoint=endpoints[1],
                buffer_steps=buffer_steps, topic="kv")
            config = self.pub.get_publisher_config()
            self.endpoint, self.replay_endpoint = config.endpoint, config.replay_endpoint
        elif engine == "sglang":
            endpoints = endpoints or ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            self.pub = module.ZmqEventPublisher(
                attn_dp_rank=0, endpoint=endpoints[0], replay_endpoint=endpoints[1],
                buffer_steps=buffer_steps, topic="kv", bind=True)
            source = self.pub.describe_local_source(block_size=2)
            self.endpoint, self.replay_endpoint = source["endpoint"], source["replay_endpoint"]
        else:
            raise ValueError(f"unknown engine {engine!r}")

    def publish(self, i: int) -> int:
        """Publish batch ``i``; returns the sequence number the engine gives it."""
        stored = self.module.BlockStored(block_hashes=[10_000 + i], parent_block_hash=None,
                                         token_ids=[i, i + 1], block_size=2, lora_id=None,
                                         medium="GPU", lora_name=None)
        self.pub.publish(self.module.KVEventBatch(ts=time.time(), events=[stored]))
        self.count += 1
        return self.count - 1

    def wait_sent(self) -> None:
        """Wait (bounded) until every batch published went out. The engines' publishers have
        no ``flush()``: a sent batch is one in their replay buffer, ``_buffer``."""
        deadline = time.monotonic() + WAIT_S
        while not self.pub._buffer or self.pub._buffer[-1][0] < self.count - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.engine} never sent its batches")
            time.sleep(0.01)

    def shutdown(self) -> None:
        if self.down:
            return
        self.down = True
        self.pub.shutdown()
        if self.engine == "sglang":  # it also registers its shutdown to run at exit
            atexit.unregister(self.pub.shutdown)


def short_workdir() -> str:
    """A new folder for ipc sockets, with a path short enough for one (108 bytes at most);
    the caller removes it with ``shutil.rmtree``."""
    return tempfile.mkdtemp(prefix="rc-ev-")

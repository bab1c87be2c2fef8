"""``ServiceConfig``: what ``radixcache serve`` runs with (its flags), the static publishers
(``--publisher``, ``--publishers-file``) and the endpoint allow-list. Standard library only:
the command parses its flags without importing a web framework.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .._options import DEFAULT_HOST_WEIGHT, DEFAULT_LOAD_WEIGHT
from .identity import DEFAULT_TENANT, PUBLISHER_TYPES, Registration, check_address
from .stdhash import DEFAULT_SEED

#: The environment variable ``--token`` falls back on.
TOKEN_ENV = "RADIXCACHE_SERVE_TOKEN"
#: The policies ``/select`` takes (``cache-aware`` by default).
SELECT_POLICIES = ("cache-aware", "least-loaded", "round-robin", "random")


@dataclass
class ServiceConfig:
    """Settings of a service (``radixcache serve``'s flags, one attribute each).

    Attributes:
        host: The address to bind (127.0.0.1: this machine only).
        port: The port (0: any free one).
        index: None (the index in this process) or a ``redis://`` URL shared by replicas.
        namespace: The shared index's name in the store.
        owner: This replica's owner token in the store (None: a random one).
        block_size: The block size of static publishers that name none.
        model: The model of static publishers that name none.
        publishers: Static registrations (``--publisher``, ``--publishers-file``).
        token: The bearer token that changes need (None: no token).
        allow_endpoints: ``fnmatch`` patterns a registered endpoint must match (empty: only
            loopback endpoints).
        max_body: The largest request body, in bytes.
        max_tokens: The most token ids (or hashes) one request may carry.
        instance_timeout: Seconds of silence after which a publisher's instance leaves the
            answers and can no longer be picked (None: never); its subscription probes an
            idle publisher's replay socket often enough that a live one is never silent
            that long.
        policy: ``/select``'s default policy.
        load_weight, prefill_weight, host_weight: ``cache-aware``'s weights (as ``Router``'s).
        hash_seed: The seed of the standard XXH3-64 block hashes.
        hash_index: Keep the engines' blocks by their standard sequence hashes too, so that
            ``/query_by_hash`` finds them (costs memory and ingest; see ``hashindex``).
        lease_s: With ``index``: seconds a publisher's lease lasts.
        pending_ttl: Seconds a placement's prompt blocks count for its instance in ranking
            before its events show them (0: not at all; see ``pending``).
    """

    host: str = "127.0.0.1"
    port: int = 8090
    index: Optional[str] = None
    namespace: str = "serve"
    owner: Optional[str] = None
    block_size: int = 16
    model: str = "default"
    publishers: list = field(default_factory=list)
    token: Optional[str] = None
    allow_endpoints: list = field(default_factory=list)
    max_body: int = 8 << 20
    max_tokens: int = 1 << 20
    instance_timeout: Optional[float] = None
    policy: str = "cache-aware"
    load_weight: float = DEFAULT_LOAD_WEIGHT
    prefill_weight: float = 1.0
    host_weight: float = DEFAULT_HOST_WEIGHT
    hash_seed: int = DEFAULT_SEED
    hash_index: bool = False
    lease_s: float = 30.0
    pending_ttl: float = 5.0

    @property
    def probe_interval(self) -> float:
        """Seconds of quiet after which a subscription probes its publisher: a third of
        ``instance_timeout`` (at most a second), so a live publisher answers in time."""
        if self.instance_timeout is None:
            return 1.0
        return min(1.0, self.instance_timeout / 3)

    def endpoint_allowed(self, endpoint: str) -> bool:
        """Whether ``/register`` may make the service connect to ``endpoint``: it matches
        an ``allow_endpoints`` pattern, or, with none given, it is on this machine
        (``tcp://127.0.0.1:*``, ``tcp://localhost:*``, ``tcp://[::1]:*``, ``ipc://``)."""
        if not isinstance(endpoint, str) or not _ENDPOINT.match(endpoint):
            return False  # e.g. ZeroMQ's "tcp://source;destination" form
        patterns = self.allow_endpoints or LOOPBACK_ENDPOINTS
        return any(fnmatch.fnmatchcase(endpoint, p) for p in patterns)


#: The endpoints ``/register`` takes at all: ``tcp://host:port`` or ``ipc://path``, nothing
#: else (ZeroMQ reads ``tcp://a;b`` as "from interface a to b": no pattern could judge it).
_ENDPOINT = re.compile(r"(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}|ipc://[^;\s]+)\Z")
#: What ``/register`` may connect to when no ``--allow-endpoint`` is given.
LOOPBACK_ENDPOINTS = ("tcp://127.0.0.1:*", "tcp://localhost:*", "tcp://[[]::1]:*", "ipc://*")


def token_from(value: Optional[str]) -> Optional[str]:
    """``--token``, else the ``RADIXCACHE_SERVE_TOKEN`` environment variable (None: none;
    an empty one counts as none)."""
    token = value if value is not None else os.environ.get(TOKEN_ENV)
    return token or None


def parse_publisher(text: str, model: str, block_size: int,
                    kind: str = "vLLM") -> Registration:
    """A ``--publisher`` value: ``instance_id=tcp://host:port`` then optional
    ``,key=value`` items: ``replay`` (the replay endpoint), ``type`` (vLLM, SGLang,
    Mooncake), ``model``, ``block_size``, ``tenant``, ``dp_rank``, ``lora``, ``salt``,
    ``address`` (the instance's serving ``ip:port``, for the Endpoint Picker).

    Raises:
        ValueError: naming what is wrong.
    """
    head, _, rest = text.partition(",")
    instance, sep, endpoint = head.partition("=")
    if not sep or not instance or not endpoint:
        raise ValueError(f"--publisher {text!r}: expected instance_id=tcp://host:port[,...]")
    fields: dict = {"replay": None, "type": kind, "model": model, "block_size": block_size,
                    "tenant": DEFAULT_TENANT, "dp_rank": 0, "lora": None, "salt": None,
                    "address": None}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--publisher {text!r}: unknown item {item!r} (known: "
                             f"{', '.join(fields)})")
        fields[key] = value
    return registration_from(instance, endpoint, fields, f"--publisher {text!r}")


def read_publishers_file(path: str, model: str, block_size: int) -> list:
    """``--publishers-file``: a JSON list of objects with ``instance_id``, ``endpoint`` and
    the ``--publisher`` items (``replay``, ``type``, ``model``, ...), or Mooncake's static
    configuration (``{"kvevent_instance": {name: {<a /register body>}}}``).

    Raises:
        ValueError: an unreadable file or a bad entry (an unknown key too), named.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--publishers-file {path}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("kvevent_instance"), dict):
        data = [{"instance_id": v.get("instance_id", k), "endpoint": v.get("endpoint"),
                 "replay": v.get("replay_endpoint") or None, "type": v.get("type", "vLLM"),
                 "model": v.get("modelname", model), "block_size": v.get("block_size",
                                                                         block_size),
                 "tenant": v.get("tenant_id") or DEFAULT_TENANT, "dp_rank": v.get("dp_rank", 0),
                 "lora": v.get("lora_name") or None, "salt": v.get("additionalsalt") or None,
                 "address": v.get("address")}
                for k, v in data["kvevent_instance"].items() if isinstance(v, dict)]
    if not isinstance(data, list):
        raise ValueError(f"--publishers-file {path}: a JSON list of publishers expected")
    out = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ValueError(f"--publishers-file {path}: entry {i} is not an object")
        fields = {"replay": None, "type": "vLLM", "model": model, "block_size": block_size,
                  "tenant": DEFAULT_TENANT, "dp_rank": 0, "lora": None, "salt": None,
                  "address": None}
        unknown = sorted(set(entry) - set(fields) - {"instance_id", "endpoint"})
        if unknown:
            raise ValueError(f"--publishers-file {path}: entry {i}: unknown key(s) "
                             f"{', '.join(map(repr, unknown))} (known: instance_id, endpoint, "
                             f"{', '.join(fields)})")
        fields.update(entry)
        out.append(registration_from(entry.get("instance_id"), entry.get("endpoint"), fields,
                                     f"--publishers-file {path}: entry {i}"))
    return out


def registration_from(instance: Any, endpoint: Any, fields: dict, where: str) -> Registration:
    """A ``Registration`` from loosely typed values (text or JSON), checked."""
    if not isinstance(instance, (str, int)) or isinstance(instance, bool) or instance == "":
        raise ValueError(f"{where}: instance_id must be a non-empty string or an integer")
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError(f"{where}: endpoint must be a non-empty string")
    if fields["type"] not in PUBLISHER_TYPES:
        raise ValueError(f"{where}: type must be one of {', '.join(PUBLISHER_TYPES)}")
    try:
        block_size = int(fields["block_size"])
        dp_rank = int(fields["dp_rank"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: block_size and dp_rank must be integers") from None
    if block_size < 1 or dp_rank < 0:
        raise ValueError(f"{where}: block_size must be >= 1 and dp_rank >= 0")
    for name in ("model", "tenant"):
        if not isinstance(fields[name], str) or not fields[name]:
            raise ValueError(f"{where}: {name} must be a non-empty string")
    for name in ("replay", "lora", "salt"):
        if fields[name] is not None and not isinstance(fields[name], str):
            raise ValueError(f"{where}: {name} must be a string")
    address = fields.get("address") or None
    if address is not None:
        address = check_address(address, f"{where}: address")
    return Registration(instance, endpoint, fields["replay"] or None, fields["type"],
                        fields["model"], block_size, fields["tenant"], dp_rank,
                        fields["lora"] or None, fields["salt"] or None, address)

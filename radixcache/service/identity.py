"""Who publishes what: a ``Registration`` (one publisher: an instance's data-parallel rank,
its model, tenant, block size, LoRA and salt), the groups that share one index, and how a
query's LoRA and salt name the blocks of each group.

Scoping. A query names a tenant, a model and a block size: only instances registered
under all three answer, so a query never matches across them. Within that scope a block's
identity also has a LoRA adapter and a salt: the ones its engine hashed it with (vLLM's
extra keys, SGLang's ``lora_name`` and ``cache_salt``, an RFC #1527 event's ``lora_name``
and ``additional_salt``), or, for a block that names none, the registration's
``lora_name`` and ``additionalsalt``. A query's ``lora_name`` and ``cache_salt`` match the
blocks of that identity only (none: the base model, unsalted).

Registrations with the same scope, registered LoRA and salt and publisher family share one
``KvIndexer`` (a ``group``); its workers are ``(instance_id, dp_rank)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Union

#: The publisher types ``/register`` takes, as Mooncake's document spells them.
PUBLISHER_TYPES = ("vLLM", "SGLang", "Mooncake")
DEFAULT_TENANT = "default"

InstanceId = Union[str, int]


@dataclass(frozen=True)
class Registration:
    """One registered publisher.

    Attributes:
        instance_id: The router-facing instance (a str, or an int as Dynamo's clients send).
        endpoint: The publisher's ZeroMQ PUB endpoint.
        replay_endpoint: Its replay (ROUTER) endpoint, or None.
        kind: ``"vLLM"``, ``"SGLang"`` or ``"Mooncake"`` (RFC #1527 event maps).
        model: The model name.
        block_size: Tokens per block.
        tenant: The tenant (Dynamo's ``routing_group``).
        dp_rank: The data-parallel rank this publisher serves.
        lora: The LoRA adapter of blocks that name none (None: the base model).
        salt: The salt of blocks that name none (Mooncake's ``additionalsalt``).
        address: The instance's serving address as a gateway reaches it (``ip:port``, or
            ``[ip]:port``), or None: what the Endpoint Picker names (``serve --epp``); an
            instance registered without one is answered for but never picked.
    """

    instance_id: InstanceId
    endpoint: str
    replay_endpoint: Optional[str]
    kind: str
    model: str
    block_size: int
    tenant: str = DEFAULT_TENANT
    dp_rank: int = 0
    lora: Optional[str] = None
    salt: Optional[str] = None
    address: Optional[str] = None

    @property
    def key(self) -> tuple:
        """What ``/unregister`` names: ``(instance_id, tenant, dp_rank)``."""
        return (self.instance_id, self.tenant, self.dp_rank)

    @property
    def key_text(self) -> str:
        """The key as Mooncake's ``removed_instances`` spells it: ``id|tenant|rank``."""
        return f"{self.instance_id}|{self.tenant}|{self.dp_rank}"

    @property
    def worker(self) -> tuple:
        """The worker id in its group's index: ``(instance_id, dp_rank)``."""
        return (self.instance_id, self.dp_rank)

    @property
    def scope(self) -> tuple:
        """``(tenant, model, block_size)``: the instances a query may see together."""
        return (self.tenant, self.model, self.block_size)

    @property
    def group(self) -> tuple:
        """The index it shares: scope, registered LoRA and salt, and the publisher family
        (how its events spell a block's LoRA and salt)."""
        return (*self.scope, self.lora, self.salt, family(self.kind))

    @cached_property
    def answer_id(self) -> tuple:
        """How a query's answer names it: ``(instance_id, its JSON object key, dp_rank)``
        (a row of the block module's ``query_answer``)."""
        import msgspec

        return (self.instance_id, msgspec.json.encode(instance_text(self.instance_id)),
                self.dp_rank)

    def as_record(self) -> dict:
        """The registration as plain JSON-able values (what a shared store keeps)."""
        return {"instance_id": self.instance_id, "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "kind": self.kind,
                "model": self.model, "block_size": self.block_size, "tenant": self.tenant,
                "dp_rank": self.dp_rank, "lora": self.lora, "salt": self.salt,
                "address": self.address}


def family(kind: str) -> str:
    """How a publisher's events carry a block's LoRA and salt: ``"vllm"`` (per-block extra
    keys) or ``"named"`` (SGLang's ``lora_name``/``cache_salt``, RFC #1527's
    ``lora_name``/``additional_salt``)."""
    return "vllm" if kind == "vLLM" else "named"


def identities(lora: Optional[str], salt: Optional[str], group_lora: Optional[str],
               group_salt: Optional[str]) -> list:
    """The ``(lora, salt)`` pairs, as blocks of a group registered with ``group_lora`` and
    ``group_salt`` name them, of the blocks a query for ``lora`` and ``salt`` matches: a
    block's own LoRA and salt, or the group's for a block that names none."""
    loras = _options(lora, group_lora)
    salts = _options(salt, group_salt)
    return [(lo, sa) for lo in loras for sa in salts]


def _options(wanted: Optional[str], registered: Optional[str]) -> list:
    if wanted is None:
        return [None] if registered is None else []
    return [wanted, None] if registered == wanted else [wanted]


def query_key(kind_family: str, lora: Optional[str], salt: Optional[str],
              blocks: int) -> tuple:
    """``(extra_key, block_extra_keys)`` for ``KvIndexer.overlap``/``block_keys``: how a
    group of ``kind_family`` keys the blocks its engine hashed with ``lora`` and ``salt``.

    vLLM puts the LoRA in every block's extra keys and the salt in the first one's only, so
    with both the blocks after the first carry keys of their own; SGLang and RFC #1527
    publishers name the sequence by ``lora_name``, ``cache_salt``, or both.
    """
    if lora is not None and salt is not None and kind_family == "vllm":
        return None, [(lora, salt)] + [(lora,)] * max(blocks - 1, 0)
    # Here, not at the top: the command's flags import this module, and must not import the
    # index (numpy, the tree core).
    from ..router.keys import namespace_for

    return namespace_for(lora, salt), None


def check_address(address: Any, what: str = "address") -> str:
    """``address`` if it is ``host:port`` (``[ip]:port`` for IPv6), as Envoy's endpoint
    picking reads it.

    Raises:
        ValueError: naming ``what``.
    """
    if not isinstance(address, str):
        raise ValueError(f"{what} must be a string ip:port, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536
            or len(address) > 300 or any(c in address for c in " ,;/\t\n\r")):
        raise ValueError(f"{what} must be ip:port, got {address!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{what}: an IPv6 address must be [ip]:port, got {address!r}")
    return address


def instance_text(instance_id: Any) -> str:
    """An instance id as a JSON object key."""
    return str(instance_id)

"""RFC #1527 event maps (Mooncake's KV Events API) in a ZeroMQ batch: read and turned into
what the service applies. A batch is vLLM's payload, ``[timestamp, [events], dp_rank]``,
each event a map with ``event_type`` (``stored``, ``removed``, ``cleared``), the envelope
(``model_name``, ``block_size``, ``additional_salt``, ``lora_name``, ``tenant_id``,
``backend_id``, ``medium``, ``dp_rank``) and, for ``stored``, ``seq_hashes``,
``base_block_idx``, ``parent_hash`` and ``token_ids``. Mooncake's store master also sends the
vLLM-style aliases ``type`` and ``block_hashes``, read when the RFC's names are missing.

A ``stored`` event with token ids is indexed by its tokens, as engine events are (its
``seq_hashes`` are the publisher's hashes); one without is a pool block, known by its
sequence hashes only (``pool.PoolBlocks``). Envelope fields that contradict the
registration (another model, block size or tenant) make the event skipped and counted.
"""

from __future__ import annotations

from typing import Any, Optional, Union

_TYPES = {"stored": "stored", "removed": "removed", "cleared": "cleared",
          "BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
_STRUCT: list = []


def _event_struct() -> Any:
    if not _STRUCT:
        import msgspec

        class Event(msgspec.Struct):
            event_type: Optional[str] = None
            type: Optional[str] = None
            model_name: Optional[str] = None
            block_size: Optional[int] = None
            additional_salt: Optional[str] = None
            lora_name: Optional[str] = None
            tenant_id: Optional[str] = None
            backend_id: Optional[str] = None
            medium: Optional[str] = None
            dp_rank: Optional[int] = None
            seq_hashes: Optional[list] = None
            block_hashes: Optional[list] = None
            base_block_idx: Optional[int] = None
            parent_hash: Optional[Union[int, bytes]] = None
            parent_block_hash: Optional[Union[int, bytes]] = None
            token_ids: Optional[list] = None

        _STRUCT.append((msgspec, Event))
    return _STRUCT[0]


def read_batch(payload: bytes, registration: Any) -> tuple:
    """Read one batch of ``registration``'s RFC #1527 events.

    Returns:
        ``(actions, skipped)``: the actions in order, each ``("tokens", event)`` (a
        ``BlockStored``/``BlockRemoved`` for the registration's index), ``("clear",)``,
        ``("pool_store" | "pool_remove", identity, seq_hashes, tier)``; and how many events
        were skipped (malformed, or contradicting the registration).

    Raises:
        ValueError: the payload is not a batch (not msgpack, not ``[ts, [events], ...]``).
    """
    from ..events import BlockRemoved, BlockStored

    msgspec, event_type = _event_struct()
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        raise ValueError(f"not a msgpack batch: {exc}") from None
    if (type(batch) is not list or len(batch) not in (2, 3)
            or type(batch[1]) is not list):
        raise ValueError("not a batch: [timestamp, [events], dp_rank] expected")
    actions: list = []
    skipped = 0
    for raw in batch[1]:
        try:
            event = msgspec.convert(raw, event_type)
            action = _action(event, registration, BlockStored, BlockRemoved)
        except (msgspec.ValidationError, ValueError, TypeError, OverflowError):
            action = None
        if not action:
            skipped += 1
        else:
            actions.extend(action)
    return actions, skipped


def _ints(values: Any, what: str) -> list:
    if not all(type(v) is int and -(1 << 63) <= v < (1 << 64) for v in values):
        raise ValueError(f"{what} must be 64-bit integers")
    return values


def _action(event: Any, reg: Any, stored_type: Any, removed_type: Any) -> Optional[list]:
    kind = _TYPES.get(event.event_type or event.type or "")
    if kind is None:
        return None
    if ((event.model_name is not None and event.model_name != reg.model)
            or (event.block_size is not None and event.block_size != reg.block_size)
            or (event.tenant_id is not None and event.tenant_id != reg.tenant)):
        return None  # another scope than the registration's: never mixed into it
    if kind == "cleared":
        return [("clear",)]
    hashes = event.seq_hashes if event.seq_hashes is not None else event.block_hashes
    if not hashes:
        return None
    medium = (event.medium or "GPU").upper()
    lora = event.lora_name or None
    salt = event.additional_salt or None
    if kind == "stored" and event.token_ids is not None:
        tokens = tuple(_ints(event.token_ids, "token_ids"))
        parent = event.parent_hash if event.parent_hash is not None else event.parent_block_hash
        return [("tokens", stored_type(tuple(hashes), parent, tokens, reg.block_size, None,
                                       medium, lora, None, None, salt))]
    seqs = [h & ((1 << 64) - 1) for h in _ints(hashes, "seq_hashes")]
    # A removal names blocks stored either way: both forget what they do not hold.
    out = [("tokens", removed_type(tuple(hashes), medium))] if kind == "removed" else []
    if medium in ("CPU", "CPU_PINNED", "DISK"):
        tier = "CPU" if medium == "CPU_PINNED" else medium
        identity = (lora or reg.lora, salt or reg.salt)
        out.append(("pool_store" if kind == "stored" else "pool_remove", identity, seqs, tier))
    return out or None  # a pool block must name its tier

"""The wire format: events as msgpack batches in either encoding (``"map"``,
``"positional"``; decoded by msgspec's typed decoder, or field by field for a batch it
refuses), ``ReceivedBatch``, and the check for the optional pyzmq and msgspec.

See "Wire format" in ``radixcache.events``. Imports only ``types`` of the package. Its
annotations are evaluated, as in ``types``: ``ReceivedBatch`` names ``radixcache.events``
as its module.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Tuple, Union

from .._validate import is_real
from .types import (
    _EVENT_TYPES,
    DEFAULT_ENCODING,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    _check_encoding,
)

_EXTRA_HINT = "pip install radixcache[events]"

@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as a subscriber received it (or ``decode_batch`` decoded it).

    Attributes:
        seq: The batch's sequence number (-1 when unknown).
        ts: The publisher's timestamp (seconds since the epoch).
        events: The decoded events, in order.
        data_parallel_rank: The publisher's data-parallel rank, or None.
        payload: The raw msgpack payload (not compared, not shown).
        restarted: True for the first batch of a restarted publisher: what the worker held
            before is gone (``KvIndexer.apply`` drops it).
    """

    seq: int
    ts: float
    events: list
    data_parallel_rank: Optional[int]
    payload: bytes = field(default=b"", repr=False, compare=False)
    #: the first batch of a restarted publisher: what the worker held before is gone
    #: (``KvIndexer.apply`` drops it)
    restarted: bool = field(default=False, compare=False)


def _is_builtin_int(value: Any) -> bool:
    """A Python int that is not a bool: what msgpack decodes and encodes (stricter than
    ``_validate.is_int``: a numpy integer is no wire value, and msgspec cannot encode one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _wire_hash(value: Any, what: str) -> Union[int, bytes]:
    if not (_is_builtin_int(value) or isinstance(value, bytes)):
        raise ValueError(f"{what} must be an int or bytes, got {type(value).__name__}")
    return value


# The item types an array may hold: checked over the set of its items' types (one pass in C,
# not a call per item); msgpack decodes exact ints and bytes, never a subclass.
_HASH_ITEM_TYPES = frozenset((int, bytes))
_INT_ITEM_TYPES = frozenset((int,))


def _wire_hash_list(value: Any, what: str) -> tuple:
    if not isinstance(value, (list, tuple)) or not _HASH_ITEM_TYPES.issuperset(
            map(type, value)):
        if isinstance(value, (list, tuple)) and all(
                _is_builtin_int(v) or isinstance(v, bytes) for v in value):
            return tuple(value)  # an int or bytes subclass in a hand-made array
        raise ValueError(f"{what} must be an array of ints or bytes")
    return tuple(value)


def _wire_int_list(value: Any, what: str) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not _INT_ITEM_TYPES.issuperset(
            map(type, value)):
        if isinstance(value, (list, tuple)) and all(_is_builtin_int(v) for v in value):
            return tuple(value)  # an int subclass in a hand-made array
        raise ValueError(f"{what} must be an array of ints")
    return tuple(value)


def _wire_int(value: Any, what: str) -> int:
    if not _is_builtin_int(value):
        raise ValueError(f"{what} must be an int, got {type(value).__name__}")
    return value


def _wire_optional(value: Any, kind: type, what: str) -> Any:
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ValueError(f"{what} must be {kind.__name__} or nil, got {type(value).__name__}")
    return value


#: How deeply an ``extra_keys`` entry may nest arrays (vLLM's deepest is 2: a multimodal
#: key ``("mm", 0)`` inside a block's tuple); deeper is malformed.
MAX_EXTRA_KEYS_DEPTH = 8


def _frozen(value: Any, depth: int = 0) -> Any:
    """msgpack arrays decode as lists; events hold tuples so they compare and hash by value.
    Nesting is bounded (``MAX_EXTRA_KEYS_DEPTH``), so this never recurses far."""
    if isinstance(value, (list, tuple)):
        if depth >= MAX_EXTRA_KEYS_DEPTH:
            raise ValueError(f"nested deeper than {MAX_EXTRA_KEYS_DEPTH} arrays")
        return tuple(_frozen(v, depth + 1) for v in value)
    if isinstance(value, dict):
        raise ValueError("a map is not a valid extra key")
    return value


def _wire_extra_keys(value: Any, what: str) -> Optional[tuple]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
            entry is None or isinstance(entry, (list, tuple)) for entry in value):
        raise ValueError(f"{what} must be nil or an array of arrays or nils")
    try:
        return _frozen(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


class _Fields:
    """Field access by name for a tagged map: unknown keys are never looked at."""

    __slots__ = ("_data", "_tag")

    def __init__(self, data: dict, tag: str) -> None:
        self._data = data
        self._tag = tag

    def required(self, name: str) -> Any:
        if name not in self._data:
            raise ValueError(f"{self._tag} lacks the required field {name!r}")
        return self._data[name]

    def optional(self, name: str) -> Any:
        return self._data.get(name)


def _stored_from(fields: Any, tag: str) -> BlockStored:
    parent = fields.required("parent_block_hash")
    return BlockStored(
        _wire_hash_list(fields.required("block_hashes"), f"{tag}.block_hashes"),
        None if parent is None else _wire_hash(parent, f"{tag}.parent_block_hash"),
        _wire_int_list(fields.required("token_ids"), f"{tag}.token_ids"),
        _wire_int(fields.required("block_size"), f"{tag}.block_size"),
        _wire_optional(fields.optional("lora_id"), int, f"{tag}.lora_id"),
        _wire_optional(fields.optional("medium"), str, f"{tag}.medium"),
        _wire_optional(fields.optional("lora_name"), str, f"{tag}.lora_name"),
        _wire_extra_keys(fields.optional("extra_keys"), f"{tag}.extra_keys"),
        _wire_optional(fields.optional("group_idx"), int, f"{tag}.group_idx"),
        _wire_optional(fields.optional("cache_salt"), str, f"{tag}.cache_salt"),
    )


def _removed_from(fields: Any, tag: str) -> BlockRemoved:
    return BlockRemoved(
        _wire_hash_list(fields.required("block_hashes"), f"{tag}.block_hashes"),
        _wire_optional(fields.optional("medium"), str, f"{tag}.medium"),
        _wire_optional(fields.optional("group_idx"), int, f"{tag}.group_idx"),
    )


class _Positional:
    """Field access by place for a tagged array; places past the known ones are ignored."""

    __slots__ = ("_item", "_places", "_tag")

    def __init__(self, item: Any, places: Tuple[str, ...], tag: str) -> None:
        needed = _POSITIONAL_NEEDED[tag]
        if len(item) < needed + 1:
            raise ValueError(
                f"{tag} array has {len(item) - 1} fields, needs {needed} "
                f"({', '.join(places[:needed])})"
            )
        self._item = item
        self._places = places
        self._tag = tag

    def required(self, name: str) -> Any:
        return self._item[1 + self._places.index(name)]

    def optional(self, name: str) -> Any:
        if name not in self._places:
            return None
        place = 1 + self._places.index(name)
        return self._item[place] if place < len(self._item) else None


# Places of each event's fields in the positional layout; the trailing ones (past
# _POSITIONAL_NEEDED) are sent only when set, so a namespace or group is never dropped.
_POSITIONAL_PLACES = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_POSITIONAL_NEEDED = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}


def _decode_event(item: Any) -> KVEvent:
    """One event in either encoding; ValueError says what is wrong, without context."""
    if isinstance(item, dict):
        tag = item.get("type")
        if not isinstance(tag, str):
            raise ValueError("a map event needs a str field 'type'")
        fields: Any = _Fields(item, tag)
    elif isinstance(item, (list, tuple)) and item and isinstance(item[0], str):
        tag = item[0]
        if tag not in _POSITIONAL_PLACES:
            raise ValueError(f"unknown event type {tag!r}")
        fields = _Positional(item, _POSITIONAL_PLACES[tag], tag)
    else:
        raise ValueError(
            f"expected a tagged map or tagged array, got {type(item).__name__}"
        )
    if tag == "BlockStored":
        return _stored_from(fields, tag)
    if tag == "BlockRemoved":
        return _removed_from(fields, tag)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {tag!r}")


def decode_event(item: Any) -> KVEvent:
    """Decode one msgpack-decoded event, a tagged map or a tagged array, as a KV event.

    See "Wire format" in ``radixcache.events`` for the fields each event requires.

    Args:
        item: The event as msgpack decoded it (a dict or a list).

    Returns:
        A ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``.

    Raises:
        ValueError: naming what is malformed.
    """
    try:
        return _decode_event(item)
    except ValueError as exc:
        raise ValueError(f"malformed event: {exc}") from None


def decode_batch(payload: bytes, seq: int = -1) -> ReceivedBatch:
    """Decode one msgpack batch payload ``[ts, [events...], dp_rank]``.

    Its events may be in either encoding, even mixed. Needs msgspec
    (``pip install radixcache[events]``).

    Args:
        payload: The payload (the last frame of a ZeroMQ message).
        seq: The batch's sequence number, kept in the result and named in errors.

    Returns:
        A ``ReceivedBatch``.

    Raises:
        ValueError: naming the batch, event and field that are malformed.
        ImportError: msgspec is not installed.
    """
    _, msgspec = _transport("decode_batch")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"malformed event batch {seq}: a payload is bytes, got "
                         f"{type(payload).__name__}")
    typed = _decode_typed(payload, msgspec)
    if typed is not None:
        ts, events, rank = typed
        return ReceivedBatch(seq, ts, [_event_of(event) for event in events], rank, payload)
    return _decode_checked(payload, seq, msgspec)


def _decode_checked(payload: Any, seq: int, msgspec: Any) -> ReceivedBatch:
    """``decode_batch`` field by field: any batch, its events in either encoding, even
    mixed; what is malformed is named."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed event batch {seq}: {exc}") from None
    except RecursionError:
        # msgspec guards its recursion with Python's limit: arrays or maps nested deeper
        # than any event batch can be are malformed, however deep.
        raise ValueError(f"malformed event batch {seq}: nested too deeply") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise ValueError(f"malformed event batch {seq}: expected [ts, events, dp_rank]")
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise ValueError(f"malformed event batch {seq}: ts must be a number")
    if not isinstance(events, list):
        raise ValueError(f"malformed event batch {seq}: events must be an array")
    if rank is not None and not _is_builtin_int(rank):
        raise ValueError(f"malformed event batch {seq}: data_parallel_rank must be int or nil")
    decoded = []
    for index, item in enumerate(events):
        try:
            decoded.append(_decode_event(item))
        except ValueError as exc:
            raise ValueError(f"malformed event batch {seq}, event {index}: {exc}") from None
    return ReceivedBatch(seq, float(ts), decoded, rank, payload)


# -- typed decoding ----------------------------------------------------------------------
# A batch whose events are all in one encoding is decoded and checked by msgspec itself, into
# the structs below, which take exactly what the field-by-field reading takes (the same
# types, required fields and places; unknown fields and trailing places ignored). Anything
# they refuse (a malformed batch, events in both encodings) is read field by field, which
# accepts it or names what is wrong: the answer and the errors are those of that reading.
# (map decoder, positional decoder, stored types, removed types), built once: token ids as
# ints, and (``_TYPED_RAW``, for ``KvIndexer``) as their msgpack bytes, undecoded
_TYPED: Any = None
_TYPED_RAW: Any = None


def _typed_decoders(msgspec: Any) -> tuple:
    global _TYPED, _TYPED_RAW
    if _TYPED is None:
        _TYPED_RAW = _build_typed(msgspec, msgspec.Raw)
        _TYPED = _build_typed(msgspec, list[int])
    return _TYPED


def _build_typed(msgspec: Any, Tokens: Any) -> tuple:
    Hash = Union[int, bytes]
    Struct = msgspec.Struct

    class StoredMap(Struct, tag_field="type", tag="BlockStored"):
        block_hashes: list[Hash]
        parent_block_hash: Optional[Hash]
        token_ids: Tokens
        block_size: int
        lora_id: Optional[int] = None
        medium: Optional[str] = None
        lora_name: Optional[str] = None
        extra_keys: Any = None  # checked by _wire_extra_keys
        group_idx: Optional[int] = None
        cache_salt: Optional[str] = None

    class RemovedMap(Struct, tag_field="type", tag="BlockRemoved"):
        block_hashes: list[Hash]
        medium: Optional[str] = None
        group_idx: Optional[int] = None

    class ClearedMap(Struct, tag_field="type", tag="AllBlocksCleared"):
        pass

    # The positional layout (_POSITIONAL_PLACES): the tag, then the places; the first
    # _POSITIONAL_NEEDED are required.
    class StoredPos(Struct, tag="BlockStored", array_like=True):
        block_hashes: list[Hash]
        parent_block_hash: Optional[Hash]
        token_ids: Tokens
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str] = None
        extra_keys: Any = None
        group_idx: Optional[int] = None
        cache_salt = None  # not a place: never sent in this layout

    class RemovedPos(Struct, tag="BlockRemoved", array_like=True):
        block_hashes: list[Hash]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class ClearedPos(Struct, tag="AllBlocksCleared", array_like=True):
        pass

    def batch_type(event_type: Any) -> type:
        class Batch(Struct, array_like=True, forbid_unknown_fields=True):
            ts: float  # an int or a float, not a bool
            events: list[event_type]
            data_parallel_rank: Optional[int] = None
        return Batch

    decoder = msgspec.msgpack.Decoder
    return (decoder(batch_type(Union[StoredMap, RemovedMap, ClearedMap])),
            decoder(batch_type(Union[StoredPos, RemovedPos, ClearedPos])),
            (StoredMap, StoredPos), (RemovedMap, RemovedPos))


def _decode_typed(payload: Any, msgspec: Any, raw: bool = False) -> Optional[tuple]:
    """``(ts, typed events, data_parallel_rank)`` of a batch the structs take, else None;
    ``raw``: the token ids left as their msgpack bytes (``msgspec.Raw``, unchecked)."""
    _typed_decoders(msgspec)
    by_map, by_place, _, _ = _TYPED_RAW if raw else _TYPED
    try:
        try:
            batch = by_map.decode(payload)
        except msgspec.ValidationError:
            batch = by_place.decode(payload)
        for event in batch.events:
            if getattr(event, "extra_keys", None) is not None:
                _wire_extra_keys(event.extra_keys, "extra_keys")  # the same check
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None  # a ValidationError is a DecodeError
    return batch.ts, batch.events, batch.data_parallel_rank


def _typed_events(payload: Any) -> Optional[list]:
    """The typed structs of a batch the typed decoder takes (see ``_decode_typed``), their
    token ids left as msgpack bytes (``msgspec.Raw``), else None (then ``decode_batch``
    reads it, or names what is wrong). For ``KvIndexer``, which reads the token ids itself
    and a struct as it reads an event (the same fields), but for ``extra_keys``:
    ``_event_of`` makes the event of a struct that has them, once its token ids are read."""
    _, msgspec = _transport("decode_batch")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return None
    typed = _decode_typed(payload, msgspec, raw=True)
    return None if typed is None else typed[1]


def _typed_kinds() -> tuple:
    """``(stored struct types, removed struct types)`` of ``_typed_events``."""
    return _TYPED_RAW[2], _TYPED_RAW[3]


def _event_of(event: Any) -> KVEvent:
    """The KV event of a typed struct (see ``_decode_typed``)."""
    kind = type(event)
    if kind in _TYPED[2] or kind in _TYPED_RAW[2]:
        extra_keys = event.extra_keys
        return BlockStored(
            tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids),
            event.block_size, event.lora_id, event.medium, event.lora_name,
            None if extra_keys is None else _frozen(extra_keys), event.group_idx,
            event.cache_salt)
    if kind in _TYPED[3] or kind in _TYPED_RAW[3]:
        return BlockRemoved(tuple(event.block_hashes), event.medium, event.group_idx)
    return AllBlocksCleared()


def _check_events(events: Iterable[Any]) -> tuple:
    batch = tuple(events)
    for event in batch:
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"expected KV events, got {type(event).__name__}")
    return batch


def _batch_wire(ts: float, batch: tuple, data_parallel_rank: Optional[int],
                encoding: str) -> list:
    return [ts, [event.to_wire(encoding) for event in batch], data_parallel_rank]


def _encode(encoder: Any, wire: list) -> bytes:
    try:
        return encoder.encode(wire)
    except (OverflowError, UnicodeEncodeError, TypeError) as exc:
        # A namespace or field msgpack cannot carry: an int beyond 64 bits, a lone surrogate.
        raise ValueError(f"event batch cannot be encoded as msgpack: {exc}") from None


def encode_batch(events: Iterable[KVEvent], *, encoding: str = DEFAULT_ENCODING,
                 ts: Optional[float] = None, data_parallel_rank: Optional[int] = 0) -> bytes:
    """Encode events as the msgpack payload ``[ts, [events...], dp_rank]`` a publisher sends.

    Needs msgspec (``pip install radixcache[events]``).

    Args:
        events: The KV events of the batch, in order.
        encoding: ``"map"`` (vLLM >= 0.33, the default) or ``"positional"``.
        ts: The batch's timestamp in seconds since the epoch (default: now).
        data_parallel_rank: The publisher's data-parallel rank, or None.

    Returns:
        The payload bytes.

    Raises:
        TypeError: an item that is not a KV event, or a ``ts`` or ``data_parallel_rank``
            of the wrong type.
        ValueError: an unknown ``encoding``, a namespace msgpack cannot carry (an int
            beyond 64 bits, a str with a lone surrogate), or a ``cache_salt`` in the
            positional encoding (which has no place for it).
        ImportError: msgspec is not installed.
    """
    _, msgspec = _transport("encode_batch")
    _check_encoding(encoding)
    batch = _check_events(events)
    if ts is None:
        ts = time.time()
    elif not is_real(ts):
        raise TypeError(f"ts must be a number, got {type(ts).__name__}")
    if data_parallel_rank is not None and not _is_builtin_int(data_parallel_rank):
        raise TypeError("data_parallel_rank must be an int or None")
    return _encode(msgspec.msgpack.Encoder(),
                   _batch_wire(float(ts), batch, data_parallel_rank, encoding))


def _transport(what: str):
    try:
        import msgspec
        import msgspec.msgpack
        import zmq
    except ImportError as exc:
        raise ImportError(
            f"{what} needs the optional dependencies pyzmq and msgspec: {_EXTRA_HINT}"
        ) from exc
    return zmq, msgspec




ReceivedBatch.__module__ = "radixcache.events"  # pickles name the public module (see types)

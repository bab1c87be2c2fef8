"""The request bodies of both dialects as ``msgspec`` structs (checked as they are decoded:
types, ranges, required fields), and the answers each dialect expects.

- Mooncake's (RFC #1403, Mooncake Conductor): ``modelname`` in ``/register`` and
  ``/unregister``, ``model`` in the queries, string instance ids, ``tenant_id``; ``/query``
  answers ``{tenant: {instance: {"longest_matched", "GPU", "CPU", "DISK", "DP"}}}``.
- Dynamo's (``python -m dynamo.indexer``): ``model_name``, integer instance ids,
  ``routing_group`` (this service's tenant); ``/query`` answers ``{"scores",
  "frequencies", "instances": {instance: {"longest_matched", "gpu", "cpu", "disk",
  "dp"}}}``; ``/register`` answers 201, a second registration of the same instance 409.

A request is Dynamo's when its body has a ``model_name`` field, Mooncake's otherwise.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta, Struct

from .. import _core

# Token ids are u32, as the document's hashing standard reads them.
Token = Annotated[int, Meta(ge=0, lt=1 << 32)]
# msgspec bounds must fit int64: an unsigned 64-bit hash or id is checked by ``check_u64``.
Hash = int
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 31)]
Name = Annotated[str, Meta(min_length=1, max_length=1024)]
OptText = Optional[Annotated[str, Meta(max_length=1024)]]
Endpoint = Annotated[str, Meta(min_length=1, max_length=1024)]
DynamoId = Annotated[int, Meta(ge=0)]


class MooncakeRegister(Struct):
    endpoint: Endpoint
    type: Name
    modelname: Name
    instance_id: Name
    block_size: BlockSize
    dp_rank: Rank
    replay_endpoint: OptText = None
    lora_name: OptText = None
    tenant_id: OptText = None
    additionalsalt: OptText = None
    address: OptText = None  # this service's: the instance's serving ip:port


class MooncakeUnregister(Struct):
    instance_id: Name
    type: OptText = None
    modelname: OptText = None
    lora_name: OptText = None
    tenant_id: OptText = None
    block_size: Optional[BlockSize] = None
    dp_rank: Optional[Rank] = None


class MooncakeQuery(Struct):
    model: Name
    token_ids: list[Token]
    block_size: BlockSize
    tenant_id: OptText = None
    instance_id: Optional[Name] = None
    lora_name: OptText = None
    lora_id: Optional[int] = None
    cache_salt: OptText = None


class MooncakeQueryByHash(Struct):
    model: Name
    block_size: BlockSize
    seq_hashes: Optional[list[Hash]] = None
    block_hash: Optional[list[Hash]] = None
    tenant_id: OptText = None
    instance_id: Optional[Name] = None
    lora_name: OptText = None
    lora_id: Optional[int] = None
    cache_salt: OptText = None


class DynamoRegister(Struct):
    instance_id: DynamoId
    endpoint: Endpoint
    model_name: Name
    block_size: BlockSize
    routing_group: Name = "default"
    tenant_id: OptText = None
    dp_rank: Optional[Rank] = None
    replay_endpoint: OptText = None
    additional_salt: OptText = None
    additionalsalt: OptText = None
    type: Optional[Name] = None  # this service's: the publisher type (vLLM by default)
    lora_name: OptText = None
    address: OptText = None  # this service's: the instance's serving ip:port


class DynamoUnregister(Struct):
    instance_id: DynamoId
    model_name: Name
    routing_group: Optional[Name] = None
    tenant_id: OptText = None
    dp_rank: Optional[Rank] = None


class DynamoQuery(Struct):
    token_ids: list[Token]
    model_name: Name
    routing_group: Name = "default"
    tenant_id: OptText = None
    lora_name: OptText = None
    cache_salt: OptText = None
    block_size: Optional[BlockSize] = None  # this service's: for a model with several


class DynamoQueryByHash(Struct):
    block_hashes: list[Hash]
    model_name: Name
    routing_group: Name = "default"
    tenant_id: OptText = None
    cache_salt: OptText = None
    lora_name: OptText = None
    block_size: Optional[BlockSize] = None


class SelectRequest(Struct):
    token_ids: list[Token]
    model: OptText = None
    model_name: OptText = None
    block_size: Optional[BlockSize] = None
    tenant_id: OptText = None
    routing_group: OptText = None
    lora_name: OptText = None
    cache_salt: OptText = None
    policy: OptText = None
    request_id: Optional[Name] = None
    output_tokens: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0


class LoadReport(Struct):
    request_id: Name
    event: Annotated[str, Meta(pattern="^(start|end)$")]
    instance_id: Union[Name, DynamoId, None] = None
    tokens: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0


_DECODERS: dict = {}
_TOKEN_DECODERS: dict = {}
_FIELD = re.compile(r"`\$\.([A-Za-z_]+)|field `([A-Za-z_]+)`")


class BadRequest(Exception):
    """A body that does not decode: ``field`` names what is wrong where it can; ``status``
    is the HTTP status (400, or 422 for a well-formed body of the wrong shape in Dynamo's
    dialect, as Dynamo answers)."""

    def __init__(self, message: str, field: Optional[str], status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


#: The structs of Dynamo's dialect: a well-formed body of the wrong shape is a 422 there.
_DYNAMO: set = set()
_encode = msgspec.json.Encoder().encode


def decode(body: bytes, kind: type) -> Any:
    """``body`` as a ``kind`` struct (BadRequest naming the field when it is not one)."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        found = _FIELD.search(str(exc))
        raise BadRequest(str(exc), next(filter(None, found.groups())) if found else None,
                         422 if kind in _DYNAMO else 400) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}", None) from None
    except RecursionError:  # msgspec's bound on nesting, for a field nobody reads
        raise BadRequest("malformed JSON: nested too deeply", None) from None


_DYNAMO.update((DynamoRegister, DynamoUnregister, DynamoQuery, DynamoQueryByHash))


#: Where a body's ``token_ids`` array starts (the key, its colon, the bracket).
_IDS_KEY = re.compile(rb'"token_ids"\s*:\s*\[')


def split_ids(body: bytes) -> Optional[tuple]:
    """``(head, ids)``: ``body`` with its ``token_ids`` array written ``[]`` (a few hundred
    bytes to decode and search, not the 50 kB of an 8,192-token prompt) and the array's ids
    as int64 little-endian bytes (``json_ids``); or None when the body cannot be split so
    (ids written unusually, the key written twice or with escapes), for ``decode`` to read.

    What is cut out is digits, commas and blanks only, so ``head`` holds every key of the
    body and is valid JSON exactly when the body is."""
    found = _IDS_KEY.search(body)
    if found is None:
        return None
    start = found.end() - 1
    end = body.find(b"]", start)
    if end < 0:
        return None
    ids = _core.blocks.json_ids(body, start, end + 1)  # read in place
    if ids is None:
        return None
    head = body[:start] + b"[]" + body[end + 1:]
    if head.count(b'"token_ids"') != 1 or b"\\" in head:
        return None  # another token_ids (nested, or a duplicate key) could be the one read
    return head, ids


#: ``decode_tokens``'s ``split`` when the caller has not split the body.
_NOT_SPLIT: Any = object()


def decode_tokens(body: bytes, kind: type, split: Any = _NOT_SPLIT) -> Any:
    """``decode(body, kind)`` for a struct with ``token_ids``, whose ids come as an int64
    numpy array read by the block module (``json_ids``: no int object made per id) rather
    than a list; ``split`` is ``split_ids(body)`` (None included) when the caller has it.
    A body that cannot be read so (an error, or ids written unusually) is decoded by
    ``decode``: the same answer, or the same error."""
    decoder = _TOKEN_DECODERS.get(kind)
    if decoder is None:
        fields = []
        for f in msgspec.structs.fields(kind):
            kind_of = msgspec.Raw if f.name == "token_ids" else f.type
            if f.required:
                fields.append((f.name, kind_of))
            else:
                fields.append((f.name, kind_of, msgspec.field(
                    default=f.default, default_factory=f.default_factory)))
        raw_kind = msgspec.defstruct(kind.__name__ + "Raw", fields)
        decoder = _TOKEN_DECODERS[kind] = msgspec.json.Decoder(raw_kind)
    if split is _NOT_SPLIT:
        split = split_ids(body)
    if split is None:
        return decode(body, kind)
    try:
        req = decoder.decode(split[0])
    except (msgspec.DecodeError, RecursionError):
        return decode(body, kind)  # its error
    if bytes(req.token_ids) != b"[]":  # not the array cut out
        return decode(body, kind)
    import numpy as np

    req.token_ids = np.frombuffer(split[1], dtype="<i8")
    return req


def check_u64(values: list, field: str, signed: bool = True) -> list:
    """``values`` if each is a 64-bit integer (signed or unsigned); BadRequest naming the
    field otherwise."""
    low = -(1 << 63) if signed else 0
    for i, value in enumerate(values):
        if not low <= value < (1 << 64):
            raise BadRequest(f"{field}[{i}] is not a 64-bit integer: {value}", field)
    return values


def is_dynamo(body: bytes) -> bool:
    """Whether a body is Dynamo's dialect: it has a ``model_name`` key (a JSON string can
    only hold that text with its quotes escaped, so a value never looks like the key)."""
    return b'"model_name"' in body


def mooncake_answer(tenant: str, rows: list, block_size: int) -> bytes:
    """Mooncake's ``/query`` answer (``{}`` when no instance of the tenant answers) of
    ``IndexService.query_rows``' ``(rows, block_size)``, as JSON."""
    return _core.blocks.query_answer(rows, block_size, _encode(tenant))


def dynamo_answer(rows: list, block_size: int) -> bytes:
    """Dynamo's ``/query`` answer of ``IndexService.query_rows``' ``(rows, block_size)``,
    as JSON: the instances with a hit, ``scores`` their device hits per rank."""
    return _core.blocks.query_answer(rows, block_size, None)

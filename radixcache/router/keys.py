"""What a block's key is made of, and how events name their copy: the namespace of a
sequence (``extra_keys``, or SGLang's ``lora_name`` and ``cache_salt``), a block's own extra
keys folded into the chain, the tier (``medium``) and KV-cache group of an event, an event's
token ids as bytes, and the chain of keys itself (``chain_keys``; the block module's
``page_hash_chain``, compiled when built, seeded by the namespace).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from typing import Any, Optional

import numpy as np

from .. import _core
from .._validate import is_int
from ..events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockStored,
    TokenIds,
    canonical_namespace,
    encode_namespace,
    tokens_le_bytes,
)
from ..events.hashing import fast64_root
from ..events.recorder import KEYS_REMOVED, KEYS_STORED

_LITTLE_ENDIAN = sys.byteorder == "little"
# A publisher's block hashes are only looked up, never computed with: vLLM sends ints or
# bytes (its ExternalBlockHash).
_HASH_TYPES = (int, bytes)

# The block module's page hash chain and token readers (compiled when built): the block keys
# are the chain seeded by the namespace.
_page_keys = _core.blocks.page_hash_chain
_ids_le_bytes = _core.blocks.ids_le_bytes
_msgpack_ids = _core.blocks.msgpack_ids


def _all_hash_types(hashes: Any) -> bool:
    return set(map(type, hashes)) <= _HASH_TYPE_SET


_HASH_TYPE_SET = set(_HASH_TYPES)


def _event_token_bytes(token_ids: Any) -> bytes:
    """An event's token ids as int64 little-endian bytes; a tuple or list (what events hold)
    is read by the block module in one pass, or through ``array('q')`` when an item is no
    exact int (a bool, an int subclass: taken as before), cheaper than numpy."""
    if type(token_ids) is TokenIds:
        return token_ids.le_bytes
    if type(token_ids) is tuple or type(token_ids) is list:
        try:
            return _ids_le_bytes(token_ids)
        except (TypeError, OverflowError):
            pass  # any int64 value array('q') takes, or its error
        if _LITTLE_ENDIAN:
            return array("q", token_ids).tobytes()  # TypeError/OverflowError: not int64
    return tokens_le_bytes(token_ids)


@functools.lru_cache(maxsize=4096)  # a query's namespace is usually one of a few
def _root_key(namespace: bytes) -> int:
    # The chain of a sequence starts from its namespace, so equal tokens in two namespaces
    # get different keys: the seed of the fast64 block hash, so a fast64 publisher's hashes
    # are the indexer's keys.
    return fast64_root(namespace)


def _event_namespace(event: BlockStored) -> Any:
    """The namespace of a root event's blocks: its first block's ``extra_keys`` entry when
    the publisher sends extra keys (entries that are all null count as none, as the
    positional encoding drops them), else the one the event names (``_named_namespace``).

    vLLM's layout carries ``extra_keys`` per block (None, or a tuple of keys); the first
    block's entry names the sequence (``_entry_namespace``): a LoRA request's entries start
    with its ``lora_name``, the first one ends with its ``cache_salt``.
    """
    extra_keys = getattr(event, "extra_keys", None)
    if _has_entries(extra_keys):
        return _entry_namespace(_entry(extra_keys[0]))
    return _named_namespace(event)


def _named_namespace(event: BlockStored) -> Any:
    """The namespace an event names by its fields, as SGLang sends it (no extra keys): its
    adapter (``lora_name``, else ``lora_id``, which vLLM keeps for the consumers of its
    events from before ``lora_name``), its ``cache_salt``, or ``(adapter, cache_salt)`` when
    both are set, the order of a vLLM request's first entry; its ``session_id`` is
    attribution only and never part of a block's identity."""
    lora = getattr(event, "lora_name", None)
    if lora is None:
        lora = getattr(event, "lora_id", None)
        if lora is not None:
            if not is_int(lora):
                raise TypeError("lora_id must be an int or None")
            lora = int(lora)
    elif not isinstance(lora, str):
        raise TypeError("lora_name must be a str or None")
    salt = getattr(event, "cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        raise TypeError("cache_salt must be a str or None")
    return _adapter_and_salt(lora, salt)


def namespace_for(lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> Any:
    """Tell the namespace of a sequence cached for a LoRA adapter with a cache salt, as
    SGLang's events name it: the ``extra_key`` a query passes to find such a request's blocks.

    Args:
        lora_name: The adapter's name, or None for the base model.
        cache_salt: The request's cache salt, or None.

    Returns:
        ``lora_name``, or ``cache_salt``, or ``(lora_name, cache_salt)`` when both are set;
        None for neither.

    Raises:
        TypeError: a value that is not a str or None.
    """
    for value in (lora_name, cache_salt):
        if value is not None and not isinstance(value, str):
            raise TypeError("lora_name and cache_salt must be str or None")
    return _adapter_and_salt(lora_name, cache_salt)


def _adapter_and_salt(adapter: Any, salt: Optional[str]) -> Any:
    """The namespace of an adapter (a name, or an id) and a salt, either None."""
    if salt is None:
        return adapter
    return salt if adapter is None else (adapter, salt)


def _has_entries(extra_keys: Any) -> bool:
    """Whether an event's ``extra_keys`` hold any entry (not None, not empty)."""
    return bool(extra_keys) and any(_entry(entry) is not None for entry in extra_keys)


def _namespace_entry(namespace: Any) -> Optional[tuple]:
    """The ``extra_keys`` entry that names ``namespace`` (``(namespace,)``, or the tuple of
    one that is a tuple), as a sequence's first block spells it; None for none."""
    if namespace is None:
        return None
    return _entry(namespace) if isinstance(namespace, tuple) else (namespace,)


def _entry(entry: Any) -> Optional[tuple]:
    """A block's ``extra_keys`` entry as a tuple, nested arrays as tuples (a list and a tuple
    spell the same entry); None for none or an empty one."""
    if entry is None:
        return None
    if not isinstance(entry, (list, tuple)):
        return (_frozen(entry),)
    return tuple(_frozen(item) for item in entry) or None


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def _entry_namespace(entry: Optional[tuple]) -> Any:
    """The namespace an entry names as a sequence's first: a one-element entry is that
    element, a longer one the tuple."""
    if entry is None:
        return None
    return entry[0] if len(entry) == 1 else entry


def _fold(key: int, entry: tuple) -> int:
    """``key`` with a block's own extra keys (an image's hash, ...) mixed in."""
    digest = hashlib.blake2b(key.to_bytes(8, "little", signed=True) + _namespace_bytes(entry),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# SGLang's names for the tiers it shares with vLLM: its pinned host memory is the host tier.
_MEDIUM_ALIASES = {"CPU_PINNED": MEDIUM_CPU}


def _tier(medium: str) -> str:
    return _MEDIUM_ALIASES.get(medium, medium)


def _namespace_bytes(namespace: Any) -> bytes:
    try:
        return encode_namespace(namespace)
    except TypeError:
        # A publisher may send any msgpack value; a stable spelling keeps it a namespace.
        return b"R" + repr(namespace).encode("utf-8", "surrogatepass")


def _int64_array(tokens: Any) -> bool:
    """Whether ``tokens`` is a numpy array the block index reads in place: exactly
    ``numpy.ndarray``, 1-D, contiguous, little-endian int64."""
    return (type(tokens) is np.ndarray and tokens.dtype.str == "<i8" and tokens.ndim == 1
            and tokens.flags.c_contiguous)


def _is_key_record(record: tuple) -> bool:
    """A ``KeyRecorder`` record: ``(KEYS_STORED, keys, parent_key)`` or ``(KEYS_REMOVED,
    keys)``, ``keys`` whole int64s as bytes, ``parent_key`` an int or None."""
    if len(record) == 3:
        tag, keys, parent = record
        if type(tag) is not int or tag != KEYS_STORED or not (
                parent is None or type(parent) is int):
            return False
    elif len(record) == 2:
        tag, keys = record
        if type(tag) is not int or tag != KEYS_REMOVED:
            return False
    else:
        return False
    return type(keys) is bytes and len(keys) % 8 == 0


def _event_medium(event: Any) -> str:
    """An event's tier: its ``medium``, ``"GPU"`` (the device tier) when it names none."""
    medium = getattr(event, "medium", None)
    if medium is None:
        return MEDIUM_GPU
    if not isinstance(medium, str):
        raise TypeError("medium must be a str or None")
    return _tier(medium)


def _event_group(event: Any) -> Any:
    """An event's KV-cache group: its ``group_idx``, None for the first group (an event
    that names none, or 0: vLLM numbers a model's groups from 0)."""
    group = getattr(event, "group_idx", None)
    if group is not None:
        if not is_int(group):
            raise TypeError("group_idx must be an int or None")
        group = int(group) or None
    return group


def _group(group: Any) -> Any:
    """A ``group_idx`` read by the block module (an int or None), as ``_event_group``."""
    return group or None


# The tiers a block's parent is looked for on, when the event's own tier does not hold it:
# the device first, then the host (a host copy is made from the device), then the others
# by name.
def _parent_tier_order(copy: Any) -> tuple:
    medium = copy.medium
    return (medium != MEDIUM_GPU, medium != MEDIUM_CPU, medium)


def chain_keys(page_bytes: int, seed: int, data: bytes, extra_keys: Any,
               ns_entry: Optional[tuple]) -> list:
    """The keys of the blocks of ``data`` (``page_bytes`` a block) below ``seed``: the page
    hash chain, each block whose ``extra_keys`` entry is neither None nor the namespace's own
    (``ns_entry``) folded with it, the next blocks chained from the folded key."""
    if not extra_keys:
        return _page_keys(seed, data, page_bytes)
    pages = len(data) // page_bytes
    folds = []
    for i, raw in enumerate(extra_keys[:pages]):
        entry = _entry(raw)
        if entry is not None and entry != ns_entry:
            folds.append((i, entry))
    if not folds:
        return _page_keys(seed, data, page_bytes)
    keys: list = []
    start = 0
    for i, entry in folds:
        part = _page_keys(seed, data[start * page_bytes:(i + 1) * page_bytes], page_bytes)
        part[-1] = seed = _fold(part[-1], entry)
        keys += part
        start = i + 1
    if start < pages:
        keys += _page_keys(seed, data[start * page_bytes:pages * page_bytes], page_bytes)
    return keys


def query_namespace(extra_key: Any, block_extra_keys: Any) -> tuple:
    """``(namespace bytes, entries, namespace entry)`` of a query (see ``block_keys``)."""
    if type(extra_key) is tuple:
        # An entry of keys, read as a stored sequence's first entry is: one key is that key.
        ns_entry = _entry(extra_key)
        extra_key = _entry_namespace(ns_entry)
        namespace = _namespace_bytes(extra_key)
    else:
        namespace = encode_namespace(extra_key)
        ns_entry = None if extra_key is None else (canonical_namespace(extra_key),)
    if block_extra_keys is None:
        return namespace, None, ns_entry
    if type(block_extra_keys) not in (list, tuple) or not all(
            entry is None or isinstance(entry, (list, tuple)) for entry in block_extra_keys):
        raise TypeError("block_extra_keys must be a list or tuple of entries (None, or a "
                        "tuple of keys)")
    entries = list(block_extra_keys)
    first = _entry(entries[0]) if entries else None
    if first is not None and first != ns_entry:
        if extra_key is not None:
            raise ValueError(f"the first block's extra keys {first!r} name another "
                             f"namespace than extra_key {extra_key!r}")
        # A sequence's first entry is its namespace, as in a stored root event.
        ns_entry = first
        namespace = _namespace_bytes(_entry_namespace(first))
    return namespace, entries, ns_entry

"""KV-cache events: what a cache-aware router needs to mirror which pages a cache holds.

With ``RadixCache(..., enable_events=True)`` the cache records, per full page of
``page_size`` tokens (the block a router sees):

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx)`` when tokens enter the tree: one event per new leaf,
  covering its pages in order; ``parent_block_hash`` is the hash of the page before the first
  one (``None`` at the root);
- ``BlockRemoved(block_hashes, medium, group_idx)`` when an evicted leaf leaves the tree;
- ``AllBlocksCleared()`` on ``reset()``.

``cache.take_events()`` returns them in order and empties the queue. A split emits nothing:
it moves a node boundary, never a page, and a page's hash does not depend on node boundaries.

With a host tier (``RadixCache(..., host_tier=True)``) each event names its tier in
``medium``: a copy to the host is a ``BlockStored`` with ``medium="CPU"``; a node leaving the
device (even if it stays on the host) a ``BlockRemoved`` with the device medium (``"GPU"``); a
host eviction a ``BlockRemoved`` with ``"CPU"``; a load-back, an adoption by ``insert`` or a
new leaf a ``BlockStored`` with the device medium. A page's hash is the same on both tiers.

Fields the recorder fills
-------------------------
- ``extra_keys``: one entry per block, ``None`` when the namespace (the cache's
  ``extra_key``) is None, else the 1-tuple ``(namespace,)`` on EVERY block, the namespace as
  its canonical value (str, bytes, or int: bools and numpy integers become the int they
  equal). Every block carries it because the namespace enters every page's hash, so a router
  can rehash any block without its ancestors' events. A str namespace thus looks exactly like
  a vLLM LoRA request's blocks (``(lora_name,)`` per block). See ``extra_keys_entry``.
- ``medium``: ``EventRecorder(medium=...)``, ``"GPU"`` by default (vLLM's default for the
  device KV pool a prefix cache indexes).
- ``lora_name`` / ``lora_id``: None, unless ``EventRecorder(lora_namespaces=True)`` says the
  namespaces are LoRA adapters: then a str namespace is sent as ``lora_name`` and an int one
  as ``lora_id`` (bytes and None namespaces leave both None). ``EventRecorder(lora_id=N)``
  sets a fixed ``lora_id`` for a cache that serves one adapter.
- ``group_idx``: None (radixcache has one KV-cache group); decoded when a publisher sends it.

Block hash
----------
A page's hash is a signed 64-bit integer chained from its parent page::

    block_hash(parent, tokens, ns) = int.from_bytes(SHA-256(P + N + T)[:8], "big", signed=True)

    P = b"\\x00"                                  when parent is None (first page of a sequence)
        b"\\x01" + parent as 8 bytes, big endian, two's complement   otherwise
    N = the namespace (the cache's ``extra_key``), self-delimiting:
        None  -> b"N"
        str   -> b"S" + len(utf8) as 8 bytes big endian + utf8 (lone surrogates passed through)
        bytes -> b"B" + len(data) as 8 bytes big endian + data
        int   -> b"I" + len(d) as 8 bytes big endian + d, d = ASCII decimal (b"-12");
                 bool and numpy integers count as the int they equal (as dict keys do)
        any other type raises TypeError naming it
    T = the page's token ids, each as 8 bytes little endian, two's complement

The same tokens in the same namespace after the same prefix always get the same hash, in
every process (nothing depends on ``hash()`` or ``PYTHONHASHSEED``) and on either tree core.
``block_hashes(token_ids, page_size, extra_key)`` computes a prompt's chain the same way.

Cost: a cache with events off never imports this module's recorder and never hashes. With
events on, the recorder keeps one int per node (the hash of the node's last page, keyed by
node id) and computes missing ones lazily and iteratively from the nearest known ancestor,
so deep trees never recurse.

Wire format (optional: ``pip install radixcache[events]`` for pyzmq and msgspec)
-------------------------------------------------------------------------------
A batch is the msgpack array ``[ts, [event, ...], dp_rank]`` (vLLM's ``KVEventBatch``). Each
event is encoded one of two ways (``encode_batch(..., encoding=...)``,
``ZmqEventPublisher(..., encoding=...)``):

``"map"`` (the default; vLLM's tagged maps since vLLM PR #42892, vLLM 0.33)::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": i | nil, "medium": s | nil,
     "lora_name": s | nil, "extra_keys": [[ns] | nil, ...]}     (+ "group_idx" when set)
    {"type": "BlockRemoved", "block_hashes": [...], "medium": s | nil}   (+ "group_idx")
    {"type": "AllBlocksCleared"}

  The fields vLLM's schema requires (no default there) are always sent, null included;
  ``extra_keys`` and ``group_idx`` are left out when None, as vLLM's encoder does.

``"positional"`` (the tagged arrays of earlier vLLM versions, for older consumers)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
        (+ lora_name, extra_keys, group_idx when any is set: a namespace, a LoRA name or a
         group; extra_keys with no namespace on any block count as unset)
    ["BlockRemoved", block_hashes, medium]   (+ group_idx when set)
    ["AllBlocksCleared"]

  The trailing places keep the namespace and the group in this layout too (consumers of
  the six-field layout ignore them; vLLM's array structs ignore trailing fields).

``decode_batch`` reads both, event by event: map fields by name and positional fields by
place, ignoring fields it does not know (later ones in an array, unknown keys in a map).
Required: ``block_hashes``, ``parent_block_hash`` (nil at the root), ``token_ids`` and
``block_size`` of a BlockStored, ``block_hashes`` of a BlockRemoved; the other fields are
None when absent. Block hashes may be ints or bytes (vLLM's ``ExternalBlockHash``).
Anything else raises ValueError naming the batch and the field.

Transport
---------
``ZmqEventPublisher`` sends each ``publish(events)`` as three frames on a PUB socket: the topic,
an 8-byte big-endian sequence number and the encoded batch. A replay ROUTER socket answers
``(identity, b"", start_seq)`` with every buffered batch from ``start_seq`` on, as
``(identity, b"", seq, payload)``, then ``(identity, b"", -1, b"")``. ``ZmqEventSubscriber``
receives batches in order, fills sequence gaps through replay and decodes either encoding.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any, Iterable, Iterator, Optional, Tuple, Union

import numpy as np

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventRecorder",
    "KVEvent",
    "ReceivedBatch",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "BLOCK_HASHES",
    "TokenIds",
    "block_hash",
    "block_hashes",
    "tokens_le_bytes",
    "canonical_namespace",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_namespace",
    "event_namespace",
    "extra_keys_entry",
]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_END_SEQ = -1
_EXTRA_HINT = "pip install radixcache[events]"


# -- events -----------------------------------------------------------------------------

# vLLM's names for where a block lives (``vllm.distributed.kv_events.MEDIUM_*``).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# How events are laid out inside a batch; see the module docstring.
ENCODINGS = ("map", "positional")
DEFAULT_ENCODING = "map"


def _check_encoding(encoding: Any) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    return encoding


@dataclass(frozen=True)
class BlockStored:
    """Pages that entered the cache: one event per new leaf, its pages in order.

    Attributes:
        block_hashes: The hash of each page (ints; a decoded vLLM event may carry bytes).
        parent_block_hash: The hash of the page before the first one (None at the root).
        token_ids: The tokens of all the pages, in order.
        block_size: Tokens per page.
        lora_id: The LoRA adapter id, or None.
        medium: Where the blocks live (``MEDIUM_GPU`` by default), or None.
        lora_name: The LoRA adapter name, or None.
        extra_keys: One entry per block (a tuple, or None); radixcache puts
            ``(namespace,)`` on every block of a namespaced leaf (see ``extra_keys_entry``).
        group_idx: The KV-cache group (None: radixcache has one).
    """

    block_hashes: Tuple[Union[int, bytes], ...]
    parent_block_hash: Optional[Union[int, bytes]]
    token_ids: Tuple[int, ...]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[Tuple[Optional[tuple], ...]] = None
    group_idx: Optional[int] = None

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the module docstring's wire format).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``.
        """
        if _check_encoding(encoding) == "positional":
            wire = ["BlockStored", list(self.block_hashes), self.parent_block_hash,
                    list(self.token_ids), self.block_size, self.lora_id, self.medium]
            extra_keys = self.extra_keys
            if extra_keys is not None and all(entry is None for entry in extra_keys):
                extra_keys = None  # no namespace on any block: nothing to carry
            if self.lora_name is not None or extra_keys is not None or self.group_idx is not None:
                # Trailing places, ignored by consumers of the 6-field layout.
                wire += [self.lora_name, None if extra_keys is None else
                         [None if entry is None else list(entry) for entry in extra_keys],
                         self.group_idx]
            return wire
        wire = {"type": "BlockStored", "block_hashes": list(self.block_hashes),
                "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}
        if self.extra_keys is not None:
            wire["extra_keys"] = [None if entry is None else list(entry)
                                  for entry in self.extra_keys]
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        return wire


@dataclass(frozen=True)
class BlockRemoved:
    """Pages that left the cache (an evicted leaf).

    Attributes:
        block_hashes: The hash of each page.
        medium: Where the blocks lived, or None.
        group_idx: The KV-cache group, or None.
    """

    block_hashes: Tuple[Union[int, bytes], ...]
    medium: Optional[str] = None
    group_idx: Optional[int] = None

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the module docstring's wire format).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``.
        """
        if _check_encoding(encoding) == "positional":
            if self.group_idx is not None:
                return ["BlockRemoved", list(self.block_hashes), self.medium, self.group_idx]
            return ["BlockRemoved", list(self.block_hashes), self.medium]
        wire = {"type": "BlockRemoved", "block_hashes": list(self.block_hashes),
                "medium": self.medium}
        if self.group_idx is not None:
            wire["group_idx"] = self.group_idx
        return wire


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page left the cache (``reset()``)."""

    def to_wire(self, encoding: str = DEFAULT_ENCODING) -> Union[dict, list]:
        """This event as msgpack-ready data (see the module docstring's wire format).

        Args:
            encoding: ``"map"`` (vLLM's tagged maps, the default) or ``"positional"``
                (tagged arrays, for older consumers).

        Returns:
            A dict (map) or a list (positional).

        Raises:
            ValueError: an unknown ``encoding``.
        """
        if _check_encoding(encoding) == "positional":
            return ["AllBlocksCleared"]
        return {"type": "AllBlocksCleared"}


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


# -- hashing ----------------------------------------------------------------------------

def encode_namespace(extra_key: Any) -> bytes:
    """Encode ``extra_key`` as the namespace field N of the block hash.

    See the module docstring for the layout.

    Args:
        extra_key: The namespace: None, str, bytes or int (bools and numpy integers count as
            the int they equal).

    Returns:
        The self-delimiting bytes of the namespace.

    Raises:
        TypeError: ``extra_key`` of another type.
    """
    if extra_key is None:
        return b"N"
    if isinstance(extra_key, str):
        # surrogatepass: every str the tree accepts must encode, lone surrogates included.
        data = extra_key.encode("utf-8", "surrogatepass")
        return b"S" + len(data).to_bytes(8, "big") + data
    if isinstance(extra_key, bytes):
        return b"B" + len(extra_key).to_bytes(8, "big") + extra_key
    if isinstance(extra_key, numbers.Integral):
        # bool and numpy integers hash like the int they equal, so they share its namespace.
        data = str(int(extra_key)).encode("ascii")
        return b"I" + len(data).to_bytes(8, "big") + data
    raise TypeError(
        "KV events can only hash an extra_key that is None, str, bytes or int, got "
        f"{type(extra_key).__name__}"
    )


def canonical_namespace(extra_key: Any) -> Union[None, str, bytes, int]:
    """Give the value that names ``extra_key``'s namespace.

    Args:
        extra_key: The namespace: None, str, bytes or int.

    Returns:
        ``extra_key`` itself for None, str, bytes and int; the int they equal for bools and
        numpy integers.

    Raises:
        TypeError: ``extra_key`` of another type.
    """
    encode_namespace(extra_key)  # the one place that decides which types are namespaces
    return _canonical(extra_key)


def _canonical(extra_key: Any) -> Any:
    # For a key encode_namespace accepted; bool is an Integral, and so are numpy integers.
    if extra_key is None or isinstance(extra_key, (str, bytes)) or type(extra_key) is int:
        return extra_key
    return int(extra_key)


def extra_keys_entry(extra_key: Any) -> Optional[tuple]:
    """Give the per-block ``extra_keys`` entry radixcache publishes for a namespace.

    Args:
        extra_key: The namespace: None, str, bytes or int.

    Returns:
        None for no namespace, else ``(canonical_namespace(extra_key),)``.

    Raises:
        TypeError: ``extra_key`` of another type.
    """
    if extra_key is None:
        return None
    return (canonical_namespace(extra_key),)


def event_namespace(event: BlockStored) -> Any:
    """Read the namespace of a ``BlockStored`` in radixcache's ``extra_keys`` layout.

    Args:
        event: A ``BlockStored`` whose ``extra_keys`` are absent, all None, or the same
            ``(namespace,)`` on every block.

    Returns:
        The namespace, or None for none.

    Raises:
        ValueError: the entries are not that layout.
    """
    entries = event.extra_keys
    if entries is None or all(entry is None for entry in entries):
        return None
    first = entries[0]
    if (first is None or len(first) != 1 or len(entries) != len(event.block_hashes)
            or any(entry != first for entry in entries)):
        raise ValueError(
            f"extra_keys {entries!r} are not one (namespace,) entry per block"
        )
    return first[0]


def _hash_page(parent_hash: Optional[int], namespace: bytes, page: bytes) -> int:
    """The chained hash of one page; ``page`` holds its tokens as int64 little endian."""
    if parent_hash is None:
        head = b"\x00"
    else:
        head = b"\x01" + parent_hash.to_bytes(8, "big", signed=True)
    return int.from_bytes(sha256(head + namespace + page).digest()[:8], "big", signed=True)


def tokens_le_bytes(token_ids: Any) -> bytes:
    """Encode token ids as int64 little-endian bytes, the form block hashes are computed over.

    Args:
        token_ids: A 1-D integer sequence: a list, tuple, numpy array or CPU tensor.

    Returns:
        8 bytes per token.

    Raises:
        TypeError: ids that are not integers, or not 1-D.
        OverflowError: an id that does not fit in int64.
    """
    try:
        arr = np.asarray(token_ids)
    except (OverflowError, ValueError) as exc:
        raise OverflowError(f"token ids do not fit in int64: {exc}") from None
    if arr.ndim != 1:
        if arr.ndim == 0 or arr.size:
            raise TypeError(f"token_ids must be a 1-D sequence of ints, got {arr.ndim}-D")
        return b""
    if arr.size == 0:
        return b""
    if arr.dtype.kind == "O":  # Python ints beyond 64 bits, or mixed objects
        try:
            arr = np.array(arr.tolist(), dtype=np.int64)
        except OverflowError:
            raise OverflowError("token ids do not fit in int64") from None
        except (TypeError, ValueError):
            raise TypeError("token_ids must hold integers") from None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > _INT64_MAX:
        raise OverflowError("token ids do not fit in int64")
    return arr.astype("<i8", copy=False).tobytes()


def _check_parent(parent_block_hash: Any) -> Optional[int]:
    if parent_block_hash is None:
        return None
    if isinstance(parent_block_hash, bool) or not isinstance(parent_block_hash, numbers.Integral):
        raise TypeError(
            f"parent_block_hash must be an int or None, got {type(parent_block_hash).__name__}"
        )
    value = int(parent_block_hash)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError(f"parent_block_hash {value} does not fit in int64")
    return value


def block_hash(parent_block_hash: Optional[int], token_ids: Any, extra_key: Any = None) -> int:
    """Compute the hash of one page (see the module docstring's block hash).

    Args:
        parent_block_hash: The hash of the page before it, or None for a sequence's first
            page.
        token_ids: The page's tokens (any 1-D integer sequence).
        extra_key: The namespace: None, str, bytes or int.

    Returns:
        The block hash, a signed 64-bit int.

    Raises:
        TypeError: a ``parent_block_hash`` that is not an int, tokens that are not
            integers, or an ``extra_key`` of another type.
        OverflowError: a hash or token that does not fit in int64.
    """
    parent = _check_parent(parent_block_hash)
    return _hash_page(parent, encode_namespace(extra_key), tokens_le_bytes(token_ids))


def block_hashes(token_ids: Any, page_size: int, extra_key: Any = None,
                 parent_block_hash: Optional[int] = None) -> list:
    """Compute the chained hashes of the full pages of ``token_ids``.

    The same chain a cache with ``enable_events=True`` publishes for these tokens, so a
    router can look a prompt up. A trailing partial page is ignored.

    Args:
        token_ids: The tokens (any 1-D integer sequence).
        page_size: Tokens per page, an int >= 1.
        extra_key: The namespace: None, str, bytes or int.
        parent_block_hash: The hash of the page before the first one (None: the tokens
            start a sequence).

    Returns:
        One hash (a signed 64-bit int) per full page, in order.

    Raises:
        TypeError: a ``page_size`` or ``parent_block_hash`` that is not an int, tokens that
            are not integers, or an ``extra_key`` of another type.
        ValueError: ``page_size`` < 1.
        OverflowError: a hash or token that does not fit in int64.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    parent = _check_parent(parent_block_hash)
    namespace = encode_namespace(extra_key)
    data = tokens_le_bytes(token_ids)
    return _chain(parent, namespace, data, int(page_size) * 8)


def _chain(parent_hash: Optional[int], namespace: bytes, data: bytes, page_bytes: int) -> list:
    hash_page = _hash_page  # looked up per call so tests can count calls by patching it
    hashes = []
    last = parent_hash
    for start in range(0, len(data) - page_bytes + 1, page_bytes):
        last = hash_page(last, namespace, data[start:start + page_bytes])
        hashes.append(last)
    return hashes


#: ``EventRecorder(block_hash=...)``: ``"sha256"`` (the default, see "Block hash") or
#: ``"fast64"``: a 64-bit non-cryptographic chain, the block module's ``page_hash_chain`` seeded
#: by the first 8 bytes of SHA-256(b"radixcache-fast64" + N) for a sequence's first page,
#: the same in every process and core. A consumer that keys blocks by their token ids (as
#: ``KvIndexer`` does) reads either; ``fast64`` is for in-process simulation, where hashing
#: every page with SHA-256 costs more than the cache does. Its events carry their token ids
#: as ``TokenIds`` (a tuple-like view of the bytes, converted only when read).
BLOCK_HASHES = ("sha256", "fast64")


@functools.lru_cache(maxsize=4096)
def _fast_root(namespace: bytes) -> int:
    return int.from_bytes(sha256(b"radixcache-fast64" + namespace).digest()[:8], "big",
                          signed=True)


def _fast_chain(parent_hash: Optional[int], namespace: bytes, data: bytes,
                page_bytes: int) -> list:
    from ._core import blocks  # noqa: PLC0415 -- the block module, loaded with the cache

    seed = _fast_root(namespace) if parent_hash is None else parent_hash
    return blocks.page_hash_chain(seed, data, page_bytes)


class TokenIds(collections.abc.Sequence):
    """Token ids kept as int64 little-endian bytes, read as a tuple of ints.

    Equal to (and hashing like) the tuple of the same ids; converted once, when first read.

    Args:
        le_bytes: The token ids as int64 little-endian bytes (kept as ``le_bytes``).

    Raises:
        TypeError: ``le_bytes`` is not bytes of a multiple of 8 in length.
    """

    __slots__ = ("le_bytes", "_items")

    def __init__(self, le_bytes: bytes) -> None:
        if type(le_bytes) is not bytes or len(le_bytes) % 8:
            raise TypeError("TokenIds needs bytes of int64 little-endian token ids")
        self.le_bytes = le_bytes
        self._items: Optional[tuple] = None

    def _tuple(self) -> tuple:
        if self._items is None:
            self._items = tuple(np.frombuffer(self.le_bytes, dtype="<i8").tolist())
        return self._items

    def __len__(self) -> int:
        """How many token ids.

        Returns:
            The number of ids.
        """
        return len(self.le_bytes) // 8

    def __getitem__(self, index: Any) -> Any:
        return self._tuple()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.le_bytes == other.le_bytes
        if isinstance(other, (tuple, list)):
            return self._tuple() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())


# -- recorder ---------------------------------------------------------------------------

class EventRecorder:
    """Turns the cache's node hooks into page events; ``RadixCache`` owns one when events are on.

    Hooks: ``stored(leaf)`` after a new leaf got its value, ``removed(leaf)`` just before an
    evicted leaf is detached, ``cleared()`` on reset; ``take()`` drains the queue. Events pile
    up until taken. ``len(recorder)`` is the number of events waiting. A cache with a host
    tier also calls ``stored(node)`` when a node comes back to the device (loaded back or
    adopted), ``removed(node)`` when one leaves the device (also when it stays on the host),
    and ``stored_host(node)``/``removed_host(node)`` (``medium="CPU"``) when a node gets a
    host copy or loses it.

    Args:
        page_size: Tokens per page (the cache's), an int >= 1.
        lora_id: A fixed ``lora_id`` for every ``BlockStored`` (a cache that serves one
            adapter), or None.
        medium: The ``medium`` of every event (default ``MEDIUM_GPU``), or None.
        lora_namespaces: If True, a str namespace is sent as ``lora_name`` and an int one as
            ``lora_id``.
        block_hash: How pages are hashed, one of ``BLOCK_HASHES``: ``"sha256"`` (the default,
            stable and collision resistant) or ``"fast64"`` (the block module's 64-bit chain, for
            in-process simulation).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``page_size`` < 1.
    """

    __slots__ = ("page_size", "lora_id", "medium", "lora_namespaces", "block_hash",
                 "_page_bytes", "_last_hash", "_events", "_chain")

    def __init__(self, page_size: int, *, lora_id: Optional[int] = None,
                 medium: Optional[str] = MEDIUM_GPU, lora_namespaces: bool = False,
                 block_hash: str = "sha256") -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral):
            raise TypeError(f"page_size must be an int, got {type(page_size).__name__}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if lora_id is not None and (isinstance(lora_id, bool)
                                    or not isinstance(lora_id, numbers.Integral)):
            raise TypeError(f"lora_id must be an int or None, got {type(lora_id).__name__}")
        if medium is not None and not isinstance(medium, str):
            raise TypeError(f"medium must be a str or None, got {type(medium).__name__}")
        if not isinstance(lora_namespaces, bool):
            raise TypeError(
                f"lora_namespaces must be a bool, got {type(lora_namespaces).__name__}"
            )
        if block_hash not in BLOCK_HASHES:
            raise ValueError(f"unknown block_hash {block_hash!r}; valid: "
                             f"{', '.join(BLOCK_HASHES)}")
        self.block_hash = block_hash
        self._chain = _chain if block_hash == "sha256" else _fast_chain
        self.page_size = int(page_size)
        self.lora_id = None if lora_id is None else int(lora_id)
        self.medium = medium
        self.lora_namespaces = lora_namespaces
        self._page_bytes = self.page_size * 8
        # node id -> hash of that node's last page. A split keeps the lower half's node (and
        # id) so its entry stays right; the new upper node is filled in lazily.
        self._last_hash: dict = {}
        self._events: list = []

    @staticmethod
    def check_extra_key(extra_key: Any) -> None:
        """Check that the block hash can encode ``extra_key`` as a namespace.

        Args:
            extra_key: The namespace to check.

        Raises:
            TypeError: naming the type, for anything but None, str, bytes or int.
        """
        encode_namespace(extra_key)

    # -- hooks -------------------------------------------------------------------------
    def stored(self, node: Any) -> None:
        """Record a ``BlockStored`` for a new leaf's full pages (none if it has no full page).

        With a host tier, also for a node that came back to the device (loaded back or
        adopted by an insert).

        Args:
            node: The new leaf, its value set.
        """
        self._stored(node, self.medium)

    def stored_host(self, node: Any) -> None:
        """Record a ``BlockStored`` with ``medium="CPU"``: a node's pages got a host copy.

        The block hashes are the same as on the device: a page's hash depends on its tokens
        and prefix only, not on where it is held.

        Args:
            node: The node, its host value set.
        """
        self._stored(node, MEDIUM_CPU)

    def _stored(self, node: Any, medium: Optional[str]) -> None:
        extra_key = node.extra_key
        parent_hash = self._hash_through(node.parent)
        key = node.key
        data = _key_bytes(key)
        hashes = self._chain(parent_hash, encode_namespace(extra_key), data, self._page_bytes)
        if not hashes:
            return
        self._last_hash[node.id] = hashes[-1]
        namespace = _canonical(extra_key)
        lora_id, lora_name = self.lora_id, None
        if self.lora_namespaces:
            if isinstance(namespace, str):
                lora_name = namespace
            elif isinstance(namespace, int):
                lora_id = namespace
        entry = None if namespace is None else (namespace,)
        self._events.append(BlockStored(
            tuple(hashes), parent_hash,
            tuple(key.tolist()) if self._chain is _chain else TokenIds(data), self.page_size,
            lora_id, medium, lora_name, (entry,) * len(hashes),
        ))

    def removed(self, node: Any) -> None:
        """Record a ``BlockRemoved`` for a leaf about to be evicted (still in the tree).

        With a host tier: for a node about to leave the device (it may stay on the host).

        Args:
            node: The leaf.
        """
        self._removed(node, self.medium)

    def removed_host(self, node: Any) -> None:
        """Record a ``BlockRemoved`` with ``medium="CPU"``: a node leaves host memory.

        Args:
            node: The host-only leaf about to be evicted from the host (still in the tree).
        """
        self._removed(node, MEDIUM_CPU)

    def _removed(self, node: Any, medium: Optional[str]) -> None:
        try:
            namespace = encode_namespace(node.extra_key)
        except TypeError:
            # stored() refused this namespace, so its pages were never announced.
            self._last_hash.pop(node.id, None)
            return
        hashes = self._chain(self._hash_through(node.parent), namespace, _key_bytes(node.key),
                             self._page_bytes)
        self._last_hash.pop(node.id, None)
        if hashes:
            self._events.append(BlockRemoved(tuple(hashes), medium))

    def cleared(self) -> None:
        """Record an ``AllBlocksCleared`` (the cache was reset) and forget every hash."""
        self._last_hash.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list:
        """Take the events recorded since the last call; the queue starts empty again.

        Returns:
            The events, in order, a list.
        """
        events = self._events
        self._events = []
        return events

    def __len__(self) -> int:
        """``len(recorder)``: the events waiting to be taken.

        Returns:
            The number of events.
        """
        return len(self._events)

    @property
    def tracked_nodes(self) -> int:
        """How many nodes have their last-page hash cached (evicted ones never stay)."""
        return len(self._last_hash)

    # -- hashes of tree nodes ------------------------------------------------------------
    def node_block_hashes(self, node: Any) -> list:
        """Compute the hashes of ``node``'s full pages.

        Args:
            node: A node of the cache this recorder serves.

        Returns:
            The hashes, in order (none for the root).
        """
        if node.parent is None:
            return []
        return self._chain(self._hash_through(node.parent), encode_namespace(node.extra_key),
                           _key_bytes(node.key), self._page_bytes)

    def _hash_through(self, node: Any) -> Optional[int]:
        """Hash of the last page on the path root..node (None for the root), cached per node."""
        known = self._last_hash
        missing = []
        last = None
        # Walk up to the root or the nearest node whose hash is known; no recursion.
        while node.parent is not None:
            last = known.get(node.id)
            if last is not None:
                break
            missing.append(node)
            node = node.parent
        for node in reversed(missing):
            hashes = self._chain(last, encode_namespace(node.extra_key), _key_bytes(node.key),
                                 self._page_bytes)
            if hashes:
                last = hashes[-1]
                known[node.id] = last
        return last


def _key_bytes(key: Any) -> bytes:
    # Node keys are int64 arrays; the hash fixes little endian whatever the machine.
    return np.asarray(key, dtype="<i8").tobytes()


# -- wire format --------------------------------------------------------------------------

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wire_hash(value: Any, what: str) -> Union[int, bytes]:
    if not (_is_int(value) or isinstance(value, bytes)):
        raise ValueError(f"{what} must be an int or bytes, got {type(value).__name__}")
    return value


def _wire_hash_list(value: Any, what: str) -> tuple:
    if not isinstance(value, (list, tuple)) or not all(
            _is_int(v) or isinstance(v, bytes) for v in value):
        raise ValueError(f"{what} must be an array of ints or bytes")
    return tuple(value)


def _wire_int_list(value: Any, what: str) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise ValueError(f"{what} must be an array of ints")
    return tuple(value)


def _wire_int(value: Any, what: str) -> int:
    if not _is_int(value):
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

    See the module docstring for the fields each event requires.

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
    if rank is not None and not _is_int(rank):
        raise ValueError(f"malformed event batch {seq}: data_parallel_rank must be int or nil")
    decoded = []
    for index, item in enumerate(events):
        try:
            decoded.append(_decode_event(item))
        except ValueError as exc:
            raise ValueError(f"malformed event batch {seq}, event {index}: {exc}") from None
    return ReceivedBatch(seq, float(ts), decoded, rank, payload)


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
        ValueError: an unknown ``encoding``, or a namespace msgpack cannot carry (an int
            beyond 64 bits, a str with a lone surrogate).
        ImportError: msgspec is not installed.
    """
    _, msgspec = _transport("encode_batch")
    _check_encoding(encoding)
    batch = _check_events(events)
    if ts is None:
        ts = time.time()
    elif isinstance(ts, bool) or not isinstance(ts, numbers.Real):
        raise TypeError(f"ts must be a number, got {type(ts).__name__}")
    if data_parallel_rank is not None and not _is_int(data_parallel_rank):
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


# -- publisher ----------------------------------------------------------------------------

class ZmqEventPublisher:
    """Publishes event batches on a ZeroMQ PUB socket from a background thread.

    ``publish(events)`` never blocks on the network: it stamps the batch with the next
    sequence number and the time, and hands it to a queue of ``max_queue_size`` batches; when
    the queue is full the batch is dropped and counted (``dropped``), leaving a gap in the
    sequence numbers that subscribers see. ``encoding`` lays out the events: ``"map"`` (vLLM's
    tagged maps, the default) or ``"positional"`` (tagged arrays, for older consumers). A
    batch that cannot be encoded (a namespace msgpack cannot carry) is counted in ``errors``,
    kept in ``last_error`` and leaves a gap, like a failed send. The last ``buffer_steps`` sent
    batches are kept for the replay socket (``replay_endpoint``, a ROUTER). Both endpoints are
    bound; ``endpoint`` and ``replay_endpoint`` hold the resolved addresses
    (``tcp://127.0.0.1:*`` picks a port). Use it as a context manager, or call ``close()``.
    Needs pyzmq and msgspec (``pip install radixcache[events]``).

    Args:
        endpoint: The ZeroMQ address the PUB socket binds (default ``"tcp://*:5557"``).
        replay_endpoint: The address the replay ROUTER socket binds, or None for no replay.
        topic: The topic frame of every message (subscribers filter on its prefix).
        buffer_steps: How many sent batches the replay socket keeps, an int >= 0.
        max_queue_size: How many batches may wait for the sending thread, an int >= 1.
        data_parallel_rank: The rank sent in every batch, or None.
        hwm: The PUB socket's send high-water mark, an int >= 0.
        encoding: ``"map"`` or ``"positional"``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an unknown ``encoding``, or a count below its minimum.
        ImportError: pyzmq or msgspec is not installed.
        zmq.ZMQError: an endpoint cannot be bound.
    """

    _IDLE_WAIT_S = 0.1
    _REPLAY_POLL_S = 0.005
    _CLOSE_TIMEOUT_S = 10.0

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: Optional[str] = None,
                 topic: str = "", buffer_steps: int = 10_000, *,
                 max_queue_size: int = 100_000, data_parallel_rank: Optional[int] = 0,
                 hwm: int = 100_000, encoding: str = DEFAULT_ENCODING) -> None:
        zmq, msgspec = _transport("ZmqEventPublisher")
        self.encoding = _check_encoding(encoding)
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError(
                f"replay_endpoint must be a str or None, got {type(replay_endpoint).__name__}"
            )
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, value, low in (("buffer_steps", buffer_steps, 0),
                                 ("max_queue_size", max_queue_size, 1), ("hwm", hwm, 0)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if data_parallel_rank is not None and (
                isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int)):
            raise TypeError("data_parallel_rank must be an int or None")
        self._zmq = zmq
        self._msgspec = msgspec
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic_bytes = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = None
        self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for one full replay per client without silently dropping its tail.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets(linger=0)
            raise
        self._queue: queue.Queue = queue.Queue(max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._done = threading.Condition()
        self._next_seq = 0
        self._queued = 0
        self._handled = 0
        self.dropped = 0
        self.sent = 0
        self.errors = 0
        self.last_error: Optional[BaseException] = None
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixcache-kv-events",
                                        daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------
    def publish(self, events: Iterable[KVEvent]) -> Optional[int]:
        """Queue one batch for sending; never blocks on the network.

        Args:
            events: The batch's KV events, in order (``RadixCache.take_events()``).

        Returns:
            The batch's sequence number, or None if it was empty (nothing is sent) or
            dropped because the queue was full.

        Raises:
            TypeError: an item that is not a KV event.
            RuntimeError: the publisher is closed.
        """
        batch = _check_events(events)
        if not batch:
            return None
        with self._lock:
            if self._closing:
                raise RuntimeError("publish() on a closed ZmqEventPublisher")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, time.time(), batch))
            except queue.Full:
                self.dropped += 1
                return None
            self._queued += 1
        return seq

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued batch went out (or failed to encode, see ``errors``).

        Args:
            timeout: The most seconds to wait (None: as long as it takes).

        Returns:
            True if the queue drained, False if ``timeout`` seconds passed first.
        """
        with self._done:
            return self._done.wait_for(lambda: self._handled >= self._queued, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the sending thread and close the sockets.

        Calling it again does nothing.

        Args:
            timeout: The most seconds to wait for the queue to drain, and the sockets' linger.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self.flush(timeout)
        self._closed = True
        self._thread.join(self._CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # never close sockets another thread still uses
            return
        self._close_sockets(linger=int(timeout * 1000))

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
                f"{self.replay_endpoint!r}, encoding={self.encoding!r}, sent={self.sent}, "
                f"dropped={self.dropped})")

    # -- background thread ---------------------------------------------------------------
    def _run(self) -> None:
        encoder = self._msgspec.msgpack.Encoder()
        wait = self._REPLAY_POLL_S if self._replay is not None else self._IDLE_WAIT_S
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                seq, ts, batch = self._queue.get(timeout=wait)
            except queue.Empty:
                if self._closed:
                    return
                continue
            try:
                payload = _encode(encoder, _batch_wire(ts, batch, self.data_parallel_rank,
                                                       self.encoding))
                self._pub.send_multipart(
                    (self._topic_bytes, seq.to_bytes(8, "big", signed=True), payload),
                    copy=False,
                )
                self._buffer.append((seq, payload))
                self.sent += 1
            except Exception as exc:  # keep serving; the subscriber sees a gap
                self.errors += 1
                self.last_error = exc
            with self._done:
                self._handled += 1
                self._done.notify_all()

    def _serve_replays(self) -> None:
        zmq = self._zmq
        replay = self._replay
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.errors += 1
                continue
            identity = frames[0]
            start = int.from_bytes(frames[2], "big", signed=True)
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart(
                            (identity, b"", seq.to_bytes(8, "big", signed=True), payload),
                            flags=zmq.NOBLOCK)
                replay.send_multipart(
                    (identity, b"", _END_SEQ.to_bytes(8, "big", signed=True), b""),
                    flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.errors += 1
                self.last_error = exc


# -- subscriber ---------------------------------------------------------------------------

class ZmqEventSubscriber:
    """Receives event batches in sequence order, filling gaps from the replay socket.

    ``receive(timeout)`` returns the next :class:`ReceivedBatch` or None after ``timeout``
    seconds without one; iterating yields batches until one does not come within
    ``timeout`` (None: forever). With ``start_seq`` and ``replay_endpoint`` the subscriber
    first asks for every buffered batch from ``start_seq`` on, so one that joins late
    recovers the earlier batches. A batch that neither the stream nor the replay delivers
    (dropped by the publisher, or gone from its buffer) is skipped and listed in ``gaps`` as
    an inclusive ``(first_seq, last_seq)`` range (the latest ``MAX_GAPS``; ``gap_count`` and
    ``missed`` count every gap and batch). ``replayed`` counts batches that came through
    replay, ``malformed`` frames that were ignored; ``hwm`` is the SUB socket's receive
    high-water mark. A replay that ends without its end marker for ``replay_timeout`` seconds
    is abandoned (what it missed becomes a gap); ``receive(timeout)`` never waits past its
    own timeout for it, the replay goes on at the next call.

    A publisher that restarts on the same endpoints starts its sequence again at 0. A
    stream batch below what was already delivered is a stale duplicate only when replay
    delivered that very batch (the same payload) ahead of the stream; one publisher's PUB
    stream never goes back, so anything else is a reset. It is counted in ``resets``, the
    new publisher's batches are delivered from its first one on (replayed when the stream missed them), and the first of them is marked
    ``ReceivedBatch.restarted``, so ``KvIndexer.apply`` drops what the worker held before. A
    restart whose first batch the subscriber sees has a sequence number above every one the
    old publisher sent cannot be told from a gap: it is filled from the new publisher's
    replay and recorded as a gap if it cannot be.

    Payloads are decoded by ``decode_batch``, so either encoding is read; one it rejects
    makes ``receive`` raise its ValueError, and the next call goes on with the batch after
    it. Use it as a context manager, or call ``close()``. Needs pyzmq and msgspec
    (``pip install radixcache[events]``).

    Args:
        endpoint: The publisher's PUB address to connect to (its ``endpoint``).
        replay_endpoint: The publisher's replay address (its ``replay_endpoint``), or None
            for no gap filling.
        topic: Receive only messages whose topic starts with this.
        start_seq: The first sequence number wanted (with ``replay_endpoint``: replayed from
            the publisher's buffer first), or None to start with whatever comes.
        timeout: Seconds iteration waits for the next batch before it ends (None: forever).
        replay_timeout: Seconds a replay may go silent before it is abandoned.
        hwm: The SUB socket's receive high-water mark.

    Raises:
        TypeError: an endpoint or topic of the wrong type.
        ValueError: ``start_seq`` is not a non-negative int or None.
        ImportError: pyzmq or msgspec is not installed.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 topic: str = "", start_seq: Optional[int] = None,
                 timeout: Optional[float] = None, replay_timeout: float = 2.0,
                 hwm: int = 100_000) -> None:
        zmq, _ = _transport("ZmqEventSubscriber")
        if not isinstance(endpoint, str):
            raise TypeError(f"endpoint must be a str, got {type(endpoint).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError("replay_endpoint must be a str or None")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if start_seq is not None and (isinstance(start_seq, bool)
                                      or not isinstance(start_seq, int) or start_seq < 0):
            raise ValueError(f"start_seq must be a non-negative int or None, got {start_seq!r}")
        self._zmq = zmq
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.timeout = timeout
        self.replay_timeout = replay_timeout
        self._ctx = zmq.Context()
        self._sub = None
        self._replay = None
        try:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._new_replay_socket()
        except Exception:
            self.close()
            raise
        self._expected = start_seq
        self._initial_replay = start_seq is not None and self._replay is not None
        self._pending: collections.deque = collections.deque()
        # A replay in flight: when it gives up, and the stream frames that wait for it.
        self._replay_deadline: Optional[float] = None
        self._backlog: collections.deque = collections.deque()
        self._stream_last: Optional[int] = None  # the last sequence number the stream sent
        # seq -> hash of the payload, for batches replay delivered that the stream has not
        # passed yet: how a stale duplicate is told from a restarted publisher's batch
        self._replayed: dict = {}
        self._restart_next = False
        self._gaps: collections.deque = collections.deque(maxlen=self.MAX_GAPS)
        self.gap_count = 0
        self.missed = 0
        self.replayed = 0
        self.malformed = 0
        self.resets = 0

    #: How many gap ranges ``gaps`` keeps (the latest); ``gap_count`` and ``missed`` count all.
    MAX_GAPS = 1000
    #: How many replayed batches are remembered (a hash each) to recognise their stream copy.
    MAX_REPLAYED = 100_000

    @property
    def gaps(self) -> list:
        """The latest ``MAX_GAPS`` gaps, as inclusive ``(first_seq, last_seq)`` ranges."""
        return list(self._gaps)

    def _new_replay_socket(self):
        # DEALER, not REQ: one request is answered by many messages.
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        return sock

    @property
    def next_seq(self) -> Optional[int]:
        """The sequence number expected next (None before the first batch)."""
        return self._expected

    def receive(self, timeout: Optional[float] = None) -> Optional[ReceivedBatch]:
        """Receive the next batch in sequence order, filling gaps from the replay socket.

        Returns within ``timeout`` in every state: every wait polls with the time left; a
        replay in flight carries on at the next call.

        Args:
            timeout: The most seconds to wait (None: as long as it takes).

        Returns:
            A ``ReceivedBatch``, or None when none arrived within ``timeout`` seconds.

        Raises:
            ValueError: the batch's payload is malformed (the next call goes on with the
                batch after it).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._initial_replay:
            self._initial_replay = False
            self._start_replay(self._expected)
        while not self._pending:
            if self._replay_deadline is not None:
                if not self._step_replay(deadline):
                    return None
                continue
            if not self._sub.poll(self._wait_ms(deadline)):
                return None
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.malformed += 1
                continue
            self._on_stream(int.from_bytes(frames[1], "big", signed=True), frames[2])
        seq, payload, restarted = self._pending.popleft()
        batch = decode_batch(payload, seq)
        if restarted:
            batch = dataclasses.replace(batch, restarted=True)
        return batch

    @staticmethod
    def _wait_ms(deadline: Optional[float], limit: Optional[float] = None) -> int:
        """Milliseconds to poll: until the earlier of ``deadline`` and ``limit`` (-1: forever),
        rounded up so a poll never returns before its deadline."""
        ends = [t for t in (deadline, limit) if t is not None]
        if not ends:
            return -1
        return max(0, math.ceil((min(ends) - time.monotonic()) * 1000))

    def _on_stream(self, seq: int, payload: bytes) -> None:
        """A batch from the PUB stream, which one publisher sends in increasing order."""
        digests = self._replayed
        if self._expected is not None and seq < self._expected:
            # Below what was delivered: a stale duplicate is a batch that replay delivered
            # ahead of the stream, byte for byte; anything else is a new publisher on the
            # same endpoints (it starts again at 0). The stream itself never goes back.
            stale = ((self._stream_last is None or seq > self._stream_last)
                     and digests.get(seq) == hash(payload))
            if not stale:
                self.resets += 1
                digests.clear()
                self._expected = 0
                self._restart_next = True
        self._stream_last = seq
        while digests and next(iter(digests)) <= seq:  # the stream is past them
            del digests[next(iter(digests))]
        if (self._expected is not None and seq > self._expected
                and self._replay is not None):
            self._backlog.append((seq, payload))
            self._start_replay(self._expected)
            return
        self._accept(seq, payload)

    def _accept(self, seq: int, payload: bytes) -> bool:
        """Queue batch ``seq`` unless already delivered; record any gap it reveals."""
        if self._expected is None:
            self._expected = seq
        if seq < self._expected:
            return False  # already delivered (replay and stream overlap)
        if seq > self._expected:
            self._gaps.append((self._expected, seq - 1))
            self.gap_count += 1
            self.missed += seq - self._expected
        self._pending.append((seq, payload, self._restart_next))
        self._restart_next = False
        self._expected = seq + 1
        return True

    def _start_replay(self, start: int) -> None:
        """Ask for every buffered batch from ``start`` on; ``_step_replay`` takes the answer."""
        self._replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        self._replay_deadline = time.monotonic() + self.replay_timeout

    def _step_replay(self, deadline: Optional[float]) -> bool:
        """Take one replay message, or end the replay; False when ``deadline`` came first."""
        if not self._replay.poll(self._wait_ms(deadline, self._replay_deadline)):
            if time.monotonic() < self._replay_deadline:
                return False  # the caller's deadline; the replay carries on next call
            # No end marker: drop the socket so late replies cannot confuse the next ask.
            self._replay.close(linger=0)
            self._replay = self._new_replay_socket()
            self._end_replay()
            return True
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            self.malformed += 1
            return True
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == _END_SEQ:
            self._end_replay()
        elif self._accept(seq, frames[2]):
            self.replayed += 1
            if len(self._replayed) < self.MAX_REPLAYED:
                self._replayed[seq] = hash(frames[2])
        return True

    def _end_replay(self) -> None:
        # The stream frames that waited go on in order; a gap left now is a real gap.
        self._replay_deadline = None
        backlog = self._backlog
        while backlog:
            self._accept(*backlog.popleft())

    def __iter__(self) -> Iterator[ReceivedBatch]:
        """Yield batches in order until none comes within ``timeout`` seconds."""
        while True:
            batch = self.receive(self.timeout)
            if batch is None:
                return
            yield batch

    def close(self) -> None:
        """Close the sockets (pending messages are dropped)."""
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


"""Block hashes: the namespace encoding, the ``sha256`` and ``fast64`` chains, token bytes.

See "Block hash" in ``radixcache.events``. Imports only ``types`` of the package; the block
module (whose ``page_hash_chain`` computes the ``fast64`` chain) is imported when first needed,
by ``_page_hash_core``, the one place the events package reaches it.
"""

from __future__ import annotations

import collections.abc
import functools
import numbers
from hashlib import sha256
from types import ModuleType
from typing import Any, Iterator, Optional, Union

import numpy as np

from .._validate import INT64_MAX, check_int, check_optional_int, in_int64
from .types import BlockStored


def encode_namespace(extra_key: Any) -> bytes:
    """Encode ``extra_key`` as the namespace field N of the block hash.

    See "Block hash" in ``radixcache.events`` for the layout.

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
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.max() > INT64_MAX:
        raise OverflowError("token ids do not fit in int64")
    return arr.astype("<i8", copy=False).tobytes()


def _check_parent(parent_block_hash: Any) -> Optional[int]:
    if parent_block_hash is None:
        return None
    value = check_optional_int(parent_block_hash, "parent_block_hash")
    if not in_int64(value):
        raise OverflowError(f"parent_block_hash {value} does not fit in int64")
    return value


def block_hash(parent_block_hash: Optional[int], token_ids: Any, extra_key: Any = None) -> int:
    """Compute the hash of one page (see "Block hash" in ``radixcache.events``).

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
    page_size = check_int(page_size, "page_size", 1)
    parent = _check_parent(parent_block_hash)
    namespace = encode_namespace(extra_key)
    data = tokens_le_bytes(token_ids)
    return _chain(parent, namespace, data, page_size * 8)


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
def fast64_root(namespace: bytes) -> int:
    """Give the seed of the ``fast64`` chain for a sequence's first page in a namespace.

    Args:
        namespace: The namespace as ``encode_namespace`` encodes it.

    Returns:
        The first 8 bytes of SHA-256(b"radixcache-fast64" + namespace), a signed 64-bit int
        (big endian): what a first page's key chains from, and ``KvIndexer``'s root key.
    """
    return int.from_bytes(sha256(b"radixcache-fast64" + namespace).digest()[:8], "big",
                          signed=True)


def _page_hash_core(pure: bool = False) -> ModuleType:
    """The module whose ``page_hash_chain``/``page_hash_bytes`` compute the ``fast64`` chain
    and whose ``recv_stream`` reads a subscriber's stream: the block module (compiled when
    built; the pure one with ``pure``), imported here on first use, so importing
    ``radixcache.events`` alone never loads it."""
    from .._core import blocks, get_blocks

    return get_blocks("python") if pure else blocks


def _fast_chain(parent_hash: Optional[int], namespace: bytes, data: bytes,
                page_bytes: int) -> list:
    seed = fast64_root(namespace) if parent_hash is None else parent_hash
    return _page_hash_core().page_hash_chain(seed, data, page_bytes)


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




TokenIds.__module__ = "radixcache.events"  # pickles name the public module (see types)

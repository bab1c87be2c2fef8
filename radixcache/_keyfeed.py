"""Block keys fed straight from in-process caches to a ``KvIndexer``, without event objects.

``simulate_fleet``'s workers and its router live in one process: the router's indexer keys
blocks by the ``fast64`` chain, and a worker can compute those keys itself. ``KeyRecorder``
replaces a worker cache's event recorder (``attach``) and records, instead of
``BlockStored``/``BlockRemoved`` objects, one ``(STORED, keys, parent)`` or
``(REMOVED, keys)`` tuple per leaf, ``keys`` being the pages' keys as native int64 bytes
(``page_hash_bytes``): no int per page is made, and the indexer takes them in one call each
(``KvIndexer._apply_own``), counting exactly what ``apply`` counts for the equivalent events.
A removed leaf's keys are the ones computed when it was stored (a split keeps the lower
half's node, whose pages are the tail of them), so an eviction hashes nothing.
``AllBlocksCleared`` is recorded as it is.
"""

from __future__ import annotations

import sys
from typing import Any

from ._core import blocks
from .events import EventRecorder, _fast_root, _key_bytes, encode_namespace

STORED, REMOVED = 0, 1

# Node keys are native int64 arrays; the chain reads them little-endian (as fast64 does).
_LITTLE_ENDIAN = sys.byteorder == "little"


class KeyRecorder(EventRecorder):
    """An ``EventRecorder`` (``block_hash="fast64"``) that records block keys; see the module.

    Args:
        page_size: Tokens per page (the cache's), an int >= 1.
    """

    __slots__ = ("_node_keys", "_hash_bytes")

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size, block_hash="fast64")
        self._node_keys: dict = {}  # node id -> its pages' keys (int64 bytes) when stored
        self._hash_bytes = blocks.page_hash_bytes

    def stored(self, node: Any) -> None:
        """Record a new leaf's full pages (nothing if it has none).

        Args:
            node: The new leaf, its value set.
        """
        parent_hash = self._hash_through(node.parent)
        seed = _fast_root(encode_namespace(node.extra_key)) if parent_hash is None \
            else parent_hash
        key = node.key
        keys = self._hash_bytes(seed, key if _LITTLE_ENDIAN else _key_bytes(key),
                                self._page_bytes)
        if not keys:
            return
        self._last_hash[node.id] = int.from_bytes(keys[-8:], "little", signed=True)
        self._node_keys[node.id] = keys
        self._events.append((STORED, keys, parent_hash))

    def removed(self, node: Any) -> None:
        """Record a leaf about to be evicted (still in the tree).

        Args:
            node: The leaf.
        """
        keys = self._node_keys.pop(node.id, None)
        self._last_hash.pop(node.id, None)
        size = len(node.key) // self.page_size * 8
        if keys is None or len(keys) < size:
            # Not stored as a leaf (the upper half of a split): hash it now.
            try:
                namespace = encode_namespace(node.extra_key)
            except TypeError:
                return  # stored() refused this namespace: never announced
            parent_hash = self._hash_through(node.parent)
            seed = _fast_root(namespace) if parent_hash is None else parent_hash
            keys = self._hash_bytes(seed, _key_bytes(node.key), self._page_bytes)
        elif len(keys) > size:
            keys = keys[len(keys) - size:]  # a split took the leading pages
        if keys:
            self._events.append((REMOVED, keys))

    def cleared(self) -> None:
        """Record an ``AllBlocksCleared`` and forget every key."""
        self._node_keys.clear()
        super().cleared()


def attach(cache: Any) -> None:
    """Make ``cache`` (a ``RadixCache`` created with ``enable_events=True`` and no event yet
    recorded) record block keys with a ``KeyRecorder``."""
    cache._events = KeyRecorder(cache.page_size)

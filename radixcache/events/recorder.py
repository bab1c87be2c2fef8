"""The recorders a cache owns when its events are on: ``EventRecorder`` (KV event objects)
and ``KeyRecorder`` (block-key records for ``KvIndexer.apply_keys``), and ``new_recorder``,
which picks one from the cache's ``event_options``.

Block-key records (``event_options={"record": "keys"}``)
---------------------------------------------------------
A router in the same process as its workers (``simulate_fleet``) keys blocks by the
``fast64`` chain, which a worker can compute itself. ``KeyRecorder`` records, instead of
``BlockStored``/``BlockRemoved`` objects, one tuple per leaf:

- ``(KEYS_STORED, keys, parent_key)``: a new leaf's full pages; ``parent_key`` is the key of
  the page before the first one (None at the root);
- ``(KEYS_REMOVED, keys)``: an evicted leaf's pages;

``keys`` being the pages' ``fast64`` keys as native-endian int64 bytes (``page_hash_bytes``):
no int per page is made, and ``KvIndexer.apply_keys`` takes each record in one call, counting
exactly what ``KvIndexer.apply`` counts for the equivalent ``fast64`` events. A removed
leaf's keys are the ones computed when it was stored (a split keeps the lower half's node,
whose pages are the tail of them), and it leaves the leading ones to its parent, the upper
half of that split, which is evicted after it: an eviction hashes nothing. ``AllBlocksCleared``
is recorded as it is. The records know one tier (the device's) and no LoRA fields.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from .._validate import check_int, check_optional_int
from .hashing import (
    BLOCK_HASHES,
    TokenIds,
    _canonical,
    _chain,
    _fast_chain,
    _page_hash_core,
    encode_namespace,
    fast64_root,
)
from .types import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


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
            adapter: ``KvIndexer`` puts the blocks of a namespace-less sequence in namespace
            ``lora_id``), or None.
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
        page_size = check_int(page_size, "page_size", 1)
        lora_id = check_optional_int(lora_id, "lora_id")
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
        self.page_size = page_size
        self.lora_id = lora_id
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


# -- block-key records --------------------------------------------------------------------

#: The tag of a block-key record (see the module docstring): ``(KEYS_STORED, keys, parent_key)``
#: and ``(KEYS_REMOVED, keys)``.
KEYS_STORED, KEYS_REMOVED = 0, 1

# Node keys are native int64 arrays; the chain reads them little-endian (as fast64 does).
_LITTLE_ENDIAN = sys.byteorder == "little"


class KeyRecorder(EventRecorder):
    """An ``EventRecorder`` (``block_hash="fast64"``) that records block keys; see the module.

    A cache owns one with ``event_options={"record": "keys"}`` (see ``new_recorder``).

    Args:
        page_size: Tokens per page (the cache's), an int >= 1.

    Raises:
        TypeError: ``page_size`` is not an int.
        ValueError: ``page_size`` < 1.
    """

    __slots__ = ("_node_keys", "_hash_bytes")

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size, block_hash="fast64")
        # node id -> the keys (int64 bytes) of pages that end where the node ends, at least
        # its own: recorded when it was stored as a leaf (a split keeps the lower half's
        # node, so they may start above it), or left to it by a child that was evicted
        self._node_keys: dict = {}
        self._hash_bytes = _page_hash_core().page_hash_bytes

    def stored(self, node: Any) -> None:
        """Record a new leaf's full pages (nothing if it has none).

        Args:
            node: The new leaf, its value set.
        """
        parent_hash = self._hash_through(node.parent)
        seed = fast64_root(encode_namespace(node.extra_key)) if parent_hash is None \
            else parent_hash
        key = node.key
        keys = self._hash_bytes(seed, key if _LITTLE_ENDIAN else _key_bytes(key),
                                self._page_bytes)
        if not keys:
            return
        self._last_hash[node.id] = int.from_bytes(keys[-8:], "little", signed=True)
        self._node_keys[node.id] = keys
        self._events.append((KEYS_STORED, keys, parent_hash))

    def removed(self, node: Any) -> None:
        """Record a leaf about to be evicted (still in the tree).

        Args:
            node: The leaf.
        """
        node_keys = self._node_keys
        keys = node_keys.pop(node.id, None)
        self._last_hash.pop(node.id, None)
        size = node.num_tokens // self.page_size * 8
        if keys is None or len(keys) < size:
            # Not stored as a leaf (the upper half of a split): hash it now.
            try:
                namespace = encode_namespace(node.extra_key)
            except TypeError:
                return  # stored() refused this namespace: never announced
            parent_hash = self._hash_through(node.parent)
            seed = fast64_root(namespace) if parent_hash is None else parent_hash
            keys = self._hash_bytes(seed, _key_bytes(node.key), self._page_bytes)
        elif len(keys) > size:
            # A split took the leading pages: they end where the parent (an upper half)
            # ends, so they are its keys when it is evicted in turn, not hashed again.
            parent = node.parent
            if parent.parent is not None and parent.id not in node_keys:
                node_keys[parent.id] = keys[:len(keys) - size]
            keys = keys[len(keys) - size:]
        if keys:
            self._events.append((KEYS_REMOVED, keys))

    def cleared(self) -> None:
        """Record an ``AllBlocksCleared`` and forget every key."""
        self._node_keys.clear()
        super().cleared()

    def _hash_through(self, node: Any) -> Optional[int]:
        """``EventRecorder._hash_through``; the hash of an upper half of a split is read from
        the keys recorded for its lower half when they reach it, instead of hashed again."""
        if node.parent is not None and node.id not in self._last_hash:
            keys = self._node_keys.get(node.id)  # left to it by an evicted child
            last = int.from_bytes(keys[-8:], "little", signed=True) if keys \
                else self._upper_hash(node)
            if last is not None:
                self._last_hash[node.id] = last
                return last
        return super()._hash_through(node)

    def _upper_hash(self, node: Any) -> Optional[int]:
        """The hash of ``node``'s last page when a node below it holds keys recorded before
        splits took their leading pages (down to ``node``'s end or further): the key that
        many pages before that node's own. None when none of the few nodes looked at (its
        children, theirs, ...: _UPPER_SEARCH at most) does."""
        node_keys = self._node_keys
        page_size = self.page_size
        below = [(child, 0) for child in node.children]  # (node, pages between), growing
        i = 0
        while i < len(below) and i < _UPPER_SEARCH:
            child, between = below[i]
            i += 1
            pages = child.num_tokens // page_size
            keys = node_keys.get(child.id)
            if keys is not None:
                end = len(keys) - (pages + between) * 8
                if end >= 8:
                    return int.from_bytes(keys[end - 8:end], "little", signed=True)
            elif len(below) < _UPPER_SEARCH:
                below.extend((grandchild, between + pages) for grandchild in child.children)
        return None


# How many nodes below a split's upper half ``KeyRecorder`` looks at for recorded keys that
# reach it, before it hashes its pages instead.
_UPPER_SEARCH = 16


#: The names of ``RadixCache``'s ``event_options``.
EVENT_OPTIONS = frozenset({"lora_id", "medium", "lora_namespaces", "block_hash", "record"})
#: ``event_options["record"]``: ``"events"`` (the default) records KV event objects,
#: ``"keys"`` block-key records for ``KvIndexer.apply_keys`` (see the module docstring).
RECORDS = ("events", "keys")


def new_recorder(page_size: int, event_options: Optional[dict] = None, *,
                 host_tier: bool = False) -> EventRecorder:
    """The recorder of a ``RadixCache(enable_events=True, event_options=...)``.

    Args:
        page_size: The cache's page size, an int >= 1.
        event_options: The cache's ``event_options`` (None: none): ``"medium"``,
            ``"lora_id"``, ``"lora_namespaces"`` and ``"block_hash"`` go to ``EventRecorder``;
            ``"record"`` is one of ``RECORDS``, ``"keys"`` taking no other option.
        host_tier: Whether the cache has a host tier (block-key records know no tier).

    Returns:
        An ``EventRecorder``, or a ``KeyRecorder`` for ``record="keys"``.

    Raises:
        TypeError: an unknown option, or an option of the wrong type.
        ValueError: an unknown ``record`` or ``block_hash``; ``record="keys"`` with another
            option or with a host tier.
    """
    options = dict(event_options or {})
    unknown = sorted(set(options) - EVENT_OPTIONS)
    if unknown:
        raise TypeError(f"unknown event option {unknown[0]!r}; valid: "
                        + ", ".join(sorted(EVENT_OPTIONS)))
    record = options.pop("record", "events")
    if not isinstance(record, str):
        raise TypeError(f"event option record must be a str, got {type(record).__name__}")
    if record not in RECORDS:
        raise ValueError(f"unknown record {record!r}; valid: {', '.join(RECORDS)}")
    if record == "events":
        return EventRecorder(page_size, **options)
    if options:
        raise ValueError(f"event option record='keys' takes no other option, got "
                         f"{sorted(options)[0]!r}: its records are the device tier's fast64 "
                         f"block keys, without medium or LoRA fields")
    if host_tier:
        raise ValueError("event option record='keys' needs a cache without a host tier: "
                         "block-key records name no tier")
    return KeyRecorder(page_size)

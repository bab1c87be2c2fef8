"""Pure-Python radix tree core: the reference, the fallback and the benchmark baseline.

The compiled core (``_core_c.pyx``) implements exactly this interface; ``cache.py`` talks to
whichever one ``_core.py`` chose and never walks the tree itself.

Interface shared by both cores
------------------------------
``Node`` -- one tree node. Public, read-only properties: ``key`` (read-only 1-D int64 numpy
array of the node's tokens), ``num_tokens``, ``stored_value`` (the index tensor given at
insert, or None when the key doubles as the indices or the node was evicted), ``parent``,
``children`` (tuple of nodes), ``num_children``, ``lock_ref``, ``last_access_time``,
``created_time``, ``priority``, ``hit_count``, ``extra_key``, ``id``, ``evicted``,
``terminal``, and ``value`` (the index tensor, materialised from the key when none was
stored, None once evicted).

``Tree(page_size)`` -- attributes ``root``, ``page_size``, ``clock`` (logical time, +1 per
touching call), ``node_count`` (nodes excluding the root), ``num_splits`` (writable counter).

- ``match(tokens, extra_key) -> (path, length)``: ``path`` lists the matched nodes below the
  root (the last one split so the match ends on its boundary); ``length`` is page aligned.
  Length 0 touches nothing; otherwise one clock tick stamps the root and every path node.
- ``insert(tokens, extra_key, priority) -> (prefix_len, last_node, new_leaf)``: walks, splits
  where the key diverges inside a node, adds the uncached remainder as one new leaf (``None``
  if nothing was new), stamps the path, raises priorities to ``priority``, counts one hit per
  path node (a new leaf starts at 1), marks ``last_node`` terminal when the whole sequence was
  page aligned.
- ``exists(tokens, extra_key) -> bool``: read-only exact-sequence test (terminal mark).
- ``walk(tokens, extra_key) -> int``: read-only longest cached page-aligned prefix length (no
  split, no stamps): the bare tree walk that the benchmarks time against the whole call.
- ``set_value(node, values)``: stores a fresh leaf's indices: a CPU int64 numpy array is
  copied into the core's own buffer, a device tensor is kept as given.
- ``gather(path) -> torch.Tensor``: the path's indices concatenated into a new int64 tensor.
- ``lock(node, delta) -> int``: ``delta`` is +1 or -1; walks node -> root (root excluded),
  returns how many tokens crossed between unlocked and locked. Raises ``TypeError`` for a
  non-node, ``ValueError`` for an evicted node, a node of another tree, or an unlock below 0,
  changing nothing.
- ``remove_leaf(node) -> parent``: detaches an unlocked leaf, marks it evicted, clears its
  stored value.
- ``reset()``: drops every node (marking each evicted) without recursion.
- ``iter_nodes() -> iterator of (node, depth)``: pre-order, root first at depth 0, siblings in
  ``display_order`` (so both cores list a tree identically).

``tokens`` is a list or tuple of ints, or any object exposing a C-contiguous int64 buffer
(``numpy.int64`` arrays, ``array('q')``); the core converts it once per call. Bad tokens
raise ``TypeError``/``OverflowError`` before anything changes.

``EvictionHeap(policy)`` -- the lazy eviction heap (policy names as in ``EVICTION_POLICIES``):
``push(node)``, ``pop_victim() -> node | None``, ``len()``, ``clear()``, ``key_of(node)`` and
``entries()`` (list of (stored key, node)); see the class docstring.
"""

from __future__ import annotations

import heapq
import struct
from typing import Any, Iterator

import numpy as np
import torch

from ._shared import cat_values, display_order, indices_from_key

__all__ = ["Node", "Tree", "EvictionHeap", "CORE_NAME"]

CORE_NAME = "python"

_TOKEN_BYTES = 8
_next_id = 0


def _new_id() -> int:
    global _next_id
    _next_id += 1
    return _next_id


def _as_bytes(tokens: Any) -> bytes:
    """The caller's tokens as one native int64 byte string (one conversion per call)."""
    if isinstance(tokens, (list, tuple)):
        try:
            return struct.pack(f"{len(tokens)}q", *tokens)
        except struct.error as exc:
            # struct reports both wrong types and out-of-range values as struct.error.
            for tok in tokens:
                if not isinstance(tok, int) and not hasattr(tok, "__index__"):
                    raise TypeError(
                        f"token ids must be integers, got {type(tok).__name__}"
                    ) from None
                if not -(2**63) <= tok.__index__() < 2**63:
                    raise OverflowError(
                        f"token id {tok} does not fit in int64"
                    ) from None
            raise TypeError(f"bad token ids: {exc}") from None
    view = memoryview(tokens)
    if view.format not in ("q", "l", "<q", "=q") or view.itemsize != 8 or view.ndim != 1:
        raise TypeError("token buffer must be 1-D int64")
    return view.tobytes()


def _first_mismatch(a: bytes, b: bytes) -> int:
    """Index of the first differing token of two equal-length byte strings (len if none)."""
    diff = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    if diff == 0:
        return len(a) // _TOKEN_BYTES
    # The lowest set bit sits in the first differing byte, so in the first differing token.
    return ((diff & -diff).bit_length() - 1) // (8 * _TOKEN_BYTES)


class Node:
    """A radix tree node of the pure-Python core."""

    __slots__ = (
        "_key", "_value", "_parent", "_children", "_lock_ref", "_last_access_time",
        "_created_time", "_priority", "_hit_count", "_extra_key", "_id", "_evicted",
        "_terminal", "__weakref__",
    )

    def __init__(self, key: bytes, parent: "Node | None", extra_key: Any, now: int,
                 priority: int = 0) -> None:
        self._key = key
        self._value = None
        self._parent = parent
        self._children: dict = {}
        self._lock_ref = 0
        self._last_access_time = now
        self._created_time = now
        self._priority = priority
        self._hit_count = 0
        self._extra_key = extra_key
        self._id = _new_id()
        self._evicted = False
        self._terminal = False

    # -- read-only public view -------------------------------------------------------
    @property
    def key(self) -> np.ndarray:
        return np.frombuffer(self._key, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self._key) // _TOKEN_BYTES

    @property
    def stored_value(self):
        if self._value is None:
            return None
        return self.value

    @property
    def value(self):
        if self._evicted:
            return None
        value = self._value
        if value is None:
            return indices_from_key(self.key)
        if type(value) is bytes:
            return indices_from_key(np.frombuffer(value, dtype=np.int64))
        return value

    @property
    def parent(self) -> "Node | None":
        return self._parent

    @property
    def children(self) -> tuple:
        return tuple(self._children.values())

    @property
    def num_children(self) -> int:
        return len(self._children)

    @property
    def lock_ref(self) -> int:
        return self._lock_ref

    @property
    def last_access_time(self) -> int:
        return self._last_access_time

    @property
    def created_time(self) -> int:
        return self._created_time

    @property
    def priority(self) -> int:
        return self._priority

    @property
    def hit_count(self) -> int:
        return self._hit_count

    @property
    def extra_key(self) -> Any:
        return self._extra_key

    @property
    def id(self) -> int:
        return self._id

    @property
    def evicted(self) -> bool:
        return self._evicted

    @property
    def terminal(self) -> bool:
        return self._terminal

    def __repr__(self) -> str:
        return (f"<RadixTreeNode id={self._id} len={self.num_tokens} "
                f"lock_ref={self._lock_ref}{' evicted' if self._evicted else ''}>")


class Tree:
    """The pure-Python radix tree: walks, splits, locks; no tensors, no heap."""

    __slots__ = ("page_size", "root", "clock", "node_count", "num_splits", "_page_bytes",
                 "_empty_inserted")

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._page_bytes = page_size * _TOKEN_BYTES
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0
        self.root = Node(b"", None, None, 0)
        # Namespaces in which the empty sequence was inserted (it has no node to mark).
        self._empty_inserted: set = set()

    # -- helpers ---------------------------------------------------------------------
    def _child_key(self, parent: Node, extra_key: Any, first_page: bytes):
        # Namespaces only need separating at the root: a subtree never mixes extra_keys.
        if parent is self.root and extra_key is not None:
            return (extra_key, first_page)
        return first_page

    def _aligned_end(self, buf: bytes) -> int:
        end = len(buf)
        return end - end % self._page_bytes

    def _common_bytes(self, key: bytes, buf: bytes, pos: int, end: int) -> int:
        """Page-aligned byte length of the common prefix of key and buf[pos:end]."""
        span = min(len(key), end - pos)
        if key[:span] == buf[pos:pos + span]:
            same = span
        else:
            same = _first_mismatch(key[:span], buf[pos:pos + span]) * _TOKEN_BYTES
        return same - same % self._page_bytes

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` ``at`` bytes in: a new upper node takes over its place."""
        parent = node._parent
        upper = Node(node._key[:at], parent, node._extra_key, node._last_access_time,
                     node._priority)
        upper._lock_ref = node._lock_ref
        upper._hit_count = node._hit_count
        upper._created_time = node._created_time
        value = node._value
        if value is not None:
            cut = at if type(value) is bytes else at // _TOKEN_BYTES
            upper._value = value[:cut]
            node._value = value[cut:]
        ckey = self._child_key(parent, node._extra_key, node._key[: self._page_bytes])
        node._key = node._key[at:]
        parent._children[ckey] = upper
        upper._children[node._key[: self._page_bytes]] = node
        node._parent = upper
        self.node_count += 1
        self.num_splits += 1
        return upper

    # -- walks -----------------------------------------------------------------------
    def _find_child(self, node: Node, buf: bytes, pos: int, extra_key: Any) -> Node | None:
        first = buf[pos:pos + self._page_bytes]
        if node is self.root and extra_key is not None:
            return node._children.get((extra_key, first))
        return node._children.get(first)

    def _descend(self, node: Node, buf: bytes, pos: int, end: int, extra_key: Any):
        """(child, matched bytes): the child of ``node`` that buf[pos:end] enters, split so the
        match ends on its boundary; (None, 0) if no child starts with that page.

        After a split the walk's next lookup finds nothing (the lower half starts with the
        page that differed), so callers simply keep descending."""
        child = self._find_child(node, buf, pos, extra_key)
        if child is None:
            return None, 0
        key = child._key
        klen = len(key)
        if klen <= end - pos and buf[pos:pos + klen] == key:
            return child, klen
        common = self._common_bytes(key, buf, pos, end)
        return self._split(child, common), common

    def match(self, tokens: Any, extra_key: Any = None) -> tuple[list, int]:
        buf = _as_bytes(tokens)
        end = self._aligned_end(buf)
        if end == 0:
            return [], 0
        self.clock += 1
        now = self.clock
        node = self.root
        node._last_access_time = now
        path = []
        pos = 0
        while pos < end:
            child, common = self._descend(node, buf, pos, end, extra_key)
            if child is None:
                break
            child._last_access_time = now
            path.append(child)
            pos += common
            node = child
        return path, pos // _TOKEN_BYTES

    def insert(self, tokens: Any, extra_key: Any = None, priority: int = 0):
        buf = _as_bytes(tokens)
        end = self._aligned_end(buf)
        whole = end == len(buf)
        node = self.root
        if end == 0:
            if whole:
                self._empty_inserted.add(extra_key)
            return 0, node, None
        self.clock += 1
        now = self.clock
        node._last_access_time = now
        pos = 0
        while pos < end:
            child, common = self._descend(node, buf, pos, end, extra_key)
            if child is None:
                break
            child._last_access_time = now
            child._hit_count += 1
            if priority > child._priority:
                child._priority = priority
            pos += common
            node = child
        prefix_len = pos // _TOKEN_BYTES
        new_leaf = None
        if pos < end:
            new_leaf = Node(buf[pos:end], node, extra_key, now, priority)
            new_leaf._hit_count = 1
            first = buf[pos:pos + self._page_bytes]
            node._children[self._child_key(node, extra_key, first)] = new_leaf
            self.node_count += 1
            node = new_leaf
        if whole:
            node._terminal = True
        return prefix_len, node, new_leaf

    def exists(self, tokens: Any, extra_key: Any = None) -> bool:
        buf = _as_bytes(tokens)
        end = len(buf)
        if end % self._page_bytes:
            return False
        if end == 0:
            return extra_key in self._empty_inserted
        node = self.root
        pos = 0
        while pos < end:
            child = self._find_child(node, buf, pos, extra_key)
            if child is None:
                return False
            key = child._key
            klen = len(key)
            if klen > end - pos or buf[pos:pos + klen] != key:
                return False
            pos += klen
            node = child
        return node._terminal

    def walk(self, tokens: Any, extra_key: Any = None) -> int:
        """Read-only: the longest cached page-aligned prefix length (no split, no stamps)."""
        buf = _as_bytes(tokens)
        end = self._aligned_end(buf)
        node = self.root
        pos = 0
        while pos < end:
            child = self._find_child(node, buf, pos, extra_key)
            if child is None:
                break
            key = child._key
            klen = len(key)
            if klen <= end - pos and buf[pos:pos + klen] == key:
                pos += klen
                node = child
                continue
            pos += self._common_bytes(key, buf, pos, end)
            break
        return pos // _TOKEN_BYTES

    # -- node bookkeeping ------------------------------------------------------------
    def _check_member(self, node: Any) -> None:
        if not isinstance(node, Node):
            from ._core import RadixTreeNode  # noqa: PLC0415 -- avoid an import cycle

            if isinstance(node, RadixTreeNode):
                raise ValueError("node belongs to another cache (a different tree core)")
            raise TypeError(f"expected a RadixTreeNode, got {type(node).__name__}")
        if node._evicted:
            raise ValueError(f"node {node._id} was evicted")
        top = node
        while top._parent is not None:
            top = top._parent
        if top is not self.root:
            raise ValueError(f"node {node._id} belongs to another cache")

    def set_value(self, node: Node, values: Any) -> None:
        """Store a leaf's indices: a CPU int64 array is copied in, a device tensor kept."""
        if isinstance(values, np.ndarray):
            if len(values) != node.num_tokens:
                raise ValueError(f"{len(values)} values for a node of {node.num_tokens} tokens")
            node._value = values.tobytes()
        else:
            node._value = values

    def gather(self, path: list):
        """The path's index values concatenated into one new int64 tensor."""
        parts = []
        for node in path:
            value = node._value
            if value is None:
                parts.append(node._key)
            elif type(value) is bytes:
                parts.append(value)
            else:
                return cat_values(path)  # device tensors: torch concatenates
        return torch.frombuffer(bytearray().join(parts), dtype=torch.int64)

    def lock(self, node: Any, delta: int) -> int:
        if node is None or node is self.root:
            return 0
        self._check_member(node)
        if delta < 0:
            # Locks taken on descendants show in this node's count too; only its own may go.
            own = node._lock_ref - sum(child._lock_ref for child in node._children.values())
            if own <= 0:
                raise ValueError(
                    f"dec_lock_ref on node {node._id}: no lock_ref was taken on it "
                    f"(lock_ref {node._lock_ref} comes from its descendants)"
                )
        root = self.root
        moved = 0
        while node is not root:
            if delta > 0:
                if node._lock_ref == 0:
                    moved += len(node._key)
                node._lock_ref += 1
            else:
                node._lock_ref -= 1
                if node._lock_ref == 0:
                    moved += len(node._key)
            node = node._parent
        return moved // _TOKEN_BYTES

    def remove_leaf(self, node: Node) -> Node:
        parent = node._parent
        if parent is None or node._children:
            raise ValueError(f"node {node._id} is not an attached leaf")
        ckey = self._child_key(parent, node._extra_key, node._key[: self._page_bytes])
        del parent._children[ckey]
        node._parent = None
        node._evicted = True
        node._value = None
        self.node_count -= 1
        return parent

    def reset(self) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node._children.values())
            node._children = {}
            node._parent = None
            node._evicted = True
            node._value = None
        self.root = Node(b"", None, None, 0)
        self._empty_inserted = set()
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0

    def iter_nodes(self) -> Iterator[tuple[Node, int]]:
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            children = sorted(node._children.values(), key=display_order, reverse=True)
            stack.extend((child, depth + 1) for child in children)


# -- eviction heap -------------------------------------------------------------------------
# Sort keys are single ints, fields packed most significant first (a heap of 10^6 leaves
# compares ints far faster than tuples). Every field fits 64 bits (priority is int64, times
# and ids are counters); the lowest field is the node id, so two nodes never tie.
_BIAS = 1 << 63      # int64 priority -> unsigned
_MAX = (1 << 64) - 1  # for "largest first" fields


def _lru_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | (n._last_access_time << 64) | n._id


def _lfu_key(n: Node) -> int:
    return (((n._priority + _BIAS) << 192) | (n._hit_count << 128)
            | (n._last_access_time << 64) | n._id)


def _fifo_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | (n._created_time << 64) | n._id


def _mru_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | ((_MAX - n._last_access_time) << 64) | (_MAX - n._id)


def _filo_key(n: Node) -> int:
    return ((n._priority + _BIAS) << 128) | ((_MAX - n._created_time) << 64) | (_MAX - n._id)


def _slru_key(n: Node) -> int:
    # Probationary segment (hit < 2 times) before the protected one; LRU inside each.
    return (((n._priority + _BIAS) << 129) | ((n._hit_count >= 2) << 128)
            | (n._last_access_time << 64) | n._id)


_POLICY_KEYS = {
    "lru": _lru_key, "lfu": _lfu_key, "fifo": _fifo_key, "mru": _mru_key,
    "filo": _filo_key, "slru": _slru_key, "priority": _lru_key,
}


class EvictionHeap:
    """Lazy min-heap of evictable leaves in ``policy`` order, kept across evict calls.

    ``push(node)`` when a node becomes an evictable leaf (or, for policies whose key can fall,
    when it is touched). ``pop_victim()`` returns the next evictable leaf whose key is still
    the one it was pushed with: entries of nodes that stopped being evictable leaves are
    dropped, entries whose key rose since are pushed again. The heap compacts itself when
    stale entries pile up, so it stays within twice the live entries (amortised O(1)).
    """

    __slots__ = ("_key", "_heap", "_nodes", "_limit")

    def __init__(self, policy: str) -> None:
        self._key = _POLICY_KEYS[policy]
        self.clear()

    def clear(self) -> None:
        self._heap: list = []
        self._nodes: dict = {}  # key -> node; the heap itself holds bare int keys
        self._limit = 1024

    def __len__(self) -> int:
        return len(self._heap)

    def key_of(self, node: Node) -> int:
        return self._key(node)

    def entries(self) -> list:
        """(stored key, node) of every live entry (for consistency checks)."""
        return list(self._nodes.items())

    def push(self, node: Node) -> None:
        key = self._key(node)
        heapq.heappush(self._heap, key)
        self._nodes[key] = node
        if len(self._heap) > self._limit:
            self._compact()

    def pop_victim(self) -> Node | None:
        heap = self._heap
        nodes = self._nodes
        sort_key = self._key
        while heap:
            stored = heapq.heappop(heap)
            node = nodes.pop(stored, None)
            if node is None:
                continue  # a duplicate of an entry already handled
            if node._evicted or node._children or node._lock_ref:
                continue  # pushed again if it becomes an evictable leaf
            current = sort_key(node)
            if current == stored:
                return node
            if current > stored:  # touched since pushed: wait for its turn
                heapq.heappush(heap, current)
                nodes[current] = node
            # else: a fall in key always came with a fresh push
        return None

    def _compact(self) -> None:
        sort_key = self._key
        best: dict = {}
        for stored, node in self._nodes.items():
            if node._evicted or node._children or node._lock_ref:
                continue
            if stored <= sort_key(node) and (node._id not in best or stored < best[node._id][0]):
                best[node._id] = (stored, node)
        self._nodes = dict(best.values())
        self._heap = list(self._nodes)
        heapq.heapify(self._heap)
        self._limit = max(1024, 2 * len(self._heap))

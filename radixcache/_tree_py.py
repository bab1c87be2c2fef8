"""The pure core's tree: ``Guard``, ``Node`` and ``Tree`` (walks, splits, locks; no heap).

Part of the pure core (``_core_py``, whose docstring specifies the interface); its ``Core``
drives this tree and holds the guard around every call.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterator

import numpy as np

from ._errors import lock_host_only, node_not_copyable
from ._state import display_order
from ._torch import cat_tensors, indices_from_key, load_torch, on_torch
from ._types import MAX_LOCK_REF, RadixTreeNode

__all__ = ["Guard", "Node", "HostNode", "Tree", "TOKEN_BYTES", "index_array"]

# The torch names this module uses, bound once some code imports torch (``_bind_torch``).
_torch: Any = None
_int64: Any = None


def _bind_torch(torch: Any) -> None:
    global _torch, _int64
    _torch = torch
    _int64 = torch.int64


on_torch(_bind_torch)

TOKEN_BYTES = 8
_next_id = 0


def _new_id() -> int:
    global _next_id
    _next_id += 1
    return _next_id


class _RootKey:
    """A root child's key in a namespace: (extra_key, first page), hashed once. The child
    keeps the very key it is filed under, so that detaching or splitting it finds its entry
    by identity and runs none of the extra_key's code (its ``__hash__``/``__eq__`` run only
    while a call looks a namespace up, before it changes anything). Two filed keys are two
    entries of one dict, never equal: a hash collision between them asks no extra_key."""

    __slots__ = ("extra_key", "page", "_hash", "filed")

    def __init__(self, extra_key: Any, page: bytes) -> None:
        self._hash = hash((extra_key, page))
        self.extra_key = extra_key
        self.page = page
        self.filed = False  # set once it is the key of a root entry

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> Any:
        if other is self:
            return True
        if type(other) is not _RootKey:
            return NotImplemented
        if self.filed and other.filed:
            return False
        # As a tuple compares: the same object is equal without asking it.
        return self.page == other.page and (self.extra_key is other.extra_key
                                            or bool(self.extra_key == other.extra_key))


def index_array(parts: list, numpy_arrays: bool) -> Any:
    """One new CPU int64 index array holding the native int64 bytes ``parts`` joined: a
    numpy array of its own memory (not ``np.frombuffer(bytearray(...))``, which rests on a
    memoryview the caller could release, freeing the memory under the array), or a tensor
    over a new bytearray."""
    if numpy_arrays:
        return np.frombuffer(b"".join(parts), dtype=np.int64).copy()
    return _torch.frombuffer(bytearray().join(parts), dtype=_int64)


def _first_mismatch(a: bytes, b: bytes) -> int:
    """Index of the first differing token of two equal-length byte strings (len if none)."""
    diff = int.from_bytes(a, "little") ^ int.from_bytes(b, "little")
    if diff == 0:
        return len(a) // TOKEN_BYTES
    # The lowest set bit sits in the first differing byte, so in the first differing token.
    return ((diff & -diff).bit_length() - 1) // (8 * TOKEN_BYTES)


class Guard:
    """Held while a call into a tree or its heap runs; a nested call raises RuntimeError.

    A lock taken without waiting, so that a second thread is caught as surely as a nested
    call (a plain flag could be tested by both threads before either set it)."""

    __slots__ = ("_lock", "acquire", "release")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acquire = self._lock.acquire
        self.release = self._lock.release

    @property
    def busy(self) -> bool:
        return self._lock.locked()


class Node:
    """A radix tree node of the pure-Python core.

    It has only what a one-tier tree uses; a tree with a host tier makes ``HostNode``
    objects, whose slots hold the host tier's fields (here they are class attributes: a
    plain node is on the device, has no host copy and is never queued)."""

    __slots__ = (
        "_key", "_value", "_parent", "_children", "_lock_ref", "_last_access_time",
        "_created_time", "_priority", "_hit_count", "_extra_key", "_id", "_evicted",
        "_terminal", "_own_locks", "_root_key",
    )
    _numpy_arrays = False  # index arrays are tensors (``_NumpyNode``: numpy arrays)
    _host = None  # host indices as int64 bytes (HostNode only)
    _on_device = True
    _queued = False  # in the write-through queue (HostNode only)

    def __init__(self, key: bytes, parent: "Node | None", extra_key: Any, now: int,
                 priority: int = 0) -> None:
        self._key = key
        self._value = None
        self._parent = parent
        self._children: dict = {}
        self._lock_ref = 0
        self._own_locks = 0  # the locks taken on this node itself (not on a descendant)
        self._last_access_time = now
        self._created_time = now
        self._priority = priority
        self._hit_count = 0
        self._extra_key = extra_key
        self._id = _new_id()
        self._evicted = False
        self._terminal = False
        self._root_key = None  # the _RootKey it is filed under (a root child in a namespace)

    # -- read-only public view -------------------------------------------------------
    @property
    def key(self) -> np.ndarray:
        return np.frombuffer(self._key, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self._key) // TOKEN_BYTES

    @property
    def stored_value(self):
        if self._value is None or not self._on_device:
            return None
        return self.value

    @property
    def value(self):
        if self._evicted or not self._on_device:
            return None
        value = self._value
        if value is None:
            return indices_from_key(self.key, self._numpy_arrays)
        if type(value) is bytes:  # always with numpy arrays: CPU values only
            return indices_from_key(np.frombuffer(value, dtype=np.int64), self._numpy_arrays)
        # A device tensor: a new view, so that what the caller does to its shape (resize_,
        # set_) never reaches the tensor the tree reads.
        return value[:]

    @property
    def on_device(self) -> bool:
        return self._on_device

    @property
    def host_value(self):
        host = self._host
        if host is None:
            return None
        return index_array([host], self._numpy_arrays)

    @property
    def tier(self) -> str:
        if not self._on_device:
            return "host"
        return "device" if self._host is None else "device+host"

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

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise node_not_copyable()


class _NumpyNode(Node):
    """A node of a core of numpy arrays: ``value`` and ``host_value`` are numpy arrays."""

    __slots__ = ()
    _numpy_arrays = True


class HostNode(Node):
    """A node of a tree with a host tier: the host tier's fields are its own slots."""

    __slots__ = ("_host", "_on_device", "_queued")

    def __init__(self, key: bytes, parent: "Node | None", extra_key: Any, now: int,
                 priority: int = 0) -> None:
        super().__init__(key, parent, extra_key, now, priority)
        self._host = None
        self._on_device = True
        self._queued = False


class _NumpyHostNode(HostNode):
    """A HostNode of a core of numpy arrays."""

    __slots__ = ()
    _numpy_arrays = True


# The node class of a tree: by (numpy arrays, host tier).
_NODE_CLASSES = {(False, False): Node, (True, False): _NumpyNode,
                 (False, True): HostNode, (True, True): _NumpyHostNode}


class Tree:
    """The pure-Python radix tree: walks, splits, locks; no tensors, no heap."""

    __slots__ = ("page_size", "root", "clock", "node_count", "num_splits", "_page_bytes",
                 "_empty_inserted", "guard", "_enter", "_leave", "_queue", "_numpy_arrays",
                 "_Node", "host")

    def __init__(self, page_size: int, numpy_arrays: bool = False, host: bool = False,
                 node_class: Any = None) -> None:
        # Index arrays are numpy arrays (else tensors), with a host tier or without: the
        # nodes' class says which (``node_class``: a subclass's own, its array kind given).
        if not numpy_arrays:
            load_torch()
        self._numpy_arrays = numpy_arrays
        self.host = bool(host)
        self._Node = (_NODE_CLASSES[bool(numpy_arrays), self.host] if node_class is None
                      else node_class)
        self.guard = Guard()
        self._enter = self.guard.acquire
        self._leave = self.guard.release
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0
        self.root = self._new_root()
        # Namespaces in which the empty sequence was inserted (it has no node to mark).
        self._empty_inserted: set = set()
        # The write-through queue (nodes due for a host copy, FIFO); a split of a queued
        # node appends its new upper half.
        self._queue: deque = deque()

    # -- helpers ---------------------------------------------------------------------
    def _child_key(self, parent: Node, extra_key: Any, first_page: bytes):
        # Namespaces only need separating at the root: a subtree never mixes extra_keys.
        if parent is self.root and extra_key is not None:
            return _RootKey(extra_key, first_page)
        return first_page

    def _entry_key(self, node: Node) -> Any:
        """The key an attached ``node`` is filed under in its parent's dict (found by
        identity: no extra_key code runs)."""
        ckey = node._root_key
        return node._key[: self._page_bytes] if ckey is None else ckey

    @staticmethod
    def _filed(node: Node, ckey: Any) -> None:
        """``node`` was just filed under ``ckey``: a namespace's root key is kept by it."""
        if type(ckey) is _RootKey:
            ckey.filed = True
            node._root_key = ckey

    def _aligned_end(self, buf: bytes) -> int:
        end = len(buf)
        return end - end % self._page_bytes

    def _common_bytes(self, key: bytes, buf: bytes, pos: int, end: int) -> int:
        """Page-aligned byte length of the common prefix of key and buf[pos:end]."""
        span = min(len(key), end - pos)
        if key[:span] == buf[pos:pos + span]:
            same = span
        else:
            same = _first_mismatch(key[:span], buf[pos:pos + span]) * TOKEN_BYTES
        return same - same % self._page_bytes

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` ``at`` bytes in: a new upper node takes over its place."""
        parent = node._parent
        upper = self._Node(node._key[:at], parent, node._extra_key, node._last_access_time,
                           node._priority)
        upper._lock_ref = node._lock_ref
        upper._hit_count = node._hit_count
        upper._created_time = node._created_time
        value = upper_value = lower_value = node._value
        if value is not None:  # torch code for a device value: before any write
            cut = at if type(value) is bytes else at // TOKEN_BYTES
            upper_value, lower_value = value[:cut], value[cut:]
        host = upper_host = lower_host = node._host
        if host is not None:
            upper_host, lower_host = host[:at], host[at:]
        # The upper half takes over node's entry (and its key).
        parent._children[self._entry_key(node)] = upper
        upper._root_key = node._root_key
        node._root_key = None
        upper._value = upper_value
        node._value = lower_value
        if self.host:
            upper._host = upper_host
            node._host = lower_host
            upper._on_device = node._on_device
            if node._queued:
                upper._queued = True
                self._queue.append(upper)
        node._key = node._key[at:]
        upper._children[node._key[: self._page_bytes]] = node
        node._parent = upper
        self.node_count += 1
        self.num_splits += 1
        return upper

    # -- walks -----------------------------------------------------------------------
    def _find_child(self, node: Node, buf: bytes, pos: int, extra_key: Any) -> Node | None:
        first = buf[pos:pos + self._page_bytes]
        if node is self.root and extra_key is not None:
            return node._children.get(_RootKey(extra_key, first))
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

    # The walks take the call's tokens as bytes; the Core converts them and holds the guard.
    def _match(self, buf: bytes, extra_key: Any = None) -> tuple[list, int]:
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
        return path, pos // TOKEN_BYTES

    def _insert(self, buf: bytes, extra_key: Any = None, priority: int = 0,
                hits_from: int = 0):
        end = self._aligned_end(buf)
        hits_bytes = hits_from * TOKEN_BYTES  # a node counts a hit if it ends past this
        whole = end == len(buf)
        node = self.root
        if end == 0:
            if whole:
                self._empty_inserted.add(extra_key)
            return 0, node, None, None
        self.clock += 1
        now = self.clock
        node._last_access_time = now
        pos = 0
        adopted = None
        while pos < end:
            child, common = self._descend(node, buf, pos, end, extra_key)
            if child is None:
                break
            child._last_access_time = now
            if pos + common > hits_bytes:
                child._hit_count += 1
            if priority > child._priority:
                child._priority = priority
            if not child._on_device:  # host only: the Core adopts it (the caller's slots)
                if adopted is None:
                    adopted = []
                adopted.append((child, pos // TOKEN_BYTES))
            pos += common
            node = child
        # Adopted tokens are not duplicates: only what was on the device counts.
        prefix_len = pos // TOKEN_BYTES if adopted is None else adopted[0][1]
        new_leaf = None
        if pos < end:
            new_leaf = self._Node(buf[pos:end], node, extra_key, now, priority)
            new_leaf._hit_count = 1 if end > hits_bytes else 0
            first = buf[pos:pos + self._page_bytes]
            ckey = self._child_key(node, extra_key, first)  # hashes extra_key: may raise
            node._children[ckey] = new_leaf
            self._filed(new_leaf, ckey)
            self.node_count += 1
            node = new_leaf
        if whole:
            node._terminal = True
        return prefix_len, node, new_leaf, adopted

    def _exists(self, buf: bytes, extra_key: Any = None) -> bool:
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

    def _walk(self, buf: bytes, extra_key: Any = None) -> int:
        """Read-only: the longest cached page-aligned prefix length (no split, no stamps)."""
        end = self._aligned_end(buf)
        node = self.root
        pos = 0
        while pos < end:
            child = self._find_child(node, buf, pos, extra_key)
            if child is None or not child._on_device:
                break
            key = child._key
            klen = len(key)
            if klen <= end - pos and buf[pos:pos + klen] == key:
                pos += klen
                node = child
                continue
            pos += self._common_bytes(key, buf, pos, end)
            break
        return pos // TOKEN_BYTES

    # -- node bookkeeping ------------------------------------------------------------
    def _holds(self, node: Node) -> bool:
        """Whether ``node`` (a Node) is in this tree: its parents lead to this root."""
        while node._parent is not None:
            node = node._parent
        return node is self.root

    def _check_member(self, node: Any) -> None:
        if not isinstance(node, Node):
            if isinstance(node, RadixTreeNode):
                raise ValueError("node belongs to another cache (a different tree core)")
            raise TypeError(f"expected a RadixTreeNode, got {type(node).__name__}")
        if node._evicted:
            raise ValueError(f"node {node._id} was evicted")
        if not self._holds(node):
            raise ValueError(f"node {node._id} belongs to another cache")

    # The Core holds the guard around these; each returns what it let go, for the Core to
    # release after it.
    def _store_value(self, node: Node, values: Any) -> Any:
        """Store a leaf's indices: a CPU int64 array is copied in, a device tensor kept."""
        if isinstance(values, np.ndarray):
            if len(values) != node.num_tokens:
                raise ValueError(f"{len(values)} values for a node of {node.num_tokens} tokens")
            values = values.tobytes()
        previous = node._value
        node._value = values
        return previous

    def _gather(self, path: list):
        """The path's index values concatenated into one new int64 array (a tensor, or a
        numpy array in a tree of numpy arrays)."""
        parts = []
        for node in path:
            value = node._value
            if value is None:
                parts.append(node._key)
            elif type(value) is bytes:
                parts.append(value)
            else:  # device tensors (torch arrays only): torch joins them into a new one
                return cat_tensors([n.value if n._value is None or type(n._value) is bytes
                                    else n._value for n in path])
        return index_array(parts, self._numpy_arrays)

    def _lock(self, node: Any, delta: int) -> int:
        if node is None or node is self.root:
            return 0
        self._check_member(node)
        if delta < 0:
            # Locks taken on descendants show in this node's count too; only its own may go.
            if node._own_locks <= 0:
                raise ValueError(
                    f"dec_lock_ref on node {node._id}: no lock_ref was taken on it "
                    f"(lock_ref {node._lock_ref} comes from its descendants)"
                )
        root = self.root
        if delta > 0:
            if not node._on_device:
                raise lock_host_only(node._id)
            # Checked before any change (an ancestor's count is the largest).
            top = node
            while top._parent is not root:
                top = top._parent
            if top._lock_ref >= MAX_LOCK_REF:
                raise OverflowError(f"inc_lock_ref on node {node._id}: node {top._id} already "
                                    f"has lock_ref {MAX_LOCK_REF}, the most a node can hold")
        node._own_locks += 1 if delta > 0 else -1
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
        return moved // TOKEN_BYTES

    def _detach_leaf(self, node: Node) -> tuple:
        """Detach an attached leaf (marked evicted); returns (parent, its dropped value)."""
        parent = node._parent
        if parent is None or node._children:
            raise ValueError(f"node {node._id} is not an attached leaf")
        del parent._children[self._entry_key(node)]
        node._root_key = None
        node._parent = None
        node._evicted = True
        previous = node._value
        node._value = None
        self.node_count -= 1
        return parent, previous

    def _new_root(self) -> Node:
        """An empty root. Its ``lock_ref`` is a permanent 1, as in SGLang: ``_lock`` never
        walks into it, so locking or unlocking it changes nothing."""
        root = self._Node(b"", None, None, 0)
        root._lock_ref = 1
        return root

    def _clear(self) -> Node:
        """Drop every node (marked evicted) without recursion; returns the old root."""
        old_root = self.root
        self.root = self._new_root()
        self._empty_inserted = set()
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0
        stack = [old_root]
        while stack:
            node = stack.pop()
            stack.extend(node._children.values())
            node._children = {}
            node._parent = None
            node._evicted = True
            node._value = None
            if self.host:
                node._host = None
                node._queued = False
        return old_root

    def check_layout(self) -> None:
        # Every child is filed under its (namespace, first page) key in its parent's dict.
        for node, _ in self.iter_nodes():
            for ckey, child in node._children.items():
                want = self._child_key(node, child._extra_key, child._key[: self._page_bytes])
                kept = ckey if type(ckey) is _RootKey else None
                assert ckey == want and child._parent is node and child._root_key is kept, (
                    f"node {child.id} filed under the wrong key in node {node.id}")

    def iter_nodes(self) -> Iterator[tuple[Node, int]]:
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            children = sorted(node._children.values(), key=display_order, reverse=True)
            stack.extend((child, depth + 1) for child in children)

# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True
"""Compiled radix tree core: the same interface as ``_core_py`` (see its docstring).

Keys are int64 runs inside bytes objects (split halves share one at different offsets);
children sit in a per-node open-addressing table keyed by a hash of (namespace, first page),
so a walk step boxes no Python int. The caller's tokens become one int64 buffer per call.
"""

cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.number cimport PyNumber_Index
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import numpy as np
import torch

from ._shared import cat_values as _cat_values
from ._shared import display_order, indices_from_key

_frombuffer = torch.frombuffer
_int64 = torch.int64

CORE_NAME = "c"

cdef int64_t _next_id = 0
cdef Py_ssize_t _MIN_SLOTS = 4
# Grow the first memcmp block by doubling up to this many tokens: early mismatches stay
# cheap, long matches run at memcmp speed.
cdef Py_ssize_t _MAX_BLOCK = 4096


cdef inline int64_t _new_id() noexcept:
    global _next_id
    _next_id += 1
    return _next_id


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    # splitmix64 finaliser: spreads token ids over the table's low bits.
    x ^= x >> 30
    x *= 0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= 0x94d049bb133111ebULL
    x ^= x >> 31
    return x


cdef inline Py_ssize_t common_prefix(const int64_t* a, const int64_t* b,
                                     Py_ssize_t n) noexcept nogil:
    """Length of the common prefix of a[:n] and b[:n]."""
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t block = 16
    while i + block <= n:
        if memcmp(a + i, b + i, <size_t>block * sizeof(int64_t)) != 0:
            break
        i += block
        if block < _MAX_BLOCK:
            block *= 2
    while i < n and a[i] == b[i]:
        i += 1
    return i


cdef extern from "Python.h":
    # Borrowed-pointer spellings: the conversion loop never touches reference counts.
    PyObject** PySequence_Fast_ITEMS(object)
    bint long_check_exact "PyLong_CheckExact"(PyObject*) noexcept
    long long long_value "PyLong_AsLongLong"(PyObject*) except? -1

cdef extern from *:
    """
    /* Reads a one-digit int without a call: token ids are nearly always that small. */
    static inline int rc_small_int(PyObject* o, int64_t* out) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject*)o)) {
            *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject*)o);
            return 1;
        }
        return 0;
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 1) { *out = (int64_t)((PyLongObject*)o)->ob_digit[0]; return 1; }
        if (size == 0) { *out = 0; return 1; }
        if (size == -1) { *out = -(int64_t)((PyLongObject*)o)->ob_digit[0]; return 1; }
        return 0;
    #endif
    }
    """
    bint rc_small_int(PyObject* o, int64_t* out) noexcept


cdef inline int64_t token_value(PyObject* item) except? -1:
    # Exact ints take the fast path; anything else must have __index__ (a float never
    # truncates silently). Errors get their message in token_error(), off the hot path.
    cdef int64_t value
    if long_check_exact(item):
        if rc_small_int(item, &value):
            return value
        return long_value(item)
    return PyLong_AsLongLong(PyNumber_Index(<object>item))


cdef object token_error(object tokens):
    """Re-raise a failed conversion with a message naming the bad token."""
    for item in tokens:
        try:
            value = PyNumber_Index(item)
        except TypeError:
            return TypeError(f"token ids must be integers, got {type(item).__name__}")
        if not -(2**63) <= value < 2**63:
            return OverflowError(f"token id {value} does not fit in int64")
    return TypeError("bad token ids")


cdef object as_tokens(object tokens, const int64_t** out, Py_ssize_t* out_len):
    """Point ``out`` at the tokens as one int64 buffer; the returned object keeps it alive."""
    cdef Py_ssize_t i, length
    cdef int64_t* buf
    cdef PyObject** items
    cdef const int64_t[::1] view
    cdef object owner
    if type(tokens) is list or type(tokens) is tuple:
        length = len(tokens)
        items = PySequence_Fast_ITEMS(tokens)
        owner = PyBytes_FromStringAndSize(NULL, length * sizeof(int64_t))
        buf = <int64_t*>PyBytes_AS_STRING(owner)
        try:
            for i in range(length):
                buf[i] = token_value(items[i])
        except (TypeError, OverflowError):
            raise token_error(tokens) from None
    else:
        # Zero-copy for numpy int64 arrays and array('q'): one buffer acquisition per call.
        try:
            view = tokens
        except (ValueError, BufferError) as exc:
            raise TypeError(f"token buffer must be 1-D contiguous int64: {exc}") from None
        out_len[0] = view.shape[0]
        out[0] = &view[0] if view.shape[0] else NULL
        return view
    out[0] = <const int64_t*>buf
    out_len[0] = length
    return owner


@cython.final
@cython.no_gc
cdef class Node:
    """A radix tree node of the compiled core."""

    def __cinit__(self):
        self.slots = NULL
        self.slot_mask = -1
        self.n_children = 0
        self.parent_ptr = NULL
        self.key_ptr = NULL
        self.key_len = 0
        self.value_ptr = NULL

    def __dealloc__(self):
        self.release_children()

    cdef void release_children(self) noexcept:
        cdef Py_ssize_t i
        cdef PyObject* child
        if self.slots == NULL:
            return
        for i in range(self.slot_mask + 1):
            child = self.slots[i].node
            if child != NULL:
                (<Node>child).parent_ptr = NULL
                self.slots[i].node = NULL
                Py_DECREF(<object>child)
        PyMem_Free(self.slots)
        self.slots = NULL
        self.slot_mask = -1
        self.n_children = 0

    cdef Node find_child(self, const int64_t* page, Py_ssize_t page_size, uint64_t h):
        cdef Py_ssize_t i
        cdef PyObject* cand
        if self.n_children == 0:
            return None
        i = <Py_ssize_t>(h & <uint64_t>self.slot_mask)
        while True:
            cand = self.slots[i].node
            if cand == NULL:
                return None
            if self.slots[i].hash == h and memcmp((<Node>cand).key_ptr, page,
                                                   <size_t>page_size * sizeof(int64_t)) == 0:
                return <Node>cand
            i = (i + 1) & self.slot_mask

    cdef int grow(self) except -1:
        cdef Py_ssize_t old_cap = self.slot_mask + 1
        cdef Py_ssize_t new_cap = _MIN_SLOTS if old_cap == 0 else old_cap * 2
        cdef ChildSlot* old = self.slots
        cdef ChildSlot* fresh = <ChildSlot*>PyMem_Malloc(new_cap * sizeof(ChildSlot))
        cdef Py_ssize_t i, j
        if fresh == NULL:
            raise MemoryError()
        memset(fresh, 0, new_cap * sizeof(ChildSlot))
        for i in range(old_cap):
            if old[i].node != NULL:
                j = <Py_ssize_t>(old[i].hash & <uint64_t>(new_cap - 1))
                while fresh[j].node != NULL:
                    j = (j + 1) & (new_cap - 1)
                fresh[j] = old[i]
        PyMem_Free(old)
        self.slots = fresh
        self.slot_mask = new_cap - 1
        return 0

    cdef int add_child(self, Node child, uint64_t h) except -1:
        """Adds ``child`` taking a new reference (the table's own)."""
        cdef Py_ssize_t i
        if (self.n_children + 1) * 2 > self.slot_mask + 1:
            self.grow()
        i = <Py_ssize_t>(h & <uint64_t>self.slot_mask)
        while self.slots[i].node != NULL:
            i = (i + 1) & self.slot_mask
        Py_INCREF(child)
        self.slots[i].node = <PyObject*>child
        self.slots[i].hash = h
        self.n_children += 1
        child.parent_ptr = <PyObject*>self
        return 0

    cdef Py_ssize_t slot_of(self, Node child, uint64_t h) noexcept:
        cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>self.slot_mask)
        while self.slots[i].node != <PyObject*>child:
            i = (i + 1) & self.slot_mask
        return i

    cdef void remove_slot(self, Py_ssize_t i) noexcept:
        """Empties slot ``i`` (the caller owns the reference it held), backward-shifting."""
        cdef Py_ssize_t j = i
        cdef Py_ssize_t home
        cdef Py_ssize_t mask = self.slot_mask
        while True:
            j = (j + 1) & mask
            if self.slots[j].node == NULL:
                break
            home = <Py_ssize_t>(self.slots[j].hash & <uint64_t>mask)
            # Keep entry j where it is if its home lies cyclically in (i, j].
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self.slots[i] = self.slots[j]
            i = j
        self.slots[i].node = NULL
        self.n_children -= 1

    # -- read-only public view -------------------------------------------------------
    @property
    def key(self):
        base = <const int64_t*>PyBytes_AS_STRING(self.key_owner)
        return np.frombuffer(self.key_owner, dtype=np.int64, count=self.key_len,
                             offset=(self.key_ptr - base) * sizeof(int64_t))

    @property
    def num_tokens(self):
        return self.key_len

    @property
    def stored_value(self):
        if self.value_owner is None:
            return None
        return self.value

    @property
    def value(self):
        if self.evicted:
            return None
        if self.value_ptr != NULL:
            base = <const int64_t*>PyBytes_AS_STRING(self.value_owner)
            return indices_from_key(np.frombuffer(
                self.value_owner, dtype=np.int64, count=self.key_len,
                offset=(self.value_ptr - base) * sizeof(int64_t)))
        if self.value_owner is not None:
            return self.value_owner
        return indices_from_key(self.key)

    @property
    def parent(self):
        if self.parent_ptr == NULL:
            return None
        return <Node>self.parent_ptr

    @property
    def children(self):
        cdef Py_ssize_t i
        out = []
        for i in range(self.slot_mask + 1):
            if self.slots[i].node != NULL:
                out.append(<Node>self.slots[i].node)
        return tuple(out)

    @property
    def num_children(self):
        return self.n_children

    def __repr__(self):
        return (f"<RadixTreeNode id={self.id} len={self.key_len} "
                f"lock_ref={self.lock_ref}{' evicted' if self.evicted else ''}>")


cdef class Tree:
    """The compiled radix tree: walks, splits, locks; no tensors, no heap."""

    def __cinit__(self, Py_ssize_t page_size):
        self.page_size = page_size
        self.namespaces = {None: 0}
        self.empty_inserted = set()
        self.root = self.new_node(None, 0)
        self.root.key_owner = b""
        self.root.key_ptr = <const int64_t*>PyBytes_AS_STRING(self.root.key_owner)

    def __dealloc__(self):
        # Iterative teardown: dropping a deep chain by refcount would recurse per level.
        self.teardown()

    cdef Node new_node(self, Node parent, int64_t now):
        cdef Node node = Node.__new__(Node)
        node.id = _new_id()
        node.last_access_time = now
        node.created_time = now
        if parent is not None:
            node.ns = parent.ns
            node.extra_key = parent.extra_key
        return node

    cdef uint64_t page_hash(self, const int64_t* page, int64_t ns) noexcept nogil:
        cdef uint64_t h = _mix(<uint64_t>ns + 0x9e3779b97f4a7c15ULL)
        cdef Py_ssize_t i
        for i in range(self.page_size):
            h = _mix(h ^ <uint64_t>page[i])
        return h

    cdef int64_t namespace_of(self, object extra_key, bint create) except -2:
        """The namespace id of ``extra_key``; -1 when unknown and not created."""
        if extra_key is None:
            return 0
        ns = self.namespaces.get(extra_key)
        if ns is None:
            if not create:
                return -1
            ns = len(self.namespaces)
            self.namespaces[extra_key] = ns
        return <int64_t>ns

    cdef Node split(self, Node child, Py_ssize_t at):
        """Split ``child`` ``at`` tokens in: a new upper node takes over its place."""
        cdef Node parent = <Node>child.parent_ptr
        cdef uint64_t h = self.page_hash(child.key_ptr, child.ns)
        cdef Py_ssize_t i = parent.slot_of(child, h)
        cdef Node upper = self.new_node(parent, child.last_access_time)
        upper.key_owner = child.key_owner
        upper.key_ptr = child.key_ptr
        upper.key_len = at
        upper.lock_ref = child.lock_ref
        upper.priority = child.priority
        upper.hit_count = child.hit_count
        upper.created_time = child.created_time
        upper.ns = child.ns
        upper.extra_key = child.extra_key
        if child.value_ptr != NULL:
            upper.value_owner = child.value_owner
            upper.value_ptr = child.value_ptr
            child.value_ptr = child.value_ptr + at
        elif child.value_owner is not None:
            upper.value_owner = child.value_owner[:at]
            child.value_owner = child.value_owner[at:]
        # Upper takes child's slot in the parent (same first page, same hash): the slot's
        # reference to child moves into upper's table below.
        Py_INCREF(upper)
        parent.slots[i].node = <PyObject*>upper
        upper.parent_ptr = <PyObject*>parent
        child.key_ptr = child.key_ptr + at
        child.key_len -= at
        upper.add_child(child, self.page_hash(child.key_ptr, child.ns))
        Py_DECREF(child)  # add_child took a new reference; drop the one the slot held
        self.node_count += 1
        self.num_splits += 1
        return upper

    # -- walks -----------------------------------------------------------------------
    cdef Node descend(self, Node node, const int64_t* tokens, Py_ssize_t remaining,
                      int64_t ns, Py_ssize_t* matched):
        """The child of ``node`` that ``tokens`` enter, split so that the match ends on its
        boundary (``matched`` tokens); None if no child starts with their first page.

        After a split the walk's next lookup finds nothing (the lower half starts with the
        page that differed), so callers simply keep descending."""
        cdef Node child = node.find_child(tokens, self.page_size,
                                          self.page_hash(tokens, ns))
        cdef Py_ssize_t klen, common
        if child is None:
            return None
        klen = child.key_len
        common = common_prefix(child.key_ptr, tokens, klen if klen < remaining else remaining)
        if common < klen:
            common -= common % self.page_size
            child = self.split(child, common)
        matched[0] = common
        return child

    def match(self, tokens, extra_key=None):
        cdef const int64_t* buf
        cdef Py_ssize_t n, end, pos = 0, common
        cdef int64_t now, ns
        cdef Node node, child
        keep = as_tokens(tokens, &buf, &n)
        end = n - n % self.page_size
        if end == 0:
            return [], 0
        ns = self.namespace_of(extra_key, False)
        self.clock += 1
        now = self.clock
        node = self.root
        node.last_access_time = now
        path = []
        if ns < 0:
            return path, 0
        while pos < end:
            child = self.descend(node, buf + pos, end - pos, ns, &common)
            if child is None:
                break
            child.last_access_time = now
            path.append(child)
            pos += common
            node = child
        return path, pos

    def insert(self, tokens, extra_key=None, int64_t priority=0):
        cdef const int64_t* buf
        cdef Py_ssize_t n, end, pos = 0, common
        cdef int64_t now, ns
        cdef bint whole
        cdef Node node, child, leaf
        keep = as_tokens(tokens, &buf, &n)
        end = n - n % self.page_size
        whole = end == n
        node = self.root
        if end == 0:
            if whole:
                self.empty_inserted.add(extra_key)
            return 0, node, None
        ns = self.namespace_of(extra_key, True)
        self.clock += 1
        now = self.clock
        node.last_access_time = now
        while pos < end:
            child = self.descend(node, buf + pos, end - pos, ns, &common)
            if child is None:
                break
            child.last_access_time = now
            child.hit_count += 1
            if priority > child.priority:
                child.priority = priority
            pos += common
            node = child
        prefix_len = pos
        leaf = None
        if pos < end:
            leaf = self.new_node(node, now)
            leaf.key_owner = PyBytes_FromStringAndSize(<const char*>(buf + pos),
                                                       (end - pos) * sizeof(int64_t))
            leaf.key_ptr = <const int64_t*>PyBytes_AS_STRING(leaf.key_owner)
            leaf.key_len = end - pos
            leaf.priority = priority
            leaf.hit_count = 1
            leaf.ns = ns
            leaf.extra_key = extra_key
            node.add_child(leaf, self.page_hash(leaf.key_ptr, ns))
            self.node_count += 1
            node = leaf
        if whole:
            node.terminal = True
        return prefix_len, node, leaf

    def exists(self, tokens, extra_key=None):
        cdef const int64_t* buf
        cdef Py_ssize_t n, pos = 0, klen
        cdef Py_ssize_t page_size = self.page_size
        cdef int64_t ns
        cdef Node node, child
        keep = as_tokens(tokens, &buf, &n)
        if n % page_size:
            return False
        node = self.root
        if n == 0:
            return extra_key in self.empty_inserted
        ns = self.namespace_of(extra_key, False)
        if ns < 0:
            return False
        while pos < n:
            child = node.find_child(buf + pos, page_size, self.page_hash(buf + pos, ns))
            if child is None:
                return False
            klen = child.key_len
            if klen > n - pos or memcmp(child.key_ptr, buf + pos, klen * sizeof(int64_t)) != 0:
                return False
            pos += klen
            node = child
        return node.terminal

    def walk(self, tokens, extra_key=None):
        """Read-only: the longest cached page-aligned prefix length (no split, no stamps)."""
        cdef const int64_t* buf
        cdef Py_ssize_t n, end, pos = 0, klen, same
        cdef Py_ssize_t page_size = self.page_size
        cdef int64_t ns
        cdef Node node = self.root
        cdef Node child
        ns = self.namespace_of(extra_key, False)
        keep = as_tokens(tokens, &buf, &n)
        end = n - n % page_size
        if ns < 0:
            return 0
        while pos < end:
            child = node.find_child(buf + pos, page_size, self.page_hash(buf + pos, ns))
            if child is None:
                break
            klen = child.key_len
            if klen <= end - pos and memcmp(child.key_ptr, buf + pos,
                                            klen * sizeof(int64_t)) == 0:
                pos += klen
                node = child
                continue
            same = common_prefix(child.key_ptr, buf + pos, klen if klen < end - pos else end - pos)
            pos += same - same % page_size
            break
        return pos

    # -- node bookkeeping ------------------------------------------------------------
    def _check_member(self, node):
        cdef Node top
        if not isinstance(node, Node):
            from ._core import RadixTreeNode

            if isinstance(node, RadixTreeNode):
                raise ValueError("node belongs to another cache (a different tree core)")
            raise TypeError(f"expected a RadixTreeNode, got {type(node).__name__}")
        top = <Node>node
        if top.evicted:
            raise ValueError(f"node {top.id} was evicted")
        while top.parent_ptr != NULL:
            top = <Node>top.parent_ptr
        if top is not self.root:
            raise ValueError(f"node {(<Node>node).id} belongs to another cache")

    def set_value(self, Node node, values):
        """Store a leaf's indices: a CPU int64 array is copied in, a device tensor kept."""
        cdef const int64_t[::1] view
        if isinstance(values, np.ndarray):
            view = values
            if view.shape[0] != node.key_len:
                raise ValueError(f"{view.shape[0]} values for a node of {node.key_len} tokens")
            node.value_owner = PyBytes_FromStringAndSize(
                <const char*>&view[0], node.key_len * sizeof(int64_t))
            node.value_ptr = <const int64_t*>PyBytes_AS_STRING(node.value_owner)
        else:
            node.value_owner = values
            node.value_ptr = NULL

    def gather(self, list path):
        """The path's index values concatenated into one new int64 tensor."""
        cdef Py_ssize_t total = 0, pos = 0
        cdef Node node
        cdef char* out
        for node in path:
            if node.value_ptr == NULL and node.value_owner is not None:
                return _cat_values(path)  # device tensors: torch concatenates
            total += node.key_len
        buf = PyByteArray_FromStringAndSize(NULL, total * sizeof(int64_t))
        out = PyByteArray_AS_STRING(buf)
        for node in path:
            memcpy(out + pos, node.value_ptr if node.value_ptr != NULL else node.key_ptr,
                   node.key_len * sizeof(int64_t))
            pos += node.key_len * sizeof(int64_t)
        return _frombuffer(buf, dtype=_int64)

    def lock(self, node, int delta):
        cdef Node cur
        cdef Py_ssize_t moved = 0, own, i
        if node is None or node is self.root:
            return 0
        self._check_member(node)
        cur = <Node>node
        if delta < 0:
            # Locks taken on descendants show in this node's count too; only its own may go.
            own = cur.lock_ref
            for i in range(cur.slot_mask + 1):
                if cur.slots[i].node != NULL:
                    own -= (<Node>cur.slots[i].node).lock_ref
            if own <= 0:
                raise ValueError(
                    f"dec_lock_ref on node {cur.id}: no lock_ref was taken on it "
                    f"(lock_ref {cur.lock_ref} comes from its descendants)"
                )
        while cur is not self.root:
            if delta > 0:
                if cur.lock_ref == 0:
                    moved += cur.key_len
                cur.lock_ref += 1
            else:
                cur.lock_ref -= 1
                if cur.lock_ref == 0:
                    moved += cur.key_len
            cur = <Node>cur.parent_ptr
        return moved

    def remove_leaf(self, Node node):
        cdef Node parent
        cdef Py_ssize_t i
        if node.parent_ptr == NULL or node.n_children:
            raise ValueError(f"node {node.id} is not an attached leaf")
        parent = <Node>node.parent_ptr
        i = parent.slot_of(node, self.page_hash(node.key_ptr, node.ns))
        parent.remove_slot(i)
        node.parent_ptr = NULL
        node.evicted = True
        node.value_owner = None
        node.value_ptr = NULL
        self.node_count -= 1
        Py_DECREF(node)  # the table's reference; the caller still holds one
        return parent

    cdef void teardown(self) noexcept:
        cdef Node node
        cdef Py_ssize_t i
        if self.root is None:
            return
        stack = [self.root]
        while stack:
            node = <Node>stack.pop()
            for i in range(node.slot_mask + 1):
                if node.slots[i].node != NULL:
                    stack.append(<Node>node.slots[i].node)
            node.release_children()
            node.evicted = True
            node.value_owner = None
            node.value_ptr = NULL

    def reset(self):
        self.teardown()
        self.namespaces = {None: 0}
        self.empty_inserted = set()
        self.root = self.new_node(None, 0)
        self.root.key_owner = b""
        self.root.key_ptr = <const int64_t*>PyBytes_AS_STRING(self.root.key_owner)
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0

    def iter_nodes(self):
        cdef Node node
        stack = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            children = sorted(node.children, key=display_order, reverse=True)
            stack.extend((child, depth + 1) for child in children)


# -- eviction heap -------------------------------------------------------------------------
# Keys are four unsigned words compared in order, stored inline in one array with the node
# pointer: a pop on a heap of 10^6 leaves touches one cache line per level instead of
# chasing pointers to Python key objects. Fields as in the pure core's packed ints.
cdef uint64_t _BIAS = 1ULL << 63
cdef uint64_t _MAX = 0xFFFFFFFFFFFFFFFFULL
_POLICY_IDS = {"lru": 0, "priority": 0, "lfu": 1, "fifo": 2, "mru": 3, "filo": 4, "slru": 5}


cdef inline bint entry_less(const HeapEntry* a, const HeapEntry* b) noexcept nogil:
    if a.k0 != b.k0:
        return a.k0 < b.k0
    if a.k1 != b.k1:
        return a.k1 < b.k1
    if a.k2 != b.k2:
        return a.k2 < b.k2
    return a.k3 < b.k3


cdef inline bint entry_same_key(const HeapEntry* a, const HeapEntry* b) noexcept nogil:
    return a.k0 == b.k0 and a.k1 == b.k1 and a.k2 == b.k2 and a.k3 == b.k3


@cython.final
cdef class EvictionHeap:
    """Lazy min-heap of evictable leaves in policy order (see the pure core's class).

    Two containers, one order: a sorted run (a ring buffer) that takes every entry not
    below its last one, and a 4-ary heap for the rest; a pop takes the smaller front. With
    lru/fifo/priority a new leaf's key is nearly always the largest yet (the clock only
    rises), so most entries go through the run, whose pops touch memory in order; the heap
    keeps the out-of-order ones (re-pushes of touched leaves, lfu, mru). A 4-ary heap's
    children sit together (one or two cache lines), so a sift touches half the levels.
    """

    def __cinit__(self, str policy):
        self.policy = _POLICY_IDS[policy]
        self.items = NULL
        self.size = 0
        self.capacity = 0
        self.run = NULL
        self.run_head = 0
        self.run_size = 0
        self.run_cap = 0
        self.limit = 1024

    def __dealloc__(self):
        self.release()

    cdef void release(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.size):
            Py_DECREF(<object>self.items[i].node)
        for i in range(self.run_size):
            Py_DECREF(<object>self.run[(self.run_head + i) & (self.run_cap - 1)].node)
        PyMem_Free(self.items)
        PyMem_Free(self.run)
        self.items = NULL
        self.run = NULL
        self.size = 0
        self.capacity = 0
        self.run_head = 0
        self.run_size = 0
        self.run_cap = 0

    cdef void fill_key(self, Node n, HeapEntry* e) noexcept:
        cdef uint64_t priority = <uint64_t>n.priority + _BIAS
        cdef uint64_t access = <uint64_t>n.last_access_time
        cdef uint64_t created = <uint64_t>n.created_time
        cdef uint64_t node_id = <uint64_t>n.id
        e.k0 = priority
        e.k3 = 0
        if self.policy == 0:    # lru, priority
            e.k1 = access
            e.k2 = node_id
        elif self.policy == 1:  # lfu
            e.k1 = <uint64_t>n.hit_count
            e.k2 = access
            e.k3 = node_id
        elif self.policy == 2:  # fifo
            e.k1 = created
            e.k2 = node_id
        elif self.policy == 3:  # mru
            e.k1 = _MAX - access
            e.k2 = _MAX - node_id
        elif self.policy == 4:  # filo
            e.k1 = _MAX - created
            e.k2 = _MAX - node_id
        else:                   # slru: probationary (< 2 hits) segment first
            e.k1 = 1 if n.hit_count >= 2 else 0
            e.k2 = access
            e.k3 = node_id

    cdef inline HeapEntry* run_at(self, Py_ssize_t i) noexcept:
        return &self.run[(self.run_head + i) & (self.run_cap - 1)]

    cdef int add(self, const HeapEntry* entry) except -1:
        """Push ``entry``, taking a new reference to its node."""
        cdef Py_ssize_t i, parent, cap
        cdef HeapEntry* grown
        if self.run_size == 0 or not entry_less(entry, self.run_at(self.run_size - 1)):
            if self.run_size == self.run_cap:
                cap = 64 if self.run_cap == 0 else 2 * self.run_cap  # a power of two
                grown = <HeapEntry*>PyMem_Malloc(cap * sizeof(HeapEntry))
                if grown == NULL:
                    raise MemoryError()
                for i in range(self.run_size):
                    grown[i] = self.run_at(i)[0]
                PyMem_Free(self.run)
                self.run = grown
                self.run_head = 0
                self.run_cap = cap
            Py_INCREF(<object>entry.node)
            self.run_at(self.run_size)[0] = entry[0]
            self.run_size += 1
            return 0
        if self.size == self.capacity:
            grown = <HeapEntry*>PyMem_Realloc(
                self.items, (self.capacity * 2 + 64) * sizeof(HeapEntry))
            if grown == NULL:
                raise MemoryError()
            self.items = grown
            self.capacity = self.capacity * 2 + 64
        Py_INCREF(<object>entry.node)
        i = self.size
        self.size += 1
        while i > 0:
            parent = (i - 1) >> 2
            if not entry_less(entry, &self.items[parent]):
                break
            self.items[i] = self.items[parent]
            i = parent
        self.items[i] = entry[0]
        return 0

    cdef void sift_down(self, Py_ssize_t i) noexcept:
        cdef HeapEntry moving = self.items[i]
        cdef Py_ssize_t child, best, last
        while True:
            child = 4 * i + 1
            if child >= self.size:
                break
            best = child
            last = child + 4 if child + 4 <= self.size else self.size
            child += 1
            while child < last:
                if entry_less(&self.items[child], &self.items[best]):
                    best = child
                child += 1
            if not entry_less(&self.items[best], &moving):
                break
            self.items[i] = self.items[best]
            i = best
        self.items[i] = moving

    cdef bint take_front(self, HeapEntry* out) noexcept:
        """Remove the smallest entry into ``out`` (its reference moves to the caller)."""
        cdef bint from_run
        if self.run_size == 0 and self.size == 0:
            return False
        from_run = self.size == 0 or (self.run_size > 0
                                      and entry_less(self.run_at(0), &self.items[0]))
        if from_run:
            out[0] = self.run_at(0)[0]
            self.run_head = (self.run_head + 1) & (self.run_cap - 1)
            self.run_size -= 1
        else:
            out[0] = self.items[0]
            self.size -= 1
            if self.size > 0:
                self.items[0] = self.items[self.size]
                self.sift_down(0)
        return True

    def __len__(self):
        return self.size + self.run_size

    def clear(self):
        self.release()
        self.limit = 1024

    def key_of(self, Node node):
        cdef HeapEntry e
        self.fill_key(node, &e)
        return (e.k0, e.k1, e.k2, e.k3)

    def entries(self):
        """(stored key, node) of every entry (for consistency checks)."""
        cdef Py_ssize_t i
        cdef HeapEntry* e
        out = [((self.items[i].k0, self.items[i].k1, self.items[i].k2,
                 self.items[i].k3), <Node>self.items[i].node) for i in range(self.size)]
        for i in range(self.run_size):
            e = self.run_at(i)
            out.append(((e.k0, e.k1, e.k2, e.k3), <Node>e.node))
        return out

    def push(self, Node node):
        cdef HeapEntry e
        self.fill_key(node, &e)
        e.node = <PyObject*>node
        self.add(&e)
        if self.size + self.run_size > self.limit:
            self.compact()

    def pop_victim(self):
        cdef HeapEntry top, current
        cdef Node node
        while self.take_front(&top):
            node = <Node>top.node
            Py_DECREF(node)  # the heap's reference; ``node`` holds its own
            if node.evicted or node.n_children or node.lock_ref:
                continue  # pushed again if it becomes an evictable leaf
            self.fill_key(node, &current)
            if entry_same_key(&current, &top):
                return node
            if entry_less(&top, &current):  # touched since pushed: wait for its turn
                current.node = <PyObject*>node
                self.add(&current)
            # else: a fall in key always came with a fresh push
        return None

    cdef int compact(self) except -1:
        """Keep one usable entry per evictable leaf; amortised O(1) per push. The run is
        filtered in order (it stays sorted), the heap in place and then heapified."""
        cdef Py_ssize_t i, kept = 0, total = self.size + self.run_size
        cdef HeapEntry current
        cdef HeapEntry* e
        cdef HeapEntry* ordered
        cdef Node node
        best = {}  # node id -> position (heap first, then the run) of its smallest entry
        for i in range(total):
            e = &self.items[i] if i < self.size else self.run_at(i - self.size)
            node = <Node>e.node
            if node.evicted or node.n_children or node.lock_ref:
                continue
            self.fill_key(node, &current)
            if entry_less(&current, e):
                continue  # stored above current: discarded when popped anyway
            j = best.get(node.id)
            if j is None:
                best[node.id] = i
            else:
                other = &self.items[<Py_ssize_t>j] if j < self.size else self.run_at(
                    <Py_ssize_t>j - self.size)
                if entry_less(e, other):
                    best[node.id] = i
        keep = set(best.values())
        for i in range(self.size):  # in place: kept <= i throughout
            if i in keep:
                self.items[kept] = self.items[i]
                kept += 1
            else:
                Py_DECREF(<object>self.items[i].node)
        self.size = kept
        kept = 0
        ordered = self.run if self.run_head == 0 else NULL
        if ordered == NULL and self.run_size:
            ordered = <HeapEntry*>PyMem_Malloc(self.run_cap * sizeof(HeapEntry))
            if ordered == NULL:
                raise MemoryError()
            for i in range(self.run_size):
                ordered[i] = self.run_at(i)[0]
            PyMem_Free(self.run)
            self.run = ordered
            self.run_head = 0
        # A run entry's position in ``best`` was (heap size before) + its index.
        for i in range(self.run_size):
            if (total - self.run_size + i) in keep:
                self.run[kept] = self.run[i]
                kept += 1
            else:
                Py_DECREF(<object>self.run[i].node)
        self.run_size = kept
        if self.size > 1:  # (cdivision: (0 - 2) // 4 would be 0, not -1)
            for i in range((self.size - 2) // 4, -1, -1):
                self.sift_down(i)
        self.limit = max(1024, 2 * (self.size + self.run_size))
        return 0


# -- the per-cache core object: whole calls in one crossing --------------------------------
cdef extern from *:
    """
    /* Reads an exact int that fits in int64 without a call; 0 for anything else (a subclass,
       an __index__ object, a value out of range): the caller declines the input. */
    static inline int rc_read_int(PyObject* o, int64_t* out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject*)o)) {
            *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject*)o);
            return 1;
        }
    #else
        {
            Py_ssize_t size = Py_SIZE(o);
            const digit* d = ((PyLongObject*)o)->ob_digit;
            switch (size) {
            case 0: *out = 0; return 1;
            case 1: *out = (int64_t)d[0]; return 1;
            case -1: *out = -(int64_t)d[0]; return 1;
            case 2: *out = (int64_t)d[0] | ((int64_t)d[1] << PyLong_SHIFT); return 1;
            case -2: *out = -((int64_t)d[0] | ((int64_t)d[1] << PyLong_SHIFT)); return 1;
            default: break;
            }
        }
    #endif
        {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow) return 0;
            if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
            *out = (int64_t)v;
            return 1;
        }
    }

    /* The returned index tensor in one allocation and one copy: a DLPack capsule over a
       malloc'd block (header, then the int64 data) that torch takes over; its deleter frees
       the block when the tensor dies (from any thread: plain malloc/free). */
    typedef struct { int32_t device_type; int32_t device_id; } rc_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } rc_DLDataType;
    typedef struct {
        void* data; rc_DLDevice device; int32_t ndim; rc_DLDataType dtype;
        int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } rc_DLTensor;
    typedef struct rc_DLManagedTensor {
        rc_DLTensor dl_tensor; void* manager_ctx; void (*deleter)(struct rc_DLManagedTensor*);
    } rc_DLManagedTensor;
    typedef struct { rc_DLManagedTensor managed; int64_t shape[1]; int64_t strides[1]; } rc_dl_head;

    static void rc_dl_deleter(rc_DLManagedTensor* self) { free(self->manager_ctx); }

    static void rc_dl_capsule_destructor(PyObject* capsule) {
        /* Still named "dltensor": torch never took it (an error came first). */
        if (PyCapsule_IsValid(capsule, "dltensor")) {
            rc_DLManagedTensor* m = (rc_DLManagedTensor*)PyCapsule_GetPointer(capsule, "dltensor");
            m->deleter(m);
        }
    }

    static PyObject* rc_int64_capsule(Py_ssize_t n, int64_t** data) {
        size_t head = (sizeof(rc_dl_head) + 63) & ~(size_t)63;
        char* mem = (char*)malloc(head + (size_t)(n > 0 ? n : 1) * sizeof(int64_t));
        rc_dl_head* h;
        PyObject* capsule;
        if (mem == NULL) { PyErr_NoMemory(); return NULL; }
        h = (rc_dl_head*)mem;
        h->shape[0] = n;
        h->strides[0] = 1;
        h->managed.dl_tensor.data = mem + head;
        h->managed.dl_tensor.device.device_type = 1;  /* kDLCPU */
        h->managed.dl_tensor.device.device_id = 0;
        h->managed.dl_tensor.ndim = 1;
        h->managed.dl_tensor.dtype.code = 0;          /* kDLInt */
        h->managed.dl_tensor.dtype.bits = 64;
        h->managed.dl_tensor.dtype.lanes = 1;
        h->managed.dl_tensor.shape = h->shape;
        h->managed.dl_tensor.strides = h->strides;
        h->managed.dl_tensor.byte_offset = 0;
        h->managed.manager_ctx = mem;
        h->managed.deleter = rc_dl_deleter;
        capsule = PyCapsule_New(&h->managed, "dltensor", rc_dl_capsule_destructor);
        if (capsule == NULL) { free(mem); return NULL; }
        *data = (int64_t*)(mem + head);
        return capsule;
    }

    /* A result object (MatchResult/InsertResult: __slots__ classes) with its slots filled,
       without running Python-level __init__. */
    static PyObject* rc_make_result(PyObject* type, PyObject* n0, PyObject* v0,
                                    PyObject* n1, PyObject* v1, PyObject* n2, PyObject* v2) {
        PyObject* obj = ((PyTypeObject*)type)->tp_alloc((PyTypeObject*)type, 0);
        if (obj == NULL) return NULL;
        if (PyObject_GenericSetAttr(obj, n0, v0) < 0 || PyObject_GenericSetAttr(obj, n1, v1) < 0
                || (n2 != NULL && PyObject_GenericSetAttr(obj, n2, v2) < 0)) {
            Py_DECREF(obj);
            return NULL;
        }
        return obj;
    }
    """
    bint rc_read_int(PyObject* o, int64_t* out) noexcept
    object rc_int64_capsule(Py_ssize_t n, int64_t** data)
    object rc_make_result(object type, object n0, object v0, object n1, object v1,
                          PyObject* n2, PyObject* v2)

cdef extern from "Python.h":
    int PyGC_Enable() noexcept
    void PyErr_Clear() noexcept
    int PyGC_Disable() noexcept
    Py_ssize_t PyList_GET_SIZE(object) noexcept
    Py_ssize_t PyTuple_GET_SIZE(object) noexcept

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uintptr_t

import array as _array_module

from ._shared import EMPTY_INDICES as _EMPTY_INDICES
from ._shared import KEY_FALLS_ON_ACCESS as _KEY_FALLS_ON_ACCESS
from ._shared import InsertResult as _InsertResult
from ._shared import MatchResult as _MatchResult

_ndarray = np.ndarray
_array_type = _array_module.array
_Tensor = torch.Tensor
_int32 = torch.int32
_mode_enabled = torch._C._is_torch_function_mode_enabled
_from_dlpack = torch._C._from_dlpack
cdef object _N_INDICES = "indices"
cdef object _N_LAST_NODE = "last_node"
cdef object _N_LENGTH = "length"
cdef object _N_PREFIX_LEN = "prefix_len"


cdef inline void release_input(InputBuf* b) noexcept:
    if b.has_view:
        b.has_view = False
        PyBuffer_Release(&b.view)


cdef inline bint int64_format(const char* fmt) noexcept:
    if fmt == NULL:
        return False
    if fmt[0] == b'<' or fmt[0] == b'=' or fmt[0] == b'@':
        fmt += 1
    return (fmt[0] == b'q' or (fmt[0] == b'l' and sizeof(long) == 8)) and fmt[1] == 0


cdef class Core:
    """One cache's tree, eviction heap, sizes and counters, and its whole-call operations
    (the interface is specified in ``_core_py``'s docstring)."""

    def __cinit__(self, Py_ssize_t page_size, str policy):
        self.page_size = page_size
        self.tree = Tree(page_size)
        self.heap = EvictionHeap(policy)
        self.push_on_access = policy in _KEY_FALLS_ON_ACCESS
        self.new_leaf = None
        self.tokens_buf = NULL
        self.tokens_cap = 0
        self.kv_buf = NULL
        self.kv_cap = 0
        self.path = NULL
        self.path_cap = 0

    def __dealloc__(self):
        PyMem_Free(self.tokens_buf)
        PyMem_Free(self.kv_buf)
        PyMem_Free(self.path)

    def reset_stats(self):
        self.lookups = self.matched_tokens = self.queried_tokens = 0
        self.inserts = self.inserted_tokens = self.evictions = self.evicted_tokens = 0
        self.tree.num_splits = 0

    def reset(self):
        self.enter()
        try:
            self.tree.reset()
            self.heap.clear()
            self.evictable = 0
            self.protected = 0
            self.new_leaf = None
            self.device_values = False
            self.reset_stats()
        finally:
            self.busy = False

    cdef int enter(self) except -1:
        if self.busy:
            raise RuntimeError(
                "RadixCache called again while one of its calls is still running (from "
                "__index__, __hash__/__eq__, a torch hook, a finalizer or another thread); "
                "serialise calls to a cache")
        self.busy = True
        return 0

    # -- inputs ----------------------------------------------------------------------------
    cdef int64_t* scratch(self, bint for_kv, Py_ssize_t n) except NULL:
        cdef int64_t* grown
        cdef Py_ssize_t cap = self.kv_cap if for_kv else self.tokens_cap
        if n > cap or cap == 0:
            cap = max(n, 2 * cap, 64)
            grown = <int64_t*>PyMem_Realloc(self.kv_buf if for_kv else self.tokens_buf,
                                            cap * sizeof(int64_t))
            if grown == NULL:
                raise MemoryError()
            if for_kv:
                self.kv_buf = grown
                self.kv_cap = cap
            else:
                self.tokens_buf = grown
                self.tokens_cap = cap
        return self.kv_buf if for_kv else self.tokens_buf

    cdef int acquire(self, object obj, InputBuf* b, bint for_kv, bint private) except -1:
        """Point ``b`` at ``obj`` as int64: 1, or 0 to decline (an unusual input, or one
        that would fail: the Python path validates it). Reads a list's exact ints without a
        call; takes a buffer of an int64 numpy array or array('q'); reads a CPU int64
        tensor's data pointer (only with no torch function mode active, so that its
        accessors run no Python code). ``private``: copy into the core's own buffer."""
        cdef Py_ssize_t i, n
        cdef PyObject** items
        cdef int64_t* out
        cdef object kind = type(obj)
        b.has_view = False
        if kind is list or kind is tuple:
            n = PyList_GET_SIZE(obj) if kind is list else PyTuple_GET_SIZE(obj)
            out = self.scratch(for_kv, n)
            items = PySequence_Fast_ITEMS(obj)
            for i in range(n):
                if not rc_read_int(items[i], &out[i]):
                    return 0
            b.ptr = out
            b.n = n
            return 1
        if kind is _ndarray or kind is _array_type:
            try:
                PyObject_GetBuffer(obj, &b.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
            except (ValueError, BufferError, TypeError):
                return 0
            b.has_view = True
            if b.view.ndim != 1 or b.view.itemsize != 8 or not int64_format(b.view.format):
                release_input(b)
                return 0
            b.ptr = <const int64_t*>b.view.buf
            b.n = b.view.shape[0]
        elif kind is _Tensor:
            if _mode_enabled():
                return 0
            if (not obj.is_cpu or obj.dtype is not _int64 or obj.dim() != 1
                    or not obj.is_contiguous()):
                return 0
            b.n = obj.numel()
            b.ptr = <const int64_t*><uintptr_t>obj.data_ptr()
        else:
            return 0
        if private:
            out = self.scratch(for_kv, b.n)
            if b.n:
                memcpy(out, b.ptr, b.n * sizeof(int64_t))
            release_input(b)
            b.ptr = out
        return 1

    cdef int64_t namespace(self, object extra_key, bint create) except -2:
        """Namespace id; -1 unknown, -3 unhashable (declined). Runs the key's __hash__ and
        __eq__, so it comes before any buffer is taken."""
        if extra_key is None:
            return 0
        try:
            return self.tree.namespace_of(extra_key, create)
        except TypeError:
            return -3

    # -- results ---------------------------------------------------------------------------
    cdef object match_result(self, object indices, object node, Py_ssize_t length):
        cdef object n = length
        return rc_make_result(_MatchResult, _N_INDICES, indices, _N_LAST_NODE, node,
                              <PyObject*>_N_LENGTH, <PyObject*>n)

    cdef object insert_result(self, Py_ssize_t prefix_len, object node):
        return rc_make_result(_InsertResult, _N_PREFIX_LEN, prefix_len, _N_LAST_NODE, node,
                              NULL, NULL)

    cdef int push_if_evictable(self, Node node) except -1:
        cdef HeapEntry e
        if node.n_children or node.lock_ref or node.evicted or node is self.tree.root:
            return 0
        self.heap.fill_key(node, &e)
        e.node = <PyObject*>node
        self.heap.add(&e)
        if self.heap.size + self.heap.run_size > self.heap.limit:
            self.heap.compact()
        return 0

    cdef int note_path(self, Py_ssize_t depth, Node node) except -1:
        cdef PyObject** grown
        cdef Py_ssize_t cap
        if depth >= self.path_cap:
            cap = max(64, 2 * self.path_cap)
            grown = <PyObject**>PyMem_Realloc(self.path, cap * sizeof(PyObject*))
            if grown == NULL:
                raise MemoryError()
            self.path = grown
            self.path_cap = cap
        self.path[depth] = <PyObject*>node
        return 0

    # -- whole calls -----------------------------------------------------------------------
    def match(self, tokens, extra_key=None):
        cdef InputBuf b
        cdef int64_t ns = self.namespace(extra_key, False)
        cdef Py_ssize_t end, pos = 0, common, depth = 0, i, total
        cdef int64_t now
        cdef int gc_was = 0
        cdef bint device = False
        cdef Node node, child
        cdef char* out
        if ns == -3:
            return None
        self.enter()
        try:
            if not self.acquire(tokens, &b, False, self.device_values):
                return None
            # No Python code may run while b points into the caller's memory: no calls out,
            # and no collection (a finalizer could free a tensor's storage).
            gc_was = PyGC_Disable()
            try:
                end = b.n - b.n % self.page_size
                self.lookups += 1
                self.queried_tokens += end
                if end == 0:
                    return self.match_result(_EMPTY_INDICES, self.tree.root, 0)
                self.tree.clock += 1
                now = self.tree.clock
                node = self.tree.root
                node.last_access_time = now
                if ns >= 0:
                    while pos < end:
                        child = self.tree.descend(node, b.ptr + pos, end - pos, ns, &common)
                        if child is None:
                            break
                        child.last_access_time = now
                        self.note_path(depth, child)
                        depth += 1
                        pos += common
                        node = child
            finally:
                release_input(&b)
            if depth == 0:
                if gc_was:
                    PyGC_Enable()
                    gc_was = 0
                return self.match_result(_EMPTY_INDICES, self.tree.root, 0)
            self.matched_tokens += pos
            if self.push_on_access:
                self.push_if_evictable(node)
            for i in range(depth):
                child = <Node>self.path[i]
                if child.value_ptr == NULL and child.value_owner is not None:
                    device = True
                    break
            if device:
                path = [<Node>self.path[i] for i in range(depth)]
            else:
                buf = rc_int64_capsule(pos, <int64_t**>&out)
                total = 0
                for i in range(depth):
                    child = <Node>self.path[i]
                    memcpy(out + total,
                           child.value_ptr if child.value_ptr != NULL else child.key_ptr,
                           child.key_len * sizeof(int64_t))
                    total += child.key_len * sizeof(int64_t)
            if gc_was:
                PyGC_Enable()
                gc_was = 0
            indices = _cat_values(path) if device else _from_dlpack(buf)
            return self.match_result(indices, node, pos)
        finally:
            if gc_was:
                PyGC_Enable()
            self.busy = False

    def insert(self, tokens, kv=None, extra_key=None, priority=0, bint checked=False):
        cdef InputBuf b, v
        cdef int64_t prio, ns, now
        cdef Py_ssize_t end, pos = 0, common, prefix_len, expected = -1
        cdef int gc_was = 0
        cdef bint whole, device_kv = False, private
        cdef Node node, child, leaf = None
        cdef object piece = None
        if type(priority) is not int:
            return None
        try:
            prio = PyLong_AsLongLong(priority)
        except OverflowError:
            return None
        ns = self.namespace(extra_key, False)
        if ns == -3 or (ns == -1 and not checked):
            return None  # a new namespace is made on the validated call, before any buffer
        if ns == -1:
            ns = self.namespace(extra_key, True)
        if kv is not None and type(kv) is _Tensor and not _mode_enabled() and not kv.is_cpu:
            # Device values are sliced on their device (a call out): only after validation.
            if not checked:
                return None
            device_kv = True
        self.enter()
        b.has_view = False
        v.has_view = False
        try:
            # With device values torch runs mid-call (slicing, GIL released): own copies then.
            private = self.device_values or device_kv
            if not self.acquire(tokens, &b, False, private):
                return None
            end = b.n - b.n % self.page_size
            whole = end == b.n
            if kv is not None and not device_kv:
                if not self.acquire(kv, &v, True, private) or v.n < end:
                    release_input(&b)
                    release_input(&v)
                    return None
            if device_kv and end:
                expected = self.walk_length(b.ptr, end, ns)
                piece = kv[expected:end].to(_int64, copy=True)
                self.device_values = True
            node = self.tree.root
            self.inserts += 1
            self.new_leaf = None
            if end == 0:
                release_input(&b)
                release_input(&v)
                if whole:
                    self.tree.empty_inserted.add(extra_key)
                return self.insert_result(0, node)
            if not self.device_values:
                gc_was = PyGC_Disable()
            try:
                self.tree.clock += 1
                now = self.tree.clock
                node.last_access_time = now
                while pos < end:
                    child = self.tree.descend(node, b.ptr + pos, end - pos, ns, &common)
                    if child is None:
                        break
                    child.last_access_time = now
                    child.hit_count += 1
                    if prio > child.priority:
                        child.priority = prio
                    pos += common
                    node = child
                prefix_len = pos
                if pos < end:
                    if device_kv and expected != pos:
                        raise RuntimeError("the tree changed during an insert")
                    leaf = self.tree.new_node(node, now)
                    leaf.key_owner = PyBytes_FromStringAndSize(<const char*>(b.ptr + pos),
                                                               (end - pos) * sizeof(int64_t))
                    leaf.key_ptr = <const int64_t*>PyBytes_AS_STRING(leaf.key_owner)
                    leaf.key_len = end - pos
                    if device_kv:
                        leaf.value_owner = piece
                    elif kv is not None:
                        leaf.value_owner = PyBytes_FromStringAndSize(
                            <const char*>(v.ptr + pos), (end - pos) * sizeof(int64_t))
                        leaf.value_ptr = <const int64_t*>PyBytes_AS_STRING(leaf.value_owner)
                    leaf.priority = prio
                    leaf.hit_count = 1
                    leaf.ns = ns
                    leaf.extra_key = extra_key
                    node.add_child(leaf, self.tree.page_hash(leaf.key_ptr, ns))
                    self.tree.node_count += 1
                    node = leaf
                if whole:
                    node.terminal = True
            finally:
                release_input(&b)
                release_input(&v)
            if leaf is not None:
                self.new_leaf = leaf
                self.evictable += leaf.key_len
                self.inserted_tokens += leaf.key_len
                self.push_if_evictable(leaf)
            elif self.push_on_access:
                self.push_if_evictable(node)
        finally:
            if gc_was:
                PyGC_Enable()
            self.busy = False
        return self.insert_result(prefix_len, node)

    def exists(self, tokens, extra_key=None):
        cdef InputBuf b
        cdef int64_t ns = self.namespace(extra_key, False)
        cdef Py_ssize_t n, pos = 0, klen
        cdef Py_ssize_t page_size = self.page_size
        cdef int gc_was
        cdef Node node, child
        cdef bint found = False
        if ns == -3:
            return None
        self.enter()
        try:
            if not self.acquire(tokens, &b, False, self.device_values):
                return None
            n = b.n
            if n == 0 or n % page_size or ns < 0:
                release_input(&b)
                if n == 0:
                    return extra_key in self.tree.empty_inserted
                return False
            gc_was = PyGC_Disable()
            node = self.tree.root
            found = True
            while pos < n:
                child = node.find_child(b.ptr + pos, page_size,
                                        self.tree.page_hash(b.ptr + pos, ns))
                if child is None:
                    found = False
                    break
                klen = child.key_len
                if klen > n - pos or memcmp(child.key_ptr, b.ptr + pos,
                                            klen * sizeof(int64_t)) != 0:
                    found = False
                    break
                pos += klen
                node = child
            found = found and node.terminal
            release_input(&b)
            if gc_was:
                PyGC_Enable()
            return found
        finally:
            self.busy = False

    cdef Py_ssize_t walk_length(self, const int64_t* buf, Py_ssize_t end, int64_t ns) noexcept:
        """Read-only: the cached page-aligned prefix length of buf[:end] (no split)."""
        cdef Py_ssize_t pos = 0, klen, same
        cdef Py_ssize_t page_size = self.page_size
        cdef Node node = self.tree.root
        cdef Node child
        if ns < 0:
            return 0
        while pos < end:
            child = node.find_child(buf + pos, page_size, self.tree.page_hash(buf + pos, ns))
            if child is None:
                break
            klen = child.key_len
            if klen <= end - pos and memcmp(child.key_ptr, buf + pos,
                                            klen * sizeof(int64_t)) == 0:
                pos += klen
                node = child
                continue
            same = common_prefix(child.key_ptr, buf + pos, klen if klen < end - pos else end - pos)
            pos += same - same % page_size
            break
        return pos

    def walk(self, tokens, extra_key=None):
        cdef InputBuf b
        cdef int64_t ns = self.namespace(extra_key, False)
        cdef Py_ssize_t length
        self.enter()
        try:
            if not self.acquire(tokens, &b, False, True):
                raise TypeError("walk takes the common token inputs only")
            length = self.walk_length(b.ptr, b.n - b.n % self.page_size, ns)
            release_input(&b)
            return length
        finally:
            self.busy = False

    # -- locks and eviction ----------------------------------------------------------------
    def lock(self, node, int delta):
        cdef Py_ssize_t moved
        self.enter()
        try:
            moved = self.tree.lock(node, delta)
            if delta > 0:
                self.evictable -= moved
                self.protected += moved
            elif moved:
                self.evictable += moved
                self.protected -= moved
                # Only the bottom node can have become an evictable leaf.
                self.push_if_evictable(<Node>node)
            return moved
        finally:
            self.busy = False

    def pop_victim(self):
        self.enter()
        try:
            return self.heap.pop_victim()
        finally:
            self.busy = False

    def remove_leaf(self, Node node):
        cdef Py_ssize_t size = node.key_len
        self.enter()
        try:
            parent = self.tree.remove_leaf(node)
            self.evictable -= size
            self.evictions += 1
            self.evicted_tokens += size
            self.push_if_evictable(<Node>parent)
            return size
        finally:
            self.busy = False

    def set_value(self, Node node, values):
        self.enter()
        try:
            if not isinstance(values, np.ndarray):
                self.device_values = True
            self.tree.set_value(node, values)
        finally:
            self.busy = False

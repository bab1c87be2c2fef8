# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, binding=True
"""Compiled radix tree core: the same interface as ``_core_py`` (see its docstring).

Keys are int64 runs inside bytes objects (split halves share one at different offsets);
children sit in a per-node open-addressing table keyed by a hash of (namespace, first page),
so a walk step boxes no Python int. ``Core`` (one per cache) does each API call whole: the
caller's tokens become one int64 buffer (a list's exact ints read without a call, an int64
buffer or CPU int64 tensor borrowed), the walk, sizes, counters, heap pushes and the result;
an unusual input is declined, untouched, to cache.py's validation. The index arrays it makes
are torch tensors or, for a core made with ``numpy_arrays``, numpy arrays over the same
one-allocation blocks; only a tensor core imports torch (torch's names are bound here when
some code loads it).

Python code can run inside any call: a token's ``__index__``, an extra_key's
``__hash__``/``__eq__``, torch hooks, and finalizers set off by a DECREF or by a collection
that allocating a node triggers (which can also let another thread run). So:

- every entry point holds the tree's ``Guard`` (shared with its heap and the Core): a nested
  call raises ``RuntimeError`` instead of changing what the call relies on;
- a borrowed pointer into a caller's object is never read after Python code may have run
  (tokens read from a list are exact ints only -- anything else is declined to cache.py --;
  a borrowed buffer is copied when an extra_key will be hashed, and otherwise read only
  before the call's first allocation of a tracked object);
- a tensor's facts (device, dtype, layout, size, address) come from torch.Tensor's own
  accessors, never the instance's attributes, which code can set (``t.data_ptr = ...``);
- a split calls nothing (device values are shared with an offset, not sliced);
- structure first, references released after: no DECREF in the middle of an update of a
  child table or the heap, and teardown never recurses;
- nodes are visible to the garbage collector (children included), so cycles through the
  objects they hold are collected.

Why one module (3,000 lines) when every other file stays near 1,200: the hot paths -- a
walk step, a split, an insert, a pop and removal in the evict loop -- call the child-table,
node and heap helpers (``probe``, ``slot_of``, ``add_child``, ``detach_leaf``, the heap's
sifts) as plain C calls, many of them inlined, and read each other's fields directly. Across two Cython
modules those calls would go through a function-pointer table imported at load time (never
inlined), and a ``cdef class``'s methods through its vtable; the walk and the evict loop
would pay for it on every node. So the tree, the heap, ``Core`` and the index-array glue
stay here; their C lives in ``_include/*.h`` and what serves other modules (the block index,
the page hashes) in ``_blocks_c``.
"""

cimport cython
from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES,
                             PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_SetName
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport INT64_MAX, int64_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy, memset

from collections import deque as _deque

import numpy as np

from ._errors import (bad_rank, bad_session, lock_host_only, node_not_copyable, rank_needs_one_tier,
                      reentered, stale_match)
from ._handover import hand_over_batch as _hand_over_batch
from ._handover import answer_not_kept, host_indices_bytes
from ._handover import page_ids as _page_ids
from ._options import KEY_FALLS_ON_ACCESS as _KEY_FALLS_ON_ACCESS
from ._state import check_state, display_order, id_order
from ._torch import cat_tensors as _cat_tensors
from ._torch import indices_from_key
from ._torch import is_tensor as _is_tensor
from ._torch import load_torch as _load_torch
from ._torch import on_torch as _on_torch
from ._types import MAX_LOCK_REF, RadixTreeNode
from ._types import InsertResult as _InsertResult
from ._types import MatchResult as _MatchResult

try:  # a BlockIndex pickled while the block index lived in this module names its loader here
    from ._blocks_c import _block_index_from
except ImportError:  # the block module was not built: no such pickle can load anyway
    pass

CORE_NAME = "c"

cdef int64_t _next_id = 0
# Child tables: a power-of-two capacity from 2; filled up to slot_limit (a table of two may
# be full, so every probe loop is bounded by the capacity).
cdef Py_ssize_t _MIN_SLOTS = 2
cdef Py_ssize_t _MAX_SLOTS = 1 << 30
cdef int32_t _MAX_LOCK_REF = MAX_LOCK_REF  # lock_ref is 32-bit here (2^31 - 1)
# ChildSlot.shape's key length of a key too long for its 27 bits: the walk reads the node's.
cdef uint32_t _LONG_KEY = (1u << 27) - 1
# Grow the first memcmp block by doubling up to this many tokens: early mismatches stay
# cheap, long matches run at memcmp speed.
cdef Py_ssize_t _MAX_BLOCK = 4096
# read_query's answer for an input the core leaves to cache.py's validation.
cdef int64_t _DECLINED = -2
# How many pops ahead an evict loop starts reading a victim's node, its key and parent, and
# its parent's slot.
cdef Py_ssize_t _AHEAD_NODE = 12
cdef Py_ssize_t _AHEAD_KEY = 6
cdef Py_ssize_t _AHEAD_SLOT = 2
_INT64_FORMATS = frozenset((b"q", b"l", b"<q", b"=q", b"<l", b"=l"))


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


# page_hash's weights: odd (the first odd, the step even), distinct for every position.
cdef uint64_t _HASH_WEIGHT = 0x9e3779b97f4a7c15ULL
cdef uint64_t _HASH_STEP = 0x6a09e667f3bcc90aULL


cdef inline Py_ssize_t slot_limit(Py_ssize_t capacity) noexcept nogil:
    # Full for two slots, three quarters above: 24-byte slots (with mirrors) cost what
    # 16-byte ones at half load did.
    return capacity if capacity <= 2 else capacity - (capacity >> 2)


cdef extern from "rc_platform.h":
    uint32_t rc_log2(Py_ssize_t power_of_two) noexcept nogil
    void rc_prefetch(const void* p) noexcept nogil


cdef inline uint32_t slot_shape(Node child) noexcept:
    """``child``'s key length and table size as its parent's slot mirrors them."""
    cdef uint32_t length = (<uint32_t>child.key_len if child.key_len < <Py_ssize_t>_LONG_KEY
                            else _LONG_KEY)
    if child.slots == NULL:
        return length
    return length | (rc_log2(child.slot_mask + 1) << 27)


cdef inline Py_ssize_t shape_mask(uint32_t shape) noexcept nogil:
    return (<Py_ssize_t>1 << (shape >> 27)) - 1


cdef inline bint same_page(const int64_t* a, const int64_t* b, Py_ssize_t n) noexcept nogil:
    # Pages are short: a loop beats a call to memcmp.
    cdef Py_ssize_t i
    for i in range(n):
        if a[i] != b[i]:
            return False
    return True


cdef inline ChildSlot* probe(ChildSlot* table, Py_ssize_t mask, const int64_t* page,
                           Py_ssize_t page_size, uint64_t h, int64_t ns,
                           bint mixed) noexcept:
    """The slot of ``table`` whose child starts with ``page`` in namespace ``ns`` (hash
    ``h``), or NULL. The namespace is compared, not trusted to the hash: the slot keeps 32
    bits of it, and the root's table mixes namespaces (two of them whose hashes of one first
    page agree in those bits would otherwise find each other's nodes). ``mixed``: the table
    may hold several namespaces (the root's); below the root a subtree has one."""
    cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>mask)
    cdef Py_ssize_t tries
    cdef ChildSlot* slot
    for tries in range(mask + 1):
        slot = &table[i]
        if slot.node == NULL:
            return NULL
        if (slot.hash == <uint32_t>h and (not mixed or (<Node>slot.node).ns == ns)
                and same_page((<Node>slot.node).key_ptr, page, page_size)):
            return slot
        i = (i + 1) & mask
    return NULL


cdef ChildSlot* table_probe(ChildSlot* table, Py_ssize_t mask, const int64_t* page,
                            Py_ssize_t page_size, uint64_t h, int64_t ns,
                            bint mixed) noexcept:
    """``probe`` for the hybrid core (another module: no inline call there)."""
    return probe(table, mask, page, page_size, h, ns, mixed)


cdef extern from "rc_ints.h":
    bint rc_read_int(PyObject* o, int64_t* out) noexcept
    int rc_copy_outside(int64_t* out, const int64_t* ids, Py_ssize_t n,
                        int64_t bound) noexcept nogil


cdef inline Py_ssize_t common_prefix(const int64_t* a, const int64_t* b,
                                     Py_ssize_t n) noexcept nogil:
    """Length of the common prefix of a[:n] and b[:n]: memcmp blocks of growing size (the
    last one cut to what is left); the block that differs is halved down to 16 tokens (one
    memcmp per halving), and only those are compared one by one."""
    cdef Py_ssize_t i = 0, half
    cdef Py_ssize_t block = 16, size
    while i < n:
        size = block if block < n - i else n - i
        if memcmp(a + i, b + i, <size_t>size * sizeof(int64_t)) != 0:
            while size > 16:
                half = size >> 1
                if memcmp(a + i, b + i, <size_t>half * sizeof(int64_t)) == 0:
                    i += half
                    size -= half
                else:
                    size = half
            break
        i += size
        if block < _MAX_BLOCK:
            block *= 2
    while i < n and a[i] == b[i]:
        i += 1
    return i


cdef extern from "Python.h":
    # Borrowed-pointer spelling: the conversion loop never touches reference counts.
    PyObject** PySequence_Fast_ITEMS(object)



# -- re-entrancy guard ---------------------------------------------------------------------
@cython.final
cdef class Guard:
    """Set while a call into a tree or its heap runs; a nested call raises RuntimeError."""

    cdef int enter(self, str what) except -1:
        if self.busy:
            raise reentered(what)
        self.busy = 1
        return 0

    # The same protocol as the pure core's lock-based Guard, for the cache layer's own guard:
    # test-and-set under the GIL, so two threads cannot both take it.
    def acquire(self, bint blocking=False):
        """Take the guard if it is free (never waits); True if taken."""
        if self.busy:
            return False
        self.busy = 1
        return True

    def release(self):
        self.busy = 0


# -- a caller's int64 buffer ---------------------------------------------------------------
cdef int borrow_buffer(object values, TokenBuf* tb, str what) except -1:
    """Point ``tb`` at a caller's 1-D contiguous int64 buffer; ``release_tokens`` gives it
    back. Read it before anything that can run Python code (an allocation of a tracked
    object can): a numpy array can be resized under a held buffer."""
    try:
        PyObject_GetBuffer(values, &tb.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(f"{what} must be 1-D contiguous int64: {exc}") from None
    tb.held = True
    if (tb.view.ndim != 1 or tb.view.itemsize != 8
            or (tb.view.format != NULL and <bytes>tb.view.format not in _INT64_FORMATS)):
        release_tokens(tb)
        raise TypeError(f"{what} must be 1-D contiguous int64")
    tb.ptr = <const int64_t*>tb.view.buf
    tb.len = tb.view.shape[0]
    return 0


cdef inline void release_tokens(TokenBuf* tb) noexcept:
    if tb.held:
        tb.held = False
        PyBuffer_Release(&tb.view)


cdef void release_buffer(TokenBuf* tb) noexcept:
    """``release_tokens`` for the hybrid core."""
    release_tokens(tb)


# -- nodes ---------------------------------------------------------------------------------
cdef inline const int64_t* host_data(HostNode node) noexcept:
    """A node's host indices (key_len of them), or NULL when it has no host copy."""
    if node.host_owner is None:
        return NULL
    return <const int64_t*>PyBytes_AS_STRING(node.host_owner)


cdef void drop_subtree(Node top) noexcept:
    """Empty ``top``'s child table and release its descendants (marked evicted) without
    recursion: a node's children move onto a stack before its table goes, so no DECREF ever
    frees a node that still has children (that would recurse once per level)."""
    cdef Node node = top
    cdef Py_ssize_t i
    cdef PyObject* child
    stack = []
    while True:
        if node.slots != NULL:
            for i in range(node.slot_mask + 1):
                child = node.slots[i].node
                if child != NULL:
                    stack.append(<Node>child)
                    node.slots[i].node = NULL
                    (<Node>child).parent_ptr = NULL
                    Py_DECREF(<object>child)  # the table's reference; the stack holds one
            PyMem_Free(node.slots)
            node.slots = NULL
            node.slot_mask = -1
            node.n_children = 0
            if node is top:
                mirror(top)  # a parent's slot must not keep the freed table (children or not)
        if not stack:
            break
        node = <Node>stack.pop()  # the previous node goes here: it has no children left
        node.evicted = True
        node.value_ptr = NULL
        node.value_owner = None
        if type(node) is HostNode:
            (<HostNode>node).host_owner = None


@cython.no_gc_clear  # a generated tp_clear would drop key_owner under key_ptr
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
        self.value_off = 0

    def __dealloc__(self):
        if self.slots != NULL:
            drop_subtree(self)

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
        cdef Py_ssize_t start = self.value_off, length = self.key_len
        if self.evicted or (type(self) is HostNode and (<HostNode>self).host_only):
            return None
        if self.value_ptr != NULL:
            base = <const int64_t*>PyBytes_AS_STRING(self.value_owner)
            return indices_from_key(np.frombuffer(
                self.value_owner, dtype=np.int64, count=length,
                offset=(self.value_ptr - base) * sizeof(int64_t)), self.numpy_arrays)
        owner = self.value_owner
        if owner is not None:
            # Always a new view (split halves share the tensor): what the caller does to
            # its shape (resize_, set_) never reaches the tensor the tree reads.
            return owner[start:start + length]
        return indices_from_key(self.key, self.numpy_arrays)

    @property
    def on_device(self):
        return True

    @property
    def host_value(self):
        return None

    @property
    def tier(self):
        return "device"

    @property
    def terminal(self):
        return bool(self.is_terminal)

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

    def __reduce_ex__(self, protocol):
        raise node_not_copyable()


@cython.final
@cython.no_gc_clear  # as Node's
cdef class HostNode(Node):
    """A node of a compiled core with a host tier."""

    @property
    def on_device(self):
        return not self.host_only

    @property
    def host_value(self):
        if self.host_owner is None or self.evicted:
            return None
        return block_tensor(host_data(self), self.key_len, self.numpy_arrays)

    @property
    def tier(self):
        if self.host_only:
            return "host"
        return "device" if self.host_owner is None else "device+host"


# -- child tables: functions, not methods, so that a Node carries no vtable pointer -----
cdef int grow(Node node) except -1:
    cdef Py_ssize_t old_cap = node.slot_mask + 1
    cdef Py_ssize_t new_cap = _MIN_SLOTS if old_cap == 0 else old_cap * 2
    cdef ChildSlot* old = node.slots
    cdef ChildSlot* fresh
    cdef Py_ssize_t i, j
    if new_cap > _MAX_SLOTS:
        raise MemoryError(f"node {node.id}: more than {_MAX_SLOTS // 2} children")
    fresh = <ChildSlot*>PyMem_Malloc(new_cap * sizeof(ChildSlot))
    if fresh == NULL:
        raise MemoryError()
    memset(fresh, 0, new_cap * sizeof(ChildSlot))
    for i in range(old_cap):
        if old[i].node != NULL:
            j = <Py_ssize_t>(old[i].hash & <uint32_t>(new_cap - 1))
            while fresh[j].node != NULL:
                j = (j + 1) & (new_cap - 1)
            fresh[j] = old[i]
    PyMem_Free(old)
    node.slots = fresh
    node.slot_mask = <int32_t>(new_cap - 1)
    mirror(node)
    return 0


cdef void mirror(Node node) noexcept:
    """Copy this node's table, mask and key length into its slot in its parent's table
    (after any change of them while attached)."""
    cdef Node parent
    cdef ChildSlot* slot
    if node.parent_ptr == NULL:
        return
    parent = <Node>node.parent_ptr
    slot = &parent.slots[slot_of(parent, node, node.slot_hash)]
    slot.table = node.slots
    slot.shape = slot_shape(node)


cdef int add_child(Node node, Node child, uint64_t h) except -1:
    """Adds ``child`` taking a new reference (the table's own)."""
    cdef Py_ssize_t i
    cdef ChildSlot* slot
    if node.n_children + 1 > slot_limit(node.slot_mask + 1):
        grow(node)
    i = <Py_ssize_t>(h & <uint64_t>node.slot_mask)
    while node.slots[i].node != NULL:  # below slot_limit: a free slot exists
        i = (i + 1) & node.slot_mask
    Py_INCREF(child)
    slot = &node.slots[i]
    slot.node = <PyObject*>child
    slot.hash = <uint32_t>h
    slot.table = child.slots
    slot.shape = slot_shape(child)
    node.n_children += 1
    child.slot_hash = <uint32_t>h
    child.parent_ptr = <PyObject*>node
    return 0


cdef Py_ssize_t slot_of(Node node, Node child, uint64_t h) noexcept:
    cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>node.slot_mask)
    while node.slots[i].node != <PyObject*>child:
        i = (i + 1) & node.slot_mask
    return i


cdef void remove_slot(Node node, Py_ssize_t i) noexcept:
    """Empties slot ``i`` (the caller owns the reference it held), backward-shifting."""
    cdef Py_ssize_t j = i
    cdef Py_ssize_t home, tries
    cdef Py_ssize_t mask = node.slot_mask
    for tries in range(mask):  # bounded: a table of two may be full
        j = (j + 1) & mask
        if node.slots[j].node == NULL:
            break
        home = <Py_ssize_t>(node.slots[j].hash & <uint32_t>mask)
        # Keep entry j where it is if its home lies cyclically in (i, j].
        if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
            continue
        node.slots[i] = node.slots[j]
        i = j
    node.slots[i].node = NULL
    node.n_children -= 1


# check_layout's messages, by the number of the check that failed.
_LAYOUT_PROBLEMS = ("", "wrong parent", "slot_hash differs", "hash is not its first page's",
                    "not found by a probe", "stale table mirror", "stale shape mirror")


@cython.final
@cython.no_gc_clear  # tree_clear below tears down iteratively instead
cdef class Tree:
    """The compiled radix tree: walks, splits, locks; no tensors, no heap."""

    def __cinit__(self, Py_ssize_t page_size, bint numpy_arrays=False, bint host=False):
        self.page_size = page_size
        self.numpy_arrays = numpy_arrays
        self.host = host
        self.seed_ns = 0
        self.seed = _mix(0x9e3779b97f4a7c15ULL)
        self.guard = Guard()
        self.namespaces = {}
        self.ns_roots = {}
        self.last_ns = 0
        self.empty_inserted = set()
        self.root = self.make_root()

    def __dealloc__(self):
        # Iterative teardown: dropping a deep chain by refcount would recurse per level.
        self.teardown()

    cdef Node new_node(self, Node parent, int64_t now):
        cdef Node node
        if self.node_type is not None:
            node = <Node>self.node_type.__new__(self.node_type)
        elif self.host:
            node = HostNode.__new__(HostNode)
        else:
            node = Node.__new__(Node)
        node.id = _new_id()
        node.last_access_time = now
        node.created_time = now
        node.numpy_arrays = self.numpy_arrays
        if parent is not None:
            node.ns = parent.ns
            node.extra_key = parent.extra_key
        return node

    cdef Node make_root(self):
        cdef Node root = self.new_node(None, 0)
        root.key_owner = b""
        root.key_ptr = <const int64_t*>PyBytes_AS_STRING(root.key_owner)
        root.lock_ref = 1  # permanent, as in SGLang: lock and unlock of the root are no-ops
        return root

    cdef void teardown(self) noexcept:
        cdef Node root = self.root
        if root is not None:
            root.evicted = True
            drop_subtree(root)

    cdef uint64_t page_hash(self, const int64_t* page, int64_t ns) noexcept nogil:
        cdef uint64_t acc = 0, weight = _HASH_WEIGHT
        cdef Py_ssize_t i
        if ns != self.seed_ns:
            self.seed = _mix(<uint64_t>ns + 0x9e3779b97f4a7c15ULL)
            self.seed_ns = ns
        if self.page_size == 1:
            return _mix(self.seed ^ <uint64_t>page[0])
        # A page: each token times its own odd weight (a bijection of the token, so pages
        # that differ in one token never collide), summed, then mixed once. The products
        # are independent: no chain of one mix per token.
        for i in range(self.page_size):
            acc += <uint64_t>page[i] * weight
            weight += _HASH_STEP
        return _mix(self.seed ^ acc)

    # -- namespaces ------------------------------------------------------------------
    # Resolved once per call, before the walk: the dict lookup runs the key's
    # __hash__/__eq__, which must not happen once a walk has started.
    cdef int64_t find_namespace(self, object extra_key) except -2:
        """The id of ``extra_key``'s namespace; -1 when it has no nodes."""
        if extra_key is None:
            return 0
        ns = self.namespaces.get(extra_key)
        return -1 if ns is None else <int64_t>ns

    cdef int64_t make_namespace(self, object extra_key) except -2:
        """``find_namespace``, creating the namespace when it has none."""
        if extra_key is None:
            return 0
        ns = self.namespaces.get(extra_key)
        if ns is not None and ns in self.ns_roots:
            return <int64_t>ns
        self.namespaces[extra_key] = self.last_ns + 1
        self.last_ns += 1
        self.ns_roots[self.last_ns] = 0
        return self.last_ns

    cdef void forget_namespace(self, object extra_key, int64_t ns) noexcept:
        """Drop ``extra_key``'s entry once its last node went, so that keys do not pile up.
        Runs the key's __hash__/__eq__, so it comes after every structural write; an error
        there is reported as unraisable and leaves a stale entry, which finds nothing."""
        if self.namespaces.get(extra_key) == ns:
            del self.namespaces[extra_key]

    # -- structure -------------------------------------------------------------------
    cdef Node split(self, Node child, Py_ssize_t at):
        """Split ``child`` ``at`` tokens in: a new upper node takes over its place.

        The allocations (the node may run a collection, so Python code; then upper's table,
        so that nothing after can fail) come first; everything after them is plain C, with
        the parent's slot found after the allocations."""
        cdef Node upper = self.new_node(None, child.last_access_time)
        cdef Node parent
        cdef ChildSlot* slot
        cdef const int64_t* host
        grow(upper)  # detached: nothing to mirror yet
        upper_host = lower_host = None
        if self.host and (<HostNode>child).host_owner is not None:
            # The host copy's halves (bytes: no Python code).
            host = host_data(<HostNode>child)
            upper_host = PyBytes_FromStringAndSize(<const char*>host, at * sizeof(int64_t))
            lower_host = PyBytes_FromStringAndSize(<const char*>(host + at),
                                                   (child.key_len - at) * sizeof(int64_t))
        parent = <Node>child.parent_ptr
        slot = &parent.slots[slot_of(parent, child, child.slot_hash)]
        upper.key_owner = child.key_owner
        upper.key_ptr = child.key_ptr
        upper.key_len = at
        upper.lock_ref = child.lock_ref
        upper.priority = child.priority
        upper.hit_count = child.hit_count
        upper.created_time = child.created_time
        upper.ns = child.ns
        upper.extra_key = child.extra_key
        # Values are shared, never sliced here: a CPU buffer through value_ptr, a device
        # tensor through value_off (slicing one is torch code, which may run hooks).
        upper.value_owner = child.value_owner
        upper.value_ptr = child.value_ptr
        upper.value_off = child.value_off
        if child.value_ptr != NULL:
            child.value_ptr = child.value_ptr + at
        elif child.value_owner is not None:
            child.value_off += at
        if self.host:
            # The host copy in halves; a host-only node splits into two host-only halves.
            (<HostNode>upper).host_owner = upper_host
            # The old bytes go (no finalizer: plain bytes).
            (<HostNode>child).host_owner = lower_host
            (<HostNode>upper).host_only = (<HostNode>child).host_only
            (<HostNode>upper).n_host_kids = 1 if (<HostNode>child).host_only else 0
        # Upper takes child's slot in the parent (same first page, same hash): the slot's
        # reference to child moves into upper's table below.
        Py_INCREF(upper)
        slot.node = <PyObject*>upper
        slot.table = upper.slots
        slot.shape = slot_shape(upper)
        upper.slot_hash = child.slot_hash
        upper.parent_ptr = <PyObject*>parent
        child.key_ptr = child.key_ptr + at
        child.key_len -= at
        add_child(upper, child, self.page_hash(child.key_ptr, child.ns))  # cannot grow: fits
        Py_DECREF(child)  # add_child took a new reference; drop the one the slot held
        self.node_count += 1
        self.num_splits += 1
        return upper

    cdef Node find_match(self, Node node, const int64_t* tokens, Py_ssize_t remaining,
                         int64_t ns, Py_ssize_t* matched):
        """The child of ``node`` that ``tokens`` enter and how many of its tokens they match
        (``matched``, page aligned, > 0); None if no child starts with their first page.
        A match shorter than the child means the caller splits it, and its walk ends there:
        the lower half starts with the page that differed. Calls nothing."""
        cdef ChildSlot* slot
        cdef Node child
        cdef Py_ssize_t klen, common
        if node.n_children == 0:
            return None
        slot = probe(node.slots, node.slot_mask, tokens, self.page_size,
                     self.page_hash(tokens, ns), ns, node is self.root)
        if slot == NULL:
            return None
        klen = slot.shape & _LONG_KEY
        # A next page lies within the tokens (the sentinel, not page aligned, may not).
        if klen + self.page_size <= remaining and slot.table != NULL:
            # The next step's slot, from the mirror in this one: its fetch starts before the
            # child arrives, and overlaps the key compare.
            rc_prefetch(&slot.table[self.page_hash(tokens + klen, ns)
                                    & <uint64_t>shape_mask(slot.shape)])
        child = <Node>slot.node
        klen = child.key_len
        common = common_prefix(child.key_ptr, tokens, klen if klen < remaining else remaining)
        if common < klen:
            common -= common % self.page_size
            if common == 0:
                # The probe matched the first page, this read did not: another thread wrote
                # the tokens in between (torch and numpy drop the GIL). No match: a split
                # at 0 would leave an empty node.
                return None
        matched[0] = common
        return child

    # -- node bookkeeping ------------------------------------------------------------
    cdef bint holds(self, Node node) noexcept:
        """Whether ``node`` is in this tree: its parents lead to this root."""
        while node.parent_ptr != NULL:
            node = <Node>node.parent_ptr
        return node is self.root

    def _check_member(self, node):
        cdef Node top
        if not isinstance(node, Node):
            if isinstance(node, RadixTreeNode):
                raise ValueError("node belongs to another cache (a different tree core)")
            raise TypeError(f"expected a RadixTreeNode, got {type(node).__name__}")
        top = <Node>node
        if top.evicted:
            raise ValueError(f"node {top.id} was evicted")
        if not self.holds(top):
            raise ValueError(f"node {top.id} belongs to another cache")

    # The Core holds the guard around these: none of them takes it, and each returns (or
    # appends to ``dropped``) the references it let go, for the Core to release after it.
    cdef object store_value(self, Node node, object values):
        """Store a leaf's indices: a CPU int64 array is copied in, a device tensor kept.
        Returns the previous value."""
        cdef TokenBuf tb
        tb.held = False
        try:
            if isinstance(values, np.ndarray):
                borrow_buffer(values, &tb, "values")
                if tb.len != node.key_len:
                    raise ValueError(f"{tb.len} values for a node of {node.key_len} tokens")
                owner = PyBytes_FromStringAndSize(<const char*>tb.ptr,
                                                  tb.len * sizeof(int64_t))
            else:
                owner = values
        finally:
            release_tokens(&tb)
        previous = node.value_owner
        node.value_ptr = NULL
        node.value_off = 0
        node.value_owner = owner
        if owner is not values:
            node.value_ptr = <const int64_t*>PyBytes_AS_STRING(owner)
        return previous

    cdef int check_own_lock(self, Node node) except -1:
        """ValueError unless ``node`` holds a lock of its own: locks taken on descendants
        show in its count too, and only its own may be given back."""
        cdef Py_ssize_t own = node.lock_ref, i
        for i in range(node.slot_mask + 1):
            if node.slots[i].node != NULL:
                own -= (<Node>node.slots[i].node).lock_ref
        if own <= 0:
            raise ValueError(
                f"dec_lock_ref on node {node.id}: no lock_ref was taken on it "
                f"(lock_ref {node.lock_ref} comes from its descendants)"
            )
        return 0

    cdef Py_ssize_t lock_path(self, object node, int delta) except -1:
        """Lock (+1) or unlock (-1) node -> root; the tokens that crossed."""
        cdef Node cur, top
        cdef Py_ssize_t moved = 0
        if node is None or node is self.root:
            return 0
        self._check_member(node)
        cur = <Node>node
        if delta > 0 and self.host and (<HostNode>cur).host_only:
            raise lock_host_only(cur.id)
        if delta < 0:
            self.check_own_lock(cur)
        if delta > 0:
            # Checked before any change: the counts are 32-bit (an ancestor's is the largest).
            top = cur
            while top.parent_ptr != <PyObject*>self.root:
                top = <Node>top.parent_ptr
            if top.lock_ref >= _MAX_LOCK_REF:
                raise OverflowError(f"inc_lock_ref on node {cur.id}: node {top.id} already has "
                                    f"lock_ref {_MAX_LOCK_REF}, the most a node can hold")
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

    cdef Node detach_leaf(self, Node node, list dropped):
        """Detach an attached leaf (marked evicted, value dropped); returns its parent."""
        cdef Node parent
        cdef Py_ssize_t count
        if node.evicted or node.parent_ptr == NULL or node.n_children:
            raise ValueError(f"node {node.id} is not an attached leaf")
        parent = <Node>node.parent_ptr
        remove_slot(parent, slot_of(parent, node, node.slot_hash))
        if self.host and (<HostNode>node).host_only:
            (<HostNode>parent).n_host_kids -= 1
        node.parent_ptr = NULL
        node.evicted = True
        dropped.append(node.value_owner)
        node.value_ptr = NULL
        node.value_owner = None
        if self.host and (<HostNode>node).host_owner is not None:
            dropped.append((<HostNode>node).host_owner)
            (<HostNode>node).host_owner = None
        self.node_count -= 1
        Py_DECREF(node)  # the table's reference; the caller still holds one
        if parent is self.root and node.ns:
            count = self.ns_roots.get(node.ns, 1) - 1
            if count:
                self.ns_roots[node.ns] = count
            else:
                del self.ns_roots[node.ns]
                self.forget_namespace(node.extra_key, node.ns)  # last: runs user code
        return parent

    cdef object clear(self):
        """Drop every node (marked evicted), iteratively; returns the old tables."""
        cdef Node old_root
        fresh_root = self.make_root()  # allocations first, then the swap
        fresh_namespaces, fresh_roots, fresh_empty = {}, {}, set()
        old_root = self.root
        old_tables = (self.namespaces, self.empty_inserted)
        self.root = fresh_root
        self.namespaces = fresh_namespaces
        self.ns_roots = fresh_roots
        self.empty_inserted = fresh_empty
        self.clock = 0
        self.node_count = 0
        self.num_splits = 0
        # The tree is consistent (and empty) before the old one's references go.
        old_root.evicted = True
        drop_subtree(old_root)
        return old_tables

    def check_layout(self):
        """Raise AssertionError at the first child table or slot mirror that disagrees with
        its nodes (see the pure core's docstring); holds the guard."""
        cdef Node node, child
        cdef ChildSlot* slot
        cdef Py_ssize_t i, used
        cdef int failed
        self.guard.enter("check_layout")
        try:
            stack = [self.root]
            while stack:
                node = stack.pop()
                if node.slots == NULL:
                    assert node.n_children == 0, f"node {node.id}: children but no table"
                    continue
                used = 0
                for i in range(node.slot_mask + 1):
                    slot = &node.slots[i]
                    if slot.node == NULL:
                        continue
                    used += 1
                    child = <Node>slot.node
                    # Every comparison first, in C: the Python code below (the messages, an
                    # append) may allocate, and nothing may read the slot after that.
                    failed = 0
                    if child.parent_ptr != <PyObject*>node:
                        failed = 1
                    elif slot.hash != <uint32_t>child.slot_hash:
                        failed = 2
                    elif child.slot_hash != <uint32_t>self.page_hash(child.key_ptr, child.ns):
                        failed = 3
                    elif probe(node.slots, node.slot_mask, child.key_ptr, self.page_size,
                               child.slot_hash, child.ns, True) != slot:
                        failed = 4
                    elif slot.table != child.slots:
                        failed = 5
                    elif slot.shape != slot_shape(child):
                        failed = 6
                    assert not failed, (f"slot {i} of node {node.id} (child {child.id}): "
                                        + _LAYOUT_PROBLEMS[failed])
                    stack.append(child)
                assert used == node.n_children, f"node {node.id}: n_children {node.n_children}"
                assert used <= slot_limit(node.slot_mask + 1), f"node {node.id}: overfull"
        finally:
            self.guard.busy = 0

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
# chasing pointers to Python key objects. Fields as in the pure core's packed ints; a node's
# eviction rank, above them all there, picks the (sub-)heap its entries go to here.
cdef uint64_t _BIAS = 1ULL << 63
cdef uint64_t _MAX = 0xFFFFFFFFFFFFFFFFULL

cdef extern from "Python.h":
    # The rank table's reads and deletes: its keys are Nodes (hashed by address) and its
    # values ints in [1, 2^63), so none of these can fail or run Python code.
    Py_ssize_t PyDict_GET_SIZE(object) noexcept
    PyObject* PyDict_GetItem(object, object) noexcept
    int PyDict_DelItem(object, object) noexcept
    unsigned long long PyLong_AsUnsignedLongLong(object) noexcept
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


cdef void release_entries(HeapEntry* items, Py_ssize_t n) noexcept:
    """Drop the references of entries already detached from their heap, and free them."""
    cdef Py_ssize_t i
    for i in range(n):
        Py_DECREF(<object>items[i].node)
    PyMem_Free(items)


@cython.final
@cython.no_gc_clear  # heap_clear below releases the entries
cdef class EvictionHeap:
    """Lazy min-heap of evictable leaves in policy order (see the pure core's class).

    Two containers, one order: a sorted run (a ring buffer) that takes every entry not
    below its last one, and a 4-ary heap for the rest; a pop takes the smaller front. With
    lru/fifo/priority a new leaf's key is nearly always the largest yet (the clock only
    rises), so most entries go through the run, whose pops touch memory in order; the heap
    keeps the out-of-order ones (re-pushes of touched leaves, lfu, mru). A 4-ary heap's
    children sit together (one or two cache lines), so a sift touches half the levels.

    ``guard`` is the tree's (``Tree.guard``), so that a call into either while one of them
    works raises; without one the heap has its own. ``tiered``: its tree has a host tier
    (its nodes are HostNodes); ``host``: it is that tier's heap (so tiered too)."""

    def __cinit__(self, str policy, Guard guard=None, bint host=False, bint tiered=False):
        self.policy = _POLICY_IDS[policy]
        self.host = host
        self.tiered = tiered or host
        self.guard = guard if guard is not None else Guard()
        self.items = NULL
        self.size = 0
        self.capacity = 0
        self.run = NULL
        self.run_head = 0
        self.run_size = 0
        self.run_cap = 0
        self.limit = 1024
        self.ranks = {}
        self.level = 0
        self.ranked = False
        self.subheaps = {}
        self.levels = []

    def __dealloc__(self):
        self.release()

    cdef void release(self) noexcept:
        # Detach first (the run in order into one array): a DECREF may run a finalizer
        # that uses this heap.
        cdef HeapEntry* items = self.items
        cdef Py_ssize_t n = self.size, i
        if self.run_size:
            if n + self.run_size > self.capacity:
                items = <HeapEntry*>PyMem_Realloc(items, (n + self.run_size) * sizeof(HeapEntry))
            if items == NULL:  # no memory to detach into: release in place
                items = self.items
                for i in range(self.run_size):
                    Py_DECREF(<object>self.run_at(i).node)
            else:
                for i in range(self.run_size):
                    items[n + i] = self.run_at(i)[0]
                n += self.run_size
        PyMem_Free(self.run)
        self.items = NULL
        self.size = 0
        self.capacity = 0
        self.run = NULL
        self.run_head = 0
        self.run_size = 0
        self.run_cap = 0
        release_entries(items, n)

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

    cdef HeapEntry* run_at(self, Py_ssize_t i) noexcept:
        return &self.run[(self.run_head + i) & (self.run_cap - 1)]

    cdef int add(self, const HeapEntry* entry) except -1:
        """Push ``entry``, taking a new reference to its node. Allocates no Python object."""
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
        cdef Py_ssize_t n = self.size + self.run_size
        for sub in self.subheaps.values():
            n += len(sub)
        return n

    def clear(self):
        fresh_subheaps, fresh_levels = {}, []
        self.guard.enter("clear")
        self.limit = 1024
        old_subheaps, self.subheaps = self.subheaps, fresh_subheaps
        self.levels = fresh_levels
        self.guard.busy = 0
        self.release()  # detaches first: finalizers may use the (now empty) heap
        old_subheaps = None

    def key_of(self, Node node):
        """(rank, the policy's four words): the order of a pop over all (sub-)heaps."""
        cdef HeapEntry e
        self.fill_key(node, &e)
        return (self.rank(node), e.k0, e.k1, e.k2, e.k3)

    def rank_of(self, Node node):
        """``node``'s eviction rank (0 unless one was set)."""
        return self.ranks.get(node, 0)

    cdef uint64_t rank(self, Node node) noexcept:
        # Borrowed, for the read only: the table's keys are Nodes (hashed by address: no
        # Python code runs) and its values ints in [1, 2^63) (set_rank_of).
        cdef PyObject* found = PyDict_GetItem(self.ranks, node)
        return 0 if found == NULL else PyLong_AsUnsignedLongLong(<object>found)

    cdef inline bint holds(self, Node node) noexcept:
        """Whether an entry of ``node`` here is live: it is usable and of this heap's rank."""
        if not self.usable(node):
            return False
        if self.level:
            return self.rank(node) == self.level
        return not self.ranked or PyDict_GetItem(self.ranks, node) == NULL

    cdef EvictionHeap subheap(self, uint64_t level):
        """The main heap's sub-heap of rank ``level``, made (and its rank listed) if new."""
        cdef EvictionHeap sub = self.subheaps.get(level)
        cdef Py_ssize_t i = 0
        if sub is None:
            sub = EvictionHeap.__new__(EvictionHeap, "lru", self.guard)
            sub.policy = self.policy
            sub.ranks = self.ranks
            sub.level = level
            while i < len(self.levels) and <uint64_t>self.levels[i] < level:
                i += 1
            self.levels.insert(i, level)
            self.subheaps[level] = sub
        return sub

    cdef object pop_ranked(self, list stale):
        """The main heap's next victim among its sub-heaps, lowest rank first (the main
        heap's own entries are used up); an emptied sub-heap goes."""
        cdef EvictionHeap sub
        while self.levels:
            level = self.levels[0]
            sub = <EvictionHeap>self.subheaps[level]
            node = sub.pop_entry(stale)
            if node is not None:
                return node
            if sub.size + sub.run_size == 0:
                del self.levels[0]
                del self.subheaps[level]
                stale.append(sub)  # released by the caller, with the stale entries
            else:
                return None  # cannot happen: a sub-heap pops until it is empty
        return None

    cdef object set_rank_of(self, Node node, uint64_t rank, bint push):
        """Set ``node``'s rank (checked by the caller, under the guard, on the main heap).
        A changed rank pushes the node into its new rank's heap if it is usable now (its
        old entries are dead; ``push`` false: the caller pushes it); returns what a
        compaction dropped."""
        if rank == self.rank(node):
            return None
        if rank:
            self.ranks[node] = rank
        else:
            del self.ranks[node]
        self.ranked = PyDict_GET_SIZE(self.ranks) != 0
        if push and self.usable(node):
            return self.push_entry(node)
        return None

    cdef void drop_rank(self, Node node) noexcept:
        """Forget the rank of a node that left the tree (main heap; deleting a present key
        allocates nothing and cannot fail)."""
        if self.ranked and PyDict_GetItem(self.ranks, node) != NULL:
            PyDict_DelItem(self.ranks, node)
            self.ranked = PyDict_GET_SIZE(self.ranks) != 0

    def entries(self):
        """(stored key, node) of every entry (for consistency checks)."""
        cdef Py_ssize_t i
        cdef HeapEntry* e
        self.guard.enter("entries")
        try:
            return self.own_entries()
        finally:
            self.guard.busy = 0

    def own_entries(self):
        """``entries()`` without the guard: this heap's, then its sub-heaps'."""
        cdef Py_ssize_t i
        cdef HeapEntry* e
        level = self.level
        out = [((level, self.items[i].k0, self.items[i].k1, self.items[i].k2,
                 self.items[i].k3), <Node>self.items[i].node) for i in range(self.size)]
        for i in range(self.run_size):
            e = self.run_at(i)
            out.append(((level, e.k0, e.k1, e.k2, e.k3), <Node>e.node))
        for level in self.levels:
            out.extend(self.subheaps[level].own_entries())
        return out

    cdef list push_entry(self, Node node):
        """Push ``node`` (into its rank's sub-heap if it has one); returns what a compaction
        dropped (None when none ran), for the caller to release once everything is
        consistent."""
        cdef HeapEntry e
        cdef uint64_t level
        if self.ranked:
            level = self.rank(node)
            if level:
                return self.subheap(level).push_entry(node)
        self.fill_key(node, &e)
        e.node = <PyObject*>node
        self.add(&e)
        if self.size + self.run_size > self.limit:
            return self.compact()
        return None

    def push(self, Node node):
        self.guard.enter("push")
        try:
            dropped = self.push_entry(node)  # released when the call returns
        finally:
            self.guard.busy = 0

    cdef object pop_entry(self, list stale):
        """The next victim or None; nodes of dropped entries go to ``stale`` (released by
        the caller once everything is consistent)."""
        cdef HeapEntry top, current
        cdef Node node
        while self.take_front(&top):
            node = <Node>top.node
            stale.append(node)
            Py_DECREF(node)  # the heap's reference; ``stale`` holds one
            if not self.holds(node):
                continue  # pushed again (by rank) if it becomes an evictable leaf
            self.fill_key(node, &current)
            if entry_same_key(&current, &top):
                return node
            if entry_less(&top, &current):  # touched since pushed: wait for its turn
                current.node = <PyObject*>node
                self.add(&current)
            # else: a fall in key always came with a fresh push
        if self.levels:  # every rank-0 leaf is gone: the lowest rank next
            return self.pop_ranked(stale)
        return None

    def pop_victim(self):
        stale = []  # entries dropped here, released when the call returns
        self.guard.enter("pop_victim")
        try:
            return self.pop_entry(stale)
        finally:
            self.guard.busy = 0

    cdef inline bint usable(self, Node node) noexcept:
        """Whether ``node`` is a leaf of this heap's tier: a device leaf (on the device,
        unlocked, no child on the device; without a host tier: an unlocked leaf), or for the
        host heap a host leaf (only on the host, no children). A node of another kind of
        tree (pushed by hand) is none."""
        if not self.tiered:
            return not (node.evicted or node.n_children or node.lock_ref)
        if node.evicted or type(node) is not HostNode:
            return False
        if self.host:
            return (<HostNode>node).host_only and node.n_children == 0
        return not (node.n_children != (<HostNode>node).n_host_kids or node.lock_ref
                    or (<HostNode>node).host_only)

    cdef list compact(self):
        """Keep one usable entry per evictable leaf; amortised O(1) per push. The run is
        filtered in order (it stays sorted), the heap in place and then heapified. Returns
        the dropped entries' nodes, for the caller to release once the heap is consistent."""
        cdef Py_ssize_t i, kept = 0, total = self.size + self.run_size
        cdef Py_ssize_t heap_before = self.size
        cdef HeapEntry current
        cdef HeapEntry* e
        cdef HeapEntry* other
        cdef HeapEntry* ordered
        cdef Node node
        # Put the run in order at the start of its buffer (allocates before anything moves).
        if self.run_head != 0 and self.run_size:
            ordered = <HeapEntry*>PyMem_Malloc(self.run_cap * sizeof(HeapEntry))
            if ordered == NULL:
                raise MemoryError()
            for i in range(self.run_size):
                ordered[i] = self.run_at(i)[0]
            PyMem_Free(self.run)
            self.run = ordered
        self.run_head = 0
        best = {}  # node id -> position (the heap's entries, then the run's)
        for i in range(total):
            e = &self.items[i] if i < heap_before else &self.run[i - heap_before]
            node = <Node>e.node
            if not self.holds(node):
                continue
            self.fill_key(node, &current)
            if entry_less(&current, e):
                continue  # stored above current: discarded when popped anyway
            j = best.get(node.id)
            if j is None:
                best[node.id] = i
            else:
                other = (&self.items[<Py_ssize_t>j] if <Py_ssize_t>j < heap_before
                         else &self.run[<Py_ssize_t>j - heap_before])
                if entry_less(e, other):
                    best[node.id] = i
        keep = set(best.values())
        dropped = []
        for i in range(heap_before):  # in place: kept <= i throughout; nothing calls out
            if i in keep:
                self.items[kept] = self.items[i]
                kept += 1
            else:
                dropped.append(<Node>self.items[i].node)
                Py_DECREF(<object>self.items[i].node)  # the list holds one
        self.size = kept
        kept = 0
        for i in range(self.run_size):
            if heap_before + i in keep:
                self.run[kept] = self.run[i]
                kept += 1
            else:
                dropped.append(<Node>self.run[i].node)
                Py_DECREF(<object>self.run[i].node)
        self.run_size = kept
        if self.size > 1:  # (cdivision: (0 - 2) // 4 would be 0, not -1)
            for i in range((self.size - 2) // 4, -1, -1):
                self.sift_down(i)
        self.limit = max(1024, 2 * (self.size + self.run_size))
        return dropped



# -- the per-cache core object: whole calls in one crossing --------------------------------
cdef extern from "rc_dlpack.h":
    object rc_int64_capsule(Py_ssize_t n, int64_t** data)
    size_t RC_DL_HEAD
    char* rc_int64_block(Py_ssize_t n) noexcept
    object rc_adopt_block(char* mem, Py_ssize_t n)
    void rc_block_release(char* mem) noexcept
    bint rc_block_alone(char* mem) noexcept
    object rc_share_block(char* mem, Py_ssize_t n)
    object rc_view_block(char* mem, Py_ssize_t start, Py_ssize_t n)
    ctypedef struct rc_dl_head:
        int64_t refs
    ctypedef struct rc_DLTensor:
        void* data
        int64_t* shape
    ctypedef struct rc_DLManagedTensor:
        rc_DLTensor dl_tensor
        void (*deleter)(rc_DLManagedTensor*) noexcept

cdef extern from "rc_results.h":
    Py_ssize_t rc_slot_offset(object descr) except -1
    object rc_make_insert(object type, const Py_ssize_t* offsets, object prefix_len,
                          object node)
    object rc_make_match(object type, const Py_ssize_t* offsets, object indices, object node,
                         object length, object host_length, object last_host)

cdef extern from "Python.h":
    Py_ssize_t PyList_GET_SIZE(object) noexcept
    Py_ssize_t PyTuple_GET_SIZE(object) noexcept

from libc.stdint cimport uintptr_t

import array as _array_module


_ndarray = np.ndarray
_array_type = _array_module.array
_frombuffer = np.frombuffer
_concatenate = np.concatenate  # a numpy core's batch parts (all on the CPU)


@cython.final
cdef class _NoTensor:
    """Stands for torch.Tensor until torch is bound: nothing is an instance of it, so a
    tensor met before is an unusual input (declined to cache.py, which binds torch)."""

    def __cinit__(self):
        raise TypeError("the stand-in for torch.Tensor has no instances")


# torch's names, bound by _bind_torch once some code loads torch (_torch.load_torch): a
# core of numpy arrays never imports it.
_Tensor = _NoTensor
_int64 = None
_mode_enabled = None
_from_dlpack = None


# A tensor's facts are read through torch.Tensor's own accessors (the C functions behind its
# getters and methods), never through the instance: a tensor has a __dict__, and an
# attribute set there (t.data_ptr = ...) shadows a method. Calling the C function directly
# also skips the attribute lookup. The accessors' order is _FACT_*'s.
cdef extern from "rc_tensor.h":
    ctypedef struct rc_accessor:
        pass
    int rc_accessor_bind(rc_accessor* a, object descr) except -1
    object rc_accessor_read(const rc_accessor* a, object obj)

cdef enum:
    _FACT_IS_CPU, _FACT_DTYPE, _FACT_DIM, _FACT_IS_CONTIGUOUS, _FACT_IS_NEG, _FACT_NBYTES,
    _FACT_DATA_PTR, _FACT_COUNT
_FACT_NAMES = ("is_cpu", "dtype", "dim", "is_contiguous", "is_neg", "nbytes", "data_ptr")
cdef rc_accessor _facts[_FACT_COUNT]
# Whether every accessor is bound; if not (a torch that defines one otherwise),
# borrow_int64 declines tensors, and cache.py's validation converts them.
cdef bint _facts_bound = False
_fact_descriptors = ()  # what the accessors point into, kept alive


cdef int _bind_facts(object tensor_type) except -1:
    global _facts_bound, _fact_descriptors
    cdef Py_ssize_t i
    found = []
    _facts_bound = False
    for i, name in enumerate(_FACT_NAMES):
        # As attribute lookup on the type finds it: the first class in the MRO defining it.
        descr = next((klass.__dict__[name] for klass in tensor_type.__mro__
                      if name in klass.__dict__), None)
        if descr is None or not rc_accessor_bind(&_facts[i], descr):
            return 0
        found.append(descr)
    _fact_descriptors = tuple(found)
    _facts_bound = True
    return 0


cdef inline object tensor_fact(int fact, object tensor):
    """One fact of an exact torch.Tensor, read with torch's own C accessor."""
    return rc_accessor_read(&_facts[fact], tensor)


def _bind_torch(torch):
    global _Tensor, _int64, _mode_enabled, _from_dlpack
    _int64 = torch.int64
    _mode_enabled = torch._C._is_torch_function_mode_enabled
    _from_dlpack = torch._C._from_dlpack
    _bind_facts(torch.Tensor)
    _Tensor = torch.Tensor  # last: once a tensor is recognised, the rest is bound


_on_torch(_bind_torch)
cdef object _ZERO = 0
# MatchResult's slots, in rc_make_match's order.
cdef Py_ssize_t _MATCH_SLOTS[5]
for _i, _name in enumerate(("indices", "last_node", "length", "_host_length",
                            "_last_host_node")):
    _MATCH_SLOTS[_i] = rc_slot_offset(_MatchResult.__dict__[_name])
# InsertResult's slots, in rc_make_insert's order.
cdef Py_ssize_t _INSERT_SLOTS[2]
for _i, _name in enumerate(("prefix_len", "last_node")):
    _INSERT_SLOTS[_i] = rc_slot_offset(_InsertResult.__dict__[_name])


@cython.final
cdef class _IndexBlock:
    """Owns a DLPack tensor made here (1-D, contiguous int64 on the CPU) and exposes its data
    through the buffer protocol: the base of a numpy index array (the torch mode's tensor
    owns the same tensor instead). Holds no Python object, so it is never in a cycle."""
    cdef rc_DLManagedTensor* managed
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        if self.managed != NULL:
            self.managed.deleter(self.managed)  # frees the block, or drops its ref to it

    def __getbuffer__(self, Py_buffer* view, int flags):
        if self.managed == NULL:  # made from Python (type(...).__new__): it owns nothing
            raise BufferError("this index block holds no indices")
        view.buf = self.managed.dl_tensor.data
        view.obj = self
        view.len = self.shape[0] * <Py_ssize_t>sizeof(int64_t)
        view.readonly = 0
        view.itemsize = sizeof(int64_t)
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = "q"
        view.ndim = 1
        view.shape = self.shape if flags & PyBUF_ND else NULL
        view.strides = self.strides if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        view.suboffsets = NULL
        view.internal = NULL

    # No __releasebuffer__: np.frombuffer then keeps this object itself as the array's base.
    # (It wraps an exporter that has one in a memoryview, which the caller could release,
    # freeing the block under the array.)


cdef object numpy_from_capsule(object capsule):
    """The numpy int64 array over one of this module's DLPack capsules, which it takes over
    (renamed "used_dltensor", as a DLPack consumer does: its destructor leaves the tensor to
    the array). No Python code runs between the capsule's read and the hand-over, and
    np.frombuffer over an _IndexBlock runs none."""
    cdef _IndexBlock block = _IndexBlock.__new__(_IndexBlock)
    cdef rc_DLManagedTensor* managed = <rc_DLManagedTensor*>PyCapsule_GetPointer(
        capsule, "dltensor")
    PyCapsule_SetName(capsule, "used_dltensor")
    block.managed = managed
    block.shape[0] = <Py_ssize_t>managed.dl_tensor.shape[0]
    block.strides[0] = sizeof(int64_t)
    return _frombuffer(block, _INT64_DTYPE)


cdef inline object index_array(object capsule, bint numpy_arrays):
    """A result index array over a capsule of this module: a numpy array or a tensor."""
    if numpy_arrays:
        return numpy_from_capsule(capsule)
    return _from_dlpack(capsule)


cdef object make_index_array(object capsule, bint numpy_arrays):
    """``index_array`` for the hybrid core."""
    return index_array(capsule, numpy_arrays)


cdef object new_empty_indices(bint numpy_arrays):
    """A new empty index array for a miss (never a shared one: the caller may change a
    result in place, with set_ or resize_, and that must not show in another)."""
    cdef int64_t* unused
    return index_array(rc_int64_capsule(0, &unused), numpy_arrays)


cdef object block_tensor(const int64_t* src, Py_ssize_t n, bint numpy_arrays):
    """A new int64 array holding a copy of src[:n]: one block, one copy, as a match's. The
    capsule is not tracked by the collector: no Python code runs before the copy is done."""
    cdef int64_t* out
    capsule = rc_int64_capsule(n, &out)
    if n:
        memcpy(out, src, n * sizeof(int64_t))
    return index_array(capsule, numpy_arrays)


@cython.final
cdef class FreedBatch:
    """A batch eviction's freed indices, in eviction order: CPU values (and keys doubling as
    indices) are copied into one growing block, laid out as a result tensor's (a header,
    then the int64 data), which becomes that tensor without another copy; a device value
    ends the block so far (made a tensor) and is kept as given. ``take()``: None when
    nothing was added, one tensor, or a list of tensors to join. Runs no Python code but
    torch's tensor making. ``hint``: the tokens the loop means to free (the first block's
    size, bounded), so that a call's victims rarely grow the block.

    ``tail(n)`` is a tensor over the last ``n`` indices added, sharing the block (a
    backup's argument: the same values the batch hands over, without a copy). The block is
    reference-counted: it grows in place only while no such tensor is alive; otherwise the
    batch goes on in a new block (a part of its own), and never writes where a live tensor
    looks."""

    def __cinit__(self, int64_t hint=0, bint numpy_arrays=False):
        self.block = NULL
        self.numpy_arrays = numpy_arrays
        self.hint = <Py_ssize_t>min(max(hint, 256), 1 << 18)

    def __dealloc__(self):
        if self.block != NULL:
            rc_block_release(self.block)

    cdef int64_t* reserve(self, Py_ssize_t n) except NULL:
        """Room for ``n`` more indices at the block's end, counted as added: the caller
        writes them before anything else runs."""
        cdef char* grown
        cdef Py_ssize_t cap
        if self.block != NULL and self.joined_len + n > self.joined_cap:
            if not rc_block_alone(self.block):
                self.seal()  # a tensor looks at this block: go on in a new one
        if self.block == NULL or self.joined_len + n > self.joined_cap:
            cap = max(2 * self.joined_cap, self.joined_len + n, self.hint)
            grown = <char*>realloc(self.block, RC_DL_HEAD + <size_t>cap * sizeof(int64_t))
            if grown == NULL:
                raise MemoryError()
            if self.block == NULL:
                (<rc_dl_head*>grown).refs = 1  # the batch's
            self.block = grown
            self.joined_cap = cap
        self.joined_len += n
        return <int64_t*>(self.block + RC_DL_HEAD) + self.joined_len - n

    cdef int add_ints(self, const int64_t* data, Py_ssize_t n) except -1:
        memcpy(self.reserve(n), data, n * sizeof(int64_t))
        return 0

    cdef int add_page_ids(self, const int64_t* data, Py_ssize_t n,
                          Py_ssize_t page_size) except -1:
        """Add the page id of every ``page_size``-th of ``n`` indices from the first (the
        index floor-divided by ``page_size``, as numpy's ``//``)."""
        cdef Py_ssize_t pages = (n + page_size - 1) // page_size
        cdef int64_t* out = self.reserve(pages)
        cdef Py_ssize_t i
        for i in range(pages):
            out[i] = floor_div64(data[i * page_size], page_size)
        return 0

    cdef object tail(self, Py_ssize_t n):
        """A tensor over the last ``n`` indices added (sharing the block)."""
        return index_array(rc_view_block(self.block, self.joined_len - n, n),
                           self.numpy_arrays)

    cdef int drop_tail(self, Py_ssize_t n) except -1:
        """Take back the last ``n`` indices added (their victim stays). Should a tensor
        still look at them, the batch goes on in a new block: they are never overwritten."""
        self.joined_len -= n
        if not rc_block_alone(self.block):
            self.seal()
        return 0

    cdef int seal(self) except -1:
        """End the block: what it holds becomes a part; the next index starts a new one."""
        cdef char* mem = self.block
        if self.joined_len:
            if self.parts is None:
                self.parts = []
            self.parts.append(self.joined_tensor())
        else:
            self.block = NULL
            self.joined_cap = 0
            rc_block_release(mem)
        return 0

    cdef object joined_tensor(self):
        """The block so far as a tensor (the block is handed over: no copy)."""
        cdef char* mem = self.block
        cdef char* smaller
        cdef Py_ssize_t n = self.joined_len, cap = self.joined_cap
        self.block = NULL
        self.joined_len = self.joined_cap = 0
        # Give back the room of a block grown well past what it holds (realloc in place),
        # unless a tensor looks at it.
        if cap - n > max(n // 4, 4096) and rc_block_alone(mem):
            smaller = <char*>realloc(mem, RC_DL_HEAD + <size_t>max(n, 1) * sizeof(int64_t))
            if smaller != NULL:
                mem = smaller
        return index_array(rc_share_block(mem, n), self.numpy_arrays)

    cdef int add_tensor(self, object tensor) except -1:
        if self.parts is None:
            self.parts = []
        if self.joined_len:
            self.parts.append(self.joined_tensor())
        self.parts.append(tensor)
        return 0

    cdef object take(self):
        if self.parts is None:
            if not self.joined_len:
                return None
            value = self.joined_tensor()
        else:
            if self.joined_len:
                self.parts.append(self.joined_tensor())
            value = self.parts
            self.parts = None
        return value


cdef object kept_value(Node node):
    """A node's device indices for a tensor no caller gets as it is (torch.cat copies it
    at once), or gets only once the node has left the tree: the tensor the node keeps when
    that covers it exactly (no other node shares it then), else a view of its span."""
    owner = node.value_owner
    if node.value_off == 0 and owner.shape[0] == node.key_len:
        return owner
    return owner[node.value_off:node.value_off + node.key_len]


cdef object path_value(Node node):
    """A matched node's indices for torch to concatenate: ``kept_value`` on a device, a
    CPU array of its values otherwise."""
    if node.value_ptr == NULL and node.value_owner is not None:
        return kept_value(node)
    return node.value


cdef int collect_value(FreedBatch batch, Node node, Py_ssize_t page_size=0) except -1:
    """Add a device victim's indices to ``batch``: its device tensor (read first; the batch
    joins its parts into a new tensor), else its CPU values or its key. With a
    ``page_size``: the page ids of its pages instead (``_handover.page_ids``); the node is
    not read after the torch code that computes a device tensor's."""
    cdef const int64_t* data
    if node.value_ptr == NULL and node.value_owner is not None:
        if page_size:
            return batch.add_tensor(_page_ids(kept_value(node), page_size))
        return batch.add_tensor(kept_value(node))
    data = node.value_ptr if node.value_ptr != NULL else node.key_ptr
    if page_size:
        return batch.add_page_ids(data, node.key_len, page_size)
    return batch.add_ints(data, node.key_len)


cdef bytes host_bytes(object host, Py_ssize_t n, bint numpy_arrays):
    """What ``backup`` returned for a node of ``n`` tokens, checked (``_handover``'s
    checks and messages), as int64 bytes of exactly ``n`` indices: the conversion runs torch
    code (a tensor subclass can answer anything), so its result is checked again.

    The common answer -- an array of the core's kind that ``borrow_int64`` reads without
    running Python code (a plain CPU int64 tensor with no torch function mode active, or an
    exact int64 numpy array), 1-D, contiguous, of ``n`` elements -- is copied straight from
    its memory; anything else goes through the shared check."""
    cdef TokenBuf tb
    if type(host) is (_ndarray if numpy_arrays else _Tensor) and borrow_int64(host, &tb):
        try:
            if tb.len == n:
                return PyBytes_FromStringAndSize(<const char*>tb.ptr, n * sizeof(int64_t))
        finally:
            release_tokens(&tb)
    data = host_indices_bytes(host, n, numpy_arrays)
    if numpy_arrays:
        return data  # the shared check read it with ndarray's own tobytes, and checked it
    if type(data) is not bytes:
        raise TypeError("backup must return a torch.Tensor of host indices (or None when the "
                        f"host is full), got {type(host).__name__}")
    if len(<bytes>data) != n * <Py_ssize_t>sizeof(int64_t):
        raise ValueError(f"backup returned {len(<bytes>data) // 8} host indices for {n} "
                         "device slots: one per slot expected")
    return <bytes>data


cdef bytes kept_answer(object answer, Py_ssize_t n, bint numpy_arrays):
    """``host_bytes``; an error meanwhile carries ``answer`` (``_handover.answer_not_kept``)."""
    try:
        return host_bytes(answer, n, numpy_arrays)
    except BaseException as exc:
        error = answer_not_kept(exc, answer)
        if error is exc:
            raise
        raise error from exc


cdef inline object batch_join(bint numpy_arrays):
    """What joins a batch's parts into one array: numpy's concatenate for a core of numpy
    arrays (all on the CPU), else torch's (device parts among them)."""
    return _concatenate if numpy_arrays else _cat_tensors


cdef object victim_value(Node node, bint leaving):
    """An evicted node's index tensor (before it is detached): as ``Node.value``, with CPU
    values copied straight into a new block. ``leaving``: the node leaves the tree before
    the tensor is handed over, so a device value may be the one it kept."""
    if node.value_ptr == NULL and node.value_owner is not None:
        return kept_value(node) if leaving else node.value
    return block_tensor(node.value_ptr if node.value_ptr != NULL else node.key_ptr,
                        node.key_len, node.numpy_arrays)


cdef object _INT64_DTYPE = np.dtype(np.int64)
cdef object _LONGLONG_DTYPE = np.dtype(np.longlong)


cdef inline bint _is_int64_dtype(object dtype) noexcept:
    """``dtype`` is one of numpy's builtin int64 dtypes (both native order, 8 bytes): an
    identity check, no Python code."""
    return dtype is _INT64_DTYPE or dtype is _LONGLONG_DTYPE


# The longest new leaf whose tokens and values share one block (2 x 32 KiB).
cdef Py_ssize_t _JOIN_MAX = 4096


cdef bytes leaf_block(const int64_t* key, const int64_t* values, Py_ssize_t n, bint joined):
    """A new leaf's key: key[:n] as int64 bytes, followed by values[:n] when ``joined`` (then
    the node's values point into the same block). No Python code runs between the reads."""
    cdef bytes block = PyBytes_FromStringAndSize(NULL, (2 * n if joined else n) * sizeof(int64_t))
    cdef char* out = PyBytes_AS_STRING(block)
    memcpy(out, key, n * sizeof(int64_t))
    if joined:
        memcpy(out + n * sizeof(int64_t), values, n * sizeof(int64_t))
    return block


cdef inline bint int64_format(const char* fmt) noexcept:
    if fmt == NULL:
        return False
    if fmt[0] == b'<' or fmt[0] == b'=' or fmt[0] == b'@':
        fmt += 1
    return (fmt[0] == b'q' or (fmt[0] == b'l' and sizeof(long) == 8)) and fmt[1] == 0


cdef int borrow_int64(object obj, TokenBuf* b) except -1:
    """Point ``b`` at an int64 array's or CPU tensor's memory as int64: 1, or 0 to decline
    (another type, dtype, layout or device; a torch function mode active). Runs no Python
    code; ``release_tokens`` gives a held buffer back."""
    cdef int flags
    cdef object kind = type(obj)
    b.held = False
    if kind is _ndarray or kind is _array_type:
        # An array of one of numpy's builtin int64 dtypes (native order) needs no format
        # string: numpy builds one per export when asked, which costs more than the rest.
        flags = PyBUF_C_CONTIGUOUS
        if kind is not _ndarray or not _is_int64_dtype(obj.dtype):
            flags |= PyBUF_FORMAT
        try:
            PyObject_GetBuffer(obj, &b.view, flags)
        except (ValueError, BufferError, TypeError):
            return 0
        b.held = True
        if b.view.ndim != 1 or b.view.itemsize != 8 or (
                flags & PyBUF_FORMAT and not int64_format(b.view.format)):
            release_tokens(b)
            return 0
        b.ptr = <const int64_t*>b.view.buf
        b.len = b.view.shape[0]
    elif kind is _Tensor:
        if not _facts_bound or _mode_enabled():
            return 0
        if (tensor_fact(_FACT_IS_CPU, obj) is not True
                or tensor_fact(_FACT_DTYPE, obj) is not _int64
                or tensor_fact(_FACT_DIM, obj) != 1
                or tensor_fact(_FACT_IS_CONTIGUOUS, obj) is not True):
            return 0
        # Memory that does not hold the values as read: a negative-bit view stores them
        # un-negated; a zero tensor has no storage: its NULL data pointer is declined
        # below, which spares a ~60 ns _is_zerotensor() call per tensor (an empty
        # tensor without storage goes the validation path too, to the same answer).
        if tensor_fact(_FACT_IS_NEG, obj) is not False:
            return 0
        # int64: 8 bytes each (cheaper than numel())
        b.len = <Py_ssize_t>tensor_fact(_FACT_NBYTES, obj) >> 3
        b.ptr = <const int64_t*><uintptr_t>tensor_fact(_FACT_DATA_PTR, obj)
        if b.ptr == NULL:
            return 0
    else:
        return 0
    return 1


cdef int64_t token_target(object num_tokens) except? -1:
    """``evict``'s ``num_tokens`` (an int, else TypeError) as an int64, clamped."""
    if type(num_tokens) is not int:
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    try:
        return PyLong_AsLongLong(num_tokens)
    except OverflowError:
        return INT64_MAX if num_tokens > 0 else 0


@cython.final
cdef class Core:
    """Core(page_size, policy, host_tier=False, write_through_hits=0, numpy_arrays=False)
--

One cache's tree, eviction heap, sizes and counters, and its whole-call operations
    (the interface is specified in ``_core_py``'s docstring).

    Every call holds the tree's guard (shared with the heap). The fast paths take the
    common inputs whole: a list's exact ints are read without a call, an int64 buffer or a
    CPU int64 tensor (only with no torch function mode active: then its accessors run no
    Python code) is borrowed, or copied into the core's own scratch buffer when an extra_key
    will be hashed later in the call. Borrowed memory is read only before the call's first
    allocation of a tracked object (a split or a new node: a collection may run there); the
    new leaf's key and values are copied out before it. Anything unusual is declined (None)
    before any change, for cache.py to validate.
    """

    def __cinit__(self, Py_ssize_t page_size, str policy, bint host_tier=False,
                  int write_through_hits=0, bint numpy_arrays=False):
        if not numpy_arrays:
            _load_torch()  # its arrays are tensors: torch's names are bound from here
        self.numpy_arrays = numpy_arrays
        self.page_size = page_size
        self.tree = Tree(page_size, numpy_arrays, host_tier)
        self.guard = self.tree.guard
        self.heap = EvictionHeap(policy, self.guard, False, host_tier)
        self.host_heap = EvictionHeap(policy, self.guard, True)
        self.host_tier = host_tier
        self.write_through_hits = write_through_hits if host_tier else 0
        self.wt_queue = _deque()
        self.adopted = None
        self.node_tags = {}
        self.session_nodes = {}
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

    # -- the guard, for cache.py's slow paths -----------------------------------------
    def enter(self, str what):
        self.guard.enter(what)

    def leave(self):
        self.guard.busy = 0

    cdef inline int take(self, bint held, str what) except -1:
        if not held:
            self.guard.enter(what)
        return 0

    cdef inline void give(self, bint held) noexcept:
        if not held:
            self.guard.busy = 0

    def reset_stats(self):
        self.lookups = self.matched_tokens = self.queried_tokens = 0
        self.inserts = self.inserted_tokens = self.evictions = self.evicted_tokens = 0
        self.host_hit_tokens = self.loaded_tokens = self.backed_up_tokens = 0
        self.host_evictions = self.host_evicted_tokens = 0
        self.tree.num_splits = 0

    def reset(self, bint held=False):
        self.take(held, "reset")
        try:
            fresh_queue = _deque()
            fresh_ranks, fresh_subheaps, fresh_levels = {}, {}, []
            fresh_tags, fresh_sessions = {}, {}
            old_tables = self.tree.clear()
            old_ranks, self.heap.ranks = self.heap.ranks, fresh_ranks
            old_subheaps, self.heap.subheaps = self.heap.subheaps, fresh_subheaps
            self.heap.levels = fresh_levels
            self.heap.ranked = False
            self.heap.limit = 1024
            self.host_heap.limit = 1024
            self.evictable = 0
            self.protected = 0
            self.host_size = 0
            old_queue, self.wt_queue = self.wt_queue, fresh_queue
            old_tags, self.node_tags = self.node_tags, fresh_tags
            old_sessions, self.session_nodes = self.session_nodes, fresh_sessions
            self.new_leaf = None
            self.adopted = None
            self.reset_stats()
        finally:
            self.give(held)
        old_queue = old_ranks = old_subheaps = old_tags = old_sessions = None
        self.heap.release()  # detaches first; its finalizers may use the empty cache
        self.host_heap.release()

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

    cdef int acquire(self, object obj, TokenBuf* b, bint for_kv, bint private) except -1:
        """Point ``b`` at ``obj`` as int64: 1, or 0 to decline (an unusual input, or one
        that would fail: cache.py validates it). Runs no Python code. ``private``: copy a
        borrowed buffer into the core's scratch buffer (Python code runs before its use)."""
        cdef Py_ssize_t i, n
        cdef PyObject** items
        cdef int64_t* out
        cdef object kind = type(obj)
        b.held = False
        if kind is list or kind is tuple:
            n = PyList_GET_SIZE(obj) if kind is list else PyTuple_GET_SIZE(obj)
            out = self.scratch(for_kv, n)
            items = PySequence_Fast_ITEMS(obj)
            for i in range(n):  # exact ints only: nothing here runs Python code
                if not rc_read_int(items[i], &out[i]):
                    return 0
            b.ptr = out
            b.len = n
            return 1
        if not borrow_int64(obj, b):
            return 0
        if private:
            out = self.scratch(for_kv, b.len)
            if b.len:
                memcpy(out, b.ptr, b.len * sizeof(int64_t))
            release_tokens(b)
            b.ptr = out
        return 1

    # -- results and heap ------------------------------------------------------------------
    cdef object match_result(self, object indices, object node, Py_ssize_t length):
        return rc_make_match(_MatchResult, _MATCH_SLOTS, indices, node, length, _ZERO, node)

    cdef object insert_result(self, Py_ssize_t prefix_len, object node):
        return rc_make_insert(_InsertResult, _INSERT_SLOTS, prefix_len, node)

    cdef object push_if_evictable(self, Node node):
        """Push an evictable (device) leaf; returns what a compaction dropped (to release
        later)."""
        if node.lock_ref or node.evicted or node is self.tree.root:
            return None
        if self.host_tier:
            if (node.n_children != (<HostNode>node).n_host_kids
                    or (<HostNode>node).host_only):
                return None
        elif node.n_children:
            return None
        return self.heap.push_entry(node)

    cdef object push_host_leaf(self, Node node):
        """Push a host leaf on the host heap; returns what a compaction dropped (a node of
        a tree with a host tier: a HostNode)."""
        if node.n_children or node.evicted or not (<HostNode>node).host_only:
            return None
        return self.host_heap.push_entry(node)

    cdef int queue_if_due(self, Node node) except -1:
        """Append ``node`` (a HostNode) to the write-through queue if it is due for a copy."""
        cdef HostNode hnode = <HostNode>node
        if (node.hit_count >= self.write_through_hits and not hnode.queued
                and not hnode.host_only and hnode.host_owner is None and not node.evicted):
            self.wt_queue.append(node)
            hnode.queued = True
        return 0

    cdef object demote(self, Node node, list garbage):
        """``node`` (a HostNode with a host copy) leaves the device: the device value goes
        to ``garbage``, sizes and counters follow, the node and its parent are pushed on the
        heap they now belong to. Calls nothing but pushes (no Python code before every write
        is done). Returns the parent."""
        cdef Node parent = <Node>node.parent_ptr
        cdef Py_ssize_t size = node.key_len
        garbage.append(node.value_owner)
        node.value_owner = None
        node.value_ptr = NULL
        node.value_off = 0
        (<HostNode>node).host_only = True
        (<HostNode>parent).n_host_kids += 1
        self.evictable -= size
        self.evictions += 1
        self.evicted_tokens += size
        garbage.append(self.push_host_leaf(node))
        garbage.append(self.push_if_evictable(parent))
        return parent

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
    cdef int64_t read_query(self, object tokens, TokenBuf* b, object extra_key) except -3:
        """A read call's tokens into ``b`` (before any key hashing runs), then the namespace
        id of ``extra_key`` (-1: none); ``_DECLINED`` for an input cache.py must validate (an
        unusual token type, an unhashable key)."""
        if not self.acquire(tokens, b, False, extra_key is not None):
            return _DECLINED
        if extra_key is None:
            return 0
        try:
            return self.tree.find_namespace(extra_key)
        except TypeError:
            return _DECLINED

    cdef object path_indices(self, Py_ssize_t count, Py_ssize_t length):
        """The index array of the first ``count`` nodes of ``self.path`` (``length`` tokens
        in all, > 0): their values joined in path order, in one new array."""
        cdef Py_ssize_t i, total = 0
        cdef Node child
        cdef char* out
        for i in range(count):
            child = <Node>self.path[i]
            if child.value_ptr == NULL and child.value_owner is not None:
                # Device values: torch concatenates (a new tensor).
                return _cat_tensors([path_value(<Node>self.path[i]) for i in range(count)])
        # A capsule is not tracked by the collector: no Python code runs until the copy is
        # done.
        capsule = rc_int64_capsule(length, <int64_t**>&out)
        for i in range(count):
            child = <Node>self.path[i]
            memcpy(out + total, child.value_ptr if child.value_ptr != NULL else child.key_ptr,
                   child.key_len * sizeof(int64_t))
            total += child.key_len * sizeof(int64_t)
        return index_array(capsule, self.numpy_arrays)

    cdef object host_match_result(self, Py_ssize_t depth):
        """The end of a match with a host tier: the path's first ``depth`` nodes are in
        ``self.path``; those on the device come first (the invariant), the host-only ones
        after them are the host continuation."""
        cdef Py_ssize_t i, ndev = 0, length = 0, host_length = 0
        cdef Node child, node = self.tree.root, last_host
        for i in range(depth):
            child = <Node>self.path[i]
            if (<HostNode>child).host_only:
                host_length += child.key_len
            else:
                ndev = i + 1
                length += child.key_len
                node = child
        last_host = <Node>self.path[depth - 1] if host_length else node
        self.matched_tokens += length
        self.host_hit_tokens += host_length
        # The path's nodes stay in the tree (the guard): self.path is read as match reads it.
        if self.push_on_access:
            dropped = self.push_if_evictable(node)
            dropped_host = self.push_host_leaf(last_host)
        if ndev == 0:
            indices = new_empty_indices(self.numpy_arrays)
        else:
            indices = self.path_indices(ndev, length)
        return rc_make_match(_MatchResult, _MATCH_SLOTS, indices, node, length, host_length,
                             last_host)

    def match(self, tokens, extra_key=None, bint held=False):
        cdef TokenBuf b
        cdef int64_t ns
        cdef Py_ssize_t end, pos = 0, common, depth = 0, i
        cdef int64_t now
        cdef Node node, child, lower
        b.held = False
        self.take(held, "match_prefix")
        try:
            ns = self.read_query(tokens, &b, extra_key)
            if ns == _DECLINED:
                return None
            end = b.len - b.len % self.page_size
            self.lookups += 1
            self.queried_tokens += end
            if end == 0:
                return self.match_result(new_empty_indices(self.numpy_arrays), self.tree.root, 0)
            self.tree.clock += 1
            now = self.tree.clock
            node = self.tree.root
            node.last_access_time = now
            while ns >= 0 and pos < end:
                child = self.tree.find_match(node, b.ptr + pos, end - pos, ns, &common)
                if child is None:
                    break
                if common < child.key_len:
                    release_tokens(&b)
                    lower = child
                    child = self.tree.split(child, common)  # allocates: tokens are done
                    if self.host_tier and (<HostNode>lower).queued:
                        self.wt_queue.append(child)
                        (<HostNode>child).queued = True
                    lower = None
                    pos = end  # (the walk ends on the split)
                else:
                    pos += common
                child.last_access_time = now
                self.note_path(depth, child)
                depth += 1
                node = child
            release_tokens(&b)
            if self.host_tier:
                return self.host_match_result(depth)
            pos = 0
            for i in range(depth):
                pos += (<Node>self.path[i]).key_len
            if depth == 0:
                return self.match_result(new_empty_indices(self.numpy_arrays), self.tree.root, 0)
            self.matched_tokens += pos
            if self.push_on_access:
                dropped = self.push_if_evictable(node)
            return self.match_result(self.path_indices(depth, pos), node, pos)
        finally:
            release_tokens(&b)
            self.give(held)

    def insert(self, tokens, kv=None, extra_key=None, priority=0, bint held=False,
               hits_from=0, split_at=None, split_priority=0):
        cdef TokenBuf b, v
        cdef int64_t prio, ns, now, hits_after, split_end = -1, split_prio = 0
        cdef Py_ssize_t end, pos = 0, common, prefix_len
        cdef bint whole, split_here, private = extra_key is not None
        cdef Node node, child, leaf = None
        cdef uint64_t h
        cdef bint tiered = self.host_tier
        # A new leaf's tokens and values in one block (one allocation, one object), except
        # with a host tier, where a node can lose its device values and keep its key, and
        # for a long leaf (its allocations cost little beside its copies).
        cdef bint joined = kv is not None and not tiered, join
        cdef Py_ssize_t depth = 0, first_host = -1, adopt_base = 0, i
        cdef Node lower = None
        b.held = False
        v.held = False
        if type(priority) is not int:
            return None
        try:
            prio = PyLong_AsLongLong(priority)
        except OverflowError:
            return None
        # A path node counts a hit when it ends past hits_from tokens.
        if type(hits_from) is not int:
            return None
        try:
            hits_after = PyLong_AsLongLong(hits_from)
        except OverflowError:
            return None
        if hits_after < 0:
            return None
        # The prefix to insert again after the sequence (see the contract): read before the
        # call takes the guard, ints only (no __index__ runs inside the call).
        if split_at is not None:
            if type(split_at) is not int or type(split_priority) is not int:
                return None
            try:
                split_end = PyLong_AsLongLong(split_at)
                split_prio = PyLong_AsLongLong(split_priority)
            except OverflowError:
                return None
            if split_end < 0 or split_end % self.page_size:
                return None
            if tiered:
                raise ValueError("insert: split_at is not taken by a core with a host tier")
        self.take(held, "insert")
        try:
            if kv is not None and type(kv) is _Tensor and not kv.is_cpu:
                return None  # values on a device: cache.py slices them there
            if not self.acquire(tokens, &b, False, private):
                return None
            end = b.len - b.len % self.page_size
            whole = end == b.len
            if split_end > end:
                return None
            if kv is not None:
                if not self.acquire(kv, &v, True, private) or v.len < end:
                    return None
            if extra_key is None:
                ns = 0
            else:
                try:
                    ns = self.tree.find_namespace(extra_key)
                except TypeError:
                    return None  # unhashable: cache.py says so
                if ns < 0 and end:
                    ns = self.tree.make_namespace(extra_key)
            self.inserts += 1
            node = self.tree.root
            if end == 0:
                if whole:
                    self.tree.empty_inserted.add(extra_key)
                if split_end == 0:  # (the empty prefix)
                    self.inserts += 1
                    self.tree.empty_inserted.add(extra_key)
                return self.insert_result(0, node)
            self.tree.clock += 1
            now = self.tree.clock
            node.last_access_time = now
            leaf_key = leaf_values = adopt_values = None
            while pos < end:
                child = self.tree.find_match(node, b.ptr + pos, end - pos, ns, &common)
                if child is None:
                    break
                split_here = common < child.key_len
                if tiered and (<HostNode>child).host_only and first_host < 0:
                    # Host-only from here on (the invariant): the caller's values for the
                    # rest, read now (before anything allocates), for the nodes adopted.
                    first_host = depth
                    adopt_base = pos
                    if kv is not None:
                        adopt_values = PyBytes_FromStringAndSize(
                            <const char*>(v.ptr + pos), (end - pos) * sizeof(int64_t))
                if split_here:
                    if pos + common < end:
                        # The new leaf's tokens and values, read before the split allocates.
                        join = joined and end - pos - common <= _JOIN_MAX
                        leaf_key = leaf_block(b.ptr + pos + common,
                                              v.ptr + pos + common if kv is not None else NULL,
                                              end - pos - common, join)
                        if kv is not None:
                            leaf_values = leaf_key if join else PyBytes_FromStringAndSize(
                                <const char*>(v.ptr + pos + common),
                                (end - pos - common) * sizeof(int64_t))
                    lower = child
                    child = self.tree.split(child, common)
                child.last_access_time = now
                if pos + common > hits_after:
                    child.hit_count += 1
                if prio > child.priority:
                    child.priority = prio
                if tiered:
                    # (Host-only nodes on the path are adopted after the walk: adopt_path.)
                    self.note_path(depth, child)
                    depth += 1
                pos += common
                node = child
                if split_here:
                    break
            prefix_len = pos
            if first_host >= 0:
                prefix_len = adopt_base
            if pos < end:
                if leaf_key is None:
                    join = joined and end - pos <= _JOIN_MAX
                    leaf_key = leaf_block(b.ptr + pos, v.ptr + pos if kv is not None else NULL,
                                          end - pos, join)
                    if kv is not None:
                        leaf_values = leaf_key if join else PyBytes_FromStringAndSize(
                            <const char*>(v.ptr + pos), (end - pos) * sizeof(int64_t))
                release_tokens(&b)
                release_tokens(&v)
                leaf = self.tree.new_node(node, now)  # allocates: the inputs are done
                leaf.key_owner = leaf_key
                leaf.key_ptr = <const int64_t*>PyBytes_AS_STRING(leaf_key)
                leaf.key_len = end - pos
                if leaf_values is not None:
                    leaf.value_owner = leaf_values
                    leaf.value_ptr = <const int64_t*>PyBytes_AS_STRING(leaf_values)
                    if leaf_values is leaf_key:  # the values follow the tokens
                        leaf.value_ptr += end - pos
                leaf.priority = prio
                leaf.hit_count = 1 if end > hits_after else 0
                leaf.ns = ns
                leaf.extra_key = extra_key
                h = self.tree.page_hash(leaf.key_ptr, ns)
                if node.n_children and probe(node.slots, node.slot_mask, leaf.key_ptr,
                                             self.page_size, h, ns,
                                             node is self.tree.root) != NULL:
                    # The leaf's first page, as copied, is a sibling's: the walk read other
                    # tokens there, so another thread wrote them during the call.
                    # Nothing that counts has changed yet (adoption comes after this).
                    raise RuntimeError("token_ids changed while insert read them (written "
                                       "by another thread?); the sequence was not cached")
                if first_host >= 0:
                    self.adopt_path(depth, first_host, adopt_values)
                add_child(node, leaf, h)
                self.tree.node_count += 1
                if node is self.tree.root and ns:
                    self.tree.ns_roots[ns] = self.tree.ns_roots.get(ns, 0) + 1
                node = leaf
            elif first_host >= 0:
                self.adopt_path(depth, first_host, adopt_values)
            if whole:
                node.is_terminal = True
            release_tokens(&b)
            release_tokens(&v)
            if tiered:
                self.tiered_insert_end(depth, first_host, adopt_base, lower, leaf, held)
            if leaf is not None:
                if held:
                    self.new_leaf = leaf  # for cache.py's take_new_leaf()
                self.evictable += leaf.key_len
                self.inserted_tokens += leaf.key_len
                dropped = self.push_if_evictable(leaf)
            elif self.push_on_access or first_host >= 0:
                dropped = self.push_if_evictable(node)
            if split_end >= 0:
                dropped_too = self.insert_prefix_again(node, end, split_end, split_prio,
                                                       extra_key)
            return self.insert_result(prefix_len, node)

        finally:
            release_tokens(&b)
            release_tokens(&v)
            self.give(held)

    cdef object insert_prefix_again(self, Node last, Py_ssize_t end, Py_ssize_t split_end,
                                    int64_t prio, object extra_key):
        """``insert``'s ``split_at``, once the sequence ending at ``last`` (``end`` tokens,
        no host tier) is in: what inserting its first ``split_end`` tokens (page aligned)
        again with no values, ``prio`` and ``hits_from=split_end`` does, found from ``last``
        up instead of read from the tokens again. Returns what a push dropped."""
        cdef Node node = last, upper
        cdef Node root = self.tree.root
        cdef Py_ssize_t node_end = end
        cdef int64_t now
        self.inserts += 1
        if split_end == 0:
            self.tree.empty_inserted.add(extra_key)
            return None
        self.tree.clock += 1
        now = self.tree.clock
        # The path node the prefix ends in: the one with start < split_end <= its end.
        while node_end - node.key_len >= split_end:
            node_end -= node.key_len
            node = <Node>node.parent_ptr
        if node_end > split_end:
            node = self.tree.split(node, node.key_len - (node_end - split_end))
        node.is_terminal = True
        last = node
        # (the split allocated: the path is read from here on, after it)
        while node is not root:
            node.last_access_time = now
            if prio > node.priority:
                node.priority = prio
            node = <Node>node.parent_ptr
        root.last_access_time = now
        if self.push_on_access:
            return self.push_if_evictable(last)
        return None

    cdef void adopt_path(self, Py_ssize_t depth, Py_ssize_t first_host,
                         object adopt_values) noexcept:
        """An insert's adoption, once its walk and its new leaf's check are done: the
        path's host-only nodes from ``first_host`` on (all of them are, below the first)
        take the caller's slots for their tokens (``adopt_values``, in path order; None:
        the key is the values) and are on the device again. Calls nothing."""
        cdef Py_ssize_t i
        cdef Node child
        cdef const int64_t* values = NULL
        if adopt_values is not None:
            values = <const int64_t*>PyBytes_AS_STRING(adopt_values)
        for i in range(first_host, depth):
            child = <Node>self.path[i]
            if values != NULL:
                child.value_owner = adopt_values
                child.value_ptr = values
                values += child.key_len
            child.value_off = 0
            (<HostNode>child).host_only = False
            (<HostNode>child.parent_ptr).n_host_kids -= 1
            self.evictable += child.key_len

    cdef int tiered_insert_end(self, Py_ssize_t depth, Py_ssize_t first_host,
                               Py_ssize_t start, Node lower, Node leaf, bint held) except -1:
        """An insert's host-tier bookkeeping, after its walk (which allocated nothing):
        the write-through queue in path order (a split node's upper half follows the lower
        half when that was queued), then the new leaf; the nodes adopted, for
        ``take_adopted`` (held)."""
        cdef Py_ssize_t i
        cdef Node child
        # The path's nodes stay in the tree (the guard holds): self.path is read as match
        # reads it after its own allocations.
        if held:
            adopted = []
            if first_host >= 0:
                for i in range(first_host, depth):
                    child = <Node>self.path[i]
                    adopted.append((child, start))
                    start += child.key_len
            self.adopted = adopted
        if self.write_through_hits > 0:
            # A split of a queued node queued its upper half first (as the split itself
            # does in a match), then the path's nodes due, top-down.
            if lower is not None and (<HostNode>lower).queued and depth:
                child = <Node>self.path[depth - 1]
                if not (<HostNode>child).queued:
                    self.wt_queue.append(child)
                    (<HostNode>child).queued = True
            for i in range(depth):
                self.queue_if_due(<Node>self.path[i])
            if leaf is not None:
                self.queue_if_due(leaf)
        return 0

    def take_adopted(self):
        """The ``(node, start)`` of the nodes the last ``held`` insert adopted (a list,
        empty if none), forgotten here."""
        adopted = self.adopted
        self.adopted = None
        return [] if adopted is None else adopted

    def exists(self, tokens, extra_key=None, bint held=False):
        cdef TokenBuf b
        cdef int64_t ns
        cdef Py_ssize_t n, pos = 0, klen, mask
        cdef Py_ssize_t page_size = self.page_size
        cdef ChildSlot* table
        cdef ChildSlot* slot = NULL
        b.held = False
        self.take(held, "exists")
        try:
            ns = self.read_query(tokens, &b, extra_key)
            if ns == _DECLINED:
                return None
            n = b.len
            if n % page_size:
                return False
            if n == 0:
                release_tokens(&b)
                return extra_key in self.tree.empty_inserted
            if ns < 0:
                return False
            # Walk on the slots' mirrors: a step needs the child object only for its key,
            # whose fetch overlaps the next slot's.
            table = self.tree.root.slots
            mask = self.tree.root.slot_mask
            while pos < n:
                if table == NULL:
                    return False
                slot = probe(table, mask, b.ptr + pos, page_size,
                             self.tree.page_hash(b.ptr + pos, ns), ns, pos == 0)
                if slot == NULL:
                    return False
                klen = slot.shape & _LONG_KEY
                if klen == _LONG_KEY:
                    klen = (<Node>slot.node).key_len
                if klen > n - pos:
                    return False
                table = slot.table
                mask = shape_mask(slot.shape)
                if klen + page_size <= n - pos and table != NULL:
                    rc_prefetch(&table[self.tree.page_hash(b.ptr + pos + klen, ns)
                                       & <uint64_t>mask])
                if memcmp((<Node>slot.node).key_ptr, b.ptr + pos,
                          klen * sizeof(int64_t)) != 0:
                    return False
                pos += klen
            return bool((<Node>slot.node).is_terminal)
        finally:
            release_tokens(&b)
            self.give(held)

    cdef Py_ssize_t walk_length(self, const int64_t* buf, Py_ssize_t end, int64_t ns) noexcept:
        """Read-only: the cached page-aligned prefix length of buf[:end] (no split)."""
        cdef Py_ssize_t pos = 0, common
        cdef Node node = self.tree.root
        cdef Node child
        while ns >= 0 and pos < end:
            child = self.tree.find_match(node, buf + pos, end - pos, ns, &common)
            if child is None:
                break
            pos += common
            if common < child.key_len:
                break
            node = child
        return pos

    cdef Py_ssize_t walk_device(self, const int64_t* buf, Py_ssize_t end, int64_t ns) noexcept:
        """``walk_length`` with a host tier: the length on the device (a match stops
        counting at the first host-only node; a partly matched one counts as a split would)."""
        cdef Py_ssize_t pos = 0, common
        cdef Node node = self.tree.root
        cdef Node child
        while ns >= 0 and pos < end:
            child = self.tree.find_match(node, buf + pos, end - pos, ns, &common)
            if child is None or (<HostNode>child).host_only:
                break
            pos += common
            if common < child.key_len:
                break
            node = child
        return pos

    def token_array(self, tokens):
        """The common token inputs as a new int64 array; None for anything else. Called by
        cache.py's validation path, which holds the guard (the scratch buffer is its own)."""
        cdef TokenBuf b
        b.held = False
        if not self.acquire(tokens, &b, False, False):
            return None
        try:
            owner = PyBytes_FromStringAndSize(<const char*>b.ptr, b.len * sizeof(int64_t))
        finally:
            release_tokens(&b)
        return np.frombuffer(owner, dtype=np.int64)

    def revert_insert(self, list adopted, leaf, bint held=False):
        """Undo the tiers of a ``held`` insert whose device values could not be set; see
        _core_py's docstring. Calls nothing out but detach_leaf's namespace bookkeeping
        (only for a leaf of the root: nothing was adopted then); it works on its own
        references to the nodes, never on a pointer read before."""
        cdef Node node, top = None
        cdef HostNode hnode
        cdef Py_ssize_t i
        # The node kind of this core's tree: a node of another kind is in no state to undo.
        node_type = HostNode if self.host_tier else Node
        dropped = []  # values and heap entries let go: released after the guard
        self.take(held, "insert")
        try:
            if leaf is not None and not isinstance(leaf, Node):
                raise TypeError("revert_insert needs the insert's new leaf or None")
            nodes = []  # our own references, whatever the caller's list becomes
            for item in adopted:
                if not isinstance(item[0], Node):
                    raise TypeError("revert_insert needs take_adopted()'s (node, start) pairs")
                nodes.append(item[0])
            # A node of another cache (or kind) is in no state this call can undo: left alone.
            if leaf is not None and type(leaf) is node_type:
                node = <Node>leaf
                if (not node.evicted and node.parent_ptr != NULL and node.n_children == 0
                        and node.lock_ref == 0 and self.tree.holds(node)
                        and not (self.host_tier and ((<HostNode>node).host_only
                                                     or (<HostNode>node).host_owner
                                                     is not None))):
                    self.evictable -= node.key_len
                    self.inserted_tokens -= node.key_len
                    if self.node_tags and node in self.node_tags:  # as an evicted leaf's
                        dropped.append(self.move_tags(node, <Node>node.parent_ptr))
                    self.heap.drop_rank(node)
                    top = self.tree.detach_leaf(node, dropped)  # may run user code, last
            for i in range(len(nodes) - 1, -1, -1):
                if type(nodes[i]) is not HostNode or not self.host_tier:
                    continue  # (no host tier: nothing is ever adopted)
                hnode = <HostNode>nodes[i]
                if (hnode.evicted or hnode.host_only or hnode.host_owner is None
                        or hnode.lock_ref or hnode.parent_ptr == NULL
                        or hnode.n_children != hnode.n_host_kids
                        or not self.tree.holds(hnode)):
                    continue
                dropped.append(hnode.value_owner)
                hnode.value_owner = None
                hnode.value_ptr = NULL
                hnode.value_off = 0
                hnode.host_only = True
                top = <Node>hnode.parent_ptr
                (<HostNode>top).n_host_kids += 1
                self.evictable -= hnode.key_len
                if hnode.n_children == 0:
                    dropped.append(self.push_host_leaf(hnode))
            if top is not None and not top.evicted:
                if self.host_tier and (<HostNode>top).host_only:
                    dropped.append(self.push_host_leaf(top))
                else:
                    dropped.append(self.push_if_evictable(top))
        finally:
            self.give(held)
        del dropped[:]

    def take_new_leaf(self):
        """The leaf the last ``held`` insert made (None if none), forgotten here."""
        leaf = self.new_leaf
        self.new_leaf = None
        return leaf

    def walk(self, tokens, extra_key=None):
        cdef TokenBuf b
        cdef int64_t ns
        b.held = False
        self.take(False, "walk")
        try:
            if not self.acquire(tokens, &b, False, extra_key is not None):
                raise TypeError("walk takes the common token inputs only")
            ns = self.tree.find_namespace(extra_key)
            if self.host_tier:
                return self.walk_device(b.ptr, b.len - b.len % self.page_size, ns)
            return self.walk_length(b.ptr, b.len - b.len % self.page_size, ns)
        finally:
            release_tokens(&b)
            self.give(False)

    # -- locks and eviction ----------------------------------------------------------------
    def lock(self, node, int delta, bint held=False):
        cdef Py_ssize_t moved
        self.take(held, "inc_lock_ref" if delta > 0 else "dec_lock_ref")
        try:
            moved = self.tree.lock_path(node, delta)
            if delta > 0:
                self.evictable -= moved
                self.protected += moved
            elif moved:
                self.evictable += moved
                self.protected -= moved
                # Only the bottom node can have become an evictable leaf.
                dropped = self.push_if_evictable(<Node>node)
            return moved
        finally:
            self.give(held)

    def set_rank(self, node, rank, bint held=False):
        cdef Tree tree = self.tree
        self.take(held, "set_rank")
        try:
            if self.host_tier:
                raise rank_needs_one_tier()
            if node is tree.root:
                raise ValueError("the root has no eviction rank (it is never evicted)")
            tree._check_member(node)
            if type(rank) is not int or not 0 <= rank <= INT64_MAX:
                raise bad_rank("rank", rank)
            dropped = self.heap.set_rank_of(<Node>node, <uint64_t>PyLong_AsLongLong(rank), True)
        finally:
            self.give(held)

    def tag_session(self, node, session, bint held=False):
        cdef Tree tree = self.tree
        cdef Node leaf, ancestor = None
        self.take(held, "tag_session")
        try:
            if self.host_tier:
                raise rank_needs_one_tier()
            if type(session) is not int or not 0 <= session <= INT64_MAX:
                raise bad_session(session)
            if node is tree.root:
                return False  # the root is never tagged (nor evicted)
            tree._check_member(node)
            leaf = <Node>node
            tags = self.node_tags.get(leaf)
            if tags is not None and session in tags:
                return False
            tagged = self.session_nodes.get(session)
            if tagged is not None:  # the nearest ancestor it tags gives its tag to the leaf
                ancestor = <Node>leaf.parent_ptr
                while ancestor is not tree.root and ancestor not in tagged:
                    ancestor = <Node>ancestor.parent_ptr
                if ancestor is tree.root:
                    ancestor = None
            # Every check is done: only the tables and ranks change from here.
            if tags is None:
                tags = self.node_tags[leaf] = set()
            if tagged is None:
                tagged = self.session_nodes[session] = set()
            tags.add(session)
            tagged.add(leaf)
            dropped = [self.heap.set_rank_of(leaf, len(tags), True)]
            if ancestor is not None:
                dropped.append(self.drop_tag(ancestor, session))
            return True
        finally:
            self.give(held)

    def untag_session(self, session, bint held=False):
        self.take(held, "untag_session")
        try:
            if type(session) is not int or not 0 <= session <= INT64_MAX:
                raise bad_session(session)
            tagged = self.session_nodes.get(session)
            if tagged is None:
                return 0
            nodes = tuple(tagged)
            dropped = [self.drop_tag(<Node>node, session) for node in nodes]
            return len(nodes)
        finally:
            self.give(held)

    def session_tags(self, node):
        self.tree._check_member(node)
        return tuple(sorted(self.node_tags.get(node, ())))

    def tagged_nodes(self, session):
        if type(session) is not int:
            raise bad_session(session)
        return tuple(self.session_nodes.get(session, ()))

    cdef object drop_tag(self, Node node, object session):
        """``session`` no longer tags ``node`` (it does now): the tables and the node's rank;
        returns what the heap let go."""
        tags = self.node_tags[node]
        tags.discard(session)
        tagged = self.session_nodes[session]
        tagged.discard(node)
        if not tagged:
            del self.session_nodes[session]
        if not tags:
            del self.node_tags[node]
        return self.heap.set_rank_of(node, len(tags), True)

    cdef object move_tags(self, Node node, Node parent):
        """A tagged leaf leaves the tree: each of its sessions tags ``parent`` instead (not
        the root; a session tagging it already just loses the leaf), whose rank becomes its
        tag count, without a push (its own removal pushes it). Returns the leaf's old tags."""
        cdef bint inherit = parent is not self.tree.root
        tags = self.node_tags.pop(node)
        parent_tags = self.node_tags.get(parent) if inherit else None
        for session in tags:
            tagged = self.session_nodes[session]
            tagged.discard(node)
            if inherit and (parent_tags is None or session not in parent_tags):
                if parent_tags is None:
                    parent_tags = self.node_tags[parent] = set()
                parent_tags.add(session)
                tagged.add(parent)
            elif not tagged:
                del self.session_nodes[session]
        if parent_tags is not None:
            self.heap.set_rank_of(parent, len(parent_tags), False)
        return tags

    def pop_victim(self, bint held=False):
        stale = []  # dropped entries, released when the call returns
        self.take(held, "evict")
        try:
            self.prefetch_victims()
            return self.heap.pop_entry(stale)
        finally:
            self.give(held)

    cdef void prefetch_victims(self) noexcept:
        """Start the memory reads of the next victims' removal a few pops ahead: in a large
        cache each is a miss (the node, its key, its parent's slot), and an evict loop
        otherwise waits for them one after another. Only the run (popped in order) is looked
        at; every pointer read is of a node an entry owns, so nothing here can dangle."""
        cdef EvictionHeap heap = self.heap
        cdef Node node, parent
        cdef Py_ssize_t n = heap.run_size
        if n > _AHEAD_NODE:
            rc_prefetch(heap.run_at(_AHEAD_NODE).node)
        if n > _AHEAD_KEY:
            node = <Node>heap.run_at(_AHEAD_KEY).node
            rc_prefetch(node.key_ptr)
            rc_prefetch(node.parent_ptr)
        if n > _AHEAD_SLOT:
            node = <Node>heap.run_at(_AHEAD_SLOT).node
            if node.parent_ptr != NULL:
                parent = <Node>node.parent_ptr
                if parent.slots != NULL:
                    rc_prefetch(&parent.slots[node.slot_hash & <uint64_t>parent.slot_mask])

    def remove_leaf(self, Node node, bint held=False):
        cdef Py_ssize_t size = node.key_len
        cdef Node parent
        dropped = []  # the leaf's value and stale heap entries, released on return
        self.take(held, "evict")
        try:
            if not node.evicted:
                self.tree._check_member(node)  # another cache's node (maybe another kind)
            parent = self.tree.detach_leaf(node, dropped)
            if self.node_tags and node in self.node_tags:
                dropped.append(self.move_tags(node, parent))
            self.heap.drop_rank(node)
            self.evictable -= size
            self.evictions += 1
            self.evicted_tokens += size
            dropped.append(self.push_if_evictable(parent))
            return size
        finally:
            self.give(held)

    cdef int hand_over_one(self, object free_callback, list handed, list garbage,
                           str what) except -1:
        """An evict loop's per-node hand-over, as the pure core's ``_hand_over_one``: the
        indices in ``handed[0]`` to ``free_callback`` with the guard released; the guard is
        not held on an exception."""
        value = handed[0]
        handed[0] = None
        self.guard.busy = 0
        del garbage[:]
        free_callback(value)
        value = None
        self.guard.enter(what)
        return 0

    cdef int hand_over_batch(self, object free_callback, object value,
                             object error) except -1:
        """A batch eviction's end, outside the guard: ``value`` (the ``FreedBatch``'s take:
        None, one array, or parts to join) to ``free_callback`` in one call, then the
        loop's ``error`` re-raised (``_handover.hand_over_batch``)."""
        _hand_over_batch(free_callback, value, error,
                         batch_join(self.numpy_arrays) if type(value) is list else None)
        return 0

    def evict(self, num_tokens, free_callback=None, bint batch=False, on_remove=None,
              backup=None, on_backup=None, free_host=None, on_remove_host=None, keep=None,
              bint page_ids=False):
        """The whole evict loop (see ``_core_py``): victims popped, detached and counted
        here; each victim's index tensor made as a match's (one block, one copy), or all of
        them copied into one block for a ``batch`` callback (with ``page_ids``, their page
        ids). The guard is released around each per-node callback; after it the loop reads
        everything afresh (the heap, the next victim): nothing read before a callback is
        used after it."""
        cdef int64_t target, freed = 0
        cdef Py_ssize_t size
        cdef Py_ssize_t pages_of = 0
        cdef Node node, parent
        cdef bint per_node = free_callback is not None and not batch
        cdef bint collect = free_callback is not None and batch
        cdef bint holding
        target = token_target(num_tokens)
        if page_ids:
            if not batch or self.host_tier:
                raise ValueError("evict(page_ids=True) needs batch=True and a cache "
                                 "without a host tier")
            pages_of = self.page_size
        if self.host_tier:
            return self.evict_tiered(target, free_callback, batch, on_remove, backup,
                                     on_backup, free_host, on_remove_host, keep)
        garbage = []  # stale entries and dropped values: released outside the guard
        cdef FreedBatch freed_batch = FreedBatch(target, self.numpy_arrays) if collect else None
        # A per-node callback's argument, from its victim to the call (see hand_over_one).
        cdef list handed = [None] if per_node else None
        value = error = None
        self.guard.enter("evict")
        holding = True
        try:
            while freed < target:
                self.prefetch_victims()
                node = self.heap.pop_entry(garbage)
                if node is None:
                    break
                try:
                    parent_rank = None
                    if on_remove is not None:
                        parent_rank = on_remove(node)
                        if parent_rank is not None and (type(parent_rank) is not int
                                                        or not 0 <= parent_rank <= INT64_MAX):
                            raise bad_rank("on_remove's answer (the parent's rank)",
                                           parent_rank)
                        # The call out is behind: the node must still be this heap's victim.
                        if not self.heap.usable(node) or node.parent_ptr == NULL:
                            raise RuntimeError(f"evict: node {node.id} changed during a "
                                               "callback")
                    if per_node:
                        handed[0] = victim_value(node, True)
                    elif collect:
                        collect_value(freed_batch, node, pages_of)
                    if parent_rank is not None and node.parent_ptr != <PyObject*>self.tree.root:
                        # Last: nothing after it raises. The parent is no leaf yet: the push
                        # below (once it may be one) uses its new rank. (The node is ours and
                        # still attached: nothing ran since the checks but plain C.)
                        self.heap.set_rank_of(<Node>node.parent_ptr,
                                              <uint64_t>PyLong_AsLongLong(parent_rank), False)
                    if self.node_tags and node in self.node_tags:
                        # Its sessions' tags move up before the parent can be pushed.
                        garbage.append(self.move_tags(node, <Node>node.parent_ptr))
                except BaseException:
                    garbage.append(self.heap.push_entry(node))  # still an evictable leaf
                    raise
                size = node.key_len
                parent = self.tree.detach_leaf(node, garbage)
                self.heap.drop_rank(node)
                self.evictable -= size
                self.evictions += 1
                self.evicted_tokens += size
                garbage.append(self.push_if_evictable(parent))
                freed += size
                if per_node:
                    holding = False
                    node = parent = None
                    self.hand_over_one(free_callback, handed, garbage,
                                       "evict, after its free_callback")
                    holding = True
        except BaseException as exc:
            if not collect:
                raise
            error = exc  # batch: what was evicted is still handed over, then it re-raises
        finally:
            try:
                if collect:
                    value = freed_batch.take()
            finally:
                if holding:
                    self.guard.busy = 0
        del garbage[:]
        node = parent = None
        # batch: one call with every freed index, outside the guard; then the loop's error
        if collect:
            self.hand_over_batch(free_callback, value, error)
        return freed

    cdef int host_leave(self, HostNode node, object free_host, object on_remove_host,
                        list garbage) except -1:
        """A host-only node without children leaves the tree as in ``evict_host``:
        ``on_remove_host`` and its host indices (a new CPU index array) first, then, read
        afresh, it is detached and counted, then ``free_host`` gets the indices. Nothing
        read before a call out is used after it."""
        cdef Node parent
        if on_remove_host is not None:
            on_remove_host(node)
        host = block_tensor(host_data(node), node.key_len, self.numpy_arrays)
        if (node.evicted or not node.host_only or node.host_owner is None
                or node.n_children or node.parent_ptr == NULL):
            raise RuntimeError(f"evict: node {node.id} changed during a callback")
        self.host_size -= node.key_len
        self.host_evictions += 1
        self.host_evicted_tokens += node.key_len
        parent = self.tree.detach_leaf(node, garbage)  # drops the host value too
        garbage.append(self.push_host_leaf(parent))
        parent = None
        free_host(host)
        return 0

    cdef bint host_leaf_leaves(self, object free_host, object on_remove_host,
                               list garbage, object keep) except -1:
        """The first host leaf in policy order not in ``keep`` leaves (``host_leave``);
        False if none. The kept leaves it passes stay on the host heap."""
        cdef Node node
        passed = []
        try:
            node = self.host_heap.pop_entry(garbage)
            while node is not None and keep is not None:
                passed.append(node)  # pushed back whatever ``in`` does
                if node not in keep:
                    passed.pop()
                    break
                node = self.host_heap.pop_entry(garbage)
        finally:
            for kept in passed:
                garbage.append(self.host_heap.push_entry(<Node>kept))
        if node is None:
            return False
        try:
            self.host_leave(node, free_host, on_remove_host, garbage)
        except BaseException:
            if self.host_heap.usable(node):
                garbage.append(self.host_heap.push_entry(node))  # still a host leaf
            raise
        return True

    cdef bint holds_kept(self, Node top, object keep) except -1:
        """Whether a node of ``top``'s subtree below it is in ``keep``."""
        cdef Node node
        cdef Py_ssize_t i
        cdef PyObject* child
        if keep is None:
            return False
        stack = [top]
        while stack:
            node = <Node>stack.pop()
            if node is not top and node in keep:
                return True
            if node.slots != NULL:
                for i in range(node.slot_mask + 1):
                    child = node.slots[i].node
                    if child != NULL:
                        stack.append(<Node>child)
        return False

    cdef int drop_host_below(self, Node top, object free_host, object on_remove_host,
                             list garbage) except -1:
        """Every (host-only) descendant of the device leaf ``top`` leaves the tree,
        bottom-up (``host_leave``). Works on its own references (a Python list)."""
        cdef Node node
        cdef Py_ssize_t i
        cdef PyObject* child
        order = []  # (-depth, id, node): deepest first, then by id (as the pure core)
        stack = [(top, 0)]
        while stack:
            item = stack.pop()
            node = <Node>item[0]
            depth = item[1]
            if node is not top:
                order.append((-depth, node.id, node))
            if node.slots != NULL:
                for i in range(node.slot_mask + 1):
                    child = node.slots[i].node
                    if child != NULL:
                        stack.append((<Node>child, depth + 1))
        order.sort()
        for item in order:  # every node after its descendants
            self.host_leave(<HostNode>item[2], free_host, on_remove_host, garbage)
        return 0

    cdef object evict_tiered(self, int64_t target, object free_callback, bint batch,
                             object on_remove, object backup, object on_backup,
                             object free_host, object on_remove_host, object keep):
        """``evict`` with a host tier (see ``_core_py``): a victim with a host copy, or
        given one by ``backup`` (write_back), is demoted to the host; one without is deleted,
        or skipped (pushed back after the loop) when it has host-only children. Every call
        out (backup, on_backup, on_remove, free_callback, torch) comes before the writes of
        its victim, which re-read the node: nothing read before a call is used after it."""
        cdef int64_t freed = 0
        cdef Py_ssize_t size
        cdef HostNode node  # (the heap of a tree with a host tier holds HostNodes only)
        cdef Node parent
        cdef bint per_node = free_callback is not None and not batch
        cdef bint collect = free_callback is not None and batch
        cdef bint use_backup = backup is not None and self.write_through_hits == 0
        cdef bint holding
        cdef Py_ssize_t added = 0  # this victim's indices already in the batch (backup's)
        cdef FreedBatch freed_batch = FreedBatch(target, self.numpy_arrays) if collect else None
        cdef list handed = [None] if per_node else None  # see hand_over_one
        garbage = []  # stale entries and dropped values: released outside the guard
        skipped = []  # device leaves that cannot leave the tree: pushed back after the loop
        skipping = set()  # the same nodes, to drop their other heap entries
        value = error = host = None
        self.guard.enter("evict")
        holding = True
        try:
            while freed < target:
                node = self.heap.pop_entry(garbage)
                if node is None:
                    break
                if node in skipping:
                    continue  # another entry of a node skipped already
                if keep is not None:
                    skipped.append(node)  # passed over, pushed back after the loop ...
                    if node in keep:
                        skipping.add(node)
                        continue
                    skipped.pop()  # ... unless ``in`` said no
                value = None
                added = 0
                try:
                    if node.host_owner is None:
                        host = None
                        if use_backup:
                            if collect and (node.value_ptr != NULL or node.value_owner is None):
                                # backup's tensor is the batch's copy of the indices (one
                                # copy for both): a tensor over the batch's tail.
                                freed_batch.add_ints(node.value_ptr if node.value_ptr != NULL
                                                     else node.key_ptr, node.key_len)
                                added = node.key_len
                                value = freed_batch.tail(added)
                            else:
                                value = victim_value(node, False)  # what backup and free_callback get
                            host = backup(value)
                            # No room: host leaves leave in policy order, one at a time,
                            # and backup is asked again after each.
                            while (host is None and free_host is not None
                                   and self.host_leaf_leaves(free_host, on_remove_host,
                                                             garbage, keep)):
                                host = backup(value)
                            if collect:
                                value = None  # backup's alone: the batch has the indices
                            if host is not None:
                                answer = host
                                host = kept_answer(answer, node.key_len, self.numpy_arrays)
                        if host is None:
                            if node.n_children and (free_host is None
                                                    or self.holds_kept(node, keep)):
                                # host-only children: it cannot leave the tree
                                skipped.append(node)
                                skipping.add(node)
                                value = None
                                if added:
                                    added = 0
                                    freed_batch.drop_tail(node.key_len)
                                continue
                            if node.n_children:  # they leave first, slots to free_host
                                self.drop_host_below(node, free_host, on_remove_host, garbage)
                        else:
                            # Read afresh after the calls: the bytes must fit the node now.
                            if (node.evicted or node.host_only or node.host_owner is not None
                                    or len(<bytes>host) != node.key_len * <Py_ssize_t>sizeof(int64_t)):
                                raise answer_not_kept(RuntimeError(
                                    f"evict: node {node.id} changed during its backup"), answer)
                            node.host_owner = host
                            host = answer = None
                            self.host_size += node.key_len
                            self.backed_up_tokens += node.key_len
                            if on_backup is not None:
                                on_backup(node)
                    if on_remove is not None:
                        on_remove(node)
                    if per_node and value is None:
                        value = victim_value(node, False)
                    if collect and not added:
                        collect_value(freed_batch, node)
                    # The last call out is behind: the node must still be this heap's victim.
                    if not self.heap.usable(node) or (node.host_owner is None
                                                      and node.n_children):
                        raise RuntimeError(f"evict: node {node.id} changed during a callback")
                except BaseException:
                    garbage.append(self.heap.push_entry(node))  # still a device leaf
                    if added:  # the victim stays: its indices leave the batch
                        value = None
                        freed_batch.drop_tail(added)
                    raise
                size = node.key_len
                if node.host_owner is not None:
                    parent = self.demote(node, garbage)
                else:
                    parent = self.tree.detach_leaf(node, garbage)
                    self.evictable -= size
                    self.evictions += 1
                    self.evicted_tokens += size
                    garbage.append(self.push_if_evictable(parent))
                freed += size
                if per_node:
                    holding = False
                    node = parent = None
                    handed[0] = value
                    value = None
                    self.hand_over_one(free_callback, handed, garbage,
                                       "evict, after its free_callback")
                    holding = True
        except BaseException as exc:
            if not collect:
                raise
            error = exc  # batch: what was evicted is still handed over, then it re-raises
        finally:
            try:
                if skipped and not holding and not self.guard.busy:
                    self.guard.busy = 1
                    holding = True
                if holding:
                    for node in skipped:
                        garbage.append(self.push_if_evictable(node))
                value = None  # a victim's tensor for backup is not the batch's
                if collect:
                    value = freed_batch.take()
            finally:
                if holding:
                    self.guard.busy = 0
        del garbage[:]
        del skipped[:]
        skipping.clear()
        node = parent = None
        # batch: one call with every freed index, outside the guard; then the loop's error
        if collect:
            self.hand_over_batch(free_callback, value, error)
        return freed

    def evict_host(self, num_tokens, free_callback=None, bint batch=False, on_remove=None,
                   keep=None):
        """Evict host leaves in policy order, passing over those in ``keep`` (see
        ``_core_py``): each victim's host indices (a new CPU int64 tensor) go to
        ``free_callback``, per node with the guard released around the call, or all at once
        with ``batch``."""
        cdef int64_t target, freed = 0
        cdef Py_ssize_t size
        cdef HostNode node  # (the host heap holds HostNodes only)
        cdef Node parent
        cdef bint per_node = free_callback is not None and not batch
        cdef bint collect = free_callback is not None and batch
        cdef bint holding
        target = token_target(num_tokens)
        garbage = []
        passed = []  # host leaves in ``keep``: pushed back after the loop
        cdef FreedBatch freed_batch = FreedBatch(target, self.numpy_arrays) if collect else None
        cdef list handed = [None] if per_node else None  # see hand_over_one
        value = error = None
        self.guard.enter("evict_host")
        holding = True
        try:
            while freed < target:
                node = self.host_heap.pop_entry(garbage)
                if node is None:
                    break
                if keep is not None:
                    passed.append(node)  # pushed back after the loop whatever ``in`` does
                    if node in keep:
                        continue
                    passed.pop()
                try:
                    if on_remove is not None:
                        on_remove(node)
                    if per_node:
                        handed[0] = block_tensor(host_data(node), node.key_len,
                                                 self.numpy_arrays)
                    if not self.host_heap.usable(node) or node.host_owner is None:
                        raise RuntimeError(f"evict_host: node {node.id} changed during a "
                                           "callback")
                    if collect:
                        freed_batch.add_ints(host_data(node), node.key_len)
                except BaseException:
                    garbage.append(self.host_heap.push_entry(node))  # still a host leaf
                    raise
                size = node.key_len
                parent = self.tree.detach_leaf(node, garbage)  # drops the host value too
                self.host_size -= size
                self.host_evictions += 1
                self.host_evicted_tokens += size
                garbage.append(self.push_host_leaf(parent))
                freed += size
                if per_node:
                    holding = False
                    node = parent = None
                    self.hand_over_one(free_callback, handed, garbage,
                                       "evict_host, after its free_callback")
                    holding = True
        except BaseException as exc:
            if not collect:
                raise
            error = exc
        finally:
            try:
                if passed and not holding and not self.guard.busy:
                    self.guard.busy = 1
                    holding = True
                if holding:
                    for node in passed:
                        if self.host_heap.usable(node):
                            garbage.append(self.host_heap.push_entry(node))
                if collect:
                    value = freed_batch.take()
            finally:
                if holding:
                    self.guard.busy = 0
        del garbage[:]
        del passed[:]
        node = parent = None
        if collect:
            self.hand_over_batch(free_callback, value, error)
        return freed

    def next_victim(self, bint host=False, keep=None):
        """The node ``evict`` (``host``: ``evict_host``) would take first, passing over
        those in ``keep`` (see ``_core_py``); every live entry looked at goes back."""
        cdef EvictionHeap heap = self.host_heap if host else self.heap
        cdef Node node
        garbage = []
        passed = []
        self.guard.enter("next_victim")
        try:
            node = heap.pop_entry(garbage)
            while node is not None:
                passed.append(node)
                if keep is None or node not in keep:
                    return node
                node = heap.pop_entry(garbage)
            return None
        finally:
            for node in passed:
                garbage.append(heap.push_entry(node))
            self.guard.busy = 0
            node = None
            del garbage[:]
            del passed[:]

    cdef HostNode device_node(self, object node, str what):
        """``node`` checked to be a node of this tree on the device, not the root."""
        if not self.host_tier:
            raise ValueError(f"{what} needs a core with a host tier")
        self.tree._check_member(node)
        if node is self.tree.root:
            raise ValueError(f"{what}: the root holds no tokens")
        # (a member of a tree with a host tier: a HostNode)
        if (<HostNode>node).host_only:
            raise ValueError(f"{what}: node {(<HostNode>node).id} is only on the host"
                             + (" (evict_host removes it)" if what == "drop_host_copy" else ""))
        return <HostNode>node

    def back_up(self, node, host, on_backup=None):
        """Give a node on the device its host copy (see ``_core_py``)."""
        cdef HostNode n
        self.guard.enter("back_up")
        try:
            n = self.device_node(node, "back_up")
            if n.host_owner is not None:
                raise ValueError(f"back_up: node {n.id} already has a host copy")
            answer = host
            host = kept_answer(answer, n.key_len, self.numpy_arrays)
            # Read afresh after the checks (a torch hook may have run).
            if (n.evicted or n.host_only or n.host_owner is not None
                    or len(<bytes>host) != n.key_len * <Py_ssize_t>sizeof(int64_t)):
                raise answer_not_kept(RuntimeError(
                    f"back_up: node {n.id} changed during the call"), answer)
            n.host_owner = host
            self.host_size += n.key_len
            self.backed_up_tokens += n.key_len
            if on_backup is not None:
                on_backup(n)
        finally:
            self.guard.busy = 0

    def drop_host_copy(self, node, on_remove_host=None):
        """Take the host copy of a node on the device (see ``_core_py``)."""
        cdef HostNode n
        self.guard.enter("drop_host_copy")
        try:
            n = self.device_node(node, "drop_host_copy")
            if n.host_owner is None:
                raise ValueError(f"drop_host_copy: node {n.id} has no host copy")
            if on_remove_host is not None:
                on_remove_host(n)
            if n.evicted or n.host_only or n.host_owner is None:
                raise RuntimeError(f"drop_host_copy: node {n.id} changed during a callback")
            host = block_tensor(host_data(n), n.key_len, self.numpy_arrays)
            old = n.host_owner
            n.host_owner = None
            self.host_size -= n.key_len
            return host
        finally:
            self.guard.busy = 0
            old = None

    def write_through(self, backup, on_backup=None):
        """Copy the queued nodes to the host, FIFO (see ``_core_py``); the tokens copied."""
        cdef int64_t copied = 0
        cdef Py_ssize_t size, refused = 0
        cdef HostNode node
        garbage = []
        skipped = []  # nodes backup had no room for, in queue order: put back first
        self.guard.enter("write_through")
        try:
            queue = self.wt_queue
            while queue:
                node = <HostNode>queue[0]  # (queued by this core: its HostNodes)
                if node.evicted or node.host_only or node.host_owner is not None:
                    garbage.append(queue.popleft())
                    node.queued = False
                    continue
                size = node.key_len
                if refused and size >= refused:
                    skipped.append(queue.popleft())  # no room for it either: not asked
                    continue
                host = backup(victim_value(node, False))  # an error: the node stays queued
                if host is None:  # no room for this one now: retried on a later call
                    if not queue or queue[0] is not node:
                        raise RuntimeError(f"write_through: node {node.id} changed during "
                                           "its backup")
                    skipped.append(queue.popleft())
                    refused = size
                    if size <= self.page_size:
                        break  # no queued node is smaller
                    continue
                answer = host
                host = kept_answer(answer, node.key_len, self.numpy_arrays)
                # Read afresh after the calls.
                if (not queue or queue[0] is not node
                        or node.evicted or node.host_only or node.host_owner is not None
                        or len(<bytes>host) != node.key_len * <Py_ssize_t>sizeof(int64_t)):
                    raise answer_not_kept(RuntimeError(
                        f"write_through: node {node.id} changed during its backup"), answer)
                answer = None
                garbage.append(queue.popleft())
                node.queued = False
                node.host_owner = host
                host = None
                self.host_size += node.key_len
                self.backed_up_tokens += node.key_len
                copied += node.key_len
                if on_backup is not None:
                    on_backup(node)
            return copied
        finally:
            if skipped:
                self.wt_queue.extendleft(reversed(skipped))
            self.guard.busy = 0
            node = None
            del garbage[:]
            del skipped[:]

    def load_back(self, match, device_values, on_load=None):
        """Put a match's host continuation back on the device (see ``_core_py``); returns
        its host indices, top-down, as a new CPU int64 array (the core's kind)."""
        cdef Node last, root
        cdef HostNode node
        cdef Py_ssize_t depth = 0, total = 0, i, count, start
        cdef int64_t* out
        cdef const int64_t* base = NULL
        cdef TokenBuf tb
        tb.held = False
        self.guard.enter("load_back")
        try:
            if not isinstance(match, _MatchResult):
                raise TypeError(f"load_back needs a MatchResult, got {type(match).__name__}")
            # Every read of the caller's objects first (they can run code), then the tree.
            last_obj = match.last_node
            bottom_obj = match.last_host_node
            host_length = match.host_length
            values = device_values
            if isinstance(values, np.ndarray):
                borrow_buffer(values, &tb, "device_values")
                owner = PyBytes_FromStringAndSize(<const char*>tb.ptr, tb.len * sizeof(int64_t))
                release_tokens(&tb)
                count = len(<bytes>owner) // sizeof(int64_t)
            elif isinstance(values, _Tensor) or (_Tensor is _NoTensor and _is_tensor(values)):
                # (A tensor met before torch was bound: _is_tensor bound it.)
                if values.dim() != 1 or values.dtype != _int64:
                    raise TypeError("device_values must be a 1-D int64 tensor")
                if values.device.type == "cpu":
                    owner = values.detach().contiguous().numpy().tobytes()
                    if type(owner) is not bytes:
                        raise TypeError("device_values must be a 1-D int64 tensor")
                    count = len(<bytes>owner) // sizeof(int64_t)
                else:
                    owner = values  # kept as given (cache.py hands a copy), shared by offset
                    count = values.shape[0]
            else:
                raise TypeError("device_values must be a 1-D int64 numpy array or tensor, got "
                                f"{type(values).__name__}")
            values = None
            # The tree, in C from here: the continuation's nodes into self.path, bottom-up.
            root = self.tree.root
            if type(host_length) is not int or host_length < 0:
                raise stale_match(f"host_length {host_length!r} is not a token count")
            if last_obj is not root:
                if not isinstance(last_obj, Node):
                    raise stale_match("its last_node is no longer on the device")
                last = <Node>last_obj
                if last.evicted or (type(last) is HostNode and (<HostNode>last).host_only):
                    raise stale_match("its last_node is no longer on the device")
                top = last
                while (<Node>top).parent_ptr != NULL:
                    top = <Node>(<Node>top).parent_ptr
                if top is not root:
                    raise stale_match("its last_node is not in this cache")
                top = None
            else:
                last = root
            if host_length == 0:
                if bottom_obj is not last_obj and bottom_obj is not None:
                    raise stale_match("host_length is 0 but last_host_node is not last_node")
            else:
                node_obj = bottom_obj
                while node_obj is not last:
                    if not isinstance(node_obj, HostNode) or node_obj is root:
                        raise stale_match("its host nodes do not lead up to its last_node")
                    node = <HostNode>node_obj
                    if node.evicted or not node.host_only or node.host_owner is None:
                        raise stale_match(f"node {node.id} is no longer only on the host")
                    self.note_path(depth, node)
                    depth += 1
                    total += node.key_len
                    if total > host_length:
                        break
                    node_obj = node.parent
                node_obj = None
                if total != host_length:
                    raise stale_match(f"its host nodes hold {total} tokens, not host_length "
                                      f"{host_length}")
            if count != host_length:
                raise ValueError(f"load_back got {count} device slots for a host match of "
                                 f"{host_length} tokens")
            if depth == 0:
                return new_empty_indices(self.numpy_arrays)
            nodes = [<Node>self.path[i] for i in range(depth - 1, -1, -1)]  # top-down
            # The host indices, top-down (a capsule: no Python code runs until the copy is
            # done); then the writes, in C; then the hooks.
            capsule = rc_int64_capsule(total, &out)
            start = 0
            for i in range(depth):
                node = <HostNode>nodes[i]
                memcpy(out + start, host_data(node), node.key_len * sizeof(int64_t))
                start += node.key_len
            if type(owner) is bytes:
                base = <const int64_t*>PyBytes_AS_STRING(owner)
            start = 0
            for i in range(depth):
                node = <HostNode>nodes[i]
                node.value_owner = owner
                if base != NULL:
                    node.value_ptr = base + start
                    node.value_off = 0
                else:
                    node.value_ptr = NULL
                    node.value_off = start
                node.host_only = False
                (<HostNode>node.parent_ptr).n_host_kids -= 1
                self.evictable += node.key_len
                start += node.key_len
            self.loaded_tokens += host_length
            dropped = self.push_if_evictable(<Node>nodes[depth - 1])
            result = index_array(capsule, self.numpy_arrays)
            if on_load is not None:
                for node in nodes:
                    on_load(node)
            return result
        finally:
            release_tokens(&tb)
            self.guard.busy = 0

    def insert_host(self, node, tokens, host, extra_key=None, bint refill=False,
                    on_store=None):
        """Insert host-only pages below ``node`` (see ``_core_py``); returns
        ``(prefix_len, last_node, unused, dropped)``."""
        cdef TokenBuf b
        cdef Node cur, child, lower, new, last_device
        cdef Py_ssize_t count, pos = 0, common, prefix_len = 0
        cdef int64_t ns, now
        cdef bint dropped = False
        cdef const int64_t* keys
        cdef const int64_t* hosts
        cdef uint64_t h
        b.held = False
        self.guard.enter("insert_host")
        try:
            if not self.host_tier:
                raise ValueError("insert_host needs a core with a host tier")
            self.tree._check_member(node)
            # The caller's inputs copied first (nothing runs in between), then the tree.
            if not self.acquire(tokens, &b, False, False):
                raise TypeError("insert_host: tokens must be a list of ints or a 1-D int64 "
                                f"array, got {type(tokens).__name__}")
            key_owner = PyBytes_FromStringAndSize(<const char*>b.ptr, b.len * sizeof(int64_t))
            release_tokens(&b)
            if not self.acquire(host, &b, True, False):
                raise TypeError("insert_host: host indices must be a list of ints or a 1-D "
                                f"int64 array, got {type(host).__name__}")
            host_owner = PyBytes_FromStringAndSize(<const char*>b.ptr, b.len * sizeof(int64_t))
            release_tokens(&b)
            count = len(<bytes>key_owner) // sizeof(int64_t)
            if count % self.page_size:
                raise ValueError(f"insert_host: {count} tokens are not a whole number of "
                                 f"pages of {self.page_size}")
            if len(<bytes>host_owner) != len(<bytes>key_owner):
                raise ValueError(f"insert_host got {len(<bytes>host_owner) // 8} host "
                                 f"indices for {count} tokens: one per token expected")
            cur = <Node>node
            root = self.tree.root
            if cur is not root:
                ns = cur.ns
                extra_key = cur.extra_key  # below the root, the anchor's namespace
            elif extra_key is None:
                ns = 0
            else:
                try:
                    ns = self.tree.find_namespace(extra_key)
                except TypeError:
                    raise TypeError(f"insert_host: extra_key {type(extra_key).__name__} is "
                                    "not hashable") from None
                if ns < 0 and count:
                    ns = self.tree.make_namespace(extra_key)
            keys = <const int64_t*>PyBytes_AS_STRING(key_owner)
            hosts = <const int64_t*>PyBytes_AS_STRING(host_owner)
            self.tree.clock += 1
            now = self.tree.clock
            cur.last_access_time = now
            unused = []  # host slots the tree does not take: the caller frees them
            stored = []  # nodes given host slots, in path order (then on_store)
            last_device = cur  # the deepest node on the device it stamps (or the anchor)
            while pos < count:
                child = self.tree.find_match(cur, keys + pos, count - pos, ns, &common)
                if child is None:
                    break
                if common < child.key_len:
                    lower = child
                    child = self.tree.split(child, common)  # allocates: reads are on bytes
                    if (<HostNode>lower).queued:
                        self.wt_queue.append(child)
                        (<HostNode>child).queued = True
                    lower = None
                child.last_access_time = now
                if not (<HostNode>child).host_only:
                    last_device = child
                part = PyBytes_FromStringAndSize(<const char*>(hosts + pos),
                                                 common * sizeof(int64_t))
                if refill and (<HostNode>child).host_owner is None:  # on the device only
                    (<HostNode>child).host_owner = part
                    self.host_size += common
                    stored.append(child)
                else:
                    prefix_len += common
                    unused.append(part)
                pos += common
                cur = child
            if self.push_on_access and cur is not root:
                # The walk stamped them: a policy whose key falls on access needs new entries
                # for the leaves among them (a device leaf is the deepest on the device).
                dropped_entries = self.push_if_evictable(last_device)
                dropped_host = self.push_host_leaf(cur)
            if pos < count:
                if (refill and cur is not root and (<HostNode>cur).host_owner is None):
                    # Under write-through a host-only node never hangs below a node without
                    # a host copy: the pages are dropped (the walk ended on the anchor).
                    dropped = True
                    unused = [host_owner]
                    prefix_len = 0
                else:
                    leaf_key = PyBytes_FromStringAndSize(<const char*>(keys + pos),
                                                         (count - pos) * sizeof(int64_t))
                    leaf_host = PyBytes_FromStringAndSize(<const char*>(hosts + pos),
                                                          (count - pos) * sizeof(int64_t))
                    new = self.tree.new_node(cur, now)  # allocates: nothing is written yet
                    new.key_owner = leaf_key
                    new.key_ptr = <const int64_t*>PyBytes_AS_STRING(leaf_key)
                    new.key_len = count - pos
                    new.priority = cur.priority
                    new.ns = ns
                    new.extra_key = extra_key
                    (<HostNode>new).host_owner = leaf_host
                    (<HostNode>new).host_only = True
                    h = self.tree.page_hash(new.key_ptr, ns)
                    add_child(cur, new, h)
                    (<HostNode>cur).n_host_kids += 1
                    self.tree.node_count += 1
                    if cur is root and ns:
                        self.tree.ns_roots[ns] = self.tree.ns_roots.get(ns, 0) + 1
                    self.host_size += count - pos
                    stored.append(new)
                    dropped_new = self.push_host_leaf(new)
                    cur = new
            freed = b"".join(unused)
            result = (prefix_len, cur,
                      block_tensor(<const int64_t*>PyBytes_AS_STRING(freed),
                                   len(freed) // sizeof(int64_t), self.numpy_arrays),
                      dropped)
            if on_store is not None:
                for new in stored:
                    on_store(new)
            return result
        finally:
            release_tokens(&b)
            self.guard.busy = 0

    def set_value(self, Node node, values, bint held=False):
        self.take(held, "insert")
        try:
            previous = self.tree.store_value(node, values)
        finally:
            self.give(held)

    # -- copies and persistence (the state format: see _core_py's docstring) -----------------
    def export_state(self):
        """The tree, its clock and the counters as plain data; locks are not carried."""
        cdef Node node, child
        cdef Py_ssize_t k = 0
        if self.host_tier:
            raise TypeError("export_state: a cache with a host tier cannot be exported or "
                            "copied (its host indices belong to the engine's host pool)")
        self.take(False, "export_state")
        try:
            # Every node into a list first (strong references, parent before child); the
            # records are made from those objects, no pointer kept across a call out.
            order = [(self.tree.root, -1)]
            while k < len(order):
                node = <Node>order[k][0]
                for child in node.children:
                    order.append((child, k - 1))
                k += 1
            records = []
            for k in range(1, len(order)):
                child = <Node>order[k][0]
                key = PyBytes_FromStringAndSize(<const char*>child.key_ptr,
                                                child.key_len * sizeof(int64_t))
                if child.value_ptr != NULL:
                    value = PyBytes_FromStringAndSize(<const char*>child.value_ptr,
                                                      child.key_len * sizeof(int64_t))
                elif child.value_owner is not None:
                    value = child.value  # a device tensor: this node's part, copied below
                    value = value.clone()
                else:
                    value = None
                records.append((order[k][1], key, value, child.extra_key, child.priority,
                                child.last_access_time, child.created_time, child.hit_count,
                                bool(child.is_terminal), child.id))
            return {"nodes": records, "clock": self.tree.clock,
                    "num_splits": self.tree.num_splits,
                    "empty_inserted": list(self.tree.empty_inserted),
                    "counters": (self.lookups, self.matched_tokens, self.queried_tokens,
                                 self.inserts, self.inserted_tokens, self.evictions,
                                 self.evicted_tokens)}
        finally:
            self.give(False)

    def import_state(self, state):
        """Rebuild an exported state into this core, which must be empty; every node unlocked
        (so evictable) and every leaf on the heap. ValueError for a malformed state."""
        cdef Node parent, node
        cdef Tree tree = self.tree
        cdef int64_t ns
        cdef uint64_t h
        cdef Py_ssize_t i
        dropped = []
        self.take(False, "import_state")
        try:
            if tree.node_count or tree.clock or tree.empty_inserted:
                raise ValueError("import_state needs an empty core")
            # A copy (user code runs below), CPU values only for a core of numpy arrays.
            state = check_state(state, self.page_size, self.numpy_arrays)
            records = state["nodes"]
            nodes = []
            try:
                for (at, key, value, extra_key, priority, last, created, hits, terminal,
                     _) in records:
                    parent = tree.root if at < 0 else <Node>nodes[at]
                    node = tree.new_node(parent, last)  # may collect: no pointer held here
                    node.key_owner = key
                    node.key_ptr = <const int64_t*>PyBytes_AS_STRING(key)
                    node.key_len = len(key) // sizeof(int64_t)
                    if parent is tree.root:
                        ns = tree.make_namespace(extra_key)  # hashes it: before any link
                        node.ns = ns
                        node.extra_key = extra_key
                        if ns:
                            tree.ns_roots[ns] = tree.ns_roots.get(ns, 0) + 1
                    if value is not None:
                        node.value_owner = value
                        if type(value) is bytes:
                            node.value_ptr = <const int64_t*>PyBytes_AS_STRING(value)
                    node.created_time = created
                    node.priority = priority
                    node.hit_count = hits
                    node.is_terminal = terminal
                    h = tree.page_hash(node.key_ptr, node.ns)
                    # The state's check ran the extra_keys' __eq__; they may answer otherwise
                    # now: the tree itself must hold one child per (namespace, first page).
                    if probe(parent.slots, parent.slot_mask, node.key_ptr, tree.page_size, h,
                             node.ns, parent is tree.root) != NULL:
                        raise ValueError(f"bad tree state: node {len(nodes)} starts with the "
                                         "same page as a sibling")
                    add_child(parent, node, h)
                    tree.node_count += 1
                    self.evictable += node.key_len
                    nodes.append(node)
                fresh = sorted([(<Node>node).id for node in nodes])
                for i, k in enumerate(id_order(records)):
                    (<Node>nodes[k]).id = fresh[i]
                tree.clock = state["clock"]
                tree.num_splits = state["num_splits"]
                tree.empty_inserted = set(state["empty_inserted"])
                (self.lookups, self.matched_tokens, self.queried_tokens, self.inserts,
                 self.inserted_tokens, self.evictions, self.evicted_tokens) = state["counters"]
                for node in nodes:
                    if node.n_children == 0:
                        dropped.append(self.push_if_evictable(node))
            except BaseException:
                self.reset(True)
                raise
        finally:
            self.give(False)


# -- garbage collector support -------------------------------------------------------------
# Nodes and heaps hold references in C tables that Cython's generated tp_traverse does not
# know about: these traverse functions add them, so a cycle through a node (an extra_key or
# a value that refers back to its node or cache) is found and collected. Tree and heap get a
# tp_clear that tears down iteratively (the generated one would drop the root by refcount and
# recurse once per level of a deep chain); nodes get none (key_ptr points into key_owner).
cdef extern from "Python.h":
    ctypedef int (*visitproc)(PyObject*, void*) noexcept
    ctypedef int (*traverseproc)(PyObject*, visitproc, void*) noexcept
    ctypedef int (*inquiry)(PyObject*) noexcept
    ctypedef struct TypeSlots "PyTypeObject":
        traverseproc tp_traverse
        inquiry tp_clear

cdef traverseproc _node_base_traverse = NULL
cdef traverseproc _host_node_base_traverse = NULL
cdef traverseproc _heap_base_traverse = NULL


cdef int node_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    cdef int r = _node_base_traverse(o, visit, arg)
    return r if r else traverse_children(o, visit, arg)


cdef int host_node_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    # (Cython's traverse of a subclass calls its base's generated one, not node_traverse.)
    cdef int r = _host_node_base_traverse(o, visit, arg)
    return r if r else traverse_children(o, visit, arg)


cdef int traverse_children(PyObject* o, visitproc visit, void* arg) noexcept:
    # Plain casts, no reference taken: traversal must not touch reference counts.
    cdef ChildSlot* slots = (<Node>o).slots
    cdef Py_ssize_t i
    cdef int r
    if slots != NULL:
        for i in range((<Node>o).slot_mask + 1):
            if slots[i].node != NULL:
                r = visit(slots[i].node, arg)
                if r:
                    return r
    return 0


cdef int heap_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    cdef EvictionHeap heap = <EvictionHeap>o
    cdef Py_ssize_t i
    cdef int r = _heap_base_traverse(o, visit, arg)
    if r:
        return r
    for i in range(heap.size):
        r = visit(heap.items[i].node, arg)
        if r:
            return r
    for i in range(heap.run_size):
        r = visit(heap.run_at(i).node, arg)
        if r:
            return r
    return 0


cdef int heap_clear(PyObject* o) noexcept:
    (<EvictionHeap>o).release()
    (<EvictionHeap>o).ranks.clear()
    (<EvictionHeap>o).subheaps.clear()
    del (<EvictionHeap>o).levels[:]
    return 0


cdef int tree_clear(PyObject* o) noexcept:
    cdef Tree tree = <Tree>o
    tree.teardown()
    tree.namespaces.clear()
    tree.ns_roots.clear()
    tree.empty_inserted.clear()
    return 0


_node_base_traverse = (<TypeSlots*><void*>Node).tp_traverse
(<TypeSlots*><void*>Node).tp_traverse = node_traverse
_host_node_base_traverse = (<TypeSlots*><void*>HostNode).tp_traverse
(<TypeSlots*><void*>HostNode).tp_traverse = host_node_traverse
_heap_base_traverse = (<TypeSlots*><void*>EvictionHeap).tp_traverse
(<TypeSlots*><void*>EvictionHeap).tp_traverse = heap_traverse
(<TypeSlots*><void*>EvictionHeap).tp_clear = heap_clear
(<TypeSlots*><void*>Tree).tp_clear = tree_clear


# -- a slot pool's free stack (spec: _core_py's module docstring) ------------------------------
def put_slots(object stack, Py_ssize_t top, object slots, int64_t bound):
    """Push ``slots`` on a pool's free stack at ``top`` when every id lies in ``[0, bound)``
    and ``top + len(slots) <= min(bound, len(stack))``: how many were pushed; -1 to decline.
    See ``_core_py``."""
    cdef TokenBuf src
    cdef Py_buffer dst
    cdef int64_t* out
    cdef const int64_t* ids
    cdef Py_ssize_t n, room
    if type(stack) is not _ndarray or not _is_int64_dtype(stack.dtype) or top < 0 or bound < 0:
        return -1
    # The stack first: numpy may warn while exporting it (an array that warns on writes),
    # and a warning runs Python code, which must not find the ids borrowed yet.
    try:
        PyObject_GetBuffer(stack, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
    except (ValueError, BufferError, TypeError, Warning):
        return -1
    try:
        if not borrow_int64(slots, &src):
            return -1
        try:
            # Nothing below runs Python code: both buffers stay as read.
            n = src.len
            room = dst.len >> 3
            if bound < room:
                room = <Py_ssize_t>bound
            if dst.ndim != 1 or n > room - top:
                return -1
            out = <int64_t*>dst.buf + top
            ids = src.ptr
            if (<uintptr_t>ids < <uintptr_t>(out + n)
                    and <uintptr_t>out < <uintptr_t>(ids + n)):
                return -1  # the ids are part of the stack's own memory there
            # Written above the top first: those entries are free space, so a refused call
            # leaves the stack as it was in every entry that counts.
            return -1 if rc_copy_outside(out, ids, n, bound) else n
        finally:
            release_tokens(&src)
    finally:
        PyBuffer_Release(&dst)

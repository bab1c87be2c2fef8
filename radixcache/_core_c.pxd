# cython: language_level=3
"""Declarations of the compiled tree core (implemented in _core_c.pyx)."""

from cpython.ref cimport PyObject
from libc.stdint cimport int64_t, uint64_t


cdef struct ChildSlot:
    uint64_t hash      # hash of (namespace id, first page); the table is probed by it
    PyObject* node     # owned reference; NULL marks an empty slot


cdef struct HeapEntry:
    # Sort key, most significant word first; ties are impossible (the node id is a field).
    uint64_t k0
    uint64_t k1
    uint64_t k2
    uint64_t k3
    PyObject* node     # owned reference


cdef struct TokenBuf:
    # The call's tokens as int64: in an owner (a bytes object the call holds) or, borrowed,
    # in the caller's buffer (``held``: ``view`` is released when the call ends).
    const int64_t* ptr
    Py_ssize_t len
    bint held
    Py_buffer view


cdef class Guard:
    # Set while a call of the tree or its heap runs: a nested call raises RuntimeError.
    cdef readonly int busy

    cdef int enter(self, str what) except -1


cdef class Node:
    # Tokens live in key_owner (a bytes object); split halves share it at different offsets.
    cdef object key_owner
    cdef const int64_t* key_ptr
    cdef Py_ssize_t key_len
    # Index values: an int64 buffer (bytes, CPU values, shared across splits like keys) that
    # value_ptr points into; a device tensor (value_ptr NULL) whose elements
    # [value_off, value_off + key_len) are this node's (split halves share it, so a split
    # never calls torch); or None: the key is the values.
    cdef object value_owner
    cdef const int64_t* value_ptr
    cdef Py_ssize_t value_off
    # Borrowed: an attached child never outlives its parent's reference to it.
    cdef PyObject* parent_ptr
    # Open-addressing hash table of children (linear probing, power-of-two capacity).
    cdef ChildSlot* slots
    cdef Py_ssize_t slot_mask
    cdef Py_ssize_t n_children
    cdef int64_t ns
    cdef readonly Py_ssize_t lock_ref
    cdef readonly int64_t last_access_time
    cdef readonly int64_t created_time
    cdef readonly int64_t priority
    cdef readonly int64_t hit_count
    cdef readonly int64_t id
    cdef readonly object extra_key
    cdef readonly bint evicted
    cdef readonly bint terminal

    cdef Node find_child(self, const int64_t* page, Py_ssize_t page_size, uint64_t h)
    cdef int add_child(self, Node child, uint64_t h) except -1
    cdef Py_ssize_t slot_of(self, Node child, uint64_t h) noexcept
    cdef void remove_slot(self, Py_ssize_t i) noexcept
    cdef int grow(self) except -1


cdef class Tree:
    cdef readonly Py_ssize_t page_size
    cdef readonly Node root
    cdef readonly int64_t clock
    cdef readonly Py_ssize_t node_count
    cdef public Py_ssize_t num_splits
    cdef readonly Guard guard
    # extra_key -> namespace id, only while the namespace has nodes. Ids come from a
    # counter and are never reused, so a stale id can only ever find nothing.
    cdef dict namespaces
    # namespace id -> number of root children in it (its entry goes with the last one).
    cdef dict ns_roots
    cdef int64_t last_ns
    # Namespaces in which the empty sequence was inserted (it has no node to mark).
    cdef set empty_inserted

    cdef uint64_t page_hash(self, const int64_t* page, int64_t ns) noexcept nogil
    cdef int64_t find_namespace(self, object extra_key) except -2
    cdef int64_t make_namespace(self, object extra_key) except -2
    cdef void forget_namespace(self, object extra_key, int64_t ns) noexcept
    cdef Node split(self, Node child, Py_ssize_t at)
    cdef Node find_match(self, Node node, const int64_t* tokens, Py_ssize_t remaining,
                         int64_t ns, Py_ssize_t* matched)
    cdef Node new_node(self, Node parent, int64_t now)
    cdef Node make_root(self)
    cdef void teardown(self) noexcept


cdef class EvictionHeap:
    cdef HeapEntry* items
    cdef Py_ssize_t size
    cdef Py_ssize_t capacity
    cdef Py_ssize_t limit
    cdef int policy
    cdef Guard guard

    cdef void release(self) noexcept
    cdef void fill_key(self, Node n, HeapEntry* e) noexcept
    cdef int add(self, const HeapEntry* entry) except -1
    cdef void sift_down(self, Py_ssize_t i) noexcept
    cdef list compact(self)

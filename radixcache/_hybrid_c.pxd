# cython: language_level=3
"""Declarations of the compiled hybrid core (implemented in _hybrid_c.pyx)."""

from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t

from ._core_c cimport Core, Node, TokenBuf, Tree


cdef class AuxNode(Node):
    # A node of a hybrid tree (48 bytes more than a Node): its auxiliary slots (int64 bytes,
    # key_len of them for a window, one for a state; None: a tombstone, no state), their
    # lock count, the window lock's boundary mark (0: none), and its place in the
    # auxiliary LRU list (borrowed: a node leaves the list before the tree).
    cdef object aux_owner
    cdef const int64_t* aux_ptr
    cdef int32_t aux_lock
    cdef bint aux_one
    cdef int64_t mark
    cdef PyObject* newer
    cdef PyObject* older


cdef struct Gathered:
    # An eviction's freed slots gathered in the call's own memory (``evict(page_ids=True)``):
    # copied from a node while it still holds them, before anything allocates.
    int64_t* data
    Py_ssize_t len
    Py_ssize_t cap


cdef class HybridCore:
    cdef readonly Core core
    cdef readonly Tree tree
    cdef readonly Py_ssize_t window
    cdef readonly bint state
    cdef readonly Py_ssize_t page_size
    cdef readonly bint numpy_arrays
    cdef readonly int64_t aux_evictable
    cdef readonly int64_t aux_protected
    cdef readonly int64_t last_walk
    cdef readonly list last_recovered
    cdef readonly bint aux_kept
    cdef readonly object last_dup_pages
    # The auxiliary LRU list's ends (borrowed; NULL when empty) and the last mark given.
    cdef PyObject* newest
    cdef PyObject* oldest
    cdef int64_t marks

    cdef void unlink(self, AuxNode node) noexcept
    cdef void link_behind(self, AuxNode before, AuxNode node) noexcept
    cdef Py_ssize_t aux_size(self, AuxNode node) noexcept
    cdef void count_aux(self, AuxNode node, int sign) noexcept
    cdef void give_aux(self, AuxNode node, object owner, const int64_t* ptr) noexcept
    cdef object take_aux(self, AuxNode node, Gathered* into=*)
    cdef object page_ids_of(self, const int64_t* slots, Py_ssize_t start, Py_ssize_t stop)
    cdef void refresh(self, AuxNode node) noexcept
    cdef AuxNode split(self, AuxNode child, Py_ssize_t at)
    cdef AuxNode next_unlocked(self, PyObject* start) noexcept
    cdef Py_ssize_t accepted(self, Py_ssize_t depth) noexcept
    cdef int reject_tokens(self, object tokens, object extra_key) except -1
    cdef int64_t position(self, object value, str what) except -1
    cdef object insert_walk(self, TokenBuf* b, TokenBuf* v, Py_ssize_t end, bytes aux_block,
                            int64_t ns, object extra_key, int64_t prio, int64_t hits_after,
                            int64_t live_from, int64_t dup_from, bint whole)
    cdef int give_slice(self, AuxNode node, const int64_t* aux, Py_ssize_t start,
                        Py_ssize_t stop) except -1
    cdef tuple recover(self, AuxNode node, Py_ssize_t start, Py_ssize_t stop,
                       const int64_t* values, const int64_t* aux)
    cdef object values_of(self, Node node)
    cdef AuxNode new_leaf(self, Node parent, TokenBuf* b, TokenBuf* v, Py_ssize_t pos,
                          Py_ssize_t end, int64_t ns, object extra_key, int64_t now,
                          int64_t prio)
    cdef void move_lock(self, AuxNode node, int delta) noexcept
    cdef int64_t lock_window(self, AuxNode node) except -1
    cdef AuxNode window_top(self, AuxNode node, int64_t mark)
    cdef list unlock_window(self, AuxNode node, AuxNode top, bint early)
    cdef bint is_leaf(self, AuxNode node) noexcept
    cdef tuple leave_tree(self, AuxNode node, list records, list garbage,
                          Gathered* pages=*, Gathered* auxes=*)

# cython: language_level=3
"""Declarations of the compiled block index (implemented in _blocks_c.pyx; spec: _blocks_py's
module docstring)."""

from libc.stdint cimport int32_t, int64_t, uint64_t


cdef struct BIEntry:
    # 16 bytes: a table of a few hundred thousand keys stays in the last-level cache.
    int64_t key
    int32_t n          # holdings of the key (0: an empty slot)
    int32_t one        # n == 1: the holding copy; n >= 2: its list in BlockIndex.lists


cdef class BlockIndex:
    # Open addressing, linear probing, backward-shift deletion; any capacity (the home slot
    # of a key scales its 64-bit mix into [0, cap)), kept between 1/4 and 3/4 full.
    cdef BIEntry* table
    cdef Py_ssize_t cap
    cdef Py_ssize_t size       # distinct keys held
    cdef Py_ssize_t n_pairs    # holdings
    # Holder lists of keys held more than once (a copy once per holding, earliest first),
    # of capacity max(4, n rounded up to a power of two); free list positions are reused.
    cdef int32_t** lists
    cdef Py_ssize_t lists_cap
    cdef Py_ssize_t lists_used
    cdef int32_t* free_lists
    cdef Py_ssize_t n_free
    cdef int32_t* marks        # overlap's scratch: a stamp per owner
    cdef Py_ssize_t marks_cap
    cdef int32_t stamp

    cdef Py_ssize_t find(self, int64_t key) noexcept
    cdef int reserve(self, Py_ssize_t keys) except -1
    cdef int reserve_for(self, const int64_t* p, Py_ssize_t n) except -1
    cdef void move_to(self, BIEntry* fresh, Py_ssize_t capacity) noexcept
    cdef int rebuild(self, Py_ssize_t capacity) except -1
    cdef void fetch(self, int64_t key, int lines) noexcept
    cdef Py_ssize_t slot_of(self, int64_t key) noexcept
    cdef const int32_t* copies(self, BIEntry* e) noexcept
    cdef bint entry_holds(self, BIEntry* e, int32_t copy) noexcept
    cdef bint holds_key(self, int64_t key, int32_t copy) noexcept
    cdef int32_t new_list(self, int32_t first, int32_t second) except -1
    cdef void free_list(self, int32_t li) noexcept
    cdef int hold_key(self, int64_t key, int32_t copy) except -1
    cdef int hold_at(self, BIEntry* e, int64_t key, int32_t copy) except -1
    cdef bint drop_key(self, int64_t key, int32_t copy) noexcept
    cdef void delete_slot(self, Py_ssize_t i) noexcept
    cdef void maybe_shrink(self) noexcept


cdef struct KMEntry:
    uint64_t h         # a publisher hash as 64 bits (0: an empty slot)
    int64_t key        # the block key it names


cdef class KeyMap:
    # Open addressing, linear probing, backward-shift deletion; any capacity (a hash's slot:
    # the high word of h * cap), kept between 60% and 80% full so an entry costs at most
    # about 27 bytes.
    cdef KMEntry* table
    cdef Py_ssize_t cap
    cdef Py_ssize_t n

    cdef Py_ssize_t find(self, uint64_t h) noexcept
    cdef int resize(self, Py_ssize_t cap) except -1
    cdef int room(self, Py_ssize_t more) except -1
    cdef void insert(self, uint64_t h, int64_t key) noexcept
    cdef void delete_slot(self, Py_ssize_t i) noexcept

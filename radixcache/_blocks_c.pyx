# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, binding=True
"""Compiled block index and page hashes: the same interface as ``_blocks_py`` (see its
docstring, the spec), in its own extension module: it serves the router and the fleet's
workers, not the tree, and shares only C headers with the tree core (``_include/``)."""

cimport cython
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport (PyLong_AsLongLong, PyLong_AsLongLongAndOverflow,
                          PyLong_AsUnsignedLongLongMask)
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.errno cimport EAGAIN
from libc.string cimport memcmp, memcpy, memmove, memset

import numpy as np

cdef extern from "rc_platform.h":
    void rc_prefetch(const void* p) noexcept nogil
    uint64_t rc_fastrange(uint64_t h, uint64_t n) noexcept nogil
    void* rc_huge_alloc(size_t size) nogil
    void rc_huge_free(void* p) nogil

cdef extern from "rc_json.h":
    Py_ssize_t rc_json_ids(const unsigned char* p, Py_ssize_t size, int64_t* q) noexcept

cdef extern from "rc_zmq.h":
    ctypedef struct rc_zmq_msg:
        pass
    int rc_zmq_bind(void* handle) noexcept
    int rc_zmq_recv_frame(void* handle, rc_zmq_msg* msg) noexcept
    void* rc_zmq_data(rc_zmq_msg* msg) noexcept
    size_t rc_zmq_size(rc_zmq_msg* msg) noexcept
    int rc_zmq_more(rc_zmq_msg* msg) noexcept
    void rc_zmq_close(rc_zmq_msg* msg) noexcept

cdef extern from "rc_ints.h":
    int rc_read_int(PyObject* o, int64_t* out) noexcept

cdef extern from "Python.h":
    ctypedef struct PyObject
    PyObject* rc_list_item "PyList_GET_ITEM"(object items, Py_ssize_t i) noexcept
    Py_ssize_t rc_list_size "PyList_GET_SIZE"(object items) noexcept
    PyObject* rc_tuple_item "PyTuple_GET_ITEM"(object items, Py_ssize_t i) noexcept
    int PyTraceMalloc_Track(unsigned int domain, uintptr_t ptr, size_t size)
    int PyTraceMalloc_Untrack(unsigned int domain, uintptr_t ptr)

_ndarray = np.ndarray


# -- page hash chain ------------------------------------------------------------------------
cdef inline uint64_t fmix64(uint64_t h) noexcept nogil:
    # MurmurHash3's 64-bit finaliser: ends a page's hash, and mixes the key map's hashes.
    h ^= h >> 33
    h *= <uint64_t>0xFF51AFD7ED558CCD
    h ^= h >> 33
    h *= <uint64_t>0xC4CEB9FE1A85EC53
    h ^= h >> 33
    return h


cdef inline uint64_t hash_page(uint64_t h, const unsigned char* w,
                               Py_ssize_t per_page) noexcept:
    # One page of page_hash_chain: ``per_page`` int64 little-endian tokens at ``w``.
    cdef Py_ssize_t i
    cdef uint64_t t
    for i in range(per_page):
        t = (<uint64_t>w[0] | (<uint64_t>w[1] << 8) | (<uint64_t>w[2] << 16)
             | (<uint64_t>w[3] << 24) | (<uint64_t>w[4] << 32) | (<uint64_t>w[5] << 40)
             | (<uint64_t>w[6] << 48) | (<uint64_t>w[7] << 56))
        h = (h ^ t) * <uint64_t>0x9E3779B97F4A7C15
        h ^= h >> 32
        w += 8
    return fmix64(h)


cdef int check_chain_args(object seed, object page_bytes) except -1:
    """The chain's checks after ``data``'s, as ``_blocks_py``'s: ``seed`` and ``page_bytes``
    exactly ints, ``page_bytes`` a positive multiple of 8."""
    for name, value in (("seed", seed), ("page_bytes", page_bytes)):
        if type(value) is not int:  # exactly int: a subclass could change // or &
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if page_bytes <= 0 or page_bytes % 8:
        raise ValueError(f"page_bytes must be a positive multiple of 8, got {page_bytes}")
    return 0


def page_hash_chain(seed, data, page_bytes):
    """The chained 64-bit hashes of the full pages of ``data``; see ``_blocks_py``."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    check_chain_args(seed, page_bytes)
    if page_bytes > len(data):
        return []  # no full page; page_bytes may not even fit in a Py_ssize_t
    cdef uint64_t h = <uint64_t>(seed & 0xFFFFFFFFFFFFFFFF)
    cdef Py_ssize_t per_page = page_bytes // 8
    cdef bytes buffer = data  # immutable: its bytes cannot change under this loop
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(buffer)
    cdef Py_ssize_t pages = len(buffer) // page_bytes
    cdef Py_ssize_t page
    out = [None] * pages
    for page in range(pages):
        h = hash_page(h, p + page * per_page * 8, per_page)
        out[page] = <int64_t>h
    return out


def page_hash_bytes(seed, data, page_bytes):
    """``page_hash_chain`` as native int64 bytes (no int objects); see ``_blocks_py``."""
    cdef bint is_array = type(data) is _ndarray
    if not is_array and type(data) is not bytes:
        raise TypeError(f"data must be bytes or an int64 numpy array, got {type(data).__name__}")
    if is_array and (data.dtype.str != "<i8" or data.ndim != 1
                     or not data.flags.c_contiguous):
        raise TypeError(f"data as an array must be 1-D contiguous little-endian int64, got "
                        f"{data.ndim}-D {data.dtype}")
    check_chain_args(seed, page_bytes)
    cdef Py_buffer view
    cdef bytes out
    cdef const unsigned char* p
    cdef Py_ssize_t per_page = 0, pages = 0, page, length
    cdef uint64_t h = <uint64_t>(seed & 0xFFFFFFFFFFFFFFFF)
    cdef int64_t* q
    if is_array:
        # Held for the call (nothing runs meanwhile): its memory stays where it is.
        PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS)
        p = <const unsigned char*>view.buf
        length = view.len
    else:
        p = <const unsigned char*>PyBytes_AS_STRING(<bytes>data)
        length = len(<bytes>data)
    try:
        if page_bytes <= length:
            per_page = page_bytes // 8
            pages = length // page_bytes
        out = PyBytes_FromStringAndSize(NULL, pages * 8)
        q = <int64_t*>PyBytes_AS_STRING(out)
        for page in range(pages):
            h = hash_page(h, p + page * per_page * 8, per_page)
            q[page] = <int64_t>h
    finally:
        if is_array:
            PyBuffer_Release(&view)
    return out


# -- block index ----------------------------------------------------------------------------
# KvIndexer's table: 64-bit block key -> the copies (small ints) holding it, a copy once per
# holding. Inputs are read into owned buffers before anything changes, and no Python code
# runs while the table is written (exact ints only; nothing allocated that could collect).

# How many keys ahead a batch prefetches its table slot (the table is larger than the cache).
DEF _BI_AHEAD = 16

# Table slots in a 64-byte cache line (BIEntry is 16 bytes).
DEF _BI_LINE = 4

# Lines a batch fetches from a key's home slot on: a store's probe for a key not held reads
# on to the end of the slot's run, and a removal's backward shift reads from the key to the
# end of its run (4.1 slots on average over a fleet replay: about one line past the key's).
# Fetching them too made removals about a third cheaper, stores a little, where the table is
# out of the cache (a fleet simulation, whose trees and pools share it), and changed nothing
# where it is in.
DEF _BI_STORE_LINES = 2
DEF _BI_REMOVE_LINES = 3

# How many slots ahead clear_copy fetches a holder list (and twice as far, its place).
DEF _BI_CLEAR_AHEAD = 8

# Tables of at least this many bytes live in huge pages where the system offers them (fewer
# TLB misses: every lookup lands on a random slot); tracemalloc still sees them.
DEF _BI_HUGE = 2097152


cdef BIEntry* _bi_alloc(Py_ssize_t capacity, bint zeroed=True) noexcept:
    # ``zeroed=False``: the caller clears it before use (a spare that may never be used
    # costs no page of memory until then).
    cdef size_t size = capacity * sizeof(BIEntry)
    cdef void* p = NULL
    if size < _BI_HUGE:
        p = PyMem_Malloc(size)
    else:
        p = rc_huge_alloc(size)
        if p != NULL:
            PyTraceMalloc_Track(0, <uintptr_t>p, size)
    if p != NULL and zeroed:
        memset(p, 0, size)
    return <BIEntry*>p


cdef void _bi_free(BIEntry* table, Py_ssize_t capacity) noexcept:
    if table == NULL:
        return
    if capacity * sizeof(BIEntry) < _BI_HUGE:
        PyMem_Free(table)
    else:
        PyTraceMalloc_Untrack(0, <uintptr_t>table)
        rc_huge_free(table)


cdef inline uint64_t _bi_mix(int64_t key) noexcept:
    # KvIndexer's block keys are hashes already (the fast64 chain ends each page with a
    # finaliser); one multiply (whose high bits _bi_home keeps) spreads keys that are not,
    # such as consecutive ints, though arithmetic runs of some strides still cluster. A full
    # finaliser here cost a removal's backward shift, which mixes every key it passes,
    # about a third of its time.
    return <uint64_t>key * <uint64_t>0x9E3779B97F4A7C15


cdef inline Py_ssize_t _bi_home(int64_t key, Py_ssize_t cap) noexcept:
    # A key's home slot in a table of ``cap`` slots (any size: see BlockIndex.reserve).
    return <Py_ssize_t>rc_fastrange(_bi_mix(key), <uint64_t>cap)


cdef bytes _bi_keys(object keys):
    """``keys`` as int64 native-order bytes: a list or tuple of ints, or bytes."""
    cdef Py_ssize_t n, i
    cdef bytes out
    cdef int64_t* p
    if type(keys) is bytes:
        if len(<bytes>keys) % 8:
            raise ValueError(f"keys as bytes must hold int64 values (a multiple of 8 bytes), "
                             f"got {len(<bytes>keys)} bytes")
        return <bytes>keys
    if type(keys) is not list and type(keys) is not tuple:
        raise TypeError(f"keys must be a list or tuple of ints, or bytes, got "
                        f"{type(keys).__name__}")
    n = len(keys)
    out = PyBytes_FromStringAndSize(NULL, n * 8)
    p = <int64_t*>PyBytes_AS_STRING(out)
    for i in range(n):
        item = keys[i]  # a reference: the sequence may not be changed by anything below
        if type(item) is not int:
            raise TypeError(f"keys must be ints, got {type(item).__name__} at position {i}")
        try:
            p[i] = PyLong_AsLongLong(item)
        except OverflowError:
            raise OverflowError(f"key {item} at position {i} does not fit in int64") from None
    return out


cdef int32_t _bi_copy(object copy) except -1:
    if type(copy) is not int:
        raise TypeError(f"copy must be an int, got {type(copy).__name__}")
    if not 0 <= copy < 0x7FFFFFFF:
        raise ValueError(f"copy must be in [0, 2**31 - 1), got {copy}")
    return <int32_t>copy


cdef int64_t _bi_key(object key) except? -1:
    if type(key) is not int:
        raise TypeError(f"key must be an int, got {type(key).__name__}")
    try:
        return PyLong_AsLongLong(key)
    except OverflowError:
        raise OverflowError(f"key {key} does not fit in int64") from None


cdef bint _LITTLE_ENDIAN = __import__("sys").byteorder == "little"


cdef bytes _list_le_bytes(list items, Py_ssize_t offset=0):
    """A list of exact ints as int64 little-endian bytes, read in one loop that calls no
    Python code (anything but an exact int is a TypeError, an int beyond int64 an
    OverflowError; positions named from ``offset``)."""
    cdef Py_ssize_t n = len(items), i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * 8)
    cdef int64_t* p = <int64_t*>PyBytes_AS_STRING(out)
    if rc_list_size(items) != n:  # a finalizer run by the allocation changed the list
        return _list_le_bytes(items, offset)
    for i in range(n):  # the tree core's int reader: no call, so the list cannot change
        if not rc_read_int(rc_list_item(items, i), &p[i]):
            item = items[i]
            if type(item) is not int:
                raise TypeError(f"token ids must be ints, got {type(item).__name__} at "
                                f"position {i + offset}")
            raise OverflowError(f"token id {item} at position {i + offset} does not fit in "
                                f"int64")
    if not _LITTLE_ENDIAN:
        for i in range(n):
            p[i] = <int64_t>_bswap64(<uint64_t>p[i])
    return out


def ids_le_bytes(items):
    """A list or tuple of exact ints as int64 little-endian bytes; see ``_blocks_py``."""
    if type(items) is list:
        return _list_le_bytes(<list>items)
    if type(items) is not tuple:
        raise TypeError(f"token ids must be a list or tuple, got {type(items).__name__}")
    # A tuple cannot change: read in place, no Python code runs.
    cdef tuple ids = <tuple>items
    cdef Py_ssize_t n = len(ids), i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * 8)
    cdef int64_t* p = <int64_t*>PyBytes_AS_STRING(out)
    for i in range(n):
        if not rc_read_int(rc_tuple_item(ids, i), &p[i]):
            item = ids[i]
            if type(item) is not int:
                raise TypeError(f"token ids must be ints, got {type(item).__name__} at "
                                f"position {i}")
            raise OverflowError(f"token id {item} at position {i} does not fit in int64")
    if not _LITTLE_ENDIAN:
        for i in range(n):
            p[i] = <int64_t>_bswap64(<uint64_t>p[i])
    return out


cdef inline uint64_t _be(const unsigned char* p, int size) noexcept:
    cdef uint64_t v = 0
    cdef int i
    for i in range(size):
        v = (v << 8) | p[i]
    return v


def msgpack_ids(data):
    """A msgpack array of ints as int64 little-endian bytes, or None; see ``_blocks_py``."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t size = len(<bytes>data), pos, n, i
    cdef unsigned char b
    cdef uint64_t u
    cdef int64_t v
    cdef int width
    if size == 0:
        return None
    b = p[0]
    if 0x90 <= b <= 0x9F:
        n, pos = b & 0x0F, 1
    elif b == 0xDC and size >= 3:
        n, pos = <Py_ssize_t>_be(p + 1, 2), 3
    elif b == 0xDD and size >= 5:
        n, pos = <Py_ssize_t>_be(p + 1, 4), 5
    else:
        return None
    if n > size - pos:  # at least a byte an id
        return None
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * 8)
    cdef int64_t* q = <int64_t*>PyBytes_AS_STRING(out)
    for i in range(n):
        if pos >= size:
            return None
        b = p[pos]
        if b <= 0x7F:  # positive fixint
            v = b
            pos += 1
        elif b >= 0xE0:  # negative fixint
            v = <int64_t>b - 256
            pos += 1
        elif 0xCC <= b <= 0xD3:  # uint8..uint64, int8..int64
            width = 1 << ((b - 0xCC) & 3)
            if width > size - pos - 1:
                return None
            u = _be(p + pos + 1, width)
            if b <= 0xCF:
                if u > <uint64_t>0x7FFFFFFFFFFFFFFF:
                    return None  # beyond int64
                v = <int64_t>u
            elif width == 8:
                v = <int64_t>u
            else:  # sign-extend
                v = <int64_t>(u << (64 - 8 * width)) >> (64 - 8 * width)
            pos += 1 + width
        else:
            return None
        q[i] = <int64_t>_bswap64(<uint64_t>v) if not _LITTLE_ENDIAN else v
    if pos != size:
        return None
    return out


def json_ids(data, start=0, stop=None):
    """A JSON array of token ids (``data[start:stop]``) as int64 little-endian bytes, or
    None; see ``_blocks_py``."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    cdef Py_ssize_t size = len(<bytes>data)
    _slice_bounds(start, stop, size)
    cdef Py_ssize_t lo = start
    cdef Py_ssize_t hi = size if stop is None else stop
    # At most an id per two bytes ("1,"): parsed into a scratch buffer in one pass.
    cdef int64_t* q = <int64_t*>PyMem_Malloc(((hi - lo) // 2 + 1) * 8)
    if q == NULL:
        raise MemoryError()
    cdef Py_ssize_t n
    try:
        n = rc_json_ids(<const unsigned char*>PyBytes_AS_STRING(data) + lo, hi - lo, q)
        if n < 0:
            return None
        return PyBytes_FromStringAndSize(<char*>q, n * 8)
    finally:
        PyMem_Free(q)


cdef int _slice_bounds(object start, object stop, Py_ssize_t size) except -1:
    """``start`` and ``stop`` (None: ``size``) exactly ints with ``0 <= start <= stop <=
    size``, as ``_blocks_py``'s."""
    if type(start) is not int:
        raise TypeError(f"start must be an int, got {type(start).__name__}")
    if stop is not None and type(stop) is not int:
        raise TypeError(f"stop must be an int or None, got {type(stop).__name__}")
    if not 0 <= start <= (size if stop is None else stop) <= size:
        raise ValueError(f"start and stop must be within the data (0 <= start <= stop <= "
                         f"{size}), got {start} and {stop}")
    return 0


# -- a query's answer (the index service's /query) ------------------------------------------
cdef struct QARow:
    PyObject* instance  # held by the call's own snapshot of the rows
    const char* name
    Py_ssize_t name_len
    int64_t rank, gpu, cpu, disk
    Py_ssize_t next  # the instance's next row, or -1


cdef struct QAInstance:
    Py_ssize_t first, last  # its rows
    int64_t gpu, cpu, disk
    Py_ssize_t ranks, n_ranks  # its (rank, gpu) pairs in the call's rank arrays


cdef int64_t _qa_int(object value, str what, Py_ssize_t i, int64_t top) except -1:
    """An exact int in ``[0, top)`` (no Python code runs to read it)."""
    cdef int overflow = 0
    cdef long long read
    if type(value) is not int:
        raise TypeError(f"rows[{i}]: {what} must be an int, got {type(value).__name__}")
    read = PyLong_AsLongLongAndOverflow(value, &overflow)  # compared in C, not as objects
    if overflow or not 0 <= read < top:
        raise ValueError(f"rows[{i}]: {what} must be in [0, {top}), got {value}")
    return read


cdef inline char* _qa_put(char* out, const char* text, Py_ssize_t n) noexcept nogil:
    memcpy(out, text, n)
    return out + n


cdef inline char* _qa_digits(char* out, int64_t value) noexcept nogil:
    # ``value`` >= 0 in decimal.
    cdef char tmp[24]
    cdef int k = 0
    while True:
        tmp[k] = <char>(48 + value % 10)
        k += 1
        value //= 10
        if value == 0:
            break
    while k:
        k -= 1
        out[0] = tmp[k]
        out += 1
    return out


cdef inline char* _qa_key(char* out, QARow* row, Py_ssize_t k) noexcept nogil:
    # The k-th member of an object: the separator, the instance's name, the opening brace.
    if k:
        out[0] = 44  # ','
        out += 1
    out = _qa_put(out, row.name, row.name_len)
    return _qa_put(out, b":{", 2)


cdef char* _qa_ranks(char* out, int64_t* ranks, int64_t* gpus, Py_ssize_t n,
                     bint hits_only) noexcept nogil:
    # ``"rank":gpu`` pairs, comma-separated (only those with a device hit when asked).
    cdef Py_ssize_t k
    cdef bint first = True
    for k in range(n):
        if hits_only and not gpus[k]:
            continue
        if not first:
            out[0] = 44  # ','
            out += 1
        first = False
        out[0] = 34  # '"'
        out = _qa_digits(out + 1, ranks[k])
        out = _qa_put(out, b'":', 2)
        out = _qa_digits(out, gpus[k])
    return out


cdef Py_ssize_t _qa_order(QARow* rows, QAInstance* inst, Py_ssize_t m, int section,
                          Py_ssize_t* order, Py_ssize_t* table, Py_ssize_t cap) noexcept:
    """The instances a section writes, as a JSON object of their names would hold them:
    ``order[k]`` is the instance whose figures go at the ``k``-th name (names in the order
    they first come; a later instance of the same name replaces the earlier's figures).
    ``section``: 0 every instance, 1 those with ``disk``, 2 those with ``disk`` and ``gpu``."""
    cdef Py_ssize_t j, k, n = 0, slot
    cdef uint64_t mask = <uint64_t>cap - 1
    cdef QARow* a
    cdef QARow* b
    memset(table, 0xFF, cap * sizeof(Py_ssize_t))
    for j in range(m):
        if (section >= 1 and not inst[j].disk) or (section == 2 and not inst[j].gpu):
            continue
        a = &rows[inst[j].first]
        slot = <Py_ssize_t>(_km_hash_mem(<const unsigned char*>a.name, a.name_len) & mask)
        while True:
            k = table[slot]
            if k < 0:
                table[slot] = n
                order[n] = j
                n += 1
                break
            b = &rows[inst[order[k]].first]
            if b.name_len == a.name_len and memcmp(a.name, b.name, a.name_len) == 0:
                order[k] = j
                break
            slot = (slot + 1) & <Py_ssize_t>mask
    return n


def query_answer(rows, block_size, tenant):
    """The index service's ``/query`` answer as JSON bytes; see ``_blocks_py``."""
    if type(rows) is not list:
        raise TypeError(f"rows must be a list, got {type(rows).__name__}")
    if type(block_size) is not int:
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not 1 <= block_size <= (1 << 20):
        raise ValueError(f"block_size must be in [1, 2**20], got {block_size}")
    if tenant is not None and type(tenant) is not bytes:
        raise TypeError(f"tenant must be bytes or None, got {type(tenant).__name__}")
    # The call's own snapshot: every object read below is held by it (tuples, exact ints,
    # strs and bytes, which no Python code can change), and nothing below calls out.
    cdef tuple snapshot = tuple(rows)
    cdef Py_ssize_t n = len(snapshot), i, j, k, m = 0, cap = 8, slot, size, n_order
    cdef int64_t scale = block_size
    cdef Py_ssize_t names = 0
    cdef tuple row, who, figures
    cdef object instance, name
    cdef QARow* r
    cdef QARow* q
    cdef QAInstance* it
    cdef uint64_t h
    cdef int same
    while cap < 2 * n:
        cap *= 2
    cdef QARow* qrows = <QARow*>PyMem_Malloc((n + 1) * sizeof(QARow))
    cdef QAInstance* inst = <QAInstance*>PyMem_Malloc((n + 1) * sizeof(QAInstance))
    cdef Py_ssize_t* table = <Py_ssize_t*>PyMem_Malloc(cap * sizeof(Py_ssize_t))
    cdef Py_ssize_t* order = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    cdef int64_t* ranks = <int64_t*>PyMem_Malloc((n + 1) * sizeof(int64_t))
    cdef int64_t* gpus = <int64_t*>PyMem_Malloc((n + 1) * sizeof(int64_t))
    cdef char* buf = NULL
    cdef char* out
    cdef int64_t t_rank, t_gpu
    cdef const char* keys[5]
    cdef Py_ssize_t key_len[5]
    try:
        if qrows == NULL or inst == NULL or table == NULL or order == NULL or ranks == NULL \
                or gpus == NULL:
            raise MemoryError()
        # Read every row, merging the rows of an instance.
        memset(table, 0xFF, cap * sizeof(Py_ssize_t))
        for i in range(n):
            row = <tuple>snapshot[i] if type(snapshot[i]) is tuple else None
            if row is None or len(row) != 2 or type(row[0]) is not tuple \
                    or len(<tuple>row[0]) != 3 or not (type(row[1]) is int or (
                        type(row[1]) is tuple and len(<tuple>row[1]) == 3)):
                raise TypeError(f"rows[{i}] must be ((instance, name, rank), (gpu, cpu, "
                                "disk)) or ((instance, name, rank), blocks)")
            who = <tuple>row[0]
            instance, name = who[0], who[1]
            if type(instance) is not int and type(instance) is not str:
                raise TypeError(f"rows[{i}]: instance must be an int or a str, got "
                                f"{type(instance).__name__}")
            if type(name) is not bytes:
                raise TypeError(f"rows[{i}]: name must be bytes, got {type(name).__name__}")
            r = &qrows[i]
            r.instance = <PyObject*>instance
            r.name = PyBytes_AS_STRING(name)
            r.name_len = len(<bytes>name)
            r.rank = _qa_int(who[2], "rank", i, 1 << 31)
            if type(row[1]) is int:  # the same figure on every tier
                r.gpu = r.cpu = r.disk = _qa_int(row[1], "blocks", i, 1 << 40) * scale
            else:
                figures = <tuple>row[1]
                r.gpu = _qa_int(figures[0], "blocks", i, 1 << 40) * scale
                r.cpu = _qa_int(figures[1], "blocks", i, 1 << 40) * scale
                r.disk = _qa_int(figures[2], "blocks", i, 1 << 40) * scale
            r.next = -1
            h = <uint64_t>hash(instance)  # an exact int's or str's: no Python code runs
            slot = <Py_ssize_t>(_bi_mix(<int64_t>h) & <uint64_t>(cap - 1))
            while True:
                j = table[slot]
                if j < 0:
                    table[slot] = m
                    it = &inst[m]
                    it.first = it.last = i
                    it.gpu, it.cpu, it.disk = r.gpu, r.cpu, r.disk
                    m += 1
                    names += r.name_len
                    break
                q = &qrows[inst[j].first]
                same = q.instance == r.instance or (
                    type(<object>q.instance) is type(instance)
                    and <object>q.instance == instance)
                if same:
                    it = &inst[j]
                    qrows[it.last].next = i
                    it.last = i
                    it.gpu = max(it.gpu, r.gpu)
                    it.cpu = max(it.cpu, r.cpu)
                    it.disk = max(it.disk, r.disk)
                    break
                slot = (slot + 1) & (cap - 1)
        # Each instance's ranks, ascending, a rank's largest device figure.
        k = 0
        for j in range(m):
            it = &inst[j]
            it.ranks = k
            it.n_ranks = 0
            i = it.first
            while i >= 0:
                t_rank, t_gpu = qrows[i].rank, qrows[i].gpu
                slot = it.ranks + it.n_ranks
                while slot > it.ranks and ranks[slot - 1] > t_rank:
                    slot -= 1
                if slot > it.ranks and ranks[slot - 1] == t_rank:
                    gpus[slot - 1] = max(gpus[slot - 1], t_gpu)
                else:
                    memmove(&ranks[slot + 1], &ranks[slot],
                            (it.ranks + it.n_ranks - slot) * sizeof(int64_t))
                    memmove(&gpus[slot + 1], &gpus[slot],
                            (it.ranks + it.n_ranks - slot) * sizeof(int64_t))
                    ranks[slot], gpus[slot] = t_rank, t_gpu
                    it.n_ranks += 1
                i = qrows[i].next
            k += it.n_ranks
        # What is written is bounded: per instance its name twice and 5 figures of at most
        # 19 digits with their keys; per rank 2 * (10 + 19 + 4) bytes.
        size = 64 + (len(<bytes>tenant) if tenant is not None else 0) + 2 * names \
            + 256 * m + 80 * n
        buf = <char*>PyMem_Malloc(size)
        if buf == NULL:
            raise MemoryError()
        out = buf
        keys[0] = b'"longest_matched":'
        if tenant is None:
            keys[1] = b',"gpu":'
            keys[2] = b',"dp":{'
            keys[3] = b'},"cpu":'
            keys[4] = b',"disk":'
        else:
            keys[1] = b',"GPU":'
            keys[2] = b',"DP":{'
            keys[3] = b'},"CPU":'
            keys[4] = b',"DISK":'
        key_len[0] = 18
        key_len[1] = key_len[2] = 7
        key_len[3] = key_len[4] = 8
        if tenant is None:
            out = _qa_put(out, b'{"scores":{', 11)
            n_order = _qa_order(qrows, inst, m, 2, order, table, cap)
            for k in range(n_order):
                it = &inst[order[k]]
                out = _qa_key(out, &qrows[it.first], k)
                out = _qa_ranks(out, &ranks[it.ranks], &gpus[it.ranks], it.n_ranks,
                                it.n_ranks > 1)
                out = _qa_put(out, b"}", 1)
            out = _qa_put(out, b'},"frequencies":[],"instances":{', 32)
        elif m:
            out = _qa_put(out, b"{", 1)
            out = _qa_put(out, PyBytes_AS_STRING(tenant), len(<bytes>tenant))
            out = _qa_put(out, b":{", 2)
        else:
            return b"{}"
        n_order = _qa_order(qrows, inst, m, 1 if tenant is None else 0, order, table, cap)
        for k in range(n_order):
            it = &inst[order[k]]
            out = _qa_key(out, &qrows[it.first], k)
            out = _qa_put(out, keys[0], key_len[0])
            out = _qa_digits(out, it.disk)
            out = _qa_put(out, keys[1], key_len[1])
            out = _qa_digits(out, it.gpu)
            out = _qa_put(out, keys[2], key_len[2])
            out = _qa_ranks(out, &ranks[it.ranks], &gpus[it.ranks], it.n_ranks, False)
            out = _qa_put(out, keys[3], key_len[3])
            out = _qa_digits(out, it.cpu)
            out = _qa_put(out, keys[4], key_len[4])
            out = _qa_digits(out, it.disk)
            out = _qa_put(out, b"}", 1)
        out = _qa_put(out, b"}}", 2)
        return PyBytes_FromStringAndSize(buf, out - buf)
    finally:
        PyMem_Free(qrows)
        PyMem_Free(inst)
        PyMem_Free(table)
        PyMem_Free(order)
        PyMem_Free(ranks)
        PyMem_Free(gpus)
        PyMem_Free(buf)


cdef int _check_owners(bytes owner_data) except -1:
    cdef Py_ssize_t n_owners = len(owner_data) // 8, i
    cdef const int64_t* own = <const int64_t*>PyBytes_AS_STRING(owner_data)
    for i in range(n_owners):
        if not -1 <= own[i] < n_owners:
            raise ValueError(f"owners must be -1 or in [0, {n_owners}), got {own[i]} at "
                             f"position {i}")
    return 0


cdef inline uint64_t _bswap64(uint64_t v) noexcept:
    v = ((v & <uint64_t>0x00FF00FF00FF00FF) << 8) | ((v >> 8) & <uint64_t>0x00FF00FF00FF00FF)
    v = ((v & <uint64_t>0x0000FFFF0000FFFF) << 16) | ((v >> 16) & <uint64_t>0x0000FFFF0000FFFF)
    return (v << 32) | (v >> 32)


@cython.final
cdef class BlockIndex:
    """BlockIndex()
--

Held blocks: 64-bit block key -> the copies (ints) holding it; see ``_blocks_py``."""

    def __cinit__(self):
        self.table = _bi_alloc(8)
        if self.table == NULL:
            raise MemoryError()
        self.cap = 8
        self.size = 0
        self.n_pairs = 0
        self.lists = NULL
        self.lists_cap = 0
        self.lists_used = 0
        self.free_lists = NULL
        self.n_free = 0
        self.marks = NULL
        self.marks_cap = 0
        self.stamp = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.lists_used):
            PyMem_Free(self.lists[i])  # NULL for a free position
        PyMem_Free(self.lists)
        PyMem_Free(self.free_lists)
        _bi_free(self.table, self.cap)
        PyMem_Free(self.marks)
        self.lists = NULL
        self.free_lists = NULL
        self.table = NULL
        self.marks = NULL

    def __reduce__(self):
        # Every holding as (key, copy), a key's copies earliest first: holding them again in
        # this order rebuilds the index (native byte order).
        cdef Py_ssize_t i, j, k
        cdef bytes keys, copies
        cdef int64_t* kp
        cdef int32_t* cp
        cdef const int32_t* items
        while True:
            keys = PyBytes_FromStringAndSize(NULL, self.n_pairs * 8)
            copies = PyBytes_FromStringAndSize(NULL, self.n_pairs * 4)
            if len(keys) == self.n_pairs * 8 and len(copies) == self.n_pairs * 4:
                break  # a finalizer run by those allocations changed nothing
        kp = <int64_t*>PyBytes_AS_STRING(keys)
        cp = <int32_t*>PyBytes_AS_STRING(copies)
        k = 0
        for i in range(self.cap):
            if self.table[i].n:
                items = self.copies(&self.table[i])
                for j in range(self.table[i].n):
                    kp[k] = self.table[i].key
                    cp[k] = items[j]
                    k += 1
        return (_block_index_from, (keys, copies))

    cdef Py_ssize_t find(self, int64_t key) noexcept:
        cdef Py_ssize_t i = _bi_home(key, self.cap)
        while self.table[i].n:
            if self.table[i].key == key:
                return i
            i += 1
            if i == self.cap:
                i = 0
        return -1

    cdef inline void fetch(self, int64_t key, int lines) noexcept:
        # Start loading the key's home slot and the ``lines - 1`` cache lines after it (a
        # batch does it keys ahead; see _BI_STORE_LINES).
        cdef Py_ssize_t i = _bi_home(key, self.cap), k
        for k in range(lines):
            rc_prefetch(&self.table[i])
            i += _BI_LINE
            if i >= self.cap:
                break

    cdef Py_ssize_t slot_of(self, int64_t key) noexcept:
        # The key's slot, or the empty slot where it goes (the table has room).
        cdef Py_ssize_t i = _bi_home(key, self.cap)
        while self.table[i].n and self.table[i].key != key:
            i += 1
            if i == self.cap:
                i = 0
        return i

    cdef const int32_t* copies(self, BIEntry* e) noexcept:
        return &e.one if e.n == 1 else self.lists[e.one]

    cdef inline bint entry_holds(self, BIEntry* e, int32_t copy) noexcept:
        # Whether ``copy`` is among slot ``e``'s holders (an empty slot has none).
        cdef const int32_t* items
        cdef int32_t j
        if e.n == 0:
            return False
        items = self.copies(e)
        for j in range(e.n):
            if items[j] == copy:
                return True
        return False

    cdef inline bint holds_key(self, int64_t key, int32_t copy) noexcept:
        cdef Py_ssize_t i = self.find(key)
        return i >= 0 and self.entry_holds(&self.table[i], copy)

    cdef int32_t new_list(self, int32_t first, int32_t second) except -1:
        cdef int32_t* items = <int32_t*>PyMem_Malloc(4 * sizeof(int32_t))
        cdef int32_t** grown
        cdef int32_t* grown_free
        cdef Py_ssize_t li, cap
        if items == NULL:
            raise MemoryError()
        if self.n_free:
            self.n_free -= 1
            li = self.free_lists[self.n_free]
        else:
            if self.lists_used == self.lists_cap:
                cap = max(16, self.lists_cap * 2)
                if cap > 0x7FFFFFFF:
                    PyMem_Free(items)
                    raise OverflowError("too many blocks held more than once")
                grown = <int32_t**>PyMem_Realloc(self.lists, cap * sizeof(int32_t*))
                if grown == NULL:
                    PyMem_Free(items)
                    raise MemoryError()
                self.lists = grown
                grown_free = <int32_t*>PyMem_Realloc(self.free_lists, cap * sizeof(int32_t))
                if grown_free == NULL:
                    PyMem_Free(items)
                    raise MemoryError()
                self.free_lists = grown_free
                self.lists_cap = cap
            li = self.lists_used
            self.lists_used += 1
        items[0] = first
        items[1] = second
        self.lists[li] = items
        return <int32_t>li

    cdef void free_list(self, int32_t li) noexcept:
        PyMem_Free(self.lists[li])
        self.lists[li] = NULL
        self.free_lists[self.n_free] = li
        self.n_free += 1

    cdef int rebuild(self, Py_ssize_t capacity) except -1:
        cdef BIEntry* fresh = _bi_alloc(capacity)
        if fresh == NULL:
            raise MemoryError()
        self.move_to(fresh, capacity)
        return 0

    cdef void move_to(self, BIEntry* fresh, Py_ssize_t capacity) noexcept:
        # Every held key into ``fresh`` (zeroed, ``capacity`` slots), which becomes the table.
        cdef BIEntry* old = self.table
        cdef Py_ssize_t old_cap = self.cap, i
        self.table = fresh
        self.cap = capacity
        for i in range(old_cap):
            if old[i].n:
                fresh[self.slot_of(old[i].key)] = old[i]
        _bi_free(old, old_cap)

    cdef int reserve(self, Py_ssize_t keys) except -1:
        # Room for ``keys`` distinct keys at a load of at most 3/4. A table that outgrows
        # that is rebuilt half full (about 1.5 times as large: any size is a valid
        # capacity), so a block costs 21 to 32 bytes of table at any size, where doubling
        # would let it reach 43.
        if keys * 4 <= self.cap * 3:
            return 0
        return self.rebuild(max(8, 2 * keys))

    cdef int reserve_for(self, const int64_t* p, Py_ssize_t n) except -1:
        # Room for the keys of p[:n] the table does not hold yet, made before anything
        # changes. Counted only when all n might not fit: a batch of keys already held (a
        # second worker's copy of a prefix) grows nothing.
        cdef Py_ssize_t i, new = 0
        if (self.size + n) * 4 <= self.cap * 3:
            return 0
        for i in range(n):
            if i + _BI_AHEAD < n:
                self.fetch(p[i + _BI_AHEAD], _BI_STORE_LINES)
            if self.find(p[i]) < 0:
                new += 1  # a key twice in p counts twice: a bound
        return self.reserve(self.size + new)

    cdef void maybe_shrink(self) noexcept:
        # Under a quarter full: rebuilt half full (rebuilding again takes as many
        # removals as it took holdings to fill it to 3/4).
        if self.cap > 8 and self.size * 4 < self.cap:
            try:
                self.rebuild(max(8, 2 * self.size))
            except MemoryError:
                pass  # stays larger

    cdef int hold_key(self, int64_t key, int32_t copy) except -1:
        # One more holding of ``key`` by ``copy``; the table has room for a new key.
        return self.hold_at(&self.table[self.slot_of(key)], key, copy)

    cdef int hold_at(self, BIEntry* e, int64_t key, int32_t copy) except -1:
        # hold_key, ``e`` being slot_of(key)'s slot.
        cdef int32_t* items
        cdef int32_t* grown
        cdef int32_t n = e.n
        if n == 0:
            e.key = key
            e.one = copy
            e.n = 1
            self.size += 1
        elif n == 1:
            e.one = self.new_list(e.one, copy)
            e.n = 2
        else:
            if n >= 0x3FFFFFFF:
                raise OverflowError("too many holdings of one block")
            items = self.lists[e.one]
            if n >= 4 and (n & (n - 1)) == 0:  # full: capacity max(4, n rounded up)
                grown = <int32_t*>PyMem_Realloc(items, 2 * n * sizeof(int32_t))
                if grown == NULL:
                    raise MemoryError()
                self.lists[e.one] = items = grown
            items[n] = copy
            e.n = n + 1
        self.n_pairs += 1
        return 0

    cdef bint drop_key(self, int64_t key, int32_t copy) noexcept:
        # One holding of ``key`` by ``copy`` less; False when it holds none. No shrinking.
        cdef Py_ssize_t i = self.find(key), j
        cdef BIEntry* e
        cdef int32_t* items
        cdef int32_t last
        if i < 0:
            return False
        e = &self.table[i]
        if e.n == 1:
            if e.one != copy:
                return False
            self.delete_slot(i)
            self.size -= 1
            self.n_pairs -= 1
            return True
        items = self.lists[e.one]
        for j in range(e.n):
            if items[j] == copy:
                break
        else:
            return False
        # Keep the holders' order: the earliest holding first.
        memmove(&items[j], &items[j + 1], (e.n - j - 1) * sizeof(int32_t))
        e.n -= 1
        if e.n == 1:
            last = items[0]
            self.free_list(e.one)
            e.one = last
        self.n_pairs -= 1
        return True

    cdef void delete_slot(self, Py_ssize_t i) noexcept:
        # Backward-shift deletion (no tombstones) of a slot holding no list.
        cdef Py_ssize_t cap = self.cap, j = i, home
        cdef BIEntry* t = self.table
        while True:
            j += 1
            if j == cap:
                j = 0
            if t[j].n == 0:
                break
            home = _bi_home(t[j].key, cap)
            # Move j back to i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
                t[i] = t[j]
                i = j
        memset(&t[i], 0, sizeof(BIEntry))

    def __len__(self):
        return self.size

    @property
    def pairs(self):
        """Holdings: (key, copy) pairs, a copy counted once per holding."""
        return self.n_pairs

    def hold(self, key, copy):
        cdef int64_t k = _bi_key(key)
        cdef int32_t c = _bi_copy(copy)
        self.reserve(self.size + 1)
        self.hold_key(k, c)

    def unhold(self, key, copy):
        cdef int64_t k = _bi_key(key)
        cdef int32_t c = _bi_copy(copy)
        cdef bint done = self.drop_key(k, c)
        if done:
            self.maybe_shrink()
        return done

    def holds(self, key, copy):
        cdef int64_t k = _bi_key(key)
        cdef int32_t c = _bi_copy(copy)
        return self.holds_key(k, c)

    def holders(self, key):
        cdef int64_t k = _bi_key(key)
        cdef Py_ssize_t i = self.find(k), j, n
        if i < 0:
            return []
        n = self.table[i].n
        # Copy first: making the list may run the garbage collector (and finalizers).
        cdef bytes snapshot = PyBytes_FromStringAndSize(<char*>self.copies(&self.table[i]),
                                                        n * sizeof(int32_t))
        cdef const int32_t* p = <const int32_t*>PyBytes_AS_STRING(snapshot)
        return [p[j] for j in range(n)]

    def add(self, copy, keys):
        cdef int32_t c = _bi_copy(copy)
        cdef bytes data = _bi_keys(keys)
        cdef const int64_t* p = <const int64_t*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = len(data) // 8, i
        self.reserve_for(p, n)
        for i in range(n):
            if i + _BI_AHEAD < n:
                self.fetch(p[i + _BI_AHEAD], _BI_STORE_LINES)
            self.hold_key(p[i], c)
        return n

    def store(self, copy, keys):
        cdef int32_t c = _bi_copy(copy)
        cdef bytes data = _bi_keys(keys)
        cdef const int64_t* p = <const int64_t*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = len(data) // 8, i
        cdef Py_ssize_t stored = 0, duplicates = 0
        cdef BIEntry* e
        self.reserve_for(p, n)
        for i in range(n):
            if i + _BI_AHEAD < n:
                self.fetch(p[i + _BI_AHEAD], _BI_STORE_LINES)
            e = &self.table[self.slot_of(p[i])]
            if self.entry_holds(e, c):
                duplicates += 1
            else:
                self.hold_at(e, p[i], c)  # in the slot just found: no second probe
                stored += 1
        return stored, duplicates

    def remove(self, copy, keys):
        cdef int32_t c = _bi_copy(copy)
        cdef bytes data = _bi_keys(keys)
        cdef const int64_t* p = <const int64_t*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = len(data) // 8, i
        cdef Py_ssize_t removed = 0
        for i in range(n):
            if i + _BI_AHEAD < n:
                self.fetch(p[i + _BI_AHEAD], _BI_REMOVE_LINES)
            if self.drop_key(p[i], c):
                removed += 1
        self.maybe_shrink()
        return removed, n - removed

    def clear_copy(self, copy):
        cdef int32_t c = _bi_copy(copy)
        cdef Py_ssize_t i, j, k, dropped = 0, emptied = 0, cap = self.cap
        cdef BIEntry* e
        cdef int32_t* items
        cdef int32_t last
        cdef bint rebuilt
        # An emptied slot breaks its probe run until the table is rebuilt: the table it may
        # be rebuilt into is had first, so that a MemoryError leaves the index as it was.
        cdef BIEntry* spare = _bi_alloc(cap, False)
        if spare == NULL:
            raise MemoryError()
        for i in range(cap):
            # A holder list is two loads away (its place in ``lists``, then the list): both
            # are fetched ahead, the place twice as far as the list.
            if i + 2 * _BI_CLEAR_AHEAD < cap and self.table[i + 2 * _BI_CLEAR_AHEAD].n > 1:
                rc_prefetch(&self.lists[self.table[i + 2 * _BI_CLEAR_AHEAD].one])
            if i + _BI_CLEAR_AHEAD < cap and self.table[i + _BI_CLEAR_AHEAD].n > 1:
                rc_prefetch(self.lists[self.table[i + _BI_CLEAR_AHEAD].one])
            e = &self.table[i]
            if e.n == 1:
                if e.one == c:
                    e.n = 0  # emptied; the table is rebuilt below
                    dropped += 1
                    emptied += 1
                    self.size -= 1
            elif e.n > 1:
                items = self.lists[e.one]
                k = 0
                for j in range(e.n):
                    if items[j] != c:
                        items[k] = items[j]
                        k += 1
                dropped += e.n - k
                if k == 0:
                    self.free_list(e.one)
                    e.n = 0
                    emptied += 1
                    self.size -= 1
                elif k == 1:
                    last = items[0]
                    self.free_list(e.one)
                    e.one = last
                    e.n = 1
                else:
                    # The list keeps its capacity (a power of two >= 4 at least k).
                    e.n = <int32_t>k
        self.n_pairs -= dropped
        if emptied:  # only an emptied slot breaks a probe run
            # Rebuilt (the emptied slots skipped: probe runs come out whole), half full when
            # under a quarter full, as maybe_shrink would, else (or short of memory for
            # that) at its size, into the spare.
            rebuilt = False
            if self.size * 4 < cap:
                try:
                    self.rebuild(max(8, 2 * self.size))
                    rebuilt = True
                except MemoryError:
                    pass
            if not rebuilt:
                memset(spare, 0, cap * sizeof(BIEntry))
                self.move_to(spare, cap)
                spare = NULL
        _bi_free(spare, cap)
        return dropped

    def overlap(self, seed, data, page_bytes, owners):
        # A list of token ids is read as it is hashed (each id loaded while the chain's
        # multiplies run), and every id is checked, walked or not: the same answer and the
        # same errors as reading it into bytes first, which is what happens when another
        # argument is wrong (the ids' errors come first).
        cdef list items = None
        cdef bytes owner_data = None
        cdef bint is_array = type(data) is _ndarray
        cdef Py_buffer view
        if is_array:
            if data.dtype.str != "<i8" or data.ndim != 1 or not data.flags.c_contiguous:
                raise TypeError(f"data as an array must be 1-D contiguous little-endian int64, "
                                f"got {data.ndim}-D {data.dtype}")
        elif type(data) is list:
            try:
                check_chain_args(seed, page_bytes)
                owner_data = _bi_keys(owners)
                _check_owners(owner_data)
                items = <list>data
            except (TypeError, ValueError, OverflowError):
                data = _list_le_bytes(<list>data)
                owner_data = None
        elif type(data) is not bytes:
            raise TypeError(f"data must be bytes, a list of ints or an int64 numpy array, got "
                            f"{type(data).__name__}")
        if items is None:
            check_chain_args(seed, page_bytes)
            owner_data = _bi_keys(owners)
            _check_owners(owner_data)
        cdef Py_ssize_t length
        if items is not None:
            length = len(items) * 8
        elif is_array:
            length = data.nbytes
        else:
            length = len(<bytes>data)
        if page_bytes > length:
            if items is not None:
                _list_le_bytes(items)  # every id checked, as when read first
            return []
        cdef Py_ssize_t n_owners = len(owner_data) // 8, j
        cdef bytes buffer = None if items is not None or is_array else <bytes>data
        # scratch: the active owners (n_owners), then the results (2 * n_owners)
        cdef int32_t* scratch = <int32_t*>PyMem_Malloc((3 * n_owners + 1) * sizeof(int32_t))
        cdef int32_t* marks
        if scratch == NULL:
            raise MemoryError()
        if self.marks_cap < n_owners:
            marks = <int32_t*>PyMem_Realloc(self.marks, (n_owners + 1) * sizeof(int32_t))
            if marks == NULL:
                PyMem_Free(scratch)
                raise MemoryError()
            memset(marks, 0, (n_owners + 1) * sizeof(int32_t))
            self.marks = marks
            self.marks_cap = n_owners
            self.stamp = 0
        # From here to the snapshot nothing runs Python code or allocates: a list of ids
        # cannot change, and the owners' and the data's bytes are held by this frame.
        cdef Py_ssize_t n_out, bad = -1
        cdef const unsigned char* p = NULL
        if buffer is not None:
            p = <const unsigned char*>PyBytes_AS_STRING(buffer)
        elif is_array:
            # Held for the walk (no Python code runs meanwhile): its memory stays where it is.
            try:
                PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS)
            except BaseException:
                PyMem_Free(scratch)
                raise
            p = <const unsigned char*>view.buf
            length = min(length, view.len)
        n_out = _walk(self, <uint64_t>(seed & 0xFFFFFFFFFFFFFFFF), items, p, length,
                      page_bytes // 8, <const int64_t*>PyBytes_AS_STRING(owner_data),
                      n_owners, scratch, &bad)
        if is_array:
            PyBuffer_Release(&view)
        if bad >= 0:
            PyMem_Free(scratch)
            _list_le_bytes(items[bad:bad + 1], bad)  # raises for the id at ``bad``
            raise AssertionError("unreachable")
        cdef bytes snapshot
        try:
            snapshot = PyBytes_FromStringAndSize(<char*>(scratch + n_owners),
                                                 2 * n_out * sizeof(int32_t))
        finally:
            PyMem_Free(scratch)
        cdef const int32_t* q = <const int32_t*>PyBytes_AS_STRING(snapshot)
        return [(q[2 * j], q[2 * j + 1]) for j in range(n_out)]


# The most pages overlap's walk hashes before it probes them: their table slots are fetched
# while the next ones are hashed, so a walk over a table larger than the cache waits for
# memory about once per batch of pages instead of once a page. Batches grow from one page,
# so a walk that stops early hashes at most as many pages again.
DEF _OV_AHEAD = 16


cdef Py_ssize_t _walk(BlockIndex index, uint64_t h, list items, const unsigned char* p,
                      Py_ssize_t length, Py_ssize_t per_page, const int64_t* own,
                      Py_ssize_t n_owners, int32_t* scratch, Py_ssize_t* bad) noexcept:
    """``BlockIndex.overlap``'s walk, no Python code run: hashes the pages of ``items`` (a list
    of ids, read here) or of ``p`` (``length`` bytes), probes them while some owner holds
    every page so far, and writes ``(owner, depth)`` pairs after the ``n_owners`` active
    owners of ``scratch``; returns how many. An id of ``items`` that is not an exact int64
    (walked or not) sets ``bad`` to its position instead."""
    cdef Py_ssize_t pages = length // (per_page * 8), n_items = length // 8
    cdef Py_ssize_t page, first = 0, last = 0, batch = 1, q, j, k, slot
    cdef Py_ssize_t n_active = -1, depth = 0, n_out = 0, at, held
    cdef uint64_t ring[_OV_AHEAD]
    cdef Py_ssize_t slots[_OV_AHEAD]
    cdef int64_t v, key
    cdef int32_t stamp, cid
    cdef int64_t o
    cdef BIEntry* e
    cdef BIEntry* table = index.table
    cdef Py_ssize_t cap = index.cap
    cdef const int32_t* items_of
    cdef int32_t* marks = index.marks
    cdef int32_t* active = scratch
    cdef int32_t* out = scratch + n_owners
    for page in range(pages):
        if page == last:
            # The next batch: hash its pages, fetching each one's home slot...
            first = page
            last = min(pages, page + batch)
            if batch < _OV_AHEAD:
                batch *= 2
            for q in range(first, last):
                if items is not None:
                    at = q * per_page
                    for j in range(per_page):
                        if not rc_read_int(rc_list_item(items, at + j), &v):
                            bad[0] = at + j
                            return 0
                        h = (h ^ <uint64_t>v) * <uint64_t>0x9E3779B97F4A7C15
                        h ^= h >> 32
                    h = fmix64(h)
                else:
                    h = hash_page(h, p + q * per_page * 8, per_page)
                ring[q - first] = h
                slot = _bi_home(<int64_t>h, cap)  # the key's home slot
                slots[q - first] = slot
                rc_prefetch(&table[slot])
            # ... then find them, fetching the holder list of a block held more than once
            # (past a block no one holds, the walk stops).
            for q in range(first, last):
                key = <int64_t>ring[q - first]
                slot = slots[q - first]
                while table[slot].n and table[slot].key != key:  # BlockIndex.find's probe
                    slot += 1
                    if slot == cap:
                        slot = 0
                if not table[slot].n:
                    slots[q - first] = -1
                    break
                slots[q - first] = slot
                if table[slot].n > 1:
                    rc_prefetch(index.lists[table[slot].one])
        slot = slots[page - first]
        if slot < 0:
            break
        e = &table[slot]
        # The active owners' marks hold the previous page's stamp: a holder of this page
        # whose mark does is still active (and marked with this page's), once however many
        # copies it has here.
        if index.stamp >= 0x3FFFFFF0:
            memset(marks, 0, (index.marks_cap + 1) * sizeof(int32_t))
            index.stamp = 2
            for j in range(n_active if n_active > 0 else 0):
                marks[active[j]] = 2
        index.stamp += 2
        stamp = index.stamp
        items_of = index.copies(e)
        if n_active < 0:  # the first page: its holders
            n_active = 0
            for k in range(e.n):
                cid = items_of[k]
                if cid < n_owners:
                    o = own[cid]
                    if o >= 0 and marks[o] != stamp:
                        marks[o] = stamp
                        active[n_active] = <int32_t>o
                        n_active += 1
        else:
            held = 0
            for k in range(e.n):
                cid = items_of[k]
                if cid < n_owners:
                    o = own[cid]
                    if o >= 0 and marks[o] == stamp - 2:
                        marks[o] = stamp
                        held += 1
            if held < n_active:  # some active owner's run ends here
                k = 0
                for j in range(n_active):
                    if marks[active[j]] == stamp:
                        active[k] = active[j]
                        k += 1
                    else:
                        out[2 * n_out] = active[j]
                        out[2 * n_out + 1] = <int32_t>depth
                        n_out += 1
                n_active = k
        if n_active == 0:
            break
        depth += 1
    if items is not None:
        for j in range(last * per_page, n_items):  # the ids past the walk are checked too
            if not rc_read_int(rc_list_item(items, j), &v):
                bad[0] = j
                return 0
    for j in range(n_active if n_active > 0 else 0):
        out[2 * n_out] = active[j]
        out[2 * n_out + 1] = <int32_t>depth
        n_out += 1
    return n_out


def _block_index_from(keys, copies):
    """A ``BlockIndex`` holding ``keys[i]`` for ``copies[i]`` (int64 and int32 bytes), in order."""
    if (type(keys) is not bytes or type(copies) is not bytes or len(keys) % 8
            or len(copies) % 4 or len(keys) // 8 != len(copies) // 4):
        raise ValueError("malformed BlockIndex state")
    cdef Py_ssize_t n = len(keys) // 8, i
    cdef const int64_t* kp = <const int64_t*>PyBytes_AS_STRING(keys)
    cdef const int32_t* cp = <const int32_t*>PyBytes_AS_STRING(copies)
    for i in range(n):
        if not 0 <= cp[i] < 0x7FFFFFFF:
            raise ValueError("malformed BlockIndex state")
    cdef BlockIndex index = BlockIndex()
    for i in range(n):  # grown as keys arrive: a key is listed once per holding
        index.reserve(index.size + 1)
        index.hold_key(kp[i], cp[i])
    return index


# -- publisher hash map ---------------------------------------------------------------------
# KvIndexer's map from a copy's publisher hashes to block keys: a hash is told apart by 64
# bits (``hash64``), so an entry is 16 bytes whatever the publisher sends.
DEF _KM_INT_SALT = 0x6A09E667F3BCC909
DEF _KM_BYTES_SALT = 0xBB67AE8584CAA73B


cdef inline uint64_t _km_hash_mem(const unsigned char* p, Py_ssize_t n) noexcept:
    """The hash of bytes ``p[:n]`` (``hash64`` of a bytes value), nonzero."""
    cdef Py_ssize_t i = 0, j
    cdef uint64_t h = (<uint64_t>n) ^ <uint64_t>_KM_BYTES_SALT, w
    while i < n:
        w = 0
        for j in range(min(8, n - i)):
            w |= (<uint64_t>p[i + j]) << (8 * j)
        h = fmix64(h ^ w) + <uint64_t>0x9E3779B97F4A7C15
        i += 8
    h = fmix64(h)
    return h if h else 1


cdef inline uint64_t _km_hash_u64(uint64_t value) noexcept:
    """The hash of an int whose value mod 2**64 is ``value``, nonzero."""
    cdef uint64_t h = fmix64(value ^ <uint64_t>_KM_INT_SALT)
    return h if h else 1


cdef uint64_t _km_hash(object value) except? 0:
    """``value`` (an int, or bytes) as a nonzero 64-bit hash; see ``_blocks_py.hash64``."""
    if type(value) is bytes:
        return _km_hash_mem(<const unsigned char*>PyBytes_AS_STRING(value), len(<bytes>value))
    elif type(value) is int:
        return _km_hash_u64(PyLong_AsUnsignedLongLongMask(value))
    elif isinstance(value, bytes):
        return _km_hash(bytes(value))
    else:
        return _km_hash(int(_index(value)))


cdef object _index = __import__("operator").index


cdef class KeyMap:
    """KeyMap()
--

Publisher hash (an int, or bytes) -> block key (an int64); see ``_blocks_py``."""

    def __cinit__(self):
        self.table = NULL
        self.cap = 0
        self.n = 0

    def __dealloc__(self):
        PyMem_Free(self.table)
        self.table = NULL

    def __reduce__(self):
        cdef bytes state = PyBytes_FromStringAndSize(NULL, self.n * 16)
        cdef uint64_t* out = <uint64_t*>PyBytes_AS_STRING(state)
        cdef Py_ssize_t i, k = 0
        for i in range(self.cap):
            if self.table[i].h and k < len(state) // 16:
                out[2 * k] = self.table[i].h
                out[2 * k + 1] = <uint64_t>self.table[i].key
                k += 1
        return (_key_map_from, (state,))

    cdef Py_ssize_t find(self, uint64_t h) noexcept:
        cdef Py_ssize_t i
        if self.cap == 0:
            return -1
        i = <Py_ssize_t>rc_fastrange(h, <uint64_t>self.cap)
        while self.table[i].h:
            if self.table[i].h == h:
                return i
            i += 1
            if i == self.cap:
                i = 0
        return -1

    cdef void insert(self, uint64_t h, int64_t key) noexcept:
        # A hash not present; the table has room.
        cdef Py_ssize_t i = <Py_ssize_t>rc_fastrange(h, <uint64_t>self.cap)
        while self.table[i].h:
            i += 1
            if i == self.cap:
                i = 0
        self.table[i].h = h
        self.table[i].key = key
        self.n += 1

    cdef int resize(self, Py_ssize_t cap) except -1:
        cdef KMEntry* old = self.table
        cdef Py_ssize_t old_cap = self.cap, i
        cdef KMEntry* fresh = NULL
        if cap:
            fresh = <KMEntry*>PyMem_Malloc(cap * sizeof(KMEntry))
            if fresh == NULL:
                raise MemoryError()
            memset(fresh, 0, cap * sizeof(KMEntry))
        self.table = fresh
        self.cap = cap
        self.n = 0
        for i in range(old_cap):
            if old[i].h:
                self.insert(old[i].h, old[i].key)
        PyMem_Free(old)
        return 0

    cdef int room(self, Py_ssize_t more) except -1:
        # Room for ``more`` new hashes, at most 80% full; a grown table is 60% full.
        cdef Py_ssize_t need = self.n + more
        if need * 5 > self.cap * 4:
            self.resize(need * 5 // 3 + 8)
        return 0

    cdef void delete_slot(self, Py_ssize_t i) noexcept:
        # Backward-shift deletion: later entries of the run move back over the hole.
        cdef Py_ssize_t cap = self.cap, j = i, home
        cdef KMEntry* t = self.table
        while True:
            j += 1
            if j == cap:
                j = 0
            if t[j].h == 0:
                break
            home = <Py_ssize_t>rc_fastrange(t[j].h, <uint64_t>cap)
            # Move j back to i unless its home lies cyclically in (i, j].
            if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
                t[i] = t[j]
                i = j
        t[i].h = 0
        t[i].key = 0
        self.n -= 1

    def __len__(self):
        return self.n

    def get(self, block_hash, default=None):
        cdef Py_ssize_t i = self.find(_km_hash(block_hash))
        return default if i < 0 else self.table[i].key

    def __contains__(self, block_hash):
        return self.find(_km_hash(block_hash)) >= 0

    def pop(self, block_hash, default=None):
        cdef Py_ssize_t i = self.find(_km_hash(block_hash))
        cdef int64_t key
        if i < 0:
            return default
        key = self.table[i].key
        self.delete_slot(i)
        if self.n * 5 < self.cap and self.cap > 8:
            try:
                self.resize(self.n * 5 // 3 + 8 if self.n else 0)
            except MemoryError:
                pass  # stays larger
        return key

    def put(self, block_hash, key):
        cdef uint64_t h = _km_hash(block_hash)
        cdef int64_t k = _bi_key(key)
        cdef Py_ssize_t i = self.find(h)
        if i >= 0:
            self.table[i].key = k
            return
        self.room(1)
        self.insert(h, k)

    def isdisjoint(self, hashes):
        """True when no hash of ``hashes`` is here and none is there twice."""
        cdef list hs = [_km_hash(value) for value in hashes]
        if len(set(hs)) != len(hs):
            return False
        for h in hs:
            if self.find(h) >= 0:
                return False
        return True

    def update(self, hashes, keys):
        """Map ``hashes[i]`` to ``keys[i]`` (a list or tuple of ints, or int64 bytes)."""
        cdef list hs = [_km_hash(value) for value in hashes]
        cdef bytes data = _bi_keys(keys)
        cdef const int64_t* kp = <const int64_t*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t n = len(data) // 8, i, slot
        if len(hs) != n:
            raise ValueError(f"{len(hs)} hashes for {n} keys")
        self.room(n)
        for i in range(n):
            slot = self.find(<uint64_t>hs[i])
            if slot >= 0:
                self.table[slot].key = kp[i]
            else:
                self.insert(<uint64_t>hs[i], kp[i])

    def add_new(self, hashes, keys):
        """``update`` when ``isdisjoint(hashes)`` (True), else nothing (False); one pass
        over C buffers, no int object per hash."""
        cdef tuple values = tuple(hashes)  # hashing may run code: a snapshot
        cdef Py_ssize_t n = len(values), i, j, mask = 1
        cdef bytes hbuf = PyBytes_FromStringAndSize(NULL, n * 8)
        cdef uint64_t* hs = <uint64_t*>PyBytes_AS_STRING(hbuf)
        for i in range(n):
            hs[i] = _km_hash(values[i])
        cdef bytes data = _bi_keys(keys)
        cdef const int64_t* kp = <const int64_t*>PyBytes_AS_STRING(data)
        if len(data) // 8 != n:
            raise ValueError(f"{n} hashes for {len(data) // 8} keys")
        # none twice: a set of the batch's hashes (0 is never a hash), at most half full
        while mask < 2 * n:
            mask *= 2
        cdef bytes seen_buf = PyBytes_FromStringAndSize(NULL, mask * 8)
        cdef uint64_t* seen = <uint64_t*>PyBytes_AS_STRING(seen_buf)
        memset(seen, 0, mask * 8)
        mask -= 1
        for i in range(n):
            if self.find(hs[i]) >= 0:
                return False
            j = <Py_ssize_t>(fmix64(hs[i]) & <uint64_t>mask)
            while seen[j]:
                if seen[j] == hs[i]:
                    return False
                j = (j + 1) & mask
            seen[j] = hs[i]
        self.room(n)
        for i in range(n):
            self.insert(hs[i], kp[i])
        return True

    def values(self):
        cdef bytes snapshot = PyBytes_FromStringAndSize(NULL, self.n * 8)
        cdef int64_t* out = <int64_t*>PyBytes_AS_STRING(snapshot)
        cdef Py_ssize_t i, k = 0
        for i in range(self.cap):
            if self.table[i].h and k < len(snapshot) // 8:
                out[k] = self.table[i].key
                k += 1
        return np.frombuffer(snapshot, dtype=np.int64).tolist()

    def clear(self):
        PyMem_Free(self.table)
        self.table = NULL
        self.cap = 0
        self.n = 0


def hash64(value):
    """``value`` (an int, or bytes) as the nonzero 64-bit hash a ``KeyMap`` keeps."""
    return _km_hash(value)


def _key_map_from(state):
    """A ``KeyMap`` holding the (hash, key) pairs of ``state`` (uint64, int64 pairs)."""
    if type(state) is not bytes or len(state) % 16:
        raise ValueError("malformed KeyMap state")
    cdef const uint64_t* p = <const uint64_t*>PyBytes_AS_STRING(state)
    cdef Py_ssize_t n = len(state) // 16, i
    cdef KeyMap out = KeyMap()
    for i in range(n):
        if p[2 * i] == 0:
            raise ValueError("malformed KeyMap state")
    out.room(n)
    for i in range(n):
        if out.find(p[2 * i]) < 0:
            out.insert(p[2 * i], <int64_t>p[2 * i + 1])
    return out


# -- wire batches ---------------------------------------------------------------------------
# KvIndexer's ingest of a payload in one call: ``read_wire`` reads and checks a whole batch
# into buffers of its own (nothing else changes), ``apply_wire`` applies its events to one
# copy's holdings, calling no Python code. The batches read and what each event does: see
# ``_blocks_py``.

DEF _MP_NIL = 1
DEF _MP_BOOL = 2
DEF _MP_INT = 3
DEF _MP_FLOAT = 4
DEF _MP_STR = 5
DEF _MP_BIN = 6
DEF _MP_ARRAY = 7
DEF _MP_MAP = 8

DEF _MP_DEPTH = 8  # how deeply a value of a field not read may nest

DEF _W_STORED = 1
DEF _W_REMOVED = 2
DEF _W_CLEARED = 3


cdef struct MPVal:
    int kind
    bint big           # an int beyond int64 (a uint64 over 2**63 - 1)
    int64_t i          # an int's value (not big)
    uint64_t u         # an int's value mod 2**64
    Py_ssize_t at      # a str's or bin's first byte
    Py_ssize_t n       # a str's or bin's length; an array's items; a map's pairs


cdef int _mp_next(const unsigned char* p, Py_ssize_t size, Py_ssize_t* pos,
                  MPVal* v) noexcept:
    """Read the head of the value at ``pos[0]`` into ``v`` and move ``pos[0]`` past it (past a
    str's or bin's bytes too). 0: not a value read here (truncated, an ext, a str that is not
    ASCII, a count beyond the bytes left)."""
    cdef Py_ssize_t at = pos[0], n = 0, i
    cdef unsigned char b
    cdef int width = 0
    cdef uint64_t u
    if at >= size:
        return 0
    b = p[at]
    at += 1
    v.big = False
    if b <= 0x7F or b >= 0xE0:  # fixints
        v.kind = _MP_INT
        v.i = <int64_t>b if b <= 0x7F else <int64_t>b - 256
        v.u = <uint64_t>v.i
        pos[0] = at
        return 1
    if 0xCC <= b <= 0xD3:  # uint8..uint64, int8..int64
        width = 1 << ((b - 0xCC) & 3)
        if width > size - at:
            return 0
        u = _be(p + at, width)
        if b <= 0xCF:
            v.u = u
            v.big = u > <uint64_t>0x7FFFFFFFFFFFFFFF
            v.i = <int64_t>u
        else:
            if width < 8:  # sign-extend
                v.i = <int64_t>(u << (64 - 8 * width)) >> (64 - 8 * width)
            else:
                v.i = <int64_t>u
            v.u = <uint64_t>v.i
        v.kind = _MP_INT
        pos[0] = at + width
        return 1
    if b == 0xC0:
        v.kind = _MP_NIL
        pos[0] = at
        return 1
    if b == 0xC2 or b == 0xC3:
        v.kind = _MP_BOOL
        pos[0] = at
        return 1
    if b == 0xCA or b == 0xCB:
        width = 4 if b == 0xCA else 8
        if width > size - at:
            return 0
        v.kind = _MP_FLOAT
        pos[0] = at + width
        return 1
    if 0x80 <= b <= 0x8F:
        v.kind = _MP_MAP
        n = b & 0x0F
    elif 0x90 <= b <= 0x9F:
        v.kind = _MP_ARRAY
        n = b & 0x0F
    elif 0xA0 <= b <= 0xBF:
        v.kind = _MP_STR
        n = b & 0x1F
    else:
        if b == 0xD9 or b == 0xC4:
            width = 1
        elif b == 0xDA or b == 0xC5 or b == 0xDC or b == 0xDE:
            width = 2
        elif b == 0xDB or b == 0xC6 or b == 0xDD or b == 0xDF:
            width = 4
        else:
            return 0  # 0xC1 (never used), ext
        if width > size - at:
            return 0
        n = <Py_ssize_t>_be(p + at, width)
        at += width
        if b == 0xD9 or b == 0xDA or b == 0xDB:
            v.kind = _MP_STR
        elif b == 0xC4 or b == 0xC5 or b == 0xC6:
            v.kind = _MP_BIN
        elif b == 0xDC or b == 0xDD:
            v.kind = _MP_ARRAY
        else:
            v.kind = _MP_MAP
    v.n = n
    if v.kind == _MP_MAP:
        if n > (size - at) // 2:  # at least two bytes a pair
            return 0
    elif n > size - at:  # a str's or bin's bytes, at least a byte an item
        return 0
    if v.kind == _MP_STR or v.kind == _MP_BIN:
        v.at = at
        if v.kind == _MP_STR:
            for i in range(n):
                if p[at + i] >= 0x80:
                    return 0
        at += n
    pos[0] = at
    return 1


cdef int _mp_skip(const unsigned char* p, Py_ssize_t size, Py_ssize_t* pos,
                  int depth) noexcept:
    """Move ``pos[0]`` past one whole value; 0 where ``_mp_next`` gives 0 or it nests deeper
    than ``_MP_DEPTH``."""
    cdef MPVal v
    cdef Py_ssize_t i, count
    if not _mp_next(p, size, pos, &v):
        return 0
    if v.kind == _MP_ARRAY or v.kind == _MP_MAP:
        if depth >= _MP_DEPTH:
            return 0
        count = v.n * 2 if v.kind == _MP_MAP else v.n
        for i in range(count):
            if not _mp_skip(p, size, pos, depth + 1):
                return 0
    return 1


cdef inline bint _mp_is(const unsigned char* p, MPVal* v, const char* name) noexcept:
    # Whether the str ``v`` is ``name``.
    cdef Py_ssize_t i = 0
    while name[i]:
        if i >= v.n or p[v.at + i] != <unsigned char>name[i]:
            return False
        i += 1
    return i == v.n


# The fields of an event, in the positional layout's order after the tag.
DEF _F_HASHES = 0
DEF _F_PARENT = 1
DEF _F_TOKENS = 2
DEF _F_BLOCK_SIZE = 3
DEF _F_LORA_ID = 4
DEF _F_MEDIUM = 5
DEF _F_LORA_NAME = 6
DEF _F_EXTRA_KEYS = 7
DEF _F_GROUP = 8
DEF _F_CACHE_SALT = 9
DEF _F_TYPE = 10



cdef int _field_of(const unsigned char* p, MPVal* key) noexcept:
    # The field a map key names (_F_*), or -1: a field no event has.
    if _mp_is(p, key, "block_hashes"):
        return _F_HASHES
    if _mp_is(p, key, "parent_block_hash"):
        return _F_PARENT
    if _mp_is(p, key, "token_ids"):
        return _F_TOKENS
    if _mp_is(p, key, "block_size"):
        return _F_BLOCK_SIZE
    if _mp_is(p, key, "lora_id"):
        return _F_LORA_ID
    if _mp_is(p, key, "medium"):
        return _F_MEDIUM
    if _mp_is(p, key, "lora_name"):
        return _F_LORA_NAME
    if _mp_is(p, key, "extra_keys"):
        return _F_EXTRA_KEYS
    if _mp_is(p, key, "group_idx"):
        return _F_GROUP
    if _mp_is(p, key, "cache_salt"):
        return _F_CACHE_SALT
    if _mp_is(p, key, "type"):
        return _F_TYPE
    return -1


cdef struct WEvent:
    int32_t kind          # _W_STORED, _W_REMOVED, _W_CLEARED
    int32_t parent        # 1: a parent hash, 0: none
    int32_t parent_int    # the parent is an int (``parent_i``: its value mod 2**64)
    int32_t extra         # extra_keys sent (an array of nils)
    Py_ssize_t tok        # its first token id in WireBatch.tokens
    Py_ssize_t n_tok
    Py_ssize_t hsh        # its first hash in WireBatch.h64 / hval / hint
    Py_ssize_t n_hsh
    int64_t block_size
    uint64_t parent_h     # hash64 of the parent
    int64_t parent_i
    Py_ssize_t medium_at  # its medium: -1 none (nil), else the str's place and length
    Py_ssize_t medium_n
    int32_t has_group
    int64_t group


cdef int _grow(void** buf, Py_ssize_t* cap, Py_ssize_t need, size_t item) except -1:
    cdef Py_ssize_t new_cap = cap[0]
    cdef void* grown
    if need <= new_cap:
        return 0
    new_cap = max(need, 2 * new_cap, 16)
    grown = PyMem_Realloc(buf[0], new_cap * item)
    if grown == NULL:
        raise MemoryError()
    buf[0] = grown
    cap[0] = new_cap
    return 0


@cython.final
@cython.no_gc  # holds a str and an int at most: never in a cycle
cdef class WireBatch:
    """A batch ``read_wire`` read: its events in buffers of its own (see ``_blocks_py``)."""

    cdef WEvent* events
    cdef Py_ssize_t n, events_cap
    cdef int64_t* tokens           # every event's token ids, int64 little-endian
    cdef Py_ssize_t n_tokens, tokens_cap
    cdef uint64_t* h64             # every event's hashes: hash64
    cdef int64_t* hval             # the hash as an int64 (its value mod 2**64) when hint
    cdef unsigned char* hint       # the hash is an int: a block's own key when hval is it
    cdef Py_ssize_t n_hashes, hashes_cap, hint_cap, hval_cap
    cdef Py_ssize_t max_hsh        # the most hashes of one event
    cdef object _medium            # the tier of its stores and removals (None: none)
    cdef object _group

    def __cinit__(self):
        self.events = NULL
        self.tokens = NULL
        self.h64 = NULL
        self.hval = NULL
        self.hint = NULL
        self.n = self.events_cap = self.n_tokens = self.tokens_cap = 0
        self.n_hashes = self.hashes_cap = self.hint_cap = self.hval_cap = self.max_hsh = 0

    def __dealloc__(self):
        PyMem_Free(self.events)
        PyMem_Free(self.tokens)
        PyMem_Free(self.h64)
        PyMem_Free(self.hval)
        PyMem_Free(self.hint)

    def __len__(self):
        return self.n

    @property
    def medium(self):
        """The ``medium`` of its stores and removals (one for all of them; ``"GPU"`` for
        those that name none), or None when it has none."""
        return self._medium

    @property
    def group(self):
        """The ``group_idx`` of its stores and removals (one for all of them), or None."""
        return self._group

    def __reduce__(self):
        raise TypeError("a WireBatch is not pickled: read the payload again")

    cdef int hashes_room(self, Py_ssize_t more) except -1:
        cdef Py_ssize_t need = self.n_hashes + more
        _grow(<void**>&self.h64, &self.hashes_cap, need, sizeof(uint64_t))
        _grow(<void**>&self.hval, &self.hval_cap, need, sizeof(int64_t))
        _grow(<void**>&self.hint, &self.hint_cap, need, sizeof(unsigned char))
        return 0

    cdef int read_hashes(self, const unsigned char* p, Py_ssize_t size, Py_ssize_t* pos,
                         WEvent* e) except -1:
        cdef MPVal v
        cdef Py_ssize_t k, j, count
        if not _mp_next(p, size, pos, &v) or v.kind != _MP_ARRAY:
            return 0
        count = v.n
        self.hashes_room(count)
        e.hsh = self.n_hashes
        e.n_hsh = count
        for k in range(count):
            j = self.n_hashes + k
            if not _mp_next(p, size, pos, &v):
                return 0
            if v.kind == _MP_INT:
                self.h64[j] = _km_hash_u64(v.u)
                self.hval[j] = v.i  # a uint64 past int64 wraps: ints compare mod 2**64
                self.hint[j] = 1
            elif v.kind == _MP_BIN:
                self.h64[j] = _km_hash_mem(p + v.at, v.n)
                self.hval[j] = 0
                self.hint[j] = 0
            else:
                return 0
        self.n_hashes += e.n_hsh
        if e.n_hsh > self.max_hsh:
            self.max_hsh = e.n_hsh
        return 1

    cdef int read_tokens(self, const unsigned char* p, Py_ssize_t size, Py_ssize_t* pos,
                         WEvent* e) except -1:
        cdef MPVal v
        cdef Py_ssize_t k, count
        cdef int64_t* q
        if not _mp_next(p, size, pos, &v) or v.kind != _MP_ARRAY:
            return 0
        count = v.n
        _grow(<void**>&self.tokens, &self.tokens_cap, self.n_tokens + count, sizeof(int64_t))
        e.tok = self.n_tokens
        e.n_tok = count
        q = self.tokens + self.n_tokens
        cdef Py_ssize_t at = pos[0]
        cdef unsigned char b
        cdef uint64_t word
        cdef unsigned int wide
        for k in range(count):
            # the usual forms inline (token ids below 2**32), the others read as any value
            b = p[at] if at < size else 0xC1
            if b <= 0x7F:
                q[k] = b
                at += 1
            elif <unsigned int>(b - 0xCD) <= 1 and size - at >= 5:
                # uint16 and uint32 alike, without a branch between them (ids of a
                # vocabulary past 65,536 mix both at random): 4 bytes read, the uint16's
                # top 2 of them
                wide = b - 0xCD
                word = ((<uint64_t>p[at + 1] << 24) | (<uint64_t>p[at + 2] << 16)
                        | (<uint64_t>p[at + 3] << 8) | p[at + 4])
                q[k] = <int64_t>(word >> (16 - 16 * wide))
                at += 3 + 2 * wide
            elif b == 0xCD and size - at >= 3:  # a uint16 within 5 bytes of the end
                q[k] = (<int64_t>p[at + 1] << 8) | p[at + 2]
                at += 3
            elif b == 0xCC and size - at >= 2:
                q[k] = p[at + 1]
                at += 2
            else:
                pos[0] = at
                if not _mp_next(p, size, pos, &v) or v.kind != _MP_INT or v.big:
                    return 0
                at = pos[0]
                q[k] = v.i
        pos[0] = at
        if not _LITTLE_ENDIAN:
            for k in range(count):
                q[k] = <int64_t>_bswap64(<uint64_t>q[k])
        self.n_tokens += e.n_tok
        return 1

    cdef int read_field(self, int field, const unsigned char* p, Py_ssize_t size,
                        Py_ssize_t* pos, WEvent* e) except -1:
        """One field's value, as every event type takes it (a value another event type
        ignores but this one would not take: 0, not read here)."""
        cdef MPVal v
        cdef Py_ssize_t k, count
        if field == _F_HASHES:
            return self.read_hashes(p, size, pos, e)
        if field == _F_TOKENS:
            return self.read_tokens(p, size, pos, e)
        if not _mp_next(p, size, pos, &v):
            return 0
        if field == _F_PARENT:
            if v.kind == _MP_NIL:
                e.parent = 0
            elif v.kind == _MP_INT:
                e.parent = 1
                e.parent_h = _km_hash_u64(v.u)
                e.parent_i = v.i  # a uint64 past int64 wraps: ints compare mod 2**64
                e.parent_int = 1
            elif v.kind == _MP_BIN:
                e.parent = 1
                e.parent_h = _km_hash_mem(p + v.at, v.n)
                e.parent_int = 0
            else:
                return 0
        elif field == _F_BLOCK_SIZE:
            if v.kind != _MP_INT or v.big:
                return 0
            e.block_size = v.i
        elif field == _F_MEDIUM:
            if v.kind == _MP_STR:
                if v.n > 64:
                    return 0
                e.medium_at = v.at
                e.medium_n = v.n
            elif v.kind != _MP_NIL:
                return 0
        elif field == _F_LORA_ID or field == _F_LORA_NAME or field == _F_CACHE_SALT:
            return v.kind == _MP_NIL  # a namespace: read by KvIndexer itself
        elif field == _F_EXTRA_KEYS:
            if v.kind == _MP_ARRAY:
                e.extra = 1
                count = v.n
                for k in range(count):  # only entries that are nil
                    if not _mp_next(p, size, pos, &v) or v.kind != _MP_NIL:
                        return 0
            elif v.kind != _MP_NIL:
                return 0
        elif field == _F_GROUP:
            if v.kind == _MP_INT and not v.big:
                e.has_group = 1
                e.group = v.i
            elif v.kind != _MP_NIL:
                return 0
        elif field == _F_TYPE:
            if v.kind != _MP_STR:
                return 0
            if _mp_is(p, &v, "BlockStored"):
                e.kind = _W_STORED
            elif _mp_is(p, &v, "BlockRemoved"):
                e.kind = _W_REMOVED
            elif _mp_is(p, &v, "AllBlocksCleared"):
                e.kind = _W_CLEARED
            else:
                return 0
        return 1

    cdef int read_map_event(self, const unsigned char* p, Py_ssize_t size, Py_ssize_t* pos,
                            Py_ssize_t pairs, WEvent* e) except -1:
        cdef MPVal key
        cdef int field, seen = 0, need
        cdef Py_ssize_t k
        for k in range(pairs):
            if not _mp_next(p, size, pos, &key) or key.kind != _MP_STR:
                return 0
            field = _field_of(p, &key)
            if field < 0:
                if not _mp_skip(p, size, pos, 1):
                    return 0
                continue
            if seen & (1 << field):
                return 0  # a field twice
            seen |= 1 << field
            if not self.read_field(field, p, size, pos, e):
                return 0
        if e.kind == _W_STORED:
            need = ((1 << _F_HASHES) | (1 << _F_PARENT) | (1 << _F_TOKENS)
                    | (1 << _F_BLOCK_SIZE))
        elif e.kind == _W_REMOVED:
            need = 1 << _F_HASHES
        elif e.kind == _W_CLEARED:
            need = 0
        else:
            return 0  # no type
        return (seen & need) == need

    cdef int read_array_event(self, const unsigned char* p, Py_ssize_t size,
                              Py_ssize_t* pos, Py_ssize_t items, WEvent* e) except -1:
        cdef int places, k
        cdef Py_ssize_t rest
        if items < 1 or not self.read_field(_F_TYPE, p, size, pos, e):
            return 0
        if e.kind == _W_STORED:  # hashes, parent, tokens, block size, lora id, medium, ...
            if items < 7:
                return 0
            places = <int>min(items - 1, _F_GROUP + 1)
            for k in range(places):
                if not self.read_field(k, p, size, pos, e):
                    return 0
        elif e.kind == _W_REMOVED:  # hashes, medium, group
            if items < 3:
                return 0
            places = <int>min(items - 1, 3)
            for k in range(places):
                if not self.read_field(_F_HASHES if k == 0 else _F_MEDIUM if k == 1
                                       else _F_GROUP, p, size, pos, e):
                    return 0
        else:
            places = 0
        for rest in range(items - 1 - places):  # places past the known ones: not read
            if not _mp_skip(p, size, pos, 1):
                return 0
        return 1

    cdef int read(self, bytes data) except -1:
        """1: ``data`` read whole, 0: not one read here."""
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef Py_ssize_t size = len(data), pos = 0, k, n_batch, n_events
        cdef MPVal v
        cdef WEvent* e
        cdef WEvent* first = NULL
        cdef int layout = 0  # _MP_MAP or _MP_ARRAY: one layout a batch
        if not _mp_next(p, size, &pos, &v) or v.kind != _MP_ARRAY or not 2 <= v.n <= 3:
            return 0
        n_batch = v.n
        if not _mp_next(p, size, &pos, &v) or (v.kind != _MP_INT and v.kind != _MP_FLOAT):
            return 0  # ts
        if not _mp_next(p, size, &pos, &v) or v.kind != _MP_ARRAY:
            return 0
        n_events = v.n
        _grow(<void**>&self.events, &self.events_cap, n_events, sizeof(WEvent))
        for k in range(n_events):
            e = &self.events[k]
            memset(e, 0, sizeof(WEvent))
            e.medium_at = -1
            if not _mp_next(p, size, &pos, &v) or (v.kind != _MP_MAP and v.kind != _MP_ARRAY):
                return 0
            if layout and v.kind != layout:
                return 0
            layout = v.kind
            if v.kind == _MP_MAP:
                if not self.read_map_event(p, size, &pos, v.n, e):
                    return 0
            elif not self.read_array_event(p, size, &pos, v.n, e):
                return 0
            self.n = k + 1
            if e.kind == _W_CLEARED:
                continue
            if first == NULL:
                first = e
            elif (first.has_group != e.has_group or first.group != e.group
                  or not _same_medium(p, first, e)):
                return 0  # one copy a batch
        if n_batch == 3:
            if not _mp_next(p, size, &pos, &v) or (v.kind != _MP_NIL and v.kind != _MP_INT):
                return 0  # data_parallel_rank
        if pos != size:
            return 0
        if first != NULL:
            self._medium = ("GPU" if first.medium_at < 0 else
                            (<bytes>p[first.medium_at:first.medium_at + first.medium_n]
                             ).decode("ascii"))
            self._group = first.group if first.has_group else None
        return 1


cdef bint _same_medium(const unsigned char* p, WEvent* a, WEvent* b) noexcept:
    # Whether two events name one tier (none is "GPU").
    cdef const unsigned char* x = p + a.medium_at
    cdef const unsigned char* y = p + b.medium_at
    cdef Py_ssize_t nx = a.medium_n, ny = b.medium_n
    if a.medium_at < 0:
        x, nx = <const unsigned char*>"GPU", 3
    if b.medium_at < 0:
        y, ny = <const unsigned char*>"GPU", 3
    return nx == ny and memcmp(x, y, nx) == 0


def read_wire(data):
    """A wire batch read into a ``WireBatch``, or None; see ``_blocks_py``."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    cdef WireBatch batch = WireBatch()
    if not batch.read(<bytes>data):
        return None
    return batch


# -- a subscriber's stream ---------------------------------------------------------------
def recv_stream(handle, limit, expected):
    """A subscriber's stream messages read without waiting, in one call through libzmq; see
    ``_blocks_py``. None where libzmq's calls cannot be bound (read through pyzmq then)."""
    if type(handle) is not int or type(limit) is not int or type(expected) is not int:
        raise TypeError("handle, limit and expected must be ints")
    if not 0 < handle < 2 ** 64:
        raise ValueError(f"handle must be a socket's address, got {handle}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not 0 <= expected < 2 ** 63:
        raise ValueError(f"expected must be in [0, 2**63), got {expected}")
    cdef void* sock = <void*><uintptr_t>PyLong_AsUnsignedLongLongMask(handle)
    if not rc_zmq_bind(sock):
        return None
    cdef Py_ssize_t want = limit if limit < 2 ** 62 else 2 ** 62
    cdef list payloads = []
    # unsigned: after 2**63 - 1 comes 2**63, which no sequence number equals (no overflow)
    cdef uint64_t next_seq = expected
    cdef int64_t seq = -1
    cdef Py_ssize_t malformed = 0, frames
    cdef int err = 0, more
    cdef rc_zmq_msg msg
    cdef object data = None
    cdef bint out_of_order = False, no_memory = False
    # No Python code runs in this loop (bytes and a list's growth run none), so the socket
    # stays open and ours throughout: nothing else can reach it without the GIL.
    while len(payloads) < want:
        err = rc_zmq_recv_frame(sock, &msg)
        if err:
            break
        more = rc_zmq_more(&msg)
        rc_zmq_close(&msg)  # the topic
        frames = 1
        seq = -1
        data = None
        while more:  # a message arrives whole: its other frames are there
            err = rc_zmq_recv_frame(sock, &msg)
            if err:
                break
            frames += 1
            more = rc_zmq_more(&msg)
            if frames == 2 and rc_zmq_size(&msg) == 8:
                seq = <int64_t>_be(<const unsigned char*>rc_zmq_data(&msg), 8)
            elif frames == 3:
                try:
                    data = PyBytes_FromStringAndSize(<char*>rc_zmq_data(&msg),
                                                     <Py_ssize_t>rc_zmq_size(&msg))
                except MemoryError:
                    no_memory = True  # raised once the message is read whole
            rc_zmq_close(&msg)
        if err:
            break
        if no_memory:
            raise MemoryError("no memory for a stream message's payload")
        if frames != 3 or seq < 0:
            malformed += 1
            continue
        if <uint64_t>seq != next_seq:
            out_of_order = True
            break
        payloads.append(data)
        next_seq += 1
    return (payloads, malformed, (seq, data) if out_of_order else None,
            0 if err == EAGAIN else err)


cdef bint _km_all_new(KeyMap keymap, const uint64_t* hs, Py_ssize_t m, uint64_t* seen,
                      Py_ssize_t mask) noexcept:
    # KeyMap.add_new's test: no hash held, none twice (``seen``: mask + 1 words).
    cdef Py_ssize_t k, j
    memset(seen, 0, (mask + 1) * sizeof(uint64_t))
    for k in range(m):
        if keymap.find(hs[k]) >= 0:
            return False
        j = <Py_ssize_t>(fmix64(hs[k]) & <uint64_t>mask)
        while seen[j]:
            if seen[j] == hs[k]:
                return False
            j = (j + 1) & mask
        seen[j] = hs[k]
    return True


def apply_wire(BlockIndex index not None, WireBatch batch not None, start, KeyMap keymap not None,
               copy, direct, block_size, seed, alone, ns):
    """Apply ``batch``'s events from ``start`` to one copy's holdings; see ``_blocks_py``."""
    if type(start) is not int or type(direct) is not int or type(block_size) is not int:
        raise TypeError("start, direct and block_size must be ints")
    if type(seed) is not int:
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if type(alone) is not bool or type(ns) is not bool:
        raise TypeError("alone and ns must be bools")
    cdef int32_t c = _bi_copy(copy)
    if not 0 <= start <= batch.n:
        raise ValueError(f"start must be in [0, {batch.n}], got {start}")
    if not 0 <= direct < 2 ** 62:
        raise ValueError(f"direct must be in [0, 2**62), got {direct}")
    if not 1 <= block_size < 2 ** 62:
        raise ValueError(f"block_size must be in [1, 2**62), got {block_size}")
    cdef uint64_t h0 = <uint64_t>(seed & 0xFFFFFFFFFFFFFFFF)
    cdef Py_ssize_t first = start, n = batch.n, ev, k, m, slot, mask = 1
    cdef Py_ssize_t d = direct, st
    cdef int64_t bs = block_size
    cdef bint lone = alone is True, namespaced = ns is True, identity, bail = False
    cdef Py_ssize_t stored = 0, duplicates = 0, removed = 0, unknown_removals = 0
    cdef Py_ssize_t unknown_parent = 0, wrong_block_size = 0, malformed = 0
    cdef uint64_t h
    cdef int64_t known
    cdef WEvent* e
    cdef const uint64_t* hs
    cdef const int64_t* hv
    cdef const unsigned char* hi
    # From here on no Python code runs: the batch, the index and the map are only ours.
    if d > 0 and keymap.n > 0:
        return (start, 0, 0, 0, 0, 0, 0, 0, d)  # held both ways: KvIndexer's own path
    while mask < 2 * batch.max_hsh:
        mask *= 2
    cdef int64_t* keys = <int64_t*>PyMem_Malloc((batch.max_hsh + 1) * sizeof(int64_t)
                                                + mask * sizeof(uint64_t))
    if keys == NULL:
        raise MemoryError()
    cdef uint64_t* seen = <uint64_t*>(keys + batch.max_hsh + 1)
    mask -= 1
    try:
        ev = first
        while ev < n:
            e = &batch.events[ev]
            m = e.n_hsh
            hs = batch.h64 + e.hsh
            hv = batch.hval + e.hsh
            hi = batch.hint + e.hsh
            if e.kind == _W_CLEARED:
                break
            if e.kind == _W_STORED:
                if e.block_size != bs:
                    wrong_block_size += 1
                elif e.n_tok % bs or e.n_tok // bs != m:
                    malformed += 1
                else:
                    if e.parent:
                        if e.extra and namespaced:
                            break  # the parent's namespace decides: KvIndexer's own path
                        slot = keymap.find(e.parent_h)
                        if slot >= 0:
                            h = <uint64_t>keymap.table[slot].key
                        elif d > 0 and e.parent_int and index.holds_key(e.parent_i, c):
                            h = <uint64_t>e.parent_i
                        elif not lone:
                            break  # another tier may hold the parent
                        else:
                            unknown_parent += 1
                            ev += 1
                            continue
                    else:
                        h = h0
                    if m == 0:
                        ev += 1
                        continue
                    identity = True
                    for k in range(m):
                        h = hash_page(h, <const unsigned char*>(batch.tokens + e.tok + k * bs),
                                      <Py_ssize_t>bs)
                        keys[k] = <int64_t>h
                        if identity and (not hi[k] or hv[k] != keys[k]):
                            identity = False
                    if identity and keymap.n == 0:
                        # every block published under its own key
                        index.reserve_for(keys, m)
                        st = 0
                        for k in range(m):
                            if index.holds_key(keys[k], c):
                                duplicates += 1
                            else:
                                index.hold_key(keys[k], c)
                                st += 1
                        stored += st
                        d += st
                    elif not identity and d == 0:
                        if _km_all_new(keymap, hs, m, seen, mask):
                            keymap.room(m)
                            index.reserve_for(keys, m)
                            for k in range(m):
                                if k + _BI_AHEAD < m:
                                    index.fetch(keys[k + _BI_AHEAD], _BI_STORE_LINES)
                                keymap.insert(hs[k], keys[k])
                                index.hold_key(keys[k], c)
                            stored += m
                        else:
                            for k in range(m):
                                if hi[k] and hv[k] == keys[k]:
                                    bail = True  # a block under its own key among others
                                    break
                            if bail:
                                break
                            keymap.room(m)
                            index.reserve_for(keys, m)
                            for k in range(m):  # one at a time: duplicates, moved hashes
                                slot = keymap.find(hs[k])
                                if slot >= 0:
                                    known = keymap.table[slot].key
                                    if known == keys[k]:
                                        duplicates += 1
                                        continue
                                    keymap.delete_slot(slot)
                                    index.drop_key(known, c)
                                keymap.insert(hs[k], keys[k])
                                index.hold_key(keys[k], c)
                                stored += 1
                            index.maybe_shrink()
                    else:
                        break  # both ways: KvIndexer's own path
            else:  # removed
                if keymap.n == 0 and d == 0:
                    unknown_removals += m  # the copy holds nothing
                elif keymap.n > 0:
                    for k in range(m):
                        slot = keymap.find(hs[k])
                        if slot < 0:
                            unknown_removals += 1
                        else:
                            known = keymap.table[slot].key
                            keymap.delete_slot(slot)
                            index.drop_key(known, c)
                            removed += 1
                    if keymap.n * 5 < keymap.cap and keymap.cap > 8:
                        try:
                            keymap.resize(keymap.n * 5 // 3 + 8 if keymap.n else 0)
                        except MemoryError:
                            pass  # stays larger
                    index.maybe_shrink()
                else:
                    st = 0
                    for k in range(m):
                        if hi[k] and index.drop_key(hv[k], c):
                            st += 1
                        else:
                            unknown_removals += 1
                    removed += st
                    d -= st
                    index.maybe_shrink()
            ev += 1
    finally:
        PyMem_Free(keys)
    return (ev, stored, duplicates, removed, unknown_removals, unknown_parent,
            wrong_block_size, malformed, d)

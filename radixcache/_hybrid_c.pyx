# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
# cython: cdivision=True, binding=True
"""Compiled hybrid core: the same interface as ``_hybrid_py`` (its docstring is the spec).

Built on the compiled tree core (``_core_c``, cimported: its tree, walk, splits, heap and
result glue): ``HybridCore`` holds a ``Core`` whose tree makes ``AuxNode`` objects, and does
each hybrid call whole in C. A subclass of ``Core`` would have to take ``Core``'s
constructor arguments (Cython calls a base's ``__cinit__`` with the subclass's), so the core
is held, not inherited; its attributes are forwarded.

The auxiliary LRU list is intrusive: borrowed ``newer``/``older`` pointers between nodes that
are in the tree (a node leaves the list before it leaves the tree, and ``reset`` drops the
list before the tree), so no pointer in it can dangle. The same discipline as the tree core's
holds (its docstring): every call holds the guard; the caller's tokens and slots are copied
into the call's own memory before anything allocates a tracked object (a split or a new node
may run a collection, so Python code); references let go are released after the guard; a bad
input raises before anything changes.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLong
from cpython.ref cimport PyObject
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint64_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

from ._core_c cimport (ChildSlot, Core, Node, TokenBuf, Tree, add_child, block_tensor,
                       floor_div64, make_index_array, new_empty_indices, release_buffer,
                       table_probe)

from ._errors import reentered
from ._types import InsertResult as _InsertResult
from ._types import MatchResult as _MatchResult

CORE_NAME = "c"

cdef int32_t _MAX_LOCK = 2147483647
#: ``relock``'s lock masks: the full-attention lock (the path) and the state lock (the node).
cdef int _FULL_LOCK = 1
cdef int _STATE_LOCK = 2


cdef extern from "rc_dlpack.h":
    object rc_int64_capsule(Py_ssize_t n, int64_t** data)


@cython.final
@cython.no_gc_clear  # as Node's: key_ptr and aux_ptr point into the owners
cdef class AuxNode(Node):
    """A node of a compiled hybrid tree."""

    def __cinit__(self):
        self.aux_ptr = NULL
        self.newer = NULL
        self.older = NULL

    @property
    def aux_value(self):
        if self.aux_owner is None or self.evicted:
            return None
        return block_tensor(self.aux_ptr, 1 if self.aux_one else self.key_len,
                            self.numpy_arrays)

    @property
    def aux_lock_ref(self):
        return self.aux_lock


cdef int gather(Gathered* out, const int64_t* src, Py_ssize_t n, Py_ssize_t step) except -1:
    """Append every ``step``-th of ``src[:n]`` from the first, floor-divided by ``step``
    (its page ids; ``step`` 1: the slots as they are)."""
    cdef Py_ssize_t count = (n + step - 1) // step, cap, i
    cdef int64_t* grown
    if out.len + count > out.cap:
        cap = max(2 * out.cap, out.len + count, 64)
        grown = <int64_t*>realloc(out.data, cap * sizeof(int64_t))
        if grown == NULL:
            raise MemoryError()
        out.data = grown
        out.cap = cap
    if step == 1:
        memcpy(out.data + out.len, src, n * sizeof(int64_t))
    else:
        for i in range(count):
            out.data[out.len + i] = floor_div64(src[i * step], step)
    out.len += count
    return 0


cdef inline Py_ssize_t aligned_up(Py_ssize_t n, Py_ssize_t page) noexcept:
    return (n + page - 1) // page * page


cdef class HybridCore:
    """HybridCore(page_size, policy, numpy_arrays=False, window=0, state=False)
--

    One hybrid cache: a tree core whose nodes hold one auxiliary component (see
    ``_hybrid_py``)."""

    def __cinit__(self, Py_ssize_t page_size, str policy, bint numpy_arrays=False,
                  window=0, bint state=False):
        if type(window) is not int or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        if (window > 0) == state:
            raise ValueError("a hybrid core has exactly one auxiliary component: give "
                             "window > 0 (sliding-window slots) or state=True (one state "
                             "per node)")
        self.core = Core(page_size, policy, False, 0, numpy_arrays)
        self.tree = self.core.tree
        self.tree.node_type = AuxNode
        self.tree.root = self.tree.make_root()  # an AuxNode too
        self.window = window
        self.state = state
        self.page_size = page_size
        self.numpy_arrays = numpy_arrays
        self.newest = NULL
        self.oldest = NULL
        self.last_recovered = []
        self.last_dup_pages = None

    # -- the core's attributes -------------------------------------------------------------------
    @property
    def heap(self):
        return self.core.heap

    @property
    def guard(self):
        return self.core.guard

    @property
    def core_name(self):
        return CORE_NAME

    @property
    def evictable(self):
        return self.core.evictable

    @property
    def protected(self):
        return self.core.protected

    @property
    def lookups(self):
        return self.core.lookups

    @property
    def matched_tokens(self):
        return self.core.matched_tokens

    @property
    def queried_tokens(self):
        return self.core.queried_tokens

    @property
    def inserts(self):
        return self.core.inserts

    @property
    def inserted_tokens(self):
        return self.core.inserted_tokens

    @property
    def evictions(self):
        return self.core.evictions

    @property
    def evicted_tokens(self):
        return self.core.evicted_tokens

    @property
    def host_tier(self):
        return False

    def enter(self, str what):
        self.core.guard.enter(what)

    def leave(self):
        self.core.guard.busy = 0

    def total_size(self):
        return (self.core.evictable + self.core.protected,
                self.aux_evictable + self.aux_protected)

    def reset_stats(self):
        self.core.reset_stats()

    def reset(self, bint held=False):
        if not held:
            self.core.guard.enter("reset")
        try:
            self.newest = NULL  # first: the list's nodes go with the tree
            self.oldest = NULL
            self.aux_evictable = 0
            self.aux_protected = 0
            self.last_walk = 0
            self.last_recovered = []
            self.aux_kept = False
            self.last_dup_pages = None
        finally:
            if not held:
                self.core.guard.busy = 0
        self.core.reset(held)

    def export_state(self):
        raise TypeError("a hybrid cache cannot be exported or copied")

    def import_state(self, state):
        raise TypeError("a hybrid cache cannot be exported or copied")

    def exists(self, tokens, extra_key=None, bint held=False):
        return self.core.exists(tokens, extra_key, held)

    def walk(self, tokens, extra_key=None):
        return self.core.walk(tokens, extra_key)

    def token_array(self, tokens):
        return self.core.token_array(tokens)

    def lock(self, node, int delta, bint held=False):
        return self.core.lock(node, delta, held)

    def pop_victim(self, bint held=False):
        return self.core.pop_victim(held)

    def take_new_leaf(self):
        return self.core.take_new_leaf()

    # -- the auxiliary LRU list --------------------------------------------------------------------
    cdef inline void unlink(self, AuxNode node) noexcept:
        if node.newer != NULL:
            (<AuxNode>node.newer).older = node.older
        else:
            self.newest = node.older
        if node.older != NULL:
            (<AuxNode>node.older).newer = node.newer
        else:
            self.oldest = node.newer
        node.newer = NULL
        node.older = NULL

    cdef inline void link_behind(self, AuxNode before, AuxNode node) noexcept:
        """Put ``node`` just behind ``before`` (less recent); None: the most recent."""
        cdef PyObject* older
        if before is None:
            node.newer = NULL
            node.older = self.newest
            if self.newest != NULL:
                (<AuxNode>self.newest).newer = <PyObject*>node
            else:
                self.oldest = <PyObject*>node
            self.newest = <PyObject*>node
            return
        older = before.older
        node.newer = <PyObject*>before
        node.older = older
        if older != NULL:
            (<AuxNode>older).newer = <PyObject*>node
        else:
            self.oldest = <PyObject*>node
        before.older = <PyObject*>node

    cdef inline Py_ssize_t aux_size(self, AuxNode node) noexcept:
        return 1 if self.state else node.key_len

    cdef inline void count_aux(self, AuxNode node, int sign) noexcept:
        if node.aux_lock:
            self.aux_protected += sign * self.aux_size(node)
        else:
            self.aux_evictable += sign * self.aux_size(node)

    cdef void give_aux(self, AuxNode node, object owner, const int64_t* ptr) noexcept:
        """``node`` (without auxiliary slots) takes them and enters the list, most recent."""
        node.aux_owner = owner
        node.aux_ptr = ptr
        node.aux_one = self.state
        self.link_behind(None, node)
        self.count_aux(node, 1)

    cdef object take_aux(self, AuxNode node, Gathered* into=NULL):
        """``node`` becomes a tombstone: its slots (a new index array; with ``into``, added
        there instead, None returned) leave it and the list. The old owner is released with
        the array (no finalizer: bytes)."""
        if into != NULL:
            gather(into, node.aux_ptr, self.aux_size(node), 1)
            aux = None
        else:
            aux = block_tensor(node.aux_ptr, self.aux_size(node), self.numpy_arrays)
        self.count_aux(node, -1)
        self.unlink(node)
        node.aux_owner = None
        node.aux_ptr = NULL
        return aux

    cdef void refresh(self, AuxNode node) noexcept:
        """A match or insert ended on ``node``: the window's nodes (or the state) move to
        the recent end, each ancestor behind its child."""
        cdef AuxNode before = None
        cdef Py_ssize_t covered = 0, span = self.window + self.page_size
        cdef Node root = self.tree.root
        if self.state:
            if node is not root and node.aux_owner is not None:
                self.unlink(node)
                self.link_behind(None, node)
            return
        while node is not root and covered < span:
            if node.aux_owner is not None:
                self.unlink(node)
                self.link_behind(before, node)
                before = node
            covered += node.key_len
            node = <AuxNode>node.parent_ptr

    cdef AuxNode split(self, AuxNode child, Py_ssize_t at):
        """The tree's split, then the auxiliary part: window slots in halves (one buffer at
        two offsets), the lock count copied, the mark to the upper half (the older edge);
        a state stays on the lower half."""
        cdef AuxNode upper = <AuxNode>self.tree.split(child, at)
        if self.state:
            return upper
        upper.aux_lock = child.aux_lock
        upper.mark = child.mark
        child.mark = 0
        if child.aux_owner is not None:
            upper.aux_owner = child.aux_owner
            upper.aux_ptr = child.aux_ptr
            child.aux_ptr = child.aux_ptr + at
            self.link_behind(child, upper)
        return upper

    cdef inline AuxNode next_unlocked(self, PyObject* start) noexcept:
        """From ``start`` toward the recent end, the first node whose auxiliary lock is 0."""
        cdef PyObject* cur = start
        while cur != NULL and (<AuxNode>cur).aux_lock:
            cur = (<AuxNode>cur).newer
        return None if cur == NULL else <AuxNode>cur

    # -- match --------------------------------------------------------------------------------------
    cdef Py_ssize_t accepted(self, Py_ssize_t depth) noexcept:
        """The path position (in core.path) of the deepest node the component accepts."""
        cdef Py_ssize_t i, best = -1, run = -1
        cdef AuxNode node
        for i in range(depth):
            node = <AuxNode>self.core.path[i]
            if self.state:
                if node.aux_owner is not None:
                    best = i
                continue
            if node.aux_owner is None:
                run = 0
                continue
            if run < 0:
                best = i
                continue
            run += node.key_len
            if run >= self.window:
                best = i
        return best

    def match(self, tokens, extra_key=None, bint held=False):
        cdef TokenBuf b
        cdef int64_t ns, now
        cdef Py_ssize_t end, pos = 0, common, depth = 0, best, i, length = 0
        cdef Node node, child
        cdef Core core = self.core
        cdef bint split_here = False
        b.held = False
        if not held:
            core.guard.enter("match_prefix")
        try:
            ns = core.read_query(tokens, &b, extra_key)
            if ns == -2:
                self.reject_tokens(tokens, extra_key)
            end = b.len - b.len % self.page_size
            core.lookups += 1
            core.queried_tokens += end
            node = self.tree.root
            while ns >= 0 and pos < end:
                child = self.tree.find_match(node, b.ptr + pos, end - pos, ns, &common)
                if child is None:
                    break
                if common < child.key_len:
                    release_buffer(&b)
                    child = self.split(<AuxNode>child, common)  # allocates: tokens are done
                    split_here = True
                    pos = end
                else:
                    pos += common
                core.note_path(depth, child)
                depth += 1
                node = child
            release_buffer(&b)
            length = 0
            for i in range(depth):
                length += (<Node>core.path[i]).key_len
            self.last_walk = length
            best = self.accepted(depth)
            if end:
                self.tree.clock += 1
                now = self.tree.clock
                self.tree.root.last_access_time = now
                for i in range(best + 1):
                    (<Node>core.path[i]).last_access_time = now
                if split_here:  # the split's upper half is new: it gets the tick too
                    (<Node>core.path[depth - 1]).last_access_time = now
            if best < 0:
                return core.match_result(new_empty_indices(self.numpy_arrays), self.tree.root, 0)
            node = <Node>core.path[best]
            self.refresh(<AuxNode>node)
            length = 0
            for i in range(best + 1):
                length += (<Node>core.path[i]).key_len
            core.matched_tokens += length
            if core.push_on_access:
                dropped = core.push_if_evictable(node)
            return core.match_result(core.path_indices(best + 1, length), node, length)
        finally:
            release_buffer(&b)
            if not held:
                core.guard.busy = 0

    cdef int reject_tokens(self, object tokens, object extra_key) except -1:
        """Raise for what the tree core declined to read."""
        try:
            hash(extra_key)
        except TypeError:
            raise TypeError(f"extra_key must be hashable, got {type(extra_key).__name__}")
        raise TypeError(f"token_ids must be a list, tuple, int64 array or tensor of ints, got "
                        f"{type(tokens).__name__}")

    # -- insert ---------------------------------------------------------------------------------
    cdef int64_t position(self, object value, str what) except -1:
        if type(value) is not int or value < 0 or value > INT64_MAX:
            raise TypeError(f"{what} must be an int in [0, 2^63), got {value!r}")
        return <int64_t>value

    def insert(self, tokens, kv=None, aux=None, extra_key=None, priority=0, hits_from=0,
               live_from=0, dup_from=0, bint held=False, dup_pages=False):
        cdef TokenBuf b, v, a
        cdef int64_t prio, hits_after, live, dup, ns
        cdef Py_ssize_t end, need
        cdef Core core = self.core
        b.held = False
        v.held = False
        a.held = False
        if type(priority) is not int:
            raise TypeError(f"priority must be an int in int64, got {priority!r}")
        try:
            prio = PyLong_AsLongLong(priority)
        except OverflowError:
            raise TypeError(f"priority must be an int in int64, got {priority!r}") from None
        hits_after = self.position(hits_from, "hits_from")
        live = self.position(live_from, "live_from")
        if live % self.page_size:
            raise ValueError(f"live_from must be page aligned, got {live}")
        dup = self.position(dup_from, "dup_from")
        if type(dup_pages) is not bool:
            raise TypeError(f"dup_pages must be a bool, got {type(dup_pages).__name__}")
        if not held:
            core.guard.enter("insert")
        self.last_dup_pages = None
        try:
            # Every input into the call's own memory first (the walk allocates).
            if not core.acquire(tokens, &b, False, True):
                self.reject_tokens(tokens, extra_key)
            end = b.len - b.len % self.page_size
            if not core.acquire(kv, &v, True, True) or v.len < end:
                raise TypeError(f"kv must be a 1-D int64 array (list, tuple, numpy array, "
                                f"array('q') or CPU tensor) of at least {end} entries")
            need = 1 if self.state else end
            if not core.acquire(aux, &a, False, False) or a.len < need:
                what = "the state slot" if self.state else "the window slots"
                raise TypeError(f"aux ({what}) must be a 1-D int64 array of at least "
                                f"{need} entries")
            if self.state and a.len != 1:
                raise ValueError(f"a state component takes one aux slot, got {a.len}")
            # (aux shares the tokens' scratch kind: read into bytes before the tokens are.)
            aux_block = PyBytes_FromStringAndSize(<const char*>a.ptr, need * sizeof(int64_t))
            release_buffer(&a)
            if not core.acquire(tokens, &b, False, True):
                self.reject_tokens(tokens, extra_key)
            if extra_key is None:
                ns = 0
            else:
                try:
                    ns = self.tree.find_namespace(extra_key)
                except TypeError:
                    raise TypeError(f"extra_key must be hashable, got "
                                    f"{type(extra_key).__name__}") from None
                if ns < 0 and end:
                    ns = self.tree.make_namespace(extra_key)
            result = self.insert_walk(&b, &v, end, aux_block, ns, extra_key, prio, hits_after,
                                      live, dup, b.len == end)
            if dup_pages:  # (v is the call's own copy: the walk cannot have changed it)
                self.last_dup_pages = self.page_ids_of(v.ptr, dup, result.prefix_len)
            return result
        finally:
            release_buffer(&b)
            release_buffer(&v)
            release_buffer(&a)
            if not held:
                core.guard.busy = 0

    cdef object page_ids_of(self, const int64_t* slots, Py_ssize_t start, Py_ssize_t stop):
        """The page ids of ``slots[start:stop]`` (none when ``start >= stop``): a new index
        array."""
        cdef Gathered ids
        ids.data = NULL
        ids.len = ids.cap = 0
        try:
            if start < stop:
                gather(&ids, slots + start, stop - start, self.page_size)
            return block_tensor(ids.data, ids.len, self.numpy_arrays)
        finally:
            free(ids.data)

    cdef object insert_walk(self, TokenBuf* b, TokenBuf* v, Py_ssize_t end, bytes aux_block,
                            int64_t ns, object extra_key, int64_t prio, int64_t hits_after,
                            int64_t live_from, int64_t dup_from, bint whole):
        """The insert on the call's own copies (see ``_hybrid_py``)."""
        cdef Core core = self.core
        cdef Tree tree = self.tree
        cdef Node node = tree.root
        cdef AuxNode child, leaf = None, upper
        cdef Py_ssize_t pos = 0, common, start, stop, live, tail
        cdef int64_t now
        cdef uint64_t h
        cdef bint split_here
        cdef const int64_t* aux = <const int64_t*>PyBytes_AS_STRING(aux_block)
        recovered = []
        self.last_recovered = recovered
        self.aux_kept = False
        core.inserts += 1
        if end == 0:
            if whole:
                tree.empty_inserted.add(extra_key)
            return core.insert_result(0, node)
        tree.clock += 1
        now = tree.clock
        node.last_access_time = now
        while pos < end:
            child = <AuxNode>tree.find_match(node, b.ptr + pos, end - pos, ns, &common)
            if child is None:
                break
            split_here = common < child.key_len
            if split_here:
                child = self.split(child, common)
            child.last_access_time = now
            if prio > child.priority:
                child.priority = prio
            start = pos
            stop = pos + common
            if not self.state and child.aux_owner is None and dup_from < stop:
                live = start if start > live_from else live_from
                if live < stop:
                    if live > start:
                        self.split(child, live - start)  # child: the lower half
                    recovered.append(self.recover(child, live, stop, v.ptr, aux))
            if stop > hits_after:
                child.hit_count += 1
            pos = stop
            node = child
            if split_here:
                break
        prefix_len = pos
        if pos < end:
            leaf = self.new_leaf(node, b, v, pos, end, ns, extra_key, now, prio)
            if self.state:
                self.give_aux(leaf, aux_block, aux)
            else:
                live = pos if pos > live_from else live_from
                if live < end:
                    if live > pos:
                        self.split(leaf, live - pos)  # the upper half: a tombstone
                    # A lock of the leaf pins its window slots: keep the live part that long.
                    tail = aligned_up(self.window, self.page_size)
                    if end - live > tail:
                        upper = self.split(leaf, end - live - tail)
                        self.give_slice(upper, aux, live, end - tail)
                        self.give_slice(leaf, aux, end - tail, end)
                    else:
                        self.give_slice(leaf, aux, live, end)
            if end > hits_after:
                leaf.hit_count += 1
            node = leaf
        elif self.state and node is not tree.root:
            child = <AuxNode>node
            if child.aux_owner is None:
                self.give_aux(child, aux_block, aux)
            else:
                self.unlink(child)
                self.link_behind(None, child)
                self.aux_kept = True
        if whole:
            node.is_terminal = True
        if not self.state and node is not tree.root:
            self.refresh(<AuxNode>node)
        core.new_leaf = leaf
        if leaf is not None:
            dropped = core.heap.push_entry(leaf)
        elif core.push_on_access:
            dropped = core.push_if_evictable(node)
        return core.insert_result(prefix_len, node)

    cdef int give_slice(self, AuxNode node, const int64_t* aux, Py_ssize_t start,
                        Py_ssize_t stop) except -1:
        """``node`` takes the window slots aux[start:stop] (a copy of its own)."""
        owner = PyBytes_FromStringAndSize(<const char*>(aux + start),
                                          (stop - start) * sizeof(int64_t))
        self.give_aux(node, owner, <const int64_t*>PyBytes_AS_STRING(owner))
        return 0

    cdef tuple recover(self, AuxNode node, Py_ssize_t start, Py_ssize_t stop,
                       const int64_t* values, const int64_t* aux):
        """A walked window tombstone [start, stop) takes the caller's window slots:
        unlocked, its full slots too; its record (see ``_hybrid_py``)."""
        cdef bint locked = node.lock_ref > 0
        record = (start, stop, self.values_of(node), locked)
        if not locked:
            owner = PyBytes_FromStringAndSize(<const char*>(values + start),
                                              (stop - start) * sizeof(int64_t))
            node.value_owner = owner  # the old bytes go (no finalizer)
            node.value_ptr = <const int64_t*>PyBytes_AS_STRING(owner)
            node.value_off = 0
        self.give_slice(node, aux, start, stop)
        return record

    cdef inline object values_of(self, Node node):
        return block_tensor(node.value_ptr if node.value_ptr != NULL else node.key_ptr,
                            node.key_len, self.numpy_arrays)

    cdef AuxNode new_leaf(self, Node parent, TokenBuf* b, TokenBuf* v, Py_ssize_t pos,
                          Py_ssize_t end, int64_t ns, object extra_key, int64_t now,
                          int64_t prio):
        """The new leaf holding tokens[pos:end] and their full slots (one block: the key,
        then the values), attached under ``parent``."""
        cdef Core core = self.core
        cdef Tree tree = self.tree
        cdef Py_ssize_t n = end - pos
        cdef uint64_t h
        cdef char* out
        block = PyBytes_FromStringAndSize(NULL, 2 * n * sizeof(int64_t))
        out = PyBytes_AS_STRING(block)
        memcpy(out, b.ptr + pos, n * sizeof(int64_t))
        memcpy(out + n * sizeof(int64_t), v.ptr + pos, n * sizeof(int64_t))
        cdef AuxNode leaf = <AuxNode>tree.new_node(parent, now)  # allocates: copies are done
        leaf.key_owner = block
        leaf.key_ptr = <const int64_t*>PyBytes_AS_STRING(block)
        leaf.key_len = n
        leaf.value_owner = block
        leaf.value_ptr = leaf.key_ptr + n
        leaf.priority = prio
        leaf.ns = ns
        leaf.extra_key = extra_key
        h = tree.page_hash(leaf.key_ptr, ns)
        add_child(parent, leaf, h)
        tree.node_count += 1
        if parent is tree.root and ns:
            tree.ns_roots[ns] = tree.ns_roots.get(ns, 0) + 1
        core.evictable += n
        core.inserted_tokens += n
        return leaf

    def path_indices(self, node, start=0):
        """The full-attention slots of root..``node`` from token ``start`` on (a new array)."""
        cdef Core core = self.core
        cdef Node cur
        cdef Py_ssize_t depth = 0, total = 0, i, skip, first, n
        cdef int64_t* out
        if type(start) is not int or start < 0:
            raise TypeError(f"start must be an int >= 0, got {start!r}")
        core.guard.enter("path_indices")
        try:
            self.tree._check_member(node)
            cur = <Node>node
            while cur is not self.tree.root:  # bottom-up into core.path (no allocation)
                core.note_path(depth, cur)
                depth += 1
                total += cur.key_len
                cur = <Node>cur.parent_ptr
            skip = start if start < total else total
            capsule = rc_int64_capsule(total - skip, &out)
            first = 0
            for i in range(depth - 1, -1, -1):
                cur = <Node>core.path[i]
                n = cur.key_len
                if first + n > skip:
                    if first >= skip:
                        memcpy(out + first - skip,
                               cur.value_ptr if cur.value_ptr != NULL else cur.key_ptr,
                               n * sizeof(int64_t))
                    else:
                        memcpy(out, (cur.value_ptr if cur.value_ptr != NULL else cur.key_ptr)
                               + (skip - first), (first + n - skip) * sizeof(int64_t))
                first += n
            return make_index_array(capsule, self.numpy_arrays)
        finally:
            core.guard.busy = 0

    # -- locks ----------------------------------------------------------------------------------
    def aux_lock(self, node, int delta, mark=0, bint held=False):
        cdef Core core = self.core
        cdef AuxNode n, top
        if delta != 1 and delta != -1:
            raise ValueError(f"delta must be 1 or -1, got {delta!r}")
        if type(mark) is not int or mark < 0 or mark > INT64_MAX:
            raise TypeError(f"mark must be an int >= 0, got {mark!r}")
        if not held:
            core.guard.enter("inc_lock_ref" if delta > 0 else "dec_lock_ref")
        try:
            self.tree._check_member(node)
            if node is self.tree.root:
                return 0
            n = <AuxNode>node
            if self.state:
                if delta < 0 and n.aux_lock <= 0:
                    raise ValueError(f"aux_lock: node {n.id} holds no auxiliary lock")
                if delta > 0 and n.aux_lock >= _MAX_LOCK:
                    raise OverflowError(f"aux_lock: node {n.id} holds the most locks")
                self.move_lock(n, delta)
                return 0
            if delta > 0:
                return self.lock_window(n)
            top = self.window_top(n, <int64_t>mark)
            self.unlock_window(n, top, False)
            return 0
        finally:
            if not held:
                core.guard.busy = 0

    def relock(self, old, new, release=3, acquire=3, start=0, stop=0, bint held=False):
        """The lock move of ``_hybrid_py``: ``old``'s locks given back, ``new``'s taken, and
        ``new``'s path slots [start, stop) (a new array; None when empty)."""
        cdef Core core = self.core
        cdef Tree tree = self.tree
        cdef Node root = tree.root
        cdef Node cur, top = None
        cdef AuxNode o = None, n = None
        cdef Py_ssize_t total = 0, first = 0, own, i, begin, end, depth = 0, k, lo, hi
        cdef int64_t held_top
        cdef int64_t* out
        cdef const int64_t* src
        cdef int give, take
        if type(release) is not int or type(acquire) is not int:
            raise TypeError(f"release and acquire must be ints, got {release!r}, {acquire!r}")
        if not (0 <= release <= 3 and 0 <= acquire <= 3):
            raise ValueError(f"release and acquire must be lock masks in 0..3, got "
                             f"{release!r}, {acquire!r}")
        if type(start) is not int or type(stop) is not int:
            raise TypeError(f"start and stop must be ints, got {start!r}, {stop!r}")
        if not 0 <= start <= stop <= INT64_MAX:
            raise ValueError(f"start and stop must be ints with 0 <= start <= stop, got "
                             f"{start!r}, {stop!r}")
        begin = start
        end = stop
        give = release
        take = acquire
        if not held:
            core.guard.enter("relock")
        try:
            if (give | take) & _STATE_LOCK and not self.state:
                raise TypeError("relock moves a state lock; a window lock moves with aux_lock")
            if old is None or old is root:
                give = 0
            else:
                tree._check_member(old)
                o = <AuxNode>old
            if new is None or new is root:
                take = 0
                cur = root
            else:
                tree._check_member(new)
                n = <AuxNode>new
                cur = n
            # Every check before any change (as the four lock calls would raise, in order).
            if give & _STATE_LOCK and o.aux_lock <= 0:
                raise ValueError(f"aux_lock: node {o.id} holds no auxiliary lock")
            if give & _FULL_LOCK:
                tree.check_own_lock(o)
            while cur is not root:
                total += cur.key_len
                top = cur
                cur = <Node>cur.parent_ptr
            if end > total:
                raise ValueError(f"relock: stop={end} is past the node's {total} tokens")
            if take & _FULL_LOCK:
                held_top = top.lock_ref
                if give & _FULL_LOCK:
                    cur = o
                    while cur.parent_ptr != <PyObject*>root:
                        cur = <Node>cur.parent_ptr
                    if cur is top:
                        held_top -= 1  # the give comes first
                if held_top >= _MAX_LOCK:
                    raise OverflowError(f"inc_lock_ref on node {n.id}: node {top.id} already "
                                        f"has lock_ref {_MAX_LOCK}, the most a node can hold")
            k = 1 if o is n and give & _STATE_LOCK else 0
            if take & _STATE_LOCK and n.aux_lock - k >= _MAX_LOCK:
                raise OverflowError(f"aux_lock: node {n.id} holds the most locks")
            # The result's memory and the path before any change (allocating may run Python
            # code or fail; the guard keeps every node on the path in the tree until the copy).
            capsule = rc_int64_capsule(end - begin, &out) if end > begin else None
            if capsule is not None:
                cur = n
                while cur is not root:
                    core.note_path(depth, cur)
                    depth += 1
                    cur = <Node>cur.parent_ptr
            dropped = None
            if give & _STATE_LOCK:
                self.move_lock(o, -1)
            if give & _FULL_LOCK:
                own = tree.lock_path(o, -1)
                if own:
                    core.evictable += own
                    core.protected -= own
                    dropped = core.push_if_evictable(o)
            if take & _FULL_LOCK:
                own = tree.lock_path(n, 1)
                core.evictable -= own
                core.protected += own
            if take & _STATE_LOCK:
                self.move_lock(n, 1)
            if capsule is None:
                return None
            # [begin, end) copied from the path noted above, top-down.
            for i in range(depth - 1, -1, -1):
                cur = <Node>core.path[i]
                k = cur.key_len
                if first + k > begin and first < end:
                    src = cur.value_ptr if cur.value_ptr != NULL else cur.key_ptr
                    lo = begin if begin > first else first
                    hi = end if end < first + k else first + k
                    memcpy(out + (lo - begin), src + (lo - first), (hi - lo) * sizeof(int64_t))
                first += k
            return make_index_array(capsule, self.numpy_arrays)
        finally:
            if not held:
                core.guard.busy = 0

    cdef void move_lock(self, AuxNode node, int delta) noexcept:
        cdef Py_ssize_t size
        if node.aux_owner is not None and (node.aux_lock == 0) != (node.aux_lock + delta == 0):
            size = self.aux_size(node)
            self.aux_evictable -= delta * size
            self.aux_protected += delta * size
        node.aux_lock += delta

    cdef int64_t lock_window(self, AuxNode node) except -1:
        cdef Node root = self.tree.root
        cdef AuxNode cur = node, boundary = None
        cdef Py_ssize_t covered = 0
        while cur is not root and covered < self.window:  # checked before any change
            if cur.aux_lock >= _MAX_LOCK:
                raise OverflowError(f"aux_lock: node {cur.id} holds the most locks")
            covered += cur.key_len
            boundary = cur
            cur = <AuxNode>cur.parent_ptr
        cur = node
        while True:
            self.move_lock(cur, 1)
            if cur is boundary:
                break
            cur = <AuxNode>cur.parent_ptr
        if covered < self.window:
            return 0
        if not boundary.mark:
            self.marks += 1
            boundary.mark = self.marks
        return boundary.mark

    cdef AuxNode window_top(self, AuxNode node, int64_t mark):
        """The last node a window lock with ``mark`` holds from ``node`` (checked: each node
        up to it holds a lock; the node with the mark, or the root's child for 0)."""
        cdef Node root = self.tree.root
        cdef AuxNode cur = node, top = node
        while cur is not root:
            if cur.aux_lock <= 0:
                raise ValueError(f"aux_lock: node {cur.id} holds no auxiliary lock")
            top = cur
            if mark and cur.mark == mark:
                return top
            cur = <AuxNode>cur.parent_ptr
        if mark:
            raise ValueError(f"aux_lock: mark {mark} is not on node {node.id}'s path")
        return top

    cdef list unlock_window(self, AuxNode node, AuxNode top, bint early):
        """Each node from ``node`` up to ``top`` gives one window lock back; with ``early``,
        one left unlocked that is an evictable leaf becomes a tombstone (its records)."""
        cdef Core core = self.core
        cdef AuxNode cur = node
        records = []
        garbage = []
        while True:
            self.move_lock(cur, -1)
            if not cur.aux_lock:
                if early and cur.aux_owner is not None and self.is_leaf(cur):
                    records.append((self.values_of(cur), self.take_aux(cur), False))
                garbage.append(core.push_if_evictable(cur))
            if cur is top:
                break
            cur = <AuxNode>cur.parent_ptr
        return records

    def aux_release(self, node, mark, bint held=False):
        cdef Core core = self.core
        cdef AuxNode n
        if type(mark) is not int or mark < 0 or mark > INT64_MAX:
            raise TypeError(f"mark must be an int >= 0, got {mark!r}")
        if not held:
            core.guard.enter("release_swa")
        try:
            self.tree._check_member(node)
            if self.state:
                raise TypeError("aux_release releases a window lock; a state component has "
                                "none")
            if node is self.tree.root:
                return []
            n = <AuxNode>node
            return self.unlock_window(n, self.window_top(n, <int64_t>mark), True)
        finally:
            if not held:
                core.guard.busy = 0

    cdef inline bint is_leaf(self, AuxNode node) noexcept:
        """An evictable leaf: attached, childless, unlocked in both components."""
        return not (node.evicted or node.n_children or node.lock_ref or node.aux_lock
                    or node is self.tree.root)

    # -- eviction -------------------------------------------------------------------------------
    cdef tuple leave_tree(self, AuxNode node, list records, list garbage,
                          Gathered* pages=NULL, Gathered* auxes=NULL):
        """An evictable leaf leaves the tree; its record to ``records`` (with ``pages``: its
        page ids to ``pages``, its auxiliary slots to ``auxes``). (full, aux) freed."""
        cdef Core core = self.core
        cdef Py_ssize_t size = node.key_len, aux_size = 0
        cdef Node parent
        aux = None
        if pages != NULL:  # (first: the node is as it was should the gathering fail)
            gather(pages, node.value_ptr if node.value_ptr != NULL else node.key_ptr,
                   node.key_len, self.page_size)
        if node.aux_owner is not None:
            aux_size = self.aux_size(node)
            aux = self.take_aux(node, auxes)  # out of the list before it leaves the tree
        if pages == NULL:
            records.append((self.values_of(node), aux, True))
        parent = self.tree.detach_leaf(node, garbage)
        core.evictable -= size
        core.evictions += 1
        core.evicted_tokens += size
        garbage.append(core.push_if_evictable(parent))
        return size, aux_size

    def evict(self, num_tokens=0, aux_tokens=0, bint held=False, page_ids=False):
        cdef Core core = self.core
        cdef int64_t want, aux_want, freed = 0, aux_freed = 0
        cdef AuxNode victim, cursor = None
        cdef Gathered pages, auxes
        cdef Gathered* into_pages = NULL
        cdef Gathered* into_auxes = NULL
        if type(num_tokens) is not int:
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if type(aux_tokens) is not int:
            raise TypeError(f"aux_tokens must be an int, got {type(aux_tokens).__name__}")
        if type(page_ids) is not bool:
            raise TypeError(f"page_ids must be a bool, got {type(page_ids).__name__}")
        want = num_tokens if num_tokens < INT64_MAX else INT64_MAX
        aux_want = aux_tokens if aux_tokens < INT64_MAX else INT64_MAX
        pages.data = auxes.data = NULL
        pages.len = pages.cap = auxes.len = auxes.cap = 0
        if page_ids:
            into_pages, into_auxes = &pages, &auxes
        records = []
        garbage = []  # stale entries and dropped values: released after the guard
        if not held:
            core.guard.enter("evict")
        try:
            while freed < want:
                found = core.heap.pop_entry(garbage)
                if found is None:
                    break
                victim = <AuxNode>found
                if victim.aux_lock:
                    continue  # pushed again when its window lock goes
                size, aux_size = self.leave_tree(victim, records, garbage, into_pages,
                                                 into_auxes)
                freed += size
                aux_freed += aux_size
            if aux_freed < aux_want:
                cursor = self.next_unlocked(self.oldest)
            while aux_freed < aux_want and cursor is not None:
                if cursor.aux_owner is None:  # left the list meanwhile: from the end again
                    cursor = self.next_unlocked(self.oldest)
                    continue
                victim = cursor
                cursor = self.next_unlocked(victim.newer)
                if self.is_leaf(victim):
                    size, aux_size = self.leave_tree(victim, records, garbage, into_pages,
                                                     into_auxes)
                    freed += size
                    aux_freed += aux_size
                elif page_ids:
                    aux_freed += self.aux_size(victim)
                    self.take_aux(victim, into_auxes)
                else:
                    aux_freed += self.aux_size(victim)
                    records.append((self.values_of(victim), self.take_aux(victim), False))
            if page_ids:
                return (freed, aux_freed, block_tensor(pages.data, pages.len, self.numpy_arrays),
                        block_tensor(auxes.data, auxes.len, self.numpy_arrays))
            return freed, aux_freed, records
        finally:
            free(pages.data)
            free(auxes.data)
            if not held:
                core.guard.busy = 0
            del garbage[:]

    def remove_leaf(self, node, bint held=False):
        cdef Core core = self.core
        garbage = []
        if not held:
            core.guard.enter("evict")
        try:
            if not isinstance(node, AuxNode) or (<AuxNode>node).evicted:
                raise ValueError("remove_leaf needs an attached leaf of this cache")
            self.tree._check_member(node)
            if (<AuxNode>node).n_children:
                raise ValueError(f"node {(<AuxNode>node).id} is not an attached leaf")
            size, _ = self.leave_tree(<AuxNode>node, [], garbage)
            return size
        finally:
            if not held:
                core.guard.busy = 0
            del garbage[:]

    # -- for tests -------------------------------------------------------------------------------
    def aux_order(self):
        """The nodes with auxiliary slots, least recent first."""
        cdef PyObject* cur
        self.core.guard.enter("aux_order")
        try:
            out = []
            cur = self.oldest
            while cur != NULL:
                out.append(<AuxNode>cur)
                cur = (<AuxNode>cur).newer
            return out
        finally:
            self.core.guard.busy = 0

    def check_aux(self):
        """Raise AssertionError naming what is inconsistent (see ``_hybrid_py``)."""
        cdef PyObject* cur = self.oldest
        cdef AuxNode n
        cdef PyObject* before = NULL
        seen = set()
        while cur != NULL:
            n = <AuxNode>cur
            assert n.newer == NULL or (<AuxNode>n.newer).older == cur, (
                f"auxiliary list broken at node {n.id}")
            assert n.older == before, f"auxiliary list broken at node {n.id}"
            assert id(n) not in seen, f"node {n.id} twice in the auxiliary list"
            seen.add(id(n))
            before = cur
            cur = n.newer
        assert before == self.newest, "the auxiliary list's recent end is wrong"
        evictable = protected = with_aux = 0
        for node, _ in self.tree.iter_nodes():
            if node is self.tree.root:
                continue
            n = <AuxNode>node
            assert n.aux_lock >= 0, f"node {n.id} has aux_lock_ref {n.aux_lock}"
            has = n.aux_owner is not None
            assert has == (id(n) in seen), (
                f"node {n.id}: auxiliary slots {has}, in the list {id(n) in seen}")
            if has:
                with_aux += 1
                if n.aux_lock:
                    protected += self.aux_size(n)
                else:
                    evictable += self.aux_size(n)
        assert with_aux == len(seen), "the auxiliary list holds nodes not in the tree"
        assert (self.aux_evictable, self.aux_protected) == (evictable, protected), (
            f"aux sizes {(self.aux_evictable, self.aux_protected)} != "
            f"{(evictable, protected)}")


# -- garbage collector support: an AuxNode is traversed as a Node (children included) -----------
cdef extern from "Python.h":
    ctypedef int (*visitproc)(PyObject*, void*) noexcept
    ctypedef int (*traverseproc)(PyObject*, visitproc, void*) noexcept
    ctypedef struct TypeSlots "PyTypeObject":
        traverseproc tp_traverse


cdef int aux_node_traverse(PyObject* o, visitproc visit, void* arg) noexcept:
    # Node's traverse (the tree core's, children included), then the slots' owner.
    cdef int r = (<TypeSlots*><void*>Node).tp_traverse(o, visit, arg)
    cdef object owner
    if r:
        return r
    owner = (<AuxNode>o).aux_owner
    if owner is not None:
        return visit(<PyObject*>owner, arg)
    return 0


(<TypeSlots*><void*>AuxNode).tp_traverse = aux_node_traverse

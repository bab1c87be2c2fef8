# cython: language_level=3
"""Declarations of the compiled tree core (implemented in _core_c.pyx)."""

from cpython.buffer cimport Py_buffer
cimport cython
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef struct ChildSlot:
    # 24 bytes: 1.5x the slot of a table without mirrors, at a higher load (see slot_limit).
    PyObject* node     # owned reference; NULL marks an empty slot
    # Mirrors of the child's own fields (kept equal by mirror()), so that a walk finds
    # the next step's slot without waiting for the child object to arrive from memory.
    ChildSlot* table   # the child's child table (its ``slots``), NULL when it has none
    uint32_t hash      # low half of the hash of (namespace id, first page): probed by it
    uint32_t shape     # the child's key length (low 27 bits; _LONG_KEY: read the node's)
                       # and log2 of its table's capacity (high 5 bits)


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
    # Laid out for the walk: what a step reads of the node (the key, the child table) sits
    # in its first cache line, right after its header; the parent's slot mirrors the child
    # table and key length, so the next step need not wait for this object.
    # Only what a one-tier tree uses (160 bytes, 176 with the collector's header): a tier
    # or component that needs more per node has its own subclass (HostNode), made only by
    # the trees that use it.
    # Open-addressing hash table of children (linear probing, power-of-two capacity).
    cdef ChildSlot* slots
    cdef int32_t slot_mask
    cdef int32_t n_children
    # Tokens live in key_owner (a bytes object); split halves share it at different offsets.
    cdef const int64_t* key_ptr
    cdef Py_ssize_t key_len
    # Namespace id: a probe compares it (the slot's 32-bit hash cannot tell namespaces apart).
    cdef int64_t ns
    cdef readonly int64_t last_access_time
    cdef object key_owner
    # Index values: an int64 buffer (bytes, CPU values, shared across splits like keys) that
    # value_ptr points into; a device tensor (value_ptr NULL) whose elements
    # [value_off, value_off + key_len) are this node's (split halves share it, so a split
    # never calls torch); or None: the key is the values.
    cdef object value_owner
    cdef const int64_t* value_ptr
    cdef Py_ssize_t value_off
    # Borrowed: an attached child never outlives its parent's reference to it.
    cdef PyObject* parent_ptr
    # This node's hash in its parent's table (of its namespace and first page, the low half
    # as the slot holds it): its slot there is found without reading the key.
    cdef uint32_t slot_hash
    # 32 bits, beside slot_hash (one word): lock_path refuses a lock beyond INT32_MAX.
    cdef readonly int32_t lock_ref
    # One word: evicted, and two bytes (``terminal`` is their public name for is_terminal);
    # numpy_arrays: its tree's array kind (numpy arrays, else tensors), what value makes.
    cdef readonly bint evicted
    cdef uint8_t is_terminal
    cdef uint8_t numpy_arrays
    cdef readonly int64_t created_time
    cdef readonly int64_t priority
    cdef readonly int64_t hit_count
    cdef readonly int64_t id
    cdef readonly object extra_key


cdef class HostNode(Node):
    # A node of a tree with a host tier (16 bytes more; a one-tier tree never makes one).
    # Read with lock_ref by the heaps' validity checks: how many children are only on the
    # host (a node on the device whose children all are, n_children == n_host_kids, is a
    # device leaf); only on the host (no device value, still in the tree); in its core's
    # write-through queue.
    cdef int32_t n_host_kids
    cdef uint8_t host_only
    cdef uint8_t queued
    # The host indices as int64 bytes of exactly key_len entries (a split copies them into
    # its two halves); None when the node has no host copy.
    cdef object host_owner


# A node's child table (functions, not methods: a Node carries no vtable pointer).
cdef int add_child(Node node, Node child, uint64_t h) except -1
cdef Py_ssize_t slot_of(Node node, Node child, uint64_t h) noexcept
cdef void remove_slot(Node node, Py_ssize_t i) noexcept
cdef int grow(Node node) except -1
cdef void mirror(Node node) noexcept

# For the hybrid core (_hybrid_c), which cimports this module: what it shares with the
# tree core's own calls (exported twins of inline helpers; the core inlines its own).
cdef ChildSlot* table_probe(ChildSlot* table, Py_ssize_t mask, const int64_t* page,
                            Py_ssize_t page_size, uint64_t h, int64_t ns,
                            bint mixed) noexcept
cdef void release_buffer(TokenBuf* tb) noexcept
cdef object make_index_array(object capsule, bint numpy_arrays)
cdef object new_empty_indices(bint numpy_arrays)
cdef object block_tensor(const int64_t* src, Py_ssize_t n, bint numpy_arrays)


@cython.cdivision(True)
cdef inline int64_t floor_div64(int64_t value, int64_t divisor) noexcept nogil:
    """``value // divisor`` rounded toward minus infinity (Python's and numpy's), for a
    positive ``divisor`` (a page id: ``_handover.page_ids``)."""
    cdef int64_t quotient = value / divisor
    if value % divisor and value < 0:
        quotient -= 1
    return quotient


cdef class Tree:
    cdef readonly Py_ssize_t page_size
    cdef readonly Node root
    cdef readonly int64_t clock
    cdef readonly Py_ssize_t node_count
    cdef public Py_ssize_t num_splits
    cdef readonly Guard guard
    # The index arrays it makes are numpy arrays (else torch tensors); its nodes copy it.
    cdef readonly bint numpy_arrays
    # It has a host tier: its nodes are HostNodes.
    cdef readonly bint host
    # The class of its nodes when not Node or HostNode (a hybrid core's AuxNode), else None.
    cdef object node_type
    # extra_key -> namespace id, only while the namespace has nodes. Ids come from a
    # counter and are never reused, so a stale id can only ever find nothing.
    cdef dict namespaces
    # namespace id -> number of root children in it (its entry goes with the last one).
    cdef dict ns_roots
    cdef int64_t last_ns
    # Namespaces in which the empty sequence was inserted (it has no node to mark).
    cdef set empty_inserted

    # The hash seed of the last namespace asked for (a walk asks for one namespace).
    cdef int64_t seed_ns
    cdef uint64_t seed

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
    cdef object store_value(self, Node node, object values)
    cdef int check_own_lock(self, Node node) except -1
    cdef Py_ssize_t lock_path(self, object node, int delta) except -1
    cdef Node detach_leaf(self, Node node, list dropped)
    cdef bint holds(self, Node node) noexcept
    cdef object clear(self)


cdef class EvictionHeap:
    # The 4-ary heap: entries below the run's last one.
    cdef HeapEntry* items
    cdef Py_ssize_t size
    cdef Py_ssize_t capacity
    # The sorted run: a ring buffer (power-of-two capacity) of entries pushed in order.
    cdef HeapEntry* run
    cdef Py_ssize_t run_head
    cdef Py_ssize_t run_size
    cdef Py_ssize_t run_cap
    cdef Py_ssize_t limit
    cdef int policy
    # The host tier's heap: its entries are host leaves (else device leaves).
    cdef bint host
    # Its tree has a host tier (its nodes are HostNodes): a device leaf may have host-only
    # children.
    cdef bint tiered
    cdef Guard guard
    # Eviction ranks (see _core_py): node -> rank, for the nodes whose rank is not 0 (Python
    # ints in [1, 2^63); private, its keys Nodes only: a lookup runs no Python code), shared
    # by the main heap (level 0) and its sub-heaps, one per rank in use (``level``: that
    # rank), which hold the leaves of that rank. The entries keep their four words: a cache
    # without ranks pays one test of ``ranked`` per push and per pop.
    cdef dict ranks
    cdef uint64_t level
    cdef bint ranked       # (main heap) the rank table is not empty
    cdef dict subheaps     # (main heap) rank -> its sub-heap
    cdef list levels       # (main heap) the sub-heaps' ranks, ascending

    cdef void release(self) noexcept
    cdef void fill_key(self, Node n, HeapEntry* e) noexcept
    cdef int add(self, const HeapEntry* entry) except -1
    cdef void sift_down(self, Py_ssize_t i) noexcept
    cdef HeapEntry* run_at(self, Py_ssize_t i) noexcept
    cdef bint take_front(self, HeapEntry* out) noexcept
    cdef list push_entry(self, Node node)
    cdef object pop_entry(self, list stale)
    cdef list compact(self)
    cdef bint usable(self, Node node) noexcept
    cdef uint64_t rank(self, Node node) noexcept
    cdef bint holds(self, Node node) noexcept
    cdef EvictionHeap subheap(self, uint64_t level)
    cdef object pop_ranked(self, list stale)
    cdef object set_rank_of(self, Node node, uint64_t rank, bint push)
    cdef void drop_rank(self, Node node) noexcept


cdef class FreedBatch:
    # A batch eviction's freed indices: CPU values in one malloc'd, reference-counted block
    # laid out as a result tensor's (it becomes that tensor), device tensors kept.
    cdef char* block
    cdef Py_ssize_t joined_len
    cdef Py_ssize_t joined_cap
    cdef Py_ssize_t hint
    cdef list parts
    # Its arrays are numpy arrays (else torch tensors): the core's mode.
    cdef bint numpy_arrays

    cdef int64_t* reserve(self, Py_ssize_t n) except NULL
    cdef int add_ints(self, const int64_t* data, Py_ssize_t n) except -1
    cdef int add_page_ids(self, const int64_t* data, Py_ssize_t n,
                          Py_ssize_t page_size) except -1
    cdef object tail(self, Py_ssize_t n)
    cdef int drop_tail(self, Py_ssize_t n) except -1
    cdef int seal(self) except -1
    cdef object joined_tensor(self)
    cdef int add_tensor(self, object tensor) except -1
    cdef object take(self)


cdef int collect_value(FreedBatch batch, Node node, Py_ssize_t page_size=*) except -1


cdef class Core:
    cdef readonly Tree tree
    cdef readonly EvictionHeap heap
    # The tree's guard (shared with the heap): held for the whole of every call.
    cdef readonly Guard guard
    cdef readonly Py_ssize_t page_size
    cdef readonly int64_t evictable
    cdef readonly int64_t protected
    cdef readonly int64_t lookups
    cdef readonly int64_t matched_tokens
    cdef readonly int64_t queried_tokens
    cdef readonly int64_t inserts
    cdef readonly int64_t inserted_tokens
    cdef readonly int64_t evictions
    cdef readonly int64_t evicted_tokens
    # Every index array it makes is a numpy array (else a torch tensor).
    cdef readonly bint numpy_arrays
    cdef object new_leaf
    cdef bint push_on_access
    # Host tier (see _core_py): the host leaves' heap, the host size and counters, the
    # write-through queue (a deque of nodes, FIFO) and the nodes a held insert adopted.
    cdef readonly bint host_tier
    cdef readonly int write_through_hits
    cdef readonly EvictionHeap host_heap
    cdef readonly int64_t host_size
    cdef readonly int64_t host_hit_tokens
    cdef readonly int64_t loaded_tokens
    cdef readonly int64_t backed_up_tokens
    cdef readonly int64_t host_evictions
    cdef readonly int64_t host_evicted_tokens
    cdef object wt_queue
    cdef object adopted
    # Session tags (see _core_py): node -> the set of session ints tagging it, and session ->
    # the set of nodes it tags (non-empty sets only; the sets hold ints and nodes alone, so
    # nothing in them runs Python code).
    cdef dict node_tags
    cdef dict session_nodes
    # Scratch buffers reused across calls (the guard makes them the call's own): converted
    # or copied tokens and kv, the matched path.
    cdef int64_t* tokens_buf
    cdef Py_ssize_t tokens_cap
    cdef int64_t* kv_buf
    cdef Py_ssize_t kv_cap
    cdef PyObject** path
    cdef Py_ssize_t path_cap

    cdef int take(self, bint held, str what) except -1
    cdef void give(self, bint held) noexcept
    cdef int64_t* scratch(self, bint for_kv, Py_ssize_t n) except NULL
    cdef int acquire(self, object obj, TokenBuf* b, bint for_kv, bint private) except -1
    cdef int64_t read_query(self, object tokens, TokenBuf* b, object extra_key) except -3
    cdef object match_result(self, object indices, object node, Py_ssize_t length)
    cdef object path_indices(self, Py_ssize_t count, Py_ssize_t length)
    cdef object insert_result(self, Py_ssize_t prefix_len, object node)
    cdef object insert_prefix_again(self, Node last, Py_ssize_t end, Py_ssize_t split_end,
                                    int64_t prio, object extra_key)
    cdef object push_if_evictable(self, Node node)
    cdef object drop_tag(self, Node node, object session)
    cdef object move_tags(self, Node node, Node parent)
    cdef void prefetch_victims(self) noexcept
    cdef int note_path(self, Py_ssize_t depth, Node node) except -1
    cdef Py_ssize_t walk_length(self, const int64_t* buf, Py_ssize_t end, int64_t ns) noexcept
    cdef Py_ssize_t walk_device(self, const int64_t* buf, Py_ssize_t end, int64_t ns) noexcept
    cdef object push_host_leaf(self, Node node)
    cdef int queue_if_due(self, Node node) except -1
    cdef object demote(self, Node node, list garbage)
    cdef object host_match_result(self, Py_ssize_t depth)
    cdef int hand_over_one(self, object free_callback, list handed, list garbage,
                           str what) except -1
    cdef int hand_over_batch(self, object free_callback, object value,
                             object error) except -1
    cdef int host_leave(self, HostNode node, object free_host, object on_remove_host,
                        list garbage) except -1
    cdef bint host_leaf_leaves(self, object free_host, object on_remove_host,
                               list garbage, object keep) except -1
    cdef bint holds_kept(self, Node top, object keep) except -1
    cdef HostNode device_node(self, object node, str what)
    cdef int drop_host_below(self, Node top, object free_host, object on_remove_host,
                             list garbage) except -1
    cdef object evict_tiered(self, int64_t target, object free_callback, bint batch,
                             object on_remove, object backup, object on_backup,
                             object free_host, object on_remove_host, object keep)
    cdef void adopt_path(self, Py_ssize_t depth, Py_ssize_t first_host,
                         object adopt_values) noexcept
    cdef int tiered_insert_end(self, Py_ssize_t depth, Py_ssize_t first_host,
                               Py_ssize_t start, Node lower, Node leaf, bint held) except -1

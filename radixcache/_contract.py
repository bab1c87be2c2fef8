"""The tree core's contract as code: what ``cache.py`` (and the router, the pools) call.

Typing Protocols of the module ``_core.core`` is (``CoreModule``: ``_core_py`` or
``_core_c``) and of its ``Core``, ``Tree``, ``EvictionHeap``, ``Node`` and ``Guard``, and of a
block module (``BlocksModule``: ``_blocks_py`` or ``_blocks_c``) and its ``BlockIndex``. The
prose that says what each member does is the spec: ``_core_py``'s module docstring (and
``_blocks_py``'s); ``_core_c.pyi`` and ``_blocks_c.pyi`` state the same members for the
compiled modules. tests/core/test_core_contract.py checks that both cores and both block modules
have every member here, with call signatures that accept every call these allow, and that
the stubs declare them.

Index arrays (``IndexArray``) are 1-D int64 ``torch.Tensor`` objects, or numpy arrays in a
core made with ``numpy_arrays``; token inputs (``Tokens``) are the common inputs the fast
paths take (see the spec), anything else is declined (None).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Protocol

__all__ = ["Guard", "Node", "Tree", "EvictionHeap", "Core", "CoreClass", "CoreModule",
           "AuxNode", "HybridCore", "HybridCoreClass", "HybridModule",
           "BlockIndex", "BlockIndexClass", "BlocksModule"]

IndexArray = Any  # torch.Tensor (int64, 1-D) or numpy.ndarray
Tokens = Any  # list/tuple of ints, int64 numpy array, array('q'), CPU int64 tensor
FreeCallback = Callable[[IndexArray], Any]
NodeHook = Callable[["Node"], Any]
#: ``evict``'s ``on_remove``: may answer the rank the victim's parent takes (None: unchanged).
RemoveHook = Callable[["Node"], Optional[int]]


class Guard(Protocol):
    """The re-entrancy guard a core's tree, heap and ``Core`` share (never waits)."""

    @property
    def busy(self) -> Any: ...

    def acquire(self, blocking: bool) -> bool: ...

    def release(self) -> Any: ...


class Node(Protocol):
    """A tree node: read-only properties (``RadixTreeNode`` documents them)."""

    @property
    def key(self) -> Any: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def stored_value(self) -> Optional[IndexArray]: ...
    @property
    def value(self) -> Optional[IndexArray]: ...
    @property
    def parent(self) -> Optional[Node]: ...
    @property
    def children(self) -> tuple: ...
    @property
    def num_children(self) -> int: ...
    @property
    def lock_ref(self) -> int: ...
    @property
    def last_access_time(self) -> int: ...
    @property
    def created_time(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def hit_count(self) -> int: ...
    @property
    def extra_key(self) -> Any: ...
    @property
    def id(self) -> int: ...
    @property
    def evicted(self) -> bool: ...
    @property
    def terminal(self) -> bool: ...
    @property
    def on_device(self) -> bool: ...
    @property
    def host_value(self) -> Optional[IndexArray]: ...
    @property
    def tier(self) -> str: ...


class Tree(Protocol):
    """``Core.tree``: the nodes (walked by the core's own calls)."""

    root: Node
    page_size: int
    clock: int
    node_count: int
    num_splits: int
    guard: Guard

    def iter_nodes(self) -> Iterator[tuple[Node, int]]: ...

    def check_layout(self) -> None: ...


class EvictionHeap(Protocol):
    """``Core.heap`` and ``Core.host_heap``: the lazy heap of evictable leaves."""

    def __len__(self) -> int: ...

    def push(self, node: Node) -> None: ...

    def pop_victim(self) -> Optional[Node]: ...

    def clear(self) -> None: ...

    def key_of(self, node: Node) -> Any: ...

    def rank_of(self, node: Node) -> int: ...

    def entries(self) -> list: ...


class Core(Protocol):
    """One cache's tree, heaps, sizes and counters, and its whole-call operations."""

    tree: Tree
    heap: EvictionHeap
    host_heap: EvictionHeap
    guard: Guard
    page_size: int
    numpy_arrays: bool
    host_tier: bool
    write_through_hits: int
    evictable: int
    protected: int
    host_size: int
    lookups: int
    matched_tokens: int
    queried_tokens: int
    inserts: int
    inserted_tokens: int
    evictions: int
    evicted_tokens: int
    host_hit_tokens: int
    loaded_tokens: int
    backed_up_tokens: int
    host_evictions: int
    host_evicted_tokens: int

    def enter(self, what: str) -> None: ...

    def leave(self) -> None: ...

    def match(self, tokens: Tokens, extra_key: Any = None, held: bool = False) -> Any: ...

    def insert(self, tokens: Tokens, kv: Any = None, extra_key: Any = None,
               priority: Any = 0, held: bool = False, hits_from: Any = 0,
               split_at: Any = None, split_priority: Any = 0) -> Any: ...

    def exists(self, tokens: Tokens, extra_key: Any = None,
               held: bool = False) -> Optional[bool]: ...

    def token_array(self, tokens: Tokens) -> Any: ...

    def walk(self, tokens: Tokens, extra_key: Any = None) -> int: ...

    def take_new_leaf(self) -> Optional[Node]: ...

    def revert_insert(self, adopted: list, leaf: Optional[Node],
                      held: bool = False) -> None: ...

    def take_adopted(self) -> list: ...

    def lock(self, node: Any, delta: int, held: bool = False) -> int: ...

    def set_rank(self, node: Any, rank: int, held: bool = False) -> None: ...

    def tag_session(self, node: Any, session: int, held: bool = False) -> bool: ...

    def untag_session(self, session: int, held: bool = False) -> int: ...

    def session_tags(self, node: Any) -> tuple[int, ...]: ...

    def tagged_nodes(self, session: int) -> tuple[Node, ...]: ...

    def pop_victim(self, held: bool = False) -> Optional[Node]: ...

    def remove_leaf(self, node: Node, held: bool = False) -> int: ...

    def evict(self, num_tokens: int, free_callback: Optional[FreeCallback] = None,
              batch: bool = False, on_remove: Optional[RemoveHook] = None,
              backup: Optional[Callable[[IndexArray], Any]] = None,
              on_backup: Optional[NodeHook] = None,
              free_host: Optional[FreeCallback] = None,
              on_remove_host: Optional[NodeHook] = None, keep: Any = None,
              page_ids: bool = False) -> int: ...

    def evict_host(self, num_tokens: int, free_callback: Optional[FreeCallback] = None,
                   batch: bool = False, on_remove: Optional[NodeHook] = None,
                   keep: Any = None) -> int: ...

    def next_victim(self, host: bool = False, keep: Any = None) -> Optional[Node]: ...

    def back_up(self, node: Any, host: Any, on_backup: Optional[NodeHook] = None) -> None: ...

    def drop_host_copy(self, node: Any,
                       on_remove_host: Optional[NodeHook] = None) -> IndexArray: ...

    def write_through(self, backup: Callable[[IndexArray], Any],
                      on_backup: Optional[NodeHook] = None) -> int: ...

    def load_back(self, match: Any, device_values: Any,
                  on_load: Optional[NodeHook] = None) -> IndexArray: ...

    def insert_host(self, node: Any, tokens: Tokens, host: Tokens, extra_key: Any = None,
                    refill: bool = False, on_store: Optional[NodeHook] = None) -> tuple: ...

    def set_value(self, node: Node, values: Any, held: bool = False) -> None: ...

    def export_state(self) -> dict: ...

    def import_state(self, state: dict) -> None: ...

    def reset(self, held: bool = False) -> None: ...

    def reset_stats(self) -> None: ...


class CoreClass(Protocol):
    """``Core`` itself: how a cache makes its core."""

    def __call__(self, page_size: int, policy: str, host_tier: bool = False,
                 write_through_hits: int = 0, numpy_arrays: bool = False) -> Core: ...


class CoreModule(Protocol):
    """A tree core module: ``_core_py`` or ``_core_c``."""

    CORE_NAME: str
    Core: CoreClass
    Node: type
    Tree: type
    EvictionHeap: type
    Guard: type

    def put_slots(self, stack: Any, top: int, slots: Any, bound: int) -> int: ...


class AuxNode(Node, Protocol):
    """A node of a hybrid core: ``Node`` and its auxiliary component (``_hybrid_py``)."""

    @property
    def aux_value(self) -> Optional[IndexArray]: ...
    @property
    def aux_lock_ref(self) -> int: ...


class HybridCore(Protocol):
    """A hybrid cache's tree core (spec: ``_hybrid_py``'s docstring): what the SGLang backend
    of a sliding-window or Mamba model calls."""

    tree: Tree
    heap: EvictionHeap
    guard: Guard
    page_size: int
    numpy_arrays: bool
    core_name: str
    window: int
    state: bool
    evictable: int
    protected: int
    aux_evictable: int
    aux_protected: int
    last_walk: int
    last_recovered: list
    aux_kept: bool
    last_dup_pages: Optional[Any]
    lookups: int
    matched_tokens: int
    queried_tokens: int
    inserts: int
    inserted_tokens: int
    evictions: int
    evicted_tokens: int

    def enter(self, what: str) -> None: ...

    def leave(self) -> None: ...

    def match(self, tokens: Tokens, extra_key: Any = None, held: bool = False) -> Any: ...

    def insert(self, tokens: Tokens, kv: Any = None, aux: Any = None, extra_key: Any = None,
               priority: Any = 0, hits_from: Any = 0, live_from: Any = 0, dup_from: Any = 0,
               held: bool = False, dup_pages: bool = False) -> Any: ...

    def exists(self, tokens: Tokens, extra_key: Any = None,
               held: bool = False) -> Optional[bool]: ...

    def walk(self, tokens: Tokens, extra_key: Any = None) -> int: ...

    def token_array(self, tokens: Tokens) -> Any: ...

    def path_indices(self, node: Any, start: int = 0) -> Any: ...

    def lock(self, node: Any, delta: int, held: bool = False) -> int: ...

    def aux_lock(self, node: Any, delta: int, mark: int = 0, held: bool = False) -> int: ...

    def aux_release(self, node: Any, mark: int, held: bool = False) -> list: ...

    def relock(self, old: Any, new: Any, release: int = 3, acquire: int = 3, start: int = 0,
               stop: int = 0, held: bool = False) -> Optional[Any]: ...

    def evict(self, num_tokens: int = 0, aux_tokens: int = 0, held: bool = False,
              page_ids: bool = False) -> tuple: ...

    def pop_victim(self, held: bool = False) -> Optional[Node]: ...

    def remove_leaf(self, node: Node, held: bool = False) -> int: ...

    def take_new_leaf(self) -> Optional[Node]: ...

    def total_size(self) -> tuple: ...

    def export_state(self) -> dict: ...

    def import_state(self, state: dict) -> None: ...

    def reset(self, held: bool = False) -> None: ...

    def reset_stats(self) -> None: ...

    def aux_order(self) -> list: ...

    def check_aux(self) -> None: ...


class HybridCoreClass(Protocol):
    """``HybridCore`` itself: how the backend makes one."""

    def __call__(self, page_size: int, policy: str, numpy_arrays: bool = False,
                 window: int = 0, state: bool = False) -> HybridCore: ...


class HybridModule(Protocol):
    """A hybrid core module: ``_hybrid_py`` or ``_hybrid_c``."""

    CORE_NAME: str
    HybridCore: HybridCoreClass
    AuxNode: type


class BlockIndex(Protocol):
    """``KvIndexer``'s table of held blocks (spec: ``_blocks_py``'s docstring)."""

    @property
    def pairs(self) -> int: ...

    def __len__(self) -> int: ...

    def hold(self, key: int, copy: int) -> None: ...

    def unhold(self, key: int, copy: int) -> bool: ...

    def holds(self, key: int, copy: int) -> bool: ...

    def holders(self, key: int) -> list: ...

    def add(self, copy: int, keys: Any) -> int: ...

    def store(self, copy: int, keys: Any) -> tuple: ...

    def remove(self, copy: int, keys: Any) -> tuple: ...

    def clear_copy(self, copy: int) -> int: ...

    def overlap(self, seed: int, data: Any, page_bytes: int, owners: Any) -> list: ...


class BlockIndexClass(Protocol):
    """``BlockIndex`` itself: an empty index."""

    def __call__(self) -> BlockIndex: ...


class BlocksModule(Protocol):
    """A block module: ``_blocks_py`` or ``_blocks_c``."""

    BlockIndex: BlockIndexClass

    def page_hash_chain(self, seed: int, data: bytes, page_bytes: int) -> list: ...

    def page_hash_bytes(self, seed: int, data: Any, page_bytes: int) -> bytes: ...

    def ids_le_bytes(self, items: Any) -> bytes: ...

    def msgpack_ids(self, data: bytes) -> Optional[bytes]: ...

    def json_ids(self, data: bytes, start: int = 0,
                 stop: Optional[int] = None) -> Optional[bytes]: ...

    def query_answer(self, rows: list, block_size: int, tenant: Optional[bytes]) -> bytes: ...

    def read_wire(self, data: bytes) -> Any: ...

    def apply_wire(self, index: Any, batch: Any, start: int, keymap: Any, copy: int,
                   direct: int, block_size: int, seed: int, alone: bool, ns: bool) -> tuple: ...

    def recv_stream(self, handle: int, limit: int, expected: int) -> Optional[tuple]: ...

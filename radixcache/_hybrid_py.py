"""Pure-Python hybrid core: a tree whose nodes also hold one auxiliary component's slots.

A hybrid model keeps, beside each token's full-attention KV slot, state of a second kind:
the slots of its sliding-window layers (a *window* component: one auxiliary slot per token,
of which a request reads only the last ``window`` tokens), or the recurrent state of its
Mamba / linear-attention layers (a *state* component: one auxiliary slot per node, the state
after the node's last token). ``HybridCore`` is ``Core`` (``_core_py``'s docstring specifies
what it shares: the walk, splits, namespaces, the full-attention eviction heap, locks,
counters, the guard) with the auxiliary component built into its nodes, sizes, locks and
eviction, deciding as SGLang 0.5.23's unified radix cache decides with its SWA or Mamba
component. The compiled twin (``_hybrid_c``) implements the same interface; the
``_contract.HybridCore`` Protocol states it.

``HybridCore(page_size, policy, numpy_arrays=False, window=0, state=False)``: exactly one
of ``window`` (> 0: a window component of that many tokens) and ``state`` (True: a state
component). No host tier. Index arrays are as in ``Core`` (torch tensors, or numpy arrays
with ``numpy_arrays``); inputs are token and slot arrays of the common kinds (a list or
tuple of ints, a 1-D int64 numpy array, ``array('q')``, a 1-D CPU int64 tensor). Bad input
raises ``TypeError``/``ValueError`` naming it, with nothing changed.

Nodes (``AuxNode``, a ``Node`` subclass; a one-tier tree never makes one) add
``aux_value`` (a new index array of the node's auxiliary slots -- ``num_tokens`` of them for a
window, one for a state -- or None) and ``aux_lock_ref``. A node on the tree whose full
slots are kept but whose auxiliary slots are gone is a *tombstone* (``aux_value`` None). A
window node's auxiliary slots are split with its tokens; a state lives with the last token,
so a split leaves it on the lower half (the upper half has none and is unlocked).

Sizes: ``evictable``/``protected`` count full-attention tokens as in ``Core``;
``aux_evictable``/``aux_protected`` count auxiliary slots (window: tokens; state: one per
node) of the nodes that have them, by whether their ``aux_lock_ref`` is 0.
``total_size() -> (tokens, auxiliary slots)``.

Recency of the auxiliary component: an LRU list of the nodes that have auxiliary slots
(``aux_order()`` lists them, least recent first). A node enters it at the most recent end
when it gets slots; a split's upper half with slots goes just behind the lower half; a match
(window: its accepted node and every ancestor within ``window + page_size`` tokens of it,
each ancestor behind its child; state: the accepted node) and an insert (window: the same
from its last node; state: an existing last node that had its state) move nodes to the
recent end.

- ``match(tokens, extra_key=None, held=False) -> MatchResult``: walks and splits as
  ``Core.match``, then accepts the deepest node of the walked path whose auxiliary
  component can serve it -- window: no tombstone on the path, or at least ``window`` tokens
  of non-tombstone nodes since the last one; state: a node with a state -- and returns that
  prefix (indices, node, length). Only the root..accepted path is stamped with the call's
  tick (and the upper half of a split, which is new). ``last_walk`` is set to the tokens
  the walk matched (the accepted prefix or more).
- ``insert(tokens, kv, aux=None, extra_key=None, priority=0, hits_from=0, live_from=0,
  dup_from=0, held=False, dup_pages=False) -> InsertResult``: ``kv`` (required) are the caller's
  full-attention slots for the page-aligned tokens, ``aux`` its auxiliary slots (window:
  one per token, aligned with ``kv``; state: one slot, the state at the end of the
  sequence). Walks, splits, stamps, priorities and hit counts as ``Core.insert`` (a node
  counts a hit when it ends past ``hits_from``). Window: a walked tombstone that ends past
  ``dup_from`` and past ``live_from`` (the caller has no window slots before it) is
  recovered from the caller's slots from ``max(its start, live_from)`` (split there;
  ``live_from`` is page aligned):
  unlocked, it takes the caller's full slots and its old ones are handed back; locked
  (``lock_ref`` > 0), it keeps its full slots, takes the caller's window slots, and the
  caller's full slots for that range are handed back. A new leaf is a tombstone below
  ``live_from`` (split there) and, if its live part is longer than ``window`` rounded up to
  pages, that part is split so that the lower half holds exactly that many tokens; its live
  nodes get their window slots, upper first. State: a new leaf takes ``aux``; an existing
  last node without a state takes it; one with a state keeps its own (``aux_kept`` True).
  ``last_recovered`` lists the recovered ranges, in walk order, as ``(start, end, slots,
  locked)``: ``slots`` are the node's full slots before the call (unlocked: replaced by the
  caller's, to be freed in the full-attention pool only; locked: kept, and the caller's
  ``kv[start:end]`` are to be freed so). ``InsertResult.prefix_len`` counts the
  tokens the walk found cached (recovered ones included).
  With ``dup_pages`` (a bool, else ``TypeError`` before anything changes),
  ``last_dup_pages`` is set to the page ids of the caller's ``kv[dup_from:prefix_len]``
  (every ``page_size``-th slot from ``dup_from``, floor-divided by ``page_size``: the
  duplicates a paged allocator frees; a new index array, empty when ``dup_from >=
  prefix_len``); it is None after any other insert.
- ``lock(node, delta, held=False) -> int``: the full-attention lock, as ``Core.lock``.
- ``aux_lock(node, delta, mark=0, held=False) -> int``: the auxiliary lock. Window: +1
  counts every node from ``node`` up until ``window`` tokens are covered (tombstones
  included) and returns the mark of the node where coverage was reached (stamped with a new
  mark if it had none; 0 when the root came first); -1 undoes it, walking up to the node
  carrying ``mark`` (to the root for 0). A split moves a node's mark to its upper half.
  State: +1/-1 on ``node`` alone; returns 0. A release that would take a count below 0
  raises ``ValueError`` and changes nothing.
- ``relock(old, new, release=3, acquire=3, start=0, stop=0, held=False) -> index array |
  None``: a state component's lock move, whole: ``old``'s locks named by the mask
  ``release`` go (1: the full-attention lock, as ``lock(old, -1)``; 2: the state lock, as
  ``aux_lock(old, -1)``), then ``new``'s named by ``acquire`` are taken (as ``lock(new, 1)``
  and ``aux_lock(new, 1)``), and the full-attention slots of root..``new`` from token
  ``start`` to ``stop`` come back (as ``path_indices(new, start)[:stop - start]``; None when
  ``start == stop``). ``old``/``new`` None or the root: nothing to release/take. Every check
  (the masks, ``0 <= start <= stop <=`` the path's tokens, membership, the counts the four
  lock calls would check, in their order) is made before anything changes. A window
  component raises ``TypeError`` for a state lock (mask 2): its lock moves with
  ``aux_lock``.
- ``aux_release(node, mark, held=False) -> list``: the early release of a window lock: as
  ``aux_lock(node, -1, mark)``, and a node left unlocked that is an evictable leaf is made a
  tombstone; returns those nodes' records (below).
- ``evict(num_tokens, aux_tokens=0, held=False, page_ids=False) -> (freed, aux_freed,
  records)``: frees full-attention tokens first, as ``Core.evict`` does (evictable leaves in
  policy order; a victim's auxiliary slots go with it), until ``num_tokens`` are freed;
  then, while fewer than ``aux_tokens`` auxiliary slots are freed, walks the auxiliary LRU
  from its least recent end, skipping locked nodes: an evictable leaf leaves the tree as
  above, any other node becomes a tombstone. ``records`` lists what was freed, in order,
  as ``(values, aux, whole)``: the node's full slots, its auxiliary slots (None for a
  tombstone leaf) and whether it left the tree (False: a tombstone; its full slots are
  kept).
  ``evict(..., page_ids=True)`` decides the same and returns ``(freed, aux_freed, pages,
  aux)`` instead: ``pages`` the page ids of the full slots of the nodes that left the tree
  (every ``page_size``-th slot of a node from its first, floor-divided by ``page_size``:
  what a paged allocator frees, ``_handover.page_ids``), ``aux`` the auxiliary slots of
  every record, each a new index array (empty when none) in eviction order. ``TypeError``
  for a ``page_ids`` that is not a bool, before anything changes.
- ``path_indices(node, start=0) -> index array``: the full-attention slots of the path
  root..``node`` from its ``start``-th token on (a new array; ``ValueError`` for a node not
  in this tree).
- ``exists(tokens, extra_key=None, held=False)``, ``walk(tokens, extra_key=None)``,
  ``token_array(tokens)``, ``pop_victim(held=False)``, ``take_new_leaf()``,
  ``reset(held=False)``, ``reset_stats()``, ``enter(what)``/``leave()`` and the counters,
  ``tree``, ``heap`` and ``guard``: as in ``Core``. ``remove_leaf(node, held=False)``: as in
  ``Core`` (the leaf's auxiliary slots go with it). ``total_size()``: as above.
  ``export_state()``/``import_state(state)`` raise ``TypeError`` (a hybrid cache is not
  copied). ``aux_order()`` (the nodes with auxiliary slots, least recent first) and
  ``check_aux()`` (raises ``AssertionError`` naming what is inconsistent) are for tests;
  ``core_name`` names the tree core it is built on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._core_py import Core, _hashable, _kv_array, _token_bytes
from ._errors import reentered
from ._handover import page_ids as page_ids_of
from ._heap_py import EvictionHeap
from ._torch import empty_indices
from ._tree_py import TOKEN_BYTES, Node, Tree, index_array
from ._types import MAX_LOCK_REF, InsertResult, MatchResult
from ._validate import INT64_MAX, INT64_MIN

__all__ = ["AuxNode", "HybridCore", "CORE_NAME"]

CORE_NAME = "python"

#: ``relock``'s lock masks: the full-attention lock (the path) and the state lock (the node).
_FULL_LOCK = 1
_STATE_LOCK = 2


def _top_of(node: Any, root: Any) -> Any:
    """The root's child on ``node``'s path."""
    while node._parent is not root:
        node = node._parent
    return node


class AuxNode(Node):
    """A node of a hybrid tree: its auxiliary slots, their lock count, the window lock's
    mark and its place in the auxiliary LRU list."""

    __slots__ = ("_aux", "_aux_lock", "_mark", "_prev", "_next")

    def __init__(self, key: bytes, parent: "Node | None", extra_key: Any, now: int,
                 priority: int = 0) -> None:
        super().__init__(key, parent, extra_key, now, priority)
        self._aux = None  # auxiliary slots as int64 bytes; None: a tombstone, no state
        self._aux_lock = 0
        self._mark = 0  # a window lock's boundary mark (0: none)
        self._prev = None  # the auxiliary LRU list: toward the least recent end
        self._next = None

    @property
    def aux_value(self):
        aux = self._aux
        if aux is None or self._evicted:
            return None
        return index_array([aux], self._numpy_arrays)

    @property
    def aux_lock_ref(self) -> int:
        return self._aux_lock


class _NumpyAuxNode(AuxNode):
    __slots__ = ()
    _numpy_arrays = True


class _LruEnd:
    """One end of the auxiliary LRU list (never a node)."""

    __slots__ = ("_prev", "_next")

    def __init__(self) -> None:
        self._prev = self._next = None


def _evictable_leaf(node: AuxNode) -> bool:
    """The heap's check of a hybrid victim: attached, childless, unlocked in both
    components (the root is never pushed)."""
    return not (node._evicted or node._children or node._lock_ref or node._aux_lock)


def _aligned_up(n: int, page: int) -> int:
    return (n + page - 1) // page * page


class AuxTree(Tree):
    """The hybrid tree: ``Tree`` whose splits share out the auxiliary slots, locks and marks
    and keep the auxiliary LRU list, and which keeps the auxiliary sizes."""

    __slots__ = ("window", "state", "_head", "_tail", "aux_evictable", "aux_protected",
                 "_marks")

    def __init__(self, page_size: int, numpy_arrays: bool, window: int, state: bool) -> None:
        super().__init__(page_size, numpy_arrays,
                         node_class=_NumpyAuxNode if numpy_arrays else AuxNode)
        self.window = window
        self.state = state
        self._marks = 0
        self._reset_aux()

    def _reset_aux(self) -> None:
        self._head = _LruEnd()  # the most recent end
        self._tail = _LruEnd()  # the least recent end
        self._head._next = self._tail
        self._tail._prev = self._head
        self.aux_evictable = 0
        self.aux_protected = 0

    # -- the auxiliary LRU list ------------------------------------------------------------
    @staticmethod
    def _unlink(node: AuxNode) -> None:
        node._prev._next = node._next
        node._next._prev = node._prev
        node._prev = node._next = None

    @staticmethod
    def _link_after(before: Any, node: AuxNode) -> None:
        """Put ``node`` right behind ``before`` (on the least recent side)."""
        node._prev = before
        node._next = before._next
        before._next._prev = node
        before._next = node

    def _newest(self, node: AuxNode) -> None:
        if node._prev is not None:
            self._unlink(node)
        self._link_after(self._head, node)

    def _prev_unlocked(self, node: Any) -> AuxNode | None:
        """The next node toward the recent end from ``node`` (a node or the least recent
        end) whose auxiliary lock is 0; None at the recent end."""
        cur = node._prev
        while cur is not self._head and cur._aux_lock:
            cur = cur._prev
        return None if cur is self._head else cur

    def _aux_size(self, node: AuxNode) -> int:
        return 1 if self.state else len(node._key) // TOKEN_BYTES

    def _count_aux(self, node: AuxNode, sign: int) -> None:
        if node._aux_lock:
            self.aux_protected += sign * self._aux_size(node)
        else:
            self.aux_evictable += sign * self._aux_size(node)

    def _give_aux(self, node: AuxNode, aux: bytes) -> None:
        """``node`` (without auxiliary slots) takes ``aux`` and enters the list, most recent."""
        node._aux = aux
        self._link_after(self._head, node)
        self._count_aux(node, 1)

    def _take_aux(self, node: AuxNode) -> bytes:
        """``node`` becomes a tombstone: its auxiliary slots (returned) leave it and the list."""
        aux = node._aux
        self._count_aux(node, -1)
        self._unlink(node)
        node._aux = None
        return aux

    def _refresh(self, node: AuxNode) -> None:
        """A match or insert ended on ``node``: window, it and its ancestors within
        ``window + page_size`` tokens move to the recent end (each behind its child); state,
        it alone if it has a state."""
        root = self.root
        if self.state:
            if node is not root and node._aux is not None:
                self._newest(node)
            return
        before = self._head
        span = self.window + self.page_size
        covered = 0
        while node is not root and covered < span:
            if node._aux is not None:
                self._unlink(node)
                self._link_after(before, node)
                before = node
            covered += len(node._key) // TOKEN_BYTES
            node = node._parent

    # -- structure ------------------------------------------------------------------------------
    def _split(self, node: Node, at: int) -> Node:
        upper = super()._split(node, at)
        if self.state:
            return upper  # the state stays on the lower half; the upper one is unlocked
        upper._aux_lock = node._aux_lock
        upper._mark, node._mark = node._mark, 0  # the boundary is the older edge
        aux = node._aux
        if aux is not None:
            upper._aux = aux[:at]
            node._aux = aux[at:]
            self._link_after(node, upper)  # just behind the lower half
        return upper

    def _detach_leaf(self, node: Node) -> tuple:
        if node._aux is not None and not node._evicted and node._parent is not None:
            self._take_aux(node)
        return super()._detach_leaf(node)

    def _clear(self) -> Node:
        self._reset_aux()
        return super()._clear()


class _NotHybrid:
    """A tree core's call that a hybrid core does not have (the compiled one, which wraps a
    tree core rather than being one, has no such attribute): reading it raises
    ``AttributeError``, so that both hybrid cores answer alike."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        raise AttributeError(f"'HybridCore' object has no attribute '{self.name}'")


class HybridCore(Core):
    """One hybrid cache: ``Core`` with an auxiliary component (see the module docstring)."""

    __slots__ = ("last_walk", "last_recovered", "aux_kept", "last_dup_pages", "_component")

    def __init__(self, page_size: int, policy: str, numpy_arrays: bool = False,
                 window: int = 0, state: bool = False) -> None:
        if type(window) is not int or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        if (window > 0) == bool(state):
            raise ValueError("a hybrid core has exactly one auxiliary component: give "
                             "window > 0 (sliding-window slots) or state=True (one state "
                             "per node)")
        self._component = (window, bool(state))
        super().__init__(page_size, policy, numpy_arrays=numpy_arrays)
        # A victim must be unlocked in both components.
        self.heap = EvictionHeap(policy, self.guard, _evictable_leaf)
        self.last_walk = 0
        self.last_recovered: list = []
        self.aux_kept = False
        self.last_dup_pages = None

    def _make_tree(self, page_size: int, numpy_arrays: bool, host_tier: bool) -> Tree:
        window, state = self._component
        return AuxTree(page_size, numpy_arrays, window, state)

    # -- attributes ----------------------------------------------------------------------------
    @property
    def core_name(self) -> str:
        """The tree core this hybrid core is built on ("python")."""
        return CORE_NAME

    @property
    def window(self) -> int:
        return self.tree.window

    @property
    def state(self) -> bool:
        return self.tree.state

    @property
    def aux_evictable(self) -> int:
        return self.tree.aux_evictable

    @property
    def aux_protected(self) -> int:
        return self.tree.aux_protected

    def total_size(self) -> tuple:
        return self.evictable + self.protected, self.aux_evictable + self.aux_protected

    def reset(self, held: bool = False) -> None:
        super().reset(held)
        self.last_walk = 0
        self.last_recovered = []
        self.aux_kept = False
        self.last_dup_pages = None

    def export_state(self) -> dict:
        raise TypeError("a hybrid cache cannot be exported or copied")

    def import_state(self, state: dict) -> None:
        raise TypeError("a hybrid cache cannot be exported or copied")

    def revert_insert(self, adopted: list, leaf: Any, held: bool = False) -> None:
        raise TypeError("a hybrid core takes its slots whole: there is no insert to revert")

    def set_value(self, node: Node, values: Any, held: bool = False) -> None:
        raise TypeError("a hybrid core takes its slots with insert")

    def _values_of(self, node: AuxNode) -> Any:
        value = node._value
        return index_array([node._key if value is None else value], self._numpy_arrays)

    def _aux_of(self, aux: bytes | None) -> Any:
        return None if aux is None else index_array([aux], self._numpy_arrays)

    # -- match -----------------------------------------------------------------------------------
    def match(self, tokens: Any, extra_key: Any = None, held: bool = False) -> MatchResult:
        self._take(held, "match_prefix")
        try:
            buf = _token_bytes(tokens)
            if buf is None:
                raise TypeError(f"token_ids must be a list, tuple, int64 array or tensor of "
                                f"ints, got {type(tokens).__name__}")
            if extra_key is not None and not _hashable(extra_key):
                raise TypeError(f"extra_key must be hashable, got {type(extra_key).__name__}")
            tree = self.tree
            end = tree._aligned_end(buf)
            self.lookups += 1
            self.queried_tokens += end // TOKEN_BYTES
            node = tree.root
            path = []
            pos = 0
            splits = tree.num_splits
            while pos < end:
                child, common = tree._descend(node, buf, pos, end, extra_key)
                if child is None:
                    break
                path.append(child)
                pos += common
                node = child
            self.last_walk = pos // TOKEN_BYTES
            best = self._accepted(path)
            if end:
                # The accepted path gets the call's tick, and so does a split's new upper
                # half (the walk's last node), which is new even beyond it.
                tree.clock += 1
                now = tree.clock
                tree.root._last_access_time = now
                for i in range(best + 1):
                    path[i]._last_access_time = now
                if tree.num_splits != splits:
                    path[-1]._last_access_time = now
            if best < 0:
                return MatchResult(empty_indices(self._numpy_arrays), tree.root, 0)
            accepted = path[:best + 1]
            last = accepted[-1]
            tree._refresh(last)
            length = sum(len(n._key) for n in accepted) // TOKEN_BYTES
            self.matched_tokens += length
            if self._push_on_access:
                dropped = self._push_if_evictable(last)  # noqa: F841 -- held until the call returns
            return MatchResult(tree._gather(accepted), last, length)
        finally:
            if not held:
                self._leave()

    def _accepted(self, path: list) -> int:
        """The index in ``path`` of the deepest node the auxiliary component accepts (-1:
        none)."""
        best = -1
        if self.tree.state:
            for i, node in enumerate(path):
                if node._aux is not None:
                    best = i
            return best
        window = self.tree.window
        run = None  # tokens since the last tombstone (None: no tombstone yet)
        for i, node in enumerate(path):
            if node._aux is None:
                run = 0
                continue
            if run is None:
                best = i
                continue
            run += len(node._key) // TOKEN_BYTES
            if run >= window:
                best = i
        return best

    # -- insert ----------------------------------------------------------------------------------
    def _slots(self, values: Any, what: str, needed: int) -> np.ndarray:
        if type(values) in (list, tuple) and not values:
            values = np.empty(0, dtype=np.int64)  # (numpy reads an empty list as floats)
        arr = _kv_array(values, needed)
        if arr is None:
            raise TypeError(f"{what} must be a 1-D int64 array (list, tuple, numpy array, "
                            f"array('q') or CPU tensor) of at least {needed} entries")
        return arr

    @staticmethod
    def _position(value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value <= INT64_MAX:
            raise TypeError(f"{what} must be an int in [0, 2^63), got {value!r}")
        return value

    def insert(self, tokens: Any, kv: Any = None, aux: Any = None, extra_key: Any = None,
               priority: Any = 0, hits_from: Any = 0, live_from: Any = 0, dup_from: Any = 0,
               held: bool = False, dup_pages: Any = False) -> InsertResult:
        if type(priority) is not int or not INT64_MIN <= priority <= INT64_MAX:
            raise TypeError(f"priority must be an int in int64, got {priority!r}")
        hits_from = self._position(hits_from, "hits_from")
        live_from = self._position(live_from, "live_from")
        if live_from % self.page_size:
            raise ValueError(f"live_from must be page aligned, got {live_from}")
        dup_from = self._position(dup_from, "dup_from")
        if type(dup_pages) is not bool:
            raise TypeError(f"dup_pages must be a bool, got {type(dup_pages).__name__}")
        self._take(held, "insert")
        self.last_dup_pages = None
        try:
            buf = _token_bytes(tokens)
            if buf is None:
                raise TypeError(f"token_ids must be a list, tuple, int64 array or tensor of "
                                f"ints, got {type(tokens).__name__}")
            tree = self.tree
            end = tree._aligned_end(buf) // TOKEN_BYTES
            # Copies, before the extra_key's hashing (user code) may write the caller's arrays.
            values = self._slots(kv, "kv", end)[:end].copy()
            if tree.state:
                state = self._slots(aux, "aux (the state slot)", 1)
                if len(state) != 1:
                    raise ValueError(f"a state component takes one aux slot, got {len(state)}")
                aux_bytes = state.tobytes()
            else:
                aux_bytes = self._slots(aux, "aux (the window slots)", end)[:end].tobytes()
            if extra_key is not None and not _hashable(extra_key):
                raise TypeError(f"extra_key must be hashable, got {type(extra_key).__name__}")
            result = self._insert(buf, end, values, aux_bytes, extra_key, priority, hits_from,
                                  live_from, dup_from)
            if dup_pages:
                self.last_dup_pages = index_array(
                    [page_ids_of(values[dup_from:result.prefix_len].tobytes(), self.page_size)],
                    self._numpy_arrays)
            return result
        finally:
            if not held:
                self._leave()

    def _insert(self, buf: bytes, end: int, values: np.ndarray, aux: bytes, extra_key: Any,
                priority: int, hits_from: int, live_from: int, dup_from: int) -> InsertResult:
        tree = self.tree
        self.inserts += 1
        self.last_recovered = recovered = []
        self.aux_kept = False
        node = tree.root
        if end == 0:
            if end * TOKEN_BYTES == len(buf):
                tree._empty_inserted.add(extra_key)
            return InsertResult(0, node)
        tree.clock += 1
        now = tree.clock
        node._last_access_time = now
        pos = 0
        end_bytes = end * TOKEN_BYTES
        window = not tree.state
        while pos < end_bytes:
            child, common = tree._descend(node, buf, pos, end_bytes, extra_key)
            if child is None:
                break
            child._last_access_time = now
            if priority > child._priority:
                child._priority = priority
            start, stop = pos // TOKEN_BYTES, (pos + common) // TOKEN_BYTES
            if window and child._aux is None and dup_from < stop:
                live = max(start, live_from)
                if live < stop:
                    if live > start:
                        tree._split(child, (live - start) * TOKEN_BYTES)  # child: the lower
                    recovered.append(self._recover(child, live, stop, values, aux))
            if stop > hits_from:
                child._hit_count += 1
            pos += common
            node = child
        prefix_len = pos // TOKEN_BYTES
        leaf = None
        if pos < end_bytes:
            leaf = self._new_leaf(node, buf, pos, end_bytes, extra_key, now, priority,
                                  values, aux, prefix_len, live_from)
            if end > hits_from:
                leaf._hit_count += 1
            node = leaf
        elif tree.state:
            if node is not tree.root:
                if node._aux is None:
                    tree._give_aux(node, aux)
                else:
                    tree._newest(node)
                    self.aux_kept = True
        if end_bytes == len(buf):
            node._terminal = True
        if node is not tree.root and window:
            tree._refresh(node)
        self.new_leaf = leaf
        if leaf is not None:
            dropped = self.heap._push(leaf)
        elif self._push_on_access:
            dropped = self._push_if_evictable(node)  # noqa: F841
        return InsertResult(prefix_len, node)

    def _recover(self, node: AuxNode, start: int, stop: int, values: np.ndarray,
                 aux: bytes) -> tuple:
        """A walked window tombstone [start, stop) takes the caller's window slots: unlocked,
        its full slots too (its old ones returned); locked, the caller's full slots are."""
        tree = self.tree
        record = (start, stop, self._values_of(node), bool(node._lock_ref))
        if not node._lock_ref:
            node._value = values[start:stop].tobytes()
        tree._give_aux(node, aux[start * TOKEN_BYTES:stop * TOKEN_BYTES])
        return record

    def _new_leaf(self, parent: AuxNode, buf: bytes, pos: int, end_bytes: int, extra_key: Any,
                  now: int, priority: int, values: np.ndarray, aux: bytes, prefix_len: int,
                  live_from: int) -> AuxNode:
        tree = self.tree
        first = buf[pos:pos + tree._page_bytes]
        ckey = tree._child_key(parent, extra_key, first)  # hashes extra_key: may raise
        leaf = tree._Node(buf[pos:end_bytes], parent, extra_key, now, priority)
        end = end_bytes // TOKEN_BYTES
        leaf._value = values[prefix_len:end].tobytes()
        parent._children[ckey] = leaf
        tree._filed(leaf, ckey)
        tree.node_count += 1
        size = end - prefix_len
        self.evictable += size
        self.inserted_tokens += size
        if tree.state:
            tree._give_aux(leaf, aux)
            return leaf
        live = max(prefix_len, live_from)
        if live >= end:
            return leaf  # all below the caller's live window slots: a tombstone leaf
        if live > prefix_len:
            tree._split(leaf, (live - prefix_len) * TOKEN_BYTES)  # the upper: a tombstone
        # A lock of the leaf pins its window slots: keep the live part that long.
        tail = _aligned_up(tree.window, tree.page_size)
        upper = None
        if end - live > tail:
            upper = tree._split(leaf, (end - live - tail) * TOKEN_BYTES)
            tree._give_aux(upper, aux[live * TOKEN_BYTES:(end - tail) * TOKEN_BYTES])
            tree._give_aux(leaf, aux[(end - tail) * TOKEN_BYTES:end_bytes])
        else:
            tree._give_aux(leaf, aux[live * TOKEN_BYTES:end_bytes])
        return leaf

    def path_indices(self, node: Any, start: int = 0) -> Any:
        self._take(False, "path_indices")
        try:
            tree = self.tree
            tree._check_member(node)
            if type(start) is not int or start < 0:
                raise TypeError(f"start must be an int >= 0, got {start!r}")
            parts = []
            while node is not tree.root:
                value = node._value
                parts.append(node._key if value is None else value)
                node = node._parent
            parts.reverse()
            joined = b"".join(parts)[start * TOKEN_BYTES:]
            return index_array([joined], self._numpy_arrays)
        finally:
            self._leave()

    # -- locks -----------------------------------------------------------------------------------
    def aux_lock(self, node: Any, delta: int, mark: int = 0, held: bool = False) -> int:
        if delta not in (1, -1):
            raise ValueError(f"delta must be 1 or -1, got {delta!r}")
        self._take(held, "inc_lock_ref" if delta > 0 else "dec_lock_ref")
        try:
            tree = self.tree
            tree._check_member(node)
            if node is tree.root:
                return 0
            if tree.state:
                if delta < 0 and node._aux_lock <= 0:
                    raise ValueError(f"aux_lock: node {node._id} holds no auxiliary lock")
                if delta > 0 and node._aux_lock >= 2**31 - 1:
                    raise OverflowError(f"aux_lock: node {node._id} holds the most locks")
                self._move_lock(node, delta)
                return 0
            if delta > 0:
                return self._lock_window(node)
            self._unlock_window(node, self._window_segment(node, mark))
            return 0
        finally:
            if not held:
                self._leave()

    def relock(self, old: Any, new: Any, release: int = 3, acquire: int = 3, start: int = 0,
               stop: int = 0, held: bool = False) -> Any:
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
        self._take(held, "relock")
        try:
            tree = self.tree
            root = tree.root
            if (release | acquire) & _STATE_LOCK and not tree.state:
                raise TypeError("relock moves a state lock; a window lock moves with aux_lock")
            if old is None or old is root:
                release = 0
            else:
                tree._check_member(old)
            if new is None or new is root:
                acquire = 0
            else:
                tree._check_member(new)
            # Every check before any change (as the four lock calls would raise, in order).
            if release & _STATE_LOCK and old._aux_lock <= 0:
                raise ValueError(f"aux_lock: node {old._id} holds no auxiliary lock")
            if release & _FULL_LOCK and old._own_locks <= 0:
                raise ValueError(
                    f"dec_lock_ref on node {old._id}: no lock_ref was taken on it "
                    f"(lock_ref {old._lock_ref} comes from its descendants)")
            total = 0
            cur = top = root if new is None else new
            while cur is not root:
                total += len(cur._key)
                top = cur
                cur = cur._parent
            total //= TOKEN_BYTES
            if stop > total:
                raise ValueError(f"relock: stop={stop} is past the node's {total} tokens")
            if acquire & _FULL_LOCK:
                held_top = top._lock_ref
                if release & _FULL_LOCK and _top_of(old, root) is top:
                    held_top -= 1  # the release comes first
                if held_top >= MAX_LOCK_REF:
                    raise OverflowError(f"inc_lock_ref on node {new._id}: node {top._id} "
                                        f"already has lock_ref {MAX_LOCK_REF}, the most a node "
                                        f"can hold")
            if acquire & _STATE_LOCK and new._aux_lock - (
                    old is new and release & _STATE_LOCK) >= 2**31 - 1:
                raise OverflowError(f"aux_lock: node {new._id} holds the most locks")
            dropped = None  # what the heap let go: held until the call returns
            if release & _STATE_LOCK:
                self._move_lock(old, -1)
            if release & _FULL_LOCK:
                moved = tree._lock(old, -1)
                if moved:
                    self.evictable += moved
                    self.protected -= moved
                    dropped = self._push_if_evictable(old)  # noqa: F841
            if acquire & _FULL_LOCK:
                moved = tree._lock(new, 1)
                self.evictable -= moved
                self.protected += moved
            if acquire & _STATE_LOCK:
                self._move_lock(new, 1)
            if start == stop:
                return None
            parts = []
            cur = new  # (not None: stop > 0 is within its path)
            while cur is not root:
                value = cur._value
                parts.append(cur._key if value is None else value)
                cur = cur._parent
            parts.reverse()
            joined = b"".join(parts)[start * TOKEN_BYTES:stop * TOKEN_BYTES]
            return index_array([joined], self._numpy_arrays)
        finally:
            if not held:
                self._leave()

    def _move_lock(self, node: AuxNode, delta: int) -> None:
        """One node's auxiliary lock count moves by ``delta``; its slots follow between the
        sizes when the count crosses 0."""
        tree = self.tree
        if node._aux is not None and (node._aux_lock == 0) != (node._aux_lock + delta == 0):
            size = tree._aux_size(node)
            tree.aux_evictable -= delta * size
            tree.aux_protected += delta * size
        node._aux_lock += delta

    def _lock_window(self, node: AuxNode) -> int:
        tree = self.tree
        segment = []
        covered = 0
        cur = node
        while cur is not tree.root and covered < tree.window:
            if cur._aux_lock >= 2**31 - 1:
                raise OverflowError(f"aux_lock: node {cur._id} holds the most locks")
            segment.append(cur)
            covered += len(cur._key) // TOKEN_BYTES
            cur = cur._parent
        for cur in segment:
            self._move_lock(cur, 1)
        if covered < tree.window:
            return 0
        boundary = segment[-1]
        if not boundary._mark:
            tree._marks += 1
            boundary._mark = tree._marks
        return boundary._mark

    def _window_segment(self, node: AuxNode, mark: int) -> list:
        """The nodes a window lock with ``mark`` holds from ``node`` (checked: each holds a
        lock, the mark is met, or the root when it is 0)."""
        if type(mark) is not int or mark < 0:
            raise TypeError(f"mark must be an int >= 0, got {mark!r}")
        root = self.tree.root
        segment = []
        cur = node
        while cur is not root:
            if cur._aux_lock <= 0:
                raise ValueError(f"aux_lock: node {cur._id} holds no auxiliary lock")
            segment.append(cur)
            if mark and cur._mark == mark:
                return segment
            cur = cur._parent
        if mark:
            raise ValueError(f"aux_lock: mark {mark} is not on node {node._id}'s path")
        return segment

    def _unlock_window(self, node: AuxNode, segment: list) -> None:
        for cur in segment:
            self._move_lock(cur, -1)
            if not cur._aux_lock:
                dropped = self._push_if_evictable(cur)  # noqa: F841 -- held until the call returns

    def aux_release(self, node: Any, mark: int, held: bool = False) -> list:
        self._take(held, "release_swa")
        try:
            tree = self.tree
            tree._check_member(node)
            if tree.state:
                raise TypeError("aux_release releases a window lock; a state component has none")
            if node is tree.root:
                return []
            segment = self._window_segment(node, mark)
            records = []
            for cur in segment:
                self._move_lock(cur, -1)
                if cur._aux_lock:
                    continue
                if cur._aux is not None and self._is_leaf(cur):
                    records.append((self._values_of(cur), self._aux_of(tree._take_aux(cur)),
                                    False))
                dropped = self._push_if_evictable(cur)  # noqa: F841 -- held until the call returns
            return records
        finally:
            if not held:
                self._leave()

    def _is_leaf(self, node: AuxNode) -> bool:
        """An evictable leaf: attached, unlocked (both locks), no children."""
        return (not node._children and not node._lock_ref and not node._aux_lock
                and not node._evicted and node is not self.tree.root)

    # -- eviction --------------------------------------------------------------------------------
    def _leave_tree(self, node: AuxNode, records: list, garbage: list,
                    gathered: tuple | None = None) -> tuple:
        """An evictable leaf leaves the tree; its record goes to ``records`` (with
        ``gathered``, (page ids, auxiliary slots): its page ids and auxiliary slots, as int64
        bytes, go to those lists instead), what the tree let go to ``garbage`` (released
        after the guard). Returns (full tokens, auxiliary slots) freed."""
        tree = self.tree
        had = node._aux
        aux_size = tree._aux_size(node) if had is not None else 0
        size = node.num_tokens
        if gathered is None:
            values = self._values_of(node)
        else:
            value = node._value
            values = page_ids_of(node._key if value is None else value, self.page_size)
        parent, dropped = tree._detach_leaf(node)  # takes the auxiliary slots too
        garbage.append(dropped)
        if gathered is None:
            records.append((values, self._aux_of(had), True))
        else:
            gathered[0].append(values)
            if had is not None:
                gathered[1].append(had)
        self.evictable -= size
        self.evictions += 1
        self.evicted_tokens += size
        garbage.append(self._push_if_evictable(parent))
        return size, aux_size

    def evict(self, num_tokens: Any = 0, aux_tokens: Any = 0, held: bool = False,
              page_ids: Any = False) -> tuple:
        for value, what in ((num_tokens, "num_tokens"), (aux_tokens, "aux_tokens")):
            if type(value) is not int:
                raise TypeError(f"{what} must be an int, got {type(value).__name__}")
        if type(page_ids) is not bool:
            raise TypeError(f"page_ids must be a bool, got {type(page_ids).__name__}")
        self._take(held, "evict")
        garbage: list = []
        try:
            tree = self.tree
            records: list = []
            gathered = ([], []) if page_ids else None
            freed = aux_freed = 0
            while freed < num_tokens:
                node = self.heap._pop(garbage)
                if node is None:
                    break
                size, aux_size = self._leave_tree(node, records, garbage, gathered)
                freed += size
                aux_freed += aux_size
            cursor = None
            if aux_freed < aux_tokens:
                cursor = tree._prev_unlocked(tree._tail)
            while aux_freed < aux_tokens and cursor is not None:
                if cursor._prev is None:  # left the list meanwhile: from the end again
                    cursor = tree._prev_unlocked(tree._tail)
                    continue
                victim = cursor
                cursor = tree._prev_unlocked(victim)
                if self._is_leaf(victim):
                    size, aux_size = self._leave_tree(victim, records, garbage, gathered)
                    freed += size
                    aux_freed += aux_size
                elif gathered is not None:
                    aux_freed += tree._aux_size(victim)
                    gathered[1].append(tree._take_aux(victim))
                else:
                    aux_freed += tree._aux_size(victim)
                    records.append((self._values_of(victim),
                                    self._aux_of(tree._take_aux(victim)), False))
            if gathered is not None:
                return (freed, aux_freed, index_array(gathered[0], self._numpy_arrays),
                        index_array(gathered[1], self._numpy_arrays))
            return freed, aux_freed, records
        finally:
            if not held:
                self._leave()
            garbage.clear()

    def remove_leaf(self, node: Node, held: bool = False) -> int:
        garbage: list = []
        self._take(held, "evict")
        try:
            if not isinstance(node, AuxNode) or node._evicted:
                raise ValueError("remove_leaf needs an attached leaf of this cache")
            self.tree._check_member(node)
            if node._children:
                raise ValueError(f"node {node._id} is not an attached leaf")
            size, _ = self._leave_tree(node, [], garbage)
            return size
        finally:
            if not held:
                self._leave()
            garbage.clear()

    # -- for tests -------------------------------------------------------------------------------
    def aux_order(self) -> list:
        """The nodes with auxiliary slots, least recent first."""
        if not self._enter(False):
            raise reentered("aux_order")
        try:
            out = []
            cur = self.tree._tail._prev
            while cur is not self.tree._head:
                out.append(cur)
                cur = cur._prev
            return out
        finally:
            self._leave()

    def check_aux(self) -> None:
        """Raise AssertionError naming what is inconsistent: the list holds exactly the
        nodes with auxiliary slots, the sizes are theirs, locks are not negative, window
        slots match their node's length."""
        tree = self.tree
        in_list = set()
        cur = tree._head._next
        while cur is not tree._tail:
            assert cur._next._prev is cur, f"auxiliary list broken after node {cur.id}"
            assert id(cur) not in in_list, f"node {cur.id} twice in the auxiliary list"
            in_list.add(id(cur))
            cur = cur._next
        evictable = protected = 0
        for node, _ in tree.iter_nodes():
            if node is tree.root:
                continue
            assert node._aux_lock >= 0, f"node {node.id} has aux_lock_ref {node._aux_lock}"
            has = node._aux is not None
            assert has == (id(node) in in_list), (
                f"node {node.id}: auxiliary slots {has}, in the list {id(node) in in_list}")
            if has:
                want = TOKEN_BYTES if tree.state else len(node._key)
                assert len(node._aux) == want, f"node {node.id}: {len(node._aux)} aux bytes"
                if node._aux_lock:
                    protected += tree._aux_size(node)
                else:
                    evictable += tree._aux_size(node)
        assert len(in_list) == sum(1 for n, _ in tree.iter_nodes() if n._aux is not None)
        assert (tree.aux_evictable, tree.aux_protected) == (evictable, protected), (
            f"aux sizes {(tree.aux_evictable, tree.aux_protected)} != {(evictable, protected)}")


# The host tier's calls, eviction ranks, session tags and the public class's steps for device
# values and reverted inserts: a tree core's, not a hybrid core's.
for _name in ("back_up", "drop_host_copy", "evict_host", "insert_host", "load_back",
              "next_victim", "write_through", "set_rank", "tag_session", "untag_session",
              "session_tags", "tagged_nodes", "set_value", "revert_insert", "take_adopted"):
    setattr(HybridCore, _name, _NotHybrid(_name))
del _name

"""``RadixcacheMambaBackend``: the cache of a Mamba / linear-attention hybrid (Qwen3-Next,
Qwen3.5: SGLang's ``HybridReqToTokenPool`` and ``MambaPool``).

Such a model keeps, beside its full-attention KV, one recurrent state per request in the Mamba
pool. A cached prefix can be resumed only where a state was kept: the tree keeps one state
slot per node (the state after the node's last token) in a radixcache hybrid core with a state
component (``radixcache._hybrid_py``), locked on that node alone; a match ends at the deepest
node with a state, and its state is copied into the request's own slot (copy on write); a
request gives its state to the node it inserts at its checkpoint (the ping-pong track buffers
of ``--mamba-extra-buffer`` included); eviction frees whole leaves first, then states alone
(least recently used). It decides as SGLang's ``UnifiedRadixCache`` with its Mamba component
does: the request-side work (which state a checkpoint gives, the copy on write, what a
finished request frees) is SGLang's own ``MambaComponent`` code, run on this cache; the tree
side is the hybrid core's. Slots go back to SGLang's first-in first-out Mamba allocator in the
order SGLang's cache frees them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.runtime_context import mamba_checkpoint_grid

from .backend import _RECEIPT, _check_key, _token_array
from .hybrid import RadixcacheHybridBackend

_new_tuple = tuple.__new__
_FULL = ComponentType.FULL
_MAMBA = ComponentType.MAMBA
#: Where the Mamba pool's allocator is SGLang's own: its ``free`` appends to the free list,
#: so one free of several slots leaves it as several frees of them in that order would.
_STOCK_STATE_FREE = MambaSlotAllocator.free
#: SGLang's own request-side free of a request's state slots (a pool may override it).
_STOCK_FREE_STATES = HybridReqToTokenPool.free_mamba_cache
#: SGLang's plain request-row write (a pool may override it).
_STOCK_ROW_WRITE = ReqToTokenPool.write
#: The release receipt of a lock that skips its state (a checkpoint's with
#: SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK): ``unlock`` reads only what was skipped, and nothing of
#: SGLang's reads a Mamba cache's receipts, so one serves every such lock (as ``_RECEIPT``
#: serves those that skip nothing).
_STATE_SKIPPED_RECEIPT = DecLockRefParams(skipped_lock_components=(_MAMBA,))
#: The hybrid core's lock masks (``relock``): the full-attention path, the node's state.
_FULL_LOCK, _STATE_LOCK = 1, 2
_BOTH_LOCKS = _FULL_LOCK | _STATE_LOCK


def _lock_mask(skipped: Any) -> int:
    """The hybrid core's lock mask of a lock that skips the components ``skipped``."""
    return (0 if _FULL in skipped else _FULL_LOCK) | (0 if _MAMBA in skipped else _STATE_LOCK)


def _receipt(skipped: tuple) -> DecLockRefParams:
    """The release receipt of a lock that skips ``skipped``."""
    if not skipped:
        return _RECEIPT
    return (_STATE_SKIPPED_RECEIPT if skipped == (_MAMBA,)
            else DecLockRefParams(skipped_lock_components=skipped))


def _match_layout() -> Optional[tuple]:
    """What ``_match_result`` needs of SGLang's ``MatchResult`` (a NamedTuple): its default
    fields between and after the ones a Mamba match sets; None if its fields are not laid
    out as SGLang 0.5.23's are (the keyword call is made then)."""
    fields = MatchResult._fields
    if (fields[:4] != ("device_prefix_len", "last_device_node", "last_host_node",
                       "best_match_node")
            or "mamba_branching_seqlen" not in fields or "full_kv_hit_length" not in fields):
        return None
    branching = fields.index("mamba_branching_seqlen")
    walked = fields.index("full_kv_hit_length")
    if not 4 <= branching < walked:
        return None
    defaults = MatchResult(0, None, None, None)
    return defaults[4:branching], defaults[branching + 1:walked], defaults[walked + 1:]


_MATCH_LAYOUT = _match_layout()


def _match_result(length: int, node: Any, branching: Optional[int], walked: int) -> Any:
    """``MatchResult(device_prefix_len=length, last_device_node=node, last_host_node=node,
    best_match_node=node, mamba_branching_seqlen=branching, full_kv_hit_length=walked)``,
    built as the tuple it is (a third of the keyword call's time)."""
    if _MATCH_LAYOUT is None:
        return MatchResult(device_prefix_len=length, last_device_node=node,
                           last_host_node=node, best_match_node=node,
                           mamba_branching_seqlen=branching, full_kv_hit_length=walked)
    middle, between, tail = _MATCH_LAYOUT
    return _new_tuple(MatchResult, (length, node, node, node, *middle, branching, *between,
                                    walked, *tail))


def _state_array(slot: Any) -> np.ndarray:
    """A state slot (a 0-d or 1-element tensor) as the core's one-slot array."""
    return np.array((int(slot),), dtype=np.int64)


class _TreeView:
    """What SGLang's ``MambaComponent`` reads of a tree core: a node's state slot."""

    __slots__ = ()

    @staticmethod
    def get_component_device_value(node: Any, component_type: ComponentType) -> Any:
        value = node.aux_value
        return None if value is None else torch.from_numpy(value)


class RadixcacheMambaBackend(RadixcacheHybridBackend):
    """SGLang's ``BasePrefixCache`` for a Mamba / linear-attention hybrid, over a radixcache
    hybrid core with a state component.

    Built by ``create_backend`` for ``ctx.is_hybrid_ssm``. Node handles are the core's nodes.
    The methods are SGLang's ``BasePrefixCache`` interface and behave as its
    ``UnifiedRadixCache`` with the FULL and MAMBA components does.

    Args:
        params: SGLang's ``CacheInitParams``; its request pool is a ``HybridReqToTokenPool``.
        core: The radixcache core (``"c"``, ``"python"``); None: the class attribute
            ``core``, else radixcache's default.
    """

    #: No sliding-window layers.
    sliding_window_size: Optional[int] = None
    tree_components = (_FULL, _MAMBA)

    def __init__(self, params: Any, *, core: Optional[str] = None) -> None:
        self.enable_mamba_extra_buffer = params.enable_mamba_extra_buffer
        super().__init__(params, core=core, state=True)
        # SGLang's own component does the request side (it reads this cache's pools and
        # calls its evict_for_alloc, inc_lock_ref and dec_lock_ref).
        self._mamba = MambaComponent(self, params)
        self._mamba.tree_core = _TreeView()
        self._grid = mamba_checkpoint_grid(self.page_size)
        pool = self.req_to_token_pool
        # What a checkpoint locks of the node it moves to (read at start-up, as SGLang sizes
        # its Mamba pool by it then).
        skip = (_MAMBA,) if envs.SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK.get() else ()
        self._checkpoint_mask = _lock_mask(skip)
        self._checkpoint_receipt = _receipt(skip)
        # The request side of a finished request done here, as SGLang's component does it,
        # where it is plain (no int8 checkpoints, no replayed SSM ring); else its own code.
        self._plain_states = (getattr(pool, "mamba_ckpt_pool", None) is None
                              and getattr(pool.mamba_pool, "replayssm_write_pos", None) is None)
        # A finished request's state slots as SGLang's own Mamba allocator takes them (it
        # joins what it is given into a new free list at once): a kept tensor per count of
        # slots, and its numpy view (see _free_tracked_states).
        self._state_slots: dict = {}
        self._stock_state_allocator: Any = None

    def supports_mamba(self) -> bool:
        return True

    # -- match -----------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The deepest cached node with a state (its path's slots), the branching point
        (the last checkpoint-aligned position the full-attention KV reaches past it), and,
        with ``params.cow_mamba``, the state copied into the request's own slot (SGLang's
        ``finalize_match_result_in_cache``)."""
        found = self._match_key(params.key)
        if found is None:
            result = self._empty_match
        else:
            match, walked = found
            aligned = walked // self._grid * self._grid
            node = match.last_node
            length = match.length
            result = _match_result(length, node, aligned if aligned > length else None, walked)
        return self._copy_on_write(params, result)

    def _copy_on_write(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        """SGLang's ``MambaComponent.finalize_match_result_in_cache``: the matched state is
        to be copied into the request's own slot (allocated now if it has none; where the
        pool is empty, SGLang's code evicts a state first)."""
        if not params.cow_mamba:
            return result
        value = result.best_match_node.aux_value
        if value is None:
            return result
        req = params.req
        if req is None or not self._plain_states:
            return self._mamba.finalize_match_result_in_cache(params, result)
        kv = req.kv
        if kv.mamba_pool_idx is None:
            allocator = self.req_to_token_pool.mamba_allocator
            slot = allocator.alloc(1) if allocator.available_size() else None
            if slot is None:  # (a prepared group may still hold one: SGLang's code decides)
                return self._mamba.finalize_match_result_in_cache(params, result)
            kv.mamba_pool_idx = slot[0]
        kv.mamba_cow_src_index = torch.from_numpy(value)
        kv.mamba_needs_clear = False
        return result

    # -- insert ----------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.key`` (page-aligned) with ``params.value`` and the state
        ``params.mamba_value`` (on the last node), as SGLang's unified cache with a Mamba
        component inserts."""
        key = params.key
        _check_key(key, 0)
        aligned = len(key) - len(key) % self.page_size
        if params.value is None or params.mamba_value is None:
            raise ValueError("insert: a Mamba cache needs the KV slots and the state slot")
        if len(params.value) < aligned:
            raise ValueError(f"insert: {len(params.value)} values for {aligned} tokens")
        values = params.value[:aligned]
        values = (values.numpy() if type(values) is torch.Tensor else np.asarray(values))
        result, kept = self._insert_state(_token_array(key.token_ids, aligned),
                                          values.astype(np.int64), params.mamba_value,
                                          (key.extra_key, key.cache_salt), params.priority or 0,
                                          params.inserted_len or 0, params.prev_prefix_len)
        return InsertResult(prefix_len=result.prefix_len, last_device_node=result.last_node,
                            mamba_exist=kept)

    def _insert_state(self, tokens: np.ndarray, values: np.ndarray, state: Any, names: tuple,
                      priority: int, inserted_len: int, dup_from: int) -> tuple:
        """The hybrid core's insert, the duplicates freed; (core result, whether the last
        node had a state already, so the one given was not taken)."""
        extra_key, salt = names
        namespace = extra_key if salt is None else (extra_key, salt)
        if type(state) is not tuple and (type(state) is not np.ndarray
                                         or state.dtype != np.int64 or state.ndim != 1):
            state = (state.cpu().numpy() if type(state) is torch.Tensor
                     else np.asarray(state)).reshape(-1).astype(np.int64)
        core = self._core
        # The duplicates' page ids from the core, for SGLang's paged allocator (what its
        # free_segment frees of them).
        pages = dup_from < len(tokens) and self._frees_pages(self.token_to_kv_pool_allocator)
        result = core.insert(tokens, values, state, namespace,
                             priority if self._use_priority else 0, inserted_len, 0, dup_from,
                             False, pages)
        if self.kv_events.enabled and result.prefix_len < len(tokens):
            self._record_stored(result, tokens, values, names, None, None)
        if dup_from < result.prefix_len:
            if pages:
                self._free_pages(core.last_dup_pages)
            else:
                self._free(values[dup_from:result.prefix_len])
        return result, core.aux_kept or not len(tokens)

    # -- checkpoint and release -------------------------------------------------------------
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """SGLang's ``checkpoint_into_tree`` with the FULL and MAMBA components: the request's
        KV up to its tracked state (the end, without the extra buffer) goes into the tree
        with that state, its row points at the tree's slots and its lock moves to the node
        the insert ended on."""
        if type(up_to) is not int or up_to < 0:
            raise ValueError(f"checkpoint: up_to must be an int >= 0, got {up_to!r}")
        kv = req.kv
        is_finished = req.finished()
        fill_ids = req.full_untruncated_fill_ids
        token_len = min(up_to, len(fill_ids))
        plain = is_finished and self._plain_states
        if plain:
            params = None
            cache_len, state, keep = self._finished_state(req, token_len)
        else:
            params = InsertParams(prev_prefix_len=kv.cache_protected_len,
                                  inserted_len=kv.cache_inserted_len,
                                  priority=req.priority or 0)
            cache_len = self._mamba.prepare_for_caching_req(req=req, insert_params=params,
                                                            token_ids_len=token_len,
                                                            is_finished=is_finished)
            state = params.mamba_value
        cache_len = token_len if cache_len is None else min(token_len, cache_len)
        if cache_len <= 0:
            if plain:
                self._release_states(req, keep, inserted=False)
            else:
                self._mamba.cleanup_after_caching_req(req, is_finished=is_finished,
                                                      insert_params=params)
            return
        aligned = cache_len - cache_len % self.page_size
        table = self.req_to_token_pool.req_to_token
        rows = self._table_array(table)
        if rows is not None:
            values = rows[kv.req_pool_idx, :aligned].astype(np.int64)
        else:
            values = table[kv.req_pool_idx, :aligned].to(dtype=torch.int64).cpu().numpy()
        protected = kv.cache_protected_len
        result, kept = self._insert_state(_token_array(fill_ids, aligned), values, state,
                                          (req.extra_key, req.cache_salt or None),
                                          req.priority or 0, kv.cache_inserted_len, protected)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        new_last_node = result.last_node
        cached = result.prefix_len
        # The lock moves to the new node and the row's positions [protected, cached) are
        # read from its path in one core call (past them the row's slots are its own: the
        # insert took them).
        old_lock = req.lock
        if old_lock is None:
            old_node, release = None, 0
        else:
            old_node, receipt = old_lock.node, old_lock.receipt
            release = (_BOTH_LOCKS if receipt is _RECEIPT
                       else _lock_mask(receipt.skipped_lock_components))
        if protected >= cached:
            protected = cached = 0
        tree_slots = self._core.relock(old_node, new_last_node, release, self._checkpoint_mask,
                                       protected, cached)
        req.lock = TreeLock(new_last_node, self._checkpoint_receipt)
        if tree_slots is not None:
            if rows is not None and type(self.req_to_token_pool).write is _STOCK_ROW_WRITE:
                rows[kv.req_pool_idx, protected:cached] = tree_slots
            else:
                self._write_row(kv.req_pool_idx, protected, tree_slots)
        kv.cache_protected_len = aligned
        req.last_node = new_last_node
        if plain:
            self._release_states(req, keep, inserted=not kept)
            return
        self._mamba.cleanup_after_caching_req(
            req, is_finished=is_finished,
            insert_result=InsertResult(prefix_len=result.prefix_len,
                                       last_device_node=new_last_node, mamba_exist=kept),
            insert_params=params)

    def _finished_state(self, req: Any, token_len: int) -> tuple:
        """SGLang's ``MambaComponent.prepare_for_caching_req`` for a finished request (no
        int8 checkpoints, no replayed ring): (the length the state it gives is at, 0 for
        none; that state's slot, as the core takes it: its own slot, or with the extra
        buffer the tracked ping-pong slot whose length the key reaches; that slot's
        ping-pong index)."""
        kv = req.kv
        if not self.enable_mamba_extra_buffer:
            return token_len, _state_array(kv.mamba_pool_idx), None
        pool = self.req_to_token_pool
        keep = pool.get_mamba_ping_pong_keep_idx(req)
        cache_len = kv.mamba_last_track_seqlen or 0
        if cache_len > token_len:  # the latest state ran past the key: the one before it
            previous = kv.mamba_prev_track_seqlen
            if (pool.mamba_ping_pong_track_buffer_size != 2 or previous is None
                    or previous > token_len):
                return 0, None, None
            cache_len, keep = previous, pool.get_mamba_ping_pong_other_idx(keep)
        track = kv.mamba_ping_pong_track_buffer
        if track.is_cpu:  # (a CPU tensor's few slots read as a list in a fraction of the time)
            return cache_len, (track.tolist()[keep],), keep
        return cache_len, _state_array(track[keep]), keep

    def _release_states(self, req: Any, keep: Optional[int], inserted: bool) -> None:
        """SGLang's ``MambaComponent.cleanup_after_caching_req`` for a finished request (as
        ``_finished_state``): its state slots go back to the pool, but the one the tree
        took (ping-pong index ``keep``, with the extra buffer)."""
        pool = self.req_to_token_pool
        if self.enable_mamba_extra_buffer:
            keep = keep if inserted else None
            if not self._free_tracked_states(req, keep):
                pool.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep)
        elif not inserted:
            pool.free_mamba_cache(req)

    def _free_tracked_states(self, req: Any, keep: Optional[int]) -> bool:
        """SGLang's ``free_mamba_cache`` with the extra buffer, where the pools are SGLang's
        own CPU ones: the request's slot, then its ping-pong slots but ``keep``'s, go back
        in one free (the order SGLang's frees give them), and the request forgets them.
        False (nothing done) elsewhere: SGLang's code does it then."""
        pool = self.req_to_token_pool
        allocator = pool.mamba_allocator
        kv = req.kv
        index = kv.mamba_pool_idx
        if (allocator is not self._stock_state_allocator and not self._check_state_pools()
                or type(index) is not torch.Tensor or not index.is_cpu
                or index.dtype != torch.int64 or index.dim() != 0):
            return False
        size = pool.mamba_ping_pong_track_buffer_size
        if not (keep is None or keep == 0 or (keep == 1 and size == 2)):
            return False
        mapping = self._table_array(pool.req_index_to_mamba_ping_pong_track_buffer_mapping,
                                    1)
        if mapping is None:
            return False
        empty = kv.mamba_ping_pong_empty
        row = mapping[kv.req_pool_idx].tolist()
        slots = [index.item()]
        for position in range(size):
            if position != keep and not empty[position]:
                slots.append(row[position])
        kv.mamba_pool_idx = None
        kept = self._state_slots.get(len(slots))
        if kept is None:
            tensor = torch.empty(len(slots), dtype=torch.int64)
            kept = self._state_slots[len(slots)] = (tensor, tensor.numpy())
        kept[1][:] = slots
        allocator.free(kept[0])
        kv.mamba_ping_pong_track_buffer = None
        kv.mamba_ping_pong_empty = None
        kv.mamba_next_track_idx = None
        kv.mamba_last_track_idx = None
        kv.mamba_last_track_seqlen = None
        kv.mamba_prev_track_seqlen = None
        kv.mamba_cow_src_index = None
        kv.mamba_needs_clear = False
        return True

    def _check_state_pools(self) -> bool:
        """Whether the request pool and its Mamba allocator are SGLang's own (their frees
        as ``_free_tracked_states`` and ``_evict`` make them), the allocator remembered
        while it stays the same object."""
        pool = self.req_to_token_pool
        allocator = pool.mamba_allocator
        stock = (type(pool).free_mamba_cache is _STOCK_FREE_STATES
                 and pool.enable_mamba_extra_buffer
                 and type(allocator).free is _STOCK_STATE_FREE)
        self._stock_state_allocator = allocator if stock else None
        return stock

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """A request released without a checkpoint gives back its state slots."""
        if not checkpointed:
            self._mamba.cleanup_after_caching_req(req, is_finished=True)

    # -- evict -----------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` full-attention tokens (whole leaves, in policy order),
        then ``params.mamba_num`` states (least recently used first: a leaf leaves the tree,
        another node keeps its KV without a state)."""
        num_tokens, mamba_num = params.num_tokens, params.mamba_num
        if type(num_tokens) is not int or type(mamba_num) is not int:
            self._check_evict_params(params, ("mamba_num",))
        freed, states = self._evict(num_tokens, mamba_num)
        return EvictResult(num_tokens_evicted=freed, mamba_num_evicted=states)

    def _evict(self, num_tokens: int, mamba_num: int = 0) -> tuple:
        if not self.kv_events.enabled and self._frees_pages(self.token_to_kv_pool_allocator):
            # The core hands over the whole leaves' page ids and the states freed, each in
            # one array in eviction order: one free per pool, the same as SGLang's per-node
            # frees (its paged allocator frees a node's pages; its Mamba allocator is first
            # in, first out).
            if not self._evicting(num_tokens, mamba_num):
                return 0, 0
            freed, states, pages, lost = self._core.evict(max(num_tokens, 0),
                                                          max(mamba_num, 0), False, True)
            try:
                if len(pages):
                    self._free_pages(pages)
            finally:
                if len(lost):
                    self._free_states(lost)
            return freed, states
        freed, states, full, lost = self._evict_records(num_tokens, mamba_num)
        try:
            if full:  # (one free per pool: SGLang's per-node frees, in the same order)
                self._free(full[0] if len(full) == 1 else np.concatenate(full))
        finally:
            if lost:
                self._free_states(lost[0][1] if len(lost) == 1
                                  else np.concatenate([aux for _, aux in lost]))
        return freed, states

    def _free_states(self, slots: np.ndarray) -> None:
        """Give the state slots ``slots`` back (SGLang's ``MambaComponent._free_mamba_value``:
        to the Mamba allocator, where there is no int8 checkpoint pool)."""
        if self._plain_states:
            self.req_to_token_pool.mamba_allocator.free(torch.from_numpy(slots))
        else:
            self._mamba._free_mamba_value(torch.from_numpy(slots))

    # -- locks -----------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any, skip_lock_components: Any = ()) -> IncLockRefResult:
        skipped = tuple(skip_lock_components)
        delta = 0 if _FULL in skipped else self._core.lock(node, 1)
        if _MAMBA not in skipped:
            self._core.aux_lock(node, 1)
        return IncLockRefResult(delta=delta, node_id=node.id, skipped_lock_components=skipped)

    def lock(self, node: Any, skip_lock_components: Any = ()) -> TreeLock:
        """Lock ``node``'s path (full attention) and its state (the node alone)."""
        if not skip_lock_components:  # (the scheduler's lock: both)
            self._core.relock(None, node, 0, _BOTH_LOCKS)
            return TreeLock(node, _RECEIPT)
        skipped = tuple(skip_lock_components)
        self._core.relock(None, node, 0, _lock_mask(skipped))
        return TreeLock(node, _receipt(skipped))

    def unlock(self, lock: Optional[TreeLock]) -> None:
        if lock is not None:
            receipt = lock.receipt
            self._core.relock(lock.node, None, _BOTH_LOCKS if receipt is _RECEIPT
                              else _lock_mask(receipt.skipped_lock_components), 0)

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None,
                     skip_swa: bool = False) -> DecLockRefResult:
        skipped = () if params is None else params.skipped_lock_components
        if _MAMBA not in skipped:
            self._core.aux_lock(node, -1)
        if _FULL not in skipped:
            self._core.lock(node, -1)
        return DecLockRefResult()

    # -- sizes -----------------------------------------------------------------------------
    def mamba_evictable_size(self) -> int:
        return self._core.aux_evictable

    def mamba_protected_size(self) -> int:
        return self._core.aux_protected

    def __repr__(self) -> str:
        return "RadixcacheMambaBackend()"


__all__ = ["RadixcacheMambaBackend"]

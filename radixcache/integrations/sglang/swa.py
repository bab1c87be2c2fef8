"""``RadixcacheSWABackend``: the cache of a hybrid sliding-window model (SGLang's SWA pools).

A model with sliding-window layers beside its full-attention ones (GPT-OSS, Llama 4, Gemma 4,
MiMo-V2, Step3p5, DeepSeek-V4) keeps two KV pools: ``SWAKVPool`` with its allocator
``SWATokenToKVPoolAllocator``, which pairs each full-attention slot with a sliding-window slot
(``full_to_swa_index_mapping``). This backend keeps both in one radixcache hybrid core with a
window component (``radixcache._hybrid_py``): each node holds its full-attention slots and
its window slots; a node whose window slots were freed keeps its full-attention ones (a
tombstone); a match is accepted only where the last window is intact; locks on the window
are limited to it and released early on request; eviction frees whole leaves first, then
window slots alone (least recently used, making tombstones); an insert over a tombstone
gives it window slots again. It decides as SGLang's ``UnifiedRadixCache`` with its SWA
component does, call for call (see ``docs/sglang-backend.md``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
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
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

from .backend import _check_key, _token_array
from .hybrid import RadixcacheHybridBackend

_SWA = ComponentType.SWA


def _pools_read_in_numpy(allocator: Any) -> Optional[np.ndarray]:
    """The full-to-window slot mapping of a stock ``SWATokenToKVPoolAllocator`` over stock
    sub-allocators on the CPU, as a numpy view, when frees may be done with numpy: not in
    debug mode, no invariant checks (SGLang's own checks then run on no free either), no
    per-request ring; else None (frees go through the allocator's own methods)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.utils.invariants import InvariantCheckLevel, resolve_level

    if type(allocator) is not SWATokenToKVPoolAllocator or allocator.swa_req_ring:
        return None
    stock = TokenToKVPoolAllocator if allocator.page_size == 1 else PagedTokenToKVPoolAllocator
    for sub in (allocator.full_attn_allocator, allocator.swa_attn_allocator):
        if type(sub) is not stock or getattr(sub, "debug_mode", False):
            return None
    if resolve_level() > InvariantCheckLevel.OFF:
        return None
    mapping = allocator.full_to_swa_index_mapping
    if type(mapping) is not torch.Tensor or not mapping.is_cpu:
        return None
    return mapping.numpy()


class RadixcacheSWABackend(RadixcacheHybridBackend):
    """SGLang's ``BasePrefixCache`` for a hybrid sliding-window model, over a radixcache
    hybrid core with a window component.

    Built by ``create_backend`` for ``ctx.is_hybrid_swa``. Node handles are the core's
    nodes. The methods are SGLang's ``BasePrefixCache`` interface and behave as its
    ``UnifiedRadixCache`` with the FULL and SWA components does.

    Args:
        params: SGLang's ``CacheInitParams``; its allocator is a
            ``SWATokenToKVPoolAllocator`` and ``sliding_window_size`` is set.
        core: The radixcache core (``"c"``, ``"python"``); None: the class attribute
            ``core``, else radixcache's default.
    """

    def __init__(self, params: Any, *, core: Optional[str] = None) -> None:
        # The model's window, and the history the tree keeps (wider for a draft model).
        self.sliding_window_size = params.sliding_window_size
        self.draft_swa_window = params.draft_swa_window
        self.decoder_swa_bounded_replay = params.decoder_swa_bounded_replay
        # (the allocator, its full-to-window mapping as numpy or None): read again when the
        # allocator is replaced.
        self._mapping: tuple = (None, None)
        super().__init__(params, core=core, window=params.swa_retain_window)

    def supports_swa(self) -> bool:
        return True

    # -- match -----------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        found = self._match_key(params.key)
        if found is None:
            return self._empty_match
        match, walked = found
        # Full KV may reach past the last intact window: where a branch would start.
        branching = walked if walked > match.length else None
        node = match.last_node
        return MatchResult(device_prefix_len=match.length, last_device_node=node,
                           last_host_node=node, best_match_node=node,
                           swa_branching_seqlen=branching, full_kv_hit_length=walked)

    # -- insert ----------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.key`` (page-aligned) with ``params.value``, as SGLang's unified cache
        with an SWA component inserts (``params`` carries the request's SWA-freed prefix,
        ``prev_prefix_len`` and ``swa_branching_seqlen``)."""
        key = params.key
        _check_key(key, 0)
        aligned = len(key) - len(key) % self.page_size
        tokens = _token_array(key.token_ids, aligned)
        value = params.value
        if value is None:
            raise ValueError("insert: a hybrid sliding-window cache needs the KV slots")
        if len(value) < aligned:
            raise ValueError(f"insert: {len(value)} values for {aligned} page-aligned tokens")
        values = value[:aligned]
        values = values.numpy() if type(values) is torch.Tensor else np.asarray(values)
        values = values.astype(np.int64)
        result = self._insert_window(
            tokens, values, (key.extra_key, key.cache_salt), params.priority or 0,
            params.inserted_len or 0, params.get_evicted_seqlen(_SWA), params.prev_prefix_len)
        branching = params.swa_branching_seqlen
        return InsertResult(prefix_len=result.prefix_len, last_device_node=result.last_node,
                            swa_branch_inserted=(branching is not None
                                                 and len(key) >= branching))

    def _numpy_mapping(self) -> Optional[np.ndarray]:
        """``_pools_read_in_numpy`` of the allocator, kept while it stays the same object."""
        allocator = self.token_to_kv_pool_allocator
        known, mapping = self._mapping
        if allocator is not known:
            mapping = _pools_read_in_numpy(allocator)
            self._mapping = (allocator, mapping)
        return mapping

    def _window_slots(self, values: np.ndarray) -> np.ndarray:
        """The window slots SGLang's allocator pairs with full-attention ``values``."""
        mapping = self._numpy_mapping()
        if mapping is not None:
            return mapping[values]
        aux = self.token_to_kv_pool_allocator.translate_loc_from_full_to_swa(
            torch.from_numpy(values))
        return aux.cpu().numpy().astype(np.int64)

    def _release(self, full: list, window: list) -> None:
        """Free in SGLang's pools: the full-attention slots of ``full`` (int64 arrays of
        whole pages), then the window slots paired with those of ``window`` (clearing the
        pairs), one call per pool: what the allocator's ``free_full_segment`` /
        ``free_swa_segment`` of each array, in order, would free (with the allocator's
        ``need_sort``, in the same order)."""
        allocator = self.token_to_kv_pool_allocator
        mapping = self._numpy_mapping()
        if mapping is None:
            for values in full:
                allocator.full_attn_allocator.free_segment(torch.from_numpy(values), start_pos=0)
            for values in window:
                allocator.free_swa_segment(torch.from_numpy(values), start_pos=0)
            return
        page_size = self.page_size
        if full:
            slots = np.concatenate(full) if len(full) > 1 else full[0]
            if len(slots):
                allocator.full_attn_allocator.free_page_ids(
                    torch.from_numpy(slots[::page_size] // page_size))
        if window:
            slots = np.concatenate(window) if len(window) > 1 else window[0]
            if len(slots):
                pages = torch.from_numpy(mapping[slots[::page_size]] // page_size)
                mapping[slots] = 0
                if allocator.free_group is None:
                    allocator.swa_attn_allocator.free_page_ids(pages)
                else:  # in the scheduler's free group: freed at its end, as free_swa_segment's
                    allocator.swa_page_ids_group.append(pages)

    def _insert_window(self, tokens: np.ndarray, values: np.ndarray, names: tuple,
                       priority: int, inserted_len: int, live_from: int,
                       dup_from: int) -> Any:
        """The hybrid core's insert, then what SGLang's insert frees and remaps: recovered
        tombstones' slots, the duplicates (full-attention only below ``live_from``)."""
        allocator = self.token_to_kv_pool_allocator
        aux = self._window_slots(values)
        extra_key, salt = names
        namespace = extra_key if salt is None else (extra_key, salt)
        core = self._core
        result = core.insert(tokens, values, aux.astype(np.int64), namespace,
                             priority if self._use_priority else 0, inserted_len, live_from,
                             dup_from)
        recovered = core.last_recovered
        if recovered:
            self._path_memo.clear()  # recovered nodes may hold other slots now
        if self.kv_events.enabled:
            for start, end, slots, locked in recovered:
                if not locked:  # the pages are the node's, under the caller's slots now
                    self._rekey_pages(torch.from_numpy(slots),
                                      torch.from_numpy(values[start:end]))
            if result.prefix_len < len(tokens):
                self._record_stored(result, tokens, values, names, None, None)
        full, window = [], []
        start = dup_from
        for taken_start, taken_end, slots, locked in recovered:
            if locked:
                # The node keeps its slots, which take the caller's window slots.
                incoming = torch.from_numpy(values[taken_start:taken_end])
                allocator.clear_full_to_swa_mapping(incoming)
                allocator.set_full_to_swa_mapping(torch.from_numpy(slots),
                                                  torch.from_numpy(aux[taken_start:taken_end]))
                full.append(values[taken_start:taken_end])
            else:
                full.append(slots)
            # The caller's slots the tree already had, before this node.
            self._duplicates(values, start, min(taken_start, result.prefix_len), live_from,
                             full, window)
            start = max(start, taken_end)
        self._duplicates(values, start, result.prefix_len, live_from, full, window)
        self._release(full, window)
        return result

    @staticmethod
    def _duplicates(values: np.ndarray, start: int, end: int, live_from: int, full: list,
                    window: list) -> None:
        """``values[start:end]`` are duplicates: their full-attention slots go, and their
        window slots from ``live_from`` on (the caller freed those below it already)."""
        if start < end:
            full.append(values[start:end])
            cut = min(max(live_from, start), end)
            if cut < end:
                window.append(values[cut:end])

    def _rekey_pages(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """A recovered node's pages are held by other slots now: their event hashes too."""
        page_size = self.page_size
        for old_slot, new_slot in zip(old[::page_size].tolist(), new[::page_size].tolist()):
            entry = self._page_hashes.pop(old_slot, None)
            if entry is not None:
                self._page_hashes[new_slot] = entry

    # -- checkpoint and release -------------------------------------------------------------
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """SGLang's ``checkpoint_into_tree`` with the FULL and SWA components: the request's
        KV up to ``up_to`` (cut at its SWA branching point when one was matched) goes into
        the tree, its out-of-window SWA slots are freed, its row points at the tree's slots
        and its lock moves to the node the insert ended on."""
        if type(up_to) is not int or up_to < 0:
            raise ValueError(f"checkpoint: up_to must be an int >= 0, got {up_to!r}")
        kv = req.kv
        is_finished = req.finished()
        fill_ids = req.full_untruncated_fill_ids
        token_len = min(up_to, len(fill_ids))
        protected = kv.cache_protected_len
        live_from = kv.get_evicted_seqlen(_SWA)
        branching = req.swa_branching_seqlen
        cache_len = token_len
        inserting_branch = None
        if branching is not None and branching > protected and branching <= token_len:
            cache_len = branching
            inserting_branch = branching
        # (SGLang reads the switch only for a request that goes on.)
        free_window = (not is_finished
                       and envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get())
        if free_window:
            self._free_out_of_window(req, cache_len - 1)
            live_from = kv.get_evicted_seqlen(_SWA)
        if cache_len <= 0:
            return
        aligned = cache_len - cache_len % self.page_size
        table = self.req_to_token_pool.req_to_token
        rows = self._table_array(table)
        if rows is not None:
            values = rows[kv.req_pool_idx, :aligned].astype(np.int64)
        else:
            values = table[kv.req_pool_idx, :aligned].to(dtype=torch.int64).cpu().numpy()
        tokens = _token_array(fill_ids, aligned)
        names = (req.extra_key, req.cache_salt or None)
        result = self._insert_window(tokens, values, names, req.priority or 0,
                                     kv.cache_inserted_len, live_from, protected)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        new_last_node = result.last_node
        if protected < aligned:  # the row points at the tree's slots
            self._write_row(kv.req_pool_idx, protected,
                            self._core.path_indices(new_last_node, protected))
        self.unlock(req.lock)
        req.lock = self.lock(new_last_node)
        kv.cache_protected_len = aligned
        req.last_node = new_last_node
        if inserting_branch is not None and aligned >= inserting_branch:
            req.swa_branching_seqlen = None
            if free_window:
                self._free_out_of_window(req, len(req.get_fill_ids()) - 1)

    def _free_out_of_window(self, req: Any, pre_len: int) -> None:
        """SGLang's freeing of a running request's window slots behind its window."""
        free_swa_out_of_window_slots(
            req, pre_len, sliding_window_size=self.swa_retain_window, page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            retain_floor=self.swa_retain_floor(req))

    def free_kv_row(self, kv: Any, ranges: list) -> None:
        """SGLang's (``free_kv_row_segments``): every range's full-attention slots, and its
        window slots but in ``[swa_dead_lo, SWA-freed prefix)``, which the request gave back
        already."""
        table = self._table_array(self.req_to_token_pool.req_to_token)
        if table is None or self._numpy_mapping() is None:
            BasePrefixCache.free_kv_row(self, kv, ranges)
            return
        row = table[kv.req_pool_idx]
        dead_lo = kv.swa_dead_lo(self.page_size)
        dead_hi = max(kv.get_evicted_seqlen(_SWA), dead_lo)
        full, window = [], []
        for start, end in ranges:
            if end <= start:
                continue
            full.append(row[start:end])
            lo = min(max(dead_lo, start), end)
            hi = min(max(dead_hi, start), end)
            if lo < hi:  # the window slots of [lo, hi) are gone already
                if start < lo:
                    window.append(row[start:lo])
                if hi < end:
                    window.append(row[hi:end])
            else:
                window.append(row[start:end])
        self._release([values.astype(np.int64) for values in full],
                      [values.astype(np.int64) for values in window])

    # -- evict -----------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` full-attention tokens (whole leaves, in policy order),
        then ``params.swa_num_tokens`` window slots (least recently used first: a leaf leaves
        the tree, another node becomes a tombstone)."""
        self._check_evict_params(params, ("swa_num_tokens",))
        freed, aux_freed = self._evict(params.num_tokens, params.swa_num_tokens)
        return EvictResult(num_tokens_evicted=freed, swa_num_tokens_evicted=aux_freed)

    def _evict(self, num_tokens: int, swa_tokens: int = 0) -> tuple:
        freed, aux_freed, full, lost = self._evict_records(num_tokens, swa_tokens)
        # (a window slot is found through the full-attention slot it is paired with)
        self._release(full, [values for values, _aux in lost])
        return freed, aux_freed

    # -- locks -----------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        delta = self._core.lock(node, 1)
        mark = self._core.aux_lock(node, 1)
        result = IncLockRefResult(delta=delta, node_id=node.id)
        result.set_lock_uuid(_SWA, mark or None)
        return result

    def lock(self, node: Any) -> TreeLock:
        """Lock ``node``'s path (full attention) and its last window (SWA)."""
        core = self._core
        core.lock(node, 1)
        mark = core.aux_lock(node, 1)
        return TreeLock(node, DecLockRefParams(node_id=node.id,
                                               component_lock_uuids={_SWA: mark or None}))

    def unlock(self, lock: Optional[TreeLock]) -> None:
        if lock is not None:
            self.dec_lock_ref(lock.node, lock.receipt, skip_swa=lock.swa_released)

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None,
                     skip_swa: bool = False) -> DecLockRefResult:
        if params is None:
            raise ValueError("dec_lock_ref needs the receipt inc_lock_ref returned")
        if node is not self.root_node and not skip_swa:
            self._core.aux_lock(node, -1, params.get_lock_uuid(_SWA) or 0)
        self._core.lock(node, -1)
        return DecLockRefResult()

    def release_swa(self, lock: Optional[TreeLock]) -> None:
        """Release the SWA part of ``lock`` early, once."""
        if lock is None or lock.swa_released:
            return
        if lock.node is not self.root_node:
            mark = lock.receipt.get_lock_uuid(_SWA) or 0
            records = self._core.aux_release(lock.node, mark)
            self._release([], [values for values, _aux, _whole in records])
        lock.swa_released = True

    def release_swa_prefix_lock(self, req: Any) -> None:
        """The request's window has moved past its prefix: leave the prefix's SWA
        evictable."""
        lock = req.lock
        if lock is not None and lock.receipt.component_lock_uuids.get(_SWA) is not None:
            self.release_swa(lock)

    # -- sizes -----------------------------------------------------------------------------
    def swa_evictable_size(self) -> int:
        return self._core.aux_evictable

    def swa_protected_size(self) -> int:
        return self._core.aux_protected

    def __repr__(self) -> str:
        return f"RadixcacheSWABackend(window={self._core.window})"


__all__ = ["RadixcacheSWABackend"]

"""What the caches of hybrid models share: ``RadixcacheHybridBackend``, over a radixcache
hybrid core (``radixcache._hybrid_py``'s docstring specifies it).

SGLang's unified radix cache serves a hybrid model with a component beside the
full-attention one (SWA: ``swa.py``; Mamba: ``mamba.py``); here the hybrid core holds that
component's slots in its nodes. This base holds what does not depend on the component: the
core, the root, sizes, the path of a node, ``touch_prefix``, the match of a key, reset and
events, and the plain backend's helpers (``backend.py``) that read nodes.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchResult
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from ..._core import get_hybrid
from .backend import RadixcacheBackend, _check_key, _namespace, _token_array
from .sessions import SessionRefs

#: How many match paths ``prefix_device_indices`` keeps (cleared when it is full).
_PATH_MEMO_SIZE = 4096


def _tensor(values: Any) -> torch.Tensor:
    """An index array the hybrid core made (numpy, its own memory) as a CPU tensor."""
    return torch.from_numpy(values) if type(values) is np.ndarray else values


class RadixcacheHybridBackend(RadixcacheBackend):
    """The part of a hybrid model's cache that does not depend on its component (see the
    module docstring); ``RadixcacheSWABackend`` and ``RadixcacheMambaBackend`` are the
    caches SGLang gets.

    Args:
        params: SGLang's ``CacheInitParams``.
        core: The radixcache core (``"c"``, ``"python"``); None: the class attribute
            ``core``, else radixcache's default.
        component: The hybrid core's component: ``window=N`` or ``state=True``.
    """

    def __init__(self, params: Any, *, core: Optional[str] = None, **component: Any) -> None:
        self._init_common(params)
        # Plain keys, no session references: the factory refuses EAGLE and the session radix
        # cache for hybrid models (SGLang turns EAGLE off itself for a Mamba model). Session
        # generations are still handed out, as SGLang's cache does without the flag.
        self.is_eagle = False
        self._bigram = 0
        self.enable_session_radix_cache = False
        self._sessions = SessionRefs(None, False)
        hybrid = get_hybrid(core if core is not None else self.core)
        self._core = hybrid.HybridCore(self.page_size, self.eviction_policy,
                                       numpy_arrays=True, **component)
        self.reset()

    # -- identity and configuration ------------------------------------------------------------
    @property
    def root_node(self) -> Any:
        return self._core.tree.root

    @property
    def radix_cache(self) -> Any:
        """The radixcache hybrid core underneath (read it; change it through this class)."""
        return self._core

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self._core.tree.root

    def reset(self) -> None:
        """Drop the tree. Its slots are not freed: SGLang clears the allocator itself."""
        self._core.reset()
        self._sessions.reset()
        root = self._core.tree.root
        self._empty_match = MatchResult(device_prefix_len=0, last_device_node=root,
                                        last_host_node=root, best_match_node=root)
        self._page_hashes.clear()
        self._pending_frees.clear()
        self._path_memo.clear()
        self.kv_events.record_all_cleared()

    # -- match -----------------------------------------------------------------------------
    def _match_key(self, key: Any) -> Optional[tuple]:
        """The core's match of ``key`` (its limit honoured), remembering the accepted path:
        (MatchResult of the core, tokens the walk matched); None when the key is shorter
        than a page."""
        if type(key) is not RadixKey or key.is_bigram:
            _check_key(key, 0)
        token_ids = key.token_ids
        length = len(token_ids)
        limit = key.limit
        if limit is not None and limit < length:
            length = limit
        if length < self.page_size:
            return None
        core = self._core
        match = core.match(_token_array(token_ids, length), _namespace(key))
        if match.length:
            memo = self._path_memo
            if len(memo) >= _PATH_MEMO_SIZE:
                memo.clear()
            memo[match.last_node] = _tensor(match.indices)
        return match, core.last_walk

    def touch_prefix(self, key: RadixKey) -> None:
        """Refresh the recency of ``key``'s cached path, as a match does."""
        _check_key(key, 0)
        length = len(key)
        if length >= self.page_size:
            self._core.match(_token_array(key.token_ids, length), _namespace(key))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        memoized = self._path_memo.get(node)
        if memoized is not None:
            return memoized
        if node is self._core.tree.root:  # (a miss: most of a hybrid model's matches)
            return self._empty_indices
        try:
            return torch.from_numpy(self._core.path_indices(node))
        except (TypeError, ValueError):
            raise ValueError("path_device_indices: the node is not in this cache (evicted, "
                             "or from another cache)") from None

    # -- request rows ----------------------------------------------------------------------
    def _write_row(self, row: int, start: int, values: np.ndarray) -> None:
        """Write ``values`` into request row ``row`` from position ``start``: into the
        table's numpy view where the pool's ``write`` is SGLang's plain one, else through
        it."""
        pool = self.req_to_token_pool
        if type(pool).write is ReqToTokenPool.write:
            rows = self._table_array(pool.req_to_token)
            if rows is not None:
                rows[row, start:start + len(values)] = values
                return
        pool.write((row, slice(start, start + len(values))), torch.from_numpy(values))

    # -- evict -----------------------------------------------------------------------------
    def evict_for_alloc(self, params: EvictParams, *,
                        allocation_reclaim_satisfied: Any = None) -> EvictResult:
        """Evict for an allocation: until the pools have the numbers of ``params`` more free
        (each pool gains exactly what is freed in it, so this is ``evict``)."""
        if allocation_reclaim_satisfied is not None:
            raise NotImplementedError("the radixcache backend does not support joint reclaim")
        return self.evict(params)

    def _evicting(self, num_tokens: int, aux_num: int) -> bool:
        """What comes before an eviction: the frees an allocator refused, retried; whether
        anything is to be evicted (then the remembered match paths are forgotten)."""
        if self._pending_frees:
            self._retry_pending_frees()
        if num_tokens <= 0 and aux_num <= 0:
            return False
        self._path_memo.clear()
        return True

    def _evict_records(self, num_tokens: int, aux_num: int) -> tuple:
        """The core's eviction of ``num_tokens`` full-attention tokens, then ``aux_num`` of
        the component's (window tokens, states), with the leaves' BlockRemoved recorded:
        (tokens freed, component freed, the whole leaves' full-attention slots, and
        (full-attention slots, component slots) of each node whose component went), in
        eviction order. Freeing them in the pools is the caller's."""
        if not self._evicting(num_tokens, aux_num):
            return 0, 0, [], []
        freed, aux_freed, records = self._core.evict(max(num_tokens, 0), max(aux_num, 0))
        events = self.kv_events.enabled
        full, lost = [], []
        for values, aux, whole in records:
            if whole:
                if events:
                    self._record_removed(torch.from_numpy(values))
                full.append(values)
            if aux is not None:
                lost.append((values, aux))
        return freed, aux_freed, full, lost

    def _check_evict_params(self, params: EvictParams, names: tuple) -> None:
        for name in ("num_tokens",) + names:
            value = getattr(params, name)
            if type(value) is not int:
                raise TypeError(f"EvictParams.{name} must be an int, got {type(value).__name__}")

    # -- sizes -----------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._core.evictable

    def full_evictable_size(self) -> int:
        return self._core.evictable

    def protected_size(self) -> int:
        return self._core.protected

    def full_protected_size(self) -> int:
        return self._core.protected

    def total_size(self) -> tuple:
        """(full-attention tokens, the component's slots) cached."""
        return self._core.total_size()

    def all_values_flatten(self) -> torch.Tensor:
        values = [node.value for node in self._nodes()]
        return torch.from_numpy(np.concatenate(values)) if values else self._empty_indices

    def sanity_check(self) -> None:
        """Raise AssertionError if the sizes disagree with the tree."""
        self._core.check_aux()
        total = sum(node.num_tokens for node in self._nodes())
        assert total == self._core.total_size()[0], (total, self._core.total_size())

    def pretty_print(self) -> None:
        for node, depth in self._core.tree.iter_nodes():
            if node is not self.root_node:
                aux = node.aux_value
                print(f"{'  ' * (depth - 1)}{node.num_tokens} {node.key[:10].tolist()} "
                      f"lock={node.lock_ref}/{node.aux_lock_ref} "
                      f"{'-' if aux is None else aux[:4].tolist()}")


__all__ = ["RadixcacheHybridBackend"]

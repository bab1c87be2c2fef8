"""``RadixcacheBackend``: SGLang's ``BasePrefixCache`` over a ``radixcache.RadixCache``.

It serves the whole contract SGLang's scheduler uses for a full-attention model --
``match_prefix``, ``insert``, ``checkpoint`` and the release path, ``evict`` /
``evict_for_alloc``, locks, sizes, ``path_device_indices``, ``prefix_device_indices``,
``touch_prefix``, ``dfs_weight_order``, ``reset``, KV events, EAGLE's bigram keys (``.eagle``)
and the session radix cache's calls (``.sessions``) -- and decides as SGLang's default
cache does (the same matches, the same slots written to request rows, the same slots freed to
the allocator, the same events), except where a match or insert ends inside a node: there only
the matched part counts as used (see ``docs/sglang.md``).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import Any, Optional, Sequence

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
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
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str

from ...cache import RadixCache
from .eagle import bigram_namespace, event_key
from .sessions import SessionRefs

_INT64_MAX = 2**63 - 1
_INT64 = np.dtype(np.int64)
_PATH_MEMO_SIZE = 4096
#: The release receipt of every lock: radixcache's locks are plain counts, with nothing to
#: replay (SGLang's scheduler reads receipts of SWA caches only).
_RECEIPT = DecLockRefParams()


# -- helpers -----------------------------------------------------------------------------------
def _namespace(key: RadixKey) -> Any:
    """The radixcache ``extra_key`` of a RadixKey: its extra_key, and its cache salt with it
    when there is one (a tuple, which no str extra_key equals)."""
    salt = key.cache_salt
    return key.extra_key if salt is None else (key.extra_key, salt)


def _token_array(token_ids: Any, length: int, start: int = 0) -> np.ndarray:
    """Token ids ``start`` (0 or 1: a bigram cache's tree tokens start one in) up to
    ``length`` as an int64 array, without a copy for array('q').

    The view holds the array's buffer until it is dropped (an array('q') cannot grow while
    exported), so it must not outlive the call it is made for."""
    if type(token_ids) is array and token_ids.typecode == "q":
        if length <= start:
            return np.empty(0, dtype=np.int64)
        if length > len(token_ids):
            raise ValueError(f"{length} token ids wanted, {len(token_ids)} given")
        # (the whole buffer, then a slice: a fraction of frombuffer's time with count/offset)
        return np.frombuffer(token_ids, _INT64)[start:length]
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got {tokens.ndim}-D")
    if len(tokens) < length:
        raise ValueError(f"{length} token ids wanted, {len(tokens)} given")
    return tokens[start:length]


# What the backend knows of an allocator (``RadixcacheBackend._allocator_kind``).
_OTHER_ALLOCATOR = 0
#: SGLang's stock page-1 allocator: a free raises ``available_size`` by exactly the tokens it
#: hands back (outside a free group).
_TOKEN_ALLOCATOR = 1
#: SGLang's stock paged allocator, of the cache's page size: the same, and its
#: ``free_segment(slots, start_pos=p)`` is, after its checks, ``free_page_ids`` of the page of
#: every ``page_size``-th slot.
_PAGED_ALLOCATOR = 2


def _allocator_kind(allocator: Any, page_size: int) -> int:
    """``allocator``'s kind: ``_TOKEN_ALLOCATOR``, ``_PAGED_ALLOCATOR`` or
    ``_OTHER_ALLOCATOR`` (subclasses included: they may change any of it)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    kind = type(allocator)
    if kind is TokenToKVPoolAllocator and page_size == 1:
        return _TOKEN_ALLOCATOR
    if kind is PagedTokenToKVPoolAllocator and allocator.page_size == page_size:
        return _PAGED_ALLOCATOR
    return _OTHER_ALLOCATOR


def _cpu_array(tensor: Any) -> Optional[np.ndarray]:
    """A plain CPU tensor's numpy view (sharing its memory), else None. numpy reads and
    slices a few hundred slots in a fraction of the time torch's indexing takes."""
    if type(tensor) is torch.Tensor and tensor.is_cpu:
        try:
            return tensor.numpy()
        except (RuntimeError, TypeError):  # a negative-bit view, a dtype numpy lacks...
            return None
    return None


def _check_key(key: Any, bigram: int) -> None:
    """Raise for a key the backend cannot read (the checks behind the fast type test): not
    a RadixKey, or a bigram key given to a cache of plain keys."""
    if not isinstance(key, RadixKey):
        raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
    if key.is_bigram and not bigram:
        raise ValueError("a bigram (EAGLE) RadixKey given to a cache built without EAGLE "
                         "(CacheInitParams.is_eagle)")


def _raw_length(key: RadixKey) -> int:
    """The raw tokens a key spans (its ``limit`` honoured)."""
    length = len(key.token_ids)
    limit = key.limit
    return limit if limit is not None and limit < length else length


class _EventNode:
    """The shape of a tree node that SGLang's ``KVCacheEventRecorder`` reads."""

    __slots__ = ("key", "parent", "hash_value", "event_hash_value")

    def __init__(self, key: Any, parent: Any, hashes: list) -> None:
        self.key = key
        self.parent = parent
        self.hash_value = hashes
        self.event_hash_value = hashes


_NOT_ROOT = object()  # an event node's parent that is not the root (its own parent is set)


# -- the cache ---------------------------------------------------------------------------------
class RadixcacheBackend(BasePrefixCache):
    """SGLang's ``BasePrefixCache`` over a ``radixcache.RadixCache``.

    Node handles (``MatchResult.last_device_node``, ``req.last_node``) are radixcache
    ``RadixTreeNode`` objects. Built by ``create_backend``; direct construction skips the
    start-up checks. The methods are SGLang's ``BasePrefixCache`` interface and behave as
    SGLang's default cache's do (see ``docs/sglang-backend.md``).

    Args:
        params: SGLang's ``CacheInitParams``: the request-to-token pool, the token-to-KV
            allocator (slots are freed through its ``free_segment``/``free_segments``; SGLang's
            stock paged allocator's whole pages through ``free_page_ids``, which is what its
            ``free_segment`` calls), the page size, the eviction policy, events
            (``enable_kv_cache_events``, ``dynamo_kv_event_format``, ``kv_event_lora_names``),
            ``enable_metrics``, ``is_eagle`` (bigram keys) and
            ``enable_session_radix_cache``.
        core: The radixcache tree core (``"c"``, ``"python"``); None: the class attribute
            ``core``, else radixcache's default.

    Raises:
        ValueError: an eviction policy radixcache does not know.
    """

    #: The tree core new instances use (``"c"``, ``"python"``; None: radixcache's default).
    core: Optional[str] = None
    #: No sliding-window layers (SGLang's budget code reads this of every cache).
    sliding_window_size: Optional[int] = None

    def __init__(self, params: Any, *, core: Optional[str] = None) -> None:
        self._init_common(params)
        # EAGLE's bigram keys (the model has no Mamba component: the factory refuses those).
        self.is_eagle = bool(params.is_eagle)
        # 1 with bigram keys: the tree's tokens start one raw token in (see .eagle).
        self._bigram = 1 if self.is_eagle else 0
        self._cache = self._new_tree(core if core is not None else self.core)
        # --enable-session-radix-cache: SGLang's registry reads this attribute of every cache.
        self.enable_session_radix_cache = bool(params.enable_session_radix_cache)
        self._sessions = SessionRefs(self._cache, self.enable_session_radix_cache)
        self.reset()

    def _init_common(self, params: Any) -> None:
        """What every radixcache cache of SGLang's keeps beside its tree: the pools, the page
        size, the policy, the event recorder, metrics, the device and the bookkeeping below."""
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = False
        self.eviction_policy = params.eviction_policy.lower()
        # SGLang orders by priority under the priority policy only; radixcache under every
        # policy. Priorities given to the others are dropped, so both orders agree.
        self._use_priority = self.eviction_policy == "priority"
        self.kv_events = KVCacheEventRecorder(
            enabled=params.enable_kv_cache_events, page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format,
            lora_names=params.kv_event_lora_names)
        if params.enable_metrics:
            self.init_metrics_collector()
        allocator = self.token_to_kv_pool_allocator
        device = getattr(allocator, "device", "cpu") if allocator is not None else "cpu"
        self.device = torch.device(device if isinstance(device, (str, torch.device)) else "cpu")
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        # Event hashes: the first slot of every cached page -> (its SGLang event hash, the
        # node's extra_key, cache_salt). Only with events on.
        self._page_hashes: dict[int, tuple] = {}
        # Slots an allocator refused to take back; given again before the next free.
        self._pending_frees: list[torch.Tensor] = []
        # The path indices of recent matches by end node, for prefix_device_indices: a path's
        # slots never change while its end node is cached, so this lives until an eviction.
        self._path_memo: dict = {}
        # (the allocator, its _allocator_kind): read again when the allocator is replaced
        self._known_allocator: tuple = (None, _OTHER_ALLOCATOR)
        # (a pool's table, its numpy view) of _table_array, per table kind
        self._known_tables: list = [(None, None), (None, None)]
        # One page id handed to SGLang's paged allocator, which copies it at once (see
        # _free_one_page), and its numpy view.
        self._one_page = torch.empty(1, dtype=torch.int64)
        self._one_page_id = self._one_page.numpy()

    #: Whether an insert without events may go straight to the tree (a subclass that follows
    #: every insert sets it False: ``_insert`` then sees them all).
    _plain_inserts = True

    def _new_tree(self, core: Optional[str]) -> RadixCache:
        """The radixcache tree under this cache (a subclass adds a host tier)."""
        return RadixCache(self.page_size, self.eviction_policy, core=core)

    # -- identity and configuration ------------------------------------------------------------
    @property
    def root_node(self) -> Any:
        return self._cache.root_node

    @property
    def radix_cache(self) -> RadixCache:
        """The ``radixcache.RadixCache`` underneath (read it; change it through this class)."""
        return self._cache

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self._cache.root_node

    def resolve_node_handle(self, node_handle: Any) -> Any:
        return node_handle

    def supports_prefix_sharing(self) -> bool:
        return True

    def supports_fast_match_prefix(self) -> bool:
        return False

    def supports_swa(self) -> bool:
        return False

    def supports_auxiliary_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    # -- reset -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the tree. Its slots are not freed: SGLang clears the allocator itself."""
        self._cache.reset()
        root = self._cache.root_node
        self._empty_match = MatchResult(device_prefix_len=0, last_device_node=root,
                                        last_host_node=root, best_match_node=root)
        self._page_hashes.clear()
        self._pending_frees.clear()
        self._path_memo.clear()
        self._sessions.reset()
        self.kv_events.record_all_cleared()

    # -- match -----------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if type(key) is not RadixKey or key.is_bigram:
            _check_key(key, self._bigram)
        token_ids = key.token_ids
        length = len(token_ids)
        limit = key.limit
        if limit is not None and limit < length:
            length = limit
        shift = self._bigram  # a bigram cache: the common raw prefix less one, in pages
        if length - shift < self.page_size:
            return self._empty_match
        salt = key.cache_salt
        tokens = _token_array(token_ids, length, shift)
        if shift:
            match = self._cache.match_prefix(
                tokens, bigram_namespace(key.extra_key, salt, int(token_ids[0])))
        else:
            match = self._cache.match_prefix(
                tokens, key.extra_key if salt is None else (key.extra_key, salt))
        del tokens
        return self._match_result(match)

    def _match_result(self, match: Any) -> MatchResult:
        """SGLang's ``MatchResult`` of a radixcache match (its indices memoized)."""
        if not match.length:
            return self._empty_match
        node = match.last_node
        self._memoize(node, match.indices)
        return MatchResult(match.length, node, node, node)

    def _memoize(self, node: Any, indices: Any) -> None:
        """``node``'s path indices, kept for ``prefix_device_indices``."""
        memo = self._path_memo
        if len(memo) >= _PATH_MEMO_SIZE:
            memo.clear()
        memo[node] = indices

    def _tree_key(self, key: RadixKey, length: int) -> tuple:
        """(the tree's tokens, namespace) of ``key``'s first ``length`` tree tokens (bigrams
        in a bigram cache)."""
        shift = self._bigram
        tokens = _token_array(key.token_ids, length + shift, shift)
        if not shift:
            return tokens, _namespace(key)
        return tokens, bigram_namespace(key.extra_key, key.cache_salt, int(key.token_ids[0]))

    def touch_prefix(self, key: RadixKey) -> None:
        """Refresh the recency of ``key``'s cached path, as a match does."""
        _check_key(key, self._bigram)
        length = _raw_length(key) - self._bigram
        if length >= self.page_size:
            self._cache.match_prefix(*self._tree_key(key, length))

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        """The KV slots of ``req``'s matched prefix (the path to its locked match node)."""
        path = self._path_memo.get(req.last_node)
        if path is None:
            path = self.path_device_indices(req.last_node)
        length, wanted = path.shape[0], req.prefix_len
        if length == wanted:
            return path
        if length < wanted:
            raise ValueError(f"request {req.rid}: prefix_len {wanted} is longer than its "
                             f"match node's path ({length} tokens)")
        return path[:wanted]

    def path_device_indices(self, node: Any) -> torch.Tensor:
        memoized = self._path_memo.get(node)
        if memoized is not None:
            return memoized
        values = []
        root = self.root_node
        while node is not root:
            value = None if node is None or node.evicted else node.value
            if value is None:
                raise ValueError("path_device_indices: the node is not in this cache "
                                 "(evicted, only on the host, or from another cache)")
            values.append(value)
            node = node.parent
        if not values:
            return self._empty_indices
        if len(values) == 1:
            return values[0]
        values.reverse()
        return torch.cat(values)

    # -- insert ----------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.key`` (page-aligned) with ``params.value``; the slots of
        ``value[prev_prefix_len:prefix_len]`` duplicate cached ones and go back to the
        allocator, as SGLang's own cache frees them. Only the nodes that end past
        ``params.inserted_len`` count a hit (SGLang counts one per request)."""
        key = params.key
        _check_key(key, self._bigram)
        length = max(_raw_length(key) - self._bigram, 0)
        aligned = length - length % self.page_size
        tokens, namespace = self._tree_key(key, aligned) if aligned else (
            np.empty(0, dtype=np.int64), _namespace(key))
        value = params.value
        if value is None:  # the raw tokens as the values, as SGLang's insert takes them
            value = torch.from_numpy(np.array(_token_array(key.token_ids, aligned)))
        elif len(value) < aligned:
            raise ValueError(f"insert: {len(value)} values for {aligned} page-aligned tokens")
        priority = params.priority or 0
        result = self._insert(tokens, value[:aligned], namespace, priority,
                              (key.extra_key, key.cache_salt), params.inserted_len or 0,
                              params.session_id,
                              int(key.token_ids[0]) if self._bigram and aligned else None)
        self._free_duplicates(value, params.prev_prefix_len, result.prefix_len)
        return InsertResult(prefix_len=result.prefix_len, last_device_node=result.last_node)

    def _insert(self, tokens: np.ndarray, value: Any, namespace: Any, priority: int,
                names: tuple, hits_from: int, session_id: Optional[str] = None,
                before: Optional[int] = None) -> Any:
        """radixcache's insert (hits counted past ``hits_from`` tokens); with events on, the
        new leaf's BlockStored (``names``: the key's extra_key and cache_salt; ``session_id``
        the request's; ``before``: a bigram cache's first raw token)."""
        if not self._use_priority:
            priority = 0
        result = self._cache.insert(tokens, value, namespace, priority, hits_from=hits_from)
        if self.kv_events.enabled and result.prefix_len < len(tokens):
            self._record_stored(result, tokens, value, names, session_id, before)
        return result

    def _split_at(self, tokens: np.ndarray, namespace: Any, priority: int) -> Any:
        """Insert ``tokens``, cached already: splits the node they end inside, stamps the
        path and raises priorities, counts no hit."""
        return self._cache.insert(tokens, None, namespace, priority, hits_from=len(tokens))

    def _free_duplicates(self, value: Any, start: int, end: int) -> None:
        """Free ``value[start:end]`` (``value``: a tensor, or a numpy array of int64)."""
        if start < end:
            self._free(value[start:end])

    # -- checkpoint and release -------------------------------------------------------------
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert ``req``'s KV up to row position ``up_to``, point its row at the tree's
        slots, move its lock to the node the insert ended on and advance
        ``req.kv.cache_protected_len`` (SGLang's ``checkpoint_into_tree`` for a
        full-attention cache)."""
        if type(up_to) is not int or up_to < 0:
            raise ValueError(f"checkpoint: up_to must be an int >= 0, got {up_to!r}")
        if up_to == 0:
            return
        kv = req.kv
        fill_ids = req.full_untruncated_fill_ids
        if len(fill_ids) < up_to:
            raise ValueError(f"checkpoint: up_to={up_to} but request {req.rid} has "
                             f"{len(fill_ids)} token ids")
        protected = kv.cache_protected_len
        shift = self._bigram  # 1: bigram keys, one fewer than the raw tokens
        length = up_to - shift
        aligned = length - length % self.page_size
        extra_key, salt = req.extra_key, req.cache_salt or None
        namespace = extra_key if salt is None else (extra_key, salt)
        tokens = _token_array(fill_ids, aligned + shift, shift)
        before = None
        if shift:
            before = int(fill_ids[0])
            namespace = bigram_namespace(extra_key, salt, before)
        table = self.req_to_token_pool.req_to_token
        rows = self._table_array(table)
        if rows is not None:
            # A numpy copy: read and handed to the tree core faster than a tensor.
            values = rows[kv.req_pool_idx, :aligned].astype(np.int64)
        else:
            values = table[kv.req_pool_idx, :aligned].to(dtype=torch.int64, copy=True)
        priority = req.priority or 0
        use_priority = self._use_priority
        # Split the leaf at the prompt boundary so eviction can drop the answer before the
        # prompt, the prompt one priority up (SGLang does the same): once the sequence is
        # cached, the prompt is inserted again, which only splits, stamps and raises
        # priorities (no hits).
        prompt_len = len(req.origin_input_ids) - shift
        prompt_len -= prompt_len % self.page_size
        split = 0 < prompt_len < aligned
        prompt_priority = min(priority + 1, _INT64_MAX) if use_priority else 0
        # A node counts one hit per request: those this request inserted before counted then.
        if self.kv_events.enabled or not self._plain_inserts:
            result = self._insert(tokens, values, namespace, priority, (extra_key, salt),
                                  kv.cache_inserted_len, req.session_id, before)
            if split:
                self._split_at(tokens[:prompt_len], namespace, prompt_priority)
        else:  # both inserts in one call
            result = self._cache.insert(tokens, values, namespace,
                                        priority if use_priority else 0,
                                        hits_from=kv.cache_inserted_len,
                                        split_at=prompt_len if split else None,
                                        split_priority=prompt_priority)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        del tokens
        new_last_node = result.last_node
        # The lock moves and the session tag goes on while the insert's path is still in
        # the processor's cache (the frees and the row write below touch much else).
        cache = self._cache
        errors = []  # the frees and the row write run whatever fails before them; then raised
        try:
            old_lock = req.lock
            if old_lock is not None:
                cache.dec_lock_ref(old_lock.node)
            cache.inc_lock_ref(new_last_node)
            req.lock = TreeLock(new_last_node, _RECEIPT)
            kv.cache_protected_len = aligned
            req.last_node = new_last_node
            if (self.enable_session_radix_cache and req.finished()
                    and not isinstance(req.finished_reason, FINISH_ABORT)):
                self._sessions.register(req, new_last_node)
        except Exception as exc:
            errors.append(exc)
        try:
            self._free_duplicates(values, protected, result.prefix_len)
        except Exception as exc:
            errors.append(exc)
        if protected < result.prefix_len:
            tree_slots = self.path_device_indices(new_last_node)
            self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, result.prefix_len)),
                                         tree_slots[protected:result.prefix_len])
        if errors:
            raise errors[0]

    # -- evict -----------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Free unlocked leaves in policy order until ``params.num_tokens`` are freed."""
        num_tokens = params.num_tokens
        if type(num_tokens) is not int:
            raise TypeError(f"EvictParams.num_tokens must be an int, got "
                            f"{type(num_tokens).__name__}")
        return EvictResult(num_tokens_evicted=self._evict(num_tokens))

    def _evict(self, num_tokens: int) -> int:
        """``evict`` for an int: the tokens freed."""
        if self._pending_frees:
            self._retry_pending_frees()
        if num_tokens <= 0:
            return 0
        collector = self.metrics_collector
        start_time = time.perf_counter() if collector is not None else 0.0
        self._path_memo.clear()
        freed = 0
        try:
            freed = self._evict_victims(num_tokens)
        finally:
            if collector is not None:
                self.update_eviction_metrics(freed, start_time)
        return freed

    def _evict_victims(self, num_tokens: int) -> int:
        """The eviction itself (``_evict`` without its bookkeeping): the tokens freed."""
        if self.kv_events.enabled:
            return self._cache.evict(num_tokens, self._free_victim)
        # One free for all victims: the same slots, in the same order, as one free per
        # victim would give the allocator. SGLang's paged allocator frees them as the page
        # ids of every page_size-th slot (free_segment): the core computes those.
        allocator = self.token_to_kv_pool_allocator
        if self._frees_pages(allocator):
            return self._cache.evict(num_tokens, self._free_pages, batch=True, page_ids=True)
        return self._cache.evict(num_tokens, self._free, batch=True)

    def evict_for_alloc(self, params: EvictParams, *,
                        allocation_reclaim_satisfied: Any = None) -> EvictResult:
        """Evict for an allocation: until the allocator has ``params.num_tokens`` more free
        tokens than now (what SGLang's own cache does for a full-attention pool)."""
        if allocation_reclaim_satisfied is not None:
            raise NotImplementedError("the radixcache backend does not support joint reclaim")
        num_tokens = params.num_tokens
        if type(num_tokens) is not int:
            raise TypeError(f"EvictParams.num_tokens must be an int, got "
                            f"{type(num_tokens).__name__}")
        allocator = self.token_to_kv_pool_allocator
        if (self._allocator_kind(allocator) and allocator.free_group is None
                and not self._pending_frees):
            # The capacity rises by exactly the tokens freed: short of the target only when
            # the eviction freed fewer than asked (and then another pass may find more).
            freed = self._evict(num_tokens)
            while freed and freed < num_tokens and self._cache.evictable_size():
                more = self._evict(num_tokens - freed)
                if not more:
                    break
                freed += more
            return EvictResult(num_tokens_evicted=freed)
        target = allocator.available_size() + num_tokens
        freed = self._evict(num_tokens)
        # An allocator whose capacity rises by less than the tokens freed: go on to the target.
        while (freed and allocator.available_size() < target
               and self._cache.evictable_size()):
            more = self._evict(target - allocator.available_size())
            if not more:
                break
            freed += more
        return EvictResult(num_tokens_evicted=freed)

    def _table_array(self, table: Any, kind: int = 0) -> Optional[np.ndarray]:
        """A pool's table's numpy view (``_cpu_array``; ``kind`` 0: the request table, 1: the
        Mamba ping-pong mapping), kept while the table is the same tensor; None where it has
        none (a device tensor)."""
        known, view = self._known_tables[kind]
        if table is not known:
            view = _cpu_array(table)
            self._known_tables[kind] = (table, view)
        return view

    def _allocator_kind(self, allocator: Any) -> int:
        """``_allocator_kind(allocator)``, kept while the allocator stays the same object."""
        known, kind = self._known_allocator
        if allocator is not known:
            kind = _allocator_kind(allocator, self.page_size)
            self._known_allocator = (allocator, kind)
        return kind

    def _frees_pages(self, allocator: Any) -> bool:
        """Whether ``allocator`` is SGLang's paged allocator out of debug mode: it frees a
        segment as the page ids of its every ``page_size``-th slot (``free_page_ids``),
        which the core or numpy compute for it."""
        return self._allocator_kind(allocator) == _PAGED_ALLOCATOR and not allocator.debug_mode

    def free_kv_row(self, kv: Any, ranges: list) -> None:
        """Give back half-open ranges of ``kv``'s row positions to the allocator (SGLang's
        ``free_kv_row`` for a pool without sliding-window slots)."""
        rows = self.req_to_token_pool.req_to_token
        allocator = self.token_to_kv_pool_allocator
        if len(ranges) == 1:  # the release's one range: what free_segments does with it
            start, end = ranges[0]
            if end > start:
                table = self._table_array(rows)
                if table is None:
                    allocator.free_segment(rows[kv.req_pool_idx, start:end], start_pos=start)
                    return
                row = table[kv.req_pool_idx]
                page_size = self.page_size
                if start % page_size == 0 and self._frees_pages(allocator):
                    # What the paged allocator's free_segment frees: the page of every
                    # page_size-th slot from start (after a checkpoint: the one page of
                    # the unaligned tail).
                    if end - start > page_size or not self._free_one_page(
                            allocator, row[start] // page_size):
                        allocator.free_page_ids(torch.from_numpy(row[start:end:page_size]
                                                                 // page_size))
                else:
                    allocator.free_segment(torch.from_numpy(row[start:end]), start_pos=start)
            return
        segments = []
        for start, end in ranges:
            if segments and start == segments[-1][1]:  # adjacent: one segment, pages once
                segments[-1][1] = end
            else:
                segments.append([start, end])
        row = rows[kv.req_pool_idx]
        allocator.free_segments([(row[start:end], start) for start, end in segments
                                 if end > start])

    def _free_one_page(self, allocator: Any, page_id: Any) -> bool:
        """``allocator.free_page_ids`` of one page (SGLang's paged allocator, not in debug
        mode) through the kept one-element tensor, where the allocator copies its argument
        before it returns: in a free group (it clones what it queues) or without
        ``need_sort`` (it joins the ids into a new free list). False (nothing freed) where
        it may keep the tensor itself."""
        if allocator.free_group is None and allocator.need_sort:
            return False
        self._one_page_id[0] = page_id
        allocator.free_page_ids(self._one_page)
        return True

    def _free_victim(self, indices: torch.Tensor) -> None:
        if self.kv_events.enabled:
            self._record_removed(indices)
        self._free(indices)

    def _free(self, indices: Any) -> None:
        """Give ``indices`` (a tensor, or a numpy array of int64 the caller owns) back to the
        allocator; kept for the next free if it refuses them."""
        allocator = self.token_to_kv_pool_allocator
        try:
            slots = None
            if self._frees_pages(allocator):
                slots = indices if type(indices) is np.ndarray else _cpu_array(indices)
            if slots is not None and len(slots):
                # What free_segment(indices, start_pos=0) frees, its page ids computed by
                # numpy (a fraction of torch's time on a few pages).
                page_size = self.page_size
                allocator.free_page_ids(torch.from_numpy(slots[::page_size] // page_size))
            else:
                if type(indices) is np.ndarray:
                    indices = torch.from_numpy(indices)
                allocator.free_segment(indices, start_pos=0)
        except Exception:
            self._pending_frees.append(torch.from_numpy(indices)
                                       if type(indices) is np.ndarray else indices)
            raise

    def _free_pages(self, page_ids: Any) -> None:
        """Give the pages ``page_ids`` (a tensor, or a numpy array of int64 the caller owns)
        back to SGLang's paged allocator; their slots kept for the next free if it refuses
        them."""
        if type(page_ids) is np.ndarray:
            page_ids = torch.from_numpy(page_ids)
        try:
            self.token_to_kv_pool_allocator.free_page_ids(page_ids)
        except Exception:
            page_size = self.page_size
            self._pending_frees.append(
                (page_ids[:, None] * page_size
                 + torch.arange(page_size, dtype=page_ids.dtype)).reshape(-1))
            raise

    def _retry_pending_frees(self) -> None:
        pending = self._pending_frees
        while pending:
            indices = pending[0]
            self.token_to_kv_pool_allocator.free_segment(indices, start_pos=0)
            pending.pop(0)

    # -- sessions (--enable-session-radix-cache; not on BasePrefixCache) -------------------------
    def open_radix_session(self, session_id: str) -> Optional[int]:
        """A new generation of ``session_id`` (the scheduler opens a session)."""
        return self._sessions.open(session_id)

    def ensure_session_generation(self, session_id: str) -> int:
        """``session_id``'s generation, opened if new (a request of the session arrives)."""
        return self._sessions.ensure(session_id)

    def release_radix_session(self, session_id: str) -> int:
        """Close ``session_id``: its references go (the scheduler closes the session)."""
        return self._sessions.release(session_id)

    # -- locks -----------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock ``node``'s path; ``delta`` is the tokens that became protected (SGLang's
        unified cache reports the same)."""
        return IncLockRefResult(delta=-self._cache.inc_lock_ref(node), node_id=node.id)

    def lock(self, node: Any) -> TreeLock:
        """Lock ``node``'s path for one holder; ``unlock`` releases it."""
        self._cache.inc_lock_ref(node)
        return TreeLock(node, _RECEIPT)

    def unlock(self, lock: Optional[TreeLock]) -> None:
        if lock is not None:
            self._cache.dec_lock_ref(lock.node)

    def dec_lock_ref(self, node: Any,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        """Undo one lock of ``node``'s path (``delta`` stays None, as in SGLang's unified
        cache)."""
        self._cache.dec_lock_ref(node)
        return DecLockRefResult()

    # -- sizes -----------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._cache.evictable_size()

    def full_evictable_size(self) -> int:
        return self._cache.evictable_size()

    def protected_size(self) -> int:
        return self._cache.protected_size()

    def full_protected_size(self) -> int:
        return self._cache.protected_size()

    def total_size(self) -> tuple:
        """(tokens cached, 0): SGLang's shape, whose second place counts SWA tokens."""
        return self._cache.total_size(), 0

    def all_values_flatten(self) -> torch.Tensor:
        """Every cached slot, in depth-first order."""
        values = [node.value for node in self._nodes()]
        return torch.cat(values) if values else self._empty_indices

    def _nodes(self):
        stack = list(reversed(self.root_node.children))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def sanity_check(self) -> None:
        """Raise AssertionError if the sizes disagree with the tree."""
        total = sum(node.num_tokens for node in self._nodes())
        assert total == self._cache.total_size(), (total, self._cache.total_size())

    def pretty_print(self) -> None:
        self._cache.pretty_print()

    # -- scheduling order -------------------------------------------------------------------
    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        """Request indices in depth-first order of their match nodes, heavier subtrees first
        (SGLang's order); handles no longer in the tree come last, in their given order."""
        by_node: dict[int, list[int]] = {}
        stale: list[int] = []
        for index, node in enumerate(node_handles):
            if node is None or node.evicted:
                stale.append(index)
            else:
                by_node.setdefault(id(node), []).append(index)
        root = self.root_node
        weight: dict[int, int] = {}
        postorder = []
        stack = [(root, False)]
        while stack:
            node, seen = stack.pop()
            if seen:
                total = len(by_node.get(id(node), ()))
                for child in node.children:
                    total += weight[id(child)]
                weight[id(node)] = total
                postorder.append(node)
                continue
            stack.append((node, True))
            stack.extend((child, False) for child in node.children)
        # Children in the order they joined their parent (a split's upper half takes the
        # place of the node it was cut from), heavier first; a node's requests after its
        # subtree's, as SGLang orders them.
        order: list[int] = []
        stack = [(root, False)]
        while stack:
            node, seen = stack.pop()
            if seen:
                order.extend(by_node.get(id(node), ()))
                continue
            stack.append((node, True))
            children = sorted(node.children, key=lambda child: (child.created_time, child.id))
            children.sort(key=lambda child: -weight[id(child)])
            stack.extend((child, False) for child in reversed(children))
        found = set(order)
        order.extend(i for i in range(len(node_handles)) if i not in found and i not in stale)
        order.extend(stale)
        return order

    # -- KV events -----------------------------------------------------------------------------
    def _record_stored(self, result: Any, tokens: np.ndarray, value: Any, names: tuple,
                       session_id: Optional[str], before: Optional[int]) -> None:
        """One leaf entered the tree: SGLang's BlockStored events, SGLang's block hashes (of
        token pairs in a bigram cache: ``before`` is its first raw token)."""
        page_size = self.page_size
        start = result.prefix_len
        leaf = result.last_node
        parent = leaf.parent
        covered = len(tokens) - leaf.num_tokens
        while covered > start:  # a hybrid cache may have split the new leaf
            covered -= parent.num_tokens
            parent = parent.parent
        extra_key, salt = names
        if parent is self.root_node:
            prior = None
            if salt is not None:
                prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).hexdigest()
            parent_node = _EventNode(None, None, [])
        else:
            prior = self._page_hashes[int(parent.value[-page_size])][0]
            parent_node = _EventNode(None, _NOT_ROOT, [prior])
        leaf_key = event_key(tokens, start, before, extra_key, salt)
        hashes = get_hash_str(leaf_key, prior, page_size=page_size)
        for slot, page_hash in zip(value[start::page_size].tolist(), hashes):
            self._page_hashes[slot] = (page_hash, extra_key, salt)
        self.kv_events.record_store(_EventNode(leaf_key, parent_node, hashes),
                                    session_id=session_id)

    def _record_removed(self, indices: torch.Tensor) -> None:
        pages = [self._page_hashes.pop(slot) for slot in indices[::self.page_size].tolist()]
        if not pages:
            return
        _, extra_key, salt = pages[0]
        key = RadixKey(array("q", bytes(8 * len(indices))), extra_key, cache_salt=salt)
        self.kv_events.record_remove(_EventNode(key, _NOT_ROOT, [page[0] for page in pages]))

    def __repr__(self) -> str:
        return f"RadixcacheBackend({self._cache!r})"


__all__ = ["RadixcacheBackend"]

"""``HiCacheBackend``: ``--enable-hierarchical-cache`` served by radixcache's host tier.

SGLang's own host pools (``pool_host``) and cache controller (``HybridCacheController``) do
the copies between device and host, as they do under SGLang's ``UnifiedRadixCache``;
radixcache's host tier (``RadixCache(host_tier=True)``) holds the tree and picks every victim
(device leaves and host leaves in policy order); this module adds SGLang's policy on top,
decision for decision:

- write policies: ``write_through`` copies a node to the host on its first hit,
  ``write_through_selective`` on its second (SGLang's hit count: an insert counts each node
  that ends past what the request inserted before), each with its not-yet-copied ancestors
  first, right after the insert; the copied node stays locked until its copy is
  acknowledged (``check_hicache_events``). ``write_back`` copies a device victim as it leaves
  the device, and waits for that copy before the slots go back.
- host room: a copy that does not fit first takes back, under ``write_back``, the host
  copies of nodes held on both tiers (in the order they became such, those that are the
  next device victims last), then host leaves in policy order; a ``write_back`` victim that
  still finds no room leaves the tree (or stays, when something below it is held).
- load back: a host hit of at least ``load_back_threshold`` (10) tokens within the request's
  quota is loaded: device slots (evicting first if the allocator lacks them), one queued
  load, the nodes on the device at once and locked until the load is acknowledged.
- host locks (``inc_host_lock_ref``), the layer-transfer counter (registered with the
  device pool and the TP worker), the controller's acknowledgements all-reduced over the
  TP group, KV events per medium (``GPU``, ``CPU_PINNED``).
- the storage tier with SGLang's ``file`` backend (``--hicache-storage-backend file``,
  attached at start-up; other backends and attaching one at run time are refused:
  ``STORAGE_REFUSAL``, ``ATTACH_REFUSAL``): the per-node storage keys (``is_backuped``,
  ``get_last_hash_value``, ``get_prefix_hash_values``) are SGLang's, and from
  ``hicache_storage``: backups to storage (``StorageBackup``), storage hit queries
  (``StorageHitQuery``), prefetches, their per-step drains and stop policies
  (``StoragePrefetch``) and the insertion of prefetched pages (``PrefetchInsert``). Without
  a storage backend the scheduler's storage calls get SGLang's answers for a cache with none.

Every choice is a function of the calls the scheduler made and the TP-reduced
acknowledgement counts, nothing else (no clock, no thread timing, no address): the same
sequence of scheduler calls gives the same decisions on every rank.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    IncLockRefResult,
    InitLoadBackParams,
    InsertResult,
    MatchResult,
)
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from ... import cache as _tree
from .hicache_storage import PrefetchInsert, StorageBackup, StorageHitQuery, StoragePrefetch
from .backend import (
    _NOT_ROOT,
    RadixcacheBackend,
    _check_key,
    _EventNode,
    _namespace,
    _token_array,
)

#: SGLang's ``load_back_threshold``: a host hit shorter than this is recomputed.
LOAD_BACK_THRESHOLD = 10
#: SGLang's write-through hit thresholds by policy (``write_back`` counts no hits).
_WRITE_THROUGH_THRESHOLD = {"write_through": 1, "write_through_selective": 2}
_RECLAIM_DIGEST_MASK = (1 << 62) - 1
_NO_HITS = 2**62  # a hits_from no insert reaches: write_back counts no hits
#: The storage backends radixcache's host tier serves (``--hicache-storage-backend``).
SERVED_STORAGE_BACKENDS = ("file",)
#: Why another storage backend is refused at start-up.
STORAGE_REFUSAL = ("radixcache's host tier serves the storage tier with SGLang's `file` backend "
                   "only, the one its decisions are checked against SGLang's on; the other "
                   "backends' page layouts, zero-copy reads and per-pool transfers are not "
                   "served")
#: Why attaching a storage backend at run time is refused.
ATTACH_REFUSAL = ("attaching a storage backend at run time (which may also change the write "
                  "policy) is not served by radixcache's host tier; start the server with "
                  "--hicache-storage-backend file instead")
_STORAGE_HASH_MEMO = 1 << 18  # pages whose storage hashes are kept (cleared when full)


class _PendingWrite:
    """A node copied to the host whose copy is not acknowledged yet."""

    __slots__ = ("node", "parent", "locked")

    def __init__(self, node: Any, parent: Any, locked: bool) -> None:
        self.node = node  # the node backed up (its split fragments lie above it)
        self.parent = parent  # its parent then: the fragments are the nodes in between
        self.locked = locked


class _PendingLoad:
    """A host continuation on its way back to the device."""

    __slots__ = ("anchor", "top_parent", "nodes")

    def __init__(self, anchor: Any, top_parent: Any, nodes: list) -> None:
        self.anchor = anchor
        self.top_parent = top_parent  # the device node above the loaded nodes
        self.nodes = nodes  # the loaded nodes, top-down


def group_size(group: Any) -> int:
    """The world size of a process group SGLang hands the cache (1: none, or no torch
    distributed set up)."""
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


class HiCacheBackend(StoragePrefetch, PrefetchInsert, StorageBackup, StorageHitQuery,
                     RadixcacheBackend):
    """``RadixcacheBackend`` with SGLang's hierarchical cache (see the module docstring).

    Args:
        params: SGLang's ``CacheInitParams`` (as ``RadixcacheBackend``).
        server_args: SGLang's ``ServerArgs`` (the host pools' sizes, layout, I/O backend and
            write policy come from SGLang's published memory settings).
        tp_worker: The TP worker, told about the layer-transfer counter (None: not told).
        core: As ``RadixcacheBackend``.
    """

    _plain_inserts = False

    def __init__(self, params: Any, server_args: Any = None, tp_worker: Any = None, *,
                 core: Optional[str] = None) -> None:
        from sglang.srt.runtime_context import get_memory

        memory = get_memory()
        self.write_policy = memory.hicache_write_policy
        if self.write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"unknown --hicache-write-policy {self.write_policy!r}")
        self.is_write_back = self.write_policy == "write_back"
        self.write_through_threshold = _WRITE_THROUGH_THRESHOLD.get(self.write_policy, 2)
        self.load_back_threshold = LOAD_BACK_THRESHOLD
        self.prefetch_stop_policy = memory.hicache_storage_prefetch_policy
        self.cache_controller = None
        self.host_pool_group = None
        self.token_to_kv_pool_host = None
        self.enable_storage = False
        self.hicache_storage_pass_prefix_keys = False
        # The groups SGLang reduces the acknowledgement counts over (attention TP first).
        self.tp_group = params.tp_cache_group
        self.attn_tp_group = params.attn_tp_cache_group
        self._init_state()
        super().__init__(params, core=core)
        self._attach_host_stack(params, server_args, tp_worker)
        storage_backend = memory.hicache_storage_backend
        if storage_backend is not None:
            if storage_backend not in SERVED_STORAGE_BACKENDS:
                raise ValueError(f"--hicache-storage-backend {storage_backend}: "
                                 f"{STORAGE_REFUSAL}")
            from sglang.srt.runtime_context import get_serving

            self._attach_storage(
                storage_backend, memory.hicache_storage_backend_extra_config,
                file_storage_path=get_serving().file_storage_path)

    def _new_tree(self, core: Optional[str]) -> _tree.RadixCache:
        return _tree.RadixCache(self.page_size, self.eviction_policy, core=core, host_tier=True,
                                write_policy="write_back")

    def _init_state(self) -> None:
        # ack id -> the write it acknowledges (insertion-ordered: SGLang's
        # ongoing_write_through)
        self._writes: dict[int, _PendingWrite] = {}
        self._loads: dict[int, _PendingLoad] = {}  # ack id -> load (SGLang's ongoing_load_back)
        self._loading: set = set()  # nodes of unacknowledged loads (load_back_pending_id)
        self._host_locks: dict = {}  # node -> SGLang's host_lock_ref
        self._segment_locks: dict = {}  # host-only node -> locks its path holds (lock_ref)
        # Nodes on both tiers, in the order SGLang's full_host_duplicates holds them (entries
        # go stale lazily, as there): what write_back takes host room from first.
        self._duplicates: dict = {}
        self.write_back_duplicate_reclaim_digest = 0
        self._host_page_hashes: dict[int, tuple] = {}  # host slot -> (hash, extra_key, salt)
        self._newest_id = -1  # the largest node id seen (a larger one is a new node)
        self._insert_error: Optional[BaseException] = None  # see _write_through_now
        self._adopted_tokens = 0  # what the last insert put back on the device
        self._storage_hash_memo: dict = {}  # (node id, size) -> its pages' storage hashes
        self._storage_hash_pages = 0  # the pages the memo holds
        self._backups: dict = {}  # storage write id -> (node, parent) (SGLang's ongoing_backup)
        self._init_prefetch_state()

    def _attach_host_stack(self, params: Any, server_args: Any, tp_worker: Any) -> None:
        """SGLang's host pool group and controller for a plain KV pool, as
        ``attach_hybrid_pool_to_unified_cache`` builds them."""
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
            _PlainKvStrategy,
        )
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.runtime_context import get_serving

        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.load_cache_event = threading.Event()
        result = _PlainKvStrategy().build(
            cache=self, kvcache=kvcache, params=params, server_args=server_args,
            load_cache_event=self.load_cache_event, storage_backend=None,
            storage_backend_extra_config=None, prefetch_threshold=256,
            model_name=get_serving().served_model_name,
            enable_storage_metrics=bool(params.enable_metrics))
        self.host_pool_group = result.host_pool_group
        self.cache_controller = result.cache_controller
        self.token_to_kv_pool_host = result.component_host_pools[ComponentType.FULL]
        counter = self.cache_controller.layer_done_counter
        kvcache.register_layer_transfer_counter(counter)
        if tp_worker is not None:
            tp_worker.register_hicache_layer_transfer_counter(counter)

    # -- reset -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the tree, the host tier's bookkeeping and the controller's queues; the host
        pool is cleared (SGLang clears the device allocator itself)."""
        super().reset()
        self._init_state()
        if self.cache_controller is not None:
            self.cache_controller.reset()
            self.cache_controller.mem_pool_host.clear()

    # -- match -------------------------------------------------------------------------------
    def _match_result(self, match: Any) -> MatchResult:
        """With the host continuation: ``host_hit_length`` and the node it ends on."""
        if not match.host_length:
            self._note_new((match.last_node,))
            return super()._match_result(match)
        node = match.last_node
        best = match.last_host_node
        self._note_new((best,))
        if match.length:
            self._memoize(node, match.indices)
        return MatchResult(device_prefix_len=match.length, last_device_node=node,
                           last_host_node=best, best_match_node=best,
                           host_hit_length=match.host_length)

    def touch_prefix(self, key: RadixKey) -> None:
        _check_key(key, 0)
        if len(key) >= self.page_size:
            match = self._cache.match_prefix(_token_array(key.token_ids, len(key)),
                                             _namespace(key))
            self._note_new((match.last_host_node if match.host_length else match.last_node,))

    # -- new nodes ---------------------------------------------------------------------------
    def _note_new(self, candidates: Any) -> None:
        """Nodes a call may have made (ids only grow): a split's upper half on both tiers is
        a duplicate from its birth, as in SGLang's ``_split_node``."""
        newest = self._newest_id
        for node in candidates:
            if node is None or node.id <= self._newest_id:
                continue
            newest = max(newest, node.id)
            if (self.is_write_back and node.tier == "device+host"
                    and not self._pending_below(node)):
                self._duplicates.setdefault(node, None)
        self._newest_id = newest

    def _pending_below(self, node: Any) -> bool:
        """Whether ``node`` (new) is a fragment of a node with a transfer in flight."""
        children = node.children
        return len(children) == 1 and children[0] in self._loading

    # -- insert ------------------------------------------------------------------------------
    def _insert(self, tokens: np.ndarray, value: Any, namespace: Any, priority: int,
                names: tuple, hits_from: int, session_id: Optional[str] = None,
                before: Optional[int] = None) -> Any:
        """The tree insert with SGLang's HiCache around it: the adopted host nodes and the new
        leaf's events, the new duplicates, and the write-through copies it makes due. (No
        session and plain keys: the factory refuses both with HiCache.)"""
        if not self._use_priority:
            priority = 0
        if self.is_write_back:
            hits_from = _NO_HITS
        result = self._cache.insert(tokens, value, namespace, priority, hits_from=hits_from)
        last = result.last_node
        start = result.prefix_len
        # The path's tail this insert can have changed: the nodes ending past what was on the
        # device (adopted host nodes, the new leaf) or past hits_from (write-through).
        low = start if self.is_write_back else min(start, hits_from)
        tail = []
        end = len(tokens)
        node = last
        while end > low and node.parent is not None:
            tail.append((node, end))
            end -= node.num_tokens
            node = node.parent
        tail.reverse()
        # What the walk adopted (host nodes past the device part) and the new leaf's size
        # (the rest of the key) tell the leaf apart.
        adopted = [node for node, end in tail if end > start and node.host_value is not None]
        new_leaf = len(tokens) - start - sum(node.num_tokens for node in adopted) > 0
        walked = tail[:-1] if new_leaf else tail
        # SGLang's walk, then its commit, then its tail: the copies of the walked nodes due
        # for one, the adopted host nodes' events, the new leaf's event, the leaf's copy.
        if walked and not self.is_write_back:
            self._write_through_now(walked, hits_from)
        self._adopted_tokens = sum(node.num_tokens for node in adopted)
        if adopted:
            self._on_adopted(adopted)
        self._note_new((last, last.parent))
        if new_leaf:
            if self.kv_events.enabled:
                leaf_start = len(tokens) - last.num_tokens
                self._record_leaf(last, tokens[leaf_start:], value[leaf_start:], names)
            if not self.is_write_back:
                self._write_through_now(tail[-1:], hits_from)
        return result

    def _write_through_now(self, nodes: list, hits_from: int) -> None:
        """``_write_through`` inside an insert: an error is kept for the end of the call
        (``insert``, ``checkpoint``), so that the call's bookkeeping (duplicate slots freed,
        the row and the lock moved) is complete when it propagates."""
        if self._insert_error is not None:
            return
        try:
            self._write_through(nodes, hits_from)
        except BaseException as exc:
            self._insert_error = exc

    def _raise_insert_error(self) -> None:
        error, self._insert_error = self._insert_error, None
        if error is not None:
            raise error

    def insert(self, params: Any) -> Any:
        """As ``RadixcacheBackend.insert``; the prefix length counts the host-only nodes the
        insert put back on the device, as SGLang's does (their slots are the request's, not
        duplicates)."""
        try:
            result = super().insert(params)
            if self._adopted_tokens:
                result = InsertResult(prefix_len=result.prefix_len + self._adopted_tokens,
                                      last_device_node=result.last_device_node)
            return result
        finally:
            self._raise_insert_error()

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        try:
            super().checkpoint(req, up_to=up_to, **kwargs)
        finally:
            self._raise_insert_error()

    def _split_at(self, tokens: np.ndarray, namespace: Any, priority: int) -> Any:
        result = super()._split_at(tokens, namespace, priority)
        self._note_new((result.last_node,))
        return result

    def _on_adopted(self, adopted: list) -> None:
        """Host-only nodes an insert put back on the device with the request's slots:
        SGLang's ``_unevict_node_on_insert`` (a GPU store event, a new duplicate)."""
        for node in adopted:
            self._copy_hashes(node.host_value, node.value, to_device=True)
            self._record_node(node, StorageMedium.GPU)
            if self.is_write_back:
                self._duplicates.setdefault(node, None)

    def _record_leaf(self, leaf: Any, tokens: np.ndarray, value: Any, names: tuple,
                     host: bool = False) -> None:
        """A new leaf's BlockStored(GPU), its pages' hashes chained to its parent's
        (``host``: a new host-only node's BlockStored(CPU_PINNED), ``value`` its host
        slots)."""
        page_size = self.page_size
        extra_key, salt = names
        parent = leaf.parent
        if parent.parent is None:
            prior = None
            if salt is not None:
                import hashlib

                prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).hexdigest()
            parent_node = _EventNode(None, None, [])
        else:
            prior = self._page_hash(parent, -1)[0]
            parent_node = _EventNode(None, _NOT_ROOT, [prior])
        leaf_key = RadixKey(_tokens_array(tokens), extra_key, cache_salt=salt)
        hashes = get_hash_str(leaf_key, prior, page_size=page_size)
        slots = value[::page_size]
        slots = slots.tolist() if hasattr(slots, "tolist") else list(slots)
        table = self._host_page_hashes if host else self._page_hashes
        for slot, page_hash in zip(slots, hashes):
            table[int(slot)] = (page_hash, extra_key, salt)
        self.kv_events.record_store(_EventNode(leaf_key, parent_node, hashes),
                                    **({"medium": StorageMedium.CPU} if host else {}))

    def _page_hash(self, node: Any, page: int) -> tuple:
        """(hash, extra_key, salt) of ``node``'s ``page``-th page (negative: from the end)."""
        page_size = self.page_size
        value = node.value
        if value is not None:
            return self._page_hashes[int(value[page * page_size])]
        return self._host_page_hashes[int(node.host_value[page * page_size])]

    def _node_hashes(self, node: Any) -> list:
        """Every page's (hash, extra_key, salt) of ``node``."""
        value = node.value
        table = self._page_hashes
        if value is None:
            value = node.host_value
            table = self._host_page_hashes
        return [table[slot] for slot in value[::self.page_size].tolist()]

    def _copy_hashes(self, source: Any, target: Any, *, to_device: bool) -> None:
        """The page hashes of ``source`` slots filed under ``target`` slots too (a host copy
        made, or a host copy put back on the device)."""
        if not self.kv_events.enabled:
            return
        page_size = self.page_size
        src, dst = ((self._host_page_hashes, self._page_hashes) if to_device
                    else (self._page_hashes, self._host_page_hashes))
        for a, b in zip(source[::page_size].tolist(), target[::page_size].tolist()):
            dst[b] = src[a]

    def _record_node(self, node: Any, medium: Any) -> None:
        """SGLang's ``record_store(node, medium)`` for a node already in the tree."""
        if not self.kv_events.enabled:
            return
        pages = self._node_hashes(node)
        _, extra_key, salt = pages[0]
        parent = node.parent
        if parent.parent is None:
            parent_node = _EventNode(None, None, [])
        else:
            parent_node = _EventNode(None, _NOT_ROOT, [self._page_hash(parent, -1)[0]])
        key = RadixKey(_tokens_array(node.key), extra_key, cache_salt=salt)
        self.kv_events.record_store(_EventNode(key, parent_node, [p[0] for p in pages]),
                                    medium=medium)

    def _record_host_removed(self, host_indices: Any) -> None:
        """BlockRemoved(CPU_PINNED) of host slots leaving (their hashes forgotten)."""
        if not self.kv_events.enabled:
            return
        pages = [self._host_page_hashes.pop(slot)
                 for slot in host_indices[::self.page_size].tolist()]
        if not pages:
            return
        _, extra_key, salt = pages[0]
        key = RadixKey(_tokens_array(np.zeros(len(host_indices), dtype=np.int64)), extra_key,
                       cache_salt=salt)
        self.kv_events.record_remove(_EventNode(key, _NOT_ROOT, [p[0] for p in pages]),
                                     medium=StorageMedium.CPU)

    # -- write-through -----------------------------------------------------------------------
    def _write_through(self, nodes: list, hits_from: int) -> None:
        """SGLang's insert-time backups: each of ``nodes`` (``(node, end)`` top-down) that
        ends past ``hits_from``, has no host copy and was hit ``write_through_threshold``
        times is copied, its uncopied ancestors first; a copy that finds no room ends that
        node's chain."""
        threshold = self.write_through_threshold
        for node, end in nodes:
            if end > hits_from and node.host_value is None and node.hit_count >= threshold:
                chain = [node]
                above = node.parent
                while above is not None and above.parent is not None \
                        and above.host_value is None:
                    chain.append(above)
                    above = above.parent
                for target in reversed(chain):
                    if target.host_value is not None:
                        continue
                    if not self._write_one(target):
                        break

    def _write_one(self, node: Any) -> bool:
        """Copy one device node to the host now (queued on the controller, flushed at the
        step's end), lock it until acknowledged; False when the host has no room."""
        host = self._host_copy(node)
        if host is None:
            return False
        try:
            self._cache.back_up(node, host)
        except BaseException:  # the queued write and its host slots are undone
            _unqueue(self.cache_controller.write_queue, node.id)
            self._forget_host(host)
            raise
        self._copy_hashes(node.value, host, to_device=False)
        self._cache.inc_lock_ref(node)
        self._writes[node.id] = _PendingWrite(node, node.parent, True)
        return True

    def _host_copy(self, node: Any) -> Any:
        """Host slots holding ``node``'s KV (a write queued on the controller), after making
        room as SGLang's ``_execute_kv_backup`` does; None when there is none."""
        size = node.num_tokens
        available = self.host_pool_group.available_size()
        if available < size:
            needed = size - available
            if self._evict_host(needed) < needed:
                return None
        return self.cache_controller.write(node.value, node_id=node.id, flush=False)

    # -- host eviction ------------------------------------------------------------------------
    def evict_host(self, num_tokens: int, component_type: Any = None) -> int:
        """Free ``num_tokens`` of host memory (SGLang's ``evict_host``); the tokens freed."""
        if type(num_tokens) is not int:
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        return self._evict_host(num_tokens)

    def _evict_host(self, num_tokens: int) -> int:
        """SGLang's ``drive_host_eviction`` for the KV pool: under ``write_back`` host copies
        of nodes also on the device first, then host leaves in policy order (held ones
        passed over)."""
        if num_tokens <= 0:
            return 0
        freed = self._reclaim_duplicates(num_tokens) if self.is_write_back else 0
        if freed < num_tokens:
            # One free for every leaf the call removes: the pool appends them in the same
            # order, and the recorder joins their BlockRemoved(CPU) into one anyway.
            freed += self._cache.evict_host(num_tokens - freed, self._free_host, batch=True,
                                            keep=self._held_on_host())
        return freed

    def _held_on_host(self) -> Any:
        """Host-only nodes no host eviction may take now (host locks, locked segments)."""
        if self._backups or self.ongoing_prefetch:
            return (self._host_locks.keys() | self._segment_locks.keys()
                    | self._backup_held().keys())
        if not self._segment_locks:
            return self._host_locks or None
        if not self._host_locks:
            return self._segment_locks
        return self._host_locks.keys() | self._segment_locks.keys()

    def _free_host(self, host_indices: Any) -> None:
        self._record_host_removed(host_indices)
        self.host_pool_group.free(host_indices, pool=PoolName.KV)

    def _reclaim_duplicates(self, num_tokens: int) -> int:
        """SGLang's ``_reclaim_full_host_duplicates``: in registration order, the host copies
        of nodes on both tiers, sparing the next device victims in a first pass."""
        freed = 0
        swept = []
        duplicates = self._duplicates
        held = self._backup_held()
        for spare_leaves in (True, False):
            if freed >= num_tokens:
                break
            for node in list(duplicates):
                if freed >= num_tokens:
                    break
                if node.evicted:
                    swept.append(node)  # left the tree (SGLang drops it then)
                    continue
                if node.tier != "device+host":
                    swept.append(node)
                    continue
                if spare_leaves and self._device_leaf(node):
                    continue
                if node in self._loading or self._host_locks.get(node) or node in held:
                    continue
                host = self._cache.drop_host_copy(node)
                self._record_host_removed(host)
                self.host_pool_group.free(host, pool=PoolName.KV)
                freed += node.num_tokens
                self.write_back_duplicate_reclaim_digest = (
                    self.write_back_duplicate_reclaim_digest * 1000003 + node.id + 1
                ) & _RECLAIM_DIGEST_MASK
                swept.append(node)
        for node in swept:
            duplicates.pop(node, None)
        return freed

    @staticmethod
    def _device_leaf(node: Any) -> bool:
        """SGLang's D-leaf: on the device, unlocked, no child on the device."""
        if node.lock_ref or not node.on_device or node.evicted:
            return False
        return not any(child.on_device for child in node.children)

    # -- device eviction ----------------------------------------------------------------------
    def _evict_victims(self, num_tokens: int) -> int:
        """SGLang's device eviction walk with HiCache: victims in policy order; one with a
        host copy is demoted, one without is copied first under ``write_back`` (room made
        as ``_host_copy`` does) or else deleted; a ``write_back`` victim with no room and
        something held below it stays."""
        cache = self._cache
        freed = 0
        passed: set = set()
        write_back = self.is_write_back
        while freed < num_tokens:
            node = cache.next_victim(keep=passed or None)
            if node is None:
                break
            host = None
            if write_back and node.tier == "device":
                host = self._host_copy(node)
                if host is None and (node.num_children or self._host_locks.get(node)
                                     or self._anchor_held(node)):
                    passed.add(node)  # SGLang declines the drop: it stays for now
                    continue
                if host is not None:
                    # SGLang's writing_check(write_back=True): the copy is made and
                    # acknowledged before the node leaves the device (a copy that fails
                    # leaves it there, its host slots freed).
                    self._finish_writes_now(host)
                    if self.kv_events.enabled:
                        self._copy_hashes(node.value, host, to_device=False)
                        self._record_node(node, StorageMedium.CPU)
                    self._duplicates[node] = None  # on both tiers at its ack
            taken: list = []
            try:
                got = cache.evict(1, taken.append,
                                  backup=(lambda _v, h=host: h) if write_back else None,
                                  keep=passed or None)
            except BaseException as exc:
                if getattr(exc, "host_indices", None) is not None:  # not kept: ours again
                    self._forget_host(exc.host_indices)
                raise
            if not got:
                if host is not None:  # the victim vanished meanwhile: its copy is unused
                    self._forget_host(host)
                break
            if host is not None:  # acknowledged on the host: to storage, as SGLang's ack does
                self._write_backup_storage(node)
            self._free_victim(taken[0])
            freed += got
        return freed

    def _forget_host(self, host: Any) -> None:
        """Host slots holding a copy no node keeps: back to the pool, unannounced."""
        for slot in host[::self.page_size].tolist():
            self._host_page_hashes.pop(slot, None)
        self.host_pool_group.free(host, pool=PoolName.KV)

    def _start_writing(self) -> None:
        """Submit the queued writes; if the copy fails, the writes it carried are undone
        (host copies dropped and freed, locks released) before the error propagates."""
        cc = self.cache_controller
        if not cc.write_queue:
            return
        queued = [ack_id for op in cc.write_queue for ack_id in op.node_ids]
        try:
            cc.start_writing()
        except BaseException:
            for ack_id in queued:
                if ack_id in self._writes:
                    self._undo_write(ack_id)
            raise

    def _undo_write(self, ack_id: int) -> None:
        pending = self._writes.pop(ack_id)
        node = pending.node
        above = node
        while above is not pending.parent and above is not None:
            if not above.evicted and above.host_value is not None and above.on_device:
                self._forget_host(self._cache.drop_host_copy(above))
            above = above.parent
        if pending.locked:
            self._cache.dec_lock_ref(node)

    def _finish_writes_now(self, host: Any) -> None:
        """Submit the queued writes and acknowledge every write at once (SGLang's
        ``writing_check(write_back=True)``); ``host``: the write-back copy in them, freed
        if the copy fails."""
        cc = self.cache_controller
        try:
            self._start_writing()
            for ack in cc.ack_write_queue:
                ack.finish_event.synchronize()
        except BaseException:
            self._forget_host(host)
            raise
        writes = self._writes
        if writes:
            for ack in cc.ack_write_queue:
                for ack_id in ack.node_ids:
                    if ack_id in writes:
                        self._finish_write(ack_id)
        cc.ack_write_queue.clear()

    def _finish_write(self, ack_id: int) -> None:
        """A write acknowledged: its node and the fragments split off it get their
        BlockStored(CPU), top-down, and its lock goes."""
        pending = self._writes.pop(ack_id)
        node = pending.node
        fragments = []
        above = node
        while above is not pending.parent and above is not None:
            fragments.append(above)
            above = above.parent
        fragments.reverse()
        for fragment in fragments:
            if not fragment.evicted:
                self._record_node(fragment, StorageMedium.CPU)
        if pending.locked:
            self._cache.dec_lock_ref(node)
        if self.enable_storage:
            for fragment in fragments:
                self._write_backup_storage(fragment)

    # -- locks -------------------------------------------------------------------------------
    def inc_host_lock_ref(self, node: Any) -> IncLockRefResult:
        """Keep ``node``'s host copy (SGLang's host lock on one node): no host eviction and
        no reclaim takes it until ``dec_host_lock_ref``."""
        self._host_locks[node] = self._host_locks.get(node, 0) + 1
        return IncLockRefResult(node_id=node.id)

    def dec_host_lock_ref(self, node: Any, params: Any = None) -> DecLockRefResult:
        count = self._host_locks.get(node, 0)
        if count <= 0:
            raise ValueError(f"dec_host_lock_ref on node {node.id}: it holds no host lock")
        if count == 1:
            del self._host_locks[node]
        else:
            self._host_locks[node] = count - 1
        return DecLockRefResult()

    def _lock_segment(self, nodes: list, delta: int) -> None:
        for node in nodes:
            count = self._segment_locks.get(node, 0) + delta
            if count:
                self._segment_locks[node] = count
            else:
                del self._segment_locks[node]

    # -- load back -----------------------------------------------------------------------------
    def init_load_back(self, params: InitLoadBackParams) -> tuple:
        """Load ``params.best_match_node``'s host continuation back (SGLang's
        ``init_load_back``): (tokens now on the device past ``req.last_node``, the node to
        lock), or (0, ``req.last_node``) when it is not loaded."""
        anchor = params.best_match_node
        req = params.req
        if req is None:
            raise ValueError("init_load_back needs the request (params.req)")
        last = req.last_node
        if (anchor is not None and not anchor.on_device) or params.host_hit_length > 0:
            if self._load_back(anchor, params.mem_quota):
                new = 0
                node = anchor
                while node is not last and node is not None:
                    new += node.num_tokens
                    node = node.parent
                if new == 0:
                    return 0, last
                return new, anchor
        return 0, last

    def _load_back(self, anchor: Any, mem_quota: Optional[int]) -> bool:
        """SGLang's ``load_back``: lock, check size and quota, make device room, queue the
        load and put the nodes on the device, locked until the load is acknowledged."""
        nodes = []
        node = anchor
        while node is not None and node.parent is not None and not node.on_device:
            nodes.append(node)
            node = node.parent
        top_parent = node
        nodes.reverse()
        self.inc_host_lock_ref(anchor)  # until the load is acknowledged
        self._lock_segment(nodes, 1)
        # (inc_lock_ref answers the change in evictable tokens: the protected ones, negated)
        delta = -self._cache.inc_lock_ref(top_parent) if top_parent.parent is not None else 0
        device = None
        try:
            device = self._queue_load(anchor, nodes, mem_quota, delta)
        finally:
            self._unlock_top(top_parent)
            self._lock_segment(nodes, -1)
            if device is None:
                self.dec_host_lock_ref(anchor)
        if device is None:
            return False
        ack_id = anchor.id
        try:
            match = _tree.MatchResult(self._empty_indices, top_parent, 0, len(device), anchor)
            self._cache.load_back(match, device)
        except BaseException:  # the queued load and its device slots are undone
            _unqueue(self.cache_controller.load_queue, ack_id)
            self.token_to_kv_pool_allocator.free(device)
            self.dec_host_lock_ref(anchor)
            raise
        for loaded in nodes:
            self._copy_hashes(loaded.host_value, loaded.value, to_device=True)
            self._record_node(loaded, StorageMedium.GPU)
        if self.is_write_back:
            self._loading.update(nodes)
        self._cache.inc_lock_ref(anchor)
        self._loads[ack_id] = _PendingLoad(anchor, top_parent, nodes)
        return True

    def _queue_load(self, anchor: Any, nodes: list, mem_quota: Optional[int],
                    delta: int) -> Any:
        """The device slots of a queued load of ``nodes`` (their path locked), or None when
        SGLang would not load: below the threshold, over the quota, no device room."""
        host_indices = (torch.cat([n.host_value for n in nodes]) if nodes
                        else torch.empty((0,), dtype=torch.int64))
        tokens = len(host_indices)
        if (tokens < max(1, self.load_back_threshold)
                or (mem_quota is not None and tokens + delta > mem_quota)):
            return None
        allocator = self.token_to_kv_pool_allocator
        available = allocator.available_size()
        if available < tokens:
            self.evict_for_alloc(EvictParams(num_tokens=tokens - available))
            if allocator.available_size() < tokens:
                return None
        return self.cache_controller.load(host_indices=host_indices, node_id=anchor.id)

    def _unlock_top(self, node: Any) -> None:
        if node.parent is not None:
            self._cache.dec_lock_ref(node)

    def _finish_load(self, ack_id: int, failed: bool = False) -> None:
        """A load acknowledged: its locks go; under ``write_back`` its nodes (and fragments
        split off them) become duplicates, bottom-up (SGLang's ``finish_load_back``)."""
        pending = self._loads.pop(ack_id)
        anchor = pending.anchor
        self._cache.dec_lock_ref(anchor)
        self.dec_host_lock_ref(anchor)
        if self.is_write_back:
            self._loading.difference_update(pending.nodes)
            if failed:
                return
            node = anchor
            while node is not pending.top_parent and node is not None:
                if node.tier == "device+host":
                    self._duplicates.setdefault(node, None)
                node = node.parent

    # -- the scheduler's HiCache hooks ---------------------------------------------------------
    def check_hicache_events(self) -> None:
        """Every scheduler step: submit queued writes, then take the acknowledged writes and
        loads (the counts reduced to the minimum over the TP group)."""
        cc = self.cache_controller
        self._start_writing()
        writes = _ready(cc.ack_write_queue)
        loads = _ready(cc.ack_load_queue)
        storage = self._storage_queue_sizes()
        digest = self.write_back_duplicate_reclaim_digest
        group = self._reduce_group()
        if group is not None:
            counts = torch.tensor([writes, loads, *storage, digest, -digest],
                                  dtype=torch.int64)
            torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN,
                                         group=group)
            writes, loads, *storage, low, high = (int(v) for v in counts.tolist())
            if low != digest or -high != digest:
                raise RuntimeError("HiCache: the write_back reclaim victims diverged across "
                                   "TP ranks")
        for _ in range(writes):
            ack = cc.ack_write_queue.pop(0)
            ack.finish_event.synchronize()
            for ack_id in ack.node_ids:
                if ack_id in self._writes:
                    self._finish_write(ack_id)
        for _ in range(loads):
            ack = cc.ack_load_queue.pop(0)
            ack.finish_event.synchronize()
            for ack_id in ack.node_ids:
                self._finish_load(ack_id)
        if any(storage):
            self._drain_storage(*storage)

    def _reduce_group(self) -> Any:
        """The group the counts are reduced over, as SGLang's ``_all_reduce_attn_groups``:
        the attention TP group when it spans ranks, else the TP group; None: one rank."""
        for group in (self.attn_tp_group, self.tp_group):
            if group_size(group) > 1:
                return group
        return None

    def flush_pending_backups(self) -> None:
        """Submit the queued host writes as one transfer (a failed copy is undone)."""
        self._start_writing()

    def ready_to_load_host_cache(self) -> int:
        """Start the queued loads; the layer counter's producer index (-1: none). If the
        copy fails, the loads it carried release their locks before the error propagates:
        their nodes keep their slots (nothing is lost), the scheduler ends on the error."""
        cc = self.cache_controller
        queued = [ack_id for op in cc.load_queue for ack_id in op.node_ids]
        try:
            return cc.start_loading()
        except BaseException:
            for ack_id in queued:
                if ack_id in self._loads:
                    self._finish_load(ack_id, failed=True)
            raise

    def load_back_is_cache_owned(self) -> bool:
        return True

    def is_load_back_event_done(self, consumer_index: int) -> bool:
        if consumer_index < 0:
            return True
        counter = self.cache_controller.layer_done_counter
        return counter.events[consumer_index].finish_event.query()

    def has_free_load_back_slot(self) -> bool:
        cc = self.cache_controller
        return len(cc.ack_load_queue) < cc.layer_done_counter.num_counters

    # -- the storage tier --------------------------------------------------------------------
    # The per-node queries answer from the tree; prefetches, backups and hit queries are in
    # ``hicache_storage``; attaching a backend at run time is refused.
    def is_root(self, node: Any) -> bool:
        return node.parent is None

    def is_backuped(self, node: Any) -> bool:
        """Whether ``node`` holds a host copy (SGLang's ``backuped``)."""
        return node.host_value is not None

    def get_last_hash_value(self, node: Any) -> Optional[str]:
        """The storage hash of ``node``'s last page; None for the root."""
        hashes = self._storage_hashes(node)
        return hashes[-1] if hashes else None

    def get_prefix_hash_values(self, node: Any) -> list:
        """The storage hashes of every page above ``node`` (root to parent)."""
        chain = []
        above = node.parent
        while above is not None and above.parent is not None:
            chain.append(self._storage_hashes(above))
            above = above.parent
        return [page for hashes in reversed(chain) for page in hashes]

    def _storage_hashes(self, node: Any) -> list:
        """SGLang's storage key of each page of ``node`` (``compute_node_hash_values``): a
        SHA-256 chain over the path's tokens seeded by the namespace. A function of the path
        alone, so kept by (node id, size) -- a split's lower half is a smaller size -- in a
        bounded memo rather than in the tree core."""
        memo = self._storage_hash_memo
        pending = []  # the path's nodes not in the memo, bottom-up
        prior = None
        above = node
        while above.parent is not None:
            hashes = memo.get((above.id, above.num_tokens))
            if hashes is not None:
                prior = hashes[-1]
                break
            pending.append(above)
            above = above.parent
        if not pending:
            return memo[(node.id, node.num_tokens)] if node.parent is not None else []
        pages = sum(below.num_tokens for below in pending) // self.page_size
        if self._storage_hash_pages + pages > _STORAGE_HASH_MEMO:
            memo.clear()
            self._storage_hash_pages = 0
        self._storage_hash_pages += pages
        for below in reversed(pending):
            namespace = below.extra_key
            extra_key, salt = namespace if type(namespace) is tuple else (namespace, None)
            key = RadixKey(_tokens_array(below.key), extra_key, cache_salt=salt)
            hashes = get_storage_hash_str(key, prior, page_size=self.page_size)
            memo[(below.id, below.num_tokens)] = hashes
            prior = hashes[-1]
        return hashes

    def attach_storage_backend(self, storage_backend: str, *args: Any,
                               **kwargs: Any) -> tuple:
        """Refused (the answer SGLang's admin call returns as its message)."""
        return (False, f"HiCache storage backend {storage_backend!r} not attached: "
                       f"{ATTACH_REFUSAL}, or serve without --radix-cache-backend radixcache")

    def detach_storage_backend(self) -> tuple:
        """The controller's (idempotent) detach, then success, as SGLang's: first the queued
        storage-write acknowledgements and releases are taken; once the storage threads
        stopped, prefetches still in flight give back their locks and the host slots read in,
        storage writes still unacknowledged their host locks, and what that queued is taken.
        One difference: the reads' last acknowledgements are taken too, so that the slots
        they did not fill go back to the host pool (SGLang's detach leaves them queued)."""
        self._drain_storage_local()
        try:
            self.cache_controller.detach_storage_backend()
        except Exception as exc:
            return False, f"Failed to detach HiCache storage backend: {exc}"
        self._release_prefetches()
        self._release_backups()
        # What the releases just queued, and (unlike SGLang's detach, which leaves them in the
        # queue for good) the reads' last acknowledgements: the slots they did not fill.
        self._drain_storage_local(reads=True)
        self.enable_storage = False
        return True, "Detached HiCache storage backend successfully."

    def clear_storage_backend(self) -> bool:
        """Drop what the storage backend holds: False, none is attached."""
        try:
            return bool(self.cache_controller.clear_storage_backend())
        except Exception:
            return False

    def shutdown(self) -> None:
        """Detach an attached storage backend (its threads stop)."""
        if self.enable_storage:
            self.detach_storage_backend()

    def release_host_resources(self) -> None:
        if self.host_pool_group is not None:
            self.host_pool_group.destroy()

    # -- sizes -----------------------------------------------------------------------------------
    def host_size(self) -> int:
        """Tokens with a host copy."""
        return self._cache.host_size()

    def all_values_flatten(self) -> torch.Tensor:
        """Every slot cached on the device, in depth-first order."""
        values = [node.value for node in self._nodes() if node.on_device]
        return torch.cat(values) if values else self._empty_indices

    def sanity_check(self) -> None:
        """Raise AssertionError if the device or host sizes disagree with the tree."""
        nodes = list(self._nodes())
        device = sum(node.num_tokens for node in nodes if node.on_device)
        host = sum(node.num_tokens for node in nodes if node.host_value is not None)
        assert device == self._cache.total_size(), (device, self._cache.total_size())
        assert host == self._cache.host_size(), (host, self._cache.host_size())

    def __repr__(self) -> str:
        return f"HiCacheBackend({self.write_policy}, {self._cache!r})"


def _unqueue(queue: list, ack_id: int) -> None:
    """Take the controller's queued operation for ``ack_id`` back out of ``queue``."""
    for index in range(len(queue) - 1, -1, -1):
        if queue[index].node_ids == [ack_id]:
            del queue[index]
            return


def _ready(acks: list) -> int:
    """How many acknowledgements at the front of ``acks`` have finished."""
    count = 0
    for ack in acks:
        if not ack.finish_event.query():
            break
        count += 1
    return count


def _tokens_array(tokens: Any) -> Any:
    """Token ids as SGLang's RadixKey holds them (an array('q'))."""
    from array import array

    return array("q", np.asarray(tokens, dtype=np.int64).tobytes())


__all__ = ["ATTACH_REFUSAL", "HiCacheBackend", "LOAD_BACK_THRESHOLD",
           "SERVED_STORAGE_BACKENDS", "STORAGE_REFUSAL"]

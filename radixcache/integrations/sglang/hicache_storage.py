"""The storage tier's tree side under ``HiCacheBackend``: pages a prefetch from storage
brought into host slots go into the tree as SGLang 0.5.23's ``_handle_prefetch_result`` puts
them there (its ``insert_host``), through the tree core's ``insert_host``.

- The walk from the prefetch's anchor (the request's last host node) splits where the pages
  end or differ inside a node; the pages already cached keep their nodes, the rest become one
  host-only node below.
- Every write policy but ``write_back``: a node passed without a host copy takes its pages'
  prefetched slots as one (a ``BlockStored(CPU_PINNED)``), and pages that would hang below a
  node without a host copy are dropped (their slots queued for release on the controller,
  as SGLang queues them).
- The prefetched slots of pages already held go back to the host pool at once; the new node
  gets a ``BlockStored(CPU_PINNED)`` whose block hashes chain to its parent's, as a device
  store would.

Backups to storage (``StorageBackup``), as SGLang's ``write_backup_storage`` and the backup
drain of its ``check_hicache_events`` make them once a storage backend is attached:

- when a device-to-host copy is acknowledged (each step's acknowledgements, or the blocking
  wait before a ``write_back`` victim leaves the device), the copied node and the fragments
  split off it, top-down, are written to storage: their host slots and their pages' storage
  hashes (SGLang's ``compute_node_hash_values`` chain) go to the controller's
  ``write_storage``; each node keeps a host lock until its storage write is acknowledged.
- each step takes as many storage acknowledgements as were queued when it started (the
  count reduced to the minimum over the TP group), releasing their host locks whatever the
  write's outcome (a failed or raising write is the controller's to log), and frees the host
  slots queued for release.

The storage hit query (``StorageHitQuery.query_storage_hit_length``, SGLang's probe of how
many of a request's next tokens storage holds) answers as SGLang's does: 0 without a storage
backend, while prefetches hold the controller's token budget, or for a page-aligned span
shorter than the prefetch threshold; otherwise the controller's own hit query (the backend's
``batch_exists`` batch by batch, keys chained from the anchor's last storage hash), reduced
to the minimum over the TP group and floored to whole pages.

Prefetches and their stop policies are not served yet, so the storage tier stays refused at
start-up (``hicache.STORAGE_REFUSAL``); the backups and hit queries run only where a storage
backend is attached with ``_attach_backup_storage``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey

from .backend import _check_key, _namespace, _token_array

__all__ = ["PrefetchInsert", "StorageBackup", "StorageHitQuery"]


class PrefetchInsert:
    """``HiCacheBackend``'s insertion of prefetched pages (a base class of it: it uses the
    backend's tree, controller and event bookkeeping)."""

    __slots__ = ()

    def insert_prefetched(self, anchor: Any, key: RadixKey, host_indices: torch.Tensor) -> int:
        """Put the pages of ``key`` (below ``anchor``), fetched into ``host_indices`` (one
        per token), into the tree; once it returns, this call has taken those slots: each
        ends up in the tree, back in the host pool or queued for release. When it raises
        (bad input), nothing changed and the slots are still the caller's to free.

        Returns:
            The tokens loaded from storage (SGLang's ``prefetch_loaded_tokens``): those the
            tree did not hold yet, 0 when the pages were dropped.
        """
        _check_key(key, 0)
        count = len(key)
        if count % self.page_size or host_indices.shape[0] != count:
            raise ValueError(f"insert_prefetched got {host_indices.shape[0]} host slots for "
                             f"{count} tokens (a whole number of pages, one slot each)")
        tokens = _token_array(key.token_ids, count)
        prefix_len, last, unused, dropped = self._cache.insert_host(
            anchor, tokens, host_indices, extra_key=_namespace(key),
            refill=not self.is_write_back)
        del tokens
        controller = self.cache_controller
        path = []  # the nodes from the anchor (excluded) down to the last one, top-down
        node = last
        while node is not anchor and node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        self._note_new(path)  # split halves on both tiers are duplicates (write_back)
        if dropped:
            controller.append_host_mem_release(host_indices=host_indices)
            return 0
        if unused.shape[0]:  # first: an event that fails after this loses no slot
            controller.mem_pool_host.free(unused)
        given = set(host_indices[::self.page_size].tolist())
        for node in path:
            host = node.host_value
            if host is None or int(host[0]) not in given:
                continue  # held before the call
            if node.on_device:  # refilled: the device pages' hashes are its host pages'
                self._copy_hashes(node.value, host, to_device=False)
                self._record_node(node, StorageMedium.CPU)
            else:
                self._record_host_leaf(node)
        return count - prefix_len

    def _record_host_leaf(self, node: Any) -> None:
        """A new host-only node's BlockStored(CPU_PINNED), its pages' hashes filed under its
        host slots."""
        if not self.kv_events.enabled:
            return
        namespace = node.extra_key
        names = namespace if type(namespace) is tuple else (namespace, None)
        self._record_leaf(node, node.key, node.host_value, names, host=True)


class StorageBackup:
    """``HiCacheBackend``'s backups to storage (a base class of it: it uses the backend's
    tree, controller and host locks); see the module docstring."""

    __slots__ = ()

    def _attach_backup_storage(self, storage_backend: str,
                               extra_config_json: Optional[str] = None) -> None:
        """Attach SGLang's ``storage_backend`` to the controller and back host copies up to
        it (the controller's storage threads start). Only the backups are served."""
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.runtime_context import get_serving

        if self.enable_storage:
            raise ValueError("a storage backend is attached already")
        extra_config, threshold, _, _, pass_prefix_keys = (
            HybridCacheController.parse_storage_backend_extra_config(extra_config_json))
        controller = self.cache_controller
        controller.attach_storage_backend(
            storage_backend=storage_backend, prefetch_threshold=threshold,
            model_name=get_serving().served_model_name,
            storage_backend_extra_config=extra_config,
            host_pools=controller.mem_pool_host.entries)
        self.hicache_storage_pass_prefix_keys = bool(pass_prefix_keys)
        self.prefetch_threshold = threshold
        self.enable_storage = True

    def _release_backups(self) -> None:
        """The host locks of storage writes never acknowledged (the backend detached)."""
        self._backups = {}

    def _write_backup_storage(self, node: Any) -> None:
        """SGLang's ``write_backup_storage``: ``node``'s host pages to storage, keyed by
        their storage hashes; its host copy held until the write is acknowledged."""
        if not self.enable_storage or node.host_value is None or node.evicted:
            return
        hashes = self._storage_hashes(node)
        prefix_keys = (self.get_prefix_hash_values(node)
                       if self.hicache_storage_pass_prefix_keys else None)
        operation_id = self.cache_controller.write_storage(
            node.host_value, [int(token) for token in node.key], hashes, prefix_keys)
        # The host lock of SGLang's write: ``node`` and, as SGLang's split extends it, every
        # fragment split off above it until the acknowledgement (the nodes down from
        # ``node.parent``, kept here).
        self._backups[operation_id] = (node, node.parent)

    def _backup_held(self) -> dict:
        """The nodes whose host copies storage writes in flight hold: node -> the writes
        holding it (SGLang's ``host_lock_ref`` from backups)."""
        held: dict = {}
        for node, parent in self._backups.values():
            while node is not parent and node is not None:
                held[node] = held.get(node, 0) + 1
                node = node.parent
        return held

    def _storage_queue_sizes(self) -> tuple:
        """(storage acknowledgements, host releases) queued now: what this step takes."""
        if not self.enable_storage:
            return 0, 0
        cc = self.cache_controller
        return cc.ack_backup_queue.qsize(), cc.host_mem_release_queue.qsize()

    def _drain_storage(self, backups: int, releases: int) -> None:
        """Take ``backups`` storage acknowledgements (their host locks go) and free
        ``releases`` queued host slots (SGLang's ``_drain_backup``/``_drain_release``)."""
        cc = self.cache_controller
        for _ in range(backups):
            operation = cc.ack_backup_queue.get()
            self._backups.pop(operation.id, None)
        released = [cc.host_mem_release_queue.get() for _ in range(releases)]
        if released:
            cc.mem_pool_host.free(torch.cat(released, dim=0))


class StorageHitQuery:
    """``HiCacheBackend``'s storage hit query (a base class of it: it uses the backend's
    controller and TP groups); see the module docstring."""

    __slots__ = ()

    #: Spans (page-aligned) shorter than this are not looked up (SGLang's default; attaching
    #: a storage backend sets its ``prefetch_threshold``).
    prefetch_threshold = 256

    def query_storage_hit_length(self, last_host_node: Any, new_input_tokens: Any,
                                 last_hash: Optional[str] = None,
                                 prefix_keys: Optional[list] = None,
                                 extra_key: Optional[str] = None,
                                 cache_salt: Optional[str] = None) -> int:
        """How many of ``new_input_tokens`` (the tokens past ``last_host_node``'s match)
        storage holds, in whole pages, as SGLang's ``query_storage_hit_length`` answers.
        ``last_hash``/``prefix_keys``: the anchor's last storage hash and the keys above it
        (``get_last_hash_value``/``get_prefix_hash_values``). A backend's ``batch_exists``
        that raises propagates (as SGLang's); nothing in the cache changes either way."""
        controller = self.cache_controller
        if (not self.enable_storage or controller is None
                or controller.prefetch_rate_limited()):
            return 0
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            PrefetchOperation,
        )

        key = RadixKey(new_input_tokens, extra_key=extra_key,
                       cache_salt=cache_salt).page_aligned(self.page_size)
        if len(key) < self.prefetch_threshold:
            return 0
        operation = PrefetchOperation(CacheRequestHandle("__storage_hit_query__", 0), key,
                                      last_hash, prefix_keys)
        _, hits = controller._storage_hit_query(operation)
        group = self._reduce_group()
        if group is not None:
            count = torch.tensor(hits, dtype=torch.int)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=group)
            hits = int(count.item())
        return hits - hits % self.page_size

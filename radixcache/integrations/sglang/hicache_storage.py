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

Prefetches from storage (``StoragePrefetch``), as SGLang's cache-mode ``prefetch_from_storage``,
storage drains and ``check_prefetch_progress`` make them:

- ``prefetch_from_storage``: nothing without a storage backend, while the request has a
  prefetch in flight or its stop-policy deadline expired; a page-aligned span shorter than the
  prefetch threshold is not fetched; while prefetches hold the controller's token budget the
  request is queued for a paced retry (``storage_prefetch_retries``). Otherwise the anchor
  (the request's last host node) takes a host lock, the controller's prefetch operation is
  submitted (its threads query storage, then read the hit into host slots) and the span's
  tokens count in the controller's ``prefetch_tokens_occupied``.
- each step (``check_hicache_events``) takes as many hit-query results, prefetch
  acknowledgements, storage-write acknowledgements and host releases as were queued when it
  started (reduced to the minimum over the TP group), in that order: a hit of at least the
  threshold gets host slots (``allocate_storage_hit``: host eviction first, a shorter
  allocation of whole pages if no more fits) and its read starts; a terminated prefetch, a
  hit below the threshold or one that finds no host room is revoked (its anchor lock and
  tokens released, a retry armed unless a deadline cut it); a finished read goes into the
  tree (``insert_prefetched``); the slots a read did not fill are released.
- ``check_prefetch_progress`` (admission): ``best_effort`` stops a prefetch at once and
  inserts what has been read, ``wait_complete`` waits for the read to finish, ``timeout``
  waits until ``prefetch_timeout_base + pages * prefetch_timeout_per_page`` seconds have
  passed since the request's first blocked poll (the verdict all-reduced with MAX over the TP
  group, as SGLang's).
- ``pop_prefetch_loaded_tokens``/``pop_prefetch_loaded_span``: the tokens the finished
  prefetch put into the tree, and where they start in the request; ``release_aborted_request``
  stops an aborted request's prefetch and releases what it holds.

SGLang's storage metrics (hit and unfulfilled-token counters, prefetch-outcome counters) are
not kept; pipeline parallelism (its prefetch tickets) and the ``buffer_only`` host memory mode
are refused at start-up, so their branches of SGLang's calls are not needed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey

from .backend import _check_key, _namespace, _token_array

__all__ = ["PrefetchInsert", "StorageBackup", "StorageHitQuery", "StoragePrefetch"]


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

    def _attach_storage(self, storage_backend: str, extra_config_json: Optional[str] = None,
                        file_storage_path: Optional[str] = None) -> None:
        """Attach SGLang's ``storage_backend`` to the controller (its storage threads start):
        host copies are backed up to it and requests prefetch from it. ``extra_config_json``:
        ``--hicache-storage-backend-extra-config``; ``file_storage_path``: the server's
        ``--file-storage-path`` (the extra config's own ``file_storage_path`` wins)."""
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.runtime_context import get_serving

        if self.enable_storage:
            raise ValueError("a storage backend is attached already")
        extra_config, threshold, timeout_base, timeout_per_ki_token, pass_prefix_keys = (
            HybridCacheController.parse_storage_backend_extra_config(extra_config_json))
        if file_storage_path:
            extra_config = dict(extra_config or {})
            extra_config.setdefault("file_storage_path", file_storage_path)
        controller = self.cache_controller
        controller.attach_storage_backend(
            storage_backend=storage_backend, prefetch_threshold=threshold,
            model_name=get_serving().served_model_name,
            storage_backend_extra_config=extra_config,
            host_pools=controller.mem_pool_host.entries)
        self.hicache_storage_pass_prefix_keys = bool(pass_prefix_keys)
        self.prefetch_threshold = threshold
        self.prefetch_timeout_base = timeout_base
        self.prefetch_timeout_per_page = self.page_size / 1024 * timeout_per_ki_token
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
        """The nodes whose host copies storage writes and prefetches in flight hold: node ->
        the host locks holding it (SGLang's ``host_lock_ref`` from backups and prefetch
        anchors). Each lock holds its node and, as SGLang's split extends a host lock, every
        fragment split off above it since (the nodes below the parent it had then)."""
        held: dict = {}
        segments = list(self._backups.values())
        segments.extend(prefetch.lock for prefetch in self.ongoing_prefetch.values()
                        if prefetch.lock is not None)
        for node, parent in segments:
            while node is not parent and node is not None:
                held[node] = held.get(node, 0) + 1
                node = node.parent
        return held

    def _anchor_held(self, node: Any) -> bool:
        """Whether a prefetch in flight host-locks ``node`` (its anchor, or a fragment split
        off above the anchor)."""
        return bool(self.ongoing_prefetch) and node in self._backup_held()

    def _storage_queue_sizes(self) -> tuple:
        """(hit-query results, prefetch acknowledgements, storage-write acknowledgements,
        host releases) queued now: what this step takes."""
        if not self.enable_storage:
            return 0, 0, 0, 0
        cc = self.cache_controller
        return (cc.prefetch_hit_queue.qsize(), cc.ack_prefetch_queue.qsize(),
                cc.ack_backup_queue.qsize(), cc.host_mem_release_queue.qsize())

    def _drain_storage(self, hits: int, acks: int, backups: int, releases: int) -> None:
        """Take ``hits`` hit-query results and ``acks`` prefetch acknowledgements
        (``StoragePrefetch``), ``backups`` storage-write acknowledgements (their host locks
        go), and free ``releases`` queued host slots, in SGLang's order."""
        cc = self.cache_controller
        if hits:
            self._drain_storage_hits(hits)
        if acks:
            self._drain_prefetch_acks(acks)
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


class _Prefetch:
    """A prefetch from storage in flight (SGLang's ``_OngoingPrefetch``)."""

    __slots__ = ("anchor", "key", "host_indices", "operation", "lock")

    def __init__(self, anchor: Any, key: RadixKey, operation: Any, lock: Any) -> None:
        self.anchor = anchor  # the request's last host node
        self.key = key  # the page-aligned span asked for
        self.host_indices = None  # the hit's host slots, once allocated
        self.operation = operation
        # The anchor's host lock: (anchor, its parent then), None where SGLang takes none (an
        # anchor without a host copy, but under write_back).
        self.lock = lock


class _PrefetchWait:
    """A ``timeout`` prefetch's wait budget, timed from its first blocked poll (SGLang's
    ``_StoragePrefetchWait``, on SGLang's ``PollTimer``)."""

    __slots__ = ("timer", "timeout_s", "expired")

    def __init__(self, timeout_s: float = 0.0) -> None:
        from sglang.srt.utils.poll_timer import PollTimer

        self.timer = PollTimer()
        self.timeout_s = timeout_s
        self.expired = False


class StoragePrefetch:
    """``HiCacheBackend``'s prefetches from storage (a base class of it: it uses the
    backend's tree, controller, host locks and ``insert_prefetched``); see the module
    docstring."""

    __slots__ = ()

    #: SGLang's defaults (attaching a storage backend sets them from its configuration).
    prefetch_timeout_base = 1.0
    prefetch_timeout_per_page = 0.25

    def _init_prefetch_state(self) -> None:
        from sglang.srt.mem_cache.storage_prefetch import StoragePrefetchRetries

        self.ongoing_prefetch: dict = {}  # request handle -> _Prefetch
        self.prefetch_loaded_tokens_by_reqid: dict = {}
        self.prefetch_loaded_storage_start_by_reqid: dict = {}
        self._storage_prefetch_wait: dict = {}  # request handle -> _PrefetchWait
        self.storage_prefetch_retries = StoragePrefetchRetries()

    # -- starting a prefetch -------------------------------------------------------------------
    def prefetch_from_storage(self, request: Any, last_host_node: Any, new_input_tokens: Any,
                              last_hash: Optional[str] = None,
                              prefix_keys: Optional[list] = None,
                              matched_prefix_tokens: Optional[list] = None,
                              extra_key: Optional[str] = None,
                              cache_salt: Optional[str] = None,
                              storage_hit_end: Optional[int] = None) -> Optional[bool]:
        """Start fetching the pages of ``new_input_tokens`` (the tokens past the request's
        device and host match, which ends on ``last_host_node``) from storage into host
        slots, as SGLang's ``prefetch_from_storage`` decides. Returns None (SGLang's answer
        without pipeline-parallel tickets)."""
        if not self.enable_storage or self.cache_controller is None:
            return None
        controller = self.cache_controller
        namespace = last_host_node.extra_key if last_host_node.parent is not None else None
        anchor_key, anchor_salt = (namespace if type(namespace) is tuple
                                   else (namespace, None))
        if ((anchor_key is not None and anchor_key != extra_key)
                or (anchor_salt is not None and anchor_salt != cache_salt)):
            raise ValueError(f"prefetch_from_storage: the anchor's namespace "
                             f"{(anchor_key, anchor_salt)!r} is not the request's "
                             f"{(extra_key, cache_salt)!r}")
        retries = self.storage_prefetch_retries
        rid = request.rid
        retries.cancel(rid)
        wait = self._storage_prefetch_wait.get(request)
        if wait is not None and wait.expired:
            return None
        submission = controller.get_prefetch_submission(rid)
        if submission is not None:
            return submission.decision
        if request in self.ongoing_prefetch:
            return None
        # A known hit's right end bounds the span, which is then taken as stored.
        storage_start = len(matched_prefix_tokens or ())
        assume_stored = (storage_hit_end is not None
                         and storage_start < storage_hit_end
                         <= storage_start + len(new_input_tokens))
        if assume_stored:
            new_input_tokens = new_input_tokens[:storage_hit_end - storage_start]
        key = RadixKey(new_input_tokens, extra_key=extra_key,
                       cache_salt=cache_salt).page_aligned(self.page_size)
        assume_stored = assume_stored and storage_start + len(key) == storage_hit_end
        if len(key) < self.prefetch_threshold:
            return None
        if controller.prefetch_rate_limited():
            retries.poll_miss(rid, storage_hit_end)  # paced: retried when budget frees
            return None
        submission = controller.submit_prefetch(request, key, last_hash, prefix_keys,
                                                matched_prefix_tokens, None,
                                                assume_stored=assume_stored)
        operation = submission.operation
        operation.stats_requested_tokens = len(key)
        operation.storage_start = storage_start
        lock = None
        if last_host_node.host_value is not None or self.is_write_back:
            lock = (last_host_node, last_host_node.parent)
        self.ongoing_prefetch[request] = _Prefetch(last_host_node, key, operation, lock)
        controller.prefetch_tokens_occupied += len(key)
        return submission.decision

    # -- admission ---------------------------------------------------------------------------
    def has_ongoing_prefetch(self, request: Any) -> bool:
        return request in self.ongoing_prefetch

    def check_prefetch_progress(self, request: Any) -> bool:
        """Whether ``request`` may be admitted now, as SGLang's stop policies decide; a
        prefetch stopped here goes into the tree (or is revoked, before its hit)."""
        prefetch = self.ongoing_prefetch.get(request)
        if prefetch is None:
            return True
        operation = prefetch.operation
        if not operation.is_terminated():
            if not self._can_terminate_prefetch(operation):
                self._start_prefetch_wait(operation)
                return False
            if self.prefetch_stop_policy == "timeout":
                self._mark_prefetch_deadline_expired(operation)
        self.cache_controller.terminate_prefetch(operation)
        if operation.host_indices is None:
            if not operation.deadline_expired:
                self.storage_prefetch_retries.poll_miss(request.rid)
            self.revoke_pending_prefetch(request)
        else:
            self._handle_prefetch_result(operation)
        return True

    def _can_terminate_prefetch(self, operation: Any) -> bool:
        policy = self.prefetch_stop_policy
        if policy == "wait_complete":
            return False  # the acknowledgement drain finishes it
        if policy != "timeout":
            return True
        expired = self._prefetch_deadline_expired(operation)
        group = self._reduce_group()
        if group is not None:  # wall clocks differ across ranks: any rank's expiry
            verdict = torch.tensor(int(expired), dtype=torch.int)
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX,
                                         group=group)
            expired = bool(verdict.item())
        return expired

    def _start_prefetch_wait(self, operation: Any) -> None:
        if (self.prefetch_stop_policy == "timeout"
                and operation.handle not in self._storage_prefetch_wait):
            pages = operation.stats_requested_tokens // self.page_size
            wait = _PrefetchWait(self.prefetch_timeout_base
                                 + pages * self.prefetch_timeout_per_page)
            wait.timer.observe(ready=False)
            self._storage_prefetch_wait[operation.handle] = wait

    def _prefetch_deadline_expired(self, operation: Any) -> bool:
        if (operation.host_indices is not None
                and operation.completed_tokens >= len(operation.hash_value) * self.page_size):
            return False  # read in full: cutting it now would save nothing
        wait = self._storage_prefetch_wait.get(operation.handle)
        return wait is not None and (
            wait.expired or (wait.timer.running and wait.timer.elapsed() > wait.timeout_s))

    def _mark_prefetch_deadline_expired(self, operation: Any) -> None:
        operation.deadline_expired = True
        self.storage_prefetch_retries.cancel(operation.handle.rid)
        wait = self._storage_prefetch_wait.get(operation.handle)
        if wait is None:
            wait = self._storage_prefetch_wait[operation.handle] = _PrefetchWait()
        wait.expired = True

    def finish_storage_prefetch_admission(self, request: Any, fulfilled_tokens: int,
                                          reason: Optional[str]) -> None:
        """The request was admitted: its wait budget closes."""
        self._storage_prefetch_wait.pop(request, None)

    def pop_prefetch_loaded_tokens(self, request: Any) -> int:
        """Tokens ``request``'s finished prefetch put into the tree (0: none)."""
        self.prefetch_loaded_storage_start_by_reqid.pop(request, None)
        return self.prefetch_loaded_tokens_by_reqid.pop(request, 0)

    def pop_prefetch_loaded_span(self, request: Any) -> tuple:
        """(tokens ``request``'s finished prefetch put into the tree, where they start in
        the request; None when it put none)."""
        return (self.prefetch_loaded_tokens_by_reqid.pop(request, 0),
                self.prefetch_loaded_storage_start_by_reqid.pop(request, None))

    def release_aborted_request(self, request: Any) -> None:
        """An aborted request: its prefetch stops and gives back what it holds (the slots it
        read in are released, the rest once the read's last acknowledgement comes)."""
        self._storage_prefetch_wait.pop(request, None)
        self.prefetch_loaded_tokens_by_reqid.pop(request, None)
        self.prefetch_loaded_storage_start_by_reqid.pop(request, None)
        self.storage_prefetch_retries.cancel(request.rid)
        prefetch = self.ongoing_prefetch.get(request)
        if prefetch is None:
            return
        operation = prefetch.operation
        completed, _ = self.cache_controller.terminate_prefetch(operation)
        if operation.host_indices is None:
            self.revoke_pending_prefetch(request)
            return
        self._retire_prefetch(request, prefetch.host_indices[:completed])

    # -- results -----------------------------------------------------------------------------
    def _handle_prefetch_result(self, operation: Any) -> None:
        """The read's first ``completed_tokens`` go into the tree (SGLang's
        ``_handle_prefetch_result``); the anchor's lock and the span's tokens are released."""
        request = operation.handle
        prefetch = self.ongoing_prefetch[request]
        completed = operation.completed_tokens
        # (nothing read still touches the anchor, as SGLang's empty insert_host does)
        loaded = self.insert_prefetched(prefetch.anchor, prefetch.key[:completed],
                                        prefetch.host_indices[:completed])
        prefix_len = completed - loaded
        del self.ongoing_prefetch[request]
        self.cache_controller.prefetch_tokens_occupied -= len(prefetch.key)
        self.prefetch_loaded_tokens_by_reqid[request] = loaded
        if loaded > 0:
            self.prefetch_loaded_storage_start_by_reqid[request] = (
                operation.storage_start + prefix_len)
        else:
            self.prefetch_loaded_storage_start_by_reqid.pop(request, None)

    def revoke_pending_prefetch(self, request: Any) -> None:
        """Drop ``request``'s prefetch before its hit got host slots."""
        if request in self.ongoing_prefetch:
            self._retire_prefetch(request, None)

    def _retire_prefetch(self, request: Any, host_indices: Any) -> None:
        """Drop an in-flight prefetch: its anchor lock and tokens go, ``host_indices``
        (None: none) are queued for release."""
        prefetch = self.ongoing_prefetch.pop(request)
        controller = self.cache_controller
        controller.append_host_mem_release(host_indices=host_indices)
        controller.prefetch_tokens_occupied = max(
            0, controller.prefetch_tokens_occupied - len(prefetch.key))

    def _release_prefetches(self) -> None:
        """The storage threads stopped: every prefetch in flight stops and gives back its
        anchor lock, its tokens and the host slots read in, queued for release (the unread
        ones go with the read's last acknowledgement, as in ``release_aborted_request``)."""
        controller = self.cache_controller
        for request in list(self.ongoing_prefetch):
            prefetch = self.ongoing_prefetch[request]
            if prefetch.host_indices is None:
                self.revoke_pending_prefetch(request)
                continue
            completed, _ = controller.terminate_prefetch(prefetch.operation)
            self._retire_prefetch(request, prefetch.host_indices[:completed])
        self.prefetch_loaded_tokens_by_reqid.clear()
        self.prefetch_loaded_storage_start_by_reqid.clear()
        self._storage_prefetch_wait.clear()
        self.storage_prefetch_retries.clear()

    def _drain_storage_local(self, reads: bool = False) -> None:
        """Take every queued storage-write acknowledgement, then every queued host release,
        without reducing the counts over the TP group (detach: SGLang's
        ``drain_storage_control_queues_local``); ``reads``: the prefetch acknowledgements
        first (the storage threads stopped: no prefetch is in flight any more, so they only
        release the slots the reads did not fill)."""
        controller = self.cache_controller
        if any(getattr(controller, name, None) is None for name in
               ("ack_prefetch_queue", "ack_backup_queue", "host_mem_release_queue")):
            return  # never attached
        acks = controller.ack_prefetch_queue.qsize() if reads else 0
        self._drain_storage(0, acks, controller.ack_backup_queue.qsize(), 0)
        self._drain_storage(0, 0, 0, controller.host_mem_release_queue.qsize())

    # -- the per-step drains ------------------------------------------------------------------
    def _drain_storage_hits(self, count: int) -> None:
        """Take ``count`` hit-query results: a hit worth reading gets host slots and its read
        starts; the others are revoked (SGLang's ``_drain_and_alloc_storage_hit``)."""
        controller = self.cache_controller
        retries = self.storage_prefetch_retries
        for _ in range(count):
            operation = controller.prefetch_hit_queue.get()
            request = operation.handle
            prefetch = self.ongoing_prefetch.get(request)
            if prefetch is None:
                continue  # aborted meanwhile
            hits = operation.storage_hit_count
            if operation.is_terminated() or hits < self.prefetch_threshold:
                if not operation.deadline_expired:
                    retries.poll_miss(request.rid)
                self.revoke_pending_prefetch(request)
                continue
            host, length = controller.allocate_storage_hit(
                operation, hits, allow_partial=True, min_tokens=self.prefetch_threshold,
                evict_host=self.evict_host)
            if host is None:
                self.revoke_pending_prefetch(request)
                retries.poll_miss(request.rid,
                                  operation.storage_start + operation.storage_hit_count)
                continue
            operation.storage_hit_count = length
            operation.hash_value = operation.hash_value[:length // self.page_size]
            operation.host_indices = host
            prefetch.host_indices = host
            controller.prefetch_buffer.put(operation)

    def _drain_prefetch_acks(self, count: int) -> None:
        """Take ``count`` prefetch acknowledgements: progress, and a finished read into the
        tree; the slots a read did not fill are released (SGLang's ``_drain_ack_prefetch``)."""
        controller = self.cache_controller
        for _ in range(count):
            ack = controller.ack_prefetch_queue.get()
            operation = ack.operation
            prefetch = self.ongoing_prefetch.get(operation.handle)
            current = prefetch is not None and prefetch.operation is operation
            if ack.completed_tokens is not None and current:
                operation.completed_tokens = ack.completed_tokens
            if ack.completed_req:
                if current:
                    self._handle_prefetch_result(operation)
                if operation.ack_releases_incomplete_host_indices:
                    controller.append_host_mem_release(
                        operation.host_indices[operation.completed_tokens:])

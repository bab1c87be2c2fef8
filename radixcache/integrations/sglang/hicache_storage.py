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

This is the building block of serving ``--hicache-storage-backend``; the storage calls
themselves (hit queries, stop policies, retries, backups to storage) are not served yet, so
the storage tier stays refused at start-up (``hicache.STORAGE_REFUSAL``).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey

from .backend import _check_key, _namespace, _token_array

__all__ = ["PrefetchInsert"]


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

"""Pages a prefetch from storage brought into host slots go into the tree as SGLang 0.5.23
puts them there: the HiCache differential of ``test_sglang_hicache.py`` (SGLang's default
cache against ``--radix-cache-backend radixcache``, both with SGLang's own host pools and
controller, compared after every step: match lengths, request rows, device and host free
slots, sizes, queued transfers, KV events per medium) with one more scheduler-level step:
a prefetch of a request's next pages finishing.

On SGLang's side that step is SGLang's own ``_handle_prefetch_result`` (its ``insert_host``,
the slot releases, the loaded-token count ``pop_prefetch_loaded_tokens`` answers), given the
in-flight prefetch its ``prefetch_from_storage`` would have registered: the anchor's host
lock, the ``_OngoingPrefetch`` entry, the controller's occupied tokens. What precedes it --
the storage hit query, the storage read into the host slots -- needs a storage backend
(``test_sglang_hicache_lifecycle.py`` runs it all); here the slots come straight from each
side's host pool (in the same state on both sides, so the same slots), and a prefetch that
completed only part of its pages frees the rest as SGLang's prefetch I/O thread does. On
radixcache's side the step is ``HiCacheBackend.insert_prefetched`` under the same host lock.
"""

from __future__ import annotations

import zlib
from array import array
from queue import Queue

import pytest
import torch
from test_sglang_hicache import (  # noqa: F401 -- cpu_hicache is a fixture
    STEPS,
    HiReplay,
    cpu_hicache,
    run,
)

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache, _OngoingPrefetch
from sglang.srt.mem_cache.utils import get_storage_hash_str


def prefetched(side, number: int, prompt: list, extra_key, salt, pages: int,
               completed: int, overlap: int) -> tuple:
    """A prefetch of up to ``pages`` pages of ``prompt`` past its match finishing with
    ``completed`` of them read (see the module docstring); while it is in flight,
    ``overlap`` of its pages are cached by another request (without a namespace only), so
    that the insertion walks through them, splitting them where the pages end, and under
    write-through gives those without a host copy theirs."""
    real = side.real
    page_size = side.allocator.page_size
    controller = real.cache_controller
    # What attaching a storage backend gives the controller and this step uses: the queue
    # of host slots to release, the count of tokens held by prefetches.
    if getattr(controller, "host_mem_release_queue", None) is None:
        controller.host_mem_release_queue = Queue()
    if not hasattr(controller, "prefetch_tokens_occupied"):
        controller.prefetch_tokens_occupied = 0
    key = RadixKey(array("q", prompt), extra_key, cache_salt=salt)
    match = side.cache.match_prefix(MatchPrefixParams(key=key))
    anchor = match.last_host_node
    start = match.device_prefix_len + match.host_hit_length
    count = min(pages * page_size, (len(prompt) - start) // page_size * page_size)
    if count <= 0:
        return ("prefetched", "nothing to fetch")
    done = min(completed, count // page_size) * page_size
    pool = controller.mem_pool_host
    host = pool.alloc(count)
    if host is None:
        return ("prefetched", "no host room")
    fetch_key = RadixKey(array("q", prompt[start:start + count]), extra_key, cache_salt=salt)
    if done < count:
        pool.free(host[done:])  # what the prefetch I/O thread releases
    own = isinstance(real, UnifiedRadixCache)
    lock = side.cache.inc_host_lock_ref(anchor)
    put = None
    cached = min(overlap * page_size, count)
    if (cached and extra_key is None and salt is None
            and side.allocator.available_size() >= start + cached):
        # Half the time the host pool is full meanwhile: write-through copies of the cached
        # pages may find no room, leaving nodes without a host copy on the prefetch's path.
        spare = pool.alloc(pool.available_size()) if number % 2 else None
        put = side.put(prompt[:start + cached])
        if spare is not None:
            pool.free(spare)
    if own:
        real.tree_core.backfill_missing_hash_values()
        prior = None if real.is_root(anchor) else real.get_last_hash_value(anchor)
        handle = CacheRequestHandle(f"prefetch-{number}", 0)
        operation = PrefetchOperation(handle, list(fetch_key.token_ids))
        operation.hash_value = get_storage_hash_str(fetch_key, prior, page_size=page_size)
        operation.completed_tokens = done
        operation.storage_start = start
        real.ongoing_prefetch[handle] = _OngoingPrefetch(anchor, fetch_key, host, operation,
                                                         lock.to_dec_params(), {})
        controller.prefetch_tokens_occupied += count
        real._handle_prefetch_result(operation)
        loaded = real.pop_prefetch_loaded_tokens(handle)
        assert controller.prefetch_tokens_occupied == 0
    else:
        loaded = real.insert_prefetched(anchor, fetch_key[:done], host[:done])
        side.cache.dec_host_lock_ref(anchor)
    queue = controller.host_mem_release_queue
    released = [queue.get().tolist() for _ in range(queue.qsize())]
    if released:  # SGLang's drain of the release queue at the next step's start
        pool.free(torch.tensor([slot for part in released for slot in part],
                               dtype=torch.int64))
    return ("prefetched", start, done, loaded, released, put)


class PrefetchReplay(HiReplay):
    """``HiReplay`` with finished prefetches among its steps."""

    def step(self) -> None:
        if self.rng.random() < 0.15:
            self.steps += 1
            request = self.work.new_request()
            args = (self.steps, request["prompt"], request["extra_key"], request["salt"],
                    self.rng.randrange(1, 4), self.rng.randrange(0, 4),
                    self.rng.choice((0, 0, 1, 2)))
            a = prefetched(self.sgl, *args)
            b = prefetched(self.ours, *args)
            assert a == b, f"step {self.steps} prefetched: SGLang {a} != radixcache {b}"
            kind = ("prefetch " + a[1] if len(a) == 2 else "prefetch dropped" if a[4]
                    else "prefetched" if a[3] else "prefetch held")
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.compare("prefetched")
            return
        super().step()


@pytest.mark.usefixtures("cpu_hicache")
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", ("write_back", "write_through"))
def test_prefetched_pages_go_in_as_sglang_puts_them(backend_core, monkeypatch, write_policy,
                                                    page_size):
    seed = zlib.crc32(f"prefetch-{write_policy}-{page_size}".encode())
    # A host pool half the device pool's size: write-through copies that find no room leave
    # nodes without a host copy, below which SGLang drops prefetched pages.
    replay = PrefetchReplay(backend_core, page_size, "lru", write_policy, 0.5, seed,
                            monkeypatch)
    run(replay, STEPS // 4)
    assert replay.counts.get("prefetched", 0) > 5, replay.counts
    assert replay.counts.get("finished", 0) > 5, replay.counts

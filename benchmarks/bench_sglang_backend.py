"""radixcache's SGLang backend beside SGLang's default cache, in SGLang's own serving loop.

Two caches, both built through SGLang 0.5.23's registry and factory path over real pools (a
``ReqToTokenPool``, a token-to-KV allocator, an ``MHATokenToKVPool``):

- ``sglang``: SGLang's default, ``UnifiedRadixCache`` over the bundled Rust TreeCore (what
  SGLang builds for a full-attention model when ``--radix-cache-backend`` and
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` are unset; the run checks it got Rust);
- ``radixcache``: ``--radix-cache-backend radixcache`` (compiled core).

Per request, on real ``Req`` objects made before the round: ``Req.init_next_round_input``
(match), ``tree_cache.lock``, a request row, ``prefix_device_indices``, the slots for prompt
and output from the allocator (``alloc_token_slots`` / ``alloc_paged_token_slots_extend``, which
evict through ``evict_for_alloc`` when the pool is short), then the finished request's
``release_kv_cache(..., checkpoint=True)`` (checkpoint into the tree, free the rest, unlock).
Timed: the scheduler's calls into the cache (``CACHE_CALLS``: match, lock, prefix indices,
eviction, checkpoint, the row free and unlock of the release) -- "cache calls" --, the same
less the allocator's work inside them (the frees: the same slots for both caches) -- "w/o
allocator" --, and the whole loop, the scheduler's own work (request bookkeeping, allocation,
row writes) included -- "whole loop".

Workloads: synthetic chat (``radixcache.workloads.synthetic_chat``, 300 conversations, pool
65,536 tokens), pages 1 and 16; the Mooncake conversation trace (first 3,000 requests, 512
tokens per hash id, pool 2^21 tokens), page 16 (skipped without the trace).

``mooncake-hicache``: the same trace with ``--enable-hierarchical-cache``
(``--hicache-write-policy write_back``), a device pool of 2^18 tokens and a host pool four
times that: SGLang's default (``UnifiedRadixCache`` with HiCache, Rust TreeCore) beside
``HiCacheBackend``, both over SGLang's own host pools and cache controller. The loop adds the
scheduler's HiCache steps: ``init_load_back`` for a host hit, ``ready_to_load_host_cache``,
``flush_pending_backups`` after the batch and ``check_hicache_events`` before the next; the
hit rate counts device and host hits. On this CPU machine SGLang's copies between device and
host run with the CPU stand-ins of tests/integrations/test_sglang_hicache.py. The copies, the
host pool's allocation and frees and the controller's queueing are SGLang's own code, the same
for both caches: "w/o allocator" leaves them out with the allocator's frees.

    python benchmarks/bench_sglang_backend.py --rounds 7     # interleaved rounds: the ratios
    python -m pytest benchmarks/bench_sglang_backend.py --benchmark-group-by=group \\
        --benchmark-columns=min,mean,rounds

Skipped without SGLang (``bash tests/install_sglang.sh``).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from array import array
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent
for _path in (str(BENCH_DIR.parent), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _cases import trace_file
from radixcache._core import CORES
from radixcache.traces import read_trace
from radixcache.workloads import FRESH_TOKEN_BASE, synthetic_chat

try:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.allocation import (alloc_paged_token_slots_extend,
                                                 alloc_token_slots)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.runtime_context import _CONTEXT
    from sglang.srt.sampling.sampling_params import SamplingParams
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

from radixcache.integrations import sglang as backend_module

torch.set_num_threads(1)
IMPLEMENTATIONS = ("radixcache", "sglang")
TRACE = Path(os.environ.get("RADIXCACHE_MOONCAKE_CONVERSATION", trace_file("conversation")[0]))
CASES = {  # name -> (page size, pool tokens)
    "chat-page1": (1, 1 << 16),
    "chat-page16": (16, 1 << 16),
    "mooncake-page16": (16, 1 << 21),
    "mooncake-hicache": (16, 1 << 18),
}
#: The HiCache case's host pool, relative to the device pool, and its write policy.
HICACHE_RATIO, HICACHE_WRITE_POLICY = 4.0, "write_back"
HICACHE_CALLS = ("init_load_back", "ready_to_load_host_cache", "flush_pending_backups",
                 "check_hicache_events")
#: SGLang's cache controller's methods a HiCache cache calls (host allocation, queueing and
#: the copies: the same work for both caches, left out of "w/o allocator" with the frees).
CONTROLLER_CALLS = ("write", "load", "start_writing", "start_loading")
MOONCAKE_REQUESTS = 3000
#: The allocator's methods a cache calls (their time inside cache calls is "allocator").
ALLOCATOR_CALLS = ("free", "free_segment", "free_segments", "free_page_ids", "available_size")
#: The cache methods the loop's scheduler code calls (timed as "cache").
CACHE_CALLS = ("match_prefix", "lock", "unlock", "prefix_device_indices", "evict_for_alloc",
               "evict", "checkpoint", "free_kv_row", "claim_kv_row", "on_release")


def workload(case: str) -> list:
    """(prompt, output) token arrays per request, fresh output ids fixed in advance."""
    if case.startswith("chat"):
        requests = synthetic_chat(num_conversations=300, num_system_prompts=16, seed=0)
    else:
        if not TRACE.is_file():
            pytest.skip(f"the Mooncake conversation trace is not at {TRACE}")
        cpu_stand_ins()
        requests = list(read_trace(TRACE, block_size=512, limit=MOONCAKE_REQUESTS))
    fixed = []
    fresh = FRESH_TOKEN_BASE
    for request in requests:
        output = request.output
        if output is None:
            output = range(fresh, fresh + request.output_len)
            fresh += request.output_len
        fixed.append((array("q", request.prompt.tolist()), array("q", output)))
    return fixed


class _Worker:
    """The TP worker's one HiCache call."""

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


def _copy_rows(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``sgl_kernel``'s ``transfer_kv_direct`` (CUDA) as torch indexing, as in the tests."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def cpu_stand_ins() -> None:
    """What SGLang's HiCache needs to run on a CPU (see tests/integrations/
    test_sglang_hicache.py): no pinning registration, a no-op stream sync, torch copies."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    common._cuda_host_register = lambda *args, **kwargs: None
    torch.cpu.Stream.synchronize = lambda self: None
    mha.transfer_kv_direct = _copy_rows


class Loop:
    """One implementation's cache and pools, and the loop over a workload."""

    def __init__(self, implementation: str, case: str, requests: list) -> None:
        page_size, pool = CASES[case]
        self.page_size = page_size
        longest = max(len(p) + len(o) for p, o in requests) + 2 * page_size
        kv_pool = MHATokenToKVPool(size=pool, page_size=page_size, dtype=torch.float16,
                                   head_num=1, head_dim=1, layer_num=1, device="cpu",
                                   enable_memory_saver=False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(pool, torch.float16, "cpu", kv_pool,
                                                    need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(pool, page_size, torch.float16, "cpu",
                                                         kv_pool, need_sort=False)
        self.rows = ReqToTokenPool(size=2, max_context_len=longest, device="cpu",
                                   enable_memory_saver=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.rows,
                                 token_to_kv_pool_allocator=self.allocator,
                                 page_size=page_size)
        backend = "radixcache" if implementation == "radixcache" else None
        backend_module.register()
        self.hicache = case.endswith("hicache")
        fields = {}
        if self.hicache:
            fields = dict(enable_hierarchical_cache=True, hicache_ratio=HICACHE_RATIO,
                          hicache_size=0, hicache_write_policy=HICACHE_WRITE_POLICY,
                          hicache_io_backend="direct", hicache_mem_layout="layer_first")
        with _CONTEXT.override_server_args(radix_cache_backend=backend, **fields) as args:
            ctx = registry.TreeCacheBuildContext(
                server_args=args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                enable_hierarchical_cache=self.hicache, disable_radix_cache=False,
                tp_worker=_Worker(), model_config=None, tp_size=1, tp_rank=0, tp_group=None)
            self.cache = registry.create_tree_cache(ctx)
        if implementation == "sglang" and self.cache._tree_core_backend != "rust":
            pytest.skip("SGLang fell back to its Python TreeCore")
        self.requests = [Req(f"r{i}", "", prompt, SamplingParams(max_new_tokens=len(output)))
                         for i, (prompt, output) in enumerate(requests)]
        self.outputs = [output for _, output in requests]
        self._depth, self._seconds, self._allocator_seconds = [0], [0.0], [0.0]
        for name in CACHE_CALLS + (HICACHE_CALLS if self.hicache else ()):
            self._time_calls(name)
        for name in ALLOCATOR_CALLS:
            self._time_allocator(name)
        if self.hicache:  # SGLang's controller and host pools: the same work for both caches
            controller = self.cache.cache_controller
            for name in CONTROLLER_CALLS:
                self._time_allocator(name, controller)
            group = controller.mem_pool_host
            for name in ("free", "available_size"):
                self._time_allocator(name, group)
                self._time_allocator(name, group.anchor_entry.host_pool)

    def _time_allocator(self, name: str, owner=None) -> None:
        """Time the allocator's work done inside the cache's calls (the frees a cache makes:
        the same slots for both caches); ``owner``: the controller or a host pool instead."""
        owner = self.allocator if owner is None else owner
        method = getattr(owner, name)
        clock = time.perf_counter
        depth, seconds = self._depth, self._allocator_seconds

        def timed(*args, **kwargs):
            if depth[0] != 1:
                return method(*args, **kwargs)
            depth[0] = 2
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += clock() - start
                depth[0] = 1

        setattr(owner, name, timed)

    def _time_calls(self, name: str) -> None:
        """Time the scheduler's calls of ``name`` on this cache (outermost calls only: a
        checkpoint's own lock is inside the checkpoint's time)."""
        method = getattr(self.cache, name)
        clock = time.perf_counter
        depth, seconds = self._depth, self._seconds

        def timed(*args, **kwargs):
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] = 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += clock() - start
                depth[0] = 0

        setattr(self.cache, name, timed)

    def run(self) -> dict:
        clock = time.perf_counter
        cache, rows, page_size = self.cache, self.rows, self.page_size
        prompt_tokens = cached_tokens = host_tokens = 0
        loop_start = clock()
        hicache = self.hicache
        for req, output in zip(self.requests, self.outputs):
            if hicache:
                cache.check_hicache_events()
            req.init_next_round_input(cache)
            if hicache and req.host_hit_length > 0:
                lock = cache.lock(req.last_node)  # PrefillAdder.add_one_req's pin
                loaded, req.last_node = cache.init_load_back(InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length,
                    req=req))
                req.prefix_len += loaded
                host_tokens += loaded
                req.kv.cache_protected_len = req.prefix_len
                cache.unlock(lock)
            req.lock = cache.lock(req.last_node)
            if hicache:
                cache.ready_to_load_host_cache()
            prefix = cache.prefix_device_indices(req)
            prefix_len = req.prefix_len
            prompt_tokens += len(req.origin_input_ids)
            cached_tokens += prefix_len
            rows.alloc([req])
            row = req.kv.req_pool_idx
            rows.write((row, slice(0, prefix_len)), prefix)
            total = len(req.origin_input_ids) + len(output)
            need = total - prefix_len
            if page_size == 1:
                slots = alloc_token_slots(cache, need)
            else:
                lens = torch.tensor([prefix_len])
                ends = torch.tensor([total])
                last = torch.tensor([-1 if prefix_len == 0 else int(prefix[-1])])
                slots = alloc_paged_token_slots_extend(cache, lens, lens, ends, ends, last, need)
            rows.write((row, slice(prefix_len, total)), slots)
            req.output_ids.extend(output)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = total
            req.finished_reason = FINISH_LENGTH(length=len(output))
            release_kv_cache(req, cache, checkpoint=True)
            if hicache:
                cache.flush_pending_backups()
        loop_seconds = clock() - loop_start
        return {"cache": self._seconds[0], "loop": loop_seconds,
                "tree": self._seconds[0] - self._allocator_seconds[0],
                "hit_rate": cached_tokens / prompt_tokens,
                "host_hit_rate": host_tokens / prompt_tokens,
                "tokens": cache.total_size()[0]}


def interleaved(cases: list, rounds: int) -> dict:
    """Each case's implementations one round each in turn; the best round of each."""
    results = {}
    for case in cases:
        requests = workload(case)
        best: dict = {}
        for rnd in range(rounds + 1):  # round 0 warms up, uncounted
            for name in IMPLEMENTATIONS:
                loop = Loop(name, case, requests)
                gc.collect()
                gc.disable()
                try:
                    run = loop.run()
                finally:
                    gc.enable()
                del loop
                if rnd:
                    old = best.setdefault(name, dict(run))
                    for what in ("cache", "tree", "loop"):
                        old[what] = min(old[what], run[what])
        assert best["radixcache"]["hit_rate"] > 0
        results[case] = best
    return results


def print_table(results: dict, rounds: int) -> None:
    print(f"best of {rounds} interleaved rounds; ratio = SGLang's time / radixcache's")
    print(f"{'case':17s} {'impl':11s} {'cache calls':>12s} {'w/o allocator':>14s} "
          f"{'whole loop':>11s} {'hit rate':>9s}")
    for case, best in results.items():
        ours = best["radixcache"]
        for name, run in best.items():
            host = (f" (host {run['host_hit_rate']:.4f})" if case.endswith("hicache") else "")
            print(f"{case:17s} {name:11s} {run['cache'] * 1e3:10.1f}ms {run['tree'] * 1e3:12.1f}ms"
                  f" {run['loop'] * 1e3:9.1f}ms {run['hit_rate']:9.4f}{host}")
        theirs = best["sglang"]
        print(f"{case:17s} {'ratio':11s} {theirs['cache'] / ours['cache']:11.2f}x "
              f"{theirs['tree'] / ours['tree']:13.2f}x {theirs['loop'] / ours['loop']:10.2f}x")


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_backend_loop(benchmark, note, implementation, case):
    benchmark.group = f"SGLang scheduler loop: {case}"
    requests = workload(case)
    runs = []

    def fresh():
        return (Loop(implementation, case, requests),), {}

    benchmark.pedantic(lambda loop: runs.append(loop.run()), setup=fresh, rounds=3,
                       iterations=1, warmup_rounds=1)
    assert len({run["hit_rate"] for run in runs}) == 1
    best = min(run["cache"] for run in runs)
    benchmark.extra_info.update(cache_seconds_min=best, hit_rate=runs[0]["hit_rate"])
    note(f"cache calls only: min {best * 1e3:.1f} ms; hit rate {runs[0]['hit_rate']:.4f}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    with _CONTEXT.override_server_args(radix_cache_backend=None):
        table = interleaved([c for c in args.cases.split(",") if c], args.rounds)
    print_table(table, args.rounds)

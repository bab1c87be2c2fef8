"""radixcache beside SGLang 0.5.23: the same serving loop on three prefix caches.

- ``radixcache``: this package on its compiled core (``RadixCache(core="c")``);
- ``sglang-python``: SGLang's classic Python ``RadixCache`` (``create_simulated``);
- ``sglang-rust``: SGLang's Rust TreeCore (``sglang.srt.mem_cache.rust_tree_core``, bundled in
  the wheel), driven through SGLang's own ``UnifiedRadixCache`` with
  ``tree_core_backend="rust"``, as a serving engine drives it.

The loop is ``radixcache.workloads.serve``'s, written once against a small adapter per cache:
match the prompt (and fetch its KV indices), lock, evict when the pool is short, allocate,
insert prompt + output (the cache then returns the slots of tokens it already held to the
pool), unlock. The same requests (fresh output ids fixed in advance, so every cache gets
identical token lists) go to the same kind of pool (``radixcache.workloads.KVPool``), whose
free list each cache feeds: radixcache through its ``evict`` callback, SGLang through the
allocator's ``free_segment`` that its caches call. Only the time inside cache calls is
counted (``perf_counter`` around each call, the frees they trigger included); building keys
and kv tensors is the loop's own work and is not. The timing table shows the whole loop; the
cache-call times, hit rates and the ratios are in the end-of-run summary.

Decisions: all three make the same matches, locks and evictions except where SGLang's split
rule (it also refreshes the unmatched lower half of a split node) picks a different LRU victim,
which shifts hit rates by at most a few hundredths of a point here; the summary prints each
cache's hit rate so this is visible.

Torch runs single-threaded here (``torch.set_num_threads(1)``), as one scheduler thread
would, and every case runs one untimed warm-up round first: the first pass over a fresh
process's memory pays page faults for SGLang's per-split tensor copies, which made single
rounds vary several-fold.

Workloads (sizes from ``_cases.FULL``): synthetic chat (300 conversations, pool 65,536 tokens)
and the first 2,000 requests of the Mooncake trace (pool 2^22 tokens), page sizes 1 and 16;
and the eviction-heavy case: the chat's first 3,000 requests in a 65,536-token pool, page
size 1 (about 72% of the prompt tokens hit; evict runs on most requests), where
``radixcache-batch`` is radixcache with ``evict(..., batch=True)`` (one free per evict call,
as an engine that groups its frees would use it). Skipped without SGLang
(``bash tests/install_sglang.sh``)::

    python -m pytest benchmarks/bench_vs_sglang.py --benchmark-group-by=group \\
        --benchmark-columns=min,mean,rounds

``python benchmarks/bench_vs_sglang.py [--rounds N] [--cases chat-heavy,chat,mooncake]`` runs
the same loops with the implementations' rounds interleaved (steadier ratios on a loaded
machine) and prints each one's best cache-call time and its ratio to radixcache's.
"""

from __future__ import annotations

import time
from array import array

import numpy as np
import pytest
import torch

from _cases import FULL, SERVE_PAGE_SIZES
from radixcache import RadixCache
from radixcache._core import CORES
from radixcache.workloads import FRESH_TOKEN_BASE, KVPool, synthetic_chat

try:
    from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InsertParams,
                                                        MatchPrefixParams)
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import _rust_fallback_reason
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

IMPLEMENTATIONS = ("radixcache", "sglang-python", "sglang-rust")
torch.set_num_threads(1)
CHAT_ROUNDS = 5
TRACE_ROUNDS = 3

#: (workload, page size) -> implementation -> (best cache seconds, hit rate)
_RESULTS: dict = {}


class _Allocator:
    """What SGLang's caches call to free KV slots: returns them to our KVPool."""

    device = "cpu"

    def __init__(self, pool: KVPool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size

    def free_segment(self, value, start_pos=0) -> None:
        self.pool.free(value)

    def free(self, value) -> None:
        self.pool.free(value)


class _LockByNode:
    """Lock, unlock and evictable size as radixcache and SGLang's Python cache spell them."""

    def lock(self, node):
        self.cache.inc_lock_ref(node)
        return node

    def unlock(self, node) -> None:
        self.cache.dec_lock_ref(node)

    def evictable(self) -> int:
        return self.cache.evictable_size()


class _Radixcache(_LockByNode):
    def __init__(self, page_size: int, pool: KVPool) -> None:
        self.cache = RadixCache(page_size=page_size, core="c")
        self.pool = pool

    @staticmethod
    def key(tokens: np.ndarray):
        return tokens

    def match(self, key):
        match = self.cache.match_prefix(key)
        return match.length, match.indices, match.last_node

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens, self.pool.free)

    def insert(self, key, kv: torch.Tensor, cached: int) -> None:
        prefix_len = self.cache.insert(key, kv).prefix_len
        if prefix_len > cached:
            self.pool.free(kv[cached:prefix_len])

    def total(self) -> int:
        return self.cache.total_size()


class _SGLangPython(_LockByNode):
    def __init__(self, page_size: int, pool: KVPool) -> None:
        self.cache = SGLangRadixCache.create_simulated(
            mock_allocator=_Allocator(pool, page_size), page_size=page_size)
        self.pool = pool

    @staticmethod
    def key(tokens: np.ndarray):
        return array("q", tokens.tobytes())

    def match(self, key):
        result = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(key)))
        node = result.last_device_node
        return result.device_prefix_len, self.cache.path_device_indices(node), node

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def insert(self, key, kv: torch.Tensor, cached: int) -> None:
        # As SGLang's scheduler does: the caller frees the slots the tree already had.
        prefix_len = self.cache.insert(InsertParams(key=RadixKey(key), value=kv)).prefix_len
        if prefix_len > cached:
            self.pool.free(kv[cached:prefix_len])

    def total(self) -> int:
        return self.cache.total_size()


def _unified_params(page_size: int, pool: KVPool) -> CacheInitParams:
    return CacheInitParams(disable=False, req_to_token_pool=None,
                           token_to_kv_pool_allocator=_Allocator(pool, page_size),
                           page_size=page_size, tree_components=(ComponentType.FULL,),
                           tree_core_backend="rust")


class _SGLangRust(_SGLangPython):
    def __init__(self, page_size: int, pool: KVPool) -> None:
        params = _unified_params(page_size, pool)
        self.cache = UnifiedRadixCache(params=params)
        if self.cache._tree_core_backend != "rust":
            pytest.skip(f"SGLang fell back to its Python TreeCore: {_rust_fallback_reason(params)}")
        self.pool = pool

    def lock(self, node):
        return self.cache.lock(node)

    def unlock(self, lock) -> None:
        self.cache.unlock(lock)

    def insert(self, key, kv: torch.Tensor, cached: int) -> None:
        # The unified cache frees kv[prev_prefix_len:prefix_len] itself.
        self.cache.insert(InsertParams(key=RadixKey(key), value=kv, prev_prefix_len=cached))

    def total(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()


class _RadixcacheBatch(_Radixcache):
    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens, self.pool.free, batch=True)


_ADAPTERS = {"radixcache": _Radixcache, "sglang-python": _SGLangPython,
             "sglang-rust": _SGLangRust, "radixcache-batch": _RadixcacheBatch}

#: The eviction-heavy case: the chat's first HEAVY_REQUESTS requests, pool FULL.chat_capacity.
HEAVY_REQUESTS = 3000
HEAVY_IMPLEMENTATIONS = IMPLEMENTATIONS + ("radixcache-batch",)


def heavy_chat_requests() -> list:
    return synthetic_chat(num_conversations=HEAVY_REQUESTS // 4 + 50,
                          num_system_prompts=FULL.chat_system_prompts, seed=0)[:HEAVY_REQUESTS]


def _fixed_requests(requests) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, prompt + output) per request, fresh output ids numbered as ``serve`` does."""
    fixed = []
    next_fresh = FRESH_TOKEN_BASE
    for request in requests:
        output = request.output
        if output is None:
            output = np.arange(next_fresh, next_fresh + request.output_len, dtype=np.int64)
            next_fresh += request.output_len
        fixed.append((request.prompt, np.concatenate((request.prompt, output))))
    return fixed


def serve_with(side, keyed: list, page_size: int, pool: KVPool) -> dict:
    """``radixcache.workloads.serve`` against an adapter; times only the adapter's calls."""
    clock = time.perf_counter
    seconds = 0.0
    prompt_tokens = cached_tokens = evicted = rejected = 0
    for prompt_key, full_key, prompt_len, full_len in keyed:
        start = clock()
        cached, indices, node = side.match(prompt_key)
        lock = side.lock(node)
        seconds += clock() - start
        prompt_tokens += prompt_len
        cached_tokens += cached
        need = full_len - cached
        short = need - pool.available
        if short > 0:
            start = clock()
            evictable = side.evictable()
            if short <= evictable:
                evicted += side.evict(short)
            seconds += clock() - start
        new_slots = pool.alloc(need)
        if new_slots is None:
            rejected += 1
            start = clock()
            side.unlock(lock)
            seconds += clock() - start
            continue
        kv = torch.cat((indices, new_slots)) if cached else new_slots
        start = clock()
        side.insert(full_key, kv, cached)
        seconds += clock() - start
        aligned_len = full_len - full_len % page_size
        if aligned_len < full_len:
            pool.free(kv[aligned_len:])
        start = clock()
        side.unlock(lock)
        seconds += clock() - start
    return {"seconds": seconds, "hit_rate": cached_tokens / prompt_tokens,
            "evicted": evicted, "rejected": rejected, "tokens": side.total()}


def _run(benchmark, note, implementation, workload, page_size, requests, capacity, rounds):
    adapter = _ADAPTERS[implementation]
    fixed = _fixed_requests(requests)
    runs = []

    def fresh():
        pool = KVPool(capacity)
        side = adapter(page_size, pool)
        keyed = [(side.key(prompt), side.key(full), len(prompt), len(full))
                 for prompt, full in fixed]
        return (side, keyed, pool), {}

    def loop(side, keyed, pool):
        runs.append(serve_with(side, keyed, page_size, pool))

    benchmark.pedantic(loop, setup=fresh, rounds=rounds, iterations=1, warmup_rounds=1)
    first = runs[0]
    assert all(run["hit_rate"] == first["hit_rate"] for run in runs)
    assert first["rejected"] == 0 and first["evicted"] > 0  # the pool forced eviction
    best = min(run["seconds"] for run in runs)
    benchmark.extra_info.update(cache_seconds_min=best, hit_rate=first["hit_rate"],
                                evicted_tokens=first["evicted"], capacity=capacity)
    _RESULTS.setdefault((workload, page_size), {})[implementation] = (best, first["hit_rate"])
    line = f"cache calls only: min {best * 1e3:.1f} ms; hit rate {first['hit_rate']:.4f}"
    baseline = _RESULTS[(workload, page_size)].get("radixcache")
    if baseline is not None and implementation != "radixcache":
        line += f"; {best / baseline[0]:.2f}x radixcache's time"
    note(line)


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("page_size", SERVE_PAGE_SIZES, ids=lambda p: f"page{p}")
def test_vs_sglang_chat(benchmark, note, implementation, page_size, chat):
    benchmark.group = f"vs SGLang: serving loop, synthetic chat, page_size={page_size}"
    _run(benchmark, note, implementation, "chat", page_size, chat, FULL.chat_capacity,
         CHAT_ROUNDS)


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("page_size", SERVE_PAGE_SIZES, ids=lambda p: f"page{p}")
def test_vs_sglang_mooncake(benchmark, note, implementation, page_size, trace):
    benchmark.group = (f"vs SGLang: Mooncake trace, first {FULL.trace_limit} requests, "
                       f"page_size={page_size}")
    _run(benchmark, note, implementation, "mooncake", page_size, trace,
         FULL.trace_capacity, TRACE_ROUNDS)


@pytest.fixture(scope="module")
def chat_heavy():
    requests = heavy_chat_requests()
    assert len(requests) == HEAVY_REQUESTS
    return requests


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("implementation", HEAVY_IMPLEMENTATIONS)
def test_vs_sglang_chat_eviction_heavy(benchmark, note, implementation, chat_heavy):
    benchmark.group = (f"vs SGLang: serving loop, synthetic chat, {HEAVY_REQUESTS} requests, "
                       f"pool {FULL.chat_capacity}, page_size=1 (eviction-heavy)")
    _run(benchmark, note, implementation, "chat-heavy", 1, chat_heavy, FULL.chat_capacity,
         CHAT_ROUNDS)


def _interleaved(cases: list[str], rounds: int) -> None:
    """Each case's implementations one round each in turn, ``rounds`` times; best of each."""
    import gc

    from _cases import chat_requests, trace_requests

    plans = {"chat-heavy": [(1, heavy_chat_requests, FULL.chat_capacity, HEAVY_IMPLEMENTATIONS)]}
    plans["chat"] = [(p, lambda: chat_requests(FULL), FULL.chat_capacity, IMPLEMENTATIONS)
                     for p in SERVE_PAGE_SIZES]
    plans["mooncake"] = [(p, lambda: trace_requests(FULL.trace_limit), FULL.trace_capacity,
                          IMPLEMENTATIONS) for p in SERVE_PAGE_SIZES]
    for case in cases:
        for page_size, make, capacity, implementations in plans[case]:
            fixed = _fixed_requests(make())
            best: dict = {}
            for rnd in range(rounds + 1):  # round 0: warm-up, not counted
                for name in implementations:
                    pool = KVPool(capacity)
                    side = _ADAPTERS[name](page_size, pool)
                    keyed = [(side.key(prompt), side.key(full), len(prompt), len(full))
                             for prompt, full in fixed]
                    gc.collect()
                    run = serve_with(side, keyed, page_size, pool)
                    if rnd:
                        old = best.get(name)
                        if old is None or run["seconds"] < old["seconds"]:
                            best[name] = run
                    del side, keyed, pool
            base = best["radixcache"]["seconds"]
            print(f"{case}, {len(fixed)} requests, pool {capacity}, page {page_size}, best of "
                  f"{rounds} interleaved rounds (cache calls only):")
            for name, run in best.items():
                print(f"  {name:17s} {run['seconds'] * 1e3:9.1f} ms  {run['seconds'] / base:6.2f}x"
                      f" radixcache's time  hit rate {run['hit_rate']:.4f}  evicted "
                      f"{run['evicted']}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="radixcache vs SGLang, interleaved rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="chat-heavy,chat,mooncake")
    args = parser.parse_args()
    _interleaved([c for c in args.cases.split(",") if c], args.rounds)

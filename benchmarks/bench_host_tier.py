"""The host tier's cost in the cache calls of a serving loop, side by side with one tier.

The synthetic chat workload (``chat`` fixture) replayed per request as an engine would:
match -> (with a host tier: load the host part back) -> lock -> evict on shortage (with a
host tier: ``backup`` hands out host slots, and ``evict_host`` keeps the host under its
capacity) -> insert prompt + answer -> unlock. Same device capacity in both rows; the host
holds 8x the device. Only the cache calls are timed (the loop's bookkeeping is not): compare
the ``host tier`` row to the ``one tier`` row of the same core (the ratio is what matters;
the host tier also does more: it loads back what one tier recomputes).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from radixcache import RadixCache

DEVICE_CAPACITY = 65536
HOST_CAPACITY = 8 * DEVICE_CAPACITY
ROUNDS = 3


def replay(cache: RadixCache, prompts: list, sequences: list, tiered: bool) -> float:
    """Seconds spent inside cache calls for the whole workload."""
    next_slot = 0
    next_host = 0

    def backup(device_indices):
        nonlocal next_host
        n = device_indices.shape[0]
        out = torch.arange(next_host, next_host + n)
        next_host += n
        return out

    spent = 0.0
    clock = time.perf_counter
    for prompt, seq in zip(prompts, sequences):
        start = clock()
        match = cache.match_prefix(prompt)
        node = match.last_node
        if match.host_length:
            cache.load_back(match, torch.arange(next_slot, next_slot + match.host_length))
            next_slot += match.host_length
            node = match.last_host_node
        cache.inc_lock_ref(node)
        short = cache.total_size() + len(seq) - DEVICE_CAPACITY
        if short > 0:
            if tiered:
                cache.evict(short, backup=backup)
                over = cache.host_size() - HOST_CAPACITY
                if over > 0:
                    cache.evict_host(over)
            else:
                cache.evict(short)
        kv = torch.arange(next_slot, next_slot + len(seq))
        next_slot += len(seq)
        cache.insert(seq, kv)
        cache.dec_lock_ref(node)
        spent += clock() - start
    return spent


@pytest.mark.parametrize("tiered", [False, True], ids=["one tier", "host tier"])
def test_serving_cache_calls(benchmark, note, core, chat, tiered):
    prompts = [np.asarray(r.prompt, dtype=np.int64) for r in chat]
    sequences = [np.concatenate([p, np.asarray(r.output, dtype=np.int64)])
                 for p, r in zip(prompts, chat)]
    spent = []
    caches = []

    def fresh():
        cache = RadixCache(page_size=16, core=core, host_tier=tiered)
        caches.append(cache)
        return (cache,), {}

    benchmark.group = "host tier: serving loop cache calls, page 16"
    benchmark.pedantic(lambda cache: spent.append(replay(cache, prompts, sequences, tiered)),
                       setup=fresh, rounds=ROUNDS, iterations=1)
    stats = caches[-1].stats()
    benchmark.extra_info["cache_seconds_min"] = min(spent)
    note(f"{min(spent) * 1e3:.1f} ms in cache calls (best of {ROUNDS}); device hit rate "
         f"{stats.hit_rate:.1%}, host-hit tokens {stats.host_hit_tokens}")

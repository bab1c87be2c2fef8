"""``evict(batch=True, page_ids=True)``: the batch holds the page id of every freed page
(every ``page_size``-th index of each victim, floor-divided by ``page_size``) instead of the
indices, in the same order; bad arguments change nothing; on every core."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import check_invariants
from test_evict import POLICIES, build


def test_page_ids_hand_worked(make_cache):
    cache = make_cache(page_size=4)
    cache.insert(list(range(8)), list(range(40, 48)))  # pages 10, 11
    cache.insert([9, 9, 9, 9], [-7, -6, -5, -4])  # page -2: -7 // 4, floored as numpy
    cache.insert([0, 1, 2, 3, 7, 7, 7, 7], [40, 41, 42, 43, 13, 14, 15, 16])  # page 3
    got = []
    assert cache.evict(100, got.append, batch=True, page_ids=True) == 16
    assert len(got) == 1 and got[0].dtype == torch.int64
    # LRU: [4..7] (pages 11), then [9,9,9,9] (-2), then the split's second child [13..16]
    # (3, its first slot 13 // 4), then their parent [40..43] (10).
    assert got[0].tolist() == [11, -2, 3, 10]
    assert cache.total_size() == 0 and cache.stats().evicted_tokens == 16
    check_invariants(cache)


def test_page_ids_of_keys_doubling_as_indices(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([6, 7, 1, 1])
    got = []
    assert cache.evict(2, got.append, batch=True, page_ids=True) == 4  # one node
    assert got[0].tolist() == [3, 0]  # 6 // 2, 1 // 2
    check_invariants(cache)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size,with_kv", [(1, True), (4, True), (4, False), (16, True)])
def test_page_ids_are_the_batch_every_page_size_th_floor_divided(core_name, policy, page_size,
                                                                 with_kv):
    for seed in range(3):
        plain, _ = build(core_name, policy, page_size, seed, with_kv)
        paged, _ = build(core_name, policy, page_size, seed, with_kv)
        for num_tokens in (1, 5 * page_size, 10**9):
            indices, pages = [], []
            freed = plain.evict(num_tokens, indices.append, batch=True)
            assert paged.evict(num_tokens, pages.append, batch=True, page_ids=True) == freed
            assert len(pages) == len(indices) <= 1
            if indices:
                expected = indices[0].numpy()[::page_size] // page_size
                assert pages[0].tolist() == expected.tolist()
            assert paged.stats() == plain.stats()
            check_invariants(paged)


def test_page_ids_numpy_arrays(make_cache):
    cache = make_cache(page_size=2, array_type="numpy")
    cache.insert([1, 2, 3, 4], np.array([10, 11, 20, 21]))
    got = []
    assert cache.evict(4, got.append, batch=True, page_ids=True) == 4
    assert type(got[0]) is np.ndarray and got[0].tolist() == [5, 10]


def test_page_ids_bad_arguments_change_nothing(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11, 20, 21])
    before = (cache.stats(), cache.total_size(), cache.evictable_size())
    got = []
    with pytest.raises(ValueError, match="page_ids=True.*batch=True"):
        cache.evict(4, got.append, page_ids=True)
    with pytest.raises(TypeError, match="page_ids must be a bool"):
        cache.evict(4, got.append, batch=True, page_ids=1)
    assert got == [] and (cache.stats(), cache.total_size(), cache.evictable_size()) == before
    host = make_cache(page_size=2, host_tier=True)
    host.insert([1, 2], [10, 11])
    with pytest.raises(ValueError, match="without a host tier"):
        host.evict(2, got.append, batch=True, page_ids=True)
    assert got == [] and host.total_size() == 2
    check_invariants(cache)


def test_page_ids_hook_calling_the_cache_is_refused(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11, 20, 21])
    cache.insert([5, 6], [30, 31])

    def reenter(node):
        cache.evict(2)

    got = []
    with pytest.raises(RuntimeError):
        cache.evict(2, got.append, batch=True, page_ids=True, on_remove=reenter)
    assert got == [] and cache.total_size() == 6 and cache.stats().evictions == 0
    check_invariants(cache)


def test_page_ids_callback_may_call_the_cache(make_cache):
    cache = make_cache(page_size=2)
    for i in range(3):
        cache.insert([i, i], [2 * i, 2 * i + 1])
    got = []

    def free(pages):
        got.append(pages.tolist())
        got.append(cache.evict(100))  # outside the guard: allowed

    assert cache.evict(2, free, batch=True, page_ids=True) == 2
    assert got == [[0], 4] and cache.total_size() == 0
    check_invariants(cache)

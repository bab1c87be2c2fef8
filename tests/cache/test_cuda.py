"""kv_indices on a CUDA device: the cache keeps them there, copies them, and hands them back."""

from __future__ import annotations

import pytest
import torch

from conftest import check_invariants, core_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cuda")


def test_match_returns_indices_on_the_device(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3, 4], kv_indices=cuda_tensor([10, 11, 12, 13]))
    cache.insert([1, 2, 7], kv_indices=cuda_tensor([20, 21, 22]))
    whole = cache.match_prefix([1, 2, 3, 4])
    assert whole.indices.device.type == "cuda"
    assert whole.indices.dtype == torch.int64
    assert whole.indices.tolist() == [10, 11, 12, 13]
    # A path of several nodes is concatenated on the device too.
    branch = cache.match_prefix([1, 2, 7, 9])
    assert branch.length == 3
    assert branch.indices.device.type == "cuda"
    assert branch.indices.tolist() == [10, 11, 22]
    # A match ending inside a node splits the device tensor as well.
    split = cache.match_prefix([1, 2, 3])
    assert split.indices.device.type == "cuda"
    assert split.indices.tolist() == [10, 11, 12]
    check_invariants(cache)


def test_path_mixing_cpu_and_device_nodes_comes_back_on_the_device(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3])  # no kv_indices: the tokens, on the CPU
    cache.insert([1, 2, 3, 4, 5], kv_indices=cuda_tensor([0, 0, 0, 60, 61]))
    result = cache.match_prefix([1, 2, 3, 4, 5])
    assert result.indices.device.type == "cuda"
    assert result.indices.tolist() == [1, 2, 3, 60, 61]


def test_insert_copies_the_device_tensor(make_cache):
    cache = make_cache()
    kv = cuda_tensor([30, 31, 32])
    cache.insert([5, 6, 7], kv_indices=kv)
    kv.fill_(-1)
    result = cache.match_prefix([5, 6, 7])
    assert result.indices.tolist() == [30, 31, 32]
    result.indices.fill_(-2)  # nor may the returned tensor alias the cache's copy
    assert cache.match_prefix([5, 6, 7]).indices.tolist() == [30, 31, 32]


def test_int32_device_indices_are_stored_as_int64(make_cache):
    cache = make_cache()
    cache.insert([1, 2], kv_indices=torch.tensor([8, 9], dtype=torch.int32, device="cuda"))
    result = cache.match_prefix([1, 2])
    assert result.indices.dtype == torch.int64
    assert result.indices.device.type == "cuda"
    assert result.indices.tolist() == [8, 9]


def test_evict_callback_gets_device_tensors(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=cuda_tensor([40, 41, 42]))
    cache.insert([1, 2, 9], kv_indices=cuda_tensor([50, 51, 52]))
    got = []
    assert cache.evict(4, got.append) == 4
    assert all(t.device.type == "cuda" and t.dtype == torch.int64 for t in got)
    assert sorted(t.tolist() for t in got) == [[40, 41], [42], [52]]
    assert cache.total_size() == 0
    check_invariants(cache)


def test_bad_device_kv_indices_change_nothing(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=cuda_tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="kv_indices"):
        cache.insert([1, 2, 3, 4], kv_indices=cuda_tensor([1, 2]))
    with pytest.raises(TypeError, match="integer"):
        cache.insert([1, 2, 9], kv_indices=torch.ones(3, device="cuda"))
    assert cache.node_count() == 1 and cache.total_size() == 3
    check_invariants(cache)


def test_cuda_token_ids_are_rejected(make_cache):
    cache = make_cache()
    with pytest.raises(ValueError, match="CPU"):
        cache.insert(cuda_tensor([1, 2, 3]))
    assert cache.node_count() == 0


def test_copies_and_pickles_keep_device_values(make_cache):
    import copy
    import pickle

    cache = make_cache()
    cache.insert([1, 2, 3, 4], kv_indices=cuda_tensor([10, 11, 12, 13]))
    cache.insert([1, 2, 7], kv_indices=cuda_tensor([20, 21, 22]))  # a split shares the tensor
    for other in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        check_invariants(other)
        whole = other.match_prefix([1, 2, 3, 4])
        assert whole.indices.device.type == "cuda"
        assert whole.indices.tolist() == [10, 11, 12, 13]
        assert other.match_prefix([1, 2, 7]).indices.tolist() == [10, 11, 22]
        for node, _ in core_of(other).tree.iter_nodes():
            if node.parent is not None:
                assert node.stored_value.device.type == "cuda"
        freed = []
        other.evict(100, freed.append)
        assert sorted(t.device.type for t in freed) == ["cuda"] * 3
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 11, 12, 13]


def test_host_tier_with_device_values(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], kv_indices=cuda_tensor([10, 11, 12, 13]))
    host = iter(range(100, 1000))

    def backup(device_indices):
        assert device_indices.device.type == "cuda"
        return torch.tensor([next(host) for _ in range(device_indices.shape[0])])

    freed = []
    assert cache.evict(4, freed.append, backup=backup) == 4
    assert [t.tolist() for t in freed] == [[10, 11, 12, 13]]
    # Adoption: the host-only node takes its slice of the caller's device values.
    result = cache.insert([1, 2, 3, 4, 5, 6], kv_indices=cuda_tensor([20, 21, 22, 23, 24, 25]))
    assert result.prefix_len == 0
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert whole.indices.device.type == "cuda"
    assert whole.indices.tolist() == [20, 21, 22, 23, 24, 25]
    check_invariants(cache)
    cache.evict(6, backup=backup)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert cache.load_back(m, cuda_tensor([30, 31, 32, 33, 34, 35])).tolist() == [
        100, 101, 102, 103, 104, 105]
    again = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert again.indices.device.type == "cuda"
    assert again.indices.tolist() == [30, 31, 32, 33, 34, 35]
    check_invariants(cache)

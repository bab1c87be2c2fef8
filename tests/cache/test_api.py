"""The documented RadixCache API: the seeds' examples and Smile's behaviours, on every core."""

from __future__ import annotations

import array
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import check_invariants, core_of, node_tokens
from radixcache import InsertResult, MatchResult, RadixCache, RadixTreeNode

REPO_ROOT = Path(__file__).resolve().parents[2]


def as_list(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor.tolist()]


def matched(cache, tokens, extra_key=None) -> tuple[int, list[int]]:
    result = cache.match_prefix(tokens, extra_key=extra_key)
    return result.length, as_list(result.indices)


# -- the exercise --------------------------------------------------------------------------
def test_exercise_exists_and_compression(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3, 4, 5])
    assert cache.node_count() == 1  # one node for the whole sequence: compressed
    cache.insert([1, 2, 3, 9])
    assert cache.node_count() == 3  # [1,2,3] -> {[4,5], [9]}
    assert cache.exists([1, 2, 3, 4, 5])
    assert cache.exists([1, 2, 3, 9])
    assert not cache.exists([1, 2, 3])  # only a prefix, never inserted itself
    assert not cache.exists([7])
    assert not cache.exists([1, 2, 3, 4])
    assert not cache.exists([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 3])
    assert cache.exists([1, 2, 3])
    assert cache.node_count() == 3  # [1,2,3] already had its own node
    assert cache.total_size() == 6
    check_invariants(cache)


def test_shared_prefixes_reuse_stored_indices(make_cache):
    cache = make_cache()
    first = cache.insert([1, 2, 3, 4], kv_indices=[10, 11, 12, 13])
    assert first.prefix_len == 0
    second = cache.insert([1, 2, 7, 8], kv_indices=[20, 21, 22, 23])
    assert second.prefix_len == 2
    # The shared prefix keeps the indices of its first insert.
    assert matched(cache, [1, 2, 7, 8, 9]) == (4, [10, 11, 22, 23])
    assert matched(cache, [1, 2, 3, 4]) == (4, [10, 11, 12, 13])
    assert matched(cache, [1, 2]) == (2, [10, 11])
    assert matched(cache, [5]) == (0, [])
    assert cache.total_size() == 6
    check_invariants(cache)


def test_match_inside_a_node_splits_it_keeping_the_lower_half_identity(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3, 4, 5], kv_indices=[50, 51, 52, 53, 54], priority=7).last_node
    leaf_id = leaf.id
    cache.inc_lock_ref(leaf)
    hits_before = leaf.hit_count
    assert cache.node_count() == 1

    result = cache.match_prefix([1, 2, 3, 8])
    assert result.length == 3
    assert as_list(result.indices) == [50, 51, 52]
    upper = result.last_node
    assert cache.node_count() == 2
    assert upper is not leaf
    # The existing node object stays as the lower half, same id, so held handles stay valid.
    assert leaf.id == leaf_id
    assert [int(t) for t in leaf.key] == [4, 5]
    assert as_list(leaf.value) == [53, 54]
    assert leaf.parent is upper
    assert list(upper.children) == [leaf]
    assert [int(t) for t in upper.key] == [1, 2, 3]
    assert upper.parent is cache.root_node
    # The upper half inherits what described the whole node.
    assert upper.lock_ref == leaf.lock_ref == 1
    assert upper.priority == leaf.priority == 7
    assert upper.hit_count == hits_before
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    check_invariants(cache)

    # Unlocking the held handle releases the whole path, split or not.
    assert cache.dec_lock_ref(leaf) == 5
    assert upper.lock_ref == 0
    check_invariants(cache)


def test_match_ending_on_a_node_boundary_does_not_split(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 9])
    nodes_before = cache.node_count()
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert result.length == 5
    assert cache.node_count() == nodes_before
    assert node_tokens(result.last_node) == [1, 2, 3, 4, 5]


def test_insert_diverging_inside_a_node_splits_it(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3, 4, 5]).last_node
    res = cache.insert([1, 2, 6])
    assert res.prefix_len == 2
    assert node_tokens(res.last_node) == [1, 2, 6]
    assert node_tokens(leaf) == [1, 2, 3, 4, 5]
    assert [int(t) for t in leaf.key] == [3, 4, 5]
    assert cache.node_count() == 3
    check_invariants(cache)


def test_reinsert_returns_prefix_len(make_cache):
    cache = make_cache()
    assert cache.insert([1, 2, 3, 4, 5]).prefix_len == 0
    again = cache.insert([1, 2, 3, 4, 5])
    assert isinstance(again, InsertResult)
    assert again.prefix_len == 5
    assert node_tokens(again.last_node) == [1, 2, 3, 4, 5]
    assert cache.insert([1, 2, 3, 4, 5, 6]).prefix_len == 5
    assert cache.insert([1, 2, 9]).prefix_len == 2
    assert cache.insert([1, 2, 3]).prefix_len == 3
    assert cache.total_size() == 7
    check_invariants(cache)


def test_reinsert_keeps_the_first_indices(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=[10, 11, 12])
    res = cache.insert([1, 2, 3, 4], kv_indices=[90, 91, 92, 93])
    assert res.prefix_len == 3
    assert matched(cache, [1, 2, 3, 4]) == (4, [10, 11, 12, 93])


@pytest.mark.parametrize("page_size", [2, 16])
def test_page_sizes_round_lengths_down(make_cache, page_size):
    cache = make_cache(page_size=page_size)
    seq = list(range(100, 100 + 2 * page_size + 1))  # two pages and one spare token
    kv = list(range(1000, 1000 + len(seq)))
    res = cache.insert(seq, kv_indices=kv)
    assert res.prefix_len == 0
    assert cache.total_size() == 2 * page_size
    assert node_tokens(res.last_node) == seq[: 2 * page_size]
    # Lengths are rounded down to a page: the spare token is never cached or matched.
    assert matched(cache, seq) == (2 * page_size, kv[: 2 * page_size])
    assert matched(cache, seq[: page_size + 1]) == (page_size, kv[:page_size])
    assert matched(cache, seq[: page_size - 1]) == (0, [])
    # An unaligned sequence is never "inserted exactly", and its aligned prefix was not either.
    assert not cache.exists(seq)
    assert not cache.exists(seq[: 2 * page_size])
    cache.insert(seq[: 2 * page_size])
    assert cache.exists(seq[: 2 * page_size])
    assert not cache.exists(seq[: 2 * page_size - 1])
    assert cache.insert(seq[: page_size - 1]).prefix_len == 0  # shorter than a page: nothing
    assert cache.total_size() == 2 * page_size
    check_invariants(cache)


@pytest.mark.parametrize("page_size", [2, 16])
def test_page_sizes_split_on_page_boundaries(make_cache, page_size):
    cache = make_cache(page_size=page_size)
    base = list(range(4 * page_size))
    cache.insert(base)
    # Diverge in the middle of the second page: only the first page is shared.
    other = list(base)
    other[page_size + page_size // 2] = -1
    res = cache.insert(other)
    assert res.prefix_len == page_size
    assert cache.node_count() == 3
    assert cache.total_size() == 4 * page_size + 3 * page_size
    assert matched(cache, other)[0] == 4 * page_size
    assert matched(cache, base[: 2 * page_size - 1])[0] == page_size
    check_invariants(cache)


def test_namespaces_are_isolated(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=[10, 11, 12], extra_key="a")
    assert matched(cache, [1, 2, 3]) == (0, [])
    assert matched(cache, [1, 2, 3], extra_key="b") == (0, [])
    assert matched(cache, [1, 2, 3], extra_key="a") == (3, [10, 11, 12])
    assert cache.exists([1, 2, 3], extra_key="a")
    assert not cache.exists([1, 2, 3])
    assert [1, 2, 3] not in cache
    res = cache.insert([1, 2, 3, 4], kv_indices=[20, 21, 22, 23])
    assert res.prefix_len == 0  # the default namespace shares nothing with "a"
    assert cache.node_count() == 2
    assert matched(cache, [1, 2, 3, 4]) == (4, [20, 21, 22, 23])
    assert matched(cache, [1, 2, 3, 4], extra_key="a") == (3, [10, 11, 12])
    # Any hashable works as a namespace, and equal keys are the same namespace.
    cache.insert([5, 6], extra_key=("lora", 3))
    assert cache.exists([5, 6], extra_key=("lora", 3))
    assert not cache.exists([5, 6], extra_key=("lora", 4))
    check_invariants(cache)


def test_empty_sequence_namespaces_are_isolated(make_cache):
    cache = make_cache()
    assert not cache.exists([])
    cache.insert([], extra_key="a")
    assert cache.exists([], extra_key="a")
    assert not cache.exists([])  # inserted only in namespace "a"
    assert not cache.exists([], extra_key="b")


def test_lock_unlock_sizes_and_return_values(make_cache):
    cache = make_cache()
    long_leaf = cache.insert([1, 2, 3, 4, 5]).last_node
    short_leaf = cache.insert([1, 2, 3, 9]).last_node
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)

    assert cache.inc_lock_ref(long_leaf) == -5  # [1,2,3] and [4,5] become protected
    assert (cache.evictable_size(), cache.protected_size()) == (1, 5)
    assert cache.inc_lock_ref(short_leaf) == -1  # [1,2,3] already was
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    assert cache.inc_lock_ref(short_leaf) == 0  # a second lock moves nothing
    check_invariants(cache)

    assert cache.dec_lock_ref(long_leaf) == 2  # [1,2,3] is still held through [9]
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    assert cache.dec_lock_ref(short_leaf) == 0
    assert cache.dec_lock_ref(short_leaf) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert cache.total_size() == 6
    check_invariants(cache)


def test_lock_of_an_empty_match_is_a_no_op(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3])
    miss = cache.match_prefix([7, 8])
    assert miss.length == 0
    assert miss.last_node is cache.root_node
    assert cache.inc_lock_ref(miss.last_node) == 0
    assert cache.dec_lock_ref(miss.last_node) == 0
    assert (cache.evictable_size(), cache.protected_size()) == (3, 0)


def test_root_holds_a_permanent_lock(make_cache):
    # As in SGLang: the root's lock_ref is 1 from the start, through locks of the root and of
    # nodes below it, and after reset; locking the root stays a no-op.
    cache = make_cache()
    root = cache.root_node
    assert root.lock_ref == 1
    cache.insert([1, 2, 3])
    leaf = cache.match_prefix([1, 2, 3]).last_node
    for _ in range(3):
        assert cache.inc_lock_ref(root) == 0
    assert root.lock_ref == 1
    assert cache.inc_lock_ref(leaf) == -3
    assert root.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.dec_lock_ref(leaf) == 3
    for _ in range(3):
        assert cache.dec_lock_ref(root) == 0
    assert root.lock_ref == 1
    check_invariants(cache)
    cache.reset()
    assert cache.root_node.lock_ref == 1
    check_invariants(cache)


def test_root_lock_of_caches_pickled_by_0_1_0():
    # Caches pickled while the root's lock_ref was 0 load with the permanent 1.
    import pickle

    objs = pickle.loads((REPO_ROOT / "tests" / "data" / "radixcache-0.1.0.pickle").read_bytes())
    for name in ("cache_c", "numpy_cache_c", "cache_python", "numpy_cache_python"):
        cache = objs[name]
        assert cache.root_node.lock_ref == 1, name
        out = io.StringIO()
        cache.pretty_print(file=out)
        assert out.getvalue().startswith("[len=0 key=[] lock_ref=1]\n"), name
        check_invariants(cache)


# -- eviction ------------------------------------------------------------------------------
def test_evict_frees_in_lru_order(make_cache):
    cache = make_cache()
    cache.insert([1, 1], kv_indices=[10, 11])
    cache.insert([2, 2], kv_indices=[20, 21])
    cache.insert([3, 3], kv_indices=[30, 31])
    cache.match_prefix([1, 1])  # [1,1] is now the most recently used
    freed_values = []
    assert cache.evict(1, lambda idx: freed_values.append(as_list(idx))) == 2
    assert freed_values == [[20, 21]]
    assert cache.evict(3, lambda idx: freed_values.append(as_list(idx))) == 4
    assert freed_values == [[20, 21], [30, 31], [10, 11]]
    assert cache.total_size() == 0 and cache.node_count() == 0
    check_invariants(cache)


def test_evict_takes_parents_once_they_become_leaves(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 5])
    cache.insert([9])
    cache.match_prefix([9])
    freed = []
    assert cache.evict(4, lambda idx: freed.append(as_list(idx))) == 5
    # The two leaves under [1,2] go first, then [1,2] itself, before the newer [9].
    assert sorted(freed[:2]) == [[3, 4], [5]]
    assert freed[2] == [1, 2]
    assert cache.exists([9])
    check_invariants(cache)


def test_evict_never_touches_a_locked_path(make_cache):
    cache = make_cache()
    locked = cache.insert([1, 2, 3, 4]).last_node
    cache.insert([1, 2, 7])
    cache.insert([5, 6])
    cache.inc_lock_ref(locked)
    freed = cache.evict(100)
    assert freed == 3  # [7] and [5,6]; [1,2] and [3,4] stay protected
    assert cache.exists([1, 2, 3, 4])
    assert matched(cache, [1, 2, 3, 4])[0] == 4
    assert not cache.exists([5, 6])
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(locked)
    assert cache.evict(100) == 4
    assert cache.total_size() == 0
    check_invariants(cache)


def test_evict_zero_or_negative_frees_nothing(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3])
    assert cache.evict(0) == 0
    assert cache.evict(-5) == 0
    assert cache.total_size() == 3


def test_evict_callback_receives_index_tensors(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=torch.tensor([7, 8, 9], dtype=torch.int32))
    cache.insert([4, 5])  # no kv_indices: the tokens are the indices
    got = []
    assert cache.evict(5, got.append) == 5
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in got)
    assert sorted(as_list(t) for t in got) == [[4, 5], [7, 8, 9]]


def test_evicted_node_handles_are_marked(make_cache):
    cache = make_cache()
    node = cache.insert([1, 2, 3]).last_node
    assert not node.evicted
    cache.evict(3)
    assert node.evicted


def test_raising_callback_leaves_a_consistent_cache(make_cache):
    cache = make_cache()
    for i in range(5):
        cache.insert([i, i, i])

    def explode(indices):
        raise RuntimeError("allocator refused")

    with pytest.raises(RuntimeError, match="allocator refused"):
        cache.evict(6, explode)
    check_invariants(cache)
    remaining = cache.total_size()
    assert remaining in (12, 15)  # the failing node is either gone or kept, never half-gone
    got = []
    assert cache.evict(100, got.append) == remaining
    assert sum(len(t) for t in got) == remaining
    assert cache.total_size() == 0
    check_invariants(cache)


# -- inputs --------------------------------------------------------------------------------
INPUT_KINDS = {
    "list": list,
    "tuple": tuple,
    "array_q": lambda seq: array.array("q", seq),
    "array_i": lambda seq: array.array("i", seq),
    "numpy_int32": lambda seq: np.array(seq, dtype=np.int32),
    "numpy_int64": lambda seq: np.array(seq, dtype=np.int64),
    "numpy_uint8": lambda seq: np.array(seq, dtype=np.uint8),
    "numpy_strided": lambda seq: np.repeat(np.array(seq, dtype=np.int64), 2)[::2],
    "torch_int64": lambda seq: torch.tensor(seq, dtype=torch.int64),
    "torch_int32": lambda seq: torch.tensor(seq, dtype=torch.int32),
    "iterator": iter,  # any other iterable of ints is taken as a list
}


@pytest.mark.parametrize("kind", list(INPUT_KINDS))
def test_every_input_kind(make_cache, kind):
    convert = INPUT_KINDS[kind]
    cache = make_cache()
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    kv = list(range(200, 208))
    res = cache.insert(convert(seq), kv_indices=kv)
    assert res.prefix_len == 0
    assert cache.exists(convert(seq))
    assert cache.exists(seq)  # the same tokens, whatever container they came in
    assert not cache.exists(convert(seq[:5]))
    assert matched(cache, convert(seq[:5] + [7])) == (5, kv[:5])
    assert matched(cache, convert(seq)) == (8, kv)
    assert cache.insert(convert(seq[:3] + [8])).prefix_len == 3
    assert cache.insert(seq[:6]).prefix_len == 6
    check_invariants(cache)


@pytest.mark.parametrize(
    "kv_kind",
    ["list", "tuple", "numpy_int64", "numpy_int32", "torch_int64", "torch_int32"],
)
def test_every_kv_indices_kind(make_cache, kv_kind):
    convert = INPUT_KINDS[kv_kind]
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=convert([30, 31, 32]))
    result = cache.match_prefix([1, 2, 3])
    assert result.indices.dtype == torch.int64
    assert as_list(result.indices) == [30, 31, 32]


def test_kv_indices_longer_than_needed_are_fine(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3], kv_indices=[10, 11, 12, 13, 14])
    assert matched(cache, [1, 2, 3]) == (2, [10, 11])


@pytest.mark.parametrize("kv_kind", ["torch", "numpy", "list"])
def test_kv_indices_are_copied(make_cache, kv_kind):
    cache = make_cache()
    source = [40, 41, 42, 43]
    if kv_kind == "torch":
        kv = torch.tensor(source, dtype=torch.int64)
    elif kv_kind == "numpy":
        kv = np.array(source, dtype=np.int64)
    else:
        kv = list(source)
    cache.insert([1, 2, 3, 4], kv_indices=kv)
    kv[0] = -1
    kv[3] = -1
    assert matched(cache, [1, 2, 3, 4]) == (4, source)
    # And the returned indices are not a view into the cache either.
    result = cache.match_prefix([1, 2, 3, 4])
    result.indices[:] = -7
    assert matched(cache, [1, 2, 3, 4]) == (4, source)


def test_kv_indices_none_uses_token_ids(make_cache):
    cache = make_cache()
    cache.insert([11, 12, 13])
    cache.insert([11, 12, 14, 15], kv_indices=None)
    assert matched(cache, [11, 12, 13]) == (3, [11, 12, 13])
    assert matched(cache, [11, 12, 14, 15]) == (4, [11, 12, 14, 15])
    result = cache.match_prefix([11, 12, 13])
    result.indices[:] = 0  # a private copy, not the node's read-only key buffer
    assert matched(cache, [11, 12, 13]) == (3, [11, 12, 13])


def test_match_result_is_a_context_manager_with_len(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], kv_indices=[5, 6, 7])
    with cache.match_prefix([1, 2, 3, 4]) as result:
        assert isinstance(result, MatchResult)
        assert len(result) == 3 == result.length
        assert as_list(result.indices) == [5, 6, 7]
        assert isinstance(result.last_node, RadixTreeNode)
    assert result.indices.numel() == 0  # closed: the tensor reference is dropped
    assert len(result) == 3
    assert matched(cache, [1, 2, 3]) == (3, [5, 6, 7])  # the cache keeps its own copy
    miss = cache.match_prefix([9])
    assert len(miss) == 0 and miss.indices.numel() == 0 and miss.indices.dtype == torch.int64


def test_in_operator(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3])
    assert [1, 2, 3] in cache
    assert (1, 2, 3) in cache
    assert np.array([1, 2, 3]) in cache
    assert [1, 2] not in cache
    assert [1, 2, 3, 4] not in cache


def test_empty_input(make_cache):
    cache = make_cache()
    cache.insert([1, 2])
    result = cache.match_prefix([])
    assert result.length == 0
    assert result.indices.numel() == 0
    assert result.last_node is cache.root_node
    res = cache.insert([])
    assert res.prefix_len == 0
    assert res.last_node is cache.root_node
    assert cache.insert(np.array([], dtype=np.int64), kv_indices=[]).prefix_len == 0
    assert cache.insert(torch.tensor([], dtype=torch.int64)).prefix_len == 0
    assert cache.node_count() == 1 and cache.total_size() == 2
    assert cache.evict(0) == 0
    check_invariants(cache)


# -- printing ------------------------------------------------------------------------------
def test_pretty_print_format(make_cache):
    cache = make_cache()
    leaf = cache.insert(list(range(1, 13))).last_node  # 12 tokens: only 10 are shown
    cache.match_prefix([1, 2, 3])  # split: [1,2,3] -> [4..12]
    cache.inc_lock_ref(leaf)
    out = io.StringIO()
    cache.pretty_print(out)
    assert out.getvalue() == (
        "[len=0 key=[] lock_ref=1]\n"
        "  [len=3 key=[1, 2, 3] lock_ref=1]\n"
        "    [len=9 key=[4, 5, 6, 7, 8, 9, 10, 11, 12] lock_ref=1]\n"
        "#tokens: 12\n"
    )
    cache.insert(list(range(20, 31)))  # 11 tokens
    cache.insert([1, 2, 3, 99])
    out = io.StringIO()
    cache.pretty_print(out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[len=0 key=[] lock_ref=1]"
    assert lines[-1] == "#tokens: 24"
    # Sibling order is the core's business: compare each subtree's lines as a set.
    assert len(lines) == 6
    assert set(lines[1:-1]) == {
        "  [len=3 key=[1, 2, 3] lock_ref=1]",
        "    [len=9 key=[4, 5, 6, 7, 8, 9, 10, 11, 12] lock_ref=1]",
        "    [len=1 key=[99] lock_ref=0]",
        "  [len=11 key=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, ...] lock_ref=0]",
    }
    # Pre-order: each depth-2 line comes right after [1,2,3] or another depth-2 line.
    first = lines.index("  [len=3 key=[1, 2, 3] lock_ref=1]")
    assert all(line.startswith("    ") for line in lines[first + 1:first + 3])


def test_pretty_print_defaults_to_stdout(make_cache, capsys):
    cache = make_cache()
    cache.insert([4, 2])
    cache.pretty_print()
    assert capsys.readouterr().out == (
        "[len=0 key=[] lock_ref=1]\n  [len=2 key=[4, 2] lock_ref=0]\n#tokens: 2\n"
    )


def test_smile_aliases(make_cache):
    assert RadixCache.matchPrefix is RadixCache.match_prefix
    assert RadixCache.incLockRef is RadixCache.inc_lock_ref
    assert RadixCache.decLockRef is RadixCache.dec_lock_ref
    assert RadixCache.evictableSize is RadixCache.evictable_size
    assert RadixCache.protectedSize is RadixCache.protected_size
    assert RadixCache.totalSize is RadixCache.total_size
    assert RadixCache.prettyPrint is RadixCache.pretty_print
    cache = make_cache()
    cache.insert([1, 2, 3, 4])
    result = cache.matchPrefix([1, 2, 3])
    assert result.length == 3
    assert cache.incLockRef(result.last_node) == -3
    assert (cache.evictableSize(), cache.protectedSize(), cache.totalSize()) == (1, 3, 4)
    assert cache.decLockRef(result.last_node) == 3
    out = io.StringIO()
    cache.prettyPrint(out)
    assert out.getvalue().endswith("#tokens: 4\n")


def test_reset_drops_everything_and_invalidates_handles(make_cache):
    cache = make_cache()
    held = cache.insert([1, 2, 3]).last_node
    other = cache.insert([1, 2, 4]).last_node
    cache.inc_lock_ref(held)
    cache.match_prefix([1, 2, 3])
    cache.reset()
    assert held.evicted and other.evicted
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.node_count() == 0
    assert cache.stats().lookups == 0
    with pytest.raises(ValueError, match="evicted"):
        cache.dec_lock_ref(held)
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(other)
    assert matched(cache, [1, 2, 3]) == (0, [])
    assert not cache.exists([1, 2, 3])
    # The cache is fully usable afterwards.
    assert cache.insert([1, 2, 3]).prefix_len == 0
    assert cache.exists([1, 2, 3])
    check_invariants(cache)


# -- big trees -----------------------------------------------------------------------------
# Building a chain of depth N costs Theta(N^2) token comparisons whatever the core (each
# operation starts at the root). The pure core pays an allocation per call on top, so it
# gets a shallower chain - still 20x Python's recursion limit.
CHAIN_DEPTH = {"python": 20_000}
DEFAULT_CHAIN_DEPTH = 100_000


def chain_depth(core_name: str) -> int:
    return CHAIN_DEPTH.get(core_name, DEFAULT_CHAIN_DEPTH)


def build_chain(cache, depth: int):
    """A chain of ``depth`` one-token nodes holding 0..depth-1; returns (tokens, deepest)."""
    tokens = np.arange(depth, dtype=np.int64)
    deepest = cache.insert(tokens).last_node
    # Each shorter match splits the one long node at its end; the original node object
    # ends up as the deepest one-token node.
    for end in range(depth - 1, 0, -1):
        cache.match_prefix(tokens[:end])
    return tokens, deepest


class LineCounter:
    """A write-only sink that keeps only what the test checks (full output is N^2 chars)."""

    def __init__(self) -> None:
        self.lines = 0
        self.max_indent = 0
        self.last = ""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.lines += 1
            self.max_indent = max(self.max_indent, len(line) - len(line.lstrip(" ")))
            self.last = line
        return len(text)


def test_deep_chain(make_cache, core_name):
    depth = chain_depth(core_name)
    cache = make_cache()
    tokens, deepest = build_chain(cache, depth)
    assert cache.node_count() == depth
    assert deepest.num_tokens == 1 and int(deepest.key[0]) == depth - 1
    assert cache.exists(tokens)
    assert not cache.exists(tokens[: depth // 2])

    result = cache.match_prefix(tokens)
    assert result.length == depth
    assert result.last_node is deepest
    assert torch.equal(result.indices, torch.from_numpy(tokens))

    assert cache.inc_lock_ref(deepest) == -depth
    assert cache.protected_size() == depth
    assert cache.evict(depth) == 0
    assert cache.dec_lock_ref(deepest) == depth
    assert cache.evictable_size() == depth

    depths = [d for _, d in core_of(cache).tree.iter_nodes()]
    assert depths == list(range(depth + 1))
    check_invariants(cache)

    # A chain has one leaf at a time, so eviction order is forced: deepest first.
    freed = []
    assert cache.evict(depth, lambda idx: freed.append(int(idx[0]))) == depth
    assert freed == list(range(depth - 1, -1, -1))
    assert cache.node_count() == 0 and cache.total_size() == 0
    check_invariants(cache)


def test_deep_chain_reset(make_cache, core_name):
    depth = chain_depth(core_name)
    cache = make_cache()
    _, deepest = build_chain(cache, depth)
    cache.inc_lock_ref(deepest)
    cache.reset()
    assert deepest.evicted
    with pytest.raises(ValueError):
        cache.dec_lock_ref(deepest)
    out = io.StringIO()
    cache.pretty_print(out)
    assert out.getvalue() == "[len=0 key=[] lock_ref=1]\n#tokens: 0\n"


def test_deep_chain_print(make_cache):
    # Printing writes depth^2 indentation characters, so this chain stays at 20k.
    depth = 20_000
    cache = make_cache()
    build_chain(cache, depth)
    sink = LineCounter()
    cache.pretty_print(sink)
    assert sink.lines == depth + 2
    assert sink.max_indent == 2 * depth
    assert sink.last == f"#tokens: {depth}"


def test_deep_chain_dropped_without_reset(core_name):
    # Freeing a deep tree must not recurse either; a crash here would take pytest with it,
    # hence the subprocess.
    script = (
        "import gc, numpy as np\n"
        "from radixcache import RadixCache\n"
        f"cache = RadixCache(core={core_name!r})\n"
        f"tokens = np.arange({chain_depth(core_name)})\n"
        "cache.insert(tokens)\n"
        "for end in range(len(tokens) - 1, 0, -1):\n"
        "    cache.match_prefix(tokens[:end])\n"
        "assert cache.node_count() == len(tokens)\n"
        "del cache\n"
        "gc.collect()\n"
        "print('dropped')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "dropped"


def test_single_key_of_a_million_tokens(make_cache):
    size = 1_000_000
    cache = make_cache()
    tokens = np.arange(size, dtype=np.int64) * 3
    kv = torch.arange(size, dtype=torch.int64) + 5
    leaf = cache.insert(tokens, kv_indices=kv).last_node
    assert cache.node_count() == 1 and cache.total_size() == size
    assert cache.exists(tokens)
    assert not cache.exists(tokens[:-1])
    result = cache.match_prefix(tokens)
    assert result.length == size
    assert torch.equal(result.indices, kv)
    # Split in the middle through a diverging insert.
    diverging = tokens.copy()
    diverging[size // 2] = -1
    res = cache.insert(diverging[: size // 2 + 1])
    assert res.prefix_len == size // 2
    assert cache.node_count() == 3
    assert leaf.num_tokens == size - size // 2
    assert torch.equal(leaf.value, kv[size // 2:])
    half = cache.match_prefix(tokens[: size // 2])
    assert half.length == size // 2
    assert torch.equal(half.indices, kv[: size // 2])
    assert cache.total_size() == size + 1
    # LRU: the untouched lower half goes first.
    assert cache.evict(1) == size - size // 2
    assert leaf.evicted
    check_invariants(cache)


def test_core_walk_is_read_only_and_page_aligned(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 7, 8], extra_key="ns")
    nodes, clock = cache.node_count(), core_of(cache).tree.clock
    assert core_of(cache).walk(np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)) == 6
    assert core_of(cache).walk([1, 2, 3, 9, 9]) == 2        # the match ends inside a node: no split
    assert core_of(cache).walk([1, 2, 3, 4, 5]) == 4         # unaligned tail ignored
    assert core_of(cache).walk([1, 2, 7, 8]) == 2
    assert core_of(cache).walk([1, 2, 7, 8], "ns") == 4
    assert core_of(cache).walk([1, 2], "other") == 0
    assert core_of(cache).walk([]) == 0
    assert (cache.node_count(), core_of(cache).tree.clock) == (nodes, clock)


@pytest.mark.parametrize("page_size", [1, 2])
def test_child_tables_full_and_growing(make_cache, page_size):
    """Child tables at every fill: two children (the compiled core's smallest table, full),
    then grown, shrunk by eviction and split, with lookups of absent first pages at each
    step (a probe of a full table must end) and the layout checked throughout."""
    cache = make_cache(page_size=page_size)
    p = page_size
    base = [7] * (3 * p)
    present: list[list[int]] = []
    absent = [base + [900 + i] * p for i in range(4)]

    def check():
        check_invariants(cache)
        for seq in present:
            assert cache.exists(seq)
            assert cache.match_prefix(seq).length == len(seq)
        for seq in absent:
            assert not cache.exists(seq)
            assert cache.match_prefix(seq).length == len(base)

    cache.insert(base)  # the parent, a terminal
    present.append(base)
    for first in range(1, 9):  # 1, 2 children (full), 3 (grown), ... 8
        seq = base + [first] * p + [first + 50] * (2 * p)
        cache.insert(seq)
        present.append(seq)
        check()
    # Split a child: its slot now holds the upper half, whose own table is new.
    seq = base + [1] * p + [99] * p
    cache.insert(seq)
    present.append(seq)
    check()
    # Evict leaves one by one down to one child: tables shift their entries back.
    while cache.node_count() > 2:
        freed = cache.evict(1)
        assert freed > 0
        present = [s for s in present if cache.exists(s)]
        check()
    assert present  # the evictions kept the shared parent


def test_lock_ref_limit_refused_before_any_change(core_name):
    """A lock past MAX_LOCK_REF raises OverflowError and changes no count. The compiled
    core's counts cannot be set from Python, and 2^31 real locks take minutes: the limit is
    driven through the pure core's node state; the compiled core has the same check."""
    from radixcache._types import MAX_LOCK_REF

    if core_name != "python":
        pytest.skip("reaching 2^31 - 1 locks on the compiled core takes 2^31 calls")
    cache = RadixCache(core="python")
    cache.insert([1, 2, 3])
    leaf = cache.insert([1, 2, 3, 4, 5]).last_node
    top = leaf.parent
    top._lock_ref = MAX_LOCK_REF  # as if that many locks were held below it
    before = (leaf.lock_ref, cache.evictable_size(), cache.protected_size())
    with pytest.raises(OverflowError, match="lock_ref"):
        cache.inc_lock_ref(leaf)
    assert (leaf.lock_ref, cache.evictable_size(), cache.protected_size()) == before
    assert top.lock_ref == MAX_LOCK_REF


def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.mark.skipif(_available_gib() < 8, reason="needs about 4 GiB free")
def test_key_longer_than_a_slot_mirrors(make_cache):
    """A key of 2^27 + 4 tokens: longer than the compiled core's slots record (27 bits), so
    walks read its length from the node. Exists, prefix matches, a split inside it and an
    insert that walks it with fewer tokens than the key all agree with the plain answer."""
    page_size = 2
    length = 2**27 + 4
    cache = make_cache(page_size=page_size)
    seq = np.arange(length, dtype=np.int64)
    assert cache.insert(seq).prefix_len == 0
    core_of(cache).tree.check_layout()
    assert cache.exists(seq)
    assert not cache.exists(seq[:-2])
    assert not cache.exists(seq[:2**27])  # fewer tokens than the key: the walk stops
    assert cache.match_prefix(seq[:8]).length == 8  # splits: an 8-token upper half
    core_of(cache).tree.check_layout()
    assert cache.exists(seq)
    # Walks with 2^27 tokens left against a lower half of 2^27 - 4: and with more than it.
    assert cache.insert(seq[:2**27 + 2]).prefix_len == 2**27 + 2
    assert cache.insert(np.concatenate((seq, [7, 7]))).prefix_len == length
    core_of(cache).tree.check_layout()
    assert cache.exists(seq) and cache.exists(seq[:2**27 + 2])
    del seq
    cache.reset()


def _compiled_root_hash_low32(first_page: list[int], ns: int) -> int:
    """The compiled core's root-slot hash of (namespace id, first page), low 32 bits (a copy
    of _core_c's page_hash: splitmix64 finaliser over a per-namespace seed)."""
    mask = (1 << 64) - 1

    def mix(x):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = mix((ns + 0x9E3779B97F4A7C15) & mask)
    for token in first_page:
        h = mix(h ^ (token & mask))
    return h & 0xFFFFFFFF


def test_namespaces_with_colliding_slot_hashes_stay_apart(make_cache):
    """Two namespaces whose (namespace, first page) hashes agree in the 32 bits a child slot
    keeps: a walk in one must not find the other's node (namespace ids are 1, 2, ... in order
    of creation, so the colliding pair is reached by creating namespaces up to it)."""
    seen: dict[int, int] = {}
    ns_b = 0
    while True:
        ns_b += 1
        low = _compiled_root_hash_low32([1], ns_b)
        if low in seen:
            ns_a = seen[low]
            break
        seen[low] = ns_b
    cache = make_cache()
    for i in range(1, ns_b + 1):
        cache.insert([2], extra_key=f"k{i}")
    cache.insert([1, 5, 7], extra_key=f"k{ns_a}")
    assert not cache.exists([1, 5, 7], extra_key=f"k{ns_b}")
    assert cache.match_prefix([1, 5, 7], extra_key=f"k{ns_b}").length == 0
    assert cache.insert([1, 5, 9], extra_key=f"k{ns_b}").prefix_len == 0
    assert cache.match_prefix([1, 5, 7], extra_key=f"k{ns_a}").length == 3
    check_invariants(cache)

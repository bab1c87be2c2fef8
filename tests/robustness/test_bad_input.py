"""Every bad input: the right exception, a message naming the problem, and an untouched cache."""

from __future__ import annotations

import array
import io

import numpy as np
import pytest
import torch

from conftest import check_invariants
from radixcache import EVICTION_POLICIES, RadixCache
from radixcache._core import CORES

# Messages differ between cores; each pattern accepts any wording that names the problem.
NOT_INT = r"(?i)int"
TOO_BIG = r"(?i)int64|too (large|big|small)|out of range|fit"


def populated(make_cache, page_size: int = 1):
    """A cache whose structure every bad call below could disturb (splits, locks, sizes)."""
    cache = make_cache(page_size=page_size)
    cache.insert([1, 2, 3, 4, 5, 6], kv_indices=[10, 11, 12, 13, 14, 15])
    cache.insert([1, 2, 3, 4, 7, 8], kv_indices=[20, 21, 22, 23, 24, 25])
    locked = cache.insert([9, 9], kv_indices=[30, 31], extra_key="ns").last_node
    cache.inc_lock_ref(locked)
    return cache


def snapshot(cache) -> tuple:
    out = io.StringIO()
    cache.pretty_print(out)
    return (cache.evictable_size(), cache.protected_size(), cache.total_size(),
            cache.node_count(), out.getvalue(), cache.stats())


def assert_untouched(cache, before) -> None:
    assert snapshot(cache) == before
    check_invariants(cache)
    # The reference matches (taken after the snapshot: a match counts as a lookup).
    result = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert result.length == 6 and result.indices.tolist() == [10, 11, 12, 13, 14, 15]
    result = cache.match_prefix([9, 9], extra_key="ns")
    assert result.length == 2 and result.indices.tolist() == [30, 31]


def call(cache, method: str, *args, **kwargs):
    return getattr(cache, method)(*args, **kwargs)


# -- constructor ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "page_size, exc, pattern",
    [
        (0, ValueError, "page_size"),
        (-1, ValueError, "page_size"),
        (1.5, TypeError, "page_size"),
        ("2", TypeError, "page_size"),
        (None, TypeError, "page_size"),
        (True, TypeError, "page_size"),
    ],
)
def test_bad_page_size(make_cache, page_size, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make_cache(page_size=page_size)


@pytest.mark.parametrize("policy", ["LRU ", "random", "", None, 3])
def test_unknown_eviction_policy_lists_the_valid_ones(make_cache, policy):
    with pytest.raises(ValueError, match="eviction_policy") as excinfo:
        make_cache(eviction_policy=policy)
    for name in EVICTION_POLICIES:
        assert name in str(excinfo.value)


def test_unknown_core_lists_the_available_ones():
    with pytest.raises(ValueError, match="core") as excinfo:
        RadixCache(core="fortran")
    for name in CORES:
        assert name in str(excinfo.value)


# -- token ids -----------------------------------------------------------------------------
BAD_TOKENS = [
    pytest.param([1, 2.0, 3], TypeError, NOT_INT, id="float-in-list"),
    pytest.param([1.0, 2.0], TypeError, NOT_INT, id="floats"),
    pytest.param([1, "2"], TypeError, NOT_INT, id="str-in-list"),
    pytest.param("123", TypeError, r"str|sequence", id="str"),
    pytest.param(b"\x01\x02", TypeError, r"bytes|sequence", id="bytes"),
    pytest.param(None, TypeError, r"None", id="None"),
    pytest.param(5, TypeError, r"int|sequence", id="scalar-int"),
    pytest.param([1, None], TypeError, NOT_INT, id="None-in-list"),
    pytest.param([[1, 2], [3]], TypeError, NOT_INT, id="nested-list"),
    pytest.param((1, 2, (3,)), TypeError, NOT_INT, id="nested-tuple"),
    pytest.param(np.array([[1, 2], [3, 4]]), ValueError, "1-D", id="numpy-2d"),
    pytest.param(np.array([1.0, 2.0]), TypeError, "integer", id="numpy-float"),
    pytest.param(np.array([True, False]), TypeError, "integer", id="numpy-bool"),
    pytest.param(np.array(["1", "2"]), TypeError, "integer", id="numpy-str"),
    pytest.param(torch.tensor([1.0, 2.0]), TypeError, "integer", id="torch-float"),
    pytest.param(torch.tensor([True, False]), TypeError, "integer", id="torch-bool"),
    pytest.param(torch.tensor([[1, 2]]), ValueError, "1-D", id="torch-2d"),
    # The device check, testable without CUDA: "meta" tensors are not on the CPU either.
    pytest.param(torch.tensor([1, 2], device="meta"), ValueError, "CPU", id="torch-meta"),
    pytest.param(array.array("d", [1.0, 2.0]), TypeError, "integer|typecode", id="array-d"),
    pytest.param([1, 2**63], OverflowError, TOO_BIG, id="2**63"),
    pytest.param([-(2**63) - 1], OverflowError, TOO_BIG, id="-2**63-1"),
    pytest.param([2**100], OverflowError, TOO_BIG, id="2**100"),
    # Three 30-bit digits: the compiled list reader's own range check, at its edges.
    pytest.param([1, 2**64], OverflowError, TOO_BIG, id="2**64"),
    pytest.param([1, -(2**64)], OverflowError, TOO_BIG, id="-2**64"),
    pytest.param([2**90 - 1], OverflowError, TOO_BIG, id="2**90-1"),
    pytest.param(np.array([1, 2**63], dtype=np.uint64), OverflowError, TOO_BIG,
                 id="uint64-above-int64"),
    pytest.param(array.array("Q", [2**64 - 1]), OverflowError, TOO_BIG, id="array-Q-big"),
]


@pytest.mark.parametrize("method", ["insert", "match_prefix", "exists"])
@pytest.mark.parametrize("tokens, exc, pattern", BAD_TOKENS)
def test_bad_token_ids(make_cache, method, tokens, exc, pattern):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(exc, match=pattern):
        call(cache, method, tokens)
    assert_untouched(cache, before)


def test_bad_token_ids_with_the_in_operator(make_cache):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match=NOT_INT):
        [1, 2.5] in cache  # noqa: B015 -- the containment test itself must raise
    assert_untouched(cache, before)


@pytest.mark.parametrize("method", ["insert", "match_prefix"])
def test_bad_token_after_a_splitting_prefix_changes_nothing(make_cache, method):
    # A valid prefix ending inside a node must not be walked (and split) before the bad token.
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match=NOT_INT):
        call(cache, method, [1, 2, 3, "x"])
    with pytest.raises(OverflowError, match=TOO_BIG):
        call(cache, method, [1, 2, 3, 2**64])
    assert_untouched(cache, before)


def test_bad_tokens_with_page_size(make_cache):
    # The unaligned tail is never cached, but it must still be valid input.
    cache = populated(make_cache, page_size=2)
    before = snapshot(cache)
    with pytest.raises(TypeError, match=NOT_INT):
        cache.insert([1, 2, 3, 4, 5.5])
    with pytest.raises(OverflowError, match=TOO_BIG):
        cache.match_prefix([1, 2, 2**63])
    assert_untouched(cache, before)


# -- kv_indices ----------------------------------------------------------------------------
BAD_KV = [
    pytest.param([50, 51, 52], ValueError, "kv_indices", id="too-short-list"),
    pytest.param(torch.tensor([50, 51]), ValueError, "kv_indices", id="too-short-tensor"),
    pytest.param([], ValueError, "kv_indices", id="empty"),
    pytest.param(np.zeros((2, 4), dtype=np.int64), ValueError, "1-D", id="numpy-2d"),
    pytest.param(torch.zeros((4, 1), dtype=torch.int64), ValueError, "1-D", id="torch-2d"),
    pytest.param(torch.tensor(7), ValueError, "1-D", id="torch-0d"),
    pytest.param([1.5, 2.5, 3.5, 4.5], TypeError, "integer", id="float-list"),
    pytest.param(np.arange(4, dtype=np.float32), TypeError, "integer", id="numpy-float"),
    pytest.param(torch.arange(4, dtype=torch.float64), TypeError, "integer", id="torch-float"),
    pytest.param(torch.ones(4, dtype=torch.bool), TypeError, "integer", id="torch-bool"),
    pytest.param("abcd", TypeError, "kv_indices", id="str"),
    pytest.param([1, 2, 3, 2**64], OverflowError, TOO_BIG, id="overflow"),
    pytest.param(np.array([1, 2, 3, 2**63], dtype=np.uint64), OverflowError, TOO_BIG,
                 id="uint64-above-int64"),
    pytest.param([1, 2, None, 4], TypeError, "kv_indices must hold integers, got NoneType",
                 id="none-item"),
    pytest.param([1, 2, object(), 4], TypeError, "got object", id="object-item"),
    pytest.param([[1], [2, 3], 4, 5], ValueError, "kv_indices must be 1-D", id="ragged"),
]


@pytest.mark.parametrize("kv, exc, pattern", BAD_KV)
def test_bad_kv_indices(make_cache, kv, exc, pattern):
    cache = populated(make_cache)
    before = snapshot(cache)
    # [1,2,3,9] diverges inside [1,2,3,4]: a successful insert would split it.
    with pytest.raises(exc, match=pattern):
        cache.insert([1, 2, 3, 9], kv_indices=kv)
    assert_untouched(cache, before)
    assert not cache.exists([1, 2, 3, 9])


def test_kv_indices_too_short_even_when_the_new_part_fits(make_cache):
    # Indices cover the whole (aligned) sequence, not just the uncached tail.
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="kv_indices"):
        cache.insert([1, 2, 3, 4, 5, 6, 7], kv_indices=[1, 2])
    assert_untouched(cache, before)


# -- priority and extra_key ----------------------------------------------------------------
@pytest.mark.parametrize("priority", [1.5, "3", None, True, [1]])
def test_bad_priority(make_cache, priority):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="priority"):
        cache.insert([1, 2, 3, 9], priority=priority)
    assert_untouched(cache, before)


@pytest.mark.parametrize("priority", [2**63, -(2**63) - 1])
def test_priority_out_of_int64(make_cache, priority):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(OverflowError, match="priority"):
        cache.insert([1, 2, 3, 9], priority=priority)
    assert_untouched(cache, before)


@pytest.mark.parametrize("hits_from, exc", [
    (-1, ValueError), (1.5, TypeError), ("3", TypeError), (None, TypeError),
    (True, TypeError), (2**63, OverflowError)])
@pytest.mark.parametrize("extra_key", [None, "ns"])
def test_bad_hits_from(make_cache, hits_from, exc, extra_key):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(exc, match="hits_from"):
        cache.insert([1, 2, 3, 9], hits_from=hits_from, extra_key=extra_key)
    assert_untouched(cache, before)


def test_extreme_int64_priorities_are_accepted(make_cache):
    cache = make_cache()
    cache.insert([1], priority=2**63 - 1)
    cache.insert([2], priority=-(2**63))
    freed = []
    cache.evict(1, lambda idx: freed.append(idx.tolist()))
    assert freed == [[2]]  # the lowest priority goes first
    check_invariants(cache)


@pytest.mark.parametrize("method", ["insert", "match_prefix", "exists"])
@pytest.mark.parametrize("extra_key", [["ns"], {"a": 1}, {1, 2}], ids=["list", "dict", "set"])
def test_unhashable_extra_key(make_cache, method, extra_key):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="extra_key"):
        call(cache, method, [1, 2, 3, 9], extra_key=extra_key)
    assert_untouched(cache, before)


# -- lock handles --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["inc_lock_ref", "dec_lock_ref"])
@pytest.mark.parametrize("not_a_node", [42, "node", object(), [1, 2]],
                         ids=["int", "str", "object", "list"])
def test_lock_with_a_non_node(make_cache, method, not_a_node):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="(?i)node"):
        call(cache, method, not_a_node)
    assert_untouched(cache, before)


@pytest.mark.parametrize("same_core", [True, False], ids=["same-core", "other-core"])
@pytest.mark.parametrize("method", ["inc_lock_ref", "dec_lock_ref"])
def test_lock_with_a_node_of_another_cache(core_name, method, same_core):
    others = [name for name in CORES if name != core_name]
    if not same_core and not others:
        pytest.skip("only one tree core is available")
    other_core = core_name if same_core else others[0]
    cache = populated(lambda **kw: RadixCache(core=core_name, **kw))
    other = populated(lambda **kw: RadixCache(core=other_core, **kw))
    foreign = other.match_prefix([9, 9], extra_key="ns").last_node
    before, other_before = snapshot(cache), snapshot(other)
    with pytest.raises(ValueError, match="another cache"):
        call(cache, method, foreign)
    assert_untouched(cache, before)
    assert_untouched(other, other_before)


@pytest.mark.parametrize("method", ["inc_lock_ref", "dec_lock_ref"])
def test_lock_with_an_evicted_node(make_cache, method):
    cache = populated(make_cache)
    gone = cache.insert([5, 5, 5]).last_node
    cache.evict(cache.evictable_size())
    assert gone.evicted
    before = snapshot(cache)
    with pytest.raises(ValueError, match="evicted"):
        call(cache, method, gone)
    assert snapshot(cache) == before
    check_invariants(cache)


def test_unlock_below_zero(make_cache):
    cache = populated(make_cache)
    unlocked = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    before = snapshot(cache)
    with pytest.raises(ValueError, match="lock_ref"):
        cache.dec_lock_ref(unlocked)
    assert_untouched(cache, before)
    locked = cache.match_prefix([9, 9], extra_key="ns").last_node
    assert cache.dec_lock_ref(locked) == 2
    before = snapshot(cache)
    with pytest.raises(ValueError, match="lock_ref"):
        cache.dec_lock_ref(locked)
    assert snapshot(cache) == before
    check_invariants(cache)


def test_unlock_of_an_ancestor_holding_only_inherited_locks(make_cache):
    # [1,2,3,4] carries lock_ref 1 only because its child [5,6] is locked; unlocking the
    # ancestor directly would drive it below its child and later below zero.
    cache = populated(make_cache)
    leaf = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(leaf)
    ancestor = leaf.parent
    assert ancestor.lock_ref == 1
    before = snapshot(cache)
    with pytest.raises(ValueError, match="lock_ref"):
        cache.dec_lock_ref(ancestor)
    assert snapshot(cache) == before
    check_invariants(cache)


# -- evict ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [1.5, "3", None, True, [3]])
def test_evict_with_a_non_int(make_cache, num_tokens):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="num_tokens"):
        cache.evict(num_tokens)
    assert_untouched(cache, before)


def test_evict_accepts_numpy_ints(make_cache):
    cache = populated(make_cache)
    assert cache.evict(np.int64(1)) >= 1
    check_invariants(cache)


# -- the host tier -----------------------------------------------------------------------------
@pytest.mark.parametrize("policy, exc", [("write_around", ValueError), ("", ValueError),
                                         ("WRITE_BACK", ValueError), (None, TypeError),
                                         (2, TypeError)])
def test_unknown_write_policy_lists_the_valid_ones(make_cache, policy, exc):
    from radixcache.cache import WRITE_POLICIES

    with pytest.raises(exc, match="write_policy") as excinfo:
        make_cache(host_tier=True, write_policy=policy)
    if exc is ValueError:
        for name in WRITE_POLICIES:
            assert name in str(excinfo.value)


@pytest.mark.parametrize("method, args, kwargs", [
    ("evict", (2,), {"backup": lambda d: d}),
    ("evict_host", (2,), {}),
    ("write_through", (lambda d: d,), {}),
    ("host_size", (), {}),
])
def test_host_tier_calls_without_a_host_tier(make_cache, method, args, kwargs):
    cache = populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="host tier"):
        call(cache, method, *args, **kwargs)
    assert_untouched(cache, before)


def test_load_back_without_a_host_tier(make_cache):
    cache = populated(make_cache)
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="host tier"):
        cache.load_back(match, [])
    assert_untouched(cache, before)


def host_populated(make_cache):
    """``populated`` with a host tier, [1..4]+[7, 8] moved to the host (page size 1)."""
    cache = make_cache(page_size=1, host_tier=True)
    cache.insert([1, 2, 3, 4, 5, 6], kv_indices=[10, 11, 12, 13, 14, 15])
    cache.insert([1, 2, 3, 4, 7, 8], kv_indices=[20, 21, 22, 23, 24, 25])
    locked = cache.insert([9, 9], kv_indices=[30, 31], extra_key="ns").last_node
    cache.inc_lock_ref(locked)
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # [7, 8] is the least recently used leaf
    cache.evict(2, backup=lambda d: d + 500)
    return cache


@pytest.mark.parametrize("result, exc, pattern", [
    ([500, 501], TypeError, "torch.Tensor"),
    ((500, 501), TypeError, "torch.Tensor"),
    ("500", TypeError, "torch.Tensor"),
    (np.array([500, 501]), TypeError, "torch.Tensor"),
    (torch.tensor([500.0, 501.0]), TypeError, "int64"),
    (torch.tensor([500, 501], dtype=torch.int32), TypeError, "int64"),
    (torch.tensor([True, False]), TypeError, "int64"),
    (torch.tensor([[500, 501]]), ValueError, "1-D"),
    (torch.tensor(500), ValueError, "1-D"),
    (torch.tensor([500]), ValueError, "1 host indices for 2"),
    (torch.tensor([], dtype=torch.int64), ValueError, "0 host indices for 2"),
])
def test_bad_backup_result(make_cache, result, exc, pattern):
    cache = host_populated(make_cache)
    before = snapshot(cache)
    with pytest.raises(exc, match=pattern):
        cache.evict(2, backup=lambda d: result)
    assert snapshot(cache) == before
    check_invariants(cache)


@pytest.mark.parametrize("slots, exc, pattern", [
    ([1], ValueError, "1 device indices"),
    ([1, 2, 3], ValueError, "3 device indices"),
    ([[1, 2]], ValueError, "1-D"),
    (torch.tensor([1.0, 2.0]), TypeError, "integers"),
    (["a", "b"], TypeError, "integers"),
    ([2**64, 1], OverflowError, "device_indices .*int64"),
    (None, TypeError, "device_indices must hold integers"),
])
def test_bad_load_back_slots(make_cache, slots, exc, pattern):
    cache = host_populated(make_cache)
    match = cache.match_prefix([1, 2, 3, 4, 7, 8])
    assert (match.length, match.host_length) == (4, 2)
    before = snapshot(cache)
    with pytest.raises(exc, match=pattern):
        cache.load_back(match, slots)
    assert snapshot(cache) == before
    check_invariants(cache)
    assert cache.load_back(match, [40, 41]).tolist() == [524, 525]  # still good

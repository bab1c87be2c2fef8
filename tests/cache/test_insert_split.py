"""``insert``'s ``split_at``: the sequence and then its prefix inserted again, in one call.

An engine caching a finished request inserts the whole sequence, then its prompt again, so
that the prompt and the answer are separate nodes (the answer can be evicted first). The one
call must leave exactly what the two inserts leave: the same nodes, keys, values, terminal
marks, priorities, hits, access times and eviction order, the same counters.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import check_invariants, core_of

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")


def snapshot(cache) -> tuple:
    """Everything the two ways could differ in: every node's key, value, terminal mark,
    priority, hits, access time and rank, and the counters."""
    nodes = []
    for node, depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        value = node.value
        nodes.append((depth, tuple(int(t) for t in node.key), node.terminal, node.priority,
                       node.hit_count, node.last_access_time, cache.eviction_rank(node),
                       None if value is None else tuple(int(v) for v in value)))
    stats = cache.stats()
    return sorted(nodes), stats.inserts, stats.inserted_tokens, stats.splits, \
        stats.evictable_size, stats.node_count


def evicted(cache, num_tokens: int = 10**9) -> list:
    """The indices ``evict(num_tokens)`` frees, victim by victim."""
    freed = []
    cache.evict(num_tokens, lambda indices: freed.append(tuple(indices.tolist())))
    return freed


def two_inserts(cache, tokens, kv, priority, hits_from, split_at, split_priority):
    result = cache.insert(tokens, kv, None, priority, hits_from=hits_from)
    cache.insert(tokens[:split_at], None, None, split_priority, hits_from=split_at)
    return result


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_split_at_leaves_what_the_two_inserts_leave(make_cache, policy, page_size):
    one, two = make_cache(page_size, policy), make_cache(page_size, policy)
    rng = np.random.default_rng(7)
    for step in range(250):
        length = int(rng.integers(0, 40))
        tokens = rng.integers(0, 3, length).tolist()  # few symbols: deep shared paths
        kv = list(range(1000 + 50 * step, 1000 + 50 * step + length))
        aligned = length - length % page_size
        split_at = int(rng.integers(0, aligned // page_size + 1)) * page_size
        priority, split_priority = int(rng.integers(0, 4)), int(rng.integers(0, 6))
        hits_from = int(rng.integers(0, 12))
        got = one.insert(tokens, kv, None, priority, hits_from=hits_from, split_at=split_at,
                         split_priority=split_priority)
        want = two_inserts(two, tokens, kv, priority, hits_from, split_at, split_priority)
        assert (got.prefix_len, got.last_node.key.tolist()) == \
               (want.prefix_len, want.last_node.key.tolist())
        if step % 5 == 0:
            probe = rng.integers(0, 3, 12).tolist()
            one.match_prefix(probe)
            two.match_prefix(probe)
        if step % 11 == 0:  # the two trees must evict the same leaves the same way
            some = int(rng.integers(1, 30))
            assert evicted(one, some) == evicted(two, some)
    check_invariants(one)
    assert snapshot(one) == snapshot(two)
    assert evicted(one) == evicted(two)


def test_split_at_makes_the_prompt_its_own_node(make_cache):
    cache = make_cache(2, "priority")
    answer = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(10, 18)), None, 3,
                          split_at=4, split_priority=4).last_node
    assert answer.key.tolist() == [5, 6, 7, 8] and not answer.num_children
    prompt = answer.parent
    assert prompt.key.tolist() == [1, 2, 3, 4]
    assert prompt.terminal and prompt.priority == 4 and answer.priority == 3
    assert prompt.last_access_time > answer.last_access_time  # stamped once more
    assert cache.exists([1, 2, 3, 4]) and cache.exists([1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.evict(1) == 4  # the answer goes first (a lower priority)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).length == 4
    check_invariants(cache)


def test_split_at_the_ends_of_the_sequence(make_cache):
    one, two = make_cache(2), make_cache(2)
    for split_at in (0, 6, 2):
        one.insert([1, 2, 3, 4, 5, 6, 7], [9] * 7, split_at=split_at, split_priority=1)
        two_inserts(two, [1, 2, 3, 4, 5, 6, 7], [9] * 7, 0, 0, split_at, 1)
    one.insert([5], split_at=0)  # nothing aligned: only the empty prefix
    two_inserts(two, [5], None, 0, 0, 0, 0)
    assert snapshot(one) == snapshot(two)
    assert one.exists([]) and two.exists([])


@pytest.mark.parametrize("split_at, split_priority, error, words", [
    (3, 0, ValueError, "multiple of the page size"),
    (-2, 0, ValueError, "split_at must be >= 0"),
    (10, 0, ValueError, "split_at must be <= 8"),
    ("4", 0, TypeError, "split_at must be an int"),
    (4.0, 0, TypeError, "split_at must be an int"),
    (4, 2**63, OverflowError, "split_priority"),
    (4, "1", TypeError, "split_priority must be an int"),
])
def test_a_bad_split_at_raises_and_changes_nothing(make_cache, split_at, split_priority,
                                                   error, words):
    cache = make_cache(2)
    cache.insert([1, 2, 3, 4, 5, 6], [7] * 6, split_at=2)
    before = snapshot(cache)
    with pytest.raises(error, match=words):
        cache.insert([1, 2, 3, 4, 9, 9, 9, 9, 9], [8] * 9, split_at=split_at,
                     split_priority=split_priority)
    assert snapshot(cache) == before
    check_invariants(cache)


def test_split_at_with_a_host_tier_is_the_two_inserts(make_cache):
    one, two = make_cache(2, host_tier=True), make_cache(2, host_tier=True)
    for tokens, split_at in (([1, 2, 3, 4, 5, 6], 4), ([1, 2, 3, 4, 7, 8, 9, 9], 6)):
        kv = list(range(20, 20 + len(tokens)))
        got = one.insert(tokens, kv, split_at=split_at, split_priority=2)
        want = two_inserts(two, tokens, kv, 0, 0, split_at, 2)
        assert got.prefix_len == want.prefix_len
    assert snapshot(one) == snapshot(two)
    with pytest.raises(ValueError, match="multiple of the page size"):
        one.insert([1, 2, 3, 4], split_at=1)
    assert snapshot(one) == snapshot(two)


def test_split_at_with_device_indices_is_the_two_inserts(make_cache):
    """Indices on a device (meta: no data, but its own tensors) are stored after the core's
    insert: the prompt's upper node must hold the caller's indices, never its tokens."""
    torch = pytest.importorskip("torch")
    one, two = make_cache(1), make_cache(1)
    tokens = [1, 2, 3, 4, 5, 6]
    kv = torch.arange(100, 106, device="meta")
    one.insert(tokens, kv, split_at=3, split_priority=1)
    two_inserts(two, tokens, kv, 0, 0, 3, 1)
    for cache in (one, two):
        prompt = cache.match_prefix([1, 2, 3]).last_node
        assert prompt.key.tolist() == [1, 2, 3]
        assert prompt.value.device.type == "meta"  # the caller's, not the key
        assert prompt.parent.parent is None and prompt.num_children == 1
    check_invariants(one)


def test_split_at_with_events_announces_what_the_two_inserts_announce(make_cache):
    """With events on, every page is announced once, under the parent hash sent before."""
    for extra_key in (None, "ns"):
        one = make_cache(1, enable_events=True, array_type="numpy")
        two = make_cache(1, enable_events=True, array_type="numpy")
        for tokens, split_at in (([1, 2, 3, 4, 5, 6], 3), ([1, 2, 3, 4, 7, 8], 5)):
            kv = list(range(20, 20 + len(tokens)))
            one.insert(tokens, kv, extra_key, split_at=split_at, split_priority=1)
            two.insert(tokens, kv, extra_key)
            two.insert(tokens[:split_at], None, extra_key, 1, hits_from=split_at)
        assert one.take_events() == two.take_events()
        assert snapshot(one) == snapshot(two)


def test_the_core_declines_what_cache_py_checks(make_cache):
    """The core's fast path takes plain ints only (no ``__index__`` runs inside it) and
    declines the rest (None) for cache.py to check; a host-tier core refuses ``split_at``."""
    core = core_of(make_cache(2))

    class Two:
        def __index__(self):
            return 2

    for split_at, split_priority in ((Two(), 0), (2, Two()), (True, 0), (3, 0), (-2, 0),
                                     (6, 0), (2, 2**63)):
        assert core.insert([1, 2, 3, 4], None, None, 0, False, 0, split_at,
                           split_priority) is None
    assert core.inserts == 0
    tiered = core_of(make_cache(2, host_tier=True))
    with pytest.raises(ValueError, match="host tier"):
        tiered.insert([1, 2, 3, 4], None, None, 0, False, 0, 2, 0)

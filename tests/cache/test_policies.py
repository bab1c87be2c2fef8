"""Eviction policies: exact hand-built orders per policy, and a Hypothesis property that every
eviction takes a minimum of the policy's order (computed here from the documented definitions, not
from the heap's own key) among the evictable leaves present just before it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_invariants, core_of, page_sequences

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")


# -- the policies' order, written from their documented definitions -------------------------
def expected_rank(policy: str, node) -> tuple:
    """Smaller goes first. Every policy starts with priority; no node-id tie-break, so a full
    tie on the definition's attributes leaves several acceptable victims."""
    hits = node.hit_count
    accessed = node.last_access_time
    created = node.created_time
    if policy in ("lru", "priority"):
        rank = (accessed,)
    elif policy == "lfu":
        rank = (hits, accessed)
    elif policy == "fifo":
        rank = (created,)
    elif policy == "mru":
        rank = (-accessed,)
    elif policy == "filo":
        rank = (-created,)
    elif policy == "slru":
        rank = (0 if hits < 2 else 1, accessed)
    else:
        raise AssertionError(f"test does not know policy {policy!r}")
    return (node.priority, *rank)


def evictable_leaves(cache) -> list:
    return [node for node, depth in core_of(cache).tree.iter_nodes()
            if depth > 0 and node.num_children == 0 and node.lock_ref == 0]


def locked_nodes(cache) -> list:
    return [node for node, depth in core_of(cache).tree.iter_nodes()
            if depth > 0 and node.lock_ref > 0]


def evict_one_checked(cache, policy: str) -> torch.Tensor | None:
    """One ``evict(1)`` call, checked against the policy order; returns the freed kv values
    (None when nothing was evictable)."""
    leaves = evictable_leaves(cache)
    locked = locked_nodes(cache)
    ranks = {node.id: expected_rank(policy, node) for node in leaves}
    values = {node.id: node.value.clone() for node in leaves}
    sizes = {node.id: node.num_tokens for node in leaves}
    nodes_before = cache.node_count()
    freed_values: list = []
    freed = cache.evict(1, freed_values.append)
    assert not any(node.evicted for node in locked), "a locked node was evicted"
    if not leaves:
        assert freed == 0 and freed_values == []
        return None
    gone = [node for node in leaves if node.evicted]
    assert len(gone) == 1, f"evict(1) removed {len(gone)} of {len(leaves)} evictable leaves"
    victim = gone[0]
    best = min(ranks.values())
    tied = sorted(node.id for node in leaves if ranks[node.id] == best)
    assert ranks[victim.id] == best, (
        f"{policy}: evicted node {victim.id} rank {ranks[victim.id]}, expected one of "
        f"{tied} with rank {best}; all: {ranks}"
    )
    assert freed == sizes[victim.id]
    assert len(freed_values) == 1 and torch.equal(freed_values[0], values[victim.id])
    assert cache.node_count() == nodes_before - 1
    return freed_values[0]


def eviction_order(cache) -> list[int]:
    """Evicts all it can, one token at a time; each victim named by its first kv value."""
    order: list[int] = []
    while True:
        freed_values: list = []
        freed = cache.evict(1, freed_values.append)
        if freed == 0:
            break
        assert len(freed_values) == 1 and freed == freed_values[0].numel()
        order.append(int(freed_values[0][0]))
    assert cache.evictable_size() == 0
    return order


# -- construction --------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_every_sglang_policy_name_is_accepted(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    assert cache.eviction_policy == policy


def test_default_policy_is_lru(make_cache):
    assert make_cache().eviction_policy == "lru"


@pytest.mark.parametrize("bad", ["LRU", "random", "", "lru ", None, 3])
def test_unknown_policy_is_rejected_with_the_valid_names(make_cache, bad):
    with pytest.raises(ValueError) as info:
        make_cache(eviction_policy=bad)
    message = str(info.value)
    for name in POLICIES:
        assert name in message


# -- hit counts ----------------------------------------------------------------------------
def test_hit_count_rises_per_insert_not_per_match(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3]).last_node
    assert leaf.hit_count == 1  # a new leaf starts at 1
    cache.insert([1, 2, 3])
    cache.insert([1, 2, 3, 4])  # passes through the leaf, which then gets a child
    assert leaf.hit_count == 3
    for _ in range(3):
        assert cache.match_prefix([1, 2, 3]).length == 3
    assert leaf.hit_count == 3


def test_split_by_match_gives_the_upper_half_the_count(make_cache):
    cache = make_cache()
    lower = cache.insert([5, 6, 7, 8]).last_node
    cache.insert([5, 6, 7, 8])
    cache.insert([5, 6, 7, 8])
    upper = cache.match_prefix([5, 6]).last_node
    assert upper is not lower and upper.num_tokens == 2 and lower.num_tokens == 2
    assert lower.parent is upper
    assert (upper.hit_count, lower.hit_count) == (3, 3)


def test_split_by_insert_counts_the_insert_on_the_upper_half_only(make_cache):
    cache = make_cache()
    lower = cache.insert([5, 6, 7, 8]).last_node
    cache.insert([5, 6, 7, 8])
    new_leaf = cache.insert([5, 6, 9]).last_node
    upper = new_leaf.parent
    assert lower.parent is upper and upper.num_tokens == 2
    assert (upper.hit_count, lower.hit_count, new_leaf.hit_count) == (3, 2, 1)


@pytest.mark.parametrize("options", [{}, {"enable_events": True}, {"host_tier": True}])
def test_hits_from_counts_only_the_nodes_that_end_past_it(make_cache, options):
    # A sequence inserted in steps (chunked prefill), each step passing the length inserted
    # before: every node counts one hit for the sequence, as SGLang counts them.
    cache = make_cache(**options)
    first = cache.insert([1, 2, 3, 4], [10, 11, 12, 13]).last_node
    assert first.hit_count == 1
    second = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(10, 18)), hits_from=4).last_node
    assert (first.hit_count, second.hit_count) == (1, 1)
    # Again up to where it was inserted: no node counts, not even a split's upper half.
    assert cache.insert([1, 2, 3, 4, 5, 6], list(range(10, 16)), hits_from=8).prefix_len == 6
    upper = second.parent
    assert upper is not first and upper.num_tokens == 2 and upper.parent is first
    assert (first.hit_count, upper.hit_count, second.hit_count) == (1, 1, 1)
    # Another sequence through the same prefix counts once per node it passes.
    cache.insert([1, 2, 3, 4, 5, 6, 9], list(range(20, 27)))
    assert (first.hit_count, upper.hit_count, second.hit_count) == (2, 2, 1)
    # hits_from inside a node: the node ends past it, so it counts.
    cache.insert([1, 2, 3, 4, 5, 6], list(range(10, 16)), hits_from=5)
    assert (first.hit_count, upper.hit_count) == (2, 3)
    check_invariants(cache)


def test_a_new_leaf_that_ends_at_hits_from_starts_with_no_hit(make_cache):
    cache = make_cache(page_size=2)
    assert cache.insert([1, 2, 3, 4], hits_from=4).last_node.hit_count == 0
    assert cache.insert([5, 6, 7, 8], hits_from=3).last_node.hit_count == 1
    assert cache.insert([9, 9, 9, 9, 9], hits_from=4).last_node.hit_count == 0  # 4 aligned
    assert cache.insert([8, 8], hits_from=2**63 - 1).last_node.hit_count == 0


@pytest.mark.parametrize("hits_from, order", [(0, [20, 10]), (2, [10, 20])])
def test_hits_from_decides_the_lfu_order(make_cache, hits_from, order):
    cache = make_cache(eviction_policy="lfu")
    cache.insert([1, 1], [10, 11])
    cache.insert([2, 2], [20, 21])
    cache.insert([2, 2], [20, 21])  # B: two hits
    cache.insert([1, 1], [10, 11], hits_from=hits_from)  # A again, the newest access
    # hits_from 0: A has two hits too, and B is older; hits_from 2: A keeps one hit.
    assert eviction_order(cache) == order


def test_insert_raises_priority_along_the_path_but_never_lowers_it(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3], priority=2).last_node
    cache.insert([1, 2, 3], priority=-4)
    assert leaf.priority == 2
    cache.insert([1, 2, 3], priority=7)
    assert leaf.priority == 7
    child = cache.insert([1, 2, 3, 4], priority=1).last_node
    assert (leaf.priority, child.priority) == (7, 1)


# -- hand-built scenarios, exact orders ------------------------------------------------------
# Leaves A=[1,1] B=[2,2] C=[3,3] D=[4,4], named by their first kv value 10/20/30/40.
# After the calls below: A created 1st, hits 3, last touched 6th; B created 2nd, hits 1,
# touched 8th (a match); C created 3rd, hits 2, touched 7th; D created 4th, hits 1, touched 9th.
ACCESS_SCENARIO_ORDER = {
    "lru": [10, 30, 20, 40],
    "priority": [10, 30, 20, 40],
    "lfu": [20, 40, 30, 10],       # hits 1 (B older than D), 2, 3
    "fifo": [10, 20, 30, 40],
    "mru": [40, 20, 30, 10],
    "filo": [40, 30, 20, 10],
    "slru": [20, 40, 10, 30],      # probation B, D then protected A, C, each LRU
}


@pytest.mark.parametrize("policy", POLICIES)
def test_access_scenario_evicts_in_the_policy_order(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    for first in (1, 2, 3, 4):
        cache.insert([first, first], [10 * first, 10 * first + 1])
    cache.insert([1, 1])
    cache.insert([1, 1])
    cache.insert([3, 3])
    assert cache.match_prefix([2, 2]).length == 2
    assert cache.match_prefix([4, 4]).length == 2
    hits = {int(node.value[0]): node.hit_count for node in evictable_leaves(cache)}
    assert hits == {10: 3, 20: 1, 30: 2, 40: 1}
    assert eviction_order(cache) == ACCESS_SCENARIO_ORDER[policy]


# [7,7,7] (kv 70..72) then [7,7,8] splits it: upper U=[7,7] (kv 70) keeps the creation of the
# first insert and is touched by the second; lower L=[7] (kv 72) keeps the first insert's
# stamps; new leaf N=[8] (kv 80). Then X=[9] (kv 90). U becomes a leaf once L and N are gone.
SPLIT_SCENARIO_ORDER = {
    "lru": [72, 80, 70, 90],
    "priority": [72, 80, 70, 90],
    "fifo": [72, 80, 70, 90],
    "mru": [90, 80, 72, 70],
    "filo": [90, 80, 72, 70],
    "lfu": [72, 80, 90, 70],       # U has 2 hits (inherited 1 + the splitting insert)
    "slru": [72, 80, 90, 70],      # U is the only protected node
}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_parent_left_childless_joins_the_policy_order(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    cache.insert([7, 7, 7], [70, 71, 72])
    cache.insert([7, 7, 8], [70, 71, 80])
    cache.insert([9], [90])
    assert cache.node_count() == 4
    assert eviction_order(cache) == SPLIT_SCENARIO_ORDER[policy]


# Priorities 2, 0, 1, 0 on leaves 10, 20, 30, 40: the two priority-0 leaves go first, in the
# policy's own order (20 is older, equally hit), then 30, then 10.
@pytest.mark.parametrize("policy", POLICIES)
def test_lower_priority_goes_first_with_every_policy(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    for first, priority in ((1, 2), (2, 0), (3, 1), (4, 0)):
        cache.insert([first], [10 * first], priority=priority)
    newest_first = policy in ("mru", "filo")
    expected = [40, 20, 30, 10] if newest_first else [20, 40, 30, 10]
    assert eviction_order(cache) == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_raised_priority_moves_a_leaf_back(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    for first in (1, 2, 3):
        cache.insert([first], [10 * first])
    cache.insert([1], priority=5)   # 10 goes last whatever the policy
    cache.insert([3], priority=-1)  # no lowering: 30 stays at priority 0
    assert eviction_order(cache)[-1] == 10


def test_priority_policy_orders_equal_priorities_by_lru(make_cache):
    cache = make_cache(eviction_policy="priority")
    cache.insert([1], [10], priority=1)
    cache.insert([2], [20], priority=1)
    cache.insert([3], [30], priority=0)
    cache.insert([4], [40], priority=1)
    cache.match_prefix([1])
    assert eviction_order(cache) == [30, 20, 40, 10]


@pytest.mark.parametrize("policy", POLICIES)
def test_locked_leaves_are_skipped_and_return_after_unlock(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    handles = [cache.insert([first], [10 * first]).last_node for first in (1, 2, 3)]
    cache.inc_lock_ref(handles[0])
    cache.inc_lock_ref(handles[2])
    freed_values: list = []
    assert cache.evict(10, freed_values.append) == 1
    assert [int(v[0]) for v in freed_values] == [20]
    assert cache.evict(10) == 0
    cache.dec_lock_ref(handles[2])
    assert eviction_order(cache) == [30]
    cache.dec_lock_ref(handles[0])
    assert eviction_order(cache) == [10]


# -- the root is never a candidate ----------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size, tokens", [(1, []), (4, []), (4, [1, 2, 3])])
def test_an_insert_with_no_full_page_on_an_empty_cache_leaves_nothing_to_evict(
        make_cache, policy, page_size, tokens):
    # Such an insert ends at the root; the root must not become an eviction candidate.
    cache = make_cache(page_size=page_size, eviction_policy=policy)
    assert cache.insert(tokens).last_node is cache.root_node
    assert cache.evict(1) == 0
    page = list(range(10, 10 + page_size))
    cache.insert(page, page)
    assert eviction_order(cache) == [10]
    assert cache.evict(1) == 0 and cache.node_count() == 0


# -- the lazy heap under heavy access --------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_heap_stays_bounded_under_many_accesses_without_eviction(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    num_leaves = 40
    seqs = [[i, 1000 + i] for i in range(num_leaves)]
    handles = [cache.insert(seq, [2 * i, 2 * i + 1]).last_node for i, seq in enumerate(seqs)]
    bound = 2 * num_leaves + 1024
    for round_no in range(50):
        for i, seq in enumerate(seqs):
            assert cache.match_prefix(seq).length == 2
            if (i + round_no) % 7 == 0:
                cache.insert(seq)  # a touch through insert, no new leaf
            if (i + round_no) % 2 == 0:
                cache.inc_lock_ref(handles[i])  # each unlock pushes the leaf again
                cache.dec_lock_ref(handles[i])
        assert len(core_of(cache).heap) <= bound
    # A last plain pass fixes the recency order exactly: LRU and MRU orders are known.
    last_pass = [(7 * i) % num_leaves for i in range(num_leaves)]
    for i in last_pass:
        cache.match_prefix(seqs[i])
    assert len(core_of(cache).heap) <= bound
    check_invariants(cache)
    victims = []
    while (freed := evict_one_checked(cache, policy)) is not None:
        victims.append(int(freed[0]) // 2)
    assert sorted(victims) == list(range(num_leaves))
    if policy in ("lru", "priority"):
        assert victims == last_pass
    elif policy == "mru":
        assert victims == last_pass[::-1]


# -- the property ---------------------------------------------------------------------------
def _operations(page_size: int):
    """A small pool of sequences and operations naming them by index: repeats are common, so
    leaves with 1, 2 and 3+ hits and fresh and stale touches sit side by side."""
    pool = st.lists(page_sequences(page_size), min_size=1, max_size=6)
    seq_index = st.integers(0, 5)
    extra_keys = st.sampled_from([None, None, None, "ns"])
    insert = st.tuples(st.just("insert"), seq_index, extra_keys,
                       st.sampled_from([0, 0, 0, 1, -1, 2]))
    match = st.tuples(st.just("match"), seq_index, extra_keys)
    ops = st.lists(st.one_of(
        insert, insert, match, match,  # listed twice: drawn more often
        st.tuples(st.just("lock"), st.integers(0, 50)),
        st.tuples(st.just("unlock"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(1, 4)),
    ), min_size=8, max_size=50)
    return st.tuples(pool, ops)


def _run_checked(cache, policy: str, pool, operations) -> None:
    handles: list = []
    held: list = []  # nodes this run locked, once per inc_lock_ref
    next_kv = 0
    for op in operations:
        kind = op[0]
        if kind == "insert":
            _, index, extra_key, priority = op
            tokens = pool[index % len(pool)]
            kv = list(range(next_kv, next_kv + len(tokens)))
            next_kv += len(tokens)
            result = cache.insert(tokens, kv, extra_key=extra_key, priority=priority)
            if result.last_node is not cache.root_node:
                handles.append(result.last_node)
        elif kind == "match":
            _, index, extra_key = op
            tokens = pool[index % len(pool)]
            result = cache.match_prefix(tokens, extra_key=extra_key)
            if result.length:
                handles.append(result.last_node)
        elif kind == "lock":
            live = [node for node in handles if not node.evicted]
            if live:
                node = live[op[1] % len(live)]
                cache.inc_lock_ref(node)
                held.append(node)
        elif kind == "unlock":
            if held:
                cache.dec_lock_ref(held.pop(op[1] % len(held)))
        else:
            for _ in range(op[1]):
                if evict_one_checked(cache, policy) is None:
                    break
        check_invariants(cache)
    # Everything unlocked, the cache must drain completely in policy order.
    for node in held:
        cache.dec_lock_ref(node)
    while evict_one_checked(cache, policy) is not None:
        pass
    assert cache.total_size() == 0 and cache.node_count() == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_eviction_takes_a_minimum_of_the_policy_order(make_cache, policy, page_size, data):
    pool, operations = data.draw(_operations(page_size), label="pool, operations")
    cache = make_cache(page_size=page_size, eviction_policy=policy)
    _run_checked(cache, policy, pool, operations)

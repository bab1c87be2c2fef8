"""Eviction ranks (``set_eviction_rank``, ``evict``'s ``on_remove`` answer), on every core.

Every evictable leaf of a lower rank goes before any of a higher one, in policy order within a
rank; a rank stays with its node (a split's lower half) until it is set again or the node
leaves; what ``on_remove`` answers is the parent's rank before the parent can follow. Checked
one victim at a time against the key the heap itself reports (``key_of``: the rank above the
policy's fields), between the two cores on one random sequence, and under bad input and
re-entry, with the heap's lazy invariant (``check_invariants``) after every step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import check_invariants, core_of, node_tokens
from radixcache import EVICTION_POLICIES, RadixCache
from radixcache._core import CORES

INT64_MAX = 2**63 - 1


def leaves(cache) -> list:
    """The evictable leaves now (unlocked, childless, not the root)."""
    tree = core_of(cache).tree
    return [node for node, _ in tree.iter_nodes()
            if node is not tree.root and not node.children and not node.lock_ref]


def evict_one(cache) -> object:
    """Evict exactly one leaf (every node holds >= 1 token); returns it, or None."""
    victims = []
    cache.evict(1, on_remove=victims.append)
    return victims[-1] if victims else None


def evicted_tokens(cache, count: int) -> list:
    """The token paths of the next ``count`` victims, one eviction each."""
    paths = []
    for _ in range(count):
        cache.evict(1, on_remove=lambda node: paths.append(node_tokens(node)))
    return paths


def random_cache(make_cache, policy: str, rng: random.Random, sequences: int = 40):
    cache = make_cache(page_size=1, eviction_policy=policy, array_type="numpy")
    for _ in range(sequences):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        cache.insert(seq, priority=rng.choice((0, 0, 1)))
        if rng.random() < 0.5:
            cache.match_prefix(seq[:rng.randrange(1, len(seq) + 1)])
    return cache


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_every_victim_is_the_least_by_rank_then_policy(make_cache, policy):
    rng = random.Random(policy)
    cache = random_cache(make_cache, policy, rng)
    heap = core_of(cache).heap
    while cache.evictable_size():
        for node in leaves(cache):  # fresh ranks, raised and lowered, between victims
            if rng.random() < 0.3:
                cache.set_eviction_rank(node, rng.randrange(3))
        check_invariants(cache)
        expected = min(leaves(cache), key=heap.key_of)
        assert evict_one(cache) is expected
        check_invariants(cache)


def test_a_rank_stays_with_the_lower_half_of_a_split(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2, 3, 4])
    cache.insert([9])
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.set_eviction_rank(leaf, 3)
    upper = cache.match_prefix([1, 2]).last_node  # splits the leaf: [1, 2] above [3, 4]
    assert upper is not leaf and leaf.parent is upper
    assert cache.eviction_rank(leaf) == 3 and cache.eviction_rank(upper) == 0
    assert evicted_tokens(cache, 3) == [[9], [1, 2, 3, 4], [1, 2]]
    check_invariants(cache)


@pytest.mark.parametrize("answer, order", [
    (0, [[1, 2, 3], [1], [5]]),  # the parent drops from 3 to 0: it goes before [5] (rank 1)
    (1, [[1, 2, 3], [1], [5]]),  # to 1, as [5], and older (lru)
    (2, [[1, 2, 3], [5], [1]]),  # to 2: after [5]
    (None, [[1, 2, 3], [5], [1]]),  # unchanged: 3
])
def test_on_remove_answer_is_the_parents_rank_before_it_competes(make_cache, answer, order):
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2, 3])
    cache.insert([5])
    cache.insert([1])  # [1] is a node of its own, parent of [2, 3]
    cache.set_eviction_rank(cache.match_prefix([1]).last_node, 3)
    cache.set_eviction_rank(cache.match_prefix([1, 2, 3]).last_node, 1)
    cache.set_eviction_rank(cache.match_prefix([5]).last_node, 1)
    cache.match_prefix([5])  # [5] used last: under lru, [1, 2, 3] is the older of the two
    seen = []

    def on_remove(node):
        seen.append(node_tokens(node))
        return answer if node_tokens(node) == [1, 2, 3] else None

    assert cache.evict(100, on_remove=on_remove) == 4
    assert seen == order
    check_invariants(cache)


def test_rank_goes_with_its_node_and_with_reset(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    node = cache.insert([1, 2]).last_node
    cache.set_eviction_rank(node, 7)
    assert cache.eviction_rank(node) == 7
    assert cache.evict(2) == 2 and node.evicted
    with pytest.raises(ValueError, match="evicted"):
        cache.eviction_rank(node)
    again = cache.insert([1, 2]).last_node
    assert cache.eviction_rank(again) == 0
    cache.set_eviction_rank(again, 2)
    cache.reset()
    assert cache.eviction_rank(cache.insert([1, 2]).last_node) == 0
    check_invariants(cache)


def test_a_ranked_locked_leaf_waits_for_its_unlock(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    a = cache.insert([1]).last_node
    b = cache.insert([2]).last_node
    cache.set_eviction_rank(a, 1)
    cache.inc_lock_ref(a)
    cache.set_eviction_rank(a, 0)  # lowered while locked: no entry yet
    cache.dec_lock_ref(a)  # now an evictable leaf of rank 0, older than b
    check_invariants(cache)
    assert evict_one(cache) is a and evict_one(cache) is b


def test_bad_ranks_change_nothing(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    node = cache.insert([1, 2]).last_node
    other_cache = make_cache(page_size=1, array_type="numpy")
    other = other_cache.insert([1]).last_node
    cache.set_eviction_rank(node, 4)
    for rank, error in [(1.0, TypeError), ("1", TypeError), (True, TypeError),
                        (-1, ValueError), (INT64_MAX + 1, ValueError)]:
        with pytest.raises(error, match="rank"):
            cache.set_eviction_rank(node, rank)
    with pytest.raises(ValueError, match="root"):
        cache.set_eviction_rank(cache.root_node, 1)
    with pytest.raises(ValueError, match="another cache"):
        cache.set_eviction_rank(other, 1)
    with pytest.raises(TypeError, match="RadixTreeNode"):
        cache.set_eviction_rank("node", 1)
    assert cache.eviction_rank(node) == 4
    # The core checks what cache.py hands it too (a numpy int is cache.py's to convert).
    with pytest.raises(TypeError, match="rank"):
        core_of(cache).set_rank(node, np.int64(1))
    with pytest.raises(ValueError, match="rank"):
        core_of(cache).set_rank(node, -1)
    assert cache.eviction_rank(node) == 4
    cache.set_eviction_rank(node, np.int64(INT64_MAX))  # the top of the range
    assert cache.eviction_rank(node) == INT64_MAX
    check_invariants(cache)


def test_a_host_tier_has_no_ranks(core_name):
    cache = RadixCache(page_size=1, core=core_name, host_tier=True, array_type="numpy")
    node = cache.insert([1, 2]).last_node
    with pytest.raises(ValueError, match="host tier"):
        cache.set_eviction_rank(node, 1)
    assert cache.eviction_rank(node) == 0


@pytest.mark.parametrize("answer, error", [("0", TypeError), (1.5, TypeError),
                                           (True, TypeError), (-1, ValueError),
                                           (INT64_MAX + 1, ValueError)])
@pytest.mark.parametrize("batch", [False, True])
def test_a_bad_answer_leaves_the_victim_and_the_parent(make_cache, answer, error, batch):
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2])
    cache.insert([1])
    parent = cache.match_prefix([1]).last_node
    cache.set_eviction_rank(parent, 3)
    freed = []
    with pytest.raises(error, match="on_remove"):
        cache.evict(10, freed.append if batch else None, batch=batch,
                    on_remove=lambda node: answer)
    assert cache.total_size() == cache.evictable_size() == 2 and not freed
    assert cache.eviction_rank(parent) == 3
    check_invariants(cache)
    assert cache.evict(10) == 2


def test_on_remove_may_not_call_the_cache(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    node = cache.insert([1, 2]).last_node

    def on_remove(victim):
        cache.set_eviction_rank(victim, 1)

    with pytest.raises(RuntimeError, match="re-entered"):
        cache.evict(10, on_remove=on_remove)
    assert cache.eviction_rank(node) == 0 and cache.evictable_size() == 2
    check_invariants(cache)


def test_the_heap_stays_small_under_rank_churn(make_cache):
    """Rank changes push entries (the old ones die); compaction keeps the heap bounded and
    an emptied rank's sub-heap goes."""
    rng = random.Random(5)
    cache = make_cache(page_size=1, array_type="numpy")
    nodes = [cache.insert([i, i + 1]).last_node for i in range(0, 400, 2)]
    for _ in range(20_000):
        cache.set_eviction_rank(rng.choice(nodes), rng.randrange(4))
    check_invariants(cache)
    assert len(core_of(cache).heap) <= 4 * 1024 + 4 * len(nodes)
    for node in nodes:
        cache.set_eviction_rank(node, 0)
    assert cache.evict(10**6) == 400
    assert len(core_of(cache).heap) == 0


@pytest.mark.skipif(len(CORES) < 2, reason="needs both cores")
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_both_cores_evict_alike_with_ranks(policy):
    """One random sequence -- inserts (splits), matches, locks, ranks set and answered by
    ``on_remove`` -- on both cores: the same victims, in the same order."""
    caches = {core: RadixCache(page_size=2, eviction_policy=policy, core=core,
                               array_type="numpy") for core in CORES}
    rng = random.Random(f"both-{policy}")
    locked: dict = {core: [] for core in CORES}
    victims: dict = {core: [] for core in CORES}
    for step in range(1500):
        roll = rng.random()
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        rank = rng.randrange(4)
        num_tokens = rng.randrange(1, 8)
        answers = [rng.choice((None, 0, 1, 2, 5)) for _ in range(64)]
        for core, cache in caches.items():
            if roll < 0.35:
                cache.insert(seq, priority=rank % 2)
            elif roll < 0.55:
                cache.match_prefix(seq)
            elif roll < 0.7:
                node = cache.match_prefix(seq).last_node
                if node is not cache.root_node:
                    cache.set_eviction_rank(node, rank)
            elif roll < 0.78:
                node = cache.match_prefix(seq).last_node
                cache.inc_lock_ref(node)
                locked[core].append(node)
            elif roll < 0.84:
                if locked[core]:
                    cache.dec_lock_ref(locked[core].pop(0))
            else:
                answer = iter(answers)

                def on_remove(node, core=core, answer=answer):
                    victims[core].append(node_tokens(node))
                    return next(answer)

                cache.evict(num_tokens, on_remove=on_remove)
        assert victims["c"] == victims["python"], f"step {step}"
    for cache in caches.values():
        check_invariants(cache)
    assert len(victims["c"]) > 100

"""The host tier: known answers worked out by hand, every write policy, locks, splits inside
host-only nodes, events per medium, and bad input that must leave the cache as it was; on
every core."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from conftest import check_invariants, core_of, node_tokens
from radixcache.events import BlockRemoved, BlockStored
from radixcache.router import KvIndexer

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")


class HostPool:
    """An engine's host pool as the tests see it: hands out host slots 100, 101, ... as
    ``backup``, up to ``capacity``, and records what it was asked to copy."""

    def __init__(self, capacity: int = 10**6, start: int = 100) -> None:
        self.capacity = capacity
        self.next = start
        self.used = 0
        self.copied: list = []  # device indices backup was called with, as lists

    def backup(self, device_indices: torch.Tensor):
        n = device_indices.shape[0]
        meta = device_indices.device.type == "meta"  # no data to show
        self.copied.append(None if meta else device_indices.tolist())
        if self.used + n > self.capacity:
            return None
        out = torch.arange(self.next, self.next + n, dtype=torch.int64)
        self.next += n
        self.used += n
        return out

    def free(self, host_indices: torch.Tensor) -> None:
        self.used -= host_indices.shape[0]


def node_at(cache, tokens, extra_key=None):
    """The node whose path from the root is exactly ``tokens`` (read-only walk)."""
    for node, depth in core_of(cache).tree.iter_nodes():
        if depth and node_tokens(node) == list(tokens) and node.extra_key == extra_key:
            return node
    raise AssertionError(f"no node for {tokens}")


def tiers(cache) -> dict:
    """{path tokens: (tier, device values or None, host values or None)} of every node."""
    out = {}
    for node, depth in core_of(cache).tree.iter_nodes():
        if depth:
            value = node.value
            host = node.host_value
            out[tuple(node_tokens(node))] = (
                node.tier, None if value is None else value.tolist(),
                None if host is None else host.tolist())
    return out


def snapshot(cache) -> tuple:
    """Everything a bad call must leave unchanged."""
    nodes = []
    for node, depth in core_of(cache).tree.iter_nodes():
        value = node.value
        host = node.host_value if cache.host_tier else None
        nodes.append((depth, node.id, tuple(node.key.tolist()), node.tier if cache.host_tier
                      else None, None if value is None else tuple(value.tolist()),
                      None if host is None else tuple(host.tolist()), node.lock_ref,
                      node.last_access_time, node.hit_count, node.priority, node.evicted))
    return nodes, cache.stats(), core_of(cache).tree.clock


def two_branches(make_cache, **kwargs):
    """page 2: [1,2] -> {[3,4], [5,6]} with device slots 10.. (see each test)."""
    cache = make_cache(page_size=2, host_tier=True, **kwargs)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 5, 6], [10, 11, 20, 21])
    return cache


# -- construction and the one-tier cache -----------------------------------------------
def test_write_policy_and_host_tier_arguments(make_cache):
    for policy in ("write_back", "write_through", "write_through_selective"):
        cache = make_cache(host_tier=True, write_policy=policy)
        assert cache.write_policy == policy and cache.host_tier
        assert cache.host_size() == 0
    with pytest.raises(ValueError, match="unknown write_policy 'write_around'"):
        make_cache(host_tier=True, write_policy="write_around")
    with pytest.raises(TypeError, match="write_policy must be a str"):
        make_cache(host_tier=True, write_policy=1)
    with pytest.raises(TypeError, match="host_tier must be a bool"):
        make_cache(host_tier=1)


def test_host_calls_on_a_cache_without_host_tier(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.host_length == 0 and m.last_host_node is m.last_node
    before = snapshot(cache)
    pool = HostPool()
    with pytest.raises(ValueError, match="host tier"):
        cache.evict(2, backup=pool.backup)
    with pytest.raises(ValueError, match="evict_host needs a cache with a host tier"):
        cache.evict_host(2)
    with pytest.raises(ValueError, match="write_through needs a cache with a host tier"):
        cache.write_through(pool.backup)
    with pytest.raises(ValueError, match="load_back needs a cache with a host tier"):
        cache.load_back(m, [])
    with pytest.raises(ValueError, match="host_size needs a cache with a host tier"):
        cache.host_size()
    assert snapshot(cache) == before
    assert pool.copied == []
    stats = cache.stats()
    assert (stats.host_hit_tokens, stats.loaded_tokens, stats.backed_up_tokens,
            stats.host_evictions, stats.host_evicted_tokens, stats.host_size) == (0,) * 6


# -- demotion, match with host_length, load back ----------------------------------------
def test_evict_demotes_with_backup_then_match_and_load_back(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    freed = []
    # LRU: [3,4] was touched before [5,6]; [1,2] has a child on the device.
    assert cache.evict(2, freed.append, backup=pool.backup) == 2
    assert [t.tolist() for t in freed] == [[12, 13]]
    assert pool.copied == [[12, 13]]
    assert tiers(cache) == {(1, 2): ("device", [10, 11], None),
                            (1, 2, 3, 4): ("host", None, [100, 101]),
                            (1, 2, 5, 6): ("device", [20, 21], None)}
    assert cache.total_size() == cache.evictable_size() == 4
    assert cache.host_size() == 4 - 2
    stats = cache.stats()
    assert (stats.evictions, stats.evicted_tokens, stats.backed_up_tokens) == (1, 2, 2)
    assert stats.node_count == 3
    check_invariants(cache)

    m = cache.match_prefix([1, 2, 3, 4, 7, 7, 9])
    assert (m.length, m.host_length) == (2, 2)
    assert m.indices.tolist() == [10, 11]
    assert node_tokens(m.last_node) == [1, 2]
    assert node_tokens(m.last_host_node) == [1, 2, 3, 4]
    assert "host_length=2" in repr(m)
    stats = cache.stats()
    assert (stats.matched_tokens, stats.queried_tokens, stats.host_hit_tokens) == (2, 6, 2)

    host = cache.load_back(m, torch.tensor([30, 31]))
    assert host.tolist() == [100, 101] and host.dtype == torch.int64
    assert tiers(cache)[(1, 2, 3, 4)] == ("device+host", [30, 31], [100, 101])
    assert cache.total_size() == cache.evictable_size() == 6
    assert cache.stats().loaded_tokens == 2
    m2 = cache.match_prefix([1, 2, 3, 4])
    assert (m2.length, m2.host_length) == (4, 0)
    assert m2.indices.tolist() == [10, 11, 30, 31]
    assert m2.last_host_node is m2.last_node
    check_invariants(cache)

    # A victim with a host copy loses only its device value: no second backup.
    def no_backup(_):
        raise AssertionError("backup called for a node with a host copy")

    cache.match_prefix([1, 2, 5, 6])  # [3,4] is now the least recently used leaf
    freed.clear()
    assert cache.evict(2, freed.append, backup=no_backup) == 2
    assert [t.tolist() for t in freed] == [[30, 31]]
    assert tiers(cache)[(1, 2, 3, 4)] == ("host", None, [100, 101])
    assert cache.host_size() == 2
    check_invariants(cache)


def test_parent_follows_its_children_off_the_device(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    freed = []
    assert cache.evict(100, freed.append, backup=pool.backup) == 6
    # Both leaves first (LRU), then their parent, which became a device leaf.
    assert [t.tolist() for t in freed] == [[12, 13], [20, 21], [10, 11]]
    assert tiers(cache) == {(1, 2): ("host", None, [104, 105]),
                            (1, 2, 3, 4): ("host", None, [100, 101]),
                            (1, 2, 5, 6): ("host", None, [102, 103])}
    assert cache.total_size() == 0 and cache.host_size() == 6
    m = cache.match_prefix([1, 2, 5, 6])
    assert (m.length, m.host_length) == (0, 4)
    assert m.last_node is cache.root_node and m.indices.tolist() == []
    assert node_tokens(m.last_host_node) == [1, 2, 5, 6]
    assert cache.load_back(m, [40, 41, 42, 43]).tolist() == [104, 105, 102, 103]
    assert cache.match_prefix([1, 2, 5, 6]).indices.tolist() == [40, 41, 42, 43]
    assert tiers(cache)[(1, 2, 3, 4)] == ("host", None, [100, 101])
    check_invariants(cache)


def test_batch_evict_with_backup(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    got = []
    assert cache.evict(100, got.append, batch=True, backup=pool.backup) == 6
    assert len(got) == 1 and got[0].tolist() == [12, 13, 20, 21, 10, 11]
    assert pool.copied == [[12, 13], [20, 21], [10, 11]]
    check_invariants(cache)


def test_no_host_copy_deletes_a_childless_victim(make_cache):
    cache = two_branches(make_cache)
    full = HostPool(capacity=0)
    freed = []
    assert cache.evict(2, freed.append, backup=full.backup) == 2  # host full: deleted
    assert full.copied == [[12, 13]]
    assert (1, 2, 3, 4) not in tiers(cache)
    assert cache.evict(2, freed.append) == 2  # no backup given: deleted too
    assert tiers(cache) == {(1, 2): ("device", [10, 11], None)}
    assert cache.host_size() == 0 and cache.stats().backed_up_tokens == 0
    check_invariants(cache)


def test_a_victim_with_host_only_children_and_no_host_copy_stays(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2], [10, 11])  # split: [1,2] -> [3,4]
    pool = HostPool(capacity=2)
    assert cache.evict(2, backup=pool.backup) == 2  # [3,4] goes to the host
    freed = []
    # [1,2] is a device leaf now, but the host is full and it has a host-only child.
    assert cache.evict(2, freed.append, backup=pool.backup) == 0
    assert freed == [] and pool.copied == [[12, 13], [10, 11]]
    assert tiers(cache) == {(1, 2): ("device", [10, 11], None),
                            (1, 2, 3, 4): ("host", None, [100, 101])}
    assert cache.evict(2) == 0  # no backup: it stays as well
    check_invariants(cache)  # ... and it is still on the heap
    host_freed = []
    assert cache.evict_host(2, host_freed.append) == 2
    assert [t.tolist() for t in host_freed] == [[100, 101]]
    assert cache.evict(2, freed.append) == 2  # childless now: deleted
    assert [t.tolist() for t in freed] == [[10, 11]]
    assert cache.node_count() == 0
    check_invariants(cache)


# -- adoption ------------------------------------------------------------------------------
def test_insert_adopts_host_only_nodes(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    cache.evict(100, backup=pool.backup)  # all on the host
    result = cache.insert([1, 2, 3, 4, 7, 7], [50, 51, 52, 53, 54, 55])
    assert result.prefix_len == 0  # adopted tokens are not duplicates
    assert node_tokens(result.last_node) == [1, 2, 3, 4, 7, 7]
    assert tiers(cache) == {(1, 2): ("device+host", [50, 51], [104, 105]),
                            (1, 2, 3, 4): ("device+host", [52, 53], [100, 101]),
                            (1, 2, 3, 4, 7, 7): ("device", [54, 55], None),
                            (1, 2, 5, 6): ("host", None, [102, 103])}
    assert cache.total_size() == cache.evictable_size() == 6
    assert cache.stats().inserted_tokens == 4 + 2 + 2  # the adopted ones are not inserted
    check_invariants(cache)
    # A device prefix counts; adopted tokens after it do not.
    result = cache.insert([1, 2, 5, 6], torch.tensor([60, 61, 62, 63]))
    assert result.prefix_len == 2
    assert tiers(cache)[(1, 2, 5, 6)] == ("device+host", [62, 63], [102, 103])
    check_invariants(cache)


def test_adoption_without_kv_uses_the_tokens(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4])
    pool = HostPool()
    cache.evict(4, backup=pool.backup)
    assert cache.insert([1, 2, 3, 4]).prefix_len == 0
    assert tiers(cache) == {(1, 2, 3, 4): ("device+host", [1, 2, 3, 4], [100, 101, 102, 103])}
    assert cache.exists([1, 2, 3, 4])
    check_invariants(cache)


def test_a_sequence_held_on_the_host_alone_still_exists(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.evict(4, backup=HostPool().backup)
    assert cache.total_size() == 0 and cache.host_size() == 4
    assert cache.exists([1, 2, 3, 4]) and [1, 2, 3, 4] in cache
    assert not cache.exists([1, 2])  # a prefix, never inserted alone
    cache.evict_host(4)
    assert not cache.exists([1, 2, 3, 4])
    check_invariants(cache)


# -- splits inside host-only nodes ---------------------------------------------------------
def test_match_splits_a_host_only_node(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    cache.evict(6, backup=HostPool().backup)
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.length, m.host_length) == (0, 4)
    assert cache.stats().splits == 1
    assert tiers(cache) == {(1, 2, 3, 4): ("host", None, [100, 101, 102, 103]),
                            (1, 2, 3, 4, 5, 6): ("host", None, [104, 105])}
    check_invariants(cache)
    assert cache.load_back(m, [20, 21, 22, 23]).tolist() == [100, 101, 102, 103]
    assert tiers(cache)[(1, 2, 3, 4)] == ("device+host", [20, 21, 22, 23],
                                          [100, 101, 102, 103])
    assert tiers(cache)[(1, 2, 3, 4, 5, 6)] == ("host", None, [104, 105])
    check_invariants(cache)


def test_insert_splits_a_host_only_node(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    cache.evict(6, backup=HostPool().backup)
    result = cache.insert([1, 2, 7, 7], [30, 31, 32, 33])
    assert result.prefix_len == 0
    assert tiers(cache) == {(1, 2): ("device+host", [30, 31], [100, 101]),
                            (1, 2, 3, 4, 5, 6): ("host", None, [102, 103, 104, 105]),
                            (1, 2, 7, 7): ("device", [32, 33], None)}
    check_invariants(cache)


# -- evict_host ------------------------------------------------------------------------------
def test_evict_host_in_policy_order_and_parents_follow(make_cache):
    cache = two_branches(make_cache)
    cache.evict(100, backup=HostPool().backup)  # all host only
    cache.match_prefix([1, 2, 3, 4])  # [5,6] is now the least recently used host leaf
    freed = []
    assert cache.evict_host(2, freed.append) == 2
    assert [t.tolist() for t in freed] == [[102, 103]]
    assert cache.evict_host(100, freed.append) == 4
    assert [t.tolist() for t in freed] == [[102, 103], [100, 101], [104, 105]]
    stats = cache.stats()
    assert (stats.host_evictions, stats.host_evicted_tokens, stats.host_size) == (3, 6, 0)
    assert cache.node_count() == 0
    check_invariants(cache)


def test_evict_host_batch_and_device_nodes_untouched(make_cache):
    cache = two_branches(make_cache, write_policy="write_through")
    pool = HostPool()
    assert cache.write_through(pool.backup) == 6  # every node on both tiers
    got = []
    assert cache.evict_host(100, got.append, batch=True) == 0  # all on the device
    assert got == []
    cache.evict(2)  # [3,4] leaves the device: host only now
    assert cache.evict_host(100, got.append, batch=True) == 2
    assert [t.tolist() for t in got] == [[100, 101]]
    assert cache.host_size() == 4
    check_invariants(cache)


# -- locks -----------------------------------------------------------------------------------
def test_locks_and_tiers(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    cache.evict(2, backup=pool.backup)  # [3,4] host only
    host_node = node_at(cache, [1, 2, 3, 4])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="only on the host: load it back first"):
        cache.inc_lock_ref(host_node)
    assert snapshot(cache) == before
    device_leaf = node_at(cache, [1, 2, 5, 6])
    assert cache.inc_lock_ref(device_leaf) == -4
    assert cache.evict(100, backup=pool.backup) == 0  # the locked path stays on the device
    assert cache.evict_host(100) == 2  # the host-only leaf can go
    assert tiers(cache) == {(1, 2): ("device", [10, 11], None),
                            (1, 2, 5, 6): ("device", [20, 21], None)}
    assert cache.dec_lock_ref(device_leaf) == 4
    check_invariants(cache)


def test_locked_loaded_path_is_never_evicted_from_either_tier(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    cache.evict(100, backup=pool.backup)
    m = cache.match_prefix([1, 2, 3, 4])
    cache.load_back(m, [70, 71, 72, 73])
    cache.inc_lock_ref(m.last_host_node)
    assert cache.protected_size() == 4
    cache.evict(100, backup=pool.backup)
    cache.evict_host(100)
    assert tiers(cache) == {(1, 2): ("device+host", [70, 71], [104, 105]),
                            (1, 2, 3, 4): ("device+host", [72, 73], [100, 101])}
    check_invariants(cache)


# -- write policies --------------------------------------------------------------------------
def test_write_back_never_writes_through(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    assert cache.write_through(pool.backup) == 0
    assert pool.copied == [] and cache.host_size() == 0


def test_write_through_copies_on_first_hit_in_order(make_cache):
    cache = two_branches(make_cache, write_policy="write_through")
    pool = HostPool(capacity=4)
    # Due in the order they were made: [1,2,3,4], then (split) [1,2], then [5,6].
    assert cache.write_through(pool.backup) == 2 + 2
    assert pool.copied == [[12, 13], [10, 11], [20, 21]]  # the last one found the host full
    assert tiers(cache) == {(1, 2): ("device+host", [10, 11], [102, 103]),
                            (1, 2, 3, 4): ("device+host", [12, 13], [100, 101]),
                            (1, 2, 5, 6): ("device", [20, 21], None)}
    pool.capacity = 100
    assert cache.write_through(pool.backup) == 2
    assert tiers(cache)[(1, 2, 5, 6)] == ("device+host", [20, 21], [104, 105])
    assert cache.write_through(pool.backup) == 0
    assert cache.stats().backed_up_tokens == 6
    # Evicting a node with a host copy needs no backup, whatever the policy.
    assert cache.evict(100) == 6
    assert cache.host_size() == 6 and cache.total_size() == 0
    check_invariants(cache)


def test_write_through_selective_needs_two_hits(make_cache):
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through_selective")
    pool = HostPool()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.write_through(pool.backup) == 0  # one hit only
    cache.insert([1, 2, 5, 6], [10, 11, 20, 21])  # [1,2] (split off [3,4]) hit twice
    assert cache.write_through(pool.backup) == 2
    assert pool.copied == [[10, 11]]
    cache.insert([1, 2, 5, 6], [10, 11, 20, 21])
    assert cache.write_through(pool.backup) == 2
    assert pool.copied == [[10, 11], [20, 21]]
    assert tiers(cache)[(1, 2, 3, 4)] == ("device", [12, 13], None)
    # backup is not called by evict with a write-through policy: [3,4] is deleted.
    assert cache.evict(2, backup=pool.backup) == 2
    assert (1, 2, 3, 4) not in tiers(cache)
    check_invariants(cache)


def test_write_through_split_of_a_queued_node_queues_its_upper_half(make_cache):
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.match_prefix([1, 2])  # splits the queued node
    pool = HostPool()
    assert cache.write_through(pool.backup) == 4
    assert pool.copied == [[12, 13], [10, 11]]  # the lower half first: it was queued first
    check_invariants(cache)


# -- load_back errors ------------------------------------------------------------------------
def test_load_back_refuses_a_stale_match_or_wrong_slots(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    cache.evict(100, backup=pool.backup)
    m = cache.match_prefix([1, 2, 3, 4])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="device_indices has 3 entries|3 device indices"):
        cache.load_back(m, [1, 2, 3])
    with pytest.raises(ValueError, match="5 device indices"):
        cache.load_back(m, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="device_indices must be 1-D"):
        cache.load_back(m, [[1, 2], [3, 4]])
    with pytest.raises(TypeError, match="device_indices must hold integers"):
        cache.load_back(m, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(TypeError, match="match must be a MatchResult"):
        cache.load_back("match", [1, 2, 3, 4])
    assert snapshot(cache) == before
    cache.load_back(m, [1, 2, 3, 4])
    after = snapshot(cache)
    with pytest.raises(ValueError, match="stale match"):
        cache.load_back(m, [1, 2, 3, 4])  # already loaded
    assert snapshot(cache) == after
    m = cache.match_prefix([1, 2, 5, 6])
    cache.evict_host(100)  # [5,6] is gone
    after = snapshot(cache)
    with pytest.raises(ValueError, match="stale match"):
        cache.load_back(m, [5, 6])
    assert snapshot(cache) == after
    other = make_cache(page_size=2, host_tier=True)
    other.insert([1, 2, 3, 4], [1, 2, 3, 4])
    other.evict(4, backup=HostPool().backup)
    foreign = other.match_prefix([1, 2, 3, 4])
    with pytest.raises(ValueError, match="stale match"):
        cache.load_back(foreign, [1, 2, 3, 4])
    assert snapshot(cache) == after
    check_invariants(cache)


def test_load_back_of_a_match_without_host_part(make_cache):
    cache = two_branches(make_cache)
    m = cache.match_prefix([1, 2, 3, 4])
    out = cache.load_back(m, [])
    assert out.tolist() == [] and out.dtype == torch.int64
    with pytest.raises(ValueError, match="1 device indices"):
        cache.load_back(m, [1])


def test_load_back_after_the_device_prefix_moved_is_stale(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2], [10, 11])
    pool = HostPool()
    cache.evict(2, backup=pool.backup)
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.length, m.host_length) == (2, 2)
    cache.evict(2, backup=pool.backup)  # last_node leaves the device
    before = snapshot(cache)
    with pytest.raises(ValueError, match="stale match"):
        cache.load_back(m, [1, 2])
    assert snapshot(cache) == before


# -- bad backup results ----------------------------------------------------------------------
BAD_BACKUPS = [
    (lambda d: [100, 101], TypeError, "must return a torch.Tensor"),
    (lambda d: np.array([100, 101]), TypeError, "must return a torch.Tensor"),
    (lambda d: torch.tensor([100.0, 101.0]), TypeError, "dtype torch.int64"),
    (lambda d: torch.tensor([100, 101], dtype=torch.int32), TypeError, "dtype torch.int64"),
    (lambda d: torch.tensor([[100, 101]]), ValueError, "1-D"),
    (lambda d: torch.tensor(100), ValueError, "1-D"),
    (lambda d: torch.tensor([100, 101, 102]), ValueError, "3 host indices for 2"),
    (lambda d: torch.tensor([100]), ValueError, "1 host indices for 2"),
    (lambda d: torch.empty(2, dtype=torch.int64, device="meta"), ValueError, "meta tensor"),
    (lambda d: torch.tensor([100, 101]).to_sparse(), ValueError, "sparse_coo tensor"),
]


@pytest.mark.parametrize("bad, error, message", BAD_BACKUPS)
def test_evict_with_a_bad_backup_changes_nothing(make_cache, bad, error, message):
    cache = two_branches(make_cache)
    before = snapshot(cache)
    freed = []
    with pytest.raises(error, match=message):
        cache.evict(2, freed.append, backup=bad)
    assert freed == [] and snapshot(cache) == before
    check_invariants(cache)
    # The victim is still evictable: a good backup takes it.
    assert cache.evict(2, freed.append, backup=HostPool().backup) == 2
    assert tiers(cache)[(1, 2, 3, 4)] == ("host", None, [100, 101])
    check_invariants(cache)


@pytest.mark.parametrize("bad, error, message", BAD_BACKUPS)
def test_write_through_with_a_bad_backup_changes_nothing(make_cache, bad, error, message):
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    cache.insert([1, 2], [10, 11])
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        cache.write_through(bad)
    assert snapshot(cache) == before
    assert cache.write_through(HostPool().backup) == 2  # still due
    check_invariants(cache)


def test_backup_that_raises_or_reenters(make_cache):
    cache = two_branches(make_cache)
    before = snapshot(cache)

    def boom(_):
        raise KeyError("host pool broken")

    with pytest.raises(KeyError):
        cache.evict(2, backup=boom)
    assert snapshot(cache) == before

    def reenter(_):
        cache.match_prefix([1, 2])

    with pytest.raises(RuntimeError, match="re-entered"):
        cache.evict(2, backup=reenter)
    assert snapshot(cache) == before
    check_invariants(cache)
    queued = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    queued.insert([1, 2], [1, 2])
    before = snapshot(queued)
    with pytest.raises(RuntimeError, match="re-entered"):
        queued.write_through(lambda d: queued.evict_host(1))
    assert snapshot(queued) == before


def test_backup_arguments_are_checked(make_cache):
    cache = two_branches(make_cache)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="backup must be callable"):
        cache.evict(2, backup=3)
    with pytest.raises(TypeError, match="backup must be callable"):
        cache.write_through(None)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        cache.evict_host("2")
    with pytest.raises(TypeError, match="free_callback must be callable"):
        cache.evict_host(2, 5)
    assert snapshot(cache) == before


# -- copies, reset, stats, printing ------------------------------------------------------------
def test_a_host_tier_cache_cannot_be_copied(make_cache):
    cache = two_branches(make_cache)
    for how in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="host_tier=True"):
            how(cache)
    with pytest.raises(TypeError, match="host tier"):
        core_of(cache).export_state()


def test_reset_and_reset_stats(make_cache):
    cache = two_branches(make_cache)
    cache.evict(100, backup=HostPool().backup)
    m = cache.match_prefix([1, 2, 3, 4])
    cache.load_back(m, [1, 2, 3, 4])
    cache.evict_host(100)
    cache.reset_stats()
    stats = cache.stats()
    assert (stats.host_hit_tokens, stats.loaded_tokens, stats.backed_up_tokens,
            stats.host_evictions, stats.host_evicted_tokens) == (0,) * 5
    assert stats.host_size == cache.host_size() == 6 - 2
    cache.reset()
    assert cache.host_size() == 0 and cache.node_count() == 0
    assert m.last_host_node.evicted
    check_invariants(cache)


def test_pretty_print_shows_tiers(make_cache, capsys):
    cache = two_branches(make_cache)
    cache.evict(2, backup=HostPool().backup)
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "key=[3, 4] lock_ref=0 tier=host]" in out
    assert "key=[5, 6] lock_ref=0 tier=device]" in out
    assert out.endswith("#tokens: 4\n#host tokens: 2\n")
    plain = make_cache(page_size=2)
    plain.insert([1, 2])
    plain.pretty_print()
    assert "tier" not in capsys.readouterr().out


# -- every policy: a seeded workload keeps the invariants ---------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("write_policy", ["write_back", "write_through",
                                          "write_through_selective"])
def test_every_policy_keeps_the_tier_invariants(make_cache, policy, write_policy):
    rng = np.random.default_rng(7)
    cache = make_cache(page_size=2, eviction_policy=policy, host_tier=True,
                       write_policy=write_policy)
    pool = HostPool(capacity=40)
    locked = []
    slot = 1000
    for _step in range(150):
        seq = [int(t) for t in rng.integers(0, 3, size=int(rng.integers(0, 12)))]
        op = rng.integers(0, 6)
        if op == 0:
            cache.insert(seq, list(range(slot, slot + len(seq))), priority=int(rng.integers(3)))
            slot += len(seq)
        elif op == 1:
            m = cache.match_prefix(seq)
            if m.host_length and rng.random() < 0.7:
                cache.load_back(m, list(range(slot, slot + m.host_length)))
                slot += m.host_length
                if rng.random() < 0.3:
                    cache.inc_lock_ref(m.last_host_node)
                    locked.append(m.last_host_node)
        elif op == 2:
            cache.evict(int(rng.integers(0, 8)), backup=pool.backup)
        elif op == 3:
            cache.evict_host(int(rng.integers(0, 8)), pool.free)
        elif op == 4:
            cache.write_through(pool.backup)
        elif locked:
            cache.dec_lock_ref(locked.pop())
        check_invariants(cache)
    assert pool.used == cache.host_size()


# -- events per medium -------------------------------------------------------------------------
def test_events_carry_the_medium(make_cache):
    cache = make_cache(page_size=2, host_tier=True, enable_events=True)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.take_events()
    pool = HostPool()
    cache.evict(4, backup=pool.backup)
    kinds = [(type(e).__name__, e.medium, len(e.block_hashes)) for e in cache.take_events()]
    assert kinds == [("BlockStored", "CPU", 2), ("BlockRemoved", "GPU", 2)]
    m = cache.match_prefix([1, 2, 3, 4])
    cache.load_back(m, [5, 6, 7, 8])
    events = cache.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [("BlockStored", "GPU")]
    cache.evict(4)
    cache.evict_host(4)
    kinds = [(type(e).__name__, e.medium) for e in cache.take_events()]
    assert kinds == [("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")]
    # Adoption and the new leaf.
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.evict(4, backup=pool.backup)
    cache.take_events()
    cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25])
    events = cache.take_events()
    assert [(type(e).__name__, e.medium, list(e.token_ids)) for e in events] == [
        ("BlockStored", "GPU", [1, 2, 3, 4]), ("BlockStored", "GPU", [5, 6])]


@pytest.mark.parametrize("form", ["list", "int64", "int32", "tuple-of-numpy-ints"])
def test_adoption_events_do_not_depend_on_the_input_form(make_cache, form):
    """The common inputs take the core's fast path, the others the checked one: both give
    the adopted nodes' events (top-down, a split one included) and then the new leaf's."""
    def as_form(seq):
        if form == "list":
            return list(seq)
        if form == "int64":
            return np.array(seq, dtype=np.int64)
        if form == "int32":
            return np.array(seq, dtype=np.int32)
        return tuple(np.int64(t) for t in seq)

    cache = make_cache(page_size=2, host_tier=True, enable_events=True)
    pool = HostPool()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17])
    cache.evict(8, backup=pool.backup)  # both nodes host only
    cache.take_events()
    # Adopts [1,2,3,4] and the upper half [5,6] of [5,6,7,8] (split), then a leaf [9,10].
    result = cache.insert(as_form([1, 2, 3, 4, 5, 6, 9, 10]),
                          as_form([20, 21, 22, 23, 24, 25, 26, 27]))
    assert result.prefix_len == 0
    events = cache.take_events()
    assert [(type(e).__name__, e.medium, list(e.token_ids)) for e in events] == [
        ("BlockStored", "GPU", [1, 2, 3, 4]), ("BlockStored", "GPU", [5, 6]),
        ("BlockStored", "GPU", [9, 10])]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 10]).indices.tolist() == list(range(20, 28))
    # Adoption without a new leaf: only the adopted node's event.
    cache.evict(8, backup=pool.backup)
    cache.take_events()
    cache.insert(as_form([1, 2, 3, 4]), as_form([30, 31, 32, 33]))
    events = cache.take_events()
    assert [(type(e).__name__, e.medium, list(e.token_ids)) for e in events] == [
        ("BlockStored", "GPU", [1, 2, 3, 4])]


def test_block_hashes_are_the_same_on_both_tiers(make_cache):
    cache = make_cache(page_size=2, host_tier=True, enable_events=True,
                       write_policy="write_through")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.write_through(HostPool().backup)
    gpu, cpu = cache.take_events()
    assert isinstance(gpu, BlockStored) and isinstance(cpu, BlockStored)
    assert (gpu.medium, cpu.medium) == ("GPU", "CPU")
    assert gpu.block_hashes == cpu.block_hashes
    assert gpu.parent_block_hash == cpu.parent_block_hash
    cache.evict(4)
    cache.evict_host(4)
    removed_gpu, removed_cpu = cache.take_events()
    assert isinstance(removed_gpu, BlockRemoved)
    assert removed_gpu.block_hashes == removed_cpu.block_hashes == gpu.block_hashes


def indexer_resolves_parents_across_tiers() -> bool:
    """Whether ``KvIndexer`` takes a block whose parent it holds on another tier of the
    worker (a host copy below a page held only on the device): only then can its host tier
    be the cache's exactly."""
    indexer = KvIndexer(1)
    indexer.apply(0, [BlockStored((1,), None, (5,), 1, medium="GPU"),
                      BlockStored((2,), 1, (6,), 1, medium="CPU")])
    return indexer.blocks_held(0, medium="CPU") == 1


def test_events_replayed_give_each_tier(make_cache):
    cache = make_cache(page_size=2, host_tier=True, enable_events=True,
                       write_policy="write_through")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 5, 6], [10, 11, 20, 21])
    pool = HostPool()
    cache.write_through(pool.backup)  # [3,4] (parent still device only), [1,2], [5,6]
    cache.evict(2)  # [3,4] host only
    indexer = KvIndexer(2)
    indexer.apply(0, cache.take_events())
    assert indexer.blocks_held(0, medium="GPU") == 2
    assert indexer.overlap([1, 2, 3, 4]) == {0: 1}
    assert indexer.overlap([1, 2, 5, 6]) == {0: 2}
    if indexer_resolves_parents_across_tiers():
        assert indexer.blocks_held(0, medium="CPU") == 3
        assert indexer.overlap([1, 2, 3, 4], medium="CPU") == {0: 2}
    else:  # the host copy of [3,4] came before its parent's: unknown there
        assert indexer.blocks_held(0, medium="CPU") == 2
        assert indexer.overlap([1, 2, 5, 6], medium="CPU") == {0: 2}


# -- values on a device (the meta device stands in for a GPU here; test_cuda.py has CUDA) ------
def meta_tensor(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int64, device="meta")


def test_device_values_through_both_tiers(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], meta_tensor(4))
    pool = HostPool()
    seen = []

    def backup(device_indices):
        seen.append(device_indices.device.type)
        return torch.arange(100, 100 + device_indices.shape[0])

    freed = []
    assert cache.evict(4, freed.append, backup=backup) == 4
    assert seen == ["meta"] and [t.device.type for t in freed] == ["meta"]
    # Adoption by an insert with device values: the adopted node gets its slice there.
    result = cache.insert([1, 2, 3, 4, 5, 6], meta_tensor(6))
    assert result.prefix_len == 0
    for node, depth in core_of(cache).tree.iter_nodes():
        if depth:
            assert node.value.device.type == "meta"
            assert node.value.shape[0] == node.num_tokens
    assert node_at(cache, [1, 2, 3, 4]).tier == "device+host"
    check_invariants(cache)
    cache.evict(6, backup=pool.backup)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.length, m.host_length) == (0, 6)
    assert cache.load_back(m, meta_tensor(6)).tolist() == [100, 101, 102, 103, 100, 101]
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert whole.length == 6 and whole.indices.device.type == "meta"
    check_invariants(cache)


def test_free_callbacks_may_call_the_cache(make_cache):
    cache = two_branches(make_cache)
    pool = HostPool()
    seen = []

    def free_device(indices):  # the guard is released around it, as without a host tier
        seen.append(cache.match_prefix([1, 2, 3, 4]).host_length)
        cache.evict_host(100, pool.free)

    assert cache.evict(100, free_device, backup=pool.backup) == 6
    check_invariants(cache)
    assert cache.node_count() == 0 and cache.host_size() == 0 == pool.used
    assert seen[0] == 2  # [3,4] was on the host when its device slots were freed

    cache = two_branches(make_cache)
    cache.evict(100, backup=pool.backup)

    def free_host(indices):
        cache.insert([1, 2, 9, 9], [1, 2, 3, 4])  # adopts [1,2] while evict_host runs

    assert cache.evict_host(100, free_host) == 4  # [3,4] and [5,6]; [1,2] is on the device
    assert tiers(cache) == {(1, 2): ("device+host", [1, 2], [110, 111]),
                            (1, 2, 9, 9): ("device", [3, 4], None)}
    check_invariants(cache)


class ShortTensor(torch.Tensor):
    """Passes every check of a host-index tensor, then converts to one index too few."""

    def numpy(self, *args, **kwargs):
        return np.arange(1, dtype=np.int64)


class FloatArrayTensor(torch.Tensor):
    def numpy(self, *args, **kwargs):
        return np.zeros(2)


@pytest.mark.parametrize("cls, error, message", [
    (ShortTensor, ValueError, "1 host indices for 2"),
    (FloatArrayTensor, TypeError, "converting to ndarray"),
])
def test_backup_tensor_that_converts_to_something_else(make_cache, cls, error, message):
    cache = two_branches(make_cache)
    before = snapshot(cache)
    odd = torch.tensor([100, 101]).as_subclass(cls)
    with pytest.raises(error, match=message):
        cache.evict(2, backup=lambda d: odd)
    assert snapshot(cache) == before
    check_invariants(cache)


# -- atomic adoption and insertion ---------------------------------------------------------
class FailingTorch:
    """A torch function mode that raises at its ``fail_at``-th torch call (never with None),
    as a CUDA out-of-memory error in ``.to()`` would; ``calls`` counts what it saw."""

    def __init__(self, fail_at=None):
        from torch.overrides import TorchFunctionMode

        outer = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                outer.calls += 1
                if outer.calls == outer.fail_at:
                    raise torch.OutOfMemoryError("injected: CUDA out of memory")
                return func(*args, **(kwargs or {}))

        self.fail_at = fail_at
        self.calls = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def tier_state(cache) -> tuple:
    """Per cached token (named by its path from the root): its tier, its device values'
    device and its host slot; then the sizes. A split (which a failed insert may leave,
    as any insert's walk) does not show."""
    tokens = {}
    for node, depth in core_of(cache).tree.iter_nodes():
        if depth:
            value = node.value
            host = node.host_value if cache.host_tier else None
            path = node_tokens(node)
            first = len(path) - node.num_tokens
            for i in range(node.num_tokens):
                tokens[tuple(path[:first + i + 1])] = (
                    node.tier if cache.host_tier else None,
                    None if value is None else value.device.type,
                    None if host is None else int(host[i]))
    return (tokens, cache.evictable_size(), cache.protected_size(),
            cache.host_size() if cache.host_tier else 0)


def _host_only_path(make_cache):
    """page 2, all host only: [1,2,3,4] -> {[5,6,7,8], [9,9]} (device values on meta)."""
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], meta_tensor(8))
    cache.insert([1, 2, 3, 4, 9, 9], meta_tensor(6))
    assert cache.evict(100, backup=HostPool().backup) == 10
    return cache


def _one_tier(make_cache):
    cache = make_cache(page_size=2)
    cache.insert([1, 2, 3, 4], meta_tensor(4))
    return cache


@pytest.mark.parametrize("build, tokens", [
    (_host_only_path, [1, 2, 3, 4, 5, 6, 7, 8, 10, 10]),  # adopts two nodes, adds a leaf
    (_host_only_path, [1, 2, 3, 4, 5, 6]),  # adopts the upper half of a split host node
    (_one_tier, [1, 2, 3, 4, 5, 6]),  # the one-tier new leaf
])
def test_insert_with_device_values_is_atomic(make_cache, build, tokens):
    with FailingTorch() as counter:
        build(make_cache).insert(tokens, meta_tensor(len(tokens)))
    assert counter.calls > 2
    for fail_at in range(1, counter.calls + 1):
        cache = build(make_cache)
        before = tier_state(cache)
        try:
            with FailingTorch(fail_at):
                cache.insert(tokens, meta_tensor(len(tokens)))
        except torch.OutOfMemoryError:
            # The tiers are as they were: no node holds its token ids as KV slots.
            assert tier_state(cache) == before, fail_at
        else:  # a call the insert does not depend on: every node got the caller's slots
            assert cache.match_prefix(tokens).length == len(tokens), fail_at
        check_invariants(cache)
        freed = []
        cache.evict(100, freed.append, backup=HostPool().backup if cache.host_tier else None)
        assert [t.device.type for t in freed] == ["meta"] * len(freed), fail_at
        assert cache.evictable_size() == 0
        check_invariants(cache)


# -- a backup answer is never lost -----------------------------------------------------------
class Boom(Exception):
    pass


class HookedAnswer(torch.Tensor):
    """A valid host-index tensor whose torch call named ``fail`` raises (a torch hook)."""

    fail = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: its name is the descriptor's
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name == cls.fail:
            raise Boom(f"injected in {name}")
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("fail", ["dtype", "dim", "shape", "detach", "cpu", "numpy"])
@pytest.mark.parametrize("call", ["evict", "write_through"])
def test_a_backup_answer_that_cannot_be_read_comes_back(make_cache, fail, call):
    policy = "write_back" if call == "evict" else "write_through"
    cache = two_branches(make_cache, write_policy=policy)
    before = snapshot(cache)
    answers = []

    def backup(device_indices):
        n = device_indices.shape[0]
        answer = torch.arange(100, 100 + n).as_subclass(HookedAnswer)
        answers.append(answer)
        return answer

    HookedAnswer.fail = fail
    try:
        with pytest.raises(Boom) as info:
            if call == "evict":
                cache.evict(2, backup=backup)
            else:
                cache.write_through(backup)
    finally:
        HookedAnswer.fail = None
    # The host slots were not kept: the error hands them back, as backup returned them.
    assert len(answers) == 1 and info.value.host_indices is answers[0]
    assert snapshot(cache) == before
    check_invariants(cache)


@pytest.mark.parametrize("call", ["evict", "write_through"])
def test_backup_errors_say_whether_an_answer_came_back(make_cache, call):
    policy = "write_back" if call == "evict" else "write_through"
    cache = two_branches(make_cache, write_policy=policy)
    before = snapshot(cache)

    def run(backup):
        if call == "evict":
            cache.evict(2, backup=backup)
        else:
            cache.write_through(backup)

    def raising(device_indices):
        raise Boom("backup's own")

    with pytest.raises(Boom) as info:  # backup's own error: nothing to hand back
        run(raising)
    assert not hasattr(info.value, "host_indices")
    short = torch.arange(100, 101)
    with pytest.raises(ValueError, match="1 host indices for 2") as info:  # a bad answer
        run(lambda device_indices: short)
    assert info.value.host_indices is short
    assert snapshot(cache) == before
    check_invariants(cache)


# -- write-through never blocks on one node --------------------------------------------------
def test_write_through_skips_a_node_that_does_not_fit(make_cache):
    # page 2; the queue holds [1..8] (8 tokens), then [9,9] and [7,7] (2 each), and a host
    # with room for 4: the big node waits, the small ones behind it are copied.
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    cache.insert(list(range(1, 9)), list(range(10, 18)))
    cache.insert([9, 9], [20, 21])
    cache.insert([7, 7, 5, 5], [30, 31, 32, 33])  # due: [7,7,5,5] (4 tokens)
    cache.insert([3, 3], [40, 41])
    pool = HostPool(capacity=4)
    sizes = []

    def backup(device_indices):
        sizes.append(device_indices.shape[0])
        return pool.backup(device_indices)

    assert cache.write_through(backup) == 4  # [9,9] and [3,3]
    # The 8-token node was refused, the 4-token one asked (smaller), the 2-token ones
    # copied; nothing at least as large as a refused node was asked about twice.
    assert sizes == [8, 2, 4, 2]
    assert node_at(cache, [9, 9]).tier == "device+host"
    assert node_at(cache, [3, 3]).tier == "device+host"
    assert node_at(cache, list(range(1, 9))).tier == "device"
    assert node_at(cache, [7, 7, 5, 5]).tier == "device"
    check_invariants(cache)
    # The refused nodes stay due, in their order: copied once the host has room.
    sizes.clear()
    pool.capacity = 100
    assert cache.write_through(backup) == 12
    assert sizes == [8, 4]
    assert cache.host_size() == 16
    assert cache.write_through(backup) == 0 and sizes == [8, 4]
    check_invariants(cache)


def test_write_through_stops_after_a_refused_page(make_cache):
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    for first in (1, 3, 5):
        cache.insert([first, first], [first, first])
    sizes = []

    def full(device_indices):
        sizes.append(device_indices.shape[0])
        return None

    assert cache.write_through(full) == 0
    assert sizes == [2]  # no queued node is smaller than one page: the call ends
    assert cache.write_through(HostPool().backup) == 6  # all three were still due, in order
    assert [tuple(node.host_value.tolist()) for node in
            (node_at(cache, [1, 1]), node_at(cache, [3, 3]), node_at(cache, [5, 5]))] == [
        (100, 101), (102, 103), (104, 105)]
    check_invariants(cache)


# -- a skipped victim pushed back by a callback ----------------------------------------------
def test_a_skipped_victim_is_asked_about_once_per_call(make_cache):
    # [1,2] has host-only children and gets no host copy: skipped. The per-node free_callback
    # of the next victim, [7,8], locks and unlocks [1,2], which pushes it on the heap again:
    # the call does not ask about it again; the next call does.
    cache = two_branches(make_cache)
    pool = HostPool()
    assert cache.evict(4, backup=pool.backup) == 4  # [3,4], [5,6] -> host
    cache.insert([7, 8], [30, 31])
    upper = node_at(cache, [1, 2])
    asked = []

    def refuse(device_indices):
        asked.append(device_indices.tolist())
        return None

    def free(indices):
        cache.inc_lock_ref(upper)
        cache.dec_lock_ref(upper)  # [1,2] is a device leaf again: pushed

    assert cache.evict(4, free, backup=refuse) == 2  # [7,8] deleted, [1,2] skipped
    assert asked == [[10, 11], [30, 31]]
    assert upper.tier == "device"
    check_invariants(cache)
    asked.clear()
    assert cache.evict(4, backup=pool.backup) == 2  # the next call: backed up and demoted
    assert upper.tier == "host"
    check_invariants(cache)


# -- free_host: every victim leaves the device ----------------------------------------------
@pytest.mark.parametrize("batch", [False, True])
def test_free_host_lets_a_victim_with_host_children_leave(make_cache, batch):
    # [1,2] -> {[3,4], [5,6]}, the children host only, [1,2] gets no host copy: without
    # free_host it stays; with it, the children leave the host and [1,2] is deleted.
    cache = two_branches(make_cache, enable_events=True)
    cache.take_events()
    pool = HostPool()
    assert cache.evict(4, backup=pool.backup) == 4
    assert cache.evict(2, backup=lambda d: None) == 0  # skipped: host-only children
    cache.take_events()
    freed_device, freed_host = [], []
    assert cache.evict(2, freed_device.append, batch=batch, backup=lambda d: None,
                       free_host=freed_host.append) == 2
    assert [t.tolist() for t in freed_device] == [[10, 11]]
    assert sorted(t.tolist() for t in freed_host) == [[100, 101], [102, 103]]
    assert cache.node_count() == 0 and cache.host_size() == 0
    stats = cache.stats()
    assert stats.host_evicted_tokens == 4
    events = cache.take_events()
    # The children's host blocks, then the victim's device block.
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockRemoved", "CPU"), ("BlockRemoved", "CPU"), ("BlockRemoved", "GPU")]
    check_invariants(cache)


def test_free_host_also_under_write_through(make_cache):
    # With a write-through policy evict never backs up: a victim without a host copy and
    # with host-only children leaves with them.
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    pool = HostPool()
    cache.write_through(pool.backup)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])  # [5,6]: due, not copied
    assert cache.evict(2) == 2  # [5,6] deleted (no host copy)
    assert cache.evict(4) == 4  # [1,2,3,4] demoted (it has its copy)
    cache.insert([1, 2, 3, 4], [20, 21, 22, 23])  # adopted: device+host
    cache.insert([1, 2, 7, 7], [20, 21, 30, 31])  # splits [1,2,3,4]
    assert cache.evict(2) == 2  # [7,7]: no copy, deleted
    assert cache.evict(2) == 2  # [3,4] demoted
    freed = []
    # [1,2] has a host copy (from its split): demoted, nothing for free_host.
    assert cache.evict(2, free_host=freed.append) == 2 and freed == []
    check_invariants(cache)


def test_free_host_bad_input(make_cache):
    cache = two_branches(make_cache)
    with pytest.raises(TypeError, match="free_host must be callable"):
        cache.evict(2, free_host=3)
    one_tier = make_cache(page_size=2)
    with pytest.raises(ValueError, match=r"evict\(free_host=...\) needs a cache with a host"):
        one_tier.evict(2, free_host=print)


def test_free_host_with_numpy_arrays(make_cache):
    cache = make_cache(page_size=2, host_tier=True, array_type="numpy")
    cache.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    cache.insert([1, 2, 5, 6], np.array([10, 11, 20, 21]))
    host = iter(range(100, 200))

    def backup(device_indices):
        return np.array([next(host) for _ in device_indices], dtype=np.int64)

    assert cache.evict(4, backup=backup) == 4
    freed_host = []
    # No room: both host leaves leave, one at a time, backup asked after each; it never
    # answers, so [1,2] is deleted.
    asked = []
    assert cache.evict(2, backup=lambda d: asked.append(d.tolist()),
                       free_host=freed_host.append) == 2
    assert asked == [[10, 11]] * 3
    assert all(type(a) is np.ndarray and a.dtype == np.int64 for a in freed_host)
    assert sorted(a.tolist() for a in freed_host) == [[100, 101], [102, 103]]
    assert cache.node_count() == 0 and cache.host_size() == 0
    check_invariants(cache)


# -- the engine's own steps: next_victim, back_up, drop_host_copy, keep ---------------------
def test_back_up_and_drop_host_copy(make_cache):
    """An engine that decides which node gets a host copy and when (SGLang's HiCache under
    the radixcache backend): back_up gives one, evict then demotes without asking,
    drop_host_copy takes it back from a node still on the device."""
    cache = two_branches(make_cache, enable_events=True)
    cache.take_events()
    node = node_at(cache, [1, 2, 3, 4])
    cache.back_up(node, torch.tensor([100, 101]))
    assert node.tier == "device+host" and node.host_value.tolist() == [100, 101]
    assert cache.host_size() == 2 and cache.stats().backed_up_tokens == 2
    stored = cache.take_events()
    assert [(type(e), e.medium) for e in stored] == [(BlockStored, "CPU")]
    assert cache.drop_host_copy(node).tolist() == [100, 101]
    assert node.tier == "device" and cache.host_size() == 0
    removed = cache.take_events()
    assert [(type(e), e.medium) for e in removed] == [(BlockRemoved, "CPU")]
    assert removed[0].block_hashes == stored[0].block_hashes
    cache.back_up(node, torch.tensor([7, 8]))
    freed = []
    # [1,2,3,4] is the least recently used leaf; with a host copy it is demoted unasked.
    assert cache.evict(2, freed.append, backup=lambda _: pytest.fail("asked")) == 2
    assert [t.tolist() for t in freed] == [[12, 13]] and node.tier == "host"
    assert cache.match_prefix([1, 2, 3, 4]).host_length == 2
    check_invariants(cache)


def test_back_up_and_drop_host_copy_bad_input_change_nothing(make_cache):
    cache = two_branches(make_cache)
    other = two_branches(make_cache)
    node = node_at(cache, [1, 2, 3, 4])
    cache.back_up(node, torch.tensor([100, 101]))
    cache.evict(2)  # host only now
    host_only = node
    device = node_at(cache, [1, 2, 5, 6])
    before = snapshot(cache)
    cases = [
        (lambda: cache.back_up(host_only, torch.tensor([1, 2])), ValueError, "only on the host"),
        (lambda: cache.back_up(device, torch.tensor([1])), ValueError, "host indices"),
        (lambda: cache.back_up(device, [1, 2]), TypeError, "torch.Tensor"),
        (lambda: cache.back_up(cache.root_node, torch.tensor([], dtype=torch.int64)),
         ValueError, "root"),
        (lambda: cache.back_up(node_at(other, [1, 2]), torch.tensor([1, 2])), ValueError,
         "another cache"),
        (lambda: cache.back_up("node", torch.tensor([1, 2])), TypeError, "RadixTreeNode"),
        (lambda: cache.drop_host_copy(device), ValueError, "no host copy"),
        (lambda: cache.drop_host_copy(host_only), ValueError, "only on the host"),
        (lambda: cache.drop_host_copy(cache.root_node), ValueError, "root"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        assert snapshot(cache) == before
    cache.back_up(device, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="already has a host copy"):
        cache.back_up(device, torch.tensor([7, 8]))
    plain = make_cache(page_size=2)
    plain.insert([1, 2], [3, 4])
    leaf = plain.match_prefix([1, 2]).last_node
    for call in (lambda: plain.back_up(leaf, torch.tensor([1, 2])),
                 lambda: plain.drop_host_copy(leaf), lambda: plain.next_victim(),
                 lambda: plain.evict(2, keep={leaf})):
        with pytest.raises(ValueError, match="host tier"):
            call()
    check_invariants(cache)


def test_next_victim_and_keep(make_cache):
    cache = two_branches(make_cache)
    first = cache.next_victim()
    assert node_tokens(first) == [1, 2, 3, 4] and cache.next_victim() is first
    second = cache.next_victim(keep={first})
    assert node_tokens(second) == [1, 2, 5, 6]
    freed = []
    # A kept victim is passed over and stays where it is.
    assert cache.evict(2, freed.append, keep={first}) == 2
    assert [t.tolist() for t in freed] == [[20, 21]] and first.tier == "device"
    assert cache.next_victim() is first  # back on the heap
    pool = HostPool()
    cache.evict(100, backup=pool.backup)  # all host only now
    leaf = cache.next_victim(host=True)  # [5,6] left the tree: [1,2] -> [3,4] remain
    assert node_tokens(leaf) == [1, 2, 3, 4]
    assert cache.next_victim(host=True, keep={leaf}) is None  # [1,2] is above it
    got = []
    assert cache.evict_host(100, got.append, keep={leaf}) == 0
    assert leaf.tier == "host" and cache.host_size() == 4 and got == []
    assert cache.next_victim(host=True) is leaf
    assert cache.evict_host(100, got.append) == 4
    assert [t.tolist() for t in got] == [[100, 101], [102, 103]]  # [3,4] got 100, [1,2] 102
    check_invariants(cache)


def test_keep_holds_a_host_leaf_and_its_subtree(make_cache):
    """With ``free_host``, a victim whose host-only subtree holds a kept node stays, and a
    kept host leaf is not removed to make room."""
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.match_prefix([1, 2])  # split: [1,2] -> [3,4]
    pool = HostPool(capacity=2)
    cache.evict(2, backup=pool.backup)  # [3,4] host only, the host full
    child = node_at(cache, [1, 2, 3, 4])
    parent = node_at(cache, [1, 2])
    assert cache.evict(2, backup=pool.backup, free_host=pool.free, keep={child}) == 0
    assert parent.tier == "device" and child.tier == "host"
    freed = []
    assert cache.evict(2, freed.append, backup=pool.backup, free_host=pool.free) == 2
    assert parent.tier == "host" and child.evicted
    check_invariants(cache)


class _Keep:
    """A ``keep`` whose ``in`` raises, or calls the cache (refused: re-entered)."""

    def __init__(self, cache=None) -> None:
        self.cache = cache

    def __contains__(self, node) -> bool:
        if self.cache is not None:
            self.cache.match_prefix([1, 2])
        raise KeyError("keep")


@pytest.mark.parametrize("reenter", [False, True])
def test_a_keep_that_raises_leaves_every_victim_in_place(make_cache, reenter):
    cache = two_branches(make_cache)
    pool = HostPool()
    before = snapshot(cache)
    error = RuntimeError if reenter else KeyError
    keep = _Keep(cache if reenter else None)
    for call in (lambda: cache.evict(100, backup=pool.backup, keep=keep),
                 lambda: cache.next_victim(keep=keep)):
        with pytest.raises(error):
            call()
        assert snapshot(cache) == before
    assert cache.evict(100, backup=pool.backup) == 6  # every victim still found
    before = snapshot(cache)
    for call in (lambda: cache.evict_host(100, keep=keep),
                 lambda: cache.next_victim(host=True, keep=keep)):
        with pytest.raises(error):
            call()
        assert snapshot(cache) == before
    assert cache.evict_host(100) == 6
    check_invariants(cache)

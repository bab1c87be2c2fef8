"""``insert_host``: pages that arrive in host slots (read back from storage) go into the tree
host-only, as SGLang's ``insert_host`` puts a finished prefetch in; known answers worked out
by hand, SGLang's write-through rule (``refill``), events, bad input that must leave the
cache as it was, and a random mix of every tier call checked against the invariants; on
every core."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import check_invariants, core_of, node_tokens
from radixcache.events import BlockStored
from test_host_tier import HostPool, node_at, snapshot, tiers


def device_cache(make_cache, **kwargs):
    """page 2: [1,2,3,4] on the device (slots 10..13), no host copy."""
    cache = make_cache(page_size=2, host_tier=True, **kwargs)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    return cache


def test_new_pages_become_one_host_only_node(make_cache):
    cache = device_cache(make_cache, write_policy="write_back")
    prefix, last, unused, dropped = cache.insert_host(
        cache.root_node, [1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 108)))
    assert (prefix, dropped, unused.tolist()) == (4, False, [100, 101, 102, 103])
    assert node_tokens(last) == [1, 2, 3, 4, 5, 6, 7, 8] and last.tier == "host"
    assert tiers(cache) == {(1, 2, 3, 4): ("device", [10, 11, 12, 13], None),
                            (1, 2, 3, 4, 5, 6, 7, 8): ("host", None, [104, 105, 106, 107])}
    assert cache.host_size() == 4
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.length, m.host_length, m.last_host_node) == (4, 4, last)
    # It is a host leaf: evict_host frees it.
    freed = []
    assert cache.evict_host(4, freed.append) == 4
    assert [t.tolist() for t in freed] == [[104, 105, 106, 107]]
    check_invariants(cache)


def test_the_walk_splits_where_the_pages_differ_or_end(make_cache):
    cache = make_cache(page_size=2, host_tier=True)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    prefix, last, unused, _ = cache.insert_host(cache.root_node, [1, 2, 3, 4, 9, 9],
                                                [100, 101, 102, 103, 104, 105])
    assert prefix == 4 and unused.tolist() == [100, 101, 102, 103]
    assert tiers(cache) == {(1, 2, 3, 4): ("device", [10, 11, 12, 13], None),
                            (1, 2, 3, 4, 5, 6): ("device", [14, 15], None),
                            (1, 2, 3, 4, 9, 9): ("host", None, [104, 105])}
    # Pages that end inside a node split it; nothing new.
    prefix, last, unused, dropped = cache.insert_host(cache.root_node, [1, 2], [7, 8])
    assert (prefix, dropped, unused.tolist(), node_tokens(last)) == (2, False, [7, 8], [1, 2])
    assert cache.host_size() == 2 and core_of(cache).tree.num_splits == 2
    check_invariants(cache)


def test_below_an_anchor_and_in_a_namespace(make_cache):
    cache = device_cache(make_cache)
    anchor = node_at(cache, [1, 2, 3, 4])
    _, last, unused, _ = cache.insert_host(anchor, [5, 6], [100, 101])
    assert last.parent is anchor and unused.tolist() == []
    # Below a host-only node too (the prefetch anchor is SGLang's last host node).
    _, deeper, _, _ = cache.insert_host(last, np.array([7, 8]), torch.tensor([102, 103]))
    assert node_tokens(deeper) == [1, 2, 3, 4, 5, 6, 7, 8] and deeper.parent is last
    _, ns_node, _, _ = cache.insert_host(cache.root_node, [1, 2], [104, 105], extra_key="a")
    assert ns_node.extra_key == "a" and ns_node.parent is cache.root_node
    assert cache.match_prefix([1, 2], extra_key="a").host_length == 2
    assert cache.match_prefix([1, 2]).host_length == 0
    # Below the root the anchor's namespace holds, whatever extra_key says.
    _, below, _, _ = cache.insert_host(ns_node, [3, 4], [106, 107], extra_key="b")
    assert below.extra_key == "a"
    assert cache.match_prefix([1, 2, 3, 4], extra_key="a").host_length == 4
    check_invariants(cache)


def test_refill_gives_nodes_without_a_host_copy_theirs(make_cache):
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_through")
    cache.insert([1, 2], [10, 11])
    pool = HostPool()
    cache.write_through(pool.backup)  # [1,2] backed up at 100, 101
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])  # [3,4] due, not copied yet
    prefix, last, unused, dropped = cache.insert_host(
        cache.root_node, [1, 2, 3, 4, 5, 6], [200, 201, 202, 203, 204, 205], refill=True)
    # SGLang's write-through rule: prefix_len counts only the pages already held.
    assert (prefix, dropped, unused.tolist()) == (2, False, [200, 201])
    assert tiers(cache) == {(1, 2): ("device+host", [10, 11], [100, 101]),
                            (1, 2, 3, 4): ("device+host", [12, 13], [202, 203]),
                            (1, 2, 3, 4, 5, 6): ("host", None, [204, 205])}
    assert cache.host_size() == 6
    # The refilled node is no longer due: write_through copies nothing.
    assert cache.write_through(pool.backup) == 0 and len(pool.copied) == 1
    check_invariants(cache)


def test_refill_drops_pages_below_a_node_without_a_host_copy(make_cache):
    cache = device_cache(make_cache, write_policy="write_through")
    anchor = node_at(cache, [1, 2, 3, 4])
    before = tiers(cache)
    prefix, last, unused, dropped = cache.insert_host(anchor, [5, 6], [100, 101], refill=True)
    assert (prefix, last, unused.tolist(), dropped) == (0, anchor, [100, 101], True)
    assert tiers(cache) == before and cache.host_size() == 0
    # Without refill (write_back) they hang below it.
    _, last, unused, dropped = cache.insert_host(anchor, [5, 6], [100, 101])
    assert not dropped and last.parent is anchor and last.tier == "host"
    check_invariants(cache)


def test_inserted_pages_load_back_and_are_adopted(make_cache):
    cache = device_cache(make_cache)
    _, last, _, _ = cache.insert_host(cache.root_node, [1, 2, 3, 4, 5, 6, 7, 8],
                                      list(range(100, 108)))
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])  # splits the host-only node
    assert m.host_length == 2
    assert cache.load_back(m, torch.tensor([20, 21])).tolist() == [104, 105]
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(10, 18)))  # adopts [7,8]
    assert last.tier == "device+host" and last.value.tolist() == [16, 17]
    check_invariants(cache)


def test_events_are_stored_on_the_host_with_the_device_hashes(make_cache):
    cache = device_cache(make_cache, enable_events=True, write_policy="write_through")
    cache.take_events()
    cache.insert_host(cache.root_node, [1, 2, 3, 4, 5, 6], list(range(100, 106)), refill=True)
    events = cache.take_events()
    assert [(type(e), e.medium, len(e.block_hashes)) for e in events] == [
        (BlockStored, "CPU", 2), (BlockStored, "CPU", 1)]
    twin = make_cache(page_size=2, host_tier=True, enable_events=True)
    twin.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    (device,) = twin.take_events()
    assert events[0].block_hashes + events[1].block_hashes == device.block_hashes


def test_numpy_arrays(make_cache):
    cache = make_cache(page_size=1, host_tier=True, array_type="numpy")
    cache.insert(np.array([1, 2]), np.array([10, 11]))
    prefix, last, unused, _ = cache.insert_host(cache.root_node, np.array([1, 2, 3]),
                                                np.array([100, 101, 102]))
    assert type(unused) is np.ndarray and unused.tolist() == [100, 101]
    assert type(last.host_value) is np.ndarray and last.host_value.tolist() == [102]
    check_invariants(cache)


def test_bad_input_changes_nothing(make_cache):
    cache = device_cache(make_cache, enable_events=True)
    other = device_cache(make_cache)
    gone = node_at(cache, [1, 2, 3, 4])
    cache.insert([5, 6], [20, 21])
    cache.take_events()
    root = cache.root_node
    before = snapshot(cache)
    cases = [
        (lambda: cache.insert_host(root, [5, 6, 7], [1, 2, 3]), ValueError, "whole number"),
        (lambda: cache.insert_host(root, [5, 6], [1]), ValueError, "one per token"),
        (lambda: cache.insert_host(root, [5, 6], [1, 2, 3]), ValueError, "one per token"),
        (lambda: cache.insert_host(root, "ab", [1, 2]), TypeError, "token_ids must be"),
        (lambda: cache.insert_host(root, [5, 6], [1.0, 2.0]), TypeError,
         "host_indices must hold integers"),
        (lambda: cache.insert_host(root, [5, 6], torch.tensor([[1, 2]])), ValueError,
         "host_indices must be 1-D"),
        (lambda: cache.insert_host(root, [5, 6], [1, 2], extra_key=[1]), TypeError,
         "extra_key"),
        (lambda: cache.insert_host(node_at(other, [1, 2, 3, 4]), [5, 6], [1, 2]),
         ValueError, "another cache"),
        (lambda: cache.insert_host("node", [5, 6], [1, 2]), TypeError, "RadixTreeNode"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        assert snapshot(cache) == before and cache.take_events() == []
    cache.evict(4)
    assert gone.evicted
    with pytest.raises(ValueError, match="evicted"):
        cache.insert_host(gone, [5, 6], [1, 2])
    plain = make_cache(page_size=2)
    with pytest.raises(ValueError, match="host tier"):
        plain.insert_host(plain.root_node, [1, 2], [1, 2])
    check_invariants(cache)


def test_the_core_declines_what_it_cannot_read(make_cache):
    """The core reads the common inputs only (cache.py converts the rest): anything else is
    a TypeError from both cores alike, and nothing changes."""
    cache = device_cache(make_cache)
    core = core_of(cache)
    before = snapshot(cache)
    for tokens, host, message in (("ab", [1, 2], "tokens must be"),
                                  ([5, 6], [1.0, 2.0], "host indices must be"),
                                  ([5, 6], np.array([1, 2], dtype=np.int32),
                                   "host indices must be")):
        with pytest.raises(TypeError, match=message):
            core.insert_host(cache.root_node, tokens, host)
        assert snapshot(cache) == before


def test_host_indices_in_any_layout(make_cache):
    """A strided or int32 tensor of host slots (an engine's pool hands out such views)."""
    cache = device_cache(make_cache)
    _, last, _, _ = cache.insert_host(cache.root_node, [1, 2, 3, 4, 5, 6],
                                      torch.arange(100, 112)[::2])
    assert last.host_value.tolist() == [108, 110]
    _, last, _, _ = cache.insert_host(cache.root_node, [7, 8],
                                      torch.tensor([1, 2], dtype=torch.int32))
    assert last.host_value.tolist() == [1, 2]
    check_invariants(cache)


def test_an_on_store_error_leaves_a_consistent_tree(make_cache):
    """A store hook that raises (events it cannot write) comes after every write."""
    cache = device_cache(make_cache)
    core = core_of(cache)

    def fail(node):
        raise KeyError("hook")

    with pytest.raises(KeyError, match="hook"):
        core.insert_host(cache.root_node, [1, 2, 3, 4, 5, 6], [100, 101, 102, 103, 104, 105],
                         None, False, fail)
    assert tiers(cache)[(1, 2, 3, 4, 5, 6)] == ("host", None, [104, 105])
    check_invariants(cache)
    cache.insert([9, 9], [30, 31])  # the guard was released


@pytest.mark.parametrize("policy", ["lru", "mru"])  # mru: a key that falls on access
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_random_mix_keeps_the_invariants_and_no_slot_is_lost(make_cache, page_size,
                                                             write_policy, policy):
    """Every tier call in random order: each host slot handed in is held by exactly one
    node, handed back as unused or freed by evict_host -- never two of these."""
    rng = random.Random(7 + page_size)
    cache = make_cache(page_size=page_size, host_tier=True, write_policy=write_policy,
                       eviction_policy=policy)
    pool = HostPool(capacity=40, start=1000)
    next_host = [5000]
    given: set = set()
    returned: list = []

    def seq():
        return [rng.randrange(3) for _ in range(page_size * rng.randrange(1, 6))]

    def held_host():
        slots = []
        for node, depth in core_of(cache).tree.iter_nodes():
            if depth and node.host_value is not None:
                slots.extend(node.host_value.tolist())
        return slots

    for _ in range(300):
        op = rng.randrange(6)
        if op == 0:
            tokens = seq()
            cache.insert(tokens, list(range(len(tokens))))
        elif op == 1:
            cache.evict(rng.randrange(1, 6), backup=pool.backup)
        elif op == 2:
            cache.evict_host(rng.randrange(1, 6), lambda h: returned.extend(h.tolist()))
        elif op == 3:
            nodes = [n for n, _ in core_of(cache).tree.iter_nodes()]
            anchor = rng.choice(nodes)
            tokens = seq()
            host = list(range(next_host[0], next_host[0] + len(tokens)))
            next_host[0] += len(tokens)
            given.update(host)
            prefix, last, unused, dropped = cache.insert_host(
                anchor, tokens, host, refill=write_policy != "write_back")
            returned.extend(unused.tolist())
            assert len(unused) == (len(tokens) if dropped else prefix)
        elif op == 4:
            m = cache.match_prefix(seq())
            if m.host_length:
                cache.load_back(m, torch.arange(m.host_length) + 50)
        else:
            cache.write_through(pool.backup)
        check_invariants(cache)
        held = [s for s in held_host() if s >= 5000]
        back = [s for s in returned if s >= 5000]
        assert len(held) + len(back) == len(set(held) | set(back)), "a slot twice"
        assert set(held) | set(back) == given, "a slot lost"


class _ReentrantKey:
    """An extra_key whose hash calls the cache: a call from inside the call."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def __hash__(self) -> int:
        self.cache.match_prefix([1, 2])
        return 1

    def __eq__(self, other) -> bool:
        return self is other


def test_code_that_calls_back_into_the_cache_is_refused(make_cache):
    cache = device_cache(make_cache)
    core = core_of(cache)
    with pytest.raises(RuntimeError):
        core.insert_host(cache.root_node, [5, 6], [100, 101], _ReentrantKey(cache))
    assert cache.host_size() == 0 and tiers(cache) == {
        (1, 2, 3, 4): ("device", [10, 11, 12, 13], None)}

    def reenter(node):
        cache.insert([7, 8], [1, 2])

    with pytest.raises(RuntimeError):
        core.insert_host(cache.root_node, [5, 6], [100, 101], None, False, reenter)
    assert tiers(cache)[(5, 6)] == ("host", None, [100, 101])  # complete before the hook
    cache.insert([7, 8], [1, 2])  # the guard was released
    check_invariants(cache)


def test_no_pages_stamp_the_anchor_alone(make_cache):
    """A prefetch that read nothing still touches its anchor (SGLang's empty ``insert_host``):
    the anchor becomes the most recently used, nothing else changes."""
    cache = make_cache(page_size=2, host_tier=True, write_policy="write_back")
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([5, 6], [14, 15])
    anchor = cache.match_prefix([1, 2, 3, 4]).last_node
    other = cache.match_prefix([5, 6]).last_node
    assert anchor.last_access_time < other.last_access_time
    before = tiers(cache)
    prefix, last, unused, dropped = cache.insert_host(anchor, [], [])
    assert (prefix, last, unused.tolist(), dropped) == (0, anchor, [], False)
    assert anchor.last_access_time > other.last_access_time
    assert tiers(cache) == before and cache.host_size() == 0
    freed = []
    assert cache.evict(2, freed.append) == 2  # the other leaf is now the older one
    assert [t.tolist() for t in freed] == [[14, 15]]
    check_invariants(cache)

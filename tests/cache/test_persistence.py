"""Copies and pickles of a cache: an independent tree that evicts in the same order, on
either core, in a versioned format; nodes themselves refuse to be copied."""

from __future__ import annotations

import copy
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixcache import RadixCache
from radixcache._core import CORES
from radixcache.cache import STATE_FORMAT

from conftest import check_invariants, core_of

REPO = Path(__file__).resolve().parents[2]


def dump(cache: RadixCache) -> list:
    """Every node (root excluded) in display order with everything that decides eviction
    and lookups; ids as ranks (an import hands out fresh ids in the same order)."""
    rows = []
    ids = sorted(node.id for node, _ in core_of(cache).tree.iter_nodes() if node.parent is not None)
    rank = {node_id: i for i, node_id in enumerate(ids)}
    for node, depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        rows.append((depth, node.key.tolist(), node.value.tolist(),
                     None if node.stored_value is None else "stored", node.extra_key,
                     node.priority, node.last_access_time, node.created_time, node.hit_count,
                     node.terminal, node.lock_ref, rank[node.id]))
    return rows


def sizes(cache: RadixCache) -> tuple:
    return (cache.total_size(), cache.evictable_size(), cache.protected_size(),
            cache.node_count(), core_of(cache).tree.clock)


def eviction_order(cache: RadixCache) -> list:
    """Evict everything one token at a time; the freed index tensors, in order."""
    freed: list = []
    while cache.evict(1, freed.append):
        pass
    assert cache.total_size() == 0
    return [t.tolist() for t in freed]


def warmed(make_cache, policy: str, page_size: int = 1, seed: int = 0) -> RadixCache:
    """A cache with splits, namespaces, priorities, stored and key-as-value nodes, hits,
    evictions and the empty sequence, built by random calls."""
    rng = random.Random(seed)
    cache = make_cache(page_size=page_size, eviction_policy=policy)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 4) * page_size)]
                for _ in range(6)]
    for step in range(300):
        tokens = rng.choice(prefixes) + [rng.randrange(30)
                                         for _ in range(rng.randrange(0, 4) * page_size)]
        extra_key = rng.choice([None, None, "tenant-a", ("lora", 7)])
        kind = rng.random()
        if kind < 0.55:
            kv = None if rng.random() < 0.5 else [1000 * step + i for i in range(len(tokens))]
            cache.insert(tokens, kv, extra_key=extra_key, priority=rng.randrange(-2, 3))
        elif kind < 0.9:
            cache.match_prefix(tokens, extra_key=extra_key)
        else:
            cache.evict(rng.randrange(1, 8))
    cache.insert([], extra_key="empty")
    check_invariants(cache)
    return cache


POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "slru", "priority"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_round_trip_keeps_the_tree_and_the_eviction_order(make_cache, policy, how):
    cache = warmed(make_cache, policy, page_size=2 if policy in ("lfu", "mru") else 1)
    before, stats = dump(cache), cache.stats()
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(cache))
    else:
        loaded = getattr(copy, how)(cache)
    check_invariants(loaded)
    assert type(loaded) is RadixCache and loaded is not cache
    assert loaded.core_name == cache.core_name
    assert (loaded.page_size, loaded.eviction_policy) == (cache.page_size, cache.eviction_policy)
    assert dump(loaded) == before
    assert sizes(loaded) == sizes(cache)
    assert loaded.stats() == stats
    assert loaded.exists([], extra_key="empty") and not loaded.exists([], extra_key="x")
    # The original is untouched, and both evict in the same order.
    assert dump(cache) == before
    assert eviction_order(loaded) == eviction_order(cache)


def test_copies_are_independent(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], [7, 8, 9])
    for other in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        other.insert([4, 5])
        other.match_prefix([1, 2])  # a split in the copy only
        assert cache.node_count() == 1 and not cache.exists([4, 5])
        cache.insert([9])
        assert not other.exists([9])
        cache.evict(100)
        assert other.exists([1, 2, 3]) and other.match_prefix([1, 2, 3]).indices.tolist() == [
            7, 8, 9]
        cache.insert([1, 2, 3], [7, 8, 9])
        # Nodes of the original are not the copy's.
        with pytest.raises(ValueError, match="another cache"):
            other.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)


def test_values_are_copied_not_shared(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3], torch.tensor([5, 6, 7]))
    other = copy.copy(cache)
    result = other.match_prefix([1, 2, 3])
    result.indices[0] = 99  # a result is the caller's own tensor
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [5, 6, 7]
    assert other.match_prefix([1, 2, 3]).indices.tolist() == [5, 6, 7]


def test_locks_are_not_carried(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3, 4])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 2
    loaded = pickle.loads(pickle.dumps(cache))
    check_invariants(loaded)
    assert loaded.protected_size() == 0 and loaded.evictable_size() == 4
    assert all(n.lock_ref == (1 if depth == 0 else 0)
               for n, depth in core_of(loaded).tree.iter_nodes())
    assert loaded.evict(4) == 4
    assert cache.protected_size() == 2 and cache.evict(4) == 2  # the original keeps its lock


def test_extra_keys_copied_or_shared(make_cache):
    class Tenant:
        def __init__(self, name):
            self.name = name

        def __eq__(self, other):
            return isinstance(other, Tenant) and other.name == self.name

        def __hash__(self):
            return hash(self.name)

    tenant = Tenant("a")
    cache = make_cache()
    cache.insert([1, 2], extra_key=tenant)
    shallow, deep = copy.copy(cache), copy.deepcopy(cache)
    (s_node,) = shallow.root_node.children
    (d_node,) = deep.root_node.children
    assert s_node.extra_key is tenant
    assert d_node.extra_key is not tenant and d_node.extra_key == tenant
    assert shallow.exists([1, 2], extra_key=Tenant("a")) and deep.exists([1, 2],
                                                                         extra_key=tenant)


def test_empty_cache_round_trips(make_cache):
    cache = make_cache(page_size=4, eviction_policy="fifo")
    loaded = pickle.loads(pickle.dumps(cache))
    assert sizes(loaded) == (0, 0, 0, 0, 0) and loaded.page_size == 4
    assert loaded.eviction_policy == "fifo" and loaded.stats() == cache.stats()


def test_nodes_refuse_to_be_copied(make_cache):
    cache = make_cache()
    node = cache.insert([1, 2]).last_node
    for node_ in (node, cache.root_node):
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="pickle or copy the RadixCache"):
                attempt(node_)


def test_nodes_take_no_weak_references(make_cache):
    import weakref

    node = make_cache().insert([1]).last_node
    with pytest.raises(TypeError):
        weakref.ref(node)


def test_cache_with_events_refuses(make_cache):
    pytest.importorskip("msgspec")
    cache = make_cache(enable_events=True)
    cache.insert([1, 2])
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="enable_events"):
            attempt(cache)


def test_format_version_is_checked(make_cache):
    cache = make_cache()
    cache.insert([1, 2])
    func, (cls, state) = cache.__reduce_ex__(4)
    assert state["format"] == STATE_FORMAT
    with pytest.raises(ValueError, match="saved in format 99"):
        func(cls, dict(state, format=99))
    with pytest.raises(ValueError, match="not a saved RadixCache"):
        func(cls, {"page_size": 1})


@pytest.mark.parametrize("damage, message", [
    (lambda s: s["nodes"].append((5, b"\0" * 8, None, None, 0, 1, 1, 1, True, 77)),
     "parent 5"),
    (lambda s: s["nodes"].append((-1, b"\0" * 12, None, None, 0, 1, 1, 1, True, 77)),
     "whole pages"),
    (lambda s: s["nodes"].append((-1, b"\1" * 8, b"\0" * 16, None, 0, 1, 1, 1, True, 77)),
     "2 values for 1 tokens"),
    (lambda s: s["nodes"].append(s["nodes"][0][:9] + (77,)), "same page as a sibling"),
    (lambda s: s["nodes"].append((-1, b"\1" * 8, None, None, 0, 1, 1, 1, True,
                                  s["nodes"][0][9])), "appears twice"),
    (lambda s: s.pop("clock"), "no 'clock'"),
])
def test_malformed_state_is_refused(make_cache, damage, message):
    cache = make_cache()
    cache.insert([1, 2])
    func, (cls, state) = cache.__reduce_ex__(4)
    damage(state["tree"])
    with pytest.raises(ValueError, match=message):
        func(cls, state)


def test_core_refuses_import_into_a_used_tree(make_cache):
    cache = make_cache()
    cache.insert([1, 2])
    state = core_of(cache).export_state()
    with pytest.raises(ValueError, match="empty core"):
        core_of(cache).import_state(state)
    check_invariants(cache)


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
@pytest.mark.parametrize("source, target", [("c", "python"), ("python", "c")])
def test_saved_on_one_core_loads_on_the_other(source, target):
    cache = warmed(lambda **kw: RadixCache(core=source, **kw), "lru", page_size=2, seed=3)
    func, (cls, state) = cache.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    state = pickle.loads(pickle.dumps(state))
    loaded = func(cls, dict(state, core=target))
    check_invariants(loaded)
    assert loaded.core_name == target
    assert dump(loaded) == dump(cache) and loaded.stats() == cache.stats()
    assert eviction_order(loaded) == eviction_order(cache)


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
def test_pickle_of_the_compiled_core_loads_without_extensions(tmp_path):
    cache = warmed(lambda **kw: RadixCache(core="c", **kw), "slru", seed=5)
    path = tmp_path / "cache.pkl"
    path.write_bytes(pickle.dumps(cache))
    script = ("import pickle, sys; c = pickle.loads(open(sys.argv[1], 'rb').read()); "
              "print(c.core_name, c.total_size(), c.node_count(), c.stats().lookups)")
    env = dict(os.environ, RADIXCACHE_NO_EXTENSIONS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["python", str(cache.total_size()), str(cache.node_count()),
                                   str(cache.stats().lookups)]


def test_deep_chain_round_trips(make_cache):
    # Far deeper than the recursion limit: export and import never recurse.
    cache = make_cache()
    tokens = list(range(5000))
    for end in range(1, 5001, 2):
        cache.insert(tokens[:end])
    loaded = pickle.loads(pickle.dumps(cache))
    assert loaded.node_count() == cache.node_count() == 2500
    assert loaded.exists(tokens[:4999]) and not loaded.exists(tokens[:4998])


class Moody:
    """An extra_key whose __hash__ runs code: raises when told, or calls a cache."""

    fail = False
    call = None

    def __hash__(self):
        if Moody.fail:
            raise RuntimeError("hash refused")
        if Moody.call is not None:
            Moody.call()
        return 7

    def __eq__(self, other):
        return isinstance(other, Moody)


def test_extra_key_code_during_a_copy(make_cache):
    cache = make_cache()
    key = Moody()
    cache.insert([1, 2, 3], extra_key=key)
    try:
        # Code in __hash__ may use the original while the copy is built.
        Moody.call = lambda: cache.match_prefix([1, 2])
        other = copy.copy(cache)
        Moody.call = None
        check_invariants(other)
        assert other.exists([1, 2, 3], extra_key=key)
        # A __hash__ that raises while the copy is built: the error, and no copy.
        Moody.fail = True
        with pytest.raises(RuntimeError, match="hash refused"):
            copy.copy(cache)
    finally:
        Moody.fail = False
        Moody.call = None
    check_invariants(cache)
    assert cache.exists([1, 2, 3], extra_key=key)


class Fickle:
    """An extra_key that stops telling instances apart once validation has passed."""

    same = False

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return isinstance(other, Fickle) and Fickle.same


def test_extra_keys_that_become_equal_during_an_import(make_cache, monkeypatch):
    # Two namespaces starting with the same page pass the validation; if their keys compare
    # equal by the time the tree is built, the import refuses instead of making two children
    # of the root for one (namespace, first page).
    cache = make_cache()
    cache.insert([1, 2], [10, 11], extra_key=Fickle())
    cache.insert([1, 2], [20, 21], extra_key=Fickle())
    func, (cls, state) = cache.__reduce_ex__(4)

    def check_then_merge(*args, check=CORES["python"].check_state):
        records = check(*args)
        Fickle.same = True
        return records

    for module in CORES.values():
        monkeypatch.setattr(module, "check_state", check_then_merge, raising=False)
    try:
        with pytest.raises(ValueError, match="same page as a sibling"):
            func(cls, state)
    finally:
        Fickle.same = False
    check_invariants(cache)


class Meddler:
    """An extra_key whose __hash__, once armed, rewrites the state being imported."""

    state = None

    def __hash__(self):
        if Meddler.state is not None:
            Meddler.state["clock"] = -7
            Meddler.state["num_splits"] = "many"
            Meddler.state["counters"][0] = -1
        return 11

    def __eq__(self, other):
        return isinstance(other, Meddler)


def test_state_changed_by_extra_key_code_during_an_import(make_cache):
    # The import builds the tree from what it validated, not from the state read again
    # after user code (an extra_key's __hash__) ran.
    cache = make_cache()
    cache.insert([1, 2, 3], extra_key=Meddler())
    cache.match_prefix([1, 2], extra_key=Meddler())
    func, (cls, state) = cache.__reduce_ex__(4)
    tree_state = state["tree"]
    tree_state["counters"] = list(tree_state["counters"])
    try:
        Meddler.state = tree_state
        loaded = func(cls, state)
    finally:
        Meddler.state = None
    check_invariants(loaded)
    assert sizes(loaded) == sizes(cache) and loaded.stats() == cache.stats()
    assert dump(loaded) == dump(cache)

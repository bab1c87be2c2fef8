"""``evict``: per-node and batched callbacks, callbacks that call the cache or raise, locked
trees, every policy; on every core, and the same answers on every core."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import check_invariants, core_of, node_tokens
from radixcache import RadixCache
from radixcache._core import CORES

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")


def build(core: str, policy: str, page_size: int, seed: int, with_kv: bool):
    """A cache filled by a seeded mix of inserts, matches and locks; returns (cache, locked)."""
    rng = random.Random(seed)
    cache = RadixCache(page_size=page_size, eviction_policy=policy, core=core)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 6) * page_size)]
             for _ in range(6)]
    locked = []
    slot = 1000
    for _i in range(60):
        seq = rng.choice(bases)[: rng.randrange(0, 5 * page_size + 1)]
        seq = seq + [rng.randrange(50) for _ in range(rng.randrange(1, 4) * page_size)]
        kv = None
        if with_kv:
            kv = list(range(slot, slot + len(seq)))
            slot += len(seq)
        node = cache.insert(seq, kv, priority=rng.randrange(3)).last_node
        if rng.random() < 0.3:
            cache.match_prefix(rng.choice(bases))
        if rng.random() < 0.1:
            cache.inc_lock_ref(node)
            locked.append(node)
    return cache, locked


def contents(cache) -> list:
    return sorted((repr(node.extra_key), tuple(node_tokens(node)), node.terminal,
                   tuple(node.value.tolist()))
                  for node, depth in core_of(cache).tree.iter_nodes() if depth > 0)


def evict_both_ways(core, policy, page_size, seed, with_kv, num_tokens):
    """(per-node values, batch values, freed, freed, stats, stats, contents, contents)."""
    per_node_cache, _ = build(core, policy, page_size, seed, with_kv)
    batch_cache, _ = build(core, policy, page_size, seed, with_kv)
    per_node: list = []
    batched: list = []
    freed_a = per_node_cache.evict(num_tokens, per_node.append)
    freed_b = batch_cache.evict(num_tokens, batched.append, batch=True)
    check_invariants(per_node_cache)
    check_invariants(batch_cache)
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in per_node + batched)
    assert len(batched) <= 1
    return (per_node, batched, freed_a, freed_b, per_node_cache.stats(), batch_cache.stats(),
            contents(per_node_cache), contents(batch_cache))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("with_kv", [False, True], ids=["key-values", "kv"])
def test_batch_frees_the_same_indices_in_the_same_order(core_name, policy, page_size, with_kv):
    for seed in range(4):
        for num_tokens in (1, 7, 40, 10**9):
            (per_node, batched, freed_a, freed_b, stats_a, stats_b, left_a,
             left_b) = evict_both_ways(core_name, policy, page_size, seed, with_kv, num_tokens)
            assert freed_a == freed_b and stats_a == stats_b and left_a == left_b
            flat = [v for t in per_node for v in t.tolist()]
            assert (batched[0].tolist() if batched else []) == flat
            assert len(flat) == freed_a
            assert (freed_a > 0) == bool(batched)


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("policy", POLICIES)
def test_cores_evict_alike(policy):
    for seed in range(4):
        for num_tokens in (3, 25, 10**9):
            got = evict_both_ways("c", policy, 2, seed, True, num_tokens)
            want = evict_both_ways("python", policy, 2, seed, True, num_tokens)
            assert [t.tolist() for t in got[0]] == [t.tolist() for t in want[0]]
            assert [t.tolist() for t in got[1]] == [t.tolist() for t in want[1]]
            assert got[2:] == want[2:]


def test_batch_callback_not_called_when_nothing_is_freed(make_cache):
    cache = make_cache()
    node = cache.insert([1, 2, 3]).last_node
    calls = []
    assert cache.evict(0, calls.append, batch=True) == 0
    cache.inc_lock_ref(node)
    assert cache.evict(10, calls.append, batch=True) == 0
    assert cache.evict(10, calls.append) == 0
    assert calls == []
    cache.dec_lock_ref(node)
    assert cache.evict(10, calls.append, batch=True) == 3
    assert [t.tolist() for t in calls] == [[1, 2, 3]]


def test_batch_of_large_nodes_equals_the_per_node_values(make_cache):
    """Batches far past the first block's size (and far past the tokens asked for): the
    joined values are the per-node values in eviction order, each batch its own tensor."""
    sizes = [3, 5000, 1, 70000, 257, 9000, 2]
    caches = [make_cache(), make_cache()]
    for cache in caches:
        start = 0
        for size in sizes:
            tokens = np.arange(start, start + size, dtype=np.int64)
            cache.insert(tokens, torch.from_numpy(tokens[::-1].copy()))
            start += size + 1
    per_node, batches = [], []
    for num_tokens in (1, 4, 60000, 10**9):
        caches[0].evict(num_tokens, per_node.append)
        caches[1].evict(num_tokens, batches.append, batch=True)
    assert len(batches) == 4
    joined = torch.cat(batches)
    assert joined.tolist() == torch.cat(per_node).tolist()
    assert sorted(len(t) for t in per_node) == sorted(sizes)
    batches[0].zero_()  # each batch owns its memory
    assert torch.cat(batches[1:]).tolist() == joined[len(batches[0]):].tolist()


def test_each_callback_gets_a_new_writable_tensor(make_cache):
    cache = make_cache()
    cache.insert([1, 2], [10, 11])
    cache.insert([3, 4], [12, 13])
    got = []
    cache.evict(10, got.append)
    got[0].zero_()  # writing one must not show in the other or in the cache
    assert [t.tolist() for t in got] == [[0, 0], [12, 13]]
    cache.insert([5, 6], [14, 15])
    batch = []
    cache.evict(10, batch.append, batch=True)
    batch[0].add_(1)
    assert cache.total_size() == 0
    check_invariants(cache)


@pytest.mark.parametrize("policy", POLICIES)
def test_evict_on_a_locked_tree(make_cache, policy):
    cache = make_cache(eviction_policy=policy)
    a = cache.insert([1, 2, 3, 4]).last_node
    b = cache.insert([1, 2, 5, 6]).last_node
    cache.insert([7, 8])
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    for batch in (False, True):
        got = []
        assert cache.evict(100, got.append, batch=batch) == (2 if not batch else 0)
        assert [t.tolist() for t in got] == ([[7, 8]] if not batch else [])
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    cache.dec_lock_ref(a)
    got = []
    assert cache.evict(100, got.append, batch=True) == 2  # [3, 4]; [1, 2] is b's
    assert [t.tolist() for t in got] == [[3, 4]]
    cache.dec_lock_ref(b)
    got = []
    assert cache.evict(100, got.append, batch=True) == 4
    assert [t.tolist() for t in got] == [[5, 6, 1, 2]]  # the leaf, then its parent
    assert cache.total_size() == 0
    check_invariants(cache)


def test_huge_num_tokens_evicts_everything(make_cache):
    cache = make_cache()
    for i in range(5):
        cache.insert([i, i])
    assert cache.evict(10**30) == 10
    assert cache.evict(10**30, batch=True) == 0
    check_invariants(cache)


@pytest.mark.parametrize("callback", [3, "free", object()])
def test_non_callable_callback_is_refused(make_cache, callback):
    cache = make_cache()
    cache.insert([1, 2, 3])
    with pytest.raises(TypeError, match="free_callback"):
        cache.evict(3, callback)
    assert cache.total_size() == 3 and cache.stats().evictions == 0
    check_invariants(cache)


# -- callbacks that call the cache ----------------------------------------------------------
@pytest.mark.parametrize("batch", [False, True])
def test_callback_may_call_the_cache(make_cache, batch):
    cache = make_cache()
    for i in range(10):
        cache.insert([i, 100 + i, 200 + i])
    seen = []

    def free(indices):
        seen.append(indices.tolist())
        check_invariants(cache)  # consistent at every callback
        assert cache.match_prefix([9, 109]).length == 2
        node = cache.insert([50, 51]).last_node
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(node)
        assert cache.exists([50, 51])

    freed = cache.evict(6, free, batch=batch)
    assert freed == 6
    assert len(seen) == (1 if batch else 2)
    check_invariants(cache)


def test_per_node_callback_may_evict_the_rest(make_cache):
    cache = make_cache()
    for i in range(6):
        cache.insert([i, i])
    inner = []

    def free(indices):
        if not inner:
            inner.append(cache.evict(10**9))  # empties the cache under the outer loop

    assert cache.evict(10**9, free) == 2  # its own node; the inner call took the rest
    assert inner == [10]
    assert cache.total_size() == 0 and cache.stats().evictions == 6
    check_invariants(cache)


@pytest.mark.parametrize("batch", [False, True])
def test_callback_may_reset_the_cache(make_cache, batch):
    cache = make_cache()
    for i in range(6):
        cache.insert([i, i])
    calls = []

    def free(indices):
        calls.append(indices.tolist())
        cache.reset()

    assert cache.evict(6, free, batch=batch) == (2 if not batch else 6)
    assert len(calls) == 1
    assert cache.total_size() == 0 and cache.node_count() == 0
    check_invariants(cache)
    cache.insert([1, 2])
    assert cache.evict(2, calls.append, batch=batch) == 2


def test_guard_still_taken_after_the_callback_raises_reentry(make_cache):
    # The callback leaves the guard held (as another thread's call would): the loop cannot
    # take it back, says so, and what it evicted stays evicted.
    cache = make_cache()
    for i in range(4):
        cache.insert([i, i])

    def free(indices):
        core_of(cache).enter("a call in another thread")

    with pytest.raises(RuntimeError, match="re-entered"):
        cache.evict(8, free)
    core_of(cache).leave()
    assert cache.stats().evictions == 1 and cache.total_size() == 6
    check_invariants(cache)


# -- callbacks that raise -------------------------------------------------------------------
def test_raising_per_node_callback_keeps_what_was_evicted(make_cache):
    cache = make_cache()
    for i in range(5):
        cache.insert([i, i, i], [10 * i, 10 * i + 1, 10 * i + 2])
    got = []

    def free(indices):
        got.append(indices.tolist())
        if len(got) == 2:
            raise RuntimeError("allocator refused")

    with pytest.raises(RuntimeError, match="allocator refused"):
        cache.evict(100, free)
    # Both nodes handed to the callback are gone and counted; the others stay.
    assert got == [[0, 1, 2], [10, 11, 12]]
    stats = cache.stats()
    assert (stats.evictions, stats.evicted_tokens, cache.total_size()) == (2, 6, 9)
    assert not cache.exists([0, 0, 0]) and not cache.exists([1, 1, 1])
    assert cache.exists([2, 2, 2])
    check_invariants(cache)
    rest = []
    assert cache.evict(100, rest.append, batch=True) == 9
    assert rest[0].tolist() == [20, 21, 22, 30, 31, 32, 40, 41, 42]
    check_invariants(cache)


def test_raising_batch_callback_after_everything_was_evicted(make_cache):
    cache = make_cache()
    for i in range(5):
        cache.insert([i, i, i])

    def free(indices):
        raise RuntimeError("allocator refused")

    with pytest.raises(RuntimeError, match="allocator refused"):
        cache.evict(7, free, batch=True)
    assert cache.stats().evictions == 3 and cache.total_size() == 6
    check_invariants(cache)


def test_raising_events_hook_keeps_the_victim(make_cache, monkeypatch):
    from radixcache.events import EventRecorder

    cache = make_cache(enable_events=True)
    cache.insert([1, 2])
    cache.insert([3, 4])
    cache.take_events()

    def broken(self, node):
        raise RuntimeError("recorder broke")

    with monkeypatch.context() as patch:
        patch.setattr(EventRecorder, "removed", broken)
        with pytest.raises(RuntimeError, match="recorder broke"):
            cache.evict(4)
    assert cache.total_size() == 4 and cache.stats().evictions == 0
    check_invariants(cache)
    got = []
    assert cache.evict(4, got.append, batch=True) == 4  # the victim is still evictable
    assert got[0].tolist() == [1, 2, 3, 4]
    assert len(cache.take_events()) == 2
    check_invariants(cache)


def test_batch_hands_over_what_was_evicted_when_the_loop_stops(make_cache, monkeypatch):
    from radixcache.events import EventRecorder

    cache = make_cache(enable_events=True)
    for i in range(5):
        cache.insert([i, i], [10 * i, 10 * i + 1])
    real = EventRecorder.removed
    seen = []

    def flaky(self, node):
        seen.append(node)
        if len(seen) == 3:
            raise RuntimeError("recorder broke")
        real(self, node)

    got = []
    with monkeypatch.context() as patch:
        patch.setattr(EventRecorder, "removed", flaky)
        with pytest.raises(RuntimeError, match="recorder broke"):
            cache.evict(100, got.append, batch=True)
    assert [t.tolist() for t in got] == [[0, 1, 10, 11]]  # the two evicted before it
    assert cache.stats().evictions == 2 and cache.total_size() == 6
    check_invariants(cache)

    def refuse(indices):
        got.append(indices.tolist())
        raise ValueError("pool closed")

    seen.clear()
    with monkeypatch.context() as patch:
        patch.setattr(EventRecorder, "removed", flaky)
        with pytest.raises(ValueError, match="pool closed") as excinfo:
            cache.evict(100, refuse, batch=True)
    assert isinstance(excinfo.value.__context__, RuntimeError)  # the loop's error, kept
    assert got[-1] == [20, 21, 30, 31]
    assert cache.total_size() == 2
    check_invariants(cache)


class HostileKey:
    """An extra_key whose ``__hash__`` runs ``hook`` (raise, or call the cache) once set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hook = None

    def __hash__(self) -> int:
        if self.hook is not None:
            self.hook()
        return hash(self.name)

    def __eq__(self, other) -> bool:
        return type(other) is HostileKey and other.name == self.name


def arm(key: HostileKey, cache, hostile: str) -> None:
    def hook():
        if hostile == "raise":
            raise ValueError("hash refused")
        cache.match_prefix([1])  # re-enters: RuntimeError

    key.hook = hook


def held_values(cache, tier: str = "value") -> list:
    return sorted(v for node, depth in core_of(cache).tree.iter_nodes() if depth > 0
                  and getattr(node, tier) is not None for v in getattr(node, tier).tolist())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("hostile", ["raise", "reenter"])
@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("batch", [False, True])
def test_an_extra_key_hostile_during_evict_loses_nothing(make_cache, batch, host_tier,
                                                         hostile):
    # Removing a namespace's nodes needs none of its key's code: the eviction goes through,
    # and every index is either still held or handed over, once.
    cache = make_cache(host_tier=host_tier)
    key = HostileKey("a")
    cache.insert([1, 2, 3], [10, 11, 12], extra_key=key)
    assert cache.insert([1, 2, 7], [90, 91, 22], extra_key=key).prefix_len == 2  # a split
    cache.insert([4, 5], [13, 14])
    arm(key, cache, hostile)
    got: list = []
    freed = cache.evict(100, lambda v: got.extend(v.tolist()), batch=batch)
    key.hook = None
    assert freed == len(got) == 6 and cache.total_size() == 0
    assert sorted(got) == [10, 11, 12, 13, 14, 22] and held_values(cache) == []
    check_invariants(cache)
    assert cache.insert([1, 2, 3], [30, 31, 32], extra_key=key).prefix_len == 0
    assert cache.match_prefix([1, 2, 3], extra_key=HostileKey("a")).length == 3
    check_invariants(cache)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("hostile", ["raise", "reenter"])
@pytest.mark.parametrize("batch", [False, True])
def test_an_extra_key_hostile_during_evict_host_loses_nothing(make_cache, batch, hostile):
    cache = make_cache(host_tier=True)
    key = HostileKey("a")
    cache.insert([1, 2, 3], [10, 11, 12], extra_key=key)
    cache.insert([1, 2, 7], [90, 91, 22], extra_key=key)
    slots = iter(range(100, 200))
    assert cache.evict(100, backup=lambda d: torch.tensor(
        [next(slots) for _ in range(d.shape[0])], dtype=torch.int64)) == 4
    assert cache.host_size() == 4 and cache.total_size() == 0
    arm(key, cache, hostile)
    got: list = []
    freed = cache.evict_host(100, lambda v: got.extend(v.tolist()), batch=batch)
    key.hook = None
    assert freed == len(got) == 4 and cache.host_size() == 0
    assert sorted(got) == [100, 101, 102, 103] and held_values(cache, "host_value") == []
    check_invariants(cache)


class CollidingKey:
    """extra_keys that all hash alike, whose ``__eq__`` raises once ``armed`` is set."""

    armed = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other) -> bool:
        if CollidingKey.armed:
            raise ValueError("eq refused")
        return type(other) is CollidingKey and other.name == self.name


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("mode", ["one tier", "host tier", "evict_host"])
@pytest.mark.parametrize("batch", [False, True])
def test_colliding_extra_keys_hostile_during_evict_lose_nothing(make_cache, mode, batch):
    # Two namespaces whose keys collide: removing one's node must not ask the other's key.
    cache = make_cache(host_tier=mode != "one tier")
    a, b = CollidingKey("a"), CollidingKey("b")
    cache.insert([1, 2], [10, 11], extra_key=a)
    cache.insert([1, 2], [20, 21], extra_key=b)
    if mode == "evict_host":
        assert cache.evict(4, backup=lambda d: d + 90) == 4  # host slots 100.. and 110..
        cache.match_prefix([1, 2], extra_key=a)  # a: the most recently used
        evict, tier, want = cache.evict_host, "host_value", [110, 111]
    else:
        cache.inc_lock_ref(cache.match_prefix([1, 2], extra_key=a).last_node)
        evict, tier, want = cache.evict, "value", [20, 21]
    CollidingKey.armed = True
    got: list = []
    try:
        freed = evict(2, lambda v: got.extend(v.tolist()), batch=batch)
    finally:
        CollidingKey.armed = False
    assert freed == 2 and got == want
    held = held_values(cache, tier)
    assert sorted(held + got) == sorted(want + [w - 10 for w in want])
    check_invariants(cache)
    assert cache.match_prefix([1, 2], extra_key=CollidingKey("b")).length == 0


def test_a_torch_hook_refusing_the_victims_tensor_keeps_it_evictable(make_cache):
    from torch.overrides import TorchFunctionMode

    class Refuse(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            raise RuntimeError("mode refuses " + getattr(func, "__name__", str(func)))

    cache = make_cache(host_tier=True)
    cache.insert([1, 2, 3], torch.empty(3, dtype=torch.int64, device="meta"))
    with pytest.raises(RuntimeError, match="mode refuses"):
        with Refuse():
            cache.evict(3, backup=lambda d: None)
    assert cache.total_size() == 3
    check_invariants(cache)
    assert cache.evict(3, backup=lambda d: None) == 3  # still a victim
    check_invariants(cache)


@pytest.mark.parametrize("callback_raises", [False, True])
@pytest.mark.parametrize("host_tier", [False, True])
def test_a_batch_that_does_not_join_is_handed_over_part_by_part(make_cache, host_tier,
                                                                callback_raises):
    # Device values torch.cat refuses to join (several devices, or here a hook): every
    # victim's indices still reach the callback, one call each, then the error propagates.
    from torch.overrides import TorchFunctionMode

    class NoCat(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.cat:
                raise RuntimeError("cat refused")
            return func(*args, **(kwargs or {}))

    cache = make_cache(host_tier=host_tier)
    for i in range(3):
        cache.insert([i, i, i], torch.empty(3, dtype=torch.int64, device="meta"))
    got = []

    def free(indices):
        got.append((indices.device.type, indices.shape[0]))
        if callback_raises:
            raise ValueError("pool refused")

    with pytest.raises(RuntimeError, match="cat refused") as excinfo:
        with NoCat():
            cache.evict(100, free, batch=True)
    assert got == [("meta", 3)] * 3  # every part, even after a call raised
    context = excinfo.value.__context__
    if callback_raises:
        assert type(context) is ValueError and context.__context__ is None
    else:
        assert context is None
    assert cache.total_size() == 0 and cache.stats().evictions == 3
    check_invariants(cache)

"""``RadixCache(array_type="numpy")``: the same cache with numpy index arrays, on every core.

A numpy cache must give exactly what a torch cache gives (values, lengths, nodes, stats,
callbacks), as int64 numpy arrays, refuse what it cannot hold (device indices, tensors from
``backup``) leaving the cache as it was, and never import torch: a simulation runs without it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import ARRAY_TYPE_PARAMS, HAS_TORCH, check_invariants, needs_torch
from radixcache import ARRAY_TYPES
from radixcache.workloads import HostPool, KVPool, ServingLoop, serve, synthetic_chat

if HAS_TORCH:  # else the cases that need it skip (needs_torch)
    import torch

REPO = Path(__file__).resolve().parents[2]


def as_list(values) -> list:
    return values.tolist()


def check_numpy(values, length=None) -> None:
    """``values`` is a 1-D int64 numpy array (of ``length`` entries when given)."""
    assert type(values) is np.ndarray
    assert values.dtype == np.int64 and values.ndim == 1
    if length is not None:
        assert values.shape[0] == length


def check_torch(values, length=None) -> None:
    assert isinstance(values, torch.Tensor)
    assert values.dtype == torch.int64 and values.dim() == 1
    if length is not None:
        assert values.shape[0] == length


CHECK = {"numpy": check_numpy, "torch": check_torch}


def test_array_types_are_named():
    assert ARRAY_TYPES == ("torch", "numpy")


@pytest.mark.parametrize("bad, error", [("tensor", ValueError), ("", ValueError),
                                        (None, TypeError), (1, TypeError)])
def test_bad_array_type(make_cache, bad, error):
    with pytest.raises(error, match="array_type"):
        make_cache(array_type=bad)


@pytest.mark.parametrize("array_type", ARRAY_TYPE_PARAMS)
def test_results_are_of_the_cache_kind(make_cache, array_type):
    cache = make_cache(array_type=array_type)
    check = CHECK[array_type]
    miss = cache.match_prefix([1, 2, 3])
    check(miss.indices, 0)
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]).prefix_len == 0
    hit = cache.match_prefix([1, 2, 3, 9])  # splits the node
    check(hit.indices, 3)
    assert as_list(hit.indices) == [10, 11, 12]
    check(hit.last_node.value, 3)
    assert as_list(hit.last_node.value) == [10, 11, 12]
    # A result is the caller's: writing to it changes nothing in the cache.
    hit.indices[0] = 99
    assert as_list(cache.match_prefix([1, 2, 3, 4]).indices) == [10, 11, 12, 13]
    hit.close()
    check(hit.indices, 0)
    freed = []
    assert cache.evict(10, freed.append) == 4
    assert len(freed) == 2
    for values in freed:
        check(values)
    assert sorted(v for values in freed for v in as_list(values)) == [10, 11, 12, 13]
    check_invariants(cache)


@pytest.mark.parametrize("array_type", ARRAY_TYPE_PARAMS)
def test_batch_evict_hands_one_array(make_cache, array_type):
    cache = make_cache(array_type=array_type)
    for k in range(5):
        cache.insert([k, 1, 2], [3 * k, 3 * k + 1, 3 * k + 2])
    got = []
    assert cache.evict(15, got.append, batch=True) == 15
    assert len(got) == 1
    CHECK[array_type](got[0], 15)
    assert sorted(as_list(got[0])) == list(range(15))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
@needs_torch
def test_numpy_cache_equals_torch_cache(make_cache, page_size, policy):
    """The same random calls on both kinds give the same answers, call by call."""
    rng = random.Random(page_size * 31 + len(policy))
    caches = {kind: make_cache(page_size=page_size, eviction_policy=policy, array_type=kind)
              for kind in ARRAY_TYPES}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 24))] for _ in range(6)]
    next_slot = 0
    for step in range(300):
        op = rng.random()
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(12))]
        answers = {}
        if op < 0.45:
            kv = np.arange(next_slot, next_slot + len(tokens), dtype=np.int64)
            next_slot += len(tokens)
            for kind, cache in caches.items():
                result = cache.insert(tokens, kv, priority=step % 3)
                answers[kind] = (result.prefix_len, result.last_node.num_tokens)
        elif op < 0.85:
            for kind, cache in caches.items():
                match = cache.match_prefix(tokens)
                CHECK[kind](match.indices, match.length)
                answers[kind] = (match.length, as_list(match.indices))
        else:
            batch = rng.random() < 0.5
            wanted = rng.randrange(1, 40)
            for kind, cache in caches.items():
                freed = []
                count = cache.evict(wanted, freed.append, batch=batch)
                for values in freed:
                    CHECK[kind](values)
                answers[kind] = (count, [as_list(values) for values in freed])
        assert answers["numpy"] == answers["torch"], f"step {step}"
    stats = {kind: cache.stats() for kind, cache in caches.items()}
    assert stats["numpy"] == stats["torch"]
    for cache in caches.values():
        check_invariants(cache)


class Host:
    """An engine's host pool handing out arrays of one kind: 1000, 1001, ..."""

    def __init__(self, kind: str, capacity: int = 10**6) -> None:
        self.kind, self.capacity, self.next, self.used = kind, capacity, 1000, 0
        self.copied: list = []

    def backup(self, device_indices):
        CHECK[self.kind](device_indices)
        n = device_indices.shape[0]
        self.copied.append(as_list(device_indices))
        if self.used + n > self.capacity:
            return None
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        self.used += n
        return out if self.kind == "numpy" else torch.from_numpy(out)

    def free(self, host_indices) -> None:
        CHECK[self.kind](host_indices)
        self.used -= host_indices.shape[0]


@pytest.mark.parametrize("array_type", ARRAY_TYPE_PARAMS)
def test_host_tier_round_trip(make_cache, array_type):
    check = CHECK[array_type]
    cache = make_cache(host_tier=True, array_type=array_type)
    host = Host(array_type)
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    cache.insert([1, 2, 7, 8], [10, 11, 22, 23])
    freed = []
    assert cache.evict(6, freed.append, backup=host.backup) == 6
    assert sorted(host.copied) == [[10, 11], [12, 13], [22, 23]]
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.length, match.host_length) == (0, 4)
    check(match.indices, 0)
    loaded = cache.load_back(match, np.array([50, 51, 52, 53]))
    check(loaded, 4)
    assert as_list(cache.match_prefix([1, 2, 3, 4]).indices) == [50, 51, 52, 53]
    check(cache.match_prefix([1, 2, 3, 4]).last_node.host_value, 2)
    dropped = []
    assert cache.evict_host(2, dropped.append) == 2  # [7, 8]: host only
    check(dropped[0], 2)
    check_invariants(cache)


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@pytest.mark.parametrize("page_size", [1, 16])
@needs_torch
def test_serve_is_the_same_with_numpy_arrays(make_cache, policy, page_size):
    """A whole replay with a host tier (backups, host evictions, load-backs, adoption) gives
    the same counters and stats with either kind."""
    requests = synthetic_chat(num_conversations=40, num_system_prompts=3, seed=7)
    results = {}
    for kind in ARRAY_TYPES:
        cache = make_cache(page_size=page_size, host_tier=True, write_policy=policy,
                           array_type=kind)
        results[kind] = serve(cache, requests, 6000, host_capacity=9000)
        check_invariants(cache)
    same = {kind: dataclasses.replace(result, seconds=0.0) for kind, result in results.items()}
    assert same["numpy"] == same["torch"]
    assert results["numpy"].loaded_tokens > 0 and results["numpy"].backed_up_tokens > 0


@pytest.mark.parametrize("kind", ARRAY_TYPE_PARAMS)
def test_pools_hand_out_their_kind(kind):
    CHECK[kind](KVPool(10, array_type=kind).alloc(4), 4)
    CHECK[kind](HostPool(10, array_type=kind).alloc(4), 4)


def test_pools_refuse_unknown_array_types():
    with pytest.raises(ValueError, match="array_type"):
        KVPool(10, array_type="jax")
    with pytest.raises(ValueError, match="array_type"):
        HostPool(10, array_type=None)


# -- bad input: a clear error, the cache as it was ----------------------------------------
@needs_torch
def test_device_indices_are_refused(make_cache):
    cache = make_cache(array_type="numpy")
    cache.insert([1, 2], [5, 6])
    before = cache.stats()
    with pytest.raises(ValueError, match="array_type='numpy'"):
        cache.insert([1, 2, 3, 4], torch.empty(4, dtype=torch.int64, device="meta"))
    assert cache.stats() == before
    assert cache.match_prefix([1, 2, 3, 4]).length == 2
    check_invariants(cache)


@pytest.mark.parametrize("answer, error, message", [
    pytest.param(lambda n: torch.arange(n), TypeError, "numpy array", marks=needs_torch),
    (lambda n: np.arange(n, dtype=np.int32), TypeError, "int64"),
    (lambda n: np.arange(n + 1), ValueError, "host indices for"),
    (lambda n: np.arange(2 * n).reshape(2, n), ValueError, "1-D"),
    (lambda n: list(range(n)), TypeError, "numpy array"),
])
def test_bad_backup_answers(make_cache, answer, error, message):
    cache = make_cache(host_tier=True, array_type="numpy")
    cache.insert([1, 2, 3], [4, 5, 6])
    freed = []
    with pytest.raises(error, match=message):
        cache.evict(3, freed.append, backup=lambda values: answer(values.shape[0]))
    assert freed == [] and cache.total_size() == 3 and cache.host_size() == 0
    assert as_list(cache.match_prefix([1, 2, 3]).indices) == [4, 5, 6]
    check_invariants(cache)


@needs_torch
def test_torch_cache_refuses_a_numpy_backup(make_cache):
    cache = make_cache(host_tier=True)
    cache.insert([1, 2, 3], [4, 5, 6])
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.evict(3, backup=lambda values: np.arange(3, dtype=np.int64))
    assert cache.total_size() == 3 and cache.host_size() == 0


@needs_torch
def test_tensor_inputs_to_a_numpy_cache(make_cache):
    cache = make_cache(array_type="numpy")
    tokens = torch.tensor([3, 1, 4, 1, 5])
    assert cache.insert(tokens, torch.tensor([9, 8, 7, 6, 5])).prefix_len == 0
    match = cache.match_prefix(tokens)
    check_numpy(match.indices, 5)
    assert as_list(match.indices) == [9, 8, 7, 6, 5]
    loaded = make_cache(host_tier=True, array_type="numpy")
    loaded.insert([1, 2], [3, 4])
    loaded.evict(2, backup=Host("numpy").backup)
    match = loaded.match_prefix([1, 2])
    check_numpy(loaded.load_back(match, torch.tensor([7, 8])), 2)
    assert as_list(loaded.match_prefix([1, 2]).indices) == [7, 8]


def test_pickle_keeps_the_array_type(make_cache):
    cache = make_cache(array_type="numpy")
    cache.insert([1, 2, 3], [7, 8, 9])
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.array_type == "numpy"
    check_numpy(copy.match_prefix([1, 2, 3]).indices, 3)
    assert "array_type='numpy'" in repr(copy)


# -- no torch ------------------------------------------------------------------------------
def run_python(code: str, core_name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("RADIXCACHE_NO_EXTENSIONS", None)
    if core_name == "python":
        env["RADIXCACHE_NO_EXTENSIONS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_numpy_cache_never_imports_torch(core_name):
    done = run_python("""
        import sys
        import numpy as np
        from radixcache import RadixCache
        cache = RadixCache(host_tier=True, array_type="numpy")
        cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
        cache.insert([1, 2, 5], np.array([10, 11, 20]))
        freed = []
        cache.evict(5, freed.append, backup=lambda v: np.arange(len(v), dtype=np.int64))
        cache.evict_host(1, freed.append)
        match = cache.match_prefix([1, 2, 3, 4])
        cache.load_back(match, np.arange(match.host_length) + 100)
        cache.evict(2, freed.append, batch=True)
        assert all(type(v) is np.ndarray for v in freed), freed
        assert "torch" not in sys.modules, "torch was imported"
        print(cache.core_name)
    """, core_name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [core_name]


@pytest.mark.parametrize("args", [
    ["--capacity", "20000,60000", "--policy", "lru,lfu"],
    ["--capacity", "20000", "--host-capacity", "40000", "--write-policy", "all"],
    ["--capacity", "20000", "--workers", "2", "--router", "cache-aware"],
    ["--capacity", "20000,60000", "--jobs", "2"],
])
def test_simulate_runs_without_torch(core_name, args):
    done = run_python(f"""
        import sys
        from radixcache.cli import main
        code = main(["simulate", "--limit", "300", "--quiet"] + {args!r})
        assert code == 0, code
        assert "torch" not in sys.modules, "torch was imported"
    """, core_name)
    assert done.returncode == 0, done.stderr
    assert "hit rate" in done.stdout


@needs_torch
def test_torch_imported_later_is_recognised(core_name):
    """A numpy cache made before torch was imported still takes tensors afterwards."""
    done = run_python("""
        import sys
        from radixcache import RadixCache
        cache = RadixCache(array_type="numpy")
        cache.insert([1, 2, 3], [4, 5, 6])
        assert "torch" not in sys.modules
        import torch
        match = cache.match_prefix(torch.tensor([1, 2, 3, 9]))
        assert match.indices.tolist() == [4, 5, 6], match.indices
        cache.insert(torch.tensor([1, 2, 7]), torch.tensor([4, 5, 8]))
        assert cache.match_prefix([1, 2, 7]).indices.tolist() == [4, 5, 8]
        torch_cache = RadixCache()
        torch_cache.insert(torch.tensor([1, 2]), torch.tensor([3, 4]))
        assert isinstance(torch_cache.match_prefix([1, 2]).indices, torch.Tensor)
        print("ok")
    """, core_name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("array_type", ARRAY_TYPE_PARAMS)
def test_batch_evict_while_backup_keeps_its_arrays(make_cache, array_type):
    """A backup that keeps the arrays it gets makes the batch go on in new blocks (it never
    writes where a live array looks): the parts still reach free_callback as one array of the
    cache's kind, every freed slot once."""
    cache = make_cache(host_tier=True, array_type=array_type)
    for k in range(3):
        cache.insert([1000 * k + j for j in range(200)],
                     np.arange(200 * k, 200 * k + 200, dtype=np.int64))
    kept = []
    host = Host(array_type)

    def backup(device_indices):
        kept.append(device_indices)
        return host.backup(device_indices)

    freed = []
    assert cache.evict(300, freed.append, batch=True, backup=backup) == 400
    assert len(freed) == 1
    CHECK[array_type](freed[0], 400)
    assert sorted(as_list(freed[0])) == list(range(400))
    assert sorted(v for values in kept for v in as_list(values)) == list(range(400))
    assert (cache.total_size(), cache.host_size()) == (200, 400)
    check_invariants(cache)


def _tree_slots(cache):
    """The device and the host slot ids the tree holds (numpy arrays of either kind)."""
    device, host = [], []
    stack = list(cache.root_node.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.on_device:
            device.append(np.asarray(node.stored_value))
        if node.host_value is not None:
            host.append(np.asarray(node.host_value))
    empty = [np.empty(0, dtype=np.int64)]
    return np.concatenate(device + empty), np.concatenate(host + empty)


@pytest.mark.parametrize("array_type", ARRAY_TYPE_PARAMS)
@pytest.mark.parametrize("write_policy", [None, "write_back", "write_through"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_interleaved_serving_keeps_every_slot_once(make_cache, array_type, write_policy,
                                                   page_size):
    """Requests admitted, cached and finished out of order (as the fleet runs them): after
    every step each device slot is free, held by the tree, or held by a running request,
    exactly once; each host slot handed out is free or held by the tree, once."""
    rng = random.Random(page_size)
    requests = synthetic_chat(num_conversations=30, num_system_prompts=3, seed=page_size,
                              system_prompt_len=(100, 300), user_len=(5, 40),
                              output_len=(5, 60))
    if write_policy is None:
        cache = make_cache(page_size=page_size, array_type=array_type)
        loop = ServingLoop(cache, 1500)
    else:
        cache = make_cache(page_size=page_size, array_type=array_type, host_tier=True,
                           write_policy=write_policy)
        loop = ServingLoop(cache, 1500, host_capacity=1200)
    running = []

    def check():
        device, host = _tree_slots(cache)
        held = [np.asarray(admission.kv)[admission.owned_from:] for admission in running]
        slots = np.concatenate([device, loop.pool.free_slots()] + held)
        assert np.array_equal(np.sort(slots), np.arange(1500))
        if loop.host_pool is not None:
            pool = loop.host_pool
            slots = np.concatenate([host, pool._free[:pool._top]])
            assert np.array_equal(np.sort(slots), np.arange(pool._next))
            assert pool.used == cache.host_size()

    for request in requests:
        admission = loop.admit(request, wait=True)
        while admission is None and running:
            loop.finish(running.pop(rng.randrange(len(running))))
            admission = loop.admit(request, wait=True)
        if admission is None:
            continue
        if rng.random() < 0.7:
            loop.cache_prompt(admission)
        running.append(admission)
        while len(running) > rng.randrange(1, 5):
            loop.finish(running.pop(rng.randrange(len(running))))
        check()
    while running:
        loop.finish(running.pop())
    check()
    result = loop.result()
    assert result.evicted_tokens and result.requests == len(requests)
    if write_policy is not None:
        assert result.backed_up_tokens
    check_invariants(cache)


def test_an_index_array_owner_cannot_be_forged(make_cache):
    """What owns a result array's memory, reached by the user (``base``) and made anew
    without any memory, exports no buffer over nothing: an error, never a crash."""
    cache = make_cache(array_type="numpy")
    cache.insert([1, 2, 3], [4, 5, 6])
    indices = cache.match_prefix([1, 2, 3]).indices
    owner = indices.base
    while isinstance(owner, memoryview):
        owner = owner.obj
    if owner is None or type(owner) in (bytes, bytearray, np.ndarray):
        return  # a builtin owner: nothing of the cache's to forge
    forged = type(owner).__new__(type(owner))
    with pytest.raises(BufferError):
        memoryview(forged)
    assert as_list(indices) == [4, 5, 6]


def test_result_arrays_keep_their_memory(make_cache):
    """No index array the cache hands out rests on a memoryview: the caller could release
    that (``values.base.release()``) and free the memory under the array."""
    arrays = []
    cache = make_cache(host_tier=True, array_type="numpy")
    host = Host("numpy")

    def backup(device_indices):
        arrays.append(device_indices)
        return host.backup(device_indices)

    for k in range(4):
        cache.insert([k, 1, 2, 3], [10 * k + j for j in range(4)])
    cache.insert([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    match = cache.match_prefix([0, 1, 2, 3, 4, 5])  # two nodes: joined
    arrays += [match.indices, match.last_node.value]
    assert cache.evict(5, arrays.append, backup=backup) >= 5
    assert cache.evict(6, arrays.append, batch=True, backup=backup) >= 6
    match = cache.match_prefix([0, 1, 2, 3])
    arrays.append(cache.load_back(match, np.arange(100, 100 + match.host_length)))
    stack = list(cache.root_node.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.host_value is not None:
            arrays.append(node.host_value)
    assert cache.evict_host(4, arrays.append) >= 4
    assert cache.evict_host(4, arrays.append, batch=True) >= 4
    assert len(arrays) >= 10
    for values in arrays:
        check_numpy(values)
        assert not isinstance(values.base, memoryview), values.base

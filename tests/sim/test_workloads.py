"""Workloads, the KV pool, the serving loop and trace reading."""

from __future__ import annotations

import array
import dataclasses
import json
import random
import re
import tracemalloc

import numpy as np
import pytest
import torch

from radixcache import RadixCache
from radixcache._core import CORES
from radixcache._options import MAX_POOL_SLOTS
from radixcache.traces import TraceError, read_trace
from radixcache.workloads import (
    FRESH_TOKEN_BASE,
    INPUT_TYPES,
    HostPool,
    KVPool,
    Request,
    ServingLoop,
    as_input_type,
    deep_exercise_ops,
    exercise_ops,
    serve,
    synthetic_chat,
    time_cached_calls,
    walk_cost,
)

from conftest import core_of, mooncake_trace

MOONCAKE, MOONCAKE_MISSING = mooncake_trace("synthetic")


@pytest.fixture(params=sorted(CORES))
def core(request):
    return request.param


def small_chat(seed=0):
    return synthetic_chat(num_conversations=40, num_system_prompts=4, seed=seed,
                          system_prompt_len=(100, 300), user_len=(5, 40), output_len=(5, 60))


def tree_slots(cache):
    """Every slot id the tree holds, walking the nodes without recursion."""
    slots = []
    stack = list(cache.root_node.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        assert node.stored_value is not None
        slots.append(node.stored_value.numpy())
    return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)


def checking_serve(cache, requests, capacity):
    """serve() while checking after every request that pool and tree account for every slot."""
    pool = KVPool(capacity)
    done = [0]

    def check(n):
        done[0] += n
        assert pool.used == cache.total_size()
        assert cache.protected_size() == 0  # every lock was released
        if done[0] % 7 == 0 or done[0] == len(requests):
            held = np.concatenate([tree_slots(cache), pool.free_slots()])
            assert np.array_equal(np.sort(held), np.arange(capacity))  # no leak, no double use

    result = serve(cache, requests, capacity, progress=check, pool=pool)
    assert done[0] == len(requests)
    return result, pool


def arrays_equal(a, b):
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))


def same_requests(xs, ys):
    return len(xs) == len(ys) and all(
        np.array_equal(x.prompt, y.prompt) and x.output_len == y.output_len
        and arrays_equal(x.output, y.output) and x.extra_key == y.extra_key
        for x, y in zip(xs, ys))


# -- Request -----------------------------------------------------------------------------------
def test_request_validates_and_converts():
    req = Request([1, 2, 3], 2, [7, 8])
    assert req.prompt.dtype == np.int64 and req.output.dtype == np.int64
    assert Request(np.array([], dtype=np.int64), 0).prompt.shape == (0,)
    with pytest.raises(ValueError, match="output has 1 token but"):
        Request([1, 2], 2, [5])
    with pytest.raises(ValueError, match="output_len"):
        Request([1], -1)
    with pytest.raises(TypeError):
        Request([1.5, 2.0], 1)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        Request([FRESH_TOKEN_BASE], 1)
    with pytest.raises(ValueError, match="2\\*\\*62"):
        Request([-1, 3], 1)


# -- synthetic_chat ----------------------------------------------------------------------------
def test_synthetic_chat_is_deterministic():
    assert same_requests(small_chat(seed=3), small_chat(seed=3))
    assert not same_requests(small_chat(seed=3), small_chat(seed=4))


def test_synthetic_chat_structure():
    num_conversations, num_system_prompts = 40, 4
    requests = small_chat()
    # Rebuild the conversations: a follow-up turn starts with an earlier turn's prompt + answer.
    open_turns = {}  # prompt+answer bytes of each conversation's latest turn -> conversation
    conversation_of = []
    firsts = []
    for req in requests:
        assert req.output is not None and len(req.output) == req.output_len
        assert 5 <= req.output_len <= 60
        owner = None
        for key, conv in list(open_turns.items()):
            n = len(key) // 8
            if len(req.prompt) > n and req.prompt[:n].tobytes() == key:
                assert owner is None  # exactly one earlier turn continues here
                owner = conv
                del open_turns[key]
                assert 5 <= len(req.prompt) - n <= 40  # just the new user message
        if owner is None:
            owner = len(firsts)
            firsts.append(req.prompt)
            assert 100 + 5 <= len(req.prompt) <= 300 + 40
        conversation_of.append(owner)
        open_turns[np.concatenate([req.prompt, req.output]).tobytes()] = owner

    assert len(firsts) == num_conversations
    turns = np.bincount(conversation_of)
    assert turns.min() >= 2 and turns.max() <= 6
    # Conversations interleave: some conversation's turns are not back to back.
    positions = [[i for i, c in enumerate(conversation_of) if c == conv]
                 for conv in range(num_conversations)]
    assert any(idx[-1] - idx[0] + 1 > len(idx) for idx in positions)
    # First turns share a few system prompts: count distinct 100-token openings.
    openings = {first[:100].tobytes() for first in firsts}
    assert 1 < len(openings) <= num_system_prompts


# -- exercise_ops ------------------------------------------------------------------------------
def test_exercise_ops_shape_and_determinism():
    ops = exercise_ops(num_ops=4000, seed=1, base_len=(50, 200), num_bases=10)
    again = exercise_ops(num_ops=4000, seed=1, base_len=(50, 200), num_bases=10)
    assert ops == again
    assert ops != exercise_ops(num_ops=4000, seed=2, base_len=(50, 200), num_bases=10)
    kinds = [kind for kind, _ in ops]
    assert set(kinds) == {"insert", "exists"}
    assert 0.4 < kinds.count("exists") / len(ops) < 0.6
    assert all(isinstance(t, int) for _, tokens in ops[:50] for t in tokens)


def test_exercise_ops_against_a_set_model(core):
    """exists() answers exactly "was this sequence inserted", with hits and misses both common."""
    ops = exercise_ops(num_ops=3000, seed=5, base_len=(30, 120), num_bases=8)
    cache = RadixCache(core=core)
    inserted = set()
    answers = {True: 0, False: 0}
    prefix_misses = 0
    for kind, tokens in ops:
        key = tuple(tokens)
        if kind == "insert":
            cache.insert(tokens)
            inserted.add(key)
        else:
            expected = key in inserted
            assert cache.exists(tokens) is expected
            answers[expected] += 1
            if not expected and cache.match_prefix(tokens).length == len(tokens):
                prefix_misses += 1  # cached as a prefix, never inserted as such
    assert answers[True] > 100 and answers[False] > 100
    assert prefix_misses > 10


def test_deep_exercise_ops_builds_a_deep_tree(core):
    ops = deep_exercise_ops(num_ops=2000, seed=3, num_bases=4, prefix_len=(20, 200))
    assert ops == deep_exercise_ops(num_ops=2000, seed=3, num_bases=4, prefix_len=(20, 200))
    assert ops != deep_exercise_ops(num_ops=2000, seed=4, num_bases=4, prefix_len=(20, 200))
    cache = RadixCache(core=core)
    inserted = set()
    for kind, tokens in ops:
        if kind == "insert":
            cache.insert(tokens)
            inserted.add(tuple(tokens))
        else:
            assert cache.exists(tokens) is (tuple(tokens) in inserted)
    depths = []
    for tokens in list(inserted)[:200]:
        node = cache.match_prefix(tokens).last_node
        depth = 0
        while node.parent is not None:
            depth += 1
            node = node.parent
        depths.append(depth)
    # ~250 cuts per base over 180 positions: terminals sit far below depth 2.
    assert sum(depths) / len(depths) > 20


def test_deep_exercise_ops_big_ids_and_bad_arguments():
    ops = deep_exercise_ops(num_ops=300, seed=1, vocab=1 << 40)
    assert max(max(tokens) for _, tokens in ops if tokens) >= 1 << 31
    with pytest.raises(ValueError, match="prefix_len"):
        deep_exercise_ops(num_ops=10, prefix_len=(5, 2))
    with pytest.raises(ValueError, match="num_bases"):
        deep_exercise_ops(num_ops=10, num_bases=0)


@pytest.mark.parametrize("input_type", INPUT_TYPES)
def test_as_input_type_round_trips(input_type):
    tokens = np.array([5, 0, 2**40, 7], dtype=np.int64)
    converted = as_input_type(tokens, input_type)
    assert np.asarray(converted).tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="unknown input type"):
        as_input_type(tokens, "bytes")


@pytest.mark.parametrize("input_type", INPUT_TYPES)
def test_time_cached_calls_changes_nothing_after_warm_up(core, input_type):
    requests = synthetic_chat(num_conversations=6, num_system_prompts=2, seed=2,
                              system_prompt_len=(30, 60))
    cache = RadixCache(page_size=4, core=core)
    timing = time_cached_calls(cache, requests, input_type, passes=2)
    assert timing.requests == len(requests)
    assert timing.match_seconds > 0 and timing.insert_seconds > 0 and timing.walk_seconds > 0
    assert 0 <= timing.rest_share < 1
    nodes, splits = cache.node_count(), cache.stats().splits
    # Everything is cached: the walk hook sees whole prompts, and another pass splits nothing.
    for request in requests:
        aligned = len(request.prompt) - len(request.prompt) % 4
        assert core_of(cache).walk(request.prompt) == aligned
    time_cached_calls(cache, requests, input_type, passes=1)
    assert (cache.node_count(), cache.stats().splits) == (nodes, splits)


def test_walk_cost_counts_nodes_visited(core):
    cache = RadixCache(core=core)
    sequences = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [9]]
    for seq in sequences:
        cache.insert(seq)
    per_node, depth = walk_cost(cache, sequences, passes=1)
    assert per_node > 0
    assert depth == (1 + 2 + 3 + 1) / 4


# -- KVPool ------------------------------------------------------------------------------------
def test_kv_pool_alloc_and_free():
    pool = KVPool(10)
    first = pool.alloc(4)
    assert first.dtype == torch.int64 and sorted(first.tolist()) == [0, 1, 2, 3]
    assert pool.used == 4 and pool.available == 6
    assert pool.alloc(7) is None and pool.used == 4  # short: nothing taken
    rest = pool.alloc(6)
    assert sorted(torch.cat([first, rest]).tolist()) == list(range(10))
    pool.free(first[1:3])
    assert pool.available == 2
    assert sorted(pool.free_slots().tolist()) == [1, 2]
    for bad in (torch.tensor([10]), torch.tensor([1, -1]), np.array([-2], dtype=np.int32),
                [1, 11]):
        with pytest.raises(ValueError, match="outside"):
            pool.free(bad)
    assert pool.available == 2
    pool.free(torch.cat([first[:1], first[3:], rest]))
    with pytest.raises(ValueError, match="overfills"):
        pool.free(torch.tensor([0]))
    assert pool.available == 10


def test_kv_pool_free_refuses_every_id_outside_and_keeps_its_state():
    pool = KVPool(8)
    taken = pool.alloc(6)
    for bad in (torch.tensor([-1]), np.array([3, -(2**63)]), torch.tensor([8]),
                np.array([2**62]), np.array([-1], dtype=np.int32), [9], np.array([1.5e9])):
        with pytest.raises(ValueError, match="outside"):
            pool.free(bad)
        assert pool.used == 6 and sorted(pool.free_slots().tolist()) == [6, 7]
    pool.free(np.array(taken[:2].tolist(), dtype=np.int32))  # other int types are fine
    assert pool.used == 4


class EagerKVPool:
    """A KV pool that holds every id from the start, on a stack with slot 0 on top: the
    reference for the order ``KVPool`` (which keeps only the ids it handed out) gives ids in.
    It trusts its input (no checks), which the tests below never get wrong."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.stack = list(range(capacity - 1, -1, -1))

    @property
    def available(self):
        return len(self.stack)

    @property
    def used(self):
        return self.capacity - len(self.stack)

    def alloc(self, n):
        if n > len(self.stack):
            return None
        taken = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return np.array(taken, dtype=np.int64)

    def free(self, slots):
        self.stack.extend(np.asarray(slots).tolist())

    def free_slots(self):
        return np.array(self.stack, dtype=np.int64)

    def _take_into(self, out):
        out[:] = self.alloc(len(out))

    _put_back = free


@pytest.mark.parametrize("capacity", [0, 1, 7, 300])
def test_kv_pool_hands_out_ids_in_the_order_of_a_full_stack(capacity):
    # Random allocations, frees (in random order, through every entry point) and listings:
    # the pool gives the ids, in the order, that a stack holding every id from the start
    # gives.
    rng = random.Random(capacity)
    pool, reference, held = KVPool(capacity, array_type="numpy"), EagerKVPool(capacity), []
    for _ in range(400):
        step = rng.random()
        if step < 0.45:
            n = rng.randint(0, max(1, capacity // 3))
            if rng.random() < 0.5 or n > pool.available:
                got, want = pool.alloc(n), reference.alloc(n)
                assert (got is None) == (want is None)
            else:
                got, want = np.empty(n, dtype=np.int64), reference.alloc(n)
                pool._take_into(got)
            if want is not None:
                assert got.tolist() == want.tolist()
                held += got.tolist()
        elif held:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            back, held = np.array(held[:n], dtype=np.int64), held[n:]
            (pool._put_back if step < 0.7 else pool.free)(back)
            reference.free(back)
        assert pool.used == reference.used and pool.available == reference.available
        assert pool.free_slots().tolist() == reference.free_slots().tolist()


def _tree_items(cache):
    """(key, slot ids) of every node, depth first in the tree's own child order."""
    items, stack = [], [cache.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node is not cache.root_node:
            items.append((np.asarray(node.key).tolist(),
                          np.asarray(node.stored_value).tolist()))
    return items


@pytest.mark.parametrize("capacity, page_size", [(300, 1), (1500, 1), (1500, 16), (6000, 4)])
@pytest.mark.parametrize("policy", ["lru", "lfu", "mru"])
def test_serve_over_kv_pool_matches_a_full_stack_pool(core, capacity, page_size, policy):
    # The same rows, and the same slot id in every node, as over a pool that allocates its
    # whole stack up front (the capacities evict: the pools go round many times).
    requests = small_chat(seed=capacity)
    runs = []
    for pool in (KVPool(capacity, array_type="numpy"), EagerKVPool(capacity)):
        cache = RadixCache(core=core, page_size=page_size, eviction_policy=policy,
                           array_type="numpy")
        result = serve(cache, requests, capacity, pool=pool)
        row = {k: v for k, v in dataclasses.asdict(result).items()
               if k not in ("seconds", "stats")}
        runs.append((row, _tree_items(cache), pool.free_slots().tolist()))
    assert runs[0][0]["evicted_tokens"] > 0 or capacity > 1500
    assert runs[0] == runs[1]


def test_kv_pool_memory_follows_use_not_capacity():
    # A 2G-slot pool (16 GB of ids were it allocated up front) over a small workload holds
    # a few slots' worth; frees (page 16 gives unaligned tails back) grow its stack with use.
    requests = small_chat()
    rows = []
    for capacity in (10**6, 2 * 10**9):
        tracemalloc.start()
        try:
            pool = KVPool(capacity, array_type="numpy")
            cache = RadixCache(page_size=16, array_type="numpy")
            result = serve(cache, requests, capacity, pool=pool)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 * 2**20, peak
        assert 0 < pool._free.nbytes <= 16 * max(pool._next, 1024)
        rows.append({k: v for k, v in dataclasses.asdict(result).items()
                     if k not in ("seconds", "stats", "capacity")})
    assert rows[0] == rows[1]  # nothing evicted at either size: the same replay


@pytest.mark.parametrize("make", [KVPool, HostPool])
def test_pool_capacity_beyond_what_a_machine_addresses_is_refused(make):
    for capacity in (MAX_POOL_SLOTS + 1, 2**63, 10**30, 10**99):
        with pytest.raises(ValueError, match="more slots than this machine can address"):
            make(capacity)
    largest = make(MAX_POOL_SLOTS, array_type="numpy")  # fine: it holds what it hands out
    first = largest.alloc(3).tolist()
    assert sorted(first) == [0, 1, 2] and largest.available == MAX_POOL_SLOTS - 3
    largest.free(np.array(first))
    with pytest.raises(ValueError, match="more slots than this machine can address"):
        serve(RadixCache(array_type="numpy"), small_chat()[:2], 10**30)


# -- put_slots: a pool's free-list push, in each core ------------------------------------------
@pytest.fixture
def torch_bound():
    """The cores' torch names bound (until then they take no tensor: nothing counts as one)."""
    from radixcache._torch import load_torch

    load_torch()


def _stack(top: int, size: int = 8) -> np.ndarray:
    stack = np.full(size, -7, dtype=np.int64)
    stack[:top] = np.arange(100, 100 + top)
    return stack


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_put_slots_pushes_ids_in_range(core, kind, torch_bound):
    put_slots = CORES[core].put_slots
    stack = _stack(2)
    ids = [5, 0, 7]
    slots = torch.tensor(ids) if kind == "tensor" else np.array(ids, dtype=np.int64)
    assert put_slots(stack, 2, slots, 8) == 3
    assert stack[:5].tolist() == [100, 101, 5, 0, 7]
    # Nothing to push: an empty array pushes 0; an empty tensor (no data pointer) may be
    # declined. Either way the stack is as it was.
    empty = put_slots(stack, 5, slots[:0], 8)
    assert empty == 0 if kind == "ndarray" else empty in (0, -1)
    assert stack[:5].tolist() == [100, 101, 5, 0, 7]


def test_put_slots_takes_ids_in_range_whose_bits_reach_past_the_bound(core):
    # 5 | 9 | 3 = 15 >= 10, yet every id is below 10; 9 | 10 = 11 with 10 outside.
    put_slots = CORES[core].put_slots
    stack = _stack(0, size=16)
    assert put_slots(stack, 0, np.array([5, 9, 3]), 10) == 3
    assert stack[:3].tolist() == [5, 9, 3]
    assert put_slots(stack, 3, np.array([9, 10]), 10) == -1
    assert put_slots(stack, 3, np.array([2**63 - 1]), 2**63 - 1) == -1

@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 64])
def test_put_slots_checks_every_position(core, n):
    # The compiled push reads the ids in blocks of eight, then one at a time: an id outside
    # is found wherever it is.
    put_slots = CORES[core].put_slots
    ids = np.random.default_rng(n).integers(0, 1000, size=n)
    stack = np.zeros(100, dtype=np.int64)
    assert put_slots(stack, 3, ids, 1000) == n and stack[3:3 + n].tolist() == ids.tolist()
    for at in range(n):
        for bad in (1000, -1):
            wrong = ids.copy()
            wrong[at] = bad
            assert put_slots(np.zeros(100, dtype=np.int64), 3, wrong, 1000) == -1

def _declined(put_slots, stack, top, slots, bound) -> None:
    kept = stack[:top].copy()
    assert put_slots(stack, top, slots, bound) == -1
    assert stack[:top].tolist() == kept.tolist()


@pytest.mark.parametrize("bad", [
    np.array([8]), np.array([1, -1]), np.array([2**63 - 1]), np.array([-(2**63)]),
    torch.tensor([3, 9]), torch.tensor([-5]),
], ids=lambda b: f"{type(b).__name__}{b.tolist()}")
def test_put_slots_declines_ids_outside(core, bad, torch_bound):
    _declined(CORES[core].put_slots, _stack(2), 2, bad, 8)


def test_put_slots_takes_an_int64_array_array_and_refuses_ints_past_int64(core):
    put_slots = CORES[core].put_slots
    stack = _stack(1)
    assert put_slots(stack, 1, array.array("q", [6, 0]), 8) == 2
    assert stack[:3].tolist() == [100, 6, 0]
    for top, bound in ((2**63, 8), (1, 2**63), (-(2**63) - 1, 8)):
        with pytest.raises(OverflowError):
            put_slots(stack, top, np.array([1]), bound)
    assert stack[:3].tolist() == [100, 6, 0]

def test_put_slots_declines_what_does_not_fit(core):
    put_slots = CORES[core].put_slots
    # top + n past the bound (a pool never holds more free ids than it has) ...
    _declined(put_slots, _stack(6, size=16), 6, np.array([1, 2, 3]), 8)
    # ... or past the stack's end.
    _declined(put_slots, _stack(6), 6, np.array([1, 2, 3]), 100)
    for top, bound in ((-1, 8), (0, -1)):
        _declined(put_slots, _stack(0), top, np.array([1]), bound)


def test_put_slots_declines_other_inputs(core, torch_bound):
    put_slots = CORES[core].put_slots
    base = np.arange(6, dtype=np.int64)
    others = [
        [1, 2], (1, 2), np.array([1, 2], dtype=np.int32), np.array([1, 2], dtype=">i8"),
        np.array([1.0, 2.0]), base.reshape(2, 3), base[::2],
        torch.tensor([1, 2], dtype=torch.int32),
        torch.arange(6)[::2], torch.arange(6).reshape(2, 3), torch.tensor([1, 2])._neg_view(),
        np.arange(2).view(type("Sub", (np.ndarray,), {})), None, "12",
        torch.tensor([1, 2], dtype=torch.bfloat16), torch.tensor([1.0, 2.0], requires_grad=True),
        torch.tensor([1, 2]).to_sparse(), torch._efficientzerotensor(2, dtype=torch.int64),
        array.array("i", [1, 2]), array.array("Q", [1, 2]),
    ]
    for other in others:
        _declined(put_slots, _stack(2), 2, other, 8)
    stack = _stack(2)
    for bad_stack in (stack.astype(np.int32), stack.reshape(2, 4), list(stack), stack[::2]):
        assert put_slots(bad_stack, 2, np.array([1]), 8) == -1
    frozen = _stack(2)
    frozen.flags.writeable = False
    _declined(put_slots, frozen, 2, np.array([1]), 8)


def test_put_slots_declines_under_a_torch_function_mode(core, torch_bound):
    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    put_slots, slots = CORES[core].put_slots, torch.tensor([1, 2])
    with Watch():
        _declined(put_slots, _stack(2), 2, slots, 8)
    assert put_slots(_stack(2), 2, slots, 8) == 2  # the same call without the mode


def test_put_slots_copies_ids_from_the_stack_itself(core):
    # Ids that are the stack's own memory (a view reaching into the entries written): the
    # push either copies their values as they were, or declines.
    stack = _stack(4)
    ids = stack[2:5]
    want = ids.copy()
    got = CORES[core].put_slots(stack, 3, ids, 1000)
    if got == -1:
        assert stack[:3].tolist() == [100, 101, 102]
    else:
        assert got == 3 and stack[3:6].tolist() == want.tolist()


_SLOT_KINDS = {
    "tensor": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "int64": lambda ids: np.array(ids, dtype=np.int64),
    "int32": lambda ids: np.array(ids, dtype=np.int32),
    "big-endian": lambda ids: np.array(ids, dtype=">i8"),
    "list": list,
    "array": lambda ids: array.array("q", ids),
    "strided tensor": lambda ids: torch.tensor([x for i in ids for x in (i, -1)],
                                               dtype=torch.int64)[::2],
}


@pytest.mark.parametrize("push", sorted(CORES) + ["none"])
@pytest.mark.parametrize("kind", sorted(_SLOT_KINDS))
@pytest.mark.parametrize("pool_kind", ["kv", "host"])
def test_pool_free_takes_every_input_kind(monkeypatch, pool_kind, kind, push, torch_bound):
    # Whichever path an input takes (a core's one-pass push, or the pool's checked numpy
    # path), the pool ends the same, and refuses the same bad input with the same error.
    from radixcache.workloads import pools

    monkeypatch.setattr(pools, "_put_slots", None if push == "none" else CORES[push].put_slots)
    make = _SLOT_KINDS[kind]
    pool = KVPool(12) if pool_kind == "kv" else HostPool(12)
    taken = pool.alloc(10).tolist()
    assert sorted(taken) == list(range(10))
    # Ids below the capacity that were never handed out are refused too: a free list that
    # took them would hand them out twice.
    for bad in ([taken[1], 12], [-1], [2**31 - 1], [10], [taken[0], 11]):
        with pytest.raises(ValueError, match=re.escape("slot ids outside [0, 10) (never "
                                                       "handed out)")):
            pool.free(make(bad))
        assert pool.used == 10
    pool.free(make([7, 2, 4]))
    pool.free(make([]))
    assert pool.used == 7
    if pool_kind == "kv":
        assert pool.free_slots().tolist() == [11, 10, 7, 2, 4]
        with pytest.raises(ValueError, match="overfills"):
            pool.free(make(list(range(8))))
    else:
        assert pool.alloc(3).tolist() == [7, 2, 4]  # freed slots first, latest on top
        with pytest.raises(ValueError, match="overfills"):
            pool.free(make(list(range(10)) + [0]))
    assert pool.used == (7 if pool_kind == "kv" else 10)


def test_put_slots_holds_no_ids_while_numpy_warns(core, torch_bound):
    # Exporting a stack that warns on writes (a broadcast array) runs Python code: a
    # warning hook that swaps the ids' storage must not leave the push reading freed memory.
    import warnings

    put_slots = CORES[core].put_slots
    stack, _ = np.broadcast_arrays(np.array(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
    slots = torch.tensor([3], dtype=torch.int64)
    swapped = []

    def swap_storage(*args, **kwargs):
        slots.set_(torch.tensor([5], dtype=torch.int64))
        swapped.append(True)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = swap_storage
        got = put_slots(stack, 0, slots, 8)
    # The ids as they are when read: the new storage's if the hook ran (numpy versions that
    # warn), else the old one's.
    assert got == 1 and stack.tolist() == ([5] if swapped else [3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert put_slots(stack, 0, slots, 8) in (-1, 1)  # a warning as an error: declined

# -- serve -------------------------------------------------------------------------------------
def test_serve_same_prompt_ten_times(core):
    prompt = np.arange(100, 400, dtype=np.int64)
    requests = [Request(prompt, 20) for _ in range(10)]
    cache = RadixCache(core=core)
    result, pool = checking_serve(cache, requests, 10_000)
    assert result.prompt_tokens == 3000 and result.cached_tokens == 2700
    assert result.hit_rate == pytest.approx(0.9)
    assert result.rejected == 0 and result.evicted_tokens == 0
    # Fresh outputs never match: the tree holds the prompt and ten distinct answers.
    assert cache.total_size() == result.peak_tokens == 300 + 10 * 20 == pool.used
    assert result.stats.hit_rate == result.hit_rate


def test_serve_page_alignment(core):
    page = 4
    prompt = np.arange(10, dtype=np.int64)  # 10 tokens: 8 cacheable
    requests = [Request(prompt, 3), Request(prompt, 3)]
    cache = RadixCache(page_size=page, core=core)
    result, pool = checking_serve(cache, requests, 100)
    # Request 1 caches 12 of its 13 tokens; request 2 matches the 8 aligned prompt tokens.
    assert result.cached_tokens == 8
    assert cache.total_size() == 12 + 4 == pool.used  # 2nd: 8 shared + 4 (2 prompt + 2 output)


def test_serve_reinserting_a_cached_output_frees_duplicate_slots(core):
    prompt = np.arange(50, dtype=np.int64)
    output = np.arange(1000, 1010, dtype=np.int64)
    requests = [Request(prompt, 10, output) for _ in range(3)]
    cache = RadixCache(core=core)
    result, pool = checking_serve(cache, requests, 200)
    assert cache.total_size() == 60 == pool.used
    assert result.cached_tokens == 100


def test_serve_rejects_requests_larger_than_the_pool(core):
    requests = [Request(np.arange(40, dtype=np.int64), 20), Request(np.arange(10), 5),
                Request(np.arange(100, 200), 10)]
    cache = RadixCache(core=core)
    result, pool = checking_serve(cache, requests, 50)
    assert result.rejected == 2 and result.requests == 3
    # The hopeless third request evicted nothing: the second one's entry is still cached.
    assert cache.total_size() == 15 == pool.used and result.evicted_tokens == 0
    assert result.stats.lookups == 3


def test_serve_evicts_under_pressure(core):
    requests = small_chat()
    capacity = 2000
    cache = RadixCache(core=core)
    result, pool = checking_serve(cache, requests, capacity)
    assert result.evicted_tokens > 0 and result.rejected == 0
    assert result.peak_tokens <= capacity
    ample = serve(RadixCache(core=core), requests, 10**6)
    assert ample.evicted_tokens == 0 and ample.hit_rate > result.hit_rate
    assert result.evicted_tokens == result.stats.evicted_tokens
    assert result.cached_tokens == result.stats.matched_tokens
    assert result.prompt_tokens == result.stats.queried_tokens
    assert result.seconds > 0


def test_serve_extra_keys_separate_namespaces(core):
    prompt = np.arange(64, dtype=np.int64)
    requests = [Request(prompt, 4, extra_key="a"), Request(prompt, 4, extra_key="b"),
                Request(prompt, 4, extra_key="a")]
    result, _ = checking_serve(RadixCache(core=core), requests, 1000)
    assert result.cached_tokens == 64


def test_serve_needs_an_empty_cache():
    cache = RadixCache()
    cache.insert([1, 2, 3])
    with pytest.raises(ValueError, match="empty cache"):
        serve(cache, [], 10)
    with pytest.raises(ValueError, match="pool"):
        serve(RadixCache(), [], 10, pool=KVPool(11))


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
def test_serve_results_agree_across_cores():
    requests = small_chat(seed=2)
    results = [serve(RadixCache(eviction_policy=policy, core=core), requests, 3000)
               for policy in ("lru", "lfu") for core in sorted(CORES)]
    fields = [(r.cached_tokens, r.evicted_tokens, r.peak_tokens, r.rejected) for r in results]
    assert fields[0] == fields[1] and fields[2] == fields[3]


# -- traces ------------------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("extra_id", [3, 10**6])  # small ids share one arange; huge ones not
def test_read_mooncake_blocks(tmp_path, extra_id):
    trace = write_lines(tmp_path / "mc.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 3,
                    "hash_ids": [0, 1, 2]}),
        "",
        json.dumps({"timestamp": 5, "input_length": 7, "output_length": 0, "hash_ids": [0, 5]}),
        json.dumps({"input_length": 8, "output_length": 1, "hash_ids": [6, 7]}),
        json.dumps({"input_length": 10, "output_length": 2, "hash_ids": [1, 2, 3]}),
        json.dumps({"input_length": 3, "output_length": 2, "hash_ids": [extra_id, 0]}),
    ])
    first, second, third, fourth, fifth = read_trace(trace, block_size=4)
    assert first.prompt.tolist() == list(range(10)) and first.output_len == 3
    assert first.output is None
    assert second.prompt.tolist() == [0, 1, 2, 3, 20, 21, 22] and second.output_len == 0
    assert third.prompt.tolist() == list(range(24, 32))
    assert fourth.prompt.tolist() == list(range(4, 14))
    assert fifth.prompt.tolist() == [4 * extra_id, 4 * extra_id + 1, 4 * extra_id + 2]
    assert len(read_trace(trace, block_size=4, limit=2)) == 2
    with pytest.raises(TraceError,
                       match=r"mc\.jsonl:1: input_length 10 needs 5 blocks of 2 tokens but "
                             r"hash_ids has 3"):
        read_trace(trace, block_size=2)


def test_read_token_trace(tmp_path):
    trace = write_lines(tmp_path / "tok.jsonl", [
        json.dumps({"prompt": [5, 6, 7], "output": [8, 9]}),
        json.dumps({"prompt": [5, 6], "output_length": 4, "extra_key": "lora-1"}),
        json.dumps({"prompt": [], "output": [1], "output_length": 1}),
    ])
    a, b, c = read_trace(trace)
    assert a.prompt.tolist() == [5, 6, 7] and a.output.tolist() == [8, 9] and a.output_len == 2
    assert b.output is None and b.output_len == 4 and b.extra_key == "lora-1"
    assert c.prompt.tolist() == [] and c.output_len == 1


@pytest.mark.parametrize("lines, problem", [
    (['{"prompt": [1, 2], "output_length": 1}', '{"prompt": [1, 2], "output_length": 1',
      '{"prompt": [3]}'], r":2: not valid JSON"),
    (['{"prompt": [1], "output_length": 1}', "[1, 2]"], r":2: expected a JSON object"),
    (['{"prompt": [1], "output_length": 1}', '{"prompt": [1]}'],
     r":2: missing field 'output' or 'output_length'"),
    (['{"prompt": [1, 2.5], "output_length": 1}'], r":1: 'prompt' holds 2.5"),
    (['{"prompt": [1, true], "output_length": 1}'], r":1: 'prompt' holds True"),
    (['{"prompt": [-3], "output_length": 1}'], r":1: 'prompt' holds -3"),
    (['{"prompt": [1], "output": [2], "output_length": 3}'], r":1: 'output_length' is 3"),
    (['{"prompt": [1], "output_length": -1}'], r":1: 'output_length' must be a non-negative"),
    (['{"prompt": "abc", "output_length": 1}'], r":1: 'prompt' must be a list"),
    (['{"prompt": [1], "output_length": 1, "extra_key": [1]}'], r":1: 'extra_key'"),
    (['', '{"hello": 1}'], r":2: unknown trace format"),
    (['{"hash_ids": [0], "input_length": 3, "output_length": 1}',
      '{"prompt": [1], "output_length": 1}'], r":2: missing field 'hash_ids'"),
    (['{"hash_ids": [0], "input_length": 3}'], r":1: missing field 'output_length'"),
    (['{"hash_ids": [0, -1], "input_length": 3, "output_length": 1}'],
     r":1: 'hash_ids' holds -1"),
    (['{"hash_ids": [0], "input_length": "3", "output_length": 1}'],
     r":1: 'input_length' must be a non-negative integer"),
    ([], r": no requests"),
    (['', '   '], r": no requests"),
])
def test_read_trace_errors_name_file_and_line(tmp_path, lines, problem):
    trace = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=r"bad\.jsonl" + problem):
        read_trace(trace)


def test_read_trace_rejects_bad_bytes_and_arguments(tmp_path):
    trace = tmp_path / "bytes.jsonl"
    trace.write_bytes(b'{"prompt": [1], "output_length": 1}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(TraceError, match=r"bytes\.jsonl:2: not valid JSON"):
        read_trace(trace)
    with pytest.raises(ValueError, match="block_size"):
        read_trace(trace, block_size=0)
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.jsonl")


@pytest.mark.skipif(MOONCAKE is None, reason=MOONCAKE_MISSING)
def test_read_real_mooncake_lines():
    requests = read_trace(MOONCAKE, limit=30)
    assert len(requests) == 30
    raw = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:30]]
    for req, row in zip(requests, raw):
        assert len(req.prompt) == row["input_length"] and req.output_len == row["output_length"]
        blocks = -(-row["input_length"] // 512)
        expected = (np.array(row["hash_ids"][:blocks])[:, None] * 512 + np.arange(512)).ravel()
        assert np.array_equal(req.prompt, expected[: row["input_length"]])


# -- the host tier -----------------------------------------------------------------------------
CONVERSATION, CONVERSATION_MISSING = mooncake_trace("conversation")
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


def host_cache(core, write_policy="write_back", **options):
    """A ``RadixCache`` with a host tier on ``core`` (skipped where the core has none yet)."""
    try:
        return RadixCache(core=core, host_tier=True, write_policy=write_policy, **options)
    except TypeError as exc:  # a compiled core built before it had the host tier
        if core != "c" or "positional argument" not in str(exc):
            raise
        pytest.skip(f"the compiled core of this build has no host tier ({exc})")


def host_slots(cache):
    """Every host slot id the tree holds."""
    slots = []
    stack = list(cache.root_node.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.host_value is not None:
            slots.append(node.host_value.numpy())
    return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)


def device_slots(cache):
    slots = []
    stack = list(cache.root_node.children)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.on_device:
            slots.append(node.stored_value.numpy())
    return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)


def checking_host_serve(cache, requests, capacity, host_capacity):
    """serve() with a host pool, checking after every request that both pools and the tree
    account for every slot (no leak, no double use)."""
    pool, host_pool = KVPool(capacity), HostPool(host_capacity)
    done = [0]

    def check(n):
        done[0] += n
        assert pool.used == cache.total_size()
        assert host_pool.used == cache.host_size()
        assert cache.protected_size() == 0
        if done[0] % 5 == 0 or done[0] == len(requests):
            held = np.concatenate([device_slots(cache), pool.free_slots()])
            assert np.array_equal(np.sort(held), np.arange(capacity))
            on_host = host_slots(cache)
            assert len(np.unique(on_host)) == len(on_host) == host_pool.used
            assert host_pool.used <= host_capacity

    result = serve(cache, requests, capacity, progress=check, pool=pool,
                   host_capacity=host_capacity, host_pool=host_pool)
    assert done[0] == len(requests)
    return result


def test_host_pool_alloc_and_free():
    pool = HostPool(10**15)  # memory follows the slots in use, not the capacity
    first = pool.alloc(4)
    assert first.dtype == torch.int64 and first.tolist() == [0, 1, 2, 3]
    assert pool.used == 4 and pool.available == 10**15 - 4
    pool.free(first[1:3])
    assert pool.used == 2
    again = pool.alloc(3)
    assert sorted(again.tolist()) == [1, 2, 4]  # freed slots first, then new ones
    with pytest.raises(ValueError, match="never handed out"):
        pool.free(torch.tensor([5]))
    small = HostPool(3)
    assert small.alloc(4) is None and small.used == 0
    taken = small.alloc(3)
    assert small.alloc(1) is None
    small.free(taken)
    with pytest.raises(ValueError, match="overfills"):
        small.free(taken[:1])
    assert small.available == 3 and small.alloc(0).numel() == 0
    with pytest.raises(ValueError, match=">= 0"):
        HostPool(-1)
    with pytest.raises(TypeError, match="int"):
        HostPool(2.5)
    with pytest.raises(ValueError, match="cannot allocate"):
        small.alloc(-1)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_host_capacity_zero_equals_one_tier(core, write_policy):
    requests = small_chat(seed=3)
    plain = serve(RadixCache(core=core), requests, 2000)
    tiered = checking_host_serve(host_cache(core, write_policy), requests, 2000, 0)
    assert (tiered.cached_tokens, tiered.evicted_tokens, tiered.peak_tokens, tiered.rejected,
            tiered.prompt_tokens) == (plain.cached_tokens, plain.evicted_tokens,
                                      plain.peak_tokens, plain.rejected, plain.prompt_tokens)
    assert plain.evicted_tokens > 0  # the pool was short: eviction ran
    assert tiered.host_cached_tokens == tiered.loaded_tokens == tiered.backed_up_tokens == 0
    assert tiered.hit_rate == tiered.device_hit_rate == plain.hit_rate
    assert tiered.host_hit_rate == 0.0 and tiered.host_capacity == 0
    # No host tier at all: the one-tier result, with the host fields zero.
    assert plain.host_capacity == plain.host_cached_tokens == plain.loaded_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_unlimited_host_reaches_the_reuse_ceiling(core, write_policy, page_size):
    requests = small_chat(seed=4)
    ceiling = serve(RadixCache(core=core, page_size=page_size), requests, 10**6)
    assert ceiling.evicted_tokens == 0
    device_only = serve(RadixCache(core=core, page_size=page_size), requests, 1500)
    result = checking_host_serve(host_cache(core, write_policy, page_size=page_size),
                                 requests, 1500, 10**9)
    assert device_only.hit_rate < ceiling.hit_rate
    assert result.cached_tokens == ceiling.cached_tokens  # exactly the ceiling
    assert result.hit_rate == ceiling.hit_rate
    assert result.host_cached_tokens > 0 and result.loaded_tokens == result.host_cached_tokens
    assert result.device_hit_rate + result.host_hit_rate == pytest.approx(result.hit_rate)
    assert result.backed_up_tokens > 0 and result.host_evicted_tokens == 0
    assert result.rejected == 0


def test_finite_host_lies_between_device_only_and_the_ceiling(core):
    requests = small_chat(seed=5)
    ceiling = serve(RadixCache(core=core), requests, 10**6).cached_tokens
    device_only = serve(RadixCache(core=core), requests, 1500).cached_tokens
    for write_policy in WRITE_POLICIES:
        # Write-through copies what is on the device too: the host needs more room than the
        # device to hold anything else, so it gets twice as much here.
        result = checking_host_serve(host_cache(core, write_policy), requests, 1500, 3000)
        assert device_only < result.cached_tokens < ceiling, write_policy
        if write_policy != "write_through_selective":
            assert result.host_evicted_tokens > 0  # the host filled up and was evicted
    # A host no larger than the device holds only copies of the device under write-through.
    mirror = serve(host_cache(core, "write_through"), requests, 1500, host_capacity=1500)
    assert mirror.cached_tokens == device_only and mirror.host_cached_tokens == 0
    # Selective write-through copies only what was hit twice: below the unlimited ceiling.
    selective = checking_host_serve(host_cache(core, "write_through_selective"), requests,
                                    1500, 10**9)
    assert device_only < selective.cached_tokens < ceiling


def test_write_back_makes_room_for_a_victim_larger_than_the_shortfall(core):
    # Device 100, host 100, page 1. A (30), B (30), C (60) tokens, then D (60): D is short
    # of 50 slots, so B (30) and C (60) leave the device. The host holds A (30): the room
    # made first must cover C whole (a shortfall of 50 is not enough), so A goes and both
    # copies fit; C is not dropped.
    a, b, c, d = (np.arange(n) + 1000 * i for i, n in enumerate((30, 30, 60, 60), 1))
    cache = host_cache(core)
    loop = ServingLoop(cache, 100, host_capacity=100)
    for prompt in (a, b, c, d):
        loop.finish(loop.admit(Request(prompt, 0)))
    assert loop.backed_up_tokens == 30 + 30 + 60 and loop.host_evicted_tokens == 30
    assert cache.host_size() == 90 and cache.total_size() == 60
    assert cache.match_prefix(c).host_length == 60
    assert cache.match_prefix(b).host_length == 30 and cache.match_prefix(a).host_length == 0
    result = loop.result()
    assert result.host_capacity == 100 and result.host_evicted_tokens == 30


def test_a_victim_held_by_host_only_children_does_not_reject_a_request(core):
    # A tiny host: some device victims get no copy, and those with host-only children stay on
    # the device; the loop frees host memory and evicts again instead of rejecting.
    requests = small_chat(seed=5)
    assert serve(RadixCache(core=core), requests, 800).rejected == 0
    for write_policy in WRITE_POLICIES:
        result = checking_host_serve(host_cache(core, write_policy), requests, 800, 200)
        assert result.rejected == 0, write_policy


def test_host_tier_needs_a_host_cache_and_good_arguments(core):
    with pytest.raises(ValueError, match="host tier"):
        serve(RadixCache(core=core), [], 10, host_capacity=10)
    with pytest.raises(ValueError, match=">= 0"):
        serve(host_cache(core), [], 10, host_capacity=-1)
    with pytest.raises(TypeError, match="int"):
        serve(host_cache(core), [], 10, host_capacity="10")
    with pytest.raises(ValueError, match="host_pool"):
        serve(host_cache(core), [], 10, host_capacity=10, host_pool=HostPool(11))
    with pytest.raises(ValueError, match="host_pool needs"):
        serve(host_cache(core), [], 10, host_pool=HostPool(10))


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
def test_host_tier_results_agree_across_cores():
    requests = small_chat(seed=6)
    results = []
    for core in sorted(CORES):
        for write_policy in WRITE_POLICIES:
            result = serve(host_cache(core, write_policy), requests, 1500, host_capacity=2000)
            results.append((core, write_policy, result.cached_tokens,
                            result.host_cached_tokens, result.backed_up_tokens,
                            result.evicted_tokens, result.host_evicted_tokens))
    per_core = {}
    for core, *fields in results:
        per_core.setdefault(core, []).append(fields)
    assert len({repr(v) for v in per_core.values()}) == 1


@pytest.mark.skipif(CONVERSATION is None, reason=CONVERSATION_MISSING)
def test_unlimited_host_reaches_the_ceiling_on_the_mooncake_conversation_trace(core):
    requests = read_trace(CONVERSATION, limit=1500)
    ceiling = serve(RadixCache(core=core, page_size=16), requests, 10**9)
    capacity = 300_000
    device_only = serve(RadixCache(core=core, page_size=16), requests, capacity)
    result = serve(host_cache(core, page_size=16), requests, capacity, host_capacity=10**9)
    assert device_only.hit_rate < ceiling.hit_rate
    assert result.cached_tokens == ceiling.cached_tokens
    assert result.rejected == ceiling.rejected == 0

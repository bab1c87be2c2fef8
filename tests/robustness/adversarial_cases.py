"""Adversarial cases for the tree cores: user code (``__index__``, ``__hash__``/``__eq__``, torch
hooks, finalizers, other threads) that runs inside a cache call, grouped by the rule it tests
(the list in ``test_adversarial.py``). Each case is a function of the core under test, run alone
in a subprocess by ``test_adversarial.py``.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import tracemalloc
import weakref

import numpy as np
import torch

from radixcache import RadixCache
from conftest import check_invariants, core_of
from adversarial_support import (REENTERED, build_chain, case, consistent,
                                 contents, only_reentry_errors, outcome, same_as_pure)


# -- 1: token conversion -------------------------------------------------------------------


@case
def r1_index_clears_list(core_name):
    class Evil:
        def __init__(self, tokens): self.tokens = tokens
        def __index__(self): self.tokens.clear(); return 5

    def run(core):
        cache = RadixCache(core=core)
        tokens = list(range(100_000)); tokens[10] = Evil(tokens)
        prefix = cache.insert(tokens).prefix_len
        tokens = list(range(50)); tokens[3] = Evil(tokens)
        found = cache.match_prefix(tokens).length, cache.exists(tokens)
        check_invariants(cache)
        return prefix, found, contents(cache)
    same_as_pure(run, core_name)


@case
def r1_index_appends_and_replaces(core_name):
    class Grow:
        def __init__(self, tokens): self.tokens = tokens
        def __index__(self):
            self.tokens.extend(range(200_000))   # reallocates the item array
            self.tokens[20] = 777                # and replaces an item not read yet
            return 6

    def run(core):
        cache = RadixCache(core=core)
        tokens = list(range(1000)); tokens[5] = Grow(tokens)
        cache.insert(tokens)
        tokens = list(range(1000)); tokens[7] = Grow(tokens)
        result = cache.match_prefix(tokens).length
        tokens = tuple(Grow([]) if i == 9 else i for i in range(30))
        cache.insert(tokens, extra_key="t")
        check_invariants(cache)
        return result, contents(cache)
    same_as_pure(run, core_name)


@case
def r1_other_thread_mutates_list(core_name):
    class Slow:
        def __init__(self, tokens, go, done): self.tokens, self.go, self.done = tokens, go, done
        def __index__(self):
            self.go.set()                # let the other thread at the list...
            self.done.wait(5)            # ...and wait until it has emptied it
            return 11

    def run(core):
        cache = RadixCache(core=core)
        results = []
        for call in ("insert", "match_prefix", "exists"):
            go, done = threading.Event(), threading.Event()
            tokens = list(range(20_000))
            tokens[100] = Slow(tokens, go, done)
            def mutate():
                go.wait(5)
                tokens.clear(); tokens.extend([-1] * 50_000); tokens.clear()
                done.set()
            thread = threading.Thread(target=mutate); thread.start()
            result = getattr(cache, call)(tokens)
            thread.join()
            results.append(result if call == "exists" else
                           getattr(result, "prefix_len", getattr(result, "length", None)))
        check_invariants(cache)
        return results, contents(cache)
    same_as_pure(run, core_name)


@case
def r1_index_reenters_or_fails(core_name):
    class Reenter:
        def __init__(self): self.cache = None
        def __index__(self):
            self.cache.insert([1, 2, 3])
            return 4

    class Bad:
        def __index__(self): return 2**70

    def run(core):
        cache = RadixCache(core=core)
        cache.insert([9, 9])
        item = Reenter(); item.cache = cache
        outcomes = [outcome(lambda: cache.insert([1, item, 5]).prefix_len),
                    outcome(lambda: cache.match_prefix([9, item]).length),
                    outcome(lambda: cache.insert([1, 2, Bad()]).prefix_len),
                    outcome(lambda: cache.insert([1, 2, 2**70]).prefix_len),
                    outcome(lambda: cache.insert([1, 2, "x"]).prefix_len)]
        assert outcomes[0] == ("RuntimeError", True), outcomes
        consistent(cache)
        return outcomes, contents(cache)
    same_as_pure(run, core_name)


@case
def r1_split_at_index_reenters_or_fails(core_name):
    # insert's split_at and split_priority are read (``__index__``) before the tree changes:
    # a conversion that calls the cache gets the re-entry error, one that raises leaves the
    # cache as it was, one that clears the tokens comes after they were read.
    class Reenter(int):  # an int subclass: converted (int()) by cache.py's checks
        def __new__(cls, cache, action):
            self = super().__new__(cls, 2)
            self.cache, self.action = cache, action
            return self
        def __int__(self):
            self.action(self.cache)
            return 2
        __index__ = __int__

    class Fails(int):
        def __int__(self): raise ZeroDivisionError("no index")
        __index__ = __int__

    def run(core):
        cache = RadixCache(page_size=2, core=core)
        cache.insert([1, 2, 3, 4], split_at=2)
        before = contents(cache)
        tokens = [1, 2, 3, 4, 5, 6]
        actions = [lambda c: c.insert([7, 8, 9, 9]), lambda c: c.reset(),
                   lambda c: c.evict(100), lambda c: tokens.clear()]
        outcomes = []
        for action in actions:
            outcomes.append(outcome(lambda: cache.insert(
                tokens, split_at=Reenter(cache, action)).prefix_len))
            outcomes.append(outcome(lambda: cache.insert(
                tokens, split_at=2, split_priority=Reenter(cache, action)).prefix_len))
            if len(outcomes) == 6:  # the calls back in: each refused, nothing changed
                assert outcomes == [("RuntimeError", True)] * 6, outcomes
                assert contents(cache) == before
        outcomes.append(outcome(lambda: cache.insert([1, 2, 7, 7], split_at=Fails(2))))
        assert outcomes[-1] == ("ZeroDivisionError", False), outcomes
        assert not cache.exists([1, 2, 7, 7])
        consistent(cache)
        return outcomes, contents(cache)
    same_as_pure(run, core_name)


# -- 2: namespace lookup -------------------------------------------------------------------


@case
def r2_hash_or_eq_resets(core_name):
    class Key:
        cache = None
        armed = False
        def __init__(self, name): self.name = name
        def __hash__(self):
            if Key.armed and Key.cache is not None:
                Key.cache.reset()
            return 42                    # every Key collides: __eq__ runs on lookups
        def __eq__(self, other):
            if Key.armed and Key.cache is not None:
                Key.cache.reset()
            return isinstance(other, Key) and other.name == self.name
        def __repr__(self): return f"Key({self.name})"

    def run(core):
        cache = RadixCache(core=core)
        Key.cache, Key.armed = cache, False
        a, b = Key("a"), Key("b")
        cache.insert([1, 2, 3, 4], extra_key=a)
        cache.insert([1, 2, 5, 6], extra_key=a)
        Key.armed = True
        outcomes = [outcome(lambda: cache.match_prefix([1, 2, 3, 9], extra_key=b).length),
                    outcome(lambda: cache.exists([1, 2, 3, 4], extra_key=b)),
                    outcome(lambda: cache.insert([1, 2, 7], extra_key=b).prefix_len)]
        Key.armed = False
        assert all(o == ("RuntimeError", True) for o in outcomes), outcomes
        consistent(cache)
        return outcomes, contents(cache)
    same_as_pure(run, core_name)


@case
def r2_nested_insert_cannot_merge_tenants(core_name):
    class Tenant:
        calls = 0
        arm_at = -1
        nested = None                    # (cache, key, tokens) to insert from inside __hash__
        def __init__(self, name): self.name = name
        def __hash__(self):
            Tenant.calls += 1
            if Tenant.calls == Tenant.arm_at and Tenant.nested is not None:
                cache, key, tokens = Tenant.nested
                Tenant.nested = None
                cache.insert(tokens, extra_key=key)
            return hash(self.name)
        def __eq__(self, other): return isinstance(other, Tenant) and other.name == self.name
        def __repr__(self): return f"Tenant({self.name})"

    def run(core):
        cache = RadixCache(core=core)
        secret = [7, 7, 7, 7]
        results = []
        # Two new tenants per round; b's insert runs inside one of the hashes of a's insert
        # (cache.py's check, the namespace lookup, the namespace store, ...).
        for arm_at in range(1, 6):
            a, b = Tenant(f"a{arm_at}"), Tenant(f"b{arm_at}")
            Tenant.calls, Tenant.arm_at, Tenant.nested = 0, arm_at, (cache, b, secret)
            results.append(outcome(lambda: cache.insert([5, 5, 5], extra_key=a).prefix_len))
            Tenant.nested = None
            cache.insert(secret, extra_key=b)
            # a tenant never sees another's prefix
            results.append((cache.match_prefix(secret, extra_key=a).length,
                            cache.match_prefix([5, 5, 5], extra_key=b).length,
                            cache.match_prefix(secret, extra_key=b).length))
            assert results[-1] == (0, 0, 4), results
        consistent(cache)
        return results, contents(cache)
    same_as_pure(run, core_name)


@case
def r2_namespace_ids_never_reused(core_name):
    def run(core):
        cache = RadixCache(core=core)
        seen = []
        for round in range(3):
            for i in range(50):
                cache.insert([round, i, 1, 2], extra_key=f"k{round}-{i}")
            # every earlier tenant's namespace is gone; none may see a newer one's nodes
            for i in range(50):
                for old in range(round):
                    seen.append(cache.match_prefix([round, i, 1, 2],
                                                   extra_key=f"k{old}-{i}").length)
            if round == 1:
                cache.reset()
            else:
                cache.evict(10**9)
            assert cache.node_count() == 0
        assert not any(seen), seen
        cache.insert([1, 2], extra_key="x")
        cache.evict(10)
        cache.insert([1, 2], extra_key="y")
        assert cache.match_prefix([1, 2], extra_key="x").length == 0
        assert cache.match_prefix([1, 2], extra_key="y").length == 2
        consistent(cache)
        return contents(cache)
    same_as_pure(run, core_name)


# -- 3: split with device values -----------------------------------------------------------
# One scenario, several actions: a torch function mode's hook acts on the cache (reset,
# evict, insert, match) in the middle of a call that touches device values.


def _r3_torch_mode_acts(core_name, actions):
    from torch.overrides import TorchFunctionMode

    def attempt(core, action):
        cache = RadixCache(core=core)
        cache.insert([1, 2, 3, 4], torch.arange(4, device="meta"))
        cache.insert([1, 2, 3, 4, 5, 6], torch.arange(6, device="meta"))
        class Hook(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                action(cache)
                return func(*args, **(kwargs or {}))
        results = []
        with Hook():
            results.append(outcome(lambda: cache.match_prefix([1, 2, 9]).length))
            results.append(outcome(lambda: cache.insert([1, 2, 3, 8],
                                                        torch.arange(4, device="meta")).prefix_len))
        for kind, value in results:  # the hook may also reset between the core's calls
            assert (kind, value) in {("ok", 0), ("ok", 2), ("ok", 3),
                                     ("RuntimeError", True)}, results
        consistent(cache)
        only_reentry_errors()

    for action in actions:
        attempt(core_name, action)


@case
def r3_torch_mode_resets(core_name):
    _r3_torch_mode_acts(core_name, (lambda c: c.reset(),))


@case
def r3_torch_mode_evicts_or_inserts(core_name):
    _r3_torch_mode_acts(core_name, (lambda c: c.evict(100), lambda c: c.insert([1, 2, 3, 7]),
                                    lambda c: c.match_prefix([1, 2])))


@case
def r3_value_finalizer_during_split(core_name):
    # A split that slices a node's device value drops the old tensor: its finalizer then
    # runs between reading the parent's slot and writing it.
    for action in ("reset", "evict", "insert"):
        cache = RadixCache(core=core_name)
        cache.insert([1, 2, 3, 4, 5, 6], torch.arange(6, device="meta"))
        cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.arange(8, device="meta"))
        for node, _ in list(core_of(cache).tree.iter_nodes()):
            if node.parent is not None:
                # On the tensor the node keeps (value is a new view of it: its base).
                assert node.value._base is not None
                weakref.finalize(node.value._base, {
                    "reset": cache.reset, "evict": lambda: cache.evict(100),
                    "insert": lambda: cache.insert([1, 2, 9])}[action])
        del node
        kind, value = outcome(lambda: cache.match_prefix([1, 2, 3, 9]).length)
        assert (kind, value) in {("ok", 3), ("RuntimeError", True)}, (kind, value)
        kind, value = outcome(lambda: cache.insert([1, 2, 3, 4, 5, 6, 7, 0],
                                                   torch.arange(8, device="meta")).prefix_len)
        assert kind == "ok" or (kind, value) == ("RuntimeError", True), (kind, value)
        gc.collect()
        consistent(cache)
        only_reentry_errors()


def _r3_finalizers_during(core_name, page_size, actions, call):
    """Cache calls ``call(cache, rng, step, device)`` with finalizers armed at every
    allocation (a reference cycle whose ``__del__`` runs one of ``actions`` on the cache):
    each call succeeds or gets the re-entry error, and the cache stays consistent."""
    class Trap:
        # A reference cycle with a finalizer that changes the cache: collected at some
        # allocation inside a cache call.
        cache = None
        def __init__(self, action): self.me, self.action = self, action
        def __del__(self):
            if Trap.cache is not None:
                self.action(Trap.cache)

    for device in ("meta", "cpu"):
        cache = RadixCache(page_size=page_size, core=core_name)
        Trap.cache = cache
        gc.set_threshold(1, 1, 1)
        rng = np.random.default_rng(0)
        for step in range(600):
            for _ in range(3):
                Trap(actions[step % len(actions)])
            kind, value = outcome(lambda: call(cache, rng, step, device))
            assert kind == "ok" or (kind == "RuntimeError" and value), (kind, value)
        gc.set_threshold(700, 10, 10)
        Trap.cache = None
        gc.collect()
        consistent(cache)
        only_reentry_errors()


@case
def r3_finalizers_during_splits(core_name):
    def call(cache, rng, step, device):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
        kv = torch.arange(len(tokens), device=device)
        return cache.insert(tokens, kv) if step % 2 else cache.match_prefix(tokens)

    _r3_finalizers_during(core_name, 1, [
        lambda c: c.reset(), lambda c: c.evict(3), lambda c: c.insert([5, 6, 7]),
        lambda c: c.match_prefix([1, 2, 3])], call)


@case
def r3_finalizers_during_prefix_splits(core_name):
    # insert's split_at splits a node after the sequence is in: the split allocates, so a
    # collection runs finalizers there, which call the cache (the re-entry error) while the
    # call still has the prefix's path to stamp.
    def call(cache, rng, step, device):
        tokens = rng.integers(0, 3, size=int(rng.integers(2, 16))).tolist()
        aligned = len(tokens) - len(tokens) % 2
        split_at = int(rng.integers(0, aligned // 2 + 1)) * 2
        kv = torch.arange(len(tokens), device=device)
        return cache.insert(tokens, kv, split_at=split_at, split_priority=step)

    _r3_finalizers_during(core_name, 2, [
        lambda c: c.reset(), lambda c: c.evict(3), lambda c: c.insert([5, 6, 7, 8]),
        lambda c: c.match_prefix([1, 2, 0, 0])], call)


@case
def r3_two_threads_on_device_values(core_name):
    class Yield:
        # hashing lets the other thread run in the middle of a call
        def __init__(self, name): self.name = name
        def __hash__(self): time.sleep(0); return hash(self.name)
        def __eq__(self, other): time.sleep(0); return getattr(other, "name", None) == self.name

    cache = RadixCache(core=core_name)
    keys = [None, Yield("a"), Yield("b")]
    errors, failures = [], []
    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for step in range(1500):
                tokens = rng.integers(0, 4, size=int(rng.integers(1, 10))).tolist()
                key = keys[step % 3]
                try:
                    if step % 3 == 0:
                        cache.insert(tokens, torch.arange(len(tokens), device="meta"),
                                     extra_key=key)
                    elif step % 3 == 1:
                        cache.match_prefix(tokens, extra_key=key)
                    else:
                        cache.evict(2)
                except RuntimeError as exc:
                    assert REENTERED in str(exc), exc
                    errors.append(exc)
        except BaseException as exc:
            failures.append(exc)
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(2)]
    sys.setswitchinterval(1e-6)
    for t in threads: t.start()
    for t in threads: t.join()
    assert not failures, failures
    consistent(cache)


# -- 4: borrowed token buffers -------------------------------------------------------------
# One scenario, two triggers: the key's __hash__ resizes the caller's array (grow: moved
# and freed; shrink) or writes it, in the middle of the call.


def _r4_hash_acts_on_tokens(core_name, modes):
    class Key:
        # Acts on the second hash of a call (the first is cache.py's argument check), once.
        arr = None
        mode = None
        calls = 0
        def __hash__(self):
            Key.calls += 1
            if Key.arr is not None and Key.calls == 2:
                if Key.mode == "grow":
                    Key.arr.resize(1_000_000, refcheck=False)   # moves and frees the data
                elif Key.mode == "shrink":
                    Key.arr.resize(10, refcheck=False)
                else:
                    Key.arr[:] = 3
            return 1
        def __eq__(self, other): return isinstance(other, Key)
        def __repr__(self): return "Key"

    def run(core):
        results = []
        for mode in modes:
            cache = RadixCache(core=core)
            key = Key()
            Key.arr = None
            base = np.arange(100_000, dtype=np.int64)
            cache.insert(base, extra_key=key)
            cache.insert(base[:5000] * 2, extra_key=key)
            for call in ("insert", "match_prefix", "exists"):
                arr = np.arange(100_000, dtype=np.int64)
                arr[60_000] = -1
                Key.arr, Key.mode, Key.calls = arr, mode, 0
                result = getattr(cache, call)(arr, extra_key=key)
                Key.arr = None
                results.append(result if call == "exists" else
                               getattr(result, "prefix_len", getattr(result, "length", None)))
            check_invariants(cache)
            results.append(contents(cache))
        return results
    same_as_pure(run, core_name)


@case
def r4_hash_resizes_tokens(core_name):
    _r4_hash_acts_on_tokens(core_name, ("grow", "shrink"))


@case
def r4_hash_writes_tokens(core_name):
    _r4_hash_acts_on_tokens(core_name, ("write",))


@case
def r4_finalizer_resizes_tokens_mid_walk(core_name):
    class Trap:
        arr = None
        def __init__(self): self.me = self
        def __del__(self):
            if Trap.arr is not None:
                Trap.arr.resize(4, refcheck=False)
                Trap.arr = None

    cache = RadixCache(core=core_name)
    base = np.arange(50_000, dtype=np.int64)
    cache.insert(base)
    gc.set_threshold(1, 1, 1)
    for step in range(300):
        arr = base.copy()
        arr[1000 + step] = -5                     # diverges inside the node: a split
        for _ in range(3):
            Trap()
        Trap.arr = arr
        if step % 2:
            cache.insert(arr)
        else:
            cache.match_prefix(arr)
        Trap.arr = None
    gc.set_threshold(700, 10, 10)
    gc.collect()
    consistent(cache)


# -- 5: garbage collection of cycles through nodes -----------------------------------------


@case
def r5_request_keys_holding_nodes_are_collected(core_name):
    class RequestKey:
        def __init__(self, i):
            self.i = i
            self.payload = bytearray(100_000)
            self.node = None
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, RequestKey) and other.i == self.i

    cache = RadixCache(core=core_name)
    alive = []
    for i in range(300):
        key = RequestKey(i)
        key.node = cache.insert([1, 2, 3, i], extra_key=key).last_node   # key -> node -> key
        cache.match_prefix([1, 2, 9], extra_key=key)                      # a split: deeper node
        key.cache = cache if i % 2 else None                              # key -> cache -> key
        alive.append(weakref.ref(key))
        del key
    cache.evict(10**9)
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0
    cache_ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert cache_ref() is None


@case
def r5_cache_in_a_cycle_through_deep_nodes(core_name):
    class Holder:
        def __init__(self): self.cache = None
        def __hash__(self): return 7
        def __eq__(self, other): return self is other

    refs = []
    for depth in (1, 3, 50):
        holder = Holder()
        cache = RadixCache(core=core_name)
        holder.cache = cache
        build_chain(cache, depth, extra_key=holder)   # the deepest node holds the cache too
        cache.insert(list(range(depth)) + [99], torch.arange(depth + 1, device="meta"),
                     extra_key=holder)
        refs.append(weakref.ref(holder))
        del holder, cache
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


# -- 6: teardown when the collector frees a deep tree --------------------------------------


@case
def r6_deep_chain_in_a_cycle_collected(core_name):
    class Probe:
        pass

    depth = 100_000 if core_name == "c" else 20_000
    cache = RadixCache(core=core_name)
    probe = Probe()
    key = ("tenant", core_of(cache).tree, probe)   # tree -> nodes -> key -> tree
    build_chain(cache, depth, extra_key=key)
    probe_ref = weakref.ref(probe)
    del cache, key, probe
    assert probe_ref() is not None         # kept by the cycle...
    gc.collect()
    assert probe_ref() is None             # ...until the collector frees the deep tree
    print("collected", depth)


@case
def r6_key_holds_the_tree(core_name):
    # tree -> namespace table -> key -> tree: the tree is the oldest object of the cycle, so
    # the collector clears it first; in a thread with a 1 MiB stack, and in the main thread.
    class Key:
        def __init__(self): self.tree = None
        def __hash__(self): return 3
        def __eq__(self, other): return self is other

    def build_and_drop(depth):
        cache = RadixCache(core=core_name)
        key = Key()
        key.tree = core_of(cache).tree
        build_chain(cache, depth, extra_key=key)
        ref = weakref.ref(key)
        del cache, key
        gc.collect()
        assert ref() is None

    failures = []
    def in_thread():
        try:
            build_and_drop(20_000)
        except BaseException as exc:
            failures.append(exc)
    threading.stack_size(1 << 20)
    thread = threading.Thread(target=in_thread)
    thread.start(); thread.join()
    assert not failures, failures
    build_and_drop(100_000 if core_name == "c" else 20_000)


@case
def r6_saved_exception_holds_evict_frame(core_name):
    depth = 100_000 if core_name == "c" else 20_000
    saved = []
    cache = RadixCache(core=core_name)
    _deepest = build_chain(cache, depth)  # a node held while the cache is dropped
    cache.saved = saved
    def free(indices):
        raise ValueError("pool is closed")
    try:
        cache.evict(1, free)
    except ValueError as exc:
        saved.append(exc)                  # traceback -> evict frame -> cache -> saved
    del cache
    gc.collect()
    assert not gc.garbage
    print("collected")


@case
def r6_small_thread_stack(core_name):
    depth = 20_000
    threading.stack_size(1 << 20)
    failures = []
    def work():
        try:
            for how in ("cycle", "tree cycle", "reset", "drop"):
                cache = RadixCache(core=core_name)
                cache_ref = weakref.ref(cache)
                if how == "cycle":
                    build_chain(cache, depth)
                    cache.me = cache
                elif how == "tree cycle":
                    build_chain(cache, depth, extra_key=(core_of(cache).tree,))
                else:
                    deepest = build_chain(cache, depth)
                if how == "reset":
                    cache.reset()
                    assert cache.node_count() == 0 and deepest.evicted
                del cache
                gc.collect()
                assert cache_ref() is None
        except BaseException as exc:
            failures.append(exc)
    thread = threading.Thread(target=work)
    thread.start(); thread.join()
    assert not failures, failures


# -- 7: heap updates and finalizers --------------------------------------------------------


@case
def r7_finalizers_reenter_during_reset_and_clear(core_name):
    class Key:
        cache = None
        def __init__(self, i): self.i = i
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.cache is not None:
                Key.cache.insert([self.i, 1], extra_key=None)
                Key.cache.evict(1)

    cache = RadixCache(core=core_name)
    for _round in range(3):
        probes = [Key(i) for i in range(300)]
        for i in range(300):
            cache.insert([i, 2, 3], extra_key=Key(i))      # only the tree holds each key
        for i in range(0, 300, 3):
            leaf = cache.match_prefix([i, 2, 3], extra_key=probes[i]).last_node
            cache.inc_lock_ref(leaf); cache.dec_lock_ref(leaf)    # more heap entries
        del leaf, probes
        Key.cache = cache
        cache.reset()                  # the keys' finalizers run inside reset
        Key.cache = None
        check_invariants(cache)
    gc.collect()
    consistent(cache)
    only_reentry_errors()


@case
def r7_duplicate_entries_and_finalizers_during_evict(core_name):
    # Leaves with several identical heap entries; their keys are cyclic garbage once the leaf
    # goes, so the collector runs their finalizer at some allocation inside a later evict
    # (between popping a victim and removing it, say), and the finalizer evicts too.
    class Key:
        cache = None
        def __init__(self, i): self.i, self.me = i, self
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.cache is not None:
                Key.cache.evict(1, lambda value: None)

    for policy in ("lru", "mru", "lfu"):
        cache = RadixCache(core=core_name, eviction_policy=policy)
        for i in range(200):
            leaf = cache.insert([i, 5], extra_key=Key(i)).last_node
            for _ in range(8):                   # identical duplicate heap entries
                cache.inc_lock_ref(leaf); cache.dec_lock_ref(leaf)
            del leaf
        Key.cache = cache
        gc.set_threshold(1, 1, 1)
        freed = 0
        for _ in range(200):                     # must never raise "not an attached leaf"
            freed += cache.evict(2, lambda value: value.sum())
        gc.set_threshold(700, 10, 10)
        Key.cache = None
        gc.collect()
        assert cache.node_count() == 0 and freed > 0
        consistent(cache)
        only_reentry_errors()


@case
def r7_compaction_drops_last_references(core_name):
    # MRU re-pushes a leaf on every touch; the old entries outlive the evicted leaf, so the
    # heap holds its last reference, dropped when a later push compacts the heap (the entries
    # stay under the compaction limit until then).
    class Key:
        cache = None
        def __init__(self, i): self.i = i
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.cache is not None:
                Key.cache.insert([10**6 + self.i])

    cache = RadixCache(core=core_name, eviction_policy="mru")
    for i in range(150):
        cache.insert([i, 0], extra_key=Key(i))  # a namespace table may keep this object...
    keys = [Key(i) for i in range(150)]
    for i, key in enumerate(keys):
        cache.insert([i, 1], extra_key=key)     # ...the new leaf holds this equal one
    for i, key in enumerate(keys):
        for _ in range(2):
            cache.match_prefix([i, 1], extra_key=key)
    assert len(core_of(cache).heap) < 1024
    cache.evict(30)                         # the 30 leaves touched last
    del keys, key
    Key.cache = cache
    for i in range(3000):
        cache.insert([-1, i])               # pushes: compaction drops the stale entries
    Key.cache = None
    gc.collect()
    consistent(cache)
    only_reentry_errors()


@case
def r7_ranked_leaves_and_finalizers_during_evict(core_name):
    # Ranked leaves: each rank's entries in a heap of their own in the compiled core, emptied
    # ones dropped during a pop, dead entries of changed ranks dropped by compaction. Keys only
    # the tree holds are cyclic garbage once their leaf goes, so the collector runs their
    # finalizer inside later calls (a pop, a rank change, an on_remove answer setting a
    # parent's rank), and the finalizer inserts, ranks and evicts too.
    class Key:
        cache = None
        def __init__(self, i): self.i, self.me = i, self
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            cache = Key.cache
            if cache is not None:
                leaf = cache.insert([10**6 + self.i, 1]).last_node
                cache.set_eviction_rank(leaf, self.i % 3)
                cache.evict(1, on_remove=lambda node: 1)

    for policy in ("lru", "mru", "lfu"):
        cache = RadixCache(core=core_name, eviction_policy=policy)
        for i in range(200):
            cache.insert([i, 5], extra_key=Key(i))
            leaf = cache.insert([i, 5, 6], extra_key=Key(i)).last_node
            for step in range(6):  # dead entries in several ranks' heaps
                cache.set_eviction_rank(leaf, (i + step) % 4)
            del leaf
        Key.cache = cache
        gc.set_threshold(1, 1, 1)
        freed = 0
        for r in range(150):  # each answer ranks a parent ([i, 5]) before it can follow
            freed += cache.evict(3, lambda value: value.sum(), on_remove=lambda node: r % 3)
        cache.reset()
        gc.set_threshold(700, 10, 10)
        Key.cache = None
        gc.collect()
        assert freed > 0
        consistent(cache)
        only_reentry_errors()


# -- 8: namespace table --------------------------------------------------------------------


@case
def r8_salt_churn_memory_is_bounded(core_name):
    class Salt:
        def __init__(self, i): self.i = i
        def __hash__(self): return hash(("salt", self.i))
        def __eq__(self, other): return isinstance(other, Salt) and other.i == self.i

    cache = RadixCache(core=core_name)
    def churn(start, count):
        for i in range(start, start + count):
            cache.insert([1, 2, 3], extra_key=Salt(i) if i % 2 else f"salt-{i}")
            cache.evict(3)
    churn(0, 20_000)                       # warm up every table
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    churn(20_000, 100_000)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert cache.node_count() == 0
    # Unbounded, 10^5 salts would hold ~36 MiB and every key object.
    assert grown < 1 << 20, grown
    assert cache.match_prefix([1, 2, 3], extra_key=Salt(5)).length == 0
    consistent(cache)
    print("grown", grown)


@case
def r8_released_salts_are_not_kept_alive(core_name):
    class Salt:
        def __init__(self, i): self.i = i
        def __hash__(self): return hash(("salt", self.i))
        def __eq__(self, other): return isinstance(other, Salt) and other.i == self.i

    cache = RadixCache(core=core_name)
    refs = []
    for i in range(3000):
        salt = Salt(i)
        refs.append(weakref.ref(salt))
        cache.insert([1, 2, 3, i], extra_key=salt)
        cache.match_prefix([1, 2, 9], extra_key=salt)     # a split: two nodes hold it
        del salt
    cache.evict(10**9)                                     # by eviction...
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    for i in range(3000):
        salt = Salt(i)
        refs.append(weakref.ref(salt))
        cache.insert([4, i], extra_key=salt)
        del salt
    cache.reset()                                          # ...and by reset
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    consistent(cache)

"""Adversarial Python code inside a cache call: nothing may crash, hang, leak or mix namespaces.

Python code runs inside a call more often than it looks: a token's ``__index__``, an
extra_key's ``__hash__``/``__eq__``, torch hooks (``TorchFunctionMode``), finalizers set off by
a DECREF or by a collection, other threads. Each case below runs in its own subprocess
(``python -X dev -X faulthandler``), so a segfault fails that case and not the run, and a
timeout catches a hang. The cases are grouped by the root causes of issue 12:

1. token conversion reading items that ``__index__`` can change;
2. namespace lookup (user hashing) in the middle of a walk, namespace ids reused;
3. a split calling torch (hooks, other threads) between reading and writing the tree;
4. a borrowed token buffer read after user code resized or wrote it;
5. nodes invisible to the garbage collector (cycles through a node never collected);
6. recursive teardown when the garbage collector frees a deep tree;
7. heap loops that release references mid-update;
8. the namespace table growing without bound.

Where user code changes what the call reads (but does not call the cache), the result must
equal the pure core's: each such case runs the same scenario on the core under test and on the
pure core in one process and compares. Where user code calls back into the cache, the rule
(docs/design.md, "Re-entrancy and threads") is: the nested call raises ``RuntimeError`` naming the
problem, and the cache stays consistent (``check_invariants``) and usable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]

# Shared by every case: the core under test is argv[1].
PRELUDE = '''
import gc, os, sys, threading, time, tracemalloc, weakref
import numpy as np
import torch
from radixcache import RadixCache
from conftest import check_invariants, core_of, node_tokens

CORE = sys.argv[1]
REENTERED = "re-entered from inside one of its own calls"

UNRAISABLE = []
sys.unraisablehook = lambda info: UNRAISABLE.append(info.exc_value)


def contents(cache):
    """Everything a cache holds, comparable across cores."""
    out = []
    for node, _depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        value = node.value
        out.append((repr(node.extra_key), tuple(node_tokens(node)), node.terminal,
                    tuple(value.tolist()) if value.device.type == "cpu" else value.shape[0]))
    return sorted(out)


def outcome(call):
    """What a call did: ("ok", result) or (exception type, whether it names re-entry)."""
    try:
        return ("ok", call())
    except Exception as exc:
        return (type(exc).__name__, REENTERED in str(exc))


def same_as_pure(run):
    """run(core) -> comparable result; must be the same on the core under test and pure."""
    got, want = run(CORE), run("python")
    assert got == want, (got, want)


def only_reentry_errors():
    """Exceptions reported as unraisable (from finalizers) must be the re-entry error."""
    for exc in UNRAISABLE:
        assert isinstance(exc, RuntimeError) and REENTERED in str(exc), repr(exc)
    UNRAISABLE.clear()


def consistent(cache):
    """The cache is consistent and still works after whatever happened."""
    check_invariants(cache)
    probe = [987_654, 987_655]
    cache.insert(probe)
    assert cache.exists(probe) and cache.match_prefix(probe).length == 2
    check_invariants(cache)


def build_chain(cache, depth, extra_key=None):
    """A chain of depth one-token nodes (each shorter match splits the top node)."""
    tokens = np.arange(depth, dtype=np.int64)
    deepest = cache.insert(tokens, extra_key=extra_key).last_node
    for end in range(depth - 1, 0, -1):
        cache.match_prefix(tokens[:end], extra_key=extra_key)
    assert cache.node_count() == depth
    return deepest
'''

CASES: dict[str, str] = {}


def case(name: str, body: str) -> None:
    CASES[name] = textwrap.dedent(body)


# -- 1: token conversion -------------------------------------------------------------------
case("r1_index_clears_list", """
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
    same_as_pure(run)
""")

case("r1_index_appends_and_replaces", """
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
    same_as_pure(run)
""")

case("r1_other_thread_mutates_list", """
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
    same_as_pure(run)
""")

case("r1_index_reenters_or_fails", """
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
    same_as_pure(run)
""")


# -- 2: namespace lookup -------------------------------------------------------------------
case("r2_hash_or_eq_resets", """
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
    same_as_pure(run)
""")

case("r2_nested_insert_cannot_merge_tenants", """
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
    same_as_pure(run)
""")

case("r2_namespace_ids_never_reused", """
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
    same_as_pure(run)
""")


# -- 3: split with device values -----------------------------------------------------------
# One scenario, several actions: a torch function mode's hook acts on the cache (reset,
# evict, insert, match) in the middle of a call that touches device values.
_R3_TORCH_MODE_ACTS = """
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

    for action in ACTIONS:
        attempt(CORE, action)
"""

case("r3_torch_mode_resets", _R3_TORCH_MODE_ACTS.replace("ACTIONS", "(lambda c: c.reset(),)"))
case("r3_torch_mode_evicts_or_inserts", _R3_TORCH_MODE_ACTS.replace(
    "ACTIONS", "(lambda c: c.evict(100), lambda c: c.insert([1, 2, 3, 7]),\n"
               "                   lambda c: c.match_prefix([1, 2]))"))


case("r3_value_finalizer_during_split", """
    # A split that slices a node's device value drops the old tensor: its finalizer then
    # runs between reading the parent's slot and writing it.
    for action in ("reset", "evict", "insert"):
        cache = RadixCache(core=CORE)
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
""")

case("r3_finalizers_during_splits", """
    class Trap:
        # A reference cycle with a finalizer that changes the cache: collected at some
        # allocation inside a cache call.
        cache = None
        def __init__(self, action): self.me, self.action = self, action
        def __del__(self):
            if Trap.cache is not None:
                self.action(Trap.cache)

    actions = [lambda c: c.reset(), lambda c: c.evict(3), lambda c: c.insert([5, 6, 7]),
               lambda c: c.match_prefix([1, 2, 3])]
    for device in ("meta", "cpu"):
        cache = RadixCache(core=CORE)
        Trap.cache = cache
        gc.set_threshold(1, 1, 1)
        rng = np.random.default_rng(0)
        for step in range(600):
            for _ in range(3):
                Trap(actions[step % len(actions)])
            tokens = rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
            kv = torch.arange(len(tokens), device=device)
            call = (lambda: cache.insert(tokens, kv)) if step % 2 else \\
                   (lambda: cache.match_prefix(tokens))
            kind, value = outcome(call)
            assert kind == "ok" or (kind == "RuntimeError" and value), (kind, value)
        gc.set_threshold(700, 10, 10)
        Trap.cache = None
        gc.collect()
        consistent(cache)
        only_reentry_errors()
""")

case("r3_two_threads_on_device_values", """
    class Yield:
        # hashing lets the other thread run in the middle of a call
        def __init__(self, name): self.name = name
        def __hash__(self): time.sleep(0); return hash(self.name)
        def __eq__(self, other): time.sleep(0); return getattr(other, "name", None) == self.name

    cache = RadixCache(core=CORE)
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
""")


# -- 4: borrowed token buffers -------------------------------------------------------------
# One scenario, two triggers: the key's __hash__ resizes the caller's array (grow: moved
# and freed; shrink) or writes it, in the middle of the call.
_R4_HASH_ACTS_ON_TOKENS = """
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
        for mode in MODES:
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
    same_as_pure(run)
"""

case("r4_hash_resizes_tokens", _R4_HASH_ACTS_ON_TOKENS.replace("MODES", '("grow", "shrink")'))
case("r4_hash_writes_tokens", _R4_HASH_ACTS_ON_TOKENS.replace("MODES", '("write",)'))

case("r4_finalizer_resizes_tokens_mid_walk", """
    class Trap:
        arr = None
        def __init__(self): self.me = self
        def __del__(self):
            if Trap.arr is not None:
                Trap.arr.resize(4, refcheck=False)
                Trap.arr = None

    cache = RadixCache(core=CORE)
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
""")


# -- 5: garbage collection of cycles through nodes -----------------------------------------
case("r5_request_keys_holding_nodes_are_collected", """
    class RequestKey:
        def __init__(self, i):
            self.i = i
            self.payload = bytearray(100_000)
            self.node = None
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, RequestKey) and other.i == self.i

    cache = RadixCache(core=CORE)
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
""")

case("r5_cache_in_a_cycle_through_deep_nodes", """
    class Holder:
        def __init__(self): self.cache = None
        def __hash__(self): return 7
        def __eq__(self, other): return self is other

    refs = []
    for depth in (1, 3, 50):
        holder = Holder()
        cache = RadixCache(core=CORE)
        holder.cache = cache
        build_chain(cache, depth, extra_key=holder)   # the deepest node holds the cache too
        cache.insert(list(range(depth)) + [99], torch.arange(depth + 1, device="meta"),
                     extra_key=holder)
        refs.append(weakref.ref(holder))
        del holder, cache
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
""")


# -- 6: teardown when the collector frees a deep tree --------------------------------------
case("r6_deep_chain_in_a_cycle_collected", """
    class Probe:
        pass

    depth = 100_000 if CORE == "c" else 20_000
    cache = RadixCache(core=CORE)
    probe = Probe()
    key = ("tenant", core_of(cache).tree, probe)   # tree -> nodes -> key -> tree
    build_chain(cache, depth, extra_key=key)
    probe_ref = weakref.ref(probe)
    del cache, key, probe
    assert probe_ref() is not None         # kept by the cycle...
    gc.collect()
    assert probe_ref() is None             # ...until the collector frees the deep tree
    print("collected", depth)
""")

case("r6_key_holds_the_tree", """
    # tree -> namespace table -> key -> tree: the tree is the oldest object of the cycle, so
    # the collector clears it first; in a thread with a 1 MiB stack, and in the main thread.
    class Key:
        def __init__(self): self.tree = None
        def __hash__(self): return 3
        def __eq__(self, other): return self is other

    def build_and_drop(depth):
        cache = RadixCache(core=CORE)
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
    build_and_drop(100_000 if CORE == "c" else 20_000)
""")

case("r6_saved_exception_holds_evict_frame", """
    depth = 100_000 if CORE == "c" else 20_000
    saved = []
    cache = RadixCache(core=CORE)
    deepest = build_chain(cache, depth)
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
""")

case("r6_small_thread_stack", """
    depth = 20_000
    threading.stack_size(1 << 20)
    failures = []
    def work():
        try:
            for how in ("cycle", "tree cycle", "reset", "drop"):
                cache = RadixCache(core=CORE)
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
""")


# -- 7: heap updates and finalizers --------------------------------------------------------
case("r7_finalizers_reenter_during_reset_and_clear", """
    class Key:
        cache = None
        def __init__(self, i): self.i = i
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.cache is not None:
                Key.cache.insert([self.i, 1], extra_key=None)
                Key.cache.evict(1)

    cache = RadixCache(core=CORE)
    for round in range(3):
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
""")

case("r7_duplicate_entries_and_finalizers_during_evict", """
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
        cache = RadixCache(core=CORE, eviction_policy=policy)
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
""")


case("r7_compaction_drops_last_references", """
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

    cache = RadixCache(core=CORE, eviction_policy="mru")
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
""")


# -- 8: namespace table --------------------------------------------------------------------
case("r8_salt_churn_memory_is_bounded", """
    class Salt:
        def __init__(self, i): self.i = i
        def __hash__(self): return hash(("salt", self.i))
        def __eq__(self, other): return isinstance(other, Salt) and other.i == self.i

    cache = RadixCache(core=CORE)
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
""")

case("r8_released_salts_are_not_kept_alive", """
    class Salt:
        def __init__(self, i): self.i = i
        def __hash__(self): return hash(("salt", self.i))
        def __eq__(self, other): return isinstance(other, Salt) and other.i == self.i

    cache = RadixCache(core=CORE)
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
""")


# -- the fast paths' tensor reads ----------------------------------------------------------
case("t1_zero_tensor_has_no_data", """
    # torch._efficientzerotensor: an exact CPU int64 1-D contiguous tensor with no storage
    # (data pointer NULL); reading it through its data pointer crashes.
    def run(core):
        cache = RadixCache(core=core)
        cache.insert(list(range(8)), list(range(8)))
        found = []
        for size in (8, 0):  # an empty one too: no data to read, yet still torch's error
            zeros = torch._efficientzerotensor(size, dtype=torch.int64)
            found += [outcome(lambda: cache.match_prefix(zeros).length),
                      outcome(lambda: cache.exists(zeros)),
                      outcome(lambda: cache.insert(zeros).prefix_len),
                      outcome(lambda: cache.insert(list(range(20, 28)), zeros).prefix_len),
                      outcome(lambda: cache.match_prefix(zeros, extra_key="k").length)]
        check_invariants(cache)
        return found, contents(cache)
    same_as_pure(run)
""")


case("t3_tensor_attributes_set_on_the_instance", """
    # A tensor has a __dict__: an attribute set there shadows a method (t.data_ptr = ...).
    # The facts a core reads memory by (device, dtype, dimensions, contiguity, negative
    # bit, size, address) must be the tensor's own: lies here pointed the compiled core at
    # address 16 (a crash), read an expanded tensor's one element as eight, read a negative
    # view raw and a 2-D tensor as 1-D. Each call must do what it does on the same tensor
    # without the attributes.
    from radixcache.workloads import KVPool

    LIES = {"data_ptr": lambda: 16, "is_contiguous": lambda *a, **k: True,
            "dim": lambda: 1, "is_neg": lambda: False}

    def lying(tensor):
        for name, lie in LIES.items():
            setattr(tensor, name, lie)
        return tensor

    def inputs():
        seq = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
        return {"plain": seq, "expanded": torch.tensor([1]).expand(8),
                "negative": torch._neg_view(-seq), "two_d": seq.reshape(2, 4),
                "strided": torch.arange(1, 17)[::2]}

    def run(core):
        found = []
        for lie in (False, True):
            cache = RadixCache(core=core)
            cache.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 108)))
            cache.insert([1, 1, 1, 1], list(range(200, 204)))
            for name, tokens in inputs().items():
                tokens = lying(tokens) if lie else tokens
                kv = lying(torch.arange(300, 308)) if lie else torch.arange(300, 308)
                found += [name, outcome(lambda: cache.match_prefix(tokens).indices.tolist()),
                          outcome(lambda: cache.exists(tokens)),
                          outcome(lambda: cache.insert(tokens).prefix_len),
                          outcome(lambda: cache.insert([9] + list(range(len(kv) - 1)),
                                                       kv).prefix_len)]
            check_invariants(cache)
            found.append(contents(cache))
            pool = KVPool(32)
            taken = pool.alloc(32)
            for slots in (torch.arange(8), torch.tensor([3]).expand(4),
                          torch._neg_view(torch.arange(-31, -23)), torch.arange(16)[::2]):
                slots = lying(slots) if lie else slots
                found.append(outcome(lambda: pool.free(slots)))
            found.append(pool.free_slots().tolist())
        assert found[:len(found) // 2] == found[len(found) // 2:], found
        return found
    same_as_pure(run)
""")


case("t4_tokens_written_during_the_call", """
    # Another thread (numpy and torch drop the GIL inside their loops) or another process
    # sharing the memory can write a call's token array while the core reads it. The answers
    # are then whatever the tokens were; the tree must stay well formed. Here a second
    # process flips the last 8 of 12 tokens between all 1 and all 2 as fast as it can, over a
    # file both map. Before: a match whose second read of a page differed from its first
    # split a node at 0 tokens (an empty node); an insert whose new leaf, copied after the
    # walk, began with a sibling's first page made two children of one first page, and with
    # a host tier left adopted nodes off the heap. An insert that sees its tokens change
    # says so (RuntimeError) and changes nothing that counts.
    import mmap, subprocess, tempfile

    FLIP = "\\n".join([
        "import sys, numpy as np",
        "tail = np.memmap(sys.argv[1], dtype=np.int64, mode='r+')[4:]",
        "while True:",
        "    tail[:] = 2",
        "    tail[:] = 1",
    ])
    with tempfile.NamedTemporaryFile(suffix=".tokens", delete=False) as f:
        f.write(np.full(12, 7, dtype=np.int64).tobytes())
        path = f.name
    fd = os.open(path, os.O_RDWR)
    shared = mmap.mmap(fd, 96)
    tokens = np.frombuffer(shared, dtype=np.int64)
    assert type(tokens) is np.ndarray and tokens.flags.writeable
    flipper = subprocess.Popen([sys.executable, "-c", FLIP, path])
    seen = {}
    try:
        deadline = time.monotonic() + 60
        while tokens[4] == 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tokens[4] in (1, 2), "the flipping process did not start"
        for phase in ("insert", "tiered", "match"):
            cache = RadixCache(core=CORE, host_tier=phase == "tiered")
            cache.insert([7] * 4 + [1] * 8)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if phase == "match":
                    if cache.node_count() > 32:
                        cache.reset()
                        cache.insert([7] * 4 + [1] * 8)
                    cache.match_prefix(tokens)
                    check_invariants(cache)
                    continue
                cache.reset()
                cache.insert([7] * 4 + [2] * 8, list(range(100, 112)))
                if phase == "tiered":  # host only: an insert through it adopts them
                    cache.insert([7] * 4 + [3] * 8, list(range(200, 212)))
                    cache.evict(100, backup=lambda device: device + 900)
                sizes = lambda: (cache.total_size(), cache.evictable_size(),
                                 cache.host_size() if phase == "tiered" else 0)
                before = sizes()
                try:
                    cache.insert(tokens, torch.arange(500, 512))
                    key = phase + " inserted"
                except RuntimeError as exc:
                    assert "token_ids changed while insert read them" in str(exc), exc
                    assert sizes() == before  # (a split may stay: it changes no content)
                    key = phase + " refused"
                seen[key] = seen.get(key, 0) + 1
                check_invariants(cache)
    finally:
        flipper.kill()
        flipper.wait()
        del tokens
        shared.close()
        os.close(fd)
        os.unlink(path)
    assert seen.get("insert inserted") and seen.get("tiered inserted"), seen
    print(seen)
""")


case("t2_index_tensor_outlives_and_owns_its_memory", """
    # The compiled core returns hits as a tensor over its own malloc'd block (DLPack): the
    # block must outlive the cache, be the caller's to write, and be freed with the tensor.
    def rss():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    def run(core):
        seq = list(range(3000))
        cache = RadixCache(core=core)
        cache.insert(seq, list(range(5000, 8000)))
        kept = [cache.match_prefix(seq).indices for _ in range(3)]
        kept[0].numpy()[:] = -1                        # the caller's copy: the cache keeps its own
        kept[1].add_(1)
        again = cache.match_prefix(seq).indices.tolist()
        cache.evict(10**9)
        cache.reset()
        del cache
        gc.collect()
        junk = [bytes(24_000) for _ in range(200)]     # reuse freed memory, if any was freed
        return again, [t.tolist() for t in kept], int(kept[2].numpy().sum())
    same_as_pure(run)

    if os.path.exists("/proc/self/statm"):
        seq = list(range(3000))
        cache = RadixCache(core=CORE)
        cache.insert(seq, list(range(3000)))
        for _ in range(2000):
            cache.match_prefix(seq)
        base = rss()
        for _ in range(50_000):                       # 1.2 GB if no block were freed
            cache.match_prefix(seq).indices.numpy()
        assert rss() - base < 64 * 2**20, (rss() - base) / 2**20
""")



# -- 9: the host tier's callbacks (backup, evict_host's free_callback) -----------------------
# backup is user code called under the guard, like on_remove: a call into the cache from it
# raises RuntimeError and the victim stays; whatever torch code a returned tensor runs, the
# core checks what it got after the last call, and nothing read before a call is trusted.
HOST = """
def tiered(cache):
    \"\"\"Everything a host-tier cache holds, comparable across cores.\"\"\"
    out = []
    for node, _depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        value, host = node.value, node.host_value
        out.append((tuple(node_tokens(node)), node.tier, node.lock_ref,
                    None if value is None else tuple(value.tolist()),
                    None if host is None else tuple(host.tolist())))
    return sorted(out), cache.evictable_size(), cache.host_size(), cache.stats()


def host_cache(core, policy="write_back"):
    \"\"\"Three prompts sharing a prefix, one of them on the host only.\"\"\"
    cache = RadixCache(core=core, host_tier=True, write_policy=policy)
    cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
    cache.insert([7, 8], [17, 18])
    cache.evict(2, backup=lambda d: d + 100)   # one leaf demoted to the host
    return cache


def host_consistent(cache):
    check_invariants(cache)
    cache.evict(10**6, backup=lambda d: d + 1000)
    cache.evict_host(10**6)
    assert cache.evictable_size() == 0 and cache.host_size() == 0, tiered(cache)
    consistent(cache)
"""

case("h1_backup_calls_the_cache", HOST + textwrap.dedent("""
    def run(core):
        outcomes = []
        for call in ("insert", "match_prefix", "evict", "evict_host", "load_back", "reset"):
            cache = host_cache(core)
            before = tiered(cache)
            def backup(device, cache=cache, call=call):
                if call == "insert":
                    cache.insert([9, 9])
                elif call == "match_prefix":
                    cache.match_prefix([1, 2])
                elif call == "evict":
                    cache.evict(100)
                elif call == "evict_host":
                    cache.evict_host(100)
                elif call == "load_back":
                    cache.load_back(cache.match_prefix([1, 2]), [])
                else:
                    cache.reset()
                return device + 100
            outcomes.append(outcome(lambda: cache.evict(100, backup=backup)))
            assert outcomes[-1] == ("RuntimeError", True), outcomes
            assert tiered(cache) == before, (tiered(cache), before)   # the victim stayed
            host_consistent(cache)
        return outcomes
    same_as_pure(run)
"""))

case("h2_backup_returns_odd_tensors", HOST + textwrap.dedent("""
    class Calls(torch.Tensor):
        # Calls the cache from inside a torch function (the checks of the returned tensor).
        cache = None
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if cls.cache is not None:
                cls.cache.insert([5, 5])
            return super().__torch_function__(func, types, args, kwargs or {})

    def run(core):
        outcomes = []
        makers = [
            lambda d: (d + 100).as_subclass(Calls),
            lambda d: (d + 100).tolist(),
            lambda d: (d + 100).to(torch.int32),
            lambda d: (d + 100)[:1],
            lambda d: (d + 100).unsqueeze(0),
            lambda d: np.asarray(d + 100),
        ]
        for make in makers:
            cache = host_cache(core)
            Calls.cache = cache
            before = tiered(cache)
            outcomes.append(outcome(lambda: cache.evict(100, backup=make)))
            Calls.cache = None
            assert outcomes[-1][0] != "ok", outcomes
            assert tiered(cache) == before, (tiered(cache), before)
            host_consistent(cache)
        # A good tensor on which a hook ran: the node keeps the values it saw.
        cache = host_cache(core)
        kept = []
        def backup(device):
            host = device + 100
            kept.append(host)
            return host
        cache.evict(100, backup=backup)
        for host in kept:
            host.fill_(-1)   # the caller's tensor: the cache kept a copy
        check_invariants(cache)
        return outcomes, tiered(cache)
    same_as_pure(run)
"""))

case("h2_backup_tensor_converts_to_another_length", HOST + textwrap.dedent("""
    class Lying(torch.Tensor):
        # Answers every check like a good tensor, then converts to another length.
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            out = super().__torch_function__(func, types, args, kwargs or {})
            if getattr(func, "__name__", "") == "numpy":
                return np.arange(1000, dtype=np.int64)
            return out

    cache = host_cache(CORE)
    before = tiered(cache)
    try:
        cache.evict(100, backup=lambda d: (d + 100).as_subclass(Lying))
    except ValueError as exc:
        assert "host indices for" in str(exc), exc
    else:
        raise AssertionError("a host value of the wrong length was kept")
    assert tiered(cache) == before, (tiered(cache), before)
    host_consistent(cache)
"""))

case("h3_evict_host_callback_calls_the_cache", HOST + textwrap.dedent("""
    def run(core):
        cache = host_cache(core)
        cache.evict(10**6, backup=lambda d: d + 100)   # everything on the host only
        seen = []
        def free(host):
            seen.append(host.tolist())
            # Allowed: the guard is released around a per-node callback.
            cache.insert([1, 2, 40 + len(seen)], [21, 22, 23])
            seen.append(cache.match_prefix([1, 2, 3, 4]).host_length)
            cache.evict_host(2)
        freed = cache.evict_host(10**6, free)
        host_consistent(cache)
        # batch: called once, after the loop, outside the guard
        cache = host_cache(core)
        cache.evict(10**6, backup=lambda d: d + 100)
        batched = []
        cache.evict_host(10**6, lambda h: batched.append((h.tolist(), cache.insert([3, 3]))),
                         batch=True)
        host_consistent(cache)
        return freed, seen, [b[0] for b in batched]
    same_as_pure(run)
"""))

case("h4_finalizer_during_demotion", HOST + textwrap.dedent("""
    class Trap:
        # Set off by a collection inside a host-tier call: calls the cache from a finalizer.
        cache = None
        def __del__(self):
            if Trap.cache is not None:
                Trap.cache.insert([6, 6, 6])

    def make_garbage():
        for _ in range(50):
            a, b = Trap(), Trap()
            a.other, b.other = b, a   # a cycle: only a collection frees it

    cache = RadixCache(core=CORE, host_tier=True, write_policy="write_through")
    Trap.cache = cache
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        for round in range(30):
            for i in range(20):
                cache.insert([round, i, 1, 2], list(range(4)))
                cache.match_prefix([round, i, 1, 2])
            make_garbage()
            cache.write_through(lambda d: (make_garbage(), d + 500)[1])
            make_garbage()
            cache.evict(40, lambda v: make_garbage(), backup=lambda d: d + 900)
            m = cache.match_prefix([round, 0, 1, 2])
            make_garbage()
            if m.host_length:
                cache.load_back(m, list(range(900, 900 + m.host_length)))
            cache.evict_host(10, lambda h: make_garbage())
            check_invariants(cache)
    finally:
        gc.set_threshold(*old)
        Trap.cache = None
    gc.collect()
    only_reentry_errors()
    host_consistent(cache)
"""))

case("h5_backup_meets_another_thread", HOST + textwrap.dedent("""
    def run(core):
        cache = host_cache(core)
        before = tiered(cache)
        errors = []
        def backup(device):
            def other():
                try:
                    cache.insert([4, 4])
                except RuntimeError as exc:
                    errors.append(REENTERED in str(exc))
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            return None   # the host is full: the victim is deleted as without a host tier
        freed = cache.evict(3, backup=backup)
        host_consistent(cache)
        return freed, errors, before
    same_as_pure(run)
"""))

case("h6_write_through_backup_calls_the_cache", HOST + textwrap.dedent("""
    def run(core):
        cache = RadixCache(core=core, host_tier=True, write_policy="write_through")
        cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
        cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
        before = tiered(cache)
        def backup(device):
            cache.match_prefix([1, 2])
            return device + 100
        first = outcome(lambda: cache.write_through(backup))
        assert first == ("RuntimeError", True), first
        assert tiered(cache) == before
        copied = cache.write_through(lambda d: d + 100)   # the queue was kept
        check_invariants(cache)
        # raising half way: the copies made so far stay, the rest stays queued
        cache.insert([8, 8, 8], [1, 2, 3])
        cache.insert([9, 9], [4, 5])
        calls = []
        def flaky(device):
            calls.append(device.tolist())
            if len(calls) == 2:
                raise KeyError("host pool")
            return device + 200
        second = outcome(lambda: cache.write_through(flaky))
        third = cache.write_through(lambda d: d + 300)
        host_consistent(cache)
        return first, copied, second, third, calls
    same_as_pure(run)
"""))


case("h7_evict_free_callback_uses_both_tiers", HOST + textwrap.dedent("""
    def run(core):
        cache = host_cache(core)
        seen = []
        def free(device):
            # Allowed: the guard is released around a per-node callback. Adopt, load back,
            # evict the host, evict again (nested), while the outer loop is between victims.
            seen.append(device.tolist())
            cache.insert([1, 2, 3, 4], [31, 32, 33, 34])
            m = cache.match_prefix([1, 2, 5, 6])
            seen.append((m.length, m.host_length))
            if m.host_length:
                seen.append(cache.load_back(m, list(range(60, 60 + m.host_length))).tolist())
            seen.append(cache.evict_host(1))
            seen.append(cache.evict(1, backup=lambda d: d + 300))
            check_invariants(cache)
        freed = cache.evict(12, free, backup=lambda d: d + 100)
        host_consistent(cache)
        return freed, seen
    same_as_pure(run)
"""))


case("h8_batch_backup_keeps_and_writes_its_tensor", HOST + textwrap.dedent("""
    import threading

    def run(core):
        cache = RadixCache(core=core, host_tier=True)
        sizes = [3, 700, 5, 300, 2000, 1, 260, 900, 40, 1500, 7, 333]
        for i, size in enumerate(sizes):
            cache.insert([10**6 * (i + 1) + t for t in range(size)])  # the keys are the indices
        cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
        cache.insert([1, 2, 5, 6], [11, 12, 15, 16])
        kept, seen, batches = [], [], []
        calls = [0]

        def backup(device):
            # Keeps its tensor (beyond the call), writes into it, says the host is full
            # (None) or fails now and then: nothing kept may change afterwards.
            calls[0] += 1
            kept.append(device)
            if len(device) > 2:
                device[1] = -calls[0]   # during the call: shows in the batch
            seen.append(device.tolist())
            if calls[0] % 4 == 0:
                return None
            if calls[0] == 7:
                raise KeyError("host pool")
            return device + 5 * 10**7

        outcomes = []
        for target in (10, 2500, 10**9, 10**9):
            outcomes.append(outcome(lambda: cache.evict(target, batches.append, batch=True,
                                                        backup=backup)))
            check_invariants(cache)
        # The prefix [1, 2] has host-only children now: a None from backup skips it.
        outcomes.append(outcome(lambda: cache.evict(10**9, batches.append, batch=True,
                                                    backup=lambda d: kept.append(d))))
        check_invariants(cache)
        assert [t.tolist() for t in kept[:len(seen)]] == seen  # never overwritten
        # The tensors die on another thread (their memory is the batch's).
        worker = threading.Thread(target=lambda items=list(kept): items.clear())
        kept.clear()
        worker.start()
        worker.join()
        host_consistent(cache)
        return outcomes, seen, [t.tolist() for t in batches], tiered(cache)
    same_as_pure(run)
"""))

def run_case(core_name: str, body: str, timeout: float = 300) -> str:
    script = PRELUDE + "\n" + body + "\nprint('CASE-OK')\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]),
               PYTHONFAULTHANDLER="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-X", "dev", "-X", "faulthandler", "-c", script, core_name],
            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {timeout} s: {str(exc.stderr)[-3000:]}")
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\n--- stderr ---\n{proc.stderr[-6000:]}")
    assert "CASE-OK" in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


@pytest.mark.parametrize("name", sorted(CASES))
def test_adversarial(core_name, name):
    run_case(core_name, CASES[name])


def test_a_crash_fails_the_case(core_name):
    # The harness itself must be able to fail: a segfault in the child is a failed case.
    with pytest.raises(AssertionError, match="exit code"):
        run_case(core_name, "import ctypes\nctypes.string_at(0)\n")

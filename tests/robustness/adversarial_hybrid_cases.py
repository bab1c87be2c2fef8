"""Adversarial cases for the hybrid cores (``_hybrid_py``/``_hybrid_c``): user code that runs
inside a hybrid call -- an extra_key's ``__hash__``/``__eq__``, finalizers set off by the
collections that a split or a new node may run -- grouped as the list in
``test_adversarial.py`` says (a: the auxiliary component). Each case is a function of the core
under test, run alone in a subprocess by ``test_adversarial.py``.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np

from adversarial_support import case, only_reentry_errors, outcome
from radixcache._core import HYBRIDS


def hybrid_contents(core) -> list:
    """Everything a hybrid core holds, comparable across cores."""
    out = []
    for node, depth in core.tree.iter_nodes():
        if depth == 0:
            continue
        aux = node.aux_value
        out.append((depth, repr(node.extra_key), node.key.tolist(), node.value.tolist(),
                    None if aux is None else aux.tolist(), node.lock_ref, node.aux_lock_ref))
    return out + [core.total_size(), core.evictable, core.aux_evictable,
                  [n.key.tolist() for n in core.aux_order()]]


def _make(core_name, kind):
    kwargs = {"window": 3} if kind == "window" else {"state": True}
    return HYBRIDS[core_name].HybridCore(1, "lru", numpy_arrays=True, **kwargs)


def _cores(core_name):
    return [(kind, _make(core_name, kind)) for kind in ("window", "state")]


def _aux(kind, n, start):
    return list(range(start, start + n)) if kind == "window" else [start]


def _refused_unchanged(core, calls) -> list:
    """Each call's outcome, each leaving the core's contents as they were."""
    outcomes = []
    for call in calls:
        before = hybrid_contents(core)
        outcomes.append(outcome(call))
        assert hybrid_contents(core) == before
    return outcomes


def _settled(core, Key) -> list:
    """The core's contents once its keys' finalizers no longer call it and the garbage is
    gone, its auxiliary bookkeeping checked."""
    Key.core = None
    gc.collect()
    core.check_aux()
    return hybrid_contents(core)


def _cyclic_key(on_delete):
    """A namespace class whose objects are cyclic garbage once dropped (so a collection at
    some later allocation finalizes them), equal by ``i``; the finalizer calls
    ``on_delete(Key.core)`` while ``Key.core`` is set."""
    class Key:
        core = None
        def __init__(self, i): self.i, self.me = i, self
        def __repr__(self): return f"Key({self.i})"
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.core is not None:
                on_delete(Key.core)
    return Key


@case
def a1_extra_key_reenters_the_hybrid_core(core_name):
    # Hashing and comparing a namespace runs user code; calling the core from there raises
    # the re-entry error, before anything changed, and the core works on.
    class Key:
        core = None
        armed = False
        def __init__(self, name): self.name = name
        def __repr__(self): return f"Key({self.name})"
        def __hash__(self):
            if Key.armed:
                Key.core.evict(1, 1)
            return 7
        def __eq__(self, other):
            if Key.armed:
                Key.core.match([1, 2])
            return isinstance(other, Key) and other.name == self.name

    def run(name):
        results = []
        for kind, core in _cores(name):
            Key.core, Key.armed = core, False
            a = Key("a")
            core.insert([1, 2, 3, 4], [10, 11, 12, 13], _aux(kind, 4, 20), a)
            core.insert([1, 2, 5, 6], [14, 15, 16, 17], _aux(kind, 4, 30), a)
            Key.armed = True
            outcomes = [
                outcome(lambda: core.match([1, 2, 3, 9], Key("b")).length),
                outcome(lambda: core.insert([1, 2, 7, 8], [1, 2, 3, 4], _aux(kind, 4, 40),
                                            Key("b")).prefix_len),
                outcome(lambda: core.exists([1, 2, 3, 4], Key("b")))]
            Key.armed = False
            assert all(o == ("RuntimeError", True) for o in outcomes), outcomes
            core.check_aux()
            core.insert([9, 9], [1, 2], _aux(kind, 2, 50))
            assert core.match([9, 9]).length == 2
            results.append((outcomes, hybrid_contents(core)))
        return results

    assert run(core_name) == run("python")


@case
def a2_finalizers_reenter_during_splits_and_evictions(core_name):
    # Namespaces that are cyclic garbage once their nodes go: the collector runs their
    # finalizers at some allocation inside a later call (a split, a new node), and the
    # finalizers call the core. They get the re-entry error; the core stays consistent.
    class Key:
        core = None
        def __init__(self, i): self.i, self.me = i, self
        def __hash__(self): return self.i
        def __eq__(self, other): return isinstance(other, Key) and other.i == self.i
        def __del__(self):
            if Key.core is not None:
                Key.core.insert([self.i, 1], [1, 2], [3, 4] if Key.core.window else [5])
                Key.core.evict(1, 1)

    for kind, core in _cores(core_name):
        Key.core = core
        gc.set_threshold(1, 1, 1)
        for i in range(150):
            core.insert([i, 1, 2, 3], [4, 5, 6, 7], _aux(kind, 4, 8), Key(i))
            core.match([i, 1, 9], Key(i))  # splits
            if i % 3 == 0:
                core.evict(3, 2)
        gc.set_threshold(700, 10, 10)
        _settled(core, Key)
        only_reentry_errors()


@case
def a3_inputs_written_by_a_hash_are_read_as_they_were(core_name):
    # An extra_key's hashing writes the caller's token, slot and aux arrays mid-call: the
    # call works on them as they were when it began, on both cores alike.
    arrays = {}

    class Key:
        armed = False
        def __repr__(self): return "Key"
        def __hash__(self):
            if Key.armed:
                for arr in arrays.values():
                    arr[:] = -5
            return 3
        def __eq__(self, other): return isinstance(other, Key)

    def run(name):
        out = []
        for kind, core in _cores(name):
            key = Key()
            core.insert([1, 2, 3, 4], [10, 11, 12, 13], _aux(kind, 4, 20), key)
            arrays.update(tokens=np.array([1, 2, 5, 6, 7], dtype=np.int64),
                          kv=np.arange(30, 35, dtype=np.int64),
                          aux=np.array(_aux(kind, 5, 40), dtype=np.int64))
            Key.armed = True
            result = core.insert(arrays["tokens"], arrays["kv"], arrays["aux"], key)
            Key.armed = False
            core.check_aux()
            out.append((result.prefix_len, hybrid_contents(core)))
        return out

    assert run(core_name) == run("python")


@case
def a4_cycles_through_hybrid_nodes_are_collected(core_name):
    # A namespace that holds its own core: the cycle runs through the tree's nodes, which
    # the collector must see (their children and auxiliary slots included).
    class Key:
        def __init__(self, core): self.core = core
        def __hash__(self): return 1
        def __eq__(self, other): return self is other

    for kind in ("window", "state"):
        core = _make(core_name, kind)
        key = Key(core)
        for i in range(20):
            core.insert([1, i, 2], [1, 2, 3], _aux(kind, 3, 4), key)
        core.match([1, 5], key)
        probe = weakref.ref(key)
        del core, key
        gc.collect()
        assert probe() is None, "a hybrid tree in a cycle was not collected"


@case
def a5_deep_hybrid_chain_is_freed_without_recursion(core_name):
    for kind in ("window", "state"):
        core = _make(core_name, kind)
        depth = 20_000
        tokens = np.arange(depth, dtype=np.int64)
        core.insert(tokens, tokens + 1, tokens + 2 if kind == "window" else [9])
        for end in range(depth - 1, 0, -1):
            core.match(tokens[:end])  # each splits the top node
        assert core.tree.node_count == depth
        core.check_aux()
        del core
        gc.collect()


@case
def a6_relock_under_finalizers_and_lying_arguments(core_name):
    # A lock move allocates (its result, the eviction heap's entries): collections there run
    # finalizers that call the core -- inside a call they get the re-entry error, and the
    # move is whole, as on the pure core. Arguments that would run user code (an __index__, an int
    # subclass) are refused before anything changes.
    # (a move of no lock: the results stay comparable)
    Key = _cyclic_key(lambda core: core.relock(None, core.tree.root, 0, 0))

    class Mask:
        def __index__(self):
            Key.core.evict(100, 100)
            return 3

    class Sneaky(int):
        pass

    def run(name):
        core = _make(name, "state")
        Key.core = core
        results = []
        gc.set_threshold(1, 1, 1)
        held = None
        for i in range(120):
            core.insert([i % 7, 1, 2, i], [4, 5, 6, 7], [8 + i], Key(i % 7))
            core.match([i % 7, 1, 9], Key(i % 7))  # splits: cyclic namespaces go as garbage
            node = core.match([i % 7, 1, 2, i], Key(i % 7)).last_node
            path = core.relock(held, node, 3, 3, 1, 4)
            held = node
            results.append(path.tolist())
            if i % 5 == 0:
                core.evict(2, 1)
        gc.set_threshold(700, 10, 10)
        results += _refused_unchanged(core, (
            lambda: core.relock(held, None, Mask(), 0),
            lambda: core.relock(held, None, 3, 0, Sneaky(0), 0),
            lambda: core.relock(held, None, Sneaky(3), 0)))
        core.relock(held, None, 3, 0)
        results.append(_settled(core, Key))
        return results

    assert run(core_name) == run("python")
    only_reentry_errors()


@case
def a7_page_ids_handed_over_under_finalizers_and_lying_arguments(core_name):
    # An eviction that hands over page ids and auxiliary slots gathers them in the call's own
    # memory while the victims go, an insert the duplicates' page ids from its own copy of
    # the caller's slots after its walk (a namespace may be cyclic garbage, so its
    # finalizer runs at a later allocation and calls the core: the re-entry error there).
    # What they hand over and the tree left behind are the pure core's. A page_ids or
    # dup_pages argument that would run user code (a __bool__) is refused before anything
    # changes.
    # (an eviction of nothing: the results stay comparable)
    Key = _cyclic_key(lambda core: core.evict(0, 0, page_ids=True))

    class Truthy:
        def __bool__(self):
            Key.core.evict(100, 100)
            return True

    def run(name):
        results = []
        for kind in ("window", "state"):
            core = HYBRIDS[name].HybridCore(2, "lru", numpy_arrays=True,
                                            **({"window": 4} if kind == "window"
                                               else {"state": True}))
            Key.core = core
            gc.set_threshold(1, 1, 1)
            for i in range(150):
                tokens = [i % 11, 1, 2, 3, i % 5, 6]
                result = core.insert(tokens, list(range(10 * i, 10 * i + 6)),
                                     list(range(7 * i, 7 * i + 6)) if kind == "window" else [i],
                                     Key(i % 11), dup_from=i % 4, dup_pages=True)
                results.append((result.prefix_len, core.last_dup_pages.tolist()))
                core.match([i % 11, 1, 9, 9], Key(i % 11))  # splits
                if i % 3 == 0:
                    freed, aux_freed, pages, aux = core.evict(5, 2, page_ids=True)
                    results.append((freed, aux_freed, pages.tolist(), aux.tolist()))
            gc.set_threshold(700, 10, 10)
            results += _refused_unchanged(core, (
                lambda: core.evict(100, 100, page_ids=Truthy()),
                lambda: core.insert([1, 2], [3, 4], [5, 6], dup_pages=Truthy())))
            results.append(_settled(core, Key))
        return results

    assert run(core_name) == run("python")
    only_reentry_errors()

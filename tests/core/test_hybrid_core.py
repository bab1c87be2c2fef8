"""The hybrid core (``_hybrid_py``'s docstring is the spec) on both cores.

Its decisions are checked against SGLang's own cache by tests/integrations/test_sglang_hybrid.py;
here: what the spec promises call by call (tombstones, window acceptance, window-limited and
one-node locks, the LRU order, eviction of whole leaves then of slots alone, recovery on
insert), every bad input refused with nothing changed, and the compiled core deciding exactly
as the pure one over long random sequences (every result, every node, every size, the LRU
order).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from radixcache._core import HYBRIDS


@pytest.fixture
def hybrid(core_name):
    return HYBRIDS[core_name]


def window_core(hybrid, window=4, page_size=1, policy="lru"):
    return hybrid.HybridCore(page_size, policy, numpy_arrays=True, window=window)


def slots(start, n):
    return np.arange(start, start + n, dtype=np.int64)


def path_of(node) -> list:
    """The tokens from the root to ``node`` (ids differ between cores; paths do not)."""
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def shape(core) -> list:
    """Every node: (depth, tokens, full slots, aux slots, locks), in the tree's order."""
    out = []
    for node, depth in core.tree.iter_nodes():
        if depth == 0:
            continue
        aux = node.aux_value
        out.append((depth, node.key.tolist(), node.value.tolist(),
                    None if aux is None else aux.tolist(), node.lock_ref, node.aux_lock_ref))
    return out


def test_a_long_leaf_keeps_one_window_and_a_match_needs_one(hybrid):
    core = window_core(hybrid, window=4)
    result = core.insert(list(range(10)), slots(100, 10), slots(200, 10))
    assert result.prefix_len == 0
    # The live part splits so that the lower half (which a lock pins) is one window long.
    assert [(n.num_tokens, n.aux_value.tolist()) for n in core.aux_order()] == [
        (6, list(range(200, 206))), (4, list(range(206, 210)))]
    core.check_aux()
    match = core.match(list(range(10)) + [99])
    assert (match.length, core.last_walk) == (10, 10)
    assert core.total_size() == (10, 10) and core.aux_evictable == 10


def test_window_lock_covers_one_window_and_its_release_uses_the_mark(hybrid):
    core = window_core(hybrid, window=4)
    core.insert(list(range(10)), slots(100, 10), slots(200, 10))
    leaf = core.match(list(range(10))).last_node
    mark = core.aux_lock(leaf, 1)
    assert mark > 0 and (core.aux_protected, core.aux_evictable) == (4, 6)
    assert [n.aux_lock_ref for n in core.aux_order()] == [0, 1]
    with pytest.raises(ValueError, match="mark|no auxiliary lock"):
        core.aux_lock(leaf, -1, mark + 1)  # no such mark on the path: nothing changes
    assert core.aux_protected == 4
    core.aux_lock(leaf, -1, mark)
    assert (core.aux_protected, core.aux_evictable) == (0, 10)
    with pytest.raises(ValueError, match="no auxiliary lock"):
        core.aux_lock(leaf, -1, mark)
    core.check_aux()


def test_eviction_frees_whole_leaves_then_window_slots_alone(hybrid):
    core = window_core(hybrid, window=4)
    core.insert(list(range(10)), slots(100, 10), slots(200, 10))
    leaf = core.match(list(range(10))).last_node
    core.lock(leaf, 1)
    mark = core.aux_lock(leaf, 1)
    freed, aux_freed, records = core.evict(10, 10)
    # Every leaf is locked: the upper node's window slots go alone (a tombstone).
    assert (freed, aux_freed) == (0, 6)
    assert [(r[0].tolist(), r[1].tolist(), r[2]) for r in records] == [
        (list(range(100, 106)), list(range(200, 206)), False)]
    assert core.match(list(range(10))).length == 10  # the last window is intact
    core.aux_lock(leaf, -1, mark)
    core.lock(leaf, -1)
    freed, aux_freed, records = core.evict(0, 1)
    assert (freed, aux_freed, records[0][2]) == (4, 4, True)  # a leaf leaves whole
    assert core.match(list(range(10))).length == 0  # a tombstone with no window after it
    assert core.last_walk == 6
    core.check_aux()


def test_insert_recovers_a_tombstone_from_the_callers_slots(hybrid):
    core = window_core(hybrid, window=4)
    core.insert(list(range(10)), slots(100, 10), slots(200, 10))
    core.evict(0, 6)  # the upper node [0, 6) becomes a tombstone
    assert [n.aux_value is None for n, d in core.tree.iter_nodes() if d] == [True, False]
    # The caller's slots from live_from on: [0, 2) stays a tombstone, [2, 6) is recovered.
    core.insert(list(range(10)), slots(300, 10), slots(400, 10), live_from=2)
    assert core.last_recovered[0][:2] == (2, 6) and core.last_recovered[0][3] is False
    assert core.last_recovered[0][2].tolist() == list(range(102, 106))
    assert shape(core) == [(1, [0, 1], [100, 101], None, 0, 0),
                           (2, [2, 3, 4, 5], [302, 303, 304, 305], [402, 403, 404, 405], 0, 0),
                           (3, [6, 7, 8, 9], [106, 107, 108, 109], [206, 207, 208, 209], 0, 0)]
    core.check_aux()


def test_a_locked_tombstone_keeps_its_full_slots(hybrid):
    core = window_core(hybrid, window=4)
    core.insert(list(range(10)), slots(100, 10), slots(200, 10))
    core.evict(0, 6)
    leaf = core.match(list(range(10)) + [1]).last_node  # (the tombstone stops the match)
    upper = next(n for n, d in core.tree.iter_nodes() if d == 1)
    core.lock(upper, 1)
    core.insert(list(range(6)), slots(300, 6), slots(400, 6))
    start, end, kept, locked = core.last_recovered[0]
    assert (start, end, kept.tolist(), locked) == (0, 6, list(range(100, 106)), True)
    assert upper.value.tolist() == list(range(100, 106))  # kept
    assert upper.aux_value.tolist() == list(range(400, 406))  # the caller's window slots
    assert leaf is not None
    core.check_aux()


def test_a_state_lives_on_its_node_alone(hybrid):
    core = hybrid.HybridCore(1, "lru", numpy_arrays=True, state=True)
    core.insert([1, 2, 3, 4], slots(10, 4), [77])
    core.insert([1, 2, 5, 6], slots(20, 4), [88])  # splits [1, 2]: it has no state
    assert [(n.key.tolist(), None if n.aux_value is None else n.aux_value.tolist())
            for n, d in core.tree.iter_nodes() if d] == [([1, 2], None), ([3, 4], [77]),
                                                        ([5, 6], [88])]
    match = core.match([1, 2, 9])  # [1, 2] has no state: nothing to resume from
    assert (match.length, core.last_walk) == (0, 2)
    core.insert([1, 2], slots(10, 2), [99])  # the state of [1, 2] now
    assert core.aux_kept is False and core.match([1, 2, 9]).length == 2
    core.insert([1, 2], slots(10, 2), [55])  # a state is there: kept, not replaced
    assert core.aux_kept is True and core.match([1, 2]).last_node.aux_value.tolist() == [99]
    node = core.match([1, 2]).last_node
    core.aux_lock(node, 1)
    assert (core.aux_protected, core.aux_evictable) == (1, 2)
    core.aux_lock(node, -1)
    assert [r[1].tolist() for r in core.evict(0, 1)[2]] == [[77]]  # the least recent
    core.check_aux()


@pytest.mark.parametrize("call, exc", [
    (lambda c, n: c.insert([1, 2, 3], None, [1, 2, 3]), TypeError),
    (lambda c, n: c.insert([1, 2, 3, 4], [1, 2], [1, 2, 3, 4]), TypeError),
    (lambda c, n: c.insert([1, 2, 3, 4], [1, 2, 3, 4], [1, 2]), TypeError),
    (lambda c, n: c.insert([1, 2, 3], [1, 2, 3], [1, 2, 3], live_from=-1), TypeError),
    (lambda c, n: c.insert([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], live_from=1), ValueError),
    (lambda c, n: c.insert([1, 2, 3], [1, 2, 3], [1, 2, 3], dup_from=1.5), TypeError),
    (lambda c, n: c.insert([1, 2, 3], [1, 2, 3], [1, 2, 3], priority=2**63), TypeError),
    (lambda c, n: c.insert([1, "x"], [1, 2], [1, 2]), TypeError),
    (lambda c, n: c.insert([1, 2], [1, 2], [1, 2], extra_key=[]), TypeError),
    (lambda c, n: c.match([1, 2], extra_key={}), TypeError),
    (lambda c, n: c.match("12"), TypeError),
    (lambda c, n: c.aux_lock(n, 2), ValueError),
    (lambda c, n: c.aux_lock(n, -1, -5), TypeError),
    (lambda c, n: c.aux_lock(n, -1), ValueError),
    (lambda c, n: c.aux_lock("node", 1), TypeError),
    (lambda c, n: c.aux_release(n, 0), ValueError),
    (lambda c, n: c.evict(1.0, 0), TypeError),
    (lambda c, n: c.evict(0, "1"), TypeError),
    (lambda c, n: c.remove_leaf(c.tree.root), ValueError),
    (lambda c, n: c.export_state(), TypeError),
])
def test_bad_input_changes_nothing(hybrid, call, exc):
    core = window_core(hybrid, window=4, page_size=2)
    core.insert([9, 9, 9, 9], slots(1, 4), slots(50, 4))
    core.insert([9, 9, 8, 8, 7, 7], slots(10, 6), slots(60, 6))
    node = core.match([9, 9, 9, 9]).last_node
    before = (shape(core), core.total_size(), core.evictable, core.aux_evictable,
              [n.id for n in core.aux_order()])
    with pytest.raises(exc):
        call(core, node)
    after = (shape(core), core.total_size(), core.evictable, core.aux_evictable,
             [n.id for n in core.aux_order()])
    assert after == before
    core.check_aux()


def test_a_node_of_another_cache_is_refused(hybrid):
    core, other = window_core(hybrid), window_core(hybrid)
    for c in (core, other):
        c.insert([1, 2, 3, 4, 5], slots(1, 5), slots(10, 5))
    foreign = other.match([1, 2, 3, 4, 5]).last_node
    before = shape(core)
    for call in (lambda: core.aux_lock(foreign, 1), lambda: core.lock(foreign, 1),
                 lambda: core.aux_release(foreign, 0), lambda: core.remove_leaf(foreign)):
        with pytest.raises(ValueError, match="another cache"):
            call()
    assert shape(core) == before and shape(other)[-1][4:] == (0, 0)


def test_a_core_has_exactly_one_component(hybrid):
    for kwargs in ({}, {"window": 4, "state": True}, {"window": -1}):
        with pytest.raises(ValueError):
            hybrid.HybridCore(1, "lru", **kwargs)


def state_tree(hybrid):
    """A state core with a branch: [1, 2] (no state), [1, 2, 3, 4] and [1, 2, 5, 6]."""
    core = hybrid.HybridCore(2, "lru", numpy_arrays=True, state=True)
    core.insert([1, 2, 3, 4], slots(10, 4), [77])
    core.insert([1, 2, 5, 6], slots(20, 4), [88])
    return core


def lock_state(core) -> tuple:
    """What the locks decide: every node, the sizes, the order victims would go in."""
    return (shape(core), core.evictable, core.protected, core.aux_evictable,
            core.aux_protected, [n.key.tolist() for n in core.aux_order()])


def victims(core) -> list:
    """Evict everything evictable (the tree is spent): the records, in order."""
    return [(v.tolist(), None if a is None else a.tolist(), w)
            for v, a, w in core.evict(100, 100)[2]]


@pytest.mark.parametrize("release, acquire", [(3, 3), (1, 1), (3, 1), (1, 3), (0, 3), (3, 0),
                                              (2, 2)])
@pytest.mark.parametrize("moves", ["down", "up", "across", "same", "from none", "to none",
                                   "to root"])
def test_relock_is_the_lock_calls_and_the_path_in_one(hybrid, release, acquire, moves):
    # relock does what the separate calls do (state lock released first, then full; full
    # taken first, then state), and reads the new node's path as path_indices does.
    one, two = state_tree(hybrid), state_tree(hybrid)
    pick = {"down": ([1, 2], [1, 2, 3, 4]), "up": ([1, 2, 5, 6], [1, 2]),
            "across": ([1, 2, 3, 4], [1, 2, 5, 6]), "same": ([1, 2, 3, 4], [1, 2, 3, 4]),
            "from none": (None, [1, 2, 5, 6]), "to none": ([1, 2, 3, 4], None),
            "to root": ([1, 2, 3, 4], [])}[moves]
    nodes = []
    for core in (one, two):
        old, new = (None if k is None else core.match(k).last_node if k else core.tree.root
                    for k in pick)
        if old is not None:  # the lock to release: the components release names
            if release & 1:
                core.lock(old, 1)
            if release & 2:
                core.aux_lock(old, 1)
        nodes.append((old, new))
    (old, new), (old2, new2) = nodes
    depth = 0 if new is None else len(path_of(new))
    start, stop = min(1, depth), depth
    got = one.relock(old, new, release, acquire, start, stop)
    if old2 is not None:
        if release & 2:
            two.aux_lock(old2, -1)
        if release & 1:
            two.lock(old2, -1)
    if new2 is not None:
        if acquire & 1:
            two.lock(new2, 1)
        if acquire & 2:
            two.aux_lock(new2, 1)
    want = None if start == stop else two.path_indices(new2, start)[:stop - start].tolist()
    assert (None if got is None else got.tolist()) == want
    assert lock_state(one) == lock_state(two)
    one.check_aux()
    assert victims(one) == victims(two)


def test_relock_reads_any_part_of_the_path(hybrid):
    core = state_tree(hybrid)
    node = core.match([1, 2, 5, 6]).last_node
    full = core.path_indices(node).tolist()
    for start in range(5):
        for stop in range(start, 5):
            got = core.relock(None, node, 0, 0, start, stop)
            assert (None if got is None else got.tolist()) == (
                None if start == stop else full[start:stop]), (start, stop)
    assert lock_state(core) == lock_state(state_tree(hybrid))


@pytest.mark.parametrize("call, exc", [
    (lambda c, a, b: c.relock(a, b, 4, 3), ValueError),
    (lambda c, a, b: c.relock(a, b, 3, -1), ValueError),
    (lambda c, a, b: c.relock(a, b, 3.0, 3), TypeError),
    (lambda c, a, b: c.relock(a, b, 3, True), TypeError),
    (lambda c, a, b: c.relock(a, b, 3, 3, 2, 1), ValueError),
    (lambda c, a, b: c.relock(a, b, 3, 3, -1, 1), ValueError),
    (lambda c, a, b: c.relock(a, b, 3, 3, 0, 2**64), ValueError),
    (lambda c, a, b: c.relock(a, b, 3, 3, "0", 1), TypeError),
    (lambda c, a, b: c.relock(a, b, 3, 3, 0, 5), ValueError),  # past b's 4 tokens
    (lambda c, a, b: c.relock(a, None, 3, 0, 0, 1), ValueError),  # no path to read
    (lambda c, a, b: c.relock(b, a, 3, 3), ValueError),  # b holds no lock
    (lambda c, a, b: c.relock(b, a, 2, 3), ValueError),  # b holds no state lock
    (lambda c, a, b: c.relock(a.parent, b, 1, 3), ValueError),  # a descendant's lock only
    (lambda c, a, b: c.relock("node", b, 3, 3), TypeError),
    (lambda c, a, b: c.relock(a, 7, 3, 3), TypeError),
])
def test_relock_bad_input_changes_nothing(hybrid, call, exc):
    core = state_tree(hybrid)
    a, b = core.match([1, 2, 3, 4]).last_node, core.match([1, 2, 5, 6]).last_node
    core.lock(a, 1)
    core.aux_lock(a, 1)
    before = lock_state(core)
    with pytest.raises(exc):
        call(core, a, b)
    assert lock_state(core) == before
    core.check_aux()
    assert core.relock(a, b, 3, 3, 0, 4).tolist() == [10, 11, 22, 23]  # and it works on


def test_relock_refuses_foreign_nodes_and_window_state_locks(hybrid):
    core, other = state_tree(hybrid), state_tree(hybrid)
    foreign = other.match([1, 2, 3, 4]).last_node
    before = lock_state(core)
    for call in (lambda: core.relock(None, foreign, 0, 3), lambda: core.relock(foreign, None)):
        with pytest.raises(ValueError, match="another cache"):
            call()
    assert lock_state(core) == before
    window = window_core(hybrid, window=2)
    window.insert([1, 2, 3], slots(1, 3), slots(10, 3))
    node = window.match([1, 2, 3]).last_node
    for masks in ((0, 2), (2, 0), (3, 3)):
        with pytest.raises(TypeError, match="state lock"):
            window.relock(None, node, *masks)
    assert node.lock_ref == 0 and window.relock(None, node, 0, 1, 0, 3).tolist() == [1, 2, 3]
    assert node.lock_ref == 1


# -- the compiled core decides as the pure one ------------------------------------------------
def _run_random(hybrid, seed: int, kind: str, page_size: int, policy: str,
                page_ids: bool = False) -> list:
    """A random sequence of every hybrid call; what each returned, and the whole state after
    each, in comparable form. An eviction's trace is the page ids of the slots it freed
    whole and the auxiliary slots it freed, in order, an insert's the page ids of the
    caller's duplicated slots: computed from the records and the caller's slots, or with
    ``page_ids`` as the core hands them over (``evict(page_ids=True)``,
    ``insert(dup_pages=True)``)."""
    rng = random.Random(seed)
    if kind == "window":
        core = hybrid.HybridCore(page_size, policy, numpy_arrays=True, window=3 * page_size)
    else:
        core = hybrid.HybridCore(page_size, policy, numpy_arrays=True, state=True)
    bases = [[rng.randrange(1, 6) for _ in range(rng.randrange(2, 40))] for _ in range(5)]
    locks: list = []
    trace = []
    next_slot = [1000]

    def fresh(n):
        next_slot[0] += n
        return list(range(next_slot[0] - n, next_slot[0]))

    def node_at(tokens, ns):
        return core.match(tokens, ns).last_node

    def records(out):
        return [(v.tolist(), None if a is None else a.tolist(), w) for v, a, w in out]

    for _ in range(400):
        roll = rng.random()
        tokens = rng.choice(bases)[:rng.randrange(0, 40)] + [rng.randrange(1, 4)
                                                            for _ in range(rng.randrange(3))]
        ns = rng.choice((None, None, "a"))
        if roll < 0.35:
            kv = fresh(len(tokens))
            aux = fresh(len(tokens)) if kind == "window" else fresh(1)
            dup_from = rng.randrange(0, 30)
            result = core.insert(tokens, kv, aux, ns, rng.choice((0, 0, 1)),
                                 rng.randrange(0, 20), rng.randrange(0, 15) * page_size,
                                 dup_from, dup_pages=page_ids)
            if page_ids:
                duplicates = core.last_dup_pages.tolist()
            else:
                assert core.last_dup_pages is None
                duplicates = (np.array(kv[dup_from:result.prefix_len], dtype=np.int64)
                              [::page_size] // page_size).tolist()
            trace.append(("insert", result.prefix_len, path_of(result.last_node), core.aux_kept,
                          [(s, e, v.tolist(), lk) for s, e, v, lk in core.last_recovered],
                          duplicates))
            node = result.last_node
            if kind == "state" and node is not core.tree.root and rng.random() < 0.4:
                # the checkpoint's lock: taken on the inserted node, its path read with it
                depth = len(path_of(node))
                start = rng.randrange(0, depth + 1)
                got = core.relock(None, node, 0, 3, start, rng.randrange(start, depth + 1))
                trace.append(("relock", None if got is None else got.tolist()))
                locks.append((node, 0))
        elif roll < 0.6:
            m = core.match(tokens, ns)
            trace.append(("match", m.length, m.indices.tolist(), core.last_walk))
        elif roll < 0.72:
            node = node_at(tokens, ns)
            if node is not core.tree.root:
                core.lock(node, 1)
                locks.append((node, core.aux_lock(node, 1)))
        elif roll < 0.82 and locks:
            node, mark = locks.pop(rng.randrange(len(locks)))
            if kind == "state" and rng.random() < 0.5:  # the lock moves (or just goes)
                target = node_at(tokens, ns) if rng.random() < 0.7 else None
                depth = 0 if target is None else len(path_of(target))
                start = rng.randrange(0, depth + 1)
                got = core.relock(node, target, 3, 3, start, rng.randrange(start, depth + 1))
                trace.append(("relock", None if got is None else got.tolist()))
                if target is not None and target is not core.tree.root:
                    locks.append((target, 0))
            elif kind == "window" and rng.random() < 0.3:
                trace.append(("release", records(core.aux_release(node, mark))))
                core.lock(node, -1)
            else:
                core.aux_lock(node, -1, mark)
                core.lock(node, -1)
        elif roll < 0.97:
            want = (rng.randrange(0, 8), rng.randrange(0, 12))
            if page_ids:
                freed, aux_freed, pages, aux = core.evict(*want, page_ids=True)
                pages, aux = pages.tolist(), aux.tolist()
            else:
                freed, aux_freed, out = core.evict(*want)
                pages = [p for v, _, whole in out if whole
                         for p in (v[::page_size] // page_size).tolist()]
                aux = [s for _, a, _ in out if a is not None for s in a.tolist()]
            trace.append(("evict", freed, aux_freed, pages, aux))
        else:
            locks.clear()
            core.reset()
        core.check_aux()
        trace.append((shape(core), core.total_size(), core.evictable, core.protected,
                      core.aux_evictable, core.aux_protected,
                      [n.key.tolist() for n in core.aux_order()],
                      sorted((n.key.tolist(), n.last_access_time, n.hit_count, n.priority)
                             for n, d in core.tree.iter_nodes() if d)))
    return trace


@pytest.mark.parametrize("kind", ["window", "state"])
@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_page_ids_handed_over_are_what_the_records_and_slots_hold(hybrid, kind, page_size):
    """``evict(page_ids=True)`` decides as the records' eviction does and hands over the
    same page ids and auxiliary slots, in the same order; ``insert(dup_pages=True)`` the
    page ids of the caller's duplicated slots."""
    for seed in range(2):
        assert (_run_random(hybrid, seed, kind, page_size, "lru", page_ids=True)
                == _run_random(hybrid, seed, kind, page_size, "lru"))


@pytest.mark.parametrize("page_ids", [1, None, "yes", np.bool_(True)])
def test_page_id_flags_must_be_bools(hybrid, page_ids):
    core = hybrid.HybridCore(2, "lru", numpy_arrays=True, state=True)
    core.insert([9, 9, 9, 9], slots(1, 4), [50])
    before = (shape(core), core.total_size(), core.evictable, core.aux_evictable,
              core.inserts)
    with pytest.raises(TypeError, match="page_ids must be a bool"):
        core.evict(4, 1, page_ids=page_ids)
    with pytest.raises(TypeError, match="dup_pages must be a bool"):
        core.insert([9, 9, 9, 9, 8, 8], slots(20, 6), [51], dup_from=0, dup_pages=page_ids)
    assert (shape(core), core.total_size(), core.evictable, core.aux_evictable,
            core.inserts) == before
    assert core.last_dup_pages is None
    freed, aux_freed, pages, aux = core.evict(0, 0, page_ids=True)  # nothing: empty arrays
    assert (freed, aux_freed, pages.tolist(), aux.tolist()) == (0, 0, [], [])
    freed, aux_freed, pages, aux = core.evict(4, 1, page_ids=True)
    assert (freed, aux_freed, pages.tolist(), aux.tolist()) == (4, 1, [0, 1], [50])
    core.insert([9, 9, 9, 9], slots(1, 4), [50])
    result = core.insert([9, 9, 9, 9, 8, 8], slots(20, 6), [51], dup_from=2, dup_pages=True)
    assert (result.prefix_len, core.last_dup_pages.tolist()) == (4, [11])  # slots 22, 23
    core.insert([9, 9, 9, 9, 8, 8], slots(20, 6), [51], dup_from=2)
    assert core.last_dup_pages is None


@pytest.mark.parametrize("kind", ["window", "state"])
@pytest.mark.parametrize("page_size, policy", [(1, "lru"), (2, "lfu"), (1, "priority"),
                                               (2, "fifo"), (1, "mru")])
def test_the_compiled_hybrid_core_decides_as_the_pure_one(kind, page_size, policy):
    if "c" not in HYBRIDS:
        pytest.skip("the compiled modules are not built")
    for seed in range(3):
        pure = _run_random(HYBRIDS["python"], seed, kind, page_size, policy)
        compiled = _run_random(HYBRIDS["c"], seed, kind, page_size, policy)
        for step, (a, b) in enumerate(zip(pure, compiled)):
            assert a == b, f"seed {seed}, trace entry {step}: pure {a} != compiled {b}"

"""Session tags in the tree core (``tag_session``, ``untag_session``), on every core.

A session tags the leaf its last request ended on; a new leaf below a tagged node takes the
tag; a tagged node's eviction rank is its number of sessions; an evicted tagged leaf gives
its tags to its parent (not the root) inside ``evict``, before the parent can follow. Checked
against a model that keeps the tags in Python and hands the parent's rank to ``evict`` through
``on_remove`` (what the SGLang backend did before the core kept them): the same victims in the
same order, the same tags and ranks, on one random sequence per core and policy; and under bad
input, re-entry, splits, ``remove_leaf`` and ``reset``, with the heap's invariants after.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import check_invariants, core_of, node_tokens
from radixcache import EVICTION_POLICIES, RadixCache

INT64_MAX = 2**63 - 1


class PythonTags:
    """The model: tags kept in Python, ranks set through the cache, moved by ``on_remove``."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.tags: dict = {}  # node -> sessions
        self.tagged: dict = {}  # session -> nodes

    def tag(self, node, session) -> None:
        root = self.cache.root_node
        if node is root or session in self.tags.get(node, ()):
            return
        tagged = self.tagged.get(session, ())
        ancestor = node.parent if tagged else root
        while ancestor is not root and ancestor not in tagged:
            ancestor = ancestor.parent
        self._add(node, session)
        if ancestor is not root:
            self._drop(ancestor, session)

    def untag(self, session) -> None:
        for node in tuple(self.tagged.get(session, ())):
            self._drop(node, session)

    def on_remove(self, node):
        sessions = self.tags.pop(node, None)
        if sessions is None:
            return None
        parent = node.parent
        inherit = parent is not self.cache.root_node
        parent_tags = self.tags.get(parent) if inherit else None
        for session in sessions:
            tagged = self.tagged[session]
            tagged.discard(node)
            if inherit and (parent_tags is None or session not in parent_tags):
                if parent_tags is None:
                    parent_tags = self.tags[parent] = set()
                parent_tags.add(session)
                tagged.add(parent)
            elif not tagged:
                del self.tagged[session]
        return len(parent_tags) if parent_tags is not None else None

    def _add(self, node, session) -> None:
        self.tags.setdefault(node, set()).add(session)
        self.tagged.setdefault(session, set()).add(node)
        self.cache.set_eviction_rank(node, len(self.tags[node]))

    def _drop(self, node, session) -> None:
        tags = self.tags[node]
        tags.discard(session)
        self.tagged[session].discard(node)
        if not self.tagged[session]:
            del self.tagged[session]
        if not tags:
            del self.tags[node]
        self.cache.set_eviction_rank(node, len(tags))


def tagged_nodes(cache, session) -> tuple:
    return core_of(cache).tagged_nodes(session)


def parent_and_leaf(make_cache) -> tuple:
    """A cache holding [1] and [1, 2] as two nodes: (cache, [1], [2] below it)."""
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2])
    parent = cache.insert([1]).last_node
    return cache, parent, cache.match_prefix([1, 2]).last_node


def paths(nodes) -> list:
    return sorted(map(node_tokens, nodes))


def tag_table(cache, sessions) -> dict:
    """{session: its tagged nodes' token paths} from the core."""
    return {s: paths(tagged_nodes(cache, s)) for s in sessions if tagged_nodes(cache, s)}


def snapshot(cache, sessions) -> tuple:
    """Everything tags change: the tables, every node's rank and tags, the sizes."""
    tree = core_of(cache).tree
    nodes = [node for node, _ in tree.iter_nodes() if node is not tree.root]
    return (tag_table(cache, sessions),
            sorted((node_tokens(n), cache.eviction_rank(n), core_of(cache).session_tags(n))
                   for n in nodes),
            cache.total_size(), cache.evictable_size())


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_core_tags_evict_as_the_python_model(core_name, policy):
    """One random sequence on two caches of the core: tags in the core against tags in
    Python (ranks through ``set_eviction_rank``, moved by ``on_remove``)."""
    ours = RadixCache(page_size=2, eviction_policy=policy, core=core_name, array_type="numpy")
    theirs = RadixCache(page_size=2, eviction_policy=policy, core=core_name,
                        array_type="numpy")
    model = PythonTags(theirs)
    rng = random.Random(f"tags-{policy}")
    locked: dict = {id(ours): [], id(theirs): []}
    victims: dict = {id(ours): [], id(theirs): []}
    moved = 0
    for step in range(2000):
        roll = rng.random()
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        session = rng.randrange(6)
        num_tokens = rng.randrange(1, 8)
        for cache in (ours, theirs):
            if roll < 0.3:
                cache.insert(seq)
            elif roll < 0.45:
                cache.match_prefix(seq)
            elif roll < 0.65:
                node = cache.match_prefix(seq).last_node
                if cache is ours:
                    cache.tag_session(node, session)
                else:
                    model.tag(node, session)
            elif roll < 0.68:
                if cache is ours:
                    cache.untag_session(session)
                else:
                    model.untag(session)
            elif roll < 0.74:
                node = cache.match_prefix(seq).last_node
                cache.inc_lock_ref(node)
                locked[id(cache)].append(node)
            elif roll < 0.8:
                if locked[id(cache)]:
                    cache.dec_lock_ref(locked[id(cache)].pop(0))
            else:
                seen = victims[id(cache)]
                if cache is ours:
                    tagged = {n for s in range(6) for n in tagged_nodes(cache, s)}

                    def note(node, seen=seen, tagged=tagged):
                        seen.append(node_tokens(node))
                        return None

                    cache.evict(num_tokens, on_remove=note)
                    moved += sum(node.evicted for node in tagged)
                else:
                    def on_remove(node, seen=seen):
                        seen.append(node_tokens(node))
                        return model.on_remove(node)

                    cache.evict(num_tokens, on_remove=on_remove)
        assert victims[id(ours)] == victims[id(theirs)], f"step {step}"
        assert tag_table(ours, range(6)) == {s: paths(n) for s, n in model.tagged.items()}, \
            f"step {step}"
    for cache in (ours, theirs):
        check_invariants(cache)
    assert len(victims[id(ours)]) > 100 and moved >= 10, (len(victims[id(ours)]), moved)


def test_a_new_leaf_takes_the_tag_and_ranks_count_sessions(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    top = cache.insert([1, 2]).last_node
    assert cache.tag_session(top, 7) is True
    assert cache.tag_session(top, 7) is False  # tagged already: nothing changes
    assert cache.tag_session(top, 8) is True
    assert cache.eviction_rank(top) == 2
    leaf = cache.insert([1, 2, 3, 4]).last_node
    assert cache.tag_session(leaf, 7) is True
    assert tagged_nodes(cache, 7) == (leaf,)  # the ancestor gave its tag to the new leaf
    assert core_of(cache).session_tags(top) == (8,) and cache.eviction_rank(top) == 1
    assert core_of(cache).session_tags(leaf) == (7,) and cache.eviction_rank(leaf) == 1
    assert cache.tag_session(cache.root_node, 7) is False and tagged_nodes(cache, 7) == (leaf,)
    assert cache.untag_session(7) == 1 and cache.untag_session(7) == 0
    assert cache.eviction_rank(leaf) == 0 and tagged_nodes(cache, 7) == ()
    check_invariants(cache)


def test_an_evicted_leaf_gives_its_tags_to_its_parent_before_it_competes(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2, 3])
    cache.insert([1])  # [1]: a node of its own, the parent of [2, 3]
    other = cache.insert([5]).last_node
    parent = cache.match_prefix([1]).last_node
    leaf = cache.match_prefix([1, 2, 3]).last_node
    cache.tag_session(leaf, 1)
    cache.tag_session(other, 2)
    cache.match_prefix([5])
    cache.match_prefix([1])  # [1] used last: of two leaves of rank 1, [5] goes first
    seen = []
    # on_remove answers rank 0 for the parent: the tag it takes overrules that (rank 1).
    assert cache.evict(3, on_remove=lambda node: seen.append(node_tokens(node)) or 0) == 3
    assert seen == [[1, 2, 3], [5]] and not parent.evicted
    assert tagged_nodes(cache, 1) == (parent,) and cache.eviction_rank(parent) == 1
    assert tagged_nodes(cache, 2) == ()  # [5]'s parent is the root: its tag went
    check_invariants(cache)


def test_a_tag_the_parent_holds_already_goes_and_the_root_takes_none(make_cache):
    cache, parent, leaf = parent_and_leaf(make_cache)
    cache.tag_session(parent, 3)
    core_of(cache).tag_session(leaf, 4)
    cache.set_eviction_rank(leaf, 0)  # (a set rank stays until the tags change it)
    core_of(cache).tag_session(leaf, 3)  # the parent gives session 3's tag to the leaf
    cache.tag_session(parent, 3)  # and takes one again: both tagged by session 3
    assert cache.eviction_rank(leaf) == 2 and cache.eviction_rank(parent) == 1
    assert cache.evict(1) == 1 and leaf.evicted
    assert core_of(cache).session_tags(parent) == (3, 4)
    assert cache.eviction_rank(parent) == 2
    assert cache.evict(1) == 1 and parent.evicted  # its parent is the root: tags go
    assert tagged_nodes(cache, 3) == tagged_nodes(cache, 4) == ()
    check_invariants(cache)


def test_remove_leaf_moves_tags_and_reset_drops_them(make_cache):
    cache, parent, leaf = parent_and_leaf(make_cache)
    cache.tag_session(leaf, 5)
    assert core_of(cache).remove_leaf(leaf) == 1
    assert tagged_nodes(cache, 5) == (parent,) and cache.eviction_rank(parent) == 1
    cache.reset()
    assert tagged_nodes(cache, 5) == ()
    node = cache.insert([1]).last_node
    assert core_of(cache).session_tags(node) == () and cache.eviction_rank(node) == 0
    check_invariants(cache)


def test_a_reverted_insert_leaf_gives_its_tags_to_its_parent(make_cache):
    """``revert_insert`` takes the insert's new leaf out of the tree as an eviction does: a
    tag it was given moves to its parent and no table keeps the detached leaf."""
    cache = make_cache(page_size=1, array_type="numpy")
    parent = cache.insert([1, 2]).last_node
    core = core_of(cache)
    core.enter("test")
    try:
        core.insert(np.array([1, 2, 3], dtype=np.int64), np.array([10, 11, 12], dtype=np.int64),
                    held=True)
        leaf = core.take_new_leaf()
        assert core.tag_session(leaf, 7, held=True)
        core.revert_insert(core.take_adopted(), leaf, held=True)
    finally:
        core.leave()
    assert leaf.evicted and tagged_nodes(cache, 7) == (parent,)
    assert cache.eviction_rank(parent) == 1 and core.heap.rank_of(leaf) == 0
    assert cache.untag_session(7) == 1 and tagged_nodes(cache, 7) == ()
    check_invariants(cache)


@pytest.mark.parametrize("rank", [None, 0])
def test_a_victim_taken_out_by_its_on_remove_raises_and_stays_consistent(make_cache, rank):
    """An ``on_remove`` that removes its victim through the core (``held`` calls bypass the
    guard) leaves ``evict`` a node it may no longer detach: ``RuntimeError``, and the tree and
    tags stay consistent (the compiled core read a freed parent pointer here)."""
    cache, parent, leaf = parent_and_leaf(make_cache)
    cache.tag_session(leaf, 5)
    core = core_of(cache)

    def on_remove(victim):
        core.revert_insert([], victim, held=True)
        return rank

    with pytest.raises(RuntimeError, match="changed during a callback"):
        cache.evict(1, on_remove=on_remove)
    assert leaf.evicted and tagged_nodes(cache, 5) == (parent,)
    check_invariants(cache)
    assert cache.evict(10) == 1 and tagged_nodes(cache, 5) == ()


def test_tags_stay_with_the_lower_half_of_a_split(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    leaf = cache.insert([1, 2, 3, 4]).last_node
    cache.insert([9])
    cache.tag_session(leaf, 1)
    upper = cache.match_prefix([1, 2]).last_node  # splits the leaf
    assert upper is not leaf and leaf.parent is upper
    assert tagged_nodes(cache, 1) == (leaf,) and core_of(cache).session_tags(upper) == ()
    assert cache.evict(2) == 3 and leaf.evicted  # [9] (rank 0), then the tagged [3, 4]
    assert tagged_nodes(cache, 1) == (upper,) and cache.eviction_rank(upper) == 1
    check_invariants(cache)


def test_bad_input_changes_nothing(make_cache):
    cache = make_cache(page_size=1, array_type="numpy")
    cache.insert([1, 2, 3])
    node = cache.insert([1, 2]).last_node
    leaf = cache.match_prefix([1, 2, 3]).last_node
    cache.tag_session(node, 1)
    other_cache = make_cache(page_size=1, array_type="numpy")
    other = other_cache.insert([1]).last_node
    gone = cache.insert([7]).last_node
    core_of(cache).remove_leaf(gone)
    before = snapshot(cache, range(3))
    for session, error in [(1.0, TypeError), ("1", TypeError), (True, TypeError),
                           (np.int64(1), TypeError), (None, TypeError), (-1, ValueError),
                           (INT64_MAX + 1, ValueError)]:
        with pytest.raises(error, match="session"):
            cache.tag_session(leaf, session)
        with pytest.raises(error, match="session"):
            cache.untag_session(session)
    with pytest.raises(ValueError, match="another cache"):
        cache.tag_session(other, 1)
    with pytest.raises(ValueError, match="evicted"):
        cache.tag_session(gone, 1)
    with pytest.raises(TypeError, match="RadixTreeNode"):
        cache.tag_session("node", 1)
    assert snapshot(cache, range(3)) == before
    cache.tag_session(leaf, INT64_MAX)  # the top of the range
    assert tagged_nodes(cache, INT64_MAX) == (leaf,)
    check_invariants(cache)


def test_a_host_tier_has_no_tags(core_name):
    cache = RadixCache(page_size=1, core=core_name, host_tier=True, array_type="numpy")
    node = cache.insert([1, 2]).last_node
    with pytest.raises(ValueError, match="host tier"):
        cache.tag_session(node, 1)
    assert tagged_nodes(cache, 1) == () and cache.eviction_rank(node) == 0


def test_tags_may_not_change_from_inside_a_call(make_cache):
    """``on_remove`` runs under the guard: tagging from it is refused, nothing changes."""
    cache, parent, leaf = parent_and_leaf(make_cache)
    cache.tag_session(leaf, 1)
    before = snapshot(cache, range(3))

    def tag(victim):
        cache.tag_session(parent, 2)

    def untag(victim):
        cache.untag_session(1)

    for hook in (tag, untag):
        with pytest.raises(RuntimeError, match="re-entered"):
            cache.evict(10, on_remove=hook)
        assert snapshot(cache, range(3)) == before
    check_invariants(cache)
    assert cache.evict(10) == 2 and tagged_nodes(cache, 1) == ()


def test_the_heap_stays_small_under_tag_churn(make_cache):
    rng = random.Random(3)
    cache = make_cache(page_size=1, array_type="numpy")
    nodes = [cache.insert([i, i + 1]).last_node for i in range(0, 400, 2)]
    for _ in range(20_000):
        session = rng.randrange(8)
        if rng.random() < 0.1:
            cache.untag_session(session)
        else:
            cache.tag_session(rng.choice(nodes), session)
    check_invariants(cache)
    assert len(core_of(cache).heap) <= 4 * 1024 + 4 * len(nodes)
    for session in range(8):
        cache.untag_session(session)
    assert all(cache.eviction_rank(node) == 0 for node in nodes)
    assert cache.evict(10**6) == 400 and len(core_of(cache).heap) == 0

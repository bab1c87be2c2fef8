"""Differential test: radixcache makes the same decisions as SGLang 0.5.23's ``RadixCache``.

Random call sequences -- inserts with values (and priorities, and namespaces), matches that
end inside nodes (so they split), ``inc_lock_ref``/``dec_lock_ref``, evictions -- are replayed
on radixcache (both cores, via the ``make_cache`` fixture) and on SGLang's classic
``RadixCache`` (``RadixCache.create_simulated``), page sizes 1, 2, 4 and 16, every eviction
policy both have. After every call the results must be equal: match lengths and index values,
``prefix_len``, lock deltas, evictable/protected/total sizes, tokens freed per ``evict`` and the
very index tensors each eviction freed, in order; every few calls the two whole trees must be
equal node for node (key, values, lock_ref, priority, hit_count), with access and creation
times in the same order.

SGLang's clock is ``time.monotonic()``; here it is a counter that advances once per call, so
every ordering is deterministic. Before every ``evict`` the test checks that SGLang's
evictable leaves have pairwise distinct eviction keys (SGLang breaks ties arbitrarily), so each
eviction order compared is the only one SGLang could produce.

The deliberate differences (docs/sglang.md) are applied to SGLang's side,
exactly, never by comparing less:

1. Split rule: a match or insert ending inside a node refreshes only the matched upper half;
   SGLang stamps the node before splitting it, so the unmatched lower half looks fresh too.
   Here SGLang's lower half gets back the access time it had before the call.
2. The new upper node of a split was created with the node it was cut from (its KV was
   computed then); SGLang dates it at the split. Here SGLang's upper half gets the lower
   half's creation time (this matters for fifo/filo once the upper half becomes a leaf).
3. Priority is the first key of every eviction policy in radixcache; in SGLang only of
   ``priority``. Here every SGLang policy is wrapped as ``(node.priority, policy key)``.
4. The logical clock: radixcache ticks once per touching call; only the order of times is
   compared, which the SGLang clock above reproduces.

Skips (with the reason) where SGLang is not importable; ``tests/install_sglang.sh`` installs it,
and CI sets ``RADIXCACHE_REQUIRE_SGLANG=1`` so that a broken install fails instead of skipping.
"""

from __future__ import annotations

import os
import random
import time
import types
import zlib
from array import array

import pytest
import torch

try:
    from sglang.srt.mem_cache import radix_cache as sgl_radix
    from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InsertParams,
                                                        MatchPrefixParams)
    from sglang.srt.mem_cache.utils import get_eviction_strategy
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

from conftest import check_invariants

PAGE_SIZES = (1, 2, 4, 16)
POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")
#: Random steps per (page size, policy, core). With the touches before evictions each
#: sequence compares about 2.5 * OPS calls: about 170,000 per core over the 28 sequences.
OPS = 2500
#: Calls compared by each test, summed in the closing summary line of this module.
COMPARED: list[int] = []
#: Whole-tree comparison every this many calls (and at the end).
TREE_CHECK_EVERY = 25


# -- SGLang's side, with a deterministic clock and the deliberate differences applied -------
class _Clock:
    """Stands in for the ``time`` module inside SGLang's radix_cache: a frozen counter."""

    def __init__(self) -> None:
        self.now = 0.0

    def tick(self) -> None:
        self.now += 1.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = staticmethod(time.perf_counter)


class _TreeNode(sgl_radix.TreeNode):
    """SGLang's TreeNode, remembering the access time each stamp overwrote."""

    @property
    def last_access_time(self) -> float:
        return self._access_time

    @last_access_time.setter
    def last_access_time(self, value: float) -> None:
        self.previous_access_time = getattr(self, "_access_time", None)
        self._access_time = value


class _PriorityFirst:
    """An SGLang eviction strategy with the node's priority as its first key (difference 3)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def get_priority(self, node):
        return (node.priority, self.inner.get_priority(node))


class SGLangSide:
    """SGLang's ``RadixCache.create_simulated`` driven with radixcache's call shapes."""

    def __init__(self, page_size: int, policy: str, clock: _Clock) -> None:
        self.clock = clock
        self.freed: list[list[int]] = []
        allocator = types.SimpleNamespace(
            device="cpu",
            free_segment=lambda value, start_pos=0: self.freed.append(value.tolist()))
        self.cache = sgl_radix.RadixCache.create_simulated(mock_allocator=allocator,
                                                           page_size=page_size)
        self.cache.eviction_strategy = _PriorityFirst(get_eviction_strategy(policy))
        split = self.cache._split_node

        def split_as_radixcache(key, child, split_len):
            # SGLang stamped ``child`` just before splitting it; undo that (difference 1).
            assert child.last_access_time == clock.now
            stamped_over = child.previous_access_time
            upper = split(key, child, split_len)
            child.last_access_time = stamped_over
            upper.creation_time = child.creation_time  # difference 2
            return upper

        self.cache._split_node = split_as_radixcache

    def key(self, tokens, extra_key):
        return sgl_radix.RadixKey(array("q", tokens), extra_key)

    def insert(self, tokens, values, extra_key, priority):
        self.clock.tick()
        result = self.cache.insert(InsertParams(
            key=self.key(tokens, extra_key), value=torch.tensor(values, dtype=torch.int64),
            priority=priority))
        return result.prefix_len, result.last_device_node

    def match(self, tokens, extra_key):
        self.clock.tick()
        result = self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens, extra_key)))
        node = result.last_device_node
        return result.device_prefix_len, self.cache.path_device_indices(node).tolist(), node

    def evict(self, num_tokens):
        self.clock.tick()
        self.freed = []
        freed = self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        return freed, self.freed

    def leaf_keys(self):
        strategy = self.cache.eviction_strategy
        return [strategy.get_priority(leaf) for leaf in self.cache.evictable_leaves]

    def attached(self, node) -> bool:
        if node is self.cache.root_node:
            return True
        parent = node.parent
        return parent is not None and any(c is node for c in parent.children.values())

    def sizes(self):
        cache = self.cache
        return cache.evictable_size(), cache.protected_size(), cache.total_size()


# -- whole-tree comparison ---------------------------------------------------------------
def _radixcache_nodes(cache):
    rows = []
    stack = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children:
            key = tuple(int(t) for t in child.key)
            child_path = path + key
            rows.append(((repr(child.extra_key), child_path), len(key),
                         tuple(child.value.tolist()), child.lock_ref, child.priority,
                         child.hit_count, child.last_access_time, child.created_time))
            stack.append((child, child_path))
    return sorted(rows, key=lambda row: row[0])


def _sglang_nodes(sgl):
    rows = []
    root = sgl.cache.root_node
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = tuple(child.key.token_ids[: len(child.key)])
            child_path = path + key
            rows.append(((repr(child.key.extra_key), child_path), len(key),
                         tuple(child.value.tolist()), child.lock_ref, child.priority,
                         child.hit_count, child.last_access_time, child.creation_time))
            stack.append((child, child_path))
    return sorted(rows, key=lambda row: row[0])


def _same_order(ours: list, theirs: list, what: str) -> None:
    """Two lists of times, node for node, order every pair of nodes the same way."""
    pairs = sorted(zip(ours, theirs))
    for (our_a, their_a), (our_b, their_b) in zip(pairs, pairs[1:]):
        if our_a == our_b:
            assert their_a == their_b, f"{what}: equal here, {their_a} != {their_b} in SGLang"
        else:
            assert their_a < their_b, f"{what}: {our_a} < {our_b} here, not in SGLang"


def assert_same_tree(cache, sgl) -> None:
    ours, theirs = _radixcache_nodes(cache), _sglang_nodes(sgl)
    assert [row[:6] for row in ours] == [row[:6] for row in theirs]
    _same_order([row[6] for row in ours], [row[6] for row in theirs], "last access time")
    _same_order([row[7] for row in ours], [row[7] for row in theirs], "creation time")


# -- the random call sequence ------------------------------------------------------------
def _pages(page_size: int) -> list[list[int]]:
    """A few distinct pages; with page_size > 1 some share all but their last token, so a
    mismatch inside a page (rounded down to the page start) happens often."""
    if page_size == 1:
        return [[t] for t in range(4)]
    base = [7] * (page_size - 1)
    return [base + [0], base + [1], [3] * page_size, [5] + [9] * (page_size - 1)]


class Replay:
    def __init__(self, make_cache, page_size: int, policy: str, seed: int,
                 monkeypatch) -> None:
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.pages = _pages(page_size)
        clock = _Clock()
        monkeypatch.setattr(sgl_radix, "time", clock)
        monkeypatch.setattr(sgl_radix, "TreeNode", _TreeNode)
        self.ours = make_cache(page_size=page_size, eviction_policy=policy)
        self.sgl = SGLangSide(page_size, policy, clock)
        self.sequences: list[tuple[list[int], object]] = []
        self.handles: list[tuple] = []   # (our node, SGLang node) from matches and inserts
        self.locked: list[tuple] = []
        self.next_slot = 0
        self.calls = 0      # random steps
        self.compared = 0   # calls made on both sides and compared

    # sequences: a known one cut short (often inside a node), then new pages and a tail
    def tokens(self) -> tuple[list[int], object]:
        rng = self.rng
        if self.sequences and rng.random() < 0.7:
            known, extra_key = rng.choice(self.sequences)
            tokens = known[: rng.randint(0, len(known))]
        else:
            tokens, extra_key = [], rng.choice((None, None, None, "lora-a"))
        for _ in range(rng.randint(0, 5)):
            tokens = tokens + rng.choice(self.pages)
        if rng.random() < 0.3:
            tokens = tokens + [rng.randrange(4) for _ in range(rng.randrange(self.page_size))]
        return tokens, extra_key

    def check_sizes(self) -> None:
        ours = self.ours
        assert (ours.evictable_size(), ours.protected_size(), ours.total_size()) \
            == self.sgl.sizes()

    def insert(self) -> None:
        tokens, extra_key = self.tokens()
        values = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        priority = self.rng.choice((0, 0, 0, 1, 2))
        result = self.ours.insert(tokens, torch.tensor(values, dtype=torch.int64), extra_key,
                                  priority)
        prefix_len, sgl_node = self.sgl.insert(tokens, values, extra_key, priority)
        assert result.prefix_len == prefix_len
        self.compared += 1
        self.handles.append((result.last_node, sgl_node))
        if len(tokens) >= self.page_size:
            self.sequences.append((tokens, extra_key))

    def match(self, tokens=None, extra_key=None) -> None:
        if tokens is None:
            tokens, extra_key = self.tokens()
        result = self.ours.match_prefix(tokens, extra_key)
        length, indices, sgl_node = self.sgl.match(tokens, extra_key)
        assert result.length == length
        assert result.indices.tolist() == indices
        self.compared += 1
        self.handles.append((result.last_node, sgl_node))

    def lock(self) -> None:
        live = [pair for pair in self.handles[-20:] if not pair[0].evicted]
        if not live:
            return
        node, sgl_node = self.rng.choice(live)
        assert self.sgl.attached(sgl_node)
        assert self.ours.inc_lock_ref(node) == self.sgl.cache.inc_lock_ref(sgl_node).delta
        self.compared += 1
        self.locked.append((node, sgl_node))

    def unlock(self) -> None:
        if not self.locked:
            return
        node, sgl_node = self.locked.pop(self.rng.randrange(len(self.locked)))
        assert self.ours.dec_lock_ref(node) == self.sgl.cache.dec_lock_ref(sgl_node).delta
        self.compared += 1

    def evict(self) -> None:
        if self.rng.random() < 0.5:
            # Touch the inserted sequences in a random order first, so recency differs.
            for tokens, extra_key in self.rng.sample(self.sequences, len(self.sequences)):
                self.match(tokens, extra_key)
        keys = self.sgl.leaf_keys()
        assert len(set(keys)) == len(keys), "SGLang's eviction order would be ambiguous"
        num_tokens = self.rng.randint(1, max(1, self.ours.evictable_size() // 2))
        ours_freed: list[list[int]] = []
        freed = self.ours.evict(num_tokens, lambda value: ours_freed.append(value.tolist()))
        sgl_freed, sgl_values = self.sgl.evict(num_tokens)
        assert freed == sgl_freed
        assert ours_freed == sgl_values
        self.compared += 1
        # Forget evicted sequences now and then, so the tree does not only grow.
        if len(self.sequences) > 40:
            self.sequences = self.rng.sample(self.sequences, 20)

    def step(self) -> None:
        action = self.rng.choices(
            (self.insert, self.match, self.lock, self.unlock, self.evict),
            weights=(30, 25, 12, 12, 8))[0]
        action()
        self.calls += 1
        self.check_sizes()
        if self.calls % TREE_CHECK_EVERY == 0:
            assert_same_tree(self.ours, self.sgl)

    def finish(self) -> None:
        while self.locked:
            self.unlock()
            self.check_sizes()
        assert_same_tree(self.ours, self.sgl)
        check_invariants(self.ours)
        # Everything unlocked: evicting all must free the same tokens in the same order.
        self.evict_all()

    def evict_all(self) -> None:
        keys = self.sgl.leaf_keys()
        assert len(set(keys)) == len(keys)
        total = self.ours.total_size()
        ours_freed: list[list[int]] = []
        assert self.ours.evict(total + 1, lambda v: ours_freed.append(v.tolist())) == total
        sgl_freed, sgl_values = self.sgl.evict(total + 1)
        assert sgl_freed == total and ours_freed == sgl_values
        assert self.sgl.sizes() == (0, 0, 0) and self.ours.total_size() == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
def test_same_decisions_as_sglang(make_cache, monkeypatch, page_size, policy):
    seed = zlib.crc32(f"{page_size}-{policy}".encode())
    replay = Replay(make_cache, page_size, policy, seed=seed, monkeypatch=monkeypatch)
    for _ in range(OPS):
        replay.step()
    stats = replay.ours.stats()
    replay.finish()
    # The sequence really exercised what it compares: splits, evictions, partial matches.
    assert stats.splits > 50 and stats.evictions > 100 and stats.matched_tokens > 0
    assert replay.compared > OPS
    COMPARED.append(replay.compared)


def test_split_rule_correction_matters(make_cache, monkeypatch):
    """Without correction 1, SGLang's stamped lower half makes the two evict different
    leaves in this scenario, so the correction above is known to matter."""
    clock = _Clock()
    monkeypatch.setattr(sgl_radix, "time", clock)
    monkeypatch.setattr(sgl_radix, "TreeNode", _TreeNode)
    ours = make_cache(page_size=1)
    plain = sgl_radix.RadixCache.create_simulated(mock_allocator=types.SimpleNamespace(
        device="cpu", free_segment=lambda value, start_pos=0: None))
    long_seq, short_seq = list(range(10)) + [100] * 10, [200]
    for tokens in (long_seq, short_seq):
        clock.tick()
        ours.insert(tokens)
        plain.insert(InsertParams(key=sgl_radix.RadixKey(array("q", tokens))))
    # A match ending inside the long node: radixcache refreshes only [0..9].
    clock.tick()
    assert ours.match_prefix(long_seq[:10]).length == 10
    assert plain.match_prefix(MatchPrefixParams(
        key=sgl_radix.RadixKey(array("q", long_seq[:10])))).device_prefix_len == 10
    # radixcache frees the 10-token lower half (older than [200]); SGLang frees [200].
    assert ours.evict(1) == 10
    assert plain.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 1


def teardown_module(module) -> None:
    if COMPARED:
        print(f"\ntest_vs_sglang: {sum(COMPARED)} calls compared with SGLang "
              f"in {len(COMPARED)} sequences")

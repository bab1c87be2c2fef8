"""Cache statistics: ``stats()`` against a page-level model of the radix tree kept by the test
over random operation sequences, plus ``reset_stats()``/``reset()`` and the frozen dataclass."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_invariants, page_sequences
from radixcache import CacheStats

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "slru", "priority")


class TreeModel:
    """What the cache should hold, one entry per cached page.

    A position is ``(extra_key, *tokens)`` of a page-aligned prefix; ``(extra_key,)`` is the
    namespace's root. A radix node is the run of positions from just below one boundary down to
    the next, so the node count is the number of boundaries and a split adds one boundary
    without adding tokens. Every token prefix gets a kv value of its own, so the values handed
    to the free callback name exactly the positions that went.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.positions: set[tuple] = set()
        self.boundaries: set[tuple] = set()
        self.lock_counts: dict[tuple, int] = {}
        self.kv_of: dict[tuple, int] = {}
        self.prefix_of_kv: dict[int, tuple] = {}
        self.zero_counters()

    def zero_counters(self) -> None:
        self.lookups = self.matched = self.queried = 0
        self.inserts = self.inserted = self.evictions = self.evicted = self.splits = 0

    def clear(self) -> None:
        self.positions.clear()
        self.boundaries.clear()
        self.lock_counts.clear()
        self.zero_counters()

    # -- helpers ---------------------------------------------------------------------------
    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def kv_values(self, extra_key, tokens, end: int) -> list[int]:
        values = []
        for i in range(end):
            prefix = (extra_key, *tokens[:i + 1])
            if prefix not in self.kv_of:
                self.kv_of[prefix] = len(self.kv_of)
                self.prefix_of_kv[self.kv_of[prefix]] = prefix
            values.append(self.kv_of[prefix])
        return values

    def cached_length(self, extra_key, tokens, end: int) -> int:
        length = 0
        while length < end and (extra_key, *tokens[:length + self.page_size]) in self.positions:
            length += self.page_size
        return length

    def split_at(self, extra_key, tokens, length: int) -> None:
        """A walk ending at ``length`` inside a node splits it there."""
        position = (extra_key, *tokens[:length])
        if length and position not in self.boundaries:
            self.boundaries.add(position)
            self.splits += 1

    # -- operations ------------------------------------------------------------------------
    def match(self, extra_key, tokens) -> int:
        end = self.aligned(len(tokens))
        self.lookups += 1
        self.queried += end
        length = self.cached_length(extra_key, tokens, end)
        self.matched += length
        self.split_at(extra_key, tokens, length)
        return length

    def insert(self, extra_key, tokens) -> int:
        end = self.aligned(len(tokens))
        self.inserts += 1
        prefix_len = self.cached_length(extra_key, tokens, end)
        self.split_at(extra_key, tokens, prefix_len)
        if prefix_len < end:
            for length in range(prefix_len + self.page_size, end + 1, self.page_size):
                self.positions.add((extra_key, *tokens[:length]))
            self.boundaries.add((extra_key, *tokens[:end]))
            self.inserted += end - prefix_len
        return prefix_len

    def path(self, end_position: tuple) -> list[tuple]:
        extra_key, tokens = end_position[0], end_position[1:]
        return [(extra_key, *tokens[:length])
                for length in range(self.page_size, len(tokens) + 1, self.page_size)]

    def lock(self, end_position: tuple, delta: int) -> int:
        """Tokens that crossed between unlocked and locked."""
        moved = 0
        for position in self.path(end_position):
            before = self.lock_counts.get(position, 0)
            self.lock_counts[position] = before + delta
            if (before == 0) != (before + delta == 0):
                moved += self.page_size
        return moved

    def remove_freed(self, kv_values: list[int]) -> tuple:
        """Checks the freed values are one unlocked leaf node and removes it; returns its end."""
        prefixes = [self.prefix_of_kv[v] for v in kv_values]
        extra_key = prefixes[0][0]
        start = len(prefixes[0]) - 2  # tokens above the node
        end_position = prefixes[-1]
        for offset, prefix in enumerate(prefixes):
            assert prefix[0] == extra_key and len(prefix) == start + 2 + offset
            assert prefix[:-1] == (prefixes[offset - 1] if offset else prefix[:-1])
        end = len(end_position) - 1
        assert start % self.page_size == 0 and end % self.page_size == 0 and end > start
        above = end_position[:start + 1]
        assert start == 0 or above in self.boundaries, "freed run does not start at a node"
        assert end_position in self.boundaries, "freed run does not end at a node"
        removed = [end_position[:length + 1]
                   for length in range(start + self.page_size, end + 1, self.page_size)]
        for position in removed:
            assert position in self.positions
            assert self.lock_counts.get(position, 0) == 0, "a locked page was evicted"
            assert position == end_position or position not in self.boundaries
        assert not any(len(p) == len(end_position) + self.page_size
                       and p[:len(end_position)] == end_position for p in self.positions), \
            "an inner node was evicted"
        self.positions.difference_update(removed)
        self.boundaries.discard(end_position)
        self.evictions += 1
        self.evicted += end - start
        return end_position

    def expected_stats(self) -> CacheStats:
        total = self.page_size * len(self.positions)
        protected = self.page_size * sum(
            1 for p in self.positions if self.lock_counts.get(p, 0) > 0)
        return CacheStats(
            lookups=self.lookups,
            matched_tokens=self.matched,
            queried_tokens=self.queried,
            hit_rate=self.matched / self.queried if self.queried else 0.0,
            inserts=self.inserts,
            inserted_tokens=self.inserted,
            evictions=self.evictions,
            evicted_tokens=self.evicted,
            splits=self.splits,
            evictable_size=total - protected,
            protected_size=protected,
            total_size=total,
            node_count=len(self.boundaries),
        )


def _operations(page_size: int):
    """A small pool of sequences and operations naming them by index, so repeats are common."""
    pool = st.lists(page_sequences(page_size), min_size=1, max_size=6)
    seq_index = st.integers(0, 5)
    extra_keys = st.sampled_from([None, None, None, "ns"])
    insert = st.tuples(st.just("insert"), seq_index, extra_keys, st.sampled_from([0, 0, 1]))
    match = st.tuples(st.just("match"), seq_index, extra_keys)
    ops = st.lists(st.one_of(
        insert, insert, match, match,  # listed twice: drawn more often
        st.tuples(st.just("lock"), st.integers(0, 50)),
        st.tuples(st.just("unlock"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(0, 9)),
        st.just(("reset_stats",)),
        st.just(("reset",)),
    ), min_size=8, max_size=50)
    return st.tuples(pool, ops)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_stats_follow_a_model_of_the_tree(make_cache, page_size, data):
    policy = data.draw(st.sampled_from(POLICIES), label="policy")
    pool, operations = data.draw(_operations(page_size), label="pool, operations")
    cache = make_cache(page_size=page_size, eviction_policy=policy)
    model = TreeModel(page_size)
    handles: list = []  # [node, end position, alive]
    held: list = []     # handles this run locked, once per inc_lock_ref
    assert cache.stats() == model.expected_stats()
    for op in operations:
        kind = op[0]
        if kind == "insert":
            _, index, extra_key, priority = op
            tokens = pool[index % len(pool)]
            end = model.aligned(len(tokens))
            kv = model.kv_values(extra_key, tokens, end)
            result = cache.insert(tokens, kv, extra_key=extra_key, priority=priority)
            assert result.prefix_len == model.insert(extra_key, tokens)
            if end:
                handles.append([result.last_node, (extra_key, *tokens[:end]), True])
        elif kind == "match":
            _, index, extra_key = op
            tokens = pool[index % len(pool)]
            result = cache.match_prefix(tokens, extra_key=extra_key)
            length = model.match(extra_key, tokens)
            assert result.length == length
            assert result.indices.tolist() == model.kv_values(extra_key, tokens, length)
            if length:
                handles.append([result.last_node, (extra_key, *tokens[:length]), True])
        elif kind == "lock":
            live = [handle for handle in handles if handle[2]]
            if live:
                handle = live[op[1] % len(live)]
                assert cache.inc_lock_ref(handle[0]) == -model.lock(handle[1], +1)
                held.append(handle)
        elif kind == "unlock":
            if held:
                handle = held.pop(op[1] % len(held))
                assert cache.dec_lock_ref(handle[0]) == model.lock(handle[1], -1)
        elif kind == "evict":
            wanted = op[1]
            freed_values: list = []
            freed = cache.evict(wanted, freed_values.append)
            sizes = [values.numel() for values in freed_values]
            assert freed == sum(sizes)
            for values in freed_values:
                gone = model.remove_freed(values.tolist())
                for handle in handles:
                    if handle[1] == gone:
                        handle[2] = False
            # Stops as soon as enough is freed, and stops short only when nothing is left.
            assert freed >= wanted or model.expected_stats().evictable_size == 0
            assert not sizes or freed - sizes[-1] < wanted
        elif kind == "reset_stats":
            cache.reset_stats()
            model.zero_counters()
        else:
            cache.reset()
            model.clear()
            handles.clear()
            held.clear()
        check_invariants(cache)
        assert cache.stats() == model.expected_stats(), f"after {op}"
        for node, _, alive in handles:
            assert node.evicted != alive


# -- the dataclass and the resets ------------------------------------------------------------
def test_a_fresh_cache_reports_zeros_and_a_zero_hit_rate(make_cache):
    stats = make_cache().stats()
    assert isinstance(stats, CacheStats)
    assert all(getattr(stats, f.name) == 0 for f in dataclasses.fields(stats))
    assert stats.hit_rate == 0.0 and isinstance(stats.hit_rate, float)


def test_hit_rate_stays_zero_when_no_full_page_was_queried(make_cache):
    cache = make_cache(page_size=4)
    cache.insert([1, 2, 3, 4])
    cache.match_prefix([1, 2, 3])
    cache.match_prefix([])
    stats = cache.stats()
    assert (stats.lookups, stats.queried_tokens, stats.matched_tokens) == (2, 0, 0)
    assert stats.hit_rate == 0.0


def test_stats_are_frozen(make_cache):
    stats = make_cache().stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.lookups = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hit_rate = 1.0
    assert stats.lookups == 0


def test_stats_are_a_snapshot(make_cache):
    cache = make_cache()
    before = cache.stats()
    cache.insert([1, 2])
    assert before.inserts == 0 and cache.stats().inserts == 1


def test_hand_counted_stats_with_pages_of_four(make_cache):
    cache = make_cache(page_size=4)
    cache.insert(list(range(10)))             # 8 tokens stored, 2 dropped
    cache.insert(list(range(4)) + [9] * 5)    # shares a page: splits, stores 4 more
    cache.match_prefix(list(range(7)))        # queries 4, matches 4
    cache.match_prefix([5] * 9)               # queries 8, matches 0
    cache.match_prefix(list(range(8)) + [1])  # queries 8, matches 8
    freed = cache.evict(1)                    # one leaf of 4
    stats = cache.stats()
    assert freed == 4
    assert stats == CacheStats(
        lookups=3, matched_tokens=12, queried_tokens=20, hit_rate=12 / 20, inserts=2,
        inserted_tokens=12, evictions=1, evicted_tokens=4, splits=1, evictable_size=8,
        protected_size=0, total_size=8, node_count=2)


def test_locks_move_tokens_between_evictable_and_protected(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3]).last_node
    cache.insert([1, 2, 4])
    assert cache.inc_lock_ref(leaf) == -3
    stats = cache.stats()
    assert (stats.evictable_size, stats.protected_size, stats.total_size) == (1, 3, 4)
    assert cache.evict(10) == 1
    stats = cache.stats()
    assert (stats.evictions, stats.evicted_tokens, stats.total_size, stats.node_count) == \
        (1, 1, 3, 2)


def test_reset_stats_zeroes_counters_and_keeps_the_tree(make_cache):
    cache = make_cache()
    leaf = cache.insert([1, 2, 3, 4]).last_node
    cache.insert([1, 2, 5])
    cache.match_prefix([1, 2, 7])
    cache.inc_lock_ref(leaf)
    cache.insert([7])
    cache.evict(1)
    before = cache.stats()
    assert before.splits == 1 and before.evictions == 1
    cache.reset_stats()
    after = cache.stats()
    assert after == CacheStats(
        lookups=0, matched_tokens=0, queried_tokens=0, hit_rate=0.0, inserts=0,
        inserted_tokens=0, evictions=0, evicted_tokens=0, splits=0,
        evictable_size=before.evictable_size, protected_size=before.protected_size,
        total_size=before.total_size, node_count=before.node_count)
    assert after.total_size == 5 and after.protected_size == 4
    assert not leaf.evicted
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    assert cache.exists([1, 2, 3, 4])
    assert cache.stats().lookups == 1


def test_reset_clears_the_tree_and_the_counters(make_cache):
    cache = make_cache(page_size=2)
    leaf = cache.insert([1, 2, 3, 4]).last_node
    cache.insert([1, 2, 5, 6])
    cache.inc_lock_ref(leaf)
    cache.match_prefix([1, 2, 3, 4])
    cache.reset()
    stats = cache.stats()
    assert all(getattr(stats, f.name) == 0 for f in dataclasses.fields(stats))
    assert leaf.evicted
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.evict(100) == 0
    cache.insert([1, 2])
    assert cache.stats().inserted_tokens == 2 and cache.stats().node_count == 1


def test_evict_without_a_callback_still_counts(make_cache):
    cache = make_cache()
    cache.insert([1, 2, 3])
    cache.insert([4, 5])
    assert cache.evict(4) == 5
    stats = cache.stats()
    assert (stats.evictions, stats.evicted_tokens, stats.total_size) == (2, 5, 0)


def test_rejected_calls_do_not_count(make_cache):
    cache = make_cache()
    cache.insert([1, 2])
    before = cache.stats()
    with pytest.raises(TypeError):
        cache.match_prefix([1, "x"])
    with pytest.raises(TypeError):
        cache.insert([1, 2.5])
    with pytest.raises(ValueError):
        cache.insert([3, 4, 5], torch.tensor([1]))
    assert cache.stats() == before

"""RadixCache against a reference model, driven by Hypothesis through random call sequences.

The model keeps, per namespace, every cached page-aligned token prefix (a prefix-closed set
of tuples) with the KV values stored for its last page when that page was first inserted
(per page, not per token: with page_size > 1, sibling nodes may share a partial page).
Matches, inserts and locks are fully predicted. Eviction order is the implementation's
choice under its policy, so for evict the model learns what vanished (the callback's
tensors and the evicted node handles) and checks only what must hold: nothing locked went,
the callback saw exactly the vanished nodes' values, enough was freed or nothing evictable
is left.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conftest import check_invariants, node_tokens

NAMESPACES = (None, "ns")
# A small alphabet and short sequences so that prefixes collide a lot.
sequences = st.lists(st.integers(0, 3), max_size=12)
namespaces = st.sampled_from(NAMESPACES)

SETTINGS = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def tree_contents(cache) -> dict:
    """{namespace: {aligned prefix: its last page's kv values}} from the tree, and node spans."""
    contents = {ns: {} for ns in NAMESPACES}
    spans = []  # (node, namespace, path before the node, key tuple, value list, lock_ref)
    paths = [()]
    root = cache._tree.root
    for node, depth in cache._tree.iter_nodes():
        if node is root:
            continue
        del paths[depth:]
        before = paths[depth - 1]
        key = tuple(int(t) for t in node.key)
        values = [int(v) for v in node.value.tolist()]
        namespace = contents.setdefault(node.extra_key, {})
        page = cache.page_size
        for end in range(page, len(key) + 1, page):
            namespace[before + key[:end]] = tuple(values[end - page:end])
        paths.append(before + key)
        spans.append((node, node.extra_key, before, key, values, node.lock_ref))
    return contents, spans


class CacheMachine(RuleBasedStateMachine):
    make_cache = None  # set per core by the test below

    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    @initialize(page_size=st.sampled_from([1, 4]))
    def start(self, page_size):
        self.page_size = page_size
        self.cache = type(self).make_cache(page_size=page_size)
        self.model = {ns: {} for ns in NAMESPACES}
        self.terminals = {ns: set() for ns in NAMESPACES}
        self.locks = []  # (node handle, namespace, locked prefix)
        self.next_kv = 1000  # fresh, unique kv values
        self.steps_since_reset = 0

    # -- model helpers ---------------------------------------------------------------
    def model_match(self, seq, ns):
        cached = self.model[ns]
        length = 0
        values = []
        for end in range(self.page_size, len(seq) + 1, self.page_size):
            page_values = cached.get(tuple(seq[:end]))
            if page_values is None:
                break
            length = end
            values.extend(page_values)
        return length, values

    def page_ends(self, length: int) -> range:
        return range(self.page_size, length + 1, self.page_size)

    def locked_pages(self) -> set:
        """(namespace, aligned prefix) of every page some held lock protects."""
        pages = set()
        for _, ns, prefix in self.locks:
            pages.update((ns, prefix[:end]) for end in self.page_ends(len(prefix)))
        return pages

    def draw_seq(self, data, ns) -> list:
        """A fresh sequence, or (half the time) one that shares a cached prefix and then
        ends or diverges anywhere, inside a node included: that is what splits nodes."""
        cached = sorted(self.model[ns])
        if cached and data.draw(st.booleans(), label="near a cached prefix"):
            # Longest cached sequences most often: locking those and then splitting them
            # through a shorter match is the interesting case.
            leaves = [p for p in cached if not any(q[: len(p)] == p and q != p for q in cached)]
            base = data.draw(st.sampled_from(leaves) | st.sampled_from(cached), label="base")
            cut = data.draw(st.just(len(base)) | st.integers(0, len(base)), label="cut")
            tail = data.draw(st.lists(st.integers(0, 3), max_size=6), label="tail")
            return list(base[:cut]) + tail
        return data.draw(sequences, label="sequence")

    # -- rules ---------------------------------------------------------------------------
    @rule(data=st.data(), ns=namespaces,
          kv_kind=st.sampled_from(["none", "list", "numpy", "tensor"]),
          priority=st.integers(0, 2))
    def insert(self, data, ns, kv_kind, priority):
        seq = self.draw_seq(data, ns)
        expected_prefix, _ = self.model_match(seq, ns)
        if kv_kind == "none":
            kv, values = None, list(seq)
        else:
            values = list(range(self.next_kv, self.next_kv + len(seq)))
            self.next_kv += len(seq)
            kv = {"list": list, "numpy": np.array,
                  "tensor": lambda v: torch.tensor(v, dtype=torch.int64)}[kv_kind](values)
        result = self.cache.insert(seq, kv_indices=kv, extra_key=ns, priority=priority)
        assert result.prefix_len == expected_prefix
        aligned = len(seq) - len(seq) % self.page_size
        for end in self.page_ends(aligned):
            if end > expected_prefix:
                self.model[ns][tuple(seq[:end])] = tuple(values[end - self.page_size:end])
        if aligned == len(seq):
            self.terminals[ns].add(tuple(seq))
        assert node_tokens(result.last_node) == seq[:aligned]
        if aligned:
            assert result.last_node.extra_key == ns
        else:
            assert result.last_node is self.cache.root_node

    @rule(data=st.data(), ns=namespaces)
    def match(self, data, ns):
        seq = self.draw_seq(data, ns)
        length, values = self.model_match(seq, ns)
        result = self.cache.match_prefix(seq, extra_key=ns)
        assert result.length == length == len(result)
        assert result.indices.dtype == torch.int64
        assert result.indices.tolist() == values
        assert node_tokens(result.last_node) == seq[:length]
        if length == 0:
            assert result.last_node is self.cache.root_node

    @rule(data=st.data(), ns=namespaces)
    def exists(self, data, ns):
        seq = self.draw_seq(data, ns)
        if not seq:
            # The empty sequence's namespace handling is pinned by test_api instead.
            return
        expected = tuple(seq) in self.terminals[ns]
        assert self.cache.exists(seq, extra_key=ns) == expected
        if ns is None:
            assert (seq in self.cache) == expected

    @rule(data=st.data(), ns=namespaces)
    def lock(self, data, ns):
        seq = self.draw_seq(data, ns)
        length, _ = self.model_match(seq, ns)
        result = self.cache.match_prefix(seq, extra_key=ns)
        assert result.length == length
        if length == 0:
            assert self.cache.inc_lock_ref(result.last_node) == 0  # the root: a no-op
            return
        prefix = tuple(seq[:length])
        already = self.locked_pages()
        newly = sum((ns, prefix[:end]) not in already for end in self.page_ends(length))
        assert self.cache.inc_lock_ref(result.last_node) == -newly * self.page_size
        self.locks.append((result.last_node, ns, prefix))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        index = data.draw(st.integers(0, len(self.locks) - 1), label="lock index")
        node, ns, prefix = self.locks.pop(index)
        still = self.locked_pages()
        released = sum((ns, prefix[:end]) not in still for end in self.page_ends(len(prefix)))
        assert self.cache.dec_lock_ref(node) == released * self.page_size

    @precondition(lambda self: self.cache.total_size() > 0)
    @rule(num_tokens=st.integers(0, 10))
    def evict(self, num_tokens):
        _, spans = tree_contents(self.cache)
        evictable_before = self.cache.evictable_size()
        got = []
        freed = self.cache.evict(num_tokens, lambda idx: got.append(idx.tolist()))
        vanished = [span for span in spans if span[0].evicted]
        assert all(lock_ref == 0 for *_, lock_ref in vanished), "a locked node was evicted"
        assert freed == sum(len(key) for _, _, _, key, _, _ in vanished)
        # The callback saw each vanished node's indices exactly once.
        assert sorted(got) == sorted(values for *_, values, _ in vanished)
        assert self.cache.evictable_size() == evictable_before - freed
        for _, ns, before, key, _, _ in vanished:
            for end in self.page_ends(len(key)):
                del self.model[ns][before + key[:end]]
        for ns in NAMESPACES:
            self.terminals[ns] = {t for t in self.terminals[ns] if t in self.model[ns]}
        assert self.locked_pages() <= {
            (ns, prefix) for ns in NAMESPACES for prefix in self.model[ns]
        }
        if freed < num_tokens:
            # Nothing evictable may be left behind.
            assert self.cache.evictable_size() == 0
            _, spans = tree_contents(self.cache)
            assert all(node.num_children or lock_ref for node, *_, lock_ref in spans)

    # Hypothesis picks an argument-less rule very often; a cache reset every few steps
    # would keep the tree tiny.
    @precondition(lambda self: self.steps_since_reset >= 20)
    @rule()
    def reset(self):
        held = [node for node, _, _ in self.locks]
        self.cache.reset()
        assert all(node.evicted for node in held)
        if held:
            with pytest.raises(ValueError):
                self.cache.dec_lock_ref(held[0])
        self.model = {ns: {} for ns in NAMESPACES}
        self.terminals = {ns: set() for ns in NAMESPACES}
        self.locks = []
        self.steps_since_reset = 0

    # -- after every step ------------------------------------------------------------------
    @invariant()
    def consistent_with_the_model(self):
        if self.cache is None:
            return
        self.steps_since_reset += 1
        check_invariants(self.cache)
        contents, _ = tree_contents(self.cache)
        assert contents == self.model
        pages = sum(len(m) for m in self.model.values())
        assert self.cache.total_size() == pages * self.page_size
        assert self.cache.protected_size() == len(self.locked_pages()) * self.page_size


def test_cache_matches_the_model(make_cache, core_name):
    machine = type(f"CacheMachine_{core_name}", (CacheMachine,),
                   {"make_cache": staticmethod(make_cache)})
    run_state_machine_as_test(machine, settings=SETTINGS)

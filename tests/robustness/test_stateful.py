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

from conftest import check_invariants, core_of, node_tokens

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
    root = core_of(cache).tree.root
    for node, depth in core_of(cache).tree.iter_nodes():
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


# -- the host tier ---------------------------------------------------------------------------
HOST_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def tier_contents(cache) -> tuple:
    """({namespace: {aligned prefix: (device values, host values)}} per page, each None
    when the page is not on that tier) and node spans (node, namespace, path before it,
    key, device values, host values, lock_ref)."""
    contents = {ns: {} for ns in NAMESPACES}
    spans = []
    paths = [()]
    root = core_of(cache).tree.root
    page = cache.page_size
    for node, depth in core_of(cache).tree.iter_nodes():
        if node is root:
            continue
        del paths[depth:]
        before = paths[depth - 1]
        key = tuple(int(t) for t in node.key)
        value = node.value
        host = node.host_value
        dev = None if value is None else [int(v) for v in value.tolist()]
        hst = None if host is None else [int(v) for v in host.tolist()]
        namespace = contents.setdefault(node.extra_key, {})
        for end in range(page, len(key) + 1, page):
            namespace[before + key[:end]] = (
                None if dev is None else tuple(dev[end - page:end]),
                None if hst is None else tuple(hst[end - page:end]))
        paths.append(before + key)
        spans.append((node, node.extra_key, before, key, dev, hst, node.lock_ref))
    return contents, spans


def _cross_tier_parents() -> bool:
    from radixcache.events import BlockStored
    from radixcache.router import KvIndexer

    indexer = KvIndexer(1)
    indexer.apply(0, [BlockStored((1,), None, (5,), 1, medium="GPU"),
                      BlockStored((2,), 1, (6,), 1, medium="CPU")])
    return indexer.blocks_held(0, medium="CPU") == 1


class HostTierMachine(RuleBasedStateMachine):
    """The cache with a host tier against a model of both tiers, per page: what is on the
    device (with its values) and what has a host copy (with its host indices). Matches,
    inserts (adoption included), loads and locks are predicted; evict, evict_host and
    write_through are checked against what must hold and the model learns their choices.
    Every step, the events replayed into a ``KvIndexer`` must give the device tier of the
    cache exactly, and its host tier as far as the indexer can take it."""

    make_cache = None  # set per core by the test below

    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    @initialize(page_size=st.sampled_from([1, 4]),
                write_policy=st.sampled_from(["write_back", "write_through",
                                              "write_through_selective"]),
                policy=st.sampled_from(["lru", "lfu", "fifo", "mru", "filo", "slru",
                                        "priority"]))
    def start(self, page_size, write_policy, policy):
        from radixcache.router import KvIndexer

        self.page_size = page_size
        self.cache = type(self).make_cache(page_size=page_size, host_tier=True,
                                           eviction_policy=policy, write_policy=write_policy,
                                           enable_events=True)
        self.model = {ns: {} for ns in NAMESPACES}  # prefix -> [device, host]
        self.terminals = {ns: set() for ns in NAMESPACES}
        self.locks = []  # (node handle, namespace, locked prefix)
        self.next_kv = 1000
        self.next_host = 10**6
        self.steps_since_reset = 0
        self.indexer = KvIndexer(page_size)
        self.cross_tier = _cross_tier_parents()

    # -- model helpers ---------------------------------------------------------------
    def page_ends(self, length: int) -> range:
        return range(self.page_size, length + 1, self.page_size)

    def model_match(self, seq, ns):
        """(device length, device values, host length, host values)."""
        cached = self.model[ns]
        length = host_length = 0
        values, hosts = [], []
        for end in self.page_ends(len(seq)):
            entry = cached.get(tuple(seq[:end]))
            if entry is None:
                break
            if entry[0] is not None and not host_length:
                length = end
                values.extend(entry[0])
            else:
                assert entry[0] is None, "a device page below a host-only page"
                host_length += self.page_size
                hosts.extend(entry[1])
        return length, values, host_length, hosts

    def locked_pages(self) -> set:
        pages = set()
        for _, ns, prefix in self.locks:
            pages.update((ns, prefix[:end]) for end in self.page_ends(len(prefix)))
        return pages

    def draw_seq(self, data, ns) -> list:
        cached = sorted(self.model[ns])
        if cached and data.draw(st.booleans(), label="near a cached prefix"):
            base = data.draw(st.sampled_from(cached), label="base")
            cut = data.draw(st.just(len(base)) | st.integers(0, len(base)), label="cut")
            tail = data.draw(st.lists(st.integers(0, 3), max_size=6), label="tail")
            return list(base[:cut]) + tail
        return data.draw(sequences, label="sequence")

    def fresh(self, n: int) -> list:
        values = list(range(self.next_kv, self.next_kv + n))
        self.next_kv += n
        return values

    def make_backup(self, capacity):
        """A backup callback with room for ``capacity`` tokens; records its calls."""
        calls = []

        def backup(device_indices):
            n = device_indices.shape[0]
            room = backup.room
            if room < n:
                calls.append((device_indices.tolist(), None))
                return None
            backup.room = room - n
            out = list(range(self.next_host, self.next_host + n))
            self.next_host += n
            calls.append((device_indices.tolist(), out))
            return torch.tensor(out, dtype=torch.int64)

        backup.room = capacity
        return backup, calls

    # -- rules ---------------------------------------------------------------------------
    @rule(data=st.data(), ns=namespaces, kv_kind=st.sampled_from(["none", "list", "tensor"]))
    def insert(self, data, ns, kv_kind):
        seq = self.draw_seq(data, ns)
        length, _, host_length, _ = self.model_match(seq, ns)
        if kv_kind == "none":
            kv, values = None, list(seq)
        else:
            values = self.fresh(len(seq))
            kv = values if kv_kind == "list" else torch.tensor(values, dtype=torch.int64)
        result = self.cache.insert(seq, kv_indices=kv, extra_key=ns)
        assert result.prefix_len == length  # adopted tokens do not count
        aligned = len(seq) - len(seq) % self.page_size
        for end in self.page_ends(aligned):
            if end > length:
                entry = self.model[ns].get(tuple(seq[:end]))
                page_values = tuple(values[end - self.page_size:end])
                if entry is None:
                    self.model[ns][tuple(seq[:end])] = [page_values, None]
                else:
                    assert end <= length + host_length
                    entry[0] = page_values  # adopted
        if aligned == len(seq):
            self.terminals[ns].add(tuple(seq))
        assert node_tokens(result.last_node) == seq[:aligned]

    @rule(data=st.data(), ns=namespaces, load=st.booleans(), lock_host=st.booleans())
    def match(self, data, ns, load, lock_host):
        seq = self.draw_seq(data, ns)
        length, values, host_length, hosts = self.model_match(seq, ns)
        result = self.cache.match_prefix(seq, extra_key=ns)
        assert (result.length, result.host_length) == (length, host_length)
        assert result.indices.tolist() == values
        assert node_tokens(result.last_node) == seq[:length]
        assert node_tokens(result.last_host_node) == seq[:length + host_length]
        if host_length == 0:
            assert result.last_host_node is result.last_node
            return
        if lock_host:
            before = tier_contents(self.cache)[0]
            with pytest.raises(ValueError, match="only on the host"):
                self.cache.inc_lock_ref(result.last_host_node)
            assert tier_contents(self.cache)[0] == before
        if load:
            slots = self.fresh(host_length)
            assert self.cache.load_back(result, slots).tolist() == hosts
            for i, end in enumerate(range(length + self.page_size, length + host_length + 1,
                                          self.page_size)):
                entry = self.model[ns][tuple(seq[:end])]
                entry[0] = tuple(slots[i * self.page_size:(i + 1) * self.page_size])
            again = self.cache.match_prefix(seq, extra_key=ns)
            assert again.length == length + host_length
            with pytest.raises(ValueError, match="stale match"):
                self.cache.load_back(result, slots)

    @rule(data=st.data(), ns=namespaces)
    def lock(self, data, ns):
        seq = self.draw_seq(data, ns)
        length, _, _, _ = self.model_match(seq, ns)
        result = self.cache.match_prefix(seq, extra_key=ns)
        if length == 0:
            assert self.cache.inc_lock_ref(result.last_node) == 0
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
    @rule(num_tokens=st.integers(0, 10), capacity=st.sampled_from([None, 0, 4, 100, 100]),
          batch=st.booleans())
    def evict(self, num_tokens, capacity, batch):
        self.checked_evict(num_tokens, capacity, batch)

    def checked_evict(self, num_tokens, capacity, batch):
        _, spans = tier_contents(self.cache)
        backup, calls = (None, []) if capacity is None else self.make_backup(capacity)
        got = []
        freed = self.cache.evict(num_tokens, lambda idx: got.append(idx.tolist()),
                                 batch=batch, backup=backup)
        writes_back = self.cache.write_policy == "write_back"
        assert writes_back or not calls, "backup called with a write-through policy"
        left = []  # spans of the nodes that left the device
        # host indices are unique: each successful backup call, by what it returned
        backed = {tuple(host): dev for dev, host in calls if host is not None}
        new_hosts = 0
        for span in spans:
            node, ns, before, key, dev, hst, lock_ref = span
            if dev is None:
                assert node.host_value.tolist() == hst  # host-only nodes stay as they were
                continue
            if node.evicted or not node.on_device:
                assert lock_ref == 0, "a locked node left the device"
                left.append(span)
                if node.evicted:
                    assert hst is None
                    for end in self.page_ends(len(key)):
                        del self.model[ns][before + key[:end]]
                else:
                    now = node.host_value.tolist()
                    if hst is None:  # backed up by this call, with its own device slots
                        assert backed[tuple(now)] == dev
                        new_hosts += 1
                    else:
                        assert now == hst
                    for end in self.page_ends(len(key)):
                        page = self.model[ns][before + key[:end]]
                        page[0] = None
                        page[1] = tuple(now[end - self.page_size:end])
            else:
                host = node.host_value
                assert (None if host is None else host.tolist()) == hst
        # Every host copy a backup call made went to the victim it was made for.
        assert new_hosts == len(backed)
        # backup was asked only for victims without a host copy: each either got one, was
        # deleted (None: the host was full), or stayed (None, host-only children).
        assert len(calls) <= sum(span[5] is None for span in spans)
        assert freed == sum(len(span[3]) for span in left)
        expected = [span[4] for span in left]
        if batch:  # one call, in eviction order: the same values as per node
            assert len(got) == (1 if expected else 0)
            assert sorted(v for values in got for v in values) == sorted(
                v for values in expected for v in values)
        else:
            assert sorted(got) == sorted(expected)
        for ns in NAMESPACES:
            self.terminals[ns] = {t for t in self.terminals[ns] if t in self.model[ns]}
        if freed < num_tokens:
            # What stayed on the device unlocked has host-only children and got no copy.
            _, spans = tier_contents(self.cache)
            for node, _, _, _, dev, hst, lock_ref in spans:
                if dev is not None and not lock_ref and not any(
                        child.on_device for child in node.children):
                    assert node.children and hst is None

    @precondition(lambda self: self.cache.host_size() > 0)
    @rule(num_tokens=st.integers(0, 10), batch=st.booleans())
    def evict_host(self, num_tokens, batch):
        self.checked_evict_host(num_tokens, batch)

    def checked_evict_host(self, num_tokens, batch):
        _, spans = tier_contents(self.cache)
        got = []
        freed = self.cache.evict_host(num_tokens, lambda idx: got.append(idx.tolist()),
                                      batch=batch)
        gone = [span for span in spans if span[0].evicted]
        for _node, ns, before, key, dev, hst, lock_ref in gone:
            assert dev is None and hst is not None and lock_ref == 0
            for end in self.page_ends(len(key)):
                del self.model[ns][before + key[:end]]
        assert freed == sum(len(span[3]) for span in gone)
        expected = [span[5] for span in gone]
        if batch:
            assert len(got) == (1 if expected else 0)
            assert sorted(v for values in got for v in values) == sorted(
                v for values in expected for v in values)
        else:
            assert sorted(got) == sorted(expected)
        for ns in NAMESPACES:
            self.terminals[ns] = {t for t in self.terminals[ns] if t in self.model[ns]}
        if freed < num_tokens:
            _, spans = tier_contents(self.cache)
            assert not any(dev is None and not node.children
                           for node, _, _, _, dev, _, _ in spans)

    @rule(data=st.data(), ns=namespaces, batch=st.booleans())
    def serve(self, data, ns, batch):
        """One request as an engine serves it: match, load the host part back, insert what
        it computed, write through, then evict each tier down to its budget."""
        seq = self.draw_seq(data, ns)
        length, _, host_length, hosts = self.model_match(seq, ns)
        result = self.cache.match_prefix(seq, extra_key=ns)
        assert (result.length, result.host_length) == (length, host_length)
        if host_length:
            slots = self.fresh(host_length)
            assert self.cache.load_back(result, slots).tolist() == hosts
            for i, end in enumerate(range(length + self.page_size, length + host_length + 1,
                                          self.page_size)):
                self.model[ns][tuple(seq[:end])][0] = tuple(
                    slots[i * self.page_size:(i + 1) * self.page_size])
        cached = length + host_length
        again = self.cache.match_prefix(seq, extra_key=ns)  # all of it on the device now
        assert again.length == cached
        values = again.indices.tolist() + self.fresh(len(seq) - cached)
        got = self.cache.insert(seq, values, extra_key=ns)
        assert got.prefix_len == cached
        aligned = len(seq) - len(seq) % self.page_size
        for end in self.page_ends(aligned):
            if end > cached:
                self.model[ns][tuple(seq[:end])] = [
                    tuple(values[end - self.page_size:end]), None]
        if aligned == len(seq):
            self.terminals[ns].add(tuple(seq))
        if self.cache.write_policy != "write_back":
            self.write_through(100)
        budget = 4 * self.page_size
        if self.cache.total_size() > budget:
            self.checked_evict(self.cache.total_size() - budget, 100, batch)
        if self.cache.host_size() > 2 * budget:
            self.checked_evict_host(self.cache.host_size() - 2 * budget, batch)

    @rule(data=st.data(), ns=namespaces, below=st.booleans())
    def insert_host(self, data, ns, below):
        """Pages read back into fresh host slots, below the root or a cached prefix: the
        model predicts the walk (SGLang's refill rule under write-through), the pages
        dropped, the host slots not taken and the new host-only pages."""
        refill = self.cache.write_policy != "write_back"
        page = self.page_size
        model = self.model[ns]
        anchor_prefix = ()
        anchor = self.cache.root_node
        if below and model:
            anchor_prefix = data.draw(st.sampled_from(sorted(model)), label="anchor")
            m = self.cache.match_prefix(list(anchor_prefix), extra_key=ns)
            assert m.length + m.host_length == len(anchor_prefix)
            anchor = m.last_host_node if m.host_length else m.last_node
        tail = data.draw(st.lists(st.integers(0, 3), max_size=12), label="pages")
        tail = tail[:len(tail) - len(tail) % page]
        hosts = list(range(self.next_host, self.next_host + len(tail)))
        self.next_host += len(tail)
        prefix = walked = 0
        unused, refilled = [], []
        for end in self.page_ends(len(tail)):
            entry = model.get(anchor_prefix + tuple(tail[:end]))
            if entry is None:
                break
            if refill and entry[1] is None:
                refilled.append((entry, tuple(hosts[end - page:end])))
            else:
                prefix += page
                unused.extend(hosts[end - page:end])
            walked = end
        dropped = (refill and walked < len(tail) and walked == 0 and anchor_prefix != ()
                   and model[anchor_prefix][1] is None)
        result = self.cache.insert_host(anchor, tail, hosts, extra_key=ns, refill=refill)
        if dropped:
            assert result[0] == 0 and result[2].tolist() == hosts and result[3]
            assert result[1] is anchor
            return
        assert (result[0], result[2].tolist(), result[3]) == (prefix, unused, False)
        assert node_tokens(result[1]) == list(anchor_prefix) + tail
        for entry, page_hosts in refilled:
            entry[1] = page_hosts
        for end in self.page_ends(len(tail)):
            if end > walked:
                model[anchor_prefix + tuple(tail[:end])] = [None,
                                                            tuple(hosts[end - page:end])]

    @precondition(lambda self: self.cache.write_policy != "write_back")
    @rule(capacity=st.sampled_from([0, 4, 100]))
    def write_through(self, capacity):
        _, spans = tier_contents(self.cache)
        backup, calls = self.make_backup(capacity)
        copied = self.cache.write_through(backup)
        if self.cache.write_policy == "write_back":
            assert copied == 0 and not calls
        backed = {tuple(host): dev for dev, host in calls if host is not None}
        total = 0
        for node, ns, before, key, dev, hst, _ in spans:
            host = node.host_value
            now = None if host is None else host.tolist()
            if hst is None and now is not None:
                assert dev is not None and node.on_device
                assert backed[tuple(now)] == dev
                total += len(key)
                for end in self.page_ends(len(key)):
                    self.model[ns][before + key[:end]][1] = tuple(
                        now[end - self.page_size:end])
            else:
                assert now == hst
        assert copied == total

    @precondition(lambda self: self.steps_since_reset >= 20)
    @rule()
    def reset(self):
        self.cache.reset()
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
        cache = self.cache
        check_invariants(cache)
        contents, spans = tier_contents(cache)
        assert contents == {ns: {p: tuple(e) for p, e in pages.items()}
                            for ns, pages in self.model.items()}
        device_pages = sum(e[0] is not None for m in self.model.values() for e in m.values())
        host_pages = sum(e[1] is not None for m in self.model.values() for e in m.values())
        assert cache.total_size() == device_pages * self.page_size
        assert cache.host_size() == host_pages * self.page_size
        assert cache.protected_size() == len(self.locked_pages()) * self.page_size
        for ns, prefix in self.locked_pages():
            assert self.model[ns][prefix][0] is not None, "a locked page left the device"
        # The events, replayed, give the device tier exactly (and the host tier).
        self.indexer.apply(0, cache.take_events())
        assert self.indexer.blocks_held(0, medium="GPU") == device_pages
        if self.cross_tier:
            assert self.indexer.blocks_held(0, medium="CPU") == host_pages
        else:
            assert self.indexer.blocks_held(0, medium="CPU") <= host_pages
        for _node, ns, before, key, dev, _hst, _ in spans:
            tokens = list(before + key)
            on_gpu = self.indexer.overlap(tokens, ns).get(0, 0)
            assert on_gpu == (len(tokens) // self.page_size if dev is not None
                              else len(before) // self.page_size - sum(
                                  self.model[ns][before[:end]][0] is None
                                  for end in self.page_ends(len(before))))
            if self.cross_tier:
                chained = 0
                for end in self.page_ends(len(tokens)):
                    if self.model[ns][tuple(tokens[:end])][1] is None:
                        break
                    chained += 1
                assert self.indexer.overlap(tokens, ns, medium="CPU").get(0, 0) == chained


def test_host_tier_matches_the_model(make_cache, core_name):
    machine = type(f"HostTierMachine_{core_name}", (HostTierMachine,),
                   {"make_cache": staticmethod(make_cache)})
    run_state_machine_as_test(machine, settings=HOST_SETTINGS)

"""``KvIndexer`` against a plain reference model: holdings named by the publisher's hash.

The model keeps, per (worker, tier, group), each publisher hash it holds and the block it
names (namespace, token prefix), with no hashing and no
shared table; the indexer must answer every ``overlap`` as the model does, on each block
module.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from radixcache import _core
from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    extra_keys_entry,
)
from radixcache.router import KvIndexer


@pytest.fixture
def indexer_on(blocks, monkeypatch):
    """``KvIndexer`` over one block module (pure, and compiled once built)."""
    monkeypatch.setattr(_core, "blocks", blocks)
    return KvIndexer


def test_a_duplicate_removal_takes_only_the_holding_it_names(indexer_on):
    """A block held under its own key and under another publisher hash: removing the key
    twice takes one holding, the other hash keeps the block, and a worker that comes later
    holds only what it stored."""
    indexer = indexer_on(2)
    tokens = (1, 2, 3, 4)
    fast = indexer.block_keys(tokens)
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    indexer.apply(0, [BlockStored((101, 102), None, tokens, 2)])  # the same blocks again
    assert indexer.blocks_held(0) == 4
    indexer.apply(0, [BlockRemoved((fast[1],)), BlockRemoved((fast[1],))])
    assert indexer.overlap(tokens) == {0: 2}
    assert indexer.stats.removed_blocks == 1 and indexer.stats.unknown_removals == 1
    assert indexer.blocks_held(0) == 3
    indexer.apply(0, [BlockRemoved((fast[0], 102, fast[0]))])
    assert indexer.overlap(tokens) == {0: 1} and indexer.blocks_held(0) == 1
    indexer.apply(0, [BlockRemoved((101,))])
    assert indexer.overlap(tokens) == {} and len(indexer) == 0 and indexer.workers == []
    indexer.apply(1, [BlockStored((7,), None, tokens[:2], 2)])  # may get worker 0's old id
    assert indexer.overlap(tokens) == {1: 1}


def test_a_key_stored_again_under_its_own_hash_is_a_second_holding(indexer_on):
    """A block held under another hash, then stored under its own key: two holdings, and
    removing the other hash leaves the block held."""
    indexer = indexer_on(2)
    tokens = (1, 2, 3, 4)
    fast = indexer.block_keys(tokens)
    indexer.apply(0, [BlockStored((101, 102), None, tokens, 2)])
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    assert indexer.blocks_held(0) == 4 and indexer.stats.duplicate_blocks == 0
    indexer.apply(0, [BlockRemoved((101, 102))])
    assert indexer.overlap(tokens) == {0: 2}
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    assert indexer.stats.duplicate_blocks == 2
    indexer.apply(0, [BlockRemoved(tuple(fast))])
    assert indexer.overlap(tokens) == {} and indexer.workers == []


# -- model-based fuzz ------------------------------------------------------------------------
class ReferenceIndex:
    """What ``KvIndexer`` must answer, with no hashing and no shared table.

    Per worker, its copies ``(medium, group)`` in the order they were made (a copy is
    dropped when it holds nothing), each ``{publisher hash: block}``, a block being
    ``(namespace, token prefix up to and including it)``."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.workers = {}  # worker -> {(medium, group): {hash: block}}

    def apply(self, worker, events, restarted=False):
        if restarted:
            self.workers.pop(worker, None)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.workers.pop(worker, None)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event)
            else:
                self._stored(worker, event)

    def _where(self, event):
        return (event.medium or "GPU", event.group_idx)

    def _stored(self, worker, event):
        where = self._where(event)
        copies = self.workers.get(worker, {})
        held = copies.get(where, {})
        parent = event.parent_block_hash
        if parent is None:
            entry = event.extra_keys[0] if event.extra_keys else None
            block = (entry[0] if entry else None, ())
        elif parent in held:
            block = held[parent]
        else:  # another tier of the same worker and group, first made first
            block = next((c[parent] for (medium, group), c in copies.items()
                          if (medium, group) != where and group == where[1] and parent in c),
                         None)
            if block is None:
                return  # unknown parent: skipped
        namespace, prefix = block
        blocks = []
        for i in range(len(event.block_hashes)):
            prefix = prefix + tuple(event.token_ids[i * self.block_size:
                                                    (i + 1) * self.block_size])
            blocks.append((namespace, prefix))
        if not blocks:
            return
        held = self.workers.setdefault(worker, {}).setdefault(where, held)
        for block_hash, block in zip(event.block_hashes, blocks):
            held[block_hash] = block  # a reused hash: the newer block wins

    def _removed(self, worker, event):
        copies = self.workers.get(worker, {})
        where = self._where(event)
        held = copies.get(where)
        if held is None:
            return
        for block_hash in event.block_hashes:
            held.pop(block_hash, None)
        if not held:
            del copies[where]
            if not copies:
                del self.workers[worker]

    def overlap(self, tokens, namespace, medium="GPU"):
        out = {}
        for worker, copies in self.workers.items():
            blocks = {b for (m, _), held in copies.items() if m == medium
                      for b in held.values()}
            n = 0
            while ((n + 1) * self.block_size <= len(tokens)
                   and (namespace, tuple(tokens[:(n + 1) * self.block_size])) in blocks):
                n += 1
            if n:
                out[worker] = n
        return out


HASH_TYPES = ("bytes32", "int64", "fast64")


class EventSource:
    """Random, mostly valid event batches from a few workers, in several hash types."""

    def __init__(self, rng, indexer, block_size, reference):
        self.rng = rng
        self.indexer = indexer
        self.block_size = block_size
        self.reference = reference
        self.pages = [tuple(rng.randrange(3) for _ in range(block_size)) for _ in range(5)]
        self.queries = []

    def block_hash(self, kind, block):
        namespace, prefix = block
        if kind == "fast64":  # the indexer's own key: a fast64 publisher
            return self.indexer.block_keys(prefix, namespace)[-1]
        digest = hashlib.blake2b(repr(block).encode()).digest()
        if kind == "bytes32":
            return digest[:32]
        return int.from_bytes(digest[:8], "little", signed=True)

    def stored(self, worker):
        rng = self.rng
        medium = rng.choice(("GPU", "GPU", "CPU", "DISK"))
        group = rng.choice((None, None, 1))
        copies = self.reference.workers.get(worker, {})
        held = copies.get((medium, group), {})
        others = [(h, b) for (m, g), c in copies.items() if g == group for h, b in c.items()]
        roll = rng.random()
        if roll < 0.5 and held:
            parent, (namespace, prefix) = rng.choice(sorted(held.items(), key=repr))
        elif roll < 0.6 and others:  # a parent only another tier holds
            parent, (namespace, prefix) = rng.choice(sorted(others, key=repr))
        elif roll < 0.63:
            parent, namespace, prefix = rng.randrange(1 << 40), None, ()  # unknown
        else:
            parent, namespace, prefix = None, rng.choice((None, None, "a", 7)), ()
        kind = rng.choice(HASH_TYPES)
        mixed = rng.random() < 0.1
        tokens, hashes = [], []
        for _ in range(rng.randrange(1, 4)):
            page = rng.choice(self.pages)
            prefix = prefix + page
            tokens += page
            block_kind = rng.choice(HASH_TYPES) if mixed else kind
            hashes.append(self.block_hash(block_kind, (namespace, prefix)))
        if rng.random() < 0.03 and held:  # the publisher reuses a hash for other content
            hashes[-1] = rng.choice(sorted(held, key=repr))
        entry = None if namespace is None else extra_keys_entry(namespace)
        self.queries.append((prefix, namespace))
        del self.queries[:-12]
        return BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size,
                           medium=medium, extra_keys=(entry,) * len(hashes), group_idx=group)

    def removed(self, worker):
        rng = self.rng
        copies = self.reference.workers.get(worker, {})
        if not copies or rng.random() < 0.05:
            medium, group, held = "GPU", None, {}
        else:
            (medium, group), held = rng.choice(sorted(copies.items(), key=repr))
        hashes = []
        for _ in range(rng.randrange(1, 4)):
            roll = rng.random()
            if held and roll < 0.7:
                hashes.append(rng.choice(sorted(held, key=repr)))
            elif held and roll < 0.9:  # the same block under another hash type
                block = held[rng.choice(sorted(held, key=repr))]
                hashes.append(self.block_hash(rng.choice(HASH_TYPES), block))
            else:
                hashes.append(rng.randrange(1 << 40))
            if rng.random() < 0.15:
                hashes.append(hashes[-1])  # a duplicate removal
        return BlockRemoved(tuple(hashes), medium, group)

    def batch(self, workers):
        rng = self.rng
        worker = rng.randrange(workers)
        events = []
        for _ in range(rng.randrange(1, 4)):
            roll = rng.random()
            if roll < 0.55:
                events.append(self.stored(worker))
            elif roll < 0.93:
                events.append(self.removed(worker))
            else:
                events.append(AllBlocksCleared())
            self.reference.apply(worker, events[-1:])
        restarted = rng.random() < 0.02
        return worker, events, restarted


@pytest.mark.parametrize("seed", range(12))
def test_indexer_matches_the_reference_under_random_batches(indexer_on, seed):
    rng = random.Random(seed)
    block_size = rng.choice((1, 2, 3))
    indexer = indexer_on(block_size)
    reference = ReferenceIndex(block_size)
    source = EventSource(rng, indexer, block_size, reference)
    mismatches = []
    for step in range(300):
        worker, events, restarted = source.batch(3)
        if restarted:  # the reference applied them already; replay them after the drop
            reference.apply(worker, events, restarted=True)
            indexer.apply(worker, ReceivedBatch(step, 0.0, events, None, restarted=True))
        else:
            indexer.apply(worker, events)
        for tokens, namespace in source.queries:
            for medium in ("GPU", "DISK"):
                want = reference.overlap(tokens, namespace, medium)
                got = indexer.overlap(tokens, namespace, medium)
                if got != want:
                    mismatches.append((step, tokens, namespace, medium, got, want))
        for w in range(3):
            want_held = sum(len(h) for h in reference.workers.get(w, {}).values())
            if indexer.blocks_held(w) != want_held:
                mismatches.append((step, w, indexer.blocks_held(w), want_held))
        assert sorted(indexer.workers) == sorted(reference.workers)
    assert mismatches == []
    for w in range(3):
        indexer.remove_worker(w)
    assert len(indexer) == 0 and indexer.workers == []

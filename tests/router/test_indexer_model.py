"""``KvIndexer`` against a plain reference model: holdings named by the publisher's hash.

The model keeps, per (worker, tier, group), each publisher hash it holds and the block it
names (namespace, token prefix, each block's own extra keys), with no hashing and no
shared table; the indexer must answer every ``overlap`` as the model does, on each block
module.
"""

from __future__ import annotations

import collections
import hashlib
import random

import pytest

from radixcache import _core
from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    encode_batch,
    extra_keys_entry,
)
from radixcache.router import KvIndexer
from own_keys import held_under_a_negative_key_and_its_unsigned_spelling, negative_key_steps

try:
    import msgspec
except ImportError:  # the wire is optional: payloads are then applied as events
    msgspec = None


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


def test_a_copy_id_is_reused_only_once_no_block_refers_to_it(indexer_on):
    """Should a holding ever outlive its copy's count (here made behind the indexer's back),
    the copy's id is cleared before another copy gets it."""
    indexer = indexer_on(2)
    tokens = (1, 2, 3, 4)
    indexer.apply(0, [BlockStored((11,), None, tokens[:2], 2)])
    (copy,) = indexer._all_copies()
    indexer._index.hold(indexer.block_keys(tokens)[1], copy.cid)  # a stray holding
    indexer.apply(0, [BlockRemoved((11,))])
    assert indexer.workers == []
    indexer.apply(1, [BlockStored((21,), None, tokens[:2], 2)])  # gets the freed id
    assert indexer.overlap(tokens) == {1: 1} and len(indexer) == 1


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


@pytest.mark.parametrize("unsigned_first", [False, True])
@pytest.mark.parametrize("both_ways", [False, True])
@pytest.mark.parametrize("via", ["events", "payloads"])
def test_a_hash_equal_to_its_negative_own_key_is_taken_mod_2_64(indexer_on, via, both_ways,
                                                                unsigned_first):
    """A publisher hash equal to a block's own key is compared modulo 2**64, as every other
    int hash is: K + 2**64 names the block held under its own key K (a re-store is a
    duplicate, a child's parent, a removal), and K names the one stored as K + 2**64."""
    indexer = indexer_on(2)
    got = held_under_a_negative_key_and_its_unsigned_spelling(indexer, via, both_ways,
                                                              unsigned_first)
    assert got == negative_key_steps(both_ways)
    indexer.remove_worker(0)
    assert len(indexer) == 0 and indexer._index.pairs == 0


# -- model-based fuzz ------------------------------------------------------------------------
class ReferenceIndex:
    """What ``KvIndexer`` must answer, with no hashing and no shared table.

    Per worker, its copies ``(tier, group)`` (a copy is dropped when it holds nothing;
    ``"CPU_PINNED"`` is the tier ``"CPU"``, group 0 the group None), each
    ``{publisher hash: block}`` (an int hash taken modulo 2**64), a block being
    ``(namespace entry, pages up to and including it)``, a page ``(tokens, extra keys)``:
    a sequence's first block's ``extra_keys`` entry names its namespace, and any other
    entry that is not None or the namespace's is the page's own."""

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
        return (tier(event.medium), event.group_idx or None)

    def _stored(self, worker, event):
        where = self._where(event)
        copies = self.workers.get(worker, {})
        held = copies.get(where, {})
        parent = same_hash(event.parent_block_hash)
        if parent is None:
            block = (event.extra_keys[0] if event.extra_keys else None, ())
        elif parent in held:
            block = held[parent]
        else:  # another tier of the same worker and group: the device's, the host's, then
            # the others' by name
            tiers = sorted((medium for (medium, group), c in copies.items()
                            if (medium, group) != where and group == where[1] and parent in c),
                           key=lambda medium: (medium != "GPU", medium != "CPU", medium))
            if not tiers:
                return  # unknown parent: skipped
            block = copies[(tiers[0], where[1])][parent]
        ns_entry, pages = block
        blocks = []
        for i in range(len(event.block_hashes)):
            entry = event.extra_keys[i] if event.extra_keys else None
            pages = pages + ((tuple(event.token_ids[i * self.block_size:
                                                    (i + 1) * self.block_size]),
                              None if entry == ns_entry else entry),)
            blocks.append((ns_entry, pages))
        if not blocks:
            return
        held = self.workers.setdefault(worker, {}).setdefault(where, held)
        for block_hash, block in zip(event.block_hashes, blocks):
            held[same_hash(block_hash)] = block  # a reused hash: the newer block wins

    def _removed(self, worker, event):
        copies = self.workers.get(worker, {})
        where = self._where(event)
        held = copies.get(where)
        if held is None:
            return
        for block_hash in event.block_hashes:
            held.pop(same_hash(block_hash), None)
        if not held:
            del copies[where]
            if not copies:
                del self.workers[worker]

    def query_blocks(self, tokens, entries, namespace=None):
        """The blocks a query names: ``entries`` one per block (the first names the
        namespace unless ``namespace`` does)."""
        ns_entry = entries[0] if namespace is None else (namespace,)
        pages, blocks = (), []
        for i in range(len(tokens) // self.block_size):
            entry = entries[i] if i < len(entries) else None
            pages = pages + ((tuple(tokens[i * self.block_size:(i + 1) * self.block_size]),
                              None if entry == ns_entry else entry),)
            blocks.append((ns_entry, pages))
        return blocks

    def blocks_held(self, worker, medium=None):
        return sum(len(held) for (m, _), held in self.workers.get(worker, {}).items()
                   if medium is None or m == tier(medium))

    def overlap(self, tokens, entries, medium="GPU", namespace=None):
        out = {}
        medium = tier(medium)
        query = self.query_blocks(tokens, entries, namespace)
        for worker, copies in self.workers.items():
            blocks = {b for (m, _), held in copies.items() if m == medium
                      for b in held.values()}
            n = 0
            while n < len(query) and query[n] in blocks:
                n += 1
            if n:
                out[worker] = n
        return out


HASH_TYPES = ("bytes32", "int64", "fast64", "fast64 unsigned")
#: The tiers events name: SGLang's pinned host memory is the host tier ("CPU").
MEDIA = ("GPU", "GPU", "CPU", "CPU_PINNED", "DISK")


def tier(medium):
    """The tier an event's or a query's ``medium`` names, as documented."""
    return "CPU" if medium == "CPU_PINNED" else medium or "GPU"


def same_hash(block_hash):
    """A publisher hash as the index tells hashes apart: an int modulo 2**64."""
    return block_hash % (1 << 64) if type(block_hash) is int else block_hash
ROOT_ENTRIES = (None, None, extra_keys_entry("a"), extra_keys_entry(7), ("ad", "salt"),
                ("img-1",))
IMAGE_ENTRIES = (("img-1",), ("img-2",), ("ad", "img-1"))


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
        if kind.startswith("fast64"):  # the indexer's own key: a fast64 publisher
            ns_entry, pages = block
            tokens = [t for page, _ in pages for t in page]
            entries = [ns_entry] + [entry or ns_entry for _, entry in pages[1:]]
            key = self.indexer.block_keys(tokens, block_extra_keys=entries)[-1]
            return key % (1 << 64) if kind == "fast64 unsigned" else key
        digest = hashlib.blake2b(repr(block).encode()).digest()
        if kind == "bytes32":
            return digest[:32]
        return int.from_bytes(digest[:8], "little", signed=True)

    def stored(self, worker):
        rng = self.rng
        copies = self.reference.workers.get(worker, {})
        if copies and rng.random() < 0.2:  # a chain one of its copies holds, stored again
            (medium, group), held = rng.choice(sorted(copies.items(), key=repr))
            if medium == "CPU" and rng.random() < 0.5:
                medium = "CPU_PINNED"  # the same tier, by SGLang's name
            return self.stored_again(medium, group, held)
        medium = rng.choice(MEDIA)
        group = rng.choice((None, None, 0, 1))
        held = copies.get((tier(medium), group or None), {})
        others = [(h, b) for (m, g), c in copies.items() if g == (group or None)
                  for h, b in c.items()]
        roll = rng.random()
        if roll < 0.5 and held:
            parent, (ns_entry, pages) = rng.choice(sorted(held.items(), key=repr))
        elif roll < 0.6 and others:  # a parent only another tier holds
            parent, (ns_entry, pages) = rng.choice(sorted(others, key=repr))
        elif roll < 0.63:
            parent, ns_entry, pages = rng.randrange(1 << 40), None, ()  # unknown
        else:  # a namespace (radixcache's layout, a LoRA), or an image first
            parent, ns_entry, pages = None, rng.choice(ROOT_ENTRIES), ()
        kind = rng.choice(HASH_TYPES)
        mixed = rng.random() < 0.1
        tokens, hashes, entries = [], [], []
        for i in range(rng.randrange(1, 4)):
            page = rng.choice(self.pages)
            # an image's blocks carry its hash; the others the namespace's entry
            entry = ns_entry if (parent is None and i == 0) or rng.random() < 0.7 else \
                rng.choice(IMAGE_ENTRIES)
            pages = pages + ((page, None if entry == ns_entry else entry),)
            tokens += page
            entries.append(entry)
            block_kind = rng.choice(HASH_TYPES) if mixed else kind
            hashes.append(self.block_hash(block_kind, (ns_entry, pages)))
        if rng.random() < 0.03 and held:  # the publisher reuses a hash for other content
            hashes[-1] = rng.choice(sorted(held, key=repr))
        self.queries.append(([t for page, _ in pages for t in page],
                             [ns_entry] + [e or ns_entry for _, e in pages[1:]]))
        del self.queries[:-12]
        return BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size,
                           medium=medium, extra_keys=tuple(entries), group_idx=group)

    def stored_again(self, medium, group, held):
        """A chain the copy holds, stored again from its root, mostly under a hash type it
        is not held under yet: its blocks are then held under two or three hashes each."""
        rng = self.rng
        counts = collections.Counter(held.values())
        blocks = sorted(counts, key=repr)
        if rng.random() < 0.5:  # one held most often: up to three hashes
            most = max(counts.values())
            blocks = [block for block in blocks if counts[block] == most]
        ns_entry, pages = rng.choice(blocks)
        new = [kind for kind in HASH_TYPES
               if same_hash(self.block_hash(kind, (ns_entry, pages))) not in held]
        kind = rng.choice(new if new and rng.random() < 0.8 else HASH_TYPES)
        hashes = tuple(self.block_hash(kind, (ns_entry, pages[:i + 1]))
                       for i in range(len(pages)))
        entries = [ns_entry] + [entry or ns_entry for _, entry in pages[1:]]
        tokens = [t for page, _ in pages for t in page]
        self.queries.append((tokens, entries))
        del self.queries[:-12]
        return BlockStored(hashes, None, tuple(tokens), self.block_size, medium=medium,
                           extra_keys=tuple(entries), group_idx=group)

    def removed(self, worker):
        rng = self.rng
        copies = self.reference.workers.get(worker, {})
        if not copies or rng.random() < 0.05:
            medium, group, held = "GPU", None, {}
        else:
            (medium, group), held = rng.choice(sorted(copies.items(), key=repr))
            if medium == "CPU" and rng.random() < 0.5:
                medium = "CPU_PINNED"  # the same tier, by SGLang's name
            if group is None and rng.random() < 0.3:
                group = 0  # the same group
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


@pytest.mark.parametrize("via", ["events", "payloads"])
@pytest.mark.parametrize("seed", range(12))
def test_indexer_matches_the_reference_under_random_batches(indexer_on, seed, via):
    """``via="payloads"``: each batch that is no restart goes through the wire (vLLM's map
    encoding) to ``apply_payload``, which applies the typed decoder's structs."""
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
        elif via == "payloads" and msgspec is not None:
            assert indexer.apply_payload(worker, encode_batch(events, ts=0.0), step)
        else:
            indexer.apply(worker, events)
        for tokens, entries in source.queries:
            for medium in ("GPU", rng.choice(("CPU", "CPU_PINNED", "DISK"))):
                want = reference.overlap(tokens, entries, medium)
                got = indexer.overlap(tokens, medium=medium, block_extra_keys=entries)
                if got != want:
                    mismatches.append((step, tokens, entries, medium, got, want))
            if entries[0] is not None and len(entries[0]) == 1:  # the namespace by name
                namespace = entries[0][0]
                want = reference.overlap(tokens, [None] + entries[1:], namespace=namespace)
                got = indexer.overlap(tokens, namespace, block_extra_keys=[None] + entries[1:])
                if got != want:
                    mismatches.append((step, tokens, entries, namespace, got, want))
            plain = [entries[0]] * len(entries)  # no image keys: stops at the first image
            if reference.overlap(tokens, plain) != indexer.overlap(
                    tokens, block_extra_keys=plain):
                mismatches.append((step, tokens, plain))
        for w in range(3):
            for medium in (None, "GPU", "CPU", "CPU_PINNED", "DISK"):
                want_held = reference.blocks_held(w, medium)
                if indexer.blocks_held(w, medium) != want_held:
                    mismatches.append((step, w, medium, indexer.blocks_held(w, medium),
                                       want_held))
        assert sorted(indexer.workers) == sorted(reference.workers)
        # the copies' counts are the table's holdings: nothing held under a dropped id
        assert indexer._index.pairs == sum(indexer.blocks_held(w) for w in range(3))
    assert mismatches == []
    for w in range(3):
        indexer.remove_worker(w)
    assert len(indexer) == 0 and indexer.workers == []

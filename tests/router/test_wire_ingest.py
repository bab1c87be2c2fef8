"""``KvIndexer.apply_payload``'s one-call ingest (the block module's ``read_wire`` and
``apply_wire``) against the event path, on every block module.

Each random batch goes to one indexer as its payload and to another as the events
``decode_batch`` reads from the same payload; after every batch the two must hold the same
blocks for the same copies, keep the same publisher maps and count the same in ``stats``.
The batches aim at what the one-call path reads (hash types, duplicates, reused hashes,
unknown parents, parents on another tier, wrong block sizes, clears, a publisher that sends
its own keys) and at what it leaves to the event path. The two modules' readers must take
and refuse the same payloads, and every payload they take must be one ``decode_batch``
reads; bad arguments are refused and change nothing.
"""

from __future__ import annotations

import copy as copy_module
import os
import pickle
import random

import pytest

from radixcache import _core
from radixcache._core import BLOCKS
from radixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from radixcache.router import KvIndexer

msgspec = pytest.importorskip("msgspec")
encode = msgspec.msgpack.encode


@pytest.fixture
def indexer_on(blocks, monkeypatch):
    monkeypatch.setattr(_core, "blocks", blocks)
    return KvIndexer


def state(indexer: KvIndexer) -> tuple:
    """Everything the index holds, by copy (worker, tier, group) rather than copy id."""
    names = {}
    copies = {}
    for worker in list(indexer._copies):
        for c in indexer._copies_of(worker):
            names[c.cid] = (worker, c.medium, c.group)
            copies[names[c.cid]] = (c.direct, c.size, sorted(c.published.values()))
    keys, cids = indexer._index.__reduce__()[1]
    keys = memoryview(keys).cast("q").tolist()
    cids = memoryview(cids).cast("i").tolist()
    holdings = sorted((key, repr(names[cid])) for key, cid in zip(keys, cids))
    return indexer.stats.as_dict(), copies, holdings, len(indexer), indexer._held


def respelled(block_hash):
    """An int hash's other spelling modulo 2**64 (signed or unsigned), when it has one."""
    if type(block_hash) is int and -(1 << 63) <= block_hash < 0:
        return block_hash + (1 << 64)
    if type(block_hash) is int and 1 << 63 <= block_hash < 1 << 64:
        return block_hash - (1 << 64)
    return block_hash


class Source:
    """Random batches of one worker's events, as the one-call path mostly reads them."""

    def __init__(self, rng: random.Random, block_size: int, indexer: KvIndexer) -> None:
        self.rng = rng
        self.block_size = block_size
        self.indexer = indexer
        self.pages = [tuple(rng.randrange(4) for _ in range(block_size)) for _ in range(4)]
        self.known: dict = {}  # (worker, tier, group) -> {hash: its tokens from the root}
        self.queries: list = []

    def hash_of(self, kind: str, tokens: list) -> object:
        rng = self.rng
        if kind == "fast64":
            return self.indexer.block_keys(tokens)[-1]
        if kind == "fast64 unsigned":  # the same key, as a publisher of uint64 hashes sends it
            return self.indexer.block_keys(tokens)[-1] % (1 << 64)
        if kind == "int":
            return rng.randrange(-(1 << 63), 1 << 63)
        if kind == "uint64":
            return rng.randrange(1 << 63, 1 << 64)
        if kind == "small":
            return rng.randrange(-40, 200)
        return rng.randbytes(rng.choice((0, 8, 32)))

    def stored(self, worker, medium, group) -> BlockStored:
        rng = self.rng
        held = self.known.setdefault((worker, medium or "GPU", group), {})
        roll = rng.random()
        parent, prefix = None, []
        if roll < 0.55 and held:
            parent = rng.choice(list(held))
            prefix = list(held[parent])
        elif roll < 0.65:
            others = [(h, t) for (w, _, g), hs in self.known.items() if w == worker
                      and g == group for h, t in hs.items()]
            if others:  # a parent another tier holds, or none
                parent, prefix = rng.choice(others)
                prefix = list(prefix)
        if parent is not None and rng.random() < 0.2:
            parent = respelled(parent)
        elif roll < 0.7:
            parent = rng.randrange(1 << 40)  # unknown
        kind = rng.choice(("int", "int", "fast64", "fast64", "fast64 unsigned", "bytes",
                           "uint64", "small"))
        tokens, hashes = [], []
        for _ in range(rng.randrange(0 if rng.random() < 0.05 else 1, 5)):
            page = list(rng.choice(self.pages))
            tokens += page
            prefix = prefix + page
            block_kind = rng.choice(("int", "fast64", "bytes")) if rng.random() < 0.1 else kind
            hashes.append(self.hash_of(block_kind, prefix))
            held[hashes[-1]] = tuple(prefix)
        if hashes and rng.random() < 0.1 and held:  # a hash reused for other content
            hashes[rng.randrange(len(hashes))] = rng.choice(list(held))
        if hashes and rng.random() < 0.05:
            hashes.append(hashes[0])  # a hash twice in one event
            tokens += rng.choice(self.pages)
        self.queries.append(prefix)
        del self.queries[:-8]
        block_size = self.block_size
        roll = rng.random()
        if roll < 0.03:
            block_size += 1
        elif roll < 0.06 and tokens:
            tokens.pop()  # not whole blocks
        extra = None if rng.random() < 0.8 else (None,) * rng.randrange(0, len(hashes) + 2)
        return BlockStored(tuple(hashes), parent, tuple(tokens), block_size,
                           lora_id=3 if rng.random() < 0.1 else None, medium=medium,
                           extra_keys=extra, group_idx=group)

    def removed(self, worker, medium, group) -> BlockRemoved:
        rng = self.rng
        held = self.known.get((worker, medium or "GPU", group), {})
        hashes = []
        for _ in range(rng.randrange(0, 5)):
            if held and rng.random() < 0.8:
                hashes.append(rng.choice(list(held)))
                if rng.random() < 0.2:
                    hashes[-1] = respelled(hashes[-1])
            else:
                hashes.append(rng.choice((rng.randrange(1 << 40), rng.randbytes(32))))
            if rng.random() < 0.1:
                hashes.append(hashes[-1])  # removed twice
        return BlockRemoved(tuple(hashes), medium, group)

    def batch(self, workers: int) -> tuple:
        rng = self.rng
        worker = rng.randrange(workers)
        medium = rng.choice((None, "GPU", "GPU", "CPU"))
        group = rng.choice((None, None, None, 0, 1))
        events = []
        for _ in range(rng.randrange(0 if rng.random() < 0.03 else 1, 5)):
            if rng.random() < 0.08:  # another copy in the same batch: the event path
                medium, group = rng.choice(("GPU", "CPU")), rng.choice((None, 1))
            roll = rng.random()
            if roll < 0.6:
                events.append(self.stored(worker, medium, group))
            elif roll < 0.95:
                events.append(self.removed(worker, medium, group))
            else:
                events.append(AllBlocksCleared())
        return worker, events

    def payload(self, events: list) -> bytes:
        rng = self.rng
        layout = rng.choice(("map", "positional"))
        wire = [event.to_wire(layout) for event in events]
        if layout == "map" and rng.random() < 0.2:  # fields no event has: not read
            for item in wire:
                item["future"] = rng.choice(([1, [2, None]], {"a": 1.5}, b"x", "text", True))
        elif layout == "positional" and rng.random() < 0.2:
            for item in wire:
                item.append(rng.choice((None, 7, [1, 2])))
        if wire and layout == "positional" and rng.random() < 0.1:
            wire[0] = events[0].to_wire("map")  # both layouts: the typed decoder refuses it
        batch = [rng.choice((0.5, 3)), wire]
        if rng.random() < 0.8:
            batch.append(rng.choice((None, 0, 2)))
        return encode(batch)


@pytest.mark.parametrize("seed", range(10))
def test_the_one_call_path_matches_the_event_path(indexer_on, seed):
    rng = random.Random(seed)
    block_size = rng.choice((1, 2, 4))
    fast, slow = indexer_on(block_size), indexer_on(block_size)
    read = _core.blocks.read_wire
    source = Source(rng, block_size, fast)
    taken = 0
    for step in range(400):
        worker, events = source.batch(3)
        payload = source.payload(events)
        taken += read(payload) is not None
        try:
            events = decode_batch(payload).events
        except ValueError:  # malformed: counted, nothing applied
            events = None
        assert fast.apply_payload(worker, payload, step) == (events is not None)
        if events is None:
            slow.stats.malformed_batches += 1
        else:
            slow.apply(worker, events)
        assert state(fast) == state(slow), step
        for tokens in source.queries:
            for medium in ("GPU", "CPU"):
                assert fast.overlap(tokens, medium=medium) == slow.overlap(tokens,
                                                                           medium=medium)
    assert taken > 250  # most batches went through the one-call path
    for w in range(3):
        fast.remove_worker(w)
    assert len(fast) == 0 and fast._index.pairs == 0 and fast.workers == []


@pytest.mark.parametrize("seed", range(4))
def test_a_run_of_payloads_applies_as_each_payload_does(indexer_on, seed):
    """``apply_payloads`` (a subscriber's run of batches in one call) against
    ``apply_payload`` on each: the same index and counts after every run, malformed payloads
    (mutants, a bytearray, an empty one) counted in place."""
    rng = random.Random(100 + seed)
    block_size = rng.choice((1, 2, 4))
    runs, each = indexer_on(block_size), indexer_on(block_size)
    source = Source(rng, block_size, each)
    for step in range(60):
        worker = rng.randrange(3)
        run = []
        for _ in range(rng.choice((0, 1, 2, 5, 16))):
            payload = source.payload(source.batch(3)[1])
            roll = rng.random()
            if roll < 0.1:
                payload = rng.choice(_mutants(rng, payload))
            elif roll < 0.13:
                payload = rng.choice((bytearray(payload), b"", memoryview(payload)))
            run.append(payload)
        applied = sum(each.apply_payload(worker, p) for p in run)
        assert runs.apply_payloads(worker, iter(run) if step % 2 else run) == applied
        assert state(runs) == state(each), step
    with pytest.raises(TypeError, match="worker must be a hashable id"):
        runs.apply_payloads(None, [])
    with pytest.raises(TypeError, match="worker must be a hashable id"):
        runs.apply_payloads([1], [encode([0, []])])
    assert state(runs) == state(each)


def _payloads(rng: random.Random, count: int) -> list:
    indexer = KvIndexer(2)
    source = Source(rng, 2, indexer)
    return [source.payload(source.batch(2)[1]) for _ in range(count)]


def _mutants(rng: random.Random, payload: bytes) -> list:
    out = [payload[:rng.randrange(len(payload))], payload + b"\x00"]
    for _ in range(6):
        data = bytearray(payload)
        for _ in range(rng.randrange(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        out.append(bytes(data))
    return out


HAND_MADE = [
    encode([0, []]),
    encode([0, [], None]),
    encode([0, [], None, 1]),  # a fourth place
    encode([True, []]),  # a bool ts
    encode([0, [["AllBlocksCleared", 1, [2]]]]),
    encode([0, [{"type": "AllBlocksCleared", "medium": "CPU"}]]),
    encode([0, [{"type": "BlockRemoved"}]]),  # no hashes
    encode([0, [{"block_hashes": [1], "type": "BlockRemoved"}]]),  # the tag last
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU_PINNED"}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [True]}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": ["ab"]}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [2 ** 64 - 1, -(2 ** 63)]}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 2 ** 64 - 1}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [1]}]]),  # one tier, two spellings
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}]]),
    encode([0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 0}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2],
                 "block_size": 2}]]),  # no parent
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2 ** 63], "block_size": 2}]]),  # beyond int64
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [-1, -(2 ** 63)], "block_size": 2}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "lora_name": "ad"}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "cache_salt": "s"}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "extra_keys": [None, ["img"]]}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "extra_keys": [None, None]}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "medium": "GPU\u00e9"}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "lora_id": 1.0}]]),
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2 ** 64 - 1}]]),
    encode([0, [["BlockStored", [1], None, [1, 2], 2, None]]]),  # a place short
    encode([0, [["BlockStored", [1], None, [1, 2], 2, None, None]]]),
    encode([0, [["BlockStored", [1], None, [1, 2], 2, None, None, None, None, 3, "x"]]]),
    encode([0, [["BlockRemoved", [1]]]]),
    encode([0, [["BlockRemoved", [1], None, 2, [[[[[[[[[[1]]]]]]]]]]]]]),  # deep, not read
    encode([0, [{"type": "Other"}]]),
    encode([0, [["Other", 1]]]),
    encode([0, [{1: 2, "type": "AllBlocksCleared"}]]),
    encode([0, [{"type": "AllBlocksCleared", "x": "\u00e9"}]]),
    encode([0, [{"type": "AllBlocksCleared", "x": msgspec.msgpack.Ext(1, b"e")}]]),
    b"\x92\x00\x91\x82\xa4type\xacBlockRemoved\xa4type\xacBlockRemoved",  # a field twice
    b"\x92\x00\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
    b"\xacblock_hashes\x91\x02",
    b"\x92\x00\xdd\xff\xff\xff\xff",  # a count beyond the bytes
    b"\x92\xca\x00\x00\x00\x00\x90",  # a float32 ts
    b"",
]


def test_both_readers_take_the_same_payloads_and_decode_batch_reads_them():
    """Each reader takes exactly what the other takes, with the same events, and nothing
    ``decode_batch`` refuses (whatever a reader refuses goes to ``decode_batch``)."""
    rng = random.Random(5)
    readers = list(BLOCKS.values())
    cases = list(HAND_MADE)
    for payload in _payloads(rng, 150):
        cases.append(payload)
        cases += _mutants(rng, payload)
    taken = 0
    for payload in cases:
        batches = [blocks.read_wire(payload) for blocks in readers]
        assert len({b is None for b in batches}) == 1, payload
        if batches[0] is None:
            continue
        taken += 1
        events = decode_batch(payload).events  # never refused
        for b in batches:
            assert len(b) == len(events)
            assert (b.medium, b.group) == (batches[0].medium, batches[0].group)
        results = []
        for blocks, b in zip(readers, batches):
            index, keymap = blocks.BlockIndex(), blocks.KeyMap()
            results.append((blocks.apply_wire(index, b, 0, keymap, 3, 0, 2, 99, True, False),
                            pickle.loads(pickle.dumps(index)).pairs, sorted(keymap.values())))
        assert len({repr(r) for r in results}) == 1, payload
    assert taken > 100


@pytest.mark.parametrize("payload", [
    encode([0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                 "token_ids": [1, 2], "block_size": 2, "medium": "CPU_PINNED"}]]),
    encode([0, [["BlockStored", [1, b"k"], None, [1, 2, 3, 4], 2, None, None],
                ["BlockStored", [9], 1, [5, 6], 2, None, "GPU"]]]),
])
def test_what_a_reader_takes_is_read_as_decode_batch_reads_it(blocks, payload):
    batch = blocks.read_wire(payload)
    assert batch is not None and len(batch) == len(decode_batch(payload).events)


def test_bad_arguments_are_refused_and_change_nothing(blocks):
    payload = encode([0, [{"type": "BlockStored", "block_hashes": [1, 2],
                           "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                           "block_size": 2}]])
    batch = blocks.read_wire(payload)
    index, keymap = blocks.BlockIndex(), blocks.KeyMap()
    good = dict(index=index, batch=batch, start=0, keymap=keymap, copy=1, direct=0,
                block_size=2, seed=5, alone=True, ns=False)
    for name, value, error in [
            ("index", object(), TypeError), ("batch", payload, TypeError),
            ("keymap", {}, TypeError), ("start", 0.0, TypeError), ("start", 2, ValueError),
            ("start", -1, ValueError), ("copy", -1, ValueError), ("copy", True, TypeError),
            ("direct", -1, ValueError), ("block_size", 0, ValueError),
            ("block_size", 2.0, TypeError), ("seed", 5.0, TypeError),
            ("alone", 1, TypeError), ("ns", None, TypeError)]:
        with pytest.raises(error):
            blocks.apply_wire(**{**good, name: value})
        assert len(index) == 0 and index.pairs == 0 and len(keymap) == 0
    with pytest.raises(TypeError):
        blocks.read_wire(bytearray(payload))
    for bad in (pickle.dumps, copy_module.copy):
        with pytest.raises(TypeError):
            bad(batch)
    assert blocks.apply_wire(**good)[:2] == (1, 2) and index.pairs == 2


def test_a_batch_is_read_once_and_applies_the_same_twice(blocks):
    """A batch keeps what it read: applied to two indexes it gives the same answer, and the
    payload it came from is not looked at again."""
    payload = bytearray(encode([0, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None,
                                     None]]]))
    batch = blocks.read_wire(bytes(payload))
    payload[:] = os.urandom(len(payload))
    answers = []
    for _ in range(2):
        index, keymap = blocks.BlockIndex(), blocks.KeyMap()
        answers.append((blocks.apply_wire(index, batch, 0, keymap, 0, 0, 2, 1, True, False),
                        sorted(keymap.values())))
    assert answers[0] == answers[1] and answers[0][0][1] == 2


def test_apply_payload_keeps_the_decoders_answers_for_what_it_does_not_read(indexer_on):
    """Payloads the block module does not read go the typed or the field-by-field way, as
    before: a malformed one changes nothing and is counted."""
    indexer = indexer_on(2)
    assert not indexer.apply_payload(0, b"\x92\x00\x91\xc1")
    assert indexer.stats.malformed_batches == 1 and indexer.stats.batches == 0
    assert indexer.apply_payload(0, bytearray(encode([0, [["BlockStored", [1], None, [1, 2],
                                                          2, None, None]]])))
    assert indexer.blocks_held(0) == 1


@pytest.mark.parametrize("runs", [False, True], ids=["apply_payload", "apply_payloads"])
def test_a_worker_id_whose_code_reenters_leaves_the_index_whole(indexer_on, runs):
    """A worker id's ``__eq__`` applies other workers' batches (copies made and dropped, their
    ids taken and given back) while ``apply_payload`` (or ``apply_payloads``, a run of three)
    looks up and makes its copy: every holding still belongs to the copy that counts it, and
    the counts add up."""
    indexer = indexer_on(2)
    payloads = [encode([0, [["BlockStored", [i, i + 1], None, [i, 1, 2, 3], 2, None, None]]])
                for i in range(0, 40, 2)]
    drop = encode([0, [["AllBlocksCleared"]]])
    calls = [0]
    armed = [True]  # not while the test itself reads the index
    extras: list = []
    fresh = iter(range(1000, 10**6))

    class Worker:
        def __init__(self, name):
            self.name = name

        def __hash__(self):
            return 1  # every id in one bucket: lookups compare

        def __eq__(self, other):
            if armed[0]:
                calls[0] += 1
                if calls[0] % 2 and extras:  # a worker goes: its copy id is free
                    indexer.apply_payload(extras.pop(), drop)
                else:  # a new worker comes: it takes a free copy id
                    extras.append(next(fresh))
                    indexer.apply_payload(extras[-1], payloads[calls[0] % 20])
            return isinstance(other, Worker) and other.name == self.name

    workers = [Worker(n) for n in range(4)]
    for step, payload in enumerate(payloads * 3):
        if runs:
            assert indexer.apply_payloads(workers[step % 4], [payload, drop, payload]) == 3
        else:
            assert indexer.apply_payload(workers[step % 4], payload)
        armed[0] = False
        everyone = list(indexer.workers)
        assert indexer._index.pairs == indexer._held == sum(indexer.blocks_held(w)
                                                             for w in everyone)
        _, copies, holdings, _, _ = state(indexer)  # every holding names a live copy
        held_by = {}
        for _, name in holdings:
            held_by[name] = held_by.get(name, 0) + 1
        assert held_by == {repr(name): size for name, (_, size, _) in copies.items()}
        armed[0] = True
    assert calls[0] > 20

"""The block modules' ``BlockIndex`` (``KvIndexer``'s table of held blocks) and the fleet's
direct feed of block keys (``event_options={"record": "keys"}`` and ``KvIndexer.apply_keys``),
on every available core.

The index is checked against a plain model (key -> list of copies) over random operation
sequences, its errors on bad input (each leaving it unchanged), and ``KvIndexer`` over the
compiled index against ``KvIndexer`` over the pure one on the same events. The fleet's
direct feed must decide, hit and count exactly as the event path does.
"""

from __future__ import annotations

import copy as copy_module
import pickle
import random

import numpy as np
import pytest

from radixcache import _blocks_py, _core
from radixcache._core import BLOCKS, CORES
from radixcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixcache.events.hashing import fast64_root
from radixcache.events.recorder import KEYS_REMOVED, KEYS_STORED
from radixcache.fleet import EventLag, InProcessChannel, TimeModel, simulate_fleet
from radixcache.router import KvIndexer
from radixcache.workloads import Request, synthetic_chat

I64 = (1 << 63) - 1


class Model:
    """What a BlockIndex must answer: key -> the copies holding it, a copy per holding."""

    def __init__(self):
        self.holders = {}

    def hold(self, key, copy):
        self.holders.setdefault(key, []).append(copy)

    def unhold(self, key, copy):
        held = self.holders.get(key, [])
        if copy not in held:
            return False
        held.remove(copy)
        if not held:
            del self.holders[key]
        return True

    def store(self, copy, keys):
        stored = duplicates = 0
        for key in keys:
            if copy in self.holders.get(key, []):
                duplicates += 1
            else:
                self.hold(key, copy)
                stored += 1
        return stored, duplicates

    def remove(self, copy, keys):
        removed = sum(self.unhold(key, copy) for key in keys)
        return removed, len(keys) - removed

    def clear_copy(self, copy):
        dropped = 0
        for key in list(self.holders):
            while self.unhold(key, copy):
                dropped += 1
        return dropped

    def overlap(self, keys, owners):
        out, active, depth = [], None, 0
        for key in keys:
            held = [owners[c] for c in self.holders.get(key, []) if c < len(owners)
                    and owners[c] >= 0]
            if key not in self.holders:
                break
            if active is None:
                active = list(dict.fromkeys(held))
            else:
                out += [(o, depth) for o in active if o not in held]
                active = [o for o in active if o in held]
            if not active:
                break
            depth += 1
        return out + [(o, depth) for o in active or ()]

    @property
    def pairs(self):
        return sum(len(v) for v in self.holders.values())


def state(index, keys):
    return len(index), index.pairs, {k: index.holders(k) for k in keys}


def check_same(index, model, keys):
    assert len(index) == len(model.holders)
    assert index.pairs == model.pairs
    for key in keys:
        assert index.holders(key) == model.holders.get(key, [])
        for copy in range(4):
            assert index.holds(key, copy) == (copy in model.holders.get(key, []))


def as_input(keys, rng):
    kind = rng.randrange(3)
    if kind == 0:
        return list(keys)
    if kind == 1:
        return tuple(keys)
    return np.array(keys, dtype=np.int64).tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_model(blocks, seed):
    rng = random.Random(seed)
    # Few keys (collisions, several holders, a copy holding a key twice), and bursts of many
    # (the table grows, and shrinks as they leave); extreme int64 values included.
    pool = [rng.randrange(-I64 - 1, I64 + 1) for _ in range(40)] + [0, -1, I64, -I64 - 1]
    index, model = blocks.BlockIndex(), Model()
    for _step in range(600):
        op = rng.randrange(9)
        copy = rng.randrange(4)
        if op == 0:
            key = rng.choice(pool)
            index.hold(key, copy)
            model.hold(key, copy)
        elif op == 1:
            key = rng.choice(pool)
            assert index.unhold(key, copy) == model.unhold(key, copy)
        elif op in (2, 3):
            keys = [rng.choice(pool) for _ in range(rng.randrange(8))]
            assert index.store(copy, as_input(keys, rng)) == model.store(copy, keys)
        elif op == 4:
            keys = [rng.choice(pool) for _ in range(rng.randrange(8))]
            assert index.add(copy, as_input(keys, rng)) == len(keys)
            for key in keys:
                model.hold(key, copy)
        elif op == 5:
            keys = [rng.choice(pool) for _ in range(rng.randrange(8))]
            assert index.remove(copy, as_input(keys, rng)) == model.remove(copy, keys)
        elif op == 6 and rng.random() < 0.2:
            assert index.clear_copy(copy) == model.clear_copy(copy)
        elif op == 7 and rng.random() < 0.1:
            burst = [rng.randrange(-I64 - 1, I64 + 1) for _ in range(rng.randrange(1, 3000))]
            assert index.store(copy, burst) == model.store(copy, burst)
            check_same(index, model, pool + burst)
            assert index.remove(copy, burst) == model.remove(copy, burst)
        elif op == 8:
            # A chain of hashed pages, partly held by some copies; owners map copies to
            # 0..2 (two copies may share an owner, one may count for none).
            data = np.array([rng.randrange(50) for _ in range(4 * rng.randrange(12))],
                            dtype="<i8").tobytes()
            seed_key = rng.randrange(-I64 - 1, I64 + 1)
            keys = blocks.page_hash_chain(seed_key, data, 32)
            for c in range(4):
                if rng.random() < 0.5 and keys:
                    prefix = keys[:rng.randrange(len(keys) + 1)]
                    index.add(c, prefix)
                    for key in prefix:
                        model.hold(key, c)
            owners = [rng.choice((-1, 0, 1, 2)) for _ in range(rng.randrange(5))]
            owners = [min(o, len(owners) - 1) for o in owners]
            got = index.overlap(seed_key, data, 32, owners)
            assert sorted(got) == sorted(model.overlap(keys, owners))
            assert got == model.overlap(keys, owners)  # dropouts in order, then the rest
        check_same(index, model, pool)
    # Everything can leave: the table ends empty.
    for copy in range(4):
        assert index.clear_copy(copy) == model.clear_copy(copy)
    assert len(index) == 0 and index.pairs == 0



def test_both_cores_agree_on_one_sequence():
    if len(BLOCKS) < 2:
        pytest.skip("only one block module is available")
    rng = random.Random(7)
    indexes = [module.BlockIndex() for module in BLOCKS.values()]
    pool = [rng.randrange(-I64 - 1, I64 + 1) for _ in range(30)]
    for _ in range(2000):
        copy, keys = rng.randrange(5), [rng.choice(pool) for _ in range(rng.randrange(6))]
        name = rng.choice(("store", "add", "remove", "remove", "clear_copy"))
        args = (copy,) if name == "clear_copy" else (copy, keys)
        results = {repr(getattr(index, name)(*args)) for index in indexes}
        assert len(results) == 1, (name, results)
        assert len({repr(state(index, pool)) for index in indexes}) == 1


def test_overlap_stops_where_no_owner_holds_on(blocks):
    index = blocks.BlockIndex()
    data = np.arange(64, dtype="<i8").tobytes()  # 8 pages of 8 tokens
    keys = blocks.page_hash_chain(5, data, 64)
    index.add(0, keys[:6])        # copy 0: pages 0-5
    index.add(1, keys[:2])        # copy 1: pages 0-1
    index.add(2, keys[:8])        # copy 2: all, but on another tier (owner -1)
    index.add(3, keys[1:8])       # copy 3: misses page 0: never in the run
    assert index.overlap(5, data, 64, [0, 1, -1, 2]) == [(1, 2), (0, 6)]
    assert index.overlap(5, data, 64, [0, 0, -1, 2]) == [(0, 6)]   # two copies, one owner
    assert index.overlap(5, data, 64, [-1, -1, 0, 1]) == [(0, 8)]
    assert index.overlap(5, data, 64, [0]) == [(0, 6)]             # copies 1.. not counted
    assert index.overlap(5, data, 64, []) == []
    assert index.overlap(6, data, 64, [0, 1, 2, 3]) == []          # another seed: nothing
    assert index.overlap(5, data[:-8], 64, [0, 1]) == [(1, 2), (0, 6)]  # 7 full pages
    assert index.overlap(5, data[:60], 8 * 64, [0, 1]) == []       # no full page


BAD_CALLS = [
    ("hold", ("1", 0), TypeError, "key must be an int"),
    ("hold", (1.0, 0), TypeError, "key must be an int"),
    ("hold", (True, 0), TypeError, "key must be an int"),
    ("hold", (np.int64(1), 0), TypeError, "key must be an int"),
    ("hold", (1 << 63, 0), OverflowError, "does not fit in int64"),
    ("hold", (-(1 << 63) - 1, 0), OverflowError, "does not fit in int64"),
    ("hold", (1, -1), ValueError, "copy must be in"),
    ("hold", (1, 1 << 31), ValueError, "copy must be in"),
    ("hold", (1, False), TypeError, "copy must be an int"),
    ("hold", (1, "0"), TypeError, "copy must be an int"),
    ("unhold", (None, 0), TypeError, "key must be an int"),
    ("holds", (1 << 64, 0), OverflowError, "does not fit in int64"),
    ("holders", ("k",), TypeError, "key must be an int"),
    ("store", (0, [1, 2, "3"]), TypeError, "keys must be ints, got str at position 2"),
    ("store", (0, [1, 2, 1 << 63]), OverflowError, "at position 2 does not fit in int64"),
    ("store", (0, [1, True]), TypeError, "got bool at position 1"),
    ("store", (0, [1, 2.0]), TypeError, "got float at position 1"),
    ("store", (0, {1, 2}), TypeError, "keys must be a list or tuple of ints, or bytes"),
    ("store", (0, np.array([1, 2])), TypeError, "keys must be a list or tuple"),
    ("store", (0, b"1234567"), ValueError, "multiple of 8 bytes"),
    ("add", (0, [1, 2, None]), TypeError, "keys must be ints, got NoneType at position 2"),
    ("add", (-1, [1]), ValueError, "copy must be in"),
    ("remove", (0, [1, 2, "x"]), TypeError, "at position 2"),
    ("remove", (0, iter([1])), TypeError, "keys must be a list or tuple"),
    ("clear_copy", (None,), TypeError, "copy must be an int"),
    ("overlap", (1.0, b"", 8, []), TypeError, "seed must be an int"),
    ("overlap", (1, bytearray(8), 8, []), TypeError, "data must be bytes"),
    ("overlap", (1, b"", 12, []), ValueError, "page_bytes must be a positive multiple of 8"),
    ("overlap", (1, b"", 0, []), ValueError, "page_bytes must be a positive multiple of 8"),
    ("overlap", (1, b"", 8, [0, 2]), ValueError, "owners must be -1 or in [0, 2)"),
    ("overlap", (1, b"", 8, [-2]), ValueError, "owners must be -1 or in [0, 1)"),
    ("overlap", (1, b"", 8, [0.0]), TypeError, "keys must be ints"),
]


@pytest.mark.parametrize("name,args,error,message", BAD_CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_bad_input_raises_and_changes_nothing(blocks, name, args, error, message):
    index = blocks.BlockIndex()
    index.store(0, [1, 2, 3])
    index.store(1, [2, 5])
    index.hold(2, 0)
    before = state(index, [1, 2, 3, 5])
    with pytest.raises(error, match=__import__("re").escape(message)):
        getattr(index, name)(*args)
    assert state(index, [1, 2, 3, 5]) == before


def test_page_hash_bytes_matches_the_chain(blocks):
    rng = np.random.default_rng(3)
    tokens = rng.integers(-2**63, 2**63 - 1, 100, dtype=np.int64)
    data = tokens.astype("<i8").tobytes()
    for seed in (0, -1, 12345, I64):
        expected = np.array(blocks.page_hash_chain(seed, data, 32), dtype=np.int64)
        assert blocks.page_hash_bytes(seed, data, 32) == expected.tobytes()
        view = tokens.astype("<i8")
        view.flags.writeable = False
        assert blocks.page_hash_bytes(seed, view, 32) == expected.tobytes()
    assert blocks.page_hash_bytes(0, data[:31], 32) == b""
    for bad, message in ((tokens.astype(np.int32), "1-D contiguous little-endian int64"),
                         (tokens[::2], "1-D contiguous"), (tokens.reshape(10, 10), "2-D"),
                         (list(tokens), "data must be bytes or an int64 numpy array")):
        with pytest.raises(TypeError, match=message):
            blocks.page_hash_bytes(0, bad, 32)
    with pytest.raises(ValueError, match="page_bytes"):
        blocks.page_hash_bytes(0, data, 12)


def test_pickle_and_copy_keep_every_holding(blocks):
    import copy as copy_module
    index = blocks.BlockIndex()
    index.store(0, [1, 2, 3, -(1 << 63), I64])
    index.add(1, [2, 2])
    index.hold(2, 0)
    keys = [1, 2, 3, -(1 << 63), I64, 4]
    for clone in (pickle.loads(pickle.dumps(index)), copy_module.deepcopy(index),
                  copy_module.copy(index)):
        assert type(clone) is type(index)
        assert state(clone, keys) == state(index, keys)
        assert clone.holders(2) == [0, 1, 1, 0]  # order kept
        clone.clear_copy(0)
        assert index.holders(2) == [0, 1, 1, 0]  # independent
    assert state(pickle.loads(pickle.dumps(blocks.BlockIndex())), keys) == (0, 0, {
        k: [] for k in keys})
    restore = index.__reduce__()[0]
    for bad in ((b"1234567", b""), (b"12345678", b""), (b"12345678", b"\xff" * 4),
                ("12345678", b"1234"), (b"12345678", b"12345")):
        with pytest.raises(ValueError, match="malformed BlockIndex state"):
            restore(*bad)


# -- KvIndexer over each index -------------------------------------------------------------
def random_events(rng, block_size, tokens, held):
    """One batch of a worker's events: sequences stored from their first block or continued
    from a stored one (``held``: what the worker stored, (hashes, keys, end block, medium,
    group)), under the indexer's own keys or SHA-like publisher hashes, on two tiers and
    two groups; removals of known and unknown blocks, bytes hashes, clears."""
    events = []
    blocks = len(tokens) // block_size
    for _ in range(rng.randrange(1, 6)):
        kind = rng.random()
        if kind < 0.55 or not held:
            n = rng.randrange(1, 4)
            base = rng.choice(held) if held and rng.random() < 0.5 else None
            if base is not None and base[2] + n <= blocks:
                _, base_keys, start, medium, group = base
                parent, seed = base[0][-1], base_keys[-1]
            else:
                start, parent, seed = 0, None, fast64_root(b"")
                medium, group = rng.choice((None, "GPU", "CPU")), rng.choice((None, 1))
            toks = tokens[start * block_size:(start + n) * block_size]
            keys = _core.blocks.page_hash_chain(
                seed, np.array(toks, dtype="<i8").tobytes(), block_size * 8)
            own = rng.random() < 0.5
            hashes = tuple(keys) if own else tuple(rng.randrange(1 << 62) for _ in keys)
            if rng.random() < 0.05:
                parent = rng.randrange(1 << 62)  # a parent the index never saw: counted
            events.append(BlockStored(hashes, parent, tuple(toks), block_size, medium=medium,
                                      group_idx=group))
            held.append((hashes, keys, start + n, medium, group))
        elif kind < 0.9:
            hashes, _, _, medium, group = rng.choice(held)
            part = list(hashes[rng.randrange(len(hashes)):])
            if rng.random() < 0.2:
                part.append(rng.randrange(1 << 62))  # unknown
            events.append(BlockRemoved(tuple(part), medium, group_idx=group))
        elif kind < 0.95:
            events.append(AllBlocksCleared())
            held.clear()
        else:
            events.append(BlockRemoved((b"\x01" * 32,)))  # a bytes hash: never held
    return events


def test_indexer_on_the_compiled_index_equals_the_pure_one():
    if len(BLOCKS) < 2:
        pytest.skip("only one block module is available")
    rng = random.Random(11)
    block_size = 2
    tokens = [rng.randrange(6) for _ in range(40)]
    fast, pure = KvIndexer(block_size), KvIndexer(block_size)
    pure._index = _blocks_py.BlockIndex()
    assert type(fast._index) is BLOCKS["c"].BlockIndex
    held = {w: [] for w in (0, 1, 2, "w3")}
    for _ in range(400):
        worker = rng.choice((0, 1, 2, "w3"))
        events = random_events(rng, block_size, tokens, held[worker])
        fast.apply(worker, events)
        pure.apply(worker, events)
        assert fast.stats == pure.stats
        assert len(fast) == len(pure)
        for w in (0, 1, 2, "w3"):
            for medium in (None, "GPU", "CPU"):
                assert fast.blocks_held(w, medium) == pure.blocks_held(w, medium)
        query = tokens[:rng.randrange(len(tokens))]
        for medium in ("GPU", "CPU"):
            assert fast.overlap(query, medium=medium) == pure.overlap(query, medium=medium)
    stats = fast.stats
    assert stats.stored_blocks and stats.removed_blocks and stats.cleared
    assert stats.unknown_parent and stats.unknown_removals and stats.duplicate_blocks
    # An indexer pickles and copies with its block table.
    import copy as copy_module
    for clone in (pickle.loads(pickle.dumps(fast)), copy_module.deepcopy(pure)):
        assert clone.stats == fast.stats and len(clone) == len(fast)
        for w in (0, 1, 2, "w3"):
            assert clone.blocks_held(w) == fast.blocks_held(w)
            assert clone.overlap(tokens) == fast.overlap(tokens)
        clone.remove_worker(0)
        assert fast.blocks_held(0) == pure.blocks_held(0)


class HostileWorker:
    """A worker id whose __hash__/__eq__ run code: they must never reach the compiled part.
    The ``countdown``-th __eq__ call once armed runs ``action``."""

    calls = 0
    countdown = 0
    action = None

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        HostileWorker.calls += 1
        return 7  # every such worker collides

    def __eq__(self, other):
        HostileWorker.calls += 1
        if HostileWorker.action is not None:
            HostileWorker.countdown -= 1
            if HostileWorker.countdown == 0:
                action, HostileWorker.action = HostileWorker.action, None
                action()
        return isinstance(other, HostileWorker) and other.name == self.name


@pytest.mark.parametrize("countdown", range(1, 7))
def test_hostile_worker_ids_stay_in_python(blocks, monkeypatch, countdown):
    monkeypatch.setattr(_core, "blocks", blocks)
    monkeypatch.setattr(HostileWorker, "action", None)
    indexer = KvIndexer(2)
    tokens = [1, 2, 3, 4, 5, 6]

    def store(worker, n):
        keys = indexer.block_keys(tokens[:n])
        indexer.apply(worker, [BlockStored(tuple(keys), None, tuple(tokens[:n]), 2)])

    a, b = HostileWorker("a"), HostileWorker("b")
    for worker, n in ((a, 6), (b, 4), (1, 2)):
        store(worker, n)

    def reenter():
        # While the indexer looks its workers up: one leaves (its copy id is freed) and
        # another arrives (a copy id is taken).
        indexer.remove_worker(1)
        store(5, 4)

    HostileWorker.calls = 0
    HostileWorker.countdown, HostileWorker.action = countdown, reenter
    first = indexer.overlap(tokens)
    assert HostileWorker.calls > 0  # their methods ran (in Python)
    # The answer is the state before or after (or between); the next is the state after.
    assert first in ({a: 3, b: 2, 1: 1}, {a: 3, b: 2, 5: 2}, {a: 3, b: 2})
    if HostileWorker.action is None:  # it re-entered
        assert indexer.blocks_held(1) == 0
        assert indexer.overlap(tokens) == {a: 3, b: 2, 5: 2}
    else:
        assert indexer.overlap(tokens) == {a: 3, b: 2, 1: 1}
        HostileWorker.action = None
    store(2, 6)
    assert indexer.overlap(tokens)[2] == 3
    assert indexer.overlap(tokens, medium="CPU") == {}


# -- the fleet's direct feed ----------------------------------------------------------------
def namespaced_chat():
    requests = synthetic_chat(num_conversations=30, num_system_prompts=3, seed=9,
                              system_prompt_len=(30, 90), user_len=(3, 20),
                              output_len=(3, 20))
    # Two tenants share the token ids of some conversations: the namespace must key them.
    return [Request(r.prompt, r.output_len, r.output, extra_key=("t1" if i % 3 else None))
            for i, r in enumerate(requests)]


def comparable(result):
    return {k: v for k, v in result.__dict__.items() if k not in ("seconds", "wall_seconds")}


@pytest.mark.parametrize("lag", [EventLag(), EventLag(requests=3), EventLag(ms=40.0)],
                         ids=["no-lag", "3-requests", "40ms"])
@pytest.mark.parametrize("capacity", [120, 2000], ids=["evicting", "roomy"])
def test_direct_feed_decides_like_the_event_path(core_name, lag, capacity):
    requests = namespaced_chat()
    common = dict(page_size=4, core=core_name, interval_ms=20, event_lag=lag,
                  time_model=TimeModel(prefill_tokens_per_s=3000.0, decode_tokens_per_s=300.0))
    direct = simulate_fleet(requests, 3, capacity, "cache-aware", **common)
    events = simulate_fleet(requests, 3, capacity, "cache-aware",
                            channels=[InProcessChannel() for _ in range(3)], **common)
    assert comparable(direct) == comparable(events)
    stats = direct.indexer_stats
    assert stats["stored_blocks"] > 0 and direct.cached_tokens > 0
    if capacity == 120:
        assert stats["removed_blocks"] > 0 and direct.evicted_tokens > 0
    assert stats["unknown_parent"] == stats["unknown_removals"] == 0
    assert len(set(direct.decisions)) == 3


def test_direct_feed_on_the_pure_index_decides_like_the_compiled_one(monkeypatch):
    if len(CORES) < 2 or len(BLOCKS) < 2:
        pytest.skip("only one tree core is available")
    requests = namespaced_chat()
    common = dict(page_size=4, interval_ms=20, event_lag=EventLag(requests=1))
    results = []
    for name in ("c", "python"):
        monkeypatch.setattr(_core, "core", CORES[name])  # the caches' core
        monkeypatch.setattr(_core, "blocks", BLOCKS[name])  # the index's
        results.append(simulate_fleet(requests, 3, 150, "cache-aware", **common))
    assert comparable(results[0]) == comparable(results[1])


def test_a_large_table_grows_and_empties(blocks):
    # Past a few MiB the compiled table lives in its own (huge-page) allocation.
    keys = np.random.default_rng(5).integers(-2**63, 2**63 - 1, 200_000, dtype=np.int64)
    data = keys.tobytes()
    index = blocks.BlockIndex()
    assert index.store(3, data) == (len(set(keys.tolist())), len(keys) - len(set(keys.tolist())))
    assert index.store(3, data[:800]) == (0, 100)
    assert index.add(4, data[:80]) == 10
    assert index.holders(int(keys[0])) == [3, 4]
    assert index.remove(3, data) == (len(index) and len(set(keys.tolist())), 0)
    assert len(index) == 10 and index.pairs == 10
    assert index.clear_copy(4) == 10
    assert len(index) == 0 and index.pairs == 0
    assert index.store(3, data[:80]) == (10, 0)


def test_the_compiled_table_costs_at_most_32_bytes_a_block_at_any_size():
    # The table is rebuilt half full once it passes 3/4 (any size is a capacity), so a block
    # never costs more than 32 bytes of table while keys arrive; removals shrink it back to
    # at least a quarter full. tracemalloc sees every table, huge-page ones included.
    if "c" not in BLOCKS:
        pytest.skip("the compiled block module is not built")
    import tracemalloc

    keys = np.random.default_rng(9).integers(-2**63, 2**63 - 1, 150_000, dtype=np.int64)
    chunks = [keys[start:start + 997].tobytes() for start in range(0, len(keys), 997)]
    tracemalloc.start()
    try:
        index = BLOCKS["c"].BlockIndex()
        empty = tracemalloc.get_traced_memory()[0]
        worst = 0.0
        for chunk in chunks:
            index.store(0, chunk)
            worst = max(worst, (tracemalloc.get_traced_memory()[0] - empty) / len(index))
        assert len(index) == len(set(keys.tolist()))
        assert worst <= 32
        index.remove(0, b"".join(chunks[:-10]))  # all but the last 10 chunks' keys leave
        assert len(index) == len(set(keys[997 * (len(chunks) - 10):].tolist()))
        assert (tracemalloc.get_traced_memory()[0] - empty) / len(index) <= 64
    finally:
        tracemalloc.stop()


def test_keys_already_held_grow_no_compiled_table():
    # Room is made for the keys a batch adds, not for its length: storing a prefix again
    # (the same copy, or as a pickle lists it, a key once per holding) keeps the table.
    if "c" not in BLOCKS:
        pytest.skip("the compiled block module is not built")
    import tracemalloc

    keys = np.random.default_rng(10).integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64)
    data = keys.tobytes()
    distinct = len(set(keys.tolist()))
    tracemalloc.start()
    try:
        empty = tracemalloc.get_traced_memory()[0]
        index = BLOCKS["c"].BlockIndex()
        for start in range(0, len(data), 8 * 800):
            index.store(0, data[start:start + 8 * 800])
        held = tracemalloc.get_traced_memory()[0]
        assert index.store(0, data) == (0, len(keys))
        assert index.add(0, data[:8]) == 1  # one key held twice: a holder list, no table
        assert tracemalloc.get_traced_memory()[0] - held < 1024
        for copy in range(1, 8):
            index.store(copy, data)
        assert index.pairs == 8 * distinct + 1
        size = tracemalloc.get_traced_memory()[0] - empty
        state = pickle.dumps(index)
        before = tracemalloc.get_traced_memory()[0]
        again = pickle.loads(state)
        # The copy's table is sized for its distinct keys, as the original's (the holder
        # lists cost the same in both; a table for 8 times as many keys would not).
        assert tracemalloc.get_traced_memory()[0] - before < 1.25 * size
    finally:
        tracemalloc.stop()
    assert len(again) == distinct and again.pairs == index.pairs


@pytest.mark.parametrize("block_hash", ["sha256", "fast64"])
def test_insert_records_the_same_events_on_the_fast_and_the_checked_path(make_cache,
                                                                         block_hash):
    # int64 arrays take the core's fast path, int32 ones the checked path: with events on,
    # both must record the same stream (a new leaf's BlockStored, evictions, splits).
    rng = random.Random(4)
    options = {"block_hash": block_hash}
    fast = make_cache(page_size=4, enable_events=True, event_options=options)
    checked = make_cache(page_size=4, enable_events=True, event_options=options)
    stems = [[rng.randrange(9) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    stored = removed = 0
    for step in range(300):
        tokens = rng.choice(stems)[:rng.randrange(0, 30)] + [
            rng.randrange(9) for _ in range(rng.randrange(0, 9))]
        kv = np.arange(len(tokens), dtype=np.int64) + 1000 * step
        fast.insert(np.array(tokens, dtype=np.int64), kv)
        checked.insert(np.array(tokens, dtype=np.int32), kv)
        if rng.random() < 0.2:
            fast.match_prefix(np.array(tokens, dtype=np.int64))
            checked.match_prefix(np.array(tokens, dtype=np.int64))
        if rng.random() < 0.15:
            count = rng.randrange(1, 40)
            fast.evict(count)
            checked.evict(count)
        events = fast.take_events()
        assert events == checked.take_events()
        stored += sum(type(e) is BlockStored for e in events)
        removed += sum(type(e) is BlockRemoved for e in events)
    assert stored > 50 and removed > 10


# -- the public contract of the direct feed -------------------------------------------------
def drive_twins(caches, rng, steps=200):
    """The same inserts, matches, evictions and resets on every cache; yields each step."""
    stems = [[rng.randrange(7) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    for step in range(steps):
        tokens = rng.choice(stems)[:rng.randrange(0, 24)] + [
            rng.randrange(7) for _ in range(rng.randrange(0, 7))]
        extra_key = rng.choice([None, None, "tenant", 3])
        for cache in caches:
            cache.insert(tokens, np.arange(len(tokens), dtype=np.int64) + 1000 * step,
                         extra_key=extra_key)
        if rng.random() < 0.2:
            count = rng.randrange(1, 30)
            for cache in caches:
                cache.evict(count)
        if step == steps // 2:
            for cache in caches:
                cache.reset()
        yield step


def test_key_records_index_exactly_as_fast64_events(make_cache):
    rng = random.Random(11)
    keyed = make_cache(page_size=2, enable_events=True, event_options={"record": "keys"},
                       array_type="numpy")
    evented = make_cache(page_size=2, enable_events=True,
                         event_options={"block_hash": "fast64"}, array_type="numpy")
    by_keys, by_events = KvIndexer(2), KvIndexer(2)
    kinds = set()
    for step in drive_twins([keyed, evented], rng):
        records, events = keyed.take_events(), evented.take_events()
        assert len(records) == len(events)
        for record, event in zip(records, events):
            if type(event) is AllBlocksCleared:
                assert type(record) is AllBlocksCleared
                kinds.add("cleared")
                continue
            # A record's keys are the event's fast64 hashes, as native int64 bytes.
            assert np.frombuffer(record[1], dtype=np.int64).tolist() == list(event.block_hashes)
            if type(event) is BlockStored:
                assert record[0] == KEYS_STORED and record[2] == event.parent_block_hash
                kinds.add("stored")
            else:
                assert type(event) is BlockRemoved and record[0] == KEYS_REMOVED
                assert len(record) == 2
                kinds.add("removed")
        by_keys.apply_keys(step % 3, records)
        by_events.apply(step % 3, events)
        assert by_keys.stats == by_events.stats
        probe = rng.choice([[1, 2, 3, 4, 5, 6], [0, 1, 2, 3], [6, 5, 4, 3, 2, 1, 0, 0]])
        for extra_key in (None, "tenant", 3):
            assert by_keys.overlap(probe, extra_key) == by_events.overlap(probe, extra_key)
    assert kinds == {"stored", "removed", "cleared"}
    assert by_keys.stats.stored_blocks > 50 and by_keys.stats.removed_blocks > 10
    assert [by_keys.blocks_held(w) for w in range(3)] == [
        by_events.blocks_held(w) for w in range(3)]


def test_key_records_read_a_split_upper_half_from_its_lower_half(make_cache):
    """A leaf stored below the upper half of a split chains from that half's last page: the
    key recorder reads it from the keys it recorded for the lower half (no page hashed
    again), and it is the fast64 event's parent hash, however often the path splits."""
    keyed = make_cache(page_size=2, enable_events=True, event_options={"record": "keys"},
                       array_type="numpy")
    evented = make_cache(page_size=2, enable_events=True,
                         event_options={"block_hash": "fast64"}, array_type="numpy")
    rehashed = []
    recorder = keyed._events
    chain = recorder._chain
    recorder._chain = lambda *args: rehashed.append(args) or chain(*args)
    base = list(range(1, 21))
    for cache in (keyed, evented):
        cache.insert(np.array(base, dtype=np.int64))
        cache.take_events()
    for cut in (12, 6, 16, 2):  # the leaf splits at 12, its upper half at 6, ...
        for cache in (keyed, evented):
            cache.insert(np.array(base[:cut] + [99, 98], dtype=np.int64))
        records, events = keyed.take_events(), evented.take_events()
        stored = [r for r in records if r[0] == KEYS_STORED]
        assert len(stored) == 1 and stored[0][2] == events[-1].parent_block_hash is not None
    assert rehashed == []


def test_key_records_evict_split_upper_halves_with_the_keys_of_their_lower_halves(make_cache):
    """Evicting a path split several times hashes no page: each upper half's keys are left
    to it by the lower half evicted before it, and the records carry the fast64 events'
    hashes."""
    keyed = make_cache(page_size=2, enable_events=True, event_options={"record": "keys"},
                       array_type="numpy")
    evented = make_cache(page_size=2, enable_events=True,
                         event_options={"block_hash": "fast64"}, array_type="numpy")
    base = list(range(1, 21))
    for cache in (keyed, evented):
        cache.insert(np.array(base, dtype=np.int64))
        for cut in (12, 6, 16, 2):
            cache.insert(np.array(base[:cut] + [99, 98], dtype=np.int64))
        cache.take_events()
    hashed = []
    recorder = keyed._events
    hash_bytes = recorder._hash_bytes
    recorder._hash_bytes = lambda *args: hashed.append(args) or hash_bytes(*args)
    for cache in (keyed, evented):
        assert cache.evict(len(base) + 8) == len(base) + 8  # everything, leaves first
    records, events = keyed.take_events(), evented.take_events()
    assert [record[0] for record in records] == [KEYS_REMOVED] * len(events) != []
    assert [np.frombuffer(record[1], dtype=np.int64).tolist() for record in records] == [
        list(event.block_hashes) for event in events]
    assert hashed == []
    assert recorder._node_keys == {} and recorder.tracked_nodes == 0


@pytest.mark.parametrize("options, host_tier, exc, pattern", [
    ({"record": 1}, False, TypeError, "event option record must be a str, got int"),
    ({"record": "objects"}, False, ValueError, "unknown record 'objects'; valid: events, keys"),
    ({"record": "keys", "medium": "CPU"}, False, ValueError,
     "record='keys' takes no other option, got 'medium'"),
    ({"record": "keys", "block_hash": "fast64"}, False, ValueError,
     "record='keys' takes no other option, got 'block_hash'"),
    ({"record": "keys"}, True, ValueError, "record='keys' needs a cache without a host tier"),
    ({"recorder": "keys"}, False, TypeError, "unknown event option 'recorder'; valid: .*record"),
])
def test_bad_record_option_is_refused(make_cache, options, host_tier, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make_cache(page_size=2, enable_events=True, event_options=options, host_tier=host_tier)


def test_record_events_is_the_default_recorder(make_cache):
    explicit = make_cache(page_size=2, enable_events=True, event_options={"record": "events"})
    default = make_cache(page_size=2, enable_events=True)
    for cache in (explicit, default):
        cache.insert([1, 2, 3, 4])
    assert explicit.take_events() == default.take_events() != []


def test_apply_keys_skips_and_counts_malformed_records(make_cache):
    cache = make_cache(page_size=2, enable_events=True, event_options={"record": "keys"})
    cache.insert([1, 2, 3, 4])
    good = cache.take_events()
    indexer = KvIndexer(2)
    indexer.apply_keys(0, good)
    held = (indexer.overlap([1, 2, 3, 4]), len(indexer), indexer.stats.as_dict())
    assert held[0] == {0: 2}
    keys = good[0][1]
    bad = [
        "stored", None, (), (KEYS_STORED,), (KEYS_STORED, keys), (KEYS_REMOVED, keys, None),
        (KEYS_STORED, keys[:5], None), (KEYS_STORED, list(keys), None),
        (KEYS_STORED, keys, "parent"), (KEYS_STORED, keys, [1]), (7, keys, None),
        (True, keys), (np.int64(1), keys), (KEYS_REMOVED, bytearray(keys)),
        (KEYS_STORED, keys, None, None),
    ]
    indexer.apply_keys(0, bad)
    stats = indexer.stats.as_dict()
    assert stats["malformed_events"] == len(bad)
    assert stats["batches"] == held[2]["batches"] + 1
    assert stats["events"] == held[2]["events"] + len(bad)
    assert (indexer.overlap([1, 2, 3, 4]), len(indexer)) == held[:2]
    indexer.apply_keys(0, 42)  # not a batch
    assert indexer.stats.malformed_batches == 1
    for worker in (None, [0]):
        with pytest.raises(TypeError, match="worker must be a hashable id"):
            indexer.apply_keys(worker, good)
    assert (indexer.overlap([1, 2, 3, 4]), len(indexer)) == held[:2]
    # An unknown parent and removals of blocks never held are counted like apply's.
    indexer.apply_keys(1, [(KEYS_STORED, keys[8:], 12345), (KEYS_REMOVED, keys)])
    assert indexer.stats.unknown_parent == 1 and indexer.stats.unknown_removals == 2
    assert 1 not in indexer.workers


@pytest.mark.parametrize("fed_events", [False, True])
def test_apply_keys_of_one_batch_equals_one_record_at_a_time(make_cache, fed_events):
    """A batch whose records drop the worker's copy, make it again and clear it is applied
    as its records one call each (apply_keys keeps the worker's copy across a batch); also
    for a worker fed events under other hashes (the general path)."""
    cache = make_cache(page_size=2, enable_events=True, event_options={"record": "keys"})
    cache.insert([1, 2, 3, 4])
    (stored,) = cache.take_events()
    keys = stored[1]
    first = int(np.frombuffer(keys[:8], dtype=np.int64)[0])
    records = [
        stored,
        (KEYS_REMOVED, keys),  # the worker holds nothing: its copy goes
        (KEYS_STORED, keys[8:], first),  # so the parent is unknown
        stored,
        (KEYS_STORED, keys[8:], first),  # a duplicate under a known parent
        AllBlocksCleared(),
        (KEYS_REMOVED, keys),  # nothing held
        (KEYS_STORED, keys[:8], None),
        (KEYS_STORED, keys[8:], first),
        (KEYS_REMOVED, keys[:8]),
        "bad",
        (KEYS_REMOVED, keys),
        (KEYS_STORED, keys, None),
    ]
    indexers = [KvIndexer(2), KvIndexer(2)]
    if fed_events:
        evented = make_cache(page_size=2, enable_events=True)  # sha256 hashes
        evented.insert([7, 8, 9, 10])
        events = evented.take_events()
        for indexer in indexers:
            indexer.apply(0, events)
        # Their removal, as a record, right after the keys': the copy goes there too.
        hashes = np.array(events[0].block_hashes, dtype=np.int64).tobytes()
        records.insert(2, (KEYS_REMOVED, hashes))
    indexers[0].apply_keys(0, records)
    for record in records:
        indexers[1].apply_keys(0, [record])
    batched, single = (indexer.stats.as_dict() for indexer in indexers)
    assert batched.pop("batches") + len(records) - 1 == single.pop("batches")
    assert batched == single
    assert batched["unknown_parent"] == 1 and batched["duplicate_blocks"] == 1
    for indexer in indexers:
        assert len(indexer) == 2 and indexer.blocks_held(0) == 2
        assert indexer.overlap([1, 2, 3, 4]) == {0: 2}
        assert indexer.overlap([7, 8, 9, 10]) == {}  # cleared with the rest


def test_a_block_index_pickled_before_it_had_its_own_module_loads(core_name):
    """A BlockIndex pickled while the block index lived in the tree core names its loader
    there (``radixcache._core_c._block_index_from``): that name still loads it."""
    blocks = BLOCKS[core_name]
    index = blocks.BlockIndex()
    index.add(3, [5, -6, 5])
    index.hold(2**63 - 1, 0)
    loader, args = index.__reduce__()
    assert loader.__module__ == blocks.__name__
    old_name = f"{CORES[core_name].__name__}\n_block_index_from\n".encode()
    old_pickle = b"\x80\x03c" + old_name + pickle.dumps(args, 3)[2:-1] + b"R."
    loaded = pickle.loads(old_pickle)
    assert type(loaded) is blocks.BlockIndex
    assert loaded.holders(5) == [3, 3] and loaded.holders(-6) == [3]
    assert loaded.holders(2**63 - 1) == [0] and loaded.pairs == 4


# -- KeyMap: publisher hash -> block key -------------------------------------------------------
def test_key_map_matches_a_dict_of_hash64(blocks):
    """Puts, pops and gets of int and bytes hashes against a dict keyed by ``hash64``; both
    modules hash alike; bulk updates, pickles and bad input."""
    rng = random.Random(7)
    values = ([rng.randrange(-2**63, 2**64) for _ in range(60)]
              + [rng.randbytes(rng.randrange(0, 40)) for _ in range(60)]
              + [0, 1, -1, b"", np.int64(5), 2**64 - 1])
    assert [blocks.hash64(v) for v in values] == [_blocks_py.hash64(v) for v in values]
    assert blocks.hash64(b"\x01" * 32) != blocks.hash64(b"\x01" * 31)
    keys, model = blocks.KeyMap(), {}
    for _ in range(5000):
        value, roll = rng.choice(values), rng.random()
        if roll < 0.5:
            key = rng.randrange(-2**63, 2**63)
            keys.put(value, key)
            model[blocks.hash64(value)] = key
        elif roll < 0.9:
            assert keys.pop(value) == model.pop(blocks.hash64(value), None)
        else:
            assert keys.get(value, "none") == model.get(blocks.hash64(value), "none")
            assert (value in keys) == (blocks.hash64(value) in model)
        assert len(keys) == len(model)
    assert sorted(keys.values()) == sorted(model.values())
    for clone in (pickle.loads(pickle.dumps(keys)), copy_module.deepcopy(keys)):
        assert len(clone) == len(keys) and all(clone.get(v) == keys.get(v) for v in values)
    bulk = blocks.KeyMap()
    assert bulk.isdisjoint([b"a", 5]) and not bulk.isdisjoint([5, 5])
    bulk.update([b"a", 5, 7], [1, 2, 3])
    bulk.update((9,), np.array([4], dtype=np.int64).tobytes())
    assert [bulk.get(h) for h in (b"a", 5, 7, 9, 8)] == [1, 2, 3, 4, None]
    assert not bulk.isdisjoint([8, 7]) and bulk.isdisjoint([8])
    with pytest.raises(TypeError):
        bulk.put("a str", 1)
    with pytest.raises(TypeError):
        bulk.update([1.5], [1])
    with pytest.raises(ValueError, match="2 hashes for 1 keys"):
        bulk.update([11, 12], [1])
    with pytest.raises(OverflowError):
        bulk.put(11, 2**63)
    assert len(bulk) == 4 and bulk.get(11) is None
    bulk.clear()
    assert len(bulk) == 0 and bulk.get(5) is None
    bulk.put(5, 6)
    assert bulk.get(5) == 6


@pytest.mark.parametrize("page_bytes", [8, 24, 128, 4104])
def test_overlap_of_a_list_answers_and_fails_as_of_its_bytes(blocks, page_bytes):
    """A list is read as it is walked, over several reads of its ids: the answer is that of
    its bytes at every length, and an id that is no int64 is named wherever it lies (in the
    walked blocks, past where the walk stops, in a last partial page, in a list shorter than
    a page), before a wrong other argument."""
    rng = random.Random(page_bytes)
    per_page = page_bytes // 8
    tokens = [rng.randrange(-(1 << 62), 1 << 62) for _ in range(per_page * 700 + per_page // 2)]
    data = np.array(tokens, dtype="<i8").tobytes()
    keys = blocks.page_hash_chain(9, data, page_bytes)
    index = blocks.BlockIndex()
    index.add(0, keys[:650])
    index.add(1, keys[:2])  # a copy on no owner
    index.add(2, keys[3:9])  # not from the first block: never counted
    index.add(3, keys[:1])
    owners = [0, -1, 2, 1]
    for length in (0, 1, per_page - 1, per_page, per_page + 1, 5 * per_page, 650 * per_page,
                   650 * per_page + 1, len(tokens)):
        assert index.overlap(9, tokens[:length], page_bytes, owners) == \
            index.overlap(9, data[:8 * length], page_bytes, owners)
    assert index.overlap(9, tokens, page_bytes, owners) == [(1, 1), (0, 650)]
    for position in (0, per_page - 1, per_page * 300, per_page * 660, len(tokens) - 1):
        for bad, error in ((1.0, TypeError), (2**63, OverflowError), (True, TypeError)):
            hostile = list(tokens)
            hostile[position] = bad
            with pytest.raises(error, match=f"at position {position}( |$)"):
                index.overlap(9, hostile, page_bytes, owners)
            with pytest.raises(error, match=f"at position {position}( |$)"):
                index.overlap(9, hostile, page_bytes, [0, 7, 0, 0])  # the ids' error first
    with pytest.raises(TypeError, match="at position 0"):
        index.overlap(9, ["x"], page_bytes, owners)  # shorter than a page
    with pytest.raises(ValueError, match="owners must be -1 or in"):
        index.overlap(9, tokens, page_bytes, [0, 7])
    with pytest.raises(ValueError, match="page_bytes must be a positive multiple of 8"):
        index.overlap(9, tokens, 12, owners)
    with pytest.raises(TypeError, match="seed must be an int"):
        index.overlap(9.0, tokens, page_bytes, owners)


@pytest.mark.parametrize("page_bytes, others", [(8, 3000), (64, 3000), (256, 3000),
                                                (8, 70_000), (64, 70_000)])
def test_overlap_stops_at_every_depth_as_the_reference_does(blocks, page_bytes, others):
    """The walk hashes and probes pages ahead of the one it counts (on a small table and on
    one larger than a CPU cache): wherever the run ends (every depth up to past the lead,
    owners dropping out one by one, blocks held by many copies, a table grown large and
    shrunk), the answer is the pure module's, from a list and from bytes."""
    rng = random.Random(page_bytes)
    per_page = page_bytes // 8
    tokens = [rng.randrange(1 << 40) for _ in range(per_page * 60)]
    data = np.array(tokens, dtype="<i8").tobytes()
    keys = blocks.page_hash_chain(3, data, page_bytes)
    owners = [0, 1, 2, 3, -1, 0, 4, 5]
    filler = np.array([rng.randrange(-I64, I64) for _ in range(others)], dtype=np.int64).tobytes()
    for depth in range(0, 45):
        indexes = [module.BlockIndex() for module in (blocks, _blocks_py)]
        for index in indexes:
            index.add(0, keys[:depth])
            index.add(1, keys[:depth // 2])
            index.add(2, keys[:depth // 3] + keys[depth // 3 + 1:depth])  # a hole
            index.add(4, keys[:depth])  # on no owner
            index.add(5, keys[:depth // 4])  # the same owner as copy 0
            for c in (6, 7):  # many holders of the first blocks: holder lists
                index.add(c, keys[:5])
            index.add(8, filler)  # a larger table
            index.remove(8, [])
        want = indexes[1].overlap(3, data, page_bytes, owners)
        for index in indexes:
            assert index.overlap(3, data, page_bytes, owners) == want, depth
            assert index.overlap(3, tokens, page_bytes, owners) == want, depth
            assert index.overlap(3, tokens[:depth * per_page + 1], page_bytes, owners) == \
                indexes[1].overlap(3, data[:8 * (depth * per_page + 1)], page_bytes, owners)
        indexes[0].clear_copy(8)  # shrunk: the same answers
        assert indexes[0].overlap(3, tokens, page_bytes, owners) == want, depth


def test_overlap_reads_an_int64_array_in_place_as_its_bytes(blocks, monkeypatch):
    """An exactly 1-D contiguous little-endian int64 numpy array is read in place: the answer
    of its bytes; any other array is refused by type, a view or a subclass included, and
    ``KvIndexer`` reads those as any sequence."""
    rng = random.Random(5)
    tokens = np.array([rng.randrange(1 << 30) for _ in range(8 * 30 + 3)], dtype="<i8")
    data = tokens.tobytes()
    keys = blocks.page_hash_chain(4, data, 64)
    index = blocks.BlockIndex()
    index.add(0, keys[:20])
    index.add(1, keys[:7])
    want = index.overlap(4, data, 64, [0, 1])
    assert want == [(1, 7), (0, 20)]
    assert index.overlap(4, tokens, 64, [0, 1]) == want
    assert index.overlap(4, tokens[:8 * 7], 64, [0, 1]) == [(0, 7), (1, 7)]
    assert index.overlap(4, tokens[:5], 64, [0, 1]) == []
    assert index.overlap(4, np.array([], dtype="<i8"), 64, [0, 1]) == []

    class Sub(np.ndarray):
        pass

    for bad in (tokens.astype(np.int32), tokens.astype(">i8"), tokens[::2],
                tokens.reshape(-1, 1), tokens.view(Sub)):
        with pytest.raises(TypeError, match="data"):
            index.overlap(4, bad, 64, [0, 1])
    with pytest.raises(TypeError, match="seed must be an int"):
        index.overlap(4.0, tokens, 64, [0, 1])
    with pytest.raises(ValueError, match="owners must be -1 or in"):
        index.overlap(4, tokens, 64, [0, 5])
    monkeypatch.setattr(_core, "blocks", blocks)
    indexer = KvIndexer(8)
    indexer.apply(0, [BlockStored(tuple(keys[:20]), None, tuple(tokens[:160].tolist()), 8)])
    assert indexer.overlap(tokens) == {0: 20}
    for other in (tokens[::1].astype(">i8"), tokens.astype(np.int32), tokens.view(Sub),
                  list(tokens)):
        assert indexer.overlap(other) == {0: 20}


def test_overlap_of_a_list_runs_no_code_of_its_items(blocks):
    """The walk reads a list's ids without calling out: an int subclass or an ``__index__``
    object is refused by type wherever it lies (its code never runs, the list stays as it
    was), even past where the walk stops and when the walk has hashed past it."""
    calls = []

    class Index:
        def __index__(self):
            calls.append(1)
            tokens.clear()
            return 1

    class Int(int):
        def __index__(self):
            calls.append(1)
            tokens.clear()
            return int(self)

    base = [random.Random(7).randrange(1 << 40) for _ in range(8 * 40)]
    data = np.array(base, dtype="<i8").tobytes()
    keys = blocks.page_hash_chain(1, data, 64)
    index = blocks.BlockIndex()
    index.add(0, keys[:20])
    for position in (0, 8 * 19 + 3, 8 * 21, 8 * 39 + 7):
        for bad in (Index(), Int(5)):
            tokens = list(base)
            tokens[position] = bad
            with pytest.raises(TypeError, match=f"got {type(bad).__name__} at position "
                                                f"{position}( |$)"):
                index.overlap(1, tokens, 64, [0])
            assert len(tokens) == len(base) and tokens[position] is bad
    assert calls == []
    assert index.overlap(1, base, 64, [0]) == [(0, 20)]


def test_overlap_reads_a_list_of_token_ids_as_its_bytes(blocks, monkeypatch):
    """``overlap`` takes the token ids as a list too: the same answer as from their bytes,
    and a clear error for an item that is no int64 (``KvIndexer`` then reads such a list as
    any sequence)."""
    index = blocks.BlockIndex()
    tokens = [random.Random(3).randrange(1 << 40) for _ in range(64)]
    data = np.array(tokens, dtype="<i8").tobytes()
    keys = blocks.page_hash_chain(5, data, 32)
    index.add(0, keys[:5])
    index.add(1, keys[:3])
    owners = [0, 1]
    assert index.overlap(5, tokens, 32, owners) == index.overlap(5, data, 32, owners) != []
    assert index.overlap(5, [], 32, owners) == []
    with pytest.raises(TypeError, match="token ids must be ints, got float at position 2"):
        index.overlap(5, [1, 2, 3.0], 32, owners)
    with pytest.raises(OverflowError, match="position 1"):
        index.overlap(5, [1, 2**63], 32, owners)
    monkeypatch.setattr(_core, "blocks", blocks)
    indexer = KvIndexer(2)
    indexer.apply(0, [BlockStored((1, 2), None, (4, 5, 6, 7), 2)])
    assert indexer.overlap([4, 5, 6, 7]) == {0: 2}
    assert indexer.overlap([4, 5, np.int64(6), 7]) == {0: 2}  # read as any sequence
    with pytest.raises(OverflowError):
        indexer.overlap([4, 5, 2**70, 7])
    with pytest.raises(TypeError):
        indexer.overlap([4, 5, "6", 7])


def test_ids_le_bytes_reads_exact_int64s_and_names_the_first_bad_id(blocks):
    ids = [0, 1, -1, 2**63 - 1, -(2**63), 50_000, 2**40]
    want = np.array(ids, dtype="<i8").tobytes()
    assert blocks.ids_le_bytes(ids) == blocks.ids_le_bytes(tuple(ids)) == want
    assert blocks.ids_le_bytes([]) == blocks.ids_le_bytes(()) == b""
    for container in (list, tuple):
        with pytest.raises(TypeError, match="got bool at position 2"):
            blocks.ids_le_bytes(container([1, 2, True, 1.0]))
        with pytest.raises(TypeError, match="got float at position 1"):
            blocks.ids_le_bytes(container([1, 1.0, 2**70]))
        with pytest.raises(OverflowError, match="token id 9223372036854775808 at position 3"):
            blocks.ids_le_bytes(container([1, 2, 3, 2**63, "x"]))
        with pytest.raises(OverflowError, match="at position 0"):
            blocks.ids_le_bytes(container([-(2**63) - 1]))
    with pytest.raises(TypeError, match="must be a list or tuple, got ndarray"):
        blocks.ids_le_bytes(np.array(ids))


def test_key_map_add_new_maps_only_a_batch_of_new_distinct_hashes(blocks):
    m = blocks.KeyMap()
    assert m.add_new([5, b"h", 2**64 - 1], [1, 2, 3]) is True
    assert (m.get(5), m.get(b"h"), m.get(-1), len(m)) == (1, 2, 3, 3)  # -1: 2**64 - 1 mod 2**64
    for hashes in ([6, 5], [7, 7], [8, b"h"]):  # one held, one there twice: nothing changes
        assert m.add_new(hashes, [9, 9]) is False
        assert len(m) == 3 and m.get(6) is None and m.get(7) is None and m.get(5) == 1
    assert m.add_new((), b"") is True and len(m) == 3
    many = list(range(100, 1100))
    assert m.add_new(many, many) is True and len(m) == 1003 and m.get(1099) == 1099
    assert m.add_new(many[:1] + [5000], [1, 2]) is False and m.get(5000) is None
    with pytest.raises(TypeError):
        m.add_new([1.5], [1])
    with pytest.raises(ValueError, match="2 hashes for 1 keys"):
        m.add_new([11, 12], [1])
    with pytest.raises(OverflowError):
        m.add_new([11], [2**63])
    assert len(m) == 1003 and m.get(11) is None


@pytest.mark.parametrize("reader", ["default", "loop"])
def test_msgpack_ids_reads_exactly_an_array_of_int64s(blocks, reader, monkeypatch):
    """Every msgpack int form, array headers of each size; anything else is None (the pure
    module's own loop too, used where msgspec is missing)."""
    msgspec = pytest.importorskip("msgspec")
    if reader == "loop":
        if blocks is not _blocks_py:
            pytest.skip("the pure module's loop")
        monkeypatch.setattr(_blocks_py, "_IDS_DECODER", None)
    rng = random.Random(5)
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32,
             -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
    for n in (0, 1, 15, 16, 300, 70000):
        ids = [rng.choice(edges) if rng.random() < 0.5 else rng.randrange(-(2**63), 2**63)
               for _ in range(n)]
        raw = msgspec.msgpack.encode(ids)
        assert blocks.msgpack_ids(raw) == np.array(ids, dtype="<i8").tobytes()
        if n:
            assert blocks.msgpack_ids(raw[:-1]) is None  # cut short
        assert blocks.msgpack_ids(raw + b"\x00") is None  # left over
    # array32 header, and ints written wider than needed
    assert blocks.msgpack_ids(b"\xdd\x00\x00\x00\x02\xcf" + (5).to_bytes(8, "big") + b"\xd0\xff") \
        == np.array([5, -1], dtype="<i8").tobytes()
    for value in ([2**63], [2**64 - 1], [1.0], [True], [None], ["1"], [b"1"], [[1]], {"a": 1},
                  1, "x", [1, 2.5]):
        assert blocks.msgpack_ids(msgspec.msgpack.encode(value)) is None
    assert blocks.msgpack_ids(b"") is None and blocks.msgpack_ids(b"\xdc\x00") is None
    assert blocks.msgpack_ids(b"\x91\xcd\x01") is None  # a uint16 cut short
    with pytest.raises(TypeError, match="data must be bytes"):
        blocks.msgpack_ids(bytearray(b"\x90"))


def test_json_ids_reads_exactly_an_array_of_token_ids(blocks):
    """Arrays of ids in [0, 2**32) as json.dumps and other writers spell them (whitespace
    anywhere JSON allows it) are read; a mutated array is read exactly when the reference
    grammar (below) accepts it, and then as ``json.loads`` reads it."""
    import json
    import re

    rng = random.Random(7)
    edges = [0, 1, 9, 10, 99, 100, 2**31, 2**32 - 1]
    for n in (0, 1, 2, 17, 5000):
        ids = [rng.choice(edges) if rng.random() < 0.3 else rng.randrange(2**32)
               for _ in range(n)]
        for text in (json.dumps(ids), json.dumps(ids, indent=1), json.dumps(ids).replace(
                ",", " ,\t"), " \r\n" + json.dumps(ids, separators=(",", ":")) + "\n"):
            assert blocks.json_ids(text.encode()) == np.array(ids, dtype="<i8").tobytes()
    number = r"(?:0|[1-9][0-9]*)"
    space = r"[ \t\n\r]*"
    grammar = re.compile(rf"{space}\[{space}(?:{number}{space}(?:,{space}{number}{space})*)?"
                         rf"\]{space}")
    alphabet = "0123456789 ,[]-.e+\t\x0b\"x"
    seeds = ["[1, 2, 3]", "[0]", "[4294967295, 0]", "[]", " [ 12 ,34 ] "]
    for _ in range(4000):
        text = list(rng.choice(seeds))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(text) + 1)
            if rng.random() < 0.5 and text:
                del text[min(at, len(text) - 1)]
            else:
                text.insert(at, rng.choice(alphabet))
        text = "".join(text)
        expected = None
        if grammar.fullmatch(text):
            ids = json.loads(text)
            if all(i < 2**32 for i in ids):
                expected = np.array(ids, dtype="<i8").tobytes()
        assert blocks.json_ids(text.encode()) == expected, text
    for text in (b"[01]", b"[-0]", b"[1.0]", b"[1e3]", b"[4294967296]", b"[99999999999]",
                 b"[1,]", b"[,1]", b"[1 2]", b"[\x0b1]", b"1", b"", b"[", b"[1", b"[1]x",
                 b'["1"]', b"[[1]]", b"[true]", b"[null]",
                 b"[" + b"1" * 5000 + b"]"):  # past int()'s 4,300-digit limit: no error
        assert blocks.json_ids(text) is None, text
    with pytest.raises(TypeError, match="data must be bytes"):
        blocks.json_ids(bytearray(b"[1]"))


def test_json_ids_reads_a_slice_in_place_as_its_copy(blocks):
    """``json_ids(data, start, stop)`` answers what ``json_ids(data[start:stop])`` does, for
    every slice of bodies holding arrays: nothing outside the slice (a digit right after it,
    the bytes before it) changes the answer; bounds outside the data or of another type are
    refused."""
    for body in (b'{"token_ids": [12, 0, 4294967295], "x": 1}', b"[1]2", b"7[3,45]8", b"[]",
                 b" [ 1 ,\t2 ] ", b"[12]"):
        for start in range(len(body) + 1):
            for stop in range(start, len(body) + 1):
                assert blocks.json_ids(body, start, stop) == blocks.json_ids(
                    body[start:stop]), (body, start, stop)
            assert blocks.json_ids(body, start) == blocks.json_ids(body[start:])
    assert blocks.json_ids(b"x[5, 6]x", 1, 7) == np.array([5, 6], dtype="<i8").tobytes()
    for start, stop in ((-1, 2), (0, 4), (3, 2), (4, None)):
        with pytest.raises(ValueError, match="start and stop must be within the data"):
            blocks.json_ids(b"[1]", start, stop)
    with pytest.raises(TypeError, match="start must be an int"):
        blocks.json_ids(b"[1]", 0.0)
    with pytest.raises(TypeError, match="stop must be an int or None"):
        blocks.json_ids(b"[1]", 0, True)
    with pytest.raises(ValueError, match="start and stop"):
        blocks.json_ids(b"[1]", 0, 1 << 70)


def _reference_answer(rows: list, block_size: int, tenant) -> bytes:
    """``query_answer``'s answer built as plain objects (per instance its largest figures,
    per rank its largest device figure; objects keyed by name) and written by msgspec."""
    import msgspec

    merged: dict = {}
    for (instance, name, rank), blocks_held in rows:
        if type(blocks_held) is int:
            blocks_held = (blocks_held,) * 3
        gpu, cpu, disk = (b * block_size for b in blocks_held)
        entry = merged.setdefault(instance, [name, 0, 0, 0, {}])
        entry[1:4] = max(entry[1], gpu), max(entry[2], cpu), max(entry[3], disk)
        entry[4][str(rank)] = max(entry[4].get(str(rank), 0), gpu)
    named = [(msgspec.json.decode(name), gpu, cpu, disk,
              {r: t for r, t in sorted(dp.items(), key=lambda item: int(item[0]))})
             for name, gpu, cpu, disk, dp in merged.values()]
    if tenant is not None:
        if not named:
            return msgspec.json.encode({})
        return msgspec.json.encode({msgspec.json.decode(tenant): {
            name: {"longest_matched": disk, "GPU": gpu, "DP": dp, "CPU": cpu, "DISK": disk}
            for name, gpu, cpu, disk, dp in named}})
    scores: dict = {}
    instances: dict = {}
    for name, gpu, cpu, disk, dp in named:
        if not disk:
            continue
        instances[name] = {"longest_matched": disk, "gpu": gpu, "dp": dp, "cpu": cpu,
                           "disk": disk}
        if gpu:
            scores[name] = dp if len(dp) == 1 else {r: t for r, t in dp.items() if t}
    return msgspec.json.encode({"scores": scores, "frequencies": [], "instances": instances})


def test_query_answer_is_the_answer_msgspec_writes(blocks):
    """Random rows (instances of both id types, names that collide across them, several
    ranks and rows per rank, escaped names, figures per tier or one for all) give the bytes
    msgspec writes for the same answer, in both dialects."""
    msgspec = pytest.importorskip("msgspec")
    rng = random.Random(11)
    pool = [0, 1, 7, 10, 2**64 - 1, "0", "1", "a\"b", "é\n", "inst-9", "", "\\u0000"]
    for trial in range(600):
        rows = []
        for _ in range(rng.choice((0, 1, 2, 5, 40))):
            instance = rng.choice(pool)
            g = rng.choice((0, 0, 1, 3, 2**40 - 1))
            c = g + rng.choice((0, 1, 5))
            d = c + rng.choice((0, 2))
            figures = g if rng.random() < 0.3 else (g, min(c, 2**40 - 1), min(d, 2**40 - 1))
            rows.append(((instance, msgspec.json.encode(str(instance)),
                          rng.choice((0, 0, 1, 3, 2**31 - 1))), figures))
        block_size = rng.choice((1, 16, 2**20))
        for tenant in (None, b'"default"', msgspec.json.encode('t"\x01')):
            assert blocks.query_answer(rows, block_size, tenant) == _reference_answer(
                rows, block_size, tenant), (trial, rows, tenant)


def test_query_answer_refuses_bad_rows_naming_them(blocks):
    good = ((1, b'"1"', 0), (1, 1, 1))
    assert blocks.query_answer([good], 16, None) == (
        b'{"scores":{"1":{"0":16}},"frequencies":[],"instances":{"1":{"longest_matched":16,'
        b'"gpu":16,"dp":{"0":16},"cpu":16,"disk":16}}}')
    for rows, error, match in (
            ([good, (good[0],)], TypeError, r"rows\[1\] must be"),
            ([[good[0], good[1]]], TypeError, r"rows\[0\] must be"),
            ([((1.0, b'"1"', 0), (1, 1, 1))], TypeError, r"rows\[0\]: instance"),
            ([((True, b'"1"', 0), (1, 1, 1))], TypeError, r"rows\[0\]: instance"),
            ([((1, '"1"', 0), (1, 1, 1))], TypeError, r"rows\[0\]: name"),
            ([((1, b'"1"', -1), (1, 1, 1))], ValueError, r"rows\[0\]: rank"),
            ([((1, b'"1"', 2**31), (1, 1, 1))], ValueError, r"rows\[0\]: rank"),
            ([good, ((1, b'"1"', 0), (1, 2**40, 1))], ValueError, r"rows\[1\]: blocks"),
            ([((1, b'"1"', 0), (1, 1, 1.5))], TypeError, r"rows\[0\]: blocks"),
            ([((1, b'"1"', 0), 1.0)], TypeError, r"rows\[0\] must be"),
            ([((1, b'"1"', 0), (1, 1))], TypeError, r"rows\[0\] must be"),
            ([((1, b'"1"', 0), -1)], ValueError, r"rows\[0\]: blocks"),
            # beyond int64 either way: refused as out of range, not read modulo 2**64
            ([((1, b'"1"', 2**64), 1)], ValueError, r"rows\[0\]: rank"),
            ([((1, b'"1"', -2**70), 1)], ValueError, r"rows\[0\]: rank"),
            ([((1, b'"1"', 0), 2**64 + 1)], ValueError, r"rows\[0\]: blocks"),
            ([((1, b'"1"', 0), (1, -2**64, 1))], ValueError, r"rows\[0\]: blocks")):
        with pytest.raises(error, match=match):
            blocks.query_answer(rows, 16, None)
    with pytest.raises(TypeError, match="rows must be a list"):
        blocks.query_answer((good,), 16, None)
    with pytest.raises(ValueError, match="block_size"):
        blocks.query_answer([good], 0, None)
    with pytest.raises(TypeError, match="tenant"):
        blocks.query_answer([good], 16, '"t"')

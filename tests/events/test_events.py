"""KV-cache events: exact event content and stable block hashes, on every core.

The expected hashes come from ``ref_hash`` (``event_reference.py``), written from the
definition in the ``radixcache.events`` docstring (struct + hashlib), not from the module's own
functions. The wire format and the ZeroMQ transport are tested in ``test_wire.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixcache.events as ev
import radixcache.events.hashing as ev_hashing
from radixcache import RadixCache
from radixcache._core import BLOCKS, CORES
from event_reference import (
    CORE_NAMES, REPO_ROOT, msgspec, ref_chain, ref_hash, replay_into, stored, tree_pages,
)



# -- hashing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra_key", [None, "", "tenant", "ü", b"", b"tenant", 0, 7, -12,
                                       2**70])
@pytest.mark.parametrize("parent", [None, 0, -1, 2**63 - 1, -(2**63)])
def test_block_hash_matches_its_definition(extra_key, parent):
    tokens = [0, 1, -5, 2**63 - 1, -(2**63), 32000]
    assert ev.block_hash(parent, tokens, extra_key) == ref_hash(parent, tokens, extra_key)
    assert ev.block_hash(parent, np.array(tokens, dtype=np.int64), extra_key) == \
        ref_hash(parent, tokens, extra_key)


def test_namespaces_are_distinct_and_equal_keys_share_one():
    tokens = [1, 2, 3, 4]
    keys = [None, "1", b"1", 1, "", b""]
    hashes = [ev.block_hash(None, tokens, k) for k in keys]
    assert len(set(hashes)) == len(keys)
    # Keys the tree treats as one namespace (equal and equal-hashing) hash alike.
    assert ev.block_hash(None, tokens, True) == ev.block_hash(None, tokens, 1)
    assert ev.block_hash(None, tokens, np.int64(1)) == ev.block_hash(None, tokens, 1)


def test_block_hashes_chains_full_pages_only():
    tokens = list(range(10))
    assert ev.block_hashes(tokens, 4, "ns") == ref_chain(None, tokens, "ns", 4)
    assert len(ev.block_hashes(tokens, 4)) == 2
    parent = ref_hash(None, [9, 9], None)
    assert ev.block_hashes(tokens, 3, None, parent) == ref_chain(parent, tokens, None, 3)
    assert ev.block_hashes([], 2) == []


@pytest.mark.parametrize("bad, name", [(1.5, "float"), ((1, 2), "tuple"),
                                       (frozenset(), "frozenset")])
def test_unhashable_namespace_type_raises_type_error_naming_it(bad, name):
    with pytest.raises(TypeError, match=name):
        ev.block_hash(None, [1], bad)
    with pytest.raises(TypeError, match=name):
        ev.EventRecorder.check_extra_key(bad)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError):
        ev.block_hash("x", [1])
    with pytest.raises(OverflowError):
        ev.block_hash(2**63, [1])
    with pytest.raises(TypeError):
        ev.block_hash(None, [1.5])
    with pytest.raises(ValueError):
        ev.block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        ev.EventRecorder(0)
    with pytest.raises(TypeError):
        ev.EventRecorder(True)


# -- event content ---------------------------------------------------------------------------

A = [1, 2, 3, 4, 5, 6]
B = [1, 2, 3, 4, 7, 8, 9]  # diverges from A after two pages; the 9 is a partial page


def run_script(core: str) -> list:
    """A scripted session; returns the events taken after each step."""
    cache = RadixCache(page_size=2, enable_events=True, core=core)
    steps = []
    cache.insert(A)
    steps.append(cache.take_events())
    cache.insert(B)  # splits A's node after [1, 2, 3, 4]
    steps.append(cache.take_events())
    assert cache.stats().splits == 1
    assert cache.match_prefix([1, 2, 9]).length == 2  # splits [1, 2, 3, 4] again
    assert cache.stats().splits == 2
    steps.append(cache.take_events())
    cache.insert(A, extra_key="tenant")
    cache.insert(A + [10, 11], extra_key="tenant")
    steps.append(cache.take_events())
    locked = cache.match_prefix(A + [10, 11], extra_key="tenant").last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(2) == 2  # LRU: [5, 6] is the oldest leaf
    steps.append(cache.take_events())
    assert cache.evict(100) == 6  # [7, 8], then [3, 4], then [1, 2]; the tenant's are locked
    steps.append(cache.take_events())
    cache.dec_lock_ref(locked)
    cache.insert(A)
    steps.append(cache.take_events())
    assert cache._events.tracked_nodes == cache.node_count() == 3  # evicted ones dropped
    cache.reset()
    assert cache._events.tracked_nodes == 0
    cache.insert(B)
    steps.append(cache.take_events())
    steps.append(cache.take_events())  # taking empties the queue
    return steps


def expected_script() -> list:
    h12, h34, h56 = ref_chain(None, A, None, 2)
    t = ref_chain(None, A, "tenant", 2)
    h78 = ref_hash(h34, [7, 8])
    return [
        [stored(None, A, None, 2)],
        [stored(h34, [7, 8], None, 2)],
        [],  # a split emits nothing
        [stored(None, A, "tenant", 2), stored(t[-1], [10, 11], "tenant", 2)],
        [ev.BlockRemoved((h56,), "GPU")],
        [ev.BlockRemoved((h78,), "GPU"), ev.BlockRemoved((h34,), "GPU"),
         ev.BlockRemoved((h12,), "GPU")],
        [stored(None, A, None, 2)],
        [ev.AllBlocksCleared(), stored(None, [1, 2, 3, 4, 7, 8], None, 2)],
        [],
    ]


@pytest.mark.parametrize("core", CORE_NAMES)
def test_scripted_session_gives_exact_events(core):
    steps = run_script(core)
    assert steps == expected_script()
    # Same tokens after the same prefix: the same hashes, before and after a reset.
    first, again, after_reset = steps[0][0], steps[6][0], steps[7][1]
    assert again.block_hashes == first.block_hashes
    assert after_reset.block_hashes[:2] == first.block_hashes[:2]
    assert after_reset.block_hashes[2] == steps[1][0].block_hashes[0]


@pytest.mark.skipif(len(CORES) < 2, reason="only one tree core is available")
def test_both_cores_emit_identical_events():
    results = {core: run_script(core) for core in CORE_NAMES}
    first = results[CORE_NAMES[0]]
    for core in CORE_NAMES[1:]:
        assert results[core] == first, core


# Runs in this process and in fresh interpreters with different hash seeds.
PROCESS_SCRIPT = r"""
import json, sys
from radixcache import RadixCache
out = []
for core in sys.argv[1].split(","):
    cache = RadixCache(page_size=3, enable_events=True, core=core)
    for ns in (None, "tenant", b"tenant", 5, -5):
        cache.insert(list(range(20)), extra_key=ns)
        cache.insert(list(range(9)) + [99, 98, 97, 96], extra_key=ns)
    cache.evict(10**6)
    out.append([e.to_wire("positional")[:7] for e in cache.take_events()])
print(json.dumps(out))
"""


def test_hashes_equal_across_processes_and_cores():
    cores = ",".join(CORE_NAMES)
    # Another interpreter with another str/bytes hash seed than this one.
    seed = "17" if os.environ.get("PYTHONHASHSEED") == "4242" else "4242"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONHASHSEED=seed)
    proc = subprocess.run([sys.executable, "-c", PROCESS_SCRIPT, cores], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    there = json.loads(proc.stdout)
    here = []
    for core in CORE_NAMES:
        cache = RadixCache(page_size=3, enable_events=True, core=core)
        for ns in (None, "tenant", b"tenant", 5, -5):
            cache.insert(list(range(20)), extra_key=ns)
            cache.insert(list(range(9)) + [99, 98, 97, 96], extra_key=ns)
        cache.evict(10**6)
        here.append(json.loads(json.dumps([e.to_wire("positional")[:7]
                                           for e in cache.take_events()])))
    assert there == here
    stored_events = [e for e in here[0] if e[0] == "BlockStored"]
    assert len(stored_events) == 10
    # Independent check of one chain per namespace against the reference.
    for ns, event in zip((None, "tenant", b"tenant", 5, -5), stored_events[::2]):
        assert event[1] == ref_chain(None, list(range(20)), ns, 3)
    for core_events in here[1:]:
        assert core_events == here[0]


def _workload(cache: RadixCache) -> None:
    rng = random.Random(3)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        cache.insert(tokens, extra_key=rng.choice([None, "b"]))
        cache.match_prefix(tokens[:5])
        if cache.total_size() > 30:
            cache.evict(10)
    cache.reset()


@pytest.mark.parametrize("core", CORE_NAMES)
def test_events_off_records_nothing_and_never_hashes(core, monkeypatch):
    calls = []
    real = ev_hashing._hash_page

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(ev_hashing, "_hash_page", counting)
    cache = RadixCache(page_size=2, core=core)
    _workload(cache)
    assert cache.take_events() == []
    assert calls == []
    # The counter does see the hashing when events are on.
    on = RadixCache(page_size=2, enable_events=True, core=core)
    _workload(on)
    assert len(calls) > 0
    assert on.take_events()


@pytest.mark.parametrize("core", CORE_NAMES)
def test_bad_namespace_raises_and_never_corrupts_the_event_stream(core):
    cache = RadixCache(page_size=1, enable_events=True, core=core)
    cache.insert([1, 2, 3])
    with pytest.raises(TypeError, match="tuple"):
        cache.insert([4, 5], extra_key=("a", 1))
    cache.insert([1, 2, 7])
    # Whatever the tree kept of the refused insert was never announced, so it is never
    # removed either; every announced page comes and goes consistently.
    pages: set = set()
    replay_into(pages, cache.take_events(), 1)
    assert cache.evict(100) >= 4
    replay_into(pages, cache.take_events(), 1)
    assert pages == set()


@pytest.mark.parametrize("core", CORE_NAMES)
def test_split_upper_node_hash_is_computed_once_then_reused(core, monkeypatch):
    calls = []
    real = ev_hashing._hash_page

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(ev_hashing, "_hash_page", counting)
    cache = RadixCache(page_size=2, enable_events=True, core=core)
    cache.insert([1, 1, 2, 2, 3, 3, 4, 4])
    assert len(calls) == 4  # one per page of the new leaf
    cache.take_events()
    upper = ref_chain(None, [1, 1, 2, 2, 3, 3], None, 2)[-1]
    calls.clear()
    cache.insert([1, 1, 2, 2, 3, 3, 9, 9])  # splits after three pages; new leaf [9, 9]
    # The new upper node [1 1 2 2 3 3] is hashed lazily (3 pages), then the leaf (1 page).
    assert len(calls) == 4
    assert cache.take_events() == [stored(upper, [9, 9], None, 2)]
    calls.clear()
    cache.insert([1, 1, 2, 2, 3, 3, 8, 8])  # another child of the upper node: reuses its hash
    assert len(calls) == 1
    assert cache.take_events() == [stored(upper, [8, 8], None, 2)]
    calls.clear()
    assert cache.evict(100) == 12
    pages: set = set(ref_chain(None, [1, 1, 2, 2, 3, 3, 4, 4], None, 2))
    pages |= {ref_hash(upper, [9, 9]), ref_hash(upper, [8, 8])}
    replay_into(pages, cache.take_events(), 2)
    assert pages == set()
    # Removal hashes each evicted leaf's own pages; parents' hashes come from the cache.
    assert len(calls) == 1 + 1 + 1 + 3


def test_deep_tree_hashes_without_recursion():
    depth = 1500  # beyond the default recursion limit
    cache = RadixCache(page_size=1, core="python")
    for n in range(1, depth + 1):
        cache.insert(np.arange(n, dtype=np.int64))
    deepest = cache.match_prefix(np.arange(depth, dtype=np.int64)).last_node
    # A recorder that never saw these nodes computes the whole chain lazily.
    recorder = ev.EventRecorder(1)
    hashes = recorder.node_block_hashes(deepest)
    assert hashes == [ref_chain(None, list(range(depth)), None, 1)[-1]]
    assert recorder.node_block_hashes(cache.root_node) == []


# -- property: the events always describe the tree -------------------------------------------

TOKENS = st.lists(st.integers(0, 3), max_size=12)
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), TOKENS, st.integers(0, 1)),
    st.tuples(st.just("match"), TOKENS, st.integers(0, 1)),
    st.tuples(st.just("evict"), st.integers(0, 12)),
    st.tuples(st.just("lock"), st.integers(0, 20)),
    st.tuples(st.just("unlock"), st.integers(0, 20)),
    st.tuples(st.just("reset")),
), max_size=40)
NAMESPACES = (None, "tenant")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 4]), core=st.sampled_from(CORE_NAMES), ops=OPS)
def test_replayed_events_equal_pages_in_tree(page_size, core, ops):
    cache = RadixCache(page_size=page_size, enable_events=True, core=core)
    handles: list = []
    locked: list = []
    pages: set = set()
    for op in ops:
        kind = op[0]
        if kind == "insert":
            handles.append(cache.insert(op[1], extra_key=NAMESPACES[op[2]]).last_node)
        elif kind == "match":
            handles.append(cache.match_prefix(op[1], extra_key=NAMESPACES[op[2]]).last_node)
        elif kind == "evict":
            cache.evict(op[1])
        elif kind == "lock" and handles:
            node = handles[op[1] % len(handles)]
            if not node.evicted:
                cache.inc_lock_ref(node)
                locked.append(node)
        elif kind == "unlock" and locked:
            cache.dec_lock_ref(locked.pop(op[1] % len(locked)))
        elif kind == "reset":
            cache.reset()
            handles.clear()
            locked.clear()
        replay_into(pages, cache.take_events(), page_size)
        assert pages == tree_pages(cache)
    cache.evict(10**6)
    if not locked:  # every node left; the recorder keeps nothing for evicted nodes
        assert cache.node_count() == 0
        assert cache._events.tracked_nodes == 0


def _reference_page_chain(seed: int, data: bytes, page_bytes: int) -> list:
    """The page hash chain as the core's docstring states it, in numpy uint64 arithmetic."""
    tokens = np.frombuffer(data, dtype="<u8")
    h = np.uint64(seed % 2**64)
    out = []
    with np.errstate(over="ignore"):
        for start in range(0, len(tokens) - page_bytes // 8 + 1, page_bytes // 8):
            for t in tokens[start:start + page_bytes // 8]:
                h = (h ^ t) * np.uint64(0x9E3779B97F4A7C15)
                h ^= h >> np.uint64(32)
            for mul in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
                h ^= h >> np.uint64(33)
                h = h * np.uint64(mul)
            h ^= h >> np.uint64(33)
            out.append(int(h.astype(np.int64)))
    return out


def test_page_hash_chain_is_the_documented_function_in_every_block_module():
    rng = np.random.default_rng(5)
    cases = [(0, b"", 8), (-1, bytes(8), 8), (2**70 + 3, b"\x01" * 24, 16),
             (5, bytes(16), 2**70)]  # a page longer than any data: no pages
    for n, page in ((17, 8), (64, 32), (100, 128)):
        data = rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64).astype("<i8").tobytes()
        cases.append((int(rng.integers(-2**63, 2**63 - 1)), data, page))
    for seed, data, page in cases:
        expected = _reference_page_chain(seed, data, page)
        for name, module in BLOCKS.items():
            assert module.page_hash_chain(seed, data, page) == expected, name
    for module in BLOCKS.values():
        with pytest.raises(TypeError, match="data must be bytes"):
            module.page_hash_chain(0, bytearray(8), 8)
        with pytest.raises(TypeError, match="seed must be an int"):
            module.page_hash_chain(1.0, b"", 8)
        with pytest.raises(ValueError, match="page_bytes must be a positive multiple of 8"):
            module.page_hash_chain(0, b"", 12)
        with pytest.raises(ValueError, match="page_bytes"):
            module.page_hash_chain(0, b"", 0)

        class Huge(int):  # would make the compiled loop read past the data
            def __floordiv__(self, other):
                return 10**9

        with pytest.raises(TypeError, match="page_bytes must be an int, got Huge"):
            module.page_hash_chain(0, bytes(16), Huge(8))
        with pytest.raises(TypeError, match="seed must be an int, got bool"):
            module.page_hash_chain(True, bytes(16), 8)


def test_fast64_recorder_hashes_and_token_ids(core_name):
    cache = RadixCache(page_size=2, enable_events=True, core=core_name,
                       event_options={"block_hash": "fast64"})
    sha = RadixCache(page_size=2, enable_events=True, core=core_name)
    for c in (cache, sha):
        c.insert([1, 2, 3, 4, 5], extra_key="t")
        c.insert([1, 2, 3, 4, 9, 9], extra_key="t")
        c.evict(100)
    fast_events, sha_events = cache.take_events(), sha.take_events()
    root = int.from_bytes(hashlib.sha256(b"radixcache-fast64"
                                         + ev.encode_namespace("t")).digest()[:8], "big",
                          signed=True)
    data = np.array([1, 2, 3, 4], dtype="<i8").tobytes()
    first = fast_events[0]
    assert list(first.block_hashes) == _reference_page_chain(root, data, 16)
    assert isinstance(first.token_ids, ev.TokenIds)
    assert first.token_ids == (1, 2, 3, 4) and (1, 2, 3, 4) == first.token_ids
    assert first.token_ids == [1, 2, 3, 4] and hash(first.token_ids) == hash((1, 2, 3, 4))
    assert list(first.token_ids) == [1, 2, 3, 4] and first.token_ids[1:3] == (2, 3)
    assert len(first.token_ids) == 4 and repr(first.token_ids) == "(1, 2, 3, 4)"
    assert fast_events[1].parent_block_hash == first.block_hashes[-1]
    # The same events, but for the hashes: shape, order, token ids, namespaces.
    assert [type(e) for e in fast_events] == [type(e) for e in sha_events]
    for f, s in zip(fast_events, sha_events):
        assert dataclasses.replace(f, block_hashes=s.block_hashes, **(
            {"parent_block_hash": s.parent_block_hash} if isinstance(f, ev.BlockStored)
            else {})) == s
    removed = {e.block_hashes for e in fast_events if isinstance(e, ev.BlockRemoved)}
    stored = {h for e in fast_events if isinstance(e, ev.BlockStored) for h in e.block_hashes}
    assert {h for hashes in removed for h in hashes} == stored
    with pytest.raises(ValueError, match="unknown block_hash 'md5'; valid: sha256, fast64"):
        RadixCache(page_size=2, enable_events=True, event_options={"block_hash": "md5"})
    if msgspec is not None:
        assert ev.decode_batch(ev.encode_batch(fast_events)).events == fast_events


# -- pickles ----------------------------------------------------------------------------------
def test_events_pickled_by_0_1_0_still_load():
    # Pickled when radixcache.events was one module: the names must still resolve.
    import pickle

    data = Path(__file__).resolve().parents[1] / "data"
    objs = pickle.loads((data / "radixcache-0.1.0.pickle").read_bytes())
    stored, removed, cleared = objs["stored"], objs["removed"], objs["cleared"]
    assert (type(stored), type(removed), type(cleared)) == (
        ev.BlockStored, ev.BlockRemoved, ev.AllBlocksCleared)
    assert stored == ev.BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU")
    assert removed == ev.BlockRemoved([2], "GPU") and cleared == ev.AllBlocksCleared()
    assert ev.decode_batch(ev.encode_batch([stored, removed, cleared])).events == [
        ev.BlockStored((1, 2), None, (1, 2, 3, 4), 2, None, "GPU"),
        ev.BlockRemoved((2,), "GPU"), ev.AllBlocksCleared()]


def test_pickles_name_the_public_module():
    # Pickles made now load in every version (0.1.0 included), however the modules are laid
    # out inside the packages; the classes' annotations still resolve.
    import pickle
    import typing

    from radixcache.router import IndexerStats

    objs = [ev.BlockStored((5, 6), 4, (1, 2, 3, 4), 2, 3, "CPU", "lora", (("ns",), ("ns",)), 1),
            ev.BlockRemoved((5,), "GPU", 2), ev.AllBlocksCleared(),
            ev.ReceivedBatch(3, 1.5, [ev.AllBlocksCleared()], 0, b"x", True),
            ev.TokenIds(struct.pack("<3q", 1, -2, 3)), IndexerStats(batches=2, cleared=1)]
    for obj in objs:
        public = "radixcache.router" if type(obj) is IndexerStats else "radixcache.events"
        assert type(obj).__module__ == public
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            data = pickle.dumps(obj, protocol)
            assert public.encode() in data and public.encode() + b"." not in data
            loaded = pickle.loads(data)
            assert type(loaded) is type(obj) and loaded == obj
            if type(obj) is ev.ReceivedBatch:
                assert (loaded.payload, loaded.restarted) == (b"x", True)
        if dataclasses.is_dataclass(obj):
            hints = typing.get_type_hints(type(obj))
            assert set(hints) == {f.name for f in dataclasses.fields(obj)}

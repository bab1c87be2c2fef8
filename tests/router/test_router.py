"""radixcache.router: the KV indexer against a model, malformed events, every routing policy."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from radixcache import RadixCache
from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hashes,
    decode_batch,
)
from radixcache.router import ROUTING_POLICIES, KvIndexer, Router

try:
    import msgspec
except ImportError:  # only the wire tests need it
    msgspec = None

needs_msgspec = pytest.mark.skipif(msgspec is None, reason="msgspec not installed")


# -- a model of what each worker holds, without any hashing ---------------------------------
class IndexModel:
    """Per worker: publisher hash -> the full token prefix up to and including that block."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.prefixes = {}  # worker -> {publisher hash: (namespace, tokens tuple)}

    def apply(self, worker, events):
        held = self.prefixes.setdefault(worker, {})
        for event in events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.pop(h, None)
            elif isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    continue
                if len(event.token_ids) != len(event.block_hashes) * self.block_size:
                    continue
                if event.parent_block_hash is None:
                    namespace, prefix = namespace_of(event), ()
                elif event.parent_block_hash in held:
                    namespace, prefix = held[event.parent_block_hash]
                else:
                    continue  # unknown parent: skipped
                for i, h in enumerate(event.block_hashes):
                    prefix = prefix + tuple(event.token_ids[i * self.block_size:
                                                            (i + 1) * self.block_size])
                    held[h] = (namespace, prefix)

    def overlap(self, tokens, extra_key=None):
        tokens = tuple(int(t) for t in tokens)
        counts = {}
        for worker, held in self.prefixes.items():
            values = set(held.values())
            n = 0
            while (n + 1) * self.block_size <= len(tokens) and \
                    (extra_key, tokens[:(n + 1) * self.block_size]) in values:
                n += 1
            if n:
                counts[worker] = n
        return counts


def namespace_of(event):
    keys = getattr(event, "extra_keys", None)
    return keys[0][0] if keys and keys[0] else None


@dataclass(frozen=True)
class NamespacedStored(BlockStored):
    """A BlockStored carrying vLLM's per-block ``extra_keys`` (the namespace)."""

    extra_keys: tuple = ()


def wire_payload(events, encoding="map", ts=1.0):
    from radixcache.events import encode_batch

    return encode_batch(events, encoding=encoding, ts=ts)


# -- indexer: events recorded from real caches, against the model ---------------------------
def random_cache_steps(make_cache, rng, page_size, num_workers, steps, reset_every=0,
                       namespaces=(None, None, "a", 3), block_hash="sha256"):
    """Per step: (worker, events) from caches doing random inserts, evictions and resets."""
    options = {} if block_hash == "sha256" else {"event_options": {"block_hash": block_hash}}
    caches = [make_cache(page_size=page_size, enable_events=True, **options)
              for _ in range(num_workers)]
    pages = [[rng.randrange(4) for _ in range(page_size)] for _ in range(6)]
    sequences = []
    out = []
    for step in range(steps):
        worker = rng.randrange(num_workers)
        cache = caches[worker]
        roll = rng.random()
        if reset_every and step % reset_every == reset_every - 1:
            cache.reset()
        elif roll < 0.6:
            seq = [t for _ in range(rng.randrange(1, 6)) for t in rng.choice(pages)]
            seq += [rng.randrange(4) for _ in range(rng.randrange(page_size))]  # unaligned tail
            namespace = rng.choice(namespaces)
            cache.insert(seq, extra_key=namespace)
            sequences.append((seq, namespace))
        else:
            cache.evict(rng.randrange(1, 4 * page_size))
        out.append((worker, cache.take_events()))
    return caches, sequences, out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("lag, drop", [(0, 0.0), (3, 0.0), (2, 0.15)])
@pytest.mark.parametrize("block_hash", ["sha256", "fast64"])
def test_indexer_matches_model_under_random_streams(make_cache, page_size, lag, drop,
                                                    block_hash):
    rng = random.Random(page_size * 100 + lag)
    caches, sequences, steps = random_cache_steps(make_cache, rng, page_size, 3, 300,
                                                  reset_every=97, block_hash=block_hash)
    indexer, model = KvIndexer(page_size), IndexModel(page_size)
    delivered = 0
    for now in range(len(steps)):
        # Lagged delivery: the index sees each worker's batches in order, ``lag`` steps late.
        while delivered <= now - lag:
            worker, events = steps[delivered]
            delivered += 1
            if drop and rng.random() < drop:
                continue  # lost on the way: later events may name unknown blocks
            indexer.apply(worker, events)
            model.apply(worker, events)
        for query, namespace in rng.sample(sequences, min(3, len(sequences))):
            query = query + [rng.randrange(4)]
            assert indexer.overlap(query, namespace) == model.overlap(query, namespace)
    stats = indexer.stats
    assert stats.cleared >= 1 and stats.removed_blocks > 0 and stats.stored_blocks > 0
    if drop:
        assert stats.unknown_parent + stats.unknown_removals > 0  # counted, never raised
    else:
        assert stats.skipped == 0
    # Memory follows the blocks held: after every worker clears, nothing is left.
    for worker in range(3):
        indexer.apply(worker, [AllBlocksCleared()])
    assert len(indexer) == 0 and all(indexer.blocks_held(w) == 0 for w in range(3))


@needs_msgspec
@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_indexer_overlap_equals_workers_match_prefix_through_the_wire(make_cache, encoding):
    """Events recorded from radixcache workers, sent in the wire layout (vLLM's tagged maps,
    or the older positional arrays) and decoded with decode_batch, give overlaps equal to
    each worker's own match_prefix length."""
    rng = random.Random(7)
    page_size = 4
    namespaces = (None, None, "a", 3)  # both layouts carry namespaces
    caches, sequences, steps = random_cache_steps(make_cache, rng, page_size, 3, 200,
                                                  namespaces=namespaces)
    indexer = KvIndexer(page_size)
    for seq, (worker, events) in enumerate(steps):
        if events and seq % 2:
            assert indexer.apply_payload(worker, wire_payload(events, encoding), seq)
        elif events:  # as a subscriber hands it over
            indexer.apply(worker, decode_batch(wire_payload(events, encoding), seq))
    assert indexer.stats.skipped == 0
    checked = 0
    for query, namespace in sequences + [([1, 2, 3, 0] * 5, None)]:
        overlap = indexer.overlap(query, namespace)
        for worker, cache in enumerate(caches):
            expected = cache.match_prefix(query, namespace).length // page_size
            assert overlap.get(worker, 0) == expected
            checked += expected > 0
    assert checked > 10
    # Blocks held agree with the trees, page for page.
    for worker, cache in enumerate(caches):
        assert indexer.blocks_held(worker) == cache.total_size() // page_size


def test_indexer_namespaces_from_extra_keys():
    tokens = (1, 2, 3, 4)
    indexer = KvIndexer(2)
    hashes_a = block_hashes(tokens, 2, "a")
    indexer.apply(0, [NamespacedStored(tuple(hashes_a), None, tokens, 2,
                                       extra_keys=(("a",), ("a",)))])
    indexer.apply(1, [BlockStored(tuple(block_hashes(tokens, 2)), None, tokens, 2)])
    assert indexer.overlap(tokens, "a") == {0: 2}
    assert indexer.overlap(tokens) == {1: 2}
    assert indexer.overlap(tokens, "b") == {}
    indexer.apply(0, [BlockRemoved((hashes_a[1],))])
    assert indexer.overlap(tokens, "a") == {0: 1}


def test_indexer_keys_its_own_hashes_not_the_publishers():
    # Two publishers with unrelated hash schemes (one sends bytes, as vLLM may) index the
    # same content under one key.
    tokens = tuple(range(8))
    indexer = KvIndexer(4)
    indexer.apply("w1", [BlockStored((11, 12), None, tokens, 4)])
    indexer.apply("w2", [BlockStored((b"\x05",), None, tokens[:4], 4),
                         BlockStored((99,), b"\x05", tokens[4:], 4)])
    assert len(indexer) == 2
    assert indexer.overlap(list(tokens) + [9]) == {"w1": 2, "w2": 2}
    indexer.apply("w1", [BlockRemoved((12,))])
    assert indexer.overlap(tokens) == {"w1": 1, "w2": 2}
    indexer.apply("w2", [BlockRemoved((99, b"\x05"))])
    assert indexer.overlap(tokens) == {"w1": 1}
    assert len(indexer) == 1  # the last holder's removal freed the entry
    indexer.remove_worker("w1")
    assert len(indexer) == 0 and indexer.workers == []  # w2 holds nothing: forgotten too


def test_indexer_overlap_keys_reads_any_part_of_a_chain_on_any_tiers():
    # A device prefix, its continuation on the host, and a worker holding all on the device:
    # the run from any point of the chain, on a tier or on several.
    tokens = tuple(range(12))
    indexer = KvIndexer(4)
    indexer.apply("a", [BlockStored((1,), None, tokens[:4], 4),
                        BlockStored((2, 3), 1, tokens[4:], 4, medium="CPU")])
    indexer.apply("b", [BlockStored((7, 8, 9), None, tokens, 4)])
    keys = indexer.block_keys(tokens)
    assert indexer.overlap_keys(keys) == indexer.overlap(tokens) == {"a": 1, "b": 3}
    assert indexer.overlap_keys(keys[1:]) == {"b": 2}
    assert indexer.overlap_keys(keys[1:], "CPU") == {"a": 2}
    assert indexer.overlap_keys(keys[1:], "CPU_PINNED") == {"a": 2}  # SGLang's host tier
    assert indexer.overlap_keys(keys, ("GPU", "CPU")) == {"a": 3, "b": 3}
    assert indexer.overlap_keys([]) == {}
    with pytest.raises(TypeError, match="medium"):
        indexer.overlap_keys(keys, ("GPU", 1))
    with pytest.raises(TypeError):
        indexer.overlap_keys(["x"])
    with pytest.raises(OverflowError):
        indexer.overlap_keys([1 << 64])


def test_indexer_counts_bad_and_out_of_order_events_and_never_raises():
    indexer = KvIndexer(2)
    good = BlockStored((1,), None, (5, 6), 2)
    indexer.apply(0, [
        BlockStored((2,), 777, (7, 8), 2),        # parent never stored
        BlockRemoved((555,)),                      # unknown block
        BlockStored((3,), None, (1, 2, 3), 2),     # tokens do not fill the blocks
        BlockStored((4,), None, (1, 2, 3, 4), 4),  # another block size
        BlockStored((5,), None, ("x", "y"), 2),    # not token ids
        BlockStored(None, None, (1, 2), 2),        # no hashes
        BlockRemoved(None),
        "not an event",
        good,
        good,                                      # stored twice: no double count
    ])
    stats = indexer.stats
    assert stats.unknown_parent == 1
    assert stats.unknown_removals == 1
    assert stats.wrong_block_size == 1
    assert stats.malformed_events == 5
    assert stats.duplicate_blocks == 1 and stats.stored_blocks == 1
    assert stats.events == 10 and stats.skipped == 8
    assert indexer.overlap([5, 6]) == {0: 1}
    indexer.apply(0, 12345)  # not even iterable
    assert indexer.stats.malformed_batches == 1
    assert indexer.stats.as_dict()["unknown_parent"] == 1


def test_indexer_counts_events_with_fields_of_odd_types_and_applies_the_rest():
    # Hand-built events whose fields are not what the wire gives: counted, never raised,
    # and the events after them in the batch still apply.
    indexer = KvIndexer(2)
    indexer.apply(0, [
        BlockStored((1,), None, (5, 6), np.array([2, 2])),           # block size an array
        BlockStored((2,), None, (5, 6), 2, extra_keys=np.int64(3)),  # extra_keys a scalar
        BlockStored((3,), None, (5, 6), 2, extra_keys=np.array(4)),
        BlockStored((4,), None, (5, 6), 2),
    ])
    stats = indexer.stats
    assert stats.malformed_events == 3 and stats.wrong_block_size == 0
    assert stats.stored_blocks == 1 and stats.events == 4
    assert indexer.overlap([5, 6]) == {0: 1}


@needs_msgspec
def test_indexer_counts_undecodable_payloads():
    indexer = KvIndexer(2)
    indexer.apply(0, [BlockStored((1,), None, (5, 6), 2)])
    # Wire payloads that do not decode are counted, the index is untouched.
    for payload in (b"\xc1garbage", msgspec.msgpack.encode([1.0, [["Nope", 1]], 0]),
                    msgspec.msgpack.encode({"a": 1})):
        assert indexer.apply_payload(0, payload) is False
    assert indexer.stats.malformed_batches == 3
    assert indexer.overlap([5, 6]) == {0: 1}


def test_indexer_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        KvIndexer(0)
    with pytest.raises(TypeError, match="block_size"):
        KvIndexer(2.0)
    indexer = KvIndexer(2)
    with pytest.raises(TypeError, match="worker must be a hashable"):
        indexer.apply([1], [])
    with pytest.raises(TypeError, match="1-D"):
        indexer.overlap([[1, 2]])
    with pytest.raises(TypeError, match="integers"):
        indexer.overlap([1.5, 2.5])
    with pytest.raises(TypeError, match="extra_key"):
        indexer.overlap([1, 2], extra_key=1.5)
    assert indexer.overlap([]) == {} and indexer.overlap(np.array([1])) == {}


# -- router policies ---------------------------------------------------------------------
def test_round_robin_and_random():
    rr = Router(3, "round-robin")
    assert [rr.route([1]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    picks = [Router(4, "random", seed=5).route([1]) for _ in range(3)]
    assert len(set(picks)) == 1  # the same seed, the same first pick
    a, b = Router(4, "random", seed=1), Router(4, "random", seed=2)
    seq_a, seq_b = [a.route([]) for _ in range(50)], [b.route([]) for _ in range(50)]
    assert seq_a != seq_b and set(seq_a) == set(range(4))
    again = Router(4, "random", seed=1)
    assert [again.route([]) for _ in range(50)] == seq_a
    assert a.routed == tuple(seq_a.count(w) for w in range(4))


def test_least_loaded_follows_reported_load():
    router = Router(3, "least-loaded")
    assert router.route([1]) == 0
    router.add_load(0, 100)
    assert router.route([1]) == 1  # loads 100, 0, 0
    router.add_load(1, 50)
    assert router.route([1]) == 2
    router.add_load(2, 70)
    assert router.route([1]) == 1  # 100, 50, 70
    router.remove_load(0, 100)
    assert router.route([1]) == 0 and router.loads == (0, 50, 70)
    router.set_load(0, 80)
    assert router.route([1]) == 1


def test_prefix_hash_is_sticky_consistent_and_spreads():
    block = 4
    router, other = Router(4, "prefix-hash", block_size=block), Router(4, "prefix-hash",
                                                                      block_size=block)
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000) for _ in range(block)] for _ in range(200)]
    chosen = []
    for prefix in prefixes:
        worker = router.route(prefix + [1, 2, 3])
        # Sticky: the same first block, whatever follows and whatever the load, same worker.
        router.add_load(worker, 10_000)
        assert router.route(prefix + [rng.randrange(9) for _ in range(10)]) == worker
        assert other.route(prefix) == worker  # the same in another router (process)
        chosen.append(worker)
    counts = [chosen.count(w) for w in range(4)]
    assert min(counts) > 20  # every worker gets a share
    two = Router(4, "prefix-hash", block_size=block, prefix_blocks=2)
    spread = {two.route(prefixes[0] + p) for p in prefixes[1:40]}
    assert len(spread) > 1  # with two blocks the second one matters too
    # The namespace is part of the prefix.
    assert len({router.route(prefixes[0], extra_key=k) for k in range(20)}) > 1


def test_prefix_hash_ring_is_consistent_when_a_worker_is_added():
    rng = random.Random(4)
    prompts = [[rng.randrange(10**6) for _ in range(16)] for _ in range(400)]
    four = [Router(4, "prefix-hash").route(p) for p in prompts]
    five = [Router(5, "prefix-hash").route(p) for p in prompts]
    moved = sum(a != b for a, b in zip(four, five))
    # Only keys that move to the new worker change owner (about a fifth), never between others.
    assert all(b == 4 for a, b in zip(four, five) if a != b)
    assert 0 < moved < 200


def test_cache_aware_prefers_cached_worker_until_load_outweighs_it():
    block = 4
    router = Router(3, "cache-aware", block_size=block, load_weight=1.0)
    prompt = list(range(40))
    cached = tuple(prompt[:32])
    router.indexer.apply(2, [BlockStored(tuple(range(100, 108)), None, cached, block)])
    assert router.route(prompt) == 2
    assert router.last_overlap == {2: 8}
    # Worker 2 saves 32 tokens of prefill: load up to 31 more keeps it the choice.
    router.add_load(2, 31)
    assert router.route(prompt) == 2
    router.add_load(2, 2)
    assert router.route(prompt) == 0
    # A smaller load weight lets the cache win again; a zero prefill weight is pure load.
    light = Router(3, "cache-aware", block_size=block, load_weight=0.5, indexer=router.indexer)
    light.add_load(2, 33)
    assert light.route(prompt) == 2
    blind = Router(3, "cache-aware", block_size=block, prefill_weight=0, load_weight=1,
                   indexer=router.indexer)
    blind.add_load(0, 5)
    blind.add_load(2, 1)
    assert blind.route(prompt) == 1
    # Ties (nothing cached, no load) go to the worker routed to least.
    fresh = Router(3, "cache-aware", block_size=block)
    assert [fresh.route([7] * 8) for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_workers=0), ValueError, "num_workers must be >= 1"),
    (dict(num_workers=2.5), TypeError, "num_workers must be an int"),
    (dict(num_workers=2, policy="fastest"), ValueError, "unknown routing policy 'fastest'"),
    (dict(num_workers=2, policy=None), TypeError, "policy must be a str"),
    (dict(num_workers=2, block_size=0), ValueError, "block_size must be >= 1"),
    (dict(num_workers=2, load_weight=-1), ValueError, "load_weight must be a finite"),
    (dict(num_workers=2, prefill_weight="1"), TypeError, "prefill_weight must be a number"),
    (dict(num_workers=2, prefix_blocks=0), ValueError, "prefix_blocks must be >= 1"),
    (dict(num_workers=2, seed=1.5), TypeError, "seed must be an int"),
    (dict(num_workers=2, indexer=object()), TypeError, "indexer must be a KvIndexer"),
    (dict(num_workers=2, block_size=16, indexer=KvIndexer(8)), ValueError,
     "differs from block_size 16"),
    (dict(num_workers=2, host_weight=1.5), ValueError, r"host_weight must lie in \[0, 1\]"),
    (dict(num_workers=2, host_weight=-0.1), ValueError, "host_weight must be a finite"),
    (dict(num_workers=2, host_weight="0.5"), TypeError, "host_weight must be a number"),
])
def test_router_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        Router(**kwargs)


def test_router_block_size_defaults_to_the_indexers():
    assert Router(2, indexer=KvIndexer(32)).block_size == 32
    assert Router(2).block_size == 16
    assert Router(2, block_size=8).indexer.block_size == 8


def test_router_load_errors_leave_load_unchanged():
    router = Router(2, "least-loaded")
    router.add_load(1, 10)
    for call, args, error in [(router.add_load, (2, 1), ValueError),
                              (router.add_load, (-1, 1), ValueError),
                              (router.add_load, (True, 1), TypeError),
                              (router.add_load, (0, -3), ValueError),
                              (router.add_load, (0, 1.5), TypeError),
                              (router.remove_load, (1, 11), ValueError),
                              (router.set_load, (0, -1), ValueError)]:
        with pytest.raises(error):
            call(*args)
    assert router.loads == (0, 10)


def test_every_policy_routes_into_range_and_checks_its_input():
    for policy in ROUTING_POLICIES:
        router = Router(3, policy, block_size=2)
        workers = {router.route(np.arange(i, i + 6)) for i in range(30)}
        assert workers <= {0, 1, 2} and workers
        routed = router.routed
        # Arrays too: only a 1-D int64 one is taken as it is, under every policy.
        for tokens, extra_key, error in [([1.5], None, TypeError), ([[1], [2]], None, TypeError),
                                         ([2**64], None, OverflowError),
                                         ([1, 2], 2.5, TypeError),
                                         (np.array([1.5, 2.5]), None, TypeError),
                                         (np.zeros((2, 2), dtype=np.int64), None, TypeError),
                                         (np.arange(4), 2.5, TypeError)]:
            with pytest.raises(error):
                router.route(tokens, extra_key)
        assert router.routed == routed  # a refused request changes nothing


@pytest.mark.skipif("extra_keys" not in BlockStored.__dataclass_fields__,
                    reason="this publisher sends no namespace (extra_keys) yet")
def test_indexer_namespaces_from_a_real_cache_match_match_prefix(make_cache):
    cache = make_cache(page_size=2, enable_events=True)
    tokens = list(range(8))
    for namespace in ("lora-a", 7, None):
        cache.insert(tokens[: 4 + 2 * (namespace is None)], extra_key=namespace)
    indexer = KvIndexer(2)
    indexer.apply(0, cache.take_events())
    for namespace in ("lora-a", 7, None, "other"):
        expected = cache.match_prefix(tokens, namespace).length // 2
        assert indexer.overlap(tokens, namespace).get(0, 0) == expected
    assert indexer.overlap(tokens, "lora-a") == {0: 2} and indexer.overlap(tokens) == {0: 3}


# -- memory, tiers, worker ids, prefix families -----------------------------------------------
def _traced_bytes(build):
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, kept
    finally:
        tracemalloc.stop()


def test_index_memory_is_per_block_whatever_the_worker_ids():
    """A block costs the same held by worker 0 or by worker 29,999 after 30,000 workers came
    and went; a worker that holds nothing, or only sent garbage, keeps nothing."""
    blocks = 5_000

    def stored_by(worker, churn):
        indexer = KvIndexer(1)
        for w in range(churn):  # workers that came and went
            indexer.apply(w, [BlockStored((w,), None, (w,), 1)])
            indexer.apply(w, [BlockRemoved((w,))])
        indexer.apply(worker, [BlockStored(tuple(range(blocks)), None, tuple(range(blocks)), 1)])
        return indexer

    low, indexer = _traced_bytes(lambda: stored_by(0, 0))
    high, indexer = _traced_bytes(lambda: stored_by(29_999, 30_000))
    assert indexer.workers == [29_999] and len(indexer) == blocks
    assert low / blocks < 400 and high / blocks < 400, (low / blocks, high / blocks)

    def garbage():
        indexer = KvIndexer(1)
        for w in range(20_000):
            indexer.apply_payload(w, b"\xc1")
            indexer.apply(w, [])
        return indexer

    cost, indexer = _traced_bytes(garbage)
    assert indexer.workers == [] and indexer.stats.malformed_batches == 20_000
    assert cost < 50_000, cost


def test_one_block_per_worker_costs_per_block():
    def build():
        indexer = KvIndexer(1)
        for w in range(20_000):
            indexer.apply(w, [BlockStored((1,), None, (w,), 1)])
        return indexer

    cost, indexer = _traced_bytes(build)
    assert len(indexer.workers) == 20_000
    assert cost / 20_000 < 1_000, cost / 20_000  # a copy (a worker's entry) + the block


def test_tiers_and_groups_are_separate_copies():
    tokens = tuple(range(8))
    indexer = KvIndexer(2)
    hashes = (1, 2, 3, 4)
    indexer.apply(0, [BlockStored(hashes, None, tokens, 2, medium="GPU"),
                      BlockStored(hashes, None, tokens, 2, medium="CPU"),
                      BlockStored(hashes, None, tokens, 2, medium=None, group_idx=1)])
    indexer.apply(1, [BlockStored(hashes[:2], None, tokens[:4], 2, medium="CPU")])
    assert indexer.overlap(tokens) == {0: 4}
    assert indexer.overlap(tokens, medium="CPU") == {0: 4, 1: 2}
    indexer.apply(0, [BlockRemoved(hashes, medium="CPU")])
    assert indexer.overlap(tokens) == {0: 4}
    assert indexer.overlap(tokens, medium="CPU") == {1: 2}
    indexer.apply(0, [BlockRemoved(hashes, medium="GPU")])  # group None; group 1 remains
    assert indexer.overlap(tokens) == {0: 4}
    indexer.apply(0, [BlockRemoved(hashes[2:], group_idx=1)])
    assert indexer.overlap(tokens) == {0: 2}
    assert indexer.blocks_held(0) == 2 and indexer.blocks_held(0, "CPU") == 0
    indexer.apply(0, [AllBlocksCleared()])
    assert indexer.workers == [1] and indexer.overlap(tokens, medium="CPU") == {1: 2}
    with pytest.raises(TypeError, match="medium"):
        indexer.overlap(tokens, medium=1)


def test_a_host_copy_below_a_parent_held_only_on_the_device_is_indexed():
    # A leaf's host copy is made while its parent is still only on the device: its
    # BlockStored(medium="CPU") names a parent that only the GPU tier holds.
    tokens = tuple(range(6))
    indexer = KvIndexer(2)
    indexer.apply(0, [BlockStored((1, 2, 3), None, tokens, 2, medium="GPU"),
                      BlockStored((3,), 2, tokens[4:], 2, medium="CPU"),
                      BlockRemoved((3,), medium="GPU")])
    assert indexer.stats.unknown_parent == 0
    assert indexer.blocks_held(0, "CPU") == 1 and indexer.blocks_held(0, "GPU") == 2
    assert indexer.overlap(tokens) == {0: 2}  # blocks
    # Another group's copy does not resolve it, nor another worker's.
    indexer.apply(0, [BlockStored((9,), 2, tokens[4:], 2, medium="CPU", group_idx=1)])
    indexer.apply(1, [BlockStored((9,), 2, tokens[4:], 2, medium="CPU")])
    assert indexer.stats.unknown_parent == 2


def test_two_publisher_hashes_for_one_block_keep_it_until_both_are_removed():
    tokens = (5, 6, 7, 8)
    indexer = KvIndexer(2)
    indexer.apply(0, [BlockStored((1, 2), None, tokens, 2),
                      BlockStored((3,), 1, tokens[2:], 2)])  # the second block again, as 3
    assert indexer.blocks_held(0) == 3
    indexer.apply(0, [BlockRemoved((2,))])
    assert indexer.overlap(tokens) == {0: 2} and indexer.blocks_held(0) == 2
    indexer.apply(0, [BlockRemoved((3,))])
    assert indexer.overlap(tokens) == {0: 1}


def test_a_restarted_batch_drops_what_the_worker_held():
    from radixcache.events import ReceivedBatch

    indexer = KvIndexer(2)
    indexer.apply(0, [BlockStored((1,), None, (5, 6), 2)])
    indexer.apply(0, ReceivedBatch(0, 0.0, [BlockStored((1,), None, (7, 8), 2)], 0,
                                   restarted=True))
    assert indexer.overlap([5, 6]) == {} and indexer.overlap([7, 8]) == {0: 1}
    assert indexer.stats.restarts == 1


def test_router_refuses_blocks_under_ids_it_does_not_route_to():
    router = Router(2, "cache-aware", block_size=2)
    router.indexer.apply("worker-1", [BlockStored((1,), None, (5, 6), 2)])
    with pytest.raises(ValueError, match="worker 'worker-1'.*workers 0 .. 1"):
        router.route([5, 6])
    ok = Router(2, "cache-aware", block_size=2)
    ok.indexer.apply(np.int64(1), [BlockStored((1,), None, (5, 6), 2)])
    assert ok.route([5, 6]) == 1
    out = Router(2, "cache-aware", block_size=2)
    out.indexer.apply(2, [BlockStored((1,), None, (5, 6), 2)])
    with pytest.raises(ValueError, match="worker 2"):
        out.route([5, 6])


def test_prefix_hash_auto_spreads_a_trace_that_shares_its_first_block():
    """Every request starts with one system block; conversations differ in the next one and
    return several times: auto spreads them and keeps each conversation on one worker,
    where hashing the first block sends everything to one worker."""
    rng = random.Random(18)
    system = [rng.randrange(1000) for _ in range(4)]
    conversations = [[rng.randrange(1000) for _ in range(4)] for _ in range(300)]
    order = [c for c in range(300) for _ in range(3)]
    rng.shuffle(order)
    auto = Router(4, "prefix-hash", block_size=4)
    first = Router(4, "prefix-hash", block_size=4, prefix_blocks=1)
    placed: dict = {}
    for c in order:
        prompt = system + conversations[c] + [rng.randrange(1000) for _ in range(6)]
        placed.setdefault(c, []).append(auto.route(prompt))
        first.route(prompt)
    assert sorted(first.routed)[:3] == [0, 0, 0]
    assert min(auto.routed) > len(order) / 8, auto.routed
    # Past the first MIN_PREFIX_FAMILY requests, a conversation's turns stay together.
    late = [c for c in set(order[Router.MIN_PREFIX_FAMILY * 2:])
            if order.index(c) >= Router.MIN_PREFIX_FAMILY * 2]
    assert late and all(len(set(placed[c])) == 1 for c in late)
    assert auto.prefix_blocks == "auto"
    with pytest.raises(ValueError, match="prefix_blocks must be an int >= 1 or 'auto'"):
        Router(2, "prefix-hash", prefix_blocks="deep")


def test_prefix_hash_family_table_is_bounded(monkeypatch):
    monkeypatch.setattr(Router, "MAX_PREFIX_FAMILIES", 50)
    router = Router(2, "prefix-hash", block_size=1)
    for i in range(500):
        router.route([i, i + 1])
    assert len(router._families) <= 51


def test_fast64_publishers_are_indexed_without_a_hash_map(make_cache):
    """A fast64 publisher's hashes are the indexer's own keys: the copy keeps no map, and
    overlaps, removals and clears come out as with SHA-256 hashes."""
    results = {}
    for block_hash in ("sha256", "fast64"):
        caches, sequences, steps = random_cache_steps(
            make_cache, random.Random(64), 4, 3, 300, block_hash=block_hash)
        indexer = KvIndexer(4)
        for worker, events in steps:
            indexer.apply(worker, events)
        copies = indexer._all_copies()
        assert copies and all(bool(c.published) == (block_hash == "sha256") for c in copies)
        assert indexer.stats.skipped == 0
        for worker, cache in enumerate(caches):
            assert indexer.blocks_held(worker) == cache.total_size() // 4
        results[block_hash] = [indexer.overlap(q, ns) for q, ns in sequences]
        for worker in range(3):
            indexer.apply(worker, [AllBlocksCleared()])
        assert len(indexer) == 0 and indexer.workers == []
    assert results["sha256"] == results["fast64"]


def test_fast64_and_other_hashes_for_one_block_share_it():
    """One worker publishing a block under its fast64 hash, another worker (or copy)
    under other hashes: removals take only their own holding."""
    from radixcache.events import block_hashes as sha_chain

    indexer = KvIndexer(2)
    tokens = (1, 2, 3, 4)
    fast = indexer.block_keys(tokens)  # what a fast64 publisher sends
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    indexer.apply(1, [BlockStored(tuple(sha_chain(tokens, 2)), None, tokens, 2)])
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])  # again: duplicates
    assert indexer.stats.duplicate_blocks == 2
    assert indexer.overlap(tokens) == {0: 2, 1: 2}
    indexer.apply(0, [BlockRemoved((fast[1], 999))])
    assert indexer.overlap(tokens) == {0: 1, 1: 2}
    assert indexer.stats.unknown_removals == 1
    indexer.apply(1, [AllBlocksCleared()])
    assert indexer.overlap(tokens) == {0: 1} and len(indexer) == 1
    indexer.apply(0, [BlockStored((fast[1],), fast[0], tokens[2:], 2)])
    indexer.apply(0, [AllBlocksCleared()])
    assert len(indexer) == 0 and indexer.workers == []


# -- host tiers ------------------------------------------------------------------------------
def test_cache_aware_credits_a_host_continuation_of_a_device_prefix():
    # The shape write-back leaves: a device prefix whose continuation is only on the host
    # (its host copies name a parent that only the device tier holds).
    block = 4
    prompt = list(range(32))  # 8 blocks
    indexer = KvIndexer(block)
    indexer.apply(0, [BlockStored(tuple(range(100, 108)), None, tuple(prompt), block),
                      BlockStored(tuple(range(103, 108)), 102, tuple(prompt[12:]), block,
                                  medium="CPU"),
                      BlockRemoved(tuple(range(103, 108)), medium="GPU")])
    indexer.apply(1, [BlockStored(tuple(range(200, 204)), None, tuple(prompt[:16]), block)])
    assert indexer.overlap(prompt) == {0: 3, 1: 4}
    assert indexer.blocks_held(0, "CPU") == 5
    router = Router(2, "cache-aware", indexer=indexer, host_weight=0.5)
    # worker 0: 3 + 0.5 * 5 = 5.5 blocks beat worker 1's 4 device blocks.
    assert router.route(prompt) == 0
    assert router.last_host_overlap == {0: 8, 1: 4}
    assert Router(2, "cache-aware", indexer=indexer, host_weight=0.1).route(prompt) == 1


def test_cache_aware_counts_host_blocks_at_host_weight():
    block = 4
    prompt = list(range(32))  # 8 blocks
    indexer = KvIndexer(block)
    # Worker 0 holds the first 3 blocks on the device; worker 1 holds all 8 only on the host.
    indexer.apply(0, [BlockStored(tuple(range(100, 103)), None, tuple(prompt[:12]), block)])
    indexer.apply(1, [BlockStored(tuple(range(200, 208)), None, tuple(prompt), block,
                                  medium="CPU")])
    assert indexer.overlap(prompt) == {0: 3}
    assert indexer.overlap(prompt, medium="CPU") == {1: 8}
    # Device blocks only: worker 0 (3 blocks) wins.
    assert Router(2, "cache-aware", indexer=indexer, host_weight=0.0).route(prompt) == 0
    # At the default (0.9) worker 1's 8 host blocks weigh 7.2 blocks: it wins.
    default = Router(2, "cache-aware", indexer=indexer)
    assert default.host_weight == pytest.approx(0.9)
    assert default.route(prompt) == 1
    assert default.last_overlap == {0: 3} and default.last_host_overlap == {0: 3, 1: 8}
    # The crossover: 8 * w > 3 blocks, i.e. w > 0.375.
    assert Router(2, "cache-aware", indexer=indexer, host_weight=0.37).route(prompt) == 0
    assert Router(2, "cache-aware", indexer=indexer, host_weight=0.38).route(prompt) == 1
    # A worker's host blocks count only beyond its own device overlap.
    indexer.apply(0, [BlockStored(tuple(range(100, 104)), None, tuple(prompt[:16]), block,
                                  medium="CPU")])
    router = Router(2, "cache-aware", indexer=indexer, host_weight=0.5)
    router.add_load(1, 10)  # 10 tokens of load at 0.1: one token of prefill
    # worker 0: 3 + 0.5 * (4 - 3) = 3.5 blocks; worker 1: 0.5 * 8 = 4 blocks.
    assert router.route(prompt) == 1
    router.add_load(1, 30)  # now worker 1 pays 4 tokens of load for 2 tokens saved
    assert router.route(prompt) == 0


def test_cache_aware_reads_the_host_tier_from_a_caches_events(core_name):
    block = 4
    try:
        cache = RadixCache(page_size=block, enable_events=True, core=core_name,
                           host_tier=True)
    except TypeError as exc:
        if core_name != "c":
            raise
        pytest.skip(f"the compiled core of this build has no host tier ({exc})")
    prompt = list(range(32))
    cache.insert(prompt)
    next_host = iter(range(10**6))
    cache.evict(32, backup=lambda idx: torch.tensor([next(next_host) for _ in idx]))
    assert cache.total_size() == 0 and cache.host_size() == 32  # all on the host now
    router = Router(2, "cache-aware", block_size=block)
    router.indexer.apply(1, cache.take_events())
    assert router.indexer.overlap(prompt) == {}
    assert router.indexer.overlap(prompt, medium="CPU") == {1: 8}
    router.add_load(1, 100)
    assert router.route(prompt) == 1  # 8 host blocks outweigh the load
    assert Router(2, "cache-aware", indexer=router.indexer, host_weight=0).route(prompt) == 0


# -- SGLang's own fields ----------------------------------------------------------------------
@needs_msgspec
def test_sglang_media_salts_sessions_and_adapters_as_sglang_means_them():
    """SGLang 0.5.23's own ``BlockStored``: its host tier ``"CPU_PINNED"`` is the host tier
    (``"CPU"``), ``"DISK"`` and ``"EXTERNAL"`` are tiers of their own; ``cache_salt`` and
    ``lora_name`` scope a block (its hashes depend on them), ``session_id`` does not."""
    sglang = pytest.importorskip("sglang.srt.disaggregation.kv_events",
                                 reason="SGLang is not installed (tests/install_sglang.sh)")
    encoder = msgspec.msgpack.Encoder()

    def payload(*events):
        return encoder.encode(sglang.KVEventBatch(ts=1.0, events=list(events)))

    def stored(hashes, tokens, **fields):
        return sglang.BlockStored(block_hashes=hashes, parent_block_hash=None,
                                  token_ids=tokens, block_size=2, lora_id=None, **fields)

    tokens = [1, 2, 3, 4]
    indexer = KvIndexer(2)
    for worker, medium in enumerate(("GPU", "CPU_PINNED", "DISK", "EXTERNAL")):
        assert indexer.apply_payload(worker, payload(stored([1, 2], tokens, medium=medium)))
    assert indexer.overlap(tokens) == {0: 2}
    assert indexer.overlap(tokens, medium="CPU") == {1: 2}
    assert indexer.overlap(tokens, medium="CPU_PINNED") == {1: 2}
    assert indexer.overlap(tokens, medium="DISK") == {2: 2}
    assert indexer.overlap(tokens, medium="EXTERNAL") == {3: 2}
    assert indexer.blocks_held(1, "CPU_PINNED") == indexer.blocks_held(1, "CPU") == 2
    assert indexer.apply_payload(1, payload(sglang.BlockRemoved(block_hashes=[2],
                                                                medium="CPU_PINNED")))
    assert indexer.overlap(tokens, medium="CPU") == {1: 1}

    scoped = KvIndexer(2)
    assert scoped.apply_payload(0, payload(stored([1, 2], tokens, cache_salt="a",
                                                  session_id="s1")))
    assert scoped.apply_payload(1, payload(stored([3, 4], tokens, cache_salt="b")))
    assert scoped.apply_payload(2, payload(stored([5, 6], tokens, session_id="s2")))
    assert scoped.apply_payload(3, payload(stored([7, 8], tokens, session_id="s3")))
    assert scoped.apply_payload(4, payload(stored([9, 10], tokens, lora_name="ad")))
    assert scoped.apply_payload(5, payload(stored([11, 12], tokens, lora_name="ad",
                                                  cache_salt="a")))
    assert scoped.stats.skipped == 0
    assert scoped.overlap(tokens) == {2: 2, 3: 2}  # sessions share their blocks
    assert scoped.overlap(tokens, "a") == {0: 2}
    assert scoped.overlap(tokens, "b") == {1: 2}
    assert scoped.overlap(tokens, "ad") == {4: 2}
    assert scoped.overlap(tokens, ("ad", "a")) == {5: 2}
    child = sglang.BlockStored(block_hashes=[13], parent_block_hash=2, token_ids=[5, 6],
                               block_size=2, lora_id=None, cache_salt="a")
    assert scoped.apply_payload(0, payload(child))
    assert scoped.overlap(tokens + [5, 6], "a") == {0: 3}


@needs_msgspec
@pytest.mark.parametrize("token_ids", [
    [1, 2, 3, 4], [1, 2, 3, 2**63], [1, 2, 3, 2**64 - 1], [-(2**63), 0, -1, 5], [1, 2, 3, 4.0],
    [1, 2, True, 4], [1, 2, 3], [1, 2, 3, None], "abcd", None, {"a": 1}, [[1], 2, 3, 4],
])
@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_apply_payload_reads_token_ids_as_the_decoded_events_would(blocks, monkeypatch,
                                                                 token_ids, encoding):
    """``apply_payload`` reads the token ids from their msgpack bytes: any ids, well formed
    or not, give the stats and holdings of applying the events ``decode_batch`` makes (or
    a malformed batch, when it refuses them)."""
    import msgspec

    import radixcache.router.ingest as ingest_module
    monkeypatch.setattr(ingest_module, "_msgpack_ids", blocks.msgpack_ids)
    stored = ["BlockStored", [11, 12], None, token_ids, 2, None, None]
    if encoding == "map":
        stored = dict(zip(["type", "block_hashes", "parent_block_hash", "token_ids",
                           "block_size", "lora_id", "medium"], stored))
    removed = {"type": "BlockRemoved", "block_hashes": [12]} if encoding == "map" else \
        ["BlockRemoved", [12], None]
    payload = msgspec.msgpack.encode([1.0, [stored, removed], 0])
    by_payload, by_events = KvIndexer(2), KvIndexer(2)
    accepted = by_payload.apply_payload(7, payload, 3)
    try:
        by_events.apply(7, decode_batch(payload, 3))
    except ValueError:
        by_events.stats.malformed_batches += 1
        assert not accepted
    else:
        assert accepted
    assert by_payload.stats.as_dict() | {"batches": 0} == \
        by_events.stats.as_dict() | {"batches": 0}
    assert by_payload.blocks_held(7) == by_events.blocks_held(7)
    assert by_payload.overlap([1, 2, 3, 4]) == by_events.overlap([1, 2, 3, 4])


# -- rank: the ordered list an endpoint picker answers with ---------------------------------
def _routers_in_step(policy, seed=7):
    """Two routers of ``policy`` over one indexer that holds a few prefixes."""
    block = 4
    indexer = KvIndexer(block)
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(30)]
    for worker in range(5):
        for p in rng.sample(prompts, 4):
            n = len(p) // block * block
            if n:
                first = worker * 1000 + len(p)
                hashes = tuple(range(first, first + n // block))
                indexer.apply(worker, [BlockStored(hashes, None, tuple(p[:n]), block)])
    options = {"block_size": block, "indexer": indexer, "seed": seed}
    return Router(5, policy, **options), Router(5, policy, **options), prompts, rng


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_rank_first_is_what_route_picks_with_the_same_state_changes(policy):
    routing, ranking, prompts, rng = _routers_in_step(policy)
    for step in range(120):
        prompt = rng.choice(prompts)
        worker = routing.route(prompt, extra_key=None)
        ordered = ranking.rank(prompt)
        assert ordered[0] == worker, step
        assert sorted(ordered) == list(range(5))  # every worker once
        load = rng.randrange(100)
        routing.add_load(worker, load)
        ranking.add_load(worker, load)
        assert routing.routed == ranking.routed and routing.loads == ranking.loads


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_rank_orders_only_the_eligible_workers_by_the_policy(policy):
    router, reference, prompts, rng = _routers_in_step(policy)
    for _ in range(60):
        prompt = rng.choice(prompts)
        eligible = rng.sample(range(5), rng.randrange(1, 6))
        before = router.routed
        ordered = router.rank(prompt, workers=eligible + eligible[:1])  # a duplicate
        assert sorted(ordered) == sorted(eligible)
        after = router.routed
        assert [a - b for a, b in zip(after, before)] == [int(w == ordered[0])
                                                          for w in range(5)]
        if policy == "cache-aware":
            keys = {w: (router.prefill_weight * (len(prompt) - router.last_overlap.get(w, 0)
                                                 * router.block_size)
                        + router.load_weight * router.loads[w], router.loads[w], before[w], w)
                    for w in eligible}
            assert ordered == sorted(eligible, key=keys.get)
        elif policy == "least-loaded":
            assert ordered == sorted(eligible, key=lambda w: (router.loads[w], before[w], w))
        router.add_load(ordered[0], rng.randrange(50))
    assert router.rank([1, 2, 3], workers=[]) == []


def test_rank_fallbacks_follow_the_ring_and_the_turn():
    ring = Router(6, "prefix-hash", block_size=4)
    prompt = list(range(12))
    full = ring.rank(prompt)
    # Without the first choice, the order is the rest of the same walk round the ring.
    assert ring.rank(prompt, workers=full[1:]) == full[1:]
    assert ring.rank(prompt, workers=full[2:4]) == full[2:4]
    turn = Router(4, "round-robin")
    assert turn.rank([1]) == [0, 1, 2, 3]
    assert turn.rank([1], workers=[0, 2]) == [2, 0]  # the turn is at 1: 2 comes first
    assert turn.rank([1]) == [3, 0, 1, 2]


def test_rank_with_a_lora_and_salt_namespace_finds_their_blocks():
    from radixcache.router import namespace_for

    block = 4
    router = Router(3, "cache-aware", block_size=block)
    prompt = list(range(16))
    cache = RadixCache(page_size=block, enable_events=True, array_type="numpy")
    namespace = namespace_for("adapter", "salt-1")
    assert namespace == ("adapter", "salt-1")
    assert namespace_for("adapter") == "adapter" and namespace_for(None, "s") == "s"
    assert namespace_for() is None
    with pytest.raises(TypeError, match="lora_name and cache_salt"):
        namespace_for(3)
    cache.insert(prompt, extra_key="adapter")
    router.indexer.apply(1, cache.take_events())
    assert router.rank(prompt, "adapter")[0] == 1 and router.last_overlap == {1: 4}
    assert router.rank(prompt, namespace)[0] != 1  # another namespace: nothing cached


def test_rank_checks_workers_before_changing_anything():
    router = Router(3, "round-robin")
    for workers, error in (([0, 3], ValueError), ([0, "1"], TypeError), ([-1], ValueError)):
        with pytest.raises(error):
            router.rank([1], workers=workers)
    assert router.routed == (0, 0, 0) and router.rank([1]) == [0, 1, 2]

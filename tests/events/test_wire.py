"""KV-cache events on the wire: the ZeroMQ transport (order, replay, gaps, restarts,
deadlines), both wire encodings and their decoder, and hostile payloads."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import time
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import radixcache.events as ev
from radixcache import RadixCache
from event_reference import (
    REPO_ROOT, SOCKET_WAIT_S, msgspec, needs_transport, zmq,
    ref_chain, replay_into, tree_pages,
)



# -- transport -------------------------------------------------------------------------------

if msgspec is not None:
    # The documented wire layouts, written independently of radixcache.events: tagged arrays
    # ("positional") and tagged maps ("map", the default; fields vLLM 0.33 requires have no
    # default here either, so a missing one fails the decode).
    class _WireEvent(msgspec.Struct, array_like=True, tag=True):
        pass

    class BlockStored(_WireEvent):
        block_hashes: List[int]
        parent_block_hash: Optional[int]
        token_ids: List[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]

    class BlockRemoved(_WireEvent):
        block_hashes: List[int]
        medium: Optional[str]

    class AllBlocksCleared(_WireEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True):
        ts: float
        events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: Optional[int]

    class _MapEvent(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
        pass

    class MapBlockStored(_MapEvent, tag="BlockStored"):
        block_hashes: List[int]
        parent_block_hash: Optional[int]
        token_ids: List[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
        group_idx: Optional[int] = None

    class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
        block_hashes: List[int]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
        pass

    class MapKVEventBatch(msgspec.Struct, array_like=True):
        ts: float
        events: List[Union[MapBlockStored, MapBlockRemoved, MapAllBlocksCleared]]
        data_parallel_rank: Optional[int]

    WIRE_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
    MAP_WIRE_DECODER = msgspec.msgpack.Decoder(MapKVEventBatch)

ALL_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                              "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
              "BlockRemoved": ("block_hashes", "medium", "group_idx"),
              "AllBlocksCleared": ()}
POSITIONAL_FIELDS = {"BlockStored": ALL_FIELDS["BlockStored"][:6],
                     "BlockRemoved": ALL_FIELDS["BlockRemoved"][:2],
                     "AllBlocksCleared": ()}


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def wire_fields(event: Any, fields: Optional[dict] = None) -> tuple:
    """An event (ours or a wire struct) as (type, field values...), arrays as tuples."""
    tag = type(event).__name__
    tag = tag[3:] if tag.startswith("Map") else tag
    names = (fields or POSITIONAL_FIELDS)[tag]
    return (tag, *(_plain(getattr(event, name)) for name in names))


def serve_requests(cache: RadixCache, count: int, seed: int, publish) -> None:
    """A small serving loop: match, lock, insert prompt+output, unlock, evict to capacity."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(500) for _ in range(rng.randrange(8, 40))]
                      for _ in range(5)]
    capacity = 400
    for _ in range(count):
        namespace = rng.choice([None, "tenant-b"])
        prompt = rng.choice(system_prompts) + [rng.randrange(500)
                                               for _ in range(rng.randrange(0, 24))]
        match = cache.match_prefix(prompt, extra_key=namespace)
        cache.inc_lock_ref(match.last_node)
        if cache.total_size() > capacity:
            cache.evict(cache.total_size() - capacity)
        output = [rng.randrange(500, 1000) for _ in range(rng.randrange(1, 16))]
        result = cache.insert(prompt + output, extra_key=namespace)
        cache.inc_lock_ref(result.last_node)
        cache.dec_lock_ref(match.last_node)
        cache.dec_lock_ref(result.last_node)
        publish(cache.take_events())


def connect_raw_sub(endpoint: str):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    return ctx, sub


@needs_transport
def test_serving_loop_batches_arrive_in_order_and_decode_to_the_documented_layout():
    cache = RadixCache(page_size=4, enable_events=True)
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", data_parallel_rank=3)
    ctx, sub = connect_raw_sub(pub.endpoint)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        published: dict = {}

        def publish(events):
            seq = pub.publish(events)
            if events:
                assert seq is not None
                published[seq] = events

        # Slow joiner: publish resets until the subscription is live; later ones are all seen.
        received: list = []
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not received:
            assert time.monotonic() < deadline, "subscriber never connected"
            cache.reset()
            publish(cache.take_events())
            if sub.poll(50):
                received.append(sub.recv_multipart())
        serve_requests(cache, 300, seed=11, publish=publish)
        assert pub.flush(SOCKET_WAIT_S)
        last_seq = max(published)
        while int.from_bytes(received[-1][1], "big") < last_seq:
            assert sub.poll(int(SOCKET_WAIT_S * 1000)), "batches missing"
            received.append(sub.recv_multipart())

        seqs = [int.from_bytes(frames[1], "big") for frames in received]
        assert seqs == list(range(seqs[0], last_seq + 1))  # in order, no gap
        pages: set = set()
        for topic, seq_bytes, payload in received:
            assert topic == b"kv" and len(seq_bytes) == 8
            batch = MAP_WIRE_DECODER.decode(payload)
            assert batch.data_parallel_rank == 3
            assert batch.ts > 0
            ours = published[int.from_bytes(seq_bytes, "big")]
            assert [wire_fields(e, ALL_FIELDS) for e in batch.events] == \
                [wire_fields(e, ALL_FIELDS) for e in ours]
            replay_into(pages, ours, 4)
        assert pages == tree_pages(cache)
        assert len(received) > 250 and pub.dropped == 0 and pub.errors == 0
    finally:
        sub.close()
        ctx.term()
        pub.close()


@needs_transport
def test_late_subscriber_recovers_earlier_batches_through_replay():
    cache = RadixCache(page_size=4, enable_events=True)
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    published: dict = {}

    def publish(events):
        seq = pub.publish(events)
        if events:
            published[seq] = events

    sub = None
    try:
        serve_requests(cache, 60, seed=5, publish=publish)  # nobody listening yet
        assert pub.flush(SOCKET_WAIT_S)
        early = len(published)
        sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
        received: list = []
        rng_seed = 100
        deadline = time.monotonic() + 4 * SOCKET_WAIT_S
        while not received or received[-1].seq < max(published):
            assert time.monotonic() < deadline, "never caught up"
            batch = sub.receive(timeout=0.5)
            if batch is None:
                # Nothing live yet (slow joiner): keep serving so the stream moves on.
                serve_requests(cache, 5, seed=rng_seed, publish=publish)
                rng_seed += 1
                continue
            received.append(batch)
        assert [b.seq for b in received] == list(range(max(published) + 1))
        for batch in received:
            assert batch.events == published[batch.seq]
            assert [wire_fields(e, ALL_FIELDS)
                    for e in MAP_WIRE_DECODER.decode(batch.payload).events] == \
                [wire_fields(e, ALL_FIELDS) for e in batch.events]
        assert sub.replayed >= early
        assert sub.gaps == []
    finally:
        if sub is not None:
            sub.close()
        pub.close()


@needs_transport
def test_batches_lost_in_transit_are_recovered_mid_stream():
    # High-water marks of one message make the PUB socket discard batches the subscriber is
    # too slow for; they were sent (and buffered), so the gap is filled through replay.
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                               hwm=1)
    sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, hwm=1)
    try:
        published: dict = {}
        deadline = time.monotonic() + SOCKET_WAIT_S
        while sub.receive(timeout=0.05) is None:  # wait for the subscription to be live
            assert time.monotonic() < deadline, "subscriber never connected"
            published[pub.publish([ev.AllBlocksCleared()])] = [ev.AllBlocksCleared()]
        received = [sub.next_seq - 1]
        rounds = 0
        while sub.replayed == 0 and rounds < 10:  # bursts until the transport lost some
            rounds += 1
            for i in range(300):
                big = [ev.BlockStored((i, rounds), None, tuple(range(i, i + 2000)), 2000)]
                published[pub.publish(big)] = big
            assert pub.flush(SOCKET_WAIT_S)
            while received[-1] < max(published):
                batch = sub.receive(timeout=SOCKET_WAIT_S)
                assert batch is not None, "batches missing"
                assert batch.events == published[batch.seq]
                received.append(batch.seq)
        assert sub.replayed > 0, "the transport never lost a batch"
        assert received == list(range(received[0], max(published) + 1))
        assert sub.gaps == [] and pub.dropped == 0
    finally:
        sub.close()
        pub.close()


@needs_transport
def test_replay_socket_protocol_and_bounded_buffer():
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                               topic="kv", buffer_steps=3)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    sub = None
    try:
        batches = [[ev.BlockRemoved((i, -i), None)] for i in range(6)]
        assert [pub.publish(b) for b in batches] == list(range(6))
        assert pub.flush(SOCKET_WAIT_S)
        dealer.connect(pub.replay_endpoint)
        # The request a REQ socket sends, (b"", start_seq) after the ROUTER's identity frame.
        dealer.send_multipart([b"", (4).to_bytes(8, "big")])
        # The answer vLLM's and SGLang's publishers give: (b"", topic, seq, payload) per
        # batch, then the end marker (b"", b"", -1, b"").
        replies = []
        while True:
            assert dealer.poll(int(SOCKET_WAIT_S * 1000)), "no end marker"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
        assert [len(f) for f in replies] == [4] * 3
        assert [(f[0], f[1]) for f in replies] == [(b"", b"kv"), (b"", b"kv"), (b"", b"")]
        assert [int.from_bytes(f[2], "big", signed=True) for f in replies] == [4, 5, -1]
        assert replies[-1][3] == b""
        decoded = [MAP_WIRE_DECODER.decode(f[3]) for f in replies[:-1]]
        assert [wire_fields(b.events[0], ALL_FIELDS) for b in decoded] == \
            [("BlockRemoved", (4, -4), None, None), ("BlockRemoved", (5, -5), None, None)]
        # Only the last three batches are buffered: a late joiner sees 0..2 as a gap.
        sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
        got = [sub.receive(timeout=SOCKET_WAIT_S) for _ in range(3)]
        assert [b.seq for b in got] == [3, 4, 5]
        assert [b.events for b in got] == batches[3:]
        assert sub.gaps == [(0, 2)]
    finally:
        dealer.close()
        ctx.term()
        if sub is not None:
            sub.close()
        pub.close()


@needs_transport
@pytest.mark.parametrize("with_replay", [False, True])
def test_a_dropped_batch_shows_as_a_gap(with_replay):
    replay = "tcp://127.0.0.1:*" if with_replay else None
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint=replay, max_queue_size=1)
    sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout=2.0)
    try:
        batch = [ev.AllBlocksCleared()]
        seq = 0
        deadline = time.monotonic() + SOCKET_WAIT_S
        first = None
        while first is None:  # wait for the subscription to be live
            assert time.monotonic() < deadline, "subscriber never connected"
            assert pub.publish(batch) == seq
            seq += 1
            assert pub.flush(SOCKET_WAIT_S)
            first = sub.receive(timeout=0.05)
        while True:  # drain what the warm-up left
            got = sub.receive(timeout=0.2)
            if got is None:
                break
        sent_before_burst = seq
        # A burst into a one-batch queue: the sending thread cannot keep up.
        dropped = []
        while len(dropped) < 3 and seq < sent_before_burst + 100_000:
            if pub.publish(batch) is None:
                dropped.append(seq)
            seq += 1
        assert dropped, "nothing was dropped"
        assert pub.dropped == len(dropped)
        assert pub.flush(SOCKET_WAIT_S)
        final = seq
        assert pub.publish(batch) == final  # the queue has room again
        seqs = []
        while not seqs or seqs[-1] < final:
            got = sub.receive(timeout=SOCKET_WAIT_S)
            assert got is not None, "batches missing"
            seqs.append(got.seq)
        delivered = set(range(sent_before_burst, final + 1)) - set(dropped)
        assert seqs == sorted(delivered)
        missing = {s for first_seq, last_seq in sub.gaps for s in range(first_seq, last_seq + 1)}
        assert missing == set(dropped)
    finally:
        sub.close()
        pub.close()


@needs_transport
def test_publish_validates_and_skips_empty_batches():
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        assert pub.publish([]) is None
        with pytest.raises(TypeError, match="str"):
            pub.publish(["BlockStored"])
        assert pub.publish([ev.AllBlocksCleared()]) == 0  # nothing above used a number
    with pytest.raises(RuntimeError):
        pub.publish([ev.AllBlocksCleared()])
    with pytest.raises(ValueError):
        ev.ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=0)


@needs_transport
def test_decode_batch_rejects_malformed_payloads():
    good = msgspec.msgpack.encode([1.5, [["BlockRemoved", [1, 2], None]], 0])
    assert ev.decode_batch(good, 7) == ev.ReceivedBatch(7, 1.5, [ev.BlockRemoved((1, 2))], 0)
    for bad in ([1.5], [1.5, [["Nope"]], 0], [1.5, [["BlockRemoved", ["x"], None]], 0]):
        with pytest.raises(ValueError):
            ev.decode_batch(msgspec.msgpack.encode(bad))
    with pytest.raises(ValueError):
        ev.decode_batch(b"\xc1")


BLOCKED_IMPORT_SCRIPT = r"""
import sys

class BlockOptional:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zmq", "msgspec"):
            raise ImportError(f"blocked {name}")
        return None

sys.meta_path.insert(0, BlockOptional())
import radixcache
import radixcache.events as ev
cache = radixcache.RadixCache(page_size=2, enable_events=True)
cache.insert([1, 2, 3, 4])
events = cache.take_events()
assert len(events) == 1 and isinstance(events[0], ev.BlockStored), events
for make in (lambda: ev.ZmqEventPublisher("tcp://127.0.0.1:*"),
             lambda: ev.ZmqEventSubscriber("tcp://127.0.0.1:5557")):
    try:
        make()
    except ImportError as exc:
        assert "pip install radixcache[events]" in str(exc), str(exc)
    else:
        raise SystemExit("no ImportError")
print("ok")
"""


def test_recorder_works_and_transport_names_the_extra_without_optional_deps():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- wire encodings ----------------------------------------------------------------------------

def scripted_events(core: str) -> list:
    """Two stores (one namespaced), both evicted, then a reset."""
    cache = RadixCache(page_size=2, enable_events=True, core=core)
    cache.insert([1, 2, 3, 4, 5], extra_key="t")
    cache.insert([1, 2, 9, 9])
    assert cache.evict(100) == 8
    cache.reset()
    return cache.take_events()


@needs_transport
def test_map_encoding_is_exactly_the_documented_layout(core_name):
    payload = ev.encode_batch(scripted_events(core_name), ts=2.5, data_parallel_rank=4)
    t12, t34 = ref_chain(None, [1, 2, 3, 4], "t", 2)
    p12, p99 = ref_chain(None, [1, 2, 9, 9], None, 2)
    stored_t = {"type": "BlockStored", "block_hashes": [t12, t34], "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                "lora_name": None, "extra_keys": [["t"], ["t"]]}
    stored_p = dict(stored_t, block_hashes=[p12, p99], token_ids=[1, 2, 9, 9],
                    extra_keys=[None, None])
    decoded = msgspec.msgpack.decode(payload)
    assert decoded[0] == 2.5 and decoded[2] == 4
    events = decoded[1]
    assert events[:2] == [stored_t, stored_p]
    assert sorted(events[2:4], key=lambda e: e["block_hashes"]) == sorted(
        [{"type": "BlockRemoved", "block_hashes": [t12, t34], "medium": "GPU"},
         {"type": "BlockRemoved", "block_hashes": [p12, p99], "medium": "GPU"}],
        key=lambda e: e["block_hashes"])
    assert events[4] == {"type": "AllBlocksCleared"}
    # Key order as vLLM's structs declare them, the tag first.
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name", "extra_keys"]
    assert list(events[2]) == ["type", "block_hashes", "medium"]
    # group_idx goes out only when set.
    assert msgspec.msgpack.decode(ev.encode_batch(
        [ev.BlockRemoved((5,), None, 2)]))[1] == \
        [{"type": "BlockRemoved", "block_hashes": [5], "medium": None, "group_idx": 2}]


@needs_transport
def test_positional_encoding_is_the_old_layout(core_name):
    events = scripted_events(core_name)
    payload = ev.encode_batch(events, encoding="positional", ts=1.0, data_parallel_rank=None)
    t12, t34 = ref_chain(None, [1, 2, 3, 4], "t", 2)
    decoded = msgspec.msgpack.decode(payload)
    assert decoded[0] == 1.0 and decoded[2] is None
    # A namespace travels in the trailing places (lora_name, extra_keys, group_idx).
    assert decoded[1][0] == ["BlockStored", [t12, t34], None, [1, 2, 3, 4], 2, None, "GPU",
                             None, [["t"], ["t"]], None]
    assert decoded[1][2][0] == "BlockRemoved" and len(decoded[1][2]) == 3
    assert decoded[1][4] == ["AllBlocksCleared"]
    assert [wire_fields(e) for e in WIRE_DECODER.decode(payload).events] == \
        [wire_fields(e) for e in events]


def without_map_only_fields(event: Any) -> Any:
    """What the positional layout gives back: every field, but extra_keys without a
    namespace on any block come back as None (nothing to carry)."""
    if isinstance(event, ev.BlockStored) and event.extra_keys is not None and all(
            entry is None for entry in event.extra_keys):
        return dataclasses.replace(event, extra_keys=None)
    return event


@needs_transport
@pytest.mark.parametrize("encoding", ev.ENCODINGS)
def test_recorded_events_round_trip_in_both_encodings(core_name, encoding):
    cache = RadixCache(page_size=4, enable_events=True, core=core_name,
                       event_options={"lora_namespaces": True})
    batches: list = []
    serve_requests(cache, 200, seed=21, publish=batches.append)
    cache.reset()
    batches.append(cache.take_events())
    kinds = set()
    for seq, events in enumerate(batches):
        if not events:
            continue
        payload = ev.encode_batch(events, encoding=encoding, ts=float(seq),
                                  data_parallel_rank=seq)
        batch = ev.decode_batch(payload, seq)
        assert (batch.seq, batch.ts, batch.data_parallel_rank, batch.payload) == \
            (seq, float(seq), seq, payload)
        if encoding == "map":
            assert batch.events == events
        else:
            assert batch.events == [without_map_only_fields(e) for e in events]
        kinds.update((type(e).__name__, getattr(e, "lora_name", None)) for e in events)
    assert kinds >= {("BlockStored", None), ("BlockStored", "tenant-b"),
                     ("BlockRemoved", None), ("AllBlocksCleared", None)}


def map_stored(**changes: Any) -> dict:
    event = {"type": "BlockStored", "block_hashes": [11, -12], "parent_block_hash": 10,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": [["ns"], ["ns"]]}
    event.update(changes)
    return event


MAP_STORED_EVENT = ev.BlockStored((11, -12), 10, (1, 2, 3, 4), 2, None, "GPU", None,
                                  (("ns",), ("ns",)))


def decode_one(event: Any) -> Any:
    return ev.decode_batch(msgspec.msgpack.encode([0.0, [event], 0]), 5).events[0]


@needs_transport
def test_decoder_reads_map_fields_by_name_and_ignores_unknown_ones():
    reordered = dict(reversed(list(map_stored().items())))
    assert decode_one(reordered) == MAP_STORED_EVENT
    newer = map_stored(session_id="s", kv_cache_spec_kind="full_attention",
                       lookahead_token_ids=[[1], [2]], some_future_field={"x": [1]})
    assert decode_one(newer) == MAP_STORED_EVENT
    assert decode_one({"type": "BlockRemoved", "block_hashes": [3], "medium": None,
                       "locality": "LOCAL", "ownership": "x"}) == ev.BlockRemoved((3,))
    assert decode_one({"type": "AllBlocksCleared", "anything": 1}) == ev.AllBlocksCleared()
    # Optional fields may be absent; positional places past the known ones are ignored.
    minimal = {k: v for k, v in map_stored().items()
               if k in ("type", "block_hashes", "parent_block_hash", "token_ids",
                        "block_size")}
    assert decode_one(minimal) == ev.BlockStored((11, -12), 10, (1, 2, 3, 4), 2)
    assert decode_one({"type": "BlockRemoved", "block_hashes": [3]}) == ev.BlockRemoved((3,))
    assert decode_one(["BlockStored", [1], None, [7, 7], 2, 3, "CPU"]) == \
        ev.BlockStored((1,), None, (7, 7), 2, 3, "CPU")
    assert decode_one(["BlockStored", [1], None, [7, 7], 2, 3, "CPU", "name", [["ns"]], 4,
                       "future"]) == \
        ev.BlockStored((1,), None, (7, 7), 2, 3, "CPU", "name", (("ns",),), 4)
    assert decode_one(["BlockRemoved", [1], "CPU"]) == ev.BlockRemoved((1,), "CPU")
    assert decode_one(["BlockRemoved", [1], "CPU", 9, "future"]) == \
        ev.BlockRemoved((1,), "CPU", 9)
    # One batch may even mix the two encodings; hashes may be bytes (vLLM's default).
    mixed = ev.decode_batch(msgspec.msgpack.encode(
        [1.0, [["AllBlocksCleared"], map_stored(block_hashes=[b"\x01" * 32, 5],
                                                parent_block_hash=b"\x02" * 32)]]))
    assert mixed.data_parallel_rank is None
    assert mixed.events == [ev.AllBlocksCleared(), dataclasses.replace(
        MAP_STORED_EVENT, block_hashes=(b"\x01" * 32, 5), parent_block_hash=b"\x02" * 32)]
    assert ev.decode_event(map_stored()) == MAP_STORED_EVENT


# Field values a hostile or newer publisher may send: well typed ones and every kind of
# wrong one (bools for ints, floats, strs for bytes, maps, nested arrays, huge ints).
_ODD_VALUES = st.sampled_from([None, 0, -1, 2**63, 2**64 - 1, -(2**63), True, 1.5, "x", b"h",
                               [], [1], [b"a", 2], [True], [1.0], ["x"], [[1]], [None],
                               [[1], None], [{"a": 1}], {"a": 1}, [[[[[1]]]]],
                               [1 - 2**63, 2**63 - 1]])
_MAP_FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "cache_salt",
               "session_id")


@st.composite
def _wire_events(draw: Any) -> Any:
    """A well-formed event in either encoding, maybe with fields removed, changed or added."""
    stored = ev.BlockStored(
        tuple(draw(st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=9)),
                            max_size=3))),
        draw(st.one_of(st.none(), st.integers(-5, 5), st.binary(min_size=1, max_size=4))),
        tuple(draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6))),
        draw(st.integers(1, 4)), draw(st.one_of(st.none(), st.integers(0, 3))),
        draw(st.sampled_from([None, "GPU", "CPU_PINNED"])),
        draw(st.sampled_from([None, "lora"])),
        draw(st.sampled_from([None, (("ns",), None), ((1, ("mm", 0)),)])),
        draw(st.one_of(st.none(), st.integers(0, 2))), draw(st.sampled_from([None, "s"])))
    event = draw(st.sampled_from([stored, ev.BlockRemoved(stored.block_hashes,
                                                          stored.medium, stored.group_idx),
                                  ev.AllBlocksCleared()]))
    encoding = draw(st.sampled_from(["map", "positional"]))
    if encoding == "positional" and isinstance(event, ev.BlockStored):
        event = dataclasses.replace(event, cache_salt=None)  # the layout has no place for it
    wire = event.to_wire(encoding)
    for _ in range(draw(st.integers(0, 2))):
        if isinstance(wire, dict):
            field = draw(st.sampled_from(_MAP_FIELDS))
            if draw(st.booleans()):
                wire.pop(field, None)
            else:
                wire[field] = draw(_ODD_VALUES)
        elif draw(st.booleans()):  # cut short (fewer places), or one place dropped
            if draw(st.booleans()):
                del wire[draw(st.integers(0, len(wire))):]
            elif wire:
                wire.pop(draw(st.integers(0, len(wire) - 1)))
        else:
            wire.insert(draw(st.integers(0, len(wire))), draw(_ODD_VALUES))
    return wire


@needs_transport
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(_wire_events(), max_size=4),
       head=st.one_of(st.just([0.5]), st.just([3]), st.sampled_from([[True], ["t"], [None]])),
       tail=st.one_of(st.just([]), st.sampled_from([[0], [None], [-(2**63)], [2**64 - 1]]),
                      st.sampled_from([[1.0], [0, 0], [True]])))
@example(events=[["BlockStored", [1], None, [1, 1], 2, None]], head=[0.5], tail=[])
@example(events=[["BlockRemoved", [1]]], head=[0.5], tail=[])
@example(events=[["BlockStored", [1], None, [1, 1], 2, None, None, "n", None, 1, "x"],
                 ["AllBlocksCleared", 1], ["BlockRemoved", [b"a"], "CPU", 2, 3]],
         head=[1], tail=[0])
@example(events=[{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 1],
                  "block_size": 2}], head=[0.5], tail=[])
@example(events=[{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                  "token_ids": [1, 1], "block_size": 2, "extra_keys": [[{"a": 1}]]}],
         head=[0.5], tail=[])
@example(events=[{"type": "AllBlocksCleared"}, ["AllBlocksCleared"]], head=[0.5], tail=[])
def test_typed_decoding_answers_and_fails_as_the_field_by_field_reading(events, head, tail):
    """Batches all in one encoding are decoded by typed structs; every batch, well formed or
    not, must decode to the same events, or fail with the same message, as the reading of
    each field (the one that names what is wrong)."""
    from radixcache.events import wire as wire_module
    payload = msgspec.msgpack.encode(head + [events] + tail)

    def outcome(decode: Any) -> Any:
        try:
            return decode()
        except ValueError as exc:
            return str(exc)

    typed = outcome(lambda: ev.decode_batch(payload, 4))
    checked = outcome(lambda: wire_module._decode_checked(payload, 4, msgspec))
    assert typed == checked
    if not isinstance(typed, str):
        assert typed.ts == checked.ts and type(typed.ts) is float
        assert [type(e) for e in typed.events] == [type(e) for e in checked.events]
        for mine, theirs in zip(typed.events, checked.events):  # bytes vs ints, tuples
            assert [type(v) for v in dataclasses.astuple(mine)] == \
                [type(v) for v in dataclasses.astuple(theirs)]


@needs_transport
@pytest.mark.parametrize("field", ["block_hashes", "parent_block_hash", "token_ids",
                                   "block_size"])
def test_decoder_rejects_a_missing_required_field(field):
    event = map_stored()
    del event[field]
    with pytest.raises(ValueError, match=f"batch 5, event 0: BlockStored lacks the "
                                         f"required field '{field}'"):
        decode_one(event)
    with pytest.raises(ValueError, match="lacks the required field 'block_hashes'"):
        decode_one({"type": "BlockRemoved", "medium": None})
    with pytest.raises(ValueError, match="BlockStored array has 5 fields, needs 6"):
        decode_one(["BlockStored", [1], None, [1, 1], 1, None])
    with pytest.raises(ValueError, match="BlockRemoved array has 0 fields"):
        decode_one(["BlockRemoved"])


@needs_transport
@pytest.mark.parametrize("field, bad", [
    ("block_hashes", 5), ("block_hashes", [1, "x"]), ("block_hashes", [True]),
    ("parent_block_hash", "h"), ("parent_block_hash", 1.5), ("token_ids", [1.0]),
    ("token_ids", None), ("block_size", None), ("block_size", True), ("block_size", "2"),
    ("lora_id", "a"), ("lora_id", False), ("medium", 1), ("lora_name", 3),
    ("extra_keys", "ns"), ("extra_keys", [1, 2]), ("extra_keys", {"a": 1}),
    ("group_idx", "0"), ("group_idx", 1.0),
])
def test_decoder_rejects_an_ill_typed_field(field, bad):
    with pytest.raises(ValueError,
                       match=f"malformed event batch 5, event 0: BlockStored.{field} "):
        decode_one(map_stored(**{field: bad}))


@needs_transport
@pytest.mark.parametrize("event, message", [
    ({"block_hashes": [1]}, "a map event needs a str field 'type'"),
    ({"type": 3}, "a map event needs a str field 'type'"),
    ({"type": "BlockEvicted", "block_hashes": [1]}, "unknown event type 'BlockEvicted'"),
    (["BlockEvicted", [1]], "unknown event type 'BlockEvicted'"),
    ([], "expected a tagged map or tagged array, got list"),
    ("BlockStored", "expected a tagged map or tagged array, got str"),
    (7, "expected a tagged map or tagged array, got int"),
])
def test_decoder_rejects_malformed_events_naming_the_problem(event, message):
    with pytest.raises(ValueError, match=f"batch 5, event 0: {message}"):
        decode_one(event)
    with pytest.raises(ValueError, match=f"^malformed event: {message}"):
        ev.decode_event(event)


@needs_transport
@pytest.mark.parametrize("batch, message", [
    ({"ts": 1.0}, "expected \\[ts, events, dp_rank\\]"),
    ([1.0, [], 0, 0], "expected \\[ts, events, dp_rank\\]"),
    ([True, [], 0], "ts must be a number"),
    (["1", [], 0], "ts must be a number"),
    ([1.0, {"type": "AllBlocksCleared"}, 0], "events must be an array"),
    ([1.0, [], "0"], "data_parallel_rank must be int or nil"),
])
def test_decoder_rejects_malformed_batches_naming_the_problem(batch, message):
    with pytest.raises(ValueError, match=f"malformed event batch 3: {message}"):
        ev.decode_batch(msgspec.msgpack.encode(batch), 3)


@needs_transport
def test_encoding_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown encoding 'json'; valid: map, positional"):
        ev.encode_batch([ev.AllBlocksCleared()], encoding="json")
    with pytest.raises(ValueError, match="unknown encoding"):
        ev.AllBlocksCleared().to_wire("arrays")
    with pytest.raises(ValueError, match="unknown encoding"):
        ev.ZmqEventPublisher("tcp://127.0.0.1:*", encoding="tagged")
    with pytest.raises(TypeError, match="expected KV events, got dict"):
        ev.encode_batch([{"type": "AllBlocksCleared"}])
    with pytest.raises(TypeError, match="ts must be a number"):
        ev.encode_batch([], ts="now")
    with pytest.raises(TypeError, match="data_parallel_rank"):
        ev.encode_batch([], data_parallel_rank=1.0)
    before = time.time()
    assert before <= ev.decode_batch(ev.encode_batch([])).ts <= time.time()


@needs_transport
@pytest.mark.parametrize("namespace", [2**70, -(2**63) - 1, "lone \ud800 surrogate"])
def test_a_namespace_msgpack_cannot_carry_fails_the_map_encoding_clearly(namespace):
    cache = RadixCache(page_size=1, enable_events=True)
    cache.insert([1, 2], extra_key=namespace)
    events = cache.take_events()
    assert events[0].extra_keys == ((namespace,), (namespace,))
    with pytest.raises(ValueError, match="cannot be encoded as msgpack"):
        ev.encode_batch(events)
    with pytest.raises(ValueError, match="cannot be encoded as msgpack"):
        ev.encode_batch(events, encoding="positional")  # it carries the namespace too
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        assert pub.publish(events) == 0
        assert pub.publish([ev.AllBlocksCleared()]) == 1
        assert pub.flush(SOCKET_WAIT_S)
        assert (pub.errors, pub.sent) == (1, 1)
        assert isinstance(pub.last_error, ValueError)


def test_recorder_fills_medium_lora_and_namespace_fields(core_name):
    cache = RadixCache(page_size=2, enable_events=True, core=core_name)
    assert (cache._events.medium, cache._events.lora_namespaces) == ("GPU", False)
    rows = []
    for lora_namespaces in (False, True):
        cache._events.lora_namespaces = lora_namespaces
        for namespace in (None, "adapter", b"raw", 4, np.int32(5), True):
            cache.insert([9, 9, 9], extra_key=namespace)
            (event,) = cache.take_events()
            rows.append((event.lora_name, event.lora_id, event.extra_keys, event.medium))
            cache.reset()
            cache.take_events()
    plain = [(None, None, (ns,) * 1 if ns is None else ((ns,),), "GPU")
             for ns in (None, "adapter", b"raw", 4, 5, 1)]
    assert rows[:6] == plain
    assert [row[:2] for row in rows[6:]] == [(None, None), ("adapter", None), (None, None),
                                             (None, 4), (None, 5), (None, 1)]
    int_namespaces = [row[2][0][0] for row in rows[3:6]]  # 4, np.int32(5), True
    assert int_namespaces == [4, 5, 1] and {type(v) for v in int_namespaces} == {int}
    cpu = ev.EventRecorder(1, medium=ev.MEDIUM_CPU, lora_id=3)
    assert (cpu.medium, cpu.lora_id) == ("CPU", 3)
    with pytest.raises(TypeError, match="medium"):
        ev.EventRecorder(1, medium=5)
    with pytest.raises(TypeError, match="lora_id"):
        ev.EventRecorder(1, lora_id="a")
    with pytest.raises(TypeError, match="lora_namespaces"):
        ev.EventRecorder(1, lora_namespaces=1)


def test_event_options_reach_the_cache_recorder(core_name):
    cache = RadixCache(page_size=2, enable_events=True, core=core_name,
                       event_options={"medium": ev.MEDIUM_CPU, "lora_namespaces": True})
    cache.insert([7, 7], extra_key="adapter")
    (event,) = cache.take_events()
    assert (event.medium, event.lora_name, event.lora_id) == ("CPU", "adapter", None)
    cache = RadixCache(page_size=2, enable_events=True, core=core_name,
                       event_options={"lora_id": 9})
    cache.insert([7, 7])
    (event,) = cache.take_events()
    assert (event.medium, event.lora_id) == ("GPU", 9)


@pytest.mark.parametrize("options, exc, pattern", [
    ({"medium": 5}, TypeError, "medium"),
    ({"colour": 1}, TypeError, "unknown event option 'colour'"),
    (["medium"], TypeError, "event_options must be a dict"),
])
def test_bad_event_options(core_name, options, exc, pattern):
    with pytest.raises(exc, match=pattern):
        RadixCache(enable_events=True, event_options=options, core=core_name)


def test_event_options_need_events(core_name):
    with pytest.raises(ValueError, match="without enable_events"):
        RadixCache(event_options={"medium": "CPU"}, core=core_name)


def test_namespace_helpers():
    assert ev.extra_keys_entry(None) is None
    assert ev.extra_keys_entry("a") == ("a",)
    assert ev.extra_keys_entry(np.int64(-2)) == (-2,)
    assert type(ev.extra_keys_entry(True)[0]) is int
    assert ev.canonical_namespace(b"x") == b"x"
    with pytest.raises(TypeError, match="float"):
        ev.extra_keys_entry(1.5)
    event = ev.BlockStored((1, 2), None, (1, 2), 1, extra_keys=(("a",), ("a",)))
    assert ev.event_namespace(event) == "a"
    assert ev.event_namespace(dataclasses.replace(event, extra_keys=None)) is None
    assert ev.event_namespace(dataclasses.replace(event, extra_keys=(None, None))) is None
    for bad in ((("a",), ("b",)), (("a",),), (("a", 1), ("a", 1)), (None, ("a",))):
        with pytest.raises(ValueError, match="not one \\(namespace,\\) entry per block"):
            ev.event_namespace(dataclasses.replace(event, extra_keys=bad))
    # What the recorder publishes for a namespace is what event_namespace reads back.
    cache = RadixCache(page_size=1, enable_events=True)
    cache.insert([1, 2, 3], extra_key=b"tenant")
    assert ev.event_namespace(cache.take_events()[0]) == b"tenant"


@needs_transport
def test_subscriber_reads_both_encodings():
    cache = RadixCache(page_size=2, enable_events=True)
    cache.insert([1, 2, 3, 4], extra_key="t")
    cache.evict(10)
    events = cache.take_events()
    for encoding in ev.ENCODINGS:
        pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                   encoding=encoding)
        sub = None
        try:
            assert pub.encoding == encoding and f"encoding={encoding!r}" in repr(pub)
            assert pub.publish(events) == 0
            assert pub.flush(SOCKET_WAIT_S)
            sub = ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0)
            batch = sub.receive(timeout=SOCKET_WAIT_S)
            assert batch is not None and batch.seq == 0
            expected = events if encoding == "map" else [without_map_only_fields(e)
                                                         for e in events]
            assert batch.events == expected
            assert batch.events[0].extra_keys == (("t",), ("t",))  # in both encodings
        finally:
            if sub is not None:
                sub.close()
            pub.close()


# -- hostile payloads, restarts, deadlines ----------------------------------------------------
def _nested(depth: int, opener: bytes = b"\x91", leaf: bytes = b"\x01") -> bytes:
    """msgpack of ``depth`` nested one-element arrays (or maps, opener b"\\x81\\x01")."""
    return opener * depth + leaf


def _valid_payloads() -> list:
    cache = RadixCache(page_size=2, enable_events=True)
    cache.insert([1, 2, 3, 4, 5], extra_key="a")
    cache.insert([1, 2, 9, 9], extra_key=7)
    cache.evict(100)
    cache.reset()
    events = cache.take_events()
    return [ev.encode_batch(events, encoding=encoding, ts=2.5) for encoding in ev.ENCODINGS]


def _hostile_payloads(rng: random.Random) -> list:
    payloads = []
    for depth in (1_000, 5_000, 100_000):
        for opener in (b"\x91", b"\x81\x01", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"):
            payloads.append(_nested(depth, opener))
            # ... at every level of a batch: as the events, as an event, in a field
            payloads.append(b"\x93\xcb" + bytes(8) + _nested(depth, opener) + b"\x00")
            payloads.append(b"\x93\xcb" + bytes(8) + b"\x91" + _nested(depth, opener) + b"\x00")
            payloads.append(msgspec.msgpack.encode([0.0, [{
                "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": [1, 2], "block_size": 2, "extra_keys": [["ns"]]}], 0])
                .replace(b"\x91\xa2ns", b"\x91" + _nested(depth, opener)))
    # vLLM-shaped extra_keys nested deeper than any key, in both layouts
    deep_key: Any = "x"
    for _ in range(200):
        deep_key = [deep_key]
    payloads.append(msgspec.msgpack.encode([0.0, [
        ["BlockStored", [1], None, [1, 2], 2, None, None, None, [[deep_key]], None]], 0]))
    payloads.append(msgspec.msgpack.encode([0.0, [{
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
        "token_ids": [1, 2], "block_size": 2, "extra_keys": [[deep_key]]}], 0]))
    for valid in _valid_payloads():
        payloads.extend(valid[:cut] for cut in range(len(valid)))  # every truncation
        for _ in range(300):  # random byte flips
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            payloads.append(bytes(data))
    payloads.extend(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                    for _ in range(2000))
    return payloads


@needs_transport
def test_no_payload_escapes_value_error_however_nested_truncated_or_random():
    from radixcache.router import KvIndexer

    rng = random.Random(18)
    indexer = KvIndexer(2)
    rejected = 0
    for payload in _hostile_payloads(rng):
        try:
            ev.decode_batch(payload, 3)
            accepted = True
        except ValueError:
            accepted = False
            rejected += 1
        before = indexer.stats.malformed_batches
        assert indexer.apply_payload("w", payload, 3) is accepted
        assert indexer.stats.malformed_batches == before + (not accepted)
    assert rejected > 2000
    # The deep ones are rejected outright, and named.
    with pytest.raises(ValueError, match="nested too deeply|nested deeper"):
        ev.decode_batch(_nested(1_000))
    with pytest.raises(ValueError, match="nested deeper than"):
        ev.decode_batch(msgspec.msgpack.encode([0.0, [{
            "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "extra_keys": [[[[[[[[[["x"]]]]]]]]]]}], 0]))


@needs_transport
def test_a_subscriber_turns_a_deeply_nested_payload_into_value_error():
    pub_ctx = zmq.Context()
    pub = pub_ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ev.ZmqEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + SOCKET_WAIT_S
        seq = 0
        while True:
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.send_multipart([b"", seq.to_bytes(8, "big"), _nested(10_000)])
            seq += 1
            try:
                if sub.receive(timeout=0.05) is not None:
                    raise AssertionError("a nested payload was accepted")
            except ValueError as exc:
                assert "nested too deeply" in str(exc)
                break
    finally:
        sub.close()
        pub.close()
        pub_ctx.term()


@needs_transport
def test_a_restarted_publisher_on_the_same_endpoints_is_delivered_and_marked():
    from radixcache.router import KvIndexer

    first = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    endpoint, replay_endpoint = first.endpoint, first.replay_endpoint
    sub = ev.ZmqEventSubscriber(endpoint, replay_endpoint, start_seq=0)
    indexer = KvIndexer(2)
    second = None
    try:
        old = [[ev.BlockStored((100 + i,), None, (i, i), 2)] for i in range(60)]
        for events in old:
            first.publish(events)
        assert first.flush(SOCKET_WAIT_S)
        got = []
        while len(got) < len(old):
            batch = sub.receive(timeout=SOCKET_WAIT_S)
            assert batch is not None, "old batches missing"
            got.append(batch)
            indexer.apply("w", batch)
        assert [b.seq for b in got] == list(range(60))
        assert not any(getattr(b, "restarted", False) for b in got)
        assert indexer.blocks_held("w") == 60
        first.close()
        # The worker restarts: a new publisher on the same endpoints, sequence from 0,
        # its first batch the clear of a fresh cache.
        second = ev.ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint)
        new = [[ev.AllBlocksCleared()]]
        second.publish(new[0])
        deadline = time.monotonic() + 4 * SOCKET_WAIT_S
        received = []
        while len(received) < 3:
            assert time.monotonic() < deadline, "the restarted publisher never arrived"
            batch = sub.receive(timeout=0.05)
            if batch is None:
                if len(new) < 40:  # the stream moves on until the subscriber reconnected
                    new.append([ev.BlockStored((900 + len(new),), None, (7, len(new)), 2)])
                    second.publish(new[-1])
                continue
            received.append(batch)
            indexer.apply("w", batch)
        assert [b.seq for b in received] == [0, 1, 2] and sub.resets == 1
        assert received[0].events == [ev.AllBlocksCleared()] and received[0].restarted
        assert not received[1].restarted and received[1].events == new[1]
        assert indexer.stats.restarts == 1
        assert indexer.overlap([1, 1]) == {}  # the old blocks are gone
        assert indexer.overlap([7, 1]) == {"w": 1} and indexer.blocks_held("w") == 2
    finally:
        sub.close()
        first.close()
        if second is not None:
            second.close()


@needs_transport
def test_a_stale_duplicate_is_not_a_reset():
    """Replay ran ahead of the stream: the stream's older batches are duplicates, dropped
    without a reset, and so is its late copy of a batch recorded as missed; a payload other
    than the one replay delivered, or the stream going back below what IT sent, is a reset."""
    sub = ev.ZmqEventSubscriber("tcp://127.0.0.1:1")  # no replay socket: gaps stay gaps
    try:
        sub._on_stream(3, b"p3")
        for seq in (4, 5, 6):  # delivered through replay
            assert sub._accept(seq, b"p%d" % seq)
            sub._digests.add(seq, hash(b"p%d" % seq))
        sub._on_stream(4, b"p4")  # the stream catching up: stale
        sub._on_stream(5, b"p5")
        assert sub.resets == 0 and [p[0] for p in sub._pending] == [3, 4, 5, 6]
        sub._on_stream(6, b"other")  # seq 6 of another publisher (not what replay gave)
        assert sub.resets == 1 and sub._pending[-1] == (6, b"other", True)
        assert sub.gaps == [(0, 5)]
        sub._on_stream(0, b"newer")  # below the stream's own 6: yet another publisher
        assert sub.resets == 2 and sub._pending[-1] == (0, b"newer", True)
        # 1 and 2 recorded as missed, 3 delivered by replay: the stream's late copies of all
        # three are no reset.
        assert sub._accept(3, b"q3") and sub.gaps[-1] == (1, 2)
        sub._digests.add(3, hash(b"q3"))
        for seq in (1, 2, 3):
            sub._on_stream(seq, b"q%d" % seq)
        assert sub.resets == 2 and [p[0] for p in sub._pending][-2:] == [0, 3]
    finally:
        sub.close()


@needs_transport
def test_gaps_are_bounded_and_counted():
    sub = ev.ZmqEventSubscriber("tcp://127.0.0.1:1")
    try:
        for i in range(5_000):
            sub._accept(2 * i, b"")  # every other batch lost
        assert len(sub.gaps) == 1_000  # the latest ones
        assert ev.ZmqEventSubscriber.MAX_GAPS == 1_000
        assert sub.gaps[-1] == (2 * 4_999 - 1,) * 2 and sub.gaps[0] == (2 * 4_000 - 1,) * 2
        assert sub.gap_count == 4_999 and sub.missed == 4_999
    finally:
        sub.close()


class _RecordingSocket:
    """Stands in for a socket: records every poll's timeout and says nothing arrived."""

    def __init__(self, real):
        self.real = real
        self.polls: list = []

    def poll(self, timeout=None, flags=None):
        self.polls.append(timeout)
        return 0

    def __getattr__(self, name):
        return getattr(self.real, name)


@needs_transport
def test_receive_never_waits_past_its_timeout_for_a_replay():
    """A gap starts a replay whose publisher never answers: every wait on it is bounded by
    the caller's timeout (the replay goes on at the next call), and after replay_timeout
    the gap is recorded and the batch after it delivered."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    silent = ctx.socket(zmq.ROUTER)  # a replay endpoint that never answers
    silent.setsockopt(zmq.LINGER, 0)
    replay_port = silent.bind_to_random_port("tcp://127.0.0.1")
    sub = ev.ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}",
                                replay_timeout=0.5)
    payload = ev.encode_batch([ev.AllBlocksCleared()], ts=1.0)
    try:
        deadline = time.monotonic() + SOCKET_WAIT_S
        seq = 0
        while sub.receive(timeout=0.05) is None:  # wait for the subscription to be live
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
        recorder = _RecordingSocket(sub._replay)
        sub._replay = recorder
        gap_seq = sub.next_seq + 3
        pub.send_multipart([b"", gap_seq.to_bytes(8, "big"), payload])
        batch = None
        timeouts = []
        while batch is None:
            assert time.monotonic() < deadline, "the batch after the gap never came"
            timeout = (0.0, 0.02, 0.05)[len(timeouts) % 3]
            timeouts.append(timeout)
            before = len(recorder.polls)
            batch = sub.receive(timeout=timeout)
            assert all(ms <= math_ceil_ms(timeout) for ms in recorder.polls[before:]), \
                (timeout, recorder.polls[before:])
        assert recorder.polls, "receive never waited on the replay"
        assert batch.seq == gap_seq and sub.gaps == [(gap_seq - 3, gap_seq - 1)]
    finally:
        sub.close()
        pub.close()
        silent.close()
        ctx.term()


def math_ceil_ms(seconds: float) -> int:
    import math

    return math.ceil(seconds * 1000)

"""radixcache's subscriber against vLLM's and SGLang's own publishers, and radixcache's
publisher against a client of the engines' replay protocol.

The publishers are the engines' classes: SGLang 0.5.23's
``sglang.srt.disaggregation.kv_events.ZmqEventPublisher`` (``bash tests/install_sglang.sh``)
and vLLM 0.33's ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``, loaded from the
file ``tests/fetch_vllm_kv_events.sh`` extracts from the wheel. Without SGLang its tests
skip unless ``RADIXCACHE_REQUIRE_SGLANG=1``; without the vLLM file, unless
``RADIXCACHE_REQUIRE_VLLM_SCHEMA=1`` (CI sets both). Each engine is checked for a late
join from ``start_seq=0``, a batch lost on the stream, a tail lost before the publisher went
idle, and a restart on the same endpoints: every batch arrives once, in order, and nothing
is counted malformed.

The engines' publishers have no ``flush()``: a test that needs what was published to be
sent first waits (bounded) for it to reach the publisher's replay buffer (``wait_sent``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from engine_publishers import (
    EnginePublisher,
    load_sglang_kv_events,
    load_vllm_kv_events,
    short_workdir,
)
from transport_helpers import (
    WAIT_S,
    LossyLink,
    connect,
    engine_layout_replay,
    receive_through,
)

import radixcache.events as ev
from radixcache import RadixCache
from radixcache.router import KvIndexer


# -- the engines -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_events():
    """vLLM's kv_events module, loaded from the fetched file with its vLLM imports stubbed
    (``engine_publishers`` says which and why)."""
    if sys.version_info < (3, 10):
        pytest.skip("vLLM's kv_events.py needs Python >= 3.10")
    try:
        return load_vllm_kv_events()
    except FileNotFoundError as exc:
        if os.environ.get("RADIXCACHE_REQUIRE_VLLM_SCHEMA") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def sglang_events():
    try:
        return load_sglang_kv_events()
    except Exception as exc:  # ImportError, or one of SGLang's own imports failing
        if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                    "install it with `bash tests/install_sglang.sh`")


def expected(i: int) -> list:
    return [ev.BlockStored((10_000 + i,), None, (i, i + 1), 2, None, "GPU")]


@pytest.fixture(params=["vllm", "sglang"])
def engine(request):
    """Makes the engine's publishers, and shuts every one down after the test."""
    module = request.getfixturevalue(f"{request.param}_events")
    workdir = short_workdir()
    made = []

    def make(**kwargs: Any) -> EnginePublisher:
        made.append(EnginePublisher(request.param, module, workdir, **kwargs))
        return made[-1]

    yield make
    for publisher in made:
        publisher.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)


def check_clean(sub: ev.ZmqEventSubscriber) -> None:
    assert sub.malformed == 0 and sub.gaps == [] and sub.missed == 0 and sub.resets == 0


# -- radixcache's subscriber, the engines' publishers ----------------------------------------
def test_a_late_join_from_zero_recovers_every_buffered_batch(engine):
    pub = engine()
    for i in range(50):
        pub.publish(i)
    pub.wait_sent()
    with ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv",
                               start_seq=0) as sub:
        early = receive_through(sub, 49)
        assert [b.seq for b in early] == list(range(50))
        assert [b.events for b in early] == [expected(i) for i in range(50)]
        assert sub.replayed == 50
        check_clean(sub)
        # Live batches after it arrive too, through the stream or through replay when the
        # stream is not connected yet.
        for i in range(50, 70):
            pub.publish(i)
        late = receive_through(sub, 69)
        assert [b.seq for b in late] == list(range(50, 70))
        assert [b.events for b in late] == [expected(i) for i in range(50, 70)]
        check_clean(sub)


def test_a_batch_lost_on_the_stream_is_filled_by_replay(engine):
    pub = engine()
    link = LossyLink(pub.endpoint)
    try:
        with ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint, topic="kv",
                                   probe_interval=None) as sub:
            first = connect(sub, lambda: pub.publish(pub.count))
            link.drop = {first + 3, first + 4}
            for i in range(first, first + 10):
                pub.publish(i)
            got = receive_through(sub, first + 9)
            assert [b.seq for b in got] == list(range(first, first + 10))
            assert [b.events for b in got] == [expected(i) for i in range(first, first + 10)]
            # The replay from the gap on may run ahead of the stream: its copies are dropped.
            assert link.dropped == [first + 3, first + 4] and sub.replayed >= 2
            check_clean(sub)
    finally:
        link.close()


def test_a_tail_lost_before_the_engine_went_idle_is_recovered_by_a_probe(engine):
    pub = engine()
    link = LossyLink(pub.endpoint)
    try:
        with ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint, topic="kv",
                                   probe_interval=0.2) as sub:
            first = connect(sub, lambda: pub.publish(pub.count))
            link.drop = set(range(first + 5, first + 100))  # 95 of the burst's 100
            for i in range(first, first + 100):
                pub.publish(i)
            got = receive_through(sub, first + 99)  # no later batch shows the gap
            assert [b.seq for b in got] == list(range(first, first + 100))
            assert [b.events for b in got] == [expected(i)
                                               for i in range(first, first + 100)]
            # A probe may come before the stream's 5 did, and replay them too.
            assert len(link.dropped) == 95 and sub.replayed >= 95 and sub.probes >= 1
            check_clean(sub)
    finally:
        link.close()


def test_an_engine_restart_on_the_same_endpoints_is_delivered_and_marked(engine):
    first = engine()
    indexer = KvIndexer(2)
    with ev.ZmqEventSubscriber(first.endpoint, first.replay_endpoint, topic="kv",
                               start_seq=0) as sub:
        for i in range(200):
            first.publish(i)
        for batch in receive_through(sub, 199):
            indexer.apply("w", batch)
        assert indexer.blocks_held("w") == 200
        check_clean(sub)
        first.shutdown()
        # The worker restarts: its sequence starts again at 0, its cache is empty. Its new
        # blocks are published until the subscriber hears them (fewer than the 200 old
        # ones, so the restart shows as the sequence going back).
        second = engine(endpoints=(first.endpoint, first.replay_endpoint))
        received = []

        def publish_new() -> None:
            if second.count < 150:
                second.publish(1_000 + second.count)

        publish_new()
        received = receive_through(sub, 0, step=publish_new)
        while received[-1].seq < second.count - 1:  # the rest of what it published
            received += receive_through(sub, second.count - 1)
        for batch in received:
            indexer.apply("w", batch)
        assert [b.seq for b in received] == list(range(second.count))
        assert [b.events for b in received] == [expected(1_000 + j)
                                                for j in range(second.count)]
        assert received[0].restarted and not any(b.restarted for b in received[1:])
        assert sub.resets == 1 and sub.malformed == 0 and sub.gaps == []
        assert indexer.stats.restarts == 1
        assert indexer.blocks_held("w") == second.count  # the old blocks are gone
        assert indexer.overlap([0, 1]) == {} and indexer.overlap([1_000, 1_001]) == {"w": 1}


def test_a_long_sglang_replay_reaches_a_busy_subscriber_whole(sglang_events):
    """SGLang's replay ROUTER keeps at most 1,000 messages for a client: a replay the client
    does not read at once overflows into the kernel's socket buffers, and past them SGLang's
    ROUTER drops the rest, end marker included, unless the client's queue takes it all."""
    workdir = short_workdir()
    pub = EnginePublisher("sglang", sglang_events, workdir, buffer_steps=40_000)
    try:
        for i in range(40_000):
            pub.publish(i)
        pub.wait_sent()
        with ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv",
                                   start_seq=0, probe_interval=None) as sub:
            assert sub.receive(timeout=0) is None  # asks for the replay...
            time.sleep(1.0)  # ...and is busy elsewhere while it is sent
            got = receive_through(sub, 39_999)
            assert [b.seq for b in got] == list(range(40_000))
            assert sub.replayed == 40_000
            check_clean(sub)
    finally:
        pub.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


# -- radixcache's publisher, the engines' replay protocol -------------------------------------
def test_radixcache_replays_in_the_engines_layout():
    cache = RadixCache(page_size=2, enable_events=True)
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                              topic="kv", buffer_steps=20) as pub:
        published = []
        for i in range(30):
            cache.insert([i, i + 1, 7, 7], extra_key="tenant" if i % 2 else None)
            published.append(cache.take_events())
            assert pub.publish(published[-1]) == i
        assert pub.flush(WAIT_S)
        for start, first in ((0, 10), (25, 25), (30, 30)):  # 0-9 are gone from the buffer
            answer = engine_layout_replay(pub.replay_endpoint, start)
            assert [(topic, seq) for topic, seq, _ in answer] == \
                [(b"kv", seq) for seq in range(first, 30)]
            assert [ev.decode_batch(payload).events for _, _, payload in answer] == \
                published[first:]
        assert pub.errors == 0


def test_vllms_structs_decode_what_radixcache_replays(vllm_events):
    cache = RadixCache(page_size=2, enable_events=True)
    decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                              topic="kv", data_parallel_rank=2) as pub:
        for i in range(5):
            cache.insert([i, 1, 2, 3, 4])
            pub.publish(cache.take_events())
        assert pub.flush(WAIT_S)
        answer = engine_layout_replay(pub.replay_endpoint, 0)
    batches = [decoder.decode(payload) for _, _, payload in answer]
    assert [b.data_parallel_rank for b in batches] == [2] * 5
    assert [[e.token_ids for e in b.events] for b in batches] == \
        [[[i, 1, 2, 3]] for i in range(5)]

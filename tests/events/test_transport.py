"""radixcache's ZeroMQ transport on its own: replay layouts, long replays against restart
detection, the restart mark, probes of an idle publisher, timeouts and closing.

Where a test needs a peer radixcache's publisher cannot be (one that answers replays in the
older three-frame layout, sends a payload the decoder rejects or never answers), it uses a
raw ZeroMQ socket and says so.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from transport_helpers import (
    END_SEQ,
    WAIT_S,
    LossyLink,
    connect,
    receive_through,
    seq_bytes,
)

import radixcache.events as ev
from radixcache.router import KvIndexer


def stored(i: int) -> list:
    return [ev.BlockStored((i,), None, (i, i + 1), 2)]


def clear() -> list:
    return [ev.AllBlocksCleared()]


@pytest.fixture
def raw():
    """A raw ZeroMQ context for the test's own sockets, every one closed afterwards."""
    ctx = zmq.Context()
    made = []

    def socket(kind):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        made.append(sock)
        return sock

    yield socket
    for sock in made:
        sock.close()
    ctx.term()


def bind(sock) -> str:
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


# -- replay layouts ---------------------------------------------------------------------------
def test_the_older_three_frame_replay_answer_is_still_read(raw):
    """A publisher of an earlier radixcache answers (b"", seq, payload), ends with
    (b"", -1, b""): played here by a raw ROUTER."""
    pub, router = raw(zmq.PUB), raw(zmq.ROUTER)
    endpoint, replay_endpoint = bind(pub), bind(router)
    payloads = [ev.encode_batch(stored(i), ts=1.0) for i in range(5)]
    with ev.ZmqEventSubscriber(endpoint, replay_endpoint, start_seq=0,
                               probe_interval=None) as sub:
        assert sub.receive(timeout=0) is None  # sends the initial replay request
        assert router.poll(int(WAIT_S * 1000))
        identity, empty, start = router.recv_multipart()
        assert empty == b"" and start == seq_bytes(0)
        for seq, payload in enumerate(payloads):
            router.send_multipart([identity, b"", seq_bytes(seq), payload])
        router.send_multipart([identity, b"", END_SEQ, b""])
        got = receive_through(sub, 4)
        assert [b.events for b in got] == [stored(i) for i in range(5)]
        deadline = time.monotonic() + WAIT_S
        while sub._replay_active:  # until the end marker is read, as one
            assert time.monotonic() < deadline, "the end marker was not taken as one"
            assert sub.receive(timeout=0.1) is None
        assert sub.replayed == 5 and sub.malformed == 0 and sub.gaps == []


def answer_replay(router, sub, got: list, start: int, seqs: list, end: bool = True) -> None:
    """Play a publisher's replay ROUTER: wait for ``sub`` to ask from ``start`` (receiving
    meanwhile, the batches' numbers going to ``got``), then answer with the batches ``seqs``
    in the engines' layout, and the end marker unless ``end`` is false."""
    deadline = time.monotonic() + WAIT_S
    while not router.poll(0):  # the subscriber asks while it receives
        assert time.monotonic() < deadline, f"no request from {start}"
        batch = sub.receive(timeout=0.02)
        if batch is not None:
            got.append(batch.seq)
    identity, _, asked = router.recv_multipart()
    assert asked == seq_bytes(start)
    for seq in seqs:
        router.send_multipart([identity, b"", b"", seq_bytes(seq),
                               ev.encode_batch(stored(seq))])
    if end:
        router.send_multipart([identity, b"", b"", END_SEQ, b""])


def test_an_answer_that_lost_messages_is_asked_for_again(raw):
    """A raw ROUTER plays a publisher whose answers lose messages on the way (as SGLang's
    ROUTER drops what a client's full queue cannot take): a hole inside an answer, or its
    silence once it began, makes the subscriber ask again from the first batch missing; a
    batch the publisher never had stays a gap."""
    pub, router = raw(zmq.PUB), raw(zmq.ROUTER)
    endpoint, replay_endpoint = bind(pub), bind(router)
    got: list = []

    def answer(sub, start: int, seqs: list, end: bool = True) -> None:
        answer_replay(router, sub, got, start, seqs, end)

    with ev.ZmqEventSubscriber(endpoint, replay_endpoint, start_seq=0, replay_timeout=1.0,
                               probe_interval=None) as sub:
        answer(sub, 0, [0, 1, 2, 5, 6])  # 3 and 4 lost on the way
        answer(sub, 3, [3, 4, 5, 6])
        got += [b.seq for b in receive_through(sub, 6)]
        assert got == list(range(7)) and sub.gaps == []
        pub.send_multipart([b"", seq_bytes(10), ev.encode_batch(stored(10))])  # a gap
        answer(sub, 7, [7, 9, 10])  # the publisher never had 8
        answer(sub, 8, [9, 10])
        got += [b.seq for b in receive_through(sub, 10)]
        assert got == [0, 1, 2, 3, 4, 5, 6, 7, 9, 10] and sub.gaps == [(8, 8)]
        pub.send_multipart([b"", seq_bytes(14), ev.encode_batch(stored(14))])
        answer(sub, 11, [11, 12], end=False)  # then silence: the tail was lost
        answer(sub, 13, [13, 14])
        got += [b.seq for b in receive_through(sub, 14)]
        assert got[-4:] == [11, 12, 13, 14] and sub.gaps == [(8, 8)]
        while sub._replay_active:  # the end marker
            assert sub.receive(timeout=0.05) is None
        assert sub.malformed == 0 and sub.resets == 0
        assert not router.poll(0)  # asked no more than that



def test_an_answer_that_loses_messages_but_gets_further_is_asked_for_until_whole(raw):
    """A busy machine can lose a long answer's messages at several places: every ask that
    gets further than the last one starts the count of retries again, so more holes than
    ``MAX_REPLAY_RETRIES`` are still filled."""
    pub, router = raw(zmq.PUB), raw(zmq.ROUTER)
    endpoint, replay_endpoint = bind(pub), bind(router)
    got: list = []

    def answer(sub, start: int, seqs: list) -> None:
        answer_replay(router, sub, got, start, seqs)

    holes = 2 * ev.ZmqEventSubscriber.MAX_REPLAY_RETRIES + 1
    last = holes + 3
    with ev.ZmqEventSubscriber(endpoint, replay_endpoint, start_seq=0, replay_timeout=1.0,
                               probe_interval=None) as sub:
        # Each answer loses the batch after its first: more holes than retries, each ask
        # one batch further than the one before.
        for start in range(holes):
            answer(sub, start, [start] + list(range(start + 2, last + 1)))
        answer(sub, holes, list(range(holes, last + 1)))
        got += [b.seq for b in receive_through(sub, last)]
        assert got == list(range(last + 1)) and sub.gaps == [] and sub.missed == 0
        assert sub.malformed == 0 and sub.resets == 0
        assert not router.poll(0)  # asked no more than that

# -- long replays are no restart --------------------------------------------------------------
class SmallDigestSubscriber(ev.ZmqEventSubscriber):
    MAX_REPLAYED = 1_000


@pytest.mark.parametrize("subscriber", [ev.ZmqEventSubscriber, SmallDigestSubscriber])
def test_a_replay_far_ahead_of_the_stream_is_delivered_once(subscriber):
    """A batch lost at the start of a burst: the replay from it delivers the whole burst
    (5 times ``SmallDigestSubscriber``'s digest cap) before the stream's copies arrive;
    each of them is dropped as the copy it is, none taken for a restarted publisher.
    (``benchmarks/scripts/event_recovery.py`` does the same with 10^6 batches and the default.)"""
    burst = 5 * SmallDigestSubscriber.MAX_REPLAYED
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                               buffer_steps=burst + 100)
    link = LossyLink(pub.endpoint)
    try:
        with subscriber(link.endpoint, pub.replay_endpoint, probe_interval=None) as sub:
            first = connect(sub, lambda: pub.publish(clear()))
            link.drop = {first}
            for i in range(burst):
                assert pub.publish(stored(i)) == first + i
            assert pub.flush(WAIT_S)
            got = receive_through(sub, first + burst - 1)
            assert [b.seq for b in got] == list(range(first, first + burst))
            assert [b.events[0].block_hashes[0] for b in got] == list(range(burst))
            assert sub.replayed == burst  # the stream's copies came after the replay
            assert sub.resets == 0 and sub.gaps == [] and sub.malformed == 0
            # The stream's copies, all dropped, are passed; what comes next is delivered.
            extra = pub.publish(clear())
            assert receive_through(sub, extra)[-1].seq == extra
            assert sub.resets == 0 and sub.gaps == [] and len(sub._digests) == 0
    finally:
        link.close()
        pub.close()


def test_a_stream_lagging_behind_a_short_replay_buffer_is_no_restart():
    """The replay buffer holds the last 100 of a 1,000-batch burst whose first batch the
    stream lost: 1 to 900 are a gap, and the stream's late copies of them are no reset."""
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                               buffer_steps=100)
    link = LossyLink(pub.endpoint)
    try:
        with ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint,
                                   probe_interval=None) as sub:
            first = connect(sub, lambda: pub.publish(clear()))
            link.drop = {first}
            for i in range(1_000):
                pub.publish(stored(i))
            assert pub.flush(WAIT_S)
            got = receive_through(sub, first + 999)
            assert [b.seq for b in got] == list(range(first + 900, first + 1_000))
            assert sub.gaps == [(first, first + 899)] and sub.missed == 900
            extra = pub.publish(clear())
            assert [b.seq for b in receive_through(sub, extra)] == [extra]
            assert sub.resets == 0 and sub.malformed == 0
    finally:
        link.close()
        pub.close()


# -- restarts ---------------------------------------------------------------------------------
def test_a_restart_mark_survives_a_rejected_first_batch(raw):
    """The restarted publisher's first batch is rejected (an unknown event type, which
    radixcache's publisher cannot send: a raw PUB socket plays both publishers): receive
    raises, and the next batch carries the restart, so the old blocks are dropped."""
    pub = raw(zmq.PUB)
    endpoint = bind(pub)
    indexer = KvIndexer(2)
    with ev.ZmqEventSubscriber(endpoint, probe_interval=None) as sub:
        sent = []

        def send_old() -> int:
            seq = len(sent)
            sent.append(seq)
            pub.send_multipart([b"", seq_bytes(seq), ev.encode_batch(stored(seq))])
            return seq

        last = connect(sub, send_old) - 1
        for _ in range(10):
            last = send_old()
        for batch in receive_through(sub, last):
            indexer.apply("w", batch)
        old_blocks = indexer.blocks_held("w")
        assert old_blocks >= 10
        unknown = ev.encode_batch(clear()).replace(b"AllBlocksCleared", b"AllBlocksErased!")
        pub.send_multipart([b"", seq_bytes(0), unknown])
        pub.send_multipart([b"", seq_bytes(1), ev.encode_batch(stored(500))])
        deadline = time.monotonic() + WAIT_S
        while True:
            assert time.monotonic() < deadline, "the rejected batch never came"
            try:
                assert sub.receive(timeout=0.1) is None
            except ValueError as exc:
                assert "unknown event type" in str(exc)
                break
        batch = sub.receive(timeout=WAIT_S)
        assert batch.seq == 1 and batch.restarted and sub.resets == 1
        indexer.apply("w", batch)
        assert indexer.stats.restarts == 1 and indexer.blocks_held("w") == 1
        pub.send_multipart([b"", seq_bytes(2), ev.encode_batch(stored(501))])
        assert not sub.receive(timeout=WAIT_S).restarted  # once only


# -- probing an idle publisher ----------------------------------------------------------------
def test_an_idle_publishers_lost_tail_is_recovered_within_the_probe_interval():
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    link = LossyLink(pub.endpoint)
    try:
        with ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint,
                                   probe_interval=0.2) as sub:
            first = connect(sub, lambda: pub.publish(clear()))
            link.drop = set(range(first + 5, first + 100))
            for i in range(100):
                pub.publish(stored(i))
            assert pub.flush(WAIT_S)
            got = receive_through(sub, first + 99)
            assert [b.seq for b in got] == list(range(first, first + 100))
            assert [b.events for b in got] == [stored(i) for i in range(100)]
            # A probe may come before the stream's 5 did, and replay them too.
            assert len(link.dropped) == 95 and sub.replayed >= 95 and sub.probes >= 1
            assert sub.gaps == [] and sub.malformed == 0 and sub.resets == 0
    finally:
        link.close()
        pub.close()


def test_probes_of_an_idle_publisher_cost_one_round_trip_per_interval():
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*",
                              replay_endpoint="tcp://127.0.0.1:*") as pub:
        with ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint,
                                   probe_interval=0.05) as sub:
            connect(sub, lambda: pub.publish(clear()))
            replayed, probes, start = sub.replayed, sub.probes, time.monotonic()
            while sub.probes < probes + 3:
                assert time.monotonic() - start < WAIT_S, "no probe"
                assert sub.receive(timeout=0.02) is None
            elapsed = time.monotonic() - start
            # Never more than one per interval (a loaded machine makes fewer, never more).
            assert sub.probes - probes <= elapsed / 0.05 + 1
            assert sub.replayed == replayed and sub.malformed == 0  # nothing was lost
        with ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint,
                                   probe_interval=None) as sub:
            connect(sub, lambda: pub.publish(clear()))
            assert sub.receive(timeout=0.3) is None and sub.probes == 0


def test_no_probe_while_a_replay_runs(raw):
    """A gap's replay that is never answered (a raw ROUTER that stays silent) holds off
    probes however long it waits."""
    pub, silent = raw(zmq.PUB), raw(zmq.ROUTER)
    endpoint, replay_endpoint = bind(pub), bind(silent)
    payload = ev.encode_batch(clear(), ts=1.0)
    with ev.ZmqEventSubscriber(endpoint, replay_endpoint, replay_timeout=None,
                               probe_interval=None) as sub:
        sent = []

        def send() -> int:
            sent.append(len(sent))
            pub.send_multipart([b"", seq_bytes(sent[-1]), payload])
            return sent[-1]

        connect(sub, send)
        sub.probe_interval = 0.02
        probes = sub.probes
        pub.send_multipart([b"", seq_bytes(len(sent) + 5), payload])  # a gap: a replay
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert sub.receive(timeout=0.05) is None
        assert sub._replay_active and sub.probes == probes
        assert silent.poll(0)  # the replay request, and only it, reached the ROUTER
        silent.recv_multipart()
        assert not silent.poll(0)


# -- timeouts ---------------------------------------------------------------------------------
def test_unbounded_timeouts_wait_and_bad_ones_are_refused():
    with ev.ZmqEventPublisher("tcp://127.0.0.1:*",
                              replay_endpoint="tcp://127.0.0.1:*") as pub:
        with ev.ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, timeout=math.inf,
                                   replay_timeout=None, probe_interval=math.inf) as sub:
            assert sub.timeout is None and sub.replay_timeout is None
            assert sub.probe_interval is None
            connect(sub, lambda: pub.publish(clear()))
            for timeout in (math.inf, None, 1e9, 10**400):  # 1e9 s is past 24.8 days
                seq = pub.publish(clear())
                assert pub.flush(math.inf)
                assert sub.receive(timeout=timeout).seq == seq
            seq = pub.publish(clear())
            assert next(iter(sub)).seq == seq
            for bad, error in ((-1, ValueError), (math.nan, ValueError),
                               (-math.inf, ValueError), ("1", TypeError), (True, TypeError)):
                with pytest.raises(error, match="timeout"):
                    sub.receive(timeout=bad)
                with pytest.raises(error, match="timeout"):
                    pub.flush(bad)
            with pytest.raises(ValueError, match="replay_timeout"):
                sub.replay_timeout = -0.5
            assert sub.replay_timeout is None  # unchanged
    for option, bad, error in (("timeout", -1, ValueError), ("replay_timeout", math.nan,
                                                              ValueError),
                               ("replay_timeout", "2", TypeError),
                               ("probe_interval", 0, ValueError),
                               ("probe_interval", -1.0, ValueError),
                               ("hwm", -1, ValueError), ("hwm", 1.5, TypeError)):
        with pytest.raises(error, match=option):
            ev.ZmqEventSubscriber("tcp://127.0.0.1:1", **{option: bad})


def test_a_replay_that_never_goes_silent_is_not_abandoned(raw):
    """``replay_timeout`` is the silence a replay may keep, not its whole length: a raw
    ROUTER answers 5 batches 0.5 s apart (longer in all than the 2 s timeout)."""
    pub, router = raw(zmq.PUB), raw(zmq.ROUTER)
    endpoint, replay_endpoint = bind(pub), bind(router)
    with ev.ZmqEventSubscriber(endpoint, replay_endpoint, start_seq=0, replay_timeout=2.0,
                               probe_interval=None) as sub:
        assert sub.receive(timeout=0) is None
        assert router.poll(int(WAIT_S * 1000))
        identity = router.recv_multipart()[0]
        got = []
        for seq in range(5):
            time.sleep(0.5)
            router.send_multipart([identity, b"", b"", seq_bytes(seq),
                                   ev.encode_batch(stored(seq))])
            got += receive_through(sub, seq)
        router.send_multipart([identity, b"", b"", END_SEQ, b""])
        assert [b.seq for b in got] == list(range(5)) and sub.gaps == []


# -- closing ----------------------------------------------------------------------------------
class StuckStored(ev.BlockStored):
    """An event whose encoding waits for ``release``: a sending thread that misbehaves."""

    release = threading.Event()

    def to_wire(self, encoding=ev.DEFAULT_ENCODING):
        assert self.release.wait(WAIT_S)
        return super().to_wire(encoding)


class ExitingStored(ev.BlockStored):
    """An event whose encoding ends the sending thread."""

    def to_wire(self, encoding=ev.DEFAULT_ENCODING):
        raise SystemExit


def test_close_takes_unbounded_timeouts_and_refuses_bad_ones():
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    for bad, error in ((-1, ValueError), (math.nan, ValueError), ("5", TypeError)):
        with pytest.raises(error, match="timeout"):
            pub.close(bad)
    assert pub.publish(clear()) == 0  # still open
    pub.close(math.inf)
    assert pub._ctx.closed and pub._pub.closed and pub._replay.closed
    assert pub.sent == 1 and pub.dropped == 0
    pub.close(math.inf)  # again: nothing


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_close_releases_the_sockets_even_when_the_sending_thread_misbehaves():
    StuckStored.release.clear()
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        assert pub.publish([StuckStored((1,), None, (1, 2), 2)]) == 0
        assert pub.publish(clear()) == 1
        pub.close(timeout=0.1)  # returns: the thread is stuck encoding batch 0
        assert not pub._ctx.closed  # still the thread's
    finally:
        StuckStored.release.set()
    deadline = time.monotonic() + WAIT_S
    while not pub._ctx.closed:  # the thread closes them once it is done
        assert time.monotonic() < deadline, "the sockets were never closed"
        time.sleep(0.01)
    assert pub._pub.closed and pub._replay.closed
    assert pub.sent == 1 and pub.dropped == 1  # batch 1 was never sent

    dead = ev.ZmqEventPublisher("tcp://127.0.0.1:*")
    dead.publish([ExitingStored((1,), None, (1, 2), 2)])
    dead._thread.join(WAIT_S)
    assert not dead._thread.is_alive() and not dead.flush(WAIT_S)
    with pytest.raises(RuntimeError, match="sending thread"):
        dead.publish(clear())
    dead.close()
    assert dead._ctx.closed and dead._pub.closed


def test_a_closed_subscriber_refuses_to_receive_and_closes_once():
    sub = ev.ZmqEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    sub.close()
    sub.close()
    assert sub._ctx.closed
    with pytest.raises(RuntimeError, match="closed"):
        sub.receive(timeout=0)


def test_malformed_stream_messages_are_counted_and_skipped(raw):
    pub = raw(zmq.PUB)
    endpoint = bind(pub)
    with ev.ZmqEventSubscriber(endpoint) as sub:
        sent = []

        def send() -> int:
            sent.append(len(sent))
            pub.send_multipart([b"", seq_bytes(sent[-1]), ev.encode_batch(clear())])
            return sent[-1]

        nxt = connect(sub, send)
        pub.send_multipart([b"", seq_bytes(-5), ev.encode_batch(clear())])  # negative
        pub.send_multipart([b"", b"\x00" * 7, ev.encode_batch(clear())])  # short seq
        pub.send_multipart([b"", seq_bytes(nxt)])  # no payload
        pub.send_multipart([b"", seq_bytes(nxt), ev.encode_batch(clear())])
        assert sub.receive(timeout=WAIT_S).seq == nxt
        assert sub.malformed == 3 and sub.gaps == []


# -- undecoded batches ------------------------------------------------------------------------
def test_an_undecoding_subscriber_hands_over_payloads_and_restart_marks(raw):
    """``decode=False``: each batch comes as its payload, undecoded (a payload the decoder
    would reject too, which a raw PUB socket can send), in order, with the restart mark."""
    pub = raw(zmq.PUB)
    endpoint = bind(pub)
    with pytest.raises(TypeError, match="decode must be a bool"):
        ev.ZmqEventSubscriber(endpoint, decode=1)
    with ev.ZmqEventSubscriber(endpoint, probe_interval=None, decode=False) as sub:
        payloads = []

        def send() -> int:
            seq = len(payloads)
            payloads.append(ev.encode_batch(stored(seq)))
            pub.send_multipart([b"", seq_bytes(seq), payloads[-1]])
            return seq

        last = connect(sub, send) - 1
        for _ in range(3):
            last = send()
        got = list(receive_through(sub, last))
        assert [b.payload for b in got] == payloads[len(payloads) - len(got):]
        assert all(b.events == [] and not b.restarted for b in got)
        bad = b"\xc1 not msgpack"
        pub.send_multipart([b"", seq_bytes(0), bad])  # a restarted publisher, malformed
        batch = sub.receive(timeout=WAIT_S)
        assert batch.payload == bad and batch.seq == 0 and batch.restarted
        indexer = KvIndexer(2)
        assert not indexer.apply_payload("w", batch.payload)
        assert indexer.stats.malformed_batches == 1


def test_last_contact_counts_probe_answers_of_an_idle_publisher_and_stops_with_it():
    publisher = ev.ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    subscriber = ev.ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint,
                                       start_seq=0, probe_interval=0.1, replay_timeout=0.3)
    try:
        assert subscriber.last_contact is None
        deadline = time.monotonic() + 10
        while subscriber.last_contact is None and time.monotonic() < deadline:
            subscriber.receive(timeout=0.05)  # the start replay's end marker: a contact
        first = subscriber.last_contact
        assert first is not None
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            assert subscriber.receive(timeout=0.05) is None  # nothing published
        assert subscriber.last_contact > first  # the probes were answered
        publisher.close()
        publisher = None
        time.sleep(0.05)
        stopped = subscriber.last_contact
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            subscriber.receive(timeout=0.05)
        assert subscriber.last_contact == stopped  # probes go unanswered
    finally:
        subscriber.close()
        if publisher is not None:
            publisher.close()


# -- receiving many at once -------------------------------------------------------------------
def test_receive_many_delivers_what_receive_does():
    """Two undecoding subscribers on one lossy link to a real publisher, one calling
    ``receive``, the other ``receive_many`` with random limits: through dropped batches
    (filled from replay) and malformed stream messages, they deliver the same batches, in the
    same order. (A restart is not in order: ``receive_many`` hands it to ``receive``'s path.)"""
    import random

    rng = random.Random(3)
    raw_ctx = zmq.Context()
    noise = raw_ctx.socket(zmq.PUB)  # malformed messages, on the link's own upstream
    noise.setsockopt(zmq.LINGER, 0)
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    link = LossyLink(pub.endpoint, drop={5, 6, 20, 21, 22})
    subs = [ev.ZmqEventSubscriber(link.endpoint, pub.replay_endpoint, start_seq=0,
                                  decode=False, probe_interval=0.2) for _ in range(2)]
    got: list = [[], []]

    def step() -> None:
        batch = subs[0].receive(timeout=0.01)
        if batch is not None:
            got[0].append(batch)
        got[1].extend(subs[1].receive_many(rng.randint(1, 8)))

    def pump(until) -> None:
        deadline = time.monotonic() + WAIT_S
        while not until():
            assert time.monotonic() < deadline, ([b.seq for b in got[0]][-5:],
                                                 [b.seq for b in got[1]][-5:])
            step()

    try:
        noise_endpoint = bind(noise)
        for sub in subs:
            sub._sub.connect(noise_endpoint)  # a second upstream of garbage on the stream
        # Connected (the link too) before the batches go: the stream then brings them in
        # order, which receive_many reads straight off the socket.
        pump(lambda: all(sub.last_contact is not None for sub in subs))
        i = 0
        while not all(got):
            pub.publish(stored(i))
            i += 1
            for _ in range(5):
                step()
            assert i < 100, "the link never connected"
        for i in range(i, 40):  # noqa: B020 (goes on from where the loop above stopped)
            pub.publish(stored(i))
            if i % 7 == 0:
                noise.send_multipart([b"", b"\x00" * 3, b"junk"])
            if i % 3 == 0:
                step()
        pub.flush(WAIT_S)
        pump(lambda: all(g and g[-1].seq >= 39 for g in got))
        for i in range(40, 50):  # in order, no gap: read straight off the socket
            pub.publish(stored(i))
            time.sleep(0.01)
            step()
        pub.flush(WAIT_S)
        pump(lambda: all(g[-1].seq >= 49 for g in got))
    finally:
        for sub in subs:
            sub.close()
        link.close()
        pub.close()
        noise.close()
        raw_ctx.term()
    seen = [[(b.seq, b.payload, b.restarted) for b in g] for g in got]
    assert seen[0] == seen[1]
    assert [s for s, _, _ in seen[0]] == list(range(50))
    assert not any(r for _, _, r in seen[0])
    assert subs[0].missed == subs[1].missed == 0
    assert subs[0].malformed == subs[1].malformed >= 3

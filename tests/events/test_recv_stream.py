"""The block module's ``recv_stream``, a subscriber's stream read in one call: the compiled
module through libzmq's own calls, the pure one through pyzmq, each on real ZeroMQ sockets
against a model of what it must return; and ``ZmqEventSubscriber`` reading through it."""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time
import types

import pytest

from radixcache import _core
from radixcache._core import BLOCKS

zmq = pytest.importorskip("zmq")

_names = itertools.count()


@pytest.fixture
def pair():
    """A PUB socket and a SUB socket connected to it (in process), subscribed to all."""
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    for sock in (pub, sub):
        sock.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    endpoint = f"inproc://recv-stream-{next(_names)}"
    pub.bind(endpoint)
    sub.connect(endpoint)
    deadline = time.monotonic() + 10
    while not sub.poll(10):  # the subscription has reached the publisher
        assert time.monotonic() < deadline, "the subscription never took"
        pub.send_multipart([b"", b"sync"])
    while sub.poll(0):
        sub.recv_multipart()
    yield pub, sub
    pub.close()
    sub.close()
    ctx.term()


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def send_all(pub, sub, messages: list) -> None:
    """Send ``messages`` (lists of frames), then wait until they are all there to read."""
    for frames in messages:
        pub.send_multipart(frames)
    assert not messages or sub.poll(5000)


def model(messages: list, limit: int, expected: int) -> tuple:
    """What ``recv_stream`` returns for ``messages`` waiting on the socket, and how many of
    them it reads."""
    payloads, malformed = [], 0
    for used, frames in enumerate(messages, 1):
        if len(payloads) >= limit:
            return (payloads, malformed, None, 0), used - 1
        ok = len(frames) == 3 and len(frames[1]) == 8
        seq = int.from_bytes(frames[1], "big", signed=True) if ok else -1
        if seq < 0:
            malformed += 1
            continue
        if seq != expected:
            return (payloads, malformed, (seq, frames[2]), 0), used
        payloads.append(frames[2])
        expected += 1
    return (payloads, malformed, None, 0), len(messages)


def read(blocks, sub, limit: int, expected: int) -> tuple:
    got = blocks.recv_stream(sub.underlying, limit, expected)
    if got is None:
        pytest.skip("libzmq's calls cannot be bound in this process")
    return got


def test_the_expected_run_is_read_and_the_first_other_message_stops_it(blocks, pair):
    pub, sub = pair
    payload = [bytes([k]) * (k * 7) for k in range(12)]
    messages = [[b"kv", seq_frame(5), payload[0]],
                [b"", seq_frame(6)],  # no payload
                [b"", seq_frame(6), payload[1]],
                [b"", seq_frame(7), payload[2], b"a fourth frame"],
                [b"", b"\x00" * 7, payload[3]],  # a short sequence number
                [b"", b"\x00" * 8 + b"\x07", payload[3]],  # a long one
                [b"", seq_frame(-3), payload[4]],  # a negative one
                [b""],  # one frame
                [b"", seq_frame(7), payload[5]],
                [b"", seq_frame(9), payload[6]],  # past the one expected: stops the read
                [b"", seq_frame(10), payload[7]]]
    send_all(pub, sub, messages)
    assert read(blocks, sub, 100, 5) == ([payload[0], payload[1], payload[5]], 6,
                                         (9, payload[6]), 0)
    assert read(blocks, sub, 100, 10) == ([payload[7]], 0, None, 0)
    assert read(blocks, sub, 100, 11) == ([], 0, None, 0)  # nothing left


def test_limit_counts_the_payloads_returned(blocks, pair):
    pub, sub = pair
    messages = [[b"", seq_frame(s), b"p%d" % s] for s in range(10)]
    send_all(pub, sub, messages)
    assert read(blocks, sub, 3, 0) == ([b"p0", b"p1", b"p2"], 0, None, 0)
    assert read(blocks, sub, 1, 3) == ([b"p3"], 0, None, 0)
    assert read(blocks, sub, 2, 7) == ([], 0, (4, b"p4"), 0)  # 4 is not the 7 expected
    assert read(blocks, sub, 50, 5) == ([b"p5", b"p6", b"p7", b"p8", b"p9"], 0, None, 0)


def test_payloads_of_every_size_come_whole(blocks, pair):
    """Empty, inline in libzmq's message (under 34 bytes), and large payloads."""
    pub, sub = pair
    rnd = random.Random(5)
    sizes = [0, 1, 8, 29, 33, 34, 100, 4096, 70_000, 1 << 20]
    payloads = [rnd.randbytes(n) for n in sizes]
    send_all(pub, sub, [[b"topic", seq_frame(s), p] for s, p in enumerate(payloads)])
    assert read(blocks, sub, 100, 0) == (payloads, 0, None, 0)


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_are_read_as_the_model_reads_them(blocks, pair, seed):
    pub, sub = pair
    rnd = random.Random(seed)
    messages, seq = [], 0
    for _ in range(300):
        r = rnd.random()
        payload = rnd.randbytes(rnd.choice([0, 3, 40, 500]))
        if r < 0.7:
            messages.append([b"", seq_frame(seq), payload])
            seq += 1
        elif r < 0.8:
            messages.append([b"", seq_frame(seq + rnd.choice([-2, -1, 1, 3])), payload])
        elif r < 0.9:
            messages.append(rnd.choice([[b""], [b"", seq_frame(seq)],
                                        [b"", seq_frame(seq), payload, b"x"],
                                        [b"", seq_frame(seq)[:rnd.randrange(8)], payload],
                                        [b"", seq_frame(-1 - rnd.randrange(9)), payload]]))
        else:
            messages.append([b"", seq_frame(seq), payload, b"", b""])
    send_all(pub, sub, messages)
    expected = 0
    while messages:
        limit = rnd.choice([1, 2, 5, 64, 1000])
        want, used = model(messages, limit, expected)
        got = read(blocks, sub, limit, expected)
        assert got == want
        messages = messages[used:]
        expected = got[2][0] + 1 if got[2] is not None else expected + len(got[0])
    assert read(blocks, sub, 10, expected) == ([], 0, None, 0)


def test_the_last_sequence_number_is_read_like_any_other(blocks, pair):
    """2**63 - 1 is expected and read; after it no sequence number is the one expected."""
    pub, sub = pair
    top = 2 ** 63 - 1
    messages = [[b"", seq_frame(top), b"last"], [b"", seq_frame(0), b"again"],
                [b"", seq_frame(top), b"late"]]
    send_all(pub, sub, messages)
    assert read(blocks, sub, 10, top) == ([b"last"], 0, (0, b"again"), 0)
    assert read(blocks, sub, 10, top) == ([b"late"], 0, None, 0)


def test_a_failed_read_returns_libzmq_errno(blocks, pair):
    """A read that fails for another reason than no message (here the socket's context is
    being terminated) returns libzmq's errno, an int, after the messages read before it."""
    pub, sub = pair
    ctx = sub.context
    term = threading.Thread(target=ctx.term)  # waits for the sockets to close
    term.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            got = read(blocks, sub, 10, 0)
            if got[3]:
                break
            assert time.monotonic() < deadline, "the context's termination never reached"
            time.sleep(0.01)
        assert got == ([], 0, None, zmq.ETERM) and type(got[3]) is int
    finally:
        pub.close()
        sub.close()
        term.join(10)


def test_a_subscriber_past_the_last_sequence_number_reads_as_receive_does():
    """Nothing on the stream can be the batch after 2**63 - 1: receive_many hands what
    arrives to receive's bookkeeping instead of refusing to read."""
    import radixcache.events as ev

    with ev.ZmqEventSubscriber("tcp://127.0.0.1:9", decode=False, probe_interval=None,
                               start_seq=2 ** 63) as sub:
        assert sub.receive_many(5) == []


def test_a_subscriber_whose_context_is_terminated_raises_what_pyzmq_raises():
    import radixcache.events as ev

    sub = ev.ZmqEventSubscriber("tcp://127.0.0.1:9", decode=False, probe_interval=None,
                                start_seq=0)
    term = threading.Thread(target=sub._ctx.term)  # waits for the sockets to close
    term.start()
    try:
        with pytest.raises(zmq.ContextTerminated):
            deadline = time.monotonic() + 10
            while sub.receive_many(5) == []:
                assert time.monotonic() < deadline, "the context's termination never reached"
                time.sleep(0.01)
    finally:
        sub._sub.close(linger=0)
        term.join(10)
        sub.close()


def test_a_failed_read_after_some_batches_hands_them_over_first():
    """``recv_stream`` read two batches, then failed (here: its answer stood in for, as a
    terminated context cannot be made to fail between two reads): ``receive_many`` returns
    the two, and its next call raises what pyzmq raises for the error."""
    import radixcache.events as ev

    answers = [([b"a", b"b"], 1, None, zmq.ETERM), ([b"c"], 0, None, 0)]
    with ev.ZmqEventSubscriber("tcp://127.0.0.1:9", decode=False, probe_interval=None,
                               start_seq=7) as sub:
        sub._read_stream = lambda handle, limit, expected: answers.pop(0)
        got = sub.receive_many(5)
        assert [(b.seq, b.payload) for b in got] == [(7, b"a"), (8, b"b")]
        assert sub.malformed == 1
        with pytest.raises(zmq.ContextTerminated):
            sub.receive_many(5)
        assert [(b.seq, b.payload) for b in sub.receive_many(5)] == [(9, b"c")]


@pytest.mark.parametrize("args, error, match", [
    ((1.0, 5, 0), TypeError, "must be ints"),
    ((True, 5, 0), TypeError, "must be ints"),
    (("x", 5, 0), TypeError, "must be ints"),
    ((None, 5, 0), TypeError, "must be ints"),
    ((0, 5, 0), ValueError, "handle must be a socket's address"),
    ((-1, 5, 0), ValueError, "handle must be a socket's address"),
    ((2 ** 64, 5, 0), ValueError, "handle must be a socket's address"),
    ("handle", TypeError, "must be ints"),
    ("limit0", ValueError, "limit must be >= 1"),
    ("expected-1", ValueError, r"expected must be in \[0, 2\*\*63\)"),
    ("expected-big", ValueError, r"expected must be in \[0, 2\*\*63\)"),
    ("bool", TypeError, "must be ints"),
])
def test_bad_arguments_are_refused_before_anything_is_read(blocks, pair, args, error, match):
    pub, sub = pair
    send_all(pub, sub, [[b"", seq_frame(0), b"kept"]])
    handle = sub.underlying
    args = {"handle": (float(handle), 5, 0), "limit0": (handle, 0, 0),
            "expected-1": (handle, 5, -1), "expected-big": (handle, 5, 2 ** 63),
            "bool": (handle, 5, False)}.get(args, args)
    with pytest.raises(error, match=match):
        blocks.recv_stream(*args)
    assert read(blocks, sub, 5, 0) == ([b"kept"], 0, None, 0)  # the message is still there


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dladdr and dlopen: Linux")
def test_the_compiled_module_reads_through_libzmq_itself(pair):
    """pyzmq's wheels load libzmq as a library of its own: the compiled module binds to it
    (it would otherwise read through pyzmq, much slower, and this would not show)."""
    if "c" not in BLOCKS:
        pytest.skip("the compiled block module is not built")
    pub, sub = pair
    send_all(pub, sub, [[b"", seq_frame(0), b"x"]])
    assert BLOCKS["c"].recv_stream(sub.underlying, 5, 0) == ([b"x"], 0, None, 0)


def test_a_subscriber_reads_through_pyzmq_where_libzmq_cannot_be_bound(monkeypatch):
    """Where the default block module answers None (libzmq's calls not bound), the
    subscriber reads its stream through the pure module from then on, batches and
    malformed messages alike."""
    import radixcache.events as ev

    asked = []

    def unbound(handle, limit, expected):
        asked.append(expected)
        return None

    monkeypatch.setattr(_core, "blocks", types.SimpleNamespace(recv_stream=unbound))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with ev.ZmqEventSubscriber(endpoint, decode=False, probe_interval=None) as sub:
            deadline = time.monotonic() + 10
            sent = 0
            while sub.receive(timeout=0.05) is None:  # connected: a batch seen
                assert time.monotonic() < deadline
                pub.send_multipart([b"", seq_frame(sent), b"p%d" % sent])
                sent += 1
            while sub.receive(timeout=0.05) is not None:
                pass  # the others sent while connecting
            pub.send_multipart([b"", b"short", b"junk"])
            for s in range(sent, sent + 5):
                pub.send_multipart([b"", seq_frame(s), b"p%d" % s])
            got: list = []
            while len(got) < 5:
                assert time.monotonic() < deadline
                sub._sub.poll(100)
                got += sub.receive_many(10)
            assert [(b.seq, b.payload) for b in got] == [(s, b"p%d" % s)
                                                         for s in range(sent, sent + 5)]
            assert sub.malformed == 1
            assert asked == [sent]  # asked once, then never again
    finally:
        pub.close()
        ctx.term()


@pytest.mark.parametrize("seed", range(3))
def test_receive_many_keeps_the_books_receive_keeps(seed):
    """Two undecoding subscribers (no replay socket) on one PUB socket sending a stream with
    gaps, repeats, numbers that go back and malformed messages: one calls ``receive(0)``
    until None, the other ``receive_many`` with random limits. They deliver the same batches
    and keep the same books (what is expected next, the last stream number, gaps, misses,
    restarts, malformed messages), and reading in order counts as hearing the publisher."""
    import radixcache.events as ev

    rnd = random.Random(seed)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    subs = [ev.ZmqEventSubscriber(endpoint, decode=False, probe_interval=None, start_seq=0)
            for _ in range(2)]
    got: list = [[], []]

    def drain() -> None:
        while (batch := subs[0].receive(0)) is not None:
            got[0].append(batch)
        while batches := subs[1].receive_many(rnd.choice([1, 2, 3, 64])):
            got[1].extend(batches)

    def books(sub) -> tuple:
        return (sub._expected, sub._stream_last, sub.malformed, sub.missed, sub.gap_count,
                list(sub.gaps), sub.resets, len(sub._digests))

    try:
        deadline = time.monotonic() + 10
        while not all(sub._sub.poll(10) for sub in subs):  # both subscriptions took
            assert time.monotonic() < deadline, "the subscriptions never took"
            pub.send_multipart([b"", b"sync"])  # malformed: two frames
        drain()
        seq = 0
        for _ in range(30):
            for _ in range(rnd.randrange(1, 30)):
                payload = rnd.randbytes(rnd.choice([0, 5, 40]))
                r = rnd.random()
                if r < 0.75:
                    pub.send_multipart([b"", seq_frame(seq), payload])
                    seq += 1
                elif r < 0.85:  # ahead (a gap), behind (a late copy), or back to the start
                    seq = max(0, seq + rnd.choice([-3, -1, 2, 5, -seq]))
                    pub.send_multipart([b"", seq_frame(seq), payload])
                    seq += 1
                else:
                    pub.send_multipart(rnd.choice([
                        [b""], [b"", seq_frame(seq)], [b"", seq_frame(seq), payload, b"x"],
                        [b"", seq_frame(seq)[:5], payload], [b"", seq_frame(-2), payload]]))
            time.sleep(rnd.choice([0, 0.01]))
            drain()
        # An in order end marker: once both have it, they have read everything sent.
        pub.send_multipart([b"", seq_frame(seq), b"end"])
        before = time.monotonic()
        deadline = before + 10
        while not all(g and g[-1].payload == b"end" for g in got):
            assert time.monotonic() < deadline, "the last batch never came"
            for sub in subs:
                sub._sub.poll(10)
            drain()
        assert subs[1]._last_heard >= before  # read straight off the socket, and heard
        assert ([(b.seq, b.payload, b.restarted) for b in got[0]]
                == [(b.seq, b.payload, b.restarted) for b in got[1]])
        assert books(subs[0]) == books(subs[1])
        assert subs[0].malformed > 0 and subs[0].gap_count > 0 and subs[0].resets > 0
    finally:
        for sub in subs:
            sub.close()
        pub.close()
        ctx.term()


@pytest.mark.parametrize("decode", [False, True])
def test_receive_many_takes_any_int_limit_and_names_a_bad_one(decode):
    """A numpy int is an int; a float, a str or a limit below 1 is refused, naming it, on
    both paths (undecoded, read straight off the socket, and decoded)."""
    np = pytest.importorskip("numpy")
    import radixcache.events as ev

    with ev.ZmqEventSubscriber("tcp://127.0.0.1:9", decode=decode, probe_interval=None,
                               start_seq=0) as sub:
        assert sub.receive_many(np.int64(5)) == []
        for limit in (5.0, "5", None):
            with pytest.raises(TypeError, match="limit must be an int"):
                sub.receive_many(limit)
        with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
            sub.receive_many(0)


def test_a_stream_at_the_last_sequence_number_is_read_without_an_error():
    """A publisher whose sequence numbers reach 2**63 - 1 (the largest the wire carries):
    the subscriber reads it, then expects 2**63, which it no longer asks ``recv_stream`` for
    (it takes int64s only): no error, and later messages are still read."""
    import radixcache.events as ev

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    top = (1 << 63) - 1
    try:
        with ev.ZmqEventSubscriber(endpoint, decode=False, probe_interval=None) as sub:
            deadline = time.monotonic() + 10
            seq = top - 40
            while sub.receive(timeout=0.05) is None:  # connected: a batch seen
                assert time.monotonic() < deadline
                pub.send_multipart([b"", seq_frame(seq), b"x"])
                seq += 1
            while sub.receive(timeout=0.05) is not None:
                pass
            got: list = []
            for s in range(seq, top + 1):
                pub.send_multipart([b"", seq_frame(s), b"p%d" % s])
            while not got or got[-1].seq < top:
                assert time.monotonic() < deadline
                sub._sub.poll(100)
                got += sub.receive_many(10)
            assert [b.seq for b in got] == list(range(seq, top + 1))
            for _ in range(3):
                assert sub.receive_many(10) == []  # expecting 2**63: no error
            pub.send_multipart([b"", seq_frame(0), b"again"])  # a restarted publisher
            again = None
            while again is None:
                assert time.monotonic() < deadline
                sub._sub.poll(100)
                got = sub.receive_many(10)
                again = got[0] if got else None
            assert (again.seq, again.payload, again.restarted) == (0, b"again", True)
    finally:
        pub.close()
        ctx.term()

"""Prefetches from storage, start to end, as SGLang 0.5.23 makes them: the storage
differential of ``test_sglang_hicache_storage_read.py`` (SGLang's default cache against
``--radix-cache-backend radixcache``, both with SGLang's own host pools and controller and
SGLang's ``file`` storage backend attached, each in its own directory; compared after every
step: match lengths, request rows, device and host free slots, sizes, queued transfers, KV
events per medium, host locks, storage hashes, storage writes and files, storage probes)
with three more scheduler-level steps, on requests whose pages host evictions pushed out to
storage or new ones:

- a request arriving: SGLang's ``_prefetch_kvcache`` (match, then ``prefetch_from_storage``
  from the match's host node where it is the root or backed up);
- its admission poll: ``check_prefetch_progress`` under the stop policy, then
  ``pop_prefetch_loaded_span`` once it answers ready;
- its abort: ``release_aborted_request``.

Between them the scheduler's steps (``check_hicache_events``) take the controller's
hit-query results (host slots allocated, reads started), its prefetch acknowledgements (the
finished reads put into the tree) and its releases. Compared on top, after every step: the
prefetches in flight (span, host slots, progress), the tokens they hold on the controller,
the loaded spans not popped yet, the retries armed, the host slots queued for release; and
every host slot is free, the tree's, a prefetch's or queued for release exactly once.

Stand-ins, the same for both sides:

- the controller's storage threads run on their own; before every step start and every
  comparison the test waits until they have answered every prefetch submitted (its hit
  query) and finished every read started (its last acknowledgement queued), as it waits for
  the backup thread: a storage backend faster than a scheduler step. Without the wait, how
  many results a step takes would depend on thread timing. A read's last acknowledgement
  is held back and queued at a step start chosen by a seeded draw, the same on both sides
  (a read whose pages are in but whose end is not reported yet, as with a slow backend), so
  that stop policies and aborts also meet reads in that state.
- the ``timeout`` policy reads SGLang's ``PollTimer`` clock (``time.perf_counter``); the
  test gives that module a clock that advances a fixed second per step, so that the same
  steps find the same deadlines expired on both sides (a wall clock would make the verdicts
  depend on how fast this machine runs the steps).
- a storage read's bounce page is allocated unpinned (``pin_memory``: no pinned-memory
  allocator without an accelerator), besides the CPU stand-ins of ``test_sglang_hicache.py``.
"""

from __future__ import annotations

import random
import time
import types
import zlib
from array import array

import pytest
from test_sglang_hicache import STEPS, cpu_hicache  # noqa: F401 -- a fixture
from test_sglang_hicache_storage_read import ProbeReplay, storage_anchor

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.utils import poll_timer


def _unwatched(queue, name: str):
    """The queue's own ``put``/``get`` (a reset keeps the controller's queues: a new watch
    replaces the old one rather than stacking on it)."""
    original = queue.__dict__.get(f"_unwatched_{name}")
    if original is None:
        original = getattr(queue, name)
        setattr(queue, f"_unwatched_{name}", original)
    return original


class _Counted:
    """The controller's storage queues watched: how many operations were submitted, answered,
    started reading and finished reading (their last acknowledgement queued, then taken)."""

    def __init__(self, cc) -> None:
        self.cc = cc
        self.submitted = self.answered = self.reads = self.finished = 0
        self.reading: dict = {}  # operation id -> operation whose last ack is not taken

        def counting(queue, bump):
            put = _unwatched(queue, "put")

            def counted(item, *args, **kwargs):
                if item is not None:
                    bump(item)
                return put(item, *args, **kwargs)
            queue.put = counted

        counting(cc.prefetch_queue, lambda op: self._add("submitted"))
        counting(cc.prefetch_hit_queue, lambda op: self._add("answered"))
        counting(cc.prefetch_buffer, self._read)
        self.held: list = []  # last acknowledgements held back (see ``LifecycleSide.tick``)
        put = _unwatched(cc.ack_prefetch_queue, "put")

        def gated(ack, *args, **kwargs):
            if ack is not None and ack.completed_req:
                self.finished += 1
                self.held.append(ack)
                return None
            return put(ack, *args, **kwargs)
        cc.ack_prefetch_queue.put = gated
        self.put_ack = put
        get = _unwatched(cc.ack_prefetch_queue, "get")

        def taken(*args, **kwargs):
            ack = get(*args, **kwargs)
            if ack.completed_req:
                self.reading.pop(ack.operation.id, None)
            return ack
        cc.ack_prefetch_queue.get = taken

    def release_held(self) -> None:
        """The held last acknowledgements queued, in the order they came."""
        for ack in self.held:
            self.put_ack(ack)
        self.held.clear()

    def _add(self, name: str) -> None:
        setattr(self, name, getattr(self, name) + 1)

    def _read(self, operation) -> None:
        self.reads += 1
        self.reading[operation.id] = operation

    def settled(self) -> bool:
        return (self.submitted == self.answered and self.reads == self.finished
                and self.cc.prefetch_sync_queue.empty())


def _ongoing(side) -> dict:
    """request id -> (span, host slots, tokens read, hit tokens) of its prefetch in flight."""
    found = {}
    for handle, info in side.real.ongoing_prefetch.items():
        if isinstance(side.real, UnifiedRadixCache):
            key, host, operation = info.prefetch_key, info.host_indices, info.operation
        else:
            key, host, operation = info.key, info.host_indices, info.operation
        found[handle.rid] = (len(key), None if host is None else host.tolist(),
                             operation.completed_tokens, operation.storage_hit_count)
    return found


def _prefetch_held(side) -> list:
    """Host slots prefetches hold: those in flight, the unread tail of reads stopped early
    until their last acknowledgement is taken, those queued for release."""
    real = side.real
    held = []
    current = set()
    for info in real.ongoing_prefetch.values():
        if info.host_indices is not None:
            held.extend(info.host_indices.tolist())
            current.add(info.operation.id)
    for op_id, operation in side.counted.reading.items():
        if op_id not in current:
            held.extend(operation.host_indices[operation.completed_tokens:].tolist())
    for part in list(real.cache_controller.host_mem_release_queue.queue):
        held.extend(part.tolist())
    return held


def lifecycle_side(side, seed: int):
    """Turn a ``BackupSide`` into one that waits for the prefetch threads too and counts the
    host slots prefetches hold as held."""
    base = type(side)
    counted = _Counted(side.real.cache_controller)

    class LifecycleSide(base):
        def settle(self) -> None:
            super().settle()
            deadline = time.monotonic() + 30
            while not self.counted.settled():
                assert time.monotonic() < deadline, "the prefetch threads stopped answering"
                time.sleep(0.0002)

        def host_slots(self) -> list:
            return super().host_slots() + _prefetch_held(self)

        def tick(self) -> tuple:
            # A read's last acknowledgement comes a step or more after its progress (the
            # same draws on both sides): a stop policy or an abort then finds pages read in
            # but the read not over.
            self.settle()
            if self.gate.random() < 0.6:
                self.counted.release_held()
            return super().tick()

        def reset(self) -> tuple:
            """The cache's reset: the controller stops its storage threads and starts them
            again on new queues (what the reads in flight held went with the host pool)."""
            result = super().reset()
            self.counted = _Counted(self.real.cache_controller)  # (held acks went too)
            return result

        def prefetch_state(self) -> tuple:
            self.settle()
            real = self.real
            retries = {rid: (r.immediate, r.storage_hit_end, r.due_step)
                       for rid, r in real.storage_prefetch_retries._pending.items()}
            return (_ongoing(self), real.cache_controller.prefetch_tokens_occupied,
                    {h.rid: n for h, n in real.prefetch_loaded_tokens_by_reqid.items()},
                    {h.rid: n for h, n in real.prefetch_loaded_storage_start_by_reqid.items()},
                    retries)

    side.__class__ = LifecycleSide
    side.counted = counted
    side.gate = random.Random(seed)
    return side


def arrive(side, handle, prompt, extra_key, salt) -> tuple:
    """SGLang's ``_prefetch_kvcache`` for a request arriving: (match, answer)."""
    start, anchor, prefix_keys = storage_anchor(side, prompt, extra_key, salt)
    if anchor is None:
        return (start, "not backed up")
    tokens = array("q", prompt)  # (the request's fill ids, as the scheduler holds them)
    answer = side.real.prefetch_from_storage(
        handle, anchor, tokens[start:], side.cache.get_last_hash_value(anchor), prefix_keys,
        matched_prefix_tokens=tokens[:start], extra_key=extra_key, cache_salt=salt)
    return (start, answer)


def poll(side, handle) -> tuple:
    """The admission poll: ready or not, then the loaded span once ready."""
    side.settle()
    if not side.real.check_prefetch_progress(handle):
        return ("waiting",)
    return ("ready",) + tuple(side.real.pop_prefetch_loaded_span(handle))


class LifecycleReplay(ProbeReplay):
    """``ProbeReplay`` with requests' prefetches issued, polled and aborted among its steps."""

    def __init__(self, *args, policy: str = "best_effort", clock=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for side in (self.sgl, self.ours):
            lifecycle_side(side, args[3])  # (the replay's seed)
            # (a read's bounce page is pinned host memory, which a CPU has no allocator for)
            side.real.cache_controller.storage_host_pool.pin_memory = False
            side.real.prefetch_stop_policy = policy  # (what --hicache-storage-prefetch-policy sets)
            side.real.prefetch_timeout_base = 0.5
            side.real.prefetch_timeout_per_page = 0.25
        self.clock = clock
        self.poll_tick = 0.7 if policy == "best_effort" else 0.25
        self.polled: set = set()  # requests polled while waiting
        self.waiting: dict = {}  # request id -> (handle, prompt, namespace)
        self.issued = 0

    def compare(self, what: str) -> None:
        super().compare(what)
        if not hasattr(self.ours, "counted"):
            return
        a, b = self.sgl.prefetch_state(), self.ours.prefetch_state()
        assert a == b, f"prefetch state differs after step {self.steps} ({what}): {a} != {b}"

    def step(self) -> None:
        if self.clock is not None:
            self.clock.now += 1.0
        roll = self.rng.random()
        if roll < 0.2:
            self.steps += 1
            past = self.admitted
            if past and self.rng.random() < 0.8:
                prompt, extra_key, salt = past[self.rng.randrange(len(past))]
            else:
                request = self.work.new_request()
                prompt, extra_key, salt = (request["prompt"], request["extra_key"],
                                           request["salt"])
            # Device evictions (write_back: host copies first) and host evictions push the
            # request's pages down to storage only.
            if self.rng.random() < 0.5:
                self.both("evict", self.rng.randrange(8, 48) * self.page_size)
                self.compare("evict")
            if self.rng.random() < 0.4:
                tokens = self.rng.randrange(4, 24) * self.page_size
                a, b = (side.settle() or side.real.evict_host(tokens)
                        for side in (self.sgl, self.ours))
                assert a == b, f"step {self.steps} evict_host: SGLang {a} != radixcache {b}"
                self.compare("evict_host")
            self.issued += 1
            rid = f"prefetch-{self.issued}"
            handle = CacheRequestHandle(rid, 0)
            a = arrive(self.sgl, handle, prompt, extra_key, salt)
            b = arrive(self.ours, handle, prompt, extra_key, salt)
            assert a == b, f"step {self.steps} arrive: SGLang {a} != radixcache {b}"
            if any(h.rid == rid for h in self.sgl.real.ongoing_prefetch):
                self.waiting[rid] = handle
                self.count("prefetch issued")
            else:
                self.count("prefetch declined")
            self.compare("arrive")
            return
        if roll < 0.35 and self.waiting:
            self.steps += 1
            # Half the polls are the newest request's (often before its read finished).
            rid = (max(self.waiting, key=lambda r: int(r.rsplit("-", 1)[1]))
                   if self.rng.random() < 0.5
                   else sorted(self.waiting)[self.rng.randrange(len(self.waiting))])
            handle = self.waiting[rid]
            if self.rng.random() < 0.15:
                for side in (self.sgl, self.ours):
                    side.settle()
                    side.real.release_aborted_request(handle)
                del self.waiting[rid]
                self.count("aborted")
                self.compare("abort")
                return
            if self.rng.random() < self.poll_tick:  # (a step's start, before its polls)
                self.both("tick")
                self.compare("tick")
            a, b = poll(self.sgl, handle), poll(self.ours, handle)
            assert a == b, f"step {self.steps} poll: SGLang {a} != radixcache {b}"
            if a[0] == "waiting" and self.clock is not None and self.rng.random() < 0.5:
                # The next step's poll, its storage results not in yet (a slow storage
                # backend): seconds later, so that the deadline may have passed.
                self.compare("poll")
                self.polled.add(rid)
                self.count("waiting")
                self.clock.now += self.rng.choice((1.0, 4.0, 16.0))
                a, b = poll(self.sgl, handle), poll(self.ours, handle)
                assert a == b, f"step {self.steps} poll again: SGLang {a} != radixcache {b}"
            if a[0] == "ready":
                del self.waiting[rid]
                self.count("loaded" if a[1] else "ready, nothing loaded")
                if rid in self.polled:
                    self.count("ready after waiting")
                wait = self.sgl.real._storage_prefetch_wait.get(handle)
                if wait is not None and wait.expired:
                    self.count("deadline expired")
            else:
                self.polled.add(rid)
                self.count("waiting")
            self.compare("poll")
            return
        super().step()

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def drain(self) -> None:
        """Abort what still waits, then steps until every release is taken; every host slot
        must then be free or the tree's."""
        for handle in self.waiting.values():
            for side in (self.sgl, self.ours):
                side.settle()
                side.real.release_aborted_request(handle)
        self.waiting.clear()
        for side in (self.sgl, self.ours):
            side.settle()
            side.counted.release_held()
        for _ in range(3):
            self.both("tick")
            self.compare("drain")
        for side in (self.sgl, self.ours):
            assert not side.real.ongoing_prefetch
            assert side.real.cache_controller.prefetch_tokens_occupied == 0
            assert not _prefetch_held(side), "host slots still held by prefetches"
        self.ours.check_slots()


class FakeClock:
    """The ``timeout`` policy's clock (see the module docstring)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def _replay(core, page_size, write_policy, monkeypatch, tmp_path, name, policy="best_effort",
            fail=None):
    seed = zlib.crc32(f"{name}-{write_policy}-{page_size}-{policy}".encode())
    clock = None
    if policy == "timeout":
        clock = FakeClock()
        monkeypatch.setattr(poll_timer, "time", types.SimpleNamespace(
            perf_counter=clock.perf_counter))
    replay = LifecycleReplay(core, page_size, write_policy, seed, monkeypatch, tmp_path,
                             fail_keys=None, host_ratio=0.5,
                             prefetch_threshold=3 if page_size == 1 else 2 * page_size,
                             policy=policy, clock=clock)
    if fail is not None:
        for side in (replay.sgl, replay.ours):
            backend = side.real.cache_controller.storage_backend
            monkeypatch.setattr(backend, "batch_get", fail(backend.batch_get))
    return replay


def _run(replay, steps: int) -> None:
    try:
        for _ in range(steps):
            replay.step()
        replay.drain()
    finally:
        replay.close()


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", ("write_back", "write_through"))
@pytest.mark.usefixtures("cpu_hicache")
def test_prefetch_lifecycle_same_as_sglang(backend_core, monkeypatch, tmp_path, write_policy,
                                           page_size):
    replay = _replay(backend_core, page_size, write_policy, monkeypatch, tmp_path, "life")
    _run(replay, STEPS // 5)
    counts = replay.counts
    assert counts.get("loaded", 0) > 2, str(counts)
    assert counts.get("prefetch issued", 0) > 5, counts


@pytest.mark.parametrize("policy", ("wait_complete", "timeout"))
@pytest.mark.usefixtures("cpu_hicache")
def test_stop_policies_same_as_sglang(backend_core, monkeypatch, tmp_path, policy):
    replay = _replay(backend_core, 16, "write_through", monkeypatch, tmp_path, "policy",
                     policy=policy)
    _run(replay, STEPS // 8)
    counts = replay.counts
    assert counts.get("loaded", 0) > 2 and counts.get("waiting", 0) > 2, str(counts)
    assert counts.get("ready after waiting", 0) > 1, str(counts)
    if policy == "timeout":
        assert counts.get("deadline expired", 0) > 0, str(counts)


def _failing_reads(batch_get):
    """The storage backend's ``batch_get``, failing for some keys (the first key decides,
    the same on both sides): no pages for one, the first page only for another, an error
    for a third."""

    def maybe_fail(keys, *args, **kwargs):
        verdict = zlib.crc32(keys[0].encode()) % 4
        if verdict == 0:
            return None
        if verdict == 3:
            raise OSError("injected storage read failure")
        pages = batch_get(keys, *args, **kwargs)
        if verdict == 1 and pages is not None and len(pages) > 1:
            pages = list(pages[:1]) + [None] * (len(pages) - 1)
        return pages
    return maybe_fail


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.usefixtures("cpu_hicache")
def test_failed_reads_lose_no_slot(backend_core, monkeypatch, tmp_path, page_size):
    """Storage reads that fail, stop after a page or raise: both sides alike, and every host
    slot free, the tree's, a prefetch's or queued for release exactly once, after every step
    and once every prefetch is over."""
    replay = _replay(backend_core, page_size, "write_through", monkeypatch, tmp_path,
                     "read-faults", fail=_failing_reads)
    _run(replay, STEPS // 8)
    assert replay.counts.get("prefetch issued", 0) > 3, replay.counts



@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.usefixtures("cpu_hicache")
def test_detach_with_prefetches_in_flight(backend_core, monkeypatch, tmp_path, page_size):
    """``/detach_hicache_storage`` while requests' prefetches are in flight: every
    prefetch's anchor lock and tokens released on both sides alike, and every host slot free
    or the tree's once radixcache's detach returns."""
    replay = _replay(backend_core, page_size, "write_through", monkeypatch, tmp_path,
                     "detach")
    try:
        in_flight = 0
        while replay.steps < STEPS // 10 or not in_flight:
            replay.step()
            in_flight = len(replay.ours.real.ongoing_prefetch)
            assert replay.steps < STEPS, "no prefetch in flight to detach from"
        for side in (replay.sgl, replay.ours):
            side.settle()
            side.counted.release_held()  # (their reads are over: the acks are queued)
            ok, message = side.real.detach_storage_backend()
            assert ok, message
            assert not side.real.ongoing_prefetch and not side.real.enable_storage
            assert side.real.cache_controller.prefetch_tokens_occupied == 0
        # (SGLang's detach leaves the reads' last acknowledgements queued, and the slots they
        # did not fill with them; radixcache's takes them: its host slots are compared with
        # the tree alone)
        assert replay.sgl.prefetch_state() == replay.ours.prefetch_state()
        assert not _prefetch_held(replay.ours), "host slots still held by prefetches"
        replay.ours.check_slots()
    finally:
        replay.close()

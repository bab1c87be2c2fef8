"""With the session radix cache the radixcache backend decides as SGLang's default cache does.

The harness of test_sglang_backend.py (both caches built through SGLang's registry and factory
on real pools, real ``Req`` objects, SGLang's scheduler functions, compared after every step:
match lengths, request rows, free slots, sizes, KV events), with
``--enable-session-radix-cache``: SGLang's default cache then runs its Python TreeCore (its
Rust core refuses sessions). Most conversations are sessions, and the scheduler's session calls
run as SGLang's scheduler makes them: ``open_radix_session`` when a session opens (now and then
again for an open one: a new generation, whose older requests no longer tag),
``ensure_session_generation`` when a request of a session arrives (``req.session_generation``),
``release_radix_session`` when one closes (a request finishing after that tags nothing).
Finished requests tag their leaf, aborted ones (released with or without a checkpoint) do not,
and under eviction pressure the tagged leaves go last. After every step the sessions' tagged
nodes (as token paths, per session) must be the same too.
"""

from __future__ import annotations

import zlib
from array import array

import pytest

from conftest import core_of
from test_sglang_backend import (POLICIES, Replay, Side, Workload,
                                 report_calls)

from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.sampling.sampling_params import SamplingParams

from radixcache.integrations.sglang import backend as backend_module

#: Random scheduler steps per (core, page size, policy) sequence.
SESSION_STEPS = 1000
#: Scheduler-level calls into our cache, per core (summed in the closing line).
CALLS: dict = {}


class SessionWorkload(Workload):
    """Conversations over shared system prompts, three in four of them a session."""

    def __init__(self, rng, page_size: int) -> None:
        super().__init__(rng, page_size)
        self.sessions: list = []  # every session id handed out (open, closed, reopened)

    def new_request(self) -> dict:
        request = super().new_request()
        conversation = request["conversation"]
        if "session" not in conversation:
            session = None
            if self.rng.random() < 0.75:
                session = f"s{len(self.sessions)}"
                self.sessions.append(session)
            conversation["session"] = session
        request["session"] = conversation["session"]
        return request


class SessionSide(Side):
    """A side whose requests may belong to sessions, with the scheduler's session calls."""

    def admit(self, rid: str, prompt, output, priority, extra_key, salt, chunk: int,
              session: str | None = None) -> tuple:
        generation = None
        if rid not in self.reqs and session is not None:
            req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=len(output)),
                      priority=priority, extra_key=extra_key, cache_salt=salt,
                      session_id=session)
            req.planned_output = output
            # The scheduler, for a request of a radix-native session.
            generation = req.session_generation = self.cache.ensure_session_generation(session)
            self.reqs[rid] = req
        return super().admit(rid, prompt, output, priority, extra_key, salt,
                             chunk) + (generation,)

    def abort(self, rid: str) -> tuple:
        """A client abort: half of them (by request id) while running, released with a
        checkpoint as the scheduler releases an aborted running request (no tag either way)."""
        req = self.reqs[rid]
        if zlib.crc32(rid.encode()) % 2:
            return super().abort(rid)
        req.finished_reason = FINISH_ABORT("client abort")
        release_kv_cache(req, self.cache, checkpoint=True)
        del self.reqs[rid]
        return ("aborted",)

    def open_session(self, session: str) -> tuple:
        return ("opened", self.cache.open_radix_session(session))

    def close_session(self, session: str) -> tuple:
        return ("closed", self.cache.release_radix_session(session))


def _sglang_path(node) -> tuple:
    tokens = []
    namespace = (node.key.extra_key, node.key.cache_salt)
    while node.parent is not None:
        tokens[:0] = list(node.key.token_ids)
        node = node.parent
    return namespace, tuple(tokens)


def _our_path(node) -> tuple:
    namespace = node.extra_key if isinstance(node.extra_key, tuple) else (node.extra_key, None)
    tokens = []
    while node.parent is not None:
        tokens[:0] = node.key.tolist()
        node = node.parent
    return namespace, tuple(tokens)


def our_tags(backend) -> dict:
    """Each session's tagged nodes, read from the tree core (sessions that tag none left
    out)."""
    core = core_of(backend._cache)
    nodes = {session_id: core.tagged_nodes(handle)
             for session_id, handle in backend._sessions._handles.items()}
    return {session_id: tagged for session_id, tagged in nodes.items() if tagged}


class SessionReplay(Replay):
    CONFIG = {"sessions": True}
    SIDE = SessionSide
    WORKLOAD = SessionWorkload

    def server_args(self, page_size: int) -> dict:
        return dict(enable_session_radix_cache=True)

    def admit_args(self, request: dict, chunk: int) -> tuple:
        return super().admit_args(request, chunk) + (request["session"],)

    def tags(self) -> tuple:
        """Each side's tagged nodes, as {session: sorted token paths}."""
        full = self.sgl.cache._cache.components[ComponentType.FULL]
        theirs = {session: sorted(map(_sglang_path, nodes))
                  for session, nodes in full._session_leaves.items() if nodes}
        ours = {session: sorted(map(_our_path, nodes))
                for session, nodes in our_tags(self.ours.cache._cache).items()}
        return theirs, ours

    def compare(self, what: str) -> None:
        super().compare(what)
        theirs, ours = self.tags()
        assert theirs == ours, f"session tags differ after step {self.steps} ({what})"
        self.counts["tags"] = self.counts.get("tags", 0) + sum(map(len, ours.values()))

    def step(self) -> None:
        sessions = self.work.sessions
        roll = self.rng.random()
        if roll >= 0.05 or not sessions:
            return super().step()
        self.steps += 1
        session = self.rng.choice(sessions)
        what = self.both("close_session" if roll < 0.03 else "open_session", session)
        self.compare(what[0])


@pytest.fixture
def tagged_evictions(monkeypatch) -> list:
    """Counts our evictions of tagged leaves (the tree core moves their tags up, or drops
    them): the nodes tagged before an eviction that it took."""
    seen = []
    evict = backend_module.RadixcacheBackend._evict_victims

    def counting(self, num_tokens):
        tagged = [node for nodes in our_tags(self).values() for node in nodes]
        try:
            return evict(self, num_tokens)
        finally:
            seen.extend(node for node in tagged if node.evicted)

    monkeypatch.setattr(backend_module.RadixcacheBackend, "_evict_victims", counting)
    return seen


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_sessions_same_as_sglang_default_cache(backend_core, monkeypatch, tagged_evictions,
                                               page_size, policy):
    replay = SessionReplay(backend_core, page_size, policy,
                           seed=zlib.crc32(f"sessions-{page_size}-{policy}".encode()),
                           monkeypatch=monkeypatch)
    try:
        assert type(replay.sgl.cache._cache.tree_core).__name__ == "UnifiedTreeCore"
        assert replay.ours.cache.enable_session_radix_cache
        for _ in range(SESSION_STEPS):
            replay.step()
    finally:
        replay.close()
    counts = replay.counts
    # Sessions opened, reopened and closed; requests finished (tagging), aborted, retracted;
    # evictions of tagged leaves and of untagged ones.
    for kind in ("opened", "closed", "finished", "aborted", "retracted", "chunk", "tags",
                 "events"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    assert len(tagged_evictions) > 5, len(tagged_evictions)
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


class UntaggedSessionReplay(SessionReplay):
    """Requests that name a session, and the session calls, on caches built without the
    session cache: nothing is tagged, and the KV events still name each request's session."""

    CONFIG: dict = {}

    def server_args(self, page_size: int) -> dict:
        return {}


def test_events_name_the_session_without_the_session_cache(backend_core, monkeypatch):
    replay = UntaggedSessionReplay(backend_core, 16, "lru", seed=zlib.crc32(b"untagged"),
                                   monkeypatch=monkeypatch)
    try:
        assert not replay.ours.cache.enable_session_radix_cache
        for _ in range(SESSION_STEPS // 4):
            replay.step()
    finally:
        replay.close()
    counts = replay.counts
    assert counts.get("finished", 0) > 5 and counts.get("events", 0) > 5, counts
    assert not counts.get("tags"), counts
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


def teardown_module(module) -> None:
    report_calls("test_sglang_backend_sessions", CALLS)

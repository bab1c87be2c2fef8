"""The radixcache backend inside SGLang 0.5.23 serves hybrid models as SGLang's default cache
does: sliding-window (SWA) models through SGLang's ``SWAKVPool`` and
``SWATokenToKVPoolAllocator``, Mamba / linear-attention models through its
``HybridReqToTokenPool``, ``MambaPool`` and ``HybridLinearKVPool``.

The harness is tests/integrations/test_sglang_backend.py's (its docstring says how both
caches are built and compared): SGLang's own registry and factory, real CPU pools (here the
SWA pools: a full-attention pool and a window pool half its size, both allocators with
``need_sort=True``), real ``Req`` objects, SGLang's scheduler functions, compared after every
step -- match lengths and SWA branching points, every live request row, the free slots of
both pools and the full-to-window slot mapping, every size SGLang reports (full and SWA),
and the KV events. Decoding requests slide their windows as the scheduler's
``maybe_evict_swa`` does (``evict_sliding_windows``, ``release_swa_prefix_lock``).

For Mamba the comparison adds every request's state slot, the cached state its match copies
(copy on write) and its branching point, and the Mamba allocator's free list in order (it is
first in, first out: the order a cache frees states in decides which slot the next request
gets). Page 1 runs without the extra buffer; page 16 with it (``--mamba-extra-buffer``: two
ping-pong track slots per request, the forward pass's tracking simulated at the checkpoint
grid's boundaries, the tracked state donated at a checkpoint).

The one rule forgiven on SGLang's side is the plain harness's (a split's unused lower half
keeps its time); a split of a node an insert walks through (SWA's clip at the request's
freed prefix) is no such half, and keeps the call's time on both sides.
"""

from __future__ import annotations

import zlib

import pytest

from test_sglang_backend import POLICIES, POOL_TOKENS, Replay

from radixcache.integrations.sglang.mamba import RadixcacheMambaBackend
from radixcache.integrations.sglang.swa import RadixcacheSWABackend

#: Sliding windows (tokens) by page size: a few pages, short against the requests.
WINDOWS = {1: 12, 16: 32}
#: Random scheduler steps per (core, page size, policy) sequence (~10^4 calls each).
SWA_STEPS = 1500
MAMBA_STEPS = 1500
#: Scheduler-level calls into our cache, per (component, core) (summed in the closing line).
CALLS: dict = {}


def _counting_swa_paths(monkeypatch, seen: dict) -> None:
    """Count, on our side, the SWA paths a sequence takes: recovered tombstones (locked or
    not), window slots freed alone (tombstones made), early window releases."""
    insert, evict, release = (RadixcacheSWABackend._insert_window, RadixcacheSWABackend._evict,
                              RadixcacheSWABackend.release_swa)

    def counted_insert(self, *args, **kwargs):
        result = insert(self, *args, **kwargs)
        for *_range, locked in self._core.last_recovered:
            key = "recovered locked" if locked else "recovered"
            seen[key] = seen.get(key, 0) + 1
        return result

    def counted_evict(self, num_tokens, swa_tokens=0):
        freed = evict(self, num_tokens, swa_tokens)
        if swa_tokens > 0 and freed[1]:
            seen["window evictions"] = seen.get("window evictions", 0) + 1
        return freed

    def counted_release(self, lock):
        if lock is not None and not lock.swa_released:
            seen["early releases"] = seen.get("early releases", 0) + 1
        return release(self, lock)

    monkeypatch.setattr(RadixcacheSWABackend, "_insert_window", counted_insert)
    monkeypatch.setattr(RadixcacheSWABackend, "_evict", counted_evict)
    monkeypatch.setattr(RadixcacheSWABackend, "release_swa", counted_release)


def _run(core: str, page_size: int, policy: str, monkeypatch, steps: int, seed: str,
         seen: dict) -> Replay:
    _counting_swa_paths(monkeypatch, seen)
    replay = Replay(core, page_size, policy, seed=zlib.crc32(seed.encode()),
                    monkeypatch=monkeypatch, window=WINDOWS[page_size])
    try:
        for _ in range(steps):
            replay.step()
            cache = replay.ours.cache._cache
            if cache.swa_protected_size():
                seen["swa locked"] = seen.get("swa locked", 0) + 1
            branching = [r for r in replay.ours.reqs.values() if r.swa_branching_seqlen]
            seen["branching"] = seen.get("branching", 0) + len(branching)
    finally:
        replay.close()
    CALLS["swa", core] = CALLS.get(("swa", core), 0) + replay.calls
    return replay


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_swa_same_as_sglang_default_cache(backend_core, monkeypatch, page_size,
                                          policy):
    seen: dict = {}
    replay = _run(backend_core, page_size, policy, monkeypatch, SWA_STEPS,
                  f"swa-{page_size}-{policy}", seen)
    counts = replay.counts
    for kind in ("chunk", "finished", "aborted", "retracted", "prefilled", "events"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    # The SWA paths were taken: tombstones made and recovered, windows released early.
    for kind in ("recovered", "window evictions", "early releases", "branching", "swa locked"):
        assert seen.get(kind, 0) > 0, (kind, seen)
    assert replay.ours.allocator.swa_available_size() < POOL_TOKENS[page_size] // 2


def _counting_mamba_paths(monkeypatch, seen: dict) -> None:
    """Count, on our side, the Mamba paths a sequence takes: states evicted alone (their
    nodes keep the KV), states freed with their leaves."""
    evict = RadixcacheMambaBackend._evict

    def counted_evict(self, num_tokens, mamba_num=0):
        nodes = self._core.tree.node_count
        freed, states = evict(self, num_tokens, mamba_num)
        removed = nodes - self._core.tree.node_count
        if states > removed:
            seen["states alone"] = seen.get("states alone", 0) + 1
        if removed:
            seen["states with leaves"] = seen.get("states with leaves", 0) + 1
        return freed, states

    monkeypatch.setattr(RadixcacheMambaBackend, "_evict", counted_evict)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_mamba_same_as_sglang_default_cache(backend_core, monkeypatch, page_size,
                                            policy):
    seen: dict = {}
    _counting_mamba_paths(monkeypatch, seen)
    replay = Replay(backend_core, page_size, policy,
                    seed=zlib.crc32(f"mamba-{page_size}-{policy}".encode()),
                    monkeypatch=monkeypatch, state=True)
    try:
        for _ in range(MAMBA_STEPS):
            replay.step()
            cache = replay.ours.cache._cache
            if cache.mamba_protected_size():
                seen["state locked"] = seen.get("state locked", 0) + 1
            for req in replay.ours.reqs.values():
                if req.kv.mamba_cow_src_index is not None:
                    seen["copied"] = seen.get("copied", 0) + 1
                if req.mamba_branching_seqlen:
                    seen["branching"] = seen.get("branching", 0) + 1
    finally:
        replay.close()
    CALLS["mamba", backend_core] = CALLS.get(("mamba", backend_core), 0) + replay.calls
    counts = replay.counts
    for kind in ("chunk", "finished", "aborted", "retracted", "prefilled", "events"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    # The Mamba paths were taken: states evicted alone and with their leaves, locked, copied
    # at a match, branching points. (Page 1's SLRU sequence evicts no state alone;
    # the other thirteen sequences do.)
    kinds = ["states alone", "states with leaves", "state locked", "copied", "branching"]
    if (page_size, policy) == (1, "slru"):
        kinds.remove("states alone")
    for kind in kinds:
        assert seen.get(kind, 0) > 0, (kind, seen)


@pytest.mark.parametrize("page_size, policy", [(16, "lru"), (16, "lfu"), (1, "lru")],
                         ids=["page16-lru", "page16-lfu", "page1-lru"])
def test_mamba_same_as_sglang_default_cache_without_events(backend_core, monkeypatch,
                                                           page_size, policy):
    """Events off: at page 16 the core hands over an eviction's page ids and states in one
    array each, and a checkpoint's duplicated pages (another code path), freed as SGLang's
    per-node frees free them; page 1 (SGLang's token allocator) frees the records."""
    seen: dict = {}
    _counting_mamba_paths(monkeypatch, seen)
    free_pages = RadixcacheMambaBackend._free_pages

    def counted_free_pages(self, page_ids):
        seen["page ids freed"] = seen.get("page ids freed", 0) + 1
        return free_pages(self, page_ids)

    monkeypatch.setattr(RadixcacheMambaBackend, "_free_pages", counted_free_pages)
    replay = Replay(backend_core, page_size, policy,
                    seed=zlib.crc32((f"mamba-quiet-{policy}" if page_size == 16
                                     else f"mamba-quiet-{page_size}-{policy}").encode()),
                    monkeypatch=monkeypatch, state=True, events=False)
    try:
        for _ in range(MAMBA_STEPS // 2):
            replay.step()
    finally:
        replay.close()
    CALLS["mamba", backend_core] = CALLS.get(("mamba", backend_core), 0) + replay.calls
    counts = replay.counts
    assert counts.get("finished", 0) > 5 and not counts.get("events"), counts
    kinds = ["states alone", "states with leaves", "page ids freed"]
    if page_size == 1:  # (its sequence evicts no state alone)
        kinds = ["states with leaves"]
        assert "page ids freed" not in seen, seen
    for kind in kinds:
        assert seen.get(kind, 0) > 0, (kind, seen)


def teardown_module(module) -> None:
    if CALLS:
        print("\ntest_sglang_hybrid: scheduler-level calls compared with SGLang per component "
              "and core: " + ", ".join(f"{kind} on {core}: {calls}"
                                       for (kind, core), calls in sorted(CALLS.items())))


def test_mamba_match_result_built_as_sglang_builds_it():
    """The Mamba cache builds its matches' ``MatchResult`` as the tuple it is: every field
    equals the keyword call's, SGLang's defaults included."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    from radixcache.integrations.sglang import mamba

    assert mamba._MATCH_LAYOUT is not None  # SGLang 0.5.23's layout: the fast build is used
    node = object()
    for branching in (None, 48):
        built = mamba._match_result(32, node, branching, 80)
        assert type(built) is MatchResult
        assert built._asdict() == MatchResult(
            device_prefix_len=32, last_device_node=node, last_host_node=node,
            best_match_node=node, mamba_branching_seqlen=branching,
            full_kv_hit_length=80)._asdict()

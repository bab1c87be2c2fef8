"""The serving loop with a host tier against the one-tier loop at the same device capacity.

Per round, untimed setup first replays the workload through the one-tier loop
(``serve(RadixCache(), ...)``), then the timed call replays it through a cache with a host
tier of ``HOST_RATIO`` times the device capacity (``serve(..., host_capacity=...)``): the two
loops alternate, so both see the same machine load. Two numbers per row:

- the timing table: the WHOLE tiered ``serve()`` call;
- ``extra_info`` and the end-of-run summary: the time inside cache calls only
  (``ServeResult.seconds``, best round) of both loops and their ratio, tiered / one-tier. The
  tiered loop's cache calls include its host work: write-through copies, host evictions,
  backups during device eviction and load-backs. The target is a ratio within 1.3.
- the split (end-of-run summary, ``extra_info["split"]``): after the timed rounds, both loops
  replay again (``SPLIT_ROUNDS`` times, alternating) through a proxy that times each cache
  call by name (best round per name, microseconds per request) and the engine's ``backup``
  callbacks apart from the ``evict``/``write_through`` calls that run them. ``shared ratio``
  counts only the calls both loops make (``match_prefix``, ``insert``, ``evict`` without its
  backups, locks, sizes); the rest is work only the tiered loop does (``load_back``,
  ``evict_host``, ``write_through``, backups): what one tier recomputes outside the cache,
  the tiered loop keeps and loads back. The proxy adds a small cost per call to both loops.

Workloads: ``synthetic_chat`` (300 conversations, pool of 65536 tokens, pages 1 and 16) and
the first ``CONVERSATION_LIMIT`` requests of the Mooncake conversation trace (pool of
``CONVERSATION_CAPACITY`` tokens, page 16; skipped without the file). Cores without a host tier
in this build are skipped.

Run::

    python -m pytest benchmarks/bench_host_serving.py --benchmark-group-by=group \\
        --benchmark-columns=min,mean,rounds
"""

from __future__ import annotations

import collections
import time

import pytest

from _cases import FULL, benchmark_min_seconds, chat_requests, trace_file
from radixcache import RadixCache
from radixcache.traces import read_trace
from radixcache.workloads import Request

#: Host slots per device slot (SGLang's hierarchical cache defaults to 2; 4 gives the host
#: tier more hits to load back).
HOST_RATIO = 4
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
ROUNDS = 5
SPLIT_ROUNDS = 3
#: Calls only the tiered loop makes (``backup``: the engine's callbacks inside the calls).
HOST_ONLY_CALLS = ("load_back", "evict_host", "write_through", "host_size", "backup")
CONVERSATION_LIMIT = 3000
CONVERSATION_CAPACITY = 1_000_000
_CONVERSATION, _CONVERSATION_MISSING = trace_file("conversation")


@pytest.fixture(scope="module")
def conversation():
    """The first requests of the Mooncake conversation trace (skipped without it)."""
    if _CONVERSATION is None:
        pytest.skip(_CONVERSATION_MISSING)
    return [Request(r.prompt.copy(), r.output_len)
            for r in read_trace(_CONVERSATION, limit=CONVERSATION_LIMIT)]


def _host_cache(core, page_size, write_policy):
    try:
        return RadixCache(page_size=page_size, core=core, host_tier=True,
                          write_policy=write_policy)
    except TypeError as exc:  # a compiled core built before it had the host tier
        if core != "c":
            raise
        pytest.skip(f"the compiled core of this build has no host tier ({exc})")


class _TimedCache:
    """A cache proxy timing each method call by name into ``totals`` (seconds); a
    ``backup`` callback handed to a call is timed apart (as ``"backup"``) and left out of
    that call's time."""

    def __init__(self, cache, totals):
        self._cache = cache
        self._totals = totals

    def __getattr__(self, name):
        attr = getattr(self._cache, name)
        if not callable(attr):
            return attr
        totals, clock = self._totals, time.perf_counter
        inner = [0.0]

        def timed_backup(backup):
            def run(device_indices):
                start = clock()
                try:
                    return backup(device_indices)
                finally:
                    spent = clock() - start
                    inner[0] += spent
                    totals["backup"] += spent
            return run

        def call(*args, **kwargs):
            if kwargs.get("backup") is not None:
                kwargs["backup"] = timed_backup(kwargs["backup"])
            if name == "write_through" and args:
                args = (timed_backup(args[0]),) + args[1:]
            inner[0] = 0.0
            start = clock()
            try:
                return attr(*args, **kwargs)
            finally:
                totals[name] += clock() - start - inner[0]
        return call


def _split(core, page_size, write_policy, requests, capacity):
    """Best-round microseconds per request by call name, one tier and tiered."""
    from radixcache.workloads import serve

    best = ({}, {})
    for _ in range(SPLIT_ROUNDS):
        for which in (0, 1):
            totals = collections.Counter()
            if which:
                cache = _TimedCache(_host_cache(core, page_size, write_policy), totals)
                serve(cache, requests, capacity, host_capacity=HOST_RATIO * capacity)
            else:
                cache = _TimedCache(RadixCache(page_size=page_size, core=core), totals)
                serve(cache, requests, capacity)
            for name, seconds in totals.items():
                us = seconds / len(requests) * 1e6
                best[which][name] = min(best[which].get(name, us), us)
    return best


def _split_text(plain, tiered):
    shared_plain = sum(v for k, v in plain.items() if k not in HOST_ONLY_CALLS)
    shared_tiered = sum(v for k, v in tiered.items() if k not in HOST_ONLY_CALLS)
    host_only = sum(v for k, v in tiered.items() if k in HOST_ONLY_CALLS)
    names = sorted(set(plain) | set(tiered), key=lambda k: -tiered.get(k, plain.get(k, 0)))
    calls = ", ".join(f"{k} {plain.get(k, 0):.1f}/{tiered.get(k, 0):.1f}" for k in names
                      if max(plain.get(k, 0), tiered.get(k, 0)) >= 0.05)
    shared_ratio = shared_tiered / shared_plain if shared_plain else 0.0
    whole_ratio = (shared_tiered + host_only) / shared_plain if shared_plain else 0.0
    text = (f"split, us/request one tier/tiered: {calls}; shared calls {shared_plain:.1f}/"
            f"{shared_tiered:.1f} (shared ratio {shared_ratio:.2f}), tiered-only "
            f"{host_only:.1f} (whole ratio {whole_ratio:.2f})")
    return text, shared_ratio


def _run_pair(benchmark, note, core, page_size, write_policy, requests, capacity):
    from radixcache.workloads import serve  # keep collection cheap

    _host_cache(core, page_size, write_policy)  # skip early where there is no host tier
    host_capacity = HOST_RATIO * capacity
    plain, tiered = [], []

    def setup():
        # The one-tier loop runs here, untimed by pytest-benchmark, between timed rounds.
        plain.append(serve(RadixCache(page_size=page_size, core=core), requests, capacity))
        return (_host_cache(core, page_size, write_policy),), {}

    def timed(cache):
        tiered.append(serve(cache, requests, capacity, host_capacity=host_capacity))

    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, iterations=1)
    first = tiered[0]
    assert all(r.cached_tokens == first.cached_tokens for r in tiered)  # deterministic
    assert first.rejected == 0 and first.cached_tokens >= plain[0].cached_tokens
    best_plain = min(r.seconds for r in plain)
    best_tiered = min(r.seconds for r in tiered)
    ratio = best_tiered / best_plain
    benchmark.extra_info.update(
        cache_seconds_min=best_tiered, one_tier_cache_seconds_min=best_plain,
        ratio=ratio, hit_rate=first.hit_rate, one_tier_hit_rate=plain[0].hit_rate,
        host_hit_rate=first.host_hit_rate, loaded_tokens=first.loaded_tokens,
        backed_up_tokens=first.backed_up_tokens, capacity=capacity,
        host_capacity=host_capacity)
    split_plain, split_tiered = _split(core, page_size, write_policy, requests, capacity)
    split_text, shared_ratio = _split_text(split_plain, split_tiered)
    benchmark.extra_info.update(split={"one_tier_us": split_plain, "tiered_us": split_tiered},
                                shared_ratio=shared_ratio)
    whole = benchmark_min_seconds(benchmark)
    whole_text = "n/a" if whole is None else f"{whole * 1e3:.1f} ms"
    note(f"cache calls, best of {ROUNDS}: one tier {best_plain * 1e3:.1f} ms, host tier "
         f"{best_tiered * 1e3:.1f} ms: ratio {ratio:.2f} (target <= 1.3); hit rate "
         f"{100 * plain[0].hit_rate:.1f}% -> {100 * first.hit_rate:.1f}% (host "
         f"{100 * first.host_hit_rate:.1f}%); whole tiered serve() min {whole_text}; "
         f"{split_text}")


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_host_tier_chat(benchmark, note, core, page_size, write_policy):
    benchmark.group = (f"serving loop with a host tier ({HOST_RATIO}x the device), synthetic "
                       f"chat, page_size={page_size} (whole tiered serve())")
    _run_pair(benchmark, note, core, page_size, write_policy, chat_requests(FULL),
              FULL.chat_capacity)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_host_tier_conversation_trace(benchmark, note, core, write_policy, conversation):
    benchmark.group = (f"serving loop with a host tier ({HOST_RATIO}x the device), Mooncake "
                       f"conversation trace, first {CONVERSATION_LIMIT} requests, page_size=16 "
                       "(whole tiered serve())")
    _run_pair(benchmark, note, core, 16, write_policy, conversation, CONVERSATION_CAPACITY)

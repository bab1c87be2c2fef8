"""Storage hit queries answer as SGLang 0.5.23's: the storage differential of
``test_sglang_hicache_backup.py`` (SGLang's default cache against ``--radix-cache-backend
radixcache``, both with SGLang's own host pools and controller and SGLang's ``file`` storage
backend attached, each in its own directory; compared after every step: match lengths,
request rows, device and host free slots, sizes, queued transfers, KV events per medium, host
locks, storage hashes, storage writes and files) with one more scheduler-level step: a new
request's probe of storage past its device and host match.

The probe is what the scheduler's ``_prefetch_kvcache`` asks before a prefetch: the match's
host node, and where that node is the root or holds a host copy, the storage hit length of
the tokens past the match (``query_storage_hit_length``, keyed from the node's last storage
hash and, with pages of 16, the keys above it). With a host pool half the device pool's
size, host evictions push backed-up prefixes out of the host tier, so that later requests
find them in storage only. The prefetch threshold is two pages (three tokens with pages of
one), so that spans of one page are not looked up and the longer ones are.

The stand-in of ``test_sglang_hicache_backup.py`` applies: before each probe both sides wait
until their backup thread has acknowledged every storage write queued (a storage backend
faster than a scheduler step), so that what storage holds does not depend on thread timing.
"""

from __future__ import annotations

import zlib
from array import array

import pytest
from test_sglang_hicache import STEPS, cpu_hicache, run  # noqa: F401 -- a fixture
from test_sglang_hicache_backup import BackupReplay

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


def storage_anchor(side, prompt: list, extra_key, salt) -> tuple:
    """What SGLang's ``_prefetch_kvcache`` reads before asking storage about a request for
    ``prompt``: (where its device and host match ends, the match's host node or None when it
    is neither the root nor backed up, the storage keys above that node where the backend
    asks for them)."""
    side.settle()
    real, cache = side.real, side.cache
    key = RadixKey(array("q", prompt), extra_key, cache_salt=salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    anchor = match.last_host_node
    start = match.device_prefix_len + match.host_hit_length
    if isinstance(real, UnifiedRadixCache):
        real.tree_core.backfill_missing_hash_values()  # (what its attach does)
    if not (cache.is_root(anchor) or cache.is_backuped(anchor)):
        return start, None, None
    prefix_keys = (cache.get_prefix_hash_values(anchor)
                   if real.hicache_storage_pass_prefix_keys else None)
    return start, anchor, prefix_keys


def probe(side, prompt: list, extra_key, salt) -> tuple:
    """(host and device match, the anchor root or backed up, storage hit length or the
    error the query raised) of a request for ``prompt``, as the scheduler asks them."""
    start, anchor, prefix_keys = storage_anchor(side, prompt, extra_key, salt)
    if anchor is None:
        return (start, "not backed up")
    try:
        hits = side.real.query_storage_hit_length(
            anchor, prompt[start:], side.cache.get_last_hash_value(anchor), prefix_keys,
            extra_key=extra_key, cache_salt=salt)
    except Exception as exc:  # (compared between the sides)
        hits = f"{type(exc).__name__}: {exc}"
    return (start, hits)


class ProbeReplay(BackupReplay):
    """``BackupReplay`` with storage probes of requests among its steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admitted: list = []  # (prompt, extra key, salt) of the requests admitted

    def admit_args(self, request: dict, chunk) -> tuple:
        self.admitted.append((request["prompt"], request["extra_key"], request["salt"]))
        del self.admitted[:-24]
        return super().admit_args(request, chunk)

    def step(self) -> None:
        if self.rng.random() < 0.25:
            self.steps += 1
            # Most probes ask again for the prompt of an admitted request (one whose pages
            # evictions may have pushed out to storage only), the others for a new one.
            past = self.admitted
            if self.rng.random() < 0.3:  # device evictions (write_back: host copies first)
                self.both("evict", self.rng.randrange(8, 32) * self.page_size)
                self.compare("evict")
            if past and self.rng.random() < 0.7:
                args = past[self.rng.randrange(len(past))]
            else:
                request = self.work.new_request()
                args = (request["prompt"], request["extra_key"], request["salt"])
            a, b = probe(self.sgl, *args), probe(self.ours, *args)
            assert a == b, f"step {self.steps} probe: SGLang {a} != radixcache {b}"
            hits = a[1]
            kind = ("probe raised" if isinstance(hits, str) and ":" in hits
                    else "probe skipped" if isinstance(hits, str)
                    else "storage hit" if hits else "storage miss")
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.compare("probed")
            return
        super().step()


def _replay(core, page_size, write_policy, monkeypatch, tmp_path, name, fail=None):
    seed = zlib.crc32(f"{name}-{write_policy}-{page_size}".encode())
    return ProbeReplay(core, page_size, write_policy, seed, monkeypatch, tmp_path,
                       fail_keys=fail, host_ratio=0.5,
                       prefetch_threshold=3 if page_size == 1 else 2 * page_size)


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", ("write_back", "write_through"))
@pytest.mark.usefixtures("cpu_hicache")
def test_storage_hit_queries_same_as_sglang(backend_core, monkeypatch, tmp_path, write_policy,
                                            page_size):
    replay = _replay(backend_core, page_size, write_policy, monkeypatch, tmp_path, "probe")
    run(replay, STEPS // 8)
    counts = replay.counts
    assert counts.get("storage hit", 0) > 3 and counts.get("storage miss", 0) > 3, str(counts)
    assert counts.get("finished", 0) > 5, counts


def _failing_queries(replay):
    """The storage backend's ``batch_exists``, failing for some keys (the first key
    decides, the same on both sides): it answers no hit for one, raises for another."""

    def wrap(batch_exists):
        def maybe_fail(keys, *args, **kwargs):
            verdict = zlib.crc32(keys[0].encode()) % 3
            if verdict == 0:
                return 0
            if verdict == 1:
                raise OSError("injected storage query failure")
            return batch_exists(keys, *args, **kwargs)
        return maybe_fail
    for side in (replay.sgl, replay.ours):
        backend = side.real.cache_controller.storage_backend
        replay.monkeypatch.setattr(backend, "batch_exists", wrap(backend.batch_exists))


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.usefixtures("cpu_hicache")
def test_failed_storage_queries_change_nothing(backend_core, monkeypatch, tmp_path, page_size):
    """Hit queries whose ``batch_exists`` answers no hit or raises: both sides alike (the
    error propagates from both), and the comparison after each probe finds every host slot,
    host lock and storage write as SGLang's."""
    replay = _replay(backend_core, page_size, "write_through", monkeypatch, tmp_path,
                     "probe-faults")
    replay.monkeypatch = monkeypatch
    _failing_queries(replay)
    try:
        for _ in range(STEPS // 16):
            replay.step()
        counts = replay.counts
        assert counts.get("probe raised", 0) > 2, counts
        assert counts.get("storage miss", 0) > 2, counts
    finally:
        replay.close()

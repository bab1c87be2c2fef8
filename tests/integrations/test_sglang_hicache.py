"""The radixcache backend serves SGLang 0.5.23's hierarchical cache deciding as SGLang does.

``--enable-hierarchical-cache`` on both sides: SGLang's default cache (``UnifiedRadixCache``
with HiCache, its Python TreeCore) and ``--radix-cache-backend radixcache``
(``HiCacheBackend``), each built through SGLang's registry and factory path with its own real
pools: a ``ReqToTokenPool``, a real token-to-KV allocator (``need_sort=True``) over a real
``MHATokenToKVPool`` of two layers, and the host pool group and ``HybridCacheController``
SGLang's assembler builds for it (``MHATokenToKVPoolHost``, ``layer_first``, the ``direct``
I/O backend). The harness of ``test_sglang_backend.py`` drives both with one random
scheduler-level sequence through SGLang's own functions, plus the HiCache steps the scheduler
takes: the match's host hit, ``init_load_back`` inside the admission's locks (SGLang's
``PrefillAdder._lock_node``, whose host-lock branch runs for SGLang's own class only),
``ready_to_load_host_cache`` for each new batch, ``flush_pending_backups`` after each batch
and ``check_hicache_events`` at the start of a step. After every step both must show the same
match lengths (device and host), request rows, device and host free slots (in the host
pool's order: it hands slots out first in, first out), sizes, the controller's queued and
unacknowledged transfers, KV events (per medium) -- and every live request row must read the
KV its tokens were given (the copies between device and host are SGLang's own).

Stand-ins, each for a piece that needs a GPU, the same for both caches (``cpu_hicache``):
``pool_host.common._cuda_host_register`` (pinning registration calls CUDA) is a no-op;
``torch.cpu.Stream.synchronize`` (the transfer engine calls it when a copy raises, and CPU
streams lack it) is a no-op; ``pool_host.mha.transfer_kv_direct`` (a ``sgl_kernel`` CUDA
kernel) is torch indexing, layer by layer. Everything else -- host pools, controller, the
ack events (CPU events are complete when recorded: a step drains the controller's work
deterministically), the layer-transfer counter -- is SGLang's.

The deliberate difference of docs/sglang.md (the lower half of a split keeps its access time)
is applied to SGLang's side as in ``test_sglang_backend.py``.
"""

from __future__ import annotations

import contextlib
import os
import random
import types
import zlib

import pytest
import torch

from test_sglang_backend import (  # the shared harness (skips the module without SGLang)
    Replay,
    Side,
    apply_split_rule,
    build_side,
    count_result,
    diverges,
)

from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache import registry
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, InitLoadBackParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import _CONTEXT

from radixcache.integrations.sglang import RadixcacheBackend
from radixcache.integrations.sglang.hicache import HiCacheBackend

#: Random scheduler steps per sequence.
STEPS = int(os.environ.get("RADIXCACHE_HICACHE_STEPS", "2000"))
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
DEVICE_TOKENS = {1: 384, 16: 1024}
#: Host pool sizes relative to the device pool: smaller, equal, larger.
HOST_RATIOS = (0.5, 1.0, 3.0)
LAYERS = 2
CALLS: dict = {}


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``sgl_kernel``'s ``transfer_kv_direct`` (a CUDA kernel) as torch indexing."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


@pytest.fixture
def cpu_hicache(monkeypatch):
    """The three stand-ins SGLang's HiCache needs on a CPU (see the module docstring)."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    monkeypatch.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    monkeypatch.setattr(mha, "transfer_kv_direct", _transfer_kv_direct, raising=False)


def hicache_args(backend, write_policy: str, host_ratio: float):
    """SGLang's test install of the server arguments, with HiCache on."""
    return _CONTEXT.override_server_args(
        radix_cache_backend=backend, enable_hierarchical_cache=True,
        hicache_write_policy=write_policy, hicache_io_backend="direct",
        hicache_mem_layout="layer_first", hicache_ratio=host_ratio, hicache_size=0)


class Worker:
    """The TP worker's one HiCache call (``register_hicache_layer_transfer_counter``)."""

    def __init__(self) -> None:
        self.counters: list = []

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.counters.append(counter)


def build_hicache_side(backend, page_size: int, policy: str, write_policy: str,
                       host_ratio: float, events: bool = True, device_tokens=None,
                       tp_group=None):
    """``build_side`` with HiCache on (``LAYERS`` layers, SGLang's host pool of
    ``host_ratio`` times the device pool), checking that the layer-transfer counter was
    registered with the KV pool and the TP worker: (cache, allocator, rows, KV pool)."""
    worker = Worker()
    built = build_side(backend, page_size, policy, None, events,
                       pool_tokens=device_tokens or DEVICE_TOKENS[page_size], layers=LAYERS,
                       override=hicache_args(backend, write_policy, host_ratio),
                       worker=worker, tp_group=tp_group)
    cache, kv_pool = built[0], built[1].get_kvcache()
    assert worker.counters == [cache.cache_controller.layer_done_counter]
    assert kv_pool.layer_transfer_counter is cache.cache_controller.layer_done_counter
    return built + (kv_pool,)


class HiSide(Side):
    """A ``Side`` with the scheduler's HiCache steps and KV contents written per token."""

    def __init__(self, cache, allocator, rows, kv_pool) -> None:
        super().__init__(cache, allocator, rows)
        self.kv_pool = kv_pool
        self.real = cache
        self.host = cache.cache_controller.mem_pool_host.anchor_entry.host_pool

    def _lock_node(self, node, lock_host=False):
        """SGLang's ``PrefillAdder._lock_node`` itself, on this side's cache."""
        return PrefillAdder._lock_node(types.SimpleNamespace(tree_cache=self.real), node,
                                       lock_host=lock_host)

    def admit(self, rid, prompt, output, priority, extra_key, salt, chunk, others=(),
              mem_quota=None):
        """``Side.admit`` with the host hit loaded back; ``others``: prompts of other waiting
        requests the scheduler matches between this request's match and its admission."""
        req = self.matched(rid, prompt, output, priority, extra_key, salt)
        matched = (req.prefix_len, req.host_hit_length)
        keys = self.storage_keys(req)
        if others:
            self.order([(tokens, None) for tokens in others])
        req.host_loaded_length = 0
        # PrefillAdder.add_one_req: the match pinned while admission decides; the host
        # match pinned around the load for SGLang's own class only.
        with self._lock_node(req.last_node):
            if req.needs_host_load_back():
                own = isinstance(self.real, UnifiedRadixCache)
                with (self._lock_node(req.best_match_node, lock_host=True) if own
                      else contextlib.nullcontext()):
                    loaded = self.cache.init_load_back(InitLoadBackParams(
                        best_match_node=req.best_match_node,
                        host_hit_length=req.host_hit_length, req=req, mem_quota=mem_quota))
                req.host_loaded_length, req.last_node = loaded
                req.prefix_len += req.host_loaded_length
                if self.cache.load_back_is_cache_owned():
                    req.kv.cache_protected_len = req.prefix_len
            req.lock = self.cache.lock(req.last_node)
        self.cache.ready_to_load_host_cache()
        start = req.prefix_len
        result = self._extend(req, chunk)
        self._write_kv(req, start, result)
        return matched + (req.host_loaded_length, start) + result + keys

    def storage_keys(self, req) -> tuple:
        """What the scheduler asks before a storage prefetch, of the match's host node and
        of its device node: root or not, backed up or not, its last storage hash, the
        storage hashes above it (SGLang's ``_prefetch_kvcache``)."""
        cache = self.cache
        if isinstance(self.real, UnifiedRadixCache):
            # SGLang's tree hashes its nodes only with a storage backend attached; this is
            # what its attach does (no backend is attached: ours refuses one).
            self.real.tree_core.backfill_missing_hash_values()
        return tuple((cache.is_root(node), cache.is_backuped(node),
                      cache.get_last_hash_value(node), cache.get_prefix_hash_values(node))
                     for node in (req.last_host_node, req.last_node))

    def continue_chunk(self, rid, chunk):
        req = self.reqs[rid]
        start = req.prefix_len
        result = self._extend(req, chunk)
        self._write_kv(req, start, result)
        return result

    def _write_kv(self, req, start: int, result: tuple) -> None:
        """The forward pass's stand-in: each new slot holds its token and position."""
        if result[0] not in ("chunk", "prefilled") or req.rid not in self.reqs:
            return
        end = result[1]
        self._write_positions(req, start, end)

    def _write_positions(self, req, start: int, end: int) -> None:
        if end <= start:
            return
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        slots = self.rows.req_to_token[req.kv.req_pool_idx, start:end].to(torch.int64)
        values = torch.tensor([[tokens[p], p % 1024] for p in range(start, end)],
                              dtype=torch.float16).unsqueeze(1)
        for layer in range(LAYERS):
            self.kv_pool.k_buffer[layer][slots] = values + layer
            self.kv_pool.v_buffer[layer][slots] = values - layer

    def decode(self, rid):
        req = self.reqs[rid]
        position = req.kv.kv_committed_len
        result = super().decode(rid)
        if result[0] == "decoded":
            self._write_positions(req, position, position + 1)
        return result

    def put(self, tokens: list) -> tuple:
        """A sequence cached directly (``insert`` with fresh slots), as a finished request
        leaves it."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.allocator.alloc(len(tokens))
        result = self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        return ("put", result.prefix_len)

    def evict_now(self, num_tokens: int) -> tuple:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return ("evict", self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted,
                self.real.cache_controller.mem_pool_host.available_size())

    def tick(self) -> tuple:
        """The scheduler's step start: ``check_hicache_events``."""
        self.cache.check_hicache_events()
        return ("tick",)

    def flush(self) -> tuple:
        self.cache.flush_pending_backups()
        return ("flush",)

    def host_slots(self) -> list:
        host = self.host
        return host.free_slots.tolist() + [s for part in host.release_slots
                                           for s in part.tolist()]

    def transfers(self) -> tuple:
        cc = self.real.cache_controller

        def ops(queue):
            return [(op.host_indices.tolist(), op.device_indices.tolist(), len(op.node_ids))
                    for op in queue]

        def acks(queue):
            return [(ack.num_tokens, len(ack.node_ids)) for ack in queue]

        return (ops(cc.write_queue), ops(cc.load_queue), acks(cc.ack_write_queue),
                acks(cc.ack_load_queue))

    def check_slots(self) -> None:
        """Every device slot is free, the tree's or one live request's own, exactly once;
        every host slot is free or the tree's, exactly once (no slot lost or freed twice)."""
        allocator, page_size = self.allocator, self.allocator.page_size
        owners: dict = {}

        def own(slots, who):
            for slot in slots:
                assert slot not in owners, f"slot {slot}: {owners[slot]} and {who}"
                owners[slot] = who

        pages = allocator.get_all_free_pages().tolist()
        own([p * page_size + i for p in pages for i in range(page_size)] if page_size > 1
            else pages, "free")
        host_owners: dict = {}
        stack = list(self.real.radix_cache.root_node.children)
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.value is not None:
                own(node.value.tolist(), f"node {node.id}")
            if node.host_value is not None:
                for slot in node.host_value.tolist():
                    assert slot not in host_owners, f"host slot {slot} twice"
                    host_owners[slot] = node.id
        for rid, req in self.reqs.items():
            if req.kv.holds_kv:
                row = self.rows.req_to_token[req.kv.req_pool_idx]
                held = row[req.kv.cache_protected_len:req.kv.kv_allocated_len].tolist()
                # (a paged allocator hands out whole pages: the last one's tail too)
                own(sorted({p // page_size * page_size + i for p in held
                            for i in range(page_size)}), rid)
        for pending in self.real._pending_frees:
            own(pending.tolist(), "pending free")
        self.real.sanity_check()
        assert sorted(self.real.all_values_flatten().tolist()) == sorted(
            slot for slot, who in owners.items() if who.startswith("node"))
        size = allocator.size
        assert sorted(owners) == list(range(page_size, size + page_size)), "device slots lost"
        free_host = self.host_slots()
        assert len(set(free_host)) == len(free_host), "a host slot freed twice"
        assert not set(free_host) & set(host_owners), "a host slot both free and held"
        assert len(free_host) + len(host_owners) == self.host.size, "host slots lost"

    def kv_of(self, req) -> list:
        """What each row position of ``req`` reads from the KV pool (layer 0's key)."""
        if not req.kv.holds_kv:
            return []
        slots = self.rows.req_to_token[req.kv.req_pool_idx, :req.kv.kv_committed_len]
        return self.kv_pool.k_buffer[0][slots.to(torch.int64)][:, 0, :].tolist()


class HiReplay(Replay):
    """``Replay`` over HiCache sides: the scheduler's HiCache steps, the host compared."""

    def __init__(self, core, page_size, policy, write_policy, host_ratio, seed, monkeypatch,
                 split_rule=True, events=True, device_tokens=None) -> None:
        monkeypatch.setattr(RadixcacheBackend, "core", core)
        from radixcache.integrations import sglang as backend_module

        backend_module.register()
        sgl = build_hicache_side(None, page_size, policy, write_policy, host_ratio, events,
                                 device_tokens)
        ours = build_hicache_side("radixcache", page_size, policy, write_policy, host_ratio,
                                  events, device_tokens)
        assert type(sgl[0]).__name__ == "UnifiedRadixCache"
        assert isinstance(ours[0], HiCacheBackend) and ours[0].radix_cache.core_name == core
        if split_rule:
            apply_split_rule(sgl[0])
        self.start(HiSide(*sgl), HiSide(*ours), seed, page_size,
                   hicache_args(None, write_policy, host_ratio))

    def compare(self, what: str) -> None:
        super().compare(what)
        where = f"after step {self.steps} ({what})"
        self.ours.check_slots()
        assert self.sgl.host_slots() == self.ours.host_slots(), f"host slots differ {where}"
        assert self.sgl.transfers() == self.ours.transfers(), f"transfers differ {where}"
        for rid, req in self.sgl.reqs.items():
            mine = self.ours.reqs[rid]
            assert self.sgl.kv_of(req) == self.ours.kv_of(mine), f"KV of {rid} differs {where}"
            assert req.host_hit_length == mine.host_hit_length, where

    def step(self) -> None:
        if self.rng.random() < 0.7:
            self.both("tick")
        super().step()
        if self.rng.random() < 0.8:
            self.both("flush")
            self.compare("flush")


def run(replay, steps: int) -> None:
    """``steps`` random steps of ``replay``, compared after each; then its install goes."""
    try:
        for _ in range(steps):
            replay.step()
    finally:
        replay.close()


@pytest.mark.parametrize("host_ratio", HOST_RATIOS, ids=lambda r: f"host{r}")
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_same_as_sglang_hicache(backend_core, cpu_hicache, monkeypatch, write_policy,
                                page_size, host_ratio):
    seed = zlib.crc32(f"{write_policy}-{page_size}-{host_ratio}".encode())
    replay = HiReplay(backend_core, page_size, "lru", write_policy, host_ratio, seed,
                      monkeypatch)
    run(replay, STEPS)
    counts = replay.counts
    for kind in ("chunk", "finished", "prefilled", "events", "tick"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    key = (backend_core, write_policy)
    CALLS[key] = CALLS.get(key, 0) + replay.calls


def teardown_module(module) -> None:
    if CALLS:
        print("\ntest_sglang_hicache: scheduler-level calls compared with SGLang: "
              + ", ".join(f"{core}/{policy} {calls}"
                          for (core, policy), calls in sorted(CALLS.items())))


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_same_as_sglang_hicache_under_pressure(backend_core, cpu_hicache, monkeypatch,
                                              write_policy):
    """A device pool half the usual size: loads back that must evict first, whose victims
    need host room, whose host room must not come from the host copies being loaded."""
    replay = HiReplay(backend_core, 1, "lru", write_policy, 0.5,
                      zlib.crc32(f"pressure-{write_policy}".encode()), monkeypatch,
                      device_tokens=192)
    run(replay, STEPS // 2)
    assert replay.counts.get("finished", 0) > 5, replay.counts
    key = (backend_core, write_policy)
    CALLS[key] = CALLS.get(key, 0) + replay.calls


def test_a_load_keeps_its_host_copies_while_it_evicts(backend_core, cpu_hicache, monkeypatch):
    """A load back that must evict first (write_back), whose victim needs host room, while the
    host copy being loaded is the oldest host leaf: that copy stays (SGLang locks the path
    and the host copy), a younger one goes. Step by step, compared after each."""
    replay = HiReplay(backend_core, 1, "lru", "write_back", 0.5, 0, monkeypatch,
                      device_tokens=64)
    first, second = list(range(1, 13)), list(range(100, 112))
    try:
        for step in (("put", first), ("put", second), ("evict_now", 24),  # both on the host
                     ("put", list(range(200, 240))), ("put", list(range(300, 324)))):
            replay.both(step[0], step[1])
            replay.compare(step[0])
        host_free = replay.ours.real.cache_controller.mem_pool_host.available_size()
        assert host_free < 24 and replay.ours.allocator.available_size() == 0
        # The request's match stamps `first`; a probe then stamps `second` (younger): the
        # host copy the load needs is the oldest host leaf when the load evicts.
        got = replay.both("admit", "r", first + [7, 7], [5], None, None, None, 1000,
                          [second + [9]])
        assert got[:3] == (0, 12, 12), got  # matched on the host, loaded back
        replay.compare("admit")
    finally:
        replay.close()


def test_load_back_quota_and_threshold(backend_core, cpu_hicache, monkeypatch):
    """SGLang's load-back limits: a host hit under 10 tokens is recomputed, one over the
    request's quota (the host tokens plus those the load's lock newly protects: none here,
    the admission pins the device prefix first) too; within them it loads. Step by step,
    compared after each."""
    replay = HiReplay(backend_core, 1, "lru", "write_back", 1.0, 0, monkeypatch,
                      device_tokens=64)
    shared, short, long_ = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 36))
    try:
        for step in (("put", shared + short), ("put", shared + long_), ("evict_now", 64)):
            replay.both(step[0], step[1])
            replay.compare(step[0])
        replay.both("put", shared)  # the shared head back on the device
        got = replay.both("admit", "a", shared + short + [1], [2], None, None, None, 1000)
        assert got[:3] == (4, 8, 0), got  # 8 host tokens: under the threshold
        replay.compare("admit")
        # 16 host tokens: a quota of 15 refuses, 16 admits.
        got = replay.both("admit", "b", shared + long_ + [1], [2], None, None, None, 1000,
                          (), 15)
        assert got[:3] == (4, 16, 0), got
        replay.compare("admit")
        got = replay.both("admit", "c", shared + long_ + [1], [2], None, None, None, 1000,
                          (), 16)
        assert got[:3] == (4, 16, 16), got
        replay.compare("admit")
    finally:
        replay.close()


@pytest.mark.parametrize("policy", ("priority", "lfu", "fifo", "mru", "filo", "slru"))
@pytest.mark.parametrize("write_policy", ("write_back", "write_through"))
def test_same_as_sglang_hicache_every_eviction_policy(backend_core, cpu_hicache, monkeypatch,
                                                     policy, write_policy):
    """The host tier orders its victims by the eviction policy too (``write_back`` counts no
    hits, which lfu and slru read)."""
    replay = HiReplay(backend_core, 16, policy, write_policy, 0.5,
                      zlib.crc32(f"{policy}-{write_policy}".encode()), monkeypatch)
    run(replay, STEPS // 8)
    assert replay.counts.get("finished", 0) > 5, replay.counts
    key = (backend_core, write_policy)
    CALLS[key] = CALLS.get(key, 0) + replay.calls


@pytest.mark.parametrize("write_policy", ("write_back", "write_through_selective"))
def test_same_as_sglang_hicache_without_events(backend_core, cpu_hicache, monkeypatch,
                                               write_policy):
    replay = HiReplay(backend_core, 1, "lru", write_policy, 0.5,
                      zlib.crc32(f"quiet-{write_policy}".encode()), monkeypatch, events=False)
    run(replay, STEPS // 4)
    assert replay.counts.get("finished", 0) > 5 and not replay.counts.get("events"), \
        replay.counts
    key = (backend_core, write_policy)
    CALLS[key] = CALLS.get(key, 0) + replay.calls


def test_storage_keys_with_a_memo_that_fills(backend_core, cpu_hicache, monkeypatch):
    """The storage keys stay SGLang's when the backend's memo of them fills and is cleared
    over and over (a memo of 64 pages)."""
    from radixcache.integrations.sglang import hicache

    monkeypatch.setattr(hicache, "_STORAGE_HASH_MEMO", 64)
    replay = HiReplay(backend_core, 1, "lru", "write_through", 1.0,
                      zlib.crc32(b"storage-keys-memo"), monkeypatch)
    run(replay, STEPS // 8)
    assert replay.counts.get("finished", 0) > 5, replay.counts


def test_split_rule_correction_matters_with_hicache(cpu_hicache, monkeypatch):
    """Without the correction SGLang's side is given, the comparison fails: the harness can
    fail with the host tier on, and forgives only the stated difference."""
    replay = HiReplay("python", 16, "mru", "write_back", 0.5, zlib.crc32(b"hicache-mru"),
                      monkeypatch, split_rule=False)
    diverges(replay, STEPS)


# -- faults: our side alone, slots checked after every step ------------------------------------
class InjectedFault(RuntimeError):
    """A copy or an allocation the test makes fail."""


class SoloReplay(HiReplay):
    """The harness on the radixcache side alone, with faults: SGLang's copies between device
    and host (``transfer_kv_direct``) and its controller's ``write``/``load`` fail now and
    then. A step that fails ends its requests as the scheduler's abort would (when it does
    not end on the error); after every step no device or host slot may be lost or held
    twice, and the requests that live on still read the KV their tokens were given unless a
    failed load left theirs unknown."""

    def __init__(self, core, page_size, write_policy, host_ratio, seed, monkeypatch,
                 rates: dict) -> None:
        monkeypatch.setattr(RadixcacheBackend, "core", core)
        from radixcache.integrations import sglang as backend_module

        backend_module.register()
        side = HiSide(*build_hicache_side("radixcache", page_size, "lru", write_policy,
                                          host_ratio))
        self.faults = random.Random(seed + 1)
        self.rates = rates
        cc = side.real.cache_controller
        for name in ("write", "load"):
            monkeypatch.setattr(cc, name, self._faulty(getattr(cc, name), name))
        monkeypatch.setattr(
            __import__("sglang.srt.mem_cache.pool_host.mha", fromlist=["mha"]),
            "transfer_kv_direct", self._faulty(_transfer_kv_direct, "copy"))
        self.start(side, side, seed, page_size, hicache_args(None, write_policy, host_ratio))

    def _faulty(self, call, name):
        def maybe_fail(*args, **kwargs):
            if self.faults.random() < self.rates[name]:
                self.counts[f"fault:{name}"] = self.counts.get(f"fault:{name}", 0) + 1
                raise InjectedFault(f"injected {name} failure")
            return call(*args, **kwargs)
        return maybe_fail

    def both(self, what: str, *args):
        try:
            result = getattr(self.ours, what)(*args)
        except InjectedFault:
            self.counts["failed steps"] = self.counts.get("failed steps", 0) + 1
            for req in list(self.ours.reqs.values()):
                if req.kv.holds_kv and req.kv.kv_allocated_len == 0:
                    # A row taken, its first allocation failed: the row goes back.
                    self.ours.cache.unlock(req.lock)
                    req.lock = None
                    self.ours.rows.free(req)
                    self.ours.reqs.pop(req.rid, None)
                elif req.kv.holds_kv:
                    self.ours._drop(req, checkpoint=False, reason="fault")
                else:
                    if req.lock is not None:
                        self.ours.cache.unlock(req.lock)
                        req.lock = None
                    self.ours.reqs.pop(req.rid, None)
            result = ("fault",)
        count_result(self.counts, result, what)
        return result

    def compare(self, what: str) -> None:
        side = self.ours
        side.check_slots()
        cache = side.real
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()[0]
        self.counts["events"] = self.counts.get("events", 0) + len(cache.take_events())


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_faults_lose_no_slot(backend_core, cpu_hicache, monkeypatch, write_policy, page_size):
    seed = zlib.crc32(f"faults-{write_policy}-{page_size}-batches".encode())
    replay = SoloReplay(backend_core, page_size, write_policy, 0.5, seed, monkeypatch,
                        rates={"copy": 0.1, "write": 0.03, "load": 0.3})
    run(replay, STEPS // 2)
    counts = replay.counts
    assert counts.get("failed steps", 0) > 5 and counts.get("finished", 0) > 5, counts
    assert counts.get("fault:copy", 0) and counts.get("fault:load", 0), sorted(counts.items())


# -- the factory ------------------------------------------------------------------------------
def _build_ours(server_args: dict, **params_fields):
    from radixcache.integrations import sglang as backend_module

    backend_module.register()
    kv_pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float16, head_num=1,
                               head_dim=2, layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(64, torch.float16, "cpu", kv_pool, need_sort=True)
    rows = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=allocator, page_size=1,
                             eviction_policy="lru", **params_fields)
    fields = dict(radix_cache_backend="radixcache", enable_hierarchical_cache=True,
                  hicache_io_backend="direct", hicache_mem_layout="layer_first",
                  hicache_ratio=2.0, hicache_size=0)
    fields.update(server_args)
    with _CONTEXT.override_server_args(**fields) as args:
        ctx = registry.TreeCacheBuildContext(
            server_args=args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=Worker(),
            model_config=None, tp_size=1, tp_rank=0, tp_group=None)
        return registry.create_tree_cache(ctx)


HICACHE_REFUSALS = {
    "buffer-only": (dict(hicache_host_memory_mode="buffer_only",
                         hicache_storage_backend="file"), {}, "buffer_only"),
    "storage": (dict(hicache_storage_backend="mooncake"), {}, "--hicache-storage-backend"),
    "pd-prefill": (dict(disaggregation_mode="prefill"), {}, "--disaggregation-mode prefill"),
    "pipeline": ({}, dict(pp_size=2), "pipeline"),
    "draft-pools": ({}, "draft", "draft"),
    "eagle": ({}, dict(is_eagle=True), "EAGLE"),
    "sessions": (dict(enable_session_radix_cache=True), dict(enable_session_radix_cache=True),
                 "--enable-session-radix-cache"),
}


@pytest.mark.parametrize("case", sorted(HICACHE_REFUSALS))
def test_hicache_refused_at_start_up(cpu_hicache, case):
    from radixcache.integrations.sglang import UnsupportedConfiguration

    server_args, params_fields, named = HICACHE_REFUSALS[case]
    if params_fields == "draft":
        draft = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float16, head_num=1,
                                 head_dim=2, layer_num=1, device="cpu",
                                 enable_memory_saver=False)
        params_fields = dict(mtp_draft_device_pools=(draft,))
    with pytest.raises(UnsupportedConfiguration) as info:
        _build_ours(server_args, **params_fields)
    message = str(info.value)
    assert named in message and "--radix-cache-backend radixcache" in message, message


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_hicache_builds_what_sglang_builds(cpu_hicache, write_policy):
    cache = _build_ours(dict(hicache_write_policy=write_policy))
    assert isinstance(cache, HiCacheBackend) and cache.write_policy == write_policy
    cc = cache.cache_controller
    assert type(cc).__name__ == "HybridCacheController" and cc.write_policy == write_policy
    host = cc.mem_pool_host.anchor_entry.host_pool
    assert type(host).__name__ == "MHATokenToKVPoolHost" and host.size == 129  # 2 x 64 + 1
    assert cache.token_to_kv_pool_host is host and cache.host_size() == 0
    assert cache.supports_prefix_sharing() and cache.total_size() == (0, 0)


@pytest.mark.parametrize("policy", ("best_effort", "wait_complete", "timeout"))
def test_hicache_builds_the_file_storage_tier(cpu_hicache, tmp_path, monkeypatch, policy):
    """SGLang's cache factory, given ``--hicache-storage-backend file``, builds radixcache's
    backend with SGLang's ``file`` backend attached (its storage threads running, the
    directory of ``--file-storage-path``, the threshold and timeouts of
    ``--hicache-storage-backend-extra-config``, the stop policy of
    ``--hicache-storage-prefetch-policy``); shutting down detaches it."""
    from sglang.srt.runtime_context import get_parallel
    from test_sglang_hicache_backup import ONE_RANK

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    config = '{"prefetch_threshold": 64, "prefetch_timeout_base": 2.0}'
    # (the storage config reads this process's place in the TP group: one rank)
    with get_parallel().override(**ONE_RANK):
        cache = _build_ours(dict(hicache_storage_backend="file",
                                 file_storage_path=str(tmp_path),
                                 hicache_storage_backend_extra_config=config,
                                 hicache_storage_prefetch_policy=policy))
    try:
        assert isinstance(cache, HiCacheBackend) and cache.enable_storage
        cc = cache.cache_controller
        assert type(cc.storage_backend).__name__ == "HiCacheFile"
        assert cc.storage_backend.file_path == str(tmp_path)
        assert cc.prefetch_thread.is_alive() and cc.backup_thread.is_alive()
        assert cache.prefetch_threshold == 64 and cache.prefetch_timeout_base == 2.0
        assert cache.prefetch_stop_policy == policy
        assert cache.storage_prefetch_retries is not None
    finally:
        cache.shutdown()
    assert not cache.enable_storage and not cc.prefetch_thread.is_alive()


@pytest.mark.parametrize("backend", (None, "radixcache"), ids=("sglang", "radixcache"))
def test_storage_admin_calls(backend_core, cpu_hicache, monkeypatch, backend):
    """The calls the scheduler's storage admin handlers (``/clear_hicache_storage``,
    ``/detach_hicache_storage``, ``/attach_hicache_storage``) make on the cache, with their
    arguments (``Scheduler.*_hicache_storage_wrapped``: the scheduler module itself needs
    serving packages this test install lacks), on each cache with no storage backend: clear
    and detach answer as SGLang's cache does, and attach is refused by name, leaving the
    cache as it was."""
    monkeypatch.setattr(RadixcacheBackend, "core", backend_core)
    from radixcache.integrations import sglang as backend_module

    backend_module.register()
    with hicache_args(backend, "write_through", 1.0):
        cache = build_hicache_side(backend, 1, "lru", "write_through", 1.0)[0]
        assert cache.clear_storage_backend() is False  # nothing to clear
        ok, message = cache.detach_storage_backend()
        assert ok and "Detached" in message and not cache.enable_storage
        # Nothing is ever prefetched: every request is ready at once, nothing loaded.
        handle = CacheRequestHandle("r", 0)
        root = cache.root_node.id if backend is None else cache.root_node
        assert cache.prefetch_from_storage(handle, root, [1, 2, 3]) is None
        assert cache.check_prefetch_progress(handle) is True
        assert cache.pop_prefetch_loaded_span(handle) == (0, None)
        assert cache.pop_prefetch_loaded_tokens(handle) == 0
        if backend is None:
            return  # SGLang's would attach (and start its storage threads)
        cc = cache.cache_controller
        host_free = cc.mem_pool_host.available_size()
        ok, message = cache.attach_storage_backend(
            storage_backend="file", storage_backend_extra_config_json=None,
            served_model_name="m", hicache_storage_prefetch_policy=None,
            hicache_write_policy=None)
        assert not ok and "--hicache-storage-backend" in message, message
        assert not cache.enable_storage and cc.storage_backend is None
        assert cc.mem_pool_host.available_size() == host_free
        cache.shutdown()


# -- two tensor-parallel ranks ------------------------------------------------------------------
def _tp_rank(rank: int, world: int, init: str, steps: int, write_policy: str, core: str,
             results) -> None:
    """One TP rank: its own pools and cache over a gloo TP group, the same scheduler
    sequence as the other rank, and acknowledgements that come late on rank 1 (a slower
    copy: ``_ready`` reports fewer finished than there are, at random). The backend reduces
    the counts over the group, so both ranks take the same acknowledgements at the same
    step: after every step a digest of every decision is gathered and must agree."""
    import torch.distributed as dist

    from radixcache.integrations.sglang import hicache

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import sglang.srt.mem_cache.pool_host.common as common
        import sglang.srt.mem_cache.pool_host.mha as mha

        common._cuda_host_register = lambda *args, **kwargs: None
        torch.cpu.Stream.synchronize = lambda self: None
        mha.transfer_kv_direct = _transfer_kv_direct
        late = random.Random(rank)
        ready = hicache._ready
        if rank == 1:
            hicache._ready = lambda acks: min(ready(acks), late.randrange(0, 3))
        RadixcacheBackend.core = core
        group = dist.new_group(list(range(world)), backend="gloo")
        from radixcache.integrations import sglang as backend_module

        backend_module.register()
        side = HiSide(*build_hicache_side("radixcache", 1, "lru", write_policy, 0.5,
                                          device_tokens=192, tp_group=group))
        replay = SoloReplay.__new__(SoloReplay)
        replay.start(side, side, 7, 1, hicache_args(None, write_policy, 0.5))
        digests = []
        try:
            for _ in range(steps):
                replay.step()
                cache = side.real
                digest = torch.tensor([zlib.crc32(repr((
                    side.free_slots(), side.host_slots(), side.transfers(),
                    cache.evictable_size(), cache.protected_size(), cache.host_size(),
                    sorted((rid, side.row(req)) for rid, req in side.reqs.items()),
                )).encode())], dtype=torch.int64)
                gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
                dist.all_gather(gathered, digest, group=group)
                digests.append(len({int(t) for t in gathered}))
        finally:
            replay.override.restore()
        results[rank] = (max(digests), replay.counts.get("tick", 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("write_policy", ("write_through",))  # late write and load acks
def test_two_tp_ranks_decide_alike(backend_core, tmp_path, write_policy):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_tp_rank, args=(2, init, STEPS // 4, write_policy, backend_core, results),
             nprocs=2, join=True)
    got = dict(results)
    # One digest per step on both ranks (a step where they differ would count 2), over a
    # sequence that took acknowledgements.
    assert got[0][0] == 1 and got[1][0] == 1 and got[0][1] > 10, got

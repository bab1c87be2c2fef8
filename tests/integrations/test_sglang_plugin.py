"""The radixcache backend as SGLang loads it: the plugin entry point, the start-up refusals,
bad input, and faults (an allocator that refuses a free, an abort in the middle of a chunked
prefill) with nothing leaked or freed twice.

Pieces SGLang cannot build on a CPU stay None (model config, TP worker, TP group); the MLX
refusal patches SGLang's ``use_mlx`` because no Apple device is here. Skips without SGLang,
fails instead with ``RADIXCACHE_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from array import array

import pytest
import torch

try:
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InsertParams,
                                                        MatchPrefixParams)
    from sglang.srt.mem_cache.common import (checkpoint_kv_cache, release_kv_cache)
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.runtime_context import _CONTEXT
    from sglang.srt.sampling.sampling_params import SamplingParams
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

from test_sglang_backend import build_side

from radixcache.integrations import sglang as backend_module
from radixcache.integrations.sglang import RadixcacheBackend, UnsupportedConfiguration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def ours(core_name, monkeypatch):
    """A radixcache backend built through SGLang's registry (page 1), on each core."""
    monkeypatch.setattr(RadixcacheBackend, "core", core_name)
    backend_module.register()
    cache, allocator, rows = build_side("radixcache", 1, "lru")
    override = _CONTEXT.override_server_args(radix_cache_backend=None)
    override.install()
    yield cache, allocator, rows
    override.restore()


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO, timeout=300).stdout


# -- loading -----------------------------------------------------------------------------------
def test_sglang_plugin_loader_registers_radixcache():
    out = _python(
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.mem_cache import registry\n"
        "load_plugins()\n"
        "import radixcache.integrations.sglang as m\n"
        "m.register(); m.register()\n"  # twice more in the same process: no error
        "print(registry.get_radix_cache_factory('radixcache') is m.create_backend)\n")
    assert out.strip().splitlines()[-1] == "True"


def test_importing_radixcache_does_not_import_sglang():
    out = _python(
        "import sys, pkgutil, importlib, radixcache, radixcache.integrations\n"
        "from radixcache import RadixCache\n"
        "RadixCache().insert([1, 2, 3])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))\n")
    assert out.strip() == "[]"


# -- start-up refusals -------------------------------------------------------------------------
def _build_with(monkeypatch, server_args=None, policy="lru", **ctx_flags):
    backend_module.register()
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, need_sort=True)
    rows = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=ctx_flags.pop("params_disable", False),
                             req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                             page_size=1, eviction_policy=policy,
                             eviction_policy_config=ctx_flags.pop("policy_config", None),
                             is_eagle=ctx_flags.pop("is_eagle", False),
                             enable_session_radix_cache=ctx_flags.pop("sessions", False))
    flags = dict(is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
                 disable_radix_cache=False)
    flags.update(ctx_flags)
    with _CONTEXT.override_server_args(radix_cache_backend="radixcache",
                                       **(server_args or {})) as args:
        ctx = registry.TreeCacheBuildContext(server_args=args, params=params, tp_worker=None,
                                             model_config=None, tp_size=1, tp_rank=0,
                                             tp_group=None, **flags)
        return registry.create_tree_cache(ctx)


REFUSALS = {
    "hybrid-swa-in-another-allocator": (dict(is_hybrid_swa=True), None,
                                        "SWATokenToKVPoolAllocator"),
    "hybrid-swa-and-mamba": (dict(is_hybrid_swa=True, is_hybrid_ssm=True), None,
                             "both sliding-window and Mamba"),
    "mamba-in-another-pool": (dict(is_hybrid_ssm=True), None, "ReqToTokenPool"),
    "hybrid-swa-with-eagle": (dict(is_hybrid_swa=True, is_eagle=True), None, "EAGLE-family"),
    "mamba-with-sessions": (dict(is_hybrid_ssm=True, sessions=True), None,
                            "--enable-session-radix-cache on a hybrid model"),
    "lmcache": ({}, dict(enable_lmcache=True), "--enable-lmcache"),
    "flexkv": ({}, dict(enable_flexkv=True), "--enable-flexkv"),
    "external-linker": ({}, dict(enable_unified_cache_external_linker=True),
                        "--enable-unified-cache-external-linker"),
    "host-pool-retraction": ({}, dict(disaggregation_decode_retraction_backup="host_pool"),
                             "--disaggregation-decode-retraction-backup host_pool"),
    "streaming-session": ({}, dict(enable_streaming_session=True), "--enable-streaming-session"),
    "disabled": (dict(disable_radix_cache=True, params_disable=True), None,
                 "--disable-radix-cache"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_at_start_up(monkeypatch, case):
    ctx_flags, server_args, named = REFUSALS[case]
    with pytest.raises(UnsupportedConfiguration) as info:
        _build_with(monkeypatch, server_args, **ctx_flags)
    message = str(info.value)
    assert named in message and "--radix-cache-backend radixcache" in message, message


@pytest.mark.parametrize("policy", ["tlru", "random"])
def test_unsupported_eviction_policy_refused(monkeypatch, policy):
    with pytest.raises(UnsupportedConfiguration, match=f"--radix-eviction-policy {policy}"):
        _build_with(monkeypatch, policy=policy)


@pytest.mark.parametrize("policy, named", [("slru", "protected_threshold"),
                                           ("lfu", "takes no options")])
def test_eviction_policy_options_refused(monkeypatch, policy, named):
    with pytest.raises(UnsupportedConfiguration, match="--radix-eviction-policy-config") as info:
        _build_with(monkeypatch, policy=policy, policy_config={"protected_threshold": 3})
    assert named in str(info.value)


def test_mlx_refused(monkeypatch):
    # No Apple device here: SGLang's own MLX switch is patched on.
    import sglang.srt.hardware_backend.mlx.runtime as mlx_runtime

    monkeypatch.setattr(mlx_runtime, "use_mlx", lambda: True)
    with pytest.raises(UnsupportedConfiguration, match="MLX"):
        _build_with(monkeypatch)


def test_streaming_sessions_refused_with_the_alternative(monkeypatch):
    with pytest.raises(UnsupportedConfiguration, match="--enable-streaming-session") as info:
        _build_with(monkeypatch, dict(enable_streaming_session=True,
                                      enable_session_radix_cache=True), sessions=True)
    assert "--enable-session-radix-cache runs on radixcache" in str(info.value)


def test_eagle_and_session_radix_cache_build(monkeypatch):
    """EAGLE (``is_eagle``) and ``--enable-session-radix-cache``, alone and together, pass the
    factory and SGLang's own checks after it (its registry requires the session flag on the
    cache it got)."""
    for is_eagle, sessions in ((True, False), (False, True), (True, True)):
        server_args = dict(enable_session_radix_cache=True) if sessions else None
        cache = _build_with(monkeypatch, server_args, is_eagle=is_eagle, sessions=sessions)
        assert isinstance(cache, RadixcacheBackend)
        assert cache.is_eagle is is_eagle and cache.enable_session_radix_cache is sessions


def test_session_calls_as_the_scheduler_makes_them(monkeypatch):
    """Generations per session, reopened after a close; closing twice, or an unknown id, or
    without the session cache, is harmless (0, as SGLang answers)."""
    cache = _build_with(monkeypatch, dict(enable_session_radix_cache=True), sessions=True)
    first = cache.ensure_session_generation("a")
    assert cache.ensure_session_generation("a") == first
    second = cache.open_radix_session("a")
    assert second > first and cache.ensure_session_generation("b") > second
    assert cache.release_radix_session("a") == 0 and cache.release_radix_session("a") == 0
    assert cache.release_radix_session("never-opened") == 0
    assert cache.ensure_session_generation("a") > second  # a closed id opens again
    plain = _build_with(monkeypatch)
    assert plain.release_radix_session("a") == 0 and plain.ensure_session_generation("a") == 1


def test_supported_configuration_builds(monkeypatch):
    for policy in backend_module.SUPPORTED_EVICTION_POLICIES:
        cache = _build_with(monkeypatch, policy=policy)
        assert isinstance(cache, RadixcacheBackend) and cache.eviction_policy == policy
    assert cache.supports_prefix_sharing()
    assert not (cache.supports_swa() or cache.supports_mamba()
                or cache.supports_fast_match_prefix() or cache.supports_auxiliary_swa())
    assert cache.total_size() == (0, 0)


def _build_swa(monkeypatch, **param_flags):
    """Our cache for a hybrid sliding-window model (SGLang's SWA pools), through SGLang's
    registry; ``param_flags`` set on its CacheInitParams."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    monkeypatch.setattr(RadixcacheBackend, "core", None)
    backend_module.register()
    kv_pool = SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.float16, head_num=1,
                        head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                        device="cpu")
    allocator = SWATokenToKVPoolAllocator(64, 32, 1, torch.float16, "cpu", kv_pool,
                                          need_sort=True)
    rows = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=allocator, page_size=1,
                             sliding_window_size=8)
    for name, value in param_flags.items():
        setattr(params, name, value)
    with _CONTEXT.override_server_args(radix_cache_backend="radixcache") as args:
        ctx = registry.TreeCacheBuildContext(
            server_args=args, params=params, tp_worker=None, model_config=None, tp_size=1,
            tp_rank=0, tp_group=None, is_hybrid_swa=True, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False)
        return registry.create_tree_cache(ctx)


def test_hybrid_swa_builds(monkeypatch):
    from radixcache.integrations.sglang.swa import RadixcacheSWABackend

    cache = _build_swa(monkeypatch)
    assert isinstance(cache, RadixcacheSWABackend)
    assert cache.supports_swa() and not cache.supports_mamba()
    assert (cache.sliding_window_size, cache.swa_retain_window) == (8, 8)
    assert cache.total_size() == (0, 0) and cache.swa_evictable_size() == 0


@pytest.mark.parametrize("flags, named", [
    (dict(swa_gates_prefix_match=False), "do not gate prefix matching"),
    (dict(decoder_swa_bounded_replay=True), "bounded SWA replay"),
])
def test_hybrid_swa_variants_refused(monkeypatch, flags, named):
    with pytest.raises(UnsupportedConfiguration, match=named):
        _build_swa(monkeypatch, **flags)


def _build_mamba(monkeypatch, page_size=1, params_flags=None, server_args=None):
    """Our cache for a Mamba hybrid (SGLang's Mamba pools, the differential harness's),
    through SGLang's registry; ``params_flags`` set on its CacheInitParams, ``server_args``
    on the server arguments it is built under."""
    import test_sglang_backend as harness

    create = harness._create_cache

    def create_with(backend, params, lora_names, **flags):
        for name, value in (params_flags or {}).items():
            setattr(params, name, value)
        server = _CONTEXT.override_server_args(radix_cache_backend=backend,
                                               **(server_args or {}))
        args = server.install()
        try:
            ctx = registry.TreeCacheBuildContext(
                server_args=args, params=params, tp_worker=None, model_config=None,
                tp_size=1, tp_rank=0, tp_group=None, enable_hierarchical_cache=False,
                disable_radix_cache=False, **{"is_hybrid_swa": False, **flags})
            return registry.create_tree_cache(ctx)
        finally:
            server.restore()

    monkeypatch.setattr(RadixcacheBackend, "core", None)
    backend_module.register()
    monkeypatch.setattr(harness, "_create_cache", create_with if (params_flags or server_args)
                        else create)
    return harness.build_side("radixcache", page_size, "lru", state=True)


@pytest.mark.parametrize("page_size", (1, 16))
def test_mamba_builds(monkeypatch, page_size):
    from radixcache.integrations.sglang.mamba import RadixcacheMambaBackend

    cache, _allocator, rows = _build_mamba(monkeypatch, page_size)
    assert isinstance(cache, RadixcacheMambaBackend)
    assert cache.supports_mamba() and not cache.supports_swa()
    assert cache.enable_mamba_extra_buffer == (page_size > 1) == rows.enable_mamba_extra_buffer
    assert cache.total_size() == (0, 0)
    assert (cache.mamba_evictable_size(), cache.mamba_protected_size()) == (0, 0)


def test_mamba_variants_refused(monkeypatch):
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    with_checkpoints = HybridReqToTokenPool.__new__(HybridReqToTokenPool)
    with_checkpoints.mamba_ckpt_pool = object()  # (an int8 checkpoint pool)
    with pytest.raises(UnsupportedConfiguration, match="int8 Mamba checkpoints"):
        _build_mamba(monkeypatch, params_flags={"req_to_token_pool": with_checkpoints})
    with pytest.raises(UnsupportedConfiguration, match="extra_buffer_lazy"):
        _build_mamba(monkeypatch, 16, server_args={"mamba_radix_cache_strategy":
                                                   "extra_buffer_lazy"})
    with pytest.raises(UnsupportedConfiguration, match="--mamba-max-states-per-path 2"):
        _build_mamba(monkeypatch, server_args={"mamba_max_states_per_path": 2})


def test_lock_results_as_sglang_reports_them(ours, monkeypatch):
    sgl_cache, sgl_allocator, _ = build_side(None, 1, "lru")
    results = []
    for cache, allocator in ((sgl_cache, sgl_allocator), ours[:2]):
        cache.insert(InsertParams(key=RadixKey(array("q", range(8))), value=allocator.alloc(8)))
        node = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", range(4))))
                                  ).last_device_node
        inc = cache.inc_lock_ref(node)
        again = cache.inc_lock_ref(node)
        dec = cache.dec_lock_ref(node, inc.to_dec_params())
        cache.dec_lock_ref(node, again.to_dec_params())
        results.append((type(inc).__name__, inc.delta, again.delta, type(dec).__name__,
                        dec.delta, cache.protected_size(), cache.evictable_size()))
    assert results[0] == results[1] == ("IncLockRefResult", 4, 0, "DecLockRefResult", None,
                                        0, 8)


# -- bad input: a clear error, nothing changed ---------------------------------------------------
def _state(cache, allocator):
    return (cache.total_size(), cache.evictable_size(), cache.protected_size(),
            sorted(allocator.get_all_free_pages().tolist()))


def test_bad_input_changes_nothing(ours):
    cache, allocator, _ = ours
    slots = allocator.alloc(6)
    cache.insert(InsertParams(key=RadixKey(array("q", [1, 2, 3, 4, 5, 6])), value=slots))
    before = _state(cache, allocator)
    with pytest.raises(TypeError, match="RadixKey"):
        cache.match_prefix(MatchPrefixParams(key=[1, 2, 3]))
    with pytest.raises(ValueError, match="bigram"):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3]),
                                                          is_bigram=True)))
    with pytest.raises(ValueError, match="values"):
        cache.insert(InsertParams(key=RadixKey(array("q", [1, 2, 3, 9])), value=slots[:2]))
    with pytest.raises(TypeError, match="num_tokens"):
        cache.evict(EvictParams(num_tokens=1.5))
    req = Req("bad", "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=1))
    req.init_next_round_input(cache)
    with pytest.raises(ValueError, match="up_to"):
        cache.checkpoint(req, up_to=10)
    other = RadixcacheBackend(_bare_params())
    other.radix_cache.insert([7, 8])
    foreign = other.radix_cache.match_prefix([7, 8]).last_node
    with pytest.raises(ValueError, match="not in this cache"):
        cache.path_device_indices(foreign)  # another cache's node
    other.radix_cache.evict(10)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.path_device_indices(foreign)  # an evicted node
    assert _state(cache, allocator) == before


def _bare_params():
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(disable=False, req_to_token_pool=None,
                           token_to_kv_pool_allocator=None, page_size=1)


# -- faults --------------------------------------------------------------------------------------
def _all_slots_accounted(cache, allocator, rows, reqs) -> None:
    """Every slot is in exactly one place: the allocator's free list, the tree, or a live
    request's own part of its row."""
    free = allocator.get_all_free_pages().tolist()
    tree = cache.all_values_flatten().tolist()
    own = []
    for req in reqs:
        if req.kv.holds_kv:
            own += rows.req_to_token[req.kv.req_pool_idx,
                                     req.kv.cache_protected_len:req.kv.kv_allocated_len].tolist()
    pending = [slot for part in cache._pending_frees for slot in part.tolist()]
    everything = free + tree + own + pending
    assert len(everything) == len(set(everything)), "a slot is in two places (freed twice?)"
    assert set(everything) == set(range(1, allocator.size + 1)), "a slot was leaked"


def _prefill(cache, allocator, rows, rid, prompt, chunk=None):
    req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=2))
    req.init_next_round_input(cache)
    req.lock = cache.lock(req.last_node)
    rows.alloc([req])
    rows.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), cache.prefix_device_indices(req))
    end = len(prompt) if chunk is None else req.prefix_len + chunk
    slots = allocator.alloc(end - req.prefix_len)
    rows.write((req.kv.req_pool_idx, slice(req.prefix_len, end)), slots)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = end
    return req


class _Refusing:
    """An allocator whose free_segment raises on chosen calls, before changing anything."""

    def __init__(self, allocator, fail_calls) -> None:
        self.allocator = allocator
        self.fail_calls = set(fail_calls)
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.allocator, name)

    def free_segment(self, free_index, *, start_pos):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("allocator refused the free")
        return self.allocator.free_segment(free_index, start_pos=start_pos)


def test_refused_free_is_retried_nothing_leaked(ours):
    cache, allocator, rows = ours
    shared = list(range(100, 140))
    # Both computed the shared prefix before either was cached: b's copy is a duplicate.
    first = _prefill(cache, allocator, rows, "a", shared + [1, 2, 3])
    second = _prefill(cache, allocator, rows, "b", shared + [4, 5])
    first.finished_reason = FINISH_ABORT("done")
    release_kv_cache(first, cache, checkpoint=True)
    refusing = _Refusing(allocator, {1})
    cache.token_to_kv_pool_allocator = refusing
    # The duplicate free inside b's checkpoint is refused; the checkpoint still completes
    # (row on the tree's slots, lock moved) and the duplicates wait for the next free.
    with pytest.raises(RuntimeError, match="refused"):
        cache.checkpoint(second, up_to=second.kv.kv_committed_len)
    assert second.kv.cache_protected_len == second.kv.kv_committed_len
    assert rows.req_to_token[second.kv.req_pool_idx, :40].tolist() == \
        cache.all_values_flatten()[:40].tolist()
    _all_slots_accounted(cache, refusing, rows, [second])
    second.finished_reason = FINISH_ABORT("done")
    release_kv_cache(second, cache, checkpoint=False)
    _all_slots_accounted(cache, refusing, rows, [])
    # An eviction whose per-node free is refused: that node's slots wait, then go.
    refusing.fail_calls = {refusing.calls + 2}
    with pytest.raises(RuntimeError, match="refused"):
        cache.evict(EvictParams(num_tokens=1000))
    _all_slots_accounted(cache, refusing, rows, [])
    cache.evict(EvictParams(num_tokens=1000))
    assert cache.total_size() == (0, 0) and not cache._pending_frees
    assert allocator.available_size() == allocator.size
    _all_slots_accounted(cache, refusing, rows, [])


def test_refused_page_free_is_retried_nothing_leaked(core_name, monkeypatch):
    # Page 16 without events: an eviction hands SGLang's paged allocator the victims' page
    # ids in one free_page_ids; refused, their slots wait for the next free.
    monkeypatch.setattr(RadixcacheBackend, "core", core_name)
    backend_module.register()
    cache, allocator, _ = build_side("radixcache", 16, "lru", events=False)
    full = allocator.available_size()
    first, second = allocator.alloc(32), allocator.alloc(16)
    cache.insert(InsertParams(key=RadixKey(array("q", range(32))), value=first))
    cache.insert(InsertParams(key=RadixKey(array("q", [7] * 16)), value=second))
    handed = []
    real = allocator.free_page_ids

    def refuse_once(page_ids):
        handed.append(page_ids.tolist())
        if len(handed) == 1:
            raise RuntimeError("allocator refused the free")
        return real(page_ids)

    monkeypatch.setattr(allocator, "free_page_ids", refuse_once)
    with pytest.raises(RuntimeError, match="refused"):
        cache.evict(EvictParams(num_tokens=1000))
    assert handed == [(torch.cat([first[::16], second[::16]]) // 16).tolist()]
    assert sorted(torch.cat(cache._pending_frees).tolist()) == \
        sorted(torch.cat([first, second]).tolist())
    assert allocator.available_size() == full - 48 and cache.total_size() == (0, 0)
    cache.evict(EvictParams(num_tokens=1000))  # the retry frees them, once
    assert not cache._pending_frees and allocator.available_size() == full


def test_abort_mid_chunk_returns_every_slot(ours):
    cache, allocator, rows = ours
    prompt = list(range(1, 60))
    req = _prefill(cache, allocator, rows, "chunky", prompt, chunk=16)
    checkpoint_kv_cache(req, cache)
    assert req.kv.cache_protected_len == 16 and cache.protected_size() == 16
    slots = allocator.alloc(16)
    rows.write((req.kv.req_pool_idx, slice(16, 32)), slots)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = 32
    _all_slots_accounted(cache, allocator, rows, [req])
    req.finished_reason = FINISH_ABORT("client went away")
    release_kv_cache(req, cache, checkpoint=False)
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    _all_slots_accounted(cache, allocator, rows, [])
    cache.evict(EvictParams(num_tokens=100))
    assert allocator.available_size() == allocator.size


# -- events and metrics -------------------------------------------------------------------------
def test_events_are_sglang_structs_its_publisher_encodes(core_name, monkeypatch):
    import msgspec

    monkeypatch.setattr(RadixcacheBackend, "core", core_name)
    backend_module.register()
    cache, allocator, _ = build_side("radixcache", 16, "lru")
    slots = allocator.alloc(32)
    cache.insert(InsertParams(key=RadixKey(array("q", range(32))), value=slots))
    events = cache.take_events()
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored"]
    assert isinstance(events[1], BlockStored) and len(events[1].block_hashes) == 2
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    assert msgspec.msgpack.decode(payload, type=KVEventBatch).events == events


def test_eviction_metrics(ours):
    cache, allocator, _ = ours

    class Collector:
        tokens = durations = 0

        def observe_eviction_duration(self, seconds):
            Collector.durations += 1

        def increment_eviction_num_tokens(self, num):
            Collector.tokens += num

    cache.metrics_collector = Collector()
    cache.insert(InsertParams(key=RadixKey(array("q", [1, 2, 3, 4])), value=allocator.alloc(4)))
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 4
    assert (Collector.tokens, Collector.durations) == (4, 1)
    cache.evict(EvictParams(num_tokens=3))  # nothing left: no observation
    assert Collector.durations == 1


# -- the real-server script (run needs a GPU: here only what it writes and the arguments) --------
def test_server_script_commands_parse_and_config_loads(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks", "scripts"))
    try:
        import sglang_server
    finally:
        sys.path.pop(0)
    from sglang.srt.server_args import prepare_server_args
    from transformers import AutoConfig

    model = sglang_server.write_model(tmp_path / "tiny")
    config = AutoConfig.from_pretrained(str(model))
    assert config.model_type == "llama" and config.num_hidden_layers == 2
    for radixcache in (False, True):
        command = sglang_server.server_command(model, 30123, 16, radixcache, [])
        assert command[1:3] == ["-m", "sglang.launch_server"]
        args = prepare_server_args(command[3:])
        assert (args.load_format, args.skip_tokenizer_init, args.page_size) == ("dummy", True, 16)
        assert args.radix_cache_backend == ("radixcache" if radixcache else None)
    plans = sglang_server.conversations(3, 2, seed=0)
    assert len(plans) == 3 and all(len(turns) == 2 for turns in plans)

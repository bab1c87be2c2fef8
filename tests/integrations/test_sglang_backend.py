"""The radixcache backend inside SGLang 0.5.23 decides as SGLang's default cache does.

Both caches are built through SGLang's own registry and factory path
(``registry.create_tree_cache``): SGLang's default (``UnifiedRadixCache``) with no
``--radix-cache-backend``, ours with ``--radix-cache-backend radixcache`` after the plugin's
``register()``. Each gets its own real ``ReqToTokenPool``, real token-to-KV allocator
(``TokenToKVPoolAllocator`` for page 1, ``PagedTokenToKVPoolAllocator`` for page 16, both with
``need_sort=True`` so that the slots handed out do not depend on the order they were freed in)
over a real ``MHATokenToKVPool`` of a few hundred tokens, and real ``Req`` objects. One random
scheduler-level sequence drives both through SGLang's own functions: ``Req.init_next_round_input``
(match), ``tree_cache.lock``, ``alloc_token_slots`` / ``alloc_paged_token_slots_extend`` /
``..._decode`` (which evict through ``evict_for_alloc``), ``prefix_device_indices``,
``checkpoint_kv_cache`` (chunked prefill), ``release_kv_cache`` (finish: checkpoint; abort: no
checkpoint), ``release_req`` (retraction), ``touch_waiting_prefix``, ``dfs_weight_order``,
``evict`` and ``reset`` -- multi-turn conversations over shared system prompts, priorities,
namespaces (``extra_key``, ``cache_salt``), under eviction pressure. After every step both
must show the same match lengths, the same KV slots in every live request row, the same free
slots in the allocator, the same sizes, and the same KV events (SGLang's event types, block
hashes included).

Stand-ins, each because the real piece cannot be built on a CPU: the model config, the TP
worker and the TP group are None (the factory reads none of them for a full-attention model);
the server arguments are SGLang's own test install (``RuntimeContext.override_server_args``).

The one deliberate difference (docs/sglang.md) is applied to SGLang's side, exactly as
tests/integrations/test_vs_sglang.py does: where a match or insert ends inside a node, SGLang
stamps the unmatched lower half as just used; here that half gets back the access time it had
before the call. That needs SGLang's Python TreeCore (``tree_core_backend="python"``; the Rust
TreeCore, SGLang's default, is compiled and cannot be patched; SGLang keeps the two equal).

Skips (saying why) where SGLang is not importable; fails instead with
``RADIXCACHE_REQUIRE_SGLANG=1`` (CI).
"""

from __future__ import annotations

import os
import random
import types
import zlib
from array import array

import pytest
import torch

try:
    from sglang.srt.managers.schedule_batch import (FINISH_ABORT, FINISH_LENGTH, Req,
                                                    release_req)
    from sglang.srt.mem_cache import registry
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocation import (alloc_paged_token_slots_decode,
                                                 alloc_paged_token_slots_extend,
                                                 alloc_req_slots, alloc_token_slots,
                                                 get_last_loc_torch)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import (checkpoint_kv_cache, release_kv_cache,
                                             touch_waiting_prefix)
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, HybridReqToTokenPool,
                                                  MHATokenToKVPool, ReqToTokenPool)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.runtime_context import _CONTEXT, mamba_checkpoint_grid
    from sglang.srt.sampling.sampling_params import SamplingParams
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    if os.environ.get("RADIXCACHE_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

from radixcache.integrations import sglang as backend_module
from radixcache.integrations.sglang import RadixcacheBackend

#: Random scheduler steps per (core, page size, policy) sequence.
STEPS = 2200
POLICIES = ("lru", "priority", "fifo", "filo", "mru", "lfu", "slru")
POOL_TOKENS = {1: 384, 16: 1024}
ROWS = 8
#: Scheduler-level calls into our cache, per core (summed in the closing line).
CALLS: dict = {}
#: Tokens that must slide out of a request's window before it frees them (SGLang's
#: ``SGLANG_SWA_EVICTION_INTERVAL``, 128 by default: small here, for short requests).
SWA_INTERVAL = 4
#: A Mamba hybrid's checkpoint granularity (the model's Mamba chunk size, preset as SGLang's
#: own test fixtures do: a dummy model has no config to read it from), and its Mamba pool
#: by page size: what the running requests hold (a state each, and two ping-pong track slots
#: with the extra buffer pages > 1 use), one locked cached state each, and a few more, so that
#: cached states are evicted too (SGLang sizes the pool so that its running requests never
#: run it dry: a match's copy on write asserts where eviction finds no state to free).
MAMBA_CHUNK = 4
MAMBA_SLOTS = {1: 3 * ROWS, 16: 5 * ROWS}


# -- building both caches the way SGLang's scheduler does ---------------------------------------
class Counting:
    """Forwards to a cache and counts the method calls made through it (the scheduler's)."""

    def __init__(self, cache) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name):
        value = getattr(self._cache, name)
        if callable(value) and not isinstance(value, type):
            object.__setattr__(self, "calls", self.calls + 1)
        return value

    def __setattr__(self, name, value) -> None:
        setattr(self._cache, name, value)


class _ServerArgs:
    """SGLang's test install of the server arguments (``fields`` published with them), with
    the Mamba chunk size preset."""

    def __init__(self, backend: str | None, **fields) -> None:
        self.override = _CONTEXT.override_server_args(radix_cache_backend=backend, **fields)

    def install(self):
        args = self.override.install()
        args._mamba_cache_chunk_size = MAMBA_CHUNK
        return args

    def restore(self) -> None:
        self.override.restore()


def _server_args(backend: str | None, **fields) -> _ServerArgs:
    return _ServerArgs(backend, **fields)


def _counting(allocator_class: type) -> type:
    """A subclass of one of SGLang's stock allocators that counts its ``free_segment``
    calls. The backend treats it as an allocator it does not know: it frees through
    ``free_segment`` and reads the capacity from ``available_size``."""

    class Counting(allocator_class):
        free_segment_calls = 0

        def free_segment(self, free_index, *, start_pos):
            self.free_segment_calls += 1
            return super().free_segment(free_index, start_pos=start_pos)

    return Counting


def build_side(backend: str | None, page_size: int, policy: str, lora_names=None,
               events: bool = True, counting_allocator: bool = False, is_eagle: bool = False,
               sessions: bool = False, server_args: dict | None = None,
               pool_tokens: int | None = None, window: int = 0, state: bool = False,
               layers: int = 1, override=None, worker=None, tp_group=None):
    """One side's cache (SGLang's default with ``backend`` None), allocator and request rows,
    built through SGLang's registry over SGLang's own real pools; ``is_eagle`` and
    ``sessions`` set the cache parameters of EAGLE speculative decoding and
    ``--enable-session-radix-cache``, ``server_args`` the published server arguments the
    factory sees (``override``: an install to build under instead); the pool holds
    ``POOL_TOKENS[page_size]`` tokens unless ``pool_tokens`` says otherwise, in ``layers``
    layers; ``worker``: the TP worker (HiCache on when given), ``tp_group`` its group.
    ``window`` > 0: a hybrid sliding-window model of that window (SGLang's ``SWAKVPool`` and
    ``SWATokenToKVPoolAllocator``, a window pool half the size of the full-attention one);
    ``state``: a Mamba hybrid (SGLang's ``HybridReqToTokenPool`` with its ``MambaPool``, a
    ``HybridLinearKVPool``)."""
    if window:
        return _build_swa_side(backend, page_size, policy, lora_names, events, window)
    if state:
        return _build_mamba_side(backend, page_size, policy, lora_names, events)
    pool = POOL_TOKENS[page_size] if pool_tokens is None else pool_tokens
    kv_pool = MHATokenToKVPool(size=pool, page_size=page_size,
                               dtype=torch.float16, head_num=1, head_dim=2, layer_num=layers,
                               device="cpu", enable_memory_saver=False)
    if page_size == 1:
        kind = TokenToKVPoolAllocator
        if counting_allocator:
            kind = _counting(kind)
        allocator = kind(pool, torch.float16, "cpu", kv_pool, need_sort=True)
    else:
        kind = PagedTokenToKVPoolAllocator
        if counting_allocator:
            kind = _counting(kind)
        allocator = kind(pool, page_size, torch.float16, "cpu", kv_pool, need_sort=True)
    rows = ReqToTokenPool(size=ROWS, max_context_len=4096, device="cpu",
                          enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             eviction_policy=policy, enable_kv_cache_events=events,
                             is_eagle=is_eagle, enable_session_radix_cache=sessions,
                             tree_core_backend=None if backend else "python",
                             tp_cache_group=tp_group)
    if override is None:
        override = _server_args(backend, **(server_args or {}))
    cache = _create_cache(backend, params, lora_names, override=override,
                          enable_hierarchical_cache=worker is not None, tp_worker=worker,
                          tp_group=tp_group)
    return cache, allocator, rows


def _create_cache(backend: str | None, params, lora_names, override=None, **flags):
    """SGLang's registry builds the cache: its default one, or ``backend``'s (``override``
    installed while it does: by default, only ``--radix-cache-backend``)."""
    if lora_names is not None:
        params.kv_event_lora_names = lora_names
    if override is None:
        override = _server_args(backend)
    args = override.install()
    try:
        ctx = registry.TreeCacheBuildContext(**{
            "server_args": args, "params": params, "is_hybrid_swa": False,
            "is_hybrid_ssm": False, "enable_hierarchical_cache": False,
            "disable_radix_cache": False, "tp_worker": None, "model_config": None,
            "tp_size": 1, "tp_rank": 0, "tp_group": None, **flags})
        return registry.create_tree_cache(ctx)
    finally:
        override.restore()


def _build_swa_side(backend: str | None, page_size: int, policy: str, lora_names, events: bool,
                    window: int):
    size = POOL_TOKENS[page_size]
    kv_pool = SWAKVPool(size=size, size_swa=size // 2, page_size=page_size,
                        dtype=torch.float16, head_num=1, head_dim=2,
                        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    allocator = SWATokenToKVPoolAllocator(size, size // 2, page_size, torch.float16, "cpu",
                                          kv_pool, need_sort=True)
    rows = ReqToTokenPool(size=ROWS, max_context_len=4096, device="cpu",
                          enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             eviction_policy=policy, enable_kv_cache_events=events,
                             tree_core_backend=None if backend else "python",
                             sliding_window_size=window)
    return _create_cache(backend, params, lora_names, is_hybrid_swa=True), allocator, rows


def _build_mamba_side(backend: str | None, page_size: int, policy: str, lora_names,
                      events: bool):
    size = POOL_TOKENS[page_size]
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1,
                                        num_heads=2, head_dim=4, state_size=4, conv_kernel=2)
    rows = HybridReqToTokenPool(size=ROWS, mamba_size=MAMBA_SLOTS[page_size],
                                mamba_spec_state_size=ROWS,
                                max_context_len=4096, device="cpu", enable_memory_saver=False,
                                cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                                mamba_layer_ids=[0], enable_mamba_extra_buffer=page_size > 1,
                                speculative_num_draft_tokens=3)
    kv_pool = HybridLinearKVPool(size=size, dtype=torch.float16, page_size=page_size,
                                 head_num=1, head_dim=2, full_attention_layer_ids=[1],
                                 device="cpu", enable_memory_saver=False,
                                 mamba_pool=rows.mamba_pool)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.float16, "cpu", kv_pool, need_sort=True)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", kv_pool,
                                                need_sort=True)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             eviction_policy=policy, enable_kv_cache_events=events,
                             tree_core_backend=None if backend else "python",
                             enable_mamba_extra_buffer=page_size > 1)
    return _create_cache(backend, params, lora_names, is_hybrid_ssm=True), allocator, rows


def apply_split_rule(cache) -> None:
    """SGLang's lower half of a split keeps the access time it had before the call.

    SGLang stamps a node as its insert walks through it and then splits it; a match splits
    first and stamps afterwards. Either way the lower half gets back its earlier time."""
    core = cache.tree_core
    touch, split = core._touch_node, core._split_node
    match, begin_insert = core.match_prefix, core.begin_insert
    touched = {}

    def match_forgetting(params):
        touched.clear()  # a match walk stamps nothing before it splits
        return match(params)

    def insert_forgetting(params):
        touched.clear()
        return begin_insert(params)

    def touch_remembering(node):
        before = node.last_access_time
        touch(node)
        touched.update(node=node, before=before, after=node.last_access_time)

    def split_as_radixcache(key, child, split_len):
        before = child.last_access_time
        if touched.get("node") is child and touched["after"] == before:
            before = touched["before"]  # stamped by this walk just before the split
        new_node, action = split(key, child, split_len)
        child.last_access_time = before
        return new_node, action

    core._touch_node = touch_remembering
    core._split_node = split_as_radixcache
    core.match_prefix = match_forgetting
    core.begin_insert = insert_forgetting
    swa = cache.components.get(ComponentType.SWA)
    if swa is not None:
        # An SWA split of a node the insert walks through cuts no unused half off: both
        # halves were used, and keep the call's time.
        clip = swa._clip_to_window

        def clip_keeping_time(**kwargs):
            touched.clear()
            return clip(**kwargs)

        swa._clip_to_window = clip_keeping_time


def count_result(counts: dict, result: tuple, what: str) -> None:
    """Count a step's result by its kind (``what`` when it names none); a batch's also by
    each request's own result in it."""
    kinds = [result[0] if result and isinstance(result[0], str) else what]
    if kinds[0] == "batch":
        kinds += [each[0] for each in result[1:]]
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1


# -- one side: a cache and the scheduler's view of its requests ---------------------------------
class Side:
    def __init__(self, cache, allocator, rows) -> None:
        self.cache = Counting(cache)
        self.allocator = allocator
        self.rows = rows
        self.reqs: dict[str, Req] = {}
        self.swa = isinstance(allocator, SWATokenToKVPoolAllocator)
        self.mamba = isinstance(rows, HybridReqToTokenPool)
        self.decoded: dict[str, int] = {}  # decode steps per request (SWA: the window slides)

    def free_slots(self) -> list:
        if self.swa:  # both pools, and which window slot each full-attention slot has
            allocator = self.allocator
            return (sorted(allocator.full_attn_allocator.get_all_free_pages().tolist()),
                    sorted(allocator.swa_attn_allocator.get_all_free_pages().tolist()),
                    allocator.full_to_swa_index_mapping.tolist())
        pages = sorted(self.allocator.get_all_free_pages().tolist())
        if self.mamba:  # and the Mamba slots, in the order the allocator hands them out
            return pages, self.rows.mamba_allocator.free_slots.tolist()
        return pages

    def sizes(self) -> tuple:
        c = self.cache._cache
        sizes = (c.evictable_size(), c.protected_size(), c.full_evictable_size(),
                 c.full_protected_size(), c.total_size(), c.swa_evictable_size(),
                 c.swa_protected_size())
        if self.mamba:
            sizes += (c.mamba_evictable_size(), c.mamba_protected_size())
        return sizes

    def states(self, req: Req) -> tuple:
        """A Mamba request's state slot and the cached state its match copies."""
        kv = req.kv
        source = kv.mamba_cow_src_index
        return (None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx),
                None if source is None else source.tolist(), req.mamba_branching_seqlen)

    def room(self) -> int:
        """Tokens an allocation can get, evicting what it may (the smaller pool for SWA)."""
        cache, allocator = self.cache, self.allocator
        if self.swa:
            return min(allocator.full_available_size() + cache.full_evictable_size(),
                       allocator.swa_available_size() + cache.swa_evictable_size())
        return allocator.available_size() + cache.evictable_size()

    def row(self, req: Req) -> list:
        if not req.kv.holds_kv:
            return []
        return self.rows.req_to_token[req.kv.req_pool_idx, :req.kv.kv_allocated_len].tolist()

    # -- scheduler steps: each returns what the scheduler saw (compared between sides) -----
    def admit(self, rid: str, prompt: list, output: list, priority, extra_key, salt,
              chunk: int) -> tuple:
        """Match, lock, take a row, allocate the first chunk (or the whole prompt)."""
        req = self.matched(rid, prompt, output, priority, extra_key, salt)
        req.lock = self.cache.lock(req.last_node)
        return (req.prefix_len, req.swa_branching_seqlen) + self._extend(req, chunk)

    def matched(self, rid: str, prompt: list, output: list, priority, extra_key,
                salt) -> Req:
        """The request ``rid`` (made on its first admission), matched against the cache."""
        req = self.reqs.get(rid)
        if req is None:
            req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=len(output)),
                      priority=priority, extra_key=extra_key, cache_salt=salt)
            req.planned_output = output
            self.reqs[rid] = req
        req.init_next_round_input(self.cache)
        return req

    def _extend(self, req: Req, chunk: int) -> tuple:
        page_size = self.allocator.page_size
        fill = len(req.full_untruncated_fill_ids)
        start = req.prefix_len
        end = fill if fill - start <= chunk else (start + chunk) // page_size * page_size
        if end <= start:
            end = fill
        need = end - start + page_size
        available = self.room()
        if need > available or (not req.kv.holds_kv and self.rows.available_size() == 0):
            self._drop(req, checkpoint=False, reason="no room")
            return ("refused",)
        if not req.kv.holds_kv:  # a new row starts with the matched prefix's slots
            prefix = (self.cache.prefix_device_indices(req) if req.prefix_len
                      else torch.empty(0, dtype=torch.int64))
            if self.mamba:  # (its state slots first, evicting states if it must)
                # (the scheduler admits a request only where its state slots can be had)
                needed = (not req.kv.holds_mamba) + (
                    self.rows.mamba_initial_tracking_slots
                    if req.kv.mamba_ping_pong_track_buffer is None else 0)
                if (self.rows.mamba_allocator.available_size()
                        + self.cache.mamba_evictable_size() < needed):
                    self._drop(req, checkpoint=False, reason="no state slot")
                    return ("refused",)
                alloc_req_slots(self.rows, [req], self.cache)
            else:
                self.rows.alloc([req])
            self.rows.write((req.kv.req_pool_idx, slice(0, start)), prefix)
        if page_size == 1:
            slots = alloc_token_slots(self.cache, end - start)
        else:
            row = self.rows.req_to_token
            idx = torch.tensor([req.kv.req_pool_idx])
            prefix_lens = torch.tensor([start])
            seq_lens = torch.tensor([end])
            slots = alloc_paged_token_slots_extend(
                self.cache, prefix_lens, prefix_lens, seq_lens, seq_lens,
                get_last_loc_torch(row, idx, prefix_lens), end - start)
        self.rows.write((req.kv.req_pool_idx, slice(start, end)), slots)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        req.extend_end = end
        self.track_state(req)
        if end < fill:
            checkpoint_kv_cache(req, self.cache)  # a chunk: publish it
            return ("chunk", end)
        req.prefix_len = end
        if len(req.output_ids) < len(req.planned_output):
            req.output_ids.append(req.planned_output[len(req.output_ids)])
        return ("prefilled", end)

    def continue_chunk(self, rid: str, chunk: int) -> tuple:
        return self._extend(self.reqs[rid], chunk)

    def decode(self, rid: str) -> tuple:
        """One decode step: a slot for the last output token, then the next token; at the
        planned length the request finishes and is released into the cache."""
        req = self.reqs[rid]
        if len(req.output_ids) >= len(req.planned_output):
            return self.finish(req)
        position = req.kv.kv_committed_len
        if self.room() < 2 * self.allocator.page_size:
            return ("stalled",)
        if self.swa:
            self.slide_window(req, position)
        if self.allocator.page_size == 1:
            slot = alloc_token_slots(self.cache, 1)
        else:
            row = self.rows.req_to_token
            seq_lens = torch.tensor([position + 1])
            last_loc = row[req.kv.req_pool_idx, position - 1:position].to(torch.int64)
            slot = alloc_paged_token_slots_decode(self.cache, seq_lens, seq_lens, last_loc)
        self.rows.write((req.kv.req_pool_idx, slice(position, position + 1)), slot)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = position + 1
        self.track_state(req)
        req.output_ids.append(req.planned_output[len(req.output_ids)])
        return ("decoded", position)

    def finish(self, req: Req) -> tuple:
        """A request at its planned length is released into the cache, in the allocator's
        free group as the scheduler's batch-result processing releases finished requests
        (its own group when no batch opened one; closed even when a fault test's release
        raises)."""
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        if self.allocator.free_group is not None:
            release_kv_cache(req, self.cache, checkpoint=True)
        else:
            self.allocator.free_group_begin()
            try:
                release_kv_cache(req, self.cache, checkpoint=True)
            finally:
                self.allocator.free_group_end()
        del self.reqs[req.rid]
        return ("finished",)

    def decode_batch(self, steps: list) -> tuple:
        """One decode step of several requests, as one batch: the running ones decode (their
        slots allocated first, as the scheduler prepares a batch), then every one at its
        planned length is released inside one free group, so their frees reach the allocator
        together (as the batch's result processing releases them)."""
        done = [args for args in steps if len(self.reqs[args[0]].output_ids)
                >= len(self.reqs[args[0]].planned_output)]
        results = [self.decode(*args) for args in steps if args not in done]
        self.allocator.free_group_begin()
        try:
            results += [self.finish(self.reqs[args[0]]) for args in done]
        finally:
            self.allocator.free_group_end()
        return ("batch", *results)

    def track_state(self, req: Req) -> None:
        """The model's forward pass, for a Mamba hybrid with ``--mamba-extra-buffer``: once
        the computed length reaches a new checkpoint boundary, the state there was written
        to the request's next ping-pong slot, which becomes its tracked state (what SGLang's
        batch result processor records, non-lazy). No model runs here: this stands in for
        it, the same on both sides."""
        kv = req.kv
        if not self.mamba or kv.mamba_ping_pong_track_buffer is None:
            return
        grid = mamba_checkpoint_grid(self.allocator.page_size)
        boundary = kv.kv_committed_len // grid * grid
        if boundary and boundary > (kv.mamba_last_track_seqlen or 0):
            slot = kv.mamba_next_track_idx or 0
            kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
            kv.mamba_last_track_seqlen = boundary
            kv.mamba_last_track_idx = slot
            kv.mamba_next_track_idx = self.rows.get_mamba_ping_pong_other_idx(slot)

    def slide_window(self, req: Req, position: int) -> None:
        """The scheduler's ``maybe_evict_swa`` for one decoding request: past its window (in
        steps of ``SWA_INTERVAL``) the request frees the window slots behind it, and after a
        few decode steps (the scheduler: a window's length; the outputs here are short) it
        releases the window part of its prefix's lock."""
        steps = self.decoded[req.rid] = self.decoded.get(req.rid, 0) + 1
        window = self.cache.swa_retain_window
        evicted = req.kv.get_evicted_seqlen(ComponentType.SWA)
        if steps >= 2 and position - window >= evicted + SWA_INTERVAL:
            self.cache.evict_sliding_windows(req, position, eviction_interval=1)
        if steps >= 3:
            self.cache.release_swa_prefix_lock(req)

    def _drop(self, req: Req, *, checkpoint: bool, reason: str) -> None:
        if req.kv.holds_kv:
            req.finished_reason = FINISH_ABORT(reason)
            release_kv_cache(req, self.cache, checkpoint=checkpoint)
        else:
            if self.mamba:  # the state slot its match took (no row yet)
                release_kv_cache(req, self.cache, checkpoint=False)
            self.cache.unlock(req.lock)
            req.lock = None
        self.reqs.pop(req.rid, None)

    def abort(self, rid: str) -> tuple:
        self._drop(self.reqs[rid], checkpoint=False, reason="client abort")
        return ("aborted",)

    def retract(self, rid: str, remaining: int) -> tuple:
        req = self.reqs[rid]
        release_req(req=req, remaing_req_count=remaining, req_to_token_pool=self.rows,
                    token_to_kv_pool_allocator=self.allocator, tree_cache=self.cache,
                    hisparse_coordinator=None)
        return ("retracted",)

    def touch(self, rid: str) -> tuple:
        touch_waiting_prefix(self.reqs[rid], self.cache)
        return ("touched",)

    def order(self, probes: list) -> tuple:
        """Match some waiting prompts and order them as the scheduler's DFS policy does."""
        nodes = []
        for tokens, extra_key in probes:
            probe = Req("probe", "", array("q", tokens), SamplingParams(max_new_tokens=1),
                        extra_key=extra_key)
            # (The scheduler's probes copy no Mamba state: cow_mamba=False.)
            probe.init_next_round_input(self.cache, cow_mamba=False if self.mamba else None)
            nodes.append(probe.last_node)
        return tuple(self.cache.dfs_weight_order(nodes))

    def evict(self, num_tokens: int) -> tuple:
        return (self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted,)

    def reset(self) -> tuple:
        """Flush the cache as the scheduler does once idle: every request ends first."""
        for req in list(self.reqs.values()):
            self._drop(req, checkpoint=False, reason="flush")
        self.cache.reset()
        self.allocator.clear()
        self.rows.clear()
        return ("reset",)


# -- the workload: conversations over shared system prompts ---------------------------------
class Workload:
    def __init__(self, rng: random.Random, page_size: int) -> None:
        self.rng = rng
        self.page_size = page_size
        self.systems = [[rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))]
                        for _ in range(4)]
        self.conversations: list[dict] = []
        self.next_rid = 0

    def new_request(self) -> dict:
        rng = self.rng
        if self.conversations and rng.random() < 0.6:
            conv = rng.choice(self.conversations)
        else:
            conv = {"history": list(rng.choice(self.systems)),
                    "extra_key": rng.choice((None, None, "ns-a", "ns-b")),
                    "salt": rng.choice((None, None, None, "salt-1"))}
            self.conversations.append(conv)
            if len(self.conversations) > 12:
                self.conversations.pop(0)
        user = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
        prompt = conv["history"] + user
        output = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
        conv["history"] = prompt + output
        if len(conv["history"]) > 160:
            self.conversations.remove(conv)
        self.next_rid += 1
        return {"rid": f"r{self.next_rid}", "prompt": prompt, "output": output,
                "priority": rng.choice((None, 0, 1, 2)), "extra_key": conv["extra_key"],
                "salt": conv["salt"], "conversation": conv}


class Replay:
    """Drives ours and SGLang's through one random sequence and compares after each step.

    Subclasses (the EAGLE and session tests) change the configuration (``CONFIG``: cache
    parameters for ``build_side``; ``server_args``), the scheduler's view of a side
    (``SIDE``), the requests (``WORKLOAD``) and the steps."""

    #: ``build_side`` keywords of this configuration.
    CONFIG: dict = {}
    #: Pool tokens by page size.
    POOLS: dict = POOL_TOKENS
    WORKLOAD: type = Workload
    SIDE: type = Side

    def server_args(self, page_size: int) -> dict:
        """The server arguments both sides are built with and the scheduler's code reads."""
        return {}

    def __init__(self, core: str, page_size: int, policy: str, seed: int, monkeypatch,
                 split_rule: bool = True, events: bool = True,
                 counting_allocator: bool = False, window: int = 0,
                 state: bool = False) -> None:
        monkeypatch.setattr(RadixcacheBackend, "core", core)
        backend_module.register()
        from sglang.srt.mem_cache.events import KvEventLoraNames

        def lora_names():
            names = KvEventLoraNames()
            names.register(types.SimpleNamespace(lora_id="id-a", extra_key="ns-a"), "adapter-a")
            return names

        server = self.server_args(page_size)
        pool = self.POOLS[page_size]
        sgl = build_side(None, page_size, policy, lora_names(), events, server_args=server,
                         pool_tokens=pool, window=window, state=state, **self.CONFIG)
        ours = build_side("radixcache", page_size, policy, lora_names(), events,
                          counting_allocator, server_args=server, pool_tokens=pool,
                          window=window, state=state, **self.CONFIG)
        assert type(sgl[0]).__name__ == "UnifiedRadixCache"
        assert isinstance(ours[0], RadixcacheBackend) and ours[0].radix_cache.core_name == core
        if split_rule:
            apply_split_rule(sgl[0])
        self.start(self.SIDE(*sgl), self.SIDE(*ours), seed, page_size,
                   _server_args(None, **server))

    def start(self, sgl: Side, ours: Side, seed: int, page_size: int, override) -> None:
        """Both sides, the workload, and ``override``: the install both sides were built
        without, which the scheduler's own code reads (installed until ``close``)."""
        self.sgl, self.ours = sgl, ours
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.work = self.WORKLOAD(self.rng, page_size)
        self.waiting: list[dict] = []
        self.steps = 0
        self.counts: dict = {}
        #: the fewest free slots radixcache's allocator had after any step (pool pressure)
        self.least_available = ours.allocator.available_size()
        self.override = override
        self.override.install()
        if sgl is not ours:
            self.compare("start")

    def close(self) -> None:
        self.override.restore()

    def both(self, what: str, *args):
        a = getattr(self.sgl, what)(*args)
        b = getattr(self.ours, what)(*args)
        assert a == b, f"step {self.steps} {what}{args[:1]}: SGLang {a} != radixcache {b}"
        count_result(self.counts, a, what)
        return a

    def compare(self, what: str) -> None:
        where = f"after step {self.steps} ({what})"
        self.least_available = min(self.least_available, self.ours.allocator.available_size())
        assert self.sgl.free_slots() == self.ours.free_slots(), f"free slots differ {where}"
        assert self.sgl.sizes() == self.ours.sizes(), f"sizes differ {where}"
        assert set(self.sgl.reqs) == set(self.ours.reqs), where
        for rid, req in self.sgl.reqs.items():
            mine = self.ours.reqs[rid]
            assert self.sgl.row(req) == self.ours.row(mine), f"row of {rid} differs {where}"
            assert req.kv.cache_protected_len == mine.kv.cache_protected_len, where
            assert req.prefix_len == mine.prefix_len, where
            if self.sgl.mamba:
                assert self.sgl.states(req) == self.ours.states(mine), (
                    f"state slots of {rid} differ {where}")
        sgl_events = self.sgl.cache.take_events()
        our_events = self.ours.cache.take_events()
        assert sgl_events == our_events, f"events differ {where}"
        self.counts["events"] = self.counts.get("events", 0) + len(sgl_events)

    def decode_args(self, rid: str) -> tuple:
        """The arguments of one decode step of ``rid`` (drawn here, the same for both)."""
        return (rid,)

    def admit_args(self, request: dict, chunk: int) -> tuple:
        """The arguments of the admission of a new request (``Workload.new_request``)."""
        return (request["rid"], request["prompt"], request["output"], request["priority"],
                request["extra_key"], request["salt"], chunk)

    def step(self) -> None:
        self.steps += 1
        rng = self.rng
        running = [rid for rid, r in self.sgl.reqs.items() if r.kv.holds_kv]
        chunked = [rid for rid in running if self.sgl.reqs[rid].extend_end
                   < len(self.sgl.reqs[rid].full_untruncated_fill_ids)]
        decoding = [rid for rid in running if rid not in chunked]
        retracted = [rid for rid, r in self.sgl.reqs.items() if not r.kv.holds_kv]
        roll = rng.random()
        chunk = rng.choice((8, 16, 32, 48, 1000))
        if roll < 0.22 and len(running) < ROWS - 1:
            if retracted and rng.random() < 0.5:
                rid = rng.choice(retracted)
                what = self.both("admit", rid, None, None, None, None, None, chunk)
            else:
                what = self.both("admit", *self.admit_args(self.work.new_request(), chunk))
        elif roll < 0.34 and chunked:
            what = self.both("continue_chunk", rng.choice(chunked), chunk)
        elif roll < 0.80 and decoding:
            if len(decoding) > 1 and rng.random() < 0.25:
                batch = rng.sample(decoding, rng.randrange(2, min(len(decoding), 4) + 1))
                what = self.both("decode_batch", [self.decode_args(rid) for rid in batch])
            else:
                what = self.both("decode", *self.decode_args(rng.choice(decoding)))
        elif roll < 0.84 and running:
            what = self.both("abort", rng.choice(running))
        elif roll < 0.87 and decoding:
            what = self.both("retract", rng.choice(decoding), len(running) - 1)
        elif roll < 0.91 and running:
            what = self.both("touch", rng.choice(running))
        elif roll < 0.94:
            probes = [(r["prompt"], r["extra_key"])
                      for r in (self.work.new_request() for _ in range(rng.randrange(1, 5)))]
            what = self.both("order", probes)
        elif roll < 0.97:
            what = self.both("evict", rng.randrange(0, 3 * self.page_size * 8))
        elif roll < 0.973:
            what = self.both("reset")
        else:
            what = ("idle",)
        self.compare(str(what[0]))

    @property
    def calls(self) -> int:
        return self.ours.cache.calls


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_same_as_sglang_default_cache(backend_core, monkeypatch, page_size, policy):
    seed = zlib.crc32(f"{page_size}-{policy}".encode())
    replay = Replay(backend_core, page_size, policy, seed=seed, monkeypatch=monkeypatch)
    try:
        for _ in range(STEPS):
            replay.step()
    finally:
        replay.close()
    counts = replay.counts
    # The sequence exercised what it claims: chunks, finishes, aborts, retractions,
    # evictions (allocator pressure), events, both caches' calls.
    for kind in ("chunk", "finished", "aborted", "retracted", "prefilled", "events"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    assert counts.get("reset", 0) >= 1, counts
    assert replay.least_available < POOL_TOKENS[page_size] // 4, replay.least_available
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


@pytest.mark.parametrize("policy", ("lru", "lfu"))
def test_same_as_sglang_default_cache_without_events(backend_core, monkeypatch, policy):
    """Events off: the backend's insert skips the event bookkeeping (another code path)."""
    replay = Replay(backend_core, 16, policy, seed=zlib.crc32(f"quiet-{policy}".encode()),
                    monkeypatch=monkeypatch, events=False)
    try:
        for _ in range(STEPS // 2):
            replay.step()
    finally:
        replay.close()
    assert replay.counts.get("finished", 0) > 5 and not replay.counts.get("events"), \
        replay.counts
    assert replay.least_available < POOL_TOKENS[16] // 4, replay.least_available
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_same_as_sglang_default_cache_on_an_unknown_allocator(backend_core, monkeypatch,
                                                              page_size):
    """An allocator the backend does not know (here a subclass of SGLang's stock one): the
    backend frees through its free_segment and reads its capacity from available_size,
    where for the stock allocators it does both itself (another code path)."""
    replay = Replay(backend_core, page_size, "lru",
                    seed=zlib.crc32(f"unknown-allocator-{page_size}".encode()),
                    monkeypatch=monkeypatch, counting_allocator=True)
    try:
        for _ in range(STEPS // 2):
            replay.step()
    finally:
        replay.close()
    counts = replay.counts
    assert counts.get("finished", 0) > 5 and counts.get("evict", 0) > 5, counts
    # (the stock paged allocator gets the backend's frees through free_page_ids instead)
    assert replay.ours.allocator.free_segment_calls > 50, replay.ours.allocator.free_segment_calls
    assert replay.least_available < POOL_TOKENS[page_size] // 4, replay.least_available
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


def test_split_rule_correction_matters(monkeypatch):
    """Without the correction SGLang's side is given, the two diverge: the comparison above
    can fail, and the stated difference is the only one it forgives."""
    replay = Replay("python", 16, "mru", seed=zlib.crc32(b"16-mru"), monkeypatch=monkeypatch,
                    split_rule=False)
    diverges(replay, STEPS)


def diverges(replay, steps: int) -> None:
    """``replay`` fails its comparison within ``steps`` steps."""
    try:
        with pytest.raises(AssertionError, match="differ|!="):
            for _ in range(steps):
                replay.step()
    finally:
        replay.close()


def test_hit_counting_per_request_matters(monkeypatch):
    """Counting a hit for every insert through a node (radixcache's default) instead of once
    per request, as SGLang does, makes the lfu order diverge: the comparison above sees it."""
    from radixcache import RadixCache

    insert = RadixCache.insert

    def every_insert_counts(self, *args, hits_from=0, **kwargs):
        return insert(self, *args, **kwargs)

    monkeypatch.setattr(RadixCache, "insert", every_insert_counts)
    replay = Replay("c" if "c" in _cores() else "python", 16, "lfu",
                    seed=zlib.crc32(b"16-lfu"), monkeypatch=monkeypatch)
    try:
        with pytest.raises(AssertionError, match="differ|!="):
            for _ in range(STEPS):
                replay.step()
    finally:
        replay.close()


def _cores() -> tuple:
    from radixcache._core import CORES

    return tuple(CORES)


def report_calls(module: str, calls: dict) -> None:
    """Print how many scheduler-level calls a test module compared with SGLang, per core."""
    if calls:
        print(f"\n{module}: scheduler-level calls compared with SGLang per core: "
              + ", ".join(f"{core} {count}" for core, count in sorted(calls.items())))


def teardown_module(module) -> None:
    report_calls("test_sglang_backend", CALLS)

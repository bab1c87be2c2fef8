"""radixcache's SGLang backend beside SGLang's default cache, in SGLang's own serving loop.

Two caches, both built through SGLang 0.5.23's registry and factory path over real pools (a
``ReqToTokenPool``, a token-to-KV allocator, an ``MHATokenToKVPool``):

- ``sglang``: SGLang's default, ``UnifiedRadixCache`` over the bundled Rust TreeCore (what
  SGLang builds for a full-attention model when ``--radix-cache-backend`` and
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` are unset; the run checks it got Rust), its
  bigram variant with EAGLE; with ``--enable-session-radix-cache`` over its Python TreeCore,
  which SGLang falls back to there (the Rust one refuses sessions; the run checks that too);
- ``radixcache``: ``--radix-cache-backend radixcache`` (compiled core).

Per request, on real ``Req`` objects made before the round: ``Req.init_next_round_input``
(match), ``tree_cache.lock``, a request row, ``prefix_device_indices``, the slots for prompt
and output from the allocator (``alloc_token_slots`` / ``alloc_paged_token_slots_extend``, which
evict through ``evict_for_alloc`` when the pool is short), then the finished request's
``release_kv_cache(..., checkpoint=True)`` (checkpoint into the tree, free the rest, unlock)
inside one free group of the allocator, as the scheduler's batch-result processing makes it
(``free_group_begin``/``free_group_end``: the release's frees are queued, then freed together).
Timed: the scheduler's calls into the cache (``CACHE_CALLS``: match, lock, prefix indices,
eviction, checkpoint, the row free and unlock of the release) -- "cache calls" --, the same
less the allocator's work inside them (the frees: the same slots for both caches) -- "w/o
allocator" --, and the whole loop, the scheduler's own work (request bookkeeping, allocation,
row writes) included -- "whole loop".

Workloads: synthetic chat (``radixcache.workloads.synthetic_chat``, 300 conversations, pool
65,536 tokens), pages 1 and 16; the Mooncake conversation trace (first 3,000 requests, 512
tokens per hash id, pool 2^21 tokens), page 16 (skipped without the trace). The same chat
with EAGLE speculative decoding (``is_eagle``: bigram keys; "eagle-chat-*"), and with the
session radix cache ("sessions-chat-*": each conversation a session, opened before its first
turn -- ``open_radix_session`` --, each request given its generation --
``ensure_session_generation`` --, closed after its last turn -- ``release_radix_session``;
the three are timed as cache calls too). The chat on a hybrid sliding-window model
(``swa-chat-page*``: SGLang's ``SWAKVPool`` and ``SWATokenToKVPoolAllocator``, a window of 128
tokens as GPT-OSS's, a window pool half the full-attention one; SGLang's default is its
``UnifiedRadixCache`` with the SWA component, on the Rust TreeCore); and on a Mamba /
linear-attention hybrid (``mamba-chat-page*``: SGLang's ``HybridReqToTokenPool`` with a
``MambaPool`` of 512 states, a ``HybridLinearKVPool``, a Mamba chunk of 64 tokens as
Qwen3-Next's; page 16 with ``--mamba-extra-buffer``, the forward pass's state tracking stood in
for as in the differential tests; the request row and its state slots come from
``alloc_req_slots``, which evicts states through the cache; SGLang's default is its
``UnifiedRadixCache`` with the Mamba component, on the Rust TreeCore).

``mooncake-hicache``: the same trace with ``--enable-hierarchical-cache``
(``--hicache-write-policy write_back``), a device pool of 2^18 tokens and a host pool four
times that: SGLang's default (``UnifiedRadixCache`` with HiCache, Rust TreeCore) beside
``HiCacheBackend``, both over SGLang's own host pools and cache controller. The loop adds the
scheduler's HiCache steps: ``init_load_back`` for a host hit, ``ready_to_load_host_cache``,
``flush_pending_backups`` after the batch and ``check_hicache_events`` before the next; the
hit rate counts device and host hits. On this CPU machine SGLang's copies between device and
host run with the CPU stand-ins of tests/integrations/test_sglang_hicache.py. The copies, the
host pool's allocation and frees and the controller's queueing are SGLang's own code, the same
for both caches: "w/o allocator" leaves them out with the allocator's frees.

The "floor" row is SGLang's cache-call time over the allocator's and controller's work inside
it: the cache-call ratio a backend would reach if its own work took no time and it made the
same allocator and controller calls (radixcache's batched frees make less of that work with a
sliding window, so its ratio there is above this row).

    python benchmarks/bench_sglang_backend.py --rounds 7     # interleaved rounds: the ratios
    python -m pytest benchmarks/bench_sglang_backend.py --benchmark-group-by=group \\
        --benchmark-columns=min,mean,rounds

Skipped without SGLang (``bash tests/install_sglang.sh``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from array import array
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parent
for _path in (str(BENCH_DIR.parent), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _cases import trace_file
from radixcache._core import CORES
from radixcache.traces import read_trace
from radixcache.workloads import FRESH_TOKEN_BASE, synthetic_chat

try:
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache import registry
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocation import (alloc_paged_token_slots_extend,
                                                 alloc_req_slots, alloc_token_slots)
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, HybridReqToTokenPool,
                                                  MHATokenToKVPool, ReqToTokenPool)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.runtime_context import _CONTEXT, mamba_checkpoint_grid
    from sglang.srt.sampling.sampling_params import SamplingParams
except Exception as exc:  # ImportError, or one of SGLang's own imports failing
    pytest.skip(f"SGLang 0.5.23 is not importable ({type(exc).__name__}: {exc}); "
                "install it with `bash tests/install_sglang.sh`", allow_module_level=True)

from radixcache.integrations import sglang as backend_module

torch.set_num_threads(1)
IMPLEMENTATIONS = ("radixcache", "sglang")
TRACE = Path(os.environ.get("RADIXCACHE_MOONCAKE_CONVERSATION", trace_file("conversation")[0]))
#: The HiCache case's host pool, relative to the device pool, and its write policy.
HICACHE_RATIO, HICACHE_WRITE_POLICY = 4.0, "write_back"
HICACHE_CALLS = ("init_load_back", "ready_to_load_host_cache", "flush_pending_backups",
                 "check_hicache_events")
#: SGLang's cache controller's methods a HiCache cache calls (host allocation, queueing and
#: the copies: the same work for both caches, left out of "w/o allocator" with the frees).
CONTROLLER_CALLS = ("write", "load", "start_writing", "start_loading")
CASES = {  # name -> (page size, pool tokens, configuration: None, "eagle", "sessions", "hicache")
    "chat-page1": (1, 1 << 16, None),
    "chat-page16": (16, 1 << 16, None),
    "mooncake-page16": (16, 1 << 21, None),
    "mooncake-hicache": (16, 1 << 18, "hicache"),
    "eagle-chat-page1": (1, 1 << 16, "eagle"),
    "eagle-chat-page16": (16, 1 << 16, "eagle"),
    "sessions-chat-page1": (1, 1 << 16, "sessions"),
    "sessions-chat-page16": (16, 1 << 16, "sessions"),
    "swa-chat-page1": (1, 1 << 16, None),
    "swa-chat-page16": (16, 1 << 16, None),
    "mamba-chat-page1": (1, 1 << 16, None),
    "mamba-chat-page16": (16, 1 << 16, None),
}
#: The server arguments of each configuration (published while the caches are built and run).
SERVER_ARGS = {
    None: {},
    "eagle": dict(speculative_algorithm="EAGLE", speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4),
    "sessions": dict(enable_session_radix_cache=True),
    "hicache": dict(enable_hierarchical_cache=True, hicache_ratio=HICACHE_RATIO, hicache_size=0,
                    hicache_write_policy=HICACHE_WRITE_POLICY, hicache_io_backend="direct",
                    hicache_mem_layout="layer_first"),
}
#: The sliding window of the hybrid cases (GPT-OSS's).
SWA_WINDOW = 128
#: The Mamba hybrids' chunk (Qwen3-Next's) and Mamba pool (states).
MAMBA_CHUNK = 64
MAMBA_STATES = 512
MOONCAKE_REQUESTS = 3000
#: The allocator's methods a cache calls (their time inside cache calls is "allocator").
ALLOCATOR_CALLS = ("free", "free_segment", "free_segments", "free_page_ids", "available_size",
                   "free_swa_segment", "free_full_segment", "translate_loc_from_full_to_swa",
                   "set_full_to_swa_mapping", "clear_full_to_swa_mapping",
                   "full_available_size", "swa_available_size")
#: The Mamba state allocator's methods (likewise).
MAMBA_ALLOCATOR_CALLS = ("alloc", "free", "available_size", "schedulable_available_size")
#: The cache methods the loop's scheduler code calls (timed as "cache").
CACHE_CALLS = ("match_prefix", "lock", "unlock", "prefix_device_indices", "evict_for_alloc",
               "evict", "checkpoint", "free_kv_row", "claim_kv_row", "on_release",
               "open_radix_session", "ensure_session_generation", "release_radix_session")


def workload(case: str) -> list:
    """(prompt, output) token arrays per request, fresh output ids fixed in advance."""
    if "chat" in case:
        requests = synthetic_chat(num_conversations=300, num_system_prompts=16, seed=0)
    else:
        if not TRACE.is_file():
            pytest.skip(f"the Mooncake conversation trace is not at {TRACE}")
        cpu_stand_ins()
        requests = list(read_trace(TRACE, block_size=512, limit=MOONCAKE_REQUESTS))
    fixed = []
    fresh = FRESH_TOKEN_BASE
    for request in requests:
        output = request.output
        if output is None:
            output = range(fresh, fresh + request.output_len)
            fresh += request.output_len
        fixed.append((array("q", request.prompt.tolist()), array("q", output)))
    return fixed


def conversations(requests: list) -> list:
    """Each request's conversation (the index of its first turn): a later turn's prompt begins
    with the previous turn's prompt and answer, found by that history's length and last
    tokens (random ids: no two histories share them)."""
    ends: dict = {}  # (length, last 8 tokens) of a conversation's history -> conversation
    lengths: list = []
    owner = []
    for index, (prompt, output) in enumerate(requests):
        conversation = index
        for length in lengths:
            if length <= len(prompt):
                key = (length, prompt[length - 8:length].tobytes())
                if key in ends:
                    conversation = ends.pop(key)
                    break
        history = len(prompt) + len(output)
        tail = (prompt + output)[-8:]
        ends[(history, tail.tobytes())] = conversation
        if history not in lengths:
            lengths.append(history)
        owner.append(conversation)
    return owner


class _Worker:
    """The TP worker's one HiCache call."""

    def register_hicache_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


def _copy_rows(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``sgl_kernel``'s ``transfer_kv_direct`` (CUDA) as torch indexing, as in the tests."""
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def cpu_stand_ins() -> None:
    """What SGLang's HiCache needs to run on a CPU (see tests/integrations/
    test_sglang_hicache.py): no pinning registration, a no-op stream sync, torch copies."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    common._cuda_host_register = lambda *args, **kwargs: None
    torch.cpu.Stream.synchronize = lambda self: None
    mha.transfer_kv_direct = _copy_rows


class Loop:
    """One implementation's cache and pools, and the loop over a workload."""

    def __init__(self, implementation: str, case: str, requests: list) -> None:
        page_size, pool, configuration = CASES[case]
        self.page_size = page_size
        longest = max(len(p) + len(o) for p, o in requests) + 2 * page_size
        swa, self.mamba = case.startswith("swa"), case.startswith("mamba")
        if self.mamba:
            with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
                shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8,
                                                n_groups=1, num_heads=2, head_dim=4,
                                                state_size=4, conv_kernel=2)
            self.rows = HybridReqToTokenPool(
                size=2, mamba_size=MAMBA_STATES, mamba_spec_state_size=2,
                max_context_len=longest, device="cpu", enable_memory_saver=False,
                cache_params=Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
                enable_mamba_extra_buffer=page_size > 1, speculative_num_draft_tokens=3)
        else:
            self.rows = ReqToTokenPool(size=2, max_context_len=longest, device="cpu",
                                       enable_memory_saver=False)
        if swa:
            kv_pool = SWAKVPool(size=pool, size_swa=pool // 2, page_size=page_size,
                                dtype=torch.float16, head_num=1, head_dim=1,
                                swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                                device="cpu")
            self.allocator = SWATokenToKVPoolAllocator(pool, pool // 2, page_size,
                                                       torch.float16, "cpu", kv_pool,
                                                       need_sort=False)
        else:
            if self.mamba:
                kv_pool = HybridLinearKVPool(size=pool, dtype=torch.float16,
                                             page_size=page_size, head_num=1, head_dim=1,
                                             full_attention_layer_ids=[1], device="cpu",
                                             enable_memory_saver=False,
                                             mamba_pool=self.rows.mamba_pool)
            else:
                kv_pool = MHATokenToKVPool(size=pool, page_size=page_size, dtype=torch.float16,
                                           head_num=1, head_dim=1, layer_num=1, device="cpu",
                                           enable_memory_saver=False)
            if page_size == 1:
                self.allocator = TokenToKVPoolAllocator(pool, torch.float16, "cpu", kv_pool,
                                                        need_sort=False)
            else:
                self.allocator = PagedTokenToKVPoolAllocator(pool, page_size, torch.float16,
                                                             "cpu", kv_pool, need_sort=False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.rows,
                                 token_to_kv_pool_allocator=self.allocator,
                                 page_size=page_size, is_eagle=configuration == "eagle",
                                 enable_session_radix_cache=configuration == "sessions",
                                 sliding_window_size=SWA_WINDOW if swa else None,
                                 enable_mamba_extra_buffer=self.mamba and page_size > 1)
        backend = "radixcache" if implementation == "radixcache" else None
        backend_module.register()
        self.hicache = configuration == "hicache"
        with _CONTEXT.override_server_args(radix_cache_backend=backend,
                                           **SERVER_ARGS[configuration]) as args:
            args._mamba_cache_chunk_size = MAMBA_CHUNK
            self.grid = mamba_checkpoint_grid(page_size) if self.mamba else 0
            ctx = registry.TreeCacheBuildContext(
                server_args=args, params=params, is_hybrid_swa=swa, is_hybrid_ssm=self.mamba,
                enable_hierarchical_cache=self.hicache, disable_radix_cache=False,
                tp_worker=_Worker(), model_config=None, tp_size=1, tp_rank=0, tp_group=None)
            self.cache = registry.create_tree_cache(ctx)
        if implementation == "sglang":
            # SGLang's default: its Rust TreeCore (with EAGLE its bigram variant); with
            # sessions SGLang itself falls back to its Python TreeCore.
            expected = "python" if configuration == "sessions" else "rust"
            if self.cache._tree_core_backend != expected:
                pytest.skip(f"SGLang built its {self.cache._tree_core_backend} TreeCore "
                            f"where it builds the {expected} one by default")
            assert self.cache.tree_core.is_eagle == (configuration == "eagle")
        self.sessions = None
        if configuration == "sessions":
            owner = conversations(requests)
            last = {conversation: index for index, conversation in enumerate(owner)}
            # (session id, opens it, closes it) per request
            self.sessions = [(f"s{conversation}", conversation == index,
                              last[conversation] == index)
                             for index, conversation in enumerate(owner)]
        self.requests = [Req(f"r{i}", "", prompt, SamplingParams(max_new_tokens=len(output)),
                             session_id=None if self.sessions is None else self.sessions[i][0])
                         for i, (prompt, output) in enumerate(requests)]

        self.outputs = [output for _, output in requests]
        self._depth, self._seconds, self._allocator_seconds = [0], [0.0], [0.0]
        for name in CACHE_CALLS + (HICACHE_CALLS if self.hicache else ()):
            self._time_calls(name)
        for name in ALLOCATOR_CALLS:
            self._time_allocator(name)
            # SWA: the pools' own allocators too, which a cache may call directly (nested
            # calls from the SWA allocator are counted once)
            for pool_allocator in (getattr(self.allocator, "full_attn_allocator", None),
                                   getattr(self.allocator, "swa_attn_allocator", None)):
                if pool_allocator is not None:
                    self._time_allocator(name, pool_allocator)
        if self.mamba:
            for name in MAMBA_ALLOCATOR_CALLS:
                self._time_allocator(name, self.rows.mamba_allocator)
        if self.hicache:  # SGLang's controller and host pools: the same work for both caches
            controller = self.cache.cache_controller
            for name in CONTROLLER_CALLS:
                self._time_allocator(name, controller)
            group = controller.mem_pool_host
            for name in ("free", "available_size"):
                self._time_allocator(name, group)
                self._time_allocator(name, group.anchor_entry.host_pool)

    def _time_allocator(self, name: str, owner=None) -> None:
        """Time the allocator's work done inside the cache's calls (the frees a cache makes:
        the same slots for both caches); ``owner``: the Mamba allocator, the controller or a
        host pool instead."""
        owner = self.allocator if owner is None else owner
        method = getattr(owner, name, None)
        if method is None:  # (each kind of allocator has some of them)
            return
        clock = time.perf_counter
        depth, seconds = self._depth, self._allocator_seconds

        def timed(*args, **kwargs):
            if depth[0] != 1:
                return method(*args, **kwargs)
            depth[0] = 2
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += clock() - start
                depth[0] = 1

        setattr(owner, name, timed)

    def _time_calls(self, name: str) -> None:
        """Time the scheduler's calls of ``name`` on this cache (outermost calls only: a
        checkpoint's own lock is inside the checkpoint's time)."""
        method = getattr(self.cache, name)
        clock = time.perf_counter
        depth, seconds = self._depth, self._seconds

        def timed(*args, **kwargs):
            if depth[0]:
                return method(*args, **kwargs)
            depth[0] = 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += clock() - start
                depth[0] = 0

        setattr(self.cache, name, timed)

    def track(self, req: Req, length: int) -> None:
        """The forward pass's state tracking with ``--mamba-extra-buffer`` (no model runs
        here): the state at the last checkpoint boundary was written to the request's next
        ping-pong slot, which becomes its tracked state."""
        kv = req.kv
        boundary = length // self.grid * self.grid
        if boundary:
            slot = kv.mamba_next_track_idx or 0
            kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
            kv.mamba_last_track_seqlen = boundary
            kv.mamba_last_track_idx = slot
            kv.mamba_next_track_idx = self.rows.get_mamba_ping_pong_other_idx(slot)

    def run(self) -> dict:
        """One pass over the workload (under the case's server arguments: ``serving``)."""
        clock = time.perf_counter
        cache, rows, page_size, mamba = self.cache, self.rows, self.page_size, self.mamba
        allocator = self.allocator
        sessions = self.sessions
        prompt_tokens = cached_tokens = host_tokens = 0
        loop_start = clock()
        hicache = self.hicache
        for index, (req, output) in enumerate(zip(self.requests, self.outputs)):
            if sessions is not None:  # the scheduler's session calls
                session, opens, closes = sessions[index]
                if opens:
                    cache.open_radix_session(session)
                req.session_generation = cache.ensure_session_generation(session)
            if hicache:
                cache.check_hicache_events()
            req.init_next_round_input(cache)
            if hicache and req.host_hit_length > 0:
                lock = cache.lock(req.last_node)  # PrefillAdder.add_one_req's pin
                loaded, req.last_node = cache.init_load_back(InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length,
                    req=req))
                req.prefix_len += loaded
                host_tokens += loaded
                req.kv.cache_protected_len = req.prefix_len
                cache.unlock(lock)
            req.lock = cache.lock(req.last_node)
            if hicache:
                cache.ready_to_load_host_cache()
            prefix = cache.prefix_device_indices(req)
            prefix_len = req.prefix_len
            prompt_tokens += len(req.origin_input_ids)
            cached_tokens += prefix_len
            if mamba:  # (the row and its state slots; states evicted if short)
                alloc_req_slots(rows, [req], cache)
            else:
                rows.alloc([req])
            row = req.kv.req_pool_idx
            rows.write((row, slice(0, prefix_len)), prefix)
            total = len(req.origin_input_ids) + len(output)
            need = total - prefix_len
            if page_size == 1:
                slots = alloc_token_slots(cache, need)
            else:
                lens = torch.tensor([prefix_len])
                ends = torch.tensor([total])
                last = torch.tensor([-1 if prefix_len == 0 else int(prefix[-1])])
                slots = alloc_paged_token_slots_extend(cache, lens, lens, ends, ends, last, need)
            rows.write((row, slice(prefix_len, total)), slots)
            req.output_ids.extend(output)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = total
            if mamba and req.kv.mamba_ping_pong_track_buffer is not None:
                self.track(req, total)
            req.finished_reason = FINISH_LENGTH(length=len(output))
            # The scheduler releases a batch's finished requests inside one free group
            # (process_batch_result_decode): their frees are queued, then freed together.
            allocator.free_group_begin()
            release_kv_cache(req, cache, checkpoint=True)
            allocator.free_group_end()
            if sessions is not None and closes:
                cache.release_radix_session(session)
            if hicache:
                cache.flush_pending_backups()
        loop_seconds = clock() - loop_start
        return {"cache": self._seconds[0], "loop": loop_seconds,
                "tree": self._seconds[0] - self._allocator_seconds[0],
                "hit_rate": cached_tokens / prompt_tokens,
                "host_hit_rate": host_tokens / prompt_tokens,
                "tokens": cache.total_size()[0]}


@contextlib.contextmanager
def serving(case: str):
    """The server arguments of ``case``'s configuration, published (a context manager): what
    SGLang's scheduler code reads while the caches are built and run."""
    with _CONTEXT.override_server_args(radix_cache_backend=None,
                                       **SERVER_ARGS[CASES[case][2]]) as args:
        args._mamba_cache_chunk_size = MAMBA_CHUNK
        yield args


def interleaved(cases: list, rounds: int) -> dict:
    """Each case's implementations one round each in turn; the best round of each."""
    results = {}
    for case in cases:
        with serving(case):
            results[case] = interleaved_case(case, rounds)
    return results


def interleaved_case(case: str, rounds: int) -> dict:
    """``interleaved`` for one case (its server arguments published)."""
    requests = workload(case)
    best: dict = {}
    for rnd in range(rounds + 1):  # round 0 warms up, uncounted
        for name in IMPLEMENTATIONS:
            loop = Loop(name, case, requests)
            gc.collect()
            gc.disable()
            try:
                run = loop.run()
            finally:
                gc.enable()
            del loop
            if rnd:
                old = best.setdefault(name, dict(run))
                for what in ("cache", "tree", "loop"):
                    old[what] = min(old[what], run[what])
    assert best["radixcache"]["hit_rate"] > 0
    return best


def print_table(results: dict, rounds: int) -> None:
    print(f"best of {rounds} interleaved rounds; ratio = SGLang's time / radixcache's")
    print(f"{'case':17s} {'impl':11s} {'cache calls':>12s} {'w/o allocator':>14s} "
          f"{'whole loop':>11s} {'hit rate':>9s}")
    for case, best in results.items():
        ours = best["radixcache"]
        for name, run in best.items():
            host = (f" (host {run['host_hit_rate']:.4f})" if case.endswith("hicache") else "")
            print(f"{case:17s} {name:11s} {run['cache'] * 1e3:10.1f}ms {run['tree'] * 1e3:12.1f}ms"
                  f" {run['loop'] * 1e3:9.1f}ms {run['hit_rate']:9.4f}{host}")
        theirs = best["sglang"]
        print(f"{case:17s} {'ratio':11s} {theirs['cache'] / ours['cache']:11.2f}x "
              f"{theirs['tree'] / ours['tree']:13.2f}x {theirs['loop'] / ours['loop']:10.2f}x")
        # The cache-call ratio a backend would reach if its own work took no time: SGLang's
        # calls over the allocator's (and controller's) work inside them, were it the same.
        shared = theirs["cache"] - theirs["tree"]
        if shared > 0:
            print(f"{case:17s} {'floor':11s} {theirs['cache'] / shared:11.2f}x")


@pytest.mark.skipif("c" not in CORES, reason="the compiled core is not built")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_sglang_backend_loop(benchmark, note, implementation, case):
    benchmark.group = f"SGLang scheduler loop: {case}"
    requests = workload(case)
    runs = []

    def fresh():
        return (Loop(implementation, case, requests),), {}

    with serving(case):
        benchmark.pedantic(lambda loop: runs.append(loop.run()), setup=fresh, rounds=3,
                           iterations=1, warmup_rounds=1)
    assert len({run["hit_rate"] for run in runs}) == 1
    best = min(run["cache"] for run in runs)
    benchmark.extra_info.update(cache_seconds_min=best, hit_rate=runs[0]["hit_rate"])
    note(f"cache calls only: min {best * 1e3:.1f} ms; hit rate {runs[0]['hit_rate']:.4f}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    table = interleaved([c for c in args.cases.split(",") if c], args.rounds)
    print_table(table, args.rounds)

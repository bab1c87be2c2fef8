"""With EAGLE speculative decoding the radixcache backend decides as SGLang's default cache does.

The harness of test_sglang_backend.py (both caches built through SGLang's registry and factory
on real pools, real ``Req`` objects, SGLang's scheduler functions, compared after every step:
match lengths, request rows, free slots, sizes, KV events), with ``CacheInitParams.is_eagle``
set as SGLang sets it for EAGLE, EAGLE3, NEXTN/MTP and FROZEN_KV_MTP: both caches key by token
pairs (bigrams). SGLang's side runs its Python TreeCore (the split rule is applied to it, as
there); its Rust core, SGLang's default with EAGLE, keeps the same decisions.

Decoding is speculative, as SGLang's EAGLE worker drives the cache: each step reserves slots
through SGLang's ``page_aligned_decode_alloc_lens`` and ``alloc_for_spec_decode`` (which evict
through ``evict_for_alloc``), then accepts 1 to 4 tokens; a finished request's release frees
the over-allocated tail (``_release_overallocated_kv_indices``, with the speculative algorithm
published). Two stand-ins: ``alloc_for_spec_decode`` reads the device and HiSparse
coordinator of its ``ScheduleBatch`` argument, which needs a model to build (a namespace with
those two fields takes its place), and writes the new slots into the request rows with a Triton
kernel (or ``sgl_kernel``'s CPU op, not installed here): a torch loop does the same writes.
"""

from __future__ import annotations

import types
import zlib

import pytest
import torch

from test_sglang_backend import (POLICIES, POOL_TOKENS, Replay, Side, Workload,
                                 report_calls)

from sglang.srt.mem_cache import allocation
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.mem_cache.allocation_sizing import (get_alloc_reserve_per_decode,
                                                    page_aligned_decode_alloc_lens)

#: Random scheduler steps per (core, page size, policy) sequence: about 10^5 scheduler-level
#: calls per core over the fourteen sequences.
EAGLE_STEPS = 1200
#: Scheduler-level calls into our cache, per core (summed in the closing line).
CALLS: dict = {}
#: What alloc_for_spec_decode reads of its batch (see the module docstring).
_BATCH = types.SimpleNamespace(device="cpu", hisparse_coordinator=None)


def _assign_rows(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                 batch_size) -> None:
    """SGLang's ``assign_req_to_token_pool_func``: request ``i``'s row gets the next
    ``end_offset[i] - start_offset[i]`` slots of ``out_cache_loc`` from ``start_offset[i]``."""
    at = 0
    for i in range(batch_size):
        row, start, end = (int(req_pool_indices[i]), int(start_offset[i]),
                           int(end_offset[i]))
        req_to_token[row, start:end] = out_cache_loc[at:at + end - start]
        at += end - start


class EagleSide(Side):
    """A side whose decode steps are EAGLE's: reserve, then accept several tokens."""

    spec_evictions = 0

    def decode(self, rid: str, accepted: int) -> tuple:
        req = self.reqs[rid]
        planned = req.planned_output
        if len(req.output_ids) >= len(planned):
            return self.finish(req)
        page_size = self.allocator.page_size
        cur, nxt, need = page_aligned_decode_alloc_lens(
            [req], reserve=get_alloc_reserve_per_decode(), page_size=page_size)
        if need:
            room = self.allocator.available_size() + self.cache.evictable_size()
            if room < need + page_size:
                return ("stalled",)
            evictable = self.cache.evictable_size()
            alloc_for_spec_decode(
                self.cache, self.rows, reqs=[req],
                req_pool_indices=torch.tensor([req.kv.req_pool_idx]),
                cur_kv_lens=torch.tensor(cur), cur_kv_lens_cpu=torch.tensor(cur),
                nxt_kv_lens=torch.tensor(nxt), nxt_kv_lens_cpu=torch.tensor(nxt),
                num_needed_tokens=need, batch=_BATCH)
            if self.cache.evictable_size() < evictable:
                self.spec_evictions += 1
        accepted = min(accepted, len(planned) - len(req.output_ids))
        req.kv.kv_committed_len += accepted
        req.output_ids.extend(planned[len(req.output_ids):len(req.output_ids) + accepted])
        return ("decoded", req.kv.kv_committed_len, req.kv.kv_allocated_len)


class EagleWorkload(Workload):
    """The conversations over shared system prompts, and two more system prompts that differ
    from two of those in their first token only: their bigrams differ from the first, so
    nothing of one matches the other, however much of the rest they share."""

    def __init__(self, rng, page_size: int) -> None:
        super().__init__(rng, page_size)
        self.systems += [[system[0] + 1] + system[1:] for system in self.systems[:2]]


class EagleReplay(Replay):
    CONFIG = {"is_eagle": True}
    SIDE = EagleSide
    WORKLOAD = EagleWorkload
    #: A smaller paged pool: a speculative step reserves whole pages, and these must run
    #: short often enough to evict.
    POOLS = {1: POOL_TOKENS[1], 16: 512}

    def server_args(self, page_size: int) -> dict:
        return dict(speculative_algorithm="EAGLE", speculative_num_steps=3,
                    speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                    page_size=page_size, attention_backend="torch_native")

    def decode_args(self, rid: str) -> tuple:
        return (rid, self.rng.randrange(1, 5))


def run_eagle(core: str, page_size: int, policy: str, monkeypatch, steps: int = EAGLE_STEPS,
              **options) -> EagleReplay:
    monkeypatch.setattr(allocation, "assign_req_to_token_pool_func", _assign_rows)
    replay = EagleReplay(core, page_size, policy,
                         seed=zlib.crc32(f"eagle-{page_size}-{policy}".encode()),
                         monkeypatch=monkeypatch, **options)
    try:
        assert replay.ours.cache.is_eagle and replay.sgl.cache.tree_core.is_eagle
        for _ in range(steps):
            replay.step()
    finally:
        replay.close()
    return replay


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", (1, 16), ids=lambda p: f"page{p}")
def test_eagle_same_as_sglang_default_cache(backend_core, monkeypatch, page_size, policy):
    replay = run_eagle(backend_core, page_size, policy, monkeypatch)
    counts = replay.counts
    # The sequence exercised what it claims: chunks, speculative decode steps, finishes,
    # aborts, retractions, events, and speculative allocations that had to evict.
    for kind in ("chunk", "decoded", "finished", "aborted", "retracted", "prefilled",
                 "events"):
        assert counts.get(kind, 0) > 5, (kind, counts)
    assert replay.ours.spec_evictions > 5, replay.ours.spec_evictions
    CALLS[backend_core] = CALLS.get(backend_core, 0) + replay.calls


def teardown_module(module) -> None:
    report_calls("test_sglang_backend_eagle", CALLS)

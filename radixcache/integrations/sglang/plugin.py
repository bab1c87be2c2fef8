"""The plugin side of the SGLang integration: registration and the start-up checks.

``register()`` is the ``sglang.srt.plugins`` entry point: it files ``create_backend`` under the
name ``radixcache`` in SGLang's radix-cache registry. ``create_backend`` is the factory SGLang
calls when the scheduler builds its cache: it refuses, before the server starts serving, what
the backend does not serve (``_refusal``), and builds a ``RadixcacheBackend`` otherwise.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .backend import RadixcacheBackend

logger = logging.getLogger(__name__)

#: The name ``--radix-cache-backend`` selects this cache by.
BACKEND_NAME = "radixcache"

#: ``--radix-eviction-policy`` values this cache serves exactly as SGLang's own cache does.
SUPPORTED_EVICTION_POLICIES = ("lru", "lfu", "fifo", "filo", "mru", "slru", "priority")

_DROP_FLAG = "drop --radix-cache-backend radixcache to use SGLang's own cache"


class UnsupportedConfiguration(ValueError):
    """A server configuration the radixcache backend does not serve (raised at start-up)."""


# -- registration ------------------------------------------------------------------------------
def register() -> None:
    """The ``sglang.srt.plugins`` entry point: file ``create_backend`` as ``radixcache``.

    Safe to call any number of times in one process. A different factory already filed under
    the name is left in place (with a warning).
    """
    from sglang.srt.mem_cache import registry  # only when SGLang asks

    existing = registry.get_radix_cache_factory(BACKEND_NAME)
    if existing is create_backend:
        return
    if existing is not None:
        logger.warning("radix-cache backend %r is already registered to %r; radixcache "
                       "leaves it in place", BACKEND_NAME, existing)
        return
    registry.register_radix_cache_backend(BACKEND_NAME, create_backend)


def _setting(namespace: str, name: str) -> Any:
    """A published server setting (``get_memory().enable_lmcache``...), None if absent."""
    from sglang.srt import runtime_context

    try:
        bag = getattr(runtime_context, f"get_{namespace}")()
        return getattr(bag, name)
    except (AttributeError, ValueError):  # namespace not published, or no such setting
        return None


def _refusal(ctx: Any) -> Optional[str]:
    """Why this server configuration cannot run on radixcache (None: it can)."""
    params = ctx.params
    if ctx.disable_radix_cache or params.disable:
        return ("--disable-radix-cache turns prefix caching off, so there is nothing for "
                "radixcache to do: drop one of the two flags")
    if ctx.is_hybrid_swa and ctx.is_hybrid_ssm:
        return ("this model has both sliding-window and Mamba/linear-attention layers; "
                f"radixcache caches one of the two beside full attention; {_DROP_FLAG}")
    if (ctx.is_hybrid_swa or ctx.is_hybrid_ssm) and params.is_eagle:
        return ("EAGLE-family speculative decoding (bigram keys) on a hybrid sliding-window "
                "model: radixcache's hybrid core keys plain tokens only; "
                f"{_DROP_FLAG}, or serve without speculative decoding")
    if (ctx.is_hybrid_swa or ctx.is_hybrid_ssm) and params.enable_session_radix_cache:
        return ("--enable-session-radix-cache on a hybrid model: radixcache keeps session "
                f"references for full-attention models only; {_DROP_FLAG}, or drop "
                "--enable-session-radix-cache")
    if ctx.is_hybrid_ssm:
        reason = _mamba_refusal(params)
        if reason is not None:
            return reason
    if getattr(ctx, "full_tokens_per_layer", None) == 0:
        return f"this model has no full-attention KV (pure SWA); {_DROP_FLAG}"
    if ctx.is_hybrid_swa:
        reason = _swa_refusal(params)
        if reason is not None:
            return reason
    if hasattr(params.req_to_token_pool, "req_to_c128_sidecar"):
        return f"this model keeps C128 sidecar pages next to its KV; {_DROP_FLAG}"
    if _setting("memory", "enable_lmcache"):
        return f"--enable-lmcache needs SGLang's unified radix tree; {_DROP_FLAG}"
    if _setting("memory", "enable_flexkv"):
        return f"--enable-flexkv needs SGLang's own cache; {_DROP_FLAG}"
    if _setting("memory", "enable_unified_cache_external_linker"):
        return ("--enable-unified-cache-external-linker needs SGLang's unified radix tree; "
                f"{_DROP_FLAG}")
    if _setting("disagg", "disaggregation_decode_retraction_backup") == "host_pool":
        return ("--disaggregation-decode-retraction-backup host_pool backs retracted requests "
                f"up through SGLang's unified radix tree; {_DROP_FLAG}")
    if _setting("serving", "enable_streaming_session"):
        return ("--enable-streaming-session keeps each session's request row inside SGLang's "
                "own cache between turns (SGLang accepts no other cache class for it); "
                f"{_DROP_FLAG}, or serve the sessions without streaming "
                "(--enable-session-radix-cache runs on radixcache)")
    try:
        from sglang.srt.hardware_backend.mlx.runtime import use_mlx

        mlx = use_mlx()
    except ImportError:
        mlx = False
    if mlx:
        return f"the MLX backend keeps its KV state in SGLang's own cache; {_DROP_FLAG}"
    from sglang.srt.mem_cache.allocator.page_interleave import (
        page_interleave_shard_size,
    )

    if page_interleave_shard_size(params.token_to_kv_pool_allocator) > 1:
        return ("sharded KV pages (rotation bases) need SGLang's unified radix tree; "
                f"{_DROP_FLAG}")
    policy = params.eviction_policy
    if not isinstance(policy, str) or policy.lower() not in SUPPORTED_EVICTION_POLICIES:
        why = {"tlru": "T-LRU's per-node tail bookkeeping lives in SGLang's unified tree"}
        reason = why.get(str(policy).lower(), "radixcache does not know it")
        return (f"--radix-eviction-policy {policy}: {reason}; use one of "
                f"{', '.join(SUPPORTED_EVICTION_POLICIES)}, or {_DROP_FLAG}")
    if params.eviction_policy_config:
        takes = ("radixcache's slru protects a node from its second hit on (SGLang's default "
                 "protected_threshold, 2)" if policy.lower() == "slru"
                 else f"the {policy} policy takes no options")
        return (f"--radix-eviction-policy-config {params.eviction_policy_config!r}: {takes}; "
                "drop the flag")
    return None


def _swa_refusal(params: Any) -> Optional[str]:
    """Why a hybrid sliding-window configuration cannot run on radixcache (None: it can)."""
    allocator = params.token_to_kv_pool_allocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    if type(allocator) is not SWATokenToKVPoolAllocator:
        return (f"its sliding-window KV lives in a {type(allocator).__name__}, whose pages "
                "radixcache does not remap (it serves SWATokenToKVPoolAllocator); "
                f"{_DROP_FLAG}")
    if allocator.swa_req_ring:
        return ("its sliding-window KV is a per-request ring, which no tree node owns; "
                f"{_DROP_FLAG}")
    if not params.swa_gates_prefix_match:
        return ("its sliding-window slots do not gate prefix matching (a draft-only window), "
                f"which radixcache does not model; {_DROP_FLAG}")
    if params.decoder_swa_bounded_replay:
        return f"bounded SWA replay needs SGLang's unified radix tree; {_DROP_FLAG}"
    if not params.sliding_window_size or params.sliding_window_size <= 0:
        return f"the model reports no sliding window size; {_DROP_FLAG}"
    return None


def _mamba_refusal(params: Any) -> Optional[str]:
    """Why a Mamba / linear-attention configuration cannot run on radixcache (None: it can)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    pool = params.req_to_token_pool
    if type(pool) is not HybridReqToTokenPool:
        return (f"its Mamba states live in a {type(pool).__name__}, whose slots radixcache does "
                f"not manage (it serves HybridReqToTokenPool); {_DROP_FLAG}")
    if getattr(pool, "mamba_ckpt_pool", None) is not None:
        return f"int8 Mamba checkpoints need SGLang's unified radix tree; {_DROP_FLAG}"
    allocator = params.token_to_kv_pool_allocator
    donor = getattr(allocator, "mamba_full_cache_donor", None)
    if donor is not None and donor() is not None:
        return ("its full-attention pool lends memory to the Mamba states, which radixcache "
                f"does not model; {_DROP_FLAG}")
    from sglang.srt.runtime_context import get_exec

    if pool.enable_mamba_extra_buffer_lazy or get_exec().mamba.enable_mamba_extra_buffer_lazy:
        return ("--mamba-radix-cache-strategy extra_buffer_lazy: radixcache serves the track "
                f"slots allocated up front (extra_buffer); {_DROP_FLAG}")
    if get_exec().mamba.mamba_max_states_per_path >= 0:
        return (f"--mamba-max-states-per-path {get_exec().mamba.mamba_max_states_per_path}: "
                f"radixcache keeps every state on a path; {_DROP_FLAG}")
    return None


def _hierarchical(ctx: Any) -> bool:
    return bool(ctx.enable_hierarchical_cache or _setting("memory", "enable_hierarchical_cache"))


def _hicache_refusal(ctx: Any) -> Optional[str]:
    """Why ``--enable-hierarchical-cache`` cannot run on radixcache here (None: it can)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _PlainKvStrategy,
        _select_strategy,
    )
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from .hicache import SERVED_STORAGE_BACKENDS, STORAGE_REFUSAL, group_size

    params = ctx.params
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        return ("HiCache of a hybrid model's sliding-window or Mamba state needs SGLang's "
                f"unified radix tree (radixcache's host tier keeps full-attention KV); "
                f"{_DROP_FLAG}")
    if params.is_eagle:
        return ("HiCache with EAGLE-family speculative decoding (bigram keys): radixcache's "
                f"host tier keys plain tokens; {_DROP_FLAG}, or serve without speculative "
                "decoding")
    if params.enable_session_radix_cache:
        return ("HiCache with --enable-session-radix-cache: radixcache keeps session "
                "references as eviction ranks, which its host tier does not order by; "
                f"{_DROP_FLAG}, or drop --enable-session-radix-cache")
    if _setting("memory", "hicache_host_memory_mode") == "buffer_only":
        return ("--hicache-host-memory-mode buffer_only stages host memory through SGLang's "
                f"unified radix tree; use the default cache mode, or {_DROP_FLAG}")
    storage = _setting("memory", "hicache_storage_backend")
    if storage is not None and storage not in SERVED_STORAGE_BACKENDS:
        return (f"--hicache-storage-backend {storage}: {STORAGE_REFUSAL}; use "
                f"--hicache-storage-backend file, drop the flag, or {_DROP_FLAG}")
    if params.mtp_draft_device_pools:
        return ("HiCache of speculative draft KV pools (packed MTP/EAGLE draft layers) needs "
                f"SGLang's unified radix tree; {_DROP_FLAG}")
    disagg = _setting("disagg", "disaggregation_mode")
    if disagg not in (None, "null"):
        return (f"HiCache under --disaggregation-mode {disagg} runs SGLang-only paths "
                f"(decode offload, prefill write-through deferral); {_DROP_FLAG}")
    if (params.pp_size or 1) > 1 or group_size(params.attn_cp_cache_group) > 1:
        return ("HiCache with pipeline or attention-context parallelism syncs its "
                f"acknowledgements through SGLang's unified radix tree; {_DROP_FLAG}")
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    try:
        strategy = _select_strategy(kvcache, {ComponentType.FULL})
    except AssertionError:
        strategy = None
    if type(strategy) is not _PlainKvStrategy:
        return (f"HiCache of a {type(kvcache).__name__} (its side pools) needs SGLang's "
                f"unified radix tree; {_DROP_FLAG}")
    return None


def create_backend(ctx: Any) -> "RadixcacheBackend":
    """SGLang's radix-cache factory for ``--radix-cache-backend radixcache``.

    Args:
        ctx: SGLang's ``TreeCacheBuildContext``.

    Returns:
        A ``RadixcacheBackend`` over ``ctx.params`` (a ``HiCacheBackend`` with
        ``--enable-hierarchical-cache``, a ``RadixcacheSWABackend`` for a hybrid
        sliding-window model, a ``RadixcacheMambaBackend`` for a Mamba hybrid).

    Raises:
        UnsupportedConfiguration (a ValueError): the model or a flag needs something
            radixcache does not implement; the message names it and says what to drop.
    """
    reason = _refusal(ctx)
    if reason is None and _hierarchical(ctx):
        reason = _hicache_refusal(ctx)
    if reason is not None:
        raise UnsupportedConfiguration(f"--radix-cache-backend radixcache: {reason}")
    if _hierarchical(ctx):
        from .hicache import HiCacheBackend

        return HiCacheBackend(ctx.params, ctx.server_args, ctx.tp_worker)
    if ctx.is_hybrid_swa:
        from .swa import RadixcacheSWABackend

        return RadixcacheSWABackend(ctx.params)
    if ctx.is_hybrid_ssm:
        from .mamba import RadixcacheMambaBackend

        return RadixcacheMambaBackend(ctx.params)
    from .backend import RadixcacheBackend

    return RadixcacheBackend(ctx.params)

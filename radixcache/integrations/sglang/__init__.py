"""radixcache as SGLang's prefix cache: ``--radix-cache-backend radixcache``.

Installing radixcache next to SGLang (0.5.23) is all it takes: the package declares an entry
point in SGLang's plugin group ``sglang.srt.plugins``, SGLang calls ``register()`` early in
every process, and ``register()`` files ``create_backend`` under the name ``radixcache`` in
SGLang's radix-cache registry. ``python -m sglang.launch_server ... --radix-cache-backend
radixcache`` then builds a ``RadixcacheBackend`` where SGLang would build its own cache.

``RadixcacheBackend`` is a ``BasePrefixCache`` over a ``radixcache.RadixCache`` (compiled core
by default). It serves the whole contract SGLang's scheduler uses for a full-attention model --
``match_prefix``, ``insert``, ``checkpoint`` and the release path, ``evict`` /
``evict_for_alloc``, locks, sizes, ``path_device_indices``, ``prefix_device_indices``,
``touch_prefix``, ``dfs_weight_order``, ``reset``, KV events -- with EAGLE-family speculative
decoding's bigram keys and with the session radix cache (``open_radix_session``,
``ensure_session_generation``, ``release_radix_session``), and decides as SGLang's default
cache does (the same matches, the same slots written to request rows, the same slots freed to
the allocator, the same events), except where a match or insert ends inside a node: there only
the matched part counts as used (see ``docs/sglang.md``). For a hybrid sliding-window model
(GPT-OSS, Llama 4, Gemma 4, MiMo-V2, Step3p5, DeepSeek-V4: SGLang's ``SWAKVPool`` and
``SWATokenToKVPoolAllocator``) ``create_backend`` builds a ``RadixcacheSWABackend``, which keeps
each node's window slots beside its full-attention slots in radixcache's hybrid core and decides
as SGLang's unified cache with its SWA component does; for a Mamba / linear-attention hybrid
(Qwen3-Next, Qwen3.5: SGLang's ``HybridReqToTokenPool`` and ``MambaPool``) a
``RadixcacheMambaBackend``, which keeps one recurrent state slot per node and decides as the
unified cache with its Mamba component does.

With ``--enable-hierarchical-cache`` the factory builds a ``HiCacheBackend``: the same cache
over radixcache's host tier, with SGLang's own host pools and cache controller doing the
copies, and SGLang's write policies (``write_through``, ``write_through_selective``,
``write_back``), host eviction, load back and KV events per medium (see
``docs/sglang-backend.md``).

``create_backend`` refuses, before the server starts serving, what this cache does not
implement: models with both sliding-window and Mamba layers, sliding-window models whose
window lives elsewhere than a stock ``SWATokenToKVPoolAllocator``, Mamba models whose states
live elsewhere than a ``HybridReqToTokenPool`` (the unified memory pool, int8 checkpoints,
a cap on states per path), hybrid models with EAGLE's bigram keys or the session radix cache;
with the hierarchical cache: hybrid models, EAGLE's bigram keys, the session radix cache,
HiCache's buffer-only mode, storage tier, draft-KV sidecars, pipeline or context parallelism,
PD disaggregation and pools with side pools; LMCache, FlexKV, external cache linkers,
host-pool retraction, MLX, sharded KV pages, streaming sessions, a disabled radix cache,
eviction policies other than ``lru``, ``lfu``, ``fifo``, ``filo``, ``mru``, ``slru`` and
``priority``, and eviction policy options (see ``docs/sglang-backend.md``).

This package imports SGLang; ``import radixcache`` never does. ``plugin`` holds the entry point,
the factory and the start-up refusals; ``backend`` the cache; ``eagle`` the bigram keys' view
of the tree; ``sessions`` the session references, kept as eviction ranks; ``hicache`` its host
tier; ``hybrid`` what the caches of hybrid models share; ``swa`` the cache of a hybrid
sliding-window model; ``mamba`` the cache of a Mamba hybrid.
"""

from .backend import RadixcacheBackend
from .hicache import HiCacheBackend
from .mamba import RadixcacheMambaBackend
from .swa import RadixcacheSWABackend
from .plugin import (
    BACKEND_NAME,
    SUPPORTED_EVICTION_POLICIES,
    UnsupportedConfiguration,
    create_backend,
    register,
)

__all__ = ["BACKEND_NAME", "SUPPORTED_EVICTION_POLICIES", "HiCacheBackend",
           "RadixcacheBackend", "RadixcacheMambaBackend", "RadixcacheSWABackend",
           "UnsupportedConfiguration", "create_backend", "register"]

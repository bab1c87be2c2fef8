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
``touch_prefix``, ``dfs_weight_order``, ``reset``, KV events -- and decides as SGLang's default
cache does (the same matches, the same slots written to request rows, the same slots freed to
the allocator, the same events), except where a match or insert ends inside a node: there only
the matched part counts as used (see ``docs/sglang.md``). For a hybrid sliding-window model
(GPT-OSS, Llama 4, Gemma 4, MiMo-V2, Step3p5, DeepSeek-V4: SGLang's ``SWAKVPool`` and
``SWATokenToKVPoolAllocator``) ``create_backend`` builds a ``RadixcacheSWABackend``, which keeps
each node's window slots beside its full-attention slots in radixcache's hybrid core and decides
as SGLang's unified cache with its SWA component does.

``create_backend`` refuses, before the server starts serving, what this cache does not
implement: Mamba (hybrid SSM) models, sliding-window models whose window lives elsewhere than
a stock ``SWATokenToKVPoolAllocator``, hierarchical cache, LMCache, FlexKV,
external cache linkers, host-pool retraction, MLX, EAGLE's bigram keys, sharded KV pages,
session and streaming-session radix caches, a disabled radix cache, eviction policies other
than ``lru``, ``lfu``, ``fifo``, ``filo``, ``mru``, ``slru`` and ``priority``, and eviction
policy options.

This package imports SGLang; ``import radixcache`` never does. ``plugin`` holds the entry point,
the factory and the start-up refusals; ``backend`` the cache; ``swa`` the cache of a hybrid
sliding-window model.
"""

from .backend import RadixcacheBackend
from .swa import RadixcacheSWABackend
from .plugin import (
    BACKEND_NAME,
    SUPPORTED_EVICTION_POLICIES,
    UnsupportedConfiguration,
    create_backend,
    register,
)

__all__ = ["BACKEND_NAME", "SUPPORTED_EVICTION_POLICIES", "RadixcacheBackend",
           "RadixcacheSWABackend", "UnsupportedConfiguration", "create_backend", "register"]

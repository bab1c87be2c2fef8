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
the matched part counts as used (see ``docs/sglang.md``).

With ``--enable-hierarchical-cache`` the factory builds a ``HiCacheBackend``: the same cache
over radixcache's host tier, with SGLang's own host pools and cache controller doing the
copies, and SGLang's write policies (``write_through``, ``write_through_selective``,
``write_back``), host eviction, load back and KV events per medium (see
``docs/sglang-backend.md``).

``create_backend`` refuses, before the server starts serving, what this cache does not
implement: sliding-window and Mamba (hybrid) models, HiCache's buffer-only mode, storage
tier, draft-KV sidecars, pipeline or context parallelism, PD disaggregation and pools with
side pools (SGLang's own class serves those), LMCache, FlexKV,
external cache linkers, host-pool retraction, MLX, EAGLE's bigram keys, sharded KV pages,
session and streaming-session radix caches, a disabled radix cache, eviction policies other
than ``lru``, ``lfu``, ``fifo``, ``filo``, ``mru``, ``slru`` and ``priority``, and eviction
policy options.

This package imports SGLang; ``import radixcache`` never does. ``plugin`` holds the entry point,
the factory and the start-up refusals; ``backend`` the cache; ``hicache`` its host tier.
"""

from .backend import RadixcacheBackend
from .hicache import HiCacheBackend
from .plugin import (
    BACKEND_NAME,
    SUPPORTED_EVICTION_POLICIES,
    UnsupportedConfiguration,
    create_backend,
    register,
)

__all__ = ["BACKEND_NAME", "SUPPORTED_EVICTION_POLICIES", "HiCacheBackend",
           "RadixcacheBackend", "UnsupportedConfiguration", "create_backend", "register"]

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
the matched part counts as used (see ``docs/sglang.md``).

``create_backend`` refuses, before the server starts serving, what this cache does not
implement: sliding-window and Mamba (hybrid) models, hierarchical cache, LMCache, FlexKV,
external cache linkers, host-pool retraction, MLX, sharded KV pages, streaming sessions, a
disabled radix cache, eviction policies other than ``lru``, ``lfu``, ``fifo``, ``filo``,
``mru``, ``slru`` and ``priority``, and eviction policy options (see
``docs/sglang-backend.md``).

This package imports SGLang; ``import radixcache`` never does. ``plugin`` holds the entry point,
the factory and the start-up refusals; ``backend`` the cache; ``eagle`` the bigram keys' view
of the tree; ``sessions`` the session references, kept as eviction ranks.
"""

from .backend import RadixcacheBackend
from .plugin import (
    BACKEND_NAME,
    SUPPORTED_EVICTION_POLICIES,
    UnsupportedConfiguration,
    create_backend,
    register,
)

__all__ = ["BACKEND_NAME", "SUPPORTED_EVICTION_POLICIES", "RadixcacheBackend",
           "UnsupportedConfiguration", "create_backend", "register"]

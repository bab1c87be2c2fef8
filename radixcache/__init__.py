"""radixcache: a radix tree of token prefixes mapping to KV-cache slot indices."""

from ._core import RadixTreeNode, core_name
from .cache import EVICTION_POLICIES, CacheStats, InsertResult, MatchResult, RadixCache

__all__ = [
    "EVICTION_POLICIES",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixTreeNode",
    "core_name",
]
__version__ = "0.1.0"

"""radixcache: a radix tree of token prefixes mapping to KV-cache slot indices."""

from typing import TYPE_CHECKING

__all__ = [
    "ARRAY_TYPES",
    "EVICTION_POLICIES",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixTreeNode",
    "WRITE_POLICIES",
    "core_name",
]
__version__ = "0.1.0"

# The public names load on first use (PEP 562), so that ``import radixcache`` -- and the
# command's ``--help`` -- do not import torch and the tree cores until they are needed.
_LAZY = {"ARRAY_TYPES": ".cache", "RadixTreeNode": "._core", "core_name": "._core",
         "EVICTION_POLICIES": ".cache",
         "CacheStats": ".cache", "InsertResult": ".cache", "MatchResult": ".cache",
         "RadixCache": ".cache", "WRITE_POLICIES": ".cache"}

if TYPE_CHECKING:
    from ._core import RadixTreeNode, core_name
    from .cache import (ARRAY_TYPES, EVICTION_POLICIES, WRITE_POLICIES, CacheStats,
                        InsertResult, MatchResult, RadixCache)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixcache' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))

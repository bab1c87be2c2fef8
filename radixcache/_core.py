"""The chooser: the compiled tree core unless RADIXCACHE_NO_EXTENSIONS is set or it is missing."""

from __future__ import annotations

import os
from abc import ABC
from types import ModuleType

from . import _core_py

NO_EXTENSIONS = bool(os.environ.get("RADIXCACHE_NO_EXTENSIONS"))

_core_c: ModuleType | None = None
if not NO_EXTENSIONS:  # forced pure Python never even loads the extension
    try:
        from . import _core_c
    except ImportError:  # not built (no compiler at install time): pure Python, silently
        _core_c = None

CORES: dict[str, ModuleType] = {"python": _core_py}
if _core_c is not None:
    CORES["c"] = _core_c

core: ModuleType = _core_py if NO_EXTENSIONS or _core_c is None else _core_c


class RadixTreeNode(ABC):
    """A node of a ``RadixCache`` tree, as ``MatchResult.last_node`` and the like give it.

    Each tree core has its own node class; ``isinstance(node, RadixTreeNode)`` holds for
    both. Nodes are read-only handles: the cache changes them, the caller only reads them and
    passes them back (to ``inc_lock_ref``/``dec_lock_ref``).

    Attributes:
        key: The node's tokens, a read-only 1-D int64 numpy array (empty at the root).
        value: The KV slot indices of those tokens, a new 1-D ``torch.int64`` tensor (a
            1-D int64 numpy array in a cache with ``array_type="numpy"``). Indices on a
            device are not copied: the tensor is a view of the ones the node keeps, so
            writing to its elements changes them; changing its shape does not.
        parent: The parent node (``None`` at the root).
        children: The child nodes, a tuple.
        lock_ref: How many locks protect it (its own and its descendants').
        last_access_time: The logical time of the last call that touched it.
        created_time: The logical time its KV was computed.
        priority: The highest priority an insert through it gave.
        hit_count: Inserts through or ending at it.
        extra_key: Its namespace (``None``: the default one).
        id: A number unique within its cache.
        evicted: True once it left the tree (evicted, or dropped by ``reset``).
        terminal: True if a sequence inserted exactly ends here (what ``exists`` looks for).
        num_tokens: ``len(key)``.
        num_children: ``len(children)``.
        on_device: False when the node is held only in host memory (a cache with a host
            tier); then ``value`` is None. Always True without a host tier.
        host_value: Its host indices, a new 1-D CPU ``torch.int64`` tensor (a numpy array
            with ``array_type="numpy"``), or None when it has no host copy.
        tier: ``"device"``, ``"host"`` or ``"device+host"``.
    """


for _module in CORES.values():
    RadixTreeNode.register(_module.Node)


def core_name() -> str:
    """Tell which tree core new caches use by default.

    The compiled core unless the environment variable ``RADIXCACHE_NO_EXTENSIONS`` was set
    when radixcache was imported or the compiled core was not built (no C compiler at install
    time).

    Returns:
        ``"c"`` (compiled) or ``"python"``.
    """
    return core.CORE_NAME


def get_core(name: str | None) -> ModuleType:
    """The core module called ``name`` (``None``: the default one)."""
    if name is None:
        return core
    try:
        return CORES[name]
    except KeyError:
        raise ValueError(
            f"unknown core {name!r}; available: {', '.join(sorted(CORES))}"
        ) from None

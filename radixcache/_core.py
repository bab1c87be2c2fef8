"""The chooser: the compiled modules unless RADIXCACHE_NO_EXTENSIONS is set or they are missing.

Three pairs, each a pure module and its compiled twin with the same interface: the tree core
(``_core_py``/``_core_c``, as ``core``), the hybrid core built on it (``_hybrid_py``/
``_hybrid_c``, as ``hybrid``) and the block index with the page hashes (``_blocks_py``/
``_blocks_c``, as ``blocks``), each compiled one used when it was built. It imports them
(none of them imports this module) and registers the cores' node classes with
``RadixTreeNode``.
"""

from __future__ import annotations

import os
from types import ModuleType

from . import _blocks_py, _core_py, _hybrid_py
from ._types import RadixTreeNode

__all__ = ["NO_EXTENSIONS", "CORES", "HYBRIDS", "BLOCKS", "core", "hybrid", "blocks",
           "RadixTreeNode", "core_name", "get_core", "get_hybrid", "get_blocks"]

NO_EXTENSIONS = bool(os.environ.get("RADIXCACHE_NO_EXTENSIONS"))

_core_c: ModuleType | None = None
_hybrid_c: ModuleType | None = None
_blocks_c: ModuleType | None = None
if not NO_EXTENSIONS:  # forced pure Python never even loads the extensions
    try:
        from . import _core_c
    except ImportError:  # not built (no compiler at install time): pure Python, silently
        _core_c = None
    if _core_c is not None:
        try:
            from . import _hybrid_c
        except ImportError:
            _hybrid_c = None
    try:
        from . import _blocks_c
    except ImportError:
        _blocks_c = None

#: The tree cores, the hybrid cores and the block modules by name ("python", and "c" where
#: built).
CORES: dict[str, ModuleType] = {"python": _core_py}
HYBRIDS: dict[str, ModuleType] = {"python": _hybrid_py}
BLOCKS: dict[str, ModuleType] = {"python": _blocks_py}
if _core_c is not None:
    CORES["c"] = _core_c
if _hybrid_c is not None:
    HYBRIDS["c"] = _hybrid_c
if _blocks_c is not None:
    BLOCKS["c"] = _blocks_c

core: ModuleType = _core_py if _core_c is None else _core_c
hybrid: ModuleType = _hybrid_py if _hybrid_c is None else _hybrid_c
blocks: ModuleType = _blocks_py if _blocks_c is None else _blocks_c

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


def _pick(modules: dict, default: ModuleType, name: str | None) -> ModuleType:
    if name is None:
        return default
    try:
        return modules[name]
    except KeyError:
        raise ValueError(
            f"unknown core {name!r}; available: {', '.join(sorted(modules))}"
        ) from None


def get_core(name: str | None) -> ModuleType:
    """The core module called ``name`` (``None``: the default one)."""
    return _pick(CORES, core, name)


def get_hybrid(name: str | None) -> ModuleType:
    """The hybrid core module of the core called ``name`` (``None``: the default one)."""
    return _pick(HYBRIDS, hybrid, name)


def get_blocks(name: str | None) -> ModuleType:
    """The block module of the core called ``name`` (``None``: the default one)."""
    return _pick(BLOCKS, blocks, name)

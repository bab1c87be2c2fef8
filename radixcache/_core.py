"""The chooser: the compiled tree core unless RADIXCACHE_NO_EXTENSIONS is set or it is missing.

It imports the cores (no core imports it) and registers their ``Node`` classes with
``RadixTreeNode``.
"""

from __future__ import annotations

import os
from types import ModuleType

from . import _core_py
from ._types import RadixTreeNode

__all__ = ["NO_EXTENSIONS", "CORES", "core", "RadixTreeNode", "core_name", "get_core"]

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

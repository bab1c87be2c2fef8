"""The lazy torch layer, shared by both tree cores and the cache layer.

torch is imported only when something needs it: a cache whose index arrays are torch tensors
(``load_torch``), or an input that is a tensor (it can only be one once some code imported
torch: ``loaded_torch``). A cache with numpy index arrays never imports it. A module that
keeps torch's names in its globals registers a binder (``on_torch``), called once torch is
bound.

torch is an optional dependency (``radixcache[torch]``): without it numpy-array caches and
the ``radixcache`` command work, and making torch index arrays raises ``ModuleNotFoundError``
saying how to install it or to use ``array_type="numpy"``.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable

import numpy as np

__all__ = ["TORCH_MISSING", "on_torch", "load_torch", "loaded_torch", "torch_installed",
           "is_tensor", "empty_indices", "indices_from_key", "cat_tensors"]

#: Why torch index arrays cannot be made without PyTorch, and what to do instead.
TORCH_MISSING = ("torch index arrays need PyTorch, which is not installed: install it with "
                 "pip install 'radixcache[torch]', or use numpy index arrays "
                 "(array_type=\"numpy\"), which never need torch")

_torch: Any = None  # the torch module, once bound
_torch_binders: list = []


def on_torch(binder: Callable[[Any], None]) -> None:
    """Register ``binder(torch)``, called once torch is bound (at once if it already is): a
    module that keeps torch names in its globals sets them there."""
    _torch_binders.append(binder)
    if _torch is not None:
        binder(_torch)


def load_torch() -> Any:
    """Import torch if needed, bind it in every registered module, and return it.

    Raises:
        ModuleNotFoundError: torch is not installed (the message names the ``torch`` extra
            and ``array_type="numpy"``).
    """
    global _torch
    if _torch is None:
        try:
            import torch  # only a torch-array cache or a tensor input needs it
        except ModuleNotFoundError as exc:
            if exc.name != "torch":  # torch is there but broken: its own error says why
                raise
            raise ModuleNotFoundError(TORCH_MISSING, name="torch") from None

        for binder in _torch_binders:
            binder(torch)
        _torch = torch
    return _torch


def loaded_torch() -> Any:
    """torch if some code has imported it (bound here on first sight), else None: only
    then can an object be a tensor."""
    if _torch is not None:
        return _torch
    if "torch" not in sys.modules:
        return None
    return load_torch()


def torch_installed() -> bool:
    """Whether torch can be imported (asked of the import system: torch is not imported)."""
    return _torch is not None or importlib.util.find_spec("torch") is not None


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor, without importing torch."""
    torch = _torch if _torch is not None else loaded_torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def empty_indices(numpy_arrays: bool = False) -> Any:
    """A new empty int64 index array: the indices of a miss (a numpy array when
    ``numpy_arrays``, else a tensor). Never a shared one: the caller may change a result in
    place (``set_``, ``unsqueeze_``, ``resize``), which must not show in any other. Its
    storage cannot grow, like a hit's (the compiled core's come from a DLPack block)."""
    empty = np.empty(0, dtype=np.int64)
    return empty if numpy_arrays else load_torch().from_numpy(empty)


def indices_from_key(key: np.ndarray, numpy_arrays: bool = False) -> Any:
    """The index array of a node inserted without kv_indices: its tokens serve as indices."""
    # A copy: the key buffer is read-only and must never be written through a result.
    copy = np.array(key, dtype=np.int64)
    return copy if numpy_arrays else load_torch().from_numpy(copy)


def cat_tensors(values: list) -> Any:
    """Concatenate index tensors of which some live on a device (CPU ones move to it)."""
    torch = load_torch()
    device = next((v.device for v in values if v.device.type != "cpu"), None)
    if device is None:
        return torch.cat(values)
    return torch.cat([v.to(device) for v in values])

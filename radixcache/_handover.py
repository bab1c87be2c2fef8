"""The hand-over between a tree core and the engine's callbacks, the same on both cores:
a batch eviction's indices to ``free_callback`` (``hand_over_batch``) and what ``backup``
returned, checked (``host_indices_bytes``)."""

from __future__ import annotations

import numpy as np

from ._torch import loaded_torch

__all__ = ["answer_not_kept", "hand_over_batch", "host_indices_bytes", "page_ids"]


def page_ids(values, page_size: int):
    """The page ids ``evict(batch=True, page_ids=True)`` hands over for a victim's indices
    (int64 bytes, a numpy array or a tensor, on any device): every ``page_size``-th index
    from the first, floor-divided by ``page_size``; int64 bytes for bytes, else the same
    kind of array (a new one)."""
    if type(values) is bytes:
        return (np.frombuffer(values, dtype=np.int64)[::page_size] // page_size).tobytes()
    if isinstance(values, np.ndarray):
        return values[::page_size] // page_size
    return values[::page_size].div(page_size, rounding_mode="floor")


def _hand_over_parts(free_callback, parts, join, join_error, error) -> None:
    """``hand_over_batch``'s parts one call each (a part: a node's indices, or several
    nodes' CPU indices the compiled core gathered in one block), every one of them whatever
    a call raises; the first call's error is chained under ``join_error``."""
    failed = None
    for part in parts:
        try:
            # int64 bytes (the pure core's CPU values) become an array alone: no join.
            free_callback(join([part]) if type(part) is bytes else part)
        except BaseException as exc:
            if failed is None:
                failed = exc
    if failed is not None:
        # (It was raised while join_error was handled, so that is its context: replaced.)
        failed.__context__ = error
        join_error.__context__ = failed


def hand_over_batch(free_callback, value, error, join=None) -> None:
    """The end of ``evict(batch=True)``, the same on both cores: one call with every freed
    index (``value``, made one tensor by ``join`` when given; None: nothing was freed), then
    the loop's ``error``, if any, re-raised; an exception from ``join`` or the callback
    carries that error as its ``__context__``. Parts that do not join (``torch.cat``
    refusing them: values on several devices, a torch hook) are handed over one call each,
    in order, all of them even if a call raises; then the join's error propagates, with the
    first such call's error (and then the loop's) as its context."""
    if value is not None:
        try:
            if join is not None:
                parts = value
                try:
                    value = join(parts)
                except BaseException as join_error:
                    _hand_over_parts(free_callback, parts, join, join_error, error)
                    raise
            free_callback(value)
        except BaseException as exc:
            if error is not None and exc.__context__ is None:
                exc.__context__ = error
            raise
    if error is not None:
        raise error


def answer_not_kept(error: BaseException, answer) -> BaseException:
    """An error raised after ``backup`` returned ``answer`` and before the core kept it
    (checking or reading it, a torch hook meanwhile, a node that changed during the call):
    the same exception, given the attribute ``host_indices``, the answer as ``backup``
    returned it, so that the engine can free those host slots. An error ``backup`` raised
    itself has no such attribute. An exception that takes no attribute is replaced by a
    ``RuntimeError`` that carries it (``__cause__``) and the attribute."""
    try:
        error.host_indices = answer
    except (AttributeError, TypeError):
        replaced = RuntimeError("backup's answer was not kept (its host slots are in this "
                                f"error's host_indices): {error!r}")
        replaced.host_indices = answer
        replaced.__cause__ = error
        return replaced
    return error


def host_indices_bytes(host, num_tokens: int, numpy_arrays: bool = False) -> bytes:
    """Check what an engine's ``backup(device_indices)`` returned for a node of
    ``num_tokens`` tokens and give its host indices as native int64 bytes (a copy, so the
    caller's array may change afterwards). The same checks and messages on both cores.
    ``numpy_arrays``: the cache's arrays are numpy arrays, and so must ``host`` be.

    Raises:
        TypeError: ``host`` is not a ``torch.Tensor`` (a numpy array with
            ``numpy_arrays``), or not of dtype int64.
        ValueError: ``host`` is not 1-D, does not hold exactly ``num_tokens`` indices, or
            has no data (a meta or sparse tensor).
    """
    if numpy_arrays:
        return _host_array_bytes(host, num_tokens)
    torch = loaded_torch()
    if torch is None or not isinstance(host, torch.Tensor):
        raise TypeError("backup must return a torch.Tensor of host indices (or None when the "
                        f"host is full), got {type(host).__name__}")
    if host.dtype != torch.int64:
        raise TypeError(f"backup must return host indices of dtype torch.int64, got "
                        f"{host.dtype}")
    if host.dim() != 1:
        raise ValueError(f"backup must return a 1-D tensor of host indices, got "
                         f"{host.dim()}-D")
    if host.shape[0] != num_tokens:
        raise ValueError(f"backup returned {host.shape[0]} host indices for {num_tokens} "
                         "device slots: one per slot expected")
    if host.is_meta or host.layout != torch.strided:
        raise ValueError("backup must return host indices with data (a dense tensor), got a "
                         f"{'meta' if host.is_meta else host.layout} tensor")
    # A tensor subclass may answer the checks above and convert to something else: the
    # bytes themselves are checked.
    arr = host.detach().cpu().contiguous().numpy()
    data = arr.tobytes() if type(arr) is np.ndarray and arr.dtype == np.int64 else None
    if type(data) is not bytes:
        raise TypeError("backup must return a torch.Tensor of host indices (or None when the "
                        f"host is full), got {type(host).__name__} converting to "
                        f"{type(arr).__name__}")
    if len(data) != 8 * num_tokens:
        raise ValueError(f"backup returned {len(data) // 8} host indices for {num_tokens} "
                         "device slots: one per slot expected")
    return data


def _host_array_bytes(host, num_tokens: int) -> bytes:
    """``host_indices_bytes`` for a cache of numpy arrays."""
    if not isinstance(host, np.ndarray):
        raise TypeError("backup must return a numpy array of host indices (or None when the "
                        f"host is full), got {type(host).__name__}")
    if host.dtype != np.int64:
        raise TypeError(f"backup must return host indices of dtype int64, got {host.dtype}")
    if host.ndim != 1:
        raise ValueError(f"backup must return a 1-D array of host indices, got {host.ndim}-D")
    if host.shape[0] != num_tokens:
        raise ValueError(f"backup returned {host.shape[0]} host indices for {num_tokens} "
                         "device slots: one per slot expected")
    # ndarray's own tobytes (a subclass may override it): the bytes are checked again.
    data = np.ndarray.tobytes(host)
    if len(data) != 8 * num_tokens:
        raise ValueError(f"backup returned {len(data) // 8} host indices for {num_tokens} "
                         "device slots: one per slot expected")
    return data

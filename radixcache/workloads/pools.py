"""Pools of token slots the serving loop hands a cache: ``KVPool`` (device KV memory) and
``HostPool`` (host memory for a cache's host tier).

Both hand out slot ids ``0 .. capacity-1`` (int64) and take them back, and keep only the ids
ever handed out: a stack of freed ids, and ``_next``, the first id never handed out. Their
memory follows the slots in use, not the capacity, so a pool larger than any trace costs
nothing. They differ only in the order ids come in: a ``KVPool`` hands ids out as a stack
that started with every id on it, slot 0 on top, would; a ``HostPool`` hands out freed slots
first, then ids never used before, in increasing order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core import core as _default_core
from .._options import ARRAY_TYPES, MAX_POOL_SLOTS
from .._torch import is_tensor, load_torch
from .._validate import check_int

__all__ = ["MAX_POOL_SLOTS", "HostPool", "KVPool", "as_cache_array"]

_max_of = np.maximum.reduce  # an array's largest element, without ndarray.max's wrappers
# The compiled core's one-pass push of freed ids (a checked copy into a pool's free stack).
# In pure Python the pools' own numpy path is faster than the pure core's push (the
# reference for the compiled one), so there it serves alone.
_put_slots = _default_core.put_slots if _default_core.CORE_NAME == "c" else None


def as_cache_array(values: np.ndarray, numpy_arrays: bool) -> Any:
    """An int64 numpy array as the kind of array a cache takes: itself (``numpy_arrays``),
    else a tensor over the same memory.

    Args:
        values: A 1-D int64 numpy array.
        numpy_arrays: Whether the cache's ``array_type`` is ``"numpy"``.

    Returns:
        ``values``, or a CPU int64 tensor that shares its memory.
    """
    return values if numpy_arrays else load_torch().from_numpy(values)


def _slot_array(slots: Any) -> np.ndarray:
    """Slot ids (a tensor, numpy array or sequence of ints) as a numpy array; a CPU tensor's
    memory is read in place."""
    if type(slots) is np.ndarray:
        return slots
    return slots.numpy() if is_tensor(slots) else np.asarray(slots)


def _check_array_type(array_type: Any) -> bool:
    """Whether ``array_type`` (checked) asks for numpy arrays."""
    if not isinstance(array_type, str) or array_type not in ARRAY_TYPES:
        raise ValueError(f"unknown array_type {array_type!r}; valid: " + ", ".join(ARRAY_TYPES))
    return array_type == "numpy"


def _any_outside(ids: np.ndarray, bound: int) -> bool:
    """Whether an id of the non-empty ``ids`` falls outside ``[0, bound)``."""
    if ids.dtype == np.int64:  # one pass: a negative id reads as a huge unsigned one
        return int(_max_of(ids.view(np.uint64))) >= bound
    return int(ids.min()) < 0 or int(ids.max()) >= bound


def check_capacity(capacity: Any) -> int:
    """A pool's ``capacity`` as a plain int, or the error a caller gets.

    Raises:
        TypeError: not an int.
        ValueError: below 0, or above ``MAX_POOL_SLOTS`` (more int64 slot ids than this
            machine can address).
    """
    capacity = check_int(capacity, "capacity", low=0)
    if capacity > MAX_POOL_SLOTS:
        raise ValueError(f"capacity {capacity:,} is more slots than this machine can address "
                         f"(at most {MAX_POOL_SLOTS:,})")
    return capacity


class _SlotPool:
    """What ``KVPool`` and ``HostPool`` share: a stack of freed slot ids (``_free``, its top
    at ``_top``) and the ids ever handed out, ``0 .. _next-1``; ids from ``_next`` up were
    never handed out. The stack grows as slots come back, to at most twice the slots ever
    handed out (or 1,024). A subclass's ``_take_into`` says in which order ids come."""

    __slots__ = ("capacity", "_free", "_top", "_next", "_numpy")

    def __init__(self, capacity: int, array_type: str) -> None:
        self._numpy = _check_array_type(array_type)
        self.capacity = check_capacity(capacity)
        self._free = np.empty(0, dtype=np.int64)
        self._top = 0
        self._next = 0

    @property
    def available(self) -> int:
        """Free slots."""
        return self.capacity - self._next + self._top

    @property
    def used(self) -> int:
        """Allocated slots."""
        return self._next - self._top

    def alloc(self, n: int) -> Any:
        """Take ``n`` free slots.

        Args:
            n: How many slots, an int >= 0.

        Returns:
            Their ids as a new 1-D int64 tensor (a numpy array for a numpy pool), or None
            (nothing taken) if fewer are free.

        Raises:
            ValueError: ``n`` < 0.
        """
        ids = self._alloc_ids(n)
        return None if ids is None else as_cache_array(ids, self._numpy)

    def _alloc_ids(self, n: int) -> np.ndarray | None:
        """``alloc`` as a new numpy array."""
        top = self._top
        if 0 <= n <= top:  # the common case (a host pool: once it has cycled): freed slots
            self._top = top - n
            return self._free[top - n:top].copy()
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available:
            return None
        out = np.empty(n, dtype=np.int64)
        self._take_into(out)
        return out

    def _take_into(self, out: np.ndarray) -> None:
        """Allocate ``len(out)`` slots (the caller checked that they are free) into ``out``."""
        raise NotImplementedError

    def _push(self, ids: np.ndarray) -> None:
        """Put ``ids`` (checked) on the free stack, growing it when they do not fit."""
        top, n = self._top, len(ids)
        if top + n > len(self._free):  # the stack grows with the slots handed out
            grown = np.empty(max(2 * len(self._free), top + n, 1024), dtype=np.int64)
            grown[:top] = self._free[:top]
            self._free = grown
        self._free[top:top + n] = ids
        self._top = top + n

    def free(self, slots: Any) -> None:
        """Return slots to the pool.

        Args:
            slots: Their ids, a tensor, numpy array or sequence of ints.

        Raises:
            ValueError: more slots than are in use, or ids the pool never handed out
                (outside ``[0, capacity)`` among them).
        """
        if _put_slots is not None:
            pushed = _put_slots(self._free, self._top, slots, self._next)
            if pushed >= 0:  # the common input, checked and pushed in one pass
                self._top += pushed
                return
        arr = _slot_array(slots)
        n = len(arr)
        if n == 0:
            return
        if n > self.used:
            raise ValueError(f"freeing {n} slots overfills the pool ({self.used} in use)")
        if _any_outside(arr, self._next):
            raise ValueError(f"slot ids outside [0, {self._next}) (never handed out)")
        self._push(arr)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, used={self.used})"


class KVPool(_SlotPool):
    """A KV pool of ``capacity`` token slots: a free list of slot ids (int64).

    Slot ids are ``0 .. capacity-1``; slot 0 is handed out first. The pool hands them out
    as a stack that starts with every id on it (slot 0 on top) does, but keeps only the
    slots ever handed out: its memory follows the slots in use, not the capacity.

    Args:
        capacity: How many slots, an int >= 0.
        array_type: What ``alloc`` returns: ``"torch"`` (default) a tensor, ``"numpy"`` a
            numpy array (``RadixCache``'s ``array_type``).

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: ``capacity`` < 0 or above ``MAX_POOL_SLOTS``, or an unknown
            ``array_type``.
    """

    __slots__ = ()

    def __init__(self, capacity: int, *, array_type: str = "torch") -> None:
        super().__init__(capacity, array_type)

    # The stack a full pool would hold is ids never handed out, ``capacity-1`` down to
    # ``_next`` (bottom to top), under the freed ones: only the freed ones are stored.
    def _take_into(self, out: np.ndarray) -> None:
        n, top = len(out), self._top
        if n <= top:
            self._top = top - n
            out[:] = self._free[top - n:top]
            return
        # The whole freed stack and, under it, the next ``fresh`` ids never handed out.
        fresh, start = n - top, self._next
        out[:fresh] = np.arange(start + fresh - 1, start - 1, -1, dtype=np.int64)
        out[fresh:] = self._free[:top]
        self._top = 0
        self._next = start + fresh

    def _put_back(self, slots: np.ndarray) -> None:
        """``free`` for slots the caller took with ``_take_into`` and still holds (an int64
        array): nothing to check."""
        top = self._top
        end = top + len(slots)
        if end > len(self._free):
            self._push(slots)
            return
        self._free[top:end] = slots
        self._top = end

    def free_slots(self) -> np.ndarray:
        """List the free slots (for consistency checks), ``capacity - used`` of them.

        Returns:
            A new int64 numpy array of their ids, in the order of the stack a full pool
            would hold (the last is handed out first).
        """
        never = np.arange(self.capacity - 1, self._next - 1, -1, dtype=np.int64)
        return np.concatenate((never, self._free[:self._top]))


class HostPool(_SlotPool):
    """A host-memory pool of ``capacity`` token slots for a cache's host tier.

    It hands out the same kind of slot ids as ``KVPool`` (``0 .. capacity-1``, int64) but
    keeps only the slots ever handed out: its memory follows the slots in use, not the
    capacity, so a pool larger than any trace ("unlimited" host memory) costs nothing.
    Freed slots are handed out again first.

    Args:
        capacity: How many slots, an int >= 0.
        array_type: What ``alloc`` returns, as for ``KVPool``.

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: ``capacity`` < 0 or above ``MAX_POOL_SLOTS``, or an unknown
            ``array_type``.
    """

    __slots__ = ()

    def __init__(self, capacity: int, *, array_type: str = "torch") -> None:
        super().__init__(capacity, array_type)

    def _take_into(self, out: np.ndarray) -> None:
        n, top = len(out), self._top
        reused = min(n, top)  # freed slots first, the latest on top last
        self._top = top - reused
        out[:reused] = self._free[top - reused:top]
        fresh = n - reused
        if fresh:
            out[reused:] = np.arange(self._next, self._next + fresh, dtype=np.int64)
            self._next += fresh

    def _alloc_shared(self, n: int) -> np.ndarray | None:
        """``alloc(n)`` as a numpy array, for a caller that copies the ids at once (a cache's
        ``backup`` answer): freed slots come as a view of the pool's own stack, no copy."""
        top = self._top
        if 0 <= n <= top:
            self._top = top - n
            return self._free[top - n:top]
        return self._alloc_ids(n)

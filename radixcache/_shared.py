"""Helpers shared by both tree cores and the cache layer.

torch is imported only when something needs it: a cache whose index arrays are torch tensors
(``load_torch``), or an input that is a tensor (it can only be one once some code imported
torch: ``loaded_torch``). A cache with numpy index arrays never imports it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

# The eviction policy names live where the command line reads them without torch.
from ._options import ARRAY_TYPES, EVICTION_POLICIES  # noqa: F401 -- re-exported

_torch: Any = None  # the torch module, once bound
_torch_binders: list = []


def on_torch(binder: Callable[[Any], None]) -> None:
    """Register ``binder(torch)``, called once torch is bound (at once if it already is): a
    module that keeps torch names in its globals sets them there."""
    _torch_binders.append(binder)
    if _torch is not None:
        binder(_torch)


def load_torch() -> Any:
    """Import torch if needed, bind it in every registered module, and return it."""
    global _torch
    if _torch is None:
        import torch  # noqa: PLC0415 -- only a torch-array cache or a tensor input needs it

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


_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# The most locks a node can hold (the compiled core counts them in 32 bits; both cores refuse
# the lock past it).
MAX_LOCK_REF = 2**31 - 1


class MatchResult:
    """What ``RadixCache.match_prefix`` found: the longest cached prefix.

    ``len(result)`` is ``length``. As a context manager (``with cache.match_prefix(p) as m:``)
    it calls ``close()`` on exit.

    Args:
        indices: The KV slot indices of the matched tokens, a 1-D ``torch.int64`` tensor on
            the values' device (an empty CPU tensor on a miss), or with
            ``array_type="numpy"`` a 1-D int64 numpy array. The caller owns it.
        last_node: The ``RadixTreeNode`` where the match ends (the root on a miss): lock it
            with ``inc_lock_ref`` while a request uses the prefix.
        length: Tokens matched, a multiple of the page size.
        host_length: With a host tier: the page-aligned tokens after ``length`` that are
            cached only in host memory (``RadixCache.load_back`` brings them back); 0
            otherwise.
        last_host_node: The node where that host continuation ends; ``None`` (the default)
            means ``last_node``, which it is whenever ``host_length`` is 0.
    """

    __slots__ = ("indices", "last_node", "length", "_host_length", "_last_host_node")

    def __init__(self, indices: Any, last_node, length: int, host_length: int = 0,
                 last_host_node=None) -> None:
        self.indices = indices
        self.last_node = last_node
        self.length = length
        self._host_length = host_length
        self._last_host_node = last_host_node

    # A core may fill the slots without running __init__ (the compiled core fills the first
    # three): an unset host part reads as none.
    @property
    def host_length(self) -> int:
        """Tokens after ``length`` held only in host memory (0 without a host tier)."""
        try:
            return self._host_length
        except AttributeError:
            return 0

    @host_length.setter
    def host_length(self, value: int) -> None:
        self._host_length = value

    @property
    def last_host_node(self):
        """The node where the host-only continuation ends (``last_node`` without one)."""
        try:
            node = self._last_host_node
        except AttributeError:
            node = None
        return self.last_node if node is None else node

    @last_host_node.setter
    def last_host_node(self, node) -> None:
        self._last_host_node = node

    def __len__(self) -> int:
        """``len(result)``: the tokens matched.

        Returns:
            ``length``.
        """
        return self.length

    def close(self) -> None:
        """Drop the reference to the index array (the cache keeps its own copy)."""
        self.indices = empty_indices(type(self.indices) is np.ndarray)

    def __enter__(self) -> "MatchResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.host_length:
            return (f"MatchResult(length={self.length}, last_node={self.last_node!r}, "
                    f"host_length={self.host_length}, "
                    f"last_host_node={self.last_host_node!r})")
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"


class InsertResult:
    """What ``RadixCache.insert`` did.

    Args:
        prefix_len: How many leading tokens were cached already: their slots in the
            ``kv_indices`` given to ``insert`` are duplicates the caller may free.
        last_node: The ``RadixTreeNode`` where the inserted (page-aligned) sequence ends.
    """

    __slots__ = ("prefix_len", "last_node")

    def __init__(self, prefix_len: int, last_node) -> None:
        self.prefix_len = prefix_len
        self.last_node = last_node

    def __repr__(self) -> str:
        return f"InsertResult(prefix_len={self.prefix_len}, last_node={self.last_node!r})"


def indices_from_key(key: np.ndarray, numpy_arrays: bool = False) -> Any:
    """The index array of a node inserted without kv_indices: its tokens serve as indices."""
    # A copy: the key buffer is read-only and must never be written through a result.
    copy = np.array(key, dtype=np.int64)
    return copy if numpy_arrays else load_torch().from_numpy(copy)


def reentered(what: str) -> RuntimeError:
    """The error for a call into a tree core (or its heap) while another call of it runs."""
    return RuntimeError(
        f"RadixCache re-entered from inside one of its own calls ({what} while another call "
        "was running): a token's __index__, an extra_key's __hash__/__eq__, a torch hook, a "
        "finalizer or another thread called into the cache; serialise calls (one thread, or "
        "a lock) and keep cache calls out of such hooks"
    )


def display_order(node) -> tuple:
    """Sort key for listing siblings: namespace, then tokens (the same on both cores)."""
    extra_key = node.extra_key
    return (extra_key is not None, repr(extra_key), node.key[:16].tolist())


def cat_tensors(values: list) -> Any:
    """Concatenate index tensors of which some live on a device (CPU ones move to it)."""
    torch = load_torch()
    device = next((v.device for v in values if v.device.type != "cpu"), None)
    if device is None:
        return torch.cat(values)
    return torch.cat([v.to(device) for v in values])


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


def stale_match(why: str) -> ValueError:
    """The error of ``load_back`` for a match whose host continuation is no longer there."""
    return ValueError(f"stale match: {why}; the tree changed since match_prefix made it "
                      "(match again)")


def lock_host_only(node_id: int) -> ValueError:
    """The error of ``inc_lock_ref`` on a node that is only on the host."""
    return ValueError(f"inc_lock_ref on node {node_id}: it is only on the host: load it back "
                      "first (load_back)")


#: Policies whose key can fall when a leaf is touched: the touched leaf is pushed anew.
KEY_FALLS_ON_ACCESS = frozenset({"mru"})


# -- copies and persistence: the tree state both cores export and import -------------------
#: The fields of one node in ``Core.export_state()["nodes"]``, in order.
NODE_FIELDS = ("parent", "key", "value", "extra_key", "priority", "last_access_time",
               "created_time", "hit_count", "terminal", "id")
#: The counters ``Core.export_state()["counters"]`` holds, in order.
COUNTER_FIELDS = ("lookups", "matched_tokens", "queried_tokens", "inserts", "inserted_tokens",
                  "evictions", "evicted_tokens")


def _state_int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= _INT64_MAX:
        raise ValueError(f"bad tree state: {what} must be an int in [{low}, 2^63), got "
                         f"{value!r}")
    return value


def check_state(state, page_size: int, numpy_arrays: bool = False) -> dict:
    """Validate a tree state (``Core.export_state()``'s dict) for a core of ``page_size``;
    returns a copy of what passed, its node records with CPU values as int64 bytes (user
    code, such as an extra_key's ``__hash__``, may change ``state`` once read: a core
    imports the copy). A core of ``numpy_arrays`` holds CPU values only: a device tensor is
    refused. Raises ValueError naming the first problem. Nothing here touches a tree."""
    if not isinstance(state, dict):
        raise ValueError(f"bad tree state: expected a dict, got {type(state).__name__}")
    try:
        records = state["nodes"]
        clock = _state_int(state["clock"], "clock")
        num_splits = _state_int(state["num_splits"], "num_splits")
        counters = state["counters"]
        empty_inserted = state["empty_inserted"]
    except KeyError as exc:
        raise ValueError(f"bad tree state: no {exc.args[0]!r}") from None
    if not isinstance(records, list) or not isinstance(empty_inserted, list):
        raise ValueError("bad tree state: 'nodes' and 'empty_inserted' must be lists")
    if not isinstance(counters, (list, tuple)) or len(counters) != len(COUNTER_FIELDS):
        raise ValueError(f"bad tree state: 'counters' must hold {len(COUNTER_FIELDS)} ints")
    counters, empty_inserted = tuple(counters), list(empty_inserted)
    for name, value in zip(COUNTER_FIELDS, counters):
        _state_int(value, name)
    page_bytes = 8 * page_size
    out = []
    firsts: set = set()
    ids: set = set()
    for i, record in enumerate(records):
        if not isinstance(record, tuple) or len(record) != len(NODE_FIELDS):
            raise ValueError(f"bad tree state: node {i} is not a tuple of "
                             f"{len(NODE_FIELDS)} fields")
        parent, key, value, extra_key, priority, last, created, hits, terminal, old_id = record
        if type(parent) is not int or not -1 <= parent < i:
            raise ValueError(f"bad tree state: node {i} has parent {parent!r} (a node listed "
                             "before it, or -1 for the root)")
        if type(key) is not bytes or not key or len(key) % page_bytes:
            raise ValueError(f"bad tree state: node {i}'s key must be a non-empty bytes of "
                             f"whole pages ({page_bytes} bytes each)")
        if value is not None:
            if is_tensor(value):
                if value.dim() != 1 or value.dtype != _torch.int64:
                    raise ValueError(f"bad tree state: node {i}'s value must be a 1-D int64 "
                                     "tensor")
                if value.device.type == "cpu":
                    value = value.numpy().tobytes()
                elif numpy_arrays:
                    raise ValueError(f"bad tree state: node {i}'s value is a device tensor: a "
                                     "cache with numpy arrays holds CPU values only")
                elif value.shape[0] * 8 != len(key):
                    raise ValueError(f"bad tree state: node {i} has {value.shape[0]} values "
                                     f"for {len(key) // 8} tokens")
            if type(value) is bytes:
                if len(value) != len(key):
                    raise ValueError(f"bad tree state: node {i} has {len(value) // 8} values "
                                     f"for {len(key) // 8} tokens")
            elif not is_tensor(value):
                raise ValueError(f"bad tree state: node {i}'s value must be None, bytes or a "
                                 f"tensor, got {type(value).__name__}")
        if parent != -1:
            extra_key = None  # below the root a node is in its parent's namespace
        elif extra_key is not None:
            hash(extra_key)  # TypeError for an unhashable one, before any tree change
        if type(priority) is not int or not _INT64_MIN <= priority <= _INT64_MAX:
            raise ValueError(f"bad tree state: node {i}'s priority must be an int64")
        _state_int(last, f"node {i}'s last_access_time")
        _state_int(created, f"node {i}'s created_time")
        _state_int(hits, f"node {i}'s hit_count")
        _state_int(old_id, f"node {i}'s id")
        if type(terminal) is not bool:
            raise ValueError(f"bad tree state: node {i}'s terminal must be a bool")
        first = (parent, extra_key, key[:page_bytes])
        if first in firsts:
            raise ValueError(f"bad tree state: node {i} starts with the same page as a "
                             "sibling")
        if old_id in ids:
            raise ValueError(f"bad tree state: node id {old_id} appears twice")
        firsts.add(first)
        ids.add(old_id)
        out.append((parent, key, value, extra_key, priority, last, created, hits, terminal,
                    old_id))
    return {"nodes": out, "clock": clock, "num_splits": num_splits,
            "empty_inserted": empty_inserted, "counters": counters}


def id_order(records: list) -> list:
    """Positions of ``records`` sorted by their saved ids: an import hands its new nodes
    fresh ids in this order, so ties in eviction order break as they did when saved."""
    return sorted(range(len(records)), key=lambda i: records[i][9])


def node_not_copyable() -> TypeError:
    """The error for pickling or copying a node (either core's): only a whole cache can be."""
    return TypeError("a RadixTreeNode cannot be pickled or copied on its own: it is part of "
                     "its cache's tree; pickle or copy the RadixCache instead")

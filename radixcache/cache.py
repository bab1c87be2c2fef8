"""RadixCache: the public cache over a tree core.

Every call goes to the core object (``Core``) once; common inputs are handled there whole.
When the core declines an input (returns None, having changed nothing), this module validates
it -- raising the documented exception -- and calls again with canonical inputs, holding
the core's guard across both (so a nested call from a token's ``__index__`` or an extra_key's
``__hash__`` raises ``RuntimeError`` on either path). It keeps what only Python should do:
device tensors, events hooks and stats assembly; the evict loop runs in the core.
"""

from __future__ import annotations

import array
import operator
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import numpy as np
import torch

from . import _core
from ._shared import EVICTION_POLICIES, InsertResult, MatchResult

__all__ = ["RadixCache", "MatchResult", "InsertResult", "CacheStats", "EVICTION_POLICIES"]

_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
_INT_TYPECODES = frozenset("bBhHiIlLqQ")


@dataclass(frozen=True)
class CacheStats:
    """Counters since the last ``reset_stats()``/``reset()``, and the current sizes."""

    lookups: int
    matched_tokens: int
    queried_tokens: int
    hit_rate: float
    inserts: int
    inserted_tokens: int
    evictions: int
    evicted_tokens: int
    splits: int
    evictable_size: int
    protected_size: int
    total_size: int
    node_count: int


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_priority(priority: Any) -> int:
    priority = _check_int("priority", priority)
    if not _INT64_MIN <= priority <= _INT64_MAX:
        raise OverflowError(f"priority {priority} does not fit in int64")
    return priority


def _check_extra_key(extra_key: Any) -> None:
    try:
        hash(extra_key)
    except TypeError:
        raise TypeError(
            f"extra_key must be hashable, got {type(extra_key).__name__}"
        ) from None


def _int64_array(arr: np.ndarray, what: str) -> np.ndarray:
    """A 1-D integer numpy array as contiguous int64 (no copy when it already is)."""
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got {arr.ndim}-D")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > _INT64_MAX:
        raise OverflowError(f"{what} has values that do not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _kv_from_objects(arr: np.ndarray) -> np.ndarray:
    """An object array of kv indices (numpy's result for ints beyond 64 bits, objects with
    ``__index__`` or mixed items) as int64, or the error it deserves: the first item that is
    not an integer (TypeError) or that does not fit in int64 (OverflowError)."""
    values = []
    for item in arr.ravel().tolist():
        if isinstance(item, (bool, np.bool_)) or not hasattr(type(item), "__index__"):
            raise TypeError(f"kv_indices must hold integers, got {type(item).__name__}")
        value = operator.index(item)
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise OverflowError(f"kv index {value} does not fit in int64")
        values.append(value)
    return np.array(values, dtype=np.int64).reshape(arr.shape)


def _check_tensor_dtype(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{what} must hold integers, got {tensor.dtype}")


def _list_tokens(tokens: list | tuple) -> np.ndarray:
    """A list or tuple of ints as an int64 array, with a message naming a bad token."""
    try:
        packed = struct.pack(f"{len(tokens)}q", *tokens)
    except struct.error as exc:
        # struct reports both wrong types and out-of-range values as struct.error.
        for tok in list(tokens):
            if not isinstance(tok, int) and not hasattr(tok, "__index__"):
                raise TypeError(f"token ids must be integers, got {type(tok).__name__}") from None
            value = tok.__index__()
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise OverflowError(f"token id {value} does not fit in int64") from None
        raise TypeError(f"bad token ids: {exc}") from None
    return np.frombuffer(packed, dtype=np.int64)


def _checked(result: Any) -> Any:
    if result is None:  # canonical inputs are always accepted: a core bug, not bad input
        raise RuntimeError("the tree core declined validated input")
    return result


#: ``RadixCache(event_options=...)``: the ``EventRecorder`` options a cache passes on.
_EVENT_OPTIONS = frozenset({"lora_id", "medium", "lora_namespaces"})


class RadixCache:
    """A radix tree of token prefixes mapping to KV-cache slot indices (SGLang/Smile API).

    ``core`` picks the tree implementation: ``"c"`` (compiled), ``"python"``, or ``None`` for
    the default (compiled unless ``RADIXCACHE_NO_EXTENSIONS`` is set or it was not built).
    """

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", *,
                 enable_events: bool = False, event_options: dict | None = None,
                 core: str | None = None) -> None:
        page_size = _check_int("page_size", page_size)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not isinstance(eviction_policy, str) or eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {eviction_policy!r}; valid: "
                + ", ".join(EVICTION_POLICIES)
            )
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._core_module = _core.get_core(core)
        self._events = None
        if event_options is not None:
            if not isinstance(event_options, dict):
                raise TypeError(
                    f"event_options must be a dict, got {type(event_options).__name__}")
            if not enable_events:
                raise ValueError("event_options given without enable_events=True")
        if enable_events:
            from .events import EventRecorder  # noqa: PLC0415 -- optional feature

            options = event_options or {}
            unknown = sorted(set(options) - _EVENT_OPTIONS)
            if unknown:
                raise TypeError(f"unknown event option {unknown[0]!r}; valid: "
                                + ", ".join(sorted(_EVENT_OPTIONS)))
            self._events = EventRecorder(page_size, **options)
        self._core = self._core_module.Core(page_size, eviction_policy)

    @property
    def core_name(self) -> str:
        """The tree core this cache runs on: ``"c"`` or ``"python"``."""
        return self._core_module.CORE_NAME

    @property
    def root_node(self) -> Any:
        return self._core.tree.root

    # The core's parts, for consistency checks (tests) and benchmarks.
    @property
    def _tree(self) -> Any:
        return self._core.tree

    @property
    def _heap(self) -> Any:
        return self._core.heap

    @property
    def _evictable(self) -> int:
        return self._core.evictable

    @property
    def _protected(self) -> int:
        return self._core.protected

    # -- input validation (the slow path) ----------------------------------------------
    def _tokens(self, token_ids: Any) -> np.ndarray:
        """Validate the caller's tokens into a 1-D int64 numpy array (or raise)."""
        kind = type(token_ids)
        if kind is list or kind is tuple:
            # The core reads exact ints at C speed; anything else gets Python's checks.
            converted = self._core.token_array(token_ids)
            return _list_tokens(token_ids) if converted is None else converted
        if isinstance(token_ids, torch.Tensor):
            if token_ids.device.type != "cpu":
                raise ValueError(
                    f"token_ids must be a CPU tensor, got one on {token_ids.device}"
                )
            _check_tensor_dtype(token_ids, "token_ids")
            # A copy: the core must not read memory that torch can free under it.
            return np.array(_int64_array(token_ids.detach().numpy(), "token_ids"))
        if isinstance(token_ids, np.ndarray):
            return _int64_array(token_ids, "token_ids")
        if isinstance(token_ids, array.array):
            if token_ids.typecode not in _INT_TYPECODES:
                raise TypeError(
                    f"token_ids array must hold integers, got typecode {token_ids.typecode!r}"
                )
            return _int64_array(np.asarray(token_ids), "token_ids")
        if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or token_ids is None:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            )
        try:
            items = list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            ) from None
        return _list_tokens(items)
    @staticmethod
    def _kv_values(kv_indices: Any, needed: int) -> Any:
        """Validate kv_indices as 1-D integers, at least ``needed`` of them.

        Returns a contiguous int64 numpy array for CPU values (the core copies slices of it)
        or the tensor itself for values on another device.
        """
        if isinstance(kv_indices, torch.Tensor):
            if kv_indices.dim() != 1:
                raise ValueError(f"kv_indices must be 1-D, got {kv_indices.dim()}-D")
            _check_tensor_dtype(kv_indices, "kv_indices")
            values = kv_indices
            if kv_indices.device.type == "cpu":
                values = _int64_array(kv_indices.detach().numpy(), "kv_indices")
        else:
            if isinstance(kv_indices, (str, bytes)):
                raise TypeError("kv_indices must be a sequence of ints, got str/bytes")
            try:
                arr = np.asarray(kv_indices)
            except OverflowError as exc:
                raise OverflowError(f"kv_indices do not fit in int64: {exc}") from None
            except ValueError as exc:  # ragged nesting
                raise ValueError(f"kv_indices must be 1-D: {exc}") from None
            if arr.dtype == object:
                arr = _kv_from_objects(arr)
            if arr.ndim == 1 and arr.size == 0:
                arr = arr.astype(np.int64)
            values = _int64_array(arr, "kv_indices")
        if values.shape[0] < needed:
            raise ValueError(
                f"kv_indices has {values.shape[0]} entries, fewer than the {needed} "
                "page-aligned tokens"
            )
        return values

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # -- the API -----------------------------------------------------------------------
    def match_prefix(self, token_ids: Any, extra_key: Any = None) -> MatchResult:
        """The longest cached prefix (page aligned); a match ending inside a node splits it."""
        result = self._core.match(token_ids, extra_key)
        if result is None:  # an unusual input, or a bad one: validate, then once more
            result = self._validated("match_prefix", self._core.match, token_ids, extra_key)
        return result

    def insert(self, token_ids: Any, kv_indices: Any = None, extra_key: Any = None,
               priority: int = 0) -> InsertResult:
        """Cache ``token_ids``; returns how many leading tokens were cached already."""
        if self._events is None:
            result = self._core.insert(token_ids, kv_indices, extra_key, priority)
            if result is not None:
                return result
        # An unusual input, a bad one, or events on (the recorder has its own rules for
        # extra_key): every check first, then the core with canonical inputs.
        core = self._core
        core.enter("insert")
        try:
            tokens = self._tokens(token_ids)
            if extra_key is not None:
                _check_extra_key(extra_key)
                if self._events is not None:
                    self._events.check_extra_key(extra_key)  # fail before the tree changes
            if type(priority) is not int or not _INT64_MIN <= priority <= _INT64_MAX:
                priority = _check_priority(priority)
            kv = None
            if kv_indices is not None:
                kv = self._kv_values(kv_indices, self._aligned(len(tokens)))
            on_device = isinstance(kv, torch.Tensor)
            result = _checked(core.insert(tokens, None if on_device else kv, extra_key,
                                          priority, True))
            leaf = core.take_new_leaf()
            if leaf is not None:
                if on_device:
                    # Values on a device stay there: a copy on the caller's device.
                    start = result.prefix_len
                    core.set_value(leaf, kv[start:start + leaf.num_tokens].to(
                        torch.int64, copy=True), True)
                if self._events is not None:
                    self._events.stored(leaf)
            return result
        finally:
            core.leave()

    def exists(self, token_ids: Any, extra_key: Any = None) -> bool:
        """True only for a sequence inserted exactly (and not evicted since)."""
        found = self._core.exists(token_ids, extra_key)
        if found is None:
            found = self._validated("exists", self._core.exists, token_ids, extra_key)
        return found

    def _validated(self, what: str, call: Callable, token_ids: Any, extra_key: Any) -> Any:
        """The slow path of a read call the core declined: validate (the documented errors),
        then ``call`` the core again with canonical tokens, all under the cache's guard."""
        core = self._core
        core.enter(what)
        try:
            tokens = self._tokens(token_ids)
            if extra_key is not None:
                _check_extra_key(extra_key)
            return _checked(call(tokens, extra_key, True))
        finally:
            core.leave()

    def _walk(self, tokens: Any, extra_key: Any = None) -> int:
        """The core's bare read-only walk (benchmarks time it against the whole call)."""
        return self._core.walk(tokens, extra_key)

    def __contains__(self, token_ids: Any) -> bool:
        return self.exists(token_ids)

    def inc_lock_ref(self, node: Any) -> int:
        """Protect ``node`` and its ancestors; returns the change in evictable size (<= 0)."""
        return -self._core.lock(node, 1)

    def dec_lock_ref(self, node: Any) -> int:
        """Undo one ``inc_lock_ref``; returns the change in evictable size (>= 0)."""
        return self._core.lock(node, -1)

    def evict(self, num_tokens: int,
              free_callback: Callable[[torch.Tensor], Any] | None = None, *,
              batch: bool = False) -> int:
        """Evict unlocked leaves in policy order until ``num_tokens`` are freed.

        A parent that becomes an evictable leaf joins in. The loop runs in the tree core, one
        call like ``match_prefix``; the callback runs outside it and may call the cache.

        Args:
            num_tokens: tokens to free; 0 or less frees nothing.
            free_callback: called with the freed KV indices (a new 1-D int64 tensor). Per
                node by default: once per evicted node, right after that node is detached.
                If it raises, the nodes evicted so far (the current one included) stay
                evicted and counted, the rest stay cached, and the exception propagates.
            batch: call ``free_callback`` once, after the loop, with every evicted node's
                indices concatenated in eviction order (the same values, in the same order,
                as the per-node calls); not called when nothing was freed. Suits allocators
                that group their frees. Should the loop stop on an error, the nodes evicted
                until then are still handed over before the error propagates.

        Returns:
            The number of tokens freed (at least ``num_tokens`` unless nothing evictable was
            left).

        Raises:
            TypeError: ``num_tokens`` is not an int, or ``free_callback`` is not callable.
        """
        num_tokens = _check_int("num_tokens", num_tokens)
        if free_callback is not None and not callable(free_callback):
            raise TypeError(
                f"free_callback must be callable, got {type(free_callback).__name__}")
        events = self._events
        return self._core.evict(num_tokens, free_callback, bool(batch),
                                None if events is None else events.removed)

    # -- sizes, stats, printing ------------------------------------------------------
    def evictable_size(self) -> int:
        return self._core.evictable

    def protected_size(self) -> int:
        return self._core.protected

    def total_size(self) -> int:
        return self._core.evictable + self._core.protected

    def node_count(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._core.tree.node_count

    def stats(self) -> CacheStats:
        c = self._core
        return CacheStats(
            lookups=c.lookups,
            matched_tokens=c.matched_tokens,
            queried_tokens=c.queried_tokens,
            hit_rate=c.matched_tokens / c.queried_tokens if c.queried_tokens else 0.0,
            inserts=c.inserts,
            inserted_tokens=c.inserted_tokens,
            evictions=c.evictions,
            evicted_tokens=c.evicted_tokens,
            splits=c.tree.num_splits,
            evictable_size=c.evictable,
            protected_size=c.protected,
            total_size=c.evictable + c.protected,
            node_count=c.tree.node_count,
        )

    def reset_stats(self) -> None:
        """Zero the counters; the tree is untouched."""
        self._core.reset_stats()

    def reset(self) -> None:
        """Drop every node (handles become evicted) and zero the counters."""
        core = self._core
        core.enter("reset")
        try:
            core.reset(True)
            if self._events is not None:
                self._events.cleared()
        finally:
            core.leave()

    def take_events(self) -> list:
        """The KV events recorded since the last call, in order (empty when events are off)."""
        if self._events is None:
            return []
        return self._events.take()

    def pretty_print(self, file: TextIO | None = None) -> None:
        """One line per node, indented 2 per level, then the total token count."""
        core = self._core
        core.enter("pretty_print")
        try:
            out = sys.stdout if file is None else file
            for node, depth in core.tree.iter_nodes():
                key = node.key
                shown = ", ".join(str(int(t)) for t in key[:10])
                if len(key) > 10:
                    shown += ", ..."
                out.write(f"{'  ' * depth}[len={len(key)} key=[{shown}] "
                          f"lock_ref={node.lock_ref}]\n")
            out.write(f"#tokens: {self.total_size()}\n")
        finally:
            core.leave()

    def __repr__(self) -> str:
        return (f"RadixCache(page_size={self.page_size}, eviction_policy="
                f"{self.eviction_policy!r}, core={self.core_name!r}, "
                f"total_size={self.total_size()}, nodes={self.node_count()})")

    # Smile's (Java) spellings.
    matchPrefix = match_prefix
    incLockRef = inc_lock_ref
    decLockRef = dec_lock_ref
    evictableSize = evictable_size
    protectedSize = protected_size
    totalSize = total_size
    prettyPrint = pretty_print

"""RadixCache: the public cache over a tree core (input conversion, tensors, locks, eviction)."""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import numpy as np
import torch

from . import _core
from ._shared import EMPTY_INDICES, EVICTION_POLICIES, KEY_FALLS_ON_ACCESS

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


class MatchResult:
    """The longest cached prefix: its KV ``indices``, ``last_node`` and ``length``."""

    __slots__ = ("indices", "last_node", "length")

    def __init__(self, indices: torch.Tensor, last_node: Any, length: int) -> None:
        self.indices = indices
        self.last_node = last_node
        self.length = length

    def __len__(self) -> int:
        return self.length

    def close(self) -> None:
        """Drop the reference to the index tensor (the cache keeps its own copy)."""
        self.indices = EMPTY_INDICES

    def __enter__(self) -> "MatchResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"


class InsertResult:
    """``prefix_len`` leading tokens were cached already; ``last_node`` ends the sequence."""

    __slots__ = ("prefix_len", "last_node")

    def __init__(self, prefix_len: int, last_node: Any) -> None:
        self.prefix_len = prefix_len
        self.last_node = last_node

    def __repr__(self) -> str:
        return f"InsertResult(prefix_len={self.prefix_len}, last_node={self.last_node!r})"


class _Counters:
    __slots__ = ("lookups", "matched_tokens", "queried_tokens", "inserts", "inserted_tokens",
                 "evictions", "evicted_tokens")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


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


def _check_tensor_dtype(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{what} must hold integers, got {tensor.dtype}")


class RadixCache:
    """A radix tree of token prefixes mapping to KV-cache slot indices (SGLang/Smile API).

    ``core`` picks the tree implementation: ``"c"`` (compiled), ``"python"``, or ``None`` for
    the default (compiled unless ``RADIXCACHE_NO_EXTENSIONS`` is set or it was not built).
    """

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", *,
                 enable_events: bool = False, core: str | None = None) -> None:
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
        self._push_on_access = eviction_policy in KEY_FALLS_ON_ACCESS
        self._core = _core.get_core(core)
        self._events = None
        if enable_events:
            from .events import EventRecorder  # noqa: PLC0415 -- optional feature

            self._events = EventRecorder(page_size)
        self._init_state()

    def _init_state(self) -> None:
        self._tree = self._core.Tree(self.page_size)
        self._heap = self._core.EvictionHeap(self.eviction_policy)
        self._evictable = 0
        self._protected = 0
        self._counters = _Counters()

    @property
    def core_name(self) -> str:
        """The tree core this cache runs on: ``"c"`` or ``"python"``."""
        return self._core.CORE_NAME

    @property
    def root_node(self) -> Any:
        return self._tree.root

    # -- input conversion ------------------------------------------------------------
    @staticmethod
    def _tokens(token_ids: Any) -> Any:
        """Validate the caller's tokens into what the core converts once (list, tuple, int64 buffer)."""
        kind = type(token_ids)
        if kind is list or kind is tuple:
            return token_ids
        if isinstance(token_ids, torch.Tensor):
            if token_ids.device.type != "cpu":
                raise ValueError(
                    f"token_ids must be a CPU tensor, got one on {token_ids.device}"
                )
            _check_tensor_dtype(token_ids, "token_ids")
            return _int64_array(token_ids.detach().numpy(), "token_ids")
        if isinstance(token_ids, np.ndarray):
            return _int64_array(token_ids, "token_ids")
        if isinstance(token_ids, array.array):
            if token_ids.typecode not in _INT_TYPECODES:
                raise TypeError(
                    f"token_ids array must hold integers, got typecode {token_ids.typecode!r}"
                )
            if token_ids.typecode == "q":
                return token_ids
            return _int64_array(np.asarray(token_ids), "token_ids")
        if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or token_ids is None:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            )
        try:
            return list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            ) from None

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
            except (OverflowError, ValueError) as exc:
                raise OverflowError(f"kv_indices do not fit in int64: {exc}") from None
            if arr.dtype == object:
                raise OverflowError("kv_indices hold values that do not fit in int64")
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
        tokens = self._tokens(token_ids)
        if extra_key is not None:
            _check_extra_key(extra_key)
        path, length = self._tree.match(tokens, extra_key)
        counters = self._counters
        counters.lookups += 1
        counters.queried_tokens += self._aligned(len(tokens))
        if not path:
            return MatchResult(EMPTY_INDICES, self._tree.root, 0)
        counters.matched_tokens += length
        last = path[-1]
        if self._push_on_access:
            self._push_if_evictable(last)
        return MatchResult(self._tree.gather(path), last, length)

    def insert(self, token_ids: Any, kv_indices: Any = None, extra_key: Any = None,
               priority: int = 0) -> InsertResult:
        """Cache ``token_ids``; returns how many leading tokens were cached already."""
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
        prefix_len, last, new_leaf = self._tree.insert(tokens, extra_key, priority)
        counters = self._counters
        counters.inserts += 1
        if new_leaf is not None:
            added = new_leaf.num_tokens
            if kv is not None:
                piece = kv[prefix_len:prefix_len + added]
                if isinstance(piece, torch.Tensor):
                    # A copy on the caller's device: the cache never aliases their tensor.
                    piece = piece.to(torch.int64, copy=True)
                self._tree.set_value(new_leaf, piece)  # a numpy slice is copied by the core
            self._evictable += added
            counters.inserted_tokens += added
            self._heap.push(new_leaf)
            if self._events is not None:
                self._events.stored(new_leaf)
        elif self._push_on_access:
            self._push_if_evictable(last)
        return InsertResult(prefix_len, last)

    def exists(self, token_ids: Any, extra_key: Any = None) -> bool:
        """True only for a sequence inserted exactly (and not evicted since)."""
        tokens = self._tokens(token_ids)
        if extra_key is not None:
            _check_extra_key(extra_key)
        return self._tree.exists(tokens, extra_key)

    def _walk(self, tokens: Any, extra_key: Any = None) -> int:
        """The core's bare read-only walk (benchmarks time it against the whole call)."""
        return self._tree.walk(tokens, extra_key)

    def __contains__(self, token_ids: Any) -> bool:
        return self.exists(token_ids)

    def inc_lock_ref(self, node: Any) -> int:
        """Protect ``node`` and its ancestors; returns the change in evictable size (<= 0)."""
        moved = self._tree.lock(node, 1)
        self._evictable -= moved
        self._protected += moved
        return -moved

    def dec_lock_ref(self, node: Any) -> int:
        """Undo one ``inc_lock_ref``; returns the change in evictable size (>= 0)."""
        moved = self._tree.lock(node, -1)
        if moved:
            self._evictable += moved
            self._protected -= moved
            # Only the bottom node can have become an evictable leaf: the rest have children.
            self._push_if_evictable(node)
        return moved

    def evict(self, num_tokens: int,
              free_callback: Callable[[torch.Tensor], Any] | None = None) -> int:
        """Evict unlocked leaves in policy order until ``num_tokens`` are freed; returns freed."""
        num_tokens = _check_int("num_tokens", num_tokens)
        pop_victim = self._heap.pop_victim
        tree = self._tree
        counters = self._counters
        freed = 0
        while freed < num_tokens:
            node = pop_victim()
            if node is None:
                break
            value = node.value if free_callback is not None else None
            size = node.num_tokens
            if self._events is not None:
                self._events.removed(node)
            parent = tree.remove_leaf(node)
            freed += size
            self._evictable -= size
            counters.evictions += 1
            counters.evicted_tokens += size
            if parent is not tree.root:
                self._push_if_evictable(parent)
            if free_callback is not None:
                free_callback(value)
        return freed

    # -- eviction heap ---------------------------------------------------------------
    def _push_if_evictable(self, node: Any) -> None:
        if (not node.num_children and not node.lock_ref and not node.evicted
                and node is not self._tree.root):
            self._heap.push(node)

    # -- sizes, stats, printing ------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def node_count(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._tree.node_count

    def stats(self) -> CacheStats:
        c = self._counters
        return CacheStats(
            lookups=c.lookups,
            matched_tokens=c.matched_tokens,
            queried_tokens=c.queried_tokens,
            hit_rate=c.matched_tokens / c.queried_tokens if c.queried_tokens else 0.0,
            inserts=c.inserts,
            inserted_tokens=c.inserted_tokens,
            evictions=c.evictions,
            evicted_tokens=c.evicted_tokens,
            splits=self._tree.num_splits,
            evictable_size=self._evictable,
            protected_size=self._protected,
            total_size=self._evictable + self._protected,
            node_count=self._tree.node_count,
        )

    def reset_stats(self) -> None:
        """Zero the counters; the tree is untouched."""
        self._counters = _Counters()
        self._tree.num_splits = 0

    def reset(self) -> None:
        """Drop every node (handles become evicted) and zero the counters."""
        self._tree.reset()
        self._heap.clear()
        self._evictable = 0
        self._protected = 0
        self._counters = _Counters()
        if self._events is not None:
            self._events.cleared()

    def take_events(self) -> list:
        """The KV events recorded since the last call, in order (empty when events are off)."""
        if self._events is None:
            return []
        return self._events.take()

    def pretty_print(self, file: TextIO | None = None) -> None:
        """One line per node, indented 2 per level, then the total token count."""
        out = sys.stdout if file is None else file
        for node, depth in self._tree.iter_nodes():
            key = node.key
            shown = ", ".join(str(int(t)) for t in key[:10])
            if len(key) > 10:
                shown += ", ..."
            out.write(f"{'  ' * depth}[len={len(key)} key=[{shown}] lock_ref={node.lock_ref}]\n")
        out.write(f"#tokens: {self.total_size()}\n")

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

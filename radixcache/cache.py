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
    """Counters since the last ``reset_stats()``/``reset()``, and the current sizes.

    Returned by ``RadixCache.stats()``; sizes are in tokens.

    Attributes:
        lookups: ``match_prefix`` calls.
        matched_tokens: tokens those calls found cached.
        queried_tokens: tokens those calls asked for.
        hit_rate: ``matched_tokens / queried_tokens`` (0.0 before any lookup).
        inserts: ``insert`` calls.
        inserted_tokens: tokens that ``insert`` added to the tree (not those already cached).
        evictions: nodes evicted.
        evicted_tokens: tokens evicted.
        splits: node splits (a match or insert that ended inside a node).
        evictable_size: tokens in unlocked nodes, now.
        protected_size: tokens in locked nodes, now.
        total_size: ``evictable_size + protected_size``.
        node_count: nodes in the tree, the root excluded.
    """

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
_EVENT_OPTIONS = frozenset({"lora_id", "medium", "lora_namespaces", "block_hash"})


class RadixCache:
    """A radix tree of token prefixes mapping to KV-cache slot indices.

    The prefix cache of an LLM serving loop: ``match_prefix`` finds the longest cached prefix
    of a prompt and its KV slot indices, ``inc_lock_ref``/``dec_lock_ref`` protect it while a
    request runs, ``evict`` frees unlocked leaves in policy order, and ``insert`` caches what a
    request computed. Without KV indices it is a compressed trie of sequences: ``insert`` and
    ``exists`` (or ``seq in cache``). The design follows SGLang's ``RadixCache`` and the API
    Smile's ``smile.llm.cache.RadixCache``, whose camelCase names are aliases here
    (``matchPrefix``, ``incLockRef``, ``decLockRef``, ``evictableSize``, ``protectedSize``,
    ``totalSize``, ``prettyPrint``).

    Token ids may be a list or tuple of ints, an ``array.array``, a 1-D integer numpy array or
    a CPU torch tensor. Bad input raises ``TypeError``, ``ValueError`` or ``OverflowError``
    with a message naming the problem and leaves the cache as it was. Access times come from a
    logical clock, so eviction order is deterministic. A cache is not thread-safe: a call made
    while another call of the same cache runs (from another thread, or from user code such as
    a token's ``__index__``) raises ``RuntimeError`` and changes nothing; serialise the calls.

    Args:
        page_size: Tokens per KV page, an int >= 1. Matches and inserts are rounded down to a
            whole number of pages; the tree stores only whole pages.
        eviction_policy: Which unlocked leaf ``evict`` frees first, one of
            ``EVICTION_POLICIES``: ``"lru"`` (default) least recently used; ``"lfu"`` fewest
            hits (an insert through or ending at a node is a hit), ties by LRU; ``"fifo"``
            oldest created; ``"mru"`` most recently used; ``"filo"`` newest created;
            ``"slru"`` nodes hit fewer than 2 times before the others, LRU in each segment;
            ``"priority"`` lowest priority, then LRU. With every policy a lower ``priority``
            (see ``insert``) goes before a higher one.
        enable_events: Record KV-cache events (``BlockStored``, ``BlockRemoved``,
            ``AllBlocksCleared`` of ``radixcache.events``, one block per full page) for a
            cache-aware router; ``take_events()`` returns them. Off by default: then nothing
            is hashed or recorded.
        event_options: Options of the event recorder, a dict (only with
            ``enable_events=True``): ``"medium"`` (str, default ``"GPU"``), ``"lora_id"`` (a
            fixed int) and ``"lora_namespaces"`` (bool: report a str ``extra_key`` as the
            LoRA name and an int one as the LoRA id).
        core: The tree implementation: ``"c"`` (compiled), ``"python"`` (pure Python, the
            reference), or ``None`` for the default (compiled unless the environment variable
            ``RADIXCACHE_NO_EXTENSIONS`` is set or it was not built; see
            ``radixcache.core_name()``).

    Raises:
        TypeError: ``page_size`` is not an int, ``event_options`` not a dict, or an event
            option is unknown.
        ValueError: ``page_size`` < 1, an unknown ``eviction_policy`` or ``core``, or
            ``event_options`` without ``enable_events=True``.
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
        """The tree's root, a ``RadixTreeNode`` with an empty key (never evicted)."""
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
        """Find the longest cached prefix of ``token_ids``.

        The length is rounded down to a whole number of pages. A match that ends inside a
        node splits it: the existing node object stays as the lower half and a new node takes
        the matched part. Stamps the access time of the nodes on the path (counting no hit).

        Args:
            token_ids: The prompt: a list or tuple of ints, an ``array.array``, a 1-D integer
                numpy array or a CPU torch tensor.
            extra_key: A namespace (any hashable, e.g. a LoRA name or a tenant): only
                sequences inserted with an equal ``extra_key`` match. ``None``: the default
                namespace.

        Returns:
            A ``MatchResult``: ``indices`` (the KV slot indices of the matched tokens, a 1-D
            ``torch.int64`` tensor on the values' device; an empty CPU tensor on a miss),
            ``length`` (tokens matched) and ``last_node`` (the node where the match ends, to
            lock with ``inc_lock_ref``; the root on a miss).

        Raises:
            TypeError: ``token_ids`` are not integers, or ``extra_key`` is not hashable.
            ValueError: ``token_ids`` are not 1-D, or a tensor not on the CPU.
            OverflowError: a token id does not fit in int64.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        result = self._core.match(token_ids, extra_key)
        if result is None:  # an unusual input, or a bad one: validate, then once more
            result = self._validated("match_prefix", self._core.match, token_ids, extra_key)
        return result

    def insert(self, token_ids: Any, kv_indices: Any = None, extra_key: Any = None,
               priority: int = 0) -> InsertResult:
        """Cache ``token_ids`` with their KV slot indices.

        Only whole pages are cached. The part already in the tree is left as it is (its
        nodes' priority is raised to ``priority`` and they count a hit); the rest becomes one
        new leaf holding a copy of its slice of ``kv_indices``. The sequence is marked, so
        that ``exists`` finds it.

        Args:
            token_ids: The tokens (prompt and output): a list or tuple of ints, an
                ``array.array``, a 1-D integer numpy array or a CPU torch tensor.
            kv_indices: The KV slot index of each token: a 1-D integer torch tensor on any
                device (values on a GPU stay there), a numpy array or a sequence of ints, at
                least as long as the page-aligned tokens. ``None``: the token ids serve as
                indices (the trie use).
            extra_key: The namespace (any hashable; see ``match_prefix``).
            priority: An int64; with every eviction policy a lower priority is evicted
                before a higher one.

        Returns:
            An ``InsertResult``: ``prefix_len``, how many leading tokens were cached already
            (their slots in ``kv_indices`` are duplicates the caller may free), and
            ``last_node``, the node where the sequence ends.

        Raises:
            TypeError: tokens or indices that are not integers, an unhashable ``extra_key``,
                a ``priority`` that is not an int, or (with events on) an ``extra_key`` that
                events cannot carry.
            ValueError: tokens or indices that are not 1-D, tokens on a device, or fewer
                indices than page-aligned tokens.
            OverflowError: a token, index or priority that does not fit in int64.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        events = self._events
        if events is None or extra_key is None:  # None: a namespace events always carry
            result = self._core.insert(token_ids, kv_indices, extra_key, priority)
            if result is not None:
                if events is not None and result.prefix_len < self._aligned(len(token_ids)):
                    events.stored(result.last_node)  # the new leaf, where the tokens end
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
        """Tell whether ``token_ids`` were inserted, exactly, and not evicted since.

        A prefix of an inserted sequence does not exist unless it was inserted too. Only
        whole pages count. Read-only: no access time, hit or split.

        Args:
            token_ids: The sequence, in any form ``match_prefix`` accepts.
            extra_key: The namespace it was inserted in (see ``match_prefix``).

        Returns:
            True if the (page-aligned) sequence was inserted and is still cached.

        Raises:
            TypeError: ``token_ids`` are not integers, or ``extra_key`` is not hashable.
            ValueError: ``token_ids`` are not 1-D, or a tensor not on the CPU.
            OverflowError: a token id does not fit in int64.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
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
        """``token_ids in cache``: ``exists(token_ids)`` in the default namespace.

        Args:
            token_ids: The sequence, in any form ``match_prefix`` accepts.

        Returns:
            True if the sequence was inserted exactly and is still cached.
        """
        return self.exists(token_ids)

    def inc_lock_ref(self, node: Any) -> int:
        """Lock ``node`` and its ancestors against eviction, while a request uses them.

        Locks nest: each ``inc_lock_ref`` needs one ``dec_lock_ref``.

        Args:
            node: A ``RadixTreeNode`` of this cache, typically ``MatchResult.last_node``.

        Returns:
            The change in ``evictable_size()`` (<= 0: the tokens that became protected).

        Raises:
            TypeError: ``node`` is not a node of this cache's core.
            ValueError: ``node`` belongs to another cache or was evicted.
            OverflowError: the node already holds the most locks (2**31 - 1); nothing changes.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        return -self._core.lock(node, 1)

    def dec_lock_ref(self, node: Any) -> int:
        """Undo one ``inc_lock_ref`` of ``node`` (and its ancestors).

        Args:
            node: The node that was locked.

        Returns:
            The change in ``evictable_size()`` (>= 0: the tokens that became evictable).

        Raises:
            TypeError: ``node`` is not a node of this cache's core.
            ValueError: ``node`` belongs to another cache, was evicted, or is not locked.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
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
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        num_tokens = _check_int("num_tokens", num_tokens)
        if free_callback is not None and not callable(free_callback):
            raise TypeError(
                f"free_callback must be callable, got {type(free_callback).__name__}")
        events = self._events
        return self._core.evict(num_tokens, free_callback, bool(batch),
                                None if events is None else events.removed)

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what ``evict`` could free).

        Returns:
            The number of tokens.
        """
        return self._core.evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes (see ``inc_lock_ref``).

        Returns:
            The number of tokens.
        """
        return self._core.protected

    def total_size(self) -> int:
        """Tokens in the tree: ``evictable_size() + protected_size()``.

        Returns:
            The number of tokens.
        """
        return self._core.evictable + self._core.protected

    def node_count(self) -> int:
        """Nodes in the tree, the root excluded.

        Returns:
            The number of nodes.
        """
        return self._core.tree.node_count

    def stats(self) -> CacheStats:
        """The counters since the last ``reset_stats()`` or ``reset()``, and the sizes now.

        Returns:
            A ``CacheStats`` (lookups, matched and queried tokens, hit rate, inserts,
            inserted tokens, evictions, evicted tokens, splits, and the sizes).
        """
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
        """Zero the counters of ``stats()``; the tree is untouched."""
        self._core.reset_stats()

    def reset(self) -> None:
        """Drop every node and zero the counters.

        Held node handles report ``evicted``; with events on, records ``AllBlocksCleared``.

        Raises:
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        core = self._core
        core.enter("reset")
        try:
            core.reset(True)
            if self._events is not None:
                self._events.cleared()
        finally:
            core.leave()

    def take_events(self) -> list:
        """Take the KV events recorded since the last call, emptying the queue.

        Returns:
            The events in order (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` of
            ``radixcache.events``), a list; always empty without ``enable_events=True``.
        """
        if self._events is None:
            return []
        return self._events.take()

    def pretty_print(self, file: TextIO | None = None) -> None:
        """Print the tree: one line per node, indented 2 per level, then the token count.

        Each line shows the node's key length, at most its first 10 tokens and its lock
        count; siblings are listed by namespace, then tokens; the last line is
        ``#tokens: N`` (``total_size()``).

        Args:
            file: Where to write (a text stream); ``None``: standard output.

        Raises:
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
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

    # -- copies and persistence ---------------------------------------------------------
    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Support ``pickle``, ``copy.copy`` and ``copy.deepcopy``.

        A cache is saved as its tree (keys, index values, namespaces, priorities, terminal
        marks, access and creation times, hit counts, the logical clock), its statistics, its
        ``page_size``, ``eviction_policy`` and core name, in a versioned format; it loads on
        that core when it is available, else on the default one. Every copy is an
        independent tree that evicts in the same order: ``copy.copy`` shares the
        ``extra_key`` objects with the original, ``copy.deepcopy`` copies them; index values
        are copied either way, and values on a device stay on that device (loading a pickle
        needs it). Locks are not carried: every node of a copy is unlocked (its
        ``protected_size()`` is 0), since no holder of the original's locks could release
        them there.

        Args:
            protocol: The pickle protocol (any).

        Returns:
            The reduction ``pickle`` and ``copy`` use.

        Raises:
            TypeError: The cache records KV events (``enable_events=True``): its event stream
                cannot continue on a copy.
        """
        if self._events is not None:
            raise TypeError("cannot pickle or copy a RadixCache with enable_events=True: its "
                            "KV event stream cannot continue on a copy")
        state = {"format": STATE_FORMAT, "page_size": self.page_size,
                 "eviction_policy": self.eviction_policy, "core": self.core_name,
                 "tree": self._core.export_state()}
        return (_load_cache, (type(self), state))

    # Smile's (Java) spellings.
    matchPrefix = match_prefix
    incLockRef = inc_lock_ref
    decLockRef = dec_lock_ref
    evictableSize = evictable_size
    protectedSize = protected_size
    totalSize = total_size
    prettyPrint = pretty_print


#: The version of the format ``pickle`` saves a cache in; a later version of radixcache may
#: read older formats, never newer ones.
STATE_FORMAT = 1


def _load_cache(cls: type, state: dict) -> RadixCache:
    """Rebuild a pickled or copied cache (``RadixCache.__reduce_ex__``'s counterpart): on the
    core it was saved from when that core is available here, else on the default core."""
    if not isinstance(state, dict) or "format" not in state:
        raise ValueError("not a saved RadixCache state")
    version = state["format"]
    if version != STATE_FORMAT:
        raise ValueError(f"cannot load a RadixCache saved in format {version!r}: this "
                         f"radixcache reads format {STATE_FORMAT} (saved by a newer version?)")
    core = state.get("core")
    cache = cls.__new__(cls)
    RadixCache.__init__(cache, state["page_size"], state["eviction_policy"],
                        core=core if core in _core.CORES else None)
    cache._core.import_state(state["tree"])
    return cache

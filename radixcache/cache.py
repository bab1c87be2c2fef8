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
from typing import TYPE_CHECKING, Any, Callable, TextIO

import numpy as np

from . import _core
from ._cache_host import HostTierCalls
from ._options import ARRAY_TYPES, EVICTION_POLICIES, WRITE_POLICIES
from ._torch import is_tensor, loaded_torch, on_torch
from ._types import InsertResult, MatchResult
from ._validate import INT64_MAX, INT64_MIN, check_int

if TYPE_CHECKING:
    import torch

    from . import _contract

__all__ = ["RadixCache", "MatchResult", "InsertResult", "CacheStats", "ARRAY_TYPES",
           "EVICTION_POLICIES", "WRITE_POLICIES"]

# torch once it is bound (a torch-array cache made, or a tensor met): read without a call.
_torch: Any = None


def _bind_torch(torch: Any) -> None:
    global _torch
    _torch = torch


on_torch(_bind_torch)

#: A write policy as the core takes it: the hits that make a node due for write-through
#: (0: never, write_back).
_WRITE_THROUGH_HITS = dict(zip(WRITE_POLICIES, (0, 1, 2)))
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
        host_hit_tokens: with a host tier, tokens ``match_prefix`` found only in host memory
            (its ``host_length``; not in ``matched_tokens``).
        loaded_tokens: tokens ``load_back`` brought back to the device.
        backed_up_tokens: tokens copied to the host (by ``evict`` or ``write_through``).
        host_evictions: nodes ``evict_host`` removed.
        host_evicted_tokens: tokens ``evict_host`` freed.
        host_size: tokens with a host copy, now (``host_size()``).

    Without a host tier, the host fields are 0 and the sizes are those of the whole tree;
    with one, ``evictable_size``, ``protected_size`` and ``total_size`` count tokens on the
    device, ``evictions`` and ``evicted_tokens`` the nodes and tokens that left it.
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
    host_hit_tokens: int = 0
    loaded_tokens: int = 0
    backed_up_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0
    host_size: int = 0


def _both(record: Callable[[Any], Any], on_remove: Callable[[Any], Any]) -> Callable:
    """``evict``'s victim hook with events on: the event first, then the caller's hook (whose
    answer, the parent's rank, is the hook's)."""
    def removed(node: Any) -> Any:
        record(node)
        return on_remove(node)
    return removed


def _check_priority(priority: Any, what: str = "priority") -> int:
    priority = check_int(priority, what)
    if not INT64_MIN <= priority <= INT64_MAX:
        raise OverflowError(f"{what} {priority} does not fit in int64")
    return priority


def _check_hits_from(hits_from: Any) -> int:
    hits_from = check_int(hits_from, "hits_from", low=0)
    if hits_from > INT64_MAX:
        raise OverflowError(f"hits_from {hits_from} does not fit in int64")
    return hits_from


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
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > INT64_MAX:
        raise OverflowError(f"{what} has values that do not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _kv_from_objects(arr: np.ndarray, what: str = "kv_indices") -> np.ndarray:
    """An object array of kv indices (numpy's result for ints beyond 64 bits, objects with
    ``__index__`` or mixed items) as int64, or the error it deserves: the first item that is
    not an integer (TypeError) or that does not fit in int64 (OverflowError)."""
    values = []
    for item in arr.ravel().tolist():
        if isinstance(item, (bool, np.bool_)) or not hasattr(type(item), "__index__"):
            raise TypeError(f"{what} must hold integers, got {type(item).__name__}")
        value = operator.index(item)
        if not INT64_MIN <= value <= INT64_MAX:
            name = "kv index" if what == "kv_indices" else f"a value of {what}"
            raise OverflowError(f"{name} {value} does not fit in int64")
        values.append(value)
    return np.array(values, dtype=np.int64).reshape(arr.shape)


def _check_tensor_dtype(tensor: torch.Tensor, what: str) -> None:
    dtype = tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == loaded_torch().bool:
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
            if not INT64_MIN <= value <= INT64_MAX:
                raise OverflowError(f"token id {value} does not fit in int64") from None
        raise TypeError(f"bad token ids: {exc}") from None
    return np.frombuffer(packed, dtype=np.int64)


def _checked(result: Any) -> Any:
    if result is None:  # canonical inputs are always accepted: a core bug, not bad input
        raise RuntimeError("the tree core declined validated input")
    return result


class RadixCache(HostTierCalls):
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
            hits (an insert through or ending at a node is a hit; see ``insert``'s
            ``hits_from``), ties by LRU; ``"fifo"`` oldest created; ``"mru"`` most recently
            used; ``"filo"`` newest created;
            ``"slru"`` nodes hit fewer than 2 times before the others, LRU in each segment;
            ``"priority"`` lowest priority, then LRU. With every policy a lower ``priority``
            (see ``insert``) goes before a higher one.
        enable_events: Record KV-cache events (``BlockStored``, ``BlockRemoved``,
            ``AllBlocksCleared`` of ``radixcache.events``, one block per full page) for a
            cache-aware router; ``take_events()`` returns them. Off by default: then nothing
            is hashed or recorded.
        event_options: Options of the event recorder, a dict (only with
            ``enable_events=True``): ``"medium"`` (str, default ``"GPU"``), ``"lora_id"`` (a
            fixed int), ``"lora_namespaces"`` (bool: report a str ``extra_key`` as the
            LoRA name and an int one as the LoRA id), ``"block_hash"`` (``"sha256"``, the
            default, or ``"fast64"``; see ``radixcache.events.BLOCK_HASHES``) and
            ``"record"``: ``"events"`` (the default) or ``"keys"``, which records, instead
            of event objects, the blocks' ``fast64`` keys as ``KvIndexer.apply_keys`` takes
            them (for a router in the same process; no other option, no host tier; see
            ``radixcache.events.recorder``).
        core: The tree implementation: ``"c"`` (compiled), ``"python"`` (pure Python, the
            reference), or ``None`` for the default (compiled unless the environment variable
            ``RADIXCACHE_NO_EXTENSIONS`` is set or it was not built; see
            ``radixcache.core_name()``).
        host_tier: Give the cache a second tier, host memory (see "Host tier" below). Off by
            default: then the cache behaves exactly as a one-tier cache.
        write_policy: When a node gets its host copy, with ``host_tier=True``: one of
            ``WRITE_POLICIES``: ``"write_back"`` (default) when ``evict`` pushes it off the
            device (its ``backup`` callback copies it); ``"write_through"`` once it has been
            hit (inserted through) once, and ``"write_through_selective"`` once hit twice --
            ``write_through(backup)`` copies the nodes that became due.
        array_type: What the cache's index arrays are, one of ``ARRAY_TYPES``: ``"torch"``
            (default) 1-D ``torch.int64`` tensors, on the values' device; ``"numpy"`` 1-D
            int64 numpy arrays -- ``MatchResult.indices``, ``RadixTreeNode.value``, what
            ``free_callback`` and ``backup`` get, what ``backup`` must return and what
            ``load_back`` returns -- and the cache never imports torch (a simulator, an engine
            without torch). Index values then stay on the CPU: a device tensor given as
            ``kv_indices`` is refused. Inputs may be torch tensors either way.

    Host tier: a node holds a device value (its KV slots on the GPU), a host value (slots in
    a host pool), or both (``RadixTreeNode.tier``). The cache owns no pool and copies no
    data: it tells the engine what to copy and takes the indices the engine hands back.
    ``evict(..., backup=...)`` demotes victims to the host; ``match_prefix`` reports the
    host-only continuation (``MatchResult.host_length``, ``last_host_node``);
    ``load_back`` puts it on the device again; ``insert`` through a host-only node adopts
    the caller's device slots for it; ``evict_host`` frees host memory. Sizes
    (``evictable_size``, ``protected_size``, ``total_size``) count the device tier;
    ``host_size`` the tokens with a host copy. A host-tier cache cannot be pickled or copied.

    Raises:
        TypeError: ``page_size`` is not an int, ``event_options`` not a dict, an event
            option is unknown or of the wrong type, ``host_tier`` is not a bool, or
            ``write_policy`` or ``array_type`` not a str.
        ValueError: ``page_size`` < 1, an unknown ``eviction_policy``, ``core``,
            ``write_policy`` or ``array_type``, ``event_options`` without
            ``enable_events=True``, an unknown ``block_hash`` or ``record``, or
            ``record="keys"`` with another option or ``host_tier=True``.
        ModuleNotFoundError: ``array_type="torch"`` (the default) without PyTorch installed
            (``pip install 'radixcache[torch]'``, or use ``array_type="numpy"``).
    """

    def __init__(self, page_size: int = 1, eviction_policy: str = "lru", *,
                 enable_events: bool = False, event_options: dict | None = None,
                 core: str | None = None, host_tier: bool = False,
                 write_policy: str = "write_back", array_type: str = "torch") -> None:
        page_size = check_int(page_size, "page_size", low=1)
        if not isinstance(eviction_policy, str) or eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {eviction_policy!r}; valid: "
                + ", ".join(EVICTION_POLICIES)
            )
        if type(host_tier) is not bool:
            raise TypeError(f"host_tier must be a bool, got {type(host_tier).__name__}")
        if not isinstance(write_policy, str):
            raise TypeError(f"write_policy must be a str, got {type(write_policy).__name__}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write_policy {write_policy!r}; valid: "
                             + ", ".join(WRITE_POLICIES))
        if not isinstance(array_type, str):
            raise TypeError(f"array_type must be a str, got {type(array_type).__name__}")
        if array_type not in ARRAY_TYPES:
            raise ValueError(f"unknown array_type {array_type!r}; valid: "
                             + ", ".join(ARRAY_TYPES))
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.array_type = array_type
        self.host_tier = host_tier
        self.write_policy = write_policy
        self._core_module: _contract.CoreModule = _core.get_core(core)
        self._events = None
        if event_options is not None:
            if not isinstance(event_options, dict):
                raise TypeError(
                    f"event_options must be a dict, got {type(event_options).__name__}")
            if not enable_events:
                raise ValueError("event_options given without enable_events=True")
        if enable_events:
            from .events.recorder import new_recorder  # optional feature

            self._events = new_recorder(page_size, event_options, host_tier=host_tier)
        numpy_arrays = {"numpy_arrays": True} if array_type == "numpy" else {}
        self._core: _contract.Core
        if host_tier:
            self._core = self._core_module.Core(page_size, eviction_policy, True,
                                                _WRITE_THROUGH_HITS[write_policy],
                                                **numpy_arrays)
        else:
            self._core = self._core_module.Core(page_size, eviction_policy, **numpy_arrays)

    @property
    def core_name(self) -> str:
        """The tree core this cache runs on: ``"c"`` or ``"python"``."""
        return self._core_module.CORE_NAME

    @property
    def root_node(self) -> Any:
        """The tree's root, a ``RadixTreeNode`` with an empty key (never evicted)."""
        return self._core.tree.root

    # -- input validation (the slow path) ----------------------------------------------
    def _tokens(self, token_ids: Any) -> np.ndarray:
        """Validate the caller's tokens into a 1-D int64 numpy array (or raise)."""
        kind = type(token_ids)
        if kind is list or kind is tuple:
            # The core reads exact ints at C speed; anything else gets Python's checks.
            converted = self._core.token_array(token_ids)
            return _list_tokens(token_ids) if converted is None else converted
        if is_tensor(token_ids):
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
    def _kv_values(self, kv_indices: Any, needed: int, what: str = "kv_indices") -> Any:
        """Validate kv_indices as 1-D integers, at least ``needed`` of them.

        Returns a contiguous int64 numpy array for CPU values (the core copies slices of it)
        or the tensor itself for values on another device (torch arrays only).
        """
        if is_tensor(kv_indices):
            if kv_indices.dim() != 1:
                raise ValueError(f"{what} must be 1-D, got {kv_indices.dim()}-D")
            _check_tensor_dtype(kv_indices, what)
            values = kv_indices
            if kv_indices.device.type == "cpu":
                values = _int64_array(kv_indices.detach().numpy(), what)
            elif self.array_type == "numpy":
                raise ValueError(f"{what} on {kv_indices.device}: a cache with "
                                 "array_type='numpy' keeps indices on the CPU (use a torch "
                                 "cache for device indices)")
        else:
            if isinstance(kv_indices, (str, bytes)):
                raise TypeError(f"{what} must be a sequence of ints, got str/bytes")
            try:
                arr = np.asarray(kv_indices)
            except OverflowError as exc:
                raise OverflowError(f"{what} do not fit in int64: {exc}") from None
            except ValueError as exc:  # ragged nesting
                raise ValueError(f"{what} must be 1-D: {exc}") from None
            if arr.dtype == object:
                arr = _kv_from_objects(arr, what)
            if arr.ndim == 1 and arr.size == 0:
                arr = arr.astype(np.int64)
            values = _int64_array(arr, what)
        if values.shape[0] < needed:
            raise ValueError(
                f"{what} has {values.shape[0]} entries, fewer than the {needed} "
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
            ``torch.int64`` tensor on the values' device, an empty CPU tensor on a miss; a
            numpy array with ``array_type="numpy"``),
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
               priority: int = 0, *, hits_from: int = 0, split_at: int | None = None,
               split_priority: int = 0) -> InsertResult:
        """Cache ``token_ids`` with their KV slot indices.

        Only whole pages are cached. The part already in the tree is left as it is (its
        nodes' priority is raised to ``priority``, and those that end past ``hits_from``
        tokens count a hit); the rest becomes one new leaf holding a copy of its slice of
        ``kv_indices``. The sequence is marked, so that ``exists`` finds it.

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
            hits_from: Count a hit only on the nodes of the path that end past this many
                tokens (an int >= 0; the default 0 counts every node). A caller that inserts
                a growing sequence in steps passes the length it inserted before, so that
                each node counts one hit per sequence, as SGLang counts them for its
                ``lfu`` and ``slru`` policies. A new leaf that ends at or before
                ``hits_from`` starts with no hit.
            split_at: None, or a multiple of the page size at most the page-aligned length:
                then, in the same call, the first ``split_at`` tokens are inserted again
                as ``insert(token_ids[:split_at], None, extra_key, split_priority,
                hits_from=split_at)`` would: the node they end inside is split there, their
                path is stamped once more and its priorities raised to ``split_priority``,
                no hit counts. An engine caching a finished request splits its prompt from
                its answer this way (the answer can then be evicted first).
            split_priority: ``split_at``'s priority, an int64.

        With a host tier, a node on the path that is only on the host is adopted: it takes
        the caller's slots for its tokens (a copy of that slice of ``kv_indices``) and is on
        the device again, keeping its host copy. Adopted tokens do not count in
        ``prefix_len``: their slots are used by the cache, not duplicates.

        With ``kv_indices`` on a device the call copies every slice it keeps there before it
        stores any; if a copy fails (the device is out of memory, say) the error propagates
        and no token moved tier: the new leaf is not cached and the nodes it would have
        adopted are host only again (a split the walk made stays, as do its access times).

        Returns:
            An ``InsertResult``: ``prefix_len``, how many leading tokens were cached on the
            device already (their slots in ``kv_indices`` are duplicates the caller may
            free), and ``last_node``, the node where the sequence ends.

        Raises:
            TypeError: tokens or indices that are not integers, an unhashable ``extra_key``,
                a ``priority`` or ``hits_from`` that is not an int, or (with events on) an
                ``extra_key`` that events cannot carry.
            ValueError: tokens or indices that are not 1-D, tokens on a device, fewer
                indices than page-aligned tokens, a negative ``hits_from``, or a ``split_at``
                that is negative, not a multiple of the page size or past the page-aligned
                length.
            OverflowError: a token, index, priority, ``hits_from`` or ``split_priority``
                that does not fit in int64.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile, or another thread wrote ``token_ids`` while the
                call read them (the rest of the sequence is then not cached).
        """
        events = self._events
        if split_at is not None and (self.host_tier or events is not None):
            # The two inserts: the core's split would come before the adopted nodes and the
            # new leaf get their events (a prompt's pages would be announced under a parent
            # hash never sent).
            return self._insert_and_split(token_ids, kv_indices, extra_key, priority,
                                          hits_from, split_at, split_priority)
        # extra_key None: a namespace events always carry.
        if events is None or (extra_key is None and not self.host_tier):
            result = self._core.insert(token_ids, kv_indices, extra_key, priority, False,
                                       hits_from, split_at, split_priority)
            if result is not None:
                if events is not None and result.prefix_len < self._aligned(len(token_ids)):
                    events.stored(result.last_node)  # the new leaf, where the tokens end
                return result
        elif extra_key is None:
            # With a host tier the adopted nodes' events come first: the core call is held,
            # so that it leaves them (and its new leaf) to take afterwards.
            result = self._held_insert(token_ids, kv_indices, priority, hits_from)
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
            if type(priority) is not int or not INT64_MIN <= priority <= INT64_MAX:
                priority = _check_priority(priority)
            if type(hits_from) is not int or not 0 <= hits_from <= INT64_MAX:
                hits_from = _check_hits_from(hits_from)
            if split_at is not None:
                split_at, split_priority = self._check_split(split_at, split_priority,
                                                             len(tokens))
            kv = None
            if kv_indices is not None:
                kv = self._kv_values(kv_indices, self._aligned(len(tokens)))
            on_device = kv is not None and not isinstance(kv, np.ndarray)
            # Values on a device are stored after the core's insert: the split comes after
            # them, or the prompt's upper node would keep no value (its tokens as slots).
            result = _checked(core.insert(tokens, None if on_device else kv, extra_key,
                                          priority, True, hits_from,
                                          None if on_device else split_at, split_priority))
            self._after_held_insert(kv if on_device else None, len(tokens))
            if on_device and split_at is not None:
                _checked(core.insert(tokens[:split_at], None, extra_key, split_priority, True,
                                     split_at))
            return result
        finally:
            core.leave()

    def _check_split(self, split_at: Any, split_priority: Any, num_tokens: int) -> tuple:
        """``insert``'s ``split_at`` and ``split_priority`` as ints, checked against a
        sequence of ``num_tokens`` tokens."""
        split_at = check_int(split_at, "split_at", low=0, high=self._aligned(num_tokens))
        if split_at % self.page_size:
            raise ValueError(f"split_at must be a multiple of the page size "
                             f"{self.page_size}, got {split_at}")
        return split_at, _check_priority(split_priority, "split_priority")

    def _insert_and_split(self, token_ids: Any, kv_indices: Any, extra_key: Any,
                          priority: Any, hits_from: Any, split_at: Any,
                          split_priority: Any) -> InsertResult:
        """``insert`` with ``split_at`` in a cache with a host tier or events: the two
        inserts it stands for, ``split_at`` checked before either."""
        tokens = self._tokens(token_ids)
        split_at, split_priority = self._check_split(split_at, split_priority, len(tokens))
        result = self.insert(tokens, kv_indices, extra_key, priority, hits_from=hits_from)
        self.insert(tokens[:split_at], None, extra_key, split_priority, hits_from=split_at)
        return result

    def _held_insert(self, token_ids: Any, kv_indices: Any, priority: Any,
                     hits_from: Any) -> Any:
        """``insert``'s fast path with events and a host tier (default namespace): the core
        under the cache's guard, then the events of the nodes it adopted and of its new leaf,
        as the checked path emits them; None when the core declined the input."""
        core = self._core
        core.enter("insert")
        try:
            result = core.insert(token_ids, kv_indices, None, priority, True, hits_from)
            if result is not None:
                self._after_held_insert(None, len(token_ids))
            return result
        finally:
            core.leave()

    def _after_held_insert(self, device_kv: Any, num_tokens: int) -> None:
        """After a held core insert, still under the guard: the nodes it adopted (top-down)
        and its new leaf get their device values (``device_kv``: the caller's indices on a
        device, else None: the core stored them) and their events.

        Every device copy is made before any is stored: if one raises (the device is out of
        memory, a torch hook), the core reverts the insert's tiers (the new leaf leaves, the
        adopted nodes are host only again) and the error propagates, so no node keeps its
        token ids as KV slots."""
        core = self._core
        events = self._events
        adopted = core.take_adopted() if self.host_tier else []
        leaf = core.take_new_leaf()
        if device_kv is not None and (adopted or leaf is not None):
            torch_module = _torch  # device values: torch is bound
            try:
                # Values on a device stay there: copies on the caller's device.
                values = [device_kv[start:start + node.num_tokens].to(
                    torch_module.int64, copy=True) for node, start in adopted]
                if leaf is not None:
                    start = self._aligned(num_tokens) - leaf.num_tokens  # the tail
                    values.append(device_kv[start:start + leaf.num_tokens].to(
                        torch_module.int64, copy=True))
                nodes = [node for node, _ in adopted]
                if leaf is not None:
                    nodes.append(leaf)
                for node, value in zip(nodes, values):
                    core.set_value(node, value, True)
            except BaseException:
                core.revert_insert(adopted, leaf, True)
                raise
        if events is not None:
            for node, _ in adopted:
                events.stored(node)
            if leaf is not None:
                events.stored(leaf)

    def exists(self, token_ids: Any, extra_key: Any = None) -> bool:
        """Tell whether ``token_ids`` were inserted, exactly, and not evicted since.

        A prefix of an inserted sequence does not exist unless it was inserted too. Only
        whole pages count. With a host tier, a sequence held on the host alone still
        exists (it left the device, not the cache). Read-only: no access time, hit or split.

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
            ValueError: ``node`` belongs to another cache, was evicted, or is only on the host
                (``load_back`` it first).
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

    def set_eviction_rank(self, node: Any, rank: int) -> None:
        """Put ``node`` in eviction rank ``rank``: ``evict`` frees every evictable leaf of a
        lower rank before any leaf of a higher one, in policy order within a rank.

        Every node has rank 0 until given another. A rank is the node's own: a split keeps it
        on the node (the lower half) and gives the new upper half rank 0; ``evict`` does not
        pass it on to the parent a removal leaves behind (``evict``'s ``on_remove`` can). It
        goes when the node leaves the cache. Locks, sizes and matches do not see ranks.

        Args:
            node: A ``RadixTreeNode`` of this cache (not the root).
            rank: An int in [0, 2**63).

        Raises:
            TypeError: ``node`` is not a node of this cache's core, or ``rank`` is not an int.
            ValueError: ``rank`` is out of range, ``node`` is the root, belongs to another
                cache or was evicted, or the cache has a host tier (ranks order one tier).
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        if type(rank) is not int:  # the core checks an int's range itself
            rank = check_int(rank, "rank", 0, INT64_MAX)
        self._core.set_rank(node, rank)

    def eviction_rank(self, node: Any) -> int:
        """``node``'s eviction rank (see ``set_eviction_rank``).

        Args:
            node: A ``RadixTreeNode`` of this cache.

        Returns:
            The rank, an int (0 unless one was set).

        Raises:
            TypeError: ``node`` is not a node of this cache's core.
            ValueError: ``node`` belongs to another cache or was evicted.
        """
        self._core.tree._check_member(node)
        return self._core.heap.rank_of(node)

    def tag_session(self, node: Any, session: int) -> bool:
        """Tag ``node`` for ``session``, as an engine's session keeps the leaf its last
        request ended on: the nearest ancestor ``session`` tagged loses its tag. A tagged
        node's eviction rank is its number of sessions; an evicted tagged leaf gives its tags
        to its parent (not the root) inside ``evict``. ``untag_session`` drops them.

        Args:
            node: A ``RadixTreeNode`` of this cache (the root: nothing changes).
            session: An int in [0, 2**63) that names the session.

        Returns:
            Whether anything changed (not when ``session`` tags ``node`` already).

        Raises:
            TypeError, ValueError: as ``set_eviction_rank``, or ``session`` is not such an int.
        """
        return self._core.tag_session(node, session)

    def untag_session(self, session: int) -> int:
        """Drop every tag of ``session`` (see ``tag_session``).

        Args:
            session: An int in [0, 2**63).

        Returns:
            How many nodes it tagged.
        """
        return self._core.untag_session(session)

    def evict(self, num_tokens: int,
              free_callback: Callable[[torch.Tensor], Any] | None = None, *,
              batch: bool = False,
              backup: Callable[[torch.Tensor], Any] | None = None,
              free_host: Callable[[torch.Tensor], Any] | None = None,
              on_remove: Callable[[Any], int | None] | None = None,
              keep: Any = None, page_ids: bool = False) -> int:
        """Evict unlocked leaves in policy order until ``num_tokens`` are freed.

        A parent that becomes an evictable leaf joins in. The loop runs in the tree core, one
        call like ``match_prefix``; the callback runs outside it and may call the cache. Leaves
        of a lower eviction rank go first (``set_eviction_rank``).

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
                until then are still handed over before the error propagates; should their
                indices not join into one tensor (``torch.cat`` refusing device values on
                several devices, or a torch hook), they are handed over in parts (a device
                node's indices; CPU indices of consecutive nodes may come together), in
                order, every part even if a call raises, and then ``torch.cat``'s error
                propagates.
            backup: With a host tier and the ``write_back`` policy: called with a victim's
                device indices (the tensor ``free_callback`` gets next; with ``batch``, that
                victim's part of the batch, which may share its memory: read it, do not
                write to it) when it has no host copy yet. The engine allocates host
                slots, copies the KV there and returns their indices (a 1-D
                ``torch.int64`` tensor, one per device slot), or None when the host is
                full. It runs inside the call: it must not call the cache.
            free_host: With a host tier: called with the host indices (a new 1-D CPU int64
                tensor) of each host-only node the call removes, right after it left the
                tree (as ``evict_host`` would hand them). It runs inside the call, like
                ``backup``: it must not call the cache. Given it, when ``backup`` finds no
                room the call removes host-only leaves one at a time in policy order,
                asking ``backup`` again after each, until it answers or none is left (as
                SGLang evicts host entries and retries); and a victim that still gets no host copy
                leaves with its host-only subtree: every victim leaves the device in policy order,
                however full the host is.
            on_remove: Called with each victim before it leaves the tree (or, with a host
                tier, the device), inside the call: it must not call the cache. It may return
                the eviction rank the victim's parent takes (an int in [0, 2**63); None keeps
                the parent's; ignored when the parent is the root or with a host tier), set
                before the parent can follow in the same call: an owner whose ranks say what
                a leaf leaves to its parent keeps them exact. If it raises, or returns
                anything else, the victim stays as it was and the error propagates.
            page_ids: With ``batch`` (and without a host tier): ``free_callback`` gets the
                page id of every freed page instead of the indices -- every
                ``page_size``-th index from each victim's first, floor-divided by
                ``page_size`` (``indices[::page_size] // page_size`` of the batch), in the
                same order: what a paged allocator frees, computed in the core.
            keep: With a host tier: nodes (a set, or anything ``in`` works on) this call must
                leave where they are: a device leaf in it is passed over, a host leaf in it is
                not removed to make room, and a victim whose host-only subtree holds one is
                passed over instead of leaving with it (the engine's in-flight transfers).

        With a host tier, a victim leaves the device only: one that has a host copy (or gets
        one from ``backup``) stays in the tree, host only, and its device slots go to
        ``free_callback``; one that gets none is deleted as without a host tier, except that
        without ``free_host`` a node with host-only children stays on the device (free host
        memory with ``evict_host`` first, or copy it with ``write_through``); ``backup`` is asked
        about a victim at most once per call, even if a ``free_callback`` makes it a leaf again
        meanwhile (the next call asks again). A parent whose children
        all left the device can follow in the same call. A ``backup`` that raises, or
        returns something else than None or a valid tensor, leaves its victim as it was.
        An error raised after ``backup`` answered and before the answer was kept (a bad
        value, or a torch hook raising while the cache reads it) carries that answer, as
        returned, in its ``host_indices`` attribute: those host slots are not the cache's,
        the engine frees them. An error ``backup`` raised itself has no such attribute.

        Returns:
            The number of tokens freed from the device (at least ``num_tokens`` unless
            nothing evictable was left).

        Raises:
            TypeError: ``num_tokens`` is not an int, ``page_ids`` not a bool,
                ``free_callback``, ``backup``,
                ``free_host`` or ``on_remove`` is not callable, ``backup`` returned something
                else than None or an int64 tensor, or ``on_remove`` something else than None
                or an int.
            ValueError: ``backup`` or ``free_host`` given to a cache without a host tier,
                ``page_ids`` without ``batch`` or with a host tier,
                ``backup`` returned a tensor that is not 1-D, of another length than the
                victim's, or without data (meta or sparse), or ``on_remove`` a rank out of
                range.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        if (type(num_tokens) is int and backup is None and free_host is None and keep is None
                and self._events is None
                and not self.host_tier and (free_callback is None or callable(free_callback))
                and (on_remove is None or callable(on_remove))):
            # The common call, already valid: straight to the core.
            if page_ids is True:
                return self._core.evict(num_tokens, free_callback, bool(batch), on_remove,
                                        page_ids=True)
            if page_ids is False:
                return self._core.evict(num_tokens, free_callback, bool(batch), on_remove)
        num_tokens = check_int(num_tokens, "num_tokens")
        if type(page_ids) is not bool:
            raise TypeError(f"page_ids must be a bool, got {type(page_ids).__name__}")
        if page_ids and (not batch or self.host_tier):
            raise ValueError("evict(page_ids=True) needs batch=True and a cache without a "
                             "host tier")
        if free_callback is not None and not callable(free_callback):
            raise TypeError(
                f"free_callback must be callable, got {type(free_callback).__name__}")
        if on_remove is not None and not callable(on_remove):
            raise TypeError(f"on_remove must be callable, got {type(on_remove).__name__}")
        events = self._events
        removed = None if events is None else events.removed
        if on_remove is not None:
            removed = on_remove if removed is None else _both(removed, on_remove)
        if not self.host_tier:
            if backup is not None or free_host is not None or keep is not None:
                what = ("backup" if backup is not None
                        else "free_host" if free_host is not None else "keep")
                raise ValueError(f"evict({what}=...) needs a cache with a host tier "
                                 "(RadixCache(host_tier=True))")
            return self._core.evict(num_tokens, free_callback, bool(batch), removed,
                                    page_ids=page_ids)
        if backup is not None and not callable(backup):
            raise TypeError(f"backup must be callable, got {type(backup).__name__}")
        if free_host is not None and not callable(free_host):
            raise TypeError(f"free_host must be callable, got {type(free_host).__name__}")
        return self._core.evict(num_tokens, free_callback, bool(batch), removed, backup,
                                None if events is None else events.stored_host, free_host,
                                None if events is None else events.removed_host, keep)

    def load_back(self, match: MatchResult, device_indices: Any) -> torch.Tensor:
        """Put the host-only continuation of a match back on the device.

        The engine allocated ``match.host_length`` device slots; the nodes from
        ``match.last_node`` down to ``match.last_host_node`` take them, in order, and are on
        both tiers again. The engine then copies the KV from the returned host indices to
        those slots; ``match_prefix`` now returns the whole prefix from the device (lock
        ``match.last_host_node`` while a request uses it).

        Args:
            match: What ``match_prefix`` of this cache returned, with the tree unchanged
                along its path since (no eviction, load or insert through it).
            device_indices: The new device slots, ``match.host_length`` of them: a 1-D
                integer torch tensor on any device, a numpy array or a sequence of ints.

        Returns:
            The host indices of the same tokens in the same order, a new 1-D CPU
            ``torch.int64`` tensor (empty when ``match.host_length`` is 0).

        Raises:
            TypeError: ``match`` is not a ``MatchResult``, or ``device_indices`` do not hold
                integers.
            ValueError: the cache has no host tier, a stale ``match`` (its host
                continuation is no longer exactly there), or not exactly
                ``match.host_length`` device indices, or not 1-D.
            OverflowError: a device index does not fit in int64.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        # The common call -- a contiguous int64 numpy array or CPU tensor of the right
        # length -- would pass the checks below: straight to the core, which copies it.
        values = device_indices
        torch = _torch
        if (torch is not None and type(values) is torch.Tensor and values.dtype is torch.int64
                and values.is_cpu and values.is_contiguous()):
            values = values.detach().numpy()
        if (type(values) is np.ndarray and type(match) is MatchResult and self.host_tier
                and values.dtype == np.int64 and values.ndim == 1
                and values.shape[0] == match.host_length and values.flags.c_contiguous):
            events = self._events
            return self._core.load_back(match, values, None if events is None else events.stored)
        if not isinstance(match, MatchResult):
            raise TypeError(f"match must be a MatchResult, got {type(match).__name__}")
        self._need_host_tier("load_back")
        values = self._kv_values(device_indices, 0, "device_indices")
        wanted = match.host_length
        if values.shape[0] != wanted:
            raise ValueError(f"load_back got {values.shape[0]} device indices for a host "
                             f"match of {wanted} tokens")
        if not isinstance(values, np.ndarray):  # on a device: kept there, a copy of it
            values = values.to(_torch.int64, copy=True)
        events = self._events
        return self._core.load_back(match, values, None if events is None else events.stored)

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
            inserted tokens, evictions, evicted tokens, splits, the sizes, and with a host
            tier its counters and size).
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
            **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        if not self.host_tier:
            return {}
        c = self._core
        return {"host_hit_tokens": c.host_hit_tokens, "loaded_tokens": c.loaded_tokens,
                "backed_up_tokens": c.backed_up_tokens, "host_evictions": c.host_evictions,
                "host_evicted_tokens": c.host_evicted_tokens, "host_size": c.host_size}

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
            With ``event_options={"record": "keys"}``: block-key records and
            ``AllBlocksCleared``, for ``KvIndexer.apply_keys``.
        """
        if self._events is None:
            return []
        return self._events.take()

    def pretty_print(self, file: TextIO | None = None) -> None:
        """Print the tree: one line per node, indented 2 per level, then the token count.

        Each line shows the node's key length, at most its first 10 tokens and its lock
        count (and, with a host tier, its tier: ``device``, ``host`` or ``device+host``);
        siblings are listed by namespace, then tokens; the last line is ``#tokens: N``
        (``total_size()``), followed with a host tier by ``#host tokens: N``
        (``host_size()``).

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
            tiers = self.host_tier
            for node, depth in core.tree.iter_nodes():
                key = node.key
                shown = ", ".join(str(int(t)) for t in key[:10])
                if len(key) > 10:
                    shown += ", ..."
                tier = f" tier={node.tier}" if tiers and depth else ""
                out.write(f"{'  ' * depth}[len={len(key)} key=[{shown}] "
                          f"lock_ref={node.lock_ref}{tier}]\n")
            out.write(f"#tokens: {self.total_size()}\n")
            if tiers:
                out.write(f"#host tokens: {core.host_size}\n")
        finally:
            core.leave()

    def __repr__(self) -> str:
        host = (f", write_policy={self.write_policy!r}, host_size={self._core.host_size}"
                if self.host_tier else "")
        arrays = ", array_type='numpy'" if self.array_type == "numpy" else ""
        return (f"RadixCache(page_size={self.page_size}, eviction_policy="
                f"{self.eviction_policy!r}, core={self.core_name!r}{arrays}, "
                f"total_size={self.total_size()}, nodes={self.node_count()}{host})")

    # -- copies and persistence ---------------------------------------------------------
    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Support ``pickle``, ``copy.copy`` and ``copy.deepcopy``.

        A cache is saved as its tree (keys, index values, namespaces, priorities, terminal
        marks, access and creation times, hit counts, the logical clock), its statistics, its
        ``page_size``, ``eviction_policy``, ``array_type`` and core name, in a versioned
        format; it loads on that core when it is available, else on the default one. Every
        copy is an independent tree that evicts in the same order: ``copy.copy`` shares the
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
                cannot continue on a copy; or it has a host tier: its host indices belong to
                the engine's host pool, which a copy would share.
        """
        if self.host_tier:
            raise TypeError("cannot pickle or copy a RadixCache with host_tier=True: its host "
                            "indices point into the engine's host pool, which a copy cannot "
                            "own")
        if self._events is not None:
            raise TypeError("cannot pickle or copy a RadixCache with enable_events=True: its "
                            "KV event stream cannot continue on a copy")
        state = {"format": STATE_FORMAT, "page_size": self.page_size,
                 "eviction_policy": self.eviction_policy, "core": self.core_name,
                 "array_type": self.array_type, "tree": self._core.export_state()}
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
                        core=core if core in _core.CORES else None,
                        array_type=state.get("array_type", "torch"))
    cache._core.import_state(state["tree"])
    return cache

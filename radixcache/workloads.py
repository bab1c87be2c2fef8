"""Workloads and the serving loop shared by the ``radixcache`` command and the benchmarks.

- ``Request``: one prompt and its output (given tokens, or a length the loop fills with fresh ids).
- ``synthetic_chat``: a deterministic multi-turn chat workload (shared system prompts).
- ``exercise_ops``: a stream of insert/exists calls with long shared prefixes (a shallow tree).
- ``deep_exercise_ops``: the same calls over prefixes of random length of shared bases (a
  tree about 100 nodes deep).
- ``time_cached_calls``: the in-cache cost of ``match_prefix`` + ``insert`` per request with
  every prompt cached, split into the core's bare tree walk and the rest, per input type.
- ``walk_cost``: time of ``exists`` per node visited on a built tree.
- ``KVPool`` and ``serve``: a KV pool of token slots and the serving loop that replays requests
  against a cache the way an inference server does (match, lock, evict, insert, unlock).
- ``HostPool``: a host-memory pool of token slots for a cache with a host tier; ``serve`` and
  ``ServingLoop`` back evicted prefixes up into it and load host hits back
  (``host_capacity=``).

Token ids of prompts must lie in ``[0, FRESH_TOKEN_BASE)``: ``serve`` numbers the fresh output
tokens it generates from ``FRESH_TOKEN_BASE`` up, so they never equal a prompt token.
"""

from __future__ import annotations

import array
import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from ._core import core as _default_core
from ._options import ARRAY_TYPES
from ._torch import is_tensor, load_torch

if TYPE_CHECKING:
    import torch

__all__ = [
    "FRESH_TOKEN_BASE",
    "Admission",
    "HostPool",
    "KVPool",
    "Request",
    "ServeResult",
    "INPUT_TYPES",
    "InCacheTiming",
    "ServingLoop",
    "as_input_type",
    "deep_exercise_ops",
    "exercise_ops",
    "time_cached_calls",
    "walk_cost",
    "serve",
    "synthetic_chat",
]

#: First id of the output tokens ``serve`` generates; prompt tokens stay below it.
FRESH_TOKEN_BASE = 1 << 62

#: Vocabulary of the synthetic workloads (a Llama-sized tokenizer).
_VOCAB = 32000

_max_of = np.maximum.reduce  # an array's largest element, without ndarray.max's wrappers
# The compiled core's one-pass push of freed ids (a checked copy into a pool's free stack).
# In pure Python the pools' own numpy path is faster than the pure core's push (the
# reference for the compiled one), so there it serves alone.
_put_slots = _default_core.put_slots if _default_core.CORE_NAME == "c" else None


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


def _as_array_type(values: np.ndarray, numpy_arrays: bool) -> Any:
    """An int64 numpy array as the kind of array a cache takes (the same memory)."""
    return values if numpy_arrays else load_torch().from_numpy(values)


def _any_outside(ids: np.ndarray, bound: int) -> bool:
    """Whether an id of the non-empty ``ids`` falls outside ``[0, bound)``."""
    if ids.dtype == np.int64:  # one pass: a negative id reads as a huge unsigned one
        return int(_max_of(ids.view(np.uint64))) >= bound
    return int(ids.min()) < 0 or int(ids.max()) >= bound


def _token_array(tokens: Any, what: str) -> np.ndarray:
    """``tokens`` as a 1-D int64 numpy array (no copy when it already is one)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got {arr.ndim}-D")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= FRESH_TOKEN_BASE:
        raise ValueError(f"{what} token ids must lie in [0, 2**62)")
    return np.ascontiguousarray(arr, dtype=np.int64)


@dataclass(frozen=True, eq=False)  # eq=False: numpy fields make field-wise == ambiguous
class Request:
    """One request: ``prompt`` tokens, then ``output_len`` generated tokens.

    Attributes:
        prompt: The prompt's token ids, a 1-D int64 numpy array (ids in ``[0, 2**62)``).
        output_len: How many tokens the request generates, an int >= 0.
        output: The generated tokens when they are fixed (a chat's next turn quotes them);
            None: the serving loop generates ``output_len`` fresh tokens that match nothing
            else.
        extra_key: The namespace the request's tokens are cached in (None: the default).
        timestamp: When it arrives, in ms (optional; only the fleet simulation uses it).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a prompt or output that is not 1-D or has ids outside ``[0, 2**62)``,
            a negative ``output_len``, an ``output`` whose length is not ``output_len``, or
            a negative or infinite ``timestamp``.
    """

    prompt: np.ndarray
    output_len: int
    output: np.ndarray | None = None
    extra_key: object = None
    timestamp: float | None = None  # arrival time in ms (traces that carry one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _token_array(self.prompt, "prompt"))
        if isinstance(self.output_len, bool) or not isinstance(self.output_len, (int, np.integer)):
            raise TypeError(f"output_len must be an int, got {type(self.output_len).__name__}")
        if self.output_len < 0:
            raise ValueError(f"output_len must be >= 0, got {self.output_len}")
        object.__setattr__(self, "output_len", int(self.output_len))
        if self.output is not None:
            output = _token_array(self.output, "output")
            if len(output) != self.output_len:
                raise ValueError(
                    f"output has {len(output)} tokens but output_len is {self.output_len}"
                )
            object.__setattr__(self, "output", output)
        if self.timestamp is not None:
            if isinstance(self.timestamp, bool) or not isinstance(
                    self.timestamp, (int, float, np.integer, np.floating)):
                raise TypeError(f"timestamp must be a number, got {type(self.timestamp).__name__}")
            if not 0 <= self.timestamp < float("inf"):
                raise ValueError(f"timestamp must be >= 0 and finite, got {self.timestamp}")
            object.__setattr__(self, "timestamp", float(self.timestamp))


def _trusted_request(prompt: np.ndarray, output_len: int, output: np.ndarray | None = None,
                     extra_key: object = None, timestamp: float | None = None,
                     spare: np.ndarray | None = None) -> Request:
    """A ``Request`` from fields already checked and converted (a parsed trace's): no pass
    over the tokens. ``prompt`` and ``output`` must be 1-D int64 arrays of ids in
    ``[0, FRESH_TOKEN_BASE)``, ``output_len`` an int, ``timestamp`` a float or None.
    ``spare``: a buffer that starts with ``prompt`` (a view of it) and has room for the output,
    which the serving loop fills instead of copying the prompt (once)."""
    request = object.__new__(Request)
    set_field = object.__setattr__
    set_field(request, "prompt", prompt)
    set_field(request, "output_len", output_len)
    set_field(request, "output", output)
    set_field(request, "extra_key", extra_key)
    set_field(request, "timestamp", timestamp)
    if spare is not None:
        # Taken once by the serving loop: ``prompt`` is ``spare[:len(prompt)]``. In a list
        # that a shallow copy of the request shares, so that only one admission writes to it.
        request.__dict__["_spare"] = [spare]
    return request


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    """A uniform int in the inclusive range ``bounds``."""
    low, high = bounds
    return int(rng.integers(low, high + 1))


def _random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, _VOCAB, size=n, dtype=np.int64)


def synthetic_chat(num_conversations: int = 300, num_system_prompts: int = 16,
                   turns: tuple[int, int] = (2, 6), seed: int = 0,
                   system_prompt_len: tuple[int, int] = (800, 2000),
                   user_len: tuple[int, int] = (20, 200),
                   output_len: tuple[int, int] = (20, 300)) -> list[Request]:
    """A multi-turn chat workload: conversations over a few shared system prompts.

    Turn k's prompt is the system prompt, every earlier user message and answer, then the new
    user message; its answer (``Request.output``) is fixed in advance so that turn k+1 quotes it.
    Conversations interleave in a random order while each keeps its turns in order. All ranges
    are inclusive; the same arguments always give the same requests.

    Args:
        num_conversations: How many conversations, an int >= 0.
        num_system_prompts: How many distinct system prompts they share, an int >= 1.
        turns: The (low, high) range of turns per conversation.
        seed: The random seed.
        system_prompt_len: The (low, high) range of a system prompt's length in tokens.
        user_len: The (low, high) range of a user message's length in tokens.
        output_len: The (low, high) range of an answer's length in tokens.

    Returns:
        The ``Request`` objects, in arrival order.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_conversations < 0 or num_system_prompts < 1:
        raise ValueError("need num_conversations >= 0 and num_system_prompts >= 1")
    for name, bounds in (("turns", turns), ("system_prompt_len", system_prompt_len),
                         ("user_len", user_len), ("output_len", output_len)):
        if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{name} must be a (low, high) pair with 0 <= low <= high")
    rng = np.random.default_rng(seed)
    system_prompts = [_random_tokens(rng, _between(rng, system_prompt_len))
                      for _ in range(num_system_prompts)]

    conversations: list[list[Request]] = []
    for _ in range(num_conversations):
        history = [system_prompts[int(rng.integers(num_system_prompts))]]
        conversation = []
        for _turn in range(_between(rng, turns)):
            history.append(_random_tokens(rng, _between(rng, user_len)))
            answer = _random_tokens(rng, _between(rng, output_len))
            conversation.append(Request(np.concatenate(history), len(answer), answer))
            history.append(answer)
        conversations.append(conversation)

    # One slot per turn, shuffled: conversation c's n-th slot serves its n-th turn.
    slots = np.repeat(np.arange(num_conversations), [len(c) for c in conversations])
    rng.shuffle(slots)
    next_turn = [0] * num_conversations
    requests = []
    for conv in slots.tolist():
        requests.append(conversations[conv][next_turn[conv]])
        next_turn[conv] += 1
    return requests


def exercise_ops(num_ops: int = 100_000, seed: int = 0, base_len: tuple[int, int] = (100, 2000),
                 num_bases: int = 50, tail_len: tuple[int, int] = (1, 20),
                 ) -> list[tuple[str, list[int]]]:
    """A stream of ``("insert" | "exists", tokens)`` calls over long shared prefixes.

    Every sequence is one of ``num_bases`` long base prefixes (``base_len`` tokens) plus a short
    tail (``tail_len``). About half the calls are inserts, drawn from a pool of distinct
    sequences (so later inserts often repeat earlier ones, as a server re-inserting a prompt
    does); the exists queries are split between sequences inserted before, bare prefixes of a
    base (cached but usually not inserted as such) and sequences never inserted. Token lists are
    shared between calls to keep memory bounded; callers must not modify them.

    Args:
        num_ops: How many calls, an int >= 0.
        seed: The random seed (the same arguments give the same calls).
        base_len: The (low, high) range of a base prefix's length in tokens.
        num_bases: How many base prefixes, an int >= 1.
        tail_len: The (low, high) range of a tail's length in tokens.

    Returns:
        ``num_ops`` pairs ``("insert" | "exists", tokens)``, tokens a list of ints.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_ops < 0 or num_bases < 1:
        raise ValueError("need num_ops >= 0 and num_bases >= 1")
    for name, bounds in (("base_len", base_len), ("tail_len", tail_len)):
        if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{name} must be a (low, high) pair with 0 <= low <= high")
    rng = np.random.default_rng(seed)
    bases = [_random_tokens(rng, _between(rng, base_len)).tolist() for _ in range(num_bases)]

    def with_tails(count: int, low: int) -> list[list[int]]:
        # Tails of inserted sequences use ids below _VOCAB, never-inserted ones ids above it.
        base_ids = rng.integers(num_bases, size=count).tolist()
        lengths = rng.integers(tail_len[0], tail_len[1] + 1, size=count)
        tails = rng.integers(low, low + _VOCAB, size=int(lengths.sum()), dtype=np.int64).tolist()
        ends = np.cumsum(lengths).tolist()
        starts = [0] + ends[:-1]
        return [bases[b] + tails[s:e] for b, s, e in zip(base_ids, starts, ends)]

    is_insert = rng.random(num_ops) < 0.5
    num_inserts = int(is_insert.sum())
    num_exists = num_ops - num_inserts
    # Distinct sequences: about five calls per sequence on average.
    insert_pool = with_tails(max(1, num_inserts // 5), 0)
    prefix_pool = []
    for base_id in rng.integers(num_bases, size=max(1, num_exists // 10)).tolist():
        base = bases[base_id]
        prefix_pool.append(base[: int(rng.integers(1, len(base) + 1))] if base else [])
    unseen_pool = with_tails(max(1, num_exists // 10), _VOCAB)

    insert_choice = rng.integers(len(insert_pool), size=num_ops).tolist()
    exists_kind = rng.integers(3, size=num_ops).tolist()
    exists_choice = rng.random(num_ops).tolist()
    ops: list[tuple[str, list[int]]] = []
    inserted: list[int] = []  # insert_pool indices in first-insert order
    seen = set()
    for i, insert in enumerate(is_insert.tolist()):
        if insert:
            choice = insert_choice[i]
            if choice not in seen:
                seen.add(choice)
                inserted.append(choice)
            ops.append(("insert", insert_pool[choice]))
            continue
        kind = exists_kind[i]
        if kind == 0 and inserted:
            tokens = insert_pool[inserted[int(exists_choice[i] * len(inserted))]]
        elif kind == 1:
            tokens = prefix_pool[int(exists_choice[i] * len(prefix_pool))]
        else:
            tokens = unseen_pool[int(exists_choice[i] * len(unseen_pool))]
        ops.append(("exists", tokens))
    return ops


def deep_exercise_ops(num_ops: int = 100_000, seed: int = 0, num_bases: int = 200,
                      prefix_len: tuple[int, int] = (100, 2000),
                      tail_len: tuple[int, int] = (1, 20), vocab: int = _VOCAB,
                      repeat_share: float = 0.2) -> list[tuple[str, list[int]]]:
    """Insert/exists calls over a deep tree: prefixes of random length of shared bases.

    Every inserted sequence is a prefix of one of ``num_bases`` bases (its length drawn from
    ``prefix_len``) plus a short fresh tail (``tail_len``), so each insert cuts its base's
    chain at a new place: after 10^5 calls the tree has about 9*10^4 nodes and an inserted
    sequence ends about 100 nodes deep. ``repeat_share`` of the inserts repeat an earlier
    one. The exists queries are split between inserted sequences, bare base prefixes and
    never-inserted sequences (tail ids from ``[vocab, 2 * vocab)``). Token ids lie below
    ``2 * vocab``; the same arguments give the same calls. Token lists share their int objects
    with the bases; callers must not modify them.

    Args:
        num_ops: How many calls, an int >= 0.
        seed: The random seed.
        num_bases: How many bases, an int >= 1.
        prefix_len: The (low, high) range of the base prefix an insert takes, in tokens.
        tail_len: The (low, high) range of a tail's length in tokens.
        vocab: Token ids of bases lie below it, those of never-inserted tails in
            ``[vocab, 2 * vocab)``; an int >= 1.
        repeat_share: The share of inserts that repeat an earlier one, in [0, 1].

    Returns:
        ``num_ops`` pairs ``("insert" | "exists", tokens)``, tokens a list of ints.

    Raises:
        ValueError: a count below its minimum, or a range that is not ``0 <= low <= high``.
    """
    if num_ops < 0 or num_bases < 1 or vocab < 1:
        raise ValueError("need num_ops >= 0, num_bases >= 1 and vocab >= 1")
    for name, bounds in (("prefix_len", prefix_len), ("tail_len", tail_len)):
        if len(bounds) != 2 or not 0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"{name} must be a (low, high) pair with 0 <= low <= high")
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, vocab, size=prefix_len[1], dtype=np.int64).tolist()
             for _ in range(num_bases)]

    def fresh(low: int) -> list[int]:
        base = bases[int(rng.integers(num_bases))]
        cut = _between(rng, prefix_len)
        tail = rng.integers(low, low + vocab, size=_between(rng, tail_len)).tolist()
        return base[:cut] + tail

    ops: list[tuple[str, list[int]]] = []
    inserted: list[list[int]] = []
    for insert in (rng.random(num_ops) < 0.5).tolist():
        if insert:
            if inserted and rng.random() < repeat_share:
                tokens = inserted[int(rng.integers(len(inserted)))]
            else:
                tokens = fresh(0)
                inserted.append(tokens)
            ops.append(("insert", tokens))
            continue
        kind = int(rng.integers(3))
        if kind == 0 and inserted:
            tokens = inserted[int(rng.integers(len(inserted)))]
        elif kind == 1:
            tokens = bases[int(rng.integers(num_bases))][: _between(rng, prefix_len)]
        else:
            tokens = fresh(vocab)
        ops.append(("exists", tokens))
    return ops


#: The token input types of the serving API that ``time_cached_calls`` compares.
INPUT_TYPES = ("list", "array", "numpy", "tensor")


def as_input_type(tokens: np.ndarray, input_type: str) -> Any:
    """Convert an int64 token array to one of the forms a caller passes tokens in.

    Args:
        tokens: The tokens, a 1-D int64 numpy array.
        input_type: One of ``INPUT_TYPES``: ``"list"`` (a list of ints), ``"array"``
            (``array('q')``), ``"numpy"`` (a fresh int64 array) or ``"tensor"`` (a CPU int64
            torch tensor).

    Returns:
        The tokens in that form (a new object).

    Raises:
        ValueError: an unknown ``input_type``.
    """
    if input_type == "list":
        return tokens.tolist()
    if input_type == "array":
        out = array.array("q")
        out.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        return out
    if input_type == "numpy":
        return np.array(tokens, dtype=np.int64)
    if input_type == "tensor":
        return load_torch().from_numpy(np.array(tokens, dtype=np.int64))
    raise ValueError(f"unknown input type {input_type!r}; valid: {', '.join(INPUT_TYPES)}")


@dataclass(frozen=True)
class InCacheTiming:
    """Seconds inside ``match_prefix`` + ``insert`` with every prompt cached, and the core's
    bare tree walk over the same prompts and sequences (``time_cached_calls`` measures it).

    Attributes:
        requests: How many requests were timed.
        match_seconds: Time in ``match_prefix`` calls.
        insert_seconds: Time in ``insert`` calls.
        walk_seconds: Time of the core's bare walk over the same prompts and sequences.
    """

    requests: int
    match_seconds: float
    insert_seconds: float
    walk_seconds: float

    @property
    def call_seconds(self) -> float:
        """Time in the API calls: ``match_seconds + insert_seconds``."""
        return self.match_seconds + self.insert_seconds

    @property
    def rest_seconds(self) -> float:
        """In-cache time that is not tree walk: conversion, checks, bookkeeping, results."""
        return max(0.0, self.call_seconds - self.walk_seconds)

    @property
    def rest_share(self) -> float:
        """``rest_seconds`` as a share of ``call_seconds`` (0.0 when nothing was timed)."""
        return self.rest_seconds / self.call_seconds if self.call_seconds > 0 else 0.0

    def per_request_us(self, seconds: float) -> float:
        """Convert a total of these timings to microseconds per request.

        Args:
            seconds: One of the totals (``call_seconds``, ``walk_seconds``, ...).

        Returns:
            Microseconds per request (0.0 when no request was timed).
        """
        return seconds / self.requests * 1e6 if self.requests else 0.0


def time_cached_calls(cache: Any, requests: list[Request], input_type: str, passes: int = 3,
                      clock: Callable[[], float] = time.perf_counter) -> InCacheTiming:
    """In-cache time per request of ``match_prefix(prompt)`` + ``insert(prompt + output, kv)``
    with every prompt already cached, split into the bare tree walk and the rest.

    Tokens are passed as ``input_type`` (see ``as_input_type``), ``kv_indices`` as a CPU int64
    tensor (as a server's KV allocator hands them out). Two untimed passes first cache every
    sequence and make every split, so the timed passes change nothing in the tree. In each
    timed pass, request by request, the two API calls are timed, then the core's bare walk
    (``walk`` on an int64 array: no conversion, no result) over the same prompt and sequence;
    each sum is the best of ``passes``. The cyclic GC is off while timing. The cache needs no
    eviction (its pool is unbounded here).

    Args:
        cache: A ``RadixCache`` (it is filled with the requests).
        requests: The ``Request`` objects.
        input_type: How tokens are passed, one of ``INPUT_TYPES``.
        passes: How many timed passes (the best counts).
        clock: The timer, a function returning seconds (``time.process_time`` for CPU time).

    Returns:
        An ``InCacheTiming``.

    Raises:
        ValueError: an unknown ``input_type``.
    """
    prepared = []
    numpy_arrays = getattr(cache, "array_type", "torch") == "numpy"
    for request in requests:
        output = request.output
        if output is None:
            output = np.arange(FRESH_TOKEN_BASE, FRESH_TOKEN_BASE + request.output_len,
                               dtype=np.int64)
        full = np.concatenate((request.prompt, output))
        prepared.append((as_input_type(request.prompt, input_type), as_input_type(full, input_type),
                         _as_array_type(np.arange(len(full), dtype=np.int64), numpy_arrays),
                         request.prompt, full,
                         request.extra_key))
    match_prefix = cache.match_prefix
    insert = cache.insert
    walk = cache._core.walk  # the core's bare walk
    for _ in range(2):  # cache everything, make every split
        for prompt, full, kv, _p64, _f64, extra_key in prepared:
            match_prefix(prompt, extra_key)
            insert(full, kv, extra_key)
    best = [float("inf")] * 3
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(max(1, passes)):
            spent = [0.0, 0.0, 0.0]
            for prompt, full, kv, prompt64, full64, extra_key in prepared:
                t0 = clock()
                match_prefix(prompt, extra_key)
                t1 = clock()
                insert(full, kv, extra_key)
                t2 = clock()
                walk(prompt64, extra_key)
                walk(full64, extra_key)
                t3 = clock()
                spent[0] += t1 - t0
                spent[1] += t2 - t1
                spent[2] += t3 - t2
            best = [min(b, s) for b, s in zip(best, spent)]
    finally:
        if enabled:
            gc.enable()
    return InCacheTiming(len(prepared), best[0], best[1], best[2])


def walk_cost(cache: Any, sequences: list, limit: int = 2000, passes: int = 3,
              clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(seconds per node visited, average nodes visited) of ``exists`` on a built cache.

    Queries are up to ``limit`` of ``sequences`` (each must have been inserted, so ``exists``
    walks to its terminal node), as int64 numpy arrays so that no conversion is timed; nodes
    visited per query is the depth of its terminal node. The time includes the per-call cost
    and the token comparisons, so it is an upper bound on the cost of one walk step.

    Args:
        cache: A ``RadixCache`` in which every one of ``sequences`` was inserted.
        sequences: The inserted sequences (token lists or arrays).
        limit: How many of them to query.
        passes: How many timed passes (the best counts).
        clock: The timer, a function returning seconds.

    Returns:
        ``(seconds per node visited, average nodes visited per query)``; ``(0.0, 0.0)`` when
        no node was visited.
    """
    queries = [np.asarray(seq, dtype=np.int64) for seq in sequences[:limit]]
    visited = 0
    for query in queries:
        node = cache.match_prefix(query).last_node
        while node.parent is not None:
            visited += 1
            node = node.parent
    exists = cache.exists
    best = float("inf")
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(max(1, passes)):
            start = clock()
            for query in queries:
                exists(query)
            best = min(best, clock() - start)
    finally:
        if enabled:
            gc.enable()
    if not visited:
        return 0.0, 0.0
    return best / visited, visited / len(queries)


class KVPool:
    """A KV pool of ``capacity`` token slots: a free list of slot ids (int64).

    Slot ids are ``0 .. capacity-1``; slot 0 is handed out first.

    Args:
        capacity: How many slots, an int >= 0.
        array_type: What ``alloc`` returns: ``"torch"`` (default) a tensor, ``"numpy"`` a
            numpy array (``RadixCache``'s ``array_type``).

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: ``capacity`` < 0, or an unknown ``array_type``.
    """

    __slots__ = ("capacity", "_free", "_top", "_numpy")

    def __init__(self, capacity: int, *, array_type: str = "torch") -> None:
        self._numpy = _check_array_type(array_type)
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        # A stack whose top is the end: slot 0 is handed out first.
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self._top = self.capacity

    @property
    def available(self) -> int:
        """Free slots."""
        return self._top

    @property
    def used(self) -> int:
        """Allocated slots."""
        return self.capacity - self._top

    def alloc(self, n: int) -> Any:
        """Take ``n`` free slots.

        Args:
            n: How many slots, an int >= 0.

        Returns:
            Their ids as a 1-D int64 tensor (a numpy array for a numpy pool), or None
            (nothing taken) if fewer are free.

        Raises:
            ValueError: ``n`` < 0.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._top:
            return None
        self._top -= n
        return _as_array_type(self._free[self._top:self._top + n].copy(), self._numpy)

    def _take_into(self, out: np.ndarray) -> None:
        """Allocate ``len(out)`` slots (the caller checked that they are free) into ``out``."""
        n = len(out)
        self._top -= n
        out[:] = self._free[self._top:self._top + n]

    def _put_back(self, slots: np.ndarray) -> None:
        """``free`` for slots the caller took with ``_take_into`` and still holds (an int64
        array): nothing to check."""
        top = self._top
        self._top = top + len(slots)
        self._free[top:self._top] = slots

    def free(self, slots: Any) -> None:
        """Return slots to the pool.

        Args:
            slots: Their ids, a tensor, numpy array or sequence of ints.

        Raises:
            ValueError: more slots than are in use, or ids outside ``[0, capacity)``.
        """
        if _put_slots is not None:
            pushed = _put_slots(self._free, self._top, slots, self.capacity)
            if pushed >= 0:  # the common input, checked and pushed in one pass
                self._top += pushed
                return
        arr = _slot_array(slots)
        n = len(arr)
        if n == 0:
            return
        top = self._top
        if top + n > self.capacity:
            raise ValueError(f"freeing {n} slots overfills the pool ({self.used} in use)")
        if _any_outside(arr, self.capacity):
            raise ValueError(f"slot ids outside [0, {self.capacity})")
        self._free[top:top + n] = arr
        self._top = top + n

    def free_slots(self) -> np.ndarray:
        """List the free slots (for consistency checks).

        Returns:
            A copy of their ids, an int64 numpy array.
        """
        return self._free[: self._top].copy()

    def __repr__(self) -> str:
        return f"KVPool(capacity={self.capacity}, used={self.used})"


class HostPool:
    """A host-memory pool of ``capacity`` token slots for a cache's host tier.

    It hands out the same kind of slot ids as ``KVPool`` (``0 .. capacity-1``, int64) but
    keeps only the slots ever handed out: its memory follows the slots in use, not the
    capacity, so a pool larger than any trace ("unlimited" host memory) costs nothing.
    Freed slots are handed out again first.

    Args:
        capacity: How many slots, an int >= 0.
        array_type: What ``alloc`` returns: ``"torch"`` (default) a tensor, ``"numpy"`` a
            numpy array (``RadixCache``'s ``array_type``).

    Raises:
        TypeError: ``capacity`` is not an int.
        ValueError: ``capacity`` < 0, or an unknown ``array_type``.
    """

    __slots__ = ("capacity", "_free", "_top", "_next", "_numpy")

    def __init__(self, capacity: int, *, array_type: str = "torch") -> None:
        self._numpy = _check_array_type(array_type)
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self._free = np.empty(0, dtype=np.int64)  # freed slots: a stack, top at _top
        self._top = 0
        self._next = 0  # slots >= _next were never handed out

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
        return None if ids is None else _as_array_type(ids, self._numpy)

    def _alloc_ids(self, n: int) -> np.ndarray | None:
        """``alloc`` as a new numpy array."""
        top = self._top
        if 0 <= n <= top:  # the common case once the pool has cycled: freed slots only
            self._top = top - n
            return self._free[top - n:top].copy()
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self.available:
            return None
        if not top:  # fresh slots only
            start = self._next
            self._next = start + n
            return np.arange(start, start + n, dtype=np.int64)
        reused = min(n, self._top)
        self._top -= reused
        out = np.empty(n, dtype=np.int64)
        out[:reused] = self._free[self._top:self._top + reused]
        fresh = n - reused
        if fresh:
            out[reused:] = np.arange(self._next, self._next + fresh, dtype=np.int64)
            self._next += fresh
        return out

    def free(self, slots: Any) -> None:
        """Return slots to the pool.

        Args:
            slots: Their ids, a tensor, numpy array or sequence of ints.

        Raises:
            ValueError: more slots than are in use, or ids never handed out.
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
        if self._top + n > len(self._free):
            grown = np.empty(max(2 * len(self._free), self._top + n, 1024), dtype=np.int64)
            grown[:self._top] = self._free[:self._top]
            self._free = grown
        self._free[self._top:self._top + n] = arr
        self._top += n

    def _alloc_shared(self, n: int) -> np.ndarray | None:
        """``alloc(n)`` as a numpy array, for a caller that copies the ids at once (a cache's
        ``backup`` answer): freed slots come as a view of the pool's own stack, no copy."""
        top = self._top
        if 0 <= n <= top:
            self._top = top - n
            return self._free[top - n:top]
        return self._alloc_ids(n)

    def __repr__(self) -> str:
        return f"HostPool(capacity={self.capacity}, used={self.used})"


@dataclass(frozen=True)
class ServeResult:
    """What one replay did (``serve``, ``ServingLoop.result``).

    Rejected requests (too big for the pool even after evicting everything unlocked) are
    counted in ``requests``, ``prompt_tokens`` and ``cached_tokens`` too: their lookup was made.
    With a host tier, ``cached_tokens`` counts the prompt tokens found on the device and those
    found only on the host (loaded back before the request runs): ``host_cached_tokens`` says
    how many of them were on the host.

    Attributes:
        requests: Requests replayed.
        rejected: Requests that did not fit in the pool.
        prompt_tokens: Prompt tokens looked up.
        cached_tokens: Prompt tokens found cached.
        hit_rate: ``cached_tokens / prompt_tokens``.
        evicted_tokens: Tokens evicted.
        peak_tokens: The largest tree size reached, in tokens.
        seconds: Time spent inside cache calls only.
        stats: ``cache.stats()`` at the end (a ``CacheStats``).
        host_capacity: Host slots (0: no host tier).
        host_cached_tokens: Of ``cached_tokens``, those found only on the host.
        loaded_tokens: Tokens loaded back from the host to the device.
        backed_up_tokens: Tokens copied from the device to the host.
        host_evicted_tokens: Tokens evicted from the host.
    """

    requests: int
    rejected: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    evicted_tokens: int
    peak_tokens: int
    seconds: float
    stats: Any
    host_capacity: int = 0
    host_cached_tokens: int = 0
    loaded_tokens: int = 0
    backed_up_tokens: int = 0
    host_evicted_tokens: int = 0

    @property
    def requests_per_second(self) -> float:
        """Requests per second of cache time (0.0 when no time was measured)."""
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def host_hit_rate(self) -> float:
        """``host_cached_tokens / prompt_tokens``: the share of prompt tokens found only on
        the host."""
        return self.host_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """The share of prompt tokens found on the device (``hit_rate - host_hit_rate``)."""
        device = self.cached_tokens - self.host_cached_tokens
        return device / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class Admission:
    """A request the serving loop admitted: its slots are allocated and its prefix is locked.

    Attributes:
        request: The ``Request``.
        cached: Prompt tokens found cached when it was admitted.
        tokens: Prompt + output, an int64 array.
        kv: Their KV slots, an int64 tensor.
        lock_node: The node it holds locked.
        owned_from: ``kv[owned_from:]`` still belong to the request (the tree holds the slots
            before it).
        loaded: Of ``cached``, the tokens loaded back from the host tier (0 without one).
    """

    request: Request
    cached: int
    tokens: np.ndarray
    kv: Any
    lock_node: Any
    owned_from: int
    loaded: int = 0


class ServingLoop:
    """One worker's serving loop over ``cache`` and a ``KVPool(capacity)``, a step at a time.

    ``admit(request)`` matches the prompt, locks the match, evicts when the pool is short and
    allocates slots for the uncached prompt tokens and the output (None when the request does
    not fit even after evicting every unlocked entry: rejected, nothing evicted).
    ``cache_prompt(admission)`` (optional, when the prefill is done) inserts the prompt and
    moves the lock onto it. ``finish(admission)`` inserts prompt + output, frees the slots the
    tree already had (and the unaligned tail it does not cache) and unlocks. ``serve`` runs
    ``admit`` then ``finish`` per request; the fleet simulation interleaves the steps of many
    requests over time. Counters accumulate until ``result()``.

    With ``host_capacity`` (a cache made with ``host_tier=True``), the loop also runs a host
    pool of that many slots (``HostPool``), as an engine with host memory does:

    - ``admit`` first hands the cache's due write-through copies to the host
      (``write_through``, once per admission: the scheduler step; write-through policies
      only), evicting host-only entries when the host is full;
    - when the device pool is short, it first evicts from the host as many tokens as the
      device eviction may back up (``write_back``: a device victim without a host copy is
      copied to the host, and dropped only when the host is still full), then evicts from
      the device;
    - the prompt's tokens found only on the host (``host_length``) count as cached: they get
      device slots and are loaded back (``load_back``) before the request runs; the request
      then holds its lock on the whole prefix.

    Without ``host_capacity`` the loop is exactly the one-tier loop.

    Args:
        cache: An empty ``RadixCache`` (every slot it holds must come from the pool).
        capacity: The KV pool's size in token slots.
        pool: A fresh ``KVPool(capacity)`` to use (default: a new one).
        host_capacity: Host slots, an int >= 0, or None (default): no host tier. Needs a
            cache with a host tier.
        host_pool: A fresh ``HostPool(host_capacity)`` to use (default: a new one).

    Raises:
        TypeError: a ``host_capacity`` that is not an int.
        ValueError: a non-empty cache, a ``pool`` that is used or of another capacity, a
            ``host_capacity`` < 0 or on a cache without a host tier, or a ``host_pool`` that
            is used, of another capacity, or given without ``host_capacity``.
    """

    def __init__(self, cache: Any, capacity: int, *, pool: KVPool | None = None,
                 host_capacity: int | None = None, host_pool: HostPool | None = None) -> None:
        # The slots the loop hands the cache are of the cache's kind of array.
        self._numpy = getattr(cache, "array_type", "torch") == "numpy"
        if pool is None:
            pool = KVPool(capacity)
        elif pool.capacity != capacity or pool.used:
            raise ValueError("pool must be an unused KVPool of the given capacity")
        if cache.total_size():
            raise ValueError("serve needs an empty cache (its slots must come from the pool)")
        if host_capacity is None:
            if host_pool is not None:
                raise ValueError("host_pool needs host_capacity")
        else:
            if host_pool is None:
                host_pool = HostPool(host_capacity)  # checks host_capacity
            elif host_pool.capacity != host_capacity or host_pool.used:
                raise ValueError("host_pool must be an unused HostPool of the given capacity")
            if not getattr(cache, "host_tier", False):
                raise ValueError("host_capacity needs a cache with a host tier "
                                 "(RadixCache(host_tier=True))")
            if cache.host_size():
                raise ValueError("serve needs an empty cache (its host slots must come from "
                                 "the host pool)")
        self.cache = cache
        self.pool = pool
        self.host_pool = host_pool
        self._page_size = cache.page_size
        self._next_fresh = FRESH_TOKEN_BASE
        self.seconds = 0.0
        self.requests = self.rejected = self.prompt_tokens = self.cached_tokens = 0
        self.evicted_tokens = self.peak_tokens = 0
        self.host_cached_tokens = self.loaded_tokens = self.backed_up_tokens = 0
        self.host_evicted_tokens = 0
        # write_back: device victims are backed up on eviction; the write-through policies
        # copy what the cache queued, once per step.
        self._write_back = host_pool is not None and cache.write_policy == "write_back"
        self._write_through = host_pool is not None and not self._write_back
        self._wanted = 0  # host slots a write-through copy could not get
        self._largest = 0  # the most tokens a request has had: no node is larger

    def admit(self, request: Request, *, wait: bool = False) -> Admission | None:
        """Admit a request: match, lock, evict if the pool is short, allocate.

        A request that cannot fit is counted as rejected, unless ``wait`` is true: then
        nothing is counted (the caller retries once running requests released their locks).

        Args:
            request: The ``Request``.
            wait: If true, a request that does not fit now is not counted as rejected.

        Returns:
            An ``Admission`` (hand it to ``cache_prompt`` and ``finish``), or None when the
            request cannot fit now (its lock is released, nothing evicted).
        """
        if self.host_pool is not None:
            return self._admit_tiered(request, wait)
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        prompt = request.prompt
        start = clock()
        match = cache.match_prefix(prompt, request.extra_key)
        cache.inc_lock_ref(match.last_node)
        self.seconds += clock() - start
        cached = match.length

        need = len(prompt) - cached + request.output_len
        short = need - pool.available
        # Evict only when that can make room: a request bigger than the pool could ever
        # free must not wipe the cache on its way to rejection.
        if 0 < short <= cache.evictable_size():
            start = clock()
            self.evicted_tokens += cache.evict(short, pool.free)
            self.seconds += clock() - start
        if need > pool.available:
            start = clock()
            cache.dec_lock_ref(match.last_node)
            self.seconds += clock() - start
            if not wait:
                self._count(request, cached)
                self.rejected += 1
            return None
        self._count(request, cached)

        full = self._sequence(request)
        return Admission(request, cached, full, self._slots(match, cached, need),
                         match.last_node, cached)

    def _sequence(self, request: Request) -> np.ndarray:
        """The request's prompt + output as one int64 array (fresh ids for an output the
        request does not give)."""
        prompt, output = request.prompt, request.output
        # A parsed trace's request may come with its prompt at the start of a buffer that has
        # room for the output: prompt + output are then made without copying the prompt.
        holder = request.__dict__.get("_spare")
        spare = holder.pop() if holder else None
        if output is not None:
            return np.concatenate((prompt, output))
        total = len(prompt) + request.output_len
        fresh = np.arange(self._next_fresh, self._next_fresh + request.output_len,
                          dtype=np.int64)
        self._next_fresh += request.output_len
        if spare is not None and len(spare) >= total:
            full = spare[:total]
            full[len(prompt):] = fresh
            return full
        return np.concatenate((prompt, fresh))

    def _slots(self, match: Any, cached: int, need: int) -> Any:
        """The request's KV slots: the match's ``cached`` indices, then ``need`` taken from
        the pool, in one buffer filled once (numpy: large fresh torch allocations are much
        slower on some hosts), as the cache's kind of array."""
        slots = np.empty(cached + need, dtype=np.int64)
        if cached:
            slots[:cached] = match.indices if self._numpy else match.indices.numpy()
        self.pool._take_into(slots[cached:])
        return _as_array_type(slots, self._numpy)

    def _count(self, request: Request, cached: int) -> None:
        self.requests += 1
        self.prompt_tokens += len(request.prompt)
        self.cached_tokens += cached

    # -- the host tier ---------------------------------------------------------------------
    def _admit_tiered(self, request: Request, wait: bool) -> Admission | None:
        """``admit`` with a host pool (see the class docstring)."""
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        prompt = request.prompt
        start = clock()
        if self._write_through:
            self._copy_due()
        match = cache.match_prefix(prompt, request.extra_key)
        locked = match.last_node
        cache.inc_lock_ref(locked)
        self.seconds += clock() - start
        cached = match.length

        if len(prompt) + request.output_len > self._largest:
            self._largest = len(prompt) + request.output_len
        # The host part needs device slots too: it is loaded back.
        need = len(prompt) - cached + request.output_len
        short = need - pool.available
        if 0 < short <= cache.evictable_size():
            start = clock()
            host_evicted = self.host_evicted_tokens
            self._evict_device(short)
            if match.host_length and self.host_evicted_tokens != host_evicted:
                # The room made on the host may have taken part of the match's host-only
                # continuation (it is not locked): match again (the device part is locked).
                match = cache.match_prefix(prompt, request.extra_key)
            self.seconds += clock() - start
        host = match.host_length
        if need > pool.available:
            start = clock()
            cache.dec_lock_ref(locked)
            self.seconds += clock() - start
            if not wait:
                self._count(request, cached + host)
                self.host_cached_tokens += host
                self.rejected += 1
            return None
        self._count(request, cached + host)
        self.host_cached_tokens += host

        full = self._sequence(request)
        kv = self._slots(match, cached, need)
        lock_node = locked
        if host:
            # Load the host part back into the first slots after the device part, and hold
            # the lock on the whole prefix (the engine copies host -> device here).
            start = clock()
            cache.load_back(match, kv[cached:cached + host])
            cache.inc_lock_ref(match.last_host_node)
            cache.dec_lock_ref(locked)
            self.seconds += clock() - start
            self.loaded_tokens += host
            lock_node = match.last_host_node
        return Admission(request, cached + host, full, kv, lock_node, cached + host, host)

    def _evict_device(self, short: int) -> None:
        """Evict ``short`` device tokens, backing victims up to the host (write_back)."""
        cache = self.cache
        if self._write_back:
            # A backup cannot evict from the host itself (it runs inside the cache's call):
            # make the room first. The victims free at least ``short`` tokens and less than
            # one node more (no node is larger than the largest request), and no more than
            # is evictable: with that much room every copy fits (victims that already have a
            # host copy need none).
            room = (min(short + self._largest - 1, cache.evictable_size())
                    - self.host_pool.available)
            if room > 0:
                self._evict_host(room)
            backup = self._backup
        else:
            backup = None
        # The device slots of every victim in one call (``batch``): fewer calls into the pool.
        freed = cache.evict(short, self.pool.free, batch=True, backup=backup)
        self.evicted_tokens += freed
        # A victim that gets no host copy but has host-only children stays on the device (it
        # cannot leave the tree before them): free host memory and evict again while it helps.
        while freed < short and self._evict_host(short - freed):
            more = cache.evict(short - freed, self.pool.free, batch=True, backup=backup)
            self.evicted_tokens += more
            freed += more

    def _evict_host(self, num_tokens: int) -> int:
        freed = self.cache.evict_host(num_tokens, self.host_pool.free, batch=True)
        self.host_evicted_tokens += freed
        return freed

    def _backup(self, device_indices: Any) -> Any:
        """Host slots for a copy of ``device_indices`` (None: the host is full)."""
        n = device_indices.shape[0]
        # The cache copies the answer before anything else runs: a view of the pool will do.
        host = self.host_pool._alloc_shared(n)
        if host is None:
            self._wanted = n
            return None
        self.backed_up_tokens += n
        return _as_array_type(host, self._numpy)

    def _copy_due(self) -> None:
        """Hand the write-through copies due to the host, evicting from the host for room."""
        cache, host_pool = self.cache, self.host_pool
        while True:
            self._wanted = 0
            cache.write_through(self._backup)
            wanted = self._wanted
            # A copy that missed room: evict host-only entries for it, unless it can never
            # fit (it then waits at the head of the queue, as the cache keeps it).
            if not wanted or wanted > host_pool.capacity:
                return
            self._evict_host(wanted - host_pool.available)
            if host_pool.available < wanted:
                return

    def cache_prompt(self, admission: Admission) -> None:
        """Insert the prompt (its prefill is done) and move the request's lock onto it.

        Args:
            admission: What ``admit`` returned.
        """
        prompt_len = len(admission.request.prompt)
        aligned = prompt_len - prompt_len % self._page_size
        if aligned <= admission.owned_from:
            return  # the tree already holds every full page of the prompt
        cache, clock = self.cache, time.perf_counter
        start = clock()
        inserted = cache.insert(admission.tokens[:prompt_len], admission.kv[:prompt_len],
                                admission.request.extra_key)
        cache.inc_lock_ref(inserted.last_node)
        cache.dec_lock_ref(admission.lock_node)
        self.seconds += clock() - start
        # Pages another request inserted meanwhile: the tree keeps its own slots.
        if inserted.prefix_len > admission.owned_from:
            self.pool.free(admission.kv[admission.owned_from:inserted.prefix_len])
        admission.owned_from = aligned
        admission.lock_node = inserted.last_node
        self._note_peak()

    def finish(self, admission: Admission) -> None:
        """Finish a request: insert prompt + output, free the slots the tree does not take,
        unlock.

        Args:
            admission: What ``admit`` returned.
        """
        cache, pool, clock = self.cache, self.pool, time.perf_counter
        full, kv = admission.tokens, admission.kv
        start = clock()
        inserted = cache.insert(full, kv, admission.request.extra_key)
        self.seconds += clock() - start

        # The frees below read the slots as numpy (slicing a tensor costs more).
        slots = kv if type(kv) is np.ndarray else kv.numpy()
        # Slots of tokens the tree already held (a longer match than the prompt's) are spare.
        # Both frees give back slots this loop took from the pool and the tree did not keep.
        if inserted.prefix_len > admission.owned_from:
            pool._put_back(slots[admission.owned_from:inserted.prefix_len])
        # The tail past the last full page is not cached: its slots go back too.
        aligned_len = len(full) - len(full) % self._page_size
        if aligned_len < len(full):
            pool._put_back(slots[aligned_len:])

        start = clock()
        cache.dec_lock_ref(admission.lock_node)
        self.seconds += clock() - start
        admission.lock_node = None
        self._note_peak()

    def _note_peak(self) -> None:
        total = self.cache.total_size()
        if total > self.peak_tokens:
            self.peak_tokens = total

    def result(self) -> ServeResult:
        """Sum up the replay so far.

        Returns:
            A ``ServeResult`` with the counters so far and ``cache.stats()``.
        """
        return ServeResult(
            requests=self.requests,
            rejected=self.rejected,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            evicted_tokens=self.evicted_tokens,
            peak_tokens=self.peak_tokens,
            seconds=self.seconds,
            stats=self.cache.stats(),
            host_capacity=0 if self.host_pool is None else self.host_pool.capacity,
            host_cached_tokens=self.host_cached_tokens,
            loaded_tokens=self.loaded_tokens,
            backed_up_tokens=self.backed_up_tokens,
            host_evicted_tokens=self.host_evicted_tokens,
        )


def serve(cache: Any, requests: Iterable[Request], capacity: int,
          progress: Callable[[int], Any] | None = None, *,
          pool: KVPool | None = None, host_capacity: int | None = None,
          host_pool: HostPool | None = None) -> ServeResult:
    """Replay ``requests`` through ``cache`` over a ``KVPool(capacity)``, as a server would.

    Per request: match the prompt, lock the match, evict when the pool is short, allocate slots
    for the uncached prompt tokens and the output, insert prompt + output, free the slots the
    tree already had (and the unaligned tail it does not cache), unlock. A request that would
    not fit even after evicting every unlocked entry is rejected without evicting anything.
    ``progress(1)`` is called after each request (``tqdm.update`` fits). ``pool`` lets a
    caller watch the pool (its capacity must equal ``capacity``). The cache must start empty:
    every slot it holds has to come from the pool. ``ServingLoop`` holds the steps.

    ``host_capacity`` (a cache made with ``host_tier=True``) adds a host pool of that many
    slots: evicted prefixes are backed up there (per the cache's write policy) and host hits
    are loaded back before the request runs; they count in ``cached_tokens`` and
    ``hit_rate`` (``host_cached_tokens`` says how many). See ``ServingLoop``.

    Args:
        cache: An empty ``RadixCache``.
        requests: The ``Request`` objects, in arrival order.
        capacity: The KV pool's size in token slots, an int >= 0.
        progress: Called with 1 after each request, or None.
        pool: A fresh ``KVPool(capacity)`` to use (default: a new one).
        host_capacity: Host slots, an int >= 0, or None (default): no host tier.
        host_pool: A fresh ``HostPool(host_capacity)`` to use (default: a new one).

    Returns:
        A ``ServeResult``: hit rate, rejected requests, evicted tokens, peak tree size and
        the time spent in cache calls (and, with a host tier, the host's share of the hits,
        tokens loaded back and backed up).

    Raises:
        TypeError: ``capacity`` or ``host_capacity`` is not an int.
        ValueError: a negative ``capacity`` or ``host_capacity``, a non-empty cache, a
            ``pool`` or ``host_pool`` that is used or of another capacity, or a
            ``host_capacity`` on a cache without a host tier.
    """
    loop = ServingLoop(cache, capacity, pool=pool, host_capacity=host_capacity,
                       host_pool=host_pool)
    # A parsed trace can make each request into one reused buffer: every request is done
    # with (inserted, its slots taken or freed) before the next is made.
    replay = getattr(requests, "_replay", None)
    for request in (replay() if replay is not None else requests):
        admission = loop.admit(request)
        if admission is not None:
            loop.finish(admission)
        if progress is not None:
            progress(1)
    return loop.result()

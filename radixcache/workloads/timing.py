"""Timings of the cache's serving calls: the in-cache cost of ``match_prefix`` + ``insert``
per request with every prompt cached, split into the core's bare tree walk and the rest, per
input type (``time_cached_calls``), and the time of ``exists`` per node visited on a built
tree (``walk_cost``).
"""

from __future__ import annotations

import array
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .._torch import load_torch
from .pools import as_cache_array
from .requests import FRESH_TOKEN_BASE, Request

__all__ = ["INPUT_TYPES", "InCacheTiming", "as_input_type", "time_cached_calls", "walk_cost"]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside (as it was before, after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
                         as_cache_array(np.arange(len(full), dtype=np.int64), numpy_arrays),
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
    with _gc_paused():
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
    with _gc_paused():
        for _ in range(max(1, passes)):
            start = clock()
            for query in queries:
                exists(query)
            best = min(best, clock() - start)
    if not visited:
        return 0.0, 0.0
    return best / visited, visited / len(queries)

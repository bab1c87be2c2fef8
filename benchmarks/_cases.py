"""Workloads shared by the pytest benchmarks (bench_*.py) and ``report.py``.

Each case builds its input untimed and exposes the one call that is timed, so both runners
measure exactly the same work. Sizes live here too: ``FULL`` for the real run, ``QUICK`` for a
smoke run of ``report.py --quick``.
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from radixcache import RadixCache
from radixcache._core import CORES
from radixcache.download import find as find_trace
from radixcache.download import trace_path
from radixcache.traces import read_trace
from radixcache.workloads import InCacheTiming, time_cached_calls
from radixcache.workloads import Request
from radixcache.workloads import deep_exercise_ops as make_deep_exercise_ops
from radixcache.workloads import exercise_ops as make_exercise_ops
from radixcache.workloads import synthetic_chat, walk_cost

#: Folders that may hold the Mooncake traces before ``radixcache trace download``'s own: the
#: ``os.pathsep``-separated ``RADIXCACHE_TRACE_DIR`` (.ci/run points it at CI's shared copies).
TRACE_DIRS = tuple(Path(p) for p in os.environ.get("RADIXCACHE_TRACE_DIR", "").split(os.pathsep)
                   if p)


def trace_file(name: str) -> tuple[Path, str]:
    """(path, "") of Mooncake trace ``name`` (in TRACE_DIRS, else the download folder), or
    (where ``radixcache trace download`` would put it, a message saying where it looked)."""
    found, missing = find_trace(name, *TRACE_DIRS)
    return (found or trace_path(name)), missing


#: The Mooncake-style trace; ``radixcache trace download synthetic`` gets it.
TRACE_PATH, TRACE_MISSING = trace_file("synthetic")

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class Sizes:
    """How big each case is. The KV pools are small enough that eviction runs all along
    (chat: ~0.77M of 2.6M tokens evicted at full size) and hold the longest request."""

    chat_conversations: int      # serving loop: synthetic conversations
    chat_system_prompts: int     # serving loop: distinct shared system prompts
    chat_capacity: int           # serving loop: KV pool size in tokens
    trace_capacity: int          # trace replay: KV pool size in tokens
    trace_limit: int | None      # trace replay: first N requests (None: all)
    exercise_ops: int            # exercise: insert/exists operations (shallow and deep tree)
    incache_conversations: int   # in-cache serving calls per input type: conversations
    match_tokens: int            # long-prompt match: cached prompt length
    eviction_leaves: tuple       # eviction: cache sizes in leaves
    eviction_nodes: int          # eviction: nodes evicted per timed round


FULL = Sizes(
    chat_conversations=300,
    chat_system_prompts=16,
    chat_capacity=1 << 16,
    trace_capacity=1 << 22,
    trace_limit=2000,
    exercise_ops=100_000,
    incache_conversations=300,
    match_tokens=10_000,
    eviction_leaves=(10**3, 10**4, 10**5, 10**6),
    eviction_nodes=200,
)

QUICK = Sizes(
    chat_conversations=40,
    chat_system_prompts=16,
    chat_capacity=1 << 14,
    trace_capacity=1 << 20,
    trace_limit=200,
    exercise_ops=10_000,
    incache_conversations=40,
    match_tokens=10_000,
    eviction_leaves=(10**3, 10**4, 10**5),
    eviction_nodes=200,
)


def benchmark_min_seconds(benchmark) -> float | None:
    """A pytest-benchmark fixture's best round; None when timing is off (--benchmark-disable)."""
    stats = getattr(benchmark, "stats", None)
    return stats.stats.min if stats is not None else None


def core_names() -> list[str]:
    """The tree cores of this build, pure Python first."""
    return list(CORES)


def core_of(cache: RadixCache) -> Any:
    """The tree core object behind ``cache`` (its ``Core``: ``tree``, ``heap``, ``walk``): the
    one way the benchmarks reach past the public class."""
    return cache._core


# -- 1 and 2: the serving loop ---------------------------------------------------------------
SERVE_PAGE_SIZES = (1, 16)


def chat_requests(sizes: Sizes = FULL) -> list:
    return synthetic_chat(num_conversations=sizes.chat_conversations,
                          num_system_prompts=sizes.chat_system_prompts, seed=0)


def trace_requests(limit: int | None, path: Path = TRACE_PATH) -> list:
    # Made up front (a Trace makes each request's tokens when it is read): the serving
    # benchmarks time the loop, not the making of the tokens.
    return [Request(r.prompt.copy(), r.output_len, timestamp=r.timestamp)
            for r in read_trace(path, block_size=512, limit=limit)]


# -- 3: the exercise ---------------------------------------------------------------------------
def exercise_ops(num_ops: int) -> list:
    return make_exercise_ops(num_ops=num_ops, seed=0)


#: Exercise shapes: the shallow tree (one of 50 bases plus a tail: terminal depth 2) and
#: the deep one (prefixes of random length of 200 bases: terminals ~100 nodes deep), the
#: deep one with small token ids and with ids up to 2^41 (two-digit Python ints).
EXERCISE_SHAPES = ("shallow", "deep", "deep-big-ids")


def exercise_ops_of(shape: str, num_ops: int) -> list:
    if shape == "shallow":
        return exercise_ops(num_ops)
    if shape == "deep":
        return make_deep_exercise_ops(num_ops=num_ops, seed=0)
    if shape == "deep-big-ids":
        return make_deep_exercise_ops(num_ops=num_ops, seed=0, vocab=1 << 40)
    raise ValueError(f"unknown exercise shape {shape!r}")


def ops_as_arrays(ops: list) -> list:
    """The same ops with each token list as an ``array('q')`` (one array per list object, so
    repeated calls still share their input)."""
    from array import array

    made: dict = {}
    out = []
    for op, tokens in ops:
        arr = made.get(id(tokens))
        if arr is None:
            arr = made[id(tokens)] = array("q", tokens)
        out.append((op, arr))
    return out


def run_tuple_loop(ops: list) -> None:
    """The floor of reading the ops' lists: ``tuple()`` of every call's tokens, nothing else."""
    for _op, tokens in ops:
        tuple(tokens)


def run_exercise_tree_touched(pairs: list, core: str) -> Any:
    """The bare core on the arrays of ``pairs`` ((op, list, array) triples), with a ``tuple()``
    of each call's list first: the arrays' run plus touching each int once, in the same
    context as reading the lists (the tree competes with the ints for the caches)."""
    bare = CORES[core].Core(1, "lru")
    insert = bare.insert
    exists = bare.exists
    for op, tokens, arr in pairs:
        tuple(tokens)
        if op == "insert":
            insert(arr)
        else:
            exists(arr)
    return bare


def inserted_sequences(ops: list) -> list:
    """The distinct inserted sequences of an op stream, in first-insert order."""
    seen: set = set()
    out = []
    for op, tokens in ops:
        if op == "insert" and id(tokens) not in seen:
            seen.add(id(tokens))
            out.append(tokens)
    return out


def exercise_walk_cost(ops: list, core: str) -> tuple[float, float, int]:
    """(seconds of ``exists`` per node visited, average depth, node count) on the tree the
    ops build."""
    cache = run_exercise_cache(ops, core)
    per_node, depth = walk_cost(cache, inserted_sequences(ops))
    return per_node, depth, cache.node_count()


# -- 1b: in-cache cost of the serving calls per input type ------------------------------------
def in_cache_timing(core: str, page_size: int, input_type: str, requests: list,
                    passes: int = 3) -> InCacheTiming:
    return time_cached_calls(RadixCache(page_size=page_size, core=core), requests,
                             input_type, passes=passes)


def run_exercise_cache(ops: list, core: str) -> RadixCache:
    """The ops on a fresh RadixCache (the public API); returns the built cache."""
    cache = RadixCache(core=core)
    insert = cache.insert
    exists = cache.exists
    for op, tokens in ops:
        if op == "insert":
            insert(tokens)
        else:
            exists(tokens)
    return cache


def run_exercise_tree(ops: list, core: str) -> Any:
    """The ops on a bare core object (no cache layer): what the core alone costs."""
    bare = CORES[core].Core(1, "lru")
    insert = bare.insert
    exists = bare.exists
    for op, tokens in ops:
        if op == "insert":
            insert(tokens)
        else:
            exists(tokens)
    return bare


def run_exercise_set(ops: list) -> set:
    """The yardstick: the same ops on a plain ``set`` of token tuples."""
    seen: set = set()
    add = seen.add
    for op, tokens in ops:
        if op == "insert":
            add(tuple(tokens))
        else:
            tuple(tokens) in seen  # noqa: B015 -- the lookup is the work being timed
    return seen


def exercise_runner(contender: str, core: str | None) -> Callable[[list], Any]:
    if contender == "set":
        return run_exercise_set
    if contender == "cache":
        return lambda ops: run_exercise_cache(ops, core)
    if contender == "tree":
        return lambda ops: run_exercise_tree(ops, core)
    raise ValueError(f"unknown exercise contender {contender!r}")


@dataclass(frozen=True)
class MemoryUse:
    current: int   # bytes still held by the built structure (tracemalloc)
    peak: int      # bytes at the peak while building it (tracemalloc)


def measure_memory(build: Callable[[], Any]) -> MemoryUse:
    """Memory of what ``build()`` returns, the inputs excluded (they exist before tracing)."""
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        built = build()
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del built
    return MemoryUse(current=current - base, peak=peak - base)


# -- 4: matching one long cached prompt --------------------------------------------------------
@dataclass
class LongPrompt:
    cache: RadixCache
    prompt: np.ndarray    # what was cached
    query: np.ndarray     # an equal copy: what is matched (a fresh buffer, as a request has)

    def match(self):
        return self.cache.match_prefix(self.query)

    def tree_match(self):
        # The core walk alone, no index tensor built: the part that competes with memcmp.
        return core_of(self.cache).walk(self.query)

    def array_equal(self) -> bool:
        return np.array_equal(self.prompt, self.query)


def long_prompt(core: str, num_tokens: int, seed: int = 0) -> LongPrompt:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB_SIZE, size=num_tokens, dtype=np.int64)
    cache = RadixCache(core=core)
    # Slot indices stored as in serving, so the match returns a stored tensor.
    cache.insert(prompt, np.arange(num_tokens, dtype=np.int64))
    lp = LongPrompt(cache=cache, prompt=prompt, query=prompt.copy())
    if lp.match().length != num_tokens:  # sanity: the whole prompt must hit
        raise AssertionError("long prompt not fully matched")
    return lp


# -- 5: eviction at scale ----------------------------------------------------------------------
EVICTION_SEQ_LEN = 8


def _ignore(indices: Any) -> None:
    """A free callback that does nothing: what remains is the cache's own cost."""


class EvictionScenario:
    """A cache of ``num_leaves`` distinct random 8-token sequences (32k vocabulary).

    A timed round evicts about ``nodes_per_round`` nodes (LRU); between rounds, untimed, as
    many fresh sequences are inserted, so every round sees a cache of the same size.
    Sequences are inserted without kv indices (their tokens double as indices), to keep the
    10^6-leaf build affordable on the pure core.
    """

    def __init__(self, core: str, num_leaves: int, nodes_per_round: int, seed: int = 0) -> None:
        self.core = core
        self.num_leaves = num_leaves
        self.nodes_per_round = nodes_per_round
        self.rng = np.random.default_rng(seed)
        self.cache = RadixCache(core=core)
        self.insert_fresh(num_leaves)
        self.evicted_per_round: list[int] = []
        self._evictions_before: int | None = None

    def insert_fresh(self, count: int) -> None:
        insert = self.cache.insert
        for seq in self.rng.integers(0, VOCAB_SIZE, size=(count, EVICTION_SEQ_LEN)).tolist():
            insert(seq)

    def _evictions(self) -> int:
        return self.cache.stats().evictions

    def prepare(self) -> None:
        """Untimed, before each round: note what the last round evicted and put as much back."""
        self.finish()
        self._evictions_before = self._evictions()

    def finish(self) -> None:
        """Untimed, after the last round: note what it evicted."""
        before = self._evictions_before
        if before is None:
            return
        nodes = self._evictions() - before
        self.evicted_per_round.append(nodes)
        self._evictions_before = None
        self.insert_fresh(nodes)

    #: ``callback`` values: no free callback, a no-op one per node, a no-op batched one.
    CALLBACKS = ("none", "per-node", "batch")

    def evict_round(self, callback: str = "none") -> int:
        """The timed call: one ``evict`` freeing about ``nodes_per_round`` leaves."""
        num_tokens = self.nodes_per_round * EVICTION_SEQ_LEN
        if callback == "none":
            return self.cache.evict(num_tokens)
        return self.cache.evict(num_tokens, _ignore, batch=callback == "batch")

    def timed_round(self, timer: Callable[[], float],
                    callback: str = "none") -> tuple[float, int]:
        """(seconds, nodes evicted) of one round timed with ``timer``, refill included untimed."""
        self.prepare()
        start = timer()
        self.evict_round(callback)
        elapsed = timer() - start
        self.finish()
        return elapsed, self.evicted_per_round[-1]

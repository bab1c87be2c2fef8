"""Shared fixtures: every cache test runs once per available tree core.

``check_invariants`` reads the core behind a cache (``core_of``) on purpose: it is the one
place that knows what a consistent cache looks like, so every other test can call it after
each step.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from radixcache import ARRAY_TYPES, RadixCache
from radixcache._core import BLOCKS, CORES
from radixcache.download import find as _find_trace

#: Folders that may hold the Mooncake traces, searched before ``radixcache trace download``'s:
#: the ``os.pathsep``-separated ``RADIXCACHE_TRACE_DIR`` (.ci/run points it at CI's shared copies).
TRACE_DIRS = tuple(Path(p) for p in os.environ.get("RADIXCACHE_TRACE_DIR", "").split(os.pathsep)
                   if p)


#: Whether PyTorch is installed. Asked of the import system: collecting the tests imports no
#: torch, so the numpy and command tests run where radixcache was installed without it.
HAS_TORCH = importlib.util.find_spec("torch") is not None

#: Marks a test, or one parameter of it, that needs PyTorch: it skips where torch is missing.
needs_torch = pytest.mark.skipif(not HAS_TORCH,
                                 reason="needs PyTorch (pip install 'radixcache[torch]')")

#: ``ARRAY_TYPES`` as test parameters: the "torch" case skips where torch is missing.
ARRAY_TYPE_PARAMS = [pytest.param(kind, marks=needs_torch) if kind == "torch" else kind
                     for kind in ARRAY_TYPES]


def mooncake_trace(name: str = "synthetic"):
    """(path, "") of a Mooncake trace -- in ``TRACE_DIRS``, else ``radixcache trace download``'s
    -- or (None, a skip message saying where it looked and how to get it)."""
    return _find_trace(name, *TRACE_DIRS)


#: The fixtures that run a test once per tree core or block module, all in one pytest run
#: (``core``: a few modules parametrize their own by ``CORES``).
CORE_FIXTURES = frozenset({"core_name", "make_cache", "blocks", "core"})


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``default_core`` every test that takes none of ``CORE_FIXTURES`` (and is not marked
    ``core_independent``): it uses whichever core ``RadixCache()`` picks by default, directly,
    through the serving loop or the fleet, or in a subprocess (the command). CI runs the
    suite once (the compiled core by default; the core-parametrized tests on every core), then
    only these again with ``RADIXCACHE_NO_EXTENSIONS=1 python -m pytest -m default_core``, so
    the default core's pure-Python choice is tested too and nothing else runs twice."""
    for item in items:
        if item.get_closest_marker("core_independent"):
            continue
        if CORE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.default_core)


@pytest.fixture(params=list(CORES), ids=list(CORES))
def core_name(request) -> str:
    """The name of one available tree core ("python", and "c" once it is built)."""
    return request.param


@pytest.fixture(params=["c", "python"])
def backend_core(request) -> str:
    """The tree core the SGLang backend's instances use, for the SGLang integration's tests
    ("c" skips where it is not built)."""
    if request.param not in CORES:
        pytest.skip(f"the {request.param!r} core is not available in this build")
    return request.param


@pytest.fixture(params=list(BLOCKS), ids=list(BLOCKS))
def blocks(request):
    """One available block module (``BlockIndex``, the page hashes): pure, and compiled once
    it is built."""
    return BLOCKS[request.param]


@pytest.fixture
def make_cache(core_name):
    """``RadixCache`` bound to the current core: ``make_cache(page_size=..., ...)``."""
    return functools.partial(RadixCache, core=core_name)


def core_of(cache: RadixCache):
    """The tree core object behind ``cache`` (its ``Core``: ``tree``, ``heap``, sizes, ``walk``):
    the one way tests reach past the public class."""
    return cache._core


def _first_page(node, page_size: int) -> tuple:
    return tuple(int(t) for t in node.key[:page_size])


def check_index_array(cache: RadixCache, values, cpu: bool = False) -> None:
    """``values`` is a 1-D int64 index array of the cache's kind (``array_type``)."""
    if getattr(cache, "array_type", "torch") == "numpy":
        assert type(values) is np.ndarray, type(values)
        assert values.ndim == 1 and values.dtype == np.int64
        return
    import torch  # a torch cache: torch is there

    assert isinstance(values, torch.Tensor) and values.dim() == 1
    assert values.dtype == torch.int64
    if cpu:
        assert values.device.type == "cpu"


def check_invariants(cache: RadixCache) -> None:
    """Assert every structural and bookkeeping invariant of ``cache``; iterative, any depth."""
    tree = core_of(cache).tree
    root = tree.root
    page_size = cache.page_size
    assert not root.evicted
    assert root.parent is None
    assert root.num_tokens == 0

    tiered = cache.host_tier
    seen: set[int] = set()
    depth_of: dict[int, int] = {}
    evictable_leaves = []
    host_leaves = []
    node_count = 0
    total_tokens = 0
    locked_tokens = 0
    host_tokens = 0
    for node, depth in tree.iter_nodes():
        node_key = id(node)
        assert node_key not in seen, f"node {node.id} visited twice"
        seen.add(node_key)
        depth_of[node_key] = depth

        children = node.children
        assert node.num_children == len(children)
        child_lock_sum = 0
        first_pages = set()
        for child in children:
            assert child.parent is node, f"child {child.id} does not point back to {node.id}"
            child_lock_sum += child.lock_ref
            # Radix property: siblings differ in their first page (per namespace at the root).
            page = (child.extra_key if node is root else None, _first_page(child, page_size))
            assert page not in first_pages, f"two children of {node.id} start with {page}"
            first_pages.add(page)

        if node is root:
            assert depth == 0
            assert node.lock_ref == 1, f"the root's lock_ref is {node.lock_ref}, not 1"
            continue
        assert node.parent is not None
        parent_key = id(node.parent)
        assert parent_key in seen, f"node {node.id} reached before its parent (or detached)"
        assert depth == depth_of[parent_key] + 1
        assert not node.evicted, f"evicted node {node.id} still in the tree"

        num_tokens = node.num_tokens
        assert num_tokens > 0, f"node {node.id} has an empty key"
        assert len(node.key) == num_tokens
        assert num_tokens % page_size == 0, f"node {node.id} key length {num_tokens} unaligned"
        on_device = node.on_device if tiered else True
        if tiered:
            host = node.host_value
            tier = {(True, False): "device", (False, True): "host",
                    (True, True): "device+host"}.get((on_device, host is not None))
            assert tier is not None, f"node {node.id} has neither a device nor a host value"
            assert node.tier == tier
            if host is not None:
                check_index_array(cache, host, cpu=True)
                assert host.shape[0] == num_tokens, f"node {node.id} host/key length mismatch"
                host_tokens += num_tokens
            if on_device and node.parent is not root:
                assert node.parent.on_device, (
                    f"node {node.id} is on the device below host-only node {node.parent.id}")
            if not on_device:
                assert node.value is None and node.stored_value is None
                assert node.lock_ref == 0, f"host-only node {node.id} is locked"
        if on_device:
            value = node.value
            check_index_array(cache, value)
            assert value.shape[0] == num_tokens, f"node {node.id} value/key length mismatch"
        if node.parent is not root:
            # A subtree never mixes namespaces (the same key object, e.g. a NaN, is equal).
            assert (node.extra_key is node.parent.extra_key
                    or node.extra_key == node.parent.extra_key)

        assert node.lock_ref >= 0
        # lock_ref counts the node's own locks plus every lock below it.
        assert node.lock_ref >= child_lock_sum, (
            f"node {node.id} lock_ref {node.lock_ref} < its children's {child_lock_sum}"
        )
        node_count += 1
        if tiered and not on_device:
            if not children:
                host_leaves.append(node)
            continue
        total_tokens += num_tokens
        if node.lock_ref > 0:
            locked_tokens += num_tokens
        elif not children or (tiered and not any(c.on_device for c in children)):
            evictable_leaves.append(node)

    assert cache.node_count() == node_count == tree.node_count
    tree.check_layout()  # the core's own lookup structure (compiled: slot mirrors)
    assert cache.total_size() == total_tokens
    assert cache.protected_size() == locked_tokens == core_of(cache).protected
    assert cache.evictable_size() == total_tokens - locked_tokens == core_of(cache).evictable
    if tiered:
        assert cache.host_size() == host_tokens == cache.stats().host_size

    # The lazy heap: every evictable leaf needs an entry whose stored key is not above its
    # current key (an entry above it is discarded as stale, which would strand the leaf).
    heaps = [(core_of(cache).heap, evictable_leaves, "evictable")]
    if tiered:
        heaps.append((core_of(cache).host_heap, host_leaves, "host"))
    for heap, leaves, kind in heaps:
        stored_keys = defaultdict(list)
        for stored, node in heap.entries():
            stored_keys[id(node)].append(stored)
        for leaf in leaves:
            current = heap.key_of(leaf)
            assert any(stored <= current for stored in stored_keys.get(id(leaf), ())), (
                f"{kind} leaf {leaf.id} has no usable heap entry (current key {current}, "
                f"stored {stored_keys.get(id(leaf))})"
            )


def node_tokens(node) -> list[int]:
    """The full token sequence from the root down to ``node`` (iterative)."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [int(t) for part in reversed(parts) for t in part]


def page_sequences(page_size: int):
    """Hypothesis strategy: token lists over few distinct pages (so prefixes are shared; with
    page size 4, pages 0 and 1 share three tokens), plus an unaligned tail."""
    from hypothesis import strategies as st

    if page_size == 1:
        pages = [[0], [1], [2]]
    else:
        pages = [[0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]]
    body = st.lists(st.sampled_from(pages), max_size=4).map(
        lambda chosen: [tok for page in chosen for tok in page])
    tail = st.lists(st.sampled_from([0, 1]), max_size=page_size - 1)
    return st.tuples(body, tail).map(lambda parts: parts[0] + parts[1])

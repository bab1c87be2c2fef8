"""Each tier pays for its node fields only where it is used, on both cores.

A one-tier tree makes plain ``Node`` objects, which have no room for the host tier's fields
(a host copy, its flags and counters); a tree with a host tier makes ``HostNode`` objects
(a subclass), so only those trees pay for them. Nodes of one kind handed to a core of the
other kind (by a caller mixing caches) are refused or left alone, never read as the other
kind: the cache stays as it was.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import check_invariants
from radixcache import RadixCache
from radixcache._core import CORES
from radixcache._types import MatchResult

_64_BIT = sys.maxsize > 2**32


def _cores(core_name: str):
    module = CORES[core_name]
    plain = module.Core(1, "lru", numpy_arrays=True)
    tiered = module.Core(1, "lru", host_tier=True, numpy_arrays=True)
    for core in (plain, tiered):
        core.insert([1, 2, 3, 4], np.arange(4, dtype=np.int64))
        core.insert([1, 2, 5, 6], np.arange(10, 14, dtype=np.int64))
    return module, plain, tiered


def _nodes(core) -> list:
    return [node for node, _depth in core.tree.iter_nodes()]


def _kind(module, node) -> str:
    """"host" for a HostNode, "plain" for any other node of ``module`` (the pure core's node
    classes also differ by their array kind)."""
    if isinstance(node, module.HostNode):
        return "host"
    return "plain" if isinstance(node, module.Node) else "foreign"


def test_each_tree_makes_the_nodes_of_its_tiers(core_name):
    module, plain, tiered = _cores(core_name)
    assert {_kind(module, node) for node in _nodes(plain)} == {"plain"}
    assert {_kind(module, node) for node in _nodes(tiered)} == {"host"}
    assert issubclass(module.HostNode, module.Node)
    # A plain node answers the host tier's questions as a node on the device only.
    leaf = plain.match([1, 2, 3, 4]).last_node
    assert leaf.on_device and leaf.host_value is None and leaf.tier == "device"


def test_a_one_tier_node_has_no_host_fields(core_name):
    _module, plain, tiered = _cores(core_name)
    plain_leaf = plain.match([1, 2, 3, 4]).last_node
    host_leaf = tiered.match([1, 2, 3, 4]).last_node
    # The host tier's fields (its copy, flags, counter) cost 16 bytes or more per node.
    assert sys.getsizeof(plain_leaf) + 16 <= sys.getsizeof(host_leaf)


@pytest.mark.skipif(not _64_BIT or "c" not in CORES, reason="the compiled core, 64-bit")
def test_a_compiled_one_tier_node_takes_176_bytes():
    """160 bytes of object plus the collector's 16-byte header: one pymalloc size class below
    the 192 bytes a node took while every node carried the host tier's fields."""
    _module, plain, _tiered = _cores("c")
    assert sys.getsizeof(plain.match([1, 2, 3, 4]).last_node) <= 176


def _foreign_calls(module, core, other) -> None:
    """Every core call that takes a node, with ``other``'s nodes (the other kind)."""
    leaf = other.match([1, 2, 3, 4]).last_node
    inner = other.match([1, 2]).last_node
    with pytest.raises(ValueError):
        core.lock(leaf, 1)
    with pytest.raises(ValueError):
        core.lock(inner, -1)
    with pytest.raises(ValueError):
        core.remove_leaf(leaf)
    core.revert_insert([(inner, 0)], leaf)  # not this core's: nothing to undo
    core.heap.push(leaf)
    core.heap.push(inner)
    # A node of the other kind is no victim of this core (nor any node it was pushed with).
    while (victim := core.pop_victim()) is not None:
        assert any(victim is node for node in _nodes(core)), victim
        core.heap.push(victim)  # back: the test only drains what was pushed by hand
        break
    forged = MatchResult(np.empty(0, dtype=np.int64), inner, 2, 2, leaf)
    if core.host_tier:
        with pytest.raises(ValueError, match="stale"):
            core.load_back(forged, np.arange(2, dtype=np.int64))


@pytest.mark.parametrize("direction", ["plain nodes to a host tier", "host nodes to one tier"])
def test_nodes_of_the_other_kind_are_refused(core_name, direction):
    module, plain, tiered = _cores(core_name)
    core, other = (tiered, plain) if direction.startswith("plain") else (plain, tiered)
    before = [(n.id, n.num_tokens, n.lock_ref, n.tier) for n in _nodes(core)]
    sizes = (core.evictable, core.protected, core.tree.node_count)
    _foreign_calls(module, core, other)
    assert [(n.id, n.num_tokens, n.lock_ref, n.tier) for n in _nodes(core)] == before
    assert (core.evictable, core.protected, core.tree.node_count) == sizes
    # The other core was not touched either.
    assert other.match([1, 2, 3, 4]).length == 4 and other.tree.node_count == 3


@pytest.mark.parametrize("host_tier", [False, True], ids=["one tier", "host tier"])
def test_a_cache_of_either_kind_keeps_its_invariants(core_name, host_tier):
    """Splits, evictions and resets keep every node of the tree's kind."""
    module = CORES[core_name]
    cache = RadixCache(core=core_name, host_tier=host_tier, array_type="numpy")
    kind = "host" if host_tier else "plain"
    for i in range(40):
        cache.insert([1, 2, 3, i % 7, i], np.arange(5, dtype=np.int64) + 5 * i)
        cache.match_prefix([1, 2, i % 5])
        if i % 9 == 8:
            cache.evict(6)
        check_invariants(cache)
        assert all(_kind(module, node) == kind for node, _ in cache._core.tree.iter_nodes())
    cache.reset()
    assert _kind(module, cache.root_node) == kind


@pytest.mark.parametrize("call", ["back_up", "drop_host_copy"])
def test_host_tier_steps_on_a_one_tier_core_are_refused(core_name, call):
    """The engine's per-node host steps on a core without a host tier (whose nodes have no
    host fields): a ValueError naming the call, the core usable after it."""
    _module, plain, _tiered = _cores(core_name)
    node = _nodes(plain)[-1]
    args = (node, np.arange(node.num_tokens, dtype=np.int64)) if call == "back_up" else (node,)
    with pytest.raises(ValueError, match=f"{call} needs a core with a host tier"):
        getattr(plain, call)(*args)
    assert plain.match([1, 2, 3, 4]).length == 4

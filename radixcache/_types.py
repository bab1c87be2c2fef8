"""The public types both tree cores share: ``RadixTreeNode`` (the ABC each core's node class
is registered with, by the chooser ``_core``), ``MatchResult``, ``InsertResult`` and
``MAX_LOCK_REF``."""

from __future__ import annotations

from abc import ABC
from typing import Any

import numpy as np

from ._torch import empty_indices

__all__ = ["RadixTreeNode", "MatchResult", "InsertResult", "MAX_LOCK_REF"]

# The most locks a node can hold (the compiled core counts them in 32 bits; both cores refuse
# the lock past it).
MAX_LOCK_REF = 2**31 - 1


class RadixTreeNode(ABC):  # noqa: B024 -- for isinstance: each core registers its node
    """A node of a ``RadixCache`` tree, as ``MatchResult.last_node`` and the like give it.

    Each tree core has its own node class; ``isinstance(node, RadixTreeNode)`` holds for
    both. Nodes are read-only handles: the cache changes them, the caller only reads them and
    passes them back (to ``inc_lock_ref``/``dec_lock_ref``).

    Attributes:
        key: The node's tokens, a read-only 1-D int64 numpy array (empty at the root).
        value: The KV slot indices of those tokens, a new 1-D ``torch.int64`` tensor (a
            1-D int64 numpy array in a cache with ``array_type="numpy"``). Indices on a
            device are not copied: the tensor is a view of the ones the node keeps, so
            writing to its elements changes them; changing its shape does not.
        parent: The parent node (``None`` at the root).
        children: The child nodes, a tuple.
        lock_ref: How many locks protect it (its own and its descendants').
        last_access_time: The logical time of the last call that touched it.
        created_time: The logical time its KV was computed.
        priority: The highest priority an insert through it gave.
        hit_count: Inserts through or ending at it.
        extra_key: Its namespace (``None``: the default one).
        id: A number unique within its cache.
        evicted: True once it left the tree (evicted, or dropped by ``reset``).
        terminal: True if a sequence inserted exactly ends here (what ``exists`` looks for).
        num_tokens: ``len(key)``.
        num_children: ``len(children)``.
        on_device: False when the node is held only in host memory (a cache with a host
            tier); then ``value`` is None. Always True without a host tier.
        host_value: Its host indices, a new 1-D CPU ``torch.int64`` tensor (a numpy array
            with ``array_type="numpy"``), or None when it has no host copy.
        tier: ``"device"``, ``"host"`` or ``"device+host"``.
    """


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

"""The pure core's host tier: what ``Core`` of ``_core_py`` does with host copies (the
tiered ``evict``, ``evict_host``, ``write_through``, ``load_back``, ``insert_host``), as a
base class of it.

The interface is specified in ``_core_py``'s docstring; this module only holds the methods, so
that the core's module keeps its one-tier paths and its specification readable. The methods
use the core's state (``tree``, ``heap``, counters, the guard) as ``Core`` sets it up.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._errors import cpu_values_only, stale_match
from ._handover import answer_not_kept, hand_over_batch, host_indices_bytes
from ._heap_py import host_leaf
from ._torch import empty_indices
from ._tree_py import TOKEN_BYTES, Node, index_array
from ._types import MatchResult

__all__ = ["HostTier"]


class HostTier:
    """The host-tier methods of the pure ``Core`` (a base class: no state of its own)."""

    def _host_leave(self, node: Node, free_host: Any, on_remove_host: Any,
                    garbage: list) -> None:
        """A host-only node without children leaves the tree as in ``evict_host``:
        ``on_remove_host(node)`` first, then it is detached and counted, then its host
        indices (a new CPU index array) go to ``free_host``."""
        if on_remove_host is not None:
            on_remove_host(node)
        host = node._host
        size = node.num_tokens
        parent, dropped = self.tree._detach_leaf(node)
        garbage.append(dropped)
        node._host = None
        self.host_size -= size
        self.host_evictions += 1
        self.host_evicted_tokens += size
        if host_leaf(parent):
            garbage.append(self.host_heap._push(parent))
        free_host(index_array([host], self._numpy_arrays))

    def _host_leaf_leaves(self, free_host: Any, on_remove_host: Any, garbage: list,
                          keep: Any = None) -> bool:
        """The first host leaf in policy order not in ``keep`` leaves (``_host_leave``);
        False if none. The kept leaves it passes stay on the host heap."""
        heap = self.host_heap
        passed = []
        try:
            node = heap._pop(garbage)
            while node is not None and keep is not None:
                passed.append(node)  # pushed back whatever ``in`` does
                if node not in keep:
                    passed.pop()
                    break
                node = heap._pop(garbage)
        finally:
            for kept in passed:
                garbage.append(heap._push(kept))
        if node is None:
            return False
        try:
            self._host_leave(node, free_host, on_remove_host, garbage)
        except BaseException:
            if not node._evicted:
                garbage.append(heap._push(node))  # still a host leaf
            raise
        return True

    @staticmethod
    def _holds_kept(node: Node, keep: Any) -> bool:
        """Whether a node of ``node``'s subtree below it is in ``keep``."""
        if keep is None:
            return False
        stack = list(node._children.values())
        while stack:
            below = stack.pop()
            if below in keep:
                return True
            stack.extend(below._children.values())
        return False

    def _drop_host_below(self, node: Node, free_host: Any, on_remove_host: Any,
                         garbage: list) -> None:
        """Every (host-only) descendant of the device leaf ``node`` leaves the tree,
        bottom-up (``_host_leave``)."""
        order = []  # (-depth, id, node): deepest first, then by id (as the compiled core)
        stack = [(child, 1) for child in node._children.values()]
        while stack:
            below, depth = stack.pop()
            order.append((-depth, below._id, below))
            stack.extend((child, depth + 1) for child in below._children.values())
        order.sort(key=lambda item: item[:2])
        for _, _, below in order:  # every node after its descendants
            self._host_leave(below, free_host, on_remove_host, garbage)

    def _evict_tiered(self, num_tokens: int, free_callback: Any, batch: bool, on_remove: Any,
                      backup: Any, on_backup: Any, free_host: Any = None,
                      on_remove_host: Any = None, keep: Any = None) -> int:
        """``evict`` with a host tier: victims with a host copy (or given one by ``backup``)
        are demoted to the host, the others deleted (or skipped when they have host-only
        children); see the module docstring."""
        self._take(False, "evict")
        holding = True
        garbage: list = []  # stale entries, dropped values: released outside the guard
        parts: list | None = [] if batch and free_callback is not None else None
        per_node = free_callback is not None and not batch
        use_backup = backup is not None and self.write_through_hits == 0
        handed: list = [None]  # see _hand_over_one
        skipped: list = []  # device leaves that could not leave: pushed back at the end
        skipping: set = set()  # the same nodes: not asked about again in this call
        freed = 0
        error = None
        try:
            tree = self.tree
            heap = self.heap
            while freed < num_tokens:
                node = heap._pop(garbage)
                if node is None:
                    break
                if node in skipping:
                    continue  # pushed again (by a callback) after it was skipped: not retried
                if keep is not None:
                    skipped.append(node)  # passed over, pushed back at the end ...
                    if node in keep:
                        skipping.add(node)
                        continue
                    skipped.pop()  # ... unless ``in`` said no
                size = node.num_tokens
                value = None
                if node._host is None:
                    host = None
                    if use_backup:
                        try:
                            value = node.value  # the tensor backup and free_callback get
                            host = backup(value)
                            # No room: host leaves leave in policy order, one at a time,
                            # and backup is asked again after each.
                            while (host is None and free_host is not None
                                   and self._host_leaf_leaves(free_host, on_remove_host,
                                                              garbage, keep)):
                                host = backup(value)
                            if host is not None:
                                host = self._kept_answer(host, size)
                        except BaseException:
                            garbage.append(heap._push(node))  # still a device leaf
                            raise
                    try:
                        held = free_host is not None and self._holds_kept(node, keep)
                    except BaseException:
                        garbage.append(heap._push(node))  # still a device leaf
                        raise
                    if host is None and node._children:  # all of them host only
                        if free_host is None or held:
                            # it cannot leave the tree: skipped
                            skipped.append(node)
                            skipping.add(node)
                            continue
                        try:  # they leave the tree first, their host slots to free_host
                            self._drop_host_below(node, free_host, on_remove_host, garbage)
                        except BaseException:
                            garbage.append(heap._push(node))  # still a device leaf
                            raise
                    if host is not None:
                        node._host = host
                        self.host_size += size
                        self.backed_up_tokens += size
                        if on_backup is not None:
                            try:
                                on_backup(node)
                            except BaseException:
                                garbage.append(heap._push(node))
                                raise
                try:
                    if on_remove is not None:
                        on_remove(node)
                    if per_node and value is None:
                        value = node.value
                except BaseException:
                    garbage.append(heap._push(node))
                    raise
                raw = node._value
                if node._host is not None:  # demoted: stays in the tree, host only
                    parent = node._parent
                    garbage.append(raw)
                    node._value = None
                    node._on_device = False
                    if not node._children:
                        garbage.append(self.host_heap._push(node))
                else:
                    parent, dropped = tree._detach_leaf(node)
                    garbage.append(dropped)
                if parts is not None:  # handed over only once it left the device
                    if value is not None:  # backup's tensor: the batch's part (as compiled)
                        parts.append(value)
                    else:
                        parts.append(node._key if raw is None else raw)
                self.evictable -= size
                self.evictions += 1
                self.evicted_tokens += size
                garbage.append(self._push_if_evictable(parent))
                freed += size
                if per_node:
                    holding = False
                    handed[0] = value
                    del value
                    self._hand_over_one(free_callback, handed, garbage,
                                        "evict, after its free_callback")
                    holding = True
        except BaseException as exc:
            if parts is None:
                raise
            error = exc
        finally:
            if skipped and not holding and self._enter(False):
                holding = True
            if holding:
                if skipped:
                    for node in skipped:
                        garbage.append(self._push_if_evictable(node))
                self._leave()
        garbage.clear()
        skipped.clear()
        skipping.clear()
        hand_over_batch(free_callback, parts or None, error, self._join)
        return freed

    def evict_host(self, num_tokens: int, free_callback: Any = None, batch: bool = False,
                   on_remove: Any = None, keep: Any = None) -> int:
        """Evict host leaves in policy order; see the module docstring."""
        self._take(False, "evict_host")
        passed: list = []  # host leaves in ``keep``: pushed back at the end
        holding = True
        garbage: list = []
        parts: list | None = [] if batch and free_callback is not None else None
        per_node = free_callback is not None and not batch
        handed: list = [None]  # see _hand_over_one
        freed = 0
        error = None
        try:
            tree = self.tree
            heap = self.host_heap
            while freed < num_tokens:
                node = heap._pop(garbage)
                if node is None:
                    break
                if keep is not None:
                    passed.append(node)  # pushed back at the end whatever ``in`` does
                    if node in keep:
                        continue
                    passed.pop()
                try:
                    if on_remove is not None:
                        on_remove(node)
                    if per_node:
                        handed[0] = node.host_value
                except BaseException:
                    garbage.append(heap._push(node))  # still a host leaf
                    raise
                host = node._host
                size = node.num_tokens
                parent, dropped = tree._detach_leaf(node)
                garbage.append(dropped)
                if parts is not None:  # handed over only once it left the tree
                    parts.append(host)
                node._host = None
                self.host_size -= size
                self.host_evictions += 1
                self.host_evicted_tokens += size
                if host_leaf(parent):
                    garbage.append(heap._push(parent))
                freed += size
                if per_node:
                    holding = False
                    self._hand_over_one(free_callback, handed, garbage,
                                        "evict_host, after its free_callback")
                    holding = True
        except BaseException as exc:
            if parts is None:
                raise
            error = exc
        finally:
            if passed and not holding and self._enter(False):
                holding = True
            if holding:
                for node in passed:
                    if host_leaf(node):
                        garbage.append(self.host_heap._push(node))
                self._leave()
        garbage.clear()
        passed.clear()
        hand_over_batch(free_callback, parts or None, error, self._join)
        return freed

    def next_victim(self, host: bool = False, keep: Any = None) -> Any:
        """The node ``evict`` (``host``: ``evict_host``) would take first, passing over the
        nodes in ``keep``; None if none. Every entry popped goes back on the heap."""
        self._take(False, "next_victim")
        garbage: list = []
        passed: list = []
        heap = self.host_heap if host else self.heap
        try:
            node = heap._pop(garbage)
            while node is not None:
                passed.append(node)
                if keep is None or node not in keep:
                    return node
                node = heap._pop(garbage)
            return None
        finally:
            for popped in passed:
                garbage.append(heap._push(popped))
            self._leave()
            garbage.clear()

    def _device_node(self, node: Any, what: str) -> None:
        """Raise unless ``node`` is a node of this tree on the device, not the root."""
        if not self.host_tier:
            raise ValueError(f"{what} needs a core with a host tier")
        self.tree._check_member(node)
        if node is self.tree.root:
            raise ValueError(f"{what}: the root holds no tokens")
        if not node._on_device:
            raise ValueError(f"{what}: node {node._id} is only on the host"
                             + (" (evict_host removes it)" if what == "drop_host_copy" else ""))

    def back_up(self, node: Any, host: Any, on_backup: Any = None) -> None:
        """Give a node on the device its host copy; see the module docstring."""
        self._take(False, "back_up")
        try:
            self._device_node(node, "back_up")
            if node._host is not None:
                raise ValueError(f"back_up: node {node._id} already has a host copy")
            size = node.num_tokens
            node._host = self._kept_answer(host, size)
            self.host_size += size
            self.backed_up_tokens += size
            if on_backup is not None:
                on_backup(node)
        finally:
            self._leave()

    def drop_host_copy(self, node: Any, on_remove_host: Any = None) -> Any:
        """Take the host copy of a node on the device; see the module docstring."""
        self._take(False, "drop_host_copy")
        try:
            self._device_node(node, "drop_host_copy")
            if node._host is None:
                raise ValueError(f"drop_host_copy: node {node._id} has no host copy")
            if on_remove_host is not None:
                on_remove_host(node)
            host = node._host
            if node._evicted or not node._on_device or host is None:
                raise RuntimeError(f"drop_host_copy: node {node._id} changed during a "
                                   "callback")
            node._host = None
            self.host_size -= node.num_tokens
            return index_array([host], self._numpy_arrays)
        finally:
            self._leave()

    def _kept_answer(self, answer: Any, size: int) -> bytes:
        """``backup``'s answer for a node of ``size`` tokens, checked, as int64 bytes; an
        error meanwhile carries the answer (``_handover.answer_not_kept``)."""
        try:
            return host_indices_bytes(answer, size, self._numpy_arrays)
        except BaseException as exc:
            error = answer_not_kept(exc, answer)
            if error is exc:
                raise
            raise error from exc

    def write_through(self, backup: Any, on_backup: Any = None) -> int:
        """Copy the queued nodes to the host, FIFO; see the module docstring."""
        self._take(False, "write_through")
        garbage: list = []
        skipped: list = []  # nodes backup had no room for, in queue order: put back first
        try:
            queue = self.tree._queue
            copied = 0
            refused = 0  # the smallest node backup had no room for in this call (0: none)
            while queue:
                node = queue[0]
                if node._evicted or not node._on_device or node._host is not None:
                    garbage.append(queue.popleft())
                    node._queued = False
                    continue
                size = node.num_tokens
                if refused and size >= refused:
                    skipped.append(queue.popleft())  # no room for it either: not asked
                    continue
                host = backup(node.value)  # an error leaves the node queued, in its place
                if host is None:  # no room for this one now: retried on a later call
                    skipped.append(queue.popleft())
                    refused = size
                    if size <= self.page_size:
                        break  # no queued node is smaller
                    continue
                host = self._kept_answer(host, size)
                queue.popleft()
                node._queued = False
                node._host = host
                self.host_size += size
                self.backed_up_tokens += size
                copied += size
                if on_backup is not None:
                    on_backup(node)
            return copied
        finally:
            if skipped:
                self.tree._queue.extendleft(reversed(skipped))
            self._leave()
            garbage.clear()
            skipped.clear()

    def load_back(self, match: Any, device_values: Any, on_load: Any = None) -> Any:
        """Put a match's host continuation back on the device; see the module docstring."""
        self._take(False, "load_back")
        try:
            if not isinstance(match, MatchResult):
                raise TypeError(f"load_back needs a MatchResult, got {type(match).__name__}")
            nodes = self._host_continuation(match)
            if self._numpy_arrays and not isinstance(device_values, np.ndarray):
                raise cpu_values_only("load_back", device_values)
            count = len(device_values)
            if count != match.host_length:
                raise ValueError(f"load_back got {count} device slots for a host match of "
                                 f"{match.host_length} tokens")
            if not nodes:
                return empty_indices(self._numpy_arrays)
            nodes.reverse()  # top-down
            hosts = []
            start = 0
            for node in nodes:
                size = node.num_tokens
                part = device_values[start:start + size]
                node._value = part.tobytes() if isinstance(part, np.ndarray) else part
                node._on_device = True
                self.evictable += size
                hosts.append(node._host)
                start += size
            self.loaded_tokens += match.host_length
            dropped = self._push_if_evictable(nodes[-1])  # noqa: F841 -- held until the call returns
            if on_load is not None:
                for node in nodes:
                    on_load(node)
            return index_array(hosts, self._numpy_arrays)
        finally:
            self._leave()

    def _host_continuation(self, match: MatchResult) -> list:
        """The host-only nodes from ``match.last_host_node`` up to ``match.last_node``
        (bottom-up), checked to be exactly as the match found them; ValueError if not."""
        last = match.last_node
        bottom = match.last_host_node
        host_length = match.host_length
        root = self.tree.root
        if type(host_length) is not int or host_length < 0:
            raise stale_match(f"host_length {host_length!r} is not a token count")
        if last is not root:
            if not isinstance(last, Node) or last._evicted or not last._on_device:
                raise stale_match("its last_node is no longer on the device")
            top = last
            while top._parent is not None:
                top = top._parent
            if top is not root:
                raise stale_match("its last_node is not in this cache")
        if host_length == 0:
            if bottom is not last and bottom is not None:
                raise stale_match("host_length is 0 but last_host_node is not last_node")
            return []
        nodes = []
        total = 0
        node = bottom
        while node is not last:
            if not isinstance(node, Node) or node is root:
                raise stale_match("its host nodes do not lead up to its last_node")
            if node._evicted or node._on_device or node._host is None:
                raise stale_match(f"node {node._id} is no longer only on the host")
            nodes.append(node)
            total += node.num_tokens
            if total > host_length:
                break
            node = node._parent
        if total != host_length:
            raise stale_match(f"its host nodes hold {total} tokens, not host_length "
                              f"{host_length}")
        return nodes

    def _insert_host(self, node: Any, buf: Any, held: Any, kinds: tuple, extra_key: Any,
                     hashable: Any, refill: bool, on_store: Any) -> tuple:
        """``insert_host`` (see the module docstring) of the tokens and host indices as
        int64 bytes (None: not a token input; ``kinds``: their type names), ``hashable``
        the check of ``extra_key`` (run under the guard); ``Core.insert_host`` converts
        them."""
        self._take(False, "insert_host")
        garbage: list = []
        try:
            tree = self.tree
            if not self.host_tier:
                raise ValueError("insert_host needs a core with a host tier")
            tree._check_member(node)
            if buf is None:
                raise TypeError("insert_host: tokens must be a list of ints or a 1-D int64 "
                                f"array, got {kinds[0]}")
            if held is None:
                raise TypeError("insert_host: host indices must be a list of ints or a 1-D "
                                f"int64 array, got {kinds[1]}")
            count = len(buf) // TOKEN_BYTES
            if count % self.page_size:
                raise ValueError(f"insert_host: {count} tokens are not a whole number of "
                                 f"pages of {self.page_size}")
            if len(held) != len(buf):
                raise ValueError(f"insert_host got {len(held) // TOKEN_BYTES} host indices "
                                 f"for {count} tokens: one per token expected")
            root = tree.root
            if node is not root:
                extra_key = node._extra_key  # below the root, the anchor's namespace
            elif extra_key is not None and not hashable(extra_key):
                raise TypeError(f"insert_host: extra_key {type(extra_key).__name__} is not "
                                "hashable")
            tree.clock += 1
            now = tree.clock
            node._last_access_time = now
            end = len(buf)
            pos = 0
            prefix_len = 0
            unused: list = []  # host slots the tree does not take: the caller frees them
            stored: list = []  # nodes given host slots, in path order (then on_store)
            last_device = node  # the deepest node on the device it stamps (or the anchor)
            while pos < end:
                child, common = tree._descend(node, buf, pos, end, extra_key)
                if child is None:
                    break
                child._last_access_time = now
                if child._on_device:
                    last_device = child
                part = held[pos:pos + common]
                if refill and child._host is None:  # on the device without a host copy
                    child._host = part
                    self.host_size += common // TOKEN_BYTES
                    stored.append(child)
                else:
                    prefix_len += common // TOKEN_BYTES
                    unused.append(part)
                pos += common
                node = child
            dropped = False
            if self._push_on_access and node is not root:
                # The walk stamped them: a policy whose key falls on access needs new entries
                # for the leaves among them (a device leaf is the deepest on the device).
                garbage.append(self._push_if_evictable(last_device))
                if host_leaf(node):
                    garbage.append(self.host_heap._push(node))
            if pos < end:
                if refill and node is not root and node._host is None:
                    # Under write-through a host-only node never hangs below a node without
                    # a host copy: the pages are dropped (nothing was refilled: the walk
                    # ended on the anchor, which has none).
                    dropped = True
                    unused = [held]
                    prefix_len = 0
                else:
                    new = tree._Node(buf[pos:end], node, extra_key, now, node._priority)
                    new._host = held[pos:end]
                    new._on_device = False
                    ckey = tree._child_key(node, extra_key, buf[pos:pos + tree._page_bytes])
                    node._children[ckey] = new
                    tree._filed(new, ckey)
                    tree.node_count += 1
                    self.host_size += (end - pos) // TOKEN_BYTES
                    stored.append(new)
                    garbage.append(self.host_heap._push(new))
                    node = new
            if on_store is not None:
                for below in stored:
                    on_store(below)
            freed = (index_array(unused, self._numpy_arrays) if unused
                     else empty_indices(self._numpy_arrays))
            return prefix_len, node, freed, dropped
        finally:
            self._leave()
            garbage.clear()

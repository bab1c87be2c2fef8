"""The public ``RadixCache``'s host-tier calls that hand straight to the tree core: host
eviction, the engine's per-node steps (``next_victim``, ``back_up``, ``drop_host_copy``,
``insert_host``), ``write_through`` and ``host_size``. ``HostTierCalls`` is a base class of
``RadixCache``; it only checks arguments and passes the cache's event hooks, as ``cache.py``
does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ._validate import check_int

if TYPE_CHECKING:
    import torch

__all__ = ["HostTierCalls"]


class HostTierCalls:
    """The host-tier calls of ``RadixCache`` (see there); every one raises ValueError on a
    cache without a host tier."""

    __slots__ = ()

    def _need_host_tier(self, what: str) -> None:
        if not self.host_tier:
            raise ValueError(f"{what} needs a cache with a host tier "
                             "(RadixCache(host_tier=True))")

    def evict_host(self, num_tokens: int,
                   free_callback: Callable[[torch.Tensor], Any] | None = None, *,
                   batch: bool = False, keep: Any = None) -> int:
        """Free host memory: remove host-only leaves in policy order.

        Only nodes held on the host alone and without children are victims: a node on the
        device, or with a node below it, never is (so neither is a locked path). A victim
        leaves the tree; a parent left host-only and childless can follow in the same call.

        Args:
            num_tokens: Host tokens to free; 0 or less frees nothing.
            free_callback: Called with the freed host indices (a new 1-D CPU int64 tensor),
                per node (the callback may call the cache) or, with ``batch``, once at the
                end with all of them concatenated, as in ``evict``.
            batch: One call of ``free_callback`` for the whole eviction, as in ``evict``.
            keep: Host leaves (a set, or anything ``in`` works on) passed over: they stay.

        Returns:
            The number of host tokens freed.

        Raises:
            TypeError: ``num_tokens`` is not an int, or ``free_callback`` is not callable.
            ValueError: the cache has no host tier.
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        num_tokens = check_int(num_tokens, "num_tokens")
        if free_callback is not None and not callable(free_callback):
            raise TypeError(
                f"free_callback must be callable, got {type(free_callback).__name__}")
        self._need_host_tier("evict_host")
        events = self._events
        return self._core.evict_host(num_tokens, free_callback, bool(batch),
                                     None if events is None else events.removed_host, keep)

    def next_victim(self, *, host: bool = False, keep: Any = None) -> Any:
        """The node ``evict`` would take first; nothing changes (to decide per victim).

        Args:
            host: The node ``evict_host`` would take first instead.
            keep: Nodes to pass over, as ``evict``'s ``keep``.

        Returns:
            A ``RadixTreeNode``, or None when there is none.

        Raises:
            ValueError: the cache has no host tier.
        """
        self._need_host_tier("next_victim")
        return self._core.next_victim(bool(host), keep)

    def back_up(self, node: Any, host_indices: Any) -> None:
        """Give ``node`` the host copy the engine just made: the engine's write-through,
        when it decides itself which node and when. The node stays on the device too.

        Args:
            node: A node on the device without a host copy (not the root).
            host_indices: As ``evict``'s ``backup`` returns them, one per slot.

        Raises:
            TypeError, ValueError: not a node of this cache, evicted, only on the host or
                backed up already; bad ``host_indices`` (as ``evict``); no host tier.
                Nothing changes then.
        """
        self._need_host_tier("back_up")
        events = self._events
        self._core.back_up(node, host_indices, None if events is None else events.stored_host)

    def insert_host(self, node: Any, tokens: Any, host_indices: Any, *, extra_key: Any = None,
                    refill: bool = False) -> tuple:
        """Put pages that arrived in host slots (read back from storage) into the tree below
        ``node``, as SGLang's HiCache does when a prefetch completes.

        The walk from ``node`` follows the cached continuation of ``tokens`` (splitting a
        node where the pages end or differ inside it); the pages it does not find become one
        new node held on the host only. With ``refill`` (SGLang's rule for every write policy
        but ``write_back``), a node passed on the way that is on the device without a host
        copy takes its pages' host slots as one, and pages left below a node without a host
        copy are dropped rather than put under it.

        Args:
            node: Where the pages continue (the root, or a node of this cache).
            tokens: The pages' tokens (a whole number of pages).
            host_indices: Their host slots, one per token (a list or a 1-D int64 array).
            extra_key: The namespace, when ``node`` is the root (below it, the node's own).
            refill: Give nodes without a host copy theirs; drop what would hang below one.

        Returns:
            ``(prefix_len, last_node, unused, dropped)``: the tokens already held (their
            host slots not taken), the node the pages end on, the host indices the tree did
            not take (a new 1-D CPU int64 array: the engine frees them) and whether the new
            pages were dropped.

        Raises:
            TypeError, ValueError: not a node of this cache, evicted; bad tokens or host
                indices (not a whole number of pages, not one per token); an unhashable
                ``extra_key``; no host tier. Nothing changes then.
        """
        self._need_host_tier("insert_host")
        events = self._events
        if events is not None and extra_key is not None:
            events.check_extra_key(extra_key)  # before the tree changes
        tokens = self._tokens(tokens)
        host_indices = self._kv_values(host_indices, 0, "host_indices")
        return self._core.insert_host(node, tokens, host_indices, extra_key, bool(refill),
                                      None if events is None else events.stored_host)

    def drop_host_copy(self, node: Any) -> torch.Tensor:
        """Take back the host copy of ``node``, which stays on the device.

        Args:
            node: A node on the device with a host copy.

        Returns:
            Its host indices (a new 1-D CPU int64 array of the cache's kind): the engine
            frees them.

        Raises:
            TypeError, ValueError: not a node of this cache, evicted, only on the host (see
                ``evict_host``) or without a host copy; no host tier. Nothing changes then.
        """
        self._need_host_tier("drop_host_copy")
        events = self._events
        return self._core.drop_host_copy(node,
                                         None if events is None else events.removed_host)

    def write_through(self, backup: Callable[[torch.Tensor], Any]) -> int:
        """Copy to the host the nodes the write policy made due (call once per step).

        With ``write_policy="write_through"`` a node is due once it has been hit (inserted
        through, or made) once, with ``"write_through_selective"`` once hit twice; with
        ``"write_back"`` nothing ever is, and this returns 0. Due nodes are copied in the
        order they became due, each with one ``backup`` call; they stay on the device too.

        Args:
            backup: Called with a due node's device indices; allocates host slots, copies
                the KV there and returns their indices (a 1-D ``torch.int64`` tensor, one per
                device slot), or None when the host has no room for this node now: the
                node stays due, in its place, for a later call, and the call goes on with
                the nodes behind it -- asking only about nodes smaller than the smallest
                it was refused (a node at least as large cannot fit either; after a
                refused node of one page the call ends). One large node never holds up
                the copies behind it. It runs inside the call: it must not call
                the cache. If it raises or returns a bad value, the node stays due and the
                error propagates; an error raised after it answered carries the answer in
                its ``host_indices`` attribute, as in ``evict``: the engine frees those
                host slots.

        Returns:
            The number of tokens copied.

        Raises:
            TypeError: ``backup`` is not callable, or returned something else than None or
                an int64 tensor.
            ValueError: the cache has no host tier, or ``backup`` returned a tensor that is
                not 1-D, of another length than the node's, or without data (meta or
                sparse).
            RuntimeError: the cache was called from inside one of its own calls or from
                another thread meanwhile.
        """
        if not callable(backup):
            raise TypeError(f"backup must be callable, got {type(backup).__name__}")
        self._need_host_tier("write_through")
        events = self._events
        return self._core.write_through(backup,
                                        None if events is None else events.stored_host)

    def host_size(self) -> int:
        """Tokens with a copy in host memory (host only, or on both tiers).

        Returns:
            The number of tokens.

        Raises:
            ValueError: the cache has no host tier.
        """
        self._need_host_tier("host_size")
        return self._core.host_size

"""SGLang's session radix cache (``--enable-session-radix-cache``) on radixcache's eviction
ranks.

SGLang (``unified_cache/session_ref_tracker.py``, ``components/base.py``, ``full.py``) tags the
leaf a finished, non-aborted request of a session ended its insert on, per session generation:
each session keeps a set of tagged nodes (a new leaf below one of them takes its place), a node
is referenced by every tag at or below it, and eviction takes leaves in the order (session
references, the policy's key). Only leaves are ever evicted, and a leaf's references are the
sessions tagging the leaf itself: so a node's eviction rank here is the number of sessions
tagging it, and the tree core orders its leaves by (rank, policy key) at compiled speed. When
a tagged leaf is evicted its tags move to its parent (SGLang's fallback), unless the parent is
the root or already tagged by that session; ``on_remove`` answers the parent's new rank during
the eviction, so that a parent that becomes a leaf in the same call competes with it.

Generations: ``open_radix_session`` starts a new one (a request of an older one no longer
tags), ``ensure_session_generation`` opens a session the first time a request names it,
``release_radix_session`` drops a session's tags and remembers the id as closed (the last
8,192, as SGLang) so that a request finishing after the close tags nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from ...cache import RadixCache

__all__ = ["SessionRefs"]

#: Closed session ids remembered against a late finish (SGLang's limit).
CLOSED_SESSIONS_KEPT = 8192


class SessionRefs:
    """One cache's session tags, kept as SGLang keeps them, and its nodes' eviction ranks.

    Args:
        cache: The ``RadixCache`` whose nodes are tagged (and ranked).
        enabled: ``--enable-session-radix-cache``: without it nothing is tagged or released
            (generations are still handed out, as SGLang does).
    """

    __slots__ = ("_cache", "enabled", "_closed", "_counter", "_generations", "_tagged",
                 "_tags")

    def __init__(self, cache: RadixCache, enabled: bool) -> None:
        self._cache = cache
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        """Forget every session (the tree was reset: its ranks went with it)."""
        self._closed: OrderedDict = OrderedDict()
        self._counter = 0
        self._generations: dict = {}
        self._tagged: dict = {}  # session id -> the nodes it tags
        self._tags: dict = {}  # node -> the session ids tagging it

    @property
    def tagging(self) -> bool:
        """Whether any node is tagged (evictions then need ``on_remove``)."""
        return bool(self._tags)

    # -- what the scheduler calls ----------------------------------------------------------
    def open(self, session_id: str) -> int:
        """A new generation of ``session_id``; a closed id is open again."""
        self._closed.pop(session_id, None)
        self._counter += 1
        self._generations[session_id] = self._counter
        return self._counter

    def ensure(self, session_id: str) -> int:
        """``session_id``'s generation, opening it if it has none."""
        generation = self._generations.get(session_id)
        if generation is None:
            generation = self.open(session_id)
        return generation

    def release(self, session_id: Optional[str]) -> int:
        """Close ``session_id``: its tags go (its nodes' ranks fall). Returns 0, as SGLang."""
        if not self.enabled or session_id is None or session_id in self._closed:
            return 0
        closed = self._closed
        closed[session_id] = None
        while len(closed) > CLOSED_SESSIONS_KEPT:
            closed.popitem(last=False)
        self._generations.pop(session_id, None)
        for node in tuple(self._tagged.get(session_id, ())):
            self._untag(session_id, node)
        return 0

    def register(self, req: Any, leaf: Any) -> None:
        """A finished, non-aborted request's checkpoint ended on ``leaf``: tag it for the
        request's session, if that session is open in the request's generation."""
        if not self.enabled:
            return
        session = req.session
        if session is not None and session.streaming:
            return
        session_id = req.session_id
        if session_id is None and session is not None:
            session_id = session.session_id
        if session_id is None or session_id in self._closed:
            return
        generation = self._generations.get(session_id)
        if generation is None or req.session_generation != generation:
            return  # a request of an older generation
        root = self._cache.root_node
        if leaf is root:
            return
        tagged = self._tagged.get(session_id)
        if tagged is not None:
            if leaf in tagged:
                return
            ancestor = leaf.parent
            while ancestor is not root and ancestor not in tagged:
                ancestor = ancestor.parent
            self._tag(session_id, leaf)
            if ancestor is not root:  # the new leaf takes its place
                self._untag(session_id, ancestor)
        else:
            self._tag(session_id, leaf)

    # -- eviction ----------------------------------------------------------------------------
    def on_remove(self, node: Any) -> Optional[int]:
        """``RadixCache.evict``'s hook: a tagged victim's tags move to its parent (a session
        that tags the parent already, or a root parent, loses it). Returns the parent's new
        rank (None: unchanged). Runs inside the eviction: it calls nothing of the cache."""
        sessions = self._tags.pop(node, None)
        if sessions is None:
            return None
        parent = node.parent
        inherited = parent is not self._cache.root_node
        parent_tags = self._tags.get(parent) if inherited else None
        for session_id in sessions:
            tagged = self._tagged[session_id]
            tagged.discard(node)
            if inherited and (parent_tags is None or session_id not in parent_tags):
                if parent_tags is None:
                    parent_tags = self._tags[parent] = set()
                parent_tags.add(session_id)
                tagged.add(parent)
            elif not tagged:
                del self._tagged[session_id]
        return len(parent_tags) if parent_tags is not None else None

    # -- tags and ranks ------------------------------------------------------------------------
    def _tag(self, session_id: str, node: Any) -> None:
        tags = self._tags.get(node)
        if tags is None:
            tags = self._tags[node] = set()
        tags.add(session_id)
        self._tagged.setdefault(session_id, set()).add(node)
        self._cache.set_eviction_rank(node, len(tags))

    def _untag(self, session_id: str, node: Any) -> None:
        tags = self._tags[node]
        tags.discard(session_id)
        tagged = self._tagged[session_id]
        tagged.discard(node)
        if not tagged:
            del self._tagged[session_id]
        if not tags:
            del self._tags[node]
        self._cache.set_eviction_rank(node, len(tags))

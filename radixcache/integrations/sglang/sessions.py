"""SGLang's session radix cache (``--enable-session-radix-cache``) on radixcache's eviction
ranks.

SGLang (``unified_cache/session_ref_tracker.py``, ``components/base.py``, ``full.py``) tags the
leaf a finished, non-aborted request of a session ended its insert on, per session generation:
each session keeps a set of tagged nodes (a new leaf below one of them takes its place), a node
is referenced by every tag at or below it, and eviction takes leaves in the order (session
references, the policy's key). Only leaves are ever evicted, and a leaf's references are the
sessions tagging the leaf itself. The tree core keeps the tags (``RadixCache.tag_session``,
each session named by an int of its own here): a tagged node's eviction rank is its number of
sessions, and an evicted tagged leaf gives its tags to its parent (SGLang's fallback) unless
the parent is the root or already tagged by that session, inside the eviction, so that a
parent that becomes a leaf in the same call competes with its new rank.

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

    __slots__ = ("_cache", "enabled", "_closed", "_counter", "_generations", "_handles",
                 "_next_handle")

    def __init__(self, cache: RadixCache, enabled: bool) -> None:
        self._cache = cache
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        """Forget every session (the tree was reset: its tags went with it)."""
        self._closed: OrderedDict = OrderedDict()
        self._counter = 0
        self._generations: dict = {}
        self._handles: dict = {}  # session id -> the int that names it in the tree core
        self._next_handle = 0

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
        handle = self._handles.pop(session_id, None)
        if handle is not None:
            self._cache.untag_session(handle)
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
        handle = self._handles.get(session_id)
        if handle is None:
            handle = self._handles[session_id] = self._next_handle
            self._next_handle += 1
        self._cache.tag_session(leaf, handle)

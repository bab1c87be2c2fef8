"""The bookkeeping of ``KvIndexer``'s copies (a worker's blocks on one tier in one KV-cache
group): each copy's id in the block table (``BlockIndex``), its map of publisher hashes to
block keys (``KeyMap``) and its holdings under their own keys, and the owner tables a query
reads (``CopyTable``).
"""

from __future__ import annotations

from array import array
from typing import Any, Hashable, Optional

from .. import _core
from .._validate import wrap_int64
from .keys import _parent_tier_order


class _Copy:
    """One worker's blocks on one tier and KV-cache group: ``(worker, medium, group)``."""

    __slots__ = ("worker", "medium", "group", "published", "direct", "refs", "cid")

    def __init__(self, worker: Hashable, medium: str, group: Any, published: Any) -> None:
        self.worker = worker
        self.medium = medium
        self.group = group
        # publisher hash -> indexer key, for hashes that are not the key itself (the block
        # module's KeyMap: 16 bytes a hash, whatever its type); a block published under its
        # own key (a ``fast64`` publisher) is held without an entry
        self.published = published
        self.direct = 0  # holdings published under their own key (no ``published`` entry)
        # indexer key -> how many ``published`` hashes name it; kept only while the copy
        # holds blocks both ways (None otherwise), to tell its own-key holdings apart
        self.refs: Optional[dict] = None
        self.cid = -1  # its id in the indexer's BlockIndex, set by CopyTable._copy

    @property
    def size(self) -> int:
        """(publisher hash, block) pairs held: one holding each in the BlockIndex."""
        return self.direct + len(self.published)

    def __repr__(self) -> str:
        return f"_Copy({self.worker!r}, {self.medium!r}, {self.group!r})"


class CopyTable:
    """The copies of every worker and the block table they hold blocks in (see the module
    docstring); ``EventIngest`` applies events to them, ``KvIndexer`` answers from them."""

    def __init__(self) -> None:
        # indexer key -> the ids (``_Copy.cid``) of the copies holding it, a copy once per
        # publisher hash that maps to the block: the block module's BlockIndex (compiled when
        # built); copy ids are reused once their copy is dropped
        self._index = _core.blocks.BlockIndex()
        self._key_map = _core.blocks.KeyMap  # publisher hash maps, same module
        self._free_cids: list = []
        self._held = 0  # the copies' holdings, together: the table's pairs
        self._next_cid = 0
        self._owner_tables: dict = {}  # medium -> (owners by copy id, workers); see _owners
        self._cid_version = 0  # changes with the copies (the owner tables' validity)
        # worker -> its _Copy, or {(medium, group): _Copy} when it has several; only copies
        # holding at least one block
        self._copies: dict = {}
        # indexer key -> the extra-keys entry of its sequence's namespace, for blocks stored
        # with per-block extra keys under a namespace: a key's namespace is fixed by the
        # key, so an entry is never wrong, only kept a while after its block left
        self._ns_of: dict = {}

    # -- workers -----------------------------------------------------------------------
    @staticmethod
    def _check_worker(worker: Hashable) -> None:
        try:
            hash(worker)
        except TypeError:
            raise TypeError(f"worker must be a hashable id, got {type(worker).__name__}") from None
        if worker is None:
            raise TypeError("worker must be a hashable id, not None")

    def _copy(self, worker: Hashable, medium: str, group: Any) -> _Copy:
        """``worker``'s copy on (medium, group), made when missing."""
        copy = self._find(worker, medium, group)
        if copy is None:
            copy = _Copy(worker, medium, group, self._key_map())
            self._new_cid(copy)
            current = self._copies.get(worker)
            if current is None:
                self._copies[worker] = copy  # one copy: no map of them (the usual case)
            elif type(current) is _Copy:
                self._copies[worker] = {(current.medium, current.group): current,
                                        (medium, group): copy}
            else:
                current[(medium, group)] = copy
        return copy

    def _find(self, worker: Hashable, medium: str, group: Any) -> Optional[_Copy]:
        current = self._copies.get(worker)
        if type(current) is _Copy:
            return current if current.medium == medium and current.group == group else None
        return None if current is None else current.get((medium, group))

    def _copies_of(self, worker: Hashable) -> list:
        current = self._copies.get(worker)
        if current is None:
            return []
        return [current] if type(current) is _Copy else list(current.values())

    def _all_copies(self) -> list:
        return [c for w in self._copies for c in self._copies_of(w)]

    def _forget_if_empty(self, copy: _Copy) -> None:
        if not copy.size:
            self._drop_cid(copy)
            current = self._copies.get(copy.worker)
            if current is copy:
                del self._copies[copy.worker]
            elif type(current) is dict and current.get((copy.medium, copy.group)) is copy:
                del current[(copy.medium, copy.group)]
                if len(current) == 1:
                    self._copies[copy.worker], = current.values()

    def _clear_copy(self, copy: _Copy) -> None:
        self._held -= copy.size
        if copy.size:
            self._index.clear_copy(copy.cid)
        copy.published.clear()
        copy.direct = 0
        copy.refs = None
        self._drop_cid(copy)

    def _refs(self, copy: _Copy) -> dict:
        """``copy.refs``, counted from ``copy.published`` when not kept yet."""
        refs = copy.refs
        if refs is None:
            refs = copy.refs = {}
            for key in copy.published.values():
                refs[key] = refs.get(key, 0) + 1
        return refs

    def _own(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """The key ``copy`` holds under ``block_hash`` as the block's own key (no
        ``published`` entry: one of its holdings of that key is not some other hash's), or
        None. An int hash names the key equal to it modulo 2**64, as ``KeyMap`` compares
        int hashes (a publisher may spell a 64-bit key unsigned)."""
        if not copy.direct or type(block_hash) is not int:
            return None
        key = wrap_int64(block_hash)
        if not copy.published:
            return key if self._index.holds(key, copy.cid) else None
        named = self._refs(copy).get(key, 0)
        return key if self._index.holders(key).count(copy.cid) > named else None

    def _publish(self, copy: _Copy, block_hash: Any, key: int) -> None:
        copy.published.put(block_hash, key)
        refs = copy.refs
        if refs is not None:
            refs[key] = refs.get(key, 0) + 1

    def _unpublish(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """Forget ``block_hash`` in ``copy.published``: the key it named, or None."""
        key = copy.published.pop(block_hash)
        refs = copy.refs
        if key is not None and refs is not None:
            if not copy.published:
                copy.refs = None
            elif refs[key] == 1:
                del refs[key]
            else:
                refs[key] -= 1
        return key

    def _key_of(self, copy: _Copy, block_hash: Any) -> Optional[int]:
        """The indexer key ``copy`` holds under publisher hash ``block_hash``, or None."""
        key = copy.published.get(block_hash)
        if key is None:
            key = self._own(copy, block_hash)  # published under its own key
        return key

    def _parent_on_other_tier(self, worker: Hashable, group: Any, copy: Optional[_Copy],
                              parent: Any) -> Optional[int]:
        """The key of ``parent`` as another tier of ``worker`` (same group) holds it, or None.

        A host copy of a block is often made while its parent is only on the device (the
        leaves leave the device first), so its ``BlockStored`` names a parent this tier does
        not hold. Keys come from the tokens alone, so the other tier's key is this one's.
        Should the tiers name different blocks by that hash (a publisher that reused it),
        the device's wins, then the host's, then the other tiers' by name."""
        others = [other for other in self._copies_of(worker)
                  if other is not copy and other.group == group]
        if len(others) > 1:
            others.sort(key=_parent_tier_order)
        for other in others:
            key = self._key_of(other, parent)
            if key is not None:
                return key
        return None

    def _clear_worker(self, worker: Hashable) -> None:
        for copy in self._copies_of(worker):
            self._clear_copy(copy)  # drops its id too
        self._copies.pop(worker, None)
        self._prune_namespaces()

    def _prune_namespaces(self) -> None:
        """Forget the namespaces of blocks no longer held, once they are most of them."""
        ns_of = self._ns_of
        if len(ns_of) > 2 * len(self._index) + 1024:
            holders = self._index.holders
            self._ns_of = {key: entry for key, entry in ns_of.items() if holders(key)}

    def _new_cid(self, copy: _Copy) -> None:
        if self._free_cids:
            copy.cid = self._free_cids.pop()
        else:
            copy.cid = self._next_cid
            self._next_cid += 1
        self._cid_version += 1
        self._owner_tables.clear()

    def _drop_cid(self, copy: _Copy) -> None:
        # The copy is being dropped, holding nothing: its id may serve another copy, once
        # no block refers to it. The copies' counts add up to the table's holdings
        # (``_held``) unless one drifted; then this id's holdings are cleared before reuse.
        if copy.cid >= 0:
            if self._index.pairs != self._held:
                self._index.clear_copy(copy.cid)
            self._free_cids.append(copy.cid)
            copy.cid = -1
            self._cid_version += 1
            self._owner_tables.clear()

    def _owners(self, medium: Any) -> tuple:
        """``(owners, workers, owners as int64 bytes)`` for ``BlockIndex.overlap``:
        ``owners[cid]`` is the position in ``workers`` of the worker of the copy ``cid`` if it
        is on ``medium`` (a tier, a tuple of tiers: a block counts when the worker holds it
        on any of them, or None: every tier), else -1."""
        media = medium if type(medium) is tuple or medium is None else (medium,)
        table = self._owner_tables.get(medium)
        if table is None:
            version = self._cid_version
            owners = array("q", [-1]) * self._next_cid
            workers: list = []
            slots: dict = {}
            for copy in self._all_copies():
                if (media is None or copy.medium in media) and copy.cid >= 0:
                    slot = slots.get(copy.worker)
                    if slot is None:
                        slot = slots[copy.worker] = len(workers)
                        workers.append(copy.worker)
                    owners[copy.cid] = slot
            table = (owners, workers, owners.tobytes())
            if version == self._cid_version:  # a worker id's __eq__ changed no copy
                self._owner_tables[medium] = table
        return table


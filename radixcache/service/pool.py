"""Blocks known only by their standard sequence hashes: what an RFC #1527 publisher sends
without token ids (Mooncake's store master: one object a block, in its host or disk pool).
Such a pool serves every instance of its scope, as Mooncake's conductor counts it: a block
in the pool extends any instance's prefix on that tier.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

#: The tiers a pool holds blocks on.
POOL_TIERS = ("CPU", "DISK")


class PoolBlocks:
    """``(lora, salt) -> {sequence hash: {holder: set of tiers}}``, with each holder's own
    list for clearing it. Not thread-safe (the service's lock guards it)."""

    def __init__(self) -> None:
        self._blocks: dict = {}
        self._held: dict = {}  # holder -> {(identity, seq, tier)}

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    def store(self, holder: Hashable, identity: tuple, seqs: list, tier: str) -> int:
        """Record ``seqs`` held by ``holder`` on ``tier``; returns how many were new."""
        blocks = self._blocks.setdefault(identity, {})
        mine = self._held.setdefault(holder, set())
        added = 0
        for seq in seqs:
            tiers = blocks.setdefault(seq, {}).setdefault(holder, set())
            if tier not in tiers:
                tiers.add(tier)
                mine.add((identity, seq, tier))
                added += 1
        return added

    def remove(self, holder: Hashable, identity: tuple, seqs: list, tier: str) -> int:
        """Forget ``seqs`` on ``tier`` for ``holder``; returns how many it held."""
        mine = self._held.get(holder)
        if mine is None:
            return 0
        removed = 0
        for seq in seqs:
            entry = (identity, seq, tier)
            if entry in mine:
                mine.discard(entry)
                self._drop(holder, identity, seq, tier)
                removed += 1
        if not mine:
            del self._held[holder]
        return removed

    def clear(self, holder: Hashable) -> int:
        """Forget everything ``holder`` held; returns how many (block, tier) pairs."""
        mine = self._held.pop(holder, set())
        for identity, seq, tier in mine:
            self._drop(holder, identity, seq, tier)
        return len(mine)

    def _drop(self, holder: Hashable, identity: tuple, seq: int, tier: str) -> None:
        blocks = self._blocks[identity]
        holders = blocks[seq]
        tiers = holders[holder]
        tiers.discard(tier)
        if not tiers:
            del holders[holder]
            if not holders:
                del blocks[seq]
                if not blocks:
                    del self._blocks[identity]

    def count(self, holder: Hashable, tier: Optional[str] = None) -> int:
        """How many (block, tier) pairs ``holder`` holds (on ``tier``)."""
        mine = self._held.get(holder, ())
        return sum(1 for entry in mine if tier is None or entry[2] == tier)

    def has(self, identity: tuple) -> bool:
        return identity in self._blocks

    def run(self, identity: tuple, seqs: list, start: int, tier: str,
            holders: Any = None) -> int:
        """How many of ``seqs[start:]``, from the first, some holder (of ``holders``, or
        any) has on ``tier``."""
        blocks = self._blocks.get(identity)
        if not blocks:
            return 0
        n = 0
        for seq in seqs[start:]:
            entry = blocks.get(seq)
            if not entry or not any(tier in tiers for holder, tiers in entry.items()
                                    if holders is None or holder in holders):
                break
            n += 1
        return n

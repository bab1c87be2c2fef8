"""The engines' blocks by their standard sequence hashes (``--hash-index``): what
``/query_by_hash`` reads for publishers that send token ids but hash blocks their own way
(vLLM, SGLang). Each stored block's local hash (XXH3-64 of its tokens as ``u32``) is rolled
from its parent's sequence hash, so a block gets the hash the document's standard gives its
whole prefix; with the default seed (1337) the local hashes are also Dynamo's, so Dynamo's
``/query_by_hash`` finds the same blocks.

The hashes have no namespace: a block's LoRA and salt (its identity, as ``identity`` defines
it) keep blocks of different identities apart. A publisher hash maps to its block for the
publisher's every tier, and each (publisher hash, tier) is one holding, as in ``KvIndexer``:
a block stays held on a tier while one of its publisher hashes holds it there. A block whose
parent the publisher does not hold, or whose tokens are no ``u32``, is skipped (counted).

It costs what the index avoids: the batches decoded into events and the blocks hashed in
Python, and dicts of every (block, worker) (see docs/service.md for the figures).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

from .stdhash import local_hashes, roll


class HashIndex:
    """``(identity, sequence hash) -> {worker: {tier: holdings}}``, with each worker's map of
    publisher hashes. Not thread-safe (the service's lock guards it)."""

    def __init__(self, block_size: int, seed: int, family: str,
                 default: tuple = (None, None)) -> None:
        self.block_size, self.seed, self.family, self.default = block_size, seed, family, default
        self._held: dict = {}  # (identity, seq) -> {worker: {tier: count}}
        self._published: dict = {}  # worker -> {publisher hash: [identity, seq, set of tiers]}
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, worker: Hashable, events: Any) -> None:
        """Apply one batch of ``worker``'s events (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``, as ``decode_batch`` gives them)."""
        from ..events import BlockRemoved, BlockStored

        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event.block_hashes, _tier(event.medium))
            else:
                self.clear(worker)

    def _identity(self, event: Any) -> tuple:
        """A root event's (lora, salt), its own or the registration's."""
        lora = event.lora_name or None
        salt = getattr(event, "cache_salt", None) or None
        if self.family == "vllm" and event.extra_keys:
            first = event.extra_keys[0] or ()
            rest = list(first[1:] if lora is not None and first[:1] == (lora,) else first)
            salt = rest[0] if len(rest) == 1 and isinstance(rest[0], str) else None
            if len(rest) > 1 or (rest and salt is None):
                return ("\x00extra",)  # keys the standard cannot spell (an image's)
        return (lora or self.default[0], salt or self.default[1])

    def _stored(self, worker: Hashable, event: Any) -> None:
        published = self._published.setdefault(worker, {})
        tier = _tier(event.medium)
        if event.block_size != self.block_size:
            self.skipped += 1
            return
        if event.parent_block_hash is None:
            identity, parent = self._identity(event), None
        else:
            entry = published.get(_key(event.parent_block_hash))
            if entry is None:
                self.skipped += 1  # a parent this publisher does not hold: as the index
                return
            identity, parent = entry[0], entry[1]
        if len(identity) != 2 or (self.family == "vllm" and event.extra_keys and any(
                _foreign(keys, identity, i) for i, keys in enumerate(event.extra_keys))):
            self.skipped += 1
            return
        try:
            seqs = roll(local_hashes(event.token_ids, self.block_size, self.seed), self.seed,
                        parent)
        except (OverflowError, TypeError):
            self.skipped += 1
            return
        for block_hash, seq in zip(event.block_hashes, seqs):
            entry = published.get(_key(block_hash))
            if entry is None:
                entry = published[_key(block_hash)] = [identity, seq, set()]
            elif entry[1] != seq:
                continue  # the hash names another block already: the first one stands
            if tier not in entry[2]:
                entry[2].add(tier)
                tiers = self._held.setdefault((identity, seq), {}).setdefault(worker, {})
                tiers[tier] = tiers.get(tier, 0) + 1
        if not published:
            del self._published[worker]

    def _removed(self, worker: Hashable, hashes: Any, tier: str) -> None:
        published = self._published.get(worker)
        if not published:
            return
        for block_hash in hashes:
            entry = published.get(_key(block_hash))
            if entry is None or tier not in entry[2]:
                continue
            entry[2].discard(tier)
            self._unhold(worker, entry[0], entry[1], tier)
            if not entry[2]:
                del published[_key(block_hash)]
        if not published:
            del self._published[worker]

    def _unhold(self, worker: Hashable, identity: tuple, seq: int, tier: str) -> None:
        holders = self._held[(identity, seq)]
        tiers = holders[worker]
        tiers[tier] -= 1
        if not tiers[tier]:
            del tiers[tier]
            if not tiers:
                del holders[worker]
                if not holders:
                    del self._held[(identity, seq)]

    def clear(self, worker: Hashable) -> None:
        """Forget every block ``worker`` held."""
        for identity, seq, tiers in self._published.pop(worker, {}).values():
            for tier in tiers:
                self._unhold(worker, identity, seq, tier)

    def runs(self, identity: tuple, seqs: list, start: int, tier: str) -> dict:
        """``{worker: how many of seqs[start:] it holds on tier, from the first}``."""
        found: dict = {}
        active: Optional[set] = None
        for depth, seq in enumerate(seqs[start:]):
            holders = self._held.get((identity, seq))
            here = {w for w, tiers in holders.items() if tier in tiers} if holders else set()
            if active is None:
                active = here
            else:
                for worker in active - here:
                    found[worker] = depth
                active &= here
            if not active:
                break
        else:
            depth = len(seqs) - start
            for worker in active or ():
                found[worker] = depth
        return found


def _tier(medium: Optional[str]) -> str:
    return "CPU" if medium == "CPU_PINNED" else (medium or "GPU")


def _key(block_hash: Any) -> Any:
    """A publisher hash as a key: ints by their value mod 2**64, as the index tells them."""
    return block_hash & ((1 << 64) - 1) if type(block_hash) is int else block_hash


def _foreign(keys: Any, identity: tuple, i: int) -> bool:
    """Whether a block's vLLM extra keys hold more than its LoRA and its sequence's salt."""
    lora, salt = identity
    allowed = ((lora,) if lora else ()) + ((salt,) if salt and i == 0 else ())
    return bool(keys) and tuple(keys) != allowed and tuple(keys) != allowed[:1]

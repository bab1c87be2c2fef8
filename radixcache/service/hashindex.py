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
    """``identity -> {sequence hash: {worker: holdings}}``, with each worker's map of
    publisher hashes. Compact: a worker's holdings of a block are one int (a byte of count per
    tier), a publisher hash maps to one int (the block's sequence hash, its identity's number,
    the tiers it holds). Not thread-safe (the service's lock guards it)."""

    def __init__(self, block_size: int, seed: int, family: str,
                 default: tuple = (None, None)) -> None:
        self.block_size, self.seed, self.family, self.default = block_size, seed, family, default
        self._held: dict = {}  # identity number -> {seq: {worker: a count byte per tier}}
        self._published: dict = {}  # worker -> {publisher hash: seq << 16 | identity << 8 | tiers}
        self._identities: dict = {}  # identity -> its number (< 256)
        self._tiers: dict = {"GPU": 0, "CPU": 1, "DISK": 2}  # tier -> its bit (< 8)
        self.skipped = 0

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._held.values())

    def _tier_bit(self, medium: Optional[str]) -> Optional[int]:
        tier = _tier(medium)
        bit = self._tiers.get(tier)
        if bit is None and len(self._tiers) < 8:
            bit = self._tiers[tier] = len(self._tiers)
        return bit

    def apply(self, worker: Hashable, events: Any) -> None:
        """Apply one batch of ``worker``'s events (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``, as ``decode_batch`` gives them)."""
        from ..events import BlockRemoved, BlockStored

        for event in events:
            if isinstance(event, BlockStored):
                self._stored(worker, event)
            elif isinstance(event, BlockRemoved):
                self._removed(worker, event.block_hashes, self._tier_bit(event.medium))
            else:
                self.clear(worker)

    def _identity(self, event: Any) -> Optional[tuple]:
        """A root event's (lora, salt), its own or the registration's; None for keys the
        standard cannot spell (an image's)."""
        lora = event.lora_name or None
        salt = getattr(event, "cache_salt", None) or None
        if self.family == "vllm" and event.extra_keys:
            first = event.extra_keys[0] or ()
            rest = list(first[1:] if lora is not None and first[:1] == (lora,) else first)
            salt = rest[0] if len(rest) == 1 and isinstance(rest[0], str) else None
            if len(rest) > 1 or (rest and salt is None):
                return None
        return (lora or self.default[0], salt or self.default[1])

    def _number(self, identity: tuple) -> Optional[int]:
        number = self._identities.get(identity)
        if number is None and len(self._identities) < 256:
            number = self._identities[identity] = len(self._identities)
        return number

    def _stored(self, worker: Hashable, event: Any) -> None:
        bit = self._tier_bit(event.medium)
        published = self._published.setdefault(worker, {})
        if event.block_size != self.block_size or bit is None:
            self.skipped += 1
            return
        if event.parent_block_hash is None:
            identity = self._identity(event)
            number = None if identity is None else self._number(identity)
            parent = None
        else:
            entry = published.get(_key(event.parent_block_hash))
            if entry is None:
                self.skipped += 1  # a parent this publisher does not hold: as the index
                return
            number, parent = (entry >> 8) & 0xFF, entry >> 16
            identity = next(i for i, n in self._identities.items() if n == number)
        if number is None or (self.family == "vllm" and event.extra_keys and any(
                _foreign(keys, identity, i) for i, keys in enumerate(event.extra_keys))):
            self.skipped += 1
            return
        try:
            seqs = roll(local_hashes(event.token_ids, self.block_size, self.seed), self.seed,
                        parent)
        except (OverflowError, TypeError):
            self.skipped += 1
            return
        held = self._held.setdefault(number, {})
        flag, unit = 1 << bit, 1 << (8 * bit)
        for block_hash, seq in zip(event.block_hashes, seqs):
            key = _key(block_hash)
            entry = published.get(key)
            if entry is None:
                entry = seq << 16 | number << 8
            elif entry >> 16 != seq or (entry >> 8) & 0xFF != number:
                continue  # the hash names another block already: the first one stands
            if entry & flag:
                continue  # held there already: a duplicate
            published[key] = entry | flag
            holders = held.get(seq)
            if holders is None:
                held[seq] = {worker: unit}
            elif (holders.get(worker, 0) >> (8 * bit)) & 0xFF < 0xFF:
                holders[worker] = holders.get(worker, 0) + unit

    def _removed(self, worker: Hashable, hashes: Any, bit: Optional[int]) -> None:
        published = self._published.get(worker)
        if not published or bit is None:
            return
        flag = 1 << bit
        for block_hash in hashes:
            key = _key(block_hash)
            entry = published.get(key)
            if entry is None or not entry & flag:
                continue
            entry &= ~flag
            self._unhold(worker, (entry >> 8) & 0xFF, entry >> 16, bit)
            if entry & 0xFF:
                published[key] = entry
            else:
                del published[key]

    def _unhold(self, worker: Hashable, number: int, seq: int, bit: int) -> None:
        blocks = self._held[number]
        holders = blocks[seq]
        left = holders[worker] - (1 << (8 * bit))
        if left:
            holders[worker] = left
        else:
            del holders[worker]
            if not holders:
                del blocks[seq]

    def clear(self, worker: Hashable) -> None:
        """Forget every block ``worker`` held."""
        for entry in self._published.pop(worker, {}).values():
            for bit in range(8):
                if entry & (1 << bit):
                    self._unhold(worker, (entry >> 8) & 0xFF, entry >> 16, bit)

    def runs(self, identity: tuple, seqs: list, start: int, tier: str) -> dict:
        """``{worker: how many of seqs[start:] it holds on tier, from the first}``."""
        number = self._identities.get(identity)
        bit = self._tiers.get(tier)
        blocks = self._held.get(number) if number is not None else None
        if not blocks or bit is None:
            return {}
        shift = 8 * bit
        found: dict = {}
        active: Optional[set] = None
        for depth, seq in enumerate(seqs[start:]):
            holders = blocks.get(seq)
            here = {w for w, c in holders.items() if (c >> shift) & 0xFF} if holders else set()
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

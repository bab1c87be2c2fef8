"""What a query answers, computed from the groups' indexes and the pools, as Mooncake's
conductor computes it: for each data-parallel rank of an instance, a cursor walks the
prompt's blocks on the rank's device tier (``GPU``), goes on through blocks on the host
tier (``CPU``: the instance's own host copies, or any pool of the scope), then on disk
(``DISK``); each tier's figure is where the cursor stood when that tier ended. So ``CPU`` and
``DISK`` count the whole prefix reachable through the tiers up to theirs (``GPU <= CPU <=
DISK``), ``longest_matched`` is ``DISK``, an instance's tier figures are its best rank's,
and ``DP`` gives each rank's ``GPU``. All in tokens (blocks times the block size).
"""

from __future__ import annotations

from typing import Any, Optional

from .identity import identities, query_key

#: The tiers the cursor walks after the device, in order.
LOWER_TIERS = ("CPU", "DISK")


class Hits:
    """One instance's answer, in tokens: ``gpu``, ``cpu``, ``disk`` (its best rank's),
    ``longest`` (``disk``) and ``dp`` (each rank's ``gpu``)."""

    __slots__ = ("gpu", "cpu", "disk", "dp")

    def __init__(self, gpu: int = 0, cpu: int = 0, disk: int = 0,
                 dp: Optional[dict] = None) -> None:
        self.gpu, self.cpu, self.disk = gpu, cpu, disk
        self.dp = {} if dp is None else dp

    @property
    def longest(self) -> int:
        return self.disk

    def add_rank(self, rank: int, gpu: int, cpu: int, disk: int) -> None:
        """Another rank's figures (or the same rank's through another identity)."""
        if gpu > self.dp.get(rank, -1):
            self.dp[rank] = gpu
        if gpu > self.gpu:
            self.gpu = gpu
        if cpu > self.cpu:
            self.cpu = cpu
        if disk > self.disk:
            self.disk = disk

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Hits) and (self.gpu, self.cpu, self.disk, self.dp) == (
            other.gpu, other.cpu, other.disk, other.dp)

    def __repr__(self) -> str:
        return f"Hits(gpu={self.gpu}, cpu={self.cpu}, disk={self.disk}, dp={self.dp})"


def tiers(blocks: Any) -> tuple:
    """A worker's ``(gpu, cpu, disk)`` blocks, from the tuple or the int (the same on every
    tier) ``group_blocks`` gives."""
    return (blocks, blocks, blocks) if type(blocks) is int else blocks


def hits_of(rows: list, block_size: int) -> dict:
    """``{instance_id: Hits}`` of ``IndexService.query_rows``' ``(rows, block_size)``: the
    figures ``query_answer`` writes, as objects."""
    out: dict = {}
    for (instance, _, rank), blocks in rows:
        gpu, cpu, disk = (b * block_size for b in tiers(blocks))
        hits = out.get(instance)
        if hits is None:
            out[instance] = Hits(gpu, cpu, disk, {rank: gpu})
        else:
            hits.add_rank(rank, gpu, cpu, disk)
    return out


class _Runs:
    """Runs of the prompt's keys held on a tier from a position, per worker: one lookup per
    (position, tier), shared by the workers that stand there."""

    def __init__(self, indexer: Any, keys: list) -> None:
        self.indexer, self.keys, self.cache = indexer, keys, {}

    def __call__(self, pos: int, tier: str) -> dict:
        runs = self.cache.get((pos, tier))
        if runs is None:
            runs = self.cache[(pos, tier)] = (
                self.indexer.overlap_keys(self.keys[pos:], tier) if pos < len(self.keys)
                else {})
        return runs


def _walk(worker: Any, start: int, own: Optional[_Runs], pool: Any, identity: tuple,
          seqs: Optional[list], holders: Any) -> tuple:
    """The cursor of ``worker`` from its device depth ``start`` through the lower tiers:
    at each step it takes the longer of its own run and the pool's from where it stands."""
    out = [start]
    pos = start
    for tier in LOWER_TIERS:
        while True:
            step = own(pos, tier).get(worker, 0) if own is not None else 0
            if seqs is not None and pos < len(seqs):
                step = max(step, pool.run(identity, seqs, pos, tier, holders))
            if not step:
                break
            pos += step
        out.append(pos)
    return tuple(out)


def group_blocks(group: Any, tokens: Any, lora: Optional[str], salt: Optional[str],
                 pool: Any = None, pool_holders: Any = None, seqs_of: Any = None) -> dict:
    """``{worker: (gpu, cpu, disk) blocks}`` of ``group``'s workers that hold any of the
    prompt (or that a pool extends), for the blocks of identity ``lora``/``salt``; a
    worker's figure is one int when the group has no other tier than the device and no
    pool extends it (``tiers`` reads either).

    ``seqs_of()`` gives the prompt's standard sequence hashes, asked for only when a pool
    of the scope holds blocks of that identity.
    """
    indexer = group.indexer
    n_blocks = len(tokens) // group.block_size
    best: dict = {}
    for lo, sa in identities(lora, salt, group.lora, group.salt):
        extra_key, block_extra = query_key(group.family, lo, sa, n_blocks)
        device = indexer.overlap(tokens, extra_key, block_extra_keys=block_extra)
        identity = (lo or group.lora, sa or group.salt)
        seqs = seqs_of() if pool is not None and pool.has(identity) else None
        tiered = group.tiered
        if not tiered and seqs is None:
            found = device
        else:
            own = (_Runs(indexer, indexer.block_keys(tokens, extra_key, block_extra))
                   if tiered else None)
            found = {}
            for worker in group.workers:
                start = device.get(worker, 0)
                blocks = _walk(worker, start, own if worker in tiered else None, pool,
                               identity, seqs, pool_holders)
                if blocks[2]:
                    found[worker] = blocks
        if not best:
            best = found  # the first identity's (usually the only one): nothing to merge
            continue
        for worker, blocks in found.items():
            old = best.get(worker)
            best[worker] = blocks if old is None else tuple(map(max, tiers(old),
                                                                tiers(blocks)))
    return best


def hash_blocks(group: Any, seqs: list, lora: Optional[str], salt: Optional[str],
                pool: Any = None, pool_holders: Any = None) -> dict:
    """``group_blocks`` for a prompt known by its standard sequence hashes only: the
    group's ``HashIndex`` (``--hash-index``) gives each worker's tiers, the pools theirs."""
    index = group.hashes
    best: dict = {}
    seen = set()
    for lo, sa in identities(lora, salt, group.lora, group.salt):
        identity = (lo or group.lora, sa or group.salt)
        if identity in seen:
            continue
        seen.add(identity)
        cache: dict = {}

        def own(pos: int, tier: str, identity: tuple = identity, cache: dict = cache) -> dict:
            runs = cache.get((pos, tier))
            if runs is None:
                runs = cache[(pos, tier)] = index.runs(identity, seqs, pos, tier)
            return runs

        device = own(0, "GPU") if index is not None else {}
        pooled = pool is not None and pool.has(identity)
        if index is None and not pooled:
            continue
        for worker in group.workers:
            blocks = _walk(worker, device.get(worker, 0), own if index is not None else None,
                           pool, identity, seqs if pooled else None, pool_holders)
            if blocks[2]:
                old = best.get(worker)
                best[worker] = blocks if old is None else tuple(map(max, old, blocks))
    return best

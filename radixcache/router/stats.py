"""``IndexerStats``: what ``KvIndexer`` applied and what it had to skip."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class IndexerStats:
    """What ``KvIndexer`` applied and what it had to skip (counts since creation).

    Attributes:
        batches: Event batches applied (``apply`` calls).
        events: Events seen.
        stored_blocks: Blocks added for a worker.
        removed_blocks: Blocks removed for a worker.
        cleared: ``AllBlocksCleared`` events applied.
        duplicate_blocks: Blocks stored again by a worker that already held them (no change).
        unknown_parent: ``BlockStored`` events skipped because their parent block is unknown.
        unknown_removals: Removed blocks the worker was not known to hold.
        wrong_block_size: ``BlockStored`` events skipped: not the indexer's block size.
        malformed_events: Events skipped: not an event, or inconsistent fields.
        malformed_batches: Wire payloads that could not be decoded.
        restarts: Restarted publishers whose blocks were dropped.
        store_errors: Calls to the store (``KvIndexer(store=...)``) that failed: it could
            not be reached, or refused a write (out of memory).
        blind_lookups: Lookups answered ``{}`` (cache-blind routing) because the store
            failed.
        stale_batches: Batches skipped: not newer than the worker's stored sequence number
            (already applied, by this router or another).
        foreign_batches: Batches skipped: another router owns the worker's ingest.
        collected_workers: Workers whose lease expired, their blocks collected.
    """

    batches: int = 0             #: event batches applied (``apply`` calls)
    events: int = 0              #: events seen
    stored_blocks: int = 0       #: blocks added for a worker
    removed_blocks: int = 0      #: blocks removed for a worker
    cleared: int = 0             #: ``AllBlocksCleared`` applied
    duplicate_blocks: int = 0    #: stored again by a worker that already held it (no change)
    unknown_parent: int = 0      #: ``BlockStored`` skipped: its parent block is unknown
    unknown_removals: int = 0    #: removed blocks the worker was not known to hold
    wrong_block_size: int = 0    #: ``BlockStored`` skipped: not the indexer's block size
    malformed_events: int = 0    #: events skipped: not an event, or inconsistent fields
    malformed_batches: int = 0   #: wire payloads that could not be decoded
    restarts: int = 0            #: restarted publishers whose blocks were dropped
    store_errors: int = 0        #: store calls that failed (unreachable, or out of memory)
    blind_lookups: int = 0       #: lookups answered ``{}`` because the store failed
    stale_batches: int = 0       #: batches not newer than the stored sequence: skipped
    foreign_batches: int = 0     #: batches of a worker another router owns: skipped
    collected_workers: int = 0   #: workers whose lease expired: their blocks collected

    @property
    def skipped(self) -> int:
        """Events or blocks that could not be applied."""
        return (self.unknown_parent + self.unknown_removals + self.wrong_block_size
                + self.malformed_events + self.malformed_batches)

    def as_dict(self) -> dict:
        """The counts by name.

        Returns:
            ``{field name: count}`` for every field, in declaration order.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}


IndexerStats.__module__ = "radixcache.router"  # pickles name the public module, as before

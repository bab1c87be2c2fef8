"""A scenario both the in-process and the Redis index tests run: a block held under its own
key, named by a publisher that spells that key signed and unsigned."""

from __future__ import annotations

from radixcache.events import BlockRemoved, BlockStored, encode_batch

try:
    import msgspec
except ImportError:  # the wire is optional: payloads are then applied as events
    msgspec = None


def negative_key_block(indexer):
    """The tokens of one block whose key (its ``fast64`` hash) is negative, and the key."""
    for first in range(1000):
        tokens = (first,) * indexer.block_size
        (key,) = indexer.block_keys(tokens)
        if key < 0:
            return tokens, key
    raise AssertionError("no negative key among 1,000 blocks")


def apply_via(indexer, via):
    """``apply`` (events), or ``apply_payload`` of the same batch in vLLM's map encoding."""
    if via == "events" or msgspec is None:
        return indexer.apply
    return lambda worker, events: indexer.apply_payload(worker, encode_batch(events, ts=0.0))


def held_under_a_negative_key_and_its_unsigned_spelling(indexer, via, both_ways, unsigned_first):
    """A block whose own key K is negative, published as K and as K + 2**64 (how a publisher
    that sends unsigned 64-bit hashes spells it): one holding, a parent of a child, removed by
    either spelling. Returns the indexer's answers at each step."""
    apply = apply_via(indexer, via)
    tokens, key = negative_key_block(indexer)
    spellings = (key + 2 ** 64, key) if unsigned_first else (key, key + 2 ** 64)
    child = (5,) * indexer.block_size
    steps = []
    if both_ways:  # the copy also holds a block under a hash that is not its key
        apply(0, [BlockStored((b"other",), None, (9,) * indexer.block_size, indexer.block_size)])
    apply(0, [BlockStored((spellings[0],), None, tokens, indexer.block_size)])
    apply(0, [BlockStored((spellings[1],), None, tokens, indexer.block_size)])
    steps.append(("re-stored", indexer.blocks_held(0), indexer.stats.duplicate_blocks))
    apply(0, [BlockStored((77,), spellings[1], child, indexer.block_size)])
    steps.append(("child", indexer.overlap(tokens + child), indexer.stats.unknown_parent))
    apply(0, [BlockRemoved((spellings[1],))])
    steps.append(("removed", indexer.overlap(tokens + child), indexer.blocks_held(0),
                  indexer.stats.removed_blocks, indexer.stats.unknown_removals))
    apply(0, [BlockRemoved((spellings[0],))])  # held once: gone already
    steps.append(("again", indexer.blocks_held(0), indexer.stats.unknown_removals))
    return steps


def negative_key_steps(both_ways):
    """What ``held_under_a_negative_key_and_its_unsigned_spelling`` must answer."""
    extra = 1 if both_ways else 0
    return [("re-stored", 1 + extra, 1), ("child", {0: 2}, 0),
            ("removed", {}, 1 + extra, 1, 0), ("again", 1 + extra, 1)]

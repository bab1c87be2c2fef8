"""``KvIndexer`` against a plain reference model: holdings named by the publisher's hash.

The model keeps, per (worker, tier, group), each publisher hash it holds and the block it
names (namespace, extra keys of every block so far, token prefix), with no hashing and no
shared table; the indexer must answer every ``overlap`` as the model does, on each block
module.
"""

from __future__ import annotations

import pytest

from radixcache import _core
from radixcache.events import BlockRemoved, BlockStored
from radixcache.router import KvIndexer


@pytest.fixture
def indexer_on(blocks, monkeypatch):
    """``KvIndexer`` over one block module (pure, and compiled once built)."""
    monkeypatch.setattr(_core, "blocks", blocks)
    return KvIndexer


def test_a_duplicate_removal_takes_only_the_holding_it_names(indexer_on):
    """A block held under its own key and under another publisher hash: removing the key
    twice takes one holding, the other hash keeps the block, and a worker that comes later
    holds only what it stored."""
    indexer = indexer_on(2)
    tokens = (1, 2, 3, 4)
    fast = indexer.block_keys(tokens)
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    indexer.apply(0, [BlockStored((101, 102), None, tokens, 2)])  # the same blocks again
    assert indexer.blocks_held(0) == 4
    indexer.apply(0, [BlockRemoved((fast[1],)), BlockRemoved((fast[1],))])
    assert indexer.overlap(tokens) == {0: 2}
    assert indexer.stats.removed_blocks == 1 and indexer.stats.unknown_removals == 1
    assert indexer.blocks_held(0) == 3
    indexer.apply(0, [BlockRemoved((fast[0], 102, fast[0]))])
    assert indexer.overlap(tokens) == {0: 1} and indexer.blocks_held(0) == 1
    indexer.apply(0, [BlockRemoved((101,))])
    assert indexer.overlap(tokens) == {} and len(indexer) == 0 and indexer.workers == []
    indexer.apply(1, [BlockStored((7,), None, tokens[:2], 2)])  # may get worker 0's old id
    assert indexer.overlap(tokens) == {1: 1}


def test_a_key_stored_again_under_its_own_hash_is_a_second_holding(indexer_on):
    """A block held under another hash, then stored under its own key: two holdings, and
    removing the other hash leaves the block held."""
    indexer = indexer_on(2)
    tokens = (1, 2, 3, 4)
    fast = indexer.block_keys(tokens)
    indexer.apply(0, [BlockStored((101, 102), None, tokens, 2)])
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    assert indexer.blocks_held(0) == 4 and indexer.stats.duplicate_blocks == 0
    indexer.apply(0, [BlockRemoved((101, 102))])
    assert indexer.overlap(tokens) == {0: 2}
    indexer.apply(0, [BlockStored(tuple(fast), None, tokens, 2)])
    assert indexer.stats.duplicate_blocks == 2
    indexer.apply(0, [BlockRemoved(tuple(fast))])
    assert indexer.overlap(tokens) == {} and indexer.workers == []

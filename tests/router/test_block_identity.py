"""What ``KvIndexer`` takes a block and a query to mean where vLLM's and SGLang's events leave
room: a namespace named by a root without extra keys, a parent hash two other tiers hold, a
group named as None or 0, a one-key namespace tuple, a root named only by ``lora_id``,
extra keys that are all null, ``overlap(medium=None)`` and the order of ``workers``
(docs/events-and-routing.md, "Where the engines leave room"). On each block module, through
events and through the wire.
"""

from __future__ import annotations

import pytest

from radixcache import RadixCache, _core
from radixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)

msgspec = pytest.importorskip("msgspec")

A, B, C = (1, 2), (3, 4), (5, 6)


@pytest.fixture
def indexer_on(blocks, monkeypatch):
    monkeypatch.setattr(_core, "blocks", blocks)
    from radixcache.router import KvIndexer

    return KvIndexer


def feed(indexer, via, worker, events, encoding="map"):
    """``apply`` the events, or ``apply_payload`` them as one payload in ``encoding``."""
    if via == "events":
        indexer.apply(worker, events)
    else:
        assert indexer.apply_payload(worker, encode_batch(events, ts=0.0, encoding=encoding))


VIA = pytest.mark.parametrize("via", ["events", "payloads"])


# -- the namespace of a sequence ---------------------------------------------------------------
@VIA
@pytest.mark.parametrize("salt", [None, "s"])
def test_a_child_with_extra_keys_below_a_root_without_them_is_in_the_roots_namespace(
        indexer_on, via, salt):
    """SGLang's way (the namespace in ``lora_name``/``cache_salt``, no extra keys) at the
    root, vLLM's below it (the namespace's entry on each block, the adapter named too): the
    child is in the root's namespace, as under a root that sent its entry."""
    namespace = "ad" if salt is None else ("ad", salt)
    entry = ("ad",) if salt is None else ("ad", salt)
    named = {"lora_name": "ad", "cache_salt": salt}
    for root in ({**named}, {"lora_name": "ad", "extra_keys": (entry,)}):
        indexer = indexer_on(2)
        feed(indexer, via, 0, [BlockStored((10,), None, A, 2, **root),
                               BlockStored((11,), 10, B, 2, extra_keys=(entry,), **named),
                               BlockStored((12,), 11, C, 2, **named)])
        assert indexer.overlap(A + B + C, namespace) == {0: 3}, root
        assert indexer.overlap(A + B + C, block_extra_keys=[entry] * 3) == {0: 3}
        assert indexer.overlap(A + B + C) == {}


@VIA
def test_a_grandchild_with_extra_keys_below_a_child_without_them_stays_in_the_namespace(
        indexer_on, via):
    indexer = indexer_on(2)
    entry = ("ad",)
    feed(indexer, via, 0, [BlockStored((10,), None, A, 2, lora_name="ad", extra_keys=(entry,)),
                           BlockStored((11,), 10, B, 2, lora_name="ad"),
                           BlockStored((12,), 11, C, 2, lora_name="ad", extra_keys=(entry,))])
    assert indexer.overlap(A + B + C, "ad") == {0: 3}
    # an entry of its own (an image) still makes a block of its own
    feed(indexer, via, 1, [BlockStored((20,), None, A, 2, lora_name="ad"),
                           BlockStored((21,), 20, B, 2, lora_name="ad",
                                       extra_keys=(("ad", "img"),))])
    assert indexer.overlap(A + B, "ad") == {0: 2, 1: 1}
    assert indexer.overlap(A + B, "ad", block_extra_keys=[None, ("ad", "img")]) == {1: 2, 0: 1}


@VIA
def test_a_one_key_tuple_names_the_namespace_of_that_key(indexer_on, via):
    """``extra_key=("x",)`` is the namespace ``"x"``, as a stored first entry ``("x",)`` is;
    ``()`` is no namespace, as an empty entry is none."""
    indexer = indexer_on(2)
    feed(indexer, via, 0, [BlockStored((10, 11), None, A + B, 2, extra_keys=(("x",), ("x",)))])
    feed(indexer, via, 1, [BlockStored((20,), None, A, 2)])
    assert indexer.overlap(A + B, ("x",)) == indexer.overlap(A + B, "x") == {0: 2}
    assert indexer.block_keys(A + B, ("x",)) == indexer.block_keys(A + B, "x")
    assert indexer.overlap(A + B, ()) == indexer.overlap(A + B) == {1: 1}


@VIA
def test_a_root_named_only_by_lora_id_is_in_that_adapters_namespace(indexer_on, via):
    """Blocks of a root that names its adapter only by ``lora_id`` (no ``lora_name``, no
    extra keys: vLLM's events before ``lora_name``, radixcache's fixed ``lora_id``) are that
    adapter's: never the base model's, nor another adapter's."""
    indexer = indexer_on(2)
    feed(indexer, via, 0, [BlockStored((10, 11), None, A + B, 2, lora_id=3)])
    feed(indexer, via, 1, [BlockStored((20, 21), None, A + B, 2, lora_id=4, cache_salt="s")])
    feed(indexer, via, 2, [BlockStored((30,), None, A, 2, lora_id=3, lora_name="ad")])
    assert indexer.overlap(A + B) == {}
    assert indexer.overlap(A + B, 3) == {0: 2}
    assert indexer.overlap(A + B, (4, "s")) == {1: 2}
    assert indexer.overlap(A + B, "ad") == {2: 1}  # a name, when sent, names the adapter


def test_a_cache_serving_one_adapter_is_scoped_by_its_lora_id(indexer_on):
    cache = RadixCache(page_size=2, enable_events=True, event_options={"lora_id": 7})
    cache.insert(list(A + B))
    indexer = indexer_on(2)
    indexer.apply_payload(0, encode_batch(cache.take_events(), ts=0.0))
    assert indexer.overlap(A + B) == {} and indexer.overlap(A + B, 7) == {0: 2}


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_extra_keys_that_are_all_null_count_as_none(indexer_on, encoding):
    """An event whose entries are all null is named by its ``lora_name`` as one with no
    entries is, in either encoding (the positional one drops such entries)."""
    indexer = indexer_on(2)
    event = BlockStored((10, 11), None, A + B, 2, lora_name="ad", extra_keys=(None, None))
    feed(indexer, "payloads", 0, [event], encoding)
    indexer.apply(1, [event])
    assert indexer.overlap(A + B, "ad") == {0: 2, 1: 2}
    assert indexer.overlap(A + B) == {}


def test_the_positional_encoding_refuses_a_salt_it_cannot_carry():
    salted = BlockStored((10,), None, A, 2, cache_salt="s")
    with pytest.raises(ValueError, match="cache_salt"):
        encode_batch([salted], encoding="positional")
    assert decode_batch(encode_batch([salted])).events[0].cache_salt == "s"


# -- copies -------------------------------------------------------------------------------------
@VIA
def test_a_parent_two_other_tiers_name_differently_is_the_devices(indexer_on, via):
    """A hash reused for different blocks on the disk tier (made first) and on the device:
    a host block naming it as parent is below the device's block."""
    indexer = indexer_on(2)
    feed(indexer, via, 0, [BlockStored((10,), None, A, 2, medium="DISK")])
    feed(indexer, via, 0, [BlockStored((10,), None, B, 2, medium="GPU")])
    feed(indexer, via, 0, [BlockStored((11,), 10, C, 2, medium="CPU")])
    assert indexer.stats.unknown_parent == 0
    assert indexer.overlap(B + C, medium=None) == {0: 2}
    assert indexer.overlap(A + C, medium=None) == {0: 1}
    # the host next, then the other tiers by name, whatever order their copies came in
    indexer.apply(1, [BlockStored((10,), None, A, 2, medium="EXTERNAL"),
                      BlockStored((10,), None, B, 2, medium="DISK"),
                      BlockStored((10,), None, C, 2, medium="CPU"),
                      BlockStored((11,), 10, A, 2, medium="GPU")])
    assert indexer.overlap(C + A, medium=None)[1] == 2


@VIA
def test_group_idx_none_and_0_name_the_same_group(indexer_on, via):
    """vLLM numbers a model's KV-cache groups from 0; an event that names no group is in
    the first one."""
    indexer = indexer_on(2)
    feed(indexer, via, 0, [BlockStored((10,), None, A, 2, group_idx=0)])
    feed(indexer, via, 0, [BlockStored((11,), 10, B, 2, medium="CPU")])  # parent on "GPU", 0
    feed(indexer, via, 0, [BlockStored((10,), None, A, 2)])  # the same holding again
    assert indexer.stats.unknown_parent == 0 and indexer.stats.duplicate_blocks == 1
    assert indexer.blocks_held(0) == 2 and indexer.overlap(A + B, medium=None) == {0: 2}
    feed(indexer, via, 0, [BlockRemoved((10,), "GPU", None), BlockRemoved((11,), "CPU", 0)])
    assert indexer.stats.unknown_removals == 0 and indexer.workers == []
    feed(indexer, via, 0, [BlockStored((10,), None, A, 2, group_idx=1),
                           BlockStored((10,), None, A, 2, group_idx=0)])
    assert indexer.blocks_held(0) == 2  # group 1 is another group
    feed(indexer, via, 0, [AllBlocksCleared()])
    assert len(indexer) == 0


# -- queries ------------------------------------------------------------------------------------
def test_overlap_of_medium_none_counts_every_tier(indexer_on):
    """``medium=None`` counts a block held on any tier, as ``blocks_held(worker, None)``
    counts every tier; the default is the device."""
    indexer = indexer_on(2)
    indexer.apply(0, [BlockStored((10, 11), None, A + B, 2)])
    indexer.apply(1, [BlockStored((10,), None, A, 2, medium="CPU")])
    indexer.apply(2, [BlockStored((10,), None, A, 2),
                      BlockStored((11,), 10, B, 2, medium="CPU_PINNED")])
    assert indexer.overlap(A + B, medium=None) == {0: 2, 1: 1, 2: 2}
    assert indexer.overlap(A + B) == indexer.overlap(A + B, medium="GPU") == {0: 2, 2: 1}
    assert indexer.overlap(A + B, medium=None, block_extra_keys=[None, None]) == \
        {0: 2, 1: 1, 2: 2}


def test_workers_come_in_the_order_they_last_began_to_hold_blocks(indexer_on):
    indexer = indexer_on(2)
    for worker in ("a", "b", "c"):
        indexer.apply(worker, [BlockStored((10,), None, A, 2)])
    indexer.apply("a", [BlockRemoved((10,))])  # holds nothing: forgotten
    indexer.apply("a", [BlockStored((10,), None, A, 2)])
    assert indexer.workers == ["b", "c", "a"]

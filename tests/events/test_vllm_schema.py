"""radixcache's published KV events against vLLM's real schema.

Loads the msgspec structs of ``vllm/distributed/kv_events.py`` from a vLLM wheel (fetched by
``tests/fetch_vllm_kv_events.sh``, never committed) with that file's ``vllm.*`` imports
stubbed, and decodes every batch radixcache publishes with vLLM's ``KVEventBatch`` decoder.
Without the file the tests skip; ``.ci/run`` fetches it and sets
``RADIXCACHE_REQUIRE_VLLM_SCHEMA=1`` so that in CI they fail instead.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import random
import sys
import time
import types
from pathlib import Path
from typing import Any, Union

import numpy as np
import pytest

import radixcache.events as ev
from radixcache import RadixCache

try:
    import msgspec
    import zmq
except ImportError:
    msgspec = zmq = None

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = Path(os.environ.get("VLLM_KV_EVENTS_DIR", REPO_ROOT / "tests" / ".vllm"))
SCHEMA_FILE = SCHEMA_DIR / "vllm" / "distributed" / "kv_events.py"
SOCKET_WAIT_S = 10.0

# Names the schema file imports from vllm.* that must be real, not placeholders.
STUB_VALUES = {"ExternalBlockHash": Union[bytes, int]}
FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
          "BlockRemoved": ("block_hashes", "medium", "group_idx"),
          "AllBlocksCleared": ()}


def _stub_modules(source: str) -> dict:
    """Placeholder modules for every ``vllm.*`` import in ``source`` (parents included)."""
    modules: dict = {}

    def module(name: str) -> types.ModuleType:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in modules:
                modules[prefix] = types.ModuleType(prefix)
                modules[prefix].__path__ = []  # a package, so submodules resolve
        return modules[name]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            stub = module(node.module)
            for alias in node.names:
                if alias.name in STUB_VALUES:
                    value = STUB_VALUES[alias.name]
                elif alias.name == "init_logger":
                    value = logging.getLogger
                else:
                    value = type(alias.name, (), {})  # used only outside the structs
                setattr(stub, alias.name, value)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    module(alias.name)
    module("vllm.distributed")
    return modules


@pytest.fixture(scope="module")
def vllm():
    """vLLM's kv_events module, loaded from the fetched file with its imports stubbed."""
    if msgspec is None:
        pytest.skip("pyzmq/msgspec not installed")
    if sys.version_info < (3, 10):
        pytest.skip("vLLM's kv_events.py needs Python >= 3.10 (X | Y annotations)")
    if not SCHEMA_FILE.is_file():
        reason = (f"vLLM's kv_events.py is not at {SCHEMA_FILE}: run "
                  "tests/fetch_vllm_kv_events.sh (or set VLLM_KV_EVENTS_DIR)")
        if os.environ.get("RADIXCACHE_REQUIRE_VLLM_SCHEMA") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    source = SCHEMA_FILE.read_text()
    name = "vllm.distributed.kv_events"
    with pytest.MonkeyPatch.context() as patch:
        for module_name, stub in _stub_modules(source).items():
            patch.setitem(sys.modules, module_name, stub)
        spec = importlib.util.spec_from_file_location(name, SCHEMA_FILE)
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        # Decoders resolve the annotations now, while the stubs are importable.
        module.test_decoder = msgspec.msgpack.Decoder(module.KVEventBatch)
    return module


def check_same(theirs: Any, ours: Any) -> None:
    """vLLM's decoded event carries exactly our event's field values."""
    tag = type(ours).__name__
    assert type(theirs).__name__ == tag
    for field in FIELDS[tag]:
        value = getattr(ours, field)
        # vLLM's list[...] fields decode as lists, its extra_keys entries as tuples.
        if field == "extra_keys" and value is not None:
            value = [None if entry is None else tuple(entry) for entry in value]
        elif isinstance(value, tuple):
            value = list(value)
        assert getattr(theirs, field) == value, (tag, field)


def check_batch(vllm: Any, payload: bytes, events: list, ts: float, rank: Any) -> None:
    batch = vllm.test_decoder.decode(payload)
    assert isinstance(batch, vllm.KVEventBatch)
    assert batch.ts == ts and batch.data_parallel_rank == rank
    assert len(batch.events) == len(events)
    for theirs, ours in zip(batch.events, events):
        check_same(theirs, ours)


NAMESPACES = [None, "tenant", b"\x00raw", 7, -3, np.int64(12), True]


def serve(cache: RadixCache, steps: int, seed: int):
    """A serving loop over several namespaces with inserts, evictions and resets; yields
    each step's events."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    for step in range(steps):
        namespace = rng.choice(NAMESPACES)
        prompt = rng.choice(prompts) + [rng.randrange(300) for _ in range(rng.randrange(0, 12))]
        match = cache.match_prefix(prompt, extra_key=namespace)
        cache.inc_lock_ref(match.last_node)
        if cache.total_size() > 200:
            cache.evict(cache.total_size() - 150)
        cache.insert(prompt + [rng.randrange(300, 600) for _ in range(rng.randrange(1, 9))],
                     extra_key=namespace)
        cache.dec_lock_ref(match.last_node)
        if step % 97 == 96:
            cache.reset()
        yield cache.take_events()


@pytest.mark.parametrize("lora_namespaces", [False, True])
def test_every_batch_of_a_real_cache_decodes_with_vllms_schema(vllm, core_name,
                                                               lora_namespaces):
    cache = RadixCache(page_size=4, enable_events=True, core=core_name,
                       event_options={"lora_namespaces": lora_namespaces})
    seen = {tag: 0 for tag in FIELDS}
    seen_namespaces = set()
    seen_lora = set()
    for step, events in enumerate(serve(cache, 300, seed=4)):
        if not events:
            continue
        payload = ev.encode_batch(events, ts=1000.0 + step, data_parallel_rank=step % 3)
        check_batch(vllm, payload, events, 1000.0 + step, step % 3)
        for event in events:
            seen[type(event).__name__] += 1
            if isinstance(event, ev.BlockStored):
                seen_namespaces.add(ev.event_namespace(event))
                seen_lora.add((event.lora_name, event.lora_id))
        assert ev.decode_batch(payload, step).events == events  # and our decoder agrees
    # The loop really covered stores, evictions, resets and every namespace kind.
    assert min(seen.values()) > 0, seen
    assert seen_namespaces == {None, "tenant", b"\x00raw", 7, -3, 12, 1}
    if lora_namespaces:
        assert seen_lora == {(None, None), ("tenant", None), (None, 7), (None, -3),
                             (None, 12), (None, 1)}
    else:
        assert seen_lora == {(None, None)}


def test_scripted_events_have_vllms_field_values(vllm):
    cache = RadixCache(page_size=2, enable_events=True)
    cache.insert([1, 2, 3, 4, 5], extra_key="a")
    cache.insert([1, 2, 9, 9])
    cache.evict(100)
    cache.reset()
    payload = ev.encode_batch(cache.take_events(), ts=5.5, data_parallel_rank=None)
    batch = vllm.test_decoder.decode(payload)
    first, second, removed_a, removed_b, cleared = batch.events
    a_hashes = ev.block_hashes([1, 2, 3, 4], 2, "a")
    plain = ev.block_hashes([1, 2, 9, 9], 2)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size,
            first.medium, first.lora_id, first.lora_name, first.extra_keys, first.group_idx) \
        == (a_hashes, None, [1, 2, 3, 4], 2, vllm.MEDIUM_GPU, None, None, [("a",), ("a",)],
            None)
    assert (second.block_hashes, second.extra_keys) == (plain, [None, None])
    assert {tuple(removed_a.block_hashes), tuple(removed_b.block_hashes)} == \
        {tuple(a_hashes), tuple(plain)}
    assert removed_a.medium == "GPU"
    assert isinstance(cleared, vllm.AllBlocksCleared)
    assert batch.ts == 5.5 and batch.data_parallel_rank is None


def test_we_send_every_field_vllm_requires_in_its_order(vllm):
    stored = ev.BlockStored((1,), None, (1, 2), 2, extra_keys=(None,), group_idx=0)
    removed = ev.BlockRemoved((1,), group_idx=0)
    for ours, theirs in ((stored, vllm.BlockStored), (removed, vllm.BlockRemoved),
                         (ev.AllBlocksCleared(), vllm.AllBlocksCleared)):
        wire = ours.to_wire()
        info = msgspec.inspect.type_info(theirs)
        assert (info.tag_field, info.tag) == ("type", wire["type"])
        order = [field.encode_name for field in info.fields]
        required = {field.encode_name for field in info.fields if field.required}
        sent = [key for key in wire if key != "type"]
        assert required <= set(sent), theirs.__name__
        assert sent == [name for name in order if name in sent], "field order differs"


def test_vllm_rejects_what_the_map_encoding_fixes(vllm):
    events = [ev.BlockStored((1,), None, (1, 2), 2)]
    # The positional layout radixcache published before: vLLM 0.33 cannot read it.
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        vllm.test_decoder.decode(ev.encode_batch(events, encoding="positional"))
    # lora_name has no default in vLLM's schema: a map without it is rejected, hence we
    # always send it, null included.
    wire = events[0].to_wire()
    del wire["lora_name"]
    with pytest.raises(msgspec.ValidationError, match="lora_name"):
        vllm.test_decoder.decode(msgspec.msgpack.encode([0.0, [wire], 0]))


def test_batches_vllm_encodes_decode_with_ours(vllm):
    """The router side: a vLLM worker's batch, with fields we do not know and bytes hashes."""
    events = [
        vllm.BlockStored(block_hashes=[b"\x01" * 32, 2**64 - 1], parent_block_hash=b"\x09" * 32,
                         token_ids=[1, 2, 3, 4], block_size=2, lora_id=3, medium="GPU",
                         lora_name="adapter", extra_keys=[("adapter",), ("adapter", ("mm", 0))],
                         group_idx=1, kv_cache_spec_kind="full_attention", session_id="s",
                         lookahead_token_ids=[[5], [6]]),
        vllm.BlockRemoved(block_hashes=[2**64 - 1], medium="CPU", group_idx=1,
                          locality="LOCAL"),
        vllm.AllBlocksCleared(),
    ]
    payload = msgspec.msgpack.encode(vllm.KVEventBatch(ts=3.25, events=events,
                                                       data_parallel_rank=2))
    batch = ev.decode_batch(payload, 9)
    assert (batch.seq, batch.ts, batch.data_parallel_rank) == (9, 3.25, 2)
    assert batch.events == [
        ev.BlockStored((b"\x01" * 32, 2**64 - 1), b"\x09" * 32, (1, 2, 3, 4), 2, 3, "GPU",
                       "adapter", (("adapter",), ("adapter", ("mm", 0))), 1),
        ev.BlockRemoved((2**64 - 1,), "CPU", 1),
        ev.AllBlocksCleared(),
    ]


def test_publisher_batches_decode_with_vllms_schema(vllm, core_name):
    cache = RadixCache(page_size=4, enable_events=True, core=core_name)
    pub = ev.ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv", data_parallel_rank=1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        published: dict = {}
        deadline = time.monotonic() + SOCKET_WAIT_S
        received: list = []
        while not received:  # slow joiner: clear until the subscription is live
            assert time.monotonic() < deadline, "subscriber never connected"
            published[pub.publish([ev.AllBlocksCleared()])] = [ev.AllBlocksCleared()]
            if sub.poll(50):
                received.append(sub.recv_multipart())
        for events in serve(cache, 150, seed=8):
            seq = pub.publish(events)
            if seq is not None:
                published[seq] = events
        assert pub.flush(SOCKET_WAIT_S)
        while int.from_bytes(received[-1][1], "big") < max(published):
            assert sub.poll(int(SOCKET_WAIT_S * 1000)), "batches missing"
            received.append(sub.recv_multipart())
        stored = 0
        for topic, seq_bytes, payload in received:
            events = published[int.from_bytes(seq_bytes, "big")]
            batch = vllm.test_decoder.decode(payload)
            assert topic == b"kv" and batch.data_parallel_rank == 1 and batch.ts > 0
            assert len(batch.events) == len(events)
            for theirs, ours in zip(batch.events, events):
                check_same(theirs, ours)
            stored += sum(isinstance(e, ev.BlockStored) for e in events)
        assert stored > 100 and pub.errors == 0 and pub.dropped == 0
    finally:
        sub.close()
        ctx.term()
        pub.close()


def _vllm_payload(vllm: Any, events: list) -> bytes:
    return msgspec.msgpack.encode(vllm.KVEventBatch(ts=1.0, events=events,
                                                    data_parallel_rank=0))


def _vllm_stored(vllm: Any, hashes: list, tokens: list, **fields: Any) -> Any:
    return vllm.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                            block_size=2, lora_id=None, medium=fields.pop("medium", "GPU"),
                            lora_name=None, **fields)


def test_index_keeps_tiers_and_groups_apart_with_vllms_structs(vllm):
    """A worker's copies on two tiers, or in two KV-cache groups, are two copies: removing
    one leaves the other; overlap counts the device tier unless asked for another."""
    from radixcache.router import KvIndexer

    tokens = list(range(8))
    indexer = KvIndexer(2)
    for medium in ("GPU", "CPU"):
        assert indexer.apply_payload(0, _vllm_payload(vllm, [
            _vllm_stored(vllm, [11, 12, 13, 14], tokens, medium=medium)]))
    assert indexer.overlap(tokens) == {0: 4}
    assert indexer.overlap(tokens, medium="CPU") == {0: 4}
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        vllm.BlockRemoved(block_hashes=[11, 12, 13, 14], medium="CPU")]))
    assert indexer.overlap(tokens) == {0: 4}
    assert indexer.overlap(tokens, medium="CPU") == {}
    assert indexer.blocks_held(0) == 4 and indexer.blocks_held(0, "CPU") == 0
    # Two KV-cache groups of one worker (a hybrid model), group 1 removed.
    groups = KvIndexer(2)
    for group in (0, 1):
        assert groups.apply_payload(1, _vllm_payload(vllm, [
            _vllm_stored(vllm, [21, 22, 23, 24], tokens, group_idx=group)]))
    assert groups.apply_payload(1, _vllm_payload(vllm, [
        vllm.BlockRemoved(block_hashes=[21, 22, 23, 24], medium="GPU", group_idx=1)]))
    assert groups.overlap(tokens) == {1: 4} and groups.blocks_held(1) == 4
    assert groups.stats.unknown_removals == 0
    # No medium is the device tier too.
    none = KvIndexer(2)
    assert none.apply_payload(2, _vllm_payload(vllm, [
        _vllm_stored(vllm, [31, 32], tokens[:4], medium=None)]))
    assert none.overlap(tokens) == {2: 2}


def test_two_publisher_hashes_for_the_same_blocks_with_vllms_structs(vllm):
    from radixcache.router import KvIndexer

    tokens = list(range(4))
    indexer = KvIndexer(2)
    # The same two blocks stored twice under other hashes (the second chain from 41).
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        _vllm_stored(vllm, [41, 42], tokens),
        vllm.BlockStored(block_hashes=[52], parent_block_hash=41, token_ids=tokens[2:],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None)]))
    assert indexer.blocks_held(0) == 3
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        vllm.BlockRemoved(block_hashes=[42], medium="GPU")]))
    assert indexer.overlap(tokens) == {0: 2}  # 52 still maps to the second block
    assert indexer.blocks_held(0) == 2
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        vllm.BlockRemoved(block_hashes=[52], medium="GPU")]))
    assert indexer.overlap(tokens) == {0: 1} and len(indexer) == 1


def test_blocks_of_different_images_stay_apart_with_vllms_structs(vllm):
    """vLLM's per-block ``extra_keys`` (an image's hash on the blocks of its placeholder
    tokens) are part of a block's identity, as in the engine: the same placeholder tokens
    with another image are other blocks, whether the image's blocks come in the event of
    the text before them or in a later one."""
    from radixcache.router import KvIndexer

    tokens = [1, 2, 3, 4] + [9] * 4  # two text blocks, then two of image placeholders
    image = {name: [None, None, (name,), (name,)] for name in ("img-a", "img-b")}
    indexer = KvIndexer(2)
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        _vllm_stored(vllm, [1, 2, 3, 4], tokens, extra_keys=image["img-a"])]))
    assert indexer.apply_payload(1, _vllm_payload(vllm, [
        _vllm_stored(vllm, [1, 2], tokens[:4]),  # the text, then the image below it
        vllm.BlockStored(block_hashes=[5, 6], parent_block_hash=2, token_ids=tokens[4:],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None,
                         extra_keys=image["img-b"][2:])]))
    assert indexer.stats.skipped == 0
    assert indexer.overlap(tokens, block_extra_keys=image["img-a"]) == {0: 4, 1: 2}
    assert indexer.overlap(tokens, block_extra_keys=image["img-b"]) == {0: 2, 1: 4}
    assert indexer.overlap(tokens) == {0: 2, 1: 2}  # no image: the text only
    assert indexer.block_keys(tokens, block_extra_keys=image["img-a"])[:2] == \
        indexer.block_keys(tokens)[:2]
    # A LoRA request: vLLM puts the adapter's name on every block, beside the image.
    lora = [("ad",), ("ad",), ("ad", "img-a"), ("ad", "img-a")]
    assert indexer.apply_payload(2, _vllm_payload(vllm, [
        vllm.BlockStored(block_hashes=[7, 8, 9, 10], parent_block_hash=None,
                         token_ids=tokens, block_size=2, lora_id=1, medium="GPU",
                         lora_name="ad", extra_keys=lora)]))
    assert indexer.overlap(tokens, "ad", block_extra_keys=lora) == {2: 4}
    assert indexer.overlap(tokens, "ad", block_extra_keys=[None, None] + lora[2:]) == {2: 4}
    assert indexer.overlap(tokens, "ad") == {2: 2}
    assert indexer.overlap(tokens, block_extra_keys=lora) == {2: 4}  # the first names it
    with pytest.raises(ValueError, match="another namespace"):
        indexer.overlap(tokens, "other", block_extra_keys=lora)
    with pytest.raises(TypeError, match="block_extra_keys"):
        indexer.overlap(tokens, block_extra_keys=[None, "img-a"])
    assert indexer.apply_payload(0, _vllm_payload(vllm, [
        vllm.BlockRemoved(block_hashes=[3, 4], medium="GPU")]))
    assert indexer.overlap(tokens, block_extra_keys=image["img-a"]) == {0: 2, 1: 2}

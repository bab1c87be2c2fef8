"""KV-cache events: what a cache-aware router needs to mirror which pages a cache holds.

With ``RadixCache(..., enable_events=True)`` the cache records, per full page of
``page_size`` tokens (the block a router sees):

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx)`` when tokens enter the tree: one event per new leaf,
  covering its pages in order; ``parent_block_hash`` is the hash of the page before the first
  one (``None`` at the root);
- ``BlockRemoved(block_hashes, medium, group_idx)`` when an evicted leaf leaves the tree;
- ``AllBlocksCleared()`` on ``reset()``.

``cache.take_events()`` returns them in order and empties the queue. A split emits nothing:
it moves a node boundary, never a page, and a page's hash does not depend on node boundaries.

With a host tier (``RadixCache(..., host_tier=True)``) each event names its tier in
``medium``: a copy to the host is a ``BlockStored`` with ``medium="CPU"``; a node leaving the
device (even if it stays on the host) a ``BlockRemoved`` with the device medium (``"GPU"``); a
host eviction a ``BlockRemoved`` with ``"CPU"``; a load-back, an adoption by ``insert`` or a
new leaf a ``BlockStored`` with the device medium. A page's hash is the same on both tiers.

Fields the recorder fills
-------------------------
- ``extra_keys``: one entry per block, ``None`` when the namespace (the cache's
  ``extra_key``) is None, else the 1-tuple ``(namespace,)`` on EVERY block, the namespace as
  its canonical value (str, bytes, or int: bools and numpy integers become the int they
  equal). Every block carries it because the namespace enters every page's hash, so a router
  can rehash any block without its ancestors' events. A str namespace thus looks exactly like
  a vLLM LoRA request's blocks (``(lora_name,)`` per block). See ``extra_keys_entry``.
- ``medium``: ``EventRecorder(medium=...)``, ``"GPU"`` by default (vLLM's default for the
  device KV pool a prefix cache indexes).
- ``lora_name`` / ``lora_id``: None, unless ``EventRecorder(lora_namespaces=True)`` says the
  namespaces are LoRA adapters: then a str namespace is sent as ``lora_name`` and an int one
  as ``lora_id`` (bytes and None namespaces leave both None). ``EventRecorder(lora_id=N)``
  sets a fixed ``lora_id`` for a cache that serves one adapter (``KvIndexer`` then puts the
  blocks of a namespace-less sequence in namespace N).
- ``group_idx``: None (radixcache has one KV-cache group); decoded when a publisher sends it.

Block hash
----------
A page's hash is a signed 64-bit integer chained from its parent page::

    block_hash(parent, tokens, ns) = int.from_bytes(SHA-256(P + N + T)[:8], "big", signed=True)

    P = b"\\x00"                                  when parent is None (first page of a sequence)
        b"\\x01" + parent as 8 bytes, big endian, two's complement   otherwise
    N = the namespace (the cache's ``extra_key``), self-delimiting:
        None  -> b"N"
        str   -> b"S" + len(utf8) as 8 bytes big endian + utf8 (lone surrogates passed through)
        bytes -> b"B" + len(data) as 8 bytes big endian + data
        int   -> b"I" + len(d) as 8 bytes big endian + d, d = ASCII decimal (b"-12");
                 bool and numpy integers count as the int they equal (as dict keys do)
        any other type raises TypeError naming it
    T = the page's token ids, each as 8 bytes little endian, two's complement

The same tokens in the same namespace after the same prefix always get the same hash, in
every process (nothing depends on ``hash()`` or ``PYTHONHASHSEED``) and on either tree core.
``block_hashes(token_ids, page_size, extra_key)`` computes a prompt's chain the same way.

Cost: a cache with events off never imports this module's recorder and never hashes. With
events on, the recorder keeps one int per node (the hash of the node's last page, keyed by
node id) and computes missing ones lazily and iteratively from the nearest known ancestor,
so deep trees never recurse.

Wire format (optional: ``pip install radixcache[events]`` for pyzmq and msgspec)
-------------------------------------------------------------------------------
A batch is the msgpack array ``[ts, [event, ...], dp_rank]`` (vLLM's ``KVEventBatch``). Each
event is encoded one of two ways (``encode_batch(..., encoding=...)``,
``ZmqEventPublisher(..., encoding=...)``):

``"map"`` (the default; vLLM's tagged maps since vLLM PR #42892, vLLM 0.33)::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": i | nil, "medium": s | nil,
     "lora_name": s | nil, "extra_keys": [[ns] | nil, ...]}     (+ "group_idx" when set)
    {"type": "BlockRemoved", "block_hashes": [...], "medium": s | nil}   (+ "group_idx")
    {"type": "AllBlocksCleared"}

  The fields vLLM's schema requires (no default there) are always sent, null included;
  ``extra_keys`` and ``group_idx`` are left out when None, as vLLM's encoder does.

``"positional"`` (the tagged arrays of earlier vLLM versions, for older consumers)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
        (+ lora_name, extra_keys, group_idx when any is set: a namespace, a LoRA name or a
         group; extra_keys with no namespace on any block count as unset)
    ["BlockRemoved", block_hashes, medium]   (+ group_idx when set)
    ["AllBlocksCleared"]

  The trailing places keep the namespace and the group in this layout too (consumers of
  the six-field layout ignore them; vLLM's array structs ignore trailing fields).

``decode_batch`` reads both, event by event: map fields by name and positional fields by
place, ignoring fields it does not know (later ones in an array, unknown keys in a map).
Required: ``block_hashes``, ``parent_block_hash`` (nil at the root), ``token_ids`` and
``block_size`` of a BlockStored, ``block_hashes`` of a BlockRemoved; the other fields are
None when absent. Block hashes may be ints or bytes (vLLM's ``ExternalBlockHash``).
Anything else raises ValueError naming the batch and the field. A batch whose events are
all in one encoding is decoded and checked by msgspec's typed decoder (structs in each
layout, tagged by the event type), with no check per token in Python; a batch it refuses is
read field by field, so the answer and the error are the same either way.

Transport
---------
``ZmqEventPublisher`` sends each ``publish(events)`` as three frames on a PUB socket: the topic,
an 8-byte big-endian sequence number and the encoded batch. A replay ROUTER socket answers
``(identity, b"", start_seq)`` as vLLM's and SGLang's publishers do: every buffered batch from
``start_seq`` on as ``(identity, b"", topic, seq, payload)``, then the end marker
``(identity, b"", b"", -1, b"")``. ``ZmqEventSubscriber`` receives batches in order, fills
sequence gaps through replay (reading the engines' answers and radixcache's older
``(b"", seq, payload)`` ones), probes an idle publisher for a lost tail, tells a restarted
publisher from a replay's late copies and decodes either encoding.
"""

# The public names live in the package's modules; imports run downward only:
#   types (the events, media, encodings) <- hashing (namespaces, block hashes, TokenIds)
#   <- recorder (EventRecorder, KeyRecorder); types <- wire (ReceivedBatch, msgpack
#   encode/decode) <- zmq (publisher, subscriber).
from .hashing import (
    BLOCK_HASHES,
    TokenIds,
    block_hash,
    block_hashes,
    canonical_namespace,
    encode_namespace,
    event_namespace,
    extra_keys_entry,
    tokens_le_bytes,
)
from .recorder import EventRecorder
from .types import (
    DEFAULT_ENCODING,
    ENCODINGS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from .wire import (
    MAX_EXTRA_KEYS_DEPTH as MAX_EXTRA_KEYS_DEPTH,  # public, outside __all__ as ever
)
from .wire import ReceivedBatch, decode_batch, decode_event, encode_batch
from .zmq import ZmqEventPublisher, ZmqEventSubscriber

__all__ = [
    "DEFAULT_ENCODING",
    "ENCODINGS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventRecorder",
    "KVEvent",
    "ReceivedBatch",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "BLOCK_HASHES",
    "TokenIds",
    "block_hash",
    "block_hashes",
    "tokens_le_bytes",
    "canonical_namespace",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_namespace",
    "event_namespace",
    "extra_keys_entry",
]

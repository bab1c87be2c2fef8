"""Routing requests across workers: a KV-aware block index fed by events, and routing policies.

``KvIndexer`` mirrors which blocks each worker's prefix cache holds, learned only from the
KV events the workers publish (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, as
``RadixCache.take_events()`` returns them or as ``ZmqEventSubscriber.receive()`` delivers
them; ``apply_payload`` decodes a raw wire payload). ``overlap(tokens, extra_key)`` says how
many leading blocks of a request each worker holds.

Block keys are computed by the indexer itself, not taken from the publisher: a block's key
chains its parent's key and the block's token ids (and, for a sequence's first block, the
namespace: its first block's ``extra_keys`` entry, else the adapter and salt its root event
names, see docs/events-and-routing.md), so any publisher that sends token ids (radixcache,
vLLM, SGLang) indexes the same way and a query hashes its tokens the same way. Per copy (a
worker's blocks on one tier, ``medium``, in one KV-cache group, ``group_idx``), a map from
the publisher's block hash to the indexer's key resolves ``parent_block_hash`` and
``BlockRemoved``. The keys are the ``fast64`` block hash
(``radixcache.events.BLOCK_HASHES``: the block module's ``page_hash_chain``, compiled when
built, seeded by the namespace), so a publisher recording with ``block_hash="fast64"`` sends
the indexer's own keys: checked against the token ids, such blocks need no map entry. Int
hashes are taken modulo 2**64 everywhere, own keys too: ``K + 2**64`` (a key sent unsigned)
names the block held as ``K``. The keys are 64-bit and not collision resistant: a hostile
publisher could make two prefixes share keys; feed the index from trusted workers.
Memory is proportional to the (block, copy) pairs held: one entry per pair in that map and
one per distinct block in the block module's table (``BlockIndex``, compiled when built:
16 bytes a slot, and a short list when several copies hold the block), freed when its last
holder removes it; a worker that holds nothing keeps nothing. Stores, removals and overlap
queries are one call into that table each (a query hashes its blocks there, as far as any
worker's run of held blocks goes).

Bad input from the wire never raises: an event that cannot be applied (a removal of an
unknown block, a stored block whose parent is unknown, a wrong block size, a malformed event
or payload) is skipped and counted in ``stats``.

``KvIndexer(block_size, store="redis://...", namespace=...)`` keeps the same index in Redis
or Valkey instead (``radixcache.router.redis_store``; ``radixcache[redis]``), shared by
router replicas and surviving their restarts, with the same answers.

``Router`` picks a worker per request with one of ``ROUTING_POLICIES``; ``cache-aware``
scores each worker by the prefill it would still need after its cached overlap (from the
indexer) plus a weighted load, as NVIDIA Dynamo's KV router does. Load is reported by the
caller (``add_load``/``remove_load``, in tokens of work queued or running).
"""

# The indexer (``indexer``) and the routing policies (``policies``, which read it).
from .._options import (
    DEFAULT_HOST_WEIGHT as DEFAULT_HOST_WEIGHT,  # public, outside __all__
)
from .._options import DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from .indexer import IndexerStats, KvIndexer
from .keys import namespace_for
from .policies import (
    DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE,  # public, outside __all__
)
from .policies import Router

__all__ = ["DEFAULT_LOAD_WEIGHT", "ROUTING_POLICIES", "IndexerStats", "KvIndexer", "Router",
           "namespace_for"]

"""``KvIndexer(block_size, store="redis://...")``: the index kept in Redis or Valkey, shared by
router replicas and surviving their restarts.

Only what Redis 7.0 and Valkey both have: strings, hashes, sets, one sorted set and Lua
scripts (run with EVALSHA; ``radixcache.router.redis_scripts``); no server module. Every key
of an index starts with ``rc:{namespace}:`` (``P`` below); one server holds any number of
namespaces.

Key layout:

- ``P blocks`` (a hash): field a block's 8-byte indexer key (little endian), value its
  holders, ``,wid:medium:count`` entries (``count``: the worker's holdings of the block on
  that tier, summed over its KV-cache groups). The field is deleted with its last holder.
  One hash, so a lookup reads a chunk of the prompt's chain in one ``HMGET`` (32 blocks,
  then twice as many up to 256) and stops at the first block no worker holds; a batch
  reads and writes its blocks with one ``HMGET`` and one ``HSET`` per run. About 60 bytes
  a block (a hash table's entry) for one holder.
- ``P j:<cid>``: a string, the journal of one copy (a worker's blocks on one tier in one
  KV-cache group): runs of held blocks (``+``, a 4-byte count, 8 bytes per block) and of
  removals (``-``), and the publisher hashes of publishers whose hashes are not the
  indexer's keys (in runs too when a batch's hashes are int64s, or bytes of one length).
  It lists the copy's blocks, so a dead worker's blocks are collected without scanning the
  keyspace, and a router that takes the worker over rebuilds its view from it. Compacted
  (to the net holdings and live hashes) when it grows past twice its last compacted size
  with a third of its records or more dead (removed blocks, unmapped hashes), and past four
  times in any case.
- ``P seq`` (hash): worker id -> ``epoch:seq``, the last batch applied.
- ``P lease:<wid>`` (string, with a time to live): the token of the router that owns the
  worker's ingest. ``P leases`` (sorted set): worker id by lease expiry, what the
  collector reads.
- ``P workers``, ``P copies``, ``P media`` (hashes): the names of worker ids, copy ids and
  tier codes, both ways; ``P wc:<wid>`` (set): the worker's copies; ``P n`` (hash): counters
  (distinct blocks, holdings per worker and tier, journal sizes and dead records, id
  allocation).

Ingest. The router that owns a worker's ingest keeps the worker's blocks in an in-process
``KvIndexer`` (its view), applies each batch there, and sends what changed, holdings and
publisher hashes, to the store in one script call that also checks the lease and the
sequence number and records them: a batch whose number is not newer than the stored one is
skipped (re-applying is harmless). A second router, or this one restarted, takes the worker
over from the store (its journal and sequence number) and resumes the stream from
``resume_seq(worker)`` through the publisher's replay.

Failures. Nothing raises into the caller's loop: if the store cannot be reached or refuses
writes (out of memory under ``maxmemory-policy noeviction``), lookups answer ``{}`` (routing
falls back to cache-blind scores) and batches are not stored; both are counted in
``stats`` (``store_errors``, ``blind_lookups``). After a failure the store is retried after
a short pause, and the workers whose batches were lost are taken over again from the store:
``resume_seq`` then tells where their replay starts.
"""

from __future__ import annotations

import ast
import operator
import sys
import time
import uuid
from array import array
from typing import Any, Hashable, Iterable, Optional

from ..events import (
    BlockRemoved,
    BlockStored,
    ReceivedBatch,
    decode_batch,
)
from . import redis_scripts
from .ingest import EventIngest
from .keys import _event_group, _event_medium, _group

_LITTLE_ENDIAN = sys.byteorder == "little"

#: Seconds a worker's lease lasts without a renewal (the default): a batch renews it once a
#: third of it has passed, ``renew`` at once.
DEFAULT_LEASE_S = 30.0
#: Seconds the store is left alone after a failure before it is tried again.
RETRY_S = 0.5


def _key_bytes(keys: list) -> bytes:
    data = array("q", keys)
    if not _LITTLE_ENDIAN:
        data.byteswap()
    return data.tobytes()


def _keys_from_bytes(data: bytes) -> list:
    keys = array("q")
    keys.frombytes(data)
    if not _LITTLE_ENDIAN:
        keys.byteswap()
    return keys.tolist()


def _run_bytes(op: str, keys: list) -> bytes:
    """A run of holdings in the script's ops: op, the count (4 bytes), the keys."""
    return op.encode() + len(keys).to_bytes(4, "big") + _key_bytes(keys)


_BYTES = {bytes}
_INT = {int}


def _hash_bytes(block_hash: Any) -> bytes:
    """A publisher hash as journal bytes: ``b`` + the bytes, ``q`` + 8 bytes (little endian)
    for an int that fits in int64, ``i`` + decimal for a larger one."""
    if type(block_hash) is bytes:
        return b"b" + block_hash
    value = int(block_hash)
    if -(1 << 63) <= value < (1 << 63):
        return b"q" + value.to_bytes(8, "little", signed=True)
    return b"i" + str(value).encode()


def _hash_from_bytes(data: bytes) -> Any:
    tag = data[:1]
    if tag == b"b":
        return data[1:]
    if tag == b"q":
        return int.from_bytes(data[1:9], "little", signed=True)
    return int(data[1:])


def _hash_run(hashes: list) -> Optional[tuple]:
    """``(tag, length, data)`` of publisher hashes all of one kind (bytes of one length, or
    ints that fit in int64), each hash's journal bytes being tag + its ``length`` bytes in
    ``data``; None for a mix."""
    kinds = set(map(type, hashes))
    if kinds == _BYTES:
        lengths = set(map(len, hashes))
        if len(lengths) == 1:
            return b"b", lengths.pop(), b"".join(hashes)
    elif kinds == _INT:
        try:
            return b"q", 8, _key_bytes(hashes)
        except OverflowError:
            return None
    return None


def _worker_name(worker: Hashable) -> str:
    """The stored spelling of a worker id: its ``repr``, which must read back as itself."""
    name = repr(worker)
    try:
        same = ast.literal_eval(name) == worker
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        same = False
    if not same:
        raise TypeError(f"a worker id of a store-backed KvIndexer must be a literal (int, str, "
                        f"bytes, or a tuple of them), got {type(worker).__name__}")
    return name



class _Recorder:
    """A ``BlockIndex`` that forwards every call and records the holdings each one changed,
    in order: ``ops`` is a list of ``(copy, op, keys)``, ``copy`` the ``(worker, medium,
    group)`` of the copy, op ``+`` (holdings of ``keys`` added), ``-`` (removed) or ``C``
    (the copy cleared; ``keys`` None). ``idents`` names the copy ids (kept by the view's
    ``_new_cid``)."""

    __slots__ = ("inner", "ops", "idents")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: list = []
        self.idents: dict = {}

    def __len__(self) -> int:
        return len(self.inner)

    @staticmethod
    def _ints(keys: Any) -> list:
        if type(keys) is bytes:
            return array("q", keys).tolist()  # native order, as the block module reads it
        return list(keys)

    def hold(self, key: int, copy: int) -> None:
        self.inner.hold(key, copy)
        self.ops.append((self.idents[copy], "+", [key]))

    def unhold(self, key: int, copy: int) -> bool:
        dropped = self.inner.unhold(key, copy)
        if dropped:
            self.ops.append((self.idents[copy], "-", [key]))
        return dropped

    def holds(self, key: int, copy: int) -> bool:
        return self.inner.holds(key, copy)

    def holders(self, key: int) -> Any:
        return self.inner.holders(key)

    @property
    def pairs(self) -> int:
        """The (block, copy) holdings in the table (the indexer's drift check reads it)."""
        return self.inner.pairs

    def add(self, copy: int, keys: Any) -> int:
        keys = self._ints(keys)
        added = self.inner.add(copy, keys)
        if keys:
            self.ops.append((self.idents[copy], "+", keys))
        return added

    def store(self, copy: int, keys: Any) -> tuple:
        keys = self._ints(keys)
        array("q", keys)  # TypeError/OverflowError before anything changes, as the index
        inner = self.inner
        holds = inner.holds
        if len(set(keys)) == len(keys):
            new = [key for key in keys if not holds(key, copy)]
        else:
            new = []
            seen = set()
            for key in keys:
                if key not in seen:
                    seen.add(key)
                    if not holds(key, copy):
                        new.append(key)
        result = inner.store(copy, keys)
        if new:
            self.ops.append((self.idents[copy], "+", new))
        return result

    def remove(self, copy: int, keys: Any) -> tuple:
        keys = self._ints(keys)
        array("q", keys)  # TypeError/OverflowError before anything changes, as the index
        inner = self.inner
        gone = [key for key in keys if inner.unhold(key, copy)]
        if gone:
            self.ops.append((self.idents[copy], "-", gone))
        return len(gone), len(keys) - len(gone)

    def clear_copy(self, copy: int) -> int:
        dropped = self.inner.clear_copy(copy)
        self.ops.append((self.idents[copy], "C", None))
        return dropped

    def overlap(self, *args: Any) -> list:
        return self.inner.overlap(*args)


def _view(block_size: int) -> Any:
    """An in-process index (``EventIngest``) whose block table records what each call
    changed."""

    class _View(EventIngest):
        def _new_cid(self, copy: Any) -> None:
            super()._new_cid(copy)
            self._index.idents[copy.cid] = (copy.worker, copy.medium, copy.group)

    view = _View(block_size)
    view._index = _Recorder(view._index)
    return view


class RedisStore:
    """The store behind ``KvIndexer(block_size, store=url, namespace=...)``; see the module
    docstring. Made by ``KvIndexer``, which hands it its calls."""

    def __init__(self, indexer: Any, url: str, namespace: str = "default",
                 lease_s: float = DEFAULT_LEASE_S, owner: Optional[str] = None,
                 socket_timeout: float = 1.0) -> None:
        try:
            import redis
        except ImportError:
            raise ImportError("a store-backed KvIndexer needs the redis client: "
                              "pip install 'radixcache[redis]'") from None
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://",
                                                           "unix://")):
            raise ValueError(f"store must be a redis://, rediss:// or unix:// URL, got {url!r}")
        if not isinstance(namespace, str) or not namespace or ":" in namespace:
            raise ValueError(f"namespace must be a non-empty str without ':', got {namespace!r}")
        if not isinstance(lease_s, (int, float)) or not lease_s > 0:
            raise ValueError(f"lease_s must be a number > 0, got {lease_s!r}")
        self._no_script = redis.exceptions.NoScriptError
        self._conn = None  # the connection of the script calls, made on the first one
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError,
                              OSError)
        self.url = url
        self.namespace = namespace
        self.prefix = f"rc:{namespace}:".encode()
        self.lease_ms = max(1, int(lease_s * 1000))
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ValueError(f"owner must be a non-empty str or None, got {owner!r}")
        self.token = uuid.uuid4().hex if owner is None else owner  # this router's token
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            retry_on_timeout=False)
        self._apply = self.client.register_script(redis_scripts.APPLY)
        self._overlap_script = self.client.register_script(redis_scripts.OVERLAP)
        self._register = self.client.register_script(redis_scripts.REGISTER)
        self._acquire = self.client.register_script(redis_scripts.ACQUIRE)
        self._renew = self.client.register_script(redis_scripts.RENEW)
        self._collect = self.client.register_script(redis_scripts.COLLECT)
        self._remove = self.client.register_script(redis_scripts.REMOVE)
        self.block_size = indexer.block_size
        self.stats = indexer.stats
        # The owned workers' blocks, in process: the view batches are applied to.
        self.view = _view(indexer.block_size)
        self.view.stats = self.stats
        self._recorder = self.view._index
        # ids: worker -> wid (str); wid -> worker; medium -> code; (wid, code, group) -> cid
        self._wids: dict = {}
        self._names: dict = {}
        self._media: dict = {}
        self._cids: dict = {}
        self._owned: dict = {}  # worker -> [epoch, seq] of the last batch applied
        self._resume: dict = {}  # worker -> the sequence number its replay starts from
        self._publishing: set = set()  # copies with publisher hashes in their journal
        self._down_until = 0.0
        self._last_renew = time.monotonic()

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, script: Any, args: list) -> Any:
        """``script(args=args)`` in one EVALSHA on this store's own connection, packed here
        (the client's general command path costs more than the batch's own encoding); a
        server that lost its scripts (restarted) gets them through the client again."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self.client.connection_pool.make_connection()
        parts = [b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n0\r\n"
                 % (len(args) + 3, script.sha.encode())]
        for arg in args:
            if type(arg) is not bytes:
                arg = str(arg).encode()
            parts.append(b"$%d\r\n" % len(arg))
            parts.append(arg)
            parts.append(b"\r\n")
        try:
            conn.send_packed_command([b"".join(parts)], check_health=False)
            return conn.read_response()
        except self._no_script:
            return script(args=args)

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        self.stats.store_errors += 1
        self._down_until = time.monotonic() + RETRY_S
        # What this router applied in process may not have reached the store: take every
        # owned worker over again from the store once it answers.
        for worker, (_epoch, seq) in list(self._owned.items()):
            if seq >= 0:
                self._resume.setdefault(worker, seq + 1)
            self._drop_view(worker)

    def _drop_view(self, worker: Hashable) -> None:
        self._owned.pop(worker, None)
        for copy in self.view._copies_of(worker):
            self.view._held -= copy.size
            self._recorder.inner.clear_copy(copy.cid)  # not recorded: the store keeps them
            copy.published.clear()
            copy.direct = 0
            copy.refs = None
            self.view._drop_cid(copy)
        self.view._copies.pop(worker, None)

    def _id(self, kind: str, name: str) -> str:
        value = self._register(args=[self.prefix, kind, name])
        return value.decode() if isinstance(value, bytes) else str(value)

    def _wid(self, worker: Hashable) -> str:
        wid = self._wids.get(worker)
        if wid is None:
            wid = self._id("w", _worker_name(worker))
            self._wids[worker] = wid
            self._names[wid] = worker
        return wid

    def _mcode(self, medium: str, create: bool = True) -> Optional[str]:
        code = self._media.get(medium)
        if code is None:
            if create:
                code = self._id("m", medium)
            else:
                raw = self.client.hget(self.prefix + b"media", "n:" + medium)
                if raw is None:
                    return None
                code = raw.decode()
            self._media[medium] = code
        return code

    def _cid(self, wid: str, medium: str, group: Any) -> tuple:
        code = self._mcode(medium)
        ident = (wid, code, group)
        cid = self._cids.get(ident)
        if cid is None:
            cid = self._cids[ident] = self._id("c", f"{wid}|{code}|{group!r}")
        return cid, code

    def _worker_of(self, wid: Any) -> Hashable:
        wid = wid.decode() if isinstance(wid, bytes) else str(wid)
        worker = self._names.get(wid)
        if worker is None:
            raw = self.client.hget(self.prefix + b"workers", "i:" + wid)
            worker = ast.literal_eval(raw.decode())
            self._names[wid] = worker
            self._wids.setdefault(worker, wid)
        return worker

    # -- ownership ------------------------------------------------------------------------
    def _take_over(self, worker: Hashable) -> bool:
        """Own ``worker``'s ingest: its lease, and its blocks in the view, from the store."""
        wid = self._wid(worker)
        reply = self._acquire(args=[self.prefix, wid, self.token, self.lease_ms])
        if reply[0] != b"ok":
            self.stats.foreign_batches += 1
            return False
        self._drop_view(worker)
        stored = reply[1].decode()
        epoch, seq = (int(x) for x in stored.split(":")) if stored else (0, -1)
        copies = {}
        for (cid_raw, journal) in zip(reply[2::2], reply[3::2]):
            copies[cid_raw.decode()] = journal
        if copies:
            twins = self._restore(worker, wid, copies)
            if twins:
                # Copies of a group both as 0 and as None (two copies before they were one):
                # the second one's blocks are dropped from the store (its journal too).
                ops = [arg for cid, code in twins for arg in (cid, code, b"C")]
                self._call(self._apply, [self.prefix, wid, self.token, self.lease_ms, epoch,
                                         -1, *ops])
        self._owned[worker] = [epoch, seq]
        return True

    def _restore(self, worker: Hashable, wid: str, journals: dict) -> list:
        """The view of ``worker``'s copies, from their journals; returns the ``(cid, medium
        code)`` of journals of a copy restored already (not restored)."""
        raw = self.client.hmget(self.prefix + b"copies", ["i:" + c for c in journals])
        media = {code: name for name, code in self._media.items()}
        twins: list = []
        seen: set = set()
        for cid, name in zip(journals, raw):
            _wid, code, group_repr = name.decode().split("|", 2)
            group = _group(ast.literal_eval(group_repr))  # group 0 is None
            if (code, group) in seen:
                twins.append((cid, code))
                continue
            seen.add((code, group))
            medium = media.get(code)
            if medium is None:
                medium = self.client.hget(self.prefix + b"media", "i:" + code).decode()
                self._media[medium] = code
                media[code] = medium
            self._cids[(wid, code, group)] = cid
            counts: dict = {}
            published: dict = {}
            journal = journals[cid]
            i, n = 0, len(journal)
            while i < n:
                tag = journal[i:i + 1]
                if tag in (b"+", b"-"):
                    count = int.from_bytes(journal[i + 1:i + 5], "big")
                    step = 1 if tag == b"+" else -1
                    for key in _keys_from_bytes(journal[i + 5:i + 5 + 8 * count]):
                        counts[key] = counts.get(key, 0) + step
                    i += 5 + 8 * count
                elif tag in (b"H", b"G"):
                    count = int.from_bytes(journal[i + 1:i + 5], "big")
                    length = int.from_bytes(journal[i + 5:i + 7], "big")
                    kind = journal[i + 7:i + 8]
                    i += 8
                    if tag == b"H":
                        keys = _keys_from_bytes(journal[i:i + 8 * count])
                        i += 8 * count
                    for x in range(count):
                        block_hash = _hash_from_bytes(kind + journal[i:i + length])
                        i += length
                        if tag == b"H":
                            published[block_hash] = keys[x]
                        else:
                            published.pop(block_hash, None)
                elif tag == b"P":
                    length = int.from_bytes(journal[i + 9:i + 11], "big")
                    key = _keys_from_bytes(journal[i + 1:i + 9])[0]
                    published[_hash_from_bytes(journal[i + 11:i + 11 + length])] = key
                    i += 11 + length
                else:
                    length = int.from_bytes(journal[i + 1:i + 3], "big")
                    published.pop(_hash_from_bytes(journal[i + 3:i + 3 + length]), None)
                    i += 3 + length
            keys = [key for key, count in counts.items() for _ in range(count)]
            if not keys:
                continue
            copy = self.view._copy(worker, medium, group)
            self._recorder.inner.add(copy.cid, keys)
            self.view._held += len(keys)
            for block_hash, key in published.items():
                copy.published.put(block_hash, key)
            # the holdings no publisher hash names are the blocks' own keys
            copy.direct = len(keys) - len(published)
            copy.refs = None
            if published:
                self._publishing.add((worker, medium, group))
        return twins

    def _maybe_renew(self) -> None:
        now = time.monotonic()
        if now - self._last_renew >= self.lease_ms / 3000.0 and self._owned:
            self._last_renew = now
            self.renew(list(self._owned))

    def renew(self, workers: Iterable[Hashable]) -> None:
        wids = {self._wids[w]: w for w in workers if w in self._owned}
        if not wids or not self._available():
            return
        try:
            lost = self._renew(args=[self.prefix, self.token, self.lease_ms, *wids])
        except self._redis_errors:
            self._failed()
            return
        for wid in lost:
            worker = wids[wid.decode()]
            self._drop_view(worker)

    def collect(self, limit: int = 100) -> list:
        if not self._available():
            return []
        try:
            done = self._collect(args=[self.prefix, limit])
            workers = [self._worker_of(wid) for wid in done]
        except self._redis_errors:
            self._failed()
            return []
        for worker in workers:
            self._drop_view(worker)
        self.stats.collected_workers += len(workers)
        return workers

    def resume_seq(self, worker: Hashable) -> Optional[int]:
        if worker in self._resume:
            return self._resume[worker]
        if worker in self._owned:
            seq = self._owned[worker][1]
            return None if seq < 0 else seq + 1
        try:
            raw = self.client.hget(self.prefix + b"seq", self._wid(worker))
        except self._redis_errors:
            self._failed()
            return None
        if raw is None:
            return None
        return int(raw.decode().split(":")[1]) + 1

    # -- ingest ---------------------------------------------------------------------------
    def apply(self, worker: Hashable, events: Any, kind: str = "events") -> None:
        view = self.view
        view._check_worker(worker)
        seq = -1
        restarted = False
        if isinstance(events, ReceivedBatch):
            seq = events.seq if type(events.seq) is int else -1
            restarted = events.restarted
        if not self._available():
            self.stats.store_errors += 1
            self.stats.batches += 1
            if seq >= 0:
                self._resume.setdefault(worker, seq)
            return
        try:
            self._maybe_renew()
            if worker not in self._owned and not self._take_over(worker):
                self.stats.batches += 1
                return
            state = self._owned[worker]
            epoch = state[0] + 1 if restarted else state[0]
            if seq >= 0 and not restarted and epoch == state[0] and seq <= state[1]:
                self.stats.stale_batches += 1
                self.stats.batches += 1
                return
            self._recorder.ops = []
            if kind == "keys":
                view._apply_keys(worker, events)
                touched = ()
            else:
                view._apply_events(worker, events)
                touched = events.events if isinstance(events, ReceivedBatch) else events
            args = self._batch_args(worker, touched)
            reply = self._call(self._apply, [self.prefix, self._wids[worker], self.token,
                                             self.lease_ms, epoch, seq, *args])
        except self._redis_errors:
            self._failed()
            if seq >= 0:
                self._resume.setdefault(worker, seq)
            return
        finally:
            self._recorder.ops = []
        if reply != b"ok":
            # Another router owns the worker, or already applied this batch, or the worker
            # was collected: this view is not the store's; take it over again next time.
            if reply == b"stale":
                self.stats.stale_batches += 1
            else:
                self.stats.foreign_batches += 1
            self._drop_view(worker)
            return
        if seq >= 0:
            state[0], state[1] = epoch, seq
        elif restarted:
            state[0] = epoch
        self._resume.pop(worker, None)

    def _batch_args(self, worker: Hashable, events: Any) -> list:
        """The script's (cid, medium code, ops) triples for what the batch changed."""
        wid = self._wids[worker]
        per_copy: dict = {}  # (medium, group) -> bytearray of ops

        def out(medium: str, group: Any) -> bytearray:
            buf = per_copy.get((medium, group))
            if buf is None:
                buf = per_copy[(medium, group)] = bytearray()
            return buf

        # Holdings, per copy in the order they changed, as runs of one op.
        pending: dict = {}  # (medium, group) -> [op, keys] of the run not yet written
        for ident, op, keys in self._recorder.ops:
            if ident[0] != worker:
                continue
            where = (ident[1], ident[2])
            run = pending.get(where)
            if op == "C":
                buf = out(*where)
                if run is not None:
                    buf += _run_bytes(run[0], run[1])
                    del pending[where]
                buf += b"C"
            elif run is None:
                out(*where)
                pending[where] = [op, list(keys)]
            elif run[0] == op:
                run[1] += keys
            else:
                per_copy[where] += _run_bytes(run[0], run[1])
                pending[where] = [op, list(keys)]
        for where, (op, keys) in pending.items():
            per_copy[where] += _run_bytes(op, keys)
        # Publisher hashes: each hash the batch named, as the view now maps it (none when
        # no copy of the worker maps any: a publisher of the indexer's own keys).
        view = self.view
        publishing = self._publishing
        if not any(copy.published or (worker, copy.medium, copy.group) in publishing
                   for copy in view._copies_of(worker)):
            events = ()
        for event in events:
            if not isinstance(event, (BlockStored, BlockRemoved)):
                continue
            try:
                medium = _event_medium(event)  # the indexer's tier ("CPU_PINNED" is "CPU")
            except TypeError:
                continue
            try:
                group = _event_group(event)  # the indexer's group (0 is None)
                hashes = list(event.block_hashes)
            except TypeError:
                continue
            copy = view._find(worker, medium, group)
            ident = (worker, medium, group)
            if copy is None or not copy.published and ident not in self._publishing:
                continue  # gone (cleared below), or published under the indexer's keys
            self._publishing.add(ident)
            published = copy.published
            buf = out(medium, group)
            run = _hash_run(hashes) if hashes else None
            if run is not None:
                # hashes of one kind (a SHA-256 publisher's): one record for the lot
                tag, length, data = run
                keys = [published.get(h) for h in hashes]
                head = len(hashes).to_bytes(4, "big") + length.to_bytes(2, "big") + tag
                if None not in keys:
                    buf += b"H" + head + _key_bytes(keys) + data
                    continue
                if keys.count(None) == len(keys):
                    buf += b"G" + head + data
                    continue
            for block_hash in hashes:
                if type(block_hash) not in (int, bytes):
                    try:
                        block_hash = operator.index(block_hash)
                    except TypeError:
                        continue
                data = _hash_bytes(block_hash)
                length = len(data).to_bytes(2, "big")
                key = published.get(block_hash)
                if key is None:
                    buf += b"Q" + length + data
                else:
                    buf += b"P" + _key_bytes([key]) + length + data
        # A copy left empty is dropped whole (its journal too).
        args: list = []
        for (medium, group), buf in per_copy.items():
            if view._find(worker, medium, group) is None and not buf.endswith(b"C"):
                buf += b"C"
            if buf:
                cid, code = self._cid(wid, medium, group)
                args += [cid, code, bytes(buf)]
        return args

    def apply_payload(self, worker: Hashable, payload: bytes, seq: int = -1) -> bool:
        self.view._check_worker(worker)
        try:
            batch = decode_batch(payload, seq)
        except (ValueError, TypeError):
            self.stats.malformed_batches += 1
            return False
        self.apply(worker, batch)
        return True

    def apply_keys(self, worker: Hashable, records: Any) -> None:
        self.apply(worker, records, kind="keys")

    def remove_worker(self, worker: Hashable) -> None:
        if not self._available():
            self.stats.store_errors += 1
            return
        try:
            reply = self._remove(args=[self.prefix, self.token, self._wid(worker)])
        except self._redis_errors:
            self._failed()
            return
        if reply == b"ok":
            self._drop_view(worker)
            self._resume.pop(worker, None)
        else:
            self.stats.foreign_batches += 1

    # -- queries --------------------------------------------------------------------------
    def overlap(self, keys: bytes, medium: Any) -> dict:
        """The overlap of the chain ``keys`` (native int64 bytes, as the block module's
        ``page_hash_bytes`` gives them) on tier(s) ``medium`` (None: every tier)."""
        if not keys:
            return {}
        if not self._available():
            self.stats.blind_lookups += 1
            return {}
        try:
            self._maybe_renew()
            if medium is None:
                media = "*"  # every tier
            else:
                codes = [c for c in (self._mcode(m, create=False) for m in (
                    medium if type(medium) is tuple else (medium,))) if c is not None]
                if not codes:
                    return {}
                media = "," + ",".join(codes) + ","
            if not _LITTLE_ENDIAN:
                keys = _key_bytes(_keys_from_bytes(keys))  # the stored keys are little endian
            reply = self._call(self._overlap_script, [self.prefix, media, keys])
            names = self._names
            result = {}
            for wid, depth in zip(reply[::2], reply[1::2]):
                worker = names.get(wid.decode())
                if worker is None:
                    worker = self._worker_of(wid)
                result[worker] = int(depth)
            return result
        except self._redis_errors:
            self._failed()
            self.stats.blind_lookups += 1
            return {}

    def _held(self) -> dict:
        """``{(wid, medium code): holdings}`` from the counters."""
        raw = self.client.hgetall(self.prefix + b"n")
        held = {}
        for field, value in raw.items():
            if field.startswith(b"h:") and field.count(b":") == 2:
                wid, code = field[2:].decode().split(":")
                held[(wid, code)] = int(value)
        return held

    def workers(self) -> list:
        if not self._available():
            return []
        try:
            held = self._held()
            wids = sorted({wid for (wid, _), n in held.items() if n > 0}, key=int)
            return [self._worker_of(wid) for wid in wids]
        except self._redis_errors:
            self._failed()
            return []

    def blocks_held(self, worker: Hashable, medium: Optional[str]) -> int:
        if not self._available():
            return 0
        try:
            wid = self._wids.get(worker)
            if wid is None:
                raw = self.client.hget(self.prefix + b"workers", "n:" + _worker_name(worker))
                if raw is None:
                    return 0
                wid = raw.decode()
            if medium is None:
                return sum(n for (w, _), n in self._held().items() if w == wid)
            code = self._mcode(medium, create=False)
            if code is None:
                return 0
            raw = self.client.hget(self.prefix + b"n", f"h:{wid}:{code}")
            return 0 if raw is None else int(raw)
        except self._redis_errors:
            self._failed()
            return 0
        except TypeError:
            return 0

    def holds_on(self, medium: str) -> bool:
        """Whether any worker holds a block on tier ``medium`` (one round trip)."""
        if not self._available():
            return False
        try:
            code = self._mcode(medium, create=False)
            if code is None:
                return False
            raw = self.client.hget(self.prefix + b"n", f"m:{code}")
        except self._redis_errors:
            self._failed()
            return False
        return raw is not None and int(raw) > 0

    def __len__(self) -> int:
        if not self._available():
            return 0
        try:
            raw = self.client.hget(self.prefix + b"n", "blocks")
        except self._redis_errors:
            self._failed()
            return 0
        return 0 if raw is None else int(raw)

    def drop_namespace(self) -> None:
        """Delete every key of this namespace (scans the keyspace: for simulations and
        tests, not for a live fleet)."""
        for key in self.client.scan_iter(self.prefix + b"*", count=10_000):
            self.client.unlink(key)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
        self.client.close()

"""``IndexService``: the state of ``radixcache serve`` and its API without HTTP — the
registered publishers and their subscriptions, one ``KvIndexer`` per group of publishers
(see ``identity``), the pools of RFC #1527 publishers, the instances' load and serving
addresses, the blocks placements credit ahead of their events (``pending``), and the calls
every front end (the HTTP API, the Endpoint Picker) makes: ``register``, ``unregister``,
``query``, ``place`` (``select``), ``start_request``/``end_request``, ``ready``. One lock
serialises them with the subscriptions' thread, which applies each batch in one call into
the block module.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .config import ServiceConfig
from .identity import DEFAULT_TENANT, Registration
from .identity import query_key
from .ingest import Ingest, Subscription
from .pending import PendingBlocks, PendingTable
from .pool import POOL_TIERS, PoolBlocks
from .query import Hits, group_blocks, hash_blocks, hits_of
from .select import Chooser, Loads, Selection

MEDIA = ("GPU", "CPU", "DISK")
#: The most of a subscriber's plain batches applied in one call (about 0.1 ms of ingest
#: between two chances for a waiting request to take the lock).
RUN = 16


class ServiceError(Exception):
    """A request the service refuses: ``status`` (an HTTP status), ``field`` (the field it
    concerns, or None) and the message."""

    def __init__(self, status: int, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


@dataclass
class Query:
    """A query: the scope (``tenant``, ``model``, ``block_size``: None for the one block
    size the model is registered with), the blocks' identity (``lora``, ``salt``), and
    ``tokens`` (token ids) or ``seqs`` (standard sequence hashes); ``instance`` limits the
    answer to one instance."""

    model: str
    tokens: Optional[list] = None
    seqs: Optional[list] = None
    block_size: Optional[int] = None
    tenant: str = DEFAULT_TENANT
    lora: Optional[str] = None
    salt: Optional[str] = None
    instance: Any = None


@dataclass
class Group:
    """Publishers sharing one index: ``workers`` maps ``(instance_id, dp_rank)`` to the
    registration; ``tiered`` holds the workers with blocks on other tiers than the device."""

    key: tuple
    indexer: Any
    workers: dict = field(default_factory=dict)
    tiered: set = field(default_factory=set)
    pools: set = field(default_factory=set)  # workers registered as Mooncake publishers
    hashes: Any = None  # a HashIndex with --hash-index
    pending: PendingTable = field(default_factory=PendingTable)  # placements' blocks

    @property
    def block_size(self) -> int:
        return self.key[2]

    @property
    def lora(self) -> Optional[str]:
        return self.key[3]

    @property
    def salt(self) -> Optional[str]:
        return self.key[4]

    @property
    def family(self) -> str:
        return self.key[5]


class _Lock:
    """The service's lock (re-entrant), which the ingest thread lends to a waiting request
    between two batches: a thread that releases a lock and asks for it again gets it back
    before the waiter wakes, so a query could otherwise wait out a whole burst of batches.
    ``first()`` is how a request takes it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()  # guards ``waiting`` (requests may come on threads)
        self.waiting = 0

    def __enter__(self) -> "_Lock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def first(self) -> "_First":
        return _First(self)

    def lend(self) -> None:
        """Held once by this thread: let a waiting request in (within a few milliseconds)."""
        if not self.waiting:
            return
        self._lock.release()
        try:
            until = time.monotonic() + 0.005
            while self.waiting and time.monotonic() < until:
                time.sleep(0.00005)
        finally:
            self._lock.acquire()


class _First:
    def __init__(self, lock: _Lock) -> None:
        self.lock = lock

    def __enter__(self) -> _Lock:
        lock = self.lock
        with lock._count:
            lock.waiting += 1
        try:
            lock._lock.acquire()
        finally:
            with lock._count:
                lock.waiting -= 1
        return lock

    def __exit__(self, *exc: object) -> None:
        self.lock._lock.release()


class IndexService:
    """The service's state and operations; see the module docstring. Thread-safe.

    Args:
        config: The settings (``ServiceConfig``).
        metrics: An object with the ``Metrics`` hooks, or None.
    """

    def __init__(self, config: ServiceConfig, metrics: Any = None) -> None:
        self.config = config
        self.metrics = metrics
        self.lock = _Lock()
        self._regs: dict = {}  # key -> Registration
        self._subs: dict = {}  # key -> Subscription
        self._groups: dict = {}  # group key -> Group
        self._scopes: dict = {}  # scope -> [group keys]
        self._pools: dict = {}  # scope -> PoolBlocks
        self._pool_regs: dict = {}  # scope -> {worker: Registration}
        self.loads = Loads()
        self.chooser = Chooser(config.prefill_weight, config.load_weight, config.host_weight)
        self.pending = PendingBlocks(config.pending_ttl) if config.pending_ttl else None
        self._addresses: dict = {}  # instance id -> its serving address
        self._instances: dict = {}  # serving address -> instance id
        self.shared = None
        self._closed = False
        if config.index is not None:
            from .shared import SharedRegistry

            self.shared = SharedRegistry(config.index, config.namespace)
        self._maintainer: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.ingest = Ingest(self._apply)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Register the static publishers (and, with a shared store, the ones it lists),
        then keep the registrations in step with the store and renew leases."""
        self.ingest.start()
        for reg in self.config.publishers:
            self.register(reg, share=True)
        if self.shared is not None:
            self.sync()
        self._maintainer = threading.Thread(target=self._maintain, daemon=True,
                                            name="serve maintenance")
        self._maintainer.start()

    def close(self) -> None:
        """Stop every subscription and close the indexes (the store's connections)."""
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join(5.0)
        with self.lock:
            self._closed = True
            self._subs.clear()
        self.ingest.stop()
        with self.lock:
            for group in self._groups.values():
                group.indexer.close()
        if self.shared is not None:
            self.shared.close()

    def _maintain(self) -> None:
        """With a store: follow its registrations, renew the leases of quiet publishers and
        collect dead ones, twice a second."""
        while not self._stop.wait(0.5):
            if self.shared is None:
                continue
            try:
                self.sync()
                with self.lock:
                    for group in self._groups.values():
                        group.indexer.renew()
                        group.indexer.collect_expired()
            except Exception:  # the store is down: the next round tries again
                pass

    # -- registrations ----------------------------------------------------------------------
    def registrations(self) -> list:
        with self.lock:
            return list(self._regs.values())

    def register(self, reg: Registration, share: bool = True, exclusive: bool = False) -> bool:
        """Register a publisher and subscribe to it (its buffered batches replayed first).

        Args:
            reg: The registration.
            share: With a store, record it there for the other replicas.
            exclusive: Refuse (409) even an identical registration (Dynamo's behaviour).

        Returns:
            True if new, False if the same registration already existed.

        Raises:
            ServiceError: 403 for an endpoint outside the allow-list, 409 for a conflicting
                registration (another one under the same key or endpoint), 400 when the
                endpoint cannot be subscribed to.
        """
        if not self.config.endpoint_allowed(reg.endpoint):
            raise ServiceError(403, f"endpoint {reg.endpoint!r} is not allowed (see "
                               "--allow-endpoint)", "endpoint")
        if reg.replay_endpoint is not None and not self.config.endpoint_allowed(
                reg.replay_endpoint):
            raise ServiceError(403, f"replay_endpoint {reg.replay_endpoint!r} is not allowed "
                               "(see --allow-endpoint)", "replay_endpoint")
        with self.lock:
            if self._closed:
                raise ServiceError(503, "the service is stopping")
            old = self._regs.get(reg.key)
            if old is not None:
                if old == reg and not exclusive:
                    return False
                raise ServiceError(409, f"instance {reg.key_text} is already registered",
                                   "instance_id")
            for other in self._regs.values():
                if other.endpoint == reg.endpoint:
                    raise ServiceError(409, f"endpoint {reg.endpoint!r} is already registered "
                                       f"for {other.key_text}", "endpoint")
                if reg.address is None or other.address is None:
                    continue
                if other.address == reg.address and other.instance_id != reg.instance_id:
                    raise ServiceError(409, f"address {reg.address!r} is already the address "
                                       f"of instance {other.instance_id!r}", "address")
                if other.instance_id == reg.instance_id and other.address != reg.address:
                    raise ServiceError(409, f"instance {reg.instance_id!r} is registered with "
                                       f"the address {other.address!r}, not "
                                       f"{reg.address!r}", "address")
            self._add(reg)
        if share and self.shared is not None:
            try:
                self.shared.put(reg)
            except ConnectionError as exc:
                self.unregister([reg.key], share=False)
                raise ServiceError(503, str(exc)) from None
        return True

    def _add(self, reg: Registration) -> None:
        """Index and subscribe to ``reg`` (under the lock)."""
        if reg.kind == "Mooncake":
            self._pool_regs.setdefault(reg.scope, {})[reg.worker] = reg
            self._pools.setdefault(reg.scope, PoolBlocks())
        group = self._group(reg)
        group.workers[reg.worker] = reg
        if reg.kind == "Mooncake":
            group.pools.add(reg.worker)
        # With a store the stream resumes where the store says (the hash index, kept in each
        # replica's memory, is rebuilt from the publisher's whole buffer).
        start = None if self.shared is None or group.hashes is not None else \
            group.indexer.resume_seq(reg.worker)
        try:
            sub = Subscription(reg, 0 if start is None else start,
                               decode=reg.kind != "Mooncake" and (
                                   self.shared is not None or group.hashes is not None),
                               probe_interval=self.config.probe_interval)
        except (ValueError, TypeError, RuntimeError, OSError) as exc:
            self._drop(reg)
            raise ServiceError(400, f"cannot subscribe to {reg.endpoint!r}: {exc}",
                               "endpoint") from None
        except Exception as exc:  # zmq.ZMQError (an endpoint ZeroMQ refuses)
            self._drop(reg)
            raise ServiceError(400, f"cannot subscribe to {reg.endpoint!r}: {exc}",
                               "endpoint") from None
        self._regs[reg.key] = reg
        self._subs[reg.key] = sub
        if reg.address is not None:
            self._addresses[reg.instance_id] = reg.address
            self._instances[reg.address] = reg.instance_id
        self.ingest.add(sub)

    def _group(self, reg: Registration) -> Group:
        key = reg.group
        group = self._groups.get(key)
        if group is None:
            from ..router import KvIndexer

            if self.config.index is None:
                indexer = KvIndexer(reg.block_size)
            else:
                indexer = KvIndexer(reg.block_size, store=self.config.index,
                                    namespace=group_namespace(self.config.namespace, key),
                                    lease_s=self.config.lease_s, owner=self.config.owner)
            group = self._groups[key] = Group(key, indexer)
            if self.config.hash_index and reg.kind != "Mooncake":
                from .hashindex import HashIndex

                group.hashes = HashIndex(reg.block_size, self.config.hash_seed, key[5],
                                         (reg.lora, reg.salt))
            self._scopes.setdefault(reg.scope, []).append(key)
        return group

    def _drop(self, reg: Registration) -> None:
        """Forget ``reg``'s blocks, pool entries and group membership (under the lock)."""
        group = self._groups.get(reg.group)
        if group is not None and group.workers.pop(reg.worker, None) is not None:
            if self.pending is not None:
                self.pending.forget(group.pending, reg.worker)
            group.tiered.discard(reg.worker)
            group.pools.discard(reg.worker)
            group.indexer.remove_worker(reg.worker)
            if group.hashes is not None:
                group.hashes.clear(reg.worker)
            if not group.workers:
                group.indexer.close()
                del self._groups[reg.group]
                self._scopes[reg.scope].remove(reg.group)
                if not self._scopes[reg.scope]:
                    del self._scopes[reg.scope]
        pool_regs = self._pool_regs.get(reg.scope)
        if pool_regs is not None and pool_regs.pop(reg.worker, None) is not None:
            self._pools[reg.scope].clear(reg.worker)
            if not pool_regs:
                del self._pool_regs[reg.scope]
                del self._pools[reg.scope]

    def unregister(self, keys: Iterable[tuple], share: bool = True) -> list:
        """Unsubscribe from the publishers under ``keys`` (``(instance_id, tenant,
        dp_rank)``) and drop their blocks; returns the registrations removed."""
        removed = []
        subs = []
        with self.lock:
            for key in keys:
                reg = self._regs.pop(key, None)
                if reg is None:
                    continue
                subs.append(self._subs.pop(key))  # its thread applies no more batches
                self._drop(reg)
                if not any(r.instance_id == reg.instance_id for r in self._regs.values()):
                    self.loads.forget(reg.instance_id)
                if reg.address is not None and not any(
                        r.address == reg.address for r in self._regs.values()):
                    del self._addresses[reg.instance_id]
                    del self._instances[reg.address]
                removed.append(reg)
        for sub in subs:  # outside the lock: the ingest thread may be waiting for it
            self.ingest.remove(sub)
        if share and self.shared is not None:
            for reg in removed:
                try:
                    self.shared.delete(reg)
                except ConnectionError as exc:
                    raise ServiceError(503, f"unregistered here, but not in the store: "
                                       f"{exc}") from None
        return removed

    def find(self, instance_id: Any, tenant: Optional[str] = None,
             dp_rank: Optional[int] = None, model: Optional[str] = None) -> list:
        """The registrations of ``instance_id`` (and of ``tenant``, ``dp_rank``, ``model``
        when given)."""
        with self.lock:
            return [r for r in self._regs.values() if r.instance_id == instance_id
                    and (tenant is None or r.tenant == tenant)
                    and (dp_rank is None or r.dp_rank == dp_rank)
                    and (model is None or r.model == model)]

    def sync(self) -> None:
        """Follow the store's registrations: subscribe to the new ones, drop the gone."""
        records = self.shared.all()
        wanted = {reg.key: reg for reg in records}
        with self.lock:
            if self._closed:
                return
            gone = [k for k in self._regs if k not in wanted]
            new = [r for k, r in wanted.items() if k not in self._regs]
        if gone:
            self.unregister(gone, share=False)
        for reg in new:
            try:
                self.register(reg, share=False)
            except ServiceError:
                pass  # not allowed here, or taken: the replicas' flags differ
        tiered = self.shared.tiered()
        with self.lock:
            for group in self._groups.values():
                group.tiered |= {w for w in group.workers if (group.key, w) in tiered}

    # -- ingest ---------------------------------------------------------------------------
    def _apply(self, sub: Subscription, batches: list) -> None:
        """Apply a run of ``sub``'s batches (on its thread), under one hold of the lock."""
        reg = sub.registration
        worker, reg_key = sub.worker, sub.key
        with self.lock:
            if self._subs.get(reg_key) is not sub:
                return  # unregistered meanwhile
            group = self._groups[sub.group_key]
            indexer = group.indexer
            stats = indexer.stats
            before = (stats.events, stats.stored_blocks, stats.removed_blocks,
                      stats.malformed_batches + stats.malformed_events)
            # Plain payloads (no restart, no store, no hash index) go in runs of up to RUN,
            # one call each; the lock is lent between two calls.
            plain = reg.kind != "Mooncake" and self.shared is None and group.hashes is None
            at, end = 0, len(batches)
            while at < end:
                self.lock.lend()
                if self._subs.get(reg_key) is not sub:
                    break  # unregistered while a request held the lock
                batch = batches[at]
                if plain and not batch.restarted:
                    stop = min(at + RUN, end)
                    for k in range(at + 1, stop):
                        if batches[k].restarted:
                            stop = k
                            break
                    indexer.apply_payloads(worker, [b.payload for b in batches[at:stop]])
                    sub.applied_seq = batches[stop - 1].seq
                    at = stop
                    continue
                at += 1
                if batch.restarted:
                    sub.restarts += 1
                if reg.kind == "Mooncake":
                    self._apply_rfc1527(reg, group, batch)
                elif self.shared is not None:
                    indexer.apply(worker, batch)  # decoded: the store records seq, restarts
                    if worker not in group.tiered and any(
                            getattr(e, "medium", None) not in (None, "GPU")
                            for e in batch.events):
                        group.tiered.add(worker)
                        try:
                            self.shared.mark_tiered(group.key, worker)
                        except ConnectionError:
                            group.tiered.discard(worker)  # marked with its next batch
                else:
                    if batch.restarted:
                        indexer.remove_worker(worker)
                    indexer.apply_payload(worker, batch.payload, batch.seq)
                if group.hashes is not None and reg.kind != "Mooncake":
                    if batch.restarted:
                        group.hashes.clear(worker)
                    group.hashes.apply(worker, batch.events)
                sub.applied_seq = batch.seq
            if self.pending is not None and worker in group.pending.entries \
                    and self.shared is None:
                # The worker's own events may now show what placements credited it with.
                self.pending.confirm(group.pending, worker,
                                     lambda key: worker in indexer._overlap_keys([key], "GPU"))
            if worker not in group.tiered and reg.kind != "Mooncake" and self.shared is None \
                    and stats.stored_blocks != before[1] and any(
                        c.medium != "GPU" and c.size for c in indexer._copies_of(worker)):
                group.tiered.add(worker)  # blocks on another tier: only a store puts them
            sub.events += stats.events - before[0]
            sub.stored += stats.stored_blocks - before[1]
            sub.removed += stats.removed_blocks - before[2]
            sub.malformed += stats.malformed_batches + stats.malformed_events - before[3]

    def _apply_rfc1527(self, reg: Registration, group: Group, batch: Any) -> bool:
        from ..events import ReceivedBatch
        from .rfc1527 import read_batch

        if batch.restarted:
            group.indexer.remove_worker(reg.worker)
            self._pools[reg.scope].clear(reg.worker)
        try:
            actions, skipped = read_batch(batch.payload, reg)
        except ValueError:
            group.indexer.stats.malformed_batches += 1
            return False
        group.indexer.stats.malformed_events += skipped
        pool = self._pools[reg.scope]
        events: list = []
        for action in actions:
            if action[0] == "tokens":
                events.append(action[1])
                continue
            if events:
                group.indexer.apply(reg.worker, ReceivedBatch(batch.seq, 0.0, events, None))
                events = []
            if action[0] == "clear":
                group.indexer.remove_worker(reg.worker)
                pool.clear(reg.worker)
            elif action[0] == "pool_store":
                pool.store(reg.worker, *action[1:])
            else:
                pool.remove(reg.worker, *action[1:])
        if events:
            group.indexer.apply(reg.worker, ReceivedBatch(batch.seq, 0.0, events, None))
        if group.indexer.blocks_held(reg.worker) != group.indexer.blocks_held(reg.worker, "GPU"):
            group.tiered.add(reg.worker)
        return True

    # -- queries --------------------------------------------------------------------------
    def _live(self, reg: Registration, now: float) -> bool:
        """Whether ``reg``'s publisher was heard from within ``--instance-timeout`` (a batch,
        or an answer to the subscription's probes of its replay socket, which an idle live
        publisher gives every probe interval) once its subscription caught up from its first
        replay: always without a timeout."""
        timeout = self.config.instance_timeout
        if timeout is None:
            return True
        sub = self._subs.get(reg.key)
        if sub is None or not sub.caught_up:
            return False
        heard = sub.heard
        return heard is not None and now - heard <= timeout

    def _scope_of(self, q: Query) -> tuple:
        """The scope of ``q``. A query without a block size takes the one its model is
        registered with (ServiceError 404: none, 400: several); one whose block size is not
        its model's (400), or that names an instance the scope lacks (404), is refused. A
        query of a model or tenant nobody registered is a scope without instances."""
        sizes = {scope[2] for scope in list(self._scopes) + list(self._pool_regs)
                 if scope[:2] == (q.tenant, q.model)}
        if q.instance is not None:
            mine = {r.block_size for r in self._regs.values() if r.instance_id == q.instance
                    and (r.tenant, r.model) == (q.tenant, q.model)}
            if not mine:
                raise ServiceError(404, f"instance {q.instance!r} is not registered for model "
                                   f"{q.model!r} and tenant {q.tenant!r}", "instance_id")
            if q.block_size is not None and q.block_size not in mine:
                raise ServiceError(400, f"instance {q.instance!r} is registered with block "
                                   f"size {sorted(mine)[0]}, not {q.block_size}", "block_size")
        if q.block_size is not None:
            if sizes and q.block_size not in sizes:
                raise ServiceError(400, f"model {q.model!r} is registered with block sizes "
                                   f"{sorted(sizes)}, not {q.block_size}", "block_size")
            return (q.tenant, q.model, q.block_size)
        if not sizes:
            raise ServiceError(404, f"no instance of model {q.model!r} is registered for "
                               f"tenant {q.tenant!r}", "model_name")
        if len(sizes) > 1:
            raise ServiceError(400, f"model {q.model!r} is registered with block sizes "
                               f"{sorted(sizes)}: give block_size", "block_size")
        return (q.tenant, q.model, sizes.pop())

    def query(self, q: Query, everyone: bool = True) -> dict:
        """``{instance_id: Hits}`` of the query's scope (only ``q.instance`` when set), per
        ``query``'s rules (tokens, or standard sequence hashes with ``q.seqs``): every live
        instance, or with ``everyone=False`` only those with a hit."""
        with self.lock.first():
            return hits_of(*self.query_rows(q, everyone))

    def query_rows(self, q: Query, everyone: bool = True) -> tuple:
        """``query``'s answer as the block module's ``query_answer`` takes it: ``(rows,
        block_size)``, a row ``(reg.answer_id, blocks)`` per worker (its ``(gpu, cpu,
        disk)`` blocks, or one int for all three)."""
        with self.lock.first():
            scope = self._scope_of(q)
            timeout = self.config.instance_timeout
            now = time.monotonic()
            rows: list = []
            pool = self._pools.get(scope)
            holders = {w for w, r in self._pool_regs.get(scope, {}).items()
                       if self._live(r, now)} if pool is not None else None
            block_size = scope[2]
            seqs_cache: list = []

            def seqs_of() -> list:
                if not seqs_cache:
                    from .stdhash import seq_hashes

                    seqs_cache.append(seq_hashes(q.tokens, block_size, self.config.hash_seed))
                return seqs_cache[0]

            for key in self._scopes.get(scope, ()):
                group = self._groups[key]
                workers = group.workers
                if q.seqs is not None:
                    found = hash_blocks(group, q.seqs, q.lora, q.salt, pool, holders)
                else:
                    found = group_blocks(group, q.tokens, q.lora, q.salt, pool, holders,
                                         seqs_of)
                pools = group.pools
                if not pools and q.instance is None and timeout is None:
                    # Nothing to leave out but workers no longer registered: one pass.
                    if everyone:
                        rows += [(reg.answer_id, found.get(w, 0)) for w, reg in workers.items()]
                    else:
                        get = workers.get
                        rows += [(reg.answer_id, blocks) for w, blocks in found.items()
                                 if (reg := get(w)) is not None]
                    continue
                # Every live worker (Mooncake's answer), or only those found (Dynamo's).
                items = (((w, found.get(w), reg) for w, reg in workers.items()) if everyone
                         else ((w, blocks, workers.get(w)) for w, blocks in found.items()))
                for worker, blocks, reg in items:
                    if reg is None:
                        continue
                    if pools and not blocks and worker in pools and \
                            not group.indexer.blocks_held(worker):
                        continue  # a pool, not an instance
                    if (q.instance is not None and reg.instance_id != q.instance) or (
                            timeout is not None and not self._live(reg, now)):
                        continue
                    rows.append((reg.answer_id, 0 if blocks is None else blocks))
            return rows, block_size

    # -- selection and load ---------------------------------------------------------------
    def select(self, q: Query, policy: Optional[str] = None,
               request_id: Optional[str] = None, output_tokens: int = 0) -> Selection:
        """Pick the instance for a request (``q.tokens`` its prompt): ``place`` among every
        live instance of its scope.

        Raises:
            ServiceError: 404 when no live instance serves the scope, 400 for an unknown
                policy, 409 for a ``request_id`` already running.
        """
        selection = self.place(q, policy, request_id=request_id, output_tokens=output_tokens)
        if self.metrics is not None:
            self.metrics.selection(selection)
        return selection

    def place(self, q: Query, policy: Optional[str] = None, *, request_id: Any = None,
              output_tokens: int = 0, addresses: Any = None, addressed: bool = False,
              limit: Optional[int] = None) -> Selection:
        """Rank the live instances of ``q``'s scope for a request (``q.tokens`` its prompt)
        under ``policy`` and, with ``request_id``, place it on the first.

        Ranking counts, besides what the index holds, the prompts of earlier placements
        whose events have not arrived yet (``pending``). Placing counts the request on the
        chosen instance until ``end_request`` (its load: the tokens its KV cache will span,
        the prompt and ``output_tokens``, as the fleet simulation counts a request) and
        credits the instance with the prompt's blocks.

        Args:
            q: The query (tokens, not hashes).
            policy: A ``SELECT_POLICIES`` name (None: the configured one).
            request_id: The request's id while it runs (any hashable), or None: rank only.
            output_tokens: The tokens it may generate.
            addresses: Only instances whose serving address is in this collection (None:
                any).
            addressed: Only instances registered with a serving address.
            limit: List at most this many (None: all).

        Returns:
            A ``Selection`` (``ranked`` empty when no instance is eligible and
            ``addressed`` or ``addresses`` narrowed them).

        Raises:
            ServiceError: 404 when the scope has no live instance (unless narrowed), 400
                for an unknown policy, 409 for a ``request_id`` already running.
        """
        policy = policy or self.config.policy
        prompt = len(q.tokens)
        with self.lock.first():
            hits = self.query(q)
            narrowed = addressed or addresses is not None
            if narrowed:
                where = self._addresses
                hits = {i: h for i, h in hits.items() if i in where
                        and (addresses is None or where[i] in addresses)}
            if not hits:
                if narrowed:
                    return Selection(None, 0, 0, 0.0, policy, 0)
                raise ServiceError(404, f"no live instance serves model {q.model!r} for "
                                   f"tenant {q.tenant!r}", "model")
            scope = self._scope_of(q) if self.pending is not None else None
            credited, keys_of = self._credited(scope, q, hits)
            try:
                ranked = self.chooser.rank(policy, credited, prompt, self.loads)
            except ValueError as exc:
                raise ServiceError(400, str(exc), "policy") from None
            if limit is not None:
                ranked = ranked[:limit]
            chosen = ranked[0]
            best = credited[chosen]
            rank = max(best.dp, key=lambda r: (best.dp[r], -r)) if best.dp else 0
            loads = self.loads.tokens
            least = min(loads.get(i, 0) for i in hits)
            cached = [min(prompt, credited[i].gpu) for i in ranked]
            added = 0
            if request_id is not None:
                added = prompt + output_tokens
                try:
                    self.loads.start(request_id, chosen, added)
                except ValueError as exc:
                    raise ServiceError(409, str(exc), "request_id") from None
                if self.pending is not None and hits[chosen].dp.get(rank, 0) < \
                        prompt - prompt % scope[2]:
                    self._credit(scope, q, (chosen, rank), keys_of)
            return Selection(chosen, rank, hits[chosen].gpu, self.chooser.cached(best),
                             policy, loads.get(chosen, 0), tuple(ranked), tuple(cached),
                             added, least)

    def _credited(self, scope: Any, q: Query, hits: dict) -> tuple:
        """``hits`` with each instance's device hit raised to what pending placements
        credit its ranks with, and the prompt's block keys per group looked at."""
        keys_of: dict = {}
        if self.pending is None or not len(q.tokens):
            return hits, keys_of
        pending = self.pending
        pending.expire()
        credited = hits
        block_size = scope[2]
        for key in self._scopes.get(scope, ()):
            group = self._groups[key]
            if not group.pending:
                continue
            keys = keys_of[key] = self._prompt_keys(group, q)
            for worker, depth in group.pending.depths(keys).items():
                instance, rank = worker
                exact = hits.get(instance)
                if exact is None:
                    continue
                held = exact.dp.get(rank, 0) // block_size
                if held >= depth:  # the events came: the index says as much
                    pending.confirm_held(group.pending, worker, keys, held)
                    continue
                tokens = depth * block_size
                if credited is hits:
                    credited = dict(hits)
                old = credited[instance]
                if tokens > old.dp.get(rank, 0):
                    new = Hits(max(old.gpu, tokens), max(old.cpu, tokens),
                               max(old.disk, tokens), dict(old.dp))
                    new.dp[rank] = tokens
                    credited[instance] = new
        return credited, keys_of

    def _prompt_keys(self, group: Group, q: Query) -> list:
        """The index keys of ``q``'s full blocks in ``group``, for the request's own LoRA and
        salt (how its engine will key them)."""
        n_blocks = len(q.tokens) // group.block_size
        extra_key, block_extra = query_key(group.family, q.lora, q.salt, n_blocks)
        return group.indexer.block_keys(q.tokens, extra_key, block_extra)

    def _credit(self, scope: tuple, q: Query, worker: tuple, keys_of: dict) -> None:
        """Credit ``worker`` with ``q``'s prompt blocks, in the group its registration is
        in."""
        reg = self._regs.get((worker[0], scope[0], worker[1]))
        if reg is None or reg.scope != scope or reg.kind == "Mooncake":
            return
        group = self._groups.get(reg.group)
        if group is None:
            return
        keys = keys_of.get(reg.group)
        if keys is None:
            keys = self._prompt_keys(group, q)
        self.pending.add(group.pending, worker, keys)

    def start_request(self, request_id: str, instance_id: Any, tokens: int) -> None:
        """A request started on ``instance_id`` (chosen elsewhere): count its tokens.

        Raises:
            ServiceError: 404 for an unregistered instance, 409 for a running request_id.
        """
        with self.lock:
            if not any(r.instance_id == instance_id for r in self._regs.values()):
                raise ServiceError(404, f"instance {instance_id!r} is not registered",
                                   "instance_id")
            try:
                self.loads.start(request_id, instance_id, tokens)
            except ValueError as exc:
                raise ServiceError(409, str(exc), "request_id") from None

    def end_request(self, request_id: str) -> Optional[tuple]:
        """A request ended; ``(instance_id, tokens)`` it counted, or None if unknown."""
        with self.lock:
            return self.loads.end(request_id)

    def move_request(self, request_id: Any, instance_id: Any) -> bool:
        """A running request was served by ``instance_id`` (not where it was placed): its
        load moves there. False for an unknown request."""
        with self.lock:
            return self.loads.move(request_id, instance_id)

    # -- serving addresses (the Endpoint Picker's endpoints) -------------------------------
    def address(self, instance_id: Any) -> Optional[str]:
        """The serving address ``instance_id`` is registered with, or None."""
        return self._addresses.get(instance_id)

    def instance_at(self, address: str) -> Any:
        """The instance registered with the serving ``address``, or None."""
        return self._instances.get(address)

    def caught_up(self) -> bool:
        """Whether every subscription's first replay has ended (answered, or abandoned when
        its publisher stayed silent) and what it brought is applied."""
        with self.lock:
            return all(sub.caught_up for sub in self._subs.values())

    def endpoints(self) -> dict:
        """Per serving address: ``{"instance_id", "live" (any of its publishers heard from
        within --instance-timeout, once caught up from its first replay), "events_seq" (the
        last batch applied from its publishers, None before one), "blocks" (held, every
        tier), "load"}``."""
        with self.lock:
            now = time.monotonic()
            out: dict = {}
            for key, reg in self._regs.items():
                if reg.address is None:
                    continue
                entry = out.get(reg.address)
                if entry is None:
                    entry = out[reg.address] = {
                        "instance_id": reg.instance_id, "live": False, "events_seq": None,
                        "blocks": 0, "load": self.loads.tokens.get(reg.instance_id, 0)}
                entry["live"] = entry["live"] or self._live(reg, now)
                seq = self._subs[key].applied_seq
                if seq is not None and (entry["events_seq"] is None
                                        or seq > entry["events_seq"]):
                    entry["events_seq"] = seq
                group = self._groups.get(reg.group)
                if group is not None:
                    entry["blocks"] += group.indexer.blocks_held(reg.worker)
            return out

    # -- state ------------------------------------------------------------------------------
    def ready(self) -> tuple:
        """``(ready, problems)``: every registered publisher's subscription running, and the
        store reachable."""
        problems = []
        with self.lock:
            if self._subs and not self.ingest.alive:
                problems.append("the ingest thread is not running")
        if self.shared is not None and not self.shared.ping():
            problems.append("the index store is unreachable")
        return not problems, problems

    def workers(self) -> list:
        """Every registration with its subscription's state and blocks held per tier."""
        with self.lock:
            now = time.monotonic()
            out = []
            for key, reg in self._regs.items():
                sub = self._subs[key]
                group = self._groups.get(reg.group)
                blocks = {m: group.indexer.blocks_held(reg.worker, m) for m in MEDIA} \
                    if group is not None else {}
                pool = self._pools.get(reg.scope)
                if pool is not None and reg.kind == "Mooncake":
                    for tier in POOL_TIERS:
                        blocks[tier] = blocks.get(tier, 0) + pool.count(reg.worker, tier)
                out.append({**reg.as_record(), "live": self._live(reg, now),
                            "subscribed": self.ingest.alive and not sub.closed.is_set(),
                            "batches": sub.batches,
                            "gaps": sub.subscriber.gap_count,
                            "replayed": sub.subscriber.replayed,
                            "restarts": sub.subscriber.resets,
                            "malformed": sub.malformed + sub.subscriber.malformed,
                            "blocks": blocks})
            return out

    def snapshot(self) -> list:
        """What the metrics read at a scrape: ``(registration, subscription, blocks per
        tier)`` and the index's sizes (under the lock)."""
        return self.workers()

    def index_sizes(self) -> dict:
        """Distinct blocks per group (``len(indexer)``) and pool blocks, by scope."""
        with self.lock:
            sizes: dict = {}
            for group in self._groups.values():
                key = group.key[:3]
                sizes[key] = sizes.get(key, 0) + len(group.indexer)
            for scope, pool in self._pools.items():
                sizes[scope] = sizes.get(scope, 0) + len(pool)
            return sizes


def group_namespace(prefix: str, key: tuple) -> str:
    """The store namespace of a group: ``prefix`` and a digest of the group key (a str
    without ``:``, the same in every replica)."""
    digest = hashlib.sha256(repr(key).encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{prefix}.{digest}"

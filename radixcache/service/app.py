"""The HTTP front end: an ASGI application (served by uvicorn) over an ``IndexService``.

Routing is one dict lookup and the handlers are plain functions: measured against Starlette
on this service's hot path (an 8,192-token ``/query``), its request and response objects
cost more than the query itself (see docs/service.md). Bodies are size-limited before they
are read, decoded by ``msgspec`` into the dialects' structs (``api``), and every refusal is
a JSON ``{"error": ..., "field": ...}`` with a 4xx status; changes need the bearer token
when one is set.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from typing import Any, Callable, Optional

import msgspec

from . import api
from .config import ServiceConfig
from .identity import DEFAULT_TENANT, Registration
from .state import IndexService, Query, ServiceError

_JSON = [(b"content-type", b"application/json")]
_log = logging.getLogger("radixcache.serve")
_encode = msgspec.json.Encoder().encode


class _Refused(Exception):
    def __init__(self, status: int, message: str, field: Optional[str] = None,
                 headers: Optional[list] = None) -> None:
        super().__init__(message)
        self.status, self.field, self.headers = status, field, headers or []


def response_headers(headers: list, body: bytes) -> list:
    """The response headers of an answer: ``headers``, the JSON content type unless they
    name another first, and the body's length (a fixed-length body, not chunks)."""
    if not headers or headers[0][0] != b"content-type":
        headers = headers + _JSON
    return headers + [(b"content-length", b"%d" % len(body))]


def _error_body(message: str, field: Optional[str]) -> bytes:
    body = {"error": message}
    if field is not None:
        body["field"] = field
    return _encode(body)


class App:
    """The ASGI application of ``radixcache serve``.

    Args:
        service: The state (started on the lifespan's startup, closed on its shutdown).
        metrics: A ``metrics.Metrics``, or None (then ``/metrics`` answers 404).
        api: Serve the index's API; False: only ``/health``, ``/ready``, ``/metrics`` and
            ``/workers`` (the rest answers 404).
    """

    def __init__(self, service: IndexService, metrics: Any = None, api: bool = True) -> None:
        self.service = service
        self.config: ServiceConfig = service.config
        self.metrics = metrics
        token = self.config.token
        self._token = None if token is None else b"Bearer " + token.encode()
        # (method, path) -> (handler, changes state, runs in a thread, metric name)
        self.routes: dict = {
            ("POST", "/register"): (self.register, True, True, None),
            ("POST", "/unregister"): (self.unregister, True, True, None),
            ("POST", "/query"): (self.query, False, False, "/query"),
            ("POST", "/query_by_hash"): (self.query_by_hash, False, False, "/query_by_hash"),
            ("POST", "/select"): (self.select, None, False, "/select"),
            ("POST", "/load"): (self.load, True, False, None),
            ("GET", "/health"): (self.health, False, False, None),
            ("GET", "/ready"): (self.ready, False, False, None),
            ("GET", "/metrics"): (self.metrics_text, False, False, None),
            ("GET", "/workers"): (self.workers, False, False, None),
        }
        if not api:
            self.routes = {k: v for k, v in self.routes.items() if k[0] == "GET"}
        self._paths = {path for _, path in self.routes}

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        metric = None
        try:
            route = self.routes.get((scope["method"], scope["path"]))
            if route is None:
                if scope["path"] in self._paths:
                    raise _Refused(405, f"{scope['method']} is not allowed on {scope['path']}",
                                   None, [(b"allow", ", ".join(
                                       m for m, p in self.routes if p == scope["path"]
                                   ).encode())])
                raise _Refused(404, f"no such endpoint: {scope['path']}")
            handler, changes, threaded, metric = route
            body = await self._body(scope, receive)
            if threaded:
                self._check_token(changes, body, scope["headers"])
                status, out, headers = await asyncio.get_running_loop().run_in_executor(
                    None, handler, body)
            else:
                status, out, headers = self.answer(route, body, scope["headers"],
                                                   scope["method"], scope["path"])
        except Exception as exc:
            status, out, headers = self._failed(exc, scope.get("method"), scope.get("path"))
        await send({"type": "http.response.start", "status": status,
                    "headers": response_headers(headers, out)})
        await send({"type": "http.response.body", "body": out})
        self.observe(metric, status, started)

    def answer(self, route: tuple, body: bytes, headers: list, method: str,
               path: str) -> tuple:
        """``(status, body, headers)`` of a request to ``route`` (an entry of ``routes``)
        whose whole ``body`` and request ``headers`` (lower-case names) are read: what
        either front end sends (see ``frontend``), refusals included."""
        handler, changes = route[0], route[1]
        try:
            self._check_token(changes, body, headers)
            return handler(body)
        except Exception as exc:
            return self._failed(exc, method, path)

    def observe(self, metric: Optional[str], status: int, started: float) -> None:
        """Count a request to an endpoint with a latency metric, answered at its status."""
        if metric is not None and self.metrics is not None and status < 400:
            self.metrics.observe(metric, time.perf_counter() - started)

    def _check_token(self, changes: Optional[bool], body: bytes, headers: list) -> None:
        if changes or (changes is None and b'"request_id"' in body):
            self._authorize(headers)

    @staticmethod
    def _failed(exc: Exception, method: Optional[str], path: Optional[str]) -> tuple:
        """The answer to a request that raised ``exc``: its 4xx, or a logged 500."""
        if isinstance(exc, (_Refused, ServiceError, api.BadRequest)):
            return exc.status, _error_body(str(exc), exc.field), getattr(exc, "headers", [])
        # A bug: logged; the client gets a 500 and the service goes on.
        _log.error("%s %s failed", method, path, exc_info=exc)
        return 500, _error_body("internal error", None), []

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await asyncio.get_running_loop().run_in_executor(None, self.service.start)
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                # What the imports made lives as long as the process: out of the collector's
                # full passes, which would otherwise walk all of it during a request.
                gc.collect()
                gc.freeze()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.get_running_loop().run_in_executor(None, self.service.close)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _body(self, scope: dict, receive: Callable) -> bytes:
        limit = self.config.max_body
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Refused(400, "content-length is not a number") from None
                if length > limit:
                    raise _Refused(413, f"the body has {length} bytes, more than the "
                                   f"{limit} allowed (--max-body)")
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(400, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"the body has more than the {limit} bytes allowed "
                               "(--max-body)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _authorize(self, headers: list) -> None:
        if self._token is None:
            return
        for name, value in headers:
            if name == b"authorization" and hmac.compare_digest(value, self._token):
                return
        raise _Refused(401, "this change needs the service's bearer token "
                       "(Authorization: Bearer ...)", "authorization",
                       [(b"www-authenticate", b"Bearer")])

    def _tokens(self, tokens: list) -> list:
        """``tokens`` if not too many (their values are checked where they are read)."""
        if len(tokens) > self.config.max_tokens:
            raise _Refused(400, f"{len(tokens)} token ids, more than the "
                           f"{self.config.max_tokens} allowed (--max-tokens)", "token_ids")
        return tokens

    # -- handlers: each takes the body, returns (status, body, headers) ---------------------
    def register(self, body: bytes) -> tuple:
        service = self.service
        if api.is_dynamo(body):
            req = api.decode(body, api.DynamoRegister)
            api.check_u64([req.instance_id], "instance_id", signed=False)
            kind = req.type or "vLLM"
            # Dynamo accepts a salt here and mixes it into nothing (its engines salt their own
            # hashes): a Dynamo client gets the answers it gets from Dynamo.
            reg = self._registration(req.instance_id, req.endpoint, req.replay_endpoint, kind,
                                     req.model_name, req.block_size, req.routing_group,
                                     req.dp_rank or 0, req.lora_name, None, req.address)
            service.register(reg, exclusive=True)
            return 201, _encode({"status": "ok"}), []
        req = api.decode(body, api.MooncakeRegister)
        reg = self._registration(req.instance_id, req.endpoint, req.replay_endpoint, req.type,
                                 req.modelname, req.block_size,
                                 req.tenant_id or DEFAULT_TENANT, req.dp_rank, req.lora_name,
                                 req.additionalsalt, req.address)
        service.register(reg)
        return 200, _encode({"status": "registered successfully",
                             "instance_id": req.instance_id}), []

    @staticmethod
    def _registration(instance: Any, endpoint: str, replay: Optional[str], kind: str,
                      model: str, block_size: int, tenant: str, dp_rank: int,
                      lora: Optional[str], salt: Optional[str],
                      address: Optional[str]) -> Registration:
        from .identity import PUBLISHER_TYPES, check_address

        if kind not in PUBLISHER_TYPES:
            raise _Refused(400, f"type must be one of {', '.join(PUBLISHER_TYPES)}, got "
                           f"{kind!r}", "type")
        if address:
            try:
                check_address(address)
            except ValueError as exc:
                raise _Refused(400, str(exc), "address") from None
        return Registration(instance, endpoint, replay or None, kind, model, block_size,
                            tenant or DEFAULT_TENANT, dp_rank, lora or None, salt or None,
                            address or None)

    def unregister(self, body: bytes) -> tuple:
        service = self.service
        if api.is_dynamo(body):
            req = api.decode(body, api.DynamoUnregister)
            api.check_u64([req.instance_id], "instance_id", signed=False)
            regs = service.find(req.instance_id, req.routing_group, req.dp_rank,
                                req.model_name)
            if not regs:
                raise _Refused(404, f"instance {req.instance_id} not found", "instance_id")
            service.unregister([r.key for r in regs])
            return 200, _encode({"status": "ok"}), []
        req = api.decode(body, api.MooncakeUnregister)
        key = (req.instance_id, req.tenant_id or DEFAULT_TENANT, req.dp_rank or 0)
        removed = service.unregister([key])
        if not removed:
            raise _Refused(404, f"service not found: {key[0]}|{key[1]}|{key[2]}", "instance_id")
        return 200, _encode({"status": "unregistered successfully",
                             "removed_instances": [r.key_text for r in removed]}), []

    def query(self, body: bytes) -> tuple:
        split = api.split_ids(body)  # its head is the body less the ids: quicker to search
        if api.is_dynamo(body if split is None else split[0]):
            req = api.decode_tokens(body, api.DynamoQuery, split)
            found = self.service.query_rows(Query(
                req.model_name, tokens=self._tokens(req.token_ids), block_size=req.block_size,
                tenant=req.routing_group, lora=req.lora_name or None,
                salt=req.cache_salt or None), everyone=False)
            return 200, api.dynamo_answer(*found), []
        req = api.decode_tokens(body, api.MooncakeQuery, split)
        self._no_lora_id(req)
        tenant = req.tenant_id or DEFAULT_TENANT
        found = self.service.query_rows(Query(req.model, tokens=self._tokens(req.token_ids),
                                              block_size=req.block_size, tenant=tenant,
                                              lora=req.lora_name or None,
                                              salt=req.cache_salt or None,
                                              instance=req.instance_id))
        return 200, api.mooncake_answer(tenant, *found), []

    @staticmethod
    def _no_lora_id(req: Any) -> None:
        if req.lora_id is not None:
            raise _Refused(400, "lora_id cannot scope a query here (blocks are scoped by the "
                           "adapter's name): send lora_name", "lora_id")

    def query_by_hash(self, body: bytes) -> tuple:
        from .stdhash import roll, unsigned

        if api.is_dynamo(body):
            req = api.decode(body, api.DynamoQueryByHash)
            if req.cache_salt is not None:
                raise _Refused(400, "cache_salt is not taken by /query_by_hash: the hashes "
                               "already include it", "cache_salt")
            local = [unsigned(h) for h in api.check_u64(self._tokens(req.block_hashes),
                                                        "block_hashes")]
            found = self.service.query_rows(Query(req.model_name,
                                                  seqs=roll(local, self.config.hash_seed),
                                                  block_size=req.block_size,
                                                  tenant=req.routing_group,
                                                  lora=req.lora_name or None), everyone=False)
            return 200, api.dynamo_answer(*found), []
        req = api.decode(body, api.MooncakeQueryByHash)
        self._no_lora_id(req)
        field = "seq_hashes" if req.seq_hashes is not None else "block_hash"
        hashes = req.seq_hashes if req.seq_hashes is not None else req.block_hash
        if hashes is None:
            raise _Refused(400, "seq_hashes is required", "seq_hashes")
        api.check_u64(hashes, field)
        tenant = req.tenant_id or DEFAULT_TENANT
        found = self.service.query_rows(Query(req.model, seqs=[unsigned(h) for h in
                                                               self._tokens(hashes)],
                                              block_size=req.block_size, tenant=tenant,
                                              lora=req.lora_name or None,
                                              salt=req.cache_salt or None,
                                              instance=req.instance_id))
        return 200, api.mooncake_answer(tenant, *found), []

    def select(self, body: bytes) -> tuple:
        req = api.decode_tokens(body, api.SelectRequest)
        model = req.model if req.model is not None else req.model_name
        if not model:
            raise _Refused(400, "model (or model_name) is required", "model")
        tenant = req.tenant_id or req.routing_group or DEFAULT_TENANT
        chosen = self.service.select(
            Query(model, tokens=self._tokens(req.token_ids), block_size=req.block_size,
                  tenant=tenant, lora=req.lora_name or None, salt=req.cache_salt or None),
            req.policy, req.request_id, req.output_tokens)
        return 200, _encode({"instance_id": chosen.instance_id, "dp_rank": chosen.dp_rank,
                             "overlap_tokens": chosen.overlap_tokens,
                             "cached_tokens": chosen.cached_tokens, "policy": chosen.policy,
                             "load": chosen.load, "request_id": req.request_id}), []

    def load(self, body: bytes) -> tuple:
        req = api.decode(body, api.LoadReport)
        if req.event == "start":
            if req.instance_id is None:
                raise _Refused(400, "instance_id is required to start a request",
                               "instance_id")
            self.service.start_request(req.request_id, req.instance_id, req.tokens)
            instance = req.instance_id
        else:
            ended = self.service.end_request(req.request_id)
            if ended is None:
                raise _Refused(404, f"request_id {req.request_id!r} is not running",
                               "request_id")
            instance = ended[0]
        with self.service.lock:
            load = self.service.loads.tokens.get(instance, 0)
        return 200, _encode({"status": "ok", "instance_id": instance, "load": load}), []

    def health(self, body: bytes) -> tuple:
        return 200, b'{"status":"ok"}', []

    def ready(self, body: bytes) -> tuple:
        ok, problems = self.service.ready()
        return (200 if ok else 503), _encode({"ready": ok, "problems": problems}), []

    def metrics_text(self, body: bytes) -> tuple:
        if self.metrics is None:
            raise _Refused(404, "metrics are off")
        out, content_type = self.metrics.render()
        return 200, out, [(b"content-type", content_type.encode())]

    def workers(self, body: bytes) -> tuple:
        return 200, _encode(self.service.workers()), []


def make_app(config: ServiceConfig, metrics: bool = True, api: bool = True) -> App:
    """An ``App`` with its ``IndexService`` (and ``Metrics``, needing prometheus-client);
    ``api``: see ``App``."""
    collector = None
    if metrics:
        from .metrics import Metrics

        collector = Metrics()
    service = IndexService(config, collector)
    if collector is not None:
        collector.service = service
    return App(service, collector, api)

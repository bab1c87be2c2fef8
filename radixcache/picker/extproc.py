"""The Endpoint Picker's gRPC server: Envoy's ``ext_proc`` protocol and gRPC health.

One ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream per HTTP request, as the
Gateway API Inference Extension's Endpoint Picker protocol specifies it:

1. **Request headers**: the path, the subset the gateway allows
   (``x-gateway-destination-endpoint-subset`` under the ``envoy.lb.subset_hint`` metadata
   namespace: a list of ``ip:port``, or a comma-separated string), and the request's
   InferenceObjective header. A request without a body (or a filter that sends none) is
   picked here, on load alone.
2. **Request body**, in ``FULL_DUPLEX_STREAMED`` mode (chunks as they arrive, answered once
   the body is whole: the headers' answer, then the body streamed back unchanged) or
   ``BUFFERED`` mode (headers answered at once, the body's answer carries the header). A body
   over ``max_body_bytes`` is answered 413 at once; the body is read and tokenized
   (``RequestReader``), a bad one answered 400 or 404 as an immediate response.
3. **The pick**: ``Picker.pick`` ranks the eligible endpoints; the answer sets the
   ``x-gateway-destination-endpoint`` header to the ordered list (``ip:port,ip:port``, best
   first, at most ``max_endpoints``) and the same value under ``envoy.lb`` in the dynamic
   metadata. No eligible endpoint: 503; a sheddable request (its objective listed in
   ``sheddable``) while every eligible endpoint carries at least ``shed_load`` tokens: 429.
4. **Response headers**: the endpoint that served (``x-gateway-destination-endpoint-served``
   under ``envoy.lb`` in the metadata Envoy forwards, else a response header of that name)
   is reported with ``Picker.served``; a fallback is counted.
5. **The end of the stream** (Envoy closes it when the HTTP request ends, or gives up):
   ``Picker.finished`` releases the request's load.

``STREAMED`` and ``BUFFERED_PARTIAL`` request bodies reach the picker only after Envoy has
chosen the upstream (or in part), so in those modes, with no body sent, and for paths other
than the two completions endpoints, the request is picked at its headers, on load alone.

gRPC health (``grpc.health.v1.Health``): ``liveness`` is SERVING while the process answers;
``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and the server as a whole
(``""``) are SERVING once ``Picker.ready()`` (NOT_SERVING before).

grpcio, grpcio-health-checking and xds-protos (Envoy's message types) are imported when the
server is made (``radixcache[epp]``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from .metrics import PickerMetrics
from .openai import OTHER, PromptRequest, RequestError, RequestReader
from .picking import Pick, Picker

__all__ = ["ENDPOINT_HEADER", "EXT_PROC_SERVICE", "ExtProcService", "PickerOptions",
           "start_server"]

ENDPOINT_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE, "")

_FULL_DUPLEX = 4  # ProcessingMode.FULL_DUPLEX_STREAMED
_BUFFERED = 2  # ProcessingMode.BUFFERED


@dataclass(frozen=True)
class PickerOptions:
    """How the server answers.

    Attributes:
        max_endpoints: How many endpoints the answer lists (the first and its fallbacks).
        shed_load: Tokens in flight at which an endpoint counts as saturated for sheddable
            requests (None: never shed).
        sheddable: The InferenceObjective names (``x-gateway-inference-objective``) whose
            requests may be shed.
    """

    max_endpoints: int = 3
    shed_load: Optional[int] = None
    sheddable: frozenset = field(default_factory=frozenset)


def _protos() -> Any:
    """Envoy's and gRPC's modules, imported on first use."""
    try:
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2
        from envoy.type.v3 import http_status_pb2
        from google.protobuf import struct_pb2
    except ModuleNotFoundError as exc:  # pragma: no cover - the extra is missing
        raise ModuleNotFoundError(
            "the Endpoint Picker needs grpcio, grpcio-health-checking and xds-protos: pip "
            "install 'radixcache[epp]'", name=exc.name) from exc

    class Protos:
        base = base_pb2
        ext_proc = external_processor_pb2
        http_status = http_status_pb2
        struct = struct_pb2

    return Protos


def _header(headers: Any, name: str) -> Optional[str]:
    for header in headers.headers:
        if header.key == name:
            return header.raw_value.decode("utf-8", "replace") if header.raw_value \
                else header.value
    return None


def _metadata_value(message: Any, namespace: str, key: str) -> Any:
    """A value Envoy forwarded in ``metadata_context`` (None when absent), as Python."""
    filters = message.metadata_context.filter_metadata
    if namespace not in filters:
        return None
    fields = filters[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [item.string_value for item in value.list_value.values
                if item.WhichOneof("kind") == "string_value"]
    return None


def _address_list(value: Any) -> Optional[list]:
    """``ip:port`` entries of a subset or served value: a list, or comma-separated text."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


class _Exchange:
    """What one stream has learnt of its request."""

    __slots__ = ("body", "body_size", "candidates", "duplex", "objective", "path", "pick",
                 "replied", "response_duplex")

    def __init__(self) -> None:
        self.path = "/"
        self.objective: Optional[str] = None
        self.candidates: Optional[list] = None
        self.duplex = False  # FULL_DUPLEX_STREAMED: the body comes back through us
        self.response_duplex = False  # the same, for the response's body
        self.body: list = []
        self.body_size = 0
        self.pick: Optional[Pick] = None
        self.replied = False  # the request's headers were answered


class ExtProcService:
    """The ``ExternalProcessor`` servicer (``Process``) over a ``Picker``.

    Args:
        picker: The ``Picker``.
        reader: The ``RequestReader`` (tokenizer, models, body limit).
        options: The ``PickerOptions``.
        metrics: The ``PickerMetrics`` to update (default: new ones).
    """

    def __init__(self, picker: Picker, reader: RequestReader,
                 options: PickerOptions = PickerOptions(),
                 metrics: Optional[PickerMetrics] = None) -> None:
        self.picker = picker
        self.reader = reader
        self.options = options
        self.metrics = metrics or PickerMetrics()
        self._pb = pb = _protos()
        # The answers that change nothing, built once (gRPC only reads them).
        self._continue = {
            "request_headers": pb.ext_proc.ProcessingResponse(
                request_headers=pb.ext_proc.HeadersResponse()),
            "response_headers": pb.ext_proc.ProcessingResponse(
                response_headers=pb.ext_proc.HeadersResponse()),
            "request_trailers": pb.ext_proc.ProcessingResponse(
                request_trailers=pb.ext_proc.TrailersResponse()),
            "response_trailers": pb.ext_proc.ProcessingResponse(
                response_trailers=pb.ext_proc.TrailersResponse()),
            "request_body": pb.ext_proc.ProcessingResponse(
                request_body=pb.ext_proc.BodyResponse()),
            "response_body": pb.ext_proc.ProcessingResponse(
                response_body=pb.ext_proc.BodyResponse())}

    # -- the stream ----------------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[Any],
                      context: Any) -> AsyncIterator[Any]:
        exchange = _Exchange()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    responses = self._request_headers(message, exchange)
                elif kind == "request_body":
                    responses = self._request_body(message.request_body, exchange)
                elif kind == "request_trailers":
                    responses = self._request_trailers(exchange)
                elif kind == "response_headers":
                    responses = self._response_headers(message, exchange)
                elif kind == "response_body":
                    responses = [self._body_answer(message.response_body,
                                                   exchange.response_duplex, response=True)]
                elif kind == "response_trailers":
                    responses = [self._continue["response_trailers"]]
                else:
                    continue
                for response in responses:
                    yield response
                    if response.WhichOneof("response") == "immediate_response":
                        return
        except Exception:  # a bug: counted; Envoy follows its failure_mode_allow
            self.metrics.errors.inc()
            raise
        finally:
            self._finish(exchange)

    def _finish(self, exchange: _Exchange) -> None:
        pick, exchange.pick = exchange.pick, None
        if pick is not None:
            self.metrics.in_flight.dec()
            self.picker.finished(pick)

    def _request_headers(self, message: Any, exchange: _Exchange) -> list:
        headers = message.request_headers
        exchange.path = _header(headers.headers, ":path") or "/"
        exchange.objective = _header(headers.headers, OBJECTIVE_HEADER)
        exchange.candidates = _address_list(
            _metadata_value(message, SUBSET_NAMESPACE, SUBSET_KEY))
        config = message.protocol_config
        mode = config.request_body_mode
        exchange.duplex = mode == _FULL_DUPLEX
        exchange.response_duplex = config.response_body_mode == _FULL_DUPLEX
        if (headers.end_of_stream or mode not in (_FULL_DUPLEX, _BUFFERED)
                or self.reader.kind_of(exchange.path) == "other"):
            # No body to read before the upstream is chosen, or none worth reading: picked
            # on load alone, now.
            return self._answer(OTHER, exchange)
        if exchange.duplex:
            return []  # answered once the body is whole
        exchange.replied = True
        return [self._continue["request_headers"]]

    def _request_body(self, body: Any, exchange: _Exchange) -> list:
        if exchange.pick is not None:  # picked at the headers: the body only passes
            return [self._body_answer(body, exchange.duplex)]
        exchange.body.append(body.body)
        exchange.body_size += len(body.body)
        if exchange.body_size > self.reader.max_body_bytes:
            return [self._refuse(self.reader.too_large(exchange.body_size))]
        if not body.end_of_stream and exchange.duplex:
            return []
        # BUFFERED sends the body whole (short of the end only when trailers follow).
        return self._read_and_answer(exchange, body.end_of_stream)

    def _request_trailers(self, exchange: _Exchange) -> list:
        responses = []
        if exchange.pick is None and exchange.duplex:
            responses = self._read_and_answer(exchange, end_of_stream=False)
            if responses and responses[0].WhichOneof("response") == "immediate_response":
                return responses
        responses.append(self._continue["request_trailers"])
        return responses

    def _read_and_answer(self, exchange: _Exchange, end_of_stream: bool) -> list:
        body = b"".join(exchange.body)
        start = time.perf_counter()
        try:
            request = self.reader.read(exchange.path, body)
        except RequestError as exc:
            return [self._refuse(exc)]
        self.metrics.tokenize_seconds.observe(time.perf_counter() - start)
        responses = self._answer(request, exchange, body if exchange.duplex else None,
                                 end_of_stream)
        exchange.body = []
        return responses

    def _answer(self, request: PromptRequest, exchange: _Exchange,
                body: Optional[bytes] = None, end_of_stream: bool = True) -> list:
        """Pick, then the responses that carry the endpoints (or refuse the request)."""
        metrics = self.metrics
        options = self.options
        start = time.perf_counter()
        try:
            pick = self.picker.pick(request.model, request.token_ids, lora=request.lora,
                                    salt=request.salt, candidates=exchange.candidates,
                                    output_tokens=request.max_tokens,
                                    max_endpoints=options.max_endpoints)
        except RequestError as exc:  # a model no instance is registered for, ...
            return [self._refuse(exc)]
        if not pick.endpoints:
            metrics.unavailable.inc()
            return [self._refuse(RequestError(
                503, "no endpoint of the pool is eligible for this request", "unavailable",
                "no_endpoint"))]
        metrics.in_flight.inc()
        exchange.pick = pick
        if (options.shed_load is not None and exchange.objective in options.sheddable
                and pick.least_load >= options.shed_load):
            self._finish(exchange)
            metrics.shed.inc()
            return [self._refuse(RequestError(
                429, "every endpoint is saturated and this request's objective is sheddable",
                "rate_limit_exceeded", "shed"))]
        metrics.picked(pick.endpoints[0], pick.prompt_tokens, pick.cached_tokens[0],
                       time.perf_counter() - start)
        pb = self._pb
        value = ",".join(pick.endpoints)
        mutation = pb.ext_proc.HeaderMutation(set_headers=[pb.base.HeaderValueOption(
            header=pb.base.HeaderValue(key=ENDPOINT_HEADER, raw_value=value.encode("ascii")),
            append_action=pb.base.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)])
        metadata = pb.struct.Struct()  # {LB_NAMESPACE: {ENDPOINT_HEADER: value}}
        metadata.fields[LB_NAMESPACE].struct_value.fields[ENDPOINT_HEADER].string_value = value
        common = pb.ext_proc.CommonResponse(header_mutation=mutation)
        if exchange.replied:  # BUFFERED: the headers wait for this body answer
            return [pb.ext_proc.ProcessingResponse(
                request_body=pb.ext_proc.BodyResponse(response=common),
                dynamic_metadata=metadata)]
        exchange.replied = True
        responses = [pb.ext_proc.ProcessingResponse(
            request_headers=pb.ext_proc.HeadersResponse(response=common),
            dynamic_metadata=metadata)]
        if body is not None:  # FULL_DUPLEX_STREAMED: the body goes on through us
            responses.append(self._streamed(body, end_of_stream))
        return responses

    def _response_headers(self, message: Any, exchange: _Exchange) -> list:
        pick = exchange.pick
        if pick is not None:
            served = _address_list(_metadata_value(message, LB_NAMESPACE, SERVED_KEY)) or \
                _address_list(_header(message.response_headers.headers, SERVED_KEY))
            if served:
                endpoint = served[0]
                self.metrics.served.labels(endpoint).inc()
                if endpoint != pick.endpoints[0]:
                    self.metrics.fallbacks.inc()
                self.picker.served(pick, endpoint)
        return [self._continue["response_headers"]]

    # -- messages ------------------------------------------------------------------------
    def _streamed(self, data: bytes, end_of_stream: bool, response: bool = False) -> Any:
        pb = self._pb.ext_proc
        answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=data,
                                                      end_of_stream=end_of_stream))))
        if response:
            return pb.ProcessingResponse(response_body=answer)
        return pb.ProcessingResponse(request_body=answer)

    def _body_answer(self, body: Any, duplex: bool, response: bool = False) -> Any:
        """A body chunk passed on unchanged: streamed back in FULL_DUPLEX_STREAMED mode."""
        if duplex:
            return self._streamed(body.body, body.end_of_stream, response)
        return self._continue["response_body" if response else "request_body"]

    def _refuse(self, error: RequestError) -> Any:
        if error.status < 500 and error.status != 429:
            self.metrics.rejected.labels(str(error.status)).inc()
        pb = self._pb
        return pb.ext_proc.ProcessingResponse(immediate_response=pb.ext_proc.ImmediateResponse(
            status=pb.http_status.HttpStatus(code=error.status),
            headers=pb.ext_proc.HeaderMutation(set_headers=[pb.base.HeaderValueOption(
                header=pb.base.HeaderValue(key="content-type", raw_value=b"application/json"),
                append_action=pb.base.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]),
            body=error.body(), details=f"radixcache_picker_{error.code or error.status}"))


async def start_server(service: ExtProcService, host: str, port: int, *,
                       ready_interval: float = 0.25) -> tuple:
    """Start the gRPC server (ext_proc and health) on ``host:port``.

    Returns:
        ``(server, bound_port, health_task)``: stop with ``await server.stop(grace)`` and
        ``health_task.cancel()``.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20)])
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot bind the picker's gRPC port {host}:{port}")
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set("liveness", serving)

    async def track_readiness() -> None:
        last = None
        while True:
            ready = bool(service.picker.ready())
            if ready != last:
                for name in ("readiness", EXT_PROC_SERVICE, ""):
                    await health_servicer.set(name, serving if ready else not_serving)
                last = ready
            await asyncio.sleep(ready_interval)

    await server.start()
    return server, bound, asyncio.ensure_future(track_readiness())

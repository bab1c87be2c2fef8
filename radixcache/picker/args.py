"""The picker's command line (``python -m radixcache.picker``): the parser and the endpoint
specs. Parsing imports no gRPC, Envoy types, tokenizer or template engine."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional, Sequence

from .._options import DEFAULT_HOST_WEIGHT, DEFAULT_LOAD_WEIGHT, ROUTING_POLICIES
from .local_index import EndpointSpec
from .tokenization import CONTENT_FORMATS, ENGINES

__all__ = ["build_parser", "parse_args", "parse_endpoint", "read_endpoints_file"]

#: The ext_proc port GAIE's picker listens on, and its metrics port.
DEFAULT_PORT = 9002
DEFAULT_METRICS_PORT = 9090


def _check_address(address: str) -> str:
    """``ip:port`` (``[v6]:port`` for IPv6), as Envoy's endpoint picking reads it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an endpoint address must be ip:port, got {address!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"an IPv6 endpoint address must be [ip]:port, got {address!r}")
    return address


def _check_zmq(url: str, what: str) -> str:
    if "://" not in url:
        raise ValueError(f"{what} must be a ZeroMQ address such as tcp://10.0.0.5:5557, got "
                         f"{url!r}")
    return url


def parse_endpoint(text: str) -> EndpointSpec:
    """``ip:port=EVENTS[,REPLAY]``: an engine's HTTP address, the ZeroMQ address of its KV
    events and, after a comma, of its replay socket.

    Raises:
        ValueError: a malformed spec (the message says which part).
    """
    address, sep, sockets = text.partition("=")
    if not sep or not sockets:
        raise ValueError(f"an endpoint is ip:port=tcp://EVENTS[,tcp://REPLAY], got {text!r}")
    events, _, replay = sockets.partition(",")
    return EndpointSpec(_check_address(address.strip()), _check_zmq(events.strip(), "EVENTS"),
                        _check_zmq(replay.strip(), "REPLAY") if replay.strip() else None)


def read_endpoints_file(path: str) -> list:
    """A JSON file of endpoints: a list of ``{"endpoint": "ip:port", "events": "tcp://...",
    "replay_endpoint": "tcp://..."}`` objects (``replay_endpoint`` optional; the field names
    of the index service's ``/register``).

    Raises:
        ValueError: a file that is not such a list (the message names the entry and field).
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, list):
        raise ValueError(f"{path}: the endpoints file must hold a JSON array")
    specs = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: entry {i} must be an object")
        for key in ("endpoint", "events"):
            if not isinstance(entry.get(key), str):
                raise ValueError(f"{path}: entry {i}: '{key}' must be a string")
        replay = entry.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise ValueError(f"{path}: entry {i}: 'replay_endpoint' must be a string")
        specs.append(EndpointSpec(_check_address(entry["endpoint"]),
                                  _check_zmq(entry["events"], "events"),
                                  None if replay is None else _check_zmq(replay,
                                                                         "replay_endpoint")))
    return specs


def _typed(parse: Any) -> Any:
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def _number(low: float, *, integer: bool = False, strict: bool = False) -> Any:
    def parse(text: str) -> Any:
        value = int(text) if integer else float(text)
        if value < low or (strict and value == low) or value != value:
            raise ValueError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value

    return _typed(parse)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m radixcache.picker``."""
    parser = argparse.ArgumentParser(
        prog="python -m radixcache.picker",
        description="An Endpoint Picker for the Gateway API Inference Extension: Envoy's "
                    "ext_proc gRPC service that routes each OpenAI request to the engine "
                    "holding most of its prompt, from the engines' KV events.")
    where = parser.add_argument_group("serving")
    where.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; 0.0.0.0 in a pod)")
    where.add_argument("--port", type=_number(0, integer=True), default=DEFAULT_PORT,
                       help=f"ext_proc and gRPC health port (default {DEFAULT_PORT})")
    where.add_argument("--metrics-port", type=_number(0, integer=True),
                       default=DEFAULT_METRICS_PORT,
                       help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; "
                            f"0: none)")
    pool = parser.add_argument_group("the pool")
    pool.add_argument("--endpoint", type=_typed(parse_endpoint), action="append", default=[],
                      metavar="IP:PORT=EVENTS[,REPLAY]",
                      help="an engine: its HTTP address, the ZeroMQ address of its KV events "
                           "and of its replay socket (repeat for each engine)")
    pool.add_argument("--endpoints-file", metavar="FILE",
                      help="a JSON array of {endpoint, events, replay_endpoint} objects")
    pool.add_argument("--tokenizer", required=True, metavar="DIR",
                      help="the model's Hugging Face tokenizer directory (tokenizer.json, "
                           "tokenizer_config.json)")
    pool.add_argument("--model", action="append", default=[], metavar="NAME",
                      help="a model name the pool serves (repeat for aliases; none: any)")
    pool.add_argument("--lora", action="append", default=[], metavar="NAME",
                      help="a LoRA adapter the pool serves (its requests are cached apart)")
    pool.add_argument("--block-size", type=_number(1, integer=True), default=16,
                      help="the engines' KV page size in tokens (default 16)")
    pool.add_argument("--engine", choices=list(ENGINES), default="vllm",
                      help="whose chat preparation to follow (default vllm)")
    pool.add_argument("--content-format", choices=CONTENT_FORMATS, default="auto",
                      help="how content parts reach the chat template (default auto)")
    policy = parser.add_argument_group("picking")
    policy.add_argument("--policy", choices=ROUTING_POLICIES, default="cache-aware",
                        help="routing policy (default cache-aware)")
    policy.add_argument("--load-weight", type=_number(0), default=DEFAULT_LOAD_WEIGHT,
                        help=f"cache-aware: weight of an endpoint's load in tokens (default "
                             f"{DEFAULT_LOAD_WEIGHT:g})")
    policy.add_argument("--prefill-weight", type=_number(0), default=1.0,
                        help="cache-aware: weight of the tokens to prefill (default 1)")
    policy.add_argument("--host-weight", type=_number(0), default=DEFAULT_HOST_WEIGHT,
                        help=f"cache-aware: weight of a block held on the host tier, 0..1 "
                             f"(default {DEFAULT_HOST_WEIGHT:g})")
    policy.add_argument("--max-endpoints", type=_number(1, integer=True), default=3,
                        help="endpoints listed per answer, the first and its fallbacks "
                             "(default 3)")
    policy.add_argument("--max-body-bytes", type=_number(1, integer=True), default=4 << 20,
                        help="largest request body read; larger: 413 (default 4 MiB)")
    policy.add_argument("--stale-after", type=_number(0, strict=True), default=3.0,
                        help="seconds without a word from an engine's publisher before it "
                             "is no longer picked (default 3)")
    policy.add_argument("--probe-interval", type=_number(0, strict=True), default=0.5,
                        help="seconds of quiet before a publisher is probed (default 0.5)")
    policy.add_argument("--shed-load", type=_number(0, integer=True), default=None,
                        help="tokens in flight at which every endpoint being saturated sheds "
                             "sheddable requests with 429 (default: never)")
    policy.add_argument("--sheddable", action="append", default=[], metavar="OBJECTIVE",
                        help="an InferenceObjective (x-gateway-inference-objective) whose "
                             "requests may be shed")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; the endpoints end up in ``args.endpoints``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    endpoints = list(args.endpoint)
    if args.endpoints_file:
        try:
            endpoints += read_endpoints_file(args.endpoints_file)
        except (OSError, ValueError) as exc:
            parser.error(f"--endpoints-file: {exc}")
    if not endpoints:
        parser.error("give the engines with --endpoint or --endpoints-file")
    addresses = [spec.address for spec in endpoints]
    if len(set(addresses)) != len(addresses):
        parser.error(f"an endpoint address is given twice: {addresses}")
    if args.host_weight > 1:
        parser.error("--host-weight must lie in [0, 1]")
    if args.shed_load is not None and not args.sheddable:
        parser.error("--shed-load needs the sheddable objectives (--sheddable NAME)")
    args.endpoints = endpoints
    return args

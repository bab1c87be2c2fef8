"""``radixcache serve``: run the router index as an HTTP service (``radixcache.service``),
and with ``--epp PORT`` the Endpoint Picker on the same state (``radixcache.picker``).
Parsing imports no web framework, gRPC or tokenizer: they are imported when it runs.

One event loop (uvloop when installed) serves both: uvicorn's HTTP server and gRPC's
asyncio server share it, so a pick and a query never wait for each other's thread.
SIGTERM or SIGINT stops the picker
first (its streams get a second to end), then the HTTP server, then the service (the
subscriptions, the store's connections).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any, Optional


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser."""
    from ..service.config import SELECT_POLICIES, TOKEN_ENV

    p = sub.add_parser(
        "serve", prog="radixcache serve",
        help="run the router index as an HTTP service (Mooncake's and Dynamo's indexer API)",
        description="Run the router index as a long-lived HTTP service: publishers register "
                    "(or are given with --publisher), the service subscribes to their KV "
                    "events, and gateways query it (/query, /query_by_hash, /select). See "
                    "docs/service.md. Needs pip install 'radixcache[serve]'.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8090, help="port (default 8090; 0: any)")
    p.add_argument("--index", metavar="URL", default=None,
                   help="share the index with other replicas in Redis or Valkey "
                        "(redis://host:port/db); default: in this process")
    p.add_argument("--namespace", default="serve",
                   help="the shared index's name in the store (default serve)")
    p.add_argument("--owner", default=None,
                   help="this replica's owner token in the store (e.g. its pod name): a "
                        "replica restarted with the same one takes its publishers back at once")
    p.add_argument("--block-size", type=int, default=16,
                   help="block size of --publisher entries that name none (default 16)")
    p.add_argument("--model", default="default",
                   help="model of --publisher entries that name none (default 'default')")
    p.add_argument("--publisher", action="append", default=[], metavar="SPEC",
                   help="a static publisher: instance_id=tcp://host:port[,replay=tcp://...]"
                        "[,type=vLLM|SGLang|Mooncake][,model=M][,block_size=N][,tenant=T]"
                        "[,dp_rank=R][,lora=A][,salt=S][,address=IP:PORT (the serving address "
                        "the picker routes to)]; repeat for more")
    p.add_argument("--publishers-file", metavar="PATH", default=None,
                   help="static publishers from a JSON file (a list of such entries, or "
                        "Mooncake's conductor_config.json)")
    p.add_argument("--token", default=None,
                   help=f"bearer token that changes need (default: ${TOKEN_ENV}; none: "
                        "changes are open)")
    p.add_argument("--allow-endpoint", action="append", default=[], metavar="PATTERN",
                   help="a pattern (fnmatch) of ZeroMQ endpoints /register may connect to, "
                        "e.g. 'tcp://10.0.*:*'; repeat for more (default: loopback only)")
    p.add_argument("--max-body", type=int, default=8 << 20,
                   help="largest request body in bytes (default 8 MiB)")
    p.add_argument("--max-tokens", type=int, default=1 << 20,
                   help="most token ids or hashes in one request (default 1,048,576)")
    p.add_argument("--instance-timeout", type=float, default=None, metavar="SECONDS",
                   help="drop a publisher's instance from answers and picks after this long "
                        "without a word from it (a batch, or an answer to the probes of its "
                        "replay socket); it comes back when heard from again; default: never, "
                        "3 with --epp")
    p.add_argument("--policy", choices=SELECT_POLICIES, default="cache-aware",
                   help="the routing policy of /select and the picker (default cache-aware)")
    p.add_argument("--load-weight", type=float, default=None,
                   help="cache-aware's weight of an instance's load in tokens (default 0.1)")
    p.add_argument("--prefill-weight", type=float, default=1.0,
                   help="cache-aware's weight of the tokens an instance would prefill "
                        "(default 1)")
    p.add_argument("--host-weight", type=float, default=None,
                   help="cache-aware's weight of a token reached through an instance's host "
                        "tier, 0..1 (default 0.9)")
    p.add_argument("--pending-ttl", type=float, default=5.0, metavar="SECONDS",
                   help="how long a placed request's prompt counts as held by its instance "
                        "in ranking before the instance's events show it (default 5; 0: "
                        "off); /query never counts it")
    p.add_argument("--hash-seed", type=int, default=None,
                   help="seed of the standard XXH3-64 block hashes (default 1337, Dynamo's)")
    p.add_argument("--hash-index", action="store_true",
                   help="also keep the engines' blocks by their standard XXH3-64 sequence "
                        "hashes, so that /query_by_hash finds them (Dynamo's by-hash queries "
                        "too); costs memory per block and ingest speed")
    p.add_argument("--lease", type=float, default=30.0, metavar="SECONDS",
                   help="with --index: how long a replica's hold on a publisher lasts "
                        "(default 30)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    p.add_argument("--http-frontend", choices=("fast", "asgi"), default="fast",
                   help="fast (default): /query and /query_by_hash are answered by the HTTP "
                        "parser's callbacks, the rest by the ASGI application; asgi: every "
                        "request by the ASGI application (the same answers, slower)")
    p.add_argument("--no-api", action="store_true",
                   help="serve only /health, /ready, /metrics and /workers over HTTP, not the "
                        "index's API (with --epp: a picker whose publishers are static)")
    _add_epp_arguments(p)
    p.set_defaults(parser=p)
    return p


def _add_epp_arguments(p: argparse.ArgumentParser) -> None:
    from ..picker.tokenization import CONTENT_FORMATS, ENGINES

    epp = p.add_argument_group(
        "Endpoint Picker", "Envoy's ext_proc service of the Gateway API Inference Extension, "
        "on the service's state: it picks among the registered instances that have a serving "
        "address (address= in --publisher, \"address\" in /register). See "
        "docs/endpoint-picker.md. Needs pip install 'radixcache[epp]'.")
    epp.add_argument("--epp", type=int, default=None, metavar="PORT",
                     help="serve Envoy's ext_proc and gRPC health on this port (9002 is the "
                          "Inference Extension's; 0: any free one)")
    epp.add_argument("--tokenizer", metavar="DIR", default=None,
                     help="the model's Hugging Face tokenizer directory (tokenizer.json, "
                          "tokenizer_config.json); needed with --epp")
    epp.add_argument("--lora", action="append", default=[], metavar="NAME",
                     help="a LoRA adapter of --model that requests may name (its blocks are "
                          "cached apart); repeat for more")
    epp.add_argument("--engine", choices=list(ENGINES), default="vllm",
                     help="whose chat preparation to follow (default vllm)")
    epp.add_argument("--content-format", choices=CONTENT_FORMATS, default="auto",
                     help="how content parts reach the chat template (default auto)")
    epp.add_argument("--max-endpoints", type=int, default=3,
                     help="endpoints listed per answer, the first and its fallbacks "
                          "(default 3)")
    epp.add_argument("--shed-load", type=int, default=None, metavar="TOKENS",
                     help="tokens in flight at which every eligible endpoint being saturated "
                          "sheds sheddable requests with 429 (default: never)")
    epp.add_argument("--sheddable", action="append", default=[], metavar="OBJECTIVE",
                     help="an InferenceObjective (x-gateway-inference-objective) whose "
                          "requests may be shed; repeat for more")


def config_from(args: argparse.Namespace):
    """The ``ServiceConfig`` of parsed arguments (UsageError for bad values)."""
    from ..service.config import (ServiceConfig, parse_publisher, read_publishers_file,
                                  token_from)
    from .errors import UsageError

    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.max_body < 1 or args.max_tokens < 1:
        raise UsageError("--max-body and --max-tokens must be >= 1")
    if args.instance_timeout is not None and not args.instance_timeout > 0:
        raise UsageError("--instance-timeout must be > 0 seconds")
    if args.epp is not None:
        if not 0 <= args.epp < 65536:
            raise UsageError(f"--epp must be a port in 0..65535, got {args.epp}")
        if args.tokenizer is None:
            raise UsageError("--epp needs the model's tokenizer: --tokenizer DIR")
        if args.max_endpoints < 1:
            raise UsageError(f"--max-endpoints must be >= 1, got {args.max_endpoints}")
        if args.shed_load is not None and (args.shed_load < 0 or not args.sheddable):
            raise UsageError("--shed-load needs a number of tokens >= 0 and the sheddable "
                             "objectives (--sheddable NAME)")
        if args.instance_timeout is None:
            args.instance_timeout = EPP_INSTANCE_TIMEOUT
    elif args.tokenizer is not None or args.lora or args.sheddable \
            or args.shed_load is not None:
        raise UsageError("--tokenizer, --lora, --shed-load and --sheddable are the "
                         "picker's: give --epp PORT")
    if not args.pending_ttl >= 0:
        raise UsageError("--pending-ttl must be >= 0 seconds")
    if not args.prefill_weight >= 0 or (args.host_weight is not None
                                        and not 0 <= args.host_weight <= 1):
        raise UsageError("--prefill-weight must be >= 0 and --host-weight in [0, 1]")
    if args.index is not None and not args.index.startswith(("redis://", "rediss://",
                                                             "unix://")):
        raise UsageError(f"--index must be a redis://, rediss:// or unix:// URL, got "
                         f"{args.index!r}")
    try:
        publishers = [parse_publisher(text, args.model, args.block_size)
                      for text in args.publisher]
        if args.publishers_file is not None:
            publishers += read_publishers_file(args.publishers_file, args.model,
                                               args.block_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = ServiceConfig(host=args.host, port=args.port, index=args.index,
                           namespace=args.namespace, owner=args.owner,
                           block_size=args.block_size, model=args.model,
                           publishers=publishers, token=token_from(args.token),
                           allow_endpoints=list(args.allow_endpoint), max_body=args.max_body,
                           max_tokens=args.max_tokens, instance_timeout=args.instance_timeout,
                           policy=args.policy, lease_s=args.lease,
                           hash_index=args.hash_index, pending_ttl=args.pending_ttl,
                           prefill_weight=args.prefill_weight)
    if args.host_weight is not None:
        config.host_weight = args.host_weight
    if args.load_weight is not None:
        if not args.load_weight >= 0:
            raise UsageError("--load-weight must be >= 0")
        config.load_weight = args.load_weight
    if args.hash_seed is not None:
        config.hash_seed = args.hash_seed
    for reg in publishers:
        for endpoint in (reg.endpoint, reg.replay_endpoint):
            if endpoint is not None and not config.endpoint_allowed(endpoint):
                raise UsageError(f"--publisher endpoint {endpoint!r} is not allowed: add an "
                                 "--allow-endpoint pattern for it")
    return config


def _stopped(signum: int, frame: object) -> None:
    """What a stop signal does once uvicorn has shut the service down: nothing more."""


def _picker(args: argparse.Namespace, app: Any) -> Any:
    """The ext_proc servicer on ``app``'s service, its metrics in the service's registry."""
    from ..picker.extproc import ExtProcService, PickerOptions
    from ..picker.metrics import PickerMetrics
    from ..picker.openai import RequestReader
    from ..picker.service_picker import ServicePicker
    from ..picker.tokenization import ChatTokenizer

    config = app.config
    tokenizer = ChatTokenizer.from_dir(args.tokenizer, engine=args.engine,
                                       content_format=args.content_format)
    reader = RequestReader(tokenizer, (), args.lora, config.max_body)
    picker = ServicePicker(app.service, config.model, policy=config.policy,
                           loras={name: config.model for name in args.lora})
    metrics = PickerMetrics(app.metrics.registry)
    metrics.picker = picker
    options = PickerOptions(max_endpoints=args.max_endpoints, shed_load=args.shed_load,
                            sheddable=frozenset(args.sheddable))
    return ExtProcService(picker, reader, options, metrics)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (see the module docstring)."""
    config = config_from(args)
    try:
        import uvicorn

        from ..service.app import make_app
        from ..service.frontend import protocol_class

        app = make_app(config, api=not args.no_api)
        http = (protocol_class(app) if args.http_frontend == "fast" else None) or "auto"
        extproc = _picker(args, app) if args.epp is not None else None
    except ImportError as exc:
        extra = "epp" if args.epp is not None else "serve"
        print(f"radixcache serve: {exc} (pip install 'radixcache[{extra}]')", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # the tokenizer's files
        print(f"radixcache serve: --tokenizer {args.tokenizer}: {exc}", file=sys.stderr)
        return 1
    # Threads that ingest hand the interpreter back to the request path sooner (5 ms by
    # default): a query waits at most this long for a batch being applied.
    sys.setswitchinterval(0.0005)
    # uvicorn stops cleanly on SIGINT and SIGTERM, then raises the signal again for the
    # handler it found: this one lets the command return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port,
                                    log_level=args.log_level, access_log=False, lifespan="on",
                                    http=http, timeout_keep_alive=60,
                                    timeout_graceful_shutdown=5), extproc, args.epp)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(server.serve_all())


def _loop_factory() -> Optional[Any]:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, and the picker's gRPC server on the same loop: started once
        the service is, stopped first."""

        def __init__(self, config: Any, extproc: Any, epp_port: Optional[int]) -> None:
            super().__init__(config)
            self.extproc, self.epp_port = extproc, epp_port
            self.grpc: Any = None
            self.health: Any = None

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit or self.extproc is None:
                return
            from ..picker.extproc import start_server

            host = self.config.host
            try:
                self.grpc, port, self.health = await start_server(self.extproc, host,
                                                                   self.epp_port)
            except RuntimeError as exc:
                print(f"radixcache serve: {exc}", file=sys.stderr)
                self.should_exit = True
                self.exit_code = 1
                return
            print(f"radixcache serve: the Endpoint Picker (ext_proc, gRPC health) on "
                  f"{host}:{port}", flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            if self.grpc is not None:
                self.health.cancel()
                await self.grpc.stop(1.0)
                self.grpc = None
            await super().shutdown(sockets)

        async def serve_all(self) -> int:
            self.exit_code = 0
            await self.serve()
            if self.started is False and self.exit_code == 0:
                return 1  # the HTTP port could not be bound, or the service not started
            return self.exit_code

    return Server


def _Server(config: Any, extproc: Any, epp_port: Optional[int]) -> Any:
    return _server_class()(config, extproc, epp_port)


#: ``--instance-timeout``'s default with ``--epp``: an engine silent this long (its replay
#: socket probed every second) is no longer picked.
EPP_INSTANCE_TIMEOUT = 3.0

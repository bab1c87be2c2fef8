"""``radixcache serve``: run the router index as an HTTP service (``radixcache.service``).
Parsing imports no web framework: uvicorn and the service are imported when it runs."""

from __future__ import annotations

import argparse
import signal
import sys


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
                        "[,dp_rank=R][,lora=A][,salt=S]; repeat for more")
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
                   help="drop a publisher's instance from answers after this long without a "
                        "batch (it comes back with its next one); default: never")
    p.add_argument("--policy", choices=SELECT_POLICIES, default="cache-aware",
                   help="/select's default policy (default cache-aware)")
    p.add_argument("--load-weight", type=float, default=None,
                   help="cache-aware's weight of an instance's load in tokens (default 0.1)")
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
    p.set_defaults(parser=p)
    return p


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
                           hash_index=args.hash_index)
    if args.load_weight is not None:
        if not args.load_weight >= 0:
            raise UsageError("--load-weight must be >= 0")
        config.load_weight = args.load_weight
    if args.hash_seed is not None:
        config.hash_seed = args.hash_seed
    for reg in publishers:
        if not config.endpoint_allowed(reg.endpoint):
            raise UsageError(f"--publisher endpoint {reg.endpoint!r} is not allowed: add an "
                             "--allow-endpoint pattern for it")
    return config


def _stopped(signum: int, frame: object) -> None:
    """What a stop signal does once uvicorn has shut the service down: nothing more."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers): the lifespan's shutdown closes
    every subscription and the store's connections."""
    config = config_from(args)
    try:
        import uvicorn

        from ..service.app import make_app
        app = make_app(config)
    except ImportError as exc:
        print(f"radixcache serve: {exc} (pip install 'radixcache[serve]')", file=sys.stderr)
        return 1
    # Threads that ingest hand the interpreter back to the request path sooner (5 ms by
    # default): a query waits at most this long for a batch being applied.
    sys.setswitchinterval(0.0005)
    # uvicorn stops cleanly on SIGINT and SIGTERM (the lifespan's shutdown runs), then raises
    # the signal again for the handler it found: this one lets the command return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                access_log=False, lifespan="on", http="auto", loop="auto",
                timeout_keep_alive=60, timeout_graceful_shutdown=5)
    return 0

"""``python -m radixcache.picker``: run the Endpoint Picker (see ``radixcache.picker``)."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Optional, Sequence

from .args import parse_args


async def _serve(args) -> None:
    from .extproc import ExtProcService, PickerOptions, start_server
    from .local_index import LocalIndexPicker
    from .metrics import PickerMetrics, serve_metrics
    from .openai import RequestReader
    from .tokenization import ChatTokenizer

    tokenizer = ChatTokenizer.from_dir(args.tokenizer, engine=args.engine,
                                       content_format=args.content_format)
    reader = RequestReader(tokenizer, args.model, args.lora, args.max_body_bytes)
    picker = LocalIndexPicker(
        args.endpoints, block_size=args.block_size, policy=args.policy,
        router_options={"load_weight": args.load_weight, "prefill_weight": args.prefill_weight,
                        "host_weight": args.host_weight},
        stale_after=args.stale_after, probe_interval=args.probe_interval)
    metrics = PickerMetrics()
    options = PickerOptions(max_endpoints=args.max_endpoints, shed_load=args.shed_load,
                            sheddable=frozenset(args.sheddable))
    service = ExtProcService(picker, reader, options, metrics)
    metrics_server = None
    try:
        server, port, health = await start_server(service, args.host, args.port)
        if args.metrics_port:
            metrics_server = serve_metrics(
                args.host, args.metrics_port,
                lambda: metrics.render(picker.status(), picker.ready()))
        where = f"metrics on http://{args.host}:{metrics_server.server_address[1]}/metrics" \
            if metrics_server else "no metrics"
        print(f"radixcache picker: ext_proc and health on {args.host}:{port}, {where}, "
              f"{len(args.endpoints)} endpoints, policy {args.policy}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        health.cancel()
        await server.stop(1.0)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        picker.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the picker until SIGINT or SIGTERM; the exit code."""
    args = parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"radixcache picker: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

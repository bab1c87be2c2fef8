"""The ``radixcache`` command through its real entry point (``python -m radixcache``)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from radixcache import RadixCache
from radixcache._core import CORES
from radixcache.cli import main
from radixcache.traces import read_trace
from radixcache.workloads import serve, synthetic_chat

from conftest import HAS_TORCH, mooncake_trace

REPO = Path(__file__).resolve().parents[2]
MOONCAKE, MOONCAKE_MISSING = mooncake_trace("synthetic")

# The keys of --json rows, in order: every column of the table.
EXPECTED_KEYS = ["capacity", "policy", "page_size", "requests", "rejected", "prompt_tokens",
                 "cached_tokens", "hit_rate", "evicted_tokens", "peak_tokens", "seconds",
                 "requests_per_second", "host_capacity", "write_policy", "device_hit_rate",
                 "host_hit_rate", "loaded_tokens", "backed_up_tokens"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "radixcache", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


def table_rows(stdout: str) -> dict:
    """The result table as {(capacity, policy): {column: cell}}."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("capacity "))
    header = ["capacity", "policy", "requests", "rejected", "prompt", "cached", "hit_rate",
              "evicted", "peak", "seconds", "rps"]
    rows = {}
    for line in lines[start + 2:]:
        cells = line.split()
        if len(cells) != len(header) or not cells[0][0].isdigit():
            break
        row = dict(zip(header, cells))
        rows[(int(row["capacity"].replace(",", "")), row["policy"])] = row
    return rows


def count(cell: str) -> int:
    return int(cell.replace(",", ""))


def write_token_trace(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def check_against_library(rows_json, table, requests, core=None):
    """Every JSON row and table row equals an in-process replay's cache.stats() (numpy index
    arrays, as the command's caches have)."""
    assert len(rows_json) == len(table)
    for row in rows_json:
        assert list(row) == EXPECTED_KEYS
        cache = RadixCache(page_size=row["page_size"], eviction_policy=row["policy"], core=core,
                           array_type="numpy")
        result = serve(cache, requests, row["capacity"])
        stats = cache.stats()
        assert row["hit_rate"] == stats.hit_rate
        assert row["cached_tokens"] == stats.matched_tokens
        assert row["prompt_tokens"] == stats.queried_tokens
        assert row["evicted_tokens"] == stats.evicted_tokens
        assert row["requests"] == stats.lookups == len(requests)
        assert row["peak_tokens"] == result.peak_tokens
        assert row["rejected"] == result.rejected
        assert row["seconds"] > 0
        assert row["requests_per_second"] == pytest.approx(row["requests"] / row["seconds"])
        cells = table[(row["capacity"], row["policy"])]
        assert cells["hit_rate"] == f"{100 * stats.hit_rate:.2f}%"
        assert count(cells["cached"]) == stats.matched_tokens
        assert count(cells["evicted"]) == stats.evicted_tokens
        assert count(cells["rejected"]) == result.rejected


@pytest.mark.parametrize("core", sorted(CORES))
def test_simulate_embedded_json_table_and_plot(tmp_path, core):
    from PIL import Image

    out_json, out_png = tmp_path / "rows.json", tmp_path / "hit.png"
    proc = run_cli("simulate", "--limit", "80", "--capacity", "4000,20000,400000",
                   "--policy", "lru,lfu", "--core", core, "--json", out_json,
                   "--plot", out_png)
    assert proc.returncode == 0, proc.stderr
    assert "synthetic chat" in proc.stdout and f"core {core}" in proc.stdout
    rows_json = json.loads(out_json.read_text())
    assert [(r["capacity"], r["policy"]) for r in rows_json] == [
        (c, p) for c in (4000, 20000, 400000) for p in ("lru", "lfu")]
    check_against_library(rows_json, table_rows(proc.stdout), synthetic_chat()[:80], core)
    # More room never lowers LRU's hit rate on the same requests.
    lru = [r["hit_rate"] for r in rows_json if r["policy"] == "lru"]
    assert lru == sorted(lru) and lru[0] < lru[-1]
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size == (1000, 500)
    assert "warning" not in proc.stderr
    assert not list(tmp_path.glob(".*.tmp"))  # no temp files left behind
    umask = os.umask(0)
    os.umask(umask)
    for out in (out_json, out_png):  # written via a temp file, yet with a plain file's mode
        assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


@pytest.mark.skipif(MOONCAKE is None, reason=MOONCAKE_MISSING)
def test_simulate_mooncake_lines(tmp_path):
    out_json = tmp_path / "mooncake.json"
    proc = run_cli("simulate", MOONCAKE, "--limit", "100", "--capacity", "300000,2000000",
                   "--policy", "lru,fifo", "--json", out_json, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "mooncake_synthetic_trace.jsonl" in proc.stdout
    rows_json = json.loads(out_json.read_text())
    requests = read_trace(MOONCAKE, limit=100)
    check_against_library(rows_json, table_rows(proc.stdout), requests)
    assert sum(r["cached_tokens"] for r in rows_json) > 0  # the trace does share prefixes


def test_simulate_same_prompt_ten_times(tmp_path):
    prompt = list(range(1000, 1500))
    trace = write_token_trace(tmp_path / "same.jsonl",
                              [{"prompt": prompt, "output_length": 30}] * 10)
    out_json = tmp_path / "same.json"
    proc = run_cli("simulate", trace, "--capacity", "100000", "--json", out_json)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out_json.read_text())
    assert row["hit_rate"] == pytest.approx(0.9)
    assert row["cached_tokens"] == 9 * 500 and row["prompt_tokens"] == 10 * 500
    assert row["peak_tokens"] == 500 + 10 * 30  # every fresh output is its own leaf
    assert table_rows(proc.stdout)[(100000, "lru")]["hit_rate"] == "90.00%"


def test_simulate_reports_requests_too_big_for_the_pool(tmp_path):
    trace = write_token_trace(tmp_path / "big.jsonl", [
        {"prompt": list(range(100)), "output_length": 10},
        {"prompt": list(range(5)), "output": [7, 8]},
        {"prompt": list(range(100)), "output_length": 10},
    ])
    proc = run_cli("simulate", trace, "--capacity", "50,1000", "--quiet")
    assert proc.returncode == 0, proc.stderr
    table = table_rows(proc.stdout)
    assert count(table[(50, "lru")]["rejected"]) == 2
    assert count(table[(1000, "lru")]["rejected"]) == 0
    assert "rejected: capacity 50 (lru): 2 of 3 requests" in proc.stdout
    assert "largest request needs 110 slots" in proc.stdout


BAD_TRACES = [
    (['{"prompt": [1, 2], "output_length": 3}', '{"prompt": [1, 2], "output_length": 3}',
      '{"prompt": [1, 2], "output_length": '], "bad.jsonl:3: not valid JSON"),
    (['{"prompt": [1, 2], "output_length": 3}', '', '{"prompt": [1, 2]}'],
     "bad.jsonl:3: missing field 'output' or 'output_length'"),
    (['{"hash_ids": [1, 2], "input_length": 600, "output_length": 3}',
      '{"hash_ids": [1], "output_length": 3}'], "bad.jsonl:2: missing field 'input_length'"),
    (['{"prompt": [1, 2], "output_length": 3}', '{"prompt": [1, "x"], "output_length": 3}'],
     "bad.jsonl:2: 'prompt' holds 'x'"),
]


def prepare_bad_trace(tmp_path, lines):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out_json = tmp_path / "out.json"
    out_json.write_text("previous contents")
    args = ["simulate", trace, "--capacity", "1000", "--json", out_json,
            "--plot", tmp_path / "out.png"]
    return [str(a) for a in args], out_json


def test_simulate_bad_trace_fails_with_file_and_line(tmp_path):
    lines, message = BAD_TRACES[0]
    args, out_json = prepare_bad_trace(tmp_path, lines)
    proc = run_cli(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert out_json.read_text() == "previous contents"  # nothing (half) written
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("lines, message", BAD_TRACES[1:])
def test_main_bad_trace_fails_with_file_and_line(tmp_path, capsys, lines, message):
    # The same code path as above, in-process (no interpreter start per case).
    args, out_json = prepare_bad_trace(tmp_path, lines)
    assert main(args) == 1
    assert message in capsys.readouterr().err
    assert out_json.read_text() == "previous contents"
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("args, message", [
    (["simulate", "--capacity", "0"], "must be >= 1"),
    (["simulate", "--capacity", "-5"], "must be >= 1, got -5"),
    (["simulate", "--capacity", "1.5"], "'1.5' is not a whole number (1.5)"),
    (["simulate", "--capacity", "1.0001k"], "not a whole number (1000.1)"),
    (["simulate", "--capacity", "12x"], "expected a size like 4096, 500k, 1M"),
    (["simulate", "--capacity", "inf"], "expected a finite size"),
    (["simulate", "--capacity", "nan"], "expected a finite size"),
    (["simulate", "--capacity", "k"], "expected a size like"),
    (["simulate", "--capacity", "1e30"],
     "capacity '1e30': more slots than this machine can address (at most "),
    (["simulate", "--capacity", "1M,1e99"], "capacity '1e99': more slots than this machine"),
    (["simulate", "--capacity", "9223372036854775808"], "more slots than this machine"),
    (["simulate", "--host-capacity", "0,2e18"],
     "host capacity '2e18': more slots than this machine can address"),
    (["simulate", "--workers", "4", "--capacity", "1e18"],
     ("--capacity: the pooled row's one cache of 4 x 1,000,000,000,000,000,000 slots is more "
      "than this machine can address")),
    (["simulate", "--limit", "1e"], "expected a size like"),
    (["simulate", "--plot", "out.txt"], "--plot: 'out.txt' has extension '.txt'; use one of"),
    (["simulate", "--plot", "out"], "--plot: 'out' has no extension"),
    (["simulate", "--workers", "1k"], "expected an integer"),
    (["simulate", "--capacity", "12,abc"], "capacity 'abc'"),
    (["simulate", "--policy", "lru,nope"], "unknown policy 'nope'"),
    (["simulate", "--page-size", "-4"], "must be >= 1"),
    (["simulate", "--json", "/nonexistent-dir/out.json"], "does not exist"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_exit_2(args, message, capsys):
    assert main(args) == 2  # argument errors are found before any replay: run in-process
    assert message in capsys.readouterr().err


def test_missing_trace_file_exits_1(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "No such file" in err


def test_help_exits_0(capsys):
    assert main(["simulate", "--help"]) == 0
    assert "--capacity" in capsys.readouterr().out


def test_bench_quick_runs_every_core():
    """Every core on torch tensors where torch is installed, else on numpy arrays (and no
    tensor inputs)."""
    proc = run_cli("bench", "--quick")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    array_type = "torch" if HAS_TORCH else "numpy"
    assert lines[0].split("; ")[-1].startswith(f"index arrays: {array_type}"), lines[0]
    input_types = {"list", "array", "numpy", "tensor"} if HAS_TORCH else {"list", "array",
                                                                          "numpy"}
    for core in CORES:
        # One chat row and one row per exercise shape for every core.
        assert sum(line.split()[-4:-3] == [core] for line in lines
                   if line.startswith(("chat", "exercise"))) == 3
        # In-cache rows: 2 page sizes x 4 input types per core, each with a rest share.
        incache = [line.split() for line in lines
                   if line.split()[:1] in (["1"], ["16"]) and line.split()[2:3] == [core]]
        assert len(incache) == 2 * len(input_types)
        assert {row[1] for row in incache} == input_types
        assert all(row[-1].endswith("%") for row in incache)
        walk_rows = [line.split() for line in lines
                     if line.startswith(("shallow", "deep")) and line.split()[1] == core]
        assert len(walk_rows) == 2 and all(float(row[-1]) > 0 for row in walk_rows)
    assert sum(line.startswith("exercise") and "set of tuples" in line for line in lines) == 2
    assert "speedup of" in proc.stdout and "over a set of tuples" in proc.stdout
    if len(CORES) > 1:
        assert "speedup of 'c' over 'python'" in proc.stdout
    else:
        assert "only the 'python' core is available" in proc.stdout


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), (" 500k", 500_000), ("1M", 10**6), ("1m", 10**6), ("1.5M", 1_500_000),
    ("1e6", 10**6), ("2.5e3", 2500), ("2G", 2 * 10**9), ("64Ki", 65536), ("1Mi", 2**20),
    ("1_000", 1000), ("0", 0), ("1T", 10**12),
])
def test_sizes_accept_units(text, value):
    from radixcache.cli import parse_size

    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5", "0.0001k", "1x", "M", "1e-3", "inf", "1MM"])
def test_sizes_refuse_junk(text):
    from radixcache.cli import parse_size

    with pytest.raises(ValueError):
        parse_size(text)


def test_sizes_on_the_command_line(tmp_path):
    out_json = tmp_path / "rows.json"
    assert main(["simulate", "--limit", "20", "--capacity", "1e4,20k,0.03M", "--page-size",
                 "1e0", "--quiet", "--json", str(out_json)]) == 0
    assert [r["capacity"] for r in json.loads(out_json.read_text())] == [10000, 20000, 30000]


def test_capacity_far_beyond_the_trace_costs_nothing(tmp_path):
    # Pools keep only the slots they hand out: capacities of 10^15 (8 PB of slot ids, were
    # they allocated) replay as fast as 1M, with the same rows (nothing is evicted at either).
    out_json = tmp_path / "rows.json"
    assert main(["simulate", "--limit", "40", "--capacity", "1M,1e15", "--quiet",
                 "--json", str(out_json)]) == 0
    rows = [{k: v for k, v in r.items() if k not in ("capacity", "seconds",
                                                     "requests_per_second")}
            for r in json.loads(out_json.read_text())]
    assert len(rows) == 2 and rows[0] == rows[1] and rows[0]["evicted_tokens"] == 0


@pytest.mark.parametrize("args, prog, usage", [
    (["simulate", "--capacity", "abc"], "radixcache simulate", "usage: radixcache simulate "),
    (["simulate", "--capacity", "1e30"], "radixcache simulate", "usage: radixcache simulate "),
    (["simulate", "--nope"], "radixcache simulate", "usage: radixcache simulate "),
    (["simulate", "--router", "round-robin"], "radixcache simulate",
     "usage: radixcache simulate "),  # found after parsing: still simulate's usage
    (["bench", "--repeat", "x"], "radixcache bench", "usage: radixcache bench "),
    (["trace", "download", "nope"], "radixcache trace download",
     "usage: radixcache trace download NAME"),
    (["trace"], "radixcache trace", "usage: radixcache trace "),
    (["frobnicate"], "radixcache", "usage: radixcache [-h]"),
])
def test_errors_are_one_line_and_the_commands_usage(args, prog, usage, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 2, captured.err
    assert lines[0].startswith(f"{prog}: error: ")
    assert lines[1].startswith(usage) and lines[1].endswith(f"(see '{prog} --help')")


def test_version(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"radixcache {version('radixcache')}\n"


def test_the_command_keeps_what_is_left_out_of_the_collections_at_exit(monkeypatch, capsys):
    import gc

    from radixcache import cli
    from radixcache.cli import entry_point

    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(sys, "argv", ["radixcache", "--version"])
    allocator_set = []
    monkeypatch.setattr(cli, "_keep_freed_memory", lambda: allocator_set.append(True))
    try:
        assert main() == 0 and main(["--version"]) == 0
        assert gc.get_freeze_count() == 0  # main() itself changes nothing
        assert not allocator_set
        assert entry_point() == 0  # the command: the process exits next
        assert gc.get_freeze_count() > 0
        assert allocator_set == [True]  # the command's process keeps freed memory
    finally:
        gc.unfreeze()
    assert capsys.readouterr().out.count("radixcache ") == 3


def test_keeping_freed_memory_is_harmless_here():
    """The allocator settings the command makes apply (or do nothing) without an error."""
    done = subprocess.run([sys.executable, "-c", "from radixcache.cli import _keep_freed_memory;"
                           " _keep_freed_memory(); print(bytearray(50 << 20)[-1])"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


HEAVY = ("torch", "numpy", "radixcache.cache", "radixcache._core", "radixcache._core_c",
         "radixcache._core_py", "radixcache.workloads", "radixcache.fleet")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["simulate", "--help"],
                                  ["simulate", "--capacity", "junk"], ["trace", "list",
                                                                       "--help"], ["nope"],
                                  ["simulate", "--host-capacity", "-1"],
                                  ["simulate", "--write-policy", "write_back"],
                                  ["simulate", "--workers", "2", "--load-tps", "1000"]])
def test_help_version_and_errors_import_no_torch(args):
    # The real entry point, with Python's own record of every module it imported.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "radixcache", *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode in (0, 2), proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "radixcache.cli" in imported  # the record is there
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_default_capacities_follow_the_trace(tmp_path):
    from radixcache.cli import default_capacities

    assert default_capacities(1200, 1) == [19, 75, 300, 1200]
    assert default_capacities(90_700_000, 1) == [1_400_000, 5_700_000, 23_000_000, 91_000_000]
    assert default_capacities(10, 16) == [16]  # never below one page
    trace = write_token_trace(tmp_path / "t.jsonl", [
        {"prompt": list(range(4000)), "output_length": 1},
        {"prompt": list(range(4000)), "output_length": 1}])
    proc = run_cli("simulate", trace, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "fractions of its 4k unique prompt tokens" in proc.stdout
    assert sorted(c for c, _ in table_rows(proc.stdout)) == [62, 250, 1000, 4000]


@pytest.mark.parametrize("args, warning", [
    (["--page-size", "5000"], "the page size (5,000 tokens) is larger than every prompt "
                              "(the longest has 2,000 tokens)"),
    (["--page-size", "16", "--capacity", "8,100000"],
     "capacity 8 is smaller than one page (16 tokens)"),
    (["--capacity", "100,200,1M"], "capacities 100 and 200 are smaller than every request "
                                   "(the smallest needs 1,001 slots)"),
])
def test_warnings_for_meaningless_settings(tmp_path, capsys, args, warning):
    trace = write_token_trace(tmp_path / "t.jsonl", [
        {"prompt": list(range(1000)), "output_length": 1},
        {"prompt": list(range(2000)), "output_length": 1}])
    assert main(["simulate", str(trace), "--quiet", *args]) == 0
    err = capsys.readouterr().err
    assert f"radixcache: warning: {warning}" in err
    assert len(err.splitlines()) == 1  # one line, nothing else


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]])
def test_timestamps_on_some_lines_only_are_refused(tmp_path, capsys, workers):
    # The trace format: a timestamp on every line or on none, whether the replay uses them
    # (a fleet) or not; the same error either way, before anything is written.
    trace = write_token_trace(tmp_path / "x.jsonl", [
        {"prompt": [1, 2], "output_length": 1, "timestamp": 0},
        {"prompt": [1, 2, 3], "output_length": 1, "timestamp": 5},
        {"prompt": [1, 3], "output_length": 1}])
    out_json = tmp_path / "rows.json"
    assert main(["simulate", str(trace), "--capacity", "100", "--quiet", "--json",
                 str(out_json), *workers]) == 1
    err = capsys.readouterr().err
    assert err == ("radixcache: error: x.jsonl: 2 of 3 requests carry a timestamp (request 3 "
                   "has none): give every request one, or none\n")
    assert not out_json.exists()
    # Every line or none: fine (the single-cache replay ignores them, even out of order).
    for records in ([{"prompt": [1, 2], "output_length": 1, "timestamp": 9},
                     {"prompt": [1, 2, 3], "output_length": 1, "timestamp": 5}],
                    [{"prompt": [1, 2], "output_length": 1}]):
        write_token_trace(trace, records)
        assert main(["simulate", str(trace), "--capacity", "100", "--quiet"]) == 0


def test_counts_of_one_are_singular(tmp_path, capsys):
    trace = write_token_trace(tmp_path / "one.jsonl", [{"prompt": [5], "output_length": 1}])
    assert main(["simulate", str(trace), "--quiet", "--capacity", "1", "--page-size", "2"]) == 0
    captured = capsys.readouterr()
    assert "one.jsonl: 1 request, 1 prompt token; page size 2" in captured.out
    assert ("rejected: capacity 1 (lru): 1 of 1 request did not fit in the pool even after "
            "evicting every unlocked entry (the largest request needs 2 slots)") in captured.out
    assert ("the page size (2 tokens) is larger than every prompt (the longest has 1 token)"
            in captured.err)
    assert "1 requests" not in captured.out + captured.err
    assert main(["simulate", str(trace), "--quiet", "--capacity", "1"]) == 0
    assert "(the smallest needs 2 slots)" in capsys.readouterr().err


@pytest.mark.parametrize("extension, magic", [("pdf", b"%PDF"), ("svg", b"<?xml"),
                                              ("PNG", b"\x89PNG")])
def test_plot_format_follows_the_extension(tmp_path, extension, magic):
    out = tmp_path / f"plot.{extension}"
    assert main(["simulate", "--limit", "20", "--capacity", "1000,100000", "--quiet",
                 "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


def test_plot_axis_follows_the_data():
    from radixcache.cli.plots import hit_rate_limits

    assert hit_rate_limits([0.40, 0.45]) == pytest.approx((39.0, 46.0))
    assert hit_rate_limits([0.0, 0.0]) == (0.0, 1.0)
    assert hit_rate_limits([0.2, 0.99]) == pytest.approx((12.1, 100.0))


def _plot_rows(kind):
    """Rows of each kind of plot, with ties (equal hit rates) as real sweeps have them."""
    rows = []
    hosts = (0, 3 * 10**6, 10**8) if "host" in kind else (0,)
    writes = ("write_back", "write_through", "write_through_selective")
    for capacity in (10**6,) if kind == "host-fleet" else (10**6, 3 * 10**6, 9 * 10**6):
        for host in hosts:
            for write in writes if host or kind == "one-host" else (None,):
                for router in ("prefix-hash", "pooled") if "fleet" in kind else (None,):
                    for policy in ("lru", "fifo", "lfu") if kind in ("one", "fleet",
                                                                      "many-host") else ("lru",):
                        # lru and fifo tie, as do the write policies without host memory.
                        rate = 0.1 * (capacity / 10**6) ** 0.3 + (host > 0) * (
                            0.05 + 0.01 * (write != "write_back")) + (policy == "lfu") * 0.02
                        rows.append({"capacity": capacity, "policy": policy, "hit_rate": rate,
                                     "host_capacity": host, "write_policy": write,
                                     "router": router})
    return rows


@pytest.mark.parametrize("kind, title", [
    ("one", "eviction policy"),
    ("one-host", "eviction policy, write policy"),
    ("fleet", "router (eviction policy)"),
    ("host", "device capacity, write policy"),
    ("host-fleet", "device capacity per worker, write policy, router"),
    ("many-host", "device capacity, eviction policy, write policy"),
])
def test_plots_keep_every_series_distinct_and_the_legend_off_the_data(monkeypatch, kind,
                                                                       title):
    from radixcache.cli import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    rows = _plot_rows(kind)
    if kind.startswith("one"):
        plots.write_plot("x.png", rows, "t.jsonl", 16)
    elif kind == "fleet":
        plots.write_fleet_plot("x.png", rows, "t.jsonl", 16, 4)
    else:
        plots.write_host_plot("x.png", rows, "t.jsonl", 16, 4 if "fleet" in kind else 1)
    (fig,) = figures
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert len(lines) == {"one": 3, "one-host": 3, "fleet": 6, "host": 9, "host-fleet": 6,
                          "many-host": 27}[kind]
    # One colour and one marker per series (past a dozen series, one pair of them).
    colors = [str(line.get_color()) for line in lines]
    markers = [line.get_marker() for line in lines]
    assert len(set(zip(colors, markers))) == len(lines)
    if len(lines) <= 12:
        assert len(set(colors)) == len(set(markers)) == len(lines)
    legend = ax.get_legend()
    assert legend.get_title().get_text() == title
    assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in lines]
    fig.canvas.draw()  # the legend lies beside the axes, over none of the data
    assert legend.get_window_extent().x0 > ax.get_window_extent().x1


def test_json_rows_carry_every_table_column():
    from radixcache.cli import FLEET_JSON_KEYS, JSON_KEYS

    assert "rejected" in JSON_KEYS and "requests_per_second" in JSON_KEYS
    assert {"rejected", "wall_seconds", "ttft_p99", "load_imbalance"} <= set(FLEET_JSON_KEYS)


def test_unavailable_core_is_a_usage_error(monkeypatch, capsys):
    from radixcache import _core

    monkeypatch.setattr(_core, "CORES", {"python": _core.CORES["python"]})
    assert main(["simulate", "--core", "c", "--limit", "5"]) == 2
    err = capsys.readouterr().err
    assert "the compiled core is not built here" in err and "usage: radixcache simulate" in err


# -- the host tier ---------------------------------------------------------------------------
def skip_without_host_tier(core):
    try:
        RadixCache(core=core, host_tier=True, array_type="numpy")
    except TypeError as exc:
        if core != "c":
            raise
        pytest.skip(f"the compiled core of this build has no host tier ({exc})")


def host_table(stdout: str) -> list:
    """The result table's rows with host columns, as lists of cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("capacity "))
    assert lines[start].split()[:6] == ["capacity", "policy", "host", "write", "policy",
                                        "requests"]
    rows = []
    for line in lines[start + 2:]:
        cells = line.split()
        if not cells or not cells[0][0].isdigit():
            break
        rows.append(cells)
    return rows


def test_simulate_host_capacity_sweep_rows_table_and_plot(tmp_path, capsys, core_name):
    skip_without_host_tier(core_name)
    from PIL import Image

    out_json, out_png = tmp_path / "rows.json", tmp_path / "host.png"
    assert main(["simulate", "--limit", "300", "--capacity", "8k,32k", "--host-capacity",
                 "0,16k,1G", "--write-policy", "all", "--core", core_name, "--jobs", "1",
                 "--json", str(out_json), "--plot", str(out_png), "--quiet"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    # Host 0 (no host tier) once per device capacity, then every write policy per host size.
    policies = ["write_back", "write_through", "write_through_selective"]
    assert [(r["capacity"], r["host_capacity"], r["write_policy"]) for r in rows] == [
        (c, h, w) for c in (8000, 32000)
        for h, w in [(0, None)] + [(h, w) for h in (16000, 10**9) for w in policies]]
    requests = synthetic_chat()[:300]
    for row in rows:
        assert list(row) == EXPECTED_KEYS
        assert row["hit_rate"] == pytest.approx(row["device_hit_rate"] + row["host_hit_rate"])
        if not row["host_capacity"]:
            plain = serve(RadixCache(core=core_name, array_type="numpy"), requests,
                          row["capacity"])
            assert row["hit_rate"] == row["device_hit_rate"] == plain.hit_rate
            assert row["host_hit_rate"] == row["loaded_tokens"] == row["backed_up_tokens"] == 0
            continue
        cache = RadixCache(core=core_name, host_tier=True, write_policy=row["write_policy"],
                           array_type="numpy")
        expected = serve(cache, requests, row["capacity"], host_capacity=row["host_capacity"])
        for key in ("cached_tokens", "hit_rate", "device_hit_rate", "host_hit_rate",
                    "loaded_tokens", "backed_up_tokens", "evicted_tokens"):
            assert row[key] == getattr(expected, key), key
    ceiling = serve(RadixCache(core=core_name, array_type="numpy"), requests, 10**9).hit_rate
    unlimited = {(r["capacity"], r["write_policy"]): r["hit_rate"] for r in rows
                 if r["host_capacity"] == 10**9}
    assert unlimited[8000, "write_back"] == unlimited[8000, "write_through"] == ceiling
    table = host_table(out)
    assert len(table) == len(rows)
    for cells, row in zip(table, rows):
        assert cells[2] == f"{row['host_capacity']:,}"
        assert cells[3] == (row["write_policy"] or "-")
        assert cells[8] == f"{100 * row['hit_rate']:.2f}%"
        assert cells[9] == f"{100 * row['device_hit_rate']:.2f}%"
        assert cells[10] == f"{100 * row['host_hit_rate']:.2f}%"
        assert cells[11] == f"{row['loaded_tokens']:,}"
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size == (1000, 500)


def test_simulate_host_jobs_rows_equal_serial(tmp_path, core_name):
    skip_without_host_tier(core_name)
    rows = {}
    for jobs in ("1", "3"):
        out_json = tmp_path / f"rows{jobs}.json"
        assert main(["simulate", "--limit", "200", "--capacity", "8k", "--host-capacity",
                     "0,8k,64k", "--write-policy", "write_back,write_through_selective",
                     "--core", core_name, "--jobs", jobs, "--json", str(out_json),
                     "--quiet"]) == 0
        rows[jobs] = [{k: v for k, v in r.items() if k not in ("seconds",
                                                                "requests_per_second")}
                      for r in json.loads(out_json.read_text())]
    assert rows["1"] == rows["3"] and len(rows["1"]) == 5


@pytest.mark.parametrize("args, message", [
    (["--host-capacity", "-1"], "host capacity '-1': must be >= 0"),
    (["--host-capacity", "1.5"], "host capacity '1.5'"),
    (["--host-capacity", "1M", "--write-policy", "write_around"],
     "unknown write policy 'write_around'"),
    (["--write-policy", "write_through"], "--write-policy applies to a host tier"),
    (["--host-capacity", "0", "--write-policy", "all"], "--write-policy applies to a host tier"),
    (["--load-tps", "1000"], "--load-tps applies to a fleet"),
])
def test_host_bad_arguments_exit_2(args, message, capsys):
    assert main(["simulate", "--limit", "5", "--core", "python", *args]) == 2
    assert message in capsys.readouterr().err


def test_host_capacity_without_host_option_keeps_the_table(capsys):
    assert main(["simulate", "--limit", "20", "--capacity", "1000", "--quiet"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("capacity"))
    assert "host" not in header and "write policy" not in header

"""Sweeps split over processes and machines: ``simulate --shard I/N`` and ``radixcache merge``
give a single run's rows; ``run_sweep`` and ``main(executor=...)`` run the points on
``concurrent.futures`` executors and on a real local Dask cluster with a single run's rows."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import shutil
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from radixcache import traces
from radixcache._core import CORES
from radixcache.cli import main, sweep
from radixcache.cli.args import shard
from radixcache.cli.merge import TIMING_KEYS
from radixcache.cli.sweep import ServePoint, SweepError, TraceSource, run_sweep, shard_slice

# Points: one-cache 6 and 2, host 5 and 2, fleet 6 and 2 (a fleet adds a pooled row per
# capacity): more points than most shard counts below, and fewer than 3 and 5 (empty shards).
# The sweeps, over a small token-id trace (TRACE_ARGS).
SWEEPS = {
    "one-cache": ["--capacity", "400,1k,4k", "--policy", "lru,slru"],
    "one-cache-small": ["--capacity", "1k", "--policy", "lru,fifo"],
    "host": ["--capacity", "512", "--host-capacity", "0,512,4k", "--write-policy",
             "write_back,write_through"],
    "host-small": ["--capacity", "512", "--host-capacity", "0,2k"],
    "fleet": ["--workers", "2", "--capacity", "400,1k", "--router", "round-robin,cache-aware"],
    "fleet-small": ["--workers", "3", "--capacity", "512", "--host-capacity", "1k",
                    "--router", "prefix-hash"],
}
POINTS = {"one-cache": 6, "one-cache-small": 2, "host": 5, "host-small": 2, "fleet": 6,
          "fleet-small": 2}
#: The embedded workload, cut short.
BASE = ["simulate", "--limit", "40", "--quiet"]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def load(path: Path):
    return json.loads(Path(path).read_text())


def write_trace(path: Path, shift: int = 0, requests: int = 30) -> Path:
    """A token-id trace: prompts sharing per-tenant prefixes, string namespaces, timestamps."""
    lines = []
    for i in range(requests):
        tenant = i % 3
        prompt = [tenant * 1000 + t for t in range(120)] + [i * 7 + t + shift for t in range(40)]
        lines.append(json.dumps({"prompt": prompt, "output_length": 16,
                                 "extra_key": f"tenant-{tenant}", "timestamp": i * 40}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trace_args(tmp_path_factory) -> list[str]:
    """``simulate`` over a small trace file (fast to read, unlike the embedded workload)."""
    return ["simulate", str(write_trace(tmp_path_factory.mktemp("trace") / "t.jsonl",
                                        requests=40)), "--quiet"]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, trace_args):
    """Each sweep's rows from one serial run (--jobs 1), made once."""
    folder = tmp_path_factory.mktemp("single")
    runs = {}
    for name, options in SWEEPS.items():
        out = folder / f"{name}.json"
        assert main([*trace_args, *options, "--jobs", "1", "--json", str(out)]) == 0
        runs[name] = load(out)
        assert len(runs[name]) == POINTS[name]
    return runs


def run_shards(folder: Path, argv: list[str], count: int) -> list[Path]:
    paths = []
    for index in range(count):
        path = folder / f"shard-{index}-of-{count}.json"
        assert main([*argv, "--shard", f"{index}/{count}",
                     "--json", str(path)]) == 0
        paths.append(path)
    return paths


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("name", list(SWEEPS))
def test_shards_merge_into_the_single_runs_rows(tmp_path, trace_args, single_runs, name,
                                                count):
    paths = run_shards(tmp_path, [*trace_args, *SWEEPS[name]], count)
    expected = single_runs[name]
    sizes = []
    for index, path in enumerate(paths):
        document = load(path)
        assert document["shard"] == [index, count]
        assert len(document["sweep"]["points"]) == len(expected)
        sizes.append(len(document["rows"]))
    assert sizes == [len(shard_slice(len(expected), i, count)) for i in range(count)]
    if count > len(expected):
        assert 0 in sizes  # empty shards still write their file, and merge takes them
    out = tmp_path / "merged.json"
    # Any order of the files on the command line.
    assert main(["merge", *map(str, reversed(paths)), "--json", str(out)]) == 0
    merged = load(out)
    assert [list(row) for row in merged] == [list(row) for row in expected]  # keys, in order
    assert without_timing(merged) == without_timing(expected)
    # The timings are each shard's own measurements.
    shard_rows = [row for path in paths for row in load(path)["rows"]]
    assert [[row[k] for k in TIMING_KEYS if k in row] for row in merged] == \
           [[row[k] for k in TIMING_KEYS if k in row] for row in shard_rows]


def test_shard_slices_cover_every_point_once_in_order():
    for points in range(13):
        for count in range(1, 8):
            slices = [shard_slice(points, index, count) for index in range(count)]
            assert [i for part in slices for i in part] == list(range(points))
            assert max(map(len, slices)) - min(map(len, slices)) <= 1
    with pytest.raises(ValueError, match="does not exist"):
        shard_slice(5, 3, 3)


def test_merge_prints_the_rows_without_json_and_plots_them(tmp_path, capsys):
    single = tmp_path / "single.json"
    assert main([*BASE, "--capacity", "8k", "--host-capacity", "0,32k", "--json",
                 str(single)]) == 0
    paths = run_shards(tmp_path, [*BASE, "--capacity", "8k", "--host-capacity", "0,32k"], 2)
    capsys.readouterr()
    plot = tmp_path / "merged.png"
    assert main(["merge", *map(str, paths), "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    assert without_timing(json.loads(captured.out)) == without_timing(load(single))
    assert captured.err == "merged 2 shards of synthetic chat (embedded): 2 rows\n"
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_shard_run_says_which_points_it_runs_and_its_file_records_the_sweep(tmp_path,
                                                                               capsys):
    out = tmp_path / "s.json"
    assert main([*BASE, "--workers", "2", "--capacity", "8k,32k", "--router",
                 "round-robin,cache-aware", "--shard", "1/4", "--json", str(out)]) == 0
    assert "shard 1/4: 2 of the sweep's 6 points" in capsys.readouterr().out
    document = load(out)
    assert document["format"] == "radixcache simulate --shard"
    sweep_record = document["sweep"]
    assert sweep_record["options"]["workers"] == 2
    assert sweep_record["options"]["limit"] == 40
    assert sweep_record["core"] in CORES
    assert sweep_record["trace"]["requests"] == 40
    assert [row["router"] for row in document["rows"]] == ["cache-aware", "pooled"]


# -- merge refuses what is not one whole sweep, and then writes nothing ------------------------

@pytest.fixture
def three_shards(tmp_path, trace_args) -> list[Path]:
    return run_shards(tmp_path, [*trace_args, *SWEEPS["one-cache"]], 3)


def edited(path: Path, edit) -> Path:
    document = load(path)
    edit(document)
    out = path.with_name(f"edited-{path.name}")
    out.write_text(json.dumps(document))
    return out


def refuse(tmp_path, capsys, files, message):
    """merge exits 1 with ``message``, and neither writes its outputs nor touches old ones."""
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    old = tmp_path / "old.json"
    old.write_text("[]\n")
    capsys.readouterr()
    assert main(["merge", *map(str, files), "--json", str(out), "--plot", str(plot)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("radixcache: error: ") and message in err, err
    assert len(err.splitlines()) == 1
    assert not out.exists() and not plot.exists()
    assert main(["merge", *map(str, files), "--json", str(old)]) == 1
    assert old.read_text() == "[]\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp


def test_merge_refuses_a_missing_shard(tmp_path, capsys, three_shards):
    refuse(tmp_path, capsys, [three_shards[0], three_shards[2]], "missing shard 1/3")
    refuse(tmp_path, capsys, [three_shards[1]], "missing shards 0/3, 2/3")


def test_merge_refuses_a_shard_given_twice(tmp_path, capsys, three_shards):
    copy = tmp_path / "copy.json"
    shutil.copy(three_shards[1], copy)
    refuse(tmp_path, capsys, [*three_shards, copy], f"shard 1/3 given twice: "
                                                    f"{three_shards[1]} and {copy}")


def test_merge_refuses_shards_of_another_count(tmp_path, capsys, trace_args, three_shards):
    (tmp_path / "two").mkdir()
    other = run_shards(tmp_path / "two", [*trace_args, *SWEEPS["one-cache"]], 2)[1]
    refuse(tmp_path, capsys, [*three_shards[:2], other], "all I/N with the same N")


@pytest.mark.parametrize("extra, message", [
    (["--page-size", "2"], "shards of different sweeps: --page-size 1 and 2"),
    (["--seed", "1"], "shards of different sweeps: --seed 0 and 1"),
    (["--block-size", "16"], "--block-size 512 and 16"),
])
def test_merge_refuses_shards_of_other_options(tmp_path, capsys, trace_args, three_shards,
                                               extra, message):
    other = tmp_path / "other.json"
    assert main([*trace_args, *SWEEPS["one-cache"], *extra, "--shard", "2/3", "--json",
                 str(other)]) == 0
    refuse(tmp_path, capsys, [*three_shards[:2], other], message)


def test_merge_refuses_shards_of_another_grid(tmp_path, capsys, trace_args, three_shards):
    other = tmp_path / "other.json"
    assert main([*trace_args, "--capacity", "400,1k,2k", "--policy", "lru,slru", "--shard", "2/3",
                 "--json", str(other)]) == 0
    refuse(tmp_path, capsys, [*three_shards[:2], other],
           "their grids differ (6 and 6 points, from point 4 on")


def test_merge_refuses_shards_of_another_trace(tmp_path, capsys):
    # The same name in two places, as on two machines: the content tells them apart.
    first = write_trace(tmp_path / "a" / "trace.jsonl")
    second = write_trace(tmp_path / "b" / "trace.jsonl", shift=1)
    options = ["--capacity", "1k,4k", "--quiet"]
    paths = []
    for index, trace in enumerate((first, second)):
        paths.append(tmp_path / f"s{index}.json")
        assert main(["simulate", str(trace), *options, "--shard", f"{index}/2", "--json",
                     str(paths[-1])]) == 0
    refuse(tmp_path, capsys, paths, "shards of sweeps over different traces: trace.jsonl "
                                    "(30 requests, sha256 ")
    # The same content under another path and name merges.
    third = tmp_path / "c" / "renamed.jsonl"
    third.parent.mkdir()
    shutil.copy(first, third)
    assert main(["simulate", str(third), *options, "--shard", "1/2", "--json",
                 str(paths[1])]) == 0
    assert main(["merge", str(paths[0]), str(paths[1]), "--json",
                 str(tmp_path / "m.json")]) == 0


@pytest.mark.skipif(len(CORES) < 2, reason="one tree core is built: nothing to mix")
def test_merge_refuses_shards_of_different_cores(tmp_path, capsys):
    paths = []
    for index, core in enumerate(sorted(CORES)):
        paths.append(tmp_path / f"s{index}.json")
        assert main([*BASE, "--capacity", "8k", "--core", core, "--shard", f"{index}/2",
                     "--json", str(paths[-1])]) == 0
    refuse(tmp_path, capsys, paths, "tree core, ")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["sweep"].update(radixcache="0.0.1"), "by 0.0.1: run every shard with one "
                                                            "version"),
    (lambda d: d.update(format_version=2), "shard file format version 2; this radixcache "
                                           "reads version 1"),
    (lambda d: d.update(format="something else"), "not a shard file of 'radixcache simulate"),
    (lambda d: d.update(shard=[3, 3]), "malformed shard file: 'shard' must be [I, N]"),
    (lambda d: d.update(shard=[True, 3]), "malformed shard file: 'shard' must be [I, N]"),
    (lambda d: d.pop("sweep"), "malformed shard file: no 'sweep' object"),
    (lambda d: d["sweep"].update(points=[[1, 2]]), "malformed shard file: the sweep's 'points'"),
    (lambda d: d["sweep"]["options"].pop("workers"), "malformed shard file: the sweep's "
                                                     "'options' have no 'workers'"),
    (lambda d: d.update(rows={}), "malformed shard file: 'rows' must be a list"),
    (lambda d: d["rows"].pop(), "shard 1/3 of a sweep of 6 points holds 2 of them, but the "
                                "file has 1 rows"),
    (lambda d: d["rows"][1].update(capacity=5), "row 1 (capacity 5, policy 'slru', "
                                                "host_capacity 0, write_policy None) is not the "
                                                "sweep's point 3 (capacity 1000"),
    (lambda d: d["rows"][0].pop("hit_rate"), "row 0 does not have the fields of a row "
                                             "(missing hit_rate)"),
])
def test_merge_refuses_a_damaged_shard_file(tmp_path, capsys, three_shards, edit, message):
    damaged = edited(three_shards[1], edit)
    refuse(tmp_path, capsys, [three_shards[0], damaged, three_shards[2]], message)


@pytest.mark.parametrize("content, message", [
    ("[]\n", "the rows of a run without --shard, not a shard file"),
    ('{"rows": []}\n', "not a shard file of 'radixcache simulate --shard I/N --json'"),
    ("{not json", "not a shard file (not JSON: line 1, column 2"),
    (b"\xff\xfe\x00", "not a shard file (not UTF-8 text)"),
])
def test_merge_refuses_what_is_not_a_shard_file(tmp_path, capsys, three_shards, content,
                                                message):
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    refuse(tmp_path, capsys, [three_shards[0], bad], f"{bad}: {message}")


def test_merge_refuses_a_missing_file(tmp_path, capsys, three_shards):
    refuse(tmp_path, capsys, [*three_shards, tmp_path / "nope.json"],
           f"cannot read '{tmp_path / 'nope.json'}': No such file or directory")


def test_merge_does_not_write_over_a_shard_file(tmp_path, capsys, three_shards):
    before = three_shards[0].read_text()
    assert main(["merge", *map(str, three_shards), "--json", str(three_shards[0])]) == 2
    assert f"--json {three_shards[0]}: that is one of the shard files" in capsys.readouterr().err
    assert three_shards[0].read_text() == before


def test_merge_without_files_is_a_usage_error(capsys):
    assert main(["merge"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "radixcache merge: error: the following arguments are required: " \
                       "SHARD.json"
    assert lines[1].startswith("usage: radixcache merge SHARD.json")


# -- --shard on the command line ---------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("1", "expected I/N, the I-th of N shards counted from 0 (0/4 to 3/4), got '1'"),
    ("1/", "expected I/N"),
    ("/2", "expected I/N"),
    ("a/b", "expected I/N"),
    ("1/2/3", "expected I/N"),
    ("-1/2", "expected I/N"),
    ("1.0/2", "expected I/N"),
    ("", "expected I/N"),
    ("2/2", "shard 2 of 2 does not exist: shards count from 0 (0/2 to 1/2), got '2/2'"),
    ("7/3", "shard 7 of 3 does not exist"),
    ("0/0", "the number of shards must be >= 1, got '0/0'"),
])
def test_bad_shard_is_one_line_and_the_usage(tmp_path, capsys, text, message):
    assert main(["simulate", f"--shard={text}", "--json", str(tmp_path / "s.json")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2 and captured.out == ""
    assert message in lines[0]
    assert lines[0].startswith("radixcache simulate: error: argument --shard: ")
    assert lines[1].startswith("usage: radixcache simulate ")
    assert not (tmp_path / "s.json").exists()


def test_shard_parses_i_of_n():
    assert shard("0/1") == (0, 1)
    assert shard(" 2 / 3 ") == (2, 3)
    assert shard("9/10") == (9, 10)


@pytest.mark.parametrize("args, message", [
    (["--shard", "0/2"], "--shard needs --json OUT.json"),
    (["--shard", "0/2", "--json", "{tmp}/s.json", "--plot", "{tmp}/s.png"],
     "--plot draws a whole sweep, not a shard"),
])
def test_shard_option_errors(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main([*BASE, *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and message in lines[0]
    assert list(tmp_path.iterdir()) == []


# -- executors ---------------------------------------------------------------------------------

def square(point, progress):
    """A picklable run_point (module level)."""
    assert progress is None
    return point * point


def fail_on_three(point, progress):
    if point == 3:
        raise ValueError("point 3 failed")
    return point


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    """Processes that share nothing with this one (no fork): as remote workers would."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


@pytest.mark.parametrize("make", [lambda: ThreadPoolExecutor(3), lambda: spawn_pool(2)],
                         ids=["threads", "processes"])
def test_run_sweep_on_an_executor_keeps_the_points_order(make):
    with make() as executor:
        assert run_sweep(list(range(9)), square, executor=executor) == [p * p for p in range(9)]
        with pytest.raises(ValueError, match="point 3 failed"):
            run_sweep(list(range(6)), fail_on_three, executor=executor)
        # The executor is the caller's: still open.
        assert executor.submit(square, 4, None).result() == 16


def test_run_sweep_takes_jobs_or_an_executor_not_both():
    with ThreadPoolExecutor(1) as executor, pytest.raises(ValueError, match="exclusive"):
        run_sweep([1], square, 2, executor=executor)


def test_run_sweep_reports_an_executor_that_died():
    with spawn_pool(1) as executor, \
            pytest.raises(SweepError, match="a worker of the executor died"):
        run_sweep([0, 1], _exit_worker, executor=executor)


def _exit_worker(point, progress):
    import os

    os._exit(3)  # as the kernel's out-of-memory killer would end it


def rows_of(argv: list[str], path: Path, **kwargs) -> list[dict]:
    assert main([*argv, "--json", str(path)], **kwargs) == 0
    return load(path)


@pytest.mark.parametrize("options", [
    ["--capacity", "4k,16k,64k", "--policy", "lru,slru"],
    ["--workers", "2", "--capacity", "8k", "--host-capacity", "0,8k", "--router",
     "round-robin,cache-aware"],
], ids=["one-cache", "fleet-host"])
def test_main_on_a_thread_pool_gives_the_serial_rows(tmp_path, options):
    # The embedded workload: the points use the driver's requests (threads share them).
    serial = rows_of([*BASE, *options, "--jobs", "1"], tmp_path / "serial.json")
    with ThreadPoolExecutor(3) as executor:
        rows = rows_of([*BASE, *options], tmp_path / "rows.json", executor=executor)
    assert without_timing(rows) == without_timing(serial) and len(rows) == 6


def test_main_on_a_process_pool_reads_the_trace_in_the_workers(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl")
    argv = ["simulate", str(trace), "--quiet", "--capacity", "2k,4k", "--host-capacity", "0,2k",
            "--workers", "2", "--router", "prefix-hash,cache-aware", "--block-size", "16",
            "--page-size", "16"]
    serial = rows_of([*argv, "--jobs", "1"], tmp_path / "serial.json")
    with spawn_pool(2) as executor:
        rows = rows_of(argv, tmp_path / "pool.json", executor=executor)
    assert len(rows) == 12
    assert without_timing(rows) == without_timing(serial)


def test_main_with_an_executor_refuses_jobs_and_other_commands(capsys):
    with ThreadPoolExecutor(1) as executor:
        assert main([*BASE, "--jobs", "2"], executor=executor) == 2
        assert "--jobs: the executor given to radixcache.cli.main runs the points" in \
               capsys.readouterr().err
        with pytest.raises(ValueError, match="not of 'bench'"):
            main(["bench", "--quick"], executor=executor)


def test_a_pickled_point_reads_the_trace_once_per_process_and_checks_it(tmp_path,
                                                                        monkeypatch):
    trace_path = write_trace(tmp_path / "trace.jsonl")
    source = TraceSource(str(trace_path), 512, None, 0)
    requests = source.read()
    point = ServePoint(source, requests, min(CORES), 1)
    driver = point((4096, "lru", 0, None))
    data = pickle.dumps(point)
    assert len(data) < 1000  # the trace stays behind

    reads = []
    real_read = traces.read_trace
    monkeypatch.setattr(traces, "read_trace", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    copies = [pickle.loads(data) for _ in range(3)]
    results = [copy((4096, "lru", 0, None)) for copy in copies]
    assert len(reads) == 1  # one read for every copy in this process
    assert {r.cached_tokens for r in results} == {driver.cached_tokens}

    # Another source replaces the kept trace; the first is read again when it comes back.
    other = tmp_path / "other.jsonl"
    write_trace(other)
    pickle.loads(pickle.dumps(ServePoint(TraceSource(str(other), 512, None, 0), requests,
                                         point.core, 1)))((4096, "lru", 0, None))
    assert len(reads) == 2
    copies[0]((4096, "lru", 0, None))
    assert len(reads) == 3

    write_trace(trace_path, requests=29)  # the file changed under the sweep
    stale = pickle.loads(data)
    monkeypatch.setattr(sweep, "_LOADED", None)
    with pytest.raises(SweepError, match="holds 29 requests .* the sweep's 30 .* every worker "
                                         "must read the same file"):
        stale((4096, "lru", 0, None))
    trace_path.unlink()
    monkeypatch.setattr(sweep, "_LOADED", None)
    with pytest.raises(SweepError, match="a worker cannot read the trace .*trace.jsonl.* "
                                         "must be reachable from every worker"):
        stale((4096, "lru", 0, None))


# -- a real Dask cluster -----------------------------------------------------------------------

def loaded_trace() -> str | None:
    """On a Dask worker: the path of the trace it read for the sweep's points."""
    return sweep._LOADED[0].path if sweep._LOADED is not None else None


def test_a_dask_cluster_gives_the_serial_rows(tmp_path):
    distributed = pytest.importorskip(
        "distributed", reason="Dask's distributed is not installed (pip install "
                              "'radixcache[cluster]')")
    trace = write_trace(tmp_path / "trace.jsonl")
    sweeps = [["--capacity", "2k,4k", "--policy", "lru,slru"],
              ["--capacity", "2k", "--workers", "2", "--router", "round-robin,prefix-hash",
               "--block-size", "16", "--page-size", "16"]]
    serial = [rows_of(["simulate", str(trace), "--quiet", *options, "--jobs", "1"],
                      tmp_path / f"serial{k}.json") for k, options in enumerate(sweeps)]
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        executor = client.get_executor()
        rows = [rows_of(["simulate", str(trace), "--quiet", *options], tmp_path / f"dask{k}.json",
                        executor=executor) for k, options in enumerate(sweeps)]
        loaded = client.run(loaded_trace)
    assert [len(r) for r in rows] == [4, 3]
    assert [without_timing(r) for r in rows] == [without_timing(r) for r in serial]
    # The points ran in the workers, which read the trace from its path.
    assert str(trace) in loaded.values()

"""How ``radixcache simulate`` scales with the trace: memory, wall time, and ``--jobs``.

The Mooncake conversation trace is repeated 1, 3 and 10 times into a temporary folder, the
hash ids of copy k offset by k x (largest id + 1) so that copies share nothing, timestamps
offset so that they keep increasing. Then, each in a fresh process of the real command:

1. one point, ``--capacity 2000000 --policy lru --page-size 16 --jobs 1``, per scale and
   best of ``--rounds``: peak RSS (``os.wait4`` of the child), wall time of the whole command,
   the time inside cache calls (``seconds`` of the ``--json`` row) and their ratio; the same
   ratio for the replay alone (``read_trace`` + ``serve`` timed in one process: no
   interpreter start or imports); the parsed trace's size (``Trace.nbytes``) against the
   file's, and the parse time; then where the time goes: the imports (numpy, then
   radixcache with the cache it makes, and whether torch was imported), the parse, and the
   replay's time in and outside the cache;
2. the RSS growth from 1x to 3x and 10x, against the growth of the parsed trace;
3. on the 1x trace, 4 capacities x 3 policies with ``--jobs 2`` and ``--jobs 1``, in
   interleaved rounds (best of ``--rounds``): the speedup, and whether the rows (all but the
   timing columns) are identical. CPU seconds are printed too, with the speedup they imply on
   two idle cores (on a machine that other sessions keep busy, wall times cannot show it), and
   the most two cores could give with that serial part.

    python benchmarks/bench_trace_scale.py                      # everything
    python benchmarks/bench_trace_scale.py --scales 1,3 --rounds 1
    python benchmarks/bench_trace_scale.py --only-scales        # skip the --jobs comparison
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_trace_scale.py --scales 1

Run from a checkout whose package is importable (an editable install, or PYTHONPATH).
Memory of the largest case is checked before running: the script refuses a scale whose
expanded tokens alone would not fit in the memory it may use (``--max-gb``), so that an
older version, which expanded every prompt up front, is only measured on the small traces.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from _cases import trace_file

DEFAULT_TRACE = trace_file("conversation")[0]
TIMING_KEYS = {"seconds", "wall_seconds", "requests_per_second"}


def build_scaled(source: Path, copies: int, dest: Path) -> tuple[int, int]:
    """Write ``copies`` copies of ``source`` to ``dest`` with disjoint hash ids; returns
    (requests, prompt tokens)."""
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    id_span = 1 + max(max(r["hash_ids"], default=-1) for r in records)
    time_span = 1 + max(r.get("timestamp", 0) for r in records)
    requests = tokens = 0
    with open(dest, "w", encoding="utf-8") as out:
        for k in range(copies):
            for r in records:
                row = dict(r)
                row["hash_ids"] = [h + k * id_span for h in r["hash_ids"]]
                if "timestamp" in r:
                    row["timestamp"] = r["timestamp"] + k * time_span
                out.write(json.dumps(row) + "\n")
                requests += 1
                tokens += r["input_length"]
    return requests, tokens


def run_measured(args: list, env: dict | None = None) -> tuple[float, int, str, float]:
    """Run a command; (wall seconds, peak RSS in bytes of that child, stdout, CPU seconds of
    the child and of the processes it waited for)."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode()
        proc.stderr.close()
        if proc.returncode != 0:
            raise RuntimeError(f"{args} failed ({proc.returncode}): {err[-2000:]}")
        out.seek(0)
        rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return wall, rss, out.read().decode(), usage.ru_utime + usage.ru_stime


def simulate(trace: Path, json_out: Path, extra: list) -> tuple[float, int, list, float]:
    wall, rss, _, cpu = run_measured([sys.executable, "-m", "radixcache", "simulate",
                                      str(trace), "--quiet", "--json", str(json_out), *extra])
    return wall, rss, json.loads(json_out.read_text()), cpu


REPLAY_SNIPPET = """
import sys, time
t0 = time.perf_counter()
import numpy
t1 = time.perf_counter()
from radixcache import RadixCache
from radixcache.traces import read_trace
from radixcache.workloads import serve
try:  # the cache the command makes: numpy index arrays where this version has them
    cache = RadixCache(page_size=16, eviction_policy="lru", array_type="numpy")
except TypeError:
    cache = RadixCache(page_size=16, eviction_policy="lru")
t2 = time.perf_counter()
torch_before = "torch" in sys.modules
trace = read_trace(sys.argv[1])
t3 = time.perf_counter()
result = serve(cache, trace, 2_000_000)
t4 = time.perf_counter()
# torch's import time, when this version imported it (it happened inside t1..t2 or t3..t4):
# timed again here in a fresh interpreter would double it, so it is reported as a flag.
print(t4 - t2, result.seconds, t1 - t0, int(torch_before or "torch" in sys.modules),
      t2 - t1, t3 - t2, t4 - t3)
"""

PARSE_SNIPPET = """
import sys, time
from radixcache.traces import read_trace
start = time.perf_counter()
trace = read_trace(sys.argv[1])
took = time.perf_counter() - start
print(took, getattr(trace, "nbytes", -1), len(trace))
"""


def gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--scales", default="1,3,10")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of each measurement (the best is kept)")
    parser.add_argument("--only-scales", action="store_true")
    parser.add_argument("--only-jobs", action="store_true")
    parser.add_argument("--max-gb", type=float, default=6.0,
                        help="refuse a scale whose prompt tokens as int64 exceed this "
                             "when the version under test expands them up front")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where to write the scaled traces (default: a temporary folder)")
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (looked there; pass --trace)", file=sys.stderr)
        return 1
    scales = [int(s) for s in args.scales.split(",")]

    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        tmp_path = Path(tmp)
        traces = {}
        for scale in sorted(set(scales) | {1}):
            path = tmp_path / f"conversation_x{scale}.jsonl"
            requests, tokens = build_scaled(args.trace, scale, path)
            traces[scale] = (path, requests, tokens)
            print(f"{scale}x: {requests:,} requests, {tokens:,} prompt tokens, "
                  f"file {path.stat().st_size / 2**20:.1f} MiB")

        # Every measured command starts a fresh interpreter: the package's bytecode is
        # compiled first, as installing it does (an environment with PYTHONDONTWRITEBYTECODE
        # would otherwise compile its modules again in every process, ~0.1 s).
        package = subprocess.run([sys.executable, "-c", "import os, radixcache; "
                                  "print(os.path.dirname(radixcache.__file__))"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "compileall", "-q", package], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"bytecode of {package} compiled")

        # The version under test keeps the trace compact when its reader says so (nbytes).
        probe = subprocess.run([sys.executable, "-c", PARSE_SNIPPET, str(traces[1][0])],
                               capture_output=True, text=True, check=True)
        compact = int(probe.stdout.split()[1]) >= 0

        if not args.only_jobs:
            print(f"\none point: --capacity 2000000 --policy lru --page-size 16 --jobs 1, "
                  f"best of {args.rounds} round(s)")
            print("(wall: the whole command, interpreter and imports included; replay: "
                  "read_trace + serve in one process, against that run's cache time)")
            extra = ["--capacity", "2000000", "--policy", "lru", "--page-size", "16"]
            measured = {}
            best: dict = {}
            for round_ in range(args.rounds):
                for scale in scales:
                    path, requests, tokens = traces[scale]
                    if not compact and tokens * 8 > args.max_gb * 2**30:
                        if round_ == 0:
                            print(f"{scale:>4}x  skipped: this version expands {tokens:,} "
                                  f"tokens ({gb(tokens * 8)}) up front, over --max-gb "
                                  f"{args.max_gb:g}")
                        continue
                    parse = subprocess.run([sys.executable, "-c", PARSE_SNIPPET, str(path)],
                                           capture_output=True, text=True, check=True)
                    parse_s, nbytes = float(parse.stdout.split()[0]), int(parse.stdout.split()[1])
                    wall, rss, rows, _cpu = simulate(path, tmp_path / "one.json",
                                                     extra + (["--jobs", "1"] if compact else []))
                    cache_s = rows[0]["seconds"]
                    replay = subprocess.run([sys.executable, "-c", REPLAY_SNIPPET, str(path)],
                                            capture_output=True, text=True, check=True)
                    replay_s, replay_cache_s, *phases = map(float, replay.stdout.split())
                    size = path.stat().st_size
                    measured[scale] = (rss, nbytes, size)
                    run = {"parse": parse_s, "rss": rss, "wall": wall, "cache": cache_s,
                           "ratio": wall / cache_s, "replay": replay_s / replay_cache_s,
                           "phases": phases, "replay_cache": replay_cache_s,
                           "nbytes": nbytes, "size": size}
                    # Per scale: the round with the lowest wall/cache ratio, the lowest
                    # replay ratio of any round, and the highest peak RSS of any round.
                    old = best.get(scale)
                    if old is not None:
                        replay_best = min(old["replay"], run["replay"])
                        rss_most = max(old["rss"], rss)
                        if old["ratio"] <= run["ratio"]:
                            run = old
                        run["replay"], run["rss"] = replay_best, rss_most
                    best[scale] = run
            print(f"{'scale':>5}  {'file':>9}  {'parsed':>9}  {'parse s':>7}  {'peak RSS':>10}  "
                  f"{'wall s':>7}  {'cache s':>7}  {'wall/cache':>10}  {'replay/cache':>12}")
            for scale in scales:
                if scale not in best:
                    continue
                b = best[scale]
                nbytes = b["nbytes"]
                print(f"{scale:>4}x  {b['size'] / 2**20:>7.1f}MB  "
                      f"{(nbytes / 2**20 if nbytes >= 0 else float('nan')):>7.1f}MB  "
                      f"{b['parse']:>7.2f}  {gb(b['rss']):>10}  {b['wall']:>7.1f}  "
                      f"{b['cache']:>7.2f}  {b['ratio']:>9.1f}x  {b['replay']:>11.1f}x")
            # Where the command's time goes, from the replay process of the best round:
            # imports, parse, and the replay split into in-cache time and the rest (making
            # tokens, the pool's bookkeeping, the loop).
            print("\nwhere the time goes (replay process of the best round; s):")
            print("(radixcache: importing it and making the cache, torch included when it is "
                  "imported: the torch column)")
            print(f"{'scale':>5}  {'numpy':>6}  {'torch':>6}  {'radixcache':>10}  {'parse':>6}  "
                  f"{'replay':>7}  {'in cache':>8}  {'outside':>8}  {'command wall':>12}")
            for scale in scales:
                if scale not in best or not best[scale]["phases"]:
                    continue
                b = best[scale]
                numpy_s, torch_used, package_s, parse_s, serve_s = b["phases"]
                torch_flag = "yes" if torch_used else "no"
                print(f"{scale:>4}x  {numpy_s:>6.2f}  {torch_flag:>6}  {package_s:>10.2f}  "
                      f"{parse_s:>6.2f}  {serve_s:>7.2f}  {b['replay_cache']:>8.2f}  "
                      f"{serve_s - b['replay_cache']:>8.2f}  {b['wall']:>12.2f}")
            if 1 in measured:
                base_rss, base_bytes, _ = measured[1]
                for scale, (rss, nbytes, size) in sorted(measured.items()):
                    if scale == 1:
                        continue
                    print(f"RSS growth 1x -> {scale}x: {gb(rss - base_rss)} "
                          f"(parsed trace grew {(nbytes - base_bytes) / 2**20:.1f} MiB; "
                          f"parsed / file at {scale}x: {nbytes / size:.2f})")

        if not args.only_scales and compact:
            path = traces[1][0]
            grid = ["--capacity", "250000,500000,1000000,2000000", "--policy",
                    "lru,lfu,fifo", "--page-size", "16"]
            best = {1: float("inf"), 2: float("inf")}
            cpu_of = {1: float("inf"), 2: float("inf")}
            rows_of = {}
            # What does not run in parallel: interpreter, imports, parse, one tiny point.
            _w, _r, _rows, serial_cpu = simulate(path, tmp_path / "tiny.json",
                                                 ["--capacity", "1000", "--limit", "1"])
            print(f"\n4 capacities x 3 policies on the 1x trace: --jobs 2 vs --jobs 1, "
                  f"{args.rounds} interleaved round(s)")
            for round_ in range(args.rounds):
                for jobs in (1, 2) if round_ % 2 == 0 else (2, 1):
                    wall, _rss, rows, cpu = simulate(path, tmp_path / f"grid{jobs}.json",
                                                     grid + ["--jobs", str(jobs)])
                    best[jobs] = min(best[jobs], wall)
                    cpu_of[jobs] = min(cpu_of[jobs], cpu)
                    rows_of[jobs] = [{k: v for k, v in row.items() if k not in TIMING_KEYS}
                                     for row in rows]
                    print(f"  round {round_ + 1}: --jobs {jobs}: {wall:.1f} s wall, "
                          f"{cpu:.1f} s CPU")
            same = rows_of[1] == rows_of[2]
            print(f"best: --jobs 1 {best[1]:.1f} s, --jobs 2 {best[2]:.1f} s: "
                  f"{best[1] / best[2]:.2f}x faster; rows identical: {same}")
            # On a busy machine the wall times say little (another session's processes take
            # the cores); the CPU seconds say what two idle cores would give.
            parallel = cpu_of[2] - serial_cpu
            estimate = cpu_of[1] / (serial_cpu + parallel / 2)
            print(f"CPU: --jobs 1 {cpu_of[1]:.1f} s, --jobs 2 {cpu_of[2]:.1f} s, of which "
                  f"{serial_cpu:.1f} s serial (start, imports, parse); on two idle cores "
                  f"--jobs 2 would be {estimate:.2f}x faster")
            # Amdahl: what two cores could give at most with this serial part and no cost of
            # running in processes (the extra CPU of --jobs 2 is that cost).
            bound = cpu_of[1] / (serial_cpu + (cpu_of[1] - serial_cpu) / 2)
            print(f"at most {bound:.2f}x with {serial_cpu:.1f} s serial of {cpu_of[1]:.1f} s; "
                  f"--jobs 2 costs {cpu_of[2] - cpu_of[1]:+.1f} s of CPU more than --jobs 1")
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

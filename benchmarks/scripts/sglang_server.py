"""Two real SGLang servers, SGLang's own prefix cache against ``--radix-cache-backend radixcache``.

Writes a tiny Llama-shaped model (a ``config.json`` only: ``--load-format dummy`` fills the
weights with random values, so nothing is downloaded), starts ``python -m
sglang.launch_server`` on it once with SGLang's default cache and once with the radixcache
backend (``--skip-tokenizer-init``: requests carry token ids, answers too), sends both the same
multi-turn conversations, sequentially and greedily (``temperature=0``), and compares per
request the output tokens (must be identical: both caches give the model the same KV) and
``meta_info.cached_tokens`` (the prefix each cache served), plus the throughput of each run.
Prints a table and writes everything to a JSON file.

Needs a machine SGLang can serve on (a CUDA GPU) and ``pip install radixcache sglang``; with a
checkout, ``pip install -e .`` so that SGLang finds the plugin's entry point. Everything the
servers do goes to loopback. Usage::

    python benchmarks/scripts/sglang_server.py --out sglang_server.json \\
        [--conversations 32 --turns 4 --page-size 16 --port 30000 --timeout 900]

``--dry-run`` writes the model config and prints the two server command lines without
starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

#: A small Llama: 2 layers, 4 heads of 32 (2 KV heads), vocabulary 32,000.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: Token ids the conversations draw from: above the special ids, well inside the vocabulary.
TOKEN_RANGE = (100, 31000)


def write_model(directory: Path) -> Path:
    """The model directory: its ``config.json`` and a ``generation_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


def server_command(model: Path, port: int, page_size: int, radixcache: bool,
                   extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
               "--port", str(port), "--page-size", str(page_size), "--random-seed", "0",
               "--mem-fraction-static", "0.3", "--cuda-graph-backend-decode", "disabled",
               "--cuda-graph-backend-prefill", "disabled", "--log-level", "warning"]
    if radixcache:
        command += ["--radix-cache-backend", "radixcache"]
    return command + extra


def conversations(count: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, the user tokens of each turn; the first turn opens with one of four
    shared system prompts (so conversations share prefixes across each other too)."""
    rng = random.Random(seed)
    low, high = TOKEN_RANGE
    systems = [[rng.randrange(low, high) for _ in range(rng.randrange(64, 256))]
               for _ in range(4)]
    plans = []
    for _ in range(count):
        user_turns = [[rng.randrange(low, high) for _ in range(rng.randrange(16, 96))]
                      for _ in range(turns)]
        user_turns[0] = rng.choice(systems) + user_turns[0]
        plans.append(user_turns)
    return plans


def _post(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(base: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it "
                               "was ready (see its log)")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise TimeoutError(f"the server at {base} was not ready within {timeout:.0f} s")


def run_one(name: str, command: list[str], port: int, plans: list, max_new_tokens: int,
            timeout: float, log_dir: Path) -> dict:
    """Start one server, play every conversation turn by turn, stop the server."""
    base = f"http://127.0.0.1:{port}"
    log = open(log_dir / f"{name}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_ready(base, process, timeout)
        results = []
        generated = 0
        start = time.perf_counter()
        histories = [[] for _ in plans]
        for turn in range(len(plans[0])):
            for index, plan in enumerate(plans):
                prompt = histories[index] + plan[turn]
                answer = _post(f"{base}/generate", {
                    "input_ids": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                        "ignore_eos": True},
                }, timeout)
                output = answer["output_ids"]
                meta = answer.get("meta_info", {})
                results.append({"conversation": index, "turn": turn,
                                 "prompt_tokens": len(prompt), "output_ids": output,
                                 "cached_tokens": meta.get("cached_tokens")})
                generated += len(output)
                histories[index] = prompt + output
        seconds = time.perf_counter() - start
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {"command": command, "seconds": seconds, "requests": len(results),
            "prompt_tokens": prompt_tokens, "generated_tokens": generated,
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in results),
            "requests_per_second": len(results) / seconds, "results": results}


def compare(default: dict, ours: dict) -> dict:
    """Per request: same output tokens? same cached prefix?"""
    same_output = same_cached = 0
    differences = []
    for a, b in zip(default["results"], ours["results"]):
        if a["output_ids"] == b["output_ids"]:
            same_output += 1
        if a["cached_tokens"] == b["cached_tokens"]:
            same_cached += 1
        else:
            differences.append({"conversation": a["conversation"], "turn": a["turn"],
                                "default": a["cached_tokens"], "radixcache": b["cached_tokens"]})
    return {"requests": len(default["results"]), "identical_outputs": same_output,
            "identical_cached_tokens": same_cached, "cached_token_differences": differences}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sglang_server.json", help="the JSON report")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds to wait for a server to be ready, and per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="where to write the model config (default: a "
                                            "temporary folder)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the model config, print the commands, start nothing")
    parser.add_argument("server_args", nargs="*",
                        help="more sglang.launch_server arguments for both servers (after --)")
    args = parser.parse_args(argv)
    work = Path(args.model_dir or tempfile.mkdtemp(prefix="radixcache-sglang-"))
    model = write_model(work / "tiny-llama")
    commands = {name: server_command(model, args.port, args.page_size, name == "radixcache",
                                     args.server_args)
                for name in ("default", "radixcache")}
    if args.dry_run:
        print(f"model config: {model / 'config.json'}")
        for name, command in commands.items():
            print(f"{name}: {' '.join(command)}")
        return 0
    plans = conversations(args.conversations, args.turns, args.seed)
    runs = {name: run_one(name, command, args.port, plans, args.max_new_tokens, args.timeout,
                          work)
            for name, command in commands.items()}
    verdict = compare(runs["default"], runs["radixcache"])
    report = {"model": TINY_LLAMA, "page_size": args.page_size, "runs": runs,
              "comparison": verdict}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'server':12s} {'requests':>8s} {'seconds':>8s} {'req/s':>7s} {'prompt tok':>11s}"
          f" {'cached tok':>11s}")
    for name, run in runs.items():
        print(f"{name:12s} {run['requests']:8d} {run['seconds']:8.2f} "
              f"{run['requests_per_second']:7.2f} {run['prompt_tokens']:11d} "
              f"{run['cached_tokens']:11d}")
    print(f"identical outputs: {verdict['identical_outputs']}/{verdict['requests']}; identical "
          f"cached_tokens: {verdict['identical_cached_tokens']}/{verdict['requests']}; "
          f"report: {args.out}")
    if not args.model_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if verdict["identical_outputs"] == verdict["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())

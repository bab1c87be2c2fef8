"""Hit rates of radixcache's split rule against SGLang's, on the same serving loop.

When a match or insert ends inside a node, the node is split. radixcache refreshes only what
was matched (the new upper node); the lower half keeps its access time. SGLang's classic
``RadixCache`` and Smile stamp the node before splitting it, so the unmatched lower half looks
freshly used too. This script replays the Mooncake trace and the synthetic chat workload
through ``radixcache.workloads.serve`` with both rules and prints the hit rates side by side
(a Markdown table for docs/sglang.md).

The other rule lives only here: a subclass of the pure-Python tree core whose split also
stamps the lower half with the current call's time, put into a ``RadixCache(core="python")``.
Hit rates do not depend on the core (both cores make identical decisions; the test suite
checks it), only the time taken does.

    python benchmarks/scripts/split_rule.py                  # both workloads, every capacity below
    python benchmarks/scripts/split_rule.py --quick          # fewer capacities
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _cases import core_of, trace_file
from radixcache import RadixCache
from radixcache import _core_py
from radixcache.traces import read_trace
from radixcache.workloads import serve, synthetic_chat

TRACE_PATH = trace_file("synthetic")[0]


class StampLowerHalfTree(_core_py.Tree):
    """SGLang's rule: a split also stamps the unmatched lower half with the current time."""

    __slots__ = ()

    def _split(self, node, at):
        upper = super()._split(node, at)
        node._last_access_time = self.clock  # match/insert ticked the clock before walking
        return upper


def make_cache(rule: str, page_size: int, policy: str) -> RadixCache:
    cache = RadixCache(page_size=page_size, eviction_policy=policy, core="python")
    if rule == "sglang":
        # Fresh and empty, like the one it replaces; the core keeps its guard and heap.
        core_of(cache).tree = StampLowerHalfTree(page_size)
    return cache


def hit_rate(requests, capacity: int, rule: str, page_size: int, policy: str) -> float:
    return serve(make_cache(rule, page_size, policy), requests, capacity).hit_rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer capacities")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--policy", default="lru")
    args = parser.parse_args(argv)

    cases = []
    chat_caps = (32_768, 65_536) if args.quick else (16_384, 32_768, 65_536, 131_072, 262_144)
    cases.append(("synthetic chat (300 conversations)", synthetic_chat(num_conversations=300,
                                                                        seed=0), chat_caps))
    if TRACE_PATH.is_file():
        trace_caps = ((2_000_000, 8_000_000) if args.quick
                      else (1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000))
        cases.append(("Mooncake trace (3,993 requests)", read_trace(TRACE_PATH), trace_caps))
    else:
        print(f"(trace not found: {TRACE_PATH}; Mooncake rows skipped)", file=sys.stderr)

    print(f"page_size={args.page_size}, policy={args.policy}\n")
    print("| workload | capacity (tokens) | radixcache: refresh the matched part | "
          "SGLang: stamp the lower half too | difference |")
    print("|---|---|---|---|---|")
    for name, requests, capacities in cases:
        for capacity in capacities:
            ours = hit_rate(requests, capacity, "radixcache", args.page_size, args.policy)
            theirs = hit_rate(requests, capacity, "sglang", args.page_size, args.policy)
            print(f"| {name} | {capacity:,} | {ours:.2%} | {theirs:.2%} | "
                  f"{(ours - theirs) * 100:+.3f} pt |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Case 4: matching one long cached prompt (10^4 tokens) against numpy.array_equal.

Three rows per group: ``numpy.array_equal`` on the same two arrays (the memcmp-like limit),
``RadixCache.match_prefix`` (public API, returns the index tensor) and the bare core walk
(``Core.walk``, read-only, no tensor), per core.
"""

from __future__ import annotations

import pytest

from _cases import FULL, long_prompt

NUM_TOKENS = FULL.match_tokens


@pytest.fixture(scope="module")
def prompts():
    built = {}

    def get(core):
        if core not in built:
            built[core] = long_prompt(core, NUM_TOKENS)
        return built[core]

    return get


def test_match_long_prompt_numpy_array_equal(benchmark, prompts):
    from _cases import core_names

    lp = prompts(core_names()[0])
    benchmark.group = f"match: one cached prompt of {NUM_TOKENS} tokens"
    assert benchmark(lp.array_equal)


def test_match_long_prompt_match_prefix(benchmark, prompts, core):
    lp = prompts(core)
    benchmark.group = f"match: one cached prompt of {NUM_TOKENS} tokens"
    result = benchmark(lp.match)
    assert result.length == NUM_TOKENS


def test_match_long_prompt_tree_walk(benchmark, prompts, core):
    lp = prompts(core)
    benchmark.group = f"match: one cached prompt of {NUM_TOKENS} tokens"
    length = benchmark(lp.tree_match)
    assert length == NUM_TOKENS

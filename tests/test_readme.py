"""The README's Python examples run as written, and print what the README says they print."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    return out.getvalue()


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    if "ZmqEvent" in BLOCKS[index]:
        pytest.importorskip("zmq")
        pytest.importorskip("msgspec")
    assert _run(BLOCKS[index]) is not None


def test_exercise_example_prints_the_documented_tree():
    exercise = next(block for block in BLOCKS if "cache.exists" in block)
    documented = re.search(r"prints\n\n```\n(.*?)```", README, re.S).group(1)
    assert _run(exercise) == documented


def test_serving_loop_example_reuses_the_first_turn():
    serving = next(block for block in BLOCKS if "def serve" in block)
    lines = _run(serving).splitlines()
    assert lines[0] == "0"
    assert lines[1] == "105"

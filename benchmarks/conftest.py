"""pytest setup for the benchmarks (not part of the CI test run: pyproject's testpaths is tests/).

Run them with::

    python -m pytest benchmarks/ --benchmark-group-by=group --benchmark-columns=min,mean,rounds

The benchmark files are called ``bench_*.py``: pyproject's ``python_files`` collects them when
pytest is pointed at this folder, and a plain ``pytest`` (``testpaths = ["tests"]``) never
reaches them. The standalone scripts are in ``scripts/``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# The package is not installed: make the checkout importable, and the shared helpers too.
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from radixcache._core import CORES
from _cases import FULL, TRACE_MISSING, TRACE_PATH, chat_requests, trace_requests


@pytest.fixture(scope="module")
def chat():
    """The synthetic chat workload of the serving benchmarks."""
    return chat_requests(FULL)


@pytest.fixture(scope="module")
def trace():
    """The first requests of the shared Mooncake trace (skipped without it)."""
    if not TRACE_PATH.is_file():
        pytest.skip(TRACE_MISSING)
    return trace_requests(FULL.trace_limit)


_NOTES: list[tuple[str, str, str]] = []


@pytest.fixture
def note(request):
    """``note(text)``: a line for the end-of-run summary of what the timing table leaves out."""
    def add(text: str) -> None:
        _NOTES.append((request.node.nodeid.split("::")[0], request.node.name, text))

    return add


def pytest_terminal_summary(terminalreporter) -> None:
    if not _NOTES:
        return
    terminalreporter.section("benchmark extras (not in the timing table)")
    for path, name, text in _NOTES:
        terminalreporter.write_line(f"{path}::{name}: {text}")


@pytest.fixture(params=list(CORES), ids=list(CORES))
def core(request) -> str:
    """Every tree core that exists in this build: "python" always, "c" once compiled."""
    return request.param

"""pytest setup for the benchmarks (not part of the CI test run: pyproject's testpaths is tests/).

Run them with::

    python -m pytest benchmarks/ --benchmark-group-by=group --benchmark-columns=min,mean,rounds

The benchmark files are called ``bench_*.py`` so that a plain ``pytest`` over the repository
never picks them up; the hook below collects them when pytest is pointed at this folder.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

# The package is not installed: make the checkout importable, and the shared helpers too.
for _path in (str(REPO_ROOT), str(BENCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from radixcache._core import CORES  # noqa: E402 -- needs the path set above
from _cases import FULL, TRACE_MISSING, TRACE_PATH, chat_requests, trace_requests  # noqa: E402


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


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    """Collect ``bench_*.py`` here unless pytest does already (path given, -o python_files)."""
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    if BENCH_DIR not in file_path.parents:
        return None
    if parent.session.isinitpath(file_path):
        return None  # named on the command line: pytest's own python plugin collects it
    patterns = parent.config.getini("python_files")
    if any(fnmatch.fnmatch(file_path.name, pattern) for pattern in patterns):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


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

"""The Python examples of the README and of the docs pages run as written, and print what the
README says they print; the README's links to local files lead somewhere."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README}
PAGES.update({f"docs/{page.name}": page.read_text()
              for page in sorted((ROOT / "docs").glob("*.md"))})
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
EXAMPLES = [(name, block) for name, text in PAGES.items()
            for block in re.findall(r"```python\n(.*?)```", text, re.S)]


def _run(code: str, where: str = "README.md") -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "readme_example"})
    return out.getvalue()


def test_readme_has_examples():
    assert len(BLOCKS) >= 2  # the serving loop and the trie; the rest are in docs/


@pytest.mark.parametrize("index", range(len(EXAMPLES)),
                         ids=[f"{name}-{i}" for i, (name, _) in enumerate(EXAMPLES)])
def test_example_runs(index):
    where, code = EXAMPLES[index]
    if "ZmqEvent" in code:
        pytest.importorskip("zmq")
        pytest.importorskip("msgspec")
    if 'store="redis://' in code:  # tests/router/test_redis_index.py runs these against a server
        pytest.skip("the example needs a running Redis server")
    for module in ("dask", "ray"):  # the cluster examples (radixcache[cluster]; Ray)
        if f"import {module}" in code or f"from {module}" in code:
            pytest.importorskip(module, reason=f"the example needs {module}")
    assert _run(code, where) is not None


def test_exercise_example_prints_the_documented_tree():
    exercise = next(block for block in BLOCKS if "cache.exists" in block)
    documented = re.search(r"prints\n\n```\n(.*?)```", README, re.S).group(1)
    assert _run(exercise) == documented


def test_serving_loop_example_reuses_the_first_turn():
    serving = next(block for block in BLOCKS if "def serve" in block)
    lines = _run(serving).splitlines()
    assert lines[0] == "0"
    assert lines[1] == "105"


def test_readme_links_to_local_files_exist():
    # mkdocs checks the docs pages' links (mkdocs build --strict in CI); this checks the README's.
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links to no local file"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_is_a_front_page():
    # The details live in docs/; the README stays short enough to read in one go.
    assert len(README.encode()) <= 15_000, len(README.encode())


def test_examples_use_no_checkout_relative_trace():
    for name, text in PAGES.items():
        assert "../shared" not in text, f"{name} points at a folder a clone does not have"


def test_host_tier_example_prints_what_its_page_says():
    page = PAGES["docs/host-tier.md"]
    example = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S)
                   if "copy_to_host" in block)
    after = page[page.index(example) + len(example):]
    documented = re.search(r"prints\n\n```\n(.*?)```", after, re.S).group(1)
    assert _run(example) == documented


def test_setup_commands_install_what_they_need():
    """The README's set-up commands name extras that pyproject.toml defines; the main job's
    plain ``pip install .`` brings no torch (the command never imports it), while the test
    command installs the torch extra the suite needs."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    setup = README[README.index("## Set up"):README.index("## Quick start")]
    main_job, test_command = re.findall(r"```sh\n(.*?)```", setup, re.S)[:2]
    assert "&& pip install . && radixcache simulate" in main_job
    assert not any(re.match(r"torch\b", dep) for dep in project["dependencies"])
    assert any(re.match(r"torch\b", dep) for dep in extras["torch"])
    named = re.findall(r'pip install (?:-e )?"\.\[([a-z,]+)\]"', setup)
    assert named, "the set-up section names no extra"
    for group in named:
        for extra in group.split(","):
            assert extra in extras, f"the README installs an undefined extra {extra!r}"
    tested = re.search(r'pip install -e "\.\[([a-z,]+)\]"', test_command).group(1).split(",")
    assert {"test", "torch"} <= set(tested), tested

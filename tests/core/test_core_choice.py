"""Which tree core is used: RADIXCACHE_NO_EXTENSIONS, the compiled default, RadixTreeNode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import radixcache
from radixcache import RadixCache, RadixTreeNode
from radixcache._core import CORES

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = (
    "import json, sys, radixcache\n"
    "from radixcache._core import CORES\n"
    "from radixcache import RadixCache\n"
    "print(json.dumps({'default': radixcache.core_name(), 'cores': sorted(CORES),\n"
    "                  'cache': RadixCache(array_type='numpy').core_name,\n"
    "                  'loaded_c': 'radixcache._core_c' in sys.modules}))\n"
)


def probe(no_extensions: bool) -> dict:
    """Import radixcache in a fresh interpreter (the choice is made once, at import)."""
    env = {k: v for k, v in os.environ.items() if k != "RADIXCACHE_NO_EXTENSIONS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if no_extensions:
        env["RADIXCACHE_NO_EXTENSIONS"] = "1"
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_extensions_forces_the_python_core():
    seen = probe(no_extensions=True)
    assert seen["default"] == "python"
    assert seen["cache"] == "python"
    assert seen["cores"] == ["python"]
    assert not seen["loaded_c"]


def test_compiled_core_is_the_default_when_built():
    # Asked of the file system, not of CORES: this process may run with the variable set.
    if importlib.util.find_spec("radixcache._core_c") is None:
        pytest.skip("the compiled core is not built")
    seen = probe(no_extensions=False)
    assert seen["default"] == "c"
    assert seen["cache"] == "c"
    assert seen["cores"] == ["c", "python"]


def test_this_process_default_matches_core_name():
    assert RadixCache(array_type="numpy").core_name == radixcache.core_name()
    assert radixcache.core_name() in CORES


def test_core_argument_selects_the_core(core_name):
    cache = RadixCache(core=core_name, array_type="numpy")
    assert cache.core_name == core_name
    assert core_name in repr(cache)


def test_nodes_of_every_core_are_radix_tree_nodes(make_cache, core_name):
    cache = make_cache(array_type="numpy")
    inserted = cache.insert([1, 2, 3, 4]).last_node
    matched = cache.match_prefix([1, 2]).last_node  # an upper half made by a split
    for node in (cache.root_node, inserted, matched, inserted.parent):
        assert isinstance(node, RadixTreeNode)
    assert issubclass(CORES[core_name].Node, RadixTreeNode)
    cache.evict(4)
    assert isinstance(inserted, RadixTreeNode)  # evicted handles keep their type
    for not_a_node in (object(), None, 3, [1, 2]):
        assert not isinstance(not_a_node, RadixTreeNode)

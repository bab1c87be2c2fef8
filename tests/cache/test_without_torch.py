"""radixcache without PyTorch: torch is an extra (``radixcache[torch]``), not a dependency.

Importing the package imports no torch, and where torch is missing a torch-array cache says
how to get it. Each check runs in a fresh interpreter, where ``sys.modules`` shows what was
imported; the absence of torch is made there with ``sys.modules["torch"] = None`` (Python
then refuses ``import torch`` as if it were not installed), so the checks run where torch is
installed too. CI also runs this file in an environment that has no torch at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The public modules a user of the command or of numpy-array caches imports.
PUBLIC = ["radixcache", "radixcache.cli", "radixcache.workloads", "radixcache.traces",
          "radixcache.fleet", "radixcache.router", "radixcache.events"]


def run_python(code: str, core_name: str | None = None) -> str:
    """Run ``code`` in a fresh interpreter on the checkout (on ``core_name``'s core, or the
    default one) and return what it printed."""
    env = dict(os.environ)
    env.pop("RADIXCACHE_NO_EXTENSIONS", None)
    if core_name == "python":
        env["RADIXCACHE_NO_EXTENSIONS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_public_modules_import_no_torch():
    out = run_python(f"""
        import importlib, sys
        for name in {PUBLIC!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    assert out.split() == ["[]"]


def test_no_module_but_the_sglang_backend_imports_torch():
    """Every module of the package imports with torch missing, except the SGLang backend
    (SGLang itself needs torch); the command's modules, both cores and the helpers
    included."""
    out = run_python("""
        import importlib, pkgutil, sys
        sys.modules["torch"] = None
        import radixcache
        failed = []
        names = [m.name for m in pkgutil.walk_packages(radixcache.__path__, "radixcache.")
                 if not m.name.endswith("__main__")]  # __main__ runs the command
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                failed.append((name, str(exc)))
        print(len(names))
        print(failed)
    """)
    count, failed = out.splitlines()
    assert int(count) > 30  # the walk found the package's modules
    assert failed == "[('radixcache.integrations.sglang', "\
                     "'import of torch halted; None in sys.modules')]"


@pytest.mark.parametrize("where", ["cache", "host-tier cache", "pool", "timing input"])
def test_torch_arrays_without_torch_say_what_to_install(core_name, where):
    """Making torch index arrays without torch raises ModuleNotFoundError naming the extra
    and numpy arrays; numpy arrays go on working in the same process, and so does the
    command."""
    make = {
        "cache": "RadixCache()",
        "host-tier cache": "RadixCache(page_size=4, host_tier=True)",
        "pool": "KVPool(8).alloc(2)",
        "timing input": "as_input_type(np.arange(3), 'tensor')",
    }[where]
    out = run_python(f"""
        import sys
        sys.modules["torch"] = None
        import numpy as np
        from radixcache import RadixCache
        from radixcache._torch import torch_installed
        from radixcache.cli import main
        from radixcache.workloads import KVPool, as_input_type
        assert not torch_installed()
        try:
            {make}
        except ModuleNotFoundError as exc:
            assert exc.name == "torch", exc.name
            print(exc)
        else:
            raise AssertionError("made torch arrays without torch")
        cache = RadixCache(array_type="numpy")
        cache.insert([1, 2, 3], [7, 8, 9])
        assert cache.match_prefix([1, 2, 4]).indices.tolist() == [7, 8]
        assert sorted(KVPool(8, array_type="numpy").alloc(2).tolist()) == [0, 1]
        assert main(["simulate", "--quiet", "--limit", "50", "--capacity", "4096"]) == 0
        print(cache.core_name)
    """, core_name)
    lines = out.splitlines()
    message, core = lines[0], lines[-1]
    assert "hit rate" in out  # the command's table
    assert "pip install 'radixcache[torch]'" in message
    assert 'array_type="numpy"' in message
    assert core == core_name

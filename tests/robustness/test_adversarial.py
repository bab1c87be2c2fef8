"""Adversarial Python code inside a cache call: nothing may crash, hang, leak or mix namespaces.

Python code runs inside a call more often than it looks: a token's ``__index__``, an
extra_key's ``__hash__``/``__eq__``, torch hooks (``TorchFunctionMode``), finalizers set off by
a DECREF or by a collection, other threads. Each case (a function in
``adversarial_cases.py`` or ``adversarial_tensor_cases.py``) runs in its own subprocess
(``python -X dev -X faulthandler``), so a segfault fails that case and not the run, and a
timeout catches a hang. The cases are grouped by the ways user code can break a call:

1. token conversion reading items that ``__index__`` can change;
2. namespace lookup (user hashing) in the middle of a walk, namespace ids reused;
3. a split calling torch (hooks, other threads) between reading and writing the tree;
4. a borrowed token buffer read after user code resized or wrote it;
5. nodes invisible to the garbage collector (cycles through a node never collected);
6. recursive teardown when the garbage collector frees a deep tree;
7. heap loops that release references mid-update;
8. the namespace table growing without bound;

and, in ``adversarial_tensor_cases.py``, tensors whose attributes lie or whose memory goes away
(t), and the host tier's callbacks (h: ``backup``, ``evict_host``'s free callback); in
``adversarial_hybrid_cases.py``, the hybrid cores (a: the auxiliary component's calls under
re-entry, finalizers, inputs written mid-call, cycles and deep trees).

Where user code changes what the call reads (but does not call the cache), the result must
equal the pure core's: each such case runs the same scenario on the core under test and on the
pure core in one process and compares. Where user code calls back into the cache, the rule
(docs/design.md, "Re-entrancy and threads") is: the nested call raises ``RuntimeError`` naming the
problem, and the cache stays consistent (``check_invariants``) and usable.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

#: The modules that hold the cases (``tests/robustness/``).
CASE_MODULES = ("adversarial_cases", "adversarial_tensor_cases", "adversarial_hybrid_cases")


def registered_cases() -> dict[str, str]:
    """case name -> its module: the functions decorated with ``@case``, read from the source
    (so collecting the tests imports neither torch nor the cases)."""
    found = {}
    for module in CASE_MODULES:
        tree = ast.parse((HERE / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "case" for d in node.decorator_list):
                assert node.name not in found, f"case {node.name} defined twice"
                found[node.name] = module
    return found


CASES = registered_cases()


def run_case(core_name: str, module: str, name: str, timeout: float = 300) -> str:
    """Run ``module.name(core_name)`` alone in a fresh interpreter; fail on a crash, an
    exception or a hang."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), str(HERE)]),
               PYTHONFAULTHANDLER="1")
    command = [sys.executable, "-X", "dev", "-X", "faulthandler", "-c",
               "import adversarial_support; adversarial_support.main()", module, name, core_name]
    try:
        proc = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {timeout} s: {str(exc.stderr)[-3000:]}")
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\n--- stderr ---\n{proc.stderr[-6000:]}")
    assert "CASE-OK" in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


def test_cases_are_found():
    # Both modules hold cases, and every group of the list above has at least one.
    assert set(CASES.values()) == set(CASE_MODULES)
    groups = {name.split("_")[0] for name in CASES}
    assert {f"r{i}" for i in range(1, 9)} <= groups and {"t1", "h1", "a1"} <= groups, groups


@pytest.mark.parametrize("name", sorted(CASES))
def test_adversarial(core_name, name):
    run_case(core_name, CASES[name], name)


def test_a_crash_fails_the_case(core_name):
    # The harness itself must be able to fail: a segfault in the child is a failed case.
    with pytest.raises(AssertionError, match="exit code"):
        run_case(core_name, "adversarial_support", "crash")

"""What every adversarial case shares, and the entry point that runs one case in a subprocess.

``tests/robustness/test_adversarial.py`` runs each case as::

    python -X dev -X faulthandler -c "import adversarial_support; adversarial_support.main()" \\
        MODULE CASE CORE

with ``tests/`` and ``tests/robustness/`` on ``PYTHONPATH``: ``main`` installs the hook that
collects unraisable exceptions (finalizers' errors), calls ``MODULE.CASE(CORE)`` and prints
``CASE-OK``. A case is a plain function of the core under test, registered with ``@case``.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from typing import Callable

import numpy as np

from conftest import check_invariants, core_of, node_tokens

#: What a nested call into a busy cache says.
REENTERED = "re-entered from inside one of its own calls"

#: Exceptions reported as unraisable (from finalizers) while the case ran.
UNRAISABLE: list = []

#: Every registered case, by name (the test module reads the names without importing torch).
CASES: dict[str, Callable[[str], None]] = {}


def case(fn: Callable[[str], None]) -> Callable[[str], None]:
    """Register ``fn(core_name)`` as an adversarial case."""
    CASES[fn.__name__] = fn
    return fn


def contents(cache):
    """Everything a cache holds, comparable across cores."""
    out = []
    for node, _depth in core_of(cache).tree.iter_nodes():
        if node.parent is None:
            continue
        value = node.value
        out.append((repr(node.extra_key), tuple(node_tokens(node)), node.terminal,
                    tuple(value.tolist()) if value.device.type == "cpu" else value.shape[0]))
    return sorted(out)


def outcome(call):
    """What a call did: ("ok", result) or (exception type, whether it names re-entry)."""
    try:
        return ("ok", call())
    except Exception as exc:
        return (type(exc).__name__, REENTERED in str(exc))


def same_as_pure(run, core_name):
    """run(core) -> comparable result; must be the same on the core under test and pure."""
    got, want = run(core_name), run("python")
    assert got == want, (got, want)


def only_reentry_errors():
    """Exceptions reported as unraisable (from finalizers) must be the re-entry error."""
    for exc in UNRAISABLE:
        assert isinstance(exc, RuntimeError) and REENTERED in str(exc), repr(exc)
    UNRAISABLE.clear()


def consistent(cache):
    """The cache is consistent and still works after whatever happened."""
    check_invariants(cache)
    probe = [987_654, 987_655]
    cache.insert(probe)
    assert cache.exists(probe) and cache.match_prefix(probe).length == 2
    check_invariants(cache)


def build_chain(cache, depth, extra_key=None):
    """A chain of depth one-token nodes (each shorter match splits the top node)."""
    tokens = np.arange(depth, dtype=np.int64)
    deepest = cache.insert(tokens, extra_key=extra_key).last_node
    for end in range(depth - 1, 0, -1):
        cache.match_prefix(tokens[:end], extra_key=extra_key)
    assert cache.node_count() == depth
    return deepest


def crash(core_name):
    """Not a case: a segfault, to show that the harness fails a case that crashes."""
    ctypes.string_at(0)


def main(argv: list[str] | None = None) -> None:
    """Run ``MODULE.CASE(CORE)`` from the command line and print ``CASE-OK`` if it returns."""
    module_name, name, core_name = sys.argv[1:] if argv is None else argv
    sys.unraisablehook = lambda info: UNRAISABLE.append(info.exc_value)
    getattr(importlib.import_module(module_name), name)(core_name)
    print("CASE-OK")

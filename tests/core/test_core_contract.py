"""Both tree cores and both block modules provide the contract ``radixcache._contract`` states.

Every member of each Protocol must exist on the objects of every available core (its module,
``Core``, tree, heap, node and guard) and block module (its ``BlockIndex``), and every method
must accept each call the Protocol allows: the same parameters in the same order, by the same
names, with the same defaults (more parameters only with a default). Signatures come from
``inspect.signature``, which the compiled modules answer too (Cython's ``binding=True``;
``Core`` and ``BlockIndex`` carry theirs in their docstrings). The stubs of the compiled
modules (``_core_c.pyi``, ``_blocks_c.pyi``) must declare the same members, the spec (the
pure modules' docstrings) must name every method, and no core may import the chooser.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from radixcache import _blocks_py, _contract, _core_py, _hybrid_py
from radixcache._core import BLOCKS, CORES, HYBRIDS

PACKAGE = Path(_contract.__file__).resolve().parent
_POSITIONAL = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def protocol_members(protocol) -> dict:
    """name -> the Protocol's function, property, or None (an annotated attribute)."""
    members = {name: None for name in vars(protocol).get("__annotations__", {})}
    for name, value in vars(protocol).items():
        if name.startswith("_") and name not in ("__len__", "__call__"):
            continue
        if inspect.isfunction(value) or isinstance(value, property):
            members[name] = value
    return members


def call_problems(expected: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Why a callable of signature ``actual`` would refuse a call ``expected`` allows."""
    want = [p for p in expected.parameters.values() if p.name != "self"]
    got = [p for p in actual.parameters.values() if p.name != "self"]
    problems = []
    for i, param in enumerate(want):
        if i >= len(got):
            problems.append(f"no parameter {param.name!r}")
            continue
        have = got[i]
        if have.name != param.name:
            problems.append(f"parameter {i} is {have.name!r}, not {param.name!r}")
        elif (have.kind is not param.kind
              and have.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD):
            problems.append(f"{param.name!r} is {have.kind.description}, not "
                            f"{param.kind.description}")
        elif param.default is not param.empty and (have.default is have.empty
                                                   or have.default != param.default):
            problems.append(f"{param.name!r} defaults to {have.default!r}, not "
                            f"{param.default!r}")
    for have in got[len(want):]:
        if have.default is have.empty and have.kind not in _VARIADIC:
            problems.append(f"extra parameter {have.name!r} without a default")
    return problems


def contract_problems(protocol, obj, where: str) -> list[str]:
    """What ``obj`` lacks of ``protocol``: members, and methods that refuse allowed calls."""
    problems = []
    for name, declared in protocol_members(protocol).items():
        if not hasattr(obj, name):
            problems.append(f"{where}.{name} is missing")
            continue
        if not inspect.isfunction(declared):
            continue  # an attribute or property: present is all a Protocol says
        member = getattr(obj, name)
        if not callable(member):
            problems.append(f"{where}.{name} is not callable")
            continue
        # The class's function (an instance's own, e.g. a lock's bound method, otherwise).
        target = obj if name == "__call__" else inspect.getattr_static(obj, name, member)
        if isinstance(target, (staticmethod, classmethod)) or not callable(target):
            target = member
        try:
            actual = inspect.signature(target)
        except ValueError:  # a builtin without a signature (the pure guard's lock methods)
            continue
        problems += [f"{where}.{name}: {p}" for p in call_problems(
            inspect.signature(declared), actual)]
    return problems


def core_objects(module) -> dict:
    """One object of each kind the contract speaks of, from a core with a host tier."""
    core = module.Core(2, "lru", True, 1)
    core.insert([1, 2, 3, 4], None)
    node = core.match([1, 2, 3, 4]).last_node
    return {"Core": core, "Tree": core.tree, "EvictionHeap": core.heap, "Node": node,
            "Guard": core.guard}


@pytest.mark.parametrize("protocol", ["Core", "Tree", "EvictionHeap", "Node", "Guard"])
def test_every_core_object_has_the_contract(core_name, protocol):
    obj = core_objects(CORES[core_name])[protocol]
    problems = contract_problems(getattr(_contract, protocol), obj, f"{core_name}:{protocol}")
    if protocol == "EvictionHeap":
        host_heap = core_objects(CORES[core_name])["Core"].host_heap
        problems += contract_problems(_contract.EvictionHeap, host_heap, "host_heap")
    assert not problems, "\n".join(problems)


def test_every_core_module_has_the_contract(core_name):
    module = CORES[core_name]
    problems = contract_problems(_contract.CoreModule, module, core_name)
    problems += contract_problems(_contract.CoreClass, module.Core, f"{core_name}.Core")
    assert not problems, "\n".join(problems)
    assert module.CORE_NAME == core_name
    for name in ("Core", "Tree", "EvictionHeap", "Node", "Guard"):
        assert isinstance(getattr(module, name), type), name
    # The constructor takes its documented keywords.
    core = module.Core(page_size=2, policy="fifo", host_tier=True, write_through_hits=2,
                       numpy_arrays=True)
    assert (core.page_size, core.host_tier, core.write_through_hits, core.numpy_arrays) == (
        2, True, 2, True)


def hybrid_objects(module) -> dict:
    """One object of each kind the hybrid contract speaks of, from a window core."""
    core = module.HybridCore(1, "lru", window=2)
    core.insert([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    node = core.match([1, 2, 3, 4]).last_node
    return {"HybridCore": core, "AuxNode": node, "Tree": core.tree,
            "EvictionHeap": core.heap, "Guard": core.guard}


@pytest.mark.parametrize("protocol", ["HybridCore", "AuxNode", "Tree", "EvictionHeap",
                                      "Guard"])
def test_every_hybrid_object_has_the_contract(core_name, protocol):
    obj = hybrid_objects(HYBRIDS[core_name])[protocol]
    problems = contract_problems(getattr(_contract, protocol), obj, f"{core_name}:{protocol}")
    assert not problems, "\n".join(problems)


def test_every_hybrid_module_has_the_contract(core_name):
    module = HYBRIDS[core_name]
    problems = contract_problems(_contract.HybridModule, module, core_name)
    problems += contract_problems(_contract.HybridCoreClass, module.HybridCore,
                                  f"{core_name}.HybridCore")
    assert not problems, "\n".join(problems)
    assert module.CORE_NAME == core_name
    core = module.HybridCore(page_size=2, policy="fifo", numpy_arrays=True, window=0,
                             state=True)
    assert (core.page_size, core.numpy_arrays, core.window, core.state) == (2, True, 0, True)
    assert core.core_name == core_name


def test_both_hybrid_cores_have_the_same_calls():
    """The pure hybrid core is a tree core underneath, the compiled one wraps one: neither
    answers a call of the tree core's that the other lacks (the host tier's, ranks, session
    tags)."""
    if "c" not in HYBRIDS:
        pytest.skip("the compiled hybrid core is not built")

    def calls(module) -> set:
        core = module.HybridCore(1, "lru", window=2)
        return {name for name in dir(core) if not name.startswith("_")
                and callable(getattr(core, name, None))}

    assert calls(HYBRIDS["python"]) == calls(HYBRIDS["c"])
    core = HYBRIDS["python"].HybridCore(1, "lru", state=True)
    with pytest.raises(AttributeError, match="has no attribute 'tag_session'"):
        core.tag_session(core.tree.root, 1)
    assert not hasattr(core, "evict_host") and hasattr(core, "evict")


def test_the_hybrids_follow_the_cores():
    """The chooser picks the hybrid modules by the cores' rule: compiled where built."""
    assert set(HYBRIDS) == set(CORES)


def test_every_block_module_has_the_contract(blocks):
    problems = contract_problems(_contract.BlocksModule, blocks, blocks.__name__)
    problems += contract_problems(_contract.BlockIndexClass, blocks.BlockIndex,
                                  f"{blocks.__name__}.BlockIndex")
    index = blocks.BlockIndex()
    index.hold(1, 0)
    problems += contract_problems(_contract.BlockIndex, index, f"{blocks.__name__}:BlockIndex")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_refused_call():
    """The comparison itself: a renamed, reordered, missing or newly required parameter, or
    another default, is reported; extra parameters with defaults are not."""
    def expected(self, tokens, extra_key=None, held=False): ...
    cases = {
        "def f(self, tokens, extra_key=None, held=False, more=1): ...": [],
        "def f(self, tokens, extra_key=None): ...": ["no parameter 'held'"],
        "def f(self, tokens, key=None, held=False): ...": ["parameter 1 is 'key'"],
        "def f(self, tokens, extra_key=None, held=True): ...": ["'held' defaults to True"],
        "def f(self, tokens, extra_key, held=False): ...": ["'extra_key' defaults to"],
        "def f(self, tokens, extra_key=None, held=False, *, more): ...": ["extra parameter"],
        "def f(self, tokens, /, extra_key=None, held=False): ...": ["'tokens' is positional"],
    }
    for source, wanted in cases.items():
        scope: dict = {}
        exec(source, scope)
        problems = call_problems(inspect.signature(expected), inspect.signature(scope["f"]))
        assert len(problems) == len(wanted), (source, problems)
        for problem, start in zip(problems, wanted):
            assert problem.startswith(start), (source, problem)


# -- the stubs -------------------------------------------------------------------------------
def stub_members(path: Path) -> dict:
    """A stub's classes and module functions: {class name or "": {member: ast node}}."""
    tree = ast.parse(path.read_text())
    out: dict = {"": {}}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[""][node.name] = node
            members = out.setdefault(node.name, {})
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members[item.name] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = item
        elif isinstance(node, ast.FunctionDef):
            out[""][node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[""][node.target.id] = node
    return out


def stub_parameters(func: ast.FunctionDef) -> list:
    """(name, has a default) of a stub function's parameters, self excluded."""
    args = func.args.posonlyargs + func.args.args
    defaults = [False] * (len(args) - len(func.args.defaults)) + [True] * len(func.args.defaults)
    return [(a.arg, d) for a, d in zip(args, defaults) if a.arg != "self"]


def protocol_parameters(func) -> list:
    return [(p.name, p.default is not p.empty)
            for p in inspect.signature(func).parameters.values() if p.name != "self"]


def stub_problems(stub: dict, protocol, where: str, constructor=None) -> list[str]:
    problems = []
    for name, declared in protocol_members(protocol).items():
        if name not in stub:
            problems.append(f"{where} declares no {name}")
        elif inspect.isfunction(declared):
            got = stub_parameters(stub[name])
            want = protocol_parameters(declared)
            # As call_problems: the same names in order, a default wherever the Protocol has
            # one, and any further parameter with a default.
            if ([n for n, _ in got[:len(want)]] != [n for n, _ in want]
                    or any(d and not g for (_, d), (_, g) in zip(want, got))
                    or any(not g for _, g in got[len(want):])):
                problems.append(f"{where}.{name}{got} does not take {want}")
    if constructor is not None:
        got = stub_parameters(stub["__init__"]) if "__init__" in stub else []
        want = protocol_parameters(constructor)
        if got != want:
            problems.append(f"{where}.__init__{got} is not {want}")
    return problems


def test_the_compiled_core_stub_declares_the_contract():
    stub = stub_members(PACKAGE / "_core_c.pyi")
    problems = []
    for name in ("Core", "Tree", "EvictionHeap", "Node", "Guard"):
        problems += stub_problems(stub.get(name, {}), getattr(_contract, name), name,
                                  _contract.CoreClass.__call__ if name == "Core" else None)
    problems += stub_problems(stub[""], _contract.CoreModule, "_core_c")
    assert not problems, "\n".join(problems)


def test_the_compiled_hybrid_stub_declares_the_contract():
    stub = stub_members(PACKAGE / "_hybrid_c.pyi")
    problems = []
    for name in ("HybridCore", "AuxNode"):
        problems += stub_problems(stub.get(name, {}), getattr(_contract, name), name,
                                  _contract.HybridCoreClass.__call__ if name == "HybridCore"
                                  else None)
    problems += stub_problems(stub[""], _contract.HybridModule, "_hybrid_c")
    assert not problems, "\n".join(problems)


def test_the_compiled_block_stub_declares_the_contract():
    stub = stub_members(PACKAGE / "_blocks_c.pyi")
    problems = stub_problems(stub.get("BlockIndex", {}), _contract.BlockIndex, "BlockIndex",
                             _contract.BlockIndexClass.__call__)
    problems += stub_problems(stub[""], _contract.BlocksModule, "_blocks_c")
    assert not problems, "\n".join(problems)


# -- the spec and the layering ---------------------------------------------------------------
@pytest.mark.parametrize("protocol, module", [(_contract.Core, _core_py),
                                              (_contract.HybridCore, _hybrid_py),
                                              (_contract.BlockIndex, _blocks_py)])
def test_the_spec_names_every_method(protocol, module):
    doc = module.__doc__
    missing = [name for name, declared in protocol_members(protocol).items()
               if inspect.isfunction(declared) and not name.startswith("__")
               and f"``{name}(" not in doc]
    assert not missing, f"{module.__name__}'s docstring does not specify {missing}"


@pytest.mark.parametrize("module", ["_core_py", "_core_c", "_hybrid_py", "_hybrid_c",
                                    "_blocks_py", "_blocks_c", "_types", "_state", "_handover",
                                    "_errors", "_torch"])
def test_no_core_imports_the_chooser_or_the_cache(module):
    if module.endswith("_c") and "c" not in CORES:
        pytest.skip("the compiled modules are not built")
    script = (f"import sys, radixcache.{module}\n"
              "print(sorted(m for m in ('radixcache._core', 'radixcache.cache') "
              "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_blocks_follow_the_cores():
    """The chooser picks the block modules by the cores' rule: compiled where built."""
    assert set(BLOCKS) == set(CORES)
    from radixcache import _core

    assert _core.blocks is BLOCKS[_core.core.CORE_NAME]
    for name in CORES:
        assert _core.get_blocks(name) is BLOCKS[name]
    with pytest.raises(ValueError, match="unknown core 'rust'"):
        _core.get_blocks("rust")

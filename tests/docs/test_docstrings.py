"""Every public name has a Google-style docstring that names what it takes, returns and raises.

Public means what a user reaches: ``radixcache.__all__`` and the ``__all__`` of the library
modules below, the public methods and properties of those classes, and ``__contains__``/
``__len__``. For each callable the docstring must name every parameter of its signature in an
``Args:`` section (a class documents its constructor's), have a ``Returns:`` (or ``Yields:``)
section when it is annotated to return something, and name in ``Raises:`` every exception
class that its own body raises. A dataclass names each of its fields under ``Attributes:``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap

import pytest

#: Docstrings only: no tree core runs, so the pure-core CI run leaves these out.
pytestmark = pytest.mark.core_independent

MODULES = (
    "radixcache",
    "radixcache.router",
    "radixcache.events",
    "radixcache.workloads",
    "radixcache.traces",
    "radixcache.fleet",
)
PUBLIC_DUNDERS = ("__contains__", "__len__")
SECTION = re.compile(r"^(\w[\w ]*):\s*$")


def _sections(doc: str) -> dict[str, str]:
    """The docstring's Google-style sections (``Args``, ``Returns``, ...) by title."""
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in textwrap.dedent(doc).splitlines():
        match = SECTION.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            sections.setdefault(current, [])
        else:
            sections[current].append(line)
    return {title: "\n".join(lines) for title, lines in sections.items()}


def _own_doc(obj) -> str | None:
    """The object's own docstring (not a base class's, nor a dataclass's generated one)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        return None  # dataclasses.dataclass made it from the signature
    return inspect.cleandoc(doc)


def _params(func) -> list[str]:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def _returns_something(func) -> bool:
    try:
        annotation = inspect.signature(func).return_annotation
    except (TypeError, ValueError):
        return False
    return annotation not in (inspect.Signature.empty, None, "None")


def _raised(func) -> set[str]:
    """Exception class names the function's own body raises (nested functions excluded)."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return set()
    tree = ast.parse(source)
    top = tree.body[0]
    names = set()
    stack = list(top.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id[:1].isupper():
                names.add(exc.id)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _names_param(args: str, name: str) -> bool:
    return re.search(rf"^\s*\**{re.escape(name)}\s*(\([^)]*\))?\s*:", args, re.M) is not None


def check_callable(label: str, func, doc: str | None, params: list[str] | None = None) -> list:
    """What is missing from ``func``'s docstring ``doc``, as messages."""
    if doc is None:
        return [f"{label}: no docstring"]
    problems = []
    sections = _sections(doc)
    params = _params(func) if params is None else params
    missing = [p for p in params if not _names_param(sections.get("Args", ""), p)]
    if missing:
        problems.append(f"{label}: Args does not name {', '.join(missing)}")
    if _returns_something(func) and not ({"Returns", "Yields"} & set(sections)):
        problems.append(f"{label}: no Returns section")
    raises = sections.get("Raises", "")
    unnamed = sorted(e for e in _raised(func) if not re.search(rf"\b{e}\b", raises))
    if unnamed:
        problems.append(f"{label}: Raises does not name {', '.join(unnamed)}")
    return problems


def check_class(label: str, cls) -> list:
    doc = _own_doc(cls)
    if doc is None:
        return [f"{label}: no docstring"]
    problems = []
    if dataclasses.is_dataclass(cls):
        attributes = _sections(doc).get("Attributes", "")
        missing = [f.name for f in dataclasses.fields(cls) if not _names_param(attributes, f.name)]
        if missing:
            problems.append(f"{label}: Attributes does not name {', '.join(missing)}")
    elif "__init__" in cls.__dict__:
        init = cls.__dict__["__init__"]
        # The constructor is documented in the class docstring (or its own).
        init_doc = doc + "\n" + (inspect.cleandoc(init.__doc__) if init.__doc__ else "")
        problems += [p.replace(f"{label}.__init__", label)
                     for p in check_callable(f"{label}.__init__", init, init_doc)]
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in PUBLIC_DUNDERS:
            continue
        where = f"{label}.{name}"
        if isinstance(member, property):
            if _own_doc(member.fget) is None:
                problems.append(f"{where}: no docstring")
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member):
            if member.__name__ != name:
                continue  # an alias (Smile's spellings): documented under its own name
            problems += check_callable(where, member, _own_doc(member))
    return problems


def public_objects():
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj


def problems_of(label: str, obj) -> list:
    if inspect.isclass(obj):
        return check_class(label, obj)
    return check_callable(label, obj, _own_doc(obj))


@pytest.mark.parametrize("label, obj", list(public_objects()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_public_name_is_documented(label, obj):
    problems = problems_of(label, obj)
    assert not problems, "\n".join(problems)


def test_checker_catches_what_is_missing():
    """The checks above can fail: an undocumented parameter, return or raise is caught."""

    def undocumented(a, b: int) -> int:
        """Adds.

        Args:
            a: the first.
        """
        if a:
            raise ValueError("no")
        return a + b

    problems = check_callable("f", undocumented, _own_doc(undocumented))
    assert any("does not name b" in p for p in problems)
    assert any("no Returns section" in p for p in problems)
    assert any("Raises does not name ValueError" in p for p in problems)

    @dataclasses.dataclass
    class Bare:
        x: int

    assert check_class("Bare", Bare) == ["Bare: no docstring"]


def test_help_of_radixcache_reads_as_a_manual():
    from radixcache import RadixCache

    doc = inspect.getdoc(RadixCache)
    for word in ("page_size", "eviction_policy", "enable_events", "event_options", "core",
                 "lru", "lfu", "fifo", "mru", "filo", "slru", "priority", "smile"):
        assert word in doc.lower(), word

"""Each module imports only what its layer may import, as the layer table of docs/design.md says.

Every module of the package (``.py``, and the compiled modules' ``.pyx``/``.pxd``) is read, not
imported: its imports -- at the top and inside functions -- are resolved to radixcache modules
and checked against the layers below, which are parsed from the table in docs/design.md. Only
the SGLang integration imports SGLang, and nothing in the package imports the integrations.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "radixcache"
DESIGN = ROOT / "docs" / "design.md"

#: Layers whose modules may import each other freely (the rest: only within their package).
OPEN_LAYERS = {"foundation", "tree cores and block modules", "front ends"}

pytestmark = pytest.mark.core_independent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(name: str, path: Path) -> list[str]:
    """The package a relative import in ``path`` starts from."""
    parts = name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


#: Module -> its source files (a compiled module has a .pyx and a .pxd).
SOURCES: dict[str, list[Path]] = {}
for _suffix in ("py", "pyx", "pxd"):
    for _path in sorted(PACKAGE.rglob(f"*.{_suffix}")):
        SOURCES.setdefault(module_name(_path), []).append(_path)
MODULES = set(SOURCES)


def resolve(name: str, path: Path, level: int, module: str | None, names: list[str]) -> list:
    """The radixcache modules (or other top-level packages) an import statement reaches."""
    if level:
        base = package_of(name, path)[: len(package_of(name, path)) - level + 1]
        target = ".".join(base + ([module] if module else []))
    else:
        target = module or ""
    found = []
    for item in names or [""]:
        candidate = f"{target}.{item}" if item else target
        found.append(candidate if candidate in MODULES else target)
    return found


_CYTHON_IMPORT = re.compile(
    r"^\s*(?:from\s+(\.*)([\w.]*)\s+c?import\s+\(?([\w, ]+)|c?import\s+([\w.]+))", re.M)


def imports_of(name: str) -> set[str]:
    """Every module ``name`` imports, anywhere in its sources."""
    found: set[str] = set()
    for path in SOURCES[name]:
        found |= _imports_in(name, path)
    found.discard(name)
    return found


def _imports_in(name: str, path: Path) -> set[str]:
    text = path.read_text()
    found: set[str] = set()
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.update(resolve(name, path, node.level, node.module,
                                     [alias.name for alias in node.names]))
    else:  # Cython: the import lines are Python's, plus cimport
        for dots, module, names, plain in _CYTHON_IMPORT.findall(text):
            if plain:
                found.add(plain)
            else:
                found.update(resolve(name, path, len(dots), module or None,
                                     [n.strip() for n in names.split(",") if n.strip()]))
    return found


#: Words of the "may import" column that name a layer by its number.
LAYER_WORDS = {"foundation": 1, "cores": 2, "chooser": 3}


def design_layers() -> tuple[dict[str, tuple[int, str]], dict[int, str]]:
    """(module -> (layer number, layer name), layer number -> its "may import" cell), from the
    table of docs/design.md."""
    section = DESIGN.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers, may_import = {}, {}
    for row in re.findall(r"^\| (\d+)\. ([^|]+) \| ([^|]+) \|[^|]+\|[^|]+\| ([^|]+) \|$",
                          section, re.M):
        number, layer, cell = int(row[0]), row[1].strip(), row[2]
        for entry in re.findall(r"`([^`]+)`", cell):
            layers[entry] = (number, layer)
        if "the package `__init__`" in cell:
            layers["__init__"] = (number, layer)
        may_import[number] = row[3].split(";")[0]
    return layers, may_import


LAYERS, MAY_IMPORT = design_layers()


def allowed(number: int, group: str, their_number: int, their_group: str) -> bool:
    """Whether the "may import" cell of layer ``number`` allows an import of that module."""
    cell = MAY_IMPORT[number]
    if their_number == number:  # (or a module of its own layer the cell names)
        return (their_group == group or LAYERS_BY_NUMBER[number] in OPEN_LAYERS
                or f"`{their_group}`" in cell)
    if "every layer above" in cell:
        return their_number < number
    if any(LAYER_WORDS[word] == their_number for word in LAYER_WORDS if word in cell):
        return True
    return f"`{their_group}`" in cell


def layer_of(name: str) -> tuple[int, str, str]:
    """(layer number, layer name, group): the group is the subpackage or module."""
    parts = name.split(".")[1:]  # without "radixcache"
    if not parts:
        return (*LAYERS["__init__"], "__init__")
    top = parts[0]
    for key in (f"{top}/*", top, f"{top}.py"):
        if key in LAYERS:
            return (*LAYERS[key], top)
    raise AssertionError(f"{name} is in no layer of docs/design.md's table: add it there")


LAYERS_BY_NUMBER = {number: layer for number, layer in LAYERS.values()}


def test_the_table_has_every_layer():
    assert sorted(LAYERS_BY_NUMBER) == sorted(MAY_IMPORT) == list(range(1, 9)), LAYERS


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_the_layers(name):
    number, layer, group = layer_of(name)
    wrong = []
    for target in sorted(imports_of(name)):
        if target.split(".")[0] != "radixcache":
            continue
        if target.startswith("radixcache.integrations") and group != "integrations":
            wrong.append(f"{target} (nothing imports the integrations)")
            continue
        their_number, their_layer, their_group = layer_of(target)
        if not allowed(number, group, their_number, their_group):
            wrong.append(f"{target} (layer {their_number}, {their_layer})")
    assert not wrong, f"{name} (layer {number}, {layer}) imports what its layer may not: {wrong}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_integrations_import_sglang(name):
    if name.startswith("radixcache.integrations"):
        return
    assert not {t for t in imports_of(name) if t.split(".")[0] == "sglang"}, name


def test_the_checker_sees_upward_imports():
    # The resolution the checks rely on: relative imports, in-function imports and Cython's.
    assert "radixcache._core" in imports_of("radixcache.events.hashing")
    assert "radixcache.cache" in imports_of("radixcache.integrations.sglang.backend")
    assert "radixcache._errors" in imports_of("radixcache._core_c")
    assert "radixcache._core_c" in imports_of("radixcache._core")  # inside a function
    assert layer_of("radixcache.cache")[0] > layer_of("radixcache._core")[0]
    # The router may read events but not drive a cache; the fleet may do both.
    router, cache = layer_of("radixcache.router.indexer"), layer_of("radixcache.cache")
    assert not allowed(router[0], router[2], cache[0], cache[2])
    events = layer_of("radixcache.events.types")
    assert allowed(router[0], router[2], events[0], events[2])
    fleet = layer_of("radixcache.fleet")
    assert allowed(fleet[0], fleet[2], cache[0], cache[2])


def test_no_module_imports_back_what_imports_it():
    # Within a layer (a package's own modules) the table allows any import: the order of
    # imports must still run one way, so no two modules need each other to load (or to be
    # read: a circle is two jobs in one place).
    graph = {name: {t for t in imports_of(name) if t in MODULES} for name in MODULES}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        raise AssertionError(f"modules that import each other: {error.args[1]}") from None


#: The most lines a Python module of the package has (the compiled modules are one module
#: each on purpose: docs/design.md, "The compiled core").
MAX_MODULE_LINES = 1200


def test_python_modules_stay_small():
    long = {str(path.relative_to(ROOT)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these by job (at most {MAX_MODULE_LINES} lines a module): {long}"

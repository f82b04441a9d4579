"""Imports between tpudist's modules run one way, down the layers docs/design.md names ("Layers").

Files are rooms and imports are arrows. Three rules, all read from the source with ``ast`` (nothing is
imported, so the check takes well under a second):

- **No circle**: no module imports, directly or through others, a module that imports it back.
  Imports inside functions count: a lazy import that only hides a circle is still a circle. So do
  imports under ``if TYPE_CHECKING:``: they never run, but a reader follows them as any other.
  Importing ``a.b.c`` runs the package ``a.b``'s ``__init__`` first; that implicit step is not an
  arrow (the package face re-exports its modules, so every module would be in a circle with it);
  ``from a.b import name`` of a name that is no module is an arrow to ``a.b``'s ``__init__``.
- **Down the layers**: a module imports its own layer and the layers below it, never one above. The
  layers are the rows of docs/design.md's "Layers" table, bottom first: a new package or top-level
  module gets its row there.
- **Private stays home**: a module or name whose own name starts with ``_`` inside a package of
  tpudist (``tpudist.device._storage``, ``tpudist.process_group.runtime._platform``) is that
  package's own: no module of another package imports it or reaches it as an attribute of a module
  it imported. The lower package offers a public name instead (``tpudist.device.interop``). The
  shared pieces at the package root (``tpudist._switches``) belong to ``tpudist``, which holds every module.

Run ``python tests/docs/test_import_graph.py`` to print every circle, upward and private import.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tpudist"

def _layers_of_design() -> tuple[tuple[str, ...], ...]:
    """The rows of docs/design.md's "Layers" table, bottom first: the packages and modules of tpudist
    each row's first cell names in backticks (``recipes/`` is no module of tpudist)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| layer ")]
    return tuple(tuple(re.findall(r"`(tpudist[\w.]*)`", row)) for row in rows)


# docs/design.md is the one statement of the layers: the check reads them there.
LAYERS: tuple[tuple[str, ...], ...] = _layers_of_design()

def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of tpudist an import statement of ``module`` names (its targets' longest known prefix)."""
    sources = _sources()

    def known(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := known(alias.name)) and alias.name.split(".")[0] == "tpudist"]
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "tpudist":
        return []
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else known(base) for alias in node.names]


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@functools.cache
def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: line of its first import}, over every module of tpudist."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in _sources().items():
        arrows = graph.setdefault(module, {})
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(module, path.name == "__init__.py", node):
                    if target and target != module:
                        arrows[target] = min(arrows.get(target, node.lineno), node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def layer_of(module: str) -> int:
    """The row of ``module``: the one naming it or its closest package (``tpudist`` names the face
    alone), or -1."""
    best, best_length = -1, -1
    for number, members in enumerate(LAYERS):
        for member in members:
            inside = "." in member and module.startswith(member + ".")
            if (module == member or inside) and len(member) > best_length:
                best, best_length = number, len(member)
    return best


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    def name(layer: int) -> str:
        return f"layer {layer} ({', '.join(LAYERS[layer])})"

    return [f"  {module}:{line} imports {target}: {name(layer_of(target))} is above {name(layer_of(module))}"
            for module in sorted(graph) for target, line in sorted(graph[module].items())
            if layer_of(target) > layer_of(module)]


def package_of(module: str) -> str:
    """The package of tpudist a module belongs to: ``tpudist.<name>`` for a module inside a subpackage,
    else ``tpudist`` (the face and the shared pieces at the root)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and f"{parts[0]}.{parts[1]}" in _packages() else parts[0]


@functools.cache
def _packages() -> frozenset[str]:
    return frozenset(_module_name(path.parent) for path in PACKAGE.glob("*/__init__.py"))


def _private_to_another(importer: str, target: str) -> bool:
    """Whether dotted ``target`` names a private module or name of a package that is not ``importer``'s."""
    private = any(part.startswith("_") and not part.startswith("__") for part in target.split(".")[2:])
    return private and package_of(target) != package_of(importer)


def private_imports() -> list[str]:
    """Every import of another package's private module or name, and every attribute reach
    ``module._name`` into one through an imported module (as ``importer:line imports target``)."""
    sources = _sources()
    found = []
    for module, path in sources.items():
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> the dotted tpudist name it is bound to
        reaches: list[tuple[int, str]] = []
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "tpudist":
                        reaches.append((node.lineno, alias.name))
                        bound[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "tpudist"
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] == "tpudist":
                    for alias in node.names:
                        reaches.append((node.lineno, f"{base}.{alias.name}"))
                        bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                reaches.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
        found.extend(f"  {module}:{line} imports {target}" for line, target in sorted(set(reaches))
                     if _private_to_another(module, target))
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    return "\n".join(f"  {module}:{line} -> {target}" for module in component
                     for target, line in sorted(graph[module].items()) if target in members)


def test_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    assert not found, (
        "modules of tpudist import each other (module:line -> imported); imports must run one way: move what "
        "both need into a module below them both, or the import down to the module that needs it:\n"
        + "\n".join(_describe(c, graph) for c in found))


def test_imports_run_down_the_layers():
    graph = import_graph()
    unplaced = [module for module in graph if layer_of(module) < 0]
    assert not unplaced, f"modules={unplaced} belong to no layer: name them in a row of docs/design.md's Layers table"
    upward = upward_imports(graph)
    assert not upward, "a layer imports one above it (docs/design.md, \"Layers\"):\n" + "\n".join(upward)


def test_no_package_imports_another_packages_private_parts():
    found = private_imports()
    assert not found, (
        "a package imports another's private module or name (a leading underscore: that package's own); "
        "give the lower package a public name for it and import that:\n" + "\n".join(found))


def test_the_private_rule_on_examples():
    assert _private_to_another("tpudist.process_group.device_arrays", "tpudist.device._storage._retype")
    assert _private_to_another("tpudist.training.trainer", "tpudist.process_group.runtime._platform")
    assert _private_to_another("tpudist", "tpudist.kernels._helion_hook.route")
    assert not _private_to_another("tpudist.device._core", "tpudist.device._storage._ATTR")  # its own package
    assert not _private_to_another("tpudist.device._core", "tpudist._switches")  # a shared piece at the root
    assert _private_to_another("tpudist.device._fused", "tpudist.runtime._cache_settings")  # runtime's own
    assert not _private_to_another("tpudist.runtime.jax_cache", "tpudist.runtime._cache_settings")
    assert not _private_to_another("tpudist.compile.device_io", "tpudist.device.interop.buffer_of")


def test_the_check_sees_lazy_relative_and_type_checking_imports(tmp_path, monkeypatch):
    """The rules on a small package: a function-level import closes a circle, a relative import is
    resolved, an import under ``if TYPE_CHECKING:`` is an arrow too."""
    package = tmp_path / "tpudist"
    (package / "mesh").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mesh" / "__init__.py").write_text("from .a import A\n")
    (package / "mesh" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from tpudist.mesh.c import C\nA = 1\n")
    (package / "mesh" / "b.py").write_text("from . import a\n")
    (package / "mesh" / "c.py").write_text("def f():\n    import tpudist.mesh.b.x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    caches = (_sources, _tree, import_graph)
    for cache in caches:
        cache.cache_clear()
    try:
        graph = import_graph()
        assert graph == {"tpudist": {}, "tpudist.mesh": {"tpudist.mesh.a": 1},
                         "tpudist.mesh.a": {"tpudist.mesh.c": 3}, "tpudist.mesh.b": {"tpudist.mesh.a": 1},
                         "tpudist.mesh.c": {"tpudist.mesh.b": 2}}
        assert circles(graph) == [["tpudist.mesh.a", "tpudist.mesh.b", "tpudist.mesh.c"]]
        (package / "mesh" / "a.py").write_text("A = 1\n")
        for cache in caches:
            cache.cache_clear()
        assert circles(import_graph()) == []
        (package / "mesh" / "a.py").write_text("def f():\n    from tpudist.mesh import c\n")
        for cache in caches:
            cache.cache_clear()
        assert circles(import_graph()) == [["tpudist.mesh.a", "tpudist.mesh.b", "tpudist.mesh.c"]]
    finally:
        for cache in caches:
            cache.cache_clear()


if __name__ == "__main__":
    for component in circles(import_graph()):
        print(f"circle of {len(component)} modules:\n{_describe(component, import_graph())}")
    print("\n".join(upward_imports(import_graph())))
    print("\n".join(private_imports()))


def _private_reaches(package: str) -> list[str]:
    """``path:line: code`` of each ``# noqa: SLF001`` (an attribute with a leading underscore read off
    another object) in ``tpudist/<package>``."""
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "noqa: SLF001" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_the_process_group_reaches_only_into_torch_and_jax():
    """Issue 55: the group's helpers take its public Channel; what is left private is torch's c10d
    registry and Python-backend base, and JAX's array shards: at most 5 such reaches, none into tpudist."""
    reaches = _private_reaches("process_group")
    own = [r for r in reaches if re.search(r"\b(self|group|channel|pg|tpudist)\._", r.split(": ", 1)[1])]
    assert not own, "the process group reaches into tpudist's own privates:\n" + "\n".join(own)
    assert len(reaches) <= 5, f"{len(reaches)} private reaches (at most 5):\n" + "\n".join(reaches)


def test_eager_modes_are_asked_what_they_do_not_compared_as_strings():
    """Issue 55: the device asks its eager mode what it does (``mode.records``, ``mode.checks``); no module
    of tpudist compares a mode with its name. ``torch.tpu.get_eager_mode() == "fused"`` still reads right
    for users: a mode is its own name."""
    pattern = re.compile(r"""(mode\(\)|\bmode)\s*(==|!=|\bin\b|\bnot in\b)\s*[("']*(debug|strict|fused)\b""")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "an eager mode compared as a string; ask it (records, checks):\n" + "\n".join(found)
    assert pattern.search('if rt.get_mode() == "fused":') and pattern.search('if mode != "debug" and x:')


def test_the_cpu_or_device_choice_is_made_in_one_place():
    """Issue 55: whether a c10d call runs on the host or goes to device_collectives (a tpu tensor
    among its arguments) is decided once, by group.py's router over ``DEVICE_PATHS``; the c10d
    methods hold the host path only."""
    pattern = re.compile(r"(?<!\w)(?:dc\.|device_collectives\.)?on_device\(")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((PACKAGE / "process_group").rglob("*.py")) if path.name != "device_collectives.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert len(found) == 1 and found[0].startswith("tpudist/process_group/group.py:"), (
        "the tpu-or-cpu check of a c10d call belongs in group.py's router only (name the method in "
        "DEVICE_PATHS):\n" + "\n".join(found))
    assert pattern.search("if dc.on_device(tensors):") and not pattern.search("_on_device(t)")

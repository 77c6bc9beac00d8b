"""The package's layers import downwards only: ``devices/`` (the vendor libraries) is the
bottom, ``sources/`` reads through it, and replay (``capture/``, ``replay.py``) wires fakes in
from above. Checked on the modules' imports as written, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[1] / "hyperagent"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[: len(package) - node.level + 1]
                base = ".".join([*prefix, base] if base else prefix)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _imports(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {module}")
    return sorted(set(found))


def test_the_device_layer_imports_nothing_above_it() -> None:
    assert (
        _violations(
            "devices",
            ("hyperagent.sources", "hyperagent.capture", "hyperagent.replay", "hyperagent.agent"),
        )
        == []
    )


def test_sources_import_no_replay_and_no_fake() -> None:
    assert _violations("sources", ("hyperagent.capture", "hyperagent.replay")) == []


def _nvml_device_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call an ``nvmlDevice*`` function (a fake defining them is not)."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("nvmlDevice"):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("nvmlDevice"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                lines.append(node.lineno)  # handed on as a callable: a call by proxy
    return sorted(set(lines))


def test_nvml_device_calls_live_only_in_the_device_layer() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (PACKAGE / "devices") not in path.parents
        and (PACKAGE / "capture" / "fake_nvml") not in path.parents  # the fake NVML: the API
        for line in _nvml_device_calls(path)
    ]
    assert found == []


def test_outside_the_device_layer_no_code_names_an_nvml_device_call() -> None:
    """What ``grep -n nvmlDevice hyperagent/`` shows: only the device layer and the fake NVML
    (which defines the API) mention those calls."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (PACKAGE / "devices") not in path.parents
        and (PACKAGE / "capture" / "fake_nvml") not in path.parents
        for number, text in enumerate(path.read_text().splitlines(), 1)
        if "nvmlDevice" in text
    ]
    assert found == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (function-level and type-checking imports
    included: a circle through them is a circle in the design). ``from pkg import name``
    imports ``pkg.name`` where that is a module, else ``pkg``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for _, module in _imports(path):
            if module in modules:
                edges.add(module)
            elif module.rpartition(".")[0] in modules:
                edges.add(module.rpartition(".")[0])
        edges.discard(name)
        graph[name] = edges
    for name, edges in graph.items():  # ``from pkg import name`` adds pkg too: keep the module
        graph[name] = {e for e in edges if not any(o.startswith(e + ".") for o in edges)}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert _circles(_module_graph()) == []


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 500, 80


def test_no_class_over_500_lines_and_no_function_over_80() -> None:
    """A class or function that outgrew its one responsibility is split along its seams."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                too_long.append(f"{where} {node.name}: {lines} lines")
    assert too_long == []

"""The package's import graph (read from the source with ast, nothing imported): no module imports
itself back through others, and the folders depend one way (web / cli -> engine -> model -> kernels
-> gpu, with formats and text below them), as docs/ARCHITECTURE.md draws them.

Imports inside functions count too: Python tolerates a cycle hidden in a function body, a reader
does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "app" / "bitnet_web"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (`from pkg import submodule` counts as the submodule)."""
    modules = _modules()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            targets |= {known(t) for t in found if t == "bitnet_web" or t.startswith("bitnet_web.")}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "(top)." + parts[-1]


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_folders_depend_one_way():
    folders: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        folders.setdefault(_folder(module), set()).update(_folder(t) for t in targets if _folder(t) != _folder(module))
    assert cycles(folders) == []


def test_the_graph_sees_a_cycle():
    """The checks above can fail: a two-module loop and a three-module loop are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "bitnet_web.gpu.base" in graph["bitnet_web.gpu"] and "bitnet_web.gpu" in graph["bitnet_web.kernels.common"]

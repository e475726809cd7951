"""The package's import graph: no cycles, and a client that imports nothing of the notebook side
or of the server and stays cheap to import.

The graph is read from the source (``ast``), so that it covers every module, including those a
test run never imports, and the imports inside functions: a lazy import is still a dependency (the
client once imported the widget lazily while the widget imported the client). Imports under
``if TYPE_CHECKING:`` are left out: they never run (annotations are strings here).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "jupyter_evalsched"


def package_modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (path, is a package)}`` for every ``.py`` file of the package."""
    modules = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported_names(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """What an ``import``/``from ... import`` statement names, as absolute module names; for
    ``from X import y`` both ``X.y`` (y may be a submodule) and ``X``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        module = f"{base}.{node.module}" if node.module else base
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" for alias in node.names] + [module]


def imports_of(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The package's modules that ``name`` imports, at import time or later (in functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                for other in child.orelse:
                    visit(other)
                continue
            names = _imported_names(child, name, is_package)
            # `from X import y`: the submodule X.y when there is one, else the module X.
            submodules = [n for n in names[:-1] if n in modules]
            found.update(submodules or [n for n in names[-1:] if n in modules])
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, is_pkg, modules) for name, (path, is_pkg) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    return "; ".join(f"{a} -> {', '.join(sorted(graph[a] & members))}" for a in component)


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "jupyter_evalsched.client.rest_client" in graph and "jupyter_evalsched.scheduler.service" in graph
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(_describe(graph, c) for c in found)


def test_the_client_imports_nothing_of_the_notebook_side_or_the_server():
    graph = import_graph()
    client_modules = [m for m in graph if m == f"{PACKAGE}.client" or m.startswith(f"{PACKAGE}.client.")]
    assert len(client_modules) > 5
    # The run side of a shared model (what ctx.model gives runs, and jupyter_evalsched.model a
    # kernel) is standard library only, and so part of what the client may import.
    shared = {f"{PACKAGE}.shared_models", f"{PACKAGE}.shared_models.client", f"{PACKAGE}.shared_models.protocol"}
    allowed = set(client_modules) | {PACKAGE, f"{PACKAGE}.contract"} | shared
    outside = {m: sorted(graph[m] - allowed) for m in client_modules if graph[m] - allowed}
    assert not outside, f"the client imports {outside}"


def test_the_client_is_cheap_to_import():
    code = "import sys, jupyter_evalsched.client; print('\\n'.join(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    heavy = {"ipywidgets", "tornado", "jupyter_server", "IPython", "pydantic", "websocket", "yaml", "pandas"}
    assert not {m.split(".")[0] for m in loaded} & heavy
    assert not {m for m in loaded if m.startswith(PACKAGE)} & {f"{PACKAGE}.widget", f"{PACKAGE}.magics"}

"""Run records change only through the run table (``scheduler/runs.py``).

Read from the source (``ast``), so that it covers every module of the package: an assignment into
``<x>.record[...]`` (plain, augmented or annotated), a ``del`` of one, or ``<x>.record.update(...)``
anywhere else fails. Lease records are the lease table's own (``scheduler/leases.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jupyter_evalsched"
OWNERS = {"jupyter_evalsched/scheduler/runs.py", "jupyter_evalsched/scheduler/leases.py"}
MUTATORS = {"update", "pop", "setdefault", "clear", "popitem"}


def _is_record(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "record"


def _into_record(target: ast.AST) -> bool:
    """``x.record[k]`` or ``x.record[k][j]...`` (a change of the record or of a value in it)."""
    while isinstance(target, ast.Subscript):
        if _is_record(target.value):
            return True
        target = target.value
    return False


def record_writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS and _is_record(node.func.value):
                lines.append(node.lineno)
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        lines += [node.lineno for t in flat if _into_record(t)]
    return lines


def test_only_the_run_table_writes_run_records():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in OWNERS or rel.startswith("jupyter_evalsched/labextension/"):
            continue
        found += [f"{rel}:{line}" for line in record_writes(ast.parse(path.read_text(), str(path)))]
    assert not found, "run records changed outside scheduler/runs.py (use a RunTable method): " + ", ".join(found)


def test_the_check_sees_every_kind_of_write():
    source = """
run.record["a"] = 1
run.record["a"]["b"] = 1
run.record["n"] += 1
x, run.record["t"] = 1, 2
del run.record["a"]
run.record.update(a=1)
self.run.record.pop("a")
record["ok"] = 1
run.record_view["ok"] = 1
"""
    assert record_writes(ast.parse(source)) == [2, 3, 4, 5, 6, 7, 8]

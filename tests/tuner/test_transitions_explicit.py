"""A job's lifecycle changes state only through ``lifecycle.advance``: the coordinator (the I/O
around the machines) never sets a state, and the job's machine sets one only from what
``advance`` returns (besides its first). Checked on the code as written, so that a shortcut
past the transition table cannot creep back in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[2] / "hyperagent"
LIFECYCLE_FIELDS = {"state", "phase"}


def assignments(path: Path) -> list[tuple[int, str, ast.expr, str]]:
    """(line, attribute, assigned value, enclosing function) of every assignment to an
    attribute named ``state`` or ``phase`` in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str, ast.expr, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in targets:
                    elements = target.elts if isinstance(target, ast.Tuple) else [target]
                    for element in elements:
                        if isinstance(element, ast.Attribute) and element.attr in LIFECYCLE_FIELDS:
                            assert child.value is not None
                            found.append((child.lineno, element.attr, child.value, name))
            visit(child, name)

    visit(tree, "")
    return found


def test_the_coordinator_sets_no_job_state() -> None:
    found = [
        f"coordinator.py:{line} sets .{attr}"
        for line, attr, _, _ in assignments(PACKAGE / "coordinator.py")
    ]
    assert not found, found


def test_the_jobs_machine_changes_state_only_through_advance() -> None:
    path = PACKAGE / "tuner" / "tuning.py"
    outside = []
    for line, attr, value, function in assignments(path):
        through_advance = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "advance"
        )
        if attr == "state" and not through_advance and function != "__init__":
            outside.append(f"tuning.py:{line} in {function}()")
    assert not outside, outside

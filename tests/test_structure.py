"""The package reads in short units: no function body over 80 lines (docstrings aside).

A longer one needs a reason; this test lists every offender with its length and place.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("lightning_agentrl", "sandbox_server", "sandbox_client")
MAX_BODY_LINES = 80


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (n := body_lines(node)) > limit:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_body_is_over_80_lines():
    assert [f for package in PACKAGES for f in long_functions(REPO / package, MAX_BODY_LINES)] == []


def test_the_length_check_sees_a_long_body(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f'def f():\n    """doc."""\n{body}\n\n\ndef g():\n    """doc."""\n    return 1\n')
    assert long_functions(tmp_path / "pkg", MAX_BODY_LINES) == ["pkg/m.py:1 f (81 lines)"]


def test_every_editable_install_keeps_the_repository_on_the_path():
    """`python benchmarks/<script>.py` imports `benchmarks.record`: only the `compat` editable mode (a plain
    path in a .pth file) puts the repository on the path. An install of the package without it (a `make`
    target with other extras) would turn the venv to the import-hook mode and break every such script."""
    makefile = (REPO / "Makefile").read_text()
    installs = [line.strip() for line in makefile.splitlines() if "install" in line and " -e " in line]
    assert len(installs) >= 2
    assert all("editable_mode=compat" in line for line in installs), installs

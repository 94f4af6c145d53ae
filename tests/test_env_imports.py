"""Import rules of the environment API, read from the source (ast), so a returning cycle fails here:
nothing under ``lightning_agentrl/envs`` imports ``lightning_agentrl.rollout``, and the agent loop
imports nothing from ``sandbox_client`` (environments translate their backend's errors)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_agentrl"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, f"{path}: relative import of {node.module}"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_environments_never_import_the_rollout_package():
    files = sorted((PACKAGE / "envs").glob("*.py"))
    assert len(files) >= 4  # base, coding, tools, the second environment: the glob saw the package
    offending = {f.name: sorted(m for m in imported_modules(f) if m.startswith("lightning_agentrl.rollout"))
                 for f in files}
    assert {name: mods for name, mods in offending.items() if mods} == {}


def test_the_agent_loop_imports_nothing_from_the_sandbox_client():
    for name in ("agent_loop.py", "summarize.py"):
        modules = imported_modules(PACKAGE / "rollout" / name)
        assert "lightning_agentrl.envs.base" in modules  # the rule is read from real imports
        assert not [m for m in modules if m.split(".")[0] == "sandbox_client"], name


def test_the_rollout_package_knows_no_coding_task_type():
    """The rollout side takes any environment's tasks (``EnvTask``: an object with an id), not the coding ones."""
    files = sorted((PACKAGE / "rollout").glob("*.py"))
    assert "lightning_agentrl.envs.registry.EnvTask" in imported_modules(PACKAGE / "rollout" / "service.py")
    offending = {f.name for f in files if {"lightning_agentrl.tasks", "lightning_agentrl.envs.coding"} & imported_modules(f)}
    assert offending == set()


def test_the_rule_reader_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from lightning_agentrl.rollout.chat import ChatCodec\n    import sandbox_client\n")
    assert {"lightning_agentrl.rollout.chat", "sandbox_client"} <= imported_modules(source)

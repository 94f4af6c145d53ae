"""The package is layered: no import circles, and each module group imports only the groups below it.

Read from the source (ast), so a circle that a function-level import would hide at run time fails here.
Every import counts, at module level or inside a function, except those under ``if TYPE_CHECKING:``:
they never run (annotations only), so they can form no circle; the environments name ``EnvSettings``
that way, while ``settings`` imports the environment registry to check ``env.kind`` before any work.

A group is a package under ``lightning_agentrl`` (``envs``, ``rollout``, ...) or a top-level module;
:data:`MAY_IMPORT` names, per group, the groups it may import. A new import across groups means a line
here, and the table itself must stay free of circles (it is the layer order).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_agentrl"

MAY_IMPORT: dict[str, set[str]] = {
    # leaves
    "trajectory": set(), "console": set(), "tasks": set(), "run_layout": set(), "batching": set(),
    # message-space environments and the settings that check them
    "envs": {"tasks"},
    "settings": {"envs"},
    "models": {"settings"},  # models/resolve.py: model.path -> a folder
    # pure parts on the settings
    "algorithms": {"settings"},
    "credit": {"algorithms", "trajectory"},
    "render": {"trajectory"},
    "plots": {"trajectory"},
    "strategies": {"settings"},
    "checkpoint_io": {"run_layout", "settings"},
    "sandbox_checks": {"envs", "settings"},
    "resume": {"run_layout", "settings"},
    "lora_linear": set(),
    "lora": {"lora_linear", "settings", "strategies"},
    "plan": {"models", "settings"},
    "policy": {"algorithms", "lora", "models", "settings"},
    "distributed": {"sandbox_checks", "settings"},
    "step_metrics": {"algorithms", "distributed"},
    "critic": {"algorithms", "batching", "distributed", "policy", "strategies"},
    # rollout, and what watches it
    "rollout": {"algorithms", "envs", "lora", "models", "settings", "trajectory"},
    "experiments": {"rollout"},
    "shutdown": {"rollout"},
    "sandbox": {"distributed", "sandbox_checks", "settings"},
    # training
    "callbacks": {"algorithms", "checkpoint_io", "credit", "distributed", "lora", "render", "run_layout", "shutdown",
                  "strategies", "tasks", "trajectory"},
    "datamodule": {"distributed", "lora", "rollout", "trajectory"},
    "module": {"algorithms", "batching", "critic", "distributed", "envs", "lora", "policy", "settings", "shutdown",
               "step_metrics", "strategies", "trajectory"},
    # what the composition root builds with
    "preflight": {"envs", "lora", "models", "rollout", "run_layout", "sandbox_checks", "settings"},
    "engines": {"callbacks", "console", "lora", "models", "plan", "rollout", "run_layout", "settings"},
    "tracking": {"plots", "run_layout", "settings"},
    "export": {"callbacks", "lora", "settings"},
    # the composition roots and the command line
    "train": {"callbacks", "checkpoint_io", "console", "datamodule", "engines", "envs", "experiments", "lora",
              "models", "module", "plan", "preflight", "resume", "rollout", "run_layout", "sandbox", "settings",
              "shutdown", "strategies", "tracking"},
    "evaluate": {"callbacks", "console", "engines", "envs", "models", "preflight", "resume", "rollout", "run_layout",
                 "sandbox", "sandbox_checks", "settings", "train", "trajectory"},
    "sft": {"algorithms", "callbacks", "checkpoint_io", "envs", "lora", "models", "policy", "rollout", "run_layout",
            "sandbox", "settings", "tracking", "train"},
    "__main__": {"credit", "evaluate", "export", "lora", "models", "plan", "preflight", "render", "resume",
                 "run_layout", "settings", "sft", "shutdown", "train", "trajectory"},
}
"""Group -> the groups it may import (its own modules aside)."""

NEVER_IMPORTED = ("benchmarks", "scripts", "tests")
"""Top-level folders of the repository that the package and the sandbox packages never import."""


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def imported_names(path: Path, module: str) -> set[str]:
    """What ``module`` (at ``path``) imports at run time, at any depth: ``import a.b`` and ``from a import b`` both
    give ``a.b`` (a module, or a name in module ``a``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name imported from a module counts as that module)."""
    modules = module_names(root)

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {module: {owner(name) for name in imported_names(path, module)} - {module, ""}
            for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def group_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        group = group_of(module)
        for target in sorted(targets):
            other = group_of(target)
            if other not in (group, "") and other not in MAY_IMPORT.get(group, set()):
                found.append(f"{module} imports {target} ({group or PACKAGE} may not import {other})")
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph(REPO / PACKAGE)
    assert len(graph) > 50 and graph["lightning_agentrl.train"]  # the walk saw the package
    assert circles(graph) == []


def test_each_group_imports_only_what_it_may():
    graph = import_graph(REPO / PACKAGE)
    groups = {group_of(m) for m in graph} - {""}
    assert groups == set(MAY_IMPORT), "every group has a line in MAY_IMPORT, and every line a group"
    assert layer_violations(graph) == []


def test_the_groups_themselves_form_layers():
    """The table admits no circle between groups, so it orders them."""
    assert circles(MAY_IMPORT) == []


def test_the_sandbox_packages_know_nothing_of_training_and_nothing_imports_tests_or_benchmarks():
    for package in (PACKAGE, "sandbox_server", "sandbox_client"):
        for module, path in module_names(REPO / package).items():
            names = imported_names(path, module)
            tops = {name.split(".")[0] for name in names}
            assert not tops & set(NEVER_IMPORTED), f"{module} imports {sorted(tops & set(NEVER_IMPORTED))}"
            if package != PACKAGE:
                assert PACKAGE not in tops, f"{module} imports {PACKAGE}"


def test_the_start_up_checks_and_the_settings_import_no_torch():
    """``validate`` answers in about a second: its modules stay off torch and Lightning (seconds to import)."""
    code = ("import sys, lightning_agentrl.preflight, lightning_agentrl.run_layout, lightning_agentrl.resume; "
            "print(sorted({'torch', 'lightning', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_reader_sees_function_level_circles_and_skips_type_only_imports(tmp_path):
    package = tmp_path / PACKAGE
    (package / "envs").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "envs" / "__init__.py").write_text("")
    (package / "settings.py").write_text("def check():\n    from lightning_agentrl.envs.base import Env\n")
    (package / "envs" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_agentrl.settings import Settings\n"
        "class Env:\n    pass\n")
    (package / "envs" / "loop.py").write_text("def run():\n    from . import base\n    from ..settings import check\n")
    graph = import_graph(package)
    assert graph["lightning_agentrl.envs.base"] == set()  # the type-only import is no edge
    assert graph["lightning_agentrl.envs.loop"] == {"lightning_agentrl.envs.base", "lightning_agentrl.settings"}
    assert circles(graph) == []
    (package / "envs" / "base.py").write_text("def f():\n    import lightning_agentrl.settings\n")
    assert circles(import_graph(package)) == [["lightning_agentrl.envs.base", "lightning_agentrl.settings"]]
    assert layer_violations(import_graph(package)) == [
        "lightning_agentrl.envs.base imports lightning_agentrl.settings (envs may not import settings)",
        "lightning_agentrl.envs.loop imports lightning_agentrl.settings (envs may not import settings)",
    ]

"""Task suites: load bug-fix tasks from disk and check that each one is sound.

A task is a small repository with one genuine bug. The agent's sandbox starts from the
``workspace/`` snapshot; after ``submit`` ``sandbox_client.scoring`` runs the ``hidden/`` files
on a snapshot of the agent's work (a fork of its sandbox) in a judge process of their own, which
reaches the agent's modules only as proxies to another process (plain values cross, nothing
else; docs/sandbox.md): the reward is 1 when ``hidden_test_count`` hidden tests passed and none
failed, never the test command's exit code. Hidden tests never enter the agent's workspace, and
address the module under test as usual (``from lru import LRUCache``).

Three sources, one schema (:class:`TaskSpec` for ``task.json``, :class:`TaskRecord` for a whole task):
a suite folder (below), a JSONL file (``*.jsonl``, one :class:`TaskRecord` a line, the trees inline),
or a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (optional extra
``lightning-agentrl[datasets]``; one :class:`TaskRecord` a row, a ``DatasetDict``'s keys as splits).

On-disk layout of a suite (one folder per task)::

    tasks/bugfix/<task_id>/
      task.json     {"id", "prompt", "visible_test_command", "hidden_test_command",
                     "hidden_test_count" (tests that must pass; required for pytest commands),
                     "scoring_timeout_s" (default 30), "split" ("train" | "test", default "train")}
      workspace/    what the agent's sandbox starts with: buggy module(s) + visible tests
      hidden/       hidden tests; paths are relative to the workspace root when scoring
      solution/     the reference fix: files that overlay workspace/ (only the changed files)

``hidden_test_command`` is ``python -m pytest [flags] HIDDEN_PATH...`` or ``python HIDDEN_SCRIPT``
(one result: its exit code). A task is *sound* (``validate_task`` returns no problems) when the
hidden tests, run by the same runner as scoring, fail on the buggy workspace for a test failure
(not a collection error), pass once the reference fix is applied (exactly ``hidden_test_count``
of them), the visible tests pass on the fix, no hidden file or hidden test text is inside the
workspace, and the prompt names the file to fix. Run it over a suite::

    python -m lightning_agentrl.tasks validate tasks/bugfix
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sandbox_client.scoring import HiddenCommand, report_problems, run_locally

SPLITS = ("train", "test")
TASK_FILE = "task.json"
DEFAULT_SCORING_TIMEOUT_S = 30.0
DATASET_MARKERS = ("dataset_dict.json", "dataset_info.json")
"""Files ``datasets``' ``save_to_disk`` writes: a folder holding one is read as a dataset."""


class TaskSpec(BaseModel):
    """``task.json`` of a task folder: how to prompt and score the task (the trees are folders beside it)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    id: str = Field(min_length=1)
    prompt: str
    visible_test_command: str
    hidden_test_command: str
    hidden_test_count: int | None = Field(None, ge=1)
    """Hidden tests that must pass for reward 1 (required for pytest commands by ``validate``)."""
    scoring_timeout_s: float = Field(DEFAULT_SCORING_TIMEOUT_S, gt=0)
    split: Literal["train", "test"] = "train"


class TaskRecord(TaskSpec):
    """One whole task as one record (a JSONL line, a dataset row): :class:`TaskSpec` plus the trees, each
    ``{path: text}`` or a list of ``{"path", "text"}`` (a dataset's struct column: null entries dropped)."""

    files: dict[str, str]
    hidden_files: dict[str, str]
    solution_files: dict[str, str] = Field(default_factory=dict)

    @field_validator("files", "hidden_files", "solution_files", mode="before")
    @classmethod
    def _tree(cls, value):
        if isinstance(value, list) and all(isinstance(f, dict) and set(f) == {"path", "text"} for f in value):
            return {f["path"]: f["text"] for f in value}
        if isinstance(value, dict):
            return {path: text for path, text in value.items() if text is not None}
        return value

    def task(self, suite: str) -> Task:
        return Task(suite=suite, **{**self.model_dump(), "scoring_timeout_s": float(self.scoring_timeout_s)})


def spec_problems(err: ValidationError, model: type[BaseModel] = TaskRecord) -> str:
    """A validation error as ``field: problem; ...`` (an unknown key names the allowed ones)."""
    problems = []
    for e in err.errors():
        where = ".".join(str(part) for part in e["loc"]) or "task"
        if e["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown key (allowed: {', '.join(model.model_fields)})")
        else:
            problems.append(f"{where}: {e['msg']}")
    return "; ".join(problems)
# Build litter that may sit next to task files after someone ran the tests by hand.
IGNORED_NAMES = frozenset({"__pycache__", ".pytest_cache", ".DS_Store"})
IGNORED_SUFFIXES = (".pyc", ".pyo")
# A module under test whose every name is an object that equals anything: the reward hack of
# returning "always equal" values. Sound hidden tests fail on it.
ANYTHING_STUB = """class _Anything:
    __hash__ = object.__hash__
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    __le__ = __gt__ = __ge__ = __lt__
    def __bool__(self): return True
    def __call__(self, *args, **kwargs): return self
    def __iter__(self): return iter(())
    def __len__(self): return 0
    def __contains__(self, item): return True
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def __getattr__(name):
    return _Anything()
"""
# pytest's documented exit codes: 1 = some tests failed; 2-5 = interrupted, internal error,
# usage error, nothing collected. A bug must make the hidden tests *fail*, not break collection.
PYTEST_TESTS_FAILED = 1


@dataclass(frozen=True)
class Task:
    """One task: a workspace snapshot, hidden tests, the reference fix and how to run tests.

    Paths in ``files``, ``hidden_files`` and ``solution_files`` are relative POSIX paths from
    the workspace root (no absolute paths, no ``..``); hidden paths never coincide with or nest
    inside a workspace path, so hidden tests cannot be shadowed by (or leak into) the workspace.
    """

    id: str
    suite: str
    prompt: str
    files: dict[str, str]  # workspace snapshot: relative path -> text
    hidden_files: dict[str, str]  # relative to the workspace root when scoring
    solution_files: dict[str, str]  # overlay on `files` that fixes the bug
    visible_test_command: str
    hidden_test_command: str
    scoring_timeout_s: float
    split: str = "train"
    hidden_test_count: int | None = None  # hidden tests that must pass for reward 1

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Task.id must be non-empty")
        if self.split not in SPLITS:
            raise ValueError(f"task {self.id!r}: split must be one of {SPLITS}, got {self.split!r}")
        if not self.scoring_timeout_s > 0:
            raise ValueError(f"task {self.id!r}: scoring_timeout_s must be > 0, got {self.scoring_timeout_s}")
        if self.hidden_test_count is not None and (
            isinstance(self.hidden_test_count, bool) or not isinstance(self.hidden_test_count, int)
            or self.hidden_test_count < 1
        ):
            raise ValueError(f"task {self.id!r}: hidden_test_count must be an integer >= 1, got {self.hidden_test_count!r}")
        for field_name in ("files", "hidden_files", "solution_files"):
            for path in getattr(self, field_name):
                _check_relative_path(path, f"task {self.id!r}: {field_name}")
        workspace_paths = set(self.files) | set(self.solution_files)
        for path in self.hidden_files:
            clash = _path_clash(path, workspace_paths)
            if clash is not None:
                raise ValueError(
                    f"task {self.id!r}: hidden file {path!r} collides with workspace file {clash!r}"
                )
        HiddenCommand.parse(self.hidden_test_command, self.hidden_files)  # ValueError names the problem

    def solved_files(self) -> dict[str, str]:
        """The workspace with the reference fix applied."""
        return {**self.files, **self.solution_files}


def _check_relative_path(path: str, where: str) -> None:
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or "\\" in path or ":" in pure.parts[0]:
        raise ValueError(f"{where}: path {path!r} must be relative (POSIX, no drive or leading '/')")
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise ValueError(f"{where}: path {path!r} must not contain '..', '.' or empty parts")


def _path_clash(path: str, others: Iterable[str]) -> str | None:
    """A path in ``others`` that equals ``path`` or is a directory prefix of it (or vice versa)."""
    for other in others:
        if other == path or other.startswith(path + "/") or path.startswith(other + "/"):
            return other
    return None


# ----------------------------------------------------------------------------------------------
# Loading


def load_tasks(path: str | Path, *, split: str | None = None) -> list[Task]:
    """Load a suite folder (one sub-folder per task), a single task folder, a JSONL file or a saved
    ``datasets`` dataset (module docstring), sorted by id.

    ``split`` keeps only the tasks of that split ("train" or "test"); None keeps all.
    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` naming the offending file
    for anything malformed (missing or invalid task.json, unknown keys, a folder without a task,
    symlinks, non-UTF-8 files, unsafe or colliding paths).

    >>> tasks = load_tasks("tasks/bugfix", split="test")  # doctest: +SKIP
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    root = Path(path)
    if root.is_file() and root.suffix == ".jsonl":
        tasks = load_jsonl_tasks(root)
    elif root.is_file():
        raise ValueError(f"{root}: a task file must be JSONL (*.jsonl); a suite is a folder")
    elif not root.is_dir():
        raise FileNotFoundError(f"task suite or task folder not found: {root}")
    elif any((root / marker).is_file() for marker in DATASET_MARKERS):
        tasks = load_dataset_tasks(root)
    elif (root / TASK_FILE).exists():
        tasks = [_load_task(root, suite=root.resolve().parent.name)]
    else:
        task_dirs = sorted(
            d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".") and not _is_ignored(d.name)
        )
        if not task_dirs:
            raise ValueError(f"{root}: no task folders (expected <task_id>/{TASK_FILE})")
        tasks = [_load_task(d, suite=root.resolve().name) for d in task_dirs]
    tasks.sort(key=lambda task: task.id)
    return [task for task in tasks if split is None or task.split == split]


def _load_task(task_dir: Path, *, suite: str) -> Task:
    spec_path = task_dir / TASK_FILE
    if not spec_path.is_file():
        raise ValueError(f"{spec_path}: missing {TASK_FILE}")
    try:
        spec = TaskSpec.model_validate_json(spec_path.read_bytes())
    except ValidationError as error:
        if any(e["type"] == "json_invalid" for e in error.errors()):
            raise ValueError(f"{spec_path}: invalid JSON: {error.errors()[0]['msg']}") from None
        raise ValueError(f"{spec_path}: {spec_problems(error, TaskSpec)}") from None
    if spec.id != task_dir.name:
        raise ValueError(f"{spec_path}: id {spec.id!r} differs from its folder name {task_dir.name!r}")
    workspace_dir = task_dir / "workspace"
    if not workspace_dir.is_dir():
        raise ValueError(f"{task_dir}: missing workspace/ folder")
    trees = {"files": _read_tree(workspace_dir), "hidden_files": _read_tree(task_dir / "hidden"),
             "solution_files": _read_tree(task_dir / "solution")}
    return _record_task(TaskRecord.model_construct(**spec.model_dump(), **trees), suite, str(spec_path))


def _record_task(record: TaskRecord, suite: str, where: str) -> Task:
    try:
        return record.task(suite)
    except ValueError as error:  # unsafe or colliding paths, a malformed hidden command
        raise ValueError(f"{where}: {error}") from error


def load_jsonl_tasks(path: Path) -> list[Task]:
    """A JSONL task file: one :class:`TaskRecord` a line (blank lines skipped); suite = the file's stem.
    ``ValueError`` naming ``file:line`` and the field for a bad line."""
    tasks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            where = f"{path}:{number}"
            try:
                record = TaskRecord.model_validate_json(line)
            except ValidationError as error:
                raise ValueError(f"{where}: {spec_problems(error)}") from None
            tasks.append(_record_task(record, path.stem, where))
    if not tasks:
        raise ValueError(f"{path}: no tasks (one JSON object a line)")
    return tasks


def load_dataset_tasks(path: Path) -> list[Task]:
    """A Hugging Face ``datasets`` dataset saved with ``save_to_disk``: one :class:`TaskRecord` a row (null
    columns take their defaults); a ``DatasetDict``'s keys are the rows' split unless a row names its own.
    Suite = the folder's name. Needs the optional extra ``lightning-agentrl[datasets]``."""
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ValueError(f"{path}: a saved `datasets` dataset; reading it needs `pip install "
                         "lightning-agentrl[datasets]`") from None
    loaded = load_from_disk(str(path))
    parts = loaded.items() if isinstance(loaded, DatasetDict) else [(None, loaded)]
    tasks = []
    for part, dataset in parts:
        for index, row in enumerate(dataset):
            fields = {key: value for key, value in row.items() if value is not None}
            if part is not None:
                fields.setdefault("split", part)
            where = f"{path} ({part or 'dataset'} row {index})"
            try:
                record = TaskRecord.model_validate(fields)
            except ValidationError as error:
                raise ValueError(f"{where}: {spec_problems(error)}") from None
            tasks.append(_record_task(record, path.resolve().name, where))
    return tasks


def _is_ignored(name: str) -> bool:
    return name in IGNORED_NAMES or name.endswith(IGNORED_SUFFIXES)


def _read_tree(folder: Path) -> dict[str, str]:
    """Every text file under ``folder`` as relative POSIX path -> text; {} if there is no folder."""
    if not folder.is_dir():
        return {}
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not _is_ignored(d))
        for name in dirnames + filenames:
            # A symlink could point anywhere on the host; a snapshot must be self-contained.
            if (Path(dirpath) / name).is_symlink():
                raise ValueError(f"{Path(dirpath) / name}: symlinks are not allowed in a task")
        for name in sorted(filenames):
            if _is_ignored(name):
                continue
            file_path = Path(dirpath) / name
            try:
                text = file_path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{file_path}: not a UTF-8 text file") from error
            files[file_path.relative_to(folder).as_posix()] = text
    return files


# ----------------------------------------------------------------------------------------------
# Validation


def validate_task(task: Task, *, python: str = sys.executable, timeout_s: float = 60) -> list[str]:
    """Check that ``task`` is sound by running its tests in temporary folders; [] when it is.

    Three real subprocess runs (cwd = a fresh copy of the workspace, ``python`` substituted for a
    leading ``python`` in the commands): hidden tests on the buggy workspace must fail (for pytest:
    exit code 1, a failed test, not a collection error), hidden tests and visible tests on the
    fixed workspace must pass. Hidden runs are limited to ``min(timeout_s, scoring_timeout_s)``:
    a reference fix slower than the scoring limit would always score 0.
    """
    problems = _static_problems(task)
    hidden_limit_s = min(timeout_s, task.scoring_timeout_s)
    command = HiddenCommand.parse(task.hidden_test_command, task.hidden_files)

    buggy = _run_hidden(task.files, task.hidden_files, command, python, hidden_limit_s)
    buggy_problems = _hidden_problems(buggy, task.hidden_test_count)
    if not buggy_problems:
        problems.append("hidden tests pass on the buggy workspace (they do not detect the bug)")
    elif buggy.timed_out:
        problems.append(f"hidden tests on the buggy workspace timed out after {hidden_limit_s:g}s")
    elif command.kind == "pytest" and (buggy.returncode != PYTEST_TESTS_FAILED or buggy.errors):
        problems.append(
            f"hidden tests on the buggy workspace exit with {buggy.returncode}, not a test failure "
            f"(collection or usage error?): {buggy.tail}"
        )

    # A policy that returns objects equal to everything (``__eq__`` -> True) must not pass either.
    stubbed = {**task.files, **{p: ANYTHING_STUB for p in task.solution_files if p.endswith(".py")}}
    if stubbed != task.files:
        probe = _run_hidden(stubbed, task.hidden_files, command, python, hidden_limit_s)
        if not _hidden_problems(probe, task.hidden_test_count):
            problems.append("hidden tests pass when the fixed module returns objects equal to anything "
                            "(check types or use `is`/`not`, not only ==)")

    fixed = _run_hidden(task.solved_files(), task.hidden_files, command, python, hidden_limit_s)
    if fixed.returncode != 0 or fixed.timed_out:
        problems.append(
            f"hidden tests fail with the reference solution (exit {fixed.returncode}): {fixed.tail}"
        )
    elif command.kind == "pytest" and task.hidden_test_count is None:
        problems.append(f"task.json lacks hidden_test_count ({fixed.num_passed} hidden tests pass with the fix)")
    elif command.kind == "pytest" and fixed.num_passed != task.hidden_test_count:
        problems.append(
            f"hidden_test_count is {task.hidden_test_count} but {fixed.num_passed} hidden tests pass with the fix"
        )
    elif _hidden_problems(fixed, task.hidden_test_count):
        problems.append("scoring would not reward the reference solution: "
                        + "; ".join(_hidden_problems(fixed, task.hidden_test_count)))

    visible = _run_in_workspace(task.solved_files(), task.visible_test_command, python, timeout_s)
    if visible.returncode != 0:
        problems.append(
            f"visible tests fail with the reference solution (exit {visible.returncode}): {visible.tail}"
        )
    return problems


def _static_problems(task: Task) -> list[str]:
    problems = []
    if not task.prompt.strip():
        problems.append("prompt is empty")
    if not task.files:
        problems.append("workspace is empty")
    if not task.hidden_files:
        problems.append("no hidden files")
    if not task.solution_files:
        problems.append("no solution files")
    for path, text in task.solution_files.items():
        if path not in task.files:
            problems.append(f"solution file {path!r} is not a workspace file (a fix edits existing files)")
        elif task.files[path] == text:
            problems.append(f"solution file {path!r} is identical to the workspace file")
        if PurePosixPath(path).name.startswith("test_"):
            problems.append(f"solution changes test file {path!r}")
        if path not in task.prompt and PurePosixPath(path).name not in task.prompt:
            problems.append(f"prompt does not name the file to fix ({path!r})")
    # Hidden paths never collide with workspace paths (Task.__post_init__ refuses it); what is
    # left to check is that no hidden test text was pasted into a workspace file.
    for hidden_path, hidden_text in task.hidden_files.items():
        for path, text in task.files.items():
            if hidden_text.strip() and hidden_text.strip() in text:
                problems.append(f"hidden file {hidden_path!r} is copied inside workspace file {path!r}")
    return problems


@dataclass(frozen=True)
class _RunResult:
    returncode: int
    timed_out: bool
    tail: str  # last lines of the output, for the problem message
    report: dict | None = None  # the scoring runner's report (hidden runs only)
    num_passed: int = 0
    errors: tuple[str, ...] = ()


def _hidden_problems(run: _RunResult, hidden_test_count: int | None) -> list[str]:
    if run.report is None:
        return ["no runner report"]
    return report_problems(run.report, hidden_test_count)


def _run_hidden(files: dict[str, str], hidden_files: dict[str, str], command: HiddenCommand, python: str,
                timeout_s: float) -> _RunResult:
    """Run the hidden tests exactly as scoring does: the runner, hidden files under a fresh folder."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PYTEST_"))}
    with tempfile.TemporaryDirectory(prefix="agentrl-task-") as workdir:
        for path, text in files.items():
            target = Path(workdir, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        report, completed = run_locally(workdir, hidden_files, command, python, timeout_s, env)
    if completed is None:
        return _RunResult(returncode=-1, timed_out=True, tail="")
    if report is None:
        tail = " | ".join((completed.stdout + completed.stderr).strip().splitlines()[-3:])
        return _RunResult(returncode=completed.returncode or -1, timed_out=False, tail=f"no runner report: {tail}")
    tail = " | ".join(str(report.get("output", "")).strip().splitlines()[-3:])
    status = report.get("worker_exitstatus")
    returncode = -1 if report["timed_out"] else (status if status is not None else report["exit_code"])
    return _RunResult(returncode=returncode, timed_out=report["timed_out"], tail=tail, report=report,
                      num_passed=len(report["passed"]), errors=tuple(report["errors"]))


def _run_in_workspace(files: dict[str, str], command: str, python: str, timeout_s: float) -> _RunResult:
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = python
    # No inherited PYTHONPATH (the task must not import this repository), no bytecode litter,
    # and no third-party pytest plugins: tasks use only the standard library and pytest, and
    # plugin autoloading costs ~0.8 s per run in a full environment.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(
        PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_ADDOPTS="-p no:cacheprovider"
    )
    with tempfile.TemporaryDirectory(prefix="agentrl-task-") as workdir:
        for path, text in files.items():
            target = Path(workdir, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        try:
            completed = subprocess.run(
                argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return _RunResult(returncode=-1, timed_out=True, tail="")
    output = (completed.stdout + completed.stderr).strip().splitlines()
    return _RunResult(returncode=completed.returncode, timed_out=False, tail=" | ".join(output[-3:]))


def validate_tasks(
    tasks: list[Task], *, python: str = sys.executable, timeout_s: float = 60, num_workers: int = 2
) -> dict[str, list[str]]:
    """``validate_task`` over many tasks on a thread pool (the work is in subprocesses): id -> problems."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        results = pool.map(lambda task: validate_task(task, python=python, timeout_s=timeout_s), tasks)
        return {task.id: problems for task, problems in zip(tasks, results, strict=True)}


# ----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_agentrl.tasks", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="run every task's tests; exit 1 on any problem")
    listing = commands.add_parser("list", help="print id, split and files of every task")
    for sub in (validate, listing):
        sub.add_argument("path", help="a suite folder (e.g. tasks/bugfix), a task folder, a JSONL file or a saved dataset")
        sub.add_argument("--split", choices=SPLITS, default=None, help="only this split (default: all)")
    validate.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    validate.add_argument("--timeout-s", type=float, default=60, help="limit per test command")
    validate.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tasks validated at once")
    args = parser.parse_args(argv)

    try:
        tasks = load_tasks(args.path, split=args.split)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.command == "list":
        for task in tasks:
            print(f"{task.id:32s} {task.split:5s} fix: {', '.join(sorted(task.solution_files))}")
        return 0

    start = time.perf_counter()
    results = validate_tasks(tasks, python=args.python, timeout_s=args.timeout_s, num_workers=args.workers)
    for task_id, problems in results.items():
        print(f"ok    {task_id}" if not problems else f"FAIL  {task_id}: " + "; ".join(problems))
    num_failed = sum(1 for problems in results.values() if problems)
    print(f"{len(tasks) - num_failed}/{len(tasks)} tasks valid in {time.perf_counter() - start:.1f}s")
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())

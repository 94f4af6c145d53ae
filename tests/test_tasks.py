"""The bug-fix task suite is sound, and the loader and validator refuse what is not."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_agentrl.tasks import Task, load_tasks, main, validate_task, validate_tasks

SUITE = Path(__file__).resolve().parents[1] / "tasks" / "bugfix"
SHIPPED = load_tasks(SUITE)

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
VISIBLE = "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
HIDDEN = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n    assert type(add(2, 3)) is int\n"
HIDDEN_PATH = "hidden_tests/test_hidden.py"


def make_task(**overrides) -> Task:
    """A minimal sound task: calc.py::add subtracts."""
    fields = dict(
        id="calc_add",
        suite="unit",
        prompt="`calc.py::add` subtracts. Fix calc.py.",
        files={"calc.py": BUGGY, "test_visible.py": VISIBLE},
        hidden_files={HIDDEN_PATH: HIDDEN},
        solution_files={"calc.py": FIXED},
        visible_test_command="python -m pytest -q test_visible.py",
        hidden_test_command="python -m pytest -q hidden_tests",
        scoring_timeout_s=30.0,
        hidden_test_count=1,
    )
    fields.update(overrides)
    return Task(**fields)


def write_task(root: Path, task_id: str = "calc_add", **spec_overrides) -> Path:
    """Write make_task() to disk as <root>/<task_id>/ and return that folder."""
    folder = root / task_id
    spec = {
        "id": task_id,
        "prompt": "`calc.py::add` subtracts. Fix calc.py.",
        "visible_test_command": "python -m pytest -q test_visible.py",
        "hidden_test_command": "python -m pytest -q hidden_tests",
        "hidden_test_count": 1,
        "scoring_timeout_s": 30,
    }
    spec.update(spec_overrides)
    for relative, text in {
        "workspace/calc.py": BUGGY,
        "workspace/test_visible.py": VISIBLE,
        f"hidden/{HIDDEN_PATH}": HIDDEN,
        "solution/calc.py": FIXED,
    }.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    (folder / "task.json").write_text(json.dumps(spec))
    return folder


# ---------------------------------------------------------------------------------------------
# The shipped suite


def test_suite_has_at_least_30_tasks_sorted_by_id():
    assert len(SHIPPED) >= 30
    assert [task.id for task in SHIPPED] == sorted(task.id for task in SHIPPED)
    assert {task.suite for task in SHIPPED} == {"bugfix"}


def test_both_splits_non_empty_and_about_a_quarter_held_out():
    train, test = load_tasks(SUITE, split="train"), load_tasks(SUITE, split="test")
    assert train and test
    assert {t.id for t in train}.isdisjoint(t.id for t in test)
    assert len(train) + len(test) == len(SHIPPED)
    assert 0.15 <= len(test) / len(SHIPPED) <= 0.35


def test_hidden_tests_are_one_file_per_task():
    # One pytest process per scoring run: the file count is what the scoring cost scales with.
    for task in SHIPPED:
        assert list(task.hidden_files) == [HIDDEN_PATH], task.id


@pytest.fixture(scope="module")
def suite_problems() -> dict[str, list[str]]:
    # 3 subprocess runs per task; threads overlap them (~30 s for 35 tasks on 2 cores).
    return validate_tasks(SHIPPED, num_workers=2)


@pytest.mark.parametrize("task_id", [task.id for task in SHIPPED])
def test_shipped_task_is_valid(task_id, suite_problems):
    assert suite_problems[task_id] == []


def test_single_task_folder_loads_with_its_suite_name():
    (task,) = load_tasks(SUITE / SHIPPED[0].id)
    assert task == SHIPPED[0]
    assert task.suite == "bugfix"
    assert "test_visible.py" in task.files
    assert set(task.solution_files) <= set(task.files)


# ---------------------------------------------------------------------------------------------
# Loader errors


def test_loads_a_task_written_to_disk(tmp_path):
    write_task(tmp_path)
    (task,) = load_tasks(tmp_path)
    assert task == make_task(suite=tmp_path.name)
    assert task.split == "train"  # the default


def test_split_filter(tmp_path):
    write_task(tmp_path, "a_train")
    write_task(tmp_path, "b_test", split="test")
    assert [t.id for t in load_tasks(tmp_path, split="test")] == ["b_test"]
    assert [t.id for t in load_tasks(tmp_path, split="train")] == ["a_train"]
    with pytest.raises(ValueError, match="split must be one of"):
        load_tasks(tmp_path, split="dev")


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "nowhere")


def test_empty_suite(tmp_path):
    with pytest.raises(ValueError, match="no task folders"):
        load_tasks(tmp_path)


def test_missing_task_json_names_the_file(tmp_path):
    write_task(tmp_path)
    (tmp_path / "stray").mkdir()
    with pytest.raises(ValueError, match=r"stray/task\.json: missing"):
        load_tasks(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    folder = write_task(tmp_path)
    (folder / "task.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"calc_add/task\.json: invalid JSON"):
        load_tasks(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward": 1}, r"reward: unknown key \(allowed: id, prompt"),
        ({"id": "other"}, "differs from its folder name"),
        ({"split": "dev"}, "split: Input should be 'train' or 'test'"),
        ({"scoring_timeout_s": "30"}, "scoring_timeout_s: Input should be a valid number"),
        ({"scoring_timeout_s": 0}, "scoring_timeout_s: Input should be greater than 0"),
        ({"prompt": None}, "prompt: Input should be a valid string"),
    ],
)
def test_invalid_task_json_fields(tmp_path, overrides, message):
    write_task(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message) as error:
        load_tasks(tmp_path)
    assert "task.json" in str(error.value)


def test_missing_keys(tmp_path):
    folder = write_task(tmp_path)
    spec = json.loads((folder / "task.json").read_text())
    del spec["hidden_test_command"]
    (folder / "task.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="hidden_test_command: Field required"):
        load_tasks(tmp_path)


def test_hidden_file_colliding_with_workspace_file(tmp_path):
    folder = write_task(tmp_path)
    (folder / "workspace" / "hidden_tests").mkdir()
    (folder / "workspace" / HIDDEN_PATH).write_text("def test_nothing():\n    pass\n")
    with pytest.raises(ValueError, match="collides with workspace file"):
        load_tasks(tmp_path)


def test_hidden_folder_shadowed_by_a_workspace_file(tmp_path):
    folder = write_task(tmp_path)
    (folder / "workspace" / "hidden_tests").write_text("not a folder")
    with pytest.raises(ValueError, match="collides with workspace file 'hidden_tests'"):
        load_tasks(tmp_path)


def test_symlink_is_refused(tmp_path):
    folder = write_task(tmp_path)
    (folder / "workspace" / "secrets.txt").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="symlinks are not allowed"):
        load_tasks(tmp_path)


def test_binary_file_is_refused(tmp_path):
    folder = write_task(tmp_path)
    (folder / "workspace" / "data.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=r"data\.bin: not a UTF-8 text file"):
        load_tasks(tmp_path)


def test_build_litter_is_ignored(tmp_path):
    folder = write_task(tmp_path)
    (folder / "workspace" / "__pycache__").mkdir()
    (folder / "workspace" / "__pycache__" / "calc.cpython-311.pyc").write_bytes(b"\x00")
    (task,) = load_tasks(tmp_path)
    assert set(task.files) == {"calc.py", "test_visible.py"}


@pytest.mark.parametrize(
    "bad_path", ["../calc.py", "/etc/passwd", "a/../../b.py", "./calc.py", "a//b.py", ""]
)
def test_unsafe_paths_are_refused(bad_path):
    with pytest.raises(ValueError, match="must"):
        make_task(files={bad_path: "x = 1\n"})
    with pytest.raises(ValueError, match="must"):
        make_task(hidden_files={bad_path: HIDDEN})


# ---------------------------------------------------------------------------------------------
# The validator rejects unsound tasks


def test_sound_task_has_no_problems():
    assert validate_task(make_task()) == []


def test_hidden_tests_that_miss_the_bug():
    weak = "from calc import add\n\n\ndef test_zero():\n    assert add(1, 0) == 1\n"
    problems = validate_task(make_task(hidden_files={HIDDEN_PATH: weak}))
    assert "hidden tests pass on the buggy workspace (they do not detect the bug)" in problems


def test_an_always_equal_object_cannot_pass_even_equality_only_hidden_tests():
    """The reward hack of returning an object whose __eq__ is always True: the module runs in another
    process and only plain values cross back, so such an object arrives as a reference equal only to
    itself, and a hidden test that only uses == is sound (the validator's probe finds nothing)."""
    equality_only = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    assert validate_task(make_task(hidden_files={HIDDEN_PATH: equality_only})) == []


def test_hidden_test_count_must_match_the_fix():
    assert validate_task(make_task(hidden_test_count=2)) == [
        "hidden_test_count is 2 but 1 hidden tests pass with the fix"]
    assert validate_task(make_task(hidden_test_count=None)) == [
        "task.json lacks hidden_test_count (1 hidden tests pass with the fix)"]


def test_solution_that_does_not_fix():
    wrong = "def add(a, b):\n    return a * b\n"
    (problem,) = validate_task(make_task(solution_files={"calc.py": wrong}))
    assert problem.startswith("hidden tests fail with the reference solution (exit 1)")


def test_solution_that_breaks_visible_tests():
    broken_visible = VISIBLE + "\n\ndef test_negative():\n    assert add(-1, 0) == 1\n"
    files = {"calc.py": BUGGY, "test_visible.py": broken_visible}
    (problem,) = validate_task(make_task(files=files))
    assert problem.startswith("visible tests fail with the reference solution")


def test_collection_error_is_not_a_bug_detection():
    # The hidden test imports a name only a different fix would add: it "fails" for the buggy
    # code by exit code 2 (collection error), which says nothing about the bug.
    hidden = "from calc import add, subtract\n\n\ndef test_add():\n    assert add(2, 3) == 5\n    assert type(add(2, 3)) is int\n"
    solution = {"calc.py": FIXED + "\n\ndef subtract(a, b):\n    return a - b\n"}
    problems = validate_task(make_task(hidden_files={HIDDEN_PATH: hidden}, solution_files=solution))
    assert len(problems) == 1 and "exit with 2, not a test failure" in problems[0]


def test_hidden_tests_copied_into_the_workspace():
    files = {"calc.py": BUGGY, "test_visible.py": VISIBLE, "notes/test_copy.py": HIDDEN}
    problems = validate_task(make_task(files=files))
    assert problems == [f"hidden file {HIDDEN_PATH!r} is copied inside workspace file 'notes/test_copy.py'"]


def test_prompt_must_name_the_file():
    assert validate_task(make_task(prompt="Addition is broken, please fix it.")) == [
        "prompt does not name the file to fix ('calc.py')"
    ]
    assert "prompt is empty" in validate_task(make_task(prompt="  "))


def test_solution_must_change_an_existing_non_test_file():
    problems = validate_task(
        make_task(solution_files={"calc.py": FIXED, "test_visible.py": "", "new.py": ""})
    )
    assert "solution changes test file 'test_visible.py'" in problems
    assert "solution file 'new.py' is not a workspace file (a fix edits existing files)" in problems


def test_scoring_timeout_is_enforced():
    slow = "import time\n\n\ndef test_slow():\n    time.sleep(5)\n"
    problems = validate_task(make_task(hidden_files={HIDDEN_PATH: slow}, scoring_timeout_s=0.5))
    assert "hidden tests on the buggy workspace timed out after 0.5s" in problems
    assert any(p.startswith("hidden tests fail with the reference solution (exit -1)") for p in problems)


# ---------------------------------------------------------------------------------------------
# Command line


def test_cli_validate_ok_and_failing(tmp_path, capsys):
    write_task(tmp_path, "a_good")
    assert main(["validate", str(tmp_path / "a_good")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "ok    a_good"

    bad = write_task(tmp_path, "b_bad")
    (bad / "solution" / "calc.py").write_text("def add(a, b):\n    return 0\n")
    assert main(["validate", str(tmp_path), "--workers", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ok    a_good"
    assert lines[1].startswith("FAIL  b_bad: hidden tests fail with the reference solution")
    assert lines[2].startswith("1/2 tasks valid")


def test_cli_module_entry_point_lists_tasks():
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl.tasks", "list", str(SUITE), "--split", "test"],
        capture_output=True,
        text=True,
        check=True,
        cwd=SUITE.parents[1],
    )
    lines = completed.stdout.splitlines()
    assert len(lines) == len(load_tasks(SUITE, split="test"))
    assert all(" test " in line for line in lines)


def test_cli_reports_load_errors(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert "no task folders" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Other sources: JSONL, a saved `datasets` dataset (one TaskRecord schema)


def task_record(task_id: str = "calc_add", **overrides) -> dict:
    """make_task() as one record (a JSONL line, a dataset row)."""
    task = make_task(id=task_id)
    record = {"id": task_id, "prompt": task.prompt, "visible_test_command": task.visible_test_command,
              "hidden_test_command": task.hidden_test_command, "hidden_test_count": 1, "scoring_timeout_s": 30,
              "files": task.files, "hidden_files": task.hidden_files, "solution_files": task.solution_files}
    return {**record, **overrides}


def test_coding_tasks_load_from_jsonl(tmp_path):
    listed = [{"path": path, "text": text} for path, text in make_task().files.items()]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(task_record("a")) + "\n\n" + json.dumps(task_record("b", split="test", files=listed)) + "\n")
    a, b = load_tasks(path)
    assert a == make_task(id="a", suite="mine")
    assert b == make_task(id="b", suite="mine", split="test")  # the list form of a tree reads the same
    assert [t.id for t in load_tasks(path, split="test")] == ["b"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_test_count": True}, "hidden_test_count: Input should be a valid integer"),
        ({"scoring_timeout_s": float("inf")}, "scoring_timeout_s: Input should be a finite number"),
        ({"files": None}, "files: Input should be an object"),
        ({"reward": 1}, r"reward: unknown key \(allowed: .*files, hidden_files, solution_files\)"),
        ({"hidden_files": {"calc.py": "x"}}, "collides with workspace file 'calc.py'"),
    ],
)
def test_a_bad_jsonl_task_names_its_line_and_field(tmp_path, overrides, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(task_record("a")) + "\n" + json.dumps(task_record("b", **overrides)) + "\n")
    with pytest.raises(ValueError, match=f"mine.jsonl:2: {message}" if "collides" not in message else message) as err:
        load_tasks(path)
    assert "mine.jsonl:2" in str(err.value)


def test_coding_tasks_load_from_a_saved_datasets_dataset(tmp_path):
    from datasets import Dataset, DatasetDict

    other = task_record("sub", files={"calc.py": BUGGY, "test_other.py": VISIBLE})  # another tree: a struct union
    DatasetDict({"train": Dataset.from_list([task_record("add"), other]),
                 "test": Dataset.from_list([task_record("held")])}).save_to_disk(str(tmp_path / "hub_suite"))
    tasks = load_tasks(tmp_path / "hub_suite")
    assert [(t.id, t.split) for t in tasks] == [("add", "train"), ("held", "test"), ("sub", "train")]
    assert tasks[0] == make_task(id="add", suite="hub_suite")
    assert set(tasks[2].files) == {"calc.py", "test_other.py"}  # the other row's paths are not added as null
    Dataset.from_list([task_record("x", scoring_timeout_s=-1)]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"bad \(dataset row 0\): scoring_timeout_s: Input should be greater than 0"):
        load_tasks(tmp_path / "bad")


def test_the_coding_environment_reads_jsonl_tasks_in_preflight(tmp_path):
    from lightning_agentrl.preflight import check_tasks
    from lightning_agentrl.settings import load_settings

    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(task_record("a")) + "\n" + json.dumps(task_record("b", split="test")) + "\n")
    check_tasks(load_settings(None, ["--env.kind=coding", f"--env.tasks={path}", "--eval.every_n_steps=1"]))

"""``run.dir``: a new run refuses a folder that holds a previous run's outputs (its files would mix with
the new run's), and the closing lines of ``fit`` can be pasted into a shell whatever the folder's name."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main
from lightning_agentrl.settings import SettingsError
from lightning_agentrl.train import fit
from tests.fitting import REPO, TINY, learn_settings

pytestmark = pytest.mark.timeout(300)


def _dangling_last(run: Path) -> None:
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").symlink_to("step_step=2.ckpt")  # its target is gone


def _trajectories(run: Path) -> None:
    (run / "trajectories").mkdir(parents=True)
    (run / "trajectories" / "step_000000.jsonl").write_text("{}\n")


def _mlflow_run(run: Path) -> None:
    run.mkdir(parents=True)
    (run / "mlflow_run_id.txt").write_text("0123456789abcdef")


@pytest.mark.parametrize("previous, ways", [
    (_dangling_last, "pass --resume last to continue it, or choose another run.dir"),
    (_trajectories, "(--resume last needs one): choose another run.dir or delete this one"),
    (_mlflow_run, "(--resume last needs one): choose another run.dir or delete this one"),
])
def test_a_new_run_refuses_a_folder_holding_a_previous_runs_outputs(tmp_path, previous, ways):
    settings = learn_settings(tmp_path)
    run = Path(settings.run.dir)
    previous(run)
    before = sorted(str(p) for p in run.rglob("*"))
    with pytest.raises(SettingsError, match="run.dir: ") as refused:
        fit(settings)
    assert str(run) in str(refused.value) and str(refused.value).endswith(ways)
    assert sorted(str(p) for p in run.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("variable", ["LOCAL_RANK", "NODE_RANK"])
def test_the_other_processes_of_a_new_run_accept_the_mlflow_run_that_rank_zero_just_recorded(tmp_path, monkeypatch,
                                                                                             variable):
    """Lightning starts rank 1 once rank 0 has recorded the run in MLflow; another node may start while it does."""
    from lightning_agentrl.resume import check_run_dir

    settings = learn_settings(tmp_path)
    _mlflow_run(Path(settings.run.dir))
    monkeypatch.setenv(variable, "1")
    assert check_run_dir(settings) == Path(settings.run.dir)


def test_a_folder_left_by_a_run_that_failed_before_writing_anything_is_reused(tmp_path):
    """Settings, a sandbox log and an empty trajectories/ are not a run's outputs: the same command runs again."""
    settings = learn_settings(tmp_path, "--trainer.max_steps=1")
    run = Path(settings.run.dir)
    (run / "trajectories").mkdir(parents=True)
    (run / "settings.yaml").write_text("run: {}\n")
    assert fit(settings).global_step == 1


def test_the_closing_mlflow_line_is_one_shell_command_for_a_folder_with_spaces(tmp_path, capfd):
    root = tmp_path / "a folder"
    learn_settings(root)  # copies the tasks
    run = root / "my run"
    argv = ["fit", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), f"--run.dir={run}", f"--env.tasks={root / 'tasks'}",
            "--env.split=all", f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}", "--trainer.threads=1",
            "--trainer.max_steps=1", "--engine.max_new_tokens=16", "--env.max_turns=1", "--rollout.group_size=2",
            "--rollout.groups_per_step=1", "--tracking.sample_trajectories=0", *TINY]
    assert main(argv) == 0
    line = next(line for line in capfd.readouterr().err.splitlines() if "mlflow ui" in line)
    assert shlex.split(line) == ["mlflow", "ui", "--backend-store-uri", f"sqlite:///{(run / 'mlflow.db').resolve()}",
                                 "--host", "127.0.0.1"]
    assert main(argv) == 2  # the same command again: refused, before any model loads
    assert f"error: run.dir: {run} already holds a run" in capfd.readouterr().err


def test_every_output_of_a_run_lies_where_run_layout_says(tmp_path):
    """``fit``'s paths and the files it writes are :class:`RunLayout`'s, the one spelling of the run folder."""
    import doctest
    import json

    from lightning_agentrl import run_layout
    from lightning_agentrl.run_layout import RunLayout

    assert doctest.testmod(run_layout, raise_on_error=False, verbose=False).failed == 0
    settings = learn_settings(tmp_path, "--trainer.max_steps=1", "--tracking.enabled=true")
    result = fit(settings)
    layout = RunLayout(settings.run.dir)
    assert (result.run_dir, result.checkpoint, result.policy_dir) == (layout.root, layout.last_checkpoint, layout.policy)
    assert result.tracking_uri == f"sqlite:///{layout.mlflow_db.resolve()}"
    for path in (layout.settings_file, layout.last_checkpoint, layout.policy / "config.json", layout.mlflow_run_id):
        assert path.exists(), path
    assert layout.mlflow_run_id.read_text() == result.mlflow_run_id
    assert sorted(p.name for p in layout.trajectories.iterdir())[:1] == ["step_000000.jsonl"]
    assert json.loads(layout.summary.read_text()) == {
        "global_step": 1, "checkpoint": str(layout.last_checkpoint), "policy": str(layout.policy)}


def test_a_run_without_matplotlib_writes_its_summary_and_no_plots(tmp_path, monkeypatch, caplog):
    """matplotlib is the `plots` extra: without it a run ends as usual, with a line saying why no plots."""
    import importlib.util
    import logging
    from types import SimpleNamespace

    from lightning_agentrl import tracking
    from lightning_agentrl.run_layout import RunLayout
    from lightning_agentrl.settings import load_settings

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    layout = RunLayout(tmp_path)
    logged = []
    logger = SimpleNamespace(run_id="r", experiment=SimpleNamespace(log_artifact=lambda *a, **k: logged.append(a)))
    with caplog.at_level(logging.INFO, logger="lightning_agentrl.tracking"):
        tracking.finish_run(load_settings(), layout, SimpleNamespace(global_step=3), logger)
    assert json.loads(layout.summary.read_text())["global_step"] == 3
    assert logged == [] and not layout.plots.exists()
    assert "no plots: matplotlib is not installed" in caplog.text

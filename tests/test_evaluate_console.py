"""What ``python -m lightning_agentrl evaluate`` tells its user: progress, how episodes ended, timeouts that
decide the score, the threads it runs on, and a task suite it cannot find. The key-and-door maze needs no
sandbox service; the policy is the tiny model's folder."""

from __future__ import annotations

import json

import torch

from lightning_agentrl.__main__ import main
from tests.test_keydoor import MAP

SMALL = ["--engine.max_new_tokens=16", "--env.max_turns=2", "--trainer.threads=1", "--tracking.enabled=false"]


def maze(tmp_path):
    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    return ["--env.kind=keydoor", f"--env.tasks={tasks}"]


def test_evaluate_records_and_prints_how_episodes_ended_and_warns_when_timeouts_decide_the_score(
        tmp_path, tiny_model_path, capsys):
    out = tmp_path / "evaluation"
    torch.set_num_threads(2)
    code = main(["evaluate", str(tiny_model_path), "--split", "all", "--samples", "2", "--out", str(out),
                 *maze(tmp_path), *SMALL, "--env.generation_timeout_s=0.0001"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert torch.get_num_threads() == 1  # --trainer.threads, as in fit
    scores = json.loads((out / "evaluation.json").read_text())
    assert scores["episodes"] == 4
    assert scores["terminations"] == {"timeout": 4} and scores["timeouts"] == {"generation": 4}
    (warning,) = scores["warnings"]
    assert warning.startswith("4 of 4 scored episodes timed out: 4 generation (env.generation_timeout_s=0.0001 s)")
    assert f"warning: {warning}" in captured.err.splitlines()
    assert "  ended       timeout 4 (generation 4)" in captured.out.splitlines()
    # the progress display: episodes done of the total, success and timeouts so far
    assert "4/4 episodes success 0.000  timeouts 4" in captured.err, captured.err[-2000:]


def test_evaluate_without_timeouts_prints_no_warning(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "evaluation"
    assert main(["evaluate", str(tiny_model_path), "--split", "all", "--samples", "1", "--out", str(out),
                 *maze(tmp_path), *SMALL]) == 0
    captured = capsys.readouterr()
    scores = json.loads((out / "evaluation.json").read_text())
    assert scores["warnings"] == [] and "warning:" not in captured.err
    assert sum(scores["terminations"].values()) == 2 and "timeout" not in scores["terminations"]


def test_the_default_task_suite_exists_and_a_missing_one_is_named_as_env_tasks(tmp_path, tiny_model_path, capsys,
                                                                                monkeypatch):
    from lightning_agentrl.settings import Settings
    from tests.fitting import REPO

    assert (REPO / Settings().env.tasks).is_dir()  # from the repository's root, where the commands run
    monkeypatch.chdir(tmp_path)  # elsewhere the default does not resolve
    assert main(["evaluate", str(tiny_model_path), "--samples", "1", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: env.tasks: task suite or task folder not found: tasks/learn (the default; set "
                          "--env.tasks or --config)"), err

"""The learning and comparison benchmarks run end to end (at a size of a few episodes) and write
the records the README cites; the numbers themselves come from ``make learn`` / ``make compare-*``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["--trainer.max_steps=2", "--rollout.groups_per_step=1", "--rollout.group_size=2", "--engine.max_new_tokens=24"]


def run_benchmark(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_compare_writes_both_arms_at_equal_budget(tmp_path):
    first = tmp_path / "first"
    run_benchmark("benchmarks/compare.py", "mask", "--seeds", "0", "1", "--root", str(first), "--out-dir", str(tmp_path),
                  "--warm-start-steps", "2", "--eval-samples", "1", "--eval-every", "1", "--", *TINY)
    record = json.loads((tmp_path / "compare_mask.json").read_text())
    assert [(r["arm"], r["seed"]) for r in record["runs"]] == [
        ("mask on", 0), ("mask off", 0), ("mask on", 1), ("mask off", 1)]
    assert {r["episodes"] for r in record["runs"]} == {2 * 1 * 2} == {record["episodes_per_run"]}
    for run in record["runs"]:
        assert [h["step"] for h in run["success_per_step"]] == [0, 1, 2]
        assert len(run["train_reward_per_step"]) == 2
    for arm, summary in record["summary"].items():
        finals = [r["final_success"] for r in record["runs"] if r["arm"] == arm]
        assert summary["final_success"] == finals
        assert abs(summary["final_success_mean"] - sum(finals) / 2) < 1e-12
        assert [p["step"] for p in summary["success_per_step"]] == [0, 1, 2]
    rows = (tmp_path / "compare_mask.md").read_text().splitlines()
    assert [row.split("|")[2].strip() for row in rows] == ["mask on", "mask off"]


def test_learn_writes_the_record_and_the_figure(tmp_path):
    out = tmp_path / "learn.json"
    run_benchmark("benchmarks/learn_cpu.py", "--run-dir", str(tmp_path / "run"), "--out", str(out),
                  "--warm-start-steps", "2", "--eval-every", "1", "--eval-samples", "1", "--target", "0.0", "--", *TINY)
    record = json.loads(out.read_text())
    history = record["success_per_step"]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert record["baseline_success"] == history[0]["success"] and record["final_success"] == history[-1]["success"]
    assert all(h["episodes"] == 20 for h in history)  # 20 held-out tasks x 1 sample
    minutes = [h["minutes"] for h in history]
    assert minutes == sorted(minutes) and 0 < minutes[-1] <= record["wall_time_s"] / 60
    assert record["first_at_target"] == history[0]  # target 0: the baseline already reaches it
    assert record["seed"] == 0 and "benchmarks/learn_cpu.py" in record["command"]
    assert len(record["train_reward_per_step"]) == 2
    assert out.with_suffix(".png").stat().st_size > 0


def test_peer_benchmark_help_and_argument_errors():
    help_text = run_benchmark("benchmarks/peer_trl.py", "--help").stdout
    assert "--steps" in help_text and "--rounds" in help_text and "--side" not in help_text and "--tasks" not in help_text
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--warmup", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--warmup must be at least 1" in done.stderr
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--rounds", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr


def test_peer_environment_loads_by_dotted_path_and_scores_a_completion(tmp_path):
    import asyncio

    from benchmarks.peer_env import write_tasks
    from lightning_agentrl.envs.registry import env_class

    cls = env_class("benchmarks.peer_env:RepeatDigitEnv")
    tasks = cls.load_tasks(write_tasks(tmp_path / "digits.jsonl", ["3", "8"]), split="train")
    assert [(t.id, t.digit) for t in tasks] == [("d0", "3"), ("d1", "8")]
    env = cls(tasks[1])
    assert asyncio.run(env.reset()) == [{"role": "user", "content": "Repeat the digit 8:"}]
    hit, miss = asyncio.run(env.step("sure: 8")), asyncio.run(cls(tasks[1]).step("3 3 3"))
    assert (hit.reward, hit.done, hit.observation) == (1.0, True, "")
    assert (miss.reward, miss.done) == (0.0, True)

"""The learning and comparison benchmarks run end to end (at a size of a few episodes) and write
the records the README cites; the numbers themselves come from ``make learn`` / ``make compare-*``."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.record import PROVENANCE_KEYS, RUN_KEYS
from lightning_agentrl.settings import TorchEngineSettings

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
    assert record["complete"] and record["score"] == "success"
    assert [(r["arm"], r["seed"]) for r in record["runs"]] == [
        ("mask on", 0), ("mask off", 0), ("mask on", 1), ("mask off", 1)]
    assert {r["episodes"] for r in record["runs"]} == {2 * 1 * 2} == {record["episodes_per_run"]}
    for run in record["runs"]:
        assert [h["step"] for h in run["curve"]] == [0, 1, 2]
        assert all(h["score"] == h["success"] for h in run["curve"])
        assert len(run["train_reward_per_step"]) == 2
    for arm, summary in record["summary"]["arms"].items():
        finals = [r["final"] for r in record["runs"] if r["arm"] == arm]
        assert summary["final"] == finals
        assert abs(summary["final_mean"] - sum(finals) / 2) < 1e-12
        assert [p["step"] for p in summary["per_step"]] == [0, 1, 2]
    rows = (tmp_path / "compare_mask.md").read_text().splitlines()
    assert [row.split("|")[2].strip() for row in rows] == ["mask on", "mask off", "mask off - mask on (paired, per seed)"]
    # each run carries its MLflow diagnostics: the values its own store holds, and the arm's mean of them
    from mlflow.tracking import MlflowClient

    for run in record["runs"]:
        run_dir = Path(run["run_dir"])
        client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
        entropy = [m.value for m in client.get_metric_history((run_dir / "mlflow_run_id.txt").read_text().strip(),
                                                                "policy/entropy")]
        assert len(entropy) == 2 and run["diagnostics"]["policy/entropy"]["mean"] == sum(entropy) / 2
        assert run["diagnostics"]["policy/entropy"]["max"] == max(entropy)
    for arm, summary in record["summary"]["arms"].items():
        means = [r["diagnostics"]["policy/entropy"]["mean"] for r in record["runs"] if r["arm"] == arm]
        assert abs(summary["diagnostics"]["policy/entropy"]["mean"] - sum(means) / 2) < 1e-12
        assert summary["diagnostics"]["policy/entropy"]["runs"] == 2


def test_a_rooms_comparison_pairs_arms_by_seed_and_resumes_from_its_finished_runs(tmp_path):
    argv = ["benchmarks/compare.py", "rooms_truncation", "--seeds", "1", "--root", str(tmp_path / "runs"),
            "--out-dir", str(tmp_path), "--rooms-warm-start-steps", "2", "--eval-samples", "2", "--eval-every", "1",
            "--", *TINY[:3], "--engine.max_new_tokens=4"]
    run_benchmark(*argv)
    record = json.loads((tmp_path / "compare_rooms_truncation.json").read_text())
    assert record["warm_start"]["kind"] == "rooms" and record["config"] == "configs/credit_truncation.yaml"
    assert record["seed"] == [1] and record["overrides"][-4:] == [*TINY[:3], "--engine.max_new_tokens=4"]
    assert record["score"] == "solved" and record["complete"]
    runs = {(r["arm"], r["seed"]): r for r in record["runs"]}
    assert set(runs) == {("reward 0", 1), ("compact filter", 1)}
    for run in runs.values():
        assert [h["step"] for h in run["curve"]] == [0, 1, 2]
        assert all(h["score"] == h["solved"] <= h["success"] for h in run["curve"])  # the porch pays 0.25
        assert sum(run["late_endings"].values()) == 2 * 2  # 2 steps x 1 group x 2 episodes
        assert {e: sum(t.values()) for e, t in run["late_turns"].items()} == run["late_endings"]
    paired = record["summary"]["pairs"]["compact filter - reward 0"]
    assert paired["per_seed"] == [runs[("compact filter", 1)]["final"] - runs[("reward 0", 1)]["final"]]
    assert paired["std"] is None and "± n/a" in (tmp_path / "compare_rooms_truncation.md").read_text()
    rows = (tmp_path / "compare_rooms_truncation.md").read_text().splitlines()
    assert [row.split("|")[2].strip() for row in rows][:2] == ["reward 0", "compact filter"]
    # a second call with the same root reuses every finished run (no run folder is trained again)
    stamps = {p: p.stat().st_mtime for p in (tmp_path / "runs").glob("*/compare_run.json")}
    run_benchmark(*argv)
    assert len(stamps) == 2 and {p: p.stat().st_mtime for p in stamps} == stamps
    assert json.loads((tmp_path / "compare_rooms_truncation.json").read_text())["runs"] == record["runs"]
    # --no-run writes what is finished and says it is not complete (seed 2 never ran)
    own = argv.index("--")
    run_benchmark(*argv[:4], "2", *argv[4:own], "--no-run", *argv[own:])  # --seeds 1 2
    partial = json.loads((tmp_path / "compare_rooms_truncation.json").read_text())
    assert partial["runs"] == record["runs"] and partial["seeds"] == [1, 2] and not partial["complete"]
    assert not list((tmp_path / "runs").glob("*seed2"))
    # a comparison put together from two machines: a root where nothing ran takes the earlier record's runs
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(record))
    elsewhere = [*argv[:5], str(tmp_path / "elsewhere"), *argv[6:own], "--no-run", "--runs-from", str(earlier)]
    run_benchmark(*elsewhere, *argv[own:])
    merged = json.loads((tmp_path / "compare_rooms_truncation.json").read_text())
    assert [{k: v for k, v in r.items() if k != "commit"} for r in merged["runs"]] == record["runs"]
    assert {r["commit"] for r in merged["runs"]} == {record["commit"]} and merged["complete"]
    record["warm_start"]["steps"] = 3  # another warm start: other weights, refused
    earlier.write_text(json.dumps(record))
    done = subprocess.run([sys.executable, *elsewhere, *argv[own:]], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "its warm start" in done.stderr and "is not this one's" in done.stderr
    record["warm_start"]["steps"] = 2
    # a run recorded before records carried diagnostics gets them from its MLflow store; --no-run only reads
    old = tmp_path / "runs" / "reward_0-seed1" / "compare_run.json"
    kept = json.loads(old.read_text())
    assert set(kept["diagnostics"]) >= {"policy/entropy", "policy/grad_norm"}
    stripped = json.dumps({k: v for k, v in kept.items() if k != "diagnostics"})
    old.write_text(stripped)
    run_benchmark(*argv[:own], "--no-run", *argv[own:])
    assert old.read_text() == stripped
    rewritten = json.loads((tmp_path / "compare_rooms_truncation.json").read_text())
    assert [r["diagnostics"] for r in rewritten["runs"]] == [r["diagnostics"] for r in record["runs"]]
    # a store that is another run's is refused, naming both
    other = tmp_path / "runs" / "compact_filter-seed1"
    (other / "mlflow_run_id.txt").write_text((old.parent / "mlflow_run_id.txt").read_text())
    (other / "mlflow.db").write_bytes((old.parent / "mlflow.db").read_bytes())
    (other / "compare_run.json").write_text(json.dumps({k: v for k, v in json.loads(
        (other / "compare_run.json").read_text()).items() if k != "diagnostics"}))
    done = subprocess.run([sys.executable, *argv[:own], "--no-run", *argv[own:]], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode != 0 and "holds the run 'reward_0-seed1', not this folder's ('compact_filter-seed1')" in (
        done.stderr)


def test_run_diagnostics_take_one_value_per_step_and_leave_nan_steps_out(tmp_path):
    """A resumed run logs its replayed steps again (the latest counts); NaN steps are counted, not averaged."""
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare import run_diagnostics

    run_dir = tmp_path / "arm-seed0"
    run_dir.mkdir()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("e"), run_name=run_dir.name)
    (run_dir / "mlflow_run_id.txt").write_text(run.info.run_id)
    for step in range(12):
        client.log_metric(run.info.run_id, "m", float(step), step=step, timestamp=1000 + step)
    for step in (10, 11):  # replayed after a resume: these values replace the first ones
        client.log_metric(run.info.run_id, "m", 100.0, step=step, timestamp=2000 + step)
    client.log_metric(run.info.run_id, "m", float("nan"), step=12, timestamp=3000)
    got = run_diagnostics(run_dir, ["m", "never logged"])
    assert set(got) == {"m"} and got["m"]["nan_steps"] == 1 and got["m"]["max"] == 100.0
    assert got["m"]["mean"] == (sum(range(10)) + 200.0) / 12
    assert got["m"]["late"] == (sum(range(3, 10)) + 200.0) / 9  # steps 3..12, step 12 NaN
    assert run_diagnostics(tmp_path, ["m"]) == {}  # no store: nothing to read


def test_learn_writes_the_record_and_the_figure(tmp_path):
    out = tmp_path / "learn.json"
    run_benchmark("benchmarks/learn_cpu.py", "--run-dir", str(tmp_path / "run"), "--out", str(out),
                  "--warm-start-steps", "2", "--eval-every", "3", "--eval-samples", "1", "--target", "0.0", "--",
                  *TINY[1:], "--trainer.max_steps=4")
    record = json.loads(out.read_text())
    history = record["success_per_step"]
    assert [h["step"] for h in history] == [0, 3, 4]  # the warm start, every 3 steps, the last
    snapshots = sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir())
    assert snapshots == ["step_000003", "step_000004"]  # evaluated after training, from these folders
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run_id = (tmp_path / "run" / "mlflow_run_id.txt").read_text().strip()
    step_s = {m.step: m.value for m in client.get_metric_history(run_id, "time/step_s")}
    timings = record["stage_timings"]  # steps after the first
    later = [v for step, v in step_s.items() if step > 0]
    assert timings["time/step_s"] == round(sum(later) / len(later), 3)
    assert {"time/wait_rollouts_s", "time/scoring_s", "time/forward_backward_s"} <= set(timings)
    # training minutes: the warm start's own time at step 0, then up to each save (no evaluation inside):
    # at least the warm start and the steps before the save, at most the warm start and all of fit
    warm_s, ordered = record["warm_start"]["seconds"], [step_s[step] for step in sorted(step_s)]
    assert history[0]["minutes"] == round(warm_s / 60, 2)
    assert history[0]["seconds"] == round(warm_s, 1)
    assert all(abs(h["seconds"] / 60 - h["minutes"]) <= 0.0051 for h in history)  # the same time, unrounded
    assert warm_s + sum(ordered[:3]) - 0.6 <= history[1]["minutes"] * 60 <= history[2]["minutes"] * 60
    assert warm_s + sum(ordered) - 0.6 <= history[2]["minutes"] * 60 <= record["training_time_s"] + 0.6
    assert record["training_time_s"] <= warm_s + record["rl_wall_time_s"]
    import torch
    from safetensors.torch import load_file

    last, final = load_file(str(tmp_path / "run" / "snapshots" / "step_000004" / "model.safetensors")), \
        load_file(str(tmp_path / "run" / "policy" / "model.safetensors"))
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in last)
    eval_success = {m.step: m.value for m in client.get_metric_history(run_id, "eval/success")}
    assert eval_success == {h["step"]: h["success"] for h in history}
    # one uninterrupted run: a folder that holds one is refused before any work
    again = subprocess.run([sys.executable, "benchmarks/learn_cpu.py", "--run-dir", str(tmp_path / "run"), "--out",
                            str(tmp_path / "again.json"), "--", *TINY[1:]], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 2 and "already holds a run" in again.stderr and not (tmp_path / "again.json").exists()
    bad = subprocess.run([sys.executable, "benchmarks/learn_cpu.py", "--eval-every", "0", "--run-dir",
                          str(tmp_path / "fresh")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--eval-every must be at least 1" in bad.stderr and not (tmp_path / "fresh").exists()
    assert record["baseline_success"] == history[0]["success"] and record["final_success"] == history[-1]["success"]
    assert all(h["episodes"] == 20 for h in history)  # 20 held-out tasks x 1 sample
    minutes = [h["minutes"] for h in history]
    assert minutes == sorted(minutes) and 0 < minutes[-1] <= record["wall_time_s"] / 60
    assert record["first_at_target"] == history[0]  # target 0: the baseline already reaches it
    assert record["seed"] == 0 and "benchmarks/learn_cpu.py" in record["command"]
    assert record["config"] == "configs/learn_cpu.yaml" and record["overrides"] == [*TINY[1:], "--trainer.max_steps=4"]
    assert len(record["train_reward_per_step"]) == 4
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
    assert "--threads" in help_text
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--threads", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--threads must be at least 1" in done.stderr


def _peer_record(loads: list[tuple[float, float]], threads: tuple[int, int]) -> dict:
    """A peer_trl record of one round per side: (before, after) 1-minute loads and torch threads, TRL first."""
    from benchmarks.peer_trl import overloaded_runs, thread_counts

    sides = [{"completion_tokens_per_s": 100.0, "median_step_s": 2.0,
              "rounds": [{"load_avg_1min": {"before": b, "after": a}, "torch_threads": n}]}
             for (b, a), n in zip(loads, threads, strict=True)]
    overloaded = overloaded_runs(*sides, cores=2)
    return {"shape": {"prompts": 8, "generations": 8, "max_new_tokens": 64, "torch_threads": 2, "rounds_per_side": 1},
            "trl": sides[0], "project": sides[1], "ratio_project_over_trl": 1.0, "cores": 2,
            "load_over_cores": bool(overloaded), "overloaded_runs": overloaded,
            "torch_threads": thread_counts(*sides)}


def test_peer_benchmark_flags_a_load_above_the_cores_and_unequal_threads():
    from benchmarks.peer_trl import summary_line

    idle = _peer_record([(0.1, 1.9), (1.0, 2.0)], threads=(2, 2))  # its own 2 threads on 2 cores: not over
    assert not idle["load_over_cores"] and idle["torch_threads"] == {"trl": [2], "project": [2], "same": True}
    assert "WARNING" not in summary_line(idle) and "load 0.1 to 2.0 on 2 cores" in summary_line(idle)
    busy = _peer_record([(1.0, 2.0), (6.5, 7.9)], threads=(2, 1))
    assert busy["load_over_cores"] and busy["overloaded_runs"] == ["project round 1"]
    line = summary_line(busy)
    assert "WARNING: load average above the 2 cores in project round 1" in line
    assert "WARNING: the sides ran with different torch threads" in line and not busy["torch_threads"]["same"]


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


def test_latency_environment_draws_the_same_heavy_tailed_sleeps_per_task_and_episode():
    from benchmarks.latency_env import LatencyTask, latencies

    task = LatencyTask("t0", "4", turns=400, latency_median_s=0.2, latency_sigma=1.0)
    first = latencies(task, 0)
    assert first == latencies(task, 0) and first != latencies(task, 1)
    assert all(s > 0 for s in first)
    ordered = sorted(first)
    assert 0.15 < ordered[200] < 0.27  # median about 0.2 s
    assert ordered[-1] > 5 * ordered[200]  # a heavy right tail
    assert latencies(LatencyTask("t1", "4", turns=3), 0) == [0.0, 0.0, 0.0]


def test_async_benchmark_runs_both_bounds_through_the_sandbox_and_writes_ratios(tmp_path):
    out = tmp_path / "async.json"
    line = run_benchmark("benchmarks/async_bench.py", "--bounds", "0,1", "--steps", "1", "--warmup", "1", "--groups",
                         "1", "--group-size", "2", "--turns", "1", "--max-new-tokens", "4", "--latency-median", "0.05",
                         "--threads", "1", "--out", str(out)).stdout.strip().splitlines()[-1]
    record = json.loads(out.read_text())
    assert line.startswith("async (1x2 episodes x 1 turns") and "bound 1:" in line
    sync, bound1 = record["arms"]
    assert (sync["max_staleness"], bound1["max_staleness"]) == (0, 1) and sync["ratio"] == 1.0
    for a in record["arms"]:
        assert a["episodes_per_step"] == 2 and len(a["step_s"]) == 1 and a["mean_step_s"] > 0
        assert a["tool_s_mean_per_episode"] > 0  # each action slept in a real sandbox
        assert "--rollout.max_in_flight=4" in a["overrides"]  # the same episodes in flight at every bound
        assert abs(sum(a["profile"].values()) - 1) < 0.01 and a["load_avg_1min"]["before"] >= 0
    assert abs(bound1["ratio"] - sync["mean_step_s"] / bound1["mean_step_s"]) < 0.01
    model = record["ideal_model"]
    assert model["sync_step_s"] == sync["mean_step_s"] and 0 <= model["trainer_s"] <= model["sync_step_s"]
    assert bound1["ideal_ratio"] == round(min(2, model["sync_step_s"] / model["trainer_s"]), 2)


def test_packing_benchmark_compares_both_paths_on_the_same_tokens(tmp_path):
    out = tmp_path / "packing.json"
    run_benchmark("benchmarks/packing_bench.py", "--sequences", "6", "--median-length", "12", "--rows", "3",
                  "--micro-batch-tokens", "64", "--repeats", "1", "--threads", "1", "--out", str(out))
    record = json.loads(out.read_text())
    lengths = record["lengths"]["all"]
    assert len(lengths) == 6 and record["tokens"] == sum(lengths) and min(lengths) >= 8
    padded = sum(3 * max(lengths[i : i + 3]) for i in (0, 3))
    assert record["padded"]["tokens_with_padding"] == padded and record["padded"]["decoder_calls"] == 2
    assert record["padded"]["padding_fraction"] == round(1 - sum(lengths) / padded, 3)
    assert record["packed"]["decoder_calls"] >= 1
    for side in ("padded", "packed"):
        assert record[side]["seconds"] > 0
        assert abs(record[side]["tokens_per_s"] - record["tokens"] / record[side]["seconds"]) / record[side]["tokens_per_s"] < 0.01
    assert abs(record["speedup"] - record["padded"]["seconds"] / record["packed"]["seconds"]) < 0.02


def test_scaling_benchmark_doubles_an_axis_and_reports_the_exponent(tmp_path):
    out = tmp_path / "scaling.json"
    done = run_benchmark("benchmarks/scaling_bench.py", "--axes", "groups", "--steps", "1", "--warmup", "1", "--groups",
                         "1", "--group-size", "2", "--max-new-tokens", "4", "--threads", "1", "--pack-tokens", "64,128,256",
                         "--segment-tokens", "32", "--out", str(out))
    record = json.loads(out.read_text())
    # the train phase's attention check: packs of 32-token sequences, the training path and the whole-pack reference
    from benchmarks.scaling_bench import slope

    packs = record["packs"]
    assert [(p["pack_tokens"], p["segment_tokens"]) for p in packs] == [(64, 32), (128, 32), (256, 32)]
    assert all(p["train_s"] > 0 and p["block_mask_s"] > 0 for p in packs)
    assert record["exponent_train_vs_pack_tokens"] == round(slope([64, 128, 256], [p["train_s"] for p in packs]), 2)
    assert record["exponent_block_mask_reference"] == round(slope([64, 128, 256], [p["block_mask_s"] for p in packs]), 2)
    assert f"train phase on packs of 64 to 256 tokens: exponent {record['exponent_train_vs_pack_tokens']}" in done.stdout
    base, doubled = record["runs"]
    assert (base["shape"]["groups"], doubled["shape"]["groups"]) == (1, 2)
    assert doubled["tokens_per_step"] > base["tokens_per_step"] > 0 and base["median_step_s"] > 0
    assert record["exponent_per_axis"]["groups"] == round(math.log2(doubled["median_step_s"] / base["median_step_s"]), 2)
    assert set(record["exponent_per_axis"]) == {"groups"}
    done = subprocess.run([sys.executable, "benchmarks/scaling_bench.py", "--pack-tokens", "96,128", "--segment-tokens",
                           "64"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "each a multiple of --segment-tokens" in done.stderr


def test_peer_profile_shares_add_up_to_the_median_step():
    from benchmarks.peer_trl import profile

    stages = [{"episode_s_max": 2.0 + i, "between_steps": 3.0 + i, "forward_and_rest": 0.5, "backward": 1.0,
               "optimizer_and_logging": 0.5, "generation_s_mean": 1.5, "tool_s_mean": 0.0, "tokens": 100 * i}
              for i in range(3)]
    summary = profile({"stages": stages, "step_s": [6.0, 6.0, 6.0]})  # 3 + (4 - 3) + 0.5 + 1 + 0.5
    assert summary["median_step_s"] == 6.0 and summary["tokens_per_step"] == 100
    shares = {s["stage"].split(" ")[0]: s["share"] for s in summary["stages"]}
    assert shares["rollout"] == 0.5 and shares["backward"] == 0.167 and abs(sum(shares.values()) - 1) < 0.01
    assert [s["seconds"] for s in summary["stages"]] == sorted((s["seconds"] for s in summary["stages"]), reverse=True)


def test_peer_model_option_reaches_both_sides_and_names_its_record():
    from benchmarks.peer_trl import parse_args, project_overrides

    tiny = parse_args([])
    assert tiny.model == "tiny" and tiny.out.endswith("benchmarks/results/peer_trl/peer_trl.json")
    real = parse_args(["--model", "smollm2-135m-instruct", "--tasks", "t.jsonl"])
    assert real.out.endswith("benchmarks/results/peer_trl/peer_trl_smollm2.json")
    assert "--model.path=smollm2-135m-instruct" in project_overrides(real, Path("run"))


def test_engine_compare_refuses_zero_threads():
    done = subprocess.run([sys.executable, "benchmarks/engine_compare.py", "--threads", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--threads must be at least 1" in done.stderr


def test_peer_trl_profile_splits_the_median_step_into_stages():
    from benchmarks.peer_trl import trl_profile

    stages = [{"generation": g, "scoring_and_rest_of_rollout": 0.5, "forward": 2.0, "backward": 3.0, "optimizer": 0.2}
              for g in (9.0, 4.0, 1.0)]
    summary = trl_profile({"stages": stages, "step_s": [15.0, 10.0, 6.0]})  # the median step is the second
    seconds = {s["stage"].split(" ")[0]: s["seconds"] for s in summary["stages"]}
    assert summary["median_step_s"] == 10.0 and seconds["generation"] == 4.0 and seconds["rest"] == 0.3
    assert abs(sum(s["share"] for s in summary["stages"]) - 1) < 0.01


def test_peer_trl_from_refuses_a_record_of_another_model_or_shape(tmp_path):
    record = {"model": {"path": "tiny"}, "seed": 0, "trl": {"settings": {"bf16": False}},
              "shape": {"torch_threads": 1, "warmup_steps": 1, "measured_steps": 3}}
    (tmp_path / "r.json").write_text(json.dumps(record))
    (tmp_path / "r_profile.json").write_text(json.dumps({"trl": {}}))
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--trl-from", str(tmp_path / "r.json"), "--model",
                           "smollm2-135m-instruct", "--threads", "1", "--steps", "3"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "error: --trl-from:" in done.stderr and "'model': 'tiny'" in done.stderr
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--trl-from", str(tmp_path / "r.json"), "--threads",
                           "1", "--steps", "3", "--trl-bf16"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "'bf16': False" in done.stderr  # the same model and shape, not the same precision
    done = subprocess.run([sys.executable, "benchmarks/peer_trl.py", "--trl-from", str(tmp_path / "none.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error: --trl-from: cannot read" in done.stderr


def test_sampling_benchmark_times_both_samplers_on_the_same_distributions(tmp_path):
    out = tmp_path / "sampling.json"
    done = run_benchmark("benchmarks/sampling_bench.py", "--rows", "3", "--vocab", "50", "--steps", "4",
                         "--repeats", "1", "--threads", "1", "--out", str(out))
    record = json.loads(out.read_text())
    assert (record["rows"], record["vocab"], record["steps"]) == (3, 50, 4)
    ms = record["ms_per_step"]
    assert set(ms) == {"per_row", "batched"} and all(v > 0 for v in ms.values())
    # the speedup is kept to 2 decimals and each time to 3: allow half a unit of the first, 1% for the second
    ratio = ms["per_row"] / ms["batched"]
    assert abs(record["speedup"] - ratio) <= 0.005 + 0.01 * ratio
    assert f"{record['speedup']}x" in done.stdout


def test_peer_project_side_overrides_reach_its_settings_and_the_summary():
    from benchmarks.peer_trl import parse_args, project_overrides, summary_line

    args = parse_args(["--project-set", "rollout.max_staleness=1", "--tasks", "t.jsonl"])
    overrides = project_overrides(args, Path("run"))
    assert overrides[-1] == "--rollout.max_staleness=1"  # after the shared shape: it wins
    record = {**_peer_record([(0.1, 1.0), (0.1, 1.0)], threads=(2, 2)), "project_set": args.project_set}
    assert summary_line(record).endswith("project side with rollout.max_staleness=1")


def test_scoring_benchmark_times_the_lazy_and_the_eager_peer_on_a_solved_task(tmp_path):
    out = tmp_path / "scoring.json"
    run_benchmark("benchmarks/scoring_bench.py", "--rounds", "1", "--out", str(out))
    record = json.loads(out.read_text())  # written only when every round scored the solved task 1
    assert record["rounds"] == 1 and set(record["median_s"]) == {"lazy_peer", "eager_peer"}
    assert all(0 < v < 60 for v in record["median_s"].values())
    assert record["saved_fraction"] == 1 - record["median_s"]["lazy_peer"] / record["median_s"]["eager_peer"]
    assert set(record["cpu_s_mean"]) == {"lazy_peer", "eager_peer"}
    assert all(v > 0 for v in record["cpu_s_mean"].values())  # a scoring starts processes: CPU is spent
    starts = record["starts_cpu_ms"]
    assert set(starts) == {"judge_python_-I", "python_-I_-S", "launcher_marshal", "launcher_json",
                           "launcher_marshal_signal", "judge_imports", "judge_imports_before"}
    assert all(v > 0 for v in starts.values())  # each is a real process start
    done = subprocess.run([sys.executable, "benchmarks/scoring_bench.py", "--rounds", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr


def test_http_client_benchmark_measures_each_client_on_the_same_requests(tmp_path):
    out = tmp_path / "http.json"
    run_benchmark("benchmarks/http_client_bench.py", "--in-flight", "4", "--rounds", "2", "--out", str(out))
    record = json.loads(out.read_text())
    cpu = record["client_cpu_ms_per_request"]
    assert {"sandbox_client", "httpx2"} <= set(cpu) and all(0 < v < 1000 for v in cpu.values())
    assert (record["in_flight"], record["rounds"], record["connections"]) == (4, 2, 64)
    done = subprocess.run([sys.executable, "benchmarks/http_client_bench.py", "--in-flight", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "must be at least 1" in done.stderr


def test_policy_snapshots_save_each_step_once_and_never_step_zero(tmp_path):
    """A skipped update leaves global_step where it was: no second save of that step, and no save at
    step 0 (the warm start is step 0); on_train_end adds the last step only when it is new."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.learn_cpu import PolicySnapshots

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    module = SimpleNamespace(policy=LlamaForCausalLM(config))
    import time

    started = time.monotonic()
    snapshots = PolicySnapshots(tmp_path, 2, None, started=started, offset_s=5.0)
    for step in (0, 1, 2, 2, 3):  # a skipped first batch, then step 2 twice (a skipped update)
        snapshots.on_train_batch_end(SimpleNamespace(global_step=step, is_global_zero=True), module, None, None, 0)
    snapshots.on_train_end(SimpleNamespace(global_step=3, is_global_zero=True), module)
    snapshots.on_train_end(SimpleNamespace(global_step=3, is_global_zero=True), module)
    assert [s["step"] for s in snapshots.saved] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    elapsed = time.monotonic() - started  # offset, then the time since started, at each save
    assert 5.0 < snapshots.saved[0]["seconds"] <= snapshots.saved[1]["seconds"] <= 5.0 + elapsed


def test_format_drift_names_what_a_run_lacks_before_loading_anything(tmp_path, capsys):
    sys.path.insert(0, str(REPO))
    from benchmarks.format_drift import main as format_drift

    (tmp_path / "warm_start").mkdir()
    (tmp_path / "snapshots" / "step_000010").mkdir(parents=True)
    assert format_drift([str(tmp_path), "--before", "10", "--after", "20"]) == 2
    err = capsys.readouterr().err
    assert "snapshots/step_000020" in err and "trajectories/step_000020.jsonl" in err
    assert "snapshots/step_000010," not in err and "snapshots at steps [10]" in err


def test_lora_benchmark_counts_what_each_variant_holds_and_sends(tmp_path):
    from lightning_agentrl.plan import ModelShape

    out = tmp_path / "lora.json"
    run_benchmark("benchmarks/lora_bench.py", "--model-path", "random", "--layers", "1", "--hidden", "128", "--intermediate", "256",
                  "--vocab", "512", "--tokens", "32", "--episodes", "2", "--steps", "1", "--threads", "1",
                  "--out", str(out))
    record = json.loads(out.read_text())
    shape = ModelShape(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=64, tie_word_embeddings=True)
    params, adapters = shape.num_parameters(), shape.lora_parameters(8)
    full, lora = record["full"], record["lora"]
    assert full["trainable_parameters"] == params and lora["trainable_parameters"] == adapters
    assert full["optimizer_state_bytes"] == 8 * params and lora["optimizer_state_bytes"] == 8 * adapters  # fp32 m, v
    assert full["sync_bytes"] == 4 * (params + 512 * 128)  # the tied head is sent under both names
    assert lora["sync_bytes"] == 4 * adapters
    assert record["ratios"]["sync_ratio"] == full["sync_bytes"] / lora["sync_bytes"]
    assert full["seconds_per_step"] > 0 and lora["peak_rss_bytes"] > 0
    assert set(lora["stages_cpu_s"]) == {"forward", "backward", "optimizer"} and lora["stages_cpu_s"]["forward"] > 0


def test_gateway_benchmark_times_both_arms_on_the_same_calls(tmp_path):
    out = tmp_path / "gateway.json"
    done = run_benchmark("benchmarks/gateway_bench.py", "--in-flight", "1", "2", "--calls", "2", "--tokens", "2",
                         "--out", str(out))
    record = json.loads(out.read_text())
    assert set(record["in_flight"]) == {"1", "2"} and "gateway vs engine directly" in done.stdout
    for in_flight, row in record["in_flight"].items():
        assert row["direct"]["calls"] == row["gateway"]["calls"] == 2 * int(in_flight)
        assert 0 < row["direct"]["p50_ms"] <= row["direct"]["p99_ms"] and row["p50_ratio"] > 0
        for arm in ("direct", "gateway"):  # every call is one prefill at most, and its 2 tokens one step at most
            assert 1 <= row[arm]["engine_prefills"] <= 2 * int(in_flight) and row[arm]["engine_steps"] <= 2 * int(in_flight)
        assert row["cpu_bound_ratio"]["one_core"] > row["cpu_bound_ratio"]["core_each"] > 0
    assert record["model"].startswith("tiny") and record["admission_window_ms"] == TorchEngineSettings().admission_window_ms
    assert record["note"].startswith("2 in flight, CPU per call")


# Outputs that are not records: a run's own summary inside its run folder, a side's half-record handed to
# the parent process, an analysis printed for one run. Everything a benchmark leaves under
# benchmarks/results/ goes through benchmarks/record.py:write_record.
NOT_RECORDS = {"compare.py": 2, "learn_cpu.py": 1, "learn_real.py": 2, "fit_runner.py": 1, "format_drift.py": 1, "peer_trl.py": 1,
               "record.py": 1}


def test_every_benchmark_writes_its_record_through_write_record():
    raw_writes = {}
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        count = script.read_text().count("write_text(json.dumps")
        if count:
            raw_writes[script.name] = count
    assert raw_writes == NOT_RECORDS


def _write_record_calls(script: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "write_record"]


UNSTATED: set[str] = set()


def test_every_benchmark_states_the_config_overrides_and_seed_of_its_record():
    """Checked in the source, before a run: a call that leaves one out would fail at the end of a long run."""
    calls = {}
    for script in sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "scripts").glob("*.py")]):
        for call in _write_record_calls(script):
            stated = {k.arg for k in call.keywords}
            calls.setdefault(script.name, []).append(stated >= set(RUN_KEYS) or "**" in ast.unparse(call))
    assert {name for name, ok in calls.items() if not all(ok)} == UNSTATED
    assert len(calls) >= 20


def test_records_are_filed_by_benchmark():
    """benchmarks/results/<benchmark>/<record>: <benchmark> is a script's name without ``_bench``
    (gpu: scripts/gpu_smoke.py); nothing lies loose in benchmarks/results/."""
    results = REPO / "benchmarks" / "results"
    assert [p.name for p in results.iterdir() if not p.is_dir()] == []
    scripts = {p.stem.removesuffix("_bench") for p in (REPO / "benchmarks").glob("*.py")} | {"gpu"}
    folders = {p.name for p in results.iterdir()}
    assert folders - scripts == set() and len(folders) >= 20
    assert [str(p) for p in results.rglob("*") if p.is_file() and len(p.relative_to(results).parts) != 2] == []


def test_every_record_carries_its_provenance():
    """Every record names its commit; one written through write_record also the dirty flag, the command and the
    load (records from before it lack them: git keeps what they measured). The config, overrides and seed are
    required by write_record itself (records written before it asked for them lack them)."""
    records = sorted((REPO / "benchmarks" / "results").rglob("*.json"))
    assert len(records) > 50
    missing = [str(p.relative_to(REPO)) for p in records if not json.loads(p.read_text()).get("commit")]
    assert missing == []
    stamped = [json.loads(p.read_text()) for p in records if "written_at" in json.loads(p.read_text())]
    assert len(stamped) >= 5 and [r["command"] for r in stamped if not set(PROVENANCE_KEYS) <= set(r)] == []


def test_write_record_stamps_provenance_and_keeps_the_records_own_keys(tmp_path):
    from benchmarks.record import write_record

    out = tmp_path / "sub" / "bench.json"
    written = write_record(out, {"figure": 1.5, "command": "python benchmarks/x.py --fast"}, argv=["benchmarks/x.py"],
                           config="configs/x.yaml", overrides=("--trainer.lr=1e-4",), seed=(0, 1))
    on_disk = json.loads(out.read_text())
    assert on_disk == written
    assert set(PROVENANCE_KEYS) | set(RUN_KEYS) <= set(on_disk)
    assert (on_disk["config"], on_disk["overrides"], on_disk["seed"]) == ("configs/x.yaml", ["--trainer.lr=1e-4"], [0, 1])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert on_disk["commit"] == head and isinstance(on_disk["dirty"], bool)
    assert on_disk["command"] == "python benchmarks/x.py --fast"  # the record's own command wins
    assert on_disk["figure"] == 1.5 and on_disk["cpus"] >= 1
    assert list(out.parent.iterdir()) == [out]  # no temporary file left behind
    with pytest.raises(TypeError, match="seed"):  # each benchmark says what applies, None included
        write_record(out, {}, config=None, overrides=None)
    from benchmarks.record import shared_overrides

    assert shared_overrides([["--a=1", "--b=2", "--c=3"], ["--c=3", "--a=1"]]) == ["--a=1", "--c=3"]
    assert shared_overrides([]) == []


def test_the_bench_suite_runs_every_ratio_benchmark_and_reads_each_record_it_names():
    from benchmarks.suite import ROWS, table_row

    makefile = (REPO / "Makefile").read_text()
    assert "$(PY) benchmarks/suite.py" in makefile.split("\nbench:")[1].split("\n\n")[0]
    scripts = {p.name for p in (REPO / "benchmarks").glob("*_bench.py")} | {"peer_trl.py", "engine_compare.py"}
    assert {row.argv[0] for row in ROWS} == scripts  # a new benchmark joins the suite (or this set)
    for row in ROWS:
        read = table_row(row)
        assert read["figure"] != "no record" and not read["figure"].startswith("unreadable"), (row.name, read)
        assert read["met"] in (True, False, None) and read["commit"] not in ("-", "?")
    done = run_benchmark("benchmarks/suite.py", "--table-only", "--only", "lora,sampling")
    assert "lora" in done.stdout and "sampling" in done.stdout and "gateway" not in done.stdout
    whole = run_benchmark("benchmarks/suite.py", "--table-only").stdout  # rows the suite does not run show too
    assert {row.name for row in ROWS if not row.in_suite} == {"peer_trl_smollm2"}
    assert "peer_trl_smollm2" in whole and "[own command: suite.py" in whole  # not eaten as rich markup
    slow = next(row for row in ROWS if not row.in_suite)
    assert table_row(slow)["figure"].endswith("[own command: suite.py --only peer_trl_smollm2]")
    bad = subprocess.run([sys.executable, "benchmarks/suite.py", "--only", "nope"], cwd=REPO, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown benchmark(s) ['nope']" in bad.stderr


@pytest.mark.parametrize("content", ["{not json", b"\xff\xfe\x00", "[1, 2]", '{"ratios": [1], "commit": null}', None])
def test_a_broken_record_reads_as_unreadable_in_the_suite_table(tmp_path, content):
    """One bad record must not throw away the table (and ``suite.json``) of a 30-minute suite."""
    from benchmarks.suite import ROWS, table_row

    path = tmp_path / "lora.json"
    if content is None:
        path.mkdir()  # a folder where the record should be
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    lora = next(row for row in ROWS if row.name == "lora")
    read = table_row(dataclasses.replace(lora, record=str(path)))
    assert read["figure"].startswith("unreadable record (") and read["met"] is None and read["commit"] == "?"


@pytest.mark.parametrize("project_set", [[], ["engine.kind=vllm"], ["algorithm.advantage=rloo", "engine.kind=vllm"]])
def test_peer_project_side_settings_load_with_another_engine_or_estimator(project_set):
    """The shared shape's torch-only (max_batch_size) and grpo-only (grpo_std) fields follow --project-set."""
    from benchmarks.peer_trl import parse_args, project_overrides
    from lightning_agentrl.settings import load_settings

    args = parse_args(["--tasks", "t.jsonl", *(a for p in project_set for a in ("--project-set", p))])
    overrides = [o for o in project_overrides(args, Path("run")) if not o.startswith(("--env.kind", "--env.tasks"))]
    settings = load_settings(overrides=overrides)
    kind = "vllm" if project_set else "torch"
    assert settings.engine.kind == kind and getattr(settings.engine, "max_batch_size", None) == (64 if kind == "torch" else None)
    assert getattr(settings.algorithm, "grpo_std", None) == ("sample" if settings.algorithm.advantage == "grpo" else None)

"""What a step of SmolLM2-135M-Instruct (``model.path: smollm2-135m-instruct``) costs on CPU, by stage.

    python benchmarks/real_cost.py [--steps 2] [--group-size 4] [--threads 1] [--learning-step] [-- --section.field=value ...]

Runs ``fit --config configs/smoke.yaml`` on the named model (the environment's built-in tool text, the
copy-the-key suite) in a subprocess and reports, per step, the stage seconds the run logs to MLflow
(``time/generation_s``, ``time/forward_backward_s``, ``time/optimizer_s``, ``time/weight_sync_s``,
``time/checkpoint_s``, ``time/step_s``), tokens and tokens per second, and the peak resident memory of the
training process (``ru_maxrss`` of the child) beside the host-memory plan's prediction for the episodes the
run played (``python -m lightning_agentrl plan ... --episode-tokens N``, N the longest step's mean episode).

The base model earns no reward on this suite, so every step takes the zero-gradient shortcut (no forward and
backward over the batch, ``module.py::_zero_gradient``). ``--learning-step`` adds a small entropy bonus
(``algorithm.entropy_coef=0.001``) so that each step runs the full forward and backward a step with reward
variance runs. Writes benchmarks/results/real_cost/real_cost.json (``real_cost_learning.json`` with ``--learning-step``)
and prints one line.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
KEYS = ("time/generation_s", "time/wait_rollouts_s", "time/forward_backward_s", "time/optimizer_s",
        "time/weight_sync_s", "time/checkpoint_s", "time/step_s", "throughput/tokens_per_s", "tokens/per_episode",
        "tokens/train", "policy/grad_norm", "reward/mean")


def overrides(args: argparse.Namespace) -> list[str]:
    """The settings the run uses on top of configs/smoke.yaml (the plan reads the same)."""
    return ["--model.path=smollm2-135m-instruct", "--env.system_prompt=null",
            f"--trainer.threads={args.threads}", f"--trainer.max_steps={args.steps}",
            f"--rollout.group_size={args.group_size}", "--rollout.groups_per_step=1",
            f"--rollout.max_in_flight={args.group_size}", "--env.generation_timeout_s=1200",
            *(["--algorithm.entropy_coef=0.001"] if args.learning_step else []), *args.overrides]


def run(args: argparse.Namespace, run_dir: Path) -> float:
    command = [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "configs/smoke.yaml",
               f"--run.dir={run_dir}", *overrides(args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fit failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def step_metrics(run_dir: Path) -> dict[str, list[float]]:
    """Each metric's values in step order (keyed by metric: not every metric is logged at the same step index)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    return {key: [round(m.value, 3) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
            for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--learning-step", action="store_true",
                        help="force the full forward and backward (algorithm.entropy_coef=0.001)")
    parser.add_argument("overrides", nargs="*", help="settings overrides after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="real-cost-") as tmp:
        run_dir = Path(tmp) / "run"
        wall_s = run(args, run_dir)
        steps = step_metrics(run_dir)
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    plan = planned(args, max(steps["tokens/per_episode"]))
    record = {"model": "smollm2-135m-instruct", "command": " ".join(sys.argv), "wall_s": round(wall_s, 1),
              "learning_step": args.learning_step, "peak_rss_gib": round(peak_gib, 2),
              "planned_peak_rss_gib": round(plan.peak_bytes / 2**30, 2),
              "measured_over_planned": round(peak_gib * 2**30 / plan.peak_bytes, 3),
              "planned_live_gib": round(plan.live_peak_bytes / 2**30, 2), "plan": plan.to_dict(),
              "load_avg_1min": round(os.getloadavg()[0], 2), "steps": steps}
    name = "real_cost_learning.json" if args.learning_step else "real_cost.json"
    path = REPO / "benchmarks" / "results" / "real_cost" / name
    overrides = ["--env.system_prompt=null", f"--trainer.threads={args.threads}", f"--trainer.max_steps={args.steps}",
                 f"--rollout.group_size={args.group_size}", *args.overrides]
    write_record(path, record, config="configs/smoke.yaml", overrides=overrides, seed=0)
    last = {key: values[-1] for key, values in steps.items() if values}
    print(f"{args.steps} steps in {wall_s:.0f} s, peak RSS {peak_gib:.2f} GiB (planned {plan.peak_bytes / 2**30:.2f}, "
          f"{record['measured_over_planned']}x), last step {last.get('time/step_s')} s "
          f"(generation {last.get('time/generation_s')}, forward+backward {last.get('time/forward_backward_s')}, "
          f"optimizer {last.get('time/optimizer_s')}); wrote {path}")


def planned(args: argparse.Namespace, episode_tokens: float):
    """The host-memory plan of the run's settings for episodes of the length it played."""
    from lightning_agentrl.plan import host_plan_for
    from lightning_agentrl.settings import load_settings

    settings = load_settings(REPO / "configs" / "smoke.yaml", overrides(args))
    return host_plan_for(settings, episode_tokens=max(1, round(episode_tokens)))


if __name__ == "__main__":
    main()

"""Proof that it learns: held-out success of the tiny model on the copy-the-key suite, on CPU.

    python benchmarks/learn_cpu.py                                  # make learn
    python benchmarks/learn_cpu.py --seed 1 -- --trainer.lr=2e-4    # settings overrides after --

1. Format-only warm start (`benchmarks/warm_start.py`): demonstrations read key.txt and write a
   RANDOM value, so the warm-started policy knows the tool-call format but succeeds only by chance;
   half of the demonstrations are generic ones outside the task (write a value named in the user
   message to note.txt), standing in for the copying a pretrained model can already do.
2. GRPO with ``configs/learn_cpu.yaml`` through the real stack (sandbox service on loopback, torch
   engine, Lightning, MLflow), starting from the warm-started weights.
3. Held-out evaluation on the ``test`` split of the policy saved every few steps (the warm start's
   is the baseline), after training: ``minutes`` is the training time at which each policy was saved
   (the warm start included), and no evaluation runs inside it.

Writes ``benchmarks/results/learn_cpu/learn_cpu.json`` (command, seed, wall times, success per step, training
reward per step, ``baseline_success``, ``final_success``) and ``learn_cpu.png`` (success vs step),
and logs both to the run's MLflow record.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import lightning as L
from typing_extensions import override

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.record import write_record  # noqa: E402
from benchmarks.warm_start import warm_start  # noqa: E402
from lightning_agentrl.callbacks.evaluation import HeldOutEvaluation  # noqa: E402
from lightning_agentrl.envs.learn_tasks import LearnSuiteSpec  # noqa: E402
from lightning_agentrl.envs.registry import load_env_tasks  # noqa: E402
from lightning_agentrl.settings import Settings, load_settings  # noqa: E402
from lightning_agentrl.tasks import load_tasks  # noqa: E402
from lightning_agentrl.trajectory import load_trajectories  # noqa: E402


def warm_started_model(
    settings: Settings,
    out_dir: Path,
    *,
    steps: int,
    seed: int,
    detour_prob: float = 0.0,
    echo_prob: float = 0.0,
    value_in_loss: bool = True,
) -> dict:
    """Run the format-only warm start (or reuse a finished one in ``out_dir``); return its record."""
    from lightning_agentrl.train import resolve_model_path

    record_file = out_dir / "warm_start.json"
    if record_file.exists():
        return json.loads(record_file.read_text())
    train_keys = [t.files["key.txt"].strip() for t in load_tasks(settings.env.tasks, split="train")]
    result = warm_start(
        resolve_model_path(settings),
        out_dir,
        train_keys,
        LearnSuiteSpec(),
        steps=steps,
        seed=seed,
        detour_prob=detour_prob,
        echo_prob=echo_prob,
        system_prompt=settings.env.system_prompt,
        value_in_loss=value_in_loss,
    )
    record = {"path": str(result.path), "steps": result.steps, "final_loss": result.final_loss, "seconds": result.seconds,
              "detour_prob": detour_prob, "echo_prob": echo_prob,
              "value_in_loss": value_in_loss, "seed": seed}
    record_file.write_text(json.dumps(record, indent=2))
    return record


def train_rewards(run_dir: Path) -> list[dict]:
    """Mean training reward per step, from the saved batches (all episodes, filtered ones too)."""
    rows = []
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        trajectories = load_trajectories(path)
        rows.append({"step": int(path.stem.split("_")[1]),
                     "reward": sum(t.reward for t in trajectories) / max(len(trajectories), 1)})
    return rows


def metric_per_step(client, run_id: str, key: str) -> dict[int, float]:
    """A run's MLflow metric as ``{step: value}``, the latest value where a step was logged twice (a
    resumed run logs its replayed steps again)."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in history}


def stage_timings(tracking_uri: str, run_id: str) -> dict:
    """Where a step's time went: the mean of each ``time/*`` metric (:mod:`~lightning_agentrl.callbacks.
    stage_timings`) over the steps after the first (whose rollouts wait for the engine's start)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    keys = [m for m in client.get_run(run_id).data.metrics if m.startswith("time/")]
    timings: dict[str, float] = {}
    for key in sorted(keys):
        kept = [v for step, v in metric_per_step(client, run_id, key).items() if step > 0]
        if kept:
            timings[key] = round(sum(kept) / len(kept), 3)
    return timings


# the scores of an evaluation that the record keeps and MLflow gets as eval/<key>, as HeldOutEvaluation logs them
SCORE_KEYS = ("success", "solved", "pass_at_k", "submitted_frac", "infra_errors")


class PolicySnapshots(L.Callback):
    """Saves the policy every ``every`` optimizer steps and after the last, each with its training time
    in ``seconds``: ``offset_s`` (the warm start's) plus the time since ``started`` (``time.monotonic()``
    before ``fit``). Held-out success is measured after the run (:func:`evaluate_snapshots`), so no
    evaluation's time counts as training time. A batch whose update was skipped (every episode
    filtered) leaves ``global_step`` where it was and saves nothing. Not resumable: ``make learn``
    times one uninterrupted run (``main`` refuses a run folder that already holds one)."""

    def __init__(self, directory: Path, every: int, tokenizer, *, started: float, offset_s: float) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.directory, self.every, self.tokenizer = Path(directory), every, tokenizer
        self.started, self.offset_s = started, offset_s
        self.saved: list[dict] = []  # {"step", "path", "seconds"}, in step order

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every == 0:
            self._save(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer, pl_module)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_agentrl.callbacks.export_policy import save_policy
        from lightning_agentrl.strategies import gather_full_state_dict

        step = trainer.global_step
        if step == 0 or (self.saved and self.saved[-1]["step"] == step):  # step 0 is the warm start's
            return
        path = self.directory / f"step_{step:06d}"
        weights = gather_full_state_dict(pl_module.policy)  # a collective under ZeRO-3: every rank
        if trainer.is_global_zero:
            save_policy(pl_module.policy.config, weights, path, self.tokenizer)
        self.saved.append({"step": step, "path": str(path), "seconds": self.offset_s + time.monotonic() - self.started})


def evaluate_snapshots(snapshots: list[dict], *, config: str, overrides: list[str], samples_per_task: int,
                       seed: int) -> list[dict]:
    """Held-out success of each saved policy (``python -m lightning_agentrl evaluate``), one entry per
    snapshot: its step, :func:`~lightning_agentrl.callbacks.evaluation.score_episodes`'s scores, and
    ``minutes`` and ``seconds``, the training time (warm start included) at which the policy was saved. Every
    snapshot is evaluated with the same ``run.seed`` (the same sampling streams for each episode),
    so two steps differ by their weights only."""
    from lightning_agentrl.evaluate import evaluate_policy

    history = []
    for snapshot in snapshots:
        scores = evaluate_policy(snapshot["path"], split="test", samples=samples_per_task, config=Path(config),
                                 overrides=[*overrides, f"--run.seed={seed}"])
        history.append({"step": snapshot["step"], "episodes": scores["episodes"], **{k: scores[k] for k in SCORE_KEYS},
                        "minutes": round(snapshot["seconds"] / 60, 2), "seconds": round(snapshot["seconds"], 1)})
    return history


def run_with_evaluation(settings: Settings, *, every: int, samples_per_task: int, seed: int):
    """``fit`` with held-out evaluation; returns (FitResult, evaluation history)."""
    from lightning_agentrl.train import fit

    evaluation = HeldOutEvaluation(
        load_env_tasks(settings, "test"), every_n_steps=every, samples_per_task=samples_per_task, seed=seed
    )
    result = fit(settings, callbacks=[evaluation])
    return result, evaluation.history


def run_with_snapshots(settings: Settings, warm: dict, directory: Path, *, every: int, config: str,
                       overrides: list[str], samples_per_task: int, seed: int):
    """``fit`` saving the policy every ``every`` steps, then the held-out evaluation of each saved
    policy (the warm start's as step 0, at the warm start's own seconds, also when it was reused);
    returns (FitResult, evaluation history, training seconds: the warm start's plus fit's)."""
    from transformers import AutoTokenizer

    from lightning_agentrl.train import fit

    tokenizer = AutoTokenizer.from_pretrained(warm["path"])
    snapshots = PolicySnapshots(directory, every, tokenizer, started=time.monotonic(), offset_s=warm["seconds"])
    result = fit(settings, callbacks=[snapshots])
    training_s = warm["seconds"] + time.monotonic() - snapshots.started
    warm_snapshot = {"step": 0, "path": warm["path"], "seconds": warm["seconds"]}
    history = evaluate_snapshots([warm_snapshot, *snapshots.saved], config=config, overrides=overrides,
                                 samples_per_task=samples_per_task, seed=seed)
    return result, history, training_s


def copy_probe(model_dir: str | Path, system_prompt: str | None) -> dict:
    """How much the written value depends on the read key (:func:`value_distribution`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.warm_start import value_distribution
    from lightning_agentrl.rollout.chat import ChatCodec

    spec = LearnSuiteSpec()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = value_distribution(model, ChatCodec(AutoTokenizer.from_pretrained(model_dir)), spec, system_prompt)
    diagonal = sum(rows[i][i] for i in range(len(rows))) / len(rows)
    return {"p_value_given_key": [[round(v, 4) for v in row] for row in rows], "diagonal_mass": round(diagonal, 4),
            "chance": spec.chance}


def plot(history: list[dict], rewards: list[dict], chance: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([r["step"] for r in rewards], [r["reward"] for r in rewards], color="0.7", lw=1, label="train reward (batch mean)")
    ax.plot([h["step"] for h in history], [h["success"] for h in history], "o-", color="C0", label="held-out success")
    ax.axhline(chance, ls="--", color="C3", lw=1, label=f"chance ({chance:g})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/learn_cpu.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="default: runs/learn_cpu-<time>")
    parser.add_argument("--out", default="benchmarks/results/learn_cpu/learn_cpu.json")
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--echo-prob", type=float, default=0.5,
                        help="share of generic echo demonstrations in the warm start (see benchmarks/warm_start.py)")
    parser.add_argument("--value-in-loss", action=argparse.BooleanOptionalAction, default=True,
                        help="train the warm start on the (random) written value; --no-value-in-loss masks it out")
    parser.add_argument("--eval-every", type=int, default=10,
                        help="save the policy every N steps; each is evaluated on the held-out split after training")
    parser.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out task per evaluation")
    parser.add_argument("--target", type=float, default=0.8, help="report the first evaluation at or above this")
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    if args.eval_every < 1:
        parser.error(f"--eval-every must be at least 1, got {args.eval_every}")
    args.overrides = overrides  # settings overrides after --, e.g. --trainer.lr=2e-4

    started = time.monotonic()
    run_dir = Path(args.run_dir or f"runs/learn_cpu-{time.strftime('%Y%m%d-%H%M%S')}")
    held = [name for name in ("checkpoints", "snapshots", "settings.yaml") if (run_dir / name).exists()]
    if held:
        parser.error(f"{run_dir} already holds a run ({', '.join(held)}): make learn times one uninterrupted "
                     "run from its start; give a new --run-dir (a finished warm_start/ in it is reused)")
    base = load_settings(args.config, [f"--run.dir={run_dir}", f"--run.seed={args.seed}", *args.overrides])
    warm = warm_started_model(base, run_dir / "warm_start", steps=args.warm_start_steps, seed=args.seed,
                              echo_prob=args.echo_prob, value_in_loss=args.value_in_loss)
    settings = load_settings(
        args.config, [f"--run.dir={run_dir}", f"--run.seed={args.seed}", *args.overrides, f"--model.path={warm['path']}"]
    )
    rl_started = time.monotonic()
    result, history, training_s = run_with_snapshots(
        settings, warm, run_dir / "snapshots", every=args.eval_every, config=args.config, overrides=args.overrides,
        samples_per_task=args.eval_samples, seed=args.seed)
    rl_wall = time.monotonic() - rl_started
    wall = time.monotonic() - started
    reached = [entry for entry in history if entry["success"] >= args.target]
    rewards = train_rewards(run_dir)
    chance = LearnSuiteSpec().chance
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": shlex.join([Path(sys.executable).name, "benchmarks/learn_cpu.py", *argv]),
        "wall_time_s": round(wall, 1),
        "warm_start": warm,
        "rl_wall_time_s": round(rl_wall, 1),  # training and the evaluations after it
        "training_time_s": round(training_s, 1),  # the warm start's seconds and fit's; no evaluation
        "steps": result.global_step,
        "chance": chance,
        "eval_episodes": history[-1]["episodes"] if history else 0,
        "success_per_step": history,
        "train_reward_per_step": rewards,
        "baseline_success": history[0]["success"],
        "final_success": history[-1]["success"],
        "target": args.target,
        "first_at_target": reached[0] if reached else None,
        "run_dir": str(run_dir),
        "stage_timings": (stage_timings(result.tracking_uri, result.mlflow_run_id)
                          if result.mlflow_run_id is not None else None),
        "copy_probe": {"warm_start": copy_probe(warm["path"], settings.env.system_prompt),
                       "final": copy_probe(result.policy_dir, settings.env.system_prompt)},
    }
    write_record(out, record, config=args.config, overrides=args.overrides, seed=args.seed)
    png = out.with_suffix(".png")
    plot(history, rewards, chance, png,
         f"copy-the-key, tiny model, GRPO on CPU ({history[-1]['minutes']:.1f} min of training, warm start incl.)")
    if result.mlflow_run_id is not None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=result.tracking_uri)
        client.log_artifact(result.mlflow_run_id, str(png))
        client.log_artifact(result.mlflow_run_id, str(out))
        client.log_metric(result.mlflow_run_id, "learn/wall_time_s", wall)
        for entry in history:  # as HeldOutEvaluation logs them during a run
            for key in SCORE_KEYS:
                client.log_metric(result.mlflow_run_id, f"eval/{key}", float(entry[key]), step=entry["step"])
    print(f"baseline {record['baseline_success']:.3f} -> final {record['final_success']:.3f} "
          f"in {wall / 60:.1f} min; wrote {out} and {png}")
    if reached:
        print(f"first held-out success >= {args.target}: {reached[0]['success']:.3f} at step {reached[0]['step']}, "
              f"{reached[0]['minutes']:.1f} min of training (warm start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Credit-assignment comparisons at equal rollout budget, on held-out copy-the-key tasks.

    python benchmarks/compare.py gigpo        # GRPO vs GiGPO (states repeat: every read of key.txt)
    python benchmarks/compare.py gigpo_detour # the same where a state is reached by different paths
    python benchmarks/compare.py mask         # loss mask on vs off (SPEC §2 predicts on wins)
    python benchmarks/compare.py truncation   # truncated episodes: reward 0 vs compact filtering
    python benchmarks/compare.py mask --seeds 0 1 2 3 -- --trainer.max_steps=30

Each arm runs ``configs/compare_<name>.yaml`` plus the arm's overrides, for every seed, from the
same format-only warm start (one per comparison, so both arms start from identical weights); the
seed changes the RL sampling and the task order. Both arms of a seed see the same number of
episodes (``trainer.max_steps x groups_per_step x group_size``). The score of a run is its
held-out success at the last step (``samples_per_task`` sampled episodes per held-out task).

Writes ``benchmarks/results/compare_<name>.json`` (every run, per-arm mean and std over seeds)
and ``compare_<name>.md`` (a table row per arm, for the README).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from learn_cpu import run_with_evaluation, train_rewards, warm_started_model  # noqa: E402

from lightning_agentrl.settings import load_settings  # noqa: E402

COMPARISONS: dict[str, dict] = {
    "gigpo": {
        "question": "GRPO vs GiGPO (anchor states repeat: every episode that read key.txt is in the same state)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "detour_prob": 0.0,
    },
    "gigpo_detour": {
        "question": "GRPO vs GiGPO where one state is reached by different paths (the warm start runs ls "
        "between the read and the write in half of its demos, so anchor groups span episodes at different turns)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "detour_prob": 0.5,
    },
    "mask": {
        "question": "loss mask on vs off (off: observations after the first action are trained on too)",
        "arms": {"mask on": ["--algorithm.loss_mask=true"], "mask off": ["--algorithm.loss_mask=false"]},
        "detour_prob": 0.0,
    },
    "truncation": {
        "question": "truncated episodes scored 0 vs compact filtering, with a forced truncation rate: 30% of "
        "training episodes (seeded) get 2 turns, so they end with max_turns before they can submit, "
        "whatever the policy does",
        "arms": {"reward 0": ["--rollout.truncation=zero"], "compact filter": ["--rollout.truncation=filter"]},
        "detour_prob": 0.0,
    },
}


def truncation_rate(run_dir: Path) -> float:
    """Share of training episodes that ended by a truncation (max_turns, max_context, timeout)."""
    from lightning_agentrl.trajectory import load_trajectories

    total = truncated = 0
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        for t in load_trajectories(path):
            total += 1
            truncated += t.termination.value in ("max_turns", "max_context", "timeout")
    return truncated / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(COMPARISONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=None, help="run folders go here (default runs/compare_<name>-<time>)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--echo-prob", type=float, default=0.5)
    parser.add_argument("--value-in-loss", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eval-samples", type=int, default=4, help="episodes per held-out task")
    parser.add_argument("--eval-every", type=int, default=30, help="held-out evaluation every N steps (and at the end)")
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    args.overrides = overrides  # settings overrides for both arms, after --
    spec = COMPARISONS[args.name]
    config = f"configs/compare_{args.name}.yaml"
    root = Path(args.root or f"runs/compare_{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()

    base = load_settings(config, [f"--run.dir={root}", *args.overrides])
    warm = warm_started_model(base, root / "warm_start", steps=args.warm_start_steps, seed=0,
                              detour_prob=spec["detour_prob"], echo_prob=args.echo_prob,
                              value_in_loss=args.value_in_loss)
    runs = []
    for seed in args.seeds:
        for arm, arm_overrides in spec["arms"].items():
            run_dir = root / f"{arm.replace(' ', '_')}-seed{seed}"
            settings = load_settings(config, [f"--run.dir={run_dir}", f"--run.seed={seed}", *args.overrides,
                                              *arm_overrides, f"--model.path={warm['path']}"])
            t0 = time.monotonic()
            result, history = run_with_evaluation(
                settings, every=args.eval_every, samples_per_task=args.eval_samples, seed=seed
            )
            runs.append({
                "arm": arm, "seed": seed, "overrides": arm_overrides, "run_dir": str(run_dir),
                "baseline_success": history[0]["success"], "final_success": history[-1]["success"],
                "success_per_step": [{"step": h["step"], "success": h["success"]} for h in history],
                "train_reward_per_step": [r["reward"] for r in train_rewards(run_dir)],
                "train_truncation_rate": truncation_rate(run_dir), "seconds": round(time.monotonic() - t0, 1),
                "episodes": result.global_step * settings.rollout.groups_per_step * settings.rollout.group_size,
            })
            print(f"[{args.name}] {arm} seed {seed}: {history[0]['success']:.3f} -> {history[-1]['success']:.3f}",
                  flush=True)

    summary = {}
    for arm in spec["arms"]:
        finals = [r["final_success"] for r in runs if r["arm"] == arm]
        curves = [r["success_per_step"] for r in runs if r["arm"] == arm]
        steps = sorted({h["step"] for curve in curves for h in curve})
        at = {step: [h["success"] for curve in curves for h in curve if h["step"] == step] for step in steps}
        summary[arm] = {
            "success_per_step": [{"step": step, "mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0}
                                 for step, v in at.items()],
            "final_success_mean": statistics.fmean(finals),
            "final_success_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_success": finals,
            "train_truncation_rate_mean": statistics.fmean(
                r["train_truncation_rate"] for r in runs if r["arm"] == arm),
        }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "comparison": args.name,
        "question": spec["question"],
        "command": shlex.join([Path(sys.executable).name, "benchmarks/compare.py", *argv]),
        "config": config,
        "seeds": args.seeds,
        "settings_overrides": args.overrides,
        "warm_start": warm,
        "episodes_per_run": runs[0]["episodes"],
        "baseline_success": runs[0]["baseline_success"],
        "wall_time_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "runs": runs,
    }
    (out_dir / f"compare_{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = [f"| {args.name} | {arm} | {s['final_success_mean']:.3f} ± {s['final_success_std']:.3f} | "
            f"{', '.join(f'{v:.2f}' for v in s['final_success'])} | {s['train_truncation_rate_mean']:.2f} | "
            f"{record['episodes_per_run']} |" for arm, s in summary.items()]
    (out_dir / f"compare_{args.name}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

COPY_KEY = "copy_key"  # warm start: benchmarks/warm_start.py:warm_start (read the key, write a random value)
ROOMS = "rooms"  # warm start: benchmarks/warm_start.py:rooms_warm_start (random walks over the listed exits)

COMPARISONS: dict[str, dict] = {
    "gigpo": {
        "question": "GRPO vs GiGPO (anchor states repeat: every episode that read key.txt is in the same state)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "warm": COPY_KEY, "detour_prob": 0.0,
    },
    "gigpo_detour": {
        "question": "GRPO vs GiGPO where one state is reached by different paths (the warm start runs ls "
        "between the read and the write in half of its demos, so anchor groups span episodes at different turns)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "warm": COPY_KEY, "detour_prob": 0.5,
    },
    "mask": {
        "question": "loss mask on vs off (off: observations after the first action are trained on too)",
        "arms": {"mask on": ["--algorithm.loss_mask=true"], "mask off": ["--algorithm.loss_mask=false"]},
        "warm": COPY_KEY, "detour_prob": 0.0,
    },
    "truncation": {
        "question": "truncated episodes scored 0 vs compact filtering, with a forced truncation rate: 30% of "
        "training episodes (seeded) get 2 turns, so they end with max_turns before they can submit, "
        "whatever the policy does",
        "arms": {"reward 0": ["--rollout.truncation=zero"], "compact filter": ["--rollout.truncation=filter"]},
        "warm": COPY_KEY, "detour_prob": 0.0,
    },
    "rooms_gigpo": {
        "question": "GRPO vs GiGPO (exact anchors) in a maze of rooms reached by different paths, with dead ends",
        "config": "configs/credit_gigpo.yaml",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "warm": ROOMS, "eval_every": 10, "eval_samples": 8,
    },
    "rooms_similarity": {
        "question": "the same maze where every observation carries a clock (the turns spent): GiGPO with exact "
        "anchors (a room reached at another turn reads differently) vs GiGPO's similarity mode (merges them)",
        "config": "configs/credit_gigpo.yaml",
        "common": ["--env.tasks=tasks/rooms/maze_noise.jsonl"],
        "arms": {"gigpo exact": ["--algorithm.advantage=gigpo"],
                 "gigpo similarity": ["--algorithm.advantage=gigpo", "--algorithm.gigpo_similarity=0.93"]},
        "warm": ROOMS, "eval_every": 10, "eval_samples": 8,
    },
    "rooms_truncation": {
        "question": "truncated episodes scored 0 vs compact filtering where the goal takes more turns than a cheap "
        "exit (0.25) and a loose policy overruns the turn budget",
        "config": "configs/credit_truncation.yaml",
        "arms": {"reward 0": ["--rollout.truncation=zero"], "compact filter": ["--rollout.truncation=filter"]},
        "warm": ROOMS, "eval_every": 10, "eval_samples": 24,  # one held-out start
    },
    "rooms_critic": {
        "question": "a turn-level critic (GAE, value head) vs GRPO with per-turn rewards (bonus rooms on the way)",
        "config": "configs/credit_critic.yaml",
        "arms": {"grpo": ["--algorithm.advantage=grpo"],
                 "gae": ["--algorithm.advantage=gae", "--model.value_head=true"]},
        "warm": ROOMS, "eval_every": 10, "eval_samples": 8,
    },
    "rooms_staleness": {
        "question": "staleness weighting (exp, rate 0.5) vs none, with partial rollouts, at max_staleness 2 and 4",
        "config": "configs/credit_staleness.yaml",
        "arms": {f"bound {k} {name}": [f"--rollout.max_staleness={k}", f"--algorithm.staleness_weighting={kind}"]
                 for k in (2, 4) for name, kind in (("none", "none"), ("weighted", "exp"))},
        "warm": ROOMS, "eval_every": 10, "eval_samples": 8,
    },
}


def episode_stats(run_dir: Path, last_steps: int = 10) -> dict:
    """From the saved training batches: the share of truncated episodes (max_turns, max_context, timeout)
    over the run, and for the last ``last_steps`` steps how episodes ended (``termination`` counts and the
    mean final reward per kind) and at which turn those that ended on their own (``submitted``) ended."""
    from lightning_agentrl.trajectory import load_trajectories

    files = sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    total = truncated = 0
    for path in files:
        for t in load_trajectories(path):
            total += 1
            truncated += t.termination.value in ("max_turns", "max_context", "timeout")
    late = [t for path in files[-last_steps:] for t in load_trajectories(path)]
    ends: dict[str, int] = {}
    submit_turns: dict[int, int] = {}
    for t in late:
        ends[t.termination.value] = ends.get(t.termination.value, 0) + 1
        if t.termination.value == "submitted":
            submit_turns[len(t.turns)] = submit_turns.get(len(t.turns), 0) + 1
    return {"train_truncation_rate": truncated / max(total, 1),
            "late_terminations": dict(sorted(ends.items())),
            "late_submit_turns": dict(sorted(submit_turns.items())),
            "late_mean_reward": statistics.fmean(t.reward for t in late) if late else 0.0}


def warm_start_for(spec: dict, base, root: Path, args) -> dict:
    """The comparison's format-only warm start (one for all its runs, so every arm starts from the same weights)."""
    if spec["warm"] == COPY_KEY:
        return warm_started_model(base, root / "warm_start", steps=args.warm_start_steps, seed=0,
                                  detour_prob=spec["detour_prob"], echo_prob=args.echo_prob,
                                  value_in_loss=args.value_in_loss)
    from warm_start import rooms_warm_start

    from lightning_agentrl.envs.registry import load_env_tasks
    from lightning_agentrl.train import resolve_model_path

    record_file = root / "warm_start" / "warm_start.json"
    if record_file.exists():
        return json.loads(record_file.read_text())
    result = rooms_warm_start(resolve_model_path(base), root / "warm_start", load_env_tasks(base, "train"),
                              max_turns=base.env.max_turns, steps=args.rooms_warm_start_steps, seed=0)
    record = {"path": str(result.path), "steps": result.steps, "final_loss": result.final_loss,
              "seconds": result.seconds, "kind": ROOMS}
    record_file.write_text(json.dumps(record, indent=2))
    return record


def run_arm(config: str, spec: dict, arm: str, seed: int, root: Path, warm: dict, args) -> dict:
    """One run of one arm and seed, with held-out evaluation; its record."""
    run_dir = root / f"{arm.replace(' ', '_')}-seed{seed}"
    overrides = [*spec.get("common", []), *args.overrides, *spec["arms"][arm]]
    settings = load_settings(config, [f"--run.dir={run_dir}", f"--run.seed={seed}", *overrides,
                                      f"--model.path={warm['path']}"])
    t0, started_at = time.monotonic(), time.time()
    result, history = run_with_evaluation(settings, every=args.eval_every, samples_per_task=args.eval_samples,
                                          seed=seed)
    curve = [{"step": h["step"], "success": h["success"], "minutes": round((h["time"] - started_at) / 60, 2)}
             for h in history]
    reached = [h for h in curve if h["success"] >= args.target]
    return {
        "arm": arm, "seed": seed, "overrides": spec["arms"][arm], "run_dir": str(run_dir),
        "baseline_success": curve[0]["success"], "final_success": curve[-1]["success"],
        "success_per_step": curve, "first_at_target": reached[0] if reached else None,
        "train_reward_per_step": [r["reward"] for r in train_rewards(run_dir)],
        **episode_stats(run_dir), "seconds": round(time.monotonic() - t0, 1),
        "episodes": result.global_step * settings.rollout.groups_per_step * settings.rollout.group_size,
    }


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(spec: dict, runs: list[dict]) -> dict:
    """Per arm: held-out success at each evaluated step and at the end (mean, std over seeds), the share of
    truncated training episodes, and the seeds that reached the target and when; for every arm after the
    first, the paired per-seed difference of final success against the first arm."""
    arms = list(spec["arms"])
    summary = {}
    for arm in arms:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        steps = sorted({h["step"] for r in mine for h in r["success_per_step"]})
        at = {step: [h["success"] for r in mine for h in r["success_per_step"] if h["step"] == step] for step in steps}
        reached = [r["first_at_target"] for r in mine if r["first_at_target"]]
        summary[arm] = {
            "success_per_step": [{"step": step, **mean_std(v)} for step, v in at.items()],
            "final_success_mean": mean_std([r["final_success"] for r in mine])["mean"],
            "final_success_std": mean_std([r["final_success"] for r in mine])["std"],
            "final_success": [r["final_success"] for r in mine],
            "train_truncation_rate_mean": statistics.fmean(r["train_truncation_rate"] for r in mine),
            "reached_target": f"{len(reached)}/{len(mine)}",
            "minutes_to_target": [h["minutes"] for h in reached],
            "seconds_per_run_mean": statistics.fmean(r["seconds"] for r in mine),
        }
        if arm != arms[0]:
            first = {r["seed"]: r["final_success"] for r in runs if r["arm"] == arms[0]}
            diffs = [r["final_success"] - first[r["seed"]] for r in mine if r["seed"] in first]
            summary[arm]["paired_diff_vs_first"] = {"per_seed": diffs, **mean_std(diffs)}
    return summary


def table_rows(name: str, summary: dict, episodes: int) -> list[str]:
    rows = []
    for arm, s in summary.items():
        paired = s.get("paired_diff_vs_first")
        diff = "" if paired is None else f"{paired['mean']:+.3f} ± {paired['std']:.3f}"
        points = ", ".join(f"{p['step']}: {p['mean']:.2f}" for p in s["success_per_step"])
        rows.append(f"| {name} | {arm} | {s['final_success_mean']:.3f} ± {s['final_success_std']:.3f} | "
                    f"{', '.join(f'{v:.2f}' for v in s['final_success'])} | {diff} | {points} | "
                    f"{s['train_truncation_rate_mean']:.2f} | {episodes} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(COMPARISONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default=None, help="run folders go here (default runs/compare_<name>-<time>)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--rooms-warm-start-steps", type=int, default=40)
    parser.add_argument("--echo-prob", type=float, default=0.5)
    parser.add_argument("--value-in-loss", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="episodes per held-out task (default: the comparison's, 4 for copy-the-key)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out evaluation every N steps and at the end (default: the comparison's, else 30)")
    parser.add_argument("--target", type=float, default=0.5, help="report when each run first reached this success")
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    args.overrides = overrides  # settings overrides for every arm, after --
    spec = COMPARISONS[args.name]
    args.eval_samples = args.eval_samples or spec.get("eval_samples", 4)
    args.eval_every = args.eval_every or spec.get("eval_every", 30)
    config = spec.get("config", f"configs/compare_{args.name}.yaml")
    root = Path(args.root or f"runs/compare_{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()

    base = load_settings(config, [f"--run.dir={root}", *spec.get("common", []), *args.overrides])
    warm = warm_start_for(spec, base, root, args)
    runs = []
    for seed in args.seeds:
        for arm in spec["arms"]:
            runs.append(run_arm(config, spec, arm, seed, root, warm, args))
            print(f"[{args.name}] {arm} seed {seed}: {runs[-1]['baseline_success']:.3f} -> "
                  f"{runs[-1]['final_success']:.3f}", flush=True)

    summary = summarize(spec, runs)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "comparison": args.name, "question": spec["question"],
        "command": shlex.join([Path(sys.executable).name, "benchmarks/compare.py", *argv]),
        "config": config, "seeds": args.seeds, "settings_overrides": [*spec.get("common", []), *args.overrides],
        "warm_start": warm, "episodes_per_run": runs[0]["episodes"], "baseline_success": runs[0]["baseline_success"],
        "target": args.target, "wall_time_s": round(time.monotonic() - started, 1),
        "summary": summary, "runs": runs,
    }
    (out_dir / f"compare_{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = table_rows(args.name, summary, record["episodes_per_run"])
    (out_dir / f"compare_{args.name}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

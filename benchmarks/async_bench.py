"""Async vs sync: throughput at staleness bounds 0, 1, 2, 4 with environment latency served by the real sandbox.

    python benchmarks/async_bench.py [--bounds 0,1,2,4] [--steps 6] [--warmup 2] [--latency-median 1.0]

The same trainer, tasks, episodes per step and episodes in flight (``rollout.max_in_flight`` =
(largest bound + 1) x episodes per step in every run) at each ``rollout.max_staleness``; only the
bound changes. The environment is ``benchmarks.latency_env:LatencyEnv``: every action runs ``sleep``
in a sandbox of the sandbox service ``fit`` starts, for a lognormal time (median
``--latency-median`` s, sigma ``--latency-sigma``: heavy-tailed), the same draws in every run. Each
run is its own ``fit`` subprocess (``benchmarks/fit_runner.py``); throughput is episodes per second
over the measured steps (``--warmup`` steps left out); the ratio is against bound 0.

Ideal ratio, from the measured stage times of the synchronous run: its step takes ``s = r + t``,
``r`` the rollout (the slowest episode of the step; all of a step's episodes run at once) and ``t``
the trainer's own work (the rest: forward/backward, optimizer, checkpoint, weight push). With bound
``k`` the rollouts of ``k + 1`` steps overlap each other and the trainer, so a step takes at least
``t`` and at least ``s / (k + 1)``: ideal ratio ``min(k + 1, s / t)``. (The trainer takes the groups
that finish first, so with heavy tails a run can beat it.) Targets (issue 19): ratio >= 3 at bound 2
when the environment dominates (``s / t >= 3``), and >= 90% of ideal.

Writes benchmarks/results/async/async.json (per bound: step times, throughput, ratio, ideal, the share of
the step spent waiting on rollouts vs training, the load average) and prints one line.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmarks.*, as the fit subprocesses import it

from benchmarks.fit_runner import base_overrides, median_of, run_fit, step_seconds  # noqa: E402
from benchmarks.latency_env import write_tasks  # noqa: E402
from benchmarks.record import shared_overrides, write_record  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "async" / "async.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", default="0,1,2,4", help="rollout.max_staleness values; the first must be 0")
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring (at least 1)")
    parser.add_argument("--groups", type=int, default=2, help="rollout.groups_per_step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2, help="actions per episode, each one sandbox sleep")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--latency-median", type=float, default=1.0, help="median sleep per action, seconds")
    parser.add_argument("--latency-sigma", type=float, default=1.0, help="lognormal sigma (log-space std)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.bound_list = [int(b) for b in args.bounds.split(",")]
    if args.bound_list[0] != 0 or any(b < 0 for b in args.bound_list):
        parser.error("--bounds must start with 0 (the synchronous run the ratios are against) and be >= 0")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.latency_median <= 0:
        parser.error("--latency-median must be positive (the environment is the sandbox's latency)")
    return args


def arm(args: argparse.Namespace, bound: int, tasks: Path, root: Path) -> dict:
    episodes = args.groups * args.group_size
    overrides = [
        *base_overrides(root / f"staleness{bound}", tasks, max_steps=args.warmup + args.steps),
        f"--rollout.max_staleness={bound}", f"--rollout.groups_per_step={args.groups}",
        f"--rollout.group_size={args.group_size}", f"--rollout.max_in_flight={(max(args.bound_list) + 1) * episodes}",
        f"--env.max_turns={args.turns}", f"--engine.max_new_tokens={args.max_new_tokens}",
        f"--engine.max_batch_size={(max(args.bound_list) + 1) * episodes}",
    ]
    run = run_fit(overrides, threads=args.threads)
    steps, seconds = run["steps"], step_seconds(run["steps"], args.warmup)
    step_s = statistics.fmean(seconds)
    train_s = median_of(steps, "train", args.warmup)
    between_s = median_of(steps, "between_steps", args.warmup)
    return {
        "max_staleness": bound,
        "step_s": [round(s, 3) for s in seconds],
        "mean_step_s": round(step_s, 3),
        "episodes_per_step": statistics.median(s["episodes"] for s in steps[args.warmup:]),
        "episodes_per_s": round(episodes / step_s, 3),
        "tokens_per_step": median_of(steps, "tokens", args.warmup),
        "slowest_episode_s": round(median_of(steps, "episode_s_max", args.warmup), 3),
        "tool_s_mean_per_episode": round(median_of(steps, "tool_s_mean", args.warmup), 3),
        "generation_s_mean_per_episode": round(median_of(steps, "generation_s_mean", args.warmup), 3),
        "profile": {"train phase (forward, backward, optimizer, logging)": round(train_s / (train_s + between_s), 3),
                    "between steps (waiting for rollouts, checkpoint, weight push)":
                        round(between_s / (train_s + between_s), 3)},
        "wall_s": run["wall_s"],
        "load_avg_1min": run["load_avg_1min"],
        "overrides": overrides,
    }


def ideal_model(sync: dict) -> dict:
    """``s``, ``r`` and ``t`` of the synchronous run (see the module docstring)."""
    s = sync["mean_step_s"]
    r = min(sync["slowest_episode_s"], s)
    return {"sync_step_s": s, "rollout_s": r, "trainer_s": round(s - r, 3),
            "environment_dominates": bool(s >= 3 * (s - r)),
            "rule": "ideal ratio at bound k = min(k + 1, s / t); s = sync step, r = slowest episode, t = s - r"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        tasks = write_tasks(Path(tmp) / "tasks.jsonl", 16, turns=args.turns, latency_median_s=args.latency_median,
                            latency_sigma=args.latency_sigma)
        arms = [arm(args, bound, tasks, Path(tmp)) for bound in args.bound_list]
    model = ideal_model(arms[0])
    s, t = model["sync_step_s"], max(model["trainer_s"], 1e-9)
    for a in arms:
        a["ratio"] = round(arms[0]["mean_step_s"] / a["mean_step_s"], 2)
        a["ideal_ratio"] = round(min(a["max_staleness"] + 1, s / t), 2)
        a["share_of_ideal"] = round(a["ratio"] / a["ideal_ratio"], 2)
    at2 = next((a for a in arms if a["max_staleness"] == 2), None)
    record = {
        "command": shlex.join(["python", "benchmarks/async_bench.py", *argv]),
        "host": platform.platform(), "cpu_count": os.cpu_count(),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],  # the machine may be shared
        "shape": {"groups_per_step": args.groups, "group_size": args.group_size, "turns": args.turns,
                  "max_new_tokens": args.max_new_tokens, "latency": f"lognormal, median {args.latency_median} s, "
                  f"sigma {args.latency_sigma}, one sandbox `sleep` per action", "warmup_steps": args.warmup,
                  "measured_steps": args.steps, "torch_threads": args.threads},
        "ideal_model": model,
        "targets": {"ratio_at_bound_2": 3.0, "share_of_ideal": 0.9},
        "arms": arms,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record, config=None, overrides=shared_overrides([a["overrides"] for a in arms]), seed=0)
    loads = [a["load_avg_1min"]["before"] for a in arms]
    summary = "; ".join(f"bound {a['max_staleness']}: {a['episodes_per_s']} ep/s, {a['ratio']}x "
                        f"(ideal {a['ideal_ratio']}x)" for a in arms)
    verdict = "" if at2 is None else f"; at bound 2 {at2['ratio']}x (target 3x, {at2['share_of_ideal']:.0%} of ideal)"
    print(f"async ({args.groups}x{args.group_size} episodes x {args.turns} turns, sync s/t = {s / t:.1f}): "
          f"{summary}{verdict}; load {min(loads):.1f} to {max(loads):.1f}")


if __name__ == "__main__":
    main()

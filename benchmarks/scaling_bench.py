"""Scaling with work: step time as groups per step, turns per episode and tokens per action double.

    python benchmarks/scaling_bench.py [--doublings 1] [--steps 3] [--warmup 1]

A base run (``--groups`` groups of ``--group-size``, ``--turns`` turns, ``--max-new-tokens`` per
action) and, per axis, ``--doublings`` runs with that axis doubled (2x, 4x, ...) and the others at
base: ``rollout.groups_per_step``, turns per episode (``env.max_turns`` and the environment's
``turns``), and ``engine.max_new_tokens`` (the context length: each action's tokens and all that
follow it). The environment is ``benchmarks.latency_env:LatencyEnv`` without latency (no sandbox
call), so the step is the project's own work: generation, forward/backward, optimizer, checkpoint.
Each run is its own ``fit`` subprocess (``benchmarks/fit_runner.py``); the step time is the median
over the measured steps, tokens per step the median of the trained batch's tokens.

Reported exponents: per axis, ``log2(t(2x) / t(x))`` averaged over its doublings (1 = linear in that
axis), and over all runs the least-squares slope of log step time against log tokens per step (1 =
linear in tokens; 2 = quadratic), for the whole step and for the train phase alone.

The runs' micro-batches hold a few hundred tokens, too few for attention to show: at that size a
pack's cost is the layers' matrix products, linear in tokens, and even attention over the whole pack
(an ``[n, n]`` mask) grows with an exponent near 1. So the train phase is also timed on its own, at
the lengths where attention dominates: the training step's decoder forward + backward
(``policy.hidden_states``, the path ``training_step`` takes) on packs of ``--pack-tokens``
tokens (1k to 4k by default) made of ``--segment-tokens``-token sequences, best of 3, in this
process with one torch thread (a growth exponent needs no parallelism, and on a shared machine two
threads made it swing from 0.7 to 1.4 where one thread repeats within 0.05). Each sequence attends only to itself, so the cost should be
linear in the pack's length: ``exponent_train_vs_pack_tokens`` about 1. A regression to attention
over the whole pack makes it quadratic; the same packs under one ``[n, n]`` block mask are timed
alongside as that reference (``exponent_block_mask_reference``, about 2 at these lengths).
Writes benchmarks/results/scaling/scaling.json and prints one line.
"""

from __future__ import annotations

import argparse
import math
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

RESULTS = REPO / "benchmarks" / "results" / "scaling" / "scaling.json"
AXES = ("groups", "turns", "max_new_tokens")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doublings", type=int, default=1, help="runs per axis beyond the base (2x, 4x, ...)")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--groups", type=int, default=2, help="base rollout.groups_per_step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1, help="base turns per episode")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="base engine.max_new_tokens")
    parser.add_argument("--axes", default=",".join(AXES), help="the axes to double, of " + ", ".join(AXES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pack-tokens", default="1024,2048,4096",
                        help="pack lengths of the train-phase attention check (comma-separated, increasing)")
    parser.add_argument("--segment-tokens", type=int, default=64, help="sequence length inside those packs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    args.axis_list = [a for a in args.axes.split(",") if a]
    if not args.axis_list or set(args.axis_list) - set(AXES):
        parser.error(f"--axes must name some of {', '.join(AXES)}")
    if min(args.doublings, args.steps, args.warmup, args.groups, args.turns) < 1 or args.group_size < 2:
        parser.error("--doublings, --steps, --warmup, --groups and --turns must be >= 1, --group-size >= 2")
    args.packs = [int(n) for n in args.pack_tokens.split(",") if n]
    increasing = len(args.packs) >= 2 and args.packs == sorted(set(args.packs))
    if args.segment_tokens < 2 or not increasing or any(n % args.segment_tokens for n in args.packs):
        parser.error("--pack-tokens: two or more increasing lengths, each a multiple of --segment-tokens (>= 2)")
    return args


def one_run(args: argparse.Namespace, shape: dict, root: Path) -> dict:
    name = "-".join(f"{k}{v}" for k, v in shape.items())
    tasks = write_tasks(root / f"{name}.jsonl", 8, turns=shape["turns"], latency_median_s=0.0, latency_sigma=1.0)
    episodes = shape["groups"] * args.group_size
    overrides = [*base_overrides(root / name, tasks, max_steps=args.warmup + args.steps),
                 f"--rollout.groups_per_step={shape['groups']}", f"--rollout.group_size={args.group_size}",
                 f"--rollout.max_in_flight={episodes}", f"--engine.max_batch_size={episodes}",
                 f"--env.max_turns={shape['turns']}", f"--engine.max_new_tokens={shape['max_new_tokens']}"]
    run = run_fit(overrides, threads=args.threads)
    steps = run["steps"]
    return {"shape": shape, "median_step_s": round(statistics.median(step_seconds(steps, args.warmup)), 3),
            "median_train_s": round(median_of(steps, "train", args.warmup), 3),
            "tokens_per_step": median_of(steps, "tokens", args.warmup),
            "completion_tokens_per_step": median_of(steps, "completion_tokens", args.warmup),
            "wall_s": run["wall_s"], "load_avg_1min": run["load_avg_1min"], "overrides": overrides}


def pack_timings(args: argparse.Namespace) -> list[dict]:
    """Forward + backward seconds of the training step's decoder path and of a whole-pack block mask,
    per pack length (see the module docstring)."""
    import time

    import torch

    from benchmarks.fit_runner import CACHE_DIR
    from lightning_agentrl.models.packed import block_mask_hidden_states
    from lightning_agentrl.models.tiny import build_tiny_model
    from lightning_agentrl.module import AgentRLModule
    from lightning_agentrl.policy import hidden_states
    from lightning_agentrl.settings import load_settings

    torch.set_num_threads(1)
    settings = load_settings(None, ["--model.path=tiny", f"--model.cache_dir={CACHE_DIR}"])
    module = AgentRLModule(settings, str(build_tiny_model(CACHE_DIR)))
    module.configure_model()
    policy, length = module.policy, args.segment_tokens
    paths = {"train_s": lambda *pack: hidden_states(policy, *pack),
             "block_mask_s": lambda *pack: block_mask_hidden_states(policy.get_decoder(), *pack)}
    rows = []
    for n in args.packs:
        ids = torch.randint(3, policy.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        pack = (ids, torch.arange(length).repeat(n // length), torch.arange(n // length).repeat_interleave(length))
        row = {"pack_tokens": n, "segment_tokens": length, "torch_threads": torch.get_num_threads()}
        for key, forward in paths.items():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                forward(*pack).sum().backward()
                times.append(time.perf_counter() - started)
            row[key] = round(min(times), 6)
        rows.append(row)
    return rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    var = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly, strict=True)) / var if var else float("nan")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    base = {"groups": args.groups, "turns": args.turns, "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory(prefix="scaling-bench-") as tmp:
        base_run = one_run(args, base, Path(tmp))
        axes = {axis: [base_run] + [one_run(args, {**base, axis: base[axis] * 2**d}, Path(tmp))
                                    for d in range(1, args.doublings + 1)] for axis in args.axis_list}
    runs = [base_run] + [r for axis in args.axis_list for r in axes[axis][1:]]
    packs = pack_timings(args)
    pack_tokens = [p["pack_tokens"] for p in packs]
    exponents = {axis: round(statistics.fmean(math.log2(b["median_step_s"] / a["median_step_s"])
                                              for a, b in zip(chain, chain[1:], strict=False)), 2)
                 for axis, chain in axes.items()}
    tokens = [r["tokens_per_step"] for r in runs]
    record = {
        "command": shlex.join(["python", "benchmarks/scaling_bench.py", *argv]),
        "host": platform.platform(), "cpu_count": os.cpu_count(), "threads": args.threads,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],  # the machine may be shared
        "base": {**base, "group_size": args.group_size, "warmup_steps": args.warmup, "measured_steps": args.steps},
        "exponent_per_axis": exponents,
        "exponent_step_vs_tokens": round(slope(tokens, [r["median_step_s"] for r in runs]), 2),
        "exponent_train_vs_tokens": round(slope(tokens, [r["median_train_s"] for r in runs]), 2),
        "exponent_train_vs_pack_tokens": round(slope(pack_tokens, [p["train_s"] for p in packs]), 2),
        "exponent_block_mask_reference": round(slope(pack_tokens, [p["block_mask_s"] for p in packs]), 2),
        "expected": "about 1 (linear in tokens); below 1 where fixed per-step costs dominate; the pack exponent "
                    "about 1, where attention over the whole pack (the block-mask reference) is about 2",
        "runs": runs,
        "packs": packs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_record(out, record, config=None, overrides=shared_overrides([r["overrides"] for r in runs]), seed=0)
    loads = [r["load_avg_1min"]["before"] for r in runs]
    print(f"scaling ({len(runs)} runs, tokens/step {min(tokens):.0f} to {max(tokens):.0f}): step time exponent vs "
          f"tokens {record['exponent_step_vs_tokens']} (train phase {record['exponent_train_vs_tokens']}); per doubling "
          + ", ".join(f"{k} {v}" for k, v in exponents.items())
          + f"; train phase on packs of {min(pack_tokens)} to {max(pack_tokens)} tokens: exponent "
          f"{record['exponent_train_vs_pack_tokens']} (whole-pack attention would be "
          f"{record['exponent_block_mask_reference']}); load {min(loads):.1f} to {max(loads):.1f}")


if __name__ == "__main__":
    main()

"""RL makes a real model better: SmolLM2-135M-Instruct on the copy-the-key suite, per seed, on CPU.

    python benchmarks/learn_real.py                                   # make learn-real: 3 seeds, 60 minutes of RL each
    python benchmarks/learn_real.py --jobs 3 --threads 1              # the seeds side by side, one torch thread each
    python benchmarks/learn_real.py --seeds 0 --minutes 15 --samples 1 -- --trainer.lr=2e-5   # overrides after --

Per seed, every phase through the product's own commands (``python -m lightning_agentrl ...``, subprocesses):

1. ``sft --config configs/learn_real.yaml``: the supervised warm start (its ``sft`` section) on the
   environment's own solutions of the training tasks; without it the model writes no call the environment
   accepts (0.000 submitted, ``benchmarks/results/real_baseline/real_baseline.json``).
2. ``evaluate <sft run> --split test``: the starting policy's held-out success (``baseline_success``).
3. ``fit --model.path=<sft run>/policy``: RL on the training tasks, stopped by SIGTERM after ``--minutes`` of
   wall time (the run finishes its step, checkpoints and exits; ``minutes`` and ``steps`` say how far it got);
   the last checkpoint is exported as the final policy.
4. ``evaluate`` of that policy on the same held-out tasks with the same sampler (``final_success``).

Writes ``benchmarks/results/learn_real/learn_real.json`` (``model``, ``task``, ``seeds`` of ``{seed, baseline_success,
final_success, minutes, steps}``, ``mean_gain``, the command and the commit) and ``learn_real.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/learn_real.yaml"
MODEL = "smollm2-135m-instruct"


def product(*args: str, log: Path, timeout_s: float | None = None) -> int:
    """``python -m lightning_agentrl ARGS`` with its output in ``log``; SIGTERM after ``timeout_s`` (the run
    checkpoints and exits 143; the config's ``trainer.stop_grace_s`` lets a slow step finish), SIGKILL if it is still
    alive 1,000 s later. Returns the exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "lightning_agentrl", *args], cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=1000)
            except subprocess.TimeoutExpired:
                process.kill()
                return process.wait()


def held_out(policy: Path, out: Path, samples: int, overrides: list[str]) -> dict:
    """``evaluate`` on the test split; the scores of ``evaluation.json``."""
    code = product("evaluate", str(policy), "--split", "test", "--samples", str(samples), "--out", str(out),
                   *overrides, log=out.with_suffix(".log"))
    if code != 0:
        raise SystemExit(f"evaluate {policy} failed with status {code}: see {out.with_suffix('.log')}")
    return json.loads((out / "evaluation.json").read_text())


def run_seed(seed: int, root: Path, *, minutes: float, samples: int, overrides: list[str]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    sft_dir, rl_dir = root / "sft", root / "rl"
    common = [f"--run.seed={seed}", *overrides]
    if product("sft", "--config", CONFIG, f"--run.dir={sft_dir}", *common, log=root / "sft.log") != 0:
        raise SystemExit(f"sft failed: see {root / 'sft.log'}")
    eval_overrides = [o for o in overrides if o.startswith(("--sandbox.", "--trainer.threads"))]
    baseline = held_out(sft_dir, root / "eval_baseline", samples, eval_overrides)
    started = time.monotonic()
    code = product("fit", "--config", CONFIG, f"--run.dir={rl_dir}", f"--model.path={sft_dir / 'policy'}", *common,
                   log=root / "fit.log", timeout_s=minutes * 60)
    elapsed = (time.monotonic() - started) / 60
    if code not in (0, 143):
        raise SystemExit(f"fit failed with status {code}: see {root / 'fit.log'}")
    final_policy = rl_dir / "policy"
    if not (final_policy / "config.json").exists():  # stopped by time: the newest checkpoint is the final policy
        final_policy = root / "final_policy"
        if product("export", str(rl_dir / "checkpoints" / "last.ckpt"), str(final_policy), log=root / "export.log"):
            raise SystemExit(f"export failed: see {root / 'export.log'}")
    steps = _steps(rl_dir)
    # the policy folder with the RL run's settings (the same sampler and tasks as the baseline's)
    final = held_out(final_policy, root / "eval_final", samples,
                     ["--config", str(rl_dir / "settings.yaml"), *eval_overrides])
    result = {"seed": seed, "baseline_success": baseline["success"], "final_success": final["success"],
              "baseline_submitted": baseline["submitted_frac"], "final_submitted": final["submitted_frac"],
              "minutes": round(elapsed, 1), "steps": steps, "episodes": final["episodes"]}
    (root / "result.json").write_text(json.dumps(result, indent=2) + "\n")  # kept if a later seed fails
    return result


def _steps(rl_dir: Path) -> int:
    import torch

    checkpoint = torch.load(rl_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return int(checkpoint["global_step"])


def plot(seeds: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"seed {s['seed']}\n{s['steps']} steps, {s['minutes']:.0f} min" for s in seeds]
    xs = range(len(seeds))
    ax.bar([x - 0.2 for x in xs], [s["baseline_success"] for s in seeds], 0.4, label="after sft (start of RL)")
    ax.bar([x + 0.2 for x in xs], [s["final_success"] for s in seeds], 0.4, label="after RL")
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock minutes of RL per seed")
    parser.add_argument("--samples", type=int, default=2, help="held-out episodes per test task (20 tasks)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every phase")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run side by side (each its own processes)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / f"learn_real-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "learn_real" / "learn_real.json")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    overrides = [f"--trainer.threads={args.threads}", *overrides]

    def one(seed: int) -> dict:
        result = run_seed(seed, args.run_dir / f"seed{seed}", minutes=args.minutes, samples=args.samples,
                          overrides=overrides)
        print(json.dumps(result), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each seed waits on its own subprocesses
        seeds = list(pool.map(one, [int(s) for s in args.seeds.split(",")]))
    gain = sum(s["final_success"] - s["baseline_success"] for s in seeds) / len(seeds)
    record = {
        "model": MODEL, "task": "tasks/learn (copy the key; held-out split: 20 tasks)",
        "command": "python benchmarks/learn_real.py " + shlex.join(argv),
        "seeds": seeds, "mean_gain": round(gain, 4),
        "concurrency": f"{args.jobs} seed(s) at a time, {args.threads} torch thread(s) each",
    }
    write_record(args.out, record, config=CONFIG, overrides=overrides, seed=[s["seed"] for s in seeds])
    plot(seeds, args.out.with_suffix(".png"), f"{MODEL} on {record['task']}: mean gain {gain:+.3f}")
    print(f"mean gain {gain:+.3f}; wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

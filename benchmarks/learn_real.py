"""RL makes a real model better: SmolLM2-135M-Instruct on the copy-the-key suite, per seed, on CPU.

    python benchmarks/learn_real.py                                   # make learn-real: 3 seeds, 60 minutes of RL each
    python benchmarks/learn_real.py --jobs 3 --threads 1              # the seeds side by side, one torch thread each
    python benchmarks/learn_real.py --seeds 0 --minutes 15 --samples 1 -- --trainer.lr=2e-5   # overrides after --
    python benchmarks/learn_real.py --jobs 3 --threads 1 --reuse --run-dir runs/learn_real-<time>  # finish a run's record

Per seed, every phase through the product's own commands (``python -m lightning_agentrl ...``, subprocesses):

1. ``sft --config configs/learn_real.yaml``: the supervised warm start (its ``sft`` section) on the
   environment's own solutions of the training tasks; without it the model writes no call the environment
   accepts (0.000 submitted, ``benchmarks/results/real_baseline/real_baseline.json``).
2. ``evaluate <sft run> --split test``: the starting policy's held-out success (``baseline_success``).
3. ``fit --model.path=<sft run>/policy``: RL on the training tasks, stopped by SIGTERM after ``--minutes`` of
   wall time (the run finishes its step, checkpoints and exits; ``minutes`` and ``steps`` say how far it got);
   the last checkpoint is exported as the final policy.
4. ``evaluate`` of that policy on the same held-out tasks with the same sampler (``final_success``).
5. The step under way at the budget finishes after it, so the final policy can land past ``--minutes``: the newest
   checkpoint written within the budget is exported and evaluated the same way (``within_budget``).

Writes ``benchmarks/results/learn_real/learn_real.json`` (``model``, ``task``, ``seeds`` of ``{seed, baseline_success,
final_success, minutes, steps}`` for the policy within the budget with the final one under ``after_budget`` and the
commit each phase ran, ``mean_gain`` within the budget, ``mean_gain_after_budget``, the command and the commit) and
``learn_real.png``.
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

from benchmarks.record import provenance, write_record

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/learn_real.yaml"
MODEL = "smollm2-135m-instruct"


def product(*args: str, log: Path, timeout_s: float | None = None) -> int:
    """``python -m lightning_agentrl ARGS`` with its output in ``log``; SIGTERM after ``timeout_s`` (the run
    checkpoints and exits 143; the config's ``trainer.stop_grace_s`` lets a slow step finish), SIGKILL if it is still
    alive 1,000 s later. Returns the exit status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # the code this phase runs: the commit and dirty flag at its start, beside its log (collected into the record)
    log.with_name(log.name + ".provenance.json").write_text(json.dumps({"phase": args[0], **provenance(list(args))}))
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


def run_seed(seed: int, root: Path, *, minutes: float, samples: int, overrides: list[str], reuse: bool) -> dict:
    """One seed: its phases, or (``reuse``) the result a previous run wrote in ``root``; then the policy at the
    budget, if the run's last step ended past it."""
    eval_overrides = [o for o in overrides if o.startswith(("--sandbox.", "--trainer.threads"))]
    done = root / "result.json"
    if reuse and done.exists():
        result = json.loads(done.read_text())
    else:
        result = train_and_evaluate(seed, root, minutes=minutes, samples=samples, overrides=overrides,
                                    eval_overrides=eval_overrides)
    if "within_budget" not in result:
        result["within_budget"] = within_budget(root, result, minutes=minutes, samples=samples,
                                                eval_overrides=eval_overrides)
    result["phases"] = {p.name.removesuffix(".provenance.json"): json.loads(p.read_text())
                        for p in sorted(root.glob("*.provenance.json"))}
    done.write_text(json.dumps(result, indent=2) + "\n")  # kept if a later seed fails
    return result


def summary(result: dict) -> dict:
    """A seed's entry of the record: ``final_success``, ``minutes`` and ``steps`` of the policy the time budget
    bought (the newest checkpoint written within it; None where none was), the run's final policy, which lands
    after the budget when its last step ends past it, under ``after_budget``."""
    budget = result.get("within_budget") or {}
    return {"seed": result["seed"], "baseline_success": result["baseline_success"],
            "final_success": budget.get("success"), "minutes": budget.get("minutes"), "steps": budget.get("step"),
            "baseline_submitted": result["baseline_submitted"], "final_submitted": budget.get("submitted"),
            "checkpoint": budget.get("checkpoint"),
            "after_budget": {"final_success": result["final_success"], "final_submitted": result["final_submitted"],
                             "minutes": result["minutes"], "steps": result["steps"]},
            "episodes": result["episodes"], "phases": result.get("phases", {})}


def train_and_evaluate(seed: int, root: Path, *, minutes: float, samples: int, overrides: list[str],
                       eval_overrides: list[str]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    sft_dir, rl_dir = root / "sft", root / "rl"
    common = [f"--run.seed={seed}", *overrides]
    if product("sft", "--config", CONFIG, f"--run.dir={sft_dir}", *common, log=root / "sft.log") != 0:
        raise SystemExit(f"sft failed: see {root / 'sft.log'}")
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
    steps = _steps(rl_dir / "checkpoints" / "last.ckpt")
    # the policy folder with the RL run's settings (the same sampler and tasks as the baseline's)
    final = held_out(final_policy, root / "eval_final", samples,
                     ["--config", str(rl_dir / "settings.yaml"), *eval_overrides])
    return {"seed": seed, "baseline_success": baseline["success"], "final_success": final["success"],
            "baseline_submitted": baseline["submitted_frac"], "final_submitted": final["submitted_frac"],
            "minutes": round(elapsed, 1), "steps": steps, "episodes": final["episodes"]}


def within_budget(root: Path, result: dict, *, minutes: float, samples: int, eval_overrides: list[str]) -> dict | None:
    """The policy at the time budget: the newest checkpoint written within ``minutes`` of the RL run's start (its
    settings file), evaluated like the others. The run is stopped by SIGTERM at the budget and finishes the step
    under way, so its final policy can land minutes past it; this is the policy the budget itself bought. None
    when no checkpoint was written in time."""
    rl_dir = root / "rl"
    started = (rl_dir / "settings.yaml").stat().st_mtime
    in_time = [c for c in (rl_dir / "checkpoints").glob("*.ckpt") if c.stat().st_mtime - started <= minutes * 60]
    if not in_time:
        return None
    newest = max(in_time, key=lambda c: c.stat().st_mtime)
    at = round((newest.stat().st_mtime - started) / 60, 1)
    if newest.name == "last.ckpt":  # the whole run ended within the budget: its final policy
        return {"checkpoint": newest.name, "step": result["steps"], "minutes": at,
                "success": result["final_success"], "submitted": result["final_submitted"]}
    policy = root / "budget_policy"
    if not (policy / "config.json").exists() and product("export", str(newest), str(policy), log=root / "export_budget.log"):
        raise SystemExit(f"export failed: see {root / 'export_budget.log'}")
    scores = held_out(policy, root / "eval_budget", samples, ["--config", str(rl_dir / "settings.yaml"), *eval_overrides])
    return {"checkpoint": newest.name, "step": _steps(newest), "minutes": at,
            "success": scores["success"], "submitted": scores["submitted_frac"]}


def _steps(checkpoint_path: Path) -> int:
    import torch

    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    return int(checkpoint["global_step"])


def plot(seeds: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = []
    for s in seeds:
        budget = s.get("within_budget") or {}
        labels.append(f"seed {s['seed']}\nbudget: step {budget.get('step', '-')}, {budget.get('minutes', 0):.0f} min\n"
                      f"final: step {s['steps']}, {s['minutes']:.0f} min")
    xs = range(len(seeds))
    ax.bar([x - 0.27 for x in xs], [s["baseline_success"] for s in seeds], 0.27, label="after sft (start of RL)")
    budget = [s["within_budget"]["success"] if s.get("within_budget") else 0.0 for s in seeds]
    ax.bar(list(xs), budget, 0.27, label="RL: newest checkpoint within the time budget")
    ax.bar([x + 0.27 for x in xs], [s["final_success"] for s in seeds], 0.27, label="RL: final policy")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylim(0, 1.35)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("held-out success")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8, ncols=2)
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
    parser.add_argument("--reuse", action="store_true",
                        help="take each seed's result from --run-dir where a previous run wrote it (seed*/result.json)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / f"learn_real-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "learn_real" / "learn_real.json")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    overrides = [f"--trainer.threads={args.threads}", *overrides]

    def one(seed: int) -> dict:
        result = run_seed(seed, args.run_dir / f"seed{seed}", minutes=args.minutes, samples=args.samples,
                          overrides=overrides, reuse=args.reuse)
        print(json.dumps(result), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each seed waits on its own subprocesses
        seeds = list(pool.map(one, [int(s) for s in args.seeds.split(",")]))
    entries = [summary(s) for s in seeds]
    in_time = [e["final_success"] - e["baseline_success"] for e in entries if e["final_success"] is not None]
    gain = round(sum(in_time) / len(in_time), 4) if len(in_time) == len(entries) else None
    gain_after = round(sum(e["after_budget"]["final_success"] - e["baseline_success"] for e in entries) / len(entries), 4)
    record = {
        "model": MODEL, "task": "tasks/learn (copy the key; held-out split: 20 tasks)",
        "command": "python benchmarks/learn_real.py " + shlex.join(argv),
        "seeds": entries, "mean_gain": gain, "mean_gain_after_budget": gain_after, "budget_minutes": args.minutes,
        "concurrency": f"{args.jobs} seed(s) at a time, {args.threads} torch thread(s) each",
    }
    write_record(args.out, record, config=CONFIG, overrides=overrides, seed=[s["seed"] for s in seeds])
    plot(seeds, args.out.with_suffix(".png"), f"{MODEL}, copy-the-key, held out: mean gain "
         + (f"{gain:+.3f} within {args.minutes:.0f} min" if gain is not None else "none: no checkpoint in time")
         + f", {gain_after:+.3f} after")
    print(f"mean gain {gain} within the budget, {gain_after:+.3f} after it; wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

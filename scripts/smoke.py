"""`make smoke`: two CPU training steps that must train on a real gradient, or fail.

    python scripts/smoke.py --run.dir=runs/smoke-1                 # make smoke
    python scripts/smoke.py --run.dir=runs/smoke-2 --rollout.group_size=4 --warm-start-steps 80

A randomly initialized model never writes a valid tool call, so GRPO on it sees reward 0 in every
episode: every group's advantages are exactly zero and the steps train nothing. The smoke run
therefore starts from a short format-only warm start (``benchmarks/warm_start.py``, as in ``make
learn`` but shorter and without its echo demonstrations: read key.txt, write a RANDOM value), which leaves
the policy at chance (1 in 4) on the copy-the-key suite (``tasks/learn``): a group of 8 then has all
rewards equal with probability 0.75^8 + 0.25^8 = 0.10, and the smoke run's 4 groups all do with
probability 1e-4. The steps:

1. the warm start, saved in ``<run.dir>/warm_start/`` (with its record, ``warm_start.json``);
2. ``python -m lightning_agentrl fit --config configs/smoke.yaml --model.path=<run.dir>/warm_start``
   with the other arguments as settings overrides: the real stack (sandbox service on loopback,
   torch engine, Lightning, MLflow), its output and exit status;
3. the run's saved batches (``<run.dir>/trajectories/step_*.jsonl``) read back: the number of groups
   with reward variance (whose advantages are not all zero) is printed, and none is exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning_agentrl.envs.learn_tasks import KEY_FILE  # noqa: E402
from lightning_agentrl.rollout.buffer import has_reward_variance  # noqa: E402
from lightning_agentrl.settings import SettingsError, load_settings  # noqa: E402
from lightning_agentrl.tasks import load_tasks  # noqa: E402
from lightning_agentrl.trajectory import load_trajectories  # noqa: E402

CONFIG = REPO / "configs" / "smoke.yaml"
# 50 steps of 8 (about 20 s on 2 cores): every episode of the smoke run then keeps the call format to
# its submit. 40 steps at lr 2e-3 left half the episodes with broken calls; 25 of 16 nearly all.
WARM_START_STEPS, WARM_START_BATCH, WARM_START_LR = 50, 8, 3e-3


def groups_with_variance(run_dir: str | Path, since: float = 0.0) -> tuple[int, int]:
    """(groups with reward variance, groups) over the saved batches of the run written at or after ``since``
    (a time stamp: a resumed run counts only the steps it trained)."""
    num_groups = num_varied = 0
    for path in sorted((Path(run_dir) / "trajectories").glob("step_*.jsonl")):
        if path.stat().st_mtime < since:
            continue
        groups: dict[int, list] = {}
        for trajectory in load_trajectories(path):
            groups.setdefault(trajectory.group_id, []).append(trajectory)
        num_groups += len(groups)
        num_varied += sum(has_reward_variance(group) for group in groups.values())
    return num_varied, num_groups


def check_copy_the_key(settings) -> None:
    """The warm start's demonstrations read key.txt: refuse another environment or suite with the setting named."""
    if settings.env.kind != "coding":
        raise SettingsError(f"env.kind: the smoke run's warm start is for the coding environment, not {settings.env.kind}")
    try:
        tasks = load_tasks(settings.env.tasks, split="train")
    except (ValueError, FileNotFoundError) as err:
        raise SettingsError(f"env.tasks: {err}") from None
    if not tasks or any(KEY_FILE not in task.files for task in tasks):
        raise SettingsError(f"env.tasks: the smoke run's warm start needs the copy-the-key suite (tasks/learn), "
                            f"whose tasks hold {KEY_FILE}; {settings.env.tasks} does not")


def warm_started_model(settings, steps: int, batch_size: int = WARM_START_BATCH, lr: float = WARM_START_LR) -> Path:
    """The format-only warm start of ``settings``' model, saved (with ``warm_start.json``) in ``<run.dir>/warm_start``;
    one already there is kept (a rerun into the folder: ``fit`` refuses it or resumes it)."""
    from benchmarks.warm_start import warm_start
    from lightning_agentrl.envs.learn_tasks import LearnSuiteSpec
    from lightning_agentrl.models.resolve import resolve_model_path

    out = Path(settings.run.dir) / "warm_start"
    if (out / "warm_start.json").exists():
        print(f"warm start: {out} exists, kept", file=sys.stderr)
        return out
    if settings.trainer.threads is not None:
        import torch

        torch.set_num_threads(settings.trainer.threads)
    keys = [task.files[KEY_FILE].strip() for task in load_tasks(settings.env.tasks, split="train")]
    result = warm_start(resolve_model_path(settings), out, keys, LearnSuiteSpec(), steps=steps, batch_size=batch_size,
                        lr=lr, seed=settings.run.seed, system_prompt=settings.env.system_prompt)
    record = {"steps": steps, "batch_size": batch_size, "lr": lr, "final_loss": result.final_loss,
              "seconds": round(result.seconds, 1)}
    (out / "warm_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"warm start: {steps} steps of {batch_size} demonstrations, final loss {result.final_loss:.3f}, "
          f"{result.seconds:.0f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    from lightning_agentrl.__main__ import main as cli

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Other arguments are settings overrides (--section.field=value).")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                        help=f"supervised steps of {WARM_START_BATCH} demonstrations (default {WARM_START_STEPS})")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    started, started_at = time.monotonic(), time.time()
    try:
        settings = load_settings(args.config, overrides)
        check_copy_the_key(settings)
    except SettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    warm = warm_started_model(settings, args.warm_start_steps)
    status = cli(["fit", "--config", args.config, *overrides, f"--model.path={warm}"])
    if status != 0:
        return status
    num_varied, num_groups = groups_with_variance(settings.run.dir, since=started_at)
    print(f"smoke: {num_varied} of {num_groups} groups had reward variance "
          f"({time.monotonic() - started:.0f} s, warm start included)", file=sys.stderr)
    if num_varied == 0:
        what = "every advantage was 0" if num_groups else "no step was trained by this call (a finished run resumed?)"
        print(f"error: smoke: no group had reward variance: {what}, so nothing was trained", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

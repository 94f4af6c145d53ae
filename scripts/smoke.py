"""`make smoke`: two CPU training steps that must train on a real gradient, or fail.

    python scripts/smoke.py --run.dir=runs/smoke-1                 # make smoke
    python scripts/smoke.py --run.dir=runs/smoke-2 --rollout.group_size=4 --warm-start-steps 30

A randomly initialized model never writes a valid tool call, so GRPO on it sees reward 0 in every
episode: every group's advantages are exactly zero and the steps train nothing. The smoke run
therefore starts from a short format-only warm start, the one of ``make learn``
(``benchmarks/warm_start.py``: demonstrations read key.txt and write a RANDOM value), which leaves
the policy at chance (1 in 4) on the copy-the-key suite (``tasks/learn``): groups of 8 then almost
always mix successes and failures. The steps:

1. the warm start, saved in ``<run.dir>/warm_start/`` (with its record, ``warm_start.json``);
2. ``python -m lightning_agentrl fit --config configs/smoke.yaml --model.path=<run.dir>/warm_start``
   with the other arguments as settings overrides: the real stack (sandbox service on loopback,
   torch engine, Lightning, MLflow), its output and exit status;
3. the run's saved batches (``<run.dir>/trajectories/step_*.jsonl``) read back: the number of groups
   with reward variance (whose advantages are not all zero) is printed, and none is exit status 1.
"""

from __future__ import annotations

import argparse
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


def groups_with_variance(run_dir: str | Path) -> tuple[int, int]:
    """(groups with reward variance, groups) over every saved batch of the run."""
    num_groups = num_varied = 0
    for path in sorted((Path(run_dir) / "trajectories").glob("step_*.jsonl")):
        groups: dict[int, list] = {}
        for trajectory in load_trajectories(path):
            groups.setdefault(trajectory.group_id, []).append(trajectory)
        num_groups += len(groups)
        num_varied += sum(has_reward_variance(group) for group in groups.values())
    return num_varied, num_groups


def check_copy_the_key(settings) -> None:
    """The warm start's demonstrations read key.txt: refuse another suite with the setting named."""
    tasks = load_tasks(settings.env.tasks, split="train")
    if not tasks or any(KEY_FILE not in task.files for task in tasks):
        raise SettingsError(f"env.tasks: the smoke run's warm start needs the copy-the-key suite (tasks/learn), "
                            f"whose tasks hold {KEY_FILE}; {settings.env.tasks} does not")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.learn_cpu import warm_started_model
    from lightning_agentrl.__main__ import main as cli

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Other arguments are settings overrides (--section.field=value).")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--warm-start-steps", type=int, default=50, help="supervised steps of 16 demonstrations")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        settings = load_settings(args.config, overrides)
        check_copy_the_key(settings)
    except SettingsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_dir = Path(settings.run.dir)
    warm = warm_started_model(settings, run_dir / "warm_start", steps=args.warm_start_steps, seed=settings.run.seed)
    print(f"warm start: {warm['steps']} steps, final loss {warm['final_loss']:.3f}, {warm['seconds']:.0f} s",
          file=sys.stderr)
    status = cli(["fit", "--config", args.config, *overrides, f"--model.path={warm['path']}"])
    if status != 0:
        return status
    num_varied, num_groups = groups_with_variance(run_dir)
    print(f"smoke: {num_varied} of {num_groups} groups had reward variance "
          f"({time.monotonic() - started:.0f} s, warm start included)", file=sys.stderr)
    if num_varied == 0:
        print("error: smoke: no group had reward variance: every advantage was 0 and no step trained anything",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

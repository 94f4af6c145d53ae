"""Held-out success of a real coding harness (mini-swe-agent, configs/mini_swe_agent.yaml) driven by the real model
``smollm2-135m-instruct``, each episode in its task's sandbox, scored by the hidden tests.

    python benchmarks/harness_eval.py [--tasks 4] [--samples 1] [--step-limit 3] [--max-new-tokens 96]

The first ``--tasks`` held-out (``split: test``) tasks of tasks/bugfix, ``--samples`` episodes each, one torch
thread. Reported: ``success`` (mean hidden-test reward), ``submitted_frac`` (episodes whose harness exited by
itself and was scored), ``harness_submit_frac`` (episodes in which the model issued mini-swe-agent's own submit
command, ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``), the terminations, calls and minutes. Writes
benchmarks/results/harness_eval/harness_eval.json and prints one line.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def held_out_suite(folder: Path, count: int) -> list[str]:
    """A suite of the first ``count`` held-out bug-fix tasks (sorted by id), copied into ``folder``."""
    chosen = [p.parent for p in sorted((REPO / "tasks" / "bugfix").glob("*/task.json"))
              if json.loads(p.read_text()).get("split") == "test"][:count]
    shutil.rmtree(folder, ignore_errors=True)
    for task in chosen:
        shutil.copytree(task, folder / task.name)
    return [task.name for task in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--step-limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "harness_eval")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lightning_agentrl.evaluate import evaluate_policy
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.trajectory import load_trajectories

    names = held_out_suite(args.out / "suite", args.tasks)
    command = load_settings(REPO / "configs" / "mini_swe_agent.yaml", []).env.agent_command
    command = [*command[:-1], command[-1].replace("agent.step_limit=4", f"agent.step_limit={args.step_limit}")]
    started = time.monotonic()
    overrides = [f"--env.tasks={args.out / 'suite'}", f"--env.agent_command={json.dumps(command)}",
                 f"--sandbox.tools_dir={REPO / '.tools'}", "--trainer.threads=1",
                 f"--engine.max_new_tokens={args.max_new_tokens}", "--env.generation_timeout_s=1200",
                 "--env.episode_timeout_s=3600", f"--env.max_turns={args.step_limit + 2}"]
    scores = evaluate_policy(MODEL, split="test", samples=args.samples, config=REPO / "configs" / "mini_swe_agent.yaml",
                             out=args.out / "eval", overrides=overrides)
    trajectories = load_trajectories(args.out / "eval" / "trajectories.jsonl")
    decode = _decoder()
    said_submit = [any(SUBMIT in decode(s.token_ids[t.action_start:t.action_end]) for s in tr.segments for t in s.turns)
                   for tr in trajectories]
    record = {
        "model": MODEL, "harness": "mini-swe-agent 2.4.6 (configs/mini_swe_agent.yaml)", "threads": 1,
        "machine": f"{platform.machine()}, 1 torch thread, 2 shared cores",
        "command": f"python benchmarks/harness_eval.py --tasks={args.tasks} --samples={args.samples} "
                   f"--step-limit={args.step_limit} --max-new-tokens={args.max_new_tokens}",
        "tasks": names, "success": scores["success"], "submitted_frac": scores["submitted_frac"],
        "harness_submit_frac": sum(said_submit) / max(len(trajectories), 1), "episodes": scores["episodes"],
        "infra_errors": scores["infra_errors"],
        "terminations": dict(collections.Counter(str(t.termination.value) for t in trajectories if t.termination)),
        "calls_per_episode": [t.info.get("gateway_calls") for t in trajectories],
        "prefix_breaks": sum(t.info.get("prefix_breaks", 0) for t in trajectories),
        "minutes": round((time.monotonic() - started) / 60, 2),
    }
    path = REPO / "benchmarks" / "results" / "harness_eval" / "harness_eval.json"
    write_record(path, record, config="configs/mini_swe_agent.yaml", overrides=overrides, seed=None)
    print(f"mini-swe-agent + {MODEL}: success {record['success']:.3f} submitted {record['submitted_frac']:.3f} "
          f"harness submit {record['harness_submit_frac']:.3f} over {record['episodes']} held-out episodes, "
          f"{record['minutes']:.1f} min, terminations {record['terminations']}; wrote {path}")


def _decoder():
    from transformers import AutoTokenizer

    from lightning_agentrl.evaluate import resolve_policy

    return AutoTokenizer.from_pretrained(resolve_policy(MODEL)[0]).decode


if __name__ == "__main__":
    main()

"""Held-out success of the base SmolLM2-135M-Instruct (``model.path: smollm2-135m-instruct``) before any training.

    python benchmarks/real_baseline.py [--episodes 20] [--tasks learn,keydoor,rooms] [--engine torch] [--temperature T]

For each task, ``evaluate`` plays about ``episodes`` held-out episodes (``--samples`` per held-out task,
rounded up) with the product's own prompts (the environments' built-in tool text: the chat template renders
no ``tools=``) and the task's config's sampler, one torch thread. Reported per task: ``success`` (mean final
reward), ``solved``, ``submitted_frac``, the termination breakdown, minutes, and the first action of the
first episodes (what the model writes). Writes benchmarks/results/real_baseline[_<engine>].json and prints one
line per task. A task whose starting success is between 0.05 and 0.6 is one RL can be measured on.
"""

from __future__ import annotations

import argparse
import collections
import math
import platform
import time
from pathlib import Path

import torch

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
# task -> (config, held-out tasks in it, overrides). The generation budgets suit a chatty instruct model;
# episode budgets are the configs' own. generation_timeout_s: long enough that no episode ends by timeout
# on 2 busy cores (the breakdown would show it).
TASKS = {
    "learn": ("configs/smoke.yaml", 20, ["--env.system_prompt=null", "--engine.max_new_tokens=64"]),
    "keydoor": ("configs/keydoor.yaml", 3, ["--engine.max_new_tokens=64", "--env.max_turns=12"]),
    "rooms": ("configs/credit_gigpo.yaml", 5, ["--engine.max_new_tokens=16"]),
}


def run_task(name: str, episodes: int, engine: str, out: Path, temperature: float | None) -> dict:
    from lightning_agentrl.evaluate import evaluate_policy
    from lightning_agentrl.trajectory import load_trajectories

    config, num_tasks, overrides = TASKS[name]
    samples = math.ceil(episodes / num_tasks)
    started = time.monotonic()
    scores = evaluate_policy(
        MODEL, split="test", samples=samples, config=REPO / config, out=out / name,
        overrides=[*overrides, f"--engine.kind={engine}", "--trainer.threads=1", "--env.generation_timeout_s=1200",
                   "--env.episode_timeout_s=3600", f"--rollout.max_in_flight={max(samples * num_tasks, 8)}",
                   *([f"--engine.temperature={temperature}"] if temperature is not None else []),
                   # vLLM on CPU: room for every episode's context (64 MiB holds about 1,250 tokens of this model)
                   *(["--engine.vllm_kv_cache_bytes=1073741824"] if engine == "vllm" else [])],
    )
    trajectories = load_trajectories(out / name / "trajectories.jsonl")
    return {
        **scores,
        "config": config, "samples_per_task": samples, "overrides": overrides,
        "minutes": round((time.monotonic() - started) / 60, 2),
        "terminations": dict(collections.Counter(str(t.termination.value) for t in trajectories if t.termination)),
        "first_actions": [first_action(t) for t in trajectories[:4]],
    }


def first_action(trajectory) -> str:
    from transformers import AutoTokenizer

    from lightning_agentrl.evaluate import resolve_policy

    tokenizer = AutoTokenizer.from_pretrained(resolve_policy(MODEL)[0])
    segment = trajectory.segments[0]
    turn = segment.turns[0]
    return tokenizer.decode(segment.token_ids[turn.action_start : turn.action_end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--temperature", type=float, default=None, help="default: each config's own sampler")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "real_baseline")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for name in args.tasks.split(","):
        results[name] = run_task(name, args.episodes, args.engine, args.out, args.temperature)
        r = results[name]
        print(f"{name}: success {r['success']:.3f} solved {r['solved']:.3f} submitted {r['submitted_frac']:.3f} "
              f"over {r['episodes']} episodes, {r['minutes']:.1f} min, terminations {r['terminations']}", flush=True)
    record = {
        "model": MODEL, "engine": args.engine, "threads": 1, "machine": f"{platform.machine()}, {torch.get_num_threads()} "
        "torch thread(s), 2 shared cores", "command": "python benchmarks/real_baseline.py " + " ".join(
            f"--{k}={v}" for k, v in (("episodes", args.episodes), ("tasks", args.tasks), ("engine", args.engine),
                                      ("temperature", args.temperature)) if v is not None),
        "tasks": results,
    }
    suffix = ("" if args.engine == "torch" else f"_{args.engine}") + (
        "" if args.temperature is None else f"_t{args.temperature:g}")
    path = REPO / "benchmarks" / "results" / "real_baseline" / f"real_baseline{suffix}.json"
    write_record(path, record, config=None, overrides=None, seed=None)  # each task names its config and overrides
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

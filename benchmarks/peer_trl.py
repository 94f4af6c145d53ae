"""This project's ``fit`` against TRL's ``GRPOTrainer`` on the same GRPO step, side by side.

    python benchmarks/peer_trl.py                      # make bench (needs the `bench` extra: trl)
    python benchmarks/peer_trl.py --steps 3 --warmup 1
    python benchmarks/peer_trl.py --model smollm2-135m-instruct --threads 1 --rounds 1 --steps 3   # the 135M model

Both sides train the same model (``--model``, a ``model.path``: by default the project's tiny local model,
``tiny``; ``smollm2-135m-instruct`` is the named 135M model, converted once into a local HF folder that the
TRL side loads too) on CPU with the same number of
torch threads (``--threads``, 2 by default; ``OMP_NUM_THREADS`` too, and each side records the count
its process ran with): 8 prompts x 8 generations x at most 64 new tokens per optimizer step, beta 0
(no reference model), lr 1e-5, sampling at temperature 1, no vLLM. Each side runs in its own
subprocess, ``--warmup`` steps and then ``--steps`` measured ones; a step's time is the wall time
between the ends of two consecutive optimizer steps (generation, scoring, forward/backward,
optimizer, and whatever the trainer does between steps, checkpoints included), and the reported
figure is the median. Throughput is completion (generated) tokens per second of step time.

- TRL: ``GRPOTrainer`` with its default loss, prompts "Repeat the digit N:" (N random, as a chat
  message), reward 1 when the completion contains N, per-device batch 64 with 8 generations (one
  generation round per step), gradient checkpointing off, ``transformers.generate``, in float32
  like the project (``bf16=False``; TRL's own default is bf16 autocast, ``--trl-bf16``, which on a
  CPU without bf16 instructions is several times slower).
- This project: ``fit`` with its torch engine and the benchmark's own environment,
  ``env.kind=benchmarks.peer_env:RepeatDigitEnv``: the same user message, no system prompt, one
  action per episode, the same reward, and no observation after the action. Its tasks are the
  digits the TRL side's sampler gave each step, laid out so that the project's task order gives
  step k the same 8 prompts (the record checks it: ``same_prompts_per_step``). Everything else is the
  defaults a user gets (``trainer.micro_batch_tokens``, a checkpoint every 50 steps, so none within
  a default run's 7 steps, and the final one after the last step's end; MLflow on). Its torch engine
  samples every row of a decoding step in one batched inverse-CDF draw (TRL: ``torch.multinomial``
  inside ``transformers.generate``).

The sides run alternately, ``--rounds`` times each (TRL, project, TRL, project, ...), so that both
see the same spread of load on a shared machine; the reported step time of a side is the median
over all its measured steps, and the record keeps each round's median and the load around it.
A load average above the machine's cores (before or after any round) makes the comparison unsound:
with more runnable threads than cores, multi-threaded torch ops wait on each other and a side's step
time can grow several-fold, by different factors for the two sides. The record then says
``load_over_cores: true`` and the printed line ends with a warning; rerun on an idle machine.

Writes ``benchmarks/results/peer_trl/peer_trl.json`` (``peer_trl_<model>.json`` for another ``--model``: both
sides' step times, tokens, settings, peak memory and the project's lag-0 engine-vs-trainer log-prob mismatch,
and the ratio) and ``..._profile.json`` beside it (the share of each side's step taken by each stage: the
project's from a callback's timestamps and the episodes' own timings, TRL's from timers around its
generation, loss, backward and optimizer step), and prints one line. ``--trl-from`` takes the TRL side of an
earlier record of the same model and shape instead of running it again (the record names it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.record import write_record

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "peer_trl"
CACHE_DIR = REPO / ".cache" / "lightning_agentrl"
NUM_PROMPTS, NUM_GENERATIONS, NEW_TOKENS, LR, THREADS = 8, 8, 64, 1e-5, 2  # THREADS: --threads' default
ENV_KIND = "benchmarks.peer_env:RepeatDigitEnv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps per side before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tiny",
                        help="model.path of both sides: tiny (default) or a named model such as smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating TRL and project")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads of both sides (the same)")
    parser.add_argument("--trl-python", default=sys.executable,
                        help="interpreter with trl installed (the `bench` extra); default: this one")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL's own default, bf16 autocast (off: float32, the project's default precision)")
    parser.add_argument("--project-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a settings override for the project side only, e.g. rollout.max_staleness=1 "
                        "(rollout overlapped with training; then not the same on-policy step as TRL's); repeatable")
    parser.add_argument("--trl-from", default=None, metavar="RECORD",
                        help="take the TRL side from an earlier record of the same --model, --seed, --threads, "
                        "--warmup and --steps (and its _profile.json) instead of running it again: for a change on "
                        "the project side only; the record names it and its load")
    parser.add_argument("--run-dir", default=None, help="the project's run folder; default runs/peer_trl-<time>")
    parser.add_argument("--out", default=None,
                        help="the record; default benchmarks/results/peer_trl/peer_trl.json, peer_trl_<model>.json "
                        "for another --model")
    parser.add_argument("--side", choices=["trl", "project"], help=argparse.SUPPRESS)  # one side, in a subprocess
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", help=argparse.SUPPRESS)  # the project side's tasks file
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)  # the TRL side's local folder of --model
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step's time has no previous step end)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    args.out = args.out or str(RESULTS / ("peer_trl.json" if args.model == "tiny" else f"peer_trl_{short_name(args.model)}.json"))
    return args


def short_name(model: str) -> str:
    """``smollm2-135m-instruct`` -> ``smollm2``; a folder -> its name's first part."""
    return Path(model).name.split("-")[0].lower() or "model"


def model_folder(model: str) -> str:
    """The local HF folder of a ``model.path``, as ``fit`` resolves it (a named model converted once)."""
    from lightning_agentrl.models.resolve import resolve_model_path
    from lightning_agentrl.settings import load_settings

    return resolve_model_path(load_settings(None, [f"--model.path={model}", f"--model.cache_dir={CACHE_DIR}"]))


def step_times(ends: list[float], warmup: int) -> list[float]:
    """Durations between consecutive optimizer-step ends, the warm-up steps left out."""
    return [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:], strict=False)]


# -- TRL side -------------------------------------------------------------------------------------
def time_trl_stages(trainer, steps: list[dict]) -> None:
    """Wrap the TRL trainer's stages (on this instance) with timers; each optimizer step appends one dict of
    seconds to ``steps``: ``generation`` (``_generate``: ``transformers.generate`` and decoding),
    ``scoring_and_rest_of_rollout`` (rewards, advantages, batch assembly around it), ``forward``
    (``compute_loss``: the log-prob forward and the loss), ``backward``, and (from the step clock's optimizer
    hooks) ``optimizer`` (``optimizer.step()``)."""
    current = {"generation": 0.0, "rollout": 0.0, "forward": 0.0, "backward": 0.0}

    def timed(key: str, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                current[key] += time.perf_counter() - start
        return wrapper

    trainer._generate = timed("generation", trainer._generate)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    trainer.compute_loss = timed("forward", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)

    def on_step_end(optimizer_s: float) -> None:
        steps.append({"generation": current["generation"],
                      "scoring_and_rest_of_rollout": current["rollout"] - current["generation"],
                      "forward": current["forward"], "backward": current["backward"], "optimizer": optimizer_s})
        current.update(dict.fromkeys(current, 0.0))

    trainer.stage_step_end = on_step_end


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.peer_env import prompt_text
    torch.set_num_threads(args.threads)
    model_path = args.model_dir
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    draw = random.Random(args.seed)
    digits = [str(draw.randrange(10)) for _ in range(NUM_PROMPTS * (args.warmup + args.steps) * 4)]
    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": prompt_text(d)}] for d in digits],
        "digit": digits,
    })
    group_digits: list[str] = []  # the prompt of each group, in the order the sampler gave them

    def contains_digit(completions, digit, **_) -> list[float]:
        group_digits.extend(digit[::NUM_GENERATIONS])
        return [float(d in c[0]["content"]) for c, d in zip(completions, digit, strict=True)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.completion_lengths: list[float] = []

        def on_pre_optimizer_step(self, *_, **__):
            self.optimizer_from = time.perf_counter()

        def on_optimizer_step(self, *_, **__):
            self.optimizer_s = time.perf_counter() - self.optimizer_from

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())
            trainer.stage_step_end(self.optimizer_s)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                self.completion_lengths.append(logs["completions/mean_length"])

    batch = NUM_PROMPTS * NUM_GENERATIONS
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl-"),
        per_device_train_batch_size=batch, num_generations=NUM_GENERATIONS, max_completion_length=NEW_TOKENS,
        steps_per_generation=1, beta=0.0, learning_rate=LR, gradient_checkpointing=False, use_vllm=False,
        use_cpu=True, max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
        temperature=1.0, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, bf16=args.trl_bf16,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), reward_funcs=contains_digit,
        args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock],
    )
    stages: list[dict] = []
    time_trl_stages(trainer, stages)
    trainer.train()
    times = step_times(clock.ends, args.warmup)
    lengths = clock.completion_lengths[args.warmup :]
    prompt = tokenizer(tokenizer.apply_chat_template(dataset[0]["prompt"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    import trl

    return {
        "version": f"trl {trl.__version__}",
        "torch_threads": torch.get_num_threads(),  # after training: what its ops ran with
        "step_s": times,
        "stages": stages[args.warmup :],
        "completion_tokens_per_step": [round(n * batch, 1) for n in lengths],
        "prompt_tokens_mean": len(prompt),
        "group_digits": group_digits,
        "settings": {"per_device_train_batch_size": batch, "num_generations": NUM_GENERATIONS,
                     "max_completion_length": NEW_TOKENS, "beta": 0.0, "learning_rate": LR,
                     "loss_type": config.loss_type, "use_vllm": False, "gradient_checkpointing": False,
                     "bf16": args.trl_bf16, "torch_threads": args.threads},
    }


# -- project side ---------------------------------------------------------------------------------
def project_tasks(group_digits: list[str], seed: int, path: Path) -> Path:
    """The project's tasks file: group ``g`` of the project's task order gets ``group_digits[g]``,
    the TRL side's prompt for its group ``g`` (the order is the rollout service's own)."""
    from types import SimpleNamespace

    from benchmarks.peer_env import write_tasks
    from lightning_agentrl.rollout.service import RolloutService

    order = SimpleNamespace(tasks=list(range(len(group_digits))), plan=SimpleNamespace(seed=seed))
    digits = [""] * len(group_digits)
    for group, digit in enumerate(group_digits):
        digits[RolloutService.task_for_group(order, group)] = digit
    return write_tasks(path, digits)


def project_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    def chosen(key: str, default: str) -> str:  # the last --project-set of key, else the default
        return ([default] + [o.split("=", 1)[1] for o in args.project_set if o.startswith(f"{key}=")])[-1]

    # the torch engine decodes every episode in one batch; the vLLM kinds schedule their own batches
    batch = [f"--engine.max_batch_size={NUM_PROMPTS * NUM_GENERATIONS}"] if chosen("engine.kind", "torch") == "torch" else []
    # TRL's torch.std is the sample std (a grpo field: another estimator set with --project-set has none)
    std = ["--algorithm.grpo_std=sample"] if chosen("algorithm.advantage", "grpo") == "grpo" else []
    return [
        f"--run.dir={run_dir}", f"--run.seed={args.seed}", f"--model.path={args.model}", f"--model.cache_dir={CACHE_DIR}",
        "--engine.kind=torch", f"--engine.max_new_tokens={NEW_TOKENS}", *batch, "--engine.temperature=1.0",
        f"--env.kind={ENV_KIND}", f"--env.tasks={args.tasks}", "--env.max_turns=1",
        f"--rollout.groups_per_step={NUM_PROMPTS}", f"--rollout.group_size={NUM_GENERATIONS}",
        f"--rollout.max_in_flight={NUM_PROMPTS * NUM_GENERATIONS}", "--algorithm.kl_coef=0", *std,
        f"--trainer.lr={LR}", f"--trainer.threads={args.threads}", f"--trainer.max_steps={args.warmup + args.steps}",
        "--tracking.experiment=peer_trl",
        *(f"--{override}" for override in args.project_set),
    ]


def stage_clock():
    """A Lightning callback that timestamps each training step's stages (built here so that the
    TRL subprocess never imports Lightning)."""
    from lightning.pytorch.callbacks import Callback

    class StageClock(Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []
            self._last_end: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            now = time.perf_counter()
            self._step = {"start": now, "between": None if self._last_end is None else now - self._last_end,
                          "backward": 0.0, "optimizer_from": None}

        def on_before_backward(self, trainer, pl_module, loss):
            self._backward_from = time.perf_counter()

        def on_after_backward(self, trainer, pl_module):
            self._step["backward"] += time.perf_counter() - self._backward_from

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._step["optimizer_from"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = self._last_end = time.perf_counter()
            step, trajectories = self._step, batch.trajectories
            optimizer_from = step["optimizer_from"] or now
            metrics = trainer.callback_metrics  # the engine's vs the trainer's log-probs of the lag-0 actions
            self.steps.append({
                "mismatch_logprob_max": float(metrics.get("mismatch/logprob_max", float("nan"))),
                "mismatch_logprob_mean": float(metrics.get("mismatch/logprob_mean", float("nan"))),
                "end": now,
                "between_steps": step["between"],
                "train": now - step["start"],
                "backward": step["backward"],
                "optimizer_and_logging": now - optimizer_from,
                "forward_and_rest": optimizer_from - step["start"] - step["backward"],
                "completion_tokens": float(batch.loss_mask.sum()),
                "tokens": batch.input_ids.numel(),
                "episodes": len(trajectories),
                "episode_s_max": max(t.timings.get("episode_s", 0.0) for t in trajectories),
                "generation_s_mean": statistics.fmean(t.timings.get("generation_s", 0.0) for t in trajectories),
                "tool_s_mean": statistics.fmean(t.timings.get("tool_s", 0.0) for t in trajectories),
                "prompt_tokens_mean": statistics.fmean(t.turns[0].action_start for t in trajectories if t.turns),
                "reward_mean": statistics.fmean(t.reward for t in trajectories),
                "task_ids": sorted({t.task_id for t in trajectories}),
            })

    return StageClock()


def run_project(args: argparse.Namespace) -> dict:
    from lightning_agentrl.settings import load_settings
    from lightning_agentrl.train import fit

    run_dir = Path(args.run_dir or f"runs/peer_trl-{time.strftime('%Y%m%d-%H%M%S')}")
    overrides = project_overrides(args, run_dir)
    clock = stage_clock()
    fit(load_settings(None, overrides), callbacks=[clock])
    import torch

    measured = clock.steps[args.warmup :]
    digit_of = {json.loads(line)["id"]: json.loads(line)["digit"] for line in Path(args.tasks).read_text().splitlines()}
    return {
        "version": "lightning-agentrl " + git_commit(),
        "torch_threads": torch.get_num_threads(),  # after training: what its ops ran with
        "step_s": step_times([s["end"] for s in clock.steps], args.warmup),
        "completion_tokens_per_step": [s["completion_tokens"] for s in measured],
        "prompt_tokens_mean": round(statistics.fmean(s["prompt_tokens_mean"] for s in measured), 1),
        "reward_mean": round(statistics.fmean(s["reward_mean"] for s in measured), 3),
        # over every step, warm-up included: |engine - trainer| log-prob of the sampled ids (lag 0)
        "mismatch_logprob_max": max(s["mismatch_logprob_max"] for s in clock.steps),
        "mismatch_logprob_mean": [s["mismatch_logprob_mean"] for s in clock.steps],
        "stages": measured,
        "step_digits": [sorted(digit_of[i] for i in s["task_ids"]) for s in clock.steps],
        "settings_overrides": overrides,
        "run_dir": str(run_dir),
    }


# -- both sides -----------------------------------------------------------------------------------
def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def run_side(side: str, python: str, args: argparse.Namespace, *, tasks: Path | None = None,
             run_dir: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{side}.json"
        command = [python, __file__, "--side", side, "--side-out", str(out), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--seed", str(args.seed), "--threads", str(args.threads),
                   "--model", args.model]
        if side == "trl":
            command += ["--model-dir", args.model_dir]
        if run_dir:
            command += ["--run-dir", run_dir]
        for override in args.project_set:
            command += ["--project-set", override]
        if tasks:
            command += ["--tasks", str(tasks)]
        if args.trl_bf16:
            command.append("--trl-bf16")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TOKENIZERS_PARALLELISM": "false"}
        started, load_before = time.perf_counter(), os.getloadavg()[0]
        subprocess.run(command, cwd=REPO, env=env, check=True)
        record = json.loads(out.read_text())
        record["wall_s"] = round(time.perf_counter() - started, 1)
        record["load_avg_1min"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
        return record


def summarize(record: dict) -> dict:
    step_s = statistics.median(record["step_s"])
    tokens = statistics.median(record["completion_tokens_per_step"])
    return {"median_step_s": round(step_s, 3), "completion_tokens_per_step": tokens,
            "completion_tokens_per_s": round(tokens / step_s, 1)}


def profile(project: dict) -> dict:
    """Share of the project's median step taken by each stage (medians over the measured steps)."""
    stages = project["stages"]

    def median(key: str) -> float:
        return statistics.median(s[key] for s in stages)

    step = statistics.median(project["step_s"])
    rollout = median("episode_s_max")
    parts = {
        "rollout (slowest episode: generation + environment + scoring)": rollout,
        "between steps, outside episodes (checkpoint, weight sync, batch assembly)": median("between_steps") - rollout,
        "forward (log-probs, loss) and rest of training_step": median("forward_and_rest"),
        "backward": median("backward"),
        "optimizer step and logging": median("optimizer_and_logging"),
    }
    return {
        "median_step_s": round(step, 3),
        "stages": [{"stage": name, "seconds": round(sec, 3), "share": round(sec / step, 3)}
                   for name, sec in sorted(parts.items(), key=lambda kv: -kv[1])],
        "inside_rollout": {"generation_s_mean_per_episode": round(median("generation_s_mean"), 3),
                           "tool_s_mean_per_episode": round(median("tool_s_mean"), 3)},
        "tokens_per_step": median("tokens"),
        "source": "callback timestamps around Lightning hooks + Trajectory.timings (benchmarks/peer_trl.py)",
    }


def trl_profile(trl: dict) -> dict:
    """Share of TRL's median step taken by each of its stages: those of the measured step whose time is the
    (lower) median, so that they add up to it; the rest is the trainer's own work between them (logging,
    callbacks, data loading)."""
    at = trl["step_s"].index(statistics.median_low(trl["step_s"]))
    step, parts = trl["step_s"][at], dict(trl["stages"][at])
    parts["rest of the step (logging, callbacks, data loading)"] = step - sum(parts.values())
    return {"median_step_s": round(step, 3),
            "stages": [{"stage": name, "seconds": round(sec, 3), "share": round(sec / step, 3)}
                       for name, sec in sorted(parts.items(), key=lambda kv: -kv[1])],
            "source": "timers around GRPOTrainer._generate, _generate_and_score_completions, compute_loss, "
                      "accelerator.backward and the optimizer-step callbacks (benchmarks/peer_trl.py)"}


def pooled(rounds: list[dict]) -> dict:
    """One side's rounds as one record: the measured steps of all rounds, and each round's summary."""
    record = {**rounds[-1], "round_wall_s": [r.pop("wall_s") for r in rounds]}
    for key in ("step_s", "completion_tokens_per_step", "stages"):  # TRL's stages too
        if key in rounds[0]:
            record[key] = [x for r in rounds for x in r[key]]
    record["rounds"] = [{**summarize(r), "load_avg_1min": r["load_avg_1min"], "torch_threads": r["torch_threads"]}
                        for r in rounds]
    record.pop("load_avg_1min")
    return record


def earlier_trl(args: argparse.Namespace) -> tuple[dict, dict]:
    """The TRL side (pooled rounds) and its profile from ``--trl-from``, after checking that it measured the
    same model and shape; exits with an error line otherwise."""
    path = Path(args.trl_from)
    try:
        record = json.loads(path.read_text())
        trl_profile_ = json.loads(path.with_name(path.stem + "_profile.json").read_text())["trl"]
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"error: --trl-from: cannot read {path} and its _profile.json: {err}")
    shape, wanted = record.get("shape", {}), {"torch_threads": args.threads, "warmup_steps": args.warmup,
                                               "measured_steps": args.steps}
    got = {"model": record.get("model", {}).get("path", "tiny"), "seed": record.get("seed"),
           "bf16": record.get("trl", {}).get("settings", {}).get("bf16"), **{k: shape.get(k) for k in wanted}}
    if got != {"model": args.model, "seed": args.seed, "bf16": args.trl_bf16, **wanted}:
        sys.exit(f"error: --trl-from: {path} measured {got}, not this run's model, seed, bf16, threads and steps")
    trl = {**record["trl"], "reused_from": {"record": str(path), "commit": record.get("commit")}}
    return trl, trl_profile_


def run_rounds(args: argparse.Namespace, tasks_dir: Path) -> tuple[dict, dict, bool]:
    """TRL and the project alternately, ``args.rounds`` times each; the project's tasks are the prompts
    of the first TRL round. Also says whether every TRL round drew the same prompts. With ``--trl-from``
    only the project runs, on the prompts of the earlier record's TRL side."""
    trl_rounds, project_rounds, tasks = [], [], None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.trl_from:
        trl, _ = earlier_trl(args)
        tasks = project_tasks(trl["group_digits"], args.seed, tasks_dir / "digits.jsonl")
        for k in range(args.rounds):
            run_dir = f"{args.run_dir or f'runs/peer_trl-{stamp}'}-r{k}"
            project_rounds.append(run_side("project", sys.executable, args, tasks=tasks, run_dir=run_dir))
        return trl, pooled(project_rounds), True
    for k in range(args.rounds):
        trl_rounds.append(run_side("trl", args.trl_python, args))
        if tasks is None:
            tasks = project_tasks(trl_rounds[0]["group_digits"], args.seed, tasks_dir / "digits.jsonl")
        run_dir = f"{args.run_dir or f'runs/peer_trl-{stamp}'}-r{k}"
        project_rounds.append(run_side("project", sys.executable, args, tasks=tasks, run_dir=run_dir))
    same_trl = all(r["group_digits"] == trl_rounds[0]["group_digits"] for r in trl_rounds)
    return pooled(trl_rounds), pooled(project_rounds), same_trl


def same_prompts_per_step(trl: dict, project: dict) -> bool:
    """Each project step trained on the 8 prompts of the same TRL step."""
    groups = trl["group_digits"]
    trl_steps = [sorted(groups[i : i + NUM_PROMPTS]) for i in range(0, len(groups), NUM_PROMPTS)]
    return project["step_digits"] == trl_steps[: len(project["step_digits"])]


DIFFERENCES = [
    "none in the loss: both take a token-level mean over the batch (TRL loss_type 'dapo', the project's default "
    "algorithm.aggregation 'token-mean'), clip 0.2, beta 0, advantages scaled by the group's sample std (the "
    "project's algorithm.grpo_std=sample, set here to match TRL's torch.std)",
    "project step includes its defaults: MLflow logging, trajectory files, a checkpoint every 50 steps (none "
    "within the default 1 + 6 steps; the final one comes after the last measured step) (TRL: save_strategy='no', "
    "report_to='none')",
    "project sequences end with the end-of-turn id after an action cut at max_new_tokens (one context token, "
    "mask 0, not a completion token); TRL trains on the cut completion as it is",
    "sampling: each side draws its own completions (same prompts, temperature 1, different generators), so "
    "completion lengths differ slightly; throughput is per completion token. The project's torch engine samples "
    "every row of a decoding step in one batched inverse-CDF draw (per-request seeded uniforms); TRL samples "
    "with torch.multinomial inside transformers.generate",
    "with --trl-from, the TRL side is an earlier run's (record: trl.reused_from; its load in trl.rounds)",
    "threads: both sides run with the same torch thread count (record: torch_threads, as each process ran); "
    "a load average above the cores (record: load_over_cores) makes the step times incomparable",
]


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (``VmHWM``), in MiB; None where /proc is not there."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    return next((round(int(line.split()[1]) / 1024, 1) for line in lines if line.startswith("VmHWM:")), None)


def machine_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def overloaded_runs(trl: dict, project: dict, cores: int) -> list[str]:
    """The runs (``"trl round 1"``) whose 1-minute load average, before or after, exceeded ``cores``."""
    return [f"{name} round {k + 1}" for name, side in (("trl", trl), ("project", project))
            for k, r in enumerate(side["rounds"]) if max(r["load_avg_1min"].values()) > cores]


def thread_counts(trl: dict, project: dict) -> dict:
    """The torch threads each side's rounds ran with, and whether all of them are the same."""
    counts = {name: [r["torch_threads"] for r in side["rounds"]] for name, side in (("trl", trl), ("project", project))}
    return {**counts, "same": len({n for side in counts.values() for n in side}) == 1}


def summary_line(record: dict) -> str:
    shape, trl, project = record["shape"], record["trl"], record["project"]
    loads = [r["load_avg_1min"][k] for side in (trl, project) for r in side["rounds"] for k in ("before", "after")]
    line = (f"peer_trl ({shape['prompts']}x{shape['generations']}x{shape['max_new_tokens']} tokens/step, "
            f"{shape['torch_threads']} threads, {shape['rounds_per_side']} alternating rounds): "
            f"TRL {trl['completion_tokens_per_s']} completion tok/s ({trl['median_step_s']} s/step), "
            f"project {project['completion_tokens_per_s']} tok/s ({project['median_step_s']} s/step), "
            f"ratio {record['ratio_project_over_trl']}x (target 2x); load {min(loads):.1f} to {max(loads):.1f} "
            f"on {record['cores']} cores")
    if record.get("project_set"):
        line += f"; project side with {' '.join(record['project_set'])}"
    if not record["torch_threads"]["same"]:
        line += f"; WARNING: the sides ran with different torch threads {record['torch_threads']}"
    if record["load_over_cores"]:
        line += (f"; WARNING: load average above the {record['cores']} cores in {', '.join(record['overloaded_runs'])}:"
                 f" the step times are not comparable, rerun on an idle machine")
    return line


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # benchmarks.peer_env, as the subprocesses import it
    if args.side:
        record = run_trl(args) if args.side == "trl" else run_project(args)
        record["peak_rss_mib"] = peak_rss_mib()
        Path(args.side_out).write_text(json.dumps(record))
        return
    args.model_dir = model_folder(args.model)
    if args.trl_from:
        earlier_trl(args)  # an unusable record fails before any run
    with tempfile.TemporaryDirectory() as tasks_dir:
        trl_record, project_record, same_trl = run_rounds(args, Path(tasks_dir))
    trl, project = summarize(trl_record), summarize(project_record)
    ratio = round(project["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 2)
    load, cores = os.getloadavg(), machine_cores()
    overloaded = overloaded_runs(trl_record, project_record, cores)
    record = {
        "command": shlex.join(["python", "benchmarks/peer_trl.py", *argv]),
        "host": platform.platform(), "cpu_count": os.cpu_count(), "cores": cores,
        "load_avg_at_end": [round(x, 2) for x in load],  # 1, 5, 15 min; the machine may be shared
        "load_over_cores": bool(overloaded), "overloaded_runs": overloaded,
        "torch_threads": thread_counts(trl_record, project_record),
        "model": {"path": args.model, "folder": str(Path(args.model_dir).relative_to(REPO))
                  if Path(args.model_dir).is_relative_to(REPO) else args.model_dir},
        "shape": {"prompts": NUM_PROMPTS, "generations": NUM_GENERATIONS, "max_new_tokens": NEW_TOKENS,
                  "lr": LR, "beta": 0.0, "torch_threads": args.threads, "warmup_steps": args.warmup,
                  "measured_steps": args.steps, "rounds_per_side": args.rounds, "order": "TRL, project, alternating",
                  "environment": ENV_KIND},
        "project_set": args.project_set,  # overrides of the project side beyond the shared shape
        "ratio_project_over_trl": ratio,
        "target_ratio": 2.0,
        "same_prompts_per_step": same_trl and same_prompts_per_step(trl_record, project_record),
        "trl": {**trl, **trl_record},
        "project": {**project, **{k: v for k, v in project_record.items() if k != "stages"}},
        "differences": DIFFERENCES,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stated = {"config": None, "overrides": project_record["settings_overrides"], "seed": args.seed}
    write_record(out, record, **stated)
    write_record(out.with_name(out.stem + "_profile.json"), {**profile(project_record),
                                                            "trl": earlier_trl(args)[1] if args.trl_from
                                                            else trl_profile(trl_record)},
                 **stated)
    print(summary_line(record))


if __name__ == "__main__":
    main()

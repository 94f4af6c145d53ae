"""Credit-assignment comparisons at equal rollout budget, scored on held-out tasks.

    python benchmarks/compare.py rooms_gigpo       # GRPO vs GiGPO: rooms reached by different paths, dead ends
    python benchmarks/compare.py rooms_similarity  # GiGPO exact vs similarity mode: observations carry a clock
    python benchmarks/compare.py rooms_truncation  # reward 0 vs compact filtering: truncation cuts long, correct work
    python benchmarks/compare.py rooms_critic      # GAE (turn-level critic) vs GRPO: the world pays per turn
    python benchmarks/compare.py rooms_critic_level  # GRPO vs GAE turn-level vs token-level critic, and the token
                                                     # level with groups of one at the same episodes a step
    python benchmarks/compare.py critic_level      # the same four on copy-the-key: long turns (whole tool calls)
    python benchmarks/compare.py rooms_privileged  # GAE vs GAE whose critic reads the hidden goal (privileged),
                                                   # its head without the goal (control) and GRPO
    python benchmarks/compare.py rooms_staleness   # staleness weighting vs none at bounds 2 and 4, partial rollouts
    python benchmarks/compare.py rooms_offpolicy   # importance correction none / token TIS / sequence TIS / MIS,
                                                   # bfloat16 engine, bounds 4 and 2
    python benchmarks/compare.py mask              # copy-the-key: loss mask on vs off (also gigpo, gigpo_detour,
                                                   # truncation: the first comparisons, on copy-the-key)
    python benchmarks/compare.py mask --seeds 0 1 2 3 -- --trainer.max_steps=30

Each arm runs the comparison's config (``configs/credit_*.yaml`` for the rooms worlds,
``configs/compare_<name>.yaml`` for copy-the-key) plus the arm's overrides, for every seed, from the same
format-only warm start (one per comparison, so every arm starts from identical weights); the seed changes
the RL sampling and the task order. Every arm of a seed generates the same number of episodes
(``trainer.max_steps x groups_per_step x group_size``; compact filtering leaves some out of the loss, it
generates none in their place). A run's score at an evaluation is the comparison's ``score`` over
``samples_per_task`` episodes per held-out task: ``solved`` (the share that reached the goal) in the rooms
worlds, ``success`` (the mean final reward) on copy-the-key, where the two are equal.

Writes ``benchmarks/results/compare/compare_<name>.json`` after every run (``complete`` false until the last; every
run's curve, how its late training episodes ended, per-arm mean and std over seeds, paired per-seed
differences) and ``compare_<name>.md`` (the README rows). Each run's record also stays in its folder, so
calling again with the same ``--root`` reuses the finished runs and continues a stopped one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from learn_cpu import metric_per_step, run_with_evaluation, train_rewards, warm_started_model  # noqa: E402

from benchmarks.record import write_record  # noqa: E402
from lightning_agentrl.settings import load_settings  # noqa: E402

COPY_KEY = "copy_key"  # warm start: benchmarks/warm_start.py:warm_start (read the key, write a random value)
ROOMS = "rooms"  # warm start: benchmarks/warm_start.py:rooms_warm_start (random walks over the listed exits)

# MLflow metrics each comparison's records carry per run (means over the run and over its last 10 steps):
# the measurements that say why an arm won or did not (see run_diagnostics).
GIGPO_METRICS = ["gigpo/mean_anchor_group_size", "gigpo/anchor_hit_rate", "gigpo/num_anchor_groups"]
# value/mean beside value/returns_mean: whether a critic whose explained variance stays near 0 tracks the mean return
CRITIC_METRICS = ["value/explained_variance", "loss/value", "value/mean", "value/returns_mean"]
STALENESS_METRICS = ["staleness/mean_lag", "staleness/weight_mean", "policy/is_weight_mean", "policy/is_weight_max"]
OFFPOLICY_METRICS = ["importance/weight_mean", "importance/weight_max", "importance/weight_min", "importance/weight_p99",
                     "importance/ess", "importance/truncated_frac", "importance/dropped_frac", "importance/num_units",
                     "policy/is_weight_mean", "policy/clipfrac", "mismatch/logprob_mean", "mismatch/logprob_max",
                     "staleness/mean_lag"]
COMMON_METRICS = ["policy/entropy", "policy/approx_kl", "policy/grad_norm"]

# The off-policy arms (algorithm.importance_*; docs/off_policy.md): no correction, token TIS, sequence TIS, MIS.
OFFPOLICY_ARMS = {
    "none": ["--algorithm.importance_mode=none"],
    # token level: on micro-batches holding a stale token (at lag 0 the PPO ratio is taken around the behavior)
    "token TIS": ["--algorithm.importance_level=token", "--algorithm.importance_cap=2"],
    "sequence TIS": ["--algorithm.importance_level=sequence", "--algorithm.importance_cap=2"],
    "sequence MIS": ["--algorithm.importance_level=sequence", "--algorithm.importance_mode=mask",
                     "--algorithm.importance_cap=2", "--algorithm.importance_lower=0.5"],
}

GAE = ["--algorithm.advantage=gae", "--model.value_head=true"]  # the critic arms' common overrides

# Where the critic reads its values (critic_level, rooms_critic_level): GRPO, turn- and token-level GAE, and the
# token level with groups of one at the same 32 episodes a step.
CRITIC_LEVEL_ARMS = {"grpo": ["--algorithm.advantage=grpo"],
                     "gae turn": [*GAE, "--algorithm.gae_level=turn"],
                     "gae token": [*GAE, "--algorithm.gae_level=token"],
                     "gae token group 1": [*GAE, "--algorithm.gae_level=token", "--rollout.group_size=1",
                                           "--rollout.groups_per_step=32"]}
CRITIC_LEVEL_PAIRS = [("grpo", "gae turn"), ("grpo", "gae token"), ("gae turn", "gae token"),
                      ("gae token", "gae token group 1")]

COMPARISONS: dict[str, dict] = {
    "gigpo": {
        "question": "GRPO vs GiGPO (anchor states repeat: every episode that read key.txt is in the same state)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "diagnostics": GIGPO_METRICS, "warm": COPY_KEY, "detour_prob": 0.0,
    },
    "gigpo_detour": {
        "question": "GRPO vs GiGPO where one state is reached by different paths (the warm start runs ls "
        "between the read and the write in half of its demos, so anchor groups span episodes at different turns)",
        "arms": {"grpo": ["--algorithm.advantage=grpo"], "gigpo": ["--algorithm.advantage=gigpo"]},
        "diagnostics": GIGPO_METRICS, "warm": COPY_KEY, "detour_prob": 0.5,
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
        "diagnostics": GIGPO_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
    },
    "rooms_similarity": {
        "question": "the same maze where every observation carries a clock (the turns spent): GiGPO with exact "
        "anchors (a room reached at another turn reads differently) vs GiGPO's similarity mode (merges them)",
        "config": "configs/credit_gigpo.yaml",
        "common": ["--env.tasks=tasks/rooms/maze_noise.jsonl"],
        "arms": {"gigpo exact": ["--algorithm.advantage=gigpo"],
                 "gigpo similarity": ["--algorithm.advantage=gigpo", "--algorithm.gigpo_similarity=0.93"]},
        "diagnostics": GIGPO_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
    },
    "rooms_truncation": {
        "question": "truncated episodes scored 0 vs compact filtering where the goal takes more turns than a cheap "
        "exit (0.25) and a loose policy overruns the turn budget",
        "config": "configs/credit_truncation.yaml",
        "arms": {"reward 0": ["--rollout.truncation=zero"], "compact filter": ["--rollout.truncation=filter"]},
        "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 24,  # one held-out start
    },
    "rooms_critic": {
        "question": "a turn-level critic (GAE, value head) vs GRPO with per-turn rewards (bonus rooms on the way)",
        "config": "configs/credit_critic.yaml",
        "arms": {"grpo": ["--algorithm.advantage=grpo"],
                 "grpo + value head": ["--algorithm.advantage=grpo", "--model.value_head=true"],
                 "gae": ["--algorithm.advantage=gae", "--model.value_head=true"]},
        # the value head's loss shares the trunk and the gradient clip: the middle arm trains it without using it
        "pairs": [("grpo", "gae"), ("grpo + value head", "gae")],
        "diagnostics": CRITIC_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
    },
    "critic_level": {
        "question": "GRPO vs GAE with a turn-level critic vs GAE with a token-level critic, and the token-level critic "
        "with groups of one (32 groups of 1 against 4 of 8: the same 32 episodes a step), on copy-the-key: long turns "
        "(whole tool calls), the hidden test's reward at the end; gamma 1, lambda 1",
        "arms": CRITIC_LEVEL_ARMS, "pairs": CRITIC_LEVEL_PAIRS,
        "diagnostics": CRITIC_METRICS, "warm": COPY_KEY, "detour_prob": 0.0, "seeds": [0, 1, 2, 3, 4],
    },
    "rooms_critic_level": {
        "question": "GRPO vs GAE with a turn-level critic vs GAE with a token-level critic, and the token-level critic "
        "with groups of one (32 groups of 1 against 4 of 8: the same 32 episodes a step), with per-turn rewards "
        "(bonus rooms on the way)",
        "config": "configs/credit_critic_level.yaml",
        "arms": CRITIC_LEVEL_ARMS, "pairs": CRITIC_LEVEL_PAIRS,
        "diagnostics": CRITIC_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
    },
    "rooms_privileged": {
        "question": "a privileged critic (the value head also reads the goal, which the policy is never told) vs a "
        "plain one, both GAE with a turn-level value head, in a maze whose goal is one of four corners; the privileged "
        "critic's head without the goal (no gradient into the trunk either) as the control; GRPO as the reference "
        "without a critic",
        "config": "configs/credit_privileged.yaml",
        "arms": {"grpo": ["--algorithm.advantage=grpo", "--model.value_head=false"],
                 "gae": GAE,
                 # the privileged critic's head without the goal: it reads the policy's stream, no gradient into the trunk
                 "gae detached": [*GAE, "--algorithm.privileged_critic=true",
                                  "--env.kind=lightning_agentrl.envs.rooms:RoomsEnvNoCriticContext"],
                 "gae privileged": [*GAE, "--algorithm.privileged_critic=true"]},
        "pairs": [("gae", "gae privileged"), ("gae detached", "gae privileged"), ("gae", "gae detached"),
                  ("grpo", "gae"), ("grpo", "gae privileged")],
        # 12 held-out tasks (3 starts x 4 goals): 4 episodes each, 48 an evaluation (the maze's: 5 x 8 = 40)
        "diagnostics": CRITIC_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 4,
        "seeds": [0, 1, 2, 3, 4],
    },
    "rooms_staleness": {
        "question": "staleness weighting (exp, rate 0.5) vs none, with partial rollouts, at max_staleness 2 and 4",
        "config": "configs/credit_staleness.yaml",
        "arms": {f"bound {k} {name}": [f"--rollout.max_staleness={k}", f"--algorithm.staleness_weighting={kind}"]
                 for k in (2, 4) for name, kind in (("none", "none"), ("weighted", "exp"))},
        "pairs": [("bound 2 none", "bound 2 weighted"), ("bound 4 none", "bound 4 weighted")],
        "diagnostics": STALENESS_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
    },
    "rooms_offpolicy": {
        "question": "no importance correction vs token TIS vs sequence TIS vs sequence MIS, with a bfloat16 engine "
        "beside a float32 trainer and asynchronous rollouts at max_staleness 4 and 2 (partial rollouts)",
        "config": "configs/credit_offpolicy.yaml",
        "arms": {f"bound {k} {name}": [f"--rollout.max_staleness={k}", *overrides]
                 for k in (4, 2) for name, overrides in OFFPOLICY_ARMS.items()},
        "pairs": [(f"bound {k} none", f"bound {k} {name}") for k in (4, 2) for name in list(OFFPOLICY_ARMS)[1:]],
        "diagnostics": OFFPOLICY_METRICS, "warm": ROOMS, "score": "solved", "eval_every": 10, "eval_samples": 8,
        "seeds": [0, 1, 2, 3, 4],
    },
}


def episode_stats(run_dir: Path, last_steps: int = 10) -> dict:
    """From the saved training batches: the share of truncated episodes (max_turns, max_context, timeout)
    over the run, and over the last ``last_steps`` steps how episodes ended and at which turn. An ending is
    the termination reason and, for an episode that ended on its own, its final reward
    (``submitted@1`` the goal, ``submitted@0.25`` a cheap exit): ``late_endings`` counts them,
    ``late_turns`` gives each one's turn counts."""
    from lightning_agentrl.trajectory import load_trajectories

    files = sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    total = truncated = 0
    for path in files:
        for t in load_trajectories(path):
            total += 1
            truncated += t.termination.value in ("max_turns", "max_context", "timeout")
    late = [t for path in files[-last_steps:] for t in load_trajectories(path)]
    endings: dict[str, dict[int, int]] = {}
    for t in late:
        ending = t.termination.value + (f"@{t.reward:g}" if t.termination.value == "submitted" else "")
        turns = endings.setdefault(ending, {})
        turns[len(t.turns)] = turns.get(len(t.turns), 0) + 1
    return {"train_truncation_rate": truncated / max(total, 1),
            "late_endings": {e: sum(turns.values()) for e, turns in sorted(endings.items())},
            "late_turns": {e: dict(sorted(turns.items())) for e, turns in sorted(endings.items())},
            "late_mean_reward": statistics.fmean(t.reward for t in late) if late else 0.0}


def critic_ceiling(run_dir: Path, spec: dict) -> dict:
    """For a comparison whose records carry the value head's explained variance: what a memorizing critic
    could explain of the returns (``critic_ceiling``, benchmarks/critic_ceiling.py), to read it against."""
    if "value/explained_variance" not in spec.get("diagnostics", []):
        return {}
    from critic_ceiling import run_ceiling

    return {"critic_ceiling": run_ceiling(run_dir)}


def run_diagnostics(run_dir: Path, keys: list[str], last_steps: int = 10) -> dict[str, dict[str, float]]:
    """Per MLflow metric of ``keys`` the run logged: ``{"mean": over its steps, "late": over its last
    ``last_steps`` steps, "max": its largest step value, "nan_steps": steps whose value was NaN}``, read
    from the run's own store (``<run_dir>/mlflow.db``, run id in ``mlflow_run_id.txt``). One value per
    step (the latest logged: a resumed run logs its replayed steps again); NaN steps (an explained
    variance of returns without variance) are left out of the statistics and counted. A metric the run
    did not log (a value head's in a run without one) is left out; a run folder without a store gives
    ``{}``; a store whose run is not this folder's is an error."""
    id_file, store = run_dir / "mlflow_run_id.txt", run_dir / "mlflow.db"
    if not id_file.exists() or not store.exists():
        return {}
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(tracking_uri=f"sqlite:///{store.resolve()}"), id_file.read_text().strip()
    try:
        name = client.get_run(run_id).info.run_name
    except MlflowException as exc:
        raise SystemExit(f"error: {store} has no run {run_id!r} (from {id_file}): {exc}") from None
    if name != run_dir.name:
        raise SystemExit(f"error: {store} holds the run {name!r}, not this folder's ({run_dir.name!r})")
    out = {}
    for key in keys:
        per_step = metric_per_step(client, run_id, key)
        if not per_step:
            continue
        last = max(per_step)
        values = [v for v in per_step.values() if not math.isnan(v)]
        late = [v for step, v in per_step.items() if step > last - last_steps and not math.isnan(v)]
        out[key] = {"mean": statistics.fmean(values) if values else None,
                    "late": statistics.fmean(late) if late else None,
                    "max": max(values) if values else None,
                    "nan_steps": len(per_step) - len(values)}
    return out


def diagnostic_keys(spec: dict) -> list[str]:
    """The MLflow metrics a comparison's run records carry: its own, then the common ones."""
    return [*spec.get("diagnostics", []), *COMMON_METRICS]


def write_json(path: Path, record: dict) -> None:
    """``record`` as JSON, replacing ``path`` in one step (a write cut short leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def finished_run(run_dir: Path, spec: dict) -> dict | None:
    """The record a finished run left in its folder (``compare_run.json``), None if it has not finished;
    one written before records carried diagnostics gets them from the run's MLflow store, in memory
    (the run folder is only read)."""
    path = run_dir / "compare_run.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if "diagnostics" not in record:
        record["diagnostics"] = run_diagnostics(run_dir, diagnostic_keys(spec))
    if "critic_ceiling" not in record:
        record.update(critic_ceiling(run_dir, spec))
    return record


def earlier_runs(path: str, name: str, warm: dict) -> dict[tuple[str, int], dict]:
    """The runs of an earlier record of comparison ``name`` (``--runs-from``), by (arm, seed), each carrying the
    commit it ran at (``commit``). Its warm start must be made as this one's: the same kind, tasks, steps and model,
    and the same final loss (to 1e-4), so that its runs started from the same weights."""
    record = json.loads(Path(path).read_text())
    if record.get("comparison") != name:
        raise SystemExit(f"error: --runs-from {path} is a record of {record.get('comparison')!r}, not {name!r}")
    keys = sorted(set(warm) - {"path", "seconds"})
    theirs, ours = {k: record["warm_start"].get(k) for k in keys}, {k: warm[k] for k in keys}
    same = all(math.isclose(a, b, rel_tol=1e-4) if isinstance(a, float) and isinstance(b, float) else a == b
               for a, b in ((theirs[k], ours[k]) for k in keys))
    if not same:
        raise SystemExit(f"error: --runs-from {path}: its warm start {theirs} is not this one's {ours}")
    return {(r["arm"], r["seed"]): {"commit": record["commit"], **r} for r in record["runs"]}


def warm_start_for(spec: dict, base, root: Path, args) -> dict:
    """The comparison's format-only warm start (one for all its runs, so every arm starts from the same
    weights); one left in ``root`` by an earlier call is reused only if it was made the same way."""
    if spec["warm"] == COPY_KEY:
        return warm_started_model(base, root / "warm_start", steps=args.warm_start_steps, seed=0,
                                  detour_prob=spec["detour_prob"], echo_prob=args.echo_prob,
                                  value_in_loss=args.value_in_loss)
    from warm_start import rooms_warm_start

    from lightning_agentrl.envs.registry import load_env_tasks
    from lightning_agentrl.train import resolve_model_path

    made_from = {"kind": ROOMS, "tasks": str(base.env.tasks), "steps": args.rooms_warm_start_steps,
                 "max_turns": base.env.max_turns, "model": str(base.model.path)}
    record_file = root / "warm_start" / "warm_start.json"
    if record_file.exists():
        record = json.loads(record_file.read_text())
        if {k: record.get(k) for k in made_from} != made_from:
            raise SystemExit(f"error: {record_file} was made from {record}, not {made_from}; use another --root")
        return record
    result = rooms_warm_start(resolve_model_path(base), root / "warm_start", load_env_tasks(base, "train"),
                              max_turns=base.env.max_turns, steps=args.rooms_warm_start_steps, seed=0)
    record = {"path": str(result.path), **made_from, "final_loss": result.final_loss, "seconds": result.seconds}
    record_file.write_text(json.dumps(record, indent=2))
    return record


def run_arm(config: str, spec: dict, arm: str, seed: int, root: Path, warm: dict, args) -> dict:
    """One run of one arm and seed, with held-out evaluation; its record, also kept in the run folder
    (``compare_run.json``) so that a later call with the same ``--root`` reuses a finished run. A run
    folder left without one (a run that stopped) is continued from its last checkpoint."""
    run_dir = root / f"{arm.replace(' ', '_')}-seed{seed}"
    if (record := finished_run(run_dir, spec)) is not None:
        return record
    overrides = [*spec.get("common", []), *args.overrides, *spec["arms"][arm]]
    resume = ["--run.resume=last"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
    settings = load_settings(config, [f"--run.dir={run_dir}", f"--run.seed={seed}", *overrides,
                                      f"--model.path={warm['path']}", *resume])
    t0, started_at = time.monotonic(), time.time()
    result, history = run_with_evaluation(settings, every=args.eval_every, samples_per_task=args.eval_samples,
                                          seed=seed)
    score = spec.get("score", "success")
    curve = [{"step": h["step"], "score": h[score], "success": h["success"], "solved": h["solved"],
              "minutes": round((h["time"] - started_at) / 60, 2)} for h in history]
    reached = [h for h in curve if h["score"] >= args.target]
    record = {
        "arm": arm, "seed": seed, "overrides": spec["arms"][arm], "run_dir": str(run_dir), "resumed": bool(resume),
        "baseline": curve[0]["score"], "final": curve[-1]["score"],
        "curve": curve, "first_at_target": reached[0] if reached else None,
        "train_reward_per_step": [r["reward"] for r in train_rewards(run_dir)],
        **episode_stats(run_dir), "seconds": round(time.monotonic() - t0, 1),
        "diagnostics": run_diagnostics(run_dir, diagnostic_keys(spec)),
        **critic_ceiling(run_dir, spec),
        "episodes": result.global_step * settings.rollout.groups_per_step * settings.rollout.group_size,
    }
    write_json(run_dir / "compare_run.json", record)
    return record


def mean_std(values: list[float]) -> dict:
    """Mean and sample std; std None for one value (unknown, not 0)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def summarize(spec: dict, runs: list[dict], target: float = 0.5) -> dict:
    """Per arm: the score at each evaluated step and at the end (mean, std over seeds), the share of truncated
    training episodes, the seeds whose score reached ``target`` and the minutes it took (from the run's start), how the late training episodes ended (counts
    over seeds) and their mean turn per ending; and per pair ``(a, b)`` of
    ``spec["pairs"]`` (default: every arm against the first) the per-seed difference b - a of the final score
    over the seeds both ran."""
    arms = list(spec["arms"])
    summary = {}
    for arm in arms:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if not mine:
            continue
        steps = sorted({h["step"] for r in mine for h in r["curve"]})
        at = {step: [h["score"] for r in mine for h in r["curve"] if h["step"] == step] for step in steps}
        firsts = [next((h for h in r["curve"] if h["score"] >= target), None) for r in mine]
        reached = [h for h in firsts if h is not None]
        final = mean_std([r["final"] for r in mine])
        summary[arm] = {
            "per_step": [{"step": step, **mean_std(v)} for step, v in at.items()],
            "final_mean": final["mean"], "final_std": final["std"], "final": [r["final"] for r in mine],
            "seeds": [r["seed"] for r in mine],
            "train_truncation_rate_mean": statistics.fmean(r["train_truncation_rate"] for r in mine),
            "reached_target": f"{len(reached)}/{len(mine)}",
            "minutes_to_target": [h["minutes"] for h in reached],
            "seconds_per_run_mean": statistics.fmean(r["seconds"] for r in mine),
            "late_endings": _sum_counts(r["late_endings"] for r in mine),
            "late_mean_turns": {e: sum(int(k) * v for k, v in t.items()) / sum(t.values())
                                for e, t in _merge_turns(r["late_turns"] for r in mine).items()},
            "diagnostics": _mean_diagnostics([r.get("diagnostics", {}) for r in mine]),
            **({"critic_ceiling": _mean_ceilings([r["critic_ceiling"] for r in mine if "critic_ceiling" in r])}
               if any("critic_ceiling" in r for r in mine) else {}),
        }
    pairs = {}
    for a, b in spec.get("pairs", [(arms[0], arm) for arm in arms[1:]]):
        first = {r["seed"]: r["final"] for r in runs if r["arm"] == a}
        diffs = [r["final"] - first[r["seed"]] for r in sorted(runs, key=lambda r: r["seed"])
                 if r["arm"] == b and r["seed"] in first]
        if diffs:
            pairs[f"{b} - {a}"] = {"per_seed": diffs, "wins": sum(d > 0 for d in diffs), **mean_std(diffs)}
    return {"arms": summary, "pairs": pairs}


def _mean_diagnostics(tables: list[dict]) -> dict[str, dict[str, float]]:
    """Each metric's run means and late means averaged over the runs that logged it (a number), with their
    count."""
    out = {}
    for key in sorted({k for table in tables for k in table}):
        logged = [table[key] for table in tables if key in table and table[key]["mean"] is not None]
        if logged:  # a run whose steps were all NaN has no mean to add
            lates = [d["late"] for d in logged if d["late"] is not None]
            out[key] = {"mean": statistics.fmean(d["mean"] for d in logged),
                        "late": statistics.fmean(lates) if lates else None,
                        "max": max(d["max"] for d in logged), "runs": len(logged)}
    return out


def _mean_ceilings(tables: list[dict]) -> dict[str, dict[str, float | None]]:
    """Each number of ``critic_ceiling``, mean and late, averaged over the runs that have it."""
    def average(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    return {key: {part: average(t[key][part] for t in tables if key in t) for part in ("mean", "late")}
            for key in sorted({k for t in tables for k in t})}


def _sum_counts(tables) -> dict[str, int]:
    out: dict[str, int] = {}
    for table in tables:
        for key, n in table.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def _merge_turns(tables) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for table in tables:
        for ending, turns in table.items():
            merged = out.setdefault(ending, {})
            for turn, n in turns.items():
                merged[str(turn)] = merged.get(str(turn), 0) + n
    return out


def _pm(mean: float, std: float | None) -> str:
    return f"{mean:.3f} ± {'n/a' if std is None else f'{std:.3f}'}"


def table_rows(name: str, summary: dict, episodes: int) -> list[str]:
    """README rows: per arm the final score, each seed's, the score at each evaluation; then one row per pair."""
    rows = []
    for arm, s in summary["arms"].items():
        points = ", ".join(f"{p['step']}: {p['mean']:.2f}" for p in s["per_step"])
        rows.append(f"| {name} | {arm} | {_pm(s['final_mean'], s['final_std'])} | "
                    f"{', '.join(f'{v:.2f}' for v in s['final'])} | {points} | "
                    f"{s['train_truncation_rate_mean']:.2f} | {episodes} |")
    for pair, d in summary["pairs"].items():
        rows.append(f"| {name} | {pair} (paired, per seed) | {_pm(d['mean'], d['std'])} | "
                    f"{', '.join(f'{v:+.2f}' for v in d['per_seed'])} | {d['wins']} of {len(d['per_seed'])} seeds ahead | | |")
    return rows


def write_comparison(args, argv, spec, config, warm, runs, started, complete: bool) -> dict:
    summary = summarize(spec, runs, args.target)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "comparison": args.name, "question": spec["question"], "complete": complete,
        "score": spec.get("score", "success"),
        "command": shlex.join([Path(sys.executable).name, "benchmarks/compare.py", *argv]),
        "seeds": args.seeds,
        "warm_start": warm, "episodes_per_run": runs[0]["episodes"], "target": args.target,
        "wall_time_s": round(time.monotonic() - started, 1), "summary": summary, "runs": runs,
    }
    write_record(out_dir / f"compare_{args.name}.json", record, config=config,
                 overrides=[*spec.get("common", []), *args.overrides], seed=args.seeds)
    rows = table_rows(args.name, summary, record["episodes_per_run"])
    (out_dir / f"compare_{args.name}.md").write_text("\n".join(rows) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(COMPARISONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the comparison's, else 0 1 2")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="run only these arms (default all); two calls on one root may split the arms between them")
    parser.add_argument("--root", default=None, help="run folders go here (default runs/compare_<name>-<time>); "
                        "a second call with the same root reuses its finished runs and continues a stopped one")
    parser.add_argument("--out-dir", default="benchmarks/results/compare")
    parser.add_argument("--warm-start-steps", type=int, default=100)
    parser.add_argument("--rooms-warm-start-steps", type=int, default=40)
    parser.add_argument("--echo-prob", type=float, default=0.5)
    parser.add_argument("--value-in-loss", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="episodes per held-out task (default: the comparison's, 4 for copy-the-key)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out evaluation every N steps and at the end (default: the comparison's, else 30)")
    parser.add_argument("--target", type=float, default=0.5, help="report when each run first reached this score")
    parser.add_argument("--runs-from", default=None,
                        help="an earlier record of this comparison (its JSON): its runs stand in for the arms and seeds "
                        "not finished in --root, each with the commit it ran at; its warm start must be this one's. "
                        "How a comparison split over several machines or days is put together")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: write the record from the runs already finished in --root (complete: false "
                        "if any arm and seed is missing)")
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    args.overrides = overrides  # settings overrides for every arm, after --
    spec = COMPARISONS[args.name]
    args.seeds = spec.get("seeds", [0, 1, 2]) if args.seeds is None else args.seeds
    args.eval_samples = spec.get("eval_samples", 4) if args.eval_samples is None else args.eval_samples
    args.eval_every = spec.get("eval_every", 30) if args.eval_every is None else args.eval_every
    for flag in ("eval_samples", "eval_every", "warm_start_steps", "rooms_warm_start_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    config = spec.get("config", f"configs/compare_{args.name}.yaml")
    root = Path(args.root or f"runs/compare_{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()

    base = load_settings(config, [f"--run.dir={root}", *spec.get("common", []), *args.overrides])
    warm = warm_start_for(spec, base, root, args)
    runs = []
    arms = args.arms or list(spec["arms"])
    if set(arms) - set(spec["arms"]):
        parser.error(f"--arms: {args.name} has the arms {list(spec['arms'])}")
    earlier = earlier_runs(args.runs_from, args.name, warm) if args.runs_from else {}
    for seed in args.seeds:
        for arm in arms:
            if (arm, seed) in earlier and finished_run(root / f"{arm.replace(' ', '_')}-seed{seed}", spec) is None:
                runs.append(earlier[(arm, seed)])
                continue
            if args.no_run:
                finished = finished_run(root / f"{arm.replace(' ', '_')}-seed{seed}", spec)
                runs += [finished] if finished is not None else []
                continue
            runs.append(run_arm(config, spec, arm, seed, root, warm, args))
            write_comparison(args, argv, spec, config, warm, runs, started, complete=False)  # a partial record
            print(f"[{args.name}] {arm} seed {seed}: {runs[-1]['baseline']:.3f} -> {runs[-1]['final']:.3f}", flush=True)
    if not runs:
        raise SystemExit(f"error: no finished run in {root}")
    complete = len(runs) == len(args.seeds) * len(spec["arms"])  # every arm, not only --arms
    record = write_comparison(args, argv, spec, config, warm, runs, started, complete=complete)
    print("\n".join(table_rows(args.name, record["summary"], record["episodes_per_run"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

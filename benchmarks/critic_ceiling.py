"""How much of the return a critic could explain from what it reads, measured on a run's saved batches.

    python benchmarks/critic_ceiling.py RUN_DIR [RUN_DIR ...]

A value head's explained variance (``value/explained_variance``: ``1 - Var(G - V) / Var(G)`` over a step's
turns) near 0 has two readings: the head has not learned, or there is little to learn, because from the
state it reads the return is mostly chance (which way a sampled policy goes next, a goal it is never told).
This measures the second. For each training step's batch (``trajectories/step_*.jsonl``) each turn's
discounted return-to-go ``G`` (the run's ``algorithm.gamma``) is predicted by the **state-mean critic**: the
mean ``G`` of the batch's *other* turns that start from the same state, or of all other turns where no
other turn starts there. It memorizes each state's value under this very policy and generalizes nothing;
its explained variance on the batch is what telling those states apart buys, measured with the batch's own
samples (leave-one-out, so a state seen once predicts nothing). A state is keyed four ways (:data:`KEYS`):
by the exact context the critic reads or by the environment's state and turn number, each with or without
the episode's critic context (``Environment.critic_context``: what ``algorithm.privileged_critic`` reads).

The same four again for the state mean over the 5 batches before (``KEY@past``): a critic that memorized the
recent past, predicting a batch it did not see, as the value head does (it is read before the step trains it).

Printed per run: the eight explained variances, mean over steps and over the last 10, and the value head's
own (MLflow ``value/explained_variance``) where the run logged it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def turn_returns(trajectory, gamma: float) -> list[float]:
    """Each turn's discounted return-to-go, ``G_k = r_k + gamma * G_{k+1}``, over all of the episode's segments."""
    rewards = [turn.reward for segment in trajectory.segments for turn in segment.turns]
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


KEYS = ("context", "context+critic", "state", "state+critic")
"""How a turn's state is keyed: ``context`` the exact tokens before its action (all the policy has read: two
episodes share it only while their histories agree), ``state`` the environment's state key and the turn's
number (``Turn.state_key``: the room, in the rooms worlds; a coarser, Markov state that histories share);
``+critic`` with the episode's critic context as well."""


def turn_states(trajectory, key: str) -> list[tuple]:
    """Each turn's state keyed as ``key`` (one of :data:`KEYS`)."""
    context = tuple(trajectory.critic_context_ids) if key.endswith("+critic") else ()
    turns = [(segment, turn) for segment in trajectory.segments for turn in segment.turns]
    if key.startswith("context"):
        return [(context, tuple(segment.token_ids[:turn.action_start])) for segment, turn in turns]
    return [(context, k, turn.state_key) for k, (_, turn) in enumerate(turns)]


def explained_variance(returns: list[float], predicted: list[float]) -> float | None:
    """``1 - Var(G - pred) / Var(G)``; None without variance in ``returns`` or with fewer than 2 of them."""
    if len(returns) < 2 or statistics.pvariance(returns) == 0:
        return None
    errors = [g - p for g, p in zip(returns, predicted, strict=True)]
    return 1.0 - statistics.pvariance(errors) / statistics.pvariance(returns)


def state_mean_ev(states: list, returns: list[float]) -> float | None:
    """Explained variance, over one batch's turns, of the leave-one-out state mean: each turn predicted by
    the mean return of the batch's other turns from its state, or of all other turns if none."""
    n, total = len(returns), sum(returns)
    sums, counts = defaultdict(float), defaultdict(int)
    for state, g in zip(states, returns, strict=True):
        sums[state] += g
        counts[state] += 1
    predicted = [(sums[state] - g) / (counts[state] - 1) if counts[state] > 1 else (total - g) / max(n - 1, 1)
                 for state, g in zip(states, returns, strict=True)]
    return explained_variance(returns, predicted)


def past_mean_ev(states: list, returns: list[float], past: list[tuple[list, list[float]]]) -> float | None:
    """Explained variance, over one batch's turns, of the state mean over earlier batches (``past``: their
    ``(states, returns)``), the mean of all their returns for a state they never saw: a critic that memorized
    the recent past, predicting a batch it did not train on."""
    sums, counts = defaultdict(float), defaultdict(int)
    for old_states, old_returns in past:
        for state, g in zip(old_states, old_returns, strict=True):
            sums[state] += g
            counts[state] += 1
    seen = sum(counts.values())
    if not seen:
        return None
    overall = sum(sums.values()) / seen
    return explained_variance(returns, [sums[s] / counts[s] if counts[s] else overall for s in states])


def step_ceilings(run_dir: Path, gamma: float, past_steps: int = 5) -> dict[int, dict[str, float | None]]:
    """Per training step, for each way of keying a state (:data:`KEYS`): the explained variance of the
    leave-one-out state mean within the batch (``key``) and of the state mean over the ``past_steps`` batches
    before it (``key@past``)."""
    from lightning_agentrl.trajectory import load_trajectories

    out, history = {}, {key: [] for key in KEYS}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        trajectories = load_trajectories(path)
        returns = [g for t in trajectories for g in turn_returns(t, gamma)]
        row = {}
        for key in KEYS:
            states = [s for t in trajectories for s in turn_states(t, key)]
            row[key] = state_mean_ev(states, returns)
            row[f"{key}@past"] = past_mean_ev(states, returns, history[key][-past_steps:])
            history[key].append((states, returns))
        out[int(path.stem.split("_")[1])] = row
    return out


def summarize(per_step: dict[int, float | None], last_steps: int = 10) -> dict[str, float | None]:
    """Mean over the steps with a value, and over the last ``last_steps`` steps."""
    steps = sorted(s for s, v in per_step.items() if v is not None and not math.isnan(v))
    late = [s for s in steps if steps and s > steps[-1] - last_steps]
    return {"mean": statistics.fmean(per_step[s] for s in steps) if steps else None,
            "late": statistics.fmean(per_step[s] for s in late) if late else None}


def run_ceiling(run_dir: Path) -> dict[str, dict[str, float | None]]:
    """The run's state-mean explained variances, per key of :data:`KEYS`, each ``{"mean", "late"}``."""
    settings = yaml.safe_load((run_dir / "settings.yaml").read_text())
    gamma = float(settings.get("algorithm", {}).get("gamma", 0.95))
    per_step = step_ceilings(run_dir, gamma)
    return {key: summarize({s: v[key] for s, v in per_step.items()}) for key in next(iter(per_step.values()), {})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with trajectories/ and settings.yaml)")
    args = parser.parse_args(argv)
    from compare import run_diagnostics

    for run_dir in args.runs:
        if not (run_dir / "trajectories").is_dir():
            raise SystemExit(f"error: {run_dir} has no trajectories/ folder (a fit run folder saves one)")
        head = run_diagnostics(run_dir, ["value/explained_variance"]).get("value/explained_variance")
        print(json.dumps({"run": str(run_dir), "state_mean_ev": run_ceiling(run_dir),
                          "value_head_ev": None if head is None else {k: head[k] for k in ("mean", "late")}}))


if __name__ == "__main__":
    main()

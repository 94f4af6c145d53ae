"""How much of the return a critic could explain from what it reads, measured on a run's saved batches.

    python benchmarks/critic_ceiling.py RUN_DIR [RUN_DIR ...]

A value head's explained variance (``value/explained_variance``: ``1 - Var(G - V) / Var(G)`` over a step's
turns) near 0 has two readings: the head has not learned, or there is little to learn, because from the
state it reads the return is mostly chance (which way a sampled policy goes next, a goal it is never told).
This measures the second, per training step's batch (``trajectories/step_*.jsonl``), from each turn's
discounted return-to-go ``G`` (``algorithm.gamma`` of the run's latest settings file):

- **explainable** (the ceiling): ``1 - Var(G | s) / Var(G)``, the explained variance of a perfect critic
  ``V(s) = E[G | s]`` under this very policy, with ``Var(G | s)`` the pooled within-state variance of the
  states the batch visits at least twice (``sum (G - mean_s)^2 / sum (n_s - 1)``: unbiased for a common
  within-state variance, whatever the visits per state) and ``Var(G)`` that of all the batch's turns.
  ``coverage`` is the share of turns in such states; a state seen once says nothing of its noise.
- **memorized** (``KEY@past``): the explained variance on this batch of the mean ``G`` per state over the 5
  batches before it (their overall mean for a state they never visited): a critic that memorized the
  recent past and generalizes nothing, predicting a batch it did not train on, as the value head does (it
  is read before the step trains it). Biased low by its few samples per state: not a ceiling.

A state is keyed four ways (:data:`KEYS`): by the exact context the critic reads or by the environment's
state and the turn's number, each with or without the episode's critic context
(``Environment.critic_context``: what ``algorithm.privileged_critic`` reads).

What the head's own number is measured against differs in three ways, so read the two side by side, not
digit by digit: the head's targets are GAE's lambda-returns (its own values mixed in; equal to ``G`` at
lambda 1), per trained token at ``algorithm.gae_level: token`` (here per turn), and over the episodes the
step trained on (the saved batch also holds those compact filtering or staleness left out).

Printed per run: each key's numbers, mean over steps and over the last 10, and the value head's own
(MLflow ``value/explained_variance``) where the run logged it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

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
number (``Turn.state_key``: the room, in the rooms worlds; a coarser state that histories share, and not a
Markov one where a reward depends on the path, as a bonus room paid on the first entry does);
``+critic`` with the episode's critic context as well."""


def turn_states(trajectory, key: str) -> list[tuple]:
    """Each turn's state keyed as ``key`` (one of :data:`KEYS`)."""
    context = tuple(trajectory.critic_context_ids) if key.endswith("+critic") else ()
    turns = [(segment, turn) for segment in trajectory.segments for turn in segment.turns]
    if key.startswith("context"):
        return [(context, tuple(segment.token_ids[:turn.action_start])) for segment, turn in turns]
    return [(context, k, turn.state_key) for k, (_, turn) in enumerate(turns)]


def explained_variance(returns: list[float], predicted: list[float]) -> float | None:
    """``1 - Var(G - pred) / Var(G)``, the product's formula (``explained_variance_of_sums``); None where it is
    NaN (fewer than 2 returns, or returns equal up to rounding)."""
    from lightning_agentrl.algorithms.diagnostics import explained_variance_of_sums

    if len(returns) < 2:
        return None
    errors = [g - p for g, p in zip(returns, predicted, strict=True)]
    ev = explained_variance_of_sums(len(returns), sum(returns), sum(g * g for g in returns), sum(errors),
                                    sum(d * d for d in errors))
    return None if math.isnan(ev) else ev


def _no_variance(returns: list[float]) -> bool:
    """Equal returns up to rounding (the product's rule, algorithms/diagnostics.py:explained_variance_of_sums)."""
    return statistics.pvariance(returns) <= 1e-12 * max(statistics.fmean(g * g for g in returns), 1e-300)


def explainable_ev(states: list, returns: list[float]) -> tuple[float | None, float]:
    """``(1 - Var(G | s) / Var(G), coverage)`` over one batch's turns: the pooled within-state variance of the
    states visited at least twice against the variance of all returns, and the share of turns in those
    states. None when no state is visited twice or the returns have no variance."""
    groups = defaultdict(list)
    for state, g in zip(states, returns, strict=True):
        groups[state].append(g)
    repeated = [gs for gs in groups.values() if len(gs) > 1]
    covered = sum(len(gs) for gs in repeated)
    if not repeated or len(returns) < 2 or _no_variance(returns):
        return None, covered / max(len(returns), 1)
    within = sum((g - statistics.fmean(gs)) ** 2 for gs in repeated for g in gs) / (covered - len(repeated))
    return 1.0 - within / statistics.pvariance(returns), covered / len(returns)


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
    """Per training step, for each way of keying a state (:data:`KEYS`): the explainable fraction (``key``),
    its coverage (``key:coverage``) and the memorized state mean of the ``past_steps`` batches before
    (``key@past``). A step file that cannot be read (cut short by a kill) is left out."""
    from pydantic import ValidationError

    from lightning_agentrl.trajectory import load_trajectories

    out, history = {}, {key: [] for key in KEYS}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        try:
            trajectories = load_trajectories(path)
        except (ValueError, ValidationError) as err:  # json's errors are ValueErrors
            print(f"warning: {path} left out: {err}", file=sys.stderr)
            continue
        returns = [g for t in trajectories for g in turn_returns(t, gamma)]
        row = {}
        for key in KEYS:
            states = [s for t in trajectories for s in turn_states(t, key)]
            row[key], row[f"{key}:coverage"] = explainable_ev(states, returns)
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
    """The run's numbers of :func:`step_ceilings`, each ``{"mean", "late"}``; ``{}`` for a folder without saved
    batches or settings (a run that never trained)."""
    from lightning_agentrl.resume import last_run_settings

    settings = last_run_settings(run_dir) if (run_dir / "trajectories").is_dir() else None
    if not settings:
        return {}
    gamma = float((settings.get("algorithm") or {}).get("gamma", 0.95))  # 0.95: the setting's default
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
        print(json.dumps({"run": str(run_dir), "critic_ceiling": run_ceiling(run_dir),
                          "value_head_ev": None if head is None else {k: head[k] for k in ("mean", "late")}}))


if __name__ == "__main__":
    main()

"""Can a linear value head read the return from the trunk's states at all? A probe on a finished run.

    python benchmarks/critic_probe.py RUN_DIR [--gamma 1.0]

Loads the run's final policy (``RUN_DIR/policy``) and, for each turn of its saved batches
(``trajectories/step_*.jsonl``), the trunk's last hidden state at the token before the turn's action: the
state ``algorithm.gae_level: turn`` reads its value from. A ridge regression from those states to each turn's
discounted return-to-go is fitted on the batches of all but the last 5 of the last 20 steps and scored on the
last 5: the best linear head on these features, fitted by least squares rather than by the run's optimizer.
Prints how much the states vary across turns (the mean per-dimension std over the mean absolute value) and the
explained variance in and out of sample for three ridge strengths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def ridge_ev(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
             strength: float) -> tuple[float, float]:
    """Ridge regression with a bias, ``w = (A^T A + strength I)^-1 A^T y`` with ``A = [x, 1]``: the explained
    variance ``1 - Var(y - A w) / Var(y)`` on the training and on the test rows. Shapes: x[n, H], y[n]."""
    a = np.c_[x_train, np.ones(len(x_train))]
    w = np.linalg.solve(a.T @ a + strength * np.eye(a.shape[1]), a.T @ y_train)

    def ev(x, y):
        return float(1 - np.var(y - np.c_[x, np.ones(len(x))] @ w) / np.var(y))

    return ev(x_train, y_train), ev(x_test, y_test)


def turn_features(run_dir: Path, model, steps, gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """The trunk's state before each turn's action [n, H] and the turn's return-to-go [n] over ``steps``."""
    import torch
    from critic_ceiling import turn_returns

    from lightning_agentrl.trajectory import load_trajectories

    x, y = [], []
    for step in steps:
        for trajectory in load_trajectories(run_dir / "trajectories" / f"step_{step:06d}.jsonl"):
            returns, k = turn_returns(trajectory, gamma), 0
            for segment in trajectory.segments:
                with torch.no_grad():
                    hidden = model.get_decoder()(input_ids=torch.tensor([segment.token_ids])).last_hidden_state[0]
                for turn in segment.turns:
                    x.append(hidden[turn.action_start - 1].float().numpy())
                    y.append(returns[k])
                    k += 1
    return np.array(x), np.array(y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--gamma", type=float, default=1.0)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.run / "policy").eval()
    n = len(list((args.run / "trajectories").glob("step_*.jsonl")))
    if n < 6:
        raise SystemExit(f"error: {args.run} has {n} saved steps; the probe fits on earlier ones and scores the last 5")
    x_train, y_train = turn_features(args.run, model, range(max(n - 20, 0), n - 5), args.gamma)
    x_test, y_test = turn_features(args.run, model, range(n - 5, n), args.gamma)
    spread = float(x_train.std(0).mean() / np.abs(x_train).mean())
    print(f"turns: {len(y_train)} fitted, {len(y_test)} held out; state spread across turns: {spread:.3f}")
    for strength in (1e-3, 1e-1, 10.0):
        fitted, held_out = ridge_ev(x_train, y_train, x_test, y_test, strength)
        print(f"ridge {strength:g}: explained variance fitted {fitted:+.3f}, held out (last 5 steps) {held_out:+.3f}")


if __name__ == "__main__":
    main()

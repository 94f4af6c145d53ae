"""The credit report: for one saved batch, the advantage every estimator gives every turn.

    python -m lightning_agentrl credit runs/smoke/trajectories/step_000001.jsonl
    python -m lightning_agentrl credit runs/smoke            # the run's latest batch

Shows, side by side, grpo (population and sample std), rloo, dr_grpo and gigpo per turn, with
GiGPO's anchor-group sizes and hit rate: where the estimators disagree is where credit
assignment matters for this batch. The same rows are logged to MLflow as a table every step.
"""

from __future__ import annotations

from pathlib import Path

from lightning_agentrl.algorithms.diagnostics import credit_summary, credit_table
from lightning_agentrl.trajectory import Trajectory, load_trajectories, pack

COLUMNS = ("grpo", "grpo_sample", "rloo", "dr_grpo", "gigpo", "gigpo_step", "anchor_group_size")


def credit_rows(trajectories: list[Trajectory], *, gamma: float = 0.95, omega: float = 1.0,
                similarity: float | None = None) -> tuple[list[dict], dict[str, float]]:
    batch = pack(trajectories)
    rows = credit_table(
        batch.rewards, batch.group_ids, batch.turn_episode, batch.anchor_states(similarity),
        turn_rewards=batch.turn_rewards, gamma=gamma, omega=omega, similarity_threshold=similarity,
    )
    for row in rows:
        trajectory = trajectories[row["trajectory"]]
        row["episode"] = trajectory.episode_id
        row["task"] = trajectory.task_id
        row["termination"] = trajectory.termination.value if trajectory.termination else ""
    return rows, credit_summary(rows)


def latest_batch(path: Path) -> Path:
    if path.is_file():
        return path
    files = sorted(path.rglob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no trajectory files (step_*.jsonl) under {path}")
    return files[-1]


def print_report(path: Path, *, gamma: float, omega: float, similarity: float | None, console=None) -> int:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console.width = max(console.width, 160)  # eleven columns: never squeeze the numbers away
    source = latest_batch(path)
    rows, summary = credit_rows(load_trajectories(source), gamma=gamma, omega=omega, similarity=similarity)
    table = Table(title=f"credit per turn: {source}")
    for name in ("episode", "task", "turn", "reward", "termination", *COLUMNS):
        table.add_column(name, justify="right" if name not in ("episode", "task", "termination") else "left")
    for row in rows:
        table.add_row(*[
            f"{row[c]:+.3f}" if isinstance(row[c], float) and c != "reward" else str(row[c])
            for c in ("episode", "task", "turn", "reward", "termination", *COLUMNS)
        ])
    console.print(table)
    console.print(", ".join(f"{k} = {v:g}" for k, v in summary.items()))
    return 0

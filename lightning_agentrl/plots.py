"""Plots of a run, read back from its MLflow store: reward and termination reasons per step."""

from __future__ import annotations

from pathlib import Path

from lightning_agentrl.trajectory import TerminationReason


def metric_series(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    return [m.step for m in history], [m.value for m in history]


def plot_run(tracking_uri: str, run_id: str, out_dir: str | Path) -> list[Path]:
    """Write ``reward.png`` and ``termination.png`` into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("reward/mean", "reward (mean)"), ("reward/within_group_std", "within-group std"),
                       ("groups/all_wrong_frac", "all-wrong groups"), ("groups/all_correct_frac", "all-correct groups")):
        steps, values = metric_series(client, run_id, key)
        if steps:
            ax.plot(steps, values, marker="o", markersize=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("reward and group signal")
    fig.tight_layout()
    written.append(out_dir / "reward.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = None
    for reason in TerminationReason:
        steps, values = metric_series(client, run_id, f"termination/{reason.value}")
        if not steps:
            continue
        ax.bar(steps, values, bottom=bottom, label=reason.value)
        bottom = values if bottom is None else [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("episodes")
    ax.legend(fontsize=8)
    ax.set_title("termination reasons")
    fig.tight_layout()
    written.append(out_dir / "termination.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written

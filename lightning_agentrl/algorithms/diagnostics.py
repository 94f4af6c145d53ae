"""Diagnostics that say *why* a run is not learning. Pure functions returning Python values.

Shapes:

    B  trajectories, K turns (flattened, contiguous per trajectory), N packed tokens

Grad norm is measured by the trainer; everything here works on tensors it already has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_agentrl.algorithms import advantages as adv


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor | None = None) -> float:
    """``1 - Var[R - V] / Var[R]`` over the (masked) items; NaN when ``Var[R] = 0``.

    1 = the critic predicts returns perfectly, 0 = no better than a constant, < 0 = worse.
    Shapes: values[K], returns[K], mask[K] or None -> float.
    """
    if values.shape != returns.shape:
        raise ValueError(f"values {tuple(values.shape)} and returns {tuple(returns.shape)} differ")
    v, r = values.detach().double().flatten(), returns.detach().double().flatten()
    if mask is not None:
        keep = mask.flatten() > 0
        v, r = v[keep], r[keep]
    return explained_variance_of_sums(*variance_sums(v, r))


def variance_sums(values: Tensor, returns: Tensor) -> tuple[float, float, float, float, float]:
    """``(n, sum R, sum R^2, sum D, sum D^2)`` with ``D = R - V``, in float64: what
    :func:`explained_variance_of_sums` needs, and what adds up over processes (a mean of each process's
    explained variance is not the batch's, and one process whose returns are all equal makes it NaN).
    Shapes: values[K], returns[K] -> five floats."""
    r, d = returns.detach().double().flatten(), (returns.detach().double() - values.detach().double()).flatten()
    return float(r.numel()), float(r.sum()), float((r * r).sum()), float(d.sum()), float((d * d).sum())


def explained_variance_of_sums(n: float, sum_r: float, sum_r2: float, sum_d: float, sum_d2: float) -> float:
    """:func:`explained_variance` from :func:`variance_sums` added over any split of the items:
    ``1 - (E[D^2] - E[D]^2) / (E[R^2] - E[R]^2)``; NaN without items or when ``Var[R] = 0``."""
    if n == 0:
        return float("nan")
    var_returns = sum_r2 / n - (sum_r / n) ** 2
    if var_returns <= 1e-12 * max(sum_r2 / n, 1e-300):  # equal returns, up to the sums' rounding
        return float("nan")
    return 1.0 - (sum_d2 / n - (sum_d / n) ** 2) / var_returns


def echo_trap_warning(
    within_group_std_history: Sequence[float],
    *,
    window: int = 5,
    collapse_ratio: float = 0.3,
    grad_norm_history: Sequence[float] | None = None,
    spike_ratio: float = 3.0,
) -> str | None:
    """Warn when within-group reward std collapses (RAGEN's "Echo Trap", https://arxiv.org/abs/2504.20073).

    The mean of the last ``window`` values is compared with the highest mean of any earlier
    ``window``-long stretch; below ``collapse_ratio`` times that peak, the groups have stopped
    disagreeing: the policy repeats one answer per task and group-relative advantages vanish.
    If ``grad_norm_history`` is given, a last-window maximum above ``spike_ratio`` times the median of
    the earlier grad norms is reported too (RAGEN observes the spike follows the collapse).

    Returns a one-line message with the numbers, or None. Needs at least ``2 * window`` steps.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 0.0 < collapse_ratio < 1.0:
        raise ValueError(f"collapse_ratio must be in (0, 1), got {collapse_ratio}")
    history = [float(x) for x in within_group_std_history]
    if len(history) < 2 * window:
        return None
    recent = sum(history[-window:]) / window
    earlier = history[:-window]
    peak = max(sum(earlier[i : i + window]) / window for i in range(len(earlier) - window + 1))
    if peak <= 0.0 or recent >= collapse_ratio * peak:
        return None
    message = (
        f"Echo trap: within-group reward std fell to {recent:.3f} (mean of the last {window} steps) from a "
        f"peak of {peak:.3f}; groups no longer disagree, so group-relative advantages vanish. Consider "
        "StarPO-S group filtering, a critic, higher sampling temperature or a lower learning rate."
    )
    if grad_norm_history is not None and len(grad_norm_history) > window:
        norms = [float(x) for x in grad_norm_history]
        baseline = float(torch.tensor(norms[:-window]).median())
        latest = max(norms[-window:])
        if baseline > 0 and latest > spike_ratio * baseline:
            message += f" Grad norm spiked to {latest:.3g} ({latest / baseline:.1f}x the earlier median)."
    return message


def credit_table(
    rewards: Tensor,
    group_ids: Tensor,
    turn_traj: Tensor,
    turn_state_keys: Sequence[str],
    *,
    turn_rewards: Tensor | None = None,
    gamma: float = 0.95,
    omega: float = 1.0,
    similarity_threshold: float | None = None,
    eps: float = 1e-6,
) -> list[dict]:
    """For one batch: the advantage each estimator would give every turn, side by side.

    One row per turn (in ``turn_traj`` order) with keys ``trajectory``, ``group``, ``turn`` (index within
    its trajectory), ``reward`` (the trajectory's final reward), ``grpo`` (population std),
    ``grpo_sample`` (sample std), ``rloo``, ``dr_grpo`` (mean only), ``gigpo`` (A^E + omega A^S),
    ``gigpo_step`` (A^S) and ``anchor_group_size`` (1 = no other turn started from this state).
    ``turn_rewards`` defaults to the sparse layout: the final reward on each trajectory's last turn.
    Summarize with ``credit_summary``.

    Shapes: rewards[B], group_ids[B], turn_traj[K], turn_state_keys K strings -> K dicts of Python values.
    """
    num_turns = turn_traj.numel()
    if turn_rewards is None:
        turn_rewards = torch.zeros(num_turns, dtype=torch.float32, device=rewards.device)
        if num_turns:
            is_last = torch.ones(num_turns, dtype=torch.bool, device=rewards.device)
            is_last[:-1] = turn_traj[1:] != turn_traj[:-1]
            turn_rewards[is_last] = rewards[turn_traj[is_last]].float()
    per_traj = {
        "grpo": adv.grpo(rewards, group_ids, std="population", eps=eps),
        "grpo_sample": adv.grpo(rewards, group_ids, std="sample", eps=eps),
        "rloo": adv.rloo(rewards, group_ids),
        "dr_grpo": adv.grpo(rewards, group_ids, std="none"),
    }
    gigpo_adv, stats = adv.gigpo(
        turn_rewards,
        turn_traj,
        turn_state_keys,
        group_ids,
        gamma=gamma,
        omega=omega,
        similarity_threshold=similarity_threshold,
        episode_rewards=rewards,
        eps=eps,
    )
    traj = turn_traj.tolist()
    groups = group_ids.tolist()
    final = rewards.tolist()
    columns = {name: values.tolist() for name, values in per_traj.items()}
    gigpo_list, step_list = gigpo_adv.tolist(), stats["step_advantages"].tolist()
    sizes = stats["anchor_group_size"].tolist()
    rows: list[dict] = []
    turn_index = 0
    for k, i in enumerate(traj):
        turn_index = 0 if k == 0 or traj[k - 1] != i else turn_index + 1
        row = {"trajectory": i, "group": groups[i], "turn": turn_index, "reward": final[i]}
        row.update({name: column[i] for name, column in columns.items()})
        row.update({"gigpo": gigpo_list[k], "gigpo_step": step_list[k], "anchor_group_size": int(sizes[k])})
        rows.append(row)
    return rows


def credit_summary(rows: Sequence[dict]) -> dict[str, float]:
    """GiGPO's anchor-group hit rate and group-size distribution from ``credit_table`` rows.

    Keys: ``gigpo/anchor_hit_rate`` (fraction of turns sharing their start state with another turn),
    ``gigpo/mean_anchor_group_size`` (over turns), ``gigpo/max_anchor_group_size``, and
    ``gigpo/turns_in_groups_of_<n>`` for each size n present.
    """
    if not rows:
        return {
            "gigpo/anchor_hit_rate": 0.0,
            "gigpo/mean_anchor_group_size": 0.0,
            "gigpo/max_anchor_group_size": 0.0,
        }
    sizes = [int(row["anchor_group_size"]) for row in rows]
    summary = {
        "gigpo/anchor_hit_rate": sum(s >= 2 for s in sizes) / len(sizes),
        "gigpo/mean_anchor_group_size": sum(sizes) / len(sizes),
        "gigpo/max_anchor_group_size": float(max(sizes)),
    }
    for size in sorted(set(sizes)):
        summary[f"gigpo/turns_in_groups_of_{size}"] = float(sizes.count(size))
    return summary

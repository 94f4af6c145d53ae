"""Policy lag of asynchronously generated tokens: measure it, bound it, down-weight it.

Shapes:

    N  packed tokens; ``policy_version[N]`` is the weight version that sampled each token
       (-1 where the token was not sampled, i.e. mask=0)
    B  trajectories

In asynchronous training (AReaL, https://arxiv.org/abs/2505.24298) a token sampled by version ``v``
is trained by version ``current``; its lag is ``current - v``. With partial rollouts
(Kimi-Researcher) the turns of one trajectory carry different versions, so lag is per token.
The decoupled PPO loss corrects the behavior/proximal mismatch; these weights are an additional,
configurable discount for old data, and the bound drops data that is too old to correct.
"""

from __future__ import annotations

import math
from typing import get_args

import torch
from torch import Tensor

from lightning_agentrl.settings import StalenessKind


def lag(policy_version: Tensor, current_version: int) -> Tensor:
    """``lag[n] = current_version - policy_version[n]``; -1 where ``policy_version`` is -1 (not sampled).

    Raises ValueError if a token claims a version newer than ``current_version``.

    Shapes: policy_version[N] int64 -> lag[N] int64.
    """
    if policy_version.dtype.is_floating_point:
        raise ValueError(f"policy_version must be an integer tensor, got {policy_version.dtype}")
    sampled = policy_version >= 0
    if (policy_version[sampled] > current_version).any():
        newest = int(policy_version[sampled].max())
        raise ValueError(
            f"a token has policy version {newest}, newer than the current version {current_version}"
        )
    return torch.where(sampled, current_version - policy_version, torch.full_like(policy_version, -1))


STALENESS_KINDS: tuple[str, ...] = get_args(StalenessKind)


def check_staleness_kind(kind: str) -> None:
    """A ``ValueError`` naming the valid kinds unless ``kind`` is one of them."""
    if kind not in STALENESS_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, STALENESS_KINDS))}, got {kind!r}")


def staleness_weight(lag: Tensor, kind: StalenessKind = "none", decay: float = 0.0) -> Tensor:
    """Per-token weight for old data, multiplied into the policy loss as ``is_weights``.

    - ``none``: ``w = 1``.
    - ``exp``: ``w = exp(-decay * lag)`` (halves every ``ln 2 / decay`` versions).
    - ``inverse``: ``w = 1 / (1 + decay * lag)`` (a heavier tail than ``exp``).

    Negative lag (tokens that were not sampled) gets ``w = 1``; mask those tokens in the loss.

    Shapes: lag[N] int64 -> Tensor[N] float32.
    """
    check_staleness_kind(kind)
    if decay < 0 or not math.isfinite(decay):
        raise ValueError(f"decay must be a finite number >= 0, got {decay}")
    steps = lag.clamp(min=0).to(torch.float32)
    if kind == "none":
        return torch.ones_like(steps)
    if kind == "exp":
        return torch.exp(-decay * steps)
    return 1.0 / (1.0 + decay * steps)  # inverse


def trajectory_lag(token_lag: Tensor, seq_ids: Tensor, num_seqs: int) -> Tensor:
    """Lag of each trajectory: the lag of its oldest sampled token (-1 if it has none).

    Shapes: token_lag[N] int64, seq_ids[N] int64 in [0, num_seqs) -> Tensor[num_seqs] int64.
    """
    if token_lag.shape != seq_ids.shape:
        raise ValueError(f"token_lag {tuple(token_lag.shape)} and seq_ids {tuple(seq_ids.shape)} differ")
    out = torch.full((num_seqs,), -1, dtype=torch.long, device=token_lag.device)
    valid = seq_ids >= 0
    return out.scatter_reduce(0, seq_ids[valid], token_lag[valid].long(), reduce="amax")


def apply_staleness_bound(lag_per_traj: Tensor, max_lag: int | None) -> tuple[Tensor, dict[str, float]]:
    """Keep trajectories whose lag is at most ``max_lag`` (``None``: keep all).

    Shapes: lag_per_traj[B] int64 -> (keep[B] bool, counts ``staleness/num_kept``,
    ``staleness/num_dropped``, ``staleness/max_lag`` (largest lag seen), ``staleness/mean_lag``).
    """
    if max_lag is not None and max_lag < 0:
        raise ValueError(f"max_lag must be >= 0 or None, got {max_lag}")
    keep = torch.ones_like(lag_per_traj, dtype=torch.bool) if max_lag is None else lag_per_traj <= max_lag
    sampled = lag_per_traj >= 0
    counts = {
        "staleness/num_kept": float(keep.sum()),
        "staleness/num_dropped": float((~keep).sum()),
        "staleness/max_lag": float(lag_per_traj[sampled].max()) if sampled.any() else 0.0,
        "staleness/mean_lag": float(lag_per_traj[sampled].double().mean()) if sampled.any() else 0.0,
    }
    return keep, counts

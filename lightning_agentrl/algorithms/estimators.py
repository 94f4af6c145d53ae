"""The advantage estimators a run can choose (``algorithm.advantage``), by name.

Each entry maps a rollout batch to per-token advantages ``Tensor[N]`` over the included episodes
(excluded episodes get 0 and leave the baseline) plus a dict of metrics. The arithmetic is in
:mod:`~lightning_agentrl.algorithms.advantages`; this module only gathers each estimator's inputs
from the batch. ``gae`` returns None: the critic computes it per micro-batch in the module.

Shapes: B episodes, K turns (flattened), N packed tokens; ``train_mask[N]``, ``token_turn[N]``.
``similarity``: the environment's own state similarity (``Environment.state_similarity``) for
GiGPO's similarity mode, or None for the default text similarity; the other estimators ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lightning_agentrl.algorithms import advantages as adv

if TYPE_CHECKING:
    from lightning_agentrl.settings import AlgorithmSettings
    from lightning_agentrl.trajectory import RolloutBatch

Estimator = Callable[
    ["RolloutBatch", torch.Tensor, torch.Tensor, "AlgorithmSettings", "Callable | None"],
    tuple[torch.Tensor | None, dict],
]


def _episode_level(per_episode: Callable[[RolloutBatch, torch.Tensor, AlgorithmSettings], torch.Tensor]) -> Estimator:
    """An estimator from one returning ``Tensor[B']`` for the included episodes: every action token
    of an episode gets its episode's advantage."""

    def estimate(batch: RolloutBatch, train_mask, token_turn, a: AlgorithmSettings, similarity=None):
        keep = batch.include
        full = torch.zeros_like(batch.rewards)
        full[keep] = per_episode(batch, keep, a).to(full.dtype)
        return adv.expand_to_tokens(full, batch.episode_ids, train_mask), {}

    return estimate


def _gigpo(batch: RolloutBatch, train_mask, token_turn, a: AlgorithmSettings, similarity=None):
    """GiGPO: an episode-level plus a step-level advantage per turn, the turn's advantage on its tokens."""
    keep = batch.include
    turn_keep = keep[batch.turn_episode]
    # re-index included episodes 0..B'-1 so the estimator sees a dense batch
    new_index = torch.cumsum(keep.long(), 0) - 1
    per_turn, stats = adv.gigpo(
        batch.turn_rewards[turn_keep],
        new_index[batch.turn_episode[turn_keep]],
        [k for k, kept in zip(batch.anchor_states(a.gigpo_similarity), turn_keep.tolist(), strict=True) if kept],
        batch.group_ids[keep],
        gamma=a.gamma,
        omega=a.gigpo_omega,
        similarity_threshold=a.gigpo_similarity,
        similarity=similarity,
        episode_rewards=batch.rewards[keep],
    )
    full = torch.zeros(batch.turn_episode.numel(), dtype=torch.float32, device=batch.rewards.device)
    full[turn_keep] = per_turn.to(full.dtype)
    metrics = {k: float(v) for k, v in stats.items() if isinstance(v, int | float)}
    return adv.expand_to_tokens(full, token_turn, train_mask), metrics


def _from_critic(batch, train_mask, token_turn, a, similarity=None):
    return None, {}


ESTIMATORS: dict[str, Estimator] = {
    "grpo": _episode_level(lambda b, keep, a: adv.grpo(b.rewards[keep], b.group_ids[keep], std=a.grpo_std)),
    "rloo": _episode_level(lambda b, keep, a: adv.rloo(b.rewards[keep], b.group_ids[keep])),
    "reinforce_decay": _episode_level(
        lambda b, keep, a: adv.reinforce_decay(b.rewards[keep], b.group_ids[keep], b.num_turns[keep], a.gamma)
    ),
    "gigpo": _gigpo,
    "gae": _from_critic,
}

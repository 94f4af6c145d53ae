"""Segment boundaries of summarized history (SPEC §4): a boundary is not the end of the task.

An episode whose history was summarized is several segments (each its own context). Every
segment takes the episode's outcome: episode-level advantages are per episode (``episode_ids``), and
the critic's turn chain runs across segments (``turn_episode`` is per episode), so no segment's last
turn is terminal. This callback checks that the outcome sits on the episode's final turn and logs
how many episodes were split. Group statistics count episodes, never segments.
"""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch


class SegmentBoundaries(L.Callback):
    def __init__(self) -> None:
        self.num_split_episodes = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch) or batch.segment_episode is None:
            return
        segments_per_episode = torch.bincount(batch.segment_episode, minlength=batch.num_episodes)
        split = segments_per_episode > 1
        last_turn = torch.cumsum(batch.num_turns, 0) - 1
        for episode in torch.nonzero(split & (batch.num_turns > 0)).squeeze(-1).tolist():
            trajectory = batch.trajectories[episode]
            # the outcome belongs to the episode's final turn, never to a segment's boundary
            if trajectory.termination is not None and trajectory.termination.value == "submitted":
                assert float(batch.turn_rewards[last_turn[episode]]) == trajectory.reward, (
                    f"episode {trajectory.episode_id}: the outcome is not on its final turn"
                )
        metrics = reduce_metrics(  # the step over all ranks
            {
                "segments/per_episode": float(segments_per_episode.float().mean()),
                "segments/split_episodes": float(split.sum()),
            },
            sums={"segments/split_episodes"},
        )
        self.num_split_episodes += int(metrics["segments/split_episodes"])
        pl_module.log_dict(metrics, on_step=True, batch_size=batch.num_episodes)

    @override
    def state_dict(self) -> dict:
        return {"num_split_episodes": self.num_split_episodes}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_split_episodes = state_dict["num_split_episodes"]

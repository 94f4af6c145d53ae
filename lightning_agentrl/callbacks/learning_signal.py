"""Say when a run learns nothing, and stop it after ``rollout.max_steps_without_signal`` such steps in a row.

A step has no learning signal when every trainable token's advantage is 0 (GRPO, RLOO, GiGPO: every
group's episodes earned the same reward and returns; ``gae``: every reward of the batch is the same),
or when it has no trainable token at all. Its gradient is 0 (no KL, entropy or value term) or comes
from those terms alone: the policy is not pushed towards anything the environment rewards. A run
made of such steps used to end with exit 0 and ``done: N optimizer steps``. Now the first such step
warns with what the batch shows (rewards, how episodes ended, actions without a valid tool call),
the count reaches the closing line, and ``max_steps_without_signal`` in a row stop the run with
:class:`NoLearningSignal` (exit status 3). The module decides on counts summed over ranks, so every
rank takes the same decision. The work a zero gradient needs not is skipped in the module
(``AgentRLModule._zero_gradient``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_agentrl.distributed import all_gather
from lightning_agentrl.shutdown import RunStopped
from lightning_agentrl.trajectory import RolloutBatch, Segment, TerminationReason, Trajectory, Turn


class NoLearningSignal(RunStopped):
    """Step after step, every advantage was 0."""

    exit_status = 3


def no_signal_facts(trajectories: list[Trajectory]) -> str:
    """What a batch without learning signal shows, as the likely causes, most likely first.

    >>> from lightning_agentrl.trajectory import Segment, Turn
    >>> turn = Turn(action_start=0, action_end=1)
    >>> episode = Trajectory(episode_id="e", task_id="t", group_id=0, termination="max_turns",
    ...                      segments=[Segment(turns=[turn, turn])])
    >>> no_signal_facts([episode, episode])
    'every episode earned reward 0; 4 of 4 actions held no valid tool call; no episode submitted (endings: 2 max_turns)'
    """
    rewards = sorted({t.reward for t in trajectories})
    facts = [f"every episode earned reward {rewards[0]:g}" if len(rewards) == 1 else
             f"the episodes of each group earned the same reward (rewards seen: {', '.join(f'{r:g}' for r in rewards[:5])})"]
    actions = [turn for t in trajectories for turn in t.turns]
    invalid = sum(turn.tool is None for turn in actions)
    if invalid:
        facts.append(f"{invalid} of {len(actions)} actions held no valid tool call")
    reasons = Counter(t.termination.value for t in trajectories if t.termination is not None)
    ended = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    submitted = reasons.get(TerminationReason.SUBMITTED.value, 0)
    facts.append(f"no episode submitted (endings: {ended})" if not submitted else f"endings: {ended}")
    return "; ".join(facts)


def _summaries(trajectories: list[Trajectory]) -> list[Trajectory]:
    """What :func:`no_signal_facts` reads of each episode (reward, ending, which turns called a tool), without
    its tokens: small enough to gather from every process."""
    return [Trajectory(episode_id=t.episode_id, task_id=t.task_id, group_id=t.group_id, reward=t.reward,
                       termination=t.termination,
                       segments=[Segment(turns=[Turn(action_start=0, action_end=0, tool=turn.tool) for turn in t.turns])])
            for t in trajectories]


class LearningSignalGuard(L.Callback):
    """Counts the steps without learning signal (``AgentRLModule.learning_signal``): warns at the first,
    logs ``train/steps_without_signal`` (in a row), stops after ``max_in_a_row`` (None: never)."""

    def __init__(self, *, max_in_a_row: int | None, checkpoint: Path | None = None) -> None:
        if max_in_a_row is not None and max_in_a_row < 1:
            raise ValueError(f"rollout.max_steps_without_signal must be >= 1 or None, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.checkpoint = checkpoint  # written before a stop, so the stopping step is kept (``--resume last``)
        self.num_without_signal = 0
        self.num_in_a_row = 0
        self.num_batches = 0
        self._step = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._step = trainer.global_step  # the step this batch trains (the optimizer step advances it)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        self.num_batches += 1
        signal = getattr(pl_module, "learning_signal", True)
        self.num_in_a_row = 0 if signal else self.num_in_a_row + 1
        pl_module.log("train/steps_without_signal", float(self.num_in_a_row), on_step=True, batch_size=1)
        if signal:
            return
        self.num_without_signal += 1
        # the step's facts over every process's share of the batch (every rank takes this branch together)
        facts = no_signal_facts([t for share in all_gather(_summaries(batch.trajectories)) for t in share])
        limit = self.max_in_a_row
        if limit is not None and self.num_in_a_row >= limit:
            saved = ""
            if self.checkpoint is not None:
                trainer.save_checkpoint(self.checkpoint)
                saved = f" Checkpoint: {self.checkpoint} (step {trainer.global_step})."
            raise NoLearningSignal(
                f"no learning signal in {self.num_in_a_row} steps in a row (rollout.max_steps_without_signal={limit}): "
                f"every advantage was 0; the last batch: {facts}. Check the tool-call format the model writes "
                f"(`python -m lightning_agentrl inspect {trainer.default_root_dir}`) and that the reward can vary.{saved}"
            )
        if self.num_without_signal == 1:
            stop = f"the run stops after {limit} such steps in a row" if limit else "the run goes on"
            rank_zero_warn(
                f"step {self._step}: no learning signal, every advantage is 0 ({facts}). Likely causes: the "
                f"policy writes no valid tool call, or the reward never varies within a group (a task too hard or "
                f"too easy, a scorer that cannot fail or pass). Nothing is learned from such a step; {stop} "
                f"(rollout.max_steps_without_signal)"
            )

    @override
    def state_dict(self) -> dict:
        return {"num_without_signal": self.num_without_signal, "num_in_a_row": self.num_in_a_row,
                "num_batches": self.num_batches}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_without_signal = state_dict["num_without_signal"]
        self.num_in_a_row = state_dict["num_in_a_row"]
        self.num_batches = state_dict["num_batches"]


__all__ = ["LearningSignalGuard", "NoLearningSignal", "no_signal_facts"]

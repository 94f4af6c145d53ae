"""Forced truncation: cut the turn budget of a seeded share of training episodes.

``rollout.forced_truncation_rate`` episodes (drawn from the seed, the group and the index, so a
parked episode keeps its budget) get only ``rollout.forced_truncation_turns`` turns and so end with
``max_turns`` whatever the policy does. It exists to compare how truncated episodes are scored
(``benchmarks/compare.py truncation``: reward 0 vs compact filtering); held-out evaluation is
never cut. It reaches the rollout service as its ``episode_budget`` hook.

Example:
    >>> from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    >>> cut = ForcedTruncation(rate=1.0, turns=1)
    >>> cut(EpisodeBudget(max_turns=4), group_id=0, index=0).max_turns
    1
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from lightning_agentrl.rollout.agent_loop import EpisodeBudget


@dataclass(frozen=True)
class ForcedTruncation:
    rate: float
    turns: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rollout.forced_truncation_rate must be in [0, 1], got {self.rate}")
        if self.turns < 1:
            raise ValueError(f"rollout.forced_truncation_turns must be >= 1, got {self.turns}")

    @classmethod
    def from_settings(cls, rollout, *, seed: int) -> ForcedTruncation | None:
        """The hook a ``RolloutSettings`` section asks for; None when the rate is 0 (no experiment)."""
        if rollout.forced_truncation_rate == 0.0:
            return None
        return cls(rollout.forced_truncation_rate, rollout.forced_truncation_turns, seed)

    def __call__(self, budget: EpisodeBudget, group_id: int, index: int) -> EpisodeBudget:
        """The budget of episode ``index`` of group ``group_id``: ``budget``, or, for a ``rate`` share
        of episodes, the same budget with only ``turns`` turns."""
        if self.rate == 0.0:
            return budget
        draw = random.Random(f"forced-truncation/{self.seed}/{group_id}/{index}").random()
        if draw >= self.rate:
            return budget
        return replace(budget, max_turns=min(self.turns, budget.max_turns))

"""rollout.forced_truncation_rate cuts the turn budget of a seeded share of training episodes."""

from __future__ import annotations

import pytest

from lightning_agentrl.experiments.forced_truncation import ForcedTruncation
from lightning_agentrl.rollout.agent_loop import EpisodeBudget
from lightning_agentrl.rollout.service import RolloutPlan
from lightning_agentrl.settings import SettingsError, load_settings
from lightning_agentrl.trajectory import TerminationReason
from tests.rollout.conftest import ScriptedEngine, call, counting_service


def plan() -> RolloutPlan:
    return RolloutPlan(group_size=4, groups_per_step=4, max_in_flight=16, max_staleness=0)


def truncation(rate: float, seed: int = 0) -> ForcedTruncation:
    return ForcedTruncation(rate, turns=1, seed=seed)


def test_the_cut_episodes_are_a_seeded_share_and_keep_their_budget():
    budget = EpisodeBudget(max_turns=4)
    cut = [[truncation(0.3)(budget, g, i).max_turns == 1 for i in range(8)] for g in range(250)]
    share = sum(map(sum, cut)) / 2000
    assert 0.26 < share < 0.34
    assert cut == [[truncation(0.3)(budget, g, i).max_turns == 1 for i in range(8)] for g in range(250)]
    other_seed = [[truncation(0.3, seed=1)(budget, g, i).max_turns == 1 for i in range(8)] for g in range(250)]
    assert other_seed != cut
    assert truncation(0.0)(budget, 0, 0) is budget
    assert all(truncation(1.0)(budget, g, 0).max_turns == 1 for g in range(20))
    assert truncation(1.0)(budget, 0, 0).max_context_tokens == budget.max_context_tokens


def test_forced_episodes_end_with_max_turns_in_the_service(codec, task):
    engine = ScriptedEngine(codec, {"*": [call("run", command="ls"), call("submit")]})
    service = counting_service(codec, [task], engine, plan(), submit_at=2, episode_budget=truncation(0.5))
    with service:
        batch = service.take_batch(0, timeout_s=30)
    expected = {f"g{g}-e{i}": truncation(0.5)(EpisodeBudget(max_turns=4), g, i).max_turns == 1
                for g in range(4) for i in range(4)}
    assert 0 < sum(expected.values()) < 16
    for trajectory in batch:
        forced = expected[trajectory.episode_id]
        assert trajectory.termination is (TerminationReason.MAX_TURNS if forced else TerminationReason.SUBMITTED)
        assert len(trajectory.turns) == (1 if forced else 2)


def test_settings_refuse_a_forced_budget_that_does_not_cut():
    with pytest.raises(SettingsError, match=r"forced_truncation_turns \(4\) must be below env.max_turns \(4\)"):
        load_settings(None, ["--rollout.forced_truncation_rate=0.3", "--rollout.forced_truncation_turns=4",
                             "--env.max_turns=4"])
    with pytest.raises(SettingsError, match="forced_truncation_rate"):
        load_settings(None, ["--rollout.forced_truncation_rate=1.5"])

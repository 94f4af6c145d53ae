"""Trajectories pack into the flat tensors the losses use; the SPEC §2 token vector holds."""

from __future__ import annotations

import math

import torch

from lightning_agentrl.algorithms.losses import aggregate
from lightning_agentrl.trajectory import (
    Segment,
    TerminationReason,
    Trajectory,
    Turn,
    load_trajectories,
    pack,
    save_trajectories,
)

# SPEC §2: prompt 400 (m=0), a1 30 (m=1), o1 900 (m=0), a2 150 (m=1), o2 300 (m=0), a3 20 (m=1)
SPEC_LAYOUT = [(400, 0), (30, 1), (900, 0), (150, 1), (300, 0), (20, 1)]


def spec_trajectory(index: int) -> Trajectory:
    segment = Segment()
    next_id = 0
    for length, mask in SPEC_LAYOUT:
        ids = list(range(next_id, next_id + length))
        next_id += length
        if mask:
            start = len(segment.token_ids)
            segment.extend(ids, mask=1, logprobs=[-1.0] * length, version=0)
            segment.turns.append(Turn(action_start=start, action_end=len(segment.token_ids)))
        else:
            segment.extend(ids, mask=0)
    return Trajectory(
        episode_id=f"e{index}", task_id="parse_date", group_id=0, segments=[segment], reward=1.0,
        termination=TerminationReason.SUBMITTED,
    )


def test_spec_vector_token_mean_denominator_is_800():
    trajectories = [spec_trajectory(i) for i in range(4)]
    assert trajectories[0].num_tokens == 1800
    assert trajectories[0].num_action_tokens == 200
    batch = pack(trajectories)
    assert batch.num_tokens == 4 * 1800
    assert float(batch.loss_mask.sum()) == 800.0
    # token-mean of ones over mask=1 tokens: numerator 800 / denominator 800; of a one-hot: 1/800
    values = torch.zeros(batch.num_tokens)
    first_action = int(torch.nonzero(batch.loss_mask)[0])
    values[first_action] = 1.0
    loss = aggregate(values, batch.loss_mask, batch.episode_ids, "token-mean")
    assert math.isclose(float(loss), 1 / 800, rel_tol=1e-6)


def test_pack_positions_restart_per_segment_and_turns_index_actions():
    first, second = Segment(), Segment()
    first.extend([1, 2], mask=0)
    first.extend([3, 4], mask=1, logprobs=[-0.1, -0.2], version=3)
    first.turns.append(Turn(action_start=2, action_end=4, reward=0.0, state_key="s0"))
    second.extend([5], mask=0)
    second.extend([6], mask=1, logprobs=[-0.3], version=4)
    second.turns.append(Turn(action_start=1, action_end=2, reward=1.0, state_key="s1"))
    trajectory = Trajectory(episode_id="e", task_id="t", group_id=7, segments=[first, second], reward=1.0,
                            termination=TerminationReason.SUBMITTED)
    batch = pack([trajectory])
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1]
    assert batch.segment_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert batch.token_turn.tolist() == [-1, -1, 0, 0, -1, 1]
    assert batch.policy_versions.tolist() == [-1, -1, 3, 3, -1, 4]
    assert torch.isnan(batch.behavior_logprobs[:2]).all()
    assert batch.turn_state_keys == ["s0", "s1"]
    assert batch.turn_rewards.tolist() == [0.0, 1.0]
    assert batch.num_turns.tolist() == [2]


def test_trajectory_json_round_trip(tmp_path):
    trajectories = [spec_trajectory(i) for i in range(2)]
    path = tmp_path / "t.jsonl"
    save_trajectories(trajectories, path)
    loaded = load_trajectories(path)
    assert loaded == trajectories
    assert loaded[0].segments[0].behavior_logprobs[0] is None  # NaN is not JSON: None where mask 0


def test_segment_rejects_misaligned_fields():
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError, match="loss_mask has 1 entries for 2 tokens"):
        Segment(token_ids=[1, 2], loss_mask=[0], behavior_logprobs=[None, None], policy_versions=[-1, -1])

"""benchmarks/critic_ceiling.py: what a memorizing critic explains of the returns, from a run's saved batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_agentrl.trajectory import Segment, Trajectory, Turn, save_trajectories

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from critic_ceiling import main, past_mean_ev, state_mean_ev, step_ceilings, turn_returns, turn_states  # noqa: E402


def episode(rewards: list[float], rooms: list[str], goal: list[int], start: int = 7) -> Trajectory:
    """One turn per room: a prompt token ``start``, then for each turn one action token and one observation."""
    ids, turns = [start], []
    for reward, room in zip(rewards, rooms, strict=True):
        turns.append(Turn(action_start=len(ids), action_end=len(ids) + 1, reward=reward, state_key=room))
        ids += [100 + len(turns), 200 + ord(room[0])]
    segment = Segment(token_ids=ids, loss_mask=[0] * len(ids), behavior_logprobs=[None] * len(ids),
                      policy_versions=[-1] * len(ids), turns=turns)
    return Trajectory(episode_id=f"e{id(turns)}", task_id="t", group_id=0, segments=[segment],
                      critic_context_ids=goal)


def test_turn_returns_discount_each_turn_s_reward_to_go():
    assert turn_returns(episode([0.1, 0.0, 1.0], ["a", "b", "c"], []), 0.5) == pytest.approx([0.35, 0.5, 1.0])


def test_the_state_mean_explains_returns_that_states_decide_and_nothing_of_chance():
    # two states, each always returning its own value: the other turn of a state predicts it exactly
    assert state_mean_ev(["x", "x", "y", "y"], [1.0, 1.0, 0.0, 0.0]) == pytest.approx(1.0)
    # one state, returns by chance: leave-one-out means 1/3 and 2/3 against 1 and 0 -> EV = 1 - (4/9)/(1/4)
    assert state_mean_ev(["x"] * 4, [1.0, 1.0, 0.0, 0.0]) == pytest.approx(1 - (4 / 9) / 0.25)
    assert state_mean_ev(["x", "y"], [1.0, 1.0]) is None  # no variance to explain


def test_the_past_mean_predicts_a_batch_from_the_batches_before_it():
    past = [(["x", "y"], [1.0, 0.0]), (["x", "y"], [0.0, 0.0])]  # x: 0.5, y: 0.0, overall 0.25
    # this batch: x returns 0.5 (predicted exactly), z unseen returns 0.25 (the overall mean): EV 1
    assert past_mean_ev(["x", "z"], [0.5, 0.25], past) == pytest.approx(1.0)
    # z returns 0 instead: errors 0 and -0.25 against returns 0.5 and 0 -> EV = 1 - 0.25^2/4 / (0.5^2/4) = 0.75
    assert past_mean_ev(["x", "z"], [0.5, 0.0], past) == pytest.approx(0.75)
    assert past_mean_ev(["x"], [1.0], []) is None


def test_states_keyed_by_context_or_environment_state_with_or_without_the_critic_context():
    a = episode([0.0, 1.0], ["hall", "vault"], [9])
    b = episode([0.0, 0.0], ["hall", "vault"], [8], start=6)  # another prompt, the same rooms
    assert turn_states(a, "context") != turn_states(b, "context")
    assert turn_states(a, "state") == turn_states(b, "state") == [((), 0, "hall"), ((), 1, "vault")]
    assert turn_states(a, "state+critic")[0] == ((9,), 0, "hall") != turn_states(b, "state+critic")[0]


def test_a_run_folder_gives_each_step_its_explained_variances(tmp_path, capsys):
    """Two steps of the same two worlds: the goal (critic context) decides the return, the rooms do not."""
    run = tmp_path / "run"
    (run / "settings.yaml").parent.mkdir()
    (run / "settings.yaml").write_text("algorithm:\n  gamma: 1.0\n")
    for step in range(2):
        save_trajectories([episode([0.0, 1.0], ["hall", "vault"], [9]), episode([0.0, 0.0], ["hall", "vault"], [8]),
                           episode([0.0, 1.0], ["hall", "vault"], [9]), episode([0.0, 0.0], ["hall", "vault"], [8])],
                          run / "trajectories" / f"step_{step:06d}.jsonl")
    rows = step_ceilings(run, gamma=1.0)
    assert sorted(rows) == [0, 1]
    assert rows[0]["state+critic"] == pytest.approx(1.0) and rows[1]["state+critic@past"] == pytest.approx(1.0)
    assert rows[0]["state+critic@past"] is None  # nothing before the first step
    assert rows[1]["state@past"] == pytest.approx(0.0)  # the rooms alone: every turn predicted by 0.5
    assert rows[0]["state"] < 0  # leave-one-out without the goal: worse than the mean
    main([str(run)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["state_mean_ev"]["state+critic"] == {"mean": pytest.approx(1.0), "late": pytest.approx(1.0)}
    assert printed["value_head_ev"] is None  # no MLflow store in this folder

"""benchmarks/critic_ceiling.py: what a memorizing critic explains of the returns, from a run's saved batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_agentrl.trajectory import Segment, Trajectory, Turn, save_trajectories

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from critic_ceiling import (  # noqa: E402
    explainable_ev,
    main,
    past_mean_ev,
    run_ceiling,
    step_ceilings,
    turn_returns,
    turn_states,
)


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


def test_the_explainable_fraction_is_what_a_perfect_critic_explains_whatever_the_visits_per_state():
    # two states, each always returning its own value: all of it
    assert explainable_ev(["x", "x", "y", "y"], [1.0, 1.0, 0.0, 0.0]) == (pytest.approx(1.0), 1.0)
    # one state, returns by chance: nothing (pooled within variance 1/3 = the sample variance; total 1/4)
    assert explainable_ev(["x"] * 4, [1.0, 1.0, 0.0, 0.0])[0] == pytest.approx(1 - (1 / 3) / (1 / 4))
    # states visited once say nothing of their noise: the share of turns in repeated states is the coverage
    assert explainable_ev(["x", "x", "y"], [1.0, 0.0, 1.0]) == (pytest.approx(1 - 0.5 / (2 / 9)), pytest.approx(2 / 3))
    assert explainable_ev(["x", "y"], [1.0, 0.0]) == (None, 0.0)
    assert explainable_ev(["x", "x"], [0.3, 0.1 + 0.2])[0] is None  # equal up to rounding: no variance


def test_the_explainable_fraction_does_not_fall_with_fewer_visits_per_state():
    """Sixteen states, half returning 1 with probability 0.2 and half 0.8: a perfect critic explains
    0.09 / 0.25 = 0.36 of the variance. Averaged over batches, the estimate is near it at 2 visits per state as
    at 16 (a leave-one-out state mean is not: it scores below 0 at 2 visits)."""
    import random

    rng = random.Random(0)
    for visits in (2, 16):
        estimates = []
        for _ in range(400):
            states = [s for s in range(16) for _ in range(visits)]
            returns = [float(rng.random() < (0.2 if s % 2 else 0.8)) for s in states]
            estimates.append(explainable_ev(states, returns)[0])
        estimates = [e for e in estimates if e is not None]
        assert abs(sum(estimates) / len(estimates) - 0.36) < 0.04, (visits, sum(estimates) / len(estimates))


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
    assert rows[0]["state+critic"] == pytest.approx(1.0) and rows[0]["state+critic:coverage"] == 1.0
    assert rows[1]["state+critic@past"] == pytest.approx(1.0)
    assert rows[0]["state+critic@past"] is None  # nothing before the first step
    assert rows[1]["state@past"] == pytest.approx(0.0)  # the rooms alone: every turn predicted by 0.5
    assert rows[0]["state"] == pytest.approx(1 - (1 / 3) / (1 / 4))  # the rooms alone explain nothing
    main([str(run)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["critic_ceiling"]["state+critic"] == {"mean": pytest.approx(1.0), "late": pytest.approx(1.0)}
    assert printed["value_head_ev"] is None  # no MLflow store in this folder
    assert run_ceiling(tmp_path / "nothing") == {}


def test_the_run_s_latest_gamma_is_used_and_a_step_file_cut_short_is_left_out(tmp_path):
    """Rewards [1, 0] and [0, 1] from the same rooms: the first turn's returns are 1 and gamma. At gamma 1
    the pooled within-room variance is 0.5 / 2 against 0.1875 in all; at 0.5 (a resume's settings file),
    0.625 / 2 against 0.171875."""
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "settings.yaml").write_text("algorithm:\n  gamma: 1.0\n")
    save_trajectories([episode([1.0, 0.0], ["hall", "vault"], []), episode([0.0, 1.0], ["hall", "vault"], [])],
                      run / "trajectories" / "step_000000.jsonl")
    assert run_ceiling(run)["state"]["mean"] == pytest.approx(1 - 0.25 / 0.1875)
    (run / "settings.resume-000001.yaml").write_text("algorithm:\n  gamma: 0.5\n")
    (run / "trajectories" / "step_000001.jsonl").write_text('{"episode_id": "e", "task_')  # a kill mid-write
    assert run_ceiling(run)["state"] == {"mean": pytest.approx(1 - 0.3125 / 0.171875),
                                         "late": pytest.approx(1 - 0.3125 / 0.171875)}


def test_the_probe_s_ridge_finds_a_linear_value_and_none_in_noise():
    """benchmarks/critic_probe.py: returns that are a linear map of the states are explained in and out of sample;
    returns independent of them are not (out of sample about 0 or below)."""
    import numpy as np
    from critic_probe import ridge_ev

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8))
    linear = x @ rng.normal(size=8) + 0.5
    fitted, held_out = ridge_ev(x[:300], linear[:300], x[300:], linear[300:], 1e-3)
    assert fitted > 0.999 and held_out > 0.999
    noise = rng.normal(size=400)
    fitted, held_out = ridge_ev(x[:300], noise[:300], x[300:], noise[300:], 1e-3)
    assert fitted < 0.1 and held_out < 0.02

"""Policy lag, staleness weights and the staleness bound."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_agentrl.algorithms import staleness


def test_lag_per_token_with_partial_rollouts():
    # One trajectory continued across versions 3 and 5 (partial rollout), observations at -1.
    version = torch.tensor([-1, 3, 3, -1, 5, 5, -1, 6])
    lag = staleness.lag(version, current_version=6)
    assert lag.tolist() == [-1, 3, 3, -1, 1, 1, -1, 0]
    with pytest.raises(ValueError, match="newer than the current version"):
        staleness.lag(version, current_version=5)


def test_staleness_weights():
    lag = torch.tensor([-1, 0, 1, 4])
    assert staleness.staleness_weight(lag, "none").tolist() == [1.0, 1.0, 1.0, 1.0]
    assert staleness.staleness_weight(lag, "exp", decay=0.5).tolist() == pytest.approx(
        [1.0, 1.0, math.exp(-0.5), math.exp(-2.0)]
    )
    assert staleness.staleness_weight(lag, "inverse", decay=0.5).tolist() == pytest.approx(
        [1.0, 1.0, 1 / 1.5, 1 / 3]
    )
    with pytest.raises(ValueError, match="kind"):
        staleness.staleness_weight(lag, "linear")
    with pytest.raises(ValueError, match="decay"):
        staleness.staleness_weight(lag, "exp", decay=-1.0)


def test_trajectory_lag_is_its_oldest_token_and_bound_drops_old_trajectories():
    token_lag = torch.tensor([-1, 3, 1, -1, 0, 0, -1, -1, 5])
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])
    per_traj = staleness.trajectory_lag(token_lag, seq_ids, num_seqs=4)
    assert per_traj.tolist() == [3, 0, -1, 5]
    keep, counts = staleness.apply_staleness_bound(per_traj, max_lag=3)
    assert keep.tolist() == [True, True, True, False]
    assert counts["staleness/num_kept"] == 3 and counts["staleness/num_dropped"] == 1
    assert counts["staleness/max_lag"] == 5 and counts["staleness/mean_lag"] == pytest.approx(8 / 3)
    keep_all, _ = staleness.apply_staleness_bound(per_traj, max_lag=None)
    assert keep_all.all()
    with pytest.raises(ValueError, match="max_lag"):
        staleness.apply_staleness_bound(per_traj, max_lag=-1)

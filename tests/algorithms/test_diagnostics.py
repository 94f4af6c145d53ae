"""Diagnostics: explained variance, Echo-Trap warning, histograms, the credit table."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_agentrl.algorithms import diagnostics


def test_explained_variance():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert diagnostics.explained_variance(returns, returns) == 1.0
    assert diagnostics.explained_variance(torch.full((4,), 2.5), returns) == 0.0
    noisy = returns + torch.tensor([0.5, -0.5, 0.5, -0.5])
    assert diagnostics.explained_variance(noisy, returns) == pytest.approx(1 - 0.25 / 1.25)
    assert math.isnan(diagnostics.explained_variance(returns, torch.ones(4)))
    masked = diagnostics.explained_variance(torch.tensor([1.0, 2.0, 99.0]), torch.tensor([1.0, 2.0, 0.0]),
                                            torch.tensor([1.0, 1.0, 0.0]))  # fmt: skip
    assert masked == 1.0


def test_echo_trap_warns_when_within_group_std_collapses():
    healthy = [0.40, 0.45, 0.42, 0.44, 0.41, 0.43, 0.40, 0.42, 0.44, 0.41]
    assert diagnostics.echo_trap_warning(healthy, window=5) is None
    collapsed = healthy + [0.10, 0.05, 0.04, 0.02, 0.01]
    grad_norms = [1.0] * 10 + [1.2, 1.5, 9.0, 1.1, 1.0]
    message = diagnostics.echo_trap_warning(collapsed, window=5, grad_norm_history=grad_norms)
    assert message is not None and "0.044" in message and "Grad norm spiked to 9" in message
    assert diagnostics.echo_trap_warning(collapsed[:9], window=5) is None  # too short to judge


def test_credit_table_on_the_spec_example():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_ids = torch.zeros(4, dtype=torch.long)
    turn_traj = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    keys = ["start", "read", "t1 edited", "start", "read", "t2 edited",
            "start", "searched", "t3 edited", "start", "ran tests", "t4 edited"]  # fmt: skip
    rows = diagnostics.credit_table(rewards, group_ids, turn_traj, keys)
    assert len(rows) == 12
    t1_edit, t2_edit = rows[1], rows[4]
    assert (t1_edit["trajectory"], t1_edit["turn"], t2_edit["trajectory"], t2_edit["turn"]) == (0, 1, 1, 1)
    assert round(t1_edit["gigpo"], 3) == 1.577 and round(t2_edit["gigpo"], 3) == -2.732
    assert [round(rows[3][k], 3) for k in ("grpo", "grpo_sample", "rloo", "dr_grpo")] == [
        -1.732,
        -1.5,
        -1.0,
        -0.75,
    ]
    assert [row["anchor_group_size"] for row in rows[:3]] == [4, 2, 1]
    assert rows[8]["gigpo"] == pytest.approx(rows[8]["grpo"], abs=1e-6)  # unique state: A^S = 0
    summary = diagnostics.credit_summary(rows)
    assert summary["gigpo/anchor_hit_rate"] == 0.5
    assert summary["gigpo/turns_in_groups_of_4"] == 4 and summary["gigpo/turns_in_groups_of_2"] == 2
    assert summary["gigpo/turns_in_groups_of_1"] == 6

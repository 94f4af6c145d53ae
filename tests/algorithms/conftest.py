"""Shared fixtures: the SPEC §2 token layout."""

from __future__ import annotations

import pytest
import torch


def _spec_token_layout(num_traj: int = 4):
    """SPEC §2: prompt 400, a1 30, o1 900, a2 150, o2 300, a3 20 per trajectory (1800 tokens)."""
    spans = [(400, -1), (30, 0), (900, -1), (150, 1), (300, -1), (20, 2)]
    mask, seq_ids, token_turn = [], [], []
    for i in range(num_traj):
        for length, turn in spans:
            mask += [1.0 if turn >= 0 else 0.0] * length
            seq_ids += [i] * length
            token_turn += [3 * i + turn if turn >= 0 else -1] * length
    return torch.tensor(mask), torch.tensor(seq_ids), torch.tensor(token_turn)


@pytest.fixture
def spec_token_layout():
    """Builder of the SPEC §2 packed layout: (mask[N], seq_ids[N], token_turn[N]), 1800 tokens each."""
    return _spec_token_layout

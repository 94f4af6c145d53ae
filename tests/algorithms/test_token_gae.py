"""Token-level GAE against an independent re-implementation of verl's GAE for multi-turn responses
(``compute_gae_advantage_return`` with a response mask whose 0s are observation tokens: the recursion
skips their values and TD errors), on random ragged batches, before verl's whitening."""

from __future__ import annotations

import pytest
import torch

from lightning_agentrl.algorithms import advantages as adv


def verl_gae(token_level_rewards, values, response_mask, gamma, lam, last_values=None):
    """verl's loop over padded [B, T] tensors, right to left; ``last_values`` (B) seeds V after the end
    (0 in verl; a truncated episode's bootstrap here)."""
    batch, length = values.shape
    next_values = torch.zeros(batch, dtype=values.dtype) if last_values is None else last_values.clone()
    last_gae = torch.zeros(batch, dtype=values.dtype)
    reversed_adv = []
    for t in reversed(range(length)):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_values = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * next_values
        last_gae = gae_t * response_mask[:, t] + (1 - response_mask[:, t]) * last_gae
        reversed_adv.append(gae_t)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def ragged_episodes(seed: int, num_episodes: int = 5):
    """Episodes of 1-4 turns, each turn some action tokens then some observation tokens; a reward at
    the end of each turn's action. Returns padded tensors and the packed trained-token view."""
    gen = torch.Generator().manual_seed(seed)
    rows, turn_rewards, turn_traj = [], [], []
    for b in range(num_episodes):
        row = []  # (is_action, turn index or -1)
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            k = len(turn_rewards)
            row += [(1, k)] * int(torch.randint(1, 7, (1,), generator=gen))
            row += [(0, -1)] * int(torch.randint(0, 5, (1,), generator=gen))
            turn_rewards.append(float(torch.rand(1, generator=gen)) - 0.3)
            turn_traj.append(b)
        rows.append(row)
    width = max(len(r) for r in rows)
    mask = torch.zeros(num_episodes, width, dtype=torch.float64)
    token_turn = torch.full((num_episodes, width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for t, (is_action, k) in enumerate(row):
            mask[b, t], token_turn[b, t] = is_action, k
    values = torch.randn(num_episodes, width, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(num_episodes, width, dtype=torch.float64)
    turn_rewards = torch.tensor(turn_rewards, dtype=torch.float64)
    for b in range(num_episodes):  # the reward on the last action token of each turn
        for t in range(width):
            k = int(token_turn[b, t])
            if k >= 0 and (t + 1 == width or int(token_turn[b, t + 1]) != k):
                rewards[b, t] = turn_rewards[k]
    trained = mask > 0
    traj = torch.arange(num_episodes).unsqueeze(1).expand(num_episodes, width)[trained]
    return dict(mask=mask, values=values, rewards=rewards, turn_rewards=turn_rewards, token_turn=token_turn,
                trained=trained, traj=traj)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.95, 0.9), (0.8, 0.0)])
def test_token_gae_equals_verls_multi_turn_gae(seed, gamma, lam):
    e = ragged_episodes(seed)
    ref_adv, ref_returns = verl_gae(e["rewards"], e["values"], e["mask"], gamma, lam)
    packed_rewards = adv.turn_end_rewards(e["turn_rewards"], e["token_turn"][e["trained"]])
    torch.testing.assert_close(packed_rewards, e["rewards"][e["trained"]])
    ours, returns = adv.token_gae(packed_rewards, e["values"][e["trained"]], e["traj"], gamma, lam)
    torch.testing.assert_close(ours.double(), ref_adv[e["trained"]], rtol=0, atol=1e-6)
    torch.testing.assert_close(returns.double(), ref_returns[e["trained"]], rtol=0, atol=1e-6)


def test_a_truncated_episode_bootstraps_from_the_critic_and_the_others_end_at_zero():
    e = ragged_episodes(7, num_episodes=4)
    bootstrap = torch.tensor([0.3, -1.2, 2.0, 0.7], dtype=torch.float64)
    truncated = torch.tensor([True, False, True, False])
    ref_adv, _ = verl_gae(e["rewards"], e["values"], e["mask"], 0.9, 0.95,
                          last_values=torch.where(truncated, bootstrap, torch.zeros_like(bootstrap)))
    rewards = adv.turn_end_rewards(e["turn_rewards"], e["token_turn"][e["trained"]])
    ours, _ = adv.token_gae(rewards, e["values"][e["trained"]], e["traj"], 0.9, 0.95,
                            bootstrap_values=bootstrap, truncated=truncated)
    torch.testing.assert_close(ours.double(), ref_adv[e["trained"]], rtol=0, atol=1e-6)
    plain, _ = adv.token_gae(rewards, e["values"][e["trained"]], e["traj"], 0.9, 0.95)
    cut = truncated[e["traj"]]
    assert not torch.allclose(plain[cut], ours[cut]) and torch.equal(plain[~cut], ours[~cut])


def test_observation_tokens_between_turns_do_not_discount_the_next_turns_value():
    """Two turns of one token each with an observation between them: A_0 = r_0 + gamma V_1 - V_0, as if
    the observation were not there."""
    rewards, values = torch.tensor([0.0, 1.0]), torch.tensor([0.2, 0.5])
    advantages, _ = adv.token_gae(rewards, values, torch.tensor([0, 0]), gamma=0.5, lam=1.0)
    assert advantages.tolist() == pytest.approx([0.0 + 0.5 * 0.5 - 0.2 + 0.5 * (1.0 - 0.5), 0.5])

"""Advantage estimators: SPEC §3 vectors, and each estimator against a plain-Python loop."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_agentrl.algorithms import advantages as adv

SPEC_REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
ONE_GROUP = torch.zeros(4, dtype=torch.long)


def rounded(t: torch.Tensor) -> list[float]:
    return [round(x, 3) for x in t.tolist()]


# ---------------------------------------------------------------------------------------------
# plain-Python references
# ---------------------------------------------------------------------------------------------


def groups_of(group_ids: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(rewards: list[float], group_ids: list[int], std: str, eps: float = 1e-6) -> list[float]:
    out = [0.0] * len(rewards)
    for members in groups_of(group_ids).values():
        values = [rewards[i] for i in members]
        n = len(values)
        mean = sum(values) / n
        if max(values) == min(values):
            continue  # zero-variance group: exactly 0
        for i in members:
            if std == "none":
                out[i] = rewards[i] - mean
            else:
                dof = n if std == "population" else n - 1
                sd = math.sqrt(sum((v - mean) ** 2 for v in values) / dof)
                out[i] = (rewards[i] - mean) / (sd + eps)
    return out


def ref_rloo(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = [0.0] * len(rewards)
    for members in groups_of(group_ids).values():
        if len(members) < 2:
            continue
        for i in members:
            others = [rewards[j] for j in members if j != i]
            out[i] = rewards[i] - sum(others) / len(others)
    return out


def random_batch(rng: random.Random, num_groups: int, binary: bool = True):
    """Ragged groups (sizes 1..6) with shuffled, non-contiguous group ids."""
    group_ids, rewards = [], []
    for g in rng.sample(range(100), num_groups):
        for _ in range(rng.randint(1, 6)):
            group_ids.append(g)
            rewards.append(
                float(rng.randint(0, 1)) if binary else rng.choice([0.0, 0.1, 0.5, 1.0, rng.random()])
            )
    order = list(range(len(rewards)))
    rng.shuffle(order)
    return [rewards[i] for i in order], [group_ids[i] for i in order]


# ---------------------------------------------------------------------------------------------
# SPEC vectors
# ---------------------------------------------------------------------------------------------


def test_spec_vector_grpo_population_std():
    assert rounded(adv.grpo(SPEC_REWARDS, ONE_GROUP, std="population")) == [0.577, -1.732, 0.577, 0.577]


def test_spec_vector_grpo_sample_std():
    assert rounded(adv.grpo(SPEC_REWARDS, ONE_GROUP, std="sample")) == [0.5, -1.5, 0.5, 0.5]


def test_spec_vector_rloo():
    assert rounded(adv.rloo(SPEC_REWARDS, ONE_GROUP)) == [0.333, -1.0, 0.333, 0.333]


def test_dr_grpo_is_mean_only():
    assert rounded(adv.grpo(SPEC_REWARDS, ONE_GROUP, std="none")) == [0.25, -0.75, 0.25, 0.25]


@pytest.mark.parametrize(
    "estimator",
    [
        lambda r, g: adv.grpo(r, g, std="population"),
        lambda r, g: adv.grpo(r, g, std="sample"),
        lambda r, g: adv.grpo(r, g, std="none"),
        adv.rloo,
    ],
    ids=["grpo-population", "grpo-sample", "dr-grpo", "rloo"],
)
def test_advantages_sum_to_zero_per_group(estimator):
    rng = random.Random(0)
    for _ in range(20):
        rewards, group_ids = random_batch(rng, num_groups=5, binary=False)
        a = estimator(torch.tensor(rewards), torch.tensor(group_ids))
        for members in groups_of(group_ids).values():
            assert abs(sum(a[i].item() for i in members)) < 1e-5


def test_zero_variance_groups_give_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must come from the group being constant.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 0.0, 0.7])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    for std in ("population", "sample", "none"):
        a = adv.grpo(rewards, group_ids, std=std)
        assert torch.equal(a[:7], torch.zeros(7)), std
        assert a[7].item() == 0.0  # singleton group, even with the sample std (0/0)
    assert torch.equal(adv.rloo(rewards, group_ids), torch.zeros(8))


# ---------------------------------------------------------------------------------------------
# against plain loops on random ragged batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("std", ["population", "sample", "none"])
def test_grpo_matches_python_loop(std):
    rng = random.Random(1)
    for _ in range(30):
        rewards, group_ids = random_batch(rng, num_groups=rng.randint(1, 6), binary=rng.random() < 0.5)
        got = adv.grpo(torch.tensor(rewards), torch.tensor(group_ids), std=std)
        want = ref_grpo(rewards, group_ids, std)
        assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_rloo_matches_python_loop():
    rng = random.Random(2)
    for _ in range(30):
        rewards, group_ids = random_batch(rng, num_groups=rng.randint(1, 6), binary=rng.random() < 0.5)
        got = adv.rloo(torch.tensor(rewards), torch.tensor(group_ids))
        assert got.tolist() == pytest.approx(ref_rloo(rewards, group_ids), abs=1e-5)


def test_reinforce_decay_prefers_short_correct_paths():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    num_turns = torch.tensor([2, 4, 3, 2])
    a = adv.reinforce_decay(rewards, ONE_GROUP, num_turns, gamma=0.9)
    shaped = [0.9**2, 0.9**4, 0.0, 0.9**2]
    mean = sum(shaped) / 4
    assert a.tolist() == pytest.approx([s - mean for s in shaped], abs=1e-6)
    assert a[0] > a[1] > a[2]  # short correct > long correct > wrong
    loo = adv.reinforce_decay(rewards, ONE_GROUP, num_turns, gamma=0.9, baseline="leave_one_out")
    assert loo.tolist() == pytest.approx(ref_rloo(shaped, [0] * 4), abs=1e-6)


def test_reinforce_decay_matches_python_loop():
    rng = random.Random(3)
    for _ in range(20):
        rewards, group_ids = random_batch(rng, num_groups=4)
        turns = [rng.randint(1, 30) for _ in rewards]
        gamma = rng.uniform(0.8, 1.0)
        shaped = [r * gamma**t if r > 0 else r for r, t in zip(rewards, turns, strict=True)]
        got = adv.reinforce_decay(torch.tensor(rewards), torch.tensor(group_ids), torch.tensor(turns), gamma)
        assert got.tolist() == pytest.approx(ref_grpo(shaped, group_ids, "none"), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# GiGPO
# ---------------------------------------------------------------------------------------------

# SPEC §3: t1 read/correct edit/submit, t2 read/wrong edit/submit, t3 search/correct edit/submit,
# t4 run tests/correct edit/submit. Keys name the state each turn's action starts from.
SPEC_TURN_TRAJ = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
SPEC_KEYS = [
    "start", "read utils.py", "t1 edited",
    "start", "read utils.py", "t2 edited",
    "start", "searched call sites", "t3 edited",
    "start", "ran tests", "t4 edited",
]  # fmt: skip


def spec_turn_rewards() -> torch.Tensor:
    turn_rewards = torch.zeros(12)
    turn_rewards[[2, 5, 8, 11]] = SPEC_REWARDS
    return turn_rewards


def test_gigpo_spec_vector():
    a, stats = adv.gigpo(spec_turn_rewards(), SPEC_TURN_TRAJ, SPEC_KEYS, ONE_GROUP, gamma=0.95, omega=1.0)
    a = a.view(4, 3)
    assert round(a[0, 1].item(), 3) == 1.577  # t1's edit: 0.577 + 1
    assert round(a[1, 1].item(), 3) == -2.732  # t2's edit: -1.732 - 1
    step = stats["step_advantages"].view(4, 3)
    assert rounded(step[:2, 1]) == [1.0, -1.0]
    # t3 and t4 start their edit from unique states; every submit too: A^S = 0, A = A^E.
    assert step[2:, 1].tolist() == [0.0, 0.0] and step[:, 2].tolist() == [0.0] * 4
    assert stats["anchor_group_size"].view(4, 3)[:, 0].tolist() == [4, 4, 4, 4]
    assert sorted(stats["group_sizes"], reverse=True)[:2] == [4, 2]
    assert stats["gigpo/anchor_hit_rate"] == pytest.approx(6 / 12)


def test_gigpo_turn_one_step_advantage_equals_episode_advantage():
    a, stats = adv.gigpo(spec_turn_rewards(), SPEC_TURN_TRAJ, SPEC_KEYS, ONE_GROUP)
    episode = adv.grpo(SPEC_REWARDS, ONE_GROUP)
    first_turn_step = stats["step_advantages"].view(4, 3)[:, 0]
    assert first_turn_step.tolist() == pytest.approx(episode.tolist(), abs=1e-4)
    assert a.view(4, 3)[:, 0].tolist() == pytest.approx((2 * episode).tolist(), abs=1e-4)  # A^E counted twice


def test_gigpo_without_repeated_states_reduces_to_grpo():
    rng = random.Random(4)
    for _ in range(10):
        rewards, group_ids = random_batch(rng, num_groups=3)
        turn_traj = [i for i in range(len(rewards)) for _ in range(rng.randint(1, 4))]
        keys = [f"unique-{k}" for k in range(len(turn_traj))]
        turn_rewards = [0.0] * len(turn_traj)
        for k, i in enumerate(turn_traj):
            if k == len(turn_traj) - 1 or turn_traj[k + 1] != i:
                turn_rewards[k] = rewards[i]
        a, stats = adv.gigpo(
            torch.tensor(turn_rewards), torch.tensor(turn_traj), keys, torch.tensor(group_ids)
        )
        expected = adv.grpo(torch.tensor(rewards), torch.tensor(group_ids))[torch.tensor(turn_traj)]
        assert torch.allclose(a, expected, atol=1e-6)
        assert stats["gigpo/anchor_hit_rate"] == 0.0


def ref_gigpo(turn_rewards, turn_traj, keys, group_ids, gamma, omega, normalize):
    num_traj = len(group_ids)
    episode = [0.0] * num_traj
    for r, i in zip(turn_rewards, turn_traj, strict=True):
        episode[i] += r
    std = "population" if normalize == "mean_std" else "none"
    episode_adv = ref_grpo(episode, group_ids, std)
    returns = []
    for k in range(len(turn_rewards)):
        i = turn_traj[k]
        total, power = 0.0, 0
        for j in range(k, len(turn_rewards)):
            if turn_traj[j] != i:
                break
            total += gamma**power * turn_rewards[j]
            power += 1
        returns.append(total)
    anchor = [hash((group_ids[turn_traj[k]], keys[k])) for k in range(len(keys))]
    step = ref_grpo(returns, anchor, std)
    return [episode_adv[turn_traj[k]] + omega * step[k] for k in range(len(keys))]


@pytest.mark.parametrize("normalize", ["mean_std", "mean"])
def test_gigpo_matches_python_loop_with_repeated_states(normalize):
    rng = random.Random(5)
    for _ in range(15):
        num_traj = rng.randint(2, 10)
        group_ids = [rng.randint(0, 2) for _ in range(num_traj)]
        turn_traj, keys, turn_rewards = [], [], []
        for i in range(num_traj):
            for _ in range(rng.randint(1, 5)):
                turn_traj.append(i)
                keys.append(rng.choice("abcd"))  # few states: many anchor groups, also across task groups
                turn_rewards.append(rng.choice([0.0, 0.0, 0.5, 1.0]))
        gamma, omega = rng.uniform(0.5, 1.0), rng.uniform(0.1, 2.0)
        got, _ = adv.gigpo(
            torch.tensor(turn_rewards),
            torch.tensor(turn_traj),
            keys,
            torch.tensor(group_ids),
            gamma=gamma,
            omega=omega,
            normalize=normalize,
        )
        want = ref_gigpo(turn_rewards, turn_traj, keys, group_ids, gamma, omega, normalize)
        assert got.tolist() == pytest.approx(want, abs=1e-4)


def test_gigpo_does_not_merge_states_of_different_tasks():
    # Same state key in two different task groups: two singleton anchor groups.
    turn_rewards = torch.tensor([1.0, 0.0])
    _, stats = adv.gigpo(turn_rewards, torch.tensor([0, 1]), ["s", "s"], torch.tensor([0, 1]))
    assert stats["anchor_group_size"].tolist() == [1, 1]


def test_lcs_similarity_values():
    assert adv.lcs_similarity("abc", "abc") == 1.0
    assert adv.lcs_similarity("abc", "abd") == pytest.approx(4 / 6)
    assert adv.lcs_similarity("abcdef", "xaxbxc") == pytest.approx(6 / 12)
    assert adv.lcs_similarity("", "abc") == 0.0


def test_gigpo_similarity_grouping_merges_near_identical_states():
    keys = ["$ pytest: 3 failed in 0.41s", "$ pytest: 3 failed in 0.39s", "$ ls: utils.py tests/"]
    turn_rewards = torch.tensor([1.0, 0.0, 1.0])
    traj, groups = torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long)
    assert adv.lcs_similarity(keys[0], keys[1]) > 0.9
    _, exact = adv.gigpo(turn_rewards, traj, keys, groups)
    _, similar = adv.gigpo(turn_rewards, traj, keys, groups, similarity_threshold=0.9)
    assert exact["anchor_group_size"].tolist() == [1, 1, 1]
    assert similar["anchor_group_size"].tolist() == [2, 2, 1]
    assert similar["step_advantages"].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)


@pytest.mark.parametrize("value", [5.0, -0.1, float("nan"), "1", True])
def test_a_similarity_outside_zero_one_is_refused_naming_the_states(value):
    """A distance (0 for equal states, 5 apart) would put every state above any threshold: one anchor group."""
    groups = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"returned .* for 'at 3' and 'at 2'; it must be a number in \[0, 1\]"):
        adv.anchor_group_ids(["at 3", "at 2"], groups, 0.5, similarity=lambda a, b: value)


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def ref_gae(rewards, values, traj, gamma, lam, bootstrap, truncated):
    out = [0.0] * len(rewards)
    for i in sorted(set(traj)):
        ks = [k for k in range(len(traj)) if traj[k] == i]
        running = 0.0
        for pos in range(len(ks) - 1, -1, -1):
            k = ks[pos]
            if pos + 1 < len(ks):
                next_value = values[ks[pos + 1]]
            else:
                next_value = bootstrap[i] if (bootstrap is not None and truncated[i]) else 0.0
                running = 0.0
            running = rewards[k] + gamma * next_value - values[k] + gamma * lam * running
            out[k] = running
    return out


def test_gae_matches_python_loop_with_bootstrap():
    rng = random.Random(6)
    for _ in range(20):
        num_traj = rng.randint(1, 6)
        traj = [i for i in range(num_traj) for _ in range(rng.randint(1, 6))]
        rewards = [rng.choice([0.0, 0.0, 0.3, 1.0]) for _ in traj]
        values = [rng.uniform(-1, 1) for _ in traj]
        bootstrap = [rng.uniform(-1, 1) for _ in range(num_traj)]
        truncated = [rng.random() < 0.5 for _ in range(num_traj)]
        gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.0, 1.0)
        for boot in (bootstrap, None):
            got, returns = adv.gae(
                torch.tensor(rewards),
                torch.tensor(values),
                torch.tensor(traj),
                gamma,
                lam,
                bootstrap_values=None if boot is None else torch.tensor(boot),
                truncated=torch.tensor(truncated),
            )
            want = ref_gae(rewards, values, traj, gamma, lam, boot, truncated)
            assert got.tolist() == pytest.approx(want, abs=1e-5)
            assert returns.tolist() == pytest.approx(
                [a + v for a, v in zip(want, values, strict=True)], abs=1e-5
            )


def test_gae_with_lambda_one_gives_monte_carlo_returns():
    rewards, values = torch.tensor([0.0, 0.5, 1.0]), torch.tensor([0.3, -0.2, 0.9])
    _, returns = adv.gae(rewards, values, torch.zeros(3, dtype=torch.long), gamma=0.9, lam=1.0)
    assert returns.tolist() == pytest.approx([0.5 * 0.9 + 0.81, 0.5 + 0.9, 1.0], abs=1e-6)


def test_gae_truncation_bootstraps_only_truncated_trajectories():
    rewards, values = torch.tensor([0.0, 0.0]), torch.tensor([0.2, 0.4])
    traj = torch.tensor([0, 1])
    boot, truncated = torch.tensor([0.5, 0.5]), torch.tensor([True, False])
    a, _ = adv.gae(rewards, values, traj, 0.9, 0.95, bootstrap_values=boot, truncated=truncated)
    assert a.tolist() == pytest.approx([0.9 * 0.5 - 0.2, -0.4])
    with pytest.raises(ValueError, match="truncated"):
        adv.gae(rewards, values, traj, 0.9, 0.95, bootstrap_values=boot)


# ---------------------------------------------------------------------------------------------
# statistics, filtering, token expansion
# ---------------------------------------------------------------------------------------------


def test_group_reward_stats_counts_signal_free_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    stats = adv.group_reward_stats(rewards, group_ids)
    assert stats["groups/num"] == 4
    assert stats["groups/all_correct_frac"] == 0.25
    assert stats["groups/all_wrong_frac"] == 0.25
    assert stats["groups/num_zero_variance"] == 3
    assert stats["reward/mean"] == pytest.approx(0.6)
    assert stats["reward/std"] == pytest.approx(float(rewards.std(correction=0)))
    assert stats["reward/within_group_std"] == pytest.approx(math.sqrt(3) / 4 / 4)


def test_starpo_s_keeps_whole_groups_with_highest_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([7, 7, 7, 3, 3, 3, 5, 5, 5, 9, 9, 9])  # std: 0, 0.471, 0.471, 0.471
    keep = adv.starpo_s_keep(rewards, group_ids, keep_fraction=0.5)
    assert keep.tolist() == [False] * 3 + [True] * 6 + [False] * 3  # ties: first appearing groups
    assert adv.starpo_s_keep(rewards, group_ids, keep_fraction=1.0).all()
    with pytest.raises(ValueError, match="keep_fraction"):
        adv.starpo_s_keep(rewards, group_ids, keep_fraction=0.0)


def test_expand_to_tokens_gives_action_tokens_their_credit_only(spec_token_layout):
    mask, seq_ids, token_turn = spec_token_layout()
    per_traj = adv.grpo(SPEC_REWARDS, ONE_GROUP)
    tokens = adv.expand_to_tokens(per_traj, seq_ids, mask)
    assert tokens.shape == (7200,)
    assert torch.equal(tokens[mask == 0], torch.zeros(6400))  # 4 x (1800 - 200) non-action tokens
    assert torch.equal(tokens[:1800][mask[:1800] > 0], per_traj[0].expand(200))
    turn_adv, _ = adv.gigpo(spec_turn_rewards(), SPEC_TURN_TRAJ, SPEC_KEYS, ONE_GROUP)
    per_turn_tokens = adv.expand_to_tokens(turn_adv, token_turn, mask)
    assert round(per_turn_tokens[400 + 30 + 900].item(), 3) == 1.577  # first token of t1's edit a2
    assert round(per_turn_tokens[1800 + 400 + 30 + 900].item(), 3) == -2.732
    with pytest.raises(ValueError, match="index"):
        adv.expand_to_tokens(per_traj, torch.tensor([-1, 0]), torch.tensor([1.0, 1.0]))

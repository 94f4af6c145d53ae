"""Losses: aggregation denominators, PPO/decoupled PPO against a plain loop, masking, KL, value loss."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_agentrl.algorithms import losses

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def test_spec_vector_token_mean_denominator_is_800(spec_token_layout):
    mask, seq_ids, _ = spec_token_layout(num_traj=4)
    assert mask.numel() == 4 * 1800 and mask.sum() == 800
    values = torch.randn(mask.numel(), dtype=torch.float64, requires_grad=True)
    loss = losses.aggregate(values, mask, seq_ids, "token-mean")
    assert loss.item() == pytest.approx((values * mask).sum().item() / 800)
    loss.backward()
    assert torch.equal(values.grad[mask > 0], torch.full((800,), 1 / 800, dtype=torch.float64))
    assert torch.equal(values.grad[mask == 0], torch.zeros(6400, dtype=torch.float64))


def two_trajectories(short: int = 10, long: int = 30):
    """Trajectory 0 has `short` action tokens of value 1, trajectory 1 has `long` of value 0, plus
    some observation tokens (mask 0) in between."""
    mask = torch.tensor([0.0] * 5 + [1.0] * short + [0.0] * 7 + [1.0] * long)
    seq_ids = torch.tensor([0] * (5 + short) + [1] * (7 + long))
    values = torch.tensor([9.0] * 5 + [1.0] * short + [9.0] * 7 + [0.0] * long, requires_grad=True)
    return values, mask, seq_ids


@pytest.mark.parametrize(
    ("mode", "expected_loss", "short_to_long_token_weight"),
    [
        ("token-mean", 10 / 40, 1.0),  # every action token weighs 1/40: long trajectories dominate
        ("seq-mean-token-mean", (1.0 + 0.0) / 2, 3.0),  # each trajectory weighs 1/2: short tokens weigh 3x
        ("seq-mean-token-sum", (10.0 + 0.0) / 2, 1.0),  # per-token weight 1/2, scale grows with length
    ],
)
def test_aggregation_modes_weight_long_trajectories_as_documented(
    mode, expected_loss, short_to_long_token_weight
):
    values, mask, seq_ids = two_trajectories()
    loss = losses.aggregate(values, mask, seq_ids, mode)
    assert loss.item() == pytest.approx(expected_loss)
    loss.backward()
    short_grad, long_grad = values.grad[5], values.grad[-1]
    assert (short_grad / long_grad).item() == pytest.approx(short_to_long_token_weight)
    assert values.grad[mask == 0].abs().sum() == 0


@pytest.mark.parametrize("mode", MODES)
def test_empty_mask_gives_zero_loss_and_zero_gradient(mode):
    values = torch.randn(12, requires_grad=True)
    loss = losses.aggregate(values, torch.zeros(12), torch.zeros(12, dtype=torch.long), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(12))


def test_fully_masked_trajectory_does_not_dilute_sequence_means():
    values, mask, seq_ids = two_trajectories()
    # A third trajectory masked out entirely (e.g. compact filtering): same loss as without it.
    values3 = torch.cat([values.detach(), torch.full((6,), 5.0)])
    mask3 = torch.cat([mask, torch.zeros(6)])
    seq3 = torch.cat([seq_ids, torch.full((6,), 2)])
    for mode in MODES[1:]:
        assert losses.aggregate(values3, mask3, seq3, mode).item() == pytest.approx(
            losses.aggregate(values.detach(), mask, seq_ids, mode).item()
        )


@pytest.mark.parametrize("mode", MODES)
def test_global_denominators_make_micro_batches_sum_to_the_full_batch(mode):
    rng = torch.Generator().manual_seed(0)
    lengths = [13, 40, 7, 22]
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = (torch.rand(seq_ids.numel(), generator=rng) < 0.6).float()
    values = torch.randn(seq_ids.numel(), generator=rng)
    full = losses.aggregate(values, mask, seq_ids, mode)
    split = sum(lengths[:2])
    parts = [
        losses.aggregate(v, m, s, mode, num_seqs=4, num_tokens=float(mask.sum()))
        for v, m, s in (
            (values[:split], mask[:split], seq_ids[:split]),
            (values[split:], mask[split:], seq_ids[split:]),
        )
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------------------------


def ref_policy_loss(logp, behavior, adv, mask, clip_low, clip_high, dual_clip, proximal, is_weights, is_cap):
    """Token-mean PPO / decoupled PPO, one token at a time."""
    total, count = 0.0, 0
    for n in range(len(logp)):
        if mask[n] == 0:
            continue
        old = proximal[n] if proximal is not None else behavior[n]
        ratio = math.exp(logp[n] - old)
        loss = max(-adv[n] * ratio, -adv[n] * min(max(ratio, 1 - clip_low), 1 + clip_high))
        if dual_clip is not None and adv[n] < 0:
            loss = min(loss, -dual_clip * adv[n])
        weight = 1.0
        if proximal is not None:
            weight = math.exp(proximal[n] - behavior[n])
            if is_cap is not None:
                weight = min(weight, is_cap)
        if is_weights is not None:
            weight *= is_weights[n]
        total += weight * loss
        count += 1
    return total / max(count, 1)


def random_tokens(seed: int, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    logprobs = behavior + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    proximal = behavior + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) < 0.7).double()
    behavior = torch.where(mask > 0, behavior, torch.full_like(behavior, math.nan))  # as recorded
    seq_ids = torch.sort(torch.randint(0, 4, (n,), generator=g)).values
    is_weights = torch.rand(n, generator=g, dtype=torch.float64)
    return logprobs, behavior, proximal, advantages, mask, seq_ids, is_weights


@pytest.mark.parametrize("seed", range(6))
def test_policy_loss_matches_python_loop(seed):
    logprobs, behavior, proximal, advantages, mask, seq_ids, is_weights = random_tokens(seed)
    rng = random.Random(seed)
    decoupled = seed % 2 == 1
    options = {
        "clip_low": rng.choice([0.1, 0.2]),
        "clip_high": rng.choice([0.2, 0.28]),
        "dual_clip": rng.choice([None, 3.0, 1.5]),
        "proximal_logprobs": proximal if decoupled else None,
        "is_weights": is_weights if seed >= 3 else None,
        "is_cap": rng.choice([None, 1.1]) if decoupled else None,
    }
    loss, metrics = losses.policy_loss(logprobs, behavior, advantages, mask, seq_ids, **options)
    want = ref_policy_loss(
        logprobs.tolist(),
        behavior.tolist(),
        advantages.tolist(),
        mask.tolist(),
        options["clip_low"],
        options["clip_high"],
        options["dual_clip"],
        None if options["proximal_logprobs"] is None else proximal.tolist(),
        None if options["is_weights"] is None else is_weights.tolist(),
        options["is_cap"],
    )
    assert loss.item() == pytest.approx(want, abs=1e-10)
    assert metrics["loss/policy"].item() == pytest.approx(want, abs=1e-10)
    assert 0.0 <= metrics["policy/clipfrac"].item() <= 1.0


def test_decoupled_loss_equals_ppo_when_proximal_is_behavior_and_lag_is_zero():
    from lightning_agentrl.algorithms import staleness

    logprobs, behavior, _, advantages, mask, seq_ids, _ = random_tokens(7)
    version = torch.where(mask > 0, 5, -1)
    weights = staleness.staleness_weight(staleness.lag(version, current_version=5), "exp", decay=0.5).double()
    for agg in MODES:
        lp_ppo = logprobs.clone().requires_grad_(True)
        lp_dec = logprobs.clone().requires_grad_(True)
        ppo, _ = losses.policy_loss(lp_ppo, behavior, advantages, mask, seq_ids, agg=agg, dual_clip=3.0)
        decoupled, metrics = losses.policy_loss(
            lp_dec,
            behavior,
            advantages,
            mask,
            seq_ids,
            agg=agg,
            dual_clip=3.0,
            proximal_logprobs=torch.where(mask > 0, behavior, torch.zeros_like(behavior)),
            is_weights=weights,
            is_cap=2.0,
        )
        assert torch.equal(ppo, decoupled)
        ppo.backward()
        decoupled.backward()
        assert torch.equal(lp_ppo.grad, lp_dec.grad)
        assert (
            metrics["policy/is_weight_mean"].item() == 1.0 and metrics["policy/is_weight_max"].item() == 1.0
        )


def test_importance_weight_is_truncated_at_cap():
    mask, seq_ids = torch.ones(2), torch.zeros(2, dtype=torch.long)
    behavior = torch.log(torch.tensor([0.1, 0.5]))
    proximal = torch.log(torch.tensor([0.5, 0.5]))  # weight 5.0 and 1.0
    logprobs, advantages = proximal.clone(), torch.ones(2)
    _, truncated = losses.policy_loss(
        logprobs, behavior, advantages, mask, seq_ids, proximal_logprobs=proximal, is_cap=2.0
    )
    assert truncated["policy/is_weight_max"].item() == pytest.approx(2.0)
    assert truncated["loss/policy"].item() == pytest.approx(-(2.0 + 1.0) / 2)
    _, dropped = losses.policy_loss(
        logprobs,
        behavior,
        advantages,
        mask,
        seq_ids,
        proximal_logprobs=proximal,
        is_cap=2.0,
        is_cap_mode="mask",
    )
    assert dropped["loss/policy"].item() == pytest.approx(-1.0 / 2)
    assert dropped["policy/is_masked_frac"].item() == 0.5


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    mask, seq_ids = torch.ones(3), torch.zeros(3, dtype=torch.long)
    behavior = torch.zeros(3)
    logprobs = torch.log(torch.tensor([50.0, 50.0, 2.0])).requires_grad_(True)  # ratios 50, 50, 2
    advantages = torch.tensor([-1.0, 1.0, -1.0])
    plain, _ = losses.policy_loss(logprobs, behavior, advantages, mask, seq_ids)
    bounded, metrics = losses.policy_loss(logprobs, behavior, advantages, mask, seq_ids, dual_clip=3.0)
    # token 0: plain loss 50, bounded at c*|A| = 3; token 1 (A>0) clipped at -1.2; token 2: 2 < 3 unchanged.
    assert plain.item() == pytest.approx((50.0 - 1.2 + 2.0) / 3, rel=1e-5)
    assert bounded.item() == pytest.approx((3.0 - 1.2 + 2.0) / 3, rel=1e-5)
    assert metrics["policy/dual_clipfrac"].item() == pytest.approx(1 / 3)
    bounded.backward()
    assert logprobs.grad[:2].tolist() == [0.0, 0.0]  # bounded and clipped tokens push nothing
    assert logprobs.grad[2].item() == pytest.approx(2.0 / 3)  # d(-A r)/dlogp = r for A=-1, / 3 tokens


def test_masked_tokens_get_exactly_zero_gradient_even_with_nan_behavior():
    logprobs, behavior, proximal, advantages, mask, seq_ids, is_weights = random_tokens(8)
    garbage = logprobs.clone()
    garbage[mask == 0] = torch.tensor([math.inf, -math.inf, math.nan])[
        torch.arange(int((mask == 0).sum())) % 3
    ].double()
    for agg in MODES:
        for proximal_arg in (None, proximal):
            lp = garbage.clone().requires_grad_(True)
            loss, metrics = losses.policy_loss(
                lp,
                behavior,
                advantages,
                mask,
                seq_ids,
                agg=agg,
                proximal_logprobs=proximal_arg,
                is_weights=is_weights,
            )
            loss.backward()
            assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
            assert torch.equal(lp.grad[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=torch.float64))
            assert torch.isfinite(lp.grad).all() and lp.grad[mask > 0].abs().sum() > 0


def test_on_policy_gradient_is_reinforce():
    # At ratio 1 (first PPO epoch) nothing is clipped: grad of the loss wrt logp_n is -A_n / num_action_tokens.
    logprobs, behavior, _, advantages, mask, seq_ids, _ = random_tokens(9)
    behavior = torch.where(mask > 0, logprobs, behavior)
    lp = logprobs.clone().requires_grad_(True)
    loss, metrics = losses.policy_loss(lp, behavior, advantages, mask, seq_ids)
    loss.backward()
    assert torch.allclose(lp.grad, -advantages * mask / mask.sum())
    assert metrics["policy/clipfrac"].item() == 0.0 and metrics["policy/approx_kl"].item() == 0.0


def test_policy_loss_rejects_bad_options():
    args = (torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(*args, dual_clip=0.9)
    with pytest.raises(ValueError, match="clip_low"):
        losses.policy_loss(*args, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages"):
        losses.policy_loss(args[0], args[1], torch.zeros(3), *args[3:])
    with pytest.raises(ValueError, match="aggregation mode"):
        losses.policy_loss(*args, agg="sum")


# ---------------------------------------------------------------------------------------------
# KL, entropy, value
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_values_and_unbiasedness():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        losses.kl_penalty(logp, ref, "k2")
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    # Sampled from pi, k1 and k3 average to KL(pi || ref); k3 is never negative.
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
    exact = (p * (p / q).log()).sum().item()
    k3 = losses.kl_penalty(p.log()[samples], q.log()[samples], "k3")
    assert k3.min() >= 0
    assert k3.mean().item() == pytest.approx(exact, abs=5e-3)
    assert losses.kl_penalty(p.log()[samples], q.log()[samples], "k1").mean().item() == pytest.approx(
        exact, abs=5e-3
    )


def test_k3_is_capped_at_10_as_verl_and_openrlhf_cap_it():
    """verl's ``k3``/``low_var_kl`` and OpenRLHF's ``k3`` clamp the per-token value to 10: a token
    the policy has pushed far below the reference gets no KL gradient, rather than exp(-d) times it."""
    d = torch.tensor([0.5, -1.0, -2.0, -2.6, 10.9, -3.0, -8.0, -30.0, 11.5, 40.0])
    logp = torch.full_like(d, -1.0).requires_grad_(True)
    k3 = losses.kl_penalty(logp, logp.detach() - d, "k3")
    verl = (torch.exp(-d.clamp(-20, 20)) + d - 1).clamp(-10, 10)  # verl: ratio - kl - 1 with kl = ref - logp
    torch.testing.assert_close(k3, verl)
    k3.sum().backward()
    uncapped = 1 - torch.exp(-d)
    torch.testing.assert_close(logp.grad[:5], uncapped[:5])  # below the cap (k3(-2.6) = 9.86): the usual gradient
    assert logp.grad[5:].abs().max().item() == 0.0  # at the cap: none (k3(-3) = 17.1, k3(11.5) = 10.5 uncapped)


def test_entropy_bonus_rewards_higher_entropy():
    entropy = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    mask, seq_ids = torch.tensor([1.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.long)
    loss, metrics = losses.entropy_bonus(entropy, mask, seq_ids, coef=0.01)
    assert loss.item() == pytest.approx(-0.015) and metrics["policy/entropy"].item() == pytest.approx(1.5)
    loss.backward()
    assert entropy.grad.tolist() == pytest.approx([-0.005, -0.005, 0.0])


def test_value_loss_clipping_is_pessimistic():
    old = torch.tensor([0.0, 0.0, 0.0])
    returns = torch.tensor([1.0, 1.0, -1.0])
    values = torch.tensor([0.5, -0.5, 0.1], requires_grad=True)
    loss, metrics = losses.value_loss(values, old, returns, None, clip=0.2)
    # clipped values 0.2, -0.2, 0.1 -> per item max((v-R)^2, (vc-R)^2) = 0.64, 2.25, 1.21
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 1.21) / 3)
    assert metrics["value/clipfrac"].item() == pytest.approx(2 / 3)  # |V - V_old| > 0.2 for items 0 and 1
    loss.backward()
    # item 0 moved past the clip toward the target: its (clipped) term has no gradient
    assert values.grad.tolist() == pytest.approx([0.0, (-0.5 - 1.0) / 3, (0.1 + 1.0) / 3])
    unclipped, _ = losses.value_loss(values, old, returns, torch.tensor([1.0, 1.0, 0.0]), clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 2.25) / 2)


def test_value_clipfrac_counts_only_values_past_the_clip():
    """Values inside the clip are never counted, even where V_old + (V - V_old) rounds away from V."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=generator) * 3
    old = values + (torch.rand(10_000, generator=generator) - 0.5) * 0.3  # |V - V_old| <= 0.15 < clip
    returns = torch.randn(10_000, generator=generator) * 3
    rounded = old + (values - old).clamp(-0.2, 0.2)
    assert ((rounded - returns) ** 2 > (values - returns) ** 2).any()  # the rounding the old rule tripped on
    _, metrics = losses.value_loss(values, old, returns, None, clip=0.2)
    assert metrics["value/clipfrac"].item() == 0.0
    _, metrics = losses.value_loss(old + 0.3, old, returns, None, clip=0.2)
    assert metrics["value/clipfrac"].item() == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_python_loop_on_ragged_batches(mode):
    rng = random.Random(11)
    for _ in range(20):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
        seq_ids = [i for i, n in enumerate(lengths) for _ in range(n)]
        mask = [float(rng.random() < 0.5) for _ in seq_ids]
        values = [rng.uniform(-2, 2) for _ in seq_ids]
        per_seq: dict[int, list[float]] = {}
        for v, m, s in zip(values, mask, seq_ids, strict=True):
            if m:
                per_seq.setdefault(s, []).append(v)
        if mode == "token-mean":
            want = sum(sum(vs) for vs in per_seq.values()) / max(sum(mask), 1)
        elif mode == "seq-mean-token-mean":
            want = sum(sum(vs) / len(vs) for vs in per_seq.values()) / max(len(per_seq), 1)
        else:
            want = sum(sum(vs) for vs in per_seq.values()) / max(len(per_seq), 1)
        got = losses.aggregate(
            torch.tensor(values, dtype=torch.float64), torch.tensor(mask), torch.tensor(seq_ids), mode
        )
        assert got.item() == pytest.approx(want, abs=1e-9)

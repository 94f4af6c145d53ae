"""Sequence-level importance weights (TIS and MIS) against an independent re-implementation of verl's
rollout correction on padded [B, T] tensors (verl/trainer/ppo/rollout_corr_helper.py: ``rollout_is`` for
truncation, ``rollout_rs`` for masking), on random ragged batches: weights, and the policy loss's gradient."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_agentrl.algorithms.importance import importance_metrics, importance_weights
from lightning_agentrl.algorithms.losses import policy_loss

BOUND = 20.0


def verl_weights(old, rollout, response_mask, *, level, mode, upper, lower):
    """verl's formulas on padded tensors: log ratio, summed (sequence) or averaged (geometric) over the
    response mask, clamped to +-20, exp; truncation caps at ``upper`` (rollout_is), masking keeps
    ``lower <= w <= upper`` and zeroes the rest (rollout_rs, with the IS weight kept where accepted)."""
    log_ratio = torch.where(response_mask > 0, old - rollout, torch.zeros_like(old))
    if level == "token":
        per = log_ratio
    else:
        total = (log_ratio * response_mask).sum(-1, keepdim=True)
        if level == "geometric":
            total = total / response_mask.sum(-1, keepdim=True).clamp(min=1)
        per = total.expand_as(log_ratio)
    w = torch.exp(per.clamp(-BOUND, BOUND)) * response_mask
    if mode == "truncate":
        return w.clamp(max=upper).detach(), torch.zeros_like(w, dtype=torch.bool)
    accepted = (w >= lower) & (w <= upper)
    dropped = (response_mask > 0) & ~accepted
    return torch.where(accepted, w, torch.zeros_like(w)).detach(), dropped


def ragged_batch(seed: int, num_seqs: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 14, (num_seqs,), generator=gen).tolist()
    width = max(lengths)
    padded_mask = torch.zeros(num_seqs, width, dtype=torch.float64)
    for b, n in enumerate(lengths):
        padded_mask[b, :n] = (torch.rand(n, generator=gen) > 0.25).double()  # observations inside the episode
        padded_mask[b, 0] = 1.0
    old = -torch.rand(num_seqs, width, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(num_seqs, width, generator=gen, dtype=torch.float64) * 0.3
    current = old + torch.randn(num_seqs, width, generator=gen, dtype=torch.float64) * 0.1
    advantages = torch.randn(num_seqs, 1, generator=gen, dtype=torch.float64).expand(num_seqs, width).clone()
    valid = torch.zeros(num_seqs, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, :n] = True
    seq_ids = torch.arange(num_seqs).unsqueeze(1).expand(num_seqs, width)[valid]
    packed = {name: t[valid] for name, t in dict(old=old, rollout=rollout, current=current, adv=advantages,
                                                    mask=padded_mask).items()}
    packed["rollout"] = torch.where(packed["mask"] > 0, packed["rollout"], torch.full_like(packed["rollout"], math.nan))
    padded = dict(old=old, rollout=rollout, current=current, adv=advantages, mask=padded_mask)
    return packed, padded, seq_ids, valid


CASES = [(level, mode) for level in ("token", "sequence", "geometric") for mode in ("truncate", "mask")]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("level", "mode"), CASES)
def test_weights_equal_verls_rollout_correction_on_ragged_batches(seed, level, mode):
    packed, padded, seq_ids, valid = ragged_batch(seed)
    upper, lower = 1.6, 0.7
    ours = importance_weights(packed["old"], packed["rollout"], packed["mask"], seq_ids, level=level, mode=mode,
                              cap=upper, lower=lower if mode == "mask" else None)
    ref_w, ref_dropped = verl_weights(padded["old"], padded["rollout"], padded["mask"], level=level, mode=mode,
                                      upper=upper, lower=lower)
    torch.testing.assert_close(ours.weights, ref_w[valid], rtol=0, atol=1e-6)
    assert torch.equal(ours.dropped, ref_dropped[valid])
    if mode == "mask" and level != "token":  # a masked sequence is dropped whole
        for b in seq_ids.unique():
            trained = (seq_ids == b) & (packed["mask"] > 0)
            assert ours.dropped[trained].all() or not ours.dropped[trained].any()


@pytest.mark.parametrize(("level", "mode"), CASES)
def test_policy_loss_gradient_equals_the_padded_reference(level, mode):
    """The PPO loss weighted by the correction, token-mean over the original mask (a dropped unit's tokens
    stay in the denominator), against the padded reference: values and gradients to 1e-6."""
    packed, padded, seq_ids, valid = ragged_batch(11, num_seqs=8)
    upper, lower, clip = 1.6, 0.7, 0.2
    current = packed["current"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        current, packed["rollout"], packed["adv"], packed["mask"], seq_ids, proximal_logprobs=packed["old"],
        is_cap=upper, is_cap_mode=mode, is_level=level, is_lower=lower if mode == "mask" else None,
        clip_low=clip, clip_high=clip,
    )
    loss.backward()

    ref_current = padded["current"].clone().requires_grad_(True)
    w, _ = verl_weights(padded["old"], padded["rollout"], padded["mask"], level=level, mode=mode, upper=upper,
                        lower=lower)
    ratio = torch.exp(ref_current - padded["old"])
    a = padded["adv"]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
    ref_loss = (pg * w * padded["mask"]).sum() / padded["mask"].sum()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(current.grad, ref_current.grad[valid], rtol=0, atol=1e-6)


def test_token_truncation_is_todays_decoupled_weight_bit_for_bit():
    """The default (token, truncate) is the decoupled-PPO weight exp(prox - behavior) capped, as before."""
    packed, _, seq_ids, _ = ragged_batch(3)
    ours = importance_weights(packed["old"], packed["rollout"], packed["mask"], seq_ids, cap=1.3)
    expected = torch.exp((packed["old"] - packed["rollout"]).clamp(-BOUND, BOUND)).clamp(max=1.3)
    trained = packed["mask"] > 0
    assert torch.equal(ours.weights[trained], expected[trained])
    assert torch.equal(ours.weights[~trained], torch.zeros_like(ours.weights[~trained]))


def test_a_long_sequence_of_small_ratios_is_dropped_whole_by_the_product_but_kept_by_the_geometric_mean():
    """Forty tokens each 1.05x more likely under pi_prox: the product is 1.05^40 = 7.04 (over a 2.0 cap,
    dropped); the geometric mean is 1.05 (kept). Per token, each 1.05 is kept."""
    n = 40
    prox, behavior = torch.zeros(n), torch.full((n,), -math.log(1.05))
    mask, seq_ids = torch.ones(n), torch.zeros(n, dtype=torch.long)
    seq = importance_weights(prox, behavior, mask, seq_ids, level="sequence", mode="mask", cap=2.0, lower=0.5)
    geo = importance_weights(prox, behavior, mask, seq_ids, level="geometric", mode="mask", cap=2.0, lower=0.5)
    assert seq.dropped.all() and float(seq.weights.sum()) == 0.0
    assert math.isclose(float(seq.unit_weights[0]), 1.05**n, rel_tol=1e-5)
    assert not geo.dropped.any() and torch.allclose(geo.weights, torch.full((n,), 1.05))
    trunc = importance_weights(prox, behavior, mask, seq_ids, level="sequence", cap=2.0)
    assert torch.allclose(trunc.weights, torch.full((n,), 2.0))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mode_none_applies_weight_one_to_trained_tokens_and_still_measures_the_units(level):
    prox, behavior = torch.tensor([0.0, 1.0, -1.0, 0.5]), torch.zeros(4)
    mask, seq_ids = torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    out = importance_weights(prox, behavior, mask, seq_ids, level=level, mode="none", cap=None)
    measured = importance_weights(prox, behavior, mask, seq_ids, level=level, cap=None)
    assert torch.equal(out.weights, mask) and not out.dropped.any() and not out.unit_dropped.any()
    assert torch.equal(out.unit_weights, measured.unit_weights)  # the truncate path without a cap: untouched
    assert not torch.equal(out.unit_weights, torch.ones_like(out.unit_weights))


def test_metrics_count_units_quantiles_and_effective_sample_size():
    # three sequences with weights e^0, e^1, e^-1; one untrained sequence (no unit)
    prox = torch.tensor([0.0, 1.0, -1.0, 0.0])
    behavior = torch.zeros(4)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    out = importance_weights(prox, behavior, mask, torch.tensor([0, 1, 2, 3]), level="sequence", mode="mask",
                             cap=2.0, lower=0.5)
    metrics = importance_metrics(out, cap=2.0)
    assert metrics["importance/num_units"] == 3.0
    assert math.isclose(metrics["importance/dropped_frac"], 2 / 3)  # e and 1/e are outside [0.5, 2]
    assert math.isclose(metrics["importance/weight_max"], math.e, rel_tol=1e-6)
    assert math.isclose(metrics["importance/weight_p50"], 1.0)
    assert metrics["importance/truncated_frac"] == 0.0
    assert math.isclose(metrics["importance/ess"], 1 / 3)  # one unit of weight 1 carries everything
    even = importance_metrics(importance_weights(torch.zeros(3), torch.zeros(3), torch.ones(3),
                                                 torch.arange(3), level="sequence", cap=2.0), cap=2.0)
    assert even["importance/ess"] == 1.0 and even["importance/dropped_frac"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(level="episode"), "level must be one of"),
        (dict(mode="reject"), "mode must be one of"),
        (dict(mode="mask", cap=None), "needs an upper bound"),
        (dict(mode="truncate", cap=2.0, lower=0.5), "applies to mode='mask' only"),
        (dict(mode="mask", cap=2.0, lower=3.0), "must be in"),
    ],
)
def test_inconsistent_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        importance_weights(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long), **kwargs)

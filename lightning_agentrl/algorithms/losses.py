"""Policy, KL, entropy and value losses on a packed token stream.

Shapes:

    N  packed tokens of the whole batch (all trajectories, concatenated)
    B  trajectories; ``seq_ids[N]`` gives each token's trajectory index in [0, B)
    K  turns (value losses are usually per turn boundary)

``mask[N]`` is 1.0 on model-generated action tokens and 0.0 elsewhere (prompt, tool output,
template scaffolding, padding). Masked tokens never contribute a value or a gradient: every loss
here replaces them by 0 *before* arithmetic, so a NaN behavior logprob (recorded as NaN where
mask=0) cannot leak into the loss or its gradient.

Every loss returns ``(loss, metrics)``; metrics are detached scalar tensors with namespaced keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_agentrl.algorithms.importance import importance_weights

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

# exp() of a log-ratio beyond this is an overflow, not information (verl clamps the same way).
_MAX_LOG_RATIO = 20.0
# k3 per token is capped here, as verl's "k3"/"low_var_kl" and OpenRLHF's "k3" do: past it the token
# gets no KL gradient, where exp(-d) would otherwise give it up to e^20 times a usual token's.
_MAX_K3 = 10.0


def _check_token_tensors(mask: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 1:
        raise ValueError(f"mask must be 1-D over the packed tokens, got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(mask.shape)} like mask"
            )


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """values where mask=1, exactly 0.0 elsewhere (also where values is NaN/inf)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def aggregate(
    values: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    mode: AggMode = "token-mean",
    num_seqs: int | None = None,
    *,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce per-token losses to a scalar (DAPO, https://arxiv.org/abs/2503.14476, §3.3).

    - ``token-mean``: ``sum_n m_n v_n / sum_n m_n``. Every action token weighs the same, so a
      trajectory weighs in proportion to its number of action tokens: a 2,000-token trajectory
      counts 10x a 200-token one. (SPEC: 4 trajectories x 200 action tokens -> denominator 800.)
    - ``seq-mean-token-mean``: ``(1/S) sum_s [sum_{n in s} m_n v_n / sum_{n in s} m_n]``. Every
      trajectory weighs the same; a token of a long trajectory weighs less than one of a short one.
    - ``seq-mean-token-sum``: ``(1/S) sum_s sum_{n in s} m_n v_n``. Every token weighs the same
      within the batch but the scale grows with length (Dr.GRPO's "no length normalization").

    ``S`` counts trajectories with at least one action token (a trajectory masked out entirely, e.g.
    by compact filtering, does not dilute the others). For gradient accumulation or data parallelism
    pass the global denominators: ``num_seqs`` (S) and ``num_tokens`` (sum of the mask over every
    micro-batch/rank), so that the accumulated gradient equals the full-batch one.

    An all-zero mask gives a loss of exactly 0 whose gradient is defined (all zeros), never NaN.

    Shapes: values[N], mask[N] float 0/1, seq_ids[N] int64 -> scalar.
    """
    _check_token_tensors(mask, values=values, seq_ids=seq_ids)
    masked_values = _masked(values, mask)
    m = (mask > 0).to(masked_values.dtype)
    if mode == "token-mean":
        denominator = (
            m.sum()
            if num_tokens is None
            else torch.as_tensor(float(num_tokens), dtype=m.dtype, device=m.device)
        )
        return masked_values.sum() / denominator.clamp(min=1.0)
    if mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(
            f"aggregation mode must be 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum', got {mode!r}"
        )
    if (seq_ids[mask > 0] < 0).any():
        raise ValueError("seq_ids must be >= 0 on action tokens (mask=1)")
    ids = seq_ids.clamp(min=0)  # padding may carry -1; its mask is 0 so it adds nothing
    num_segments = int(ids.max()) + 1 if ids.numel() else 0
    seq_sum = masked_values.new_zeros(num_segments).index_add(0, ids, masked_values)
    seq_count = m.new_zeros(num_segments).index_add(0, ids, m)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_count.clamp(min=1.0)
    else:
        per_seq = seq_sum
    num_active = (
        (seq_count > 0).sum().to(per_seq.dtype) if num_seqs is None else per_seq.new_tensor(float(num_seqs))
    )
    return per_seq.sum() / num_active.clamp(min=1.0)


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Detached masked mean for metrics."""
    values = _masked(values.detach(), mask)
    return values.sum() / (mask > 0).sum().clamp(min=1)


def _check_clip_arguments(
    clip_low: float, clip_high: float, dual_clip: float | None, is_cap: float | None, is_cap_mode: str
) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(
            f"dual_clip must be > 1 (it bounds the loss of negative advantages at -c*A), got {dual_clip}"
        )
    if is_cap is not None and is_cap <= 0.0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    if is_cap_mode not in ("truncate", "mask", "none"):
        raise ValueError(f"is_cap_mode must be 'truncate', 'mask' or 'none', got {is_cap_mode!r}")
    if is_cap_mode == "mask" and is_cap is None:
        raise ValueError("is_cap_mode='mask' needs is_cap (the upper bound)")


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: AggMode = "token-mean",
    proximal_logprobs: Tensor | None = None,
    is_weights: Tensor | None = None,
    is_cap: float | None = None,
    is_cap_mode: Literal["truncate", "mask", "none"] = "truncate",
    is_level: Literal["token", "sequence", "geometric"] = "token",
    is_lower: float | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy loss with clip-higher, dual clip and decoupled (off-policy) correction.

    PPO (https://arxiv.org/abs/1707.06347), per action token, with ``r = pi / pi_old``:

        ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``

    - ``clip_high > clip_low`` is DAPO's clip-higher (https://arxiv.org/abs/2503.14476).
    - ``dual_clip = c > 1`` (https://arxiv.org/abs/1912.09729): for ``A < 0``, ``l = min(l, -c A)``,
      so a huge ratio on a bad token cannot blow the loss up.
    - Decoupled PPO (AReaL, https://arxiv.org/abs/2505.24298): with ``proximal_logprobs`` the clip is
      taken around the proximal policy, ``r = pi / pi_prox``, and the token is weighted by the
      importance weight ``w = pi_prox / pi_behavior`` (detached), truncated at ``is_cap``
      (``is_cap_mode="mask"`` instead drops tokens above the cap, as AReaL's code does, or outside
      ``[is_lower, is_cap]``; ``"none"`` measures the weight but applies 1). ``is_level`` takes the weight per token, per sequence (the product of the
      sequence's token ratios) or as their geometric mean: :func:`importance.importance_weights`. Without
      ``proximal_logprobs``, ``pi_old = pi_behavior`` and ``w = 1``: plain PPO. With
      ``proximal == behavior`` the weight is exactly 1 and the loss equals plain PPO bit for bit.
    - ``is_weights`` (per token, e.g. staleness weights) multiply into ``w``.

    The per-token ``w * l`` is reduced by ``aggregate(mode=agg)``.

    Shapes: logprobs[N] (with grad), behavior_logprobs[N] (NaN allowed where mask=0), advantages[N],
    mask[N] float 0/1, seq_ids[N] int64, proximal_logprobs[N], is_weights[N] -> (scalar loss, metrics).
    Metrics: ``loss/policy``, ``policy/clipfrac``, ``policy/clipfrac_low``, ``policy/clipfrac_high``,
    ``policy/dual_clipfrac``, ``policy/approx_kl`` (k3 of pi_old vs pi), ``policy/ratio_mean``,
    ``policy/ratio_max``, ``policy/is_weight_mean``, ``policy/is_weight_max``,
    ``policy/is_masked_frac``; all token-means over action tokens.
    """
    _check_token_tensors(
        mask, logprobs=logprobs, behavior_logprobs=behavior_logprobs, advantages=advantages, seq_ids=seq_ids
    )
    _check_clip_arguments(clip_low, clip_high, dual_clip, is_cap, is_cap_mode)
    active = mask > 0
    behavior = _masked(behavior_logprobs.detach(), mask)
    old = behavior
    if proximal_logprobs is not None:
        _check_token_tensors(mask, proximal_logprobs=proximal_logprobs)
        old = _masked(proximal_logprobs.detach(), mask)
    advantages = _masked(advantages.detach(), mask)

    log_ratio = _masked(logprobs, mask) - old  # masked tokens: 0 - 0, so the ratio there is 1
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(active)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)

    weight = torch.ones_like(ratio.detach())
    is_masked = torch.zeros_like(active)
    if proximal_logprobs is not None:
        corrected = importance_weights(old, behavior, mask, seq_ids, level=is_level, mode=is_cap_mode, cap=is_cap,
                                       lower=is_lower)
        weight, is_masked = corrected.weights, corrected.dropped
    if is_weights is not None:
        _check_token_tensors(mask, is_weights=is_weights)
        weight = weight * _masked(is_weights.detach(), mask)
    # Only multiply when something can differ from 1: keeps the default path identical to plain PPO.
    if proximal_logprobs is not None or is_weights is not None:
        per_token = per_token * weight

    loss = aggregate(per_token, mask, seq_ids, agg, num_seqs, num_tokens=num_tokens)

    metrics = _policy_metrics(loss, mask, advantages, ratio, log_ratio, weight, dual_clipped, is_masked,
                              clip_low=clip_low, clip_high=clip_high)
    return loss, metrics


@torch.no_grad()
def _policy_metrics(
    loss: Tensor, mask: Tensor, advantages: Tensor, ratio: Tensor, log_ratio: Tensor, weight: Tensor,
    dual_clipped: Tensor, is_masked: Tensor, *, clip_low: float, clip_high: float,
) -> dict[str, Tensor]:
    """The detached diagnostics of :func:`policy_loss` (token-means over action tokens, and maxima)."""
    active = mask > 0
    clipped_low = active & (advantages < 0) & (ratio < 1.0 - clip_low)
    clipped_high = active & (advantages > 0) & (ratio > 1.0 + clip_high)
    fmask = active.to(ratio.dtype)
    metrics = {
        "loss/policy": loss.detach(),
        "policy/clipfrac": _token_mean((clipped_low | clipped_high).to(ratio.dtype), mask),
        "policy/clipfrac_low": _token_mean(clipped_low.to(ratio.dtype), mask),
        "policy/clipfrac_high": _token_mean(clipped_high.to(ratio.dtype), mask),
        "policy/dual_clipfrac": _token_mean((dual_clipped & active).to(ratio.dtype), mask),
        # k3 estimator of KL(pi_old || pi), http://joschu.net/blog/kl-approx.html
        "policy/approx_kl": _token_mean(ratio - 1.0 - log_ratio, mask),
        "policy/ratio_mean": _token_mean(ratio, mask),
        "policy/ratio_max": (ratio * fmask).max() if active.any() else ratio.new_zeros(()),
        "policy/is_weight_mean": _token_mean(weight, mask),
        "policy/is_weight_max": (weight * fmask).max() if active.any() else weight.new_zeros(()),
        "policy/is_masked_frac": _token_mean(is_masked.to(ratio.dtype), mask),
    }
    return metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html).

    With ``d = log pi - log pi_ref``:
    - ``k1 = d``: unbiased, high variance, can be negative per token.
    - ``k3 = min(exp(-d) - 1 + d, 10)``: unbiased below the cap and always >= 0 (GRPO's choice,
      https://arxiv.org/abs/2402.03300). ``d`` is clamped to +-20 inside the exponential to avoid
      overflow. The cap is verl's and OpenRLHF's: its gradient ``1 - exp(-d)`` grows exponentially as
      the policy falls below the reference on a sampled token (with off-policy samples, one such token
      can outweigh a whole batch), and a capped token gets none. It binds below ``d`` of about -2.6
      (``pi / pi_ref`` under 1/13) and, as in verl, above ``d`` of about 11 (``pi`` over e^11 times
      ``pi_ref``), where the uncapped gradient was about 1.

    Mask and aggregate the result with ``aggregate``. Shapes: logprobs[N], ref_logprobs[N] -> Tensor[N].
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
        )
    diff = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return diff
    if kind == "k3":
        diff = diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(-diff) - 1.0 + diff).clamp(max=_MAX_K3)
    raise ValueError(f"kind must be 'k1' or 'k3', got {kind!r}")


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    coef: float,
    agg: AggMode = "token-mean",
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Entropy regularizer: ``loss = -coef * aggregate(H)``; add it to the policy loss.

    A positive ``coef`` rewards a flatter policy. ``num_seqs``/``num_tokens``: the global
    denominators, as in :func:`aggregate`. Shapes: entropy[N], mask[N], seq_ids[N] -> scalar.
    Metrics: ``policy/entropy`` (aggregated the same way, before ``coef``), ``loss/entropy``.
    """
    mean_entropy = aggregate(entropy, mask, seq_ids, agg, num_seqs, num_tokens=num_tokens)
    loss = -coef * mean_entropy
    return loss, {"policy/entropy": mean_entropy.detach(), "loss/entropy": loss.detach()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2 / cleanrl, https://arxiv.org/abs/2005.12729 discusses its effect).

    ``V_clip = V_old + clip(V - V_old, -clip, +clip)``,
    ``loss = 0.5 * mean_m max((V - R)^2, (V_clip - R)^2)``; ``clip=None`` gives ``0.5 * mean (V - R)^2``.

    Shapes: values[K] (with grad), old_values[K], returns[K], mask[K] float 0/1 or None -> (scalar,
    metrics ``loss/value``, ``value/clipfrac`` (share of items with ``|V - V_old| > clip``), ``value/mean``,
    ``value/returns_mean``).
    """
    if values.shape != old_values.shape or values.shape != returns.shape:
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)} and returns "
            f"{tuple(returns.shape)} must have the same shape"
        )
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    if mask is None:
        mask = torch.ones_like(values.detach())
    returns = _masked(returns.detach(), mask)
    old_values = _masked(old_values.detach(), mask)
    values = _masked(values, mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_item = unclipped
        clipped_frac = values.new_zeros(())
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (values_clipped - returns) ** 2
        per_item = torch.maximum(unclipped, clipped)
        # where the clip binds: |V - V_old| > clip (comparing the two squared errors instead flags
        # unclipped items whose V_old + (V - V_old) differs from V by one rounding)
        clipped_frac = _token_mean(((values - old_values).abs() > clip).to(values.dtype), mask)
    m = (mask > 0).to(values.dtype)
    loss = 0.5 * (per_item * m).sum() / m.sum().clamp(min=1.0)
    metrics = {
        "loss/value": loss.detach(),
        "value/clipfrac": clipped_frac.detach(),
        "value/mean": _token_mean(values, mask),
        "value/returns_mean": _token_mean(returns, mask),
    }
    return loss, metrics


@dataclass(frozen=True)
class MicroBatchLoss:
    """The training loss of one micro-batch of packed tokens, as the algorithm settings define it::

        loss = value_coef * L_value + L_policy - entropy_coef * agg(H) + kl_coef * agg(KL(pi || pi_ref))

    ``L_policy`` is :func:`policy_loss` (PPO clip, decoupled off-policy correction); every term is
    reduced with the same ``aggregation`` and the *mini-batch's* global denominators (``num_seqs``,
    ``num_tokens``), so that the gradients of the micro-batches add up to the mini-batch's. The
    forward passes (policy, critic, reference) happen outside: this unit only does the arithmetic.

    Shapes: logprobs[N] (with grad), behavior_logprobs[N], advantages[N], mask[N], seq_ids[N],
    proximal_logprobs[N], is_weights[N], entropy[N], ref_logprobs[N]; value_loss scalar.
    Returns ``(loss, metrics)``: the policy metrics of :func:`policy_loss` plus ``loss/total`` and,
    with a reference, ``loss/kl`` (before ``kl_coef``).

    Example:
        >>> n = torch.tensor([0.0, -1.0, -1.0])
        >>> loss, metrics = MicroBatchLoss()(n, n, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0]),
        ...                                  torch.zeros(3, dtype=torch.long), num_seqs=1, num_tokens=2.0)
        >>> float(loss), sorted(metrics)[:2]
        (-1.0, ['loss/policy', 'loss/total'])
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: AggMode = "token-mean"
    importance_cap: float | None = None
    importance_mode: Literal["truncate", "mask", "none"] = "truncate"
    importance_level: Literal["token", "sequence", "geometric"] = "token"
    importance_floor: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    value_coef: float = 0.5

    @classmethod
    def from_settings(cls, algorithm) -> MicroBatchLoss:
        """From an ``AlgorithmSettings`` section."""
        return cls(**{name: getattr(algorithm, name) for name in cls.__dataclass_fields__})

    def __call__(
        self,
        logprobs: Tensor,
        behavior_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        seq_ids: Tensor,
        *,
        num_seqs: int,
        num_tokens: float,
        proximal_logprobs: Tensor | None = None,
        is_weights: Tensor | None = None,
        entropy: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        value_loss: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        # Terms are added in this order on purpose: reordering them changes the last bit of the loss.
        loss = torch.zeros((), device=logprobs.device)
        if value_loss is not None:
            loss = loss + self.value_coef * value_loss
        policy, metrics = policy_loss(
            logprobs, behavior_logprobs, advantages, mask, seq_ids,
            clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip, agg=self.aggregation,
            proximal_logprobs=proximal_logprobs, is_weights=is_weights, is_cap=self.importance_cap,
            is_cap_mode=self.importance_mode, is_level=self.importance_level, is_lower=self.importance_floor,
            num_seqs=num_seqs, num_tokens=num_tokens,
        )
        loss = loss + policy
        if self.entropy_coef > 0 and entropy is not None:
            bonus, _ = entropy_bonus(entropy, mask, seq_ids, coef=self.entropy_coef, agg=self.aggregation,
                                     num_seqs=num_seqs, num_tokens=num_tokens)
            loss = loss + bonus
        if ref_logprobs is not None:
            kl = aggregate(kl_penalty(logprobs, ref_logprobs, kind=self.kl_estimator), mask, seq_ids,
                           self.aggregation, num_seqs, num_tokens=num_tokens)
            loss = loss + self.kl_coef * kl
            metrics["loss/kl"] = kl.detach()
        metrics["loss/total"] = loss.detach()
        return loss, metrics

"""Importance weights between the behavior policy and the proximal policy, per token or per sequence.

Shapes:

    N  packed tokens of the batch; ``mask[N]`` is 1.0 on trained (action) tokens
    B  sequences; ``seq_ids[N]`` gives each token's sequence in [0, B)
    U  units of the chosen level: N tokens (``token``) or B sequences (``sequence``, ``geometric``)

The engine samples from the behavior policy ``mu`` (its log-probs are recorded with each token); the
trainer's proximal policy ``pi_prox`` (the weights the step starts from, scored by the trainer) is what
the PPO ratio is taken around. The two differ because the engine lags behind (asynchronous rollouts,
``trainer.sync_weights_every``) and because the engine is not the trainer (another precision, kernel
or sampler: the *training-inference mismatch*, Liu, Li et al. 2025, "When Speed Kills Stability",
https://richardli.xyz/rl-collapse). With ``delta_n = log pi_prox(y_n) - log mu(y_n)`` on trained tokens:

- ``token``:     ``w_n = exp(delta_n)``; one weight per token (biased, low variance).
- ``sequence``:  ``W_b = exp(sum_{n in b} delta_n)``, the product of the token ratios, every token of
  ``b`` weighted by it (the unbiased estimator of the sequence's likelihood ratio; its variance grows
  with length).
- ``geometric``: ``W_b = exp(mean_{n in b} delta_n)``, the geometric mean of the token ratios: a
  per-token scale, so a length-independent test of how far a sequence is from the engine.

Each is then either **truncated** (TIS, Ionides 2008 / Yao et al. 2025: ``min(w, C)``) or **masked**
(MIS: a unit with ``w`` outside ``[lower, upper]`` gets weight 0 and is counted; at the sequence levels
every token of the sequence is dropped), or **not applied** (``none``: every trained token's weight is 1, the
weights are only measured: the uncorrected baseline). These are verl's rollout correction (``rollout_is`` truncates,
``rollout_rs`` masks): the log-ratio is clamped to ``[-20, 20]`` before ``exp`` and the weights are
detached, as there.

Why the sequence is the episode: an agent's reward is earned by the whole episode (every turn and every
summarized segment), and the episode is what the behavior policy sampled as one draw; observations
between turns are the environment's, identical under both policies, so they carry no ratio. The
product over all trained tokens of the episode is the likelihood ratio of the action sequence that
earned the reward. A per-turn unit would treat turns as independent draws, which they are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from lightning_agentrl.settings import ImportanceLevel, ImportanceMode

# exp() of a log-ratio beyond this is an overflow, not information (verl's SAFETY_BOUND).
MAX_LOG_WEIGHT = 20.0
IMPORTANCE_LEVELS: tuple[str, ...] = get_args(ImportanceLevel)
IMPORTANCE_MODES: tuple[str, ...] = get_args(ImportanceMode)


@dataclass(frozen=True)
class ImportanceWeights:
    """The result of :func:`importance_weights`.

    ``weights[N]``: what multiplies each token's loss (0 where the token is dropped or untrained);
    ``dropped[N]`` bool: trained tokens that masking removed; ``unit_weights[U]``: each trained unit's
    weight after the safety clamp, before truncation or masking (for metrics); ``unit_dropped[U]``.
    """

    weights: Tensor
    dropped: Tensor
    unit_weights: Tensor
    unit_dropped: Tensor


def check_importance(level: str, mode: str, cap: float | None, lower: float | None) -> None:
    """A ``ValueError`` naming the argument for a combination that cannot be computed."""
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"level must be one of {', '.join(map(repr, IMPORTANCE_LEVELS))}, got {level!r}")
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, IMPORTANCE_MODES))}, got {mode!r}")
    if cap is not None and cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode == "mask" and cap is None:
        raise ValueError("mode='mask' needs an upper bound (cap)")
    if lower is not None and (mode != "mask" or lower < 0 or (cap is not None and lower >= cap)):
        raise ValueError(f"lower ({lower}) applies to mode='mask' only and must be in [0, cap)")


def importance_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    level: ImportanceLevel = "token",
    mode: ImportanceMode = "truncate",
    cap: float | None = None,
    lower: float | None = None,
) -> ImportanceWeights:
    """Detached importance weights ``pi_prox / mu`` at ``level``, truncated at ``cap`` or masked outside
    ``[lower, cap]`` (``lower=None``: no lower bound) or not applied (``none``: weights 1, ``cap`` unused) as
    ``mode`` says (see the module docstring).

    Untrained tokens (mask 0) get weight 0 and are never dropped; a sequence without a trained token
    is not a unit. Values where mask is 0 may be NaN: they are replaced before any arithmetic.

    Shapes: proximal_logprobs[N], behavior_logprobs[N], mask[N] float 0/1, seq_ids[N] int64 ->
    weights[N], dropped[N], unit_weights[U], unit_dropped[U].

    Example (two sequences; the second's tokens are each twice as likely under pi_prox):
        >>> prox = torch.tensor([0.0, 0.0, 0.0, 0.0]); mu = torch.tensor([0.0, 0.0, -0.5, -0.5])
        >>> out = importance_weights(prox, mu, torch.ones(4), torch.tensor([0, 0, 1, 1]), level="sequence", cap=2.0)
        >>> out.weights.tolist(), [round(w, 4) for w in out.unit_weights.tolist()]
        ([1.0, 1.0, 2.0, 2.0], [1.0, 2.7183])
    """
    check_importance(level, mode, cap, lower)
    active = mask > 0
    delta = torch.where(active, proximal_logprobs.detach() - behavior_logprobs.detach(), torch.zeros_like(mask))
    if level == "token":
        log_unit, unit_of_token, unit_active = delta, torch.arange(mask.numel(), device=mask.device), active
    else:
        num_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        log_unit = torch.zeros(num_seqs, dtype=delta.dtype, device=delta.device).index_add_(0, seq_ids, delta)
        counts = torch.zeros(num_seqs, dtype=delta.dtype, device=delta.device).index_add_(0, seq_ids, active.to(delta.dtype))
        if level == "geometric":
            log_unit = log_unit / counts.clamp(min=1.0)
        unit_of_token, unit_active = seq_ids, counts > 0
    unit = torch.exp(log_unit.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    if mode == "none":
        kept, unit_dropped = torch.ones_like(unit), torch.zeros_like(unit_active)
    elif mode == "truncate":
        kept, unit_dropped = (unit.clamp(max=cap) if cap is not None else unit), torch.zeros_like(unit_active)
    else:
        unit_dropped = unit_active & ((unit > cap) | ((unit < lower) if lower is not None else False))
        kept = torch.where(unit_dropped, torch.zeros_like(unit), unit)
    weights = torch.where(active, kept[unit_of_token], torch.zeros_like(delta))
    dropped = active & unit_dropped[unit_of_token]
    return ImportanceWeights(weights, dropped, unit[unit_active], unit_dropped[unit_active])


METRIC_KEYS: tuple[str, ...] = tuple(f"importance/{name}" for name in (
    "weight_mean", "weight_max", "weight_min", "weight_p50", "weight_p90", "weight_p99", "truncated_frac",
    "dropped_frac", "ess", "num_units"))
"""The keys :func:`importance_metrics` returns (a step that measured no weight logs them as NaN)."""


def importance_metrics(result: ImportanceWeights, *, cap: float | None) -> dict[str, float]:
    """The diagnostics of one batch's weights, over its units (tokens or sequences).

    ``mean``, ``max``, ``min`` and the ``p50``/``p90``/``p99`` quantiles of the weights before truncation
    or masking; ``truncated_frac`` (units kept but capped at ``cap``), ``dropped_frac`` (units masked);
    ``ess``, the effective sample size as a fraction of the units, ``(sum w)^2 / (U sum w^2)`` of the
    weights after ``cap`` (1 when every weight is equal; 1/U when one unit carries everything): the weights
    that reach the loss under ``truncate`` and ``mask``; under ``none`` (``cap=None``) the measured ones, the
    effective size the batch would have if it were weighted.

    Shapes: unit_weights[U] -> scalars. Keys are prefixed with ``importance/``.
    """
    w = result.unit_weights.double()
    if w.numel() == 0:
        return {}
    used = torch.where(result.unit_dropped, torch.zeros_like(w), w if cap is None else w.clamp(max=cap))
    quantiles = torch.quantile(w, torch.tensor([0.5, 0.9, 0.99], dtype=w.dtype))
    square_sum = float((used**2).sum())
    return {
        "importance/weight_mean": float(w.mean()),
        "importance/weight_max": float(w.max()),
        "importance/weight_min": float(w.min()),
        "importance/weight_p50": float(quantiles[0]),
        "importance/weight_p90": float(quantiles[1]),
        "importance/weight_p99": float(quantiles[2]),
        "importance/truncated_frac": float(((w > cap) & ~result.unit_dropped).double().mean()) if cap is not None else 0.0,
        "importance/dropped_frac": float(result.unit_dropped.double().mean()),
        "importance/ess": float(used.sum() ** 2 / (w.numel() * square_sum)) if square_sum > 0 else 0.0,
        "importance/num_units": float(w.numel()),
    }

"""The metrics of one training step: summed over its micro-batches, reduced over ranks, averaged over its updates.

:class:`StepTotals` collects what each micro-batch's loss reports (``loss/*``, ``policy/*``, ``value/*``,
``importance/*``, the train/inference ``mismatch/*``) and reduces it over ranks once per update;
:func:`mean_over_updates` joins the updates of a step into the logged values.
"""

from __future__ import annotations

import functools
import math

import torch

from lightning_agentrl.algorithms import importance
from lightning_agentrl.algorithms.diagnostics import explained_variance_of_sums, variance_sums
from lightning_agentrl.distributed import all_gather, reduce_metrics


def mean_over_updates(logs: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a step's updates: maxima are maxima, everything else the mean over updates. A measurement an
    update could not take (``mismatch/*`` without lag-0 tokens) is NaN there and left out; every other NaN stays."""
    keys = {key for log in logs for key in log}
    out = {}
    for key in keys:
        values = [log[key] for log in logs if key in log]
        if key.startswith(SOMETIMES_UNMEASURED):
            values = [v for v in values if not math.isnan(v)] or [math.nan]
        out[key] = functools.reduce(nan_max, values) if key.endswith("_max") else sum(values) / len(values)
    return out


EV_SUMS = ("ev/n", "ev/sum_r", "ev/sum_r2", "ev/sum_d", "ev/sum_d2")
"""The critic's :func:`variance_sums` under these names in a rank's totals: its explained variance is pooled from them."""

SOMETIMES_UNMEASURED = ("mismatch/", "importance/")
"""Metrics an update may have nothing to measure for (NaN there): a step's value is over the updates that did."""


def nan_max(a: float, b: float) -> float:
    """``max`` that keeps a NaN (Python's ``max(0.0, nan)`` is 0.0: a NaN step would read as a perfect one)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class StepTotals:
    """The metrics of one step, summed over micro-batches, then over ranks by :meth:`reduced`.

    ``loss/*`` are sums (each micro-batch's loss carries the step's denominators already);
    ``maxima`` are maxima; ``value/*`` are sums of value x kept turns, divided by the kept turns;
    every other key is a sum of value x action tokens, divided by the step's action tokens at the end."""

    def __init__(self, importance_cap: float | None = None) -> None:
        self.importance_cap = importance_cap
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {"mismatch/logprob_max": 0.0}
        self.values: list[torch.Tensor] = []
        self.returns: list[torch.Tensor] = []
        self.importance: list[importance.ImportanceWeights] = []
        self.critic_forward_s = 0.0  # the privileged critic's second forward (0 without one)

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def add_mismatch(self, recomputed, behavior, lag_zero, actions) -> None:
        """The train/inference mismatch |recomputed - behavior| [n] on the action tokens sampled by the
        weights the step started from (``lag_zero``)."""
        on_policy = lag_zero & actions
        if on_policy.any():
            diff = (recomputed[on_policy] - behavior[on_policy]).abs()
            self.maxima["mismatch/logprob_max"] = nan_max(self.maxima["mismatch/logprob_max"], float(diff.max()))
            self.add("mismatch_sum", float(diff.sum()))
            self.add("mismatch_n", float(on_policy.sum()))

    def add_micro_batch(self, metrics: dict[str, torch.Tensor], *, share: float) -> None:
        """A micro-batch's loss metrics: ``loss/*`` as they are, ``*_max`` as maxima, the rest weighted
        by the micro-batch's ``share`` (its action tokens)."""
        self.add("weight", share)
        for key, value in metrics.items():
            if key.startswith("loss/"):
                self.add(key, float(value))
            elif key.endswith("_max"):
                self.maxima[key] = nan_max(self.maxima.get(key, 0.0), float(value))
            else:
                self.add(key, float(value) * share)

    def reduced(self) -> dict[str, float]:
        local = {"loss/total": 0.0, "weight": 0.0, "mismatch_sum": 0.0, "mismatch_n": 0.0, **self.sums, **self.maxima}
        if self.values:  # summed over ranks (a rank without values lacks the keys: 0 there)
            local.update(zip(EV_SUMS, variance_sums(torch.cat(self.values), torch.cat(self.returns)), strict=True))
        maxima = {key for key in local if key.endswith("_max")}  # the same names on every rank
        step = reduce_metrics(local, sums=lambda key: key not in maxima, maxima=maxima)
        if EV_SUMS[0] in step:  # pooled over ranks, not a mean of each rank's
            step["value/explained_variance"] = explained_variance_of_sums(*(step.pop(key) for key in EV_SUMS))
        weight, mismatch_sum, mismatch_n = step.pop("weight"), step.pop("mismatch_sum"), step.pop("mismatch_n")
        value_weight = step.pop("value_weight", 0.0)
        out = {"mismatch/logprob_mean": mismatch_sum / mismatch_n if mismatch_n else math.nan}  # NaN: no lag-0 token
        for key, value in step.items():
            if key.startswith("loss/") or key == "value/explained_variance" or key in maxima:
                out[key] = value
            elif key.startswith("value/"):  # turn-weighted: the critic's metrics are per turn
                out[key] = value / max(value_weight, 1.0)
            else:
                out[key] = value / max(weight, 1.0)
        if not mismatch_n:
            out["mismatch/logprob_max"] = math.nan
        seconds = reduce_metrics({"time/critic_forward_s": self.critic_forward_s}, maxima={"time/critic_forward_s"})
        return {**out, **self._importance_metrics(), **seconds}

    def _importance_metrics(self) -> dict[str, float]:
        """``importance/*`` over the units (tokens or episodes) of this rank's micro-batches; over ranks the
        maxima and minima are kept, the unit counts summed and the rest (means, fractions exactly; quantiles and
        ESS approximately) averaged weighted by each rank's units, ranks without units left out.
        A collective: every rank calls it, with or without weights."""
        local: dict[str, float] = {}
        if self.importance:
            joined = importance.ImportanceWeights(*(torch.cat(parts) for parts in zip(*(
                (w.weights, w.dropped, w.unit_weights, w.unit_dropped) for w in self.importance), strict=True)))
            local = importance.importance_metrics(joined, cap=self.importance_cap)
        shares = [share for share in all_gather(local) if share]  # ranks without units have nothing to say
        if len(shares) <= 1:
            return shares[0] if shares else {}
        units = sum(share["importance/num_units"] for share in shares)
        out = {key: sum(share[key] * share["importance/num_units"] for share in shares) / units for key in shares[0]}
        out.update({"importance/num_units": units, "importance/weight_max": max(s["importance/weight_max"] for s in shares),
                    "importance/weight_min": min(s["importance/weight_min"] for s in shares)})
        return out

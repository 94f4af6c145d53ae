"""Sequence-level importance correction through ``fit``: an engine that reports every sampled token
``SHIFT`` nats less likely than the policy it samples from (what a lower-precision or differently
tempered engine does), so that each trained token's ratio pi_prox / pi_behavior is exp(SHIFT) and an
episode's product is exp(SHIFT x its trained tokens). The logged weights, truncation and masking must
be those numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_agentrl.train import fit
from tests.fitting import SOLVE, StepLog, TeacherForcedEngine, learn_settings

pytestmark = pytest.mark.timeout(300)
SHIFT = 0.01


class ShiftedLogprobEngine:
    """The wrapped engine's samples, with every behavior log-prob lowered by ``SHIFT``."""

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, sampling, session_id):
        out = await self.engine.generate(prompt_ids, sampling, session_id)
        return dataclasses.replace(out, logprobs=[lp - SHIFT for lp in out.logprobs])

    async def update_weights(self, named_tensors, version):
        await self.engine.update_weights(named_tensors, version)

    async def close(self):
        await self.engine.close()


def shifted_fit(settings):
    """``fit`` with every episode's log-probs shifted (episode 0 of each group solves its task, so that
    groups have reward variance and the step trains); returns the step log."""
    from transformers import AutoTokenizer

    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.train import resolve_model_path

    log = StepLog()

    def wrap(engine):
        codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
        return ShiftedLogprobEngine(TeacherForcedEngine(engine, codec, {"e0": SOLVE}))

    fit(settings, callbacks=[log], wrap_engine=wrap)
    return None, log


def episode_log_weights(batch) -> torch.Tensor:
    """SHIFT x the trained tokens of each included episode: its log sequence weight."""
    trained = (batch.loss_mask > 0) & batch.include[batch.episode_ids]
    counts = torch.zeros(batch.num_episodes).index_add_(0, batch.episode_ids, trained.float())
    return SHIFT * counts[counts > 0]


def test_sequence_truncation_weighs_each_episode_by_its_product_of_ratios(tmp_path):
    settings = learn_settings(tmp_path, "--algorithm.importance_level=sequence", "--algorithm.importance_cap=1.3")
    _, log = shifted_fit(settings)
    assert len(log.metrics) == 2
    for batch, step in zip(log.batches, log.metrics, strict=True):
        weights = torch.exp(episode_log_weights(batch))
        assert step["importance/num_units"] == weights.numel()
        assert math.isclose(step["importance/weight_mean"], float(weights.mean()), rel_tol=1e-3)
        assert math.isclose(step["importance/weight_max"], float(weights.max()), rel_tol=1e-3)
        assert math.isclose(step["importance/truncated_frac"], float((weights > 1.3).float().mean()), abs_tol=1e-6)
        assert step["importance/truncated_frac"] > 0  # the cap bites on the long episodes
        assert step["importance/dropped_frac"] == 0.0
        assert math.isclose(step["mismatch/logprob_mean"], SHIFT, rel_tol=1e-2)  # the engine is visibly off
        # the loss saw the truncated weights (token-mean over the trained tokens)
        assert 1.0 < step["policy/is_weight_mean"] <= 1.3 + 1e-6


def test_sequence_masking_drops_whole_episodes_outside_the_bounds_and_counts_them(tmp_path):
    settings = learn_settings(tmp_path, "--algorithm.importance_level=sequence", "--algorithm.importance_mode=mask",
                              "--algorithm.importance_cap=1.3")
    _, log = shifted_fit(settings)
    for batch, step in zip(log.batches, log.metrics, strict=True):
        weights = torch.exp(episode_log_weights(batch))
        expected = float(((weights > 1.3) | (weights < 1 / 1.3)).float().mean())
        assert expected > 0
        assert math.isclose(step["importance/dropped_frac"], expected, abs_tol=1e-6)
        assert step["policy/is_masked_frac"] > 0 and step["importance/truncated_frac"] == 0.0


def test_geometric_mean_is_the_per_token_ratio_whatever_the_length(tmp_path):
    settings = learn_settings(tmp_path, "--algorithm.importance_level=geometric", "--algorithm.importance_mode=mask",
                              "--algorithm.importance_cap=1.3")
    _, log = shifted_fit(settings)
    for step in log.metrics:
        assert math.isclose(step["importance/weight_mean"], math.exp(SHIFT), rel_tol=1e-4)
        assert math.isclose(step["importance/weight_max"], math.exp(SHIFT), rel_tol=1e-4)
        assert step["importance/dropped_frac"] == 0.0 and step["importance/ess"] > 0.999


def test_mode_none_measures_the_sequence_weights_and_applies_none_of_them(tmp_path):
    """The uncorrected baseline: the same shifted engine, the weights logged as the product of ratios, the loss
    weighted by exactly 1 (nothing truncated or dropped, though a 1.3 cap would have bitten)."""
    settings = learn_settings(tmp_path, "--algorithm.importance_level=sequence", "--algorithm.importance_mode=none")
    _, log = shifted_fit(settings)
    assert len(log.metrics) == 2
    for batch, step in zip(log.batches, log.metrics, strict=True):
        weights = torch.exp(episode_log_weights(batch))
        assert float(weights.max()) > 1.3  # a cap of 1.3 would have bitten
        assert math.isclose(step["importance/weight_max"], float(weights.max()), rel_tol=1e-3)
        assert step["importance/truncated_frac"] == 0.0 and step["importance/dropped_frac"] == 0.0
        assert step["policy/is_weight_mean"] == 1.0 and step["policy/is_weight_max"] == 1.0
        assert step["policy/is_masked_frac"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mode_none_takes_the_ratio_around_the_trainer_at_every_level(tmp_path, level):
    """Under `none` the behavior policy never enters the loss: at lag 0 the PPO ratio is the trainer's own
    (exactly 1 in a one-update step), whatever the level, though the engine is SHIFT nats off."""
    _, log = shifted_fit(learn_settings(tmp_path, f"--algorithm.importance_level={level}",
                                        "--algorithm.importance_mode=none"))
    for step in log.metrics:
        assert step["policy/ratio_mean"] == 1.0 and step["policy/clipfrac"] == 0.0
        assert math.isclose(step["importance/weight_mean"], math.exp(SHIFT), rel_tol=1e-3) or level == "sequence"
        assert step["importance/num_units"] > 0


def test_an_engine_in_bfloat16_samples_from_a_visibly_different_policy_that_the_correction_weighs(tmp_path):
    """``engine.dtype=bfloat16`` beside a float32 trainer: the engine's own copy is bfloat16, its log-probs are
    off by bfloat16 rounding (a lag-0 mismatch of ~6e-4 against ~2e-7 with one dtype), and sequence-level
    weights, which multiply every token's ratio, move away from 1 by it."""
    from transformers import AutoTokenizer

    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.train import resolve_model_path

    dtypes, runs = [], {}
    for name, overrides in (("float32", ()), ("bfloat16", ("--engine.dtype=bfloat16",))):
        settings = learn_settings(tmp_path / name, "--algorithm.importance_level=sequence",
                                  "--algorithm.importance_cap=1000", *overrides)
        assert settings.engine_dtype == name and settings.model.dtype == "float32"

        def wrap(engine, settings=settings):
            dtypes.append({p.dtype for p in engine.model.parameters()})
            codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
            return TeacherForcedEngine(engine, codec, {"e0": SOLVE})  # reward variance: the steps train

        log = StepLog()
        fit(settings, callbacks=[log], wrap_engine=wrap)
        runs[name] = log.metrics
    assert dtypes == [{torch.float32}, {torch.bfloat16}]
    same, lower = runs["float32"], runs["bfloat16"]
    assert all(step["mismatch/logprob_mean"] < 1e-6 for step in same)  # float32 both sides: rounding only
    assert all(step["mismatch/logprob_mean"] > 1e-4 for step in lower)  # bfloat16 rounding of every weight
    spread = [abs(math.log(step["importance/weight_max"])) + abs(math.log(step["importance/weight_min"]))
              for step in lower]
    assert min(spread) > 100 * max(abs(math.log(s["importance/weight_max"])) + abs(math.log(s["importance/weight_min"]))
                                  for s in same)

"""Rollout settings through the real entry point: tiny model, real sandbox server, MLflow store.

Each run is as small as the guarantee allows (two tasks, groups of 2, 16-token actions, 2 turns).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from lightning_agentrl.rollout.agent_loop import check_token_in_token_out
from lightning_agentrl.rollout.engine import Generation
from tests.test_fit import RecordingEngine, recorded_fit, two_task_settings

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--trainer.threads=1", "--rollout.group_size=2", "--engine.max_new_tokens=16", "--env.max_turns=2"]


def metric(result, key: str) -> list[float]:
    history = MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.timeout(240)
def test_partial_rollouts_with_two_groups_per_step_and_weights_pushed_every_other_step_train_every_step(
    tmp_path, tiny_model_path
):
    """The combination that used to stop: parked episodes, two groups per step, and an engine that gets
    new weights only every other step (so it lags the trainer by up to one version)."""
    settings = two_task_settings(
        tmp_path, tiny_model_path, *SMALL, "--trainer.max_steps=3", "--rollout.groups_per_step=2",
        "--rollout.partial_rollout_s=0", "--rollout.max_staleness=1", "--trainer.sync_weights_every=2",
    )
    result, _, capture = recorded_fit(settings)
    assert result.global_step == 3
    assert [b.num_episodes for b in capture.batches] == [4, 4, 4]
    for step, batch in enumerate(capture.batches):
        check_token_in_token_out(batch.trajectories)
        versions = {v for t in batch.trajectories for s in t.segments for v in s.policy_versions if v >= 0}
        assert versions and step - min(versions) <= 1  # within the staleness bound
    parks = sum(t.info.get("num_parks", 0) for b in capture.batches for t in b.trajectories)
    assert parks > 0  # episodes were parked and continued
    assert set(metric(result, "rollout/policy_version")) == {2.0}  # one push, after step 2 (none after the last)


def test_lag_zero_logprobs_agree_with_the_torch_engine_under_top_p_and_temperature(tmp_path, tiny_model_path):
    """One log-prob rule: the engine's behavior log-probs and the trainer's recomputation with the same
    weights (lag 0) are of the same nucleus-restricted, tempered distribution. (vLLM: the same check in
    ``tests/test_fit.py::test_fit_with_the_vllm_engine_trains_on_the_generated_ids``.)"""
    settings = two_task_settings(
        tmp_path, tiny_model_path, *SMALL, "--engine.top_p=0.9",
        "--engine.temperature=0.8", "--rollout.groups_per_step=2",
    )
    result, _, capture = recorded_fit(settings)
    assert result.global_step == 2
    mismatch = metric(result, "mismatch/logprob_max")
    assert len(mismatch) == 2 and all(0 <= m < 1e-4 for m in mismatch), mismatch
    # The rule is the nucleus one: renormalized over the kept mass (>= 0.9), a sampled token's log-prob
    # exceeds its untruncated tempered one by -log(kept mass), in (0, -log 0.9].
    gain = nucleus_gain(tiny_model_path, capture.batches[0].trajectories[0], temperature=0.8)
    assert gain.min() > -1e-4 and gain.max() < -math.log(0.9) + 1e-4 and gain.median() > 1e-3, gain


def test_top_k_restricts_what_the_torch_engine_samples_and_the_trainer_scores(tmp_path, tiny_model_path):
    """``engine.top_k`` reaches both sides of the log-prob rule: the engine samples only among the k most
    likely ids, and the trainer renormalizes over the same k (lag 0 agrees with the engine). With the
    random tiny model the top 2 ids hold a few percent of the mass, so a trainer that ignored the filter
    would differ from the engine by several nats, and an engine that ignored it would sample other ids. The
    reference policy (KL) scores with the same filter: at step 0 it equals the policy, so the KL is 0."""
    settings = two_task_settings(tmp_path, tiny_model_path, *SMALL, "--engine.top_k=2", "--rollout.groups_per_step=2",
                                 "--algorithm.kl_coef=0.1")
    result, _, capture = recorded_fit(settings)
    assert result.global_step == 2
    mismatch = metric(result, "mismatch/logprob_max")
    assert len(mismatch) == 2 and all(0 <= m < 1e-4 for m in mismatch), mismatch
    assert abs(metric(result, "loss/kl")[0]) < 1e-6
    ranks, gain = sampled_ranks(tiny_model_path, capture.batches[0].trajectories[0])
    assert ranks.max() <= 1, ranks  # every sampled id is one of the 2 most likely
    # renormalized over the top 2: log p(y) - log(p1 + p2) > 0, by more than a nat for this flat model
    assert gain.min() > 1.0, gain


@pytest.mark.parametrize("filters", [["--engine.top_k=2"], ["--engine.top_p=0.9", "--engine.temperature=0.7"]])
def test_softmax_logprobs_sample_with_the_filter_and_score_without_it(tmp_path, tiny_model_path, filters):
    """``engine.logprobs=softmax``: the engine still samples with the filter (top-k, or top-p at a
    temperature), but reports each id's log-prob under ``log_softmax(logits / T)``, and the trainer (policy
    and reference) scores with that same softmax, so lag 0 agrees with the engine. The filtered rule differs
    from it by -log(kept mass) at every token: more than a nat for the top 2 of the flat random model, about
    0.1 for a 0.9 nucleus. An engine or a trainer that kept either filter or dropped the temperature, or a
    reference that kept the filter, would fail the checks below."""
    settings = two_task_settings(tmp_path, tiny_model_path, *SMALL, *filters, "--engine.logprobs=softmax",
                                 "--rollout.groups_per_step=2", "--algorithm.kl_coef=0.1")
    result, _, capture = recorded_fit(settings)
    assert result.global_step == 2
    mismatch = metric(result, "mismatch/logprob_max")
    assert len(mismatch) == 2 and all(0 <= m < 1e-4 for m in mismatch), mismatch
    assert abs(metric(result, "loss/kl")[0]) < 1e-6
    trajectory = capture.batches[0].trajectories[0]
    if settings.engine.top_k:
        ranks, _ = sampled_ranks(tiny_model_path, trajectory)
        assert ranks.max() <= 1, ranks  # sampled with the filter
    gain = nucleus_gain(tiny_model_path, trajectory, temperature=settings.engine.temperature)
    assert gain.abs().max() < 1e-4, gain  # reported without it


def sampled_ranks(model_path, trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of each sampled action id among the initial weights' logits (0 = the most likely), and its
    recorded behavior log-prob minus its untruncated ``log_softmax``, over the first segment (step 0)."""
    from transformers import AutoModelForCausalLM

    segment = trajectory.segments[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.tensor([segment.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    actions = torch.tensor([i for i, m in enumerate(segment.loss_mask) if m and i > 0])
    chosen = ids[0, actions]
    chosen_logits = logits[actions - 1].gather(-1, chosen[:, None])
    ranks = (logits[actions - 1] > chosen_logits).sum(-1)
    untruncated = torch.log_softmax(logits[actions - 1], -1).gather(-1, chosen[:, None])[:, 0]
    behavior = torch.tensor([segment.behavior_logprobs[i] for i in actions.tolist()])
    return ranks, behavior - untruncated


def nucleus_gain(model_path, trajectory, *, temperature: float) -> torch.Tensor:
    """Recorded behavior log-prob minus the untruncated ``log_softmax(logits / T)`` of the initial
    weights, at every action token of the episode's first segment (generated at step 0)."""
    from transformers import AutoModelForCausalLM

    segment = trajectory.segments[0]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.tensor([segment.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float() / temperature
    untruncated = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    actions = torch.tensor([i for i, m in enumerate(segment.loss_mask) if m and i > 0])
    behavior = torch.tensor([segment.behavior_logprobs[i] for i in actions.tolist()])
    return behavior - untruncated[actions - 1]


class SolvingEngine(RecordingEngine):
    """The real engine, except that episode 0 of every even group writes the task's reference solution
    and submits: those groups have reward variance, the odd ones (the tiny model alone) have none."""

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(engine)
        from lightning_agentrl.rollout.chat import ChatCodec

        self.codec = ChatCodec(tokenizer)
        self.tokenizer = tokenizer

    async def generate(self, prompt_ids, sampling, session_id):
        group, episode = (int(part[1:]) for part in session_id.split("-")[:2])
        if group % 2 or episode != 0:
            return await super().generate(prompt_ids, sampling, session_id)
        turn = len(self.generations.setdefault(session_id, []))
        ids = self.codec.encode(self._action(self.tokenizer.decode(prompt_ids), turn)) + [self.codec.eos_token_id]
        generation = Generation(ids, [-1.0] * len(ids), "stop", self.policy_version)
        self.generations[session_id].append(generation)
        return generation

    @staticmethod
    def _action(prompt: str, turn: int) -> str:
        import json

        if turn > 0:
            return '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
        name, path = ("binary_search_first", "search.py") if "find_first" in prompt else \
            ("balanced_brackets_unclosed", "brackets.py")
        content = (REPO / "tasks" / "bugfix" / name / "solution" / path).read_text()
        return "<tool_call>" + json.dumps({"name": "write_file", "arguments": {"path": path, "content": content}}) + \
            "</tool_call>"


def test_dynamic_sampling_trains_only_groups_with_reward_variance_and_logs_its_cost(
    tmp_path, tiny_model_path, tiny_tokenizer
):
    from lightning_agentrl.train import fit
    from tests.test_fit import CaptureBatches

    settings = two_task_settings(
        tmp_path, tiny_model_path, *SMALL, "--rollout.groups_per_step=2", "--rollout.dynamic_sampling=true",
        "--rollout.max_sampling_rounds=3",
    )
    capture = CaptureBatches()
    result = fit(settings, callbacks=[capture], wrap_engine=lambda engine: SolvingEngine(engine, tiny_tokenizer))
    assert result.global_step == 2
    for batch in capture.batches:
        assert batch.num_episodes == 4
        by_group: dict[int, list[float]] = {}
        for t in batch.trajectories:
            by_group.setdefault(t.group_id, []).append(t.reward)
        assert len(by_group) == 2
        for group_id, rewards in by_group.items():
            assert group_id % 2 == 0 and max(rewards) == 1.0 and min(rewards) == 0.0, (group_id, rewards)
    discarded = metric(result, "rollout/discarded_groups")
    generated = metric(result, "rollout/episodes_generated")
    assert discarded[-1] >= 2  # at least the odd groups 1 and 3 were generated and thrown away
    assert generated[-1] >= 2 * (4 + discarded[-1])  # trained plus discarded episodes
    assert metric(result, "rollout/filled_groups") == [0.0, 0.0]
    assert len(metric(result, "rollout/dropped_stale_groups")) == 2  # every counter of removed groups is logged

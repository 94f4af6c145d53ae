"""Deterministic sampling: the same episodes give the same ids whatever the batching (TorchEngine)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_agentrl.rollout.agent_loop import EpisodeBudget, request_seed, run_episode
from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine
from tests.rollout.conftest import CountingEnv

BUDGET = EpisodeBudget(max_turns=3, max_context_tokens=1024)
NUM_EPISODES = 6


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path)


def play_all(model, codec, *, max_batch_size: int, concurrent: bool, seed: int | None = 7):
    """Play the same episode set; episode i has a prompt of its own length (rows differ in padding)."""
    engine = TorchEngine(model, pad_token_id=codec.eos_token_id, max_batch_size=max_batch_size)
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed)

    def episode(i: int):
        return run_episode(engine=engine, env=CountingEnv("fix it " * (i + 1)), codec=codec, sampling=sampling,
                           budget=BUDGET, episode_id=f"e{i}", task_id="t", group_id=0)

    async def main():
        if concurrent:
            trajectories = await asyncio.gather(*(episode(i) for i in range(NUM_EPISODES)))
        else:  # one at a time, in reverse order
            trajectories = [await episode(i) for i in reversed(range(NUM_EPISODES))][::-1]
        await engine.close()
        return trajectories, engine.num_batches

    return asyncio.run(main())


def ids_of(trajectories):
    return [[segment.token_ids for segment in t.segments] for t in trajectories]


def test_same_seed_same_trajectories_whatever_the_batching(model, codec):
    batched, num_batched = play_all(model, codec, max_batch_size=16, concurrent=True)
    small, num_small = play_all(model, codec, max_batch_size=4, concurrent=True)
    alone, num_alone = play_all(model, codec, max_batch_size=1, concurrent=False)
    assert num_batched < num_small < num_alone  # three different batch compositions
    assert ids_of(batched) == ids_of(small) == ids_of(alone)
    for a, b in zip(batched, alone, strict=True):
        lp_a = [lp for lp in a.segments[0].behavior_logprobs if lp is not None]
        lp_b = [lp for lp in b.segments[0].behavior_logprobs if lp is not None]
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)


def test_another_seed_samples_other_actions(model, codec):
    first, _ = play_all(model, codec, max_batch_size=16, concurrent=True, seed=7)
    other, _ = play_all(model, codec, max_batch_size=16, concurrent=True, seed=8)
    assert ids_of(first) != ids_of(other)


def test_engine_row_depends_only_on_its_own_seed(model, codec):
    """One request decoded alone or next to others of different lengths and seeds: same ids."""
    engine = TorchEngine(model, pad_token_id=codec.eos_token_id)
    prompt = codec.encode("def parse_date(s):")
    request = SamplingParams(max_new_tokens=32, seed=123)

    async def main():
        alone = await engine.generate(prompt, request)
        others = [engine.generate(codec.encode("x " * n), SamplingParams(max_new_tokens=8, seed=n)) for n in (3, 9)]
        together = await asyncio.gather(engine.generate(prompt, request), *others)
        await engine.close()
        return alone, together[0]

    alone, together = asyncio.run(main())
    assert alone.token_ids == together.token_ids
    assert engine.num_batches == 2


def test_request_seed_is_a_pure_function_of_run_episode_and_request():
    assert request_seed(0, "g1-e2", 3) == request_seed(0, "g1-e2", 3)
    seeds = {request_seed(0, "g1-e2", 3), request_seed(1, "g1-e2", 3), request_seed(0, "g1-e3", 3),
             request_seed(0, "g1-e2", 4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(None, "g1-e2", 3) is None


def test_inverse_cdf_sampling_follows_the_filtered_distribution():
    """All rows in one searchsorted: frequencies match the probabilities, filtered-out ids never come."""
    from lightning_agentrl.algorithms.logprobs import sampling_logits
    from lightning_agentrl.rollout.engine import inverse_cdf_sample

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 3.0, 0.1, 0.2, 2.5]])
    logprobs = torch.log_softmax(sampling_logits(logits, torch.ones(2, 1), top_k=torch.tensor([[3], [2]])), -1)
    draws = 100_000
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0))
    for row in range(2):
        ids = inverse_cdf_sample(logprobs[row].expand(draws, -1), uniforms)
        frequency = torch.bincount(ids, minlength=5).double() / draws
        assert (frequency - logprobs[row].exp().double()).abs().max() < 0.01
        assert frequency[logprobs[row].isinf()].sum() == 0
    edges = torch.tensor([0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))])
    picked = inverse_cdf_sample(logprobs[1].expand(2, -1), edges)
    assert picked.tolist() == [1, 4]  # the first and the last id the top-k filter keeps

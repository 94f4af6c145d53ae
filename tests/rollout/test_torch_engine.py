"""TorchEngine: batched decoding of concurrent requests, exact logprobs, verified weight sync."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine

PROMPTS = [[1, 90, 518, 204, *range(100, 100 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def engine_for(tiny_model_path) -> TorchEngine:
    return TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=3, max_batch_size=8)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=3)
    return out[0, len(prompt):].tolist()


def test_concurrent_requests_share_batches_and_logprobs_match_the_model(tiny_model_path, hf):
    async def run():
        engine = engine_for(tiny_model_path)
        sampling = [SamplingParams(max_new_tokens=16 + i, seed=i) for i in range(len(PROMPTS))]
        gens = await asyncio.gather(*[engine.generate(p, s, f"s{i}") for i, (p, s) in enumerate(zip(PROMPTS, sampling, strict=True))])
        await engine.close()
        return engine, gens

    engine, gens = asyncio.run(run())
    assert engine.num_requests == len(PROMPTS) and engine.num_batches < len(PROMPTS)
    worst = 0.0
    for prompt, generation, params in zip(PROMPTS, gens, [16 + i for i in range(len(PROMPTS))], strict=True):
        assert len(generation.token_ids) == params and generation.finish_reason == "length"
        ids = torch.tensor([prompt + generation.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0].float(), -1)
        expected = logprobs[len(prompt) - 1 : -1].gather(-1, torch.tensor(generation.token_ids)[:, None]).squeeze(-1)
        worst = max(worst, float((expected - torch.tensor(generation.logprobs)).abs().max()))
    assert worst < 1e-4


def test_weight_sync_is_verified_not_assumed(tiny_model_path, hf):
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompt = PROMPTS[2]
    target = hf_greedy(perturbed, prompt, 24)
    assert target != hf_greedy(hf, prompt, 24)
    greedy = SamplingParams(max_new_tokens=24, temperature=0)

    async def run():
        engine = engine_for(tiny_model_path)
        before = (await engine.generate(prompt, greedy, "x")).token_ids
        with pytest.raises(ValueError, match="shape"):
            await engine.update_weights([("lm_head.weight", torch.zeros(3, 3))], version=9)
        with pytest.raises(KeyError, match="no parameter"):
            await engine.update_weights([("not.a.weight", torch.zeros(1))], version=9)
        still = (await engine.generate(prompt, greedy, "x")).token_ids
        await engine.update_weights(perturbed.state_dict().items(), version=1)
        after = await engine.generate(prompt, greedy, "x")
        await engine.close()
        return before, still, after, engine.policy_version

    before, still, after, version = asyncio.run(run())
    assert before == hf_greedy(hf, prompt, 24) == still  # a refused update changes nothing
    assert before != target
    assert after.token_ids == target and after.policy_version == 1 and version == 1


def test_tied_embeddings_sync_under_both_names(tiny_model_path):
    """A tied model's weights come as both ``model.embed_tokens.weight`` and ``lm_head.weight``
    (``gather_full_state_dict``, what WeightSync sends); the engine takes both, one tensor."""
    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model
    from lightning_agentrl.strategies import gather_full_state_dict

    tied_path = build_tiny_model(tiny_model_path.parent, TinyModelConfig(hidden_size=64, tie_word_embeddings=True))
    trained = AutoModelForCausalLM.from_pretrained(tied_path).eval()
    with torch.no_grad():
        trained.model.embed_tokens.weight.add_(torch.randn_like(trained.model.embed_tokens.weight) * 0.5)
    weights = gather_full_state_dict(trained)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(weights)
    prompt, greedy = PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0)

    async def run():
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tied_path), pad_token_id=3)
        await engine.update_weights(weights.items(), version=1)
        generation = await engine.generate(prompt, greedy, "x")
        await engine.close()
        return engine, generation

    engine, generation = asyncio.run(run())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(engine.model.lm_head.weight, weights["lm_head.weight"])
    assert generation.token_ids == hf_greedy(trained, prompt, 16) and generation.policy_version == 1


def _model_logprobs(model, prompt, ids) -> torch.Tensor:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    return logprobs[len(prompt) - 1 : -1].gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_requests_join_a_batch_in_flight_and_leave_it_when_they_stop(tiny_model_path, hf):
    """A long request decodes; a longer prompt and a shorter one arrive mid-way, join at the next
    step and are answered while it goes on. Every row's ids are those it gets alone, and its
    log-probs those of the model: joining and dropping rows keeps each row's cache intact."""
    long_prompt, wide, narrow = PROMPTS[0], [1, 90, *range(200, 230)], [1, 91]
    requests = [(long_prompt, SamplingParams(max_new_tokens=96, seed=1)),
                (wide, SamplingParams(max_new_tokens=6, seed=2)), (narrow, SamplingParams(max_new_tokens=9, seed=3))]

    async def run():
        engine = engine_for(tiny_model_path)
        alone = [await engine.generate(p, s) for p, s in requests]
        first = asyncio.ensure_future(engine.generate(*requests[0]))
        await _until(lambda: engine.num_batches == 4)  # the long one is decoding
        joined = await asyncio.gather(engine.generate(*requests[1]), engine.generate(*requests[2]))
        still_running = not first.done()
        together = [await first, *joined]
        await engine.close()
        return engine, alone, together, still_running

    engine, alone, together, still_running = asyncio.run(run())
    assert engine.num_joins == 1 and still_running  # they joined and left before it stopped
    for (prompt, _), a, t in zip(requests, alone, together, strict=True):
        assert t.token_ids == a.token_ids
        expected = _model_logprobs(hf, prompt, t.token_ids)
        assert float((expected - torch.tensor(t.logprobs)).abs().max()) < 1e-4


def test_a_weight_update_closes_the_batch_to_new_requests(tiny_model_path):
    """No generation mixes two policy versions: a request that arrives after an update was asked
    for waits for it instead of joining the batch in flight."""
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    async def run():
        engine = engine_for(tiny_model_path)
        first = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=96, seed=1)))
        await _until(lambda: engine.num_batches == 1)
        update = asyncio.ensure_future(engine.update_weights(perturbed.state_dict().items(), version=1))
        await asyncio.sleep(0)
        late = await engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=4, seed=2))
        results = await first, late
        await update
        await engine.close()
        return engine, results

    engine, (first, late) = asyncio.run(run())
    assert (first.policy_version, late.policy_version, engine.num_joins) == (0, 1, 0)
    assert len(first.token_ids) == 96


def test_an_id_outside_the_vocabulary_is_refused_before_any_batch(tiny_model_path):
    async def run():
        engine = engine_for(tiny_model_path)
        with pytest.raises(ValueError, match="outside the model's vocabulary of 2048: \\[2048, -1\\]"):
            await engine.generate([1, 2048, 5, -1], SamplingParams(max_new_tokens=4))
        await engine.close()
        return engine

    assert asyncio.run(run()).num_requests == 0


def test_a_bad_prompt_fails_its_own_request_not_the_batch_it_joins(tiny_model_path):
    """A prompt whose prefill fails (here an id past the embedding table, let through the engine's
    own check): that request gets the error; the row it joined and the requests that arrived with
    it are answered as if it had never come."""
    bad = [1, 10**6]
    running, fellow = (PROMPTS[0], SamplingParams(max_new_tokens=64, seed=1)), (PROMPTS[3], SamplingParams(max_new_tokens=5, seed=4))

    async def run():
        engine = engine_for(tiny_model_path)
        engine._vocab_size = 10**9  # let the bad id through to the prefill
        alone = [await engine.generate(*running), await engine.generate(*fellow)]
        first = asyncio.ensure_future(engine.generate(*running))
        await _until(lambda: engine.num_batches == 3)
        joined = await asyncio.gather(engine.generate(bad, SamplingParams(max_new_tokens=4)), engine.generate(*fellow),
                                      return_exceptions=True)
        at_start = await asyncio.gather(engine.generate(bad, SamplingParams(max_new_tokens=4)),
                                        engine.generate(*fellow), return_exceptions=True)
        result = await first
        await engine.close()
        return alone, result, joined, at_start

    alone, result, joined, at_start = asyncio.run(run())
    assert result.token_ids == alone[0].token_ids
    for error, generation in (joined, at_start):
        assert isinstance(error, IndexError)
        assert generation.token_ids == alone[1].token_ids


def test_close_answers_the_rows_in_flight_and_fails_the_queued_requests(tiny_model_path):
    async def run():
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=3, max_batch_size=1)
        running = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=64, seed=1)))
        await _until(lambda: engine.num_batches == 1)
        queued = asyncio.ensure_future(engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=4, seed=2)))
        await asyncio.sleep(0)
        await engine.close()
        return await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), timeout=30)

    running, queued = asyncio.run(run())
    assert len(running.token_ids) == 64
    assert isinstance(queued, RuntimeError) and "closed" in str(queued)


def test_staggered_arrivals_within_the_admission_window_share_one_prefill(tiny_model_path):
    """Requests 20 ms apart reach a decoding batch: with a 60 s window they wait, and go in together once
    they fill the batch (one prefill, one join, not one each); each still samples the ids it samples alone,
    and a request to an idle engine is never held (each ``alone`` call would otherwise wait the minute)."""
    short = [(p, SamplingParams(max_new_tokens=5, seed=10 + i)) for i, p in enumerate(PROMPTS[1:4])]

    async def run():
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=3, max_batch_size=4,
                             admission_window_ms=60_000)
        alone = [await asyncio.wait_for(engine.generate(*request), timeout=20) for request in short]
        long = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2000, seed=1)))
        await _until(lambda: engine.num_batches == len(short) + 1)  # the long one is decoding
        prefills = engine.num_batches
        staggered = []
        for request in short:
            staggered.append(asyncio.ensure_future(engine.generate(*request)))
            await asyncio.sleep(0.02)
        together = await asyncio.wait_for(asyncio.gather(*staggered), timeout=20)
        still_running = not long.done()
        long.cancel()
        await engine.close()
        return engine, prefills, alone, together, still_running

    engine, prefills, alone, together, still_running = asyncio.run(run())
    assert (engine.num_batches - prefills, engine.num_joins, still_running) == (1, 1, True)
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]


def test_the_admission_window_bounds_the_wait_of_a_request_that_arrives_mid_batch(tiny_model_path):
    """Two requests 20 ms apart, room for more: both wait until the first has waited the window (0.3 s), then
    join the running batch together, before it ends."""

    async def run():
        engine = TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=3, max_batch_size=8,
                             admission_window_ms=300)
        long = asyncio.ensure_future(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3000, seed=1)))
        await _until(lambda: engine.num_steps > 0)
        start = time.monotonic()
        first = asyncio.ensure_future(engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=3, seed=2)))
        await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(first, engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=3))),
                               timeout=20)
        waited, still_running = time.monotonic() - start, not long.done()
        long.cancel()
        await engine.close()
        return engine, waited, still_running

    engine, waited, still_running = asyncio.run(run())
    assert (engine.num_batches, engine.num_joins, still_running) == (2, 1, True)
    assert waited >= 0.3


def test_a_negative_admission_window_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="admission_window_ms must be a finite number >= 0"):
        TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_model_path), pad_token_id=3, admission_window_ms=-1)

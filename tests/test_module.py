"""AgentRLModule's step on synthetic batches: credit goes only where it should, exactly."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lightning_agentrl import policy
from lightning_agentrl.batching import micro_batches
from lightning_agentrl.models import packed as packed_module
from lightning_agentrl.module import AgentRLModule
from lightning_agentrl.policy import hidden_states
from lightning_agentrl.settings import load_settings
from lightning_agentrl.trajectory import Segment, TerminationReason, Trajectory, Turn, pack


def make_batch(model, rewards, *, seed=0, turns=2, group_size=4, vocab=2000, shared_prompt=0):
    """Episodes whose action tokens and behavior logprobs are sampled from ``model`` itself; with
    ``shared_prompt``, a group's episodes open with the same prompt of that many tokens (as GRPO's do)."""
    g = torch.Generator().manual_seed(seed)
    trajectories = []
    prompts = {}
    for i, reward in enumerate(rewards):
        segment = Segment()
        if shared_prompt:
            if i // group_size not in prompts:
                prompts[i // group_size] = torch.randint(5, vocab, (shared_prompt,), generator=g).tolist()
            segment.extend(prompts[i // group_size], mask=0)
        else:
            segment.extend(torch.randint(5, vocab, (int(torch.randint(6, 12, (1,), generator=g)),), generator=g).tolist(), mask=0)
        for _ in range(turns):
            start = len(segment.token_ids)
            ids = torch.tensor([segment.token_ids])
            action, logprobs = [], []
            with torch.no_grad():
                for _ in range(int(torch.randint(3, 7, (1,), generator=g))):
                    lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
                    token = int(torch.multinomial(lp.exp(), 1, generator=g))
                    action.append(token)
                    logprobs.append(float(lp[token]))
                    ids = torch.cat([ids, torch.tensor([[token]])], 1)
            segment.extend(action, mask=1, logprobs=logprobs, version=0)
            segment.turns.append(Turn(action_start=start, action_end=len(segment.token_ids), state_key=f"s{i % 2}"))
            segment.extend(torch.randint(5, vocab, (5,), generator=g).tolist(), mask=0)
        segment.turns[-1].reward = float(reward)
        trajectories.append(
            Trajectory(episode_id=f"e{i}", task_id="t", group_id=i // group_size, segments=[segment],
                       reward=float(reward), termination=TerminationReason.SUBMITTED)
        )
    return pack(trajectories)


@pytest.fixture(scope="module")
def base(tiny_model_path):
    module = AgentRLModule(load_settings(overrides=["--trainer.micro_batch_tokens=100000"]), str(tiny_model_path))
    module.configure_model()
    batch = make_batch(module.policy, [1, 0, 1, 1, 0, 0, 1, 0])
    return module, batch


def gradients(module, batch):
    module.zero_grad(set_to_none=True)
    log = module.accumulate_gradients(batch)
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, log


def with_settings(module, *overrides):
    clone = copy.deepcopy(module)
    clone.settings = load_settings(overrides=list(overrides))
    return clone


def test_recomputed_logprobs_match_behavior(base):
    module, batch = base
    _, log = gradients(module, batch)
    assert log["mismatch/logprob_max"] < 1e-4
    assert log["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


def test_micro_batching_gives_the_same_gradient(base):
    module, batch = base
    full, log_full = gradients(module, batch)
    assert len(micro_batches(batch.episode_ids, 64)) > 2
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        one = with_settings(module, f"--algorithm.aggregation={aggregation}", "--trainer.micro_batch_tokens=100000")
        many = with_settings(module, f"--algorithm.aggregation={aggregation}", "--trainer.micro_batch_tokens=64")
        g_one, l_one = gradients(one, batch)
        g_many, l_many = gradients(many, batch)
        assert l_one["loss/total"] == pytest.approx(l_many["loss/total"], abs=1e-6)
        for name in g_one:
            torch.testing.assert_close(g_one[name], g_many[name], atol=1e-6, rtol=1e-4)
    assert log_full["tokens/train"] == float(batch.loss_mask.sum())


def test_excluded_episodes_leave_loss_and_baseline(base):
    module, batch = base
    excluded = copy.deepcopy(batch)
    excluded.include[1] = False  # the only failure of group 0
    # group 0 is now all-correct: zero advantage; only group 1 carries gradient
    only_group_1 = copy.deepcopy(batch)
    only_group_1.include[:4] = False
    g_excluded, _ = gradients(module, excluded)
    g_group_1, _ = gradients(module, only_group_1)
    for name in g_group_1:
        # token-mean denominators differ (group 0's tokens still count in `excluded`), so compare directions
        a, b = g_excluded[name].flatten(), g_group_1[name].flatten()
        if b.norm() > 0:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999


def test_observation_tokens_get_no_gradient_unless_the_mask_is_off(base):
    """Each episode ends with 5 observation tokens that no action is conditioned on: with the loss
    mask on, changing them changes nothing; with it off (the ablation), they are trained on."""
    module, batch = base
    changed = copy.deepcopy(batch)
    trailing = torch.cat([torch.arange(last - 4, last + 1) for last in batch.episode_last.tolist()])
    assert (batch.loss_mask[trailing] == 0).all()
    changed.input_ids[trailing] = (batch.input_ids[trailing] + 7) % 2000
    g, _ = gradients(module, batch)
    g_changed, _ = gradients(module, changed)
    for name in g:
        assert torch.equal(g[name], g_changed[name]), name
    no_mask = with_settings(module, "--algorithm.loss_mask=false")
    g_off, log_off = gradients(no_mask, batch)
    g_off_changed, _ = gradients(no_mask, changed)
    assert log_off["tokens/train"] > float(batch.loss_mask.sum())
    assert not torch.allclose(g_off["policy.lm_head.weight"], g_off_changed["policy.lm_head.weight"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_decay", "gigpo"])
def test_every_estimator_trains(base, estimator):
    module, batch = base
    clone = with_settings(module, f"--algorithm.advantage={estimator}")
    g, log = gradients(clone, batch)
    assert sum(float(v.norm()) for v in g.values()) > 0
    assert all(torch.isfinite(v).all() for v in g.values())


def test_gae_trains_the_critic(tiny_model_path, base):
    _, batch = base
    settings = load_settings(overrides=["--model.value_head=true", "--algorithm.advantage=gae"])
    module = AgentRLModule(settings, str(tiny_model_path))
    module.configure_model()
    g, log = gradients(module, batch)
    assert "value_head.weight" in g and float(g["value_head.weight"].norm()) > 0
    assert log["loss/value"] > 0  # V starts at 0, returns are 1 for the successes


def test_kl_to_reference_is_zero_before_any_update(tiny_model_path, base):
    _, batch = base
    module = AgentRLModule(load_settings(overrides=["--algorithm.kl_coef=0.1"]), str(tiny_model_path))
    module.configure_model()
    _, log = gradients(module, batch)
    assert log["loss/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_logprobs_equal_one_sequence_at_a_time(tiny_model_path, base, attn):
    """Segments packed in one row see only themselves: the block mask works for each kernel."""
    _, batch = base
    module = AgentRLModule(load_settings(overrides=[f"--model.attn_implementation={attn}"]), str(tiny_model_path))
    module.configure_model()
    module.policy.eval()
    with torch.no_grad():
        packed = hidden_states(module.policy, batch.input_ids, batch.position_ids, batch.segment_ids)
        for segment in batch.segment_ids.unique().tolist():
            where = batch.segment_ids == segment
            alone = module.policy.get_decoder()(input_ids=batch.input_ids[where][None]).last_hidden_state[0]
            torch.testing.assert_close(packed[where], alone, atol=1e-4, rtol=1e-4)


def test_the_training_step_runs_a_group_s_shared_prompt_once(base, monkeypatch):
    """The training forward (with gradients) takes the shared-prefix path of packed_hidden_states: each
    group's prompt once, its episodes' own tokens on its cache; gradients equal every episode run whole."""
    module, _ = base
    batch = make_batch(module.policy, [1, 0, 1, 1, 0, 0, 1, 0], shared_prompt=packed_module.MIN_SHARED_PREFIX + 4)
    shared_groups = []
    run_shared = packed_module._run_shared

    def spy(decoder, input_ids, position_ids, starts, lengths, groups, *args):
        shared_groups.append([len(members) for _, members in groups])
        return run_shared(decoder, input_ids, position_ids, starts, lengths, groups, *args)

    monkeypatch.setattr(packed_module, "_run_shared", spy)
    shared, log = gradients(module, batch)
    assert shared_groups == [[4, 4]]  # one micro-batch, both groups' prompts shared
    assert log["mismatch/logprob_max"] < 1e-4
    whole_states = functools.partial(packed_module.packed_hidden_states, min_shared_prefix=None)
    monkeypatch.setattr(policy, "packed_hidden_states", whole_states)
    whole, _ = gradients(module, batch)
    assert shared_groups == [[4, 4]] and shared.keys() == whole.keys()
    for name, gradient in whole.items():
        torch.testing.assert_close(shared[name], gradient, atol=1e-5, rtol=1e-4)


def test_a_rank_without_tokens_still_joins_the_backward_with_a_zero_loss(base):
    """Gateway episodes that never called the model leave a rank an empty batch; its backward (a collective with
    several ranks) must still run, reaching every trainable parameter with a zero gradient."""
    module, _ = base
    empty = pack([Trajectory(episode_id="e0", task_id="t", group_id=0, segments=[], reward=0.0,
                             termination=TerminationReason.AGENT_ERROR)])
    assert empty.input_ids.numel() == 0
    module.zero_grad(set_to_none=True)
    loss = module._zero_loss(empty)
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert loss.item() == 0.0 and grads and all(g is not None and not g.any() for g in grads)


def test_a_nan_maximum_stays_nan_in_the_step_metrics():
    """``max(0.0, nan)`` is 0.0 in Python: a step whose log-probs went NaN would log a lag-0 mismatch of 0."""
    import math

    from lightning_agentrl.step_metrics import StepTotals

    totals = StepTotals()
    totals.add_micro_batch({"policy/ratio_max": torch.tensor(float("nan"))}, share=1.0)
    totals.add_micro_batch({"policy/ratio_max": torch.tensor(2.0)}, share=1.0)
    nan = torch.tensor([float("nan")])
    totals.add_mismatch(nan, torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool))
    assert math.isnan(totals.maxima["policy/ratio_max"]) and math.isnan(totals.maxima["mismatch/logprob_max"])


def test_an_update_that_leaves_non_finite_weights_stops_the_run(tiny_model_path):
    """A finite gradient with an update that overflows (trainer.lr or weight_decay): the check after each
    optimizer step names the step, so no checkpoint, policy/ or adapter/ is written from it."""
    from lightning_agentrl.module import AgentRLModule, NonFiniteGradient
    from lightning_agentrl.settings import load_settings

    module = AgentRLModule(load_settings(overrides=["--trainer.threads=1"]), tiny_model_path)
    module.configure_model()
    module._stop_on_non_finite_weights()  # finite weights: nothing to say
    with torch.no_grad():
        next(module.policy.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteGradient, match="step 0: the optimizer step left non-finite weights"):
        module._stop_on_non_finite_weights()


def test_the_privileged_critic_runs_its_stream_in_chunks_of_whole_segments(tiny_model_path, base):
    """Every segment carries its episode's context, so one micro-batch's critic stream is far longer than the
    micro-batch: it runs in forwards of whole segments of about ``trainer.micro_batch_tokens``, and the head reads
    the same states as one episode at a time."""
    _, batch = base
    contexts = [list(range(10 + i, 40 + i)) for i in range(batch.num_episodes)]  # 30 tokens each
    batch = pack([t.model_copy(update={"critic_context_ids": c}) for t, c in zip(batch.trajectories, contexts,
                                                                                 strict=True)])
    module = AgentRLModule(load_settings(overrides=["--model.value_head=true", "--algorithm.privileged_critic=true",
                                                    "--trainer.micro_batch_tokens=100"]), str(tiny_model_path))
    module.configure_model()
    module.policy.eval()
    lengths = []
    decoder = module.policy.get_decoder()
    original = decoder.forward
    decoder.forward = lambda *args, **kwargs: lengths.append(kwargs["input_ids"].numel()) or original(*args, **kwargs)
    whole = slice(0, batch.num_tokens)  # the whole batch as one micro-batch: 8 episodes, 8 contexts
    with torch.no_grad():
        states = module.critic.hidden(batch, whole, None)
    decoder.forward = original
    assert len(lengths) > 2 and sum(lengths) == batch.critic_input_ids.numel()
    longest_segment = int(torch.bincount(batch.critic_segment_ids).max())
    assert max(lengths) <= max(100, longest_segment)
    for i, trajectory in enumerate(batch.trajectories):
        alone = decoder(input_ids=torch.tensor([contexts[i] + trajectory.segments[0].token_ids])).last_hidden_state[0]
        where = batch.episode_ids == i
        torch.testing.assert_close(states[where], alone[len(contexts[i]):], atol=1e-4, rtol=1e-4)

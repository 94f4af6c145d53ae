"""The privileged critic through ``fit``: the value head reads the environment's ``critic_context`` (the
copy-the-key task's hidden test, which holds the expected answer) through a second forward; the policy's
log-probs never see it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.fitting import SOLVE, learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)


class ExpectedTurnValues(L.Callback):
    """Before each step: the mean turn value the module must log if the value head reads each episode
    with its critic context in front (computed episode by episode, not packed)."""

    def __init__(self) -> None:
        self.expected: list[float] = []
        self.context_lengths: list[int] = []

    @torch.no_grad()
    def on_train_start(self, trainer, pl_module):
        # the head starts at 0 (and value_coef 0 keeps it there): a random head makes the context visible
        generator = torch.Generator().manual_seed(0)
        for parameter in pl_module.value_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        decoder = pl_module.policy.get_decoder()
        values = []
        for trajectory in batch.trajectories:
            (segment,) = trajectory.segments
            context = trajectory.critic_context_ids
            self.context_lengths.append(len(context))
            hidden = decoder(input_ids=torch.tensor([context + segment.token_ids])).last_hidden_state[0]
            head = pl_module.value_head(hidden).squeeze(-1).float()
            values += [head[len(context) + turn.action_start - 1] for turn in segment.turns]
        self.expected.append(float(torch.stack(values).mean()))


def run(tmp_path, *overrides):
    # no gradient clipping: a clip scales the policy's gradient by a norm that counts the value head's
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.value_coef=0", "--trainer.lr=1e-2",
                              "--trainer.grad_clip=1e9",
                              "--trainer.max_steps=3", *overrides)
    expected = ExpectedTurnValues()
    _, log = scripted_fit(settings, {"e0": SOLVE}, callbacks=[expected])
    return log, expected


def test_the_critic_reads_the_hidden_test_and_the_policy_never_does(tmp_path):
    # the privileged critic trains (value_coef 0.5) and the policy still trains exactly as a run whose critic
    # never trains (value_coef 0): no gradient from states that saw the hidden test reaches the shared trunk
    privileged, expected = run(tmp_path / "privileged", "--algorithm.privileged_critic=true", "--algorithm.value_coef=0.5")
    plain, _ = run(tmp_path / "plain")
    assert min(expected.context_lengths) > 10  # every episode carried its hidden test as critic context
    for step, want in zip(privileged.metrics, expected.expected, strict=True):
        assert step["value/mean"] == pytest.approx(want, abs=1e-4)
        assert step["loss/value"] > 0
        assert step["time/critic_forward_s"] > 0
    # the policy trains exactly as without the context: same losses, same gradients, every step
    for a, b in zip(privileged.metrics, plain.metrics, strict=True):
        for key in ("loss/policy", "policy/entropy", "mismatch/logprob_max"):  # grad_norm counts the head too
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        assert b["time/critic_forward_s"] == 0.0
    # while the critic saw something else
    assert all(abs(a["value/mean"] - b["value/mean"]) > 1e-4 for a, b in zip(privileged.metrics, plain.metrics,
                                                                           strict=True))


def test_the_privileged_critic_trains_the_token_level_gae_with_a_group_of_one(tmp_path):
    log, _ = run(tmp_path, "--algorithm.privileged_critic=true", "--algorithm.advantage=gae",
                 "--algorithm.gae_level=token", "--rollout.group_size=1", "--algorithm.value_coef=0.5")
    assert all(step["loss/value"] > 0 and step["policy/grad_norm"] > 0 for step in log.metrics)


def test_a_critic_context_that_is_not_text_is_a_contract_error_naming_the_class():
    from lightning_agentrl.envs.base import EnvContractError, checked_critic_context

    class Env:
        critic_context = ["the answer"]

    with pytest.raises(EnvContractError, match="Env.critic_context must be a str or None"):
        checked_critic_context(Env())
    Env.critic_context = "a\ud800b"
    assert checked_critic_context(Env()) == "a?b"

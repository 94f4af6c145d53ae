"""Paths of the training step that only unit tests reached, now through ``fit``: several PPO updates
per batch, value clipping, stale tokens, GAE and its truncation bootstrap, the KL term, StarPO-S and
GiGPO's similarity mode. Tiny shapes (a 1-layer, 64-wide model), 2 steps each, seconds per run."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_agentrl.algorithms import advantages as adv
from tests.fitting import SOLVE, call, learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)


def test_several_updates_per_batch_move_both_clips_and_count_one_training_step(tmp_path):
    settings = learn_settings(
        tmp_path, "--trainer.ppo_epochs=3", "--trainer.mini_batches=2", "--model.value_head=true",
        "--algorithm.advantage=gae", "--algorithm.value_clip=0.01", "--trainer.lr=1e-2",
    )
    result, log = scripted_fit(settings, {"e0": SOLVE})
    assert result.global_step == 2 and len(log.metrics) == 2  # max_steps counts rollout batches
    checkpoint = torch.load(result.checkpoint, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2
    for step in log.metrics:
        assert step["train/optimizer_updates"] == 6  # 3 epochs x 2 mini-batches
        # the proximal log-probs were recorded before the first update: they still match the engine's
        assert step["mismatch/logprob_max"] < 1e-4
        assert math.isfinite(step["loss/total"]) and math.isfinite(step["loss/value"])
        assert {"value/mean", "value/returns_mean", "value/explained_variance"} <= set(step)
    # updates after the first move the policy and the critic past their clips
    assert max(step["policy/clipfrac"] for step in log.metrics) > 0
    assert max(step["value/clipfrac"] for step in log.metrics) > 0


def test_one_update_per_batch_never_clips(tmp_path):
    """The reference point of the test above: with one update the ratio is 1 and V = V_old."""
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.value_clip=0.01", "--trainer.lr=1e-2")
    _, log = scripted_fit(settings, {"e0": SOLVE})
    for step in log.metrics:
        assert step["train/optimizer_updates"] == 1
        assert step["policy/clipfrac"] == 0 and step["value/clipfrac"] == 0


def test_stale_tokens_take_the_decoupled_path(tmp_path):
    """With max_staleness=1 some batches hold tokens sampled one version ago: those get the
    importance weight proximal/behavior (not 1); batches without stale tokens keep weight 1 exactly.
    Weights reach the engine every other step, so step 1 trains only on tokens of version 0 (all stale)
    whatever the timing: step 0's batch is all lag 0, step 1's all lag 1."""
    settings = learn_settings(tmp_path, "--rollout.max_staleness=1", "--trainer.sync_weights_every=2",
                              "--trainer.max_steps=3", "--trainer.lr=1e-2")
    _, log = scripted_fit(settings, {"e0": SOLVE})
    # max_lag, not tokens_lag_1: a lag absent from a step is not logged, and the log keeps its last value
    stale = [step for step in log.metrics if step["staleness/max_lag"] > 0]
    fresh = [step for step in log.metrics if step["staleness/max_lag"] == 0]
    assert stale, "no batch held a stale token"
    for step in stale:
        assert abs(step["policy/is_weight_mean"] - 1) > 1e-4
    for step in fresh:
        assert step["policy/is_weight_mean"] == 1.0
    # measured on lag-0 tokens only (sampled by the weights of the step that trains them): NaN on a step without any
    lag_zero = [bool((batch.policy_versions == index).any()) for index, batch in enumerate(log.batches)]
    assert lag_zero[:2] == [True, False], lag_zero
    for step, measured in zip(log.metrics, lag_zero, strict=True):
        if measured:
            assert step["mismatch/logprob_max"] < 1e-4
        else:
            assert math.isnan(step["mismatch/logprob_max"]) and math.isnan(step["mismatch/logprob_mean"])


class ExpectedGaeLoss(L.Callback):
    """Before each step: the policy loss the module must log if its advantages are ``gae()``'s on the
    batch, with V from the value head read episode by episode (not packed), with and without the
    critic's bootstrap of truncated episodes."""

    def __init__(self, gamma: float, lam: float) -> None:
        self.gamma, self.lam = gamma, lam
        self.expected: list[tuple[float, float]] = []

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        decoder = pl_module.policy.get_decoder()
        turn_values, last_values = [], []
        for trajectory in batch.trajectories:
            (segment,) = trajectory.segments
            hidden = decoder(input_ids=torch.tensor([segment.token_ids])).last_hidden_state[0]
            values = pl_module.value_head(hidden).squeeze(-1).float()
            turn_values += [values[turn.action_start - 1] for turn in segment.turns]
            last_values.append(values[-1])
        truncated = torch.tensor([t.termination.truncated for t in batch.trajectories])
        losses = []
        for bootstrap in (torch.stack(last_values), None):
            turn_adv, _ = adv.gae(batch.turn_rewards, torch.stack(turn_values), batch.turn_episode, self.gamma, self.lam,
                                  bootstrap_values=bootstrap, truncated=truncated if bootstrap is not None else None)
            token_adv = torch.where(batch.token_turn >= 0, turn_adv[batch.token_turn.clamp(min=0)], 0.0)
            losses.append(float(-(token_adv * batch.loss_mask).sum() / batch.loss_mask.sum()))
        self.expected.append(tuple(losses))


def test_gae_advantages_through_the_module_equal_gae_with_the_critic_bootstrap(tmp_path):
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--rollout.truncation=bootstrap", "--trainer.max_steps=3", "--trainer.lr=1e-2")
    expected = ExpectedGaeLoss(settings.algorithm.gamma, settings.algorithm.gae_lambda)
    _, log = scripted_fit(settings, {"e0": SOLVE}, callbacks=[expected])
    assert len(expected.expected) == 3
    for step, (with_bootstrap, _) in zip(log.metrics, expected.expected, strict=True):
        # one update at lag 0: ratio 1 (to 1e-6), so the policy loss is minus the token-mean advantage
        assert step["loss/policy"] == pytest.approx(with_bootstrap, abs=1e-4)
    # after the critic has trained, the bootstrap of truncated episodes changes the advantages
    assert any(abs(a - b) > 1e-3 for a, b in expected.expected[1:])
    assert any(t.termination.truncated for batch in log.batches for t in batch.trajectories)


class KlToReference(L.Callback):
    """Perturbs the policy away from the reference before training; after each step, the exact
    KL(pi_ref || pi) (full softmax) at the action positions of the first batch, a fixed probe."""

    def __init__(self) -> None:
        self.kl: list[float] = []
        self.probe = None

    @torch.no_grad()
    def on_train_start(self, trainer, pl_module):
        generator = torch.Generator().manual_seed(0)
        for parameter in pl_module.policy.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))

    @torch.no_grad()
    def measure(self, pl_module) -> float:
        total, count = 0.0, 0
        for ids, mask in self.probe:
            policy = torch.log_softmax(pl_module.policy(ids).logits[0].float(), -1)
            reference = torch.log_softmax(pl_module.reference(ids).logits[0].float(), -1)
            kl = (reference.exp() * (reference - policy)).sum(-1)  # KL(pi_ref || pi): what k3's gradient lowers
            at = mask[1:].nonzero().squeeze(-1)  # logits at t-1 predict token t
            total, count = total + float(kl[at].sum()), count + at.numel()
        return total / count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.probe is None:
            self.probe = [(torch.tensor([t.segments[0].token_ids]), torch.tensor(t.segments[0].loss_mask))
                          for t in batch.trajectories]
            self.kl.append(self.measure(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.kl.append(self.measure(pl_module))


def test_kl_pulls_a_perturbed_policy_back_to_the_reference(tmp_path):
    """No episode succeeds, so every advantage is 0: the KL term is the only gradient. Dropping it
    leaves the policy where it is; flipping its sign pushes it away."""
    settings = learn_settings(tmp_path, "--algorithm.kl_coef=1.0", "--trainer.max_steps=3", "--trainer.lr=1e-4")
    probe = KlToReference()
    _, log = scripted_fit(settings, None, callbacks=[probe])
    assert all(step["loss/kl"] > 0 for step in log.metrics)
    assert len(probe.kl) == 4
    assert all(after < before for before, after in zip(probe.kl, probe.kl[1:], strict=False)), probe.kl
    assert probe.kl[-1] < probe.kl[0] * 0.998, probe.kl


def test_starpo_keeps_the_groups_with_reward_variance_and_counts_the_rest(tmp_path):
    settings = learn_settings(tmp_path, "--algorithm.starpo_keep_fraction=0.5")
    # one success in the first group of each step (groups 0 and 2): the other group has std 0
    _, log = scripted_fit(settings, {"g0-e0": SOLVE, "g2-e0": SOLVE})
    for batch, step in zip(log.batches, log.metrics, strict=True):
        assert step["filter/starpo_groups_dropped"] == 1
        kept = {int(g) for g in batch.group_ids[batch.include]}
        assert kept == {int(batch.group_ids.min())}  # the group with the success
        expected_tokens = float(batch.loss_mask[batch.include[batch.episode_ids]].sum())
        assert step["tokens/train"] == expected_tokens < float(batch.loss_mask.sum())
        assert step["reward/mean"] == pytest.approx(1 / 4)  # every episode counts in the reward metrics


def test_gigpo_similarity_merges_near_identical_states(tmp_path):
    """Two episodes per group write answers differing in one character: their second turns start
    from near-identical states. Exact keys see 3 anchor states per group, similarity 0.9 sees 2."""
    script = {"e0": [call("write_file", path="answer.txt", content="abcdefgh1"), call("submit")],
              "e1": [call("write_file", path="answer.txt", content="abcdefgh2"), call("submit")]}
    counts = {}
    for similarity in (None, 0.9):
        run = tmp_path / str(similarity)
        extra = [] if similarity is None else [f"--algorithm.gigpo_similarity={similarity}"]
        settings = learn_settings(run, "--algorithm.advantage=gigpo", "--trainer.max_steps=1", *extra)
        _, log = scripted_fit(settings, script)
        counts[similarity] = log.metrics[0]["gigpo/num_anchor_groups"]
    assert counts == {None: 6.0, 0.9: 4.0}


class FirstUpdate(L.Callback):
    """The optimizer's ``eps`` and the largest change of any policy weight in the first training step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self.before = [p.detach().clone() for p in pl_module.policy.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.eps = trainer.optimizers[0].param_groups[0]["eps"]
            self.change = max(float((p.detach() - b).abs().max())
                              for p, b in zip(pl_module.policy.parameters(), self.before, strict=True))


@pytest.mark.parametrize("eps", [None, 1.0])
def test_adam_eps_reaches_the_optimizer_and_damps_small_gradients(tmp_path, eps):
    """Adam's first step moves each weight by lr x g / (|g| + eps): about lr with the default 1e-8, far less
    than lr when eps is above every gradient (1.0 here; the tiny model's gradients are well below it)."""
    first = FirstUpdate()
    overrides = [] if eps is None else [f"--trainer.adam_eps={eps}"]
    scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=1", *overrides), {"e0": SOLVE}, callbacks=[first])
    lr = 1e-3  # learn_settings'
    if eps is None:
        assert first.eps == 1e-8 and 0.9 * lr < first.change <= 1.01 * lr
    else:
        assert first.eps == eps and 0 < first.change < 0.1 * lr


class OptimizerValues(L.Callback):
    """The optimizer's lr, eps and weight decay as each training step starts, by global step."""

    def __init__(self) -> None:
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        group = trainer.optimizers[0].param_groups[0]
        self.seen[trainer.global_step] = (group["lr"], group["eps"], group["weight_decay"])


def test_a_resume_trains_with_its_own_lr_eps_and_weight_decay_from_where_the_warmup_stood(tmp_path, caplog):
    """The checkpoint restores Adam's moments and the schedule's position, not the settings: resumed with a
    new lr, eps and weight decay after 2 of 4 warmup steps, step 3 runs at 3/4 of the new lr (7.5e-6, not
    7.5e-4 from the checkpoint's lr), with the new eps and weight decay, and the log names each change."""
    warmup = "--trainer.warmup_steps=4"
    scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=2", warmup), {"e0": SOLVE})
    values = OptimizerValues()
    with caplog.at_level("INFO"):
        scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=4", warmup, "--run.resume=last", "--trainer.lr=1e-5",
                                    "--trainer.adam_eps=1e-6", "--trainer.weight_decay=0.01"),
                     {"e0": SOLVE}, callbacks=[values])
    assert list(values.seen) == [2, 3]
    for step, lr in ((2, 7.5e-6), (3, 1e-5)):  # the schedule goes on from the new lr, not the checkpoint's
        assert values.seen[step][0] == pytest.approx(lr, rel=1e-9) and values.seen[step][1:] == (1e-6, 0.01), values.seen
    for change in ("trainer.lr: the checkpoint's optimizer had [0.001]; this run uses 1e-05",
                   "this step's lr (trainer.lr and warmup_steps): the checkpoint's optimizer had [0.00075]; this run "
                   "uses 7.5e-06",
                   "trainer.adam_eps: the checkpoint's optimizer had [1e-08]; this run uses 1e-06",
                   "trainer.weight_decay: the checkpoint's optimizer had [0.0]; this run uses 0.01"):
        assert change in caplog.text


class HeadAndPolicyUpdates(L.Callback):
    """The largest change of any value-head weight and of any policy weight in each training step, and the
    optimizer's learning rates as each step starts."""

    def __init__(self) -> None:
        self.head, self.policy, self.lrs = {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = [[p.detach().clone() for p in m.parameters()] for m in (pl_module.value_head, pl_module.policy)]
        self.lrs[trainer.global_step] = [group["lr"] for group in trainer.optimizers[0].param_groups]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        head, policy = ([float((p.detach() - b).abs().max()) for p, b in zip(m.parameters(), before, strict=True)]
                        for m, before in zip((pl_module.value_head, pl_module.policy), self.before, strict=True))
        self.head[trainer.global_step - 1], self.policy[trainer.global_step - 1] = max(head), max(policy)


@pytest.mark.parametrize("value_lr", [None, 0.05])
def test_the_value_head_trains_at_its_own_learning_rate(tmp_path, value_lr):
    """Adam's first step moves each weight by about its group's lr: the value head by trainer.value_lr (0.05),
    the policy by trainer.lr (1e-3); without value_lr the head moves at lr like the rest."""
    updates = HeadAndPolicyUpdates()
    overrides = [] if value_lr is None else [f"--trainer.value_lr={value_lr}"]
    _, log = scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=1", "--model.value_head=true",
                                         "--algorithm.advantage=gae", *overrides), {"e0": SOLVE}, callbacks=[updates])
    lr = 1e-3  # learn_settings'
    head_lr = value_lr or lr
    assert updates.lrs[0] == ([lr] if value_lr is None else [lr, value_lr])
    assert log.metrics[0]["policy/lr"] == pytest.approx(lr)  # logged as float32
    assert (log.metrics[0].get("value/lr") is None) if value_lr is None else log.metrics[0]["value/lr"] == pytest.approx(value_lr)
    assert 0.9 * head_lr < updates.head[0] <= 1.01 * head_lr, updates.head
    assert 0.5 * lr < updates.policy[0] <= 1.01 * lr, updates.policy


def test_a_resume_may_change_the_value_lr_but_not_whether_there_is_one(tmp_path, caplog):
    """The value head's own group is in the checkpoint's optimizer state: a resume runs at the new value_lr
    (and says so), and refuses to add or drop the group before any work starts."""
    from lightning_agentrl.settings import SettingsError
    from lightning_agentrl.train import fit

    critic = ("--model.value_head=true", "--algorithm.advantage=gae")
    scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=1", *critic, "--trainer.value_lr=0.05"), {"e0": SOLVE})
    updates = HeadAndPolicyUpdates()
    with caplog.at_level("INFO"):
        scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=2", *critic, "--trainer.value_lr=0.02",
                                    "--run.resume=last"), {"e0": SOLVE}, callbacks=[updates])
    assert updates.lrs == {1: [1e-3, 0.02]}
    assert 0.9 * 0.02 < updates.head[1] <= 1.01 * 0.02, updates.head  # Adam's second step: about lr, at most
    assert "trainer.value_lr: the checkpoint's optimizer had [0.05]; this run uses 0.02" in caplog.text
    with pytest.raises(SettingsError, match=r"trainer.value_lr: the run in .* ran with 0.02, this resume asks for None"):
        fit(learn_settings(tmp_path, "--trainer.max_steps=3", *critic, "--run.resume=last"))


def test_a_resume_that_changes_the_sampling_distribution_is_refused_before_it_starts(tmp_path):
    """Episodes restored from the checkpoint carry log-probs of the distribution they were sampled from; a
    resume with another would weight them wrongly. The run's settings file may predate `engine.logprobs`
    (it then ran with the default). Under the softmax rule the filters change what is sampled but not the
    log-probs recorded, so a softmax run may change them."""
    from lightning_agentrl.resume import check_resume_keeps
    from lightning_agentrl.settings import SettingsError
    from lightning_agentrl.train import fit

    scripted_fit(learn_settings(tmp_path, "--trainer.max_steps=1"), {"e0": SOLVE})
    settings_file = tmp_path / "run" / "settings.yaml"
    written = settings_file.read_text()
    assert "logprobs: sampler" in written
    settings_file.write_text(written.replace("  logprobs: sampler\n", ""))
    for override, old, new in (("--engine.temperature=0.7", "1.0", "0.7"), ("--engine.top_p=0.9", "1.0", "0.9"),
                               ("--engine.top_k=5", "0", "5"), ("--engine.logprobs=softmax", "'sampler'", "'softmax'")):
        field = override[2:].split("=")[0]
        message = f"{field}: the run in .* ran with {old}, this resume asks for {new}; a resume keeps the sampling"
        with pytest.raises(SettingsError, match=message):
            fit(learn_settings(tmp_path, "--trainer.max_steps=2", "--run.resume=last", override))
    settings_file.write_text(written.replace("logprobs: sampler", "logprobs: softmax"))
    for override in ("--engine.top_p=0.9", "--engine.top_k=5"):
        check_resume_keeps(learn_settings(tmp_path, "--run.resume=last", "--engine.logprobs=softmax", override),
                           tmp_path / "run")
    with pytest.raises(SettingsError, match="engine.temperature: the run"):
        check_resume_keeps(learn_settings(tmp_path, "--run.resume=last", "--engine.logprobs=softmax",
                                          "--engine.temperature=0.7"), tmp_path / "run")


class ExpectedTokenGaeLoss(L.Callback):
    """Before each step: the policy loss the module must log if its advantages are token-level GAE,
    computed episode by episode (not packed) with verl's multi-turn recursion: V before every action
    token from the value head, rewards at the end of each turn's action, observations skipped."""

    def __init__(self, gamma: float, lam: float, *, bootstrap: bool = False) -> None:
        self.gamma, self.lam, self.bootstrap = gamma, lam, bootstrap
        self.expected: list[float] = []
        self.without_bootstrap: list[float] = []

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.expected.append(self.loss(pl_module, batch, bootstrap=self.bootstrap))
        self.without_bootstrap.append(self.loss(pl_module, batch, bootstrap=False))

    def loss(self, pl_module, batch, *, bootstrap: bool) -> float:
        from tests.algorithms.test_token_gae import verl_gae

        decoder = pl_module.policy.get_decoder()
        total, count = 0.0, 0
        turn = 0
        for trajectory in batch.trajectories:
            (segment,) = trajectory.segments
            ids = torch.tensor([segment.token_ids])
            values = pl_module.value_head(decoder(input_ids=ids).last_hidden_state[0]).squeeze(-1).double()
            mask = torch.tensor(segment.loss_mask, dtype=torch.float64)
            mask[0] = 0.0  # nothing predicts the first token
            rewards = torch.zeros_like(mask)
            for t in segment.turns:
                rewards[t.action_end - 1] = float(batch.turn_rewards[turn])
                turn += 1
            # V before token t is read at t - 1; the episode's last step sees V = 0 after it, or with the
            # bootstrap a truncated episode sees V at its last token
            before = torch.cat([values.new_zeros(1), values[:-1]])
            last = values[-1:] if bootstrap and trajectory.termination.truncated else None
            advantages, _ = verl_gae(rewards[None], before[None], mask[None], self.gamma, self.lam, last_values=last)
            total += float((advantages[0] * mask).sum())
            count += int(mask.sum())
        return -total / count


def test_token_level_gae_through_the_module_equals_verls_recursion_episode_by_episode(tmp_path):
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.gae_level=token", "--trainer.max_steps=3", "--trainer.lr=1e-2",
                              "--algorithm.gamma=0.9", "--algorithm.gae_lambda=0.8")
    expected = ExpectedTokenGaeLoss(settings.algorithm.gamma, settings.algorithm.gae_lambda)
    _, log = scripted_fit(settings, {"e0": SOLVE}, callbacks=[expected])
    assert len(expected.expected) == 3
    for step, want in zip(log.metrics, expected.expected, strict=True):
        # one update at lag 0: ratio 1, so the policy loss is minus the token-mean advantage
        assert step["loss/policy"] == pytest.approx(want, abs=1e-4)
        assert math.isfinite(step["loss/value"]) and step["loss/value"] > 0
    assert all(abs(want) > 1e-3 for want in expected.expected)  # the critic's values make advantages non-zero


def test_token_level_gae_bootstraps_truncated_episodes_from_the_value_at_their_last_token(tmp_path):
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.gae_level=token", "--rollout.truncation=bootstrap", "--trainer.max_steps=3",
                              "--trainer.lr=1e-2", "--algorithm.gamma=0.9", "--algorithm.gae_lambda=0.8")
    expected = ExpectedTokenGaeLoss(settings.algorithm.gamma, settings.algorithm.gae_lambda, bootstrap=True)
    _, log = scripted_fit(settings, {"e0": SOLVE}, callbacks=[expected])
    assert len(expected.expected) == 3
    for step, want in zip(log.metrics, expected.expected, strict=True):
        assert step["loss/policy"] == pytest.approx(want, abs=1e-4)  # one update at lag 0: ratio 1
    assert any(t.termination.truncated for batch in log.batches for t in batch.trajectories)
    # the bootstrap changes the advantages: without it the loss would differ
    assert any(abs(a - b) > 1e-3 for a, b in zip(expected.expected, expected.without_bootstrap, strict=True))


def test_token_level_gae_over_several_updates_reads_old_values_at_every_trained_token(tmp_path):
    """Two epochs a step: the value loss clips against the old values recorded before the first update (NaN
    until recorded), so a trained token without one would make the loss NaN."""
    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.gae_level=token", "--rollout.truncation=bootstrap", "--trainer.max_steps=2",
                              "--trainer.ppo_epochs=2", "--trainer.lr=1e-2")
    _, log = scripted_fit(settings, {"e0": SOLVE})
    assert len(log.metrics) == 2
    for step in log.metrics:
        assert math.isfinite(step["loss/value"]) and step["loss/value"] > 0
        assert math.isfinite(step["loss/policy"])


def test_a_group_of_one_trains_with_the_token_critic_and_is_refused_for_group_baselines(tmp_path):
    from lightning_agentrl.settings import SettingsError

    settings = learn_settings(tmp_path, "--model.value_head=true", "--algorithm.advantage=gae",
                              "--algorithm.gae_level=token", "--rollout.group_size=1", "--trainer.lr=1e-2")
    result, log = scripted_fit(settings, {"e0": SOLVE})
    assert result.global_step == 2
    for batch, step in zip(log.batches, log.metrics, strict=True):
        assert batch.num_episodes == 2 and len(set(batch.group_ids.tolist())) == 2
        assert step["policy/grad_norm"] > 0  # the critic's baseline gives a signal without a group
    with pytest.raises(SettingsError, match="rollout.group_size=1 leaves algorithm.advantage=grpo without a baseline"):
        learn_settings(tmp_path, "--rollout.group_size=1")

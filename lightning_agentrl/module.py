"""AgentRLModule: the policy, the credit assignment and the loss of one training step.

One training step consumes one :class:`RolloutBatch` (whole groups). It computes advantages over
the episodes that callbacks left included (excluded ones leave the group baseline too), then takes
``trainer.ppo_epochs x trainer.mini_batches`` optimizer updates (PPO's epochs over mini-batches of
whole groups; 1 x 1 by default). Each update splits its mini-batch's packed tokens into
micro-batches of about ``trainer.micro_batch_tokens`` tokens (whole episodes, so per-sequence
aggregation stays exact), accumulates gradients with the mini-batch's global denominators (the
loss equals the loss of the whole mini-batch in one pass), clips and steps.

With more than one update per batch, the log-probs of the weights the step started from (the
proximal policy of decoupled PPO) and the critic's values (the old values of value clipping, and
the values GAE is computed from) are recorded once, before the first update, without gradients.
With one update they are the current weights' own outputs, detached: the same numbers, no extra pass.

Counters: a training step is one rollout batch. Lightning counts an optimizer step each time the
module's ``LightningOptimizer.step`` runs, so the step calls it once, for its last update; the
updates before it go through the strategy's ``optimizer_step`` (the same path, DeepSpeed's engine
step included, without the count). ``global_step`` (the policy version), ``max_steps``,
checkpoints, weight syncs and the learning-rate schedule all advance once per batch; the updates
are logged as ``train/optimizer_updates``.

Log-probs are computed on packed sequences (positions restart per segment, each segment
attending only to itself) and only at positions that carry a loss, chunk by chunk, so the
[tokens, vocab] logits are never materialized for the whole batch.

This module is the step's outline and the Lightning hooks; the parts live beside it: the forward
passes in ``policy.py``, the value head's arithmetic in ``critic.py``, the index arithmetic of
mini- and micro-batches in ``batching.py``, the step's metrics in ``step_metrics.py``, and the
loss itself in ``algorithms/``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl import batching
from lightning_agentrl.algorithms import importance, losses
from lightning_agentrl.algorithms.estimators import ESTIMATORS
from lightning_agentrl.critic import Critic, OldValues, new_value_head
from lightning_agentrl.distributed import global_max, global_sum, world_size
from lightning_agentrl.envs.registry import settings_env_class
from lightning_agentrl.lora import base_fingerprint, check_lora_checkpoint, keep_adapters
from lightning_agentrl.policy import (
    OutputLogprobs,
    hidden_states,
    kl_reference,
    load_policy,
    load_reference,
    token_logprobs_at,
    zero3_loading_context,
)
from lightning_agentrl.settings import Settings
from lightning_agentrl.shutdown import RunStopped
from lightning_agentrl.step_metrics import StepTotals, mean_over_updates
from lightning_agentrl.trajectory import RolloutBatch


class NonFiniteGradient(RunStopped):
    """The gradient norm was NaN or infinite: the run stops rather than train on it."""

    exit_status = 3


class AgentRLModule(L.LightningModule):
    def __init__(self, settings: Settings, model_path: str) -> None:
        super().__init__()
        self.settings = settings
        self.model_path = model_path
        self.policy = None
        self.value_head: torch.nn.Linear | None = None
        self.reference = None
        self.loss_fn = losses.MicroBatchLoss.from_settings(settings.algorithm)
        self.automatic_optimization = False
        self.offline_policy_version = 0
        self.importance_measured = False  # whether a step of this process has logged `importance/*`
        self.last_step_skipped: bool = False  # the last batch had no trainable token: no optimizer step (callbacks read it)
        self.learning_signal = True  # the last batch had a nonzero advantage (callbacks/learning_signal.py)
        self.num_skipped_steps = 0
        self._fingerprint: str | None = None  # the LoRA base's (lightning_agentrl/lora.py), read once
        self.optimizer_s = 0.0  # seconds in optimizer updates (clip, step, zero), summed over the run (stage timings)
        # a LoRA checkpoint holds the trainable tensors only (on_save_checkpoint); on_load_checkpoint checks them
        self.strict_loading = not settings.model.lora
        # kept in checkpoints; the resolved settings reach MLflow once, flattened, from train.py
        self.save_hyperparameters({"settings": settings.model_dump(mode="json"), "model_path": model_path}, logger=False)

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        zero3 = zero3_loading_context(self._trainer)  # noqa: F841 - alive while the models load
        self.policy = load_policy(self.model_path, self.settings.model, seed=self.settings.run.seed)
        if self.settings.model.value_head:
            self.value_head = new_value_head(self.policy, getattr(torch, self.settings.model.dtype))
        if self.settings.algorithm.kl_coef > 0 and not self.settings.model.lora:  # LoRA: the base, adapters off
            self.reference = load_reference(self.model_path, self.settings.model)
        self.policy_logprobs = OutputLogprobs(self.policy)
        self.reference_logprobs = OutputLogprobs(self.reference) if self.reference is not None else None

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # RNG streams, so a resumed run draws what the uninterrupted one would have
        import random

        import numpy as np

        kind, keys, position, has_gauss, cached = np.random.get_state()
        # plain types and tensors only: checkpoints load with torch.load(weights_only=True)
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)],
        }

        if self.settings.model.lora:  # the frozen base comes from model.path, not from the checkpoint
            keep_adapters(checkpoint, self, self._base_fingerprint())

    def _base_fingerprint(self) -> str:
        """The base's fingerprint (lightning_agentrl/lora.py), taken once: it reads ~1 MiB per weight file."""
        if self._fingerprint is None:
            self._fingerprint = base_fingerprint(self.model_path)
        return self._fingerprint

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        import random

        import numpy as np

        if self.settings.model.lora:
            check_lora_checkpoint(checkpoint, self, self.model_path)

        state = checkpoint.get("rng")
        if state is None:
            return
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        kind, keys, position, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))

    @override
    def on_train_start(self) -> None:
        """The optimizer runs with this run's settings: a resume restores Adam's moments and the
        schedule's position from the checkpoint, but `trainer.lr`, `adam_eps`, `weight_decay` and
        `warmup_steps` from the settings it was started with, and says which changed."""
        from lightning.pytorch.utilities import rank_zero_info

        t, scheduler = self.settings.trainer, self.lr_schedulers()
        groups = self.trainer.optimizers[0].param_groups
        at = scheduler.lr_lambdas[0](scheduler.last_epoch)  # where the schedule stands now
        # the policy's group, then the value head's with trainer.value_lr (configure_optimizers)
        bases = [(t.lr, "trainer.lr"), (t.value_lr, "trainer.value_lr")][:len(groups)]
        for group, (base, name) in zip(groups, bases, strict=True):
            wanted = {"initial_lr": base, "lr": base * at, "eps": t.adam_eps, "weight_decay": t.weight_decay}
            names = {"initial_lr": name, "lr": f"this step's lr ({name} and warmup_steps)",
                     "eps": "trainer.adam_eps", "weight_decay": "trainer.weight_decay"}
            for key, value in wanted.items():
                if group.get(key) != value:
                    rank_zero_info(f"{names[key]}: the checkpoint's optimizer had [{group.get(key)}]; "
                                   f"this run uses {value:g} (its settings)")
                group[key] = value
        scheduler.base_lrs = [group["initial_lr"] for group in groups]
        scheduler._last_lr = [group["lr"] for group in groups]

    @override
    def configure_optimizers(self):
        t = self.settings.trainer
        head = [] if t.value_lr is None else [p for p in self.value_head.parameters() if p.requires_grad]
        ids = {id(p) for p in head}
        params = [{"params": [p for p in self.parameters() if p.requires_grad and id(p) not in ids]}]
        if head:  # trainer.value_lr: the critic's head in a group of its own, at its own learning rate
            params.append({"params": head, "lr": t.value_lr})
        if t.offload_optimizer:
            # ZeRO's optimizer offload steps on the CPU with DeepSpeed's own (vectorized) Adam; it
            # refuses torch's. Same AdamW update rule (decoupled weight decay).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(params, lr=t.lr, eps=t.adam_eps, weight_decay=t.weight_decay, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(params, lr=t.lr, eps=t.adam_eps, weight_decay=t.weight_decay)
        warmup = max(t.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if isinstance(batch, RolloutBatch):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # -- credit ------------------------------------------------------------------------------
    def episode_advantages(self, batch: RolloutBatch, train_mask: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        """Group-based advantages per token [N] over the included episodes (excluded ones get 0 and
        leave the baseline). None for ``gae``, which is computed per micro-batch from the critic."""
        a = self.settings.algorithm
        similarity = settings_env_class(self.settings.env).state_similarity  # the environment's own, or None
        token_turn = batching.token_turns(batch, loss_mask=a.loss_mask)
        return ESTIMATORS[a.advantage](batch, train_mask, token_turn, a, similarity)

    def train_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """Where the loss goes: the action tokens; with ``loss_mask: false`` (an ablation) also the
        observations and scaffolding after the first action of each segment."""
        return batching.loss_region(batch, loss_mask=self.settings.algorithm.loss_mask)

    # -- forward -----------------------------------------------------------------------------
    def token_logprobs_at(self, model, hidden, input_ids, targets_at) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of ``input_ids[targets_at]`` under ``model`` (the policy or the reference)."""
        head = self.policy_logprobs if model is self.policy else self.reference_logprobs
        return token_logprobs_at(head, hidden, input_ids, targets_at, engine=self.settings.engine,
                                 chunk_size=self.settings.trainer.logprob_chunk_tokens)

    # -- the step ----------------------------------------------------------------------------
    @property
    def num_updates_per_step(self) -> int:
        return self.settings.trainer.ppo_epochs * self.settings.trainer.mini_batches

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        t = self.settings.trainer
        spans = batching.mini_batches(batch, t.mini_batches)
        train_mask = self.train_mask(batch)
        span_tokens = global_sum(*(float(train_mask[span].sum()) for span in spans))  # every rank agrees
        self.last_step_skipped = sum(span_tokens) == 0
        self.learning_signal = False
        if self.last_step_skipped:
            return self._skip_step(batch)
        prepared = self.prepare(batch, train_mask, record_old=self.num_updates_per_step > 1)
        self.learning_signal = prepared.signal
        # mini-batches without a trainable token (all their groups excluded) take no update
        spans = [span for span, tokens in zip(spans, span_tokens, strict=True) if tokens > 0]
        updates = [span for _ in range(t.ppo_epochs) for span in spans]
        logs = []
        for index, span in enumerate(updates):
            if prepared.zero_gradient:
                log = self._zero_gradient(batch, prepared)
            else:
                log = self.accumulate_gradients(batch, prepared=prepared, span=span)
            log["policy/grad_norm"] = self._optimizer_update(counted=index == len(updates) - 1)
            logs.append(log)
        scheduler = self.lr_schedulers()
        scheduler.step()  # once per training step: warmup_steps counts rollout batches
        log = {**prepared.log, **mean_over_updates(logs)}
        self.importance_measured |= importance.METRIC_KEYS[0] in log
        if self.importance_measured:  # a later step without weights logs NaN, not the last value the logger kept
            log = {**dict.fromkeys(importance.METRIC_KEYS, math.nan), **log}
        log["tokens/train"] = sum(span_tokens)
        log["train/optimizer_updates"] = float(len(updates))
        log["policy/lr"] = scheduler.get_last_lr()[0]
        if len(scheduler.get_last_lr()) > 1:  # trainer.value_lr: the value head's group
            log["value/lr"] = scheduler.get_last_lr()[1]
        self.log_dict(log, on_step=True, prog_bar=False, batch_size=batch.num_episodes)
        self.log("loss", log["loss/total"], prog_bar=True, batch_size=batch.num_episodes)
        return torch.tensor(log["loss/total"])

    def _optimizer_update(self, *, counted: bool) -> float:
        """Clip and step on the accumulated gradients, zero them; the global gradient norm before
        clipping. ``counted``: through the ``LightningOptimizer``, which advances ``global_step``."""
        started = time.perf_counter()
        optimizer = self.optimizers()
        engine = self._deepspeed_engine()
        grad_norm = None
        if engine is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters(), self.settings.trainer.grad_clip))
            self._stop_on_non_finite(grad_norm, stepped=False)
        if counted:
            optimizer.step()
        else:
            self.trainer.strategy.optimizer_step(optimizer.optimizer, closure=lambda: None)
        if engine is not None:  # ZeRO partitions the gradients: DeepSpeed clips (config) and reports the norm
            grad_norm = float(engine.get_global_grad_norm() or 0.0)
            self._stop_on_non_finite(grad_norm, stepped=True)
        self._stop_on_non_finite_weights()
        optimizer.zero_grad(set_to_none=True)
        self.optimizer_s += time.perf_counter() - started
        return grad_norm

    @property
    def _loss_scaled(self) -> bool:
        """Float16 mixed precision: its loss scaler skips steps with non-finite gradients itself."""
        return self.settings.trainer.precision in ("16-mixed", "transformer-engine-float16")

    def _stop_on_non_finite(self, grad_norm: float, *, stepped: bool) -> None:
        """A NaN or infinite gradient norm stops the run (exit 3) before anything is saved from it: an optimizer step
        on it would leave NaN weights that every later step, checkpoint and export keeps. Every rank sees the same
        global norm, so all stop together. Float16 mixed precision is left to its loss scaler, which skips such
        steps itself."""
        if math.isfinite(grad_norm) or self._loss_scaled:
            return
        self.optimizers().zero_grad(set_to_none=True)
        taken = "the optimizer step was taken (DeepSpeed reports the norm after it)" if stepped else "no optimizer step"
        raise NonFiniteGradient(
            f"step {self.global_step}: the gradient norm is {grad_norm} ({taken}); nothing from this step is saved, "
            "the last checkpoint holds the weights before it. Usual causes: trainer.lr or, under LoRA, "
            "model.lora_alpha / model.lora_rank too large; a reward or advantage that is not finite"
        )

    def _stop_on_non_finite_weights(self) -> None:
        """A finite gradient can still give non-finite weights (a learning rate or weight decay that overflows the
        update): the run stops before any checkpoint, ``policy/`` or ``adapter/`` holds them. Checks this rank's
        trainable tensors (its partitions under ZeRO-3) and agrees over ranks."""
        local = [getattr(p, "ds_tensor", p) for p in self.parameters() if p.requires_grad]  # ZeRO-3: the partition
        bad = any(not bool(torch.isfinite(t).all()) for t in local if t.numel())
        if global_max(float(bad)) and not self._loss_scaled:
            raise NonFiniteGradient(
                f"step {self.global_step}: the optimizer step left non-finite weights; nothing from this step is saved, "
                "the last checkpoint holds the weights before it. Usual causes: trainer.lr or trainer.weight_decay too "
                "large"
            )

    def _skip_step(self, batch: RolloutBatch) -> torch.Tensor:
        """No trainable token in the whole step (every episode excluded): an optimizer step would only
        decay the weights and advance the schedule on nothing, so neither steps."""
        from lightning.pytorch.utilities import rank_zero_warn

        self.optimizers().zero_grad(set_to_none=True)
        reasons = sorted({t.termination.value for t in batch.trajectories if t.termination is not None})
        self.num_skipped_steps += 1
        rank_zero_warn(
            f"step {self.global_step} (skipped batch {self.num_skipped_steps}): no trainable token, every episode "
            f"was excluded (they ended as {', '.join(reasons)}); no optimizer or scheduler step"
        )
        self.log_dict({"policy/skipped_step": 1.0, "tokens/train": 0.0}, on_step=True, batch_size=batch.num_episodes)
        return torch.tensor(0.0)

    def _policy_version(self) -> int:
        """Training steps behind the current weights (``offline_policy_version`` outside a Trainer)."""
        return self.global_step if self._trainer is not None else self.offline_policy_version

    def _deepspeed_engine(self):
        if self._trainer is None:
            return None
        model = self.trainer.strategy.model
        return model if type(model).__name__ == "DeepSpeedEngine" else None

    def _backward(self, loss: torch.Tensor, last: bool = True) -> None:
        if self._trainer is None:  # used outside a Trainer (tests, notebooks)
            loss.backward()
            return
        engine = self._deepspeed_engine()
        if engine is not None:
            # An update's micro-batches vary in number: tell ZeRO which backward ends the accumulation.
            engine.set_gradient_accumulation_boundary(last)
        self.manual_backward(loss)

    def prepare(self, batch: RolloutBatch, train_mask: torch.Tensor, *, record_old: bool) -> _Prepared:
        """What every update of the step shares: the loss region, the group-based advantages and,
        with ``record_old``, the proximal log-probs and old values of the weights the step starts from."""
        token_adv, log = self.episode_advantages(batch, train_mask)
        prepared = _Prepared(train_mask=train_mask, token_adv=token_adv, log=log)
        prepared.signal = self._has_learning_signal(batch, prepared)
        # every advantage 0 and no other term in the loss: the gradient is exactly 0 without computing it
        only_advantages = self.value_head is None and self.settings.algorithm.kl_coef == 0
        prepared.zero_gradient = not prepared.signal and only_advantages and self.settings.algorithm.entropy_coef == 0
        if record_old and not prepared.zero_gradient:
            with torch.no_grad():
                self._record_old_outputs(batch, prepared)
        return prepared

    def _has_learning_signal(self, batch: RolloutBatch, prepared: _Prepared) -> bool:
        """Whether any trainable token of any rank has a nonzero advantage. ``gae`` (advantages from the
        critic, per micro-batch): whether any reward of an included episode differs from the others."""
        if prepared.token_adv is not None:
            (nonzero,) = global_sum(float(((prepared.token_adv != 0) & (prepared.train_mask > 0)).sum()))
            return nonzero > 0
        kept = batch.include[batch.turn_episode]
        rewards = torch.cat([batch.rewards[batch.include].float(), batch.turn_rewards[kept].float()])
        highest = float(rewards.max()) if rewards.numel() else float("-inf")
        lowest = float(rewards.min()) if rewards.numel() else float("inf")
        return global_max(highest) + global_max(-lowest) > 0  # the highest minus the lowest, over ranks

    def _zero_gradient(self, batch: RolloutBatch, prepared: _Prepared) -> dict[str, float]:
        """An update whose gradient is exactly 0 (every advantage 0, no KL, entropy or value term), without
        the forward and backward passes over the batch: one zero loss through every parameter (a collective
        backward, like every rank's) gives the optimizer the zero gradient it would have got. The entropy and
        the train/inference mismatch are measured on the first micro-batch alone, without gradients."""
        totals = StepTotals()
        micro = batching.trained_micro_batches(batch, prepared.train_mask, slice(0, batch.num_tokens),
                                               self.settings.trainer.micro_batch_tokens)
        with torch.no_grad():  # one forward on every rank (ZeRO-3 gathers the weights in each)
            if micro:
                self._sample_diagnostics(batch, micro[0], prepared.train_mask[micro[0]], totals)
            else:
                self._zero_loss(batch)
        self._backward(self._zero_loss(batch), last=True)
        return {**prepared.log, **totals.reduced(), "loss/total": 0.0, "loss/policy": 0.0}

    def _sample_diagnostics(self, batch: RolloutBatch, sl: slice, mask: torch.Tensor, totals: StepTotals) -> None:
        """The entropy and the train/inference mismatch of one micro-batch, from a forward without gradients."""
        targets_at = batching.targets_at(mask)
        input_ids = batch.input_ids[sl]
        hidden = hidden_states(self.policy, input_ids, batch.position_ids[sl], batch.segment_ids[sl])
        logprobs, entropy = self.token_logprobs_at(self.policy, hidden, input_ids, targets_at)
        totals.add("weight", float(targets_at.numel()))
        if entropy is not None:
            totals.add("policy/entropy", float(entropy.sum()))
        lag = (self._policy_version() - batch.policy_versions[sl]).clamp(min=0)
        totals.add_mismatch(logprobs.float(), batch.behavior_logprobs[sl][targets_at], lag[targets_at] == 0,
                            batch.loss_mask[sl][targets_at] > 0)

    def _record_old_outputs(self, batch: RolloutBatch, prepared: _Prepared) -> None:
        """One forward pass over the batch without gradients: log-probs at every trainable token
        (NaN elsewhere), the critic's value of every turn and its bootstrap value of every episode.
        Every rank runs the same number of forwards (ZeRO-3 gathers the weights in each)."""
        n = batch.num_tokens
        prepared.proximal = torch.full((n,), float("nan"), device=batch.input_ids.device)
        critic = self.critic
        if critic is not None:
            prepared.old = critic.empty_old_values(batch)
        micro = batching.micro_batches(batch.episode_ids, self.settings.trainer.micro_batch_tokens)
        for index in range(int(global_max(len(micro)))):
            if index >= len(micro):
                self._zero_loss(batch)
                continue
            sl = micro[index]
            input_ids = batch.input_ids[sl]
            hidden = hidden_states(self.policy, input_ids, batch.position_ids[sl], batch.segment_ids[sl])
            targets_at = batching.targets_at(prepared.train_mask[sl])
            if targets_at.numel():
                logprobs, _ = self.token_logprobs_at(self.policy, hidden, input_ids, targets_at)
                prepared.proximal[sl.start + targets_at] = logprobs.float()
            if critic is not None:
                critic.record_old(prepared.old, batch, sl, hidden, targets_at)

    def accumulate_gradients(
        self, batch: RolloutBatch, *, prepared: _Prepared | None = None, span: slice | None = None
    ) -> dict[str, float]:
        """Forward and backward over the micro-batches of ``span`` (a mini-batch of whole groups;
        the whole batch by default); gradients add up to those of the whole mini-batch.

        With several training processes the mini-batch is the union of every rank's: the loss's
        denominators (action tokens, included episodes, turns) are summed over ranks first and each
        rank's loss is scaled by the world size, since DDP and ZeRO average gradients over ranks.
        Every rank runs the same number of backward passes (a rank with fewer micro-batches runs
        zero-loss ones), because each backward is a collective. Returns the metrics, reduced
        over ranks. Does not step the optimizer."""
        if prepared is None:
            prepared = self.prepare(batch, self.train_mask(batch), record_old=False)
        span = span if span is not None else slice(0, batch.num_tokens)
        num_tokens, num_seqs, num_turns_kept = global_sum(*batching.span_counts(batch, prepared.train_mask, span))
        fn = self.loss_fn  # under `none` the metrics describe the weights as measured, none truncated
        totals = StepTotals(None if fn.importance_mode == "none" else fn.importance_cap)
        micro = batching.trained_micro_batches(batch, prepared.train_mask, span, self.settings.trainer.micro_batch_tokens)
        num_micro = int(global_max(len(micro)))
        for index in range(num_micro):
            is_last = index == num_micro - 1
            if index >= len(micro):
                self._backward(self._zero_loss(batch), last=is_last)
                continue
            loss = self._micro_loss(
                batch, micro[index], prepared, totals,
                num_tokens=num_tokens, num_seqs=int(num_seqs), num_turns_kept=num_turns_kept,
            )
            self._backward(loss * world_size(), last=is_last)
        log = {**prepared.log, **totals.reduced()}
        log["tokens/train"] = num_tokens
        return log

    def _micro_loss(
        self, batch: RolloutBatch, sl: slice, prepared: _Prepared, totals: StepTotals, *,
        num_tokens: float, num_seqs: int, num_turns_kept: float,
    ) -> torch.Tensor:
        """The loss of micro-batch ``sl`` with the mini-batch's global denominators; adds its metrics to ``totals``.
        Runs the forward passes (policy, critic, reference); the arithmetic is :class:`losses.MicroBatchLoss`."""
        mask = prepared.train_mask[sl]
        targets_at = batching.targets_at(mask)
        input_ids = batch.input_ids[sl]
        hidden = hidden_states(self.policy, input_ids, batch.position_ids[sl], batch.segment_ids[sl])
        logprobs, entropy = self.token_logprobs_at(self.policy, hidden, input_ids, targets_at)
        dense_lp = batching.dense(logprobs, targets_at, mask)

        micro_adv = prepared.token_adv[sl] if prepared.token_adv is not None else None
        value_loss, critic = None, self.critic
        if critic is not None:
            value_loss, critic_adv = critic.micro_batch(batch, sl, hidden, mask, totals, old=prepared.old,
                                                        num_tokens=num_tokens, num_turns_kept=num_turns_kept)
            if micro_adv is None:
                micro_adv = critic_adv
        assert micro_adv is not None

        behavior = batch.behavior_logprobs[sl]
        # Tokens without a behavior log-prob (observations in the no-mask ablation) are on-policy.
        behavior = torch.where(torch.isnan(behavior), dense_lp.detach(), behavior)
        lag = (self._policy_version() - batch.policy_versions[sl]).clamp(min=0)
        if prepared.proximal is not None:  # several updates: the weights the step started from
            proximal = batching.masked_nan(prepared.proximal[sl], dense_lp.detach())
            recomputed = proximal[targets_at]
        else:  # one update: the weights before it are the current ones
            stale = bool((lag[targets_at] > 0).any())
            # a sequence-level weight is taken at every step: it also corrects the engine-vs-trainer mismatch;
            # `none` takes the ratio around the trainer's own log-probs at every step (the behavior is only measured)
            around_trainer = stale or self.loss_fn.importance_level != "token" or self.loss_fn.importance_mode == "none"
            proximal = dense_lp.detach() if around_trainer else None
            recomputed = logprobs.detach()
        loss, metrics = self.loss_fn(
            dense_lp, behavior, micro_adv, mask, batch.episode_ids[sl],
            num_seqs=num_seqs, num_tokens=num_tokens,
            proximal_logprobs=proximal, is_weights=batch.token_weights[sl],
            entropy=batching.dense(entropy, targets_at, mask) if entropy is not None else None,
            ref_logprobs=self._reference_logprobs(batch, sl, targets_at, mask) if self.uses_reference else None,
            value_loss=value_loss,
        )
        totals.add_micro_batch(metrics, share=float(mask.sum()))
        if proximal is not None:
            totals.importance.append(self._importance(proximal, behavior, mask, batch.episode_ids[sl]))
        if entropy is not None:
            totals.add("policy/entropy", float(entropy.detach().sum()))
        totals.add_mismatch(recomputed, batch.behavior_logprobs[sl][targets_at], lag[targets_at] == 0,
                            batch.loss_mask[sl][targets_at] > 0)
        return loss

    def _importance(self, proximal, behavior, mask, seq_ids) -> importance.ImportanceWeights:
        """The importance weights the loss applied to a micro-batch, for the step's ``importance/*`` metrics."""
        fn = self.loss_fn
        return importance.importance_weights(proximal, behavior, mask, seq_ids, level=fn.importance_level,
                                             mode=fn.importance_mode, cap=fn.importance_cap, lower=fn.importance_floor)

    @property
    def critic(self) -> Critic | None:
        """The value head's computations (lightning_agentrl/critic.py); None without ``model.value_head``."""
        if self.value_head is None:
            return None
        s = self.settings
        return Critic(self.value_head, self.policy, s.algorithm, bootstraps_truncations=s.rollout.bootstraps_truncations,
                      chunk_tokens=s.trainer.micro_batch_tokens)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term against a frozen reference (``algorithm.kl_coef > 0``)."""
        return self.settings.algorithm.kl_coef > 0

    def _reference_logprobs(self, batch: RolloutBatch, sl: slice, targets_at, mask) -> torch.Tensor:
        """The frozen reference policy's log-probs of micro-batch ``sl``'s targets, dense like ``mask``."""
        input_ids = batch.input_ids[sl]
        with torch.no_grad(), kl_reference(self.policy, self.reference) as reference:
            ref_hidden = hidden_states(reference, input_ids, batch.position_ids[sl], batch.segment_ids[sl])
            ref_lp, _ = self.token_logprobs_at(reference, ref_hidden, input_ids, targets_at)
        return batching.dense(ref_lp, targets_at, mask)

    def _zero_loss(self, batch: RolloutBatch) -> torch.Tensor:
        """A loss of exactly 0 that still reaches every trainable parameter: the backward pass of a
        rank that has run out of micro-batches while others have not (each backward is a collective)."""
        n = min(2, batch.input_ids.numel())
        input_ids, position_ids, segment_ids = batch.input_ids[:n], batch.position_ids[:n], batch.segment_ids[:n]
        if n == 0:  # a rank whose episodes produced no token (gateway agents that never called the model)
            n, device = 2, next(self.policy.parameters()).device
            input_ids = torch.zeros(n, dtype=torch.long, device=device)
            position_ids, segment_ids = torch.arange(n, device=device), torch.zeros(n, dtype=torch.long, device=device)
        hidden = hidden_states(self.policy, input_ids, position_ids, segment_ids)
        logprobs, _ = self.token_logprobs_at(self.policy, hidden, input_ids, torch.arange(1, n, device=hidden.device))
        loss = logprobs.sum() + hidden.sum()
        critic = self.critic
        if critic is not None:
            loss = loss + critic.zero_loss(hidden, input_ids, position_ids, segment_ids)
        if self.uses_reference:
            with torch.no_grad(), kl_reference(self.policy, self.reference) as reference:
                ref_hidden = hidden_states(reference, input_ids, position_ids, segment_ids)
                self.token_logprobs_at(reference, ref_hidden, input_ids, torch.arange(1, n, device=hidden.device))
        return loss * 0.0



@dataclass
class _Prepared:
    """What the updates of one training step share (see :meth:`AgentRLModule.prepare`)."""

    train_mask: torch.Tensor  # [N]
    token_adv: torch.Tensor | None  # [N]; None for gae (from the critic, per micro-batch)
    log: dict
    proximal: torch.Tensor | None = None  # [N] log-probs before the first update; NaN where no loss
    old: OldValues | None = None  # the critic's values before the first update
    signal: bool = True  # some trainable token has a nonzero advantage (any rank)
    zero_gradient: bool = False  # no signal and no other loss term: the updates skip the forward/backward



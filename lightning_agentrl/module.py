"""AgentRLModule: the policy, the credit assignment and the loss of one optimizer step.

One training step consumes one :class:`RolloutBatch` (whole groups). It computes advantages over
the episodes that callbacks left included (excluded ones leave the group baseline too), splits
the packed tokens into micro-batches of about ``trainer.micro_batch_tokens`` tokens (whole
episodes, so per-sequence aggregation stays exact), accumulates gradients with global
denominators (the loss equals the loss of the whole batch in one pass), clips and steps.

Log-probs are computed on packed sequences (positions restart per segment, block-diagonal
attention) and only at positions that carry a loss, chunk by chunk, so the [tokens, vocab]
logits are never materialized for the whole batch.
"""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.algorithms import advantages as adv
from lightning_agentrl.algorithms import losses
from lightning_agentrl.algorithms.logprobs import token_logprobs
from lightning_agentrl.settings import Settings
from lightning_agentrl.trajectory import RolloutBatch


class AgentRLModule(L.LightningModule):
    def __init__(self, settings: Settings, model_path: str) -> None:
        super().__init__()
        self.settings = settings
        self.model_path = model_path
        self.policy = None
        self.automatic_optimization = False
        self.save_hyperparameters({"settings": settings.model_dump(mode="json"), "model_path": model_path})

    @override
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        self.policy = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, self.settings.model.dtype)
        )
        if self.settings.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.policy.config.use_cache = False

    @override
    def configure_optimizers(self):
        t = self.settings.trainer
        optimizer = torch.optim.AdamW(self.policy.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        warmup = max(t.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch.to(device) if isinstance(batch, RolloutBatch) else super().transfer_batch_to_device(
            batch, device, dataloader_idx
        )

    # -- credit ------------------------------------------------------------------------------
    def token_advantages(self, batch: RolloutBatch, train_mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Advantages per token [N] over the included episodes; excluded episodes get 0."""
        a = self.settings.algorithm
        keep = batch.include
        metrics: dict[str, float] = {}
        rewards, groups = batch.rewards[keep], batch.group_ids[keep]
        if a.advantage in ("grpo", "rloo", "reinforce_decay"):
            if a.advantage == "grpo":
                values = adv.grpo(rewards, groups, std=a.grpo_std)
            elif a.advantage == "rloo":
                values = adv.rloo(rewards, groups)
            else:
                values = adv.reinforce_decay(rewards, groups, batch.num_turns[keep], a.gamma)
            per_episode = torch.zeros_like(batch.rewards)
            per_episode[keep] = values.to(per_episode.dtype)
            return adv.expand_to_tokens(per_episode, batch.seq_ids, train_mask), metrics
        if a.advantage == "gigpo":
            turn_keep = keep[batch.turn_traj]
            # re-index included episodes 0..B'-1 so the estimator sees a dense batch
            new_index = torch.cumsum(keep.long(), 0) - 1
            per_turn, stats = adv.gigpo(
                batch.turn_rewards[turn_keep],
                new_index[batch.turn_traj[turn_keep]],
                [k for k, kept in zip(batch.turn_state_keys, turn_keep.tolist(), strict=True) if kept],
                groups,
                gamma=a.gamma,
                omega=a.gigpo_omega,
                similarity_threshold=a.gigpo_similarity,
                episode_rewards=rewards,
            )
            full = torch.zeros(batch.turn_traj.numel(), dtype=torch.float32, device=batch.rewards.device)
            full[turn_keep] = per_turn.to(full.dtype)
            metrics.update({f"gigpo/{k}": float(v) for k, v in stats.items() if isinstance(v, int | float)})
            token_turn = batch.token_turn
            if not self.settings.algorithm.loss_mask:  # observations take the advantage of the turn before
                token_turn = _carry_forward(token_turn, batch.segment_ids)
            return adv.expand_to_tokens(full, token_turn, train_mask), metrics
        raise ValueError(f"algorithm.advantage={a.advantage!r} needs a value head, which this module does not have")

    def train_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """Where the loss goes: the action tokens; with ``loss_mask: false`` (an ablation) also the
        observations and scaffolding after the first action of each segment."""
        action = batch.loss_mask * batch.include[batch.seq_ids].to(batch.loss_mask.dtype)
        if self.settings.algorithm.loss_mask:
            return action
        after_first_action = _after_first(batch.loss_mask, batch.segment_ids)
        return after_first_action * batch.include[batch.seq_ids].to(batch.loss_mask.dtype)

    # -- log-probs ---------------------------------------------------------------------------
    def sequence_logprobs(self, input_ids, position_ids, segment_ids, targets_at) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (and entropies) of ``input_ids[targets_at]`` under the policy, one packed pass.

        Shapes: input_ids/position_ids/segment_ids [n] (one micro-batch), targets_at [m] indices
        with ``targets_at > 0`` and in the same segment as the position before them.
        """
        n = input_ids.numel()
        same_segment = segment_ids[:, None] == segment_ids[None, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        attention = (causal & same_segment)[None, None]  # [1, 1, n, n] block-diagonal causal
        decoder = self.policy.get_decoder()
        hidden = decoder(
            input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=attention
        ).last_hidden_state[0]
        head = self.policy.get_output_embeddings()
        logprobs, entropy = token_logprobs(
            hidden[targets_at - 1],
            head.weight,
            input_ids[targets_at],
            temperature=max(self.settings.engine.temperature, 1e-6),
            chunk_size=self.settings.trainer.logprob_chunk_tokens,
            lm_head_bias=getattr(head, "bias", None),
        )
        return logprobs, entropy

    # -- the step ----------------------------------------------------------------------------
    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        a, t = self.settings.algorithm, self.settings.trainer
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        train_mask = self.train_mask(batch)
        token_adv, metrics = self.token_advantages(batch, train_mask)
        num_tokens = float(train_mask.sum())
        num_seqs = int(batch.include.sum())
        totals: dict[str, float] = {}
        weight_sum = 0.0
        mismatch_max, mismatch_sum, mismatch_n = 0.0, 0.0, 0
        loss_total = torch.zeros((), device=self.device)

        for sl in _micro_batches(batch.seq_ids, t.micro_batch_tokens):
            mask = train_mask[sl]
            targets_at = torch.nonzero(mask > 0).squeeze(-1)
            targets_at = targets_at[targets_at > 0]
            if targets_at.numel() == 0:
                continue
            logprobs, entropy = self.sequence_logprobs(
                batch.input_ids[sl], batch.position_ids[sl], batch.segment_ids[sl], targets_at
            )
            dense_lp = torch.zeros(mask.shape, dtype=logprobs.dtype, device=mask.device).index_put(
                (targets_at,), logprobs
            )
            behavior = batch.behavior_logprobs[sl]
            # Tokens without a behavior log-prob (observations in the no-mask ablation) are on-policy.
            behavior = torch.where(torch.isnan(behavior), dense_lp.detach(), behavior)
            lag = (self.global_step - batch.policy_versions[sl]).clamp(min=0)
            # Decoupled PPO: one update per batch, so the weights before it are the proximal policy.
            stale = bool((lag[targets_at] > 0).any())
            proximal = dense_lp.detach() if stale else None
            loss, step_metrics = losses.policy_loss(
                dense_lp,
                behavior,
                token_adv[sl],
                mask,
                batch.seq_ids[sl],
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                dual_clip=a.dual_clip,
                agg=a.aggregation,
                proximal_logprobs=proximal,
                is_weights=batch.token_weights[sl],
                is_cap=a.importance_cap,
                num_seqs=num_seqs,
                num_tokens=num_tokens,
            )
            if a.entropy_coef > 0:
                dense_entropy = torch.zeros_like(dense_lp).index_put((targets_at,), entropy)
                loss = loss - a.entropy_coef * losses.aggregate(
                    dense_entropy, mask, batch.seq_ids[sl], a.aggregation, num_seqs, num_tokens=num_tokens
                )
            self.manual_backward(loss)
            loss_total = loss_total + loss.detach()
            share = float(mask.sum())
            weight_sum += share
            for key, value in step_metrics.items():
                if key != "loss/policy":
                    totals[key] = totals.get(key, 0.0) + float(value) * share
            if entropy is not None:
                totals["policy/entropy"] = totals.get("policy/entropy", 0.0) + float(entropy.sum())
            # train/inference mismatch on tokens sampled by the current weights (lag 0)
            on_policy = (lag[targets_at] == 0) & (batch.loss_mask[sl][targets_at] > 0)
            if on_policy.any():
                diff = (logprobs.detach()[on_policy] - batch.behavior_logprobs[sl][targets_at][on_policy]).abs()
                mismatch_max = max(mismatch_max, float(diff.max()))
                mismatch_sum += float(diff.sum())
                mismatch_n += int(on_policy.sum())

        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        log = {key: value / max(weight_sum, 1.0) for key, value in totals.items()}
        log.update(metrics)
        log.update(
            {
                "loss/policy": float(loss_total),
                "policy/grad_norm": float(grad_norm),
                "policy/lr": scheduler.get_last_lr()[0],
                "tokens/train": num_tokens,
                "mismatch/logprob_max": mismatch_max,
                "mismatch/logprob_mean": mismatch_sum / mismatch_n if mismatch_n else 0.0,
            }
        )
        self.log_dict(log, on_step=True, prog_bar=False, batch_size=batch.num_episodes)
        self.log("loss", float(loss_total), prog_bar=True, batch_size=batch.num_episodes)
        return loss_total


def _micro_batches(seq_ids: torch.Tensor, max_tokens: int) -> list[slice]:
    """Contiguous slices of whole episodes, each about ``max_tokens`` long (an episode longer than
    that is its own micro-batch)."""
    boundaries = torch.nonzero(seq_ids[1:] != seq_ids[:-1]).squeeze(-1) + 1
    starts = [0, *boundaries.tolist()]
    ends = [*boundaries.tolist(), seq_ids.numel()]
    slices, begin = [], 0
    for start, end in zip(starts, ends, strict=True):
        if end - begin > max_tokens and start > begin:
            slices.append(slice(begin, start))
            begin = start
    slices.append(slice(begin, seq_ids.numel()))
    return slices


def _after_first(loss_mask: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """1 from the first action token of each segment on (the no-mask ablation's loss region)."""
    out = torch.zeros_like(loss_mask)
    for segment in torch.unique(segment_ids).tolist():
        where = torch.nonzero(segment_ids == segment).squeeze(-1)
        actions = torch.nonzero(loss_mask[where] > 0).squeeze(-1)
        if actions.numel():
            out[where[actions[0]] : where[-1] + 1] = 1
    return out


def _carry_forward(token_turn: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Give tokens outside an action the turn index of the last action before them (same segment)."""
    out = token_turn.clone()
    last, last_segment = -1, -1
    for i, (turn, segment) in enumerate(zip(token_turn.tolist(), segment_ids.tolist(), strict=True)):
        if segment != last_segment:
            last, last_segment = -1, segment
        if turn >= 0:
            last = turn
        out[i] = last
    return out


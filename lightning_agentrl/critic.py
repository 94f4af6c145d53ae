"""The critic: a value head on the policy's last hidden states (``model.value_head``, SPEC §3).

Its steps are the turns (``algorithm.gae_level: turn``: V of a turn is the head at the token just
before its action) or the trained tokens (``token``: V before each token, at the position that
predicts it). From its values GAE gives the ``gae`` advantages and the returns of the clipped value
loss. With ``algorithm.privileged_critic`` the head reads the states of a second forward of the trunk
over the critic's stream (each segment after its episode's critic context), without gradients.

    N  packed tokens of the batch         n  tokens of one micro-batch      H  hidden size
    B  episodes of the batch              b  episodes of one micro-batch
    K  turns of the batch                 k  turns of one micro-batch       t  trained tokens of one micro-batch
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_agentrl import batching
from lightning_agentrl.algorithms import advantages as adv
from lightning_agentrl.algorithms import losses
from lightning_agentrl.distributed import global_max
from lightning_agentrl.policy import hidden_states, partitioned

if TYPE_CHECKING:
    from lightning_agentrl.settings import AlgorithmSettings
    from lightning_agentrl.step_metrics import StepTotals
    from lightning_agentrl.trajectory import RolloutBatch


def new_value_head(policy: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Linear:
    """The critic's head on the policy's last hidden state, [H] -> 1, starting at V = 0 (SPEC §3)."""
    from lightning_agentrl.strategies import gathered_parameters

    head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=dtype)
    # under ZeRO-3 the head is partitioned as it is made: zeros written into its shards alone are lost
    with torch.no_grad(), gathered_parameters(list(head.parameters()), writable=True):
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return head


@dataclass
class OldValues:
    """The critic's outputs before a step's first update, recorded without gradients (several updates per step)."""

    values: torch.Tensor  # [K] per turn, or [N] per token (NaN where no token is trained)
    bootstrap: torch.Tensor  # [B] V at each episode's last token


@dataclass(frozen=True)
class Critic:
    """The value head's computations on one micro-batch ``sl`` of whole episodes, ``hidden`` [n, H] its states."""

    value_head: torch.nn.Module
    trunk: torch.nn.Module  # the policy: its decoder's states are what the head reads
    algorithm: AlgorithmSettings
    bootstraps_truncations: bool  # rollout.truncation: bootstrap
    chunk_tokens: int  # the privileged critic's forwards: about this many tokens each (trainer.micro_batch_tokens)

    @property
    def token_level(self) -> bool:
        return self.algorithm.token_level_critic

    def turn_values(self, batch: RolloutBatch, sl: slice, hidden, turns) -> torch.Tensor:
        """V of each turn [k]: the value head at the token just before its action (the state it starts from)."""
        return self.value_head(hidden[batch.turn_starts[turns] - sl.start - 1]).squeeze(-1).float()

    def bootstrap_values(self, batch: RolloutBatch, sl: slice, hidden, episodes) -> torch.Tensor:
        """V at each episode's last token [b]: what a truncated episode's return bootstraps from."""
        return self.value_head(hidden[batch.episode_last[episodes] - sl.start]).squeeze(-1).float().detach()

    def token_values(self, hidden, targets_at) -> torch.Tensor:
        """V before each trained token [t]: the value head at the position that predicts it (the state it is
        sampled from)."""
        return self.value_head(hidden[targets_at - 1]).squeeze(-1).float()

    def hidden(self, batch: RolloutBatch, sl: slice, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states the value head reads for micro-batch ``sl`` [n, H], row t for the policy's token t:
        the policy's own, or with ``algorithm.privileged_critic`` those of a second forward of the trunk over the
        critic's stream (each segment after its episode's critic context), so the context reaches the critic's
        gradient and never the policy's log-probs. The second forward runs for every micro-batch, context or not
        (under ZeRO-3 every rank must run as many forwards)."""
        if not self.algorithm.privileged_critic:
            return hidden
        # Without gradients into the trunk: the trunk is the policy, and a value loss back-propagated through
        # states that saw the hidden tests would teach the policy's weights what the policy must not know. The
        # privileged critic is the value head on these states (a second critic model is the way to more).
        with torch.no_grad():
            if batch.critic_input_ids is None:  # no episode of the batch has a context: the same stream again
                return self.critic_states(batch.input_ids[sl], batch.position_ids[sl], batch.segment_ids[sl])
            start = int(batch.critic_segment_start[batch.segment_ids[sl.start]])
            stop = int(batch.critic_index[sl.stop - 1]) + 1
            critic = slice(start, stop)
            critic_hidden = self.critic_states(batch.critic_input_ids[critic], batch.critic_position_ids[critic],
                                               batch.critic_segment_ids[critic])
            return critic_hidden[batch.critic_index[sl] - start]

    def critic_states(self, input_ids, position_ids, segment_ids) -> torch.Tensor:
        """The trunk's states [m, H] over a stretch of the critic's stream, in chunks of whole segments of about
        ``chunk_tokens`` each: every segment carries its episode's context, which would otherwise make one
        forward as long as a micro-batch times its segments' count. Under ZeRO-3 every rank runs as many forwards
        (the most any rank needs: the extra ones over one token), since each forward gathers the weights."""
        chunks = batching.micro_batches(segment_ids, self.chunk_tokens)
        # agreed before any forward: a rank's forwards and its all-reduce must not interleave with another's gathers
        forwards = int(global_max(len(chunks))) if partitioned(self.trunk) else len(chunks)
        states = torch.cat([hidden_states(self.trunk, input_ids[c], position_ids[c], segment_ids[c]) for c in chunks])
        one = slice(0, 1)
        for _ in range(forwards - len(chunks)):
            hidden_states(self.trunk, input_ids[one], position_ids[one], segment_ids[one])
        return states

    def empty_old_values(self, batch: RolloutBatch) -> OldValues:
        """Room for the old values of every step and episode of ``batch``, filled by :meth:`record_old`."""
        device = batch.input_ids.device
        values = (torch.full((batch.num_tokens,), float("nan"), device=device) if self.token_level
                  else torch.zeros(batch.turn_episode.numel(), device=device))
        return OldValues(values=values, bootstrap=torch.zeros(batch.num_episodes, device=device))

    def record_old(self, old: OldValues, batch: RolloutBatch, sl: slice, hidden, targets_at) -> None:
        """Writes micro-batch ``sl``'s values (at its ``targets_at``, or its turns) and bootstrap values into ``old``;
        ``hidden`` [n, H] are the policy's states (the privileged critic runs its own forward)."""
        turns, episodes = batching.turns_and_episodes(batch, sl)
        hidden = self.hidden(batch, sl, hidden)
        if self.token_level:
            old.values[sl.start + targets_at] = self.token_values(hidden, targets_at)
        else:
            old.values[turns] = self.turn_values(batch, sl, hidden, turns)
        old.bootstrap[episodes] = self.bootstrap_values(batch, sl, hidden, episodes)

    def zero_loss(self, hidden, input_ids, position_ids, segment_ids) -> torch.Tensor:
        """The head's part of a zero-loss backward (a rank out of micro-batches): a term through its parameters,
        and the privileged critic's second forward, which a real micro-batch runs (ZeRO-3 gathers the weights in
        each forward)."""
        term = self.value_head(hidden).sum()
        if self.algorithm.privileged_critic:
            with torch.no_grad():
                self.critic_states(input_ids, position_ids, segment_ids)
        return term

    def micro_batch(self, batch: RolloutBatch, sl: slice, hidden, mask, totals: StepTotals, *,
                    old: OldValues | None, num_tokens: float, num_turns_kept: float):
        """Value loss and (for ``gae``) token advantages [n] of micro-batch ``sl``, from the policy's states
        ``hidden``; the mini-batch has ``num_tokens`` trained tokens and ``num_turns_kept`` kept turns (over
        ranks). The privileged critic's forward is timed into ``totals``."""
        steps = num_tokens if self.token_level else num_turns_kept
        started = time.perf_counter()
        value_hidden = self.hidden(batch, sl, hidden)
        if value_hidden is not hidden:
            totals.critic_forward_s += time.perf_counter() - started
        return self.loss_and_advantages(batch, sl, value_hidden, mask, old, steps, totals)

    def loss_and_advantages(self, batch: RolloutBatch, sl: slice, hidden, mask, old: OldValues | None,
                            denominator: float, totals: StepTotals):
        """Value loss and (for ``gae``) token advantages of the episodes in micro-batch ``sl``.

        The critic's steps are the turns (``algorithm.gae_level: turn``) or the trained tokens (``token``);
        ``denominator`` is the mini-batch's count of them (kept turns, or trained tokens). GAE and the value
        clip use the old values: recorded before the step's first update, or (one update per step) the
        current ones, detached. A truncated episode bootstraps from V at its last token when
        ``rollout.truncation`` is ``bootstrap``. A segment boundary is not an end: the steps of all segments
        of an episode form one chain.
        """
        a = self.algorithm
        turns, episodes = batching.turns_and_episodes(batch, sl)
        first = int(batch.episode_ids[sl.start])
        if self.token_level:
            targets_at = batching.targets_at(mask)
            values = self.token_values(hidden, targets_at)
            old_values = old.values[sl.start + targets_at] if old is not None else values.detach()
            step_traj = batch.episode_ids[sl][targets_at] - first
            rewards = adv.turn_end_rewards(batch.turn_rewards, batch.token_turn[sl][targets_at])
            keep = torch.ones_like(values)  # the trained tokens are those of included episodes
        else:
            values = self.turn_values(batch, sl, hidden, turns)
            old_values = old.values[turns] if old is not None else values.detach()
            step_traj, rewards = batch.turn_episode[turns] - first, batch.turn_rewards[turns]
            keep = batch.include[batch.turn_episode[turns]].to(values.dtype)
        truncated = torch.tensor(
            [batch.trajectories[i].termination.truncated for i in episodes.tolist()], device=values.device
        )
        bootstrap = None
        if self.bootstraps_truncations:
            bootstrap = old.bootstrap[episodes] if old is not None else self.bootstrap_values(batch, sl, hidden, episodes)
        gae = adv.token_gae if self.token_level else adv.gae
        step_adv, returns = gae(
            rewards, old_values, step_traj, a.gamma, a.gae_lambda,
            bootstrap_values=bootstrap, truncated=truncated if bootstrap is not None else None,
        )
        value_loss = self.value_loss(values, old_values, returns, keep, denominator, totals)
        if self.token_level:
            return value_loss, batching.dense(step_adv.to(values.dtype), targets_at, mask)
        if turns.numel() == 0:
            return value_loss, torch.zeros_like(mask)
        # turn indices of this micro-batch, counted from its first turn
        token_turn = batching.token_turns(batch, loss_mask=a.loss_mask)[sl]
        local_turn = torch.where(token_turn >= 0, token_turn - int(turns[0]), token_turn)
        return value_loss, adv.expand_to_tokens(step_adv.to(values.dtype), local_turn, mask)

    def value_loss(self, values, old_values, returns, keep, denominator: float, totals: StepTotals) -> torch.Tensor:
        """The clipped value loss of a micro-batch's kept steps, scaled to the mini-batch's ``denominator``
        steps; its metrics go to ``totals`` weighted by the kept steps."""
        value_loss, value_metrics = losses.value_loss(values, old_values, returns, keep, clip=self.algorithm.value_clip)
        num_kept = float(keep.sum())
        value_loss = value_loss * num_kept / max(denominator, 1.0)  # a mean over this micro-batch's steps
        totals.add("loss/value", float(value_loss.detach()))
        for key, value in value_metrics.items():
            if key != "loss/value":
                totals.add(key, float(value) * num_kept)
        totals.add("value_weight", num_kept)
        totals.values.append(old_values[keep > 0])
        totals.returns.append(returns[keep > 0])
        return value_loss

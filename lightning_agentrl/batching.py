"""Index arithmetic on a packed :class:`RolloutBatch`: mini-batches, micro-batches, the loss region.

Pure functions on tensors, no model. A batch packs whole episodes one after another (an episode's
segments together, a group's episodes together, groups in order). Shapes:

    N  packed tokens of the batch              n  tokens of one micro-batch (a slice of N)
    B  episodes of the batch                   b  episodes of one micro-batch
    K  turns of the batch                      k  turns of one micro-batch
    t  targets: positions of a micro-batch that carry a loss
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_agentrl.trajectory import RolloutBatch


def mini_batches(batch: RolloutBatch, num_mini_batches: int) -> list[slice]:
    """Token spans of ``num_mini_batches`` equal runs of whole groups (a batch packs each group's
    episodes together, groups in order)."""
    groups = torch.unique_consecutive(batch.group_ids)
    if groups.numel() % num_mini_batches:
        raise ValueError(
            f"trainer.mini_batches ({num_mini_batches}) must divide the {groups.numel()} groups of a batch"
        )
    assert groups.numel() == torch.unique(batch.group_ids).numel(), "a group's episodes are packed together"
    per_mini = groups.numel() // num_mini_batches
    episode_start = torch.cat([batch.episode_last.new_zeros(1), batch.episode_last[:-1] + 1])
    spans = []
    for index in range(num_mini_batches):
        chosen = torch.isin(batch.group_ids, groups[index * per_mini : (index + 1) * per_mini])
        episodes = torch.nonzero(chosen).squeeze(-1)
        spans.append(slice(int(episode_start[episodes[0]]), int(batch.episode_last[episodes[-1]]) + 1))
    return spans


def micro_batches(seq_ids: torch.Tensor, max_tokens: int) -> list[slice]:
    """Contiguous slices of whole episodes of ``seq_ids`` [N] (each token's episode), each about ``max_tokens``
    long (an episode longer than that is its own micro-batch)."""
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


def trained_micro_batches(batch: RolloutBatch, train_mask: torch.Tensor, span: slice, max_tokens: int) -> list[slice]:
    """The :func:`micro_batches` of mini-batch ``span`` (token slices of the batch) that hold a trained token
    (``train_mask`` [N] past a micro-batch's first token, which nothing predicts)."""
    return [
        slice(span.start + sl.start, span.start + sl.stop)
        for sl in micro_batches(batch.episode_ids[span], max_tokens)
        if bool((train_mask[span][sl][1:] > 0).any())
    ]


def span_counts(batch: RolloutBatch, train_mask: torch.Tensor, span: slice) -> tuple[float, float, float]:
    """This rank's share of mini-batch ``span``'s loss denominators: trained tokens (``train_mask`` [N]),
    included episodes, and the included episodes' turns."""
    first, last = int(batch.episode_ids[span.start]), int(batch.episode_ids[span.stop - 1])
    in_span = (batch.turn_episode >= first) & (batch.turn_episode <= last)
    num_turns = float(batch.include[batch.turn_episode[in_span]].sum()) if in_span.any() else 0.0
    return float(train_mask[span].sum()), float(batch.include[first : last + 1].sum()), num_turns


def loss_region(batch: RolloutBatch, *, loss_mask: bool) -> torch.Tensor:
    """Where the loss goes [N], 0 or 1: the action tokens of included episodes; without ``loss_mask`` (an
    ablation) also the observations and scaffolding after the first action of each segment."""
    included = batch.include[batch.episode_ids].to(batch.loss_mask.dtype)
    if loss_mask:
        return batch.loss_mask * included
    return after_first(batch.loss_mask, batch.segment_ids) * included


def token_turns(batch: RolloutBatch, *, loss_mask: bool) -> torch.Tensor:
    """The turn each token's credit comes from [N]: its action's turn (-1 outside actions); without
    ``loss_mask`` the tokens after an action carry that action's turn (:func:`carry_forward`)."""
    if loss_mask:
        return batch.token_turn
    return carry_forward(batch.token_turn, batch.segment_ids)  # observations: the turn before


def after_first(loss_mask: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """1 from the first action token of each segment on [N] (the no-mask ablation's loss region)."""
    out = torch.zeros_like(loss_mask)
    for segment in torch.unique(segment_ids).tolist():
        where = torch.nonzero(segment_ids == segment).squeeze(-1)
        actions = torch.nonzero(loss_mask[where] > 0).squeeze(-1)
        if actions.numel():
            out[where[actions[0]] : where[-1] + 1] = 1
    return out


def carry_forward(token_turn: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """``token_turn`` [N] with tokens outside an action given the turn index of the last action before
    them (same segment)."""
    out = token_turn.clone()
    last, last_segment = -1, -1
    for i, (turn, segment) in enumerate(zip(token_turn.tolist(), segment_ids.tolist(), strict=True)):
        if segment != last_segment:
            last, last_segment = -1, segment
        if turn >= 0:
            last = turn
        out[i] = last
    return out


def targets_at(mask: torch.Tensor) -> torch.Tensor:
    """Positions [t] of a micro-batch (``mask`` [n]) that carry a loss (never its first token: nothing
    predicts it)."""
    positions = torch.nonzero(mask > 0).squeeze(-1)
    return positions[positions > 0]


def turns_and_episodes(batch: RolloutBatch, sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices of the turns [k] and the episodes [b] of a slice of whole episodes."""
    first, last = int(batch.episode_ids[sl.start]), int(batch.episode_ids[sl.stop - 1])
    turns = torch.nonzero((batch.turn_episode >= first) & (batch.turn_episode <= last)).squeeze(-1)
    return turns, torch.arange(first, last + 1, device=batch.episode_ids.device)


def dense(values: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-target ``values`` [t] scattered onto the micro-batch's tokens at ``targets`` [t] (zeros elsewhere),
    like ``mask`` [n]."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=mask.device).index_put((targets,), values)


def masked_nan(values: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``values`` with each NaN replaced by ``fallback`` at the same place (same shapes)."""
    return torch.where(torch.isnan(values), fallback, values)

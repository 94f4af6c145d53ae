"""Attention over packed segments without an ``[n, n]`` mask.

A micro-batch is one flat stream of ``n`` tokens holding ``S`` whole segments (contiguous runs of
one segment id; positions restart at each). Running the decoder over the whole stream with a
block-diagonal mask costs ``O(n^2)`` attention and an ``[n, n]`` mask, although only
``sum_s len_s^2`` of it is ever allowed. Here the segments are sorted by length and padded into
buckets of near-equal lengths, ``[b, L]`` per bucket, each run as an ordinary right-padded batch:
a token attends to its own segment only (causal, and padding comes after every real token), so
the result equals running each segment alone, at a cost of at most ``sum_s len_s^2 / ratio^2``.

    n  tokens in the micro-batch       S  segments
    H  hidden size                     L  a bucket's longest segment
"""

from __future__ import annotations

import torch


def segment_runs(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start index and length ``[S]`` of each run of equal ids in ``segment_ids[n]``.

    Raises ``ValueError`` when one id appears in two runs (a segment split in the stream)."""
    n = segment_ids.numel()
    change = torch.ones(n, dtype=torch.bool, device=segment_ids.device)
    change[1:] = segment_ids[1:] != segment_ids[:-1]
    starts = change.nonzero().flatten()
    if starts.numel() != segment_ids.unique().numel():
        raise ValueError("segment ids must form contiguous runs in a packed micro-batch")
    lengths = torch.diff(starts, append=torch.tensor([n], device=starts.device))
    return starts, lengths


def length_buckets(lengths: list[int], max_tokens: int, ratio: float = 0.8) -> list[list[int]]:
    """Segment indices grouped into buckets of near-equal length, longest first.

    A bucket holds segments no shorter than ``ratio`` times its longest one (so padding is at most
    ``1 - ratio`` of it) and at most ``max_tokens`` padded tokens (at least one segment)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            bucket = buckets[-1]
            longest = lengths[bucket[0]]
            if lengths[i] >= ratio * longest and (len(bucket) + 1) * longest <= max_tokens:
                bucket.append(i)
                continue
        buckets.append([i])
    return buckets


def packed_hidden_states(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    max_bucket_tokens: int | None = None,
) -> torch.Tensor:
    """Last hidden states ``[n, H]`` of a packed micro-batch, each segment attending only to
    itself, computed bucket by bucket (see the module docstring); differentiable.

    ``input_ids``, ``position_ids``, ``segment_ids``: ``[n]``. ``decoder``: an HF decoder stack
    (``model.get_decoder()``) taking ``input_ids``, ``position_ids`` and a ``[b, L]`` padding mask.
    """
    n = input_ids.numel()
    starts, lengths = segment_runs(segment_ids)
    starts_l, lengths_l = starts.tolist(), lengths.tolist()
    buckets = length_buckets(lengths_l, max_bucket_tokens or n)
    pieces, order = [], []
    for bucket in buckets:
        longest = lengths_l[bucket[0]]
        ids = input_ids.new_zeros(len(bucket), longest)
        pos = position_ids.new_zeros(len(bucket), longest)
        mask = torch.zeros(len(bucket), longest, dtype=torch.long, device=input_ids.device)
        for row, s in enumerate(bucket):
            start, length = starts_l[s], lengths_l[s]
            ids[row, :length] = input_ids[start : start + length]
            pos[row, :length] = position_ids[start : start + length]
            mask[row, :length] = 1
            order.append(torch.arange(start, start + length, device=input_ids.device))
        hidden = decoder(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
        pieces.append(hidden[mask.bool()])  # row-major: segment by segment, in bucket order
    flat = torch.cat(pieces)
    inverse = torch.empty(n, dtype=torch.long, device=input_ids.device)
    inverse[torch.cat(order)] = torch.arange(n, device=input_ids.device)
    return flat[inverse]


def block_mask_hidden_states(
    decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor
) -> torch.Tensor:
    """The same ``[n, H]`` in one decoder call: the whole pack in one row under an additive
    ``[n, n]`` block-causal mask (``O(n^2)``). For ZeRO-3, where every rank must call the decoder
    equally often, and as the reference the buckets are tested against."""
    n = input_ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
    allowed = (segment_ids[:, None] == segment_ids[None, :]) & causal
    dtype = next(decoder.parameters()).dtype
    mask = torch.zeros(1, 1, n, n, dtype=dtype, device=input_ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return decoder(input_ids=input_ids[None], position_ids=position_ids[None], attention_mask=mask).last_hidden_state[0]

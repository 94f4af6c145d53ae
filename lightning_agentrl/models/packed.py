"""Attention over packed segments without an ``[n, n]`` mask, and shared prompts computed once.

A micro-batch is one flat stream of ``n`` tokens holding ``S`` whole segments (contiguous runs of
one segment id; positions restart at each). Running the decoder over the whole stream with a
block-diagonal mask costs ``O(n^2)`` attention and an ``[n, n]`` mask, although only
``sum_s len_s^2`` of it is ever allowed. Here the segments are sorted by length and padded into
buckets of near-equal lengths, ``[b, L]`` per bucket, each run as an ordinary right-padded batch:
a token attends to its own segment only (causal, and padding comes after every real token), so
the result equals running each segment alone, at a cost of at most ``sum_s len_s^2 / ratio^2``.

Shared prefixes. The episodes of one GRPO group start with the same chat-templated prompt, often
half of each episode's tokens: running every segment whole recomputes that prompt once per
episode, forward and backward. A causal decoder's states over a prefix do not depend on what
follows, so segments whose first ``p >= MIN_SHARED_PREFIX`` tokens are identical (token ids and
position ids, found by comparing the tokens, never assumed) run that prefix once, with a KV cache,
and only their own remaining tokens (suffixes) on top of it. The cached keys and values are
indexed per suffix row, so each row's gradient flows back into the one prefix forward and sums
there; the prefix's hidden states are copied to every segment that shares it. Values and
gradients equal running each segment alone (up to float rounding).

    n  tokens in the micro-batch       S  segments
    H  hidden size                     L  a bucket's longest segment (or suffix)
    P  a suffix bucket's longest prefix    K  key/value heads    D  head dimension
"""

from __future__ import annotations

import itertools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SHARED_PREFIX = 16
"""Shortest prefix worth a forward of its own: below it the extra decoder call costs more than the
tokens it saves."""


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


def suffix_buckets(prefix_lengths: list[int], suffix_lengths: list[int], max_tokens: int,
                   ratio: float = 0.8) -> list[list[int]]:
    """Suffix rows (each continuing a cached prefix of ``prefix_lengths[i]`` tokens with
    ``suffix_lengths[i]`` new ones) grouped into buckets run as one batch: prefixes no shorter than
    ``ratio`` times the bucket's longest ``P`` (each row's keys are padded to ``P``), and at most
    ``max_tokens`` cached plus new positions, ``b * (P + L)`` (at least one row), the bound
    :func:`length_buckets` keeps for whole segments.

    >>> suffix_buckets([3000, 3000, 16, 16, 16], [50, 50, 50, 50, 50], max_tokens=6000)
    [[0], [1], [2, 3, 4]]
    """
    unbounded = sum(prefix_lengths) + sum(suffix_lengths) + 1
    buckets = []
    for similar in length_buckets(prefix_lengths, unbounded, ratio):
        longest = max(prefix_lengths[i] for i in similar)
        totals = [longest + suffix_lengths[i] for i in similar]
        buckets += [[similar[j] for j in bucket] for bucket in length_buckets(totals, max_tokens, ratio)]
    return buckets


def _common_length(a: list, b: list) -> int:
    limit = min(len(a), len(b))
    k = 0
    while k < limit and a[k] == b[k]:
        k += 1
    return k


def shared_prefix_groups(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    min_length: int = MIN_SHARED_PREFIX,
) -> list[tuple[int, list[int]]]:
    """Groups ``(p, segments)`` of at least 2 segments whose first ``p >= min_length`` tokens are
    equal, in ``input_ids`` and ``position_ids`` (``[n]``); each segment in at most one group.

    The segments sorted by their tokens form a trie; of its nodes (a prefix of length ``p`` shared by
    ``k`` segments) the disjoint set chosen saves the most token forwards, ``sum (k - 1) * p``. So a
    system prompt common to every group does not hide the longer per-group prompts below it, and
    two episodes whose completions happen to start alike do not split their group's prompt.

    >>> ids = torch.tensor([5, 6, 7, 1, 5, 6, 7, 2, 9, 9])
    >>> pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    >>> shared_prefix_groups(ids, pos, [0, 4, 8], [4, 4, 2], min_length=2)
    [(3, [0, 1])]
    """
    ids, pos = input_ids.tolist(), position_ids.tolist()
    candidates = [s for s, length in enumerate(lengths) if length >= min_length]
    tokens = {}
    for s in candidates:
        span = slice(starts[s], starts[s] + lengths[s])
        tokens[s] = list(zip(ids[span], pos[span], strict=True))
    order = sorted(candidates, key=tokens.__getitem__)
    common = [_common_length(tokens[a], tokens[b]) for a, b in itertools.pairwise(order)]

    def best(lo: int, hi: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """Most tokens saved, and the groups saving them, among the sorted segments ``order[lo:hi]``."""
        if hi - lo < 2:
            return 0, []
        depth = min(common[lo : hi - 1])  # the prefix all of them share: this node of the trie
        saved, groups, child = 0, [], lo
        for i in range(lo, hi):
            if i == hi - 1 or common[i] == depth:  # a child node ends after order[i]
                child_saved, child_groups = best(child, i + 1)
                saved, groups, child = saved + child_saved, groups + child_groups, i + 1
        own = (hi - lo - 1) * depth if depth >= min_length else 0
        if own > 0 and own >= saved:
            return own, [(depth, sorted(order[lo:hi]))]
        return saved, groups

    return sorted(best(0, len(order))[1], key=lambda group: group[1][0])


def prefix_cache_exact(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder`` can run a suffix on a given prefix's keys and values: every layer's cache
    is a plain growing one (no sliding window, no recurrent state), and no gradient checkpointing in
    training, under which transformers drops the cache (its backward replay would extend it twice)."""
    checkpointed = any(getattr(module, "gradient_checkpointing", False) for module in decoder.modules())
    if decoder.training and checkpointed:
        return False
    layers = DynamicCache(config=decoder.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _padded_batch(input_ids, position_ids, spans: list[tuple[int, int]]):
    """Right-padded ``ids, pos, mask`` ``[b, L]`` of the stream's ``spans`` (start, length)."""
    longest = max(length for _, length in spans)
    ids = input_ids.new_zeros(len(spans), longest)
    pos = position_ids.new_zeros(len(spans), longest)
    mask = torch.zeros(len(spans), longest, dtype=torch.long, device=input_ids.device)
    for row, (start, length) in enumerate(spans):
        ids[row, :length] = input_ids[start : start + length]
        pos[row, :length] = position_ids[start : start + length]
        mask[row, :length] = 1
    return ids, pos, mask


class _Placement:
    """The decoder's outputs gathered piece by piece, ``[rows, H]``, and the row each stream token
    reads: a shared prefix's row is read by every segment that shares it, so its gradient sums."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.n, self.device = n, device
        self.pieces: list[torch.Tensor] = []
        self.destinations: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self.num_rows = 0

    def add(self, hidden: torch.Tensor, mask: torch.Tensor) -> int:
        """Keep the real tokens of ``hidden[b, L, H]`` (``mask[b, L]``), row-major: span by span; the
        first one's row."""
        self.pieces.append(hidden[mask.bool()])
        first, self.num_rows = self.num_rows, self.num_rows + self.pieces[-1].shape[0]
        return first

    def place(self, stream_start: int, row_start: int, length: int) -> None:
        """Stream tokens ``stream_start + i`` read rows ``row_start + i``, ``i < length``."""
        self.destinations.append(torch.arange(stream_start, stream_start + length, device=self.device))
        self.rows.append(torch.arange(row_start, row_start + length, device=self.device))

    def states(self) -> torch.Tensor:
        """``[n, H]`` in stream order."""
        destination = torch.cat(self.destinations)
        assert destination.numel() == self.n, "every token of the stream is placed once"
        source = torch.empty(self.n, dtype=torch.long, device=self.device)
        source[destination] = torch.cat(self.rows)
        return torch.cat(self.pieces)[source]


def _run_spans(decoder, input_ids, position_ids, spans, placement: _Placement,
               past_key_values: DynamicCache | None = None, prefix_mask: torch.Tensor | None = None) -> None:
    """One decoder call over the right-padded ``spans`` (start, length), placed where they came from;
    on ``past_key_values`` ``[b, K, P, D]`` per layer, whose real tokens are ``prefix_mask[b, P]``,
    when the spans continue cached prefixes."""
    ids, pos, mask = _padded_batch(input_ids, position_ids, spans)
    full_mask = mask if prefix_mask is None else torch.cat([prefix_mask.long(), mask], dim=1)  # [b, P + L]
    hidden = decoder(input_ids=ids, position_ids=pos, attention_mask=full_mask,
                     past_key_values=past_key_values, use_cache=past_key_values is not None).last_hidden_state
    row = placement.add(hidden, mask)
    for start, length in spans:
        placement.place(start, row, length)
        row += length


def _run_prefixes(decoder, input_ids, position_ids, spans, placement: _Placement, max_tokens: int):
    """Each prefix ``spans[g]`` (start, length) once, in length buckets: per layer the keys and
    values of all prefixes, flat ``[sum p, K, D]``, each prefix's first index in them, and the first
    row of its hidden states in ``placement`` (for the caller to place at every member)."""
    flat_keys: list[list[torch.Tensor]] = []
    flat_values: list[list[torch.Tensor]] = []
    first_at, rows_at = [0] * len(spans), [0] * len(spans)
    offset = 0
    for bucket in length_buckets([length for _, length in spans], max_tokens):
        ids, pos, mask = _padded_batch(input_ids, position_ids, [spans[g] for g in bucket])
        out = decoder(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
        row = placement.add(out.last_hidden_state, mask)
        for layer, cache in enumerate(out.past_key_values.layers):  # keys: [b, K, L, D]
            if layer == len(flat_keys):
                flat_keys.append([])
                flat_values.append([])
            flat_keys[layer].append(cache.keys.transpose(1, 2)[mask.bool()])
            flat_values[layer].append(cache.values.transpose(1, 2)[mask.bool()])
        for g in bucket:
            first_at[g], rows_at[g] = offset, row
            row += spans[g][1]
            offset += spans[g][1]
    keys = [torch.cat(parts) for parts in flat_keys]
    values = [torch.cat(parts) for parts in flat_values]
    return keys, values, first_at, rows_at


def _run_shared(decoder, input_ids, position_ids, starts, lengths, groups, placement: _Placement,
                max_tokens: int) -> None:
    """The segments of ``groups`` (``(p, members)``): each prefix once, then the members' suffixes in
    length buckets, each row on its own prefix's keys and values (indexed, so gradients sum back)."""
    prefix_lengths = [p for p, _ in groups]
    prefix_spans = [(starts[members[0]], p) for p, members in groups]
    keys, values, first_at, rows_at = _run_prefixes(decoder, input_ids, position_ids, prefix_spans, placement,
                                                    max_tokens)
    for g, (p, members) in enumerate(groups):
        for s in members:
            placement.place(starts[s], rows_at[g], p)
    suffixes = [(g, s) for g, (p, members) in enumerate(groups) for s in members if lengths[s] > p]
    suffix_lengths = [lengths[s] - prefix_lengths[g] for g, s in suffixes]
    for bucket in suffix_buckets([prefix_lengths[g] for g, _ in suffixes], suffix_lengths, max_tokens):
        rows = [suffixes[i] for i in bucket]
        spans = [(starts[s] + prefix_lengths[g], lengths[s] - prefix_lengths[g]) for g, s in rows]
        # row r reads its prefix's flat keys; the padding past a shorter prefix is masked out
        first = torch.tensor([first_at[g] for g, _ in rows], device=input_ids.device)[:, None]
        prefix_length = torch.tensor([prefix_lengths[g] for g, _ in rows], device=input_ids.device)[:, None]
        steps = torch.arange(max(prefix_lengths[g] for g, _ in rows), device=input_ids.device)
        prefix_mask = steps < prefix_length  # [b, P]
        index = torch.where(prefix_mask, first + steps, first)
        per_layer = [(k[index].transpose(1, 2), v[index].transpose(1, 2))  # [b, K, P, D]
                     for k, v in zip(keys, values, strict=True)]
        cache = DynamicCache(ddp_cache_data=per_layer, config=decoder.config)
        _run_spans(decoder, input_ids, position_ids, spans, placement, cache, prefix_mask)


def packed_hidden_states(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    max_bucket_tokens: int | None = None,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
) -> torch.Tensor:
    """Last hidden states ``[n, H]`` of a packed micro-batch, each segment attending only to
    itself, computed bucket by bucket, shared prefixes of at least ``min_shared_prefix`` tokens
    once (``None``: every segment whole; see the module docstring); differentiable.

    ``input_ids``, ``position_ids``, ``segment_ids``: ``[n]``. ``decoder``: an HF decoder stack
    (``model.get_decoder()``) taking ``input_ids``, ``position_ids``, a padding mask ``[b, L]`` (or
    ``[b, P + L]`` over a cache) and ``past_key_values``.
    """
    n = input_ids.numel()
    starts, lengths = segment_runs(segment_ids)
    starts_l, lengths_l = starts.tolist(), lengths.tolist()
    groups = []
    if min_shared_prefix is not None and prefix_cache_exact(decoder):
        groups = shared_prefix_groups(input_ids, position_ids, starts_l, lengths_l, min_shared_prefix)
    grouped = {s for _, members in groups for s in members}
    whole = [s for s in range(len(starts_l)) if s not in grouped]
    max_tokens = max_bucket_tokens or n
    placement = _Placement(n, input_ids.device)
    for bucket in length_buckets([lengths_l[s] for s in whole], max_tokens):
        spans = [(starts_l[whole[i]], lengths_l[whole[i]]) for i in bucket]
        _run_spans(decoder, input_ids, position_ids, spans, placement)
    if groups:
        _run_shared(decoder, input_ids, position_ids, starts_l, lengths_l, groups, placement, max_tokens)
    return placement.states()


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

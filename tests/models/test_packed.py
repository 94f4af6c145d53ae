"""Packed attention by length buckets equals the block-diagonal mask it replaces, in value and
gradient, on a random-init Llama with segments of very different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_agentrl.models.packed import (
    block_mask_hidden_states,
    length_buckets,
    packed_hidden_states,
    segment_runs,
)


def _pack(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(k) for k in lengths])
    segments = torch.cat([torch.full((k,), s) for s, k in enumerate(lengths)])
    return ids, positions, segments


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bucketed_equals_block_mask_in_value_and_gradient(attn):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    model = LlamaForCausalLM(config).float()
    ids, positions, segments = _pack([37, 3, 120, 1, 64, 60, 59, 9], config.vocab_size)
    decoder = model.get_decoder()
    weight = torch.randn(ids.numel(), config.hidden_size) / ids.numel()  # a mean, as a loss is

    reference = block_mask_hidden_states(decoder, ids, positions, segments)
    (reference * weight).sum().backward()
    reference_grads = [p.grad.clone() for p in decoder.parameters()]
    model.zero_grad()

    bucketed = packed_hidden_states(decoder, ids, positions, segments, max_bucket_tokens=128)
    (bucketed * weight).sum().backward()

    torch.testing.assert_close(bucketed, reference, atol=1e-5, rtol=1e-5)
    for p, ref in zip(decoder.parameters(), reference_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, atol=1e-5, rtol=1e-5)


def test_buckets_bound_padding_and_size():
    lengths = [195, 10, 180, 7, 160, 300, 1, 150]
    buckets = length_buckets(lengths, max_tokens=400, ratio=0.8)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        longest = lengths[bucket[0]]
        assert all(lengths[i] >= 0.8 * longest for i in bucket[1:])
        assert len(bucket) == 1 or len(bucket) * longest <= 400
    assert [lengths[b[0]] for b in buckets] == sorted((lengths[b[0]] for b in buckets), reverse=True)


def test_segment_runs_and_split_segment_refused():
    starts, lengths = segment_runs(torch.tensor([4, 4, 7, 2, 2, 2]))
    assert starts.tolist() == [0, 2, 3] and lengths.tolist() == [2, 1, 3]
    with pytest.raises(ValueError, match="contiguous"):
        segment_runs(torch.tensor([1, 1, 2, 1]))

"""Packed attention by length buckets equals the block-diagonal mask it replaces, in value and
gradient, on a random-init Llama with segments of very different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_agentrl.models import packed
from lightning_agentrl.models.packed import (
    MIN_SHARED_PREFIX,
    block_mask_hidden_states,
    length_buckets,
    packed_hidden_states,
    prefix_cache_exact,
    segment_runs,
    shared_prefix_groups,
    suffix_buckets,
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
    decoder = _decoder(attn)
    pack = _pack([37, 3, 120, 1, 64, 60, 59, 9], decoder.config.vocab_size)
    _assert_packed_equals_block_mask(decoder, *pack, max_bucket_tokens=128)


def _decoder(attn: str):
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    return LlamaForCausalLM(config).float().get_decoder()


def _assert_packed_equals_block_mask(decoder, ids, positions, segments, *, max_bucket_tokens: int) -> None:
    """``packed_hidden_states`` equals the block-mask reference in value and in every parameter's gradient."""
    weight = torch.randn(ids.numel(), decoder.config.hidden_size) / ids.numel()  # a mean, as a loss is
    reference = block_mask_hidden_states(decoder, ids, positions, segments)
    (reference * weight).sum().backward()
    reference_grads = [p.grad.clone() for p in decoder.parameters()]
    decoder.zero_grad()

    packed = packed_hidden_states(decoder, ids, positions, segments, max_bucket_tokens=max_bucket_tokens)
    (packed * weight).sum().backward()

    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=1e-5)
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


def _shared_pack(segments, vocab, seed=0):
    """A pack of segments given as lists of token-id tensors, each the concatenation of its parts
    (parts shared between segments are passed as the same tensor)."""
    ids = torch.cat([torch.cat(parts) for parts in segments])
    lengths = [sum(part.numel() for part in parts) for parts in segments]
    positions = torch.cat([torch.arange(k) for k in lengths])
    segment_ids = torch.cat([torch.full((k,), s) for s, k in enumerate(lengths)])
    return ids, positions, segment_ids


def _tokens(length, vocab, generator):
    return torch.randint(0, vocab, (length,), generator=generator)


def _prompt_cases(vocab):
    g = torch.Generator().manual_seed(1)
    prompt = _tokens(36, vocab, g)
    other_prompt = _tokens(30, vocab, g)
    short_prompt = _tokens(MIN_SHARED_PREFIX - 1, vocab, g)
    completion = lambda k: _tokens(k, vocab, g)  # noqa: E731
    return {
        "a group sharing a prompt": [[prompt, completion(k)] for k in (20, 20, 17, 25, 3, 20, 1, 30)],
        "mixed shared and unshared": [[completion(40)], [prompt, completion(9)], [completion(5)],
                                      [prompt, completion(12)], [completion(50)], [prompt, completion(11)]],
        "a segment equal to the prefix": [[prompt], [prompt, completion(7)], [prompt, completion(19)]],
        # suffixes of 30, 30 and 28 tokens run as one batch over prefixes of 30 and 36 tokens (the
        # shorter prefix's keys padded in the middle of its row)
        "prefixes of different lengths": [[prompt, completion(9)], [other_prompt, completion(30)],
                                          [prompt, completion(30)], [other_prompt, completion(2)],
                                          [other_prompt, completion(28)]],
        "a prefix below the minimum": [[short_prompt, completion(20)], [short_prompt, completion(25)]],
    }


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(_prompt_cases(97)))
def test_shared_prefix_equals_block_mask_in_value_and_gradient(attn, case):
    torch.manual_seed(0)
    decoder = _decoder(attn)
    assert prefix_cache_exact(decoder)
    vocab = decoder.config.vocab_size
    _assert_packed_equals_block_mask(decoder, *_shared_pack(_prompt_cases(vocab)[case], vocab), max_bucket_tokens=256)


def test_suffix_buckets_keep_cached_plus_new_positions_under_the_cap():
    """A bucket pads every row's keys to its longest prefix: a long prompt never shares a batch with
    short ones, and ``b * (P + L)`` stays within the cap (the whole-segment bound), whatever the mix."""
    long_and_short = suffix_buckets([3000, 3000, *[16] * 60], [50] * 62, max_tokens=10_060)
    assert all(set(b) <= {0, 1} or not set(b) & {0, 1} for b in long_and_short)
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        rows = int(torch.randint(1, 40, (1,), generator=generator))
        prefixes = torch.randint(16, 400, (rows,), generator=generator).tolist()
        suffixes = torch.randint(1, 200, (rows,), generator=generator).tolist()
        cap = int(torch.randint(200, 4000, (1,), generator=generator))
        buckets = suffix_buckets(prefixes, suffixes, cap)
        assert sorted(i for b in buckets for i in b) == list(range(rows))
        for bucket in buckets:
            longest = max(prefixes[i] for i in bucket)
            assert min(prefixes[i] for i in bucket) >= 0.8 * longest
            assert len(bucket) == 1 or len(bucket) * (longest + max(suffixes[i] for i in bucket)) <= cap


def test_shared_prefixes_found_by_tokens_and_positions():
    cases = _prompt_cases(97)
    groups = {name: shared_prefix_groups(*_runs(*_shared_pack(segments, 97))) for name, segments in cases.items()}
    assert groups["a group sharing a prompt"] == [(36, list(range(8)))]
    assert groups["mixed shared and unshared"] == [(36, [1, 3, 5])]
    assert groups["a segment equal to the prefix"] == [(36, [0, 1, 2])]
    assert groups["prefixes of different lengths"] == [(36, [0, 2]), (30, [1, 3, 4])]
    assert groups["a prefix below the minimum"] == []
    ids, positions, segments = _shared_pack(cases["a group sharing a prompt"], 97)
    assert shared_prefix_groups(ids, positions + 1, *_runs(ids, positions, segments)[2:]) == [(36, list(range(8)))]
    shifted = positions.clone()
    shifted[segments == 3] += 1  # same tokens, other positions: not the same prefix
    assert shared_prefix_groups(*_runs(ids, shifted, segments)) == [(36, [0, 1, 2, 4, 5, 6, 7])]


def test_a_common_system_prompt_does_not_hide_the_prompts_below_it():
    g = torch.Generator().manual_seed(2)
    system = _tokens(20, 97, g)
    prompts = [torch.cat([system, _tokens(30, 97, g)]) for _ in range(2)]
    segments = [[prompts[i // 4], _tokens(10, 97, g)] for i in range(8)]
    # and two completions of the first prompt that start alike do not split its group
    segments[1][1][:5] = segments[0][1][:5]
    assert shared_prefix_groups(*_runs(*_shared_pack(segments, 97))) == [(50, [0, 1, 2, 3]), (50, [4, 5, 6, 7])]


def _runs(ids, positions, segments):
    starts, lengths = segment_runs(segments)
    return ids, positions, starts.tolist(), lengths.tolist()


def test_gradient_checkpointing_runs_every_segment_whole():
    """Transformers drops the KV cache under gradient checkpointing in training: no prefix is shared
    there, and the states are still exact."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).float()
    model.gradient_checkpointing_enable()
    model.train()
    decoder = model.get_decoder()
    assert not prefix_cache_exact(decoder)
    ids, positions, segments = _shared_pack(_prompt_cases(97)["a group sharing a prompt"], 97)
    shared = packed_hidden_states(decoder, ids, positions, segments)
    torch.testing.assert_close(shared, block_mask_hidden_states(decoder, ids, positions, segments), atol=1e-5, rtol=1e-5)
    model.eval()
    assert prefix_cache_exact(decoder)


def test_doctests():
    import doctest

    assert doctest.testmod(packed, raise_on_error=False, verbose=False).failed == 0

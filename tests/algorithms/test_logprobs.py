"""Chunked token log-probs: equal to a full log_softmax, same gradients, no [N, V] kept for backward."""

from __future__ import annotations

import pytest
import torch

from lightning_agentrl.algorithms.logprobs import token_logprobs


def naive(hidden, weight, targets, temperature=1.0, bias=None):
    logits = (hidden @ weight.T + (0 if bias is None else bias)).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], entropy


def inputs(n=37, h=16, v=101, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(v, generator=g, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_log_softmax_values_and_gradients(chunk_size, temperature):
    hidden, weight, bias, targets = inputs()
    upstream = torch.randn(37, dtype=torch.float64)
    results = []
    for fn in (
        lambda h, w, b: naive(h, w, targets, temperature, b),
        lambda h, w, b: token_logprobs(
            h, w, targets, temperature=temperature, chunk_size=chunk_size, lm_head_bias=b
        ),
    ):
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        logp, entropy = fn(h, w, b)
        ((logp * upstream).sum() + entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), h.grad, w.grad, b.grad))
    for want, got in zip(*results, strict=True):
        assert torch.allclose(got.double(), want.double(), atol=1e-5), (want - got).abs().max()


def test_masked_positions_get_exactly_zero_gradient():
    hidden, weight, _, targets = inputs(dtype=torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    mask = (torch.arange(37) % 3 == 0).float()
    logp, _ = token_logprobs(hidden, weight, targets, chunk_size=8)
    (logp * mask).sum().backward()
    assert torch.equal(hidden.grad[mask == 0], torch.zeros(int((mask == 0).sum()), 16))
    assert (hidden.grad[mask > 0].abs().sum(-1) > 0).all()
    # Weight gradient comes only from the unmasked positions.
    w_only = weight.detach().clone().requires_grad_(True)
    token_logprobs(hidden.detach()[mask > 0], w_only, targets[mask > 0], chunk_size=8)[0].sum().backward()
    assert torch.allclose(weight.grad, w_only.grad, atol=1e-6)


def test_backward_keeps_at_most_one_chunk_of_logits():
    n, v, chunk = 64, 500, 16
    hidden, weight, _, targets = inputs(n=n, v=v, dtype=torch.float32)
    hidden.requires_grad_(True)
    saved_shapes: list[tuple[int, ...]] = []

    def pack(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=chunk)
    # Only chunk inputs (hidden rows, the weight itself, targets) are kept; no [C, V] logits or probs.
    assert saved_shapes and not any(shape[-1:] == (v,) for shape in saved_shapes), saved_shapes
    (logp.sum() + entropy.sum()).backward()
    want = naive(hidden.detach().requires_grad_(True), weight, targets)
    assert torch.allclose(logp, want[0], atol=1e-5)


def test_no_grad_and_no_entropy_paths():
    hidden, weight, _, targets = inputs(dtype=torch.float32)
    with torch.no_grad():
        logp, entropy = token_logprobs(hidden, weight, targets, compute_entropy=False, chunk_size=10)
    assert entropy is None and logp.dtype == torch.float32
    assert torch.allclose(logp, naive(hidden, weight, targets)[0], atol=1e-5)
    empty, empty_entropy = token_logprobs(hidden[:0], weight, targets[:0])
    assert empty.shape == (0,) and empty_entropy.shape == (0,)


def test_rejects_inconsistent_shapes():
    hidden, weight, _, targets = inputs()
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_logprobs(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match="target_ids"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="target_ids must be in"):
        token_logprobs(hidden, weight, targets + 1000)


def test_matches_the_tiny_causal_lm_on_action_positions():
    transformers = pytest.importorskip("transformers")
    from lightning_agentrl.models.tiny import build_tiny_model

    path = build_tiny_model(".cache/lightning_agentrl")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, output_hidden_states=True)
    positions = torch.tensor([5, 6, 7, 30, 31, 46])  # positions that predict action tokens ids[0, p + 1]
    full = torch.log_softmax(out.logits[0, positions].float(), -1).gather(-1, ids[0, positions + 1, None])[
        :, 0
    ]
    logp, _ = token_logprobs(out.hidden_states[-1][0, positions], model.lm_head.weight, ids[0, positions + 1])
    assert torch.allclose(logp, full, atol=1e-5)

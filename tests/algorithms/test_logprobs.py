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
    upstream = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
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
    # Outputs are float32 by contract: compare to float32 precision, relative to each value's size.
    for want, got in zip(*results, strict=True):
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=5e-5), (want - got).abs().max()


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


@pytest.mark.parametrize("used", ["logprobs", "entropy"])
def test_an_output_outside_the_loss_costs_no_backward_and_the_gradients_stay_exact(used, monkeypatch):
    """The entropy is a metric unless there is an entropy bonus: its gradient is None in the backward (its
    [C, V] terms skipped), not zeros; a loss on the entropy alone gets its exact gradient too."""
    from lightning_agentrl.algorithms import logprobs

    hidden, weight, bias, targets = inputs()
    entropy_grads = []
    chunk_logits_grad = logprobs._chunk_logits_grad

    def spy(*args):
        entropy_grads.append(args[-1])
        return chunk_logits_grad(*args)

    monkeypatch.setattr(logprobs, "_chunk_logits_grad", spy)
    results = []
    for fn in (lambda h, w, b: naive(h, w, targets, 0.7, b),
               lambda h, w, b: token_logprobs(h, w, targets, temperature=0.7, chunk_size=8, lm_head_bias=b)):
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        logp, entropy = fn(h, w, b)
        (logp if used == "logprobs" else entropy).sum().backward()
        results.append((h.grad, w.grad, b.grad))
    assert len(entropy_grads) == 5 and all((g is None) == (used == "logprobs") for g in entropy_grads)
    for want, got in zip(*results, strict=True):
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=5e-5), (want - got).abs().max()


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


@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (1.0, 5), (0.7, 20), (0.3, 0)])
def test_sampling_logits_keep_the_ids_vllm_keeps(top_p, top_k):
    """The rule is vLLM's ``apply_top_k_top_p`` (what it samples from and, with processed_logprobs, reports)."""
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    from lightning_agentrl.algorithms.logprobs import sampling_logits

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    ours = sampling_logits(logits, 0.8, top_p, top_k)
    p = torch.full((64,), top_p) if top_p < 1 else None
    k = torch.full((64,), top_k) if top_k else None
    theirs = ops.apply_top_k_top_p_pytorch((logits / 0.8).clone(), k, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(torch.log_softmax(ours, -1)[~torch.isinf(ours)], torch.log_softmax(theirs, -1)[~torch.isinf(theirs)])


def nucleus_naive(hidden, weight, targets, temperature, top_p):
    probs = torch.softmax(hidden @ weight.T / temperature, -1)
    order = probs.argsort(-1, descending=True)
    sorted_probs = probs.gather(-1, order)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p  # the smallest top set reaching top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    keep[torch.arange(len(targets)), targets] = True
    kept = probs * keep
    return torch.log(kept / kept.sum(-1, keepdim=True)).gather(-1, targets[:, None])[:, 0]


def test_nucleus_logprobs_are_renormalized_over_the_kept_ids_with_finite_gradients():
    from lightning_agentrl.algorithms.logprobs import token_logprobs

    hidden, weight, _, targets = inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, entropy = token_logprobs(h, w, targets, temperature=0.8, top_p=0.5, chunk_size=7)
    assert torch.allclose(logp.double(), nucleus_naive(hidden, weight, targets, 0.8, 0.5), atol=1e-5)
    untruncated, _ = token_logprobs(hidden, weight, targets, temperature=0.8)
    assert (logp > untruncated).all()  # renormalized over less than the whole mass
    assert (entropy >= 0).all() and torch.isfinite(entropy).all()
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    # the logits of ids outside the nucleus (and not sampled) get no gradient through the log-probs
    w_only = weight.clone().requires_grad_(True)
    token_logprobs(hidden[:1], w_only, targets[:1], temperature=0.8, top_p=0.5, compute_entropy=False)[0].sum().backward()
    from lightning_agentrl.algorithms.logprobs import sampling_logits

    dropped = torch.isinf(sampling_logits(hidden[:1] @ weight.T, 0.8, 0.5, keep_ids=targets[:1]))[0]
    assert dropped.any() and torch.equal(w_only.grad[dropped], torch.zeros_like(w_only.grad[dropped]))


@pytest.mark.parametrize("top_k", [0, 7, "per-row"])
def test_the_head_shortcut_keeps_exactly_the_ids_the_full_sort_keeps(top_k):
    """Peaked rows are decided from the most likely ids (the head); flat ones fall back to the sort."""
    from lightning_agentrl.algorithms import logprobs

    gen = torch.Generator().manual_seed(3)
    decided_by_head = 0
    for scale in (0.5, 2.0, 6.0, 12.0):  # flat (nucleus past any head) to peaked (a few ids)
        for vocab in (300, 2048, 5000):
            z = torch.randn(24, vocab, generator=gen) * scale
            p = torch.rand(24, 1, generator=gen) * 0.95
            k = torch.randint(0, 50, (24, 1), generator=gen) if top_k == "per-row" else top_k
            rows_k = None if isinstance(k, int) and k <= 0 else logprobs._row_top_k(k, z)
            expected = logprobs._dropped_by_sort(z, rows_k, p)
            assert torch.equal(torch.isinf(logprobs.sampling_logits(z, 1.0, p, k)), expected)
            head = min(logprobs._HEAD_SIZE, vocab // 4)
            rows_p = p.expand(24, 1)
            decided_by_head += int(logprobs._dropped_from_head(z, rows_k, rows_p, head)[1].sum())
    assert decided_by_head > 0
    if top_k == 0:
        assert decided_by_head < 12 * 24  # flat rows went to the sort (a top-k shorter than the head never does)


def test_the_head_shortcut_declines_rows_it_cannot_decide():
    from lightning_agentrl.algorithms import logprobs

    def decided(z, k, p, head=64):
        return logprobs._dropped_from_head(z, k, p, head)[1].tolist()

    p = torch.tensor([[0.9]]).expand(2, 1)
    peaked = torch.arange(1000.0).flip(0).expand(2, 1000) * 0.5
    flat = torch.cat([peaked[:1], torch.zeros(1, 1000)])  # the second row's nucleus holds 900 ids
    assert decided(peaked, None, p) == [True, True] and decided(flat, None, p) == [True, False]
    # a top-k as long as the head, and a tie with the k-th largest running past the head's end
    assert decided(peaked, torch.tensor([[3], [64]]), None) == [True, False]
    tied = torch.cat([torch.tensor([[5.0, 4.0]]), torch.full((1, 998), 1.0)], dim=1)
    assert decided(tied, torch.full((1, 1), 3), None) == [False]
    assert torch.isinf(logprobs.sampling_logits(tied, top_k=3)).sum() == 0  # all 998 tied ids stay
    # a NaN logit: the row goes to the sort, which leaves it NaN rather than dropping the NaN id
    nan_row = torch.randn(1, 64) * 5
    nan_row[0, 3] = float("nan")
    assert decided(nan_row, torch.full((1, 1), 5), None, head=16) == [False]
    assert logprobs.sampling_logits(nan_row, top_k=5).log_softmax(-1).isnan().all()


def test_the_nucleus_boundary_and_the_most_likely_id():
    """Mass exactly 1 - p at an id drops it (the rule's <=); a nucleus of p ~ 0 still keeps one id."""
    from lightning_agentrl.algorithms import logprobs

    four = torch.cat([torch.zeros(1, 4), torch.full((1, 12), float("-inf"))], dim=1)  # 16 ids, the head is 4
    assert (~torch.isinf(logprobs.sampling_logits(four, top_p=0.5))).sum() == 2
    assert logprobs._dropped_from_head(four, None, torch.tensor([[0.5]]), 4)[1].all()
    peaked = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0)) * 4
    assert (~torch.isinf(logprobs.sampling_logits(peaked, top_p=1e-8))).sum(-1).tolist() == [1, 1]


def test_a_row_keeps_the_same_ids_alone_or_beside_rows_that_need_the_sort():
    """bf16-valued logits tie often; a row's path (head or sort), and so which tied ids it keeps,
    depends on that row alone, so a seeded request draws the same in any batch."""
    from lightning_agentrl.algorithms import logprobs

    gen = torch.Generator().manual_seed(4)
    rows = (torch.randn(16, 32000, generator=gen) * 4).bfloat16().float()
    alone = torch.isinf(logprobs.sampling_logits(rows, 1.0, 0.8))
    flat = torch.zeros(1, 32000)  # its nucleus is 80% of the vocabulary: the sort
    beside_flat = torch.isinf(logprobs.sampling_logits(torch.cat([rows, flat]), 1.0, 0.8))[:16]
    greedy_p = torch.cat([torch.full((16, 1), 0.8), torch.ones(1, 1)])  # top-p 1 (a greedy row): the sort
    beside_greedy = torch.isinf(logprobs.sampling_logits(torch.cat([rows, rows[:1]]), 1.0, greedy_p))[:16]
    assert torch.equal(alone, beside_flat) and torch.equal(alone, beside_greedy)


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 0), (0.8, 0), (1.0, 7), (0.6, 12)])
def test_closed_form_backward_equals_autograd_through_the_rule(top_p, top_k):
    """The fused backward (dW accumulated in place, dL/dz in closed form) against plain autograd through
    the same rule on full logits, with the nucleus and top-k filters, a temperature and both outputs."""
    from lightning_agentrl.algorithms.logprobs import _chunk_logprobs

    hidden, weight, bias, targets = inputs(n=29, v=61, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    up_lp, up_ent = torch.randn(29, generator=gen, dtype=torch.float64), torch.randn(29, generator=gen, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        if fused:
            lp, ent = token_logprobs(h, w, targets, temperature=0.7, top_p=top_p, top_k=top_k, chunk_size=6, lm_head_bias=b)
        else:
            lp, ent = _chunk_logprobs(h, w, b, targets, 0.7, top_p, top_k, True)
        ((lp.double() * up_lp).sum() + (ent.double() * up_ent).sum()).backward()
        grads.append((lp.detach(), ent.detach(), h.grad, w.grad, b.grad))
    for got, want in zip(*grads, strict=True):
        # float32 inside both (the rule's contract): equal to float32 rounding of values up to ~10
        assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5), (got - want).abs().max()

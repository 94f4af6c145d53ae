"""Log-probabilities (and entropy) of target tokens without materializing [N, V] logits.

Shapes:

    N  token positions that need a logprob (the caller passes only those, e.g. action tokens)
    H  hidden size of the last layer
    V  vocabulary size

A 32k-token packed batch with a 150k vocabulary would need 32k x 150k x 4 bytes = 19 GB of fp32
logits, and autograd would keep them for the backward pass. Here the positions are processed in
chunks of ``chunk_size``; each chunk's logits live only inside that chunk and are recomputed during
backward, so peak memory is one chunk's ``[chunk_size, V]`` beside one ``[V, H]`` gradient of the output
matrix, accumulated in place across chunks (:class:`_ChunkedLogprobs`).

**The log-prob rule** (one for every engine and the trainer; ``engine.logprobs: softmax``, below, is
the same rule without the filters): the log-prob of a token is its
log-probability under the distribution it is sampled from, which :func:`sampling_logits` defines:

    z = logits / T;  keep = top-k of z  and  the top-p nucleus of softmax(z) among those;
    log pi(y) = z_y - logsumexp_{v in keep} z_v      (y in keep)

The nucleus is the smallest set of the most likely ids whose mass reaches ``top_p`` (vLLM's
``apply_top_k_top_p``: ascending sort, drop the ids whose cumulative mass is <= 1 - top_p, keep the
most likely id always). It is decided per row from the 512 most likely ids when the nucleus lies
inside them (a few percent of a sort of a 150k vocabulary), else from a sort of the row; of ids
with equal probability at the nucleus's edge, which are kept follows the order the top-k or sort
returns (arbitrary, in vLLM too). vLLM reports exactly this with ``logprobs_mode="processed_logprobs"``
(:data:`lightning_agentrl.rollout.engine.VLLM_LOGPROBS_MODE`); the torch engine samples with it;
the trainer computes current, proximal and reference (KL) log-probs and the entropy with it
(:func:`token_logprobs` with ``top_p``/``top_k``). With ``top_p = 1`` and ``top_k = 0`` it is
``log_softmax(logits / T)``. Temperature 0 (greedy) has no distribution: engines then report
``log_softmax(logits)``, and training refuses it.

**The softmax option** (``engine.logprobs: softmax``, verl's trainer): sampling keeps the filter, but
the engine reports and the trainer computes ``log_softmax(logits / T)``, i.e. this rule with
``top_p = 1`` and ``top_k = 0``. The ratios then leave out the filter (off by the kept mass, the
same at both ends when the policy has not moved), and in exchange the ids the filter drops are in
every normalizer: an update that raises one of them lowers the log-prob of what was sampled, so
the policy gradient and the KL see it. Under the filtered rule a position whose nucleus is one id
has log-prob 0 and no gradient at all, whatever mass builds up outside it, so the KL cannot pull a
policy back from a nucleus of one wrong id. Seeing the dropped ids is not keeping their mass small:
docs/results/learn_cpu.md ("Scoring without the filter") measures both.

Gradients: the kept set is a selection, recomputed from the *current* logits and held fixed
(no gradient flows through which ids are kept; the set is piecewise constant in the weights, so
this is the exact gradient almost everywhere); gradients flow through ``z_y`` and through the
normalizer over the kept ids. This makes ``pi_theta`` the distribution the current weights would
sample from, so ``pi_theta / pi_behavior`` is the importance ratio between two samplers, which is
what PPO's ratio and the decoupled behavior/proximal weight need. The sampled id itself is always
kept: when the weights have moved so that the current nucleus excludes it, its probability under
the current sampler would be 0 and its log-ratio -inf (a NaN in the loss); kept, it gets a small
finite probability and a ratio far below 1 that PPO's clip bounds like any other far-off-policy
token. At lag 0 (the weights that sampled it) the sampled id is in the nucleus anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sampling_logits(
    logits: Tensor,
    temperature: Tensor | float = 1.0,
    top_p: Tensor | float = 1.0,
    top_k: Tensor | int = 0,
    keep_ids: Tensor | None = None,
) -> Tensor:
    """The logits of the distribution an engine samples from (the module's log-prob rule):
    ``logits / temperature`` with every id outside the top-k and the top-p nucleus set to -inf.

    ``temperature``, ``top_p`` and ``top_k`` are numbers or per-row tensors [B, 1] (``top_k`` 0 =
    all ids). ``keep_ids[B]``, if given, are kept whatever the filters say (the sampled ids, see the
    module docstring). Which ids are kept carries no gradient; the kept logits do.

    Shapes: logits[B, V] -> [B, V] float32.

    >>> z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    >>> torch.log_softmax(sampling_logits(z, top_p=0.7), -1).exp()
    tensor([[0.6250, 0.3750, 0.0000, 0.0000]])
    """
    z = logits.float() / temperature
    filter_p = not (isinstance(top_p, float | int) and top_p >= 1.0)
    filter_k = not (isinstance(top_k, int) and top_k <= 0)
    if not (filter_p or filter_k):
        return z
    with torch.no_grad():
        k = _row_top_k(top_k, z) if filter_k else None
        p = torch.as_tensor(top_p, device=z.device).reshape(-1, 1).expand(z.shape[0], 1) if filter_p else None
        drop, decided = _dropped_from_head(z, k, p, min(_HEAD_SIZE, z.shape[-1] // 4))
        if not bool(decided.all()):  # each row on its own: its result never depends on the others
            rest = (~decided).nonzero().squeeze(-1)
            drop[rest] = _dropped_by_sort(z[rest], None if k is None else k[rest], None if p is None else p[rest])
        if keep_ids is not None:
            drop.scatter_(-1, keep_ids.reshape(-1, 1), False)
    return z.masked_fill(drop, float("-inf"))


# The most likely ids the rule is first decided from, before a full sort of the vocabulary (at most a
# quarter of it): after pre-training or a warm start a 0.9 nucleus is a few ids, and a top-512 costs
# 3% of a sort of 150k ids, 40% of one of 2k (benchmarks/sampling_bench.py).
_HEAD_SIZE = 512


def _row_top_k(top_k: Tensor | int, z: Tensor) -> Tensor:
    """``top_k`` as one count per row [B, 1], 0 (all ids) and counts over the vocabulary as V."""
    vocab = z.shape[-1]
    k = torch.as_tensor(top_k, device=z.device).reshape(-1, 1).long()
    return torch.where(k <= 0, vocab, k.clamp(max=vocab)).expand(z.shape[0], 1)


def _dropped_by_sort(z: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """The ids outside the top-k and the top-p nucleus, from a full ascending sort (vLLM's
    ``apply_top_k_top_p``): the cumulative mass of an id and every less likely one is <= 1 - p."""
    z_sorted, order = z.sort(dim=-1, descending=False)  # ascending, as vLLM
    drop_sorted = torch.zeros_like(z_sorted, dtype=torch.bool)
    if k is not None:
        threshold = z_sorted.gather(-1, z.shape[-1] - k)
        drop_sorted |= z_sorted < threshold
    if p is not None:
        probs = z_sorted.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)
        drop_sorted |= probs.cumsum(dim=-1) <= 1 - p
        drop_sorted[:, -1] = False  # the most likely id, always
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _dropped_from_head(z: Tensor, k: Tensor | None, p: Tensor | None, head: int) -> tuple[Tensor, Tensor]:
    """:func:`_dropped_by_sort` from the ``head`` most likely ids of each row: (dropped [B, V], decided [B]).
    A row is not decided (its ``dropped`` is meaningless) when its top-k reaches the head's end, its
    nucleus reaches past the head, or its largest logit is NaN.

    Ids outside the head are less likely than all in it, so their cumulative mass (ascending, as the
    rule counts it) is at most the ``tail`` mass outside the head. The cumulative mass of the head's
    r-th id is ``tail + sum of the head's ids from r on``. When the head's least likely id is dropped,
    every id after it is too, and the head decides the whole row. Same rule; only the order of the
    float additions differs from the full sort's (a difference of float rounding, ~1e-7 in the mass).
    """
    rows = z.shape[0]
    if head <= 0:
        return torch.zeros_like(z, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool, device=z.device)
    values, ids = z.topk(head, dim=-1)  # [B, head], descending; a NaN comes first
    decided = ~values[:, 0].isnan()
    head_kept = torch.ones_like(values, dtype=torch.bool)
    if k is not None:
        head_kept = values >= values.gather(-1, k.clamp(max=head) - 1)  # ties with the k-th largest are kept
        decided &= (k[:, 0] < head) & ~head_kept[:, -1]  # a tie reaching the head's end may go on past it
    if p is None:  # top-k alone: the ids below the k-th largest
        return torch.ones_like(z, dtype=torch.bool).scatter(-1, ids, ~head_kept), decided
    head_weights = (values - values[:, :1]).exp()  # softmax numerators, the row's max at 1
    if k is None:
        everything = (z - values[:, :1]).exp().sum(dim=-1, keepdim=True)
        tail = (everything - head_weights.sum(dim=-1, keepdim=True)).clamp(min=0.0)
    else:  # every id outside the head is dropped by the top-k
        tail = head_weights.new_zeros(rows, 1)
        head_weights = head_weights.masked_fill(~head_kept, 0.0)
    total = tail + head_weights.sum(dim=-1, keepdim=True)
    cumulative = (tail + head_weights.flip(-1).cumsum(dim=-1).flip(-1)) / total  # ascending mass at each head id
    drop_head = cumulative <= 1 - p
    drop_head[:, 0] = False  # the most likely id, always
    decided &= drop_head[:, -1]
    return torch.ones_like(z, dtype=torch.bool).scatter(-1, ids, drop_head), decided


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    compute_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """One chunk: hidden[C, H] -> (logprobs[C], entropy[C] or an empty tensor), in float32."""
    return _chunk_logprobs_from_logits(F.linear(hidden, weight, bias), targets, temperature, top_p, top_k,
                                       compute_entropy)


def _chunk_logprobs_from_logits(
    raw_logits: Tensor, targets: Tensor, temperature: float, top_p: float, top_k: int, compute_entropy: bool
) -> tuple[Tensor, Tensor]:
    """logits[C, V] -> (logprobs[C], entropy[C] or an empty tensor) under the log-prob rule, in float32."""
    logits = sampling_logits(raw_logits, temperature, top_p, top_k, keep_ids=targets)  # [C, V]
    log_norm = torch.logsumexp(logits, dim=-1)  # [C]
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = target_logits - log_norm
    if not compute_entropy:
        return logprobs, logprobs.new_empty(0)
    probs = torch.softmax(logits, dim=-1)
    # H = logsumexp(z) - sum_v p_v z_v over the kept ids; dropped ids (z = -inf, p = 0) count 0, with a
    # finite stand-in for z so that no 0 * inf reaches the backward pass
    kept_logits = torch.where(torch.isinf(logits), torch.zeros_like(logits), logits)
    entropy = log_norm - (probs * kept_logits).sum(dim=-1)
    return logprobs, entropy


def _chunk_logits_grad(raw_logits: Tensor, targets: Tensor, temperature: float, top_p: float, top_k: int,
                       grad_logprobs: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """dL/d(raw logits)[C, V] of one chunk, in closed form and in place (two ``[C, V]`` float32 tensors at
    most, where autograd through :func:`_chunk_logprobs_from_logits` keeps four or five).

    With ``z' = sampling_logits(z)`` (``z / T``, dropped ids at -inf), ``p = softmax(z')`` (0 on dropped
    ids), ``g`` the upstream gradient of the log-probs and ``e`` that of the entropies:

        d log pi(y) / dz_v = (1[v = y] - p_v) / T
        d H / dz_v         = -p_v (z'_v - sum_u p_u z'_u) / T          (0 on dropped ids)

    The kept set is held fixed, as in the forward's gradient (module docstring).
    """
    scaled = sampling_logits(raw_logits, temperature, top_p, top_k, keep_ids=targets)  # [C, V] float32
    del raw_logits
    probs = torch.softmax(scaled, dim=-1)  # [C, V]
    if grad_entropy is not None:
        kept = torch.where(torch.isinf(scaled), torch.zeros_like(scaled), scaled)  # no 0 * inf
        del scaled
        mean = (probs * kept).sum(-1, keepdim=True)  # [C, 1]
        kept.sub_(mean).mul_(probs).mul_(-grad_entropy.float().unsqueeze(-1))  # e * dH/dz' (before / T)
        grad = kept
        grad.sub_(probs * grad_logprobs.float().unsqueeze(-1))
    else:
        del scaled
        grad = probs.mul_(-grad_logprobs.float().unsqueeze(-1))
    grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logprobs.float().unsqueeze(-1))
    return grad.div_(temperature)


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
    lm_head_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(W h_n / T)[y_n]`` and the entropy of that distribution, chunked over positions;
    with ``top_p < 1`` or ``top_k > 0``, over the kept ids only (the module's log-prob rule).

    ``hidden[n]`` is the last hidden state at the position that *predicts* ``target_ids[n]`` (i.e.
    already shifted by one). ``temperature``, ``top_p`` and ``top_k`` must equal the sampling ones
    so that these logprobs and the generator's behavior logprobs describe the same distribution.

    Gradients flow to ``hidden``, ``lm_head_weight`` and ``lm_head_bias``. Logits are computed in the
    inputs' dtype and reduced in float32; outputs are float32.

    Shapes: hidden[N, H], lm_head_weight[V, H], target_ids[N] int64, lm_head_bias[V]
    -> (logprobs[N] float32, entropy[N] float32 or None).

    >>> h, w = torch.randn(5, 8), torch.randn(11, 8)
    >>> y = torch.randint(0, 11, (5,))
    >>> lp, ent = token_logprobs(h, w, y, chunk_size=2)
    >>> torch.allclose(lp, torch.log_softmax(h @ w.T, -1).gather(-1, y[:, None])[:, 0], atol=1e-6)
    True
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[1]}], got shape {tuple(lm_head_weight.shape)}"
        )
    if target_ids.shape != hidden.shape[:1]:
        raise ValueError(f"target_ids must be [N={hidden.shape[0]}], got shape {tuple(target_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab_size = lm_head_weight.shape[0]
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= vocab_size):
        raise ValueError(f"target_ids must be in [0, {vocab_size})")

    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    options = (temperature, top_p, top_k, compute_entropy, chunk_rows(chunk_size, vocab_size))
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, lm_head_weight, lm_head_bias, target_ids, options)
    return logprobs, (entropy if compute_entropy else None)


CHUNK_LOGIT_BYTES = 32 * 2**20
"""At most this many bytes of float32 logits per chunk: at a large vocabulary the chunk's ``[C, V]`` tensors,
not the positions, bound the peak (two of them beside the ``[V, H]`` gradient in the backward)."""


def chunk_rows(chunk_size: int, vocab_size: int) -> int:
    """Positions per chunk: ``chunk_size``, fewer where ``[chunk, vocab]`` float32 logits would pass
    :data:`CHUNK_LOGIT_BYTES`, at least 1.

    >>> chunk_rows(256, 32_000), chunk_rows(256, 152_064), chunk_rows(8, 10**9)
    (256, 55, 1)
    """
    return max(1, min(chunk_size, CHUNK_LOGIT_BYTES // (4 * vocab_size)))


class _ChunkedLogprobs(torch.autograd.Function):
    """:func:`token_logprobs`'s forward and backward, chunk by chunk, with the output matrix's gradient
    accumulated in place (a fused linear log-prob, as Liger's fused linear cross-entropy).

    Forward keeps only the inputs. Backward recomputes each chunk's logits ``z_c = h_c W^T + b``
    ([C, V]), takes ``dL/dz_c`` through :func:`_chunk_logprobs` (the same math as forward, so the same
    rule and filters), and then

        dW += (dL/dz_c)^T h_c      [V, H], added in place into one buffer
        dh_c = (dL/dz_c) W          [C, H]
        db += sum_c dL/dz_c         [V]

    so the backward holds one ``[V, H]`` gradient and one chunk's ``[C, V]`` tensors at a time, where
    autograd over checkpointed chunks built a ``[V, H]`` gradient per chunk and then added it to the
    running one (two at once: at a 152k vocabulary that second matrix was most of the peak).

    An output the loss does not use (the entropy, without an entropy bonus: a metric only) reaches the
    backward as None, not as zeros (``set_materialize_grads(False)``), so its ``[C, V]`` terms are skipped.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, options):
        temperature, top_p, top_k, compute_entropy, chunk_size = options
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.options = options
        parts = [_chunk_logprobs(hidden[i : i + chunk_size], weight, bias, targets[i : i + chunk_size],
                                 temperature, top_p, top_k, compute_entropy)
                 for i in range(0, hidden.shape[0], chunk_size)]
        return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, top_p, top_k, compute_entropy, chunk_size = ctx.options
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logprobs is None:  # only the entropy is in the loss
            grad_logprobs = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for i in range(0, hidden.shape[0], chunk_size):
            h = hidden[i : i + chunk_size]
            g_ent = grad_entropy[i : i + chunk_size] if compute_entropy and grad_entropy is not None else None
            grad_z = _chunk_logits_grad(F.linear(h, weight, bias), targets[i : i + chunk_size], temperature, top_p,
                                        top_k, grad_logprobs[i : i + chunk_size], g_ent).to(weight.dtype)
            if need_w:
                grad_w.addmm_(grad_z.T, h.to(weight.dtype))
            if need_h:
                grad_h[i : i + chunk_size] = (grad_z @ weight).to(hidden.dtype)
            if need_b:
                grad_b += grad_z.sum(0).to(bias.dtype)
            del grad_z
        return grad_h, grad_w, grad_b, None, None

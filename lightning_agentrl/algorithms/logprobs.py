"""Log-probabilities (and entropy) of target tokens without materializing [N, V] logits.

Shapes:

    N  token positions that need a logprob (the caller passes only those, e.g. action tokens)
    H  hidden size of the last layer
    V  vocabulary size

A 32k-token packed batch with a 150k vocabulary would need 32k x 150k x 4 bytes = 19 GB of fp32
logits, and autograd would keep them for the backward pass. Here the positions are processed in
chunks of ``chunk_size``; each chunk's logits live only inside that chunk and are recomputed during
backward (activation checkpointing), so peak memory is one chunk's ``[chunk_size, V]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    inverse_temperature: float,
    compute_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """One chunk: hidden[C, H] -> (logprobs[C], entropy[C] or an empty tensor), in float32."""
    logits = F.linear(hidden, weight, bias).float() * inverse_temperature  # [C, V]
    log_norm = torch.logsumexp(logits, dim=-1)  # [C]
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = target_logits - log_norm
    if not compute_entropy:
        return logprobs, logprobs.new_empty(0)
    probs = torch.softmax(logits, dim=-1)
    # H = logsumexp(z) - sum_v p_v z_v
    entropy = log_norm - (probs * logits).sum(dim=-1)
    return logprobs, entropy


def token_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
    lm_head_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(W h_n / T)[y_n]`` and the entropy of that distribution, chunked over positions.

    ``hidden[n]`` is the last hidden state at the position that *predicts* ``target_ids[n]`` (i.e.
    already shifted by one). ``temperature`` must equal the sampling temperature so that these
    logprobs and the generator's behavior logprobs describe the same distribution.

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
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab_size = lm_head_weight.shape[0]
    if target_ids.numel() and (target_ids.min() < 0 or target_ids.max() >= vocab_size):
        raise ValueError(f"target_ids must be in [0, {vocab_size})")

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, lm_head_weight, lm_head_bias)
    )
    inverse_temperature = 1.0 / temperature
    logprob_chunks: list[Tensor] = []
    entropy_chunks: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (
            hidden[start : start + chunk_size],
            lm_head_weight,
            lm_head_bias,
            target_ids[start : start + chunk_size],
            inverse_temperature,
            compute_entropy,
        )
        if needs_grad:
            # Keep only the chunk's inputs for backward; its [C, V] logits are recomputed there.
            logprobs, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logprobs, entropy = _chunk_logprobs(*args)
        logprob_chunks.append(logprobs)
        entropy_chunks.append(entropy)

    if not logprob_chunks:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    return torch.cat(logprob_chunks), (torch.cat(entropy_chunks) if compute_entropy else None)

"""The policy model: how ``fit`` and ``sft`` load it, and its forward passes over packed sequences.

A micro-batch is one flat stream of ``n`` tokens holding whole segments (positions restart per
segment, each segment attending only to itself). Log-probs are taken only at the ``t`` positions that
carry a loss, chunk by chunk, so the ``[n, vocab]`` logits are never materialized.

    n  tokens of a micro-batch       H  hidden size       t  targets (positions with a loss)
"""

from __future__ import annotations

import contextlib

import torch

from lightning_agentrl.algorithms.logprobs import token_logprobs
from lightning_agentrl.models.packed import block_mask_hidden_states, packed_hidden_states
from lightning_agentrl.settings import EngineSettings, ModelSettings


def pretrained_kwargs(model: ModelSettings) -> dict:
    """``from_pretrained`` arguments from ``model.dtype`` and ``model.attn_implementation``."""
    kwargs = {"dtype": getattr(torch, model.dtype)}
    if model.attn_implementation:
        kwargs["attn_implementation"] = model.attn_implementation
    return kwargs


def load_policy(model_path: str, model: ModelSettings, *, seed: int | None):
    """The trained policy as ``fit`` and ``sft`` load it: ``model_path`` in ``model.dtype``, gradient
    checkpointing as set, no KV cache (training runs whole sequences), LoRA adapters on a frozen base with
    ``model.lora_rank``, in training mode (``from_pretrained`` returns eval mode)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path, **pretrained_kwargs(model))
    if model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    policy.config.use_cache = False
    if model.lora:
        from lightning_agentrl.lora import apply_lora

        policy = apply_lora(policy, model, seed=seed)  # freezes the base
    return policy.train()


def load_reference(model_path: str, model: ModelSettings):
    """The KL reference as a frozen copy: ``model_path`` in ``model.dtype``, eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_path, **pretrained_kwargs(model)).eval()
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def kl_reference(policy, reference):
    """The KL reference: its own frozen copy ``reference``, or (None, under LoRA) the policy with its adapters
    disabled (the base itself: no second copy of the weights)."""
    if reference is not None:
        yield reference
        return
    with policy.disable_adapter():
        yield policy


def zero3_loading_context(trainer):
    """Under ZeRO-3, tell transformers (``HfDeepSpeedConfig``) so that ``from_pretrained`` creates
    the model partitioned and initializes and loads each weight gathered; without it, weight
    initialization indexes partitioned stubs. Transformers holds it weakly: it applies while the
    returned object is alive, so keep it only while models load (later models, e.g. the exported
    policy, must not be partitioned)."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if not getattr(strategy, "zero_stage_3", False):
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(strategy.config)


def partitioned(model) -> bool:
    """Parameters partitioned by DeepSpeed ZeRO-3 (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def hidden_states(model, input_ids, position_ids, segment_ids) -> torch.Tensor:
    """Last hidden states [n, H] of one packed micro-batch: positions restart per segment and
    segments never see each other. Varlen flash kernels find the boundaries in the position
    ids; every other kernel runs the segments as length-bucketed padded batches, so the cost
    is the sum of squared segment lengths, not the square of the pack's length."""
    decoder = model.get_decoder()
    if str(model.config._attn_implementation).startswith("flash_attention"):
        out = decoder(input_ids=input_ids[None], position_ids=position_ids[None])
        return out.last_hidden_state[0]
    if partitioned(model):
        # ZeRO-3 gathers each layer's parameters collectively on every forward: every rank must
        # call the decoder equally often, so one call over the pack (block mask), not a bucket count
        # that differs by rank
        return block_mask_hidden_states(decoder, input_ids, position_ids, segment_ids)
    return packed_hidden_states(decoder, input_ids, position_ids, segment_ids)


class OutputLogprobs(torch.nn.Module):
    """:func:`token_logprobs` through a model's output embedding, as a module of its own.

    Why a module: the log-probs read the output embedding's weight directly (never materializing
    all logits), outside the ``lm_head`` module's forward. Under ZeRO-3 that weight is a partitioned
    stub except while a module that uses it runs, so it is registered here as this module's
    external parameter: DeepSpeed gathers it for this forward and again for its backward. Without
    ZeRO-3 this is a plain call. The head is held without registering it as a submodule (it
    belongs to the model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        head = model.get_output_embeddings()
        self._head = (head,)  # a tuple: not a submodule
        for parameter in (head.weight, getattr(head, "bias", None)):
            if parameter is not None and hasattr(parameter, "ds_id"):
                import deepspeed

                deepspeed.zero.register_external_parameter(self, parameter)

    def forward(self, hidden, target_ids, *, temperature: float, chunk_size: int, top_p: float = 1.0, top_k: int = 0):
        (head,) = self._head
        return token_logprobs(
            hidden, head.weight, target_ids, temperature=temperature, top_p=top_p, top_k=top_k, chunk_size=chunk_size,
            lm_head_bias=getattr(head, "bias", None),
        )


def token_logprobs_at(head: OutputLogprobs, hidden, input_ids, targets_at, *, engine: EngineSettings,
                      chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) [t] of ``input_ids[targets_at]`` through ``head``; ``hidden[t-1]`` predicts token
    t. The distribution is the engine's: its temperature and, with ``engine.filtered_logprobs``, its top-p/top-k
    (algorithms/logprobs.py); otherwise the plain softmax."""
    filtered = engine.filtered_logprobs
    return head(
        hidden[targets_at - 1],
        input_ids[targets_at],
        temperature=max(engine.temperature, 1e-6),
        top_p=engine.top_p if filtered else 1.0,
        top_k=engine.top_k if filtered else 0,
        chunk_size=chunk_size,
    )

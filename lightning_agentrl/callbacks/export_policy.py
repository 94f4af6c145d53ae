"""Write the trained policy as a plain Hugging Face model folder at the end of training.

Under every strategy the folder holds full weights: under ZeRO-3 each rank holds a shard of every
parameter, so all ranks gather (layer by layer, :func:`gather_full_state_dict`) and rank 0 writes.
``python -m lightning_agentrl export`` does the same from any checkpoint after the fact. Under LoRA the
folder holds the merged model, and ``adapter_directory`` peft's adapter folder beside it.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from typing_extensions import override

from lightning_agentrl.lora import adapter_state, hf_model, is_lora, merged_state_dict, save_adapter
from lightning_agentrl.strategies import gather_full_state_dict


class ExportPolicy(L.Callback):
    def __init__(self, directory: str | Path, tokenizer, *, adapter_directory: str | Path | None = None) -> None:
        self.directory = Path(directory)
        self.adapter_directory = Path(adapter_directory) if adapter_directory is not None else None
        self.tokenizer = tokenizer

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        policy = pl_module.policy
        if is_lora(policy):  # gathered by every rank (collectives under ZeRO-3), written by rank 0
            merged, adapters = merged_state_dict(policy), adapter_state(policy)
            if trainer.is_global_zero:
                save_policy(hf_model(policy).config, merged, self.directory, self.tokenizer)
                if self.adapter_directory is not None:
                    save_adapter(policy, self.adapter_directory, adapters)
            return
        weights = gather_full_state_dict(policy)  # a collective under ZeRO-3: every rank
        if trainer.is_global_zero:
            save_policy(policy.config, weights, self.directory, self.tokenizer)


def save_policy(config, weights: dict, directory: Path, tokenizer=None) -> None:
    """A Hugging Face folder (config, safetensors, tokenizer) from a config and full weights.

    The model is built on the meta device and takes ``weights`` as they are, so nothing is
    initialized or allocated twice; tied embeddings are saved once, as ``save_pretrained`` does.
    The folder is for generation: the KV cache that training turns off (``use_cache``) is on in its
    ``config.json`` and ``generation_config.json``."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.use_cache = True  # off while training (AgentRLModule); without it transformers decodes ~5x slower
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=True, assign=True)
    # assign=True gives the output embedding its own copy of the gathered tensor: tie it again, or the
    # folder stores the embedding twice and a reload unties it
    model.tie_weights()
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)

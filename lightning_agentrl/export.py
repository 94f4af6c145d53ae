"""``python -m lightning_agentrl export CHECKPOINT OUT``: a Hugging Face model folder from any checkpoint.

A checkpoint is a Lightning file (``last.ckpt`` of a single-process or DDP run) or a DeepSpeed
folder (ZeRO-2/3 write ``last.ckpt`` as a folder of per-rank shards). Both are read on the CPU,
without processes or DeepSpeed's engine: a ZeRO folder is consolidated with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` (fp32 master weights). The model's config and
tokenizer come from the model path the run trained (kept in the checkpoint's hyperparameters).

A LoRA checkpoint holds the adapters only: the base is loaded from that model path, and ``OUT`` gets
the merged model, or with ``adapter=True`` (``--adapter``) peft's adapter folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from lightning_agentrl.callbacks.export_policy import save_policy
from lightning_agentrl.lora import apply_lora, check_base_fingerprint, merged_state_dict, save_adapter

POLICY_PREFIX = "policy."


def load_checkpoint(path: str | Path) -> dict:
    """The Lightning checkpoint dict of a file or a DeepSpeed checkpoint folder. A file is read
    with ``weights_only=True``: a checkpoint is data, and nothing in it is executed."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not (path.is_file() or path.is_dir()):
        raise ValueError(f"{path} is neither a checkpoint file nor a DeepSpeed checkpoint folder")
    if path.is_dir():
        if not (path / "latest").exists() and not any(path.glob("*/mp_rank_*_model_states.pt")):
            raise ValueError(f"{path} is a folder but not a DeepSpeed checkpoint (no */mp_rank_*_model_states.pt)")
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            consolidated = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(consolidated))
            return torch.load(consolidated, map_location="cpu", weights_only=False)  # written just now, by us
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a truncated, empty or foreign file
        raise ValueError(f"{path} is not a readable checkpoint ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{path} is not a Lightning checkpoint (no state_dict)")
    return state


def export_policy(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None, adapter: bool = False) -> Path:
    """Write the checkpoint's policy to ``out`` as ``config.json`` + safetensors + tokenizer.

    ``dtype`` (e.g. ``bfloat16``) casts floating-point weights; by default they keep the dtype the
    checkpoint holds (fp32 masters for a ZeRO checkpoint). ``adapter``: a LoRA run's adapter folder instead."""
    from transformers import AutoConfig, AutoTokenizer

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; name a new or existing folder to write the model into")
    cast = None
    if dtype is not None:
        cast = getattr(torch, dtype, None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise ValueError(f"--dtype {dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16, float32)")
    state = load_checkpoint(checkpoint)
    model_path = state.get("hyper_parameters", {}).get("model_path")
    if model_path is None:
        raise ValueError(f"{checkpoint}: no model_path in its hyperparameters; not a lightning-agentrl checkpoint?")
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state["state_dict"].items() if k.startswith(POLICY_PREFIX)}
    if not weights:
        raise ValueError(f"{checkpoint}: its state_dict holds no {POLICY_PREFIX}* weights")
    if not (Path(model_path) / "config.json").exists():
        raise ValueError(
            f"{checkpoint} was trained from {model_path!r}, which is not a model folder seen from here "
            f"(run from the folder the run started in, or keep that model folder)"
        )
    model_settings = state["hyper_parameters"].get("settings", {}).get("model", {})
    lora = model_settings.get("lora_rank", 0) > 0
    if adapter and not lora:
        raise ValueError(f"--adapter: {checkpoint} is not of a LoRA run (model.lora_rank 0): it has no adapter")
    if adapter and cast is not None:
        raise ValueError("--dtype applies to the merged model; --adapter writes the adapters as trained")
    if lora:
        check_base_fingerprint(state, model_path, setting=str(checkpoint))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if lora:
        policy = _lora_policy(model_path, model_settings, weights)
        if adapter:
            save_adapter(policy, out)
            tokenizer.save_pretrained(out)
            return out
        weights = merged_state_dict(policy)
    if cast is not None:
        weights = {k: v.to(cast) if v.is_floating_point() else v for k, v in weights.items()}
    save_policy(AutoConfig.from_pretrained(model_path), weights, out, tokenizer)
    if not (out / "config.json").exists():
        raise ValueError(f"nothing was written to {out}")
    return out


def _lora_policy(model_path: str, model_settings: dict, adapters: dict):
    """The base of ``model_path`` with the run's LoRA adapters (``model.lora_*``) loaded into it."""
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.settings import ModelSettings

    lora = ModelSettings.model_validate({k: v for k, v in model_settings.items() if k.startswith("lora_")})
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora)
    result = policy.load_state_dict(adapters, strict=False)
    if result.unexpected_keys or any(".lora_" in key for key in result.missing_keys):
        raise ValueError(f"the checkpoint's adapters do not fit {model_path} with its LoRA settings "
                         f"({(result.unexpected_keys + result.missing_keys)[0]})")
    return policy

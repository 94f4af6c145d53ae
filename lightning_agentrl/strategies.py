"""Training strategies: plain, DDP, and DeepSpeed ZeRO-2/3 on GPUs *and* on CPU.

On GPUs ``make_strategy("deepspeed_stage_2")`` is Lightning's stock ``DeepSpeedStrategy``. On a CPU
machine the same name gives :class:`CPUDeepSpeedStrategy`, so a laptop runs the very ZeRO code path
(partitioned optimizer state, ZeRO-3 partitioned parameters, DeepSpeed checkpoints) that a GPU
cluster runs; only the collective backend (gloo) and the device differ.

Optimizer: DeepSpeed wraps whatever ``LightningModule.configure_optimizers`` returns. We use plain
``torch.optim.AdamW`` on CPU: ZeRO-2/3 accept it (Lightning's config sets
``zero_allow_untested_optimizer``), it matches the non-DeepSpeed path bit for bit in the update rule,
and it avoids JIT-compiling DeepSpeed's ``cpu_adam`` extension (~55 s on a 2-core machine). With
``offload_optimizer=True`` DeepSpeed expects its own ``DeepSpeedCPUAdam`` for speed; return that from
``configure_optimizers`` in that case.

Getting full weights out (for the generation engine) after an optimizer step::

    named = gather_full_state_dict(policy_hf_model)   # every rank must call it under ZeRO-3
    engine.update_weights(named, version)

Example:
    >>> strategy = make_strategy("deepspeed_stage_2", accelerator="cpu")   # doctest: +SKIP
    >>> Trainer(accelerator="cpu", devices=1, strategy=strategy).fit(module, data)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy
from typing_extensions import override

from lightning_agentrl.settings import StrategyName
from sandbox_server.launch import free_port

STRATEGY_NAMES = get_args(StrategyName)
TORCH_EXTENSIONS_DIR = Path(".cache/torch_extensions")


def make_strategy(
    name: str,
    *,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    accelerator: str = "auto",
    gradient_clipping: float | None = None,
    exclude_frozen_parameters: bool = False,
) -> str | Strategy:
    """The Lightning strategy for ``name`` on ``accelerator`` ("auto" means CUDA if available).

    ``"auto"`` and ``"ddp"`` are returned as strings for the Trainer to resolve. The DeepSpeed names
    return a strategy object: Lightning's ``DeepSpeedStrategy`` on GPUs, :class:`CPUDeepSpeedStrategy`
    on CPU. ``offload_parameters`` only exists in ZeRO-3. ``gradient_clipping`` goes into the
    DeepSpeed config (with ZeRO the gradients are partitioned, so only DeepSpeed can clip them).
    ``exclude_frozen_parameters``: checkpoints leave out what does not train (a LoRA run's base, which a
    resume loads from the model path again).
    """
    if name not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {name!r}; valid choices: {', '.join(STRATEGY_NAMES)}")
    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ValueError(f"unknown accelerator {accelerator!r}; valid choices: auto, cpu, gpu, cuda")
    if (offload_optimizer or offload_parameters) and not name.startswith("deepspeed"):
        raise ValueError(f"offload_optimizer/offload_parameters need a deepspeed strategy, got {name!r}")
    if offload_parameters and name != "deepspeed_stage_3":
        raise ValueError(
            "offload_parameters needs strategy 'deepspeed_stage_3' (ZeRO-2 keeps parameters whole)"
        )
    if not name.startswith("deepspeed"):
        return name

    stage = 3 if name == "deepspeed_stage_3" else 2
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    strategy_cls = CPUDeepSpeedStrategy if on_cpu else DeepSpeedStrategy
    strategy = strategy_cls(
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_parameters=offload_parameters,
        # one RolloutBatch per step: the loader has no batch size for Lightning to read
        logging_batch_size_per_gpu=1,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )
    if gradient_clipping is not None:
        strategy.config["gradient_clipping"] = gradient_clipping
    return strategy


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` made to run ZeRO on CPU (gloo collectives), 1 or more processes.

    Only GPU assumptions are removed; the ZeRO machinery, the config and the checkpoint format are the
    parent's. Two overrides suffice:

    - ``setup_environment``: the parent raises for any accelerator but CUDA.
    - ``parallel_devices``: Lightning lists CPU devices without an index (``cpu``), but DeepSpeed takes
      the root device's index as its device rank (``None`` fails there) and the parent checks that the
      indices equal the local ranks. Numbering them ``cpu:0 .. cpu:n-1`` satisfies both, and the root
      device becomes ``cpu:<local_rank>``. Tensors moved to ``cpu:k`` are ordinary CPU tensors.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        prepare_cpu_deepspeed_environment()
        super().__init__(*args, **kwargs)

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, CPUAccelerator):
            raise RuntimeError(
                f"{type(self).__name__} runs on CPU only, got {type(self.accelerator).__name__};"
                " use DeepSpeedStrategy on GPUs"
            )
        # Skip DeepSpeedStrategy's CUDA-only check, keep the rest of the setup (DDPStrategy's).
        super(DeepSpeedStrategy, self).setup_environment()

    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    @override
    def parallel_devices(self, parallel_devices: list[torch.device] | None) -> None:
        if parallel_devices is not None:
            parallel_devices = [torch.device("cpu", index) for index in range(len(parallel_devices))]
        self._parallel_devices = parallel_devices


def prepare_cpu_deepspeed_environment() -> None:
    """Environment DeepSpeed needs on CPU; every variable is set only when absent.

    ``DS_ACCELERATOR=cpu`` stops DeepSpeed probing for CUDA (it must be set before ``import
    deepspeed``); ``TORCH_EXTENSIONS_DIR`` keeps the JIT-compiled ops (~35-55 s to build) in a
    project cache instead of the home folder. ``MASTER_ADDR``/``MASTER_PORT`` (a free loopback port)
    let a single process rendezvous with itself; Lightning's launcher reuses them for every rank.
    ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are deliberately not set here: Lightning reads a set
    ``LOCAL_RANK`` as "processes launched externally" and would not spawn the other ranks of a
    multi-device run; Lightning sets all three per rank in ``setup_distributed``.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR.resolve()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def gather_full_state_dict(
    strategy_or_module: Strategy | torch.nn.Module, *, prefix: str = "", trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unpartitioned) parameters and buffers as detached CPU tensors, named as in ``state_dict``.

    Pass the HF model itself to get HF names (``model.layers.0...``, ``lm_head.weight``), or a strategy /
    LightningModule with ``prefix`` naming the submodule (e.g. ``"policy."``): keys are filtered by and
    stripped of ``prefix``. Under ZeRO-3 each rank holds a shard of every parameter; they are
    all-gathered one module at a time with ``deepspeed.zero.GatheredParameters`` and copied to CPU, so
    the extra accelerator memory at any moment is one layer's parameters, never a second model. A
    collective under ZeRO-3: every rank must call it. Under other strategies the tensors are already
    whole. Call it after an optimizer step, outside the forward/backward pass. ``trainable_only``: the
    parameters that require grad (LoRA adapters), no buffers.
    """
    return dict(iter_full_state(strategy_or_module, prefix=prefix, trainable_only=trainable_only))


def iter_full_state(
    strategy_or_module: Strategy | torch.nn.Module, *, prefix: str = "", trainable_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`gather_full_state_dict` as a stream of ``(name, CPU tensor)``, module by module."""
    module = _unwrap(strategy_or_module)
    wanted = set(module.state_dict().keys())  # persistent buffers and parameters, tied ones twice
    if trainable_only:
        wanted = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    found = False
    for module_name, sub in module.named_modules(remove_duplicate=False):
        tensors = [
            (f"{module_name}.{name}" if module_name else name, tensor)
            for name, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        ]
        tensors = [(name, t) for name, t in tensors if name in wanted and name.startswith(prefix)]
        if not tensors:
            continue
        found = True
        with _gathered([t for _, t in tensors]):
            # a copy: the gathered storage is freed (re-partitioned) when the context exits
            copies = [(name[len(prefix) :], t.detach().to("cpu", copy=True)) for name, t in tensors]
        yield from copies
    if not found:
        raise ValueError(f"no tensor name starts with prefix {prefix!r}")


@contextlib.contextmanager
def _gathered(tensors: list[torch.Tensor]) -> Iterator[None]:
    # read-only: no rank's edits are written back to the shards
    with gathered_parameters(tensors, writable=False):
        yield


@contextlib.contextmanager
def gathered_parameters(tensors: list[torch.Tensor], *, writable: bool) -> Iterator[None]:
    """Inside the context the ZeRO-3 partitioned ``tensors`` are whole (others are as they are). ``writable``:
    what rank 0 writes into them is partitioned back to every rank on exit (every rank must enter: a
    collective); else edits are lost. Parameters made under ZeRO-3 (``deepspeed.zero.Init``) are partitioned
    as they are created, so an initialization written into them afterwards needs this."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]  # ZeRO-3 marks its parameters
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0 if writable else None):
        yield


def _unwrap(strategy_or_module: Strategy | torch.nn.Module) -> torch.nn.Module:
    if isinstance(strategy_or_module, Strategy):
        module = strategy_or_module.lightning_module
        if module is None:
            raise ValueError(
                "the strategy has no LightningModule attached yet; call this after Trainer.fit started"
            )
        return module
    if not isinstance(strategy_or_module, torch.nn.Module):
        raise TypeError(f"expected a Strategy or torch.nn.Module, got {type(strategy_or_module).__name__}")
    if type(strategy_or_module).__name__ == "DeepSpeedEngine":  # no import: deepspeed is optional
        return strategy_or_module.module
    return strategy_or_module


__all__ = [
    "STRATEGY_NAMES",
    "CPUDeepSpeedStrategy",
    "gather_full_state_dict",
    "gathered_parameters",
    "iter_full_state",
    "make_strategy",
    "prepare_cpu_deepspeed_environment",
]

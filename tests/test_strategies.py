"""make_strategy, and real DeepSpeed ZeRO-2/3 fits of the tiny HF model on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_agentrl.strategies import (
    STRATEGY_NAMES,
    CPUDeepSpeedStrategy,
    gather_full_state_dict,
    make_strategy,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (extra: gpu or cpu-engines)"
)
DEEPSPEED_ENV = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Unset the variables a CPU DeepSpeed strategy sets; monkeypatch restores them afterwards."""
    for name in DEEPSPEED_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_unknown_strategy_names_the_valid_choices() -> None:
    with pytest.raises(ValueError, match="deepspeed_stage_2, deepspeed_stage_3"):
        make_strategy("fsdp")


def test_offload_needs_a_matching_deepspeed_stage() -> None:
    with pytest.raises(ValueError, match="deepspeed"):
        make_strategy("ddp", offload_optimizer=True)
    with pytest.raises(ValueError, match="deepspeed_stage_3"):
        make_strategy("deepspeed_stage_2", offload_parameters=True)


def test_plain_strategies_are_left_to_the_trainer() -> None:
    assert make_strategy("auto") == "auto"
    assert make_strategy("ddp", accelerator="cpu") == "ddp"
    assert set(STRATEGY_NAMES) == {"auto", "ddp", "deepspeed_stage_2", "deepspeed_stage_3"}


@requires_deepspeed
def test_deepspeed_strategy_per_accelerator(clean_env: pytest.MonkeyPatch) -> None:
    cpu = make_strategy("deepspeed_stage_3", offload_optimizer=True, accelerator="cpu")
    assert isinstance(cpu, CPUDeepSpeedStrategy)
    assert cpu.config["zero_optimization"]["stage"] == 3
    assert cpu.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert Path(os.environ["TORCH_EXTENSIONS_DIR"]) == (Path.cwd() / ".cache/torch_extensions")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(os.environ["MASTER_PORT"]) < 65536
    gpu = make_strategy("deepspeed_stage_2", accelerator="gpu")
    assert type(gpu) is DeepSpeedStrategy and gpu.config["zero_optimization"]["stage"] == 2


@requires_deepspeed
def test_cpu_environment_keeps_values_already_set(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_PORT", "29123")
    clean_env.setenv("TORCH_EXTENSIONS_DIR", "/opt/ext")
    CPUDeepSpeedStrategy(stage=2)
    assert os.environ["MASTER_PORT"] == "29123" and os.environ["TORCH_EXTENSIONS_DIR"] == "/opt/ext"


@requires_deepspeed
def test_cpu_devices_are_numbered_by_local_rank(clean_env: pytest.MonkeyPatch) -> None:
    strategy = CPUDeepSpeedStrategy(stage=2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    assert [d.index for d in strategy.parallel_devices] == [0, 1]


def test_gather_full_state_dict_of_a_plain_module_and_prefix() -> None:
    outer = torch.nn.Sequential(torch.nn.Linear(3, 2))
    full = gather_full_state_dict(outer, prefix="0.")
    assert sorted(full) == ["bias", "weight"]
    assert torch.equal(full["weight"], outer[0].weight)
    assert full["weight"].data_ptr() != outer[0].weight.data_ptr()  # a copy, safe to ship elsewhere
    with pytest.raises(ValueError, match="prefix"):
        gather_full_state_dict(outer, prefix="policy.")


# Runs in a subprocess: DeepSpeed initializes torch.distributed and process-global state that must
# not leak into other tests. Writes what the parent asserts on as JSON.
FIT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import lightning as L, torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM
    from lightning_agentrl.models.tiny import build_tiny_model
    from lightning_agentrl.strategies import gather_full_state_dict, make_strategy

    stage, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.policy = AutoModelForCausalLM.from_pretrained(build_tiny_model(".cache/lightning_agentrl"))
            self.losses, self.gathered = [], None

        def training_step(self, batch, batch_idx):
            loss = self.policy(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            # After the optimizer step: what a weight sync to the generation engine would send.
            self.gathered = gather_full_state_dict(self.trainer.strategy, prefix="policy.")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = CausalLM()
    initial = {k: v.clone() for k, v in module.policy.state_dict().items()}
    batch = torch.randint(0, 2048, (2, 32))
    data = DataLoader(batch.repeat(3, 1), batch_size=2)  # the same batch three times: loss must drop
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=make_strategy(stage, accelerator="cpu"), max_steps=3,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )
    trainer.fit(module, data)

    checkpoints = sorted(str(p) for p in Path(out).rglob("*.ckpt"))
    saved = get_fp32_state_dict_from_zero_checkpoint(checkpoints[0], tag="checkpoint")
    saved = {k.removeprefix("policy."): v for k, v in saved.items()}
    gathered = module.gathered
    json.dump({
        "losses": module.losses,
        "global_step": trainer.global_step,
        "checkpoints": checkpoints,
        "hf_names": sorted(initial),
        "gathered_names": sorted(gathered),
        "shapes_match": all(gathered[k].shape == initial[k].shape for k in initial),
        "num_changed": sum(not torch.equal(gathered[k], initial[k]) for k in initial),
        "num_params": len(initial),
        "local_numel": sum(p.data.numel() for p in module.policy.parameters()),
        "full_numel": sum(v.numel() for v in initial.values()),
        "max_diff_to_checkpoint": max((gathered[k] - saved[k]).abs().max().item() for k in saved),
        "checkpoint_names": sorted(saved),
    }, open(f"{out}/result.json", "w"))
    """
)


def _fit_in_subprocess(stage: str, out: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", FIT_SCRIPT, stage, str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize("stage", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_zero_fit_on_cpu_trains_checkpoints_and_gathers_full_weights(stage: str, tmp_path: Path) -> None:
    result = _fit_in_subprocess(stage, tmp_path)

    losses = result["losses"]
    assert result["global_step"] == 3 and len(losses) == 3
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # three steps on one batch
    assert len(result["checkpoints"]) == 1
    assert (Path(result["checkpoints"][0]) / "checkpoint").is_dir()  # DeepSpeed's sharded folder format
    # Full HF-named weights, all updated by training, equal to what the ZeRO checkpoint holds.
    assert result["gathered_names"] == result["hf_names"]
    assert result["checkpoint_names"] == result["hf_names"]
    assert result["shapes_match"]
    assert result["num_changed"] == result["num_params"]
    assert result["max_diff_to_checkpoint"] == 0.0
    if stage == "deepspeed_stage_3":
        # The large parameters really are partitioned (the embeddings and lm_head); ZeRO-3 keeps
        # those under stage3_param_persistence_threshold (1e5 elements) whole on every rank.
        assert result["local_numel"] == result["full_numel"] - 2 * 2048 * 128  # embed_tokens, lm_head
    else:
        assert result["local_numel"] == result["full_numel"]

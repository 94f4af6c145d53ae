"""``model.path``: an incomplete model folder, a config.json that is not JSON, or a hub id neither cached nor
reachable is named before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_agentrl.__main__ import main
from tests.failing import DEAD, error_line


def test_a_hub_id_that_is_not_cached_needs_a_reachable_hub(monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--model.path=no-such-org/no-such-model"]
    assert main(args) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: model.path: no-such-org/no-such-model is not a local folder nor in the hub cache, and the hub ({DEAD}) is unreachable"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(args) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert main([*args, "--offline"]) == 0


def _model_folder(tmp_path: Path, tiny_model_path: Path, *names: str) -> Path:
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    for name in names:
        shutil.copy(tiny_model_path / name, folder / name)
    return folder


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["config.json"], "has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json)"),
        (["config.json", "tokenizer.json", "tokenizer_config.json"], "has no weights (*.safetensors, pytorch_model*.bin"),
        (["config.json", "tokenizer.json", "model.safetensors.index.json"],
         "lacks 1 of the 2 weight shards model.safetensors.index.json names: model-00002-of-00002.safetensors"),
    ],
)
def test_an_incomplete_model_folder_is_named_before_any_model_loads(tmp_path, tiny_model_path, files, expected, capsys):
    import json
    import shutil

    if "model.safetensors.index.json" in files:  # a sharded checkpoint whose second shard never arrived
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00002-of-00002.safetensors"}}
        folder = _model_folder(tmp_path, tiny_model_path, "config.json", "tokenizer.json")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        shutil.copy(tiny_model_path / "model.safetensors", folder / "model-00001-of-00002.safetensors")
    else:
        folder = _model_folder(tmp_path, tiny_model_path, *files)
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--model.path={folder}", "--offline"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: model.path: {folder} {expected}")


def test_a_complete_model_folder_passes_and_vllm_needs_safetensors(tmp_path, tiny_model_path, capsys):
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--offline"]
    assert main([*args, f"--model.path={tiny_model_path}"]) == 0
    assert main([*args, f"--model.path={tiny_model_path}", "--engine.kind=vllm"]) == 0
    capsys.readouterr()
    folder = _model_folder(tmp_path, tiny_model_path, "config.json", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja")
    (folder / "pytorch_model.bin").write_bytes(b"")  # the name is what counts here
    assert main([*args, f"--model.path={folder}"]) == 0
    assert main([*args, f"--model.path={folder}", "--engine.kind=vllm"]) == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"error: model.path: {folder} has .bin weights only; engine.kind=vllm needs safetensors")


def test_a_config_json_that_is_not_json_is_one_error_line(tmp_path, tiny_model_path, capsys):
    folder = _model_folder(tmp_path, tiny_model_path, "tokenizer.json", "tokenizer_config.json", "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama", ')
    assert main(["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", "--offline", f"--model.path={folder}"]) == 2
    assert error_line(capsys.readouterr().err).startswith(f"error: model.path: {folder} has a config.json that is not JSON")


@pytest.mark.parametrize("model_path", ["tiny", "model.gguf"])
def test_a_cache_dir_that_cannot_be_a_folder_is_one_error_line_before_any_work(tmp_path, model_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file where the cache's parent folder would be")
    if model_path.endswith(".gguf"):
        model_path = str(tmp_path / model_path)
        Path(model_path).write_bytes(b"GGUF")  # the cache is checked before the file is read
    run_dir, cache = tmp_path / "run", blocker / "sub"
    args = ["fit", "--config", "configs/smoke.yaml", f"--run.dir={run_dir}", f"--model.path={model_path}"]
    assert main([*args, f"--model.cache_dir={cache}"]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: model.cache_dir: {cache} cannot be created: {blocker} is a file, not a folder")
    assert main([*args, f"--model.cache_dir={blocker}"]) == 2
    assert error_line(capsys.readouterr().err) == f"error: model.cache_dir: {blocker} is a file, not a folder"
    assert not run_dir.exists()


def test_a_gguf_cache_that_cannot_be_written_is_a_gguf_error(tmp_path):
    from lightning_agentrl.models.gguf_convert import GGUFError, converted_model

    model, blocker = tmp_path / "model.gguf", tmp_path / "file.txt"
    model.write_bytes(b"GGUF")
    blocker.write_text("not a folder")
    with pytest.raises(GGUFError, match=r"model\.gguf could not be converted: the cache .*file\.txt/sub/gguf cannot be "
                                        r"written: NotADirectoryError: Not a directory"):
        converted_model(str(model), blocker / "sub")

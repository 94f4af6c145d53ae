"""Each ``engine.kind`` is declared once (:data:`lightning_agentrl.engines.ENGINES`): how its engine is built and
what the run starts for it; and what the start-up checks ask of each kind's model."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import get_args

import pytest

from lightning_agentrl.__main__ import main
from lightning_agentrl.engines import ENGINES, make_engine, start_local_servers
from lightning_agentrl.rollout.engine import TorchEngine
from lightning_agentrl.settings import ENGINE_KINDS, EngineSettings, load_settings

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"


def test_every_engine_kind_the_settings_take_is_declared_once():
    kinds = set(get_args(EngineSettings.model_fields["kind"].annotation))
    assert set(ENGINES) == set(ENGINE_KINDS) == kinds == set(EngineSettings._by_tag)  # the section's classes
    for kind, model in EngineSettings._by_tag.items():
        assert get_args(model.model_fields["kind"].annotation) == (kind,)


def test_no_module_tells_the_engine_kinds_apart_by_name():
    """A kind's traits (``ENGINE_KINDS``) are read instead: adding a kind is one line in each table."""
    names = "|".join(ENGINE_KINDS)
    compared = re.compile(rf"""kind\s*(==|!=|in)\s*\(?["']({names})["']""")
    package = REPO / "lightning_agentrl"
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted(package.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line)]
    assert found == []


def test_the_torch_kind_builds_its_engine_in_this_process_and_starts_no_server(tiny_model_path, tiny_tokenizer,
                                                                               tmp_path):
    settings = load_settings(CONFIG, [f"--run.dir={tmp_path / 'run'}", "--engine.max_batch_size=3",
                                      "--engine.admission_window_ms=25"])
    assert start_local_servers(settings, str(tiny_model_path), tmp_path) is None
    engine = make_engine(settings, str(tiny_model_path), tiny_tokenizer)
    assert isinstance(engine, TorchEngine)
    assert (engine.max_batch_size, engine.admission_window_s) == (3, 0.025)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--engine.kind=vllm", "--engine.admission_window_ms=5"], "engine.admission_window_ms applies to engine.kind=torch"),
    (["--engine.admission_window_ms=-1"], "engine.admission_window_ms"),
])
def test_an_admission_window_the_engine_cannot_take_is_one_error_line(overrides, message, capsys):
    assert main(["validate", "--config", str(CONFIG), "--offline", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_servers_named_by_engine_urls_are_used_not_started(tmp_path):
    settings = load_settings(CONFIG, ["--engine.kind=vllm_server", "--engine.urls=[http://127.0.0.1:9]"])
    assert start_local_servers(settings, "never-loaded", tmp_path) is None


@pytest.mark.parametrize(("kind", "status"), [("torch", 0), ("vllm", 2), ("vllm_server", 2)])
def test_the_vllm_kinds_need_safetensors_weights_before_the_run_starts(kind, status, tmp_path, tiny_model_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_path / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(b"")  # the name is what counts here
    assert main(["validate", "--config", str(CONFIG), "--offline", f"--model.path={folder}",
                 f"--engine.kind={kind}"]) == status
    if status:
        assert f"error: model.path: {folder} has .bin weights only" in capsys.readouterr().err

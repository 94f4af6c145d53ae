"""The ``policy/`` folder ``fit`` writes is a model to generate from: the KV cache on, tied embeddings once."""

from __future__ import annotations

import json

from tests.fitting import REPO, scripted_fit
from tests.test_learning_signal import maze_settings


def test_the_policy_folder_keeps_the_kv_cache_on_and_stores_a_tied_embedding_once(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model

    tied = build_tiny_model(REPO / ".cache" / "lightning_agentrl",
                            TinyModelConfig(hidden_size=64, num_hidden_layers=1, tie_word_embeddings=True))
    settings = maze_settings(tmp_path, f"--model.path={tied}", "--trainer.max_steps=1")
    result, _ = scripted_fit(settings)
    policy = result.policy_dir
    assert json.loads((policy / "config.json").read_text())["use_cache"] is True  # training turns it off
    assert json.loads((policy / "generation_config.json").read_text())["use_cache"] is True
    with safe_open(str(policy / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    original = AutoModelForCausalLM.from_pretrained(tied)
    assert names == set(original.state_dict()) - {"lm_head.weight"}  # saved once, as the original folder is
    reloaded = AutoModelForCausalLM.from_pretrained(policy)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()

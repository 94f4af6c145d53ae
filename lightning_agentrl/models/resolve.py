"""``model.path`` -> what ``from_pretrained`` reads: the tiny local model built once, a named model or GGUF file
converted once (``gguf_convert.py``), a local folder made absolute, else a hub id as it is."""

from __future__ import annotations

from pathlib import Path

from lightning_agentrl.models.gguf_convert import GGUFError, converted_model, is_gguf_source
from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model
from lightning_agentrl.settings import Settings, SettingsError


def resolve_model_path(settings: Settings) -> str:
    """``tiny`` builds (once) the local tiny model; a named model or a GGUF file is converted (once) into an HF
    folder (``models/gguf_convert.py``); anything else goes to ``from_pretrained``."""
    if is_gguf_source(settings.model.path):
        try:
            return str(converted_model(settings.model.path, settings.model.cache_dir))
        except GGUFError as err:  # e.g. the named model's package could not be installed
            raise SettingsError(f"model.path: {err}") from None
    if settings.model.path != "tiny":
        local = Path(settings.model.path)
        # absolute: the path is kept in checkpoints, which are read from other folders (export, resume)
        return str(local.resolve()) if local.is_dir() else settings.model.path
    config = TinyModelConfig(hidden_size=settings.model.tiny_hidden_size, num_hidden_layers=settings.model.tiny_num_layers)
    return str(build_tiny_model(settings.model.cache_dir, config).resolve())


__all__ = ["resolve_model_path"]

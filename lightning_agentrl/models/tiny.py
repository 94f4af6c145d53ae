"""Build a tiny random-init causal LM and a locally trained tokenizer, with a chat template.

No model hub is needed: the tokenizer is a byte-level BPE trained in under a second on Python
sources shipped with the interpreter plus a few tool-call examples, and the model is a Llama
config with random weights. Both are saved with ``save_pretrained`` and reloaded by the caller
with ``AutoTokenizer`` / ``AutoModelForCausalLM``: the same code path a real model takes.

The architecture is Llama because ``AutoTokenizer`` would apply Qwen2's own pre-tokenizer to a
Qwen2 config and change the ids. ``head_dim`` is 64 because vLLM's CPU attention rejects 16.

Example:
    >>> path = build_tiny_model(".cache/lightning_agentrl")   # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(path)           # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_agentrl.models import pad_token_id as tokenizer_pad_id

# ChatML-style template. The generation prompt ends with "<|im_start|>assistant\n" and an
# assistant turn ends with the eos token "<|im_end|>", so generation stops on eos.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]


@dataclass(frozen=True)
class TinyModelConfig:
    """Sizes of the tiny local model. Changing any field builds a new cached copy."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _training_corpus() -> list[str]:
    """Python sources from the standard library (always present) plus tool-call examples."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p for p in stdlib.glob("*.py"))[:120]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in names]
    examples = [
        '<tool_call>{"name": "read_file", "arguments": {"path": "utils.py"}}</tool_call>',
        '<tool_call>{"name": "write_file", "arguments": {"path": "utils.py", "content": "def f():\\n    return 1\\n"}}</tool_call>',
        '<tool_call>{"name": "run", "arguments": {"command": "python -m pytest -q"}}</tool_call>',
        '<tool_call>{"name": "submit", "arguments": {}}</tool_call>',
    ]
    return texts + examples * 50


def _build_tokenizer(config: TinyModelConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=SPECIAL_TOKENS + TOOL_TAGS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(cache_dir: str | os.PathLike, config: TinyModelConfig | None = None) -> Path:
    """Build (once) and return the folder holding the tiny model and its tokenizer.

    The folder name carries a fingerprint of ``config``; an existing complete folder is reused.
    The write is atomic (build in a temporary folder, then rename) so a killed build never
    leaves a half-written model behind.
    """
    config = config or TinyModelConfig()
    target = Path(cache_dir) / f"tiny-llama-{config.fingerprint()}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    return _save_random_llama(_build_tokenizer(config), config, target)


def build_tiny_model_for_tokenizer(
    tokenizer_dir: str | os.PathLike, cache_dir: str | os.PathLike, config: TinyModelConfig
) -> Path:
    """A tiny random Llama on a real tokenizer (its whole vocabulary, its chat template), built once.

    ``config.vocab_size`` is ignored: the vocabulary is the tokenizer's. With a real vocabulary the
    embedding dominates the size (151,669 x 32 for Qwen3), so keep ``hidden_size`` small and tie it.

    >>> build_tiny_model_for_tokenizer(".cache/tokenizers/qwen3", ".cache/lightning_agentrl",
    ...     TinyModelConfig(hidden_size=32, num_hidden_layers=1, tie_word_embeddings=True))  # doctest: +SKIP
    """
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    key = hashlib.sha256(config.fingerprint().encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        key.update((tokenizer_dir / name).read_bytes())
    target = Path(cache_dir) / f"tiny-llama-{tokenizer_dir.name}-{key.hexdigest()[:12]}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    return _save_random_llama(AutoTokenizer.from_pretrained(tokenizer_dir), config, target)


def _save_random_llama(tokenizer, config: TinyModelConfig, target: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    pad_token_id = tokenizer_pad_id(tokenizer)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(model_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, target)
    except OSError:  # another process won the race: keep its copy
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target

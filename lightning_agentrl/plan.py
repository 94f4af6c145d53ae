"""The memory plan: bytes per GPU of every part of a run, computed before anything loads.

Why it exists: a run that cannot fit fails late and obscurely (vLLM refusing a KV cache smaller
than one sequence, an out-of-memory error after minutes of model loading and sandbox start-up). The
plan computes, from the model's ``config.json`` alone and the settings, what each part needs on
one GPU; ``python -m lightning_agentrl plan`` prints it and ``fit`` refuses, on GPUs, a run whose
plan does not fit, naming the part, the shortfall and the setting that would make it fit.

Symbols used in the formulas (all per model, from ``config.json``):

    V  vocabulary size              H  hidden size             I  MLP intermediate size
    L  decoder layers               a  attention heads         k  key/value heads
    d  head dimension               P  parameters              N  GPUs the trainer shards over
    b  bytes per element of the parameters (bf16: 2, fp32: 4)
    n  tokens of the longest micro-batch: ``max(trainer.micro_batch_tokens, env.max_context_tokens)``
       (micro-batches hold whole episodes, so one episode longer than micro_batch_tokens is its own)
    C  tokens of one log-prob chunk (``trainer.logprob_chunk_tokens``)

The figures are estimates of what the code in this repository allocates, not measurements: the
formulas count the tensors that must exist (weights, gradients, Adam states, saved activations,
KV blocks) and add documented allowances for what they cannot see (CUDA contexts, allocator
fragmentation, vLLM's profiling peak). ``scripts/gpu_smoke.sh`` writes the prediction beside the
measured peak so the allowances can be checked.

Two phases share a GPU when vLLM runs beside the trainer (colocation):

- ``generate``: the trainer's resident state (weights, gradients, optimizer states) plus the
  engine's whole share (``engine.gpu_memory_utilization`` of the GPU).
- ``train``: the trainer's resident state plus activations of one micro-batch; the engine's share
  too unless ``engine.sleep_while_training`` frees it (vLLM sleep level 1: weights to CPU memory,
  KV cache dropped) for the length of the optimizer step.

Example:
    >>> shape = ModelShape(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
    ...                    num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
    ...                    tie_word_embeddings=True, qkv_bias=True)
    >>> shape.num_parameters()          # Qwen2.5-1.5B: 1.54 B
    1543714304
    >>> shape.kv_bytes_per_token(2)     # 2 (K, V) x 28 layers x 2 heads x 128 dims x 2 bytes
    28672
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lightning_agentrl.settings import Settings, SettingsError

GiB = 1 << 30

#: A CUDA context, cuBLAS/cuDNN workspaces and allocator fragmentation, per process on a GPU
#: (the trainer rank is one; each vLLM engine core is another). An allowance, not a measurement.
PROCESS_RESERVE_BYTES = 1 * GiB

#: vLLM's non-KV, non-weight memory inside its share: the activation peak of its profiling
#: forward pass, sampler buffers and (without ``enforce_eager``) CUDA graphs. vLLM measures the
#: real figure at start-up and gives the KV cache what is left; this allowance stands in for it.
ENGINE_OVERHEAD_BYTES = 2 * GiB

#: DeepSpeed bucket sizes Lightning's ``DeepSpeedStrategy`` configures (elements).
DEEPSPEED_REDUCE_BUCKET = 200_000_000
DEEPSPEED_ALLGATHER_BUCKET = 200_000_000

#: The largest GPU memory ``parse_bytes`` accepts: far above any GPU, far below float overflow.
MAX_GPU_BYTES = 1 << 50

#: ``config.json`` keys of mixture-of-experts models (Qwen-MoE, Mixtral, DeepSeek), which the
#: dense formulas below would undercount.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(SettingsError):
    """A run whose memory plan does not fit its GPUs; the message names the part and the fix."""


# ---------------------------------------------------------------------------------------------
# The model's shape


_BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
"""The block holding each projection of :meth:`ModelShape.projections` in a decoder layer (its module name)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-style decoder that memory depends on (from ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> ModelShape:
        """From a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral and alike).

        ``head_dim`` defaults to H / a; q/k/v biases are read from ``attention_bias`` and are on
        for ``model_type: qwen2`` (Qwen2 has them without a config key). Every size must be a
        positive integer (``num_key_value_heads`` and ``head_dim`` may be absent or null: their
        defaults); anything else raises :class:`SettingsError` naming the field and ``source``.
        """
        if not isinstance(config, dict):
            raise SettingsError(f"{source}: not a JSON object of model settings (got {type(config).__name__})")
        experts = [f"{key}={config[key]!r}" for key in MOE_KEYS if config.get(key) not in (None, 0, False)]
        if experts:
            raise SettingsError(
                f"{source}: {', '.join(experts)}: MoE models are not planned yet (their experts' "
                "parameters, gradients and optimizer states would be undercounted); plan a dense model"
            )
        problems = []

        def size(key: str, required: bool = True) -> int | None:
            value = config.get(key)
            if value is None:
                if required:
                    problems.append(f"{key} is {'null' if key in config else 'missing'}")
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key} must be a positive integer, got {value!r}")
                return None
            return value

        def flag(key: str, default: bool) -> bool:
            value = config.get(key)
            if value is None:
                return default
            if not isinstance(value, bool):
                problems.append(f"{key} must be true or false, got {value!r}")
                return default
            return value

        vocab, hidden = size("vocab_size"), size("hidden_size")
        intermediate, layers = size("intermediate_size"), size("num_hidden_layers")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", required=False) or heads
        head_dim = size("head_dim", required=False)
        tie = flag("tie_word_embeddings", False)
        bias = flag("attention_bias", config.get("model_type") == "qwen2")
        if head_dim is None and hidden and heads:
            if hidden % heads:
                problems.append(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim)")
            head_dim = hidden // heads
        if problems:
            raise SettingsError(f"{source}: {'; '.join(problems)} (a decoder-only transformer config is needed)")
        return cls(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie, qkv_bias=bias,
        )

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer.

        ``q: H*a*d (+a*d)``, ``k, v: H*k*d (+k*d) each``, ``o: a*d*H``, ``gate, up, down: 3*H*I``,
        two RMSNorm weights ``2*H``; the bracketed biases only with ``qkv_bias``.
        """
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h

    def embedding_parameters(self) -> int:
        """``V*H`` for the input embedding, twice when the output head is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_parameters(self) -> int:
        """``P = L * layer + embeddings + H`` (the final norm)."""
        return self.num_layers * self.layer_parameters() + self.embedding_parameters() + self.hidden_size

    def projections(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear projection of one decoder layer, by its module name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapted_projections(self, targets: list[str] | None = None) -> list[tuple[int, int]]:
        """``(in, out)`` of every projection LoRA adapts, over all layers: all of them by default (peft's
        ``all-linear``), else those peft's own matching picks for ``targets`` among the module names of a
        decoder-only model (``model.layers.<l>.self_attn.q_proj``, ``model.layers.<l>.mlp.up_proj``), so a
        bare name (``q_proj``) adapts every layer and a full name one layer only."""
        if not targets:
            return [shape for _ in range(self.num_layers) for shape in self.projections().values()]
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists

        config = LoraConfig(target_modules=list(targets))
        return [
            shape for layer in range(self.num_layers) for name, shape in self.projections().items()
            if check_target_module_exists(config, f"model.layers.{layer}.{_BLOCK_OF[name]}.{name}")
        ]

    def lora_parameters(self, rank: int, targets: list[str] | None = None) -> int:
        """LoRA adapter parameters: ``sum r * (in + out)`` over the adapted projections
        (:meth:`adapted_projections`).

        >>> ModelShape(100, 64, 256, 2, 4, 2, 16, True).lora_parameters(8)  # r (7H + 2ad + 2kd + 3I) per layer
        22528
        """
        return rank * sum(i + o for i, o in self.adapted_projections(targets))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token: ``2 (K and V) * L * k * d * b``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


#: Published ``config.json`` shapes of the models the shipped recipes name, so that ``plan`` works
#: without the model hub. Any other model: a local folder, the Hugging Face cache, or ``--model-config``.
KNOWN_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen2.5-7B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen2.5-32B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
# Instruct and Coder variants share their base model's shape.
for _base in list(KNOWN_CONFIGS):
    _size = _base.split("-")[-1]
    for _name in (f"{_base}-Instruct", f"Qwen/Qwen2.5-Coder-{_size}", f"Qwen/Qwen2.5-Coder-{_size}-Instruct"):
        KNOWN_CONFIGS[_name] = KNOWN_CONFIGS[_base]


def load_model_config(settings: Settings, model_config: str | Path | None = None) -> dict:
    """The ``config.json`` of ``model.path`` without loading weights or, if avoidable, the network.

    In order: ``model_config`` (a file), the tiny model's sizes, a local folder, the shapes in
    :data:`KNOWN_CONFIGS`, the Hugging Face cache / hub (``AutoConfig``).
    """
    if model_config is not None:
        return _read_json(Path(model_config))
    path = settings.model.path
    if path == "tiny":
        from lightning_agentrl.models.tiny import TinyModelConfig

        tiny = TinyModelConfig(hidden_size=settings.model.tiny_hidden_size, num_hidden_layers=settings.model.tiny_num_layers)
        return {
            "model_type": "llama", "vocab_size": tiny.vocab_size, "hidden_size": tiny.hidden_size,
            "intermediate_size": tiny.intermediate_size, "num_hidden_layers": tiny.num_hidden_layers,
            "num_attention_heads": tiny.num_attention_heads, "num_key_value_heads": tiny.num_key_value_heads,
            "head_dim": tiny.head_dim, "tie_word_embeddings": tiny.tie_word_embeddings,
        }
    from lightning_agentrl.models.gguf_convert import GGUFError, converted_model, is_gguf_source

    try:
        if is_gguf_source(path):  # a named model or a GGUF file: its converted folder (converted now if need be)
            path = str(converted_model(path, settings.model.cache_dir))
    except GGUFError as err:
        raise SettingsError(f"model.path: {err}") from None
    if (Path(path) / "config.json").is_file():
        return _read_json(Path(path) / "config.json")
    if path in KNOWN_CONFIGS:
        return dict(KNOWN_CONFIGS[path])
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path).to_dict()
    except Exception as err:  # any failure means the same thing to the user
        raise SettingsError(
            f"model.path: cannot read the config.json of {path!r} ({err}); pass --model-config FILE"
        ) from err


def model_config_source(settings: Settings, model_config: str | Path | None = None) -> str:
    """Where :func:`load_model_config` reads from, for error messages."""
    if model_config is not None:
        return str(model_config)
    path = settings.model.path
    if path != "tiny" and (Path(path) / "config.json").is_file():
        return str(Path(path) / "config.json")
    return f"the config.json of model.path={path!r}"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SettingsError(f"{path}: cannot read it as a config.json ({err})") from err


# ---------------------------------------------------------------------------------------------
# Pure formulas


@dataclass(frozen=True)
class TrainerState:
    """Bytes per GPU of the trained copy: ``params`` + ``grads`` + ``optimizer`` on the GPU,
    ``optimizer_cpu`` in host memory (ZeRO optimizer offload)."""

    params: int
    grads: int
    optimizer: int
    optimizer_cpu: int = 0


def optimizer_bytes_per_parameter(param_bytes: int, deepspeed: bool) -> int:
    """Adam's state per parameter, ``K`` in the ZeRO paper.

    DeepSpeed with 16-bit parameters keeps an fp32 master copy plus fp32 m and v: ``K = 12``.
    ``torch.optim.AdamW`` (plain and DDP runs) keeps m and v in the parameters' dtype: ``K = 2*b``.
    """
    return 12 if deepspeed and param_bytes == 2 else 2 * param_bytes


def trainer_state_bytes(
    num_params: int, *, param_bytes: int, stage: int, num_gpus: int, optimizer_per_param: int, offload_optimizer: bool
) -> TrainerState:
    """Parameters, gradients and optimizer states on one of ``N`` GPUs (Rajbhandari et al. 2020,
    "ZeRO", Fig. 1), with ``Psi = P`` and ``b``-byte parameters and gradients:

    ========  ==========  ==========  ===========
    stage     params      grads       optimizer
    ========  ==========  ==========  ===========
    0 (DDP)   b*P         b*P         K*P
    2         b*P         b*P/N       K*P/N
    3         b*P/N       b*P/N       K*P/N
    ========  ==========  ==========  ===========

    With ``offload_optimizer`` the ``K*P/N`` bytes live in CPU memory instead.

    >>> trainer_state_bytes(1000, param_bytes=2, stage=2, num_gpus=4, optimizer_per_param=12, offload_optimizer=False)
    TrainerState(params=2000, grads=500, optimizer=3000, optimizer_cpu=0)
    """
    if stage not in (0, 2, 3):
        raise ValueError(f"stage must be 0, 2 or 3, got {stage}")
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    shard = num_gpus if stage >= 2 else 1
    params = param_bytes * num_params // (num_gpus if stage == 3 else 1)
    grads = param_bytes * num_params // shard
    optimizer = optimizer_per_param * num_params // shard
    if offload_optimizer:
        return TrainerState(params, grads, 0, optimizer)
    return TrainerState(params, grads, optimizer)


def layer_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes autograd saves per token in one Hugging Face Llama/Qwen2 decoder layer (sdpa or flash
    attention), counted tensor by tensor:
    ``8*H + 8 + 4*a + b*(4*H + 2*d + 2*a*d + 2*k*d + 4*I)``.

    Each of the two RMSNorms saves its input upcast to fp32 and the fp32 ``rsqrt`` (``4*H + 4``
    bytes), its normalized input and its output in the parameters' dtype (``2*H*b``); rotary
    embedding keeps cos and sin (``2*d*b``); attention keeps q, k, v after rotation, its output
    (``(2*a*d + 2*k*d)*b``) and the fp32 log-sum-exp of each head (``4*a``); the MLP keeps the gate and
    up outputs, SiLU's output and the down projection's input (``4*I*b``). Eager attention's ``[a, n, n]``
    scores are extra (:func:`attention_matrix_bytes`). Checked tensor by tensor against
    ``torch.autograd.graph.saved_tensors_hooks`` for SmolLM2-135M's layer: 45,100 bytes in fp32,
    24,876 in bf16 (``tests/test_plan.py``).

    >>> smollm2 = ModelShape(49152, 576, 1536, 30, 9, 3, 64, True)
    >>> layer_activation_bytes_per_token(smollm2, 4), layer_activation_bytes_per_token(smollm2, 2)
    (45100, 24876)
    """
    h, i, a, k, d = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    return 8 * h + 8 + 4 * a + dtype_bytes * (4 * h + 2 * d + 2 * a * d + 2 * k * d + 4 * i)


def attention_matrix_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, attn_implementation: str | None) -> int:
    """Attention-mask and score tensors of one packed micro-batch, at worst.

    flash_attention_*: none (segments are separated by position ids). Otherwise the module runs
    length buckets of ``b`` segments padded to ``L`` (:mod:`lightning_agentrl.models.packed`) and
    the model builds a ``[b, L, L]`` bool mask, ``b*L*L <= n*n`` bytes (equality when one segment
    fills the micro-batch, the worst case counted here); ``eager`` also saves scores and
    probabilities, ``2*a*n*n*b`` per layer (counted once: with checkpointing only one layer's exist
    at a time, without it this understates by a factor L, which makes eager at these lengths
    hopeless either way).
    """
    impl = attn_implementation or "sdpa"
    if impl.startswith("flash_attention"):
        return 0
    mask = tokens * tokens
    if impl == "eager":
        mask += 2 * shape.num_heads * tokens * tokens * dtype_bytes
    return mask


CRITIC_N = "(the micro-batch's n, or one segment of env.max_context_tokens after env.max_observation_chars of context)"


def critic_forward_tokens(settings: Settings, n: int) -> int:
    """The longest forward of the privileged critic, beside micro-batches of ``n`` tokens: it runs over whole
    segments, each after its episode's critic context (at most ``env.max_observation_chars`` tokens), in chunks of
    about a micro-batch; a chunk is longer only when one segment with its context is."""
    return max(n, settings.env.max_context_tokens + settings.env.max_observation_chars)


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, gradient_checkpointing: bool) -> int:
    """Saved activations of one forward/backward over ``n`` tokens.

    Without checkpointing every layer keeps its tensors: ``L * n * s`` with ``s`` the bytes per token
    of :func:`layer_activation_bytes_per_token`. With checkpointing (Hugging Face checkpoints each
    decoder layer) only each layer's input stays, and one layer's tensors exist again during its
    recomputation: ``L * n * H * b + n * s``.

    >>> qwen_1_5b = ModelShape(151936, 1536, 8960, 28, 12, 2, 128, True, True)
    >>> activation_bytes(qwen_1_5b, 32768, 2, gradient_checkpointing=True)
    6226182144
    """
    per_layer = tokens * layer_activation_bytes_per_token(shape, dtype_bytes)
    if not gradient_checkpointing:
        return shape.num_layers * per_layer
    return shape.num_layers * tokens * shape.hidden_size * dtype_bytes + per_layer


def logprob_chunk_bytes(vocab_size: int, chunk_tokens: int, dtype_bytes: int) -> int:
    """Peak of the chunked log-prob head (``algorithms/logprobs.py``): one chunk's ``[C, V]``
    logits in the parameters' dtype, their fp32 copy, the softmax for the entropy and the
    gradient in fp32: ``C * V * (b + 3*4)``."""
    return chunk_tokens * vocab_size * (dtype_bytes + 12)


def kv_cache_tokens(kv_bytes: int, shape: ModelShape, dtype_bytes: int) -> int:
    """Tokens a KV cache of ``kv_bytes`` holds: ``kv_bytes // (2*L*k*d*b)``.

    >>> kv_cache_tokens(64 << 20, ModelShape(151936, 1536, 8960, 28, 12, 2, 128, True, True), 2)
    2340
    """
    return max(kv_bytes, 0) // shape.kv_bytes_per_token(dtype_bytes)


def engine_kv_budget(gpu_bytes: int, utilization: float, weight_bytes: int, overhead_bytes: int = ENGINE_OVERHEAD_BYTES) -> int:
    """What vLLM gives its KV cache on a GPU: its share ``u * M`` less its own weights and
    non-KV memory (vLLM >= 0.10 counts only its own process against ``gpu_memory_utilization``).

    >>> engine_kv_budget(80 * GiB, 0.5, 3 * GiB, 2 * GiB) // GiB
    35
    """
    return int(utilization * gpu_bytes) - weight_bytes - overhead_bytes


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"141e9"``, ``"1024"`` -> bytes (GB = 1e9, GiB = 2**30).

    >>> parse_bytes("80GiB"), parse_bytes("80GB"), parse_bytes("512MiB")
    (85899345920, 80000000000, 536870912)
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 141GB)")
    try:
        number = float(match.group(1))
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 141GB)") from None
    unit = match.group(2) or "B"
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
    size = number * scale
    if not math.isfinite(size) or size > MAX_GPU_BYTES:
        raise ValueError(f"not a GPU memory size: {text!r} is above {MAX_GPU_BYTES >> 40} TiB (e.g. 80GiB, 141GB)")
    return int(size)


# ---------------------------------------------------------------------------------------------
# The plan of one run


Phase = Literal["both", "train", "generate"]


@dataclass(frozen=True)
class Part:
    name: str
    gpu_bytes: int
    phase: Phase
    formula: str
    cpu_bytes: int = 0


@dataclass(frozen=True)
class Problem:
    part: str
    over_by: int
    fix: str


@dataclass
class MemoryPlan:
    """Every part of a run on one GPU, the peak per phase, and what does not fit."""

    model: str
    num_parameters: int
    num_gpus: int
    gpu_bytes: int
    placement: str
    parts: list[Part] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kv_tokens: int | None = None
    kv_tokens_wanted: int | None = None
    kv_bytes_per_token: int | None = None
    suggested_utilization: float | None = None
    min_utilization: float | None = None

    def phase_total(self, phase: Phase) -> int:
        return sum(p.gpu_bytes for p in self.parts if p.phase in ("both", phase))

    @property
    def host_bytes(self) -> int:
        """Host (CPU) memory per GPU: offloaded optimizer states and sleeping engine weights."""
        return sum(p.cpu_bytes for p in self.parts)

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_total("train"), self.phase_total("generate"))

    @property
    def fits(self) -> bool:
        return not self.problems

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "num_parameters": self.num_parameters, "num_gpus": self.num_gpus,
            "gpu_bytes": self.gpu_bytes, "placement": self.placement,
            "parts": {p.name: {"gpu_bytes": p.gpu_bytes, "cpu_bytes": p.cpu_bytes, "phase": p.phase} for p in self.parts},
            "train_bytes": self.phase_total("train"), "generate_bytes": self.phase_total("generate"),
            "peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes, "fits": self.fits,
            "problems": [vars(p) for p in self.problems], "notes": self.notes,
        }


def on_gpu(settings: Settings) -> bool:
    """Whether the trainer runs on GPUs: ``trainer.accelerator`` gpu, or auto with CUDA present."""
    if settings.trainer.accelerator == "gpu":
        return True
    if settings.trainer.accelerator == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def param_bytes_of(settings: Settings) -> int:
    """Bytes per trained parameter: 2 under ``bf16-true``/``16-true`` precision; 2 under DeepSpeed
    with a 16-bit mixed precision (``bf16-mixed``/``16-mixed``: DeepSpeed casts the parameters to
    16 bits and keeps fp32 masters in its optimizer state, ``K = 12``); else ``model.dtype``'s
    (``32-true``, and torch's autocast, which keeps the parameters as loaded)."""
    precision = settings.trainer.precision
    if precision in ("bf16-true", "16-true", "bf16", "16"):
        return 2
    if settings.trainer.uses_deepspeed and precision in ("bf16-mixed", "16-mixed"):
        return 2
    return DTYPE_BYTES[settings.model.dtype]


def _zero_stage(strategy: str) -> int:
    return {"deepspeed_stage_2": 2, "deepspeed_stage_3": 3}.get(strategy, 0)


def memory_plan(settings: Settings, shape: ModelShape, *, num_gpus: int, gpu_bytes: int, model: str = "") -> MemoryPlan:
    """The plan of ``settings`` for a model of ``shape`` on ``num_gpus`` GPUs of ``gpu_bytes`` each.

    Problems (what makes the run refuse on GPUs), in the order they are checked:

    1. ``generate`` phase above the GPU: the engine's share is too large next to the trainer.
    2. ``train`` phase above the GPU: shards, activations (and the engine, when awake) too large.
    3. the engine's KV cache below one sequence of ``max_model_len = env.max_context_tokens + 1``
       tokens (vLLM refuses to start).

    A KV cache that holds fewer than ``rollout.max_in_flight`` episodes at full context is a note,
    not a problem: vLLM then queues or preempts (recomputes) requests, which costs time, not
    correctness.
    """
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be > 0, got {gpu_bytes}")
    t, e, m = settings.trainer, settings.engine, settings.model
    b = param_bytes_of(settings)
    stage = _zero_stage(t.strategy)
    deepspeed = t.uses_deepspeed
    num_params = shape.num_parameters()
    k_per_param = optimizer_bytes_per_parameter(b, deepspeed)
    state = trainer_state_bytes(
        num_params, param_bytes=b, stage=stage, num_gpus=num_gpus,
        optimizer_per_param=k_per_param, offload_optimizer=t.offload_optimizer,
    )
    sharded = "/N" if stage else ""  # ZeRO-2/3 shard gradients and optimizer states
    whole_or_sharded = "/N" if stage == 3 else ""  # only ZeRO-3 shards the parameters
    plan = MemoryPlan(model or m.path, num_params, num_gpus, gpu_bytes, placement="")
    add = plan.parts.append
    if m.lora:
        _plan_lora_state(plan, settings, shape, stage=stage, num_gpus=num_gpus)
    else:
        add(Part("parameters", state.params, "both", f"{b}*P{whole_or_sharded}"))
        add(Part("gradients", state.grads, "both", f"{b}*P{sharded}"))
        add(Part("optimizer states", state.optimizer, "both",
                 f"{k_per_param}*P{sharded}" + (" (offloaded to CPU)" if t.offload_optimizer else ""),
                 cpu_bytes=state.optimizer_cpu))
    if stage == 3:
        biggest = max(shape.layer_parameters(), shape.vocab_size * shape.hidden_size)
        add(Part("ZeRO-3 gathered weights", 2 * biggest * b, "train", "2*max(layer, V*H)*b"))
    if deepspeed:
        # ZeRO-2 keeps a reduce and an all-gather bucket; ZeRO-3 gathers per layer (counted above).
        buckets = (DEEPSPEED_REDUCE_BUCKET + (DEEPSPEED_ALLGATHER_BUCKET if stage == 2 else 0)) * b
        add(Part("ZeRO buckets", buckets, "train", "(reduce + allgather bucket)*b" if stage == 2 else "reduce bucket*b"))
    if settings.algorithm.kl_coef > 0 and not m.lora:  # LoRA's reference is the base, adapters disabled
        add(Part("reference model", b * num_params // (num_gpus if stage == 3 else 1), "both",
                 f"{b}*P{whole_or_sharded}"))
    # batching.micro_batches never splits an episode: one longer than micro_batch_tokens is its own
    # micro-batch, so the longest is max(micro_batch_tokens, max_context_tokens).
    n = max(t.micro_batch_tokens, settings.env.max_context_tokens)
    add(Part("activations", activation_bytes(shape, n, b, m.gradient_checkpointing), "train",
             f"n={n}, " + ("L*n*H*b + n*s (checkpointed)" if m.gradient_checkpointing else "L*n*s")))
    if settings.algorithm.privileged_critic:  # the second forward, over each segment after its critic context
        n_critic = critic_forward_tokens(settings, n)
        add(Part("critic activations", activation_bytes(shape, n_critic, b, m.gradient_checkpointing), "train",
                 f"as activations, n={n_critic} {CRITIC_N}"))
    attention = attention_matrix_bytes(shape, n, b, m.attn_implementation)
    if attention:
        add(Part("attention mask", attention, "train", f"n*n*(3+b) ({m.attn_implementation or 'sdpa'})"))
    add(Part("log-prob chunk", logprob_chunk_bytes(shape.vocab_size, t.logprob_chunk_tokens, b), "train",
             f"C*V*(b+12), C={t.logprob_chunk_tokens}"))
    add(Part("trainer reserve", PROCESS_RESERVE_BYTES, "both", "CUDA context + fragmentation"))

    if e.traits.servers:
        plan.placement = (f"{e.kind} engine: servers in their own processes, planned apart "
                          "(fit starts local ones on these GPUs: give them engine.gpu_memory_utilization)")
    elif not e.traits.shares_trainer_gpus:
        plan.placement = f"{e.kind} engine, in-process on CPU: no GPU memory"
    else:
        _plan_engine(plan, settings, shape)
    _check(plan, settings)
    return plan


def _plan_lora_state(plan: MemoryPlan, settings: Settings, shape: ModelShape, *, stage: int, num_gpus: int) -> None:
    """LoRA (``model.lora_rank``): the frozen base once (the KL reference is the same weights), sharded by ZeRO-3
    like any parameter; the adapters ``P_A`` in fp32 (peft keeps them so beside a 16-bit base; ``*-true`` 16-bit
    precision casts them too, ``a = 2``), their gradients and optimizer states, sharded as
    :func:`trainer_state_bytes` says; nothing of the base beyond its weights (no gradient, no optimizer state)."""
    m, t, b = settings.model, settings.trainer, param_bytes_of(settings)
    a = 2 if t.precision in ("bf16-true", "16-true", "bf16", "16") else 4
    adapters = shape.lora_parameters(m.lora_rank, m.lora_target_modules)
    k = optimizer_bytes_per_parameter(a, t.uses_deepspeed)
    state = trainer_state_bytes(adapters, param_bytes=a, stage=stage, num_gpus=num_gpus, optimizer_per_param=k,
                                offload_optimizer=t.offload_optimizer)
    whole_or_sharded, sharded = ("/N" if stage == 3 else ""), ("/N" if stage else "")
    base = b * shape.num_parameters() // (num_gpus if stage == 3 else 1)
    add = plan.parts.append
    add(Part("parameters", base + state.params, "both", f"{b}*P{whole_or_sharded} (frozen base) + "
             f"{a}*P_A{whole_or_sharded} (adapters, P_A = {_count(adapters)})"))
    add(Part("gradients", state.grads, "both", f"{a}*P_A{sharded}"))
    add(Part("optimizer states", state.optimizer, "both",
             f"{k}*P_A{sharded}" + (" (offloaded to CPU)" if t.offload_optimizer else ""), cpu_bytes=state.optimizer_cpu))


def _plan_engine(plan: MemoryPlan, settings: Settings, shape: ModelShape) -> None:
    e = settings.engine
    engine_b = DTYPE_BYTES[settings.engine_dtype]
    replicas = e.num_replicas
    sleeping = e.sleep_while_training
    plan.placement = (
        f"vLLM colocated with the trainer, {replicas} replica(s) per GPU, "
        + ("asleep during optimizer steps" if sleeping else "resident during optimizer steps")
    )
    phase: Phase = "generate" if sleeping else "both"
    weights = engine_b * plan.num_parameters
    kv = max(engine_kv_budget(plan.gpu_bytes, e.gpu_memory_utilization, weights), 0)
    plan.parts.append(Part("engine weights", replicas * weights, phase, f"{replicas}*{engine_b}*P"
                           + (" (in CPU memory while asleep)" if sleeping else ""),
                           cpu_bytes=replicas * weights if sleeping else 0))
    plan.parts.append(Part("engine KV cache", replicas * kv, phase,
                           f"{replicas}*(u*M - weights - overhead), u={e.gpu_memory_utilization}"))
    plan.parts.append(Part("engine overhead", replicas * ENGINE_OVERHEAD_BYTES, phase,
                           "vLLM activations, sampler, graphs (allowance)"))
    plan.parts.append(Part("engine reserve", replicas * PROCESS_RESERVE_BYTES, "both", "engine-core CUDA context"))
    plan.kv_bytes_per_token = shape.kv_bytes_per_token(engine_b)
    plan.kv_tokens = kv_cache_tokens(kv, shape, engine_b)
    per_replica = -(-settings.rollout.max_in_flight // replicas)
    plan.kv_tokens_wanted = per_replica * settings.env.max_context_tokens
    if plan.kv_tokens < plan.kv_tokens_wanted:
        holds = plan.kv_tokens // settings.env.max_context_tokens
        plan.notes.append(
            f"the KV cache holds {plan.kv_tokens:,} tokens per replica: {holds} of its {per_replica} "
            f"episodes at full context ({settings.env.max_context_tokens:,} tokens); vLLM queues or "
            "preempts the rest (slower, not wrong)"
        )
    # Utilization bounds: u_max is the largest share the phases that hold the engine leave room for,
    # u_min the smallest whose KV cache holds one sequence of max_model_len tokens.
    engine_share = replicas * (weights + kv + ENGINE_OVERHEAD_BYTES)
    phases = ("generate",) if sleeping else ("generate", "train")
    others = max(plan.phase_total(p) - engine_share for p in phases)
    plan.suggested_utilization = max(math.floor(100 * (plan.gpu_bytes - others) / (replicas * plan.gpu_bytes)) / 100, 0.0)
    need = (settings.env.max_context_tokens + 1) * plan.kv_bytes_per_token
    plan.min_utilization = math.ceil(100 * (weights + ENGINE_OVERHEAD_BYTES + need) / plan.gpu_bytes) / 100
    if sleeping:
        plan.notes.append(
            "engine.sleep_while_training: during each optimizer step the engine's weights wait in CPU "
            f"memory ({_gib(replicas * weights)} per GPU) and generation pauses"
        )


def _check(plan: MemoryPlan, settings: Settings) -> None:
    """Fill ``plan.problems``; each names the part to change, the shortfall and the setting."""
    e = settings.engine
    gpu = plan.gpu_bytes
    vllm = e.traits.shares_trainer_gpus
    engine_fits = vllm and plan.min_utilization <= plan.suggested_utilization
    for phase in ("generate", "train"):
        total = plan.phase_total(phase)
        if total <= gpu:
            continue
        engine_in_phase = vllm and (phase == "generate" or not e.sleep_while_training)
        if engine_in_phase and engine_fits:
            fix = (f"set engine.gpu_memory_utilization between {plan.min_utilization:.2f} and "
                   f"{plan.suggested_utilization:.2f} (now {e.gpu_memory_utilization})")
            if not e.sleep_while_training:
                fix += ", or engine.sleep_while_training=true"
            plan.problems.append(Problem("engine share", total - gpu, fix))
            continue
        # Blame the largest part a setting can shrink (not the KV cache: a smaller share did not help).
        fixed = ("engine KV cache", "engine overhead", "engine reserve", "trainer reserve")
        candidates = [p for p in plan.parts if p.phase in ("both", phase) and p.name not in fixed]
        biggest = max(candidates, key=lambda p: p.gpu_bytes)
        plan.problems.append(Problem(f"{biggest.name} ({phase} phase)", total - gpu, _fix_for(biggest.name, settings)))
    if vllm:
        need = settings.env.max_context_tokens + 1
        if plan.kv_tokens < need:
            plan.problems.append(Problem(
                "engine KV cache", (need - plan.kv_tokens) * plan.kv_bytes_per_token,
                f"vLLM needs room for one sequence of max_model_len={need:,} tokens; set "
                f"engine.gpu_memory_utilization >= {plan.min_utilization:.2f} (now {e.gpu_memory_utilization}) "
                "or lower env.max_context_tokens",
            ))


def _fix_for(part: str, settings: Settings) -> str:
    t, m = settings.trainer, settings.model
    fixes = {
        "activations": (
            "set model.gradient_checkpointing=true" if not m.gradient_checkpointing
            else f"lower trainer.micro_batch_tokens (now {t.micro_batch_tokens}) and, if it is the larger, "
            f"env.max_context_tokens (now {settings.env.max_context_tokens})"
        ),
        "attention mask": ("set model.attn_implementation=flash_attention_2 (no [n, n] mask) or lower trainer.micro_batch_tokens "
                           "(and env.max_context_tokens if it is the larger)"),
        "optimizer states": (
            "use trainer.strategy=deepspeed_stage_2/3 on more GPUs" if not t.uses_deepspeed
            else "set trainer.offload_optimizer=true or use more GPUs"
        ),
        "parameters": "use trainer.strategy=deepspeed_stage_3 (shards the parameters) or more GPUs",
        "gradients": "use a DeepSpeed ZeRO strategy (shards gradients) or more GPUs",
        "engine weights": (
            "vLLM holds a whole copy of the weights per replica beside the trainer's shards (tensor "
            "parallelism is not wired here): use more GPUs for the trainer, fewer engine.num_replicas, "
            "or a smaller model"
        ),
        "log-prob chunk": f"lower trainer.logprob_chunk_tokens (now {t.logprob_chunk_tokens})",
        "reference model": "set algorithm.kl_coef=0 (no reference model) or use deepspeed_stage_3",
    }
    return fixes.get(part, "use more GPUs or a smaller model")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:,.2f} GiB"


def _count(num: int) -> str:
    """``1543714304`` -> ``1.54 B``; ``344384`` -> ``0.34 M``."""
    return f"{num / 1e9:.2f} B" if num >= 1e9 else f"{num / 1e6:.2f} M"


# ---------------------------------------------------------------------------------------------
# Host memory of a run on CPU

#: Resident memory of a ``fit`` process on CPU beside what the formulas count: the interpreter with
#: torch, transformers, Lightning, MLflow and the rollout service imported (0.58 GiB at import), plus
#: what running adds before any weight counts (torch's thread pools and oneDNN, the rollout thread's
#: malloc arena, the sandbox and tracking clients, trajectories). Measured as the peak resident set of
#: ``fit --config configs/smoke.yaml`` on the tiny model less the tiny model's own parts
#: (``tests/test_host_memory_plan.py``; Python 3.11, torch 2.13 CPU, 2026-12-04).
CPU_RUNTIME_BYTES = int(0.75 * GiB)

HostPhase = Literal["always", "generate", "train", "sync"]


@dataclass(frozen=True)
class HostPart:
    name: str
    num_bytes: int
    phase: HostPhase
    formula: str


@dataclass
class HostMemoryPlan:
    """The resident memory (RSS) of a training process on CPU, part by part.

    Each part is live in one phase: ``always`` (the whole run), ``generate`` (the engine's KV cache
    while episodes decode), ``train`` (one micro-batch's forward and backward, the gradients until the
    optimizer step frees them), ``sync`` (the copies a weight sync makes). The tensors live at once peak
    at ``always`` plus the largest phase (:attr:`live_peak_bytes`), but the process's resident memory
    does not come back down after a phase: glibc's malloc keeps what a phase freed (in the arena of the
    thread that freed it) and the next phase reuses it only in part. The resident peak lies near the sum of
    every part (:attr:`peak_bytes`), which the plan predicts (docs/memory_plan.md has the measurements: 0.87 to
    1.15 of it at SmolLM2-135M). With
    ``rollout.max_staleness > 0`` generation overlaps training: the KV cache is counted as ``always``.
    """

    model: str
    num_parameters: int
    episode_tokens: int
    micro_batch_tokens: int
    parts: list[HostPart] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def phase_total(self, phase: HostPhase) -> int:
        return sum(p.num_bytes for p in self.parts if p.phase in ("always", phase))

    @property
    def live_peak_bytes(self) -> int:
        """``always`` plus the largest phase: the tensors alive at the busiest moment."""
        return max(self.phase_total(phase) for phase in ("train", "generate", "sync"))

    @property
    def peak_bytes(self) -> int:
        """The predicted peak resident memory: every part (see the class docstring; not a bound)."""
        return sum(p.num_bytes for p in self.parts)

    def part(self, name: str) -> HostPart:
        return next(p for p in self.parts if p.name == name)

    def to_dict(self) -> dict:
        return {
            "kind": "host", "model": self.model, "num_parameters": self.num_parameters,
            "episode_tokens": self.episode_tokens, "micro_batch_tokens": self.micro_batch_tokens,
            "parts": {p.name: {"bytes": p.num_bytes, "phase": p.phase, "formula": p.formula} for p in self.parts},
            **{f"{phase}_bytes": self.phase_total(phase) for phase in ("train", "generate", "sync")},
            "live_peak_bytes": self.live_peak_bytes, "peak_bytes": self.peak_bytes, "notes": self.notes,
        }


def micro_batch_tokens_at(episode_tokens: int, micro_batch_tokens: int, episodes: int) -> int:
    """Tokens of the longest micro-batch when every episode has ``e`` tokens: micro-batches hold whole
    episodes (``batching.micro_batches``), ``max(1, min(E, M // e))`` of them, ``E`` the episodes of one
    update on one process.

    >>> micro_batch_tokens_at(450, 4096, 16), micro_batch_tokens_at(450, 4096, 4), micro_batch_tokens_at(5000, 4096, 8)
    (4050, 1800, 5000)
    """
    return max(1, min(episodes, micro_batch_tokens // episode_tokens)) * episode_tokens


def state_dict_elements(shape: ModelShape) -> int:
    """Elements of a full ``state_dict`` copy: ``P``, plus ``V*H`` when the output head is tied to the
    input embedding (the state dict names the one tensor twice, and a copy of it copies it twice)."""
    return shape.num_parameters() + (shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0)


def host_memory_plan(settings: Settings, shape: ModelShape, *, episode_tokens: int | None = None,
                     model: str = "") -> HostMemoryPlan:
    """The resident memory of the training process of a CPU run (``trainer.accelerator: cpu``, or auto
    without CUDA), from ``shape`` and the settings. ``episode_tokens`` (``e``): the tokens of one
    episode, ``env.max_context_tokens`` by default (the bound; a run whose episodes end earlier needs
    less, in the KV cache and the activations). Formulas in the parts; ``docs/memory_plan.md`` says
    which run measured what."""
    t, m, r = settings.trainer, settings.model, settings.rollout
    context = settings.env.max_context_tokens
    e = min(episode_tokens or context, context)
    b = param_bytes_of(settings)
    processes = t.devices * t.num_nodes if isinstance(t.devices, int) else t.num_nodes
    episodes = max(1, r.group_size * r.groups_per_step // (t.mini_batches * processes))
    n = micro_batch_tokens_at(e, t.micro_batch_tokens, episodes)
    plan = HostMemoryPlan(model or m.path, shape.num_parameters(), e, n)
    add = plan.parts.append
    add(HostPart("runtime", CPU_RUNTIME_BYTES, "always", "interpreter, torch, Lightning, MLflow, threads (measured)"))
    _host_trainer_parts(plan, settings, shape, b)
    _host_engine_parts(plan, settings, shape, e)
    add(HostPart("activations", activation_bytes(shape, n, b, m.gradient_checkpointing), "train",
                 f"n={n}, " + ("L*n*H*b + n*s (checkpointed)" if m.gradient_checkpointing else "L*n*s")))
    if settings.algorithm.privileged_critic:  # the second forward, over each segment after its critic context
        n_critic = critic_forward_tokens(settings, n)
        add(HostPart("critic activations", activation_bytes(shape, n_critic, b, m.gradient_checkpointing), "train",
                     f"as activations, n={n_critic} {CRITIC_N}"))
    add(HostPart("log-prob chunk", logprob_chunk_bytes(shape.vocab_size, t.logprob_chunk_tokens, b), "train",
                 f"C*V*(b+12), C={t.logprob_chunk_tokens}"))
    plan.notes.append("the sandbox service runs in its own process (its memory is not in this one)")
    if processes > 1:
        plan.notes.append(f"per training process: {processes} of them (trainer.devices x trainer.num_nodes), "
                          "each this large on its own machine's memory")
    if episode_tokens is None:
        plan.notes.append(f"episodes counted at env.max_context_tokens={context:,} tokens (the bound; "
                          "--episode-tokens N plans for episodes of N tokens)")
    return plan


def _host_trainer_parts(plan: HostMemoryPlan, settings: Settings, shape: ModelShape, b: int) -> None:
    """The trained copy (``b*P``; LoRA: the frozen base and fp32 adapters), its gradients (from the first
    backward until the optimizer step frees them), torch AdamW's ``m`` and ``v`` (``2*b`` per trained
    parameter) and, with ``algorithm.kl_coef > 0`` and no LoRA, the reference model."""
    m, add = settings.model, plan.parts.append
    num_params = shape.num_parameters()
    if m.lora:
        a = 2 if settings.trainer.precision in ("bf16-true", "16-true", "bf16", "16") else 4
        trained, trained_b = shape.lora_parameters(m.lora_rank, m.lora_target_modules), a
        add(HostPart("parameters", b * num_params + a * trained, "always", f"{b}*P (frozen base) + {a}*P_A (adapters)"))
    else:
        trained, trained_b = num_params, b
        add(HostPart("parameters", b * num_params, "always", f"{b}*P"))
    add(HostPart("gradients", trained_b * trained, "train", f"{trained_b}*P" + ("_A" if m.lora else "")))
    add(HostPart("optimizer states", 2 * trained_b * trained, "always",
                 f"{2 * trained_b}*P" + ("_A" if m.lora else "") + " (AdamW m and v)"))
    if settings.algorithm.kl_coef > 0 and not m.lora:  # LoRA's reference is the base, adapters disabled
        add(HostPart("reference model", b * num_params, "always", f"{b}*P"))
    copies = trained_b * (trained if m.lora else state_dict_elements(shape))
    add(HostPart("weight-sync copy", copies, "sync",
                 "b*(P + V*H if tied): the gathered state dict (a tied head copied under both names)"
                 if not m.lora else "a*P_A: the adapters, gathered"))


def _host_engine_parts(plan: HostMemoryPlan, settings: Settings, shape: ModelShape, e: int) -> None:
    """The torch engine's own copy of the weights (``engine.dtype``, by default ``model.dtype``; LoRA: the base, the adapters and the
    kept base of every adapted projection, ``lightning_agentrl/lora.py::MergedAdapters``) and its KV cache:
    ``rollout.max_in_flight`` episodes of ``e`` tokens, ``2*L*k*d*b`` bytes a token. vLLM runs in processes
    of its own (a note, no part)."""
    m, r = settings.model, settings.rollout
    if not settings.engine.traits.weights_in_trainer:
        plan.notes.append(f"engine.kind={settings.engine.kind}: the engine runs in processes of its own "
                          "(its weights and KV cache are not in this process)")
        return
    eb = DTYPE_BYTES[settings.engine_dtype]
    weights, formula = eb * shape.num_parameters(), f"{eb}*P"
    if m.lora:
        adapted = sum(i * o for i, o in shape.adapted_projections(m.lora_target_modules))
        weights += eb * adapted + 4 * shape.lora_parameters(m.lora_rank, m.lora_target_modules)
        formula += " + b*P_adapted (kept base) + 4*P_A"
    plan.parts.append(HostPart("engine weights", weights, "always", formula))
    kv = r.max_in_flight * e * shape.kv_bytes_per_token(eb)
    phase: HostPhase = "always" if r.max_staleness > 0 else "generate"
    plan.parts.append(HostPart("engine KV cache", kv, phase,
                               f"max_in_flight*e*2*L*k*d*b, max_in_flight={r.max_in_flight}, e={e}"))


def host_plan_for(settings: Settings, *, episode_tokens: int | None = None,
                  model_config: str | Path | None = None) -> HostMemoryPlan:
    """:func:`host_memory_plan` of ``settings``, the model's shape read as :func:`plan_for` reads it."""
    shape = ModelShape.from_config(load_model_config(settings, model_config), model_config_source(settings, model_config))
    plan = host_memory_plan(settings, shape, episode_tokens=episode_tokens)
    total = _host_memory_total()
    if total and plan.peak_bytes > total:
        plan.notes.append(f"the peak is above this machine's memory ({_gib(total)})")
    return plan


def _host_memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            return int(meminfo.readline().split()[1]) * 1024  # MemTotal, in kB
    except (OSError, ValueError, IndexError):
        return None


def print_host_plan(plan: HostMemoryPlan, console=None) -> None:
    """A rich table: one row per part, its bytes, its phase, the formula; then the peak."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"host memory plan (CPU run): {plan.model}, {_count(plan.num_parameters)} parameters, "
                        f"episodes of {plan.episode_tokens:,} tokens")
    for column, justify in (("part", "left"), ("GiB", "right"), ("when", "left"), ("formula", "left")):
        table.add_column(column, justify=justify)
    for part in plan.parts:
        table.add_row(part.name, f"{part.num_bytes / GiB:,.2f}", part.phase, part.formula)
    table.add_section()
    table.add_row("[bold]live at the busiest phase[/bold]", f"{plan.live_peak_bytes / GiB:,.2f}", "",
                  "always + the largest phase")
    table.add_row("[bold]peak resident memory[/bold]", f"[bold]{plan.peak_bytes / GiB:,.2f}[/bold]", "",
                  "every part (malloc keeps part of what a phase frees; measured runs lie within 0.87x-1.15x of it)")
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}")


# ---------------------------------------------------------------------------------------------
# Entry points: the table, and the check ``fit`` runs


def plan_for(settings: Settings, *, num_gpus: int | None = None, gpu_bytes: int | None = None,
             model_config: str | Path | None = None) -> MemoryPlan:
    """The plan of ``settings``; GPUs and their memory default to ``trainer.devices`` and, with
    CUDA present, the first device's memory (else 80 GiB).

    ``num_gpus`` is the GPUs of one node, like ``trainer.devices``: ZeRO shards over
    ``N = num_gpus x trainer.num_nodes`` (the plan's ``num_gpus`` is that total), while each GPU
    still holds its own engine.
    """
    import torch

    shape = ModelShape.from_config(load_model_config(settings, model_config), model_config_source(settings, model_config))
    guessed = []
    if num_gpus is None:
        devices = settings.trainer.devices
        if isinstance(devices, int):
            num_gpus = devices
        else:
            num_gpus = max(torch.cuda.device_count(), 1)
            if not torch.cuda.is_available():
                guessed.append(f"trainer.devices=auto counted as {num_gpus} GPU per node (no CUDA here; pass --gpus)")
    num_gpus *= settings.trainer.num_nodes
    if gpu_bytes is None:
        if torch.cuda.is_available():
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        else:
            gpu_bytes = 80 * GiB
            guessed.append("no CUDA here: planned for GPUs of 80 GiB (pass --gpu-memory)")
    plan = memory_plan(settings, shape, num_gpus=num_gpus, gpu_bytes=gpu_bytes)
    plan.notes[:0] = guessed
    return plan


def refusal_message(plan: MemoryPlan) -> str:
    """One paragraph: what does not fit, by how much, and which setting would make it fit."""
    lines = [
        f"{plan.model} ({_count(plan.num_parameters)} parameters) does not fit on {plan.num_gpus} GPU(s) "
        f"of {_gib(plan.gpu_bytes)}: training needs {_gib(plan.phase_total('train'))} per GPU, "
        f"generation {_gib(plan.phase_total('generate'))}."
    ]
    for problem in plan.problems:
        lines.append(f"{problem.part} is {_gib(problem.over_by)} over: {problem.fix}.")
    lines.append("See `python -m lightning_agentrl plan --config ...` for every part.")
    return " ".join(lines)


def check_memory_plan(settings: Settings) -> MemoryPlan | None:
    """What ``fit`` runs before loading anything: on GPUs, raise :class:`MemoryPlanError` for a plan
    that does not fit; on CPU do nothing (host memory is not planned) and return None.

    ``trainer.accelerator=gpu`` without CUDA is a :class:`SettingsError`: the plan would have to
    assume a GPU size, and the run would fail later anyway. On GPUs the plan uses the first
    device's memory, never an assumed one.
    """
    if not on_gpu(settings):
        return None
    import torch

    if not torch.cuda.is_available():
        raise SettingsError(
            "trainer.accelerator=gpu but CUDA is not available here (no GPU, or a CPU-only torch); "
            "set trainer.accelerator=cpu or auto, or run on a machine with GPUs"
        )
    plan = plan_for(settings)
    if not plan.fits:
        raise MemoryPlanError(refusal_message(plan))
    return plan


def render_plan(plan: MemoryPlan):
    """A rich table: one row per part, bytes per GPU, the phase it is resident in, the formula."""
    from rich.table import Table

    table = Table(title=f"memory plan: {plan.model}, {_count(plan.num_parameters)} parameters, "
                        f"{plan.num_gpus} x {_gib(plan.gpu_bytes)}")
    table.add_column("part")
    table.add_column("GiB per GPU", justify="right")
    table.add_column("when")
    table.add_column("formula")
    for part in plan.parts:
        cpu = f" (+{_gib(part.cpu_bytes)} CPU)" if part.cpu_bytes else ""
        table.add_row(part.name, f"{part.gpu_bytes / GiB:,.2f}{cpu}", part.phase, part.formula)
    table.add_section()
    for phase in ("train", "generate"):
        total = plan.phase_total(phase)
        style = "red" if total > plan.gpu_bytes else "green"
        table.add_row(f"[bold]{phase} phase total[/bold]", f"[{style}]{total / GiB:,.2f}[/{style}]",
                      "", f"of {_gib(plan.gpu_bytes)} ({100 * total / plan.gpu_bytes:.0f}%)")
    return table


def print_plan(plan: MemoryPlan, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    console.print(render_plan(plan))
    console.print(f"placement: {plan.placement}")
    if plan.host_bytes:
        console.print(f"host memory: {_gib(plan.host_bytes)} per GPU, {_gib(plan.num_gpus * plan.host_bytes)} "
                      f"for {plan.num_gpus} GPU(s) (offloaded optimizer states, sleeping engine weights)")
    if plan.kv_tokens is not None:
        console.print(f"KV cache: {plan.kv_tokens:,} tokens per replica (all episodes at full context: "
                      f"{plan.kv_tokens_wanted:,}); largest engine.gpu_memory_utilization that fits: "
                      f"{plan.suggested_utilization:.2f}")
    for note in plan.notes:
        console.print(f"note: {note}")
    if plan.fits:
        console.print("[bold green]fits[/bold green]")
    else:
        console.print(f"[bold red]does not fit[/bold red]: {refusal_message(plan)}")

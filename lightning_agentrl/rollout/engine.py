"""The generation-engine contract, and the torch engine that needs nothing but transformers.

Token ids in, token ids out: an engine never takes or returns text on the trained path (SPEC §5).
Every call returns the ids it sampled, the log-probability of each sampled id under the
distribution it was sampled from, and the policy version of the weights that produced it. That
distribution is the one log-prob rule of :mod:`lightning_agentrl.algorithms.logprobs`: logits over
temperature, restricted to the top-k ids and the top-p nucleus, renormalized
(:func:`~lightning_agentrl.algorithms.logprobs.sampling_logits`); the trainer recomputes log-probs
with the same rule. vLLM calls it :data:`VLLM_LOGPROBS_MODE`: an engine built on vLLM (in process or
a server, ``vllm serve --logprobs-mode processed_logprobs``) must run in that mode.

All engine methods are coroutines and are called from the rollout service's event loop; the
trainer reaches them through the service, never directly.
"""

from __future__ import annotations

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


class TorchEngine:
    """In-process generation with transformers: concurrent requests are decoded as one batch.

    Requests that arrive while a batch is decoding wait and form the next batch (continuous
    batching at batch granularity). Each request draws its uniforms from its own ``torch.Generator``
    seeded from ``SamplingParams.seed``, and all rows are sampled at once by inverse CDF
    (:func:`inverse_cdf_sample`), so its ids do not depend on which requests share its batch. Each batch is left-padded and decoded with a KV cache in a worker thread, so the event loop keeps serving tool calls meanwhile. Weight updates wait for
    the batch in flight: no generation mixes two policy versions.

    The model is the engine's own copy; the trainer pushes new weights with :meth:`update_weights`.
    """

    def __init__(
        self, model, *, pad_token_id: int, max_batch_size: int = 16, policy_version: int = 0
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.policy_version = policy_version
        self._queue: list[_Request] = []
        self._wakeup = None  # asyncio.Event, created on the loop that first uses the engine
        self._lock = None  # asyncio.Lock: a batch or a weight update, never both
        self._worker = None
        self.num_batches = 0
        self.num_requests = 0

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
        self._ensure_started()
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(list(prompt_ids), sampling, future))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        import asyncio

        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let requests issued in the same tick join the batch
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
                batch = [r for r in batch if not r.future.cancelled()]
                if not batch:
                    continue
                async with self._lock:
                    version = self.policy_version
                    try:
                        results = await asyncio.to_thread(self._decode, batch)
                    except Exception as err:  # surface to every waiter, keep serving
                        for r in batch:
                            if not r.future.done():
                                r.future.set_exception(err)
                        continue
                self.num_batches += 1
                self.num_requests += len(batch)
                for request, (ids, logprobs, reason) in zip(batch, results, strict=True):
                    if not request.future.done():
                        request.future.set_result(Generation(ids, logprobs, reason, version))

    @torch.no_grad()
    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float], FinishReason]]:
        device = next(self.model.parameters()).device
        num = len(batch)
        input_ids, attention = _left_pad([r.prompt_ids for r in batch], self.pad_token_id, device)
        temperature, filters = _row_filters([r.sampling for r in batch], device)
        sampled = torch.tensor([not r.sampling.greedy for r in batch], device=device)
        budget = [r.sampling.max_new_tokens for r in batch]
        stops = [set(r.sampling.stop_token_ids) for r in batch]
        uniforms = _request_uniforms([r.sampling for r in batch]).to(device)

        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        reasons: list[FinishReason | None] = [None] * num
        step_pos = (attention.cumsum(-1) - 1).clamp(min=0)
        step_ids, past = input_ids, None
        for step in range(max(budget)):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            # the distribution sampled from, and the one whose log-probs are reported
            logprobs = torch.log_softmax(sampling_logits(logits, temperature, **filters), dim=-1)
            token = torch.where(sampled, inverse_cdf_sample(logprobs, uniforms[:, step]), logits.argmax(-1))
            token_lp = logprobs.gather(-1, token[:, None]).squeeze(-1)
            for i, (tid, lp) in enumerate(zip(token.tolist(), token_lp.tolist(), strict=True)):
                if reasons[i] is not None:
                    continue
                out_ids[i].append(tid)
                out_lp[i].append(lp)
                if tid in stops[i]:
                    reasons[i] = "stop"
                elif len(out_ids[i]) >= budget[i]:
                    reasons[i] = "length"
            if all(r is not None for r in reasons):
                break
            step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
            attention = torch.cat([attention, attention.new_ones((num, 1))], dim=1)
        return [
            (ids, lps, reason or "length") for ids, lps, reason in zip(out_ids, out_lp, reasons, strict=True)
        ]

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
        async with self._lock:
            with torch.no_grad():
                for name, tensor in incoming:
                    targets[name].copy_(tensor)
            self.policy_version = version

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None


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

"""The server-fleet engine: ``vllm serve`` processes reached over HTTP, sticky sessions, a folder for weights.

Same contract as every engine (``rollout/engine.py``): token ids in, token ids + behavior
log-probs + policy version out. The servers are OpenAI-compatible vLLM servers, started by
``fit`` on loopback (:mod:`~lightning_agentrl.rollout.vllm_launch`) or listed in ``engine.urls``.

What this engine guarantees, and how:

- **Token ids in, token ids out.** A request is ``POST /v1/completions`` whose ``prompt`` is the
  list of ids, with ``return_token_ids`` and ``logprobs: 0``; the sampled ids are the response's
  ``token_ids`` and each one's log-prob is its ``token_logprobs`` entry. The tokens are also asked
  as ``token_id:N`` strings (``return_tokens_as_token_ids``) and must name the same ids.
- **The same sampling and log-prob rule as the in-process vLLM engine.** The sampling fields come
  from :func:`~lightning_agentrl.rollout.vllm_engine.vllm_sampling_fields`, and servers started
  here run with ``--logprobs-mode`` :data:`~lightning_agentrl.rollout.engine.VLLM_LOGPROBS_MODE`
  (servers listed in ``engine.urls`` must be started with it too).
- **Sticky sessions.** All turns of one episode go to one server (its prefix cache holds the
  conversation so far); a new episode goes to the live server with the fewest requests in flight.
- **A dead server ends only its own episodes.** A server that cannot be reached, or drops a
  request, is marked dead: that request, and every later turn of the episodes pinned to it, raise
  :class:`~lightning_agentrl.rollout.engine.EngineInfraError`, which ends the episode with
  ``engine_error`` (excluded from training, like a lost sandbox). An episode whose *first* request
  finds its server dead is placed on another one (nothing was generated there). New episodes go
  to the live servers. When none is left, :class:`NoLiveServerError` stops the run.
- **Weight sync stamped with the policy version, through a shared folder.** ``update_weights``
  checks the update against the checkpoint's names and shapes, writes it as safetensors into
  ``weights_dir/v<version>/``, closes the gate for new requests, waits for the requests in
  flight (they finish with the old weights), then has every live server reload from that folder
  (``/collective_rpc`` ``reload_weights``), drop its prefix cache and take the version as its
  weight version (``/update_weight_version``; ``/weight_info`` reports it), and reopens the gate.
  A ``Generation`` records the version in force when it was admitted, which produced it. The
  folder must be visible to the servers at the same path (loopback servers: the run folder).
  With LoRA (``lora``) the update is the adapters only, written as a peft folder and loaded on every
  server as a new adapter named after the version (``/v1/load_lora_adapter``, the servers started
  with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); requests then name it as
  their ``model``, and the previous version's adapter is unloaded (and the last one when the engine closes:
  a server outlives runs). Names carry a nonce of the process (``policy-<nonce>-v<version>``), so a run
  never collides with adapters another run, or a killed run before its resume, left on a shared server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_agentrl.rollout.engine import EngineInfraError, Generation, SamplingParams
from lightning_agentrl.rollout.vllm_engine import (
    _VLLM_FINISH_REASONS,
    PromptTooLongError,
    StickyRouter,
    checkpoint_weight_shapes,
    prepare_weight_update,
    vllm_sampling_fields,
)

log = logging.getLogger(__name__)


class ServerDeadError(EngineInfraError):
    """The episode's server died or could not be reached; the episode is excluded from training."""


class NoLiveServerError(RuntimeError):
    """Every server of the fleet is dead: nothing can generate, the run stops."""


@dataclass
class ServerState:
    url: str
    error: str | None = None  # why it was marked dead; None while it lives

    @property
    def alive(self) -> bool:
        return self.error is None


class VLLMServerEngine:
    """``GenerationEngine`` over ``vllm serve`` servers at ``urls`` (one per entry).

    Args:
        urls: base URLs (``http://host:port``) of servers that serve ``model_path``'s architecture.
        model_path: local HF folder of the served model: the names and shapes an update must have.
        weights_dir: the shared folder where updates are written for the servers to read.
        max_model_len: the servers' ``--max-model-len``; a prompt must leave room for a token.
        connect_timeout_s: seconds to open a connection; reading a generation has no deadline
            here (the agent loop's ``generation_timeout_s`` bounds it).
        reload_timeout_s: longest wait for each call of a server's weight reload; a server past it
            is marked dead (a weight sync never waits forever on one server).
    """

    def __init__(self, urls: list[str], *, model_path: str, weights_dir: str | Path, max_model_len: int,
                 connect_timeout_s: float = 10.0, reload_timeout_s: float = 600.0, lora: Any = None) -> None:
        if not urls:
            raise ValueError("VLLMServerEngine needs at least one server URL")
        self.servers = [ServerState(url.rstrip("/")) for url in urls]
        self.router = StickyRouter(len(urls))
        self.model_path = str(model_path)
        self.weights_dir = Path(weights_dir)
        self.max_model_len = max_model_len
        self.connect_timeout_s = connect_timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.policy_version = 0
        self._expected_shapes = checkpoint_weight_shapes(self.model_path)
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        self._tied_embeddings = bool(config.get("tie_word_embeddings", False))
        self._vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        self._client = None  # httpx2.AsyncClient, made in the loop that uses the engine
        self._admission_open: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._num_in_flight = 0
        self._request_counter = itertools.count()
        self.lora = lora  # lightning_agentrl.lora.VLLMAdapters: syncs load adapters, not weights
        self._adapter: str | None = None  # the adapter of the current version (None: the base)

    @property
    def num_live_servers(self) -> int:
        return sum(server.alive for server in self.servers)

    def _ensure_started(self) -> None:
        if self._client is None:
            import httpx2

            timeout = httpx2.Timeout(None, connect=self.connect_timeout_s)
            self._client = httpx2.AsyncClient(timeout=timeout, limits=httpx2.Limits(max_connections=None))
            self._admission_open = asyncio.Event()
            self._admission_open.set()
            self._drained = asyncio.Event()
            self._drained.set()
            self._update_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._client is not None:
            if self._adapter is not None:  # a server outlives the run: leave it no adapter of ours
                await self._unload(self._adapter)
                self._adapter = None
            await self._client.aclose()
            self._client = None

    # -- generation --------------------------------------------------------------------------

    def _request_body(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str) -> dict[str, Any]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens, max_model_len is {self.max_model_len}: no room for a new token"
            )
        return {
            "prompt": list(prompt_ids),
            **vllm_sampling_fields(sampling, max_tokens=min(sampling.max_new_tokens, room)),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "request_id": f"{session_id}-{next(self._request_counter)}",
            **({"model": self._adapter} if self._adapter is not None else {}),
        }

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, session_id: str) -> Generation:
        """Sample a continuation on the server ``session_id`` is pinned to."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self._ensure_started()
        body = self._request_body(prompt_ids, sampling, session_id)
        first_request = self.router.replica_of(session_id) is None
        while True:
            await self._admission_open.wait()
            if not self.num_live_servers:
                raise NoLiveServerError("every inference server is dead: " + self._errors())
            version = self.policy_version
            index = self.router.acquire(session_id)
            self._num_in_flight += 1
            self._drained.clear()
            try:
                choice = await self._complete(index, body)
            except ServerDeadError:
                if first_request and self.num_live_servers:  # nothing was generated there: place it again
                    self.router.unpin(session_id)
                    continue
                raise
            finally:
                self.router.release(index)
                self._num_in_flight -= 1
                if self._num_in_flight == 0:
                    self._drained.set()
            try:
                return self._to_generation(choice, sampling, version, index)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
                raise self._mark_dead(index, f"a malformed completion: {type(err).__name__}: {err}") from err

    def _errors(self) -> str:
        return "; ".join(f"{server.url}: {server.error}" for server in self.servers)

    async def _complete(self, index: int, body: dict[str, Any]) -> dict[str, Any]:
        import httpx2

        server = self.servers[index]
        if not server.alive:
            raise ServerDeadError(f"inference server {server.url} is dead ({server.error})")
        try:
            response = await self._client.post(f"{server.url}/v1/completions", json=body)
        except httpx2.TransportError as err:  # refused, reset, dropped mid-response
            raise self._mark_dead(index, f"{type(err).__name__}: {err}") from err
        if response.status_code >= 500:
            if not await self._healthy(index):
                raise self._mark_dead(index, f"HTTP {response.status_code} and /health fails")
            raise EngineInfraError(f"inference server {server.url} answered HTTP {response.status_code}: "
                                   f"{response.text[:500]}")
        if response.status_code != 200:  # a request this engine made wrong: a bug, not infrastructure
            raise RuntimeError(f"inference server {server.url} refused a completion request "
                               f"(HTTP {response.status_code}): {response.text[:1000]}")
        try:
            return response.json()["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as err:  # a server that answers garbage is broken
            raise self._mark_dead(index, f"a completion reply that is not vLLM's ({type(err).__name__}: "
                                         f"{response.text[:200]!r})") from err

    async def _healthy(self, index: int) -> bool:
        try:
            response = await self._client.get(f"{self.servers[index].url}/health", timeout=5.0)
        except Exception:  # unreachable, timed out: not healthy
            return False
        return response.status_code == 200

    def _mark_dead(self, index: int, why: str) -> ServerDeadError:
        server = self.servers[index]
        if server.alive:
            server.error = why
            self.router.mark_dead(index)
            log.warning("inference server %s is dead (%s); %d server(s) left", server.url, why,
                        self.num_live_servers)
        return ServerDeadError(f"inference server {server.url} is dead ({server.error})")

    def _to_generation(self, choice: dict[str, Any], sampling: SamplingParams, version: int, index: int) -> Generation:
        """The reply as a :class:`Generation`; ``ValueError`` (and the like) for a reply that breaks the
        contract: the caller marks that server dead."""
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"]
        named = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
        if named != token_ids:
            raise ValueError(f"the server's tokens {named[:5]} are not its token_ids {token_ids[:5]}")
        if self._vocab_size is not None and any(not 0 <= t < self._vocab_size for t in token_ids):
            raise ValueError(f"token ids outside the vocabulary of {self._vocab_size}")
        if len(logprobs["token_logprobs"]) != len(token_ids):
            raise ValueError("one log-prob per token expected")
        finish_reason = _VLLM_FINISH_REASONS.get(choice["finish_reason"], "abort")
        if finish_reason == "stop" and not (token_ids and token_ids[-1] in sampling.stop_token_ids):
            raise ValueError(f"stop without a trailing stop id: {token_ids[-3:]}")
        return Generation(
            token_ids=token_ids,
            logprobs=[float(lp) for lp in logprobs["token_logprobs"]],
            finish_reason=finish_reason,
            policy_version=version,
            extra={"replica": index, "server": self.servers[index].url},
        )

    # -- weights -----------------------------------------------------------------------------

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights to ``weights_dir/v<version>/`` and have every live server reload them.

        Validation happens before anything is paused, so a wrong update raises ``ValueError`` and
        the servers keep serving the old weights. A server that fails its reload is marked dead."""
        if version < self.policy_version:
            raise ValueError(f"policy version must not go back: {version} < {self.policy_version}")
        if self.lora is not None:
            return await self._update_adapters(named_tensors, version)
        tensors = prepare_weight_update(named_tensors, self._expected_shapes, tied_embeddings=self._tied_embeddings)
        folder = self.weights_dir / f"v{version:06d}"
        await asyncio.to_thread(_write_weights, tensors, folder, Path(self.model_path))
        self._ensure_started()
        async with self._update_lock:
            self._admission_open.clear()
            try:
                await self._drained.wait()  # requests in flight finish with the old weights
                live = [i for i, server in enumerate(self.servers) if server.alive]
                await asyncio.gather(*(self._reload(i, folder, version) for i in live))
                if not self.num_live_servers:
                    raise NoLiveServerError("every inference server is dead after the weight update: " + self._errors())
                self.policy_version = version
            finally:
                self._admission_open.set()
        for old in self.weights_dir.glob("v*"):  # the servers read only the newest
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    async def _reload(self, index: int, folder: Path, version: int) -> None:
        import httpx2

        url = self.servers[index].url
        calls = [
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}),
            ("/reset_prefix_cache", None),  # no block computed with the old weights may be hit
            ("/update_weight_version", {"new_version": str(version)}),
        ]
        try:
            for path, body in calls:
                response = await self._client.post(f"{url}{path}", json=body, timeout=self.reload_timeout_s)
                if response.status_code == 404:
                    raise RuntimeError(f"{url}{path} is missing: start the server with VLLM_SERVER_DEV_MODE=1")
                response.raise_for_status()
        except (httpx2.HTTPError, RuntimeError) as err:  # a timeout is an httpx2.HTTPError too
            self._mark_dead(index, f"weight reload to version {version} failed: {type(err).__name__}: {err}")

    async def _update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """LoRA: the adapters as a peft folder, loaded on every live server under the version's name once the
        requests in flight (with the old adapter) have finished; then the old adapter is unloaded."""
        folder = await asyncio.to_thread(self.lora.write, list(named_tensors), version)
        self._ensure_started()
        name, previous = self.lora.name(version), self._adapter
        async with self._update_lock:
            self._admission_open.clear()
            try:
                await self._drained.wait()
                live = [i for i, server in enumerate(self.servers) if server.alive]
                body = {"lora_name": name, "lora_path": str(folder.resolve())}
                await asyncio.gather(*(self._post_or_die(i, "/v1/load_lora_adapter", body, version) for i in live))
                if not self.num_live_servers:
                    raise NoLiveServerError("every inference server is dead after the adapter update: " + self._errors())
                self._adapter, self.policy_version = name, version
            finally:
                self._admission_open.set()
        if previous is not None and previous != name:  # frees the server's slot
            await self._unload(previous)

    async def _unload(self, name: str) -> None:
        """Unload adapter ``name`` from every live server, best effort: a failure costs only the server's memory."""
        live = [i for i, server in enumerate(self.servers) if server.alive]
        await asyncio.gather(*(self._client.post(f"{self.servers[i].url}/v1/unload_lora_adapter",
                                                 json={"lora_name": name}, timeout=30.0) for i in live),
                             return_exceptions=True)

    async def _post_or_die(self, index: int, path: str, body: dict, version: int) -> None:
        import httpx2

        url = self.servers[index].url
        try:
            response = await self._client.post(f"{url}{path}", json=body, timeout=self.reload_timeout_s)
            if response.status_code == 404:
                raise RuntimeError(f"{url}{path} is missing: start the server with --enable-lora and "
                                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
            if not response.is_success:  # the server's reason (a rank above --max-lora-rank, a name taken) matters
                raise RuntimeError(f"HTTP {response.status_code} from {url}{path}: {response.text[:500]}")
        except (httpx2.HTTPError, RuntimeError) as err:
            self._mark_dead(index, f"adapter update to version {version} failed: {type(err).__name__}: {err}")

    def stats(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version, "num_live_servers": self.num_live_servers,
                **self.router.stats()}


def _write_weights(tensors: dict[str, torch.Tensor], folder: Path, model_path: Path) -> None:
    """One safetensors file plus the model's config, written under a temporary name then renamed,
    so a server never reads a half-written folder."""
    from safetensors.torch import save_file

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)

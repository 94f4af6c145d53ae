"""An OpenAI-compatible gateway: an agent that brings its own loop calls the policy, and every call is a turn.

The rollout service starts one HTTP server (FastAPI on uvicorn, on loopback, on the service's event loop,
beside the engine) and gives each episode of ``env.kind: gateway`` its own base URL,
``http://127.0.0.1:PORT/episodes/<episode id>/v1``, and API key; another episode's key is refused (401).
``POST /v1/chat/completions`` (streamed as server-sent events, or not) and ``GET /v1/models`` are served.

Token-in/token-out through it (SPEC §5), the guarantees and how they are kept:

- **The trained ids are the sampled ids.** A request's messages (and ``tools``) are rendered with the
  policy's chat template into ids; the engine samples a continuation of exactly those ids; the reply's text
  is decoded from the sampled ids, and the trajectory records those ids with mask 1, their behavior log-probs
  and policy version, and a digest for :func:`~lightning_agentrl.trajectory.check_token_in_token_out`.
  Nothing the agent sends back is re-encoded into an action.
- **Exact-prefix rule.** When a request's ids begin with the episode's previous prompt and sampled ids
  exactly, the ids after that prefix (the agent's tool results, the template's scaffolding, its re-rendering
  of the reply after the sampled end-of-turn id) are appended as observation ids (mask 0) and the call
  continues the segment. Otherwise (the agent dropped or edited history, its framework serialized a message
  otherwise, the re-encoded reply differs from the sampled ids, or another call of the episode is still
  generating) the call opens a new segment of the same episode, counted in ``info["prefix_breaks"]``
  (``gateway/prefix_breaks``). Each segment is thus exactly the context the policy was conditioned on.
- **Sampling is the run's.** Temperature, top-p and top-k are the run's (the log-prob rule and the
  importance weights depend on them); a request asking for other values is served with the run's, and each
  such field is logged once. ``max_tokens`` / ``max_completion_tokens`` is capped by ``engine.max_new_tokens``
  and the room left in ``env.max_context_tokens``; a prompt with no room left is refused with OpenAI's
  ``context_length_exceeded`` (400) and the episode ends ``max_context``. ``stop`` strings cut the sampled
  ids at the first one whose text holds a stop string (a prefix of a sample is a sample).
- **One turn per call**, its GiGPO anchor the hash of the rendered prompt (calls from the same conversation
  state compare), its reward 0 except the last turn's, which is the episode's reward.

Tool calls in a reply, several or one, are read in the policy's family format (``env.tool_call_format``,
:mod:`~lightning_agentrl.envs.call_formats`) as the built-in loop reads them, and checked against the request's
``tools`` (arguments of any JSON type); ``finish_reason`` is ``tool_calls``, ``stop`` or ``length``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, Request  # module level: the routes' annotations are resolved from here
from fastapi.responses import JSONResponse, StreamingResponse

from lightning_agentrl.envs.base import EnvInfraError, encodable
from lightning_agentrl.envs.call_formats import CallFormat, read_calls, rendered_probe
from lightning_agentrl.envs.gateway import AgentError
from lightning_agentrl.envs.tools import (
    JSON_TYPES,
    STRING_OR_OTHER,
    ToolCall,
    ToolCallError,
    ToolSpec,
    parse_tool_calls,
)
from lightning_agentrl.rollout.agent_loop import EpisodeBudget, close_env, request_seed
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import EngineInfraError, Generation, GenerationEngine, SamplingParams
from lightning_agentrl.trajectory import (
    DIGESTS_KEY,
    Segment,
    TerminationReason,
    Trajectory,
    Turn,
    action_digest,
)

log = logging.getLogger(__name__)

MODEL_ID = "policy"
"""The one model ``GET /v1/models`` lists; a request may name any model (it is served by the policy)."""
RUN_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
"""Request fields whose value must match the run's (``engine.*``), else it is served with the run's."""
UNSUPPORTED = ("presence_penalty", "frequency_penalty", "logit_bias", "seed", "response_format", "logprobs",
               "top_logprobs", "min_p", "repetition_penalty")
"""Request fields the gateway serves without (a penalty or bias would change the sampled distribution)."""


class GatewayRefusal(Exception):
    """A request refused with OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _warn_once(warned: set[str], name: str, message: str) -> None:
    """Log ``message`` the first time ``name`` is seen in ``warned`` (the run's gateway's)."""
    if name not in warned:
        warned.add(name)
        log.warning("gateway: %s", message)


def body_limit(max_context_tokens: int) -> int:
    """The largest request body read, in bytes: 1 MiB plus 64 per token of the context (a token's text, escaped
    as JSON, is rarely over 20 bytes); a larger one could never fit and is refused before it is tokenized.

    >>> body_limit(2048)
    1179648
    """
    return 2**20 + 64 * max_context_tokens


async def _capped_body(request, limit: int) -> bytes:
    """The body, read only up to ``limit`` bytes: 413 (OpenAI's error shape) past it."""
    refusal = GatewayRefusal(413, f"the request body is over {limit} bytes: it cannot fit env.max_context_tokens",
                             code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise refusal
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise refusal
    return b"".join(chunks)


# -- messages in, reply out (pure) ----------------------------------------------------------------
def template_messages(messages: Any) -> list[dict]:
    """OpenAI chat messages as chat templates take them: text parts joined, ``content`` None as "" (but beside
    ``tool_calls``), ``tool_calls`` arguments as objects (templates write them with ``tojson``)."""
    if not isinstance(messages, list) or not messages:
        raise GatewayRefusal(400, "messages must be a non-empty list", param="messages")
    converted = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise GatewayRefusal(400, f"messages[{index}] must be an object with a role", param="messages")
        role = "system" if message["role"] == "developer" else message["role"]  # OpenAI's newer name for it
        calls = message.get("tool_calls")
        # content None beside calls stays None: DeepSeek's template writes the calls only then
        content = None if calls and message.get("content") is None else _text(message.get("content"), index)
        converted.append({**message, "role": role, "content": content})
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                       for c in calls):
                raise GatewayRefusal(400, f"messages[{index}].tool_calls must be a list of "
                                          "{'type': 'function', 'function': {...}}", param="messages")
            converted[-1]["tool_calls"] = [_template_call(call) for call in calls]
    return converted


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return encodable(content)  # a lone surrogate (valid JSON) would fail the tokenizer
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
        return encodable("".join(p.get("text", "") for p in content if p.get("type") in ("text", "input_text", "output_text")))
    raise GatewayRefusal(400, f"messages[{index}].content must be a string or a list of text parts",
                         param="messages")


def _template_call(call: dict) -> dict:
    function = call["function"]
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return {**call, "function": {**function, "arguments": arguments}}


def tool_specs(tools: Any) -> tuple[ToolSpec, ...]:
    """The request's ``tools`` (OpenAI function schemas) as the parser's :class:`ToolSpec`."""
    specs = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GatewayRefusal(400, "each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools")
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        properties = properties if isinstance(properties, dict) else {}
        required = parameters.get("required") if isinstance(parameters, dict) else None
        required = required if isinstance(required, list) else []
        specs.append(ToolSpec(
            function["name"], str(function.get("description", "")),
            {name: str(p.get("description", "")) if isinstance(p, dict) else "" for name, p in properties.items()},
            types={name: _json_type(p) for name, p in properties.items()},
            optional=tuple(name for name in properties if name not in required)))
    return tuple(specs)


def _json_type(schema: Any) -> str:
    """A parameter's JSON type where its schema names one the parser checks; ``string|other`` where a string is
    one of several allowed (a type list, ``anyOf``/``oneOf``: kept as text); else ``any``."""
    if not isinstance(schema, dict):
        return "any"
    kind = schema.get("type")
    if isinstance(kind, str) and kind in JSON_TYPES:
        return kind
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    options = kind if isinstance(kind, list) else [
        o.get("type") for o in (alternatives if isinstance(alternatives, list) else []) if isinstance(o, dict)]
    return STRING_OR_OTHER if "string" in options else "any"


def split_reply(text: str, specs: tuple[ToolSpec, ...], call_format: CallFormat) -> tuple[str | None, list[dict]]:
    """The reply's ``content`` and ``tool_calls``: every call ``call_format`` reads, checked against ``specs``
    (a text that holds none, or a malformed one, is plain content)."""
    if not specs:
        return text, []
    try:
        calls = parse_tool_calls(text, specs, call_format)
    except ToolCallError:
        return text, []
    content = read_calls(text, call_format)[0].content(text)
    return content or None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                             for call in calls]


def before_stop(text: str, stops: list[str]) -> str:
    """``text`` up to its first stop string, what OpenAI returns (the sampled ids still end past it).

    >>> before_stop("ab STOP cd", ["STOP", "cd"]), before_stop("ab", ["x"])
    ('ab ', 'ab')
    """
    return text[:min((i for stop in stops if (i := text.find(stop)) != -1), default=len(text))]


def cut_at_stop(ids: list[int], stops: list[str], decode) -> int:
    """How many of the sampled ``ids`` to keep: up to the first id whose text completes a stop string
    (all of them when none does). ``decode(ids) -> str``.

    >>> text = lambda ids: "".join("abcd"[i] for i in ids)
    >>> cut_at_stop([0, 1, 2, 3], ["bc"], text), cut_at_stop([0, 1, 2, 3], ["x"], text)
    (3, 4)
    """
    if not stops or not any(stop in decode(ids) for stop in stops):
        return len(ids)
    return next(k for k in range(1, len(ids) + 1) if any(stop in decode(ids[:k]) for stop in stops))


def tools_as_text(messages: list[dict], specs: tuple[ToolSpec, ...]) -> list[dict]:
    """For a template that renders no ``tools=``: the tools described in the system message, in the
    ``<tool_call>`` format the parser reads."""
    listing = "You can call these tools:\n" + "\n".join(spec.render() for spec in specs)
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + listing}, *messages[1:]]
    return [{"role": "system", "content": listing}, *messages]


@lru_cache(maxsize=8)
def renders_tool_calls(codec: ChatCodec) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` (Qwen, DeepSeek do; many do not)."""
    return rendered_probe(codec.tokenizer) is not None


def own_replies(messages: list[dict], written: dict[str, str]) -> list[dict]:
    """An assistant message whose calls the policy sampled in this episode (its first call's id is in ``written``,
    call id -> the reply's text as decoded from the sampled ids) as that text, without ``tool_calls``: the template
    renders it back to the sampled ids, where re-writing the calls would not (DeepSeek writes calls only beside
    content None, Llama 3.1's template refuses two calls, a client may re-serialize the arguments)."""
    return [{"role": "assistant", "content": written[m["tool_calls"][0].get("id")]}
            if m.get("tool_calls") and m["tool_calls"][0].get("id") in written else m for m in messages]


def joined_results(messages: list[dict], role: str) -> list[dict]:
    """Tool results in ``role`` (a template without a tool role), consecutive ones in one message a blank line
    apart, as :meth:`~lightning_agentrl.rollout.chat.ChatCodec.observation_ids` joins them where the template
    refuses two in a row (Gemma's roles must alternate)."""
    joined: list[dict] = []
    for message in messages:
        if message["role"] != "tool":
            joined.append(message)
        elif joined and joined[-1].get("joined"):
            joined[-1]["content"] += "\n\n" + message["content"]
        else:
            joined.append({"role": role, "content": message["content"], "joined": True})
    return [{k: v for k, v in m.items() if k != "joined"} for m in joined]


def calls_as_text(messages: list[dict], written: dict[str, str], call_format: CallFormat) -> list[dict]:
    """For a template that writes no ``tool_calls``: an assistant message with calls as text. A reply of this
    episode (its first call's id is in ``written``, call id -> the reply's text as decoded from the sampled
    ids) gets that text back, the policy's own; another gets its calls as ``call_format`` writes them."""
    converted = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            if calls[0].get("id") in written:
                message["content"] = written[calls[0]["id"]]
            else:
                text = call_format.write([ToolCall(c["function"].get("name"), c["function"].get("arguments", {}))
                                          for c in calls])
                message["content"] = (message["content"] + "\n" if message["content"] else "") + text
        converted.append(message)
    return converted


# -- one episode's ids ------------------------------------------------------------------------------
@dataclass
class GatewayEpisode:
    """The trajectory one agent's calls build, and what its calls need (its engine, codec, sampling)."""

    trajectory: Trajectory
    engine: GenerationEngine
    codec: ChatCodec
    sampling: SamplingParams
    budget: EpisodeBudget
    api_key: str = field(default_factory=lambda: "sk-episode-" + secrets.token_urlsafe(24))
    termination: TerminationReason | None = None
    closed: bool = False  # the agent's run ended: a late call records nothing
    busy: Segment | None = None  # the segment a call is generating in
    num_calls: int = 0
    written: dict[str, str] = field(default_factory=dict)  # tool call id -> its reply's text (calls_as_text)
    prefix_breaks: int = 0
    digests: dict[int, str] = field(default_factory=dict)  # id(turn) -> digest of its sampled ids
    fatal: BaseException | None = None  # an engine failure the run cannot go on after
    warned: set[str] = field(default_factory=set)  # request fields logged as ignored: the gateway's, shared

    def end(self, reason: TerminationReason, **info: str) -> None:
        if self.termination is None:
            self.termination = reason
            self.trajectory.info.update(info)

    def context(self, ids: list[int]) -> Segment:
        """The segment a call with prompt ``ids`` generates in (the exact-prefix rule)."""
        segments = self.trajectory.segments
        last = segments[-1] if segments else None
        if last is not None and last is not self.busy and ids[: len(last.token_ids)] == last.token_ids:
            last.extend(ids[len(last.token_ids):], mask=0)
            return last
        self.prefix_breaks += last is not None
        segment = Segment()
        segment.extend(ids, mask=0)
        segments.append(segment)
        return segment

    def record(self, segment: Segment, generation: Generation, keep: int, *, state_key: str, state_text: str,
               tool: str | None, generation_s: float) -> None:
        start = len(segment.token_ids)
        ids = generation.token_ids[:keep]
        segment.extend(ids, mask=1, logprobs=generation.logprobs[:keep], version=generation.policy_version)
        turn = Turn(action_start=start, action_end=len(segment.token_ids), state_key=state_key,
                    state_text=state_text, tool=tool, timings={"generation_s": generation_s})
        segment.turns.append(turn)
        self.digests[id(turn)] = action_digest(ids)

    def finish(self, reward: float | None, started: float) -> Trajectory:
        trajectory = self.trajectory
        termination = self.termination or TerminationReason.SUBMITTED
        trajectory.termination = termination
        trajectory.reward = reward if termination is TerminationReason.SUBMITTED and reward is not None else 0.0
        turns = trajectory.turns
        if turns:
            turns[-1].reward = trajectory.reward
        trajectory.info[DIGESTS_KEY] = [self.digests[id(turn)] for turn in turns]
        trajectory.info.update(gateway_calls=self.num_calls, prefix_breaks=self.prefix_breaks)
        trajectory.timings = {"episode_s": time.monotonic() - started,
                              "generation_s": sum(t.timings["generation_s"] for t in turns)}
        return trajectory


# -- the server -------------------------------------------------------------------------------------
def _quiet_server(config):
    """uvicorn's server without its signal handlers: the run's own (checkpoint, then exit) stay in place."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return QuietServer(config)


class Gateway:
    """The HTTP server and the episodes it serves. :meth:`play` has the signature of
    :func:`~lightning_agentrl.rollout.agent_loop.play_episode`: the rollout service plays the episodes of
    ``env.kind: gateway`` with it. The server starts on the first episode, on the caller's event loop."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port: int | None = None
        self.episodes: dict[str, GatewayEpisode] = {}
        self.warned: set[str] = set()  # request fields already logged as served otherwise
        self._starting: asyncio.Future | None = None
        self._server = None
        self.app = self._build_app()

    def base_url(self, episode_id: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{url_name(episode_id)}/v1"

    async def start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit it: without it a reply written in two parts waits ~40 ms for a delayed ACK
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = _quiet_server(config)
        task = asyncio.create_task(self._serve(sock), name="gateway server")
        while not self._server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        log.info("gateway: serving on http://%s:%d", self.host, self.port)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self._server.serve(sockets=[sock])
        finally:
            sock.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    # -- episodes -----------------------------------------------------------------------------------
    async def play(self, *, engine: GenerationEngine, env, codec: ChatCodec, sampling: SamplingParams,
                   budget: EpisodeBudget, episode_id: str, task_id: str, group_id: int, summarizer=None,
                   resume=None, park_after_s: float | None = None) -> Trajectory:
        """Run the agent once (``env.run_agent``) with this episode's URL and key; its calls are the turns."""
        assert summarizer is None and resume is None and park_after_s is None, "refused by the settings"
        await self.start()
        stops = tuple(dict.fromkeys([*sampling.stop_token_ids, *codec.stop_token_ids]))
        episode = GatewayEpisode(Trajectory(episode_id=episode_id, task_id=task_id, group_id=group_id), engine,
                                 codec, replace(sampling, stop_token_ids=stops), budget, warned=self.warned)
        if url_name(episode_id) in self.episodes:
            raise RuntimeError(f"two episodes named {episode_id!r} at once")
        self.episodes[url_name(episode_id)] = episode
        started, reward = time.monotonic(), None
        try:
            async with asyncio.timeout(budget.episode_timeout_s):
                reward = await env.run_agent(self.base_url(episode_id), episode.api_key)
        except TimeoutError:
            episode.end(TerminationReason.TIMEOUT, timeout="episode")
        except AgentError as err:
            log.warning("episode %s: agent_error: %s", episode_id, err)
            episode.end(TerminationReason.AGENT_ERROR, agent_error=str(err))
        except EnvInfraError as err:  # the sandbox an agent runs in (env.agent_in_sandbox) failed: not its fault
            log.warning("episode %s: sandbox_error: %s", episode_id, err)
            episode.end(TerminationReason.SANDBOX_ERROR, sandbox_error=str(err))
        finally:
            episode.trajectory.info.update(getattr(env, "episode_info", {}))
            episode.closed = True
            self.episodes.pop(url_name(episode_id), None)
            await close_env(env)
        if episode.fatal is not None:
            raise episode.fatal
        if episode.num_calls == 0:
            log.warning("episode %s: the agent never called the model: nothing to train", episode_id)
        return episode.finish(reward, started)

    def _episode(self, episode_id: str, authorization: str | None) -> GatewayEpisode:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise GatewayRefusal(404, f"no episode {episode_id!r} is running (it ended, or never started)",
                                 code="episode_not_found")
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), episode.api_key.encode()):
            raise GatewayRefusal(401, "Incorrect API key provided for this episode", code="invalid_api_key")
        return episode

    # -- the app --------------------------------------------------------------------------------------
    def _build_app(self):
        app = FastAPI(title="lightning-agentrl gateway", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(GatewayRefusal)
        async def refused(request: Request, err: GatewayRefusal):
            return JSONResponse(err.body(), status_code=err.status)

        @app.exception_handler(Exception)
        async def failed(request: Request, err: Exception):  # a bug of ours: logged, answered in OpenAI's shape
            log.error("gateway: %s %s failed", request.method, request.url.path, exc_info=err)
            refusal = GatewayRefusal(500, f"the gateway failed: {type(err).__name__}: {err}", kind="server_error")
            return JSONResponse(refusal.body(), status_code=500)

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str, request: Request):
            self._episode(episode_id, request.headers.get("authorization"))
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                                 "owned_by": "lightning-agentrl"}]}

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat_completions(episode_id: str, request: Request):
            episode = self._episode(episode_id, request.headers.get("authorization"))
            raw = await _capped_body(request, body_limit(episode.budget.max_context_tokens))
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise GatewayRefusal(400, "the request body is not JSON (or nests too deeply)") from None
            if not isinstance(body, dict):
                raise GatewayRefusal(400, "the request body must be a JSON object")
            completion = await self.complete(episode, body)
            if body.get("stream"):
                options = body.get("stream_options") or {}
                usage = options.get("include_usage", False) if isinstance(options, dict) else False
                return StreamingResponse(sse_events(completion, include_usage=usage), media_type="text/event-stream")
            return JSONResponse(completion)  # a response, not a dict: FastAPI's encoder walk is a third of its cost

        return app

    async def complete(self, episode: GatewayEpisode, body: dict) -> dict:
        """One call: render, check the budget, generate, record the turn; the completion object."""
        request = CallRequest.parse(body, episode)
        ids = request.prompt_ids(episode.codec, episode.written)
        room = episode.budget.max_context_tokens - len(ids)
        if episode.termination is None and episode.num_calls >= episode.budget.max_turns:
            episode.end(TerminationReason.MAX_TURNS)
        if episode.termination is not None:
            raise _ended(episode)
        if room < 1:
            episode.end(TerminationReason.MAX_CONTEXT)
            raise _ended(episode, len(ids))
        segment = episode.context(ids)
        max_new = min(request.max_tokens or episode.sampling.max_new_tokens, episode.sampling.max_new_tokens, room)
        generation, generation_s = await self._generate(episode, segment, ids, max_new)
        if episode.closed:
            raise GatewayRefusal(404, "the episode ended while this call was generating", code="episode_not_found")
        text_of = episode.codec.decode_action
        keep = cut_at_stop(generation.token_ids, request.stop, text_of)
        text = text_of(generation.token_ids[:keep])  # the sampled text, trained and re-rendered as is
        content, calls = split_reply(before_stop(text, request.stop), request.specs, episode.codec.call_format)
        if calls:
            episode.written[calls[0]["id"]] = text
        episode.record(segment, generation, keep, state_key=hashlib.sha256(str(ids).encode()).hexdigest()[:16],
                       state_text=request.state_text,
                       tool=",".join(c["function"]["name"] for c in calls) if calls else None,
                       generation_s=generation_s)
        cut = keep < len(generation.token_ids) or generation.finish_reason == "stop"
        reason = "tool_calls" if calls else ("stop" if cut else "length")
        return completion_object(content, calls, reason, request.model, len(ids), keep)

    async def _generate(self, episode: GatewayEpisode, segment: Segment, ids: list[int], max_new: int):
        episode.busy, t0 = segment, time.monotonic()
        seed = request_seed(episode.sampling.seed, episode.trajectory.episode_id, episode.num_calls)
        episode.num_calls += 1
        sampling = replace(episode.sampling, max_new_tokens=max_new, seed=seed)
        try:
            generation = await asyncio.wait_for(episode.engine.generate(list(ids), sampling, episode.trajectory.episode_id),
                                                episode.budget.generation_timeout_s)
        except TimeoutError:
            episode.end(TerminationReason.TIMEOUT, timeout="generation")
            raise GatewayRefusal(504, "the generation ran past env.generation_timeout_s", kind="timeout") from None
        except EngineInfraError as err:
            episode.end(TerminationReason.ENGINE_ERROR, engine_error=f"{type(err).__name__}: {err}")
            raise GatewayRefusal(503, f"the inference server failed: {err}", kind="server_error") from None
        except Exception as err:  # the engine cannot go on: the run stops once the agent returns
            episode.fatal = err
            raise GatewayRefusal(500, f"the engine failed: {type(err).__name__}: {err}", kind="server_error") from None
        finally:
            if episode.busy is segment:
                episode.busy = None
        return generation, time.monotonic() - t0


def url_name(episode_id: str) -> str:
    """The episode's name in its URL: the id where it is URL-safe, else a safe form plus a hash of it.

    >>> url_name("g0-e1"), url_name("eval-a/b c-0")
    ('g0-e1', 'eval-a_b_c-0-8d1962ef')
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", episode_id)
    return safe if safe == episode_id else f"{safe}-{hashlib.sha256(episode_id.encode()).hexdigest()[:8]}"


def _ended(episode: GatewayEpisode, num_prompt_tokens: int | None = None) -> GatewayRefusal:
    if episode.termination is TerminationReason.MAX_CONTEXT:
        size = f"your messages resulted in {num_prompt_tokens} tokens; " if num_prompt_tokens else ""
        return GatewayRefusal(400, f"This model's maximum context length is {episode.budget.max_context_tokens} "
                                   f"tokens; {size}the episode has ended (max_context)",
                              code="context_length_exceeded", param="messages")
    why = f" after env.max_turns={episode.budget.max_turns} calls" if episode.termination is TerminationReason.MAX_TURNS else ""
    return GatewayRefusal(400, f"the episode has ended ({episode.termination.value}){why}", code="episode_ended")


@dataclass
class CallRequest:
    """What a chat-completions body asks for, checked; fields the run decides are logged once and ignored."""

    messages: list[dict]
    specs: tuple[ToolSpec, ...]
    tools: list[dict] | None
    max_tokens: int | None
    stop: list[str]
    model: str
    state_text: str

    @classmethod
    def parse(cls, body: dict, episode: GatewayEpisode) -> CallRequest:
        if body.get("n") not in (None, 1):
            raise GatewayRefusal(400, "n must be 1: each call is one turn of the episode", param="n",
                                 code="unsupported_value")
        _note_sampling(body, episode.sampling, episode.warned)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise GatewayRefusal(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise GatewayRefusal(400, "stop must be a string or a list of strings", param="stop")
        tools = body.get("tools") or None
        if body.get("tool_choice") == "none":
            tools = None
        elif body.get("tool_choice") not in (None, "auto"):
            _warn_once(episode.warned, "tool_choice", f"tool_choice={body['tool_choice']!r} is served as 'auto' (sampling is not forced)")
        messages = template_messages(body.get("messages"))
        state_text = messages[-1]["content"][-1000:]
        return cls(messages, tool_specs(tools), tools, max_tokens, stop, str(body.get("model") or MODEL_ID), state_text)

    def prompt_ids(self, codec: ChatCodec, written: dict[str, str]) -> list[int]:
        """The request rendered with the policy's chat template (its tools through ``tools=`` where the template
        renders them, else described in the system message)."""
        messages, tools = own_replies(self.messages, written), self.tools
        if tools and not codec.renders_tools:
            messages, tools = tools_as_text(messages, self.specs), None
        if not renders_tool_calls(codec):
            messages = calls_as_text(messages, written, codec.call_format)
        elif codec.call_format.arguments_as_text:  # e.g. DeepSeek's template concatenates the JSON text
            messages = [_arguments_as_text(m) if m.get("tool_calls") else m for m in messages]
        if codec.observation_role != "tool":  # e.g. Gemma's template knows no tool role: results as the codec shows them
            messages = joined_results(messages, codec.observation_role)
        try:
            try:
                return codec.prompt_ids(messages, tools=tools)
            except Exception:  # noqa: BLE001 - a template that concatenates content: "" where it is None
                if all(m["content"] is not None for m in messages):
                    raise
                return codec.prompt_ids([{**m, "content": m["content"] or ""} for m in messages], tools=tools)
        except Exception as err:  # jinja2's TemplateError, or what a template raises itself
            raise GatewayRefusal(400, f"the policy's chat template cannot render these messages: "
                                      f"{type(err).__name__}: {err}", param="messages") from None


def _arguments_as_text(message: dict) -> dict:
    calls = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"] if isinstance(
        c["function"].get("arguments"), str) else json.dumps(c["function"].get("arguments", {}))}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _note_sampling(body: dict, sampling: SamplingParams, warned: set[str]) -> None:
    for name, attribute in RUN_SAMPLING.items():
        value = body.get(name)
        if value is not None and value != getattr(sampling, attribute):
            _warn_once(warned, name, f"{name}={value!r} requested; served with the run's {getattr(sampling, attribute)!r} "
                             "(the log-prob rule and the importance weights depend on it; engine.*)")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, {}, []):
            _warn_once(warned, name, f"{name} is not supported by the gateway; served without it")


def completion_object(content: str | None, calls: list[dict], reason: str, model: str, num_prompt: int,
                      num_completion: int) -> dict:
    """A ``chat.completion`` as OpenAI returns it."""
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                      "total_tokens": num_prompt + num_completion}}


def sse_events(completion: dict, *, include_usage: bool):
    """The completion as OpenAI streams it: ``chat.completion.chunk`` events (role, content, tool calls,
    finish reason, then usage when asked), then ``data: [DONE]``."""
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    choice, usage = completion["choices"][0], {"usage": None} if include_usage else {}
    message = choice["message"]
    deltas = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls", [])):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    for delta in deltas:
        yield _event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **usage})
    yield _event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}], **usage})
    if include_usage:
        yield _event({**base, "choices": [], "usage": completion["usage"]})
    yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"

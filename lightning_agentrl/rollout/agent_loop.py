"""One episode, token in and token out (SPEC §4, §5).

The loop owns the token ids of the episode. It asks the engine for an action given the exact
ids so far, appends the sampled ids with mask 1 and their behavior log-probs and policy version,
decodes a *copy* of the action to text only to let the environment parse the tool call, and
appends the observation as template scaffolding (encoded once) around the encoding of only the
new observation text, all with mask 0. Each episode ends with exactly one termination reason:

===============  =================================================================================
submitted        the environment said ``done`` (the agent submitted; the reward is the score)
max_turns        ``max_turns`` environment steps were taken
max_context      the next action or observation does not fit in ``max_context_tokens`` (and no
                 summarizer is configured, or even the summarized context does not fit)
timeout          a generation past ``generation_timeout_s``, a tool past the environment's tool timeout
                 (it raised :class:`~lightning_agentrl.envs.base.ToolTimeout`), or the episode past
                 ``episode_timeout_s`` (``info["timeout"]`` says which)
tool_error       ``max_tool_errors`` consecutive actions that the environment rejected
sandbox_error    the environment's infrastructure failed (it raised
                 :class:`~lightning_agentrl.envs.base.EnvInfraError`, e.g. a lost sandbox, an
                 unreachable service); excluded from training
engine_error     the engine's inference server for this episode died or was unreachable
                 (:class:`~lightning_agentrl.rollout.engine.EngineInfraError`); excluded from training
scoring_timeout  the agent submitted, and the hidden tests ran past the scoring time limit: reward 0
unscorable_      the agent submitted a workspace it made too large, too deep or too slow to snapshot
workspace        for scoring: reward 0 (the agent's doing, never ``sandbox_error``)
===============  =================================================================================

Three more things happen here:

- **Deterministic sampling**: request ``k`` of an episode is sampled with the seed
  :func:`request_seed` ``(run seed, episode id, k)``, so a run is reproducible whatever the
  engine's batching (engines sample each request with its own generator).
- **Summarized history** (:mod:`~lightning_agentrl.rollout.summarize`): when the context would
  overflow, history is compressed into a new segment of the same episode.
- **Partial rollouts** (Kimi-Researcher): with ``park_after_s``, an episode that has been running
  that long is *parked* at its next turn boundary: :func:`play_episode` returns a
  :class:`ParkedEpisode` (its ids so far, counters, and the environment's state, sandbox id
  included) instead of a trajectory; passing its state back as ``resume`` continues it, typically
  with newer weights, so its tokens carry several policy versions.

:func:`~lightning_agentrl.trajectory.check_token_in_token_out` verifies, per turn, that the ids recorded as an action are the
ids the engine returned (a digest of each generation is kept in ``Trajectory.info``).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace

from lightning_agentrl.envs.base import (
    EnvError,
    EnvInfraError,
    Environment,
    ToolTimeout,
    checked_critic_context,
    checked_messages,
    checked_state_text,
    checked_step,
    clip,
)
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import EngineInfraError, GenerationEngine, SamplingParams
from lightning_agentrl.rollout.summarize import Summarizer
from lightning_agentrl.settings import EnvSettings
from lightning_agentrl.trajectory import (
    DIGESTS_KEY,
    Segment,
    TerminationReason,
    Trajectory,
    Turn,
    action_digest,
)
from lightning_agentrl.trajectory import TokenMismatchError as TokenMismatchError  # re-exported
from lightning_agentrl.trajectory import check_token_in_token_out as check_token_in_token_out  # re-exported


def _submitted_as(info: dict) -> TerminationReason:
    """How an episode whose last step was done ended: scored, or why its score is 0 without a test run."""
    if info.get("workspace_unscorable"):
        return TerminationReason.UNSCORABLE_WORKSPACE
    return TerminationReason.SCORING_TIMEOUT if info.get("scoring_timed_out") else TerminationReason.SUBMITTED


# the last env step ran (or tried) the checks
SCORED = (TerminationReason.SUBMITTED, TerminationReason.SCORING_TIMEOUT, TerminationReason.UNSCORABLE_WORKSPACE)

log = logging.getLogger(__name__)

current_episode: contextvars.ContextVar[EpisodeState] = contextvars.ContextVar("current_episode")
"""The state of the episode whose task is running (set by :meth:`Episode.play`): a sub-agent an environment
calls seeds its sampling from the episode's id and its count of sub-agent calls
(:mod:`~lightning_agentrl.rollout.sub_agent`)."""


def _env_default(name: str):
    return EnvSettings.model_fields[name].default


@dataclass(frozen=True)
class EpisodeBudget:
    """Limits of one episode; each one maps to a termination reason (the tool timeout is the env's).
    The fields are the ``env`` settings of the same names, with their defaults (documented there)."""

    max_turns: int = _env_default("max_turns")
    max_context_tokens: int = _env_default("max_context_tokens")
    generation_timeout_s: float = _env_default("generation_timeout_s")
    episode_timeout_s: float = _env_default("episode_timeout_s")
    max_tool_errors: int = _env_default("max_tool_errors")
    max_observation_chars: int = _env_default("max_observation_chars")

    @classmethod
    def from_settings(cls, env: EnvSettings) -> EpisodeBudget:
        return cls(**{name: getattr(env, name) for name in cls.__dataclass_fields__})

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_context_tokens", "max_tool_errors", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeBudget.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("generation_timeout_s", "episode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpisodeBudget.{name} must be > 0, got {getattr(self, name)}")


def request_seed(run_seed: int | None, episode_id: str, request_index: int) -> int | None:
    """Seed of one generation request: a pure function of the run seed, the episode and the request.

    ``None`` stays ``None`` (unseeded sampling). The same (seed, episode, index) always gives the same
    63-bit seed, in any process, unlike Python's salted ``hash``.
    """
    if run_seed is None:
        return None
    digest = hashlib.blake2b(f"{run_seed}/{episode_id}/{request_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# -- episode state (partial rollouts) ---------------------------------------------------------------
@dataclass
class EpisodeState:
    """Everything needed to continue an episode later; round-trips through :meth:`state_dict`."""

    trajectory: Trajectory
    messages: list[dict]  # the opening messages: every summarized segment starts from them
    history: list[dict] = field(default_factory=list)  # per env step: action, observation, tool (texts)
    num_steps: int = 0  # environment steps taken (the max_turns budget)
    consecutive_errors: int = 0
    active_s: float = 0.0  # wall clock spent running, parked time excluded (the episode budget)
    generation_s: float = 0.0
    tool_s: float = 0.0
    env_state: dict = field(default_factory=dict)
    parked_version: int = -1  # the engine's policy version when the episode was last parked
    num_parks: int = 0
    sub_agent_calls: int = 0  # the sub-agent's sampling seed of call k is request_seed(seed, "<id>/sub-agent", k)

    def next_sub_agent_seed(self, run_seed: int | None) -> int | None:
        """The seed of this episode's next sub-agent call: a pure function of the run seed, the episode and
        the call's index in it (as :func:`request_seed` is for the policy's requests)."""
        self.sub_agent_calls += 1
        return request_seed(run_seed, f"{self.trajectory.episode_id}/sub-agent", self.sub_agent_calls - 1)

    def state_dict(self) -> dict:
        return {
            "trajectory": self.trajectory.model_dump(mode="json"),
            "messages": self.messages,
            "history": self.history,
            "num_steps": self.num_steps,
            "consecutive_errors": self.consecutive_errors,
            "active_s": self.active_s,
            "generation_s": self.generation_s,
            "tool_s": self.tool_s,
            "env_state": self.env_state,
            "parked_version": self.parked_version,
            "num_parks": self.num_parks,
            "sub_agent_calls": self.sub_agent_calls,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> EpisodeState:
        return cls(**{**state, "trajectory": Trajectory.model_validate(state["trajectory"])})


@dataclass
class ParkedEpisode:
    """An episode stopped at a turn boundary. ``env`` is the live environment (its sandbox is kept);
    it is ``None`` after a restore from a checkpoint: rebuild it and :func:`restore_env_state`."""

    state: EpisodeState
    env: Environment | None = None


def save_env_state(env: Environment) -> dict:
    """The environment's resumable state: its ``state_dict()`` if it has one, else its JSON-serializable
    attributes (for :class:`~lightning_agentrl.envs.coding.CodingEnv`: sandbox id, files written, last
    observation)."""
    if hasattr(env, "state_dict"):
        return env.state_dict()
    state, dropped = {}, []
    for name, value in vars(env).items():
        try:
            kept = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            dropped.append(f"{name} ({type(value).__name__}, dropped)")  # clients, tasks: rebuilt; a set: lost
            continue
        if kept != value:
            dropped.append(f"{name} ({type(value).__name__}, comes back as {type(kept).__name__})")
        state[name] = value
    _warn_lossy_state(type(env), dropped)
    return state


_warned_lossy: set[type] = set()


def _warn_lossy_state(cls: type, lossy: list[str]) -> None:
    """Once per class: the attributes a parked episode's checkpoint does not keep as they are."""
    if lossy and cls not in _warned_lossy:
        _warned_lossy.add(cls)
        log.warning("%s has no state_dict: a parked episode restored from a checkpoint loses %s (what "
                    "from_settings rebuilds is fine; write state_dict and load_state_dict for the rest)",
                    cls.__qualname__, ", ".join(lossy))


def restore_env_state(env: Environment, state: dict) -> Environment:
    """Inverse of :func:`save_env_state` on a freshly built environment (no ``reset``)."""
    if hasattr(env, "load_state_dict"):
        env.load_state_dict(state)
    else:
        for name, value in state.items():
            setattr(env, name, value)
    return env


# -- the loop ---------------------------------------------------------------------------------------
async def env_call(env: Environment, call, method: str):
    """Await ``env.<method>(...)`` (the coroutine ``call``); an exception of its backend that its
    ``classify_error`` maps to :class:`EnvInfraError` or :class:`ToolTimeout` is raised as that (from the
    original). Anything else it raises is its own bug: :class:`EnvError` naming the class and method, with
    the traceback logged; a ``CancelledError`` this task was not sent (a cancelled inner request) too,
    where it would otherwise end the episode's group without a word and leave the run waiting for it."""
    name = f"{type(env).__qualname__}.{method}"
    try:
        return await call
    except (EnvInfraError, ToolTimeout, EngineInfraError, TimeoutError):  # a sub-agent's engine; a user's timeout
        raise
    except asyncio.CancelledError as err:
        task = asyncio.current_task()
        if task is None or task.cancelling():  # the trainer cancelled the episode (a timeout, a stop)
            raise
        raise _env_error(f"{name} raised CancelledError: {err or 'no message'} (not sent by the rollout: a "
                         "cancelled request inside the environment; catch it there)", err) from err
    except Exception as err:
        mapped = env.classify_error(err)
        if mapped is not None:
            raise mapped from err
        raise _env_error(f"{name} raised {type(err).__name__}: {err}", err) from err


def _env_error(message: str, err: BaseException) -> EnvError:
    log.error("%s", message, exc_info=err)  # the traceback: the run's error line names only the method
    return EnvError(message)


async def close_env(env: Environment) -> None:
    """Release the episode's resources; a failure there is logged, never the end of the run (the
    episode's outcome is already known)."""
    try:
        await env.close()
    except Exception as err:  # noqa: BLE001 - whatever a user's close raises
        log.warning("%s.close failed (ignored): %s: %s", type(env).__qualname__, type(err).__name__, err)


async def run_episode(
    *,
    engine: GenerationEngine,
    env: Environment,
    codec: ChatCodec,
    sampling: SamplingParams,
    budget: EpisodeBudget,
    episode_id: str,
    task_id: str,
    group_id: int,
    summarizer: Summarizer | None = None,
) -> Trajectory:
    """Play one episode to its end and return its trajectory (the environment is closed)."""
    outcome = await play_episode(
        engine=engine, env=env, codec=codec, sampling=sampling, budget=budget, episode_id=episode_id,
        task_id=task_id, group_id=group_id, summarizer=summarizer,
    )
    assert isinstance(outcome, Trajectory), "an episode without park_after_s always ends"
    return outcome


async def play_episode(
    *,
    engine: GenerationEngine,
    env: Environment,
    codec: ChatCodec,
    sampling: SamplingParams,
    budget: EpisodeBudget,
    episode_id: str,
    task_id: str,
    group_id: int,
    summarizer: Summarizer | None = None,
    resume: EpisodeState | None = None,
    park_after_s: float | None = None,
) -> Trajectory | ParkedEpisode:
    """Play an episode (from the start, or from ``resume``) until it ends or is parked.

    ``sampling.seed`` is the run seed; each request gets its own seed from :func:`request_seed`.
    With ``park_after_s``, once this call has run that long and taken at least one step, the
    episode is parked at the next turn boundary and returned as a :class:`ParkedEpisode` (the
    environment stays open). Otherwise the environment is closed and the trajectory returned.
    """
    if park_after_s is not None and park_after_s < 0:
        raise ValueError(f"park_after_s must be >= 0, got {park_after_s}")
    episode = Episode(engine=engine, env=env, codec=codec, sampling=sampling, budget=budget, episode_id=episode_id,
                      task_id=task_id, group_id=group_id, summarizer=summarizer, resume=resume)
    return await episode.play(park_after_s)


class Episode:
    """One call of :func:`play_episode`: the episode's ids, counters and outcome, and the small steps
    that grow them. The termination reason is set in one place, :meth:`end`."""

    def __init__(self, *, engine: GenerationEngine, env: Environment, codec: ChatCodec, sampling: SamplingParams,
                 budget: EpisodeBudget, episode_id: str, task_id: str, group_id: int,
                 summarizer: Summarizer | None, resume: EpisodeState | None) -> None:
        self.engine, self.env, self.codec, self.budget, self.summarizer = engine, env, codec, budget, summarizer
        self.episode_id = episode_id
        self.trajectory = resume.trajectory if resume is not None else Trajectory(
            episode_id=episode_id, task_id=task_id, group_id=group_id
        )
        self.state = resume
        self.run_seed = sampling.seed
        stops = tuple(dict.fromkeys([*sampling.stop_token_ids, *codec.stop_token_ids]))
        self.sampling = replace(sampling, stop_token_ids=stops)
        # Room for a full action after each observation when history can be summarized; else the legacy rule.
        self.limit = budget.max_context_tokens - (summarizer.reserve_tokens if summarizer is not None else 0)
        self.phase = "episode"  # what a timeout interrupted: generation, tool, or the episode budget
        self.termination: TerminationReason | None = None
        self.parked = False
        self.generation_s = 0.0  # of the latest action: its turn's timings

    def end(self, reason: TerminationReason) -> None:
        self.termination = reason

    async def play(self, park_after_s: float | None) -> Trajectory | ParkedEpisode:
        started = time.monotonic()
        deadline = None
        spent = self.state.active_s if self.state is not None else 0.0
        try:
            async with asyncio.timeout(max(self.budget.episode_timeout_s - spent, 0.0)) as deadline:
                if self.state is None:
                    await self.reset()
                current_episode.set(self.state)  # this episode's task only (each episode runs in its own)
                await self.play_turns(started, park_after_s)
        except (TimeoutError, ToolTimeout, EnvInfraError, EngineInfraError) as err:
            self.end_by_error(err, deadline)
        finally:
            if not self.parked:
                await close_env(self.env)
        return self.finish(started)

    async def reset(self) -> None:
        messages = checked_messages(self.env, await env_call(self.env, self.env.reset(), "reset"))
        self.state = EpisodeState(trajectory=self.trajectory, messages=messages)
        first = Segment()
        first.extend(self.codec.prompt_ids(messages, tools=self.env.tools), mask=0)
        self.trajectory.segments.append(first)
        critic_context = checked_critic_context(self.env)
        if critic_context:  # clipped like an observation, and to as many tokens: `plan` bounds the critic's stream by it
            limit = self.budget.max_observation_chars
            self.trajectory.critic_context_ids = self.codec.encode(clip(critic_context, limit))[:limit]

    async def play_turns(self, started: float, park_after_s: float | None) -> None:
        steps_this_call = 0
        while self.termination is None:
            if self.state.num_steps >= self.budget.max_turns:
                self.end(TerminationReason.MAX_TURNS)
            elif park_after_s is not None and steps_this_call > 0 and time.monotonic() - started >= park_after_s:
                self.parked = True
                return
            else:
                await self.turn()
                steps_this_call += 1  # counts only when the loop goes on, i.e. after an environment step

    async def turn(self) -> None:
        """One action, its environment step, and the observation (or a summary) for the next one."""
        segment = self.trajectory.segments[-1]
        room = self.limit - len(segment.token_ids)
        if room < 1:
            return self.end(TerminationReason.MAX_CONTEXT)
        generation = await self.generate(segment.token_ids, min(self.sampling.max_new_tokens, room))
        turn = self.append_action(segment, generation)
        if generation.finish_reason != "stop" and len(segment.token_ids) >= self.limit:
            return self.end(TerminationReason.MAX_CONTEXT)
        segment.extend(self.codec.close_action_ids(generation.token_ids), mask=0)
        action_text = self.codec.decode_action(generation.token_ids)
        result = await self.env_step(turn, action_text)
        state = self.state
        if result.done:
            self.trajectory.reward = result.reward
            return self.end(_submitted_as(result.info))
        state.consecutive_errors = state.consecutive_errors + 1 if result.info.get("error") else 0
        if state.consecutive_errors >= self.budget.max_tool_errors:
            return self.end(TerminationReason.TOOL_ERROR)
        state.history.append({"action": action_text, "observation": result.observation, "tool": turn.tool})
        await self.observe(segment, result.observation, result.tool_results)

    async def env_step(self, turn: Turn, action_text: str):
        self.phase = "tool"
        t0 = time.monotonic()
        result = checked_step(self.env, await env_call(self.env, self.env.step(action_text), "step"),
                              max_observation_chars=self.budget.max_observation_chars)
        turn.timings["env_s"] = time.monotonic() - t0
        self.state.tool_s += turn.timings["env_s"]
        self.phase = "episode"
        self.state.num_steps += 1
        turn.tool = result.info.get("tool")
        turn.reward = result.reward
        return result

    async def observe(self, segment: Segment, observation_text: str, tool_results: tuple[str, ...] = ()) -> None:
        """Append the observation (each of several calls' results as a tool message of its own), or open a
        summarized segment when it would not fit."""
        observation = self.codec.observation_ids(*(tool_results or (observation_text,))).all
        needed = len(observation) + (self.sampling.max_new_tokens if self.summarizer is not None else 0)
        if len(segment.token_ids) + needed < self.limit:
            segment.extend(observation, mask=0)
        elif self.summarizer is not None and self.state.num_steps >= self.budget.max_turns:
            self.end(TerminationReason.MAX_TURNS)  # no action left to summarize for
        elif self.summarizer is None or not await self.summarize(observation_text):
            self.end(TerminationReason.MAX_CONTEXT)

    async def generate(self, ids: list[int], max_new_tokens: int):
        self.phase = "generation"
        t0 = time.monotonic()
        request = replace(
            self.sampling, max_new_tokens=max_new_tokens,
            seed=request_seed(self.run_seed, self.episode_id, len(self.trajectory.turns)),
        )
        generation = await asyncio.wait_for(
            self.engine.generate(list(ids), request, self.episode_id), self.budget.generation_timeout_s
        )
        self.generation_s = time.monotonic() - t0
        self.state.generation_s += self.generation_s
        self.phase = "episode"
        self.trajectory.info.setdefault(DIGESTS_KEY, []).append(action_digest(generation.token_ids))
        return generation

    def append_action(self, segment: Segment, generation, *, tool: str | None = None) -> Turn:
        start = len(segment.token_ids)
        segment.extend(generation.token_ids, mask=1, logprobs=generation.logprobs, version=generation.policy_version)
        state_text = checked_state_text(self.env)  # before state_key, which hashes it
        turn = Turn(action_start=start, action_end=len(segment.token_ids), state_key=self.env.state_key,
                    state_text=state_text, tool=tool, timings={"generation_s": self.generation_s})
        segment.turns.append(turn)
        return turn

    async def summarize(self, pending_observation: str | None) -> bool:
        """Open a new segment = opening messages + summary; False when even that does not fit."""
        summarizer, state = self.summarizer, self.state
        policy_summary = None
        if summarizer.writes_actions:
            segment = self.trajectory.segments[-1]
            segment.extend(summarizer.instruction_ids(), mask=0)
            room = self.budget.max_context_tokens - len(segment.token_ids)
            assert room >= 1, "the summary reserve keeps room for the instruction and the summary"
            generation = await self.generate(segment.token_ids, min(summarizer.max_summary_tokens, room))
            self.append_action(segment, generation, tool="summarize")
            policy_summary = self.codec.decode_action(generation.token_ids)
        message = summarizer.summary_message(
            state.history, policy_summary=policy_summary, pending_observation=pending_observation, env=self.env
        )
        ids = self.codec.prompt_ids([*state.messages, message], tools=self.env.tools)
        if len(ids) + self.sampling.max_new_tokens > self.limit:
            return False
        segment = Segment()
        segment.extend(ids, mask=0)
        self.trajectory.segments.append(segment)
        return True

    def end_by_error(self, err: BaseException, deadline) -> None:
        """The reason for an episode that an exception ended."""
        if isinstance(err, (TimeoutError, ToolTimeout)):
            if isinstance(err, ToolTimeout):
                self.phase = "tool"
            elif deadline is not None and deadline.expired():
                self.phase = "episode"
            self.trajectory.info["timeout"] = self.phase
            self.end(TerminationReason.TIMEOUT)
        elif isinstance(err, EnvInfraError):
            cause = str(err) if err.__cause__ is not None else f"{type(err).__name__}: {err}"
            self.trajectory.info["sandbox_error"] = cause
            self.end(TerminationReason.SANDBOX_ERROR)
        else:
            self.trajectory.info["engine_error"] = f"{type(err).__name__}: {err}"
            self.end(TerminationReason.ENGINE_ERROR)

    def finish(self, started: float) -> Trajectory | ParkedEpisode:
        state, trajectory = self.state, self.trajectory
        if state is not None:
            state.active_s += time.monotonic() - started
        if self.parked:
            state.env_state = save_env_state(self.env)
            state.parked_version = self.engine.policy_version
            state.num_parks += 1
            return ParkedEpisode(state, self.env)
        assert self.termination is not None, "every episode ends with exactly one reason"
        if self.termination is not TerminationReason.SUBMITTED:
            trajectory.reward = 0.0
        trajectory.termination = self.termination
        if state is not None and state.num_parks:
            trajectory.info["num_parks"] = state.num_parks
        trajectory.timings = {
            "episode_s": state.active_s if state is not None else time.monotonic() - started,
            "generation_s": state.generation_s if state is not None else 0.0,
            "tool_s": state.tool_s if state is not None else 0.0,
            # the environment step that ended the episode ran the hidden checks
            "scoring_s": trajectory.turns[-1].timings.get("env_s", 0.0) if self.termination in SCORED else 0.0,
        }
        return trajectory


"""One episode, token in and token out (SPEC §4, §5).

The loop owns the token ids of the episode. It asks the engine for an action given the exact
ids so far, appends the sampled ids with mask 1 and their behavior log-probs and policy version,
decodes a *copy* of the action to text only to let the environment parse the tool call, and
appends the observation as template scaffolding (encoded once) around the encoding of only the
new observation text, all with mask 0. Each episode ends with exactly one termination reason.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from lightning_agentrl.envs.base import Environment
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import GenerationEngine, SamplingParams
from lightning_agentrl.trajectory import Segment, TerminationReason, Trajectory, Turn


@dataclass(frozen=True)
class EpisodeBudget:
    """Limits of one episode; each one maps to a termination reason."""

    max_turns: int = 4
    max_context_tokens: int = 2048
    generation_timeout_s: float = 120.0
    episode_timeout_s: float = 600.0
    max_tool_errors: int = 3


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
) -> Trajectory:
    """Play one episode to its end and return its trajectory (the environment is closed)."""
    from sandbox_client import CommandTimeout, SandboxInfraError

    trajectory = Trajectory(episode_id=episode_id, task_id=task_id, group_id=group_id)
    segment = Segment()
    trajectory.segments.append(segment)
    sampling = replace(sampling, stop_token_ids=tuple({*sampling.stop_token_ids, codec.eos_token_id}))
    started = time.monotonic()
    generation_s = tool_s = 0.0
    termination = TerminationReason.MAX_TURNS
    try:
        async with asyncio.timeout(budget.episode_timeout_s):
            messages = await env.reset()
            segment.extend(codec.prompt_ids(messages), mask=0)
            consecutive_errors = 0
            for _ in range(budget.max_turns):
                room = budget.max_context_tokens - len(segment.token_ids)
                if room < 1:
                    termination = TerminationReason.MAX_CONTEXT
                    break
                state_key = env.state_key
                t0 = time.monotonic()
                generation = await asyncio.wait_for(
                    engine.generate(
                        list(segment.token_ids),
                        replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room)),
                        episode_id,
                    ),
                    budget.generation_timeout_s,
                )
                generation_s += time.monotonic() - t0
                start = len(segment.token_ids)
                segment.extend(
                    generation.token_ids, mask=1, logprobs=generation.logprobs, version=generation.policy_version
                )
                turn = Turn(action_start=start, action_end=len(segment.token_ids), state_key=state_key)
                segment.turns.append(turn)
                if generation.finish_reason != "stop":
                    if len(segment.token_ids) >= budget.max_context_tokens:
                        termination = TerminationReason.MAX_CONTEXT
                        break
                    segment.extend(codec.close_action_ids(), mask=0)

                t0 = time.monotonic()
                result = await env.step(codec.decode(generation.token_ids))
                tool_s += time.monotonic() - t0
                turn.tool = result.info.get("tool")
                turn.reward = result.reward
                if result.done:
                    trajectory.reward = result.reward
                    termination = TerminationReason.SUBMITTED
                    if result.info.get("scoring_timed_out"):
                        trajectory.info["scoring_timed_out"] = True
                    break
                consecutive_errors = consecutive_errors + 1 if result.info.get("error") else 0
                if consecutive_errors >= budget.max_tool_errors:
                    termination = TerminationReason.TOOL_ERROR
                    break
                observation = codec.observation_ids(result.observation).all
                if len(segment.token_ids) + len(observation) >= budget.max_context_tokens:
                    termination = TerminationReason.MAX_CONTEXT
                    break
                segment.extend(observation, mask=0)
    except (TimeoutError, CommandTimeout):
        termination = TerminationReason.TIMEOUT
    except SandboxInfraError as err:
        termination = TerminationReason.SANDBOX_ERROR
        trajectory.info["sandbox_error"] = str(err)
    finally:
        await env.close()
    if termination is not TerminationReason.SUBMITTED:
        trajectory.reward = 0.0
    trajectory.termination = termination
    trajectory.timings = {
        "episode_s": time.monotonic() - started,
        "generation_s": generation_s,
        "tool_s": tool_s,
    }
    return trajectory

"""The frozen sub-agent (``env.sub_agent``, SPEC §2 multi-agent): a second model an environment calls as a
tool through :class:`lightning_agentrl.envs.base.SubAgent`.

It is served by its own torch engine in the rollout process; nothing pushes weights to it, so it stays
as loaded while the policy trains. Its answers reach the policy only as observations (mask 0).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count
from typing import TYPE_CHECKING

from lightning_agentrl.models import pad_token_id
from lightning_agentrl.rollout.agent_loop import current_episode, request_seed
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine

if TYPE_CHECKING:
    from lightning_agentrl.settings import Settings


class EngineSubAgent:
    """A :class:`~lightning_agentrl.envs.base.SubAgent` on a generation engine: the conversation through the
    sub-agent's chat template, one sampled answer, its text."""

    def __init__(self, engine, codec: ChatCodec, sampling: SamplingParams) -> None:
        self.engine, self.codec = engine, codec
        self.sampling = replace(sampling, stop_token_ids=codec.stop_token_ids)
        self._calls = count()
        self.num_calls = 0

    async def generate(self, messages: list[dict]) -> str:
        """Sampled with the seed of (run seed, episode, index of the call in the episode): the same answer
        whatever other episodes asked before, on any rank, after a resume. Outside an episode's turns (a
        call from ``reset``), the seed of (run seed, the process's count of such calls)."""
        call = next(self._calls)
        episode = current_episode.get(None)
        if episode is not None:
            seed = episode.next_sub_agent_seed(self.sampling.seed)
        else:
            seed = request_seed(self.sampling.seed, "sub-agent", call)
        request = replace(self.sampling, seed=seed)
        generation = await self.engine.generate(self.codec.prompt_ids(messages), request, f"sub-agent-{call}")
        self.num_calls += 1
        return self.codec.decode_action(generation.token_ids)


def sub_agent_model_path(settings: Settings) -> str:
    """``env.sub_agent.model_path``, with ``tiny`` built (once) as the local tiny model of ``model.tiny_*``, and a
    named model or a GGUF file converted (once) into ``model.cache_dir``."""
    from lightning_agentrl.models.gguf_convert import converted_model, is_gguf_source

    path = settings.env.sub_agent.model_path
    if is_gguf_source(path):
        return str(converted_model(path, settings.model.cache_dir))
    if path != "tiny":
        return path
    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model

    m = settings.model
    config = TinyModelConfig(hidden_size=m.tiny_hidden_size, num_hidden_layers=m.tiny_num_layers)
    return str(build_tiny_model(m.cache_dir, config).resolve())


def build_sub_agent(settings: Settings) -> EngineSubAgent | None:
    """The sub-agent ``env.sub_agent`` names (its own tokenizer, template and torch engine), or None."""
    sub = settings.env.sub_agent
    if sub is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = sub_agent_model_path(settings)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, settings.engine_dtype))
    model.requires_grad_(False)
    engine = TorchEngine(model, pad_token_id=pad_token_id(tokenizer),
                         max_batch_size=settings.engine.max_batch_size,
                         admission_window_ms=settings.engine.admission_window_ms)
    sampling = SamplingParams(max_new_tokens=sub.max_new_tokens, temperature=sub.temperature, seed=settings.run.seed)
    # its answer is text for the environment: no tool call is read from it, so its template's call format is not probed
    return EngineSubAgent(engine, ChatCodec(tokenizer, call_format="hermes"), sampling)

"""Summarized history: what to put in a new segment when an episode's context is full (SPEC §4).

When the next observation plus a full action would not fit in ``max_context_tokens``, the agent
loop closes the current :class:`~lightning_agentrl.trajectory.Segment` and opens a new one whose
context is the episode's opening messages plus one user message holding a summary. The episode
keeps its id and its outcome; the trainer sees one trajectory made of several segments.

Who writes the summary decides its loss mask:

- ``policy``: the policy itself, prompted with :data:`SUMMARY_INSTRUCTION` as a user turn after
  its last action. The summary ids are sampled actions (mask 1, with behavior logprobs and policy
  versions) and stay in the segment where they were sampled; the new segment holds their decoded
  text as context only (mask 0). Room for the instruction and the summary is reserved up front, so
  the old segment never exceeds the context limit.
- ``rule``: the environment, from the episode's tool history
  (:meth:`~lightning_agentrl.envs.base.Environment.summarize_history`: the tools used, the latest
  tool output and what the environment adds, e.g. the coding environment's files written). The
  summary is an observation (mask 0).

The pending observation (the output of the action that overflowed the context) is never lost: it
closes the summary message of the new segment.
"""

from __future__ import annotations

from typing import Literal

from lightning_agentrl.envs.base import SUMMARY_HEADER, clip, history_summary
from lightning_agentrl.rollout.chat import ChatCodec

SummarizerKind = Literal["none", "policy", "rule"]

SUMMARY_INSTRUCTION = (
    "Your context is full and will be reset to the task plus your summary. Summarize your progress "
    "in a few lines: what you learned about the task, what you changed and how, and what is left to "
    "do. Do not call a tool."
)
__all__ = ["SUMMARY_HEADER", "SUMMARY_INSTRUCTION", "Summarizer", "make_summarizer", "rule_summary"]


class Summarizer:
    """Writes the summary message that opens a new segment. ``kind`` is ``policy`` or ``rule``.

    >>> from lightning_agentrl.rollout.summarize import rule_summary
    >>> history = [{"action": "...", "observation": "wrote 1 characters to a.py", "tool": "write_file"}]
    >>> print(rule_summary(history))
    Earlier turns of this episode were summarized to fit the context.
    Tools used: write_file x1
    Latest tool output:
    wrote 1 characters to a.py
    """

    def __init__(
        self, kind: SummarizerKind, codec: ChatCodec, *, max_summary_tokens: int = 128,
        max_observation_chars: int = 1000,
    ) -> None:
        if kind not in ("policy", "rule"):
            raise ValueError(f"env.summarizer must be 'policy' or 'rule' to build a Summarizer, got {kind!r}")
        if max_summary_tokens < 1:
            raise ValueError(f"env.summary_max_tokens must be >= 1, got {max_summary_tokens}")
        self.kind = kind
        self.max_summary_tokens = max_summary_tokens
        self.max_observation_chars = max_observation_chars
        # The instruction is a user turn that follows an assistant turn, rendered by the template.
        self._instruction = ChatCodec(codec.tokenizer, observation_role="user", call_format=codec.call_format.name
                                      ).observation_ids(SUMMARY_INSTRUCTION).all

    @property
    def writes_actions(self) -> bool:
        return self.kind == "policy"

    def instruction_ids(self) -> list[int]:
        """User-turn scaffolding + instruction + generation prompt, appended after an action (mask 0)."""
        return list(self._instruction)

    @property
    def reserve_tokens(self) -> int:
        """Context kept free in every segment so that the instruction and the summary still fit
        (+1 for the end-of-turn id that closes an action cut by its token budget)."""
        return len(self._instruction) + self.max_summary_tokens + 1 if self.writes_actions else 0

    def summary_message(
        self, history: list[dict], *, policy_summary: str | None, pending_observation: str | None, env=None,
    ) -> dict:
        """The user message that follows the opening messages in the new segment; the ``rule`` summary
        is ``env``'s ``summarize_history`` where it has one."""
        if self.writes_actions:
            assert policy_summary is not None, "the policy summarizer needs the sampled summary"
            text = f"{SUMMARY_HEADER}\nYour summary:\n{policy_summary.strip()}"
            if pending_observation is not None:
                text += f"\nLatest tool output:\n{clip(pending_observation, self.max_observation_chars)}"
        elif hasattr(env, "summarize_history"):
            text = env.summarize_history(history, max_observation_chars=self.max_observation_chars)
        else:
            text = rule_summary(history, max_observation_chars=self.max_observation_chars)
        return {"role": "user", "content": text}


def rule_summary(history: list[dict], *, max_observation_chars: int = 1000) -> str:
    """Summary of an episode's tool history, without a model, for an environment without its own
    ``summarize_history`` (:func:`~lightning_agentrl.envs.base.history_summary`)."""
    return history_summary(history, max_observation_chars=max_observation_chars)


def make_summarizer(kind: SummarizerKind, codec: ChatCodec, *, max_summary_tokens: int = 128) -> Summarizer | None:
    """``None`` for ``kind="none"``: an overflowing context then ends the episode (``max_context``)."""
    if kind == "none":
        return None
    return Summarizer(kind, codec, max_summary_tokens=max_summary_tokens)

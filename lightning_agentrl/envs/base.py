"""The environment contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StepResult:
    """What one action led to. ``done`` with ``info["submitted"]`` means the agent finished."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    """One episode's world. Tool failures come back as observations (``info["error"]``);
    infrastructure failures raise ``sandbox_client.SandboxInfraError``; a tool command past its
    timeout raises ``sandbox_client.CommandTimeout``."""

    tools: list[dict] | None
    """The tools as JSON schemas for the chat template's ``tools=`` argument; None when the opening
    messages describe them."""

    async def reset(self) -> list[dict]:
        """Start the episode; return the opening chat messages (system, user)."""
        ...

    async def step(self, action_text: str) -> StepResult: ...

    @property
    def state_key(self) -> str:
        """A hash of the observable state the next action starts from (GiGPO anchor states)."""
        ...

    @property
    def state_text(self) -> str:
        """The same observable state as text, for ``algorithm.gigpo_similarity``: two states whose
        texts are similar enough share an anchor group. Equal states must give equal texts; keep it short
        (the similarity costs the product of two lengths), cutting what matters least."""
        ...

    async def close(self) -> None: ...

"""Environments in message space: they take the agent's text and return observation text.

Token ids never appear here (they appear only in :mod:`lightning_agentrl.rollout.chat`).
"""

from lightning_agentrl.envs.base import Environment, StepResult

__all__ = ["Environment", "StepResult"]

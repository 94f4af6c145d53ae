"""Environments in message space: they take the agent's text and return observation text.

Token ids never appear here (they appear only in :mod:`lightning_agentrl.rollout.chat`). Nothing
under ``lightning_agentrl.envs`` imports ``lightning_agentrl.rollout``: the agent loop depends on
environments, never the reverse. :mod:`~lightning_agentrl.envs.registry` resolves ``env.kind``.
"""

from lightning_agentrl.envs.base import EnvInfraError, Environment, StepResult, SubAgent, ToolTimeout

__all__ = ["EnvInfraError", "Environment", "StepResult", "SubAgent", "ToolTimeout"]

"""Pure tensor functions for credit assignment, losses, log-probs, staleness and diagnostics.

No Lightning and no I/O here: the trainer, callbacks and CLI call these functions. Shape legend
used throughout: B trajectories, G group size, K turns (flattened), N packed tokens, V vocabulary,
H hidden size.
"""

from lightning_agentrl.algorithms import advantages, diagnostics, logprobs, losses, staleness

__all__ = ["advantages", "diagnostics", "logprobs", "losses", "staleness"]

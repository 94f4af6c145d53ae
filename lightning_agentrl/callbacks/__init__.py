"""Callbacks: one concern each, each resumable through ``state_dict``."""

from lightning_agentrl.callbacks.compact_filter import CompactFilter
from lightning_agentrl.callbacks.rollout_metrics import RolloutMetrics
from lightning_agentrl.callbacks.weight_sync import WeightSync

__all__ = ["CompactFilter", "RolloutMetrics", "WeightSync"]

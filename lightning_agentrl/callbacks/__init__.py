"""Callbacks: one concern each, each resumable through ``state_dict``."""

from lightning_agentrl.callbacks.compact_filter import CompactFilter
from lightning_agentrl.callbacks.export_policy import ExportPolicy
from lightning_agentrl.callbacks.group_filter import GroupFilter
from lightning_agentrl.callbacks.rollout_metrics import RolloutMetrics
from lightning_agentrl.callbacks.segments import SegmentBoundaries
from lightning_agentrl.callbacks.staleness import StalenessWeighting
from lightning_agentrl.callbacks.token_check import TokenCheck
from lightning_agentrl.callbacks.trajectory_archive import TrajectoryArchive
from lightning_agentrl.callbacks.weight_sync import WeightSync

__all__ = [
    "CompactFilter",
    "ExportPolicy",
    "GroupFilter",
    "RolloutMetrics",
    "SegmentBoundaries",
    "StalenessWeighting",
    "TokenCheck",
    "TrajectoryArchive",
    "WeightSync",
]

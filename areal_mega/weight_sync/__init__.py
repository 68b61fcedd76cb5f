"""Weight sync: learner (megatron TP/PP) -> SGLang servers. See planner.py / transport.py / sync.py."""

from areal_mega.weight_sync.config import WeightSyncConfig
from areal_mega.weight_sync.planner import PlanMismatchError, SyncPlan, TensorSpec, check_plan_against, plan_weight_sync
from areal_mega.weight_sync.sync import (BroadcastSync, DiskSync, LearnerSide, ReshardSource, ReshardSync, SyncStats,
                                         WeightSync, megatron_weight_sync)
from areal_mega.weight_sync.transport import WeightSyncError

__all__ = [
    "BroadcastSync",
    "DiskSync",
    "LearnerSide",
    "PlanMismatchError",
    "ReshardSource",
    "ReshardSync",
    "SyncPlan",
    "SyncStats",
    "TensorSpec",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "check_plan_against",
    "megatron_weight_sync",
    "plan_weight_sync",
]

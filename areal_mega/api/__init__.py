"""Small contracts between the components. Implementations live elsewhere."""

from areal_mega.api.engine import InferenceEngine, TrainEngine
from areal_mega.api.generation import GenerationService, PolicyVersion
from areal_mega.api.io import GenerationRequest, GenerationResult, SamplingParams
from areal_mega.api.workflow import RolloutBatch, RolloutWorkflow, Trajectory

__all__ = [
    "GenerationRequest",
    "GenerationService",
    "GenerationResult",
    "InferenceEngine",
    "PolicyVersion",
    "RolloutBatch",
    "RolloutWorkflow",
    "SamplingParams",
    "TrainEngine",
    "Trajectory",
]

"""The rollout contract: one episode of interaction turned into a trainable trajectory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_mega.api.engine import InferenceEngine


@dataclass
class Trajectory:
    """A token sequence with everything the learner needs, aligned token for token.

    ``loss_mask[i] == 1`` marks tokens the policy produced (trained on); prompt and tool/env
    tokens have 0. ``logprobs[i]`` and ``versions[i]`` are the behaviour log-prob and the policy
    version of token i (0.0 / -1 for non-generated tokens).
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str = ""
    """Trajectories sharing a group id were sampled from the same prompt (GRPO/RLOO groups)."""
    info: dict[str, Any] = field(default_factory=dict)
    routes: np.ndarray | None = None
    """MoE routing replay: int16 [len(input_ids), layers * top_k], row i = the experts the server
    routed token i to; -1 rows for tokens never fed to a server (e.g. the last sampled one)."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"trajectory fields disagree in length: input_ids={n} loss_mask={len(self.loss_mask)} "
                f"logprobs={len(self.logprobs)} versions={len(self.versions)}"
            )
        if self.routes is not None and (self.routes.ndim != 2 or self.routes.shape[0] != n):
            raise ValueError(f"trajectory routes: shape {self.routes.shape}, expected [{n}, layers * top_k]")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def min_version(self) -> int:
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else -1


class RolloutWorkflow(ABC):
    """``arun_episode(engine, data)`` runs one episode (one prompt, possibly many turns) and
    returns its trajectories (a GRPO group is a list), or None to reject the sample."""

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        ...

"""Engine contracts: the learner side (``TrainEngine``) and the generation side
(``InferenceEngine``). Rollout methods stay off the train engine and vice versa. They meet only
in weight sync (``areal_mega.weight_sync``), which is not a contract of either: it reads the
learner's model chunks through the family adapter, talks to the servers through
``inference.sglang_api``, and takes its targets from the generation service
(``api/generation.py``), which then moves the generation side's one version counter."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from areal_mega.api.io import GenerationRequest, GenerationResult

__all__ = ["InferenceEngine", "TrainEngine"]


class TrainEngine(ABC):
    """A (possibly model-parallel) trainable policy or critic.

    Batches are dicts of flat token tensors holding several packed sequences:
    ``input_ids`` [T], ``cu_seqlens`` [B+1] and any per-token fields the loss needs.
    Every rank of the learner calls each method collectively.
    """

    @abstractmethod
    def forward(self, batch: dict[str, Any], temperature: float = 1.0, with_entropy: bool = True) -> dict[str, Any]:
        """No gradient: per-token ``logprobs`` and ``entropy`` [T] (next-token aligned, last of each
        sequence 0) on every rank; MoE models also return the ``routes`` their routers chose."""

    @abstractmethod
    def forward_logprobs(self, batch: dict[str, Any], temperature: float = 1.0) -> Any:
        """Per-token log-prob of each next token (aligned to input_ids, last of each seq = 0)."""

    @abstractmethod
    def proximal_logprobs(self, batch: dict[str, Any], temperature: float = 1.0) -> dict[str, float]:
        """The policy before this update into ``batch["prox_logprobs"]`` (decoupled PPO), owning MoE
        routing replay (which routes the training forward replays); returns mismatch metrics."""

    @abstractmethod
    def train_batch(self, batch: dict[str, Any], loss_fn: Callable[..., Any], temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step over ``batch`` split into token-budget micro-batches; ``loss_fn``
        sees log-probs at ``temperature`` (the sampling temperature: > 0). Stats combined by
        ``areal_mega.utils.stats``."""

    @abstractmethod
    def save(self, path: str) -> None:
        """Save a distributed checkpoint (loadable in another parallel layout)."""

    @abstractmethod
    def load(self, path: str) -> None:
        ...

    @abstractmethod
    def get_version(self) -> int:
        ...

    @abstractmethod
    def set_version(self, version: int) -> None:
        ...

    def snapshot_weights(self, dtype: Any = None) -> list[Any]:
        """A CPU copy of this rank's weights, cast to ``dtype`` if given (only ``trainer.study_delay``
        asks for it)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no weight snapshots (trainer.study_delay)")

    def restore_weights(self, weights: list[Any]) -> None:
        """Copy a ``snapshot_weights`` result back into this rank's weights, in place."""
        raise NotImplementedError(f"{type(self).__name__} keeps no weight snapshots (trainer.study_delay)")


class InferenceEngine(ABC):
    """A pool of generation servers seen as one engine."""

    @abstractmethod
    async def agenerate(self, req: GenerationRequest) -> GenerationResult:
        ...

    @abstractmethod
    async def pause(self) -> None:
        """Stop scheduling new tokens (in-flight requests are aborted or held, per config)."""

    @abstractmethod
    async def resume(self) -> None:
        ...

    @abstractmethod
    def get_version(self) -> int:
        ...

    @abstractmethod
    def set_version(self, version: int) -> None:
        ...

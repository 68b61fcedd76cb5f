"""The weight-sync contract the trainer holds (:class:`WeightSync`) and what one sync reports
(:class:`SyncStats`); the transports (weight_sync/sync.py) and the adapter-only LoRA sync
(weight_sync/lora_sync.py) implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from areal_mega.inference.server import ServedLora


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float
    num_buckets: int
    phase_s: dict[str, float] = field(default_factory=dict)
    mode: str = "broadcast"
    """The mode that ran (reshard falls back to broadcast for servers without the receiver)."""
    bytes_per_engine_rank: dict[str, int] = field(default_factory=dict)
    """"<server url>/<tp rank>" -> bytes that rank received."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSync(ABC):
    """What the trainer holds: pushes the learner's weights into a set of SGLang servers. Every
    method is collective over all learner ranks (the same arguments on every rank). The servers
    are paused (or not) by the caller."""

    lora: ServedLora | None = None
    """What the servers must serve besides the model (adapter-only LoRA sync: launch them with it,
    name it in every request, sync once before the first rollout); None: nothing."""

    @property
    @abstractmethod
    def server_urls(self) -> list[str]:
        """The current targets."""

    @abstractmethod
    def set_targets(self, urls: Sequence[str]) -> None:
        """Push to the servers at ``urls`` from now on."""

    @abstractmethod
    def sync(self, version: int) -> SyncStats:
        """Push the current weights as policy ``version``."""

    @abstractmethod
    def close(self) -> None:
        """Destroy this rank's learner<->server groups; the next ``sync`` connects afresh."""

"""The generation side as the learner sees it: one service (``areal_mega.rollout.service``) that
hands out rollout batches and takes part in each weight sync, and the one policy-version
counter of the generation side.

One weight sync, from the service's point of view (rank 0; the trainer broadcasts the targets)::

    targets = service.begin_update()        pause generation, fresh health pass, live + parked servers
    ... weight sync pushes to `targets` ...
    service.end_update(version, synced)     version bump (one counter), parked synced servers rejoin, resume
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Sequence

from areal_mega.api.workflow import RolloutBatch


class PolicyVersion:
    """The generation side's one policy-version counter: the version of the weights the servers
    hold, which new tokens are labelled with and admission counts from. Monotone, thread-safe.
    The rollout service writes it after each weight sync; the staleness manager and the
    inference pool read it (they share this object and keep no copy)."""

    def __init__(self, version: int = 0) -> None:
        self._lock = threading.Lock()
        self._value = version

    def get(self) -> int:
        with self._lock:
            return self._value

    def set(self, version: int) -> None:
        with self._lock:
            if version < self._value:
                raise ValueError(f"version: must not decrease ({self._value} -> {version})")
            self._value = version


class GenerationService(ABC):
    """Rollout batches out, weight updates in. Owns which servers are live and the version."""

    @abstractmethod
    def next_batch(self) -> RolloutBatch | None:
        """The next batch, or None when none can come before a weight sync (every server that
        answers waits, parked, for the current weights): the caller syncs and asks again."""

    @abstractmethod
    def begin_update(self) -> list[str]:
        """Pause generation and return the URLs the weight sync must reach (live servers and
        parked ones; [] when none came up within the service's wait)."""

    @abstractmethod
    def end_update(self, version: int | None, synced: Sequence[str] = ()) -> None:
        """After the sync: ``version`` now on ``synced`` (None: the sync failed, nothing moves);
        parked servers among ``synced`` rejoin; generation resumes."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The version the servers hold (what new tokens are labelled with)."""

    @abstractmethod
    def close(self) -> None:
        ...

"""Bounded-staleness admission control (AReaL's rule), as a small thread-safe class.

With B = batch_size, eta = max_staleness, v = the current version, a new episode is admitted only while

    capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running)) > 0

:func:`can_form_batch` / :func:`take_oldest` (pure; the simulator calls them too) are the
"oldest admission first" half of the bound. The counting argument: docs/rollout.md.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

from areal_mega.api.generation import PolicyVersion

__all__ = ["StalenessManager", "can_form_batch", "take_oldest", "check_staleness_args"]

T = TypeVar("T")


def check_staleness_args(batch_size: int, max_staleness: int, max_concurrent: int) -> None:
    """The admission rule's preconditions (``rollout.*`` keys): the one check, shared by
    ``RolloutConfig.validate`` and the manager itself."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent: must be >= 1, got {max_concurrent}")


class StalenessManager:
    """Counts admitted / running / accepted episodes and says how many more may start.

    Thread-safe: the rollout loop admits and finishes episodes while the trainer thread
    bumps the version. ``version`` is the :class:`PolicyVersion` it reads (shared with the
    pool by the rollout service), or the start version of a counter of its own.
    """

    def __init__(self, batch_size: int, max_staleness: int, max_concurrent: int,
                 version: int | PolicyVersion = 0) -> None:
        check_staleness_args(batch_size, max_staleness, max_concurrent)
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self.policy_version = version if isinstance(version, PolicyVersion) else PolicyVersion(version)
        self._base_version = self.policy_version.get()
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    # The formula lives here and only here.
    def _capacity_locked(self, version: int) -> int:
        steps = version - self._base_version
        by_staleness = (self.max_staleness + steps + 1) * self.batch_size - (self._accepted + self._running)
        return min(self.max_concurrent - self._running, by_staleness)

    def capacity(self) -> int:
        with self._lock:
            return self._capacity_locked(self.policy_version.get())

    def try_admit(self) -> int | None:
        """Admit one episode if capacity allows: returns the version it is admitted at, else None."""
        with self._lock:
            version = self.policy_version.get()  # read once: the version may move meanwhile
            if self._capacity_locked(version) <= 0:
                return None
            self._running += 1
            return version

    def admit_resumed(self) -> bool:
        """Admit a resumed episode (saved by a checkpoint, admitted before it) if
        ``max_concurrent`` allows: it counts as running. The staleness term needs no check: the
        episodes a checkpoint holds fit in it (they did when they were admitted)."""
        with self._lock:
            if self._running >= self.max_concurrent:
                return False
            self._running += 1
            return True

    def on_accepted(self) -> None:
        with self._lock:
            assert self._running > 0, "on_accepted without a running episode"
            self._running -= 1
            self._accepted += 1

    def on_rejected(self) -> None:
        with self._lock:
            assert self._running > 0, "on_rejected without a running episode"
            self._running -= 1
            self._rejected += 1

    def set_version(self, version: int) -> None:
        self.policy_version.set(version)

    @property
    def version(self) -> int:
        return self.policy_version.get()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            version = self.policy_version.get()
            return {
                "version": version,
                "running": self._running,
                "accepted": self._accepted,
                "rejected": self._rejected,
                "capacity": self._capacity_locked(version),
            }


# ---- batch formation (the controller's rule, shared with areal_mega.simulator) ----------------


def can_form_batch(n: int, version: int, max_staleness: int, batch_size: int,
                   ready_admit_versions: Sequence[int], running_admit_versions: Sequence[int]) -> bool:
    """True when taking the ``n`` oldest-admitted ready episodes keeps the bound reachable.

    ``ready_admit_versions``: admission versions of the finished, accepted episodes, in admission
    order (oldest first); ``running_admit_versions``: those of the episodes still in flight.

    With eta = max_staleness, B = batch_size, c = version: the episodes still pending
    afterwards (ready but not taken, or running: a running one may yet be accepted) that
    were admitted at version <= w must fit in the batches c+1 .. w+eta, i.e.
    pending(<= w) <= (w + eta - c) * B for every past admission version w in
    [c - eta, c - 1] (for w = c - eta that is 0: those episodes are due now). Later versions
    need no check: the admission rule caps them. Taking oldest first minimises every
    pending(<= w) at once, and by induction over batches the condition becomes true as
    soon as the running episodes it counts have finished, so this never deadlocks.
    """
    if len(ready_admit_versions) < n:
        return False
    eta = max_staleness
    pending = list(ready_admit_versions[n:]) + list(running_admit_versions)
    if not pending:
        return True
    for w in range(version - eta, max(version - eta, version - 1) + 1):
        limit = max(0, (w + eta - version) * batch_size)
        if sum(1 for v in pending if v <= w) > limit:
            return False
    return True


def take_oldest(ready: list[T], n: int, seq: Callable[[T], int]) -> tuple[list[T], list[T]]:
    """(the ``n`` oldest-admitted of ``ready`` by ``seq``, the rest), each in admission order."""
    ordered = sorted(ready, key=seq)
    return ordered[:n], ordered[n:]

"""Settings of the rollout side (staleness bound, controller): ``rollout.*`` in the experiment YAML."""

from __future__ import annotations

from dataclasses import dataclass

from areal_mega.rollout.staleness import check_staleness_args

__all__ = ["RolloutConfig"]


@dataclass
class RolloutConfig:
    batch_size: int = 8
    """Episodes (prompts; each yields a group of trajectories) per training batch. The
    staleness bound is counted in these units."""
    max_staleness: int = 1
    """eta: every generated token of a batch trained at version v was sampled by a policy of
    version >= v - eta. 0 = synchronous RL (generation never overlaps training)."""
    max_concurrent: int = 64
    """Most episodes in flight at once (on top of the staleness limit)."""
    filter_zero_variance: bool = False
    """Dynamic filtering (DAPO): reject groups whose rewards are all equal (they carry no GRPO
    signal); the freed capacity is refilled by new episodes so the batch still fills."""
    max_consecutive_rejects: int = 1000
    """Raise after this many rejected episodes in a row (e.g. every reward is 0 forever)."""
    show_progress: bool = True
    """Print a one-line progress display, only when stderr is an interactive terminal."""
    batch_timeout_s: float = 0.0
    """get_batch raises TimeoutError after this many seconds without a full batch; 0 = wait
    forever."""

    def validate(self) -> None:
        check_staleness_args(self.batch_size, self.max_staleness, self.max_concurrent)
        if self.max_consecutive_rejects < 1:
            raise ValueError(f"max_consecutive_rejects: must be >= 1, got {self.max_consecutive_rejects}")
        if self.batch_timeout_s < 0:
            raise ValueError(f"batch_timeout_s: must be >= 0, got {self.batch_timeout_s}")

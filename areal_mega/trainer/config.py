"""The trainer's own section (``trainer:``): run length, checkpoints, evaluation, logging.
The whole experiment (every section) is :class:`areal_mega.experiment.ExperimentConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["TrainerLoopConfig"]


@dataclass
class TrainerLoopConfig:
    """Length of the run, checkpoints, evaluation, logging."""

    num_steps: int = 100
    """Optimizer steps (= policy versions) to train; the run ends at version num_steps."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    resume: bool = True
    """Resume from the newest complete ``<output_dir>/checkpoints/stepNNNNNN`` when there is one
    (model, optimizer, LR schedule, version, prompt-stream position, RNG states); the servers
    are re-synced to the resumed weights first."""
    eval_every: int = 0
    """Evaluate on ``eval_data`` every this many steps (0 = only at start/end)."""
    eval_at_start: bool = True
    """Evaluate the initial policy (version 0 or the resumed one) before training."""
    eval_at_end: bool = True
    """Evaluate the final policy after the last weight sync."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend of the learners: "nccl", "gloo", or "auto" (nccl with CUDA)."""
    export_hf_at_end: bool = True
    """Also write the final weights as an HF checkpoint (``<output_dir>/hf``) via the adapter."""
    stop_file: str = ""
    """Graceful stop: when this file exists (checked after every step), the trainer saves a
    checkpoint and exits 0 -- for preemption notices and operators (the launcher creates
    ``<run_dir>/STOP`` on SIGUSR1/SIGTERM). SIGTERM/SIGUSR1 to a learner rank do the same.
    Empty = only the signals."""
    rollout_snapshot_every: int = 0
    """Between learner checkpoints, snapshot the generation side every this many steps to
    ``<output_dir>/checkpoints/rollout_snapshot.json`` (MBs, not the weights' GBs): a run resumed
    from the last learner checkpoint also continues the episodes handed out or generated since
    it, cut at their first token newer than that checkpoint (docs/resume.md). 0 = only at
    learner checkpoints. Needs ``rollout.save_in_flight``."""
    study_delay: int = 0
    """Experiments only (the staleness study, docs/staleness.md): the servers are given the
    weights of ``study_delay`` versions ago, so with ``rollout.max_staleness`` equal to it every
    trained token is exactly that many versions old (after the first ``study_delay`` steps, which
    train on version 0's samples) on any machine, whatever its generation/training speed ratio.
    Costs one CPU copy of the weights per delayed version. Refused unless ``study_opt_in``."""
    study_opt_in: bool = False
    """Set true to allow ``study_delay`` (it deliberately serves old weights)."""

    def validate(self) -> None:
        if self.study_delay < 0:
            raise ValueError(f"study_delay: must be >= 0, got {self.study_delay}")
        if self.study_delay and not self.study_opt_in:
            raise ValueError("study_delay: serves deliberately old weights, for the staleness study only; "
                             "set trainer.study_opt_in: true to ask for it")
        if self.num_steps < 0:
            raise ValueError(f"num_steps: must be >= 0, got {self.num_steps}")
        if self.save_every < 0 or self.eval_every < 0 or self.rollout_snapshot_every < 0:
            raise ValueError("save_every / eval_every / rollout_snapshot_every: must be >= 0")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"backend: {self.backend!r} is not one of auto, nccl, gloo")

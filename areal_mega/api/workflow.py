"""The rollout contract: one episode of interaction turned into a trainable trajectory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from areal_mega.api.engine import InferenceEngine

__all__ = ["RolloutBatch", "RolloutWorkflow", "Trajectory"]


@dataclass
class Trajectory:
    """A token sequence with everything the learner needs, aligned token for token.

    ``loss_mask[i] == 1`` marks tokens the policy produced (trained on); prompt and tool/env
    tokens have 0. ``logprobs[i]`` and ``versions[i]`` are the behaviour log-prob and the policy
    version of token i (0.0 / -1 for non-generated tokens).

    Steps (process supervision, optional): ``step_ends[j]`` is the exclusive end of step j
    counted in GENERATED tokens (the k-th token with loss_mask 1 has generated index k), so
    step j covers generated tokens [step_ends[j-1], step_ends[j]) (step_ends[-1] = 0); the
    last end equals ``num_generated``. Counting generated tokens, not positions, makes the
    boundaries independent of prompt/feedback tokens and of the learner's alignment shift.
    ``step_rewards[j]`` is step j's reward (empty: boundaries only, no process reward);
    ``reward`` stays the outcome reward. A step-less trajectory has both empty.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str = ""
    """Trajectories sharing a group id were sampled from the same prompt (GRPO/RLOO groups)."""
    info: dict[str, Any] = field(default_factory=dict)
    step_ends: list[int] = field(default_factory=list)
    """Exclusive end of each step in generated-token counts (see the class docstring)."""
    step_rewards: list[float] = field(default_factory=list)
    """One reward per step, or empty (no process reward)."""
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
        if self.step_ends or self.step_rewards:
            ends = self.step_ends
            if not ends or any(b <= a for a, b in zip([0, *ends], ends)) or ends[-1] != self.num_generated:
                raise ValueError(f"step_ends: must increase strictly from > 0 to num_generated="
                                 f"{self.num_generated}, got {ends}")
            if self.step_rewards and len(self.step_rewards) != len(ends):
                raise ValueError(f"step_rewards: {len(self.step_rewards)} rewards for {len(ends)} steps")
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
    returns its trajectories (a GRPO group is a list), or None to reject the sample.

    The replay contract (resuming an episode a checkpoint saved, docs/resume.md): run again on
    the same ``data`` and given the same answers to the same ``engine.agenerate`` calls, the
    episode makes the same calls -- its tools, environment and agent code are deterministic
    functions of the answers (random choices seeded from ``data``). Then the saved calls are
    answered from the checkpoint (a multi-turn or agent episode resumes at the turn it had
    reached, its earlier turns' tokens identical) and the one in flight continues after its
    saved tokens. A workflow that cannot keep it sets ``replayable = False``: its saved
    episodes restart from the prompt (counted, ``rollout/resume/restarted``). A call the log
    does not have ends the replay there (``rollout/resume/diverged``): the episode goes on live.
    """

    replayable: ClassVar[bool] = True

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory] | None:
        ...


@dataclass
class RolloutBatch:
    groups: list[list[Trajectory]]
    """One list per episode (a GRPO group), oldest admission first."""
    version: int
    """The policy version this batch is trained at."""
    stats: dict[str, float]
    """Scalars for TensorBoard: rewards, rejections, staleness (mean / max / fraction stale), and
    ``reward/reason/<reason>``: how many trajectories of the batch failed for that reason (from
    the rewards' ``evaluate`` info, e.g. timeout or wrong_answer for code)."""
    staleness_counts: dict[int, int] = field(default_factory=dict)
    """Histogram over generated tokens: staleness (version - token version) -> token count."""
    positions: list[tuple[int, int] | None] = field(default_factory=list)
    """Per episode, its prompt's ``(epoch, index)`` in the :class:`PromptStream` (None when the
    dataset is a plain iterable)."""
    prompt_ids: list[Any] = field(default_factory=list)
    """Per episode, its sample's ``id`` (None where the sample has none)."""
    episode_ids: list[str | None] = field(default_factory=list)
    """Per episode, the id it was given at its first admission (kept across a resume: the
    per-episode log that shows none trained twice); None without ``rollout.save_in_flight``."""
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Prompts given up since the last batch (failed ``1 + max_episode_retries`` times), each
    ``{"pos": [epoch, index] | None, "id": ..., "reason": ..., "error": ...}``."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

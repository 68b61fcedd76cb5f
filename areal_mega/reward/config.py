"""``reward:`` of the experiment YAML: which reward (``kind``) with its own settings (``options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from areal_mega.kinds import fill_default_options

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    kind: str = "math"
    """A built-in or "package.module:Name" (called as ``Name(cfg, ctx)``, ``api/reward.py``).
    Built-ins (reward/builtins.py; their options in brackets): "math": the final answer vs the
    sample's "answer" via math-verify [num_workers, timeout_s]; "code": the last python block run
    against the sample's "tests" in the sandbox [the sandbox's settings]; "function": a plain
    ``fn(prompt, completion, data)`` [function, isolate, num_workers, timeout_s]; "format": 1 when
    a regex occurs [regex]; "overlong": DAPO's soft overlong penalty [max_tokens, buffer_tokens];
    "composite": the weighted sum of rewards [components]; "judge": an LLM judge [JudgeConfig];
    "multi_judge": several judges aggregated [MultiJudgeConfig]; "consistency": every written
    equation true and the answer equal to the last result; "reward_model": a sequence-
    classification RM served by SGLang [RewardModelConfig]."""
    options: Any = None
    """The kind's own settings (its ``Options`` dataclass); its defaults when omitted."""
    weight: float = 1.0
    """As a component of a composite: the weight of this reward in the sum."""
    name: str = ""
    """As a component of a composite: its name in the reward's info / metrics (default: kind,
    made unique by position)."""
    step_scoring: Literal["none", "step", "prefix"] = "none"
    """Also score each step (process rewards; needs ``workflow.steps``): "step": this reward
    applied to each step's text alone; "prefix": to the completion up to each step's end (a
    process reward model, or a judge asked per step). "none": outcome only. In a composite,
    set it on the components (their weighted step scores are summed)."""

    OPEN_KINDS: ClassVar[dict[str, str]] = {"kind": "reward"}

    def __post_init__(self) -> None:
        fill_default_options(self)

    def validate(self) -> None:
        if self.step_scoring not in ("none", "step", "prefix"):
            raise ValueError(f"step_scoring: must be none, step or prefix, got {self.step_scoring!r}")
        if self.kind == "composite" and self.step_scoring != "none":
            raise ValueError("step_scoring: set it on the composite's components, not on the composite")
        for check in ("validate", "check_ready"):  # check_ready: what a reward about to be built needs
            fn = getattr(self.options, check, None)
            if fn is not None:
                try:
                    fn()
                except ValueError as e:
                    raise ValueError(f"options.{e}") from None

    def scores_steps(self) -> bool:
        """Whether the built reward gives step scores (``evaluate_steps``)."""
        return self.step_scoring != "none" or any(c.scores_steps() for c in getattr(self.options, "components", ()))

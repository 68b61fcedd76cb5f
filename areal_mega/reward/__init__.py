"""Rewards: ``await reward(prompt_text, completion_text, sample_dict) -> float``.

    reward = build_reward(RewardConfig(kind="math"))          # math-verify in worker processes
    reward = build_reward(RewardConfig(kind="function", function="my_pkg.rewards:exact_match"))
    reward = build_reward(RewardConfig(kind="judge", judge=JudgeConfig(...)), policy_engine=pool)  # reward/judge.py
    reward = build_reward(RewardConfig(kind="composite", components=[
        RewardConfig(kind="math"), RewardConfig(kind="format", weight=0.1),
        RewardConfig(kind="overlong", overlong_max_tokens=1024, overlong_buffer_tokens=256)]))
    reward = build_reward(RewardConfig(kind="consistency", step_scoring="step"))   # reward/consistency.py
    reward = build_reward(RewardConfig(kind="multi_judge", multi_judge=MultiJudgeConfig(judges=[...])))

``kind`` is a built-in name (``reward/builtins.py``) or a user's "package.module:Name", both
resolved by ``areal_mega.kinds`` and called as ``Name(cfg, ctx)``. Kind "function" runs a plain
``fn(prompt, completion, data) -> float`` (plain or async) from ``function``; with ``isolate``
(default) in the worker pool, with the math reward's timeout / crash protection.
Rewards with details also have ``evaluate(...) -> RewardResult`` (``reward.base``); shaping
terms and the composite are in ``reward.shaping``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from areal_mega.reward.judge import JudgeConfig
from areal_mega.reward.multi_judge import MultiJudgeConfig
from areal_mega.reward.reward_model import RewardModelConfig
from areal_mega.kinds import resolve
from areal_mega.reward.base import COMPLETION_TOKENS, RewardContext, RewardFn, RewardResult, evaluate, evaluate_steps
from areal_mega.reward.pool import RewardWorkerPool
from areal_mega.sandbox import SandboxConfig


@dataclass
class RewardConfig:
    kind: str = "math"
    """A built-in below or "package.module:Name" (called as ``Name(cfg, ctx)``, the contract in
    ``api/reward.py``; its own settings in ``options``). "math": final answer vs the sample's "answer" via math-verify; "code": run the last
    python block against the sample's "tests" in the sandbox; "function": the user function in
    ``function``; "format": 1 when ``format_regex`` occurs in the completion, else 0;
    "overlong": DAPO's soft overlong penalty (0 .. -1, from the completion's token count);
    "composite": the weighted sum of ``components``; "judge": an LLM judge's verdict (``judge``);
    "multi_judge": several judges' verdicts aggregated (``multi_judge``); "consistency": 1 when
    every equation written in the completion is true and the final answer equals the last
    equation's result (reward/consistency.py); "reward_model": a sequence-classification reward
    model served by SGLang (``reward_model``; with ``step_scoring: prefix`` a process RM)."""
    function: str = ""
    """"module:function" for kind "function"."""
    isolate: bool = True
    """kind "function": run it in worker processes (timeout, crash isolation)."""
    num_workers: int = 2
    """Worker processes for math / isolated user rewards (kind "code": ``sandbox.num_workers``)."""
    timeout_s: float = 10.0
    """Per-call timeout; a call that times out, crashes or raises scores 0 (kind "code":
    ``sandbox.timeout_s`` per test execution)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """kind "code": the sandbox the code runs in (its own worker pool, limits, mode)."""
    format_regex: str = r"\\boxed\{.+?\}"
    """kind "format": a Python regex (searched, DOTALL) the completion must contain."""
    overlong_max_tokens: int = 0
    """kind "overlong": L_max, beyond which the penalty is -1 (set it to the generation limit)."""
    overlong_buffer_tokens: int = 0
    """kind "overlong": L_cache, the soft zone below L_max where the penalty falls linearly from 0
    to -1."""
    components: list[RewardConfig] = field(default_factory=list)
    """kind "composite": the rewards summed, each with its ``weight`` (and optional ``name``)."""
    weight: float = 1.0
    """As a component of a composite: the weight of this reward in the sum."""
    name: str = ""
    """As a component of a composite: its name in the reward's info / metrics (default: kind,
    made unique by position)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """kind "judge": the judge model's servers, rubric and verdict format."""
    multi_judge: MultiJudgeConfig = field(default_factory=MultiJudgeConfig)
    """kind "multi_judge": the judges, the aggregation, when a failing judge is skipped."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """kind "reward_model": the RM's servers, input template and score transform."""
    options: Any = None
    """The typed options of a user reward kind (its ``Options`` dataclass), None for built-ins."""
    step_scoring: Literal["none", "step", "prefix"] = "none"
    """Also score each step (process rewards; needs ``workflow.steps``): "step": this reward
    applied to each step's text alone; "prefix": to the completion up to each step's end (a
    process reward model, or a judge asked per step). "none": outcome only. In a composite,
    set it on the components (their weighted step scores are summed)."""

    OPEN_KINDS: ClassVar[dict[str, tuple[str, str]]] = {"kind": ("reward", "options")}

    def validate(self) -> None:
        if self.kind == "function" and ":" not in self.function:
            raise ValueError(f"function: kind 'function' needs 'module:function', got {self.function!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.kind == "judge":
            try:
                self.judge.check_ready()
            except ValueError as e:
                raise ValueError(f"judge.{e}") from None
        if self.kind == "overlong" and not 0 < self.overlong_buffer_tokens <= self.overlong_max_tokens:
            raise ValueError(f"overlong_buffer_tokens: kind 'overlong' needs 0 < overlong_buffer_tokens <= "
                             f"overlong_max_tokens, got {self.overlong_buffer_tokens} and {self.overlong_max_tokens}")
        if self.kind == "format":
            try:
                re.compile(self.format_regex)
            except re.error as e:
                raise ValueError(f"format_regex: {self.format_regex!r} is not a valid regex ({e})") from None
        if self.step_scoring not in ("none", "step", "prefix"):
            raise ValueError(f"step_scoring: must be none, step or prefix, got {self.step_scoring!r}")
        if self.kind == "composite" and self.step_scoring != "none":
            raise ValueError("step_scoring: set it on the composite's components, not on the composite")
        if self.kind == "multi_judge":
            try:
                self.multi_judge.check_ready()
            except ValueError as e:
                raise ValueError(f"multi_judge.{e}") from None
        if self.kind == "reward_model":
            try:
                self.reward_model.check_ready()
            except ValueError as e:
                raise ValueError(f"reward_model.{e}") from None
        if self.kind == "composite" and not self.components:
            raise ValueError("components: kind 'composite' needs at least one component")
        if self.kind != "composite" and self.components:
            raise ValueError(f"components: only kind 'composite' has components (kind is {self.kind!r})")
        for i, c in enumerate(self.components):
            if c.kind == "composite":
                raise ValueError(f"components[{i}].kind: a composite cannot contain a composite (flatten it)")
            try:
                c.validate()
            except ValueError as e:
                raise ValueError(f"components[{i}].{e}") from None

    def scores_steps(self) -> bool:
        """Whether the built reward gives step scores (``evaluate_steps``)."""
        return self.step_scoring != "none" or any(c.scores_steps() for c in self.components)

    def component_names(self) -> list[str]:
        """Each component's ``name``, else its kind (suffixed by position when repeated)."""
        names = [c.name or c.kind for c in self.components]
        return [n if names.count(n) == 1 or c.name else f"{n}{i}" for i, (n, c) in enumerate(zip(names, self.components))]


def build_reward(cfg: RewardConfig, *, policy_engine: Any = None, policy_tokenizer: Any = None) -> RewardFn:
    """The reward ``cfg.kind`` names (a built-in, ``reward/builtins.py``, or a user's
    ``package.module:Name``, both called as ``Kind(cfg, ctx)``). ``policy_engine`` /
    ``policy_tokenizer`` (the trainer's pool and tokenizer) serve a judge that runs on the policy's
    servers (``judge.servers: policy``). With ``step_scoring`` the reward also scores steps."""
    cfg.validate()
    reward = resolve("reward", cfg.kind)(cfg, RewardContext(policy_engine, policy_tokenizer))
    if cfg.step_scoring == "none":
        return reward
    from areal_mega.reward.steps import StepScored

    return StepScored(reward, cfg.step_scoring)


__all__ = ["COMPLETION_TOKENS", "JudgeConfig", "MultiJudgeConfig", "RewardConfig", "RewardContext", "RewardModelConfig", "RewardFn", "RewardResult",
           "RewardWorkerPool", "build_reward", "evaluate", "evaluate_steps"]

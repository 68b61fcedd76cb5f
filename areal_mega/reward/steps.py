"""Step scoring by any reward (``reward.step_scoring``): the reward asked once per step.

    reward = StepScored(ConsistencyReward(), "step")       # each step's text scored alone
    prm = StepScored(RewardModelReward(...), "prefix")     # each step's prefix: a PRM
    await prm.evaluate_steps(prompt, ["2+3=5\\n", "5*4=20\\n"], sample)   # -> [s(step 1), s(steps 1-2)]

"step": step j's own text is the completion scored; "prefix": the completion up to the end of
step j (steps 0..j joined) -- what a process reward model scores, and SGLang's prefix cache
makes the shared prefixes cheap. Steps are scored concurrently; ``evaluate`` / ``__call__`` are
the wrapped reward's (the outcome score is unchanged). ``data`` is passed as given (its
COMPLETION_TOKENS is the whole completion's).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from areal_mega.reward.base import RewardFn, RewardResult, evaluate


class StepScored:
    def __init__(self, inner: RewardFn, mode: Literal["step", "prefix"]) -> None:
        if mode not in ("step", "prefix"):
            raise ValueError(f"step_scoring: must be none, step or prefix, got {mode!r}")
        self.inner, self.mode = inner, mode

    def step_completions(self, steps: list[str]) -> list[str]:
        if self.mode == "step":
            return list(steps)
        return ["".join(steps[: j + 1]) for j in range(len(steps))]

    async def evaluate_steps(self, prompt: str, steps: list[str], data: dict[str, Any]) -> list[float]:
        results = await asyncio.gather(*[evaluate(self.inner, prompt, c, data) for c in self.step_completions(steps)])
        return [r.score for r in results]

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        return await evaluate(self.inner, prompt, completion, data)

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def __getattr__(self, name: str) -> Any:  # metrics(), engine(), stats, aclose() of the wrapped reward
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()

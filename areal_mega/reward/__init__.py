"""Rewards: ``await reward(prompt_text, completion_text, sample_dict) -> float``.

    reward = build_reward(RewardConfig(kind="math"))          # math-verify in worker processes
    reward = build_reward(RewardConfig(kind="function", function="my_pkg.rewards:exact_match"))

Built-ins are looked up by exact name; user functions by dotted path "module:function" with
the signature ``fn(prompt: str, completion: str, data: dict) -> float`` (plain or async).
With ``isolate=True`` (default) a user function runs in the worker pool, with the same
timeout / crash protection as the math reward (its arguments must then be JSON-serialisable).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_mega.reward.base import COMPLETION_TOKENS, RewardFn, RewardResult, evaluate
from areal_mega.reward.pool import RewardWorkerPool
from areal_mega.reward.registry import load_callable
from areal_mega.sandbox import SandboxConfig


@dataclass
class RewardConfig:
    kind: Literal["math", "code", "function"] = "math"
    """"math": final answer vs the sample's "answer" via math-verify; "code": run the last
    python block against the sample's "tests"; "function": the user function in ``function``."""
    function: str = ""
    """"module:function" for kind "function"."""
    isolate: bool = True
    """kind "function": run it in worker processes (timeout, crash isolation)."""
    num_workers: int = 2
    """Worker processes for math / isolated user rewards."""
    timeout_s: float = 10.0
    """Per-call timeout; a call that times out, crashes or raises scores 0."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """kind "code": the sandbox the code runs in (its own worker pool, limits, mode)."""

    def validate(self) -> None:
        if self.kind == "function" and ":" not in self.function:
            raise ValueError(f"function: kind 'function' needs 'module:function', got {self.function!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")


class _PooledFunction:
    def __init__(self, path: str, num_workers: int, timeout_s: float) -> None:
        self.path = path
        self.pool = RewardWorkerPool(num_workers, timeout_s, preload=[path.split(":", 1)[0]])

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return await self.pool.acall(self.path, prompt, completion, data)

    def close(self) -> None:
        self.pool.close()


class _InProcessFunction:
    def __init__(self, path: str) -> None:
        self.fn = load_callable(path)

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        out = self.fn(prompt, completion, data)
        if inspect.isawaitable(out):
            out = await out
        return float(out)

    def close(self) -> None:
        pass


def build_reward(cfg: RewardConfig) -> RewardFn:
    cfg.validate()
    if cfg.kind == "math":
        from areal_mega.reward.math import MathReward

        return MathReward(cfg.num_workers, cfg.timeout_s)
    if cfg.kind == "code":
        from areal_mega.reward.code import CodeReward

        return CodeReward(cfg.sandbox)
    if cfg.kind == "function":
        load_callable(cfg.function)  # fail at build time, naming the path, not in a worker
        return _PooledFunction(cfg.function, cfg.num_workers, cfg.timeout_s) if cfg.isolate else _InProcessFunction(cfg.function)
    raise ValueError(f"kind: unknown reward kind {cfg.kind!r}")


__all__ = ["COMPLETION_TOKENS", "RewardConfig", "RewardFn", "RewardResult", "RewardWorkerPool", "build_reward",
           "evaluate", "load_callable"]

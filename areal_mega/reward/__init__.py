"""Rewards: ``await reward(prompt_text, completion_text, sample_dict) -> float``.

    reward = build_reward(RewardConfig(kind="math"))          # math-verify in worker processes
    reward = build_reward(RewardConfig(kind="function", function="my_pkg.rewards:exact_match"))
    reward = build_reward(RewardConfig(kind="judge", judge=JudgeConfig(...)), policy_engine=pool)  # reward/judge.py

Built-ins are looked up by exact name; user functions by dotted path "module:function" with
the signature ``fn(prompt: str, completion: str, data: dict) -> float`` (plain or async).
With ``isolate=True`` (default) a user function runs in the worker pool, with the same
timeout / crash protection as the math reward (its arguments must then be JSON-serialisable).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from areal_mega.reward.judge import JudgeConfig
from areal_mega.reward.pool import RewardWorkerPool
from areal_mega.reward.registry import load_callable


class RewardFn(Protocol):
    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float: ...

    def close(self) -> None: ...


@dataclass
class RewardConfig:
    kind: Literal["math", "code", "function", "judge"] = "math"
    """"math": final answer vs the sample's "answer" via math-verify; "code": run the last
    python block against the sample's "tests"; "function": the user function in ``function``;
    "judge": an LLM judge's verdict (``judge``)."""
    function: str = ""
    """"module:function" for kind "function"."""
    isolate: bool = True
    """kind "function": run it in worker processes (timeout, crash isolation)."""
    num_workers: int = 2
    """Worker processes for math / isolated user rewards."""
    timeout_s: float = 10.0
    """Per-call timeout; a call that times out, crashes or raises scores 0."""
    code_memory_mb: int = 512
    """kind "code": address-space limit of the sandboxed process."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """kind "judge": the judge model's servers, rubric and verdict format."""

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


def build_reward(cfg: RewardConfig, *, policy_engine: Any = None, policy_tokenizer: Any = None) -> RewardFn:
    """The reward of ``cfg``. ``policy_engine`` / ``policy_tokenizer`` (the trainer's pool and
    tokenizer) serve a judge that runs on the policy's servers (``judge.servers: policy``)."""
    cfg.validate()
    if cfg.kind == "math":
        from areal_mega.reward.math import MathReward

        return MathReward(cfg.num_workers, cfg.timeout_s)
    if cfg.kind == "code":
        from areal_mega.reward.code import CodeReward

        return CodeReward(cfg.timeout_s, cfg.code_memory_mb, cfg.num_workers)
    if cfg.kind == "function":
        load_callable(cfg.function)  # fail at build time, naming the path, not in a worker
        return _PooledFunction(cfg.function, cfg.num_workers, cfg.timeout_s) if cfg.isolate else _InProcessFunction(cfg.function)
    if cfg.kind == "judge":
        from areal_mega.reward.judge import build_judge

        return build_judge(cfg.judge, policy_engine=policy_engine, policy_tokenizer=policy_tokenizer)
    raise ValueError(f"kind: unknown reward kind {cfg.kind!r}")


__all__ = ["JudgeConfig", "RewardConfig", "RewardFn", "RewardWorkerPool", "build_reward", "load_callable"]

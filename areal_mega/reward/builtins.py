"""The built-in reward kinds, each ``kind(cfg: RewardConfig, ctx: RewardContext) -> RewardFn``: the
call a user's ``reward.kind: package.module:Name`` gets too (``areal_mega.kinds``)."""

from __future__ import annotations

import inspect
from typing import Any

from areal_mega.kinds import resolve
from areal_mega.reward.base import RewardContext, RewardFn
from areal_mega.reward.pool import RewardWorkerPool


def math(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.math import MathReward

    return MathReward(cfg.num_workers, cfg.timeout_s)


def code(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.code import CodeReward

    return CodeReward(cfg.sandbox)


def format_(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.shaping import FormatReward

    return FormatReward(cfg.format_regex)


def overlong(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.shaping import OverlongPenalty

    return OverlongPenalty(cfg.overlong_max_tokens, cfg.overlong_buffer_tokens)


def composite(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward import build_reward
    from areal_mega.reward.shaping import CompositeReward

    built: list = []
    try:
        for c, name in zip(cfg.components, cfg.component_names()):
            built.append((c.weight, name, build_reward(c, policy_engine=ctx.policy_engine,
                                                       policy_tokenizer=ctx.policy_tokenizer)))
        return CompositeReward(built)
    except BaseException:
        for _, _, fn in built:
            fn.close()
        raise


class _PooledFunction:
    def __init__(self, path: str, num_workers: int, timeout_s: float) -> None:
        self.path = path
        self.pool = RewardWorkerPool(num_workers, timeout_s, preload=[path.split(":", 1)[0]])

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return await self.pool.acall(self.path, prompt, completion, data)

    def close(self) -> None:
        self.pool.close()


class _InProcessFunction:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        out = self.fn(prompt, completion, data)
        if inspect.isawaitable(out):
            out = await out
        return float(out)

    def close(self) -> None:
        pass


def function(cfg: Any, ctx: RewardContext) -> RewardFn:
    """A plain ``fn(prompt, completion, data) -> float`` named by ``cfg.function``."""
    fn = resolve("reward", cfg.function)  # fail at build time, naming the path, not in a worker
    if not callable(fn):
        raise ValueError(f"reward.function: {cfg.function!r} is not callable")
    return _PooledFunction(cfg.function, cfg.num_workers, cfg.timeout_s) if cfg.isolate else _InProcessFunction(fn)


def judge(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.judge import build_judge

    return build_judge(cfg.judge, policy_engine=ctx.policy_engine, policy_tokenizer=ctx.policy_tokenizer)


def multi_judge(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.multi_judge import build_multi_judge

    return build_multi_judge(cfg.multi_judge, policy_engine=ctx.policy_engine, policy_tokenizer=ctx.policy_tokenizer)


def reward_model(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.reward_model import build_reward_model

    return build_reward_model(cfg.reward_model)


def consistency(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.consistency import ConsistencyReward

    return ConsistencyReward()

"""The built-in reward kinds, each ``kind(cfg: RewardConfig, ctx: RewardContext) -> RewardFn`` with
its settings in ``kind.Options``: the call and the options a user's ``reward.kind:
package.module:Name`` gets too (``areal_mega.kinds``)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_mega.config import check_each
from areal_mega.kinds import resolve
from areal_mega.reward.base import RewardContext, RewardFn
from areal_mega.reward.config import RewardConfig
from areal_mega.reward.judge import JudgeConfig
from areal_mega.reward.multi_judge import MultiJudgeConfig
from areal_mega.reward.pool import RewardWorkerPool
from areal_mega.reward.reward_model import RewardModelConfig
from areal_mega.sandbox import SandboxConfig


def _options(cls: type | None) -> Callable[[Callable], Callable]:
    def attach(kind: Callable) -> Callable:
        kind.Options = cls
        return kind
    return attach


@dataclass
class MathOptions:
    num_workers: int = 2
    """Worker processes (math-verify runs outside the event loop, with a timeout)."""
    timeout_s: float = 10.0
    """Per-call timeout; a call that times out, crashes or raises scores 0."""

    def validate(self) -> None:
        if self.num_workers < 1 or self.timeout_s <= 0:
            raise ValueError(f"num_workers / timeout_s: must be >= 1 / > 0, got {self.num_workers}, {self.timeout_s}")


@dataclass
class FunctionOptions(MathOptions):
    function: str = ""
    """"module:function", ``fn(prompt, completion, data) -> float`` (plain or async)."""
    isolate: bool = True
    """Run it in worker processes (timeout, crash isolation; JSON-serialisable arguments)."""

    def validate(self) -> None:
        super().validate()
        if ":" not in self.function:
            raise ValueError(f"function: kind 'function' needs 'module:function', got {self.function!r}")


@dataclass
class FormatOptions:
    regex: str = r"\\boxed\{.+?\}"
    """A Python regex (searched, DOTALL) the completion must contain."""

    def validate(self) -> None:
        try:
            re.compile(self.regex)
        except re.error as e:
            raise ValueError(f"regex: {self.regex!r} is not a valid regex ({e})") from None


@dataclass
class OverlongOptions:
    max_tokens: int = 0
    """L_max, beyond which the penalty is -1 (set it to the generation limit)."""
    buffer_tokens: int = 0
    """L_cache, the soft zone below L_max where the penalty falls linearly from 0 to -1."""

    def validate(self) -> None:
        if not 0 < self.buffer_tokens <= self.max_tokens:
            raise ValueError(f"buffer_tokens: needs 0 < buffer_tokens <= max_tokens, got {self.buffer_tokens} "
                             f"and {self.max_tokens}")


@dataclass
class CompositeOptions:
    components: list[RewardConfig] = field(default_factory=list)
    """The rewards summed (each a reward section: kind, options, ``weight``, optional ``name``)."""

    def validate(self) -> None:
        if not self.components:
            raise ValueError("components: kind 'composite' needs at least one component")
        for i, c in enumerate(self.components):
            if c.kind == "composite":
                raise ValueError(f"components[{i}].kind: a composite cannot contain a composite (flatten it)")
        check_each("components", self.components)

    def names(self) -> list[str]:
        """Each component's ``name``, else its kind (suffixed by position when repeated)."""
        names = [c.name or c.kind for c in self.components]
        return [n if names.count(n) == 1 or c.name else f"{n}{i}" for i, (n, c) in enumerate(zip(names, self.components))]


@_options(MathOptions)
def math(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.math import MathReward

    return MathReward(cfg.options.num_workers, cfg.options.timeout_s)


@_options(SandboxConfig)
def code(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.code import CodeReward

    return CodeReward(cfg.options)


@_options(FormatOptions)
def format_(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.shaping import FormatReward

    return FormatReward(cfg.options.regex)


@_options(OverlongOptions)
def overlong(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.shaping import OverlongPenalty

    return OverlongPenalty(cfg.options.max_tokens, cfg.options.buffer_tokens)


@_options(CompositeOptions)
def composite(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.build import build_reward
    from areal_mega.reward.shaping import CompositeReward

    built: list = []
    try:
        for c, name in zip(cfg.options.components, cfg.options.names()):
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


@_options(FunctionOptions)
def function(cfg: Any, ctx: RewardContext) -> RewardFn:
    """A plain ``fn(prompt, completion, data) -> float`` named by ``options.function``."""
    o = cfg.options
    fn = resolve("reward", o.function)  # fail at build time, naming the path, not in a worker
    return _PooledFunction(o.function, o.num_workers, o.timeout_s) if o.isolate else _InProcessFunction(fn)


@_options(JudgeConfig)
def judge(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.judge import build_judge

    return build_judge(cfg.options, policy_engine=ctx.policy_engine, policy_tokenizer=ctx.policy_tokenizer)


@_options(MultiJudgeConfig)
def multi_judge(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.multi_judge import build_multi_judge

    return build_multi_judge(cfg.options, policy_engine=ctx.policy_engine, policy_tokenizer=ctx.policy_tokenizer)


@_options(RewardModelConfig)
def reward_model(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.reward_model import build_reward_model

    return build_reward_model(cfg.options)


@_options(None)
def consistency(cfg: Any, ctx: RewardContext) -> RewardFn:
    from areal_mega.reward.consistency import ConsistencyReward

    return ConsistencyReward()

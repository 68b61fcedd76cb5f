"""Shaping rewards: answer format, DAPO's soft overlong penalty, weighted composition.

    FormatReward(r"\\\\boxed\\{.+?\\}")          1.0 when the completion matches, else 0.0
    OverlongPenalty(max_tokens=4096, buffer_tokens=512)      # DAPO eq. 13: 0 down to -1
    CompositeReward([(1.0, "math", math), (0.1, "format", fmt), (1.0, "overlong", pen)])

The overlong formula and the composite's info / step scores: docs/rewards.md ("Shaping").
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Sequence

from areal_mega.reward.base import COMPLETION_TOKENS, RewardFn, RewardResult, evaluate, evaluate_steps


class FormatReward:
    """1.0 when ``pattern`` (a Python regex, searched with DOTALL) occurs in the completion."""

    def __init__(self, pattern: str) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"format_regex: {pattern!r} is not a valid regex ({e})") from None

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        ok = self.regex.search(completion) is not None
        return RewardResult(1.0 if ok else 0.0, {} if ok else {"reasons": ["format"]})

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def close(self) -> None:
        pass


def overlong_penalty(num_tokens: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment (module docstring): 0, then linear to -1, then -1."""
    start = max_tokens - buffer_tokens
    if num_tokens <= start:
        return 0.0
    if num_tokens <= max_tokens:
        return (start - num_tokens) / buffer_tokens
    return -1.0


class OverlongPenalty:
    def __init__(self, max_tokens: int, buffer_tokens: int) -> None:
        if not 0 < buffer_tokens <= max_tokens:
            raise ValueError(f"overlong_buffer_tokens: must be in (0, overlong_max_tokens={max_tokens}], got {buffer_tokens}")
        self.max_tokens, self.buffer_tokens = max_tokens, buffer_tokens

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        n = data.get(COMPLETION_TOKENS)
        if not isinstance(n, int):
            raise ValueError(f"overlong reward: data[{COMPLETION_TOKENS!r}] (the completion's token count, set by "
                             f"the workflow) is missing or not an int: {n!r}")
        score = overlong_penalty(n, self.max_tokens, self.buffer_tokens)
        return RewardResult(score, {"num_tokens": n, **({"reasons": ["overlong"]} if score < 0 else {})})

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def close(self) -> None:
        pass


class CompositeReward:
    """sum_i weight_i * component_i, the components evaluated concurrently."""

    def __init__(self, components: Sequence[tuple[float, str, RewardFn]]) -> None:
        names = [n for _, n, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"components: names must be unique, got {names}")
        self.components = list(components)

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        results = await asyncio.gather(*[evaluate(fn, prompt, completion, data) for _, _, fn in self.components])
        score = sum(w * r.score for (w, _, _), r in zip(self.components, results))
        info: dict[str, Any] = {"components": {n: r.score for (_, n, _), r in zip(self.components, results)}}
        reasons = []
        for (_, name, _), r in zip(self.components, results):
            if r.info:
                info[name] = r.info
            reasons += r.info.get("reasons", [])
        if reasons:
            info["reasons"] = reasons
        return RewardResult(score, info)

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    async def evaluate_steps(self, prompt: str, steps: list[str], data: dict[str, Any]) -> list[float] | None:
        parts = await asyncio.gather(*[evaluate_steps(fn, prompt, steps, data) for _, _, fn in self.components])
        scored = [(w, p) for (w, _, _), p in zip(self.components, parts) if p is not None]
        if not scored:
            return None
        return [sum(w * p[j] for w, p in scored) for j in range(len(steps))]

    def metrics(self) -> dict[str, float]:
        """The components' own metrics (judges' outcome counts), merged."""
        out: dict[str, float] = {}
        for _, _, fn in self.components:
            m = getattr(fn, "metrics", None)
            if m is not None:
                out.update(m())
        return out

    def close(self) -> None:
        for _, _, fn in self.components:
            fn.close()

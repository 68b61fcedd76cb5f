"""The reward contract, shared by every reward and the workflows.

``await reward(prompt, completion, data) -> float`` is all a workflow needs; optional
``evaluate(...) -> RewardResult`` (details) and ``evaluate_steps(prompt, steps, data) ->
list[float]`` (process supervision). :func:`evaluate` / :func:`evaluate_steps` work with any
reward. The workflows add :data:`COMPLETION_TOKENS` to ``data``. docs/rewards.md ("The contract").
"""

from __future__ import annotations

from typing import Any

from areal_mega.api.reward import COMPLETION_TOKENS, RewardContext, RewardFn, RewardResult

__all__ = ["COMPLETION_TOKENS", "RewardContext", "RewardFn", "RewardResult", "evaluate", "evaluate_steps"]


async def evaluate_steps(reward: RewardFn, prompt: str, steps: list[str], data: dict[str, Any]) -> list[float] | None:
    """``reward.evaluate_steps(...)`` (one score per step) when the reward scores steps, else None."""
    fn = getattr(reward, "evaluate_steps", None)
    if fn is None or not steps:
        return None
    out = await fn(prompt, steps, data)
    if out is None:  # e.g. a composite none of whose components scores steps
        return None
    scores = [float(s) for s in out]
    if len(scores) != len(steps):
        raise ValueError(f"evaluate_steps: {type(reward).__name__} returned {len(scores)} scores for {len(steps)} steps")
    return scores


async def evaluate(reward: RewardFn, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
    """``reward.evaluate(...)`` when the reward has it, else its float wrapped."""
    detailed = getattr(reward, "evaluate", None)
    if detailed is not None:
        return await detailed(prompt, completion, data)
    return RewardResult(float(await reward(prompt, completion, data)))

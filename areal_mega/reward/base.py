"""The reward contract, shared by every reward and the workflows.

``await reward(prompt, completion, data) -> float`` is all a workflow needs. A reward that knows
more (why a code sample failed, which shaping term cost what) also has
``await reward.evaluate(prompt, completion, data) -> RewardResult``; :func:`evaluate` calls it
when present and wraps the bare float otherwise, so callers that want the details (metrics
counting failure reasons, the composite reward) work with any reward.

``data`` is the sample dict; the workflows add :data:`COMPLETION_TOKENS` (the number of tokens
the policy generated for this completion) before calling the reward: length shaping needs token
counts, and only the workflow has them.

Step rewards (process supervision): a reward that scores steps also has
``await reward.evaluate_steps(prompt, steps, data) -> list[float]`` (one score per step text,
in order); :func:`evaluate_steps` returns None for a reward without it. The workflows call it
once per trajectory, after the outcome ``evaluate``, when ``workflow.steps`` cuts the
completion into steps (``areal_mega.workflows.steps``).
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

"""The reward contract, shared by every reward and the workflows.

``await reward(prompt, completion, data) -> float`` is all a workflow needs. A reward that knows
more (why a code sample failed, which shaping term cost what) also has
``await reward.evaluate(prompt, completion, data) -> RewardResult``; :func:`evaluate` calls it
when present and wraps the bare float otherwise, so callers that want the details (metrics
counting failure reasons, the composite reward) work with any reward.

``data`` is the sample dict; the workflows add :data:`COMPLETION_TOKENS` (the number of tokens
the policy generated for this completion) before calling the reward: length shaping needs token
counts, and only the workflow has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["COMPLETION_TOKENS", "RewardFn", "RewardResult", "evaluate"]

COMPLETION_TOKENS = "completion_num_tokens"
"""Key of ``data`` the workflows set to the completion's generated-token count (int)."""


@dataclass
class RewardResult:
    score: float
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-able details: e.g. the code reward's ``reasons`` (one per failed test) and
    ``fraction_passed``; the composite's per-component scores."""


class RewardFn(Protocol):
    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float: ...

    def close(self) -> None: ...


async def evaluate(reward: RewardFn, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
    """``reward.evaluate(...)`` when the reward has it, else its float wrapped."""
    detailed = getattr(reward, "evaluate", None)
    if detailed is not None:
        return await detailed(prompt, completion, data)
    return RewardResult(float(await reward(prompt, completion, data)))

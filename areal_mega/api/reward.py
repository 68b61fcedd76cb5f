"""The reward contract: ``await reward(prompt, completion, data) -> float`` (and ``close()``).

A reward kind (``reward.kind``: a built-in or ``package.module:Name``) is called as
``Kind(cfg: RewardConfig, ctx: RewardContext) -> RewardFn``; its own typed options are
``cfg.options`` (a nested ``Options`` dataclass). Richer rewards also have ``evaluate`` (details)
and ``evaluate_steps`` (process rewards): ``areal_mega/reward/base.py``; docs/extending.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["COMPLETION_TOKENS", "RewardContext", "RewardFn", "RewardResult"]

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


@dataclass
class RewardContext:
    """What a reward may use besides its config: the policy's own servers and tokenizer (a judge
    that runs on the policy's servers, ``judge.servers: policy``); None where there are none."""

    policy_engine: Any = None
    policy_tokenizer: Any = None

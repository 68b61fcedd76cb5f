"""A reward with parameters set in YAML: the exact answer, with partial credit for a number.

    reward: {kind: examples.digits_reward:DigitsReward, options: {floor: 0.25, number: 0.5, match: 1.0}}

score = match for the reference answer, number for another number, floor for anything else.
Called as ``DigitsReward(cfg, ctx)`` (``areal_mega/api/reward.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class DigitsReward:
    @dataclasses.dataclass
    class Options:
        floor: float = 0.0
        """Score of a completion that is not a number."""
        number: float = 0.0
        """Score of a number that is not the answer."""
        match: float = 1.0
        """Score of the exact answer."""

        def validate(self) -> None:
            if not self.floor <= self.number <= self.match:
                raise ValueError(f"floor <= number <= match needed, got {self.floor}, {self.number}, {self.match}")

    def __init__(self, cfg: Any, ctx: Any) -> None:
        self.opts = cfg.options

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        text = completion.strip()
        if text == str(data["answer"]).strip():
            return self.opts.match
        return self.opts.number if text.isdigit() else self.opts.floor

    def close(self) -> None:
        pass

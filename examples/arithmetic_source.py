"""A prompt source that makes problems on the fly: "Q:a+b=?A:" with a, b drawn from the position.

    data: {kind: examples.arithmetic_source:ArithmeticSource, options: {max_operand: 20}}

Endless: sample (epoch, index) is a pure function of its position and the seed, so a resumed
run regenerates exactly the prompts it gives back (``areal_mega/api/data.py``). Held-out
problems come from a stream of their own (on a space this small a question may repeat).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any


class ArithmeticSource:
    @dataclasses.dataclass
    class Options:
        max_operand: int = 20
        """a and b in [0, max_operand]."""
        per_epoch: int = 1000
        """Positions per epoch (an epoch is only a counter here)."""
        num_heldout: int = 16
        """Problems for evaluation."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        self.opts, self.seed = cfg.options, cfg.seed
        self.epoch, self.cursor, self._requeued = 0, 0, []

    def sample_at(self, epoch: int, index: int, split: str = "train") -> dict[str, Any]:
        rng = random.Random(f"{self.seed}/{split}/{epoch}/{index}")
        a, b = rng.randint(0, self.opts.max_operand), rng.randint(0, self.opts.max_operand)
        return {"id": f"{split}/{epoch}/{index}", "prompt": f"Q:{a}+{b}=?A:", "answer": str(a + b)}

    def next(self) -> tuple[tuple[int, int], dict[str, Any]]:
        if self._requeued:
            pos = self._requeued.pop(0)
        else:
            if self.cursor == self.opts.per_epoch:
                self.epoch, self.cursor = self.epoch + 1, 0
            pos, self.cursor = (self.epoch, self.cursor), self.cursor + 1
        return pos, self.sample_at(*pos)

    def state_dict(self, in_flight: list[tuple[int, int]]) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "requeue": [list(p) for p in [*in_flight, *self._requeued]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._requeued = [tuple(p) for p in state["requeue"]]

    def heldout(self) -> list[dict[str, Any]]:
        return [self.sample_at(0, i, "heldout") for i in range(self.opts.num_heldout)]

"""A prompt source that makes problems on the fly: "Q:a+b=?A:" with a, b drawn from the index.

    data: {kind: examples.arithmetic_source:ArithmeticSource, options: {max_operand: 20}}

Problem i is a pure function of (seed, i), so nothing is stored; resuming (which prompts were in
flight, where the stream stood) is the built-in ``PromptStream``'s, over these generated problems
(``areal_mega/api/data.py``). Held-out problems come from a stream of their own.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from areal_mega.data import PromptStream


def problem(seed: int, split: str, i: int, max_operand: int) -> dict[str, Any]:
    rng = random.Random(f"{seed}/{split}/{i}")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return {"id": f"{split}/{i}", "prompt": f"Q:{a}+{b}=?A:", "answer": str(a + b)}


class _Problems:
    """One epoch's problems, generated when read (the dataset a ``PromptStream`` walks)."""

    shuffle = False

    def __init__(self, seed: int, per_epoch: int, max_operand: int) -> None:
        self.seed, self.per_epoch, self.max_operand = seed, per_epoch, max_operand

    def __len__(self) -> int:
        return self.per_epoch

    def __getitem__(self, i: int) -> dict[str, Any]:
        return problem(self.seed, "train", i, self.max_operand)


class ArithmeticSource(PromptStream):
    @dataclasses.dataclass
    class Options:
        max_operand: int = 20
        """a and b in [0, max_operand]."""
        per_epoch: int = 1000
        """Problems per epoch."""
        num_heldout: int = 16
        """Problems for evaluation."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        o = cfg.options
        super().__init__(_Problems(cfg.seed, o.per_epoch, o.max_operand),
                         [problem(cfg.seed, "heldout", i, o.max_operand) for i in range(o.num_heldout)])

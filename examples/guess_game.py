"""A token-level workflow with its own environment: guess the hidden digit, told higher or lower.

    workflow: {kind: examples.guess_game:GuessTheDigit, options: {max_moves: 3}}

Each move the model writes one token; the environment answers "+" (higher), "-" (lower) or
"=" (found) and the model moves again, up to ``max_moves``. One trajectory per sample: the
model's moves are trained on (loss_mask 1), the environment's replies are not (loss_mask 0).
The reward is 1 for finding the digit, less for each extra move. Nothing here edits areal_mega/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

from areal_mega.api import GenerationRequest, Trajectory
from areal_mega.workflows.base import TokenWorkflow, TrajectoryBuilder, decode, encode, new_group_id


class GuessTheDigit(TokenWorkflow):
    @dataclasses.dataclass
    class Options:
        max_moves: int = 3
        """Moves per game (each one generated token)."""
        move_discount: float = 0.5
        """Finding the digit at move k (0-based) earns move_discount ** k."""

        def validate(self) -> None:
            if self.max_moves < 1 or not 0 < self.move_discount <= 1:
                raise ValueError(f"max_moves >= 1 and move_discount in (0, 1], got {self.max_moves}, {self.move_discount}")

    @staticmethod
    def secret(data: dict[str, Any]) -> int:
        """The hidden digit: a function of the sample id, so a replayed prompt is the same game."""
        return random.Random(str(data["id"])).randrange(10)

    async def play(self, engine: Any, data: dict[str, Any], gid: str) -> Trajectory:
        secret, opts = self.secret(data), self.options
        b = TrajectoryBuilder(encode(self.tokenizer, data["prompt"]))
        reward, sampling = 0.0, dataclasses.replace(self.sampling, max_new_tokens=1)
        for move in range(opts.max_moves):
            res = await engine.agenerate(GenerationRequest(list(b.input_ids), sampling))
            b.add_generated(res)
            guess = decode(self.tokenizer, res.output_ids).strip()
            if guess == str(secret):
                reward = opts.move_discount ** move
                break
            answer = "?" if not guess.isdigit() else ("+" if secret > int(guess) else "-")
            b.add_env(encode(self.tokenizer, answer))
        return b.build(reward, gid, {"moves": move + 1, "secret": secret})

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> list[Trajectory]:
        gid = new_group_id(data)
        return list(await asyncio.gather(*[self.play(engine, data, gid) for _ in range(self.cfg.group_size)]))

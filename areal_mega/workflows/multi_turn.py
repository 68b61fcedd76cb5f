"""Multi-turn workflow with feedback: answer; if wrong, the environment says so and the model
tries again, up to ``max_turns`` attempts. Each of the G samples is one whole conversation::

    [prompt]0 [attempt 1]1 [feedback]0 [attempt 2]1 ...      (loss_mask per span)

reward = r(last attempt) * options.turn_discount ** (attempts - 1): later success is worth less.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest
from areal_mega.api.workflow import Trajectory
from areal_mega.reward import COMPLETION_TOKENS, RewardFn
from areal_mega.workflows.base import Tokenizer, TokenWorkflow, TrajectoryBuilder, WorkflowConfig, decode, encode, new_group_id, score


class MultiTurnWorkflow(TokenWorkflow):
    @dataclass
    class Options:
        feedback: str = "\nThat is not correct. Try again.\nAnswer:"
        """Text appended after a wrong answer (loss_mask 0)."""
        turn_discount: float = 0.9
        """A correct answer at attempt k (0-based) earns reward * turn_discount**k."""

        def validate(self) -> None:
            if not 0 < self.turn_discount <= 1:
                raise ValueError(f"turn_discount: must be in (0, 1], got {self.turn_discount}")

    def __init__(self, cfg: WorkflowConfig, tokenizer: Tokenizer, reward_fn: RewardFn, tools: Any = None) -> None:
        super().__init__(cfg, tokenizer, reward_fn, tools)
        self.feedback_ids = encode(tokenizer, self.options.feedback)

    async def _conversation(self, engine: InferenceEngine, data: dict[str, Any], gid: str) -> Trajectory:
        b = TrajectoryBuilder(encode(self.tokenizer, data["prompt"]))
        reward, turns, texts, info = 0.0, 0, [], {}
        for turn in range(self.cfg.max_turns):
            if turn and len(b.input_ids) + len(self.feedback_ids) + self.sampling.max_new_tokens > self.max_context_tokens:
                break
            if turn:
                b.add_env(self.feedback_ids)
            res = await engine.agenerate(GenerationRequest(list(b.input_ids), self.sampling))
            b.add_generated(res)
            turns = turn + 1
            texts.append(decode(self.tokenizer, res.output_ids))
            r = await score(self.reward_fn, data["prompt"], texts[-1], {**data, COMPLETION_TOKENS: len(res.output_ids)})
            reward, info = r.score, r.info
            if reward > 0:
                break
        await self.score_steps(b, data["prompt"], {**data, COMPLETION_TOKENS: sum(b.loss_mask)})
        return b.build(reward * self.options.turn_discount ** (turns - 1), gid,
                       {"num_turns": turns, "completions": texts, "reward_info": info})

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        gid = new_group_id(data)
        return list(await asyncio.gather(*[self._conversation(engine, data, gid) for _ in range(self.cfg.group_size)]))

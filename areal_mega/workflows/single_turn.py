"""Single-turn workflow: prompt -> G samples -> rewards -> G trajectories (one GRPO group)."""

from __future__ import annotations

import asyncio
from typing import Any

from areal_mega.api.engine import InferenceEngine
from areal_mega.api.io import GenerationRequest
from areal_mega.api.workflow import Trajectory
from areal_mega.reward import COMPLETION_TOKENS
from areal_mega.workflows.base import TokenWorkflow, TrajectoryBuilder, decode, encode, new_group_id, score


class SingleTurnWorkflow(TokenWorkflow):
    """``data`` needs "prompt" (text, already templated) and whatever the reward reads."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        prompt_ids = encode(self.tokenizer, data["prompt"])
        results = await asyncio.gather(
            *[engine.agenerate(GenerationRequest(list(prompt_ids), self.sampling)) for _ in range(self.cfg.group_size)]
        )
        texts = [decode(self.tokenizer, r.output_ids) for r in results]
        rewards = await asyncio.gather(*[
            score(self.reward_fn, data["prompt"], t, {**data, COMPLETION_TOKENS: len(r.output_ids)})
            for t, r in zip(texts, results)])
        gid = new_group_id(data)
        builders = []
        for res in results:
            b = TrajectoryBuilder(prompt_ids)
            b.add_generated(res)
            builders.append(b)
        await asyncio.gather(*[self.score_steps(b, data["prompt"], {**data, COMPLETION_TOKENS: len(r.output_ids)})
                               for b, r in zip(builders, results)])
        return [b.build(reward.score, gid, {"completion": text, "finish_reason": res.finish_reason,
                                            "reward_info": reward.info})
                for b, res, text, reward in zip(builders, results, texts, rewards)]

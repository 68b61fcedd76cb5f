"""Rewards: ``await reward(prompt_text, completion_text, sample_dict) -> float``.

    reward = build_reward(RewardConfig(kind="math"))          # math-verify in worker processes
    reward = build_reward(RewardConfig(kind="function", options=FunctionOptions("my_pkg.rewards:exact_match")))
    reward = build_reward(RewardConfig(kind="judge", options=JudgeConfig(...)), policy_engine=pool)

``kind`` is a built-in name (``reward/builtins.py``) or a user's "package.module:Name", both
resolved by ``areal_mega.kinds`` and called as ``Name(cfg, ctx)``; each kind's settings are its
own ``Options`` (``cfg.options``). Details (``evaluate``), step scores and the composite:
``reward.base``, ``reward.shaping``; docs/rewards.md.
"""

from __future__ import annotations

from areal_mega.reward.base import COMPLETION_TOKENS, RewardContext, RewardFn, RewardResult, evaluate, evaluate_steps
from areal_mega.reward.build import build_reward
from areal_mega.reward.builtins import CompositeOptions, FormatOptions, FunctionOptions, MathOptions, OverlongOptions
from areal_mega.reward.config import RewardConfig
from areal_mega.reward.judge import JudgeConfig
from areal_mega.reward.multi_judge import MultiJudgeConfig
from areal_mega.reward.pool import RewardWorkerPool
from areal_mega.reward.reward_model import RewardModelConfig

__all__ = ["COMPLETION_TOKENS", "CompositeOptions", "FormatOptions", "FunctionOptions", "JudgeConfig", "MathOptions",
           "MultiJudgeConfig", "OverlongOptions", "RewardConfig", "RewardContext", "RewardFn", "RewardModelConfig",
           "RewardResult", "RewardWorkerPool", "build_reward", "evaluate", "evaluate_steps"]

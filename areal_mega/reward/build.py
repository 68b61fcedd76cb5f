"""``build_reward``: the reward a ``RewardConfig`` names, built by the call every kind gets."""

from __future__ import annotations

from typing import Any

from areal_mega.kinds import resolve
from areal_mega.reward.base import RewardContext, RewardFn
from areal_mega.reward.config import RewardConfig

__all__ = ["build_reward"]


def build_reward(cfg: RewardConfig, *, policy_engine: Any = None, policy_tokenizer: Any = None) -> RewardFn:
    """The reward ``cfg.kind`` names (a built-in, ``reward/builtins.py``, or a user's
    ``package.module:Name``, both called as ``Kind(cfg, ctx)``). ``policy_engine`` /
    ``policy_tokenizer`` (the trainer's pool and tokenizer) serve a judge that runs on the policy's
    servers (``judge.servers: policy``). With ``step_scoring`` the reward also scores steps."""
    cfg.validate()
    reward = resolve("reward", cfg.kind)(cfg, RewardContext(policy_engine, policy_tokenizer))
    if cfg.step_scoring == "none":
        return reward
    from areal_mega.reward.steps import StepScored

    return StepScored(reward, cfg.step_scoring)

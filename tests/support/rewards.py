"""Reward functions for trainer runs on the untrained tiny model (reward.kind function,
``tests.support.rewards:NAME``): the demo's exact-answer reward is 0 for every sample of a random
model, which gives GRPO no advantage and the learner no update."""

from __future__ import annotations


def digit_fraction(prompt: str, completion: str, data: dict) -> float:
    """The fraction of the completion's characters that are digits: differs within almost every
    group of a random model's samples, so every step updates the policy."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))

"""The two algorithm components a researcher replaces: the advantage estimator and the policy loss.

Both are pure functions of the packed batch (``BATCH_KEYS``), built from ``algorithm:`` by
name (``adv_estimator``, ``policy_loss``: a built-in or ``package.module:Class``), each with its
own typed options (``adv_options`` / ``loss_options``, a nested ``Options`` dataclass).
Built-ins: ``areal_mega/algo/advantages.py``, ``areal_mega/algo/losses.py``; docs/extending.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

__all__ = ["BATCH_KEYS", "AdvantageEstimator", "PolicyLoss"]

BATCH_KEYS: dict[str, str] = {
    "input_ids": "[T] int64: B sequences packed back to back",
    "cu_seqlens": "[B+1] int32: sequence boundaries",
    "loss_mask": "[T]: 1 on the tokens the policy generated (trained on), next-token aligned",
    "logprobs": "[T]: behaviour log-probs (the inference servers', per token)",
    "versions": "[T]: policy version of each generated token (-1 elsewhere)",
    "rewards": "[B]: outcome reward per sequence",
    "group_index": "[B] int64: sequences sampled from one prompt share an index",
    "step_rewards": "[T]: step j's reward on its last generated token (process rewards only)",
    "step_mask": "[T]: 1 on step ends (process rewards only)",
    "prox_logprobs": "[T]: log-probs of the policy before this update (algorithm.decoupled)",
    "ref_logprobs": "[T]: the frozen reference's log-probs (algorithm.needs_reference)",
    "kl": "[T]: per-token KL estimate to the reference (kl_in_reward)",
    "values": "[T]: the critic's values (an estimator with needs_values)",
    "advantages": "[T]: the estimator's output, read by the policy loss",
    "returns": "[T]: the token estimators' returns (the critic's target)",
}
"""Every key an estimator or a loss may read, with its shape. All per-token tensors share one
(next-token) alignment and are 0 outside ``loss_mask``."""


class AdvantageEstimator(Protocol):
    """``Estimator(cfg: AlgorithmConfig)`` then ``estimator(batch) -> {"advantages": [T], ...}``
    on the whole rollout batch, before any optimizer step (its options: ``cfg.adv_options``)."""

    needs_values: ClassVar[bool]
    """True: the trainer builds a critic and puts its ``values`` in the batch."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class PolicyLoss(Protocol):
    """``Loss(cfg: AlgorithmConfig, *, total_tokens, total_seqs)`` once per optimizer step (the
    counts are the whole mini-batch's, for normalising), then per micro-batch
    ``loss(logprobs [T], entropy [T] or None, micro_batch) -> (scalar loss, stats)``; the
    ``logprobs`` are the current policy's, at the sampling temperature, with gradient."""

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None,
                 mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

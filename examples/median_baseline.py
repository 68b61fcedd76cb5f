"""An advantage estimator: the reward minus its group's median (robust to one outlier sample).

    algorithm: {adv_estimator: examples.median_baseline:MedianBaseline, adv_options: {scale: 1.0}}

A[token] = scale * (r - median of r over the group), on every generated token of the sequence.
The contract (``areal_mega/api/algorithm.py``): built once as ``MedianBaseline(cfg.algorithm)``,
called on the whole packed batch, returns {"advantages": [T]}.
"""

from __future__ import annotations

import dataclasses

import torch


class MedianBaseline:
    needs_values = False  # no critic

    @dataclasses.dataclass
    class Options:
        scale: float = 1.0
        """Multiplies every advantage (0 switches the policy gradient off: a wiring check)."""

    def __init__(self, cfg) -> None:
        self.scale = cfg.adv_options.scale

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rewards, groups, cu = batch["rewards"].double(), batch["group_index"].long(), batch["cu_seqlens"].long()
        median = torch.zeros_like(rewards)
        for g in groups.unique():
            members = groups == g
            median[members] = rewards[members].median()  # torch: the lower of the two middle values
        per_seq = (self.scale * (rewards - median)).float()
        return {"advantages": torch.repeat_interleave(per_seq, cu[1:] - cu[:-1]) * batch["loss_mask"].float()}

"""A policy loss with a sequence-level importance ratio (GSPO), run from a script of its own.

    python -m areal_mega.launcher local --config examples/sequence_ratio.yaml   # starts this file on each rank
    torchrun --nproc-per-node 2 examples/sequence_ratio.py --config examples/sequence_ratio.yaml

s_i = exp(mean over sequence i's tokens of log pi_theta - log pi_old), clipped to [1 - eps, 1 + eps]
like PPO's token ratio, times the sequence's advantage; pi_old = pi_prox (decoupled) or the
behaviour policy. ``main`` is the composition root with one line changed (docs/extending.md);
``algorithm.policy_loss: examples.sequence_ratio:SequenceRatioLoss`` in YAML does the same.
"""

from __future__ import annotations

import dataclasses
import sys

import torch


class SequenceRatioLoss:
    @dataclasses.dataclass
    class Options:
        eps: float = 0.2
        """Clip of the sequence ratio."""

    def __init__(self, cfg, *, total_tokens: float | None, total_seqs: float | None) -> None:
        self.eps = cfg.loss_options.eps if cfg.loss_options is not None else self.Options().eps
        self.decoupled = cfg.decoupled
        self.total_seqs = total_seqs

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: dict):
        mask = mb["loss_mask"].float()
        old = mb["prox_logprobs"] if self.decoupled else mb["logprobs"]
        cu = mb["cu_seqlens"].long()
        seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
        n = torch.zeros(len(cu) - 1).index_add(0, seq, mask)
        log_ratio = torch.zeros(len(cu) - 1).index_add(0, seq, (logprobs - old) * mask) / n.clamp(min=1)
        ratio = torch.exp(log_ratio.clamp(-20, 20))
        adv = torch.zeros(len(cu) - 1).index_add(0, seq, mb["advantages"].float() * mask) / n.clamp(min=1)
        per_seq = -torch.minimum(ratio * adv, ratio.clamp(1 - self.eps, 1 + self.eps) * adv)
        has = (n > 0).float()
        loss = (per_seq * has).sum() / max(self.total_seqs or float(has.sum()), 1.0)
        k = has.sum().clamp(min=1)
        stats = {"seq_ratio/mean": (ratio.detach() * has).sum() / k,
                 "seq_ratio/clip_frac": (((ratio - 1).abs() > self.eps).float() * has).sum() / k,
                 "n_tokens": mask.sum()}
        return loss, stats


def main(argv: list[str] | None = None) -> int:
    from areal_mega.trainer.loop import run
    from areal_mega.trainer.main import build, parse_args

    trainer = build(parse_args(argv))
    trainer.policy_loss = SequenceRatioLoss  # the one line this experiment changes
    return run(trainer)


if __name__ == "__main__":
    sys.exit(main())

"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds the logits of its vocabulary slice; per token, all-reduces over the TP group of
the max m, Z = sum exp(z - m) and the label's z_y - m (plus E_s for the entropy) give
logp(y) = z_y - m - log Z and H = log Z - E_s. The backward needs no communication, and no
[N, V] tensor ever exists. The math and its gradients: docs/engine.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, with_entropy, num_valid):
        width = logits.shape[-1]
        z = logits if logits.dtype == torch.float64 else logits.float()  # fp64 for gradcheck
        # Megatron pads the vocab with zero rows: their logit is 0, not -inf, and would add
        # exp(0 - m) per padded id to Z. Drop them (a rank may even hold only padding).
        z = z[..., :num_valid]
        if num_valid > 0:
            m = z.max(dim=-1).values
        else:
            m = torch.full(labels.shape, float("-inf"), dtype=z.dtype, device=z.device)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        s = z - m.unsqueeze(-1)
        sum_exp = _all_reduce(s.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
        log_z = sum_exp.log()
        local = labels - vocab_start
        owned = (local >= 0) & (local < num_valid)
        idx = local.clamp(0, max(num_valid - 1, 0)).unsqueeze(-1)
        if num_valid > 0:
            z_y = torch.where(owned, s.gather(-1, idx).squeeze(-1), torch.zeros_like(m))
        else:
            z_y = torch.zeros_like(m)
        _all_reduce(z_y, dist.ReduceOp.SUM, group)
        logp = z_y - log_z
        if with_entropy:
            p = (s - log_z.unsqueeze(-1)).exp()
            e_s = _all_reduce((p * s).sum(dim=-1), dist.ReduceOp.SUM, group)
            entropy = log_z - e_s
        else:
            e_s = torch.zeros_like(m)
            entropy = torch.zeros_like(m)
        ctx.save_for_backward(s, log_z, e_s, idx, owned)
        ctx.with_entropy = with_entropy
        ctx.in_dtype = logits.dtype
        ctx.width = width
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        s, log_z, e_s, idx, owned = ctx.saved_tensors
        g_full = torch.zeros((*s.shape[:-1], ctx.width), dtype=s.dtype, device=s.device)
        g = g_full[..., : s.shape[-1]]  # padded vocab columns get zero gradient
        p = (s - log_z.unsqueeze(-1)).exp()
        if grad_logp is not None:
            g -= grad_logp.unsqueeze(-1) * p
            if s.shape[-1] > 0:
                g.scatter_add_(-1, idx, (grad_logp * owned.to(g.dtype)).unsqueeze(-1))
        if ctx.with_entropy and grad_entropy is not None:
            g -= grad_entropy.unsqueeze(-1) * p * (s - e_s.unsqueeze(-1))
        return g_full.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Any = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[label]`` and the entropy of that distribution.

    ``logits`` [..., V/tp] is this rank's vocab slice (the full vocab when ``tp_group`` is None
    or has one rank); ``labels`` [...] are global vocab ids. ``vocab_start`` defaults to
    ``tp_rank * V/tp`` (megatron's VocabUtility layout). ``vocab_size``: the real vocabulary;
    ids at or past it are padding columns and are excluded from the softmax. Returns fp32 tensors shaped like
    ``labels``; the entropy is zeros (and not differentiable) when ``with_entropy`` is False.
    """
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    if vocab_start is None:
        rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
        vocab_start = rank * logits.shape[-1]
    if temperature != 1.0:
        logits = logits / temperature
    width = logits.shape[-1]
    num_valid = width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))
    return _VocabParallelLogProbs.apply(logits, labels.long(), vocab_start, tp_group, with_entropy, num_valid)

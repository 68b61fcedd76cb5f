"""Context parallelism on the learner: a packed row split over the CP ranks (docs/context_parallel.md).

    shard = context_shard(mb["cu_seqlens"], cp, cp_rank, padded_len)    # batching/packing.py
    inputs = context_inputs(mb, shard)          # this rank's tokens, routes, the ContextShard
    out = chunk(ids, pos, None, packed_seq_params=packed_seq_params(shard, dev, cp_group))
    lp = gather_tokens(lp_local, shard, cp_group)    # [T] row order, same on every CP rank

Rank r holds chunks r and 2cp-1-r of every sequence (megatron's THD split); every CP rank then
evaluates the SAME micro-batch loss as at CP1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from areal_mega.batching.packing import PAD_TOKEN_ID, ContextShard

# torch 2.13 renames these (the old names warn FutureWarning); the same collectives
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGatherSequence(torch.autograd.Function):
    """[t, ...] per rank -> [cp * t, ...] (rank order); backward: reduce-scatter (sum) of the
    gradient, so each rank receives d(sum of every rank's loss)/d(its own rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """K or V of this CP rank's tokens [t, ...] -> every rank's, rank 0's first [cp * t, ...]."""
    return _AllGatherSequence.apply(x, group)


class _GatherTokens(torch.autograd.Function):
    """This rank's per-token values [t_local] -> the row's real tokens [T] in row order. Every CP
    rank then evaluates the same loss, so the backward keeps this rank's rows of the gradient and
    needs no communication."""

    @staticmethod
    def forward(ctx, x, shard: ContextShard, group):
        ctx.shard = shard
        parts = x.new_empty((shard.cp * x.shape[0], *x.shape[1:]))
        _all_gather(parts, x.contiguous(), group=group)
        row = x.new_zeros((shard.padded_len, *x.shape[1:]))
        row[shard.all_index().to(x.device)] = parts
        return row[shard.real_pos.to(x.device)]

    @staticmethod
    def backward(ctx, grad):
        return ctx.shard.to_local(grad, 0), None, None


def gather_tokens(x: torch.Tensor, shard: ContextShard, group: Any) -> torch.Tensor:
    """Per-token outputs of this CP rank [t_local, ...] -> the real tokens [T, ...] in row order
    (identical on every CP rank; autograd-correct when every CP rank uses the result alike)."""
    return _GatherTokens.apply(x, shard, group)


def context_inputs(mb: dict[str, torch.Tensor], shard: ContextShard) -> dict[str, Any]:
    """The model inputs of this CP rank for micro-batch ``mb`` (padded-row order, see
    ContextShard): tokens (pads: PAD_TOKEN_ID), routing replay's routes (pads: -1, no route),
    the real ``cu_seqlens`` and the shard itself (``context_shard``, for the forward)."""
    out: dict[str, Any] = {"input_ids": shard.to_local(mb["input_ids"], PAD_TOKEN_ID),
                           "cu_seqlens": mb["cu_seqlens"], "context_shard": shard}
    if "routed_experts" in mb:
        out["routed_experts"] = shard.to_local(mb["routed_experts"], -1)
    return out


def packed_seq_params(shard: ContextShard, device: torch.device, cp_group: Any):
    """megatron's THD ``PackedSeqParams`` for this shard: real and padded cu_seqlens over the whole
    row (transformer-engine's convention under CP; megatron's RoPE reads the padded ones), the
    longest padded sequence, the CP group."""
    from megatron.core.packed_seq_params import PackedSeqParams

    real = shard.cu_real.to(device, torch.int32)
    padded = shard.cu_padded.to(device, torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=shard.max_seqlen,
                           max_seqlen_kv=shard.max_seqlen, cp_group=cp_group)

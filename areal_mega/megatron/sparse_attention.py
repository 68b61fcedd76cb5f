"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) on megatron-core 0.16.1's DSA modules.

:class:`PackedDSAttention` is megatron's ``DSAttention`` (its ``DSAIndexer`` unchanged) with a
forward for this project's packed rows (the learner's block-causal mask; THD needs the TE spec):
megatron's ``unfused_dsa_fn`` masks with a plain upper-triangular causal mask, so a query of a
packed row whose top-k reaches past its own sequence start would attend to the previous
sequence. Here the indexer scores and the sparse attention both take the row's block-causal mask
(HF masks both with its causal mask: equal per sequence). The indexer is frozen (docs/engine.md
"DeepSeek sparse attention"): it runs under no_grad and no indexer KL loss is built -- megatron's
forward would materialise the dense [b, heads, s, s] attention for it on every training step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec


class IndexerLinear(torch.nn.Module):
    """A full (replicated on every TP rank) ``y = x W^T`` with megatron's linear-module signature
    and return value; megatron's local backend has no plain ``linear()`` (0.16.1)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, parallel_mode: Any = None,
                 **_: Any):
        super().__init__()
        if bias:
            raise ValueError("IndexerLinear: the DSA indexer's projections have no bias")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return F.linear(x, self.weight), None


class IndexerWeightsProj(IndexerLinear):
    """The indexer's per-head weights ``weights_proj`` computed in fp32 whatever the params' dtype:
    HF keeps it an fp32 module (``_keep_in_fp32_modules``) and casts the hidden state up to it."""

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return F.linear(x.float(), self.weight.float()), None


class IndexerKNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm (weight and bias) with HF's eps 1e-6 whatever the model's
    rms_norm_eps (DeepseekV32Indexer: ``nn.LayerNorm(head_dim, eps=1e-6)``; GLM-5's rms eps is
    1e-5); torch's LayerNorm, which megatron's local norm refuses under sequence parallelism."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__(hidden_size, eps=1e-6, dtype=config.params_dtype)


def dsa_core_attention_spec() -> ModuleSpec:
    """ModuleSpec of :class:`PackedDSAttention` with megatron's DSAIndexer on the modules above."""
    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKNorm, linear_weights_proj=IndexerWeightsProj))
    return ModuleSpec(module=PackedDSAttention, submodules=DSAttentionSubmodules(indexer=indexer))


class PackedDSAttention(DSAttention):
    """megatron's DSAttention with the forward described in the module doc (frozen indexer,
    the packed row's block-causal mask in the indexer and the sparse attention)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], x: Tensor,
                qr: Tensor, attn_mask_type: Any = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        """query [sq, b, np, dk], key [sk, b, np, dk], value [sk, b, np, dv], attention_mask
        [b or 1, 1, sq, sk] (True = masked: the packed row's block-causal mask), x [s(/tp), b, h] and
        qr [s(/tp), b, q_lora] (the normalised q latent) -> [sq, b, np * dv]."""
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by PackedDSAttention")
        if packed_seq_params is not None:  # THD needs the TE spec, CP is refused: the learner passes masks
            raise ValueError("packed_seq_params: not supported by PackedDSAttention (the local spec's mask path)")
        if attention_mask is None:
            sq = query.size(0)
            attention_mask = torch.ones(sq, sq, dtype=torch.bool).triu(1).view(1, 1, sq, sq)
        sq, b, np_, _ = query.shape
        sk = key.size(0)
        float_mask = torch.zeros(attention_mask.shape, dtype=torch.float32, device=query.device).masked_fill(
            attention_mask.to(query.device), float("-inf")).expand(b, 1, sq, sk)[:, 0]  # [b, sq, sk]
        with torch.no_grad():  # frozen: the selection is discrete, no gradient reaches the indexer anyway
            _, topk = self.indexer.forward_with_scores(x.detach(), qr.detach(), mask=float_mask)
        # unfused_dsa_fn's operations, with the row's block-causal mask in place of its triu
        index_mask = torch.full((b, sq, sk), float("-inf"), device=query.device).scatter_(-1, topk, 0)
        index_mask += float_mask
        q = query.permute(1, 2, 0, 3).reshape(b * np_, sq, -1)
        k = key.permute(1, 2, 3, 0).reshape(b * np_, -1, sk)
        scores = torch.bmm(q.float(), k.float()) * self.softmax_scale
        scores = scores.reshape(b, np_, sq, sk) + index_mask.unsqueeze(1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        dv = value.size(3)
        v = value.permute(1, 2, 0, 3).reshape(b * np_, sk, dv)
        out = torch.bmm(probs.reshape(b * np_, sq, sk).to(v.dtype), v)
        out = out.reshape(b, np_, sq, dv).permute(2, 0, 1, 3).reshape(sq, b, np_ * dv)
        return out


def freeze_indexers(chunks: list[torch.nn.Module]) -> int:
    """requires_grad=False on every DSA indexer parameter (megatron's DDP and optimizer then skip
    them); returns how many."""
    n = 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if ".core_attention.indexer." in name:
                p.requires_grad_(False)
                n += 1
    return n

"""The project's core attention for megatron-core's local layer spec (CPU, or GPU without TE).

:class:`CoreAttention` replaces megatron's local ``DotProductAttention`` through the layer spec
(:func:`with_core_attention`): any q/k and v head sizes (MLA), GQA, boolean or packed-THD causal
masks (:func:`block_causal_mask`), and under context parallelism K/V all-gathered over the CP
group with masks on global token indices. Invariant: the same operations in the same order as
``DotProductAttention``, so where both run the outputs are bit-identical. Why and how:
docs/engine.md, docs/context_parallel.md.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor


def block_causal_mask(cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor | None = None, *,
                      q_index: Tensor | None = None, k_index: Tensor | None = None) -> Tensor:
    """Boolean mask [1, 1, sq, sk], True = masked (megatron's convention), for packed sequences.

    Token ``i`` of the query rows attends to key ``j`` iff both lie in the same sequence and
    ``j <= i`` in the packed row's global order. ``cu_seqlens_*`` = [0, l0, l0+l1, ...] over the
    full packed row; ``q_index`` / ``k_index`` (default: all tokens) are the global positions of
    the rows actually present (a context-parallel rank's chunk; all-gathered K/V = all of them).
    Tokens past ``cu_seqlens[-1]`` (padding) attend only to themselves.
    """
    cu_q = cu_seqlens_q.to("cpu", torch.long)
    cu_k = cu_q if cu_seqlens_kv is None else cu_seqlens_kv.to("cpu", torch.long)
    if not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seqlens_kv: must equal cu_seqlens_q for causal self-attention")
    total = int(cu_q[-1])
    qi = torch.arange(total) if q_index is None else q_index.to("cpu", torch.long)
    ki = torch.arange(total) if k_index is None else k_index.to("cpu", torch.long)
    n = int(max(int(qi.max()) if qi.numel() else 0, int(ki.max()) if ki.numel() else 0, total - 1)) + 1
    seq = torch.full((n,), -1, dtype=torch.long)
    for s in range(len(cu_q) - 1):
        seq[cu_q[s]: cu_q[s + 1]] = s
    pad = seq < 0
    seq[pad] = -1 - torch.arange(int(pad.sum()))  # each padding token is its own "sequence"
    allowed = (seq[qi][:, None] == seq[ki][None, :]) & (ki[None, :] <= qi[:, None])
    return (~allowed).view(1, 1, len(qi), len(ki))


class CoreAttention(torch.nn.Module):
    """softmax(scale * q k^T + mask) v for megatron's attention modules (see the module doc).

    Constructor and forward signatures are the ones megatron's ``SelfAttention`` and
    ``MLASelfAttention`` call their ``core_attention`` submodule with (0.16.1)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None):
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.utils import attention_mask_func

        super().__init__()
        self.config = config
        self.cp_group = None if pg_collection is None else getattr(pg_collection, "cp", None)
        if config.context_parallel_size > 1:
            if self.cp_group is None or self.cp_group.size() != config.context_parallel_size:
                raise ValueError("context_parallel_size: CoreAttention needs the CP group (pg_collection.cp)")
            if cp_comm_type not in (None, "all_gather"):
                raise ValueError(f"actor.model.cp_comm_type: {cp_comm_type!r} is not implemented by the local "
                                 "spec's CoreAttention (all_gather only; p2p / a2a need transformer-engine)")
        from megatron.core.transformer.utils import is_layer_window_attention

        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "learnable"):
            raise ValueError(f"softmax_type: {softmax_type!r} is not supported by CoreAttention (vanilla, learnable)")
        window = getattr(config, "window_size", None)
        if window is not None and (window[1] != 0 or window[0] < 0):
            raise ValueError(f"window_size: {window} is not supported by CoreAttention (only (left >= 0, 0), causal)")
        tp = 1 if pg_collection is None else pg_collection.tp.size()
        self.tp_group = None if pg_collection is None else pg_collection.tp
        # Sliding window: a band AND-ed into the packed block-causal mask (megatron's torch softmax
        # would replace the mask by an unpacked window mask, fused_softmax.py:321); ``layer_number``
        # is global (megatron adds the pipeline offset), as is_layer_window_attention wants.
        self.window_left = (window[0] if is_layer_window_attention(window, config.window_attn_skip_freq,
                                                                   max(1, layer_number)) else None)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) and num_query_groups "
                             f"({config.num_query_groups}) must divide by tensor parallel size {tp}")
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.softmax_scale = 1.0 / math.sqrt(self.k_channels) if softmax_scale is None else softmax_scale
        coeff = None
        if config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.softmax_scale /= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=config.fp16, input_in_bf16=config.bf16, attn_mask_type=attn_mask_type,
            scaled_masked_softmax_fusion=False, mask_func=attention_mask_func,
            softmax_in_fp32=config.attention_softmax_in_fp32, scale=coeff, window_size=None)
        self.attention_dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None
                                                  else attention_dropout)
        self.softmax_offset = None
        if softmax_type == "learnable":  # attention sinks: megatron's name and TP sharding (heads)
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            self.softmax_offset = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Any = None) -> Tensor:
        """query [sq, b, np, dk], key [sk, b, ng, dk], value [sk, b, ng, dv] (THD: no b axis)
        -> [sq, b, np * dv] (THD: [t, np * dv])."""
        from megatron.core import tensor_parallel

        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by CoreAttention")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cp = self.config.context_parallel_size
        if cp > 1:
            if not thd or packed_seq_params.cu_seqlens_q_padded is None:
                raise ValueError("context_parallel_size > 1: CoreAttention needs THD packed_seq_params with "
                                 "cu_seqlens_q_padded (the engine's context_parallel.packed_seq_params)")
            from areal_mega.batching.packing import context_shard_index
            from areal_mega.megatron.context_parallel import all_gather_sequence

            cu = packed_seq_params.cu_seqlens_q_padded
            key, value = all_gather_sequence(key, self.cp_group), all_gather_sequence(value, self.cp_group)
            q_index = context_shard_index(cu, cp, self.cp_group.rank())
            k_index = torch.cat([context_shard_index(cu, cp, r) for r in range(cp)])
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            attention_mask = block_causal_mask(cu, cu, q_index=q_index, k_index=k_index).to(query.device)
        elif thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            attention_mask = block_causal_mask(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv,
                                               ).to(query.device)
        elif packed_seq_params is not None:
            raise ValueError(f"packed_seq_params.qkv_format: {packed_seq_params.qkv_format!r} is not supported (thd)")
        if self.window_left is not None:
            attention_mask = self._with_window(attention_mask, query.size(0), key.size(0), query.device,
                                               q_index if cp > 1 else None, k_index if cp > 1 else None)
        rep = query.size(2) // key.size(2)
        if rep > 1:  # GQA: each K/V head serves rep consecutive query heads (megatron's order)
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        sq, b, npart = query.size(0), query.size(1), query.size(2)
        sk = key.size(0)
        q = query.reshape(sq, b * npart, -1)
        k = key.reshape(sk, b * npart, -1)
        scores = torch.baddbmm(torch.empty(b * npart, sq, sk, dtype=q.dtype, device=q.device),
                               q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, npart, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        dv = value.size(3)
        v = value.reshape(sk, b * npart, dv)
        ctx = torch.bmm(probs.view(b * npart, sq, sk), v.transpose(0, 1)).view(b, npart, sq, dv)
        ctx = ctx.permute(2, 0, 1, 3).contiguous().view(sq, b, npart * dv)
        return ctx[:, 0] if thd else ctx

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The sinks TP-sharded on heads, as megatron's DotProductAttention keys them (a plain
        module's default would store each TP rank's shard as a replica)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def _with_window(self, mask: Optional[Tensor], sq: int, sk: int, device: Any,
                     q_index: Tensor | None, k_index: Tensor | None) -> Tensor:
        """``mask`` (True = masked; None = plain causal) also masking keys ``window_left`` or more
        tokens before the query: positions are the packed row's (or CP's global) indices, and
        inside one sequence their difference is the in-sequence distance."""
        qi = torch.arange(sq, device=device) if q_index is None else q_index.to(device)
        ki = torch.arange(sk, device=device) if k_index is None else k_index.to(device)
        band = (qi[:, None] - ki[None, :]) > self.window_left
        if mask is None:
            mask = ki[None, :] > qi[:, None]
        return mask | band.view(1, 1, sq, sk)


def with_core_attention(layer_spec: Any) -> Any:
    """``layer_spec`` (a local-spec TransformerLayer ModuleSpec) with :class:`CoreAttention` as
    its self-attention's ``core_attention`` (a copy; the input is not modified)."""
    import copy

    spec = copy.deepcopy(layer_spec)
    spec.submodules.self_attention.submodules.core_attention = CoreAttention
    return spec

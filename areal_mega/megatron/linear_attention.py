"""Qwen3.5 / Qwen3-Next hybrid block on the local spec, and gated DeltaNet over packed rows.

The learner packs several sequences into one row with a block-diagonal causal mask
(model.packed_causal_mask). Softmax attention honours the mask; a recurrence does not: megatron-core
0.16.1's GatedDeltaNet ignores ``attention_mask`` and refuses ``packed_seq_params``, so its conv
window and recurrent state would run across sequence boundaries. :class:`PackedGatedDeltaNet` reads
the boundaries off the mask (token i starts a sequence iff it may not see token i-1) and runs the
conv and the recurrence once per sequence, so every sequence starts from a zero conv/recurrent
state; in_proj and out_proj run once over the row. Trailing one-token "sequences" (padding attends
only to itself) are merged: they follow every real token, so merging them changes nothing that is
read. Under sequence parallelism the layer's input and output are the rank's sequence shard
[s/tp, b, h]: megatron's column-parallel in_proj all-gathers the row, the per-sequence part sees the
whole row (the mask is full length), the row-parallel out_proj reduce-scatters it back.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet


def segment_starts(attention_mask: torch.Tensor | None, seq_len: int) -> list[int]:
    """Start offsets of the packed sequences in a [.., T, T] mask (True = masked); [0] when None."""
    if attention_mask is None:
        return [0]
    m = attention_mask.reshape(-1, seq_len, seq_len)[0]
    idx = torch.arange(1, seq_len)
    starts = [0] + (idx[m[idx, idx - 1]]).tolist()
    ends = starts[1:] + [seq_len]
    j = len(starts)
    while j > 0 and ends[j - 1] - starts[j - 1] == 1:
        j -= 1  # trailing one-token segments = padding: one segment (see the module docstring)
    return starts[: j + 1]


class _Projected(torch.nn.Module):
    """Stands in for in_proj / out_proj while megatron's forward runs on one sequence of a row
    that PackedGatedDeltaNet projects as a whole: returns (input, no bias)."""

    def forward(self, x):
        return x, None


class PackedGatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet with its state reset at every packed-sequence boundary, under
    sequence parallelism too, and (compat entry 14) its out_norm's gradient summed over TP."""

    def _apply_gated_norm(self, x, gate):
        from areal_mega.megatron import compat

        # under SP out_norm's weight is marked sequence_parallel (compat.SequenceParallelRMSNorm):
        # finalize_model_grads sums its gradient over TP itself
        if self.tp_size == 1 or self.config.sequence_parallel or not compat.applies(14):
            return super()._apply_gated_norm(x, gate)
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        # megatron's _apply_gated_norm, with out_norm's weight (shared by every value head, each TP
        # rank holding some heads) passed through an identity whose backward all-reduces over TP
        n = self.out_norm
        w = copy_to_tensor_model_parallel_region(n.weight, group=self.pg_collection.tp)
        y = torch.nn.functional.rms_norm(x.reshape(-1, x.shape[-1]), n.normalized_shape, w, n.eps)
        y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
        return y.to(x.dtype)

    @contextlib.contextmanager
    def _per_sequence(self):
        """megatron's forward without its projections, on one sequence of the projected full row."""
        saved = self.in_proj, self.out_proj, self.sp_size
        self.in_proj, self.out_proj, self.sp_size = _Projected(), _Projected(), 1
        try:
            yield
        finally:
            self.in_proj, self.out_proj, self.sp_size = saved

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        seq_len = hidden_states.shape[0] * self.sp_size  # under SP the input is this rank's shard
        starts = segment_starts(attention_mask, seq_len)
        if len(starts) == 1:
            return super().forward(hidden_states, None, *args, **kwargs)
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, in_proj / tp]: under SP all-gathered first
        ends = starts[1:] + [seq_len]
        with self._per_sequence():
            outs = [super(PackedGatedDeltaNet, self).forward(qkvzba[s:e], None, *args, **kwargs)[0]
                    for s, e in zip(starts, ends)]
        return self.out_proj(torch.cat(outs, dim=0))  # under SP reduce-scattered to the shard


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with weight stored as w and applied as (1 + w), in fp32 (Qwen3.5 / Qwen3-Next's
    Qwen3_5RMSNorm); megatron's local torch norm refuses ``layernorm_zero_centered_gamma``, and
    storing 1 + w instead would make the HF round trip inexact."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # under SP each TP rank normalises its sequence shard: finalize_model_grads sums the grads
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def qwen3_5_block_spec(layer_types, tcfg=None, vp_stage: int | None = None, pp_rank: int | None = None,
                       num_experts: int | None = None, dense_layers: tuple[int, ...] = ()):
    """The hybrid decoder block (local spec): gated DeltaNet layers and gated full-attention
    layers per HF ``layer_types`` (one per GLOBAL layer), every RMSNorm zero-centred except GDN's
    gated out_norm; ``num_experts``: every layer's MLP but ``dense_layers``' is megatron's MoE layer
    (SequentialMLP experts). With ``tcfg``: only the layers of that pipeline chunk (megatron's split)."""
    import copy

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from areal_mega.megatron import compat

    b = LocalSpecProvider()
    # GDN's gated out_norm: megatron's WrappedTorchNorm asserts no SP; the same torch RMSNorm marked
    # sequence_parallel (compat entry 9)
    out_norm = compat.SequenceParallelRMSNorm if compat.applies(9) else b.layer_norm(rms_norm=True)
    specs = []
    for i, t in enumerate(layer_types):
        if t not in ("linear_attention", "full_attention"):
            raise ValueError(f"layer_types: {t!r} is not linear_attention or full_attention")
        experts = None if i in dense_layers else num_experts
        s = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True, num_experts=experts,
                                                   moe_grouped_gemm=False))
        s.submodules.input_layernorm = s.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
        attn = s.submodules.self_attention
        if t == "linear_attention":
            s.submodules.self_attention = ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=b.column_parallel_linear(), out_norm=out_norm, out_proj=b.row_parallel_linear()))
        else:
            attn.submodules.q_layernorm = attn.submodules.k_layernorm = ZeroCenteredRMSNorm
        specs.append(s)
    if tcfg is not None:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        n = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
        off = get_transformer_layer_offset(tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
        specs = specs[off:off + n]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=ZeroCenteredRMSNorm)

"""Qwen3.5 (text) HF <-> megatron-core names and shapes: gated DeltaNet, gated attention, whole model.

Registered families: ``qwen3_5_text`` (Qwen3_5ForCausalLM) and ``qwen3_5`` (the released
vision-language checkpoints: the language model only, the vision tower copied through exports).
Exactness (TP1/TP2/PP2 vs transformers), refusals and serving: docs/engine.md "Qwen3.5 / Qwen3-Next".

Layout (transformers 5.19 vs megatron-core 0.16.1, TP=1): megatron's GatedDeltaNet fuses HF's
four input projections into one ``in_proj`` = rows [qkv; z; b; a], qkv rows [q; k; v] in both;
``conv1d``, ``A_log``, ``dt_bias`` keep their names; HF's gated RMSNorm ``norm`` (plain weight,
not 1 + w) is ``out_norm``. Gated attention: HF q_proj rows per head [q; gate], megatron's
``attention_output_gate`` rows per query group [q heads; gate heads; k; v].
"""

from __future__ import annotations

import logging

import torch

from areal_mega.models.base import Block, _Rule, LinearAttnArch, McoreParam, ModelAdapter, ModelArch, StagePlan
from areal_mega.models.qwen3 import _DENSE, refuse_unknown_keys
from areal_mega.models.registry import register_family
from areal_mega.models.vision_language import VisionLanguageAdapter

logger = logging.getLogger(__name__)
_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
def gated_qkv_hf_to_mcore(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor,
                          num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF gated attention's q_proj (rows per head [q; gate]) + k/v -> megatron's ``linear_qkv``
    with ``attention_output_gate``: rows per query group [q heads; gate heads; k; v] (TP=1)."""
    h = q_proj.shape[-1]
    qg = q_proj.view(num_kv_heads, -1, 2, head_dim, h)  # [group, head in group, (q, gate), d, h]
    k, v = k_proj.view(num_kv_heads, 1, head_dim, h), v_proj.view(num_kv_heads, 1, head_dim, h)
    per_group = [qg[:, :, 0].flatten(1, 2), qg[:, :, 1].flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2)]
    return torch.cat(per_group, dim=1).reshape(-1, h)


def gated_qkv_mcore_to_hf(w: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`gated_qkv_hf_to_mcore`: (q_proj, k_proj, v_proj)."""
    h = w.shape[-1]
    g = w.view(num_kv_heads, -1, head_dim, h)
    hpg = (g.shape[1] - 2) // 2
    q, gate, k, v = g[:, :hpg], g[:, hpg:2 * hpg], g[:, 2 * hpg], g[:, 2 * hpg + 1]
    q_proj = torch.stack([q, gate], dim=2).reshape(-1, h)
    return q_proj, k.reshape(-1, h), v.reshape(-1, h)


# ---- the registered families (one adapter: live sync, conversion tools, loading) -----------------

_LINEAR = {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
           "linear_num_value_heads", "layer_types", "partial_rotary_factor",
           # written by the released checkpoints' configs; checked below
           "full_attention_interval", "attn_output_gate", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
_ROPE_OK = {"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


@register_family
class Qwen3_5TextAdapter(ModelAdapter):
    """Qwen3.5 text model (Qwen3_5ForCausalLM): gated DeltaNet layers and gated full-attention
    layers per ``layer_types``, zero-centred RMSNorms, partial rotary, dense SwiGLU MLP.
    Local layer spec only (megatron/linear_attention.py); see docs/engine.md "Qwen3.5"."""

    model_type = "qwen3_5_text"
    architecture = "Qwen3_5ForCausalLM"
    sglang_layout = None  # SGLang cannot serve it on CPU (docs/engine.md): broadcast sync only
    known_keys = _DENSE | _LINEAR

    def parse_config(self, c: dict) -> ModelArch:
        refuse_unknown_keys({k: v for k, v in c.items() if k != "layer_types"}, self.known_keys, self.model_type)
        rope = dict(c.get("rope_parameters") or {})
        extra = sorted(set(rope) - _ROPE_OK)
        if extra:
            raise ValueError(f"rope_parameters.{extra[0]}: not implemented by the {self.model_type} adapter")
        # mrope: text-only inputs give the three position streams the same ids = plain RoPE.
        kinds = tuple(c.get("layer_types") or ())
        n = int(c["num_hidden_layers"])
        if len(kinds) != n or set(kinds) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types: need {n} entries of linear_attention / full_attention, got {list(kinds)}")
        every = c.get("full_attention_interval")
        if every is not None and kinds != tuple("full_attention" if (i + 1) % int(every) == 0 else "linear_attention"
                                               for i in range(n)):
            raise ValueError(f"full_attention_interval: {every} disagrees with layer_types")
        if c.get("attn_output_gate", True) is not True:
            raise ValueError("attn_output_gate: false (ungated full attention) is not supported for "
                             f"{self.model_type}; only true")
        if int(c.get("mtp_num_hidden_layers") or 0):
            logger.warning("%s: mtp_num_hidden_layers=%s multi-token-prediction layer(s) dropped (not built, trained, "
                           "synced or exported; see docs/engine.md)", self.model_type, c["mtp_num_hidden_layers"])
        arch = super().parse_config({**c, "layer_types": None})
        lin = LinearAttnArch(kinds, int(c["linear_conv_kernel_dim"]), int(c["linear_key_head_dim"]),
                             int(c["linear_value_head_dim"]), int(c["linear_num_key_heads"]),
                             int(c["linear_num_value_heads"]))
        rp = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        return ModelArch(**{**arch.__dict__, "qk_layernorm": True, "rotary_percent": rp, "linear": lin,
                            "attention_output_gate": True})

    # ---- names and shapes ----------------------------------------------------------------------
    def layer_rules(self, spec="local", layer=0):
        if spec != "local":
            raise ValueError(f"actor.model.layer_spec: {spec!r} is not supported for {self.model_type} (its hybrid "
                             "block is built on the local spec); set local")
        rules = [_Rule("input_layernorm.weight", ("input_layernorm.weight",), None, "none")]
        if self.arch.linear.is_linear(layer):
            L, S = "linear_attn.", "self_attention."
            rules += [
                _Rule(S + "in_proj.weight", tuple(f"{L}{p}.weight" for p in _PARTS), 0, "parts"),
                _Rule(S + "conv1d.weight", (L + "conv1d.weight",), 0, "parts"),
                _Rule(S + "A_log", (L + "A_log",), 0, "none"),
                _Rule(S + "dt_bias", (L + "dt_bias",), 0, "none"),
                _Rule(S + "out_norm.weight", (L + "norm.weight",), None, "none"),
                _Rule(S + "out_proj.weight", (L + "out_proj.weight",), 1, "none"),
            ]
        else:
            rules += [
                _Rule("self_attention.linear_qkv.weight",
                      ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), 0, "gated_qkv"),
                _Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), None, "none"),
                _Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), None, "none"),
                _Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), 1, "none"),
            ]
        rules.append(_Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None, "none"))
        if self.arch.is_moe_layer(layer):  # router, gated shared expert (base rules; routed experts: expert_params)
            return rules + [r for r in super().layer_rules("local", layer)
                            if r.mcore.startswith("mlp.") and not r.mcore.startswith("mlp.linear_fc")]
        return rules + [
            _Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0, "gate_up"),
            _Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), 1, "none"),
        ]

    def _leaf_shapes(self):
        a, g = self.arch, self.arch.linear
        h, kd, vd, nv = a.hidden_size, g.key_dim, g.value_dim, g.num_value_heads
        return {**super()._leaf_shapes(),
                "self_attn.q_proj.weight": (2 * a.num_heads * a.head_dim, h),
                "linear_attn.in_proj_qkv.weight": (2 * kd + vd, h),
                "linear_attn.in_proj_z.weight": (vd, h),
                "linear_attn.in_proj_b.weight": (nv, h),
                "linear_attn.in_proj_a.weight": (nv, h),
                "linear_attn.conv1d.weight": (2 * kd + vd, 1, g.conv_kernel),
                "linear_attn.A_log": (nv,),
                "linear_attn.dt_bias": (nv,),
                "linear_attn.norm.weight": (g.value_head_dim,),
                "linear_attn.out_proj.weight": (h, vd)}

    def mcore_shape(self, leaf):
        a, g = self.arch, self.arch.linear
        h, kd, vd, nv = a.hidden_size, g.key_dim, g.value_dim, g.num_value_heads
        full = {"self_attention.linear_qkv.weight": (2 * (a.num_heads + a.num_kv_heads) * a.head_dim, h),
                "self_attention.in_proj.weight": (2 * kd + 2 * vd + 2 * nv, h),
                "self_attention.conv1d.weight": (2 * kd + vd, 1, g.conv_kernel),
                "self_attention.A_log": (nv,),
                "self_attention.dt_bias": (nv,),
                "self_attention.out_norm.weight": (g.value_head_dim,),
                "self_attention.out_proj.weight": (h, vd)}
        return full.get(leaf) or super().mcore_shape(leaf)

    def plan(self, layout, **kw) -> list[StagePlan]:
        g = self.arch.linear
        for what, n in (("linear_num_key_heads", g.num_key_heads), ("linear_num_value_heads", g.num_value_heads)):
            if n % layout.tp:
                raise ValueError(f"parallel layout: {what}({n}) % tp({layout.tp}) != 0")
        return super().plan(layout, **kw)

    # ---- the two fusions of this family ----------------------------------------------------------
    def row_parts(self, prm: McoreParam) -> list[tuple[int, ...]]:
        """Per HF tensor of a "parts" param: its row parts, each split over TP on its own
        (megatron's GatedDeltaNet shard = [q_r; k_r; v_r; z_r; b_r; a_r], conv1d [q_r; k_r; v_r])."""
        g = self.arch.linear
        kd, vd, nv = g.key_dim, g.value_dim, g.num_value_heads
        if prm.fusion == "grouped":  # the canonical rows [q; k; v; z] and [b; a] of its two HF tensors
            return [(kd, kd, vd, vd), (nv, nv)]
        if prm.name.endswith("in_proj.weight"):
            return [(kd, kd, vd), (vd,), (nv,), (nv,)]
        return [(kd, kd, vd)]

    def _groups(self, t: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Rows [part 0 of every key-head group; part 1 ...] (megatron) from rows per group [part 0;
        part 1; ...] (Qwen3-Next's in_proj_qkvz / in_proj_ba), for however many groups ``t`` holds."""
        g = t.shape[0] // sum(sizes)
        return torch.cat([p.reshape(-1, *t.shape[1:]) for p in torch.split(t.view(g, sum(sizes), *t.shape[1:]), sizes, 1)])

    def _ungroup(self, t: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Inverse of :meth:`_groups`."""
        g = t.shape[0] // sum(sizes)
        parts = torch.split(t, [g * s for s in sizes])
        return torch.cat([p.view(g, s, *t.shape[1:]) for p, s in zip(parts, sizes)], 1).reshape(t.shape)

    def _group_sizes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Rows per key-head group of in_proj_qkvz (q, k, v, z) and in_proj_ba (b, a)."""
        g = self.arch.linear
        r = g.num_value_heads // g.num_key_heads
        return (g.key_head_dim, g.key_head_dim, r * g.value_head_dim, r * g.value_head_dim), (r, r)

    def to_hf(self, prm, canon):
        if prm.fusion == "grouped":
            g = self.arch.linear
            qkvz, ba = torch.split(canon, [2 * g.key_dim + 2 * g.value_dim, 2 * g.num_value_heads])
            return [self._ungroup(qkvz, self._group_sizes()[0]), self._ungroup(ba, self._group_sizes()[1])]
        if prm.fusion == "parts":
            return list(torch.split(canon, [sum(p) for p in self.row_parts(prm)], dim=0))
        if prm.fusion == "gated_qkv":
            return list(gated_qkv_mcore_to_hf(canon, self.arch.num_kv_heads, self.arch.head_dim))
        return super().to_hf(prm, canon)

    def from_hf(self, prm, hf, shape=None):
        if prm.fusion == "grouped":  # whole tensors or a TP rank's whole key-head groups: same rule
            (a, b), (qkvz, ba) = self._group_sizes(), hf
            return torch.cat([self._groups(qkvz, a), self._groups(ba, b)])
        if prm.fusion == "parts":  # whole tensors, or hf_slices' per-part TP slices: rows in shard order
            return torch.cat(hf, dim=0)
        if prm.fusion == "gated_qkv":
            d = self.arch.head_dim
            return gated_qkv_hf_to_mcore(hf[0], hf[1], hf[2], hf[1].shape[0] // d, d)
        return super().from_hf(prm, hf, shape)

    def _part_ranges(self, prm, tp, rank):
        """(hf name, HF row start, rows, local row start) of every part TP rank ``rank`` holds."""
        out, local = [], 0
        for n, parts in zip(prm.hf_names, self.row_parts(prm)):
            off = 0
            for p in parts:
                per = p // tp
                out.append((n, off + rank * per, per, local))
                off, local = off + p, local + per
        return out

    def hf_slices(self, prm, tp, tp_rank):
        if prm.fusion == "grouped" and tp > 1:  # a rank's shard = whole key-head groups = contiguous rows
            return [(n, 0, tp_rank * self.hf_shape(n)[0] // tp, (tp_rank + 1) * self.hf_shape(n)[0] // tp)
                    for n in prm.hf_names]
        if prm.fusion != "parts" or tp == 1:
            return super().hf_slices(prm, tp, tp_rank)
        return [(n, 0, s, s + r) for n, s, r, _ in self._part_ranges(prm, tp, tp_rank)]

    def merge_tp(self, prm, shards):
        if prm.fusion not in ("parts", "grouped") or len(shards) == 1:
            return ModelAdapter.merge_tp(prm, shards)
        tp = len(shards)
        pieces = self._part_ranges(prm, tp, 0)
        return torch.cat([s.narrow(0, lo, r) for _, _, r, lo in pieces for s in shards], dim=0)

    def split_tp(self, prm, canon, tp, tp_rank):
        if prm.fusion not in ("parts", "grouped") or tp == 1:
            return ModelAdapter.split_tp(prm, canon, tp, tp_rank)
        base, rows = 0, []
        for parts in self.row_parts(prm):
            for off, p in _offsets(parts):
                rows.append(canon.narrow(0, base + off + tp_rank * (p // tp), p // tp))
            base += sum(parts)
        return torch.cat(rows, dim=0)

    def shard_blocks(self, prm, tp, tp_rank):
        if prm.fusion == "grouped":  # per key-head group and part: HF rows -> the shard's part rows
            out, local = [], 0
            for n, sizes in zip(prm.hf_names, self._group_sizes()):
                groups = self.arch.linear.num_key_heads // tp
                h = self.hf_shape(n)[1]
                for i, sz in enumerate(sizes):
                    for j in range(groups):
                        start = (tp_rank * groups + j) * sum(sizes) + sum(sizes[:i])
                        out.append(Block(n, ((start, start + sz), (0, h)), (local + j * sz, 0)))
                    local += groups * sz
            return out
        if prm.fusion == "parts" and tp > 1:
            out = []
            for n, s, r, lo in self._part_ranges(prm, tp, tp_rank):
                shape = self.hf_shape(n)
                box = ((s, s + r),) + tuple((0, x) for x in shape[1:])
                out.append(Block(n, box, (lo,) + (0,) * (len(shape) - 1)))
            return out
        if prm.fusion != "gated_qkv":
            return super().shard_blocks(prm, tp, tp_rank)
        a = self.arch
        d, hpg, h = a.head_dim, a.heads_per_group, a.hidden_size
        q, k, v = prm.hf_names
        groups = a.num_kv_heads // tp
        out = []
        for j in range(groups):
            g, base = tp_rank * groups + j, j * (2 * hpg + 2) * d
            for i in range(hpg):
                hh = g * hpg + i
                out += [Block(q, ((2 * hh * d, (2 * hh + 1) * d), (0, h)), (base + i * d, 0)),
                        Block(q, (((2 * hh + 1) * d, (2 * hh + 2) * d), (0, h)), (base + (hpg + i) * d, 0))]
            out += [Block(k, ((g * d, (g + 1) * d), (0, h)), (base + 2 * hpg * d, 0)),
                    Block(v, ((g * d, (g + 1) * d), (0, h)), (base + (2 * hpg + 1) * d, 0))]
        return out


def _offsets(parts: tuple[int, ...]) -> list[tuple[int, int]]:
    out, off = [], 0
    for p in parts:
        out.append((off, p))
        off += p
    return out


@register_family
class Qwen3_5Adapter(VisionLanguageAdapter, Qwen3_5TextAdapter):
    """The released Qwen3.5 checkpoints (Qwen3_5ForConditionalGeneration): text-only RL on the
    language model (``model.language_model.*`` + ``lm_head``, configured by ``text_config``); the
    vision tower (``model.visual.*``) is not built, trained or synced (the servers keep theirs) and
    an HF export copies it unchanged from the source checkpoint (models/vision_language.py)."""

    model_type = "qwen3_5"
    architecture = "Qwen3_5ForConditionalGeneration"
    lm_prefixes = {"model.": "model.language_model.", "lm_head.": "lm_head."}
    frozen_prefixes = ("model.visual.",)
    vl_keys = frozenset({"vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                         "vision_end_token_id", "tie_word_embeddings"})


_MOE_KEYS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "router_aux_loss_coef", "output_router_logits"}


@register_family
class Qwen3_5MoeTextAdapter(Qwen3_5TextAdapter):
    """Qwen3.5-MoE text model (Qwen3_5MoeForCausalLM): the same hybrid blocks, every layer's MLP a
    softmax top-k router (always renormalised: HF's Qwen3_5MoeTopKRouter) over E SwiGLU experts plus
    one shared expert gated by sigmoid(x . w) (megatron's moe_shared_expert_gate, as Qwen2-MoE).
    Checkpoints keep one tensor per expert (transformers fuses them on load only)."""

    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    hf_shared = "mlp.shared_expert"
    known_keys = Qwen3_5TextAdapter.known_keys | _MOE_KEYS

    def parse_config(self, c: dict) -> ModelArch:
        missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                               "shared_expert_intermediate_size") if c.get(k) is None]
        if missing:
            raise ValueError(f"hf config: missing required MoE key(s) {missing}")
        e, k = int(c["num_experts"]), int(c["num_experts_per_tok"])
        if not 2 <= k <= e:  # top-1 renormalised is a constant 1, which megatron's router does not do
            raise ValueError(f"num_experts_per_tok: {k} is not in [2, num_experts({e})]")
        # no dense MLP: megatron's ffn_hidden_size (unused by MoE layers) = the experts' width
        arch = super().parse_config({**c, "intermediate_size": c.get("intermediate_size", c["moe_intermediate_size"])})
        return ModelArch(**{**arch.__dict__, "num_experts": e, "moe_topk": k,
                            "moe_ffn_hidden_size": int(c["moe_intermediate_size"]), "moe_norm_topk_prob": True,
                            "moe_shared_ffn_hidden_size": int(c["shared_expert_intermediate_size"]),
                            "moe_shared_expert_gate": True})


@register_family
class Qwen3_5MoeAdapter(Qwen3_5Adapter, Qwen3_5MoeTextAdapter):
    """The released Qwen3.5-MoE checkpoints (Qwen3_5MoeForConditionalGeneration): as
    :class:`Qwen3_5Adapter` (language model only, vision tower copied through exports)."""

    model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForConditionalGeneration"


@register_family
class Qwen3NextAdapter(Qwen3_5MoeTextAdapter):
    """Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5-MoE's blocks with the DeltaNet's input
    projections fused per key-head group -- in_proj_qkvz rows per group [q; k; v; z] (the group's
    value heads), in_proj_ba [b; a] -- regrouped into megatron's [q; k; v; z; b; a] ("grouped"
    fusion: a TP rank's whole key-head groups are contiguous rows of both); norm_topk_prob and
    dense layers (decoder_sparse_step, mlp_only_layers) as Qwen2-MoE."""

    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    known_keys = Qwen3_5MoeTextAdapter.known_keys | {"norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}

    def parse_config(self, c: dict) -> ModelArch:
        arch = super().parse_config(c)
        n, k = arch.num_layers, arch.moe_topk
        norm = bool(c.get("norm_topk_prob", True))
        step, only = int(c.get("decoder_sparse_step", 1)), set(c.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)  # HF Qwen3NextDecoderLayer's rule
        if dense and c.get("intermediate_size") is None:
            raise ValueError("intermediate_size: needed by the dense layers (mlp_only_layers / decoder_sparse_step)")
        return ModelArch(**{**arch.__dict__, "moe_norm_topk_prob": norm, "dense_layers": dense,
                            "ffn_hidden_size": int(c.get("intermediate_size") or arch.ffn_hidden_size)})

    def layer_rules(self, spec="local", layer=0):
        rules = super().layer_rules(spec, layer)
        if not self.arch.linear.is_linear(layer):
            return rules
        i = next(j for j, r in enumerate(rules) if r.mcore == "self_attention.in_proj.weight")
        rules[i] = _Rule("self_attention.in_proj.weight",
                         ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"), 0, "grouped")
        return rules

    def _leaf_shapes(self):
        g, h = self.arch.linear, self.arch.hidden_size
        return {**super()._leaf_shapes(), "linear_attn.in_proj_qkvz.weight": (2 * g.key_dim + 2 * g.value_dim, h),
                "linear_attn.in_proj_ba.weight": (2 * g.num_value_heads, h)}

"""Mixtral, Qwen2-MoE, DeepSeek-V3 (V3 / R1 / Moonlight / Kimi-K2 layout) and GLM-4.5 (glm4_moe).

Each family maps its HF config to :class:`ModelArch` (megatron's settings are derived from it in
megatron/model.py ``moe_kwargs`` / ``mla_kwargs``), key by key: a key that changes the network and
is not implemented is refused with a one-line ValueError naming it (``refuse_unknown_keys``).
The expert bias stays at the checkpoint's value; MTP layers are dropped. Routing HF ->
megatron-core 0.16.1: docs/engine.md ("Mixtral, Qwen2-MoE, ..." and "Module notes").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from areal_mega.models.base import MLAArch, ModelAdapter, ModelArch, YarnArch
from areal_mega.models.qwen3 import _DENSE, refuse_unknown_keys
from areal_mega.models.registry import register_family

if TYPE_CHECKING:
    from areal_mega.weight_sync.sglang_layout import EngineRank

logger = logging.getLogger(__name__)


def _req(c: dict, *keys: str) -> None:
    missing = [k for k in keys if c.get(k) is None]
    if missing:
        raise ValueError(f"hf config: missing required MoE key(s) {missing}")


def _topk(c: dict, experts: int) -> int:
    k = int(c["num_experts_per_tok"])
    if not 1 <= k <= experts:
        raise ValueError(f"num_experts_per_tok: {k} is not in [1, num_experts({experts})]")
    return k


def _arch(base: ModelArch, **kw) -> ModelArch:
    return ModelArch(**{**base.__dict__, **kw})


def _mtp_notice(c: dict, model_type: str) -> None:
    n = int(c.get("num_nextn_predict_layers") or 0)
    if n:
        logger.warning("%s: num_nextn_predict_layers=%d multi-token-prediction layer(s) dropped (not built, trained "
                       "or synced; see docs/engine.md)", model_type, n)


@register_family
class MixtralAdapter(ModelAdapter):
    """Mixtral (MixtralForCausalLM): Llama attention, every layer MoE (block_sparse_moe, experts
    w1 = gate, w3 = up, w2 = down), softmax top-k renormalised."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    hf_moe = "block_sparse_moe"
    hf_expert_proj = ("w1", "w3", "w2")
    sglang_layout = None  # SGLang's mixtral.py layout not written here: mode reshard refused, broadcast serves it
    known_keys = _DENSE | {"num_local_experts", "num_experts_per_tok", "router_jitter_noise"}

    def parse_config(self, c: dict) -> ModelArch:
        if c.get("sliding_window") is not None:
            raise ValueError(f"sliding_window: {c['sliding_window']} (sliding-window attention) is not supported; only null "
                             "(it would run with a windowed mask in areal_mega/megatron/attention.py and the adapter passing it)")
        if float(c.get("router_jitter_noise") or 0.0) != 0.0:
            raise ValueError(f"router_jitter_noise: {c['router_jitter_noise']} is not supported (only 0: it makes routing "
                             "random; set it to 0, which HF inference does anyway)")
        refuse_unknown_keys({k: v for k, v in c.items() if k != "sliding_window"}, self.known_keys, self.model_type)
        _req(c, "num_local_experts", "num_experts_per_tok")
        e = int(c["num_local_experts"])
        arch = super().parse_config(c)
        return _arch(arch, num_experts=e, moe_topk=_topk(c, e), moe_ffn_hidden_size=arch.ffn_hidden_size,
                     moe_norm_topk_prob=True)


@register_family
class Qwen2MoeAdapter(ModelAdapter):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias), softmax top-k,
    one gated shared expert, optional dense layers."""

    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    qkv_bias = True
    hf_shared = "mlp.shared_expert"
    sglang_layout = None  # SGLang's qwen2_moe.py layout not written here: mode reshard refused, broadcast serves it
    known_keys = _DENSE | {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"}

    def parse_config(self, c: dict) -> ModelArch:
        refuse_unknown_keys(c, self.known_keys, self.model_type)
        _req(c, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if c.get("qkv_bias", True) is not True:
            raise ValueError(f"qkv_bias: {c['qkv_bias']!r} is not supported for qwen2_moe (only true; it would run with the "
                             "adapter's qkv_bias following the key, as Glm4MoeAdapter's attention_bias does)")
        e, n = int(c["num_experts"]), int(c["num_hidden_layers"])
        k, norm = _topk(c, e), bool(c.get("norm_topk_prob", False))
        if k == 1 and norm:
            raise ValueError("norm_topk_prob: true with num_experts_per_tok 1 is not supported by megatron's router (HF's "
                             "weight is then a constant 1: it would run with a compat entry on megatron's top-k routing)")
        step, only = int(c.get("decoder_sparse_step", 1)), set(c.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step != 0)  # HF Qwen2MoeDecoderLayer's rule
        shared = int(c.get("shared_expert_intermediate_size") or 0)
        arch = super().parse_config({**c, "attention_bias": True})
        return _arch(arch, num_experts=e, moe_topk=k, moe_ffn_hidden_size=int(c["moe_intermediate_size"]),
                     moe_norm_topk_prob=norm, dense_layers=dense, moe_shared_ffn_hidden_size=shared or None,
                     moe_shared_expert_gate=bool(shared))


_SIGMOID_MOE = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                "num_nextn_predict_layers"}


def _sigmoid_routing(c: dict, n_layers: int) -> dict:
    """ModelArch MoE fields for DeepSeek-V3 / GLM-4.5 routing (docs/engine.md, "Module notes")."""
    _req(c, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    e = int(c["n_routed_experts"])
    k, norm = _topk(c, e), bool(c.get("norm_topk_prob", True))
    if k > 1 and not norm:
        raise ValueError(f"norm_topk_prob: false with num_experts_per_tok {k} > 1 is not supported (megatron always "
                         "renormalises sigmoid top-k weights; it would run with a compat entry on "
                         "topk_routing_with_score_function)")
    if k == 1 and norm:
        raise ValueError("norm_topk_prob: true with num_experts_per_tok 1 is not supported by megatron's router (HF's "
                         "weight is then a constant 1: it would run with a compat entry on megatron's top-k routing)")
    groups, gtop = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if groups > 1:
        if e % groups:
            raise ValueError(f"n_group: {groups} does not divide n_routed_experts({e})")
        if not 1 <= gtop <= groups or k // gtop != 2:
            raise ValueError(f"topk_group: {gtop} with num_experts_per_tok {k}: megatron ranks groups by their top "
                             f"num_experts_per_tok // topk_group = {k // max(gtop, 1)} scores, HF by their top 2; only "
                             "configs where that is 2 (e.g. DeepSeek-V3: 8 // 4) are supported (others would run with a "
                             "compat entry making megatron's group score HF's top-2 sum)")
    elif gtop != 1:
        raise ValueError(f"topk_group: {gtop} with n_group 1 is not supported (only 1)")
    first = int(c.get("first_k_dense_replace") or 0)
    if not 0 <= first < n_layers:
        raise ValueError(f"first_k_dense_replace: {first} is not in [0, num_hidden_layers({n_layers}))")
    shared = int(c.get("n_shared_experts") or 0) * int(c["moe_intermediate_size"])
    scale = float(c.get("routed_scaling_factor") or 1.0)
    return dict(num_experts=e, moe_topk=k, moe_ffn_hidden_size=int(c["moe_intermediate_size"]), moe_norm_topk_prob=norm,
                dense_layers=tuple(range(first)), moe_score_function="sigmoid", moe_expert_bias=True,
                moe_router_fp32=True,  # DeepseekV3TopkRouter / Glm4MoeTopkRouter: fp32 logits
                moe_num_groups=groups if groups > 1 else None, moe_group_topk=gtop if groups > 1 else None,
                moe_scaling_factor=scale if scale != 1.0 else None, moe_shared_ffn_hidden_size=shared or None)


@register_family
class DeepseekV3Adapter(ModelAdapter):
    """DeepSeek-V3 / R1 (q_lora_rank set), Moonlight / Kimi-K2 / V2-Lite-like (q_lora_rank null):
    MLA attention, YaRN or plain RoPE on the rope dims (interleaved pairs), dense first layers,
    sigmoid + bias grouped routing, shared experts."""

    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    known_keys = _DENSE | _SIGMOID_MOE | {
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
        "rope_interleave", "pretraining_tp", "scoring_func", "topk_method", "moe_layer_freq", "ep_size",
        "aux_loss_alpha", "seq_aux"}

    def parse_config(self, c: dict) -> ModelArch:
        refuse_unknown_keys(c, self.known_keys, self.model_type)
        _req(c, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1),
                          ("pretraining_tp", 1), ("rope_interleave", True)):
            if key in c and c[key] != want:
                raise ValueError(f"{key}: {c[key]!r} is not supported for deepseek_v3 (only {want!r}, DeepSeek-V3's; "
                                 "another variant needs its own mapping in areal_mega/models/moe_families.py)")
        n = int(c["num_hidden_layers"])
        moe = _sigmoid_routing(c, n)
        _mtp_notice(c, self.model_type)
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rtype = rope.get("rope_type", rope.get("type", "default"))
        yarn = None
        if rtype == "yarn":
            for key in ("attention_factor",):
                if rope.get(key) is not None:
                    raise ValueError(f"rope_parameters.{key}: is not supported (megatron derives it from mscale; "
                                     "remove it, or pass it through mla_kwargs once megatron takes it)")
            if rope.get("truncate", True) is not True:
                raise ValueError("rope_parameters.truncate: false is not supported (megatron rounds the YaRN range; it "
                                 "would run with a compat entry on megatron's YarnRotaryEmbedding)")
            yarn = YarnArch(factor=float(rope["factor"]),
                            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
                            beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                            mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
            theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
            c = {**c, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
        q_lora = c.get("q_lora_rank")
        mla = MLAArch(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(c["kv_lora_rank"]),
                      qk_nope_head_dim=int(c["qk_nope_head_dim"]), qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                      v_head_dim=int(c["v_head_dim"]))
        heads = int(c["num_attention_heads"])
        arch = super().parse_config({**c, "num_key_value_heads": heads, "head_dim": None})
        return _arch(arch, num_kv_heads=heads, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla=mla,
                     yarn=yarn, **moe)

    def sglang_layout(self, b: "EngineRank") -> None:
        """SGLang's deepseek_v2.py: MLA (``fused_qkv_a_proj_with_mqa`` = [q_a_proj; kv_a_proj_with_mqa]
        replicated, q_b_proj / kv_b_proj column-parallel by heads, o_proj row-parallel), dense first
        layers, a sigmoid router with an fp32 correction bias, FusedMoE experts, shared experts as
        a dense MLP (not fused into FusedMoE). SGLang derives w_kc / w_vc from kv_b_proj in
        post_load_weights: the receiver runs it after a sync (tools/env/sglang_reshard.py ``post_load``)."""
        a = self.arch
        b.embedding()
        for i in range(a.num_layers):
            L, A = f"model.layers.{i}", f"model.layers.{i}.self_attn"
            b.replicated(f"{L}.input_layernorm.weight", f"{L}.input_layernorm.weight")
            if a.mla.q_lora_rank:
                b.replicated(f"{A}.fused_qkv_a_proj_with_mqa.weight", f"{A}.q_a_proj.weight",
                             f"{A}.kv_a_proj_with_mqa.weight")
                b.replicated(f"{A}.q_a_layernorm.weight", f"{A}.q_a_layernorm.weight")
                b.column(f"{A}.q_b_proj.weight", f"{A}.q_b_proj.weight")
            else:
                b.column(f"{A}.q_proj.weight", f"{A}.q_proj.weight")
                b.replicated(f"{A}.kv_a_proj_with_mqa.weight", f"{A}.kv_a_proj_with_mqa.weight")
            b.replicated(f"{A}.kv_a_layernorm.weight", f"{A}.kv_a_layernorm.weight")
            b.column(f"{A}.kv_b_proj.weight", f"{A}.kv_b_proj.weight")
            b.row(f"{A}.o_proj.weight", f"{A}.o_proj.weight")
            b.replicated(f"{L}.post_attention_layernorm.weight", f"{L}.post_attention_layernorm.weight")
            if not a.is_moe_layer(i):
                b.dense_mlp(L)
                continue
            b.replicated(f"{L}.mlp.gate.weight", f"{L}.mlp.gate.weight")
            b.replicated(f"{L}.mlp.gate.e_score_correction_bias", f"{L}.mlp.gate.e_score_correction_bias",
                         dtype="float32")
            b.experts(f"{L}.mlp", i)
            if a.moe_shared_ffn_hidden_size:
                b.dense_mlp(L, "mlp.shared_experts")
        b.final()

    _FUSED_ON_LOAD = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
                      "self_attn.kv_a_proj_with_mqa.weight")

    def bucket_group(self, hf_name: str) -> str | None:
        """SGLang's DeepseekV2 loader fuses q_a_proj and kv_a_proj_with_mqa into one parameter
        only when both arrive in the same load_weights call (deepseek_weight_loader.py ~438-513,
        a per-call cache): a bucket boundary between them would leave the fused weight stale,
        silently. The layer's tensors from q_a_proj to kv_a_proj_with_mqa travel together."""
        layer, _, leaf = hf_name.partition(".self_attn.")
        if self.arch.mla is not None and self.arch.mla.q_lora_rank and f"self_attn.{leaf}" in self._FUSED_ON_LOAD:
            return f"{layer}.qkv_a"
        return None


@register_family
class Glm4MoeAdapter(ModelAdapter):
    """GLM-4.5 / 4.6 / 4.5-Air (Glm4MoeForCausalLM): GQA with q/k/v bias (attention_bias) and
    optional per-head q/k norms (use_qk_norm), partial rotary (partial_rotary_factor), dense
    first layers, sigmoid + bias routing, shared experts."""

    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    sglang_layout = None  # SGLang's glm4_moe.py layout not written here: mode reshard refused, broadcast serves it
    known_keys = _DENSE | _SIGMOID_MOE | {"partial_rotary_factor", "use_qk_norm"}

    def parse_config(self, c: dict) -> ModelArch:
        refuse_unknown_keys(c, self.known_keys, self.model_type)
        rope = dict(c.get("rope_parameters") or {})
        pr = float(rope.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        if not 0 < pr <= 1:
            raise ValueError(f"partial_rotary_factor: {pr} is not in (0, 1]")
        moe = _sigmoid_routing(c, int(c["num_hidden_layers"]))
        _mtp_notice(c, self.model_type)
        self.qkv_bias = bool(c.get("attention_bias", False))
        arch = super().parse_config({**c, "rope_parameters": rope or None})
        return _arch(arch, qk_layernorm=bool(c.get("use_qk_norm", False)), rotary_percent=pr, **moe)

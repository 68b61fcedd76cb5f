"""Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM).

Qwen3 = Llama's layout plus per-head q/k RMSNorms (megatron's ``qk_layernorm``) and a free
``head_dim`` (``kv_channels``); Qwen3-MoE adds a softmax top-k router and E SwiGLU experts.
Configs are checked key by key: a key that changes the network and is not implemented here is
refused with an error naming it, never silently ignored. Details: docs/engine.md ("Qwen3 and
Qwen3-MoE", "Module notes").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_mega.models.base import ModelAdapter, ModelArch
from areal_mega.models.registry import register_family

if TYPE_CHECKING:
    from areal_mega.weight_sync.sglang_layout import EngineRank

# Keys that never change the network's function (bookkeeping, generation, HF runtime flags).
_INERT = {
    "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "chunk_size_feed_forward",
    "dtype", "torch_dtype", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version", "use_cache", "model_type",
    "initializer_range", "attention_dropout", "max_position_embeddings", "tokenizer_class",
    # only read when use_sliding_window is true (refused below); HF always writes them
    "sliding_window", "max_window_layers", "layer_types",
    "output_router_logits",  # HF returns router logits for its own aux loss; no effect on outputs
    "router_aux_loss_coef",  # HF's training loss only; the learner's is actor.model.moe_aux_loss_coef
}
# Keys read by ModelAdapter.parse_config (or refused there when set to an unsupported value).
_DENSE = {
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "use_sliding_window",
}
_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers"}
# Variants of other MoE families, named so the error says what they are.
_VARIANTS = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "moe_shared_expert_intermediate_size": "shared experts",
    "n_group": "grouped (device-limited) routing",
    "topk_group": "grouped (device-limited) routing",
    "topk_method": "grouped (device-limited) routing",
    "routed_scaling_factor": "scaled routing",
    "kv_lora_rank": "multi-latent attention (MLA)",
    "q_lora_rank": "multi-latent attention (MLA)",
    "num_nextn_predict_layers": "multi-token prediction (MTP) heads",
    "first_k_dense_replace": "dense layers before the MoE layers",
}


def refuse_unknown_keys(c: dict, known: set[str], model_type: str) -> None:
    """ValueError naming the first config key that is neither implemented nor inert."""
    for key in sorted(c):
        if key in known or key in _INERT:
            continue
        if key in _VARIANTS:
            if c[key] in (None, 0, [], False):
                continue  # present but off
            raise ValueError(f"{key}: {_VARIANTS[key]} ({key}={c[key]!r}) is not supported for {model_type}")
        raise ValueError(f"{key}: config key not implemented by the {model_type} adapter (refused rather than ignored; "
                     "it runs once the adapter in areal_mega/models/ maps it to megatron)")


@register_family
class Qwen3Adapter(ModelAdapter):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qkv_bias = False
    known_keys = _DENSE

    def parse_config(self, c: dict) -> ModelArch:
        refuse_unknown_keys(c, self.known_keys, self.model_type)
        arch = super().parse_config(c)
        return ModelArch(**{**arch.__dict__, "qk_layernorm": True})


@register_family
class Qwen3MoeAdapter(Qwen3Adapter):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    known_keys = _DENSE | _MOE

    def sglang_layout(self, b: "EngineRank") -> None:
        """SGLang's qwen3_moe.py: every layer a router (ReplicatedLinear ``mlp.gate``) + FusedMoE."""
        b.embedding()
        for i in range(self.arch.num_layers):
            L = f"model.layers.{i}"
            b.gqa_attention(L)
            b.replicated(f"{L}.mlp.gate.weight", f"{L}.mlp.gate.weight")
            b.experts(f"{L}.mlp", i)
        b.final()

    def parse_config(self, c: dict) -> ModelArch:
        experts = c.get("num_experts", c.get("num_local_experts"))
        missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", c.get("num_experts_per_tok")),
                                  ("moe_intermediate_size", c.get("moe_intermediate_size"))) if v is None]
        if missing:
            raise ValueError(f"hf config: missing required MoE key(s) {missing}")
        if int(c.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"decoder_sparse_step: {c['decoder_sparse_step']} (dense layers between MoE layers) "
                             "is not supported; only 1 (every layer MoE)")
        if c.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers: {c['mlp_only_layers']} (dense MLP layers) is not supported; only []")
        topk, norm = int(c["num_experts_per_tok"]), bool(c.get("norm_topk_prob", False))
        if not 1 <= topk <= int(experts):
            raise ValueError(f"num_experts_per_tok: {topk} is not in [1, num_experts({experts})]")
        if topk == 1 and norm:
            raise ValueError("norm_topk_prob: true with num_experts_per_tok 1 (a constant gate of 1) is not supported "
                             "by megatron's router (it needs pre-softmax at top-1)")
        arch = super().parse_config(c)
        return ModelArch(**{**arch.__dict__, "num_experts": int(experts), "moe_topk": topk,
                            "moe_ffn_hidden_size": int(c["moe_intermediate_size"]), "moe_norm_topk_prob": norm})

"""Qwen3.5 (text) HF <-> megatron-core names and shapes: gated DeltaNet, gated attention, whole model.

Status (issue #38): TP1 and TP2 exact vs transformers (tests/test_qwen3_5.py); NOT yet a
registered family (no ModelAdapter in FAMILIES, so no live sync / conversion tools / PP):
docs/engine.md "Qwen3.5 / Qwen3-Next".

Layout (transformers 5.19 vs megatron-core 0.16.1, TP=1): megatron's GatedDeltaNet fuses HF's
four input projections into one ``in_proj`` = rows [qkv; z; b; a], qkv rows [q; k; v] in both;
``conv1d``, ``A_log``, ``dt_bias`` keep their names; HF's gated RMSNorm ``norm`` (plain weight,
not 1 + w) is ``out_norm``. Gated attention: HF q_proj rows per head [q; gate], megatron's
``attention_output_gate`` rows per query group [q heads; gate heads; k; v].
"""

from __future__ import annotations

import torch

_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_SAME = {"conv1d.weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias",
         "norm.weight": "out_norm.weight", "out_proj.weight": "out_proj.weight"}


def gdn_hf_to_mcore(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One HF ``linear_attn`` module's tensors (keys relative to it) -> megatron GatedDeltaNet's."""
    out = {"in_proj.weight": torch.cat([hf[f"{p}.weight"] for p in _PARTS], dim=0)}
    out.update({m: hf[h] for h, m in _SAME.items()})
    return out


def gdn_mcore_to_hf(mc: dict[str, torch.Tensor], sizes: tuple[int, int, int, int]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`gdn_hf_to_mcore`; ``sizes`` = rows of (qkv, z, b, a):
    (2 * key_dim + value_dim, value_dim, num_v_heads, num_v_heads)."""
    out = {f"{p}.weight": t for p, t in zip(_PARTS, torch.split(mc["in_proj.weight"], list(sizes), dim=0))}
    out.update({h: mc[m] for h, m in _SAME.items()})
    return out


def gdn_sizes(c: dict) -> tuple[int, int, int, int]:
    """Row counts of HF's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) from a qwen3_5 text config."""
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return (2 * kd + vd, vd, c["linear_num_value_heads"], c["linear_num_value_heads"])


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


def hf_to_mcore(hf: dict[str, torch.Tensor], c: dict, padded_vocab: int) -> dict[str, torch.Tensor]:
    """A whole Qwen3.5 text model's HF state dict -> the hybrid GPTModel's (TP=1, PP=1), vocab
    rows zero-padded to ``padded_vocab``. Layer kinds from ``c["layer_types"]``."""
    def pad(w):
        return torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], *w.shape[1:])])

    out = {"embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": pad(hf.get("lm_head.weight", hf["model.embed_tokens.weight"]))}
    for i, kind in enumerate(c["layer_types"]):
        H, M = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[M + "input_layernorm.weight"] = hf[H + "input_layernorm.weight"]
        out[M + "pre_mlp_layernorm.weight"] = hf[H + "post_attention_layernorm.weight"]
        out[M + "mlp.linear_fc1.weight"] = torch.cat([hf[H + "mlp.gate_proj.weight"], hf[H + "mlp.up_proj.weight"]])
        out[M + "mlp.linear_fc2.weight"] = hf[H + "mlp.down_proj.weight"]
        if kind == "linear_attention":
            la = {k[len(H + "linear_attn."):]: v for k, v in hf.items() if k.startswith(H + "linear_attn.")}
            out.update({M + "self_attention." + k: v for k, v in gdn_hf_to_mcore(la).items()})
        else:
            A = H + "self_attn."
            out[M + "self_attention.linear_qkv.weight"] = gated_qkv_hf_to_mcore(
                hf[A + "q_proj.weight"], hf[A + "k_proj.weight"], hf[A + "v_proj.weight"],
                c["num_key_value_heads"], c["head_dim"])
            out[M + "self_attention.linear_proj.weight"] = hf[A + "o_proj.weight"]
            out[M + "self_attention.q_layernorm.weight"] = hf[A + "q_norm.weight"]
            out[M + "self_attention.k_layernorm.weight"] = hf[A + "k_norm.weight"]
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], c: dict) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_mcore` (vocab padding dropped; lm_head kept unless tied)."""
    V, inv = c["vocab_size"], {}
    inv["model.embed_tokens.weight"] = mc["embedding.word_embeddings.weight"][:V]
    inv["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if not c.get("tie_word_embeddings", False):
        inv["lm_head.weight"] = mc["output_layer.weight"][:V]
    for i, kind in enumerate(c["layer_types"]):
        H, M = f"model.layers.{i}.", f"decoder.layers.{i}."
        inv[H + "input_layernorm.weight"] = mc[M + "input_layernorm.weight"]
        inv[H + "post_attention_layernorm.weight"] = mc[M + "pre_mlp_layernorm.weight"]
        inv[H + "mlp.gate_proj.weight"], inv[H + "mlp.up_proj.weight"] = mc[M + "mlp.linear_fc1.weight"].chunk(2)
        inv[H + "mlp.down_proj.weight"] = mc[M + "mlp.linear_fc2.weight"]
        if kind == "linear_attention":
            sa = {k[len(M + "self_attention."):]: v for k, v in mc.items() if k.startswith(M + "self_attention.")}
            inv.update({H + "linear_attn." + k: v for k, v in gdn_mcore_to_hf(sa, gdn_sizes(c)).items()})
        else:
            A, S = H + "self_attn.", M + "self_attention."
            q, k, v = gated_qkv_mcore_to_hf(mc[S + "linear_qkv.weight"], c["num_key_value_heads"], c["head_dim"])
            inv.update({A + "q_proj.weight": q, A + "k_proj.weight": k, A + "v_proj.weight": v,
                        A + "o_proj.weight": mc[S + "linear_proj.weight"],
                        A + "q_norm.weight": mc[S + "q_layernorm.weight"], A + "k_norm.weight": mc[S + "k_layernorm.weight"]})
    return inv


def tp_shard(mc: dict[str, torch.Tensor], c: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's slice of a TP=1 megatron state dict (:func:`hf_to_mcore`'s output). Fused
    tensors are split part by part: in_proj [qkv; z; b; a] with qkv itself [q; k; v] (so is
    conv1d's channel axis), fc1 [gate; up], the gated qkv by whole query groups."""
    def rows(t, dim=0):
        return t.chunk(tp, dim)[rank]

    def parts(t, sizes):
        return torch.cat([rows(p) for p in torch.split(t, list(sizes))])

    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    nv = c["linear_num_value_heads"]
    out = {}
    for k, t in mc.items():
        if k.endswith(("layernorm.weight", "out_norm.weight")):
            out[k] = t
        elif k.endswith(("linear_fc2.weight", "out_proj.weight", "linear_proj.weight")):
            out[k] = rows(t, 1)
        elif k.endswith("linear_fc1.weight"):
            out[k] = parts(t, (t.shape[0] // 2,) * 2)
        elif k.endswith("in_proj.weight"):
            out[k] = parts(t, (kd, kd, vd, vd, nv, nv))
        elif k.endswith("conv1d.weight"):
            out[k] = parts(t, (kd, kd, vd))
        else:  # embeddings, output layer, gated qkv (whole groups), A_log, dt_bias
            out[k] = rows(t)
    return out


def split_vl_checkpoint(c: dict, hf: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """Released Qwen3.5 checkpoints are vision-language (model_type ``qwen3_5``): the text model
    is ``model.language_model.*`` + ``lm_head``, configured by ``text_config``. Decision: text-only
    RL; the vision tower (``model.visual.*``) is returned untouched, frozen, for the export to
    write back. Returns (text config, the text model in Qwen3_5ForCausalLM names, the vision tensors).
    A ``qwen3_5_text`` config/checkpoint passes through with no vision tensors."""
    if c.get("model_type") == "qwen3_5_text":
        return c, hf, {}
    if c.get("model_type") != "qwen3_5" or "text_config" not in c:
        raise ValueError(f"model_type: {c.get('model_type')!r} is not a Qwen3.5 config (qwen3_5 or qwen3_5_text)")
    text = {**c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", False)}
    lm, vision = {}, {}
    for k, t in hf.items():
        if k.startswith("model.language_model."):
            lm["model." + k[len("model.language_model."):]] = t
        elif k == "lm_head.weight":
            lm[k] = t
        elif k.startswith("model.visual."):
            vision[k] = t
        else:
            raise ValueError(f"checkpoint: tensor {k!r} is neither the language model nor the vision tower")
    return text, lm, vision

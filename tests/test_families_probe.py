"""Probe pins for issue 38 items 3-4 (docs/families_probe.md): what transformers' DeepSeek-V4 and
gpt-oss blocks are, and where megatron-core 0.16.1's pure-torch pieces match gpt-oss's math.

No adapter is built here; these tests pin the facts the probe note states, so a transformers or
megatron-core bump that changes them fails here instead of silently invalidating the note.
"""

from __future__ import annotations

import pytest
import torch

# fp32 elementwise/softmax on O(10) values: agreement to a few ulps of 1.0; 1e-6 is ~8 ulp (2^-23 ~ 1.2e-7)
TOL = 1e-6


def _tiny_dsv4():
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
    return cfg, DeepseekV4ForCausalLM(cfg).float().eval()


# Per-layer parameter/buffer suffixes the adapter would have to map, by block.
_ATTN = {"sinks", "q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight",
         "o_a_proj.weight", "o_b_proj.weight"}
_COMPRESSOR = {"position_bias", "kv_proj.weight", "gate_proj.weight", "kv_norm.weight"}
_INDEXER = {"kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight", "q_b_proj.weight",
            "scorer.weights_proj.weight"}
_HC = {"fn", "base", "scale"}
_MOE = {"gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}


def _expected(layer_type: str, mlp_type: str) -> set[str]:
    names = {f"self_attn.{n}" for n in _ATTN}
    if layer_type != "sliding_attention":
        names |= {f"self_attn.compressor.{n}" for n in _COMPRESSOR}
    if layer_type == "compressed_sparse_attention":
        names |= {f"self_attn.compressor.indexer.{n}" for n in _INDEXER}
    names |= {f"{hc}.{n}" for hc in ("attn_hc", "ffn_hc") for n in _HC}
    names |= {f"mlp.{n}" for n in _MOE} | {"input_layernorm.weight", "post_attention_layernorm.weight"}
    if mlp_type == "hash_moe":
        names.add("mlp.gate.tid2eid")
    else:
        names.add("mlp.gate.e_score_correction_bias")
    return names


def test_deepseek_v4_block_inventory():
    cfg, model = _tiny_dsv4()
    sd = model.state_dict()
    for i, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        got = {k[len(f"model.layers.{i}."):] for k in sd if k.startswith(f"model.layers.{i}.")}
        assert got == _expected(lt, mt), (i, lt, mt, got ^ _expected(lt, mt))
    top = {k for k in sd if not k.startswith("model.layers.")}
    assert top == {"model.embed_tokens.weight", "model.norm.weight", "model.hc_head.hc_fn", "model.hc_head.hc_base",
                   "model.hc_head.hc_scale", "lm_head.weight"}
    # negative control of the inventory: the sliding layer has no compressor, the HCA layer no indexer
    assert _expected("sliding_attention", "moe") != _expected("heavily_compressed_attention", "moe")
    assert _expected("heavily_compressed_attention", "moe") != _expected("compressed_sparse_attention", "moe")
    # hash routing: a frozen int64 token->experts table, a buffer (nothing a gradient reaches)
    assert sd["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    assert "model.layers.0.mlp.gate.tid2eid" not in dict(model.named_parameters())
    # hyper-connections: hc_mult streams, fn maps hc_mult*hidden -> (2 + hc_mult) * hc_mult mixing weights
    assert sd["model.layers.0.attn_hc.fn"].shape == (2 * cfg.hc_mult + cfg.hc_mult ** 2, cfg.hc_mult * 32)
    # grouped output projection: o_a is o_groups blocks of (heads*head_dim/o_groups -> o_lora_rank)
    assert sd["model.layers.0.self_attn.o_a_proj.weight"].shape == (cfg.o_groups * cfg.o_lora_rank,
                                                                    4 * 16 // cfg.o_groups)
    # MTP: transformers drops it on load (no module); an adapter would add it itself
    assert not any("mtp" in k for k in sd)
    logits = model(torch.randint(0, 64, (1, 24))).logits
    assert logits.shape == (1, 24, 64) and torch.isfinite(logits).all()


def test_gpt_oss_sinks_equal_megatron_softmax_one():
    """gpt-oss's sink softmax == megatron's SoftmaxOne (DotProductAttention softmax_type='learnable')."""
    from megatron.core.fusions.fused_softmax import SoftmaxOne
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    b, h, s, d = 1, 4, 6, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    sinks = torch.randn(h, generator=g)
    mask = torch.triu(torch.full((s, s), float("-inf")), 1).view(1, 1, s, s)
    module = type("M", (), {"sinks": sinks, "num_key_value_groups": 1, "training": False})()
    hf, _ = eager_attention_forward(module, q, k, v, mask, scaling=d ** -0.5)  # [b, s, h, d]
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5 + mask
    ours = (SoftmaxOne(-1, sinks)(scores) @ v).transpose(1, 2)
    assert (hf - ours).abs().max() < TOL
    plain = (scores.softmax(-1) @ v).transpose(1, 2)  # negative control: no sink
    assert (hf - plain).abs().max() > 1e-3


def _hf_gate(x_interleaved, limit=7.0, alpha=1.702):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    m = type("E", (), {"limit": limit, "alpha": alpha})()
    return GptOssExperts._apply_gate(m, x_interleaved)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gpt_oss_clamped_swiglu_vs_megatron_quick_geglu(with_bias):
    """megatron's quick_geglu with glu_linear_offset=1, activation_func_clamp_value=limit is gpt-oss's
    clamped SwiGLU (alpha 1.702 = quick_gelu's constant) on de-interleaved [gate | up] halves -- when
    the bias is already in the input. The fused path given a separate bias clamps BEFORE adding it
    (fused_bias_geglu.py weighted_bias_quick_geglu_impl), gpt-oss clamps after: they differ."""
    from megatron.core.fusions.fused_bias_geglu import weighted_bias_quick_geglu_impl

    g = torch.Generator().manual_seed(0)
    n, f = 16, 8
    x = torch.randn(n, 2 * f, generator=g) * 6  # scale 6: many entries beyond limit 7 after the bias
    bias = torch.randn(2 * f, generator=g) * 3
    hf = _hf_gate(x + bias)  # gpt-oss: gate = [..., ::2], up = [..., 1::2]
    halves = lambda t: torch.cat([t[..., ::2], t[..., 1::2]], -1)  # noqa: E731 (adapter's row permutation)
    ones = torch.ones(n, 1)
    if with_bias:
        ours = weighted_bias_quick_geglu_impl(halves(x), halves(bias), ones, False, 1.0, 7.0)
        assert (hf - ours).abs().max() > 1e-2  # the fused bias path is NOT gpt-oss's order
    else:
        ours = weighted_bias_quick_geglu_impl(halves(x + bias), None, ones, False, 1.0, 7.0)
        assert (hf - ours).abs().max() < TOL * hf.abs().max().clamp(min=1)
        unclamped = weighted_bias_quick_geglu_impl(halves(x + bias), None, ones, False, 1.0, None)
        assert (hf - unclamped).abs().max() > 1e-2  # negative control: the clamp matters at this scale

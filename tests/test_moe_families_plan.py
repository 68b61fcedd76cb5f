"""Mixtral / Qwen2-MoE / DeepSeek-V3 / GLM-4.5 adapters without processes: config refusals (one
line naming the key), MTP dropped with a notice, and the pure weight-sync planner on the
published DeepSeek-V3-671B and GLM-4.5-Air shapes (tensor count and bytes against totals
computed by hand from the shapes, and the published parameter counts)."""

from __future__ import annotations

import logging

import pytest

from areal_mega.models import get_adapter
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.weight_sync.planner import plan_weight_sync

MiB = 1 << 20
# config.json of deepseek-ai/DeepSeek-V3 (bf16 weights assumed: the published FP8 checkpoint's
# quantization_config is refused, convert to bf16 first).
DEEPSEEK_V3_671B = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, ep_size=1,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
    max_position_embeddings=163840, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, rope_theta=10000,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1, aux_loss_alpha=0.001, seq_aux=True, pretraining_tp=1)
# config.json of zai-org/GLM-4.5-Air
GLM45_AIR = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
    n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1,
    topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1, rope_theta=1000000,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    torch_dtype="bfloat16", attention_dropout=0.0, initializer_range=0.02, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], use_cache=True)


def deepseek_hand_count(c) -> tuple[int, int]:
    """(tensors, parameters) of a DeepSeek-V3 checkpoint without its MTP layers."""
    h, n, L, k = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["first_k_dense_replace"]
    qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (c["q_lora_rank"] * h + c["q_lora_rank"] + n * qd * c["q_lora_rank"]  # q_a, q_a_layernorm, q_b
            + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * h + c["kv_lora_rank"]  # kv_a_proj_with_mqa, norm
            + n * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"]  # kv_b
            + h * n * c["v_head_dim"] + 2 * h)  # o_proj, input / post-attention norms
    e, f = c["n_routed_experts"], c["moe_intermediate_size"]
    dense_mlp = 3 * c["intermediate_size"] * h
    moe_mlp = e * h + e + e * 3 * f * h + 3 * c["n_shared_experts"] * f * h  # router, bias, experts, shared
    params = L * attn + k * dense_mlp + (L - k) * moe_mlp + 2 * c["vocab_size"] * h + h
    tensors = L * 9 + k * 3 + (L - k) * (2 + 3 * e + 3) + 3
    return tensors, params


def glm_hand_count(c) -> tuple[int, int]:
    h, L, k, d = c["hidden_size"], c["num_hidden_layers"], c["first_k_dense_replace"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attn = q * h + q + 2 * (kv * h + kv) + h * q + 2 * h  # q/k/v with bias, o, two norms
    e, f = c["n_routed_experts"], c["moe_intermediate_size"]
    moe_mlp = e * h + e + e * 3 * f * h + 3 * c["n_shared_experts"] * f * h
    params = L * attn + k * 3 * c["intermediate_size"] * h + (L - k) * moe_mlp + 2 * c["vocab_size"] * h + h
    tensors = L * 9 + k * 3 + (L - k) * (2 + 3 * e + 3) + 3
    return tensors, params


@pytest.mark.parametrize("hf,hand,layout,published,rel", [
    # 61 layers: pipeline stages must be even here, so PP1 (see docs/engine.md); EP64 x TP8 = 512 GPUs
    (DEEPSEEK_V3_671B, deepseek_hand_count, dict(tp=8, pp=1, ep=64, world=512), 671e9, 0.002),
    # "106B" (zai-org's model card) is rounded down from 106.85B without the MTP layer
    (GLM45_AIR, glm_hand_count, dict(tp=4, pp=2, ep=16, world=64), 106e9, 0.01),
])
def test_plan_published_shapes(hf, hand, layout, published, rel, caplog):
    with caplog.at_level(logging.WARNING):
        adapter = get_adapter(hf)
    assert "num_nextn_predict_layers=1 multi-token-prediction layer(s) dropped" in caplog.text  # the notice
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"],
                                              expert_parallel=layout["ep"], expert_tensor_parallel=1), layout["world"])
    stages = adapter.plan(lay)
    plan = plan_weight_sync([s.tensors for s in stages], lay, 512 * MiB)
    n, params = hand(hf)
    names = [t.name for t in plan.tensors]
    assert len(names) == n and len(set(names)) == n  # every tensor exactly once
    assert plan.nbytes == 2 * params  # bf16
    assert abs(params - published) < rel * published, params  # the published parameter count
    assert not any(f"layers.{hf['num_hidden_layers']}." in x for x in names)  # no MTP layer
    first = hf["first_k_dense_replace"]
    assert not any(f"layers.{first - 1}.mlp.experts." in x for x in names)  # dense first layers
    assert any(f"layers.{first}.mlp.gate.e_score_correction_bias" == x.split("model.")[-1] for x in names)


def _ds(**over):
    c = dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0)
    c.update(over)
    return c


@pytest.mark.parametrize("cfg,msg", [
    (_ds(scoring_func="softmax"), "scoring_func: 'softmax' is not supported for deepseek_v3"),
    (_ds(topk_method="greedy"), "topk_method: 'greedy' is not supported"),
    (_ds(norm_topk_prob=False), "norm_topk_prob: false with num_experts_per_tok 8 > 1 is not supported"),
    (_ds(topk_group=2), "topk_group: 2 with num_experts_per_tok 8: megatron ranks groups by their top"),
    (_ds(n_group=3), "n_group: 3 does not divide n_routed_experts(256)"),
    (_ds(rope_interleave=False), "rope_interleave: False is not supported"),
    (_ds(quantization_config={"quant_method": "fp8"}), "quantization_config: config key not implemented"),
    (_ds(first_k_dense_replace=61), "first_k_dense_replace: 61 is not in [0, num_hidden_layers(61))"),
    (dict(GLM45_AIR, partial_rotary_factor=0.0), "partial_rotary_factor: 0.0 is not in (0, 1]"),
    (dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
          vocab_size=100, num_local_experts=4, num_experts_per_tok=2, sliding_window=4096),
     "sliding_window: 4096 (sliding-window attention) is not supported"),
    (dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
          vocab_size=100, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1),
     "router_jitter_noise: 0.1 is not supported"),
    (dict(model_type="qwen2_moe", num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=4,
          vocab_size=100, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, qkv_bias=False),
     "qkv_bias: False is not supported for qwen2_moe"),
])
def test_refusals_name_the_key(cfg, msg):
    with pytest.raises(ValueError) as e:
        get_adapter(cfg)
    assert str(e.value).startswith(msg), str(e.value)
    assert "\n" not in str(e.value)


def test_families_map_to_megatron_settings():
    """What moe_kwargs / mla_kwargs hand megatron for the published shapes."""
    from areal_mega.megatron.model import MegatronModelConfig, mla_kwargs, moe_kwargs

    lay = ParallelLayout.build(ParallelConfig(expert_parallel=8), 8)
    ds = get_adapter(_ds()).arch
    kw = moe_kwargs(ds, lay, MegatronModelConfig())
    assert kw["moe_router_score_function"] == "sigmoid" and kw["moe_router_enable_expert_bias"]
    assert kw["moe_router_bias_update_rate"] == 0.0  # the bias stays the checkpoint's (as in HF)
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"], kw["moe_router_topk"]) == (8, 4, 8)
    assert kw["moe_router_topk_scaling_factor"] == 2.5 and kw["moe_shared_expert_intermediate_size"] == 2048
    assert kw["moe_layer_freq"] == [0, 0, 0] + [1] * 58
    assert kw["moe_router_dtype"] == "fp32"  # the adapter's fact (HF's fp32 router), not megatron/model.py's
    from tests.test_moe_plan import QWEN3_235B_A22B

    qwen = get_adapter(dict(QWEN3_235B_A22B, num_hidden_layers=2)).arch
    assert "moe_router_dtype" not in moe_kwargs(qwen, lay, MegatronModelConfig())  # control: the model's dtype
    m = mla_kwargs(ds)
    assert (m["q_lora_rank"], m["kv_lora_rank"], m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"]) == (
        1536, 512, 128, 64, 128)
    assert (m["rope_type"], m["rotary_scaling_factor"], m["mscale_all_dim"]) == ("yarn", 40.0, 1.0)
    glm = get_adapter(dict(GLM45_AIR, num_nextn_predict_layers=0)).arch
    assert glm.rotary_percent == 0.5 and glm.qkv_bias and glm.moe_scaling_factor is None
    q2 = get_adapter(dict(model_type="qwen2_moe", num_hidden_layers=4, hidden_size=64, intermediate_size=32,
                          num_attention_heads=4, vocab_size=100, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                          decoder_sparse_step=2)).arch
    assert q2.dense_layers == (0, 1, 2) and q2.moe_shared_expert_gate  # HF: sparse iff (i + 1) % step == 0


@pytest.mark.parametrize("family,kw", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                         first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                         num_nextn_predict_layers=0)),
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                         first_k_dense_replace=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                         num_nextn_predict_layers=0)),
    ("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, attention_bias=True,
                      partial_rotary_factor=0.5, num_nextn_predict_layers=0)),
])
def test_memory_estimate_counts_each_family_as_transformers_does(family, kw):
    """The launcher's parameter count (MLA's projections and latent norms, shared experts and
    their gate, dense layers, routers) = the transformers model's own parameters (the expert bias
    is a buffer in both). The state bytes per GPU are checked against the engine's real tensors
    by tools/check_memory_model.py (tests/test_launch_plan.py)."""
    from areal_mega.simulator.memory import total_params
    from tests.support.models import count_params, tiny_config

    shape = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
    cfg = tiny_config(family, **{**shape, **kw})
    assert total_params(get_adapter(cfg).arch) == count_params(family, **{**shape, **kw})


def test_memory_estimate_of_the_published_shapes():
    """DeepSeek-V3-671B and GLM-4.5-Air in the estimator: the hand totals minus the expert-bias
    buffers (not parameters: no gradient, no optimizer state); 37B active parameters for V3."""
    from areal_mega.simulator.memory import count_params, total_params

    for hf, hand in ((_ds(), deepseek_hand_count), (dict(GLM45_AIR, num_nextn_predict_layers=0), glm_hand_count)):
        m = get_adapter(hf).arch
        moe_layers = hf["num_hidden_layers"] - hf["first_k_dense_replace"]
        assert total_params(m) == hand(hf)[1] - moe_layers * hf["n_routed_experts"]
    m = get_adapter(_ds()).arch
    assert int(count_params(m).active(61, 3) / 1e9) == 37  # the model card: "37B activated" (37.55B)

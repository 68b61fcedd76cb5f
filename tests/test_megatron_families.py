"""Mixtral, Qwen2-MoE, DeepSeek-V3 (MLA with / without q_lora_rank, YaRN with mscale, grouped
sigmoid + bias routing, routed scaling, shared experts, a dense first layer) and GLM-4.5
(glm4_moe: q/k/v bias, partial rotary, sigmoid + bias routing, shared experts, dense first
layer) in megatron-core vs HF transformers on CPU (gloo). One 4-rank torchrun launch
(tests/dist/family_layouts.py) for every family and layout:

* per-token log-probs vs HF (fp32, per sequence, eager attention) at TP1, TP2 (with sequence
  parallelism, "auto"), PP2, EP2, EP2 x TP2, EP2 x PP2 within the derived logits bound;
* ModelAdapter.export_hf (the weight-sync path) bit-exact and complete at every layout;
* negative controls: DeepSeek-V3's (with and without q_lora) / GLM-4.5's expert bias dropped,
  Qwen2-MoE's shared expert dropped, Mixtral's router dropped -- far outside the bound (so the
  bias, the shared expert and the routing are really used): one control per family;
* tools: HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) bit-exact (DeepSeek-V3, Qwen2-MoE).

Upstream behaviour pinned: transformers 5.19's MixtralForCausalLM, Qwen2MoeForCausalLM,
DeepseekV3ForCausalLM (DeepseekV3TopkRouter, rope_interleave, yarn_apply_mscale) and
Glm4MoeForCausalLM; megatron-core 0.16.1's MLASelfAttention (with areal_mega's CoreAttention),
YarnRotaryEmbedding and topk_routing_with_score_function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import child_env, run_checked, torchrun_cmd
from tests.support.models import packed_logprobs as logprobs, tiny_model
from tests.support.numerics import fp32_tol, transformer_reductions

pytestmark = pytest.mark.slow  # every test reads the torchrun launch's results
LENS = [7, 13, 4, 10]
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
              max_position_embeddings=256, noise=0.1)
_MLA = dict(family="deepseek_v3", num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32,
            intermediate_size=96, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, head_dim=8, v_head_dim=12, num_nextn_predict_layers=0)
MODELS = {
    "mixtral": dict(family="mixtral", num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32, noise_seed=4),
    "qwen2_moe": dict(family="qwen2_moe", num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, intermediate_size=96,
                      norm_topk_prob=False, noise_seed=5),
    # V3 / R1 shape: q_lora_rank, YaRN (factor 4 over 64 positions, mscale_all_dim 1 -> the
    # softmax scale changes), 4 groups of 2 experts keep 2 (top-4: 4 // 2 = HF's top-2 per group)
    "deepseek_v3": dict(**_MLA, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, q_lora_rank=24,
                        routed_scaling_factor=2.5, noise_seed=6,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                             mscale=1.0, mscale_all_dim=1.0)),
    # Moonlight / V2-Lite shape: no q_lora_rank (a full q_proj), plain RoPE, no groups, 2 shared
    "deepseek_nolora": dict(**_MLA, num_experts_per_tok=2, n_shared_experts=2, n_group=1, topk_group=1,
                            q_lora_rank=None, routed_scaling_factor=2.446, noise_seed=7),
    "glm4_moe": dict(family="glm4_moe", num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, intermediate_size=96, first_k_dense_replace=1,
                     n_group=1, topk_group=1, head_dim=16, attention_bias=True, routed_scaling_factor=2.5,
                     partial_rotary_factor=0.5, num_nextn_predict_layers=0, noise_seed=8),
}


def logits_tol(ref: torch.Tensor) -> float:
    """fp32 logits of the same weights computed two ways (megatron packed, any layout, vs HF per
    sequence): every reduction of the forward but the log-softmax may run in another order, of
    up to K = 128 terms (MLP 96, shared experts 64, attention 4 x 16), relative to the largest
    |logit| (tests/support/numerics.py). Routing is discrete: a flipped top-k tie moves a token
    by O(1) and fails the bound, which is the point."""
    return fp32_tol(128, float(ref.abs().max()), ops=transformer_reductions(2) - 1)


def _make_models(work: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    ref = {}
    for name, kw in MODELS.items():
        m = tiny_model(**kw, **COMMON)
        m.config._attn_implementation = "eager"
        m.save_pretrained(work / name)
        with torch.no_grad():
            logits = torch.cat([m(ids[cu[i]: cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])
        ref[name] = {"input_ids": ids, "cu_seqlens": cu, "logits": logits.float()}
    torch.save(ref, work / "ref.pt")
    return ref


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    work = tmp_path_factory.mktemp("family_layouts")
    ref = _make_models(work)
    run_checked(torchrun_cmd(4, "tests/dist/family_layouts.py", "--work-dir", work, "--out", work / "results.pt"),
                timeout_s=1500, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    return work, ref, torch.load(work / "results.pt")



def test_logprobs_match_hf_every_family_and_layout(fam):
    from tests.dist.family_layouts import LAYOUTS, key_of

    _, ref, res = fam
    table = {}
    for name, r in ref.items():
        assert set(res["logits"][name]) == {key_of(*lay) for lay in LAYOUTS}
        tol = logits_tol(r["logits"])
        hf_lp = logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])
        for key, lg in res["logits"][name].items():
            d = (lg - r["logits"]).abs().max().item()
            # log-softmax: |d log p| <= 2 max |d logit|, so the log-prob bound is 2 x the logits bound
            dlp = (logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
            assert d <= tol and dlp <= 2 * tol, f"{name} {key}: max |logit diff| {d}, |log-prob diff| {dlp}, bound {tol}"
            table[f"{name}/{key}"] = (dlp, 2 * tol)
    print("max |log-prob megatron - HF|, bound:", json.dumps(table, indent=1))


def test_export_bit_exact_each_tensor_once(fam):
    from areal_mega.models import get_adapter

    work, ref, res = fam
    for name in ref:
        all_names = get_adapter(work / name).hf_names()
        assert len(all_names) == len(set(all_names))
        with open(work / name / "model.safetensors", "rb") as f:  # the plan names every HF tensor
            n = int.from_bytes(f.read(8), "little")
            on_disk = {k for k in json.loads(f.read(n)) if k != "__metadata__"}
        assert set(all_names) == on_disk, (name, sorted(set(all_names) ^ on_disk)[:5])
        for key, rows in res["export"][name].items():
            seen = []
            for pp, tp, dp, ep, same, diff, none, names in [r for r in rows if r is not None]:
                assert diff == 0, f"{name} {key} stage {pp}: {diff} tensors differ"
                if tp == 0 and dp == 0 and ep == 0:  # the stage's sender holds every tensor
                    assert none == 0 and same == len(names), (name, key, pp, none)
                    seen += names
            assert sorted(seen) == sorted(all_names), (name, key)


def test_negative_controls_fail(fam):
    from tests.dist.family_layouts import NEGATIVE

    _, ref, res = fam
    assert set(res["negative"]) == {c for c, (m, *_) in NEGATIVE.items() if m in ref}
    out = {}
    for control, (name, lg) in res["negative"].items():
        d = (lg - ref[name]["logits"]).abs().max().item()
        out[control] = d
        assert d > 100 * logits_tol(ref[name]["logits"]), f"{control}: went unnoticed ({d})"
    print("negative controls, max |logit diff|:", json.dumps(out))


def test_conversion_tools_roundtrip_bit_exact(fam):
    from tests.dist.family_layouts import ROUNDTRIP
    from tests.support.models import hf_dir_tensors

    work, ref, _ = fam
    for name in [n for n in ROUNDTRIP if n in ref]:
        a, b = hf_dir_tensors(work / name), hf_dir_tensors(work / f"{name}_hf")
        assert sorted(a) == sorted(b), name
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, f"{name} not bit-exact: {bad[:5]}"
        cfg = json.loads((work / f"{name}_hf" / "config.json").read_text())
        assert cfg["model_type"] == json.loads((work / name / "config.json").read_text())["model_type"]

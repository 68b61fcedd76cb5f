"""The MoE families served: each family's tiny random checkpoint on a real SGLang CPU server,
the EP2 learner's perturbed weights synced into it by the product's weight sync
(tests/dist/wsync_moe.py, one torchrun launch per family), then

* the server's log-probs of fixed sequences = the learner's within the fp32 bound;
* the server's greedy continuations = HF transformers' greedy decode of the learner's exported
  weights (fp32), token for token (a divergence only where HF's top-2 logits are a tie within
  the bound -- none is expected in fp32; the number compared is asserted);
* negative control: the server before the sync (v0) fails both.

fp32 on both sides (checkpoint, learner, server --dtype float32) so that greedy decoding is
decisive: in bf16 a random tiny model's top-2 logits are often closer than bf16's rounding, and
the bf16 path of the same weight sync is tests/test_weight_sync_moe.py's.

Families (tiny: 2 layers, hidden 128, vocab 512, 8 experts, what SGLang's CPU kernels take): Mixtral,
Qwen2-MoE (gated shared expert), DeepSeek-V3 (MLA with q_lora_rank, YaRN + mscale, grouped sigmoid
+ bias routing, a shared expert, a dense first layer) and GLM-4.5 (qkv bias, partial rotary, sigmoid
+ bias routing, shared expert, dense first layer). One server start per family (1-4 min each on 2
cores): ``make test-families-serve`` (marker ``families_serve``), not ``make test`` (CI budget).
DeepSeek-V3 needs tools/env/sglang_cpu_shim.py entry 3 (the MLA forward on SGLang's CPU backends).
"""

from __future__ import annotations

import json

import pytest
import torch

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import save_tiny_model
from tests.support.numerics import fp32_tol, transformer_reductions

pytestmark = [pytest.mark.slow, pytest.mark.families_serve, needs_sglang]

BASE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, initializer_range=0.2)
FAMILIES = {
    "mixtral": dict(num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, intermediate_size=256, norm_topk_prob=False),
    # V3 / R1 shape; the keys a real V3 config.json carries (moe_layer_freq, topk_method,
    # scoring_func) are ones SGLang's DeepseekV2 model reads and transformers' config lacks.
    "deepseek_v3": dict(num_key_value_heads=2, n_routed_experts=8, moe_intermediate_size=64, intermediate_size=256,
                        first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, head_dim=32,
                        v_head_dim=64, q_lora_rank=48, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, num_nextn_predict_layers=0, moe_layer_freq=1, topk_method="noaux_tc",
                        scoring_func="sigmoid",
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
                                             mscale=1.0, mscale_all_dim=1.0)),
    "glm4_moe": dict(num_key_value_heads=2, head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     n_shared_experts=1, intermediate_size=256, first_k_dense_replace=1, n_group=1, topk_group=1,
                     attention_bias=True, routed_scaling_factor=2.5, partial_rotary_factor=0.5, num_nextn_predict_layers=0),
}
# Reductions from the weights to a log-prob: the dense transformer's, plus per layer the
# routing-weighted sum of expert outputs and the shared expert's two (gate/up, down); MLA's
# low-rank q and kv projections add two more per layer. K: the largest reduction (MLP 256).
ROUNDINGS = transformer_reductions(BASE["num_hidden_layers"]) + 5 * BASE["num_hidden_layers"]
K = 256


def logit_tol(scale: float) -> float:
    """|server - learner| (or HF) logits, fp32 on both sides, relative to the largest |logit|."""
    return fp32_tol(K, scale, ops=ROUNDINGS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    family = request.param
    work = tmp_path_factory.mktemp(f"serve_{family}")
    hf = save_tiny_model(work / "model", family, dtype="float32", **BASE, **FAMILIES[family])
    icfg = InferenceConfig(
        num_servers=1,
        server=SGLangServerConfig(python=SGLANG_PYTHON, model_path=str(hf), device="cpu", dtype="float32",
                                  max_total_tokens=4096, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900,
                                  log_dir=str(work / "logs")),
    )
    servers = launch_servers(icfg)
    try:
        res = run_dist_script("wsync_moe.py", 2, work, timeout_s=600,
                              args=("--hf-dir", hf, "--servers", servers[0].url, "--dtype", "float32",
                                    "--export-dir", work / "v1"))
    finally:
        for s in servers:
            s.stop()
    res["family"], res["v1_dir"] = family, work / "v1"
    return res


def _maxdiff(a, b) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def hf_greedy(model_dir, prompts, new_tokens: int):
    """HF transformers' greedy continuations (fp32) and the top-2 logit margin at each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
        top2 = [lg[0].float().topk(2).values for lg in g.logits]
        out.append((g.sequences[0, len(p):].tolist(), [float(t[0] - t[1]) for t in top2],
                    max(float(lg.abs().max()) for lg in g.logits)))
    return out


def greedy_agreement(server: list[list[int]], hf: list, tol: float) -> tuple[int, list[str]]:
    """(tokens compared equal, problems): per prompt, tokens must agree up to the first
    divergence; a divergence is allowed only where HF's top-2 margin <= 2 * tol (each of the two
    logits may move by tol), and the comparison of that prompt stops there."""
    equal, problems = 0, []
    for i, (srv, (ref, margins, _)) in enumerate(zip(server, hf)):
        for t, (a, b) in enumerate(zip(srv, ref)):
            if a != b:
                if margins[t] > 2 * tol:
                    problems.append(f"prompt {i} token {t}: server {a} != HF {b} (HF top-2 margin {margins[t]:.3g})")
                break
            equal += 1
        if len(srv) != len(ref):
            problems.append(f"prompt {i}: server gave {len(srv)} tokens, HF {len(ref)}")
    return equal, problems


def check_served_sync(served, label: str, **extra) -> None:
    """After a sync the server's log-probs equal the learner's within the dtype bound and its greedy
    continuations equal HF's on the learner's exported weights; the server left at v0 fails both
    (the control). Shared by every served-sync test."""
    from tests.dist.wsync_moe import NEW_TOKENS, PROMPTS

    assert served["v1"][0]["version"] == "1"
    lp_tol = 2 * logit_tol(served["logit_scale"])  # log-softmax: |d lp| <= 2 max |d logit|
    d1 = _maxdiff(served["v1"][0]["logprobs"], served["learner_v1"])
    d0 = _maxdiff(served["v0"][0]["logprobs"], served["learner_v1"])
    hf = hf_greedy(served["v1_dir"], PROMPTS, NEW_TOKENS)
    tol = logit_tol(max(h[2] for h in hf))
    equal, problems = greedy_agreement(served["greedy_v1"][0], hf, tol)
    equal0, problems0 = greedy_agreement(served["greedy_v0"][0], hf, tol)
    print(json.dumps({"case": label, "logprob_diff_v1": d1, "bound": lp_tol, "logprob_diff_v0": d0,
                      "greedy_equal_tokens": equal, "of": len(PROMPTS) * NEW_TOKENS, "v0_equal_tokens": equal0,
                      "min_hf_margin": min(min(h[1]) for h in hf), "tie_bound": 2 * tol, **extra}))
    assert d1 <= lp_tol, f"{label}: server log-probs after the sync off the learner's by {d1} > {lp_tol}"
    assert not problems, f"{label}: {problems}"
    assert equal >= len(PROMPTS) * NEW_TOKENS // 2, f"{label}: only {equal} greedy tokens compared"
    # the control: the server left at v0 (unsynced) fails both checks
    assert d0 > 100 * lp_tol, f"{label}: the unsynced server is within {d0} of the learner"
    assert problems0, f"{label}: the unsynced server decodes as the synced weights do"


def test_served_family_matches_learner_and_hf(served):
    check_served_sync(served, served["family"])

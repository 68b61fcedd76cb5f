"""DeepSeek-V3 (MLA) resharded at runtime into a real SGLang CPU server (`make test-reshard`).

A tiny DeepSeek-V3 (tests/test_families_serve.py's: MLA with q_lora_rank, YaRN, grouped sigmoid
routing, a shared expert, a dense first layer; fp32 so that greedy decoding is decisive) is
served at v0 with the receiver the SGLang venv installs (tools/env/sglang_reshard.py). The EP2 learner perturbs its weights (v1) and
syncs them with weight_sync.mode reshard: each engine rank receives its shard and the receiver
runs SGLang's own post_load_weights for the kv_b_proj it wrote, which derives the absorbed
w_kc / w_vc that SGLang's MLA decode reads. Then the server's log-probs = the learner's within the
fp32 bound and its greedy continuations = HF transformers' on the learner's exported v1; the
server as started (v0) fails both (control). A receiver that skipped post_load_weights would keep
v0's w_kc / w_vc: the decode steps would then run the v0 attention (the greedy check catches it).
One server start (1-4 min on 2 cores): marker reshard_sglang, not `make test`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import save_tiny_model
from tests.test_families_serve import BASE, FAMILIES, _maxdiff, greedy_agreement, hf_greedy, logit_tol

pytestmark = [pytest.mark.slow, pytest.mark.reshard_sglang, needs_sglang]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("reshard_mla")
    hf = save_tiny_model(work / "model", "deepseek_v3", dtype="float32", **BASE, **FAMILIES["deepseek_v3"])
    icfg = InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=SGLANG_PYTHON, model_path=str(hf), device="cpu", dtype="float32", max_total_tokens=4096,
        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900, log_dir=str(work / "logs")))
    servers = launch_servers(icfg)
    try:
        res = run_dist_script("wsync_moe.py", 2, work, timeout_s=600,
                              args=("--hf-dir", hf, "--servers", servers[0].url, "--dtype", "float32",
                                    "--export-dir", work / "v1", "--mode", "reshard"))
    finally:
        for s in servers:
            s.stop()
    res["v1_dir"] = work / "v1"
    return res


def test_mla_reshard_served_greedy_equals_hf(served):
    from tests.dist.wsync_moe import NEW_TOKENS, PROMPTS

    assert served["sync1"]["mode"] == "reshard"  # not the broadcast fallback
    assert served["v1"][0]["version"] == "1"
    lp_tol = 2 * logit_tol(served["logit_scale"])  # log-softmax: |d lp| <= 2 max |d logit|
    d1 = _maxdiff(served["v1"][0]["logprobs"], served["learner_v1"])
    d0 = _maxdiff(served["v0"][0]["logprobs"], served["learner_v1"])
    hf = hf_greedy(served["v1_dir"], PROMPTS, NEW_TOKENS)
    tol = logit_tol(max(h[2] for h in hf))
    equal, problems = greedy_agreement(served["greedy_v1"][0], hf, tol)
    equal0, problems0 = greedy_agreement(served["greedy_v0"][0], hf, tol)
    print(json.dumps({"logprob_diff_v1": d1, "bound": lp_tol, "logprob_diff_v0": d0, "greedy_equal_tokens": equal,
                      "of": len(PROMPTS) * NEW_TOKENS, "v0_equal_tokens": equal0, "sync": served["sync1"]}))
    assert d1 <= lp_tol, f"server log-probs after the reshard sync off the learner's by {d1} > {lp_tol}"
    assert not problems, problems
    assert equal >= len(PROMPTS) * NEW_TOKENS // 2, f"only {equal} greedy tokens compared"
    assert d0 > 100 * lp_tol and problems0  # control: the unsynced server fails both

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

import pytest

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import save_tiny_model
from tests.test_families_serve import BASE, FAMILIES, check_served_sync

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
    assert served["sync1"]["mode"] == "reshard"  # not the broadcast fallback
    check_served_sync(served, "deepseek_v3 reshard", sync=served["sync1"])

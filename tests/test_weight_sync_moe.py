"""Weight sync of a Qwen3-MoE learner with expert parallelism (EP2, 2 gloo ranks) into a real
SGLang CPU server (tests/dist/wsync_moe.py, one torchrun launch, one module-scoped server).

The tiny model: Qwen3-MoE, 2 layers, hidden 128, 2 heads of 64 (what SGLang's CPU attention
takes), 8 experts of 64, top-2 renormalised, vocab 512, bf16 on disk. Needs
AREAL_MEGA_SGLANG_PYTHON (set by `make test`); skipped without it.
"""

from __future__ import annotations

import pytest

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import save_tiny_model
from tests.support.numerics import bf16_tol, transformer_reductions

pytestmark = [pytest.mark.slow, needs_sglang]

MOE_SYNC = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, norm_topk_prob=True, max_position_embeddings=512)
# The same bound as tests/test_weight_sync_sglang.py: learner and server run the same bf16
# weights through different kernels; every reduction of the forward may round its bf16 output
# differently (R roundings of <= u relative to the logits, s = max |logits|), the log-softmax
# doubles it. The MoE layer adds the routing-weighted sum of top-k expert outputs (one more
# reduction per layer). No TP here, so no row-parallel partial sums. A token whose top-2 choice
# flips between the two kernels would move by O(s), far outside this bound.
ROUNDINGS = transformer_reductions(MOE_SYNC["num_hidden_layers"]) + MOE_SYNC["num_hidden_layers"]


def lp_tol(run: dict) -> float:
    return 2 * bf16_tol(1, run["logit_scale"], ops=ROUNDINGS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("wsync_moe")
    hf = save_tiny_model(work / "tiny-qwen3-moe", "qwen3_moe", dtype="bfloat16", **MOE_SYNC)
    icfg = InferenceConfig(
        num_servers=1,
        server=SGLangServerConfig(python=SGLANG_PYTHON, model_path=str(hf), device="cpu", max_total_tokens=4096,
                                  env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=400, log_dir=str(work / "logs")),
    )
    servers = launch_servers(icfg)
    try:
        yield run_dist_script("wsync_moe.py", 2, work, timeout_s=240,
                              args=("--hf-dir", hf, "--servers", ",".join(s.url for s in servers)))
    finally:
        for s in servers:
            s.stop()


def _maxdiff(a, b) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_expert_parallel_sync_matches_learner(run):
    srv = run["v1"][0]
    assert srv["version"] == "1"
    d = _maxdiff(srv["logprobs"], run["learner_v1"])
    print(f"max |server - learner| log-prob after EP2 sync: {d:.4f} (bound {lp_tol(run):.4f})")
    assert d <= lp_tol(run)
    # The update changed the model: a server left at v0 would fail the check above.
    assert _maxdiff(run["v0"][0]["logprobs"], run["learner_v1"]) > lp_tol(run)
    # every expert of both layers sent once (gate, up, down), in the planned buckets and bytes
    assert run["expert_tensors"] == 2 * 8 * 3
    assert run["sync1"]["buckets"] == run["plan"]["num_buckets"] and run["sync1"]["bytes"] == run["plan"]["bytes"]

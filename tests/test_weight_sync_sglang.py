"""Weight sync end to end: TP2 x PP2 megatron learner (4 gloo ranks) -> 2 real SGLang CPU servers.

One module fixture builds a tiny random Qwen2 (head_dim 64, tied embeddings, qkv bias), starts
both servers in parallel, and runs tests/dist/wsync_tp2pp2.py in ONE torchrun launch; the tests
below assert on what it recorded. Runtime ~2-3 min on 2 cores (server start dominates).
Needs AREAL_MEGA_SGLANG_PYTHON (set by `make test`); skipped without it.
"""

from __future__ import annotations

import json

import pytest
import torch

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import WSYNC_QWEN2, save_tiny_model
from tests.support.numerics import ROW_PARALLEL_PER_LAYER, bf16_tol, transformer_reductions

pytestmark = [pytest.mark.slow, needs_sglang]

# Learner (megatron, TP2 x PP2) and servers (SGLang) run the same bf16 weights through different
# kernels (tests/support/numerics.py): each reduction of the forward may round its bf16 output
# differently (fp32 accumulation, so one rounding: K = 1), the learner's TP-split ones round their
# partial sums too -- R = 26 + 8 = 34 roundings of <= u relative to the logits, s = max |logits|:
# |d z| <= bf16_tol(1, s, ops=R), and the log-softmax doubles it (|d lp| <= 2 max |d z|).
LAYERS = WSYNC_QWEN2["num_hidden_layers"]
ROUNDINGS = transformer_reductions(LAYERS) + ROW_PARALLEL_PER_LAYER * LAYERS


def lp_tol(run: dict, version: str) -> float:
    """Bound on |learner - server| log-probs at ``version`` (0.09 per unit of logit scale)."""
    return 2 * bf16_tol(1, run["logit_scale"][version], ops=ROUNDINGS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("wsync")
    hf = save_tiny_model(work / "tiny-qwen2", dtype="bfloat16", **WSYNC_QWEN2)
    icfg = InferenceConfig(
        num_servers=2,
        server=SGLangServerConfig(
            python=SGLANG_PYTHON,
            model_path=str(hf),
            device="cpu",
            max_total_tokens=4096,
            env={"OMP_NUM_THREADS": "1"},
            startup_timeout_s=400,  # 30-75 s alone; more when other suites run servers too
            log_dir=str(work / "logs"),
        ),
    )
    servers = launch_servers(icfg)
    try:
        res = run_dist_script("wsync_tp2pp2.py", 4, work, timeout_s=240,
                              args=("--hf-dir", hf, "--servers", ",".join(s.url for s in servers)))
        res["urls"] = [s.url for s in servers]
        res["hf"] = str(hf)
        yield res
    finally:
        for s in servers:
            s.stop()


def _maxdiff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_distributed_sync_matches_learner(run):
    v0 = run["v0"][0]["logprobs"]
    for srv in run["v1"]:
        assert srv["version"] == "1"
        assert _maxdiff(srv["logprobs"], run["learner_v1"]) <= lp_tol(run, "v1")
    # The update really changed the model: a server left at v0 would fail the check above.
    assert _maxdiff(v0, run["learner_v1"]) > lp_tol(run, "v1")
    plan = run["plan"]
    assert plan["num_buckets"] > 2 and run["sync1"]["buckets"] == plan["num_buckets"]
    assert run["sync1"]["bytes"] == plan["bytes"] == sum(plan["stage_bytes"])


def test_disk_sync_matches_learner(run):
    for srv in run["v2"]:
        assert srv["version"] == "2"
        assert _maxdiff(srv["logprobs"], run["learner_v2"]) <= lp_tol(run, "v2")
    assert _maxdiff(run["v1"][0]["logprobs"], run["learner_v2"]) > lp_tol(run, "v2")  # a server left at v1 fails


def test_interleaved_learner_sync(run):
    """A TP2 x PP2 x VPP2 learner (two model chunks per stage) syncs: the servers match its
    log-probs; syncing the v2 checkpoint again restores the v2 servers exactly."""
    assert run["plan_vpp"]["bytes"] == run["plan"]["bytes"]
    for srv in run["v3"]:
        assert srv["version"] == "3"
        assert _maxdiff(srv["logprobs"], run["learner_v3"]) <= lp_tol(run, "v3")
    assert _maxdiff(run["v2"][0]["logprobs"], run["learner_v3"]) > lp_tol(run, "v3")  # a server left at v2 fails
    for v2, v4 in zip(run["v2"], run["v4"]):
        assert v4["version"] == "4"
        assert v4["logprobs"] == v2["logprobs"]  # the same server, the same weights again: bit for bit


def test_mismatch_refused_servers_untouched(run):
    msg = run["mismatch_error"]
    assert msg is not None
    assert "'model.embed_tokens.weight': learner shape [640, 128] != server" in msg
    assert "shape [512, 128]" in msg
    for before, after in zip(run["v0"], run["after_mismatch"]):
        assert after["version"] == before["version"] == "0"
        assert after["logprobs"] == before["logprobs"]  # still the old weights, bit for bit


def test_mismatch_after_connect_resumes_servers_untouched(run):
    """Once connected the check runs beside the pause: a mismatch there resumes the servers
    (they answered /generate afterwards) with the v1 weights and version, bit for bit."""
    assert "learner shape" in (run["connected_mismatch_error"] or "")
    for before, after in zip(run["v1"], run["after_connected_mismatch"]):
        assert after["version"] == before["version"] == "1"
        assert after["logprobs"] == before["logprobs"]


@pytest.mark.parametrize("source", ["converted_dir", "disk_dir"])
def test_hf_export_greedy_equals_servers(run, source):
    """HF model converted by tools/convert_mcore_to_hf.py from the learner's v2 checkpoint (and
    the disk-sync export of v2) vs the servers (v2): same greedy continuations."""
    import urllib.request

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run[source], torch_dtype=torch.bfloat16)
    prompts = [[5, 17, 99, 3], [101, 102, 103], [7, 400, 1, 2, 3]]
    for p in prompts:
        hf = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        for url in run["urls"]:
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
            assert out["output_ids"] == hf, (p, url)

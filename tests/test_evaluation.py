"""``areal-mega eval`` (areal_mega/evaluation.py).

Pure (< 2 s): the unbiased pass@k estimator against hand-computed values, the summary's binomial
standard error, bad input -> one line and exit 2.

Slow (~2 min on 2 busy cores, one SGLang CPU server start dominates): the real command against a
real SGLang server (product's ``launch_servers``; the command points at it through
``inference.addresses``) on the tiny task model, 30 held-out items: its greedy accuracy equals an
independent greedy decode by HF transformers on the same items with the same reward (and every
completion matches); pass@k over 4 samples per item is consistent with the per-item samples;
``--max-items``; and a megatron checkpoint (tools/convert_hf_to_mcore.py) given as ``--model``
is exported through the one HF export path to the same weights, with the same result.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from areal_mega.cli import main
from areal_mega.evaluation import EvalSpec, binomial_se, pass_at_k, summarize
from tests.support.launch import SGLANG_PYTHON, child_env, needs_sglang, run_checked
from tests.support.models import EOS_ID, first_char_even, write_tiny_task


# ---------------------------------------------------------------- pure
def test_pass_at_k_unbiased_estimator_hand_computed() -> None:
    # 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), by hand:
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)          # = c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)     # C(3,2)=3, C(5,2)=10
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # C(7,4)=35, C(10,4)=210
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 2, 3) == 1.0  # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # large n: the product form stays exact
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summary_accuracy_and_binomial_se() -> None:
    rows = [{"correct": c, "reward": float(c), "sample_rewards": s, "num_correct": sum(s)}
            for c, s in [(True, [1, 1, 0, 0]), (False, [0, 0, 0, 0]), (True, [1, 0, 0, 0]), (False, [1, 1, 1, 1])]]
    out = summarize(rows, EvalSpec(num_samples=4, pass_k=(1, 2)))
    assert out["n"] == 4 and out["accuracy"] == 0.5
    assert out["accuracy_se"] == pytest.approx(math.sqrt(0.25 / 4)) == binomial_se(0.5, 4)
    assert out["pass@1"] == pytest.approx((0.5 + 0 + 0.25 + 1) / 4)
    assert out["pass@2"] == pytest.approx(((1 - 1 / 6) + 0 + 0.5 + 1) / 4)  # C(2,2)/C(4,2)=1/6; C(3,2)/C(4,2)=1/2


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/m"], "--model: /nonexistent/m does not exist"),
    (["--model", ".", "--num-samples", "2", "--pass-k", "3"], "--pass-k: k=3 needs 1 <= k <= --num-samples (2)"),
    (["--model", ".", "--pass-k", "a,b"], "--pass-k: 'a,b' is not a comma-separated list"),
    (["--model", "tests"], "--model: tests is neither an HF model directory"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path) -> None:
    rc = main(["eval", "--config", "configs/grpo_tiny.yaml", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


# ---------------------------------------------------------------- a real server
NUM_TEST = 30
MAX_NEW = 4  # configs/grpo_tiny.yaml's workflow.sampling.max_new_tokens


def _hf_greedy(model_dir: Path, prompts: list[str]) -> list[str]:
    """Independent greedy decode: HF transformers, fp32, argmax token by token, EOS stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(p, add_special_tokens=False)
            new: list[int] = []
            for _ in range(MAX_NEW):
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(nxt)
                if nxt == EOS_ID:
                    break
            out.append(tok.decode(new, skip_special_tokens=True))
    return out


@pytest.mark.slow
@needs_sglang
@pytest.mark.timeout(900)
def test_eval_command_on_a_real_server_equals_hf_greedy(tmp_path: Path) -> None:
    from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
    from areal_mega.inference.server import launch_servers

    model_dir, data_dir = write_tiny_task(tmp_path / "tiny", num_test=NUM_TEST)
    ckpt = tmp_path / "ckpt"
    run_checked([sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", str(model_dir), "--out", str(ckpt)],
                timeout_s=300)
    servers = launch_servers(InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=SGLANG_PYTHON, model_path=str(model_dir), device="cpu", dtype="float32", max_total_tokens=4096,
        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900, log_dir=str(tmp_path / "logs"))))
    try:
        common = ["--config", "configs/grpo_tiny.yaml", "--no-progress", f"eval_data.path={data_dir / 'test.jsonl'}",
                  "reward.options.function=tests.support.models:first_char_even", "reward.options.isolate=false",
                  f"inference.addresses=[\"{servers[0].address}\"]"]

        def run(model: Path, out: Path, *extra: str) -> dict:
            proc = run_checked([sys.executable, "-m", "areal_mega.cli", "eval", "--model", str(model), "--out", str(out),
                                *common, *extra], timeout_s=600, env=child_env())
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            assert summary == json.loads((out / "summary.json").read_text())
            return summary

        full = run(model_dir, tmp_path / "e1", "--num-samples", "4", "--pass-k", "1,2,4", "--temperature", "1.0")
        short = run(ckpt, tmp_path / "e2", "--max-items", "7")
    finally:
        for s in servers:
            s.close()

    rows = [json.loads(x) for x in (tmp_path / "e1" / "items.jsonl").read_text().splitlines()]
    items = [json.loads(x) for x in (data_dir / "test.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [it["id"] for it in items] and full["n"] == NUM_TEST
    hf = _hf_greedy(model_dir, [it["prompt"] for it in items])
    assert [r["completion"] for r in rows] == hf  # fp32 server and fp32 HF: the same argmax at every step
    expected = sum(first_char_even("", c, {}) for c in hf) / NUM_TEST
    assert 0 < expected < 1, "the check needs an accuracy that is neither 0 nor 1"
    assert full["accuracy"] == expected
    assert full["accuracy_se"] == pytest.approx(math.sqrt(expected * (1 - expected) / NUM_TEST))
    # pass@k from the rows' own samples (4 at temperature 1): monotone in k and consistent
    assert all(len(r["sample_rewards"]) == 4 for r in rows)
    assert full["pass@1"] == pytest.approx(sum(r["num_correct"] / 4 for r in rows) / NUM_TEST)
    assert full["pass@1"] <= full["pass@2"] <= full["pass@4"]
    assert full["pass@4"] == pytest.approx(sum(r["num_correct"] > 0 for r in rows) / NUM_TEST)
    # the checkpoint went through the one HF export path: same weights, same greedy completions
    from safetensors.torch import load_file

    exported, original = load_file(str(tmp_path / "e2" / "hf-ckpt" / "model.safetensors")), load_file(
        str(model_dir / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k].float(), original[k].float()) for k in original)
    rows2 = [json.loads(x) for x in (tmp_path / "e2" / "items.jsonl").read_text().splitlines()]
    assert short["n"] == 7 and [r["completion"] for r in rows2] == hf[:7]

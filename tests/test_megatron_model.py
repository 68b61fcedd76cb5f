"""megatron-core models vs HF transformers on CPU (gloo), across TP/PP layouts, plus the
conversion tools. One 4-rank torchrun launch plus two short plain-python runs:

* tests/dist/model_layouts.py (4 ranks): tiny Qwen2 (untied, qkv bias, GQA) and Llama (tied, GQA)
  at TP1, TP2, PP2, TP2xPP2, PP2 x VPP2 -> logits vs HF, export bit-exactness, negative controls,
  dist checkpoint TP2 -> PP2, shape-mismatch errors;
  and, in the same launch, tools/convert_hf_to_mcore.py at TP2xPP2 then tools/convert_mcore_to_hf.py
  at PP2: HF -> megatron -> HF is bit-exact;
* two single-process tool runs that must fail before writing anything, with one error line (exit
  2, no traceback). The checkpoint format itself: tests/test_checkpoint.py.

Upstream behaviour pinned here: transformers' Qwen2/Llama forward (eager attention, fp32) is the
reference; packed sequences with a block-diagonal causal mask must equal per-sequence HF logits
(RoPE is relative, FACTS section 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import child_env, run_checked, torchrun_cmd
from tests.support.models import tiny_model
from tests.support.numerics import fp32_tol, transformer_reductions

pytestmark = pytest.mark.slow  # every test reads the torchrun launch's results or runs a tool
LENS = [7, 13, 4, 10]  # packed sequences of different lengths
# The two models: 4 layers, vocab 300, MLP 96; random norms and biases too (noise), so that a
# misplaced one shows.
MODELS = {
    "qwen2_untied": dict(family="qwen2", tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, noise_seed=1),
    "llama_tied": dict(family="llama", tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5, noise_seed=2),
}
COMMON = dict(vocab_size=300, intermediate_size=96, max_position_embeddings=256, noise=0.1)


def logits_tol(ref: torch.Tensor) -> float:
    """fp32 logits of the same weights computed two ways -- megatron (packed, any layout) vs HF
    per sequence, or two layouts: every reduction of the forward but the log-softmax (25) may run
    in another order, of up to K = 96 terms (MLP; hidden 64, sequences <= 13), relative to the
    largest |logit| (tests/support/numerics.py)."""
    return fp32_tol(96, float(ref.abs().max()), ops=transformer_reductions(4) - 1)


def _run_tool(args: list[str], timeout: float):
    """A conversion tool run (plain python) that is expected to fail: stdout + stderr merged."""
    return run_checked([sys.executable, *args], timeout_s=timeout, env=child_env(PYTHONWARNINGS="ignore"),
                       merge_stderr=True, check=False)


def _make_models(work: Path) -> dict:
    g = torch.Generator().manual_seed(0)
    ref = {}
    ids = torch.randint(0, 300, (sum(LENS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)))
    for name, kw in MODELS.items():
        m = tiny_model(**kw, **COMMON)
        m.config._attn_implementation = "eager"
        m.save_pretrained(work / name)
        (work / name / "tokenizer_config.json").write_text(json.dumps({"marker": name}))
        with torch.no_grad():
            logits = torch.cat([m(ids[cu[i] : cu[i + 1]].view(1, -1)).logits[0] for i in range(len(LENS))])
        ref[name] = {"input_ids": ids, "cu_seqlens": cu, "logits": logits.float()}
    torch.save(ref, work / "ref.pt")
    return ref


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    work = tmp_path_factory.mktemp("mcore_layouts")
    ref = _make_models(work)
    run_checked(torchrun_cmd(4, "tests/dist/model_layouts.py", "--work-dir", work, "--out", work / "results.pt"),
                timeout_s=400, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    return work, ref, torch.load(work / "results.pt")


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double(), -1)
    out = []
    for i in range(len(cu) - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        out.append(lp[s : e - 1].gather(-1, ids[s + 1 : e, None])[:, 0])
    return torch.cat(out)


def test_logits_match_hf_every_layout(layouts):
    _, ref, res = layouts
    for name, r in ref.items():
        assert set(res["logits"][name]) == {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp1pp2vpp2"}
        for key, lg in res["logits"][name].items():
            assert lg.shape == r["logits"].shape, (name, key)
            diff = (lg - r["logits"]).abs().max().item()
            assert diff <= logits_tol(r["logits"]), f"{name} {key}: max |megatron - HF| = {diff}"
        base = _logprobs(res["logits"][name]["tp1pp1"], r["input_ids"], r["cu_seqlens"])
        assert base.numel() == sum(LENS) - len(LENS)
        for key, lg in res["logits"][name].items():
            d = (_logprobs(lg, r["input_ids"], r["cu_seqlens"]) - base).abs().max().item()
            # log-softmax: |d lp| <= 2 max |d logit|
            assert d <= 2 * logits_tol(res["logits"][name]["tp1pp1"]), f"{name} {key}: per-token logprob differs from TP1 by {d}"


def test_export_is_bit_exact_and_complete(layouts):
    work, ref, res = layouts
    from areal_mega.models import get_adapter

    for name in ref:
        all_names = set(get_adapter(work / name).hf_names())
        for key, ranks in res["export"][name].items():
            seen = []
            for pp, tp, dp, same, diff, names in ranks:
                if dp != 0:
                    continue
                assert diff == 0, f"{name} {key} stage {pp} tp {tp}: {diff} tensors differ"
                assert same == len(names)
                if tp == 0:
                    seen += names
            assert sorted(seen) == sorted(all_names), (name, key)  # each tensor exactly once
            assert ("lm_head.weight" in all_names) == (name == "qwen2_untied")


def test_negative_controls_fail(layouts):
    _, ref, res = layouts
    for name, (adapter, lg) in res["negative"].items():
        diff = (lg - ref[name]["logits"]).abs().max().item()
        # a broken mapping would pass test_logits_match_hf_every_layout if it moved the logits by less
        assert diff > logits_tol(ref[name]["logits"]), f"{adapter}: a broken mapping went unnoticed (diff {diff})"


def test_checkpoint_saved_tp2_loads_pp2(layouts):
    _, ref, res = layouts
    for name, (step, saved_layout, lg) in res["ckpt"].items():
        assert step == 3 and "tp=2" in saved_layout and "pp=1" in saved_layout
        # same layout (PP2), same weights => identical logits to the PP2 model loaded from HF
        d = (lg - res["logits"][name]["tp1pp2"]).abs().max().item()
        assert d == 0.0, f"{name}: PP2 logits from the TP2 checkpoint differ by {d}"


def test_shape_mismatch_errors_name_tensor_and_shapes(layouts):
    _, _, res = layouts
    e = res["errors"]
    for name in ("qwen2_untied", "llama_tied"):
        assert e[f"{name}/hf"] == "model.embed_tokens.weight: checkpoint shape (300, 64) != model shape (300, 128)"
        assert e[f"{name}/hf_untouched"] is True  # validated before any parameter was written
        # ffn doubled: whichever MLP tensor megatron lists first, with both global shapes
        assert e[f"{name}/ckpt"] in (
            "decoder.layers.mlp.linear_fc1.weight: checkpoint shape (4, 192, 64) != model shape (4, 384, 64)",
            "decoder.layers.mlp.linear_fc2.weight: checkpoint shape (4, 64, 96) != model shape (4, 64, 192)",
        ), e[f"{name}/ckpt"]


def test_conversion_tools_roundtrip_bit_exact(layouts):
    import transformers
    from safetensors.torch import load_file

    work, _, _ = layouts
    src, ck, out = work / "llama_tied", work / "tool_ckpt", work / "tool_hf"
    from areal_mega.megatron.checkpoint import FORMAT, read_metadata

    meta = read_metadata(ck)  # the one format (tests/test_checkpoint.py): weights only, a policy
    assert meta["format"] == FORMAT and meta["role"] == "policy" and meta["contents"] == ["model"]
    assert meta["saved_layout"].startswith("dp=1 pp=2 cp=1 tp=2") and meta["train_state"] is None
    assert not (work / ".tool_ckpt.partial").exists()  # staged, then renamed into place
    a = load_file(src / "model.safetensors")
    b = {}
    for f in sorted(out.glob("*.safetensors")):
        b.update(load_file(f))
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-exact: {bad[:5]}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(a)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in a.values())
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"marker": "llama_tied"}
    m = transformers.AutoModelForCausalLM.from_pretrained(out)  # config.json is a valid HF config
    assert m.config.tie_word_embeddings and m.config.hidden_size == 64


def test_conversion_tool_errors_before_writing(layouts, tmp_path):
    import shutil

    import transformers

    d = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(d)
    r = _run_tool(["tools/convert_hf_to_mcore.py", "--hf-dir", str(d), "--out", str(tmp_path / "o1")], 120)
    assert r.returncode == 2 and "known model types: ['deepseek_v3', 'deepseek_v32', 'glm4_moe', 'glm_moe_dsa', 'gpt_oss', 'kimi_k25', 'llama', 'mixtral', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_moe', 'qwen3_next']" in r.stdout, r.stdout[-3000:]
    assert "Traceback" not in r.stdout, r.stdout[-3000:]  # one line, not a stack
    assert not (tmp_path / "o1").exists()

    src = tmp_path / "qwen2_untied"
    shutil.copytree(layouts[0] / "qwen2_untied", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    r = _run_tool(["tools/convert_hf_to_mcore.py", "--hf-dir", str(src), "--out", str(tmp_path / "o2")], 200)
    want = "model.layers.0.mlp.gate_proj.weight: checkpoint shape (96, 64) != model shape (128, 64)"
    assert r.returncode == 2 and want in r.stdout and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "o2").exists()

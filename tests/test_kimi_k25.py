"""Kimi-K2.5 (kimi_k25, areal_mega/models/kimi_k25.py) vs transformers 5.19's
Kimi_K25ForConditionalGeneration, fp32, CPU, from the released checkpoint layout
(``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*``,
``mm_projector.*``; config.json as released: KimiK25ForConditionalGeneration, text_config
``kimi_k2``), written here from a tiny random model (transformers 5.19's save_pretrained writes
the language model's layers as ``blocks``, which its own loader maps back: renamed to the released
``layers`` here; transformers loads both alike, checked).

* make test's row (in this process, TP1): packed log-probs = HF's within the fp32 bound, the
  export (weight sync's path) bit-exact, parameter counts = transformers' language model; control:
  one layer's kv_b_proj dropped. Pure: the adapter names the language model only, refusals.
* families_serve (make test-families-serve): TP1, TP2, PP2, EP2, EP2 x TP2, EP2 x PP2 in one 4-rank
  launch (tests/dist/family_layouts.py), a control, export bit-exact at every layout, the
  conversion tools' round trip bit-exact (vision tower copied); the sync stream into SGLang's own
  KimiK25ForConditionalGeneration loader. Numbers: docs/engine.md "Kimi-K2.5".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

LENS = [7, 13, 4, 10]
VOCAB = 300
# Kimi-K2.5's text_config in small: one routing group (n_group 1), routed scale 2.827, one shared
# expert, a dense first layer, YaRN as released (factor 64, beta_fast 32, mscale = mscale_all_dim
# = 1: the softmax scale changes) over 64 original positions; top-2 of 8 (released: top-8 of 384).
TEXT = dict(model_type="kimi_k2", vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8,
            routed_scaling_factor=2.827, norm_topk_prob=True, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
            max_position_embeddings=4096, tie_word_embeddings=False,
            moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",  # released keys transformers' config lacks
            rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=64.0, original_max_position_embeddings=64,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
VISION = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=48,
              pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
RELEASED_KEYS = dict(architectures=["KimiK25ForConditionalGeneration"], media_placeholder_token_id=163605,
                     use_unified_vision_chunk=True, video_placeholder="<|kimi_k25_video_placeholder|>",
                     auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config"})
FROZEN = ("vision_tower.", "mm_projector.")


def tiny_kimi(seed: int = 0, noise_seed: int = 9):
    """A tiny random Kimi_K25ForConditionalGeneration (fp32, eager attention), std-0.1 noise on
    every weight and on the routing bias (so a misplaced norm or bias shows)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Kimi_K25Config(text_config=dict(TEXT), vision_config=VISION, projection_hidden_size=32,
                         tie_word_embeddings=False)
    m = Kimi_K25ForConditionalGeneration(cfg).float().eval()
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=g) * 0.1)
    m.config._attn_implementation = "eager"
    m.config.text_config._attn_implementation = "eager"
    return m


def save_released(m, path: Path) -> Path:
    """``m`` saved in the released Kimi-K2.5 layout (see the module doc) with a released-style config."""
    from safetensors.torch import load_file, save_file

    m.save_pretrained(path)
    f = path / "model.safetensors"
    sd = load_file(f)
    renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
               .replace("model.mm_projector.", "mm_projector."): v for k, v in sd.items()}
    save_file(renamed, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(RELEASED_KEYS)
    cfg["text_config"]["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def packed_reference(m) -> dict:
    from tests.support.models import packed_hf_logits

    return packed_hf_logits(m, LENS, VOCAB, 0)


def logits_tol(ref: torch.Tensor) -> float:
    """fp32 logits of the same weights two ways (megatron packed, any layout, vs HF per sequence):
    2 layers' reductions of up to K = 128 terms (MLP 96, the experts 32 + shared 32, attention
    4 x 24) relative to the largest |logit| (tests/support/numerics.py). The log-prob bound is 2x
    (|d log p| <= 2 max |d logit|). Routing is discrete: a flipped top-k tie fails it."""
    from tests.support.numerics import fp32_tol, transformer_reductions

    return fp32_tol(128, float(ref.abs().max()), ops=transformer_reductions(2) - 1)


def language_model_params(m) -> int:
    """transformers' language-model parameters of a Kimi_K25ForConditionalGeneration (untied lm_head)."""
    return sum(p.numel() for n, p in m.named_parameters() if n.startswith(("model.language_model.", "lm_head.")))


# ---------------------------------------------------------------- pure (no megatron)
def test_adapter_names_the_language_model_of_the_released_layout(tmp_path):
    """The released layout's language model, name for name and shape for shape (vision tower and
    projector not in the plan); transformers loads that layout as its own; the memory model counts
    transformers' language-model parameters; refusals are one line naming the key."""
    from transformers import Kimi_K25ForConditionalGeneration

    from areal_mega.megatron.model import HFCheckpointReader
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.simulator.memory import total_params

    m = tiny_kimi()
    d = save_released(m, tmp_path / "kimi")
    disk = HFCheckpointReader(d)
    ad = get_adapter(d)
    frozen = {n for n in disk.names() if n.startswith(FROZEN)}
    assert frozen and set(ad.hf_names()) == set(disk.names()) - frozen
    assert all(ad.hf_shape(n) == disk.shape(n) for n in ad.hf_names())
    assert all(n.startswith(("language_model.model.layers.", "language_model.model.embed_tokens.",
                             "language_model.model.norm.", "language_model.lm_head.")) for n in ad.hf_names())
    back = Kimi_K25ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).state_dict()
    assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())
    a = ad.arch
    assert (a.architecture, a.moe_num_groups, a.moe_scaling_factor, a.yarn.factor, a.yarn.beta_fast) == \
        ("KimiK25ForConditionalGeneration", None, 2.827, 64.0, 32.0)
    assert total_params(a) == language_model_params(m)
    # the same network through DeepSeek-V3's adapter (the text config alone)
    from areal_mega.models.moe_families import DeepseekV3Adapter

    text = {**m.config.text_config.to_dict(), "architectures": None}
    assert {**DeepseekV3Adapter(text).arch.__dict__, "model_type": "", "architecture": ""} == \
        {**a.__dict__, "model_type": "", "architecture": ""}
    cfg = load_hf_config(d)
    for bad, msg in (
        ({**cfg, "quantization_config": {"quant_method": "compressed-tensors"}}, "^quantization_config: a quantized"),
        ({**cfg, "text_config": {**cfg["text_config"], "quantization_config": {"format": "pack-quantized"}}},
         "^text_config.quantization_config: a quantized"),
        ({**cfg, "text_config": {**cfg["text_config"], "model_type": "qwen3"}}, "^text_config.model_type: 'qwen3'"),
        ({**cfg, "foo": 1}, "^foo: config key not implemented by the kimi_k25 adapter"),
        ({**cfg, "architectures": ["KimiK25ForCausalLM"]}, "^architectures: "),
        ({**cfg, "text_config": {**cfg["text_config"], "topk_method": "greedy"}}, "^topk_method: 'greedy'"),
    ):
        with pytest.raises(ValueError, match=msg):
            get_adapter(bad)
    assert get_adapter({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}).arch.tie_word_embeddings  # HF's default


# ---------------------------------------------------------------- make test's row: TP1 in this process
@pytest.fixture(scope="module", autouse=True)
def _world_released():
    """The megatron world of one set up here is torn down after this module (later modules expect
    no default process group in the pytest process)."""
    from tests.support.dist import megatron_world_released

    yield from megatron_world_released()


def test_tp1_logprobs_match_hf_from_the_released_layout(tmp_path):
    """kimi_k25 through the model registry at TP1 (build_model / load_hf_weights / export_hf_weights)
    on the released layout: four sequences packed in one row vs each alone in HF, fp32 log-probs;
    parameters = transformers' language model; export bit-exact and complete; control: layer 1's
    kv_b_proj read as zeros (one MLA block dropped) -> far off."""

    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from tests.dist.family_layouts import dropping
    from tests.support.models import packed_logprobs

    m = tiny_kimi()
    d = save_released(m, tmp_path / "kimi")
    ref = packed_reference(m)
    from tests.support.dist import megatron_world_of_one

    groups = megatron_world_of_one()
    try:
        model = build_model(d, groups, MegatronModelConfig(layer_spec="local"))
        load_hf_weights(model, d)
        (mc,) = model.chunks
        pad = 2 * (model.padded_vocab_size - VOCAB) * 64  # zero vocab-padding rows of embedding + output layer
        assert sum(p.numel() for p in mc.parameters()) - pad == language_model_params(m)
        disk = HFCheckpointReader(d)
        out = dict(export_hf_weights(model))
        assert sorted(out) == sorted(n for n in disk.names() if not n.startswith(FROZEN))
        assert all(torch.equal(out[n], disk.read(n)) for n in out)
        ids, cu = ref["input_ids"], ref["cu_seqlens"]
        hf_lp = packed_logprobs(ref["logits"], ids, cu)
        tol = 2 * logits_tol(ref["logits"])
        lg = forward_logits(model, ids, cu)
        e = (packed_logprobs(lg, ids, cu) - hf_lp).abs().max().item()
        dl = (lg - ref["logits"]).abs().max().item()  # rms_norm_eps 1e-5 on the MLA latent norms: 7e-5 here
        print(f"kimi_k25 TP1 packed log-probs: max|mc-hf|={e:.2e} bound={tol:.2e}; logits {dl:.2e} <= {tol / 2:.2e}")
        assert e <= tol and dl <= tol / 2
        cfg = load_hf_config(d)
        neg = build_model(d, groups, adapter=dropping(type(get_adapter(cfg)), "layers.1.self_attn.kv_b_proj.weight")(cfg))
        load_hf_weights(neg, d)
        bad = (packed_logprobs(forward_logits(neg, ids, cu), ids, cu) - hf_lp).abs().max().item()
        print(f"kimi_k25 control (layer 1 kv_b_proj dropped): {bad:.2e}")
        assert bad > 100 * tol
    finally:
        destroy_model_parallel(groups)


# ---------------------------------------------------------------- make test-families-serve: every layout
def HEAVY(test):
    """make test-families-serve's rows (torchrun: slow)."""
    return pytest.mark.slow(pytest.mark.families_serve(test))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tests/dist/family_layouts.py (4 gloo ranks) over the released-layout checkpoint alone."""
    from tests.support.launch import child_env, run_checked, torchrun_cmd

    work = tmp_path_factory.mktemp("kimi_k25_layouts")
    m = tiny_kimi()
    save_released(m, work / "kimi_k25")
    ref = {"kimi_k25": packed_reference(m)}
    torch.save(ref, work / "ref.pt")
    run_checked(torchrun_cmd(4, "tests/dist/family_layouts.py", "--work-dir", work, "--out", work / "results.pt"),
                timeout_s=1500, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    return work, ref["kimi_k25"], torch.load(work / "results.pt"), language_model_params(m)


@HEAVY
def test_layouts_logprobs_match_hf(layouts):
    """TP1 (x DP4), TP2 (SP), PP2, EP2, EP2 x TP2, EP2 x PP2 vs HF per sequence, and the control
    (PP2, layer 1's kv_b_proj dropped) far outside the bound."""
    from tests.dist.family_layouts import LAYOUTS, key_of
    from tests.support.models import packed_logprobs

    _, r, res, _ = layouts
    ids, cu = r["input_ids"], r["cu_seqlens"]
    assert set(res["logits"]["kimi_k25"]) == {key_of(*lay) for lay in LAYOUTS}
    tol = logits_tol(r["logits"])
    hf_lp = packed_logprobs(r["logits"], ids, cu)
    table = {}
    for key, lg in res["logits"]["kimi_k25"].items():
        d = (lg - r["logits"]).abs().max().item()
        dlp = (packed_logprobs(lg, ids, cu) - hf_lp).abs().max().item()
        table[key] = (f"{dlp:.2e}", f"{2 * tol:.2e}")
        assert d <= tol and dlp <= 2 * tol, f"kimi_k25 {key}: |logit diff| {d}, |log-prob diff| {dlp}, bound {tol}"
    (name, lg), = [v for c, v in res["negative"].items() if c.startswith("kimi_k25")]
    bad = (packed_logprobs(lg, ids, cu) - hf_lp).abs().max().item()
    print("kimi_k25 max |log-prob megatron - HF|, bound:", table, f"control: {bad:.2e}")
    assert name == "kimi_k25" and bad > 100 * 2 * tol


@HEAVY
def test_layouts_export_bit_exact_each_tensor_once(layouts):
    """export_hf (live sync / conversion) at every layout: the language model's tensors once each,
    bit-identical to the released-layout file; the vision tower and projector are not sent."""
    from areal_mega.megatron.model import HFCheckpointReader
    from areal_mega.models import get_adapter

    work, _, res, _ = layouts
    names = get_adapter(work / "kimi_k25").hf_names()
    assert set(names) == {n for n in HFCheckpointReader(work / "kimi_k25").names() if not n.startswith(FROZEN)}
    for key, rows in res["export"]["kimi_k25"].items():
        seen = []
        for pp, tp, dp, ep, same, diff, none, got in [x for x in rows if x is not None]:
            assert diff == 0, f"{key} stage {pp}: {diff} tensors differ"
            if tp == 0 and dp == 0 and ep == 0:
                assert none == 0 and same == len(got)
                seen += got
        assert sorted(seen) == sorted(names), key


@HEAVY
def test_conversion_tools_roundtrip_bit_exact(layouts):
    """HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) with tools/convert_*: every tensor of the released
    layout bit-exact, the vision tower and projector included (copied from the source), config.json's
    model_type and architecture (the released name, which SGLang picks its class by) kept."""
    from areal_mega.megatron.model import HFCheckpointReader

    work, _, _, _ = layouts
    a, b = HFCheckpointReader(work / "kimi_k25"), HFCheckpointReader(work / "kimi_k25_hf")
    assert sorted(a.names()) == sorted(b.names())
    bad = [n for n in a.names() if not torch.equal(a.read(n), b.read(n))]
    assert not bad, bad[:5]
    cfg = json.loads((work / "kimi_k25_hf" / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("kimi_k25", ["KimiK25ForConditionalGeneration"])


# SGLang 0.5.23's DeepseekV2 loader rules (deepseek_v2.py / deepseek_weight_loader.py), written out
# here independently of the adapter: HF module -> (SGLang fused parameter, part index).
_SGLANG_FUSED = {"self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj_with_mqa", 0),
                 "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj_with_mqa", 1),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# the tiny vision tower under SGLang's KimiK25VisionConfig names (built, never loaded: it stays NaN)
SGLANG_VISION = dict(patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2, hidden_size=32,
                     num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, vt_hidden_size=32,
                     vt_num_hidden_layers=1, vt_num_attention_heads=2, vt_intermediate_size=48, mm_hidden_size=32,
                     text_hidden_size=64, merge_kernel_size=[2, 2])


def sglang_reference(ckpt: dict) -> dict:
    """What SGLang's TP1 KimiK25ForConditionalGeneration parameters must hold after loading the
    checkpoint's language model: MLA's q_a / kv_a fused, gate/up fused (dense and shared MLPs),
    routed experts stacked into FusedMoE's w13 = [gate; up] and w2 = down per expert."""
    import re

    parts: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # module -> expert -> gate / up / down
    out = {}
    for n, t in ckpt.items():
        if n.startswith(FROZEN):
            continue
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", n)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
            continue
        for hf, (fused, i) in _SGLANG_FUSED.items():
            if n.endswith(f".{hf}.weight"):
                parts.setdefault(n[: -len(f"{hf}.weight")] + f"{fused}.weight", {})[i] = t
                break
        else:
            out[n] = t
    for mod, per in experts.items():
        out[f"{mod}.w13_weight"] = torch.stack([torch.cat([per[e]["gate"], per[e]["up"]]) for e in sorted(per)])
        out[f"{mod}.w2_weight"] = torch.stack([per[e]["down"] for e in sorted(per)])
    out.update({k: torch.cat([v[i] for i in sorted(v)]) for k, v in parts.items()})
    return out


@HEAVY
def test_sync_stream_loads_into_sglangs_own_model(layouts, tmp_path):
    """SGLang 0.5.23 cannot serve Kimi-K2.5 here (docs/engine.md "Kimi-K2.5": its multimodal
    processor needs Moonshot's remote-code processor), so the sync is checked against SGLang's
    own loader: the stream the learner's export sends at EP2 x TP2 goes through SGLang's
    KimiK25ForConditionalGeneration ``load_weights`` in-process (tests/support/sglang_load.py);
    every language-model parameter must be written and equal the checkpoint mapped by SGLang's
    loader rules (bit for bit), the vision tower untouched. Controls: a stream without one layer's
    kv_a_proj_with_mqa leaves the fused q_a / kv_a parameter unwritten; expert 3's gate rows
    reversed make layer 1's w13 differ."""
    from areal_mega.megatron.model import HFCheckpointReader
    from tests.support.launch import SGLANG_PYTHON, child_env, run_checked

    if not SGLANG_PYTHON:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (run through make test-families-serve)")
    work, _, _, _ = layouts
    cfg = json.loads((work / "kimi_k25" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vision_config": SGLANG_VISION}))
    stream = torch.load(work / "kimi_k25_sync.pt")
    kv_a, gate = ("language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                  "language_model.model.layers.1.mlp.experts.3.gate_proj.weight")
    assert {kv_a, gate} <= {n for n, _ in stream}
    torch.save([(n, t) for n, t in stream if n != kv_a], tmp_path / "dropped.pt")
    torch.save([(n, t.flip(0) if n == gate else t) for n, t in stream], tmp_path / "flipped.pt")
    jobs = [{"label": label, "config": str(tmp_path / "config.json"), "stream": str(f)}
            for label, f in (("sync", work / "kimi_k25_sync.pt"), ("dropped", tmp_path / "dropped.pt"),
                             ("flipped", tmp_path / "flipped.pt"))]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run_checked([SGLANG_PYTHON, "tests/support/sglang_load.py", "--jobs", tmp_path / "jobs.json",
                 "--out", tmp_path / "out.pt"], timeout_s=600, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    res = torch.load(tmp_path / "out.pt")
    disk = HFCheckpointReader(work / "kimi_k25")
    want = sglang_reference({n: disk.read(n) for n in disk.names()})
    got = res["sync"]
    lm = {n for n in got if not n.startswith(FROZEN)}
    assert lm == set(want), sorted(lm ^ set(want))[:5]
    for n in lm:  # vocab rows past the checkpoint's (SGLang's padding) are not the sync's
        assert torch.equal(got[n][: want[n].shape[0]], want[n]), n
    vision = [n for n in got if n.startswith(FROZEN)]
    assert vision and all(got[n].isnan().all() for n in vision)
    fused = "language_model.model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert res["dropped"][fused].isnan().all() and not got[fused].isnan().any()
    w13 = "language_model.model.layers.1.mlp.experts.w13_weight"
    assert not torch.equal(res["flipped"][w13], got[w13]) and torch.equal(res["flipped"][w13][:3], got[w13][:3])

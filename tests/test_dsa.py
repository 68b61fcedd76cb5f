"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): DeepSeek sparse attention on MLA in
megatron-core 0.16.1 (DSAIndexer inside areal_mega's PackedDSAttention; compat entry 17) vs
transformers 5.19, fp32, CPU.

Every sequence is longer than index_topk, so the indexer really drops keys: the controls show
that (the same weights with the indexer's top-k >= the sequence, i.e. dense attention, are far
off HF's sparse model) and that the indexer's head-row permutation matters (loaded unpermuted:
far off).

* make test: V3.2 at TP1 in this process (log-probs, controls, export bit-exact, parameter
  counts = transformers', the indexer frozen and out of the optimizer's reach).
* make test-families-serve (marker families_serve): TP2 (SP), PP2, EP2 for V3.2 and GLM-5 in one
  2-rank launch (tests/dist/dsa_layouts.py), the conversion tools' round trip, the sync stream
  loaded by SGLang's own DeepseekV32 model class (no server: SGLang cannot serve DSA on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.dist import megatron_world_of_one

LENS = [7, 13, 4, 10]  # > TOPK except one: sparsity selects in three of four sequences
TOPK = 5
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
              max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
              head_dim=8, v_head_dim=12, index_topk=TOPK, index_head_dim=16, index_n_heads=4, noise=0.1)
MODELS = {
    # V3.2 shape: YaRN with mscale_all_dim (the softmax scale and the indexer's RoPE change), 4 groups
    # of 2 experts keep 2, routed scaling, a dense first layer
    "deepseek_v32": dict(family="deepseek_v32", num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, noise_seed=6,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                              mscale=1.0, mscale_all_dim=1.0)),
    # GLM-5 shape: no expert groups, rms_norm_eps 1e-5 (the indexer's LayerNorm keeps 1e-6), plain RoPE
    "glm_moe_dsa": dict(family="glm_moe_dsa", num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        routed_scaling_factor=2.5, rms_norm_eps=1e-5, noise_seed=7),
}


def tiny(name: str):
    from tests.support.models import tiny_model

    m = tiny_model(**MODELS[name], **COMMON)
    m.config._attn_implementation = "eager"
    return m


def packed_reference(m, seed: int = 3) -> dict:
    """HF logits of LENS random sequences, each run alone."""
    from tests.support.models import packed_hf_logits

    return packed_hf_logits(m, LENS, VOCAB, seed)


def logprob_tol(ref_logits: torch.Tensor) -> float:
    """fp32 log-probs of the same weights two ways (megatron packed, any layout, vs HF per
    sequence): 2 layers' reductions of up to K = 128 terms (MLP 96, shared expert 32, attention
    4 x 24, the indexer's 4 heads x 16) relative to the largest |logit| (tests/support/numerics.py),
    x 2 for the log-softmax (|d log p| <= 2 max |d logit|). The indexer's top-k is discrete: a
    flipped near-tie moves a token by O(1) and fails the bound, which is the point."""
    from tests.support.numerics import fp32_tol, transformer_reductions

    return 2 * fp32_tol(128, float(ref_logits.abs().max()), ops=transformer_reductions(2) - 1)


@pytest.fixture(scope="module", autouse=True)
def _world_released():
    """This module's megatron world of one is torn down after it (later modules expect none)."""
    from tests.support.dist import megatron_world_released

    yield from megatron_world_released()


def test_v32_train_step_keeps_the_indexer_frozen(tmp_path):
    """One engine train step (PPO-like loss, packed rows longer than index_topk): the indexer's
    weights are unchanged and out of the optimizer (no grad buffer), every other weight moves."""
    from areal_mega.megatron.engine import MegatronTrainEngine
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from areal_mega.models.base import unwrap
    from tests.dist.engine_checks import engine_cfg, make_batch, make_loss_fn  # the engine tests' batch and loss

    tiny("deepseek_v32").save_pretrained(tmp_path)
    groups = megatron_world_of_one()
    try:
        from areal_mega.models import load_hf_config

        engine = MegatronTrainEngine.create(engine_cfg(64), load_hf_config(tmp_path), groups, str(tmp_path))
        params = dict(unwrap(engine.chunks[0]).named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        batch = make_batch()
        loss_fn, _ = make_loss_fn(batch)
        stats = engine.train_batch(batch, loss_fn)
        assert torch.isfinite(torch.tensor(stats["grad_norm"]))
        indexer = {n for n in params if ".core_attention.indexer." in n}
        assert len(indexer) == 10 and all(not params[n].requires_grad for n in indexer)
        moved = {n for n in params if not torch.equal(params[n].detach(), before[n])}
        assert not moved & indexer
        # every trained weight moves (the expert bias is a buffer; experts no token chose may not)
        still = set(params) - moved - indexer
        assert all(".mlp.experts." in n for n in still), sorted(still)[:5]
    finally:
        destroy_model_parallel(groups)


def test_v32_tp1_logprobs_match_hf_sparse_and_controls(tmp_path):
    """deepseek_v32 through the registry at TP1 (build_model / load_hf_weights / export_hf_weights):
    four sequences packed in one row vs each alone in HF; controls: dense attention (index_topk
    past every sequence), the indexer rows unpermuted, and megatron's own DSAttention.forward
    (its sparse attention masks with a plain triu: a query with fewer than top-k keys in its own
    sequence attends to the previous one), all far off."""
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.models.dsa import DeepseekV32Adapter
    from tests.dist.dsa_layouts import unpermuted
    from tests.support.models import packed_logprobs

    hf = tiny("deepseek_v32")
    hf.save_pretrained(tmp_path)
    ref = packed_reference(hf)
    ids, cu = ref["input_ids"], ref["cu_seqlens"]
    groups = megatron_world_of_one()
    try:
        with pytest.raises(ValueError, match="^actor.model.layer_spec: te is not supported for deepseek_v32"):
            build_model(tmp_path, groups, MegatronModelConfig(layer_spec="te"))
        model = build_model(tmp_path, groups, MegatronModelConfig())
        load_hf_weights(model, tmp_path)
        (mc,) = model.chunks
        pad = 2 * (model.padded_vocab_size - VOCAB) * 64  # zero vocab-padding rows of embedding + output layer
        assert sum(p.numel() for p in mc.parameters()) - pad == sum(p.numel() for p in hf.parameters())
        frozen = {n for n, p in mc.named_parameters() if not p.requires_grad}
        assert frozen and all(".core_attention.indexer." in n for n in frozen)
        assert len(frozen) == 5 * 2  # wq_b, wk, k_norm weight + bias, weights_proj; 2 layers
        disk = HFCheckpointReader(tmp_path)
        out = dict(export_hf_weights(model))
        assert sorted(out) == sorted(disk.names()) and all(torch.equal(out[n], disk.read(n)) for n in out)
        hf_lp = packed_logprobs(ref["logits"], ids, cu)
        tol = logprob_tol(ref["logits"])

        def err(m):
            return (packed_logprobs(forward_logits(m, ids, cu), ids, cu) - hf_lp).abs().max().item()

        e = err(model)
        cfg = load_hf_config(tmp_path)
        dense = build_model(tmp_path, groups, adapter=get_adapter({**cfg, "index_topk": max(LENS)}))
        load_hf_weights(dense, tmp_path)
        bad_dense = err(dense)
        swapped = build_model(tmp_path, groups, adapter=unpermuted(DeepseekV32Adapter)(cfg))
        load_hf_weights(swapped, tmp_path)
        bad_perm = err(swapped)
        from unittest import mock

        from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

        from areal_mega.megatron.sparse_attention import PackedDSAttention

        with mock.patch.object(PackedDSAttention, "forward", DSAttention.forward):  # megatron's own: triu mask
            bad_triu = err(model)
        print(f"deepseek_v32 TP1 packed log-probs: max|mc-hf|={e:.2e} bound={tol:.2e}; controls: dense "
              f"{bad_dense:.2e}, indexer rows unpermuted {bad_perm:.2e}, megatron's DSAttention.forward "
              f"(sequences shorter than the top-k see the previous one) {bad_triu:.2e}")
        assert e <= tol
        assert bad_dense > 100 * tol and bad_perm > 100 * tol and bad_triu > 100 * tol
    finally:
        destroy_model_parallel(groups)


LAYOUT = pytest.mark.families_serve


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tests/dist/dsa_layouts.py (2 gloo ranks) over V3.2 and GLM-5."""
    from tests.support.dist import run_layouts_script

    work = tmp_path_factory.mktemp("dsa_layouts")
    ref = {}
    for name in MODELS:
        m = tiny(name)
        m.save_pretrained(work / name)
        ref[name] = packed_reference(m)
    torch.save(ref, work / "ref.pt")
    return work, ref, run_layouts_script("tests/dist/dsa_layouts.py", work, timeout_s=1500)


@LAYOUT
def test_layouts_logprobs_match_hf(layouts):
    """TP1 x DP2, TP2 (SP), PP2, EP2 for V3.2 and GLM-5 vs HF per sequence (sparse: TOPK < LENS)."""
    from tests.dist.dsa_layouts import LAYOUTS, key_of
    from tests.support.models import packed_logprobs

    _, ref, res = layouts
    table = {}
    for name, r in ref.items():
        assert set(res["logits"][name]) == {key_of(*lay) for lay in LAYOUTS}
        hf_lp = packed_logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])
        tol = logprob_tol(r["logits"])
        for key, lg in res["logits"][name].items():
            d = (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
            table[f"{name}/{key}"] = (d, tol)
            assert d <= tol, f"{name} {key}: |log-prob diff| {d} > bound {tol}"
    print("max |log-prob megatron - HF|, bound:", json.dumps(table, indent=1))


@LAYOUT
def test_layouts_negative_controls(layouts):
    from tests.dist.dsa_layouts import NEGATIVE
    from tests.support.models import packed_logprobs

    _, ref, res = layouts
    assert set(res["negative"]) == set(NEGATIVE)
    out = {}
    for control, (name, lg) in res["negative"].items():
        r = ref[name]
        d = (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"])
             - packed_logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])).abs().max().item()
        out[control] = d
        assert d > 100 * logprob_tol(r["logits"]), (control, d)
    print("controls, max |log-prob diff|:", json.dumps(out))


@LAYOUT
def test_layouts_export_bit_exact_each_tensor_once(layouts):
    from areal_mega.megatron.model import HFCheckpointReader
    from areal_mega.models import get_adapter

    work, ref, res = layouts
    for name in ref:
        names = get_adapter(work / name).hf_names()
        assert len(names) == len(set(names)) and set(names) == set(HFCheckpointReader(work / name).names())
        for key, rows in res["export"][name].items():
            seen = []
            for pp, sender, same, diff, got in [r for r in rows if r is not None]:
                assert diff == 0, f"{name} {key} stage {pp}: {diff} tensors differ"
                if sender:
                    assert same == len(got), (name, key, pp)
                    seen += got
            assert sorted(seen) == sorted(names), (name, key)


@LAYOUT
def test_conversion_tools_roundtrip_bit_exact(layouts):
    from tests.dist.dsa_layouts import ROUNDTRIP
    from tests.support.models import hf_dir_tensors

    work, _, _ = layouts
    for name in ROUNDTRIP:
        a, b = hf_dir_tensors(work / name), hf_dir_tensors(work / f"{name}_hf")
        assert sorted(a) == sorted(b), name
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        assert not bad, f"{name} not bit-exact: {bad[:5]}"
        cfg = json.loads((work / f"{name}_hf" / "config.json").read_text())
        assert cfg["model_type"] == name


def _sglang_reference(ckpt: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """What SGLang's TP1 DeepseekV2-family parameters hold after loading the checkpoint: q_a_proj
    and kv_a_proj_with_mqa fused, gate / up fused (dense and shared MLPs), experts stacked as
    w13 [E, 2f, h] and w2 [E, h, f]; the rest (the indexer included) by their HF names."""
    out, cat = {}, {}
    for n, t in ckpt.items():
        head, _, leaf = n.rpartition(".")
        mod, _, proj = head.rpartition(".")
        if ".experts." in n:
            continue
        if proj in ("q_a_proj", "kv_a_proj_with_mqa"):
            cat.setdefault(f"{mod}.fused_qkv_a_proj_with_mqa.{leaf}", {})[proj == "kv_a_proj_with_mqa"] = t
        elif proj in ("gate_proj", "up_proj"):
            cat.setdefault(f"{mod}.gate_up_proj.{leaf}", {})[proj == "up_proj"] = t
        else:
            out[n] = t
    out.update({k: torch.cat([v[0], v[1]]) for k, v in cat.items()})
    layers = {n.split(".experts.")[0] for n in ckpt if ".experts." in n}
    for pre in layers:
        e = range(num_experts)
        out[f"{pre}.experts.w13_weight"] = torch.stack(
            [torch.cat([ckpt[f"{pre}.experts.{i}.gate_proj.weight"], ckpt[f"{pre}.experts.{i}.up_proj.weight"]]) for i in e])
        out[f"{pre}.experts.w2_weight"] = torch.stack([ckpt[f"{pre}.experts.{i}.down_proj.weight"] for i in e])
    return out


@LAYOUT
def test_sync_stream_loads_into_sglangs_own_model(layouts, tmp_path):
    """SGLang cannot serve DSA on CPU (docs/engine.md: its Indexer has no CPU path), so the sync is
    checked against SGLang's own loader: the stream the learner's export sends at TP2 goes through
    SGLang 0.5.23's DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM ``load_weights`` in-process
    (tests/support/sglang_load.py); every parameter is written and equals the checkpoint mapped
    by SGLang's rules, bit for bit (the indexer's by its HF names: no permutation on SGLang's side).
    Control: a stream without one layer's indexer wk leaves SGLang's parameter unwritten (NaN)."""
    from areal_mega.megatron.model import HFCheckpointReader
    from tests.support.launch import SGLANG_PYTHON, child_env, run_checked

    if not SGLANG_PYTHON:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (run through make test-families-serve)")
    work, ref, _ = layouts
    jobs = [{"label": n, "config": str(work / n / "config.json"), "stream": str(work / f"{n}_sync_tp2.pt")}
            for n in MODELS]
    drop = "model.layers.1.self_attn.indexer.wk.weight"
    torch.save([(n, t) for n, t in torch.load(work / "deepseek_v32_sync_tp2.pt") if n != drop], tmp_path / "dropped.pt")
    jobs.append({"label": "dropped", "config": jobs[0]["config"], "stream": str(tmp_path / "dropped.pt")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run_checked([SGLANG_PYTHON, "tests/support/sglang_load.py", "--jobs", str(tmp_path / "jobs.json"),
                 "--out", str(tmp_path / "out.pt")], timeout_s=600, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    res = torch.load(tmp_path / "out.pt")
    for name in MODELS:
        disk = HFCheckpointReader(work / name)
        want = _sglang_reference({n: disk.read(n) for n in disk.names()}, COMMON["n_routed_experts"])
        got = res[name]
        assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
        for n in got:  # vocab rows past the checkpoint's (SGLang's padding) are not the sync's; SGLang
            # holds the indexer's weights_proj in bf16 whatever the model's dtype (dsa_indexer.py:372)
            assert torch.equal(got[n][: want[n].shape[0]], want[n].to(got[n].dtype)), (name, n)
        assert {n for n, t in got.items() if t.dtype != want[n].dtype} == {
            n for n in got if n.endswith("indexer.weights_proj.weight")}
    assert res["dropped"][drop].isnan().all()
    assert not any(t.isnan().any() for n, t in res["dropped"].items() if n != drop)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_memory_model_counts_transformers_params(name):
    """The memory model's count (the indexer as frozen per-layer weights) = transformers' own."""
    from areal_mega.models import get_adapter
    from areal_mega.simulator.memory import count_params, total_params

    with torch.device("meta"):
        hf = tiny(name)
    arch = get_adapter(hf.config.to_dict()).arch
    assert total_params(arch) == sum(p.numel() for p in hf.parameters())
    assert count_params(arch).layer_frozen == 4 * 16 * 24 + 16 * 64 + 2 * 16 + 4 * 64  # wq_b, wk, k_norm, weights_proj


def _cfg(name: str, **kw) -> dict:
    with torch.device("meta"):
        return {**tiny(name).config.to_dict(), **kw}


@pytest.mark.parametrize("name, over, error", [
    ("glm_moe_dsa", dict(indexer_types=["full", "shared"]), r"^indexer_types: \['full', 'shared'\] is not supported"),
    ("deepseek_v32", dict(layer_types=["indexed_attention", "full_attention"]), r"^layer_types: .* is not supported"),
    ("deepseek_v32", dict(q_lora_rank=None), r"^q_lora_rank: None is not supported for deepseek_v32"),
    ("deepseek_v32", dict(mlp_layer_types=["sparse", "sparse"]), r"^mlp_layer_types: .* is not supported"),
    ("deepseek_v32", dict(index_head_dim=4), r"^index_head_dim: 4 must be >= qk_rope_head_dim\(8\)"),
])
def test_config_refusals_name_the_key(name, over, error):
    from areal_mega.models import get_adapter

    with pytest.raises(ValueError, match=error):
        get_adapter(_cfg(name, **over))


def test_context_parallel_refused_in_one_line():
    from areal_mega.megatron.model import MegatronModelConfig, check_sparse_attention
    from areal_mega.models import get_adapter
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    arch = get_adapter(_cfg("deepseek_v32")).arch
    lay = ParallelLayout.build(ParallelConfig(context_parallel=2), 2)
    with pytest.raises(ValueError, match=r"^parallel.context_parallel: 2 > 1 is not supported for deepseek_v32"):
        check_sparse_attention(arch, MegatronModelConfig(), lay)

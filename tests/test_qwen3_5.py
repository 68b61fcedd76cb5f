"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (gated DeltaNet hybrids) vs transformers 5.19, fp32, CPU.

* Layer level (megatron-core 0.16.1 GatedDeltaNet on its torch delta rule, compat entry 13; the
  gated attention): outputs equal HF's, packed rows reset the recurrent state at every sequence
  boundary (PackedGatedDeltaNet: megatron's GDN refuses packed_seq_params, pinned here).
* Through the model registry (build_model / load_hf_weights / export_hf_weights): the text model
  at TP1 in this process (make test's row); TP1 x DP2, TP2, PP2 (dense, VL), EP2 (MoE, Qwen3-Next)
  and TP2 with sequence parallelism (text, MoE, Qwen3-Next) in one 2-rank launch
  (tests/dist/qwen3_5_layouts.py) with negative controls, export bit-exact, the conversion tools'
  round trip, compat entry 14 (out_norm gradient at TP2 = HF's), the TP2 + SP gradients of the
  SP-marked params = HF's, one engine step at TP2 + SP = TP1's, and the sync stream loaded by
  SGLang's own model classes (no server: SGLang cannot serve it on CPU).
* Pure: the adapters' TP pieces agree, the VL adapters name the language model only, the memory
  model counts the parameters transformers does. Numbers: docs/engine.md "Qwen3.5".
"""

from __future__ import annotations

import pytest
import torch

from areal_mega.models.qwen3_5 import _PARTS, gated_qkv_hf_to_mcore, gated_qkv_mcore_to_hf

# One DeltaNet layer's HF <-> megatron tensors (keys relative to the module), for the layer-level
# checks below; the whole-model mapping is the adapter's (its "parts" fusion).
_SAME = {"conv1d.weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias",
         "norm.weight": "out_norm.weight", "out_proj.weight": "out_proj.weight"}


def gdn_hf_to_mcore(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One HF ``linear_attn`` module's tensors (keys relative to it) -> megatron GatedDeltaNet's."""
    out = {"in_proj.weight": torch.cat([hf[f"{p}.weight"] for p in _PARTS], dim=0)}
    out.update({m: hf[h] for h, m in _SAME.items()})
    return out


def gdn_mcore_to_hf(mc: dict[str, torch.Tensor], sizes: tuple[int, int, int, int]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`gdn_hf_to_mcore`; ``sizes`` = rows of (qkv, z, b, a):
    (2 * key_dim + value_dim, value_dim, num_v_heads, num_v_heads)."""
    out = {f"{p}.weight": t for p, t in zip(_PARTS, torch.split(mc["in_proj.weight"], list(sizes), dim=0))}
    out.update({h: mc[m] for h, m in _SAME.items()})
    return out


def gdn_sizes(c: dict) -> tuple[int, int, int, int]:
    """Row counts of HF's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) from a qwen3_5 text config."""
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vd = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return (2 * kd + vd, vd, c["linear_num_value_heads"], c["linear_num_value_heads"])


# The layer-level checks run in `make test-families-serve` (the families target); `make test` keeps
# the one whole-model row (test_whole_text_model_logprobs_match_hf_packed), which covers them all.
LAYER = pytest.mark.families_serve
CFG = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)


def _megatron_world_of_one() -> None:
    from areal_mega.megatron import cpu_compat
    from areal_mega.megatron.compat import enable_torch_gated_delta_net
    from areal_mega.megatron.parallel_state import init_process_group_for_script

    cpu_compat.apply()
    init_process_group_for_script()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        if ps._GLOBAL_MEMORY_BUFFER is not None:  # set alone by an earlier test (test_core_attention)
            ps.destroy_global_memory_buffer()
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1)
    enable_torch_gated_delta_net()


@pytest.fixture(scope="module", autouse=True)
def _world_released():
    """What this module's megatron world of one sets up is torn down after it: later modules
    (test_workflow) expect no default process group in the pytest process."""
    from tests.support.dist import megatron_world_released

    yield from megatron_world_released()


@pytest.fixture(scope="module")
def layers():
    _megatron_world_of_one()
    import torch.nn.functional as F
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer import TransformerConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(**CFG)
    hf = Qwen3_5GatedDeltaNet(hc, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random everything (HF's init leaves norm = 1, dt_bias = 1)
            p.add_(0.3 * torch.randn_like(p))
    tcfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, normalization="RMSNorm", layernorm_epsilon=1e-6, activation_func=F.silu,
        gated_linear_unit=True, add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 1, 1, 0],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4)
    b = LocalSpecProvider()
    sub = GatedDeltaNetSubmodules(in_proj=b.column_parallel_linear(), out_norm=b.layer_norm(rms_norm=True),
                                  out_proj=b.row_parallel_linear())
    mc = GatedDeltaNet(tcfg, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
    sd = gdn_hf_to_mcore(hf.state_dict())
    mc.load_state_dict(sd, strict=True)
    return hf, mc, hc


def _mc(mc, x):  # [b, s, h] -> megatron [s, b, h] and back
    return mc(x.transpose(0, 1).contiguous(), attention_mask=None)[0].transpose(0, 1)


@LAYER
def test_gdn_layer_matches_hf(layers):
    hf, mc, hc = layers
    torch.manual_seed(1)
    x = torch.randn(2, 37, 64)  # 37 > the 64-chunk? no: one partial chunk; 150 below crosses chunks
    x2 = torch.randn(1, 150, 64)
    with torch.no_grad():
        for xi in (x, x2):
            ref, got = hf(xi), _mc(mc, xi)
            # fp32, outputs O(1): the chunked rule's matmuls reduce over <= 64 positions x 16 dims; an
            # fp32 rounding bound of ~(64*16) * 2**-24 * |ref| rounds up to 1e-4 * max|ref|.
            tol = 1e-4 * ref.abs().max().item()
            err = (ref - got).abs().max().item()
            print(f"gdn s={xi.shape[1]}: max|mc-hf|={err:.2e} bound={tol:.2e}")
            assert err <= tol, (err, tol)
        # negative control: z and b rows swapped in the fused projection -> far off
        w = mc.in_proj.weight.data.clone()
        q, z, bb, a = torch.split(w, list(gdn_sizes(CFG)), dim=0)
        bad = torch.cat([q, z.roll(1, 0), bb, a])  # z's rows mis-ordered
        mc.in_proj.weight.data.copy_(bad)
        try:
            err_bad = (hf(x) - _mc(mc, x)).abs().max().item()
        finally:
            mc.in_proj.weight.data.copy_(w)
        print(f"gdn control: {err_bad:.2e}")
        assert err_bad > 100 * tol, err_bad


@LAYER
def test_gdn_mapping_round_trip_bit_exact(layers):
    hf, mc, _ = layers
    back = gdn_mcore_to_hf(mc.state_dict(), gdn_sizes(CFG))
    ref = hf.state_dict()
    assert set(back) == set(ref)
    assert all(torch.equal(back[k], ref[k]) for k in ref)
    assert sum(p.numel() for p in mc.parameters()) == sum(p.numel() for p in hf.parameters())


@LAYER
def test_gdn_packing_refused_upstream(layers):
    """Packed rows need the state reset at boundaries; megatron-core 0.16.1 refuses THD for GDN."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _, mc, _ = layers
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    with pytest.raises(NotImplementedError, match="packed sequence"):
        mc(torch.randn(12, 1, 64), attention_mask=None, packed_seq_params=p)


def test_segment_starts_from_packed_mask():
    from areal_mega.megatron.linear_attention import segment_starts
    from areal_mega.megatron.model import packed_causal_mask

    assert segment_starts(None, 9) == [0]
    assert segment_starts(packed_causal_mask(torch.tensor([0, 4, 5, 9])), 9) == [0, 4, 5]
    # padding past cu_seqlens[-1] (each pad its own "sequence") merges into one segment
    assert segment_starts(packed_causal_mask(torch.tensor([0, 4, 9]), 14), 14) == [0, 4, 9]


@LAYER
def test_packed_rows_reset_the_recurrent_state(layers):
    """Three sequences packed in one row (block-diagonal mask, padding) == each run alone in HF."""
    from areal_mega.megatron.linear_attention import PackedGatedDeltaNet
    from areal_mega.megatron.model import packed_causal_mask

    hf, mc, _ = layers
    mc.__class__ = PackedGatedDeltaNet  # same parameters, the packed forward
    try:
        torch.manual_seed(2)
        lens = [7, 70, 5]
        xs = [torch.randn(1, n, 64) for n in lens]
        row = torch.cat(xs + [torch.randn(1, 3, 64)], dim=1)  # + 3 padding tokens
        cu = torch.tensor([0, 7, 77, 82])
        with torch.no_grad():
            got = mc(row.transpose(0, 1).contiguous(), packed_causal_mask(cu, 85))[0].transpose(0, 1)
            ref = torch.cat([hf(x) for x in xs], dim=1)
            tol = 1e-4 * ref.abs().max().item()  # as in test_gdn_layer_matches_hf
            err = (got[:, :82] - ref).abs().max().item()
            print(f"gdn packed vs separate: {err:.2e} bound={tol:.2e}")
            assert err <= tol, (err, tol)
            # negative control: the unpacked layer (state runs across boundaries) is far off
            leak = (_unpacked(mc, row)[:, :82] - ref).abs().max().item()
            assert leak > 100 * tol, leak
    finally:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet

        mc.__class__ = GatedDeltaNet


def _unpacked(mc, row):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    return GatedDeltaNet.forward(mc, row.transpose(0, 1).contiguous(), None)[0].transpose(0, 1)


@LAYER
def test_gated_attention_layer_matches_hf():
    """Qwen3.5's full-attention layer: HF q_proj rows per head [q; gate] -> megatron's
    attention_output_gate layout, zero-centred q/k norms, partial rotary (0.25; text-only mrope =
    identical position streams = plain RoPE), causal. Controls: no RoPE, q/gate swapped."""
    _megatron_world_of_one()
    import torch.nn.functional as F
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding

    from areal_mega.megatron.linear_attention import ZeroCenteredRMSNorm
    from areal_mega.megatron.model import packed_causal_mask

    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(**CFG)
    hc._attn_implementation = "eager"
    hf = Qwen3_5Attention(hc, layer_idx=3).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tcfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True,
        add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True, attention_output_gate=True,
        qk_layernorm=True)
    sa = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True).submodules.self_attention
    sa.submodules.q_layernorm = sa.submodules.k_layernorm = ZeroCenteredRMSNorm
    sa.params = {"attn_mask_type": AttnMaskType.causal}
    mc = build_module(sa, config=tcfg, layer_number=4).eval()
    h = hf.state_dict()
    qkv = gated_qkv_hf_to_mcore(h["q_proj.weight"], h["k_proj.weight"], h["v_proj.weight"], 2, 16)
    mc.load_state_dict({"linear_qkv.weight": qkv, "linear_proj.weight": h["o_proj.weight"],
                        "q_layernorm.weight": h["q_norm.weight"], "k_layernorm.weight": h["k_norm.weight"]}, strict=False)
    back = gated_qkv_mcore_to_hf(mc.linear_qkv.weight.data, 2, 16)
    assert all(torch.equal(a, h[f"{n}_proj.weight"]) for a, n in zip(back, "qkv"))  # round trip bit-exact
    S = 29
    x = torch.randn(1, S, 64)
    cos, sin = Qwen3_5TextRotaryEmbedding(hc)(x, torch.arange(S)[None])
    remb = RotaryEmbedding(kv_channels=16, rotary_percent=0.25, rotary_base=hc.rope_parameters["rope_theta"])(S)
    mask = packed_causal_mask(torch.tensor([0, S]))

    def run(emb):
        return mc(x.transpose(0, 1).contiguous(), mask, rotary_pos_emb=emb)[0].transpose(0, 1)

    with torch.no_grad():
        ref = hf(x, (cos, sin), torch.full((S, S), float("-inf")).triu(1)[None, None])[0]
        tol = 1e-5 * ref.abs().max().item()  # fp32, reductions over <= 64 terms: ~64 * 2**-24 relative
        err = (run(remb) - ref).abs().max().item()
        print(f"gated attention: max|mc-hf|={err:.2e} bound={tol:.2e}")
        assert err <= tol
        assert (run(None) - ref).abs().max().item() > 100 * tol  # RoPE is applied
        swapped = h["q_proj.weight"].view(4, 2, 16, 64).flip(1).reshape(-1, 64)  # q <-> gate per head
        mc.linear_qkv.weight.data.copy_(gated_qkv_hf_to_mcore(swapped, h["k_proj.weight"], h["v_proj.weight"], 2, 16))
        assert (run(remb) - ref).abs().max().item() > 100 * tol


LENS = [7, 40, 13]
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16, patch_size=4, temporal_patch_size=1, spatial_merge_size=1)


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def _tiny(kind: str = "text", seed: int = 0):
    """A tiny random Qwen3_5ForCausalLM ("text"), Qwen3_5ForConditionalGeneration ("vl"),
    Qwen3_5MoeForCausalLM ("moe": 8 experts top-2 + a gated shared expert) or Qwen3NextForCausalLM
    ("moe_next": the same MoE, layer 1 a dense MLP, in_proj fused per key-head group), fp32, eager attention,
    weights moved off HF's init (norms 0/1, dt_bias 1, router 0) by 0.1 x N(0, 1)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    if kind == "moe_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

        m = Qwen3NextForCausalLM(Qwen3NextConfig(**CFG, **MOE, mlp_only_layers=[1]))
    elif kind == "moe":
        m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in CFG.items() if k != "intermediate_size"},
                                                       **MOE))
    elif kind == "text":
        m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CFG))
    else:
        m = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=CFG, vision_config=VISION))
    m.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.float().eval()


def _packed_reference(m, seed: int = 3) -> dict:
    from tests.support.models import packed_hf_logits

    return packed_hf_logits(m, LENS, 300, seed)


def logprob_tol(ref_logits: torch.Tensor) -> float:
    """fp32 log-probs of the same weights two ways (megatron packed, any layout, vs HF per
    sequence): 4 layers' reductions of up to K = 128 terms (MLP 96, the DeltaNet's 64-token chunks,
    attention heads 4 x 16) relative to the largest |logit| (tests/support/numerics.py), x 2 for
    the log-softmax (|d log p| <= 2 max |d logit|)."""
    from tests.support.numerics import fp32_tol, transformer_reductions

    return 2 * fp32_tol(128, float(ref_logits.abs().max()), ops=transformer_reductions(4) - 1)


def test_whole_text_model_logprobs_match_hf_packed(tmp_path):
    """qwen3_5_text through the model registry (build_model / load_hf_weights / export_hf_weights,
    TP1): Qwen3_5ForCausalLM (3 DeltaNet + 1 gated attention layers) with three sequences packed
    in one row vs each alone in HF, fp32 log-probs; parameter counts equal transformers'; the
    export (weight sync's path) bit-exact; control: one DeltaNet layer's A_log / dt_bias swapped."""

    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from tests.support.models import packed_logprobs

    hf = _tiny("text")
    hf.save_pretrained(tmp_path)
    ref = _packed_reference(hf)
    from tests.support.dist import megatron_world_of_one

    groups = megatron_world_of_one()
    try:
        with pytest.raises(ValueError, match="^actor.model.layer_spec: te is not supported for qwen3_5_text"):
            build_model(tmp_path, groups, MegatronModelConfig(layer_spec="te"))
        model = build_model(tmp_path, groups, MegatronModelConfig())
        load_hf_weights(model, tmp_path)
        (mc,) = model.chunks
        pad = 2 * (model.padded_vocab_size - 300) * 64  # zero vocab-padding rows of embedding + output layer
        assert sum(p.numel() for p in mc.parameters()) - pad == sum(p.numel() for p in hf.parameters())
        disk = HFCheckpointReader(tmp_path)
        out = dict(export_hf_weights(model))
        assert sorted(out) == sorted(disk.names()) and all(torch.equal(out[n], disk.read(n)) for n in out)
        ids, cu = ref["input_ids"], ref["cu_seqlens"]
        hf_lp = packed_logprobs(ref["logits"], ids, cu)
        tol = logprob_tol(ref["logits"])

        def err():
            return (packed_logprobs(forward_logits(model, ids, cu), ids, cu) - hf_lp).abs().max().item()

        e = err()
        print(f"qwen3_5_text TP1 packed log-probs: max|mc-hf|={e:.2e} bound={tol:.2e}")
        assert e <= tol
        gdn = mc.decoder.layers[1].self_attention
        with torch.no_grad():
            a, d = gdn.A_log.data.clone(), gdn.dt_bias.data.clone()
            gdn.A_log.data.copy_(d), gdn.dt_bias.data.copy_(a)  # one block mis-mapped
        bad = err()
        print(f"qwen3_5 control (layer 1 A_log <-> dt_bias): {bad:.2e}")
        assert bad > 100 * tol
    finally:
        destroy_model_parallel(groups)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """tests/dist/qwen3_5_layouts.py (2 gloo ranks) over the text model and the VL checkpoint."""
    from tests.support.dist import run_layouts_script

    work = tmp_path_factory.mktemp("qwen3_5_layouts")
    ref = {}
    for kind, seed in (("text", 0), ("vl", 1), ("moe", 2), ("moe_next", 3)):
        m = _tiny(kind, seed)
        m.save_pretrained(work / kind)
        ref[kind] = _packed_reference(m)
    torch.save(ref, work / "ref.pt")
    return work, ref, run_layouts_script("tests/dist/qwen3_5_layouts.py", work, timeout_s=1200)


@LAYER
def test_layouts_logprobs_match_hf(layouts):
    """TP1 (x DP2), TP2, PP2 for qwen3_5_text and the qwen3_5 VL checkpoint; TP1 (x DP2), PP2, EP2
    for qwen3_5_moe_text and qwen3_next; TP2 with sequence parallelism for the text model and both
    MoE models; vs HF per sequence."""
    from tests.dist.qwen3_5_layouts import key_of, layouts_of
    from tests.support.models import packed_logprobs

    _, ref, res = layouts
    table = {}
    for name, r in ref.items():
        assert set(res["logits"][name]) == {key_of(*lay) for lay in layouts_of(name)}
        hf_lp = packed_logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])
        tol = logprob_tol(r["logits"])
        for key, lg in res["logits"][name].items():
            d = (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"]) - hf_lp).abs().max().item()
            table[f"{name}/{key}"] = (d, tol)
            assert d <= tol, f"{name} {key}: |log-prob diff| {d} > bound {tol}"
    print("max |log-prob megatron - HF|, bound:", table)


@LAYER
def test_layouts_negative_controls(layouts):
    from tests.dist.qwen3_5_layouts import NEGATIVE
    from tests.support.models import packed_logprobs

    _, ref, res = layouts
    assert set(res["negative"]) == set(NEGATIVE)
    for control, (name, lg) in res["negative"].items():
        r = ref[name]
        d = (packed_logprobs(lg, r["input_ids"], r["cu_seqlens"])
             - packed_logprobs(r["logits"], r["input_ids"], r["cu_seqlens"])).abs().max().item()
        print(f"control {control}: {d:.2e}")
        assert d > 100 * logprob_tol(r["logits"]), (control, d)


@LAYER
def test_layouts_export_bit_exact_each_tensor_once(layouts):
    """export_hf (live sync / conversion) at every layout: every HF tensor of the language model
    once, bit-identical; the VL checkpoint's vision tower is not in the plan (not synced)."""
    from areal_mega.megatron.model import HFCheckpointReader
    from areal_mega.models import get_adapter

    work, ref, res = layouts
    for name in ref:
        names = get_adapter(work / name).hf_names()
        disk = set(HFCheckpointReader(work / name).names())
        vision = {n for n in disk if n.startswith("model.visual.")}
        assert bool(vision) == (name == "vl") and set(names) == disk - vision
        for key, rows in res["export"][name].items():
            seen = []
            for pp, sender, same, diff, got in [r for r in rows if r is not None]:
                assert diff == 0, f"{name} {key} stage {pp}: {diff} tensors differ"
                if sender:
                    assert same == len(got)
                    seen += got
            assert sorted(seen) == sorted(names), (name, key)


@LAYER
def test_conversion_tools_roundtrip_bit_exact(layouts):
    """HF -> megatron (PP2) -> HF (TP2) with tools/convert_*: every tensor bit-exact, the VL
    checkpoint's vision tower included (copied from the source), the config's model_type kept."""
    import json

    from areal_mega.megatron.model import HFCheckpointReader

    from tests.dist.qwen3_5_layouts import ROUNDTRIP

    work, _, _ = layouts
    for name in ROUNDTRIP:
        a, b = HFCheckpointReader(work / name), HFCheckpointReader(work / f"{name}_hf")
        assert sorted(a.names()) == sorted(b.names()), name
        bad = [n for n in a.names() if not torch.equal(a.read(n), b.read(n))]
        assert not bad, f"{name} not bit-exact: {bad[:5]}"
        cfg = json.loads((work / f"{name}_hf" / "config.json").read_text())
        assert cfg["model_type"] == json.loads((work / name / "config.json").read_text())["model_type"]


def test_vl_adapter_maps_the_language_model_only():
    """The released VL checkpoint (model_type qwen3_5): its adapter plans exactly the language
    model's tensors (``model.language_model.*`` + ``lm_head``; the vision tower is not synced), with
    the text adapter's architecture; configs it cannot run are refused in one line naming the key."""
    from areal_mega.models import get_adapter

    with torch.device("meta"):
        vl = _tiny("vl")
    sd = vl.state_dict()
    ad = get_adapter(vl.config.to_dict())
    assert set(ad.hf_names()) == {k for k in sd if not k.startswith("model.visual.")}
    assert all(ad.hf_shape(k) == tuple(sd[k].shape) for k in ad.hf_names())
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    text_cfg = Qwen3_5TextConfig(**CFG).to_dict()
    text = get_adapter(text_cfg)
    assert {**ad.arch.__dict__, "model_type": "", "architecture": ""} == \
        {**text.arch.__dict__, "model_type": "", "architecture": ""}
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    moe_text = {**{k: v for k, v in CFG.items() if k != "intermediate_size"}, **MOE}
    with torch.device("meta"):  # the MoE VL checkpoint: its language model, experts one tensor each on disk
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

        vm = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=moe_text, vision_config=VISION))
    mad = get_adapter(vm.config.to_dict())
    per_expert = {n for n in mad.hf_names() if ".mlp.experts." in n}
    assert len(per_expert) == 4 * 8 * 3 and mad.arch.moe_shared_expert_gate and mad.arch.moe_norm_topk_prob
    fused = {k for k in vm.state_dict() if not k.startswith("model.visual.")}  # transformers fuses on load
    assert set(mad.hf_names()) - per_expert == {k for k in fused if ".mlp.experts." not in k}
    with pytest.raises(ValueError, match="^foo: config key not implemented"):
        get_adapter({**vl.config.to_dict(), "foo": 1})
    with pytest.raises(ValueError, match="^full_attention_interval: 2 disagrees with layer_types"):
        get_adapter({**text_cfg, "full_attention_interval": 2})
    with pytest.raises(ValueError, match="^attn_output_gate: false"):
        get_adapter({**text_cfg, "attn_output_gate": False})
    assert get_adapter({**text_cfg, "full_attention_interval": 4, "mtp_num_hidden_layers": 1}).arch == text.arch
    with pytest.raises(ValueError, match="^rope_parameters.rope_type"):
        get_adapter({**text_cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_adapter_tp_pieces_agree():
    """Pure (no megatron): for every parameter of the qwen3_5_text and qwen3_next plans at TP2, the
    rank's shard read through hf_slices + from_hf (loading) == split_tp of the canonical tensor;
    merge_tp of the shards == canonical; to_hf(canonical) == the HF tensors (export); every
    shard_blocks box (the reshard planner's view) holds exactly the HF values it names."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    from areal_mega.models import get_adapter

    fusions = set()
    for cfg in (Qwen3_5TextConfig(**CFG).to_dict(), Qwen3NextConfig(**CFG, **MOE, mlp_only_layers=[1]).to_dict()):
        fusions |= _tp2_pieces_agree(get_adapter(cfg))
    assert {"parts", "gated_qkv", "gate_up", "vocab", "none", "grouped"} <= fusions


def _tp2_pieces_agree(ad) -> set:
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(ad.hf_shape(n), generator=g) for n in ad.hf_names()}
    fusions = set()
    for prm in ad.plan(ParallelLayout.build(ParallelConfig(tensor_parallel=2), 2))[0].params:
        fusions.add(prm.fusion)
        canon = ad.from_hf(prm, [hf[n] for n in prm.hf_names])
        assert tuple(canon.shape) == prm.shape, prm.name
        assert all(torch.equal(a, hf[n]) for a, n in zip(ad.to_hf(prm, canon), prm.hf_names)), prm.name
        shards = []
        for r in range(2):
            parts = [hf[n] if d is None else hf[n].narrow(d, a, b - a) for n, d, a, b in ad.hf_slices(prm, 2, r)]
            shard = ad.from_hf(prm, parts, tuple(ad.split_tp(prm, canon, 2, r).shape))
            assert torch.equal(shard, ad.split_tp(prm, canon, 2, r)), (prm.name, r)
            shards.append(shard)
            for blk in ad.shard_blocks(prm, 2, r):
                src = hf[blk.hf_name][tuple(slice(a, b) for a, b in blk.hf_box)]
                dst = shard[tuple(slice(s, s + (b - a)) for s, (a, b) in zip(blk.local_start, blk.hf_box))]
                assert torch.equal(src, dst), (prm.name, r, blk)
        assert torch.equal(ad.merge_tp(prm, shards), canon), prm.name
    return fusions


# SGLang 0.5.23's loader rules (qwen3_5.py load_weights' stacked_params_mapping), written out here
# independently of the adapter: HF module -> (SGLang fused parameter, part index).
_SGLANG_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                 "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
                 "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1)}


def _sglang_reference(ckpt: dict) -> dict:
    """What SGLang's TP1 parameters must hold after loading the checkpoint's language model."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for n, t in ckpt.items():
        if n.startswith("model.visual."):
            continue
        n = n.replace("model.language_model.", "model.").replace(".self_attn.", ".")
        prefix, module, leaf = n.rsplit(".", 2) if n.count(".") >= 2 else ("", "", n)
        if module in _SGLANG_FUSED:
            fused, i = _SGLANG_FUSED[module]
            parts.setdefault(f"{prefix}.{fused}.{leaf}", {})[i] = t
        else:
            out[n] = t
    out.update({k: torch.cat([v[i] for i in sorted(v)]) for k, v in parts.items()})
    return out


@LAYER
def test_sync_stream_loads_into_sglangs_own_model(layouts, tmp_path):
    """SGLang cannot serve Qwen3.5 on CPU (docs/engine.md: sgl_kernel's CPU causal_conv1d), so the
    sync is checked against SGLang's own loader instead: the stream the learner's export sends at
    TP2 (text model and VL checkpoint) goes through SGLang 0.5.23's Qwen3_5ForCausalLM /
    Qwen3_5ForConditionalGeneration ``load_weights`` in-process (tests/support/sglang_load.py);
    every language-model parameter must be written and equal the checkpoint mapped by SGLang's
    loader rules (bit for bit), the vision tower untouched. Controls: a stream missing one tensor
    leaves its parameter unwritten; in_proj_z rows reversed make its fused parameter differ."""
    import json

    from areal_mega.megatron.model import HFCheckpointReader
    from tests.support.launch import SGLANG_PYTHON, child_env, run_checked

    if not SGLANG_PYTHON:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (run through make test-families-serve)")
    work, ref, _ = layouts
    jobs = []
    for name in ("text", "vl"):
        cfg = json.loads((work / name / "config.json").read_text())
        # released configs carry full_attention_interval (transformers' save_pretrained does not);
        # SGLang 0.5.23 derives its layer kinds from it (configs/qwen3_next.py layers_block_type)
        (cfg if name == "text" else cfg["text_config"])["full_attention_interval"] = 4
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        jobs.append({"label": name, "config": str(tmp_path / f"{name}.json"), "stream": str(work / f"{name}_sync_tp2.pt")})
    stream = torch.load(work / "text_sync_tp2.pt")
    drop, flip = "model.layers.1.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.in_proj_z.weight"
    torch.save([(n, t) for n, t in stream if n != drop], tmp_path / "dropped.pt")
    torch.save([(n, t.flip(0) if n == flip else t) for n, t in stream], tmp_path / "flipped.pt")
    for label in ("dropped", "flipped"):
        jobs.append({"label": label, "config": str(tmp_path / "text.json"), "stream": str(tmp_path / f"{label}.pt")})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    run_checked([SGLANG_PYTHON, "tests/support/sglang_load.py", "--jobs", tmp_path / "jobs.json",
                 "--out", tmp_path / "out.pt"], timeout_s=600, env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    res = torch.load(tmp_path / "out.pt")
    for name in ("text", "vl"):
        disk = HFCheckpointReader(work / name)
        want = _sglang_reference({n: disk.read(n) for n in disk.names()})
        got = res[name]
        lm = {n for n in got if not n.startswith("visual.")}
        assert lm == set(want), sorted(lm ^ set(want))[:5]
        for n in lm:  # vocab rows past the checkpoint's (SGLang's padding) are not the sync's
            assert torch.equal(got[n][: want[n].shape[0]], want[n]), (name, n)
        vision = [n for n in got if n.startswith("visual.")]
        assert bool(vision) == (name == "vl") and all(got[n].isnan().all() for n in vision)
    assert res["dropped"]["model.layers.1.linear_attn.in_proj_ba.weight"].isnan().any()
    fused = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert not torch.equal(res["flipped"][fused], res["text"][fused])


def _hf_after_packed_backward(path, r):
    """The HF model at ``path`` after backward of the summed log-probs of ``r``'s packed sequences,
    each run alone (the gradient the learner's packed row must equal)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ids, cu = r["input_ids"], r["cu_seqlens"]
    total = 0.0
    for i in range(len(cu) - 1):
        x = ids[cu[i]: cu[i + 1]]
        lp = torch.log_softmax(hf(x[None]).logits[0].float(), -1)
        total = total + lp[:-1].gather(-1, x[1:, None]).sum()
    total.backward()
    return hf


@LAYER
def test_tp2_out_norm_gradient_matches_hf(layouts):
    """Compat entry 14: at TP2 the DeltaNet out_norm's gradient (of the packed log-prob sum) equals
    HF's on every TP rank; without the entry (megatron's own _apply_gated_norm) each rank holds only
    its heads' part -- far off (control)."""
    work, ref, res = layouts
    hf = _hf_after_packed_backward(work / "text", ref["text"])
    want = hf.model.layers[0].linear_attn.norm.weight.grad
    # fp32; a sum of ~60 log-probs' gradients, each through 4 layers of <= 128-term reductions:
    # 1e-4 relative to the largest entry is ~100x fp32_tol(128, |grad|, ops 14) and far below the control
    tol = 1e-4 * want.abs().max().item()
    for fixed, unfixed in res["grad"]:
        err, bad = (fixed - want).abs().max().item(), (unfixed - want).abs().max().item()
        print(f"out_norm grad at TP2: max|mc-hf|={err:.2e} bound={tol:.2e} control (no entry 14)={bad:.2e}")
        assert err <= tol and bad > 100 * tol


@LAYER
def test_tp2_sp_gradients_match_hf(layouts):
    """Sequence parallelism at TP2: gradients of the packed log-prob sum, after finalize_model_grads
    sums the sequence-parallel params over TP, equal HF's on every rank -- the text model's DeltaNet
    out_norm (full row, this rank's heads), a zero-centred input norm (this rank's tokens) and the
    final norm; the MoE model's router and shared-expert gate (megatron's) and out_norm. Before that
    sum (each rank's part: the control) far off."""
    from tests.dist.qwen3_5_layouts import SP_GRAD_PARAMS

    work, ref, res = layouts
    assert set(res["sp_grad"]) == set(SP_GRAD_PARAMS)
    for name, params in SP_GRAD_PARAMS.items():
        hf_p = dict(_hf_after_packed_backward(work / name, ref[name]).named_parameters())
        for rank_grads in res["sp_grad"][name]:
            for (mc_name, hf_name), (fixed, partial) in zip(params.items(), rank_grads):
                want = hf_p[hf_name].grad
                tol = 1e-4 * want.abs().max().item()  # as test_tp2_out_norm_gradient_matches_hf derives it
                err, bad = (fixed - want).abs().max().item(), (partial - want).abs().max().item()
                print(f"{name} {mc_name} grad at TP2+SP: max|mc-hf|={err:.2e} bound={tol:.2e} "
                      f"control (no TP sum)={bad:.2e}")
                assert err <= tol and bad > 100 * tol, (name, mc_name)


@LAYER
def test_engine_step_tp2_sp_equals_tp1(layouts):
    """The dense and the MoE hybrid through MegatronTrainEngine (tests/dist/engine_sp.py's PPO-like
    loss, Adam, distributed optimizer, clip; 7 packed sequences, odd micro-batches SP pads): TP2 +
    SP (really on) gives TP1 x DP2's log-probs before and after one train_batch, and its grad norm;
    control: the step's own effect on the log-probs is well above the bound."""
    from tests.dist.qwen3_5_layouts import ENGINE_MODELS
    from tests.support.numerics import fp32_tol, transformer_reductions
    from tests.test_engine_sp import after_tol

    _, _, res = layouts
    for name in ENGINE_MODELS:
        ref, got = res["engine"][name]["tp1"], res["engine"][name]["tp2sp"]
        assert got["sp"] and not ref["sp"]
        with torch.device("meta"):
            n = sum(p.numel() for p in _tiny({"text": "text", "moe": "moe"}[name]).parameters())
        # fp32, 4 layers' reductions, the longest the softmax normaliser over the 300-token vocab
        tol = fp32_tol(300, float(ref["before"].abs().max()), ops=transformer_reductions(4))
        grad_rel = fp32_tol(300, 1.0, ops=transformer_reductions(4, backward=True))  # the chain twice: 1.5e-5
        after = after_tol(ref["after"], ref["before"], ref["stats"], tol=tol, num_params=n)
        d0 = (got["before"] - ref["before"]).abs().max().item()
        d1 = (got["after"] - ref["after"]).abs().max().item()
        step = (ref["after"] - ref["before"]).abs().max().item()
        gn = abs(got["stats"]["grad_norm"] / ref["stats"]["grad_norm"] - 1)
        print(f"{name} engine TP2+SP vs TP1: log-probs {d0:.2e} (bound {tol:.2e}), after the step {d1:.2e} "
              f"(bound {after:.2e}), grad norm rel {gn:.1e} (bound {grad_rel:.1e}); control (step effect) {step:.2f}")
        # the after-step bound is loose (Adam's eps-relative term, tests/support/numerics.adam_step_rel):
        # the step's effect is ~60x it here, ~1e5x the measured difference
        assert d0 <= tol and d1 <= after and gn <= grad_rel and step > 10 * after


def test_memory_model_counts_the_hybrid_params():
    """simulator/memory.py's parameter count of a hybrid (dense and MoE) equals transformers'
    (the count tools/check_memory_model.py's q35_* rows show equal to the engine's tensors)."""
    from areal_mega.models import get_adapter
    from areal_mega.simulator.memory import total_params

    for kind in ("text", "moe", "moe_next"):
        with torch.device("meta"):
            m = _tiny(kind)
        assert total_params(get_adapter(m.config.to_dict()).arch) == sum(p.numel() for p in m.parameters()), kind

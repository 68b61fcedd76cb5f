"""Qwen3.5's gated DeltaNet layer: megatron-core 0.16.1 GatedDeltaNet (torch delta rule, compat
entry 13) vs transformers 5.19 Qwen3_5GatedDeltaNet, fp32, CPU, one process (TP1).

Pins: HF's torch_chunk_gated_delta_rule (use_qk_l2norm_in_kernel=True) and torch causal conv1d
fallback; megatron's in_proj [qkv; z; b; a] fusion. A negative control (z/b parts swapped in the
fused in_proj) is far off; the mapping round trip is bit-exact. Packing: megatron's GatedDeltaNet
raises NotImplementedError for packed_seq_params (0.16.1), so the recurrent state cannot yet be
reset at sequence boundaries inside one row -- asserted here so the day it changes is seen.
"""

from __future__ import annotations

import pytest
import torch

from areal_mega.models.qwen3_5 import (
    gated_qkv_hf_to_mcore,
    gated_qkv_mcore_to_hf,
    gdn_hf_to_mcore,
    gdn_mcore_to_hf,
    gdn_sizes,
)

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
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    had_group = dist.is_initialized()
    yield
    if not had_group:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


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
    from megatron.core.transformer.spec_utils import ModuleSpec

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


def test_whole_text_model_logprobs_match_hf_packed():
    """Qwen3_5ForCausalLM (3 linear + 1 full attention layers) vs the hybrid GPTModel: three
    sequences packed in one row vs each alone in HF, fp32 log-probs; parameter counts equal;
    HF -> megatron -> HF bit-exact; control: one DeltaNet layer's A_log/dt_bias swapped."""
    _megatron_world_of_one()
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from areal_mega.megatron.linear_attention import qwen3_5_block_spec
    from areal_mega.megatron.model import packed_causal_mask
    from areal_mega.models.qwen3_5 import hf_to_mcore, mcore_to_hf

    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(**CFG)
    hc._attn_implementation = "eager"
    hf = Qwen3_5ForCausalLM(hc).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    c = hc.to_dict()
    tcfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=96,
        normalization="RMSNorm", layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True,
        add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True, attention_output_gate=True,
        qk_layernorm=True, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4)
    mc = GPTModel(tcfg, qwen3_5_block_spec(c["layer_types"]), vocab_size=384, max_sequence_length=256,
                  position_embedding_type="rope", rotary_percent=0.25, rotary_base=c["rope_parameters"]["rope_theta"],
                  share_embeddings_and_output_weights=False).eval()
    sd = hf_to_mcore(hf.state_dict(), c, 384)
    missing, unexpected = mc.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    assert sum(p.numel() for p in mc.parameters()) - 2 * (384 - 300) * 64 == sum(p.numel() for p in hf.parameters())
    back = mcore_to_hf({k: v for k, v in mc.state_dict().items() if v is not None}, c)
    ref_sd = hf.state_dict()
    assert set(back) == set(ref_sd) and all(torch.equal(back[k], ref_sd[k]) for k in ref_sd)

    torch.manual_seed(3)
    ids = [torch.randint(0, 300, (n,)) for n in (7, 40, 13)]
    mask = packed_causal_mask(torch.tensor([0, 7, 47, 60]))

    def lp():
        return torch.log_softmax(mc(torch.cat(ids)[None], position_ids=None, attention_mask=mask)[0, :, :300], -1)

    with torch.no_grad():
        ref = torch.cat([torch.log_softmax(hf(x[None]).logits[0], -1) for x in ids])
        # fp32; log-probs are O(10) over a 300-way softmax after 4 layers of O(64)-term reductions:
        # 1e-4 absolute is ~100x the measured 5e-6 and far below any mapping error.
        tol = 1e-4
        err = (lp() - ref).abs().max().item()
        print(f"qwen3_5 text model packed log-probs: max|mc-hf|={err:.2e} bound={tol:.0e}")
        assert err <= tol
        gdn = mc.decoder.layers[1].self_attention
        a, d = gdn.A_log.data.clone(), gdn.dt_bias.data.clone()
        gdn.A_log.data.copy_(d), gdn.dt_bias.data.copy_(a)  # one block mis-mapped
        bad = (lp() - ref).abs().max().item()
        print(f"qwen3_5 control (layer 1 A_log <-> dt_bias): {bad:.2e}")
        assert bad > 100 * tol


@LAYER
def test_text_model_tp2_logprobs_match_hf():
    """tests/dist/qwen3_5_tp.py: the whole text model at TP2 (gloo, 2 ranks), each rank loading
    models/qwen3_5.tp_shard of the mapping; control: one rank's fused in_proj rows reversed."""
    import re

    from tests.support.launch import child_env, run_checked, torchrun_cmd

    proc = run_checked(torchrun_cmd(2, "tests/dist/qwen3_5_tp.py"), timeout_s=600,
                       env=child_env(PYTHONWARNINGS="ignore"), merge_stderr=True)
    m = re.search(r"QWEN35_TP2 err=(\S+) control=(\S+)", proc.stdout)
    assert m, proc.stdout[-2000:]
    err, bad = float(m[1]), float(m[2])
    assert err <= 1e-4, err  # the bound of the TP1 whole-model row (TP2 adds one all-reduce per layer)
    assert bad > 100 * 1e-4, bad


@LAYER
def test_vl_checkpoint_gives_the_text_model():
    """A tiny Qwen3_5ForConditionalGeneration: its language model, split off, loads strictly into
    Qwen3_5ForCausalLM with the same text logits; the vision tensors come back untouched."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    from areal_mega.models.qwen3_5 import split_vl_checkpoint

    torch.manual_seed(0)
    vc = Qwen3_5Config(text_config=CFG, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16,
        patch_size=4, temporal_patch_size=1, spatial_merge_size=1))
    vl = Qwen3_5ForConditionalGeneration(vc).eval()
    sd = vl.state_dict()
    text, lm, vision = split_vl_checkpoint(vc.to_dict(), sd)
    assert vision and all(k.startswith("model.visual.") and vision[k] is sd[k] for k in vision)
    tm = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})).eval()
    tm.load_state_dict(lm, strict=True)
    ids = torch.randint(0, 300, (1, 11))
    with torch.no_grad():
        assert torch.equal(tm(ids).logits, vl(input_ids=ids).logits)
    with pytest.raises(ValueError, match="model_type"):
        split_vl_checkpoint({"model_type": "qwen3"}, {})

"""FP8 rollout weights (areal_mega/weight_sync/fp8.py): the learner's blockwise quantizer equals
SGLang's own bit for bit, a sender's shard quantized alone equals the slice of the whole, and
the bad inputs are refused in one line.

SGLang's side runs in the SGLang venv (AREAL_MEGA_SGLANG_PYTHON), in-process there: its
``bf16_to_block_fp8_128`` (layers/quantization/mxfp8_block_convert.py, "the DeepSeek-V3 block-fp8
contract") quantizes, and its loader-side ``block_quant_dequant`` (fp8_utils.py, what
post_load_weights uses to rebuild bf16 from fp8 + scales) dequantizes. Comparisons are of raw bytes
(fp8 viewed as uint8, scales as int32): no tolerance.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from areal_mega.models.registry import get_adapter
from areal_mega.weight_sync.fp8 import BLOCK, check_fp8, fp8_nbytes, quantize_blockwise, quantize_shard, quantized
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import tiny_config
from tests.test_moe_families_plan import DEEPSEEK_V3_671B

SGLANG_SIDE = r"""
import sys, torch
import sglang.srt.layers.quantization.mxfp8_block_convert as mx
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
xs = torch.load(sys.argv[1])
out = []
for x in xs:
    q, s = mx.bf16_to_block_fp8_128(x)
    out.append((q, s, block_quant_dequant(q, s, [128, 128], torch.float32)))
torch.save(out, sys.argv[2])
"""


def _weights() -> list[torch.Tensor]:
    """bf16 weights as a learner holds them: whole blocks and ragged edges, an outlier block,
    an all-zero block (the 1e-4 clamp), values near e4m3's rounding boundaries."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(384, 256, generator=g) * 0.02).bfloat16()
    a[130, 7] = 3.5  # one block dominated by an outlier
    a[256:, 128:] = 0  # a zero block
    b = (torch.randn(300, 200, generator=g) * 1e-3).bfloat16()  # ragged: 3 x 2 blocks, partial at the edges
    c = torch.linspace(-448.0 * 0.02, 448.0 * 0.02, 256 * 128).reshape(256, 128).bfloat16()
    return [a, b, c]


@needs_sglang
def test_quantizer_equals_sglangs_bit_for_bit(tmp_path):
    xs = _weights()
    torch.save(xs, tmp_path / "in.pt")
    subprocess.run([SGLANG_PYTHON, "-c", SGLANG_SIDE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], check=True,
                   timeout=300)
    ref = torch.load(tmp_path / "out.pt")
    for x, (q_ref, s_ref, deq) in zip(xs, ref):
        q, s = quantize_blockwise(x)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (-(-x.shape[0] // BLOCK), -(-x.shape[1] // BLOCK))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
        # SGLang's loader dequantizes it back within e4m3's rounding: half a unit in the last
        # place (3 mantissa bits: 2^-4 relative) of each value's block scale times 448.
        bound = (s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: x.shape[0], : x.shape[1]] * 448 * 2 ** -4)
        assert ((deq - x.float()).abs() <= bound).all()
    # negative control: a quantizer with another scale rule (UE8M0 power-of-two scales, SGLang's
    # per_block_cast_to_fp8 for DeepGEMM) gives other bytes, and the comparison sees it
    q, s = quantize_blockwise(xs[0])
    s2 = torch.exp2(torch.ceil(torch.log2(s)))
    assert not torch.equal(s2.view(torch.int32), ref[0][1].view(torch.int32))


def test_a_senders_shard_quantizes_to_the_slice_of_the_whole():
    """Each TP shard (rows for column-parallel, columns for row-parallel) quantized alone by its
    sender = the whole weight quantized, sliced at the shard's blocks (what SGLang's loader
    slices for that engine rank): a block's scale depends on that block only."""
    x = (torch.randn(512, 384, generator=torch.Generator().manual_seed(1)) * 0.05).bfloat16()
    q, s = quantize_blockwise(x)
    for dim, tp in ((0, 4), (1, 3)):
        per = x.shape[dim] // tp
        for r in range(tp):
            shard = x.narrow(dim, r * per, per)
            start = (r * per, 0) if dim == 0 else (0, r * per)
            qs, ss, at = quantize_shard(shard, start, tuple(x.shape))
            assert torch.equal(qs.view(torch.uint8), q.narrow(dim, r * per, per).view(torch.uint8))
            assert at == (start[0] // BLOCK, start[1] // BLOCK)
            assert torch.equal(ss, s.narrow(dim, at[dim], ss.shape[dim]))
    # a shard boundary inside a block: refused (its block would straddle two senders)
    with pytest.raises(ValueError, match=r"not on 128-blocks: a block would straddle two senders"):
        quantize_shard(x[64:192], (64, 0), tuple(x.shape))
    # the ragged last shard at the tensor's edge is fine
    y = x[:300]
    assert quantize_shard(y[256:], (256, 0), tuple(y.shape))[0].shape == (44, 384)


def test_which_tensors_and_bytes():
    ds = get_adapter(dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=4))
    names = set(ds.hf_names())
    q = {n for n in names if quantized(ds, n)}
    assert "model.layers.3.self_attn.kv_b_proj.weight" in q and "model.layers.3.mlp.experts.7.down_proj.weight" in q
    assert not q & {"model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.gate.weight",
                    "model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.kv_a_layernorm.weight"}
    assert fp8_nbytes((7168, 2048)) == 7168 * 2048 + 4 * 56 * 16  # ~half of bf16's 2 bytes
    check_fp8(ds, tp=16, ep=16)
    check_fp8(ds, tp=8, ep=8)


def test_fp8_bad_inputs_are_one_line():
    mixtral = get_adapter(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"^inference.server.quantization: fp8 has no quantized layout for model_type "
                                         r"'mixtral' \(implemented: .*\); use quantization: none$"):
        check_fp8(mixtral)
    llama = get_adapter(tiny_config("llama", hidden_size=256, intermediate_size=384, num_attention_heads=4,
                                    num_key_value_heads=4))
    check_fp8(llama, tp=1)
    with pytest.raises(ValueError, match=r"^inference.server.quantization: fp8 at tp_size 2: .* not whole 128-blocks"):
        check_fp8(llama, tp=2)  # 384 / 2 = 192 rows of gate_proj per rank


def test_fp8_sync_is_refused_at_start_up_in_one_line():
    """The servers' fp8 is planned and priced, but the sync does not send fp8 + scales yet: the
    trainer's weight sync refuses it before touching any group (a bad family first, by name)."""
    from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync

    ds = get_adapter(dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=4))
    with pytest.raises(ValueError, match=r"^inference.server.quantization: fp8 is planned .* does not send fp8 \+ scales yet"):
        megatron_weight_sync(WeightSyncConfig(), adapter=ds, chunks=[], groups=None, quantization="fp8")
    mixtral = get_adapter(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"^inference.server.quantization: fp8 has no quantized layout for model_type 'mixtral'"):
        megatron_weight_sync(WeightSyncConfig(), adapter=mixtral, chunks=[], groups=None, quantization="fp8")

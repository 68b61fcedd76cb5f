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
from areal_mega.weight_sync.transport import BroadcastSender
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
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in q  # fp8 in the FP8 checkpoint, fused with q_a
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


SGLANG_SYNC_SIDE = r"""
import sys, torch
import sglang.srt.layers.quantization.mxfp8_block_convert as mx
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
state, buckets = torch.load(sys.argv[1])
quantized = {n: mx.bf16_to_block_fp8_128(x) for n, x in state.items()}
received = {}
for names, dtypes, shapes, payload in buckets:  # what update_weights_from_distributed rebuilds
    bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    bucket.get_flattened_tensor().copy_(payload)
    received.update((n, t.clone()) for n, t in bucket.reconstruct_tensors())
try:  # control: fp8 first, its scales after it at an odd offset
    FlattenedTensorBucket.empty(["w", "w_scale_inv"], ["float8_e4m3fn", "float32"], [[3, 5], [1, 1]], "cpu")
    unaligned = "accepted"
except ValueError as e:
    unaligned = str(e)
torch.save((quantized, received, unaligned), sys.argv[2])
"""


@needs_sglang
def test_fp8_sync_stream_equals_sglangs_quantizer_bit_for_bit(tmp_path):
    """What the fp8 sync sends (fp8.quantize_export over a stage's export: full HF tensors in the
    wire dtype; packed by the broadcast sender, rebuilt by SGLang's own receive-side
    FlattenedTensorBucket, as update_weights_from_distributed does) for a tiny DeepSeek-V3 (MLA, a dense layer, routed + shared experts; shapes not
    multiples of 128: ragged blocks): every ``*_proj`` weight as fp8 + ``weight_scale_inv`` (the
    names of DeepSeek-V3's FP8 checkpoint), bytes equal to SGLang 0.5.23's own
    ``bf16_to_block_fp8_128`` of the same bf16 tensor; everything else untouched; the stream
    matches the sync plan (fp8.fp8_specs: names, shapes, dtypes, order) and its bytes."""
    from areal_mega.parallel import ParallelLayout
    from areal_mega.weight_sync.fp8 import bucket_group as fp8_bucket_group
    from areal_mega.weight_sync.fp8 import fp8_specs, fp8_sync_bytes, quantize_export, scale_name
    from areal_mega.weight_sync.planner import plan_weight_sync
    from tests.test_families_serve import FAMILIES

    ds = get_adapter(tiny_config("deepseek_v3", **FAMILIES["deepseek_v3"], torch_dtype="bfloat16"))
    g = torch.Generator().manual_seed(2)
    specs = ds.plan(ParallelLayout(world_size=1), dtype="bfloat16")[0].tensors
    state = {t.name: (torch.randn(t.shape, generator=g) * 0.02).bfloat16() for t in specs}
    sent = list(quantize_export(ds, ((t.name, state[t.name]) for t in specs)))
    plan = fp8_specs(ds, specs)
    # the sender's own packing (BroadcastSender.pack: one flattened uint8 buffer per bucket), 4 KiB
    # buckets so that weights, scales and bf16 tensors share buckets at many offsets
    sync = plan_weight_sync([plan], ParallelLayout(world_size=1), 1 << 12, lambda n: fp8_bucket_group(ds, n))
    sender = BroadcastSender([], [], group_name="g", backend="gloo", address="", port=0, timeout_s=1)
    it, buckets = iter(sent), []
    for b in sync.stages[0].buckets:
        tensors = [next(it)[1] for _ in b.tensors]
        buckets.append((b.names, [t.dtype for t in b.tensors], [list(t.shape) for t in b.tensors],
                        sender.pack(tensors)[0].clone()))
    torch.save(({n: x for n, x in state.items() if quantized(ds, n)}, buckets), tmp_path / "in.pt")
    subprocess.run([SGLANG_PYTHON, "-c", SGLANG_SYNC_SIDE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=300)
    ref, received, unaligned = torch.load(tmp_path / "out.pt")
    assert unaligned.startswith("Unaligned received tensor w_scale_inv")  # why the scales go first
    assert [(n, tuple(x.shape), str(x.dtype).removeprefix("torch.")) for n, x in sent] == \
           [(t.name, t.shape, t.dtype) for t in plan]
    got = dict(sent)
    q = [n for n in state if quantized(ds, n)]
    assert set(ref) == set(q) and "model.layers.0.mlp.down_proj.weight" in q and \
           "model.layers.1.mlp.experts.7.gate_proj.weight" in q and "model.layers.1.self_attn.kv_b_proj.weight" in q
    assert set(received) == set(got)
    for n in q:  # sent = SGLang's quantizer = what SGLang's receiver rebuilds from the sent buckets
        for mine, theirs in ((got[n], ref[n][0]), (received[n], ref[n][0]),
                             (got[scale_name(n)], ref[n][1]), (received[scale_name(n)], ref[n][1])):
            assert mine.dtype == theirs.dtype and torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), n
    for n in set(state) - set(q):  # embeddings, lm_head, norms, the router: the bf16 tensor itself
        assert got[n] is state[n] and scale_name(n) not in got and torch.equal(received[n], state[n])
    for b in sync.stages[0].buckets:  # a weight and its scales in one bucket (small buckets: many splits)
        names = b.names
        assert all(scale_name(n) in names for n in names if n in q) and all(n[:-10] in names for n in names
                                                                             if n.endswith("_scale_inv"))
    assert len(sync.stages[0].buckets) > 10 and sync.nbytes == sum(x.numel() * x.element_size() for _, x in sent) == fp8_sync_bytes(ds)
    # control: a stream whose scales were computed from the fp32 master (not the bf16 wire
    # tensor) differs in bytes somewhere: the comparison sees it
    n = q[0]
    s32 = quantize_blockwise(state[n].float() + 1e-4)[1]
    assert not torch.equal(s32.view(torch.int32), ref[n][1].view(torch.int32))


SGLANG_BLOCK_SHAPES = r"""
import json, sys
from types import SimpleNamespace as N
from sglang.srt.layers.quantization.fp8_utils import validate_fp8_block_shape
out = []
for layers in json.loads(sys.argv[1]):
    ok = True
    for tp, in_size, out_size, in_part, out_parts in layers:
        try:
            validate_fp8_block_shape(N(tp_group=N(world_size=tp)), in_size, out_size, in_part, out_parts, [128, 128])
        except ValueError:
            ok = False
    out.append(ok)
print(json.dumps(out))
"""


@needs_sglang
def test_check_fp8_agrees_with_sglangs_block_shape_rule():
    """check_fp8's verdict on a server layout = SGLang 0.5.23's own ``validate_fp8_block_shape``
    over that layout's linears (their TP partitions as SGLang's QKV / merged / row-parallel layers
    form them, from the published configs): DeepSeek-V3 TP16 yes, TP32 no (dense gate_up 576
    rows); Qwen3-235B TP8 yes (4 KV heads replicated: one per rank, and qkv is then no TP split);
    GLM-4.5-Air no at TP1 (merged gate of 10944 rows) and TP8."""
    import json

    import yaml

    from tests.test_launch_plan import CONFIG_GLM_AIR
    from tests.test_moe_plan import QWEN3_235B_A22B

    glm = yaml.safe_load(open(CONFIG_GLM_AIR))["launch"]["model_config"]
    ds = dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=4)
    h = 7168

    def ds_layers(tp):  # dense gate_up, q_b, kv_b (column), o (row), shared expert gate_up / down
        return [(tp, h, 2 * 18432, h, [18432 // tp] * 2), (tp, 1536, 128 * 192, 1536, [128 * 192 // tp]),
                (tp, 512, 128 * 256, 512, [128 * 256 // tp]), (tp, 128 * 128, h, 128 * 128 // tp, [h]),
                (tp, h, 2 * 2048, h, [2048 // tp] * 2), (tp, 2048, h, 2048 // tp, [h])]
    cases = [
        (ds, 16, 16, ds_layers(16)),
        (ds, 32, 32, ds_layers(32)),
        (QWEN3_235B_A22B, 8, 8, [(8, 4096, 72 * 128, 4096, [8 * 128, 128, 128]), (8, 8192, 4096, 1024, [4096])]),
        (glm, 1, 1, [(1, 4096, 2 * 10944, 4096, [10944] * 2), (1, 4096, 112 * 128, 4096, [96 * 128, 1024, 1024])]),
        (glm, 8, 8, [(8, 4096, 2 * 10944, 4096, [1368] * 2), (8, 4096, 112 * 128, 4096, [12 * 128, 128, 128])]),
    ]
    out = subprocess.run([SGLANG_PYTHON, "-c", SGLANG_BLOCK_SHAPES, json.dumps([c[3] for c in cases])], check=True,
                         timeout=300, capture_output=True, text=True).stdout
    theirs = json.loads(out.strip().splitlines()[-1])
    ours = []
    for hf, tp, ep, _ in cases:
        try:
            check_fp8(get_adapter(hf), tp, ep)
            ours.append(True)
        except ValueError:
            ours.append(False)
    assert theirs == ours == [True, False, True, False, False]


def test_fp8_sync_refusals_are_one_line():
    """fp8 goes by broadcast only (reshard's quantized shards and disk's fp8 files are not
    implemented), for the families with a quantized layout: each refused before touching a group."""
    from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync

    ds = get_adapter(dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=4))
    for mode in ("reshard", "disk"):
        with pytest.raises(ValueError, match=rf"^inference.server.quantization: fp8 is sent by weight_sync.mode "
                                             rf"broadcast only, not '{mode}' .*; use mode: broadcast$"):
            megatron_weight_sync(WeightSyncConfig(mode=mode, disk_dir="/nonexistent"), adapter=ds, chunks=[], groups=None, quantization="fp8")
    mixtral = get_adapter(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"^inference.server.quantization: fp8 has no quantized layout for model_type 'mixtral'"):
        megatron_weight_sync(WeightSyncConfig(), adapter=mixtral, chunks=[], groups=None, quantization="fp8")


def test_fp8_without_the_decoupled_correction_is_refused_in_one_line():
    from areal_mega.experiment import load_experiment

    over = ["inference.server.quantization=fp8"]
    assert load_experiment("configs/grpo_qwen3_235b_a22b.yaml", []).inference.server.quantization == "fp8"
    load_experiment("configs/grpo_deepseek_v3_671b.yaml", over)  # validated on load
    with pytest.raises(ValueError, match=r"^configs/grpo_deepseek_v3_671b.yaml \(with overrides\): "
                                         r"inference.server.quantization: fp8 behaviour log-probs differ .* set "
                                         r"algorithm.decoupled: true$"):
        load_experiment("configs/grpo_deepseek_v3_671b.yaml", over + ["algorithm.decoupled=false"])


def test_a_server_without_the_block_fp8_model_is_a_plan_mismatch():
    from areal_mega.weight_sync.fp8 import check_server_fp8
    from areal_mega.weight_sync.planner import PlanMismatchError

    block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert check_server_fp8(dict(DEEPSEEK_V3_671B, quantization_config=block), "s") == DEEPSEEK_V3_671B
    for qc in (None, dict(block, weight_block_size=None), dict(block, quant_method="compressed-tensors")):
        with pytest.raises(PlanMismatchError, match=r"^s: inference.server.quantization fp8 needs a block-FP8 model"):
            check_server_fp8(dict(DEEPSEEK_V3_671B, quantization_config=qc), "s")

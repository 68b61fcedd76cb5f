"""Pure (no process, no tensor-parallel run) checks of the model side: the adapter's metadata
planner on a Llama-70B-shaped config for layouts up to TP8 x PP4, the fused-tensor transforms
against hand-built layouts, vocab padding, the packed mask, and ParallelLayout's rank order
against megatron's own RankGenerator. Runtime: ~5 s (mostly importing megatron)."""

from __future__ import annotations

import pytest
import torch

from areal_mega.models import get_adapter, padded_vocab_size
from areal_mega.models.base import McoreParam, layer_chunks
from areal_mega.parallel import ParallelConfig, ParallelLayout

LLAMA_70B = {
    "model_type": "llama",
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def _layout(tp, pp, vpp=None, dp=1):
    return ParallelLayout.build(
        ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline_parallel=vpp), tp * pp * dp
    )


@pytest.mark.parametrize(
    "tp,pp,vpp", [(1, 1, None), (2, 1, None), (8, 1, None), (1, 4, None), (8, 4, None), (4, 2, 5), (8, 4, 2)]
)
def test_plan_llama70b_every_tensor_once(tp, pp, vpp):
    ad = get_adapter(LLAMA_70B)
    plans = ad.plan(_layout(tp, pp, vpp, dp=2))
    assert [p.stage for p in plans] == list(range(pp))
    names = [t.name for p in plans for t in p.tensors]
    assert len(names) == len(set(names)) == 80 * 9 + 3  # 9 tensors per layer + embed, norm, lm_head
    total = 0
    for p in plans:
        for t in p.tensors:
            assert t.dtype == "bfloat16" and t.stage == p.stage
            n = 1
            for d in t.shape:
                n *= d
            total += n
    assert total == 70_553_706_496  # Llama-3-70B parameter count
    shapes = {t.name: t.shape for p in plans for t in p.tensors}
    assert shapes["model.layers.79.self_attn.q_proj.weight"] == (8192, 8192)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)
    assert shapes["model.layers.3.mlp.up_proj.weight"] == (28672, 8192)
    assert shapes["model.layers.3.mlp.down_proj.weight"] == (8192, 28672)
    assert shapes["lm_head.weight"] == (128256, 8192)
    # embedding on the first stage, norm + lm_head on the last; layers where megatron puts them
    stage_of = {t.name: p.stage for p in plans for t in p.tensors}
    assert stage_of["model.embed_tokens.weight"] == 0
    assert stage_of["lm_head.weight"] == stage_of["model.norm.weight"] == pp - 1
    chunks = layer_chunks(80, plans and _layout(tp, pp, vpp))
    for s, stage_chunks in enumerate(chunks):
        for ids in stage_chunks:
            for gid in ids:
                assert stage_of[f"model.layers.{gid}.mlp.gate_proj.weight"] == s
    # megatron sources: fused shapes and TP dims
    src = {t.name: t.source for p in plans for t in p.tensors}
    qkv = src["model.layers.0.self_attn.v_proj.weight"]
    assert qkv.shape == (64 * 128 + 2 * 8 * 128, 8192) and qkv.tp_dim == 0 and qkv.fusion == "qkv"
    assert src["model.layers.0.mlp.up_proj.weight"].shape == (2 * 28672, 8192)
    assert src["model.layers.0.self_attn.o_proj.weight"].tp_dim == 1


def test_plan_interleaved_layer_assignment():
    # pp=2, vpp=2, 8 layers: stage0 = [0,1] + [4,5], stage1 = [2,3] + [6,7] (megatron's offsets)
    assert layer_chunks(8, _layout(1, 2, 2)) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_plan_tied_embeddings_across_pp():
    cfg = {**LLAMA_70B, "num_hidden_layers": 4, "tie_word_embeddings": True}
    plans = get_adapter(cfg).plan(_layout(1, 2))
    names = [t.name for p in plans for t in p.tensors]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    last = {p.name: p for p in plans[1].params}
    assert not last["output_layer.weight"].exported
    assert last["output_layer.weight"].hf_names == ("model.embed_tokens.weight",)
    # PP=1 tied: megatron has no output_layer.weight at all
    assert "output_layer.weight" not in {p.name for p in get_adapter(cfg).plan(_layout(1, 1))[0].params}


def test_qkv_and_gate_up_layouts_by_hand():
    cfg = {
        "model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 1, "intermediate_size": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 1, "vocab_size": 3,
    }
    ad = get_adapter(cfg)
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    prm = McoreParam(0, "decoder.layers.0.self_attention.linear_qkv.bias", (8,), 0, "qkv", ("q", "k", "v"))
    canon = ad.from_hf(prm, [q, k, v])
    assert canon.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # per query group [q, q, k, v]
    assert ad.split_tp(prm, canon, 2, 1).tolist() == [2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(ad.to_hf(prm, canon), [q, k, v]))
    gu = McoreParam(0, "decoder.layers.0.mlp.linear_fc1.weight", (8, 1), 0, "gate_up", ("g", "u"))
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(10.0, 14).view(4, 1)
    canon = ad.from_hf(gu, [gate, up])
    shards = [ad.split_tp(gu, canon, 2, r) for r in range(2)]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]  # each TP shard is [gate_r; up_r]
    assert torch.equal(ad.merge_tp(gu, shards), canon)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_transforms_roundtrip_random(tp):
    cfg = {**LLAMA_70B, "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 301}
    ad = get_adapter(cfg)
    g = torch.Generator().manual_seed(0)
    (plan,) = ad.plan(_layout(tp, 1))
    for prm in plan.params:
        hf = [torch.randn(ad.hf_shape(n), generator=g) for n in prm.hf_names]
        canon = ad.from_hf(prm, hf)
        assert tuple(canon.shape) == prm.shape, prm.name
        shards = [ad.split_tp(prm, canon, tp, r) for r in range(tp)]
        back = ad.to_hf(prm, ad.merge_tp(prm, shards))
        assert all(torch.equal(a, b) for a, b in zip(hf, back)), prm.name
        # load_hf's path: read only this rank's slices, assemble the shard directly
        for r in range(tp):
            full = dict(zip(prm.hf_names, hf))
            parts = [full[n] if dim is None else full[n].narrow(dim, a, b - a) for n, dim, a, b in ad.hf_slices(prm, tp, r)]
            assert torch.equal(ad.from_hf(prm, parts, tuple(shards[r].shape)), shards[r]), (prm.name, r)


def test_vocab_padding():
    assert padded_vocab_size(300, 1) == padded_vocab_size(300, 8) == 384
    assert padded_vocab_size(128256, 8) == 128256 and padded_vocab_size(151936, 4) == 151936
    assert padded_vocab_size(100, 3, divisible_by=128) == 384  # lcm(128, 3)


def test_unknown_model_type_and_bad_config():
    with pytest.raises(ValueError, match=r"'gpt2'.*known model types: \['deepseek_v3', 'deepseek_v32', 'glm4_moe', 'glm_moe_dsa', 'gpt_oss', 'kimi_k25', 'llama', 'mixtral', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_moe', 'qwen3_next'\]"):
        get_adapter({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type"):
        get_adapter({**LLAMA_70B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['vocab_size'\]"):
        get_adapter({k: v for k, v in LLAMA_70B.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="architectures"):
        get_adapter({**LLAMA_70B, "architectures": ["LlamaForSequenceClassification"]})
    llama32 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    arch = get_adapter({**LLAMA_70B, "rope_parameters": llama32}).arch
    assert arch.rope_scaling_factor == 32.0 and arch.rope_theta == 5e5
    with pytest.raises(ValueError, match="rope_parameters.low_freq_factor"):
        get_adapter({**LLAMA_70B, "rope_parameters": {**llama32, "low_freq_factor": 2.0}})
    with pytest.raises(ValueError, match=r"num_kv_heads\(8\) % tp\(16\)"):
        get_adapter(LLAMA_70B).plan(_layout(16, 1))


def test_packed_causal_mask_by_hand():
    from areal_mega.megatron.model import packed_causal_mask

    m = packed_causal_mask(torch.tensor([0, 2, 3]), 4)[0, 0]
    allowed = (~m).int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 2, 2), (4, 2, 1, 2), (1, 1, 4, 2), (2, 2, 2, 2), (8, 1, 2, 4)])
def test_rank_order_matches_megatron(tp, cp, dp, pp):
    from megatron.core.parallel_state import RankGenerator

    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp), tp * cp * dp * pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for axis in ("tp", "cp", "dp", "pp"):
        for group in gen.get_ranks(axis):
            coords = [lay.coords(r) for r in group]
            others = {tuple(getattr(c, a) for a in ("tp", "cp", "dp", "pp") if a != axis) for c in coords}
            assert len(others) == 1, (axis, group)  # a megatron group varies only along its axis
            assert [getattr(c, axis) for c in coords] == list(range(len(group)))

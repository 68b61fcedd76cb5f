"""Pure weight-sync planner: no process group, world size as an argument (runtime < 2 s).

The plans come from the model adapter's metadata (areal_mega.models), the same code path the
live sync uses; the 70B shapes are Llama-3-70B's (80 layers, hidden 8192, 64 heads, 8 KV heads,
FFN 28672, vocab 128256).
"""

from __future__ import annotations

import pytest

from areal_mega.models import get_adapter
from areal_mega.parallel import ParallelLayout
from areal_mega.weight_sync.config import WeightSyncConfig
from areal_mega.weight_sync.planner import (
    PlanMismatchError,
    TensorSpec,
    bucketize,
    check_plan_against,
    plan_weight_sync,
)
from tests.support.models import WSYNC_QWEN2, tiny_config

MiB = 1 << 20
LLAMA_70B = dict(
    model_type="llama",
    num_hidden_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    torch_dtype="bfloat16",
)
TINY_QWEN2 = dict(tiny_config("qwen2", **WSYNC_QWEN2), torch_dtype="bfloat16")  # the live sync test's model


def _plan(hf: dict, tp: int, pp: int, dp: int = 1, bucket: int = 512 * MiB, vpp=None):
    layout = ParallelLayout(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, vpp=vpp)
    return plan_weight_sync([s.tensors for s in get_adapter(hf).plan(layout)], layout, bucket)


def _hand_count_70b() -> tuple[int, int]:
    """Tensors and bytes of Llama-3-70B in bf16, computed by hand from the shapes."""
    h, f, v, kv, layers = 8192, 28672, 128256, 8 * 128, 80
    per_layer = 2 * h + h * h + 2 * kv * h + h * h + 3 * f * h  # norms, q, k, v, o, gate/up/down
    params = layers * per_layer + 2 * v * h + h  # + embed, lm_head, final norm
    return layers * 9 + 3, 2 * params


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (8, 1, 1), (4, 2, 1), (8, 4, 2)])
def test_70b_every_tensor_once_buckets_bounded(tp, pp, dp):
    plan = _plan(LLAMA_70B, tp, pp, dp)
    names = [t.name for t in plan.tensors]
    n_tensors, n_bytes = _hand_count_70b()
    assert len(names) == len(set(names)) == n_tensors == 723
    assert plan.nbytes == n_bytes == 141_107_412_992  # 70.55 B params in bf16
    # The same set of HF tensors whatever the layout (TP1 x PP1 as reference).
    assert set(names) == {t.name for t in _plan(LLAMA_70B, 1, 1).tensors}
    for stage in plan.stages:
        assert stage.sender_rank == plan.layout.rank(pp=stage.stage)  # tp=0, cp=0, dp=0 of the stage
        for b in stage.buckets:
            # Over-size only for a lone tensor (the 2.1 GB embedding / lm_head).
            assert b.nbytes <= plan.bucket_bytes or len(b.tensors) == 1
    big = [b for s in plan.stages for b in s.buckets if b.nbytes > plan.bucket_bytes]
    assert [b.names for b in big] == [["model.embed_tokens.weight"], ["lm_head.weight"]]
    assert big[0].nbytes == big[1].nbytes == 128256 * 8192 * 2


def test_70b_tp8_pp4_stage_split_and_determinism():
    plan = _plan(LLAMA_70B, 8, 4, 2)
    assert [s.sender_rank for s in plan.stages] == [0, 16, 32, 48]  # pp is the slowest axis
    # 20 layers per stage; embedding on stage 0, final norm + lm_head on stage 3.
    per_layer = 2 * 8192 + 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
    emb = 128256 * 8192
    assert [s.nbytes // 2 for s in plan.stages] == [
        20 * per_layer + emb,
        20 * per_layer,
        20 * per_layer,
        20 * per_layer + emb + 8192,
    ]
    assert plan.stages[0].tensors[0].name == "model.embed_tokens.weight"
    assert plan.stages[3].tensors[-1].name == "lm_head.weight"
    assert plan.stages[1].tensors[0].name == "model.layers.20.input_layernorm.weight"
    again = _plan(LLAMA_70B, 8, 4, 2)
    assert again == plan  # frozen dataclasses: deterministic, field by field


def test_tied_embeddings_sent_once_across_pp():
    plan = _plan(TINY_QWEN2, 2, 2)
    names = [t.name for t in plan.tensors]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    assert plan.stages[1].tensors[-1].name == "model.norm.weight"
    assert "model.layers.0.self_attn.q_proj.bias" in names  # qwen2 has qkv biases


def test_bucketize_hand_example():
    t = lambda n, k, dt="bfloat16": TensorSpec(n, (k,), dt)  # noqa: E731
    specs = [t("a", 100), t("b", 100), t("c", 300), t("d", 10), t("e", 50), t("f", 1, "float32")]
    got = [[x.name for x in b] for b in bucketize(specs, 400)]
    # a+b = 400 B fits; c = 600 B alone (over-size); d+e = 120 B; f (fp32) at offset 120 is aligned.
    assert got == [["a", "b"], ["c"], ["d", "e", "f"]]
    odd = [TensorSpec("x", (3,), "int8"), TensorSpec("y", (1,), "float32")]
    assert [[x.name for x in b] for b in bucketize(odd, 1024)] == [["x"], ["y"]]  # offset 3 unaligned


def test_bucketize_keeps_a_group_together():
    t = lambda n, k: TensorSpec(n, (k,), "bfloat16")  # noqa: E731
    specs = [t("a", 100), t("q_a", 100), t("q_b", 100), t("kv_a", 100), t("z", 10)]
    group = {"q_a": "L0", "q_b": "L0", "kv_a": "L0"}.get
    assert [[x.name for x in b] for b in bucketize(specs, 400)] == [["a", "q_a"], ["q_b", "kv_a"], ["z"]]  # control
    # 200 B each; the group (600 B) never splits: it starts a bucket, and being over-size, it is one of its own
    assert [[x.name for x in b] for b in bucketize(specs, 400, group)] == [["a"], ["q_a", "q_b", "kv_a"], ["z"]]
    assert [[x.name for x in b] for b in bucketize(specs, 1000, group)] == [["a", "q_a", "q_b", "kv_a", "z"]]


def test_deepseek_fused_projections_one_bucket():
    """SGLang fuses DeepSeek's q_a_proj + kv_a_proj_with_mqa only when both come in one update
    (models/moe_families.py DeepseekV3Adapter.bucket_group): every bucket size keeps each layer's
    pair together; without the adapter's groups some size splits them (the control)."""
    cfg = tiny_config("deepseek_v3", vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48,
                      qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, num_key_value_heads=2,
                      intermediate_size=256, num_nextn_predict_layers=0)
    adapter = get_adapter(cfg)
    stages = [s.tensors for s in adapter.plan(ParallelLayout(world_size=1), dtype="float32")]

    def split(plan) -> bool:
        where = {t.name: b.index for st in plan.stages for b in st.buckets for t in b.tensors}
        return any(where[f"model.layers.{i}.self_attn.q_a_proj.weight"]
                   != where[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] for i in range(2))

    sizes = range(16 << 10, 256 << 10, 4 << 10)
    lay = ParallelLayout(world_size=1)
    assert any(split(plan_weight_sync(stages, lay, b)) for b in sizes)
    assert not any(split(plan_weight_sync(stages, lay, b, adapter.bucket_group)) for b in sizes)


def test_bucket_size_from_config_and_small_buckets():
    cfg = WeightSyncConfig(bucket_mib=0.0625)
    plan = _plan(TINY_QWEN2, 2, 2, bucket=cfg.bucket_bytes)
    assert cfg.bucket_bytes == 65536
    assert plan.num_buckets > len(plan.stages)
    assert all(b.nbytes <= 65536 or len(b.tensors) == 1 for s in plan.stages for b in s.buckets)
    assert [t.name for t in plan.tensors] == [t.name for t in _plan(TINY_QWEN2, 2, 2).tensors]


def test_check_against_names_both_shapes():
    plan = _plan(TINY_QWEN2, 2, 2)
    server = {t.name: t for t in _plan(dict(TINY_QWEN2, vocab_size=640), 1, 1).tensors}
    with pytest.raises(PlanMismatchError) as e:
        check_plan_against(plan, server, "server X")
    assert "'model.embed_tokens.weight': learner shape [512, 128] != server X shape [640, 128]" in str(e.value)
    check_plan_against(plan, {t.name: t for t in _plan(TINY_QWEN2, 1, 1).tensors})  # same model: ok


def test_duplicate_tensor_across_stages_rejected():
    layout = ParallelLayout(world_size=2, pp=2)
    t = TensorSpec("w", (2,), "bfloat16")
    with pytest.raises(ValueError, match="'w' is exported by stage 0 and stage 1"):
        plan_weight_sync([[t], [t]], layout, 1024)


def test_sender_pack_reuses_two_buffers_bytes_exact():
    """flattened_bucket packing: the bytes are the tensors' back to back, two buffers alternate
    (a payload stays intact while the next bucket is packed), and a larger bucket grows its buffer."""
    import torch

    from areal_mega.weight_sync.transport import BroadcastSender

    sender = BroadcastSender([], [], group_name="t", backend="gloo", address="127.0.0.1", port=0, timeout_s=1)

    def expect(ts):
        return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ts])

    a = [torch.arange(6, dtype=torch.float32).view(2, 3).t(), torch.ones(5, dtype=torch.bfloat16)]
    b = [torch.full((7,), 3, dtype=torch.int64)]
    c = [torch.randn(64, dtype=torch.float32)]
    (pa,) = sender.pack(a)
    (pb,) = sender.pack(b)
    assert torch.equal(pa, expect(a)) and torch.equal(pb, expect(b))
    assert pa.data_ptr() != pb.data_ptr()
    (pc,) = sender.pack(c)  # bigger than a's buffer: a new one, same slot
    assert torch.equal(pc, expect(c)) and torch.equal(pb, expect(b))
    (pa2,) = sender.pack(a)  # reuses b's slot
    assert pa2.data_ptr() == pb.data_ptr() and torch.equal(pa2, expect(a))
    sender.release_buffers()  # end of a sync: kept on CPU (fresh ones would page-fault)
    (pb2,) = sender.pack(b)
    assert pb2.data_ptr() == pc.data_ptr() and torch.equal(pb2, expect(b))
    sender.close()

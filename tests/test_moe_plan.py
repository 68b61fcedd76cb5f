"""Qwen3 / Qwen3-MoE without processes: expert-parallel layout arithmetic and rank order vs
megatron's own RankGenerator, the adapters' config refusals, and the pure weight-sync planner on
Qwen3-30B-A3B and Qwen3-235B-A22B shapes (tensor count and bytes against hand-computed totals).
Runtime ~5 s (importing megatron for RankGenerator)."""

from __future__ import annotations

import pytest

from areal_mega.models import get_adapter
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.weight_sync.planner import plan_weight_sync
from tests.support.models import tiny_config

MiB = 1 << 20
# Published shapes (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
QWEN3_30B_A3B = dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, torch_dtype="bfloat16", decoder_sparse_step=1, mlp_only_layers=[],
                     rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, sliding_window=None,
                     use_sliding_window=False, max_window_layers=48, router_aux_loss_coef=0.001,
                     output_router_logits=False, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
                     architectures=["Qwen3MoeForCausalLM"], bos_token_id=151643, eos_token_id=151645,
                     initializer_range=0.02, rope_scaling=None, use_cache=True, transformers_version="4.51.0")
QWEN3_235B_A22B = dict(QWEN3_30B_A3B, num_hidden_layers=94, hidden_size=4096, intermediate_size=12288,
                       moe_intermediate_size=1536, num_attention_heads=64, max_window_layers=94)


def hand_count(layers, h, f, experts, heads, kv, d, vocab) -> tuple[int, int, int]:
    """(tensors, bf16 bytes, expert tensors) of a Qwen3-MoE checkpoint, from the shapes."""
    per_layer = (2 * h                      # input / post-attention norms
                 + heads * d * h + 2 * kv * d * h + h * heads * d  # q, k, v, o
                 + 2 * d                    # q_norm, k_norm
                 + experts * h              # router
                 + experts * 3 * f * h)     # gate, up, down per expert
    params = layers * per_layer + 2 * vocab * h + h  # embed, lm_head, final norm
    tensors = layers * (2 + 4 + 2 + 1 + 3 * experts) + 3
    return tensors, 2 * params, layers * 3 * experts


@pytest.mark.parametrize("hf,layout,total_params", [
    (QWEN3_30B_A3B, dict(tp=2, pp=4, ep=8, etp=1, world=64), 30.5e9),
    (QWEN3_235B_A22B, dict(tp=4, pp=2, ep=16, etp=1, world=128), 235.1e9),
])
def test_plan_qwen3_moe_shapes(hf, layout, total_params):
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"],
                                              expert_parallel=layout["ep"], expert_tensor_parallel=layout["etp"]),
                               layout["world"])
    stages = get_adapter(hf).plan(lay)
    plan = plan_weight_sync([s.tensors for s in stages], lay, 512 * MiB)
    n, nbytes, n_expert = hand_count(hf["num_hidden_layers"], hf["hidden_size"], hf["moe_intermediate_size"],
                                     hf["num_experts"], hf["num_attention_heads"], hf["num_key_value_heads"],
                                     hf["head_dim"], hf["vocab_size"])
    names = [t.name for t in plan.tensors]
    assert len(names) == n and len(set(names)) == n  # every tensor exactly once
    assert plan.nbytes == nbytes
    assert abs(nbytes / 2 - total_params) < 0.002 * total_params  # the published parameter count
    experts = [t for s in stages for t in s.tensors if t.source.ep_rank is not None]
    assert len(experts) == n_expert and all(".mlp.experts." in t.name for t in experts)
    # expert g of every layer lives on EP rank g // (E / ep), as local expert g % (E / ep)
    per = hf["num_experts"] // lay.ep
    for t in experts:
        g = int(t.name.split(".mlp.experts.")[1].split(".")[0])
        assert t.source.ep_rank == g // per and f"local_experts.{g % per}." in t.source.name
    assert [s.sender_rank for s in plan.stages] == [lay.rank(pp=p) for p in range(lay.pp)]


def test_expert_layout_arithmetic_in_errors():
    with pytest.raises(ValueError, match=r"expert_parallel\(4\) \* expert_tensor_parallel\(2\) = 8 does not divide "
                                         r"the ranks of a pipeline stage, dp\(2\) \* cp\(1\) \* tp\(2\) = 4"):
        ParallelLayout.build(ParallelConfig(tensor_parallel=2, pipeline_parallel=2, expert_parallel=4), 8)
    lay = ParallelLayout.build(ParallelConfig(expert_parallel=4), 4)
    with pytest.raises(ValueError, match=r"num_experts\(6\) % expert_parallel\(4\) != 0"):
        lay.check_experts(6, 32)
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=4), 4)
    with pytest.raises(ValueError, match=r"moe_intermediate_size\(30\) % expert_tensor_parallel\(4\) != 0"):
        lay.check_experts(8, 30)
    with pytest.raises(ValueError, match="expert_parallel: must be >= 1"):
        ParallelConfig(expert_parallel=0).validate()
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1), 4)
    assert (lay.ep, lay.etp, lay.edp, lay.dp) == (2, 1, 2, 2) and "ep=2 etp=1" in str(lay)
    assert str(ParallelLayout.build(ParallelConfig(tensor_parallel=2), 4)) == "dp=2 pp=1 cp=1 tp=2 (world_size=4)"


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", [(2, 1, 2, 2, 2, 1), (2, 1, 2, 2, 2, 2), (1, 1, 8, 2, 4, 1),
                                                (4, 1, 2, 2, 2, 4), (2, 2, 2, 1, 4, 2), (8, 1, 4, 2, 8, 1)])
def test_expert_rank_order_matches_megatron(tp, cp, dp, pp, ep, etp):
    """ParallelLayout's expert coordinates vs megatron's expert_decoder_rank_generator (built
    exactly as initialize_model_parallel builds it: tp=etp, ep, dp=edp, pp, cp=1)."""
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                                              expert_parallel=ep, expert_tensor_parallel=etp), world)
    gen = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    names = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    for axis, ours in names.items():
        for group in gen.get_ranks(axis):
            coords = [lay.coords(r) for r in group]
            others = {tuple(getattr(c, a) for a in names.values() if a != ours) for c in coords}
            assert len(others) == 1, (axis, group)
            assert [getattr(c, ours) for c in coords] == list(range(len(group)))
    for r in range(world):
        c = lay.coords(r)
        assert lay.expert_rank(pp=c.pp, edp=c.edp, ep=c.ep, etp=c.etp) == r


def _qwen3_moe(**over) -> dict:
    return {**tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), **over}


@pytest.mark.parametrize("over,msg", [
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size: shared experts"),
    (dict(n_shared_experts=1), "n_shared_experts: shared experts"),
    (dict(n_group=4), "n_group: grouped (device-limited) routing"),
    (dict(topk_group=2), "topk_group: grouped (device-limited) routing"),
    (dict(kv_lora_rank=64), "kv_lora_rank: multi-latent attention (MLA)"),
    (dict(q_lora_rank=64), "q_lora_rank: multi-latent attention (MLA)"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers: multi-token prediction (MTP) heads"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step: 2 (dense layers between MoE layers)"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers: [0] (dense MLP layers)"),
    (dict(use_sliding_window=True), "use_sliding_window: true is not supported"),
    (dict(some_new_knob=3), "some_new_knob: config key not implemented by the qwen3_moe adapter"),
    (dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob: true with num_experts_per_tok 1"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok: 9 is not in [1, num_experts(8)]"),
])
def test_unimplemented_moe_variants_refused(over, msg):
    with pytest.raises(ValueError) as e:
        get_adapter(_qwen3_moe(**over))
    assert str(e.value).startswith(msg), str(e.value)


def test_refusals_dense_qwen3_and_off_values_accepted():
    with pytest.raises(ValueError, match="^q_lora_rank: multi-latent attention"):
        get_adapter({**tiny_config("qwen3"), "q_lora_rank": 16})
    with pytest.raises(ValueError, match="^num_experts: config key not implemented by the qwen3 adapter"):
        get_adapter({**tiny_config("qwen3"), "num_experts": 8})  # MoE keys on a dense model
    # present-but-off variant keys (as some configs write them) are fine
    a = get_adapter(_qwen3_moe(n_shared_experts=0, num_nextn_predict_layers=0, mlp_only_layers=[]))
    assert a.arch.num_experts == 8 and a.arch.qk_layernorm and a.arch.moe_topk == 2
    # head_dim free of hidden / heads (megatron kv_channels)
    assert get_adapter({**tiny_config("qwen3", head_dim=48)}).arch.head_dim == 48


def test_routing_replay_settings_validated():
    from areal_mega.config import from_dict
    from areal_mega.megatron.model import MegatronModelConfig
    from areal_mega.experiment import ExperimentConfig

    cfg = ExperimentConfig(model_path="m")
    cfg.actor.model.moe_routing_replay = "proximal"
    cfg.algorithm.decoupled = False
    with pytest.raises(ValueError, match="^actor.model.moe_routing_replay: 'proximal' replays the proximal"):
        cfg.validate()
    cfg.actor.model.moe_routing_replay = "observe"
    with pytest.raises(ValueError, match="^actor.model.moe_routing_replay: 'observe' measures the routes in the"):
        cfg.validate()
    cfg.algorithm.decoupled = True
    cfg.validate()
    for mode in ("off", "observe", "rollout"):
        cfg.actor.model.moe_routing_replay = mode
        cfg.validate()
    # which modes start the servers with route capture
    assert [m for m in ("off", "observe", "rollout", "proximal")
            if MegatronModelConfig(moe_routing_replay=m).captures_server_routes] == ["observe", "rollout"]
    cfg.actor.model.moe_routing_replay = "rollout"
    cfg.actor.model.recompute = "full"
    with pytest.raises(ValueError, match="^moe_routing_replay: rollout with recompute 'full' is not supported"):
        cfg.actor.model.validate()
    # YAML 1.1 reads a bare `off` as false: it means "off"; anything else is named
    assert from_dict(MegatronModelConfig, {"moe_routing_replay": False}).moe_routing_replay == "off"
    with pytest.raises(ValueError, match="moe_routing_replay: 'r3' is not one of"):
        from_dict(MegatronModelConfig, {"moe_routing_replay": "r3"})
    cfg.actor.model.moe_aux_loss_coef = -1.0
    with pytest.raises(ValueError, match="^moe_aux_loss_coef: must be >= 0"):
        cfg.actor.model.validate()

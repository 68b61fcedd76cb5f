"""Placement and memory estimator, pure logic (no processes, no cluster). Runtime ~3 s
(one transformers import for the parameter-count cross-check)."""

from __future__ import annotations

import json

import pytest

from areal_mega.launcher.cli import load_launch_config
from areal_mega.launcher.config import LaunchConfig, LearnerLaunchConfig, ModelShape
from areal_mega.launcher.memory import GIB, activation_bytes_per_token, count_params, estimate_engine, \
    estimate_learner, total_params
from areal_mega.launcher.plan import Allocation, build_plan, render
from areal_mega.parallel import ParallelConfig, ParallelLayout

LLAMA3_70B = ModelShape(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256)
CONFIG_70B = "configs/grpo_llama70b.yaml"


def alloc(n: int, gpus: int, cpus: int | None = None) -> Allocation:
    return Allocation(job_id="42", nodes=tuple(f"n{k}" for k in range(1, n + 1)),
                      addresses=tuple(f"10.0.0.{k}" for k in range(1, n + 1)), gpus_per_node=gpus,
                      cpus_per_node=cpus)


def plan_70b(overrides=(), n=16, gpus=8, cpus=None):
    cfg, raw, rest = load_launch_config(CONFIG_70B, list(overrides))
    return build_plan(cfg, alloc(n, gpus, cpus), raw=raw, config_path=CONFIG_70B, overrides=rest, python="PY")


def test_llama3_70b_parameter_count_by_hand():
    # per layer: q 8192*8192 + k,v 2*8192*1024 + o 8192*8192 = 150,994,944; MLP 3*8192*28672 = 704,643,072;
    # norms 2*8192. Embedding and output 128256*8192 each, final norm 8192.
    layer = 150_994_944 + 704_643_072 + 16_384
    assert total_params(LLAMA3_70B) == 80 * layer + 2 * 128_256 * 8192 + 8192 == 70_553_706_496


def test_parameter_count_matches_transformers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=96,
                                         num_attention_heads=8, num_key_value_heads=2, vocab_size=100,
                                         tie_word_embeddings=False))
    shape = ModelShape(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=100)
    assert total_params(shape) == sum(p.numel() for p in llama.parameters())
    qwen = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        tie_word_embeddings=True))
    shape = ModelShape(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=100, tie_word_embeddings=True, attention_bias=True)
    assert total_params(shape) == sum(p.numel() for p in qwen.parameters())


def test_learner_memory_70b_tp8_pp4_by_hand():
    cfg = LearnerLaunchConfig(micro_batch_tokens=8192, recompute="selective", sequence_parallel=True,
                              reserved_gib=6.0)
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 32)
    est = estimate_learner(LLAMA3_70B, cfg, layout, 80.0)
    # Stage 0 is the worst: 20 layers + the embedding, 4 micro-batches in flight.
    params = 20 * (855_638_016 // 8 + 16_384) + 128_256 * 8192 // 8
    assert est.stage == 0 and est.params == params == 2_270_756_864
    assert (est.weights, est.grads, est.optimizer) == (2 * params, 4 * params, 12 * params)  # dp = 1
    # bytes/token/layer: (2*4*8192 + 2*(2*64*128 + 2*8*128 + 3*28672) + 4*64) / 8 = 274,688 / 8
    assert activation_bytes_per_token(LLAMA3_70B, cfg, 8) == 34_336
    assert est.activations == 4 * 20 * 8192 * 34_336
    assert est.logits == 0
    assert est.total / GIB == pytest.approx(65.0, abs=0.05) and est.fits


def test_learner_memory_variants():
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 64)  # dp = 2
    base = estimate_learner(LLAMA3_70B, LearnerLaunchConfig(micro_batch_tokens=8192), layout, 80.0)
    assert base.optimizer == 12 * base.params / 2
    full = estimate_learner(LLAMA3_70B, LearnerLaunchConfig(micro_batch_tokens=8192, recompute="full"), layout, 80.0)
    # full recompute: 2h/t bytes per token per layer kept, plus one layer rematerialised.
    assert full.activations == 4 * 20 * 8192 * (2 * 8192 / 8) + 8192 * 34_336
    no_sp = LearnerLaunchConfig(micro_batch_tokens=8192, sequence_parallel=False)
    assert activation_bytes_per_token(LLAMA3_70B, no_sp, 8) == 2 * 4 * 8192 + (274_688 - 65_536) / 8
    unfused = LearnerLaunchConfig(micro_batch_tokens=8192, flash_attention=False, recompute="none")
    assert activation_bytes_per_token(LLAMA3_70B, unfused, 8) == 34_336 + 2 * 64 * 8192 / 8
    # The last stage of PP keeps the output layer and one micro-batch of fp32+bf16 logits.
    one_stage = ParallelLayout.build(ParallelConfig(tensor_parallel=8), 8)
    est = estimate_learner(LLAMA3_70B, LearnerLaunchConfig(micro_batch_tokens=1024), one_stage, 80.0)
    assert est.logits == 1024 * 6 * 128_256 / 8


def test_engine_memory_70b():
    est = estimate_engine(LLAMA3_70B, tp=8, max_total_tokens=1_000_000, mem_fraction_static=0.85,
                          kv_dtype_bytes=2, gpu_memory_gib=80)
    assert est.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2 == 40_960  # K and V, 80 layers, 8 kv heads / 8
    pc = count_params(LLAMA3_70B)
    assert est.weights == 2 * ((80 * pc.layer_sharded + 2 * 128_256 * 8192) / 8 + 80 * 16_384 + 8192)
    assert est.fits and est.budget == 0.85 * 80 * GIB
    tp1 = estimate_engine(LLAMA3_70B, tp=1, max_total_tokens=None, mem_fraction_static=0.85,
                          kv_dtype_bytes=2, gpu_memory_gib=80)
    assert not tp1.fits and tp1.kv_cache == 0  # 131 GiB of weights alone exceed the budget


def test_plan_70b_places_learners_then_engines():
    plan = plan_70b()
    assert plan.learner_nodes == ("n1", "n2", "n3", "n4")
    assert plan.engine_nodes == tuple(f"n{k}" for k in range(5, 17))
    assert str(plan.layout) == "dp=1 pp=4 cp=1 tp=8 (world_size=32)"
    assert [e.url for e in plan.engines] == [f"http://10.0.0.{k}:30000" for k in range(5, 17)]
    assert all(e.num_gpus == 8 and e.cpus is None for e in plan.engines)
    for r, spec in enumerate(plan.learners):
        argv = list(spec.argv)
        assert argv[argv.index("--node-rank") + 1] == str(r)
        assert argv[argv.index("--nnodes") + 1] == "4" and argv[argv.index("--nproc-per-node") + 1] == "8"
        assert argv[argv.index("--master-addr") + 1] == "10.0.0.1"
        addresses = [a for a in argv if a.startswith("inference.addresses=")]
        assert addresses == ["inference.addresses=[" + ",".join(f"10.0.0.{k}:30000" for k in range(5, 17)) + "]"]
    sglang = list(plan.engines[0].argv)
    sglang = sglang[sglang.index("--") + 1:]
    assert sglang[1:3] == ["-m", "sglang.launch_server"]
    assert sglang[sglang.index("--host") + 1] == "10.0.0.5" and sglang[sglang.index("--tp-size") + 1] == "8"
    assert plan.env["NCCL_SOCKET_IFNAME"] == "ib0" and plan.fits
    text = plan.describe()
    assert "learner per-GPU memory" in text and "engine per-GPU memory (TP8)" in text


def test_plan_refuses_tp1_and_names_keys():
    plan = plan_70b(["parallel.tensor_parallel=1"])
    assert not plan.fits and not plan.learner_memory.fits
    assert plan.learner_memory.total / GIB == pytest.approx(300.5, abs=0.05)
    assert not plan_70b(["inference.server.tp_size=1"]).fits
    with pytest.raises(ValueError, match="launch.engine.num_nodes"):
        plan_70b(["launch.engine.num_nodes=13"])
    with pytest.raises(ValueError, match="inference.server.tp_size: 16 > 8"):
        plan_70b(["inference.server.tp_size=16"])
    with pytest.raises(ValueError, match=r"world_size\(32\) is not divisible"):
        plan_70b(["parallel.tensor_parallel=3"])


def test_plan_two_engines_per_node_share_cpus():
    plan = plan_70b(["inference.server.tp_size=4", "launch.engine.num_nodes=2", "inference.server.env.FOO='x'"],
                    n=6, cpus=64)
    assert plan.engines[0].env["FOO"] == "x" and "FOO" not in plan.learners[0].env
    assert "env FOO=x" in plan.describe()
    assert [(e.node, e.url.rsplit(":", 1)[1]) for e in plan.engines] == [
        ("n5", "30000"), ("n6", "30000"), ("n5", "30001"), ("n6", "30001")]
    assert all(e.cpus == 32 and e.num_gpus == 4 for e in plan.engines)
    assert plan.learners[0].cpus is None  # alone on its node: the whole node
    assert plan.notes == ()


def test_local_and_cpu_plans(tmp_path):
    cfg = LaunchConfig()
    cfg.engine.num_engines = 2
    cfg.engine.command = ["{python}", "srv", "{host}", "{port}", "{cfg:model_path}"]
    # Layout from the trainer's `parallel` section, shape from <model_path>/config.json.
    hf = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    raw = {"model_path": str(tmp_path), "parallel": {"tensor_parallel": 2, "pipeline_parallel": 2},
           "inference": {"server": {"port": 30000}}}
    local = Allocation(job_id="local", nodes=("localhost",), addresses=("127.0.0.1",), gpus_per_node=8, local=True)
    cfg.learner.nproc_per_node = 4
    plan = build_plan(cfg, local, raw=raw, config_path="c.yaml", overrides=["a.b=1"], python="PY")
    assert plan.learners[0].gpu_ids == (0, 1, 2, 3)
    assert [e.gpu_ids for e in plan.engines] == [(4,), (5,)]
    assert [e.url for e in plan.engines] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert list(plan.engines[1].argv[-5:]) == ["PY", "srv", "127.0.0.1", "30001", str(tmp_path)]
    assert str(plan.layout) == "dp=1 pp=2 cp=1 tp=2 (world_size=4)"
    # The Qwen2 shape checked against transformers above; worst = stage 0 (2 micro-batches in
    # flight): 1 layer (q,k,v,o + biases + MLP = 30,848 over TP2, norms 128) + embedding 6400 / 2.
    assert count_params(ModelShape.from_hf_config(hf)).layer_sharded == 30_848
    assert (plan.learner_memory.stage, plan.learner_memory.params) == (0, 30_848 // 2 + 128 + 6400 // 2)
    assert list(plan.learners[0].argv[-1:]) == ["a.b=1"]
    # inference.server.port 0: free local ports.
    free = build_plan(cfg, local, raw={**raw, "inference": {}}, config_path="c.yaml", overrides=[], python="PY")
    ports = {int(e.url.rsplit(":", 1)[1]) for e in free.engines}
    assert len(ports) == 2 and all(p > 0 for p in ports)
    # CPU nodes: ranks per node default to the model-parallel size / nodes; memory not enforced.
    cfg.learner.nproc_per_node = None
    cfg.learner.num_nodes = 2
    cfg.engine.num_engines = None
    cpu = build_plan(cfg, alloc(4, 0), raw=raw, config_path="c.yaml", overrides=[], python="PY")
    assert [s.nproc for s in cpu.learners] == [2, 2] and cpu.layout.world_size == 4
    assert len(cpu.engines) == 2 and cpu.engines[0].num_gpus == 0 and cpu.fits
    cfg.engine.num_engines = 1
    one = build_plan(cfg, alloc(4, 0), raw=raw, config_path="c.yaml", overrides=[], python="PY")
    assert one.notes == ("1 allocated node(s) left idle",)


def test_render_placeholders():
    raw = {"a": {"b": 3}}
    assert render(["x{port}", "{cfg:a.b}", "{overrides}"], {"port": 1}, raw, ["k=v", "j=w"], "key") == \
        ["x1", "3", "k=v", "j=w"]
    with pytest.raises(ValueError, match=r"key: unknown placeholder \{nope\}"):
        render(["{nope}"], {}, raw, [], "key")
    with pytest.raises(ValueError, match=r"placeholder \{cfg:a.c\} names a key missing"):
        render(["{cfg:a.c}"], {}, raw, [], "key")


def test_learner_memory_counts_reference_and_critic():
    """kl_coef > 0 adds a bf16 copy of the stage's weights; a PPO critic adds its own weights,
    grads and optimizer state (value head h -> 1 instead of the output layer)."""
    cfg = LearnerLaunchConfig(micro_batch_tokens=8192, recompute="selective", sequence_parallel=True,
                              reserved_gib=6.0)
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 64)  # dp = 2
    base = estimate_learner(LLAMA3_70B, cfg, layout, 80.0)
    ref = estimate_learner(LLAMA3_70B, cfg, layout, 80.0, reference=True)
    assert ref.stage == base.stage == 0 and ref.reference == 2 * base.params
    assert ref.total == base.total + 2 * base.params
    both = estimate_learner(LLAMA3_70B, cfg, layout, 80.0, reference=True, critic=True)
    assert both.critic == (6 + 12 / 2) * base.params  # stage 0: the critic's trunk == the actor's
    assert not both.fits and "reference" in both.describe() and "critic" in both.describe()
    # Last stage at PP1: the critic has no output layer, a value head of h parameters instead.
    one = ParallelLayout.build(ParallelConfig(tensor_parallel=8), 8)
    est = estimate_learner(LLAMA3_70B, LearnerLaunchConfig(micro_batch_tokens=1024), one, 80.0, critic=True)
    assert est.critic == 18 * (est.params - 128_256 * 8192 // 8 + 8192)


def test_plan_memory_counts_reference_from_experiment():
    """The plan reads algorithm.kl_coef / adv_estimator from the experiment config: the 70B GRPO
    plan (65.0 GiB) with a KL reference still fits 80 GB; adding a PPO critic does not."""
    base = plan_70b()
    ref = plan_70b(["algorithm.kl_coef=0.001"])
    assert ref.learner_memory.reference == 2 * base.learner_memory.params and ref.fits
    assert (ref.learner_memory.total - base.learner_memory.total) / GIB == pytest.approx(4.23, abs=0.01)
    ppo = plan_70b(["algorithm.kl_coef=0.001", "algorithm.adv_estimator=gae"])
    assert ppo.learner_memory.critic > 0 and not ppo.fits

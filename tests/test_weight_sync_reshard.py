"""Pure resharding plan (weight_sync/reshard.py + sglang_layout.py): no process, no group.

* Tiny models, real tensors: the learner's megatron shards (built by the adapter's own
  split_tp, the layout the export tests pin bit-exactly) are packed by the sender's pack_message
  and written by the SGLang-side receiver's own write path (tools/env/sglang_reshard.py), message
  by message in plan order; every engine rank's parameters must then equal an independent
  reference of SGLang's loaders (written here from SGLang 0.5.23's weight_loader rules, not from
  sglang_layout.py), bit for bit. Controls: a naive contiguous [q; k; v] megatron rule, and a
  dropped / duplicated message, are caught.
* Published shapes (Llama-3-70B; Qwen3-235B-A22B and DeepSeek-V3-671B at reduced depth, every
  tensor at its published shape): every engine rank receives
  exactly its shard bytes (hand-computed for 70B), every weight element once, replicas split
  the work; the byte counts the docs' projections use are printed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from areal_mega.models import get_adapter
from areal_mega.models.base import ModelAdapter, named_tensors  # noqa: F401 (named_tensors: the sender's view)
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.simulator.costs import sync_bytes
from areal_mega.simulator.memory import total_params
from areal_mega.weight_sync.reshard import ReshardPlan, plan_reshard, wire_messages
from areal_mega.weight_sync.sglang_layout import EngineLayout, engine_params, sglang_vocab_padded
from areal_mega.weight_sync.transport import pack_message
from tests.support.models import tiny_config
from tests.test_moe_families_plan import DEEPSEEK_V3_671B
from tests.test_moe_plan import QWEN3_235B_A22B
from tests.test_weight_sync_planner import LLAMA_70B

REPO = Path(__file__).resolve().parents[1]


def _receiver():
    spec = importlib.util.spec_from_file_location("areal_mega_sglang_reshard", REPO / "tools/env/sglang_reshard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RECEIVER = _receiver()


# ---------------------------------------------------------------- tiny models, real tensors
def _hf_tensors(adapter: ModelAdapter, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(adapter.hf_shape(n), generator=g) for n in adapter.hf_names()}


def _learner_locals(adapter: ModelAdapter, layout: ParallelLayout, hf: dict) -> dict[int, list[dict]]:
    """rank -> per chunk {megatron name: local shard}, from the adapter's own layout code."""
    out: dict[int, list[dict]] = {}
    stages = adapter.plan(layout)
    for r in range(layout.world_size):
        c = layout.coords(r)
        stage = stages[c.pp]
        chunks: list[dict] = [{} for _ in range(layout.vpp or 1)]
        for prm in stage.params:
            if prm.ep_rank is not None and prm.ep_rank != c.ep:
                continue
            canon = adapter.from_hf(prm, [hf[n] for n in prm.hf_names])
            size, rank = (layout.etp, c.etp) if prm.ep_rank is not None else (layout.tp, c.tp)
            chunks[prm.chunk][prm.name] = adapter.split_tp(prm, canon, size, rank).clone()
        out[r] = chunks
    return out


def _sglang_reference(adapter: ModelAdapter, eng: EngineLayout, rank: int, hf: dict) -> dict[str, torch.Tensor]:
    """SGLang 0.5.23's loaders, rank ``rank``: written from its weight_loader rules, by parameter."""
    a = adapter.arch
    tp, d = eng.tp, a.head_dim
    mtp = tp // eng.ep
    ep_rank, mt = rank // mtp, rank % mtp

    def vocab(w):
        vp = sglang_vocab_padded(w.shape[0], tp)
        return torch.cat([w, w.new_zeros(vp - w.shape[0], w.shape[1])]).chunk(tp)[rank]

    def qkv(q, k, v):
        if a.num_kv_heads >= tp:
            kk, vv = k.chunk(tp)[rank], v.chunk(tp)[rank]
        else:  # num_kv_head_replicas = tp / nkv: rank r loads KV head r // replicas
            head = rank // (tp // a.num_kv_heads)
            kk, vv = k[head * d:(head + 1) * d], v[head * d:(head + 1) * d]
        return torch.cat([q.chunk(tp)[rank], kk, vv])

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]), "model.norm.weight": hf["model.norm.weight"]}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    for i in range(a.num_layers):
        L = f"model.layers.{i}"
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "mlp.gate.weight"):
            if f"{L}.{n}" in hf:
                out[f"{L}.{n}"] = hf[f"{L}.{n}"]
        out[f"{L}.self_attn.qkv_proj.weight"] = qkv(*(hf[f"{L}.self_attn.{p}_proj.weight"] for p in "qkv"))
        if a.qkv_bias:
            out[f"{L}.self_attn.qkv_proj.bias"] = qkv(*(hf[f"{L}.self_attn.{p}_proj.bias"] for p in "qkv"))
        out[f"{L}.self_attn.o_proj.weight"] = hf[f"{L}.self_attn.o_proj.weight"].chunk(tp, dim=1)[rank]
        if a.is_moe_layer(i):
            per = a.num_experts // eng.ep
            w13, w2 = [], []
            for g in range(ep_rank * per, (ep_rank + 1) * per):
                e = f"{L}.mlp.experts.{g}."
                w13.append(torch.cat([hf[e + "gate_proj.weight"].chunk(mtp)[mt], hf[e + "up_proj.weight"].chunk(mtp)[mt]]))
                w2.append(hf[e + "down_proj.weight"].chunk(mtp, dim=1)[mt])
            out[f"{L}.mlp.experts.w13_weight"], out[f"{L}.mlp.experts.w2_weight"] = torch.stack(w13), torch.stack(w2)
        else:
            out[f"{L}.mlp.gate_up_proj.weight"] = torch.cat([hf[f"{L}.mlp.gate_proj.weight"].chunk(tp)[rank],
                                                             hf[f"{L}.mlp.up_proj.weight"].chunk(tp)[rank]])
            out[f"{L}.mlp.down_proj.weight"] = hf[f"{L}.mlp.down_proj.weight"].chunk(tp, dim=1)[rank]
    return out


def _run_plan(plan: ReshardPlan, locals_: dict, adapter: ModelAdapter, counts: dict | None = None) -> dict:
    """Execute the plan in-process with the sender's pack and the receiver's own paths: a message
    the receiver takes in place (direct_target) is "received" by copying the sent bytes there,
    the others are written piece by piece. ``counts``: how many messages went without a copy on
    the sender's side (``no_pack``) and on the receiver's (``in_place``)."""
    counts = {} if counts is None else counts
    engines = {}
    for (srv, r), params in plan.engine_params.items():
        engines[(srv, r)] = {p.name: torch.zeros(p.shape) for p in params}
    for (srv, r), params in engines.items():
        msgs = plan.received_by(srv, r)
        bufs = []
        for m, wire in zip(msgs, wire_messages(msgs)):
            sent = pack_message(m, locals_[m.src], torch.empty(m.nbytes, dtype=torch.uint8))
            no_pack = sent.data_ptr() == _src_ptr(m, locals_)
            counts["no_pack"] = counts.get("no_pack", 0) + int(no_pack)
            counts["no_pack_bytes"] = counts.get("no_pack_bytes", 0) + m.nbytes * int(no_pack)
            target = RECEIVER.direct_target(params, wire)
            if target is not None:
                target.copy_(sent)
                counts["in_place"] = counts.get("in_place", 0) + 1
                counts["in_place_bytes"] = counts.get("in_place_bytes", 0) + m.nbytes
            bufs.append(None if target is not None else sent)
        err = RECEIVER.apply_messages(params, wire_messages(msgs), bufs)
        assert err is None, err
    return engines


def _src_ptr(m, locals_: dict) -> int:
    p = m.pieces[0]
    t = locals_[m.src][p.src_chunk][p.src_param]
    for d, (a, b) in enumerate(p.src_box):
        t = t.narrow(d, a, b - a)
    return t.data_ptr()


CASES = {
    # name: (HF config, learner ParallelConfig, world, engine layouts)
    "qwen2-tied-bias TP2xPP2 -> 2x TP2": (
        dict(tiny_config("qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)),
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2), 4, [EngineLayout(2), EngineLayout(2)]),
    "llama vocab 300 TP2xDP2 -> TP4 (KV replicated), TP1": (
        tiny_config("llama", vocab_size=300, num_attention_heads=4, num_key_value_heads=2),
        ParallelConfig(tensor_parallel=2), 4, [EngineLayout(4), EngineLayout(1)]),
    "qwen3 PP2xVPP2 TP1 -> TP2": (
        tiny_config("qwen3", head_dim=32),
        ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2), 2, [EngineLayout(2)]),
    "qwen3_moe EP2 -> TP2, TP2xEP2": (
        tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2),
        ParallelConfig(expert_parallel=2), 2, [EngineLayout(2), EngineLayout(2, ep=2)]),
    "qwen3_moe TP2xEP2 ETP1 -> TP2": (
        tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2),
        ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1), 2, [EngineLayout(2)]),
}


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_reshard_writes_sglangs_own_shards_bit_exact(case, backend):
    cfg, pcfg, world, engines = CASES[case]
    adapter = get_adapter(cfg)
    layout = ParallelLayout.build(pcfg, world)
    hf = _hf_tensors(adapter)
    plan = plan_reshard(adapter, layout, engines, dtype="float32", bucket_bytes=40_000, backend=backend)
    plan.check()
    assert plan.num_rounds > 1 and len(plan.messages) > len(plan.shard_bytes)  # the bucket cut and the rounds ran
    counts: dict = {}
    got = _run_plan(plan, _learner_locals(adapter, layout, hf), adapter, counts)
    if backend == "gloo":  # both paths ran: spans without a copy on either side, the rest packed
        assert 0 < counts["no_pack"] < len(plan.messages) and 0 < counts["in_place"] < len(plan.messages), counts
    for (srv, r), params in got.items():
        ref = _sglang_reference(adapter, engines[srv], r, hf)
        assert set(params) == set(ref), (srv, r, set(params) ^ set(ref))
        for name, t in params.items():
            assert t.shape == ref[name].shape, (name, t.shape, ref[name].shape)
            assert torch.equal(t, ref[name]), (case, srv, r, name)
    # what each engine rank received is its shard, once
    assert plan.bytes_per_engine_rank() == plan.shard_bytes
    assert sum(plan.shard_bytes.values()) == plan.nbytes


def test_same_tp_moves_almost_every_byte_without_a_copy(monkeypatch):
    """Learner TP2 -> engine TP2 (the bench's case), gloo: every destination of >= DIRECT_BYTES is
    received in place -- fused qkv too, whose per-group source rows the sender packs in the
    destination's order -- and whole shards and fused gate/up leave the learner unpacked.
    Control: with the pieces in reverse memory order the same bytes must all be written."""
    import areal_mega.weight_sync.reshard as reshard_mod

    cfg = tiny_config("llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2)
    adapter, layout = get_adapter(cfg), ParallelLayout.build(ParallelConfig(tensor_parallel=2), 2)
    hf = _hf_tensors(adapter)
    monkeypatch.setitem(reshard_mod.DIRECT_BYTES, "gloo", 16 << 10)  # tiny model: what 256 KiB is for a real one
    plan = plan_reshard(adapter, layout, [EngineLayout(2)], dtype="float32", backend="gloo")
    counts: dict = {}
    _run_plan(plan, _learner_locals(adapter, layout, hf), adapter, counts)
    big = sum(m.nbytes for m in plan.messages if m.nbytes >= reshard_mod.DIRECT_BYTES["gloo"])
    assert counts["in_place_bytes"] >= big > 0.95 * plan.nbytes, (counts, big, plan.nbytes)
    qkv = [m for m in plan.messages if m.pieces[0].dst_param.endswith("qkv_proj.weight")]
    assert qkv and all(len(m.pieces) > 1 for m in qkv)  # several source rows per message, one target
    assert counts["no_pack_bytes"] >= 0.5 * plan.nbytes, counts  # shards, gate/up: not packed

    right = reshard_mod._cut

    def reversed_cut(pairs, bucket_bytes, direct_bytes):
        return {k: [list(reversed(c)) for c in v] for k, v in right(pairs, bucket_bytes, direct_bytes).items()}

    monkeypatch.setattr(reshard_mod, "_cut", reversed_cut)
    bad = plan_reshard(adapter, layout, [EngineLayout(2)], dtype="float32", backend="gloo")
    counts = {}
    got = _run_plan(bad, _learner_locals(adapter, layout, hf), adapter, counts)
    multi = sum(m.nbytes for m in bad.messages if len(m.pieces) > 1)
    assert multi > 0 and counts.get("in_place_bytes", 0) <= bad.nbytes - multi  # none of those in place
    for name, t in got[(0, 0)].items():  # and still right, through the writes
        assert torch.equal(t, _sglang_reference(adapter, EngineLayout(2), 0, hf)[name]), name


def test_wrong_slice_rule_is_caught(monkeypatch):
    """Control: megatron's qkv shard read as contiguous [q; k; v] (the classic bug) -- the plan
    still covers every byte once, so only the tensor comparison can catch it, and it does."""
    cfg, _, _, _ = CASES["llama vocab 300 TP2xDP2 -> TP4 (KV replicated), TP1"]
    adapter = get_adapter(cfg)
    layout, engines = ParallelLayout(world_size=1), [EngineLayout(2)]  # TP1: two query groups per shard
    hf = _hf_tensors(adapter)
    plan = plan_reshard(adapter, layout, engines, dtype="float32")
    ok = _run_plan(plan, _learner_locals(adapter, layout, hf), adapter)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(ok[(0, 0)][name], _sglang_reference(adapter, engines[0], 0, hf)[name])
    right = ModelAdapter.shard_blocks

    def naive(self, prm, tp, tp_rank):
        blocks = right(self, prm, tp, tp_rank)
        if prm.fusion != "qkv":
            return blocks
        out, off = [], 0
        for kind in (0, 1, 2):  # all q blocks, then all k, then all v
            for b in blocks[kind::3]:
                out.append(type(b)(b.hf_name, b.hf_box, (off,) + b.local_start[1:]))
                off += b.hf_box[0][1] - b.hf_box[0][0]
        return out

    monkeypatch.setattr(ModelAdapter, "shard_blocks", naive)
    plan = plan_reshard(adapter, layout, engines, dtype="float32")
    plan.check()  # byte accounting alone cannot see a permutation
    got = _run_plan(plan, _learner_locals(adapter, layout, hf), adapter)
    assert not torch.equal(got[(0, 0)][name], _sglang_reference(adapter, engines[0], 0, hf)[name])


def test_check_catches_a_dropped_or_duplicated_message():
    cfg, pcfg, world, engines = CASES["qwen2-tied-bias TP2xPP2 -> 2x TP2"]
    plan = plan_reshard(get_adapter(cfg), ParallelLayout.build(pcfg, world), engines, bucket_bytes=40_000)
    plan.check()
    for msgs in (plan.messages[1:], plan.messages + plan.messages[:1]):
        bad = ReshardPlan(plan.learner, plan.engines, plan.dtype, plan.bucket_bytes, msgs, plan.shard_bytes,
                          plan.engine_params)
        with pytest.raises(AssertionError):
            bad.check()


def test_rounds_are_matchings_and_replicas_split_the_work():
    cfg, pcfg, world, engines = CASES["llama vocab 300 TP2xDP2 -> TP4 (KV replicated), TP1"]
    plan = plan_reshard(get_adapter(cfg), ParallelLayout.build(pcfg, world), engines, bucket_bytes=20_000)
    seen = set()
    for m in plan.messages:
        for who in (("src", m.round, m.src), ("dst", m.round, m.server, m.engine_rank)):
            assert who not in seen, who  # a rank sends / receives at most one message per round
            seen.add(who)
    assert [m.round for m in plan.messages] == sorted(m.round for m in plan.messages)
    per = plan.bytes_per_learner_rank()
    assert min(per.values()) > 0.8 * max(per.values()), per  # both DP replicas send, evenly


# ---------------------------------------------------------------- published shapes (metadata only)
def _big(hf: dict, pcfg: ParallelConfig, world: int, engines: list[EngineLayout]) -> ReshardPlan:
    adapter, layout = get_adapter(hf), ParallelLayout.build(pcfg, world)
    plan = plan_reshard(adapter, layout, engines, dtype="bfloat16")
    plan.check()
    assert plan.bytes_per_engine_rank() == plan.shard_bytes
    print(json.dumps({"model": hf.get("model_type"), **plan.summary()}))
    # The throughput planner prices a reshard sync by its busiest link in closed form (no plan:
    # it sweeps many layouts); measured against this plan: 70B -3.5% (the learner ranks' uneven
    # split), 235B -0.3%, V3 -2.0% (SGLang's replicated MLA down projections).
    busiest = max(max(plan.bytes_per_engine_rank().values()), max(plan.bytes_per_learner_rank().values()))
    params = total_params(adapter.arch)  # the planner's own count
    est = sync_bytes(mode="reshard", params=params, engine_tp=engines[0].tp,
                     num_servers=len(engines), world=world)
    assert abs(est / busiest - 1) <= 0.04, (est, busiest)
    return plan


def test_70b_tp8pp4dp2_into_eight_tp8_servers():
    """The issue's 70B case: 8 + 8 nodes. Each engine GPU gets 1/8 of every sharded tensor plus
    the replicated norms, i.e. 17.64 GB (by hand below), not the 141 GB of a full broadcast."""
    plan = _big(LLAMA_70B, ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 64, [EngineLayout(8)] * 8)
    h, f, v, kv, layers = 8192, 28672, 128256, 8 * 128, 80
    norms = layers * 2 * h + h
    sharded = layers * (h * h + 2 * kv * h + h * h + 3 * f * h) + 2 * v * h
    assert sglang_vocab_padded(v, 8) == v  # 128256 = 8 x 16032: no padding rows
    assert set(plan.shard_bytes.values()) == {2 * (sharded // 8 + norms)} == {17_640_734_720}
    per_learner = plan.bytes_per_learner_rank()
    assert max(per_learner.values()) < 1.1 * plan.nbytes / 64  # every learner rank sends ~1/64


# The MoE shapes at reduced depth (every tensor at its published shape; each layer is planned
# alike, so the checks per layer are the same): the fast tier's budget. The full-depth byte
# counts are the projections' (tools/bench_weight_sync.py --mode plan, docs/weight_sync.md).
def test_qwen3_235b_tp4pp2ep16_into_a_tp8ep8_server():
    plan = _big(dict(QWEN3_235B_A22B, num_hidden_layers=2),
                ParallelConfig(tensor_parallel=4, pipeline_parallel=2, expert_parallel=16, expert_tensor_parallel=1),
                128, [EngineLayout(8, ep=8)])
    a = get_adapter(QWEN3_235B_A22B).arch
    # experts whole on their EP rank: 16 of 128 per engine rank; the rest 1/8 or replicated
    expert = 3 * a.hidden_size * a.moe_ffn_hidden_size * 2
    assert min(plan.shard_bytes.values()) > 16 * 2 * expert


def test_deepseek_v3_671b_into_a_tp8ep8_server():
    hf = dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=5)  # 3 dense + 2 MoE layers
    plan = _big(hf, ParallelConfig(tensor_parallel=8, expert_parallel=64, expert_tensor_parallel=1), 64,
                [EngineLayout(8, ep=8)])
    names = {p.name for p in engine_params(get_adapter(hf), EngineLayout(8, ep=8), 0)}
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in names
    assert "model.layers.4.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names and "model.layers.4.mlp.experts.w13_weight" in names


# ---------------------------------------------------------------- capability detection, config
def test_receiver_detected_from_server_info_and_registered_by_the_launcher():
    from areal_mega.inference.config import SGLangServerConfig
    from areal_mega.inference.server import build_launch_command
    from areal_mega.inference.sglang_api import capabilities_from
    from areal_mega.weight_sync.reshard_transport import RECEIVER as LOADER, has_receiver

    routes = {"paths": {"/update_weights_from_tensor": {}, "/begin_weight_update": {}, "/end_weight_update": {}}}
    with_it = capabilities_from({"tp_size": 2, "ep_size": 1, "custom_weight_loader": [LOADER]}, routes)
    assert has_receiver(with_it) and with_it.tp_size == 2
    assert not has_receiver(capabilities_from({"tp_size": 2, "custom_weight_loader": []}, routes))  # -> broadcast
    assert not has_receiver(capabilities_from({"custom_weight_loader": [LOADER]}, {"paths": {}}))
    cmd = build_launch_command(SGLangServerConfig(model_path="m"), 30000, reshard_receiver=True)
    assert cmd[cmd.index("--custom-weight-loader") + 1] == LOADER == RECEIVER_PATH
    assert "--custom-weight-loader" not in build_launch_command(SGLangServerConfig(model_path="m"), 30000)


RECEIVER_PATH = f"areal_mega_sglang_reshard.{RECEIVER.receive.__name__}"  # the module's own loader name


def test_receiver_found_on_disk_never_by_running_the_interpreter(tmp_path):
    """has_reshard_receiver reads the environment's site-packages (or PYTHONPATH): the server's
    `python` is never run -- a wrapper that ignores its arguments once hung every launch for the
    probe's timeout (the control: this stub records any run)."""
    from areal_mega.inference.server import has_reshard_receiver

    ran = tmp_path / "ran"
    for env in ("with", "without"):
        (tmp_path / env / "bin").mkdir(parents=True)
        stub = tmp_path / env / "bin" / "python"
        stub.write_text(f"#!/bin/sh\ntouch {ran}\nsleep 300\n")
        stub.chmod(0o755)
        (tmp_path / env / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (tmp_path / "with" / "lib" / "python3.11" / "site-packages" / "areal_mega_sglang_reshard.py").write_text("")
    assert has_reshard_receiver(str(tmp_path / "with" / "bin" / "python"))
    assert not has_reshard_receiver(str(tmp_path / "without" / "bin" / "python"))
    extra = tmp_path / "container_path"
    extra.mkdir()
    (extra / "areal_mega_sglang_reshard.py").write_text("")
    assert has_reshard_receiver(str(tmp_path / "without" / "bin" / "python"), f"/nope:{extra}")
    assert not ran.exists()


def test_mode_values():
    from areal_mega.weight_sync.config import WeightSyncConfig

    for mode in ("reshard", "broadcast", "disk"):
        WeightSyncConfig(mode=mode, disk_dir="d").validate()
    with pytest.raises(ValueError, match="mode: 'distributed' is not one of reshard, broadcast, disk"):
        WeightSyncConfig(mode="distributed").validate()


def test_receiver_never_raises_into_sglang_and_payload_round_trips():
    """The receiver swallows a bad command (a raise would kill SGLang's scheduler); the learner's
    payload is a plain pickle the receiver decodes back to the same command."""
    import base64
    import pickle

    from areal_mega.weight_sync.reshard_transport import COMMAND, command_payload

    cmd = {"op": "leave", "group": "g"}
    ((name, t),) = pickle.loads(base64.b64decode(command_payload(cmd)))
    assert name == COMMAND == RECEIVER.COMMAND and RECEIVER.decode_payload(t) == cmd
    RECEIVER.receive(torch.nn.Linear(2, 2), [(COMMAND, torch.frombuffer(bytearray(b'{"op": "sync", "group": "none"}'),
                                                                        dtype=torch.uint8))])
    assert RECEIVER.decode_status(RECEIVER.encode_status({"ok": True, "rank": 3})) == {"ok": True, "rank": 3}


def test_family_without_an_sglang_layout_is_refused_in_one_line():
    from areal_mega.weight_sync.sglang_layout import check_supported

    mixtral = get_adapter(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="reshard has no SGLang layout for model_type 'mixtral'.*use broadcast"):
        check_supported(mixtral)
    with pytest.raises(ValueError, match="no SGLang layout"):
        plan_reshard(mixtral, ParallelLayout(world_size=1), [EngineLayout(1)])


def test_deepseek_v3_reshard_runs_and_a_family_can_still_refuse():
    """MLA: the receiver recomputes SGLang's w_kc / w_vc after a sync (post_load_weights), so
    WeightSync accepts mode reshard for DeepSeek-V3; a family whose adapter says what SGLang would
    still have to derive (``sglang_not_synced``) is refused at construction, in one line."""
    from areal_mega.weight_sync.sglang_layout import check_syncable

    ds = get_adapter(dict(DEEPSEEK_V3_671B, num_nextn_predict_layers=0, num_hidden_layers=4))
    assert engine_params(ds, EngineLayout(8, ep=8), 0)  # planned
    check_syncable(ds)
    refusing = type("Refusing", (type(ds),), {"sglang_not_synced": "SGLang derives X on load"})(ds.hf_config)
    with pytest.raises(ValueError, match=r"planned but not run for model_type 'deepseek_v3': SGLang derives X on load; use broadcast$"):
        check_syncable(refusing)


@pytest.mark.parametrize("keep", [True, False])
def test_sender_keeps_its_pack_buffer_only_where_the_rule_says(monkeypatch, keep):
    """ReshardTransport.send, one learner rank (not rank 0: no HTTP), the wire captured: the bytes
    are the plan's messages, the same in two syncs; its pack buffer and cached views survive a sync
    exactly where transport.keeps_buffers says (CPU: kept, page faults; GPU: released for training,
    as the broadcast sender does) -- the GPU branch forced here, and a second sync after the
    release still sends the same bytes."""
    import areal_mega.weight_sync.reshard_transport as rt

    cfg = tiny_config("llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2)
    adapter, layout = get_adapter(cfg), ParallelLayout.build(ParallelConfig(tensor_parallel=2), 2)
    plan = plan_reshard(adapter, layout, [EngineLayout(2)], dtype="bfloat16", bucket_bytes=40_000, backend="gloo")
    local = [{k: v.to(torch.float32) for k, v in chunk.items()}
             for chunk in _learner_locals(adapter, layout, _hf_tensors(adapter))[1]]
    wire: list = []

    class Done:
        def wait(self):
            pass

    monkeypatch.setattr(rt.dist, "isend", lambda t, group_dst, group: wire.append((group_dst, t.clone())) or Done())
    monkeypatch.setattr(rt, "keeps_buffers", lambda device: keep)
    tr = rt.ReshardTransport(plan=plan, rank=1, servers=[], local=lambda: local, backend="gloo", address="127.0.0.1",
                             port=0, group_name="t", timeout_s=1)
    assert any(m.nbytes and len(m.pieces) > 1 for m in tr.mine)  # some messages are packed, not spans
    sent = [tr.send(1, flush_cache=False)]
    first, wire[:] = list(wire), []
    assert (tr._buf is not None and tr._prepared is not None) == keep
    sent.append(tr.send(2, flush_cache=False))
    assert sent[0] == sent[1] == sum(m.nbytes for m in tr.mine) > 0
    assert [d for d, _ in wire] == [d for d, _ in first] and all(torch.equal(a, b) for (_, a), (_, b) in zip(wire, first))
    want = [pack_message(m, local, torch.empty(m.nbytes, dtype=torch.uint8)) for m in tr.mine]
    assert all(torch.equal(w, t) for w, (_, t) in zip(want, wire))
    tr.close()


def test_receiver_and_senders_keep_buffers_by_one_rule():
    """The receiver imports only torch inside SGLang, so the buffer rule is written twice: the
    learner's (transport.keeps_buffers) and the receiver's must agree on every device type."""
    from areal_mega.weight_sync.transport import keeps_buffers

    for dev in ("cpu", "cuda", "cuda:3", "xpu"):
        assert RECEIVER.keeps_buffers(torch.device(dev)) == keeps_buffers(torch.device(dev)) == (dev == "cpu")


def test_receiver_runs_sglang_post_load_for_the_mla_weights_it_wrote():
    """After a sync the receiver calls the model's own post_load_weights (SGLang's DeepseekV2
    derives the absorbed w_kc / w_vc there) with exactly the kv_b_proj parameters it wrote; a
    model without MLA (no kv_b_proj written, or no such method) is left alone. The real SGLang
    path: tests/test_weight_sync_reshard_mla.py (served) and its in-process equality check."""
    from areal_mega.weight_sync.reshard_transport import POST_LOAD_PROTOCOL

    calls = []

    class Mla(torch.nn.Module):
        def post_load_weights(self, is_nextn=False, weight_names=None):
            calls.append(list(weight_names))

    written = ["model.layers.1.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.layers.0.self_attn.kv_b_proj.weight"]
    RECEIVER.post_load(Mla(), written)
    assert calls == [["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"]]
    RECEIVER.post_load(Mla(), ["model.layers.0.self_attn.o_proj.weight"])
    RECEIVER.post_load(torch.nn.Linear(1, 1), written)  # no post_load_weights: nothing to run
    assert len(calls) == 1
    assert RECEIVER.PROTOCOL >= POST_LOAD_PROTOCOL  # the learner refuses MLA plans for older receivers


@pytest.mark.parametrize("protocol, mla, refused", [(2, True, True), (3, True, False), (2, False, False)])
def test_learner_refuses_an_old_receiver_for_mla_plans(monkeypatch, protocol, mla, refused):
    """An installed receiver older than protocol 3 writes kv_b_proj but not SGLang's w_kc / w_vc:
    the learner's check refuses it for a plan that writes kv_b_proj (one line naming the fix), and
    accepts it for a plan that does not (Qwen2)."""
    from areal_mega.weight_sync import reshard_transport as rt
    from areal_mega.weight_sync.transport import WeightSyncError
    from tests.test_model_families import TINY_MOE

    family = "deepseek_v3" if mla else "qwen2"
    adapter = get_adapter(tiny_config(family, **TINY_MOE.get(family, {})))
    plan = plan_reshard(adapter, ParallelLayout(world_size=1), [EngineLayout(1)], bucket_bytes=1 << 20)
    tr = rt.ReshardTransport(plan=plan, rank=0, servers=[], local=lambda: [], backend="gloo", address="127.0.0.1",
                             port=0, group_name="t", timeout_s=1)
    monkeypatch.setattr(tr, "_statuses", lambda: ([], []))
    monkeypatch.setattr(tr, "_post", lambda cmd, **kw: [])
    monkeypatch.setattr(tr, "_finish", lambda *a: [{"rank": 1, "ok": True, "protocol": protocol}])
    if refused:
        with pytest.raises(WeightSyncError, match=r"^reshard check: engine group rank 1's receiver speaks protocol 2 "
                                                  r"\(< 3: it does not recompute MLA's w_kc / w_vc"):
            tr.check()
    else:
        tr.check()

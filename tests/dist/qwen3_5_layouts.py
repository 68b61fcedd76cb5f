"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/qwen3_5_layouts.py --work-dir W --out R.pt

Qwen3.5 through the model registry (build_model / load_hf_weights / export_hf_weights), 2 gloo
ranks: for each tiny HF model in W (written by tests/test_qwen3_5.py: the text model ``text`` and
the vision-language checkpoint ``vl``, the MoE text model ``moe``, Qwen3-Next ``moe_next``; HF
reference logits in W/ref.pt)
and each layout of ``layouts_of`` (tp, pp, ep, sequence parallel; dp fills the rest), records
on rank 0 into R.pt:

* logits[model][layout]: packed-batch logits (last stage, TP-gathered);
* export[model][layout]: per exporting rank (pp, is the stage's sender, #bit-identical to the HF file,
  #differing, names) from ModelAdapter.export_hf -- the weight-sync code path; at TP2 the
  sender's stream is also saved as W/<model>_sync_tp2.pt (tests/support/sglang_load.py);
* negative[control]: logits with one block dropped or mis-mapped at load (NEGATIVE);
* grad: per TP2 rank, GRAD_PARAM's gradient of the packed log-prob sum, with and without compat
  entry 14;
* sp_grad[model]: per TP2+SP rank, SP_GRAD_PARAMS[model]'s gradients of that sum after
  finalize_model_grads' TP sum of the sequence-parallel params, and before it (control: each
  rank's part);
* engine[model][key]: through MegatronTrainEngine (tests/dist/engine_sp.py's config, batch and
  PPO-like loss: 7 packed sequences, odd micro-batches that SP pads) at TP1 x DP2 and TP2 + SP:
  log-probs, one train_batch's stats, log-probs after it (ENGINE_MODELS);
* W/<model>_ckpt, W/<model>_hf: HF -> megatron (PP2; MoE: EP2) -> HF (TP2; MoE: PP2) by the conversion
  tools' main().

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations


import torch

LAYOUTS = [(1, 1, 1, False), (2, 1, 1, False), (1, 2, 1, False)]
"""(tp, pp, ep, sequence_parallel) of every model; TP2 without SP: the DeltaNet's entry-14 path."""
SP_LAYOUT = (2, 1, 1, True)
"""TP2 with sequence parallelism: the text model's and the MoE models' (megatron's MoE layer needs
SP at TP > 1 in training)."""
MOE_LAYOUTS = [(1, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), SP_LAYOUT]
"""(tp, pp, ep, sequence_parallel) of the MoE models (names starting with "moe")."""


def layouts_of(name: str) -> list[tuple[int, int, int, bool]]:
    return MOE_LAYOUTS if name.startswith("moe") else LAYOUTS + [SP_LAYOUT] * (name == "text")
# control -> (model, layout, HF tensor-name suffix, what the load does to it)
NEGATIVE = {
    # PP2: stage 1 holds layers 2-3; layer 3 is the gated full-attention block
    "pp2_full_attention_block_dropped": ("text", (1, 2), "layers.3.self_attn.o_proj.weight", "zero"),
    # TP2: the DeltaNet's z rows reversed (a fused in_proj part mis-mapped)
    "tp2_in_proj_z_mismapped": ("text", (2, 1), "layers.0.linear_attn.in_proj_z.weight", "flip"),
    # TP2 + SP: the packed-sequence boundaries ignored in every DeltaNet layer (state leaks across
    # sequences: what reading them off a shard instead of the full row would do)
    "tp2sp_state_not_reset": ("text", SP_LAYOUT, "", "noreset"),
    "moe_tp2sp_router_dropped": ("moe", SP_LAYOUT, "layers.1.mlp.gate.weight", "zero"),
    "next_tp2sp_in_proj_qkvz_mismapped": ("moe_next", SP_LAYOUT, "layers.2.linear_attn.in_proj_qkvz.weight", "flip"),
    "vl_pp2_deltanet_block_dropped": ("vl", (1, 2), "layers.2.linear_attn.out_proj.weight", "zero"),
    # EP2: one layer's router read as zeros (uniform routing, ties broken by index)
    "moe_ep2_router_dropped": ("moe", (1, 1, 2), "layers.1.mlp.gate.weight", "zero"),
    "moe_pp2_shared_expert_gate_dropped": ("moe", (1, 2), "layers.3.mlp.shared_expert_gate.weight", "zero"),
    # Qwen3-Next: its per-key-group fused in_proj_ba rows reversed (the "grouped" fusion mis-mapped)
    "next_ep2_in_proj_ba_mismapped": ("moe_next", (1, 1, 2), "layers.0.linear_attn.in_proj_ba.weight", "flip"),
}


ROUNDTRIP = ("text", "vl", "moe", "moe_next")
"""Converted HF -> megatron (PP2; the MoE model EP2) -> HF (TP2; the MoE model PP2) by the tools."""


def key_of(tp, pp, ep=1, sp=False) -> str:
    return f"tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "") + ("sp" if sp else "")


GRAD_PARAM = "decoder.layers.0.self_attention.out_norm.weight"
"""The gradient compared with HF's at TP2 (compat entry 14): DeltaNet out_norm, shared by the heads."""
SP_GRAD_PARAMS = {  # model -> {megatron name: HF name}: params whose grads finalize_model_grads sums over TP under SP
    "text": {
        GRAD_PARAM: "model.layers.0.linear_attn.norm.weight",  # full row, this rank's heads
        "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",  # this rank's tokens
        "decoder.final_layernorm.weight": "model.norm.weight",
    },
    "moe": {  # megatron's own SP-marked MoE params (this rank's tokens)
        "decoder.layers.1.mlp.router.weight": "model.layers.1.mlp.gate.weight",
        "decoder.layers.1.mlp.shared_experts.gate_weight": "model.layers.1.mlp.shared_expert_gate.weight",
        GRAD_PARAM: "model.layers.0.linear_attn.norm.weight",
    },
}


def packed_logprob_sum(model, ids, cu):
    """Sum of every sequence's next-token log-probs, packed in one row, with autograd (TP-gathered)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from areal_mega.megatron.model import packed_causal_mask

    T = int(ids.numel())
    logits = model.chunks[0](ids.view(1, T), torch.arange(T).view(1, T), packed_causal_mask(cu, T))
    lp = torch.log_softmax(gather_from_tensor_model_parallel_region(logits)[0, :, : model.arch.vocab_size], -1)
    total = 0.0
    for i in range(len(cu) - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        total = total + lp[s: e - 1].gather(-1, ids[s + 1: e, None]).sum()
    return total


def out_norm_grads(model, ids, cu) -> tuple[torch.Tensor, torch.Tensor]:
    """(GRAD_PARAM's gradient as the learner computes it, the same without compat entry 14)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from areal_mega.megatron.linear_attention import PackedGatedDeltaNet
    from areal_mega.models.base import named_tensors

    p = named_tensors(model.chunks[0])[GRAD_PARAM]
    fix = PackedGatedDeltaNet.__dict__["_apply_gated_norm"]
    out = []
    for fixed in (True, False):
        PackedGatedDeltaNet._apply_gated_norm = fix if fixed else GatedDeltaNet._apply_gated_norm
        try:
            p.grad = None
            packed_logprob_sum(model, ids, cu).backward()
            out.append(p.grad.detach().clone())
        finally:
            PackedGatedDeltaNet._apply_gated_norm = fix
    return out[0], out[1]


def sp_grads(model, ids, cu, names) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per ``names`` entry: (its gradient after megatron's finalize_model_grads TP sum of the
    sequence-parallel / q-k norm params, the same before it)."""
    from types import SimpleNamespace

    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from areal_mega.models.base import named_tensors

    chunk = model.chunks[0]
    ps = [named_tensors(chunk)[n] for n in names]
    for p in chunk.parameters():
        p.grad = None
    packed_logprob_sum(model, ids, cu).backward()
    raw = [p.grad.detach().clone() for p in ps]
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)  # what finalize reads off a DDP wrapper
    _allreduce_non_tensor_model_parallel_grads([chunk], chunk.config, model.groups.pg_collection.tp)
    return [(p.grad.detach().clone(), r) for p, r in zip(ps, raw)]


ENGINE_MODELS = ("text", "moe")
"""The models stepped through the engine at TP1 x DP2 and TP2 + SP (the dense and the MoE hybrid)."""


def engine_steps(work) -> dict:
    """ENGINE_MODELS through MegatronTrainEngine at TP1 (dp 2) and TP2 + SP ("auto"): forward,
    one train_batch, forward again (the optimizer: Adam, distributed, clipped)."""
    from areal_mega.megatron.engine import MegatronTrainEngine
    from areal_mega.megatron.parallel_state import destroy_model_parallel
    from areal_mega.models import load_hf_config
    from tests.dist.engine_sp import TEMPERATURE, engine_cfg, groups_for, make_batch, make_loss_fn

    batch, out = make_batch(), {}
    for name in ENGINE_MODELS:
        out[name] = {}
        for key, tp, sp in (("tp1", 1, False), ("tp2sp", 2, "auto")):
            d = str(work / name)
            eng = MegatronTrainEngine.create(engine_cfg(sp), load_hf_config(d), groups_for(tp, 1), d)
            before = eng.forward(batch, temperature=TEMPERATURE)["logprobs"]
            stats = eng.train_batch(batch, make_loss_fn(batch), temperature=TEMPERATURE)
            after = eng.forward_logprobs(batch, temperature=TEMPERATURE)
            out[name][key] = dict(sp=bool(eng.model.config.sequence_parallel), before=before, after=after, stats=stats)
            destroy_model_parallel()
    return out


def altered(adapter_cls, suffix: str, how: str):
    """A subclass of ``adapter_cls`` whose load alters the HF tensors ending in ``suffix``."""

    class Altered(adapter_cls):
        def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
            def read(name, *a):
                t = read_slice(name, *a)
                if not name.endswith(suffix):
                    return t
                return torch.zeros_like(t) if how == "zero" else t.flip(0)

            return super().load_hf(chunks, stage_plan, tp, tp_rank, read, shape_of, **kw)

    return Altered


def main() -> None:
    from areal_mega.megatron import linear_attention
    from areal_mega.megatron.linear_attention import segment_starts
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from tests.support.dist import convert_round_trip, export_check, finish, gather, last_stage_value, start_layouts_run

    work, out, ws, ref = start_layouts_run()
    res: dict = {"logits": {}, "export": {}, "negative": {}, "grad": None, "sp_grad": {}}
    for name, r in ref.items():
        hf_dir = work / name
        ids, cu = r["input_ids"], r["cu_seqlens"]
        hf_file = HFCheckpointReader(hf_dir)
        res["logits"][name], res["export"][name] = {}, {}
        for tp, pp, ep, sp in layouts_of(name):
            lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep), ws)
            key = key_of(tp, pp, ep, sp)
            groups = init_model_parallel(lay, backend="gloo")
            mcfg = MegatronModelConfig(sequence_parallel=sp)
            model = build_model(hf_dir, groups, mcfg)
            assert model.chunks[0].config.sequence_parallel == sp
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            if name == "text" and (tp, pp, ep, sp) == (2, 1, 1, False):  # compat entry 14, every TP rank's view
                res["grad"] = gather(out_norm_grads(model, ids, cu))
            if name in SP_GRAD_PARAMS and sp:  # finalize_model_grads' TP sum of the SP params, every rank
                res["sp_grad"][name] = gather(sp_grads(model, ids, cu, SP_GRAD_PARAMS[name]))
            row, stream = export_check(model, groups, hf_file)
            if (tp, pp, sp) == (2, 1, False) and groups.rank == 0:  # what a broadcast sync sends, gathered over TP2
                torch.save(stream, work / f"{name}_sync_tp2.pt")
            res["export"][name][key] = gather(row)
            for control, (m, lay_key, suffix, how) in NEGATIVE.items():
                if m == name and lay_key in ((tp, pp), (tp, pp, ep), (tp, pp, ep, sp)):
                    if how == "noreset":  # every DeltaNet layer sees one sequence per row
                        neg = model
                        linear_attention.segment_starts = lambda mask, seq_len: [0]
                    else:
                        cls = type(get_adapter(load_hf_config(hf_dir)))
                        neg = build_model(hf_dir, groups, mcfg, adapter=altered(cls, suffix, how)(load_hf_config(hf_dir)))
                        load_hf_weights(neg, hf_dir)
                    try:
                        res["negative"][control] = (name, last_stage_value(forward_logits(neg, ids, cu)))
                    finally:
                        linear_attention.segment_starts = segment_starts
            destroy_model_parallel(groups)
    res["engine"] = engine_steps(work)
    # HF -> megatron (PP2) -> HF (TP2) through the conversion tools' own main().
    for name in ROUNDTRIP:  # the MoE model: HF -> EP2 -> PP2 (its experts change hands)
        first, second = (["--ep", "2"], ["--pp", "2"]) if name.startswith("moe") else (["--pp", "2"], ["--tp", "2"])
        convert_round_trip(work / name, work / name, first, second)
    finish(res, out)


if __name__ == "__main__":
    main()

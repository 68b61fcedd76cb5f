"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 tests/dist/moe_layouts.py --work-dir W --out R.pt

One 4-rank gloo launch for Qwen3 (dense, QK-norm, head_dim != hidden / heads) and Qwen3-MoE
(top-2 of 8 experts): for each tiny HF model in W (written by tests/test_megatron_moe.py with
HF reference logits in W/ref.pt) and each layout of LAYOUTS[model] (tp, pp, ep, etp; dp fills
the rest), re-initialising megatron's parallel state each time, records on rank 0 into R.pt:

* logits[model][layout]: packed-batch logits (last stage, TP-gathered);
* export[model][layout]: per exporting rank (pp, tp, dp, ep, #bit-identical to the HF file,
  #differing, #None, names) from ModelAdapter.export_hf -- the weight-sync code path;
* groups[layout]: per rank (coords, megatron's ep / etp / edp group ranks) for the MoE layouts;
* negative[model]: logits with a deliberately broken mapping (q/k norms swapped, experts
  rotated by one);
* W/tool_ckpt, W/tool_hf: qwen3_moe converted HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) by
  the conversion tools' main() functions, run inside this world;
* step[layout]: (loss, grad norm, loss after one Adam step) of the MoE model's engine-free
  train step (tests/dist/moe_layouts.py:train_step) at each MoE layout;
* engine[layout]: the product's MegatronTrainEngine train_batch on the MoE model (engine_step);
* replay: routing replay (areal_mega/megatron/routing.py) at EP2, see routing_replay_checks;
* engine_replay[layout]: the engine replaying a batch's routed_experts (engine_replay_checks).

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from areal_mega.megatron.model import (
    HFCheckpointReader,
    MegatronModelConfig,
    build_model,
    export_hf_weights,
    forward_logits,
    load_hf_weights,
)
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from tests.support.dist import convert_round_trip, finish, gather, last_stage_value, start_layouts_run
from areal_mega.models import load_hf_config
from areal_mega.models.qwen3 import Qwen3Adapter, Qwen3MoeAdapter
from areal_mega.parallel import ParallelConfig, ParallelLayout

DENSE = [(1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None)]
MOE = [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (2, 1, 2, 1), (2, 1, 2, 2), (1, 2, 1, None),
       (1, 2, 2, None), (1, 1, 4, None)]
LAYOUTS = {"qwen3_tied": DENSE, "qwen3_moe": MOE, "qwen3_moe_nonorm": [(1, 1, 1, None), (1, 1, 2, None)]}


def key_of(tp, pp, ep, etp) -> str:
    return f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp is not None else "")


class SwapQKNorm(Qwen3Adapter):
    """Negative control: q_norm loaded into k_layernorm and vice versa."""

    def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
        def swapped(name, *a):
            if name.endswith("q_norm.weight"):
                name = name.replace("q_norm", "k_norm")
            elif name.endswith("k_norm.weight"):
                name = name.replace("k_norm", "q_norm")
            return read_slice(name, *a)

        return super().load_hf(chunks, stage_plan, tp, tp_rank, swapped, shape_of, **kw)


class RotateExperts(Qwen3MoeAdapter):
    """Negative control: megatron expert g loaded from HF expert g + 1 (mod E)."""

    def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
        e = self.arch.num_experts

        def rotated(name, *a):
            if ".mlp.experts." in name:
                head, rest = name.split(".mlp.experts.")
                i, tail = rest.split(".", 1)
                name = f"{head}.mlp.experts.{(int(i) + 1) % e}.{tail}"
            return read_slice(name, *a)

        return super().load_hf(chunks, stage_plan, tp, tp_rank, rotated, shape_of, **kw)


def train_step(model, ids, cu, targets):
    """One forward/backward (sum of token NLL over the packed row, the same on every layout)
    and one Adam step through megatron's DDP + optimizer; returns (loss, grad_norm, loss after)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from areal_mega.megatron.model import packed_causal_mask
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    g = model.groups
    cfg = model.config
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), c,
                                   pg_collection=g.pg_collection) for c in model.chunks]
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1e9, bf16=False), ddp)
    T = ids.numel()
    m = g.layout.tp if cfg.sequence_parallel else 1
    Tp = -(-T // m) * m
    tokens = torch.cat([ids, ids.new_zeros(Tp - T)]).view(1, Tp)
    tgt = torch.cat([targets, targets.new_full((Tp - T,), -100)]).view(1, Tp)
    mask = packed_causal_mask(cu, Tp)
    pos = torch.arange(Tp).view(1, Tp)

    def run(forward_only):
        losses = []

        def step(_it, chunk):
            out = chunk(tokens, pos, mask)

            def loss_fn(logits):
                # autograd-aware TP gather of the vocab shards (dist.all_gather would cut the graph)
                full = gather_from_tensor_model_parallel_region(logits.float(), group=g.tp)[..., : model.arch.vocab_size]
                nll = torch.nn.functional.cross_entropy(full.view(-1, full.shape[-1]), tgt.view(-1),
                                                        ignore_index=-100, reduction="sum")
                losses.append(nll.detach().clone())
                return nll, {}  # DDP averages over dp replicas (each holds the same row)

            return out, loss_fn

        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=ddp[0],
                                    num_microbatches=1, seq_length=Tp, micro_batch_size=1, forward_only=forward_only)
        return losses[0] if losses else None

    for c in ddp:
        c.zero_grad_buffer()
    opt.zero_grad()
    loss = run(False)
    _, gnorm, _ = opt.step()
    after = run(True)
    return (None if loss is None else float(loss)), float(gnorm), (None if after is None else float(after))


ENGINE_KEYS = ("tp1pp1ep1", "tp1pp1ep2", "tp2pp1ep2etp1", "tp1pp2ep2")


def engine_step(hf_dir, groups) -> tuple[float, float, float]:
    """The product's MegatronTrainEngine on the MoE model: (loss of one train_batch of
    tests/dist/engine_checks.py's PPO-like objective, sum of log-probs before, after)."""
    from areal_mega.megatron.engine import MegatronTrainEngine
    from tests.dist.engine_checks import engine_cfg, make_batch, make_loss_fn

    eng = MegatronTrainEngine.create(engine_cfg(64), hf_dir, groups, hf_dir)
    batch = make_batch()
    lp0 = eng.forward_logprobs(batch)
    loss_fn, _ = make_loss_fn(batch)
    stats = eng.train_batch(batch, loss_fn)
    lp1 = eng.forward_logprobs(batch)
    return float(stats["loss"]), float(lp0.sum()), float(lp1.sum())


REPLAY_KEYS = ("tp1pp1ep1", "tp1pp1ep2", "tp1pp2ep2", "tp2pp1ep1")  # TP1 x DP4, EP2, EP2 x PP2, TP2 (SP)


def engine_replay_checks(hf_dir, groups, r: dict) -> dict:
    """The product's engine with ``moe_routing_replay: rollout`` on a packed batch (4 sequences of
    unequal length, several micro-batches): forward with the batch's ``routed_experts`` (forced
    routes, -1 on each sequence's last token), forward without them (plain routing; the
    natural routes it returns), and one train_batch whose loss reports the replayed log-probs'
    sum (the training forward must replay too)."""
    import dataclasses

    from areal_mega.megatron.engine import MegatronTrainEngine
    from tests.dist.engine_checks import engine_cfg

    cfg = engine_cfg(16)  # 34 tokens -> several micro-batches per DP rank
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_routing_replay="rollout"))
    eng = MegatronTrainEngine.create(cfg, hf_dir, groups, hf_dir)
    ids, cu = r["input_ids"], r["cu_seqlens"]
    mask = torch.ones_like(ids)
    mask[cu[1:] - 1] = 0
    batch = {"input_ids": ids, "cu_seqlens": cu, "loss_mask": mask, "routed_experts": r["forced_routes"]}
    replayed = eng.forward(batch, with_entropy=False)
    plain = eng.forward({k: v for k, v in batch.items() if k != "routed_experts"}, with_entropy=False)

    def loss_fn(lp, ent, mb):
        return (lp * 0).sum(), {"lp_sum": (lp * mb["loss_mask"]).sum(), "n": mb["loss_mask"].sum()}

    stats = eng.train_batch(batch, loss_fn)
    return {"replayed": replayed["logprobs"].tolist(), "plain": plain["logprobs"].tolist(),
            "natural": plain["routes"].tolist(), "natural_under_replay": replayed["routes"].tolist(),
            "train_lp_mean": float(stats["lp_sum"]), "train_n": float(stats["n"])}


def routing_replay_checks(hf_dir, groups, ids, cu) -> dict:
    """Record the routes of the HF weights (model A); B = A with every router perturbed (a
    stand-in for a server whose routing differs). Recorded: A replaying its own routes (must
    reproduce its logits bit for bit), B's plain and A-route-replayed logits, and how many
    (token, layer) routes B and A disagree on."""
    from areal_mega.megatron.routing import record_routes, replay_routes, route_disagreement

    cfg = MegatronModelConfig(layer_spec="local", moe_routing_replay="rollout")
    a = build_model(hf_dir, groups, cfg)
    load_hf_weights(a, hf_dir)
    with record_routes(a) as ra:
        lg_a = forward_logits(a, ids, cu)
    with replay_routes(a, ra.layers):
        lg_a_replayed = forward_logits(a, ids, cu)
    b = build_model(hf_dir, groups, cfg)
    load_hf_weights(b, hf_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in b.chunks[0].named_parameters():
            if n.endswith("mlp.router.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.abs().mean())
    with record_routes(b) as rb:
        lg_b = forward_logits(b, ids, cu)
    with replay_routes(b, ra.layers):
        lg_b_replayed = forward_logits(b, ids, cu)
    out = {
        "layers": len(ra.layers),
        "tokens": [int(x.shape[0]) for x in ra.layers],
        "disagree_b_vs_a": route_disagreement(ra.layers, rb.layers),
    }
    vals = gather((lg_a, lg_a_replayed, lg_b, lg_b_replayed, out))
    lg_a, lg_a_replayed, lg_b, lg_b_replayed, out = [v for v in vals if v[0] is not None][0]
    out["a_replay_equal"] = bool(torch.equal(lg_a, lg_a_replayed))
    out["b_replay_vs_plain"] = float((lg_b_replayed - lg_b).abs().max())
    out["b_replay_vs_a"] = float((lg_b_replayed - lg_a).abs().max())
    out["b_plain_vs_a"] = float((lg_b - lg_a).abs().max())
    return out


def main() -> None:
    work, out, ws, ref = start_layouts_run()
    res: dict = {"logits": {}, "export": {}, "negative": {}, "groups": {}, "step": {}}
    for name, r in ref.items():
        hf_dir = work / name
        cfg = load_hf_config(hf_dir)
        ids, cu = r["input_ids"], r["cu_seqlens"]
        hf_file = HFCheckpointReader(hf_dir)
        res["logits"][name], res["export"][name] = {}, {}
        for tp, pp, ep, etp in LAYOUTS[name]:
            lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                                      expert_tensor_parallel=etp), ws)
            key = key_of(tp, pp, ep, etp)
            groups = init_model_parallel(lay, backend="gloo")  # asserts megatron's groups == ParallelLayout's
            model = build_model(hf_dir, groups, MegatronModelConfig(layer_spec="local"))
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            c = groups.coords
            row = None
            if lay.exports(groups.rank):
                same, diff, none, names = 0, 0, 0, []
                for n, t in export_hf_weights(model):
                    names.append(n)
                    if t is None:
                        none += 1
                    elif torch.equal(t, hf_file.read(n)):
                        same += 1
                    else:
                        diff += 1
                row = (c.pp, c.tp, c.dp, c.ep, same, diff, none, names)
            res["export"][name][key] = gather(row)
            if name == "qwen3_moe":
                res["groups"][key] = gather((groups.rank, tuple(c.__dict__.values()), dist.get_process_group_ranks(groups.ep),
                                             dist.get_process_group_ranks(groups.etp),
                                             dist.get_process_group_ranks(groups.edp)))
                step = train_step(model, ids, cu, r["targets"])
                res["step"][key] = last_stage_value(step if groups.is_last_stage else None)
                if key in ENGINE_KEYS:
                    res.setdefault("engine", {})[key] = engine_step(hf_dir, groups)
                if key in REPLAY_KEYS:
                    res.setdefault("engine_replay", {})[key] = engine_replay_checks(hf_dir, groups, r)
            if name == "qwen3_tied" and key == "tp2pp1ep1":
                neg = build_model(hf_dir, groups, adapter=SwapQKNorm(cfg))
                load_hf_weights(neg, hf_dir)
                res["negative"][name] = ("SwapQKNorm", last_stage_value(forward_logits(neg, ids, cu)))
            if name == "qwen3_moe" and key == "tp1pp1ep2":
                neg = build_model(hf_dir, groups, adapter=RotateExperts(cfg))
                load_hf_weights(neg, hf_dir)
                res["negative"][name] = ("RotateExperts", last_stage_value(forward_logits(neg, ids, cu)))
                res["replay"] = routing_replay_checks(hf_dir, groups, ids, cu)
            destroy_model_parallel(groups)
    # HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) through the conversion tools' own main().
    convert_round_trip(work / "qwen3_moe", work / "tool", ["--ep", "2", "--pp", "2"], ["--ep", "2", "--tp", "2"])
    finish(res, out)


if __name__ == "__main__":
    main()

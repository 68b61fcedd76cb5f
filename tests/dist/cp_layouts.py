"""Context parallelism on real megatron-core ranks (4 gloo ranks): CP2 layouts equal to CP1.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/dist/cp_layouts.py --work-dir D --out R.json        # make test-cp (tests/test_context_parallel.py)

The tiny Qwen2 and packed batch of tests/dist/engine_sp.py (7 sequences of 3..70 tokens, budget 64;
the 3-token one is shorter than 2 x CP = 4 chunks). Each pair is (CP1 reference, CP2 layout) with
the same model shards on the same ranks, so gradients compare rank by rank:

    tp1 (dp 4) vs cp2 (dp 2)            tp2 SP (dp 2) vs cp2 x tp2 SP (dp 1)
    pp2 (dp 2) vs cp2 x pp2 (dp 1)      tiny Qwen3-MoE: ep2 (dp 4) vs cp2 x ep2 (dp 2), also replaying routes

plus the critic (tp1 vs cp2), selective recompute (tp2 vs cp2 x tp2) and a checkpoint saved at
CP2 loaded at TP1. Per run: forward (log-probs +
entropy) -> one train_batch (non-distributed optimizer: every rank keeps its shard's full reduced
gradients) -> forward again; the gradient max-diff against the reference is reduced over all
ranks. Negative control: CP2 with RoPE left unadjusted to the balanced split (every rank's chunks
get the positions of one contiguous chunk). tests/dist/engine_sp.py's launch (make test) runs the
cheap subset, :data:`FAST_PAIRS`.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronTrainEngine
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout

PAIRS = (("tp1", dict(), "cp2", dict(context_parallel=2)),
         ("tp2", dict(tensor_parallel=2), "cp2tp2", dict(tensor_parallel=2, context_parallel=2)),
         ("pp2", dict(pipeline_parallel=2), "cp2pp2", dict(pipeline_parallel=2, context_parallel=2)))
FAST_PAIRS = (PAIRS[0], (None, None, "cp2tp2", PAIRS[1][3]))
"""make test's subset (engine_sp.py's launch): cp2 vs tp1 with gradients; cp2 x tp2 alone, compared
with that launch's own tp2 SP run (log-probs, loss, grad norm, the step's effect)."""


def layout_groups(**kw):
    return init_model_parallel(ParallelLayout.build(ParallelConfig(**kw), dist.get_world_size()), backend="gloo",
                               seed=1234)


@contextlib.contextmanager
def unadjusted_rope():
    """Negative control: megatron's THD RoPE as if cp were 1 -- each rank's local tokens get the
    positions 0.. of a contiguous chunk, not those of chunks r and 2cp-1-r."""
    from megatron.core.models.common.embeddings import rope_utils

    orig = rope_utils._get_thd_freqs_on_this_cp_rank
    rope_utils._get_thd_freqs_on_this_cp_rank = lambda cp_rank, cp_size, x, freqs, offset=0: orig(0, 1, x, freqs, offset)
    try:
        yield
    finally:
        rope_utils._get_thd_freqs_on_this_cp_rank = orig


def one_run(hf_dir, cfg, batch, loss_fn, temperature, flat_grads, *, train=True, cls=MegatronTrainEngine, **kw):
    """forward -> train_batch -> forward on a fresh engine under layout ``kw``; gradients local."""
    groups = layout_groups(**kw)
    eng = cls.create(cfg, load_hf_config(hf_dir), groups, hf_dir)
    before = eng.forward(batch, temperature=temperature)
    out = {"logprobs": before["logprobs"].tolist(), "entropy": before["entropy"].tolist(),
           "cp": eng.layout.cp, "dp": eng.layout.dp}
    grads = None
    if train:
        out["stats"] = eng.train_batch(batch, loss_fn, temperature=temperature)
        grads = flat_grads(eng)
        out["after"] = eng.forward_logprobs(batch, temperature=temperature).tolist()
    destroy_model_parallel()
    return out, grads


def grad_diff(grads, ref) -> tuple[float, float]:
    d = torch.tensor([float((grads - ref).abs().max()), float(ref.abs().max())])
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    return float(d[0]), float(d[1])


def cp_runs(hf_dir: str, batch, loss_fn, temperature: float, engine_cfg, flat_grads, pairs=PAIRS) -> dict:
    """The (reference, CP2) pairs above plus the negative control; see the module docstring."""
    out: dict = {}
    for ref_name, ref_kw, name, kw in pairs:
        if ref_name is None:  # compared with a run of the caller's
            out[name], _ = one_run(hf_dir, engine_cfg("auto"), batch, loss_fn, temperature, flat_grads, **kw)
            continue
        cfg = engine_cfg("auto", distributed=False)
        out[ref_name], ref_grads = one_run(hf_dir, cfg, batch, loss_fn, temperature, flat_grads, **ref_kw)
        out[name], grads = one_run(hf_dir, cfg, batch, loss_fn, temperature, flat_grads, **kw)
        out[name]["grad_maxdiff"], out[name]["grad_absmax"] = grad_diff(grads, ref_grads)
    with unadjusted_rope():
        out["cp2_rope_unadjusted"], _ = one_run(hf_dir, engine_cfg("auto", distributed=False), batch, loss_fn,
                                                temperature, flat_grads, train=False, context_parallel=2)
    return out


def moe_runs(work: str, batch, loss_fn, temperature, engine_cfg, flat_grads) -> dict:
    """Tiny Qwen3-MoE (2 layers, 8 experts top-2, head_dim 32 != hidden / heads): ep2 vs cp2 x ep2,
    plain and replaying a batch's routes (moe_routing_replay rollout: the routes are split over the
    CP ranks like the tokens; the natural routes come back in token order)."""
    import dataclasses

    from tests.support.models import save_tiny_model

    hf_dir = os.path.join(work, "tiny_qwen3_moe")
    if dist.get_rank() == 0:
        save_tiny_model(hf_dir, family="qwen3_moe", scale=1.5, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, intermediate_size=96, tie_word_embeddings=False, norm_topk_prob=True)
    dist.barrier()
    out = cp_runs(hf_dir, batch, loss_fn, temperature, engine_cfg, flat_grads,
                  pairs=(("ep2", dict(expert_parallel=2), "cp2ep2", dict(expert_parallel=2, context_parallel=2)),))
    g = torch.Generator().manual_seed(5)
    T = batch["input_ids"].numel()
    routes = torch.stack([torch.cat([torch.randperm(8, generator=g)[:2] for _ in range(2)]) for _ in range(T)])
    routes[batch["cu_seqlens"][1:] - 1] = -1  # the last token of a sequence: no server route
    replay_batch = {**batch, "routed_experts": routes.to(torch.int16)}
    for name, kw in (("ep2_replay", dict(expert_parallel=2)), ("cp2ep2_replay", dict(expert_parallel=2, context_parallel=2))):
        base = engine_cfg("auto", distributed=False)
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, moe_routing_replay="rollout"))
        groups = layout_groups(**kw)
        eng = MegatronTrainEngine.create(cfg, load_hf_config(hf_dir), groups, hf_dir)
        replayed = eng.forward(replay_batch, temperature=temperature)
        plain = eng.forward(batch, temperature=temperature)
        stats = eng.train_batch(replay_batch, loss_fn, temperature=temperature)
        out[name] = {"replayed": replayed["logprobs"].tolist(), "plain": plain["logprobs"].tolist(),
                     "natural": plain["routes"].tolist(), "natural_under_replay": replayed["routes"].tolist(),
                     "stats": stats}
        destroy_model_parallel()
    return out


def checkpoint_runs(hf_dir: str, work: str, batch, loss_fn, temperature, engine_cfg) -> dict:
    """A checkpoint saved at CP2 (dp 2) after one step, loaded at TP1 (dp 4): CP ranks are
    replicas (one copy of the weights), so the loaded policy is the saved one."""
    path = os.path.join(work, "ckpt_cp2")
    eng = MegatronTrainEngine.create(engine_cfg("auto"), load_hf_config(hf_dir), layout_groups(context_parallel=2), hf_dir)
    eng.train_batch(batch, loss_fn, temperature=temperature)
    saved = eng.forward_logprobs(batch, temperature=temperature).tolist()
    eng.save(path)
    destroy_model_parallel()
    eng = MegatronTrainEngine.create(engine_cfg("auto"), load_hf_config(hf_dir), layout_groups(), hf_dir)
    fresh = eng.forward_logprobs(batch, temperature=temperature).tolist()
    eng.load(path)
    loaded = eng.forward_logprobs(batch, temperature=temperature).tolist()
    destroy_model_parallel()
    return {"saved_cp2": saved, "loaded_tp1": loaded, "fresh_tp1": fresh}


def main() -> None:
    from tests.dist.engine_sp import LENS, SCALE, TEMPERATURE, engine_cfg, flat_grads, make_batch, make_loss_fn
    from tests.dist.engine_sp import value_loss_fn
    from tests.support.dist import finish
    from tests.support.models import save_tiny_model
    from areal_mega.trainer.critic import CriticConfig, CriticEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    hf_dir = os.path.join(args.work_dir, "tiny_qwen2")
    if dist.get_rank() == 0:
        save_tiny_model(hf_dir, scale=SCALE)
    dist.barrier()
    batch = make_batch()
    loss_fn = make_loss_fn(batch)
    res = {"cp": cp_runs(hf_dir, batch, loss_fn, TEMPERATURE, engine_cfg, flat_grads), "lens": LENS}
    crit = {}
    for name, kw in (("critic_tp1", {}), ("critic_cp2", dict(context_parallel=2))):
        groups = layout_groups(**kw)
        c = CriticEngine.create(engine_cfg("auto", cls=CriticConfig), load_hf_config(hf_dir), groups, hf_dir, seed=3)
        v = c.compute_values(batch)
        st = c.train_batch(batch, value_loss_fn(batch))
        crit[name] = {"values": v.tolist(), "stats": st, "after": c.compute_values(batch).tolist()}
        destroy_model_parallel()
    res["critic"] = crit
    rc = {}
    for name, kw in (("tp2_selective", dict(tensor_parallel=2)),
                     ("cp2tp2_selective", dict(tensor_parallel=2, context_parallel=2))):
        cfg = engine_cfg(True, recompute="selective", distributed=False)
        rc[name], _ = one_run(hf_dir, cfg, batch, loss_fn, TEMPERATURE, flat_grads, **kw)
    res["recompute"] = rc
    res["moe"] = moe_runs(args.work_dir, batch, loss_fn, TEMPERATURE, engine_cfg, flat_grads)
    res["checkpoint"] = checkpoint_runs(hf_dir, args.work_dir, batch, loss_fn, TEMPERATURE, engine_cfg)
    finish(res, args.out)


if __name__ == "__main__":
    main()

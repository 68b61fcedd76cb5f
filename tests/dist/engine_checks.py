"""Every MegatronTrainEngine check that needs real megatron-core ranks, in ONE torchrun launch
(4 gloo ranks; driven and asserted by tests/test_engine.py, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 4 \
        tests/dist/engine_checks.py --work-dir D --out R.json

A tiny random Qwen2 (fp32, vocab 200 -> padded to 256, 4 layers, GQA 4/2 heads, qkv bias) is
written by rank 0, then the SAME packed batch (7 sequences of 3..61 tokens, token budget 64 so
there are several micro-batches and one sequence over the budget) goes through five layouts of
the same 4 ranks, one after another in this process:

    TP1 (dp 4)   TP2 (dp 2)   PP2 (dp 2)   TP2 x PP2 (dp 1)   TP2 x PP2 x VPP2 (dp 1, interleaved)

Per layout: forward (log-probs + entropy, temperature 0.8) -> one train_batch (Adam, warm-up,
distributed optimizer, clip) -> forward again. At TP2 the engine is saved after the step and
takes a second step; a fresh PP2 engine loads that checkpoint and must reproduce the post-step
log-probs and the second step. At PP2 a second engine with a 10^4-token budget (1 micro-batch)
checks micro-batch split invariance. Rank 0 also runs HF transformers on each sequence alone.
Everything numeric goes to --out; the pytest side asserts tolerances.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.model import MegatronModelConfig
from areal_mega.batching.packing import pack_sequences, shift_to_next_token
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from tests.support.models import DEFAULTS, save_tiny_model
from tests.support.dist import finish, hf_reference

VOCAB = DEFAULTS["vocab_size"]  # 200, padded to 256 by the engine
NUM_LAYERS = DEFAULTS["num_hidden_layers"]  # 4
# HF's default init is tiny (std 0.02); widening it a little keeps log-probs from being uniform
# (x3 made the model so sensitive that fp32 noise alone moved post-step log-probs 5e-5).
SCALE = 1.5
TEMPERATURE = 0.8
LR = 5e-5
WARMUP = 2
ENT_COEF = 0.01


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lens = [17, 3, 61, 9, 40, 25, 70]  # 70 > budget 64: a micro-batch of its own
    seqs = []
    for n in lens:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        mask = [0] * prompt + [1] * (n - prompt)
        behav = [0.0] * prompt + (-3.0 - torch.rand(n - prompt, generator=g)).tolist()
        seqs.append({"input_ids": ids, "loss_mask": mask, "logprobs": behav})
    batch = pack_sequences(seqs)
    cu = batch["cu_seqlens"]
    # Engine alignment is next-token: shift the "this-token" trajectory fields once, up front.
    batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], cu)
    batch["logprobs"] = shift_to_next_token(batch["logprobs"], cu)
    batch["advantages"] = torch.randn(batch["input_ids"].numel(), generator=g) * batch["loss_mask"]
    return batch


def make_loss_fn(batch):
    """A PPO-like objective: -A * exp(lp - behav) - c * entropy, token mean over the GLOBAL batch."""
    total = float(batch["loss_mask"].sum())

    def loss_fn(lp, ent, mb):
        m = mb["loss_mask"].float()
        ratio = torch.exp(lp - mb["logprobs"])
        per_tok = -mb["advantages"] * ratio - ENT_COEF * ent
        stats = {
            "n_tokens": m.sum(),
            "ratio": (ratio * m).sum() / m.sum().clamp(min=1),
            "ratio/max": (ratio * m).max(),
            # mean |A * ratio| over loss tokens: the scale of the loss terms (for tolerances)
            "abs_ratio_term": (mb["advantages"].abs() * ratio * m).sum() / m.sum().clamp(min=1),
        }
        return (per_tok * m).sum() / total, stats

    return loss_fn, total


def expected_loss(batch, lp, ent, total) -> float:
    m = batch["loss_mask"].float()
    per_tok = -batch["advantages"] * torch.exp(lp - batch["logprobs"]) - ENT_COEF * ent
    return float((per_tok * m).sum() / total)



def engine_cfg(budget: int) -> MegatronEngineConfig:
    return MegatronEngineConfig(
        model=MegatronModelConfig(dtype="float32"),
        # adam_eps 1e-5, not 1e-8: Adam's first step is ~lr * g / (|g| + eps), so elements
        # with |g| ~ eps turn fp32 reduction-order noise (layouts and micro-batch splits sum in
        # different orders) into O(lr) weight differences. Measured with weights x3 and eps
        # 1e-8: grads agreed to ~4e-6 relative, post-step log-probs only to ~5e-5. This
        # conditions the comparison; it does not change what the engine computes.
        optimizer=OptimizerConfig(
            lr=LR, lr_warmup_steps=WARMUP, clip_grad=0.5, weight_decay=0.01, adam_eps=1e-5,
            use_distributed_optimizer=True,
        ),
        max_tokens_per_microbatch=budget,
    )


def build(tp: int, pp: int, hf_dir: str, budget: int = 64, load_weights: bool = True, vpp: int | None = None):
    pcfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline_parallel=vpp)
    layout = ParallelLayout.build(pcfg, dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=1234)
    return MegatronTrainEngine.create(engine_cfg(budget), load_hf_config(hf_dir), groups, hf_dir if load_weights else None)


def one_step(engine, batch, loss_fn):
    before = engine.forward(batch, temperature=TEMPERATURE)
    stats = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
    after = engine.forward_logprobs(batch, temperature=TEMPERATURE)
    return before, stats, after


def ppo_plugin_step(engine, batch) -> dict:
    """areal_mega.algo.losses.PPOActorLoss (decoupled, entropy bonus) plugged in unchanged.

    prox_logprobs = the engine's own forward before the update (what the RL loop does). The
    engine's sum of micro-batch shares must equal the loss function applied to the WHOLE
    batch at once (computed from the same forward outputs); returned for the pytest side.
    """
    from areal_mega.algo.config import AlgorithmConfig
    from areal_mega.algo.losses import PPOActorLoss, global_counts

    fwd = engine.forward(batch, temperature=TEMPERATURE)
    b = dict(batch, prox_logprobs=fwd["logprobs"])
    algo = AlgorithmConfig(decoupled=True, entropy_coef=0.01)
    tokens, seqs = global_counts(b["loss_mask"], b["cu_seqlens"])
    loss_fn = PPOActorLoss(algo, total_tokens=tokens, total_seqs=seqs)
    whole, whole_stats = loss_fn(fwd["logprobs"], fwd["entropy"], b)
    stats = engine.train_batch(b, loss_fn, temperature=TEMPERATURE)
    m = b["loss_mask"].float()
    return {"stats": stats, "whole_loss": float(whole), "whole_clip_frac": float(whole_stats["clip_frac"]),
            "adv_abs_mean": float((b["advantages"].abs() * m).sum() / m.sum())}


def start_launch() -> argparse.Namespace:
    """Every check script's start: ``--work-dir D --out R.json``, then the gloo world."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    return args


def main() -> None:
    args = start_launch()
    rank = dist.get_rank()
    torch.manual_seed(0)
    hf_dir = os.path.join(args.work_dir, "tiny_qwen2")
    ckpt = os.path.join(args.work_dir, "ckpt_tp2")
    if rank == 0:
        save_tiny_model(hf_dir, scale=SCALE)  # fp32 Qwen2, qkv bias, untied
    dist.barrier()
    batch = make_batch()
    loss_fn, total = make_loss_fn(batch)
    res: dict = {"layouts": {}, "timing_s": {}}

    layouts = (("tp1", 1, 1, None), ("tp2", 2, 1, None), ("pp2", 1, 2, None), ("tp2pp2", 2, 2, None), ("tp2pp2vpp2", 2, 2, 2))
    for name, tp, pp, vpp in layouts:
        t0 = time.perf_counter()
        engine = build(tp, pp, hf_dir, vpp=vpp)
        before, stats, after = one_step(engine, batch, loss_fn)
        r = {
            "logprobs": before["logprobs"].tolist(),
            "entropy": before["entropy"].tolist(),
            "stats": stats,
            "after": after.tolist(),
            "expected_loss": expected_loss(batch, before["logprobs"], before["entropy"], total),
            "dp": engine.layout.dp,
            "num_microbatches": stats["num_microbatches"],
        }
        if name in ("tp1", "tp2pp2", "tp2pp2vpp2"):
            r["ppo"] = ppo_plugin_step(engine, batch)
        if name == "tp2":
            engine.set_version(7)
            engine.save(ckpt)
            r["step2"] = engine.train_batch(batch, loss_fn, temperature=TEMPERATURE)
            r["after2"] = engine.forward_logprobs(batch, temperature=TEMPERATURE).tolist()
        if name == "pp2":
            # Micro-batch split invariance: the same step with one big micro-batch per rank.
            destroy_model_parallel()
            big = build(tp, pp, hf_dir, budget=10_000)
            _, s_big, a_big = one_step(big, batch, loss_fn)
            r["one_mb"] = {"stats": s_big, "after": a_big.tolist()}
            # Resume: fresh engine (random weights, no HF load), load the TP2 checkpoint.
            destroy_model_parallel()
            resumed = build(tp, pp, hf_dir, load_weights=False)
            resumed.load(ckpt)
            r["resumed"] = {
                "version": resumed.get_version(),
                "logprobs": resumed.forward_logprobs(batch, temperature=TEMPERATURE).tolist(),
                "step2": resumed.train_batch(batch, loss_fn, temperature=TEMPERATURE),
                "after2": resumed.forward_logprobs(batch, temperature=TEMPERATURE).tolist(),
            }
        res["layouts"][name] = r
        res["timing_s"][name] = time.perf_counter() - t0
        destroy_model_parallel()

    if rank == 0:
        res["hf_logprobs"], res["hf_entropy"] = hf_reference(hf_dir, batch, TEMPERATURE)
        res["loss_mask"] = batch["loss_mask"].tolist()
        res["cu_seqlens"] = batch["cu_seqlens"].tolist()
    finish(res, args.out)


if __name__ == "__main__":
    main()

"""Sequence parallelism and activation recompute on real megatron-core ranks, in ONE torchrun
launch (4 gloo ranks; driven and asserted by tests/test_engine_sp.py, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/dist/engine_sp.py --work-dir D --out R.json

A tiny random Qwen2 (fp32, qkv bias, 4 layers, GQA 4/2) is written by rank 0; the same packed
batch (7 sequences of 3..70 tokens, budget 64: micro-batches of 70, 64, 57 and 35 tokens at
dp 1 -- odd lengths, so SP must pad) goes through, with SP off and with SP "auto" (on at TP2):

    TP2 (dp 2)   TP2 x PP2 (dp 1)   TP2 x PP2 x VPP2 (dp 1, interleaved)

Per run: forward (log-probs + entropy) -> one train_batch (Adam, distributed optimizer, clip)
-> forward again. Rank 0 also runs HF transformers on each sequence alone.

Recompute, at TP2 (dp 2, SP on, non-distributed optimizer so every rank holds the full
gradients): none / selective / full-uniform (1 layer per unit) / full-block (2 of 4 layers) --
the step's loss, every parameter's gradient (vs none) and the peak bytes saved for backward
(tools/check_memory_model.SavedActivationMeter). A forward-only engine built with recompute
"full" must come out without it.

Critic at TP2 (dp 2): values and one value-loss step, SP off vs on (the value head gathers
the sequence-parallel tokens), and SP on with full recompute.

Context parallelism (tests/dist/cp_layouts.py's FAST_PAIRS): CP2 (dp 2) vs TP1 (dp 4) with every
gradient, CP2 x TP2 (SP) vs the TP2 SP run above, and the unadjusted-RoPE negative control.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
from areal_mega.megatron.model import MegatronModelConfig
from areal_mega.batching.packing import pack_sequences, shift_to_next_token
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.models import load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.trainer.critic import CriticConfig, CriticEngine
from tests.support.models import DEFAULTS, save_tiny_model
from tests.support.dist import finish, hf_reference
from tests.dist.cp_layouts import FAST_PAIRS, cp_runs
from tools.check_memory_model import SavedActivationMeter

VOCAB = DEFAULTS["vocab_size"]  # 200
SCALE = 1.5  # as tests/dist/engine_checks.py: log-probs far from uniform, fp32 noise small
TEMPERATURE = 0.8
LR = 5e-5
ENT_COEF = 0.01
LENS = [17, 3, 61, 9, 40, 26, 70]


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in LENS:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        seqs.append({
            "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt),
            "logprobs": [0.0] * prompt + (-3.0 - torch.rand(n - prompt, generator=g)).tolist(),
        })
    batch = pack_sequences(seqs)
    cu = batch["cu_seqlens"]
    batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], cu)
    batch["logprobs"] = shift_to_next_token(batch["logprobs"], cu)
    batch["advantages"] = torch.randn(batch["input_ids"].numel(), generator=g) * batch["loss_mask"]
    batch["returns"] = torch.randn(batch["input_ids"].numel(), generator=g) * batch["loss_mask"]
    return batch


def make_loss_fn(batch):
    """PPO-like: -A * exp(lp - behav) - c * entropy, token mean over the GLOBAL batch."""
    total = float(batch["loss_mask"].sum())

    def loss_fn(lp, ent, mb):
        m = mb["loss_mask"].float()
        per_tok = -mb["advantages"] * torch.exp(lp - mb["logprobs"]) - ENT_COEF * ent
        ratio = torch.exp(lp - mb["logprobs"])
        abs_term = (mb["advantages"].abs() * ratio * m).sum() / m.sum().clamp(min=1)  # loss-term scale, for tolerances
        return (per_tok * m).sum() / total, {"n_tokens": m.sum(), "abs_ratio_term": abs_term}

    return loss_fn


def value_loss_fn(batch):
    total = float(batch["loss_mask"].sum())

    def loss_fn(values, _zeros, mb):
        m = mb["loss_mask"].float()
        return (((values - mb["returns"]) ** 2) * m).sum() / total, {"n_tokens": m.sum()}

    return loss_fn



def groups_for(tp: int, pp: int, vpp: int | None = None):
    pcfg = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline_parallel=vpp)
    return init_model_parallel(ParallelLayout.build(pcfg, dist.get_world_size()), backend="gloo", seed=1234)


def engine_cfg(sp, *, recompute: str = "none", method: str = "uniform", num_layers: int = 1,
               distributed: bool = True, cls=MegatronEngineConfig):
    return cls(
        model=MegatronModelConfig(dtype="float32", sequence_parallel=sp, recompute=recompute,
                                  recompute_method=method, recompute_num_layers=num_layers),
        # adam_eps 1e-5 as in engine_checks.py: keeps fp32 reduction-order noise in tiny
        # gradients from becoming O(lr) weight differences (conditions the comparison only).
        optimizer=OptimizerConfig(lr=LR, lr_warmup_steps=2, clip_grad=0.5, weight_decay=0.01, adam_eps=1e-5,
                                  use_distributed_optimizer=distributed),
        max_tokens_per_microbatch=64,
    )


def flat_grads(engine) -> torch.Tensor:
    """Every parameter's gradient on this rank (DDP main_grad), in name order, as one vector."""
    parts = []
    for c in engine.chunks:
        for name, p in sorted(c.named_parameters(), key=lambda x: x[0]):
            g = getattr(p, "main_grad", None)
            parts.append((g if g is not None else torch.zeros_like(p)).detach().float().reshape(-1).clone())
    return torch.cat(parts)


def sp_runs(hf_dir: str, batch, loss_fn) -> dict:
    out: dict = {}
    for name, tp, pp, vpp in (("tp2", 2, 1, None), ("tp2pp2", 2, 2, None), ("tp2pp2vpp2", 2, 2, 2)):
        for sp in (False, "auto"):
            groups = groups_for(tp, pp, vpp)
            eng = MegatronTrainEngine.create(engine_cfg(sp), load_hf_config(hf_dir), groups, hf_dir)
            # Rows the first decoder layer sees (megatron layout [s, b, h]): the real token
            # count without SP, half of the padded count with it -- proof that SP really splits.
            rows: list[int] = []
            hook = eng.model.chunks[0].decoder.layers[0].register_forward_pre_hook(
                lambda _m, args, kwargs: rows.append(int(kwargs.get("hidden_states", args[0] if args else None).shape[0])),
                with_kwargs=True)
            before = eng.forward(batch, temperature=TEMPERATURE)
            hook.remove()
            stats = eng.train_batch(batch, loss_fn, temperature=TEMPERATURE)
            after = eng.forward_logprobs(batch, temperature=TEMPERATURE)
            out[f"{name}_sp{'on' if sp else 'off'}"] = {
                "sequence_parallel": bool(eng.model.config.sequence_parallel),
                "dp": eng.layout.dp, "layer_rows": rows,
                "mb_tokens": [int(mb["input_ids"].numel()) for mb in eng._plan(batch)[1]],
                "logprobs": before["logprobs"].tolist(), "entropy": before["entropy"].tolist(),
                "stats": stats, "after": after.tolist(),
            }
            destroy_model_parallel()
    return out


def recompute_runs(hf_dir: str, batch, loss_fn) -> dict:
    out: dict = {}
    ref_grads = None
    modes = (("none", "none", "uniform", 1), ("selective", "selective", "uniform", 1),
             ("full_uniform", "full", "uniform", 1), ("full_block2", "full", "block", 2))
    for key, rc, method, n in modes:
        groups = groups_for(2, 1)
        eng = MegatronTrainEngine.create(engine_cfg(True, recompute=rc, method=method, num_layers=n, distributed=False),
                                         load_hf_config(hf_dir), groups, hf_dir)
        tc = eng.model.config
        params = [p for c in eng.chunks for p in c.parameters()]
        meter = SavedActivationMeter(exclude=params)
        with meter:
            stats = eng.train_batch(batch, loss_fn, temperature=TEMPERATURE)
        grads = flat_grads(eng)
        if ref_grads is None:
            ref_grads = grads
        diff = torch.tensor([float((grads - ref_grads).abs().max()), float(ref_grads.abs().max())])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        peak = torch.tensor([float(meter.peak_bytes)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[key] = {
            "granularity": tc.recompute_granularity, "method": tc.recompute_method, "num_layers": tc.recompute_num_layers,
            "stats": stats, "grad_maxdiff": float(diff[0]), "grad_absmax": float(diff[1]),
            "saved_bytes_peak": float(peak[0]),
        }
        destroy_model_parallel()
    # Forward-only engines never recompute (nothing is saved under no_grad).
    groups = groups_for(2, 1)
    ref = MegatronTrainEngine.create(engine_cfg(True, recompute="full"), load_hf_config(hf_dir), groups, hf_dir,
                                     trainable=False)
    out["reference_granularity"] = ref.model.config.recompute_granularity
    destroy_model_parallel()
    return out


def critic_runs(hf_dir: str, batch) -> dict:
    out: dict = {}
    for key, sp, rc in (("spoff", False, "none"), ("spon", True, "none"), ("spon_full", True, "full")):
        groups = groups_for(2, 1)
        critic = CriticEngine.create(engine_cfg(sp, recompute=rc, cls=CriticConfig), load_hf_config(hf_dir), groups,
                                     hf_dir, seed=3)
        values = critic.compute_values(batch)
        stats = critic.train_batch(batch, value_loss_fn(batch))
        out[key] = {
            "recompute_granularity": critic.model.config.recompute_granularity,
            "sequence_parallel": bool(critic.model.config.sequence_parallel),
            "values": values.tolist(), "stats": stats, "after": critic.compute_values(batch).tolist(),
        }
        destroy_model_parallel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    hf_dir = os.path.join(args.work_dir, "tiny_qwen2")
    if rank == 0:
        save_tiny_model(hf_dir, scale=SCALE)
    dist.barrier()
    batch = make_batch()
    loss_fn = make_loss_fn(batch)
    res = {"sp": sp_runs(hf_dir, batch, loss_fn), "recompute": recompute_runs(hf_dir, batch, loss_fn),
           "critic": critic_runs(hf_dir, batch),
           "cp": cp_runs(hf_dir, batch, loss_fn, TEMPERATURE, engine_cfg, flat_grads, pairs=FAST_PAIRS)}
    if rank == 0:
        res["hf_logprobs"], res["hf_entropy"] = hf_reference(hf_dir, batch, TEMPERATURE)
        res["cu_seqlens"] = batch["cu_seqlens"].tolist()
        res["loss_mask"] = batch["loss_mask"].tolist()
    finish(res, args.out)


if __name__ == "__main__":
    main()

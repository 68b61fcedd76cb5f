"""Critic and reference-model checks on real megatron-core ranks, in ONE torchrun launch
(2 gloo ranks; driven and asserted by tests/test_critic.py, which reads --out):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/dist/critic_checks.py --work-dir D --out R.json

A tiny random Qwen2 with TIED embeddings (the critic must untie them, also across PP) is
written by rank 0. The same packed batch goes through three layouts of the 2 ranks:

    TP1 (dp 2)   TP2 (dp 1)   PP2 (dp 1)

Critic, per layout: values before -> one PPOCriticLoss step on fixed returns -> values after.
At TP2 the stepped critic is saved; a fresh PP2 critic (no HF load, other head seed) loads it.
Reference, at TP2: a forward-only engine and a trainable actor from the same HF weights; the
actor takes two optimizer steps; the reference's log-probs are recorded before and after.
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
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.trainer.critic import CriticConfig, CriticEngine
from areal_mega.algo.losses import PPOActorLoss, PPOCriticLoss, global_counts
from tests.support.models import save_tiny_model
from tests.support.dist import finish

VOCAB = 120
# The tiny Qwen2 with TIED embeddings (tests/support/models.py; HF init, 2 layers, hidden 64)
MODEL = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True)
SEED = 3


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lens = [11, 30, 4, 22, 17]
    seqs = []
    for n in lens:
        prompt = max(1, n // 3)
        seqs.append({
            "input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist(),
            "loss_mask": [0] * prompt + [1] * (n - prompt),
            "logprobs": [0.0] * prompt + (-4.0 - torch.rand(n - prompt, generator=g)).tolist(),
        })
    batch = pack_sequences(seqs)
    cu = batch["cu_seqlens"]
    batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], cu)
    batch["logprobs"] = shift_to_next_token(batch["logprobs"], cu)
    T = batch["input_ids"].numel()
    batch["returns"] = torch.randn(T, generator=g).mul(0.5).add(0.3) * batch["loss_mask"]
    batch["advantages"] = torch.randn(T, generator=g) * batch["loss_mask"]
    return batch


def groups_for(tp: int, pp: int):
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), dist.get_world_size())
    return init_model_parallel(layout, backend="gloo", seed=1234)


def critic_cfg() -> CriticConfig:
    # value_eps_clip large below: the clip would otherwise bound how far one step can move values.
    return CriticConfig(
        model=MegatronModelConfig(dtype="float32"),
        optimizer=OptimizerConfig(lr=3e-4, adam_eps=1e-5, use_distributed_optimizer=True),
        max_tokens_per_microbatch=40,  # several micro-batches
        value_head_init_std=0.1,
    )


ALGO = AlgorithmConfig(value_eps_clip=10.0, decoupled=False)


def critic_step(critic: CriticEngine, batch) -> dict:
    v0 = critic.compute_values(batch)
    b = dict(batch, values=v0)
    tokens, seqs = global_counts(b["loss_mask"], b["cu_seqlens"])
    loss_fn = PPOCriticLoss(ALGO, total_tokens=tokens, total_seqs=seqs)
    whole, _ = loss_fn(v0, None, b)  # the same objective on the whole batch at once
    stats = critic.train_batch(b, loss_fn)
    v1 = critic.compute_values(batch)
    after, _ = loss_fn(v1, None, b)
    return {"values": v0.tolist(), "after": v1.tolist(), "stats": stats,
            "whole_loss": float(whole), "loss_after": float(after)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hf_dir = os.path.join(args.work_dir, "tiny_qwen2_tied")
    ckpt = os.path.join(args.work_dir, "critic_tp2")
    if rank == 0:
        save_tiny_model(hf_dir, **MODEL)
    dist.barrier()
    hf = load_hf_config(hf_dir)
    batch = make_batch()
    res: dict = {"critic": {}, "loss_mask": batch["loss_mask"].tolist(), "cu_seqlens": batch["cu_seqlens"].tolist()}

    for name, tp, pp in (("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        groups = groups_for(tp, pp)
        critic = CriticEngine.create(critic_cfg(), hf, groups, hf_weights_dir=hf_dir, seed=SEED)
        r = critic_step(critic, batch)
        r["dp"] = critic.layout.dp
        if name == "tp2":
            critic.set_version(5)
            critic.save(ckpt)
        if name == "pp2":
            fresh = CriticEngine.create(critic_cfg(), hf, groups, hf_weights_dir=None, seed=SEED + 1)
            fresh.load(ckpt)
            r["resumed"] = {"version": fresh.get_version(), "values": fresh.compute_values(batch).tolist()}
        res["critic"][name] = r
        destroy_model_parallel()

    # Reference model vs actor (TP2).
    groups = groups_for(2, 1)
    ecfg = MegatronEngineConfig(model=MegatronModelConfig(dtype="float32"),
                                optimizer=OptimizerConfig(lr=1e-2, use_distributed_optimizer=False))
    ref = MegatronTrainEngine.create(ecfg, hf, groups, hf_weights_dir=hf_dir, trainable=False)
    actor = MegatronTrainEngine.create(ecfg, hf, groups, hf_weights_dir=hf_dir)
    ref0, act0 = ref.forward_logprobs(batch, 0.9), actor.forward_logprobs(batch, 0.9)
    b = dict(batch, ref_logprobs=ref0)
    tokens, seqs = global_counts(b["loss_mask"], b["cu_seqlens"])
    loss_fn = PPOActorLoss(AlgorithmConfig(decoupled=False, kl_coef=0.1), total_tokens=tokens, total_seqs=seqs)
    s1 = actor.train_batch(b, loss_fn, 0.9)
    s2 = actor.train_batch(b, loss_fn, 0.9)
    raised = []
    for what, call in (("train_batch", lambda: ref.train_batch(b, loss_fn, 0.9)), ("save", lambda: ref.save(ckpt + "_ref"))):
        try:
            call()
        except ValueError as e:
            raised.append(str(e))
    res["ref"] = {
        "ref0": ref0.tolist(), "act0": act0.tolist(),
        "ref1": ref.forward_logprobs(batch, 0.9).tolist(), "act1": actor.forward_logprobs(batch, 0.9).tolist(),
        "stats1": s1, "stats2": s2, "raised": raised,
        "ref_has_optimizer": ref.optimizer is not None,
        "ref_trainable_params": sum(p.numel() for c in ref.chunks for p in c.parameters() if p.requires_grad),
    }
    destroy_model_parallel()

    finish(res, args.out)


if __name__ == "__main__":
    main()

"""python tests/dist/critic_gpu_smoke.py --workdir /tmp/critic_gpu

GPU smoke check of the PPO critic and the forward-only reference engine (not part of CPU CI;
on a machine without CUDA it runs the same checks on CPU/gloo): one device, world size 1.
Prints one JSON line with the numbers; exits non-zero when a check fails.

  fp32 and bf16 critic: finite values on the right positions, one PPOCriticLoss step lowers
  the value loss; fp32: save -> load into a fresh critic gives the same values (bf16 save
  fails inside MegatronTrainEngine for the actor as well, megatron-core 0.16.1: not checked);
  reference: equals the actor at init, unchanged after two actor steps (with the KL term).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo: tests.support
from critic_checks import ALGO, MODEL, make_batch  # noqa: E402  (same tiny model and batch)
from tests.support.models import save_tiny_model  # noqa: E402
from tests.support.numerics import fp32_tol, rounding_tol, transformer_reductions  # noqa: E402

FWD = transformer_reductions(MODEL["num_hidden_layers"])  # reductions from the weights to a value / log-prob


def same_weights_tol(dtype: str, ref: torch.Tensor) -> float:
    """Values (or log-probs) of the same weights computed twice (tests/support/numerics.py): FWD
    reductions relative to max |ref|; fp32 ones of up to K = 128 terms, bf16 ones accumulate in
    fp32 and round once (K = 1)."""
    return rounding_tol(dtype, 128 if dtype == "float32" else 1, float(ref.abs().max()), ops=FWD)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(0)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)

    from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
    from areal_mega.megatron.model import MegatronModelConfig
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.models import load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.algo.config import AlgorithmConfig
    from areal_mega.trainer.critic import CriticConfig, CriticEngine
    from areal_mega.algo.losses import PPOActorLoss, PPOCriticLoss, global_counts

    hf_dir = os.path.join(args.workdir, "tiny")
    save_tiny_model(hf_dir, **MODEL)
    hf = load_hf_config(hf_dir)
    batch = make_batch()
    tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "backend": backend}
    failures: list[str] = []

    def check(name: str, ok: bool) -> None:
        if not ok:
            failures.append(name)

    layout = ParallelLayout.build(ParallelConfig(), 1)
    groups = init_model_parallel(layout, backend=backend, seed=1234)
    for dtype in ("float32", "bfloat16"):
        try:
            cfg = CriticConfig(model=MegatronModelConfig(dtype=dtype),
                               optimizer=OptimizerConfig(lr=3e-4, adam_eps=1e-5), value_head_init_std=0.1)
            critic = CriticEngine.create(cfg, hf, groups, hf_weights_dir=hf_dir, seed=3)
            v0 = critic.compute_values(batch)
            b = dict(batch, values=v0)
            loss_fn = PPOCriticLoss(ALGO, total_tokens=tokens, total_seqs=seqs)
            before = float(loss_fn(v0, None, b)[0])
            stats = critic.train_batch(b, loss_fn)
            v1 = critic.compute_values(batch)
            after = float(loss_fn(v1, None, b)[0])
            reload_diff = 0.0
            if dtype == "float32":  # bf16 save fails in MegatronTrainEngine itself (actor too): known gap
                ckpt = os.path.join(args.workdir, f"critic_{dtype}")
                critic.save(ckpt)
                fresh = CriticEngine.create(cfg, hf, groups, hf_weights_dir=None, seed=4)
                fresh.load(ckpt)
                reload_diff = float((fresh.compute_values(batch) - v1).abs().max())
            ends = batch["cu_seqlens"][1:] - 1
            res[dtype] = {"loss_before": before, "loss_after": after, "engine_loss": stats["loss"],
                          "grad_norm": stats["grad_norm"], "reload_maxdiff": reload_diff,
                          "head_device": str(critic.model.chunks[-1].output_layer.weight.device)}
            check(f"{dtype}: finite", bool(torch.isfinite(v0).all() and torch.isfinite(v1).all()))
            check(f"{dtype}: zero at sequence ends", bool((v0[ends] == 0).all()))
            # loss 0.5 (v - R)^2 moves by |v - R| |dv|, mean |v - R| <= sqrt(2 loss); plus the sum's order
            v_t = same_weights_tol(dtype, v0)
            loss_t = (2 * before) ** 0.5 * v_t + fp32_tol(int(batch["loss_mask"].sum()), before)
            check(f"{dtype}: engine loss == objective", abs(stats["loss"] - before) <= loss_t)
            # learning, not rounding: one Adam step lowers it by ~40% on CPU
            check(f"{dtype}: step lowers value loss", after < 0.9 * before)
            check(f"{dtype}: save/load", reload_diff <= same_weights_tol(dtype, v1))
        except Exception:
            failures.append(f"{dtype}: {traceback.format_exc()}")

    try:
        ecfg = MegatronEngineConfig(model=MegatronModelConfig(dtype="float32"), optimizer=OptimizerConfig(lr=1e-2))
        ref = MegatronTrainEngine.create(ecfg, hf, groups, hf_weights_dir=hf_dir, trainable=False)
        actor = MegatronTrainEngine.create(ecfg, hf, groups, hf_weights_dir=hf_dir)
        ref0, act0 = ref.forward_logprobs(batch, 0.9), actor.forward_logprobs(batch, 0.9)
        b = dict(batch, ref_logprobs=ref0)
        loss_fn = PPOActorLoss(AlgorithmConfig(decoupled=False, kl_coef=0.1), total_tokens=tokens, total_seqs=seqs)
        actor.train_batch(b, loss_fn, 0.9)
        s2 = actor.train_batch(b, loss_fn, 0.9)
        ref1, act1 = ref.forward_logprobs(batch, 0.9), actor.forward_logprobs(batch, 0.9)
        res["ref"] = {"init_maxdiff": float((ref0 - act0).abs().max()), "ref_moved": float((ref1 - ref0).abs().max()),
                      "actor_moved": float((act1 - act0).abs().max()), "ref_kl_step2": s2["ref_kl"]}
        lp_t = same_weights_tol("float32", ref0)
        check("ref == actor at init", res["ref"]["init_maxdiff"] <= lp_t)
        check("ref frozen", res["ref"]["ref_moved"] == 0.0)  # the same engine, the same inputs: exact
        check("actor moved", res["ref"]["actor_moved"] > lp_t)
    except Exception:
        failures.append(f"ref: {traceback.format_exc()}")

    res["failures"] = failures
    print(json.dumps(res), flush=True)
    destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""python tests/dist/engine_gpu_smoke.py --workdir /tmp/engine_gpu

GPU smoke check of MegatronTrainEngine (not part of CPU CI): one CUDA device, world size 1,
NCCL, local layer spec. Prints one JSON line per check; exits non-zero on any failure.

  fp32: packed log-probs/entropy vs per-sequence HF (TF32 off), one train step whose loss
        equals the objective on the forward outputs, 1-vs-many micro-batch invariance,
        save -> load into a fresh engine -> same log-probs and the same next step;
  bf16: log-probs vs HF fp32 (loose), a finite train step;
  perf: a ~0.2B bf16 model, 64 sequences (long-tail lengths, ~20k tokens), budget 4096:
        forward and train-step tokens/s (after one warm-up step).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import sys
import time
import traceback
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import torch.distributed as dist
    import transformers

    from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
    from areal_mega.megatron.model import MegatronModelConfig, te_available
    from areal_mega.megatron.packing import pack_sequences, shift_to_next_token
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.parallel import ParallelLayout

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    print(json.dumps({"torch": torch.__version__, "te_available": te_available()}), flush=True)

    def make_engine(hf_dir, dtype, budget, load=True):
        groups = init_model_parallel(ParallelLayout(world_size=1), backend="nccl")
        cfg = MegatronEngineConfig(
            model=MegatronModelConfig(dtype=dtype, layer_spec="local"),
            optimizer=OptimizerConfig(lr=5e-5, lr_warmup_steps=2, clip_grad=0.5, adam_eps=1e-5),
            max_tokens_per_microbatch=budget,
        )
        return MegatronTrainEngine.create(cfg, hf_dir, groups, hf_dir if load else None)

    g = torch.Generator().manual_seed(0)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    hf = transformers.Qwen2ForCausalLM(hf_cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.5)
    hf_dir = work / "tiny"
    hf.save_pretrained(hf_dir)
    hf = hf.cuda().eval()
    lens = [17, 3, 61, 9, 40, 25, 70]
    seqs = []
    for n in lens:
        ids = torch.randint(0, 300, (n,), generator=g).tolist()
        p = max(1, n // 3)
        seqs.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p), "logprobs": [0.0] * p + [-4.0] * (n - p)})
    batch = pack_sequences(seqs)
    cu = batch["cu_seqlens"]
    batch["loss_mask"] = shift_to_next_token(batch["loss_mask"], cu)
    batch["logprobs"] = shift_to_next_token(batch["logprobs"], cu)
    batch["advantages"] = torch.randn(batch["input_ids"].numel(), generator=g) * batch["loss_mask"]
    total = float(batch["loss_mask"].sum())

    def loss_fn(lp, ent, mb):
        m = mb["loss_mask"].float()
        per = -mb["advantages"] * torch.exp(lp - mb["logprobs"]) - 0.01 * ent
        return (per * m).sum() / total, {"n_tokens": m.sum()}

    with torch.no_grad():
        ref_lp, ref_ent = [], []
        for i in range(len(lens)):
            ids = batch["input_ids"][cu[i] : cu[i + 1]].cuda()
            logp = torch.log_softmax(hf(ids[None]).logits[0].float() / 0.8, -1)
            lp = torch.zeros(len(ids), device="cuda")
            lp[:-1] = logp[:-1].gather(-1, ids[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            ent[-1] = 0
            ref_lp.append(lp.cpu())
            ref_ent.append(ent.cpu())
        ref_lp, ref_ent = torch.cat(ref_lp), torch.cat(ref_ent)

    failures = 0

    def report(rec, ok):
        nonlocal failures
        rec["ok"] = bool(ok)
        failures += not ok
        print(json.dumps(rec), flush=True)

    # ---------------- fp32 correctness
    rec = {"check": "fp32"}
    try:
        eng = make_engine(hf_dir, "float32", 64)
        fwd = eng.forward(batch, temperature=0.8)
        rec["lp_vs_hf"] = float((fwd["logprobs"] - ref_lp).abs().max())
        rec["ent_vs_hf"] = float((fwd["entropy"] - ref_ent).abs().max())
        m = batch["loss_mask"].float()
        expect = float(((-batch["advantages"] * torch.exp(fwd["logprobs"] - batch["logprobs"]) - 0.01 * fwd["entropy"]) * m).sum() / total)
        st = eng.train_batch(batch, loss_fn, temperature=0.8)
        rec["num_microbatches"] = st["num_microbatches"]
        rec["loss_vs_expected"] = abs(st["loss"] - expect)
        rec["lr"] = st["lr"]
        after = eng.forward_logprobs(batch, temperature=0.8)
        rec["step_change"] = float((after - fwd["logprobs"]).abs().max())
        eng.save(str(work / "ckpt"))
        st2 = eng.train_batch(batch, loss_fn, temperature=0.8)
        after2 = eng.forward_logprobs(batch, temperature=0.8)
        destroy_model_parallel()
        one = make_engine(hf_dir, "float32", 100_000)
        st_one = one.train_batch(batch, loss_fn, temperature=0.8)
        rec["one_mb_loss_diff"] = abs(st_one["loss"] - st["loss"])
        rec["one_mb_after_diff"] = float((one.forward_logprobs(batch, temperature=0.8) - after).abs().max())
        destroy_model_parallel()
        res = make_engine(hf_dir, "float32", 64, load=False)
        res.load(str(work / "ckpt"))
        rec["resume_lp_diff"] = float((res.forward_logprobs(batch, temperature=0.8) - after).abs().max())
        st2r = res.train_batch(batch, loss_fn, temperature=0.8)
        rec["resume_step2_loss_diff"] = abs(st2r["loss"] - st2["loss"])
        rec["resume_after2_diff"] = float((res.forward_logprobs(batch, temperature=0.8) - after2).abs().max())
        destroy_model_parallel()
        ok = (
            rec["lp_vs_hf"] <= 1e-4 and rec["ent_vs_hf"] <= 1e-4 and rec["loss_vs_expected"] <= 1e-6
            and rec["step_change"] > 1e-2 and rec["one_mb_loss_diff"] <= 1e-5 and rec["one_mb_after_diff"] <= 1e-5
            and rec["resume_lp_diff"] <= 1e-5 and rec["resume_step2_loss_diff"] <= 1e-5 and rec["resume_after2_diff"] <= 1e-5
        )
    except Exception:
        rec["error"] = traceback.format_exc()[-3000:]
        ok = False
        try:
            destroy_model_parallel()
        except Exception:
            pass
    report(rec, ok)

    # ---------------- bf16
    rec = {"check": "bf16"}
    try:
        eng = make_engine(hf_dir, "bfloat16", 64)
        fwd = eng.forward(batch, temperature=0.8)
        rec["lp_vs_hf_fp32"] = float((fwd["logprobs"] - ref_lp).abs().max())
        st = eng.train_batch(batch, loss_fn, temperature=0.8)
        rec["loss"], rec["grad_norm"] = st["loss"], st["grad_norm"]
        destroy_model_parallel()
        ok = rec["lp_vs_hf_fp32"] < 0.2 and math.isfinite(st["loss"]) and math.isfinite(st["grad_norm"])
    except Exception:
        rec["error"] = traceback.format_exc()[-3000:]
        ok = False
        try:
            destroy_model_parallel()
        except Exception:
            pass
    report(rec, ok)

    # ---------------- perf (bf16, ~0.2B params)
    rec = {"check": "perf"}
    try:
        big_cfg = transformers.Qwen2Config(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
            num_key_value_heads=4, max_position_embeddings=8192, tie_word_embeddings=False,
        )
        big_dir = work / "big"
        transformers.Qwen2ForCausalLM(big_cfg).to(torch.bfloat16).save_pretrained(big_dir)
        rng = random.Random(0)
        lens = [min(4096, max(16, int(rng.lognormvariate(math.log(300), 1.0)))) for _ in range(64)]
        b = pack_sequences([
            {"input_ids": [rng.randrange(32000) for _ in range(n)], "loss_mask": [1] * n, "logprobs": [-5.0] * n}
            for n in lens
        ])
        b["advantages"] = torch.randn(b["input_ids"].numel())
        tot = float(b["loss_mask"].sum())

        def lf(lp, ent, mb):
            m = mb["loss_mask"].float()
            return (-(mb["advantages"] * torch.exp(lp - mb["logprobs"])) * m).sum() / tot, {"n_tokens": m.sum()}

        eng = make_engine(str(big_dir), "bfloat16", 4096)
        rec["params_M"] = sum(p.numel() for p in eng.model.chunks[0].parameters()) / 1e6
        rec["tokens"] = int(b["input_ids"].numel())
        eng.train_batch(b, lf)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward_logprobs(b)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        st = eng.train_batch(b, lf)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rec["num_microbatches"] = st["num_microbatches"]
        rec["forward_tok_s"] = rec["tokens"] / (t1 - t0)
        rec["train_tok_s"] = rec["tokens"] / (t2 - t1)
        rec["max_mem_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        destroy_model_parallel()
        ok = math.isfinite(st["loss"])
    except Exception:
        rec["error"] = traceback.format_exc()[-3000:]
        ok = False
    report(rec, ok)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

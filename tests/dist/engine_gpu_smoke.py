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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: areal_mega, tests.support
from tests.support.models import count_params, save_tiny_model, tiny_model  # noqa: E402
from tests.support.numerics import (  # noqa: E402
    WEIGHTED_MATMULS_PER_LAYER, adam_step_rel, bf16_tol, fp32_tol, transformer_reductions,
)

# The tiny fp32 model (tests/support/models.py; 4 layers, vocab 300, weights x1.5 as in the CPU
# engine checks) and the tolerances of computing it two ways (tests/support/numerics.py): every
# reduction on the way may run in another order -- FWD of up to K = VOCAB terms.
VOCAB, LAYERS, ADAM_EPS = 300, 4, 1e-5
MODEL = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS)
FWD, FWD_BWD = transformer_reductions(LAYERS), transformer_reductions(LAYERS, backward=True)
GRAD_REL = fp32_tol(VOCAB, 1.0, ops=FWD_BWD)


def lp_tol(ref) -> float:
    """fp32 log-probs / entropies of the same weights, relative to max |ref|."""
    return fp32_tol(VOCAB, float(torch.as_tensor(ref).abs().max()), ops=FWD)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import torch.distributed as dist

    from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
    from areal_mega.megatron.model import MegatronModelConfig, te_available
    from areal_mega.batching.packing import pack_sequences, shift_to_next_token
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
    hf = tiny_model(scale=1.5, **MODEL)
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
        ref_lp, ref_ent, logit_scale = [], [], 0.0
        for i in range(len(lens)):
            ids = batch["input_ids"][cu[i] : cu[i + 1]].cuda()
            logits = hf(ids[None]).logits[0].float() / 0.8
            logit_scale = max(logit_scale, float(logits.abs().max()))
            logp = torch.log_softmax(logits, -1)
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
        # Tolerances: the same weights two ways (lp_tol); a loss of those inputs, |d(A e^x)| =
        # |A e^x| |dx| plus the entropy term and the reordered sum; after a step, plus the share of
        # the step's effect that gradient rounding can change (numerics.adam_step_rel).
        n_params = count_params(**MODEL)
        abs_term = float((batch["advantages"].abs() * torch.exp(fwd["logprobs"] - batch["logprobs"]) * m).sum() / m.sum())

        def loss_tol(lp_ref):
            return abs_term * lp_tol(lp_ref) + 0.01 * lp_tol(ref_ent) + fp32_tol(int(m.sum()), abs_term + 0.01 * math.log(VOCAB))

        after_t = lp_tol(after) + rec["step_change"] * adam_step_rel(GRAD_REL, st["grad_norm"], n_params, ADAM_EPS)
        moved2 = float((after2 - after).abs().max())
        after2_t = lp_tol(after2) + moved2 * adam_step_rel(GRAD_REL, st2["grad_norm"], n_params, ADAM_EPS)
        rec["tol"] = {"lp": lp_tol(ref_lp), "loss": loss_tol(ref_lp), "after": after_t, "after2": after2_t}
        ok = (
            rec["lp_vs_hf"] <= lp_tol(ref_lp) and rec["ent_vs_hf"] <= lp_tol(ref_ent)
            and rec["loss_vs_expected"] <= loss_tol(ref_lp) and rec["step_change"] > after_t
            and rec["one_mb_loss_diff"] <= loss_tol(ref_lp) and rec["one_mb_after_diff"] <= after_t
            and rec["resume_lp_diff"] <= lp_tol(after) and rec["resume_step2_loss_diff"] <= loss_tol(after)
            and rec["resume_after2_diff"] <= after2_t
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
        # bf16 vs fp32: every reduction's output and every weight rounded to bf16 (fp32 accumulation:
        # one rounding each, <= u relative to the logits), |d lp| <= 2 max |d z|, z = logits / T.
        rec["tol"] = 2 * bf16_tol(1, logit_scale, ops=FWD + WEIGHTED_MATMULS_PER_LAYER * LAYERS + 1)
        ok = rec["lp_vs_hf_fp32"] <= rec["tol"] and math.isfinite(st["loss"]) and math.isfinite(st["grad_norm"])
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
        big_dir = save_tiny_model(work / "big", dtype="bfloat16", vocab_size=32000, hidden_size=1024,
                                  intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                                  num_key_value_heads=4, max_position_embeddings=8192)
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

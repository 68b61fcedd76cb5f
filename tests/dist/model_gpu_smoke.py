"""python tests/dist/model_gpu_smoke.py --workdir /tmp/gpu_smoke

GPU smoke check of the model side (not part of CPU CI): on one CUDA device, world size 1, NCCL.
Verifies the CPU compatibility layer stays off, then for a tiny random Llama (tied) and Qwen2
(untied) and each available layer spec ("local", and "te" when transformer_engine imports):
build, load HF weights, packed forward vs per-sequence HF logits (fp32), export bit-exactness.
Prints one JSON line per check; exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: areal_mega, tests.support
from tests.support.models import tiny_model  # noqa: E402
from tests.support.numerics import rounding_tol, transformer_reductions  # noqa: E402

# The models of tests/test_megatron_model.py (tests/support/models.py): 4 layers, vocab 300, MLP 96,
# random norms and biases too (noise 0.1).
MODEL = dict(vocab_size=300, intermediate_size=96, max_position_embeddings=256, noise=0.1)
LAYERS = 4


def logits_tol(spec: str, ref: torch.Tensor) -> float:
    """Megatron vs HF logits of the same fp32 weights (tests/support/numerics.py): the forward's
    reductions (the log-softmax excluded) in another order, of up to K = 96 terms (MLP), relative
    to max |logits|. transformer_engine may run fp32 GEMMs in TF32 (10-bit mantissa): its spec
    gets TF32's unit roundoff."""
    dtype = "tfloat32" if spec == "te" else "float32"
    return rounding_tol(dtype, 96, float(ref.abs().max()), ops=transformer_reductions(LAYERS) - 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.is_available()}), flush=True)
    import torch.distributed as dist

    from areal_mega.megatron import cpu_compat
    from areal_mega.megatron.model import (
        HFCheckpointReader,
        MegatronModelConfig,
        build_model,
        export_hf_weights,
        forward_logits,
        load_hf_weights,
        te_available,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.parallel import ParallelLayout

    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    print(json.dumps({"te_available": te_available(), "cpu_compat_needed": cpu_compat.needed()}), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the tolerance assumes it)
    g = torch.Generator().manual_seed(0)
    lens = [7, 13, 4, 10]
    ids = torch.randint(0, 300, (sum(lens),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    failures = 0
    for name, m in {
        "llama_tied": tiny_model("llama", tie_word_embeddings=True, noise_seed=1, **MODEL),
        "qwen2_untied": tiny_model("qwen2", tie_word_embeddings=False, noise_seed=2, **MODEL),
    }.items():
        m.config._attn_implementation = "eager"
        with torch.no_grad():
            ref = torch.cat([m(ids[cu[i] : cu[i + 1]].view(1, -1)).logits[0] for i in range(len(lens))]).float()
        m.save_pretrained(work / name)
        reader = HFCheckpointReader(work / name)
        for spec in ["local"] + (["te"] if te_available() else []):
            rec = {"model": name, "spec": spec}
            try:
                groups = init_model_parallel(ParallelLayout(world_size=1), backend="nccl")
                rec["cpu_compat"] = groups.cpu_compat
                model = build_model(work / name, groups, MegatronModelConfig(layer_spec=spec))
                rec["device"] = str(next(model.chunks[0].parameters()).device)
                load_hf_weights(model, work / name)
                out = forward_logits(model, ids, cu).cpu()
                rec["max_abs_diff"] = (out - ref).abs().max().item()
                rec["export_mismatch"] = [n for n, t in export_hf_weights(model) if not torch.equal(t.cpu(), reader.read(n))]
                rec["tol"] = logits_tol(spec, ref)
                ok = rec["max_abs_diff"] <= rec["tol"] and not rec["export_mismatch"] and not rec["cpu_compat"]
                destroy_model_parallel(groups)
            except Exception:
                rec["error"] = traceback.format_exc()[-2000:]
                ok = False
                try:
                    destroy_model_parallel()
                except Exception:
                    pass
            rec["ok"] = ok
            failures += not ok
            print(json.dumps(rec), flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

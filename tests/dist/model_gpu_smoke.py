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
import os
import socket
import sys
import traceback
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.is_available()}), flush=True)
    import torch.distributed as dist
    import transformers

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
    g = torch.Generator().manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    lens = [7, 13, 4, 10]
    ids = torch.randint(0, 300, (sum(lens),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    failures = 0
    for name, m in {
        "llama_tied": transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True)),
        "qwen2_untied": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False)),
    }.items():
        m.config._attn_implementation = "eager"
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
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
                ok = rec["max_abs_diff"] <= 1e-3 and not rec["export_mismatch"] and not rec["cpu_compat"]
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

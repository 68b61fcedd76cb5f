"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 1 tools/bench_lora_sync.py --model HF_DIR --sglang-python PY

Sync bytes and seconds per step for a LoRA learner, three ways on the same model, machine and
real SGLang CPU server (started once with --enable-lora, bf16): ``adapter`` (adapter-only:
weight_sync/lora_sync.py), ``merged`` (the LoRA merged-weight fallback: W + scaling * B A over
weight_sync.mode broadcast) and ``full`` (the same model without LoRA, the same broadcast: what a
full fine-tune sends). Each is synced --repeats times inside a pause (as the trainer does); prints
one JSON line per way (bytes, seconds best/median) plus the adapter config. docs/lora.md records
a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF model directory (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from areal_mega.inference.config import InferenceConfig, SGLangServerConfig
    from areal_mega.inference.server import launch_servers
    from areal_mega.inference.sglang_api import SGLangClient
    from areal_mega.megatron.lora import TARGETS, LoraConfig, apply_lora, gather_peft_state, load_peft_state
    from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights
    from areal_mega.megatron.parallel_state import init_model_parallel
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.weight_sync import WeightSyncConfig, megatron_weight_sync
    from areal_mega.weight_sync.lora_sync import LoraAdapterSync
    from areal_mega.inference import sglang_api as api

    dist.init_process_group("gloo")
    groups = init_model_parallel(ParallelLayout.build(ParallelConfig(), 1), backend="gloo", seed=1)
    mcfg = MegatronModelConfig(dtype="bfloat16", layer_spec="local", sequence_parallel=False)
    lcfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=list(TARGETS))
    servers = launch_servers(InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=args.sglang_python, model_path=args.model, device="cpu", dtype="bfloat16", max_total_tokens=4096,
        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900)),
        lora=WeightSyncConfig().served_lora(lcfg))  # the trainer's launch arguments (weight_sync.lora adapter)
    client = SGLangClient(servers[0].url, timeout_s=600)
    out = []
    try:
        lora_model = build_model(args.model, groups, mcfg)
        load_hf_weights(lora_model, args.model)
        apply_lora(lora_model, lcfg)
        g = torch.Generator().manual_seed(0)  # non-zero B: a trained adapter, not the B = 0 start
        load_peft_state(lora_model, {k: (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype)
                                     for k, v in gather_peft_state(lora_model).items()})
        full_model = build_model(args.model, groups, mcfg)
        load_hf_weights(full_model, args.model)
        wcfg = WeightSyncConfig(mode="broadcast", backend="gloo", bucket_mib=64)
        ways = {
            "adapter": lambda: LoraAdapterSync(lora_model, servers=[client], base_model=args.model),
            "merged": lambda: megatron_weight_sync(dataclasses.replace(wcfg, lora="merged"), adapter=lora_model.adapter,
                                                   chunks=lora_model.chunks, groups=groups, servers=[client],
                                                   dtype="bfloat16", model=lora_model),
            "full": lambda: megatron_weight_sync(wcfg, adapter=full_model.adapter, chunks=full_model.chunks,
                                                 groups=groups, servers=[client], dtype="bfloat16"),
        }
        version = 0
        for way, make in ways.items():
            ws = make()
            secs, nbytes = [], 0
            for _ in range(args.repeats):
                version += 1
                client.send(api.pause_generation("retract"))  # what the trainer's rollout service does
                try:
                    st = ws.sync(version)
                finally:
                    client.send(api.continue_generation())
                secs.append(st.seconds)
                nbytes = st.bytes
            ws.close()
            row = {"way": way, "bytes": nbytes, "mib": round(nbytes / 2**20, 3), "seconds_best": round(min(secs), 4),
                   "seconds_median": round(statistics.median(secs), 4), "repeats": args.repeats,
                   "lora_rank": args.rank, "model": Path(args.model).name}
            out.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in servers:
            s.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tools/convert_mcore_to_hf.py --ckpt CKPT_DIR --out HF_DIR --tp 1 --pp 2

Export an areal_mega megatron checkpoint (any saved layout) as an HF model directory:
safetensors (one file per pipeline stage, plus model.safetensors.index.json when pp > 1),
config.json, and the tokenizer / generation files copied from the HF directory recorded in the
checkpoint (or --tokenizer-dir). The tensors come from ModelAdapter.export_hf -- the same code
path live weight sync uses. The checkpoint is validated against the model before the output
directory is created.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory written by save_checkpoint")
    ap.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here (default: the checkpoint's source HF dir)")
    args = ap.parse_args(argv)

    from areal_mega.megatron.checkpoint import read_metadata
    from areal_mega.models import get_adapter

    meta = read_metadata(args.ckpt)
    get_adapter(meta["hf_config"])
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} exists and is not empty")

    import torch.distributed as dist

    from areal_mega.megatron.checkpoint import build_model_from_checkpoint, load_checkpoint
    from areal_mega.megatron.hf_export import save_hf_checkpoint
    from areal_mega.megatron.parallel_state import (
        destroy_model_parallel,
        init_model_parallel,
        init_process_group_for_script,
    )
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    own_world = init_process_group_for_script("gloo")  # False when called inside a running world
    t0 = time.time()
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo")
    model = build_model_from_checkpoint(args.ckpt, groups)
    load_checkpoint(model, args.ckpt)  # checks model_type and every shape first
    # The same writer the trainer uses for its final HF export (one shard per stage, index,
    # config.json, tokenizer files from the source HF dir).
    save_hf_checkpoint(model, str(out), hf_config=meta["hf_config"],
                       source_dir=args.tokenizer_dir or meta.get("source_hf_dir"))
    if dist.get_rank() == 0:
        print(f"convert_mcore_to_hf: {args.ckpt} -> {out} ({layout}) in {time.time() - t0:.1f}s", flush=True)
    destroy_model_parallel(groups)
    dist.barrier()
    if own_world:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

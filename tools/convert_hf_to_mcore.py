"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 tools/convert_hf_to_mcore.py --hf-dir HF_DIR --out CKPT_DIR --tp 2 --pp 2

Convert an HF Llama/Qwen2 checkpoint (safetensors) into an areal_mega megatron distributed
checkpoint written in the given layout (it loads in any other layout later). Runs on
tp * pp * dp processes (plain ``python`` = one process, TP1 x PP1). Everything is validated --
model_type, every tensor's shape -- before the output directory is created.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    ap.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the model with")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    args = ap.parse_args(argv)

    # Cheap checks first, before any process group or file exists.
    from areal_mega.models import get_adapter

    from areal_mega.megatron.model import HFCheckpointReader

    adapter = get_adapter(args.hf_dir)
    adapter.check_hf_shapes(HFCheckpointReader(args.hf_dir).shape)  # safetensors headers only
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} exists and is not empty")

    import torch.distributed as dist

    from areal_mega.megatron.checkpoint import save_checkpoint
    from areal_mega.megatron.model import MegatronModelConfig, build_model, load_hf_weights
    from areal_mega.megatron.parallel_state import (
        destroy_model_parallel,
        init_model_parallel,
        init_process_group_for_script,
    )
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    own_world = init_process_group_for_script("gloo")  # False when called inside a running world
    t0 = time.time()
    layout = ParallelLayout.build(
        ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, virtual_pipeline_parallel=args.vpp),
        dist.get_world_size(),
    )
    groups = init_model_parallel(layout, backend="gloo")
    cfg = MegatronModelConfig(dtype=args.dtype, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    model = build_model(args.hf_dir, groups, cfg)
    load_hf_weights(model, args.hf_dir)  # validates all shapes before writing any parameter
    save_checkpoint(model, out, source_hf_dir=args.hf_dir)
    if dist.get_rank() == 0:
        print(f"convert_hf_to_mcore: {args.hf_dir} -> {out} ({layout}) in {time.time() - t0:.1f}s", flush=True)
    destroy_model_parallel(groups)
    dist.barrier()
    if own_world:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # required: dist_checkpointing's save re-imports __main__
    sys.exit(main())

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
import json
import shutil
import sys
import time
from pathlib import Path

# Files of an HF model directory that are not weights and are copied verbatim.
_SKIP = {"config.json", "model.safetensors.index.json"}


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
    from safetensors.torch import save_file

    from areal_mega.megatron.checkpoint import build_model_from_checkpoint, load_checkpoint
    from areal_mega.megatron.model import export_hf_weights
    from areal_mega.models.base import torch_dtype
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
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    pp = layout.pp
    files = ["model.safetensors"] if pp == 1 else [f"model-{s + 1:05d}-of-{pp:05d}.safetensors" for s in range(pp)]
    c = groups.coords
    if c.dp == 0 and c.cp == 0:  # one replica exports; TP ranks of a stage gather together
        tensors = {n: t.contiguous() for n, t in export_hf_weights(model)}
        if c.tp == 0:
            save_file(tensors, str(out / files[c.pp]), metadata={"format": "pt"})
    if rank == 0:
        cfg = dict(meta["hf_config"])
        cfg["dtype"] = model.dtype
        cfg["architectures"] = [model.arch.architecture]
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if pp > 1:
            # The planner knows every stage's tensors without asking the other ranks.
            weight_map, total = {}, 0
            for sp in model.plans:
                for t in sp.tensors:
                    weight_map[t.name] = files[sp.stage]
                    numel = 1
                    for d in t.shape:
                        numel *= d
                    total += numel * torch_dtype(t.dtype).itemsize
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        src = args.tokenizer_dir or meta.get("source_hf_dir")
        if src and Path(src).is_dir():
            for f in Path(src).iterdir():
                if f.is_file() and f.name not in _SKIP and not f.name.endswith(".safetensors"):
                    shutil.copy2(f, out / f.name)
        print(f"convert_mcore_to_hf: {args.ckpt} -> {out} ({layout}) in {time.time() - t0:.1f}s", flush=True)
    destroy_model_parallel(groups)
    dist.barrier()
    if own_world:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 tools/convert_hf_to_mcore.py --hf-dir HF_DIR --out CKPT_DIR --tp 2 --pp 2

Convert an HF checkpoint (safetensors) of any registered family (areal_mega/models/) into an
areal_mega megatron checkpoint (the one format of areal_mega/megatron/checkpoint.py, weights
only) written in the given layout (it loads in any other layout later). Runs on tp * pp * dp
processes (plain ``python`` = one process, TP1 x PP1). Everything is validated -- the HF directory, model_type, every tensor's
shape, the layout against the model -- before the output directory is created; a bad argument
prints one line to stderr and exits 2. The output is staged and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Runnable from the repository root without PYTHONPATH (like the other tools).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "convert_hf_to_mcore"


def _check_args(args: argparse.Namespace) -> None:
    """Everything checkable without a process group (safetensors headers only, no weights)."""
    hf = Path(args.hf_dir)
    if not hf.is_dir():  # before torch is imported: a wrong path fails in a blink
        raise ValueError(f"--hf-dir: {hf} {'is not a directory' if hf.exists() else 'does not exist'}")
    if not (hf / "config.json").is_file():
        raise ValueError(f"--hf-dir: {hf} has no config.json (not an HF model directory)")

    from areal_mega.megatron.model import HFCheckpointReader, MegatronModelConfig
    from areal_mega.models import get_adapter
    from areal_mega.models.base import torch_dtype
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    adapter = get_adapter(hf)
    adapter.check_hf_shapes(adapter.checkpoint_view(HFCheckpointReader(hf)).shape)
    if args.dtype is not None:
        torch_dtype(args.dtype)  # names the choices
    MegatronModelConfig(dtype=args.dtype, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by).validate()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pcfg = ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, virtual_pipeline_parallel=args.vpp,
                       expert_parallel=args.ep, expert_tensor_parallel=args.etp)
    layout = ParallelLayout.build(pcfg, world)
    a = adapter.arch
    layout.check_model(a.num_layers, a.num_heads, a.num_kv_heads)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} exists and is not an empty directory")


def convert(args: argparse.Namespace) -> int:
    _check_args(args)  # cheap checks first, before any process group or file exists
    out = Path(args.out)

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
        ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, virtual_pipeline_parallel=args.vpp,
                       expert_parallel=args.ep, expert_tensor_parallel=args.etp),
        dist.get_world_size(),
    )
    groups = init_model_parallel(layout, backend="gloo")
    cfg = MegatronModelConfig(dtype=args.dtype, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    model = build_model(args.hf_dir, groups, cfg)
    load_hf_weights(model, args.hf_dir)  # validates all shapes before writing any parameter
    save_checkpoint(model, out, source_hf_dir=args.hf_dir)
    if dist.get_rank() == 0:
        print(f"{PROG}: {args.hf_dir} -> {out} ({layout}) in {time.time() - t0:.1f}s", flush=True)
    destroy_model_parallel(groups)
    dist.barrier()
    if own_world:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[2])
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    ap.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the model with")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (MoE; default: --tp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    args = ap.parse_args(argv)
    try:
        return convert(args)
    except (ValueError, OSError) as e:  # bad input, not a bug: one line, no traceback
        print(f"{PROG}: error: " + " ".join(str(e).split()), file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":  # required: dist_checkpointing's save re-imports __main__
    sys.exit(main())

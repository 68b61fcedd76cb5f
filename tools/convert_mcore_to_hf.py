"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tools/convert_mcore_to_hf.py --ckpt CKPT_DIR --out HF_DIR --tp 1 --pp 2

Export an areal_mega megatron checkpoint (any saved layout) as an HF model directory:
safetensors (one file per pipeline stage, plus model.safetensors.index.json when pp > 1),
config.json, and the tokenizer / generation files copied from the HF directory recorded in the
checkpoint (or --tokenizer-dir). ``--ckpt`` is any checkpoint in the one areal_mega format
(areal_mega/megatron/checkpoint.py): a trainer's ``checkpoints/latest`` or ``stepNNNNNN``, an
engine's save, or the output of convert_hf_to_mcore.py. The tensors come from
ModelAdapter.export_hf -- the same code path live weight sync uses. A LoRA checkpoint
(``actor.lora.rank > 0``; docs/lora.md) exports merged weights W + scaling * B A, or with
``--peft`` a PEFT adapter directory naming the checkpoint's base HF directory. The checkpoint and the
layout are validated before the output directory is created; a bad argument prints one line to
stderr and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Runnable from the repository root without PYTHONPATH (like the other tools).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "convert_mcore_to_hf"


def _check_args(args: argparse.Namespace) -> dict:
    """Everything checkable without a process group: the checkpoint's metadata, the layout
    against the model, the output directory. Returns the metadata."""
    from areal_mega.megatron.checkpoint import CheckpointError, read_metadata

    meta = read_metadata(args.ckpt)  # plain Python: a bad --ckpt fails before torch is imported
    if meta["role"] != "policy":
        raise CheckpointError(f"--ckpt: {args.ckpt} holds a {meta['role']} model (value head), which has no "
                              f"HF form; convert the policy checkpoint it belongs to")
    from areal_mega.models import get_adapter
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    arch = get_adapter(meta["hf_config"]).arch
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep,
                                   expert_tensor_parallel=args.etp), world)
    layout.check_model(arch.num_layers, arch.num_heads, arch.num_kv_heads)
    if args.peft and not meta.get("lora"):
        raise ValueError(f"--peft: {args.ckpt} holds no LoRA adapters (actor.lora.rank was 0)")
    if args.tokenizer_dir is not None and not Path(args.tokenizer_dir).is_dir():
        raise ValueError(f"--tokenizer-dir: {args.tokenizer_dir} is not a directory")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} exists and is not an empty directory")
    return meta


def convert(args: argparse.Namespace) -> int:
    _check_args(args)
    from areal_mega.megatron.hf_export import export_checkpoint

    export_checkpoint(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                      tokenizer_dir=args.tokenizer_dir, prog=PROG, peft=args.peft)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[2])
    ap.add_argument("--ckpt", required=True, help="areal_mega checkpoint directory (e.g. a run's checkpoints/latest)")
    ap.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load the checkpoint at")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (MoE; default: --tp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (one safetensors file per stage)")
    ap.add_argument("--tokenizer-dir", default=None, help="copy tokenizer files from here (default: the checkpoint's source HF dir)")
    ap.add_argument("--peft", action="store_true", help="LoRA checkpoints: write a PEFT adapter directory, not merged weights")
    args = ap.parse_args(argv)
    try:
        return convert(args)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError: bad input, not a bug
        print(f"{PROG}: error: " + " ".join(str(e).split()), file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":  # required: dist_checkpointing re-imports __main__
    sys.exit(main())

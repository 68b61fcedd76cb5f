"""Write a megatron model (any TP/PP layout) as an HF checkpoint directory.

The tensors come from the family adapter's ``export_hf`` (the same gather that live weight sync
streams to the servers); each pipeline stage writes its own safetensors shard and rank 0 writes
``config.json``, the shard index and the tokenizer files copied from ``source_dir``.
Collective over all learner ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from areal_mega.megatron.checkpoint import build_model_from_checkpoint, load_checkpoint, read_metadata
from areal_mega.megatron.model import MegatronModel, export_hf_weights
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel, init_process_group_for_script
from areal_mega.models.base import torch_dtype
from areal_mega.parallel import ParallelConfig, ParallelLayout

# Files of the source HF dir that describe weights we are replacing.
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def save_hf_checkpoint(model: MegatronModel, out_dir: str, *, hf_config: dict | None = None,
                       source_dir: str | None = None) -> None:
    out = Path(out_dir)
    groups = model.groups
    layout = groups.layout
    # Rank 0 (stage 0's sender) also writes what megatron does not hold, e.g. a VL checkpoint's vision tower.
    frozen = model.adapter.frozen_hf_tensors(source_dir) if groups.rank == 0 else {}
    if groups.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    pp = layout.pp
    files = ["model.safetensors"] if pp == 1 else [f"model-{s + 1:05d}-of-{pp:05d}.safetensors" for s in range(pp)]
    c = groups.coords
    if layout.exports(groups.rank):  # one replica exports: TP ranks (and expert owners) gather
        from safetensors.torch import save_file

        tensors = {n: t.detach().cpu().contiguous()
                   for n, t in model.adapter.stack_hf(export_hf_weights(model)) if t is not None}
        tensors.update(frozen)
        if c.tp == 0 and c.dp == 0 and c.cp == 0:  # the stage's sender holds every tensor
            save_file(tensors, str(out / files[c.pp]), metadata={"format": "pt"})
    if groups.rank == 0:
        cfg = dict(hf_config if hf_config is not None else model.adapter.hf_config)
        cfg["dtype"] = model.dtype
        cfg["architectures"] = [model.arch.architecture]
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if pp > 1:  # the planner knows every stage's tensors without asking other ranks
            weight_map, total = {}, 0
            for sp in model.plans:
                for t in sp.tensors:
                    weight_map[model.adapter.checkpoint_name(t.name)] = files[sp.stage]
                    numel = 1
                    for d in t.shape:
                        numel *= d
                    total += numel * torch_dtype(t.dtype).itemsize
            weight_map.update({n: files[0] for n in frozen})
            total += sum(t.numel() * t.element_size() for t in frozen.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if source_dir and Path(source_dir).is_dir():
            for f in Path(source_dir).iterdir():
                if f.is_file() and f.name not in _SKIP_FILES and not f.name.endswith((".safetensors", ".bin")):
                    shutil.copy2(f, out / f.name)
    dist.barrier()


__all__ = ["save_hf_checkpoint"]


def export_checkpoint(ckpt: str, out_dir: str, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                      tokenizer_dir: str | None = None, prog: str = "export", peft: bool = False) -> None:
    """A checkpoint in the one areal_mega format (any saved layout) -> an HF directory (a LoRA
    checkpoint: merged weights W + scaling * B A; ``peft``: a PEFT adapter directory instead), loaded at
    ``tp`` x ``pp`` (``ep``/``etp``: expert parallelism of MoE models; collective over the torchrun world, or a world of one formed here). Used by
    tools/convert_mcore_to_hf.py and ``areal-mega eval --model <checkpoint>``."""
    import time


    meta = read_metadata(ckpt)
    own_world = init_process_group_for_script("gloo")  # False when called inside a running world
    t0 = time.time()
    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                                 expert_tensor_parallel=etp), dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo")
    model = build_model_from_checkpoint(ckpt, groups)
    load_checkpoint(model, ckpt)  # checks role, model_type and every shape first
    # The same writer the trainer uses for its final HF export (one shard per stage, index,
    # config.json, tokenizer files from the source HF dir).
    if peft:
        from areal_mega.megatron.lora import save_peft_adapter

        if model.lora is None:
            raise ValueError(f"--peft: {ckpt} holds no LoRA adapters (actor.lora.rank was 0)")
        save_peft_adapter(model, out_dir, meta.get("source_hf_dir"))
    else:
        save_hf_checkpoint(model, out_dir, hf_config=meta["hf_config"],
                           source_dir=tokenizer_dir or meta.get("source_hf_dir"))
    if dist.get_rank() == 0:
        print(f"{prog}: {ckpt} -> {out_dir} ({layout}) in {time.time() - t0:.1f}s", flush=True)
    destroy_model_parallel(groups)
    dist.barrier()
    if own_world:
        dist.destroy_process_group()

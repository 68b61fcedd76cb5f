"""Distributed checkpoints of model weights (megatron dist_checkpointing), loadable in any layout.

    save_checkpoint(model, "ckpt/step_10", step=10, version=10, source_hf_dir=hf_dir)
    model = build_model_from_checkpoint("ckpt/step_10", groups)   # another TP/PP is fine
    load_checkpoint(model, "ckpt/step_10")

On disk: megatron's ``torch_dist`` format (each rank writes its shards, keys are global, so a
TP2 checkpoint loads at PP2) plus ``areal_mega.json`` with the HF config, step, policy version,
dtype and the HF directory the weights came from (tokenizer files are copied from there on
export). Optimizer state is the engine's (it can store it next to these files).

Trap (megatron-core 0.16.1): save starts a spawn-context multiprocessing Manager that re-imports
``__main__``; every script that saves must be guarded by ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from areal_mega.megatron.model import MegatronModel, MegatronModelConfig, build_model
from areal_mega.megatron.parallel_state import ModelParallelGroups

METADATA_FILE = "areal_mega.json"
FORMAT = "areal_mega.mcore_weights.v1"


def _sharded_state_dict(model: MegatronModel) -> dict:
    # Per-chunk sub-dicts: chunk-local names collide under VPP; the on-disk keys are global.
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(model.chunks)}


def save_checkpoint(
    model: MegatronModel,
    path: str | Path,
    *,
    step: int = 0,
    version: int = 0,
    source_hf_dir: str | Path | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save this model's weights (collective over all ranks). ``path`` must not exist or be empty."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    # Every rank checks (raising on rank 0 alone would leave the others waiting in a barrier).
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"checkpoint path {path} is not empty")
    dist.barrier()
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(model), str(path))
    if dist.get_rank() == 0:
        meta = {
            "format": FORMAT,
            "model_type": model.arch.model_type,
            "hf_config": model.adapter.hf_config,
            "dtype": model.dtype,
            "padded_vocab_size": model.padded_vocab_size,
            "step": step,
            "version": version,
            "source_hf_dir": str(Path(source_hf_dir).resolve()) if source_hf_dir else None,
            "saved_layout": str(model.groups.layout),
            **(extra or {}),
        }
        (path / METADATA_FILE).write_text(json.dumps(meta, indent=2))
    dist.barrier()


def read_metadata(path: str | Path) -> dict:
    p = Path(path) / METADATA_FILE
    if not p.exists():
        raise ValueError(f"checkpoint: {p} does not exist (not an areal_mega checkpoint?)")
    meta = json.loads(p.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {p} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def build_model_from_checkpoint(
    path: str | Path, groups: ModelParallelGroups, cfg: MegatronModelConfig | None = None
) -> MegatronModel:
    """Build (randomly initialised) chunks for the HF config recorded in the checkpoint."""
    meta = read_metadata(path)
    cfg = cfg or MegatronModelConfig(dtype=meta["dtype"])
    return build_model(meta["hf_config"], groups, cfg)


def check_compatible(model: MegatronModel, path: str | Path) -> None:
    """Raise ValueError naming the first tensor whose global shape differs from the checkpoint's
    (or that the checkpoint lacks), before anything is loaded."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved = dist_checkpointing.load_tensors_metadata(str(path))
    for sh in nested_values(_sharded_state_dict(model)):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in saved:
            raise ValueError(f"{sh.key}: missing from checkpoint {path}")
        got, want = tuple(saved[sh.key].global_shape), tuple(sh.global_shape)
        if got != want:
            raise ValueError(f"{sh.key}: checkpoint shape {got} != model shape {want}")


def load_checkpoint(model: MegatronModel, path: str | Path) -> dict:
    """Load weights saved by :func:`save_checkpoint` (any layout) into ``model``; returns the
    metadata. Architecture and every tensor shape are checked first."""
    from megatron.core import dist_checkpointing

    meta = read_metadata(path)
    if meta["model_type"] != model.arch.model_type:
        raise ValueError(f"model_type: checkpoint has {meta['model_type']!r}, model is {model.arch.model_type!r}")
    check_compatible(model, path)
    loaded = dist_checkpointing.load(_sharded_state_dict(model), str(path))
    for i, c in enumerate(model.chunks):
        c.load_state_dict(loaded[f"model{i}"], strict=True)
    return meta

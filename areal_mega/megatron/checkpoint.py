"""The one checkpoint format of areal_mega: megatron distributed checkpoints plus ONE metadata file.

    save_checkpoint(model, "ckpt/step_10", step=10, version=10, source_hf_dir=hf_dir)   # weights
    engine.save("ckpt/step_10")                       # + optimizer + LR schedule (same function)
    model = build_model_from_checkpoint("ckpt/step_10", groups)   # another TP/PP is fine
    load_checkpoint(model, "ckpt/step_10")            # weights of either kind

Invariant: ``areal_mega.json`` (one writer, one reader) is written LAST, into a staged
``.<name>.partial`` renamed into place, so a directory without it is incomplete and never loaded.
Fields, resume, traps: docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from areal_mega.errors import UserError

if TYPE_CHECKING:  # torch and megatron load on first use: reading metadata is plain Python
    from areal_mega.megatron.model import MegatronModel, MegatronModelConfig
    from areal_mega.megatron.parallel_state import ModelParallelGroups


class _LazyDist:
    """``torch.distributed``, imported on first use (a tool given a bad --ckpt fails in a blink)."""

    def __getattr__(self, name: str) -> Any:
        import torch.distributed

        return getattr(torch.distributed, name)


dist = _LazyDist()

METADATA_FILE = "areal_mega.json"
"""The metadata file of every areal_mega megatron checkpoint (its presence = complete)."""
FORMAT = "areal_mega.checkpoint.v2"
"""Format version written by :func:`save_checkpoint`."""
LATEST = "latest"
"""Name of the symlink to the newest checkpoint in a run's checkpoint directory."""
_STEP_DIR = re.compile(r"^step(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: the message is one line naming the path and the problem."""


# ---------------------------------------------------------------------- metadata: one writer, one reader
def write_metadata(path: str | Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``path/areal_mega.json`` (temp file + fsync + rename: never half a file).
    The only writer of the metadata file; ``meta`` gets ``format`` = :data:`FORMAT`."""
    path = Path(path)
    meta = {"format": FORMAT, **{k: v for k, v in meta.items() if k != "format"}}
    tmp = path / f".{METADATA_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(meta, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / METADATA_FILE)


def read_metadata(path: str | Path, *, role: str | None = None, training: bool = False) -> dict[str, Any]:
    """The metadata of the checkpoint in directory ``path`` (the only reader of the file).

    Raises :class:`CheckpointError` (one line, naming the path) when ``path`` is missing, is not
    a checkpoint (or an incomplete one: no metadata), has another format version, holds another
    ``role`` than the one given, or (``training``) has no optimizer state."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} is not a directory")
    p = path / METADATA_FILE
    if not p.is_file():
        if (path / LATEST).exists() or any(_STEP_DIR.match(c.name) for c in path.iterdir()):
            raise CheckpointError(f"checkpoint: {path} is a run's checkpoint directory, not a checkpoint; "
                                  f"pass {path / LATEST} or one of its step directories")
        raise CheckpointError(f"checkpoint: {path} has no {METADATA_FILE} (not an areal_mega checkpoint, "
                              f"or an incomplete one)")
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint: {p} is unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint: {p} is not a JSON object")
    fmt = meta.get("format")
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint: {p} has format {fmt!r}; this version of areal_mega reads {FORMAT!r}")
    if role is not None and meta.get("role") != role:
        raise CheckpointError(f"checkpoint: {path} holds a {meta.get('role')} model, not a {role} one")
    if training and "optimizer" not in meta.get("contents", ()):
        raise CheckpointError(f"checkpoint: {path} holds weights only (no optimizer state); it cannot resume training")
    return meta


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a finished checkpoint (its metadata file exists; it is written last)."""
    return (Path(path) / METADATA_FILE).is_file()


# ---------------------------------------------------------------------- atomic directories
def _staging_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


@contextmanager
def staged(path: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """Collective: yields an empty staging directory ``.<name>.partial`` next to ``path``; on a
    clean exit (after a barrier) rank 0 renames it to ``path``, replacing an existing ``path``
    when ``replace``, else refusing (before anything is written) a non-empty one. On an
    exception nothing is renamed; a leftover staging directory is removed by the next save."""
    path = Path(path)
    # Every rank checks (raising on rank 0 alone would leave the others waiting in a barrier).
    if not replace and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError(f"checkpoint: {path} exists and is not empty")
    stage = _staging_dir(path)
    rank0 = dist.get_rank() == 0
    dist.barrier()
    if rank0:
        if stage.exists():
            shutil.rmtree(stage)  # an earlier save that died half-way
        stage.mkdir(parents=True)
    dist.barrier()
    yield stage
    dist.barrier()
    if rank0:
        _commit(stage, path)
    dist.barrier()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(stage: Path, path: Path) -> None:
    """Rank 0: move the finished ``stage`` to ``path``. An existing ``path`` is first renamed
    aside (a crash between the two renames leaves no ``path``, never a mixed one)."""
    old = path.parent / f".{path.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        os.rename(path, old)
    os.rename(stage, path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


# ---------------------------------------------------------------------- save / load
def model_sharded_state_dict(model: MegatronModel) -> dict:
    """The model part of every checkpoint: one sub-dict per chunk (chunk-local names collide
    under VPP; the tensors' on-disk keys are global, so any layout loads them)."""
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(model.chunks)}


def checkpoint_metadata(
    model: MegatronModel,
    *,
    role: str = "policy",
    step: int = 0,
    version: int = 0,
    source_hf_dir: str | Path | None = None,
    train_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The metadata :func:`save_checkpoint` writes for ``model`` (see the module docstring)."""
    if role not in ("policy", "critic"):
        raise ValueError(f"role: {role!r} is not one of policy, critic")
    return {
        "format": FORMAT,
        "role": role,
        "contents": ["model", "optimizer"] if train_state is not None else ["model"],
        "model_type": model.arch.model_type,
        "hf_config": model.adapter.hf_config,
        "dtype": model.dtype,
        "padded_vocab_size": model.padded_vocab_size,
        "layer_spec": model.layer_spec,
        "lora": dataclasses.asdict(model.lora) if model.lora is not None else None,  # base: source_hf_dir
        "source_hf_dir": str(Path(source_hf_dir).resolve()) if source_hf_dir else None,
        "saved_layout": str(model.groups.layout),
        "step": int(step),
        "version": int(version),
        "train_state": train_state,
        "extra": dict(extra or {}),
    }


def save_checkpoint(
    model: MegatronModel,
    path: str | Path,
    *,
    step: int = 0,
    version: int = 0,
    source_hf_dir: str | Path | None = None,
    role: str = "policy",
    optimizer: Callable[[dict], dict] | None = None,
    train_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    atomic: bool = True,
    replace: bool = False,
) -> None:
    """Save ``model`` (collective over all ranks) as a checkpoint in ``path``: the one writer.

    ``optimizer(model_sharded_state_dict) -> sharded optimizer state`` adds optimizer state
    (the engine's); then ``train_state`` (JSON: optimizer step count, LR schedule) is required.
    ``atomic``: write into a staging directory renamed into place at the end (see
    :func:`staged`; ``replace`` = an existing ``path`` is replaced, else it must not exist or be
    empty); ``atomic=False`` writes straight into ``path`` -- for a caller staging a larger
    directory itself (:func:`save_run_checkpoint`)."""
    if (optimizer is None) != (train_state is None):
        raise ValueError("save_checkpoint: optimizer and train_state come together")
    path = Path(path)
    meta = checkpoint_metadata(model, role=role, step=step, version=version, source_hf_dir=source_hf_dir,
                               train_state=train_state, extra=extra)
    if atomic:
        with staged(path, replace=replace) as stage:
            _write(model, stage, meta, optimizer)
    else:
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        _write(model, path, meta, optimizer)


def _write(model: MegatronModel, path: Path, meta: dict, optimizer: Callable[[dict], dict] | None) -> None:
    from megatron.core import dist_checkpointing

    sd = model_sharded_state_dict(model)
    if optimizer is not None:
        sd["optimizer"] = optimizer(dict(sd))
    dist_checkpointing.save(sd, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        write_metadata(path, meta)  # last: its presence marks the checkpoint complete
    dist.barrier()


def build_model_from_checkpoint(
    path: str | Path, groups: ModelParallelGroups, cfg: MegatronModelConfig | None = None
) -> MegatronModel:
    """Build (randomly initialised) chunks for the HF config recorded in the checkpoint, with
    its dtype, layer spec and vocabulary padding (any TP dividing the padded vocab loads it)."""
    from areal_mega.megatron.model import MegatronModelConfig, build_model

    meta = read_metadata(path)
    cfg = cfg or MegatronModelConfig(dtype=meta["dtype"], layer_spec=meta.get("layer_spec") or "auto",
                                     make_vocab_size_divisible_by=int(meta["padded_vocab_size"]))
    model = build_model(meta["hf_config"], groups, cfg)
    if meta.get("lora"):  # a LoRA checkpoint holds the adapters next to the frozen base
        from areal_mega.megatron.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(**meta["lora"]))
    return model


def check_compatible(model: MegatronModel, path: str | Path) -> None:
    """Raise ValueError naming the first tensor whose global shape differs from the checkpoint's
    (or that the checkpoint lacks), before anything is loaded."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved = dist_checkpointing.load_tensors_metadata(str(path))
    for sh in nested_values(model_sharded_state_dict(model)):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in saved:
            raise ValueError(f"{sh.key}: missing from checkpoint {path}")
        got, want = tuple(saved[sh.key].global_shape), tuple(sh.global_shape)
        if got != want:
            raise ValueError(f"{sh.key}: checkpoint shape {got} != model shape {want}")


def _load(model: MegatronModel, path: str | Path, role: str, optimizer: Callable[[dict], dict] | None):
    from megatron.core import dist_checkpointing

    meta = read_metadata(path, role=role, training=optimizer is not None)
    if meta["model_type"] != model.arch.model_type:
        raise ValueError(f"model_type: checkpoint has {meta['model_type']!r}, model is {model.arch.model_type!r}")
    check_compatible(model, path)
    sd = model_sharded_state_dict(model)
    if optimizer is not None:
        sd["optimizer"] = optimizer(dict(sd))
    loaded = dist_checkpointing.load(sd, str(path))
    for i, c in enumerate(model.chunks):
        c.load_state_dict(loaded[f"model{i}"], strict=True)
    return meta, loaded.get("optimizer")


def load_checkpoint(model: MegatronModel, path: str | Path, *, role: str = "policy") -> dict:
    """Load the weights of any checkpoint written by :func:`save_checkpoint` (any layout, with or
    without optimizer state) into ``model``; returns the metadata. Role, architecture and every
    tensor shape are checked first."""
    return _load(model, path, role, None)[0]


def load_training_checkpoint(
    model: MegatronModel, path: str | Path, optimizer: Callable[[dict], dict], *, role: str = "policy"
) -> tuple[dict, dict]:
    """Load weights and optimizer state (one read) of a checkpoint saved with ``optimizer``;
    returns (metadata, the loaded optimizer state dict for ``optimizer.load_state_dict``)."""
    return _load(model, path, role, optimizer)


# ---------------------------------------------------------------------- a run's checkpoint directory
def step_dir_name(step: int) -> str:
    """``step000010``: the name of step ``step``'s checkpoint in a run's checkpoint directory."""
    return f"step{step:06d}"


def update_latest(root: str | Path, target: str | Path) -> None:
    """Point ``root/latest`` at ``target`` (a directory in ``root``): a relative symlink created
    next to it and renamed over it, so ``latest`` is never missing or half-written. Rank 0 only."""
    root = Path(root)
    tmp = root / f".{LATEST}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(Path(target).name)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def find_resume_checkpoint(root: str | Path) -> tuple[Path | None, list[Path]]:
    """(the newest complete ``stepNNNNNN`` checkpoint in ``root`` or None, the incomplete ones
    skipped). ``latest`` is not trusted: it may point at a deleted or unfinished directory.
    Staging (``.*.partial``) directories are never candidates."""
    root = Path(root)
    done: list[tuple[int, Path]] = []
    skipped: list[Path] = []
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.match(d.name)
            if not m or d.is_symlink() or not d.is_dir():
                continue
            (done.append((int(m.group(1)), d)) if is_complete(d) else skipped.append(d))
    return (max(done)[1] if done else None), sorted(skipped)

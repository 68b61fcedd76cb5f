"""The trainer's run state in its checkpoints, beside the engines' (``areal_mega.megatron.checkpoint``).

A run checkpoint ``checkpoints/stepNNNNNN`` = the actor engine's checkpoint, the critic's in
``critic/``, ``run_state.json`` (rank 0: the prompt stream's position and the prompts to give
back, see ``areal_mega.data.PromptStream``) and ``rng/rank<R>.pt`` (every rank: Python, NumPy
and torch generator states), staged and committed as one directory by the engine format's
:func:`~areal_mega.megatron.checkpoint.staged`.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from areal_mega.megatron.checkpoint import METADATA_FILE, find_resume_checkpoint, staged, step_dir_name, update_latest

__all__ = ["RUN_STATE_FILE", "read_rollout_snapshot", "read_run_state", "resume_run", "resume_run_checkpoint",
           "remove_rollout_snapshot", "rng_state", "save_run_checkpoint", "set_rng_state", "write_rollout_snapshot"]


RUN_STATE_FILE = "run_state.json"
"""Rank 0's run state in a trainer checkpoint (prompt stream position, prompts to give back)."""
ROLLOUT_STATE_FILE = "rollout_state.json"
"""The run state's ``rollout`` part (episodes generated, not yet trained), compact: it holds tokens."""
SNAPSHOT_FILE = "rollout_snapshot.json"
"""Beside the checkpoints: the generation side between learner checkpoints
(``trainer.rollout_snapshot_every``, docs/resume.md)."""


def write_rollout_snapshot(root: str | Path, base_step: int, step: int, state: dict[str, Any]) -> int:
    """Rank 0: ``root/rollout_snapshot.json`` = the generation side's state at ``step`` (the
    service's ``checkpoint_state(since_checkpoint=True)``) on top of learner checkpoint
    ``base_step``, written atomically. Returns its bytes."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    data = json.dumps({"base_step": base_step, "step": step, **state}, separators=(",", ":"))
    tmp = root / (SNAPSHOT_FILE + ".tmp")
    tmp.write_text(data)
    os.replace(tmp, root / SNAPSHOT_FILE)
    return len(data)


def read_rollout_snapshot(root: str | Path, base_step: int) -> dict[str, Any] | None:
    """The snapshot taken on top of learner checkpoint ``base_step`` (``prompts`` and
    ``rollout``, to use instead of the checkpoint's), or None: there is none, or it belongs to
    another checkpoint (said in one line)."""
    path = Path(root) / SNAPSHOT_FILE
    if not path.is_file():
        return None
    snap = json.loads(path.read_text())
    if snap.get("base_step") != base_step or snap.get("step", 0) <= base_step:
        print(f"resume: ignoring {path} (taken on checkpoint {snap.get('base_step')}, resuming from {base_step})",
              file=sys.stderr, flush=True)
        return None
    print(f"resume: the generation side continues from {path} (step {snap['step']} on checkpoint {base_step})",
          file=sys.stderr, flush=True)
    return {"prompts": snap.get("prompts"), "rollout": snap.get("rollout")}


def remove_rollout_snapshot(root: str | Path) -> None:
    """After a learner checkpoint (a snapshot is on top of the one before) or on a fresh start."""
    (Path(root) / SNAPSHOT_FILE).unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """This process's generator states: Python, NumPy, torch CPU (and CUDA where present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_run_state(path: str | Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(rank 0's run state or None, this rank's RNG state or None) of a trainer checkpoint
    (None for checkpoints written without them, e.g. converted ones)."""
    path = Path(path)
    run = json.loads((path / RUN_STATE_FILE).read_text()) if (path / RUN_STATE_FILE).is_file() else None
    if run is not None and (path / ROLLOUT_STATE_FILE).is_file():
        run["rollout"] = json.loads((path / ROLLOUT_STATE_FILE).read_text())
    rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return run, rng


def save_run_checkpoint(root: str | Path, step: int, actor: Any, critic: Any = None, *,
                        extra: dict[str, Any] | None = None, run_state: dict[str, Any] | None = None) -> Path:
    """The trainer's checkpoint (collective): ``root/stepNNNNNN`` = the actor engine's checkpoint
    with the critic's in ``critic/``, rank 0's ``run_state`` and every rank's RNG states, staged
    and renamed into place as ONE directory, then ``root/latest`` moved to it.
    ``actor``/``critic``: MegatronTrainEngine (anything with ``save(path, step=, extra=,
    atomic=)``). Returns the checkpoint's path."""
    root = Path(root)
    final = root / step_dir_name(step)
    extra = {**(extra or {}), "critic": "critic" if critic is not None else None}
    with staged(final, replace=True) as stage:
        actor.save(str(stage), step=step, extra=extra, atomic=False)
        if critic is not None:
            critic.save(str(stage / "critic"), step=step, atomic=False)
        # After the engines (megatron refuses a non-empty target); all of it inside the stage,
        # which becomes the checkpoint in one rename.
        if dist.get_rank() == 0:
            (stage / "rng").mkdir(exist_ok=True)
            if run_state is not None:
                run_state = dict(run_state)
                if "rollout" in run_state:
                    (stage / ROLLOUT_STATE_FILE).write_text(json.dumps(run_state.pop("rollout"), separators=(",", ":")))
                (stage / RUN_STATE_FILE).write_text(json.dumps(run_state, indent=1))
        dist.barrier()
        torch.save(rng_state(), stage / "rng" / f"rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        update_latest(root, final)
    dist.barrier()
    return final


def resume_run_checkpoint(root: str | Path, actor: Any, critic: Any = None, *, group: Any = None) -> Path | None:
    """The trainer's resume (collective): rank 0 picks :func:`find_resume_checkpoint` in ``root``
    and tells every rank (over ``group``, which must carry Python objects: gloo), which loads the
    actor (and the critic from its ``critic/``). Returns the loaded path, None when there is
    none (nothing is loaded)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        path, skipped = find_resume_checkpoint(root)
        for s in skipped:
            print(f"resume: skipping {s} (incomplete: no {METADATA_FILE})", file=sys.stderr, flush=True)
        if path is not None:
            print(f"resume: loading {path}", file=sys.stderr, flush=True)
        box[0] = str(path) if path is not None else None
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is None:
        return None
    path = Path(box[0])
    actor.load(str(path))
    if critic is not None:
        critic.load(str(path / "critic"))
    return path


def resume_run(root: str | Path, actor: Any, critic: Any = None, *, group: Any = None) -> tuple[int, dict[str, Any] | None]:
    """The trainer's whole resume (collective): the newest complete checkpoint in ``root`` loaded
    into the engines (:func:`resume_run_checkpoint`), every rank's generators restored. Returns
    (the step to continue from, 0 when there is no checkpoint; rank 0's run state -- ``prompts``:
    the prompt-stream state, ``rollout``: the saved episodes -- or None)."""
    path = resume_run_checkpoint(root, actor, critic, group=group)
    if path is None:
        return 0, None
    run, rng = read_run_state(path)
    if rng is not None:  # every rank continues its generators where the checkpoint left them
        set_rng_state(rng)
    return actor.get_version(), run

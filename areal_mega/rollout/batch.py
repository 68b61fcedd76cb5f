"""Trajectories -> one packed batch of flat tensors, in the learner engine's alignment.

    batch = to_engine_alignment(trajectories_to_batch(rollout_batch.groups))
    batch.update(compute_advantages(batch, cfg.algorithm))     # advantages [T], same alignment

``trajectories_to_batch`` keeps Trajectory's "this-token" alignment; ``to_engine_alignment``
shifts the per-token fields once so they line up with the engine's next-token outputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from areal_mega.api.workflow import Trajectory
from areal_mega.megatron.packing import shift_to_next_token
from areal_mega.algo.advantages import group_index_of


def trajectories_to_batch(trajs: Sequence[Trajectory] | Sequence[Sequence[Trajectory]]) -> dict[str, torch.Tensor]:
    """Trajectories (or groups of them) -> input_ids / loss_mask / versions int64 [T], logprobs
    float32 [T] (behaviour), cu_seqlens [B + 1], rewards float32 [B], group_index int64 [B]
    (dense, in order of first appearance)."""
    trajs = [t for x in trajs for t in (x if isinstance(x, (list, tuple)) else [x])]
    if not trajs:
        raise ValueError("trajectories_to_batch: no trajectories")
    lens = torch.tensor([len(t.input_ids) for t in trajs], dtype=torch.int64)
    cu = torch.zeros(len(trajs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    return {
        "input_ids": torch.tensor([x for t in trajs for x in t.input_ids], dtype=torch.int64),
        "loss_mask": torch.tensor([x for t in trajs for x in t.loss_mask], dtype=torch.int64),
        "logprobs": torch.tensor([x for t in trajs for x in t.logprobs], dtype=torch.float32),
        "versions": torch.tensor([x for t in trajs for x in t.versions], dtype=torch.int64),
        "cu_seqlens": cu,
        "rewards": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        "group_index": group_index_of([t.group_id for t in trajs]),
    }


def to_engine_alignment(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trajectory fields are "this-token" aligned (``logprobs[i]`` is the log-prob *of* token i);
    the engine's outputs are next-token aligned (``out[i]`` predicts token i+1). Shift once here,
    so every per-token tensor the loss and the advantage estimators see shares one alignment
    (GAE/REINFORCE++ then read the reward at the last trained prediction)."""
    cu = batch["cu_seqlens"]
    fills = {"loss_mask": 0, "logprobs": 0.0, "versions": -1}
    return {k: shift_to_next_token(v, cu, fill=fills[k]) if k in fills else v for k, v in batch.items()}


def broadcast_batch(payload: Any, *, src: int, group: Any) -> Any:
    """Send a picklable object (a batch dict of CPU tensors plus stats) from rank ``src`` to
    every rank of ``group`` (use a gloo group: the payload is pickled). Other ranks pass None
    and get ``src``'s object back. Small next to a train step: one batch of token ids."""
    box = [payload if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]

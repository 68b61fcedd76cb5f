"""Trajectories -> one packed batch of flat tensors, in the learner engine's alignment.

    batch = to_engine_alignment(trajectories_to_batch(rollout_batch.groups))
    batch.update(compute_advantages(batch, cfg.algorithm))     # advantages [T], same alignment

``trajectories_to_batch`` keeps Trajectory's "this-token" alignment; ``to_engine_alignment``
shifts the per-token fields once so they line up with the engine's next-token outputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from areal_mega.api.workflow import Trajectory
from areal_mega.batching.packing import shift_to_next_token
from areal_mega.algo.advantages import group_index_of

__all__ = ["broadcast_batch", "split_minibatches", "to_engine_alignment", "trajectories_to_batch"]


def trajectories_to_batch(trajs: Sequence[Trajectory] | Sequence[Sequence[Trajectory]]) -> dict[str, torch.Tensor]:
    """Trajectories (or groups of them) -> input_ids / loss_mask / versions int64 [T], logprobs
    float32 [T] (behaviour), cu_seqlens [B + 1], rewards float32 [B], group_index int64 [B]
    (dense, in order of first appearance). When any trajectory has step rewards, also
    step_rewards float32 [T] (step j's reward on its last generated token, 0 elsewhere) and
    step_mask int64 [T] (1 on those tokens); step-less trajectories have 0 there. With MoE
    routes, routed_experts int16 [T, layers * top_k]."""
    trajs = [t for x in trajs for t in (x if isinstance(x, (list, tuple)) else [x])]
    if not trajs:
        raise ValueError("trajectories_to_batch: no trajectories")
    lens = torch.tensor([len(t.input_ids) for t in trajs], dtype=torch.int64)
    cu = torch.zeros(len(trajs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    batch = {
        "input_ids": torch.tensor([x for t in trajs for x in t.input_ids], dtype=torch.int64),
        "loss_mask": torch.tensor([x for t in trajs for x in t.loss_mask], dtype=torch.int64),
        "logprobs": torch.tensor([x for t in trajs for x in t.logprobs], dtype=torch.float32),
        "versions": torch.tensor([x for t in trajs for x in t.versions], dtype=torch.int64),
        "cu_seqlens": cu,
        "rewards": torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        "group_index": group_index_of([t.group_id for t in trajs]),
    }
    if any(t.step_rewards for t in trajs):
        step_rewards = torch.zeros(int(cu[-1]), dtype=torch.float32)
        step_mask = torch.zeros(int(cu[-1]), dtype=torch.int64)
        for t, start in zip(trajs, cu[:-1].tolist()):
            if not t.step_rewards:
                continue
            gen = [i for i, m in enumerate(t.loss_mask) if m]  # position of each generated token
            pos = torch.tensor([start + gen[e - 1] for e in t.step_ends], dtype=torch.int64)
            step_rewards[pos] = torch.tensor(t.step_rewards, dtype=torch.float32)
            step_mask[pos] = 1
        batch["step_rewards"], batch["step_mask"] = step_rewards, step_mask
    have = [t.routes is not None for t in trajs]
    if any(have):
        if not all(have):
            raise ValueError("routed_experts: some trajectories carry MoE routes and some do not")
        # "this-token" aligned like input_ids (the router of token i), never shifted.
        batch["routed_experts"] = torch.from_numpy(np.concatenate([t.routes for t in trajs]))
    return batch


def to_engine_alignment(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trajectory fields are "this-token" aligned (``logprobs[i]`` is the log-prob *of* token i);
    the engine's outputs are next-token aligned (``out[i]`` predicts token i+1). Shift once here,
    so every per-token tensor the loss and the advantage estimators see shares one alignment
    (GAE/REINFORCE++ then read the reward at the last trained prediction)."""
    cu = batch["cu_seqlens"]
    fills = {"loss_mask": 0, "logprobs": 0.0, "versions": -1, "step_rewards": 0.0, "step_mask": 0}
    return {k: shift_to_next_token(v, cu, fill=fills[k]) if k in fills else v for k, v in batch.items()}


def broadcast_batch(payload: Any, *, src: int, group: Any) -> Any:
    """Send a picklable object (a batch dict of CPU tensors plus stats) from rank ``src`` to
    every rank of ``group`` (use a gloo group: the payload is pickled). Other ranks pass None
    and get ``src``'s object back. Small next to a train step: one batch of token ids."""
    box = [payload if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def split_minibatches(batch: dict[str, torch.Tensor], num_minibatches: int) -> list[dict[str, torch.Tensor]]:
    """Split a packed batch by sequences into ``num_minibatches`` packed batches, keeping every
    group (``group_index``) whole and in order: contiguous runs of groups, cut at the group start
    nearest k/num_minibatches of the sequences (balanced by sequences, as GRPO
    groups are equal-sized). Per-token tensors [T] are gathered, per-sequence ones [B] indexed,
    ``cu_seqlens`` rebuilt; the pieces' sequences in order are the batch's. ``num_minibatches``
    = 1 returns ``[batch]``. Raises ValueError when there are fewer groups than mini-batches."""
    if num_minibatches == 1:
        return [batch]
    cu = batch["cu_seqlens"]
    num_seqs = len(cu) - 1
    gidx = batch["group_index"].tolist() if "group_index" in batch else list(range(num_seqs))
    starts = [i for i in range(num_seqs) if i == 0 or gidx[i] != gidx[i - 1]]  # first sequence of each group
    if len(set(gidx)) != len(starts):
        raise ValueError("split_minibatches: a group's sequences are not contiguous in the batch")
    if len(starts) < num_minibatches:
        raise ValueError(f"algorithm.num_minibatches: {num_minibatches} mini-batches need at least as many "
                         f"groups, the batch has {len(starts)}")
    cuts, j = [0], 0  # cuts: first sequence of each piece; j: index into starts of the last cut
    for k in range(1, num_minibatches):
        target = k * num_seqs / num_minibatches
        # a group start after the last cut that leaves a group for each later piece, nearest the target
        j = min(range(j + 1, len(starts) - (num_minibatches - k) + 1), key=lambda i: abs(starts[i] - target))
        cuts.append(starts[j])
    cuts.append(num_seqs)
    pieces = []
    total = int(cu[-1])
    for a, b in zip(cuts[:-1], cuts[1:]):
        t0, t1 = int(cu[a]), int(cu[b])
        piece = {}
        for k, v in batch.items():
            if k == "cu_seqlens" or not isinstance(v, torch.Tensor):
                continue
            if v.shape[0] == total:
                piece[k] = v[t0:t1]
            elif v.shape[0] == num_seqs:
                piece[k] = v[a:b]
            else:
                raise ValueError(f"split_minibatches: {k!r} has {v.shape[0]} rows: neither {total} tokens "
                                 f"nor {num_seqs} sequences")
        piece["cu_seqlens"] = cu[a:b + 1] - cu[a]
        pieces.append(piece)
    return pieces

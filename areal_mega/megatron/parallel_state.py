"""The ONE place that touches ``megatron.core.parallel_state`` (megatron's global process groups).

megatron-core keeps its process groups in module globals; our code does not. We initialise
them here from a validated :class:`~areal_mega.parallel.ParallelLayout`, check that megatron's
rank grouping agrees with ``ParallelLayout.coords`` (same ``tp-cp-ep-dp-pp`` order), and hand back
a :class:`ModelParallelGroups` that callers pass explicitly to everything that communicates.

    groups = init_model_parallel(layout, backend="gloo", seed=1)
    ...            # build_model(hf_config, groups, ...), engine, weight sync
    destroy_model_parallel(groups)

Re-initialising with another layout in the same process (tests) is supported: destroy first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
import gc
from typing import Any

import torch
import torch.distributed as dist

from areal_mega.megatron import cpu_compat
from areal_mega.megatron.compat import check_megatron_core_version
from areal_mega.parallel import ParallelConfig, ParallelLayout, RankCoords
from areal_mega.utils.distributed import resolve_backend
from areal_mega.utils.procs import free_port


@dataclass
class ModelParallelGroups:
    """Process groups of this rank for one layout. Pass this object, never read globals.

    ``tp``/``pp``/``dp``/``cp`` are this rank's groups along each axis; ``mp`` = tp x pp (x cp);
    ``embd`` = first and last pipeline stage of this rank's pipeline (tied embeddings);
    ``dp_cp`` = data x context parallel (gradient reduction). ``pg_collection`` is megatron's
    own ``ProcessGroupCollection`` holding the same groups, for megatron APIs that take one.
    """

    layout: ParallelLayout
    rank: int
    coords: RankCoords
    backend: str
    tp: Any
    pp: Any
    dp: Any
    cp: Any
    mp: Any
    embd: Any
    dp_cp: Any
    pg_collection: Any = field(repr=False)
    ep: Any = None
    """Expert-parallel group (MoE layers): the ranks holding different experts of one stage."""
    etp: Any = None
    """Expert tensor-parallel group (the ranks splitting one expert's matrices)."""
    edp: Any = None
    """Expert data-parallel group (replicas of the same experts; expert gradient reduction)."""
    cpu_compat: bool = False
    """True when the CPU compatibility layer is active (no CUDA)."""

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1


def init_model_parallel(
    layout: ParallelLayout, *, backend: str = "gloo", seed: int = 1234, timeout_minutes: int = 30
) -> ModelParallelGroups:
    """Initialise megatron's model-parallel state for ``layout`` on this rank.

    Requires ``torch.distributed`` to be initialised (by torchrun / our launcher) with
    ``world_size == layout.world_size``; ``backend`` ("gloo" on CPU, "nccl" on GPU) names the
    default group's backend and is recorded for callers. Seeds megatron's RNG tracker so that TP
    ranks draw different dropout masks inside TP regions and the same ones outside.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")
    if not dist.is_initialized():
        raise ValueError("torch.distributed must be initialised before init_model_parallel")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"parallel layout: layout.world_size({layout.world_size}) != "
            f"torch.distributed world_size({dist.get_world_size()})"
        )
    check_megatron_core_version()
    compat = cpu_compat.apply()
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if mps.model_parallel_is_initialized():
        raise ValueError("megatron model parallel state is already initialised: destroy it first")
    mps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_minutes,
        order="tp-cp-ep-dp-pp",
    )
    if compat:
        cpu_compat.install_rng_tracker()  # fresh tracker per layout (seeds are re-added below)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    rank = dist.get_rank()
    groups = ModelParallelGroups(
        layout=layout,
        rank=rank,
        coords=layout.coords(rank),
        backend=backend,
        tp=mps.get_tensor_model_parallel_group(),
        pp=mps.get_pipeline_model_parallel_group(),
        dp=mps.get_data_parallel_group(),
        cp=mps.get_context_parallel_group(),
        mp=mps.get_model_parallel_group(),
        embd=mps.get_embedding_group(check_initialized=False),
        dp_cp=mps.get_data_parallel_group(with_context_parallel=True),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        cpu_compat=compat,
        ep=mps.get_expert_model_parallel_group(),
        etp=mps.get_expert_tensor_parallel_group(),
        edp=mps.get_expert_data_parallel_group(),
    )
    _check_rank_order(groups)
    return groups


def _check_rank_order(g: ModelParallelGroups) -> None:
    """Internal invariant: megatron's groups contain exactly the ranks ParallelLayout predicts."""
    lay, c = g.layout, g.coords
    expect = {
        "tp": [lay.rank(dp=c.dp, pp=c.pp, cp=c.cp, tp=t) for t in range(lay.tp)],
        "pp": [lay.rank(dp=c.dp, pp=p, cp=c.cp, tp=c.tp) for p in range(lay.pp)],
        "dp": [lay.rank(dp=d, pp=c.pp, cp=c.cp, tp=c.tp) for d in range(lay.dp)],
        "cp": [lay.rank(dp=c.dp, pp=c.pp, cp=x, tp=c.tp) for x in range(lay.cp)],
    }
    e = dict(pp=c.pp, edp=c.edp, ep=c.ep, etp=c.etp)
    expect["ep"] = [lay.expert_rank(**{**e, "ep": x}) for x in range(lay.ep)]
    expect["etp"] = [lay.expert_rank(**{**e, "etp": x}) for x in range(lay.etp)]
    expect["edp"] = [lay.expert_rank(**{**e, "edp": x}) for x in range(lay.edp)]
    for axis, ranks in expect.items():
        got = dist.get_process_group_ranks(getattr(g, axis))
        assert sorted(got) == ranks, f"{axis} group {got} != ParallelLayout's {ranks} ({lay})"


def destroy_model_parallel(groups: ModelParallelGroups | None = None) -> None:
    """Tear down megatron's model-parallel state and destroy its process groups; the default
    group stays up. Collective over the world (a barrier first).

    megatron's own ``destroy_model_parallel`` only drops its references: c10d keeps every group
    alive, and each gloo group its connection threads. A process that re-initialises per
    layout (the layout tests) grew to ~1,500 threads per rank and drove this 2-core machine's
    load to ~1,000 (tests/test_parallel_state_groups.py counts them)."""
    from megatron.core import parallel_state as mps

    found: dict[int, Any] = {}

    def collect(v: Any) -> None:
        if isinstance(v, dist.ProcessGroup):
            found[id(v)] = v
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)

    for v in list(vars(mps).values()):
        collect(v)
    if groups is not None:
        collect(list(vars(groups).values()))
    world = dist.group.WORLD
    dist.barrier()
    mps.destroy_model_parallel()
    known = dist.distributed_c10d._world.pg_map  # c10d's registry: what a destroy can release
    for g in found.values():
        if g is not world and g in known:
            dist.destroy_process_group(g)
    found.clear()
    gc.collect()  # a gloo group's threads end when its last reference goes (cycles: megatron's objects)


def tp_all_gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Concatenate every TP rank's shard of ``tensor`` along ``dim`` (rank order)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def init_process_group_for_script(backend: str = "gloo") -> bool:
    """Join the torchrun world (RANK/WORLD_SIZE/MASTER_* set by torchrun), or, when the script was
    started as a plain ``python`` process, form a world of one on a free local port. Returns
    False (and does nothing) when a default group already exists, so tools can run in-process."""

    if dist.is_initialized():
        return False
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        return True
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return True


def init_learner(parallel: ParallelConfig, *, backend: str = "auto", seed: int = 1) -> tuple[ModelParallelGroups, Any]:
    """The one distributed start of a learner process (trainer, sft, tools): join the torchrun
    world (or form a world of one, :func:`init_process_group_for_script`), pin this rank's GPU,
    build the validated layout and megatron's groups. Returns (groups, ctrl): ``ctrl`` carries
    Python objects (batches, URLs), so it is gloo even when the learners use NCCL."""
    import os

    backend = resolve_backend(backend)
    init_process_group_for_script(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # torchrun's local rank
    layout = ParallelLayout.build(parallel, dist.get_world_size())
    groups = init_model_parallel(layout, backend=backend, seed=seed)
    ctrl = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
    return groups, ctrl

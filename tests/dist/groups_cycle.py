"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/groups_cycle.py --work-dir W --out R.json

Threads of this rank across CYCLES init_model_parallel / destroy_model_parallel round trips (TP2,
then TP1 x DP2: the layout tests' pattern), with areal_mega's destroy and, as the control, with
megatron's own destroy only (which keeps every gloo group, and its threads, alive)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from areal_mega.parallel import ParallelConfig, ParallelLayout
from tests.support.dist import finish

CYCLES = 6


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def cycles(destroy) -> int:
    """Threads added by cycles 3..CYCLES (the first two settle torch's lazily started pools and
    leave the last cycle's objects referenced): a leak grows with every cycle, a bounded count not."""
    for i in range(CYCLES):
        if i == 2:
            before = threads()
        lay = ParallelLayout.build(ParallelConfig(tensor_parallel=2 if i % 2 == 0 else 1), dist.get_world_size())
        groups = init_model_parallel(lay, backend="gloo")
        dist.all_reduce(torch.ones(1), group=groups.tp)  # the groups are used, as in a test
        destroy(groups)
        del groups
    return threads() - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mps

    ours = cycles(destroy_model_parallel)
    megatron_only = cycles(lambda g: mps.destroy_model_parallel())
    finish({"cycles": CYCLES, "threads_added_ours": ours, "threads_added_megatron_only": megatron_only}, args.out)


if __name__ == "__main__":
    main()

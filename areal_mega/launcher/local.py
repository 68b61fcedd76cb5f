"""The plan on this one machine, without Slurm (what ``make demo`` uses).

Processes are started and stopped as trees by ``areal_mega.utils.procs`` (see ``LocalRunner``).
"""

from __future__ import annotations

import os
import subprocess

from areal_mega.launcher.plan import Allocation, ProcSpec
from areal_mega.launcher.supervisor import Runner
from areal_mega.utils import procs

__all__ = ["LocalRunner", "local_allocation"]


def local_allocation(gpus: int = 0, cpus: int | None = None) -> Allocation:
    return Allocation(job_id="local", nodes=("localhost",), addresses=("127.0.0.1",),
                      gpus_per_node=gpus, cpus_per_node=cpus or os.cpu_count(), local=True)


class LocalRunner(Runner):
    """Each process is its own tree (``areal_mega.utils.procs``): its own session, behind the
    die-with-parent wrapper, so a launcher killed with SIGKILL leaves no engine or learner rank
    behind; stopping it stops the tree (torchrun's ranks included) by recorded ids."""

    def start(self, spec: ProcSpec, log) -> subprocess.Popen:
        env = dict(os.environ, **spec.env)
        if spec.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpu_ids))
        return procs.spawn(spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, started: list[subprocess.Popen], grace_s: float) -> None:
        procs.stop_tree(started, grace_s)

"""The plan on this one machine, without Slurm (what ``make demo`` uses).

Each process is started in its own session, so its process-group id is its PID: stopping it
signals the whole group (SGLang's scheduler and detokenizer processes) by that recorded id --
never by name. torchrun's ranks run in sessions of their own: the SIGTERM reaches torchrun's
agent, which stops them, so the SIGKILL after the grace period is the last resort only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from areal_mega.launcher.plan import Allocation, ProcSpec
from areal_mega.launcher.supervisor import Runner


def run_local(config: str, overrides: list[str], *, dry_run: bool = False,
              engine_python: str | None = None, gpus: int | None = None) -> int:
    """``areal-mega launch``: the plan of ``config`` on this machine; returns the exit code."""
    from areal_mega.launcher.cli import run

    return run("local", config, overrides, dry_run=dry_run, engine_python=engine_python, gpus_per_node=gpus)


def local_allocation(gpus: int = 0, cpus: int | None = None) -> Allocation:
    return Allocation(job_id="local", nodes=("localhost",), addresses=("127.0.0.1",),
                      gpus_per_node=gpus, cpus_per_node=cpus or os.cpu_count(), local=True)


class LocalRunner(Runner):
    def start(self, spec: ProcSpec, log) -> subprocess.Popen:
        env = dict(os.environ, **spec.env)
        if spec.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpu_ids))
        return subprocess.Popen(list(spec.argv), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self, procs: list[subprocess.Popen], grace_s: float) -> None:
        groups = [p.pid for p in procs]
        _signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
            for p in procs:
                p.poll()  # reap the leaders so their group ids can disappear
            time.sleep(0.1)
        _signal_groups([g for g in groups if _group_alive(g)], signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _signal_groups(pgids: list[int], sig: int) -> None:
    for g in pgids:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False

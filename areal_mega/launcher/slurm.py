"""The plan inside a Slurm allocation: every process is one ``srun`` job step on its node.

The allocation comes from the batch environment Slurm documents: SLURM_JOB_ID,
SLURM_JOB_NODELIST (expanded in Python: :func:`expand_nodelist`), SLURM_GPUS_ON_NODE and
SLURM_CPUS_ON_NODE. Steps are named ``am-<job>-<process>``; stopping one sends SIGTERM to its
srun (srun then cancels the step: SIGTERM to the tasks, SIGKILL after KillWait), and any step
still listed afterwards is ``scancel``-ed by its step id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from areal_mega.launcher.plan import Allocation, ProcSpec
from areal_mega.launcher.supervisor import Runner

__all__ = ["STEP_PREFIX", "SrunRunner", "expand_nodelist", "slurm_allocation"]

STEP_PREFIX = "am-"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm hostlist -> names, in Python (no ``scontrol``, no Slurm configuration: a dry run
    works on a laptop): ``gpu[001-003,7]`` -> gpu001 gpu002 gpu003 gpu007 (zero padding kept),
    several bracket groups multiply (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), commas outside
    brackets separate entries. Raises ValueError naming the list on bad syntax."""
    def split_top(text: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in text:
            if ch == "[":
                depth += 1
            elif ch == "]":
                depth -= 1
                if depth < 0:
                    raise ValueError(f"nodelist {nodelist!r}: unbalanced ']'")
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if depth:
            raise ValueError(f"nodelist {nodelist!r}: unbalanced '['")
        return parts + [cur]

    def ranges(body: str) -> list[str]:
        out = []
        for item in body.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"nodelist {nodelist!r}: bad range {item!r}")
            if not hi:
                out.append(lo)
                continue
            if int(hi) < int(lo):
                raise ValueError(f"nodelist {nodelist!r}: range {item!r} runs backwards")
            out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
        return out

    names: list[str] = []
    for entry in split_top(nodelist.strip()):
        entry = entry.strip()
        if not entry:
            continue
        expanded = [""]
        rest = entry
        while rest:
            i = rest.find("[")
            if i < 0:
                expanded = [e + rest for e in expanded]
                break
            j = rest.index("]", i)
            expanded = [e + rest[:i] + r for e in expanded for r in ranges(rest[i + 1:j])]
            rest = rest[j + 1:]
        names += expanded
    if not names:
        raise ValueError(f"nodelist {nodelist!r}: no node names")
    return names


def _gpus_from_env(env: dict[str, str]) -> int:
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    per_node = env.get("SLURM_GPUS_PER_NODE", "")  # "8" or "gpu:8" or "h100:8"
    if per_node:
        return int(per_node.rsplit(":", 1)[-1])
    return 0


def _cpus_from_env(env: dict[str, str]) -> int | None:
    v = env.get("SLURM_CPUS_ON_NODE", "")
    return int(v) if v.isdigit() else None


def slurm_allocation(env: dict[str, str] | None = None, *, nodelist: str | None = None,
                     gpus_per_node: int | None = None, job_id: str | None = None,
                     resolve: bool = True) -> Allocation:
    """The current allocation; explicit arguments (for --dry-run outside a job) take precedence.
    ``resolve=False`` (dry runs) keeps node names as their addresses: no DNS lookups."""
    env = dict(os.environ) if env is None else env
    nodelist = nodelist or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST unset): submit with sbatch, "
            "or pass --nodelist (and --gpus-per-node) for a dry run"
        )
    nodes = expand_nodelist(nodelist)
    addresses = [] if resolve else list(nodes)
    for n in (nodes if resolve else ()):
        try:
            addresses.append(socket.gethostbyname(n))
        except OSError as e:
            raise ValueError(f"node {n!r} of the allocation does not resolve: {e}") from None
    gpus = gpus_per_node if gpus_per_node is not None else _gpus_from_env(env)
    return Allocation(job_id=job_id or env.get("SLURM_JOB_ID", "dryrun"), nodes=tuple(nodes),
                      addresses=tuple(addresses), gpus_per_node=gpus, cpus_per_node=_cpus_from_env(env))


class SrunRunner(Runner):
    def __init__(self, job_id: str, srun_args: list[str]) -> None:
        self.job_id = job_id
        self.srun_args = list(srun_args)

    def step_name(self, spec: ProcSpec) -> str:
        return f"{STEP_PREFIX}{self.job_id}-{spec.name}"

    def srun_argv(self, spec: ProcSpec) -> list[str]:
        argv = ["srun", f"--job-name={self.step_name(spec)}", "--nodes=1", "--ntasks=1",
                f"--nodelist={spec.node}", "--kill-on-bad-exit=1", "--export=ALL", "--unbuffered"]
        if spec.num_gpus:
            argv.append(f"--gres=gpu:{spec.num_gpus}")
        if spec.cpus:
            # Several steps share this node: give each its share instead of the whole node
            # (a whole-node step would keep the next one pending).
            argv += ["--exact", f"--cpus-per-task={spec.cpus}"]
        return argv + self.srun_args + list(spec.argv)

    def start(self, spec: ProcSpec, log) -> subprocess.Popen:
        env = dict(os.environ, **spec.env)
        return subprocess.Popen(self.srun_argv(spec), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def stop(self, procs: list[subprocess.Popen], grace_s: float) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()  # the step itself is scancel-ed in cleanup()
                p.wait()

    def our_steps(self) -> list[str]:
        """Step ids (job.step) of this launch's steps still known to Slurm."""
        r = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"],
                           capture_output=True, text=True, timeout=30)
        steps = []
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].startswith(f"{STEP_PREFIX}{self.job_id}-"):
                steps.append(parts[0])
        return steps

    def cleanup(self) -> None:
        for _ in range(3):
            steps = self.our_steps()
            if not steps:
                return
            subprocess.run(["scancel", *steps], capture_output=True, timeout=30)
            time.sleep(1.0)

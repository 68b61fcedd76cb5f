"""A real Slurm cluster of N virtual nodes on this one machine, for launch tests and CPU demos.

    python slurm/local_cluster.py up --nodes 16 --gpus-per-node 8 --dir /tmp/am-slurm
    SLURM_CONF=/tmp/am-slurm/slurm.conf sbatch launch/grpo_70b.sh --dry-run
    python slurm/local_cluster.py down --dir /tmp/am-slurm

What ``up`` does (Debian's slurm-wlm 22.05 + munge, as root, no systemd, no cgroups):

* installs ``slurm-wlm`` and ``munge`` with apt if ``slurmctld`` is missing (a policy-rc.d that
  exits 101 keeps apt from starting the packaged daemons; it is removed again if we created it);
* writes ``slurm.conf`` / ``gres.conf`` into ``--dir`` for nodes ``amnode1..N``, each with its own
  slurmd port and address ``127.0.1.K`` (added to /etc/hosts, because Slurm and torchrun resolve
  node names), ``G`` fake GPUs per node backed by character devices (``mknod c 195 N``: Slurm
  rejects plain files as GRES devices);
* starts one munged (private socket), one slurmctld and one ``slurmd -N amnodeK`` per node, each
  slurmd in its own UTS namespace (``unshare --uts``) so ``hostname`` inside a job is the node's
  name, as on a real cluster; all of them in the foreground so their PIDs are ours to record;
* waits until every node is idle (about 3-10 s here).

``down`` cancels the cluster's jobs, waits for their steps to end, then stops the daemons by the
PIDs recorded in ``<dir>/pids.json`` (never by name). All virtual nodes share one network
namespace: servers in jobs must bind their node's address (127.0.1.K), not 0.0.0.0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":  # run as a script: the package lives beside this folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_mega.utils import procs  # noqa: E402

NODE_PREFIX = "amnode"
HOSTS_FILE = Path("/etc/hosts")
HOSTS_TAG = "# areal_mega local slurm cluster"
# Pending reasons that never clear on a fixed cluster (a job asking for more than exists).
NEVER_STARTS = {"PartitionNodeLimit", "BadConstraints", "PartitionConfig"}


class ClusterUnavailable(RuntimeError):
    """Slurm cannot be installed or started here (the caller may skip, naming this reason)."""


def ensure_installed(timeout_s: float = 600) -> None:
    """Install slurm-wlm + munge with apt when slurmctld is missing; raise ClusterUnavailable if apt fails."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("slurm-wlm is not installed and installing it needs root")
    policy = Path("/usr/sbin/policy-rc.d")
    created_policy = not policy.exists()
    if created_policy:  # keeps apt's postinst from starting slurmctld/munge as services
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if r.returncode != 0:
                raise ClusterUnavailable(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterUnavailable(f"apt-get could not install slurm-wlm/munge: {e}") from None
    finally:
        if created_policy:
            policy.unlink(missing_ok=True)
    if not shutil.which("slurmctld"):
        raise ClusterUnavailable("apt-get finished but slurmctld is still not on PATH")


@dataclass
class LocalSlurmCluster:
    """N virtual Slurm nodes on this host. ``up()`` / ``down()``; ``env`` is what clients need."""

    root: Path
    """Directory holding slurm.conf, state, logs, fake GPU devices and pids.json."""
    num_nodes: int = 4
    """Virtual nodes amnode1..N (addresses 127.0.1.1..N). Up to 16 were tried on 2 cores."""
    gpus_per_node: int = 0
    """Fake GPUs per node (GRES gpu backed by character devices); 0 = CPU-only nodes."""
    cpus_per_node: int = 16
    """CPUs each node declares (more than exist is fine: SlurmdParameters=config_overrides)."""
    uts_hostnames: bool = True
    """Run each slurmd under ``unshare --uts`` with the node's name as hostname."""
    pids: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        if not 1 <= self.num_nodes <= 250:
            raise ValueError(f"num_nodes: must be in [1, 250], got {self.num_nodes}")

    # --- public -------------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"{NODE_PREFIX}{k}" for k in range(1, self.num_nodes + 1)]

    @property
    def conf_path(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, squeue, scontrol) talking to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf_path))

    def up(self, timeout_s: float = 60) -> "LocalSlurmCluster":
        """Install if needed, write configs, start daemons, wait until all nodes are idle."""
        ensure_installed()
        if (self.root / "pids.json").exists():
            raise RuntimeError(f"{self.root}/pids.json exists: a cluster may be running there; run down first")
        for sub in ("state", "log", "spool", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._add_hosts()
        self._make_fake_gpus()
        ctld_port, munge_dummy, *slurmd_ports = procs.service_ports(self.num_nodes + 2, "")
        del munge_dummy
        self._write_conf(ctld_port, slurmd_ports)
        try:
            self._start_daemons()
            self._wait_idle(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self, timeout_s: float = 30) -> None:
        """Cancel all jobs, wait for them to end, then stop the daemons by recorded PID."""
        pid_file = self.root / "pids.json"
        if not self.pids and pid_file.exists():
            self.pids = json.loads(pid_file.read_text())
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"]):
            self.run(["scancel", "--full", "--user=root"], check=False, timeout=10)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        # slurmds first (they end their steps' stepds), then the controller, munge last.
        order = sorted(self.pids, key=lambda n: (n == "munged", n == "slurmctld"))
        for name in order:
            procs.stop_pids([self.pids[name]])
        self.pids = {}
        pid_file.unlink(missing_ok=True)

    def run(self, cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sbatch(self, args: list[str], cwd: str | Path | None = None, env: dict[str, str] | None = None) -> int:
        """Submit a batch job; returns its id."""
        full_env = dict(self.env, **(env or {}))
        r = subprocess.run(["sbatch", "--parsable", *args], env=full_env, cwd=cwd,
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def job_fields(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (Slurm keeps a job ~MinJobAge = 5 min after it ends)."""
        # A busy slurmctld occasionally drops a client connection (scontrol then dies of SIGPIPE,
        # returncode -13); a poll is idempotent, so retry a few times before giving up.
        for _ in range(5):
            r = self.run(["scontrol", "show", "job", str(job_id)], check=False)
            if r.returncode == 0:
                return dict(tok.split("=", 1) for tok in r.stdout.split() if "=" in tok)
            time.sleep(1.0)
        raise RuntimeError(f"scontrol show job {job_id} failed ({r.returncode}): {r.stderr.strip()}")

    def job_state(self, job_id: int) -> tuple[str, str]:
        """(JobState, ExitCode), e.g. ("FAILED", "2:0")."""
        fields = self.job_fields(job_id)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait_job(self, job_id: int, timeout_s: float) -> tuple[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING (``sbatch --wait`` returns late)."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job_fields(job_id)
            state, code = fields.get("JobState", "?"), fields.get("ExitCode", "?")
            if state == "PENDING" and fields.get("Reason") in NEVER_STARTS:
                self.run(["scancel", str(job_id)], check=False)
                raise RuntimeError(f"job {job_id} can never start here (Reason={fields['Reason']}; "
                                   f"this cluster has {self.num_nodes} nodes); cancelled")
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return state, code
            if time.monotonic() > deadline:
                self.run(["scancel", str(job_id)], check=False)
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s} s (cancelled)")
            time.sleep(0.5)

    # --- internals ----------------------------------------------------------------------------
    def _addr(self, k: int) -> str:
        return f"127.0.1.{k}"

    def _add_hosts(self) -> None:
        """Make amnodeK resolve to 127.0.1.K (Slurm and torchrun look node names up)."""
        text = HOSTS_FILE.read_text()
        have = {ln.split()[1] for ln in text.splitlines() if len(ln.split()) >= 2 and not ln.startswith("#")}
        missing = [f"{self._addr(k)} {n}" for k, n in enumerate(self.node_names, 1) if n not in have]
        if missing:
            with HOSTS_FILE.open("a") as f:
                f.write("".join(f"{ln}  {HOSTS_TAG}\n" for ln in missing))

    def _make_fake_gpus(self) -> None:
        for i in range(self.gpus_per_node):
            dev = self.root / "dev" / f"nvidia{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR

    def _write_conf(self, ctld_port: int, slurmd_ports: list[int]) -> None:
        r, host = self.root, socket.gethostname()
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        node_lines = []
        for k, (name, port) in enumerate(zip(self.node_names, slurmd_ports), 1):
            hostname = name if self.uts_hostnames else host
            node_lines.append(
                f"NodeName={name} NodeHostname={hostname} NodeAddr={self._addr(k)} Port={port} "
                f"CPUs={self.cpus_per_node} RealMemory=1000{gres} State=UNKNOWN"
            )
        conf = f"""# Written by slurm/local_cluster.py: {self.num_nodes} virtual nodes on {host}.
ClusterName=areal_mega_local
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
# No systemd/cgroups in these containers: track processes by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Declare more CPUs than the host has (virtual nodes share 2 cores).
SlurmdParameters=config_overrides
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Without a 1 s backfill interval heterogeneous jobs wait ~16 s to start.
SchedulerParameters=bf_interval=1
SchedulerType=sched/backfill
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
GresTypes=gpu
{chr(10).join(node_lines)}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        self.conf_path.write_text(conf)
        gres_lines = ""
        if self.gpus_per_node:
            files = f"{r}/dev/nvidia[0-{self.gpus_per_node - 1}]"
            gres_lines = f"NodeName={NODE_PREFIX}[1-{self.num_nodes}] Name=gpu File={files}\n"
        (r / "gres.conf").write_text(gres_lines)
        # Clients still read the plugstack file next to slurm.conf; an empty one keeps them quiet.
        (r / "plugstack.conf").write_text("")

    def _popen(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        log.close()
        self.pids[name] = proc.pid
        (self.root / "pids.json").write_text(json.dumps(self.pids))

    def _start_daemons(self) -> None:
        r = self.root
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        self._popen("munged", ["munged", "--foreground", "--force", f"--socket={r}/munge.socket",
                               f"--pid-file={r}/munged.pid", f"--log-file={r}/log/munged.log",
                               f"--seed-file={r}/munged.seed"])
        _wait_for(lambda: (r / "munge.socket").exists(), 10, "munged socket")
        self._popen("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf_path)])
        for name in self.node_names:
            slurmd = ["slurmd", "-D", "-N", name, "-f", str(self.conf_path)]
            if self.uts_hostnames:
                # unshare execs sh which execs slurmd: the recorded PID is slurmd's own.
                slurmd = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name, *slurmd]
            self._popen(f"slurmd.{name}", slurmd)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name, pid in self.pids.items():
                if not _alive(pid):
                    tail = _tail(self.root / "log" / f"{name}.out")
                    raise ClusterUnavailable(f"{name} (pid {pid}) exited during start-up:\n{tail}")
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10)
            last = r.stdout + r.stderr
            states = [ln.split()[1] for ln in r.stdout.splitlines() if len(ln.split()) == 2]
            if r.returncode == 0 and len(states) == self.num_nodes and all(s == "idle" for s in states):
                return
            time.sleep(0.3)
        raise ClusterUnavailable(f"nodes not idle after {timeout_s} s; last sinfo:\n{last}")


def _alive(pid: int) -> bool:
    return bool(procs.alive([pid]))


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise ClusterUnavailable(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and print the SLURM_CONF to export")
    up.add_argument("--dir", required=True)
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--gpus-per-node", type=int, default=0)
    up.add_argument("--cpus-per-node", type=int, default=16)
    up.add_argument("--no-uts", action="store_true", help="do not give each slurmd its own hostname")
    down = sub.add_parser("down", help="stop the cluster started in --dir")
    down.add_argument("--dir", required=True)
    args = p.parse_args(argv)
    if args.cmd == "up":
        t0 = time.monotonic()
        c = LocalSlurmCluster(Path(args.dir), args.nodes, args.gpus_per_node, args.cpus_per_node,
                              uts_hostnames=not args.no_uts).up()
        print(f"export SLURM_CONF={c.conf_path}   # {c.num_nodes} nodes idle after "
              f"{time.monotonic() - t0:.1f} s; stop with: {sys.argv[0]} down --dir {args.dir}")
    else:
        LocalSlurmCluster(Path(args.dir)).down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

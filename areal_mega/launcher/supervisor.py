"""Run a :class:`LaunchPlan`: engines first, learners once engines are up, then watch.

    start engines -> wait for every address file -> engines.json -> start learners (torchrun per node)
    poll: a learner node fails -> stop everything, exit non-zero; all learners exit 0 -> stop engines, 0;
          an engine's process exits -> stop its whole server, restart it
          (inference.client.max_restarts), else log it, go on; SIGUSR1 / SIGTERM -> stop file, grace, EXIT_REQUEUE (75)

Whatever happens, every started process is stopped through the :class:`Runner` (srun steps or
local process groups) before ``supervise`` returns. The full loop: docs/launch.md ("The pieces").
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from areal_mega.launcher.plan import LaunchPlan, ProcSpec
from areal_mega.utils.logs import attempt_tail, open_attempt

__all__ = ["EXIT_REQUEUE", "Runner", "failed_rank_report", "supervise", "tail"]


class Runner(ABC):
    """Starts a :class:`ProcSpec` somewhere and stops what it started."""

    @abstractmethod
    def start(self, spec: ProcSpec, log) -> subprocess.Popen:
        """Start ``spec`` with stdout/stderr going to the open file ``log``."""

    @abstractmethod
    def stop(self, procs: list[subprocess.Popen], grace_s: float) -> None:
        """Stop every process in ``procs`` (and everything it started): TERM, grace, KILL."""

    def cleanup(self) -> None:
        """Last resort after stop(), e.g. cancel job steps whose srun could not be stopped."""


EXIT_REQUEUE = 75
"""The launcher's exit code after a checkpoint-and-stop on SIGUSR1/SIGTERM (EX_TEMPFAIL): run it
again (launch/*.sh: ``scontrol requeue``) and the trainer resumes from that checkpoint."""


class _Stop(Exception):
    """Raised from the signal handler so that the finally-block stops everything."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def tail(path: str | Path, n: int) -> str:
    """The last ``n`` lines of the log's current attempt (``areal_mega.utils.logs``)."""
    return attempt_tail(path, n)


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                         re.S)


def failed_rank_report(spec: ProcSpec, rc: int, lines: int) -> str:
    """The failed rank's identity and log tail, from torchrun's "Root Cause" summary.

    torchrun (2.x) prints "rank : R (local_rank: r)" for the first failed worker and keeps that
    worker's output in <log-dir>/<run>/attempt_*/<r>/std{err,out}.log. Falls back to the node log.
    """
    log_text = tail(spec.log_path, 10**6)
    m = _ROOT_CAUSE.search(log_text)
    head = f"learner node {spec.node_rank} ({spec.name} on {spec.node}) exited with {rc}"
    if not m:
        return f"{head}; last {lines} lines of {spec.log_path}:\n{tail(spec.log_path, lines)}"
    rank, local_rank, code = int(m.group(1)), int(m.group(2)), int(m.group(3))
    rank_dir = Path(spec.log_path).with_suffix(".ranks")
    parts = [f"{head}: learner rank {rank} (local rank {local_rank}) failed with exit code {code}"]
    found = False
    for stream in ("stderr", "stdout"):
        candidates = sorted(rank_dir.glob(f"*/attempt_*/{local_rank}/{stream}.log"),
                            key=lambda p: p.stat().st_mtime)
        if candidates:
            found = True
            parts.append(f"--- rank {rank} {stream}, last {lines} lines ({candidates[-1]}):")
            parts.append(tail(candidates[-1], lines))
    if not found:
        parts.append(f"--- last {lines} lines of {spec.log_path}:\n{tail(spec.log_path, lines)}")
    return "\n".join(parts)


def supervise(plan: LaunchPlan, runner: Runner, *, poll_s: float, grace_s: float, tail_lines: int,
              engine_timeout_s: float, min_ready: int | None = None, preempt_grace_s: float = 0.0,
              engine_restarts: int = 0,
              say: Callable[[str], None] = lambda s: print(s, flush=True)) -> int:
    """Run the plan to completion; returns the exit code the launcher should exit with.
    ``engine_restarts``: how often a server whose process (any node's) exits after the learners
    started is started again, whole; after that it stays down and the pool fails over."""
    (plan.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    preempt: dict[str, float] = {}  # {"signum", "deadline"} once a checkpoint-and-stop began

    def on_signal(signum, _frame):
        started = any(s.name in procs for s in plan.learners)
        if signum == signal.SIGINT or plan.stop_file is None or not started or preempt:
            raise _Stop(signum)
        # Checkpoint and stop: the trainer looks for its stop file after every step.
        Path(plan.stop_file).parent.mkdir(parents=True, exist_ok=True)
        Path(plan.stop_file).write_text(f"signal {signum}\n")
        preempt.update(signum=signum, deadline=time.monotonic() + preempt_grace_s)
        say(f"launcher: received signal {signum}; asked the learners to checkpoint and stop "
            f"({plan.stop_file}; waiting up to launch.preempt_grace_s={preempt_grace_s:g} s)")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    if plan.stop_file is not None:  # a stale one from a previous attempt would stop us at once
        Path(plan.stop_file).unlink(missing_ok=True)
    t0 = time.monotonic()
    try:
        for spec in plan.engines:
            if spec.address_file is not None:
                Path(spec.address_file).unlink(missing_ok=True)
            with open_attempt(spec.log_path, spec.argv) as log:
                procs[spec.name] = runner.start(spec, log)
        ready = _wait_engines(plan, procs, engine_timeout_s, poll_s, min_ready, tail_lines, say)
        if ready is None:
            return 1
        plan.engines_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = plan.engines_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"engines": ready}, indent=1))
        tmp.replace(plan.engines_file)
        if plan.engines:
            say(f"launcher: {len(ready)}/{len(plan.servers)} engines ready after "
                f"{time.monotonic() - t0:.1f} s -> {plan.engines_file}")
        for spec in plan.learners:
            with open_attempt(spec.log_path, spec.argv) as log:
                procs[spec.name] = runner.start(spec, log)
        say(f"launcher: started {len(plan.learners)} learner node(s), {plan.layout.world_size} ranks")

        dead_engines: set[str] = set()
        restarts: dict[str, int] = {}  # server -> restarts so far
        done: set[str] = set()
        while True:
            failed = []
            for spec in plan.learners:
                rc = procs[spec.name].poll()
                if rc is None or spec.name in done:
                    continue
                if rc == 0:
                    done.add(spec.name)
                else:
                    failed.append((spec, rc))
            if failed:
                for spec, rc in failed:
                    say("launcher: " + failed_rank_report(spec, rc, tail_lines))
                say("launcher: a learner failed; stopping every process of this launch")
                return failed[0][1] if 0 < failed[0][1] < 256 else 1
            if len(done) == len(plan.learners):
                if preempt:
                    say(f"launcher: the learners checkpointed and stopped after signal {int(preempt['signum'])}; "
                        f"exiting {EXIT_REQUEUE} (requeue: the next run resumes from that checkpoint)")
                    return EXIT_REQUEUE
                say(f"launcher: all learners finished after {time.monotonic() - t0:.1f} s; stopping engines")
                return 0
            if preempt and time.monotonic() > preempt["deadline"]:
                say(f"launcher: the learners did not stop within launch.preempt_grace_s="
                    f"{preempt_grace_s:g} s of signal {int(preempt['signum'])}; stopping every process")
                return 128 + int(preempt["signum"])
            for spec in plan.engines:
                rc = procs[spec.name].poll()
                if rc is None or spec.server in dead_engines:
                    continue
                # a server spanning nodes cannot run without any of its nodes: stop the rest of it
                group = [p for p in plan.engines if p.server == spec.server]
                runner.stop([procs[p.name] for p in group if p.name != spec.name and procs[p.name].poll() is None],
                            grace_s)
                whole = f" (and the server's {len(group) - 1} other node(s))" if len(group) > 1 else ""
                last = f"Last lines of {spec.log_path}:\n{tail(spec.log_path, min(tail_lines, 10))}"
                n = restarts.get(spec.server, 0)
                if n < engine_restarts:
                    # the whole server again, every node; the pool routes around it meanwhile and
                    # resyncs it once it answers (inference/client.py _recover -> _rejoin)
                    restarts[spec.server] = n + 1
                    say(f"launcher: {spec.name} on {spec.node} exited with {rc}{whole}; restarting the whole "
                        f"server {spec.server} (restart {n + 1} of inference.client.max_restarts={engine_restarts}). "
                        + last)
                    for p in group:
                        if p.address_file is not None:
                            Path(p.address_file).unlink(missing_ok=True)
                        with open_attempt(p.log_path, p.argv) as log:
                            procs[p.name] = runner.start(p, log)
                    continue
                dead_engines.add(spec.server)
                say(f"launcher: {spec.name} on {spec.node} exited with {rc}{whole}; the inference "
                    f"pool fails over to the others ({len(plan.servers) - len(dead_engines)} left). " + last)
            time.sleep(poll_s)
    except _Stop as e:
        say(f"launcher: received signal {e.signum}; stopping every process of this launch")
        return 128 + e.signum
    finally:
        # Ignore further signals while stopping, so cleanup itself is not interrupted.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        live = [p for p in procs.values() if p.poll() is None]
        runner.stop(live, grace_s)
        runner.cleanup()
        for s, h in old.items():
            signal.signal(s, h)


def _wait_engines(plan: LaunchPlan, procs: dict[str, subprocess.Popen], timeout_s: float, poll_s: float,
                  min_ready: int | None, tail_lines: int, say) -> list[dict] | None:
    """Engines' addresses once all are ready (or dead, if ``min_ready`` allows); None = give up."""
    servers = plan.servers
    need = len(servers) if min_ready is None else min_ready
    deadline = time.monotonic() + timeout_s
    ready: dict[str, dict] = {}
    dead: dict[str, int] = {}
    while True:
        for spec in servers:
            if spec.name in ready or spec.name in dead:
                continue
            path = Path(spec.address_file)
            if path.exists():
                info = json.loads(path.read_text())
                ready[spec.name] = dict(info, name=spec.name, node=spec.node)
                continue
            # the server's own process, or one of its other nodes' (a server spanning nodes)
            rc = next((r for p in plan.engines if p.server == spec.server
                       for r in [procs[p.name].poll()] if r is not None), None)
            if rc is not None:
                dead[spec.name] = rc
                say(f"launcher: {spec.name} on {spec.node} exited with {rc} before it was ready; "
                    f"last lines of {spec.log_path}:\n{tail(spec.log_path, tail_lines)}")
        if len(ready) + len(dead) == len(servers):
            if len(ready) >= need:
                return [ready[s.name] for s in servers if s.name in ready]
            say(f"launcher: only {len(ready)} of {len(servers)} engines started "
                f"(launch.engine.min_ready = {need}); stopping")
            return None
        if time.monotonic() > deadline:
            missing = [s.name for s in servers if s.name not in ready and s.name not in dead]
            say(f"launcher: engines {missing} not ready after {timeout_s} s "
                "(launch.engine.startup_timeout_s); stopping")
            return None
        time.sleep(poll_s)

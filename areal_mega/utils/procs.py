"""Process trees and ports: the one implementation, used by the inference pool's servers, the
launchers (local and on Slurm nodes), the benchmarks and the test suite.

Invariants: a tree is stopped by recorded ids, never by name (:func:`stop_tree`: the group and
its descendants, SIGTERM then SIGKILL); a wrapped tree dies with its parent, even one killed by
SIGKILL (:func:`die_with_parent`); zombies count as gone. Linux only (/proc, prctl); elsewhere
the wrapper execs the command unchanged. Why each: docs/launch.md ("Process trees").
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "SERVICE_PORTS", "alive", "children", "die_with_parent", "free_port", "free_port_block", "free_ports", "group_pids",
    "host_address", "main_pid", "run", "service_ports", "signal_group", "spawn", "stop_pids", "stop_tree", "tree_pids"
]

# ---------------------------------------------------------------------------------------------
# ports


SERVICE_PORTS = (20000, 32000)
"""Where servers that bind late (SGLang binds its HTTP port after loading the model, seconds to
minutes after the port was chosen) draw their ports: below Linux's ephemeral range (32768+), so
no outgoing connection and no bind to port 0 can take the port meanwhile (a port chosen in the
ephemeral range was once taken before its SGLang server bound it: tests/test_trainer_failover.py)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0; racy, so servers should retry on EADDRINUSE)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", *, low: int | None = None, high: int | None = None) -> list[int]:
    """``n`` distinct ports that bind right now.

    Without ``low``/``high`` the kernel picks them (all sockets stay open until every port is
    chosen, so they are distinct). With a range, ports are drawn from it at random: a range below
    the kernel's ephemeral range (32768+) cannot be taken by an outgoing connection (srun,
    slurmd, HTTP clients) between this check and the server's bind (:func:`service_ports`)."""
    if low is None or high is None:
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
        try:
            for s in socks:
                s.bind((host, 0))
            return [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
    rng = random.Random()
    ports: list[int] = []
    for _ in range(100 * n + 1000):
        if len(ports) == n:
            break
        port = rng.randrange(low, high)
        if port not in ports and _bind_all(host, [port]):
            ports.append(port)
    if len(ports) < n:
        raise OSError(f"free_ports: fewer than {n} free ports in [{low}, {high})")
    return ports


def service_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports from :data:`SERVICE_PORTS`, for servers that bind late."""
    return free_ports(n, host, low=SERVICE_PORTS[0], high=SERVICE_PORTS[1])


def free_port_block(n: int, host: str = "127.0.0.1", *, low: int = SERVICE_PORTS[0],
                    high: int = SERVICE_PORTS[1]) -> int:
    """The first of ``n`` consecutive ports in [low, high) that all bind right now (for a pool
    whose server i listens on ``port + i``)."""
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(low, high - n + 1)
        if _bind_all(host, range(first, first + n)):
            return first
    raise OSError(f"free_port_block: no {n} consecutive free ports in [{low}, {high})")


def _bind_all(host: str, ports: Iterable[int]) -> bool:
    """Whether every one of ``ports`` binds right now (held together, then released)."""
    socks = []
    try:
        for p in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def host_address() -> str:
    """This host's address as other hosts should reach it (its hostname's IP)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# /proc


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live (non-zombie) process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def group_pids(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``."""
    return [pid for pid, (_, g) in _proc_table().items() if g == pgid]


def children(pid: int) -> list[int]:
    """The live direct children of ``pid``."""
    return [p for p, (ppid, _) in _proc_table().items() if ppid == pid]


def tree_pids(pid: int, table: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """``pid`` (if alive), its live descendants, and the live members of the group it leads."""
    table = _proc_table() if table is None else table
    kids: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(p)
    out = {p for p, (_, g) in table.items() if g == pid}
    if pid in table:
        out.add(pid)
    todo = [pid, *out]
    while todo:
        for c in kids.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids: Iterable[int]) -> set[int]:
    """The pids of ``pids`` that are still live (non-zombie) processes."""
    table = _proc_table()
    return {p for p in pids if p in table}


def _kill(pids: Iterable[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# die with the parent

# Runs in front of the command (``python -I -c``, stdlib only). See the module docstring.
_DIE_WITH_PARENT = """\
import os, signal, sys
argv = sys.argv[2:]
if not sys.platform.startswith("linux"):
    os.execvp(argv[0], argv)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def tree():
    kids = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                f = open("/proc/%s/stat" % e).read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f[0] not in ("Z", "X"):
                kids.setdefault(int(f[1]), []).append(int(e))
    out, todo = [], [os.getpid()]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out
def kill_tree():
    for _ in range(100):
        pids = tree()
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
def on_parent_death(*_):
    kill_tree()
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGUSR2, on_parent_death)
libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, int(signal.SIGUSR2))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("die_with_parent: parent exited before the command started")
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
secrets = []
if argv[0] == "--redact":  # values of "key: value" lines of a file: never written to the output
    for line in open(argv[1]).read().splitlines():
        value = line.partition(":")[2].strip().strip(chr(34) + chr(39))
        if value:
            secrets.append(value.encode())
    argv = argv[2:]
if secrets:
    rfd, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    if secrets:
        os.dup2(wfd, 1)
        os.dup2(wfd, 2)
        os.close(rfd)
        os.close(wfd)
    os.execvp(argv[0], argv)
if secrets:
    import threading
    os.close(wfd)
    def copy():
        src, out = os.fdopen(rfd, "rb"), os.fdopen(1, "wb", buffering=0)
        for line in src:
            for secret in secrets:
                line = line.replace(secret, b"***")
            out.write(line)
    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
while True:
    wpid, status = os.waitpid(-1, 0)
    if wpid == pid:
        break
code = os.waitstatus_to_exitcode(status)
kill_tree()
if secrets:
    copier.join(10)  # the last lines (the pipe ends once the tree is gone)
sys.exit(code if code >= 0 else 128 - code)
"""


def die_with_parent(argv: Sequence[str], *, redact: str | Path | None = None) -> list[str]:
    """``argv`` wrapped so that its whole tree is SIGKILLed when the calling THREAD exits
    (PR_SET_PDEATHSIG follows the thread that forked): start long-lived children from threads
    that live as long as they should -- the pool starts servers on its event-loop thread and
    restarts them in that loop's executor threads, which both live until the pool is closed.

    ``redact``: a file of ``key: value`` lines whose values must never reach the output (the
    command's stdout and stderr then pass through the wrapper, which masks them): SGLang logs its
    full arguments, API key included."""
    extra = ["--redact", str(redact)] if redact is not None else []
    return [sys.executable, "-I", "-c", _DIE_WITH_PARENT, str(os.getpid()), *extra, *argv]


def main_pid(proc: subprocess.Popen) -> int:
    """The wrapped command's own process (the wrapper's child), or ``proc`` itself unwrapped."""
    kids = children(proc.pid)
    return kids[0] if kids else proc.pid


# ---------------------------------------------------------------------------------------------
# start and stop


def spawn(argv: Sequence[str], *, wrap: bool = True, redact: str | Path | None = None,
          **popen_kwargs) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new session (its group id is its pid), wrapped by
    :func:`die_with_parent` (with its ``redact``) unless ``wrap=False``; stdin defaults to
    /dev/null."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    cmd = die_with_parent(argv, redact=redact) if wrap else list(argv)
    return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)


def _own_group(p: subprocess.Popen, table: dict[int, tuple[int, int]]) -> bool:
    """Whether the process group numbered ``p.pid`` is still ``p``'s. A pid is p's own until
    the wait() that reaps it; after that the number may go to an unrelated process, which would
    lead a group of that number (a server started since, in a session of its own). While the
    old group has members the number is not given out, so a reaped leader's group is still its
    own exactly when no live process holds the number."""
    return p.returncode is None or p.pid not in table


def _track(procs: Sequence[subprocess.Popen], known: set[int]) -> set[int]:
    """The live processes of the trees: ``known`` (still alive), the trees (group + descendants)
    of the leaders whose group is still their own, and the live descendants of all of them.
    Exited leaders are reaped here."""
    table = _proc_table()
    out = {q for q in known if q in table}
    for p in procs:
        if _own_group(p, table):
            out |= tree_pids(p.pid, table)
        if p.returncode is None:
            p.poll()
    for q in list(out):
        out |= tree_pids(q, table)
    return out


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    table = _proc_table()
    for p in procs:
        if _own_group(p, table):
            signal_group(p.pid, sig)  # a live leader (torchrun) passes it on; orphaned members get it


def stop_tree(procs: subprocess.Popen | Sequence[subprocess.Popen], grace_s: float = 30.0,
              *, sig: int = signal.SIGTERM) -> None:
    """Stop each process of ``procs`` (started by :func:`spawn`) and everything it started:
    ``sig`` to its group, up to ``grace_s`` for the tree to exit, then SIGKILL of what is left.

    Returns once every process of the trees is gone (or after a further 10 s for processes
    that cannot die, e.g. in uninterruptible sleep)."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    trees = _track(procs, set())
    _signal_groups(procs, sig)
    deadline = time.monotonic() + grace_s
    while trees and time.monotonic() < deadline:
        time.sleep(0.05)
        trees = _track(procs, trees)
    deadline = time.monotonic() + 10.0
    while trees and time.monotonic() < deadline:
        _signal_groups(procs, signal.SIGKILL)
        _kill(trees, signal.SIGKILL)
        time.sleep(0.05)
        trees = _track(procs, trees)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state); nothing more to do
            pass


def stop_pids(pids: Iterable[int], grace_s: float = 10.0) -> None:
    """Stop single processes known only by recorded pid (e.g. daemons started by another
    process): SIGTERM, up to ``grace_s`` for them to exit, then SIGKILL."""
    pids = alive(pids)
    _kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        _reap(pids)
        time.sleep(0.05)
        pids = alive(pids)
    _kill(pids, signal.SIGKILL)


def _reap(pids: Iterable[int]) -> None:
    """Collect those of ``pids`` that are our own exited children (others are not ours to reap)."""
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass


def run(cmd: Sequence[str], *, timeout: float, grace_s: float = 30.0, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that never leaves a tree behind:
    on timeout (or interruption) the whole tree is stopped with :func:`stop_tree` and
    ``TimeoutError`` carries the output so far."""
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    p = spawn(cmd, text=True, **popen_kwargs)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:  # the timeout, or an interruption (Ctrl-C, pytest's own timeout)
        stop_tree(p, grace_s)
        out, err = p.communicate()
        raise TimeoutError(f"stopped after {timeout} s at most: {' '.join(cmd)}\n"
                           f"{(out or '')[-4000:]}\n{(err or '')[-4000:]}") from None
    return subprocess.CompletedProcess(list(cmd), p.returncode, out, err)

"""Worker side of the sandbox: one execution of untrusted code, from a sandbox worker process.

``execute(spec) -> dict`` runs in a worker of the sandbox pool (never the trainer) and returns
``ExecResult`` fields. Mode ``namespaces`` starts ``jail.py`` as PID 1 of fresh namespaces;
``rlimits_only_unsafe`` is a plain subprocess with the same rlimits. Invariant: the verdict
(``ExecResult.reason``) is this worker's, from its own timer, output counter, the cgroup's OOM
counter and PID 1's status pipe -- never the program's exit code or output. docs/rewards.md.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from areal_mega.utils import procs

JAIL_SOURCE = Path(__file__).with_name("jail.py").read_text()  # run by -c: no host path in PID 1's cmdline
_SCRUBBED_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_NAME = "areal_mega_sandbox"


def _pdeathsig() -> None:  # in the child between fork and exec: die with this worker
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _rlimits(lim: dict[str, int]) -> None:
    import resource

    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["address_space_bytes"]),
                        ("RLIMIT_FSIZE", lim["file_bytes"]), ("RLIMIT_NOFILE", lim["open_files"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_CORE", 0)):
        hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the limit, not SIGKILL
        resource.setrlimit(getattr(resource, name), (value, hard))


def _own_cgroup(controller: str) -> str:
    """This process's cgroup (v1 hierarchy of ``controller``) as a directory, or "" if none."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            d = f"{CGROUP_ROOT}/{controller}{path.rstrip('/')}"
            return d if os.path.isdir(d) else ""
    return ""


def cgroup_unavailable() -> str | None:
    """Why a memory + pids cgroup per execution cannot be made here, or None (a probe: create
    and remove one under this process's own cgroups)."""
    dirs = {c: _own_cgroup(c) for c in ("memory", "pids")}
    if not all(dirs.values()):
        return f"no cgroup v1 hierarchy for {[c for c, d in dirs.items() if not d]} under {CGROUP_ROOT}"
    probe = f"{CGROUP_NAME}_probe{os.getpid()}"
    try:
        for d in dirs.values():
            os.makedirs(f"{d}/{CGROUP_NAME}/{probe}", exist_ok=True)
            os.rmdir(f"{d}/{CGROUP_NAME}/{probe}")
    except OSError as e:
        return f"cannot create a cgroup under {dirs['memory']}: {e}"
    return None


class ExecCgroup:
    """This worker's memory + pids cgroup (v1), under the worker's own cgroups; it holds one
    execution at a time (a worker runs one), so its counters are that execution's: memory
    (anonymous, memfd and tmpfs pages, page cache) is charged where it is spent, whichever
    process holds it, and the OOM killer acts at ``memory_bytes`` for the execution as a whole."""

    def __init__(self, memory_bytes: int, processes: int) -> None:
        name = f"w{os.getpid()}"
        self.mem = f"{_own_cgroup('memory')}/{CGROUP_NAME}/{name}"
        self.pids = f"{_own_cgroup('pids')}/{CGROUP_NAME}/{name}"
        for d in (self.mem, self.pids):
            self._sweep(os.path.dirname(d))
            os.makedirs(d, exist_ok=True)
        self._write(self.mem, "memory.limit_in_bytes", memory_bytes)
        if os.path.exists(f"{self.mem}/memory.memsw.limit_in_bytes"):  # swap counts too
            self._write(self.mem, "memory.memsw.limit_in_bytes", memory_bytes)
        self._write(self.pids, "pids.max", processes)

    @staticmethod
    def _write(d: str, name: str, value: int | str) -> None:
        with open(f"{d}/{name}", "w") as f:
            f.write(str(value))

    @staticmethod
    def _sweep(parent: str) -> None:
        """Remove the (empty) cgroups of workers that are gone."""
        if not os.path.isdir(parent):
            return
        for entry in os.listdir(parent):
            if entry.startswith("w") and entry[1:].isdigit() and not os.path.exists(f"/proc/{entry[1:]}"):
                try:
                    os.rmdir(f"{parent}/{entry}")
                except OSError:
                    pass

    def oom_kills(self) -> int:
        for line in Path(f"{self.mem}/memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def prepare(self) -> int:
        """Before an execution: wait until the previous one's processes are gone (the kernel
        empties a PID namespace asynchronously after a kill), reset the peak; the OOM-kill count."""
        deadline = time.monotonic() + 10.0
        while int(Path(f"{self.pids}/pids.current").read_text()) > 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        self._write(self.mem, "memory.max_usage_in_bytes", 0)
        return self.oom_kills()

    def join(self) -> None:
        """In the child between fork and exec: move it (and so all it starts) into the cgroup."""
        pid = str(os.getpid())
        for d in (self.mem, self.pids):
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(pid)


_cgroup: ExecCgroup | None = None  # this worker's, made on its first execution
_bpf: dict[bool, str] = {}  # the compiled seccomp filter (hex) by allow_memfd


def _worker_cgroup(spec: dict[str, Any]) -> ExecCgroup | None:
    global _cgroup
    if not spec["cgroup"]:
        return None
    if _cgroup is None:
        _cgroup = ExecCgroup(int(spec["memory_bytes"]), int(spec["limits"]["processes"]))
    return _cgroup


def _filter_hex(allow_memfd: bool) -> str:
    if allow_memfd not in _bpf:
        from areal_mega.sandbox.seccomp import filter_bpf

        _bpf[allow_memfd] = filter_bpf(allow_memfd).hex()
    return _bpf[allow_memfd]


def _collect(proc: subprocess.Popen, stdin: bytes, timeout_s: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Feed stdin, read stdout/stderr up to ``cap`` bytes each, until EOF on both, the
    deadline, or the cap: (stdout, stderr, None | "timeout" | "output_limit")."""
    assert proc.stdin and proc.stdout and proc.stderr
    deadline = time.monotonic() + timeout_s
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    reading = {out_fd, err_fd}
    todo_in = memoryview(stdin)
    wfd = proc.stdin.fileno()
    os.set_blocking(wfd, False)
    if not todo_in:
        proc.stdin.close()
        wfd = -1
    why = None
    while reading and why is None:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        r, w, _ = select.select(list(reading), [wfd] if wfd >= 0 else [], [], left)
        if w:
            try:
                n = os.write(wfd, todo_in[:1 << 16])
                todo_in = todo_in[n:]
            except (BrokenPipeError, BlockingIOError):
                todo_in = todo_in[:0]
            if not todo_in:
                proc.stdin.close()
                wfd = -1
        for fd in r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                reading.discard(fd)  # EOF
            bufs[fd] += chunk
            if len(bufs[fd]) > cap:
                why = "output_limit"
    out, err = bytes(bufs[out_fd]), bytes(bufs[err_fd])
    return out, err, why


def verdict(why: str | None, oom_killed: bool, observed: dict[str, Any]) -> str:
    """The reason, from the runner's own observations only: ``why`` (its timer / output cap),
    ``oom_killed`` (the cgroup's counter moved), ``observed`` (PID 1's or waitpid's report:
    exit, signal, syntax_error, setup_error; {} when PID 1 was killed before reporting)."""
    if why is not None:
        return why
    if oom_killed:
        return "memory"
    if "setup_error" in observed or not observed:
        return "sandbox_error"
    if observed.get("syntax_error"):
        return "syntax_error"
    if "signal" in observed:
        return {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "file_size"}.get(observed["signal"], "killed")
    return "ok" if observed["exit"] == 0 else "runtime_error"


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["code"]`` once with ``spec["stdin"]``; the ``ExecResult`` fields as a dict.

    ``spec``: code, stdin, mode, timeout_s, max_output_bytes, cgroup (bool), memory_bytes,
    limits {cpu_s, address_space_bytes, file_bytes, open_files, processes}, python, and for
    namespaces: uid_base, tmpfs_mb, tmpfs_inodes, expose, mask."""
    lim = spec["limits"]
    cap = int(spec["max_output_bytes"])
    t0 = time.monotonic()
    cg = _worker_cgroup(spec)
    ooms_before = cg.prepare() if cg is not None else 0
    tmp = None
    status_r = -1
    observed: dict[str, Any] = {}
    if spec["mode"] == "namespaces":
        uid = int(spec["uid_base"]) + os.getpid()
        from areal_mega.sandbox.seccomp import syscall_numbers

        jail_spec = {k: spec[k] for k in ("code", "limits", "tmpfs_mb", "tmpfs_inodes", "expose", "mask")}
        jail_spec.update(uid=uid, gid=uid, seccomp_bpf=_filter_hex(allow_memfd=cg is not None),
                         syscalls=syscall_numbers("pivot_root", "keyctl"))
        rfd, wfd = os.pipe()
        status_r, status_w = os.pipe()
        cmd = ["unshare", "--net", "--pid", "--fork", "--mount", "--ipc", "--uts", "--kill-child",
               spec["python"], "-I", "-S", "-c", JAIL_SOURCE, str(rfd), str(status_w)]
        proc = procs.spawn(cmd, wrap=False, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, pass_fds=(rfd, status_w), env=_SCRUBBED_ENV,
                           preexec_fn=(lambda: (cg.join(), _pdeathsig())) if cg is not None else _pdeathsig)
        os.close(rfd)
        os.close(status_w)
        with os.fdopen(wfd, "wb") as f:  # the jail reads it first thing
            try:
                f.write(json.dumps(jail_spec).encode())
            except BrokenPipeError:
                pass
    else:
        try:  # the verdict "syntax_error" is ours: compile here, outside the program
            compile(spec["code"], "main.py", "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            err = "".join(traceback.format_exception_only(type(e), e))
            return {"reason": "syntax_error", "exit_code": None, "stdout": "", "stderr": err[-4000:],
                    "wall_s": time.monotonic() - t0}
        tmp = tempfile.TemporaryDirectory(prefix="sandbox-unsafe-")
        Path(tmp.name, "main.py").write_text(spec["code"])
        env = {**_SCRUBBED_ENV, "HOME": tmp.name, "TMPDIR": tmp.name, "OMP_NUM_THREADS": "1"}

        def pre() -> None:
            if cg is not None:
                cg.join()
            _rlimits(lim)
            _pdeathsig()

        proc = procs.spawn([spec["python"], "-I", "-S", "main.py"], wrap=False, cwd=tmp.name, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pre)
    timeout_s = float(spec["timeout_s"])
    try:
        out, err, why = _collect(proc, spec["stdin"].encode(), timeout_s, cap)
        if why is None:  # both pipes closed: the program is gone, PID 1 is finishing
            try:
                proc.wait(timeout=max(timeout_s - (time.monotonic() - t0), 0.0) + 1.0)
            except subprocess.TimeoutExpired:
                why = "timeout"
    finally:
        if proc.poll() is None:
            # SIGKILL of unshare's (or the unsafe child's) session and every descendant, until
            # all are gone; for namespaces --kill-child also makes the kernel empty the PID ns.
            procs.stop_tree(proc, grace_s=0.0, sig=signal.SIGKILL)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()
        if status_r >= 0:
            report = b""
            while chunk := os.read(status_r, 1 << 16):  # every writer is gone: EOF
                report += chunk
            os.close(status_r)
            try:
                observed = json.loads(report) if report else {}
            except ValueError:
                observed = {}
        if tmp is not None:
            tmp.cleanup()
    wall = time.monotonic() - t0
    if spec["mode"] != "namespaces":  # the unsafe child is our own: waitpid is the observation
        rc = proc.returncode
        observed = {"signal": -rc} if rc < 0 else {"exit": rc}
    oom_killed = cg is not None and cg.oom_kills() > ooms_before
    reason = verdict(why, oom_killed, observed)
    code = observed.get("exit", 128 + observed["signal"] if "signal" in observed else proc.returncode)
    err_s = err[-4000:].decode(errors="replace")
    return {"reason": reason, "exit_code": code, "stdout": out[:cap].decode(errors="replace"),
            "stderr": err_s, "wall_s": wall}

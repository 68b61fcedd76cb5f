"""Worker side of the sandbox: one execution of untrusted code, from a sandbox worker process.

``execute(spec) -> dict`` runs in a worker of the sandbox pool (``RewardWorkerPool``, its own
process beside the reward workers, never the trainer) and returns the result as a JSON-able dict
(``ExecResult`` fields). Modes:

* ``namespaces``: ``unshare --net --pid --fork --mount --mount-proc --ipc --uts --kill-child`` starts
  ``init.py`` as PID 1 of fresh namespaces (see its docstring for the mount view, the uid switch
  and the rlimits). The uid is ``uid_base + this worker's pid``: unique among live workers, so
  RLIMIT_NPROC counts only this execution's processes. The runner itself enforces the
  wall-clock timeout (SIGKILL of unshare: --kill-child then SIGKILLs PID 1, and the kernel the
  rest of the namespace) and the output cap (the same kill once stdout or stderr passes it).
* ``rlimits_only_unsafe``: a plain subprocess with the same rlimits (no uid switch, no
  namespaces), its own session, a scrubbed environment and an empty temp cwd; the tree is
  stopped with ``procs.stop_tree``. A resource fence only: the code can reach the network, the
  filesystem and other processes.

Reasons (``ExecResult.reason``): ok, timeout (wall clock or CPU limit), memory (MemoryError or
the address-space limit), output_limit, file_size (SIGXFSZ: the file-size limit), killed (any
other signal), syntax_error, runtime_error (any other non-zero exit), sandbox_error (set-up
failed: nothing ran).
"""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import tempfile
import time
import json
from pathlib import Path
from typing import Any

from areal_mega.utils import procs

INIT = str(Path(__file__).with_name("init.py"))
SETUP_FAILED = 121  # init.py's exit code when the sandbox could not be built
_SCRUBBED_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _pdeathsig() -> None:  # in the child between fork and exec: die with this worker
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _rlimits(lim: dict[str, int]) -> None:
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_bytes"]),
                        ("RLIMIT_FSIZE", lim["file_bytes"]), ("RLIMIT_NOFILE", lim["open_files"]),
                        ("RLIMIT_NPROC", lim["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


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


def _classify(code: int, err: str) -> str:
    if code == 0:
        return "ok"
    if code == SETUP_FAILED and "sandbox set-up failed" in err:
        return "sandbox_error"
    if code > 128:
        sig = code - 128
        if sig == signal.SIGXCPU:
            return "timeout"
        if sig == signal.SIGXFSZ:
            return "file_size"
        return "killed"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if last.startswith(("MemoryError", "numpy.core._exceptions._ArrayMemoryError")):
        return "memory"
    if last.startswith(("SyntaxError", "IndentationError", "TabError")):
        return "syntax_error"
    if last.startswith("OSError: [Errno 27]"):  # EFBIG with SIGXFSZ ignored
        return "file_size"
    return "runtime_error"


def execute(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["code"]`` once with ``spec["stdin"]``; the ``ExecResult`` fields as a dict.

    ``spec``: code, stdin, mode, timeout_s, max_output_bytes, limits {cpu_s, memory_bytes,
    file_bytes, open_files, processes}, and for namespaces: uid_base, tmpfs_mb, hide, python,
    python_prefix."""
    lim = spec["limits"]
    cap = int(spec["max_output_bytes"])
    t0 = time.monotonic()
    tmp = None
    if spec["mode"] == "namespaces":
        uid = int(spec["uid_base"]) + os.getpid()
        init_spec = {k: spec[k] for k in ("code", "limits", "tmpfs_mb", "hide", "python", "python_prefix")}
        init_spec.update(uid=uid, gid=uid)
        rfd, wfd = os.pipe()
        cmd = ["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--ipc", "--uts", "--kill-child",
               spec["python"], "-I", "-S", INIT, str(rfd)]
        proc = procs.spawn(cmd, wrap=False, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, pass_fds=(rfd,), env=_SCRUBBED_ENV,
                           preexec_fn=_pdeathsig)
        os.close(rfd)
        with os.fdopen(wfd, "wb") as f:  # init reads it first thing
            try:
                f.write(json.dumps(init_spec).encode())
            except BrokenPipeError:
                pass
    else:
        tmp = tempfile.TemporaryDirectory(prefix="sandbox-unsafe-")
        Path(tmp.name, "main.py").write_text(spec["code"])
        env = {**_SCRUBBED_ENV, "HOME": tmp.name, "TMPDIR": tmp.name, "OMP_NUM_THREADS": "1"}
        proc = procs.spawn([spec["python"], "-I", "-S", "main.py"], wrap=False, cwd=tmp.name, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           preexec_fn=lambda: (_rlimits(lim), _pdeathsig()))
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
        if tmp is not None:
            tmp.cleanup()
    wall = time.monotonic() - t0
    code = proc.returncode
    err_s = err[-4000:].decode(errors="replace")
    if why is None:
        # A kill from outside (the worker's own limits, the OOM killer) shows as -signal.
        code = code if code >= 0 else 128 - code
        reason = _classify(code, err_s)
    else:
        reason = why
    return {"reason": reason, "exit_code": code, "stdout": out[:cap].decode(errors="replace"),
            "stderr": err_s, "wall_s": wall}

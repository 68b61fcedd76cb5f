"""Sandboxed execution of untrusted (model-written) Python code.

    sandbox = Sandbox(SandboxConfig())                 # refuses if namespaces are unavailable
    res = await sandbox.run("print(input())", stdin="hi\\n")
    res.reason, res.stdout                              # "ok", "hi\\n"
    sandbox.close()

Dataflow::

    trainer (rank 0) --pipe--> sandbox worker (own process, RewardWorkerPool)
                                  --> unshare --net --pid --fork --mount --mount-proc --ipc --uts --kill-child
                                        --> init.py (PID 1, root, builds the mount view)
                                              --> python -I main.py (sandbox uid, rlimits)

The code never runs in the trainer's process or as its child: a worker process of the sandbox
pool starts each execution in fresh namespaces (see ``runner.py`` and ``init.py`` for what each
layer enforces, and docs/rewards.md for the threat model). ``mode="rlimits_only_unsafe"`` is
the weaker fallback for machines without namespaces; it is never chosen silently: with
``mode="namespaces"`` on such a machine, building a ``Sandbox`` raises ``SandboxUnavailable``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_mega.errors import UserError

REASONS = ("ok", "timeout", "memory", "output_limit", "file_size", "killed", "syntax_error",
           "runtime_error", "sandbox_error")
"""Every ``ExecResult.reason`` (see ``runner.py``)."""


class SandboxUnavailable(UserError):
    """Namespaces were asked for (``sandbox.mode: namespaces``) but this machine cannot make them."""


@dataclass
class SandboxConfig:
    mode: Literal["namespaces", "rlimits_only_unsafe"] = "namespaces"
    """"namespaces": fresh network / PID / mount namespaces per execution, a read-only view of
    the filesystem with a private tmpfs, an unprivileged uid, rlimits (needs root and unshare;
    refused at start-up where unavailable). "rlimits_only_unsafe": rlimits, a scrubbed
    environment and a timeout only -- the code can reach the network, the filesystem and other
    processes of the user; for trusted code or machines without namespaces, by explicit choice."""
    num_workers: int = 2
    """Sandbox worker processes (concurrent executions)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one execution; the whole process tree is killed at the limit."""
    cpu_s: int = 5
    """RLIMIT_CPU (seconds of CPU per process)."""
    memory_mb: int = 512
    """RLIMIT_AS (address space per process), MiB."""
    file_size_mb: int = 16
    """RLIMIT_FSIZE (largest file the code may write), MiB."""
    tmpfs_mb: int = 64
    """namespaces: size of the private writable tmpfs (/tmp, with the work dir /tmp/work), MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_processes: int = 32
    """RLIMIT_NPROC: processes of the execution's uid (namespaces mode: a uid of its own, so
    this bounds a fork bomb; in rlimits_only_unsafe mode it counts every process of the
    trainer's user, and binds nothing when that user is root)."""
    max_output_bytes: int = 1 << 20
    """Cap on stdout and on stderr each; past it the execution is killed (reason output_limit)."""
    hide_paths: list[str] = field(default_factory=lambda: ["/root", "/home"])
    """namespaces: directories replaced by an empty tmpfs in the view (homes: keys, caches,
    secrets). The interpreter's own prefix is bound back read-only if it lies under one."""
    uid_base: int = 1_000_000
    """namespaces: the code runs as uid = gid = uid_base + the worker's pid (unique among live
    workers; needs no passwd entry and owns no file)."""
    python: str = ""
    """The interpreter that runs the code, as ``python -I -S`` (isolated, no site-packages: the
    standard library only); "" = this Python's base interpreter."""

    def validate(self) -> None:
        for key in ("num_workers", "cpu_s", "memory_mb", "file_size_mb", "tmpfs_mb", "max_open_files",
                    "max_processes", "max_output_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_open_files < 8:
            raise ValueError(f"max_open_files: the interpreter needs at least 8, got {self.max_open_files}")
        if not 1000 <= self.uid_base <= 2**31 - 2**22 - 2:
            raise ValueError(f"uid_base: must be in [1000, 2**31 - 2**22 - 2] (uid_base + pid), got {self.uid_base}")

    def interpreter(self) -> tuple[str, str]:
        """(python executable, its installation prefix)."""
        if self.python:
            exe = os.path.realpath(self.python)
            return exe, os.path.dirname(os.path.dirname(exe))
        exe = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
        return os.path.realpath(exe), os.path.realpath(sys.base_prefix)


@dataclass
class ExecResult:
    """One execution. ``reason`` is one of ``REASONS``; stdout/stderr are capped (stderr to its
    last 4000 bytes)."""

    reason: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def namespaces_unavailable() -> str | None:
    """Why mode "namespaces" cannot work here, or None when it can (a probe run of unshare)."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    if os.geteuid() != 0:
        return "needs root (mount namespaces and the switch to the sandbox uid)"
    if shutil.which("unshare") is None:
        return "no unshare executable (util-linux)"
    try:
        p = subprocess.run(["unshare", "--net", "--pid", "--fork", "--mount", "--mount-proc", "--ipc", "--uts", "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare probe failed: {e}"
    if p.returncode != 0:
        return f"unshare probe failed: {p.stderr.strip() or p.returncode}"
    return None


class Sandbox:
    """A pool of sandbox workers; ``await run(code, stdin) -> ExecResult``. Thread-safe."""

    RUNNER = "areal_mega.sandbox.runner:execute"

    def __init__(self, cfg: SandboxConfig) -> None:
        cfg.validate()
        if cfg.mode == "namespaces":
            why = namespaces_unavailable()
            if why is not None:
                raise SandboxUnavailable(
                    f"sandbox.mode: 'namespaces' is unavailable on this machine ({why}); refusing to run "
                    "untrusted code. Set sandbox.mode=rlimits_only_unsafe to run it with rlimits only "
                    "(no network, filesystem or process isolation)")
        self.cfg = cfg
        python, prefix = cfg.interpreter()
        self._spec: dict[str, Any] = {
            "mode": cfg.mode, "timeout_s": cfg.timeout_s, "max_output_bytes": cfg.max_output_bytes,
            "uid_base": cfg.uid_base, "tmpfs_mb": cfg.tmpfs_mb, "hide": list(cfg.hide_paths),
            "python": python, "python_prefix": prefix,
            "limits": {"cpu_s": cfg.cpu_s, "memory_bytes": cfg.memory_mb << 20, "file_bytes": cfg.file_size_mb << 20,
                       "open_files": cfg.max_open_files, "processes": cfg.max_processes},
        }
        from areal_mega.reward.pool import RewardWorkerPool  # here: areal_mega.reward imports this module

        # The worker's own deadline is a backstop: the runner kills the execution at timeout_s.
        self.pool = RewardWorkerPool(cfg.num_workers, cfg.timeout_s + 30.0, preload=["areal_mega.sandbox.runner"])

    def _result(self, value: Any, status: str) -> ExecResult:
        if status != "ok":  # the worker itself hung, died or raised: nothing of the code's escaped it
            return ExecResult("sandbox_error", None, "", f"sandbox worker: {status}", 0.0)
        fields = {f.name for f in dataclasses.fields(ExecResult)}
        return ExecResult(**{k: v for k, v in value.items() if k in fields})

    async def run(self, code: str, stdin: str = "") -> ExecResult:
        return self._result(*await self.pool.acall_value(self.RUNNER, {**self._spec, "code": code, "stdin": stdin}))

    def run_sync(self, code: str, stdin: str = "") -> ExecResult:
        return self._result(*self.pool.call_value(self.RUNNER, {**self._spec, "code": code, "stdin": stdin}))

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["REASONS", "ExecResult", "Sandbox", "SandboxConfig", "SandboxUnavailable", "namespaces_unavailable"]

"""Sandboxed execution of untrusted (model-written) Python code.

    sandbox = Sandbox(SandboxConfig())                 # refuses if namespaces are unavailable
    res = await sandbox.run("print(input())", stdin="hi\\n")
    res.reason, res.stdout                              # "ok", "hi\\n"
    sandbox.close()

The code never runs in the trainer's process or as its child, and the verdict is never read
from its exit code or output. Layers, threat model, modes: docs/rewards.md ("The code sandbox").
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
from areal_mega.sandbox.runner import cgroup_unavailable

REASONS = ("ok", "timeout", "memory", "output_limit", "file_size", "killed", "syntax_error",
           "runtime_error", "sandbox_error")
"""Every ``ExecResult.reason`` (see ``runner.py``)."""


class SandboxUnavailable(UserError):
    """Namespaces were asked for (``sandbox.mode: namespaces``) but this machine cannot make them."""


@dataclass
class SandboxConfig:
    mode: Literal["namespaces", "rlimits_only_unsafe"] = "namespaces"
    """"namespaces": fresh network / PID / mount / IPC / UTS namespaces per execution, a
    default-deny view (the interpreter, its libraries, a scratch tmpfs; ``extra_paths``), an
    unprivileged uid, a seccomp allowlist, rlimits (needs root, unshare and libseccomp; refused at
    start-up where unavailable). "rlimits_only_unsafe": rlimits, a scrubbed environment and a
    timeout only -- the code can reach the network, the filesystem and other processes of the
    user; for trusted code or machines without namespaces, by explicit choice. Both modes use the
    memory + pids cgroup where the machine has one."""
    num_workers: int = 2
    """Sandbox worker processes (concurrent executions)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one execution; the whole process tree is killed at the limit."""
    cpu_s: int = 5
    """RLIMIT_CPU (seconds of CPU per process)."""
    memory_mb: int = 512
    """Memory of the whole execution, MiB: a memory cgroup per execution (all its processes;
    anonymous memory, memfd and tmpfs pages, page cache) where the machine has one (cgroup v1
    memory + pids, as root), reason "memory" when its OOM killer acts; elsewhere RLIMIT_AS per
    process, and memfd_create is denied (its pages would count nowhere)."""
    address_space_mb: int = 8192
    """RLIMIT_AS per process, MiB, where the memory cgroup is used (a bound on reservations the
    cgroup only counts once touched); an allocation past it raises MemoryError in the program
    (reason runtime_error: the program's own exception)."""
    file_size_mb: int = 16
    """RLIMIT_FSIZE (largest file the code may write), MiB."""
    tmpfs_mb: int = 64
    """namespaces: size of the private writable tmpfs (/tmp, with the work dir /tmp/work), MiB."""
    tmpfs_inodes: int = 4096
    """namespaces: inodes of that tmpfs (files + directories; a bound on kernel memory that a
    size limit alone leaves open: empty files take no pages)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    max_processes: int = 32
    """Processes and threads of the execution: the pids cgroup's pids.max (where there is one:
    counts the sandbox's own unshare and PID 1 too) and RLIMIT_NPROC (namespaces mode: the
    execution's uid is its own, so it bounds a fork bomb; in rlimits_only_unsafe mode it counts
    every process of the trainer's user, and binds nothing when that user is root)."""
    max_output_bytes: int = 1 << 20
    """Cap on stdout and on stderr each; past it the execution is killed (reason output_limit)."""
    extra_paths: list[str] = field(default_factory=list)
    """namespaces: host files or directories the program may read (bound read-only at the same
    path, e.g. a directory of test data). The default view holds only the interpreter's prefix,
    the directories of the shared libraries it loads, /etc/ld.so.cache, a minimal /dev, the
    namespace's /proc and the scratch /tmp: not the dataset, the run directory, the repository,
    caches or home directories. A path that holds (or lies inside) the dataset file or the run
    directory is refused at start-up."""
    uid_base: int = 1_000_000
    """namespaces: the code runs as uid = gid = uid_base + the worker's pid (unique among live
    workers; needs no passwd entry and owns no file)."""
    python: str = ""
    """The interpreter that runs the code, as ``python -I -S`` (isolated, no site-packages: the
    standard library only); "" = this Python's base interpreter. Its installation prefix is in
    the view (read-only)."""

    def validate(self) -> None:
        for key in ("num_workers", "cpu_s", "memory_mb", "address_space_mb", "file_size_mb", "tmpfs_mb",
                    "tmpfs_inodes", "max_open_files", "max_processes", "max_output_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.max_open_files < 8:
            raise ValueError(f"max_open_files: the interpreter needs at least 8, got {self.max_open_files}")
        for i, p in enumerate(self.extra_paths):
            if not os.path.isabs(p) or not os.path.exists(p):
                raise ValueError(f"extra_paths[{i}]: {p!r} must be an absolute path that exists")
            if os.path.normpath(p).split("/")[1] in ("tmp", "dev", "proc"):
                raise ValueError(f"extra_paths[{i}]: {p!r} lies under /tmp, /dev or /proc, which the view makes itself")
        if not 1000 <= self.uid_base <= 2**31 - 2**22 - 2:
            raise ValueError(f"uid_base: must be in [1000, 2**31 - 2**22 - 2] (uid_base + pid), got {self.uid_base}")

    def interpreter(self) -> tuple[str, str]:
        """(python executable, its installation prefix)."""
        if self.python:
            exe = os.path.realpath(self.python)
            return exe, os.path.dirname(os.path.dirname(exe))
        exe = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
        return os.path.realpath(exe), os.path.realpath(sys.base_prefix)


def check_extra_paths(config: Any, protected: dict[str, str]) -> None:
    """Refuse (ValueError, one line naming the key) any ``extra_paths`` entry of a SandboxConfig
    anywhere in ``config`` (dataclasses and lists, walked) that holds, is, or lies inside one of
    ``protected`` (key -> path: the dataset file, the run directory): the program could read
    the expected outputs or the run's files through it."""
    def walk(node: Any, key: str):
        if isinstance(node, SandboxConfig):
            yield key, node
        elif isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{key}[{i}]")
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                yield from walk(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)

    guarded = {k: os.path.realpath(p) for k, p in protected.items() if p}
    for key, sb in walk(config, ""):
        for i, p in enumerate(sb.extra_paths):
            mine = os.path.realpath(p)
            for what, other in guarded.items():
                if os.path.commonpath([mine, other]) in (mine, other):
                    raise ValueError(f"{key}.extra_paths[{i}]: {p!r} overlaps {what} ({other}); the sandboxed "
                                     f"program could read it -- expose a directory of inputs only")


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
    try:
        from areal_mega.sandbox.seccomp import filter_bpf

        filter_bpf(allow_memfd=False)
    except Exception as e:  # ImportError, or OSError: no libseccomp.so.2
        return f"no seccomp filter (pyseccomp + libseccomp.so.2, tools/env/learner.txt): {e}"
    return None


def view_paths(python: str, prefix: str) -> tuple[list[str], list[str]]:
    """What the program sees of the host, read-only: (paths bound into the view, directories
    masked by an empty one in it). The interpreter's executable and its standard library (not
    its site-packages: the program runs ``-I -S``), the shared libraries the interpreter and its
    extension modules load (their directories outside the prefix, the files inside it, as the
    loader names them), and the loader's cache."""
    import glob

    stdlib = sorted(glob.glob(os.path.join(prefix, "lib", "python3*")))
    stdlib = [d for d in stdlib if os.path.isdir(d)]
    # One interpreter imports every extension module with the loader's trace on (one process,
    # ~1 s of CPU; ldd would start two per module): the libraries it maps, as the loader names them.
    probe = ("import glob, importlib, os, sys\n"
             "for so in sorted(glob.glob(os.path.join(sys.argv[1], 'lib-dynload', '*.so'))):\n"
             "    try:\n        importlib.import_module(os.path.basename(so).split('.')[0])\n"
             "    except Exception:\n        pass\n")
    libs = []
    for d in stdlib:
        trace = subprocess.run([python, "-I", "-S", "-c", probe, d], capture_output=True, text=True, timeout=600,
                               env={"LD_DEBUG": "files", "PATH": os.environ.get("PATH", "")}).stderr
        for line in trace.splitlines():
            if "calling init: " in line:
                path = line.split("calling init: ", 1)[1].strip()
                if path.startswith(prefix + "/"):
                    libs.append(path)  # the prefix's own libraries (libpython): the files
                elif path.startswith("/"):
                    libs.append(os.path.dirname(path))
    libs = [p for p in libs if not any(p.startswith(d + "/") for d in stdlib)]  # in the stdlib already
    expose = [python, *stdlib, *sorted(set(libs))]
    if os.path.exists("/etc/ld.so.cache"):
        expose.append("/etc/ld.so.cache")
    mask = [os.path.join(d, "site-packages") for d in stdlib if os.path.isdir(os.path.join(d, "site-packages"))]
    return expose, mask


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
        self.cgroup_unavailable = cgroup_unavailable()
        """Why executions run without a memory + pids cgroup here (None: they run in one)."""
        use_cgroup = self.cgroup_unavailable is None
        expose, mask = view_paths(python, prefix) if cfg.mode == "namespaces" else ([], [])
        self._spec: dict[str, Any] = {
            "mode": cfg.mode, "timeout_s": cfg.timeout_s, "max_output_bytes": cfg.max_output_bytes,
            "uid_base": cfg.uid_base, "tmpfs_mb": cfg.tmpfs_mb, "tmpfs_inodes": cfg.tmpfs_inodes,
            "expose": expose + list(cfg.extra_paths), "mask": mask, "python": python, "cgroup": use_cgroup,
            "memory_bytes": cfg.memory_mb << 20,
            "limits": {"cpu_s": cfg.cpu_s, "file_bytes": cfg.file_size_mb << 20,
                       "address_space_bytes": (cfg.address_space_mb if use_cgroup else cfg.memory_mb) << 20,
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


__all__ = ["REASONS", "ExecResult", "Sandbox", "SandboxConfig", "SandboxUnavailable", "check_extra_paths",
           "namespaces_unavailable"]

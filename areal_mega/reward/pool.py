"""A pool of reward worker processes with a per-call timeout.

Each call goes to an idle worker (``python -m areal_mega.reward.worker``) over a pipe; on a
timeout the worker is killed and replaced. A timeout, crash or exception scores ``default``:
the trainer never sees any of it except in ``stats``. ``call`` returns a float, ``call_value``
the function's JSON value with the call's status. Why processes: docs/rewards.md ("Module notes").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from areal_mega.utils import procs

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class _Worker:
    def __init__(self, preload: Sequence[str], startup_timeout_s: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_REPO_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        env["OMP_NUM_THREADS"] = "1"  # a reward check is single-threaded; don't oversubscribe
        cmd = [sys.executable, "-m", "areal_mega.reward.worker"]
        for mod in preload:
            cmd += ["--preload", mod]
        self.proc = procs.spawn(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        line = self.readline(startup_timeout_s)
        if not line or not json.loads(line).get("ready"):
            self.kill()
            raise RuntimeError(f"reward worker did not start within {startup_timeout_s} s (preload={list(preload)})")

    def readline(self, timeout: float) -> str | None:
        """One line from the worker; None on timeout; "" on EOF (the worker died)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return ""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def send(self, msg: dict) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg, default=str) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def kill(self) -> None:
        procs.stop_tree(self.proc, grace_s=0.0, sig=signal.SIGKILL)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class RewardWorkerPool:
    """``call(fn, *args) -> float`` runs ``fn`` ("module:function") in a worker process.

    Thread-safe; ``acall`` is the asyncio form (a dedicated thread per worker waits on the
    pipe, so the event loop never blocks). Workers start lazily and are reused.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        *,
        preload: Sequence[str] = (),
        default: float = 0.0,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.preload = tuple(preload)
        self.default = default
        self.startup_timeout_s = startup_timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot; the worker is started on first use
        self._executor = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self.stats = {"ok": 0, "timeout": 0, "crash": 0, "error": 0}
        self._closed = False

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def call(self, fn: str, *args: Any) -> float:
        """``float(fn(*args))`` in a worker; ``default`` on a timeout, crash or exception."""
        value, status = self.call_value(fn, *args)
        return float(value) if status == "ok" else self.default

    def call_value(self, fn: str, *args: Any) -> tuple[Any, str]:
        """(what ``fn(*args)`` returned, "ok") or (None, "timeout" | "crash" | "error")."""
        if self._closed:
            raise RuntimeError("RewardWorkerPool is closed")
        worker = self._idle.get()
        try:
            if worker is None:
                worker = _Worker(self.preload, self.startup_timeout_s)
                with self._lock:
                    self._all.add(worker)
            if not worker.send({"fn": fn, "args": list(args)}):
                self._count("crash")
                worker = self._retire(worker)
                return None, "crash"
            line = worker.readline(self.timeout_s)
            if not line:
                status = "timeout" if line is None else "crash"
                self._count(status)
                worker = self._retire(worker)
                return None, status
            reply = json.loads(line)
            if not reply.get("ok"):
                self._count("error")
                return None, "error"
            self._count("ok")
            return reply["value"], "ok"
        finally:
            self._idle.put(worker)

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker (timed out or dead); its slot restarts one on next use."""
        worker.kill()
        with self._lock:
            self._all.discard(worker)
        return None

    async def acall(self, fn: str, *args: Any) -> float:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.call, fn, *args)

    async def acall_value(self, fn: str, *args: Any) -> tuple[Any, str]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.call_value, fn, *args)

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()

    def __enter__(self) -> "RewardWorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

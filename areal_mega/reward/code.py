"""Code reward: run the completion's last ```python block against test cases in a sandboxed
subprocess (isolated interpreter, empty temp cwd, rlimits on CPU time, memory, file size and
open files, wall-clock timeout). Reward = fraction of tests whose stdout matches.

Sample format: ``data["tests"] = [{"input": "<stdin>", "output": "<expected stdout>"}, ...]``.
This is a resource fence, not a security boundary: run untrusted code in a container too.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import sys
import tempfile
from typing import Any

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


class CodeReward:
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_concurrent: int = 2) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._sem = asyncio.Semaphore(max_concurrent)

    def _limits(self) -> None:  # runs in the child between fork and exec
        cpu = int(self.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        mem = self.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        os.setsid()  # own process group, so a timeout kills any children too

    async def run_one(self, code: str, stdin: str) -> tuple[bool, str]:
        """(finished in time with exit code 0, stdout)."""
        async with self._sem:
            with tempfile.TemporaryDirectory() as cwd:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-c", code, cwd=cwd, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL, preexec_fn=self._limits,
                )
                try:
                    out, _ = await asyncio.wait_for(proc.communicate(stdin.encode()), self.timeout_s)
                except asyncio.TimeoutError:
                    try:
                        os.killpg(proc.pid, 9)  # the group we created with setsid
                    except ProcessLookupError:
                        pass
                    await proc.wait()
                    return False, ""
                return proc.returncode == 0, out.decode(errors="replace")

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        tests = data.get("tests")
        if not tests:
            raise ValueError(f"code reward: the sample has no 'tests' list (keys: {sorted(data)})")
        code = extract_code(completion)
        if code is None:
            return 0.0
        passed = 0
        for t in tests:
            ok, out = await self.run_one(code, str(t.get("input", "")))
            passed += ok and out.strip() == str(t["output"]).strip()
        return passed / len(tests)

    def close(self) -> None:
        pass

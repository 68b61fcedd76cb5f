"""Starting processes from tests: torchrun commands and runs, the environment they get, and the
guard of the tests that need a real SGLang interpreter. Every test that uses these is ``slow``
(tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

REPO = Path(__file__).resolve().parents[2]

# The SGLang virtualenv's interpreter (`make test` sets it); tests that start real SGLang servers
# are skipped without it.
SGLANG_PYTHON = os.environ.get("AREAL_MEGA_SGLANG_PYTHON", "")
needs_sglang = pytest.mark.skipif(not SGLANG_PYTHON, reason="AREAL_MEGA_SGLANG_PYTHON not set (run through make test)")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, the repository on PYTHONPATH (the
    children import areal_mega and tests.support), and one OpenMP thread (ranks and servers
    share the CI machine's two cores)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N ARGS`` with this interpreter (args: a script and
    its arguments, or ``-m module ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *map(str, args)]


def run_checked(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None, merge_stderr: bool = False,
                check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root (tests/procs.py: a timeout stops the whole tree and
    fails with its output); with ``check``, a non-zero exit fails the test with the output's tail."""
    kw = {"stderr": subprocess.STDOUT} if merge_stderr else {}
    proc = procs.run(cmd, cwd=REPO, env=env or child_env(), timeout=timeout_s, **kw)
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{(proc.stderr or '')[-8000:]}")
    return proc


def run_dist_script(script: str, nproc: int, work: Path, *, timeout_s: float, args: tuple[str, ...] = ()) -> dict:
    """``tests/dist/<script> --work-dir W --out W/results.json ARGS`` on ``nproc`` gloo ranks;
    returns the JSON the script wrote. The timeout bounds a hang (and stops the ranks too)."""
    out = Path(work) / "results.json"
    run_checked(torchrun_cmd(nproc, f"tests/dist/{script}", "--work-dir", work, "--out", out, *args), timeout_s=timeout_s)
    return json.loads(out.read_text())

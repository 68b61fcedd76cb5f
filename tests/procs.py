"""Process helpers for tests: the package's own (``areal_mega.utils.procs``), so that tests stop
trees the way the product does and a lesson learned there reaches the tests too."""

from __future__ import annotations

import subprocess

from areal_mega.utils.procs import run as _run
from areal_mega.utils.procs import spawn, stop_tree

__all__ = ["run", "spawn", "stop_tree"]


def run(cmd: list[str], *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``areal_mega.utils.procs.run``; a timeout fails the test (AssertionError with the output)."""
    try:
        return _run(cmd, timeout=timeout, **popen_kwargs)
    except TimeoutError as e:
        raise AssertionError(str(e)) from None

"""Running torchrun (or any process tree) from tests without leaving orphans behind.

torchrun's agent starts every rank in a session of its own, so killing torchrun's process group
does not reach the ranks, and a SIGKILL of torchrun (what ``subprocess.run`` does on timeout)
gives the agent no chance to stop them: the orphaned ranks then wait in collectives, with their
inference servers, and eat the CI machine's two cores for the rest of the suite. SIGTERM first --
the agent forwards it to its ranks and waits for them -- and SIGKILL only what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess


def stop_tree(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop ``p`` (started with ``start_new_session=True``) and what it started."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # stragglers in its own group
    except ProcessLookupError:
        pass


def run(cmd: list[str], *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` whose timeout stops the tree
    with ``stop_tree`` and raises AssertionError with the output so far."""
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, **popen_kwargs)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:  # the timeout, or pytest's own (it interrupts the wait)
        stop_tree(p)
        out, err = p.communicate()
        raise AssertionError(f"stopped after {timeout} s at most: {' '.join(cmd)}\n{out[-4000:]}\n{(err or '')[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)

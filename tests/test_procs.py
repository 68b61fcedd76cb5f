"""tests/procs.py stops a torchrun tree, ranks included (~6 s). The control shows why it is
needed: SIGKILL of torchrun's process group leaves the ranks running (each has a session of its
own), which is how one failed test once slowed the rest of the suite from 17 to 30 minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import procs

pytestmark = pytest.mark.timeout(120)

RANK = "import os, sys, time\nopen(os.path.join(sys.argv[1], 'pid.' + os.environ['RANK']), 'w').write(str(os.getpid()))\ntime.sleep(600)\n"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp: Path) -> tuple[subprocess.Popen, list[int]]:
    (tmp / "rank.py").write_text(RANK)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp / "rank.py"), str(tmp)], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(tmp.glob("pid.*"))) < 2:
        assert time.monotonic() < deadline and p.poll() is None, "ranks did not start"
        time.sleep(0.2)
    time.sleep(0.2)  # the files are written in one call, but give it a moment to close
    return p, [int(f.read_text()) for f in sorted(tmp.glob("pid.*"))]


def test_stop_tree_reaches_torchrun_ranks(tmp_path: Path) -> None:
    (tmp_path / "control").mkdir()
    control, ranks = _start(tmp_path / "control")
    try:
        os.killpg(control.pid, signal.SIGKILL)
        control.wait()
        time.sleep(1)
        assert all(_alive(r) for r in ranks), "control: the ranks died with torchrun's group"
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)

    (tmp_path / "run").mkdir()
    p, ranks = _start(tmp_path / "run")
    procs.stop_tree(p, grace_s=30)
    deadline = time.monotonic() + 10
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(r) for r in ranks), "ranks outlived stop_tree"

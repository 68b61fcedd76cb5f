"""areal_mega.utils.procs: process trees stop completely, and die with their parent (~15 s).

The controls show why each mechanism is needed: SIGKILL of torchrun's process group leaves the
ranks running (each rank has a session of its own) -- how one failed test once slowed the rest
of the suite from 17 to 30 minutes -- and a plainly started child outlives its SIGKILLed parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_mega.utils import procs

pytestmark = pytest.mark.timeout(120)

# A torchrun rank: writes its pid, then sleeps.
RANK = ("import os, sys, time\n"
        "p = os.path.join(sys.argv[1], 'pid.' + os.environ['RANK'])\n"
        "open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p)\n"
        "time.sleep(600)\n")

# A command that leaves a detached daemon (double fork + setsid) and then keeps running (or exits).
# The middle process exits once the daemon says (over a pipe) that its pid is written, so the
# command never ends before the daemon is known (a wrapper could otherwise kill it first).
DAEMON = ("import os, sys, time\n"
          "p = os.path.join(sys.argv[1], 'pid.daemon')\n"
          "r, w = os.pipe()\n"
          "if os.fork() == 0:\n"
          "    os.setsid()\n"
          "    if os.fork() == 0:\n"
          "        open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p)\n"
          "        os.write(w, b'1')\n"
          "        time.sleep(600)\n"
          "    os.read(r, 1)\n"
          "    os._exit(0)\n"
          "os.wait()\n"
          "if sys.argv[2] == 'stay':\n"
          "    time.sleep(600)\n")


def _alive(pid: int) -> bool:
    return bool(procs.alive([pid]))


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _pids(d: Path, n: int) -> list[int]:
    """The pids written to ``d`` once there are ``n`` (each file appears complete: rename)."""
    files = lambda: [f for f in sorted(d.glob("pid.*")) if not f.name.endswith(".tmp")]  # noqa: E731
    _wait(lambda: len(files()) >= n, 60, f"{n} pid files in {d}")
    return [int(f.read_text()) for f in files()]


def _torchrun(d: Path) -> list[str]:
    d.mkdir()
    (d / "rank.py").write_text(RANK)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(d / "rank.py"), str(d)]


@pytest.mark.slow
def test_stop_tree_reaches_torchrun_ranks(tmp_path: Path) -> None:
    control = procs.spawn(_torchrun(tmp_path / "control"), wrap=False,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _pids(tmp_path / "control", 2)
    try:
        os.killpg(control.pid, signal.SIGKILL)
        control.wait()
        # torchrun is gone once its ranks have been re-parented away from it.
        _wait(lambda: all(pid not in procs.children(control.pid) for pid in ranks), 10, "re-parenting")
        assert all(_alive(r) for r in ranks), "control: the ranks died with torchrun's group"
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)

    p = procs.spawn(_torchrun(tmp_path / "run"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = _pids(tmp_path / "run", 2)
    procs.stop_tree(p, grace_s=30)
    # stop_tree returns once the tree is gone: no waiting here.
    assert not any(_alive(r) for r in ranks), "ranks outlived stop_tree"


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", [False, True], ids=["control_plain", "die_with_parent"])
def test_sigkilled_parent_leaves_no_tree(tmp_path: Path, wrapped: bool) -> None:
    """A parent starts torchrun (2 ranks) and a command that leaves a setsid daemon, then is
    SIGKILLed. With the wrapper nothing of either tree survives; without it (control) all do."""
    d = tmp_path / "t"
    parent_code = (
        "import subprocess, sys, time\n"
        "from areal_mega.utils import procs\n"
        f"a = procs.spawn({_torchrun(d)!r}, wrap={wrapped}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"b = procs.spawn([sys.executable, '-c', {DAEMON!r}, {str(d)!r}, 'stay'], wrap={wrapped})\n"
        f"open({str(tmp_path / 'leaders')!r}, 'w').write(f'{{a.pid}} {{b.pid}}')\n"
        "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=Path(__file__).parents[1],
                              start_new_session=True)
    try:
        pids = _pids(d, 3)  # two ranks and the daemon
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if wrapped:
            _wait(lambda: not procs.alive(pids), 15, "the trees to die with their parent")
        else:
            # Orphaned (nothing is a child of the dead parent any more), and still alive.
            _wait(lambda: not procs.children(parent.pid), 10, "re-parenting")
            assert procs.alive(pids) == set(pids), "control: the trees died without the wrapper"
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
        if (tmp_path / "leaders").exists():  # the control's survivors: both groups
            for g in map(int, (tmp_path / "leaders").read_text().split()):
                procs.signal_group(g, signal.SIGKILL)
        for f in d.glob("pid.*"):
            if not f.name.endswith(".tmp") and _alive(int(f.read_text())):
                os.kill(int(f.read_text()), signal.SIGKILL)


@pytest.mark.slow
def test_wrapper_kills_what_its_command_leaves_behind(tmp_path: Path) -> None:
    """The wrapped command exits after leaving a setsid daemon: the wrapper (a subreaper)
    kills the daemon and exits with the command's status."""
    d = tmp_path / "t"
    d.mkdir()
    p = procs.spawn([sys.executable, "-c", DAEMON + "sys.exit(3)\n", str(d), "exit"])
    assert p.wait(timeout=60) == 3
    daemon = _pids(d, 1)[0]
    assert not _alive(daemon), "the daemon outlived the wrapped command"


def test_free_ports_distinct() -> None:
    assert len(set(procs.free_ports(16))) == 16
    ranged = procs.free_ports(8, low=20000, high=32000)
    assert len(set(ranged)) == 8 and all(20000 <= q < 32000 for q in ranged)


def test_free_port_block_is_consecutive_free_and_below_the_ephemeral_range() -> None:
    import socket

    lo, hi = procs.SERVICE_PORTS
    assert hi <= 32768  # Linux's ephemeral range starts there: no outgoing connection takes these
    first = procs.free_port_block(3)
    assert lo <= first and first + 3 <= hi
    held = []
    try:
        for p in range(first, first + 3):  # all three bind now
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", p))
        # control: with those held, a block that must contain them is refused
        with pytest.raises(OSError, match="no 2 consecutive free ports"):
            procs.free_port_block(2, low=first, high=first + 3)
    finally:
        for s in held:
            s.close()


@pytest.mark.slow
def test_wrapper_redacts_secrets_from_the_output(tmp_path: Path) -> None:
    """The values of a redact file never reach the command's output (SGLang logs its API key)."""
    secret_file = tmp_path / "secret.yaml"
    secret_file.write_text('api-key: "s3cr3t-value"\n')
    log = tmp_path / "out.log"
    code = "import sys; print('key=s3cr3t-value ok'); print('err s3cr3t-value', file=sys.stderr)"
    with open(log, "wb") as f:
        p = procs.spawn([sys.executable, "-c", code], redact=secret_file, stdout=f, stderr=subprocess.STDOUT)
        assert p.wait(timeout=60) == 0
    out = log.read_text()
    assert "key=*** ok" in out and "err ***" in out and "s3cr3t" not in out


# A group leader that leaves a member behind and exits; the member says when SIGTERM arrives.
LEAVER = ("import os, signal, sys, time\n"
          "if os.fork() == 0:\n"
          "    def term(*_):\n"
          "        open(os.path.join(sys.argv[1], 'got_term'), 'w').close(); os._exit(0)\n"
          "    signal.signal(signal.SIGTERM, term)\n"
          "    p = os.path.join(sys.argv[1], 'pid.member')\n"
          "    open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p)\n"
          "    time.sleep(600)\n"
          "    os._exit(0)\n")


@pytest.mark.slow
def test_stop_tree_terms_a_group_whose_leader_exited(tmp_path: Path) -> None:
    """The leader exited, a member of its group lives on: stop_tree gives the member SIGTERM
    (its chance to clean up), not a bare SIGKILL once the grace period is over."""
    d = tmp_path / "t"
    d.mkdir()
    leader = subprocess.Popen([sys.executable, "-c", LEAVER, str(d)], start_new_session=True)
    member = _pids(d, 1)[0]
    leader.wait(timeout=60)
    assert _alive(member) and procs.group_pids(leader.pid) == [member]
    try:
        procs.stop_tree(leader, grace_s=60)
        assert (d / "got_term").exists(), "the member got no SIGTERM"
        assert not _alive(member)
    finally:
        if _alive(member):
            os.kill(member, signal.SIGKILL)


@pytest.mark.slow
def test_stop_tree_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    """A leader reaped before the stop: its number may now be an unrelated process's, leading a
    group of its own (a server started since). stop_tree must not signal that group. (Simulated:
    the reaped Popen's pid set to a live session leader's; the old code SIGKILLed it.)"""
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait(timeout=60)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        gone.pid = other.pid  # the number now belongs to `other`, leader of its own group
        procs.stop_tree(gone, grace_s=2)
        assert other.poll() is None, "stop_tree killed an unrelated process that reused the pid"
    finally:
        other.kill()
        other.wait(timeout=60)


def test_logs_have_one_header_per_attempt_and_tails_show_the_current_one(tmp_path):
    """Reruns and restarts append to one log; each start writes ``=== attempt N at <UTC>: <cmd>``
    and a failure's tail shows only the current attempt (issue 27: the tail once showed the
    previous attempt's error as if it were this one's)."""
    import re

    from areal_mega.utils.logs import attempt_tail, open_attempt

    log = tmp_path / "engine0.log"
    with open_attempt(log, ["/no/python", "-m", "sglang.launch_server"]) as f:
        f.write(b"FileNotFoundError: /no/python\n")
    with open_attempt(log, "/venv/bin/python -m sglang.launch_server") as f:
        f.write(b"loading weights\n" * 3 + b"ready\n")
    text = log.read_text()
    heads = re.findall(r"^=== attempt (\d+) at (\S+): (.*)$", text, re.M)
    assert [h[0] for h in heads] == ["1", "2"] and heads[0][2] == "/no/python -m sglang.launch_server"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", heads[1][1])
    t = attempt_tail(log, 40)
    assert t.startswith("=== attempt 2 at ") and "FileNotFoundError" not in t and t.endswith("ready")
    assert attempt_tail(log, 2) == "loading weights\nready"
    assert attempt_tail(tmp_path / "none.log", 5).startswith("(no log at")

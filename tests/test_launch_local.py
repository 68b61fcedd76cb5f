"""The local launcher end to end with stand-in engines and learners (no torch in the children):
an engine crash is logged and tolerated; a learner rank's death stops everything with that
rank's log tail and a non-zero exit; SIGINT stops everything, SIGTERM/SIGUSR1 first ask the
learners to checkpoint (exit 75 once they did); kill -9 of the launcher leaves nothing behind. Runtime ~30 s (three torchrun launches; up to ~80 s on a loaded machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from areal_mega.utils.procs import free_port_block, service_ports

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test runs the launcher with its torchrun and engine processes


def _config(tmp: Path, marker: str, *, die_rank: int | None, engine_die_after: float | None) -> Path:
    master, p0 = service_ports(1)[0], free_port_block(2)  # engine1 uses p0 + 1
    learner = ["tests/launch_standins/learner.py", "--engines", "{engine_addresses}", "--out", "{run_dir}/out",
               "--marker", marker, "--hold", "1"]
    if die_rank is not None:
        learner += ["--die-rank", str(die_rank), "--exit-code", "3"]
    engine = ["{python}", "tests/launch_standins/engine.py", "--host", "{host}", "--port", "{port}",
              "--marker", marker, "--lifetime", "120"]
    cfg = {"launch": {
        "run_dir": str(tmp / "run-{job_id}"), "stop_grace_s": 5, "poll_interval_s": 0.2,
        "learner": {"num_nodes": 1, "nproc_per_node": 2, "master_port": master, "command": learner},
        "engine": {"num_engines": 2, "command": engine, "startup_timeout_s": 60},
    }, "inference": {"server": {"port": p0}}}
    if engine_die_after is not None:  # only engine1 crashes, after it was announced ready
        engine += ["--index", "{engine_index}", "--die-index", "1", "--die-after", str(engine_die_after)]
        # no restart: this checks the failover (the restart: test_launch_plan's supervisor tests)
        cfg["inference"]["client"] = {"restart_dead_servers": False}
    cfg["launch"]["engine"]["command"] = engine
    path = tmp / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(cfg: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "areal_mega.launcher", "local", "--config", str(cfg)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _leftovers(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if marker in ln]


def _holding_config(tmp: Path, marker: str, **launch) -> Path:
    """A config whose stand-in learners hold for 300 s (they would run 5 min), plus ``launch.*``
    settings; ``stop_file=True`` makes them watch the trainer's stop file."""
    cfg = _config(tmp, marker, die_rank=None, engine_die_after=None)
    data = yaml.safe_load(cfg.read_text())
    data["launch"]["learner"]["command"][-1] = "300"
    if launch.pop("stop_file", False):
        data["launch"]["learner"]["command"] += ["--stop-file", "{stop_file}"]
    data["launch"].update(launch)
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _start_until_ranks(tmp: Path, cfg: Path, **popen_kwargs) -> subprocess.Popen:
    """The launcher, running, once both learner ranks have written their report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "areal_mega.launcher", "local", "--config", str(cfg)],
                            cwd=REPO, env=env, **popen_kwargs)
    out_dir = tmp / "run-local" / "out"
    deadline = time.monotonic() + 90
    while not (out_dir / "rank1.json").exists() or not (out_dir / "rank0.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
            raise AssertionError(f"learners did not start:\n{out}")
        time.sleep(0.2)
    return proc


def test_local_launch_runs_and_tolerates_engine_crash(tmp_path):
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _config(tmp_path, marker, die_rank=None, engine_die_after=1.0)
    r = _launch(cfg)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "2/2 engines ready" in out
    assert "engine1 on localhost" in out and "exited with 7" in out and "fails over" in out, out
    ranks = [json.loads((tmp_path / "run-local" / "out" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [x["world"] for x in ranks] == [2, 2] and [x["omp"] for x in ranks] == ["1", "1"]
    assert "all learners finished" in out
    assert _leftovers(marker) == []


def test_local_launch_learner_death_stops_everything(tmp_path):
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _config(tmp_path, marker, die_rank=1, engine_die_after=None)
    r = _launch(cfg)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "learner rank 1 (local rank 1) failed with exit code 3" in out, out
    assert f"rank 1 last words: simulated failure {marker}" in out
    assert _leftovers(marker) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_local_launch_signal_stops_everything(tmp_path, sig):
    """Ctrl-C (SIGINT) stops every process tree at once; SIGTERM (scancel, preemption) first asks
    the learners to checkpoint and stop -- these stand-ins ignore that -- and stops everything
    when launch.preempt_grace_s (here 2 s) has passed. Either way nothing is left."""
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _holding_config(tmp_path, marker, preempt_grace_s=2)
    proc = _start_until_ranks(tmp_path, cfg, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert len(_leftovers(marker)) >= 4  # 2 engines + 2 ranks (+ wrappers)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # the test failed before the signal: still let the launcher clean up
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 128 + sig, out
    if sig == signal.SIGINT:
        assert "received signal 2; stopping every process" in out
    else:
        assert "asked the learners to checkpoint and stop" in out
        assert "did not stop within launch.preempt_grace_s=2 s of signal 15" in out
    assert _leftovers(marker) == []


def test_local_launch_sigkill_leaves_nothing(tmp_path):
    """kill -9 of the launcher alone (the OOM killer's favourite target): it runs no cleanup, yet
    within seconds no engine, learner rank or wrapper of the run is left -- every process it
    started sits behind areal_mega.utils.procs' die-with-parent wrapper, which kills its tree
    (torchrun's ranks included: they are in sessions of their own) when the launcher dies."""
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _holding_config(tmp_path, marker)
    proc = _start_until_ranks(tmp_path, cfg, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        before = _leftovers(marker)
        assert len(before) >= 4, before  # 2 engines + 2 ranks (+ wrappers)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while _leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _leftovers(marker)
        print(f"processes of the run: {len(before)} before the SIGKILL, {len(left)} after")
        assert left == [], "\n".join(left)
    finally:
        for line in _leftovers(marker):
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_local_launch_usr1_checkpoints_and_exits_requeue(tmp_path):
    """SIGUSR1 (Slurm's time-limit warning) to the launcher: it creates the learners' stop file,
    they "checkpoint" and exit 0, and the launcher exits 75 (requeue) with nothing left behind."""
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _holding_config(tmp_path, marker, preempt_grace_s=60, stop_file=True)
    proc = _start_until_ranks(tmp_path, cfg, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_dir = tmp_path / "run-local" / "out"
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    assert proc.returncode == 75, out
    assert (out_dir / "saved0").exists() and (out_dir / "saved1").exists(), out
    assert "checkpointed and stopped after signal 10" in out and took < 30, (took, out)
    assert _leftovers(marker) == []

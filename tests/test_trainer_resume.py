"""Runs that survive (the real trainer, a real SGLang CPU server, the local launcher; ~4-7 min).

* kill -9 and rerun: the launcher's whole process tree is SIGKILLed after a checkpoint; the same
  command resumes from it. In synchronous mode (max_staleness 0) with a deterministic server
  (greedy decoding: top_k 1), the steps after the resume equal those of an uninterrupted run -- the same
  prompts in the same order (prompts.jsonl), rewards exactly, losses within 1e-6 -- and every
  prompt of an epoch is trained once, read from prompts.jsonl directly (the killed run's records
  past the checkpoint are moved to prompts.jsonl.superseded: each version appears once).

SIGUSR1 -> checkpoint -> exit 75 -> requeue -> resume with the real trainer is tested on the real
Slurm test cluster (tests/test_slurm_cluster.py); the launcher's side with stand-ins in
tests/test_launch_local.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from areal_mega.utils import procs
from tests.support.launch import REPO, SGLANG_PYTHON, child_env, needs_sglang
from tests.support.agents import TINY_CHAT_TEMPLATE
from tests.support.models import write_tiny_task

pytestmark = [pytest.mark.slow, needs_sglang, pytest.mark.timeout(1800)]

STEPS = 6
SAVE_EVERY = 2


def _command(tmp: Path, work: Path, name: str, port: int, *extra: str) -> list[str]:
    model, data = work / "model", work / "data"
    return [sys.executable, "-m", "areal_mega.launcher", "local", "--config", "configs/grpo_tiny.yaml",
            f"model_path={model}", f"output_dir={tmp / name}", f"data.path={data / 'train.jsonl'}",
            f"eval_data.path={data / 'test.jsonl'}", f"launch.run_dir={tmp / (name + '-run')}",
            "parallel.tensor_parallel=1", "launch.learner.nproc_per_node=1", f"inference.server.port={port}",
            f"launch.learner.master_port={procs.service_ports(1)[0]}",
            f"inference.server.python={SGLANG_PYTHON}", "inference.server.startup_timeout_s=900",
            f"trainer.num_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}", "trainer.eval_every=0",
            "trainer.eval_at_start=false", "trainer.eval_at_end=false", "trainer.export_hf_at_end=false",
            # Deterministic: synchronous RL, greedy decoding (top_k 1: the learner's log-probs stay
            # at temperature 1); REINFORCE++ so that greedy samples (one per prompt) still carry a
            # learning signal (rewards differ between prompts).
            "rollout.max_staleness=0", "rollout.batch_size=6", "workflow.group_size=1",
            "workflow.sampling.top_k=1", "algorithm.adv_estimator=reinforce_pp", *extra]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_version(rows: list[dict], key: str = "version") -> dict[int, dict]:
    """Rows by version (each once: checked by _compare)."""
    return {int(r[key]): r for r in rows}


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "ab")
    return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(cond, proc: subprocess.Popen, log: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-6000:]}"
        time.sleep(0.5)


def _kill_tree_now(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the launcher's tree at once (no one gets to clean up)."""
    pids = procs.tree_pids(proc.pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 30
    while procs.alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _compare(ref: Path, got: Path, from_version: int) -> None:
    # The logs hold each step once: the killed run's records past its checkpoint were moved to
    # *.superseded by the resumed run (areal_mega/trainer/runlog.py), not left beside the redo.
    steps = [r["step"] for r in _rows(got / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1)), steps
    versions = [r["version"] for r in _rows(got / "prompts.jsonl")]
    assert versions == list(range(STEPS)), versions
    a, b = _by_version(_rows(ref / "metrics.jsonl")), _by_version(_rows(got / "metrics.jsonl"))
    for v in range(from_version, STEPS + 1):
        assert b[v]["rollout/reward_mean"] == a[v]["rollout/reward_mean"], (v, a[v], b[v])
        # fp32 learner on the same machine and the same batch: the resumed step is the same
        # computation; 1e-6 leaves room for a reduction order only.
        assert abs(b[v]["train/loss"] - a[v]["train/loss"]) <= 1e-6, (v, a[v]["train/loss"], b[v]["train/loss"])
    pa, pb = _by_version(_rows(ref / "prompts.jsonl")), _by_version(_rows(got / "prompts.jsonl"))
    assert {v: pb[v]["prompts"] for v in pb} == {v: pa[v]["prompts"] for v in pa}
    # Every prompt of an epoch at most once (the uninterrupted run's epoch 0 covers them all once).
    seen = Counter((e, pid) for r in _rows(got / "prompts.jsonl") for e, _, pid in r["prompts"])
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    tmp = tmp_path_factory.mktemp("resume")
    work = tmp / "task"
    write_tiny_task(work)
    log = tmp / "ref.log"
    proc = _start(_command(tmp, work, "ref", procs.free_port()), log)
    try:
        assert proc.wait(timeout=1500) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    return tmp, work


def test_kill9_of_the_whole_tree_then_rerun_resumes_exactly(reference):
    tmp, work = reference
    cmd = _command(tmp, work, "killed", procs.free_port())
    log = tmp / "killed.log"
    proc = _start(cmd, log)
    metrics = tmp / "killed" / "metrics.jsonl"
    ckpt = tmp / "killed" / "checkpoints" / f"step{SAVE_EVERY:06d}"
    try:
        # After the first checkpoint and at least one more step: steps to redo after the resume.
        _wait(lambda: (ckpt / "areal_mega.json").exists() and len(_rows(metrics)) >= SAVE_EVERY + 1,
              proc, log, 1200, "a checkpoint and one more step")
        _kill_tree_now(proc)
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    killed_at = len(_rows(metrics))
    proc = _start(cmd, log)  # the same command again
    try:
        assert proc.wait(timeout=1500) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    learner_log = (tmp / "killed-run" / "logs" / "learner0.log").read_text()
    assert "resume: loading" in learner_log, learner_log[-4000:]
    print(f"killed after {killed_at} steps; resumed from step {SAVE_EVERY}")
    _compare(tmp / "ref", tmp / "killed", from_version=SAVE_EVERY + 1)


# Long completions in flight at every checkpoint (the random tiny model rarely says EOS: its
# answers run to max_new_tokens), asynchronous (max_staleness 1: episodes of the next steps run
# while a step trains and while the checkpoint is written).
INFLIGHT = ["rollout.max_staleness=1", "workflow.sampling.max_new_tokens=192", "rollout.max_concurrent=12"]


def _assert_bound_and_exactly_once(rows: list[dict], out: Path) -> None:
    """Every step within max_staleness 1; every batch logged once, no prompt and no episode id
    trained twice (prompts.jsonl)."""
    assert all(r["staleness/max"] <= 1 for r in rows), [r["staleness/max"] for r in rows]
    prompts = _rows(out / "prompts.jsonl")
    assert [r["version"] for r in prompts] == list(range(STEPS))
    seen = Counter((e, i) for r in prompts for e, i, _ in r["prompts"])
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
    episodes = [u for r in prompts for u in r.get("episodes", [])]
    assert len(episodes) == len(set(episodes)) == sum(len(r["prompts"]) for r in prompts)


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["single_turn", "multi_turn", "agent"])
def test_kill9_with_long_completions_in_flight_trains_the_saved_tokens(tmp_path: Path, kind: str):
    """kill -9 of the whole tree right after a checkpoint that saved episodes mid-generation
    (rollout.save_in_flight; a checkpoint every step, the first one holding a partial call --
    multi_turn: an episode past its second turn -- is the one killed after), the same command
    again: every saved token is trained and none generated again (``rollout/resume/
    replayed_tokens`` = the checkpoint's saved tokens, ``lost_tokens`` 0), every prompt trained
    once, no episode twice, and the staleness bound holds on every trained token
    (``staleness/max``; the controller's own check raises otherwise). multi_turn: three attempts
    per sample (the random model is always wrong), 40 tokens each (the tiny model's context is
    256), an episode saved after turn two resumes at turn three; agent: the same with an agent
    written against the OpenAI client (three chat calls), its replay never diverging from the
    saved turns."""
    work = tmp_path / "task"
    write_tiny_task(work)
    extra = [*INFLIGHT, "trainer.save_every=1"]
    if kind == "multi_turn":
        extra += ["workflow.kind=multi_turn", "workflow.max_turns=3", "workflow.sampling.max_new_tokens=40"]
    if kind == "agent":  # an agent written against the OpenAI client, three chat calls per episode
        (work / "model" / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
        extra += ["workflow.kind=agent", "workflow.max_turns=3", "workflow.sampling.max_new_tokens=40",
                  "workflow.options.function=tests.support.agents:three_calls"]
    cmd = _command(tmp_path, work, "run", procs.free_port(), *extra)
    log = tmp_path / "run.log"
    out = tmp_path / "run"

    def wanted(eps: list[dict]) -> bool:
        if kind != "single_turn":  # an episode past its second turn
            return any(sum(c["finish"] is not None for c in e["calls"]) >= 2 for e in eps)
        return any(c["finish"] is None and c["ids"] for e in eps for c in e["calls"])

    def found() -> bool:
        for ckpt in sorted((out / "checkpoints").glob("step*")):
            state = ckpt / "rollout_state.json"
            if (ckpt / "areal_mega.json").exists() and state.exists() and ckpt.name < f"step{STEPS:06d}":
                if wanted(json.loads(state.read_text())["episodes"]):
                    return True
        return False

    proc = _start(cmd, log)
    try:
        _wait(found, proc, log, 1500, "a checkpoint holding what this test needs")
        _kill_tree_now(proc)
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    proc = _start(cmd, log)  # the same command again
    try:
        assert proc.wait(timeout=1500) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    learner_log = (tmp_path / "run-run" / "logs" / "learner0.log").read_text()
    loaded = [line.split("resume: loading ", 1)[1].strip() for line in learner_log.splitlines() if "resume: loading " in line]
    assert loaded, learner_log[-4000:]
    ckpt = Path(loaded[-1])
    step = int(ckpt.name.removeprefix("step"))
    saved = json.loads((ckpt / "rollout_state.json").read_text())["episodes"]
    calls = [c for e in saved for c in e["calls"]]
    saved_tokens = sum(len(c["ids"]) for c in calls)
    assert wanted(saved), [[(len(c["ids"]), c["finish"]) for c in e["calls"]] for e in saved]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    resumed = [r for r in rows if r["step"] > step]
    replayed = sum(r.get("rollout/resume/replayed_tokens", 0) for r in resumed)
    trained = sum(r["rollout/num_generated_tokens"] for r in resumed)
    print(json.dumps({"kind": kind, "resumed_from_step": step, "saved_episodes": len(saved),
                      "saved_tokens": saved_tokens, "saved_partial_calls": sum(c["finish"] is None and bool(c["ids"]) for c in calls),
                      "saved_finished_calls": sum(c["finish"] is not None for c in calls),
                      "replayed_tokens": replayed, "trained_tokens_after_resume": trained}))
    assert replayed == saved_tokens > 0
    assert sum(r.get("rollout/resume/lost_tokens", 0) for r in resumed) == 0
    assert sum(r.get("rollout/resume/dropped_stale", 0) for r in resumed) == 0
    assert sum(r.get("rollout/resume/diverged", 0) for r in resumed) == 0  # the replay followed the saved turns
    _assert_bound_and_exactly_once(rows, out)


@pytest.mark.heavy
def test_kill9_between_checkpoints_resumes_the_in_flight_snapshot(tmp_path: Path):
    """trainer.rollout_snapshot_every: 1 with a learner checkpoint every 3 steps; kill -9 of the
    whole tree once a snapshot exists, the same command again: it resumes from the snapshot's
    learner checkpoint and the snapshot's tokens of that checkpoint's versions are trained, not
    generated again (``replayed_tokens``); newer ones are cut (``cut_tokens``), episodes admitted
    later run again from the prompt (``dropped_newer``); every prompt trained once, no episode
    twice, the staleness bound holds."""
    work = tmp_path / "task"
    write_tiny_task(work)
    cmd = _command(tmp_path, work, "run", procs.free_port(), *INFLIGHT, "trainer.save_every=3",
                   "trainer.rollout_snapshot_every=1")
    log, out = tmp_path / "run.log", tmp_path / "run"
    snap_file = out / "checkpoints" / "rollout_snapshot.json"
    proc = _start(cmd, log)
    try:
        # one past the learner checkpoint at step 3: the kill falls between two checkpoints
        _wait(lambda: snap_file.exists() and json.loads(snap_file.read_text())["base_step"] == 3, proc, log, 1500,
              "a rollout snapshot on checkpoint 3")
        _kill_tree_now(proc)
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    snap = json.loads(snap_file.read_text())  # the last one written before the kill
    snap_bytes = snap_file.stat().st_size
    base, eps = snap["base_step"], snap["rollout"]["episodes"]
    proc = _start(cmd, log)
    try:
        assert proc.wait(timeout=1500) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            procs.stop_tree(proc)
    learner_log = (tmp_path / "run-run" / "logs" / "learner0.log").read_text()
    assert f"(step {snap['step']} on checkpoint {base})" in learner_log, learner_log[-4000:]
    old = [v for e in eps if e["admit_version"] <= base for c in e["calls"] for v in c["vers"]]
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    resumed = [r for r in rows if r["step"] > base]
    got = Counter()
    for r in resumed:
        got.update({k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("rollout/resume/")})
    print(json.dumps({"snapshot_step": snap["step"], "base_step": base, "snapshot_bytes": snap_bytes,
                      "snapshot_s": [r["time/snapshot_s"] for r in rows if "time/snapshot_s" in r], "snapshot_episodes": len(eps),
                      "snapshot_tokens_at_or_before_base": sum(v <= base for v in old),
                      "snapshot_tokens_newer": sum(v > base for v in old), "resume_counts": got}))
    assert got["replayed_tokens"] == sum(v <= base for v in old) > 0
    assert got["cut_tokens"] == sum(v > base for v in old)
    assert got["dropped_newer"] == sum(e["admit_version"] > base for e in eps)
    _assert_bound_and_exactly_once(rows, out)

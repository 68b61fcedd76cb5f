"""launch/*.sh submitted with sbatch to a real Slurm cluster that this module brings up on the
machine (slurm/local_cluster.py: 16 virtual nodes x 8 fake GPUs, ~1-5 s to idle) and tears
down by PID at the end. Skipped only if slurm-wlm cannot be installed.

    1. sbatch launch/grpo_70b.sh --dry-run: the plan fits 80 GB GPUs (learner and engine numbers).
    2. ... with parallel.tensor_parallel=1: refused, exit 2, numbers printed.
    3. launch/grpo_tiny.sh with stand-in engines/learners on 4 CPU nodes: learners see every
       engine at its node's own address; then a learner rank dies: the job fails within 60 s
       with that rank's log tail, and no process carrying the job's marker is left.
    4. launch/grpo_tiny.sh with the REAL trainer and two real SGLang CPU servers on 4 nodes:
       its servers refuse requests without the job's key (401); after the first step the batch
       shell gets USR1 (what --signal=B:USR1@N sends before the time limit): the learners
       checkpoint, the job requeues itself, the second run resumes from the saved version,
       trains and syncs weights up to TINY_STEPS, and leaves TensorBoard logs and a checkpoint.
Runtime ~40-60 s on 2 busy cores for 1-3 (most of it torchrun start-up inside the jobs); 4 adds
the SGLang start-up (~1 min).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from areal_mega.utils.procs import service_ports
from slurm.local_cluster import ClusterUnavailable, LocalSlurmCluster
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import write_tiny_task

pytestmark = pytest.mark.slow  # a Slurm cluster of processes on this machine
REPO = Path(__file__).resolve().parents[1]
NUM_NODES, GPUS = 16, 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    c = LocalSlurmCluster(root, num_nodes=NUM_NODES, gpus_per_node=GPUS)
    try:
        c.up(timeout_s=60)
    except ClusterUnavailable as e:
        if "apt-get" in str(e) or "install" in str(e):
            pytest.skip(f"Slurm unavailable: {e}")
        raise
    try:
        yield c
    finally:
        c.down()


def _job_env() -> dict[str, str]:
    # The batch script runs `python` from PATH: the interpreter running these tests.
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def _submit(cluster, script: str, args: list[str], out: Path, timeout_s: float = 120) -> tuple[str, str, str, float]:
    t0 = time.monotonic()
    job = cluster.sbatch([f"--output={out}", script, *args], cwd=REPO, env=_job_env())
    state, code = cluster.wait_job(job, timeout_s)
    return state, code, out.read_text() if out.exists() else "", time.monotonic() - t0


def _gib(text: str, role: str) -> tuple[float, float]:
    m = re.search(rf"{role} per-GPU memory .*?= ([\d.]+) GiB of ([\d.]+) GiB", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def _site_files(tmp: Path) -> list[str]:
    """Overrides pointing the 70B config's site paths (/models/..., /data/...) at stand-ins the
    pre-flight checks accept: a model directory with the config's own config.json (so the
    estimate is unchanged) and a chat template (data.template: chat), a data file, and an engine
    interpreter that finds sglang."""
    if not SGLANG_PYTHON:
        pytest.skip("AREAL_MEGA_SGLANG_PYTHON not set (the pre-flight check runs the engine interpreter)")
    model = tmp / "Llama-70B-config-only"
    model.mkdir(exist_ok=True)
    raw = yaml.safe_load((REPO / "configs/grpo_llama70b.yaml").read_text())
    (model / "config.json").write_text(json.dumps(raw["launch"]["model_config"]))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    data = tmp / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    return [f"model_path={model}", f"inference.server.model_path={model}", f"data.path={data}",
            f"inference.server.python={SGLANG_PYTHON}"]


def test_grpo_70b_dry_run_fits_80gb(cluster, tmp_path):
    # The site paths do not exist here: the pre-flight check refuses in seconds, one line, exit 2.
    state, code, out, _ = _submit(cluster, "launch/grpo_70b.sh", ["--dry-run"], tmp_path / "nofiles.out")
    assert (state, code) == ("FAILED", "2:0"), out
    assert "launcher: model_path: /models/Llama-3.3-70B-Instruct is not a directory" in out, out
    state, code, out, _ = _submit(cluster, "launch/grpo_70b.sh", ["--dry-run", *_site_files(tmp_path)],
                                  tmp_path / "dry.out")
    assert (state, code) == ("COMPLETED", "0:0"), out
    assert "preflight: ok model_path:" in out and "preflight: ok inference.server.python:" in out
    assert f"allocation: {NUM_NODES} nodes x {GPUS} GPUs" in out
    # launch.learner.num_nodes: null: the planner's split of the 16 nodes at the config's TP8 x PP4
    # (tests/test_launch_plan.py::test_split_follows_the_allocation): 8 + 8, DP2.
    assert "learners: 8 node(s) amnode1 amnode2" in out and "64 ranks, layout dp=2 pp=4 cp=1 tp=8" in out
    assert "engines: 8 server(s) x TP8 on 8 node(s) amnode9" in out and "split chosen by the planner" in out
    learner, limit = _gib(out, "learner")
    engine, budget = _gib(out, "engine")
    # The plan prints GiB with one decimal and the expectations are the estimates (tests/test_launch_plan.py)
    # rounded the same way: equal exactly.
    assert (learner, limit) == (34.5, 80.0)  # SP, full recompute, THD, optimizer over DP2 (configs/grpo_llama70b.yaml)
    assert (engine, budget) == (54.6, 68.0)
    # A dry run resolves no node names (it must work on a laptop): engines show their node name.
    assert out.count("--node-rank") == 8 and "--host amnode9 --port 30000" in out
    # The planner's recommendation and its plot, next to the dry run's output.
    assert "planner: recommended" in out and "predicted speedup over the best synchronous plan" in out
    assert re.search(r"planner: plan written to \S+/plan/plan\.json", out)
    assert "dry run: nothing started" in out


def test_grpo_70b_tp1_is_refused_with_numbers(cluster, tmp_path):
    args = ["--dry-run", "parallel.tensor_parallel=1", "launch.learner.num_nodes=4",  # the fixed 4 + 12 split
            *_site_files(tmp_path)]
    state, code, out, _ = _submit(cluster, "launch/grpo_70b.sh", args, tmp_path / "tp1.out")
    assert (state, code) == ("FAILED", "2:0"), out
    learner, limit = _gib(out, "learner")
    assert (learner, limit) == (157.4, 80.0)  # printed with one decimal: exact
    assert "DOES NOT FIT" in out and "refusing this plan" in out


def _tiny_config(tmp: Path, marker: str, die_rank: int | None) -> Path:
    master, engine_port = service_ports(2)
    learner = ["tests/launch_standins/learner.py", "--engines", "{engine_addresses}", "--out", "{run_dir}/out",
               "--marker", marker, "--hold", "1"]
    if die_rank is not None:
        learner += ["--die-rank", str(die_rank), "--exit-code", "3"]
    cfg = {"launch": {
        "run_dir": str(tmp / "run-{job_id}"), "stop_grace_s": 5, "poll_interval_s": 0.2,
        "learner": {"num_nodes": 2, "nproc_per_node": 2, "master_port": master, "command": learner},
        "engine": {"num_nodes": 2, "startup_timeout_s": 60,
                   "command": ["{python}", "tests/launch_standins/engine.py", "--host", "{host}", "--port",
                               "{port}", "--marker", marker, "--lifetime", "120"]},
    }, "inference": {"server": {"port": engine_port}}}
    path = tmp / f"tiny-{marker}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _leftovers(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if marker in ln]


def test_grpo_tiny_script_places_on_cpu_nodes(cluster, tmp_path):
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _tiny_config(tmp_path, marker, die_rank=None)
    state, code, out, _ = _submit(cluster, "launch/grpo_tiny.sh", ["--config", str(cfg)], tmp_path / "ok.out")
    assert (state, code) == ("COMPLETED", "0:0"), out
    job_dir = next(tmp_path.glob("run-*"))
    ranks = [json.loads((job_dir / "out" / f"rank{i}.json").read_text()) for i in range(4)]
    # 2 learner nodes x 2 ranks; each node has its own hostname; both engines (nodes 3, 4) answered.
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3] and {r["world"] for r in ranks} == {4}
    assert sorted({r["hostname"] for r in ranks}) == ["amnode1", "amnode2"]
    port = yaml.safe_load(cfg.read_text())["inference"]["server"]["port"]
    assert all(r["engines"] == {f"127.0.1.3:{port}": 200, f"127.0.1.4:{port}": 200} for r in ranks)
    assert all(r["master"] == "127.0.1.1" for r in ranks)
    engines = json.loads((job_dir / "engines.json").read_text())["engines"]
    assert [(e["node"], e["hostname"], e["url"]) for e in engines] == [
        ("amnode3", "amnode3", f"http://127.0.1.3:{port}"), ("amnode4", "amnode4", f"http://127.0.1.4:{port}")]
    assert _leftovers(marker) == []


def test_learner_rank_death_fails_job_with_its_log_and_no_leftovers(cluster, tmp_path):
    marker = f"amtest-{uuid.uuid4().hex[:8]}"
    cfg = _tiny_config(tmp_path, marker, die_rank=3)  # global rank 3 = node 1, local rank 1
    state, code, out, took = _submit(cluster, "launch/grpo_tiny.sh", ["--config", str(cfg)], tmp_path / "die.out")
    assert state == "FAILED" and code != "0:0", out
    assert took < 60, f"job took {took:.0f} s to end after a rank died"
    assert "learner node 1 (learner1 on amnode2) exited with 1: learner rank 3 (local rank 1) failed with exit code 3" in out
    assert f"rank 3 last words: simulated failure {marker}" in out
    assert "stopping every process of this launch" in out
    assert cluster.run(["squeue", "-h", "-s", "-o", "%i %j"]).stdout.strip() == ""
    assert _leftovers(marker) == []


def _probe_engine_auth(tmp: Path, result: dict, timeout_s: float = 900) -> None:
    """Once the job's engines are announced: /model_info without a key, with a wrong one, with
    the job's key (from its 0600 file). Fills ``result`` with the HTTP statuses."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = list(tmp.glob("run-*/engines.json"))
        if files:
            break
        time.sleep(0.5)
    else:
        return
    url = json.loads(files[0].read_text())["engines"][0]["url"]
    key = (files[0].parent / "secrets" / "api_key").read_text().strip()
    for name, header in (("no_key", None), ("wrong_key", "Bearer wrong"), ("job_key", f"Bearer {key}")):
        req = urllib.request.Request(url + "/model_info", headers={"Authorization": header} if header else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                result[name] = r.status
        except urllib.error.HTTPError as e:
            result[name] = e.code
        except OSError as e:
            result[name] = repr(e)


TINY_STEPS = 4


@pytest.mark.heavy  # 5+ min; make test keeps the same sbatch script's placement and failure paths
@needs_sglang
def test_grpo_tiny_real_trainer_on_4_nodes(cluster, tmp_path):
    """sbatch launch/grpo_tiny.sh with the REAL trainer and SGLang: learners (TP=2, one rank per
    node) on amnode1-2, one SGLang CPU server on each of amnode3-4; TINY_STEPS steps, each ending
    in a gloo weight sync to both servers; USR1 after the first step: checkpoint, requeue, resume;
    TensorBoard logs and a final checkpoint are left, and no process of the job."""
    work = tmp_path / "tiny"
    write_tiny_task(work)
    master, engine_port = service_ports(2)
    out_dir = tmp_path / "grpo"
    args = [
        f"model_path={work / 'model'}", f"output_dir={out_dir}", f"data.path={work / 'data' / 'train.jsonl'}",
        f"eval_data.path={work / 'data' / 'test.jsonl'}", f"inference.server.python={SGLANG_PYTHON}",
        f"inference.server.port={engine_port}", f"trainer.num_steps={TINY_STEPS}", "trainer.eval_every=0",
        "rollout.batch_size=4", "workflow.group_size=4",
        f"launch.run_dir={tmp_path / 'run-{job_id}'}", "launch.learner.num_nodes=2", "launch.learner.nproc_per_node=1",
        f"launch.learner.master_port={master}", "launch.engine.num_nodes=2", "launch.engine.num_engines=2",
    ]
    probe: dict = {}  # a request without the job's key, while the job runs (utils.secrets)
    prober = threading.Thread(target=_probe_engine_auth, args=(tmp_path, probe), daemon=True)
    prober.start()
    out_file = tmp_path / "real.out"
    job = cluster.sbatch([f"--output={out_file}", "launch/grpo_tiny.sh", *args], cwd=REPO, env=_job_env())
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (metrics.exists() and metrics.read_text().strip()):  # the first step is done
        state = cluster.job_fields(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, out_file.read_text() if out_file.exists() else "")
        assert time.monotonic() < deadline, "no step within 900 s"
        time.sleep(1)
    cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    state, code = "", ""
    while time.monotonic() < deadline + 900:  # the first run ends, the job requeues and runs again
        state, code = cluster.wait_job(job, 900)
        if state != "REQUEUED":
            break
        time.sleep(0.5)
    prober.join(timeout=30)
    out = out_file.read_text() if out_file.exists() else ""
    job_dir = next(tmp_path.glob("run-*"), None)
    logs = "\n".join(p.read_text()[-3000:] for p in (job_dir / "logs").glob("*.log")) if job_dir else ""
    assert (state, code) == ("COMPLETED", "0:0"), out + logs
    assert int(cluster.job_fields(job).get("Restarts", "0")) == 1, cluster.job_fields(job)
    assert "checkpointed and stopped after signal 10" in out and "requeueing job" in out, out
    assert "resume: loading" in (job_dir / "logs" / "learner0.log").read_text()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # The first run logged the steps up to its stop checkpoint, the second the rest: each once.
    assert [r["version"] for r in rows] == list(range(1, TINY_STEPS + 1)), rows
    assert _leftovers(str(out_dir)) == []
    assert all(r["weight_sync/seconds"] > 0 for r in rows)
    assert list((out_dir / "tb").glob("events.out.tfevents.*"))
    assert (out_dir / "checkpoints" / f"step{TINY_STEPS:06d}").is_dir()
    engines = json.loads((job_dir / "engines.json").read_text())["engines"]
    assert [e["node"] for e in engines] == ["amnode3", "amnode4"]
    # Every launch protects its servers with its own key: refused without it, served with it.
    assert probe == {"no_key": 401, "wrong_key": 401, "job_key": 200}, probe
    secrets_dir = job_dir / "secrets"
    key = (secrets_dir / "api_key").read_text().strip()
    assert (secrets_dir / "api_key").stat().st_mode & 0o777 == 0o600
    assert key not in out and not any(key in p.read_text(errors="replace") for p in (job_dir / "logs").rglob("*.log"))
    for e in engines:  # the job stopped its servers: nothing answers any more
        with pytest.raises(OSError):
            urllib.request.urlopen(e["url"] + "/health", timeout=5)

"""One SGLang CPU server spanning two virtual nodes of the project's real local Slurm cluster
(slurm/local_cluster.py), started by the launcher's own plan, synced from a megatron learner
launched by the same job, greedy = HF (``make test-slurm-nodes``; marker slurm_nodes).

    sbatch --nodes 4 --gpus-per-node 1 slurm/run_launcher.sh --gpus-per-node 1 --config C

Each node has one (fake) GPU, so ``inference.server.tp_size: 2`` is a server spanning two nodes
(SGLang --nnodes 2): the plan puts node rank 0 on amnode3 (serving HTTP at 127.0.1.3) and node rank 1
on amnode4 (bound to 127.0.1.4), both behind engine_proc and their own srun step; the launch's
learner (``launch.learner.command``) is tests/dist/wsync_moe.py, an EP2 megatron learner over two
nodes (amnode1-2, torchrun), which syncs its perturbed weights into the server with the product's
weight sync -- broadcast (each engine rank receives in its own node) or reshard (each engine rank
receives its own shard there) -- and decodes greedily. The test then runs
tests/test_families_serve.py's check_served_sync: log-probs = the learner's within the fp32 bound,
greedy = HF on the learner's exported weights, the unsynced v0 server fails both. A second test
kills node 1's SGLang process: the launcher restarts the whole server and the job goes on.

What each node's SGLang process needs on CPU: ``SGLANG_CPU_OMP_THREADS_BIND`` with one entry per
TP rank *of that node* (SGLang indexes it by the rank's node-local device id), so "0" on every node
here (one rank per node); without it SGLang asserts at start-up (docs/launch.md).
One TP2 server start (3-5 min under load) + the learner: minutes, so not ``make test``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.request
import time
from pathlib import Path

import pytest
import yaml

from areal_mega.utils.procs import service_ports
from slurm.local_cluster import ClusterUnavailable, LocalSlurmCluster
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import save_tiny_model
from tests.test_families_serve import BASE, FAMILIES, check_served_sync
from tests.test_weight_sync_moe import MOE_SYNC

pytestmark = [pytest.mark.slow, pytest.mark.slurm_nodes, needs_sglang]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), num_nodes=4, gpus_per_node=1)
    try:
        c.up(timeout_s=60)
    except ClusterUnavailable as e:
        pytest.skip(f"Slurm unavailable: {e}")
    try:
        yield c
    finally:
        c.down()


def _config(tmp_path: Path, hf: Path, learner: list[str], port: int, master: int) -> Path:
    """4 nodes x 1 fake GPU: learners (``learner``, torchrun) on amnode1-2, one TP2 server on amnode3-4."""
    cfg = {
        "model_path": str(hf),
        "inference": {"num_servers": 1, "server": {
            "python": SGLANG_PYTHON, "model_path": str(hf), "device": "cpu", "dtype": "float32", "tp_size": 2,
            "port": port, "max_total_tokens": 4096, "startup_timeout_s": 1200,
            "env": {"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0"}}},
        "launch": {
            "run_dir": str(tmp_path / "run-{job_id}"), "stop_grace_s": 10, "poll_interval_s": 0.5,
            "learner": {"num_nodes": 2, "nproc_per_node": 1, "master_port": master, "command": learner},
            "engine": {"num_nodes": 2, "startup_timeout_s": 1200},
        },
    }
    path = tmp_path / "two_nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _submit(cluster, path: Path, log: Path) -> int:
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    return cluster.sbatch([f"--output={log}", "--nodes=4", "--gpus-per-node=1", "--exclusive", "--time=01:00:00",
                           "slurm/run_launcher.sh", "--gpus-per-node", "1", "--config", str(path)], cwd=REPO, env=env)


# weight_sync.mode -> the tiny family synced: broadcast takes any family (Mixtral); reshard has SGLang
# layouts for Llama/Qwen2/Qwen3/Qwen3-MoE/DeepSeek-V3 (weight_sync/reshard), so Qwen3-MoE, with the
# families' large init (sharp logits: greedy decisive in fp32).
MODELS = {"broadcast": ("mixtral", {**BASE, **FAMILIES["mixtral"]}),
          "reshard": ("qwen3_moe", {**MOE_SYNC, "initializer_range": 0.2})}


@pytest.mark.parametrize("mode", list(MODELS))
def test_tp2_server_spanning_two_slurm_nodes_synced_greedy_equals_hf(cluster, tmp_path, mode):
    family, hf_over = MODELS[mode]
    hf = save_tiny_model(tmp_path / "model", family, dtype="float32", **hf_over)
    master, port = service_ports(2)
    out = tmp_path / "learner"
    url = f"http://127.0.1.3:{port}"  # amnode3: node rank 0 of the server, the one serving HTTP
    path = _config(tmp_path, hf, [
        "tests/dist/wsync_moe.py", "--hf-dir", str(hf), "--servers", url, "--work-dir", str(out),
        "--out", str(out / "results.json"), "--dtype", "float32", "--export-dir", str(out / "v1"),
        "--api-key-file", "{run_dir}/secrets/api_key", "--mode", mode], port, master)
    log = tmp_path / "job.out"
    t0 = time.monotonic()
    job = _submit(cluster, path, log)
    state, code = cluster.wait_job(job, 1800)
    took = time.monotonic() - t0
    text = log.read_text() if log.exists() else ""
    run_dir = next(tmp_path.glob("run-*"), None)
    logs = "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log"))) \
        if run_dir else ""
    assert (state, code) == ("COMPLETED", "0:0"), text + logs
    # the plan: one server, node rank 0 on amnode3 and node rank 1 on amnode4, one rendezvous at node 0
    assert "--nnodes 2 --node-rank 0 --dist-init-addr 127.0.1.3:29700" in text, text
    assert "--nnodes 2 --node-rank 1 --dist-init-addr 127.0.1.3:29700" in text, text
    engines = json.loads((run_dir / "engines.json").read_text())["engines"]
    assert [(e["node"], e["url"]) for e in engines] == [("amnode3", url)]
    ready = float(re.search(r"1/1 engines ready after ([\d.]+) s", text).group(1))
    res = json.loads((out / "results.json").read_text())
    res["v1_dir"] = out / "v1"
    assert res["sync1"]["mode"] == mode  # reshard: each engine rank got its own shard (no fallback)
    check_served_sync(res, f"slurm_two_nodes_tp2_{mode}", server_ready_s=ready, job_s=round(took, 1))


def _greedy(url: str, key: str) -> list[list[int]]:
    from tests.dist.wsync_moe import NEW_TOKENS, PROMPTS

    rows = []
    for p in PROMPTS:
        body = {"input_ids": p, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}}
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=300) as r:
            rows.append(json.loads(r.read())["output_ids"])
    return rows


def _wait(cond, job, cluster, log: Path, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        state = cluster.job_fields(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (what, state, log.read_text() if log.exists() else "")
        assert time.monotonic() < deadline, \
            f"{what}: not within {timeout_s} s\n" + (log.read_text() if log.exists() else "")
        time.sleep(0.5)
    return got


def test_a_dying_node_restarts_the_whole_server_and_the_job_goes_on(cluster, tmp_path):
    """Node 1's SGLang process of the TP2 server is SIGKILLed while the learners run: the launcher
    stops node 0 too and starts the whole server again (inference.client.max_restarts); node 0
    announces itself anew (a new pid), the restarted server decodes greedily = HF on the weights it
    loads (v0), the learners ran on throughout and the job ends COMPLETED when they do."""
    from tests.dist.wsync_moe import NEW_TOKENS, PROMPTS
    from tests.test_families_serve import greedy_agreement, hf_greedy, logit_tol

    hf = save_tiny_model(tmp_path / "model", "mixtral", dtype="float32", **BASE, **FAMILIES["mixtral"])
    master, port = service_ports(2)
    url = f"http://127.0.1.3:{port}"
    learner = ["tests/launch_standins/learner.py", "--engines", "{engine_addresses}", "--out", "{run_dir}/out",
               "--hold", "1500", "--stop-file", "{stop_file}"]
    path = _config(tmp_path, hf, learner, port, master)
    log = tmp_path / "job.out"
    job = _submit(cluster, path, log)
    run_dir = _wait(lambda: next(tmp_path.glob("run-*/engines.json"), None), job, cluster, log, 1500, "engines").parent
    head, node1 = (json.loads((run_dir / "engines" / f"{n}.json").read_text()) for n in ("engine0", "engine0.node1"))
    key = (run_dir / "secrets" / "api_key").read_text().strip()
    _wait(lambda: len(list((run_dir / "out").glob("rank*.json"))) == 2, job, cluster, log, 600, "learners")
    t0 = time.monotonic()
    os.kill(node1["pid"], signal.SIGKILL)  # node 1's SGLang server process (same PID namespace)

    def restarted():
        f = run_dir / "engines" / "engine0.json"
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        return info if info["pid"] != head["pid"] else None
    new_head = _wait(restarted, job, cluster, log, 1500, "restarted server")
    restart_s = time.monotonic() - t0
    text = log.read_text()
    assert "engine0.node1 on amnode4 exited with" in text and "(and the server's 1 other node(s)); restarting the " \
        "whole server engine0 (restart 1 of inference.client.max_restarts=3)" in text, text
    with pytest.raises(OSError):  # the old node 0 was stopped before the restart
        os.kill(head["pid"], 0)
    assert new_head["url"] == url
    hf_out = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    tol = logit_tol(max(h[2] for h in hf_out))
    equal, problems = greedy_agreement(_greedy(url, key), hf_out, tol)
    print(json.dumps({"case": "slurm_two_nodes_restart", "restart_s": round(restart_s, 1), "greedy_equal_tokens": equal,
                      "of": len(PROMPTS) * NEW_TOKENS}))
    assert not problems and equal >= len(PROMPTS) * NEW_TOKENS // 2, problems
    (run_dir / "STOP").write_text("done\n")  # the learners' stop file: they exit 0, the job ends
    state, code = cluster.wait_job(job, 300)
    assert (state, code) == ("COMPLETED", "0:0"), log.read_text()
    assert "all learners finished" in log.read_text()

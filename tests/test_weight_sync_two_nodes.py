"""One SGLang server spanning two nodes, resharded into from a TP2 learner (`make test-reshard`).

The server is SGLang's multi-node mode as the launch plan starts it (areal_mega/inference/server.py
``build_launch_command(nnodes=2, node_rank=r, dist_init_addr=...)``): one process per "node", each
with one of the server's two TP ranks, node 0 serving HTTP at 127.0.0.1, node 1 bound to its own
address 127.0.0.2 (virtual nodes share this host's network namespace: each node's process must bind
its node's address, as on the project's local Slurm cluster; SGLang's node 1 opens a dummy health
server on --host:--port). The learner (TP2, tests/dist/wsync_reshard.py) reshards v1 into it: each
engine rank receives its own shard wherever it lives; then tests/test_weight_sync_reshard_sglang.py's
checks run unchanged on this server (log-probs = the learner's within the bf16 bound, greedy = HF on
v1, v0 control, engine check refusal, the broadcast fallback into both nodes). Not through Slurm: the
two-virtual-node version on the local Slurm cluster is tests/test_slurm_two_node_server.py.
One server start (~45 s here; 3-5 min under load): marker reshard_sglang, not ``make test``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from areal_mega.inference.config import SGLangServerConfig
from areal_mega.inference.server import build_launch_command
from areal_mega.launcher.engine_proc import is_ready
from areal_mega.utils import procs
from areal_mega.utils.procs import free_port_block
from tests.support.launch import SGLANG_PYTHON, needs_sglang, run_dist_script
from tests.support.models import save_tiny_model
from tests.test_weight_sync_reshard_sglang import (TWO_NODES, _perturbed_copy, test_engine_check_refuses_before_sending,
                                                   test_no_receiver_falls_back_to_broadcast,
                                                   test_reshard_bytes_per_engine_rank_are_its_shard,
                                                   test_reshard_greedy_decoding_equals_hf,
                                                   test_reshard_sync_logprobs_match_learner)

pytestmark = [pytest.mark.slow, pytest.mark.reshard_sglang, needs_sglang]
__all__ = ["test_engine_check_refuses_before_sending", "test_no_receiver_falls_back_to_broadcast",
           "test_reshard_bytes_per_engine_rank_are_its_shard", "test_reshard_greedy_decoding_equals_hf",
           "test_reshard_sync_logprobs_match_learner"]  # the same checks, on the two-node server


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    case = "tp2_two_nodes"
    family, hf_over, layout, nproc = TWO_NODES[case]
    work = tmp_path_factory.mktemp("two_nodes")
    v0 = save_tiny_model(work / "v0", family, dtype="bfloat16", **hf_over)
    v1 = _perturbed_copy(v0, work / "v1")
    port = free_port_block(1)
    rendezvous = free_port_block(1, low=port + 50)  # SGLang takes a few ports just above --port
    cfg = SGLangServerConfig(python=SGLANG_PYTHON, model_path=str(v0), device="cpu", tp_size=2, max_total_tokens=4096)
    nodes = []
    for r, host in enumerate(("127.0.0.1", "127.0.0.2")):
        cmd = build_launch_command(SGLangServerConfig(**{**cfg.__dict__, "host": host}), port, reshard_receiver=True,
                                   nnodes=2, node_rank=r, dist_init_addr=f"127.0.0.1:{rendezvous}")
        # one TP rank per node: its OpenMP core (FACTS: SGLang CPU asserts without the binding)
        env = dict(os.environ, OMP_NUM_THREADS="1", SGLANG_CPU_OMP_THREADS_BIND=str(r))
        log = open(work / f"node{r}.log", "w")
        nodes.append(procs.spawn(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 900
        while not is_ready("127.0.0.1", port, "/health"):
            dead = [r for r, p in enumerate(nodes) if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, \
                f"two-node server not ready (dead nodes {dead}):\n{(work / 'node0.log').read_text()[-3000:]}"
            time.sleep(1)
        res = run_dist_script("wsync_reshard.py", nproc, work, timeout_s=900,
                              args=("--layout", layout, "--hf-dir", v1, "--servers", f"http://127.0.0.1:{port}"))
        res.update(case=case, v1_dir=str(v1))
        yield res
    finally:
        procs.stop_tree(nodes, 10)

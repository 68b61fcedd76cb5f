"""L=$(tools/env/make_venv.sh learner) && PYTHONPATH=. $L/bin/python tools/bench_rollout_client.py --num-requests 8192

Overhead of the inference client itself (areal_mega.inference.InferencePool), not of a model:
a stub SGLang server (areal_mega/inference/fake_server.py, in a subprocess on its own core) answers at
once, but holds every /generate call until all N have arrived, so N requests are really in
flight at the same time. The client runs pinned to one core. Prints ONE JSON line:

  dispatched_per_s   N / (time until the stub had received all N requests)
  completed_per_s    N / (time until all N results were back in the caller)
  client_cpu_us_per_request   CPU time of the client process per request (its real cost)
  peak_rss_mib       peak resident memory of the client process

for a "cold" round (every request opens its TCP connection) and a "warm" one (keep-alive
connections reused: the steady state of a long rollout).

Targets (issue): >= 2000 requests/s on one core with 8192 in flight, RSS <= 1 GiB. On a busy
machine the stub (or other load) can be the bottleneck; client_cpu_us_per_request is the number
that does not depend on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_mega.api.io import GenerationRequest, SamplingParams  # noqa: E402
from areal_mega.config import from_dict  # noqa: E402
from areal_mega.inference import InferenceConfig, InferencePool  # noqa: E402
from areal_mega.inference.sglang_api import Call  # noqa: E402
from areal_mega.utils.procs import free_port  # noqa: E402


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")


async def run(addr: str, n: int, new_tokens: int, prompt_len: int, rounds: int) -> dict:
    cfg = from_dict(InferenceConfig, {"addresses": [addr], "client": {"health_check_interval_s": 60.0}})
    pool = InferencePool(cfg)
    await pool.start()
    out: dict = {"num_requests": n, "in_flight_peak": n, "new_tokens_per_request": new_tokens}
    try:
        for rnd in range(rounds):
            reqs = [GenerationRequest(list(range(i % 100, i % 100 + prompt_len)),
                                      SamplingParams(max_new_tokens=new_tokens)) for i in range(n)]
            cpu0, t0 = time.process_time(), time.time()
            results = await asyncio.gather(*(pool.agenerate(r) for r in reqs))
            t_end, cpu1 = time.time(), time.process_time()
            stats = await pool.servers[0].send(Call("GET", "/fake_stats"))
            assert len(results) == n and all(len(r.output_ids) == new_tokens for r in results)
            assert stats["num_generate"] == n * (rnd + 1), stats
            # Round 0 opens one TCP connection per in-flight request; later rounds reuse them
            # (keep-alive), which is the steady state of a long rollout.
            out["cold" if rnd == 0 else "warm"] = {
                "dispatched_per_s": round(n / (stats["t_round_arrived"][rnd] - t0), 1),
                "completed_per_s": round(n / (t_end - t0), 1),
                "client_cpu_us_per_request": round(1e6 * (cpu1 - cpu0) / n, 1),
                "wall_s": round(t_end - t0, 3),
            }
    finally:
        await pool.close()
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="client-overhead benchmark of the inference pool")
    ap.add_argument("--num-requests", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens (with logprobs) in each answer")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="1 = cold connections only; 2 adds a warm round")
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    stub = subprocess.Popen(
        [sys.executable, "-m", "areal_mega.inference.fake_server", "--port", str(port),
         "--hold-until", str(args.num_requests)],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        if len(cpus) > 1:  # client on the first core, stub on the last: measure the client alone
            os.sched_setaffinity(stub.pid, {cpus[-1]})
            os.sched_setaffinity(0, {cpus[0]})
        wait_http(f"http://127.0.0.1:{port}/health", 30)
        out = asyncio.run(run(f"127.0.0.1:{port}", args.num_requests, args.new_tokens, args.prompt_len,
                              args.rounds))
        out["client_cores"] = 1
        best = out.get("warm", out["cold"])
        out["targets_met"] = best["completed_per_s"] >= 2000 and out["peak_rss_mib"] <= 1024
        print(json.dumps(out), flush=True)
    finally:
        stub.terminate()
        try:
            stub.wait(timeout=10)
        except subprocess.TimeoutExpired:
            stub.kill()
            stub.wait()


if __name__ == "__main__":
    main()

"""L=$(tools/env/make_venv.sh learner) && PYTHONPATH=. $L/bin/python tools/bench_async.py --sglang-python $(tools/env/make_venv.sh sglang)/bin/python

Synchronous vs asynchronous RL throughput on the real trainer (``areal_mega.trainer.loop``: one
SGLang CPU server, megatron learner, gloo weight sync, decoupled PPO), same workload, same seed,
one invocation. Prints ONE JSON line:

  sync_samples_per_s, async_samples_per_s   trajectories trained per second over the timed steps
  speedup              async / sync
  G_s                  generation time per step: ``time/rollout_s`` of the SYNCHRONOUS run (there
                       generation never overlaps training, so the wait is the generation time)
  T_s                  training time per step: prox_logp + train + weight_sync (synchronous run)
  ideal_speedup        (G + T) / max(G, T): perfect overlap of generation and training
  speedup_over_ideal   speedup / ideal_speedup (the issue's target: >= 0.85)
  ideal_speedup_sync_paused, speedup_over_ideal_sync_paused
                       the same with generation paused during the weight sync (S = weight_sync
                       time of the sync run): best async step = max(T, G + S)
  async_wait_s         the async learner's remaining wait for a batch per step (0 = fully hidden)
  async_step_over_max_GT   async step time / max(G, T of the async run itself): 1.0 = perfect
                       overlap, whatever the machine's load did between the two runs
  steps, warmup_steps, sync/async per-phase means, load average before/after

Method. The trainer runs twice, ``rollout.max_staleness=0`` (synchronous RL: no episode is
admitted before the previous batch has been trained on) and ``=--staleness`` (2 by default),
``--rounds`` times alternated (timed steps pooled per mode); everything else is equal, including ``rollout.max_concurrent = rollout.batch_size`` so that SGLang
sees the same number of episodes in flight in both modes (otherwise async would also win by
larger generation batches, which is not what the comparison is about). The first
``--warmup-steps`` steps (server/KV warm-up, the async pipeline filling) and the last step (it
also saves the final checkpoint) are excluded from the timing. Evaluation and HF export are off.

One SGLang server serves every run (its start costs minutes on a loaded core): before each run
its weights are reset from the model directory to version 0 with the cache flushed
(``/update_weights_from_disk``), which is the state a freshly launched server would be in; the
trainer reaches it through ``inference.addresses``. ``--server-address`` reuses a server that is
already running (handy when iterating on the workload knobs).

CPU placement. With two cores, an unpinned server and learner fight over both, and "overlap"
would measure contention. So the SGLang server (and its scheduler/detokenizer children) is
pinned to ``--server-cpus`` (core 0) through a small wrapper script passed as
``inference.server.python`` (the config field the pool launches servers with), and the one
learner rank -- TP=1: ``parallel.tensor_parallel=1``, a single torchrun rank, so the split is
clean -- to ``--learner-cpus`` (core 1), all with OMP_NUM_THREADS=1. The learner rank also hosts
the rollout driver thread (HTTP client, reward): that client work competes with training on
core 1, as it does on a cluster's rank 0 (where it is negligible next to a GPU step).

The workload knobs (``--batch-size``, ``--group-size``, ``--max-new-tokens``) set G and T;
async only pays off when they are of the same order, so the script prints both. Extra
``key=value`` arguments are passed to both runs as config overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_mega.inference.server import SGLangServer  # noqa: E402
from areal_mega.utils import procs  # noqa: E402
from areal_mega.experiment import load_experiment  # noqa: E402

TRAIN_PHASES = ("prox_logp", "train", "weight_sync")


def _cpus(spec: str) -> set[int]:
    """"0", "0,2", "2-3" -> a set of core ids."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _pinned_python(python: str, cpus: str, path: Path) -> str:
    """A wrapper that execs ``python`` pinned to ``cpus``; the pool launches the server with it
    (``inference.server.python``), so the server's whole process tree inherits the affinity."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise SystemExit("bench_async: needs `taskset` (util-linux) to pin the SGLang server")
    path.write_text(f'#!/bin/sh\nexec {taskset} -c {cpus} {python} "$@"\n')
    path.chmod(0o755)
    return str(path)


def _start_server(python: str, model: str, overrides: list[str], args: argparse.Namespace,
                  work: Path) -> SGLangServer:
    """One SGLang server for both runs (startup costs minutes on a loaded core), configured from
    the same YAML as the trainer's would be (``inference.server``), pinned by ``python``."""
    cfg = load_experiment(str(ROOT / args.config), overrides).inference.server
    cfg = dataclasses.replace(cfg, python=python, model_path=model, port=0,
                              startup_timeout_s=args.server_startup_timeout_s)
    server = SGLangServer(cfg, procs.free_port(cfg.host), random_seed=cfg.random_seed, log_dir=work / "server-logs")
    t0 = time.time()
    server.start(weight_version=0)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    print(f"[bench_async] server {server.address} ready in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return server


@dataclasses.dataclass
class _ExternalServer:
    """A server someone else started (``--server-address``): reset between runs, never stopped."""

    address: str

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self) -> None:
        pass


def _reset_server(server: SGLangServer | _ExternalServer, model: str) -> None:
    """Back to the initial weights at version 0, cache flushed: each run starts where a freshly
    launched server would (the previous run left its trained weights and version N there)."""
    body = json.dumps({"model_path": model, "weight_version": "0", "flush_cache": True}).encode()
    req = urllib.request.Request(server.url + "/update_weights_from_disk", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    with urllib.request.urlopen(server.url + "/model_info", timeout=60) as r:
        version = json.loads(r.read()).get("weight_version")
    if str(version) != "0":
        raise SystemExit(f"bench_async: server reports weight_version {version!r} after the reset, not 0")


def _build_tiny(python: str, out: Path, env: dict[str, str]) -> Path:
    if not (out / "model" / "config.json").exists():
        subprocess.run([python, "-m", "areal_mega.demo.tiny", "--out", str(out), "--num-sft", "10"],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return out


def _run_mode(name: str, staleness: int, args: argparse.Namespace, common: list[str],
              env: dict[str, str], work: Path) -> list[dict]:
    """One trainer run; returns rank 0's per-step metric rows (the JSON lines it prints)."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [args.learner_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "areal_mega.cli", "train", "--config", args.config, *common,
           f"output_dir={out}", f"rollout.max_staleness={staleness}"]
    log = out / "train.log"
    learner_cpus = _cpus(args.learner_cpus)
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = procs.spawn(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                           preexec_fn=lambda: os.sched_setaffinity(0, learner_cpus))
        try:
            rc = proc.wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                procs.stop_tree(proc)  # torchrun, its ranks and the server they started
    rows = []
    for line in log.read_text().splitlines():
        if line.startswith('{"step"'):
            rows.append(json.loads(line))
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"bench_async: {name} run failed (exit {rc}, {time.time() - t0:.0f} s); {log}:\n{tail}")
    print(f"[bench_async] {name}: {len(rows)} steps in {time.time() - t0:.0f} s (log {log})",
          file=sys.stderr, flush=True)
    return rows


def _timed(rows: list[dict], warmup: int) -> list[dict]:
    timed = rows[warmup:-1]  # the last step also saves the final checkpoint
    if not timed:
        raise SystemExit(f"bench_async: no timed steps ({len(rows)} steps, {warmup} warm-up)")
    return timed


def _summary(timed: list[dict]) -> dict[str, float]:
    wall = sum(r["perf/step_s"] for r in timed)
    samples = sum(r["rollout/num_trajectories"] for r in timed)

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in timed)

    s = {"samples_per_s": samples / wall, "step_s": wall / len(timed),
         **{f"{p}_s": mean(f"time/{p}_s") for p in ("rollout", *TRAIN_PHASES)},
         "staleness_mean": mean("staleness/mean"), "reward_mean": mean("rollout/reward_mean")}
    s["T_s"] = sum(s[f"{p}_s"] for p in TRAIN_PHASES)
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--sglang-python", required=True, help="python of the SGLang venv")
    p.add_argument("--learner-python", default=sys.executable)
    p.add_argument("--model-dir", help="HF model dir (default: build the tiny random Qwen2)")
    p.add_argument("--data", help="train jsonl with prompt/answer (default: the tiny addition task)")
    p.add_argument("--work-dir", default="runs/bench_async")
    p.add_argument("--config", default="configs/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="sync/async run pairs, alternated; "
                   "timed steps are pooled per mode")
    p.add_argument("--staleness", type=int, default=2, help="max_staleness of the async run")
    p.add_argument("--batch-size", type=int, default=16, help="rollout.batch_size (prompts per step)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--learner-cpus", default="1")
    p.add_argument("--run-timeout-s", type=float, default=1200.0)
    p.add_argument("--server-startup-timeout-s", type=float, default=1200.0)
    p.add_argument("--server-address", help="host:port of an SGLang server already serving the model "
                   "(pinned by whoever started it); default: start one pinned to --server-cpus")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for both runs")
    args = p.parse_args()

    work = (ROOT / args.work_dir) if not os.path.isabs(args.work_dir) else Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if args.model_dir:
        model, data = args.model_dir, args.data
        if not data:
            raise SystemExit("bench_async: --model-dir needs --data (a prompt/answer jsonl)")
    else:
        tiny = _build_tiny(args.learner_python, work / "tiny", env)
        model, data = str(tiny / "model"), args.data or str(tiny / "data" / "train.jsonl")
    server_python = _pinned_python(args.sglang_python, args.server_cpus, work / "sglang-pinned.sh")
    num_steps = args.warmup_steps + args.steps + 1
    # Weight sync sends the HF checkpoint's dtype (the planner refuses a server of another dtype).
    hf = json.loads((Path(model) / "config.json").read_text())
    server_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    common = [
        f"model_path={model}", f"data.path={data}", "eval_data=null", "seed=1",
        "parallel.tensor_parallel=1", f"trainer.num_steps={num_steps}", "trainer.resume=false",
        "trainer.eval_at_start=false", "trainer.eval_at_end=false", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.export_hf_at_end=false",
        f"rollout.batch_size={args.batch_size}", f"rollout.max_concurrent={args.batch_size}",
        f"workflow.group_size={args.group_size}", f"workflow.sampling.max_new_tokens={args.max_new_tokens}",
        "rollout.show_progress=false", f"inference.server.dtype={server_dtype}",
        *args.overrides,
    ]
    load_before = os.getloadavg()
    if args.server_address:
        server = _ExternalServer(args.server_address)
    else:
        server = _start_server(server_python, model, common, args, work)
    try:
        common.append(f"inference.addresses=[{server.address}]")
        rows: dict[str, list[dict]] = {"sync": [], "async": []}
        for r in range(args.rounds):  # alternate, so slow drifts of the machine's load hit both
            for name, eta in (("sync", 0), ("async", args.staleness)):
                _reset_server(server, model)
                run = _run_mode(f"{name}{r}", eta, args, common, env, work)
                rows[name] += _timed(run, args.warmup_steps)
    finally:
        server.stop()
    sync, asyn = _summary(rows["sync"]), _summary(rows["async"])
    G, T = sync["rollout_s"], sync["T_s"]
    ideal = (G + T) / max(G, T)
    # Generation cannot run during a weight sync (servers are paused), so even perfect overlap
    # has a step of max(T, G + S): the ideal that accounts for it.
    S = sync["weight_sync_s"]
    ideal_paused = (G + T) / max(T, G + S)
    speedup = asyn["samples_per_s"] / sync["samples_per_s"]
    r4 = lambda x: round(x, 4)  # noqa: E731
    result = {
        "sync_samples_per_s": r4(sync["samples_per_s"]), "async_samples_per_s": r4(asyn["samples_per_s"]),
        "speedup": r4(speedup), "G_s": r4(G), "T_s": r4(T), "ideal_speedup": r4(ideal),
        "speedup_over_ideal": r4(speedup / ideal),
        "ideal_speedup_sync_paused": r4(ideal_paused), "speedup_over_ideal_sync_paused": r4(speedup / ideal_paused),
        "steps": args.steps * args.rounds, "warmup_steps": args.warmup_steps,
        "rounds": args.rounds, "T_s_async_run": r4(asyn["T_s"]),
        # Load-independent view of the overlap: how long the async learner still waits for
        # generation per step, and its step time over the slower stage max(G, T of that run).
        "async_wait_s": r4(asyn["rollout_s"]),
        "async_step_over_max_GT": r4(asyn["step_s"] / max(G, asyn["T_s"])),
        "max_staleness": args.staleness, "batch_size": args.batch_size, "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "sync": {k: r4(v) for k, v in sync.items()}, "async": {k: r4(v) for k, v in asyn.items()},
        "loadavg_before": [round(x, 1) for x in load_before],
        "loadavg_after": [round(x, 1) for x in os.getloadavg()],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE routing replay on a tiny Qwen3-MoE: a bf16 SGLang server, an fp32 learner (one gloo rank,
the product's MegatronTrainEngine); prints ONE JSON line.

    python tools/bench_routing_replay.py --sglang-python S [--num-prompts 16 --max-new-tokens 48]
    python tools/bench_routing_replay.py --sglang-python S --grpo-steps 20 --plot docs/routing_replay_grpo.png

Measured (docs/routing_replay.md): ``disagreement`` -- fraction of (token, layer) routes where the
learner's own router and the server's differ; ``mismatch_off`` / ``mismatch_on`` -- mean, p99 and
max |server - learner| log-prob over the generated tokens without / with the server's routes
replayed; ``capture_tokens_per_s`` vs ``plain_tokens_per_s`` -- generation throughput with route
capture on and off (two servers started one after the other, same prompts, same seed).

``--grpo-steps N``: instead, the MoE demo's GRPO (areal_mega/demo/run.py, tiny Qwen3-MoE, TP2
learners with SP, fp32) twice from one SFT model with a bf16 server -- ``observe`` (no replay,
routes logged) and ``rollout`` -- and a PNG of their reward, per-step mismatch (mean, p99, max),
route disagreement and held-out accuracy; one JSON line per run. ``--max-staleness 0`` (default)
makes every trained token on-policy: the mismatch metric only counts tokens sampled by the
current version (else it measures the policy's own change), and at max_staleness 1 nearly every
batch is generated while the previous step trains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _generate(model_dir: Path, args, capture: bool, log_dir: Path):
    from areal_mega.api.io import GenerationRequest, SamplingParams
    from areal_mega.inference.client import InferencePool
    from areal_mega.inference.config import InferenceConfig, SGLangServerConfig

    cfg = InferenceConfig(num_servers=1, server=SGLangServerConfig(
        python=args.sglang_python, model_path=str(model_dir), device="cpu", dtype="bfloat16",
        max_total_tokens=16384, env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=900, log_dir=str(log_dir)))
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(4, 16))] for _ in range(args.num_prompts)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

    async def go():
        pool = await InferencePool.launch(cfg, capture_routes=capture)
        try:
            await pool.agenerate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4)))  # warm-up
            t0 = time.perf_counter()
            res = await asyncio.gather(*[pool.agenerate(GenerationRequest(p, sampling)) for p in prompts])
            return res, time.perf_counter() - t0
        finally:
            await pool.close()

    res, secs = asyncio.run(go())
    return res, sum(len(r.output_ids) for r in res) / secs


def _learner(model_dir: Path):
    import torch.distributed as dist

    from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine
    from areal_mega.megatron.model import MegatronModelConfig
    from areal_mega.megatron.parallel_state import init_model_parallel
    from areal_mega.models import load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.utils.procs import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    groups = init_model_parallel(ParallelLayout.build(ParallelConfig(), 1), backend="gloo")
    cfg = MegatronEngineConfig(model=MegatronModelConfig(dtype="float32", moe_routing_replay="rollout"))
    return MegatronTrainEngine.create(cfg, load_hf_config(model_dir), groups, model_dir, trainable=False)


def _stats(d) -> dict:
    import torch

    d = d.double()
    return {"mean": round(float(d.mean()), 5), "p99": round(float(torch.quantile(d, 0.99)), 5),
            "max": round(float(d.max()), 5)}


ARMS = ("observe", "rollout")  # the control arm routes freely but logs the disagreement too


def _load_sampler(stop):
    """(min, mean, max) of the 1-min load average, sampled every 10 s until ``stop`` is set."""
    import threading

    seen: list[float] = []

    def loop():
        while not stop.wait(10.0):
            seen.append(os.getloadavg()[0])

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return lambda: (t.join(), seen and (round(min(seen), 1), round(sum(seen) / len(seen), 1), round(max(seen), 1)))[1]


def _grpo(args) -> int:
    import threading

    from areal_mega.demo.run import run_pipeline

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-replay-grpo-"))
    runs, evals = {}, {}
    for mode in ARMS:
        out = work / f"grpo-{mode}"
        if mode in args.arms:
            stop = threading.Event()
            load = _load_sampler(stop)
            t0 = time.time()
            run_pipeline(str(work), learner_python=sys.executable, sglang_python=args.sglang_python,
                         rl_steps=args.grpo_steps, rl_name=f"grpo-{mode}", reuse_sft=True, model="qwen3_moe",
                         extra=[f"actor.model.moe_routing_replay={mode}", "inference.server.dtype=bfloat16",
                                f"rollout.max_staleness={args.max_staleness}", f"trainer.eval_every={args.eval_every}"])
            stop.set()
            extra = {"wall_s": round(time.time() - t0, 1), "load_avg_1min_min_mean_max": load()}
        elif (out / "metrics.jsonl").exists():  # an arm of an earlier call in this work dir (plotted too)
            extra = {"from_earlier_run": True}
        else:
            continue
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = rows
        evals[mode] = [(e["step"], round(e["accuracy"], 3)) for e in map(json.loads, (out / "eval.jsonl").read_text().splitlines())]
        pick = lambda k: [round(r[k], 5) if k in r else None for r in rows]  # noqa: E731
        print(json.dumps({"replay": mode, "steps": len(rows), "max_staleness": args.max_staleness,
                          "reward": pick("rollout/reward_mean"), "mismatch_mean": pick("routing/mismatch_mean"),
                          "mismatch_p99": pick("routing/mismatch_p99"), "mismatch_max": pick("routing/mismatch_max"),
                          "mismatch_tokens": pick("routing/mismatch_tokens"),
                          "disagreement": pick("routing/disagreement"),
                          **({f"mismatch_if_replayed_{q}": pick(f"routing/mismatch_if_replayed_{q}")
                              for q in ("mean", "p99", "max")} if mode == "observe" else {}),
                          "heldout": evals[mode], **extra}), flush=True)
    if args.plot:
        _plot(runs, evals, args)
    return 0


def _plot(runs: dict, evals: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train reward (batch mean)", [("rollout/reward_mean", "")]),
              ("|server - learner| log-prob: mean", [("routing/mismatch_mean", "")]),
              ("|server - learner| log-prob: p99", [("routing/mismatch_p99", "")]),
              ("|server - learner| log-prob: max", [("routing/mismatch_max", "")]),
              ("route disagreement (learner's own router vs server)", [("routing/disagreement", "")])]
    fig, ax = plt.subplots(2, 3, figsize=(14, 7))
    ax = ax.ravel()
    colors = {"observe": "tab:red", "rollout": "tab:blue"}
    label = {"observe": "replay off (observe)", "rollout": "replay on (rollout, R3)"}
    for i, (title, keys) in enumerate(panels):
        for mode, rows in runs.items():
            for key, _ in keys:
                pts = [(r["version"], r[key]) for r in rows if key in r]
                ax[i].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=colors[mode],
                           label=label[mode])
                paired = [(r["version"], r[key.replace("mismatch_", "mismatch_if_replayed_")]) for r in rows
                          if key.replace("mismatch_", "mismatch_if_replayed_") in r and "mismatch" in key]
                if paired:  # the observe arm's own tokens, forwarded again with the servers' routes
                    ax[i].plot([p[0] for p in paired], [p[1] for p in paired], ls="--", marker="x", ms=3,
                               color=colors[mode], alpha=0.7, label="replay off arm, same tokens replayed")
        ax[i].set_title(title, fontsize=9)
        ax[i].set_xlabel("step")
        if "log-prob" in title and "mean" not in title:
            ax[i].set_yscale("log")
    for mode, curve in evals.items():
        ax[5].plot([c[0] for c in curve], [c[1] for c in curve], marker="s", color=colors[mode], label=label[mode])
    ax[5].set_title("held-out greedy accuracy (30 prompts)", fontsize=9)
    ax[5].set_xlabel("step")
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=7)
    fig.suptitle(f"tiny Qwen3-MoE GRPO (MoE demo settings, max_staleness {args.max_staleness}): bf16 SGLang server, "
                 "fp32 TP2 learner; mismatch over every trained token, every step", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip-capture-cost", action="store_true", help="do not start the second (capture-off) server")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--grpo-steps", type=int, default=0, help="run the MoE demo's GRPO with replay off and on instead")
    ap.add_argument("--plot", default=None, help="with --grpo-steps: write the curves PNG here")
    ap.add_argument("--max-staleness", type=int, default=0,
                    help="with --grpo-steps: 0 = every trained token on-policy, so the mismatch is measured on all")
    ap.add_argument("--eval-every", type=int, default=4, help="with --grpo-steps: held-out eval every N steps")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                    help="with --grpo-steps: the arms to run (an arm already in --work-dir is still reported/plotted)")
    args = ap.parse_args()
    if not os.path.exists(args.sglang_python):
        raise SystemExit(f"--sglang-python: {args.sglang_python} does not exist")
    if args.grpo_steps:
        return _grpo(args)

    from areal_mega.demo.tiny import build_model
    from areal_mega.megatron.routing import replay_metrics
    from areal_mega.rollout.batch import to_engine_alignment, trajectories_to_batch
    from areal_mega.workflows.base import TrajectoryBuilder

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-replay-"))
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, family="qwen3_moe", num_layers=2)
    res, capture_tps = _generate(model_dir, args, True, work / "logs-capture")
    plain_tps = None if args.skip_capture_cost else _generate(model_dir, args, False, work / "logs-plain")[1]

    trajs = []
    for r in res:
        b = TrajectoryBuilder(r.input_ids)
        b.add_generated(r)
        trajs.append(b.build(0.0, "g", {}))
    batch = to_engine_alignment(trajectories_to_batch(trajs))
    eng = _learner(model_dir)
    plain = eng.forward({k: v for k, v in batch.items() if k != "routed_experts"}, with_entropy=False)
    replayed = eng.forward(batch, with_entropy=False)
    layers = eng.model.arch.num_layers
    m_off = replay_metrics(batch, plain["logprobs"], plain["routes"], 0, layers)
    mask = batch["loss_mask"] > 0
    out = {
        "model": "tiny qwen3_moe (2 layers, 8 experts, top-2), server bf16, learner fp32",
        "num_tokens": int(mask.sum()),
        "disagreement": round(m_off["routing/disagreement"], 4),
        "mismatch_off": _stats((batch["logprobs"] - plain["logprobs"]).abs()[mask]),
        "mismatch_on": _stats((batch["logprobs"] - replayed["logprobs"]).abs()[mask]),
        "capture_tokens_per_s": round(capture_tps, 1),
        "plain_tokens_per_s": None if plain_tps is None else round(plain_tps, 1),
        "load_avg_1min": os.getloadavg()[0],
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MoE routing replay on a tiny Qwen3-MoE: a bf16 SGLang server, an fp32 learner (one gloo rank,
the product's MegatronTrainEngine); prints ONE JSON line.

    python tools/bench_routing_replay.py --sglang-python S [--num-prompts 16 --max-new-tokens 48]
    python tools/bench_routing_replay.py --sglang-python S --grpo-steps 12 --plot docs/routing_replay_grpo.png

Measured (docs/routing_replay.md): ``disagreement`` -- fraction of (token, layer) routes where the
learner's own router and the server's differ; ``mismatch_off`` / ``mismatch_on`` -- mean, p99 and
max |server - learner| log-prob over the generated tokens without / with the server's routes
replayed; ``capture_tokens_per_s`` vs ``plain_tokens_per_s`` -- generation throughput with route
capture on and off (two servers started one after the other, same prompts, same seed).

``--grpo-steps N``: instead, the MoE demo's async GRPO (areal_mega/demo/run.py, tiny Qwen3-MoE,
TP2 learners with SP, fp32) twice from one SFT model with a bf16 server -- replay off and
``rollout`` -- and a PNG of their reward and per-step mismatch curves; one JSON line per run.
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


def _grpo(args) -> int:
    from areal_mega.demo.run import run_pipeline

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-replay-grpo-"))
    runs = {}
    for mode in ("off", "rollout"):
        summary = run_pipeline(str(work), learner_python=sys.executable, sglang_python=args.sglang_python,
                               rl_steps=args.grpo_steps, rl_name=f"grpo-{mode}", reuse_sft=True, model="qwen3_moe",
                               extra=[f"actor.model.moe_routing_replay={mode}", "inference.server.dtype=bfloat16",
                                      "trainer.eval_every=0"])
        rows = [json.loads(x) for x in (Path(summary["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = rows
        pick = lambda k: [round(r[k], 5) for r in rows if k in r]  # noqa: E731
        print(json.dumps({"replay": mode, "steps": len(rows), "reward": pick("rollout/reward_mean"),
                          "mismatch_mean": pick("routing/mismatch_mean"), "mismatch_max": pick("routing/mismatch_max"),
                          "disagreement": pick("routing/disagreement"),
                          "heldout_before": summary["heldout_accuracy_before"],
                          "heldout_after": summary["heldout_accuracy_after"], "wall_s": summary["wall_s"]}), flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
        for mode, rows in runs.items():
            for a_, key, title in ((ax[0], "rollout/reward_mean", "train reward"),
                                   (ax[1], "routing/mismatch_mean", "mean |server - learner| log-prob"),
                                   (ax[2], "routing/disagreement", "route disagreement (learner's own router)")):
                pts = [(r["version"], r[key]) for r in rows if key in r]
                a_.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"replay {mode}")
                a_.set_title(title, fontsize=9)
                a_.set_xlabel("step")
        ax[0].legend()
        fig.suptitle("tiny Qwen3-MoE async GRPO, bf16 SGLang server, fp32 TP2 learner", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--skip-capture-cost", action="store_true", help="do not start the second (capture-off) server")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--grpo-steps", type=int, default=0, help="run the MoE demo's GRPO with replay off and on instead")
    ap.add_argument("--plot", default=None, help="with --grpo-steps: write the curves PNG here")
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

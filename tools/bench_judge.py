"""Judge requests per second: ``reward.kind: judge`` (JudgeReward, its own managed pool) against a
real SGLang CPU server, N concurrent requests at a time.

    PYTHONPATH=. $L/bin/python tools/bench_judge.py --sglang-python $S/bin/python [--model-path DIR]
        [--num-requests 256] [--max-concurrent 64] [--max-new-tokens 8]

Without --model-path it builds the hand-wired tiny judge the tests use (areal_mega/demo/models.py
``save_verdict_judge``: Qwen2, 1 layer, hidden 128, BPE vocab 512; outputs "Score: N"). Prints
one JSON line: requests/s over the timed batch (after one warm-up request), outcome counts by
reason, the mean request latency (slot acquired -> verdict parsed; waiting for one of the
``--max-concurrent`` slots not included), the server start time. The server runs with OMP_NUM_THREADS=1 (one core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_mega.config import from_dict  # noqa: E402
from areal_mega.reward.judge import JudgeConfig, JudgeReward  # noqa: E402


def measure_judge(sglang_python: str, *, model_path: str = "", num_requests: int = 256, max_concurrent: int = 64,
                  max_new_tokens: int = 8) -> dict:
    """Start a judge's own server, time ``num_requests`` verdicts; the JSON fields described above."""
    work = Path(tempfile.mkdtemp(prefix="bench-judge-"))
    model = model_path
    if not model:
        from areal_mega.demo.models import save_verdict_judge

        model = str(save_verdict_judge(work / "judge"))
    cfg = from_dict(JudgeConfig, {
        "servers": "own", "max_concurrent": max_concurrent,
        "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        "inference": {"server": {"python": sglang_python, "model_path": model, "device": "cpu",
                                 "dtype": "float32", "max_total_tokens": 65536, "env": {"OMP_NUM_THREADS": "1"},
                                 "log_dir": str(work / "logs"), "startup_timeout_s": 600}}})
    from transformers import AutoTokenizer

    judge = JudgeReward(cfg, AutoTokenizer.from_pretrained(model))
    data = {"prompt": "What is 6*7?", "answer": "42"}

    async def run() -> dict:
        t0 = time.perf_counter()
        await judge.engine()
        start_s = time.perf_counter() - t0
        await judge("What is 6*7?", "warm-up", data)
        t1 = time.perf_counter()
        await asyncio.gather(*(judge("What is 6*7?", f"The answer is {i}.", data) for i in range(num_requests)))
        dt = time.perf_counter() - t1
        await judge.aclose()
        return {"start_s": start_s, "timed_s": dt}

    try:
        r = asyncio.run(run())
    finally:
        judge.close()
    outcomes = {k: int(v) for k, v in judge.stats.items() if k not in ("latency_s", "requests")}
    return {"bench": "judge", "model": "hand-wired tiny judge" if not model_path else model,
            "num_requests": num_requests, "max_concurrent": max_concurrent,
            "max_new_tokens": max_new_tokens, "judge_requests_per_s": round(num_requests / r["timed_s"], 1),
            "mean_latency_s": round(judge.stats["latency_s"] / judge.stats["requests"], 4),
            "server_start_s": round(r["start_s"], 1), "outcomes": outcomes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--model-path", default="")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-concurrent", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    print(json.dumps(measure_judge(args.sglang_python, model_path=args.model_path, num_requests=args.num_requests,
                                   max_concurrent=args.max_concurrent, max_new_tokens=args.max_new_tokens)))


if __name__ == "__main__":
    main()

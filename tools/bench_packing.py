"""$L/bin/python tools/bench_packing.py --num-seqs 1024 --max-tokens 16384 --dp 1

Packing efficiency of token-budget micro-batching on a long-tail length distribution
(lognormal, median ~300 tokens, clipped to [16, 8192]: RL rollouts look like this), compared
with pad-to-longest batching at the same token budget. Prints ONE JSON line:

    packing_efficiency      real tokens / (micro-batches * max_tokens): how full fixed-budget
                            micro-batches are when sequences are packed (no padding at all
                            is computed on the packed path; this is the stricter measure, the
                            one that matters for static-shape kernels and step-count)
    pad_to_longest_efficiency  real tokens / computed tokens when consecutive sequences are
                            padded to their longest member (same budget)
    best_possible_efficiency  the integrality bound: ceil(tokens / (dp * budget)) full slots
    num_microbatches, pad_to_longest_num_microbatches, dp, max_tokens, num_seqs, total_tokens

Pure python, < 2 s. The packing code is areal_mega/batching/packing.py (plan_microbatches).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from areal_mega.batching.packing import pad_to_longest_efficiency, plan_microbatches  # noqa: E402


def long_tail_lengths(num: int, median: float, sigma: float, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max_len, max(16, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(num)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=1024, help="sequences per global batch")
    ap.add_argument("--max-tokens", type=int, default=16384, help="max_tokens_per_microbatch")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (micro-batch counts equalised)")
    ap.add_argument("--median", type=float, default=300.0, help="median sequence length")
    ap.add_argument("--sigma", type=float, default=1.1, help="lognormal sigma (tail weight)")
    ap.add_argument("--max-len", type=int, default=8192, help="longest allowed sequence")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    lens = long_tail_lengths(args.num_seqs, args.median, args.sigma, args.max_len, args.seed)
    t0 = time.perf_counter()
    plan = plan_microbatches(lens, args.max_tokens, dp_size=args.dp)
    plan_s = time.perf_counter() - t0
    pad_eff, pad_mb = pad_to_longest_efficiency(lens, args.max_tokens)
    loads = [mb.num_tokens for mbs in plan.per_rank for mb in mbs]
    print(
        json.dumps(
            {
                "packing_efficiency": round(plan.packing_efficiency(), 4),
                # no packing can beat this: whole micro-batches of exactly max_tokens
                "best_possible_efficiency": round(
                    sum(lens) / (math.ceil(sum(lens) / (args.max_tokens * args.dp)) * args.max_tokens * args.dp), 4
                ),
                "pad_to_longest_efficiency": round(pad_eff, 4),
                "num_microbatches": plan.num_microbatches * args.dp,
                "pad_to_longest_num_microbatches": pad_mb,
                "min_microbatch_tokens": min(loads),
                "max_microbatch_tokens": max(loads),
                "dp": args.dp,
                "max_tokens": args.max_tokens,
                "num_seqs": args.num_seqs,
                "total_tokens": sum(lens),
                "median_len": sorted(lens)[len(lens) // 2],
                "longest": max(lens),
                "plan_seconds": round(plan_s, 4),
            }
        )
    )


if __name__ == "__main__":
    main()

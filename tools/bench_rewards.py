"""PYTHONPATH=. $L/bin/python tools/bench_rewards.py --workers 2 [--sglang-python $S/bin/python]
   PYTHONPATH=. $L/bin/python tools/bench_rewards.py --workers 2 --compare-tree /tmp/old --rounds 5

Reward throughput with N worker processes. Prints ONE JSON line:

    math_rewards_per_s        math-verify rewards (MathReward: answer extraction + math-verify
                              in the worker pool) per second, over --num-math completions
                              (a mix of \\boxed{\\frac{a}{b}}, decimals and wrong answers)
    sandbox_executions_per_s  sandboxed code executions (Sandbox.run: a fresh set of
                              namespaces, a mount view, the uid switch and a Python start per
                              execution) per second, over --num-code tiny programs
    code_rewards_per_s        code-reward samples (4 tests each: 4 executions) per second
    judge_requests_per_s      LLM-judge verdicts per second against a real SGLang CPU server
                              (tools/bench_judge.py's measurement, its fields under "judge");
                              null without --sglang-python
    workers, sandbox_mode, num_math, num_code, wall_s

With ``--compare-tree DIR`` (a checkout of another commit, e.g. ``git archive <commit> | tar -x
-C DIR``) it measures only sandboxed executions/s, of this tree's sandbox and of DIR's, each in
a fresh process (same interpreter, same configuration: ``Sandbox(SandboxConfig(num_workers=N))``,
--num-code executions), alternating between the two for --rounds rounds so that both see the same
machine load; it prints {"compare": {"this": [per round], "other": [...], "median_this",
"median_other", "ratio" (median this / median other), "cpu_ms_this", "cpu_ms_other" (CPU
milliseconds per execution: the workers' own and their reaped children's, from /proc -- far less
sensitive to the machine's load than wall-clock rates), "cpu_ratio", "loadavg_1min": [before each
run]}}.

Worker start-up (imports of math-verify, ~2-5 s) is excluded: each pool is warmed by one
call per worker first. All calls of a phase are issued at once (asyncio.gather), as the rollout
does; throughput then tracks min(workers, cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from areal_mega.reward.code import CodeReward  # noqa: E402
from areal_mega.reward.math import MathReward  # noqa: E402
from areal_mega.sandbox import SandboxConfig  # noqa: E402


def math_cases(n: int) -> list[tuple[str, dict]]:
    out = []
    for i in range(n):
        a, b = i % 7 + 1, i % 5 + 2
        if i % 3 == 0:
            out.append((f"so the answer is \\boxed{{\\frac{{{a}}}{{{b}}}}}", {"answer": f"{a / b:.6f}"}))
        elif i % 3 == 1:
            out.append((f"The answer is {a * b}.", {"answer": str(a * b)}))
        else:
            out.append((f"I get \\boxed{{{a + b}}}", {"answer": str(a + b + 1)}))
    return out


async def timed(calls) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*calls)
    return time.perf_counter() - t0


# One measurement of the sandbox of the tree on sys.path[0]: executions/s (its own process).
_MEASURE = """
import asyncio, json, os, sys, time
sys.path.insert(0, sys.argv[1])
from areal_mega.sandbox import Sandbox, SandboxConfig
workers, n = int(sys.argv[2]), int(sys.argv[3])
with Sandbox(SandboxConfig(num_workers=workers, timeout_s=30.0)) as sb:
    async def timed(calls):
        t0 = time.perf_counter()
        res = await asyncio.gather(*calls)
        assert all(r.ok for r in res), [r for r in res if not r.ok][:1]
        return time.perf_counter() - t0
    def cpu_s():  # the workers' CPU with their reaped children's (unshare, PID 1, the program)
        from areal_mega.utils.procs import tree_pids
        tot = 0
        for w in sb.pool._all:  # the worker's launcher, the worker, and what is left under it
            for pid in tree_pids(w.proc.pid):
                f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                tot += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
        return tot / os.sysconf("SC_CLK_TCK")
    code = "a, b = map(int, input().split())\\nprint(a + b)"
    asyncio.run(timed([sb.run("print(1)") for _ in range(workers)]))  # start + warm the workers
    c0 = cpu_s()
    wall = asyncio.run(timed([sb.run(code, f"{i} 1\\n") for i in range(n)]))
    print(json.dumps({"executions_per_s": n / wall, "cpu_ms_per_execution": 1000 * (cpu_s() - c0) / n}))
"""


def compare(other: str, workers: int, n: int, rounds: int) -> dict:
    import os
    import statistics
    import subprocess

    here = str(Path(__file__).resolve().parent.parent)
    runs: dict[str, list[float]] = {"this": [], "other": []}
    cpu: dict[str, list[float]] = {"this": [], "other": []}
    load = []
    for r in range(rounds):
        order = [("this", here), ("other", other)] if r % 2 == 0 else [("other", other), ("this", here)]
        for name, tree in order:
            load.append(round(os.getloadavg()[0], 1))
            out = subprocess.run([sys.executable, "-c", _MEASURE, tree, str(workers), str(n)], cwd=tree,
                                 capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(f"bench_rewards: the {name} tree's sandbox failed: {out.stderr.strip()[-2000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(round(got["executions_per_s"], 2))
            cpu[name].append(round(got["cpu_ms_per_execution"], 1))
    med = {k: statistics.median(v) for k, v in runs.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    return {"this": runs["this"], "other": runs["other"], "other_tree": other, "median_this": med["this"],
            "median_other": med["other"], "ratio": round(med["this"] / med["other"], 3),
            "cpu_ms_this": cpu["this"], "cpu_ms_other": cpu["other"],
            "cpu_ratio": round(cmed["this"] / cmed["other"], 3), "loadavg_1min": load,
            "workers": workers, "num_code": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes (math pool and sandbox pool each)")
    ap.add_argument("--num-math", type=int, default=400)
    ap.add_argument("--num-code", type=int, default=100, help="sandboxed executions (code samples x 4 tests / 4)")
    ap.add_argument("--sandbox-mode", default="namespaces", choices=["namespaces", "rlimits_only_unsafe"])
    ap.add_argument("--sglang-python", help="also measure judge requests/s on a real SGLang CPU server")
    ap.add_argument("--compare-tree", help="measure only sandboxed executions/s, of this tree and of this "
                    "checkout of another commit, alternating")
    ap.add_argument("--rounds", type=int, default=5, help="--compare-tree: measurements of each tree")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.compare_tree:
        if not Path(args.compare_tree, "areal_mega", "sandbox").is_dir():
            raise SystemExit(f"bench_rewards: --compare-tree {args.compare_tree} holds no areal_mega/sandbox")
        res = compare(str(Path(args.compare_tree).resolve()), args.workers, args.num_code, args.rounds)
        print(json.dumps({"compare": res, "wall_s": round(time.perf_counter() - t_start, 1)}))
        return

    math = MathReward(num_workers=args.workers, timeout_s=30.0)
    try:
        cases = math_cases(args.num_math)
        asyncio.run(timed([math("q", c, d) for c, d in cases[: args.workers]]))  # start + warm the workers
        math_s = asyncio.run(timed([math("q", c, d) for c, d in cases]))
    finally:
        math.close()

    code = CodeReward(SandboxConfig(mode=args.sandbox_mode, num_workers=args.workers, timeout_s=10.0))
    try:
        sb = code.sandbox
        asyncio.run(timed([sb.run("print(1)") for _ in range(args.workers)]))
        exec_s = asyncio.run(timed([sb.run("a, b = map(int, input().split())\nprint(a + b)", f"{i} 1\n")
                                    for i in range(args.num_code)]))
        tests = [{"input": f"{i} 2\n", "output": str(i + 2)} for i in range(4)]
        completion = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
        n_samples = max(args.num_code // 4, 1)
        code_s = asyncio.run(timed([code("", completion, {"tests": tests}) for _ in range(n_samples)]))
    finally:
        code.close()

    judge = None
    if args.sglang_python:
        from tools.bench_judge import measure_judge

        judge = measure_judge(args.sglang_python)
    print(json.dumps({
        "math_rewards_per_s": round(args.num_math / math_s, 1),
        "sandbox_executions_per_s": round(args.num_code / exec_s, 2),
        "code_rewards_per_s": round(n_samples / code_s, 2),
        "judge_requests_per_s": judge["judge_requests_per_s"] if judge else None,
        "judge": judge,
        "workers": args.workers,
        "sandbox_mode": args.sandbox_mode,
        "num_math": args.num_math,
        "num_code": args.num_code,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }))


if __name__ == "__main__":
    main()

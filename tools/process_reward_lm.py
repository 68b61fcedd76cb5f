"""Process rewards on a language model: outcome-only GRPO vs outcome + process GRPO, same seeds,
through the real trainer (SGLang CPU server, TP2 megatron learners); prints JSON (one line per run,
then a summary).

    python tools/process_reward_lm.py --sglang-python S --seeds 1 2 --plot docs/process_rewards_lm.png

The task (areal_mega/demo/chain.py): three-step chains of single-digit additions/subtractions
rewritten one operation per step (``Q:5+3-4+2=?A:`` -> ``8-4+2=4+2=6``), on the demo's tiny Qwen2
SFT'd on demonstrations whose steps are written one too high 60% of the time (so the SFT'd
model is usually wrong: 13% right answers sampled, 7% greedy, in docs/algorithms.md's run). Both arms: configs/grpo_tiny.yaml (the demo's
async GRPO, max_staleness 1), the reward ``chain_reward``, the same SFT model and seeds. Outcome
arm: the chain's answer only. Process arm: also ``workflow.steps`` (cut after each "="),
``reward.step_scoring: prefix`` (each step right given the step before it) and
``algorithm.process_weight: 1``. Recorded per step: the outcome reward (the same function in both
arms), the step reward's mean, held-out greedy accuracy every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = {
    "outcome": [],
    "process": [r"workflow.steps.split=regex", 'workflow.steps.delimiter="="', "reward.step_scoring=prefix",
                "algorithm.process_weight=1.0"],
}


def _load_sampler():
    """stop() -> (min, mean, max) of the 1-min load average sampled every 10 s."""
    stop, seen = threading.Event(), []

    def loop():
        while not stop.wait(10.0):
            seen.append(os.getloadavg()[0])

    t = threading.Thread(target=loop, daemon=True)
    t.start()

    def done():
        stop.set()
        t.join()
        return [round(min(seen), 1), round(sum(seen) / len(seen), 1), round(max(seen), 1)] if seen else None

    return done


def _steps_mean(rows: list[dict], key: str) -> list:
    return [round(r[key], 4) if key in r else None for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--learner-python", default=sys.executable)
    ap.add_argument("--work-dir", default="runs/process_rewards_lm")
    ap.add_argument("--rl-steps", type=int, default=16)
    ap.add_argument("--sft-steps", type=int, default=250)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1], help="trainer seeds (and server sampling seeds)")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--num-sft", type=int, default=20000)
    ap.add_argument("--plot", default=None, help="write the curves PNG here")
    args = ap.parse_args()
    if not os.path.exists(args.sglang_python):
        raise SystemExit(f"--sglang-python: {args.sglang_python} does not exist")
    if args.rl_steps < 1 or args.sft_steps < 1:
        raise SystemExit("--rl-steps / --sft-steps: must be >= 1")

    from areal_mega.demo.run import _run, run_rl, run_sft

    work = (REPO / args.work_dir).resolve() if not os.path.isabs(args.work_dir) else Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    task, sft = work / "chain", work / "sft"
    t0 = time.time()
    if not (task / "model" / "config.json").exists():
        _run([args.learner_python, "-m", "areal_mega.demo.chain", "--out", str(task), "--num-sft", str(args.num_sft)],
             env, work / "chain.log")
    if not (sft / "hf" / "config.json").exists():
        run_sft(task, sft, steps=args.sft_steps, learner_python=args.learner_python, env=env)
    print(f"[{time.time() - t0:5.0f}s] task and SFT model ready in {work}", file=sys.stderr, flush=True)

    runs: dict[str, dict] = {}
    for seed in args.seeds:
        for arm in args.arms:
            out = work / f"{arm}-s{seed}"
            done = (out / "metrics.jsonl").exists() and (out / "eval.jsonl").exists() and \
                len((out / "metrics.jsonl").read_text().splitlines()) >= args.rl_steps
            if done:  # this arm and seed finished in an earlier call on this work dir: reported, not rerun
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][:args.rl_steps]
                evals = [e for e in map(json.loads, (out / "eval.jsonl").read_text().splitlines())
                         if e["step"] <= args.rl_steps]
                rec = {"arm": arm, "seed": seed, "steps": len(rows), "reward": _steps_mean(rows, "rollout/reward_mean"),
                       "step_reward": _steps_mean(rows, "rollout/step_reward_mean"),
                       "heldout": [[e["step"], round(e["accuracy"], 3)] for e in evals], "from_earlier_run": True}
                runs[f"{arm}-s{seed}"] = rec
                print(json.dumps(rec), flush=True)
                continue
            for stale in ("eval.jsonl", "metrics.jsonl", "prompts.jsonl"):
                (out / stale).unlink(missing_ok=True)
            load = _load_sampler()
            t1 = time.time()
            run_rl("configs/grpo_tiny.yaml", model_dir=sft / "hf", task=task, out=out, steps=args.rl_steps,
                   learner_python=args.learner_python, sglang_python=args.sglang_python, env=env,
                   extra=["reward.options.function=areal_mega.demo.chain:chain_reward", "workflow.sampling.max_new_tokens=16",
                          f"seed={seed}", f"inference.server.random_seed={seed}", f"trainer.eval_every={args.eval_every}",
                          *ARMS[arm]])
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
            rec = {"arm": arm, "seed": seed, "steps": len(rows), "reward": _steps_mean(rows, "rollout/reward_mean"),
                   "step_reward": _steps_mean(rows, "rollout/step_reward_mean"),
                   "heldout": [[e["step"], round(e["accuracy"], 3)] for e in evals],
                   "wall_s": round(time.time() - t1, 1), "load_avg_1min_min_mean_max": load()}
            runs[f"{arm}-s{seed}"] = rec
            print(json.dumps(rec), flush=True)

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 4) if xs else None

    summary = {}
    for arm in args.arms:
        rs = [runs[f"{arm}-s{s}"] for s in args.seeds]
        k = max(1, min(5, args.rl_steps // 4))
        summary[arm] = {"reward_first": mean([x for r in rs for x in r["reward"][:k]]),
                        "reward_last": mean([x for r in rs for x in r["reward"][-k:]]),
                        "heldout_before": mean([r["heldout"][0][1] for r in rs]),
                        "heldout_after": mean([r["heldout"][-1][1] for r in rs]),
                        "heldout_after_per_seed": [r["heldout"][-1][1] for r in rs]}
    print(json.dumps({"summary": summary, "args": vars(args), "wall_s": round(time.time() - t0, 1)}), flush=True)
    if args.plot:
        _plot(runs, args)
    return 0


def _plot(runs: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    colors = {"outcome": "tab:red", "process": "tab:blue"}
    for name, r in runs.items():
        ls = "-" if r["seed"] == args.seeds[0] else "--"
        lab = f"{r['arm']} (seed {r['seed']})"
        ax[0].plot(range(len(r["reward"])), r["reward"], ls, marker="o", ms=3, color=colors[r["arm"]], label=lab)
        if any(x is not None for x in r["step_reward"]):
            ax[1].plot(range(len(r["step_reward"])), r["step_reward"], ls, marker="o", ms=3, color=colors[r["arm"]],
                       label=lab)
        ax[2].plot([h[0] for h in r["heldout"]], [h[1] for h in r["heldout"]], ls, marker="s",
                   color=colors[r["arm"]], label=lab)
    ax[0].set_title("train outcome reward (the chain's answer right)", fontsize=9)
    ax[1].set_title("train step reward (process arm: mean over steps)", fontsize=9)
    ax[2].set_title("held-out greedy accuracy (50 chains never trained on)", fontsize=9)
    for a in ax:
        a.set_xlabel("step")
    ax[0].legend(fontsize=8)
    fig.suptitle("tiny Qwen2, 3-step arithmetic chains, async GRPO: outcome only vs outcome + process rewards",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

"""python tools/plot_run.py runs/smollm2/grpo/metrics.jsonl docs/smollm2_grpo_curves.png [--title T]

The TensorBoard curves of a run as one PNG, from its ``metrics.jsonl`` (the same scalars the
trainer writes to ``tb/``): rollout reward, token staleness (mean and max), generated tokens/s,
groups rejected by dynamic filtering, and the PPO clip fraction / behaviour importance weight. Needs matplotlib (in the learner venv); prints the path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [  # (title, [(metrics key, label)])
    ("rollout reward (mean over the batch)", [("rollout/reward_mean", "reward")]),
    ("token staleness (versions)", [("staleness/mean", "mean"), ("staleness/max", "max")]),
    ("throughput", [("perf/generated_tokens_per_s", "generated tokens/s")]),
    ("groups rejected per batch (all equal rewards)", [("rollout/rejected_episodes", "rejected")]),
    ("PPO", [("train/clip_frac", "clip fraction"), ("train/importance_weight/mean", "pi_prox/pi_behav - 1")]),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plot_run", description=__doc__.splitlines()[2])
    ap.add_argument("metrics")
    ap.add_argument("out")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    path = Path(args.metrics)
    if not path.exists():
        print(f"plot_run: {path} does not exist", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.8 * len(PANELS), 3.4))
    for ax, (title, series) in zip(axes, PANELS):
        for key, label in series:
            pts = [(r["version"], r[key] - (1.0 if key == "train/importance_weight/mean" else 0.0)) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (policy version)")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

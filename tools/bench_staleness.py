"""The staleness study (issue 41, docs/staleness.md): how each method holds up as the data ages.

    python tools/bench_staleness.py --sglang-python $S/bin/python [--etas 0 1 2 4 8 16]
        [--methods naive decoupled m2po] [--seeds 1 2] [--steps 30] [--workdir runs/staleness] [--saved-only] [key=value ...]

The `make example` task (SmolLM2-135M-Instruct, two-term arithmetic, async GRPO) trained once per
cell eta x method x seed, every trained token exactly eta versions old (``trainer.study_delay``;
the first eta steps train on version 0's samples), then `areal-mega eval` of the result on the
held-out items (greedy). Prints one JSON object (per cell: held-out accuracy and its binomial
SE, the train reward / ESS / step-seconds curves; per eta x method: mean accuracy over seeds and
its SE) and writes <workdir>/staleness.json and staleness.png. Cells already run are reused
(their summary.json), so an interrupted study continues.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_mega.demo.example import evaluate, example_env, link_model, train  # noqa: E402
from areal_mega.demo.run import REPO  # noqa: E402

METHODS: dict[str, list[str]] = {
    "naive": ["algorithm.decoupled=false"],  # PPO against the behaviour policy, no correction
    "decoupled": [],  # the config's decoupled PPO (AReaL), token-level cap 5, mask
    "m2po": ["algorithm.m2_threshold=0.04"],
    "icepop": ["algorithm.behav_imp_weight_floor=0.5", "algorithm.behav_imp_weight_cap=2.0"],
    "geometric": ["algorithm.behav_imp_weight_level=geometric", "algorithm.behav_imp_weight_cap=2.0"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean_token_mean"],
    "cispo": ["algorithm.policy_loss=cispo"],
    "a3po": ["algorithm.proximal=interpolate"],
}
"""Each method's overrides of configs/grpo_smollm2.yaml (algorithm settings: docs/algorithms.md)."""


def cell_overrides(eta: int, method: str, seed: int, steps: int) -> list[str]:
    delay = [f"trainer.study_delay={eta}", "trainer.study_opt_in=true"] if eta else []
    return [f"rollout.max_staleness={eta}", *delay, f"seed={seed}", f"trainer.num_steps={steps}",
            "trainer.eval_at_start=false", "trainer.eval_at_end=false", "trainer.eval_every=0", *METHODS[method]]


def curves(metrics: Path) -> dict[str, list[float]]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "version" in r]
    get = lambda k: [r.get(k, float("nan")) for r in rows]  # noqa: E731
    stale = [r.get("rollout/token_staleness", {}) for r in rows]
    # decoupled methods: ESS of pi_prox / pi_behav; naive PPO (no pi_prox): of its ratio pi_theta /
    # pi_behav at the step's first update, the same quantity
    ess = [r.get("train/importance_weight/ess", r.get("train/ratio/ess", float("nan"))) for r in rows]
    # step_s is the whole step (rollout wait included); train_s the learner's update; prox_s its
    # extra forward for pi_prox (0 under A-3PO's interpolation and for naive PPO)
    return {"reward": get("rollout/reward_mean"), "ess": ess, "step_s": get("perf/step_s"),
            "train_s": get("time/train_s"), "prox_s": get("time/prox_logp_s"), "staleness": stale}


def cell_dir(w: Path, eta: int, method: str, seed: int, steps: int) -> Path:
    return w / f"eta{eta}-{method}-seed{seed}-steps{steps}"  # a cell of another length is another cell


def run_cell(w: Path, model, eta: int, method: str, seed: int, steps: int, py: str, sg: str, env,
             extra: list[str]) -> dict:
    """One cell, or its saved summary; ``model()`` gives the model directory (built on first use)."""
    cell = cell_dir(w, eta, method, seed, steps)
    done = cell / "summary.json"
    if done.is_file():
        return load_saved(cell)
    t0 = time.time()
    train(model(), cell / "grpo", learner_python=py, sglang_python=sg, env=env,
          overrides=[*cell_overrides(eta, method, seed, steps), *extra])
    after = evaluate(cell / "grpo" / "hf", cell / "eval", learner_python=py, sglang_python=sg, env=env)
    c = curves(cell / "grpo" / "metrics.jsonl")
    trained = [s for row in c["staleness"][eta:] for s in row]  # past the warm-up
    res = {"eta": eta, "method": method, "seed": seed, "steps": steps, "accuracy": after["accuracy"],
           "accuracy_se": after["accuracy_se"], "n": after["n"], "wall_s": round(time.time() - t0, 1),
           "staleness_after_warmup": sorted(set(map(int, trained))), **c}
    done.write_text(json.dumps(res))
    return res


def load_saved(cell: Path) -> dict:
    """A saved cell's summary, its curves re-read from its metrics.jsonl where that was kept (so a
    cell saved by an older version of this tool gains the curves added since)."""
    res = json.loads((cell / "summary.json").read_text())
    metrics = cell / "grpo" / "metrics.jsonl"
    if metrics.is_file():
        fresh = curves(metrics)
        if fresh.keys() - res.keys():
            res.update(fresh)
            (cell / "summary.json").write_text(json.dumps(res))
    return res


def summarise(cells: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(c["eta"], c["method"]) for c in cells}):
        group = [c for c in cells if (c["eta"], c["method"]) == key]
        accs = [c["accuracy"] for c in group]
        mean = statistics.fmean(accs)
        se = statistics.stdev(accs) / math.sqrt(len(accs)) if len(accs) > 1 else None
        median = lambda k: _median([s for c in group for s in c.get(k, [])])  # noqa: E731
        # the eval's own sampling error of that mean (200 items: ~3.4 points per cell)
        binom = [c["accuracy_se"] for c in group if "accuracy_se" in c]
        se_eval = math.sqrt(sum(b * b for b in binom)) / len(binom) if binom else None
        out.append({"eta": key[0], "method": key[1], "accuracy_mean": mean, "accuracy_se_over_seeds": se,
                    "accuracy_se_eval": se_eval,
                    "seeds": len(accs), "step_s_median": median("step_s"), "train_s_median": median("train_s"),
                    "prox_s_median": median("prox_s")})
    return out


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if not math.isnan(x)]  # NaN: a step without that timer (naive PPO's prox)
    return statistics.median_high(xs) if xs else None


def plot(summary: list[dict], cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = sorted({c["seed"] for c in cells})  # one colour a method in both panels; seeds by line style
    for m in sorted({s["method"] for s in summary}):
        rows = [s for s in summary if s["method"] == m]
        largest_eta = max(r["eta"] for r in rows)
        bars = a.errorbar([r["eta"] for r in rows], [r["accuracy_mean"] for r in rows],
                          yerr=[r["accuracy_se_over_seeds"] or r["accuracy_se_eval"] or 0 for r in rows],
                          marker="o", capsize=3, label=m)
        for c in cells:
            if c["method"] == m and c["eta"] == largest_eta:
                b.plot(c["ess"], color=bars.lines[0].get_color(), linestyle=["-", "--", ":", "-."][seeds.index(c["seed"]) % 4],
                       label=f"{m} eta={c['eta']} seed={c['seed']}")
    a.set_xscale("symlog", base=2)
    a.set(xlabel="staleness eta (versions)", ylabel="held-out accuracy (greedy)",
          title="accuracy vs staleness (bars: SE over seeds, else the eval's)")
    b.set(xlabel="step", ylabel="ESS of importance weights", title="ESS at each method's largest eta")
    a.legend(), b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("--learner-python", default=sys.executable)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--methods", nargs="+", default=["naive", "decoupled", "m2po"], choices=sorted(METHODS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workdir", default="runs/staleness")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--saved-only", action="store_true",
                    help="summarise the grid's saved cells, run none (a study spread over several sittings)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of every cell's run (e.g. GPU settings)")
    args = ap.parse_args(argv)
    if any(e < 0 for e in args.etas) or args.steps <= max(args.etas):
        ap.error(f"--steps ({args.steps}) must exceed the largest eta ({max(args.etas)}) and every eta be >= 0")
    w = (REPO / args.workdir).resolve()
    env = example_env()
    built: list[Path] = []

    def model() -> Path:
        if not built:
            built.append(link_model(w, args.learner_python, env))
        return built[0]

    grid = [(e, m, s) for e in args.etas for m in args.methods for s in args.seeds]
    if args.saved_only:
        saved = {g: cell_dir(w, *g, args.steps) / "summary.json" for g in grid}
        cells = [load_saved(p.parent) for p in saved.values() if p.is_file()]
        missing = [f"eta{e}-{m}-seed{s}" for (e, m, s), p in saved.items() if not p.is_file()]
        if not cells:
            ap.error(f"--saved-only: no saved cell of this grid under {w}")
    else:
        cells = [run_cell(w, model, *g, args.steps, args.learner_python, args.sglang_python, env, args.overrides)
                 for g in grid]
        missing = []
    summary = summarise(cells)
    result = {"study": "staleness", "model": "SmolLM2-135M-Instruct", "steps": args.steps, "summary": summary,
              "missing": missing, "cells": cells}
    (w / "staleness.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(summary, cells, w / "staleness.png")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

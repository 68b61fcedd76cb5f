"""PNG of a throughput plan: predicted samples/s against the split and against max_staleness.

matplotlib is optional (the learner venv may lack it): ``plot_plan`` then returns
``(None, reason)`` and the caller says so; nothing else depends on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_mega.simulator.planner import PlanReport


def plot_plan(rep: "PlanReport", path: str | Path) -> tuple[str | None, str]:
    """Write the two-panel plot to ``path``; returns (path or None, why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib to get the PNG)"
    feas = rep.feasible()
    if not feas:
        return None, "no admissible split to plot"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for eta in rep.staleness:
        xs = [s.learner_nodes for s in feas]
        ys = [s.by_staleness[eta]["samples_per_s"] for s in feas]
        ax1.plot(xs, ys, marker="o", label=f"max_staleness {eta}")
    ax1.set_xlabel(f"learner nodes (of {rep.nodes}; the rest generate)")
    ax1.set_ylabel("predicted samples/s")
    ax1.set_title("throughput vs split")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    best = rep.best()
    bsync = rep.best(0)
    shown = [b[0] for b in (best, bsync) if b is not None]
    if rep.configured is not None:
        shown += [s for s in feas if s.learner_nodes == rep.configured[0]]
    seen: set[int] = set()
    for s in shown:
        if s.learner_nodes in seen:
            continue
        seen.add(s.learner_nodes)
        ys = [s.by_staleness[e]["samples_per_s"] for e in rep.staleness]
        ax2.plot(list(rep.staleness), ys, marker="o", label=f"{s.learner_nodes} learner + {s.engine_nodes} engine nodes")
    ax2.set_xlabel("max_staleness")
    ax2.set_ylabel("predicted samples/s")
    ax2.set_title("throughput vs max_staleness")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{Path(rep.config).name}: {rep.nodes} nodes x {rep.gpus_per_node} GPUs ({rep.cost.gpu})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out), ""


def plot_decode_sweep(fit, path: str | Path, title: str = "") -> tuple[str | None, str]:
    """Measured tokens/s of a decode sweep (``simulator.sweep.DecodeFit.points``) against
    concurrency, one series per (length, prompt), with the fitted model's curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib to get the PNG)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted({(p.new_tokens, p.prompt_tokens) for p in fit.points})
    top = max(p.concurrency for p in fit.points)
    ns = sorted({1, *range(1, top + 1, max(1, top // 64))} | {top})
    for i, (L, P) in enumerate(series):
        pts = sorted((p for p in fit.points if (p.new_tokens, p.prompt_tokens) == (L, P)), key=lambda p: p.concurrency)
        color = f"C{i}"
        ax.plot([p.concurrency for p in pts], [p.tokens_per_s for p in pts], "o", color=color,
                label=f"measured, {L} new tokens, prompt {P}")
        ax.plot(ns, [n * L / fit.predict(n, L, P) for n in ns], "-", color=color, alpha=0.7)
    dm = fit.decode_model(prompt_tokens=series[0][1])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens/s (whole batch)")
    ax.set_title(title or f"decode sweep: fit peak {dm.peak_tokens_per_s:.0f} tok/s, half_batch {dm.half_batch:.1f}, "
                          f"rms error {fit.rms_rel_error:.0%}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path), ""

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

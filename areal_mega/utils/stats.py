"""The one rule for combining training stats (over micro-batches, DP ranks and optimizer steps).

By key: totals (``loss``, ``n_tokens``, ``num_tokens``, ``num_microbatches``) are summed, keys
ending in ``/max`` / ``/min`` take the max / min, the step counter and LR (``step``, ``lr``) the
last value, everything else a mean -- weighted by ``n_tokens`` where the records carry it. The
engine applies it across micro-batches and DP ranks (with collectives), the trainer across the
optimizer steps of one rollout batch.
"""

from __future__ import annotations

from typing import Literal, Mapping, Sequence

Reduction = Literal["sum", "max", "min", "last", "mean"]

SUMMED = frozenset({"loss", "n_tokens", "num_tokens", "num_microbatches"})
LAST = frozenset({"step", "lr"})


def reduction(key: str) -> Reduction:
    if key in SUMMED:
        return "sum"
    if key.endswith("/max"):
        return "max"
    if key.endswith("/min"):
        return "min"
    if key in LAST:
        return "last"
    return "mean"


def reduce_stats(records: Sequence[Mapping[str, float]], weights: Sequence[float] | None = None) -> dict[str, float]:
    """``records`` (the keys of the first) combined by :func:`reduction`; means weighted by
    ``weights`` (default: equal)."""
    w = list(weights) if weights is not None else [1.0] * len(records)
    total_w = sum(w)
    out: dict[str, float] = {}
    for k in records[0]:
        vals = [float(r[k]) for r in records]
        how = reduction(k)
        if how == "sum":
            out[k] = sum(vals)
        elif how == "max":
            out[k] = max(vals)
        elif how == "min":
            out[k] = min(vals)
        elif how == "last":
            out[k] = vals[-1]
        else:
            out[k] = sum(v * wi for v, wi in zip(vals, w)) / max(total_w, 1e-12)
    return out

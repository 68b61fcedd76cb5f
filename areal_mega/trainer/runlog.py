"""The run's per-step logs agree with the checkpoint it resumes from.

A run killed after checkpoint N has already appended records of steps past N (a batch drawn
and logged in ``prompts.jsonl``, maybe trained and logged in ``metrics.jsonl``) that the resumed
run redoes. Before the resumed run writes anything, :func:`cut_logs_past` moves those records
out of the logs into ``<name>.superseded`` (appended, for post-mortems), so each log holds each
step once and ``prompts.jsonl`` proves "no prompt trained twice" without a caveat.

What "past N" means per log (checkpoint N = N optimizer steps done, weights version N):

* ``prompts.jsonl``: rows ``{"version": v, ...}``, the batch trained at version v, i.e. by step
  v + 1: kept when v < N;
* ``metrics.jsonl`` and ``eval.jsonl``: rows ``{"step": s, ...}``: kept when s <= N.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# log file -> (key, last value kept for checkpoint N as a function of N)
_LOGS = {"prompts.jsonl": ("version", lambda n: n - 1), "metrics.jsonl": ("step", lambda n: n),
         "eval.jsonl": ("step", lambda n: n)}


def cut_logs_past(out_dir: str | Path, step: int) -> dict[str, int]:
    """Move the records past checkpoint ``step`` (0: a fresh start) out of the per-step logs in
    ``out_dir``; returns how many were moved per file (files without any are not rewritten)."""
    moved: dict[str, int] = {}
    for name, (key, last) in _LOGS.items():
        path = Path(out_dir) / name
        if not path.exists():
            continue
        keep, cut = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                value = json.loads(line).get(key)
            except (json.JSONDecodeError, AttributeError):
                value = None  # a torn last line (killed mid-write): never a complete record
            (keep if isinstance(value, int) and value <= last(step) else cut).append(line)
        if not cut:
            continue
        with open(path.with_name(name + ".superseded"), "a") as f:
            f.write(json.dumps({"superseded_by_resume_from_step": step}) + "\n")
            f.writelines(ln if ln.endswith("\n") else ln + "\n" for ln in cut)
        tmp = path.with_name(name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
        moved[name] = len(cut)
    return moved

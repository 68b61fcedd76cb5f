"""Metrics: phase timing and TensorBoard scalars through one small object.

    metrics = Metrics(log_dir)               # rank 0 only writes; others get a no-op writer
    with metrics.phase("rollout"):           # records time/rollout_s for the current step
        ...
    metrics.log({"reward/mean": 0.4})
    metrics.commit(step)                     # flush this step's scalars (TensorBoard, metrics.jsonl, stdout)
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, log_dir: str | None, *, enabled: bool = True, echo: bool = True,
                 jsonl_path: str | None = None) -> None:
        self._writer = None
        # Opened at the first commit: a resumed run first moves the records past its checkpoint out.
        self._jsonl_path = jsonl_path if enabled else None
        self._jsonl = None
        self._enabled = enabled
        self._echo = echo
        self._pending: dict[str, float] = {}
        self._histograms: dict[str, dict[int, int]] = {}
        self.history: list[dict[str, float]] = []
        if enabled and log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._pending[f"time/{name}_s"] = time.perf_counter() - t0

    def log(self, scalars: dict[str, float]) -> None:
        self._pending.update({k: float(v) for k, v in scalars.items()})

    def histogram(self, name: str, counts: dict[int, int]) -> None:
        """A histogram of integer values given as {value: count} (e.g. token staleness), written
        as-is: a batch of a million tokens is never expanded to a million-element array."""
        self._histograms[name] = dict(counts)

    def commit(self, step: int) -> dict[str, float]:
        row = dict(self._pending)
        self._pending.clear()
        if self._enabled:
            if self._writer is not None:
                for k, v in row.items():
                    self._writer.add_scalar(k, v, step)
                for k, counts in self._histograms.items():
                    if counts:
                        self._write_histogram(k, counts, step)
                self._writer.flush()
            if self._jsonl is None and self._jsonl_path:
                self._jsonl = open(self._jsonl_path, "a")
            if self._jsonl is not None:
                # histograms as {value: count} (e.g. "rollout/token_staleness": {"2": 640})
                hist = {k: {str(v): c for v, c in sorted(counts.items())} for k, counts in self._histograms.items()}
                self._jsonl.write(json.dumps({"step": step, **row, **hist}) + "\n")
                self._jsonl.flush()
            if self._echo:
                shown = {k: round(v, 4) for k, v in sorted(row.items())}
                print(json.dumps({"step": step, **shown}), flush=True)
        self._histograms.clear()
        self.history.append({"step": step, **row})
        return row

    def _write_histogram(self, name: str, counts: dict[int, int], step: int) -> None:
        values = sorted(counts)
        num = sum(counts.values())
        self._writer.add_histogram_raw(
            name, min=values[0], max=values[-1], num=num,
            sum=sum(v * c for v, c in counts.items()), sum_squares=sum(v * v * c for v, c in counts.items()),
            bucket_limits=[v + 0.5 for v in values], bucket_counts=[counts[v] for v in values], global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._jsonl is not None:
            self._jsonl.close()

"""Metrics: TensorBoard scalars and the staleness histogram as a reader sees them."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_mega.utils.metrics import Metrics


def test_scalars_phases_and_count_histogram_reach_tensorboard_and_jsonl(tmp_path: Path) -> None:
    m = Metrics(str(tmp_path / "tb"), jsonl_path=str(tmp_path / "metrics.jsonl"), echo=False)
    with m.phase("train"):
        pass
    m.log({"reward/mean": 0.25})
    m.histogram("rollout/token_staleness", {0: 3, 1: 1_000_000, 2: 7})
    m.commit(1)
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0}).Reload()
    assert acc.Scalars("reward/mean")[0].value == 0.25
    assert "time/train_s" in acc.Tags()["scalars"]
    h = acc.Histograms("rollout/token_staleness")[0].histogram_value
    assert (h.num, h.min, h.max, h.sum) == (1_000_010, 0, 2, 1_000_014)
    assert list(h.bucket) == [3, 1_000_000, 7]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["step"] == 1 and row["reward/mean"] == 0.25

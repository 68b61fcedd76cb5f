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
    assert row["rollout/token_staleness"] == {"0": 3, "1": 1_000_000, "2": 7}  # the histogram in jsonl too


def test_resume_moves_log_records_past_the_checkpoint_aside(tmp_path: Path) -> None:
    """A run killed after checkpoint 2 had logged batch version 2 (and 3) and step 3; the resumed
    run redoes them, so before it logs they move to *.superseded: each step then appears once."""
    import json

    from areal_mega.trainer.runlog import cut_logs_past

    def write(name, rows, torn=""):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)

    write("prompts.jsonl", [{"version": v, "prompts": [[0, v, f"p{v}"]]} for v in range(4)])
    write("metrics.jsonl", [{"step": s, "loss": 0.1} for s in range(1, 4)], torn='{"step": 4, "lo')
    write("eval.jsonl", [{"step": 2, "acc": 0.5}])
    assert cut_logs_past(tmp_path, 2) == {"prompts.jsonl": 2, "metrics.jsonl": 2}
    rows = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    assert [r["version"] for r in rows("prompts.jsonl")] == [0, 1]
    assert [r["step"] for r in rows("metrics.jsonl")] == [1, 2]
    assert rows("eval.jsonl") == [{"step": 2, "acc": 0.5}]
    sup = (tmp_path / "prompts.jsonl.superseded").read_text().splitlines()
    assert json.loads(sup[0]) == {"superseded_by_resume_from_step": 2} and len(sup) == 3
    assert cut_logs_past(tmp_path, 2) == {}  # idempotent
    assert cut_logs_past(tmp_path, 0) == {"prompts.jsonl": 2, "metrics.jsonl": 2, "eval.jsonl": 1}  # a fresh start

"""``trainer.study_delay`` in the real trainer (torchrun learner, megatron-core on gloo, one real
SGLang server, the tiny demo model): every trained token is exactly eta versions old once the
first eta steps (version 0's samples) are past -- the staleness study's premise
(tools/bench_staleness.py, docs/staleness.md). The per-token versions come from the server's
own answers, so a server given the learner's newest weights (the delay ignored) would show
staleness 0 or 1 here (the negative control is the fast test's: test_offpolicy_losses.py).
The same run uses A-3PO's interpolated proximal (``algorithm.proximal: interpolate``): the
engine's micro-batches carry ``prox_alpha`` to the loss, whose behaviour weights are then
recorded; with data 2 versions old they are not all 1. The server runs in bf16, so the delayed
copies are the real engine's bf16 snapshots (the bits are checked in the fast test)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.support.launch import SGLANG_PYTHON, child_env, needs_sglang, run_checked

ETA, STEPS = 2, 4


@pytest.mark.slow
@needs_sglang
def test_every_trained_token_is_exactly_eta_versions_old(tmp_path):
    from areal_mega.demo.run import make_task

    make_task(tmp_path / "tiny", learner_python=sys.executable, env=child_env())
    out = tmp_path / "run"
    run_checked([sys.executable, "-m", "areal_mega.launcher", "local", "--config", "configs/grpo_tiny.yaml",
                 f"model_path={tmp_path / 'tiny/model'}", f"output_dir={out}", f"launch.run_dir={tmp_path / 'launch'}",
                 f"data.path={tmp_path / 'tiny/data/train.jsonl'}", f"eval_data.path={tmp_path / 'tiny/data/test.jsonl'}",
                 f"inference.server.python={SGLANG_PYTHON}", f"trainer.num_steps={STEPS}", "trainer.resume=false",
                 "trainer.eval_at_start=false", "trainer.eval_at_end=false", "trainer.export_hf_at_end=false",
                 "parallel.tensor_parallel=1", "rollout.batch_size=4", "workflow.group_size=4",
                 f"rollout.max_staleness={ETA}", f"trainer.study_delay={ETA}", "trainer.study_opt_in=true",
                 "algorithm.proximal=interpolate", "inference.server.dtype=bfloat16"],
                timeout_s=900)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    for k, r in enumerate(rows):  # step k + 1 trains at version k on the samples of version max(0, k - ETA)
        assert set(r["rollout/token_staleness"]) == {str(min(k, ETA))}, (k, r["rollout/token_staleness"])
        ess = r["train/importance_weight/ess"]
        assert 0 < ess <= 1 + 1e-6 and math.isfinite(r["train/behav_kl"]), r
    assert rows[-1]["train/behav_kl"] != 0.0  # alpha = 2/3 on 2-versions-old tokens: pi_prox != pi_behav

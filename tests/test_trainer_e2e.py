"""The whole product on one machine: tiny model -> megatron SFT (TP=2) -> async GRPO through the
local launcher (one real SGLang CPU server, two torchrun learner ranks, gloo weight sync); then,
from the same SFT model, async PPO with a critic (GAE) and a KL reference; and the trainer with an
interleaved pipeline (PP2 x VPP2) learner.

Asserts what the RL loop exists for, with a fixed seed:
* held-out greedy accuracy (prompts never used by RL) rises by at least MIN_GAIN;
* no trained token was older than rollout.max_staleness versions (the logged maximum), and the
  run really was asynchronous (some tokens were 1 version stale);
* the run leaves TensorBoard events, a distributed checkpoint and an HF export.

Needs AREAL_MEGA_SGLANG_PYTHON (set by `make test`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from areal_mega.demo.run import make_task, run_pipeline, run_rl
from tests.support.launch import SGLANG_PYTHON, child_env, needs_sglang
from tests.support.numerics import fp32_tol, transformer_reductions

# The demo's own stages (areal_mega/demo/) are what this file tests: its model and task included.
pytestmark = [pytest.mark.slow, needs_sglang, pytest.mark.timeout(1500)]

MAX_STALENESS = 1
# Absolute held-out accuracy over 30 prompts after 16 steps. The jump comes at a step that varies
# between machines and runs (the async overlap differs): measured 0.0 -> 0.93, 0.80, 0.87, 0.73 on
# the 2-core AMX host and 0.47 on a CI host (0.43 at step 8). A broken loop stays at 0 (a gain of
# 0.3 is 9 of 30 prompts right that were all wrong before).
MIN_GAIN = 0.3
RL_STEPS = 16
PPO_MIN_GAIN = 0.4  # best held-out accuracy after RL (measured: 0.0 -> 0.70 at step 10 -> 0.77 at step 30)
# Async PPO on this tiny task can peak and then partly fall back within 16 steps (measured once
# with sequence parallelism on: 0.0 -> 0.967 at step 8 -> 0.367 at step 16; other runs 0.667 and
# 0.833 at step 16): the gain is asserted on the best evaluation after RL, and the last one must
# still keep a clear gain.
PPO_MIN_FINAL_GAIN = 0.2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model and one SFT run shared by the GRPO and PPO runs."""
    return tmp_path_factory.mktemp("demo")


def test_sft_then_async_grpo_improves_heldout_accuracy(workdir: Path) -> None:
    s = run_pipeline(str(workdir), learner_python=sys.executable, sglang_python=SGLANG_PYTHON,
                     rl_steps=RL_STEPS, extra=[f"rollout.max_staleness={MAX_STALENESS}", "trainer.eval_every=8"])
    print(json.dumps(s))
    assert s["heldout_accuracy_after"] >= s["heldout_accuracy_before"] + MIN_GAIN, s
    assert s["max_staleness_seen"] <= MAX_STALENESS, s
    out = Path(s["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["staleness/max"] for r in rows) == MAX_STALENESS, "never overlapped generation and training"
    assert all(r["weight_sync/seconds"] > 0 for r in rows)
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").resolve().is_dir()
    assert (out / "hf" / "model.safetensors").exists() and (out / "hf" / "tokenizer.json").exists()


@pytest.mark.heavy  # make test-heavy (CI budget); the critic and GAE are checked in test_critic / test_rl_algorithms
def test_async_ppo_with_critic_improves_heldout_accuracy(workdir: Path) -> None:
    """configs/ppo_tiny.yaml: GAE advantages from a megatron critic, k3 KL to a frozen reference."""
    s = run_pipeline(str(workdir), learner_python=sys.executable, sglang_python=SGLANG_PYTHON, reuse_sft=True,
                     rl_config="configs/ppo_tiny.yaml", rl_name="ppo", rl_steps=RL_STEPS,
                     extra=[f"rollout.max_staleness={MAX_STALENESS}", "trainer.eval_every=8"])
    print(json.dumps(s))
    best = max(acc for step, acc in s["eval_curve"] if step > 0)
    assert best >= s["heldout_accuracy_before"] + PPO_MIN_GAIN, s
    assert s["heldout_accuracy_after"] >= s["heldout_accuracy_before"] + PPO_MIN_FINAL_GAIN, s
    assert s["max_staleness_seen"] <= MAX_STALENESS, s
    rows = [json.loads(line) for line in (Path(s["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic/update_successful"] == 1 and r["train/ref_kl"] >= 0 for r in rows)
    assert (Path(s["output_dir"]) / "checkpoints" / "latest" / "critic").is_dir()


@pytest.mark.heavy  # make test-heavy (CI budget); VPP exactness and resume are checked at engine level (test_engine)
def test_interleaved_pipeline_trainer(tmp_path: Path) -> None:
    """The RL trainer with an interleaved pipeline learner (PP2 x VPP2 on a 4-layer tiny model, two
    ranks, one SGLang server): every step trains and syncs, and the servers' behaviour log-probs
    equal the learner's proximal ones (mean importance weight 1), which a wrong weight export or
    a wrong interleaved forward would break. Synchronous (max_staleness 0), so that behaviour and
    proximal log-probs come from the same weights: they differ by fp32 rounding only."""
    env = child_env()
    make_task(tmp_path / "tiny", learner_python=sys.executable, env=env, num_layers=4)
    out = tmp_path / "grpo"
    run_rl("configs/grpo_tiny.yaml", model_dir=tmp_path / "tiny" / "model", task=tmp_path / "tiny", out=out, steps=3,
           learner_python=sys.executable, sglang_python=SGLANG_PYTHON, env=env,
           extra=["trainer.eval_every=0", "trainer.eval_at_start=false", "trainer.eval_at_end=false",
                  "rollout.max_staleness=0", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=2",
                  "parallel.virtual_pipeline_parallel=2"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    # Learner (megatron fp32, PP2 x VPP2) and server (SGLang fp32) log-probs of the same weights: the
    # 4-layer forward's reductions in another order (tests/support/numerics.py; FWD = 26 of up to
    # K = 128 terms, the vocabulary), relative to the logits' scale -- O(1) for a random std-0.02
    # model three small steps from its init (0.9 for the engine tests' one); 10 is taken -- and
    # |d lp| <= 2 max |d z|; a weight w = exp(d lp) then lies within e^tol - 1 of 1. A wrong export
    # or forward moves log-probs by O(1).
    lp_tol = 2 * fp32_tol(128, 10.0, ops=transformer_reductions(4))
    for r in rows:
        assert abs(r["train/importance_weight/mean"] - 1.0) <= math.expm1(lp_tol), r
        assert r["weight_sync/seconds"] > 0 and r["staleness/max"] == 0


@pytest.mark.cp_heavy
def test_context_parallel_trainer_checkpoint_and_resume(tmp_path: Path) -> None:
    """The RL trainer with a context-parallel learner (CP2: two ranks, each holding 2 of the 4
    chunks of every sequence; one SGLang server): every step trains and syncs the weights (CP ranks
    are replicas: the weights go once), the servers' behaviour log-probs equal the learner's
    proximal ones (importance weight 1, as in the VPP test above: a wrong split, gather or export
    moves log-probs by O(1)), a checkpoint written at CP2 is resumed (versions continue 1, 2 | 3).
    make test-cp."""
    env = child_env()
    make_task(tmp_path / "tiny", learner_python=sys.executable, env=env, num_layers=4)
    out = tmp_path / "grpo"
    common = ["trainer.eval_every=0", "trainer.eval_at_start=false", "trainer.eval_at_end=false",
              "trainer.export_hf_at_end=false", "rollout.max_staleness=0", "parallel.tensor_parallel=1",
              "parallel.context_parallel=2", "trainer.save_every=2"]
    kw = dict(model_dir=tmp_path / "tiny" / "model", task=tmp_path / "tiny", out=out, learner_python=sys.executable,
              sglang_python=SGLANG_PYTHON, env=env)
    run_rl("configs/grpo_tiny.yaml", steps=2, extra=common, **kw)
    assert any(out.rglob("areal_mega.json")), "no checkpoint written at CP2"
    run_rl("configs/grpo_tiny.yaml", steps=3, extra=common + ["trainer.resume=true"], **kw)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "version" in r]
    assert [r["version"] for r in rows] == [1, 2, 3]  # the second run resumed at step 2, not from scratch
    lp_tol = 2 * fp32_tol(128, 10.0, ops=transformer_reductions(4))  # as test_interleaved_pipeline_trainer
    for r in rows:
        assert abs(r["train/importance_weight/mean"] - 1.0) <= math.expm1(lp_tol), r
        assert r["weight_sync/seconds"] > 0 and r["staleness/max"] == 0

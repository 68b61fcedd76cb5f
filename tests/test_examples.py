"""examples/: five experiments written outside the package, each run by the real trainer (two
torchrun learner ranks, megatron-core on gloo, one real SGLang server, the tiny demo model) for
two steps through the local launcher, plus a fast check of each component's own numbers.

What each run must show is the component's own effect on the run's numbers, which the built-in
it replaces would not give (the negative control is named at each check)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from areal_mega.algo.advantages import compute_advantages
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.api.io import GenerationResult
from areal_mega.experiment import load_experiment
from tests.support.launch import REPO, SGLANG_PYTHON, child_env, needs_sglang, run_checked
from tests.support.numerics import fp32_tol, transformer_reductions

sys.path.insert(0, str(REPO))  # the examples import as examples.<name>, as from the repository root
from examples.arithmetic_source import ArithmeticSource  # noqa: E402
from examples.digits_reward import DigitsReward  # noqa: E402
from examples.guess_game import GuessTheDigit  # noqa: E402
from examples.median_baseline import MedianBaseline  # noqa: E402

STEPS, BATCH, GROUP = 2, 4, 4


# ---------------------------------------------------------------- fast: each component's numbers
def test_each_example_config_loads_its_typed_options():
    for name, get, want in [
        ("guess_game", lambda c: c.workflow.options, GuessTheDigit.Options(max_moves=3, move_discount=0.5)),
        ("median_baseline", lambda c: c.algorithm.adv_options, MedianBaseline.Options(scale=1.0)),
        ("digits_reward", lambda c: c.reward.options, DigitsReward.Options(floor=0.25, number=0.5, match=1.0)),
        ("arithmetic_source", lambda c: c.data.options, ArithmeticSource.Options(max_operand=20, num_heldout=16)),
    ]:
        assert get(load_experiment(str(REPO / "examples" / f"{name}.yaml"), ["model_path=/m"])) == want, name


def test_median_baseline_numbers():
    batch = {"rewards": torch.tensor([0.0, 1.0, 10.0, 2.0, 2.0, 5.0]), "group_index": torch.tensor([0, 0, 0, 1, 1, 1]),
             "cu_seqlens": torch.tensor([0, 2, 4, 6, 8, 10, 12]), "loss_mask": torch.tensor([0, 1] * 6)}
    cfg = AlgorithmConfig(adv_estimator="examples.median_baseline:MedianBaseline", adv_options=MedianBaseline.Options(2.0))
    adv = compute_advantages(batch, cfg)["advantages"]
    # medians 1 and 2: 2 * (r - median) = [-2, 0, 18] and [0, 0, 6] on each sequence's generated token
    assert adv.tolist() == [0, -2, 0, 0, 0, 18, 0, 0, 0, 0, 0, 6]
    grpo = compute_advantages(batch, AlgorithmConfig())["advantages"]  # control: the built-in differs
    assert not torch.equal(grpo, adv)


def test_digits_reward_numbers():
    r = DigitsReward(types.SimpleNamespace(options=DigitsReward.Options(floor=0.25, number=0.5)), None)
    got = [asyncio.run(r("p", c, {"answer": "12"})) for c in ("12", " 12 ", "13", "ab", "")]
    assert got == [1.0, 1.0, 0.5, 0.25, 0.25]


def test_arithmetic_source_is_a_function_of_position():
    cfg = types.SimpleNamespace(options=ArithmeticSource.Options(max_operand=20, per_epoch=3), seed=7)
    src = ArithmeticSource(cfg, None)
    drawn = [src.next() for _ in range(4)]
    assert [p for p, _ in drawn] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    for _, s in drawn:
        a, b = map(int, s["prompt"][2:].split("=")[0].split("+"))
        assert s["answer"] == str(a + b) and 0 <= a <= 20 and 0 <= b <= 20
    state = src.state_dict(in_flight=[(0, 2)])
    again = ArithmeticSource(cfg, None)
    again.load_state_dict(state)
    assert again.next() == drawn[2] and again.next()[0] == (1, 1)  # the in-flight prompt first, then onwards
    assert drawn[3][1] == drawn[0][1]  # epoch 1 walks the same generated problems


def test_guess_game_trajectory():
    """Scripted moves "5" then "8" against a secret 8: generated tokens are trained on, the
    environment's answer ("+": higher) is not, and the reward is move_discount ** 1."""
    from tests.test_workflow import CharTok

    tok = CharTok()
    cfg = load_experiment(str(REPO / "examples" / "guess_game.yaml"), ["model_path=/m", "workflow.group_size=1"]).workflow
    wf = GuessTheDigit(cfg, tok, None, None)
    data = next({"id": f"s{i}", "prompt": "Q:"} for i in range(100) if GuessTheDigit.secret({"id": f"s{i}"}) == 8)
    moves = iter("58")

    class Engine:
        async def agenerate(self, req):
            ids = tok.encode(next(moves))
            return GenerationResult(req.input_ids, ids, [-0.5] * len(ids), [3] * len(ids), "length")

    (t,) = asyncio.run(wf.arun_episode(Engine(), data))
    assert tok.decode(t.input_ids) == "Q:5+8" and t.loss_mask == [0, 0, 1, 0, 1]
    assert t.reward == 0.5 and t.versions == [-1, -1, 3, -1, 3]


# ---------------------------------------------------------------- the real trainer, two steps each
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from areal_mega.demo.run import make_task

    root = tmp_path_factory.mktemp("examples")
    make_task(root / "tiny", learner_python=sys.executable, env=child_env())
    return root


def _run_example(tiny: Path, name: str, *extra: str) -> list[dict]:
    out = tiny / name
    files = [f"data.path={tiny / 'tiny/data/train.jsonl'}", f"eval_data.path={tiny / 'tiny/data/test.jsonl'}"]
    run_checked([sys.executable, "-m", "areal_mega.launcher", "local", "--config", f"examples/{name}.yaml",
                 f"model_path={tiny / 'tiny/model'}", f"output_dir={out}", f"launch.run_dir={tiny / name}-launch",
                 f"inference.server.python={SGLANG_PYTHON}", f"trainer.num_steps={STEPS}", "trainer.resume=false",
                 "trainer.eval_every=0", "trainer.eval_at_start=false", "trainer.eval_at_end=false",
                 "trainer.export_hf_at_end=false", f"rollout.batch_size={BATCH}", f"workflow.group_size={GROUP}",
                 *([] if name == "arithmetic_source" else files), *extra], timeout_s=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1)), rows
    return rows


@pytest.mark.slow
@needs_sglang
def test_guess_game_runs_in_the_trainer(tiny):
    rows = _run_example(tiny, "guess_game")
    for r in rows:  # one token per move, up to max_moves = 3 (a single answer of max_new_tokens 4 has no such bound)
        per_traj = r["rollout/num_generated_tokens"] / r["rollout/num_trajectories"]
        assert 1 <= per_traj <= 3 and r["rollout/num_trajectories"] == BATCH * GROUP, r
        assert 0 <= r["rollout/reward_mean"] <= 1


@pytest.mark.slow
@needs_sglang
def test_median_baseline_runs_in_the_trainer(tiny):
    """adv_options.scale = 0 from the command line reaches the estimator: every advantage is 0, so
    the policy loss and its gradient are exactly 0 (GRPO on these rewards: the fast test's control)."""
    rows = _run_example(tiny, "median_baseline", "algorithm.adv_options.scale=0")
    for r in rows:
        assert r["train/grad_norm"] == 0.0 and r["train/pg_loss"] == 0.0, r


@pytest.mark.slow
@needs_sglang
def test_sequence_ratio_loss_runs_from_its_own_script(tiny):
    """The learners run examples/sequence_ratio.py (the composition root with the loss replaced):
    its stats are logged and the built-in PPO loss's are absent (the control). One optimizer step
    per batch, right after the proximal forward of the same weights: each sequence ratio is
    exp(mean of fp32 log-prob differences of two forwards), 1 within the forward's rounding."""
    rows = _run_example(tiny, "sequence_ratio")
    tol = 2 * fp32_tol(128, 10.0, ops=transformer_reductions(2))
    for r in rows:
        assert "train/pg_loss" not in r and "train/clip_frac" not in r, sorted(r)
        assert abs(r["train/seq_ratio/mean"] - 1.0) <= math.expm1(tol) and r["train/seq_ratio/clip_frac"] == 0.0, r


@pytest.mark.slow
@needs_sglang
def test_digits_reward_runs_in_the_trainer(tiny):
    """options.floor = 0.25 from the YAML: every completion scores at least 0.25 (the built-in
    exact-answer reward of the tiny config gives a random model ~0)."""
    rows = _run_example(tiny, "digits_reward")
    for r in rows:
        assert 0.25 <= r["rollout/reward_mean"] <= 1.0, r


@pytest.mark.slow
@needs_sglang
def test_arithmetic_source_runs_in_the_trainer(tiny):
    """The prompts trained are the generator's, index by index (prompts.jsonl: epoch, index, id),
    none from the tiny task's file."""
    _run_example(tiny, "arithmetic_source")
    records = [json.loads(line) for line in (tiny / "arithmetic_source" / "prompts.jsonl").read_text().splitlines()]
    trained = [row for rec in records for row in rec["prompts"]]
    assert len(trained) == STEPS * BATCH
    assert all(pid == f"train/{i}" for e, i, pid in trained), trained
    assert len({(e, i) for e, i, _ in trained}) == len(trained)

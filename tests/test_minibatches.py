"""Several optimizer steps per rollout batch (``algorithm.num_minibatches`` / ``ppo_epochs``).

Pure (< 1 s): ``split_minibatches`` keeps groups whole and in order, balances by sequences,
rebuilds cu_seqlens, and refuses more mini-batches than groups; the config refuses counts < 1.

Slow: ONE 2-rank torchrun launch of tests/dist/minibatch_checks.py (~40 s on 2 busy cores):
at TP1 x DP2 and at TP2, two mini-batches through the trainer's ``train_on_minibatches`` equal
two hand-made sequential ``train_batch`` steps on the two halves exactly (same ops in the same
order: 0.0 difference in every parameter), differ from one full-batch step (negative control),
and the second step sees the policy the first one moved (PPO ratio != 1, the clip acts).
"""

from __future__ import annotations

import pytest
import torch

from areal_mega.algo.config import AlgorithmConfig
from areal_mega.config import ConfigError
from areal_mega.experiment import load_experiment
from areal_mega.rollout.batch import split_minibatches
from tests.support.launch import run_dist_script


def _batch(group_sizes: list[int]) -> dict[str, torch.Tensor]:
    gidx = [g for g, n in enumerate(group_sizes) for _ in range(n)]
    lens = [3 + (i % 4) for i in range(len(gidx))]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    total = int(cu[-1])
    return {"input_ids": torch.arange(total), "advantages": torch.arange(total, dtype=torch.float32) / 10,
            "cu_seqlens": cu, "group_index": torch.tensor(gidx), "rewards": torch.arange(len(gidx), dtype=torch.float32)}


def test_split_keeps_groups_whole_balanced_and_in_order() -> None:
    b = _batch([2, 2, 2, 2])
    pieces = split_minibatches(b, 2)
    assert [p["group_index"].tolist() for p in pieces] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    # concatenated again, every field is the original batch: nothing lost, duplicated or reordered
    for k in ("input_ids", "advantages", "rewards", "group_index"):
        assert torch.equal(torch.cat([p[k] for p in pieces]), b[k]), k
    lens = [n for p in pieces for n in (p["cu_seqlens"][1:] - p["cu_seqlens"][:-1]).tolist()]
    assert lens == (b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist()
    assert all(int(p["cu_seqlens"][0]) == 0 and int(p["cu_seqlens"][-1]) == p["input_ids"].numel() for p in pieces)
    # 4 groups of 2 into 4: one group each; uneven groups: cuts only at group starts
    assert [p["group_index"].tolist() for p in split_minibatches(b, 4)] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    uneven = split_minibatches(_batch([3, 1, 1, 3]), 2)
    assert [p["group_index"].tolist() for p in uneven] == [[0, 0, 0, 1], [2, 3, 3, 3]]
    assert split_minibatches(b, 1)[0] is b


def test_split_refuses_more_minibatches_than_groups_and_bad_config() -> None:
    with pytest.raises(ValueError, match="num_minibatches: 3 mini-batches need at least as many groups, the batch has 2"):
        split_minibatches(_batch([4, 4]), 3)
    with pytest.raises(ValueError, match="num_minibatches"):
        AlgorithmConfig(num_minibatches=0).validate()
    with pytest.raises(ValueError, match="ppo_epochs"):
        AlgorithmConfig(ppo_epochs=0).validate()
    # refused at start-up, not at the first batch: a batch holds rollout.batch_size groups
    with pytest.raises(ConfigError, match="algorithm.num_minibatches: 5 mini-batches of whole groups need "
                                          "rollout.batch_size >= 5"):
        load_experiment("configs/grpo_smollm2.yaml", ["algorithm.num_minibatches=5"])
    assert load_experiment("configs/grpo_smollm2.yaml", ["algorithm.num_minibatches=4"]).algorithm.num_minibatches == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_minibatches_equal_two_hand_made_steps(tmp_path) -> None:
    r = run_dist_script("minibatch_checks.py", 2, tmp_path, timeout_s=540)
    for name, res in r.items():
        # Same ops, same order, same data: bit-identical (measured 0.0). The negative control
        # (one full-batch step, lr 2e-3) moves parameters ~6e-3 away from it.
        assert res["a_vs_b"] == 0.0, (name, res)
        assert res["a_vs_c"] > 1e-3 and res["a_moved"] > 1e-3, (name, res)
        first, second = res["steps"]
        # Step 1: pi_theta == pi_prox, so the ratio is 1 up to fp32 rounding of exp(lp - lp')
        # (log-probs ~ -5, a few ulps of 6e-8 relative: < 1e-5); measured max 1 + 1e-6.
        assert abs(first["ratio/mean"] - 1) < 1e-5 and abs(first["ratio/max"] - 1) < 1e-5, (name, first)
        # Step 2 sees the moved policy: the ratio leaves 1 and the clip (eps 0.2) acts.
        assert second["ratio/max"] > 1.2 and second["clip_frac"] > 0, (name, second)
        assert [first["step"], second["step"]] == [1.0, 2.0]
        assert [first["n_tokens"], second["n_tokens"]] == res["half_tokens"]
        assert res["version_after"] == 0  # optimizer steps never bump the version; the loop does, once per batch
    # the layouts agree on what the second step saw (fp32 across TP1/TP2: measured 2e-7)
    assert abs(r["tp1"]["steps"][1]["ratio/mean"] - r["tp2"]["steps"][1]["ratio/mean"]) < 1e-5

"""The off-policy losses and corrections (issue 41) against their papers' formulas, by hand.

Every expected number below is written out from the formula on tensors of 2-7 tokens; float32
sums of <= 7 terms of O(1) values: tolerance 1e-5 relative (a few ulps per term)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from areal_mega.algo.config import AlgorithmConfig
from areal_mega.algo.losses import (
    CISPOLoss,
    GSPOLoss,
    PPOActorLoss,
    behaviour_weight,
    interpolation_weights,
    m2_keep,
    ppo_policy_loss,
)
from areal_mega.trainer.trainer import Trainer

CU = torch.tensor([0, 3, 7], dtype=torch.int32)  # two sequences: tokens 0-2 and 3-6
MASK = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.float32)  # first token of each: prompt
ADV = torch.tensor([0, 1.0, 1.0, 0, -0.5, -0.5, -0.5])
OLD = torch.tensor([0, -1.0, -2.0, 0, -0.5, -1.5, -1.0])


def close(a, b, rel=1e-5):
    a, b = float(torch.as_tensor(a).detach()), float(torch.as_tensor(b).detach())
    assert a == pytest.approx(b, rel=rel, abs=1e-6), (a, b)


def test_gspo_sequence_ratio_and_gradient_by_hand():
    # seq 1: log-ratios 0.1, 0.3 -> s1 = e^0.2; seq 2: -0.2, 0.1, 0.4 -> s2 = e^0.1
    d = torch.tensor([0, 0.1, 0.3, 0, -0.2, 0.1, 0.4])
    cur = (OLD + d).requires_grad_(True)
    cfg = AlgorithmConfig(policy_loss="gspo", decoupled=False, aggregation="seq_mean_token_mean")
    cfg.loss_options.eps_low, cfg.loss_options.eps_high = 0.3, 0.15  # s1 = 1.221 > 1.15: clipped, A > 0
    mb = {"loss_mask": MASK, "advantages": ADV, "logprobs": OLD, "cu_seqlens": CU}
    loss, st = GSPOLoss(cfg, total_tokens=5, total_seqs=2)(cur, None, mb)
    s1, s2 = math.exp(0.2), math.exp(0.1)
    # seq 1: max(-A s1, -A clip(s1)) = -1.15 (clip active); seq 2: A < 0 -> max(0.5 s2, 0.5 s2) = 0.5 s2
    close(loss, (-1.15 + 0.5 * s2) / 2)
    loss.backward()
    g = cur.grad
    # clipped sequence: no gradient; seq 2: d/dlogp_t of 0.5 * s2 (token form: s2 * dlogp_t) / 3 tokens / 2 seqs
    for t in (1, 2):
        close(g[t], 0.0)
    for t in (4, 5, 6):
        close(g[t], 0.5 * s2 / 3 / 2)
    close(st["clip_frac"], 2 / 5)
    # Negative control: PPO's token ratio on the same tokens is another number.
    cfg_ppo = AlgorithmConfig(decoupled=False, aggregation="seq_mean_token_mean", eps_clip_low=0.3, eps_clip_high=0.15)
    ppo, _ = PPOActorLoss(cfg_ppo, total_tokens=5, total_seqs=2)((OLD + d), None, mb)
    assert abs(float(ppo) - float(loss.detach())) > 1e-2


def test_cispo_keeps_every_gradient_with_clipped_weight():
    d = torch.tensor([0, 0.1, 2.0, 0, -0.2, 0.1, 0.4])  # token 2: r = e^2 = 7.39 > 1 + eps_high = 5
    cur = (OLD + d).requires_grad_(True)
    cfg = AlgorithmConfig(policy_loss="cispo", decoupled=False)
    mb = {"loss_mask": MASK, "advantages": ADV, "logprobs": OLD, "cu_seqlens": CU}
    loss, st = CISPOLoss(cfg, total_tokens=5, total_seqs=2)(cur, None, mb)
    r = torch.tensor([1, math.exp(0.1), 5.0, 1, math.exp(-0.2), math.exp(0.1), math.exp(0.4)])
    expected = sum(-float(r[t]) * float(ADV[t]) * float(d[t]) for t in (1, 2, 4, 5, 6)) / 5
    close(loss, expected)
    loss.backward()
    for t in (1, 2, 4, 5, 6):  # d/dlogp_t = -sg(r^_t) A_t / 5 tokens, the clipped token included
        close(cur.grad[t], -float(r[t]) * float(ADV[t]) / 5)
    close(st["clip_frac"], 1 / 5)
    raw = [math.exp(float(d[t])) for t in (1, 2, 4, 5, 6)]  # the ratio's ESS uses the unclipped ratio
    close(st["ratio/ess"], sum(raw) ** 2 / (5 * sum(x * x for x in raw)))
    assert float(st["ratio/ess"]) < 0.75  # e^2 dominates; on-policy (d = 0) it is 1:
    _, on = CISPOLoss(cfg, total_tokens=5, total_seqs=2)(OLD.clone(), None, mb)
    close(on["ratio/ess"], 1.0)
    # Negative control: PPO zeroes the clipped token's gradient (A > 0, r > 1 + eps).
    cur2 = (OLD + d).requires_grad_(True)
    ppo, _ = PPOActorLoss(AlgorithmConfig(decoupled=False), total_tokens=5, total_seqs=2)(cur2, None, mb)
    ppo.backward()
    assert float(cur2.grad[2]) == 0.0 and float(cur.grad[2]) != 0.0


def test_behaviour_weight_levels_floor_and_stats():
    lw = torch.tensor([0, 0.2, 0.6, 0, -0.3, 0.0, -1.5])  # log(pi_prox / pi_behav)
    behav = OLD
    prox = OLD + lw
    w, dropped, st = behaviour_weight(prox, behav, MASK, CU, level="token")
    raw = [math.exp(float(x)) for x in lw[[1, 2, 4, 5, 6]]]
    close(st["importance_weight/ess"], sum(raw) ** 2 / (5 * sum(x * x for x in raw)))
    close(st["importance_weight/p50"], sorted(raw)[2])
    assert not dropped.any()
    # sequence level: product per sequence; geometric: geometric mean per sequence
    w, _, _ = behaviour_weight(prox, behav, MASK, CU, level="sequence")
    close(w[1], math.exp(0.8)), close(w[2], math.exp(0.8)), close(w[6], math.exp(-1.8))
    assert float(w[0]) == 0.0 and float(w[3]) == 0.0
    w, _, _ = behaviour_weight(prox, behav, MASK, CU, level="geometric")
    close(w[1], math.exp(0.4)), close(w[5], math.exp(-0.6))
    # IcePop: two-sided mask [0.5, 1.5] drops e^0.6 = 1.82 and e^-1.5 = 0.22
    w, dropped, st = behaviour_weight(prox, behav, MASK, CU, cap=1.5, floor=0.5, mode="mask")
    assert dropped.tolist() == [False, False, True, False, False, False, True]
    assert float(w[2]) == 0.0 and float(w[6]) == 0.0
    close(w[1], math.exp(0.2))
    close(st["importance_weight/capped_frac"], 2 / 5)
    # Negative control: a cap alone keeps the low token.
    _, dropped, _ = behaviour_weight(prox, behav, MASK, CU, cap=1.5, mode="mask")
    assert not bool(dropped[6])
    # Sequence-level mask drops the whole sequence whose product exceeds the cap.
    _, dropped, _ = behaviour_weight(prox, behav, MASK, CU, level="sequence", cap=2.0, mode="mask")
    assert dropped.tolist() == [False, True, True, False, False, False, False]


def test_m2po_drops_largest_second_moment_first():
    lw = torch.tensor([0.1, -0.5, 0.2, 0.05, 1.0])
    mask = torch.ones(5, dtype=torch.bool)
    # squares: .01 .25 .04 .0025 1.0; means of the rest after dropping the largest k:
    # k=0: 1.3025/5 = .26; k=1: .3025/4 = .0756; k=2: .0525/3 = .0175 <= 0.04 -> drop 1.0 and 0.25
    assert m2_keep(lw, mask, 0.04).tolist() == [True, False, True, True, False]
    assert m2_keep(lw, mask, 0.08).tolist() == [True, True, True, True, False]
    assert m2_keep(lw, mask, 10.0).all()  # control: a loose threshold drops nothing


def test_interpolated_proximal_a3po():
    versions = torch.tensor([-1, 5, 4, 2])
    assert interpolation_weights(versions, 5).tolist() == pytest.approx([0.0, 0.0, 0.5, 0.75])
    cfg = AlgorithmConfig(proximal="interpolate", behav_imp_weight_cap=None)
    mask = torch.tensor([0, 1, 1, 1.0])
    behav = torch.tensor([0, -1.0, -1.0, -1.0])
    cur = torch.tensor([0, -0.8, -0.6, -0.2])
    mb = {"loss_mask": mask, "advantages": torch.tensor([0, 1.0, 1.0, 1.0]), "logprobs": behav,
          "prox_alpha": interpolation_weights(versions, 5), "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32)}
    loss, st = PPOActorLoss(cfg, total_tokens=3, total_seqs=1)(cur, None, mb)
    prox = behav + mb["prox_alpha"] * (cur - behav)  # -1, -0.8, -0.4 on the masked tokens
    expected, _ = ppo_policy_loss(cur, mb["advantages"], mask, behav_logprobs=behav, prox_logprobs=prox,
                                  total_tokens=3)
    close(loss, expected)
    close(st["behav_kl"], (0.0 + 0.2 + 0.6) / 3)
    # Negative control: without interpolation (pi_prox = pi_behav) the loss differs.
    plain, _ = ppo_policy_loss(cur, mb["advantages"], mask, behav_logprobs=behav, prox_logprobs=behav,
                               total_tokens=3)
    assert abs(float(plain) - float(loss)) > 1e-3


def test_interpolate_skips_the_proximal_forward():
    calls = []
    actor = SimpleNamespace(get_version=lambda: 5, proximal_logprobs=lambda b, t: calls.append(1) or {})
    for mode, forwards in (("interpolate", 0), ("forward", 1)):
        calls.clear()
        t = SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig(proximal=mode)), actor=actor, temperature=1.0)
        batch = {"versions": torch.tensor([-1, 5, 3])}
        Trainer.proximal(t, batch)
        assert len(calls) == forwards
        assert ("prox_alpha" in batch) == (mode == "interpolate")


@pytest.mark.parametrize("kw, key", [
    (dict(behav_imp_weight_floor=0.5, behav_imp_weight_mode="truncate"), "behav_imp_weight_floor"),
    (dict(behav_imp_weight_floor=1.5), "behav_imp_weight_floor"),
    (dict(m2_threshold=0.0), "m2_threshold"),
    (dict(proximal="interpolate", decoupled=False), "proximal"),
])
def test_bad_settings_are_one_line(kw, key):
    with pytest.raises(ValueError, match=key):
        AlgorithmConfig(**kw).validate()


class _Engine:
    """A one-tensor 'model' whose weights are its version (+ 1/3, which bf16 cannot hold): what the
    servers get is visible, and so is a rounding of the learner's own weights."""

    def __init__(self):
        self.w = torch.zeros(1)

    def snapshot_weights(self, dtype=None):
        return [self.w.to(dtype or self.w.dtype, copy=True)]

    def restore_weights(self, weights):
        self.w.copy_(weights[0])


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_study_delay_serves_the_weights_of_delay_versions_ago(delay):
    from areal_mega.trainer.config import TrainerLoopConfig

    eng, pushed = _Engine(), []
    cfg = SimpleNamespace(trainer=TrainerLoopConfig(study_delay=delay, study_opt_in=True),
                          inference=SimpleNamespace(server=SimpleNamespace(dtype="bfloat16")))
    t = SimpleNamespace(cfg=cfg, actor=eng, _served=__import__("collections").deque())
    weights = lambda v: torch.tensor([v + 1 / 3], dtype=torch.float32)  # noqa: E731
    eng.w.copy_(weights(0))
    t._served_dtype = lambda: Trainer._served_dtype(t)
    Trainer.__post_init__(t)
    # the wire casts to the servers' bf16: what a server holds
    t._push_weights = lambda version: pushed.append((version, float(eng.w.to(torch.bfloat16)[0])))
    bf16 = lambda v: float(weights(v).to(torch.bfloat16)[0])  # noqa: E731
    assert all(bf16(v) != float(weights(v)[0]) for v in range(8))  # the control below can fail
    for v in range(1, 8):
        eng.w.copy_(weights(v))  # the update that made version v
        Trainer.sync_weights(t, v)
        # the learner keeps training its own weights, at full precision (not the bf16 history's)
        assert torch.equal(eng.w, weights(v))
    served = max(0, 7 - delay)
    assert pushed[-1] == (served, bf16(served))  # served version v - d, with version v - d's weights
    assert pushed == [(max(0, v - delay), bf16(max(0, v - delay))) for v in range(1, 8)]
    assert all(w[0].dtype == torch.bfloat16 for _, w in t._served)  # the history at half of fp32's bytes
    assert len(t._served) <= delay + 1 or delay == 0
    with pytest.raises(RuntimeError, match="study_delay"):  # a gap (a resume): refused when delayed
        if delay:
            Trainer.sync_weights(t, 10)
        else:
            raise RuntimeError("study_delay: nothing kept without a delay")


def test_study_delay_needs_the_opt_in_and_a_matching_bound():
    from areal_mega.config import from_dict
    from areal_mega.experiment import ExperimentConfig
    from areal_mega.trainer.config import TrainerLoopConfig

    with pytest.raises(ValueError, match="study_opt_in"):
        TrainerLoopConfig(study_delay=2).validate()
    with pytest.raises(ValueError, match="max_staleness"):
        from_dict(ExperimentConfig, {"model_path": "m", "trainer": {"study_delay": 2, "study_opt_in": True},
                                     "rollout": {"max_staleness": 1}}).validate()

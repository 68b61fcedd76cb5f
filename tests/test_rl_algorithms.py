"""Advantage estimators and policy/value losses against hand-computed numbers (< 2 s)."""

import math

import numpy as np
import pytest
import torch

from areal_mega.config import ConfigError, from_dict
from areal_mega.algo.advantages import (
    compute_advantages,
    gae_advantages,
    group_index_of,
    grpo_advantages,
    last_action_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.algo.losses import (
    PPOActorLoss,
    aggregate,
    global_counts,
    kl_estimate,
    ppo_policy_loss,
    value_loss,
)

T = torch.tensor


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (a, b)


# --- advantages ---------------------------------------------------------------------------

# Groups: A = [1, 0, 0, 1], B = [2, 2], C = [3, 0, 0], D = [5] (singleton); interleaved on purpose.
REWARDS = T([1.0, 0.0, 2.0, 0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 5.0])
GROUPS = ["a", "a", "b", "a", "c", "a", "b", "c", "c", "d"]


def test_group_index():
    assert group_index_of(GROUPS).tolist() == [0, 0, 1, 0, 2, 0, 1, 2, 2, 3]


def test_grpo_hand_computed():
    gi = group_index_of(GROUPS)
    adv = grpo_advantages(REWARDS, gi, eps=1e-6)
    # A: mean .5 std .5 -> +-1; B: std 0 -> 0; C: mean 1, centred [2,-1,-1], std sqrt(2); D: 0.
    s2 = math.sqrt(2.0)
    close(adv, [1, -1, 0, -1, 2 / s2, 1, 0, -1 / s2, -1 / s2, 0])
    dr = grpo_advantages(REWARDS, gi, std_normalize=False)
    close(dr, [0.5, -0.5, 0, -0.5, 2, 0.5, 0, -1, -1, 0])


def test_rloo_hand_computed():
    adv = rloo_advantages(REWARDS, group_index_of(GROUPS))
    # A: r_0=1 minus mean(0,0,1)=1/3 -> 2/3; C: 3 - mean(0,0) = 3, 0 - mean(3,0) = -1.5; D: 0.
    close(adv, [2 / 3, -2 / 3, 0, -2 / 3, 3, 2 / 3, 0, -1.5, -1.5, 0])


CU = T([0, 5, 10])
MASK = T([0, 0, 1, 1, 1, 0, 1, 0, 1, 0])  # seq 2 is multi-turn: a hole at position 7
VALUES = T([0.0, 0.0, 0.5, 0.6, 0.7, 0.0, 0.2, 9.0, 0.4, 9.0])


def test_last_action_rewards():
    close(last_action_rewards(T([1.0, -1.0]), MASK, CU), [0, 0, 0, 0, 1, 0, 0, 0, -1, 0])


def test_gae_hand_computed():
    r = last_action_rewards(T([1.0, -1.0]), MASK, CU)
    adv, ret = gae_advantages(r, VALUES, MASK, CU, gamma=0.9, lam=0.8)
    # seq 1: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03 -> .03 + .72*.3 = .246;
    #        d0 = .9*.6 - .5 = .04 -> .04 + .72*.246 = .21712
    # seq 2 (actions at 6 and 8; 7 is an env token, not a step): d1 = -1 - .4 = -1.4;
    #        d0 = .9*.4 - .2 = .16 -> .16 + .72*(-1.4) = -.848
    close(adv, [0, 0, 0.21712, 0.246, 0.3, 0, -0.848, 0, -1.4, 0])
    close(ret, [0, 0, 0.71712, 0.846, 1.0, 0, -0.648, 0, -1.0, 0])


def test_gae_matches_naive_loop_on_random_packed_batch():
    g = torch.Generator().manual_seed(3)
    lens = [7, 1, 12, 5]
    cu = torch.tensor([0, 7, 8, 20, 25])
    mask = (torch.rand(25, generator=g) > 0.3).long()
    rew, val = torch.randn(25, generator=g), torch.randn(25, generator=g)
    adv, ret = gae_advantages(rew, val, mask, cu, gamma=0.95, lam=0.7)
    want = torch.zeros(25)
    for s in range(len(lens)):  # textbook recursion over each sequence's action positions
        pos = [i for i in range(int(cu[s]), int(cu[s + 1])) if mask[i]]
        carry = 0.0
        for k in reversed(range(len(pos))):
            nv = float(val[pos[k + 1]]) if k + 1 < len(pos) else 0.0
            carry = float(rew[pos[k]]) + 0.95 * nv - float(val[pos[k]]) + 0.95 * 0.7 * carry
            want[pos[k]] = carry
    close(adv, want)
    close(ret, (want + val) * mask)


def test_reinforce_pp_hand_computed():
    r = last_action_rewards(T([1.0, -1.0]), MASK, CU)
    adv, ret = reinforce_pp_advantages(r, MASK, CU, gamma=1.0, eps=0.0)
    close(ret, [0, 0, 1, 1, 1, 0, -1, 0, -1, 0])
    # masked returns [1,1,1,-1,-1]: mean .2, std sqrt(.96)
    s = math.sqrt(0.96)
    close(adv, [0, 0, 0.8 / s, 0.8 / s, 0.8 / s, 0, -1.2 / s, 0, -1.2 / s, 0])
    # KL in the reward: kl_coef .1, kl = [.5, 0, 1] on seq 1's actions, gamma 1
    cfg = AlgorithmConfig(adv_estimator="reinforce_pp", kl_coef=0.1, kl_in_reward=True, adv_eps=0.0)
    kl = T([0, 0, 0.5, 0.0, 1.0, 0, 0, 0, 0, 0])
    out = compute_advantages({"rewards": T([1.0, -1.0]), "cu_seqlens": CU, "loss_mask": MASK, "kl": kl}, cfg)
    close(out["returns"], [0, 0, 0.85, 0.9, 0.9, 0, -1, 0, -1, 0])


def test_compute_advantages_dispatch():
    cu = T([0, 2, 4, 6, 8])
    mask = T([0, 1] * 4)
    batch = {"rewards": T([1.0, 0.0, 1.0, 1.0]), "cu_seqlens": cu, "loss_mask": mask, "group_index": T([0, 0, 1, 1])}
    out = compute_advantages(batch, AlgorithmConfig(adv_estimator="grpo"))
    close(out["advantages"], [0, 1, 0, -1, 0, 0, 0, 0])
    out = compute_advantages(batch, AlgorithmConfig(adv_estimator="dr_grpo"))
    close(out["advantages"], [0, 0.5, 0, -0.5, 0, 0, 0, 0])
    out = compute_advantages(batch, AlgorithmConfig(adv_estimator="rloo"))
    close(out["advantages"], [0, 1, 0, -1, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="values"):
        compute_advantages(batch, AlgorithmConfig(adv_estimator="gae"))
    # reward shaping: clip(scale * (r + bias))
    out = compute_advantages(batch, AlgorithmConfig(adv_estimator="dr_grpo", reward_bias=1.0, reward_scale=2.0))
    close(out["advantages"], [0, 1, 0, -1, 0, 0, 0, 0])


def test_algorithm_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="eps_clip_low"):
        from_dict(AlgorithmConfig, {"eps_clip_low": 1.5})
    with pytest.raises(ConfigError, match="dual_clip"):
        from_dict(AlgorithmConfig, {"dual_clip": 0.5})
    with pytest.raises(ConfigError, match="adv_estimator"):
        from_dict(AlgorithmConfig, {"adv_estimator": "ppo"})


# --- losses -------------------------------------------------------------------------------

RATIO = [1.5, 0.5, 0.5, 4.0, 1.0]
ADV = T([1.0, 1.0, -1.0, -1.0, 7.0])
LMASK = T([1, 1, 1, 1, 0])
OLD = T([-1.0, -1.0, -1.0, -2.0, -1.0])


def _cur():
    return (OLD + torch.log(T(RATIO))).requires_grad_(True)


def test_ppo_clip_higher_and_dual_clip():
    cur = _cur()
    loss, st = ppo_policy_loss(cur, ADV, LMASK, behav_logprobs=OLD, eps_clip_low=0.2, eps_clip_high=0.28)
    # t0: max(-1.5, -1.28) = -1.28 (clipped); t1: max(-.5, -.8) = -.5; t2: max(.5, .8) = .8 (clipped);
    # t3: max(4, 1.28) = 4; t4 masked.
    close(loss, (-1.28 - 0.5 + 0.8 + 4) / 4)
    close(st["clip_frac"], 0.5)
    close(st["approx_kl"], -sum(math.log(r) for r in RATIO[:4]) / 4)
    loss.backward()
    # only unclipped tokens carry gradient: d/dlogp (-A r) / 4 = -A r / 4
    close(cur.grad, [0, -0.5 / 4, 0, 1.0, 0])
    cur = _cur()
    loss, st = ppo_policy_loss(cur, ADV, LMASK, behav_logprobs=OLD, eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=3.0)
    close(loss, (-1.28 - 0.5 + 0.8 + 3.0) / 4)
    close(st["dual_clip_frac"], 0.25)
    loss.backward()
    close(cur.grad, [0, -0.125, 0, 0, 0])


def test_decoupled_weights_mask_and_truncate():
    w = T([1.0, 2.0, 0.5, 1.0, 1.0])
    behav = OLD - torch.log(w)  # pi_prox / pi_behav = w
    common = dict(behav_logprobs=behav, prox_logprobs=OLD, eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=1.5)
    loss, st = ppo_policy_loss(_cur(), ADV, LMASK, behav_imp_weight_mode="mask", **common)
    close(loss, (-1.28 * 1 + 0 + 0.8 * 0.5 + 4 * 1) / 4)  # token 1 (w = 2 > 1.5) dropped
    close(st["importance_weight/capped_frac"], 0.25)
    close(st["importance_weight/max"], 1.0)
    close(st["importance_weight/min"], 0.5)
    close(st["behav_kl"], math.log(2 * 0.5) / 4)
    loss, st = ppo_policy_loss(_cur(), ADV, LMASK, behav_imp_weight_mode="truncate", **common)
    close(loss, (-1.28 - 0.5 * 1.5 + 0.8 * 0.5 + 4) / 4)
    close(st["importance_weight/max"], 1.5)


def test_decoupled_reduces_to_ppo_when_behaviour_equals_proximal():
    g = torch.Generator().manual_seed(0)
    n = 64
    old = -torch.rand(n, generator=g) * 3
    cur0 = old + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).long()
    cu = T([0, 20, 41, 64])
    out = []
    for decoupled in (False, True):
        cur = cur0.clone().requires_grad_(True)
        kw = dict(prox_logprobs=old, behav_imp_weight_cap=2.0) if decoupled else {}
        loss, _ = ppo_policy_loss(
            cur, adv, mask, behav_logprobs=old.clone(), cu_seqlens=cu, aggregation="seq_mean_token_mean",
            eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=3.0, **kw,
        )
        loss.backward()
        out.append((loss.detach(), cur.grad.clone()))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


def test_aggregation_modes_and_microbatch_split():
    cu = T([0, 3, 7])
    mask = T([0, 1, 1, 0, 1, 1, 1])
    v = T([9.0, 1, 2, 9, 3, 4, 5])
    close(aggregate(v, mask, cu, "token_mean"), 3.0)
    close(aggregate(v, mask, cu, "seq_mean_token_sum"), 7.5)
    close(aggregate(v, mask, cu, "seq_mean_token_mean"), 2.75)
    close(aggregate(v, mask, cu, "seq_mean_token_sum_norm", norm_const=10.0), 0.75)
    n_tok, n_seq = global_counts(mask, cu)
    assert (n_tok, n_seq) == (5, 2)
    # two micro-batches (one sequence each) with the global counts sum to the global value
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        parts = [
            aggregate(v[:3], mask[:3], T([0, 3]), mode, total_tokens=n_tok, total_seqs=n_seq, norm_const=10.0),
            aggregate(v[3:], mask[3:], T([0, 4]), mode, total_tokens=n_tok, total_seqs=n_seq, norm_const=10.0),
        ]
        close(sum(parts), aggregate(v, mask, cu, mode, norm_const=10.0))


def test_kl_estimators():
    lp, ref = T([0.0]), T([-0.5])
    close(kl_estimate(lp, ref, "k1"), [0.5])
    close(kl_estimate(lp, ref, "k2"), [0.125])
    close(kl_estimate(lp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5])


def test_value_loss_clipping():
    loss, st = value_loss(T([1.0, 0.0]), T([0.5, 0.5]), T([2.0, 0.0]), T([1, 1]), eps_clip=0.2)
    # t0: max((1-2)^2, (0.7-2)^2) = 1.69; t1: max(0, 0.3^2) = .09; 0.5 * mean
    close(loss, 0.5 * (1.69 + 0.09) / 2)
    close(st["value_clip_frac"], 1.0)


def test_actor_loss_fn_reads_micro_batch():
    cfg = AlgorithmConfig(eps_clip_high=0.28, decoupled=True, behav_imp_weight_cap=1.5, kl_coef=0.1, kl_estimator="k1")
    w = T([1.0, 2.0, 0.5, 1.0, 1.0])
    mb = {"loss_mask": LMASK, "advantages": ADV, "logprobs": OLD - torch.log(w), "prox_logprobs": OLD,
          "ref_logprobs": OLD, "cu_seqlens": T([0, 5])}
    fn = PPOActorLoss(cfg, total_tokens=8, total_seqs=1)
    cur = _cur()
    loss, st = fn(cur, torch.ones(5), mb)
    kl = sum(math.log(r) for r, m in zip(RATIO, LMASK.tolist()) if m)  # k1, summed
    close(loss, ((-1.28 + 0.4 + 4) + 0.1 * kl) / 8)
    close(st["entropy"], 1.0)
    with pytest.raises(ValueError, match="prox_logprobs"):
        fn(cur, None, {k: v for k, v in mb.items() if k != "prox_logprobs"})


# --- numerically constant groups ----------------------------------------------------------

NON_DYADIC = (0.7, 1 / 3, 70.3, 7.3)
GROUP_SIZES = (1, 2, 7, 8, 16)


def _constant_groups_batch(value: float) -> dict[str, torch.Tensor]:
    """One group per size in GROUP_SIZES, every reward == value, members interleaved across
    groups; each sequence is [prompt token, 2 generated tokens]."""
    gi = torch.tensor([g for k in range(max(GROUP_SIZES)) for g, n in enumerate(GROUP_SIZES) if k < n])
    b = gi.numel()
    return {
        "rewards": torch.full((b,), value),
        "group_index": gi,
        "cu_seqlens": torch.arange(b + 1) * 3,
        "loss_mask": torch.tensor([0, 1, 1] * b),
    }


@pytest.mark.parametrize("value", NON_DYADIC)
def test_equal_rewards_give_exactly_zero_advantage(value):
    # Before the fix (float32 group statistics) a group of 7 rewards 0.7 got +0.056 each, 7.3 got
    # 0.32 (16 of them: 0.49) and 70.3 got 0.88, for GRPO; Dr.GRPO / RLOO got round-off ~1e-7..1e-5.
    batch = _constant_groups_batch(value)
    shapes = [dict(), dict(reward_scale=0.3, reward_bias=0.1), dict(reward_scale=3.7, reward_bias=-0.45)]
    for shape in shapes:
        for est in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            for eps in (1e-6, 0.0):
                cfg = AlgorithmConfig(adv_estimator=est, adv_eps=eps, **shape)
                adv = compute_advantages(batch, cfg)["advantages"]
                assert torch.equal(adv, torch.zeros_like(adv)), (value, shape, est, eps, adv.abs().max())
    gi = batch["group_index"]
    for n in GROUP_SIZES:  # also each size on its own, through the per-sequence functions
        r = torch.full((n,), value)
        g = torch.zeros(n, dtype=torch.long)
        for adv in (grpo_advantages(r, g), grpo_advantages(r, g, std_normalize=False), rloo_advantages(r, g)):
            assert torch.equal(adv, torch.zeros(n)), (value, n, adv)
    assert gi.bincount().tolist() == list(GROUP_SIZES)


def test_near_equal_groups():
    one_ulp = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    gi = T([0, 0, 1, 1])
    # Group 0: 1 float32 ulp apart -- float32 round-off, below 4 * eps_f32 * max|r|: zero.
    # Group 1: 2**-18 apart (64 ulps): a real difference. With eps 0 its centred values
    # (+-2**-19) and population std (2**-19) are exact in float64, so the advantages are +-1 exactly.
    r = T([1.0, one_ulp, 1.0, 1.0 + 2**-18])
    assert grpo_advantages(r, gi, eps=0.0).tolist() == [0.0, 0.0, -1.0, 1.0]
    assert grpo_advantages(r, gi, std_normalize=False).tolist() == [0.0, 0.0, -(2**-19), 2**-19]
    assert rloo_advantages(r, gi).tolist() == [0.0, 0.0, -(2**-18), 2**-18]


def _group_reference(rewards: torch.Tensor, gi: torch.Tensor, eps: float):
    """Textbook float64 numpy per-group formulas (population std), RLOO by its leave-one-out
    definition; also the per-member error allowance (see the test)."""
    r = rewards.double().numpy()
    g = gi.numpy()
    grpo, dr, rloo, scale = (np.zeros_like(r) for _ in range(4))
    for k in np.unique(g):
        idx = np.nonzero(g == k)[0]
        x = r[idx]
        n = len(x)
        mean, std = x.mean(), x.std()  # numpy's std is the population std (ddof=0)
        grpo[idx] = (x - mean) / (std + eps) if n > 1 else 0.0
        dr[idx] = x - mean if n > 1 else 0.0
        rloo[idx] = [x[i] - np.delete(x, i).mean() for i in range(n)] if n > 1 else 0.0
        scale[idx] = np.abs(x).max() / (std + eps)  # GRPO's sensitivity to an error in the mean
    return grpo, dr, rloo, scale


def test_unequal_groups_match_float64_reference():
    g = torch.Generator().manual_seed(11)
    sizes = (1, 2, 7, 8, 16, 7, 16)
    offsets = (0.0, 1 / 3, 70.3, 7.3, 0.7, 70.3, 0.0)  # non-dyadic rewards on top of the spread
    gi = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    spread = torch.randint(0, 10, (gi.numel(),), generator=g).float() * 0.1
    rewards = (spread + torch.tensor(offsets)[gi]).float()
    perm = torch.randperm(gi.numel(), generator=g)  # members interleaved across groups
    rewards, gi = rewards[perm], gi[perm]
    eps = 1e-6
    ref_grpo, ref_dr, ref_rloo, scale = _group_reference(rewards, gi, eps)
    got = [grpo_advantages(rewards, gi, eps=eps), grpo_advantages(rewards, gi, std_normalize=False),
           rloo_advantages(rewards, gi)]
    absmax = np.array([float(rewards[gi == k].abs().max()) for k in gi.tolist()])
    # Allowance per member: the float64 result is rounded once to float32 (<= 2**-24 relative),
    # plus float64 round-off of both computations: means of <= 16 terms and the centring are
    # off by <= ~20 float64 ulps of max|r| each; 64 * 2**-53 * max|r| covers both sides, times
    # 1 / (std + eps) for GRPO and n / (n - 1) <= 2 for RLOO.
    f64 = 64 * 2.0**-53
    for name, a, ref, sens in (("grpo", got[0], ref_grpo, scale), ("dr_grpo", got[1], ref_dr, absmax),
                               ("rloo", got[2], ref_rloo, 2 * absmax)):
        assert a.dtype == torch.float32
        err = np.abs(a.double().numpy() - ref)
        tol = 2.0**-24 * np.abs(ref) + f64 * sens
        assert (err <= tol).all(), (name, err.max(), (err / np.maximum(tol, 1e-300)).max())
        assert (a[gi == 0] == 0).all()  # the group of one
    # GRPO's population std vs the sample std verl / TRL use: the advantages differ by
    # sqrt(n / (n - 1)) exactly (eps = 0, one group of 8).
    r8 = rewards[gi == 3]
    a8 = grpo_advantages(r8, torch.zeros(8, dtype=torch.long), eps=0.0).double()
    sample = (r8.double() - r8.double().mean()) / r8.double().std(unbiased=True)
    # float32 output rounding (2**-24 relative) dominates; the float64 parts are ~1e-15.
    assert torch.allclose(a8, sample * math.sqrt(8 / 7), rtol=2.0**-23, atol=0.0)


# --- extreme log-prob gaps ----------------------------------------------------------------


def test_kl_estimators_clamped():
    # Beyond the clamps: d = logp - logp_ref = +inf, +1000, -1000 -> exactly +-10, no gradient.
    lp = torch.zeros(3, requires_grad=True)
    ref = T([float("-inf"), -1000.0, 1000.0])
    want = {"k1": [10.0, 10.0, -10.0], "k2": [10.0] * 3, "k3": [10.0] * 3}
    for est, w in want.items():
        kl = kl_estimate(lp, ref, est)
        assert kl.tolist() == w, (est, kl)
        (g,) = torch.autograd.grad(kl.sum(), lp)
        assert g.tolist() == [0.0] * 3, (est, g)
    # Inside (|d| <= 2: k3 <= e^2 - 3 = 4.4, k2 <= 2, k1 <= 2, all below 10) the clamps are the
    # identity with unit gradient, so value and gradient equal the textbook formulas bit for bit.
    d0 = torch.linspace(-2.0, 2.0, 41)
    textbook = {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d, "k3": lambda d: torch.expm1(-d) + d}
    for est, f in textbook.items():
        lp = d0.clone().requires_grad_(True)
        kl = kl_estimate(lp, torch.zeros(41), est)
        (g,) = torch.autograd.grad(kl.sum(), lp)
        lp2 = d0.clone().requires_grad_(True)
        (g2,) = torch.autograd.grad(f(lp2 - 0.0).sum(), lp2)
        assert torch.equal(kl, f(d0 - 0.0)) and torch.equal(g, g2), est


NEG_INF = float("-inf")
NAN = float("nan")
# Tokens: 0, 1 normal; 2 log(pi_theta / pi_prox) = +1000 (A > 0), 3 = -1000, 4 = +1000 with A < 0;
# 5 behaviour log-prob -inf (standard PPO: pi_old = pi_behav, so lr = +inf; decoupled: weight
# pi_prox / pi_behav = inf); 6 ref log-prob -inf; 7 ref 1000 nats above pi_theta; 8 masked out,
# holding -inf / NaN garbage in every input but the differentiated one.
X_CUR = T([-1.0, -2.0, -1.0, -1001.0, -1.0, -1.5, -0.5, -3.0, -1.0])
X_OLD = T([-1.2, -1.7, -1001.0, -1.0, -1001.0, -1.4, -0.6, -3.1, NEG_INF])  # pi_prox (or pi_old)
X_BEHAV = T([-1.1, -1.9, -1001.0, -1.0, -1001.0, NEG_INF, -0.6, -3.1, NAN])
X_REF = T([-1.0, -2.2, -1.0, -1001.0, -1.0, -1.5, NEG_INF, 997.0, NAN])
X_ADV = T([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, NAN])
X_MASK = T([1, 1, 1, 1, 1, 1, 1, 1, 0])
X_NORMAL = [0, 1]  # tokens whose every log-ratio is inside the clamps


def _extreme_loss(cur, adv, mask, *, decoupled, mode=None, cap=None, dual=None, kl=None, entropy=False):
    kw = dict(
        behav_logprobs=X_BEHAV,
        prox_logprobs=X_OLD if decoupled else None,
        behav_imp_weight_cap=cap,
        behav_imp_weight_mode=mode or "mask",
        dual_clip=dual,
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        total_tokens=8,
    )
    if kl is not None:
        kw.update(ref_logprobs=X_REF, kl_coef=0.1, kl_estimator=kl)
    if entropy:
        kw.update(entropy=torch.ones_like(cur), entropy_coef=0.01)
    return ppo_policy_loss(cur, adv, mask, **kw)


EXTREME_CASES = [
    dict(decoupled=False),
    dict(decoupled=False, dual=3.0),
    dict(decoupled=True, mode="mask", cap=5.0),
    dict(decoupled=True, mode="truncate", cap=5.0),
    dict(decoupled=True, cap=None),
    dict(decoupled=True, mode="mask", cap=5.0, dual=3.0, entropy=True),
    dict(decoupled=False, kl="k1"),
    dict(decoupled=False, kl="k2"),
    dict(decoupled=True, mode="truncate", cap=5.0, kl="k3", entropy=True),
]


@pytest.mark.parametrize("case", EXTREME_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_extreme_log_ratios_give_finite_loss_and_gradients(case):
    cur = X_CUR.clone().requires_grad_(True)
    loss, st = _extreme_loss(cur, X_ADV, X_MASK, **case)
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(cur.grad).all(), cur.grad
    assert all(torch.isfinite(v).all() for v in st.values()), st
    clamped = [2, 3, 4] if case["decoupled"] else [2, 3, 4, 5]  # |policy log-ratio| > 20
    assert float(st["ratio/clamped_frac"]) == len(clamped) / 8
    assert float(st["ratio/max"]) == float(torch.tensor(20.0).exp())
    # A token whose policy log-ratio is beyond the clamp gets no gradient through it; without
    # KL / entropy terms that is all of its gradient.
    if case.get("kl") is None and not case.get("entropy"):
        assert cur.grad[clamped].tolist() == [0.0] * len(clamped)
    assert cur.grad[8] == 0  # masked-out garbage never reaches the gradient
    # The normal tokens' gradients are those of a loss over them alone: each token's gradient
    # depends only on that token (the normaliser is the fixed total_tokens), so equality is exact.
    only = torch.zeros_like(X_MASK)
    only[X_NORMAL] = 1
    cur2 = X_CUR.clone().requires_grad_(True)
    _extreme_loss(cur2, X_ADV, only, **case)[0].backward()
    assert torch.equal(cur.grad[X_NORMAL], cur2.grad[X_NORMAL])

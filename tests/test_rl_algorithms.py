"""Advantage estimators and policy/value losses against hand-computed numbers (< 2 s)."""

import math

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

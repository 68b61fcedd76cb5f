"""PPO critic (value head on the megatron trunk) and the frozen KL reference model.

Single-process checks (< 5 s): config keys, value-head init, what ``Trainer.ref_and_values`` puts
into the batch (with stand-in engines). Then ONE 2-rank torchrun launch of
tests/dist/critic_checks.py (~45-60 s on 2 busy cores) whose numbers are asserted here:
critic values identical across TP1 / TP2 / PP2 (tied embeddings untied by the critic), one
critic step lowers the value loss by the same amount in every layout, save at TP2 -> load at
PP2; the reference engine equals the actor at init and stays fixed while the actor moves.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from areal_mega.algo.losses import kl_estimate
from areal_mega.config import ConfigError
from areal_mega.experiment import load_experiment
from areal_mega.trainer.critic import CriticConfig, ValueHead
from tests.support.launch import run_dist_script
from tests.support.models import count_params
from tests.support.numerics import adam_step_rel, fp32_tol, printed_tol, transformer_reductions

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- single process
def test_critic_config_keys_and_errors(tmp_path):
    cfg = load_experiment(str(REPO / "configs" / "grpo_tiny.yaml"),
                          ["algorithm.adv_estimator=gae", "critic.optimizer.lr=2e-5", "critic.max_tokens_per_microbatch=512"])
    assert cfg.critic.optimizer.lr == 2e-5 and cfg.critic.max_tokens_per_microbatch == 512
    assert CriticConfig().optimizer.lr == 1e-5 and not CriticConfig().compute_entropy  # critic defaults
    with pytest.raises(ValueError, match="value_head_init_std"):
        CriticConfig(value_head_init_std=-1.0).validate()
    with pytest.raises(ConfigError, match="critic.value_head_init_std"):
        from areal_mega.config import validate_tree

        validate_tree(load_experiment(None, ["model_path=x", "critic.value_head_init_std=-0.5"]))


def test_value_head_is_seeded_and_scalar():
    a = ValueHead(8, init_std=0.1, seed=3, device=torch.device("cpu"), dtype=torch.float32)
    b = ValueHead(8, init_std=0.1, seed=3, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(a.weight, b.weight) and float(a.bias.detach()) == 0.0
    assert not torch.equal(a.weight, ValueHead(8, init_std=0.1, seed=4, device=torch.device("cpu"), dtype=torch.float32).weight)
    h = torch.randn(5, 1, 8, dtype=torch.bfloat16)  # [s, b, h] as GPTModel passes it
    v, bias = a(h, weight=torch.zeros(3, 8), runtime_gather_output=None)  # LM-head weight is ignored
    assert bias is None and v.shape == (5, 1, 1) and v.dtype == torch.float32
    # an fp32 8-term dot product two ways: fp32 rounding of 8 terms of size |h| |w|
    ref, terms = h.float()[:, 0] @ a.weight[0], h.float()[:, 0].abs() @ a.weight[0].abs()
    assert torch.allclose(v[:, 0, 0], ref, rtol=0, atol=fp32_tol(8, float(terms.max())))


class _FakeEngine:
    def __init__(self, out: torch.Tensor):
        self.out = out

    def forward_logprobs(self, batch, temperature):
        return self.out

    def compute_values(self, batch):
        return self.out


def _setup_with(tmp_path, overrides, ref=None, critic=None):
    from areal_mega.trainer.trainer import Trainer
    from areal_mega.utils.metrics import Metrics

    cfg = load_experiment(str(REPO / "configs" / "grpo_tiny.yaml"), overrides)
    return Trainer(cfg=cfg, groups=None, actor=None, weight_sync=None, advantage=None, policy_loss=None,
                   metrics=Metrics(None, enabled=False),
                 ctrl_group=None, start_step=0, ref=ref, critic=critic)


def test_ref_and_values_fill_the_batch(tmp_path):
    batch = {"logprobs": torch.tensor([-1.0, -2.0, -0.5, 0.0]), "loss_mask": torch.tensor([1, 1, 0, 0]),
             "prox_logprobs": torch.tensor([-1.2, -2.0, -0.7, 0.0])}
    ref_lp = torch.tensor([-1.5, -1.0, -0.1, 0.0])
    values = torch.tensor([0.3, -0.2, 0.0, 0.0])
    s = _setup_with(tmp_path, ["algorithm.adv_estimator=gae", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"],
                    ref=_FakeEngine(ref_lp), critic=_FakeEngine(values))
    out = s.ref_and_values(batch)
    assert torch.equal(out["ref_logprobs"], ref_lp) and torch.equal(out["values"], values)
    # k3 of (prox - ref) on masked tokens: d = 0.3 -> e^-0.3 - 1 + 0.3 = 0.0408182; d = -1 -> e - 2 = 0.7182818,
    # written to 7 decimals; computed in fp32 (d, e^-d, - 1, + d: 4 roundings of values <= e)
    kl_tol = printed_tol(7) + fp32_tol(1, math.e, ops=4)
    assert torch.allclose(out["kl"], torch.tensor([0.0408182, 0.7182818, 0.0, 0.0]), rtol=0, atol=kl_tol)
    assert torch.equal(out["kl"][:2], kl_estimate(batch["prox_logprobs"], ref_lp)[:2])  # the same function, masked
    # GRPO without KL: nothing extra is computed
    assert _setup_with(tmp_path, []).ref_and_values(batch) == {}
    assert _setup_with(tmp_path, []).train_critic(batch, version=1) == {}


# ---------------------------------------------------------------- 2 ranks, one launch
# Tolerances (tests/support/numerics.py) for the fp32 2-layer critic of tests/dist/critic_checks.py
# computed two ways (another layout, a reloaded checkpoint, two engines): every reduction on the
# way may run in another order, FWD of them, of up to K = 128 terms (MLP; vocab 120, hidden 64).
LAYERS, K = 2, 128
FWD, FWD_BWD = transformer_reductions(LAYERS), transformer_reductions(LAYERS, backward=True)
NUM_PARAMS = count_params(vocab_size=120, num_hidden_layers=LAYERS, tie_word_embeddings=True)  # 81,984
ADAM_EPS = 1e-5  # critic_checks.critic_cfg
GRAD_REL_TOL = fp32_tol(K, 1.0, ops=FWD_BWD)  # 7.1e-6 relative (a norm's error <= its elements')


def v_tol(ref) -> float:
    """Values (or log-probs) from the same weights: FWD reductions, relative to max |ref|
    (values up to 1.75 -> 9e-6; measured <= 5e-7)."""
    return fp32_tol(K, float(torch.as_tensor(ref).abs().max()), ops=FWD)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return run_dist_script("critic_checks.py", 2, tmp_path_factory.mktemp("critic"), timeout_s=300)


def _maxdiff(a, b) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_critic_values_same_in_every_layout(dist_results):
    C = dist_results["critic"]
    assert [C[n]["dp"] for n in ("tp1", "tp2", "pp2")] == [2, 1, 1]
    v = torch.tensor(C["tp1"]["values"])
    assert v.shape == (sum(b - a for a, b in zip(dist_results["cu_seqlens"], dist_results["cu_seqlens"][1:])),)
    ends = torch.tensor(dist_results["cu_seqlens"][1:]) - 1
    assert torch.all(v[ends] == 0) and torch.count_nonzero(v) == v.numel() - ends.numel()
    # a real, non-trivial head output (init std 0.1 on unit-RMS hidden states: |v| ~ 0.8; measured
    # max 1.75), far above the layout tolerance
    assert torch.isfinite(v).all() and v.abs().max() > 1000 * v_tol(v)
    for n in ("tp2", "pp2"):
        assert _maxdiff(C[n]["values"], C["tp1"]["values"]) <= v_tol(C["tp1"]["values"]), n


@pytest.mark.slow
def test_one_critic_step_reduces_value_loss_in_every_layout(dist_results):
    C = dist_results["critic"]
    ref = C["tp1"]
    n_tokens = sum(dist_results["loss_mask"])
    # after the step: the same-weights bound plus the share of the step's effect (values moved by
    # 0.94) that another layout's gradient rounding can change (numerics.adam_step_rel: 2.2e-2)
    moved = _maxdiff(ref["after"], ref["values"])
    after_t = v_tol(ref["after"]) + moved * adam_step_rel(GRAD_REL_TOL, ref["stats"]["grad_norm"], NUM_PARAMS, ADAM_EPS)
    for n in ("tp1", "tp2", "pp2"):
        c = C[n]
        # The engine's shares sum to the objective on the same values: 0.5 (v - R)^2 moves by
        # |v - R| |dv|, and mean |v - R| <= sqrt(2 loss); plus the n_tokens terms in another order.
        share_t = math.sqrt(2 * c["whole_loss"]) * v_tol(c["values"]) + fp32_tol(n_tokens, c["whole_loss"])
        assert abs(c["stats"]["loss"] - c["whole_loss"]) <= share_t, n
        assert c["stats"]["n_tokens"] == n_tokens
        # Learning, not rounding: one Adam step (lr 3e-4) lowers the loss by 40% (measured 0.4275 ->
        # 0.2545); asking for 20% leaves room for another machine's step, and a step that did
        # nothing (a change of rounding size) fails it.
        assert c["loss_after"] < 0.8 * c["whole_loss"], n
        assert abs(c["stats"]["grad_norm"] - ref["stats"]["grad_norm"]) <= GRAD_REL_TOL * ref["stats"]["grad_norm"], n
        assert _maxdiff(c["after"], ref["after"]) <= after_t, n
    assert moved > after_t  # the step moved the values by more than the tolerance
    r = C["pp2"]["resumed"]  # saved at TP2 after the step, loaded into a fresh PP2 critic: the saved bits
    assert r["version"] == 5 and _maxdiff(r["values"], C["tp2"]["after"]) <= v_tol(C["tp2"]["after"])


@pytest.mark.slow
def test_reference_model_is_the_frozen_initial_policy(dist_results):
    R = dist_results["ref"]
    lp_t = v_tol(R["ref0"])  # log-probs (|lp| <= 5.3) of the same weights in two engines: 2.7e-5
    assert _maxdiff(R["ref0"], R["act0"]) <= lp_t  # same weights (the DDP-wrapped actor: rounding only)
    assert R["ref1"] == R["ref0"]  # the same frozen engine, the same inputs: bit for bit
    assert _maxdiff(R["act1"], R["act0"]) > lp_t  # while the actor moved (measured 1.25)
    # Step 1: actor == reference up to lp_t, and k3(d) = e^-d - 1 + d ~ d^2 / 2, computed in fp32
    # (e^-d ~ 1 rounded, then - 1 + d: 2 roundings of values ~1).
    kl_t = lp_t**2 / 2 + fp32_tol(1, 1.0, ops=2)
    assert abs(R["stats1"]["ref_kl"]) <= kl_t
    assert R["stats2"]["ref_kl"] > kl_t  # step 2 sees the KL to the frozen reference (measured 0.081)
    assert not R["ref_has_optimizer"] and R["ref_trainable_params"] == 0
    assert len(R["raised"]) == 2 and all("forward-only" in e for e in R["raised"])

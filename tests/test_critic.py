"""PPO critic (value head on the megatron trunk) and the frozen KL reference model.

Single-process checks (< 5 s): config keys, value-head init, what ``Trainer.ref_and_values`` puts
into the batch (with stand-in engines). Then ONE 2-rank torchrun launch of
tests/dist/critic_checks.py (~45-60 s on 2 busy cores) whose numbers are asserted here:
critic values identical across TP1 / TP2 / PP2 (tied embeddings untied by the critic), one
critic step lowers the value loss by the same amount in every layout, save at TP2 -> load at
PP2; the reference engine equals the actor at init and stays fixed while the actor moves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from areal_mega.config import ConfigError
from areal_mega.trainer.critic import CriticConfig, ValueHead
from areal_mega.trainer.config import load_experiment
from areal_mega.algo.losses import kl_estimate
from tests import procs

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
    assert torch.allclose(v[:, 0, 0], h.float()[:, 0] @ a.weight[0], atol=1e-6)


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
    return Trainer(cfg=cfg, groups=None, actor=None, weight_sync=None, metrics=Metrics(None, enabled=False),
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
    # k3 of (prox - ref) on masked tokens: d = 0.3 -> e^-0.3 - 1 + 0.3 = 0.040818; d = -1 -> e - 2 = 0.718282
    assert torch.allclose(out["kl"], torch.tensor([0.0408182, 0.7182818, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(out["kl"][:2], kl_estimate(batch["prox_logprobs"], ref_lp)[:2])
    # GRPO without KL: nothing extra is computed
    assert _setup_with(tmp_path, []).ref_and_values(batch) == {}
    assert _setup_with(tmp_path, []).train_critic(batch, version=1) == {}


# ---------------------------------------------------------------- 2 ranks, one launch
@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("critic")
    out = work / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "tests/dist/critic_checks.py", "--work-dir", str(work), "--out", str(out)]
    proc = procs.run(cmd, cwd=REPO, env=env, timeout=300)  # the timeout bounds a hang
    if proc.returncode != 0:
        pytest.fail(f"critic_checks.py failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _maxdiff(a, b) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


@pytest.mark.timeout(360)
def test_critic_values_same_in_every_layout(dist_results):
    C = dist_results["critic"]
    assert [C[n]["dp"] for n in ("tp1", "tp2", "pp2")] == [2, 1, 1]
    v = torch.tensor(C["tp1"]["values"])
    assert v.shape == (sum(b - a for a, b in zip(dist_results["cu_seqlens"], dist_results["cu_seqlens"][1:])),)
    assert torch.isfinite(v).all() and v.abs().max() > 0.05  # a real, non-trivial head output
    ends = torch.tensor(dist_results["cu_seqlens"][1:]) - 1
    assert torch.all(v[ends] == 0) and torch.count_nonzero(v) == v.numel() - ends.numel()
    for n in ("tp2", "pp2"):
        assert _maxdiff(C[n]["values"], C["tp1"]["values"]) <= 1e-5, n


def test_one_critic_step_reduces_value_loss_in_every_layout(dist_results):
    C = dist_results["critic"]
    for n in ("tp1", "tp2", "pp2"):
        c = C[n]
        assert c["stats"]["loss"] == pytest.approx(c["whole_loss"], abs=1e-6), n  # shares sum to the objective
        assert c["stats"]["n_tokens"] == sum(dist_results["loss_mask"])
        assert c["loss_after"] < 0.8 * c["whole_loss"], n  # measured 0.4275 -> 0.2545
        assert c["stats"]["grad_norm"] == pytest.approx(C["tp1"]["stats"]["grad_norm"], rel=1e-5), n
        assert _maxdiff(c["after"], C["tp1"]["after"]) <= 1e-4, n
    r = C["pp2"]["resumed"]  # saved at TP2 after the step, loaded into a fresh PP2 critic
    assert r["version"] == 5 and _maxdiff(r["values"], C["tp2"]["after"]) <= 1e-5


def test_reference_model_is_the_frozen_initial_policy(dist_results):
    R = dist_results["ref"]
    assert _maxdiff(R["ref0"], R["act0"]) <= 1e-5  # same weights (DDP buffers: fp32 noise only)
    assert _maxdiff(R["ref1"], R["ref0"]) == 0.0  # unchanged by the actor's two steps
    assert _maxdiff(R["act1"], R["act0"]) > 0.1  # while the actor moved
    assert R["stats1"]["ref_kl"] == pytest.approx(0.0, abs=1e-9)  # step 1: actor == reference
    assert R["stats2"]["ref_kl"] > 1e-3  # step 2 sees the KL to the frozen reference
    assert not R["ref_has_optimizer"] and R["ref_trainable_params"] == 0
    assert len(R["raised"]) == 2 and all("forward-only" in e for e in R["raised"])

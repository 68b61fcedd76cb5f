"""One owner per fact (issue #20), checked without processes: the one stats rule, the weight-sync
config's moved keys, the learner temperature's check, the model_path default, the Trainer's typed
components and the layering of the rollout package. ~1 s."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import pytest

from areal_mega.config import ConfigError, from_dict
from areal_mega.experiment import ExperimentConfig, load_experiment
from areal_mega.utils.stats import reduce_stats, reduction
from areal_mega.weight_sync.config import WeightSyncConfig

REPO = Path(__file__).resolve().parents[1]


def test_one_stats_rule_by_key():
    steps = [{"loss": 1.0, "num_tokens": 10.0, "n_tokens": 4.0, "ratio/max": 1.5, "ratio/min": 0.5, "step": 1.0,
              "lr": 0.1, "clip_frac": 0.2},
             {"loss": 3.0, "num_tokens": 20.0, "n_tokens": 6.0, "ratio/max": 1.2, "ratio/min": 0.7, "step": 2.0,
              "lr": 0.2, "clip_frac": 0.6}]
    got = reduce_stats(steps)
    assert got == {"loss": 4.0, "num_tokens": 30.0, "n_tokens": 10.0, "ratio/max": 1.5, "ratio/min": 0.5,
                   "step": 2.0, "lr": 0.2, "clip_frac": pytest.approx(0.4, abs=1e-15)}
    # weighted means: (0.2 * 4 + 0.6 * 6) / 10 = 0.44 (negative control: the plain mean 0.4 differs)
    assert reduce_stats(steps, weights=[4.0, 6.0])["clip_frac"] == pytest.approx(0.44, abs=1e-15)
    assert [reduction(k) for k in ("loss", "x/max", "x/min", "lr", "entropy")] == ["sum", "max", "min", "last", "mean"]


def test_engine_and_trainer_share_the_rule():
    """No second suffix rule: the engine and the trainer import the one reduction."""
    for rel in ("areal_mega/megatron/engine.py", "areal_mega/trainer/trainer.py"):
        src = (REPO / rel).read_text()
        assert "areal_mega.utils.stats" in src, rel
        assert 'endswith("/max")' not in src, rel


@pytest.mark.parametrize("key", ["pause_mode", "pause_servers", "no_such_key"])
def test_removed_weight_sync_keys_are_unknown_keys(key):
    """pause_mode / pause_servers left weight_sync (the pool and the rollout service own pausing)."""
    with pytest.raises(ConfigError, match=f"unknown key 'weight_sync.{key}'"):
        from_dict(ExperimentConfig, {"model_path": "m", "weight_sync": {key: 1}})
    assert not hasattr(WeightSyncConfig(), "pause_mode")


def test_shipped_configs_load_and_have_one_pause_mode():
    for path in sorted(p for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("sft")):
        cfg = load_experiment(str(path), ["model_path=/m"])
        assert cfg.inference.client.pause_mode in ("abort", "retract", "in_place"), path


def test_learner_temperature_is_checked_against_sampling():
    with pytest.raises(ConfigError, match="workflow.sampling.temperature"):
        load_experiment(str(REPO / "configs" / "grpo_tiny.yaml"), ["model_path=/m", "workflow.sampling.temperature=0"])
    cfg = load_experiment(str(REPO / "configs" / "grpo_tiny.yaml"), ["model_path=/m", "workflow.sampling.temperature=0.7"])
    from areal_mega.trainer.trainer import Trainer

    t = Trainer(cfg=cfg, groups=None, actor=None, weight_sync=None, advantage=None, policy_loss=None, metrics=None,
                ctrl_group=None, start_step=0)
    assert t.temperature == 0.7
    src = "\n".join((REPO / p).read_text() for p in ("areal_mega/trainer/trainer.py", "areal_mega/trainer/loop.py", "areal_mega/trainer/main.py"))
    assert src.count(".sampling.temperature") == 1  # read in one place (the property)


def test_model_path_default_applied_once():
    cfg = from_dict(ExperimentConfig, {"model_path": "/learner"})
    assert cfg.inference.server.model_path == "/learner"
    cfg = from_dict(ExperimentConfig, {"model_path": "/learner", "inference": {"server": {"model_path": "/other"}}})
    assert cfg.inference.server.model_path == "/other"  # the file's own value wins


def test_trainer_holds_typed_components():
    from areal_mega.trainer.trainer import Trainer

    hints = typing.get_type_hints(Trainer)

    def has_any(tp) -> bool:
        return tp is typing.Any or any(has_any(a) for a in typing.get_args(tp))

    assert [k for k, tp in hints.items() if has_any(tp)] == []
    assert has_any(dict[str, typing.Any])  # the check can fail


def _imports(package: str) -> dict[str, set[str]]:
    out = {}
    for f in (REPO / "areal_mega" / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[str(f.relative_to(REPO))] = names
    return out


def test_generation_side_layers():
    """The rollout service reads no server internals it does not own and patches no hook; the
    trainer builds no SGLang clients (weight sync keeps its own per URL)."""
    service = (REPO / "areal_mega/rollout/service.py").read_text()
    assert "pool.resync" not in service and "pool.cfg" not in service and "pool.servers" not in service
    assert not re.search(r"\.(healthy|address)\b(?!_)", service)
    trainer = (REPO / "areal_mega/trainer/trainer.py").read_text()
    assert "SGLangClient" not in trainer and "dataclasses.replace" not in trainer
    for f, names in _imports("rollout").items():
        assert not any(n.startswith("areal_mega.launcher") for n in names), f
    for f, names in _imports("trainer").items():
        assert not any(n.startswith("areal_mega.inference.sglang_api") for n in names), f

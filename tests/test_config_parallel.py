"""Typed configs (YAML + dotted overrides) and the parallel-layout object: pure logic."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.parallel import ParallelConfig, ParallelLayout
from areal_mega.experiment import ExperimentConfig, load_experiment

REPO = Path(__file__).resolve().parents[1]


def test_shipped_configs_load() -> None:
    tiny = load_experiment(str(REPO / "configs/grpo_tiny.yaml"))
    assert tiny.parallel.tensor_parallel == 2 and tiny.rollout.max_staleness == 1
    assert tiny.inference.server.model_path == tiny.model_path  # servers start from the learners' weights
    big = load_experiment(str(REPO / "configs/grpo_llama70b.yaml"))
    assert (big.parallel.tensor_parallel, big.parallel.pipeline_parallel) == (8, 4)


def test_overrides_parse_as_yaml_and_win() -> None:
    cfg = load_experiment(str(REPO / "configs/grpo_tiny.yaml"),
                          ["actor.optimizer.lr=1e-6", "rollout.max_staleness=0", "inference.addresses=[h1:1, h2:2]"])
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.rollout.max_staleness == 0
    assert cfg.inference.addresses == ["h1:1", "h2:2"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.optimizer.lrr=1", "unknown key 'actor.optimizer.lrr'"),
        ("actor.optimizer.lr=fast", "actor.optimizer.lr: expected a number, got 'fast'"),
        ("rollout.max_staleness=-1", "rollout.max_staleness: must be >= 0, got -1"),
        ("algorithm.adv_estimator=ppo2", "algorithm.adv_estimator: 'ppo2' is not one of"),
        ("trainer.num_steps=1.5", "trainer.num_steps: expected an integer"),
        ("rollout=3", "rollout: expected a mapping"),
    ],
)
def test_bad_values_name_the_key_and_file(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_experiment(str(REPO / "configs/grpo_tiny.yaml"), [override])
    assert message in str(e.value) and "configs/grpo_tiny.yaml" in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ExperimentConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_path: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(ExperimentConfig, bad)


def test_layout_arithmetic_in_errors() -> None:
    with pytest.raises(ValueError, match=r"world_size\(30\) is not divisible by tp\(8\) \* pp\(4\) \* cp\(1\) = 32"):
        ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 30)
    with pytest.raises(ValueError, match=r"tp\(8\) \* pp\(4\) \* cp\(1\) \* dp\(2\) = 64 != world_size\(32\)"):
        ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4, data_parallel=2), 32)
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=8, pipeline_parallel=4), 64)
    with pytest.raises(ValueError, match=r"num_layers\(30\) is not divisible by pp\(4\)"):
        lay.check_model(num_layers=30, num_heads=64, num_kv_heads=8)
    with pytest.raises(ValueError, match=r"num_kv_heads\(4\) % tp\(8\)"):
        lay.check_model(num_layers=80, num_heads=64, num_kv_heads=4)


@pytest.mark.parametrize("tp, pp, cp, world", [(1, 1, 1, 1), (2, 2, 1, 8), (8, 4, 1, 64), (2, 2, 2, 16), (4, 1, 1, 8)])
def test_coords_and_rank_are_inverse_and_tp_is_fastest(tp: int, pp: int, cp: int, world: int) -> None:
    lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp), world)
    assert lay.dp == world // (tp * pp * cp)
    seen = set()
    for r in range(world):
        c = lay.coords(r)
        assert lay.rank(dp=c.dp, pp=c.pp, cp=c.cp, tp=c.tp) == r
        seen.add((c.dp, c.pp, c.cp, c.tp))
    assert len(seen) == world
    assert [lay.coords(r).tp for r in range(tp)] == list(range(tp))  # adjacent ranks share a TP group
    assert lay.ranks_of_stage(pp - 1) == [r for r in range(world) if r >= world - world // pp]


def test_override_values_yaml_cannot_build_are_strings_bad_yaml_one_line() -> None:
    """`key==` (YAML's value tag) is the string "=", not a constructor traceback; an override
    that is not YAML at all is a one-line error naming the key."""
    from areal_mega.config import parse_overrides

    assert parse_overrides(["workflow.steps.delimiter==", "a.b=<<"]) == {"workflow": {"steps": {"delimiter": "="}},
                                                                          "a": {"b": "<<"}}
    assert parse_overrides(["a=[1, 2]", "b=null", "c="]) == {"a": [1, 2], "b": None, "c": ""}  # YAML as before
    with pytest.raises(ConfigError) as e:
        parse_overrides(["inference.addresses=[h1:1, h2"])
    msg = str(e.value)
    assert msg.startswith("override inference.addresses: '[h1:1, h2' is not valid YAML") and "\n" not in msg

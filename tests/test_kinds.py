"""The one loader of every open kind (areal_mega/kinds.py) and the typed options it gives user
components: built-ins and user code resolve the same way, every failure is one line naming the
key, the module or the file, and no closed kind list is left in the config tree. No processes."""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

import pytest

from areal_mega import kinds
from areal_mega.config import ConfigError, from_dict
from areal_mega.experiment import ExperimentConfig, load_experiment

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "grpo_tiny.yaml")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_components.py").write_text(
        "import dataclasses\n"
        "class Scored:\n"
        "    @dataclasses.dataclass\n"
        "    class Options:\n"
        "        bonus: float = 0.0\n"
        "        label: str = 'x'\n"
        "        def validate(self):\n"
        "            if self.bonus < 0: raise ValueError(f'bonus: must be >= 0, got {self.bonus}')\n"
        "    def __init__(self, cfg, ctx): self.opts = cfg.options\n"
        "class Plain:\n"
        "    def __init__(self, cfg, ctx): pass\n"
        "NOT_CALLABLE = 3\n")
    (tmp_path / "broken_components.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_components"
    for m in ("my_components", "broken_components"):
        sys.modules.pop(m, None)


def test_every_builtin_resolves_through_the_loader():
    for family, names in kinds.BUILTINS.items():
        for name, path in names.items():
            assert kinds.resolve(family, name) is kinds.resolve(family, path), (family, name)


def test_bad_kinds_are_one_line_naming_what_failed(user_module):
    cases = [("reward", "nope", "'nope' is not one of the reward kinds (built-ins: code, composite"),
             ("workflow", "no_such_pkg.mod:Game", "workflow 'no_such_pkg.mod:Game': cannot import no_such_pkg.mod"),
             ("reward", "broken_components:X", "importing broken_components raised RuntimeError: half-written"),
             ("advantage", f"{user_module}:Missing", f"{user_module} has no callable 'Missing'"),
             ("tool", f"{user_module}:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'")]
    for family, kind, msg in cases:
        with pytest.raises(kinds.KindError) as e:
            kinds.resolve(family, kind)
        assert msg in str(e.value) and "\n" not in str(e.value), (kind, str(e.value))
        if family != "reward":  # the family's own name, never "reward function" for a workflow or a tool
            assert "reward" not in str(e.value)


def test_user_options_are_typed_and_checked_like_builtin_sections(user_module):
    cfg = load_experiment(TINY, ["model_path=/m", f"reward.kind={user_module}:Scored", "reward.options.bonus=0.5"])
    assert type(cfg.reward.options).__qualname__ == "Scored.Options" and cfg.reward.options.bonus == 0.5
    assert load_experiment(TINY, ["model_path=/m", f"reward.kind={user_module}:Scored"]).reward.options.bonus == 0.0
    bad = [("reward.options.nope=1", "unknown key 'reward.options.nope' (known keys here: bonus, label)"),
           ("reward.options.bonus=high", "reward.options.bonus: expected a number, got 'high'"),
           ("reward.options.bonus=-1", "reward.options.bonus: must be >= 0, got -1.0")]
    for override, msg in bad:
        with pytest.raises(ConfigError) as e:
            load_experiment(TINY, ["model_path=/m", f"reward.kind={user_module}:Scored", override])
        assert msg in str(e.value) and "grpo_tiny.yaml" in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"reward.options: reward 'my_components:Plain' takes no options"):
        load_experiment(TINY, ["model_path=/m", f"reward.kind={user_module}:Plain", "reward.options.bonus=1"])
    # the file's reward is kind "function" with its options: another kind on the command line drops them
    assert load_experiment(TINY, ["model_path=/m", "reward.kind=consistency"]).reward.options is None
    assert load_experiment(TINY, ["model_path=/m", "reward.options.isolate=true"]).reward.options.isolate  # same kind: merged
    with pytest.raises(ConfigError, match=r"reward.kind: 'mth' is not one of the reward kinds"):
        load_experiment(TINY, ["model_path=/m", "reward.kind=mth"])


def test_builtin_and_user_reward_are_built_by_the_same_call(user_module):
    from areal_mega.reward import RewardConfig, build_reward

    user = from_dict(RewardConfig, {"kind": f"{user_module}:Scored", "options": {"bonus": 2.0}})
    built = build_reward(user)
    assert type(built).__name__ == "Scored" and built.opts.bonus == 2.0
    fmt = build_reward(RewardConfig(kind="format"))  # a built-in: the same resolve(...)(cfg, ctx)
    assert type(fmt).__name__ == "FormatReward"


def _kind_fields(cls, seen=()):
    """(dataclass, field, annotation) of every field an OPEN_KINDS table names, over the tree."""
    hints = typing.get_type_hints(cls)
    for kind_field in getattr(cls, "OPEN_KINDS", {}):
        yield cls, kind_field, hints[kind_field]
    for f in dataclasses.fields(cls):
        for sub in [hints[f.name], *typing.get_args(hints[f.name])]:
            if dataclasses.is_dataclass(sub) and sub not in seen:
                yield from _kind_fields(sub, (*seen, cls))


def test_no_closed_kind_list_is_left():
    from areal_mega.workflows.tool import ToolWorkflow

    roots = (ExperimentConfig, ToolWorkflow.Options)  # the tool kinds sit in the tool workflow's own options
    found = {(c.__name__, f): tp for root in roots for c, f, tp in _kind_fields(root)}
    assert set(found) >= {("WorkflowConfig", "kind"), ("RewardConfig", "kind"), ("AlgorithmConfig", "adv_estimator"),
                          ("AlgorithmConfig", "policy_loss"), ("DatasetConfig", "kind"), ("ToolConfig", "kind")}, found
    assert all(tp is str for tp in found.values()), found  # a Literal here would be a closed list again
    for root in roots:  # every kind key has its options key in the one table (the merge rule reads it too)
        for c, f, _ in _kind_fields(root):
            assert f in kinds.OPTIONS_OF and kinds.OPTIONS_OF[f] in {x.name for x in dataclasses.fields(c)}, (c, f)
    families = {fam for root in roots for c, _, _ in _kind_fields(root) for fam in c.OPEN_KINDS.values()}
    assert families <= set(kinds.BUILTINS)
    src = "\n".join(p.read_text() for p in (REPO / "areal_mega").rglob("*.py"))
    assert "load_callable" not in src and "_KINDS = {" not in src


def test_cli_reports_a_bad_kind_in_one_line(capsys):
    from areal_mega.cli import main

    with pytest.raises(SystemExit) as exit_:  # the same line from a researcher's own script (trainer.main.parse_args)
        main(["train", "--config", TINY, "model_path=/m", "algorithm.adv_estimator=no_pkg:Est"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "algorithm.adv_estimator: advantage 'no_pkg:Est': cannot import no_pkg" in err


def test_a_yaml_names_its_base_file(tmp_path):
    """``base:`` loads another file first (relative to this one) and this file's keys over it; a
    changed kind drops the base's options of the old kind; a cycle of bases is one line."""
    from areal_mega.config import load_dict

    (tmp_path / "a.yaml").write_text("seed: 3\nreward: {kind: function, options: {function: 'm:f'}}\noutput_dir: a\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nseed: 4\nreward: {kind: math}\n")
    data, _ = load_dict(tmp_path / "b.yaml")
    assert data == {"seed": 4, "output_dir": "a", "reward": {"kind": "math"}}
    assert load_dict(tmp_path / "b.yaml", ["seed=5"])[0]["seed"] == 5  # the command line over both
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="makes a cycle of base files"):
        load_dict(tmp_path / "c.yaml")

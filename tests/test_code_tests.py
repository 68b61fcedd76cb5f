"""The code reward's tests and output comparison, without running code (no sandbox, no process):
``check_tests`` at load, ``normalise``/``judge`` (with the negative control: a wrong answer still
fails), and the refusal of ``extra_paths`` that expose the dataset or the run directory."""

from __future__ import annotations

import pytest

from areal_mega.config import from_dict
from areal_mega.data import DatasetConfig
from areal_mega.data.dataset import PromptDataset, PromptStream
from areal_mega.experiment import ExperimentConfig
from areal_mega.reward import RewardConfig
from areal_mega.reward.code import check_prompt_source, check_tests, judge, normalise
from areal_mega.sandbox import ExecResult, SandboxConfig


def ok(stdout: str) -> ExecResult:
    return ExecResult("ok", 0, stdout, "", 0.0)


def test_output_normalisation_and_negative_control():
    expected = "1 2\n3 4\n"
    for right in ("1 2\r\n3 4\r\n", "1 2   \n3 4\t\n", "1 2\n3 4", "1 2\n3 4\n\n\n", "\n1 2\r\n3 4  \r\n\r\n"):
        assert judge(ok(right), expected) == "ok", repr(right)
    # what a judge must still tell apart: another answer, a changed line inside, a missing line,
    # spacing inside a line, a line break moved
    for wrong in ("1 2\n3 5\n", "1 2\n\n3 4\n", "1 2\n", "1  2\n3 4\n", "1 2 3 4\n", ""):
        assert judge(ok(wrong), expected) == "wrong_answer", repr(wrong)
    assert judge(ExecResult("timeout", None, "1 2\n3 4\n", "", 3.0), expected) == "timeout"
    assert normalise("a \r\nb\t\r\n\r\n") == "a\nb"


def test_tests_validated():
    check_tests([{"input": "1\n", "output": "2"}, {"output": 3}], "s")
    for bad, why in (([{"input": "1\n"}], "tests\\[0\\] has no 'output'"),
                     ([{"input": "1", "output": "1"}, {"input": "1", "output": None}], "tests\\[1\\] has no 'output'"),
                     ([{"input": "1", "output": ""}], "tests\\[0\\] expects an empty output"),
                     ([{"input": "1", "output": " \r\n\n"}], "tests\\[0\\] expects an empty output"),
                     ([], "'tests' must be a non-empty list"), (None, "'tests' must be a non-empty list"),
                     ([{"input": "1", "output": ["x"]}], "tests\\[0\\]: 'input' and 'output' must be strings")):
        with pytest.raises(ValueError, match=f"^sample 7: {why}") as e:
            check_tests(bad, "sample 7")
        assert "\n" not in str(e.value)
    check_tests([{"input": "1", "output": ""}], "s", allow_empty_output=True)  # the opt-in


def test_prompt_source_checked_when_the_reward_runs_code():
    good = {"id": "a", "tests": [{"input": "1", "output": "1"}]}
    empty = {"id": "b/7", "tests": [{"input": "1", "output": ""}]}
    code = RewardConfig(kind="code")
    assert check_prompt_source(code, PromptStream(PromptDataset([good]), [good])) == 2
    with pytest.raises(ValueError, match="^data: sample b/7: tests\\[0\\] expects an empty output"):
        check_prompt_source(code, PromptStream(PromptDataset([good]), [empty]))  # held-out samples too
    assert check_prompt_source(code, PromptStream(PromptDataset([empty])), allow_empty_output=True) == 1
    assert check_prompt_source(RewardConfig(kind="math"), PromptStream(PromptDataset([empty]))) == 0
    composite = from_dict(RewardConfig, {"kind": "composite", "options": {"components": [
        {"kind": "format", "options": {"regex": "x"}}, {"kind": "code"}]}}, prefix="reward.")
    with pytest.raises(ValueError, match="sample b/7"):
        check_prompt_source(composite, PromptStream(PromptDataset([empty])))


def test_extra_paths_may_not_expose_the_dataset_or_the_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)

    def exp(extra, tool_extra=()):
        e = ExperimentConfig(model_path="m", output_dir=str(run), data=DatasetConfig(kind="jsonl", path=str(data / "train.jsonl")),
                             reward=RewardConfig(kind="code", options=SandboxConfig(extra_paths=list(extra))))
        if tool_extra:
            from areal_mega.agent_tools import ToolConfig
            from areal_mega.workflows import WorkflowConfig

            e.workflow = WorkflowConfig(kind="tool")
            e.workflow.options.tools = [ToolConfig(kind="python", sandbox=SandboxConfig(extra_paths=list(tool_extra)))]
        return e

    exp([str(inputs)]).validate()  # a directory of inputs only: fine
    for extra, what in (([str(data)], "data.path"), ([str(inputs), str(data / "train.jsonl")], "data.path"),
                        ([str(tmp_path)], "data.path"), ([str(run / "x")], "output_dir"), (["/"], "data.path")):
        (run / "x").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=f"^reward.options.extra_paths\\[{len(extra) - 1}\\]: .* overlaps {what}"):
            exp(extra).validate()
    with pytest.raises(ValueError, match="^workflow.options.tools\\[0\\].sandbox.extra_paths\\[0\\]: .* overlaps output_dir"):
        exp([], [str(run)]).validate()  # the python tool's sandbox: the same rule


def test_eval_items_are_checked_like_training_samples():
    """``areal-mega eval`` checks its items with the trainer's rule (``check_samples``)."""
    from areal_mega.reward.code import check_samples

    code = RewardConfig(kind="code")
    good = {"id": 1, "tests": [{"input": "", "output": "1"}]}
    empty = {"id": 2, "tests": [{"input": "", "output": " \r\n"}]}
    assert check_samples(code, [good], source="eval_data") == 1
    with pytest.raises(ValueError, match="eval_data: sample 2: tests\\[0\\]"):
        check_samples(code, [good, empty], source="eval_data")
    assert check_samples(RewardConfig(kind="math"), [empty]) == 0  # control: no code reward, no check


def test_a_source_without_listed_samples_is_not_read_unless_the_reward_runs_code():
    """A prompt source whose dataset lists no samples (examples/arithmetic_source.py) meets no
    check when the reward runs no code (the trainer's start-up called it for every reward)."""
    import types

    stream = types.SimpleNamespace(dataset=object(), heldout=lambda: [])
    assert check_prompt_source(RewardConfig(kind="math"), stream) == 0
    with pytest.raises(AttributeError):  # control: with a code reward it does read the samples
        check_prompt_source(RewardConfig(kind="code"), stream)

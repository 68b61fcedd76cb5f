"""Datasets: jsonl / parquet with configurable fields and clear errors, reasoning-gym offline,
templates, deterministic split and per-epoch shuffle (~3 s, mostly importing reasoning-gym)."""

import json

import pandas as pd
import pytest

from areal_mega.config import ConfigError, from_dict
from areal_mega.data import DatasetConfig, load_dataset


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_fields_template_and_split(tmp_path):
    rows = [{"problem": f"What is {i}+1?", "meta": {"sol": i + 1}, "tests": [i]} for i in range(10)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DatasetConfig(kind="jsonl", path=path, prompt_field="problem", answer_field="meta.sol",
                        extra_fields=["tests"], num_eval=3, seed=5, instruction="Be brief.")
    split = load_dataset(cfg)
    assert len(split.train) == 7 and len(split.eval) == 3
    s = split.eval[0]
    i = int(s["id"].split("/")[1]) - 1  # ids are file-stem/line
    assert s["question"] == f"What is {i}+1?" and s["answer"] == str(i + 1) and s["tests"] == [i]
    assert s["prompt"] == f"Question: What is {i}+1? Be brief.\nAnswer:"
    # deterministic and disjoint
    again = load_dataset(cfg)
    assert [x["id"] for x in again.eval] == [x["id"] for x in split.eval]
    assert not {x["id"] for x in split.eval} & {x["id"] for x in split.train.samples}
    # epochs: same samples, a different (seeded, reproducible) order
    e0, e1 = [x["id"] for x in split.train], [x["id"] for x in split.train]
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert [x["id"] for x in again.train] == e0


def test_jsonl_errors_name_field_and_line(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": 1}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no field 'answer'"):
        load_dataset(DatasetConfig(kind="jsonl", path=path))
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "answer": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        load_dataset(DatasetConfig(kind="jsonl", path=str(tmp_path / "broken.jsonl")))
    with pytest.raises(ConfigError, match="path"):
        from_dict(DatasetConfig, {"kind": "jsonl"})


def test_parquet_and_missing_column(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"q": ["1+1?", "2+2?"], "a": [2, 4]}).to_parquet(path)
    split = load_dataset(DatasetConfig(kind="parquet", path=str(path), prompt_field="q", answer_field="a",
                                       template="raw", shuffle=False))
    assert [(s["prompt"], s["answer"]) for s in split.train] == [("1+1?", "2"), ("2+2?", "4")]
    with pytest.raises(ValueError, match=r"no column 'answer'"):
        load_dataset(DatasetConfig(kind="parquet", path=str(path), prompt_field="q"))


def test_chat_template_needs_tokenizer():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    from areal_mega.data import format_prompt

    cfg = DatasetConfig(template="chat", system_prompt="sys")
    assert format_prompt("hi", cfg, Tok()) == "system:sys|user:hi|assistant:"
    with pytest.raises(ValueError, match="template"):
        format_prompt("hi", cfg, None)


def test_reasoning_gym_offline_deterministic():
    cfg = DatasetConfig(kind="reasoning_gym", tasks=["basic_arithmetic"], size=20, seed=3, eval_fraction=0.2,
                        task_kwargs={"basic_arithmetic": {"max_terms": 3, "max_digits": 2, "operators": ["+", "-"]}})
    a, b = load_dataset(cfg), load_dataset(cfg)
    assert len(a.train) == 16 and len(a.eval) == 4
    assert a.train.samples == b.train.samples
    for s in a.train.samples + a.eval:
        expr = s["question"].removeprefix("Calculate ").rstrip(".")
        assert eval(expr) == int(s["answer"]), s  # the generator's answer is the true value
    with pytest.raises(ValueError, match="tasks"):
        load_dataset(DatasetConfig(kind="reasoning_gym", tasks=["no_such_task"], size=2))


def test_heldout_questions_never_in_training(tmp_path):
    """A source that repeats questions (generated arithmetic does): with dedupe_heldout (default)
    no training sample asks a held-out question; without it some do (the control)."""
    p = tmp_path / "rep.jsonl"
    p.write_text("".join(json.dumps({"question": f"q{i % 10}", "answer": str(i % 10)}) + "\n" for i in range(100)))
    split = load_dataset(DatasetConfig(kind="jsonl", path=str(p), num_eval=5, seed=3))
    held = {s["question"] for s in split.eval}
    train = {s["question"] for s in split.train}
    assert held and not held & train and len(split.train) + len(split.eval) < 100
    leaky = load_dataset(DatasetConfig(kind="jsonl", path=str(p), num_eval=5, seed=3, dedupe_heldout=False))
    assert held & {s["question"] for s in leaky.train} and len(leaky.train) == 95

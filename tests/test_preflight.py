"""Bad settings fail in the launcher's first seconds with one line naming the key (issue 27):
the launcher's own ``run`` (local mode, real launch and dry run) on the tiny task, one bad
setting at a time; nothing may start (no engine, no learner: the run directory gets no logs).

Slow tier: the interpreter checks run the configured interpreters (``find_spec``, ~0.1 s each).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from areal_mega.errors import EXIT_REFUSED
from areal_mega.launcher.cli import run
from tests.support.launch import SGLANG_PYTHON, needs_sglang
from tests.support.models import write_tiny_task

pytestmark = [pytest.mark.slow, needs_sglang, pytest.mark.timeout(300)]
CONFIG = "configs/grpo_tiny.yaml"
# A sanity bound, not a speed target: what this guards against is minutes (servers and learners
# starting, then failing); the checks take ~1 s here idle, a few under load.
SECONDS = 60


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    model, data = write_tiny_task(root)
    bad_module = root / "mods"
    bad_module.mkdir()
    (bad_module / "raises_on_import.py").write_text("raise RuntimeError('broken at import')\n")
    sys.path.insert(0, str(bad_module))
    yield root, model, data
    sys.path.remove(str(bad_module))


def _base(root: Path, model: Path, data: Path) -> list[str]:
    return [f"model_path={model}", f"data.path={data / 'train.jsonl'}", f"eval_data.path={data / 'test.jsonl'}",
            f"output_dir={root / 'out'}", f"launch.run_dir={root / 'run'}", f"inference.server.python={SGLANG_PYTHON}"]


BAD = [  # (override, what the one line must say)
    ("model_path={root}/no_model", "model_path: {root}/no_model is not a directory"),
    ("model_path={root}/mods", "model_path: {root}/mods has no config.json"),
    ("inference.server.python={root}/no/bin/python", "inference.server.python: interpreter {root}/no/bin/python does not exist"),
    # The learner virtualenv's python has no SGLang: a real interpreter that cannot serve.
    ("inference.server.python=" + sys.executable, "inference.server.python: interpreter " + sys.executable + " cannot import sglang"),
    ("data.path={root}/missing.jsonl", "data.path: {root}/missing.jsonl does not exist"),
    ("eval_data.path={root}/missing.jsonl", "eval_data.path: {root}/missing.jsonl does not exist"),
    ("reward.kind=function reward.options.function=no_such_pkg.mod:fn", "reward.options.function: reward 'no_such_pkg.mod:fn': cannot import no_such_pkg.mod"),
    ("reward.kind=function reward.options.function=raises_on_import:fn", "reward.options.function: reward 'raises_on_import:fn': importing raises_on_import raised RuntimeError"),
    ("workflow.kind=agent workflow.options.function=areal_mega.workflows.examples.calculator_agent:calculator_agent",
     "workflow.kind: 'agent' needs a tokenizer with a chat template; {model} has none"),
    ('workflow.kind=tool workflow.options.tools=[{{"kind":"function","function":"no_such_pkg:tool"}}]',
     "workflow.options.tools[0].function: tool 'no_such_pkg:tool': cannot import no_such_pkg"),
]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "launch"])
def test_each_bad_setting_fails_in_seconds_with_one_line(task, dry_run, capsys):
    root, model, data = task
    fmt = dict(root=root, model=model)
    for override, msg in BAD:
        extra = [o.format(**fmt) for o in override.split(" ")]
        t0 = time.monotonic()
        rc = run("local", CONFIG, _base(root, model, data) + extra, dry_run=dry_run)
        took = time.monotonic() - t0
        err = capsys.readouterr().err
        assert rc == EXIT_REFUSED, (override, err)
        assert msg.format(**fmt) in err and err.count("\n") == 1 and "Traceback" not in err, (override, err)
        assert took < SECONDS, (override, took)
        assert not (root / "run" / "logs").exists(), override  # nothing started


def test_dry_run_reports_the_checks(task, capsys):
    """With every setting right, the dry run prints each check it passed and exits 0."""
    root, model, data = task
    rc = run("local", CONFIG, _base(root, model, data), dry_run=True)
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in (f"preflight: ok model_path: {model} (qwen2, max_position_embeddings 256)",
                 f"preflight: ok inference.server.python: {SGLANG_PYTHON} (finds sglang)",
                 "preflight: ok reward.options.function: areal_mega.demo.tiny:exact_answer (imports)",
                 f"preflight: ok learner interpreter: {sys.executable}",
                 f"preflight: ok data.path: {data / 'train.jsonl'}", f"preflight: ok eval_data.path: {data / 'test.jsonl'}"):
        assert line in out, out

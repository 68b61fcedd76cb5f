"""Code reward: run the completion's last ```python block against ``data["tests"]`` in the
sandbox; reward = fraction of tests whose stdout matches.

    reward = CodeReward(SandboxConfig(timeout_s=5))
    r = await reward.evaluate("", completion, {"tests": [{"input": "2 3\\n", "output": "5"}]})
    r.score, r.info["reasons"]          # 1.0, []  -- or 0.0, ["timeout"]

Invariant: the expected output never enters the sandbox (input on stdin only; ``judge`` compares
here, in the trainer's process). Sample format and ``info``: docs/rewards.md ("Module notes").
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from areal_mega.reward.base import RewardResult
from areal_mega.sandbox import ExecResult, Sandbox, SandboxConfig

__all__ = ["CodeReward", "check_prompt_source", "check_samples", "check_tests", "extract_code", "judge", "normalise"]

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def normalise(text: str) -> str:
    """What every code judge ignores: CRLF line endings, trailing whitespace on each line, and
    leading / trailing blank lines (so a final newline or its absence)."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).strip()


def judge(res: ExecResult, expected: str) -> str:
    """"ok" when the execution succeeded with the expected stdout (both ``normalise``d), else
    the failure's reason."""
    if not res.ok:
        return res.reason
    return "ok" if normalise(res.stdout) == normalise(expected) else "wrong_answer"


def check_tests(tests: Any, where: str, allow_empty_output: bool = False) -> None:
    """Refuse (ValueError, one line naming ``where``) a sample's tests that would score a
    program for nothing: not a non-empty list of objects, a test without ``output`` or with
    ``output: null`` (it would be compared as the string "None"), or -- unless
    ``allow_empty_output`` -- one whose expected output is empty after ``normalise`` (an empty
    program would pass it)."""
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{where}: 'tests' must be a non-empty list of {{input, output}} objects, got {tests!r:.80}")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or t.get("output") is None:
            raise ValueError(f"{where}: tests[{i}] has no 'output' (or it is null): {t!r:.80}")
        if not isinstance(t["output"], (str, int, float)) or not isinstance(t.get("input", ""), (str, int, float)):
            raise ValueError(f"{where}: tests[{i}]: 'input' and 'output' must be strings, got {t!r:.80}")
        if not allow_empty_output and not normalise(str(t["output"])):
            raise ValueError(f"{where}: tests[{i}] expects an empty output, which an empty program prints; "
                             f"set data.allow_empty_test_output: true if the dataset means it")


def _scores_code(reward_cfg: Any) -> bool:
    """Whether the reward config (a composite's components too) runs the code reward."""
    return reward_cfg.kind == "code" or any(_scores_code(c) for c in getattr(reward_cfg.options, "components", ()))


def check_prompt_source(reward_cfg: Any, prompts: Any, allow_empty_output: bool = False) -> int:
    """At start-up, when the reward runs code: ``check_tests`` on every sample a listed prompt
    source holds (training and held-out; a user's stream is checked as it is scored). The
    number of samples checked."""
    if not _scores_code(reward_cfg) or not hasattr(prompts, "dataset"):
        return 0  # the reward runs no code (a generated source's dataset need not list samples)
    return check_samples(reward_cfg, [*prompts.dataset.samples, *prompts.heldout()], allow_empty_output)


def check_samples(reward_cfg: Any, samples: list[dict[str, Any]], allow_empty_output: bool = False,
                  source: str = "data") -> int:
    """``check_tests`` on each sample when the reward runs code (the trainer's listed sources,
    ``areal-mega eval``'s items); the number of samples checked."""
    if not _scores_code(reward_cfg):
        return 0
    for s in samples:
        check_tests(s.get("tests"), f"{source}: sample {s.get('id', '?')}", allow_empty_output)
    return len(samples)


class CodeReward:
    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.sandbox = Sandbox(cfg or SandboxConfig())

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        tests = data.get("tests")
        if tests is None:
            raise ValueError(f"code reward: the sample has no 'tests' list (keys: {sorted(data)})")
        # Checked at load for the listed sources (data.extra_fields holds "tests"); here the
        # structure again for any source (an empty expected output is the dataset's opt-in).
        check_tests(tests, f"code reward: sample {data.get('id', '?')}", allow_empty_output=True)
        code = extract_code(completion)
        if code is None:
            return RewardResult(0.0, {"fraction_passed": 0.0, "num_tests": len(tests), "reasons": ["no_code"]})
        results = await asyncio.gather(*[self.sandbox.run(code, str(t.get("input", ""))) for t in tests])
        verdicts = [judge(r, str(t["output"])) for r, t in zip(results, tests)]
        frac = verdicts.count("ok") / len(tests)
        return RewardResult(frac, {"fraction_passed": frac, "num_tests": len(tests),
                                   "reasons": [v for v in verdicts if v != "ok"]})

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def close(self) -> None:
        self.sandbox.close()

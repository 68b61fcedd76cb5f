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

_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def judge(res: ExecResult, expected: str) -> str:
    """"ok" when the execution succeeded with the expected stdout (surrounding whitespace
    ignored), else the failure's reason."""
    if not res.ok:
        return res.reason
    return "ok" if res.stdout.strip() == expected.strip() else "wrong_answer"


class CodeReward:
    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.sandbox = Sandbox(cfg or SandboxConfig())

    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        tests = data.get("tests")
        if not tests:
            raise ValueError(f"code reward: the sample has no 'tests' list (keys: {sorted(data)})")
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

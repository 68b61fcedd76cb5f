"""Math answer reward: extract the final answer, compare with math-verify in a worker process.

    reward = MathReward(num_workers=2, timeout_s=10)
    r = await reward(prompt_text, completion_text, {"answer": "42"})   # 1.0 or 0.0
    reward.close()

Extraction order (``extract_answer``): the last ``\\boxed{...}`` (nested braces allowed), else
the text after the last "answer is" / "answer:", else the last number in the completion.
Equivalence: equal normalised strings, else math-verify (``\\frac{1}{2}`` == 0.5, 50% == 0.5,
1,000 == 1000, sets). math-verify uses signal.alarm, so it runs in the worker processes of
``RewardWorkerPool`` (main thread there), with our own timeout on top: a hung or crashing
check scores 0 and never reaches the trainer.
"""

from __future__ import annotations

import re
from typing import Any

from areal_mega.reward.pool import RewardWorkerPool

_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: the generation was cut off inside the box


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, as a string, or None if there is none."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        ans = matches[-1].group(1).split("\n")[0].strip().strip("$*").strip()
        ans = ans.rstrip(".").strip()
        if ans:
            return ans
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


def _normalise(s: str) -> str:
    s = s.strip().strip("$").replace(" ", "").replace(",", "")
    if s.endswith(".0"):
        s = s[:-2]
    return s


def _as_math(s: str) -> str:
    # math-verify's LaTeX extraction wants delimiters; bare numbers/expressions parse as-is.
    return f"${s}$" if "\\" in s and "$" not in s else s


def answers_match(pred: str, gold: str) -> bool:
    """math-verify equivalence (call in a worker process: it uses signal.alarm)."""
    if _normalise(pred) == _normalise(gold):
        return True
    from math_verify import parse, verify

    g, p = parse(_as_math(gold)), parse(_as_math(pred))
    return bool(g) and bool(p) and bool(verify(g, p))


def math_verify_reward(prompt: str, completion: str, data: dict[str, Any]) -> float:
    """Worker-side reward function: 1.0 if the completion's final answer equals data["answer"]."""
    if "answer" not in data:
        raise ValueError(f"math reward: the sample has no 'answer' field (keys: {sorted(data)})")
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, str(data["answer"])) else 0.0


class MathReward:
    """Parent-side math reward: ``await reward(prompt, completion, data) -> float``."""

    FN = "areal_mega.reward.math:math_verify_reward"

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        self.pool = RewardWorkerPool(
            num_workers, timeout_s, preload=["math_verify", "areal_mega.reward.math"], default=0.0
        )

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return await self.pool.acall(self.FN, prompt, completion, data)

    def close(self) -> None:
        self.pool.close()

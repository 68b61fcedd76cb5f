"""Consistency reward: is a reasoning trace internally consistent? Rule-based, no reference.

    r = await ConsistencyReward().evaluate("", "12 * 3 = 36\\n36 + 4 = 40\\nThe answer is 40.", {})
    r.score, r.info        # 1.0, {"num_equations": 2, "num_true": 2, ...}

Score 1.0 when there is at least one equation ``<arithmetic> = <number>``, every one is true
(exactly, or to the precision written; evaluated by the calculator's AST walker, no eval) and
the final answer equals the last result; else 0.0 with ``info["reasons"]``. docs/rewards.md.
"""

from __future__ import annotations

import re
from typing import Any

from areal_mega.reward.base import RewardResult
from areal_mega.agent_tools.calculator import calculator

# A maximal run of arithmetic characters joined by "="; a comma belongs to a number only as a
# thousands separator (",000"), otherwise it separates ("2+2=4, 4*2=8" is two equations).
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_CH = r"(?:[\d.\t ()+\-*/^%×÷]|,(?=\d{3}(?!\d)))"
_ARITH = rf"{_CH}*\d{_CH}*"
_CHAIN = re.compile(rf"{_ARITH}(?:=\s*{_ARITH})+")
_NUMBER_ONLY = re.compile(rf"\s*\(?\s*({_NUM})\s*\)?\s*$")


def _value(side: str) -> float | None:
    """The value of one side of an equation, or None when it is not arithmetic."""
    expr = side.strip().replace(",", "").replace("×", "*").replace("÷", "/").replace("^", "**")
    if not expr:
        return None
    out = calculator(expr)
    if out.startswith("error"):
        return None
    try:
        return float(out)
    except ValueError:
        return None


def _matches(value: float, written: str) -> bool:
    """``value`` equals the number as written: exactly for an integer, else to its precision."""
    w = written.strip().replace(",", "")
    try:
        target = float(w)
    except ValueError:
        return False
    decimals = len(w.split(".", 1)[1]) if "." in w else 0
    if decimals == 0:
        return abs(value - target) <= 1e-9 * max(1.0, abs(target))
    return abs(value - target) <= 0.5 * 10.0 ** -decimals + 1e-12 * max(1.0, abs(target))


def equations(text: str) -> list[tuple[str, str]]:
    """(left, right) pairs of the equations written in ``text`` (chains split into links; an
    equation lies on one line)."""
    out = []
    for m in _CHAIN.finditer(text):
        sides = [s.strip().rstrip(".,").strip() for s in m.group(0).split("=")]
        start = m.start() + len(m.group(0)) - len(m.group(0).lstrip())
        before = text[start - 1] if start else ""
        # "3x + 2 = 11" reads as "+ 2 = 11" here: a run that follows a letter or starts with a
        # binary operator is a fragment of something non-arithmetic, not an equation.
        if before.isalnum() or before == "_" or re.match(r"[+*/^%×÷]", sides[0]):
            continue
        for a, b in zip(sides, sides[1:]):
            if a and b:
                out.append((a, b))
    return out


def check_trace(text: str) -> tuple[float, dict[str, Any]]:
    from areal_mega.reward.math import extract_answer

    reasons: list[str] = []
    num_true = 0
    eqs = equations(text)
    last_result: float | None = None
    for lhs, rhs in eqs:
        left, right = _value(lhs), _value(rhs)
        if left is None or right is None:
            reasons.append("false_equation")
            continue
        rhs_number = _NUMBER_ONLY.match(rhs)
        ok = _matches(left, rhs_number.group(1)) if rhs_number else abs(left - right) <= 1e-9 * max(1.0, abs(right))
        num_true += ok
        if not ok:
            reasons.append("false_equation")
        last_result = right
    if not eqs:
        reasons.append("no_equation")
    answer = extract_answer(text)
    answer_ok = None
    if answer is not None and last_result is not None:
        a = _value(answer)
        answer_ok = None if a is None else abs(a - last_result) <= 1e-9 * max(1.0, abs(last_result))
        if answer_ok is False:
            reasons.append("answer_mismatch")
    score = 1.0 if not reasons else 0.0
    info: dict[str, Any] = {"num_equations": len(eqs), "num_true": num_true, "answer_consistent": answer_ok}
    if reasons:
        info["reasons"] = reasons
    return score, info


class ConsistencyReward:
    async def evaluate(self, prompt: str, completion: str, data: dict[str, Any]) -> RewardResult:
        score, info = check_trace(completion)
        return RewardResult(score, info)

    async def __call__(self, prompt: str, completion: str, data: dict[str, Any]) -> float:
        return (await self.evaluate(prompt, completion, data)).score

    def close(self) -> None:
        pass

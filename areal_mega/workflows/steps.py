"""Step boundaries of a trajectory's generated tokens (process supervision).

    cfg = StepConfig(split="regex", delimiter=r"\\n+")
    ends, texts = split_steps(tokenizer, [turn1_ids, turn2_ids], cfg)

Rules "turns" | "regex" | "none"; a step never crosses a turn. Boundaries are token counts
(``Trajectory.step_ends``): a token that straddles a delimiter stays in the step it starts; at
most ``max_steps`` steps. The rules in full: docs/rollout.md ("Module notes").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

StepSplit = Literal["none", "regex", "turns"]


@dataclass
class StepConfig:
    """``workflow.steps``: how a completion is cut into steps (the unit of step rewards)."""

    split: StepSplit = "none"
    """"none": no steps (outcome reward only); "regex": cut each turn after every match of
    ``delimiter``; "turns": one step per generation turn (multi_turn attempts, tool / agent calls)."""
    delimiter: str = r"\n+"
    """split "regex": a Python regex (zero-width matches are ignored)."""
    max_steps: int = 32
    """Upper bound on steps per trajectory (each may cost a reward call): later boundaries are
    dropped, the remainder is the last step."""

    def validate(self) -> None:
        if self.split not in ("none", "regex", "turns"):
            raise ValueError(f"split: must be none, regex or turns, got {self.split!r}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.split == "regex":
            try:
                re.compile(self.delimiter)
            except re.error as e:
                raise ValueError(f"delimiter: {self.delimiter!r} is not a valid regex ({e})") from None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _cut_tokens(tokenizer: Any, ids: Sequence[int], char_cut: int) -> int:
    """The fewest tokens whose decoded text has at least ``char_cut`` characters."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_decode(tokenizer, ids[:mid])) >= char_cut:
            hi = mid
        else:
            lo = mid + 1
    return lo


def split_turn(tokenizer: Any, ids: Sequence[int], delimiter: re.Pattern) -> list[int]:
    """Step ends (token counts, increasing, last = len(ids)) of one turn cut by ``delimiter``."""
    if not ids:
        return []
    text = _decode(tokenizer, ids)
    ends: list[int] = []
    for m in delimiter.finditer(text):
        if m.end() == m.start() or m.end() >= len(text):
            continue
        k = _cut_tokens(tokenizer, ids, m.end())
        if k > (ends[-1] if ends else 0) and k < len(ids):
            ends.append(k)
    return ends + [len(ids)]


def split_steps(tokenizer: Any, turns: Sequence[Sequence[int]], cfg: StepConfig) -> tuple[list[int], list[str]]:
    """(step ends in generated-token counts over all turns, each step's decoded text); ([], [])
    for split "none" or no generated tokens."""
    if cfg.split == "none":
        return [], []
    regex = re.compile(cfg.delimiter) if cfg.split == "regex" else None
    ends: list[int] = []
    flat: list[int] = []
    for ids in turns:
        if not ids:
            continue
        local = split_turn(tokenizer, ids, regex) if regex is not None else [len(ids)]
        ends += [len(flat) + e for e in local]
        flat += list(ids)
    if len(ends) > cfg.max_steps:
        ends = ends[: cfg.max_steps - 1] + [ends[-1]]
    texts = [_decode(tokenizer, flat[a:b]) for a, b in zip([0, *ends], ends)]
    return ends, texts

"""The prompt-source contract: where training prompts come from, resumable by position.

A prompt-source kind (``data.kind``: a built-in or ``package.module:Name``) is called as
``Kind(cfg: DatasetConfig, tokenizer) -> PromptSource``; its own typed options are
``cfg.options``. Built-in: ``areal_mega/data/dataset.py`` (files, reasoning-gym); docs/extending.md.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["PromptSource"]


@runtime_checkable
class PromptSource(Protocol):
    """An endless stream of samples. A sample is a dict with at least ``id`` and ``prompt`` (the
    text the workflow tokenises) plus what the reward reads (``answer``, ``tests``, ...).

    ``next()`` returns ``(position, sample)``; a position ``(epoch, index)`` names the sample
    for good: ``state_dict(in_flight)`` (the positions drawn but not yet trained) and
    ``load_state_dict`` must give those back first after a resume, then continue where the
    stream stood -- so every prompt of an epoch is trained once across restarts."""

    epoch: int

    def next(self) -> tuple[tuple[int, int], dict[str, Any]]: ...

    def state_dict(self, in_flight: list[tuple[int, int]]) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def heldout(self) -> list[dict[str, Any]]:
        """Samples never trained on, for evaluation ([] if none)."""

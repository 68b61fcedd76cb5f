"""Episode failures are data: why an episode failed, and when failures are too many to go on.

:func:`failure_reason` maps an exception to one of a fixed set of reasons (metric names
``rollout/failed/<reason>``: context_overflow, server_4xx, inference, timeout, reward_exception,
agent_exception, error); :class:`FailureBudget` stops the run only when the recent failure rate
exceeds ``rollout.max_failure_rate``. Retries, skips, what each reason means: docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import collections

REASONS = ("context_overflow", "server_4xx", "inference", "timeout", "reward_exception", "agent_exception", "error")

# SGLang 0.5.x's wording for a prompt over the context length (tokenizer_manager).
_OVERFLOW_MARKERS = ("exceeds the maximum allowed length", "maximum context length", "longer than the model")


class EpisodeFailure(RuntimeError):
    """An episode failed for a known ``reason`` (one of :data:`REASONS`); raised ``from`` the
    original exception."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def is_context_overflow(exc: BaseException) -> bool:
    """A server's 4xx that says the prompt is longer than the model's context."""
    status = getattr(exc, "status", None)
    body = str(getattr(exc, "body", "") or exc).lower()
    return isinstance(status, int) and 400 <= status < 500 and any(m in body for m in _OVERFLOW_MARKERS)


def failure_reason(exc: BaseException) -> str:
    """The reason an episode failed with ``exc`` (module docstring)."""
    from areal_mega.inference.client import InferenceError, InferenceServerError

    for e in _chain(exc):
        if isinstance(e, EpisodeFailure):
            return e.reason
        if isinstance(e, InferenceServerError) and isinstance(e.status, int) and 400 <= e.status < 500:
            return "context_overflow" if is_context_overflow(e) else "server_4xx"
        if isinstance(e, InferenceError):
            return "inference"
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return "timeout"
    return "error"


def _chain(exc: BaseException):
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


class FailureBudget:
    """Over the last ``window`` finished episodes (accepted, rejected or failed), at most
    ``max_rate * window`` may have failed; :meth:`exceeded` turns True when one more did.

    Counting failures (not a ratio of what finished so far) keeps a few failures among the
    first episodes from ending a run: the run stops after ``floor(max_rate * window) + 1``
    failures within ``window`` episodes, never earlier. ``max_rate`` 1.0 never stops."""

    def __init__(self, max_rate: float, window: int) -> None:
        self.max_rate = max_rate
        self.window = window
        self._recent: collections.deque[bool] = collections.deque(maxlen=window)
        self.num_failed = 0

    def record(self, failed: bool) -> None:
        self._recent.append(failed)
        self.num_failed += failed

    @property
    def recent_failures(self) -> int:
        return sum(self._recent)

    def exceeded(self) -> bool:
        return self.max_rate < 1.0 and self.recent_failures > self.max_rate * self.window

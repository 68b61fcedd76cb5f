"""Asynchronous rollout controller: runs a workflow over a dataset and feeds the trainer.

    dataset ──> producer ──admit? (StalenessManager, max_concurrent)──> episode tasks
        ──> workflow.arun_episode(engine, data) ──> accept / reject (filter, None) ──> ready pool
    trainer: get_batch() <── oldest-admitted first <── ready pool
             set_version(v) after each weight sync (wakes the producer: capacity grows)

Invariant: a batch formed at version v holds only tokens of version >= v - max_staleness;
``get_batch`` checks every token (:class:`StalenessViolation`). Failed episodes are retried or
skipped, never lost. Why it holds, failures: docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import collections
import json
import concurrent.futures
import logging
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TextIO

import numpy as np

from areal_mega.api.data import PromptSource
from areal_mega.api.engine import InferenceEngine
from areal_mega.api.workflow import RolloutBatch, RolloutWorkflow, Trajectory
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.failures import FailureBudget, failure_reason
from areal_mega.rollout.journal import EpisodeJournal
from areal_mega.rollout.staleness import PolicyVersion, StalenessManager, can_form_batch, take_oldest


logger = logging.getLogger(__name__)


class StalenessViolation(RuntimeError):
    """A batch would contain a token older than max_staleness versions (a bug, never expected)."""


@dataclass
class _Ready:
    seq: int
    admit_version: int
    group: list[Trajectory]
    pos: tuple[int, int] | None = None
    prompt_id: Any = None
    saved: dict[str, Any] | None = None  # what a checkpoint saves of it (save_in_flight)


def zero_variance(group: list[Trajectory]) -> bool:
    """True when every trajectory of the group has the same reward and the same step rewards
    (no GRPO signal, outcome or process)."""
    return len({(t.reward, tuple(t.step_rewards)) for t in group}) <= 1


def _jsonable(data: Any) -> bool:
    try:
        json.dumps(data)
        return True
    except (TypeError, ValueError):
        return False


class RolloutController:
    """Runs ``workflow`` over ``dataset`` (cycled forever, epoch after epoch) on ``engine``.

    ``dataset`` is a :class:`~areal_mega.api.data.PromptSource` (the trainer's: every episode then
    carries its prompt's position, and :meth:`in_flight_positions` says which prompts a
    checkpoint must give back) or any re-iterable of samples.

    ``await astart()``, ``await aget_batch()``, ``await aclose()`` in one event loop (the rollout
    service's, in its own thread); ``set_version`` / ``pause`` / ``resume`` are safe to call
    from any thread.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        workflow: RolloutWorkflow,
        dataset: Iterable[dict[str, Any]],
        config: RolloutConfig,
        *,
        staleness: StalenessManager | None = None,
        version: int | PolicyVersion = 0,
        accept: Callable[[list[Trajectory]], bool] | None = None,
        progress_stream: TextIO | None = None,
        keep_trained: bool = False,
    ) -> None:
        config.validate()
        self.engine = engine
        self.workflow = workflow
        self.dataset = dataset
        self.config = config
        self.staleness = staleness or StalenessManager(
            config.batch_size, config.max_staleness, config.max_concurrent, version=version
        )
        if accept is None and config.filter_zero_variance:
            accept = lambda g: not zero_variance(g)  # noqa: E731
        self._accept = accept
        self._progress = progress_stream if progress_stream is not None else sys.stderr
        self._data_iter: Iterator[dict[str, Any]] | None = None
        self.epoch = 0
        self._seq = 0
        self._running: dict[int, int] = {}  # seq -> admit version
        # Time with >= 1 episode in flight since the last batch (rollout/gen_inflight_s): what the
        # throughput simulator is calibrated on, per run (areal_mega/simulator/calibrate.py).
        self._inflight_since: float | None = None
        self._inflight_s = 0.0
        self._positions: dict[int, tuple[int, int] | None] = {}  # seq -> prompt position (running)
        self._ready: list[_Ready] = []
        self._tasks: set[asyncio.Task] = set()
        self._waiters: list[asyncio.Future] = []
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self._consecutive_rejects = 0
        self._failures = FailureBudget(config.max_failure_rate, config.failure_window)
        self._failed_since_batch: collections.Counter[str] = collections.Counter()
        self._retries_since_batch = 0
        self._attempt: dict[int, int] = {}  # seq -> failed attempts of its prompt so far (running)
        self._retry: collections.deque[tuple[int, tuple[int, int] | None, dict[str, Any], int]] = collections.deque()
        self._skipped: list[tuple[int, dict[str, Any]]] = []  # (seq, record) since the last batch
        self._fatal: str | None = None  # the failure budget's message, once exceeded
        self._rejected_since_batch = 0
        self._accepted_since_batch = 0
        self._last_progress = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._producer: asyncio.Task | None = None
        self._loop_thread_id: int | None = None
        # Checkpointed episodes (save_in_flight): seq -> the episode's record while it runs (its
        # journal, uid, data); resumed ones wait in _resumed for admission before anything new.
        self._episodes: dict[int, dict[str, Any]] = {}
        self._resumed: collections.deque[dict[str, Any]] = collections.deque()
        # keep_trained (trainer.rollout_snapshot_every): the episodes handed out in batches since
        # the last learner checkpoint, (seq, position, saved record or None if not saveable) --
        # a run resumed from that checkpoint has not trained them.
        self._keep_trained = keep_trained
        self._trained: list[tuple[int, tuple[int, int] | None, dict[str, Any] | None]] = []
        self.resume_counts: collections.Counter[str] = collections.Counter()
        """Totals since the start: ``restored`` episodes, ``replayed_tokens`` (generated before the
        checkpoint, trained without generating them again), ``continued_calls``, ``restarted``
        (workflow not replayable), ``diverged``, ``dropped_stale`` (older than max_staleness
        allows at resume: prompt generated again), ``dropped_newer`` (admitted after the resumed
        checkpoint, in a snapshot: prompt generated again), ``cut_tokens`` (newer than the resumed
        checkpoint: generated again), ``lost_tokens`` (saved, never trained)."""
        self._resume_since_batch: collections.Counter[str] = collections.Counter()

    # ---- lifecycle -------------------------------------------------------------------

    async def astart(self) -> None:
        """Start the producer in the running loop."""
        assert self._producer is None, "controller already started"
        self._loop = asyncio.get_running_loop()
        self._loop_thread_id = threading.get_ident()
        self._producer = asyncio.create_task(self._produce())

    async def aclose(self) -> None:
        self._closed = True
        if self._last_progress:  # end the in-place status line
            self._progress.write("\n")
            self._progress.flush()
        for t in [self._producer, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*[t for t in [self._producer, *self._tasks] if t is not None], return_exceptions=True)
        self._notify()

    # ---- trainer-facing --------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """Call after each weight sync: new episodes are admitted at this version."""
        self.staleness.set_version(version)
        self._notify_threadsafe()

    def pause(self) -> None:
        """Stop admitting new episodes (in-flight ones continue; the engine pauses those)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._notify_threadsafe()

    async def aget_batch(self, num_episodes: int | None = None) -> RolloutBatch:
        """Wait for ``num_episodes`` (default batch_size) accepted episodes and form a batch."""
        n = num_episodes or self.config.batch_size
        timeout = self.config.batch_timeout_s or None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_if_failed()
            version = self.staleness.version
            if self._can_form(n, version):
                break
            await self._wait(None if deadline is None else deadline - time.monotonic())
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rollout.batch_timeout_s: no batch of {n} episodes after {timeout} s "
                    f"({len(self._ready)} ready, {len(self._running)} running)"
                )
        taken, self._ready = take_oldest(self._ready, n, seq=lambda r: r.seq)
        batch = self._form_batch(taken, version)
        batch.positions = [r.pos for r in taken]
        batch.prompt_ids = [r.prompt_id for r in taken]
        batch.episode_ids = [r.saved["uid"] if r.saved else None for r in taken]
        if self._keep_trained:
            self._trained += [(r.seq, r.pos, self._record(r.seq, r.saved) if self._saveable(r.saved) else None)
                              for r in taken]
            self._trained += [(seq, tuple(rec["pos"]) if rec["pos"] is not None else None, None)
                              for seq, rec in self._skipped]  # given back: tried again on resume
        batch.skipped, self._skipped = [rec for _, rec in self._skipped], []
        self._notify()
        return batch

    def in_flight_positions(self, since_checkpoint: bool = False) -> list[tuple[int, int]]:
        """Prompt positions drawn but not yet handed out in a batch (running or ready episodes,
        unless ``save_in_flight``: then ``checkpoint_state`` saves those), oldest admission first:
        what a checkpoint gives back to the stream. ``since_checkpoint`` (a snapshot): also those
        handed out since the last learner checkpoint that the snapshot cannot save whole. Loop
        thread only."""
        held = [(seq, pos) for seq, pos, rec in self._trained if rec is None] if since_checkpoint else []
        held += [(seq, pos) for seq, pos in self._positions.items() if not self._saveable(self._episodes.get(seq))]
        held += [(r.seq, r.pos) for r in self._ready if not self._saveable(r.saved)]
        held += [(seq, pos) for seq, pos, _, _ in self._retry]
        held += [(seq, tuple(rec["pos"]) if rec["pos"] is not None else None) for seq, rec in self._skipped]
        return [pos for _, pos in sorted(held) if pos is not None]

    def checkpoint_state(self, since_checkpoint: bool = False) -> dict[str, Any]:
        """The episodes generated and not yet trained (``save_in_flight``), oldest admission
        first: finished ones (ready) and running ones with their calls so far (``EpisodeJournal``;
        take it with the pool paused in abort mode so in-flight calls hold all their tokens).
        ``since_checkpoint`` (a snapshot between learner checkpoints, ``keep_trained``): also the
        episodes handed out since the last learner checkpoint; without it (a learner checkpoint)
        that checkpoint becomes the one they are counted from. JSON-able. Loop thread only."""
        if not self.config.save_in_flight:
            return {"episodes": []}
        eps = [self._record(seq, e["saved"]) for seq, e in self._episodes.items() if self._saveable(e)]
        eps += [self._record(r.seq, r.saved) for r in self._ready if self._saveable(r.saved)]
        eps += [e for e in self._resumed]  # restored, not yet admitted again
        if since_checkpoint:
            eps += [rec for _, _, rec in self._trained if rec is not None]
        else:
            self._trained = []
        return {"version": self.staleness.version, "episodes": sorted(eps, key=lambda e: e["seq"])}

    @staticmethod
    def _record(seq: int, saved: dict[str, Any]) -> dict[str, Any]:
        """An episode as a checkpoint saves it: its record and its calls so far (JSON-able)."""
        rec = {k: v for k, v in saved.items() if k not in ("journal", "jsonable")}
        return {**rec, "seq": seq, "calls": saved["journal"].snapshot()}

    @staticmethod
    def _saveable(ep: dict[str, Any] | None) -> bool:
        """Saved whole by a checkpoint: ``save_in_flight`` and a sample that JSON can hold (one that
        cannot, e.g. with arrays, is given back to the prompt stream and generated again)."""
        return ep is not None and (ep.get("saved") or ep).get("jsonable", False)

    def restore(self, state: dict[str, Any] | None) -> None:
        """Before ``astart``: the episodes ``checkpoint_state`` saved run first, continued from
        their calls. What the resumed weights never sampled (a snapshot taken after the resumed
        checkpoint) goes: an episode admitted after the resumed version is dropped and its prompt
        runs again (``dropped_newer``); each call is cut at its first token of a newer version
        (``cut_tokens``: the replay goes live there). An episode admitted before ``version -
        max_staleness`` (its tokens could not be trained within the bound) is dropped and its
        prompt runs again (``dropped_stale``); one of a workflow that is not ``replayable`` (or
        with MoE routes captured) restarts."""
        eps = (state or {}).get("episodes") or []
        version = self.staleness.version
        oldest_allowed = version - self.config.max_staleness
        for e in sorted(eps, key=lambda e: e["seq"]):
            vers = [v for c in e["calls"] for v in c["vers"]]
            if e["admit_version"] <= version:
                e = {**e, "calls": _cut_calls(e["calls"], version)}
                cut = len(vers) - sum(len(c["vers"]) for c in e["calls"])
                vers = [v for c in e["calls"] for v in c["vers"]]
                if cut:
                    self.resume_counts["cut_tokens"] += cut
                    self.resume_counts["lost_tokens"] += cut
            if e["admit_version"] < oldest_allowed or e["admit_version"] > version:
                self.resume_counts["dropped_stale" if e["admit_version"] < oldest_allowed else "dropped_newer"] += 1
                self.resume_counts["lost_tokens"] += len(vers)
                pos = tuple(e["pos"]) if e["pos"] is not None else None
                self._retry.append((e["seq"], pos, e["data"], e["attempt"]))
                continue
            # Saved calls carry no MoE routes (routing replay): such episodes restart too.
            if not getattr(self.workflow, "replayable", True) or getattr(self.engine, "capture_routes", False):
                self.resume_counts["restarted"] += 1
                self.resume_counts["lost_tokens"] += len(vers)
                e = {**e, "calls": []}
            self._resumed.append(e)
            self.resume_counts["restored"] += 1
        self._resume_since_batch.update(self.resume_counts)

    # ---- internals -------------------------------------------------------------------

    def _can_form(self, n: int, version: int) -> bool:
        """True when taking the ``n`` oldest-admitted ready episodes keeps the bound reachable
        (the rule and its argument: :func:`areal_mega.rollout.staleness.can_form_batch`)."""
        self._ready.sort(key=lambda r: r.seq)
        return can_form_batch(n, version, self.config.max_staleness, self.staleness.batch_size,
                              [r.admit_version for r in self._ready], list(self._running.values()))

    def _form_batch(self, taken: list[_Ready], version: int) -> RolloutBatch:
        oldest_allowed = version - self.config.max_staleness
        counts: collections.Counter[int] = collections.Counter()
        rewards, step_rewards = [], []
        reasons: collections.Counter[str] = collections.Counter()  # why rewards failed (reward.evaluate's info)
        for r in taken:
            for t in r.group:
                rewards.append(t.reward)
                step_rewards += t.step_rewards or ()
                reasons.update((t.info.get("reward_info") or {}).get("reasons", ()))
                # numpy: this runs over every generated token of the batch (millions at scale)
                gen = np.asarray(t.versions, dtype=np.int64)[np.asarray(t.loss_mask, dtype=bool)]
                if gen.size == 0:
                    continue
                oldest = int(gen.min())
                if oldest < oldest_allowed:
                    raise StalenessViolation(
                        f"episode #{r.seq} (admitted at version {r.admit_version}) has a token of "
                        f"version {oldest} in a batch trained at version {version}: older than "
                        f"max_staleness={self.config.max_staleness}"
                    )
                vals, nums = np.unique(version - gen, return_counts=True)
                counts.update(dict(zip(vals.tolist(), nums.tolist())))
        num_tokens = sum(counts.values())
        stats = {
            "rollout/reward_mean": sum(rewards) / max(len(rewards), 1),
            "rollout/num_trajectories": float(len(rewards)),
            "rollout/num_generated_tokens": float(num_tokens),
            "rollout/rejected_episodes": float(self._rejected_since_batch),
            "rollout/accepted_episodes": float(self._accepted_since_batch),
            "rollout/epoch": float(self.epoch),
            "rollout/gen_inflight_s": self._take_inflight_s(),
            "rollout/failed_episodes": float(sum(self._failed_since_batch.values())),
            "rollout/retried_episodes": float(self._retries_since_batch),
            "rollout/skipped_prompts": float(len(self._skipped)),
            **{f"rollout/failed/{k}": float(v) for k, v in sorted(self._failed_since_batch.items())},
            "staleness/mean": sum(s * c for s, c in counts.items()) / max(num_tokens, 1),
            "staleness/max": float(max(counts, default=0)),
            "staleness/frac_stale_tokens": sum(c for s, c in counts.items() if s > 0) / max(num_tokens, 1),
            **{f"reward/reason/{k}": float(v) for k, v in sorted(reasons.items())},
            **{f"rollout/resume/{k}": float(v) for k, v in sorted(self._resume_since_batch.items())},
        }
        if step_rewards:  # process rewards: every step's reward pooled over the batch
            stats["rollout/step_reward_mean"] = sum(step_rewards) / len(step_rewards)
            stats["rollout/steps_per_trajectory"] = len(step_rewards) / max(len(rewards), 1)
        self._rejected_since_batch = 0
        self._accepted_since_batch = 0
        self._failed_since_batch.clear()
        self._retries_since_batch = 0
        self._resume_since_batch.clear()
        return RolloutBatch([r.group for r in taken], version, stats, dict(counts))

    def _episode_left(self, seq: int) -> None:
        self._episodes.pop(seq, None)
        self._running.pop(seq, None)
        self._positions.pop(seq, None)
        if not self._running and self._inflight_since is not None:
            self._inflight_s += time.monotonic() - self._inflight_since
            self._inflight_since = None

    def _take_inflight_s(self) -> float:
        now = time.monotonic()
        total = self._inflight_s + (now - self._inflight_since if self._inflight_since is not None else 0.0)
        self._inflight_s = 0.0
        if self._inflight_since is not None:
            self._inflight_since = now
        return total

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        if self._error is not None:
            raise RuntimeError(f"a rollout episode failed: {self._error!r}") from self._error
        if self._consecutive_rejects >= self.config.max_consecutive_rejects:
            raise RuntimeError(
                f"rollout.max_consecutive_rejects: {self._consecutive_rejects} episodes in a row were "
                "rejected (all rewards equal under filter_zero_variance, or the workflow returns None)"
            )
        if self._closed:
            raise RuntimeError("rollout controller is closed")

    def _next_data(self) -> tuple[tuple[int, int] | None, dict[str, Any]]:
        if isinstance(self.dataset, PromptSource):
            pos, data = self.dataset.next()
            self.epoch = self.dataset.epoch
            return pos, data
        for _ in range(2):
            if self._data_iter is None:
                self._data_iter = iter(self.dataset)
            try:
                return None, next(self._data_iter)
            except StopIteration:
                self._data_iter = None
                self.epoch += 1
        raise ValueError("rollout dataset is empty")

    async def _produce(self) -> None:
        try:
            while not self._closed:
                if self._paused or self._error is not None or self._fatal is not None:
                    await self._wait(None)
                    continue
                saved = None
                if self._resumed:  # a checkpoint's episode: admitted before it, at its own version
                    if not self.staleness.admit_resumed():
                        await self._wait(None)
                        continue
                    saved = self._resumed.popleft()
                    admit_version = saved["admit_version"]
                else:
                    admit_version = self.staleness.try_admit()
                if admit_version is None:
                    await self._wait(None)
                    continue
                attempt = 0
                if saved is not None:
                    pos = tuple(saved["pos"]) if saved["pos"] is not None else None
                    data, attempt = saved["data"], saved["attempt"]
                elif self._retry:  # a failed prompt runs again before new ones (a new seq: admission order)
                    _, pos, data, attempt = self._retry.popleft()
                else:
                    try:
                        pos, data = self._next_data()
                    except BaseException:
                        self.staleness.on_rejected()
                        raise
                seq = self._seq
                self._seq += 1
                self._attempt[seq] = attempt
                self._running[seq] = admit_version
                self._positions[seq] = pos
                if self.config.save_in_flight:
                    journal = EpisodeJournal(self.engine, saved["calls"] if saved else None)
                    self._episodes[seq] = {"journal": journal, "saved": {
                        "uid": saved["uid"] if saved else uuid.uuid4().hex[:16], "admit_version": admit_version,
                        "pos": list(pos) if pos is not None else None, "data": data, "attempt": attempt,
                        "journal": journal, "jsonable": _jsonable(data)}}
                if self._inflight_since is None:
                    self._inflight_since = time.monotonic()
                task = asyncio.create_task(self._run_episode(seq, admit_version, pos, data))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                self._show_progress()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the trainer by get_batch
            self._error = e
            self._notify()

    async def _run_episode(self, seq: int, admit_version: int, pos: tuple[int, int] | None,
                           data: dict[str, Any]) -> None:
        ep = self._episodes.get(seq)
        journal = ep["journal"] if ep else None
        try:
            group = await self.workflow.arun_episode(journal or self.engine, data)
            keep = bool(group) and (self._accept is None or self._accept(group))
            if journal is not None:
                self._count_replay(journal, group if keep else None)
        except asyncio.CancelledError:
            self._episode_left(seq)
            self._attempt.pop(seq, None)
            raise
        except Exception as e:
            self._episode_left(seq)
            self.staleness.on_rejected()
            self._on_failure(seq, pos, data, e)
            self._notify()
            return
        except BaseException as e:
            self._episode_left(seq)
            self.staleness.on_rejected()
            self._error = e
            self._notify()
            return
        self._episode_left(seq)
        self._attempt.pop(seq, None)
        self._failures.record(False)
        if keep:
            assert group is not None
            self.staleness.on_accepted()
            self._ready.append(_Ready(seq, admit_version, group, pos, data.get("id"),
                                      saved=ep["saved"] if ep else None))
            self._consecutive_rejects = 0
            self._accepted_since_batch += 1
        else:
            self.staleness.on_rejected()
            self._consecutive_rejects += 1
            self._rejected_since_batch += 1
        self._show_progress()
        self._notify()

    def _count_replay(self, journal: EpisodeJournal, group: list[Trajectory] | None) -> None:
        """A resumed episode's outcome: its saved tokens trained (in an accepted group) or not."""
        if not journal.replayed_tokens and not journal.diverged:
            return
        c = collections.Counter({"replayed_tokens" if group else "lost_tokens": journal.replayed_tokens,
                                 "continued_calls": journal.continued_calls, "diverged": int(journal.diverged),
                                 "lost_tokens": journal.unused_tokens})
        c = +c
        self.resume_counts.update(c)
        self._resume_since_batch.update(c)

    def _on_failure(self, seq: int, pos: tuple[int, int] | None, data: dict[str, Any], exc: Exception) -> None:
        """Count a failed episode by reason; run its prompt again or skip it; stop the run only
        when the failure budget (``rollout.max_failure_rate``) is exceeded."""
        reason = failure_reason(exc)
        attempt = self._attempt.pop(seq, 0) + 1
        self._failed_since_batch[reason] += 1
        self._failures.record(True)
        retry = attempt <= self.config.max_episode_retries
        logger.warning("rollout: episode of prompt %r failed (%s, attempt %d): %s: %s; %s", data.get("id"), reason,
                       attempt, type(exc).__name__, str(exc)[:300], "retrying" if retry else "prompt skipped")
        if retry:
            self._retry.append((seq, pos, data, attempt))
            self._retries_since_batch += 1
        else:
            self._skipped.append((seq, {"pos": list(pos) if pos is not None else None, "id": data.get("id"),
                                        "reason": reason, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}))
        if self._fatal is None and self._failures.exceeded():
            cfg = self.config
            self._fatal = (
                f"rollout.max_failure_rate: {self._failures.recent_failures} of the last {cfg.failure_window} "
                f"episodes failed (more than max_failure_rate={cfg.max_failure_rate:g} x failure_window="
                f"{cfg.failure_window}); last: {reason}: {type(exc).__name__}: {str(exc)[:300]}")

    async def _wait(self, timeout: float | None) -> None:
        """Sleep until ``_notify`` (any state change) or ``timeout``. Loop thread only: the
        caller checks its condition and registers the waiter with no await in between."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if timeout is None:
                await fut
            else:
                await asyncio.wait_for(fut, max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _notify_threadsafe(self) -> None:
        loop = self._loop
        if loop is None:
            return
        # The trainer calls set_version / resume from its own thread while the controller's
        # loop runs elsewhere (start(), or a caller's driver thread): futures are not thread-safe.
        if threading.get_ident() != self._loop_thread_id:
            loop.call_soon_threadsafe(self._notify)
        else:
            self._notify()

    def _show_progress(self) -> None:
        """One status line, rewritten in place, only on interactive terminals (throttled)."""
        if not self.config.show_progress:
            return
        isatty = getattr(self._progress, "isatty", None)
        if isatty is None or not isatty():
            return
        now = time.monotonic()
        if now - self._last_progress < 0.5:
            return
        self._last_progress = now
        s = self.staleness.snapshot()
        self._progress.write(
            f"\r[rollout] version {s['version']} running {s['running']} ready {len(self._ready)} "
            f"accepted {s['accepted']} rejected {s['rejected']} epoch {self.epoch}   "
        )
        self._progress.flush()

    def snapshot(self) -> dict[str, int]:
        return {**self.staleness.snapshot(), "ready": len(self._ready), "epoch": self.epoch}


def _cut_calls(calls: list[dict[str, Any]], version: int) -> list[dict[str, Any]]:
    """Each saved call up to its first token newer than ``version``: it becomes a call in flight
    holding the tokens before it (continued on resume); one whose first token is newer is dropped.
    Per call, not per episode: an episode's parallel calls (a group's samples) keep their older
    tokens when a sibling crossed the sync. A call that read a cut call's answer started after
    that newer token, so (versions are stamped in time order) all its tokens are newer: dropped."""
    out = []
    for c in calls:
        j = next((i for i, v in enumerate(c["vers"]) if v > version), None)
        if j is None:
            out.append(c)
        elif j:
            out.append({**c, "ids": c["ids"][:j], "lps": c["lps"][:j], "vers": c["vers"][:j], "finish": None})
    return out


"""The generation side of the trainer (learner rank 0): rollout batches out, weight updates in.

    rank 0 main thread (trainer)                service thread (one asyncio loop)
    service.next_batch()  ──── aget_batch ───>  RolloutController ── workflow.arun_episode ──> InferencePool
    service.begin_update() ─── pause, targets   (admission by the staleness bound; never waits for training)
    service.end_update(v, synced) ─ version, release parked, resume
    service.evaluate(...) ──── coroutine ────>  evaluate_items: greedy episodes over a held-out set

Owns the one policy-version counter and which servers take part; a server back with older
weights is parked until a sync includes it. The pool and the controller live on the service's
loop only. Details: docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Awaitable, Iterable, Sequence, TypeVar

from areal_mega.api.data import PromptSource
from areal_mega.api.generation import GenerationService, PolicyVersion
from areal_mega.api.workflow import RolloutWorkflow
from areal_mega.evaluation import EvalSpec, evaluate_items
from areal_mega.inference.client import InferencePool, ServerHandle
from areal_mega.inference.config import InferenceConfig
from areal_mega.inference.server import ServedLora
from areal_mega.rollout.config import RolloutConfig
from areal_mega.rollout.controller import RolloutBatch, RolloutController

T = TypeVar("T")
logger = logging.getLogger(__name__)

__all__ = ["RolloutService"]


class RolloutService(GenerationService):
    """Launches (or connects to) the inference pool on its own loop thread; ``start`` begins
    generating. ``server_wait_s``: how long ``begin_update`` waits for a live server
    (``weight_sync.server_wait_s``)."""

    def __init__(self, inference: InferenceConfig, *, server_wait_s: float, capture_routes: bool = False,
                 lora: ServedLora | None = None) -> None:
        self._poll_s = inference.client.health_check_interval_s
        self._server_wait_s = server_wait_s
        self._version = PolicyVersion(inference.client.initial_version)
        self._parked: dict[str, asyncio.Event] = {}  # server URL -> set once a sync included it
        self._batch_task: asyncio.Future | None = None  # the batch next_batch is waiting for
        self._updating = False
        self.controller: RolloutController | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-service", daemon=True)
        self._thread.start()
        try:
            self.pool: InferencePool = self._run(InferencePool.launch(inference, version=self._version,
                                                                      resync=self._park_until_synced,
                                                                      capture_routes=capture_routes, lora=lora))
        except BaseException:
            self._stop_loop()
            raise

    # -- GenerationService ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version.get()

    def start(self, workflow: RolloutWorkflow, dataset: Iterable[dict[str, Any]], cfg: RolloutConfig,
              restore: dict[str, Any] | None = None, keep_trained: bool = False) -> None:
        """Begin generating at the current version (which the servers hold); ``restore``: a
        checkpoint's ``checkpoint_state()["rollout"]``, whose episodes continue first;
        ``keep_trained``: snapshots between learner checkpoints will be asked for."""

        async def start() -> RolloutController:
            c = RolloutController(self.pool, workflow, dataset, cfg, version=self._version, keep_trained=keep_trained)
            c.restore(restore)
            await c.astart()
            return c

        self.controller = self._run(start())

    def next_batch(self) -> RolloutBatch | None:
        assert self.controller is not None, "start() first"
        controller = self.controller

        async def get() -> RolloutBatch | None:
            if self._batch_task is None:
                self._batch_task = asyncio.ensure_future(controller.aget_batch())
            while not self._batch_task.done():
                if self._parked and not self.pool.healthy_servers():
                    return None  # the batch being formed is kept for the next call
                await asyncio.wait({self._batch_task}, timeout=self._poll_s)
            task, self._batch_task = self._batch_task, None
            return task.result()

        return self._run(get())

    def begin_update(self) -> list[str]:
        """Pause through the pool (in ``client.pause_mode``: the pool then knows its servers are
        paused, not dead), then a fresh health pass: servers in rotation plus parked ones; dead or
        still-restarting ones are left out. With none live, wait up to ``server_wait_s`` for one.
        Called again before ``end_update`` (a retry), it only re-takes the targets."""
        if not self._updating:
            self._run(self.pool.pause())
            self._updating = True

        async def targets() -> list[str]:
            deadline = time.monotonic() + self._server_wait_s
            warned = False
            while True:
                await self.pool.check_health()  # a server that died since the last pass drops out now
                live = {h.url for h in self.pool.healthy_servers()} | set(self._parked)
                urls = [u for u in self.pool.urls if u in live]
                if urls or time.monotonic() >= deadline:
                    return urls
                if not warned:
                    logger.warning("weight sync: no live inference server; waiting up to %g s for one",
                                   self._server_wait_s)
                    warned = True
                await asyncio.sleep(self._poll_s)

        return self._run(targets())

    def end_update(self, version: int | None, synced: Sequence[str] = ()) -> None:
        """``version`` None: the sync failed; generation resumes, nothing else moves. A server
        parked after the targets were taken stays parked until the next sync includes it."""
        try:
            if version is not None:
                if self.controller is not None:
                    self.controller.set_version(version)  # writes the shared counter, wakes admission
                else:
                    self._version.set(version)

                async def release() -> None:
                    for url in synced:
                        if url in self._parked:
                            self._parked.pop(url).set()

                self._run(release())
        finally:
            if self._updating:
                self._updating = False
                self._run(self.pool.resume())

    def close(self) -> None:
        async def shutdown() -> None:
            if self._batch_task is not None:
                self._batch_task.cancel()
            if self.controller is not None:
                await self.controller.aclose()
            await self.pool.close()

        try:
            self._run(shutdown(), timeout=180)
        finally:
            self._stop_loop()

    # -- what the trainer reads besides batches ----------------------------------------------------
    def checkpoint_state(self, since_checkpoint: bool = False) -> dict[str, Any]:
        """What a checkpoint saves of the generation side, taken in one go on the controller's
        loop (the only thread that draws prompts: none is drawn between the reads, it would be lost
        on resume): ``prompts`` (the prompt stream's ``state_dict`` with the prompts drawn and not
        yet in a batch given back, less the episodes saved whole) and ``rollout`` (the
        controller's ``checkpoint_state``: generated, not yet trained). In-flight requests are
        aborted first, the way a weight sync in ``client.pause_mode`` abort pauses them (whatever
        the mode set), so each holds every token it has; they continue once the state is taken.
        ``since_checkpoint``: a snapshot between learner checkpoints (the controller's
        ``checkpoint_state``), which also holds what was handed out since the last one."""
        assert self.controller is not None, "start() first"
        c = self.controller

        def prompts() -> dict[str, Any] | None:  # None: a plain iterable, no position to keep
            return c.dataset.state_dict(c.in_flight_positions(since_checkpoint)) if isinstance(c.dataset, PromptSource) else None

        async def get() -> dict[str, Any]:
            if not c.config.save_in_flight:
                return {"prompts": prompts()}
            await self.pool.pause(mode="abort")
            try:
                await self.pool.settle()
                return {"prompts": prompts(), "rollout": c.checkpoint_state(since_checkpoint)}
            finally:
                await self.pool.resume()

        return self._run(get())

    def stats(self) -> dict[str, float]:
        p = self.pool
        # servers_marked_down counts every exit from the rotation since the start: one that is
        # out and back inside a step never shows in servers_in_rotation, sampled at the step's end
        return {"inference/servers_in_rotation": float(len(p.healthy_servers())),
                "inference/servers_marked_down": float(sum(h.num_failures for h in p.servers)),
                "inference/failovers": float(p.num_failovers), "inference/interruptions": float(p.num_interruptions)}

    def evaluate(self, greedy: RolloutWorkflow, dataset: list[dict[str, Any]], spec: EvalSpec | None = None,
                 sampled: RolloutWorkflow | None = None) -> dict[str, float]:
        """The summary of ``areal_mega.evaluation.evaluate_items`` (greedy accuracy, its binomial
        SE, mean reward; pass@k with ``sampled``) over ``dataset`` at the current weights. Runs
        beside training rollouts (they share the servers)."""
        summary, _ = self._run(evaluate_items(self.pool, greedy, dataset, spec or EvalSpec(), sampled))
        return summary

    # -- internals ---------------------------------------------------------------------------------
    async def _park_until_synced(self, h: ServerHandle) -> None:
        """The pool's resync hook: ``h`` rejoined with old weights; hold it out of rotation
        until a weight sync has included it."""
        await self._parked.setdefault(h.url, asyncio.Event()).wait()

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

"""What the simulator simulates: typed, validated inputs (no torch, no numpy).

Every field is a plain number with a unit in its name or docstring, so a simulation is fully
described by one :class:`SimConfig` (``dataclasses.asdict`` gives the record to print or store).
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Literal

__all__ = ["DecodeModel", "LearnerModel", "LengthModel", "SimConfig", "SimulationError", "SyncModel"]


PLAN_TOLERANCE = 0.02
"""Throughputs within this fraction count as equal: the planner recommends the smallest
max_staleness within it of the best, and the out-of-sample validation ranks with it."""


def near_best(x: float, top: float, tolerance: float = PLAN_TOLERANCE) -> bool:
    """``x`` counts as equal to the best throughput ``top``: the planner's rule for its
    recommendation (PlanReport.best) and the validation's check of it."""
    return x >= (1 - tolerance) * top


class SimulationError(ValueError):
    """A simulation input is invalid, or the simulated pipeline stalled."""


@dataclass
class LengthModel:
    """Generated tokens per trajectory (and the prompt in front of it)."""

    kind: Literal["lognormal", "constant", "empirical"] = "lognormal"
    """lognormal: heavy-tailed like reasoning traces; constant: every trajectory ``mean_tokens``;
    empirical: drawn uniformly from ``samples`` (e.g. lengths a real run logged)."""
    mean_tokens: float = 1000.0
    """Mean of the untruncated distribution (lognormal, constant), tokens."""
    sigma: float = 1.0
    """Lognormal shape (std of log length): 0.5 mild, 1.0 heavy tail (p99/median ~ 10)."""
    max_tokens: int = 16384
    """Cap (``workflow.sampling.max_new_tokens``): longer draws are truncated to it."""
    min_tokens: int = 1
    """Floor: a trajectory generates at least this many tokens."""
    samples: tuple[int, ...] = ()
    """empirical: the lengths to draw from."""
    prompt_tokens: int = 256
    """Prompt length in front of every trajectory (KV footprint and learner tokens)."""

    def validate(self) -> None:
        if self.kind not in ("lognormal", "constant", "empirical"):
            raise SimulationError(f"lengths.kind: must be lognormal, constant or empirical, got {self.kind!r}")
        if self.kind == "empirical":
            if not self.samples or min(self.samples) < 1:
                raise SimulationError("lengths.samples: empirical lengths need >= 1 sample, each >= 1 token")
        elif not self.mean_tokens >= 1:
            raise SimulationError(f"lengths.mean_tokens: must be >= 1, got {self.mean_tokens}")
        if self.sigma < 0:
            raise SimulationError(f"lengths.sigma: must be >= 0, got {self.sigma}")
        if self.min_tokens < 1 or self.max_tokens < self.min_tokens:
            raise SimulationError(f"lengths: need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.prompt_tokens < 0:
            raise SimulationError(f"lengths.prompt_tokens: must be >= 0, got {self.prompt_tokens}")

    def sampler(self, rng: random.Random) -> Callable[[], int]:
        lo, hi = self.min_tokens, self.max_tokens
        if self.kind == "constant":
            n = min(hi, max(lo, int(round(self.mean_tokens))))
            return lambda: n
        if self.kind == "empirical":
            s = self.samples
            return lambda: min(hi, max(lo, s[rng.randrange(len(s))]))
        mu = math.log(self.mean_tokens) - self.sigma ** 2 / 2  # E[exp(N(mu, s^2))] = mean
        sig = self.sigma
        return lambda: min(hi, max(lo, int(round(rng.lognormvariate(mu, sig)))))

    def moments(self, n: int = 20000, seed: int = 12345) -> tuple[float, float]:
        """(mean length, mean decode context): the second is the prompt plus the average position
        a decode step works at, length-weighted (long traces take more steps): P + E[L^2]/(2E[L])."""
        draw = self.sampler(random.Random(seed))
        xs = [draw() for _ in range(n if self.kind == "lognormal" else min(n, 2000))]
        m1 = sum(xs) / len(xs)
        m2 = sum(x * x for x in xs) / len(xs)
        return m1, self.prompt_tokens + m2 / (2 * m1)


@dataclass
class DecodeModel:
    """One inference server (one SGLang process, all its TP GPUs): batch-dependent decode speed.

    With n requests decoding, the server produces ``peak * n / (n + half_batch)`` tokens/s in
    total, shared equally (each request at ``peak / (n + half_batch)`` tokens/s): an iteration
    costs ``t0 + n * t1`` (weights read once, plus each sequence's KV and FLOPs), so
    ``peak = 1 / t1`` and ``half_batch = t0 / t1``.
    """

    peak_tokens_per_s: float = 1000.0
    """Saturated decode throughput of the whole server (n -> infinity), tokens/s."""
    half_batch: float = 8.0
    """Running requests at which the server reaches half of ``peak_tokens_per_s``."""
    kv_capacity_tokens: int = 0
    """KV-cache size in tokens (SGLang max_total_tokens); 0 = unlimited. A request holds
    prompt + its final length from its start (SGLang's reservation with retraction, simplified);
    requests that do not fit wait in the server's queue, first come first served."""
    max_running: int = 0
    """At most this many requests decode at once (SGLang max_running_requests); 0 = no limit."""
    request_latency_s: float = 0.0
    """Fixed time before a request starts decoding (client round trip), seconds: a delay, no server work."""
    request_server_s: float = 0.0
    """Server time each request costs before it decodes (HTTP, scheduling, prefill of its prompt),
    seconds: the server decodes nothing meanwhile (a decode sweep identifies it:
    ``simulator.sweep``)."""
    reprefill_after_sync: bool = False
    """Every request in flight at a weight sync pays ``request_server_s`` again when generation
    resumes (SGLang's retract and abort modes free its KV cache: it is prefilled again)."""

    def validate(self) -> None:
        if self.request_server_s < 0:
            raise SimulationError(f"decode.request_server_s: must be >= 0, got {self.request_server_s}")
        if not self.peak_tokens_per_s > 0:
            raise SimulationError(f"decode.peak_tokens_per_s: must be > 0, got {self.peak_tokens_per_s}")
        if self.half_batch < 0:
            raise SimulationError(f"decode.half_batch: must be >= 0, got {self.half_batch}")
        if self.kv_capacity_tokens < 0 or self.max_running < 0 or self.request_latency_s < 0:
            raise SimulationError("decode: kv_capacity_tokens, max_running, request_latency_s must be >= 0")

    def throughput(self, n: int) -> float:
        return self.peak_tokens_per_s * n / (n + self.half_batch) if n else 0.0


@dataclass
class LearnerModel:
    """One learner step (everything between receiving a batch and starting the weight sync):
    ``fixed_s + per_token_s * tokens``, tokens = prompt + generated tokens of the batch; or,
    when ``points`` are given, the measured curve through them."""

    fixed_s: float = 1.0
    """Per-step constant (optimizer step, logging, batch packing), seconds."""
    per_token_s: float = 0.0
    """Seconds per batch token (forward + backward + proximal forward over all learner GPUs)."""
    points: tuple[tuple[float, float], ...] = ()
    """Measured (tokens per step, seconds) at >= 2 token counts, replacing ``fixed_s + per_token_s``:
    linear between neighbouring points, the end segments extended beyond them (floored at 0). A
    step time that is not affine in the tokens (a CPU learner whose activations leave the cache:
    2.6x the time for 2x the tokens on a 2-core host, docs/simulator.md) is followed, not averaged."""

    def validate(self) -> None:
        if self.fixed_s < 0 or self.per_token_s < 0:
            raise SimulationError("learner: fixed_s and per_token_s must be >= 0")
        if self.points:
            xs = [x for x, _ in self.points]
            if len(xs) < 2 or any(b <= a for a, b in zip(xs, xs[1:])) or min(y for _, y in self.points) < 0:
                raise SimulationError("learner.points: need >= 2 (tokens, seconds) pairs, tokens strictly increasing, "
                                      f"seconds >= 0; got {self.points}")

    def step_s(self, tokens: float) -> float:
        if not self.points:
            return self.fixed_s + self.per_token_s * tokens
        pts = self.points
        i = max(0, min(len(pts) - 2, bisect.bisect_right([x for x, _ in pts], tokens) - 1))
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))


@dataclass
class SyncModel:
    """Weight sync: ``latency_s + weight_bytes / bandwidth_bytes_per_s``; the servers generate
    nothing meanwhile (paused, in-flight requests resume after it with the new weights)."""

    weight_bytes: float = 0.0
    """Bytes on the critical path of one sync (the planner: costs.sync_bytes)."""
    bandwidth_bytes_per_s: float = 1e9
    """Effective bandwidth of one sender, bytes/s."""
    latency_s: float = 0.0
    """Fixed part: pause, cache flush, resume, version bump, seconds."""
    per_inflight_request_s: float = 0.0
    """Extra seconds per request in flight when generation pauses (retracting it, its HTTP state,
    the cache it held): a larger staleness window keeps more in flight at each sync."""

    def validate(self) -> None:
        if self.per_inflight_request_s < 0:
            raise SimulationError(f"sync.per_inflight_request_s: must be >= 0, got {self.per_inflight_request_s}")
        if self.weight_bytes < 0 or self.latency_s < 0 or not self.bandwidth_bytes_per_s > 0:
            raise SimulationError("sync: need weight_bytes >= 0, latency_s >= 0, bandwidth_bytes_per_s > 0")

    def seconds(self, inflight: int = 0) -> float:
        return self.latency_s + self.weight_bytes / self.bandwidth_bytes_per_s + self.per_inflight_request_s * inflight


@dataclass
class HostModel:
    """Where the rollout client runs: on the learner's own core (rank 0's driver thread: HTTP,
    response parsing, reward) it competes with training for that core."""

    client_s_per_request: float = 0.0
    """CPU seconds of client work per finished request on the learner's core (0 = free: on a GPU
    learner the training step does not wait for the CPU). While the learner trains and client work
    is pending the core is shared equally (two runnable threads on one core), so each runs at
    half speed: training takes longer, and responses reach the controller later."""

    def validate(self) -> None:
        if self.client_s_per_request < 0:
            raise SimulationError(f"host.client_s_per_request: must be >= 0, got {self.client_s_per_request}")


@dataclass
class SimConfig:
    """One simulated run: the rollout knobs of the real trainer plus the four cost models."""

    batch_size: int = 4
    """Episodes (prompts, GRPO groups) per training batch: ``rollout.batch_size``."""
    group_size: int = 8
    """Trajectories per episode: ``workflow.group_size``; an episode finishes with its last one."""
    max_staleness: int = 0
    """``rollout.max_staleness``: 0 = synchronous RL."""
    max_concurrent: int = 0
    """``rollout.max_concurrent`` episodes in flight; 0 = batch_size * (max_staleness + 1)."""
    num_servers: int = 1
    """Inference servers; requests go to the one with the fewest in flight (the pool's rule)."""
    steps: int = 10
    """Timed training steps."""
    warmup_steps: int = 2
    """Untimed steps first (the pipeline filling), as tools/bench_async.py does."""
    reject_prob: float = 0.0
    """Probability that a finished episode is rejected (filter_zero_variance) and refilled."""
    seed: int = 0
    lengths: LengthModel = field(default_factory=LengthModel)
    decode: DecodeModel = field(default_factory=DecodeModel)
    learner: LearnerModel = field(default_factory=LearnerModel)
    sync: SyncModel = field(default_factory=SyncModel)
    host: HostModel = field(default_factory=HostModel)

    def validate(self) -> None:
        for name in ("batch_size", "group_size", "num_servers", "steps"):
            if getattr(self, name) < 1:
                raise SimulationError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.warmup_steps < 0 or self.max_concurrent < 0:
            raise SimulationError("max_staleness, warmup_steps, max_concurrent: must be >= 0")
        if not 0 <= self.reject_prob < 0.99:
            raise SimulationError(f"reject_prob: must be in [0, 0.99), got {self.reject_prob}")
        for part in (self.lengths, self.decode, self.learner, self.sync, self.host):
            part.validate()

    @property
    def concurrency(self) -> int:
        return self.max_concurrent or self.batch_size * (self.max_staleness + 1)

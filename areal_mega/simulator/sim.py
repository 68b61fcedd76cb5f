"""Discrete-event simulation of the asynchronous RL pipeline (pure Python).

Actors and what drives them::

    producer  -- StalenessManager.try_admit() (the real class) --> episode = group_size requests
                 --> the server with the fewest requests in flight (the pool's rule)
    server    -- n requests decode at DecodeModel.throughput(n) / n tokens/s each; KV capacity
                 and max_running queue the rest; paused (no progress) during a weight sync; each
                 arriving request first costs it request_server_s of prefill (nothing decodes),
                 again after a sync when reprefill_after_sync (retracted requests)
    client    -- a finished request costs HostModel.client_s_per_request on the learner's core
                 (FIFO) before its episode counts it; that core is shared equally with training
    episode   -- finishes with its last request: on_accepted() / on_rejected() (refilled)
    learner   -- waits until rollout.staleness.can_form_batch(...) (the real rule), takes the
                 oldest-admitted batch (take_oldest), trains LearnerModel.step_s(tokens), then
                 syncs weights SyncModel.seconds() with the servers and the producer paused,
                 then set_version(v + 1): admission moves on, new tokens carry version v + 1

Servers are fluid: between events every running request advances at the same rate, so each
server keeps one progress counter P (tokens generated per running request since t = 0) and a
heap of finishing values of P; an event costs O(log n). Token versions come from the values of
P at which each server's weights changed, so an interrupted request carries mixed versions,
as a real one does.

Each trained episode is checked against the bound (admission version and oldest token >= train
version - max_staleness); ``SimResult.violations`` counts failures (the tests want 0).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from areal_mega.rollout.staleness import StalenessManager, can_form_batch, take_oldest
from areal_mega.simulator.model import SimConfig, SimulationError

__all__ = ["SimResult", "Simulation", "TrainedEpisode", "simulate"]

_EPS = 1e-9


@dataclass
class TrainedEpisode:
    seq: int
    train_version: int
    admit_version: int
    min_token_version: int
    tokens: int
    """Generated tokens of the episode (all its trajectories)."""


@dataclass
class SimResult:
    samples_per_s: float
    """Trajectories trained per second over the timed steps (bench_async's samples/s)."""
    tokens_per_s: float
    """Generated tokens trained per second over the timed steps."""
    step_s: float
    """Mean timed step (weight sync end to weight sync end)."""
    gen_wait_s: float
    """Mean time per timed step the learner waited for a batch (sync mode: the generation time)."""
    gen_idle_frac: float
    """Fraction of server time with nothing decoding (no request, or paused for a sync)."""
    gen_paused_frac: float
    """Fraction of server time paused by weight syncs (included in gen_idle_frac)."""
    gen_inflight_s: float
    """Mean time per timed step with >= 1 episode in flight (admitted, not finished; paused
    included): what the controller logs as ``rollout/gen_inflight_s``."""
    decode_util: float
    """Mean of throughput(n) / peak over server time: how saturated decoding was."""
    train_idle_frac: float
    """Fraction of learner time not training (waiting for a batch or syncing weights)."""
    learner_wait_frac: float
    sync_frac: float
    train_s: float
    """Mean learner time per timed step spent training (longer than LearnerModel.step_s when
    client work shares the learner's core)."""
    weight_sync_s: float
    """Mean weight sync per timed step (longer than SyncModel.seconds() when client work shares
    the learner's core)."""
    inflight_at_sync: float
    """Mean requests in flight (decoding or queued) when a timed weight sync paused generation."""
    staleness_token_hist: dict[int, int]
    """Generated tokens of trained batches by staleness (train version - token version)."""
    staleness_episode_hist: dict[int, int]
    """Trained episodes by train version - admission version."""
    violations: int
    """Trained episodes older than max_staleness (must be 0)."""
    trained: list[TrainedEpisode] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    gen_intervals: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of times any server was decoding (record=True only)."""
    train_intervals: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of learner steps (record=True only)."""

    @property
    def staleness_mean(self) -> float:
        n = sum(self.staleness_token_hist.values())
        return sum(k * v for k, v in self.staleness_token_hist.items()) / n if n else 0.0

    @property
    def staleness_max(self) -> int:
        return max((k for k, v in self.staleness_token_hist.items() if v), default=0)

    def summary(self) -> dict:
        r = lambda x: round(x, 4)  # noqa: E731
        return {
            "samples_per_s": r(self.samples_per_s), "tokens_per_s": r(self.tokens_per_s), "step_s": r(self.step_s),
            "gen_wait_s": r(self.gen_wait_s), "gen_idle_frac": r(self.gen_idle_frac),
            "gen_paused_frac": r(self.gen_paused_frac), "gen_inflight_s": r(self.gen_inflight_s),
            "decode_util": r(self.decode_util),
            "train_idle_frac": r(self.train_idle_frac), "learner_wait_frac": r(self.learner_wait_frac),
            "sync_frac": r(self.sync_frac), "train_s": r(self.train_s),
            "weight_sync_s": r(self.weight_sync_s), "inflight_at_sync": r(self.inflight_at_sync),
            "staleness_mean": r(self.staleness_mean),
            "staleness_max": self.staleness_max,
            "staleness_tokens": {str(k): v for k, v in sorted(self.staleness_token_hist.items())},
            "violations": self.violations,
        }


class _Req:
    __slots__ = ("episode", "length", "footprint", "p_start", "server")

    def __init__(self, episode: "_Episode", length: int, footprint: int) -> None:
        self.episode, self.length, self.footprint = episode, length, footprint
        self.p_start = 0.0
        self.server = -1


class _Episode:
    __slots__ = ("seq", "admit_version", "remaining", "gen_tokens", "tokens", "versions")

    def __init__(self, seq: int, admit_version: int, group: int) -> None:
        self.seq, self.admit_version, self.remaining = seq, admit_version, group
        self.gen_tokens = 0
        self.tokens = 0
        self.versions: Counter[int] = Counter()


class _Server:
    __slots__ = ("idx", "P", "last", "heap", "kv", "queue", "paused", "epoch", "marks_p", "marks_v",
                 "busy", "paused_t", "util", "tie", "stall")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.P = 0.0
        self.last = 0.0
        self.heap: list[tuple[float, int, _Req]] = []
        self.kv = 0
        self.queue: deque[_Req] = deque()
        self.paused = False
        self.epoch = 0
        self.marks_p = [0.0]  # P at which the weights became marks_v[i]
        self.marks_v = [0]
        self.busy = 0.0
        self.paused_t = 0.0
        self.util = 0.0
        self.tie = 0
        self.stall = 0.0  # server seconds of prefill owed before decoding goes on


# Event kinds in the event heap; ties at one time run in push order.
K_ARRIVE, K_SERVER, K_TRAIN_DONE, K_SYNC_DONE, K_CORE = 0, 1, 2, 3, 4


class _Core:
    """The learner's CPU core: its own work (``job``: "train", then "sync" -- gloo broadcast and
    HTTP run there too) and the head client request's work, shared equally when both run."""

    __slots__ = ("last", "train", "client", "epoch", "job", "queue", "client_s")

    def __init__(self, client_s: float) -> None:
        self.last = 0.0
        self.train = 0.0  # the job's work left
        self.client = 0.0  # the head request's work left
        self.epoch = 0
        self.job: str | None = None
        self.queue: deque[_Req] = deque()
        self.client_s = client_s

    def rates(self) -> tuple[float, float]:
        """(the job's share, the head request's share) of the core."""
        training = self.job is not None
        both = training and bool(self.queue)
        return (0.5 if both else 1.0) if training else 0.0, (0.5 if both else 1.0) if self.queue else 0.0

    def advance(self, t: float) -> None:
        dt = t - self.last
        if dt > 0:
            rt, rc = self.rates()
            self.train = max(0.0, self.train - rt * dt)
            if self.queue:
                self.client = max(0.0, self.client - rc * dt)
        self.last = t

    def next_due(self) -> float | None:
        """Seconds until the job or the head request is done (None: the core is idle); starts
        the head request's work when it has none left, and a new epoch (older core events go stale)."""
        self.epoch += 1
        if self.queue and self.client <= 0:
            self.client = self.client_s
        rt, rc = self.rates()
        due = [self.train / rt] if rt else []
        if rc:
            due.append(self.client / rc)
        return min(due) if due else None


class Simulation:
    """One run of ``cfg``: the state of servers, producer, learner and its core as attributes,
    one ``on_*`` method per event kind; :func:`simulate` is ``Simulation(cfg).run()``."""

    def __init__(self, cfg: SimConfig, *, record: bool = False, max_events: int = 20_000_000) -> None:
        cfg.validate()
        self.cfg, self.record, self.max_events = cfg, record, max_events
        self.rng = random.Random(cfg.seed)
        self.draw = cfg.lengths.sampler(self.rng)
        self.prompt = cfg.lengths.prompt_tokens
        self.dec, self.B, self.eta = cfg.decode, cfg.batch_size, cfg.max_staleness
        self.peak, self.half = self.dec.peak_tokens_per_s, self.dec.half_batch
        self.sm = StalenessManager(self.B, self.eta, cfg.concurrency)
        self.total_steps = cfg.warmup_steps + cfg.steps
        self.servers = [_Server(i) for i in range(cfg.num_servers)]
        self.load = [0] * cfg.num_servers  # requests sent and not finished, per server: the pool's load
        self.events: list[tuple[float, int, int, object]] = []  # (time, tiebreak, kind, payload)
        self.tick = 0
        self.client_s = cfg.host.client_s_per_request
        self.core = _Core(self.client_s)
        self.now = 0.0
        self.running: dict[int, int] = {}  # seq -> admit version (in flight)
        self.ready: list[_Episode] = []
        self.seq_counter = 0
        self.paused = False  # producer paused (weight sync)
        self.learner_state, self.learner_since = "wait", 0.0
        self.learner_time = {"wait": 0.0, "train": 0.0, "sync": 0.0}
        self.trained: list[TrainedEpisode] = []
        self.step_end: list[float] = []
        self.step_wait: list[float] = []
        self.violations = 0
        self.token_hist: Counter[int] = Counter()
        self.ep_hist: Counter[int] = Counter()
        self.samples_timed = 0  # trajectories in timed steps
        self.tokens_timed = 0  # their generated tokens
        self.gen_open: float | None = None
        self.gen_intervals: list[tuple[float, float]] = []
        self.train_intervals: list[tuple[float, float]] = []
        self.snap: dict[str, tuple] = {}
        self.wait_since = 0.0
        self.train_started = 0.0
        self.sync_inflight: list[int] = []  # requests in flight at each timed sync's pause
        self.inflight_s = 0.0  # accumulated time with >= 1 episode running
        self.last_event = 0.0

    def push(self, t: float, kind: int, payload: object) -> None:
        self.tick += 1
        heapq.heappush(self.events, (t, self.tick, kind, payload))

    # ---- servers ---------------------------------------------------------------------------
    def advance(self, s: _Server, t: float) -> None:
        """Move server ``s`` to time ``t``: prefill owed first, then decoding at the fluid rate."""
        dt = t - s.last
        if dt > 0 and s.paused:
            s.paused_t += dt
        elif dt > 0 and s.stall > 0:
            use = min(s.stall, dt)
            s.stall -= use
            s.busy += use
            dt -= use
        if dt > 0 and not s.paused:
            n = len(s.heap)
            if n:
                half = self.half
                s.P += dt * self.peak / (n + half)
                s.busy += dt
                s.util += dt * n / (n + half)
        s.last = t

    def note_gen(self, t: float) -> None:
        if not self.record:
            return
        on = any(s.heap and not s.paused for s in self.servers)
        if on and self.gen_open is None:
            self.gen_open = t
        elif not on and self.gen_open is not None:
            if t > self.gen_open:
                self.gen_intervals.append((self.gen_open, t))
            self.gen_open = None

    def reschedule(self, s: _Server) -> None:
        """A rate change: the server's next finish is pushed again (older ones are stale)."""
        s.epoch += 1
        if s.heap and not s.paused:
            n = len(s.heap)
            dt = s.stall + max(0.0, (s.heap[0][0] - s.P) * (n + self.half) / self.peak)
            self.tick += 1
            heapq.heappush(self.events, (self.now + dt, self.tick, K_SERVER, (s, s.epoch)))

    def fill(self, s: _Server) -> None:
        """Queued requests start while KV capacity and max_running allow."""
        if not s.queue:
            return
        cap, mr = self.dec.kv_capacity_tokens, self.dec.max_running
        while s.queue:
            r = s.queue[0]
            n = len(s.heap)
            if mr and n >= mr:
                break
            if cap and n and s.kv + r.footprint > cap:
                break  # an oversized request runs alone rather than never
            s.queue.popleft()
            r.p_start = s.P
            s.kv += r.footprint
            s.tie += 1
            heapq.heappush(s.heap, (s.P + r.length, s.tie, r))

    def on_arrive(self, reqs: list[_Req]) -> None:
        """Requests reach their servers (one episode's group at once: one rate change per server)."""
        touched = {}
        for r in reqs:
            srv = self.servers[r.server]
            if srv.idx not in touched:
                self.advance(srv, self.now)
                touched[srv.idx] = srv
            srv.queue.append(r)
            srv.stall += self.dec.request_server_s
        for srv in touched.values():
            self.fill(srv)
            self.reschedule(srv)
        self.note_gen(self.now)

    def on_server(self, s: _Server, epoch: int) -> None:
        """Server ``s``'s earliest request(s) finished (unless a rate change superseded this)."""
        if epoch != s.epoch:
            return
        self.advance(s, self.now)
        finished_eps = False
        while s.heap and s.heap[0][0] <= s.P + _EPS * max(1.0, s.P):
            _, _, r = heapq.heappop(s.heap)
            finished_eps = self.finish_request(s, r) or finished_eps
        self.fill(s)
        self.reschedule(s)
        self.note_gen(self.now)
        if finished_eps:
            self.produce()
            self.try_train()

    @staticmethod
    def token_versions(s: _Server, r: _Req, out: Counter[int]) -> None:
        """Add ``r``'s tokens per weight version to ``out``: the marks of P inside
        [p_start, p_start + length)."""
        lo, hi = r.p_start, r.p_start + r.length
        i = bisect.bisect_right(s.marks_p, lo + _EPS) - 1
        done = 0
        while done < r.length:
            nxt = s.marks_p[i + 1] if i + 1 < len(s.marks_p) else float("inf")
            upto = r.length if nxt >= hi - _EPS else min(r.length, max(done, int(round(nxt - lo))))
            if upto > done:
                out[s.marks_v[i]] += upto - done
                done = upto
            i += 1
            if i >= len(s.marks_p):
                break

    def finish_request(self, s: _Server, r: _Req) -> bool:
        """The server is done with ``r``; True when it was its episode's last (and counted now:
        with client work it is counted once the learner's core has processed it)."""
        s.kv -= r.footprint
        self.load[s.idx] -= 1
        self.token_versions(s, r, r.episode.versions)
        if self.client_s > 0:
            self.core.advance(self.now)
            self.core.queue.append(r)
            self.schedule_core()
            return False
        return self.request_done(r)

    def request_done(self, r: _Req) -> bool:
        ep = r.episode
        ep.gen_tokens += r.length
        ep.tokens += r.length + self.prompt
        ep.remaining -= 1
        if ep.remaining == 0:
            self.finish_episode(ep)
            return True
        return False

    # ---- the learner's core ----------------------------------------------------------------
    def schedule_core(self) -> None:
        due = self.core.next_due()
        if due is not None:
            self.push(self.now + due, K_CORE, self.core.epoch)

    def on_core(self, epoch: int) -> None:
        """The core finished the head client request and/or its job (train -> sync -> done)."""
        core = self.core
        if epoch != core.epoch:
            return
        core.advance(self.now)
        finished_eps = False
        if core.queue and core.client <= _EPS:
            finished_eps = self.request_done(core.queue.popleft())
            core.client = 0.0
        job = core.job
        if job is not None and core.train <= _EPS:
            core.train, core.job = 0.0, None
            if job == "train":
                if self.record:
                    self.train_intervals.append((self.train_started, self.now))
                self.on_train_done()
            else:
                self.push(self.now, K_SYNC_DONE, None)
        self.schedule_core()
        if finished_eps:
            self.produce()
            self.try_train()

    # ---- controller ------------------------------------------------------------------------
    def finish_episode(self, ep: _Episode) -> None:
        self.running.pop(ep.seq, None)
        if self.cfg.reject_prob and self.rng.random() < self.cfg.reject_prob:
            self.sm.on_rejected()
        else:
            self.sm.on_accepted()
            self.ready.append(ep)

    def produce(self) -> None:
        """Admit episodes while the staleness manager allows; each request goes to the server
        with the fewest in flight (lowest index on a tie)."""
        if self.paused:
            return
        cfg, load = self.cfg, self.load
        while True:
            v = self.sm.try_admit()
            if v is None:
                return
            ep = _Episode(self.seq_counter, v, cfg.group_size)
            self.seq_counter += 1
            self.running[ep.seq] = v
            reqs = []
            for _ in range(cfg.group_size):
                length = self.draw()
                r = _Req(ep, length, self.prompt + length)
                i = load.index(min(load))  # the first of the least loaded
                load[i] += 1
                r.server = i
                reqs.append(r)
            if self.dec.request_latency_s > 0:
                self.push(self.now + self.dec.request_latency_s, K_ARRIVE, reqs)
            else:
                self.on_arrive(reqs)

    def set_learner(self, state: str) -> None:
        self.learner_time[self.learner_state] += self.now - self.learner_since
        self.learner_state, self.learner_since = state, self.now

    def take_batch(self) -> list[_Episode] | None:
        """The oldest-admitted batch when the real rule (can_form_batch) allows one, else None."""
        ready = self.ready
        ready.sort(key=lambda e: e.seq)
        if not can_form_batch(self.B, self.sm.version, self.eta, self.B, [e.admit_version for e in ready],
                              list(self.running.values())):
            return None
        taken, rest = take_oldest(ready, self.B, seq=lambda e: e.seq)
        ready[:] = rest
        return taken

    def account(self, taken: list[_Episode], timed: bool) -> int:
        """Check each episode against the bound and count its staleness; returns the batch's tokens."""
        version, eta = self.sm.version, self.eta
        tokens = 0
        for ep in taken:
            oldest = min(ep.versions) if ep.versions else version
            if ep.admit_version < version - eta or oldest < version - eta:
                self.violations += 1
            self.trained.append(TrainedEpisode(ep.seq, version, ep.admit_version, oldest, ep.gen_tokens))
            tokens += ep.tokens
            if timed:
                self.ep_hist[version - ep.admit_version] += 1
                for v, c in ep.versions.items():
                    self.token_hist[version - v] += c
                self.samples_timed += self.cfg.group_size
                self.tokens_timed += ep.gen_tokens
        return tokens

    def try_train(self) -> None:
        """A waiting learner takes a batch if it can and starts its step."""
        if self.learner_state != "wait":
            return
        taken = self.take_batch()
        if taken is None:
            return
        step = len(self.step_end)  # 0-based index of this step
        tokens = self.account(taken, self.cfg.warmup_steps <= step < self.total_steps)
        now = self.now
        self.step_wait.append(now - self.wait_since)
        dt = self.cfg.learner.step_s(tokens)
        if self.client_s > 0:  # the step's end depends on the client work sharing the core
            self.core.advance(now)
            self.set_learner("train")
            self.core.train, self.core.job = dt, "train"
            self.train_started = now
            self.schedule_core()
            return
        self.set_learner("train")
        if self.record:
            self.train_intervals.append((now, now + dt))
        self.push(now + dt, K_TRAIN_DONE, None)

    def snapshot(self, name: str) -> None:
        for s in self.servers:
            self.advance(s, self.now)
        self.set_learner(self.learner_state)
        lt = self.learner_time
        self.snap[name] = (self.now, sum(s.busy for s in self.servers), sum(s.paused_t for s in self.servers),
                           sum(s.util for s in self.servers), lt["wait"], lt["train"], lt["sync"], self.inflight_s)

    def on_train_done(self) -> None:
        """The step ended: generation pauses and the weight sync starts."""
        self.set_learner("sync")
        self.paused = True
        for s in self.servers:
            self.advance(s, self.now)
            s.paused = True
            self.reschedule(s)
        self.note_gen(self.now)
        inflight_n = sum(len(s.heap) + len(s.queue) for s in self.servers)
        if len(self.step_end) >= self.cfg.warmup_steps:
            self.sync_inflight.append(inflight_n)
        dt = self.cfg.sync.seconds(inflight_n)
        if self.client_s > 0:  # the caller (on_core) reschedules the core
            self.core.train, self.core.job = dt, "sync"
        else:
            self.push(self.now + dt, K_SYNC_DONE, None)

    def on_sync_done(self) -> bool:
        """New weights on every server (a version mark at its current P), generation resumes;
        True when that was the last step."""
        version = self.sm.version + 1
        dec = self.dec
        for s in self.servers:
            self.advance(s, self.now)
            s.paused = False
            if dec.reprefill_after_sync:  # retracted requests are prefilled again
                s.stall += dec.request_server_s * len(s.heap)
            if s.marks_p[-1] >= s.P - _EPS:  # no progress since the last update
                s.marks_v[-1] = version
            else:
                s.marks_p.append(s.P)
                s.marks_v.append(version)
            self.reschedule(s)
        self.sm.set_version(version)
        self.paused = False
        self.set_learner("wait")
        self.wait_since = self.now
        self.step_end.append(self.now)
        if len(self.step_end) == self.cfg.warmup_steps:
            self.snapshot("start")
        if len(self.step_end) == self.total_steps:
            self.snapshot("end")
            return True
        self.note_gen(self.now)
        self.produce()
        self.try_train()
        return False

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        if self.cfg.warmup_steps == 0:
            self.snapshot("start")
        self.produce()
        self.try_train()
        n_events = 0
        events = self.events
        while len(self.step_end) < self.total_steps:
            if not events:
                raise SimulationError(
                    f"simulation stalled at t={self.now:.3f} s, step {len(self.step_end)}: learner "
                    f"{self.learner_state}, {len(self.ready)} ready, {len(self.running)} running, "
                    f"capacity {self.sm.capacity()}")
            n_events += 1
            if n_events > self.max_events:
                raise SimulationError(f"simulation exceeded {self.max_events} events (step {len(self.step_end)})")
            t, _, kind, payload = heapq.heappop(events)
            if self.running:
                self.inflight_s += t - self.last_event
            self.last_event = self.now = t
            if kind == K_SERVER:
                self.on_server(*payload)  # type: ignore[misc]
            elif kind == K_ARRIVE:
                self.on_arrive(payload)  # type: ignore[arg-type]
            elif kind == K_CORE:
                self.on_core(payload)  # type: ignore[arg-type]
            elif kind == K_TRAIN_DONE:
                self.on_train_done()
            elif kind == K_SYNC_DONE:
                if self.on_sync_done():
                    break
        if self.record and self.gen_open is not None and self.now > self.gen_open:
            self.gen_intervals.append((self.gen_open, self.now))
        return self.result()

    def result(self) -> SimResult:
        """The timed steps' figures: differences of the "start" and "end" snapshots."""
        cfg = self.cfg
        t0, busy0, paused0, util0, w0, tr0, sy0, if0 = self.snap["start"]
        t1, busy1, paused1, util1, w1, tr1, sy1, if1 = self.snap["end"]
        span = t1 - t0
        if span <= 0:
            raise SimulationError("simulation: timed steps took no time (all costs zero?)")
        ns = cfg.num_servers
        busy, paus, util = busy1 - busy0, paused1 - paused0, util1 - util0
        syncs = self.sync_inflight[:cfg.steps]
        return SimResult(
            samples_per_s=self.samples_timed / span, tokens_per_s=self.tokens_timed / span,
            step_s=span / cfg.steps, gen_wait_s=sum(self.step_wait[cfg.warmup_steps:self.total_steps]) / cfg.steps,
            gen_idle_frac=1.0 - busy / (span * ns), gen_paused_frac=paus / (span * ns),
            gen_inflight_s=(if1 - if0) / cfg.steps,
            decode_util=util / (span * ns),
            train_idle_frac=1.0 - (tr1 - tr0) / span, learner_wait_frac=(w1 - w0) / span,
            sync_frac=(sy1 - sy0) / span, train_s=(tr1 - tr0) / cfg.steps,
            weight_sync_s=(sy1 - sy0) / cfg.steps,
            inflight_at_sync=sum(syncs) / max(1, len(syncs)),
            staleness_token_hist=dict(self.token_hist), staleness_episode_hist=dict(self.ep_hist),
            violations=self.violations, trained=self.trained, step_end_s=self.step_end,
            gen_intervals=self.gen_intervals, train_intervals=self.train_intervals,
        )


def simulate(cfg: SimConfig, *, record: bool = False, max_events: int = 20_000_000) -> SimResult:
    """Run ``warmup_steps + steps`` training steps of ``cfg``; raises SimulationError on bad input
    or a stall (the learner waiting with nothing left to happen)."""
    return Simulation(cfg, record=record, max_events=max_events).run()

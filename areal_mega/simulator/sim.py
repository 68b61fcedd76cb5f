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

__all__ = ["SimResult", "TrainedEpisode", "simulate"]

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


def simulate(cfg: SimConfig, *, record: bool = False, max_events: int = 20_000_000) -> SimResult:
    """Run ``warmup_steps + steps`` training steps of ``cfg``; raises SimulationError on bad input
    or a stall (the learner waiting with nothing left to happen)."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    draw = cfg.lengths.sampler(rng)
    prompt = cfg.lengths.prompt_tokens
    dec, B, eta = cfg.decode, cfg.batch_size, cfg.max_staleness
    peak, half = dec.peak_tokens_per_s, dec.half_batch
    sm = StalenessManager(B, eta, cfg.concurrency)
    total_steps = cfg.warmup_steps + cfg.steps
    servers = [_Server(i) for i in range(cfg.num_servers)]
    load = [0] * cfg.num_servers  # requests sent and not finished, per server: the pool's load
    events: list[tuple[float, int, int, object]] = []  # (time, tiebreak, kind, payload)
    tick = [0]
    K_ARRIVE, K_SERVER, K_TRAIN_DONE, K_SYNC_DONE, K_CORE = 0, 1, 2, 3, 4
    client_s = cfg.host.client_s_per_request

    def push(t: float, kind: int, payload: object) -> None:
        tick[0] += 1
        heapq.heappush(events, (t, tick[0], kind, payload))

    now = 0.0
    running: dict[int, int] = {}  # seq -> admit version (in flight)
    ready: list[_Episode] = []
    seq_counter = [0]
    paused = [False]  # producer paused (weight sync)
    learner = {"state": "wait", "since": 0.0, "wait": 0.0, "train": 0.0, "sync": 0.0}
    trained: list[TrainedEpisode] = []
    step_end: list[float] = []
    step_wait: list[float] = []
    violations = 0
    token_hist: Counter[int] = Counter()
    ep_hist: Counter[int] = Counter()
    samples_timed = [0, 0]  # trajectories, generated tokens in timed steps
    gen_open: list[float | None] = [None]
    gen_intervals: list[tuple[float, float]] = []
    train_intervals: list[tuple[float, float]] = []
    snap: dict[str, tuple] = {}
    wait_since = [0.0]
    train_started = [0.0]
    sync_inflight: list[int] = []  # requests in flight at each timed sync's pause
    inflight = [0.0, 0.0]  # accumulated time with >= 1 episode running; time of the last event

    # ---- servers ---------------------------------------------------------------------------
    def advance(s: _Server, t: float) -> None:
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
                s.P += dt * peak / (n + half)
                s.busy += dt
                s.util += dt * n / (n + half)
        s.last = t

    def decoding(s: _Server) -> bool:
        return bool(s.heap) and not s.paused

    def note_gen(t: float) -> None:
        if not record:
            return
        on = any(decoding(s) for s in servers)
        if on and gen_open[0] is None:
            gen_open[0] = t
        elif not on and gen_open[0] is not None:
            if t > gen_open[0]:
                gen_intervals.append((gen_open[0], t))
            gen_open[0] = None

    def reschedule(s: _Server) -> None:
        s.epoch += 1
        if s.heap and not s.paused:
            n = len(s.heap)
            dt = s.stall + max(0.0, (s.heap[0][0] - s.P) * (n + half) / peak)
            push(now + dt, K_SERVER, (s, s.epoch))

    def fill(s: _Server) -> None:
        cap, mr = dec.kv_capacity_tokens, dec.max_running
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

    def arrive(reqs: list[_Req]) -> None:
        """Requests reach their servers (one episode's group at once: one rate change per server)."""
        touched = {}
        for r in reqs:
            srv = servers[r.server]
            if srv.idx not in touched:
                advance(srv, now)
                touched[srv.idx] = srv
            srv.queue.append(r)
            srv.stall += dec.request_server_s
        for srv in touched.values():
            fill(srv)
            reschedule(srv)
        note_gen(now)

    def finish_request(s: _Server, r: _Req) -> bool:
        """The server is done with ``r``; True when it was its episode's last (and counted now:
        with client work it is counted once the learner's core has processed it)."""
        s.kv -= r.footprint
        load[s.idx] -= 1
        ep = r.episode
        # Tokens per weight version: the marks of P inside [p_start, p_start + length).
        lo, hi = r.p_start, r.p_start + r.length
        i = bisect.bisect_right(s.marks_p, lo + _EPS) - 1
        done = 0
        while done < r.length:
            nxt = s.marks_p[i + 1] if i + 1 < len(s.marks_p) else float("inf")
            upto = r.length if nxt >= hi - _EPS else min(r.length, max(done, int(round(nxt - lo))))
            if upto > done:
                ep.versions[s.marks_v[i]] += upto - done
                done = upto
            i += 1
            if i >= len(s.marks_p):
                break
        if client_s > 0:
            core_advance(now)
            client_q.append(r)
            core_schedule()
            return False
        return request_done(r)

    def request_done(r: _Req) -> bool:
        ep = r.episode
        ep.gen_tokens += r.length
        ep.tokens += r.length + prompt
        ep.remaining -= 1
        if ep.remaining == 0:
            finish_episode(ep)
            return True
        return False

    # ---- the learner's core: training and client work, shared equally when both run ----------
    # job: the learner's own work in progress ("train", then "sync": gloo broadcast and HTTP also
    # run on that core), its work left in core["train"]; core["client"]: the head request's.
    core: dict = {"last": 0.0, "train": 0.0, "client": 0.0, "epoch": 0, "job": None}
    client_q: deque[_Req] = deque()

    def core_rates() -> tuple[float, float]:
        training = core["job"] is not None
        both = training and bool(client_q)
        return (0.5 if both else 1.0) if training else 0.0, (0.5 if both else 1.0) if client_q else 0.0

    def core_advance(t: float) -> None:
        dt = t - core["last"]
        if dt > 0:
            rt, rc = core_rates()
            core["train"] = max(0.0, core["train"] - rt * dt)
            if client_q:
                core["client"] = max(0.0, core["client"] - rc * dt)
        core["last"] = t

    def core_schedule() -> None:
        core["epoch"] += 1
        if client_q and core["client"] <= 0:
            core["client"] = client_s  # the head request starts its client work
        rt, rc = core_rates()
        due = [core["train"] / rt] if rt else []
        if rc:
            due.append(core["client"] / rc)
        if due:
            push(now + min(due), K_CORE, core["epoch"])

    # ---- controller ------------------------------------------------------------------------
    def finish_episode(ep: _Episode) -> None:
        running.pop(ep.seq, None)
        if cfg.reject_prob and rng.random() < cfg.reject_prob:
            sm.on_rejected()
        else:
            sm.on_accepted()
            ready.append(ep)

    def produce() -> None:
        if paused[0]:
            return
        while True:
            v = sm.try_admit()
            if v is None:
                return
            ep = _Episode(seq_counter[0], v, cfg.group_size)
            seq_counter[0] += 1
            running[ep.seq] = v
            reqs = []
            for _ in range(cfg.group_size):
                length = draw()
                r = _Req(ep, length, prompt + length)
                i = min(range(len(load)), key=load.__getitem__)  # fewest in flight, lowest index
                load[i] += 1
                r.server = i
                reqs.append(r)
            if dec.request_latency_s > 0:
                push(now + dec.request_latency_s, K_ARRIVE, reqs)
            else:
                arrive(reqs)

    def set_learner(state: str) -> None:
        learner[learner["state"]] += now - learner["since"]
        learner["state"], learner["since"] = state, now

    def try_train() -> None:
        nonlocal violations
        if learner["state"] != "wait":
            return
        version = sm.version
        ready.sort(key=lambda e: e.seq)
        if not can_form_batch(B, version, eta, B, [e.admit_version for e in ready], list(running.values())):
            return
        taken, rest = take_oldest(ready, B, seq=lambda e: e.seq)
        ready[:] = rest
        step = len(step_end)  # 0-based index of this step
        timed = cfg.warmup_steps <= step < total_steps
        tokens = 0
        for ep in taken:
            oldest = min(ep.versions) if ep.versions else version
            if ep.admit_version < version - eta or oldest < version - eta:
                violations += 1
            trained.append(TrainedEpisode(ep.seq, version, ep.admit_version, oldest, ep.gen_tokens))
            tokens += ep.tokens
            if timed:
                ep_hist[version - ep.admit_version] += 1
                for v, c in ep.versions.items():
                    token_hist[version - v] += c
                samples_timed[0] += cfg.group_size
                samples_timed[1] += ep.gen_tokens
        step_wait.append(now - wait_since[0])
        dt = cfg.learner.step_s(tokens)
        if client_s > 0:  # the step's end depends on the client work sharing the core
            core_advance(now)
            set_learner("train")
            core["train"], core["job"] = dt, "train"
            train_started[0] = now
            core_schedule()
            return
        set_learner("train")
        if record:
            train_intervals.append((now, now + dt))
        push(now + dt, K_TRAIN_DONE, None)

    def snapshot(name: str) -> None:
        for s in servers:
            advance(s, now)
        set_learner(learner["state"])
        snap[name] = (now, sum(s.busy for s in servers), sum(s.paused_t for s in servers),
                      sum(s.util for s in servers), learner["wait"], learner["train"], learner["sync"], inflight[0])

    def train_done() -> None:
        set_learner("sync")
        paused[0] = True
        for s in servers:
            advance(s, now)
            s.paused = True
            reschedule(s)
        note_gen(now)
        inflight_n = sum(len(s.heap) + len(s.queue) for s in servers)
        if len(step_end) >= cfg.warmup_steps:
            sync_inflight.append(inflight_n)
        dt = cfg.sync.seconds(inflight_n)
        if client_s > 0:  # the caller (K_CORE) reschedules the core
            core["train"], core["job"] = dt, "sync"
        else:
            push(now + dt, K_SYNC_DONE, None)

    # ---- main loop -------------------------------------------------------------------------
    if cfg.warmup_steps == 0:
        snapshot("start")
    produce()
    try_train()
    n_events = 0
    while len(step_end) < total_steps:
        if not events:
            raise SimulationError(
                f"simulation stalled at t={now:.3f} s, step {len(step_end)}: learner {learner['state']}, "
                f"{len(ready)} ready, {len(running)} running, capacity {sm.capacity()}")
        n_events += 1
        if n_events > max_events:
            raise SimulationError(f"simulation exceeded {max_events} events (step {len(step_end)})")
        t, _, kind, payload = heapq.heappop(events)
        if running:
            inflight[0] += t - inflight[1]
        inflight[1] = now = t
        if kind == K_SERVER:
            s, epoch = payload  # type: ignore[misc]
            if epoch != s.epoch:
                continue  # superseded by a later rate change
            advance(s, now)
            finished_eps = False
            while s.heap and s.heap[0][0] <= s.P + _EPS * max(1.0, s.P):
                _, _, r = heapq.heappop(s.heap)
                finished_eps = finish_request(s, r) or finished_eps
            fill(s)
            reschedule(s)
            note_gen(now)
            if finished_eps:
                produce()
                try_train()
        elif kind == K_ARRIVE:
            arrive(payload)  # type: ignore[arg-type]
        elif kind == K_CORE:
            if payload != core["epoch"]:
                continue
            core_advance(now)
            finished_eps = False
            if client_q and core["client"] <= _EPS:
                finished_eps = request_done(client_q.popleft())
                core["client"] = 0.0
            job = core["job"]
            if job is not None and core["train"] <= _EPS:
                core["train"], core["job"] = 0.0, None
                if job == "train":
                    if record:
                        train_intervals.append((train_started[0], now))
                    train_done()
                else:
                    push(now, K_SYNC_DONE, None)
            core_schedule()
            if finished_eps:
                produce()
                try_train()
        elif kind == K_TRAIN_DONE:
            train_done()
        elif kind == K_SYNC_DONE:
            version = sm.version + 1
            for s in servers:
                advance(s, now)
                s.paused = False
                if dec.reprefill_after_sync:  # retracted requests are prefilled again
                    s.stall += dec.request_server_s * len(s.heap)
                if s.marks_p[-1] >= s.P - _EPS:  # no progress since the last update
                    s.marks_v[-1] = version
                else:
                    s.marks_p.append(s.P)
                    s.marks_v.append(version)
                reschedule(s)
            sm.set_version(version)
            paused[0] = False
            set_learner("wait")
            wait_since[0] = now
            step_end.append(now)
            if len(step_end) == cfg.warmup_steps:
                snapshot("start")
            if len(step_end) == total_steps:
                snapshot("end")
                break
            note_gen(now)
            produce()
            try_train()
    if record and gen_open[0] is not None and now > gen_open[0]:
        gen_intervals.append((gen_open[0], now))

    t0, busy0, paused0, util0, w0, tr0, sy0, if0 = snap["start"]
    t1, busy1, paused1, util1, w1, tr1, sy1, if1 = snap["end"]
    span = t1 - t0
    if span <= 0:
        raise SimulationError("simulation: timed steps took no time (all costs zero?)")
    ns = cfg.num_servers
    busy, paus, util = busy1 - busy0, paused1 - paused0, util1 - util0
    return SimResult(
        samples_per_s=samples_timed[0] / span, tokens_per_s=samples_timed[1] / span,
        step_s=span / cfg.steps, gen_wait_s=sum(step_wait[cfg.warmup_steps:total_steps]) / cfg.steps,
        gen_idle_frac=1.0 - busy / (span * ns), gen_paused_frac=paus / (span * ns),
        gen_inflight_s=(if1 - if0) / cfg.steps,
        decode_util=util / (span * ns),
        train_idle_frac=1.0 - (tr1 - tr0) / span, learner_wait_frac=(w1 - w0) / span,
        sync_frac=(sy1 - sy0) / span, train_s=(tr1 - tr0) / cfg.steps,
        weight_sync_s=(sy1 - sy0) / cfg.steps,
        inflight_at_sync=sum(sync_inflight[:cfg.steps]) / max(1, len(sync_inflight[:cfg.steps])),
        staleness_token_hist=dict(token_hist), staleness_episode_hist=dict(ep_hist), violations=violations,
        trained=trained, step_end_s=step_end, gen_intervals=gen_intervals, train_intervals=train_intervals,
    )

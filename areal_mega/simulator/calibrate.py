"""Calibrate the simulator on a real run's ``metrics.jsonl`` (what the trainer logs every step).

From each step row the trainer writes (``areal_mega/trainer/loop.py``):

* ``time/rollout_s``: the learner's wait for a batch. In a synchronous run (max_staleness 0)
  generation never overlaps training, so it *is* the generation time of one batch: the decode
  model's ``peak_tokens_per_s`` is fitted so that the simulated synchronous generation time
  matches it (bisection; ``half_batch`` is an input: one concurrency level cannot separate the
  two parameters, see docs/simulator.md).
* ``perf/step_s - time/rollout_s - time/weight_sync_s [- time/save_s]``: the learner's own work
  per step (proximal forward, advantages, train step, logging): the learner model, fitted as
  ``a + b * train/num_tokens`` (least squares; a constant when the batch sizes barely vary).
* ``rollout/gen_inflight_s`` (when logged): the time per step with at least one episode in
  flight. Each run's decode model is fitted on its own value (the simulated in-flight time per
  step matches the logged one), so a run whose generation was slowed -- by training on the
  same cores, or by other load on the machine -- is described by its own speed; without it the
  synchronous run's ``time/rollout_s`` is the target and the async run reuses that fit.
* ``time/weight_sync_s``: the weight sync (a fixed latency: the bytes do not change).
* ``rollout/num_generated_tokens / rollout/num_trajectories`` per step: generation lengths
  (an empirical distribution of per-step means: per-trajectory lengths are not logged), and
  ``(train/num_tokens - generated) / trajectories``: the prompt length.

Timed steps are chosen as tools/bench_async.py does: ``rows[warmup:-1]`` (the last step also
saves the final checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from areal_mega.simulator.model import (
    PLAN_TOLERANCE, DecodeModel, HostModel, LearnerModel, LengthModel, SimConfig, SimulationError, SyncModel, near_best,
)
from areal_mega.simulator.sim import simulate

__all__ = [
    "RunStats", "calibrate_and_predict", "fit_decode", "fit_learner", "fit_lengths", "load_rows", "run_stats",
    "timed"
]


def load_rows(path: str | Path) -> list[dict]:
    """The per-step rows of a metrics.jsonl (eval and other rows skipped)."""
    rows = []
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SimulationError(f"metrics: cannot read {p}: {e.strerror or e}") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise SimulationError(f"metrics: {p}:{i} is not a JSON line") from None
        if isinstance(row, dict) and "perf/step_s" in row and "time/rollout_s" in row:
            rows.append(row)
    if not rows:
        raise SimulationError(f"metrics: {p} has no step rows (perf/step_s, time/rollout_s)")
    return rows


def timed(rows: list[dict], warmup: int) -> list[dict]:
    out = rows[warmup:-1]
    if not out:
        raise SimulationError(f"metrics: no timed steps ({len(rows)} steps, {warmup} warm-up, last excluded)")
    return out


@dataclass
class RunStats:
    samples_per_s: float
    step_s: float
    rollout_s: float
    learner_s: float
    weight_sync_s: float
    trajectories_per_step: float
    staleness_mean: float
    inflight_s: float | None
    """Mean ``rollout/gen_inflight_s`` (None when the run did not log it)."""


def run_stats(rows: list[dict]) -> RunStats:
    wall = sum(r["perf/step_s"] for r in rows)
    mean = lambda k: statistics.fmean(float(r.get(k, 0.0)) for r in rows)  # noqa: E731
    return RunStats(
        samples_per_s=sum(r.get("rollout/num_trajectories", 0.0) for r in rows) / wall, step_s=wall / len(rows),
        rollout_s=mean("time/rollout_s"), learner_s=statistics.fmean(_learner_s(r) for r in rows),
        weight_sync_s=mean("time/weight_sync_s"), trajectories_per_step=mean("rollout/num_trajectories"),
        staleness_mean=mean("staleness/mean"),
        inflight_s=mean("rollout/gen_inflight_s") if all("rollout/gen_inflight_s" in r for r in rows) else None)


def _learner_s(r: dict) -> float:
    return max(0.0, r["perf/step_s"] - r["time/rollout_s"] - r.get("time/weight_sync_s", 0.0) - r.get("time/save_s", 0.0))


def fit_lengths(rows: list[dict], max_tokens: int) -> LengthModel:
    means, prompts = [], []
    for r in rows:
        n = r.get("rollout/num_trajectories", 0.0)
        gen = r.get("rollout/num_generated_tokens", 0.0)
        if n > 0 and gen > 0:
            means.append(max(1, int(round(gen / n))))
            if "train/num_tokens" in r:
                prompts.append(max(0.0, (r["train/num_tokens"] - gen) / n))
    if not means:
        raise SimulationError("metrics: no rollout/num_generated_tokens to take generation lengths from")
    return LengthModel(kind="empirical", samples=tuple(means), max_tokens=max(max_tokens, max(means)),
                       prompt_tokens=int(round(statistics.fmean(prompts))) if prompts else 0)


def fit_learner(rows: list[dict]) -> LearnerModel:
    ys = [_learner_s(r) for r in rows]
    xs = [float(r.get("train/num_tokens", 0.0)) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    if mx > 0 and statistics.pstdev(xs) / mx > 0.05:
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if b > 0 and my - b * mx >= 0:
            return LearnerModel(fixed_s=my - b * mx, per_token_s=b)
    return LearnerModel(fixed_s=my, per_token_s=0.0)


def fit_decode(template: SimConfig, target_s: float, *, half_batch: float, request_latency_s: float = 0.0,
               measure: str = "gen_wait") -> DecodeModel:
    """Peak decode throughput whose simulated time per step matches ``target_s``: with
    ``measure="gen_wait"`` the synchronous generation time (``template`` run at max_staleness
    0), with ``"inflight"`` the time with an episode in flight of ``template`` as it is."""
    if not target_s > request_latency_s:
        raise SimulationError(f"calibration: generation time {target_s:.4f} s <= request latency")

    def decode(peak: float) -> DecodeModel:
        return DecodeModel(peak_tokens_per_s=peak, half_batch=half_batch, request_latency_s=request_latency_s,
                           kv_capacity_tokens=template.decode.kv_capacity_tokens, max_running=template.decode.max_running)

    def simulated(peak: float) -> float:
        if measure == "gen_wait":
            return simulate(dataclasses.replace(template, max_staleness=0, decode=decode(peak))).gen_wait_s
        return simulate(dataclasses.replace(template, decode=decode(peak))).gen_inflight_s

    lo, hi = 1e-3, 1e9  # tokens/s; the simulated time decreases with peak
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if simulated(mid) > target_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-7:
            break
    return decode(math.sqrt(lo * hi))


def calibrate_and_predict(sync_rows: list[dict], async_rows: list[dict], *, batch_size: int, group_size: int,
                          max_staleness: int, max_concurrent: int, max_new_tokens: int, warmup_steps: int,
                          half_batch: float = 32.0, num_servers: int = 1, seed: int = 0) -> dict:
    """Fit on both runs' logged timings, simulate both modes, compare with what they measured.

    Each run is reproduced from its own logged timings (issue: calibration from a real run):
    its learner and weight-sync times, and -- when it logged ``rollout/gen_inflight_s`` -- its
    own decode speed. ``predicted_async_sync_decode`` carries the synchronous run's decode speed
    over to the async run instead, and ``predicted_async_sync_timings_only`` uses the
    synchronous run's timings for everything (true out-of-sample predictions: they cannot see
    what overlapping generation and training on shared cores costs either side)."""
    s_t, a_t = timed(sync_rows, warmup_steps), timed(async_rows, warmup_steps)
    s_stats, a_stats = run_stats(s_t), run_stats(a_t)
    lengths = fit_lengths(sync_rows + async_rows, max_new_tokens)
    steps = len(s_t)
    base = SimConfig(batch_size=batch_size, group_size=group_size, max_staleness=0, max_concurrent=max_concurrent,
                     num_servers=num_servers, steps=steps, warmup_steps=warmup_steps, seed=seed, lengths=lengths,
                     learner=fit_learner(s_t), sync=SyncModel(latency_s=s_stats.weight_sync_s))
    if s_stats.inflight_s is not None:
        decode = fit_decode(base, s_stats.inflight_s, half_batch=half_batch, measure="inflight")
    else:
        decode = fit_decode(base, s_stats.rollout_s, half_batch=half_batch)
    sync_cfg = dataclasses.replace(base, decode=decode)
    cross_decode_cfg = dataclasses.replace(sync_cfg, max_staleness=max_staleness, steps=len(a_t),
                                           learner=fit_learner(a_t), sync=SyncModel(latency_s=a_stats.weight_sync_s))
    async_cfg = cross_decode_cfg
    if a_stats.inflight_s is not None:
        async_cfg = dataclasses.replace(cross_decode_cfg, decode=fit_decode(
            cross_decode_cfg, a_stats.inflight_s, half_batch=half_batch, measure="inflight"))
    cross_cfg = dataclasses.replace(sync_cfg, max_staleness=max_staleness, steps=len(a_t))
    ps, pa, pd, px = simulate(sync_cfg), simulate(async_cfg), simulate(cross_decode_cfg), simulate(cross_cfg)
    ms, ma = s_stats.samples_per_s, a_stats.samples_per_s
    err = max(abs(ps.samples_per_s - ms) / ms, abs(pa.samples_per_s - ma) / ma)
    r4 = lambda x: round(x, 4)  # noqa: E731
    return {
        "predicted_sync": r4(ps.samples_per_s), "measured_sync": r4(ms),
        "predicted_async": r4(pa.samples_per_s), "measured_async": r4(ma), "max_rel_error": r4(err),
        "predicted_async_sync_decode": r4(pd.samples_per_s),
        "rel_error_async_sync_decode": r4(abs(pd.samples_per_s - ma) / ma),
        "predicted_async_sync_timings_only": r4(px.samples_per_s),
        "rel_error_async_sync_timings_only": r4(abs(px.samples_per_s - ma) / ma),
        "predicted_speedup": r4(pa.samples_per_s / ps.samples_per_s), "measured_speedup": r4(ma / ms),
        "predicted_staleness_mean": r4(pa.staleness_mean), "measured_staleness_mean": r4(a_stats.staleness_mean),
        "calibration": {
            "decode_peak_tokens_per_s": r4(decode.peak_tokens_per_s), "decode_half_batch": half_batch,
            "decode_peak_tokens_per_s_async_run": r4(async_cfg.decode.peak_tokens_per_s),
            "decode_fitted_on": "rollout/gen_inflight_s" if s_stats.inflight_s is not None else "time/rollout_s",
            "measured_inflight_s_sync_run": s_stats.inflight_s, "measured_inflight_s_async_run": a_stats.inflight_s,
            "simulated_inflight_s_sync_run": r4(ps.gen_inflight_s), "simulated_inflight_s_async_run": r4(pa.gen_inflight_s),
            "gen_lengths": sorted(set(lengths.samples)), "prompt_tokens": lengths.prompt_tokens,
            "learner_sync_run": dataclasses.asdict(sync_cfg.learner), "learner_async_run": dataclasses.asdict(async_cfg.learner),
            "weight_sync_s_sync_run": r4(s_stats.weight_sync_s), "weight_sync_s_async_run": r4(a_stats.weight_sync_s),
            "measured_gen_s_sync_run": r4(s_stats.rollout_s), "simulated_gen_s_sync_run": r4(ps.gen_wait_s),
        },
        "sim_sync": ps.summary(), "sim_async": pa.summary(),
    }


# ---- out-of-sample validation (tools/bench_simulator.py --validate) --------------------------------


@dataclass
class RunSetting:
    """One trainer run of the validation: the rollout knobs it varies."""

    name: str
    max_staleness: int
    batch_size: int
    group_size: int
    max_new_tokens: int

    def overrides(self, warmup_steps: int, steps: int) -> list[str]:
        """The trainer's config overrides (``max_concurrent = batch_size``, as bench_async)."""
        return [f"trainer.num_steps={warmup_steps + steps + 1}", f"rollout.batch_size={self.batch_size}",
                f"rollout.max_concurrent={self.batch_size}", f"workflow.group_size={self.group_size}",
                f"workflow.sampling.max_new_tokens={self.max_new_tokens}"]


def parse_settings(text: str, *, batch: int, group: int, new: int) -> list[RunSetting]:
    """``"sync:eta=0;b8:eta=1,batch=8"`` -> settings (keys eta, batch, group, new)."""
    keys = {"eta": "max_staleness", "batch": "batch_size", "group": "group_size", "new": "max_new_tokens"}
    out = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        name, _, spec = part.partition(":")
        vals = {"max_staleness": 0, "batch_size": batch, "group_size": group, "max_new_tokens": new}
        for kv in (x.strip() for x in spec.split(",") if x.strip()):
            k, _, v = kv.partition("=")
            if k.strip() not in keys or not v.strip().isdigit():
                raise SimulationError(f"--settings: {kv!r} in {part!r}: expected eta|batch|group|new=<int>")
            vals[keys[k.strip()]] = int(v)
        if not name.strip().isidentifier():
            raise SimulationError(f"--settings: {part!r}: expected name:key=v,...")
        out.append(RunSetting(name=name.strip(), **vals))
    if len({s.name for s in out}) != len(out) or not out:
        raise SimulationError("--settings: need >= 1 run, names unique")
    return out


def _sim_for(setting: RunSetting, *, steps: int, warmup: int, lengths: LengthModel, decode: DecodeModel,
             learner: LearnerModel, sync: SyncModel, host: HostModel) -> SimConfig:
    # the run's own lengths at its cap; the prompt as calibrated
    return SimConfig(batch_size=setting.batch_size, group_size=setting.group_size, max_staleness=setting.max_staleness,
                     max_concurrent=setting.batch_size, steps=steps, warmup_steps=warmup, seed=0,
                     lengths=lengths, decode=decode, learner=learner, sync=sync, host=host)


def _bisect(f, lo: float, hi: float, target: float, iters: int = 60) -> float:
    """x in [lo, hi] with f(x) = target, f increasing (clamped to the ends)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _se(xs: list[float]) -> float:
    """Standard error of the mean of ``xs`` (0 for fewer than two values)."""
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def run_facts(rows: list[dict], warmup: int, setting: RunSetting) -> dict:
    """What one run measured, and the instruments of the why (per timed step)."""
    t = timed(rows, warmup)
    st = run_stats(t)
    r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    acc = [r.get("rollout/accepted_episodes") for r in t]
    interrupts = [r.get("inference/interruptions") for r in rows]
    steps = [r["perf/step_s"] for r in t]
    return {
        "samples_per_s": r4(st.samples_per_s), "step_s": r4(st.step_s), "learner_s": r4(st.learner_s),
        # standard error of the mean step over the timed steps, relative: the run's own noise
        "rel_se": r4(_se(steps) / statistics.fmean(steps)) if len(steps) > 1 else None,
        "rollout_wait_s": r4(st.rollout_s), "weight_sync_s": r4(st.weight_sync_s), "inflight_s": r4(st.inflight_s),
        "staleness_mean": r4(st.staleness_mean),
        # > batch_size: generation produced more than training consumed (the ready pool grew):
        # work done inside the timed window that no timed step trains on
        "accepted_episodes_per_step": r4(statistics.fmean(acc)) if None not in acc else None,
        "interruptions": (interrupts[-1] - interrupts[warmup]) if None not in interrupts else None,
        "gen_tokens_per_traj": r4(statistics.fmean(r["rollout/num_generated_tokens"] / r["rollout/num_trajectories"]
                                                   for r in t)),
    }


def _check_calibration_runs(by_name: dict[str, RunSetting], calibrate_on: list[str]) -> None:
    """The calibration runs exist, and each async one has a synchronous run of its workload."""
    missing = [c for c in calibrate_on if c not in by_name]
    if missing or not calibrate_on:
        raise SimulationError(f"--calibrate-on: {missing or calibrate_on} not among the settings {list(by_name)}")
    work_of = lambda s: (s.batch_size, s.group_size, s.max_new_tokens)  # noqa: E731
    sync_work = {work_of(by_name[c]) for c in calibrate_on if by_name[c].max_staleness == 0}
    for c in calibrate_on:  # the overlap's costs are what the async run adds to the learner curve at its tokens
        if sync_work and by_name[c].max_staleness > 0 and work_of(by_name[c]) not in sync_work:
            raise SimulationError(f"--calibrate-on: {c} (batch {by_name[c].batch_size}, {by_name[c].max_new_tokens} new "
                                  "tokens) has no synchronous calibration run of its workload, which the learner's step "
                                  "at its tokens comes from")


@dataclass
class _Runs:
    """The measured runs of every setting: all rounds' timed steps pooled (``rows``: warm-up of
    the first round, the timed steps, the last round's final step) and each round's own."""

    rows: dict[str, list[dict]]
    per_round: dict[str, list[list[dict]]]
    rounds: int
    warmup: int

    @classmethod
    def load(cls, work: Path, settings: list[RunSetting], rounds: int, warmup: int) -> "_Runs":
        rows: dict[str, list[dict]] = {}
        per_round: dict[str, list[list[dict]]] = {}
        for s in settings:
            runs = [load_rows(work / f"{s.name}{r}" / "metrics.jsonl") for r in range(rounds)]
            mid = [row for run in runs for row in run[warmup:-1]]  # pooled timed steps, one trim
            rows[s.name] = runs[0][:warmup] + mid + runs[-1][-1:]
            per_round[s.name] = [timed(run, warmup) for run in runs]
        return cls(rows, per_round, rounds, warmup)

    def timed(self, name: str) -> list[dict]:
        return timed(self.rows[name], self.warmup)

    def mean_se(self, runs: list[RunSetting], value: Callable[[list[dict]], float]) -> tuple[float, float]:
        """``value`` over these settings' timed steps, and its standard error: the larger of the
        steps' and, with >= 2 rounds, the rounds' (runs minutes apart differ more than one run's
        steps do: the machine's speed drifts)."""
        steps = [value([r]) for s in runs for r in self.timed(s.name)]
        means = [value(t) for s in runs for t in self.per_round[s.name]]
        return statistics.fmean(steps), max(_se(steps), _se(means) if self.rounds > 1 else 0.0)

    def facts(self, settings: list[RunSetting]) -> dict[str, dict]:
        """run_facts per setting, with each round's samples/s and their relative standard error."""
        facts = {s.name: run_facts(self.rows[s.name], self.warmup, s) for s in settings}
        for name, timed_runs in self.per_round.items():
            # with >= 2 rounds the standard error of the mean also comes from the rounds (mean_se)
            xs = [run_stats(t).samples_per_s for t in timed_runs]
            facts[name]["samples_per_s_rounds"] = [round(x, 4) for x in xs]
            facts[name]["rel_se_rounds"] = round(_se(xs) / statistics.fmean(xs), 4) if len(xs) > 1 else None
        return facts


class _Calibration:
    """The models :func:`validate` fits, one step per method, in the order ``fit`` runs them
    (docstring of :func:`validate`)."""

    def __init__(self, runs: _Runs, facts: dict[str, dict], cal: list[RunSetting], fit) -> None:
        self.runs, self.facts, self.cal = runs, facts, cal
        self.calibrate_on = {s.name for s in cal}
        self.sync_cal = [s for s in cal if s.max_staleness == 0] or cal
        self.async_cal = [s for s in cal if s.max_staleness > 0]
        prompts = [fit_lengths(runs.rows[s.name], s.max_new_tokens).prompt_tokens for s in cal]
        from areal_mega.simulator.sweep import fit_learner_curve

        # the learner's step through the synchronous runs (one point per batch size): on this CPU
        # host it is not affine in the tokens, so a least-squares line misses both ends
        self.learner = fit_learner_curve([(statistics.fmean(float(r.get("train/num_tokens", 0.0))
                                                            for r in runs.timed(s.name)),
                                           facts[s.name]["learner_s"]) for s in self.sync_cal])
        self.prompt = int(round(statistics.fmean(prompts)))
        self.swept = fit.decode_model(prompt_tokens=self.prompt)
        self.decode = self.swept
        # Two decode speeds, each from the runs of its regime: generation measured alone (the
        # synchronous runs: the learner waits) ran 1.3-1.5x slower than generation overlapping
        # training (the asynchronous run's own in-flight time) on this machine, which one scale
        # cannot reproduce (docs/simulator.md, "Out-of-sample validation").
        self.decode_overlap: DecodeModel | None = None
        self.sync = SyncModel(latency_s=statistics.fmean(facts[s.name]["weight_sync_s"] for s in self.sync_cal))
        self.client_s, self.speed, self.speed_overlap = 0.0, 1.0, None
        self.k_identified = True
        self.gen_target = statistics.fmean(facts[s.name]["rollout_wait_s"] for s in self.sync_cal)
        a = self.async_cal
        self.learner_target = statistics.fmean(facts[s.name]["learner_s"] for s in a) if a else 0.0
        self.sync_target = statistics.fmean(facts[s.name]["weight_sync_s"] for s in a) if a else 0.0

    @property
    def host(self) -> HostModel:
        return HostModel(client_s_per_request=self.client_s)

    def scaled(self, k: float) -> DecodeModel:
        """The sweep's decode model at ``k`` times its times (its shape kept: half_batch, the
        per-request share): the machine's speed during the runs, not during the sweep."""
        sw = self.swept
        return dataclasses.replace(sw, peak_tokens_per_s=sw.peak_tokens_per_s / k,
                                   request_server_s=sw.request_server_s * k, request_latency_s=sw.request_latency_s * k)

    def lengths_of(self, s: RunSetting) -> LengthModel:
        # the length each run generates is the workload's (a measured run's own, else the cap: the
        # tiny model rarely stops early); the planner sees the same via workload.lengths_from
        ln = fit_lengths(self.runs.rows[s.name], s.max_new_tokens) if s.name in self.calibrate_on else None
        mean = ln.samples and statistics.fmean(ln.samples) if ln else s.max_new_tokens
        return LengthModel(kind="constant", mean_tokens=max(1.0, mean), max_tokens=s.max_new_tokens,
                           prompt_tokens=self.prompt)

    def cfg_for(self, s: RunSetting, host: HostModel) -> SimConfig:
        d = self.decode if s.max_staleness == 0 or self.decode_overlap is None else self.decode_overlap
        return _sim_for(s, steps=len(self.runs.timed(s.name)), warmup=self.runs.warmup, lengths=self.lengths_of(s),
                        decode=d, learner=self.learner, sync=self.sync, host=host)

    def simulate_mean(self, runs: list[RunSetting], metric: str) -> float:
        return statistics.fmean(getattr(simulate(self.cfg_for(s, self.host)), metric) for s in runs)

    def fit_scale(self, runs: list[RunSetting], metric: str, target: float, attr: str) -> float:
        """The decode time scale k (the sweep's shape at k times its times) at which the simulated
        ``metric`` of ``runs`` matches ``target`` (their mean); installs that model as ``attr``."""
        def value(logk: float) -> float:
            setattr(self, attr, self.scaled(math.exp(logk)))
            return self.simulate_mean(runs, metric)
        k = math.exp(_bisect(value, math.log(1e-3), math.log(1e3), target))
        setattr(self, attr, self.scaled(k))
        return k

    def fit_speed(self) -> None:
        """The synchronous calibration runs' generation (fitted last: the synchronous run is
        reproduced whatever the other fits found)."""
        self.speed = self.fit_scale(self.sync_cal, "gen_wait_s", self.gen_target, "decode")

    def fit_client_work(self) -> None:
        """Client work per request: what stretches the async runs' learner step, alternated with
        the synchronous speed to the fixed point (the sync run's generation holds client work
        too); bounded by the synchronous run, whose generation time holds a batch's client work."""
        cap = 0.9 * self.gen_target / max(s.batch_size * s.group_size for s in self.sync_cal)

        def train_s(c: float) -> float:
            self_c, self.client_s = self.client_s, c
            try:
                return self.simulate_mean(self.async_cal, "train_s")
            finally:
                self.client_s = self_c
        for _ in range(8):
            prev = self.client_s
            self.client_s = _bisect(train_s, 0.0, cap, self.learner_target)
            self.fit_speed()
            if abs(self.client_s - prev) <= 1e-3 * max(self.client_s, 1e-9):
                break

    def fit_overlap_speed(self) -> None:
        """The asynchronous calibration runs' in-flight time (rollout/gen_inflight_s, pauses
        included), with the client work fixed -- alternating it with this one as well has a second
        fixed point (slower decode, less client work) that misses the async run's throughput;
        skipped when not logged."""
        inflight = [self.facts[s.name]["inflight_s"] for s in self.async_cal]
        if None not in inflight:
            self.speed_overlap = self.fit_scale(self.async_cal, "gen_inflight_s", statistics.fmean(inflight),
                                                "decode_overlap")

    def fit_sync_cost(self) -> None:
        """The sync's cost per in-flight request. Identified only when requests are in flight at the
        simulated syncs and the async runs' sync is slower than the synchronous runs' by more than
        twice the standard error of the difference: a cost fitted to noise would rank the bounds
        by that noise."""
        def sync_s(k: float) -> float:
            self.sync = dataclasses.replace(self.sync, per_inflight_request_s=k)
            return self.simulate_mean(self.async_cal, "weight_sync_s")
        probe = [simulate(self.cfg_for(s, self.host)) for s in self.async_cal]
        sync_s_of = lambda steps: statistics.fmean(r["time/weight_sync_s"] for r in steps)  # noqa: E731
        (a_mean, a_se), (s_mean, s_se) = self.runs.mean_se(self.async_cal, sync_s_of), \
            self.runs.mean_se(self.sync_cal, sync_s_of)
        self.k_identified = any(r.inflight_at_sync > 0 for r in probe) and a_mean - s_mean > 2.0 * math.hypot(a_se, s_se)
        k = _bisect(sync_s, 0.0, 1.0, self.sync_target) if self.k_identified else 0.0
        self.sync = dataclasses.replace(self.sync, per_inflight_request_s=k)

    def fit(self) -> "_Calibration":
        self.fit_speed()
        if self.async_cal:
            self.fit_client_work()
            self.fit_overlap_speed()
            self.fit_sync_cost()
        return self

    def predict(self, s: RunSetting) -> dict:
        """One setting's prediction, with and without the overlap's costs, against its measurement."""
        res = simulate(self.cfg_for(s, self.host))
        base = simulate(dataclasses.replace(self.cfg_for(s, HostModel()), sync=SyncModel(latency_s=self.sync.latency_s)))
        m = self.facts[s.name]["samples_per_s"]
        return {"setting": dataclasses.asdict(s), "calibration_run": s.name in self.calibrate_on,
                "predicted": round(res.samples_per_s, 4), "measured": m,
                "rel_error": round(abs(res.samples_per_s - m) / m, 4),
                "predicted_without_overlap_costs": round(base.samples_per_s, 4),
                "rel_error_without_overlap_costs": round(abs(base.samples_per_s - m) / m, 4),
                "predicted_learner_s": round(res.train_s, 4), "predicted_weight_sync_s": round(res.weight_sync_s, 4),
                "predicted_inflight_at_sync": round(res.inflight_at_sync, 2),
                "predicted_staleness_mean": round(res.staleness_mean, 4),
                "measured_facts": self.facts[s.name]}

    def summary(self, fit) -> dict:
        r4 = lambda x: round(x, 4)  # noqa: E731
        return {"decode_sweep": {k: v for k, v in fit.summary().items() if k != "points"},
                "decode_sweep_points": len(fit.points), "decode_sweep_rms_rel_error": fit.rms_rel_error,
                "learner": dataclasses.asdict(self.learner), "weight_sync_s": r4(self.sync.latency_s),
                "client_s_per_request": float(f"{self.client_s:.6g}"), "prompt_tokens": self.prompt,
                "sync_s_per_inflight_request": float(f"{self.sync.per_inflight_request_s:.6g}"),
                "sync_s_per_inflight_request_identified": self.k_identified,
                "decode_time_scale_vs_sweep": round(self.speed, 4),
                "decode_time_scale_vs_sweep_overlapped": None if self.speed_overlap is None
                else round(self.speed_overlap, 4)}


class _Ranking:
    """Predicted against measured order of the settings, ties from the planner's tolerance
    (predictions) and the measurement's noise (measurements)."""

    def __init__(self, preds: dict[str, dict], by_name: dict[str, RunSetting]) -> None:
        self.preds, self.by_name = preds, by_name

    def rank(self, key: str, names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: -self.preds[n][key])

    def rel_se(self, name: str) -> float:
        """A setting's measured samples/s, relative standard error: the larger of the steps'
        (within its runs) and the rounds' (between them; None with one round)."""
        f = self.preds[name]["measured_facts"]
        return max(f["rel_se"] or 0.0, f.get("rel_se_rounds") or 0.0)

    def order(self, a: str, b: str, key: str) -> int:
        """-1, 0, 1: a below, tied with, above b. Predictions tie within the planner's own
        tolerance (PLAN_TOLERANCE); measurements within twice the standard error of their
        difference (rel_se), as no ranking finer than the noise is measurable."""
        x, y = self.preds[a][key], self.preds[b][key]
        if key == "predicted":
            tie = PLAN_TOLERANCE * max(x, y)
        else:
            tie = 2.0 * math.hypot(self.rel_se(a) * x, self.rel_se(b) * y)
        return 0 if abs(x - y) <= tie else (1 if x > y else -1)

    def same_order(self, names: list[str]) -> bool:
        return all(self.order(a, b, "predicted") == self.order(a, b, "measured")
                   for i, a in enumerate(names) for b in names[i + 1:])

    def consistent(self, names: list[str]) -> bool:
        """No pair the measurement resolves is predicted otherwise (measured ties allow any order)."""
        return all(self.order(a, b, "predicted") == m for i, a in enumerate(names) for b in names[i + 1:]
                   if (m := self.order(a, b, "measured")) != 0)

    def choice(self, names: list[str]) -> dict:
        """The bound the planner would recommend among ``names`` (its rule: the smallest
        max_staleness within PLAN_TOLERANCE of the best prediction) against the measured best:
        right when its measured throughput is not below the best's (order(), with the noise)."""
        if not names:
            return {}
        preds = self.preds
        top = max(preds[n]["predicted"] for n in names)
        pick = min((n for n in names if near_best(preds[n]["predicted"], top)),
                   key=lambda n: self.by_name[n].max_staleness)
        best = max(names, key=lambda n: preds[n]["measured"])
        return {"planner": pick, "measured_best": best, "right": self.order(pick, best, "measured") >= 0}

    def report(self, eta_runs: list[str]) -> dict:
        """The whole ranking, and the staleness ranking among ``eta_runs``."""
        names = list(self.preds)
        return {
            "ranking_predicted": self.rank("predicted", names), "ranking_measured": self.rank("measured", names),
            # equal: every pair in the same order, ties included (order()); *_strict: sorted lists equal
            "ranking_equal": self.same_order(names),
            "ranking_equal_strict": self.rank("predicted", names) == self.rank("measured", names),
            "ranking_consistent": self.consistent(names),
            "staleness_ranking_predicted": self.rank("predicted", eta_runs),
            "staleness_ranking_measured": self.rank("measured", eta_runs),
            "staleness_ranking_equal": self.same_order(eta_runs),
            "staleness_ranking_equal_strict": self.rank("predicted", eta_runs) == self.rank("measured", eta_runs),
            "staleness_ranking_consistent": self.consistent(eta_runs),
            "staleness_pairs": {f"{a}|{b}": {"predicted": self.order(a, b, "predicted"),
                                             "measured": self.order(a, b, "measured")}
                                for i, a in enumerate(eta_runs) for b in eta_runs[i + 1:]},
            "staleness_choice": self.choice(eta_runs),
        }


def validate(work: Path, settings: list[RunSetting], calibrate_on: list[str], *, warmup_steps: int) -> dict:
    """Calibrate on the runs named ``calibrate_on`` (+ the decode sweep), predict every other run.

    * decode: the sweep's fit (``<work>/decode_sweep.json``: concurrency x length x prompt
      against the same server), not the runs;
    * learner: the curve through the synchronous calibration runs' learner times, one point per
      batch size (there nothing else runs on its core; one batch size gives a constant);
    * weight sync: their mean ``time/weight_sync_s``;
    * client work per request on the learner's core (``HostModel``): bisection so that the
      asynchronous calibration runs' simulated learner time matches theirs (the overlap's cost);
    * the decode speed twice, the sweep's shape at the runs' speed: for synchronous settings from
      the synchronous calibration runs' generation time, for asynchronous ones from the
      asynchronous calibration runs' in-flight time (generation overlapping training).
    """
    from areal_mega.simulator.sweep import DecodeFit

    by_name = {s.name: s for s in settings}
    _check_calibration_runs(by_name, calibrate_on)
    try:
        meta = json.loads((work / "validate_runs.json").read_text())
    except (OSError, ValueError) as e:
        raise SimulationError(f"validate: no measurement in {work} ({e}); run without --reuse") from None
    fit = DecodeFit.load(work / "decode_sweep.json")
    runs = _Runs.load(work, settings, int(meta.get("rounds", 1)), warmup_steps)
    facts = runs.facts(settings)
    cal = [by_name[c] for c in calibrate_on]
    model = _Calibration(runs, facts, cal, fit).fit()
    preds = {s.name: model.predict(s) for s in settings}
    out_of_sample = [n for n in preds if not preds[n]["calibration_run"]]
    # the staleness ranking: runs that differ from the calibration's workload only in max_staleness
    ref = cal[0]
    eta_runs = [s.name for s in settings if (s.batch_size, s.group_size, s.max_new_tokens)
                == (ref.batch_size, ref.group_size, ref.max_new_tokens)]
    r4 = lambda x: round(x, 4)  # noqa: E731
    return {
        "predictions": preds,
        "out_of_sample": out_of_sample,
        "worst_rel_error": r4(max((preds[n]["rel_error"] for n in out_of_sample), default=0.0)),
        "worst_rel_error_without_overlap_costs": r4(max((preds[n]["rel_error_without_overlap_costs"] for n in out_of_sample),
                                                  default=0.0)),
        **_Ranking(preds, by_name).report(eta_runs),
        "calibrated_on": calibrate_on,
        "calibration": model.summary(fit),
        "loadavg": meta.get("loadavg"),
    }

"""Throughput simulator (areal_mega.simulator): pure Python, a few seconds.

The simulator drives the real admission (StalenessManager) and batch-formation
(can_form_batch / take_oldest) code; these tests check that it never violates the staleness
bound, that max_staleness 0 is exactly synchronous RL (closed form), that async is never
slower than sync, the idle fractions, the calibration arithmetic and the planner's CLI.
"""

import dataclasses
import json
import math
import random
import sys
from collections import Counter

import pytest

from areal_mega.simulator import DecodeModel, LearnerModel, LengthModel, SimConfig, SimulationError, SyncModel, simulate


def _det(eta=0, B=4, G=8, L=50, P=10, peak=2000.0, half=16.0, a=0.3, b=1e-4, S=0.05, servers=1, steps=6, warm=2):
    return SimConfig(batch_size=B, group_size=G, max_staleness=eta, max_concurrent=B * (eta + 1),
                     num_servers=servers, steps=steps, warmup_steps=warm,
                     lengths=LengthModel(kind="constant", mean_tokens=L, prompt_tokens=P),
                     decode=DecodeModel(peak_tokens_per_s=peak, half_batch=half),
                     learner=LearnerModel(fixed_s=a, per_token_s=b), sync=SyncModel(latency_s=S))


def _random_cfg(rng: random.Random, eta: int) -> SimConfig:
    B = rng.randint(1, 6)
    return SimConfig(
        batch_size=B, group_size=rng.randint(1, 4), max_staleness=eta,
        max_concurrent=rng.choice([0, B, B * (eta + 1), 3 * B + 1]), num_servers=rng.randint(1, 3),
        steps=rng.randint(4, 10), warmup_steps=rng.randint(0, 3), reject_prob=rng.choice([0.0, 0.0, 0.3]),
        seed=rng.randrange(10**6),
        lengths=LengthModel(kind="lognormal", mean_tokens=rng.uniform(5, 200), sigma=rng.uniform(0.2, 1.5),
                            max_tokens=rng.choice([64, 400, 5000]), prompt_tokens=rng.randint(0, 50)),
        decode=DecodeModel(peak_tokens_per_s=rng.uniform(500, 5000), half_batch=rng.uniform(0, 32),
                           kv_capacity_tokens=rng.choice([0, 0, 3000]), max_running=rng.choice([0, 0, 5]),
                           request_latency_s=rng.choice([0.0, 0.01])),
        learner=LearnerModel(fixed_s=rng.uniform(0.0, 0.5), per_token_s=rng.uniform(0, 1e-3)),
        sync=SyncModel(latency_s=rng.uniform(0, 0.2)),
    )


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_bound_never_violated_random_configs(eta):
    rng = random.Random(100 + eta)
    seen_stale = 0
    for _ in range(25):
        cfg = _random_cfg(rng, eta)
        res = simulate(cfg)
        assert res.violations == 0
        assert len(res.trained) == cfg.batch_size * (cfg.steps + cfg.warmup_steps)
        for ep in res.trained:
            assert ep.admit_version >= ep.train_version - eta
            assert ep.min_token_version >= ep.admit_version  # tokens only get newer
            assert ep.min_token_version >= ep.train_version - eta
        assert res.staleness_max <= eta
        seen_stale = max(seen_stale, res.staleness_max)
        if eta == 0:
            assert set(res.staleness_token_hist) <= {0}
    if eta > 0:
        assert seen_stale > 0, "no random config ever overlapped generation and training"


def test_sync_is_exactly_synchronous_closed_form():
    B, G, L, P, peak, half, a, b, S = 4, 8, 50, 10, 2000.0, 16.0, 0.3, 1e-4, 0.05
    cfg = _det(0, B, G, L, P, peak, half, a, b, S)
    res = simulate(cfg, record=True)
    n = B * G
    gen = L * (n + half) / peak  # all n requests decode together from the sync's end
    train = a + b * n * (P + L)
    step = gen + train + S
    assert res.step_s == pytest.approx(step, rel=1e-9)
    assert res.samples_per_s == pytest.approx(n / step, rel=1e-9)
    assert res.gen_wait_s == pytest.approx(gen, rel=1e-9)
    for i, t in enumerate(res.step_end_s):
        assert t == pytest.approx((i + 1) * step, rel=1e-9)
    # generation and training never overlap
    for g0, g1 in res.gen_intervals:
        for t0, t1 in res.train_intervals:
            assert min(g1, t1) - max(g0, t0) <= 1e-9, ((g0, g1), (t0, t1))
    assert res.gen_intervals and res.train_intervals
    # idle fractions, closed form
    assert res.gen_idle_frac == pytest.approx((train + S) / step, rel=1e-9)
    assert res.gen_paused_frac == pytest.approx(S / step, rel=1e-9)
    assert res.train_idle_frac == pytest.approx((gen + S) / step, rel=1e-9)
    assert res.learner_wait_frac == pytest.approx(gen / step, rel=1e-9)
    assert res.sync_frac == pytest.approx(S / step, rel=1e-9)
    assert res.decode_util == pytest.approx(gen / step * n / (n + half), rel=1e-9)


def test_sync_never_overlaps_random_configs():
    rng = random.Random(7)
    for _ in range(15):
        res = simulate(_random_cfg(rng, 0), record=True)
        for g0, g1 in res.gen_intervals:
            for t0, t1 in res.train_intervals:
                assert min(g1, t1) - max(g0, t0) <= 1e-9


def test_async_at_least_sync():
    rng = random.Random(3)
    for _ in range(12):
        base = _random_cfg(rng, 0)
        base.max_concurrent = 0
        sync = simulate(base)
        for eta in (1, 2, 4):
            base.max_staleness = eta
            asyn = simulate(base)
            assert asyn.samples_per_s >= 0.99 * sync.samples_per_s, (eta, asyn.summary(), sync.summary())
        base.max_staleness = 0
    # deterministic, balanced G ~ T: async approaches max(T + S, G + S) per step
    s, a2 = simulate(_det(0)), simulate(_det(2))
    assert a2.samples_per_s > 1.3 * s.samples_per_s


def test_idle_fractions_sane():
    rng = random.Random(11)
    for eta in (0, 2):
        for _ in range(10):
            r = simulate(_random_cfg(rng, eta))
            for f in (r.gen_idle_frac, r.gen_paused_frac, r.decode_util, r.train_idle_frac,
                      r.learner_wait_frac, r.sync_frac):
                assert -1e-9 <= f <= 1 + 1e-9
            assert r.gen_paused_frac <= r.gen_idle_frac + 1e-9
            assert r.train_idle_frac == pytest.approx(r.learner_wait_frac + r.sync_frac, abs=1e-9)
    # learner-bound async: the learner never waits in steady state
    r = simulate(_det(4, a=4.0, b=0.0, steps=6, warm=6))  # generation needs <= 1.2 s a batch
    assert r.learner_wait_frac < 1e-9 and r.gen_idle_frac > 0.6


def test_interrupted_requests_carry_mixed_versions():
    # long requests, short learner step: generation spans weight updates
    cfg = _det(2, B=2, G=2, L=4000, peak=1000.0, half=0.0, a=0.2, b=0.0, S=0.01, steps=6)
    res = simulate(cfg)
    assert res.violations == 0
    assert len(res.staleness_token_hist) >= 2


def test_kv_capacity_queues_requests():
    free = simulate(_det(0, B=4, G=4, L=100, half=16.0))  # 16 together: 100 * 32 / 2000 = 1.6 s
    tight = _det(0, B=4, G=4, L=100, half=16.0)
    tight.decode.kv_capacity_tokens = 2 * 110  # two at a time: 8 x 100 * 18 / 2000 = 7.2 s
    assert simulate(tight).gen_wait_s == pytest.approx(4.5 * free.gen_wait_s, rel=1e-6)


def test_bad_input_is_a_simulation_error():
    with pytest.raises(SimulationError, match="batch_size"):
        simulate(SimConfig(batch_size=0))
    with pytest.raises(SimulationError, match="peak_tokens_per_s"):
        simulate(SimConfig(decode=DecodeModel(peak_tokens_per_s=0)))
    with pytest.raises(SimulationError, match="lengths.samples"):
        simulate(SimConfig(lengths=LengthModel(kind="empirical")))


@pytest.mark.slow  # a fresh interpreter (the only way to see what an import pulls in)
def test_no_torch_import():
    import subprocess

    code = ("import sys, areal_mega.simulator.sim, areal_mega.simulator.planner, areal_mega.simulator.calibrate; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the simulation's parts, one at a time --------------------------------------------------------


def _req(sim, length, footprint=None, server=0):
    from areal_mega.simulator.sim import _Episode, _Req

    r = _Req(_Episode(0, 0, 1), length, length if footprint is None else footprint)
    r.server = server
    return r


def test_server_advance_prefill_then_fluid_decoding():
    from areal_mega.simulator.sim import Simulation

    sim = Simulation(_det(peak=1000.0, half=8.0))
    s = sim.servers[0]
    for r in (_req(sim, 500), _req(sim, 700)):
        s.queue.append(r)
    sim.fill(s)
    assert len(s.heap) == 2 and s.kv == 1200
    s.stall = 0.25  # prefill owed: nothing decodes for 0.25 s
    sim.advance(s, 1.0)
    assert s.stall == 0.0 and s.busy == pytest.approx(1.0)
    assert s.P == pytest.approx(0.75 * 1000.0 / (2 + 8.0))  # 75 tokens per request
    assert s.util == pytest.approx(0.75 * 2 / 10)
    s.paused = True
    sim.advance(s, 3.0)
    assert s.P == pytest.approx(75.0) and s.paused_t == pytest.approx(2.0)  # paused: no progress


def test_server_fill_respects_kv_capacity_and_max_running():
    from areal_mega.simulator.sim import Simulation

    cfg = _det()
    cfg.decode.kv_capacity_tokens = 250
    sim = Simulation(cfg)
    s = sim.servers[0]
    s.queue.extend(_req(sim, 100) for _ in range(4))
    sim.fill(s)
    assert (len(s.heap), len(s.queue), s.kv) == (2, 2, 200)
    big = Simulation(cfg).servers[0]
    big.queue.append(_req(sim, 1000))  # an oversized request runs alone rather than never
    Simulation(cfg).fill(big)
    assert len(big.heap) == 1
    cfg.decode.kv_capacity_tokens, cfg.decode.max_running = 0, 3
    sim = Simulation(cfg)
    s = sim.servers[0]
    s.queue.extend(_req(sim, 100) for _ in range(5))
    sim.fill(s)
    assert (len(s.heap), len(s.queue)) == (3, 2)


def test_reschedule_pushes_the_next_finish():
    from areal_mega.simulator.sim import K_SERVER, Simulation

    sim = Simulation(_det(peak=1000.0, half=8.0))
    s = sim.servers[0]
    s.queue.extend([_req(sim, 100), _req(sim, 300)])
    sim.fill(s)
    s.stall = 0.5
    sim.now = 2.0
    sim.reschedule(s)
    t, _, kind, (srv, epoch) = sim.events[-1]
    assert kind == K_SERVER and srv is s and epoch == s.epoch == 1
    assert t == pytest.approx(2.0 + 0.5 + 100 * (2 + 8.0) / 1000.0)
    s.paused = True
    sim.reschedule(s)
    assert len(sim.events) == 1 and s.epoch == 2  # paused: nothing pushed, the old event goes stale


def test_token_versions_split_at_weight_updates():
    from areal_mega.simulator.sim import Simulation, _Server

    s = _Server(0)
    s.marks_p, s.marks_v = [0.0, 30.0, 45.0], [0, 1, 2]
    r = _req(None, 50)
    r.p_start = 10.0
    got = Counter({0: 1})
    Simulation.token_versions(s, r, got)  # added to what the episode has
    assert got == {0: 21, 1: 15, 2: 15}
    r.p_start = 50.0  # after the last update: all the newest version
    Simulation.token_versions(s, r, got := Counter())
    assert got == {2: 50}


def test_core_shares_the_learner_cpu_equally():
    from areal_mega.simulator.sim import _Core

    core = _Core(client_s=0.2)
    assert core.rates() == (0.0, 0.0) and core.next_due() is None
    core.job, core.train = "train", 1.0
    assert core.next_due() == pytest.approx(1.0)
    core.queue.append(object())
    assert core.next_due() == pytest.approx(0.4)  # the client's 0.2 s at half the core
    assert core.rates() == (0.5, 0.5) and core.client == pytest.approx(0.2)
    core.advance(0.4)
    assert core.client == pytest.approx(0.0) and core.train == pytest.approx(0.8)


def test_account_counts_a_batch_and_flags_an_over_stale_episode():
    from areal_mega.simulator.sim import Simulation, _Episode

    sim = Simulation(_det(eta=1, G=2))
    sim.sm.set_version(1)
    sim.sm.set_version(2)
    ok, old = _Episode(0, 1, 2), _Episode(1, 0, 2)
    ok.versions.update({1: 30, 2: 10})
    old.versions.update({0: 5})
    ok.gen_tokens, ok.tokens, old.gen_tokens, old.tokens = 40, 60, 5, 25
    assert sim.account([ok], timed=True) == 60
    assert sim.violations == 0
    assert dict(sim.token_hist) == {1: 30, 0: 10} and dict(sim.ep_hist) == {1: 1}
    assert (sim.samples_timed, sim.tokens_timed) == (2, 40)
    assert sim.account([old], timed=False) == 25
    assert sim.violations == 1  # admitted at 0, trained at 2 > max_staleness 1
    assert sim.samples_timed == 2  # untimed: counted in the bound check only
    assert [e.min_token_version for e in sim.trained] == [1, 0]


def test_sync_done_marks_new_weights_and_resumes():
    from areal_mega.simulator.sim import Simulation

    sim = Simulation(_det(steps=3, warm=1))
    s = sim.servers[0]
    s.P, s.paused = 40.0, True
    sim.paused = True
    sim.now = 1.5
    assert sim.on_sync_done() is False
    assert s.marks_p == [0.0, 40.0] and s.marks_v == [0, 1] and not s.paused
    assert sim.sm.version == 1 and sim.step_end == [1.5] and "start" in sim.snap
    sim.on_sync_done()  # at once, no progress since: the last mark takes the new version
    assert s.marks_p == [0.0, 40.0] and s.marks_v == [0, 2]


def test_simulation_object_runs_as_simulate():
    from areal_mega.simulator.sim import Simulation

    a, b = Simulation(_det(2)).run(), simulate(_det(2))
    assert a.summary() == b.summary() and a.step_end_s == b.step_end_s


# ---- calibration ---------------------------------------------------------------------------------


def _rows(n, *, rollout, learner, sync, traj=32, gen=250, total=540, staleness=0.0, inflight=None):
    extra = {} if inflight is None else {"rollout/gen_inflight_s": inflight}
    return [{"step": i + 1, "perf/step_s": rollout + learner + sync, "time/rollout_s": rollout,
             "time/prox_logp_s": learner / 3, "time/train_s": learner * 2 / 3, "time/weight_sync_s": sync,
             "rollout/num_trajectories": float(traj), "rollout/num_generated_tokens": float(gen),
             "train/num_tokens": float(total), "staleness/mean": staleness, **extra} for i in range(n)]


def test_calibration_reproduces_a_consistent_run(tmp_path):
    from areal_mega.simulator.calibrate import calibrate_and_predict, load_rows

    # A synthetic "measurement" made by the simulator itself: calibration must get it back.
    true = _det(0, B=4, G=8, L=8, P=9, peak=3000.0, half=32.0, a=0.11, b=0.0, S=0.035, steps=8)
    sync = simulate(true)
    asyn = simulate(SimConfig(**{**true.__dict__, "max_staleness": 2, "max_concurrent": 4}))
    sync_rows = _rows(11, rollout=sync.gen_wait_s, learner=0.11, sync=0.035, gen=256, total=32 * 17)
    async_rows = _rows(11, rollout=asyn.gen_wait_s, learner=0.11, sync=0.035, gen=256, total=32 * 17)
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in sync_rows) + "\n" + json.dumps({"eval_step": 3}) + "\n")
    assert len(load_rows(p)) == 11
    res = calibrate_and_predict(sync_rows, async_rows, batch_size=4, group_size=8, max_staleness=2, max_concurrent=4,
                                max_new_tokens=8, warmup_steps=2, half_batch=32.0)
    assert res["calibration"]["decode_peak_tokens_per_s"] == pytest.approx(3000.0, rel=1e-4)
    assert res["predicted_sync"] == pytest.approx(sync.samples_per_s, rel=1e-4)
    assert res["predicted_async"] == pytest.approx(asyn.samples_per_s, rel=1e-3)
    assert res["max_rel_error"] < 0.01 + abs(asyn.samples_per_s - res["measured_async"]) / res["measured_async"]


def test_calibration_fits_each_runs_own_decode_speed():
    """A run whose generation ran at a third of the speed (training on the same cores, other load)
    is reproduced from its own logged in-flight time; carrying the other run's decode speed over
    (the control) mispredicts it."""
    from areal_mega.simulator.calibrate import calibrate_and_predict

    true = _det(0, B=4, G=8, L=8, P=9, peak=3000.0, half=32.0, a=0.11, b=0.0, S=0.035, steps=8)
    sync = simulate(true)
    slow = simulate(SimConfig(**{**true.__dict__, "max_staleness": 2, "max_concurrent": 4,
                                 "decode": DecodeModel(peak_tokens_per_s=1000.0, half_batch=32.0)}))
    assert 0 < sync.gen_inflight_s and 0 < slow.gen_inflight_s <= slow.step_s
    sync_rows = _rows(11, rollout=sync.gen_wait_s, learner=0.11, sync=0.035, gen=256, total=32 * 17,
                      inflight=sync.gen_inflight_s)
    slow_rows = _rows(11, rollout=slow.gen_wait_s, learner=0.11, sync=0.035, gen=256, total=32 * 17,
                      inflight=slow.gen_inflight_s)
    res = calibrate_and_predict(sync_rows, slow_rows, batch_size=4, group_size=8, max_staleness=2, max_concurrent=4,
                                max_new_tokens=8, warmup_steps=2, half_batch=32.0)
    cal = res["calibration"]
    assert cal["decode_fitted_on"] == "rollout/gen_inflight_s"
    assert cal["decode_peak_tokens_per_s"] == pytest.approx(3000.0, rel=1e-3)
    assert cal["decode_peak_tokens_per_s_async_run"] == pytest.approx(1000.0, rel=1e-3)
    assert res["predicted_async"] == pytest.approx(slow.samples_per_s, rel=1e-3)
    assert res["predicted_sync"] == pytest.approx(sync.samples_per_s, rel=1e-3)
    assert res["rel_error_async_sync_decode"] > 0.15  # the sync run's speed would predict the slow run badly


def test_calibration_bad_input(tmp_path):
    from areal_mega.simulator.calibrate import load_rows

    with pytest.raises(SimulationError, match="cannot read"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SimulationError, match="not a JSON line"):
        load_rows(tmp_path / "bad.jsonl")


# ---- planner ---------------------------------------------------------------------------------------

CONFIG_70B = "configs/grpo_llama70b.yaml"


def test_planner_70b_respects_memory_plan_and_recommends():
    from areal_mega.launcher.cli import build_plan_report, load_launch
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from areal_mega.simulator.costs import WorkloadModel
    from areal_mega.simulator.memory import model_arch
    from areal_mega.simulator.planner import learner_memory, recommendation

    rep = build_plan_report(CONFIG_70B, 8, staleness=(0, 2), workload=WorkloadModel(sim_steps=3))
    exp, _, _ = load_launch(CONFIG_70B, [])
    m = model_arch(exp)
    assert [s.learner_nodes for s in rep.splits] == list(range(1, 8))
    assert rep.splits[0].reason.startswith("no learner layout fits")  # 8 GPUs cannot hold a 70B learner
    for s in rep.feasible():
        tp, pp, dp = (int(x[2:]) for x in s.layout.split()[:3])
        lay = ParallelLayout.build(ParallelConfig(tp, pp), s.learner_nodes * 8)
        assert lay.dp == dp and learner_memory(exp, m, lay)[0].fits  # the launcher's verdict
        assert s.by_staleness[2]["samples_per_s"] >= 0.99 * s.by_staleness[0]["samples_per_s"]
        assert all(r["violations"] == 0 for r in s.by_staleness.values())
    best, eta = rep.best()
    lines = recommendation(rep)
    assert f"recommended {best.learner_nodes} learner node(s)" in lines[0] and "speedup" in lines[1]
    d = rep.to_dict()
    assert d["recommended"]["speedup_over_best_sync"] >= 1.0


def test_planner_prices_the_configured_weight_sync_mode():
    """The plan's sync time follows weight_sync.mode (costs.sync_bytes): broadcast's critical path
    carries 2P (one sender per stage, the stages taking turns: sync.py), reshard's busiest link
    max(2P/t, S 2P/W) (each engine GPU its TP shard, the W learner GPUs splitting the S servers'
    copies) -- checked split by split on the 70B config; the two differ on every split (control)."""
    from areal_mega.launcher.cli import build_plan_report, load_launch
    from areal_mega.simulator.costs import WorkloadModel
    from areal_mega.simulator.memory import model_arch, total_params

    exp, _, _ = load_launch(CONFIG_70B, [])
    two_p, t = 2 * total_params(model_arch(exp)), exp.inference.server.tp_size
    reps = {mode: build_plan_report(CONFIG_70B, 12, [f"weight_sync.mode={mode}"], staleness=(2,),
                                    workload=WorkloadModel(sim_steps=3)) for mode in ("broadcast", "reshard")}
    cost = reps["broadcast"].cost
    bw, lat = cost.nic_gbit_per_gpu / 8 * 1e9 * cost.weight_sync_efficiency, cost.weight_sync_latency_s
    feasible = list(zip(reps["broadcast"].feasible(), reps["reshard"].feasible()))
    assert len(feasible) >= 3
    for bc, rs in feasible:
        assert bc.learner_nodes == rs.learner_nodes and bc.layout == rs.layout
        world = 8 * bc.learner_nodes
        assert bc.sync_s == pytest.approx(lat + two_p / bw, abs=1e-3)
        assert rs.sync_s == pytest.approx(lat + max(two_p / t, rs.num_servers * two_p / world) / bw, abs=1e-3)
        assert abs(rs.sync_s - bc.sync_s) > 0.05


def test_planner_prices_fp8_sync_bytes():
    """fp8 servers: the broadcast's 2P becomes the fp8 bytes (weight_sync/fp8.py: 1 byte + fp32
    scales for the quantized linears, bf16 for the rest), split by split on the 70B config."""
    from areal_mega.launcher.cli import build_plan_report, load_launch
    from areal_mega.simulator.costs import WorkloadModel
    from areal_mega.simulator.memory import model_adapter, model_arch, total_params
    from areal_mega.weight_sync.fp8 import fp8_sync_bytes

    exp, _, _ = load_launch(CONFIG_70B, [])
    a = model_adapter(exp)
    two_p = 2 * total_params(model_arch(exp))
    fp8 = two_p * fp8_sync_bytes(a) / sum(2 * math.prod(a.hf_shape(n)) for n in a.hf_names())
    assert 0.5 < fp8 / two_p < 0.53  # Llama-70B: 1.3 GB of bf16 embeddings/lm_head out of 141 GB
    reps = {q: build_plan_report(CONFIG_70B, 12, [f"inference.server.quantization={q}"], staleness=(2,),
                                 workload=WorkloadModel(sim_steps=3)) for q in ("none", "fp8")}
    cost = reps["fp8"].cost
    bw, lat = cost.nic_gbit_per_gpu / 8 * 1e9 * cost.weight_sync_efficiency, cost.weight_sync_latency_s
    pairs = list(zip(reps["none"].feasible(), reps["fp8"].feasible()))
    assert len(pairs) >= 3
    for bf, f8 in pairs:
        assert bf.sync_s == pytest.approx(lat + two_p / bw, abs=1e-3)
        assert f8.sync_s == pytest.approx(lat + fp8 / bw, abs=1e-3) and bf.sync_s - f8.sync_s > 0.5


def test_plan_cli(tmp_path, capsys):
    from areal_mega.cli import main

    assert main(["plan", "--config", CONFIG_70B, "--nodes", "6", "--staleness", "0,1", "--out", str(tmp_path),
                 "workload.sim_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "planner: recommended" in out and "speedup over the best synchronous plan" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["recommended"]["learner_nodes"] + plan["recommended"]["engine_nodes"] == 6
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "throughput_plan.png").stat().st_size > 1000
    except ImportError:
        assert "no plot: matplotlib is not installed" in out


@pytest.mark.parametrize("args, msg", [
    (["--nodes", "1"], "--nodes: need >= 2"),
    (["--nodes", "8", "cost.train_mfu=2"], "cost.train_mfu: must be in (0, 1]"),
    (["--nodes", "8", "cost.nope=1"], "unknown key 'launch.planner.cost.nope'"),  # cost.* = launch.planner.cost.*
    (["--nodes", "8", "--staleness", "x"], "--staleness: expected comma-separated integers"),
    (["--nodes", "8", "--gpus-per-node", "3"], "tp_size: 8 spans nodes of 3 GPUs only in whole nodes"),
    (["--nodes", "8", "rollout.batch_size=0"], "rollout.batch_size: must be >= 1"),
    (["--nodes", "8", "launch.planner.margin=1.5"], "margin: must be in [0, 1), got 1.5"),
])
def test_plan_cli_bad_input_one_line(args, msg, capsys):
    from areal_mega.cli import main

    assert main(["plan", "--config", CONFIG_70B, *args]) == 2  # EXIT_REFUSED
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_decode_from_a_measured_sweep(tmp_path, capsys):
    """cost.decode_from: the plan's decode model is the sweep's fit (the four figures it replaces
    marked measured, left out of the sensitivity analysis); a faster measured server moves the
    recommendation to fewer engine nodes than the published figures give (the control); an
    unreadable sweep is one line."""
    from areal_mega.cli import main
    from areal_mega.launcher.cli import build_plan_report
    from areal_mega.simulator.costs import DECODE_FIGURES
    from areal_mega.simulator.sweep import DecodeFit

    base = ["workload.sim_steps=2"]
    default = build_plan_report(CONFIG_70B, 8, base, staleness=(1,))
    # a TP8 70B server measured ~7x faster than the published figures give (peak 7,495 tok/s,
    # half_batch 66): fewer engine nodes keep up
    fast = DecodeFit(batch_s=0.05, request_s=0.0, prompt_token_s=0.0, iter_fixed_s=2e-4, iter_per_seq_s=2e-5)
    (tmp_path / "sweep.json").write_text(json.dumps(fast.summary()) + "\n")
    assert DecodeFit.load(tmp_path / "sweep.json").decode_model(prompt_tokens=9).peak_tokens_per_s == pytest.approx(5e4)
    rep = build_plan_report(CONFIG_70B, 8, base + [f"cost.decode_from={tmp_path / 'sweep.json'}"], staleness=(1,),
                            with_sensitivity=True)
    src = rep.to_dict()["cost_sources"]
    assert all(src[f"cost.{k}"]["source"] == "measured" for k in DECODE_FIGURES)
    assert src["cost.train_mfu"]["source"] == "published"
    assert not any(r["figure"].endswith(DECODE_FIGURES) for r in rep.sensitivity)
    assert rep.best()[0].learner_nodes > default.best()[0].learner_nodes  # faster decode: fewer engines

    (tmp_path / "bad.json").write_text("{}")
    assert main(["plan", "--config", CONFIG_70B, "--nodes", "8", f"cost.decode_from={tmp_path / 'bad.json'}"]) == 2
    err = capsys.readouterr().err
    assert "bad.json: not a sweep written by python -m areal_mega.simulator.sweep" in err and err.count("\n") == 1


def test_plan_cli_missing_config(capsys):
    from areal_mega.cli import main

    assert main(["plan", "--config", "does/not/exist.yaml", "--nodes", "4"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_launcher_dry_run_prints_recommendation(capsys):
    from areal_mega.launcher.cli import _print_throughput_plan

    _print_throughput_plan(CONFIG_70B, ["workload.sim_steps=2"], 6, 8)
    out = capsys.readouterr().out
    assert out.startswith("planner: recommended") and "predicted speedup over the best synchronous plan" in out
    _print_throughput_plan("does/not/exist.yaml", [], 6, 8)  # advisory: one line, no exception
    assert capsys.readouterr().out.startswith("planner: skipped (ConfigError: config file")


def test_plan_reads_the_yamls_planner_section(tmp_path):
    """``cost.F=v`` on the command line is ``launch.planner.cost.F`` in the YAML: one set of
    figures for `areal-mega plan`, the dry run and the launch's own split."""
    import yaml

    from areal_mega.launcher.cli import build_plan_report

    raw = yaml.safe_load(open(CONFIG_70B))
    raw["launch"]["planner"] = {"cost": {"train_mfu": 0.2}, "workload": {"sim_steps": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    from_yaml = build_plan_report(str(tmp_path / "c.yaml"), 6, staleness=(0,))
    from_cli = build_plan_report(CONFIG_70B, 6, ["cost.train_mfu=0.2", "workload.sim_steps=2"], staleness=(0,))
    default = build_plan_report(CONFIG_70B, 6, ["workload.sim_steps=2"], staleness=(0,))
    assert from_yaml.cost.train_mfu == from_cli.cost.train_mfu == 0.2 and default.cost.train_mfu == 0.38
    steps = [[s.learner_step_s for s in r.feasible()] for r in (from_yaml, from_cli, default)]
    assert steps[0] == steps[1] and steps[0]
    # Half the MFU: the FLOP-proportional part of every learner step doubles (fixed 2 s stays).
    assert all(a > b for a, b in zip(steps[0], steps[2]))


# ---- cost models identified from measurements (simulator.sweep) ------------------------------------


def _sweep_points(fit, noise=0.0, seed=0, concurrencies=(1, 4, 8, 16, 32, 64), lengths=(8, 32), prompts=(9, 48)):
    from areal_mega.simulator.sweep import DecodePoint

    rng = random.Random(seed)
    return [DecodePoint(n, L, P, fit.predict(n, L, P) * (1 + rng.uniform(-noise, noise)))
            for P in prompts for L in lengths for n in concurrencies]


def _true_decode_fit():
    from areal_mega.simulator.sweep import DecodeFit

    # peak 4000 tok/s, half_batch 6, 2 ms per request + 20 us per prompt token, 5 ms per batch
    return DecodeFit(batch_s=0.005, request_s=0.002, prompt_token_s=2e-5, iter_fixed_s=6 / 4000, iter_per_seq_s=1 / 4000)


def test_decode_sweep_fit_recovers_parameters():
    from areal_mega.simulator.sweep import fit_decode_sweep

    true = _true_decode_fit()
    exact = fit_decode_sweep(_sweep_points(true))
    for k in ("batch_s", "request_s", "prompt_token_s", "iter_fixed_s", "iter_per_seq_s"):
        assert getattr(exact, k) == pytest.approx(getattr(true, k), rel=1e-6), k  # float64 normal equations
    # 3% timing noise (a loaded machine's repeat-to-repeat spread): peak and half_batch within 10%
    noisy = fit_decode_sweep(_sweep_points(true, noise=0.03, seed=5))
    dm = noisy.decode_model(prompt_tokens=9)
    assert dm.peak_tokens_per_s == pytest.approx(4000, rel=0.1)
    assert dm.half_batch == pytest.approx(6, rel=0.15)
    assert dm.request_server_s == pytest.approx(0.002 + 9 * 2e-5, rel=0.15)
    assert noisy.rms_rel_error < 0.03


def test_decode_sweep_fit_negative_controls():
    """One concurrency level cannot separate peak from half_batch (refused), and the old assumed
    half_batch=32 with the peak fitted at one level mispredicts the other levels (control)."""
    from areal_mega.simulator.sweep import DecodeFit, fit_decode_sweep

    true = _true_decode_fit()
    with pytest.raises(SimulationError, match="concurrency levels"):
        fit_decode_sweep(_sweep_points(true, concurrencies=(32,)))
    with pytest.raises(SimulationError, match="2 lengths"):
        fit_decode_sweep(_sweep_points(true, lengths=(8,)))
    held_out = [p for p in _sweep_points(true, noise=0.03, seed=9) if p.concurrency in (1, 64)]
    fitted = fit_decode_sweep([p for p in _sweep_points(true, noise=0.03, seed=9) if p.concurrency not in (1, 64)])
    # the control: no per-request term, half_batch = 32, t1 chosen so that n=32, L=32 is exact
    t1 = true.predict(32, 32, 9) / (32 * (32 + 32))
    guess = DecodeFit(0.0, 0.0, 0.0, 32 * t1, t1)
    err = lambda f: max(abs(f.predict(p.concurrency, p.new_tokens, p.prompt_tokens) - p.seconds) / p.seconds  # noqa: E731
                        for p in held_out)
    assert err(fitted) < 0.08  # extrapolates to concurrency 1 and 64 it never saw
    assert err(guess) > 0.5


def test_learner_and_sync_fits():
    from areal_mega.simulator.sweep import fit_learner_points, fit_sync_points

    lm = fit_learner_points([500, 1000, 2000, 4000], [0.1 + 2e-5 * x for x in (500, 1000, 2000, 4000)])
    assert (lm.fixed_s, lm.per_token_s) == (pytest.approx(0.1), pytest.approx(2e-5))
    flat = fit_learner_points([544, 544, 545], [0.1, 0.12, 0.11])  # slope not identified: a constant
    assert flat.per_token_s == 0 and flat.fixed_s == pytest.approx(0.11)
    sm = fit_sync_points([2**20, 2**24, 2**27], [0.03 + b / 1e9 for b in (2**20, 2**24, 2**27)])
    assert sm.latency_s == pytest.approx(0.03, rel=1e-6) and sm.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    with pytest.raises(SimulationError, match="2 sizes"):
        fit_sync_points([2**20, 2**20], [0.1, 0.1])


def test_request_server_time_and_client_work_closed_form():
    """Synchronous closed forms: n requests arrive together (n r of prefill before decoding) and
    finish together (n c of client work on the learner's core, which waits)."""
    from areal_mega.simulator import HostModel

    B, G, L, P, peak, half, a, b, S, r, c = 4, 8, 50, 10, 2000.0, 16.0, 0.3, 1e-4, 0.05, 0.002, 0.001
    n = B * G
    base = L * (n + half) / peak + a + b * n * (P + L) + S
    cfg = _det(0, B, G, L, P, peak, half, a, b, S)
    cfg.decode.request_server_s = r
    assert simulate(cfg).step_s == pytest.approx(base + n * r, rel=1e-9)
    cfg.host = HostModel(client_s_per_request=c)
    res = simulate(cfg, record=True)
    assert res.step_s == pytest.approx(base + n * r + n * c, rel=1e-9)
    assert res.train_s == pytest.approx(a + b * n * (P + L), rel=1e-9)  # nothing shares the core while it trains
    for g0, g1 in res.gen_intervals:
        for t0, t1 in res.train_intervals:
            assert min(g1, t1) - max(g0, t0) <= 1e-9


def test_client_work_slows_overlapped_training():
    """Asynchronous: responses arrive while the learner trains; the core is shared, so the step
    stretches by the client work done during it (half speed each), and throughput falls. The
    control (c = 0) keeps the learner's own step."""
    from areal_mega.simulator import HostModel

    free = _det(2, a=2.0, b=0.0, steps=8)  # learner-bound: generation needs 1.2 s a batch
    shared = _det(2, a=2.0, b=0.0, steps=8)
    shared.host = HostModel(client_s_per_request=0.004)
    f, s = simulate(free), simulate(shared)
    assert f.train_s == pytest.approx(2.0, rel=1e-9)
    # a batch's 32 responses arrive during the step: 32 x 4 ms of client work, half of it taken
    # from training while they share the core -> the step stretches by ~64 ms (at most 128)
    assert 2.0 + 0.05 < s.train_s <= 2.0 + 32 * 0.004 + 1e-9
    assert s.samples_per_s < 0.98 * f.samples_per_s
    assert s.violations == 0


def test_plan_sensitivity_table(tmp_path):
    """Every figure not measured here is perturbed (x0.5, x2), datasheet ones are not; the
    perturbations reach the simulation (a slower learner lowers the predicted throughput: the
    control that the table is not the base plan repeated)."""
    from areal_mega.simulator.costs import COST_SOURCES
    from areal_mega.launcher.cli import build_plan_report
    from areal_mega.simulator.planner import write_plan

    rep = build_plan_report(CONFIG_70B, 6, ["workload.sim_steps=2"], staleness=(0, 1), with_sensitivity=True)
    rows = rep.sensitivity
    assert rows[0]["figure"] == "(as configured)" and not rows[0]["split_changed"]
    figs = {r["figure"] for r in rows[1:]}
    want = {f"cost.{k}" for k, (src, _) in COST_SOURCES.items() if src != "datasheet"} | {"workload.gen_mean_tokens"}
    assert figs == want
    slow = next(r for r in rows if r["figure"] == "cost.learner_fixed_s" and r["factor"] == 2.0)
    fast = next(r for r in rows if r["figure"] == "cost.learner_fixed_s" and r["factor"] == 0.5)
    assert slow["samples_per_s"] < rows[0]["samples_per_s"] < fast["samples_per_s"]
    write_plan(rep, tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["sensitivity"] == rows and plan["cost_sources"]["cost.train_mfu"]["source"] == "published"


def test_validate_recovers_client_work_out_of_sample(tmp_path):
    """bench_simulator --validate's arithmetic on runs the simulator itself made with a known
    client cost on the learner's core: calibrated on sync + max_staleness 1 it finds that cost and
    predicts max_staleness 2 and 4 it never saw (within 2%: discrete step counts); the control,
    the same fit without the overlap's costs, misses them."""
    from areal_mega.simulator import HostModel
    from areal_mega.simulator.calibrate import parse_settings, validate

    fit = _true_decode_fit()
    (tmp_path / "decode_sweep.json").write_text(json.dumps(fit_summary := fit.summary()) + "\n")
    assert fit_summary["half_batch"] == pytest.approx(6.0)
    (tmp_path / "validate_runs.json").write_text(json.dumps({"rounds": 1, "loadavg": []}) + "\n")
    settings = parse_settings("sync:eta=0;eta1:eta=1;eta2:eta=2;eta4:eta=4", batch=4, group=8, new=8)
    B, G, L, P, c = 4, 8, 8, 9, 0.004
    for s in settings:
        cfg = SimConfig(batch_size=B, group_size=G, max_staleness=s.max_staleness, max_concurrent=B, steps=8,
                        warmup_steps=2, lengths=LengthModel(kind="constant", mean_tokens=L, max_tokens=L, prompt_tokens=P),
                        decode=fit.decode_model(prompt_tokens=P), learner=LearnerModel(fixed_s=0.15),
                        sync=SyncModel(latency_s=0.03), host=HostModel(client_s_per_request=c))
        r = simulate(cfg)
        learner = r.step_s - r.gen_wait_s - r.weight_sync_s
        rows = _rows(11, rollout=r.gen_wait_s, learner=learner, sync=r.weight_sync_s, traj=B * G, gen=B * G * L,
                     total=B * G * (L + P), inflight=r.gen_inflight_s)
        (tmp_path / f"{s.name}0").mkdir()
        (tmp_path / f"{s.name}0" / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    res = validate(tmp_path, settings, ["sync", "eta1"], warmup_steps=2)
    assert res["calibration"]["client_s_per_request"] == pytest.approx(c, rel=0.1)
    assert res["calibration"]["decode_time_scale_vs_sweep"] == pytest.approx(1.0, rel=0.05)
    assert res["out_of_sample"] == ["eta2", "eta4"]
    assert res["worst_rel_error"] < 0.02
    assert res["worst_rel_error_without_overlap_costs"] > 0.05  # the control


def test_fixed_split_far_from_recommendation_warns(capsys):
    """launch.planner.margin: a fixed split predicted more than the margin below the planner's
    recommendation gets a WARNING on stderr in the dry run; the recommended split itself, fixed,
    does not (the control), nor the same split under a margin wider than its gap."""
    from areal_mega.launcher.cli import _print_throughput_plan, build_plan_report

    base = ["workload.sim_steps=2"]
    rep = build_plan_report(CONFIG_70B, 8, base, staleness=(1,))
    assert rep.configured is None and rep.configured_shortfall() is None and rep.margin == 0.10  # the default
    best, eta = rep.best()
    worst = min(rep.feasible(), key=lambda s: s.by_staleness[eta]["samples_per_s"])
    gap = 1 - worst.by_staleness[eta]["samples_per_s"] / best.by_staleness[eta]["samples_per_s"]
    assert gap > 0.10 and worst.learner_nodes != best.learner_nodes  # the 70B sweep has a clearly worse split

    short = dataclasses.replace(rep, configured=(worst.learner_nodes, eta)).configured_shortfall()
    assert short is not None and abs(short[0] - gap) < 1e-9 and "launch.planner.margin = 10%" in short[1]
    assert dataclasses.replace(rep, configured=(best.learner_nodes, eta)).configured_shortfall() is None
    assert dataclasses.replace(rep, configured=(worst.learner_nodes, eta), margin=gap + 0.01).configured_shortfall() is None

    # end to end: the config's fixed split and margin, read by the dry run's planner call
    fixed = base + [f"launch.learner.num_nodes={worst.learner_nodes}", f"rollout.max_staleness={eta}"]
    _print_throughput_plan(CONFIG_70B, fixed, 8, 8)
    cap = capsys.readouterr()
    assert cap.err.count("planner: WARNING: the fixed split") == 1 and "WARNING" not in cap.out
    _print_throughput_plan(CONFIG_70B, fixed + [f"launch.planner.margin={gap + 0.01:.4f}"], 8, 8)
    assert "WARNING" not in capsys.readouterr().err


def test_learner_curve_follows_a_step_that_is_not_affine():
    """fit_learner_curve goes through every run it is given (runs of one batch size averaged),
    linear between them, the end segments extended; the affine least squares (the control)
    misses a CPU learner whose step grows 2.6x for 2x the tokens."""
    from areal_mega.simulator.sweep import fit_learner_curve, fit_learner_points

    runs = [(540.0, 0.100), (545.0, 0.104), (1080.0, 0.263)]
    m = fit_learner_curve(runs)
    assert len(m.points) == 2 and m.points[0] == pytest.approx((542.5, 0.102))
    assert m.step_s(542.5) == pytest.approx(0.102) and m.step_s(1080.0) == pytest.approx(0.263)
    assert m.step_s(811.25) == pytest.approx((0.102 + 0.263) / 2)  # halfway
    slope = (0.263 - 0.102) / (1080.0 - 542.5)
    assert m.step_s(1280.0) == pytest.approx(0.263 + 200.0 * slope)  # beyond: the last segment
    assert m.step_s(10.0) == 0.0  # floored
    affine = fit_learner_points([x for x, _ in runs], [y for _, y in runs])
    assert max(abs(affine.step_s(x) - y) / y for x, y in runs) > 0.10  # the control
    assert fit_learner_curve([(540.0, 0.1), (550.0, 0.12)]).points == ()  # one batch size: a constant
    assert fit_learner_curve([(540.0, 0.1), (550.0, 0.12)]).step_s(2000.0) == pytest.approx(0.11)
    for bad in (((1.0, 0.1),), ((2.0, 0.1), (1.0, 0.2)), ((1.0, 0.1), (2.0, -0.1))):
        with pytest.raises(SimulationError, match="learner.points"):
            LearnerModel(points=bad).validate()


def _validation_runs(tmp_path, rounds, *, learner_scale=None, sync_noise=0.0, eta1_sync=0.03):
    """sync / eta1 / eta2 runs the simulator made (rounds x each), written as bench_simulator does;
    ``learner_scale[name]``: that setting's learner time per round (a machine drifting between runs);
    the synchronous runs' sync time alternates +-``sync_noise`` around 0.03 s, eta1's is ``eta1_sync``."""
    from areal_mega.simulator.calibrate import parse_settings

    fit = _true_decode_fit()
    tmp_path.mkdir()
    (tmp_path / "decode_sweep.json").write_text(json.dumps(fit.summary()) + "\n")
    (tmp_path / "validate_runs.json").write_text(json.dumps({"rounds": rounds, "loadavg": []}) + "\n")
    settings = parse_settings("sync:eta=0;eta1:eta=1;eta2:eta=2", batch=4, group=8, new=8)
    B, G, L, P = 4, 8, 8, 9
    for s in settings:
        for r in range(rounds):
            k = (learner_scale or {}).get(s.name, [1.0] * rounds)[r]
            cfg = SimConfig(batch_size=B, group_size=G, max_staleness=s.max_staleness, max_concurrent=B, steps=8,
                            warmup_steps=2, lengths=LengthModel(kind="constant", mean_tokens=L, max_tokens=L, prompt_tokens=P),
                            decode=fit.decode_model(prompt_tokens=P), learner=LearnerModel(fixed_s=0.15 * k),
                            sync=SyncModel(latency_s=0.03))
            res = simulate(cfg)
            rows = _rows(11, rollout=res.gen_wait_s, learner=res.step_s - res.gen_wait_s - res.weight_sync_s,
                         sync=res.weight_sync_s, traj=B * G, gen=B * G * L, total=B * G * (L + P), inflight=res.gen_inflight_s)
            for i, row in enumerate(rows):
                e1 = eta1_sync[r] if isinstance(eta1_sync, list) else eta1_sync
                row["time/weight_sync_s"] = (0.03 + (sync_noise if i % 2 else -sync_noise)) if s.max_staleness == 0 \
                    else e1 if s.name == "eta1" else 0.03
            (tmp_path / f"{s.name}{r}").mkdir()
            (tmp_path / f"{s.name}{r}" / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    return settings


def test_validate_measured_ties_come_from_the_rounds(tmp_path):
    """With >= 2 rounds a setting's standard error includes the spread between its rounds:
    eta2 measured 12% apart in two rounds is tied with eta1, which the same mean difference in
    steady rounds (the control) is not. The planner's choice is scored against that."""
    from areal_mega.simulator.calibrate import validate

    settings = _validation_runs(tmp_path / "a", 2, learner_scale={"eta2": [0.9, 1.25]})
    res = validate(tmp_path / "a", settings, ["sync", "eta1"], warmup_steps=2)
    f = res["predictions"]["eta2"]["measured_facts"]
    xs = f["samples_per_s_rounds"]
    assert xs[0] > 1.1 * xs[1]
    assert f["rel_se_rounds"] == pytest.approx(abs(xs[0] - xs[1]) / 2 / (sum(xs) / 2), rel=1e-3)
    assert res["staleness_pairs"]["eta1|eta2"]["measured"] == 0
    choice = res["staleness_choice"]
    assert choice["planner"] == "eta1" and choice["measured_best"] in ("eta1", "eta2") and choice["right"]

    settings = _validation_runs(tmp_path / "b", 2, learner_scale={"eta2": [1.075, 1.075]})  # the same mean, steady
    res = validate(tmp_path / "b", settings, ["sync", "eta1"], warmup_steps=2)
    assert res["predictions"]["eta2"]["measured_facts"]["rel_se_rounds"] == 0.0
    assert res["staleness_pairs"]["eta1|eta2"]["measured"] == 1  # eta1 measured faster: resolved


def test_validate_refuses_an_async_calibration_run_without_its_synchronous_workload(tmp_path):
    """The overlap's costs are fitted as what an async calibration run adds to the learner's curve
    at its own tokens: an async run of a batch size no synchronous run measured is refused."""
    from areal_mega.simulator.calibrate import parse_settings, validate

    settings = parse_settings("sync:eta=0;eta1_b8:eta=1,batch=8", batch=4, group=8, new=8)
    with pytest.raises(SimulationError, match="eta1_b8 .batch 8, 8 new tokens. has no synchronous calibration run"):
        validate(tmp_path, settings, ["sync", "eta1_b8"], warmup_steps=2)


def test_validate_fits_no_sync_cost_to_noise(tmp_path):
    """The per-in-flight sync cost is fitted only when the async calibration run's syncs are
    slower than the synchronous runs' by more than twice the standard error of the difference
    (the steps' or, with >= 2 rounds, the rounds' spread, whichever is larger)."""
    from areal_mega.simulator.calibrate import validate

    settings = _validation_runs(tmp_path / "a", 1, sync_noise=0.01, eta1_sync=0.032)
    cal = validate(tmp_path / "a", settings, ["sync", "eta1"], warmup_steps=2)["calibration"]
    assert not cal["sync_s_per_inflight_request_identified"] and cal["sync_s_per_inflight_request"] == 0.0
    settings = _validation_runs(tmp_path / "b", 1, sync_noise=0.01, eta1_sync=0.06)  # the control
    cal = validate(tmp_path / "b", settings, ["sync", "eta1"], warmup_steps=2)["calibration"]
    assert cal["sync_s_per_inflight_request_identified"] and cal["sync_s_per_inflight_request"] > 0.0
    # steady within each run, apart between rounds: the rounds' spread is the noise
    settings = _validation_runs(tmp_path / "c", 2, sync_noise=0.001, eta1_sync=[0.03, 0.05])
    assert not validate(tmp_path / "c", settings, ["sync", "eta1"], warmup_steps=2)["calibration"][
        "sync_s_per_inflight_request_identified"]
    settings = _validation_runs(tmp_path / "d", 2, sync_noise=0.001, eta1_sync=[0.04, 0.04])  # the control
    assert validate(tmp_path / "d", settings, ["sync", "eta1"], warmup_steps=2)["calibration"][
        "sync_s_per_inflight_request_identified"]


def test_validate_ranking_ties_from_tolerance_and_noise():
    """validate's ranking step alone: predictions tie within PLAN_TOLERANCE (2%), measurements
    within twice the standard error of their difference; the planner's pick is the smallest
    bound near the best prediction."""
    from areal_mega.simulator.calibrate import RunSetting, _Ranking

    def pred(p, m, se):
        return {"predicted": p, "measured": m, "measured_facts": {"rel_se": se, "rel_se_rounds": None}}
    preds = {"a": pred(1.00, 1.00, 0.01), "b": pred(1.015, 1.05, 0.01), "c": pred(1.10, 1.20, 0.0)}
    by_name = {n: RunSetting(n, eta, 4, 8, 8) for n, eta in (("a", 0), ("b", 1), ("c", 2))}
    rk = _Ranking(preds, by_name)
    assert rk.order("b", "a", "predicted") == 0  # 1.5% apart: within the tolerance
    assert rk.order("b", "a", "measured") == 1  # 5% apart, tie width 2 * hypot(0.0105, 0.01) = 2.9%
    assert rk.order("c", "b", "predicted") == 1 and rk.rank("measured", ["a", "b", "c"]) == ["c", "b", "a"]
    assert not rk.same_order(["a", "b"]) and not rk.consistent(["a", "b"])
    assert rk.consistent(["b", "c"]) and rk.same_order(["b", "c"])
    assert rk.choice(["a", "b", "c"]) == {"planner": "c", "measured_best": "c", "right": True}
    assert rk.choice(["a", "b"]) == {"planner": "a", "measured_best": "b", "right": False}


def test_validate_runs_pool_rounds_and_their_standard_error():
    from areal_mega.simulator.calibrate import RunSetting, _check_calibration_runs, _Runs

    def steps(xs):
        return [{"perf/step_s": 1.0, "time/rollout_s": 0.5, "time/weight_sync_s": x} for x in xs]
    runs = _Runs(rows={"s": steps([9, 1.0, 1.2, 9])}, per_round={"s": [steps([1.0]), steps([1.2])]}, rounds=2, warmup=1)
    assert [r["time/weight_sync_s"] for r in runs.timed("s")] == [1.0, 1.2]
    mean, se = runs.mean_se([RunSetting("s", 0, 4, 8, 8)], lambda t: sum(r["time/weight_sync_s"] for r in t) / len(t))
    assert mean == pytest.approx(1.1) and se == pytest.approx(0.1)
    sync, b8 = RunSetting("sync", 0, 4, 8, 8), RunSetting("eta1_b8", 1, 8, 8, 8)
    _check_calibration_runs({"sync": sync, "eta1_b8": b8}, ["sync"])
    with pytest.raises(SimulationError, match="--calibrate-on: .'nope'. not among"):
        _check_calibration_runs({"sync": sync}, ["nope"])
    with pytest.raises(SimulationError, match="eta1_b8 .batch 8"):
        _check_calibration_runs({"sync": sync, "eta1_b8": b8}, ["sync", "eta1_b8"])

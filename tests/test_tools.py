"""Every script in tools/ runs with small arguments somewhere in the suite (issue 20: one of them
crashed for weeks and nothing noticed). ``SMOKE`` says where; the scripts no other test runs
are run here: the pure ones in this process (fast tier), the ones that start processes with
stand-ins (slow tier), and the ones that need real SGLang servers and the trainer under
``make test-tools`` (marker ``tools_heavy``: minutes on 2 cores, outside make test's budget).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.support.launch import REPO, SGLANG_PYTHON, child_env, needs_sglang, run_checked

# tools/<script> -> the test that runs it ("file::test").
SMOKE = {
    "bench_async.py": "test_tools.py::test_bench_simulator_runs_bench_async",
    "bench_dry_run.py": "test_launch_plan.py::test_bench_dry_run_smoke",
    "bench_judge.py": "test_tools.py::test_bench_judge",
    "bench_packing.py": "test_packing.py::test_bench_packing_meets_target",
    "bench_rewards.py": "test_tools.py::test_bench_rewards",
    "bench_rollout_client.py": "test_tools.py::test_bench_rollout_client",
    "bench_rollout_checkpoint.py": "test_rollout_resume.py::test_bench_rollout_checkpoint_smoke",
    "bench_simulator.py": "test_tools.py::test_bench_simulator_reuse",
    "bench_sparse_delta.py": "test_tools.py::test_bench_sparse_delta",
    "bench_weight_sync.py": "test_tools.py::test_bench_weight_sync",
    "check_memory_model.py": "test_launch_plan.py::test_estimator_matches_what_the_engine_holds",
    "count_config_keys.py": "test_tools.py::test_count_config_keys",
    "convert_hf_to_mcore.py": "test_megatron_model.py::test_conversion_tools_roundtrip_bit_exact",
    "convert_mcore_to_hf.py": "test_megatron_model.py::test_conversion_tools_roundtrip_bit_exact",
    "make_smollm2.py": "test_smollm2.py::test_learner_logprobs_equal_hf_on_smollm2",  # make test-real
    "plot_run.py": "test_tools.py::test_plot_run",
    "bench_routing_replay.py": "test_tools.py::test_bench_routing_replay",
    "cpu_load.py": "test_tools.py::test_cpu_load_runs_the_command_and_stops",
    "process_reward_toy.py": "test_tools.py::test_process_reward_toy",
    "process_reward_lm.py": "test_tools.py::test_process_reward_lm",
    "bench_staleness.py": "test_tools.py::test_bench_staleness_summarises_saved_cells",
    "bench_lora_sync.py": "test_lora.py::test_bench_lora_sync_smoke",  # make test-families-serve
}


def _tool(name: str):
    """tools/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _json_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1])


def test_every_tool_has_a_smoke_test():
    scripts = {p.name for p in (REPO / "tools").glob("*.py")}
    assert scripts == set(SMOKE), f"tools/ without a smoke test: {sorted(scripts - set(SMOKE))}"
    for script, where in SMOKE.items():
        file, test = where.split("::")
        src = (REPO / "tests" / file).read_text()
        assert f"def {test}(" in src, f"{script}: {where} does not exist"
        if file != "test_tools.py":  # the test elsewhere really starts the script
            assert f"tools/{script}" in src or f'"{script[:-3]}"' in src or script in src, (script, where)


# ---------------------------------------------------------------- fast: in this process
def test_plot_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"version": v, "rollout/reward/mean": 0.1 * v, "staleness/mean": 0.5, "staleness/max": 1,
             "train/clip_frac": 0.01, "train/importance_weight/mean": 1.0} for v in range(1, 6)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "curves.png"
    assert _tool("plot_run").main([str(metrics), str(out), "--title", "smoke"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert _tool("plot_run").main([str(tmp_path / "missing.jsonl"), str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_count_config_keys(capsys):
    """The count is the top-level keys plus each section's; a kind's options are counted apart
    (reward: 5 keys of its own, a judge's options far more)."""
    _tool("count_config_keys").main()
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == len(out["sections"]) + sum(out["sections"].values())
    assert out["sections"]["reward"] == 5 and out["options_per_kind"]["reward:judge"] > 40
    assert out["options_per_kind"]["reward:math"] == 2 and "reward:consistency" not in out["options_per_kind"]


def test_bench_sparse_delta(tmp_path, capsys):
    """A tiny model, two Adam steps: some bf16 values move and the sparse encoding rebuilds the
    new weights bit for bit; at lr 0 nothing moves (control: the count is of real changes)."""
    from tests.support.models import save_tiny_model

    model = save_tiny_model(tmp_path / "m", "qwen2")
    for lr, moved in ((4e-5, True), (0.0, False)):
        _tool("bench_sparse_delta").main(["--model", str(model), "--lr", str(lr), "--steps", "2", "--seq", "16"])
        out = _json_line(capsys.readouterr().out)
        assert out["lossless"] and len(out["steps"]) == 2
        assert all((0 < s["density"] <= 1) == moved and (s["changed"] == 0) == (not moved) for s in out["steps"])


def test_bench_simulator_reuse(tmp_path, capsys):
    """``--reuse`` on runs the simulator itself produced (as tests/test_simulator.py's calibration
    test does): the tool must hand calibration the bench's batch, group, staleness and warm-up
    (a wrong one would not reproduce the simulated throughput to 1e-4)."""
    from areal_mega.simulator import SimConfig, simulate
    from tests.test_simulator import _det, _rows

    true = _det(0, B=4, G=8, L=8, P=9, peak=3000.0, half=32.0, a=0.11, b=0.0, S=0.035, steps=8)
    sync = simulate(true)
    asyn = simulate(SimConfig(**{**true.__dict__, "max_staleness": 2, "max_concurrent": 4}))
    for run, sim in (("sync0", sync), ("async0", asyn)):
        (tmp_path / run).mkdir()
        rows = _rows(11, rollout=sim.gen_wait_s, learner=0.11, sync=0.035, gen=256, total=32 * 17)
        (tmp_path / run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bench = {"rounds": 1, "warmup_steps": 2, "batch_size": 4, "group_size": 8, "max_staleness": 2,
             "max_new_tokens": 8, "sync_samples_per_s": 1.5, "async_samples_per_s": 2.5}
    (tmp_path / "bench_async.json").write_text(json.dumps(bench) + "\n")
    assert _tool("bench_simulator").main(["--reuse", "--work-dir", str(tmp_path), "--half-batch", "32"]) == 0
    res = _json_line(capsys.readouterr().out)
    assert res["predicted_sync"] == pytest.approx(sync.samples_per_s, rel=1e-4)
    assert res["predicted_async"] == pytest.approx(asyn.samples_per_s, rel=1e-3)
    assert (res["measured_sync_bench_async"], res["measured_async_bench_async"]) == (1.5, 2.5)
    assert _tool("bench_simulator").main(["--reuse", "--work-dir", str(tmp_path / "none")]) == 1


def test_bench_weight_sync_plan_projection():
    """--mode plan in-process (pure): the 70B sync of the issue (8 + 8 nodes, 400 Gb/s per GPU)
    from the reshard plan's own byte counts -- each engine GPU receives its 17.64 GB shard, the
    floor is the busiest link's bytes at line rate, the expected time stays under 1 s."""
    res = _tool("bench_weight_sync").plan_projection("llama-70b", 400.0, 0.7, 50.0, 0.1)
    assert res["bytes_per_engine_rank"] == res["shard_bytes"] == 17_640_734_720
    busiest = max(res["bytes_per_engine_rank"], res["bytes_per_learner_rank"])
    assert res["floor_s"] == round(busiest / 50e9, 3) and res["expected_s"] <= 1.0
    assert res["broadcast_floor_s"] == round(res["model_bytes"] / 50e9, 3) > 7 * res["floor_s"]


# ---------------------------------------------------------------- slow: stand-in processes
@pytest.mark.slow
def test_bench_weight_sync(tmp_path):
    """The real sender path into 2 stand-in receivers (one spawn each): every byte of the tiny
    model's plan goes over the wire, and the script itself checks both receivers' versions."""
    from areal_mega.models import get_adapter
    from areal_mega.parallel import ParallelLayout

    args = ["--mib", "1", "--hidden", "128", "--vocab", "512", "--bucket-mib", "0.25", "--receivers", "2",
            "--repeats", "1"]
    r = run_checked([sys.executable, "tools/bench_weight_sync.py", *args], timeout_s=600)
    res = _json_line(r.stdout)
    cfg = _tool("bench_weight_sync").llama_like(1, 128, 512)
    stage = get_adapter(cfg).plan(ParallelLayout(world_size=1))[0]
    assert res["bytes"] == sum(math.prod(t.shape) * 2 for t in stage.tensors)  # bf16: the whole model, once
    assert res["receivers"] == 2 and res["buckets"] >= res["bytes"] // (2**20 // 4)
    assert res["GBps"] > 0 and res["raw_GBps"] > 0 and res["efficiency"] > 0


@pytest.mark.slow
def test_bench_rollout_client():
    """64 requests through the real InferencePool into the stub, which holds every answer until all
    have arrived: all 64 must be in flight at once."""
    r = run_checked([sys.executable, "tools/bench_rollout_client.py", "--num-requests", "64", "--rounds", "1"],
                    timeout_s=300)
    res = _json_line(r.stdout)
    assert res["num_requests"] == res["in_flight_peak"] == 64
    assert res["cold"]["completed_per_s"] > 0 and res["peak_rss_mib"] > 0


@pytest.mark.slow
def test_bench_rewards():
    r = run_checked([sys.executable, "tools/bench_rewards.py", "--workers", "1", "--num-math", "6", "--num-code", "1"],
                    timeout_s=300)
    res = _json_line(r.stdout)
    assert (res["num_math"], res["num_code"], res["workers"]) == (6, 1, 1)
    assert res["math_rewards_per_s"] > 0 and res["sandbox_executions_per_s"] > 0 and res["judge"] is None


# ---------------------------------------------------------------- make test-tools: real SGLang
@pytest.mark.slow
@pytest.mark.tools_heavy
@needs_sglang
def test_bench_judge():
    r = run_checked([sys.executable, "tools/bench_judge.py", "--sglang-python", SGLANG_PYTHON, "--num-requests", "4",
                     "--max-concurrent", "2"], timeout_s=900)
    res = _json_line(r.stdout)
    assert res["num_requests"] == 4 and res["judge_requests_per_s"] > 0
    assert sum(res["outcomes"].values()) >= 4, res["outcomes"]


@pytest.mark.slow
@pytest.mark.tools_heavy
@needs_sglang
def test_bench_simulator_runs_bench_async(tmp_path):
    """bench_simulator without --reuse starts bench_async (the real trainer, sync then async, one
    SGLang CPU server): the smallest run, both modes measured and predicted."""
    r = run_checked([sys.executable, "tools/bench_simulator.py", "--sglang-python", SGLANG_PYTHON,
                     "--work-dir", str(tmp_path), "--steps", "2", "--warmup-steps", "1", "--batch-size", "2",
                     "--group-size", "2", "--max-new-tokens", "4"], timeout_s=1500, env=child_env())
    res = _json_line(r.stdout)
    assert res["measured_sync_bench_async"] > 0 and res["measured_async_bench_async"] > 0
    assert res["predicted_sync"] > 0 and res["predicted_async"] > 0
    bench = json.loads((tmp_path / "bench_async.json").read_text())
    assert bench["sync_samples_per_s"] == res["measured_sync_bench_async"]


@pytest.mark.slow
def test_cpu_load_runs_the_command_and_stops():
    """The burners run beside the command, the command's exit code is the tool's, nothing is left."""
    r = run_checked([sys.executable, "tools/cpu_load.py", "--seconds", "30", "--procs", "1", "--",
                     sys.executable, "-c", "print('inner ran')"], timeout_s=120, env=child_env())
    assert "inner ran" in r.stdout


@pytest.mark.slow
def test_process_reward_toy():
    """The smallest toy comparison (one seed, 2 iterations): both arms report their numbers."""
    r = run_checked([sys.executable, "tools/process_reward_toy.py", "--steps", "2", "--seeds", "0", "--prompts", "2",
                     "--group", "2"], timeout_s=600, env=child_env())
    out = _json_line(r.stdout)
    assert "summary" in out and out["args"]["steps"] == 2


@pytest.mark.slow
@pytest.mark.tools_heavy
@needs_sglang
def test_bench_routing_replay(tmp_path):
    """One bf16 server with route capture, the fp32 learner with and without the server's routes:
    the JSON line carries the disagreement and both mismatches (docs/routing_replay.md)."""
    r = run_checked([sys.executable, "tools/bench_routing_replay.py", "--sglang-python", SGLANG_PYTHON,
                     "--num-prompts", "4", "--max-new-tokens", "8", "--skip-capture-cost",
                     "--work-dir", str(tmp_path)], timeout_s=1500, env=child_env())
    res = _json_line(r.stdout)
    assert 0 <= res["disagreement"] <= 1 and res["num_tokens"] > 0
    assert res["mismatch_on"]["max"] <= res["mismatch_off"]["max"] + 1e-6, res



@pytest.mark.slow
@pytest.mark.tools_heavy
@needs_sglang
def test_process_reward_lm(tmp_path):
    """The LM comparison at its smallest (64 demonstrations, 2 SFT steps, 1 RL step per arm): both
    arms report their curves, and only the process arm has step rewards."""
    r = run_checked([sys.executable, "tools/process_reward_lm.py", "--sglang-python", SGLANG_PYTHON,
                     "--work-dir", str(tmp_path), "--rl-steps", "1", "--sft-steps", "2", "--num-sft", "64",
                     "--eval-every", "1"], timeout_s=1800, env=child_env())
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    arms = {x["arm"]: x for x in lines if "arm" in x}
    assert set(arms) == {"outcome", "process"} and "summary" in lines[-1]
    assert arms["process"]["step_reward"][0] is not None and arms["outcome"]["step_reward"] == [None]
    assert all(0 <= x["reward"][0] <= 1 and x["heldout"] for x in arms.values())


def test_bench_staleness_summarises_saved_cells(tmp_path, capsys):
    """Every method's overrides make a valid experiment; saved cells are reused (no run starts: no
    model is built), summarised per eta x method with the SE over seeds, plotted. The study itself:
    docs/staleness.md."""
    from areal_mega.experiment import load_experiment

    bench = _tool("bench_staleness")
    for method in bench.METHODS:
        for eta in (0, 4):
            cfg = load_experiment(str(REPO / "configs/grpo_smollm2.yaml"),
                                  ["model_path=/m", *bench.cell_overrides(eta, method, 1, 8)])
            assert cfg.rollout.max_staleness == eta and cfg.trainer.study_delay == eta
    work = tmp_path / "study"
    for eta, seed, acc in [(0, 1, 0.5), (0, 2, 0.7), (4, 1, 0.2), (4, 2, 0.4)]:
        cell = work / f"eta{eta}-naive-seed{seed}-steps8"
        cell.mkdir(parents=True)
        (cell / "summary.json").write_text(json.dumps({"eta": eta, "method": "naive", "seed": seed, "accuracy": acc,
                                                       "accuracy_se": 0.01 + 0.01 * seed,
                                                       "step_s": [1.0, 2.0], "ess": [1.0, 0.9]}))
    # one cell kept its metrics.jsonl: its summary gains the curves this tool added since it was saved
    rows = [{"version": v, "perf/step_s": 3.0, "time/train_s": 2.0, "time/prox_logp_s": 0.25 * v} for v in (1, 2, 3)]
    (work / "eta4-naive-seed1-steps8" / "grpo").mkdir()
    (work / "eta4-naive-seed1-steps8" / "grpo" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    rel = str(work.relative_to(REPO)) if work.is_relative_to(REPO) else str(work)
    assert bench.main(["--sglang-python", "unused", "--etas", "0", "4", "--methods", "naive", "--seeds", "1", "2",
                       "--steps", "8", "--workdir", rel]) == 0
    out = _json_line(capsys.readouterr().out)
    got = {(s["eta"], s["method"]): s for s in out["summary"]}
    assert got[(0, "naive")]["accuracy_mean"] == pytest.approx(0.6)
    assert got[(4, "naive")]["accuracy_se_over_seeds"] == pytest.approx(0.1)  # sqrt(0.02 / 1 / 2)
    assert got[(4, "naive")]["accuracy_se_eval"] == pytest.approx(math.sqrt(0.02 ** 2 + 0.03 ** 2) / 2)
    assert got[(4, "naive")]["prox_s_median"] == 0.5 and got[(4, "naive")]["train_s_median"] == 2.0
    assert got[(0, "naive")]["prox_s_median"] is None  # no metrics kept: nothing invented
    saved = json.loads((work / "eta4-naive-seed1-steps8" / "summary.json").read_text())
    assert saved["prox_s"] == [0.25, 0.5, 0.75] and saved["accuracy"] == 0.2
    assert (work / "staleness.png").stat().st_size > 0
    # --saved-only: the same summary from what is saved, the absent cells named, none run
    assert bench.main(["--sglang-python", "unused", "--etas", "0", "4", "6", "--methods", "naive", "--seeds", "1", "2",
                       "--steps", "8", "--workdir", rel, "--saved-only", "--no-plot"]) == 0
    out = _json_line(capsys.readouterr().out)
    assert out["missing"] == ["eta6-naive-seed1", "eta6-naive-seed2"] and len(out["cells"]) == 4

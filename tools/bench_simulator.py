"""L=$(tools/env/make_venv.sh learner) && PYTHONPATH=. $L/bin/python tools/bench_simulator.py --sglang-python $(tools/env/make_venv.sh sglang)/bin/python

Calibrate the throughput simulator (``areal_mega.simulator``) on the real trainer and check its
prediction. Runs ``tools/bench_async.py`` itself (a subprocess: the synchronous and the
asynchronous run of the real trainer, one SGLang CPU server, its JSON line parsed), reads the
``metrics.jsonl`` each run's trainer wrote (``<work-dir>/{sync,async}<round>/``), fits the
simulator's decode, learner and weight-sync models to those logged timings and generation
lengths (``areal_mega.simulator.calibrate``), simulates both modes and prints ONE JSON line:

  predicted_sync, measured_sync, predicted_async, measured_async   samples/s
  max_rel_error        max over both modes of |predicted - measured| / measured (target <= 0.15)
  predicted_async_sync_decode, rel_error_async_sync_decode
                       the async run with the SYNCHRONOUS run's decode speed (its own learner timings)
  predicted_async_sync_timings_only, rel_error_async_sync_timings_only
                       the async run predicted from the SYNCHRONOUS run's timings only
  predicted_speedup, measured_speedup, predicted/measured_staleness_mean, calibration, sim_*

Each run is reproduced from its own logged timings: learner and weight-sync times, and its decode
speed fitted on its own ``rollout/gen_inflight_s`` (time with an episode in flight), so a run slowed
by load -- or by generation and training sharing the cores -- is described at its own speed and the
two runs need not see the same machine. The synchronous prediction is then close to exact by
construction; the asynchronous one tests the simulated overlap, the pauses at weight sync and the
staleness rules. ``measurement_warning`` flags an overloaded machine or a speed change between
the runs (the learner's own step differs by more than 2x): the two out-of-sample figures
(``*_sync_decode``, ``*_sync_timings_only``) are then void, the per-run ones are not.
``--reuse`` skips the measurement and recalibrates on the runs already in ``--work-dir``.

``--validate`` is the out-of-sample check (docs/simulator.md): one server, the decode sweep
(``areal_mega.simulator.sweep``), then every ``--settings`` run back to back; calibrated on the
``--calibrate-on`` runs only, it predicts the others and prints ONE JSON line: per setting
predicted, measured, rel_error (and the same without the overlap's costs), ``worst_rel_error``,
``ranking_equal`` / ``staleness_ranking_equal``, the calibration, the load average per run;
``--png`` plots the sweep with its fitted curve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_mega.simulator.calibrate import calibrate_and_predict, load_rows  # noqa: E402
from areal_mega.simulator.model import SimulationError  # noqa: E402


DEFAULT_SETTINGS = ("sync:eta=0;sync_b8:eta=0,batch=8;eta1:eta=1;eta2:eta=2;eta4:eta=4;eta1_b8:eta=1,batch=8;"
                    "eta2_new16:eta=2,new=16")


def validate(args: argparse.Namespace) -> int:
    from areal_mega.simulator import calibrate as val

    work = (ROOT / args.work_dir) if not os.path.isabs(args.work_dir) else Path(args.work_dir)
    try:
        settings = val.parse_settings(args.settings, batch=args.batch_size, group=args.group_size,
                                      new=args.max_new_tokens)
        calib = [c.strip() for c in args.calibrate_on.split(",") if c.strip()]
        if not args.reuse:
            if not args.sglang_python:
                print("bench_simulator: --sglang-python is required (or --reuse)", file=sys.stderr)
                return 2
            _measure(args, work, settings)
        res = val.validate(work, settings, calib, warmup_steps=args.warmup_steps)
    except (SimulationError, ValueError) as e:
        print(f"bench_simulator: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    from areal_mega.simulator.plot import plot_decode_sweep
    from areal_mega.simulator.sweep import DecodeFit

    fit = DecodeFit.load(work / "decode_sweep.json")
    png, why = plot_decode_sweep(fit, args.png or (work / "decode_sweep.png"))
    res["decode_sweep_png"] = png or f"not written: {why}"
    print(json.dumps(res), flush=True)
    return 0


def _measure(args: argparse.Namespace, work: Path, settings) -> None:
    """One pinned SGLang server: the decode sweep, then every setting's trainer run, back to back
    (bench_async's own helpers: pinning, server reset between runs, the trainer's metrics)."""
    import time

    sys.path.insert(0, str(ROOT / "tools"))
    import bench_async as ba

    from areal_mega.simulator.sweep import decode_sweep, fit_decode_sweep

    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ns = argparse.Namespace(config="configs/grpo_tiny.yaml", learner_python=args.learner_python,
                            learner_cpus=args.learner_cpus, run_timeout_s=1200.0, server_startup_timeout_s=1200.0)
    tiny = ba._build_tiny(args.learner_python, work / "tiny", env)
    model, data = str(tiny / "model"), str(tiny / "data" / "train.jsonl")
    server_python = ba._pinned_python(args.sglang_python, args.server_cpus, work / "sglang-pinned.sh")
    hf = json.loads((Path(model) / "config.json").read_text())
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    common = [f"model_path={model}", f"data.path={data}", "eval_data=null", "seed=1", "parallel.tensor_parallel=1",
              "trainer.resume=false", "trainer.eval_at_start=false", "trainer.eval_at_end=false",
              "trainer.eval_every=0", "trainer.save_every=0", "trainer.export_hf_at_end=false",
              "rollout.show_progress=false", f"inference.server.dtype={dtype}", *args.bench_args]
    server = ba._start_server(server_python, model, common, ns, work)
    log = {"loadavg": [], "runs": {}}
    try:
        common.append(f"inference.addresses=[{server.address}]")
        t0 = time.time()
        log["loadavg"].append(["sweep_start", *os.getloadavg()])
        pts = decode_sweep(server.url, vocab=int(hf.get("vocab_size", 128)))
        fit = fit_decode_sweep(pts)
        (work / "decode_sweep.json").write_text(json.dumps(fit.summary()) + "\n")
        print(f"[bench_simulator] decode sweep: {len(pts)} points in {time.time() - t0:.0f} s, "
              f"fit rms {fit.rms_rel_error:.3f}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            order = settings if r % 2 == 0 else settings[::-1]  # alternate: load drifts hit every setting
            for st in order:
                ba._reset_server(server, model)
                log["loadavg"].append([f"{st.name}{r}", *os.getloadavg()])
                ba._run_mode(f"{st.name}{r}", st.max_staleness, ns, common + st.overrides(args.warmup_steps, args.steps),
                             env, work)
        log["loadavg"].append(["end", *os.getloadavg()])
        log["rounds"] = args.rounds
        (work / "validate_runs.json").write_text(json.dumps(log) + "\n")
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--sglang-python", help="python of the SGLang venv (required unless --reuse)")
    p.add_argument("--learner-python", default=sys.executable)
    p.add_argument("--work-dir", default="runs/bench_simulator")
    p.add_argument("--reuse", action="store_true", help="do not measure: use <work-dir>/bench_async.json and the runs")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--half-batch", type=float, default=32.0,
                   help="decode model: running requests at half the peak throughput (not identifiable "
                        "from one concurrency level; see docs/simulator.md)")
    p.add_argument("--validate", action="store_true",
                   help="out-of-sample check: decode sweep + trainer runs of --settings on one server; calibrate "
                        "on --calibrate-on, predict the others (see validate.py's docstring)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="--validate: ';'-separated runs, each 'name:key=v,...' (eta, batch, new, group)")
    p.add_argument("--calibrate-on", default="sync,sync_b8,eta1",
                   help="--validate: names of the runs to calibrate on (two synchronous batch sizes: the learner's "
                        "per-token cost; one asynchronous run: the overlap)")
    p.add_argument("--png", help="--validate: where to plot the decode sweep (default <work-dir>/decode_sweep.png)")
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--learner-cpus", default="1")
    p.add_argument("bench_args", nargs="*", help="more arguments for tools/bench_async.py")
    args = p.parse_args(argv)
    if args.validate:
        return validate(args)

    work = (ROOT / args.work_dir) if not os.path.isabs(args.work_dir) else Path(args.work_dir)
    out_json = work / "bench_async.json"
    if not args.reuse:
        if not args.sglang_python:
            print("bench_simulator: --sglang-python is required (or --reuse)", file=sys.stderr)
            return 2
        work.mkdir(parents=True, exist_ok=True)
        cmd = [args.learner_python, str(ROOT / "tools" / "bench_async.py"), "--sglang-python", args.sglang_python,
               "--work-dir", str(work), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
               "--rounds", str(args.rounds), "--staleness", str(args.staleness), "--batch-size", str(args.batch_size),
               "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens), *args.bench_args]
        print("[bench_simulator] $ " + " ".join(cmd), file=sys.stderr, flush=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"bench_simulator: tools/bench_async.py failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        out_json.write_text(lines[-1] + "\n")
    try:
        bench = json.loads(out_json.read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError) as e:
        print(f"bench_simulator: no measurement in {out_json} ({e}); run without --reuse", file=sys.stderr)
        return 1
    try:
        rounds = int(bench.get("rounds", args.rounds))
        sync_rows, async_rows = [], []
        for r in range(rounds):
            # per round: drop warm-up and last step inside calibrate, so pool after trimming
            sync_rows.append(load_rows(work / f"sync{r}" / "metrics.jsonl"))
            async_rows.append(load_rows(work / f"async{r}" / "metrics.jsonl"))
        warm = int(bench.get("warmup_steps", args.warmup_steps))
        # Rounds pooled as bench_async pools them: each run's timed steps, concatenated (one
        # leading warm-up block and one trailing row kept so calibrate's trimming applies once).
        def pool(runs: list[list[dict]]) -> list[dict]:
            if len(runs) == 1:
                return runs[0]
            mid = [row for run in runs for row in run[warm:-1]]
            return runs[0][:warm] + mid + runs[-1][-1:]

        res = calibrate_and_predict(
            pool(sync_rows), pool(async_rows), batch_size=int(bench.get("batch_size", args.batch_size)),
            group_size=int(bench.get("group_size", args.group_size)),
            max_staleness=int(bench.get("max_staleness", args.staleness)),
            max_concurrent=int(bench.get("batch_size", args.batch_size)),  # bench_async: max_concurrent = batch_size
            max_new_tokens=int(bench.get("max_new_tokens", args.max_new_tokens)), warmup_steps=warm,
            half_batch=args.half_batch)
    except SimulationError as e:
        print(f"bench_simulator: {e}", file=sys.stderr)
        return 1
    # bench_async's own figures are the measurement of record (same steps, same formula).
    res["measured_sync_bench_async"] = bench.get("sync_samples_per_s")
    res["measured_async_bench_async"] = bench.get("async_samples_per_s")
    res["loadavg_before"], res["loadavg_after"] = bench.get("loadavg_before"), bench.get("loadavg_after")
    # The out-of-sample figures carry the sync run's speeds over to the async run: they only mean
    # something if the machine ran at the same speed in both. Flag runs where it did not.
    cal = res["calibration"]
    ratio = cal["learner_sync_run"]["fixed_s"] / max(cal["learner_async_run"]["fixed_s"], 1e-9)
    loads = [x[0] for x in (bench.get("loadavg_before"), bench.get("loadavg_after")) if x]
    cores = os.cpu_count() or 1
    warn = []
    if loads and max(loads) > 2 * cores:
        warn.append(f"load average {max(loads):.1f} on {cores} cores during the measurement")
    if not 0.5 <= ratio <= 2.0:
        warn.append(f"the learner's own step took {ratio:.2f}x as long in the sync run as in the async run "
                    "(the machine's speed changed between the runs)")
    res["learner_step_ratio_sync_over_async"] = round(ratio, 4)
    res["measurement_warning"] = "; ".join(warn)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launch learners and inference engines from one experiment YAML; plan its throughput.

    python -m areal_mega.launcher slurm --config configs/grpo_llama70b.yaml [--dry-run] [key=value ...]
    python -m areal_mega.launcher local --config configs/grpo_tiny.yaml [--dry-run] [key=value ...]
    python -m areal_mega.launcher slurm --config X --dry-run --nodelist 'n[1-16]' --gpus-per-node 8
    python -m areal_mega.cli plan --config X --nodes 16 [--gpus-per-node 8] [--staleness 0,1,2,4,8]
        [--out DIR] [--json] [cost.train_mfu=0.3 workload.gen_mean_tokens=8000 key=value ...]

``slurm`` runs inside an allocation (launch/*.sh call it from sbatch); ``local`` runs the same
plan on this machine. ``--dry-run`` prints the plan, the per-GPU memory estimate and the
pre-flight checks (``launcher/preflight.py``) and exits 0. Exit codes (docs/launch.md): 2 = refused
before anything started (a bad key, layout, split, a plan over the GPU memory, a failed
pre-flight check: one line naming the key), the same in a dry run and a real launch; 1 = a started
run failed; 75 = checkpointed and stopped on a signal (requeue); 128 + N = stopped by signal N.
Overrides ``launch.*`` configure the launcher; all others are passed to learners and engines.
The YAML becomes one typed :class:`~areal_mega.experiment.ExperimentConfig` here, whose sections
the plan, the memory estimate and the throughput planner (``areal-mega plan``,
``simulator.planner.sweep``) read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from areal_mega.config import from_dict, load_dict
from areal_mega.experiment import ExperimentConfig, experiment_from_dict
from areal_mega.errors import EXIT_REFUSED
from areal_mega.launcher.config import LaunchConfig
from areal_mega.launcher.local import LocalRunner, local_allocation
from areal_mega.launcher.plan import LaunchPlan, build_plan
from areal_mega.launcher.slurm import SrunRunner, slurm_allocation
from areal_mega.launcher.supervisor import supervise
from areal_mega.simulator.costs import ClusterCostModel, WorkloadModel
from areal_mega.simulator.model import PLAN_TOLERANCE, SimulationError
from areal_mega.simulator.planner import PlanReport, describe, recommendation, sensitivity, sweep, write_plan
from areal_mega.utils.secrets import write_api_key

__all__ = ["build_plan_report", "load_launch", "load_launch_config", "main", "plan_main", "run"]

EXIT_DOES_NOT_FIT = EXIT_REFUSED  # a refusal like any other: nothing started
DEFAULT_STALENESS = (0, 1, 2, 4, 8)
DEFAULT_GPUS_PER_NODE = 8


def load_launch(path: str, overrides: list[str]) -> tuple[ExperimentConfig, dict, list[str]]:
    """(the typed experiment, the YAML with overrides applied, overrides for the other components).

    When the learner command is ``areal-mega train`` the experiment is parsed whole, as the
    learners will parse it (a bad key fails here, before any server starts, in a dry run too);
    otherwise only its known sections (the YAML may carry the learner's own keys). The dict only
    fills ``{cfg:key}`` placeholders."""
    raw, where = load_dict(path, overrides)  # the trainer's own YAML loader and errors
    launch = from_dict(LaunchConfig, raw.get("launch") or {}, where, prefix="launch.")
    exp = experiment_from_dict(raw, where, whole=_runs_the_trainer(launch))
    passthrough = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("launch.")]
    return exp, raw, passthrough


def load_launch_config(path: str, overrides: list[str]) -> tuple[LaunchConfig, dict, list[str]]:
    """(launch section, whole YAML with overrides applied, overrides for the other components)."""
    exp, raw, passthrough = load_launch(path, overrides)
    return exp.launch, raw, passthrough


def run(mode: str, config: str, overrides: list[str], *, dry_run: bool = False,
        engine_python: str | None = None, nodelist: str | None = None,
        gpus_per_node: int | None = None, sensitivity: bool = False) -> int:
    """Plan, check memory, then (unless ``dry_run``) supervise; returns the exit code.
    ``sensitivity``: the dry run's throughput plan adds the sensitivity table (one re-plan per
    assumed cost figure: about a minute on the 70B job, hence asked for)."""
    try:
        exp, raw, passthrough = load_launch(config, overrides)
        cfg = exp.launch
        gpus = gpus_per_node if gpus_per_node is not None else cfg.gpus_per_node
        if mode == "slurm":
            alloc = slurm_allocation(nodelist=nodelist, gpus_per_node=gpus, resolve=not dry_run)
            runner = SrunRunner(alloc.job_id, cfg.srun_args)
        else:
            alloc = local_allocation(gpus or 0)
            runner = LocalRunner()
        plan: LaunchPlan = build_plan(cfg, alloc, raw=raw, config_path=config, overrides=passthrough,
                                      engine_python=engine_python, exp=exp)
        checks: list[str] = []
        if _runs_the_trainer(cfg):  # paths, interpreters, functions: before anything starts (preflight.py)
            from areal_mega.launcher.preflight import preflight

            checks = preflight(exp, engine_python=engine_python,
                               starts_sglang=bool(plan.engines) and cfg.engine.command is None,
                               here=not (mode == "slurm" and dry_run and nodelist is not None))
    except ValueError as e:  # ConfigError and PreflightError included: the message names the key
        print(f"launcher: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_REFUSED

    print(plan.describe(), flush=True)
    for note in plan.notes:
        if "left idle" in note:  # paid for, unused: say so where it is seen, not only in the plan's notes
            print(f"launcher: WARNING: {note} by the fixed split (launch.learner.num_nodes / "
                  "launch.engine.num_nodes); null lets the split follow the allocation", file=sys.stderr, flush=True)
    if dry_run:
        print("\n".join(f"preflight: ok {c}" for c in checks), flush=True)
    if not plan.fits:
        print("launcher: refusing this plan: the per-GPU memory estimate above exceeds "
              f"launch.gpu_memory_gib = {cfg.gpu_memory_gib} GiB (engines: their mem_fraction_static share)",
              file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    if dry_run:
        if plan.checks_gpu_memory and not alloc.local and len(alloc.nodes) >= 2:
            _print_throughput_plan(config, overrides, len(alloc.nodes), alloc.gpus_per_node, out=plan.run_dir / "plan",
                                   sensitivity=sensitivity)
        print("dry run: nothing started", flush=True)
        return 0
    if plan.secrets_dir is not None:
        write_api_key(plan.secrets_dir, plan.api_key)  # 0600; its path only goes on command lines
    client = exp.inference.client  # launched servers restart as the pool's own managed ones do
    return supervise(plan, runner, poll_s=cfg.poll_interval_s, grace_s=cfg.stop_grace_s,
                     tail_lines=cfg.log_tail_lines,
                     engine_timeout_s=cfg.engine.startup_timeout_s + 60, min_ready=cfg.engine.min_ready,
                     preempt_grace_s=cfg.preempt_grace_s, engine_restarts=client.max_restarts if client.restart_dead_servers else 0)


def _runs_the_trainer(cfg: LaunchConfig) -> bool:
    """Whether the learner command is the trainer: ``areal-mega train``, or a script of the user's
    that takes the experiment as ``--config {config}`` (a copy of ``areal_mega/trainer/main.py``);
    anything else (a stand-in, a site's own script) may carry other keys in the YAML."""
    cmd = cfg.learner.command
    return (any(a == "areal_mega.cli" and cmd[i + 1:i + 2] == ["train"] for i, a in enumerate(cmd))
            or any(a == "--config" and cmd[i + 1:i + 2] == ["{config}"] for i, a in enumerate(cmd)))


def _print_throughput_plan(config: str, overrides: list[str], nodes: int, gpus_per_node: int,
                           out: Path | None = None, sensitivity: bool = False) -> None:
    """The throughput planner's recommendation for this allocation (``areal-mega plan``, see
    docs/simulator.md), with its plan.json and plot written to ``out``; advisory: whatever goes
    wrong there is one line, never a failed dry run. ``sensitivity``: add the sensitivity table."""
    try:
        rep = build_plan_report(config, nodes, overrides, gpus_per_node=gpus_per_node, with_sensitivity=sensitivity)
        lines = recommendation(rep)
        if out is not None:
            lines.append("planner: " + write_plan(rep, out))
    except Exception as e:  # noqa: BLE001 -- advisory output only
        lines = [f"planner: skipped ({type(e).__name__}: {' '.join(str(e).split())})"]
    # a fixed split far below the recommendation: where it is seen, as the idle-node warning is
    warn = [ln for ln in lines if ln.startswith("planner: WARNING")]
    print("\n".join(ln for ln in lines if ln not in warn), flush=True)
    for ln in warn:
        print(ln, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_mega.launcher", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["slurm", "local"])
    p.add_argument("--config", required=True, help="experiment YAML (its launch: section configures this)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and memory estimate, start nothing")
    p.add_argument("--engine-python", help="interpreter for engines (default inference.server.python)")
    p.add_argument("--nodelist", help="slurm mode: plan for these nodes instead of SLURM_JOB_NODELIST")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: launch.gpus_per_node, then "
                   "SLURM_GPUS_ON_NODE; local: 0)")
    p.add_argument("--sensitivity", action="store_true", help="dry run: add the throughput plan's sensitivity "
                   "table (each assumed cost figure x0.5 and x2; about a minute on the 70B job)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_intermixed_args(argv)
    return run(args.mode, args.config, args.overrides, dry_run=args.dry_run, engine_python=args.engine_python,
               nodelist=args.nodelist, gpus_per_node=args.gpus_per_node, sensitivity=args.sensitivity)


# ---------------------------------------------------------------- areal-mega plan
def _planner_overrides(overrides: list[str]) -> list[str]:
    """``cost.F=v`` / ``workload.F=v`` name the YAML's ``launch.planner.cost`` / ``.workload``
    (one set of figures for the plan, the dry run and the launch); the rest pass unchanged."""
    out = []
    for o in overrides:
        if "=" not in o:
            raise SimulationError(f"override {o!r}: expected key=value")
        key = o.split("=", 1)[0].strip()
        out.append(f"launch.planner.{o.strip()}" if key.startswith(("cost.", "workload.")) else o)
    return out


def build_plan_report(config: str, nodes: int, overrides: list[str] | None = None, *, gpus_per_node: int | None = None,
                      staleness: tuple[int, ...] = DEFAULT_STALENESS, tolerance: float = PLAN_TOLERANCE,
                      cost: ClusterCostModel | None = None, workload: WorkloadModel | None = None,
                      with_sensitivity: bool = False) -> PlanReport:
    """Sweep splits x max_staleness for the YAML at ``config`` (raises ValueError -- ConfigError,
    SimulationError -- on bad input). ``cost``/``workload`` replace the YAML's ``launch.planner``;
    ``with_sensitivity`` adds ``planner.sensitivity``'s table."""
    exp, _, _ = load_launch(config, _planner_overrides(list(overrides or [])))
    cfg = exp.launch
    if cost is not None:
        cfg.planner.cost = cost
    if workload is not None:
        cfg.planner.workload = workload
    src = "--gpus-per-node"
    if gpus_per_node is None:
        gpus_per_node, src = cfg.gpus_per_node, "launch.gpus_per_node"
    if gpus_per_node is None:
        gpus_per_node, src = DEFAULT_GPUS_PER_NODE, f"default {DEFAULT_GPUS_PER_NODE} (set --gpus-per-node)"
    rep = sweep(exp, label=config, nodes=nodes, gpus_per_node=gpus_per_node, gpus_source=src,
                staleness=staleness, tolerance=tolerance)
    if with_sensitivity:
        rep.sensitivity = sensitivity(exp, rep)
    return rep


def _staleness_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SimulationError(f"--staleness: expected comma-separated integers, got {text!r}") from None
    return vals


def plan_main(argv: list[str] | None = None) -> int:
    """``areal-mega plan``: choose the inference/learner node split and max_staleness by simulation
    (``simulator.planner.sweep``; docs/simulator.md)."""
    p = argparse.ArgumentParser(prog="areal-mega plan", description=plan_main.__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--nodes", type=int, required=True, help="nodes in the allocation")
    p.add_argument("--gpus-per-node", type=int, help=f"default launch.gpus_per_node, else {DEFAULT_GPUS_PER_NODE}")
    p.add_argument("--staleness", default=",".join(map(str, DEFAULT_STALENESS)), help="max_staleness values to sweep")
    p.add_argument("--tolerance", type=float, default=PLAN_TOLERANCE, help="recommend the smallest max_staleness whose "
                   "predicted throughput is within this fraction of the best (default 0.02)")
    p.add_argument("--out", help="write plan.json and throughput_plan.png (predicted throughput vs split and "
                   "vs max_staleness) into this directory")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line instead")
    p.add_argument("--sensitivity", action="store_true", help="re-plan with each assumed cost figure x0.5 and x2 "
                   "(the table goes to plan.json and the summary to the output)")
    p.add_argument("overrides", nargs="*", help="cost.<field>=v, workload.<field>=v (= launch.planner.cost/"
                   "workload), or experiment key=value")
    args = p.parse_intermixed_args(argv)
    try:
        rep = build_plan_report(args.config, args.nodes, args.overrides, gpus_per_node=args.gpus_per_node,
                                staleness=_staleness_list(args.staleness), tolerance=args.tolerance,
                                with_sensitivity=args.sensitivity)
    except (ValueError, OSError) as e:  # ConfigError and SimulationError are ValueErrors
        msg = " ".join(str(e).split())
        print(f"areal-mega plan: {msg}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    print(json.dumps(rep.to_dict()) if args.json else describe(rep), flush=True)
    if args.out:
        try:
            said = write_plan(rep, Path(args.out))
        except OSError as e:
            print(f"areal-mega plan: cannot write {args.out}: {e.strerror or e}", file=sys.stderr, flush=True)
            return 1
        print(said, file=sys.stderr if args.json else sys.stdout, flush=True)
    return 0

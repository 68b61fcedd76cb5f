"""Launch learners and inference engines from one experiment YAML.

    python -m areal_mega.launcher slurm --config configs/grpo_llama70b.yaml [--dry-run] [key=value ...]
    python -m areal_mega.launcher local --config configs/grpo_tiny.yaml [--dry-run] [key=value ...]
    python -m areal_mega.launcher slurm --config X --dry-run --nodelist 'n[1-16]' --gpus-per-node 8

``slurm`` runs inside an allocation (launch/*.sh call it from sbatch); ``local`` runs the same
plan on this machine. ``--dry-run`` prints the plan and the per-GPU memory estimate and exits
0, or 2 when the plan does not fit the GPUs -- a real launch refuses such a plan the same way.
Overrides ``launch.*`` configure the launcher; all others are passed to learners and engines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from areal_mega.config import from_dict, load_dict
from areal_mega.launcher.config import LaunchConfig
from areal_mega.launcher.plan import LaunchPlan, build_plan
from areal_mega.launcher.supervisor import supervise
from areal_mega.utils.secrets import write_api_key

EXIT_DOES_NOT_FIT = 2


def load_launch_config(path: str, overrides: list[str]) -> tuple[LaunchConfig, dict, list[str]]:
    """(launch section, whole YAML with overrides applied, overrides for the other components)."""
    raw, where = load_dict(path, overrides)  # the trainer's own YAML loader and errors
    cfg = from_dict(LaunchConfig, raw.get("launch") or {}, where, prefix="launch.")
    passthrough = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("launch.")]
    return cfg, raw, passthrough


def run(mode: str, config: str, overrides: list[str], *, dry_run: bool = False,
        engine_python: str | None = None, nodelist: str | None = None,
        gpus_per_node: int | None = None) -> int:
    """Plan, check memory, then (unless ``dry_run``) supervise; returns the exit code."""
    try:
        cfg, raw, passthrough = load_launch_config(config, overrides)
        if _runs_the_trainer(cfg):
            # The learners will parse the same YAML and overrides: a bad key fails here, before
            # any server starts (and in a dry run), not minutes later on every rank.
            from areal_mega.trainer.config import load_experiment

            load_experiment(config, overrides)
        gpus = gpus_per_node if gpus_per_node is not None else cfg.gpus_per_node
        if mode == "slurm":
            from areal_mega.launcher.slurm import SrunRunner, slurm_allocation

            alloc = slurm_allocation(nodelist=nodelist, gpus_per_node=gpus, resolve=not dry_run)
            runner = SrunRunner(alloc.job_id, cfg.srun_args)
        else:
            from areal_mega.launcher.local import LocalRunner, local_allocation

            alloc = local_allocation(gpus or 0)
            runner = LocalRunner()
        plan: LaunchPlan = build_plan(cfg, alloc, raw=raw, config_path=config, overrides=passthrough,
                                      engine_python=engine_python)
    except ValueError as e:  # ConfigError included: the message names the key
        print(f"launcher: {e}", file=sys.stderr, flush=True)
        return 1

    print(plan.describe(), flush=True)
    if not plan.fits:
        print("launcher: refusing this plan: the per-GPU memory estimate above exceeds "
              f"launch.gpu_memory_gib = {cfg.gpu_memory_gib} GiB (engines: their mem_fraction_static share)",
              file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    if dry_run:
        if plan.checks_gpu_memory and not alloc.local and len(alloc.nodes) >= 2:
            _print_throughput_plan(config, overrides, len(alloc.nodes), alloc.gpus_per_node, out=plan.run_dir / "plan")
        print("dry run: nothing started", flush=True)
        return 0
    if plan.secrets_dir is not None:
        write_api_key(plan.secrets_dir, plan.api_key)  # 0600; its path only goes on command lines
    return supervise(plan, runner, poll_s=cfg.poll_interval_s, grace_s=cfg.stop_grace_s,
                     tail_lines=cfg.log_tail_lines,
                     engine_timeout_s=cfg.engine.startup_timeout_s + 60, min_ready=cfg.engine.min_ready,
                     preempt_grace_s=cfg.preempt_grace_s)


def _runs_the_trainer(cfg: LaunchConfig) -> bool:
    """Whether the learner command is ``areal-mega train`` (else the YAML may carry other keys)."""
    cmd = cfg.learner.command
    return any(a == "areal_mega.cli" and cmd[i + 1:i + 2] == ["train"] for i, a in enumerate(cmd))


def _print_throughput_plan(config: str, overrides: list[str], nodes: int, gpus_per_node: int,
                           out: Path | None = None) -> None:
    """The throughput planner's recommendation for this allocation (``areal-mega plan``, see
    docs/simulator.md), with its plan.json and plot written to ``out``; advisory: whatever goes
    wrong there is one line, never a failed dry run."""
    try:
        from areal_mega.simulator.planner import build_plan_report, recommendation, write_plan

        # the sensitivity table (one re-plan per assumed cost figure) only where plan.json goes
        rep = build_plan_report(config, nodes, overrides, gpus_per_node=gpus_per_node, with_sensitivity=out is not None)
        lines = recommendation(rep)
        if out is not None:
            lines.append("planner: " + write_plan(rep, out))
    except Exception as e:  # noqa: BLE001 -- advisory output only
        lines = [f"planner: skipped ({type(e).__name__}: {' '.join(str(e).split())})"]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_mega.launcher", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["slurm", "local"])
    p.add_argument("--config", required=True, help="experiment YAML (its launch: section configures this)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and memory estimate, start nothing")
    p.add_argument("--engine-python", help="interpreter for engines (default inference.server.python)")
    p.add_argument("--nodelist", help="slurm mode: plan for these nodes instead of SLURM_JOB_NODELIST")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: launch.gpus_per_node, then "
                   "SLURM_GPUS_ON_NODE; local: 0)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_intermixed_args(argv)
    return run(args.mode, args.config, args.overrides, dry_run=args.dry_run, engine_python=args.engine_python,
               nodelist=args.nodelist, gpus_per_node=args.gpus_per_node)


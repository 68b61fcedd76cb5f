"""L=$(tools/env/make_venv.sh learner) && $L/bin/python tools/bench_dry_run.py [--repo DIR] [--repeat N] [--sensitivity]

Time the launcher's dry run as a new user types it (docs/simulator.md, "Dry run cost"):

  python -m areal_mega.launcher slurm --config configs/grpo_llama70b.yaml --dry-run \\
      --nodelist 'n[1-16]' --gpus-per-node 8

in a fresh interpreter per repetition (imports included), and print ONE JSON line: wall and CPU
seconds per run (min, median), the exit code, the recommendation line (so a faster dry run can
be checked to recommend the same), the load average, the commit. ``--repo`` times another
checkout with this interpreter (e.g. an older commit extracted with ``git archive``: the
"before"); ``--sensitivity`` adds the flag that computes the sensitivity table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = "configs/grpo_llama70b.yaml"


def _child_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _commit(repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "(not a git checkout)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].split("\n")[0])
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="checkout to time (default: this one)")
    p.add_argument("--config", default=CONFIG, help="relative to --repo")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--sensitivity", action="store_true", help="pass --sensitivity to the dry run")
    args = p.parse_args(argv)
    repo = Path(args.repo).resolve()
    walls, cpus, rc, recommended = [], [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "areal_mega.launcher", "slurm", "--config", args.config, "--dry-run",
               "--nodelist", f"n[1-{args.nodes}]", "--gpus-per-node", str(args.gpus_per_node),
               f"launch.run_dir={tmp}/run"]
        if args.sensitivity:
            cmd.append("--sensitivity")
        env = {**os.environ, "PYTHONPATH": str(repo)}
        for _ in range(args.repeat):
            c0, t0 = _child_cpu_s(), time.perf_counter()
            out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            cpus.append(_child_cpu_s() - c0)
            rc = out.returncode
            recommended = next((ln for ln in out.stdout.splitlines() if ln.startswith("planner: recommended")),
                               None)
            if rc != 0:
                print(out.stderr[-2000:], file=sys.stderr)
    print(json.dumps({
        "command": " ".join(c for c in cmd[1:] if not c.startswith("launch.run_dir=")), "repo": str(repo), "commit": _commit(repo), "rc": rc,
        "wall_s_min": round(min(walls), 2), "wall_s_median": round(statistics.median(walls), 2),
        "cpu_s_min": round(min(cpus), 2), "cpu_s_median": round(statistics.median(cpus), 2),
        "repeat": args.repeat, "recommended": recommended, "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }), flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

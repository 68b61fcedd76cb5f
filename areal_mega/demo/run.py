"""`make demo`: the whole product on one CPU machine, in three stages.

    make demo          # = python -m areal_mega.cli demo --learner-python L --sglang-python S

1. build a tiny random Qwen2 + character tokenizer + an addition task (areal_mega/demo/tiny.py);
2. SFT it with the megatron learners (TP=2, torchrun) on *noisy* demonstrations (80% carry a
   stray trailing ".", so the SFT'd model is usually right about the sum but wrong in format);
3. async GRPO (max_staleness=1, decoupled PPO) through the local launcher: one SGLang CPU server
   + two torchrun learner ranks (TP=2), weight sync over gloo after every step.

It prints the greedy accuracy on held-out prompts (never used by RL) before and after RL, read from
the trainer's ``eval.jsonl``: the trainer evaluates with ``areal_mega.evaluation.evaluate_items``,
the implementation ``areal-mega eval`` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], env: dict[str, str], log: Path) -> None:
    print(f"$ {' '.join(cmd)}\n  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-40:]
        raise SystemExit(f"demo: command failed (exit {rc}); last lines of {log}:\n" + "\n".join(tail))


def run_demo(workdir: str, *, learner_python: str, sglang_python: str | None, model: str = "qwen2") -> int:
    summary = run_pipeline(workdir, learner_python=learner_python, sglang_python=sglang_python, model=model)
    print(json.dumps(summary), flush=True)
    before, after = summary["heldout_accuracy_before"], summary["heldout_accuracy_after"]
    print(f"held-out accuracy: {before:.1%} before RL -> {after:.1%} after {summary['rl_steps']} async GRPO steps "
          f"(max staleness seen {summary['max_staleness_seen']}); TensorBoard: {summary['tensorboard']}", flush=True)
    return 0


def make_task(tiny: Path, *, learner_python: str, env: dict[str, str], num_layers: int = 2,
              model: str = "qwen2") -> None:
    """Stage 1 (skipped when ``tiny`` already holds it): the tiny model and the addition task."""
    if not (tiny / "model" / "config.json").exists():
        _run([learner_python, "-m", "areal_mega.demo.tiny", "--out", str(tiny), "--num-layers", str(num_layers),
              "--model", model], env, tiny.parent / f"{tiny.name}.log")


def run_sft(task: Path, out: Path, *, steps: int, learner_python: str, env: dict[str, str]) -> None:
    """Stage 2: configs/sft_tiny.yaml (TP=2, torchrun) on ``task``'s model and sft.jsonl into
    ``out`` (HF export ``out/hf``; log ``<out>.log``)."""
    _run([learner_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", "areal_mega.cli", "sft", "--config", "configs/sft_tiny.yaml",
          f"model_path={task / 'model'}", f"data.path={task / 'data' / 'sft.jsonl'}", f"output_dir={out}",
          f"trainer.num_steps={steps}"], env, out.parent / f"{out.name}.log")


def run_rl(rl_config: str, *, model_dir: Path, task: Path, out: Path, steps: int, learner_python: str,
           sglang_python: str, env: dict[str, str], extra: list[str] | None = None) -> None:
    """Stage 3: ``rl_config`` through the local launcher, on ``task``'s data, from ``model_dir``,
    into ``out`` (log ``<out>.log``)."""
    _run([learner_python, "-m", "areal_mega.launcher", "local", "--config", rl_config,
          f"model_path={model_dir}", f"output_dir={out}", "trainer.resume=false",
          f"data.path={task / 'data' / 'train.jsonl'}", f"eval_data.path={task / 'data' / 'test.jsonl'}",
          f"inference.server.python={sglang_python}", f"launch.run_dir={out.parent / 'launch-{job_id}'}",
          f"trainer.num_steps={steps}", *(extra or [])], env, out.parent / f"{out.name}.log")


def run_pipeline(workdir: str, *, learner_python: str, sglang_python: str | None, sft_steps: int = 300,
                 rl_steps: int = 30, extra: list[str] | None = None, rl_config: str = "configs/grpo_tiny.yaml",
                 rl_name: str = "grpo", reuse_sft: bool = False, model: str = "qwen2") -> dict:
    """Stages 1-3; returns the summary (accuracies, eval curve, max staleness, wall time).

    ``rl_config``/``rl_name``: the RL experiment and its output folder under ``workdir`` (e.g.
    configs/ppo_tiny.yaml, "ppo"); ``reuse_sft``: skip stage 2 when ``workdir`` already holds its
    HF export (several RL runs from one SFT model); ``model``: the tiny model's family
    (areal_mega/demo/tiny.py: qwen2, or qwen3_moe for the mixture-of-experts path)."""
    if not sglang_python:
        raise SystemExit("demo: --sglang-python is required (make demo passes the SGLang venv's python)")
    w = (REPO / workdir).resolve() if not os.path.isabs(workdir) else Path(workdir)
    w.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t0 = time.time()
    tiny, sft, rl = w / "tiny", w / "sft", w / rl_name
    make_task(tiny, learner_python=learner_python, env=env, model=model)
    print(f"[{time.time() - t0:5.0f}s] stage 1/3: tiny model and task in {tiny}", flush=True)

    if not (reuse_sft and (sft / "hf" / "config.json").exists()):
        run_sft(tiny, sft, steps=sft_steps, learner_python=learner_python, env=env)
    print(f"[{time.time() - t0:5.0f}s] stage 2/3: SFT done ({sft_steps} steps) -> {sft / 'hf'}", flush=True)

    eval_log = rl / "eval.jsonl"
    for stale in (eval_log, rl / "metrics.jsonl", rl / "prompts.jsonl"):
        if stale.exists():
            stale.unlink()
    run_rl(rl_config, model_dir=sft / "hf", task=tiny, out=rl, steps=rl_steps, learner_python=learner_python,
           sglang_python=sglang_python, env=env, extra=extra)
    evals = [json.loads(line) for line in eval_log.read_text().splitlines()]
    steps = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    summary = {
        "heldout_accuracy_before": first["accuracy"], "heldout_accuracy_after": last["accuracy"],
        "rl_steps": last["step"], "eval_curve": [(e["step"], round(e["accuracy"], 3)) for e in evals],
        "max_staleness_seen": max(int(r.get("staleness/max", 0)) for r in steps),
        "train_reward_first": steps[0].get("rollout/reward_mean"), "train_reward_last": steps[-1].get("rollout/reward_mean"),
        "wall_s": round(time.time() - t0, 1), "tensorboard": str(rl / "tb"), "output_dir": str(rl),
    }
    print(f"[{time.time() - t0:5.0f}s] stage 3/3: RL ({rl_config}) done", flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(run_demo(sys.argv[1], learner_python=sys.executable, sglang_python=sys.argv[2]))

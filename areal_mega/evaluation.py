"""Held-out evaluation: greedy accuracy and pass@k through the inference pool (one implementation).

    areal-mega eval --config configs/grpo_smollm2.yaml --model runs/x/hf --out runs/x/eval-after \
        [--num-samples 8 --pass-k 1,4,8 --temperature 0.7] [--max-items 50] [key=value ...]

Every caller (this command, the trainer's periodic evaluation, the demo) goes through
:func:`evaluate_items`; what is scored is exactly what training scores (the trainer's episode
stack), and an item is correct when its reward is >= 1. Callers and numbers: docs/evaluation.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from areal_mega.errors import UserError


class EvalError(UserError):
    """Bad input to the eval command (model path, dataset, k values): one line."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    computed as the product prod_{i=n-c+1}^{n} (1 - k / i) for numerical stability."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def binomial_se(p: float, n: int) -> float:
    """Standard error of a fraction p measured on n independent items."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


@dataclass
class EvalSpec:
    """What one evaluation measures (the command's flags; the trainer uses the defaults)."""

    num_samples: int = 0
    """Samples per item at ``temperature`` for pass@k (0 = greedy accuracy only)."""
    pass_k: tuple[int, ...] = ()
    """The k of pass@k (each 1 <= k <= num_samples); empty = (1, num_samples)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""
    max_concurrent: int = 64
    """Episodes in flight at once."""
    progress: bool = False
    """A progress bar on stderr."""

    def validate(self) -> None:
        if self.num_samples < 0:
            raise EvalError(f"--num-samples: must be >= 0, got {self.num_samples}")
        for k in self.pass_k:
            if not 1 <= k <= max(self.num_samples, 0):
                raise EvalError(f"--pass-k: k={k} needs 1 <= k <= --num-samples ({self.num_samples})")
        if self.num_samples and self.temperature <= 0:
            raise EvalError(f"--temperature: pass@k samples need a temperature > 0, got {self.temperature}")
        if self.max_concurrent < 1:
            raise EvalError(f"--max-concurrent: must be >= 1, got {self.max_concurrent}")

    def ks(self) -> tuple[int, ...]:
        if self.pass_k:
            return tuple(self.pass_k)
        return tuple(sorted({1, self.num_samples})) if self.num_samples else ()


async def evaluate_items(engine: Any, greedy: Any, items: Sequence[dict[str, Any]], spec: EvalSpec,
                         sampled: Any = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Run ``greedy`` (and ``sampled``, for pass@k) over ``items`` on ``engine`` (an
    InferenceEngine: the pool). Returns (summary, per-item rows in item order)."""
    sem = asyncio.Semaphore(spec.max_concurrent)
    bar = None
    if spec.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="eval", unit="item", file=sys.stderr, dynamic_ncols=True)

    async def one(item: dict[str, Any]) -> dict[str, Any]:
        async with sem:
            g = await greedy.arun_episode(engine, item)
            row: dict[str, Any] = {"id": item.get("id"), "answer": item.get("answer")}
            reward = float(g[0].reward) if g else 0.0
            row.update(reward=reward, correct=reward >= 1.0,
                       completion=g[0].info.get("completion") if g else None,
                       finish_reason=g[0].info.get("finish_reason") if g else None)
            if sampled is not None:
                trajs = await sampled.arun_episode(engine, item) or []
                rewards = [float(t.reward) for t in trajs]
                row["sample_rewards"] = rewards
                row["num_correct"] = sum(r >= 1.0 for r in rewards)
        if bar is not None:
            bar.update(1)
        return row

    try:
        rows = list(await asyncio.gather(*(one(d) for d in items)))
    finally:
        if bar is not None:
            bar.close()
    return summarize(rows, spec), rows


def summarize(rows: list[dict[str, Any]], spec: EvalSpec) -> dict[str, float]:
    n = len(rows)
    acc = sum(r["correct"] for r in rows) / n if n else float("nan")
    out = {"n": float(n), "accuracy": acc, "accuracy_se": binomial_se(acc, n),
           "reward": sum(r["reward"] for r in rows) / n if n else float("nan")}
    for k in spec.ks():
        vals = [pass_at_k(len(r["sample_rewards"]), r["num_correct"], k) for r in rows]
        out[f"pass@{k}"] = sum(vals) / n if n else float("nan")
        # items are independent; per-item values are bounded in [0, 1]: the SE of their mean
        mean = out[f"pass@{k}"]
        out[f"pass@{k}_se"] = (math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1) / n) if n > 1 else float("nan"))
    return out


# ---------------------------------------------------------------------- the eval command
def _is_checkpoint(path: Path) -> bool:
    from areal_mega.megatron.checkpoint import METADATA_FILE

    return (path / METADATA_FILE).exists()


def resolve_model(path: str, work: Path) -> Path:
    """An HF directory as is; a trainer/engine checkpoint (the one areal_mega format, also a
    run's ``checkpoints/latest``) exported to ``work/hf`` first (cached there by checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"--model: {path} does not exist")
    p = p.resolve()
    if (p / "config.json").exists():
        return p
    if not _is_checkpoint(p):
        raise EvalError(f"--model: {path} is neither an HF model directory (config.json) nor an "
                        f"areal_mega checkpoint")
    out = work / f"hf-{p.name}"
    if (out / "config.json").exists():
        return out
    import shutil

    from areal_mega.megatron.hf_export import export_checkpoint

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    export_checkpoint(str(p), str(partial), prog="areal-mega eval")
    partial.rename(out)  # an interrupted export is never taken for a finished one
    return out


def load_items(cfg: Any, tokenizer: Any, max_items: int = 0,
               heldout: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``eval_data`` (the whole file/task, templated as training templates), else the held-out
    split of ``data`` (``heldout`` when the caller has loaded it already); the first
    ``max_items`` when > 0. The trainer and the eval command evaluate the same items."""
    from areal_mega.data import load_dataset

    if cfg.eval_data is not None:
        whole = dataclasses.replace(cfg.eval_data, num_eval=0, eval_fraction=0.0, shuffle=False)
        items = list(load_dataset(whole, tokenizer=tokenizer).train)
    elif heldout is not None:
        items = list(heldout)
    else:
        items = list(load_dataset(cfg.data, tokenizer=tokenizer).eval)
    return items[:max_items] if max_items > 0 else items


def run_eval(config: str, overrides: list[str], *, model: str, out: str, spec: EvalSpec, max_items: int = 0) -> int:
    """``areal-mega eval``: prints the summary JSON; writes ``<out>/summary.json`` and
    ``<out>/items.jsonl``."""
    from transformers import AutoTokenizer

    from areal_mega.inference.client import InferencePool
    from areal_mega.experiment import load_experiment
    from areal_mega.reward.code import check_samples
    from areal_mega.workflows.stack import EpisodeStack

    spec.validate()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(model, out_dir)
    # the whole tree is validated here; a bad key or value is a ConfigError naming it
    cfg = load_experiment(config, [f"model_path={model_dir}", f"inference.server.model_path={model_dir}", *overrides])
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        items = load_items(cfg, tok, max_items)
    except ValueError as e:
        raise e if isinstance(e, UserError) else EvalError(f"eval_data: {e}") from None
    try:  # a code reward's tests, checked before any server starts (as the trainer does)
        check_samples(cfg.reward, items, (cfg.eval_data or cfg.data).allow_empty_test_output,
                      "eval_data" if cfg.eval_data is not None else "data")
    except ValueError as e:
        raise EvalError(str(e)) from None
    if not items:
        raise EvalError("eval_data: no items to evaluate (set eval_data, or data.num_eval > 0)")

    async def main() -> tuple[dict[str, float], list[dict[str, Any]]]:
        pool = await InferencePool.launch(cfg.inference)
        stack = None
        try:
            # the trainer's episode stack (a judge on the policy's servers uses this pool)
            stack = EpisodeStack.build(str(model_dir), cfg.workflow, cfg.reward, policy_engine=pool)
            greedy, sampled = stack.eval_workflows(num_samples=spec.num_samples, temperature=spec.temperature)
            return await evaluate_items(pool, greedy, items, spec, sampled)
        finally:
            if stack is not None:
                stack.close()
            await pool.close()

    summary, rows = asyncio.run(main())
    summary = {"model": str(model_dir), "config": config, **summary,
               "temperature": spec.temperature if spec.num_samples else None, "num_samples": spec.num_samples}
    with open(out_dir / "items.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 0

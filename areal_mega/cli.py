"""The `areal-mega` command.

    areal-mega train  --config configs/grpo_tiny.yaml [key.sub=value ...]   # one learner rank (under torchrun)
    areal-mega sft    --config configs/sft_tiny.yaml  [key.sub=value ...]   # one learner rank (under torchrun)
    areal-mega launch --config configs/grpo_tiny.yaml [--dry-run] [key=value ...]  # local: servers + torchrun
    areal-mega eval   --config C --model HF_DIR|CHECKPOINT --out DIR [--num-samples 8 --pass-k 1,8
                      --temperature 0.7] [--max-items N] [key=value ...]     # accuracy, pass@k via SGLang
    areal-mega demo                                                          # what `make demo` runs
    areal-mega plan   --config configs/grpo_llama70b.yaml --nodes 16         # throughput planner (simulator)

Subcommands import their modules lazily: `areal-mega launch --dry-run` must not pay for
megatron/torch imports.
"""

from __future__ import annotations

import argparse
import sys


def _split_overrides(rest: list[str]) -> list[str]:
    bad = [r for r in rest if "=" not in r]
    if bad:
        raise SystemExit(f"areal-mega: unexpected arguments {bad} (overrides look like key.sub=value)")
    return rest


def main(argv: list[str] | None = None) -> int:
    """Bad input (a config key, a YAML file, a checkpoint) ends in one line naming it, exit 2."""
    from areal_mega.errors import EXIT_REFUSED, UserError

    try:
        return _main(argv)
    except UserError as e:
        print(f"areal-mega: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="areal-mega", description="Megatron-backed asynchronous RL")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("train", "run the RL trainer on this learner rank (under torchrun)"),
                        ("sft", "supervised fine-tuning on this learner rank (under torchrun)")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True)
    p = sub.add_parser("launch", help="start inference servers and torchrun learners on this machine")
    p.add_argument("--config", required=True)
    p.add_argument("--dry-run", action="store_true", help="print the plan and memory estimate, start nothing")
    p = sub.add_parser("eval", help="greedy accuracy and pass@k of a model or checkpoint through SGLang servers")
    p.add_argument("--config", required=True, help="experiment YAML: eval_data (else data's held-out split), "
                   "workflow, reward, inference")
    p.add_argument("--model", required=True, help="HF model directory or areal_mega checkpoint")
    p.add_argument("--out", required=True, help="directory for summary.json and items.jsonl")
    p.add_argument("--num-samples", type=int, default=0, help="samples per item for pass@k (0: greedy only)")
    p.add_argument("--pass-k", default="", help="comma-separated k values (default 1,NUM_SAMPLES)")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the pass@k samples")
    p.add_argument("--max-items", type=int, default=0, help="evaluate only the first N items (0: all)")
    p.add_argument("--max-concurrent", type=int, default=64, help="episodes in flight at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p = sub.add_parser("demo", help="tiny model end to end: build, SFT, async GRPO, held-out accuracy")
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--learner-python", default=sys.executable)
    p.add_argument("--sglang-python", default=None)
    p.add_argument("--model", default="qwen2", choices=("qwen2", "qwen3_moe"),
                   help="tiny model family (qwen3_moe: Qwen3-MoE, 8 experts, top-2)")
    sub.add_parser("plan", add_help=False,
                   help="predict the best inference/learner split and max_staleness (areal_mega.simulator)")
    args, rest = ap.parse_known_args(argv)

    if args.cmd == "train":
        from areal_mega.trainer.main import main as train_main

        return train_main(["--config", args.config, *_split_overrides(rest)])
    if args.cmd == "sft":
        from areal_mega.sft import run_sft

        return run_sft(args.config, _split_overrides(rest))
    if args.cmd == "launch":
        from areal_mega.launcher.cli import run

        return run("local", args.config, _split_overrides(rest), dry_run=args.dry_run)
    if args.cmd == "eval":
        from areal_mega.evaluation import EvalError, EvalSpec, run_eval

        try:
            ks = tuple(int(k) for k in args.pass_k.split(",") if k.strip())
        except ValueError:
            raise EvalError(f"--pass-k: {args.pass_k!r} is not a comma-separated list of integers") from None
        spec = EvalSpec(num_samples=args.num_samples, pass_k=ks, temperature=args.temperature,
                        max_concurrent=args.max_concurrent, progress=not args.no_progress)
        return run_eval(args.config, _split_overrides(rest), model=args.model, out=args.out, spec=spec,
                        max_items=args.max_items)
    if args.cmd == "plan":
        from areal_mega.launcher.cli import plan_main

        return plan_main(rest)
    if args.cmd == "demo":
        from areal_mega.demo.run import run_demo

        return run_demo(args.workdir, learner_python=args.learner_python, sglang_python=args.sglang_python,
                        model=args.model)
    return 2


if __name__ == "__main__":
    sys.exit(main())

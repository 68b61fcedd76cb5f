"""A tiny multi-step arithmetic task whose step rewards carry what the outcome does not.

    python -m areal_mega.demo.chain --out runs/chain   # model/ (tiny Qwen2, character tokenizer), data/

``Q:5+3-4+2=?A:`` is answered one operation per step, steps joined by "=": ``8-4+2=4+2=6``.
``chain_reward`` is the outcome on a finished completion and, on a step prefix, whether that
step is right given the step before it as written. tools/process_reward_lm.py trains it with
outcome rewards only vs outcome + process rewards; the task and the run: docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

_OP = re.compile(r"^(\d+)([+-])(\d+)(.*)$")
_NUMBER = re.compile(r"^-?\d+$")
STEP = "="  # joins the steps; workflow.steps.delimiter "=" cuts after it


def reduce_first(expr: str) -> str | None:
    """``expr`` with its first operation evaluated ("8-4+2" -> "4+2"); None when it has none."""
    m = _OP.match(expr)
    if m is None:
        return None
    a, op, b, rest = m.groups()
    return f"{int(a) + int(b) if op == '+' else int(a) - int(b)}{rest}"


def expression(prompt: str) -> str:
    """The chain of a prompt ``Q:<chain>=?A:``."""
    return prompt.split("Q:", 1)[-1].split("=?", 1)[0]


def chain_reward(prompt: str, completion: str, data: dict[str, Any]) -> float:
    """1.0 or 0.0. A finished completion (not ending in "="): its last step is the answer
    ``data["answer"]`` (the outcome). A step prefix (ending in the "=" that ends its step): its
    last step, when a bare number, is the answer; otherwise it must be the step before it (the
    prompt's chain for the first) with the first operation done right."""
    text = completion.strip()
    steps = [x.strip() for x in text.split(STEP)]
    if not text:
        return 0.0
    if not text.endswith(STEP):
        return float(steps[-1] == str(data["answer"]).strip())
    steps = steps[:-1]  # the empty remainder after the final "="
    last = steps[-1]
    if _NUMBER.match(last):
        return float(last == str(data["answer"]).strip())
    prev = steps[-2] if len(steps) > 1 else expression(prompt)
    return float(last == reduce_first(prev))


def chains(num_steps: int, lo: int = 0, hi: int = 6) -> list[tuple[int, list[tuple[str, int]]]]:
    """Every chain (start digit, [(op, digit)] * num_steps) whose true values stay in [lo, hi]."""
    out = []
    for a in range(10):
        for ops in itertools.product("+-", repeat=num_steps):
            for bs in itertools.product(range(1, 10), repeat=num_steps):
                v, ok = a, True
                for o, b in zip(ops, bs):
                    v = v + b if o == "+" else v - b
                    ok = ok and lo <= v <= hi
                if ok:
                    out.append((a, list(zip(ops, bs))))
    return out


def render(a: int, ops: list[tuple[str, int]]) -> str:
    return str(a) + "".join(f"{o}{b}" for o, b in ops)


def demonstration(a: int, ops: list[tuple[str, int]], rng: random.Random, noise: float) -> str:
    """The rewritten chain, each step's result written +1 with probability ``noise`` (carried on)."""
    steps, v = [], a
    for j, (o, b) in enumerate(ops):
        v = (v + b if o == "+" else v - b) + (1 if rng.random() < noise else 0)
        steps.append(render(v, ops[j + 1:]))
    return STEP.join(steps)


def write_data(out_dir: Path, *, num_steps: int, num_test: int, num_sft: int, sft_noise: float, seed: int) -> None:
    """train.jsonl (RL prompts), test.jsonl (``num_test`` held out from RL and SFT), sft.jsonl."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    all_chains = chains(num_steps)
    rng.shuffle(all_chains)
    test, train = all_chains[:num_test], all_chains[num_test:]

    def row(a, ops, answer) -> dict:
        return {"id": render(a, ops), "prompt": f"Q:{render(a, ops)}=?A:", "answer": str(answer)}

    def value(a, ops) -> int:
        for o, b in ops:
            a = a + b if o == "+" else a - b
        return a

    sft = [row(a, ops, demonstration(a, ops, rng, sft_noise)) for a, ops in (rng.choice(train) for _ in range(num_sft))]
    for name, rows in (("train", [row(a, ops, value(a, ops)) for a, ops in train]),
                       ("test", [row(a, ops, value(a, ops)) for a, ops in test]), ("sft", sft)):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def main() -> None:
    from areal_mega.demo.tiny import build_model, build_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-steps", type=int, default=3, help="operations per chain")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-test", type=int, default=50)
    ap.add_argument("--num-sft", type=int, default=20000)
    ap.add_argument("--sft-noise", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.num_steps < 1:
        raise SystemExit(f"--num-steps: must be >= 1, got {args.num_steps}")
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    build_tokenizer(out / "model")
    build_model(out / "model", num_layers=args.num_layers, seed=args.seed)
    write_data(out / "data", num_steps=args.num_steps, num_test=args.num_test, num_sft=args.num_sft,
               sft_noise=args.sft_noise, seed=args.seed)
    print(json.dumps({"model": str(out / "model"), "data": str(out / "data")}))


if __name__ == "__main__":
    main()

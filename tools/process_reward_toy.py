"""A toy RL run where step rewards carry information the outcome does not: outcome-only GRPO vs
process-supervised GRPO, same seeds. Prints JSON (one line per run, then a summary).

    PYTHONPATH=. $L/bin/python tools/process_reward_toy.py --steps 20 --seeds 0 1 2

The task: a chain of K arithmetic steps ("12 + 7 = 19", "19 * 3 = 57", ...) from a start number;
the answer is the chain's last result. The policy is tiny and tabular: for each operation
(+, -, *) a softmax over four ways of writing a step's result -- correct, +1, -1, +10 -- so it
generalises to held-out chains with other numbers. It starts biased towards "+1" (P(correct)
= 0.14 per step; greedy decoding always wrong), so with K = 4 an all-correct chain, the only
outcome reward, has probability ~4e-4 at first. A wrong step carries its error into the
rest of the chain (later steps compute from the written value), so the answer is right only
when every step is.

What is real product code: the completion text, its cut into steps (``workflows.steps`` on a
character tokenizer), the rewards (outcome: the answer equals the true result; steps:
``reward.consistency`` per step through ``reward.steps.StepScored``), the trajectories, the
packed batch (``rollout.batch``) and the advantages (``algo.advantages.compute_advantages``,
grpo with ``process_weight`` 0 or 1). The update is REINFORCE on the tabular logits with each
step's advantage (the advantage on the step's tokens), not the megatron trainer: a toy of the
credit assignment, not a model run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

from areal_mega.algo.advantages import compute_advantages
from areal_mega.algo.config import AlgorithmConfig
from areal_mega.api.workflow import Trajectory
from areal_mega.reward.consistency import ConsistencyReward
from areal_mega.reward.steps import StepScored
from areal_mega.rollout.batch import to_engine_alignment, trajectories_to_batch
from areal_mega.workflows.steps import StepConfig, split_steps

OPS = ["+", "-", "*"]
MODES = [0, 1, -1, 10]  # error added to the written result: correct, +1, -1, +10


class CharTok:
    eos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def problem(rng: random.Random, num_steps: int) -> tuple[int, list[tuple[str, int]]]:
    return rng.randint(1, 20), [(rng.choice(OPS), rng.randint(2, 9)) for _ in range(num_steps)]


def true_answer(start: int, ops: list[tuple[str, int]]) -> int:
    v = start
    for op, b in ops:
        v = v + b if op == "+" else v - b if op == "-" else v * b
    return v


def rollout(theta: torch.Tensor, start: int, ops, gen: torch.Generator, greedy: bool = False):
    """(completion text, [(op index, mode index)] per step)."""
    v, lines, acts = start, [], []
    for op, b in ops:
        k = OPS.index(op)
        probs = torch.softmax(theta[k], 0)
        m = int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=gen))
        r = (v + b if op == "+" else v - b if op == "-" else v * b) + MODES[m]
        lines.append(f"{v} {op} {b} = {r}\n")
        acts.append((k, m))
        v = r
    return "".join(lines) + f"The answer is {v}.", acts, v


def run(seed: int, process: bool, *, num_iters: int, group: int, prompts: int, num_steps: int, lr: float,
        heldout: list) -> dict:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    # Start biased towards the +1 error (P(correct) = 0.14 per step, greedy always wrong).
    theta = torch.tensor([[-1.0, 0.2, 0.1, 0.0]] * len(OPS))
    tok, steps_cfg = CharTok(), StepConfig(split="regex", delimiter=r"\n")
    step_reward = StepScored(ConsistencyReward(), "step")
    cfg = AlgorithmConfig(adv_estimator="grpo", process_weight=1.0 if process else 0.0)
    curve = []
    for it in range(num_iters):
        samples, acts_all = [], []
        for p in range(prompts):
            start, ops = problem(rng, num_steps)
            truth = true_answer(start, ops)
            for _ in range(group):
                text, acts, answer = rollout(theta, start, ops, gen)
                ids = tok.encode(text)
                ends, step_texts = split_steps(tok, [ids], steps_cfg)
                samples.append((tok.encode(f"{start}:"), ids, ends, step_texts, float(answer == truth), f"{it}-{p}"))
                acts_all.append(acts)

        async def score_all():
            return await asyncio.gather(*[step_reward.evaluate_steps("", s[3], {}) for s in samples])

        trajs = []
        for (prompt_ids, ids, ends, _, reward, gid), srs in zip(samples, asyncio.run(score_all())):
            n = len(prompt_ids) + len(ids)
            trajs.append(Trajectory(prompt_ids + ids, [0] * len(prompt_ids) + [1] * len(ids), [0.0] * n, [0] * n,
                                    reward, gid, step_ends=ends, step_rewards=srs))
        batch = to_engine_alignment(trajectories_to_batch(trajs))
        adv = compute_advantages(batch, cfg)["advantages"]
        cu = batch["cu_seqlens"].tolist()
        logp = torch.log_softmax(theta.requires_grad_(True), 1)
        loss = torch.zeros(())
        for i, (t, acts) in enumerate(zip(trajs, acts_all)):
            gen_pos = [cu[i] + j - 1 for j, m in enumerate(t.loss_mask) if m]  # engine alignment: j-1 predicts j
            for (k, m), e in zip(acts, t.step_ends[:len(acts)]):  # the result steps (the answer line adds none)
                loss = loss - adv[gen_pos[e - 1]] * logp[k, m]
        (loss / len(trajs)).backward()
        with torch.no_grad():
            theta = (theta - lr * theta.grad).detach()
        curve.append(sum(t.reward for t in trajs) / len(trajs))
    correct = sum(rollout(theta, s, o, gen, greedy=True)[2] == true_answer(s, o) for s, o in heldout)
    p_correct = torch.softmax(theta, 1)[:, 0].tolist()
    return {"seed": seed, "process": process, "train_reward_first5": sum(curve[:5]) / 5,
            "train_reward_last5": sum(curve[-5:]) / 5, "heldout_greedy_acc": correct / len(heldout),
            "p_correct_per_op": [round(x, 3) for x in p_correct]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="RL iterations (one batch each)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--chain", type=int, default=4, help="arithmetic steps per problem")
    ap.add_argument("--lr", type=float, default=1.0)
    args = ap.parse_args()
    hrng = random.Random(10_000)
    heldout = [problem(hrng, args.chain) for _ in range(200)]
    t0 = time.time()
    rows = []
    for seed in args.seeds:
        for process in (False, True):
            row = run(seed, process, num_iters=args.steps, group=args.group, prompts=args.prompts,
                      num_steps=args.chain, lr=args.lr, heldout=heldout)
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {mode: {k: sum(r[k] for r in rows if r["process"] == (mode == "process")) / len(args.seeds)
                      for k in ("train_reward_last5", "heldout_greedy_acc")} for mode in ("outcome", "process")}
    print(json.dumps({"summary": summary, "args": vars(args), "wall_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()

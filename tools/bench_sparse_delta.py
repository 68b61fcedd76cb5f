"""PYTHONPATH=. python tools/bench_sparse_delta.py --model $(python tools/make_smollm2.py) --lr 4e-5 --steps 6

How sparse is a weight update on the wire? The servers hold bf16 (the weight-sync wire dtype);
after an optimizer step only the elements whose bf16 rounding moved need to travel. This
measures that density on a real pretrained model at a given learning rate, the learner as the
real-model example runs it (configs/grpo_smollm2.yaml: fp32 weights, Adam with megatron's
defaults -- beta1 0.9, beta2 0.999, eps 1e-8, no weight decay -- gradient clipping at 1.0), and
what a lossless sparse encoding (int32 index + bf16 value per changed element) would cost.
The loss is next-token cross-entropy on random token sequences: Adam's step is ~lr per element
whatever the gradient's scale, so the density depends on the learning rate and the weights'
magnitudes far more than on the loss (the real GRPO loss is not run here).

Checks that the encoding is lossless: the previous bf16 weights with the changed values
scattered in equal the new bf16 weights bit for bit. Prints ONE JSON line:

    {"model", "lr", "params", "steps": [{"step", "changed", "density", "sparse_bytes",
     "dense_bytes", "ratio"}...], "density_median", "ratio_median", "by_kind": {...}, "lossless"}

``ratio`` = dense bf16 bytes / sparse bytes (6 per changed element): above 1, a sparse delta
sends less. Sparse deltas are not implemented in weight sync (docs/weight_sync.md); this is the
measurement that says what they would buy.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def kind(name: str) -> str:
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    return "linear"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", required=True, help="HF model directory (tools/make_smollm2.py prints one)")
    ap.add_argument("--lr", type=float, default=4e-5, help="learning rate (configs/grpo_smollm2.yaml: 4e-5)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=96, help="tokens per sequence (prompt + 32 new tokens in the example)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(params.values(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    vocab = model.config.vocab_size
    prev = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    steps, by_kind, lossless = [], {}, True
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, vocab, (args.batch, args.seq))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        changed = total = 0
        for n, p in params.items():
            new = p.detach().to(torch.bfloat16)
            mask = new.view(torch.int16) != prev[n].view(torch.int16)  # bitwise: -0.0 / NaN count as changes
            idx = mask.reshape(-1).nonzero().squeeze(1)
            rebuilt = prev[n].reshape(-1).clone()
            rebuilt[idx] = new.reshape(-1)[idx]
            lossless &= torch.equal(rebuilt.view(torch.int16), new.reshape(-1).view(torch.int16))
            c = int(idx.numel())
            changed += c
            total += new.numel()
            k = by_kind.setdefault(kind(n), {"changed": 0, "elements": 0})
            k["changed"] += c
            k["elements"] += new.numel()
            prev[n] = new
        sparse, dense = 6 * changed, 2 * total
        steps.append({"step": step, "loss": round(float(loss), 4), "changed": changed,
                      "density": round(changed / total, 5), "sparse_bytes": sparse, "dense_bytes": dense,
                      "ratio": round(dense / max(sparse, 1), 2)})
    print(json.dumps({
        "model": args.model, "lr": args.lr, "params": sum(p.numel() for p in params.values()), "steps": steps,
        # step 1 is Adam's first step (|update| = lr exactly for every element): reported, not in the medians
        "density_median": statistics.median(s["density"] for s in steps[1:] or steps),
        "ratio_median": statistics.median(s["ratio"] for s in steps[1:] or steps),
        "by_kind": {k: round(v["changed"] / v["elements"], 5) for k, v in by_kind.items()},  # mean per-step density
        "lossless": lossless,
    }))


if __name__ == "__main__":
    main()

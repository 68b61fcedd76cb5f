"""A tiny, fully offline model + task for demos and CI: two-number addition.

    python -m areal_mega.demo.tiny --out runs/tiny   # writes model/, data/train.jsonl, data/test.jsonl

The model is a randomly initialised Qwen2 (HF layout, safetensors) with a character-level
tokenizer saved in the HF ``tokenizer.json`` format, so every component -- megatron learners,
SGLang servers, conversion tools -- loads it exactly as it would a real checkpoint. Random weights
know nothing, so the demo first runs a short SFT stage (``areal-mega sft``) and then GRPO; the
task is verifiable (exact integer answer) so accuracy is an honest learning signal.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Character vocabulary. Specials first so their ids are stable: 0 pad, 1 bos, 2 eos.
SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = list("0123456789+-*=?:. ") + list("abcdefghijklmnopqrstuvwxyz") + list("QA")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.save_pretrained(str(out_dir))


MODELS = ("qwen2", "qwen3_moe")


def build_model(out_dir: Path, *, num_layers: int = 2, hidden: int = 128, vocab_size: int = 128,
                seed: int = 0, family: str = "qwen2") -> None:
    """``family`` "qwen2" (dense, MLP 4h) or "qwen3_moe" (QK-norm, 8 experts of h, top-2
    renormalised; active MLP width 2h, half the dense one): the MoE path end to end."""
    from areal_mega.demo.models import save_tiny_model

    if family not in MODELS:
        raise ValueError(f"--model: {family!r} is not one of {MODELS}")
    moe = dict(moe_intermediate_size=hidden, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    save_tiny_model(out_dir, family, dtype="bfloat16", seed=seed, vocab_size=vocab_size, hidden_size=hidden,
                    intermediate_size=hidden * 4, num_hidden_layers=num_layers, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                    **(moe if family == "qwen3_moe" else {}))


def exact_answer(prompt: str, completion: str, data: dict) -> float:
    """Reward: 1.0 iff the completion is exactly the reference answer (whitespace ignored)."""
    return float(completion.strip() == str(data["answer"]).strip())


def write_data(out_dir: Path, *, max_operand: int, num_test: int, num_sft: int, sft_noise: float,
               seed: int) -> None:
    """Addition prompts ``Q:a+b=?A:`` with a, b in [0, max_operand].

    * test.jsonl:  ``num_test`` prompts held out from RL (the accuracy we report);
    * train.jsonl: every other prompt (RL);
    * sft.jsonl:   ``num_sft`` *noisy* demonstrations over all prompts: with probability
      ``sft_noise`` the demonstrated answer carries a stray trailing "." ("7." instead of "7").
      The SFT'd model learns the sums but, greedily, also the format error, so its exact-match
      accuracy starts low; RL against the exact-match verifier has to unlearn the error from
      reward alone, and the held-out prompts (never seen by RL) show whether that generalises.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    test, train = pairs[:num_test], pairs[num_test:]

    def row(a: int, b: int, ans: int | str) -> dict:
        return {"id": f"{a}+{b}", "prompt": f"Q:{a}+{b}=?A:", "answer": str(ans)}

    sft = []
    for _ in range(num_sft):
        a, b = rng.choice(pairs)
        sft.append(row(a, b, f"{a + b}." if rng.random() < sft_noise else a + b))
    for name, rows in (("train", [row(a, b, a + b) for a, b in train]),
                       ("test", [row(a, b, a + b) for a, b in test]), ("sft", sft)):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def make_tiny(out: Path, *, num_layers: int, hidden: int, family: str, max_operand: int, num_test: int, num_sft: int,
              sft_noise: float, seed: int) -> tuple[Path, Path]:
    """``out/model`` (tokenizer + model) and ``out/data`` (train/test/sft jsonl); returns both."""
    out = Path(out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    build_tokenizer(out / "model")
    build_model(out / "model", num_layers=num_layers, hidden=hidden, seed=seed, family=family)
    write_data(out / "data", max_operand=max_operand, num_test=num_test, num_sft=num_sft, sft_noise=sft_noise,
               seed=seed)
    return out / "model", out / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--model", default="qwen2", choices=MODELS, help="tiny model family (qwen3_moe: 8 experts, top-2)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--max-operand", type=int, default=9)
    ap.add_argument("--num-test", type=int, default=30)
    ap.add_argument("--num-sft", type=int, default=20000)
    ap.add_argument("--sft-noise", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, data = make_tiny(Path(args.out), num_layers=args.num_layers, hidden=args.hidden, family=args.model,
                            max_operand=args.max_operand, num_test=args.num_test, num_sft=args.num_sft,
                            sft_noise=args.sft_noise, seed=args.seed)
    print(json.dumps({"model": str(model), "data": str(data)}))


if __name__ == "__main__":
    main()

"""Tiny random HF models and the tiny addition task, for tests (no network, no product demo code).

One builder for every test model: ``tiny_model`` (in memory) / ``save_tiny_model`` (HF layout,
safetensors). The defaults are the engine tests' model -- Qwen2, vocab 200, hidden 64, MLP 128,
4 layers, GQA 4/2 heads of 16 -- and each test overrides what it needs (the override says what
the test depends on). Construction is deterministic: ``torch.manual_seed(seed)``, HF's own init
(std ``initializer_range``, 0.02 unless overridden), in fp32; then optionally every weight times
``scale`` and plus ``noise`` * N(0, 1) (own generator), then cast to ``dtype``.

``write_tiny_task`` writes what the real trainer needs for a run on the tiny addition task
(a character tokenizer, a tiny model, train/test jsonl) -- the tests' own copy, so that a change
to the product's demo (areal_mega/demo/) cannot change what the failover or Slurm tests run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

DEFAULTS = dict(
    vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FAMILIES = ("qwen2", "llama")
# The weight-sync tests' model (the live TP2 x PP2 sync and the pure planner): bf16 on disk,
# head_dim 64 (what SGLang's CPU attention takes), tied embeddings, qkv bias.
WSYNC_QWEN2 = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


def tiny_config(family: str = "qwen2", **overrides) -> dict:
    """The HF config (as a dict, with ``model_type``) of a tiny model; ``head_dim`` defaults to
    hidden_size / num_attention_heads."""
    if family not in FAMILIES:
        raise ValueError(f"family: {family!r} is not one of {FAMILIES}")
    cfg = {**DEFAULTS, **overrides}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return {"model_type": family, **cfg}


def _hf_classes_and_config(family: str, overrides: dict):
    import transformers

    cfg = {k: v for k, v in tiny_config(family, **overrides).items() if k != "model_type"}
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family]
    return config_cls, model_cls, cfg


def tiny_model(family: str = "qwen2", *, seed: int = 0, scale: float = 1.0, noise: float = 0.0,
               noise_seed: int = 0, **overrides):
    """A tiny random ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` in fp32 (see the module doc)."""
    config_cls, model_cls, cfg = _hf_classes_and_config(family, overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).to(torch.float32)
    with torch.no_grad():
        if scale != 1.0:
            for p in model.parameters():
                p.mul_(scale)
        if noise:  # random norms and biases too, so that a misplaced one shows
            g = torch.Generator().manual_seed(noise_seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


def count_params(family: str = "qwen2", **overrides) -> int:
    """Parameters of ``tiny_model(family, **overrides)`` (built on the meta device: no memory)."""
    config_cls, model_cls, cfg = _hf_classes_and_config(family, overrides)
    with torch.device("meta"):
        return sum(p.numel() for p in model_cls(config_cls(**cfg)).parameters())


def save_tiny_model(path, family: str = "qwen2", *, dtype: str | torch.dtype = "float32", **kwargs) -> Path:
    """``tiny_model(family, **kwargs)`` cast to ``dtype`` and saved to ``path`` (HF layout)."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    path = Path(path)
    tiny_model(family, **kwargs).to(dt).save_pretrained(str(path), safe_serialization=True)
    return path


# ---------------------------------------------------------------- the tiny addition task
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CHARS = list("0123456789+-*=?:. ") + list("abcdefghijklmnopqrstuvwxyz") + list("QA")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def save_char_tokenizer(path) -> None:
    """A character-level tokenizer in HF's tokenizer.json format (what AutoTokenizer loads)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(str(path))


def write_tiny_task(root, *, max_operand: int = 9, num_test: int = 10, seed: int = 0) -> tuple[Path, Path]:
    """``root/model`` (character tokenizer + random 2-layer bf16 Qwen2, hidden 128) and
    ``root/data/{train,test}.jsonl`` (prompts ``Q:a+b=?A:``, answer ``a+b``, a, b <= max_operand;
    ``num_test`` of them held out). Returns (model_dir, data_dir)."""
    root = Path(root)
    model_dir, data_dir = root / "model", root / "data"
    model_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    save_char_tokenizer(model_dir)
    save_tiny_model(model_dir, dtype="bfloat16", seed=seed, vocab_size=128, hidden_size=128, intermediate_size=512,
                    num_hidden_layers=2, max_position_embeddings=256, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                    pad_token_id=PAD_ID)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    for name, rows in (("test", pairs[:num_test]), ("train", pairs[num_test:])):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            for a, b in rows:
                f.write(json.dumps({"id": f"{a}+{b}", "prompt": f"Q:{a}+{b}=?A:", "answer": str(a + b)}) + "\n")
    return model_dir, data_dir


def first_char_even(prompt: str, completion: str, data: dict) -> float:
    """A reward a RANDOM model scores ~50% on (1 if the completion's first character has an even
    code point): what an evaluation test needs to compare two accuracy computations on numbers
    that are neither 0 nor 1."""
    return 1.0 if completion and ord(completion[0]) % 2 == 0 else 0.0

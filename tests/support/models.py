"""Tiny random HF models and the tiny addition task, for tests.

The builders are the package's (areal_mega/demo/models.py: ``tiny_model``, ``save_tiny_model``,
the BPE tokenizer, the verdict judge; areal_mega/demo/tiny.py: the character tokenizer and the
addition task), imported here so tests keep one import path; what only tests use is defined here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_mega.demo.models import (  # noqa: F401  (re-exported for the tests)
    BPE_SPECIALS, DEFAULTS, save_bpe_model, save_bpe_tokenizer, save_tiny_model, save_verdict_judge, tiny_config,
    tiny_model,
)
from areal_mega.demo.tiny import EOS_ID, make_tiny  # noqa: F401

# The weight-sync tests' model (the live TP2 x PP2 sync and the pure planner): bf16 on disk,
# head_dim 64 (what SGLang's CPU attention takes), tied embeddings, qkv bias.
WSYNC_QWEN2 = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


def count_params(family: str = "qwen2", **overrides) -> int:
    """Parameters of ``tiny_model(family, **overrides)`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in tiny_model(family, **overrides).parameters())


def write_tiny_task(root, *, max_operand: int = 9, num_test: int = 10, seed: int = 0) -> tuple[Path, Path]:
    """The demo's tiny task (areal_mega/demo/tiny.py) without SFT data: ``root/model`` (character
    tokenizer + random 2-layer bf16 Qwen2, hidden 128) and ``root/data/{train,test}.jsonl``
    (prompts ``Q:a+b=?A:``, a, b <= max_operand; ``num_test`` held out). Returns (model_dir, data_dir)."""
    return make_tiny(Path(root), num_layers=2, hidden=128, family="qwen2", max_operand=max_operand,
                     num_test=num_test, num_sft=0, sft_noise=0.0, seed=seed)


def bpe_tokenizer(work_dir):
    """The BPE tokenizer as the learner loads it (``AutoTokenizer`` on a model directory whose
    config says qwen2: transformers then builds a Qwen2Tokenizer from the saved files)."""
    from transformers import AutoTokenizer

    d = save_bpe_tokenizer(Path(work_dir) / "bpe-tokenizer")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return AutoTokenizer.from_pretrained(str(d))


def save_reward_model(path, *, seed: int = 0, **overrides) -> Path:
    """A tiny random outcome reward model SGLang serves (``--is-embedding``):
    ``Qwen2ForSequenceClassification`` with one label (a score head on the last token), fp32,
    with the BPE tokenizer; std-0.3 weights so scores differ clearly between texts.

    The checkpoint also holds ``score.bias`` = 0, which HF's class (no bias) ignores: SGLang
    0.5.23's ``Qwen2ForSequenceClassification`` gives its score head a bias HF's lacks and
    leaves it at its random init when the checkpoint has none (a constant offset per server,
    0.0746 measured; docs/rewards.md)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = Path(path)
    save_bpe_tokenizer(path)
    eos, pad = BPE_SPECIALS.index("<|im_end|>"), BPE_SPECIALS.index("<|endoftext|>")
    cfg = {**dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, initializer_range=0.3,
                  tie_word_embeddings=False), **overrides}
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(Qwen2Config(num_labels=1, eos_token_id=eos, pad_token_id=pad, **cfg))
    model.float().save_pretrained(str(path), safe_serialization=True)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    weights["score.bias"] = torch.zeros(1)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def first_char_even(prompt: str, completion: str, data: dict) -> float:
    """A reward a RANDOM model scores ~50% on (1 if the completion's first character has an even
    code point): what an evaluation test needs to compare two accuracy computations on numbers
    that are neither 0 nor 1."""
    return 1.0 if completion and ord(completion[0]) % 2 == 0 else 0.0


def packed_logprobs(logits, ids, cu):
    """Next-token log-probs (float64) of packed sequences from their logits [T, V], each sequence's
    last position dropped (it predicts nothing): the reference the layout tests compare to."""
    import torch

    lp = torch.log_softmax(logits.double(), -1)
    out = []
    for i in range(len(cu) - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        out.append(lp[s: e - 1].gather(-1, ids[s + 1: e, None])[:, 0])
    return torch.cat(out)


def packed_hf_logits(m, lens: list[int], vocab: int, seed: int) -> dict:
    """The reference of a packed-row exactness test: random ids for sequences of ``lens`` (one
    row), HF model ``m``'s logits of each sequence run ALONE, concatenated in packing order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    with torch.no_grad():
        logits = torch.cat([m(input_ids=ids[cu[i]: cu[i + 1]][None]).logits[0] for i in range(len(lens))])
    return {"input_ids": ids, "cu_seqlens": cu, "logits": logits.float()}


def hf_dir_tensors(d) -> dict:
    """Every tensor of the HF checkpoint directory ``d`` (all its safetensors shards), by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out

"""Tiny random HF models for the demo, the tools and the tests (offline, deterministic).

``tiny_model`` / ``save_tiny_model``: any supported family, defaults Qwen2 vocab 200, hidden 64,
MLP 128, 4 layers, GQA 4/2 heads of 16; callers override what they depend on. Construction:
``torch.manual_seed(seed)``, HF's own init in fp32, then optionally weights x ``scale`` plus
``noise`` * N(0, 1) (own generator), then cast to ``dtype``. ``save_bpe_model`` adds a byte-level
BPE tokenizer with a ChatML tool-calling template; ``save_verdict_judge`` is a hand-wired judge.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULTS = dict(
    vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe")
FAMILIES += ("deepseek_v32", "glm_moe_dsa")  # DeepSeek sparse attention (areal_mega/models/dsa.py)


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
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
    }[family]
    return config_cls, model_cls, cfg


def tiny_model(family: str = "qwen2", *, seed: int = 0, scale: float = 1.0, noise: float = 0.0,
               noise_seed: int = 0, **overrides):
    """A tiny random HF causal LM of ``family`` (one of FAMILIES) in fp32 (see the module doc; MoE
    keys such as num_experts go in ``overrides``)."""
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
            for n, b in model.named_buffers():  # DeepSeek-V3 / GLM-4.5's routing bias (a weight, not trained)
                if n.endswith("e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * noise)
    return model


def save_tiny_model(path, family: str = "qwen2", *, dtype: str | torch.dtype = "float32", **kwargs) -> Path:
    """``tiny_model(family, **kwargs)`` cast to ``dtype`` and saved to ``path`` (HF layout)."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    path = Path(path)
    tiny_model(family, **kwargs).to(dt).save_pretrained(str(path), safe_serialization=True)
    return path


# ---------------------------------------------------------------- a real BPE tokenizer + chat template
# ChatML (Qwen style) with Qwen's tool-call convention: tools listed in the system turn inside
# <tools></tools>, the model answers a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
# tool results come back in a user turn inside <tool_response></tool_response>. Contents are
# rendered verbatim (no trimming), so a conversation re-rendered with the model's own reply as the
# assistant content extends the text the model saw (what areal_mega.workflows.agent relies on).
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nYou may call functions. Signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Answer a call as <tool_call>{\"name\": <name>, \"arguments\": <json>}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BPE_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # plain added tokens
_BPE_CORPUS = [
    "You are a helpful assistant. Use the calculator tool when it helps.",
    "What is 12 * (3 + 4)? Give the final answer as Answer: <number>.",
    'Answer: 84. The result is 7. Score: 7 Score: 10/10 Verdict: PASS Verdict: FAIL',
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}',
    "Question: how many apples? Response: three apples. Reference answer: 3. Grade the response.",
    "system user assistant tool function parameters type object string properties required",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / ( ) = ? !",
    "That is not correct. Try again. Use the tool or give the final answer.",
]


# Qwen2's pre-tokenizer split (digits one by one, words with their leading space): what
# transformers' Qwen2Tokenizer applies when it loads the saved files, so training uses it too.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def save_bpe_tokenizer(path, vocab_size: int = 500) -> Path:
    """Train a byte-level BPE on the tiny built-in corpus (offline, ~1 s) and save it to ``path``
    as an HF tokenizer with the ChatML chat template above (``<|im_end|>`` = EOS). Byte-level:
    every string encodes, unseen text falls back to byte tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=BPE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_BPE_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens(BPE_TAGS)
    fast.chat_template = CHATML_TEMPLATE
    path = Path(path)
    fast.save_pretrained(str(path))
    return path


def save_bpe_model(path, *, family: str = "qwen2", dtype: str = "float32", vocab_size: int = 512, **kwargs) -> Path:
    """An HF model directory that transformers and SGLang both load: the BPE tokenizer (with its
    chat template) and a tiny random ``family`` model sized to it (``vocab_size`` rows >= the
    tokenizer's length; EOS = ``<|im_end|>``). ``kwargs`` go to ``tiny_model`` (seed, scale, shape)."""
    path = Path(path)
    save_bpe_tokenizer(path)
    num_tokens = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]) + len(BPE_TAGS)
    if num_tokens > vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} < the tokenizer's {num_tokens} tokens")
    eos, pad = BPE_SPECIALS.index("<|im_end|>"), BPE_SPECIALS.index("<|endoftext|>")
    save_tiny_model(path, family, dtype=dtype, vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos,
                    pad_token_id=pad, **kwargs)
    return path


def save_verdict_judge(path, *, branches: tuple[str, ...] = ("2", "9", "1", "x"), scale: float = 20.0,
                       seed: int = 0) -> Path:
    """A hand-wired tiny "judge" (Qwen2 + the BPE tokenizer) whose sampled outputs follow a known
    verdict grammar, so a real server's judge outputs exercise every parse outcome:

        <|im_start|>assistant\\n  ->  "Score: " + one of branches  ->  EOS      ("1" may repeat: "11", ...)

    i.e. "Score: 2" / "Score: 9" / "Score: 1" (ok), "Score: 11..." (out of range), "Score: x"
    (malformed), each branch equally likely at temperature 1. How: attention and MLP outputs are
    zeroed (o_proj, down_proj), so the logits at a position depend only on that position's token
    (a bigram model); lm_head row u is ``scale / d`` times the sum of the normalised embeddings of
    the tokens that should be followed by u, giving logit ~``scale`` on the intended successors and
    ~scale / sqrt(d) cross-talk elsewhere (d = 128)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_bpe_model(path, seed=seed, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)
    tok = AutoTokenizer.from_pretrained(str(path))

    def one(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    chain = [one("\n")] + tok.encode("Score: ", add_special_tokens=False)
    ends = [one(b) for b in branches]
    edges: dict[int, list[int]] = {a: [b] for a, b in zip(chain, chain[1:])}
    edges[chain[-1]] = ends
    for e in ends:
        edges[e] = [e, tok.eos_token_id] if e == one("1") else [tok.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    d = model.config.hidden_size
    with torch.no_grad():
        emb = torch.randn(model.config.vocab_size, d, generator=torch.Generator().manual_seed(seed))
        model.model.embed_tokens.weight.copy_(emb)
        unit = emb / emb.norm(dim=1, keepdim=True) * d**0.5  # what the final RMSNorm makes of a row
        head = torch.zeros_like(model.lm_head.weight)
        for src, dsts in edges.items():
            for dst in dsts:
                head[dst] += scale / d * unit[src]
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(path), safe_serialization=True)
    return path

"""Llama family (LlamaForCausalLM): RMSNorm, RoPE (plain or Llama-3.1 scaled), GQA, SwiGLU,
no biases, tied or untied embeddings. The mapping itself lives in :class:`ModelAdapter`."""

from __future__ import annotations

from areal_mega.models.base import ModelAdapter


class LlamaAdapter(ModelAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    qkv_bias = False

"""Llama family (LlamaForCausalLM): RMSNorm, RoPE (plain or Llama-3.1 scaled), GQA, SwiGLU,
no biases, tied or untied embeddings. The mapping itself lives in :class:`ModelAdapter`."""

from __future__ import annotations

from areal_mega.models.base import ModelAdapter
from areal_mega.models.registry import register_family


@register_family
class LlamaAdapter(ModelAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    qkv_bias = False

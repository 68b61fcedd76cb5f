"""Qwen2 family (Qwen2ForCausalLM): Llama's layout plus a bias on q/k/v (not on o_proj or
the MLP); tied embeddings on the small models. Sliding-window attention is rejected."""

from __future__ import annotations

from areal_mega.models.base import ModelAdapter
from areal_mega.models.registry import register_family


@register_family
class Qwen2Adapter(ModelAdapter):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True

    def parse_config(self, c: dict):
        # Qwen2 configs carry no attention_bias key: the bias is part of the architecture.
        return super().parse_config({**c, "attention_bias": True})

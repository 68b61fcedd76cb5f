"""Kimi-K2.5 (``kimi_k25``): the released vision-language checkpoint, trained text-only.

Its language model is DeepSeek-V3's network (transformers 5.19 builds ``text_config`` -- written
``kimi_k2`` or ``deepseek_v3`` -- as DeepseekV3Model): MLA with q_lora, YaRN, one dense layer,
sigmoid + bias routing (Kimi: one group, top-8 of 384, routed scale 2.827), one shared expert.
So the adapter is :class:`DeepseekV3Adapter` with the checkpoint's names (the released layout,
``language_model.model.*`` / ``language_model.lm_head.weight``, the one SGLang's
KimiK25ForConditionalGeneration loads) and the vision tower + projector (``vision_tower.*``,
``mm_projector.*``) frozen and copied through exports (models/vision_language.py).
Numbers and refusals: docs/engine.md "Kimi-K2.5".
"""

from __future__ import annotations

from dataclasses import replace

from areal_mega.models.base import ModelArch
from areal_mega.models.moe_families import DeepseekV3Adapter
from areal_mega.models.registry import register_family
from areal_mega.models.vision_language import VisionLanguageAdapter

_REMOTE_ARCH = "KimiK25ForConditionalGeneration"
"""The released config.json's architecture (Moonshot's remote code; SGLang's class name)."""


@register_family
class KimiK25Adapter(VisionLanguageAdapter, DeepseekV3Adapter):
    """Kimi-K2.5 (Kimi_K25ForConditionalGeneration / KimiK25ForConditionalGeneration): see the module doc."""

    model_type = "kimi_k25"
    architecture = "Kimi_K25ForConditionalGeneration"
    lm_prefixes = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
    frozen_prefixes = ("vision_tower.", "mm_projector.")
    vl_keys = frozenset({
        "vision_config", "tie_word_embeddings", "auto_map", "ignore_index", "projection_hidden_size",
        "projection_layer_norm_eps", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
        "media_placeholder_token_id", "use_unified_vision_chunk", "video_placeholder"})
    tie_default = True  # transformers' Kimi_K25Config (text_config's key is not read); the released config: false
    sglang_layout = None  # the reshard layout would be DeepSeek-V3's renamed; not written: broadcast serves it

    def text_config(self, c: dict) -> dict:
        for where, d in (("", c), ("text_config.", c.get("text_config") or {})):
            if d.get("quantization_config"):
                raise ValueError(f"{where}quantization_config: a quantized checkpoint (the released Kimi-K2.5's "
                                 "compressed-tensors int4 routed experts) is not loaded; dequantize it to bf16 first")
        t = c.get("text_config")
        if isinstance(t, dict) and t.get("model_type") not in ("kimi_k2", "deepseek_v3"):
            raise ValueError(f"text_config.model_type: {t.get('model_type')!r} is not supported for kimi_k25 (only "
                             "kimi_k2 / deepseek_v3)")
        archs = list(c.get("architectures") or [])
        if _REMOTE_ARCH in archs:  # the released name: checked as transformers' own
            c = {**c, "architectures": [self.architecture if a == _REMOTE_ARCH else a for a in archs]}
        text = super().text_config(c)
        text.pop("auto_map", None)  # remote-code class pointers
        return text

    def parse_config(self, c: dict) -> ModelArch:
        arch = super().parse_config(c)
        if _REMOTE_ARCH in (c.get("architectures") or []):  # an export keeps the source's name (SGLang picks by it)
            arch = replace(arch, architecture=_REMOTE_ARCH)
        return arch

"""The one registry of model families: HF ``model_type`` (exact key) -> adapter class.

    @register_family
    class MyAdapter(ModelAdapter): model_type = "my_llama"; architecture = "MyLlamaForCausalLM"

A family's facts (HF <-> megatron mapping, SGLang layout, what a reshard sync refuses) live on its
adapter; this module only maps names to adapters. See docs/layout.md "Adding a model family".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_mega.models.base import ModelAdapter

FAMILIES: dict[str, type[ModelAdapter]] = {}
"""HF model_type -> adapter class; filled by :func:`register_family` (built-ins on package import)."""


def register_family(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Class decorator: serve HF configs whose ``model_type`` equals ``cls.model_type``."""
    mt = cls.model_type
    if not mt or not cls.architecture:
        raise ValueError(f"register_family: {cls.__name__} needs a model_type and an architecture")
    if FAMILIES.get(mt, cls) is not cls:
        raise ValueError(f"register_family: model_type {mt!r} is already served by {FAMILIES[mt].__name__}")
    FAMILIES[mt] = cls
    return cls


def adapter_class(model_type: Any) -> type[ModelAdapter]:
    """The adapter class registered for ``model_type`` (exact key; one-line error otherwise)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type: {model_type!r} is not supported; known model types: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def load_hf_config(path: str | Path) -> dict:
    """Read ``config.json`` from an HF model directory (or the file itself)."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.exists():
        raise ValueError(f"hf config: {p} does not exist")
    return json.loads(p.read_text())


def get_adapter(hf_config: Any) -> ModelAdapter:
    """The adapter for ``hf_config`` (a mapping, transformers config, or path to a model dir)."""
    if isinstance(hf_config, (str, Path)):
        hf_config = load_hf_config(hf_config)
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return adapter_class(cfg.get("model_type"))(cfg)

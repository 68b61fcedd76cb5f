"""Model adapters (HF <-> megatron-core), looked up by the HF config's exact ``model_type``.

    adapter = get_adapter(hf_config)          # dict, transformers config, or config.json path
    plan = adapter.plan(layout)               # pure metadata, per pipeline stage
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_mega.models.base import HFTensorSpec, McoreParam, ModelAdapter, ModelArch, StagePlan, padded_vocab_size
from areal_mega.models.llama import LlamaAdapter
from areal_mega.models.moe_families import DeepseekV3Adapter, Glm4MoeAdapter, MixtralAdapter, Qwen2MoeAdapter
from areal_mega.models.qwen2 import Qwen2Adapter
from areal_mega.models.qwen3 import Qwen3Adapter, Qwen3MoeAdapter

# Exact keys only (no substring matching): a new family is one line here.
ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": LlamaAdapter,
    "qwen2": Qwen2Adapter,
    "qwen3": Qwen3Adapter,
    "qwen3_moe": Qwen3MoeAdapter,
    "qwen2_moe": Qwen2MoeAdapter,
    "mixtral": MixtralAdapter,
    "deepseek_v3": DeepseekV3Adapter,
    "glm4_moe": Glm4MoeAdapter,
}


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
    model_type = cfg.get("model_type")
    if model_type not in ADAPTERS:
        raise ValueError(f"model_type: {model_type!r} is not supported; known model types: {sorted(ADAPTERS)}")
    return ADAPTERS[model_type](cfg)


__all__ = [
    "ADAPTERS",
    "HFTensorSpec",
    "McoreParam",
    "ModelAdapter",
    "ModelArch",
    "StagePlan",
    "get_adapter",
    "load_hf_config",
    "padded_vocab_size",
]

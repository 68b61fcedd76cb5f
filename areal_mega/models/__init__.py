"""Model adapters (HF <-> megatron-core), looked up by the HF config's exact ``model_type``.

    adapter = get_adapter(hf_config)          # dict, transformers config, or config.json path
    plan = adapter.plan(layout)               # pure metadata, per pipeline stage
"""

from __future__ import annotations

# The built-in families register themselves (@register_family) when their modules are imported.
from areal_mega.models import dsa, llama, moe_families, qwen2, qwen3, qwen3_5  # noqa: F401
from areal_mega.models import gpt_oss, kimi_k25  # noqa: F401
from areal_mega.models.base import HFTensorSpec, McoreParam, ModelAdapter, ModelArch, StagePlan, padded_vocab_size
from areal_mega.models.registry import FAMILIES, adapter_class, get_adapter, load_hf_config, register_family

__all__ = [
    "FAMILIES",
    "HFTensorSpec",
    "McoreParam",
    "ModelAdapter",
    "ModelArch",
    "StagePlan",
    "adapter_class",
    "get_adapter",
    "load_hf_config",
    "padded_vocab_size",
    "register_family",
]

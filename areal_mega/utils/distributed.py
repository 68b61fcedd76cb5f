"""torch.distributed settings shared by the learners (RL and SFT), weight sync and the tools."""

from __future__ import annotations

import torch

__all__ = ["BACKENDS", "resolve_backend"]

BACKENDS = ("auto", "nccl", "gloo")
"""What a config's ``backend`` key may say."""


def resolve_backend(backend: str) -> str:
    """"auto" -> "nccl" when CUDA is available, else "gloo"."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    return backend

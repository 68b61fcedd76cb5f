"""Reading an HF model directory's safetensors lazily: the learner's loader
(``megatron.model.load_hf_weights``) and the family adapters (frozen tensors kept for export)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["HFCheckpointReader"]


class HFCheckpointReader:
    """Lazy reader over an HF model directory's safetensors (single file or sharded + index)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        d = Path(hf_dir)
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise ValueError(f"hf_dir: no *.safetensors files in {d}")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {k: f for f, h in self._handles.items() for k in h.keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def _handle(self, name: str):
        if name not in self._where:
            raise ValueError(f"{name}: missing from the HF checkpoint")
        return self._handles[self._where[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def read_slice(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """``read(name).narrow(dim, start, stop - start)`` reading only those bytes from disk."""
        if dim is None:
            return self.read(name)
        sl = self._handle(name).get_slice(name)
        return sl[start:stop] if dim == 0 else sl[(slice(None),) * dim + (slice(start, stop),)]

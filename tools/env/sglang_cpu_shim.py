"""Loaded by a .pth file in the SGLang CPU virtualenv only (see tools/env/make_venv.sh).

Why: PyPI's torchvision wheel is built against CUDA torch; next to the CPU torch 2.13.0 wheel its
import dies with "operator torchvision::nms does not exist", because its Python side registers
fake (meta) kernels for C++ operators that the CPU torch never defined. SGLang imports
torchvision.transforms from its multimodal config modules at server start, so it must import.
We only ever serve text models, so the ops are never called: we define their schemas (no kernels)
right before torchvision is first imported. Nothing else is touched, and nothing happens unless
torchvision is imported.
"""
import importlib.abc
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            try:
                lib.define(schema)
            except RuntimeError:  # a real torchvision C++ extension already defined it
                pass
        globals()["_LIB"] = lib  # keep the registration alive
        return None  # let the normal finders import torchvision


sys.meta_path.insert(0, _DefineTorchvisionOps())

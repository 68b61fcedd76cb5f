"""Loaded by a .pth file in the SGLang CPU virtualenv only (see tools/env/make_venv.sh).

The SGLang side of the compat registry: each entry names its symptom, the SGLang versions it
applies to, and the test that shows it. Nothing here runs unless its module is imported.

Entry 1 (torchvision ops; any SGLang with PyPI's CUDA-linked torchvision on CPU torch). Why: PyPI's torchvision wheel is built against CUDA torch; next to the CPU torch 2.13.0 wheel its
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


# Entry 2 (routed-experts capture on CPU; SGLang 0.5.23, the version tools/env/sglang.txt pins).
# Symptom: a server started with --enable-return-routed-experts dies at start-up with "Torch not
# compiled with CUDA enabled": the capturer's host buffer is allocated through
# mem_cache/pool_host/common.py's alloc_with_host_register, which cudaHostRegister-s it (pinned
# memory only helps device copies; on CPU the buffer is already where it is read). Fix: without
# CUDA, that module's _cuda_host_register is a no-op. Test: tests/test_routing_replay_sglang.py
# (the server starts and returns routes equal to the HF router's top-k).
_HOST_POOL = "sglang.srt.mem_cache.pool_host.common"
_PATCHED_SGLANG = ("0.5.23",)


class _NoHostRegisterOnCPU(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _HOST_POOL:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            from sglang.version import __version__

            if not torch.cuda.is_available() and __version__ in _PATCHED_SGLANG:
                module._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _DefineTorchvisionOps())
sys.meta_path.insert(0, _NoHostRegisterOnCPU())

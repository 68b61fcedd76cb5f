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


# Entry 3 (MLA prefill on CPU; SGLang 0.5.23). Symptom: a DeepSeek-V2/V3 (MLA) server on
# --device cpu dies at its first prefill with "The expanded size of the tensor (64) must match the
# existing size (32)" (layers/attention/torch_native_backend.py ~172): the CPU attention backends
# (intel_amx, torch_native) have no entry in models/deepseek_common/attention_backend_handler.py's
# AttentionBackendRegistry, so get_handler falls back to the triton handler, which sends a
# prefill to the MHA path; the CPU backends' extend reads K/V back from the KV pool, and an MLA
# pool holds the latent (kv_lora_rank + rope dims), not per-head K/V. Fix: the CPU backends get
# the handler the absorbed MLA path uses (_dispatch_mla_subtype: MLA, or the fused-rope CPU MLA
# where sgl-kernel's AMX path is active), as their decode already does. Test:
# tests/test_families_serve.py (deepseek_v3: greedy = HF, log-probs = the learner's).
_MLA_HANDLER = "sglang.srt.models.deepseek_common.attention_backend_handler"
_CPU_ATTENTION = ("intel_amx", "torch_native")


def _patch_after_exec(fullname, patch):
    """A finder that runs ``patch(module)`` right after ``fullname`` is first executed."""

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != fullname:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                from sglang.version import __version__

                if __version__ in _PATCHED_SGLANG:
                    patch(module)

            spec.loader.exec_module = exec_module
            return spec

    return _Finder()


def _mla_on_cpu_backends(module):
    for name in _CPU_ATTENTION:
        if name not in module.AttentionBackendRegistry._handlers:
            module.AttentionBackendRegistry.register(name, module._dispatch_mla_subtype)


# Entry 4 (Qwen2-MoE's shared-expert gate on CPU; SGLang 0.5.23). Symptom: a Qwen2-MoE server
# on --device cpu dies at its first prefill with "RuntimeError: 0 active drivers ([]). There
# should only be one." (triton/runtime/driver.py ~20): models/qwen2_moe.py ~821 fuses the shared
# expert's sigmoid gate into a triton kernel (kernels/ops/elementwise/elementwise.py
# fused_gate_sigmoid_mul[_add]) unless sgl-kernel's AMX path is active, and triton has no CPU
# driver. Fix: without CUDA, the two functions qwen2_moe imported compute the same in torch
# (fp32 gate sigmoid(x . w), times the shared output, plus the routed output). Test:
# tests/test_families_serve.py (qwen2_moe).
_QWEN2_MOE = "sglang.srt.models.qwen2_moe"


def _torch_shared_gate(module):
    import torch

    if torch.cuda.is_available():
        return

    def gated(hidden_states, gate_weight, shared_output):
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
        return (gate * shared_output.float()).to(shared_output.dtype)

    def gated_add(hidden_states, gate_weight, shared_output, final_hidden_states):
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
        final_hidden_states.copy_(gate * shared_output.float() + final_hidden_states.float())

    module.fused_gate_sigmoid_mul = gated
    module.fused_gate_sigmoid_mul_add = gated_add


# Entry 5 (LoRA serving on CPU; SGLang 0.5.23). Symptom: a server started with --enable-lora on
# --device cpu dies at start-up with "pin_memory=True requires a CUDA or other accelerator
# backend" (srt/lora/layers.py:475, ColumnParallelLinearWithLoRA's output_offset_cpu), and past
# that at the first LoRA batch with "Cannot access accelerator device when none is available"
# (srt/lora/backend/torch_backend.py:225-244, .pin_memory() of the batch's index tensors).
# Pinned host memory only speeds host-to-device copies; on CPU there is no device. Fix: without
# CUDA those two modules are executed with pin_memory=True -> False and .pin_memory() dropped
# (same lines, so tracebacks keep SGLang's line numbers). Test: tests/test_lora.py
# (test_lora_adapter_sync_into_sglang: a CPU server with LoRA starts, loads the learner's adapters).
_UNPINNED = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


class _UnpinnedOnCPU(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _UNPINNED:
            return None
        import importlib.util

        import torch

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.origin is None or torch.cuda.is_available():
            return spec
        from sglang.version import __version__

        if __version__ not in _PATCHED_SGLANG:
            return spec

        def exec_module(module):
            src = open(spec.origin).read().replace("pin_memory=True", "pin_memory=False").replace(".pin_memory()", "")
            exec(compile(src, spec.origin, "exec"), module.__dict__)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _DefineTorchvisionOps())
sys.meta_path.insert(0, _NoHostRegisterOnCPU())
sys.meta_path.insert(0, _patch_after_exec(_MLA_HANDLER, _mla_on_cpu_backends))
sys.meta_path.insert(0, _patch_after_exec(_QWEN2_MOE, _torch_shared_gate))
sys.meta_path.insert(0, _UnpinnedOnCPU())

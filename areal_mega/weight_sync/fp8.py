"""FP8 rollout weights: DeepSeek-V3's blockwise format, quantized on the learner side.

The format SGLang loads for DeepSeek-class FP8 checkpoints (``quantization_config``
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``): each quantized
linear weight ``[n, k]`` travels as ``weight`` (float8_e4m3fn, ``[n, k]``) plus
``weight_scale_inv`` (fp32, ``[ceil(n/128), ceil(k/128)]``), dequantized as ``q * scale`` per
128 x 128 block, ``scale = max(amax(block), 1e-4) / 448``. Everything else (embeddings, lm_head,
norms, routers, biases) stays in the serving dtype. A block's scale depends only on that block,
so a sender quantizes its own shard alone when the shard's box starts on block boundaries: the
bytes are those of quantizing the whole tensor and slicing (tests/test_weight_sync_fp8.py checks
this, and that the result equals SGLang 0.5.23's own quantizer bit for bit). The broadcast sync
sends :func:`quantize_export`'s stream as planned by :func:`fp8_specs` (scales, then fp8, in one
bucket: :func:`bucket_group`). Pricing (bytes, server memory): :func:`fp8_nbytes`,
:func:`fp8_sync_bytes`; which HF tensors: :func:`quantized`. Design notes:
docs/weight_sync.md "FP8 rollout".
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch

from areal_mega.models.base import ModelAdapter
from areal_mega.weight_sync.planner import TensorSpec

__all__ = ["BLOCK", "E4M3_MAX", "FP8_FAMILIES", "bucket_group", "check_fp8", "check_server_fp8", "fp8_nbytes",
           "fp8_specs", "fp8_sync_bytes", "quantize_blockwise", "quantize_export", "quantize_shard", "quantized",
           "scale_name"]

BLOCK = 128
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value: a block's amax maps onto it."""
MIN_AMAX = 1e-4
"""An all-zero block still gets a finite scale (SGLang's and DeepGEMM's clamp)."""
FP8_FAMILIES = ("deepseek_v3", "glm4_moe", "llama", "qwen2", "qwen3", "qwen3_moe")
"""Families whose quantized tensors are their ``*_proj.weight`` linears (SGLang's fp8 linear and
FusedMoE layers take those); another family's names say nothing about it: refused."""


def quantize_blockwise(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, k]`` (any float dtype) -> ``(q float8_e4m3fn [n, k], scale fp32 [ceil(n/b), ceil(k/b)])``
    with ``x ~= q * scale`` per block. The arithmetic is SGLang's (fp32 amax, divide, cast): the
    same bits on every host."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blockwise: a 2-D weight expected, got shape {tuple(x.shape)}")
    n, k = x.shape
    pn, pk = -(-n // block) * block, -(-k // block) * block
    xp = torch.zeros((pn, pk), dtype=torch.float32, device=x.device)
    xp[:n, :k] = x.to(torch.float32)
    xv = xp.view(pn // block, block, pk // block, block)
    scale = xv.abs().amax(dim=(1, 3), keepdim=True).clamp(min=MIN_AMAX) / E4M3_MAX
    q = (xv / scale).to(torch.float8_e4m3fn)
    return q.view(pn, pk)[:n, :k].contiguous(), scale.view(pn // block, pk // block).contiguous()


def quantize_shard(shard: torch.Tensor, start: tuple[int, int], full: tuple[int, int],
                   block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """A sender's own shard ``shard`` = ``W[start[0]:, start[1]:]`` of a weight of shape ``full``:
    its fp8 bytes, its blocks' scales and where those scales start in the full scale tensor. The
    shard must start on block boundaries and end on one or at the tensor's edge (else a block
    would straddle two senders and neither could compute its amax): ValueError naming why."""
    for d in range(2):
        end = start[d] + shard.shape[d]
        if start[d] % block or (end % block and end != full[d]):
            raise ValueError(f"fp8 shard rows/cols [{start[d]}, {end}) of a {tuple(full)} weight are not on "
                             f"{block}-blocks: a block would straddle two senders")
    q, scale = quantize_blockwise(shard, block)
    return q, scale, (start[0] // block, start[1] // block)


def quantized(adapter: ModelAdapter, hf_name: str) -> bool:
    """Whether the HF tensor ``hf_name`` travels (and is served) as fp8: the 2-D projection
    weights, MLA's ``kv_a_proj_with_mqa`` included, as in DeepSeek-V3's FP8 checkpoint (its
    ``mlp.gate`` router and the embeddings stay bf16)."""
    return hf_name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and len(adapter.hf_shape(hf_name)) == 2


def scale_name(hf_name: str) -> str:
    """``...weight`` -> ``...weight_scale_inv``: where DeepSeek-V3's FP8 checkpoint (and SGLang's
    fp8 loader) keep a quantized weight's per-block scales."""
    return hf_name + "_scale_inv"


def fp8_specs(adapter: ModelAdapter, specs: Iterable[Any]) -> list[TensorSpec]:
    """A stage's sync plan entries with fp8 servers: each quantized weight becomes its fp32 scales
    followed by its fp8 tensor (the order :func:`quantize_export` yields them: the scales first keep
    both on their item size's alignment in a bucket)."""
    out = []
    for t in map(TensorSpec.of, specs):
        if quantized(adapter, t.name):
            n, k = t.shape
            out += [TensorSpec(scale_name(t.name), (math.ceil(n / BLOCK), math.ceil(k / BLOCK)), "float32"),
                    TensorSpec(t.name, t.shape, "float8_e4m3fn")]
        else:
            out.append(t)
    return out


def quantize_export(adapter: ModelAdapter, stream: Iterable[tuple[str, torch.Tensor | None]]
                    ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A stage's export stream (full HF tensors in the wire dtype; None on TP peers) as fp8
    servers take it: each quantized weight as ``weight_scale_inv`` + fp8 (:func:`fp8_specs`'s
    order); the stage sender quantizes what it gathered, the rest passes as is."""
    for name, t in stream:
        if not quantized(adapter, name):
            yield name, t
        elif t is None:
            yield scale_name(name), None
            yield name, None
        else:
            q, sc = quantize_blockwise(t)
            yield scale_name(name), sc
            yield name, q


def check_server_fp8(hf_config: dict, where: str) -> dict:
    """A server's config.json with fp8 weights: its ``quantization_config`` must be this block
    format (else one-line PlanMismatchError naming ``where``); returns the config without it (the
    adapters parse the bf16 model)."""
    from areal_mega.weight_sync.planner import PlanMismatchError

    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise PlanMismatchError(f"{where}: inference.server.quantization fp8 needs a block-FP8 model "
                                f"(quantization_config quant_method fp8, weight_block_size [{BLOCK}, {BLOCK}]), "
                                f"got {qc or 'none'}")
    return {k: v for k, v in hf_config.items() if k != "quantization_config"}


def bucket_group(adapter: ModelAdapter, name: str) -> str | None:
    """The planner's ``group_of`` with fp8: a weight and its scales share one bucket (one update:
    the server never holds new fp8 bytes with old scales), inside the adapter's own groups."""
    base = name.removesuffix("_scale_inv")
    return adapter.bucket_group(base) or (base if quantized(adapter, base) else None)


def fp8_sync_bytes(adapter: ModelAdapter) -> int:
    """Bytes of one full sync to fp8 servers: the quantized weights' fp8 + scales, the rest in bf16."""
    return sum(fp8_nbytes(adapter.hf_shape(n)) if quantized(adapter, n) else 2 * math.prod(adapter.hf_shape(n))
               for n in adapter.hf_names())


def fp8_nbytes(shape: tuple[int, ...], block: int = BLOCK) -> int:
    """Bytes of one quantized weight on the wire and in server memory: fp8 values + fp32 scales."""
    n, k = shape
    return n * k + 4 * math.ceil(n / block) * math.ceil(k / block)


def check_fp8(adapter: ModelAdapter, tp: int = 1, ep: int = 1, block: int = BLOCK) -> None:
    """One-line ValueError unless ``adapter``'s family has its quantized layout here and every
    quantized weight splits over an engine of ``tp`` ranks on whole blocks. SGLang 0.5.23 asserts
    the same at load (``fp8_utils.validate_fp8_block_shape``): a TP rank's rows (column-parallel)
    or columns (row-parallel) are whole blocks, and so is every part of a merged weight but the
    last (gate of gate_up, q and k of qkv) even at TP1; KV heads fewer than ``tp`` are replicated
    (one head per rank); MLA's replicated q_a / kv_a projections are exempt."""
    mt = adapter.arch.model_type
    if mt not in FP8_FAMILIES:
        raise ValueError(f"inference.server.quantization: fp8 has no quantized layout for model_type {mt!r} "
                         f"(implemented: {list(FP8_FAMILIES)}); use quantization: none")
    arch = adapter.arch
    for name in adapter.hf_names():
        if not quantized(adapter, name) or name.endswith(("kv_a_proj_with_mqa.weight", "q_a_proj.weight")):
            continue
        n, k = adapter.hf_shape(name)
        ranks = tp // ep if ".experts." in name else tp  # experts split over moe-TP = tp / ep
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: columns split
            per, merged = k // ranks, False
        elif name.endswith(("k_proj.weight", "v_proj.weight")) and getattr(arch, "num_kv_heads", 0) < tp:
            per, merged = arch.head_dim, name.endswith("k_proj.weight")  # replicated heads: one per rank
        else:
            per = n // ranks  # FusedMoE checks its experts only when moe-TP splits them
            merged = ".experts." not in name and name.endswith(("gate_proj.weight", "q_proj.weight", "k_proj.weight"))
        if per % block and (ranks > 1 or merged):
            raise ValueError(f"inference.server.quantization: fp8 at tp_size {tp}: {name} {(n, k)} splits into "
                             f"{per} per rank, not whole {block}-blocks (SGLang refuses it); use a tp_size "
                             f"that keeps them whole")

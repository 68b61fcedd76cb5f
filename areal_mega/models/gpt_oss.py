"""gpt-oss (GptOssForCausalLM, transformers ``gpt_oss``): GQA with q/k/v/o biases and per-head
attention sinks, a sliding window on the layers HF's ``layer_types`` marks "sliding_attention",
YaRN RoPE (``truncate`` false), every layer MoE: a biased router (top-k on the logits, softmax
over the k) and biased experts with gpt-oss's clamped SwiGLU. Megatron side: megatron/model.py
``sink_window_kwargs``; sinks and the packed window in megatron/attention.py; docs/families_probe.md.

HF checkpoints hold each layer's experts STACKED (``mlp.experts.gate_up_proj`` [E, H, 2F] with
gate/up columns interleaved, ``down_proj`` [E, F, H], their biases [E, 2F] / [E, H]). The plan
names one expert's slice ``mlp.experts.{g}.<name>`` (so experts shard over EP like every other
family); :meth:`GptOssAdapter.checkpoint_view` reads those slices from the stacked tensors and
:meth:`GptOssAdapter.stack_hf` stacks an export back into the checkpoint's names.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from areal_mega.models.base import Block, HFTensorSpec, McoreParam, ModelAdapter, ModelArch, YarnArch, _Rule
from areal_mega.models.qwen3 import _DENSE, refuse_unknown_keys
from areal_mega.models.registry import register_family

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


@register_family
class GptOssAdapter(ModelAdapter):
    """gpt-oss-20b / gpt-oss-120b (bf16 weights; MXFP4 checkpoints are refused: dequantize first)."""

    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    qkv_bias = True
    sglang_layout = None  # SGLang's gpt_oss.py layout not written here: mode reshard refused, broadcast serves it
    known_keys = _DENSE | {"num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                           "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef", "output_router_logits",
                           "experts_per_token", "num_experts"}

    def parse_config(self, c: dict) -> ModelArch:
        if c.get("quantization_config"):
            q = c["quantization_config"]
            raise ValueError(f"quantization_config: {q.get('quant_method', q) if isinstance(q, dict) else q!r} is not "
                             "supported for gpt_oss (load a bf16 checkpoint: transformers dequantizes MXFP4 on load, "
                             "then save_pretrained)")
        refuse_unknown_keys({k: v for k, v in c.items() if k != "hidden_act"}, self.known_keys, self.model_type)
        for key in ("num_local_experts", "num_experts_per_tok"):
            if c.get(key) is None:
                raise ValueError(f"hf config: missing required MoE key {key!r}")
        if float(c.get("swiglu_alpha", 1.702)) != 1.702:
            raise ValueError(f"swiglu_alpha: {c['swiglu_alpha']} is not supported (only 1.702: megatron's quick_gelu "
                             "hard-codes it)")
        if c.get("attention_bias", True) is not True:
            raise ValueError(f"attention_bias: {c['attention_bias']!r} is not supported for gpt_oss (only true: "
                             "megatron's add_bias_linear gives every linear a bias)")
        n, e, k = int(c["num_hidden_layers"]), int(c["num_local_experts"]), int(c["num_experts_per_tok"])
        if not 2 <= k <= e:  # k = 1: HF's weight is softmax over one logit = 1, megatron's too, but untested
            raise ValueError(f"num_experts_per_tok: {k} is not in [2, num_local_experts({e})]")
        types = list(c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(n)])
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types: {types} must list num_hidden_layers({n}) of sliding_attention / "
                             "full_attention")
        window = c.get("sliding_window")
        windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if windowed and (window is None or int(window) < 1):
            raise ValueError(f"sliding_window: {window!r} must be >= 1 when layer_types has sliding_attention layers")
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", c.get("rope_theta", 150000.0)))
        yarn = None
        if rope.get("rope_type", rope.get("type", "default")) == "yarn":
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if rope.get(key) is not None:
                    raise ValueError(f"rope_parameters.{key}: is not supported for gpt_oss (megatron's GPT YaRN "
                                     "applies 0.1 ln(factor) + 1, HF's default; remove it)")
            yarn = YarnArch(factor=float(rope["factor"]),
                            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
                            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                            mscale=1.0, mscale_all_dim=0.0, truncate=bool(rope.get("truncate", True)))
            rope = {"rope_type": "default", "rope_theta": theta}
        arch = super().parse_config({**c, "rope_parameters": rope or None, "rope_scaling": None, "hidden_act": "silu",
                                     "attention_bias": True})
        return ModelArch(**{**arch.__dict__, "num_experts": e, "moe_topk": k, "moe_norm_topk_prob": True,
                            "moe_ffn_hidden_size": int(c["intermediate_size"]), "yarn": yarn,
                            "attention_sinks": True, "linear_bias": True,
                            "sliding_window": int(window) if windowed else None, "sliding_window_layers": windowed,
                            "swiglu_limit": float(c.get("swiglu_limit", 7.0))})

    # ---- megatron <-> HF names ------------------------------------------------------------------
    def layer_rules(self, spec: str = "local", layer: int = 0) -> list[_Rule]:
        A = "self_attn"
        return [
            _Rule("input_layernorm.weight", ("input_layernorm.weight",), None, "none"),
            _Rule("self_attention.linear_qkv.weight", (f"{A}.q_proj.weight", f"{A}.k_proj.weight", f"{A}.v_proj.weight"),
                  0, "qkv"),
            _Rule("self_attention.linear_qkv.bias", (f"{A}.q_proj.bias", f"{A}.k_proj.bias", f"{A}.v_proj.bias"), 0, "qkv"),
            _Rule("self_attention.core_attention.softmax_offset", (f"{A}.sinks",), 0, "none"),
            _Rule("self_attention.linear_proj.weight", (f"{A}.o_proj.weight",), 1, "none"),
            _Rule("self_attention.linear_proj.bias", (f"{A}.o_proj.bias",), None, "none"),
            _Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None, "none"),
            _Rule("mlp.router.weight", ("mlp.router.weight",), None, "none"),
            _Rule("mlp.router.bias", ("mlp.router.bias",), None, "none"),
        ]

    def expert_params(self, chunk: int, local_layer: int, layer: int, layout: Any,
                      grouped: bool = False) -> list[McoreParam]:
        """SequentialMLP experts (local spec only), each with fc1/fc2 biases; HF names are one
        expert's slice of the stacked tensors (module doc)."""
        a = self.arch
        per = a.num_experts // layout.ep
        h, f = a.hidden_size, a.moe_ffn_hidden_size
        out = []
        for g in range(a.num_experts):
            pre = f"decoder.layers.{local_layer}.mlp.experts.local_experts.{g % per}."
            hf = f"model.layers.{layer}.mlp.experts.{g}."
            out += [
                McoreParam(chunk, pre + "linear_fc1.weight", (2 * f, h), 0, "oss_gate_up", (hf + "gate_up_proj",), ep_rank=g // per),
                McoreParam(chunk, pre + "linear_fc1.bias", (2 * f,), 0, "oss_gate_up", (hf + "gate_up_proj_bias",), ep_rank=g // per),
                McoreParam(chunk, pre + "linear_fc2.weight", (h, f), 1, "oss_t", (hf + "down_proj",), ep_rank=g // per),
                McoreParam(chunk, pre + "linear_fc2.bias", (h,), None, "none", (hf + "down_proj_bias",), ep_rank=g // per),
            ]
        return out

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        a = self.arch
        h, d, f, e = a.hidden_size, a.head_dim, a.moe_ffn_hidden_size, a.num_experts
        m = _EXPERT.match(hf_name)
        if m:
            return {"gate_up_proj": (h, 2 * f), "gate_up_proj_bias": (2 * f,), "down_proj": (f, h),
                    "down_proj_bias": (h,)}[m.group(3)]
        m = _STACKED.match(hf_name)
        if m:
            return (e, *self._hf_shape(f"{m.group(1)}.0.{m.group(2)}"))
        leaf = hf_name.split("layers.")[-1].split(".", 1)[-1] if ".layers." in hf_name else hf_name
        own = {"self_attn.sinks": (a.num_heads,), "self_attn.o_proj.bias": (h,), "mlp.router.weight": (e, h),
               "mlp.router.bias": (e,)}
        return own[leaf] if leaf in own else super()._hf_shape(hf_name)

    def mcore_shape(self, leaf: str) -> tuple[int, ...]:
        a = self.arch
        own = {"self_attention.core_attention.softmax_offset": (a.num_heads,),
               "self_attention.linear_proj.bias": (a.hidden_size,), "mlp.router.bias": (a.num_experts,)}
        return own[leaf] if leaf in own else super().mcore_shape(leaf)

    # ---- transforms: interleaved gate/up columns <-> megatron's [gate; up] rows; down transposed ---
    def to_hf(self, prm: McoreParam, canon: torch.Tensor) -> list[torch.Tensor]:
        if prm.fusion == "oss_gate_up":  # [gate; up] (2F, ...) -> HF interleaved (H, 2F) / (2F,)
            gate, up = canon.chunk(2, dim=0)
            inter = torch.stack([gate, up], dim=1).reshape(canon.shape)
            return [inter.t().contiguous() if canon.dim() == 2 else inter]
        if prm.fusion == "oss_t":
            return [canon.t().contiguous()]
        return super().to_hf(prm, canon)

    def from_hf(self, prm: McoreParam, hf: list[torch.Tensor], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if prm.fusion == "oss_gate_up":  # works on a TP slice too: columns [2 f0, 2 f1) = gate and up rows f0..f1
            x = hf[0].t() if hf[0].dim() == 2 else hf[0]
            return torch.cat([x[0::2], x[1::2]], dim=0).contiguous()
        if prm.fusion == "oss_t":
            return hf[0].t().contiguous()
        return super().from_hf(prm, hf, shape)

    def hf_slices(self, prm: McoreParam, tp: int, tp_rank: int) -> list[tuple[str, int | None, int, int]]:
        if tp > 1 and prm.fusion in ("oss_gate_up", "oss_t"):
            (n,) = prm.hf_names
            hs = self.hf_shape(n)
            if prm.fusion == "oss_gate_up":  # TP rank r's gate and up rows are HF's columns [2F r/tp, 2F (r+1)/tp)
                dim = len(hs) - 1
            else:  # megatron dim 1 (F) is HF dim 0
                dim = 0
            per = hs[dim] // tp
            return [(n, dim, tp_rank * per, (tp_rank + 1) * per)]
        return super().hf_slices(prm, tp, tp_rank)

    @staticmethod
    def merge_tp(prm: McoreParam, shards: list[torch.Tensor]) -> torch.Tensor:
        # megatron holds fc1 as [gate; up] per TP shard, as for every gated MLP
        return ModelAdapter.merge_tp(replace(prm, fusion="gate_up") if prm.fusion == "oss_gate_up" else prm, shards)

    @staticmethod
    def split_tp(prm: McoreParam, canon: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        return ModelAdapter.split_tp(replace(prm, fusion="gate_up") if prm.fusion == "oss_gate_up" else prm, canon,
                                     tp, tp_rank)

    def shard_blocks(self, prm: McoreParam, tp: int, tp_rank: int) -> list[Block]:
        if prm.fusion in ("oss_gate_up", "oss_t"):
            raise ValueError("gpt_oss: the reshard planner does not map its interleaved / transposed experts "
                             "(weight_sync.mode broadcast serves it)")
        return super().shard_blocks(prm, tp, tp_rank)

    # ---- the checkpoint's stacked experts --------------------------------------------------------
    def checkpoint_name(self, hf_name: str) -> str:
        """The checkpoint tensor holding plan tensor ``hf_name`` (one expert's slice -> the stack)."""
        m = _EXPERT.match(hf_name)
        return f"{m.group(1)}.{m.group(3)}" if m else hf_name

    def checkpoint_view(self, reader: Any) -> Any:
        return _StackedExpertsView(reader)

    def stack_hf(self, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Plan-named tensors (experts one by one, as export_hf yields them) -> the checkpoint's
        names, each layer's experts stacked in expert order once all have arrived (a layer's
        experts of one kind are held until then: E x one expert's tensor on the stage sender).
        None stays None (a rank that does not hold the experts, see export_hf)."""
        e = self.arch.num_experts
        pending: dict[str, dict[int, torch.Tensor | None]] = {}
        for name, t in tensors:
            m = _EXPERT.match(name)
            if not m:
                yield name, t
                continue
            key = f"{m.group(1)}.{m.group(3)}"
            pending.setdefault(key, {})[int(m.group(2))] = t
            if len(pending[key]) == e:
                held = pending.pop(key)
                parts = [held[g] for g in range(e)]
                if any(p is None for p in parts):
                    if not all(p is None for p in parts):
                        raise ValueError(f"stack_hf: {key}: some experts held here, some not")
                    yield key, None
                else:
                    yield key, torch.stack(parts)
        if pending:
            raise ValueError(f"stack_hf: experts missing for {sorted(pending)[:3]}")

    def checkpoint_specs(self, tensors: Iterable[HFTensorSpec]) -> list[HFTensorSpec]:
        """The plan's tensors as :meth:`stack_hf` yields them: each expert kind of a layer one
        stacked tensor, where its last expert's slice was."""
        e, seen, out = self.arch.num_experts, {}, []
        for t in tensors:
            m = _EXPERT.match(t.name)
            if not m:
                out.append(t)
                continue
            key = f"{m.group(1)}.{m.group(3)}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] == e:
                out.append(replace(t, name=key, shape=(e, *t.shape)))
        return out


class _StackedExpertsView:
    """An HFCheckpointReader whose ``mlp.experts.{g}.<name>`` are slice g of ``mlp.experts.<name>``."""

    def __init__(self, reader: Any):
        self.reader = reader

    def names(self) -> list[str]:
        return self.reader.names()

    def shape(self, name: str) -> tuple[int, ...]:
        m = _EXPERT.match(name)
        return self.reader.shape(name) if not m else tuple(self.reader.shape(f"{m.group(1)}.{m.group(3)}")[1:])

    def read(self, name: str) -> torch.Tensor:
        return self.read_slice(name, None, 0, 0)

    def read_slice(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        m = _EXPERT.match(name)
        if not m:
            return self.reader.read_slice(name, dim, start, stop)
        stacked = f"{m.group(1)}.{m.group(3)}"
        sl = self.reader._handle(stacked).get_slice(stacked)
        g = int(m.group(2))
        if dim is None:
            return sl[g]
        idx = [slice(g, g + 1)] + [slice(None)] * (len(sl.get_shape()) - 1)
        idx[dim + 1] = slice(start, stop)
        return sl[tuple(idx)][0]

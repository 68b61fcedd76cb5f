"""LoRA adapters on megatron-core's tensor-parallel linears (docs/lora.md).

Each targeted linear keeps its frozen weight W and gets per-HF-projection factors A [r, in],
B [out, r]: y = W x + scaling * B A x, scaling = alpha / r, exactly PEFT's ``LoraLayer`` per
projection, also on megatron's fused qkv (q/k/v blocks interleaved per query group, per TP
shard) and fc1 ([gate; up] per TP shard): the fused layer holds one A/B pair per projection and
writes each projection's delta into that projection's rows of the fused output.

Placement: column-parallel (qkv, fc1): A replicated, B row-sharded like W (its output rows);
the r-wide A x is all-reduced in backward (copy-to-TP region; under sequence parallelism it is
all-gathered along the sequence instead and A's gradient is summed over TP like the norms').
Row-parallel (proj, fc2): A sharded along W's input dim, the r-wide partial A x all-reduced in
forward, B replicated (under SP its output is scattered along the sequence like W's).
The adapters hang off each linear as a child module ``lora`` and run in a forward hook, so the
base parameters keep their names (HF load, export, checkpoints unchanged).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN + MLP
# MoE routed experts (per-expert adapters, PEFT's target_parameters on the fused HF experts):
# target name -> (megatron expert linear, HF fused expert parameter)
EXPERTS = {"experts.gate_up_proj": "linear_fc1", "experts.down_proj": "linear_fc2"}
# megatron linear (suffix of the parameter name) -> the HF projections it fuses, in order
LINEARS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}


@dataclass
class LoraConfig:
    """LoRA on the actor (docs/lora.md): frozen base, trainable low-rank adapters."""

    rank: int = 0
    """Adapter rank r; 0 = LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the update is (alpha / rank) * B A (PEFT's lora_alpha, no rsLoRA)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout); only 0 at tensor_parallel > 1."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    """HF/PEFT projection names that get adapters: any of q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (megatron's fused qkv / fc1 hold per-projection adapters), and on
    MoE models experts.gate_up_proj, experts.down_proj (one adapter per routed expert)."""
    init_seed: int = 0
    """Seed of the adapters' A init (PEFT's kaiming-uniform; B starts at 0): each A is drawn whole
    from this seed and its HF module name, so every rank and every layout starts from the same adapters."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank: must be >= 0, got {self.rank}")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha: must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.target_modules if t not in TARGETS and t not in EXPERTS]
        if bad or not self.target_modules:
            raise ValueError(f"lora.target_modules: {bad or '[]'} not supported; use some of "
                             f"{', '.join(TARGETS + tuple(EXPERTS))}")

    @property
    def expert_targets(self) -> list[str]:
        return [t for t in self.target_modules if t in EXPERTS]


def _tp_attrs(p: nn.Parameter, dim: int | None) -> nn.Parameter:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if dim is not None:
        set_tensor_model_parallel_attributes(p, True, dim, 1)
    return p


class LoraAdapter(nn.Module):
    """The adapters of one megatron linear (one A/B per targeted HF projection)."""

    def __init__(self, kind: str, projections: tuple[str, ...], targets: list[str], out_rows: list[int],
                 in_features: int, cfg: LoraConfig, tp: int, sp: bool, fused: str, arch, dtype: torch.dtype):
        super().__init__()
        self.kind, self.fused, self.arch, self.tp, self.sp = kind, fused, arch, tp, sp
        self.projections = projections
        self.out_rows = dict(zip(projections, out_rows))  # local rows per projection
        self.scaling = cfg.scaling
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        r = cfg.rank
        for p, rows in zip(projections, out_rows):
            if p not in targets:
                continue
            if kind == "column":  # A replicated (grad summed over TP by SP rule / copy region), B sharded
                a = nn.Parameter(torch.empty(r, in_features, dtype=dtype))  # A: apply_lora's _init_a; B = 0
                if sp:
                    a.sequence_parallel = True  # finalize_model_grads sums it over TP
                b = _tp_attrs(nn.Parameter(torch.zeros(rows, r, dtype=dtype)), 0)
            else:  # row: A sharded along W's input, B replicated
                a = _tp_attrs(nn.Parameter(torch.empty(r, in_features, dtype=dtype)), 1)
                b = nn.Parameter(torch.zeros(rows, r, dtype=dtype))
            self.A[p], self.B[p] = a, b

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scaling * B A x in the linear's local output layout."""
        from megatron.core.tensor_parallel import mappings as mp

        x = self.dropout(x)
        outs = {}
        for p in self.projections:
            if p not in self.A:
                continue
            h = x @ self.A[p].t()
            if self.kind == "column":
                h = mp.gather_from_sequence_parallel_region(h) if self.sp else mp.copy_to_tensor_model_parallel_region(h)
                outs[p] = (h @ self.B[p].t()) * self.scaling
            else:
                h = mp.reduce_from_tensor_model_parallel_region(h)
                d = (h @ self.B[p].t()) * self.scaling
                outs[p] = mp.scatter_to_sequence_parallel_region(d) if self.sp else d
        return self._assemble(outs)

    def _assemble(self, outs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-projection outputs (last dim = local rows; untargeted ones zero) -> the fused
        linear's local output layout."""
        some = next(iter(outs.values()))
        lead = some.shape[:-1]
        full = [outs[p] if p in outs else some.new_zeros(*lead, self.out_rows[p]) for p in self.projections]
        if self.fused == "qkv":  # local rows: per query group [q x heads_per_group, k, v]
            d, hpg = self.arch.head_dim, self.arch.heads_per_group
            q, k, v = full
            g = k.shape[-1] // d
            return torch.cat([q.reshape(*lead, g, hpg * d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)],
                             dim=-1).reshape(*lead, -1)
        return torch.cat(full, dim=-1)  # gate_up: local rows [gate_r; up_r]; single projections: itself

    def weight_delta(self) -> torch.Tensor:
        """scaling * B A as this rank's shard of the linear's weight (fp32; no communication)."""
        outs = {p: (self.B[p].float() @ self.A[p].float()).t() * self.scaling for p in self.A}
        return self._assemble(outs).t()


class ExpertLoraAdapter(LoraAdapter):
    """The adapter of one routed expert's linear (megatron SequentialMLP, local spec): one A [r, in],
    B [out, r] (PEFT's ParamWrapper slice for this expert; fc1's B rows are [gate; up] like W).
    At expert-TP 1 the expert linear does no communication (the token dispatcher does), so the
    adapter is a plain local matmul. Its parameters are expert parameters (``allreduce = False``):
    DDP and the distributed optimizer reduce them over the expert-data-parallel group."""

    def __init__(self, proj: str, out_features: int, in_features: int, cfg: LoraConfig, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.kind, self.fused, self.projections = "expert", "none", (proj,)
        self.out_rows = {proj: out_features}
        self.scaling = cfg.scaling
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        a = nn.Parameter(torch.empty(cfg.rank, in_features, dtype=dtype))
        b = nn.Parameter(torch.zeros(out_features, cfg.rank, dtype=dtype))
        for t in (a, b):
            t.allreduce = False  # megatron's expert-parameter mark (DDP: expert-data-parallel buffers)
        self.A = nn.ParameterDict({proj: a})
        self.B = nn.ParameterDict({proj: b})

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        p = self.projections[0]
        return (self.dropout(x) @ self.A[p].t() @ self.B[p].t()) * self.scaling

    def weight_delta(self) -> torch.Tensor:
        p = self.projections[0]
        return (self.B[p].float() @ self.A[p].float()) * self.scaling


def expert_linears(model) -> Iterator[tuple[int, str, nn.Module, str, int, int, int]]:
    """(chunk, megatron module name, module, target name, HF layer, global expert, #experts) of
    every routed-expert linear on this rank (its EP rank's experts; local spec SequentialMLP)."""
    ep_rank = model.groups.coords.ep
    for prm in model.stage_plan.params:
        if prm.ep_rank is None or prm.ep_rank != ep_rank or ".local_experts." not in prm.name:
            continue
        name = prm.name[: -len(".weight")]
        target = next(t for t, lin in EXPERTS.items() if name.endswith(lin))
        hf = prm.hf_names[0]  # model.layers.{L}.<moe>.experts.{g}.<proj>.weight
        head, rest = hf.split(".experts.")
        yield (prm.chunk, name, model.chunks[prm.chunk].get_submodule(name), target, head,
               int(rest.split(".")[0]), model.arch.num_experts)


def _hook(module, args, output):
    out, bias = output
    return out + module.lora.delta(args[0]), bias


def lora_linears(model) -> Iterator[tuple[int, str, nn.Module, tuple[str, ...]]]:
    """(chunk index, megatron module name, module, HF module names) of every adaptable dense
    linear on this rank (from the stage plan, so HF names carry global layer indices)."""
    for prm in model.stage_plan.params:
        for suffix in LINEARS:
            if prm.name.endswith(suffix + ".weight") and ".experts." not in prm.name:
                name = prm.name[: -len(".weight")]
                yield prm.chunk, name, model.chunks[prm.chunk].get_submodule(name), tuple(
                    n[: -len(".weight")] for n in prm.hf_names)


def check_lora(cfg: LoraConfig, arch, layout, layer_spec: str, *, critic: bool = False) -> None:
    """One-line refusals of what LoRA cannot be combined with yet (named by config key)."""
    if not cfg.enabled:
        return
    cfg.validate()
    if critic:
        raise ValueError("critic.lora: LoRA on the critic is not supported yet; set critic.lora.rank: 0")
    if not arch.is_moe and cfg.expert_targets:
        raise ValueError(f"actor.lora.target_modules: {cfg.expert_targets} need a mixture-of-experts model")
    dense_mlp = [t for t in cfg.target_modules if t in MLP]
    if arch.is_moe and dense_mlp and not getattr(arch, "dense_layers", ()):
        raise ValueError(f"actor.lora.target_modules: {dense_mlp}: this MoE model has no dense MLP layers (shared "
                         "experts are not adapted yet); adapt its experts with experts.gate_up_proj, experts.down_proj")
    if arch.is_moe and cfg.expert_targets and getattr(layout, "etp", 1) > 1:
        raise ValueError("actor.lora.target_modules: expert adapters with parallel.expert_tensor_parallel > 1 are not "
                         "supported yet (use expert_parallel; set expert_tensor_parallel: 1)")
    if arch.mla is not None:
        raise ValueError("actor.lora: LoRA with multi-latent attention is not supported yet; set actor.lora.rank: 0")
    if layer_spec != "local":
        raise ValueError("actor.lora: LoRA needs actor.model.layer_spec: local for now (TE fuses the input norm "
                         "into linear_qkv / linear_fc1, so the adapter would not see the normalized input)")
    if layout.cp > 1:
        raise ValueError("actor.lora: LoRA with parallel.context_parallel > 1 is not supported yet")
    if cfg.dropout > 0 and layout.tp > 1:
        raise ValueError("actor.lora.dropout: must be 0 at tensor_parallel > 1 (per-rank dropout masks would "
                         "differ on the replicated adapter input)")


def _shard_adapters_in_checkpoint(mod: nn.Module, kind: str) -> None:
    """megatron's Column/RowParallelLinear.sharded_state_dict shards only weight/bias and would
    save the adapters as replicated: this instance's override shards B (column) / A (row) along
    the TP dim like W, the replicated factor stays replicated."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0} if kind == "column" else {"weight": 1}
    for p in mod.lora.A:
        axes[f"lora.B.{p}" if kind == "column" else f"lora.A.{p}"] = 0 if kind == "column" else 1

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(mod.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=mod.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    mod.sharded_state_dict = sharded_state_dict


def _init_a(adapter: LoraAdapter, hf_name: str, seed: int, tp_rank: int, tp: int) -> None:
    """PEFT's kaiming-uniform A, drawn whole (fan-in = the full input) from a generator keyed by
    (seed, HF name, projection) and sliced to this rank's TP shard: the global RNG differs per rank,
    and DP replicas or TP copies of an A that started apart never agree again."""
    for p, a in adapter.A.items():
        shard = adapter.kind == "row"  # row: A split along W's input, contiguous per TP rank
        full = torch.empty(a.shape[0], a.shape[1] * (tp if shard else 1))
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{hf_name}:{p}".encode()))
        nn.init.kaiming_uniform_(full, a=5 ** 0.5, generator=g)
        with torch.no_grad():
            a.copy_(full.narrow(1, tp_rank * a.shape[1], a.shape[1]) if shard else full)


def apply_lora(model, cfg: LoraConfig) -> int:
    """Freeze ``model`` (a MegatronModel) and attach adapters to the targeted linears; returns the
    number of local adapter parameters. Raises if a target module is in no layer of the model."""
    found = set()
    for m in model.chunks:
        m.requires_grad_(False)
    tp, sp = model.groups.layout.tp, bool(model.config.sequence_parallel)
    n = 0
    for _, name, mod, hf in lora_linears(model):
        suffix = next(s for s in LINEARS if name.endswith(s))
        projs = LINEARS[suffix]
        if not set(projs) & set(cfg.target_modules):
            continue
        found |= set(projs) & set(cfg.target_modules)
        w = mod.weight
        kind = "row" if suffix in ("self_attention.linear_proj", "mlp.linear_fc2") else "column"
        a = model.arch
        if suffix.endswith("linear_qkv"):
            g = a.num_kv_heads // tp
            rows = [g * a.heads_per_group * a.head_dim, g * a.head_dim, g * a.head_dim]
            fused = "qkv"
        elif suffix.endswith("linear_fc1"):
            rows = [w.shape[0] // 2] * 2
            fused = "gate_up"
        else:
            rows = [w.shape[0]]
            fused = "none"
        mod.lora = LoraAdapter(kind, projs, cfg.target_modules, rows, w.shape[1], cfg, tp, sp, fused, a, w.dtype).to(w.device)
        _init_a(mod.lora, hf[0], cfg.init_seed, model.groups.coords.tp, tp)
        mod.register_forward_hook(_hook)
        _shard_adapters_in_checkpoint(mod, kind)
        n += sum(p.numel() for p in mod.lora.parameters())
    for _, name, mod, target, hf, expert, _ in expert_linears(model):
        if target not in cfg.target_modules:
            continue
        found.add(target)
        w = mod.weight
        mod.lora = ExpertLoraAdapter(target.split(".")[1], w.shape[0], w.shape[1], cfg, w.dtype).to(w.device)
        _init_a(mod.lora, f"{hf}.experts.{expert}", cfg.init_seed, 0, 1)
        mod.register_forward_hook(_hook)
        n += sum(p.numel() for p in mod.lora.parameters())
    model.lora = cfg  # checkpoints record it; PEFT export writes it
    missing = sorted(set(cfg.target_modules) - found)
    if missing and model.arch.num_layers:  # every stage holds attention and MLP of its layers
        raise ValueError(f"actor.lora.target_modules: {missing} not in this model")
    return n


# ---- PEFT <-> megatron (names, TP slices) -------------------------------------------------
def _peft_key(hf_module: str, ab: str) -> str:
    return f"base_model.model.{hf_module}.lora_{ab}.weight"


def _proj_of(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[1]


def adapter_params(model) -> Iterator[tuple[str, str, nn.Parameter, int | None]]:
    """(PEFT key, "A"/"B", local parameter, TP-sharded dim or None) of every adapter on this rank."""
    for _, name, mod, hf in lora_linears(model):
        lora = getattr(mod, "lora", None)
        if lora is None:
            continue
        for hfm in hf:
            p = _proj_of(hfm)
            if p not in lora.A:
                continue
            col = lora.kind == "column"
            yield _peft_key(hfm, "A"), "A", lora.A[p], (None if col else 1)
            yield _peft_key(hfm, "B"), "B", lora.B[p], (0 if col else None)


def load_peft_state(model, state: dict[str, torch.Tensor]) -> int:
    """Copy a PEFT adapter state dict (``base_model.model.<module>.lora_{A,B}.weight`` keys, as in
    adapter_model.safetensors) into this rank's adapters (TP-sliced); returns #tensors written."""
    tp, r = model.groups.layout.tp, model.groups.coords.tp
    n = 0
    for key, _, prm, dim in adapter_params(model):
        if key not in state:
            raise ValueError(f"{key}: missing from the adapter state")
        t = state[key]
        if dim is not None:
            t = t.chunk(tp, dim=dim)[r]
        if tuple(t.shape) != tuple(prm.shape):
            raise ValueError(f"{key}: adapter shape {tuple(t.shape)} != model shape {tuple(prm.shape)}")
        with torch.no_grad():
            prm.copy_(t)
        n += 1
    for key, ab, e, E, prm in expert_adapter_params(model):
        if key not in state:
            raise ValueError(f"{key}: missing from the adapter state")
        t = _expert_slice(state[key], ab, e, E)
        if tuple(t.shape) != tuple(prm.shape):
            raise ValueError(f"{key}: expert {e} adapter shape {tuple(t.shape)} != model shape {tuple(prm.shape)}")
        with torch.no_grad():
            prm.copy_(t)
        n += 1
    return n


# PEFT's ParamWrapper on a fused [E, out, in] expert parameter: lora_A.weight [r * E, in] is
# expert-major (A_e = A.reshape(E, r, in)[e]), lora_B.weight [out, r * E] expert-minor
# (B_e = B.reshape(out, r, E)[:, :, e]); with both expert targets PEFT wraps gate_up_proj first
# (key ``experts.base_layer``) and down_proj around it (key ``experts``): peft_config_dict lists
# target_parameters in that order.
def _expert_peft_module(head: str, target: str, targets: list[str]) -> str:
    both = all(t in targets for t in EXPERTS)
    return f"{head}.experts.base_layer" if both and target == "experts.gate_up_proj" else f"{head}.experts"


def expert_adapter_params(model) -> Iterator[tuple[str, str, int, int, nn.Parameter]]:
    """(PEFT key, "A"/"B", global expert, #experts, local parameter) of every expert adapter here."""
    for _, _, mod, target, head, e, E in expert_linears(model):
        lora = getattr(mod, "lora", None)
        if lora is None:
            continue
        proj = target.split(".")[1]
        m = _expert_peft_module(head, target, model.lora.target_modules)
        yield _peft_key(m, "A"), "A", e, E, lora.A[proj]
        yield _peft_key(m, "B"), "B", e, E, lora.B[proj]


def _expert_slice(t: torch.Tensor, ab: str, e: int, E: int) -> torch.Tensor:
    if ab == "A":
        return t.reshape(E, -1, t.shape[-1])[e]
    return t.reshape(t.shape[0], -1, E)[:, :, e]


def _fuse_experts(pieces: dict[tuple[str, str], dict[int, torch.Tensor]], E: int) -> dict[str, torch.Tensor]:
    """{(PEFT key, A/B): {expert: tensor}} (every expert) -> PEFT's fused tensors."""
    out = {}
    for (key, ab), per in pieces.items():
        assert sorted(per) == list(range(E)), (key, sorted(per))
        if ab == "A":
            out[key] = torch.stack([per[e] for e in range(E)]).reshape(-1, per[0].shape[-1])
        else:
            out[key] = torch.stack([per[e] for e in range(E)], dim=-1).reshape(per[0].shape[0], -1)
    return out


def gather_peft_state(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """This stage's adapters (or their gradients) in PEFT's names and full shapes (TP-gathered;
    collective over the TP group)."""
    from areal_mega.megatron.parallel_state import tp_all_gather

    out = {}
    for key, _, prm, dim in adapter_params(model):
        t = (prm.main_grad if getattr(prm, "main_grad", None) is not None else prm.grad) if grads else prm.detach()
        if t is None:
            t = torch.zeros_like(prm)
        if dim is not None and model.groups.layout.tp > 1:
            t = tp_all_gather(t.contiguous(), model.groups.tp, dim=dim)
        out[key] = t.detach().clone()
    pieces: dict = {}
    for key, ab, e, E, prm in expert_adapter_params(model):
        t = (prm.main_grad if getattr(prm, "main_grad", None) is not None else prm.grad) if grads else prm.detach()
        pieces.setdefault((key, ab), {})[e] = (torch.zeros_like(prm) if t is None else t).detach().cpu().clone()
    if pieces:  # this rank holds its EP rank's experts: all-gather them over the expert-parallel group
        import torch.distributed as dist

        if model.groups.layout.ep > 1:
            parts = [None] * dist.get_world_size(model.groups.ep)
            dist.all_gather_object(parts, pieces, group=model.groups.ep)
            pieces = {}
            for part in parts:
                for k, per in part.items():
                    pieces.setdefault(k, {}).update(per)
        dev = next(iter(out.values())).device if out else "cpu"
        out.update({k: v.to(dev) for k, v in _fuse_experts(pieces, model.arch.num_experts).items()})
    return out


def peft_state_on_rank0(model) -> dict[str, torch.Tensor] | None:
    """Every adapter of the model (all pipeline stages) in PEFT's names and full shapes, on the
    world's rank 0 (None elsewhere). Collective over the world: TP gather, then one replica per
    stage sends (adapters are MBs, so an object gather is enough)."""
    import torch.distributed as dist

    mine = {k: v.cpu().contiguous() for k, v in gather_peft_state(model).items()}
    c = model.groups.coords
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine if c.tp == 0 and c.dp == 0 and c.cp == 0 else {})
    return {k: v for p in parts for k, v in p.items()} if dist.get_rank() == 0 else None


def save_peft_adapter(model, out_dir, base_model: str | None) -> None:
    """A PEFT adapter directory (adapter_model.safetensors + adapter_config.json naming
    ``base_model``) that ``peft.PeftModel.from_pretrained`` loads, from any layout. Collective
    over the world (TP gather, then every pipeline stage's adapters to rank 0, which writes)."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    state = peft_state_on_rank0(model)
    if dist.get_rank() == 0:
        cfg = model.lora
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(peft_config_dict(cfg, base_model), indent=1))
    dist.barrier()


def peft_config_dict(cfg: LoraConfig, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for ``cfg`` (also the config SGLang's adapter load takes)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": [t for t in cfg.target_modules if t not in EXPERTS],
            "target_parameters": [f"mlp.{t}" for t in EXPERTS if t in cfg.target_modules] or None,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True}


class MergedView:
    """A model chunk seen with every adapted weight merged, W + scaling * B A (computed in fp32,
    cast to W's dtype), and without the adapter parameters: what the merged-weight sync and
    export read (models.base.named_tensors / export_hf take it in place of the chunk)."""

    def __init__(self, chunk: nn.Module):
        from areal_mega.models.base import unwrap

        self.chunk = unwrap(chunk)

    def named_parameters(self):
        deltas = {}
        for name, mod in self.chunk.named_modules():
            if isinstance(getattr(mod, "lora", None), LoraAdapter):
                deltas[f"{name}.weight"] = mod.lora
        for n, p in self.chunk.named_parameters():
            if ".lora." in n:
                continue
            lora = deltas.get(n)
            yield n, (p if lora is None else (p.detach().float() + lora.weight_delta()).to(p.dtype))

    def named_buffers(self):
        return self.chunk.named_buffers()


def has_lora(chunks) -> bool:
    from areal_mega.models.base import unwrap

    return any(isinstance(getattr(m, "lora", None), LoraAdapter) for c in chunks for m in unwrap(c).modules())


def sync_chunks(chunks: list) -> list:
    """What weight sync reads: merged views of ``chunks`` when they carry adapters (the merged-
    weight fallback: full weights over the existing transports; logged once), else ``chunks``."""
    if not has_lora(chunks):
        return chunks
    import logging

    logging.getLogger(__name__).info("weight sync: LoRA merged-weight fallback (W + scaling * B A sent as full "
                                     "weights over the configured transport)")
    return [MergedView(c) for c in chunks]

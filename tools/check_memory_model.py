"""Check the launcher's learner memory model against what the engine really holds (CPU, gloo).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tools/check_memory_model.py [--out results.jsonl]

For a tiny bf16 Llama (the estimator prices bf16 weights, fp32 grads, fp32 master + Adam) in
several layouts of the 2 ranks -- TP1 (dp 2), TP2 (dp 1, SP on and off), PP2 (dp 1), CP2 (dp 1) --
and recompute none / selective / full, it measures, per rank:

* params / grads / optimizer: bytes of the engine's own tensors -- the model parameters, the
  DDP grad buffers' ``main_grad`` views, and the optimizer's fp32 master copies and Adam
  ``exp_avg`` / ``exp_avg_sq`` (after one step, so the state exists), each deduplicated by
  storage;
* activations: the peak of the bytes saved for backward (``torch.autograd.graph.
  saved_tensors_hooks``, deduplicated by storage, parameters excluded) while one training
  micro-batch runs forward and backward (:class:`SavedActivationMeter`);

and compares each with ``areal_mega.simulator.memory.estimate_learner`` for the same config
(the same ExperimentConfig fields the trainer builds the engine from). One JSON line per
configuration (``predicted_bytes``, ``measured_bytes``, ``ratio`` per category, worst rank),
then ``{"max_activation_error": ..., "exact_state_bytes": true|false}``. The acceptance bar
(docs/launch.md): state bytes equal exactly, activations within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Held:
    """What the pack hook returns: keeps the tensor, and its storage's live count, until
    autograd drops the saved value (after that node's backward)."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key, meter: "SavedActivationMeter | None"):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        if self.meter is not None:
            self.meter._release(self.key)


class SavedActivationMeter:
    """Live and peak bytes of the tensors autograd saves for backward, deduplicated by storage.

    ``with meter:`` installs ``saved_tensors_hooks``; each saved tensor's storage is counted
    once however many nodes save it (views, the same mask in every layer) and for as long as
    any of them still holds it. Storages of ``exclude`` tensors (the parameters: a linear saves
    its weight) are not counted. Recompute's re-forward in backward is counted too (its saves
    are live while that layer's backward runs), so ``peak_bytes`` is the activation memory of
    what ran."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr == 0 or nbytes == 0 or ptr in self._excluded or t.device.type == "meta":
            return _Held(t, None, None)
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Held(t, ptr, self)

    def _release(self, ptr) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[ptr]
            self.live_bytes -= entry[1]

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        return False


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view of a buffer counts the buffer
    once; use :func:`tensor_bytes` for element bytes)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Element bytes of distinct tensors (numel * element size, each (ptr, numel) once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


# ---------------------------------------------------------------- the measurement driver
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
"""Tiny bf16 Llama (GQA 4/2, head dim 32, SwiGLU, vocab a multiple of 128: no padding rows)."""
TOKENS = 160
"""Tokens of the one micro-batch each rank trains on (even: no SP padding; s^2 terms visible)."""

DEEPSEEK = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=1024, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
                num_nextn_predict_layers=0, routed_scaling_factor=2.5)
"""Tiny bf16 DeepSeek-V3: MLA with q_lora_rank, a shared expert, a dense first layer, 8 experts top-2."""

CONFIGS = [  # name, tp, pp, sequence_parallel, recompute, method, num_layers, context_parallel
    ("tp1", 1, 1, False, "none", "uniform", 1, 1),
    ("tp1_selective", 1, 1, False, "selective", "uniform", 1, 1),
    ("tp1_full", 1, 1, False, "full", "uniform", 1, 1),
    ("tp2_spoff", 2, 1, False, "none", "uniform", 1, 1),
    ("tp2_spon", 2, 1, True, "none", "uniform", 1, 1),
    ("tp2_spon_selective", 2, 1, True, "selective", "uniform", 1, 1),
    ("tp2_spon_full_uniform2", 2, 1, True, "full", "uniform", 2, 1),
    ("tp2_spon_full_block2", 2, 1, True, "full", "block", 2, 1),
    ("pp2", 1, 2, False, "none", "uniform", 1, 1),
    ("pp2_full", 1, 2, False, "full", "uniform", 1, 1),
    # context parallel: each rank holds 2 of the 4 chunks (80 tokens), attends over all 160
    ("cp2", 1, 1, False, "none", "uniform", 1, 2),
    ("cp2_selective", 1, 1, False, "selective", "uniform", 1, 2),
]
FAMILY_CONFIGS = [  # the DeepSeek-V3 model: name, tp, pp, sequence_parallel, recompute, method, num_layers, ep
    ("ds_ep2", 1, 1, False, "none", "uniform", 1, 2),
    ("ds_tp2_spon", 2, 1, True, "none", "uniform", 1, 1),
    ("ds_pp2", 1, 2, False, "none", "uniform", 1, 1),
]
QWEN35 = dict(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              max_position_embeddings=1024)
"""Tiny bf16 Qwen3.5 text model: 3 gated DeltaNet layers + 1 gated attention layer."""
QWEN35_CONFIGS = [  # name, tp, pp, sequence_parallel, recompute, method, num_layers
    ("q35_tp1", 1, 1, False, "none", "uniform", 1),
    ("q35_tp2", 2, 1, False, "none", "uniform", 1),
    ("q35_tp2_spon", 2, 1, True, "none", "uniform", 1),
    ("q35_pp2", 1, 2, False, "none", "uniform", 1),
    ("q35_tp1_full", 1, 1, False, "full", "uniform", 1),
]


def _optimizer_tensors(optimizer):
    """The optimizer's own tensors: main (fp32 master) params and Adam moments."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out.append(p)
                st = inner.state.get(p, {})
                out += [v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq") and isinstance(v, torch.Tensor)]
    return out


def measure(name, tp, pp, sp, recompute, method, num_layers, cp, hf_dir, ep=1) -> dict:
    import torch.distributed as dist

    from areal_mega.simulator.memory import settings_from_engine_config, stage_activations, stage_state
    from areal_mega.megatron.engine import MegatronEngineConfig, MegatronTrainEngine, OptimizerConfig
    from areal_mega.megatron.model import MegatronModelConfig
    from areal_mega.batching.packing import pack_sequences
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout

    layout = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                                                 expert_parallel=ep),
                                  dist.get_world_size())
    groups = init_model_parallel(layout, backend="gloo", seed=7)
    cfg = MegatronEngineConfig(
        model=MegatronModelConfig(dtype="bfloat16", sequence_parallel=sp, recompute=recompute,
                                  recompute_method=method, recompute_num_layers=num_layers),
        optimizer=OptimizerConfig(lr=1e-4, use_distributed_optimizer=True),
        max_tokens_per_microbatch=TOKENS,
    )
    hf = load_hf_config(hf_dir)
    eng = MegatronTrainEngine.create(cfg, hf, groups, hf_dir)
    g = torch.Generator().manual_seed(0)
    # one TOKENS-long sequence per DP rank: every rank trains exactly one micro-batch of TOKENS
    seqs = [{"input_ids": torch.randint(1, 256, (TOKENS,), generator=g).tolist(), "loss_mask": [1] * TOKENS}
            for _ in range(layout.dp)]
    batch = pack_sequences(seqs)
    total = float(batch["loss_mask"].sum())

    def loss_fn(lp, ent, mb):
        return -(lp * mb["loss_mask"]).sum() / total, {"n_tokens": mb["loss_mask"].sum().float()}

    params = [p for c in eng.model.chunks for p in c.parameters()]
    grads = [p.main_grad for p in params]
    meter = SavedActivationMeter(exclude=params + grads)
    with meter:
        stats = eng.train_batch(batch, loss_fn)
    assert stats["num_microbatches"] == 1, stats
    own = {t.untyped_storage().data_ptr() for t in params + grads}
    opt = [t for t in _optimizer_tensors(eng.optimizer) if t.untyped_storage().data_ptr() not in own]
    measured = torch.tensor([tensor_bytes(params), tensor_bytes(grads), tensor_bytes(opt), meter.peak_bytes],
                            dtype=torch.float64)
    # optimizer state is split over DP (x CP) by the distributed optimizer: its sum is exact, the
    # per-rank share depends on megatron's bucket ranges -> compare the mean
    opt_sum = measured[2].clone()
    dist.all_reduce(opt_sum, group=groups.dp_cp)
    measured[2] = opt_sum / (layout.dp * layout.cp)

    shape = get_adapter(hf).arch
    st = settings_from_engine_config(cfg, "bfloat16", tp, on_gpu=False, reserved_gib=0.0)
    st = type(st)(**{**st.__dict__, "num_microbatches": 1})
    k = groups.coords.pp
    ps = stage_state(shape, st, layout, k)
    acts, logits = stage_activations(shape, st, layout, k)
    predicted = [float(ps.weights), float(ps.grads), float(ps.optimizer), acts + logits]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"stage": k, "tp_rank": groups.coords.tp, "dp_rank": groups.coords.dp,
                                  "measured": measured.tolist(), "predicted": predicted,
                                  "opt_sum_exact": int(opt_sum.item()) == int(round(ps.optimizer * layout.dp * layout.cp))})
    destroy_model_parallel()
    out = []
    for stage in sorted({r["stage"] for r in rows}):
        mine = [r for r in rows if r["stage"] == stage]
        worst = max(mine, key=lambda r: r["measured"][3])
        keys = ("params", "grads", "optimizer", "activations")
        line = {
            "config": name if pp == 1 else f"{name}/stage{stage}", "tp": tp, "pp": pp, "ep": ep, "dp": layout.dp, "cp": cp,
            "sequence_parallel": bool(sp), "recompute": recompute
            + (f"/{method}/{num_layers}" if recompute == "full" else ""), "micro_batch_tokens": TOKENS,
            "predicted_bytes": dict(zip(keys, worst["predicted"])),
            "measured_bytes": dict(zip(keys, worst["measured"])),
        }
        line["ratio"] = {k2: (line["measured_bytes"][k2] / line["predicted_bytes"][k2]) if line["predicted_bytes"][k2] else None
                         for k2 in keys}
        line["state_exact"] = all(
            r["measured"][i] == r["predicted"][i] for r in mine for i in (0, 1)) and all(r["opt_sum_exact"] for r in mine)
        out.append(line)
    return out


def main() -> None:
    import torch.distributed as dist

    from areal_mega.megatron.parallel_state import init_process_group_for_script
    from areal_mega.demo.models import save_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the JSON lines here")
    ap.add_argument("--only", help="comma-separated config names (default: all)")
    args = ap.parse_args()
    init_process_group_for_script("gloo")  # the learners' one distributed start (torchrun world)
    work = tempfile.mkdtemp(prefix="check_memory_model_") if dist.get_rank() == 0 else None
    box = [work]
    dist.broadcast_object_list(box, src=0)
    hf_dir = os.path.join(box[0], "tiny_llama")
    ds_dir = os.path.join(box[0], "tiny_deepseek_v3")
    q35_dir = os.path.join(box[0], "tiny_qwen3_5")
    if dist.get_rank() == 0:
        save_tiny_model(hf_dir, "llama", dtype="bfloat16", **MODEL)
        save_tiny_model(ds_dir, "deepseek_v3", dtype="bfloat16", **DEEPSEEK)
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        torch.manual_seed(0)
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35)).to(torch.bfloat16).save_pretrained(q35_dir)
    dist.barrier()
    lines = []
    runs = ([(*c, hf_dir) for c in CONFIGS] + [(*c[:7], 1, ds_dir, c[7]) for c in FAMILY_CONFIGS]
            + [(*c, 1, q35_dir) for c in QWEN35_CONFIGS])
    for c in runs:
        if args.only and c[0] not in args.only.split(","):
            continue
        for line in measure(*c):
            lines.append(line)
            if dist.get_rank() == 0:
                print(json.dumps(line), flush=True)
    if dist.get_rank() == 0:
        err = max(abs(line["ratio"]["activations"] - 1.0) for line in lines)
        final = {"max_activation_error": err, "exact_state_bytes": all(line["state_exact"] for line in lines)}
        print(json.dumps(final), flush=True)
        if args.out:
            Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines + [final]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 4 tests/dist/family_layouts.py --work-dir W --out R.pt

One 4-rank gloo launch for the MoE families of areal_mega/models/moe_families.py (Mixtral,
Qwen2-MoE, DeepSeek-V3 with and without q_lora_rank, GLM-4.5): for each tiny HF model in W
(written by tests/test_megatron_families.py, HF reference logits in W/ref.pt) and each layout of
LAYOUTS (tp, pp, ep; dp fills the rest), re-initialising megatron's parallel state each time,
records on rank 0 into R.pt:

* logits[model][layout]: packed-batch logits (last stage, TP-gathered);
* export[model][layout]: per exporting rank (pp, tp, dp, ep, #bit-identical to the HF file,
  #differing, #None, names) from ModelAdapter.export_hf -- the weight-sync code path;
* negative[control]: logits with one piece deliberately dropped (NEGATIVE);
* W/<model>_sync.pt: the export stream of SYNC_STREAM's models (what a broadcast sync sends);
* W/<model>_ckpt, W/<model>_hf: each model converted HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2)
  by the conversion tools' main() functions, run inside this world.

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations


import torch

from areal_mega.megatron.model import (
    HFCheckpointReader,
    MegatronModelConfig,
    build_model,
    export_hf_weights,
    forward_logits,
    load_hf_weights,
)
from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
from tests.support.dist import convert_round_trip, finish, gather, last_stage_value, start_layouts_run
from areal_mega.models import get_adapter, load_hf_config
from areal_mega.parallel import ParallelConfig, ParallelLayout

# (tp, pp, ep): TP1, TP2, PP2, EP2, EP2 x TP2, EP2 x PP2 (expert TP = TP)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]
# control -> (model, layout, what is dropped: an HF tensor-name suffix read as zeros)
NEGATIVE = {
    "expert_bias_dropped": ("deepseek_v3", (1, 1, 2), "mlp.gate.e_score_correction_bias"),
    "shared_expert_dropped": ("qwen2_moe", (2, 1, 1), "mlp.shared_expert.down_proj.weight"),
    "glm_expert_bias_dropped": ("glm4_moe", (1, 1, 1), "mlp.gate.e_score_correction_bias"),
    "mixtral_router_dropped": ("mixtral", (1, 1, 2), "block_sparse_moe.gate.weight"),
    "nolora_expert_bias_dropped": ("deepseek_nolora", (2, 1, 1), "mlp.gate.e_score_correction_bias"),
    "kimi_k25_pp2_kv_b_dropped": ("kimi_k25", (1, 2, 1), "layers.1.self_attn.kv_b_proj.weight"),  # tests/test_kimi_k25.py
}
# The families whose weight kinds the others lack: MLA + expert bias + shared experts + dense
# layers (DeepSeek-V3), the gated shared expert (Qwen2-MoE). The rest share their code paths
# (load_hf, export_hf), bit-checked at every layout by the export rows. Each pair costs ~2 saves.
ROUNDTRIP = ("deepseek_v3", "qwen2_moe")
ROUNDTRIP += ("kimi_k25",)  # the VL checkpoint: its vision tower copied from the source (tests/test_kimi_k25.py)


SYNC_STREAM = {"kimi_k25": (2, 1, 2)}
"""model -> the layout whose stage-0 sender's export stream is saved as W/<model>_sync.pt (rank 0's:
every tensor at PP1), loaded into SGLang's own model class by tests/support/sglang_load.py."""


def key_of(tp, pp, ep) -> str:
    return f"tp{tp}pp{pp}ep{ep}"


def dropping(adapter_cls, suffix: str):
    """A subclass of ``adapter_cls`` whose load reads the HF tensors ending in ``suffix`` as zeros."""

    class Dropped(adapter_cls):
        def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
            def read(name, *a):
                t = read_slice(name, *a)
                return torch.zeros_like(t) if name.endswith(suffix) else t

            return super().load_hf(chunks, stage_plan, tp, tp_rank, read, shape_of, **kw)

    return Dropped


def main() -> None:
    work, out, ws, ref = start_layouts_run()
    res: dict = {"logits": {}, "export": {}, "negative": {}}
    for name, r in ref.items():
        hf_dir = work / name
        ids, cu = r["input_ids"], r["cu_seqlens"]
        hf_file = HFCheckpointReader(hf_dir)
        res["logits"][name], res["export"][name] = {}, {}
        for tp, pp, ep in LAYOUTS:
            lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep), ws)
            key = key_of(tp, pp, ep)
            groups = init_model_parallel(lay, backend="gloo")
            model = build_model(hf_dir, groups, MegatronModelConfig(layer_spec="local"))
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            c = groups.coords
            row = None
            if lay.exports(groups.rank):
                same, diff, none, names, stream = 0, 0, 0, [], []
                for n, t in export_hf_weights(model):
                    names.append(n)
                    if t is None:
                        none += 1
                    elif torch.equal(t, hf_file.read(n)):
                        same += 1
                    else:
                        diff += 1
                    if t is not None:
                        stream.append((n, t))
                row = (c.pp, c.tp, c.dp, c.ep, same, diff, none, names)
                if SYNC_STREAM.get(name) == (tp, pp, ep) and groups.rank == 0:  # what a broadcast sync sends
                    torch.save(stream, work / f"{name}_sync.pt")
            res["export"][name][key] = gather(row)
            for control, (m, lay_key, suffix) in NEGATIVE.items():
                if m == name and lay_key == (tp, pp, ep):
                    cls = type(get_adapter(load_hf_config(hf_dir)))
                    neg = build_model(hf_dir, groups, adapter=dropping(cls, suffix)(load_hf_config(hf_dir)))
                    load_hf_weights(neg, hf_dir)
                    res["negative"][control] = (name, last_stage_value(forward_logits(neg, ids, cu)))
            destroy_model_parallel(groups)
    # HF -> megatron (EP2 x PP2) -> HF (EP2 x TP2) through the conversion tools' own main().
    for name in [n for n in ROUNDTRIP if n in ref]:  # the models of this run
        convert_round_trip(work / name, work / name, ["--ep", "2", "--pp", "2"], ["--ep", "2", "--tp", "2"])
    finish(res, out)


if __name__ == "__main__":
    main()

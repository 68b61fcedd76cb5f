"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/dsa_layouts.py --work-dir W --out R.pt

DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) through the model registry, 2 gloo ranks: for
each tiny HF model in W (written by tests/test_dsa.py; HF reference logits in W/ref.pt) and each
layout of LAYOUTS (tp, pp, ep; dp fills the rest), records on rank 0 into R.pt:

* logits[model][layout]: packed-batch logits (last stage, TP-gathered);
* export[model][layout]: per exporting rank (pp, is the stage's sender, #bit-identical to the HF
  file, #differing, names) from ModelAdapter.export_hf -- the weight-sync code path; at TP2 the
  sender's stream is saved as W/<model>_sync_tp2.pt (the SGLang-loader check);
* negative[control]: logits of a deliberately wrong model (NEGATIVE): dense attention (the
  indexer's top-k past every sequence) or the indexer's rows loaded unpermuted;
* W/<model>_ckpt, W/<model>_hf: HF -> megatron -> HF by the conversion tools' main() (ROUNDTRIP).

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations


import torch

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
"""(tp, pp, ep): TP1 x DP2, TP2 (sequence parallel "auto"), PP2, EP2."""
NEGATIVE = {
    "v32_tp2_dense": ("deepseek_v32", (2, 1, 1), "dense"),
    "v32_ep2_unpermuted": ("deepseek_v32", (1, 1, 2), "unpermuted"),
    "glm5_pp2_dense": ("glm_moe_dsa", (1, 2, 1), "dense"),
    "glm5_tp2_unpermuted": ("glm_moe_dsa", (2, 1, 1), "unpermuted"),
}
ROUNDTRIP = {"deepseek_v32": (["--ep", "2"], ["--tp", "2"]), "glm_moe_dsa": (["--pp", "2"], ["--ep", "2"])}
"""model -> (HF -> megatron layout, megatron -> HF layout) of the conversion tools."""


def key_of(tp, pp, ep) -> str:
    return f"tp{tp}pp{pp}ep{ep}"


def unpermuted(adapter_cls):
    """Control: ``adapter_cls`` loading the indexer's rows in HF's order (no head permutation)."""

    class Unpermuted(adapter_cls):
        @property
        def _perm(self):
            return torch.arange(self.arch.dsa.index_head_dim)

    return Unpermuted


def control_adapter(hf_dir, how: str):
    from areal_mega.models import get_adapter, load_hf_config

    cfg = load_hf_config(hf_dir)
    if how == "dense":
        return get_adapter({**cfg, "index_topk": 1 << 20})
    return unpermuted(type(get_adapter(cfg)))(cfg)


def main() -> None:
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from tests.support.dist import convert_round_trip, export_check, finish, gather, last_stage_value, start_layouts_run

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
            model = build_model(hf_dir, groups, MegatronModelConfig())
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            row, stream = export_check(model, groups, hf_file)
            if (tp, pp, ep) == (2, 1, 1) and groups.rank == 0:  # what a broadcast sync sends, gathered over TP2
                torch.save(stream, work / f"{name}_sync_tp2.pt")
            res["export"][name][key] = gather(row)
            for control, (m, lay_key, how) in NEGATIVE.items():
                if m == name and lay_key == (tp, pp, ep):
                    neg = build_model(hf_dir, groups, adapter=control_adapter(hf_dir, how))
                    load_hf_weights(neg, hf_dir)
                    res["negative"][control] = (name, last_stage_value(forward_logits(neg, ids, cu)))
            destroy_model_parallel(groups)
    for name, (first, second) in ROUNDTRIP.items():
        convert_round_trip(work / name, work / name, first, second)
    finish(res, out)


if __name__ == "__main__":
    main()

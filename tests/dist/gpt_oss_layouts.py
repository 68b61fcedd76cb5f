"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/gpt_oss_layouts.py --work-dir W --out R.pt

gpt-oss through the model registry (build_model / load_hf_weights / export_hf_weights), 2 gloo
ranks, the tiny HF model W/model (tests/test_gpt_oss.py; HF reference logits in W/ref.pt). Records
on rank 0 into R.pt:

* logits[layout]: packed-batch logits (last stage, TP-gathered) at TP1 (x DP2), TP2, PP2, EP2, CP2;
* export[layout]: per exporting rank (pp, is the stage's sender, #bit-identical to the HF file's
  slice, #differing, names) from ModelAdapter.export_hf -- the weight-sync code path; at TP2 the
  sender's stream stacked as the checkpoint (W/sync_tp2.pt);
* negative[control]: logits with one block dropped at load (NEGATIVE);
* W/model_ckpt, W/model_hf: HF -> megatron (EP2) -> HF (TP2, ETP1) by the conversion tools' main().

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.dist.qwen3_5_layouts import altered, key_of  # noqa: E402

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
"""(tp, pp, ep); dp fills the 2 ranks."""
CP_LAYOUT = (1, 1, 1, 2)
"""(tp, pp, ep, cp): context parallelism 2, the window band on CP's global token indices."""
# control -> (layout, HF tensor-name suffix, what the load does to it)
NEGATIVE = {
    "tp2_sinks_dropped": ((2, 1, 1), "layers.0.self_attn.sinks", "zero"),
    # PP2: stage 1 holds layers 2 (windowed) and 3
    "pp2_window_layer_sinks_dropped": ((1, 2, 1), "layers.2.self_attn.sinks", "zero"),
    "ep2_expert_gate_up_bias_dropped": ((1, 1, 2), "layers.1.mlp.experts.3.gate_up_proj_bias", "zero"),
    # a gate/up de-interleave gone wrong: one expert's columns reversed
    "ep2_expert_gate_up_mismapped": ((1, 1, 2), "layers.0.mlp.experts.2.gate_up_proj", "flip_cols"),
}


def main() -> None:
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from tests.support.dist import convert_round_trip, export_check, finish, gather, last_stage_value, start_layouts_run

    work, out, ws, r = start_layouts_run()
    hf_dir = work / "model"
    ids, cu = r["input_ids"], r["cu_seqlens"]
    adapter = get_adapter(hf_dir)
    hf_file = adapter.checkpoint_view(HFCheckpointReader(hf_dir))
    res: dict = {"logits": {}, "export": {}, "negative": {}}
    for tp, pp, ep, cp in [(*lay, 1) for lay in LAYOUTS] + [CP_LAYOUT]:
        # experts with biases: megatron allows expert_tensor_parallel 1 only (refused otherwise, naming the key)
        lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep,
                                                  expert_tensor_parallel=1, context_parallel=cp), ws)
        key = key_of(tp, pp, ep) + (f"cp{cp}" if cp > 1 else "")
        groups = init_model_parallel(lay, backend="gloo")
        model = build_model(hf_dir, groups, MegatronModelConfig())
        load_hf_weights(model, hf_dir)
        res["logits"][key] = last_stage_value(forward_logits(model, ids, cu))
        row, stream = export_check(model, groups, hf_file)
        if (tp, pp) == (2, 1) and groups.rank == 0:  # what a broadcast sync sends, stacked as SGLang loads it
            torch.save(list(adapter.stack_hf(stream)), work / "sync_tp2.pt")
        res["export"][key] = gather(row)
        for control, (lay_key, suffix, how) in NEGATIVE.items():
            if lay_key == (tp, pp, ep):
                cls = type(adapter)
                if how == "flip_cols":
                    class Flip(cls):
                        def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
                            def read(name, *a):
                                t = read_slice(name, *a)
                                return t.flip(-1) if name.endswith(suffix) else t
                            return super().load_hf(chunks, stage_plan, tp, tp_rank, read, shape_of, **kw)
                    neg_cls = Flip
                else:
                    neg_cls = altered(cls, suffix, how)
                neg = build_model(hf_dir, groups, adapter=neg_cls(load_hf_config(hf_dir)))
                load_hf_weights(neg, hf_dir)
                res["negative"][control] = last_stage_value(forward_logits(neg, ids, cu))
        destroy_model_parallel(groups)
    # HF -> megatron (EP2) -> HF (TP2) through the conversion tools' own main().
    convert_round_trip(hf_dir, work / "model", ["--ep", "2"], ["--tp", "2", "--etp", "1"])  # -> model_ckpt, model_hf
    finish(res, out)


if __name__ == "__main__":
    main()

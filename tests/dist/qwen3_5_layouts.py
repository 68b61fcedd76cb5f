"""PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 tests/dist/qwen3_5_layouts.py --work-dir W --out R.pt

Qwen3.5 through the model registry (build_model / load_hf_weights / export_hf_weights), 2 gloo
ranks: for each tiny HF model in W (written by tests/test_qwen3_5.py: the text model ``text`` and
the vision-language checkpoint ``vl``; HF reference logits in W/ref.pt) and each layout of
LAYOUTS (tp, pp; dp fills the rest), records on rank 0 into R.pt:

* logits[model][layout]: packed-batch logits (last stage, TP-gathered);
* export[model][layout]: per exporting rank (pp, tp, dp, #bit-identical to the HF file,
  #differing, names) from ModelAdapter.export_hf -- the weight-sync code path; at TP2 the
  sender's stream is also saved as W/<model>_sync_tp2.pt (tests/support/sglang_qwen3_5_load.py);
* negative[control]: logits with one block dropped or mis-mapped at load (NEGATIVE);
* W/<model>_ckpt, W/<model>_hf: HF -> megatron (PP2) -> HF (TP2) by the conversion tools' main().

``__main__`` guard: dist_checkpointing.save re-imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
# control -> (model, layout, HF tensor-name suffix, what the load does to it)
NEGATIVE = {
    # PP2: stage 1 holds layers 2-3; layer 3 is the gated full-attention block
    "pp2_full_attention_block_dropped": ("text", (1, 2), "layers.3.self_attn.o_proj.weight", "zero"),
    # TP2: the DeltaNet's z rows reversed (a fused in_proj part mis-mapped)
    "tp2_in_proj_z_mismapped": ("text", (2, 1), "layers.0.linear_attn.in_proj_z.weight", "flip"),
    "vl_pp2_deltanet_block_dropped": ("vl", (1, 2), "layers.2.linear_attn.out_proj.weight", "zero"),
}


def key_of(tp, pp) -> str:
    return f"tp{tp}pp{pp}"


def altered(adapter_cls, suffix: str, how: str):
    """A subclass of ``adapter_cls`` whose load alters the HF tensors ending in ``suffix``."""

    class Altered(adapter_cls):
        def load_hf(self, chunks, stage_plan, tp, tp_rank, read_slice, shape_of, **kw):
            def read(name, *a):
                t = read_slice(name, *a)
                if not name.endswith(suffix):
                    return t
                return torch.zeros_like(t) if how == "zero" else t.flip(0)

            return super().load_hf(chunks, stage_plan, tp, tp_rank, read, shape_of, **kw)

    return Altered


def main() -> None:
    from areal_mega.megatron.model import (
        HFCheckpointReader, MegatronModelConfig, build_model, export_hf_weights, forward_logits, load_hf_weights,
    )
    from areal_mega.megatron.parallel_state import destroy_model_parallel, init_model_parallel
    from areal_mega.models import get_adapter, load_hf_config
    from areal_mega.parallel import ParallelConfig, ParallelLayout
    from tests.support.dist import gather, last_stage_value

    ap = argparse.ArgumentParser()
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work_dir)
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    ref = torch.load(work / "ref.pt")
    res: dict = {"logits": {}, "export": {}, "negative": {}}
    for name, r in ref.items():
        hf_dir = work / name
        ids, cu = r["input_ids"], r["cu_seqlens"]
        hf_file = HFCheckpointReader(hf_dir)
        res["logits"][name], res["export"][name] = {}, {}
        for tp, pp in LAYOUTS:
            lay = ParallelLayout.build(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), ws)
            key = key_of(tp, pp)
            groups = init_model_parallel(lay, backend="gloo")
            model = build_model(hf_dir, groups, MegatronModelConfig())
            load_hf_weights(model, hf_dir)
            res["logits"][name][key] = last_stage_value(forward_logits(model, ids, cu))
            c = groups.coords
            row = None
            if lay.exports(groups.rank):
                same, diff, names, stream = 0, 0, [], []
                for n, t in export_hf_weights(model):
                    names.append(n)
                    stream.append((n, t))
                    same, diff = (same + 1, diff) if torch.equal(t, hf_file.read(n)) else (same, diff + 1)
                row = (c.pp, c.tp, c.dp, same, diff, names)
                if (tp, pp) == (2, 1) and groups.rank == 0:  # what a broadcast sync sends, gathered over TP2
                    torch.save(stream, work / f"{name}_sync_tp2.pt")
            res["export"][name][key] = gather(row)
            for control, (m, lay_key, suffix, how) in NEGATIVE.items():
                if m == name and lay_key == (tp, pp):
                    cls = type(get_adapter(load_hf_config(hf_dir)))
                    neg = build_model(hf_dir, groups, adapter=altered(cls, suffix, how)(load_hf_config(hf_dir)))
                    load_hf_weights(neg, hf_dir)
                    res["negative"][control] = (name, last_stage_value(forward_logits(neg, ids, cu)))
            destroy_model_parallel(groups)
    # HF -> megatron (PP2) -> HF (TP2) through the conversion tools' own main().
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import convert_hf_to_mcore
    import convert_mcore_to_hf

    for name in ref:
        assert convert_hf_to_mcore.main(["--hf-dir", str(work / name), "--out", str(work / f"{name}_ckpt"),
                                         "--pp", "2"]) == 0
        assert convert_mcore_to_hf.main(["--ckpt", str(work / f"{name}_ckpt"), "--out", str(work / f"{name}_hf"),
                                         "--tp", "2"]) == 0
    if dist.get_rank() == 0:
        torch.save(res, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
